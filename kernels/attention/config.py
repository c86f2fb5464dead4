"""``PagedAttention``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

One warpgroup computes a CTA's tile step by step (QK, softmax, PV), so the overlap of one CTA's softmax with
another's MMAs and loads comes from two CTAs sharing an SM: 64-key tiles and a two-stage K/V ring keep a CTA
under half the shared memory wherever the head dim allows (64, 128); head dim 256 takes one CTA per SM.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

BM = 64  # packed query rows per CTA: one wgmma M
BN = 64  # keys per tile
VEC = 8  # 16-bit elements per 16-byte access
S_PAD = 4  # fp32 words of padding per staged S/O row: rows start on different banks
HEAD_DIMS = (64, 128, 256)
DTYPE_NAMES = ("bfloat16", "float16")  # Q, O and the MMAs
FP8 = "float8_e4m3fn"
SMEM_PER_SM = 228 * 1024  # SM90: a CTA may take 227 KiB, and the SM reserves 1 KiB per resident CTA
MAX_STAGES = 3


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Shared-memory plan of one CTA (bytes): Q, staged S, P, row statistics and barriers (``fixed``), then the
    ring of ``stages`` K/V tiles as loaded, the dequantized 16-bit K/V tile of an fp8 cache (``mma_tile``), and the
    fp32 O staged over the ring after the last tile."""

    stages: int
    stage: int
    mma_tile: int
    fixed: int
    ring: int
    ctas_per_sm: int

    @property
    def smem(self) -> int:
        return self.fixed + self.ring


def ring_swizzle(head_dim: int, kv_fp8: bool) -> int:
    """Swizzle width (bytes) of the staged K/V rows: 128, or the whole row when shorter (an fp8 row of 64), so a
    TMA box never spans past the head dim."""
    return min(128, head_dim * (1 if kv_fp8 else 2))


def tiling(head_dim: int, kv_fp8: bool) -> Tiling:
    """The deepest ring (2 or 3 stages) that lets two CTAs share an SM, else one CTA."""
    stage = 2 * BN * head_dim * (1 if kv_fp8 else 2)
    mma_tile = 2 * BN * head_dim * 2 if kv_fp8 else 0
    fixed = BM * head_dim * 2 + BM * (BN + S_PAD) * 4 + BM * BN * 2 + 3 * BM * 4 + 2 * MAX_STAGES * 8 + 3 * 1024
    o_staged = BM * (head_dim + S_PAD) * 4
    for ctas in (2, 1):
        budget = SMEM_PER_SM // ctas - 1024
        stages = min(MAX_STAGES, (budget - fixed - mma_tile) // stage)
        ring = max(stages * stage + mma_tile, o_staged)
        if stages >= 2 and fixed + ring <= budget:
            return Tiling(stages, stage, mma_tile, fixed, ring, ctas)
    raise ValueError(f"head_dim {head_dim} does not fit two K/V stages in shared memory")


@dataclasses.dataclass(frozen=True)
class WSTiling:
    """``PagedAttentionWS``'s plan: ``bn`` keys a tile, ``stages`` 16-bit K and V tiles in their rings (what the MMAs
    read), ``fp8_stages`` fp8 K+V tiles as loaded (an fp8 cache; dequantized into the 16-bit rings), beside the two
    warpgroups' Q tiles (reused for their O) and the barriers (bytes, ``smem``)."""

    bn: int
    stages: int
    fp8_stages: int
    smem: int


WS_BM = 128  # two consumer warpgroups of 64 rows
WS_MAX_STAGES = 4


def ws_tiling(head_dim: int, kv_fp8: bool = False) -> WSTiling:
    """128-key tiles up to head dim 128 (S is 64 registers a thread), 64 at 256 (O takes 128); the deepest rings one
    CTA's shared memory holds: 16-bit caches put all of it in the 16-bit rings, fp8 caches keep two 16-bit stages
    and give the rest to the fp8 ring."""
    bn = 128 if head_dim <= 128 else 64
    q = WS_BM * head_dim * 2
    stage = 2 * bn * head_dim * 2  # K and V, 16-bit
    fixed = q + 2 * WS_MAX_STAGES * 3 * 8 + 1024  # + (full, empty) x (K, V, fp8) barriers, alignment slack
    budget = SMEM_PER_SM - 2048 - fixed
    if not kv_fp8:
        stages = min(WS_MAX_STAGES, budget // stage)
        return WSTiling(bn, stages, 0, fixed + stages * stage)
    fp8_stage = stage // 2
    fp8_stages = min(WS_MAX_STAGES, (budget - 2 * stage) // fp8_stage)
    return WSTiling(bn, 2, fp8_stages, fixed + 2 * stage + fp8_stages * fp8_stage)


def supported(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: Optional[int],
              kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None, *, bm: int = BM,
              bn: int = BN) -> Optional[str]:
    """Why the kernel (``bm`` rows x ``bn`` keys a tile) cannot take the problem, or None."""
    if kv_dtype_name not in (None, FP8, *DTYPE_NAMES):
        return f"the cache dtype must be 16-bit or {FP8}, got {kv_dtype_name}"
    if kv_dtype_name == FP8 and page_size is None:
        return "an fp8 cache must be paged"
    if granularity is not None and (kv_dtype_name != FP8 or granularity < VEC or granularity & (granularity - 1)
                                    or head_dim % granularity):
        return (f"scales need an fp8 cache and a power-of-two granularity >= {VEC} dividing head_dim, "
                f"got {granularity}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"q heads ({num_q_heads}) must be a positive multiple of the KV heads ({num_kv_heads})"
    if num_q_heads // num_kv_heads > bm:
        return f"a GQA group of {num_q_heads // num_kv_heads} heads exceeds the {bm}-row tile"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    if page_size is not None and (page_size < 16 or (page_size % bn and bn % page_size)):
        return f"page_size ({page_size}) must be at least 16 and divide or be divided by the {bn}-key tile"
    return None
