"""``PagedKVStore`` (``gpu`` marker): bit-exact against the reference store on the same random batch.

The reference runs on a CPU copy of the batch; the kernel on the GPU copy (same seed). The step's destination
slots are poisoned with NaN on both before the write, so an unwritten slot shows, and the whole cache is compared
bitwise, so a write outside the step's slots shows too.
"""

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import bits

pytestmark = pytest.mark.gpu

CACHED = [0, 37, 5, 130, 1, 63]
NEW = [3, 1, 0, 17, 1, 200]
CASES = [  # (dtype, page_size, num_heads, head_size, is_mla)
    (torch.bfloat16, 16, 8, 128, False),
    (torch.float16, 64, 3, 64, False),
    (torch.bfloat16, 128, 1, 256, False),
    (torch.float32, 16, 2, 128, False),
    (torch.bfloat16, 64, 1, 576, True),
]


def _pair(case, cached, new, seed):
    dtype, p, h, d, mla = case
    batches = [random_paged_batch(cached, new, num_heads=h, head_size=d, page_size=p, num_layers=3, is_mla=mla,
                                  dtype=dtype, generator=torch.Generator().manual_seed(seed), device=dev)
               for dev in ("cpu", "cuda")]
    g = torch.Generator().manual_seed(seed + 1)
    t = sum(new)
    # K and V as column slices of one [T, (2 + pad)*H*D] tensor, the way a QKV projection hands them over.
    wide = torch.randn(t, 3, h * d, generator=g).to(dtype)
    k, v = wide[:, 1].unflatten(1, (h, d)), None if mla else wide[:, 2].unflatten(1, (h, d))
    for pb in batches:
        pb.poison_unread(1)
        pb.collection.blocks[pb.step_mask(1)] = float("nan")
    return batches, k, v


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-p{c[1]}-h{c[2]}-d{c[3]}{'-mla' * c[4]}")
def test_store_kernel_matches_reference(case):
    from cute_kv.kernels.compile_cache import cache_info

    (cpu, gpu), k, v = _pair(case, CACHED, NEW, seed=7)
    ref.store_kv(k, v, cpu.input_row_offsets, cpu.collection, 1)
    before = cache_info()["compiles"]
    to = (lambda x: None if x is None else x.cuda())
    cute_kv.store_kv(to(k), to(v), gpu.input_row_offsets, gpu.collection, 1)
    torch.cuda.synchronize()
    got, want = gpu.collection.blocks.cpu(), cpu.collection.blocks
    assert torch.equal(bits(got), bits(want))
    assert not got[cpu.step_mask(1)].isnan().any()  # every poisoned step slot written
    assert torch.equal(gpu.collection.cache_lengths.cpu(), cpu.collection.cache_lengths)
    compiles = cache_info()["compiles"]
    assert compiles - before <= 1  # the first call of a geometry compiles; the same geometry again does not
    cute_kv.store_kv(to(k), to(v), gpu.input_row_offsets, gpu.collection, 1)
    assert cache_info()["compiles"] == compiles


def test_store_kernel_large_and_empty_steps():
    case = (torch.bfloat16, 16, 8, 128, False)
    for cached, new in (([5, 0, 3000], [4000, 1, 3]), ([4, 0], [0, 0])):  # many CTAs; no rows at all
        (cpu, gpu), k, v = _pair(case, cached, new, seed=11)
        ref.store_kv(k, v, cpu.input_row_offsets, cpu.collection, 1)
        cute_kv.store_kv(k.cuda(), v.cuda(), gpu.input_row_offsets, gpu.collection, 1)
        torch.cuda.synchronize()
        assert torch.equal(bits(gpu.collection.blocks.cpu()), bits(cpu.collection.blocks))


@pytest.mark.parametrize("in_dtype,granularity,heads,head_size", [(torch.bfloat16, 128, 8, 128),
                                                                  (torch.float32, 64, 1, 576),
                                                                  (torch.float16, 8, 2, 64)])
def test_store_kernel_fp8_quantizes_like_reference(in_dtype, granularity, heads, head_size):
    """Per-granule amax, scale = max(amax / 448, FLT_MIN), saturate(x / scale): the same bits as the reference."""
    batches = [random_paged_batch(CACHED, NEW, num_heads=heads, head_size=head_size, page_size=16, num_layers=2,
                                  is_mla=head_size == 576, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                                  quantization_granularity=granularity, generator=torch.Generator().manual_seed(5),
                                  device=dev) for dev in ("cpu", "cuda")]
    g = torch.Generator().manual_seed(6)
    shape = (sum(NEW), heads, head_size)
    # Mixed magnitudes, one all-zero granule (the scale floor) and values that saturate nothing.
    k = (torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0])[:, None, None]).to(in_dtype)
    k[0, 0, :granularity] = 0
    v = None if head_size == 576 else torch.randn(shape, generator=g).to(in_dtype)
    ref.store_kv(k, v, batches[0].input_row_offsets, batches[0].collection, 1)
    cute_kv.store_kv(k.cuda(), None if v is None else v.cuda(), batches[1].input_row_offsets, batches[1].collection, 1)
    torch.cuda.synchronize()
    for t in ("blocks", "scales"):
        got, want = _raw(getattr(batches[1].collection, t)).cpu(), _raw(getattr(batches[0].collection, t))
        assert torch.equal(bits(got), bits(want)), t


