"""``FusedQKVGemm`` (``gpu`` marker, SM90 and SM100): against the reference on the same random batch.

The reference runs on a CPU copy of the batch (same seed). Q is written into a NaN-poisoned ``output``; the step's
K/V slots are poisoned too, so anything the kernel leaves unwritten shows; every slot outside them must keep
its bits.
"""

import pytest
import torch

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.ops.fused_qkv import plan
from cute_kv.ops.paths import device_arch
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.quant import expand_scales

from numerics import rel_err

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
CACHED = [0, 37, 5, 130, 1, 64]
NEW = [3, 1, 0, 17, 1, 90]
CASES = [  # (dtype, kv heads, q heads, D, page, hidden K, bias, rope: None or (R, interleaved, q_head_dim), MLA,
    #         qk_norm: None or (Q norm dims, K norm dims, weight offset))
    (torch.bfloat16, 2, 8, 128, 16, 256, False, None, False, None),
    (torch.bfloat16, 2, 8, 128, 64, 200, True, (128, False, None), False, None),  # ragged last k-tile, neox
    (torch.float16, 1, 4, 64, 128, 512, True, (32, True, None), False, None),  # partial GPT-J RoPE
    (torch.bfloat16, 4, 4, 64, 16, 128, False, (64, False, None), False, None),  # MHA, two heads per tile
    (torch.bfloat16, 1, 8, 576, 64, 256, False, (64, True, 192), True, None),  # MLA: latent head straddles tiles
    (torch.bfloat16, 2, 8, 128, 16, 256, True, (128, False, None), False, (128, 128, 0.0)),  # Qwen3 QK-norm
    (torch.bfloat16, 2, 4, 64, 16, 192, False, (64, True, None), False, (0, 64, 1.0)),  # Gemma-style K norm
    (torch.bfloat16, 2, 4, 64, 16, 192, False, (64, True, None), False, (48, 56, 0.0)),  # norms over part of a head
    (torch.bfloat16, 1, 8, 576, 64, 256, False, (64, True, 192), True, (0, 512, 0.0)),  # MLA latent norm
    (torch.bfloat16, 1, 8, 576, 16, 256, True, (64, True, 192), True, (0, 512, 1.0)),  # + bias, gamma offset
]



def _served(collection, hidden, weight, rope, qk_norm) -> bool:
    """Whether the device's kernel (not the reference) takes these arguments."""
    return plan(collection, hidden, weight, rope, device_arch(collection.device), qk_norm).path == "kernel"

def _inputs(case, cached, new, seed, **cache_kw):
    dtype, h, qh, d, p, k, with_bias, rope, mla, norm = case
    cache_kw = {"dtype": dtype, **cache_kw}
    batches = [random_paged_batch(cached, new, num_heads=h, head_size=d, page_size=p, num_layers=2, is_mla=mla,
                                  generator=torch.Generator().manual_seed(seed), device=dev, **cache_kw)
               for dev in ("cpu", "cuda")]
    for pb in batches:
        pb.collection.blocks[pb.step_mask(1)] = float("nan")
        if pb.collection.scales is not None:
            pb.collection.scales[pb.step_mask(1)] = float("nan")
    g = torch.Generator().manual_seed(seed + 1)
    q_head_dim = (rope[2] if rope else None) or d
    n_tot = qh * q_head_dim + (1 if mla else 2) * h * d
    t = sum(new)
    hidden = torch.randn(t, k, generator=g).to(dtype)
    weight = (torch.randn(n_tot, k, generator=g) / k**0.5).to(dtype)
    bias = torch.randn(n_tot, generator=g).to(dtype) if with_bias else None
    cfg = None
    if rope:
        cfg = RopeConfig.from_theta(rope[0], max(c + n for c, n in zip(cached, new)) + 1, interleaved=rope[1],
                                    q_head_dim=rope[2])
    qk_norm = None
    if norm:
        gamma = lambda c: torch.rand(c, generator=g) + 0.5 if c else None  # noqa: E731
        qk_norm = cute_kv.QKNorm(gamma(norm[0]), gamma(norm[1]), 1e-6, norm[2])
    return batches, hidden, weight, bias, cfg, qh * q_head_dim, qk_norm


