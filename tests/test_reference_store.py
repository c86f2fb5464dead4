"""Reference ragged KV store: exact placement through shuffled page tables, fp8 casts and per-granule quantization."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kv import reference as ref
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

FP8_MAX = 448.0
# Ragged mixed step: no cache + prefill, decode, empty request, long prefix (crosses pages) + odd prefill, decode.
CACHED = [0, 37, 5, 130, 1]
NEW = [3, 1, 0, 17, 1]


def _inputs(pb, gen, dtype, scale=1.0):
    c = pb.collection
    shape = (pb.total_rows, c.num_heads, c.head_size)
    k = (torch.randn(shape, generator=gen) * scale).to(dtype)
    v = None if c.is_mla else (torch.randn(shape, generator=gen) * scale).to(dtype)
    return k, v


def _snapshot(c):
    return _raw(c.blocks).clone(), None if c.scales is None else _raw(c.scales).clone(), c.cache_lengths.clone()


def _assert_only_step_written(pb, before, layer):
    """Bitwise: every slot outside this step's new tokens of ``layer`` (other layers, prefixes, spare pages) kept."""
    c, keep = pb.collection, ~pb.step_mask(layer)
    assert torch.equal(_raw(c.blocks)[keep], before[0][keep])
    if c.scales is not None:
        assert torch.equal(_raw(c.scales)[keep], before[1][keep])
    assert torch.equal(c.cache_lengths, before[2])


def _stored(pb, kv_idx, layer):
    """This step's stored ``(values, scales)`` concatenated over requests in row order."""
    parts = [pb.tokens(kv_idx, layer, b, cl, cl + n) for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths))]
    values = torch.cat([p[0] for p in parts])
    return values, None if parts[0][1] is None else torch.cat([p[1] for p in parts])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("is_mla", [False, True])
def test_store_places_every_token(rng, dtype, page_size, is_mla):
    pb = random_paged_batch(CACHED, NEW, num_heads=1 if is_mla else 3, head_size=16, page_size=page_size,
                            num_layers=3, is_mla=is_mla, dtype=dtype, generator=rng)
    k, v = _inputs(pb, rng, dtype)
    before = _snapshot(pb.collection)
    ref.store_kv(k, v, pb.input_row_offsets, pb.collection, 1)
    assert torch.equal(_stored(pb, 0, 1)[0], k)
    if not is_mla:
        assert torch.equal(_stored(pb, 1, 1)[0], v)
    _assert_only_step_written(pb, before, 1)


