"""Every CuTe DSL kernel compiles for sm_90a and sm_100a from fake tensors (no GPU) and emits what it claims."""

import math
import re

import pytest

from cute_kv.kernels import compile_cache
from cute_kv.kernels.attention.combine import AttentionCombine
from cute_kv.kernels.qkv.sm90 import BK, FusedQKVMatmul, supported
from cute_kv.kernels.attention.sm90 import PagedAttention
from cute_kv.kernels.attention.config import supported as attention_supported
from cute_kv.kernels.cache.gather import PagedKVGather
from cute_kv.kernels.cache.store import PagedKVStore

pytestmark = pytest.mark.compile

ARCHS = ("sm_90a", "sm_100a")
GATHER_CASES = [("bfloat16", 2, 16, 8, 128), ("float16", 2, 64, 1, 256), ("bfloat16", 1, 128, 1, 64)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_gather_ptx(arch, case):
    kernel = PagedKVGather(*case)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), arch)
    assert f".target {arch}" in ptx
    # One TMA box per 128 bytes of head dim, addressed by (dim, slot, [head,] physical page): extent-1 modes fold.
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[2-5]d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    assert len(loads) == case[4] * 2 // 128
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "st.global.v4.b32" in ptx  # 16-byte predicated row stores


STORE_CASES = [("bfloat16", 2, 16, 8, 128), ("float16", 2, 128, 1, 64), ("float32", 1, 64, 1, 576)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STORE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_store_ptx(arch, case):
    kernel = PagedKVStore(*case)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), arch)
    assert f".target {arch}" in ptx
    # Every copied vector is one 16-byte load and one 16-byte store (v4.b32, or v2.b64 for float32 on sm_100a),
    # all of a thread's loads unrolled ahead of its stores.
    vectors = kernel.kv_dim * kernel.vecs_per_thread
    assert len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx)) == vectors
    assert len(re.findall(r"st\.global\.(?:v4\.b32|v2\.b64)", ptx)) == vectors
    assert "bar.sync" in ptx  # rows resolved once per CTA, then shared


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", [("bfloat16", 2, 16, 8, 128, 128), ("float32", 1, 64, 1, 576, 64),
                                  ("float16", 2, 128, 2, 64, 8)], ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_store_fp8_ptx(arch, case):
    kernel = PagedKVStore(*case)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), arch)
    vectors = kernel.kv_dim * kernel.vecs_per_thread  # 8 values each
    lanes = case[-1] // 8  # lanes per granule: log2 butterfly steps for its amax
    assert ptx.count("shfl.sync.bfly.b32") == vectors * int(math.log2(lanes))
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == vectors * 4
    assert ptx.count("div.rn.f32") == vectors * 9  # x / scale as the reference divides, and amax / 448
    assert _count(r"st\.global\.v2\.b32", ptx) == vectors  # 8 fp8 bytes per vector
    assert _count(r"st\.global\.(?:b32|f32)", ptx) == vectors  # the granule's scale (first lane stores it)


def test_paged_kv_store_rejects_unsupported_geometry():
    with pytest.raises(ValueError, match="head_dim 100"):
        PagedKVStore("bfloat16", 2, 16, 1, 100)
    with pytest.raises(ValueError, match="granularity 48"):
        PagedKVStore("bfloat16", 2, 16, 1, 96, 48)


def _count(pattern, text):
    return len(re.findall(pattern, text))


QKV_CASES = [  # (dtype, q_dim, KVD, P, H, D, bias, rope (R, interleaved, q_head_dim), tile_m)
    ("bfloat16", 4096, 2, 16, 8, 128, False, None, 128),  # Llama-3-8B, no RoPE
    ("bfloat16", 4096, 2, 64, 8, 128, True, (128, False, 128), 64),  # neox, every head one tile
    ("float16", 512, 2, 128, 2, 64, True, (32, True, 64), 128),  # partial GPT-J RoPE on the last dims
    ("bfloat16", 1536, 1, 16, 1, 576, False, (64, True, 192), 128),  # MLA: [Q | latent K]
]


@pytest.mark.parametrize("case", QKV_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_fused_qkv_matmul_ptx(case):
    kernel = FusedQKVMatmul(*case)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), "sm_90a")
    # TMA loads of A and B in the prologue and in the steady state; wgmma 64xBNx16 atoms: BK/16 per 64 rows per
    # k-tile, issued once for the zero-initialising first tile and once in the loop.
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", ptx)) == 4
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32") == 2 * (BK // 16) * (case[-1] // 64)
    assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)  # one MMA batch in flight across k-tiles
    assert ptx.count("st.global.v4.b32") == 2  # 16-byte epilogue stores: Q to output, K/V into a page
    assert ("cvt.rn.bf16x2.f32" if case[0] == "bfloat16" else "cvt.rn.f16x2.f32") in ptx  # one rounding