def _run_case(case, cached, new, seed):
    from cute_kv.kernels.compile_cache import cache_info

    (cpu, gpu), hidden, weight, bias, rope, q_dim, qk_norm = _inputs(case, cached, new, seed)
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias,
                                         rope=rope, qk_norm=qk_norm)
    cuda = lambda x: None if x is None else x.cuda()  # noqa: E731
    norm = None if qk_norm is None else cute_kv.QKNorm(cuda(qk_norm.q_weight), cuda(qk_norm.k_weight),
                                                       qk_norm.epsilon, qk_norm.weight_offset)
    out = torch.full((hidden.shape[0], q_dim), float("nan"), dtype=hidden.dtype, device="cuda")
    compiles = cache_info()["compiles"]
    rope = None if rope is None else RopeConfig(rope.freqs_cis.cuda(), rope.interleaved, rope.q_head_dim)
    assert _served(gpu.collection, cuda(hidden), cuda(weight), rope, norm)
    got = cute_kv.fused_qkv_matmul_kv_cache(cuda(hidden), gpu.input_row_offsets, cuda(weight), gpu.collection, 1,
                                            output=out, bias=cuda(bias), rope=rope, qk_norm=norm)
    torch.cuda.synchronize()
    assert got is out and not out.isnan().any()
    assert cache_info()["compiles"] - compiles <= 1  # the kernel served the call (compiled at most once)
    tol = TOL[hidden.dtype]
    assert rel_err(out.cpu(), want) < tol
    step = cpu.step_mask(1)
    blocks, want_blocks = gpu.collection.blocks.cpu(), cpu.collection.blocks
    assert not blocks[step].isnan().any()
    assert rel_err(blocks[step], want_blocks[step]) < tol
    int_view = torch.int16
    assert torch.equal(blocks[~step].view(int_view), want_blocks[~step].view(int_view))
    return cache_info()["compiles"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{str(c[0])[6:]}-h{c[1]}-q{c[2]}-d{c[3]}-p{c[4]}-k{c[5]}"
                         f"{'-bias' * c[6]}{'-rope' + str(c[7][:2]) if c[7] else ''}{'-mla' * c[8]}"
                         f"{'-norm' + str(c[9]) if c[9] else ''}")
def test_fused_qkv_kernel_matches_reference(case):
    compiles = _run_case(case, CACHED, NEW, seed=3)
    from cute_kv.kernels.compile_cache import cache_info

    _run_case(case, CACHED, NEW, seed=4)  # same geometry: no recompile
    assert cache_info()["compiles"] == compiles


def test_fused_qkv_kernel_large_step_and_empty_step():
    case = CASES[1]
    _run_case(case, [7, 0, 300], [2500, 1, 40], seed=5)  # 128-row tiles, many of them
    (cpu, gpu), hidden, weight, bias, rope, q_dim, _ = _inputs(case, [4, 9], [0, 0], seed=6)
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, weight.cuda(), gpu.collection, 1)
    assert q.shape == (0, q_dim)


def test_fused_qkv_kernel_unchecked_step_past_the_pages():
    """``validate=False`` and a step running past request 0's page (sentinel columns, then past the table): every
    row's Q is written, K/V of rows on owned pages are stored, the others dropped, and nothing past the cache's N
    pages changes."""
    from test_store_kv_kernel import guarded_overrun

    (cpu, _, _), (_, gpu, guards) = (guarded_overrun((torch.bfloat16, 16, 2, 128, False), 5, dev)
                                     for dev in ("cpu", "cuda"))
    fit, run = cpu.new_lengths[0], 500
    g = torch.Generator().manual_seed(6)
    q_dim, k = 8 * 128, 256
    hidden = torch.randn(run + 1, k, generator=g).to(torch.bfloat16)
    weight = (torch.randn(q_dim + 2 * 2 * 128, k, generator=g) / k**0.5).to(torch.bfloat16)
    rows = torch.cat([torch.arange(fit), torch.tensor([run])])
    ref.fused_qkv_matmul_kv_cache(hidden[rows], cpu.input_row_offsets, weight, cpu.collection, 1)
    guard = guards[0][guards[0].shape[0] - 2:].clone()
    offsets = torch.tensor([0, run, run + 1], dtype=torch.uint32, device="cuda")
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), offsets, weight.cuda(), gpu, 1, validate=False)
    torch.cuda.synchronize()
    assert rel_err(q.cpu(), (hidden.float() @ weight.float().T)[:, :q_dim]) < TOL[torch.bfloat16]
    assert torch.equal(guards[0][guards[0].shape[0] - 2:].cpu().view(torch.int16), guard.cpu().view(torch.int16))
    step = cpu.step_mask(1)
    blocks, want = gpu.blocks.cpu(), cpu.collection.blocks
    assert rel_err(blocks[step], want[step]) < TOL[torch.bfloat16]
    assert torch.equal(blocks[~step].view(torch.int16), want[~step].view(torch.int16))