def guarded_overrun(case, seed, device, scale_dtype=None, granularity=None):
    """``(batch, collection, guards)``: request 0 owns one page, and ``collection`` is the batch's cache as the first
    N pages of a larger buffer (``guards``: the buffers, whose pages past N must keep their bits)."""
    dtype, p, h, d, mla = case
    pb = random_paged_batch([5, 40], [p - 5, 1], num_heads=h, head_size=d, page_size=p, num_layers=2, is_mla=mla,
                            dtype=dtype, scale_dtype=scale_dtype, quantization_granularity=granularity,
                            generator=torch.Generator().manual_seed(seed), device=device)
    c = pb.collection
    guards = [None if t is None else torch.cat([_raw(t), _raw(t[:2])]).view(t.dtype) for t in (c.blocks, c.scales)]
    n = c.blocks.shape[0]
    collection = cute_kv.PagedKVCacheCollection(
        guards[0][:n], c.cache_lengths, c.lookup_table, c.max_seq_length, c.max_cache_length,
        None if guards[1] is None else guards[1][:n], quantization_granularity=granularity)
    return pb, collection, guards


@pytest.mark.parametrize("fp8", [False, True])
def test_store_kernel_unchecked_step_past_the_pages(fp8):
    """``validate=False`` and a step running past request 0's page (lookup columns holding the sentinel N, then
    columns past the table): the rows on the owned page are stored as the reference stores them, the rest are
    dropped, and nothing past the cache's N pages (values or scales) changes."""
    case = (torch.bfloat16, 16, 2, 128, False)
    quant = {"scale_dtype": torch.float32, "granularity": 32} if fp8 else {}
    if fp8:
        case = (torch.float8_e4m3fn, *case[1:])
    (cpu, _, _), (_, gpu, guards) = (guarded_overrun(case, 3, dev, **quant) for dev in ("cpu", "cuda"))
    fit = cpu.new_lengths[0]
    run = 500  # past the lookup table's 24 columns too
    assert 5 + run > gpu.lookup_table.shape[1] * 16
    g = torch.Generator().manual_seed(4)
    k, v = (torch.randn(run + 1, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    rows = torch.cat([torch.arange(fit), torch.tensor([run])])
    ref.store_kv(k[rows], v[rows], cpu.input_row_offsets, cpu.collection, 1)
    before = [None if t is None else t[t.shape[0] - 2:].clone() for t in guards]
    offsets = torch.tensor([0, run, run + 1], dtype=torch.uint32, device="cuda")
    cute_kv.store_kv(k.cuda(), v.cuda(), offsets, gpu, 1, validate=False)
    torch.cuda.synchronize()
    for name, guard, old in zip(("blocks", "scales"), guards, before):
        if guard is not None:
            assert torch.equal(_raw(guard[guard.shape[0] - 2:]).cpu(), _raw(old).cpu()), name
            assert torch.equal(bits(_raw(getattr(gpu, name)).cpu()), bits(_raw(getattr(cpu.collection, name)))), name


def test_store_kernel_fp8_nan_and_inf_bits():
    """Granules holding NaN or +-inf: the same value and scale bits as the reference (NaN scale and values; an
    infinite scale with NaN where the infinity was)."""
    batches = [random_paged_batch(CACHED, NEW, num_heads=2, head_size=64, page_size=16, num_layers=2,
                                  dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, quantization_granularity=16,
                                  generator=torch.Generator().manual_seed(8), device=dev) for dev in ("cpu", "cuda")]
    g = torch.Generator().manual_seed(9)
    k, v = (torch.randn(sum(NEW), 2, 64, generator=g) for _ in range(2))
    k[0, 0, 3] = float("nan")
    k[1, 1, 20] = float("inf")
    k[2, 0, 40] = -float("inf")
    v[3, 1, 0:16] = float("nan")
    v[4, 0, 63] = float("inf")
    ref.store_kv(k, v, batches[0].input_row_offsets, batches[0].collection, 1)
    cute_kv.store_kv(k.cuda(), v.cuda(), batches[1].input_row_offsets, batches[1].collection, 1)
    torch.cuda.synchronize()
    for t in ("blocks", "scales"):
        got, want = _raw(getattr(batches[1].collection, t)).cpu(), _raw(getattr(batches[0].collection, t))
        assert torch.equal(bits(got), bits(want)), t
