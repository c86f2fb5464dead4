"""``PagedAttention`` (``gpu`` marker, SM90): against the float32 reference on the same random batch.

The reference runs on a CPU copy of the batch (same seed); an fp8 cache is dequantized by both (the kernel rounds the
dequantized values to the 16-bit MMA dtype, hence the same tolerance). Every slot attention must not read is NaN on both
copies (other layers, unowned pages, the unwritten tail of each last page), the output is NaN-poisoned before the
call, and the cache must keep its bits.
"""

import math

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.kernels.attention.config import BM, key_tile
from cute_kv.ops.splits import launch_shape
from cute_kv.reference.batch import random_paged_batch

from numerics import bits, rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Mixed step: fresh prefill, decode, empty request, prefill after a multi-page prefix, decode, a long prefill.
CACHED = [0, 37, 5, 130, 1, 300]
NEW = [3, 1, 0, 17, 1, 90]
FP8 = torch.float8_e4m3fn
CASES = [  # (dtype, kv heads, q heads, D, page[, fp8 cache: {scale dtype, granularity}])
    (torch.bfloat16, 8, 32, 128, 16),  # Llama-3-8B heads
    (torch.bfloat16, 2, 16, 128, 64),  # GQA 8
    (torch.float16, 4, 4, 64, 128),  # MHA, one page per tile
    (torch.bfloat16, 1, 4, 256, 16),  # head dim 256
    (torch.float16, 2, 8, 64, 32),
    (torch.bfloat16, 2, 8, 128, 16, {"scale_dtype": torch.float32, "quantization_granularity": 16}),
    (torch.float16, 1, 8, 256, 128, {"scale_dtype": torch.float32, "quantization_granularity": 256}),
    (torch.bfloat16, 2, 4, 64, 64, {}),  # fp8 without scales: a saturating cast
    (torch.bfloat16, 2, 8, 128, 64, {"scale_dtype": torch.float8_e8m0fnu, "quantization_granularity": 32}),
]


def _pair(case, cached, new, seed):
    dtype, h, hq, d, p, *fp8 = case
    cache = {"dtype": FP8, **fp8[0]} if fp8 else {"dtype": dtype}
    batches = [random_paged_batch(cached, new, num_heads=h, head_size=d, page_size=p, num_layers=2,
                                  generator=torch.Generator().manual_seed(seed), device=dev, **cache)
               for dev in ("cpu", "cuda")]
    for pb in batches:
        pb.poison_unread(1)
    q = torch.randn(sum(new), hq, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return batches, q


def _run(case, cached, new, seed, **kw):
    from cute_kv.kernels.compile_cache import cache_info

    (cpu, gpu), q = _pair(case, cached, new, seed)
    want = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 1, **kw)
    blocks = bits(gpu.collection.blocks).clone()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    compiles = cache_info()["compiles"]
    got = cute_kv.paged_attention(q.cuda(), gpu.input_row_offsets, gpu.collection, 1, out=out, **kw)
    torch.cuda.synchronize()
    assert got is out and not out.isnan().any()  # every row written, no stale (NaN) key or value reached it
    assert rel_err(out.cpu(), want) < TOL[q.dtype]
    assert torch.equal(bits(gpu.collection.blocks), blocks)
    assert cache_info()["compiles"] - compiles <= 2  # the kernel (and the split combine) served the call
    return cache_info()["compiles"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-h{c[1]}-q{c[2]}-d{c[3]}-p{c[4]}"
                         f"{'-fp8' + str(c[5].get('quantization_granularity', '')) if len(c) > 5 else ''}"
                         f"{'-e8m0' if len(c) > 5 and c[5].get('scale_dtype') == torch.float8_e8m0fnu else ''}")
def test_attention_kernel_matches_reference(case):
    from cute_kv.kernels.compile_cache import cache_info

    compiles = _run(case, CACHED, NEW, seed=3)
    _run(case, CACHED, NEW, seed=4)  # same geometry: no recompile
    assert cache_info()["compiles"] == compiles


@pytest.mark.parametrize("causal,window", [(False, None), (True, 1), (True, 40), (True, 129)])
def test_attention_kernel_masks(causal, window):
    _run(CASES[0], CACHED, NEW, seed=5, causal=causal, window=window, scale=0.2)


def test_attention_kernel_split_kv_decode():
    """One long context and few heads: the grid splits the keys (combine pass), one short request beside it."""
    cached, new = [20000, 3], [1, 2]
    (cpu, _), _ = _pair((torch.bfloat16, 2, 8, 128, 64), cached, new, seed=6)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launch_shape(cpu.collection, 8, sms, BM, key_tile(128), num_tokens=3)[1] > 1
    _run((torch.bfloat16, 2, 8, 128, 64), cached, new, seed=6)
    _run((torch.bfloat16, 2, 8, 128, 64), cached, new, seed=7, window=700)