def test_fused_qkv_matmul_is_sm90_only():
    kernel = FusedQKVMatmul(*QKV_CASES[0])
    with pytest.raises(Exception, match="sm_90a"):  # wgmma: Blackwell takes the reference until a tcgen05 port
        compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), "sm_100a")


def test_fused_qkv_matmul_supported_shapes():
    assert supported(4096, 2, 8, 128, (128, False, 128), 128) is None
    assert "crosses" in supported(4096, 2, 8, 256, (256, False, 256), 128)  # a 256-dim neox head spans 2 tiles
    assert supported(4096, 2, 8, 256, (256, True, 256), 128) is None  # GPT-J pairs are adjacent
    assert "multiples of 8" in supported(4100, 2, 8, 128, None, 128)
    with pytest.raises(ValueError, match="tile_m"):
        FusedQKVMatmul("bfloat16", 4096, 2, 16, 8, 128, False, None, 96)


def test_compile_cache_compiles_once_per_key():
    kernel = PagedKVGather("bfloat16", 2, 32, 2, 128)
    key = ("test_paged_kv_gather", "bfloat16", 2, 32, 2, 128)
    build = lambda: (kernel, *kernel.fake_args())  # noqa: E731
    first = compile_cache.compiled(key, build, "sm_90a")
    compiles = compile_cache.cache_info()["compiles"]
    assert compile_cache.compiled(key, build, "sm_90a") is first
    assert compile_cache.cache_info()["compiles"] == compiles
    assert type(first).__name__.startswith("TVMFFI")  # called with torch tensors directly
    other = compile_cache.compiled(key, build, "sm_100a")  # the arch is part of the key
    assert other is not first and compile_cache.cache_info()["compiles"] == compiles + 1


def test_target_arch_from_environment(monkeypatch):
    from cute_kv.kernels.compile_cache import target_arch

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert target_arch() == "sm_100a"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    with pytest.raises(RuntimeError, match="sm_80"):
        target_arch()


ATTENTION_CASES = [  # (dtype, Hq, H, D, page size or None for a dense cache, KVD, vector lookup reads, soft-cap,
    # sinks, lse[, fp8, granularity, e8m0]); the pipeline's PTX is checked in tests/test_paged_attention_ptx.py
    ("bfloat16", 32, 8, 128, 16, 2, True),
    ("float16", 8, 8, 64, 128, 2, True),
    ("bfloat16", 16, 2, 256, 16, 2, True),
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, "float8_e4m3fn", 16),
    ("bfloat16", 16, 2, 256, 128, 2, True, False, False, False, "float8_e4m3fn", 256),
]


def test_attention_config_names_the_kernel_dtypes():
    from cute_kv.kernels.attention.config import DTYPE_NAMES
    from cute_kv.kernels.attention.sm90 import DTYPES

    assert set(DTYPES) == set(DTYPE_NAMES)


def test_paged_attention_rejects_what_it_cannot_tile():
    assert attention_supported(32, 8, 128, 16) is None
    assert "head_dim must be one of" in attention_supported(32, 8, 96, 16)
    assert "multiple of the KV heads" in attention_supported(12, 8, 128, 16)
    assert "exceeds the 128-row tile" in attention_supported(256, 1, 128, 16)
    assert "page_size (8)" in attention_supported(32, 8, 128, 8)
    assert "page_size (48)" in attention_supported(32, 8, 128, 48)
    assert "must be paged" in attention_supported(32, 8, 128, None, "float8_e4m3fn")
    assert "granularity >= 8" in attention_supported(32, 8, 128, 16, "float8_e4m3fn", 48)
    assert "granularity >= 8" in attention_supported(32, 8, 128, 16, "bfloat16", 16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        PagedAttention("bfloat16", 8, 8, 80, 16)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_attention_fits_shared_memory(case):
    """Two 16-bit K/V stages at least (and an fp8 stage for an fp8 cache) beside the two warpgroups' Q tiles, within
    the 227 KiB one CTA may take."""
    kernel = PagedAttention(*case)
    assert kernel.stages >= 2 and kernel.fp8_stages >= (1 if kernel.kv_fp8 else 0)
    assert kernel.smem_bytes() <= 227 * 1024


def test_paged_attention_is_sm90_only():
    """wgmma does not exist on sm_100a: the kernel does not compile there (the op runs the reference instead)."""
    kernel = PagedAttention(*ATTENTION_CASES[0])
    with pytest.raises(Exception, match="sm_90a"):
        compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), "sm_100a")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_attention_combine_ptx(arch, head_dim):
    kernel = AttentionCombine("bfloat16", 32, head_dim)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), arch)
    assert f".target {arch}" in ptx
    assert _count(r"ld\.global\.v4\.(?:b32|f32)", ptx) == 1  # 16 bytes of a split's partial per thread
    assert _count(r"st\.global\.v2\.b32", ptx) == 1  # four 16-bit outputs
    assert ptx.count("ex2.approx") == 1
