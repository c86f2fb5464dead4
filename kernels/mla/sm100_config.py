"""``MlaDecodeSm100``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A row block of ``BM`` = 128 packed (token, head) rows (one ``tcgen05.mma`` M, one TMEM lane each) is served by a
cluster of ``V_SPLIT`` = 2 CTAs, one per value half: CTA ``r`` holds ``O_COLS`` = 256 of the 512 value columns of O
in tensor memory (a whole 128 x 512 float32 O would take all 512 columns and leave none for S). Neither recomputes
the other's QK: CTA ``r`` keeps only the ``SLICE`` = 320 latent columns ``[r * O_COLS, r * O_COLS + SLICE)`` of Q
and of each key row (its value half, and for CTA 1 the rope), multiplies the ``QK_COLS`` = 288 columns ``[r * 288,
(r + 1) * 288)`` into a partial S (``QK_OFFSET`` = 32 columns into CTA 1's slice), and the two partials are summed
through distributed shared memory: each softmax thread stores its row of the partial into the peer's exchange buffer
(``st.async``, which completes the peer's transaction barrier) and adds the peer's. Float addition commutes, so both
CTAs hold the same S bit for bit, run the same softmax and write P V for their own value half. Per 32-key tile a CTA
issues 18 QK MMAs (128 x 32 x 16) and 2 PV MMAs (128 x 256 x 16): 2 * 128 * (288 + 256) FLOPs per key a CTA, the
pair exactly the minimum 2 * 128 * (576 + 512) (``python perf/run.py mla-mma-work`` reads it from the PTX); a key
row's 1,152 bytes are loaded as 2 x 640 (the 64 columns [256, 320) by both). The exchange costs 512 bytes of
distributed shared memory per key and CTA (128 float32 partial scores), beside 640 bytes of key loads (384 for fp8
rows), and a round trip between the CTAs on the softmax's path each tile (the QK of the next tile proceeds
meanwhile); warps whose 32 rows are all padding (fewer than 128 packed rows, e.g. 16 heads of one token) stay out.
The wait on the exchange is followed by a cluster-scope acquire of the completed phase (in SASS a phase check and an
L1 invalidation per softmax warp and tile): the peer's ``st.async`` releases at cluster scope, which a wait acquiring
at CTA scope does not formally pair with. FlashMLA's head-128 decode reaches the minimum with a ``cta_group::2`` pair
instead, splitting the heads and folding each CTA's 64 x 512 O onto 128 lanes.

Shared memory holds the Q slice (128 x 320 16-bit: 80 KiB), P (16-bit, the PV MMA's A operand), the two exchange
buffers (128 x ``bn`` float32 each) and a ring of key slices of ``bn`` rows x ``SLICE`` columns; the first 256
columns of a slice are the CTA's values (V = the same bytes read MN-major), so a tile is loaded once for both MMAs.

Rope-aware FP8 caches (rows ``[512 e4m3 | 64 bf16]``, one float32 scale per token): the load warp brings the 128-byte
content boxes of each key tile its slice needs (CTA 0 boxes 0-2, CTA 1 boxes 2-3 and the rope: the same bytes) by
gather4 into an fp8 landing stage, its rope (CTA 1) by the bf16 rope gather4 (a box at byte ``padded_depth``) into a
bf16 landing stage, and its scales (``ld.global`` by the lane resolving the row) into a float32 array; a converter
warpgroup writes the slice of ``bf16(content * scale) | rope`` into a 16-bit ``bn x SLICE`` tile the MMAs read. The
per-token scale is applied there, not folded into S: ``S[:, j] = s_j (q_c . c_j) + q_r . r_j`` would need the
content and rope products in separate TMEM accumulators and a per-column scale in the softmax, and V = ``c_j s_j``
needs the conversion of the same e4m3 bytes to 16 bits anyway (``kind::f16`` takes no e4m3 B beside a bf16 A). The
fp8 kernel tiles ``FP8_BN`` = 16 keys (one PV MMA of K = 16 a tile).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cute_kv.kernels.attention.config import DTYPE_NAMES

BM = 128
BN = 32
O_COLS = 256  # value columns per CTA
V_SPLIT = 2  # CTAs of a cluster sharing a row block, one value half each
SLICE = 320  # latent columns a CTA holds of Q and of each key row, from r * O_COLS
QK_COLS = 288  # latent columns a CTA multiplies into its partial S, from r * QK_COLS
QK_OFFSET = QK_COLS - O_COLS  # where CTA 1's QK columns start in its slice
EXCHANGE = 2  # partial-S buffers (tile j + 1's partial may arrive while tile j's is read)
# The column arithmetic below is a pair's: the second CTA's QK columns continue the first's, at an MMA K step.
assert V_SPLIT == 2 and QK_OFFSET % 16 == 0 and QK_OFFSET + QK_COLS <= SLICE
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
CONTENT_BOX = 128  # e4m3 columns per content gather4: one 128-byte swizzle row
ROW_LANES = 32  # a stage's row (and scale) array: one entry per load-warp lane


@dataclasses.dataclass(frozen=True)
class MlaTiling:
    """Key tile ``bn``, landing ``stages``; bytes of the barriers, row (and scale) arrays ahead of the 1024-aligned
    tiles (``fixed``), of the Q slice, P, the partial-S exchange buffers, one key stage as laid out and as loaded
    (``tx_bytes``: an fp8 stage holds every content box, a CTA loads those of its slice) and (rope-aware fp8) the
    converted 16-bit tiles the MMAs read (``mma_tiles``); TMEM columns used."""

    latent_dim: int
    bn: int
    stages: int
    fixed: int
    q_bytes: int
    p_bytes: int
    exchange_bytes: int
    stage_bytes: int
    tx_bytes: int
    mma_tiles: int = 0

    @property
    def smem(self) -> int:
        return (self.fixed + self.q_bytes + self.p_bytes + self.exchange_bytes + self.stages * self.stage_bytes
                + self.mma_tiles)

    @property
    def tmem_columns(self) -> int:
        return 2 * self.bn + O_COLS


def slice_start(rank):
    """The first latent column of CTA ``rank``'s slice (a Python int, or the kernel's ``Int32``)."""
    return rank * O_COLS


def qk_start(rank):
    """Where CTA ``rank``'s ``QK_COLS`` columns start in its slice."""
    return rank * QK_OFFSET


