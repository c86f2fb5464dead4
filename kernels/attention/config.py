"""``PagedAttention``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA is 128 packed query rows (two consumer warpgroups of 64, one wgmma M each) and walks the keys in tiles of
``bn``; one CTA fills an SM (its K/V rings take most of the shared memory), so its producer warp and the two
consumer warpgroups (in ping-pong up to head dim 128) are what overlap loads, MMAs and softmax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

BM = 128  # packed query rows per CTA: two consumer warpgroups of 64
VEC = 8  # 16-bit elements per 16-byte access
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
GATHER_HEAD_DIMS = (64, 128, 256)  # rows a cp.async gather plans (``row_gather``: 128-byte swizzle, 8-row passes)
FP8_HEAD_DIMS = (64, 128, 256)  # a dequantizing warpgroup's 128 threads cover whole rows of 16-byte vectors
VALUE_DIMS = {192: 128}  # head dim -> the narrower value dim it also takes (DeepSeek MLA prefill: 128 + 64 / 128)
DTYPE_NAMES = ("bfloat16", "float16")  # Q, O and the MMAs
FP8 = "float8_e4m3fn"
SMEM_PER_SM = 228 * 1024  # SM90: a CTA may take 227 KiB, and the SM reserves 1 KiB per resident CTA
MAX_STAGES = 4
WIDE_KEY_TILES = {192: 112, 256: 80}  # head dim -> the key tile of values as wide (FA4's ``tile_size_fwd_sm90``)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """One CTA's plan: ``bn`` keys a tile, ``stages`` 16-bit K and V tiles (V ``D_v`` wide) in their rings (what
    the MMAs read), ``fp8_stages`` fp8 K+V tiles as loaded (an fp8 cache; dequantized into the 16-bit rings), beside
    the two warpgroups' Q tiles (reused for their O) and the barriers (bytes, ``smem``)."""

    bn: int
    stages: int
    fp8_stages: int
    smem: int


def key_tile(head_dim: int, v_dim: Optional[int] = None, page_size: Optional[int] = None,
             kv_fp8: bool = False) -> int:
    """128 keys a tile while O is at most 128 wide (S and O 64 registers a thread each). Wider O (192 or 256: 96 or
    128 registers) takes FA4's SM90 tiles, 112 keys at 192 and 80 at 256 (two stages beside Q; a loop's fixed work,
    waits, descriptors and O rescale, spread over 1.75 and 1.25 S blocks of 64 x 64), where page slots of 16 rows
    or more tile them (``page_slot``); else 64: a gathered or an fp8 cache (at 256 an fp8 ring would not fit beside
    two 80-key stages)."""
    if (v_dim or head_dim) <= 128:
        return 128
    wide = WIDE_KEY_TILES[head_dim]
    return 64 if kv_fp8 or gathers(page_size, wide) else wide


def operand_swizzle(row_bytes: int) -> int:
    """Swizzle width (bytes) of a K-major tile of ``row_bytes`` rows: the widest of 128, 64 and 32 that divides the
    row (CUTLASS's ``get_smem_layout_atom``, as FA4 picks it: rows of 160 bytes take 32, 192 take 64), 0 (none)
    for rows of 16-byte multiples only, so neither a swizzle atom nor a TMA box spans past the row."""
    return next((w for w in (128, 64, 32) if row_bytes % w == 0), 0)


def ring_swizzle(head_dim: int, kv_fp8: bool) -> int:
    """Swizzle width (bytes) of staged rows of ``head_dim`` 16-bit (or fp8) values."""
    return operand_swizzle(head_dim * (1 if kv_fp8 else 2))


def page_slot(page_size: int, bn: int) -> int:
    """Rows of a page slot, what one TMA box loads: the largest run of keys a ``bn``-key tile (starting at a multiple
    of ``bn``) keeps within one page, ``gcd(P, bn)``: the tile when a page holds whole tiles, the page when a tile
    holds whole pages, else a part of a page (16 rows of a 64-row page in a 112-key tile)."""
    return math.gcd(page_size, bn)


def gathers(page_size, bn: int) -> bool:
    """Whether a paged cache's K/V rows are gathered by ``cp.async`` (``row_gather``): page slots that are not a
    multiple of 16 rows. Under 16, one TMA per slot would be 8 or more TMAs of one thread per tile (128 at page 1);
    slots of 20 or 28 rows (80- and 112-key tiles over pages of 20, 28, 60, ...) are not whole 8-row swizzle atoms,
    so no TMA box matches the staged tile. Every key tile is a multiple of 16, so these are the pages of a size not
    a multiple of 16."""
    return page_size is not None and page_slot(page_size, bn) % 16 != 0


