"""``PagedAttentionSm100``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA owns 128 packed query rows (one ``tcgen05.mma`` M, one TMEM lane per row) and walks key tiles of ``BN``
keys. Tensor memory holds two S tiles (QK of tile j+1 runs while the softmax reads tile j), each tile's P (16-bit,
the PV MMA's A operand) over the upper half of its S, and the O accumulator: ``2 * BN + D_v <= 512`` columns, so one
CTA per SM. Values are ``D_v = D`` wide, or narrower where ``VALUE_DIMS`` says (MLA prefill's decompressed heads: K of
nope + rope = 192, V of 128; the V rows are the cache's ``D``-wide rows, of which the first ``D_v`` are read). At
192 / 128 one 48 KiB Q tile leaves room for two 128-key K+V stages (2 x 80 KiB; 209 KiB in all) and O takes 128 of
the 512 columns (384 used). FA4's forward at this pair instead keeps two Q tiles (96 KiB, two softmax warpgroups:
each K/V tile serves 256 rows) and O twice (all 512 columns), so its K and V share a ring of three tile slots,
alternating 48 and 32 KiB ones; one Q tile here keeps this kernel's single softmax warpgroup and its 128-row grid.
Shared memory holds Q and a ring of K/V stages, as deep as the 227 KiB a CTA may take allows. Any page size: pages
that tile the key tile load by one TMA per page slot, others by gather4 (``uses_gather4``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cute_kv.kernels.attention.config import (BM, DTYPE_NAMES, FP8, HEAD_DIMS, VALUE_DIMS, VEC,  # noqa: F401
                                               head_problem)

# BM: 128 packed query rows per CTA, the tcgen05.mma M (one TMEM lane each), as on SM90 (two warpgroups of 64).
TMEM_COLUMNS = 512  # all of an SM's tensor memory: S double buffer + O
SMEM_PER_CTA = 227 * 1024
MAX_STAGES = 4
RESERVED_BYTES = 64  # the TMEM address slot and what else the DSL reserves ahead of the kernel's buffers


@dataclasses.dataclass(frozen=True)
class Sm100Tiling:
    """Key tile ``bn``, K/V ring ``stages``, K/V by ``gather4``; bytes of the barriers and gather4 row arrays ahead
    of the 1024-aligned tiles (``fixed``), of Q, one K+V stage as loaded, O's width ``v_dim`` (TMEM columns), and the
    16-bit K and V tiles the MMAs read when an fp8 ring is dequantized (``mma_tiles``, 0 otherwise)."""

    bn: int
    stages: int
    gather4: bool
    fixed: int
    q_bytes: int
    stage_bytes: int
    v_dim: int
    mma_tiles: int = 0

    @property
    def smem(self) -> int:
        return self.fixed + self.q_bytes + self.stages * self.stage_bytes + self.mma_tiles

    @property
    def tmem_columns(self) -> int:
        """Columns used: S tiles at ``[0, 2*bn)`` (P in the upper half of each), O at ``[2*bn, 2*bn + D_v)``."""
        return 2 * self.bn + self.v_dim


def key_tile(head_dim: int, v_dim: Optional[int] = None) -> int:
    """128 keys per tile where Q and two 128-key 16-bit K+V stages fit in shared memory (D_v = D up to 128: 160 KiB;
    192 / 128: 208 KiB); else 64 (head dim 256, where one 128-key K+V stage alone would take 128 KiB)."""
    v_dim = v_dim or head_dim
    two_stages = BM * head_dim * 2 + 2 * 128 * (head_dim + v_dim) * 2 + fixed_bytes(128, 2, False)
    return 128 if two_stages <= SMEM_PER_CTA else 64


def fixed_bytes(bn: int, stages: int, gather4: bool) -> int:
    """Barriers (K/V ring full/empty, S x2, P, dequantized K and V) and, for gather4, one int32 row per key per
    stage, rounded up to the 1024-byte alignment of the tiles that follow."""
    used = RESERVED_BYTES + 8 * (2 * stages + 4 + 2 + 4) + (4 * bn * stages if gather4 else 0)
    return -(-used // 1024) * 1024


def tiling(head_dim: int, page_size: int, kv_fp8: bool = False, v_dim: Optional[int] = None) -> Sm100Tiling:
    """The deepest K/V ring (2 to ``MAX_STAGES``) that fits next to Q (and, for fp8, one 16-bit K and V tile)."""
    v_dim = v_dim or head_dim
    bn = key_tile(head_dim, v_dim)
    gather4 = uses_gather4(page_size, bn)
    q_bytes, stage_bytes = BM * head_dim * 2, bn * (head_dim + v_dim) * (1 if kv_fp8 else 2)
    mma_tiles = bn * (head_dim + v_dim) * 2 if kv_fp8 else 0
    for stages in range(MAX_STAGES, 1, -1):
        plan = Sm100Tiling(bn, stages, gather4, fixed_bytes(bn, stages, gather4), q_bytes, stage_bytes, v_dim,
                           mma_tiles)
        if plan.smem <= SMEM_PER_CTA:
            assert plan.tmem_columns <= TMEM_COLUMNS
            return plan
    raise ValueError(f"head_dim {head_dim} does not fit two K/V stages in shared memory")


def uses_gather4(page_size: int, bn: int) -> bool:
    """K/V rows by gather4 (4 arbitrary rows per TMA, each token's row computed on its own) for pages under 8 rows
    (a tiled box must cover whole 8-row swizzle atoms), or pages that neither divide nor are divided by the key tile;
    else one tiled TMA per page slot, which moves 8 or more rows per instruction (gather4 moves 4)."""
    return page_size < 8 or (page_size % bn != 0 and bn % page_size != 0)


def supported(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: Optional[int],
              kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None,
              v_dim: Optional[int] = None) -> Optional[str]:
    """Why the SM100 kernel cannot take the problem, or None."""
    if kv_dtype_name not in (FP8, *DTYPE_NAMES):
        return f"the SM100 kernel reads 16-bit or {FP8} caches, got {kv_dtype_name}"
    if page_size is None:
        return "the SM100 kernel reads paged caches"
    problem = head_problem(num_q_heads, num_kv_heads, head_dim, kv_dtype_name, granularity, v_dim)
    if problem:
        return problem
    if page_size < 1:
        return f"page_size must be positive, got {page_size}"
    return None