@pytest.mark.parametrize("granularity,scale_dtype", [(None, None), (32, torch.float32), (128, torch.float32),
                                                     (32, torch.float8_e8m0fnu), (8, torch.float8_e8m0fnu)])
def test_fused_qkv_kernel_fp8_cache(granularity, scale_dtype):
    """e4m3 cache: the kernel quantizes the float32 result once with its own per-granule scales (unscaled; float32
    over 4- and 16-lane granules; e8m0 over 4 lanes and over one lane's 8 dims)."""
    case = (torch.bfloat16, 2, 8, 128, 16, 256, True, (128, False, None), False, (128, 128, 0.0))
    kw = {"dtype": torch.float8_e4m3fn}
    if granularity:
        kw.update(scale_dtype=scale_dtype, quantization_granularity=granularity)
    (cpu, gpu), hidden, weight, bias, rope, q_dim, qk_norm = _inputs(case, CACHED, NEW, 7, **kw)
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias,
                                         rope=rope, qk_norm=qk_norm)
    norm = cute_kv.QKNorm(qk_norm.q_weight.cuda(), qk_norm.k_weight.cuda(), qk_norm.epsilon)
    rope = RopeConfig(rope.freqs_cis.cuda(), rope.interleaved)
    assert _served(gpu.collection, hidden.cuda(), weight.cuda(), rope, norm)
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, weight.cuda(), gpu.collection, 1,
                                          bias=bias.cuda(), rope=rope, qk_norm=norm)
    assert rel_err(q.cpu(), want) < TOL[torch.bfloat16]
    step = cpu.step_mask(1)
    c, w = gpu.collection, cpu.collection
    deq = lambda coll: coll.blocks.cpu().float() * (1 if coll.scales is None else expand_scales(  # noqa: E731
        coll.scales.cpu(), granularity, 128))
    assert not deq(c)[step].isnan().any()
    assert rel_err(deq(c)[step], deq(w)[step]) < 2.0**-4  # e4m3 rounding; scales agree to accumulation order
    assert torch.equal(c.blocks.cpu()[~step].view(torch.uint8), w.blocks[~step].view(torch.uint8))
    if granularity:
        bits = lambda scales: scales.cpu().view(torch.uint8 if scale_dtype == torch.float8_e8m0fnu  # noqa: E731
                                                else torch.int32)
        assert torch.equal(bits(c.scales)[~step], bits(w.scales)[~step])
        if scale_dtype == torch.float8_e8m0fnu:  # powers of two: at most one binade apart (accumulation order)
            assert (bits(c.scales)[step].int() - bits(w.scales)[step].int()).abs().max() <= 1


def test_fused_qkv_kernel_skips_rows_without_a_page():
    """validate=False with request 3's lookup entries past the pages: its rows get Q but store nothing (their
    slots keep the poison); every other row lands as the reference's."""
    case = CASES[5]
    (cpu, gpu), hidden, weight, bias, rope, q_dim, qk_norm = _inputs(case, CACHED, NEW, seed=8)
    lost = cpu.slots(3, CACHED[3], CACHED[3] + NEW[3])
    gpu.collection.lookup_table[3] = gpu.collection.num_pages + 7  # every entry of request 3: not a page
    before = gpu.collection.blocks.cpu()
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias,
                                         rope=rope, qk_norm=qk_norm)
    norm = cute_kv.QKNorm(qk_norm.q_weight.cuda(), qk_norm.k_weight.cuda(), qk_norm.epsilon)
    q = cute_kv.fused_qkv_matmul_kv_cache(
        hidden.cuda(), gpu.input_row_offsets, weight.cuda(), gpu.collection, 1, bias=bias.cuda(),
        rope=RopeConfig(rope.freqs_cis.cuda(), rope.interleaved), qk_norm=norm, validate=False)
    torch.cuda.synchronize()
    assert rel_err(q.cpu(), want) < TOL[torch.bfloat16]  # Q needs no page
    blocks = gpu.collection.blocks.cpu()
    step = cpu.step_mask(1)
    step[lost[0], :, 1, lost[1]] = False  # request 3's slots: never written
    assert rel_err(blocks[step], cpu.collection.blocks[step]) < TOL[torch.bfloat16]
    assert torch.equal(blocks[~step].view(torch.int16), before[~step].view(torch.int16))