def tiling(head_dim: int, kv_fp8: bool = False, v_dim: Optional[int] = None,
           page_size: Optional[int] = None) -> Tiling:
    """The deepest rings one CTA's shared memory holds: a 16-bit cache puts all of it in the 16-bit rings, an fp8
    cache keeps two 16-bit stages and gives the rest to the fp8 ring."""
    v_dim = v_dim or head_dim
    bn = key_tile(head_dim, v_dim, page_size, kv_fp8)
    q = BM * head_dim * 2
    stage = bn * (head_dim + v_dim) * 2  # K and V, 16-bit
    fixed = q + 2 * MAX_STAGES * 3 * 8 + 1024  # + (full, empty) x (K, V, fp8) barriers, alignment slack
    budget = SMEM_PER_SM - 2048 - fixed
    if not kv_fp8:
        stages = min(MAX_STAGES, budget // stage)
        return Tiling(bn, stages, 0, fixed + stages * stage)
    fp8_stage = stage // 2
    fp8_stages = min(MAX_STAGES, (budget - 2 * stage) // fp8_stage)
    return Tiling(bn, 2, fp8_stages, fixed + 2 * stage + fp8_stages * fp8_stage)


def head_problem(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype_name: Optional[str],
                 granularity: Optional[int], v_dim: Optional[int] = None) -> Optional[str]:
    """What both attention kernels (SM90, SM100) refuse in the heads and scales, or None: 128 packed rows hold a
    whole GQA group, head dims ``HEAD_DIMS`` (``FP8_HEAD_DIMS`` over an fp8 cache), values as wide (or a
    ``VALUE_DIMS`` pair, 16-bit), scale granules of whole 16-byte fp8 vectors."""
    if v_dim is not None and v_dim != head_dim:
        if VALUE_DIMS.get(head_dim) != v_dim:
            return (f"v_dim ({v_dim}) must equal head_dim ({head_dim}) or be one of the (head_dim, v_dim) pairs "
                    f"{sorted(VALUE_DIMS.items())}")
        if kv_dtype_name == FP8:
            return f"a v_dim narrower than head_dim needs a 16-bit cache, got {FP8}"
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
    if kv_dtype_name == FP8 and head_dim not in FP8_HEAD_DIMS:
        return f"over an {FP8} cache head_dim must be one of {FP8_HEAD_DIMS}, got {head_dim}"
    return None


def supported(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: Optional[int],
              kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None,
              v_dim: Optional[int] = None) -> Optional[str]:
    """Why the kernel cannot take the problem, or None."""
    if kv_dtype_name not in (None, FP8, *DTYPE_NAMES):
        return f"the cache dtype must be 16-bit or {FP8}, got {kv_dtype_name}"
    if kv_dtype_name == FP8 and page_size is None:
        return "an fp8 cache must be paged"
    problem = head_problem(num_q_heads, num_kv_heads, head_dim, kv_dtype_name, granularity, v_dim)
    if problem:
        return problem
    bn = key_tile(head_dim, v_dim, page_size, kv_dtype_name == FP8)
    if page_size is not None and page_size < 1:
        return f"page_size must be positive, got {page_size}"
    if gathers(page_size, bn) and (head_dim not in GATHER_HEAD_DIMS or (v_dim or head_dim) != head_dim):
        return (f"page_size ({page_size}) must be a multiple of 16 at head_dim {head_dim}"
                f"{f' / v_dim {v_dim}' if v_dim else ''}: other pages gather rows by cp.async, which takes head dims "
                f"{GATHER_HEAD_DIMS} with values as wide")
    if kv_dtype_name == FP8 and gathers(page_size, bn):
        return (f"an fp8 cache's page_size ({page_size}) must be a multiple of 16: other pages gather 16-bit rows "
                f"only (fp8 tiles land by TMA page slots for the producer warpgroup to dequantize)")
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
    threads share a row (16 bytes of float32 each) and a CTA's 128 threads hold one row at least."""
    if v_dim % VEC or v_dim // F32_VEC > COMBINE_THREADS:
        return f"the split-KV combine takes value widths of a multiple of {VEC} up to {COMBINE_THREADS * F32_VEC}"
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

