"""``FusedQKVGemm`` compiled for sm_90a and sm_100a against fake tensors: the mainloop is quack's, unchanged (same
MMA instructions as the same GEMM without our epilogue), the epilogue stores 16 bytes and rounds once, and ptxas
reports no spills. Plus the host rules: which shapes the kernel takes, and what the entry sends to it."""

import functools
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import artifacts

import cute_kv
from cute_kv import RopeConfig
from cute_kv.dtypes import is_fp8
from cute_kv.ops.fused_qkv import plan
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns

pytest.importorskip("quack")
from cute_kv.kernels.qkv.gemm import FusedQKVGemm, QKVSpec, supported  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf"))
from static_fused_qkv import bare_gemm_ptx  # noqa: E402

# (dtype, q_dim, KVD, P, H, D, q_head_dim, bias, rope (R, interleaved), q_norm dims, k_norm dims[, fp8 granularity
#  [, e8m0 scales]])
CASES = {
    "llama-plain": ("bfloat16", 4096, 2, 16, 8, 128, 128, False, None, 0, 0),
    "qwen3-bias-neox-qknorm": ("bfloat16", 4096, 2, 64, 8, 128, 128, True, (128, False), 128, 128),
    "gptj-partial-fp16": ("float16", 512, 2, 128, 2, 64, 64, True, (32, True), 0, 0),
    "gemma-knorm-only-neox": ("bfloat16", 2048, 2, 16, 4, 64, 64, False, (64, False), 0, 64),
    "mla-latent-straddles-tiles": ("bfloat16", 1536, 1, 16, 1, 576, 192, False, (64, True), 0, 0),
    "fp8-scales-g64": ("bfloat16", 4096, 2, 16, 8, 128, 128, True, (128, False), 128, 128, 64),
    "fp8-unscaled": ("float16", 512, 2, 16, 2, 64, 64, False, None, 0, 0, 0),
    "fp8-e8m0-g32": ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0, 32, True),
}
MMA = {"sm_90a": r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.(bf16|f16)", "sm_100a": r"tcgen05\.mma\.cta_group::2"}


def _spec(case) -> QKVSpec:
    c = CASES[case]
    fp8 = len(c) > 11
    return QKVSpec(*c[:9], q_norm_dim=c[9], k_norm_dim=c[10], fp8=fp8, granularity=c[11] if fp8 else 0,
                   e8m0=len(c) > 12 and c[12])


@functools.lru_cache(maxsize=None)
def _ptx(case: str, arch: str) -> str:
    return artifacts.compiled(FusedQKVGemm(_spec(case), arch), arch).ptx


@functools.lru_cache(maxsize=None)
def _bare_ptx(arch: str) -> str:
    """quack's GEMM on the same tiles and cluster with its own (D-storing) epilogue (the static table's baseline)."""
    return bare_gemm_ptx(arch)[0]


def ptxas_report(ptx: str, arch: str, tmp_path) -> str:
    ptxas = shutil.which("ptxas") or "/usr/local/bin/ptxas"
    if not shutil.which(ptxas):
        pytest.skip("ptxas not installed")
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    return subprocess.run([ptxas, f"-arch={arch}", "-v", str(src), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True).stderr


# the epilogue is shared: a few suffice
SM100_CASES = ["llama-plain", "qwen3-bias-neox-qknorm", "fp8-scales-g64", "fp8-e8m0-g32"]


@pytest.mark.compile
@pytest.mark.parametrize("case,arch", [(c, "sm_90a") for c in CASES] + [(c, "sm_100a") for c in SM100_CASES])
def test_fused_qkv_gemm_ptx(case, arch, tmp_path):
    spec = _spec(case)
    ptx = _ptx(case, arch)
    # The mainloop is quack's: the same MMA instructions as its GEMM without our epilogue (fp16 has the same count).
    assert len(re.findall(MMA[arch], ptx)) == len(re.findall(MMA[arch], _bare_ptx(arch))) > 0
    if arch == "sm_100a":
        assert "tcgen05.alloc" in ptx and "tcgen05.dealloc" in ptx  # accumulators in TMEM
    # No D tensor: Q to output and K/V into a page as one 16-byte store each (fp8: 8 e4m3 bytes and the
    # granule's scale: a float32, or an e8m0 byte), each value rounded once.
    stores = ["st.global.v4.b32", "st.global.v4.b32"]
    if spec.fp8:
        scale_store = ["st.global.b8" if spec.e8m0 else "st.global.b32"] if spec.granularity else []
        stores = ["st.global.v2.b32", "st.global.v4.b32"] + scale_store
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert sorted(re.findall(r"st\.global\.\S+", ptx)) == sorted(stores)
    assert ("cvt.rn.bf16x2.f32" if spec.dtype_name == "bfloat16" else "cvt.rn.f16x2.f32") in ptx
    # QK-norm: one butterfly step per doubling of the widest head's lanes; fp8 scales: per doubling of a granule's
    # lanes, with a NaN-propagating max.
    steps = (spec.max_head_lanes.bit_length() - 1) if spec.has_norm else 0
    amax_steps = (spec.granularity // 8).bit_length() - 1 if spec.granularity else 0
    assert ptx.count("shfl.sync.bfly") == steps + amax_steps
    assert ptx.count("max.NaN.f32") == amax_steps
    if spec.rope is not None:  # a chunk's cos/sin pairs: 16-byte loads (16 floats neox, 8 GPT-J)
        assert ptx.count("ld.global.v4.b32") == (2 if spec.rope[1] else 4)
    report = ptxas_report(ptx, arch, tmp_path)
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"]
    assert "0 bytes stack frame" in report



# SM100 registers as measured (ptxas 13). The count is set by the epilogue warps (the MMA and TMA warps hold at most
# 15 live registers at their MMAs and TMA loads, quack's alone 10), so the mainloop's code is untouched, and at one
# 256-thread CTA per SM it does not limit occupancy; the ceilings keep a change from hoisting per-thread epilogue
# state back across the TMEM drain (the QK-norm case took 82 before the chunk math was derived per tile and the
# norm masks became one flag).
SM100_REGISTERS = {"llama-plain": 56, "qwen3-bias-neox-qknorm": 68, "fp8-scales-g64": 70, "fp8-e8m0-g32": 65}


@pytest.mark.compile
@pytest.mark.parametrize("case", SM100_CASES)
def test_sm100_epilogue_registers(case, tmp_path):
    used = re.findall(r"Used (\d+) registers", ptxas_report(_ptx(case, "sm_100a"), "sm_100a", tmp_path))
    assert int(used[0]) <= SM100_REGISTERS[case]


def _instructions(ptx: str) -> list[tuple[str, list[str]]]:
    """``(opcode, operands)`` of every PTX instruction."""
    out = []
    for line in ptx.splitlines():
        parts = line.strip().rstrip(";").split(None, 1)
        if len(parts) == 2 and not parts[0].startswith((".", "//", "@", "$")):
            out.append((parts[0], [o.strip() for o in parts[1].split(",")]))
    return out


@pytest.mark.compile
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_fp8_granule_amax_is_a_magnitude(arch):
    """The lane's amax is a ``max.xorsign.abs`` chain, whose sign is the XOR of its operands' signs: it must pass
    through ``abs`` before the lanes' plain max and the scale (a negative partial would lose to a smaller positive
    one, and an all-negative granule would get the floor scale)."""
    insts = _instructions(_ptx("fp8-scales-g64", arch))
    signed = {ops[0] for op, ops in insts if "xorsign.abs" in op}
    assert signed
    for op, ops in insts:
        if signed & set(ops[1:]):
            assert "xorsign.abs" in op or op.startswith("abs."), (op, ops)


def test_supported_shapes():
    base = dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8, head_dim=128,
                q_head_dim=128, has_bias=False, rope=None)
    assert supported(QKVSpec(**base)) is None
    assert supported(QKVSpec(**{**base, "rope": (128, False)})) is None
    # a neox head of 256 spans two 128-column tiles: the last of them to arrive finishes it (test_fused_qkv_wide);
    # a GPT-J one does not need its partner from another tile
    wide = QKVSpec(**{**base, "head_dim": 256, "rope": (256, False)})
    assert supported(wide) is None and wide.wide == (False, True)
    gptj = QKVSpec(**{**base, "head_dim": 256, "rope": (256, True)})
    assert supported(gptj) is None and not gptj.last_arriver
    assert "normalized or neox-rotated Q head of 192" in supported(QKVSpec(**{**base, "q_head_dim": 192,
                                                                               "q_dim": 3072, "q_norm_dim": 192}))
    assert "straddle" in supported(QKVSpec(**{**base, "q_dim": 4160, "q_head_dim": 64, "head_dim": 128,
                                              "k_norm_dim": 128}))
    assert "multiples of 8" in supported(QKVSpec(**{**base, "q_dim": 4100, "q_head_dim": 4100}))
    # a norm weight covers whole 16-byte chunks (one flag per chunk, no per-element mask)
    assert "QK-norm weights of 0 (Q) and 100 (K)" in supported(QKVSpec(**{**base, "k_norm_dim": 100}))
    assert supported(QKVSpec(**{**base, "q_head_dim": 64, "head_dim": 64, "k_norm_dim": 56})) is None
    assert "rope_dim 24 must be a multiple of 16 (neox)" in supported(QKVSpec(**{**base, "rope": (24, False)}))
    assert supported(QKVSpec(**{**base, "rope": (24, True)})) is None  # GPT-J: 8 suffices
    assert "dtype" in supported(QKVSpec(**{**base, "dtype_name": "float32"}))
    assert supported(QKVSpec(**base, fp8=True, granularity=128)) is None
    for g in (48, 256):  # not a power of two; more lanes than a row of the tile
        assert f"granularity {g}" in supported(QKVSpec(**base, fp8=True, granularity=g))
    with pytest.raises(ValueError, match="targets"):
        FusedQKVGemm(QKVSpec(**base), "sm_80")


def _served(rng, *, dtype=torch.bfloat16, weight=None, rope=None, qk_norm=None, heads=8, head_size=128,
            q_dim=4096, is_mla=False, **cache_kw):
    """``plan``'s key on sm_90a for a CPU batch (the decision reads host values only), None for the reference."""
    pb = random_paged_batch([3, 0], [2, 5], num_heads=heads, head_size=head_size, page_size=16, is_mla=is_mla,
                            generator=rng, **{"dtype": dtype, **cache_kw})
    act = torch.bfloat16 if is_fp8(dtype) else dtype
    n_tot = q_dim + kv_columns(pb.collection)
    if weight is None:
        weight = torch.zeros(n_tot, 256, dtype=act)
    return plan(pb.collection, torch.zeros(pb.total_rows, 256, dtype=act), weight, rope, "sm_90a", qk_norm).key


def test_plan_serves(rng):
    spec = _served(rng, rope=RopeConfig.from_theta(128, 64),
                   qk_norm=cute_kv.QKNorm(torch.ones(128), torch.ones(128, dtype=torch.bfloat16), 1e-5, 1.0))
    assert (spec.q_dim, spec.head_dim, spec.rope, spec.q_norm_dim, spec.k_norm_dim) == (4096, 128, (128, False),
                                                                                       128, 128)
    assert (spec.norm_epsilon, spec.norm_offset, spec.fp8, spec.has_bias) == (1e-5, 1.0, False, False)
    fp8 = _served(rng, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, quantization_granularity=64)
    assert (fp8.fp8, fp8.granularity, fp8.dtype_name) == (True, 64, "bfloat16")
    assert _served(rng, dtype=torch.float8_e4m3fn).granularity == 0  # unscaled e4m3
    e8m0 = _served(rng, dtype=torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu, quantization_granularity=32)
    assert (e8m0.fp8, e8m0.granularity, e8m0.e8m0) == (True, 32, True)
    assert not fp8.e8m0
    mla = _served(rng, heads=1, head_size=576, q_dim=1536, is_mla=True,
                  rope=RopeConfig.from_theta(64, 64, interleaved=True, q_head_dim=192))
    assert (mla.kv_dim, mla.q_head_dim) == (1, 192)  # the latent head straddles tiles: GPT-J pairs do not
    # neox over heads of 256: two tiles each, finished by the last to arrive (test_fused_qkv_wide)
    assert _served(rng, head_size=256, q_dim=4096, rope=RopeConfig.from_theta(256, 64)).wide == (True, True)


def test_plan_leaves_to_the_reference(rng):
    int4 = cute_kv.Int4Weight(torch.zeros(4096 + 2048, 128, dtype=torch.uint8),
                              torch.ones(4096 + 2048, 2, dtype=torch.float32), 128)
    assert _served(rng, weight=int4) is None  # float32 group scales: the W4 decode multiplies bf16 (test_fused_qkv_w4)
    assert _served(rng, dtype=torch.float32) is None
    latent_norm = cute_kv.QKNorm(k_weight=torch.ones(256))  # MLA's latent norm: finished across tiles, served
    assert _served(rng, heads=1, head_size=576, q_dim=1536, is_mla=True, qk_norm=latent_norm,
                   rope=RopeConfig.from_theta(64, 64, interleaved=True, q_head_dim=192)).cross_dims == 256
    assert _served(rng, qk_norm=cute_kv.QKNorm(k_weight=torch.ones(100))) is None  # 100 dims: not whole chunks
    unaligned = RopeConfig(torch.zeros(64, 130)[:, 1:129])  # rows not 16-byte aligned: no vector loads
    assert _served(rng, rope=unaligned) is None
