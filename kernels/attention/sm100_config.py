"""``PagedAttentionSm100``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass.

A CTA owns ``q_tiles`` (1 or 2) tiles of 128 packed query rows (one ``tcgen05.mma`` M, one TMEM lane per row, one
softmax warpgroup each) and walks key tiles of ``BN`` keys; each K/V tile serves all of the CTA's rows. Tensor
memory holds two S tiles (each Q tile's own with two Q tiles, FA4's plan: one Q tile's softmax runs while the
other's QK and PV are on the tensor core; with one Q tile QK of key tile j+1 runs while the softmax reads tile j),
each tile's P (16-bit, the PV MMA's A operand) over the upper half of its S, and one O accumulator per Q tile: ``2 *
BN + q_tiles * D_v <= 512`` columns, so one CTA per SM. Two Q tiles where that and two K/V stages fit: 16-bit caches
with ``D_v = D <= 128`` (D = 128: 2 x 128 + 2 x 128 = all 512 columns), unless registers do not (``q_tiles``). One Q
tile otherwise: head dims 80, 96 and 192 (registers for two measured at D = 64 and 128 only), 256 (64-key tiles: 2 x
64 + 2 x 256 = 640 columns), K of 192 / V of 128 (two 48 KiB Q tiles and two 80 KiB K+V stages are 256 KiB; FA4
there shares one ring of alternating K and V slots), and fp8 caches (their converter warpgroup would make five
warpgroups: under 104 registers a thread). Values are ``D_v = D`` wide, or narrower where ``VALUE_DIMS`` says (MLA
prefill's decompressed heads: K of nope + rope = 192, V of 128; the V rows are the cache's ``D``-wide rows, of which
the first ``D_v`` are read). Shared memory holds Q and a ring of K/V stages, as deep as the 227 KiB a CTA may take
allows. Any page size: pages that tile the key tile load by one TMA per page slot, others by gather4
(``uses_gather4``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from cute_kv.kernels.attention.config import (BM, DTYPE_NAMES, FP8, HEAD_DIMS, VALUE_DIMS, VEC,  # noqa: F401
                                               head_problem, ring_swizzle)

# BM: 128 packed query rows per CTA, the tcgen05.mma M (one TMEM lane each), as on SM90 (two warpgroups of 64).
TMEM_COLUMNS = 512  # all of an SM's tensor memory: two S tiles + an O per Q tile
SMEM_PER_CTA = 227 * 1024
MAX_STAGES = 4
RESERVED_BYTES = 64  # the TMEM address slot and what else the DSL reserves ahead of the kernel's buffers
SLOTS = 2  # S / P tiles in TMEM
# mbarriers besides the K/V ring's full/empty pairs: S full, P / O ready and PV done per S slot; the final row
# statistics per Q tile; fp8's dequantized K and V tiles (full, empty each). (O's correction factors go by named
# barriers.)
BARRIERS = 3 * SLOTS + 2 + 4
RESCALE_THRESHOLD = 8.0  # log2 units a row max may rise by and not be taken (P <= 2^8: far inside 16 bits' range)
# Exponentials of a middle 32-score piece (neither a row's first nor its last) taken by exp2 on the FMA pipe, in
# pairs of the piece's 16 (its first pairs: with pairs spread over the piece or at its end ptxas kept more MUFU
# results live and spilled the softmax at two Q tiles), by Q tiles a CTA holds: 4 at two Q tiles (16 of a 128-key
# row's 128), 6 at one (24), FA4's shares (its ``ex2_emu_freq`` 16 and 10, which it picks by 2-CTA and causal rather
# than Q tiles), so the MUFU issues no more than FA4's per key tile. Masked tiles (a row block's causal diagonal or
# window edge, the keys' end; every tile with the soft-cap) and fp8 caches (whose converter warpgroup leaves the
# softmax 200 or 184 registers) take ``EXP2_EMULATION_TIGHT``: ptxas spilled the softmax with more (the mask's bits
# and selects at two Q tiles, for sm_103a from 2 pairs; fp8 from 2). FA4 keeps its rate in masked tiles: their
# MUFU.EX2 is 125 here against its 113.
EXP2_EMULATION = {2: 4, 1: 6}
EXP2_EMULATION_TIGHT = 1
# 2^f on [0, 1) to 8.8e-5 relative (a degree-3 minimax fit, FA4's): below the 16-bit P's rounding.
EXP2_POLY = (1.0, 0.695146143436431884765625, 0.227564394474029541015625, 0.077119089663028717041015625)


def exp2_emulation(head_dim: int, q_tiles: int, masked: bool, kv_fp8: bool = False) -> int:
    """Pairs of each middle piece emulated (``EXP2_EMULATION``), at head dims up to 128 (beyond, the softmax's
    registers hold a row of S and O's wider pieces and nothing is emulated)."""
    if head_dim > 128:
        return 0
    return EXP2_EMULATION_TIGHT if masked or kv_fp8 else EXP2_EMULATION[q_tiles]


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
    q_tiles: int = 1

    @property
    def smem(self) -> int:
        return self.fixed + self.q_bytes + self.stages * self.stage_bytes + self.mma_tiles

    @property
    def tmem_columns(self) -> int:
        """Columns used: S tiles at ``[0, 2*bn)`` (P in the upper half of each), Q tile t's O at ``2*bn + t*D_v``."""
        return SLOTS * self.bn + self.q_tiles * self.v_dim

    @property
    def rows(self) -> int:
        """Packed query rows a CTA owns."""
        return self.q_tiles * BM


def key_tile(head_dim: int, v_dim: Optional[int] = None) -> int:
    """128 keys per tile where Q and two 128-key 16-bit K+V stages fit in shared memory (D_v = D up to 128: 160 KiB;
    192 / 128: 208 KiB); else 64 (head dim 256, where one 128-key K+V stage alone would take 128 KiB)."""
    v_dim = v_dim or head_dim
    two_stages = BM * head_dim * 2 + 2 * 128 * (head_dim + v_dim) * 2 + fixed_bytes(128, 2, False)
    return 128 if two_stages <= SMEM_PER_CTA else 64


def fixed_bytes(bn: int, stages: int, gather4: bool, tiles: int = 1) -> int:
    """Barriers (``BARRIERS`` and the K/V ring's), a float32 per row of each S slot (O's correction factor, softmax
    -> correction warpgroup) and two per row of each of the ``tiles`` Q tiles (the final max and sum) and, for
    gather4, one int32 row per key per stage, rounded up to the 1024-byte alignment of the tiles that follow."""
    used = (RESERVED_BYTES + 8 * (2 * stages + BARRIERS) + 4 * BM * (SLOTS + 2 * tiles)
            + (4 * bn * stages if gather4 else 0))
    return -(-used // 1024) * 1024


def q_tiles(head_dim: int, v_dim: Optional[int] = None, kv_fp8: bool = False, page_size: Optional[int] = None,
            softcap: bool = False, group: Optional[int] = None, rows: Optional[int] = None) -> int:
    """Q tiles a CTA takes (see the module): two where their O accumulators fit tensor memory beside the two S tiles
    and two K/V stages fit shared memory beside them, with a 16-bit cache; else one. Two Q tiles leave 512
    registers per thread-slot across the four warpgroups (the softmax's 192 twice, ``sm100.REGS``), and ptxas
    measured spills there with soft-cap's tanh (softmax), gather4, over 4 page slots or 8 TMAs per K tile (load
    warp), and O by the threads' stores or a group of 1 (correction warpgroup): those keep one Q tile. ``rows``, a step's most
    packed rows per (request, KV head), keeps one Q tile where they fit it (a decode step: ``group <= 128`` rows),
    so no CTA runs a second tile of padding (FA4: ``q_stage = 2 if seqlen_q_packgqa > tile_m else 1``) and D = 128
    keeps its third K/V stage; None: any step."""
    v_dim = v_dim or head_dim
    bn = key_tile(head_dim, v_dim)
    # Registers were measured for two Q tiles at D = 64 and 128 only (80 and 96: other swizzles and O pieces).
    if kv_fp8 or softcap or head_dim not in (64, 128) or v_dim != head_dim or (rows is not None and rows <= BM):
        return 1
    # The load warp's TMAs per K tile: page slots x swizzle-row boxes of a row (``ring_swizzle``). Its 48 registers
    # hold up to 4 page slots' rows and TMA addresses (ptxas spilled it at 8: D = 64 in pages of 16).
    boxes = head_dim * 2 // ring_swizzle(head_dim, False)
    if page_size is not None:
        slots = max(bn // page_size, 1)
        if uses_gather4(page_size, bn) or slots * boxes > 8 or slots > 4:
            return 1
    if group is not None and (group == 1 or BM % group):
        return 1
    smem = fixed_bytes(bn, 2, False, 2) + 2 * BM * head_dim * 2 + 2 * bn * (head_dim + v_dim) * 2
    return 2 if SLOTS * bn + 2 * v_dim <= TMEM_COLUMNS and smem <= SMEM_PER_CTA else 1


def tiling(head_dim: int, page_size: int, kv_fp8: bool = False, v_dim: Optional[int] = None,
           softcap: bool = False, group: Optional[int] = None, tiles: Optional[int] = None) -> Sm100Tiling:
    """The deepest K/V ring (2 to ``MAX_STAGES``) that fits next to ``tiles`` Q tiles (None: as many as
    ``q_tiles`` allows; the host picks per step) and, for fp8, one 16-bit K and V tile."""
    v_dim = v_dim or head_dim
    bn = key_tile(head_dim, v_dim)
    gather4 = uses_gather4(page_size, bn)
    most = q_tiles(head_dim, v_dim, kv_fp8, page_size, softcap, group)
    if tiles is None:
        tiles = most
    elif tiles not in range(1, most + 1):
        raise ValueError(f"q_tiles must be {' or '.join(map(str, range(1, most + 1)))} for this head dim, page size, "
                         f"cache, soft-cap and group (sm100_config.q_tiles), got {tiles}")
    q_bytes, stage_bytes = tiles * BM * head_dim * 2, bn * (head_dim + v_dim) * (1 if kv_fp8 else 2)
    mma_tiles = bn * (head_dim + v_dim) * 2 if kv_fp8 else 0
    for stages in range(MAX_STAGES, 1, -1):
        plan = Sm100Tiling(bn, stages, gather4, fixed_bytes(bn, stages, gather4, tiles), q_bytes, stage_bytes, v_dim,
                           mma_tiles, tiles)
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
