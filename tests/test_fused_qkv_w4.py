"""``FusedQKVGemmW4``: quantized weights decoded in the SM90 mainloop.

On the CPU: a replay of the kernel's decode from the repacked bytes (which thread reads which word, which nibble of
it is which weight, which strip word holds its group scale and zero point) reproduces the reference's dequantized
bf16 weight bit for bit; ``plan`` routes each format to its compile key or names why not; the kernel compiles for
sm_90a with quack's W4 mainloop unchanged and our epilogue, no spills. On a GPU (``gpu`` marker): the op against
the reference on a random ragged step (sm_90a, or sm_100a's ``FusedQKVGemmW4Sm100``: ``test_fused_qkv_w4_sm100.py``).
"""

import functools
import os
import re
import sys

import pytest
import torch

import artifacts

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.dtypes import is_fp8
from cute_kv.ops.fused_qkv import plan
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns
from cute_kv.reference.quant import expand_scales
from cute_kv.reference.weights import dequantize

from numerics import rel_err

pytest.importorskip("quack")
from cute_kv.kernels.qkv.gemm import QKVSpec  # noqa: E402
from cute_kv.kernels.qkv.w4 import BN, FusedQKVGemmW4, QKVW4Spec, prepare_weight  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf"))
from static_fused_qkv import bare_w4_ptx  # noqa: E402


