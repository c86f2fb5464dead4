"""``MLADecode``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA is ``BM = 64`` packed (token, head) rows, one wgmma M, over the one latent KV head: all query heads share its
rows, so a key tile is read once per 64 heads. Key tiles are ``BN = 64`` rows of ``latent_dim`` (DeepSeek 576 =
512 + 64). Both consumer warpgroups hold the same 64 rows: each computes S for half of the tile's keys, the two
exchange row maxima and write their halves of P to shared memory, and each accumulates half of O's ``v_dim``
columns (256 of 512: 128 float32 registers a thread) from the whole P and the first ``v_dim`` columns of the same
K stage (V is never loaded on its own).

A rope-aware FP8 cache (rows ``[padded_depth e4m3 | rope_dim bf16]``, one float32 scale per token) keeps this plan:
its e4m3 content lands by TMA in the upper half of the content bytes of the 16-bit stage it is dequantized into
(``BN * padded_depth`` bytes in, the columns the dequantization writes last), its rope by TMA straight into the
stage's rope columns; the only addition is one "landed" barrier per stage (``sm90.py`` says why).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cute_kv.kernels.attention.config import combine_problem

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


ROPE_DIM = ATOM  # bf16 rope values of a rope-aware row the kernel takes: one 128-byte swizzle row of the stage
FP8_BLOCK = 128  # e4m3 content bytes of one 128-byte swizzle row of the landed tile


def tiling(latent_dim: int, rope: bool = False) -> Tiling:
    q = BM * latent_dim * 2
    ring = STAGES * BN * latent_dim * 2
    p = BM * BN * 2
    small = (3 if rope else 2) * STAGES * 8 + 2 * (2 * BM * 4)  # (full, empty[, landed]) barriers; row statistics
    return Tiling(q, ring, p, small + 1024 + q + ring + p)


def supported(num_q_heads: int, latent_dim: int, v_dim: int, page_size: int, dtype_name: str,
              rope_dim: int = 0) -> Optional[str]:
    """Why the kernel cannot take the problem, or None. ``rope_dim``: a rope-aware FP8 cache (q bf16), whose
    ``latent_dim`` is ``padded_depth + rope_dim``."""
    if rope_dim:
        padded_depth = latent_dim - rope_dim
        if dtype_name != "bfloat16":
            return f"a rope-aware FP8 cache takes bfloat16 q (its rope part is bf16), got {dtype_name}"
        if rope_dim != ROPE_DIM or padded_depth <= 0 or padded_depth % FP8_BLOCK:
            return (f"the kernel reads rope-aware rows of rope_dim {ROPE_DIM} and a padded_depth that is a multiple "
                    f"of {FP8_BLOCK}, got rope_dim {rope_dim}, padded_depth {padded_depth}")
        if v_dim > padded_depth:
            return f"mla_v_dim ({v_dim}) must be at most the padded_depth ({padded_depth}): values are content"
    elif dtype_name not in DTYPE_NAMES:
        return f"the MLA kernel takes a {' or '.join(DTYPE_NAMES)} cache, got {dtype_name}"
    if num_q_heads <= 0:
        return f"q heads must be positive, got {num_q_heads}"
    if latent_dim % ATOM or tiling(latent_dim).smem > SMEM_PER_CTA:
        return (f"latent_dim ({latent_dim}) must be a multiple of {ATOM} whose Q tile and two key stages fit in "
                f"shared memory (at most {max_latent_dim()})")
    if v_dim % (2 * ATOM) or v_dim > min(latent_dim, 2 * MAX_V_HALF):
        return (f"mla_v_dim ({v_dim}) must be a multiple of {2 * ATOM} up to {2 * MAX_V_HALF} and the latent dim "
                f"({latent_dim}): each consumer warpgroup takes half of it")
    problem = combine_problem(v_dim)  # a split-KV launch merges its splits over the v_dim columns
    if problem:
        return f"mla_v_dim ({v_dim}): {problem}"
    if page_size < 16 or (page_size % BN and BN % page_size):
        return f"page_size ({page_size}) must be at least 16 and divide or be divided by the {BN}-key tile"
    return None


def max_latent_dim() -> int:
    d = ATOM
    while tiling(d + ATOM).smem <= SMEM_PER_CTA:
        d += ATOM
    return d
