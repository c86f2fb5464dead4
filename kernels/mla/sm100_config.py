"""``MlaDecodeSm100``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA owns ``BM`` = 128 packed (token, head) rows, one ``tcgen05.mma`` M and one TMEM lane each, and half of the
value width: ``O_COLS`` = 256 of the 512 value columns (``V_SPLIT`` = 2 CTAs per row block). Tensor memory holds two
S tiles of ``BN`` keys (QK of tile j+1 runs during the softmax of tile j) and the O half: ``2 * BN + O_COLS <= 512``.
A whole 128 x 512 float32 O would take all 512 columns and leave none for S; FlashMLA fits 64 heads x 512 in 256
columns with the weight-stationary ``tcgen05.mma.ws`` M=64 layout, which the DSL offers for no 16-bit kind, so the
value columns are split across two CTAs instead (each recomputes S, the MMA work of QK is duplicated, the key rows
are read twice, the second time mostly from L2). Per 32-key tile a CTA issues 36 QK MMAs (128 x 32 x 16) and 2 PV
MMAs (128 x 256 x 16). M=64 tiles (non-ws) would not help: their accumulator still spans N columns, so a 64 x 512 O
alone fills tensor memory.

Shared memory holds Q (128 x 576 16-bit: 144 KiB), P (16-bit, the PV MMA's A operand) and a ring of key tiles of
``BN`` rows x the full latent width; the first 512 columns of a key tile are its values (V = the same bytes read
MN-major), so a tile is loaded once for both MMAs. 227 KiB leave room for two stages of 32 keys.
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


@dataclasses.dataclass(frozen=True)
class MlaTiling:
    """Bytes of the barriers and gather4 row arrays ahead of the 1024-aligned tiles (``fixed``), of Q, P and one
    key tile; TMEM columns used."""

    latent_dim: int
    fixed: int
    q_bytes: int
    p_bytes: int
    stage_bytes: int

    @property
    def smem(self) -> int:
        return self.fixed + self.q_bytes + self.p_bytes + STAGES * self.stage_bytes

    @property
    def tmem_columns(self) -> int:
        return 2 * BN + O_COLS


def tiling(latent_dim: int) -> MlaTiling:
    used = RESERVED_BYTES + 8 * (2 * STAGES + 4 + 2) + 4 * BN * STAGES
    plan = MlaTiling(latent_dim, -(-used // 1024) * 1024, BM * latent_dim * 2, BM * BN * 2, BN * latent_dim * 2)
    assert plan.smem <= SMEM_PER_CTA and plan.tmem_columns <= TMEM_COLUMNS
    return plan


def supported(q_dtype_name: str, kv_dtype_name: str, latent_dim: int, v_dim: int,
              page_size: Optional[int], rope_dim: Optional[int] = None) -> Optional[str]:
    """Why the SM100 MLA kernel cannot take the problem, or None."""
    if rope_dim is not None:
        return "the SM100 MLA kernel reads 16-bit caches; the rope-aware fp8 cache is not served yet"
    if kv_dtype_name not in DTYPE_NAMES or kv_dtype_name != q_dtype_name:
        return f"the SM100 MLA kernel needs q and the cache in the same 16-bit dtype, got {q_dtype_name} and " \
               f"{kv_dtype_name}"
    if latent_dim not in LATENT_DIMS:
        return f"the SM100 MLA kernel takes latent dims {LATENT_DIMS}, got {latent_dim}"
    if v_dim not in V_DIMS:
        return f"the SM100 MLA kernel takes mla_v_dim {V_DIMS}, got {v_dim}"
    if page_size is None or page_size < 1:
        return "the SM100 MLA kernel reads paged caches"
    return None