def _fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest e4m3: half an ulp (2^-4 relative) for normals, 2^-10 * scale in the subnormal range."""
    return x.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-30


def test_fp8_cache_without_scales_saturates(rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=16, page_size=16, dtype=torch.float8_e4m3fn,
                            generator=rng)
    k, v = _inputs(pb, rng, torch.bfloat16, scale=300.0)  # about a tenth of the values exceed 448
    before = _snapshot(pb.collection)
    ref.store_kv(k, v, pb.input_row_offsets, pb.collection, 0)
    for kv_idx, x in ((0, k), (1, v)):
        got = _stored(pb, kv_idx, 0)[0].to(torch.float64)
        x = x.to(torch.float64)
        big = x.abs() > FP8_MAX
        assert big.any() and not got.isnan().any()
        assert torch.equal(got[big], FP8_MAX * x[big].sign())
        assert ((got - x)[~big].abs() <= _fp8_error_bound(x[~big], torch.tensor(1.0))).all()
    _assert_only_step_written(pb, before, 0)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
@pytest.mark.parametrize("head_size,gran", [(32, 32), (32, 16), (48, 32)])  # one, two, and a ragged last granule
@pytest.mark.parametrize("page_size", [16, 64])
def test_fp8_quantized_store(rng, scale_dtype, head_size, gran, page_size):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=head_size, page_size=page_size,
                            dtype=torch.float8_e4m3fn, scale_dtype=scale_dtype, quantization_granularity=gran,
                            generator=rng)
    k, v = _inputs(pb, rng, torch.bfloat16, scale=3.0)
    k[2, 1, :gran] = 0  # an all-zero granule must not divide by zero
    before = _snapshot(pb.collection)
    ref.store_kv(k, v, pb.input_row_offsets, pb.collection, 1)
    g = math.ceil(head_size / gran)
    for kv_idx, x in ((0, k), (1, v)):
        q, s = _stored(pb, kv_idx, 1)
        x = x.to(torch.float64)
        s = s.to(torch.float64)
        assert s.shape == (x.shape[0], 2, g) and torch.isfinite(s).all() and (s > 0).all()
        padded = torch.nn.functional.pad(x.abs(), (0, g * gran - head_size))
        amax = padded.unflatten(-1, (g, gran)).amax(-1)
        live = amax > 0
        if scale_dtype == torch.float32:
            torch.testing.assert_close(s[live], amax[live] / FP8_MAX, rtol=1e-6, atol=0)
        else:  # the smallest power of two that keeps amax / scale within the fp8 range
            assert torch.equal(torch.exp2(torch.log2(s).round()), s)
            ratio = amax[live] / s[live]
            assert (ratio <= FP8_MAX).all() and (ratio > FP8_MAX / 2).all()
        s_el = s.repeat_interleave(gran, -1)[..., :head_size]
        deq = q.to(torch.float64) * s_el
        assert ((deq - x).abs() <= _fp8_error_bound(x, s_el)).all()
        if kv_idx == 0:
            assert (deq[2, 1, :gran] == 0).all()
    _assert_only_step_written(pb, before, 1)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_quantize_fp8_range_edges(scale_dtype):
    x = torch.tensor([[448.0, -3.0], [-448.5, 1.0], [1e-30, -2e-30], [0.0, 0.0]])
    q, s = ref.quantize_fp8(x, 2, scale_dtype)
    assert s.dtype == scale_dtype and s.shape == (4, 1)
    qf, sf = q.to(torch.float32), s.to(torch.float32)
    assert torch.isfinite(qf).all() and torch.isfinite(sf).all() and (sf > 0).all()
    assert sf[0, 0] == 1.0 and qf[0, 0] == FP8_MAX  # amax = FP8_MAX is an exact unit scale for both dtypes
    # amax 448.5: a float32 scale saturates nothing; e8m0 rounds the scale up to 2, so 448.5 -> 224.25 -> 224
    assert qf[1].abs().max() == (FP8_MAX if scale_dtype == torch.float32 else 224.0)
    torch.testing.assert_close(qf[2] * sf[2], x[2], rtol=0.07, atol=0)  # tiny values survive
    assert (qf[3] == 0).all()


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=5),
    page_size=st.sampled_from([16, 64, 128]),
    is_mla=st.booleans(),
    layer=st.integers(0, 1),
    seed=st.integers(0, 2**31),
)
def test_store_random_steps(lengths, page_size, is_mla, layer, seed):
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    pb = random_paged_batch(cached, new, num_heads=1 if is_mla else 2, head_size=8, page_size=page_size,
                            is_mla=is_mla, generator=gen)
    k, v = _inputs(pb, gen, torch.bfloat16)
    before = _snapshot(pb.collection)
    ref.store_kv(k, v, pb.input_row_offsets, pb.collection, layer)
    assert torch.equal(_stored(pb, 0, layer)[0], k)
    if not is_mla:
        assert torch.equal(_stored(pb, 1, layer)[0], v)
    _assert_only_step_written(pb, before, layer)


def test_quantize_fp8_nan_and_inf_bits():
    """NaN and infinity as a kernel's float32 arithmetic gives them, whichever device runs the reference: a NaN
    makes its granule's scale the canonical NaN and its values NaN (the positive e4m3 NaN 0x7F); an infinity makes
    the scale infinite, NaN where it was (inf/inf) and signed zeros elsewhere."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, 2.0, nan, 3.0], [1.0, -2.0, inf, 3.0], [-inf, -2.0, 5.0, 3.0], [-nan, 1.0, 1.0, 1.0]])
    q, s = ref.quantize_fp8(x, 4)
    assert q.view(torch.uint8).tolist() == [[0x7F] * 4, [0x00, 0x80, 0x7F, 0x00], [0x7F, 0x80, 0x00, 0x00],
                                            [0x7F] * 4]
    assert s.view(torch.int32).flatten().tolist() == [0x7FFFFFFF, 0x7F800000, 0x7F800000, 0x7FFFFFFF]
    q8, s8 = ref.quantize_fp8(x, 4, torch.float8_e8m0fnu)  # e8m0 has no infinity: its largest scale, 2^127
    assert s8.view(torch.uint8).flatten().tolist() == [0xFF, 0xFE, 0xFE, 0xFF]
    assert q8.view(torch.uint8)[0].tolist() == [0x7F] * 4 and q8.view(torch.uint8)[1, 2] == 0x7E
    assert ref.saturating_cast_fp8(torch.tensor([-nan, inf, -1e9])).view(torch.uint8).tolist() == [0x7F, 0x7E, 0xFE]


def test_quantize_fp8_divides_by_tensors():
    """CUDA torch divides by a Python scalar as a multiply by its reciprocal (other bits than a kernel's division):
    the reference divides by tensors only, so CPU and CUDA give the same bits."""
    from torch.overrides import TorchFunctionMode

    divisions = (torch.div, torch.true_divide, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__)

    class ScalarDivisors(TorchFunctionMode):
        found = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in divisions and not isinstance(args[1], torch.Tensor):
                self.found.append(args[1])
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 2, 64)
    for scale_dtype in (torch.float32, torch.float8_e8m0fnu):
        with ScalarDivisors() as mode:
            ref.quantize_fp8(x, 32, scale_dtype)
        assert mode.found == []
