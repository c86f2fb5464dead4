"""``MLADecode``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA is ``BM = 64`` packed (token, head) rows, one wgmma M, over the one latent KV head: all query heads share its
rows, so a key tile is read once per 64 heads. Key tiles are ``BN = 64`` rows of ``latent_dim`` (DeepSeek 576 =
512 + 64). Both consumer warpgroups hold the same 64 rows: each computes S for half of the tile's keys, the two
exchange row maxima and write their halves of P to shared memory, and each accumulates half of O's ``v_dim``
columns (256 of 512: 128 float32 registers a thread) from the whole P and the first ``v_dim`` columns of the same
K stage (V is never loaded on its own).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

BM = 64  # packed rows per CTA: one wgmma M, shared by both consumer warpgroups
BN = 64  # keys per tile; each warpgroup takes S for BN/2 of them
STAGES = 2
VEC = 8  # 16-bit elements per 16-byte access
DTYPE_NAMES = ("bfloat16", "float16")
ATOM = 64  # 16-bit elements of one 128-byte swizzle row: latent and value widths come in these
MAX_V_HALF = 256  # one wgmma N: each warpgroup's half of O
SMEM_PER_CTA = 227 * 1024


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Bytes of one CTA's shared memory: barriers and the row-statistics exchange, one alignment slack, then the Q
    tile, the K ring and the P tile (each 1024-byte aligned)."""

    q: int
    ring: int
    p: int
    smem: int


def tiling(latent_dim: int) -> Tiling:
    q = BM * latent_dim * 2
    ring = STAGES * BN * latent_dim * 2
    p = BM * BN * 2
    small = 2 * STAGES * 8 + 2 * (2 * BM * 4)  # (full, empty) barriers; row maxima and sums of both warpgroups
    return Tiling(q, ring, p, small + 1024 + q + ring + p)


def supported(num_q_heads: int, latent_dim: int, v_dim: int, page_size: int, dtype_name: str) -> Optional[str]:
    """Why the kernel cannot take the problem, or None."""
    if dtype_name not in DTYPE_NAMES:
        return f"the MLA kernel takes a {' or '.join(DTYPE_NAMES)} cache, got {dtype_name}"
    if num_q_heads <= 0:
        return f"q heads must be positive, got {num_q_heads}"
    if latent_dim % ATOM or tiling(latent_dim).smem > SMEM_PER_CTA:
        return (f"latent_dim ({latent_dim}) must be a multiple of {ATOM} whose Q tile and two key stages fit in "
                f"shared memory (at most {max_latent_dim()})")
    if v_dim % (2 * ATOM) or v_dim > min(latent_dim, 2 * MAX_V_HALF):
        return (f"mla_v_dim ({v_dim}) must be a multiple of {2 * ATOM} up to {2 * MAX_V_HALF} and the latent dim "
                f"({latent_dim}): each consumer warpgroup takes half of it")
    if page_size < 16 or (page_size % BN and BN % page_size):
        return f"page_size ({page_size}) must be at least 16 and divide or be divided by the {BN}-key tile"
    return None


def max_latent_dim() -> int:
    d = ATOM
    while tiling(d + ATOM).smem <= SMEM_PER_CTA:
        d += ATOM
    return d
