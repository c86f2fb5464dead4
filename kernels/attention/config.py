"""``PagedAttention``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA is 128 packed query rows (two consumer warpgroups of 64, one wgmma M each) and walks the keys in tiles of
``bn``; one CTA fills an SM (its K/V rings take most of the shared memory), so its producer warp and the two
consumer warpgroups' ping-pong are what overlap loads, MMAs and softmax.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

BM = 128  # packed query rows per CTA: two consumer warpgroups of 64
VEC = 8  # 16-bit elements per 16-byte access
HEAD_DIMS = (64, 128, 256)
DTYPE_NAMES = ("bfloat16", "float16")  # Q, O and the MMAs
FP8 = "float8_e4m3fn"
SMEM_PER_SM = 228 * 1024  # SM90: a CTA may take 227 KiB, and the SM reserves 1 KiB per resident CTA
MAX_STAGES = 4


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One CTA's plan: ``bn`` keys a tile, ``stages`` 16-bit K and V tiles in their rings (what the MMAs read),
    ``fp8_stages`` fp8 K+V tiles as loaded (an fp8 cache; dequantized into the 16-bit rings), beside the two
    warpgroups' Q tiles (reused for their O) and the barriers (bytes, ``smem``)."""

    bn: int
    stages: int
    fp8_stages: int
    smem: int


def key_tile(head_dim: int) -> int:
    """128 keys a tile up to head dim 128 (S is 64 registers a thread), 64 at 256 (O takes 128 already)."""
    return 128 if head_dim <= 128 else 64


def ring_swizzle(head_dim: int, kv_fp8: bool) -> int:
    """Swizzle width (bytes) of the staged K/V rows: 128, or the whole row when shorter (an fp8 row of 64), so a
    TMA box never spans past the head dim."""
    return min(128, head_dim * (1 if kv_fp8 else 2))


def gathers(page_size, bn: int) -> bool:
    """Whether a paged cache's K/V rows are gathered by ``cp.async`` (``row_gather``): pages under 16 rows (one TMA
    per page slot would be 8 or more TMAs of one thread per tile, 128 at page 1), or pages that neither divide nor
    are divided by the key tile (no box shape fits every page slot)."""
    return page_size is not None and (page_size < 16 or (page_size % bn != 0 and bn % page_size != 0))


def tiling(head_dim: int, kv_fp8: bool = False) -> Tiling:
    """The deepest rings one CTA's shared memory holds: a 16-bit cache puts all of it in the 16-bit rings, an fp8
    cache keeps two 16-bit stages and gives the rest to the fp8 ring."""
    bn = key_tile(head_dim)
    q = BM * head_dim * 2
    stage = 2 * bn * head_dim * 2  # K and V, 16-bit
    fixed = q + 2 * MAX_STAGES * 3 * 8 + 1024  # + (full, empty) x (K, V, fp8) barriers, alignment slack
    budget = SMEM_PER_SM - 2048 - fixed
    if not kv_fp8:
        stages = min(MAX_STAGES, budget // stage)
        return Tiling(bn, stages, 0, fixed + stages * stage)
    fp8_stage = stage // 2
    fp8_stages = min(MAX_STAGES, (budget - 2 * stage) // fp8_stage)
    return Tiling(bn, 2, fp8_stages, fixed + 2 * stage + fp8_stages * fp8_stage)


def head_problem(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype_name: Optional[str],
                 granularity: Optional[int]) -> Optional[str]:
    """What both attention kernels (SM90, SM100) refuse in the heads and scales, or None: 128 packed rows hold a
    whole GQA group, head dims 64/128/256, scale granules of whole 16-byte fp8 vectors."""
    if granularity is not None and (kv_dtype_name != FP8 or granularity < VEC or granularity & (granularity - 1)
                                    or head_dim % granularity):
        return (f"scales need an fp8 cache and a power-of-two granularity >= {VEC} dividing head_dim, "
                f"got {granularity}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"q heads ({num_q_heads}) must be a positive multiple of the KV heads ({num_kv_heads})"
    if num_q_heads // num_kv_heads > BM:
        return f"a GQA group of {num_q_heads // num_kv_heads} heads exceeds the {BM}-row tile"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    return None


def supported(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: Optional[int],
              kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None) -> Optional[str]:
    """Why the kernel cannot take the problem, or None."""
    if kv_dtype_name not in (None, FP8, *DTYPE_NAMES):
        return f"the cache dtype must be 16-bit or {FP8}, got {kv_dtype_name}"
    if kv_dtype_name == FP8 and page_size is None:
        return "an fp8 cache must be paged"
    problem = head_problem(num_q_heads, num_kv_heads, head_dim, kv_dtype_name, granularity)
    if problem:
        return problem
    bn = key_tile(head_dim)
    if page_size is not None and page_size < 1:
        return f"page_size must be positive, got {page_size}"
    if kv_dtype_name == FP8 and gathers(page_size, bn):
        return (f"an fp8 cache's page_size ({page_size}) must be at least 16 and divide or be divided by the "
                f"{bn}-key tile: smaller pages gather 16-bit rows only (fp8 tiles land by TMA page slots for the "
                f"producer warpgroup to dequantize)")
    return None


LAYOUTS = ("compact", "strided")  # MAX's blocks, or K and V planes of runtime strides (a collection's layout_name)


def layout_problem(layout: str, page_size: Optional[int], granularity: Optional[int]) -> Optional[str]:
    """Why a kernel cannot read a cache of ``layout``, or None: strided K/V planes (``operand.KVCacheMHAOperand``)
    are paged and carry no scales (fp8 scales follow MAX's compact ``[N, KVD, L, P, H, G]`` geometry)."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    strided = layout == "strided"
    if strided and page_size is None:
        return "strided K/V planes must be paged"
    if strided and granularity:
        return "strided K/V planes carry no scales: a scaled fp8 cache must be compact"
    return None


COMBINE_THREADS = 128  # AttentionCombine's CTA
F32_VEC = 4  # float32 per 16-byte load


def combine_problem(v_dim: int) -> Optional[str]:
    """Why ``AttentionCombine`` cannot merge split partials of ``v_dim`` value columns, or None: ``v_dim / 4``
    threads share a row (16 bytes of float32 each) and a CTA's 128 threads hold whole rows."""
    if v_dim % VEC or COMBINE_THREADS % (v_dim // F32_VEC):
        return f"the split-KV combine takes value widths of a multiple of {VEC} dividing {COMBINE_THREADS * F32_VEC}"
    return None


def index_limits(num_pages: int, row_pitch: int, page_size: int, max_cache_length: int) -> Optional[str]:
    """Why the kernel's int32 indices cannot reach this cache, or None. TMA row coordinates are int32: the row view
    of a plane has ``(N-1)*row_pitch + P`` rows (``row_pitch``: rows from one page to the next, ``KVD*L*P`` in
    MAX's layout, ``sN / sP`` in a strided one), and one past them (the zero-filled row of a tile slot past the
    keys) must be an int32 too; key positions and counts are int32. Scales are indexed in 64 bits (``row * H * G``
    passes 2^31 first)."""
    rows = (num_pages - 1) * row_pitch + page_size
    if rows > 2**31 - 1:
        return f"the cache's {rows} rows per (K or V, layer) plane exceed int32 TMA coordinates"
    if max_cache_length > 2**31 - 1 - max(map(key_tile, HEAD_DIMS)):  # a tile past the keys stays int32
        return f"max_cache_length ({max_cache_length}) exceeds int32 key positions"
    return None

