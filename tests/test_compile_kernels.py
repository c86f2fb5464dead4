"""Every CuTe DSL kernel compiles for sm_90a and sm_100a from fake tensors (no GPU) and emits what it claims."""

import math
import re

import pytest
import torch

import artifacts

from cute_kv.kernels import compile_cache
from cute_kv.kernels.catalog import (ARCHS, ATTENTION_CASES, COMBINE_CASES, GATHER_CASES, STORE_CASES,
                                     STORE_FP8_CASES, STORE_STRIDED_CASES)
from cute_kv.kernels.attention.combine import AttentionCombine
from cute_kv.kernels.attention.sm90 import PagedAttention
from cute_kv.kernels.attention.config import supported as attention_supported
from cute_kv.kernels.cache.gather import PagedKVGather
from cute_kv.kernels.cache.store import PagedKVStore

pytestmark = pytest.mark.compile



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_gather_ptx(arch, case):
    kernel = PagedKVGather(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    assert f".target {arch}" in ptx
    # One TMA box per 128 bytes of head dim, addressed by (dim, slot, [head,] physical page): extent-1 modes fold.
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[2-5]d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    assert len(loads) == case[4] * 2 // 128
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "st.global.v4.b32" in ptx  # 16-byte predicated row stores
    # The request's length and its page's lookup entry, one 4-byte load each: no vector load assumes more of the
    # table than the 4-byte base a column slice of a wider one has.
    assert _count(r"ld\.global\.b32", ptx) == 2 and _count(r"ld\.global\.\S*v[248]", ptx) == 0
    # ... of 16-byte reads of the pointer-swizzled tile (a swizzle inside the layout gave eight 2-byte reads).
    assert _count(r"ld\.shared\.v4\.b32", ptx) == 1 and _count(r"ld\.shared\.b16", ptx) == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STORE_CASES + STORE_STRIDED_CASES[:1], ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_store_ptx(arch, case):
    kernel = PagedKVStore(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    assert f".target {arch}" in ptx
    # Every copied vector is one 16-byte load and one 16-byte store (v4.b32, or v2.b64 for float32 on sm_100a),
    # all of a thread's loads unrolled ahead of its stores.
    vectors = kernel.kv_dim * kernel.vecs_per_thread
    assert len(re.findall(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx)) == vectors
    assert len(re.findall(r"st\.global\.(?:v4\.b32|v2\.b64)", ptx)) == vectors
    assert "bar.sync" in ptx  # rows resolved once per CTA, then shared


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STORE_FP8_CASES + STORE_STRIDED_CASES[1:], ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_store_fp8_ptx(arch, case):
    kernel = PagedKVStore(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    vectors = kernel.kv_dim * kernel.vecs_per_thread  # 8 values each
    lanes = kernel.granularity // 8  # lanes per granule: log2 butterfly steps for its amax
    assert ptx.count("shfl.sync.bfly.b32") == vectors * int(math.log2(lanes))
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == vectors * 4
    assert ptx.count("div.rn.f32") == vectors * 9  # x / scale as the reference divides, and amax / 448
    assert _count(r"st\.global\.v2\.b32", ptx) == vectors  # 8 fp8 bytes per vector
    assert _count(r"st\.global\.(?:b32|f32)", ptx) == vectors  # the granule's scale (first lane stores it)
    # NaN/Inf as the reference: a NaN-propagating amax (the running max of |x|, the shuffles, the scale floor), and
    # no clamp before the conversion (cvt.satfinite saturates and keeps NaN; a clamp makes NaN 448).
    # The running max of |x| is max.xorsign.abs, whose sign is the operands' XOR: cleared once (abs) before the
    # lanes' max, else a negative partial loses to a smaller positive one (the shared kernels/quant.py helper).
    assert _count(r"max\.NaN\.xorsign\.abs\.f32", ptx) == vectors * 8
    assert _count(r"\sabs\.f32", ptx) == vectors
    assert _count(r"max\.NaN\.f32", ptx) == vectors * int(math.log2(lanes))
    assert _count(r"(?:min|max)\.(?:ftz\.)?f32", ptx) == 0


def test_paged_kv_store_rejects_unsupported_geometry():
    with pytest.raises(ValueError, match="head_dim 100"):
        PagedKVStore("bfloat16", 2, 16, 1, 100)
    with pytest.raises(ValueError, match="granularity 48"):
        PagedKVStore("bfloat16", 2, 16, 1, 96, 48)


def _count(pattern, text):
    return len(re.findall(pattern, text))


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
    monkeypatch.delenv("CUTE_DSL_ARCH")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="set CUTE_DSL_ARCH"):
            target_arch()


def test_target_arch_device_wins_over_environment(monkeypatch):
    """A stale ``CUTE_DSL_ARCH`` must not compile Blackwell code for a Hopper device: the device decides, and
    says so."""
    import warnings

    from cute_kv.kernels import compile_cache

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(compile_cache, "_overridden", set())
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    with pytest.warns(RuntimeWarning, match="CUTE_DSL_ARCH=sm_100a ignored.*sm_90a"):
        assert compile_cache.target_arch() == "sm_90a"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (setting, device), not on every op call
        assert compile_cache.target_arch() == "sm_90a"
        monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
        assert compile_cache.target_arch() == "sm_90a"
        monkeypatch.delenv("CUTE_DSL_ARCH")
        assert compile_cache.target_arch() == "sm_90a"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(RuntimeError, match="sm_80"):
        compile_cache.target_arch()


def test_attention_config_names_the_kernel_dtypes():
    from cute_kv.kernels.attention.config import DTYPE_NAMES
    from cute_kv.kernels.attention.sm90 import DTYPES

    assert set(DTYPES) == set(DTYPE_NAMES)


def test_paged_attention_rejects_what_it_cannot_tile():
    assert attention_supported(32, 8, 128, 16) is None
    assert "head_dim must be one of" in attention_supported(32, 8, 112, 16)
    assert "float8_e4m3fn cache head_dim must be one of" in attention_supported(32, 8, 96, 16, "float8_e4m3fn")
    assert "v_dim (96) must equal head_dim" in attention_supported(32, 8, 128, 16, v_dim=96)
    assert "needs a 16-bit cache" in attention_supported(32, 8, 192, 16, "float8_e4m3fn", v_dim=128)
    assert "multiple of the KV heads" in attention_supported(12, 8, 128, 16)
    assert "exceeds the 128-row tile" in attention_supported(256, 1, 128, 16)
    assert attention_supported(32, 8, 128, 8) is None and attention_supported(32, 8, 128, 24) is None  # gathered
    assert attention_supported(32, 8, 128, 48) is None  # 16-row TMA slots, parts of pages
    assert attention_supported(32, 8, 192, 64) is None and attention_supported(32, 8, 256, 48) is None
    assert "page_size (24) must be a multiple of 16 at head_dim 192" in attention_supported(32, 8, 192, 24)
    assert "page_size must be positive" in attention_supported(32, 8, 128, 0)
    assert "other pages gather 16-bit rows only" in attention_supported(32, 8, 128, 8, "float8_e4m3fn")
    assert "page_size (24)" in attention_supported(32, 8, 128, 24, "float8_e4m3fn")
    assert attention_supported(32, 8, 128, 48, "float8_e4m3fn") is None
    assert "must be paged" in attention_supported(32, 8, 128, None, "float8_e4m3fn")
    assert "granularity >= 8" in attention_supported(32, 8, 128, 16, "float8_e4m3fn", 48)
    assert "granularity >= 8" in attention_supported(32, 8, 128, 16, "bfloat16", 16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        PagedAttention("bfloat16", 8, 8, 112, 16)


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
        artifacts.compiled(kernel, "sm_100a").ptx


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", COMBINE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_attention_combine_ptx(arch, case):
    kernel = AttentionCombine(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    assert f".target {arch}" in ptx
    assert _count(r"ld\.global\.v4\.(?:b32|f32)", ptx) == 1  # 16 bytes of a split's partial per thread
    assert _count(r"st\.global\.v2\.b32", ptx) == 1  # four 16-bit outputs
    assert ptx.count("ex2.approx") == 1


def _derivations(ptx):
    """Every definition of each PTX virtual register: ``{reg: [(opcode, operands), ...]}``."""
    defs = {}
    for m in re.finditer(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)\s+(%\w+),\s*(.*?);", ptx, re.M):
        defs.setdefault(m.group(2), []).append((m.group(1), m.group(3)))
    return defs


def _derived_from(defs, reg):
    """The instructions ``reg``'s value may derive from (all definitions, transitively)."""
    seen, todo, ops = set(), [reg], []
    while todo:
        r = todo.pop()
        if r not in seen:
            seen.add(r)
            for op, args in defs.get(r, []):
                ops.append((op, args))
                todo += re.findall(r"%[a-z]+\d+", args)
    return ops


def _scale_loads_indexed_in_64_bits(ptx, width, per_row):
    """How many ``ld.global.<width>`` addresses derive from a 64-bit ``row * per_row`` (H*G scales per row, or its
    byte stride)."""
    defs, factors = _derivations(ptx), {per_row, 4 * per_row}
    shifts = {int(math.log2(f)) for f in factors}
    wide = 0
    for m in re.finditer(rf"ld\.global\.(?:nc\.)?{width}\s+%r\d+, \[(%rd\d+)(?:\+\d+)?\];", ptx):
        ops = _derived_from(defs, m.group(1))
        wide += any((op == "shl.b64" and int(args.rsplit(", ", 1)[1]) in shifts)
                    or (op in ("mul.wide.s32", "mul.wide.u32", "mul.lo.s64") and args.rsplit(", ", 1)[1].isdigit()
                        and int(args.rsplit(", ", 1)[1]) in factors)
                    for op, args in ops)
    return wide


FP8_SCALED = [c for c in ATTENTION_CASES if len(c) > 11 and c[11]]  # fp8 with a granularity


@pytest.mark.parametrize("case", FP8_SCALED, ids=lambda c: "-".join(map(str, c)))
def test_paged_attention_fp8_scales_ptx(case):
    """Scale ``row * H * G + head * G + g`` in 64 bits (a 32-bit product wraps on caches past ~32 GiB); float32
    scales as whole 4-byte loads; e8m0 bytes 0 and 255 decoded as torch does; the staging stage released only after
    the barrier that ends every thread's reads of it."""
    from cute_kv.kernels.quant import E8M0_MIN_BITS, E8M0_NAN_BITS

    kernel = PagedAttention(*case)
    ptx = artifacts.compiled(kernel, "sm_90a").ptx
    per_row = kernel.num_kv_heads * kernel.head_dim // kernel.granularity
    vectors = 2 * kernel.head_dim // 16  # at least one scale per 16 dequantized dims of a K and a V row
    if kernel.e8m0_scales:
        wide = _scale_loads_indexed_in_64_bits(ptx, "[ub]8", per_row)
        assert wide >= vectors and wide == _count(r"ld\.global\.(?:nc\.)?[ub]8", ptx)
        for bits in (E8M0_MIN_BITS, E8M0_NAN_BITS):
            assert ptx.count(f"0f{bits:08X}") == wide  # one select per decoded byte
    else:
        assert _scale_loads_indexed_in_64_bits(ptx, "b32", per_row) >= vectors
        assert _count(r"ld\.global\.(?:nc\.)?[ub](?:8|16)", ptx) == 0
    assert "mul.ftz" not in ptx  # 2^-127 is a float32 subnormal: it must not flush to 0


@pytest.mark.parametrize("case", [c for c in ATTENTION_CASES if len(c) > 10 and c[10]],
                         ids=lambda c: "-".join(map(str, c)))
def test_paged_attention_fp8_release_after_barrier(case):
    """The producer warpgroup's fp8 staging stage is released only after the named barrier that ends every thread's
    reads of it: after a tile's last conversion only V's 16-bit stage is committed, then the barrier, then the
    release."""
    kernel = PagedAttention(*case)
    ptx = artifacts.compiled(kernel, "sm_90a").ptx
    lines = ptx.splitlines()
    last_read = max(i for i, line in enumerate(lines) if "cvt.rn.f16x2.e4m3x2" in line)
    sync = next(i for i in range(last_read, len(lines)) if re.match(r"\s*(?:bar|barrier)\.sync\s+\d+, 128;", lines[i]))
    arrives = lambda a, b: [i for i in range(a, b) if "mbarrier.arrive" in lines[i]]  # noqa: E731
    assert len(arrives(last_read, sync)) == 1  # V's commit, not the release
    wait = next(i for i in range(sync, len(lines)) if "mbarrier.try_wait" in lines[i])
    assert arrives(sync, wait)  # the release


def _page_guards(ptx, page_size):
    """``(column compared, [lookup entries compared])`` of the row-resolving code: the page column ``pos >> log2 P``
    is checked against the table's width, and the entry read at it against the page count, before any store."""
    defs = _derivations(ptx)
    cols = set(re.findall(rf"shr\.u32\s+(%r\d+), %r\d+, {int(math.log2(page_size))};", ptx))
    compared = {r for pair in re.findall(r"setp\.\w+\.[su]32\s+%p\d+, (%r\d+), (%r\d+);", ptx) for r in pair}
    entries = [m.group(1) for m in re.finditer(r"ld\.global\.b32\s+(%r\d+), \[(%rd\d+)\];", ptx)
               if any(set(re.findall(r"%r\d+", args)) & cols for _, args in _derived_from(defs, m.group(2)))]
    return bool(cols & compared), [e in compared and _nonnegative_checked(ptx, e) for e in entries]


def _nonnegative_checked(ptx, reg):
    """Whether ``reg`` (a uint32 lookup entry) is bounded below as well: compared unsigned, or checked against 0 / -1
    (a signed ``entry < N`` alone lets an entry of 2^31 or more through as a negative page)."""
    r = re.escape(reg)
    return bool(re.search(rf"setp\.\w+\.u32\s+%p\d+, (?:{r}, %r\d+|%r\d+, {r});", ptx)
                or re.search(rf"(?:setp\.\w+\.s32\s+%p\d+|max\.s32\s+%r\d+), {r}, (?:-1|0);", ptx)
                or re.search(rf"setp\.\w+\.s32\s+%p\d+, (?:-1|0), {r};", ptx))


@pytest.mark.parametrize("kind", ["store", "store_fp8", "qkv"])
def test_row_writers_skip_pages_outside_the_cache(kind):
    """Unchecked metadata (``validate=False``) running past a request's pages reads the sentinel entry ``N`` or a
    column past the table: each row's column and entry are compared once, so no row is written past the cache."""
    if kind == "qkv":
        pytest.importorskip("quack")
        from cute_kv.kernels.qkv.gemm import FusedQKVGemm, QKVSpec

        qkv = FusedQKVGemm(QKVSpec("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False)), "sm_90a")
        ptx, page_size = artifacts.compiled(qkv, "sm_90a").ptx, 16
    else:
        kernel = {"store": lambda: PagedKVStore("bfloat16", 2, 16, 8, 128),
                  "store_fp8": lambda: PagedKVStore("bfloat16", 2, 64, 2, 128, 32)}[kind]()
        ptx, page_size = artifacts.compiled(kernel, "sm_90a").ptx, kernel.page_size
    column_checked, entries_checked = _page_guards(ptx, page_size)
    assert column_checked and entries_checked == [True]  # one lookup read per resolved row, checked