def _int4(rng, n, k, group, has_zp=False, scale_dtype=torch.bfloat16):
    packed = torch.randint(0, 256, (n, k // 2), generator=rng, dtype=torch.uint8)
    # both signs, magnitudes over many binades: products round differently from row to row
    scales = (torch.randn(n, k // group, generator=rng) * torch.exp2(torch.randint(-12, 2, (n, k // group),
                                                                                   generator=rng).float()))
    zp = torch.randint(0, 16, (n, k // group), generator=rng, dtype=torch.uint8) if has_zp else None
    return cute_kv.Int4Weight(packed, scales.to(scale_dtype), group, has_zp, zp)


def _fp8(rng, n, k):
    return cute_kv.Fp8Weight((torch.randn(n, k, generator=rng) * 50).to(torch.float8_e4m3fn),
                             torch.rand(n, generator=rng) * 0.01 + 1e-4)


# -- replay of the decode ------------------------------------------------------------------------------------------

def _fragment_coords():
    """``(row, k)`` within an (m64 block, 64-deep k-tile) of every value thread ``t`` decodes from its words.

    A WGMMA m64k16 A fragment: thread ``t`` (warp ``t // 32``, lane ``l``) holds rows ``16 * warp + l // 4 + 8 * v1``
    and k ``2 * (l % 4) + 8 * v2 + e`` of k16 block ``b``, as 4 bf16x2 registers in slot order
    ``j = v1 + 2 * v2`` (``e``: the pair's low/high half)."""
    t = torch.arange(128)[:, None, None, None]
    b = torch.arange(4)[None, :, None, None]
    j = torch.arange(4)[None, None, :, None]
    e = torch.arange(2)[None, None, None, :]
    row = 16 * (t // 32) + (t % 32) // 4 + 8 * (j % 2)
    k = 16 * b + 2 * (t % 4) + 8 * (j // 2) + e
    return row.expand(128, 4, 4, 2), k.expand(128, 4, 4, 2)


def _replay(fmt: str, blob: torch.Tensor, sf, n_pad: int, k: int) -> torch.Tensor:
    """The dequantized weight ``[n_pad, k]`` as the kernel's decode builds it (bf16; e4m3 values unscaled).

    int4 (``decode_u4b8x8_to_bf16x8`` / ``decode_u4x8_to_magicx8``): thread ``t``'s word ``b`` of a block holds the
    k16 block ``b``; register ``j`` is nibbles ``(j, j + 4)`` of the word (``(w >> 4j) & 0x000F000F``), the low and
    high k of the pair. Its value is ``code - 8`` (symmetric) or ``code - z`` (zero points, ``c = -(128 + z)`` in
    the strip's second word), times the row's scale from strip word ``pair_slot = 8 * warp + lane // 4``, whose
    low half serves row ``r`` and high half row ``r + 8`` (``v1``): one bf16 multiply, rounded once.
    e4m3 (``decode_e4m3x4_to_bf16x4``): words ``2b`` and ``2b + 1`` hold block ``b``'s bytes, two per register.
    """
    g, kt = n_pad // 64, k // 64
    rows, ks = _fragment_coords()
    t = torch.arange(128)[:, None, None, None].expand_as(rows)
    b = torch.arange(4)[None, :, None, None].expand_as(rows)
    j = torch.arange(4)[None, None, :, None].expand_as(rows)
    e = torch.arange(2)[None, None, None, :].expand_as(rows)
    out = torch.empty(n_pad, k, dtype=torch.bfloat16)
    if fmt == "fp8":
        byte = blob.view(g, kt, 128, 32)  # 8 words: block b's register j in bytes 8b + 2j + e
        vals = byte[:, :, t, 8 * b + 2 * j + e].view(torch.float8_e4m3fn).to(torch.bfloat16)
    else:
        words = blob.view(g, kt, 128, 16).view(torch.int32)  # (g, kt, t, b)
        w = words[:, :, t, b]
        code = (w >> (4 * j + 16 * e)) & 0xF
        strip = sf.view(torch.int16).reshape(g, kt, 32, -1, 2)  # (.., slot, word, bf16 half)
        slot = 8 * (t // 32) + (t % 32) // 4
        word = (b // 2) if fmt == "int4_g32" else torch.zeros_like(b)
        scale = strip[:, :, slot, word, j % 2].view(torch.bfloat16)  # half v1 = j % 2: row r or r + 8
        if fmt == "int4awq":
            bias = strip[:, :, slot, 1, j % 2].view(torch.bfloat16).float()  # -(128 + z)
            q = (128 + code).float() + bias  # HADD2(magic, c): exact
        else:
            q = code.float() - 8  # magic - 136: exact
        vals = (q * scale.float()).to(torch.bfloat16)  # mul.rn.bf16x2: the exact product rounded once
    grow = 64 * torch.arange(g)[:, None, None, None, None, None] + rows
    gk = 64 * torch.arange(kt)[None, :, None, None, None, None] + ks
    out[grow.expand(g, kt, *rows.shape), gk.expand(g, kt, *rows.shape)] = vals
    return out


REPLAY_CASES = {  # name: (format, weight maker)
    "int4-g128": ("int4", lambda rng, n, k: _int4(rng, n, k, 128)),
    "int4-g64": ("int4_g64", lambda rng, n, k: _int4(rng, n, k, 64)),
    "int4-g32": ("int4_g32", lambda rng, n, k: _int4(rng, n, k, 32)),
    "int4-zp-g128": ("int4awq", lambda rng, n, k: _int4(rng, n, k, 128, has_zp=True)),
    "fp8": ("fp8", _fp8),
}


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_decode_replay_matches_reference(rng, case):
    fmt, make = REPLAY_CASES[case]
    n, k = 200, 384  # rows padded to 256; k-tiles across several groups
    weight = make(rng, n, k)
    assert plan_format(weight) == fmt
    blob, sf, col_scales = prepare_weight(weight)
    n_pad = -(-n // BN) * BN
    got = _replay(fmt, blob, sf, n_pad, k)
    if fmt == "fp8":  # values exact, the scale applied to the accumulator column
        assert torch.equal(got[:n].float(), weight.weight.float())
        assert torch.equal(col_scales[:n], weight.scales) and torch.equal(col_scales[n:], torch.ones(n_pad - n))
    else:
        want = dequantize(weight, torch.bfloat16).to(torch.bfloat16)
        assert torch.equal(got[:n].view(torch.int16), want.view(torch.int16))  # bit for bit, signed zeros too
        assert col_scales is None
    assert not got[n:].float().any()  # padding rows decode to zero


def test_replay_sees_a_wrong_nibble_order(rng):
    """The replay is sensitive to the packing: the same codes with nibbles swapped decode to another weight."""
    weight = _int4(rng, 128, 128, 128)
    swapped = cute_kv.Int4Weight((weight.packed >> 4) | (weight.packed << 4), weight.scales, 128)
    blob, sf, _ = prepare_weight(swapped)
    want = dequantize(weight, torch.bfloat16).to(torch.bfloat16)
    assert not torch.equal(_replay("int4", blob, sf, 128, 128), want)


def test_int4_rounding_is_one_bf16_rounding():
    """``(q - z) * s`` exact in float32, then rounded once to bf16 (not rounded through another format)."""
    s = torch.tensor([[1.0 + 2**-7]], dtype=torch.bfloat16)  # 7 * s needs 10 significant bits
    packed = torch.tensor([[0x0F]], dtype=torch.uint8)  # k = 0: code 15 (q - 8 = 7); k = 1: code 0 (-8)
    w = cute_kv.Int4Weight(packed, s, 2)
    got = dequantize(w, torch.bfloat16)
    assert got.tolist() == [[float(torch.tensor(7 * (1 + 2**-7)).to(torch.bfloat16)), -8 * (1 + 2**-7)]]
    assert dequantize(w).tolist() == [[7 * (1 + 2**-7), -8 * (1 + 2**-7)]]  # float32 activations: unrounded


def test_prepared_weight_is_reused_until_changed(rng):
    w = _int4(rng, 128, 128, 64)
    first = prepare_weight(w)
    assert prepare_weight(cute_kv.Int4Weight(w.packed, w.scales, 64)) is first  # a traced step's fresh wrapper
    w.scales.mul_(2)  # changed in place: repacked
    again = prepare_weight(w)
    assert again is not first and not torch.equal(again[1], first[1])
    other = cute_kv.Int4Weight(w.packed, w.scales.clone(), 64)  # other scale tensor: repacked
    assert prepare_weight(other) is not again


# -- plan ------------------------------------------------------------------------------------------------------------

def _plan(rng, weight, *, arch="sm_90a", dtype=torch.bfloat16, k=256, rope=None, **cache_kw):
    pb = random_paged_batch([3, 0], [2, 5], num_heads=8, head_size=128, page_size=16, generator=rng,
                            **{"dtype": dtype, **cache_kw})
    act = torch.bfloat16 if is_fp8(dtype) else dtype
    return plan(pb.collection, torch.zeros(pb.total_rows, k, dtype=act), weight, rope, arch)


N_TOT = 4096 + 2 * 8 * 128


def plan_format(weight):
    """The decode format ``plan`` picks for a weight, on a Llama-shaped step."""
    k = weight.shape[1]
    pb = random_paged_batch([1], [2], num_heads=8, head_size=128, page_size=16, dtype=torch.bfloat16,
                            generator=torch.Generator().manual_seed(0))
    big = cute_kv.Int4Weight(torch.zeros(N_TOT, k // 2, dtype=torch.uint8), torch.zeros(
        N_TOT, weight.scales.shape[1], dtype=weight.scales.dtype), weight.group_size, weight.has_zp, None if not
        weight.has_zp else torch.zeros(N_TOT, weight.scales.shape[1], dtype=torch.uint8)) if hasattr(
        weight, "packed") else cute_kv.Fp8Weight(torch.zeros(N_TOT, k, dtype=torch.float8_e4m3fn),
                                                 torch.ones(N_TOT))
    path = plan(pb.collection, torch.zeros(pb.total_rows, k, dtype=torch.bfloat16), big, None, "sm_90a")
    return path.key.weight_format if path.path == "kernel" else path.reason


def test_plan_routes_quantized_weights(rng):
    keys = {}
    for name, (fmt, make) in REPLAY_CASES.items():
        path = _plan(rng, make(rng, N_TOT, 256), rope=RopeConfig.from_theta(128, 64))
        assert (path.path, path.kernel) == ("kernel", "FusedQKVGemmW4"), path
        assert path.key.weight_format == fmt and path.key.qkv.rope == (128, False) and path.key.qkv.q_dim == 4096
        keys[name] = path.key
    assert len(set(keys.values())) == len(keys)  # format, group size and zero points each a compile key
    fp8_cache = _plan(rng, _int4(rng, N_TOT, 256, 128), dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                      quantization_granularity=64)
    assert fp8_cache.key.qkv.fp8 and fp8_cache.key.qkv.granularity == 64
    e8m0_cache = _plan(rng, _int4(rng, N_TOT, 256, 128), dtype=torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu)
    assert e8m0_cache.key.qkv.e8m0  # the bf16 kernel's cache rules hold: its epilogue stores e8m0 bytes


@pytest.mark.parametrize("weight, kw, words", [
    (lambda rng: _int4(rng, N_TOT, 256, 128), {"arch": "sm_80"}, "sm_90a, sm_100a, sm_103a's"),
    (lambda rng: _int4(rng, N_TOT, 256, 128), {"dtype": torch.float16}, "hidden is float16"),
    (lambda rng: _int4(rng, N_TOT, 256, 128, scale_dtype=torch.float32), {}, "bf16 scales"),
    (lambda rng: _int4(rng, N_TOT, 256, 64, has_zp=True), {}, "groups [128]"),
    (lambda rng: _int4(rng, N_TOT, 384, 96), {"k": 384}, "group_size 96"),
    (lambda rng: _int4(rng, N_TOT, 96, 32), {"k": 96}, "multiple of 64"),
])
def test_plan_names_why_the_reference_runs(rng, weight, kw, words):
    path = _plan(rng, weight(rng), **kw)
    assert path.path == "reference" and words in path.reason, path


def test_explain_names_the_w4_kernel(rng):
    pb = random_paged_batch([3, 0], [2, 5], num_heads=8, head_size=128, page_size=16, dtype=torch.bfloat16,
                            generator=rng)
    w = _int4(rng, 4096 + kv_columns(pb.collection), 256, 128, has_zp=True)
    path = cute_kv.explain(cute_kv.fused_qkv_matmul_kv_cache, torch.zeros(pb.total_rows, 256, dtype=torch.bfloat16),
                           pb.input_row_offsets, w, pb.collection, 0, arch="sm_90a")
    assert (path.kernel, path.key.weight_format) == ("FusedQKVGemmW4", "int4awq")


def test_w4_kernel_rejects_what_it_cannot_decode():
    spec = QKVSpec("bfloat16", 4096, 2, 16, 8, 128, 128, False, None)
    with pytest.raises(ValueError, match="weight_format"):
        FusedQKVGemmW4(QKVW4Spec(spec, "nvfp4"))
    with pytest.raises(ValueError, match="bfloat16"):
        FusedQKVGemmW4(QKVW4Spec(QKVSpec("float16", 4096, 2, 16, 8, 128, 128, False, None), "int4"))
    with pytest.raises(ValueError, match="targets sm_90a"):
        FusedQKVGemmW4(QKVW4Spec(spec, "int4"), "sm_100a")


# -- compiled for sm_90a ---------------------------------------------------------------------------------------------

# (format, QKVSpec fields: dtype, q_dim, KVD, P, H, D, q_head_dim, bias, rope, q/k norm dims[, fp8 granularity])
COMPILE_CASES = {
    "int4-llama-neox": ("int4", ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0)),
    "int4zp-qwen3-bias-qknorm": ("int4awq", ("bfloat16", 4096, 2, 64, 8, 128, 128, True, (128, False), 128, 128)),
    "int4g32-fp8cache-g64": ("int4_g32", ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0, 64)),
    "fp8-gptj-partial": ("fp8", ("bfloat16", 512, 2, 128, 2, 64, 64, True, (32, True), 0, 0)),
    # [, fp8 granularity, e8m0, cross_dims, rope_tail]: MLA's latent norm, finished by the last arriving tile
    "int4-mla-latent-norm": ("int4", ("bfloat16", 1536, 1, 64, 1, 576, 192, False, (64, True), 0, 512, 0, False,
                                      512, 0)),
    # Gemma 3 GPTQ: QK-norm and neox over heads of 256, finished by the last of a head's tiles to arrive
    "int4-gemma3-wide-heads": ("int4", ("bfloat16", 4096, 2, 16, 8, 256, 256, False, (256, False), 256, 256)),
}
WGMMA_RS = r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16"


def _w4(case) -> FusedQKVGemmW4:
    fmt, c = COMPILE_CASES[case]
    extra = dict(zip(("granularity", "e8m0", "cross_dims", "rope_tail"), c[11:]))
    return FusedQKVGemmW4(QKVW4Spec(QKVSpec(*c[:9], q_norm_dim=c[9], k_norm_dim=c[10],
                                            fp8=bool(extra.get("granularity") or extra.get("rope_tail")), **extra),
                                    fmt))


@functools.lru_cache(maxsize=None)
def _ptx(case):
    return artifacts.compiled(_w4(case), "sm_90a").ptx


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES)
def test_fused_qkv_w4_ptx(case, tmp_path):
    from test_fused_qkv_gemm import ptxas_report

    kernel = _w4(case)
    ptx, bare = _ptx(case), bare_w4_ptx(kernel.spec.weight_format)[0]
    # quack's W4 mainloop, unchanged: the same register-A wgmma and the same decode instructions
    assert len(re.findall(WGMMA_RS, ptx)) == len(re.findall(WGMMA_RS, bare)) > 0
    assert re.search(WGMMA_RS + r"\s+\{[^}]*\},\s*\{%r\d+, %r\d+, %r\d+, %r\d+\}", ptx)  # A from registers
    for decode in ("mul.rn.bf16x2", "add.rn.bf16x2", "cvt.rn.f16x2.e4m3x2"):  # the decode's own instructions
        assert ptx.count(decode) == bare.count(decode), decode
    assert ptx.count("mul.rn.bf16x2") == (0 if kernel.spec.column_scales else 48)  # 3 k-tile bodies x 16
    # no D: nothing leaves through TMA; Q and K/V rows as the bf16 kernel's 16-byte (fp8 cache: 8-byte) stores
    assert "cp.async.bulk.tensor.2d.global.shared" not in ptx and "bulk_group" not in ptx
    stores = ["st.global.v4.b32", "st.global.v4.b32"]
    if kernel.spec.qkv.fp8:
        stores = ["st.global.v2.b32", "st.global.v4.b32", "st.global.b32"]
    if kernel.spec.qkv.last_arriver:  # the arrival and finish (test_fused_qkv_latent.py, test_fused_qkv_wide.py)
        assert re.findall(r"atom\.\S+", ptx) == ["atom.global.acq_rel.add.u32", "atom.global.exch.b32"]
        assert ptx.count("fence.acq_rel.gpu") == 2
    else:
        assert sorted(re.findall(r"st\.global\.\S+", ptx)) == sorted(stores)
    report = ptxas_report(ptx, "sm_90a", tmp_path)
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"]
    assert "0 bytes stack frame" in report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 168  # 384 threads, one CTA per SM


@pytest.mark.parametrize("case", ["int4-llama-neox", "int4-mla-latent-norm"])
def test_epilogue_smem_has_a_thread_word_per_epilogue_thread(case):
    """quack's W4 GEMM is cooperative: both MMA warpgroups (256 threads) run the epilogue, and each stores its
    index to ``s_thread[tidx]``; the array (and the budget quack sizes the stages with) must hold all of them, not
    the 128 of one warpgroup (which wrote past it, over the latent's ``s_last``)."""
    gemm = _w4(case).gemm()
    threads = gemm.num_epi_warps * 32
    assert threads == 256
    struct = gemm.epi_get_smem_struct(None)
    after = [o for name, o in struct._offsets.items() if name != "s_thread" and o > struct._offsets["s_thread"]]
    end = min(after, default=struct.size_in_bytes())
    assert end - struct._offsets["s_thread"] >= 4 * threads
    assert type(gemm).epi_smem_bytes(None, gemm.cta_tile_shape_mnk, None).unstaged >= struct.size_in_bytes()



# -- on a GPU --------------------------------------------------------------------------------------------------------

GPU_CASES = {  # name: (weight maker (rng, n, k), test_fused_qkv_kernel case, cache kwargs)
    "int4-g128-neox": (lambda rng, n, k: _int4(rng, n, k, 128),
                       (torch.bfloat16, 2, 8, 128, 64, 256, True, (128, False, None), False, None), {}),
    "int4-zp-qknorm": (lambda rng, n, k: _int4(rng, n, k, 128, has_zp=True),
                       (torch.bfloat16, 2, 8, 128, 16, 256, True, (128, False, None), False, (128, 128, 0.0)), {}),
    "int4-g32-mla": (lambda rng, n, k: _int4(rng, n, k, 32),
                     (torch.bfloat16, 1, 8, 576, 64, 192, False, (64, True, 192), True, None), {}),
    "int4-g64-fp8-cache": (lambda rng, n, k: _int4(rng, n, k, 64),
                           (torch.bfloat16, 2, 8, 128, 16, 320, False, (128, False, None), False, None),
                           {"dtype": torch.float8_e4m3fn, "scale_dtype": torch.float32,
                            "quantization_granularity": 64}),
    "fp8-gptj": (_fp8, (torch.bfloat16, 4, 4, 64, 16, 128, True, (64, True, None), False, None), {}),
    "int4-g128-mla-latent-norm": (lambda rng, n, k: _int4(rng, n, k, 128),
                                  (torch.bfloat16, 1, 8, 576, 64, 256, False, (64, True, 192), True, (0, 512, 0.0)),
                                  {}),
    # heads of 256 with QK-norm and neox (Gemma 3): finished by the last of a head's two tiles
    "int4-g128-wide-heads": (lambda rng, n, k: _int4(rng, n, k, 128),
                             (torch.bfloat16, 2, 4, 256, 16, 256, False, (256, False, None), False, (256, 256, 1.0)),
                             {}),
}


def _cuda_weight(w):
    if isinstance(w, cute_kv.Fp8Weight):
        return cute_kv.Fp8Weight(w.weight.cuda(), w.scales.cuda())
    return cute_kv.Int4Weight(w.packed.cuda(), w.scales.cuda(), w.group_size, w.has_zp,
                              None if w.zero_points is None else w.zero_points.cuda())


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_fused_qkv_w4_matches_reference(case):
    from test_fused_qkv_kernel import CACHED, NEW, _inputs

    from cute_kv.kernels.compile_cache import cache_info
    from cute_kv.ops.paths import device_arch

    arch = device_arch(torch.device("cuda"))
    kernels = {"sm_90a": "FusedQKVGemmW4", "sm_100a": "FusedQKVGemmW4Sm100"}
    if arch not in kernels:
        pytest.skip("the W4 mainloops are SM90's and SM100's")
    make, kcase, cache_kw = GPU_CASES[case]
    for seed in (3, 4):  # same geometry twice: compiled once
        (cpu, gpu), hidden, dense, bias, rope, q_dim, qk_norm = _inputs(kcase, CACHED, NEW, seed, **cache_kw)
        weight = make(torch.Generator().manual_seed(seed), *dense.shape)
        want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias,
                                             rope=rope, qk_norm=qk_norm)
        cuda = lambda x: None if x is None else x.cuda()  # noqa: E731
        norm = None if qk_norm is None else cute_kv.QKNorm(cuda(qk_norm.q_weight), cuda(qk_norm.k_weight),
                                                           qk_norm.epsilon, qk_norm.weight_offset)
        rope = None if rope is None else RopeConfig(rope.freqs_cis.cuda(), rope.interleaved, rope.q_head_dim)
        w = _cuda_weight(weight)
        path = plan(gpu.collection, hidden.cuda(), w, rope, arch, norm)
        assert path.kernel == kernels[arch], path
        out = torch.full((hidden.shape[0], q_dim), float("nan"), dtype=hidden.dtype, device="cuda")
        compiles = cache_info()["compiles"]
        got = cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, w, gpu.collection, 1,
                                                output=out, bias=cuda(bias), rope=rope, qk_norm=norm)
        torch.cuda.synchronize()
        assert cache_info()["compiles"] - compiles <= (1 if seed == 3 else 0)
        assert got is out and not out.isnan().any()
        assert rel_err(out.cpu(), want) < 1e-2
        step = cpu.step_mask(1)
        blocks, want_blocks = gpu.collection.blocks.cpu(), cpu.collection.blocks
        if blocks.dtype == torch.float8_e4m3fn:  # e4m3 rounding; scales agree to accumulation order
            deq = lambda b, s: b.float() * expand_scales(s, 64, 128)  # noqa: E731
            got_kv, want_kv = deq(blocks, gpu.collection.scales.cpu()), deq(want_blocks, cpu.collection.scales)
            assert not got_kv[step].isnan().any() and rel_err(got_kv[step], want_kv[step]) < 2.0**-4
            assert torch.equal(gpu.collection.scales.cpu()[~step], cpu.collection.scales[~step])
        else:
            assert not blocks[step].isnan().any() and rel_err(blocks[step], want_blocks[step]) < 1e-2
        bits = torch.int8 if blocks.element_size() == 1 else torch.int16
        assert torch.equal(blocks[~step].view(bits), want_blocks[~step].view(bits))  # nothing else written


@pytest.mark.gpu
def test_fused_qkv_w4_empty_step():
    from test_fused_qkv_kernel import _inputs

    (_, gpu), hidden, dense, *_ = _inputs(GPU_CASES["int4-g128-neox"][1], [4, 9], [0, 0], seed=6)
    before = gpu.collection.blocks.clone()
    w = _cuda_weight(_int4(torch.Generator().manual_seed(1), *dense.shape, 128))
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, w, gpu.collection, 1)
    assert q.shape == (0, 1024) and torch.equal(gpu.collection.blocks.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("case", COMPILE_CASES)
def test_launch_arguments_match_the_compiled_signature(rng, case):
    """What the launcher passes lines up with what the kernel was compiled against (no GPU needed to check it):
    the same slots filled, and every static extent and stride of the weight bundle and ``D`` equal."""
    kernel = _w4(case)
    s = kernel.spec.qkv
    fmt, k = kernel.spec.weight_format, 256
    weight = _fp8(rng, s.n_total, k) if fmt == "fp8" else _int4(
        rng, s.n_total, k, {"int4": 128, "int4awq": 128, "int4_g32": 32}[fmt], has_zp=fmt == "int4awq")
    t = 5
    hidden = torch.randn(t, k).to(torch.bfloat16)
    some = lambda on: torch.empty(1) if on else None  # noqa: E731 -- the operands the spec compiled in
    real = kernel.args(hidden, weight, torch.empty(t, s.q_dim, dtype=torch.bfloat16), torch.empty(1), torch.empty(1),
                       torch.empty(1), torch.empty(1, 1), 0, some(s.has_bias), some(s.rope), some(s.q_norm_dim),
                       some(s.k_norm_dim), some(s.granularity), 132, some(s.last_arriver), some(s.last_arriver))
    fake = kernel.fake_args()
    fake = fake[:7] + fake[8:]  # the stream: the current one at launch
    assert [x is None for x in real] == [x is None for x in fake]

    def same_layout(r, f):
        assert len(r.shape) == len(f.shape)
        for got, want in [*zip(r.shape, f.shape), *zip(r.stride(), f.stride)]:
            if isinstance(want, int):
                assert got == want, (r.shape, r.stride(), f.shape, f.stride)

    same_layout(real[0].blob, fake[0].blob)
    assert (real[0].sf is None) == (fake[0].sf is None)
    if real[0].sf is not None:
        same_layout(real[0].sf, fake[0].sf)
    same_layout(real[2], fake[2])  # D: the weight rows' extent, one row broadcast over the tokens
    assert real[2].shape == (-(-s.n_total // BN) * BN, t)
    assert [x is None for x in real[4]] == [x is None for x in fake[4]]  # the epilogue's optional operands