def exchange_slot(j):
    """``(buffer, parity)`` of tile ``j``'s partial-S exchange: the buffers alternate, so a buffer's barrier
    completes its phase ``j // EXCHANGE`` for tile ``j``, and a wait on that phase waits on its parity."""
    return j % EXCHANGE, (j // EXCHANGE) % 2


def live_warps(rows):
    """Softmax warps holding one of a row block's ``rows`` (1 to ``BM``) packed rows that are not padding, the
    others' rows all padding: the warps that take part in the exchange (the same in both CTAs of the pair)."""
    return (rows + 31) // 32


def exchange_rotation(row, chunks: int):
    """The rotation of row ``row``'s ``chunks`` 16-byte chunks in an exchange buffer (``chunk ^ rotation``): the
    8 threads of a 128-byte access phase, ``8 / chunks`` rows to a 128-byte line, land in 8 distinct bank
    groups."""
    return (row // (8 // chunks)) % chunks


def content_boxes(rank: int, content_dim: int) -> range:
    """The 128-byte content boxes of a rope-aware fp8 row CTA ``rank``'s slice reads."""
    first = slice_start(rank)
    return range(first // CONTENT_BOX, -(-min(first + SLICE, content_dim) // CONTENT_BOX))


def tiling(latent_dim: int, rope_dim: Optional[int] = None) -> MlaTiling:
    """The deepest landing ring (up to ``MAX_STAGES``) that fits beside the Q slice, P, the exchange buffers and
    (rope-aware fp8) two converted tiles: ``BN`` keys x ``SLICE`` columns a stage for 16-bit caches; ``FP8_BN``
    keys of content + rope bytes for fp8, of which a CTA loads its slice's boxes (the same count for both ranks)."""
    fp8 = rope_dim is not None
    bn = FP8_BN if fp8 else BN
    content = latent_dim - rope_dim if fp8 else latent_dim
    if fp8:
        loads = [bn * (CONTENT_BOX * len(content_boxes(r, content)) + 2 * rope_dim * r) for r in range(V_SPLIT)]
        assert loads[0] == loads[1], loads  # one transaction count for the kernel
        stage, tx, converted = bn * (content + 2 * rope_dim), loads[0], FP8_MMA_STAGES * bn * SLICE * 2
    else:
        stage = tx = bn * SLICE * 2
        converted = 0
    for stages in range(MAX_STAGES, 1, -1):
        # barriers: landing full/empty, S, P/O, exchange (fp8: converted full/empty); per stage a row array (fp8:
        # and a scale array) of a load-warp lane each
        used = (RESERVED_BYTES + 8 * (2 * stages + 4 + 2 + EXCHANGE + (2 * FP8_MMA_STAGES if fp8 else 0))
                + (2 if fp8 else 1) * 4 * ROW_LANES * stages)
        plan = MlaTiling(latent_dim, bn, stages, -(-used // 1024) * 1024, BM * SLICE * 2, BM * bn * 2,
                         EXCHANGE * BM * bn * 4, stage, tx, converted)
        if plan.smem <= SMEM_PER_CTA:
            assert plan.tmem_columns <= TMEM_COLUMNS
            return plan
    raise ValueError(f"latent_dim {latent_dim} does not fit two landing stages in shared memory")


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
