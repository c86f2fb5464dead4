"""``MlaDecodeSm100``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA owns ``BM`` = 128 packed (token, head) rows, one ``tcgen05.mma`` M and one TMEM lane each, and half of the
value width: ``O_COLS`` = 256 of the 512 value columns (``V_SPLIT`` = 2 CTAs per row block). Tensor memory holds two
S tiles of ``BN`` keys (QK of tile j+1 runs during the softmax of tile j) and the O half: ``2 * BN + O_COLS <= 512``.
A whole 128 x 512 float32 O would take all 512 columns and leave none for S; FlashMLA fits 64 heads x 512 in 256
columns with the weight-stationary ``tcgen05.mma.ws`` M=64 layout, which the DSL offers for no 16-bit kind, so the
value columns are split across two CTAs instead (each recomputes S, the MMA work of QK is duplicated, the key rows
are read twice, the second time mostly from L2). Per 32-key tile a CTA issues 36 QK MMAs (128 x 32 x 16) and 2 PV
MMAs (128 x 256 x 16): 2 * 128 * (576 + 256) FLOPs per key a CTA, 1.53x the minimum 2 * 128 * (576 + 512) for the
pair (``python perf/run.py mla-mma-work`` reads it from the PTX). M=64 tiles (non-ws) would not help: their
accumulator still spans N columns, so a 64 x 512 O alone fills tensor memory. What would: ``cta_group::2`` with
M=128, whose accumulator folds each CTA's 64 rows x N onto all 128 lanes in N/2 columns (the DSL's fragment is
``((64, (N/2, 2)), ...)``), so the pair splits the heads and each CTA holds a whole 64 x 512 O in 256 columns, as
FlashMLA's head128 decode does; its QK reads the two N halves of B from the two CTAs, so with Q in tensor memory
(its two column halves in the two lane halves) an N = 2 x keys MMA takes each half of the latent columns from the
CTA holding it: a key row is loaded once for the pair, S is the sum of the halves and V is split by columns.

Shared memory holds Q (128 x 576 16-bit: 144 KiB), P (16-bit, the PV MMA's A operand) and a ring of key tiles of
``BN`` rows x the full latent width; the first 512 columns of a key tile are its values (V = the same bytes read
MN-major), so a tile is loaded once for both MMAs. 227 KiB leave room for two stages of 32 keys.

Rope-aware FP8 caches (rows ``[512 e4m3 | 64 bf16]``, one float32 scale per token): the load warp brings each key
tile's content by gather4 into an fp8 landing stage (4 x 128-byte boxes at byte 0 of the rows), its rope by the bf16
rope gather4 (a box at byte ``padded_depth``) into a bf16 landing stage, and its scales (``ld.global`` by the lane
resolving the row) into a float32 array; a converter warpgroup writes ``bf16(content * scale) | rope`` into a 16-bit
``BN x 576`` tile the MMAs read (both: V is its first 512 columns). The per-token scale is applied there, not folded
into S: ``S[:, j] = s_j (q_c . c_j) + q_r . r_j`` would need the content and rope products in separate TMEM
accumulators and a per-column scale in the softmax, and V = ``c_j s_j`` (or ``P[:, j] s_j``) needs the conversion of
the same e4m3 bytes to 16 bits anyway (``kind::f16`` takes no e4m3 B beside a bf16 A), so the fold would only move
one multiply per element out of the converter. Two converted tiles (QK of tile j + 1 while P V of tile j waits on
the softmax) of 32 keys would not fit next to Q, so the fp8 kernel tiles ``FP8_BN`` = 16 keys: Q 144 KiB, P 4 KiB,
two 18 KiB converted tiles and ``stages`` 10 KiB landing stages (4: 226 KiB in all). 36 QK MMAs (N = 16) and one
PV MMA (K = 16) per tile.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cute_kv.kernels.attention.config import DTYPE_NAMES

BM = 128
BN = 32
STAGES = 2
O_COLS = 256  # value columns per CTA
V_SPLIT = 2  # CTAs sharing a row block, one value half each
TMEM_COLUMNS = 512  # allocation (a power of two): S double buffer + the O half use 2 * BN + O_COLS
SMEM_PER_CTA = 227 * 1024
RESERVED_BYTES = 64
GATHER_WIDTH = 64  # 16-bit columns per gather4: one 128-byte swizzle row
LATENT_DIMS = (576,)  # kv_lora_rank + rope_dim of DeepSeek-V2/V3 (512 + 64)
V_DIMS = (512,)
ROPE_DIMS = (64,)  # rope-aware FP8 rows: bf16 rope values after padded_depth = latent_dim - rope_dim e4m3 bytes
FP8 = "float8_e4m3fn"
FP8_BN = 16
FP8_MMA_STAGES = 2  # converted 16-bit tiles
MAX_STAGES = 4
ROW_LANES = 32  # a stage's row (and scale) array: one entry per load-warp lane


@dataclasses.dataclass(frozen=True)
class MlaTiling:
    """Key tile ``bn``, landing ``stages``; bytes of the barriers, row (and scale) arrays ahead of the 1024-aligned
    tiles (``fixed``), of Q, P, one key stage as loaded and (rope-aware fp8) the converted 16-bit tiles the MMAs
    read (``mma_tiles``); TMEM columns used."""

    latent_dim: int
    bn: int
    stages: int
    fixed: int
    q_bytes: int
    p_bytes: int
    stage_bytes: int
    mma_tiles: int = 0

    @property
    def smem(self) -> int:
        return self.fixed + self.q_bytes + self.p_bytes + self.stages * self.stage_bytes + self.mma_tiles

    @property
    def tmem_columns(self) -> int:
        return 2 * self.bn + O_COLS


def tiling(latent_dim: int, rope_dim: Optional[int] = None) -> MlaTiling:
    """16-bit caches: ``STAGES`` stages of ``BN`` keys x ``latent_dim``. Rope-aware fp8: ``FP8_BN`` keys, the
    deepest landing ring (content + rope bytes a stage) that fits beside two converted tiles."""
    if rope_dim is None:
        used = RESERVED_BYTES + 8 * (2 * STAGES + 4 + 2) + 4 * BN * STAGES
        plan = MlaTiling(latent_dim, BN, STAGES, -(-used // 1024) * 1024, BM * latent_dim * 2, BM * BN * 2,
                         BN * latent_dim * 2)
        assert plan.smem <= SMEM_PER_CTA and plan.tmem_columns <= TMEM_COLUMNS
        return plan
    bn, content = FP8_BN, latent_dim - rope_dim
    for stages in range(MAX_STAGES, 1, -1):
        # barriers: landing full/empty, S, P/O, converted full/empty; per stage a row and a scale array of a
        # load-warp lane each
        used = RESERVED_BYTES + 8 * (2 * stages + 4 + 2 + 2 * FP8_MMA_STAGES) + 2 * 4 * ROW_LANES * stages
        plan = MlaTiling(latent_dim, bn, stages, -(-used // 1024) * 1024, BM * latent_dim * 2, BM * bn * 2,
                         bn * (content + 2 * rope_dim), FP8_MMA_STAGES * bn * latent_dim * 2)
        if plan.smem <= SMEM_PER_CTA:
            return plan
    raise ValueError(f"latent_dim {latent_dim} does not fit two fp8 landing stages in shared memory")


def supported(q_dtype_name: str, kv_dtype_name: str, latent_dim: int, v_dim: int,
              page_size: Optional[int], rope_dim: Optional[int] = None) -> Optional[str]:
    """Why the SM100 MLA kernel cannot take the problem, or None."""
    if rope_dim is not None:
        if kv_dtype_name != FP8 or q_dtype_name not in DTYPE_NAMES:
            return f"the SM100 MLA kernel reads rope-aware rows as {FP8} beside 16-bit q, got {q_dtype_name} and " \
                   f"{kv_dtype_name}"
        if rope_dim not in ROPE_DIMS:
            return f"the SM100 MLA kernel takes rope-aware rows of rope_dim {ROPE_DIMS}, got {rope_dim}"
    elif kv_dtype_name not in DTYPE_NAMES or kv_dtype_name != q_dtype_name:
        return f"the SM100 MLA kernel needs q and the cache in the same 16-bit dtype, got {q_dtype_name} and " \
               f"{kv_dtype_name}"
    if latent_dim not in LATENT_DIMS:
        return f"the SM100 MLA kernel takes latent dims {LATENT_DIMS}, got {latent_dim}"
    if v_dim not in V_DIMS:
        return f"the SM100 MLA kernel takes mla_v_dim {V_DIMS}, got {v_dim}"
    if page_size is None or page_size < 1:
        return "the SM100 MLA kernel reads paged caches"
    return None
