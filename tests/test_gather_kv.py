"""``gather_kv``: the reference path on the CPU, the PagedKVGather kernel on a GPU (``gpu`` marker)."""

import pytest
import torch

import cute_kv
from cute_kv.reference.batch import random_paged_batch

CASES = [  # (cache_lengths, page_size, heads, head_dim, dtype)
    ((37, 0, 1, 64, 130), 16, 2, 64, torch.bfloat16),
    ((1, 200, 0), 64, 1, 128, torch.float16),
    ((129, 5), 128, 3, 256, torch.bfloat16),
    ((33, 17), 32, 8, 128, torch.bfloat16),
]


def _batch(case, device, seed=0, num_layers=3):
    lengths, p, h, d, dtype = case
    g = torch.Generator().manual_seed(seed)
    return random_paged_batch(lengths, [0] * len(lengths), num_heads=h, head_size=d, page_size=p, generator=g,
                              num_layers=num_layers, dtype=dtype, device=device)


def _check(batch, layer, kv, got, untouched):
    """Valid rows equal the cache (read through the page lists), the rest equals ``untouched``."""
    for b, length in enumerate(batch.cache_lengths):
        want, _ = batch.tokens(0 if kv == "k" else 1, layer, b, 0, length)
        assert torch.equal(got[b, :length], want)
        assert torch.equal(got[b, length:].view(torch.int16), untouched[b, length:].view(torch.int16))


def _run_cases(device):
    for i, case in enumerate(CASES):
        batch = _batch(case, device, seed=i)
        c = batch.collection
        blocks_before = c.blocks.clone()
        for layer, kv in ((0, "k"), (2, "v")):
            fresh = cute_kv.gather_kv(c, layer, kv=kv)
            _check(batch, layer, kv, fresh, torch.zeros_like(fresh))
            poisoned = torch.full_like(fresh, float("nan"))
            sentinel = poisoned.clone()
            assert cute_kv.gather_kv(c, layer, kv=kv, out=poisoned) is poisoned
            _check(batch, layer, kv, poisoned, sentinel)
        assert torch.equal(c.blocks, blocks_before)


def test_gather_kv_cpu():
    _run_cases("cpu")


def test_gather_kv_mla_and_errors():
    batch = _batch(((20, 3), 16, 1, 64, torch.bfloat16), "cpu")
    c = batch.collection
    with pytest.raises(ValueError, match="kv must be"):
        cute_kv.gather_kv(c, 0, kv="q")
    with pytest.raises(ValueError, match="layer_idx"):
        cute_kv.gather_kv(c, 3)
    with pytest.raises(TypeError, match="out must have dtype"):
        cute_kv.gather_kv(c, 0, out=torch.zeros(2, 20, 1, 64))
    with pytest.raises(ValueError, match="out must have shape"):
        cute_kv.gather_kv(c, 0, out=torch.zeros(2, 21, 1, 64, dtype=torch.bfloat16))
    c.lookup_table[0, 1] = c.num_pages  # request 0 (20 tokens) loses its second page
    out = torch.full((2, 20, 1, 64), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"lookup_table\[0, 1\]"):
        cute_kv.gather_kv(c, 0, out=out)
    assert bool((out == 7.0).all())  # nothing half-written


@pytest.mark.parametrize("scale_dtype,granularity", [(torch.float32, 16), (torch.float8_e8m0fnu, 64)])
def test_gather_kv_of_a_scaled_fp8_cache_is_dequantized(rng, scale_dtype, granularity):
    """The e4m3 bytes of a scaled cache mean nothing without their scales: float32 ``values * scale``, as
    attention reads them. An unscaled fp8 cache stays a copy of its e4m3 values (MAX's gather)."""
    lengths = (37, 0, 9)
    scaled = random_paged_batch(lengths, [0] * 3, num_heads=2, head_size=64, page_size=16, generator=rng,
                                dtype=torch.float8_e4m3fn, scale_dtype=scale_dtype,
                                quantization_granularity=granularity)
    out = cute_kv.gather_kv(scaled.collection, 1, kv="v")
    assert out.dtype == torch.float32 and out.shape == (3, 37, 2, 64)
    for b, length in enumerate(lengths):
        assert torch.equal(out[b, :length].double(), scaled.dense(1, 1, b, length))
        assert not out[b, length:].any()
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        cute_kv.gather_kv(scaled.collection, 1, out=torch.zeros(out.shape, dtype=torch.float8_e4m3fn))
    plain = random_paged_batch(lengths, [0] * 3, num_heads=2, head_size=64, page_size=16, generator=rng,
                               dtype=torch.float8_e4m3fn)
    raw = cute_kv.gather_kv(plain.collection, 0)
    assert raw.dtype == torch.float8_e4m3fn
    assert torch.equal(raw[0, :37].view(torch.uint8), plain.tokens(0, 0, 0, 0, 37)[0].view(torch.uint8))


@pytest.mark.gpu
def test_gather_kv_kernel_matches_cache_and_compiles_once():
    from cute_kv.kernels.compile_cache import cache_info

    start = cache_info()["compiles"]
    _run_cases("cuda")
    before = cache_info()["compiles"]
    assert before - start == len(CASES)  # every case went through the kernel, one compile per geometry
    _run_cases("cuda")  # same keys: no recompile
    assert cache_info()["compiles"] == before
    torch.cuda.synchronize()