@pytest.mark.parametrize("cached,new", [(CACHED, NEW), ([20000, 3], [1, 2])], ids=["mixed", "split-kv"])
@pytest.mark.parametrize("softcap,with_sinks", [(30.0, False), (None, True), (5.0, True)])
def test_attention_kernel_softcap_sinks_lse(cached, new, softcap, with_sinks):
    """Soft-cap, sinks and the natural-log lse from the kernel (and the combine, split) against the reference;
    the lse poisoned with NaN first and checked written."""
    case = (torch.bfloat16, 2, 8, 128, 64)
    (cpu, gpu), q = _pair(case, cached, new, seed=12)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(13)) * 3 if with_sinks else None
    kw = {"softcap": softcap, "sinks": sinks, "return_lse": True}
    want, want_lse = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 1, **kw)
    kw["sinks"] = None if sinks is None else sinks.cuda()
    out, lse = cute_kv.paged_attention(q.cuda(), gpu.input_row_offsets, gpu.collection, 1, **kw)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    assert rel_err(out.cpu(), want) < TOL[q.dtype]
    assert (lse.cpu() - want_lse).abs().max() < 2e-2


def test_attention_kernel_spec_decode_and_empty_step():
    _run(CASES[1], [400, 1000, 0], [4, 5, 1], seed=8)  # a few new tokens per request: packed rows span tokens
    (cpu, gpu), q = _pair(CASES[0], [4, 9], [0, 0], seed=9)
    out = cute_kv.paged_attention(q.cuda(), gpu.input_row_offsets, gpu.collection, 1)
    assert out.shape == (0, 32, 128)


def test_attention_kernel_strided_q_and_out():
    """q as a column slice of a fused QKV output and a strided ``out``: copied in and out, same numbers."""
    case = CASES[0]
    (cpu, gpu), q = _pair(case, CACHED, NEW, seed=10)
    want = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 1)
    wide = torch.randn(q.shape[0], 2 * q.shape[1] * q.shape[2], dtype=q.dtype, device="cuda")
    wide[:, 64:64 + q[0].numel()] = q.flatten(1).cuda()
    q_view = wide[:, 64:64 + q[0].numel()].unflatten(1, q.shape[1:])
    out = torch.full((q.shape[1], q.shape[0], q.shape[2]), float("nan"), dtype=q.dtype, device="cuda").transpose(0, 1)
    cute_kv.paged_attention(q_view, gpu.input_row_offsets, gpu.collection, 1, out=out)
    assert rel_err(out.cpu(), want) < TOL[q.dtype]


def test_dense_operand_matches_sdpa():
    """The same kernel over a contiguous ``[B, S, H, D]`` cache (``DenseMHAOperand``), against torch SDPA."""
    from cute_kv.kernels.compile_cache import compiled
    from cute_kv.kernels.attention.sm90 import PagedAttention

    b, s, h, hq, d = 3, 300, 2, 8, 128
    g = torch.Generator(device="cuda").manual_seed(11)
    # Requests s + 16 rows apart (a slice of a longer cache): the operand steps by stride[0], not by S.
    k, v = (torch.randn(b, s + 16, h, d, generator=g, device="cuda").to(torch.bfloat16)[:, :s] for _ in range(2))
    new = torch.tensor([1, 4, 7])
    cache_lengths = (s - new).to(torch.uint32).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)]).to(torch.uint32).cuda()
    q = torch.randn(int(new.sum()), hq, d, generator=g, device="cuda").to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    kernel = PagedAttention("bfloat16", hq, h, d, None)
    fn = compiled(("dense_attention_test", hq, h, d), lambda: (kernel, *kernel.fake_args()), "sm_90a")
    m_blocks = math.ceil(int(new.max()) * (hq // h) / BM)
    scratch = torch.empty(1, 1, hq, d, device="cuda"), torch.empty(1, 1, hq, device="cuda")
    fn(q, out, None, *scratch, None, k, v, offsets, cache_lengths, None, None, 0, m_blocks, 1, 1, 0, 1.0,
       math.log2(math.e) / math.sqrt(d))
    torch.cuda.synchronize()
    for i, n in enumerate(new.tolist()):
        rows = slice(int(offsets[i]), int(offsets[i]) + n)
        mask = torch.arange(s, device="cuda")[None, :] <= (s - n + torch.arange(n, device="cuda"))[:, None]
        want = torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(0, 1).float(), k[i].transpose(0, 1).float().repeat_interleave(hq // h, 0),
            v[i].transpose(0, 1).float().repeat_interleave(hq // h, 0), attn_mask=mask).transpose(0, 1)
        assert rel_err(out[rows].float(), want) < TOL[torch.bfloat16]


def test_attention_kernel_e8m0_bytes_0_and_255():
    """e8m0 scale bytes decode as torch decodes them: 0 is 2^-127 (that key's values vanish, the output stays
    finite), 255 is NaN (every query that sees that key gets NaN, as in the reference)."""
    from cute_kv.paged_cache import _raw

    case = CASES[8]
    (cpu, gpu), q = _pair(case, CACHED, NEW, seed=12)
    for pb in (cpu, gpu):
        scales = _raw(pb.collection.scales)
        page, slot = pb.slots(5, 7, 8)  # a key of request 5 (K and V of layer 1): byte 0
        scales[page, :, 1, slot] = 0
        page, slot = pb.slots(3, 1, 2)  # a key of request 3: byte 255
        scales[page, :, 1, slot] = 255
    want = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 1)
    got = cute_kv.paged_attention(q.cuda(), gpu.input_row_offsets, gpu.collection, 1).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
    finite = ~want.isnan()
    assert rel_err(got[finite], want[finite]) < TOL[q.dtype]
