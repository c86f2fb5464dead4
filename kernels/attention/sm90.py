"""``PagedAttention`` (SM90): warp-specialized FlashAttention-3 pipeline over a KV operand, decode and ragged
prefill alike (MAX's ``flash_attention_kv_cache_ragged``).

A CTA is (block of ``BM = 128`` packed query rows, KV head, split, request); packed rows interleave the
``group = Hq/H`` query heads of a KV head with the tokens (row ``i*group + g`` is token ``i``, head
``kv_head*group + g``; FA's pack-GQA), so a decode step's heads fill the MMA's M. Three warpgroups:

* the producer (32 registers; 40 dequantizing fp8): warp 0 first loads each consumer warpgroup's Q tile by TMA
  when the GQA group divides its 64 rows (``q_tma_tile``; the consumers copy Q themselves for other groups), then,
  for each key tile, issues one TMA per page slot for K into the K ring and for V into the V ring (separate
  pipelines, so QK of a tile can start before its V lands) and then reads the lookup entries of the next tile
  (``populate``) while they are in flight. Over an fp8 cache the tiles land in an fp8 ring and the whole warpgroup
  dequantizes them into the 16-bit rings (per granule, or per tensor: ``k_scale`` / ``v_scale``). Pages no TMA box tiles (under 16 rows, or neither dividing nor divided by
  the key tile) are gathered instead (40 registers): the whole warpgroup issues 16-byte ``cp.async`` copies of each
  row into the rings, one lookup entry a key (``row_gather``);
* two consumer warpgroups (232 registers), 64 rows each, sharing the K/V stages: ``S = Q K^T`` (SS wgmma) stays in
  registers, the online softmax runs there, ``P`` is converted in registers and fed to ``O += P V`` as the A
  operand (RS wgmma). Within a warpgroup the PV of tile ``j`` runs while the softmax of tile ``j + 1`` starts (QK
  of ``j + 1`` and PV of ``j`` are issued back to back, then only the QK is waited for); between the two
  warpgroups two named barriers alternate who issues its wgmmas (ping-pong), so one's softmax overlaps the other's
  MMAs. Past head dim 128 the warpgroups issue freely (FA3's and FA4's choice there): a tile's MMAs then outlast the
  other warpgroup's softmax, which the PV of the same warpgroup already overlaps. No CTA-wide barrier runs past the
  prologue.

Tiles are walked from the last to the first: the tile that holds the request's last key (and any slot past it) comes
first; its V rows past the keys are zeroed in shared memory once (P is exactly 0 there, but 0 * NaN is not; an fp8
tile is dequantized with those rows as zeros). Three loops follow, none with a branch: masked tiles at the keys'
end, tiles every live row sees whole (no mask), masked tiles at the window's start. Soft-cap (``c * tanh(s / c)``)
is applied to S before masking; sinks join the denominator once, in split 0. Split-KV: each split writes ``O/l`` and
its base-2 ``lse`` in float32 and ``AttentionCombine`` merges them (a split left without a key tile, a short request's
beside a long one, writes ``lse = -inf`` alone and exits before any setup; the combine reads no O of it); one split
writes the output (through its warpgroup's Q tile, 16-byte stores: a packed row is a (token, head) pair one TMA box
cannot address for every group size) and the natural-log ``lse`` when asked.
"""

from __future__ import annotations

import enum
import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

from cute_kv.kernels.quant import granule_scale, tensor_scale_views
from cute_kv.kernels.attention import softmax
from cute_kv.kernels.attention.block_info import copy_q_chunk, mask_loops, row_key_ranges, split_tiles
from cute_kv.kernels.attention.config import (BM, DTYPE_NAMES, FP8, VEC, gathers, layout_problem, ring_swizzle,
                                              supported, tiling)
from cute_kv.kernels.attention.operand import DenseMHAOperand, KVCacheMHAOperand
from cute_kv.kernels.attention.row_gather import RowGather
from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.paged.ragged_rows import request_rows

WG_THREADS = 128
THREADS = 3 * WG_THREADS  # producer + two consumer warpgroups
WG_ROWS = 64  # packed rows per consumer warpgroup: one wgmma M
PRODUCER_REGS = 32
PRODUCER_REGS_FP8 = 40  # a working producer warpgroup (fp8 dequantization, row gathers): all that the launch's
# 168 x 384 leave beside the consumers' 232
CONSUMER_REGS = 232
# S (BN/2 registers a thread), P (BN/4) and O (D_v/2) past this spilled in 232 (112 keys at head dim 192: 180, 80
# at 256: 188): a one-warp TMA producer (24 registers) leaves 240 to the consumers
CONSUMER_ACC_REGS = 176
PRODUCER_REGS_LEAN = 24
CONSUMER_REGS_WIDE = 240
LOG2E = math.log2(math.e)
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
assert set(DTYPES) == set(DTYPE_NAMES)


@dsl_user_op
def _arrive_if(pred: cutlass.Boolean, mbar: cute.Pointer, *, loc=None, ip=None):
    """One arrival on the shared-memory barrier ``mbar`` from each thread where ``pred`` holds: a predicated arrive,
    not a branch around one (under a branch ptxas recomputed the barrier's address behind a vote every tile)."""
    args = [cutlass.Boolean(pred).ir_value(loc=loc, ip=ip), mbar.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args, "{\n.reg .b64 s;\n@$0 mbarrier.arrive.shared::cta.b64 s, [$1];\n}", "b,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def _opaque_b64(x: Int64, *, loc=None, ip=None) -> Int64:
    return Int64(llvm.inline_asm(T.i64(), [Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def _mul_wide_u32(x: Int32, c: int, *, loc=None, ip=None) -> Int64:
    """``x * c`` in 64 bits, ``x`` unsigned: one ``mul.wide.u32`` (LLVM writes a widened index product as
    ``mul.wide.s32``, or folds a zero-extension into it)."""
    return Int64(llvm.inline_asm(T.i64(), [Int32(x).ir_value(loc=loc, ip=ip)], f"mul.wide.u32 $0, $1, {c};", "=l,r",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def pinned_descriptors(frag: cute.Tensor) -> cute.Tensor:
    """A wgmma operand's shared-memory descriptor fragment, its 64-bit descriptor built once here (outside the key
    loops) and then opaque: each wgmma's descriptor is that base plus the k block's (and stage's) offset. Left to
    the compiler, the descriptor is re-derived from the shared-memory address (shift, mask, or) at every wgmma in
    the loop, and each k block re-pairs a low-word add with a high-word move: ~2x the uniform instructions."""
    desc = _opaque_b64(tcgen05.smem_descriptor_to_int(frag.iterator))
    return cute.make_tensor(tcgen05.int_to_smem_descriptor(desc), frag.layout)


@dsl_user_op
def _low_word_at(desc: Int64, index: Int32, c: int, *, loc=None, ip=None) -> Int64:
    """``desc``'s low word plus ``index * c``, zero-extended, opaque to LLVM (so that it is not re-derived from the
    shared-memory address at each use)."""
    args = [Int64(desc).ir_value(loc=loc, ip=ip), Int32(index).ir_value(loc=loc, ip=ip)]
    asm = f"{{\n.reg .b32 lo, hi;\nmov.b64 {{lo, hi}}, $1;\nmad.lo.s32 lo, $2, {c}, lo;\ncvt.u64.u32 $0, lo;\n}}"
    return Int64(llvm.inline_asm(T.i64(), args, asm, "=l,l,r", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT))


def descriptors_at(frag: cute.Tensor, index: Int32, *, invariant: bool = False) -> cute.Tensor:
    """``frag`` at ``index`` of its last mode (a ring's stage, a warpgroup's Q tile).

    By default the index's offset is added to the whole 64-bit descriptor (``mul.wide.u32`` and a 64-bit add), so
    each k block's is one 64-bit add from it (K's ring stage past head dim 128, the stage computed from the tile's
    count: ``PagedAttention.read_state``). Indexed as a tensor at each k block instead, the offset goes into the low
    word only and ptxas re-sets the constant high word at every wgmma, which past 8 k blocks costs more than it
    saves.

    ``invariant``: an operand that stays put across the key loop (a warpgroup's Q tile). The index moves the low word
    only and the constant high word stays in sight of ptxas: its k blocks' descriptors are then held in uniform
    registers across the loop, or built in one 64-bit add of a constant (``UIADD3.64``) where the default's take two
    (a low add and its carry): at head dim 256, 3-8 instructions a tile fewer. For K's ring stage ptxas splits this
    form into a low add and a re-materialized high constant (18 more than the default)."""
    last = cute.rank(frag) - 1
    mode = cute.coalesce(cute.make_layout(frag.shape[last], stride=frag.stride[last]))  # stages:stride
    desc = tcgen05.smem_descriptor_to_int(frag.iterator)
    if invariant:  # (LLVM folds the constant high word from the descriptor's form)
        desc = _low_word_at(desc, index, mode.stride) + ((desc >> 32) << 32)
    else:
        desc = desc + _mul_wide_u32(index, mode.stride)
    return cute.make_tensor(tcgen05.int_to_smem_descriptor(desc), cute.select(frag.layout, list(range(last))))


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one, never used past the prologue)."""

    SCHED_WG1 = 1  # ping-pong: consumer warpgroup 1 may issue its wgmmas
    SCHED_WG2 = 2
    STALE_V = 3  # both consumer warpgroups around the zeroing of stale V rows
    EPILOGUE_WG1 = 4  # one consumer warpgroup: its Q rows loaded / its O rows staged
    EPILOGUE_WG2 = 5
    DEQUANT = 6  # the producer warpgroup: every thread has read an fp8 stage before it is released


class PagedAttention:
    """Compile-time key: dtype (Q, O and the MMAs), heads (Hq, H), head dim, the operand (``page_size``; None for a
    dense ``[B, S, H, D]`` cache), KVD, whether the lookup table takes vector reads, the optional features (soft-cap,
    sinks, writing the natural-log ``lse``), and an fp8 cache: ``kv_dtype_name`` ``"float8_e4m3fn"`` with scales over
    ``granularity`` head dims (None: unscaled), float32 or, with ``e8m0_scales``, float8_e8m0fnu (passed as their
    uint8 bits), and ``v_dim`` (None: the head dim): values are the first ``v_dim`` dims of the V rows
    (``config.VALUE_DIMS``: K of 192, V of 128), the PV MMA's N and O are ``v_dim`` wide. Every tile is swizzled by
    its row's width (``config.ring_swizzle``: 32 bytes at head dim 80, 64 at 96, 128 otherwise). ``layout``
    ``"strided"``: K and V come as two strided planes ``[N, L, P, H, D]`` instead of ``blocks``
    (``KVCacheMHAOperand``). ``tensor_scales``: an fp8 cache scaled per tensor (vLLM's and FlashInfer's ``k_scale`` /
    ``v_scale``, ``cute_kv/tensor_scales.py``), its two scales passed as one float32 ``[2]`` in place of ``scales``,
    in either layout.

    An fp8 cache lands by TMA in an fp8 ring; the producer warpgroup dequantizes each tile (``x * scale`` of its
    granule, scales read from global memory in 64-bit index math, rows past the keys written as zeros) into the
    16-bit K and V rings the consumers read, so nothing of it runs on the math path."""

    def __init__(self, dtype_name: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: Optional[int], kv_dim: int = 2, lut_vector: bool = True, softcap: bool = False,
                 sinks: bool = False, return_lse: bool = False, kv_dtype_name: Optional[str] = None,
                 granularity: Optional[int] = None, e8m0_scales: bool = False, v_dim: Optional[int] = None,
                 layout: str = "compact", tensor_scales: bool = False):
        self.kv_fp8 = kv_dtype_name == FP8
        problem = supported(num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype_name or dtype_name,
                            granularity, v_dim) or layout_problem(layout, page_size, granularity)
        if problem:
            raise ValueError(problem)
        if tensor_scales and (not self.kv_fp8 or granularity):
            raise ValueError("tensor_scales needs an fp8 cache without granule scales")
        self.tensor_scales = tensor_scales
        self.dtype = DTYPES[dtype_name]
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else self.dtype
        self.granularity, self.e8m0_scales = granularity, e8m0_scales
        bn = tiling(head_dim, self.kv_fp8, v_dim, page_size).bn
        # pages no TMA box tiles: the producer warpgroup gathers rows by cp.async (``row_gather``)
        self.gather = RowGather(bn, head_dim, page_size, self.kv_dtype, ring_swizzle(head_dim, self.kv_fp8)) \
            if gathers(page_size, bn) else None
        self.producer_regs = PRODUCER_REGS_FP8 if self.kv_fp8 or self.gather else PRODUCER_REGS
        self.consumer_regs = CONSUMER_REGS
        if bn * 3 // 4 + (v_dim or head_dim) // 2 > CONSUMER_ACC_REGS:  # (only TMA producers take such tiles)
            self.producer_regs, self.consumer_regs = PRODUCER_REGS_LEAN, CONSUMER_REGS_WIDE
        # the lean producer issues a tile's TMA boxes a column of them at a time (``copy_page_slots``)
        self.box_loop = self.producer_regs == PRODUCER_REGS_LEAN
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.v_dim = v_dim or head_dim
        self.pingpong = head_dim <= 128  # the two warpgroups' turns at issuing wgmmas (module docstring)
        self.group = num_q_heads // num_kv_heads
        # Q by TMA when the group divides a warpgroup's 64 rows (power-of-two groups up to 64); else thread copies
        self.q_tma = WG_ROWS % self.group == 0
        self.page_size, self.kv_dim = page_size, kv_dim
        self.softcap, self.sinks, self.return_lse = softcap, sinks, return_lse
        self.plan = tiling(head_dim, self.kv_fp8, self.v_dim, page_size)
        self.bn, self.stages, self.fp8_stages = self.plan.bn, self.plan.stages, self.plan.fp8_stages
        # Past head dim 128 (12-16 k blocks a QK): K's ring stage added to the whole descriptor once (``gemm_qk``),
        # and a tile's read state computed from its count (``read_state``; every ring there is two deep, the power
        # of two its bit form needs)
        self.k_stage_whole = head_dim > 128
        self.count_read = self.k_stage_whole and self.stages & (self.stages - 1) == 0
        self.swizzle = ring_swizzle(head_dim, False)  # of Q (and O staged in it) and the K ring
        self.v_swizzle = ring_swizzle(self.v_dim, False)
        # of the tiles TMA writes: K's and V's (an fp8 cache has V as wide as K)
        self.load_swizzles = (ring_swizzle(head_dim, self.kv_fp8), ring_swizzle(self.v_dim, self.kv_fp8))
        if page_size is None:
            self.k_op = self.v_op = DenseMHAOperand(self.bn)
        else:
            lut_vector = lut_vector and not self.gather  # a gather reads one entry a key
            self.k_op = KVCacheMHAOperand(0, page_size, self.bn, lut_vector, layout == "strided")
            self.v_op = KVCacheMHAOperand(1, page_size, self.bn, lut_vector, layout == "strided")

    # -- host ------------------------------------------------------------------------------------

    def smem_bytes(self) -> int:
        return self.plan.smem

    def fake_args(self) -> tuple:
        dt, d, dv, hq, h = self.dtype, self.head_dim, self.v_dim, self.num_q_heads, self.num_kv_heads
        t = cute.sym_int32()
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- 16-byte row accesses
        q = make_fake_tensor(dt, (t, hq, d), stride=(row(), d, 1), assumed_align=16)
        out = make_fake_tensor(dt, (t, hq, dv), stride=(row(), dv, 1), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (t, hq), stride_order=(1, 0), assumed_align=4) if self.return_lse \
            else None
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, dv),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        sinks = make_fake_compact_tensor(Float32, (hq,), assumed_align=4) if self.sinks else None
        b = cute.sym_int32()
        scales = None
        if self.page_size is None:
            cache = lambda: make_fake_tensor(dt, (cute.sym_int32(), cute.sym_int32(), h, d), stride=(  # noqa: E731
                cute.sym_int64(divisibility=h * d), h * d, d, 1), assumed_align=16)
            k_src, v_src, lut = cache(), cache(), None
        else:
            kvd, p = self.kv_dim, self.page_size
            k_src = v_src = self.k_op.fake_source(self.kv_dtype, h, d, kvd)
            if self.granularity:
                g = d // self.granularity
                scales = make_fake_tensor(Uint8 if self.e8m0_scales else Float32, (
                    cute.sym_int32(), kvd, cute.sym_int32(), p, h, g), stride=(
                    cute.sym_int64(), cute.sym_int64(), p * h * g, h * g, g, 1),
                    assumed_align=1 if self.e8m0_scales else 4)  # one 4-byte load a float32 scale
            elif self.tensor_scales:
                scales = make_fake_compact_tensor(Float32, (2,), assumed_align=4)
            width = self.k_op.lut_width
            lut = make_fake_tensor(Uint32, (b, cute.sym_int32()), stride=(cute.sym_int64(divisibility=width), 1),
                                   assumed_align=4 * width)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        return (q, out, lse, o_part, lse_part, sinks, k_src, v_src, offsets, lengths, lut, scales, Int32(0), Int32(1),
                Int32(1), Int32(1), Int32(0), Float32(1.0), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, q: cute.Tensor, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor,
                 lse_part: cute.Tensor, sinks: Optional[cute.Tensor], k_src: cute.Tensor, v_src: cute.Tensor,
                 input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: Optional[cute.Tensor],
                 scales: Optional[cute.Tensor], layer_idx: Int32, m_blocks: Int32, num_splits: Int32, causal: Int32,
                 window: Int32, score_scale: Float32, softmax_scale_log2: Float32, stream: cuda.CUstream):
        """``m_blocks``: ``ceil(max_seq_len * group / BM)``; ``window`` 0: none. Without soft-cap ``score_scale`` is
        unused and ``softmax_scale_log2 = scale * log2(e)``; with soft-cap ``c``, ``score_scale = scale / c`` (S
        becomes ``tanh(S * score_scale)``) and ``softmax_scale_log2 = c * log2(e)``. Both must be positive. ``scales``:
        the fp8 cache's ``[N, KVD, L, P, H, G]``, or with ``tensor_scales`` its ``(k_scale, v_scale)`` (None for
        unscaled or 16-bit caches)."""
        dt, d, dv, bn = self.dtype, self.head_dim, self.v_dim, self.bn
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                         (1, 1, 1), (WG_ROWS, bn))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                         (1, 1, 1), (WG_ROWS, dv), warpgroup.OperandSource.RMEM)
        tma_q = g_q = None
        if cutlass.const_expr(self.q_tma):
            tma_q, g_q = self.q_tma_tile(q)
        k_rows = self.k_op.row_view(k_src, layer_idx)
        v_rows = self.v_op.row_view(v_src, layer_idx)
        if cutlass.const_expr(self.gather is not None):  # the row views themselves, no descriptor
            tma_k, g_k, tma_v, g_v, s_slot, v_slot = None, k_rows, None, v_rows, None, None
        else:
            tma_k, g_k, s_slot = tma_tiles.create_tma_tile(k_rows, self.k_op.rows_per_copy, d, self.load_swizzles[0])
            tma_v, g_v, v_slot = tma_tiles.create_tma_tile(v_rows, self.v_op.rows_per_copy, dv, self.load_swizzles[1])
        k_scales = v_scales = None
        if cutlass.const_expr(self.tensor_scales):
            k_scales, v_scales = tensor_scale_views(scales)
        elif cutlass.const_expr(scales is not None):
            k_scales = self.k_op.scale_view(scales, layer_idx)
            v_scales = self.v_op.scale_view(scales, layer_idx)
        grid = (m_blocks, self.num_kv_heads * num_splits, cache_lengths.shape[0])
        self.kernel(tiled_mma_qk, tiled_mma_pv, tma_q, g_q, tma_k, g_k, tma_v, g_v, s_slot, v_slot, q, out, lse,
                    o_part, lse_part, sinks, input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales,
                    self.k_op.rows_per_page(k_src), k_rows.shape[0], num_splits, causal, window, score_scale,
                    softmax_scale_log2).launch(
            grid=grid, block=(THREADS, 1, 1), smem=self.smem_bytes(), stream=stream, min_blocks_per_mp=1)

    def q_tma_tile(self, q: cute.Tensor):
        """Q's TMA descriptor: ``q [T, Hq, D]`` seen as ``((Hq, T), D)``, box ``((group, 64 / group), D)``: the
        group's heads of ``64 / group`` consecutive tokens land in packed-row order (row ``i*group + g``) in a
        warpgroup's swizzled Q tile. TMA zero-fills boxes past ``T``."""
        t, hq, d = q.shape
        packed = cute.make_tensor(q.iterator, cute.make_layout(((hq, t), d), stride=((d, q.stride[0]), 1)))
        return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), packed,
                                           tma_tiles.smem_tile_layout(self.dtype, WG_ROWS, d, self.swizzle),
                                           ((self.group, WG_ROWS // self.group), d))

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tma_q: Optional[cute.CopyAtom],
               g_q: Optional[cute.Tensor], tma_k: Optional[cute.CopyAtom], g_k: cute.Tensor,
               tma_v: Optional[cute.CopyAtom], g_v: cute.Tensor, s_slot: Optional[cute.ComposedLayout],
               v_slot: Optional[cute.ComposedLayout], q: cute.Tensor, out: cute.Tensor, lse: Optional[cute.Tensor],
               o_part: cute.Tensor, lse_part: cute.Tensor, sinks: Optional[cute.Tensor],
               input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: Optional[cute.Tensor],
               k_scales: Optional[cute.Tensor], v_scales: Optional[cute.Tensor], rows_per_page: Int32, oob_row: Int32,
               num_splits: Int32, causal: Int32, window: Int32, score_scale: Float32, softmax_scale_log2: Float32):
        dt, d, dv, bn, group, stages = self.dtype, self.head_dim, self.v_dim, self.bn, self.group, self.stages
        m_block, head_split, b = cute.arch.block_idx()
        kv_head = head_split % self.num_kv_heads
        split = head_split // self.num_kv_heads
        q_start, seq_len = request_rows(input_row_offsets, b, q.shape[0])  # (unchecked offsets stay inside q)
        m0 = m_block * BM
        if m0 < seq_len * group:  # the CTA has query rows (uniform: the whole CTA leaves otherwise)
            cache_len = Int32(cache_lengths[b])
            num_keys = cache_len + seq_len
            first_tile, n_tiles = split_tiles(m0, seq_len, cache_len, num_keys, causal, window, split, num_splits,
                                              BM, bn, group)
            last_tile = first_tile + n_tiles - 1  # walked from here down to first_tile
            if n_tiles == 0 and num_splits > 1:
                # a split past the keys its rows see (never split 0): its lse says so, and the combine reads no O
                self.skip_split(lse_part, q_start, seq_len, m0, kv_head, split)
            else:
                warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
                if warp_idx == 0:
                    if cutlass.const_expr(self.q_tma):
                        cpasync.prefetch_descriptor(tma_q)
                    if cutlass.const_expr(self.gather is None):
                        cpasync.prefetch_descriptor(tma_k)
                        cpasync.prefetch_descriptor(tma_v)

                smem = SmemAllocator()
                mbars_k = smem.allocate_array(cutlass.Int64, 2 * stages)
                mbars_v = smem.allocate_array(cutlass.Int64, 2 * stages)
                if cutlass.const_expr(self.kv_fp8):  # every barrier before the tiles: one alignment slack (``tiling``)
                    mbars_8 = smem.allocate_array(cutlass.Int64, 2 * self.fp8_stages)
                mbars_q = None
                if cutlass.const_expr(self.q_tma):  # one per warpgroup's Q tile (within ``tiling``'s barrier bytes)
                    mbars_q = smem.allocate_array(cutlass.Int64, 2)
                    if warp_idx == 0:
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_init(mbars_q, 1)
                            cute.arch.mbarrier_init(mbars_q + 1, 1)
                        cute.arch.mbarrier_init_fence()
                # one (64, D) tile per warpgroup
                sq_layout = tma_tiles.smem_tile_layout(dt, WG_ROWS, d, self.swizzle, stages=2)
                k_layout = tma_tiles.smem_tile_layout(dt, bn, d, self.swizzle, stages=stages)
                v_layout = tma_tiles.smem_tile_layout(dt, bn, dv, self.v_swizzle, stages=stages)
                s_q = smem.allocate_tensor(dt, sq_layout.outer, byte_alignment=1024, swizzle=sq_layout.inner)
                s_k = smem.allocate_tensor(dt, k_layout.outer, byte_alignment=1024, swizzle=k_layout.inner)
                s_v = smem.allocate_tensor(dt, v_layout.outer, byte_alignment=1024, swizzle=v_layout.inner)

                one = cute.make_layout((1, 1, 1, 1))
                consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * WG_THREADS // 32)
                if cutlass.const_expr(self.kv_fp8):
                    # TMA -> fp8 ring (K and V of a tile on one barrier) -> producer warpgroup -> 16-bit rings
                    ring8_layout = tma_tiles.smem_tile_layout(self.kv_dtype, bn, d, self.load_swizzles[0],
                                                              stages=self.fp8_stages)
                    ring8_k = smem.allocate_tensor(self.kv_dtype, ring8_layout.outer, byte_alignment=1024,
                                                   swizzle=ring8_layout.inner)
                    ring8_v = smem.allocate_tensor(self.kv_dtype, ring8_layout.outer, byte_alignment=1024,
                                                   swizzle=ring8_layout.inner)
                    pipe_8 = pipeline.PipelineTmaAsync.create(
                        barrier_storage=mbars_8, num_stages=self.fp8_stages,
                        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS // 32),
                        tx_count=2 * bn * d, cta_layout_vmnk=one, defer_sync=True)
                if cutlass.const_expr(self.kv_fp8 or self.gather is not None):
                    # The producer warpgroup fills the 16-bit rings: every thread's arrival (fp8: after its
                    # dequantized stores; gather: its cp.async.mbarrier.arrive.noinc) is one of a stage's.
                    ring_pipe = pipeline.PipelineAsync if cutlass.const_expr(self.kv_fp8) else pipeline.PipelineCpAsync
                    producers = pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS)
                    pipe_k = ring_pipe.create(barrier_storage=mbars_k, num_stages=stages, producer_group=producers,
                                              consumer_group=consumers, defer_sync=True)
                    pipe_v = ring_pipe.create(barrier_storage=mbars_v, num_stages=stages, producer_group=producers,
                                              consumer_group=consumers)
                else:
                    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
                    pipe_k = pipeline.PipelineTmaAsync.create(barrier_storage=mbars_k, num_stages=stages,
                                                              producer_group=producer, consumer_group=consumers,
                                                              tx_count=bn * d * dt.width // 8, cta_layout_vmnk=one,
                                                              defer_sync=True)
                    pipe_v = pipeline.PipelineTmaAsync.create(barrier_storage=mbars_v, num_stages=stages,
                                                              producer_group=producer, consumer_group=consumers,
                                                              tx_count=bn * dv * dt.width // 8, cta_layout_vmnk=one)
                    # (the last create's sync publishes every barrier's init)
                if warp_idx < 4:
                    cute.arch.setmaxregister_decrease(self.producer_regs)
                    if cutlass.const_expr(self.q_tma):
                        if warp_idx == 0:  # Q ahead of the first K tile, which the first QK waits for as well
                            self.load_q_tma(tma_q, g_q, s_q, mbars_q, q_start, m0, kv_head)
                    if cutlass.const_expr(self.kv_fp8):
                        self.produce_fp8(pipe_8, pipe_k, pipe_v, tma_k, g_k, ring8_k, tma_v, g_v, ring8_v, s_k, s_v,
                                         s_slot, lookup_table, k_scales, v_scales, b, kv_head, num_keys, rows_per_page,
                                         oob_row, last_tile, n_tiles, warp_idx)
                    elif cutlass.const_expr(self.gather is not None):
                        self.produce_gather(pipe_k, pipe_v, g_k, s_k, g_v, s_v, lookup_table, b, kv_head, num_keys,
                                            rows_per_page, oob_row, last_tile, n_tiles, warp_idx)
                    else:
                        if warp_idx == 0:
                            self.produce(pipe_k, pipe_v, tma_k, g_k, s_k, tma_v, g_v, s_v, s_slot, v_slot, lookup_table,
                                         b, kv_head, num_keys, rows_per_page, oob_row, first_tile, last_tile, n_tiles)
                else:
                    cute.arch.setmaxregister_increase(self.consumer_regs)
                    wg = warp_idx // 4 - 1
                    self.consume(tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, mbars_q, s_q, s_k, s_v, q, out, lse,
                                 o_part, lse_part, sinks, wg, q_start, seq_len, cache_len, num_keys, m0, kv_head, split,
                                 num_splits, causal, window, first_tile, last_tile, n_tiles, score_scale,
                                 softmax_scale_log2)

    @cute.jit
    def skip_split(self, lse_part: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, kv_head: Int32,
                   split: Int32):
        """A CTA whose split holds no key tile: ``lse = -inf`` for its live rows, one a thread, and nothing else (no
        pipeline, no Q, no O partial: ``AttentionCombine`` reads a split's O only where its lse is finite)."""
        tidx = cute.arch.thread_idx()[0]
        tok = (m0 + tidx) // self.group
        if tidx < BM and tok < seq_len:
            lse_part[split, q_start + tok, kv_head * self.group + (m0 + tidx) % self.group] = softmax.NEG_INF

    @cute.jit
    def produce(self, pipe_k: pipeline.PipelineTmaAsync, pipe_v: pipeline.PipelineTmaAsync, tma_k: cute.CopyAtom,
                g_k: cute.Tensor, s_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor, s_v: cute.Tensor,
                s_slot: cute.ComposedLayout, v_slot: cute.ComposedLayout, lookup_table: Optional[cute.Tensor], b: Int32,
                kv_head: Int32, num_keys: Int32, rows_per_page: Int32, oob_row: Int32, first_tile: Int32,
                last_tile: Int32, n_tiles: Int32):
        """Warp 0: K then V of each tile, last to first, in boxes of K's and V's widths (``s_slot``, ``v_slot``). The
        next tile's lookup entries are read right after this tile's copies are issued, so their latency hides behind
        the wait for a free stage."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
        if n_tiles > 0:
            self.k_op.populate(rows, lookup_table, b, last_tile * self.bn, num_keys, rows_per_page, oob_row)
        for i in cutlass.range(n_tiles, unroll=1):
            for pipe, g_rows, ring, atom, slot in ((pipe_k, g_k, s_k, tma_k, s_slot),
                                                   (pipe_v, g_v, s_v, tma_v, v_slot)):
                pipe.producer_acquire(state)
                self.copy_tile(atom, g_rows, ring, slot, rows, state.index, kv_head,
                               pipe.producer_get_barrier(state))
                pipe.producer_commit(state)
            if i + 1 < n_tiles:
                self.k_op.populate(rows, lookup_table, b, (last_tile - i - 1) * self.bn, num_keys, rows_per_page,
                                   oob_row)
            state.advance()

    @cute.jit
    def produce_gather(self, pipe_k: pipeline.PipelineCpAsync, pipe_v: pipeline.PipelineCpAsync, g_k: cute.Tensor,
                       s_k: cute.Tensor, g_v: cute.Tensor, s_v: cute.Tensor, lookup_table: cute.Tensor, b: Int32,
                       kv_head: Int32, num_keys: Int32, rows_per_page: Int32, num_rows: Int32, last_tile: Int32,
                       n_tiles: Int32, warp_idx: Int32):
        """The producer warpgroup gathers K then V of each tile, last to first (``row_gather``): K and V rows share
        their row numbers, so one lookup a lane serves both; the next tile's is read right after this tile's copies
        are issued, its latency hidden behind the wait for a free stage."""
        lane = cute.arch.lane_idx()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        row = Int32(-1)
        if n_tiles > 0:
            row = self.gather.lane_row(lookup_table, b, last_tile * self.bn, warp_idx, lane, num_keys, rows_per_page,
                                       num_rows)
        for i in cutlass.range(n_tiles, unroll=1):
            for pipe, g_rows, ring in ((pipe_k, g_k, s_k), (pipe_v, g_v, s_v)):
                pipe.producer_acquire(state)
                self.gather.copy_tile(g_rows, ring[None, None, state.index], row, kv_head, warp_idx, lane)
                pipe.producer_commit(state)
            if i + 1 < n_tiles:
                row = self.gather.lane_row(lookup_table, b, (last_tile - i - 1) * self.bn, warp_idx, lane,
                                           num_keys, rows_per_page, num_rows)
            state.advance()

    @cute.jit
    def copy_tile(self, atom: cute.CopyAtom, g_rows: cute.Tensor, ring: cute.Tensor, s_slot: cute.ComposedLayout,
                  rows: cute.Tensor, stage: Int32, kv_head: Int32, bar):
        """One TMA per page slot of the tile (one in all when a page holds the tile): rows ``rows[p]`` onward."""
        tma_tiles.copy_page_slots(atom, g_rows, ring[None, None, stage], s_slot, rows, self.k_op.rows_per_copy,
                                  kv_head, bar, self.box_loop)

    @cute.jit
    def produce_fp8(self, pipe_8: pipeline.PipelineTmaAsync, pipe_k: pipeline.PipelineAsync,
                    pipe_v: pipeline.PipelineAsync, tma_k: cute.CopyAtom, g_k: cute.Tensor, ring8_k: cute.Tensor,
                    tma_v: cute.CopyAtom, g_v: cute.Tensor, ring8_v: cute.Tensor, s_k: cute.Tensor, s_v: cute.Tensor,
                    s_slot: cute.ComposedLayout, lookup_table: Optional[cute.Tensor], k_scales: Optional[cute.Tensor],
                    v_scales: Optional[cute.Tensor], b: Int32, kv_head: Int32, num_keys: Int32, rows_per_page: Int32,
                    oob_row: Int32, last_tile: Int32, n_tiles: Int32, warp_idx: Int32):
        """The producer warpgroup over an fp8 cache: warp 0 keeps the fp8 ring ``fp8_stages`` tiles ahead (TMA);
        all four warps dequantize each landed tile into the 16-bit K and V stages, then release its fp8 stage once
        every thread has read it."""
        bn = self.bn
        tidx = cute.arch.thread_idx()[0]
        load = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.fp8_stages)
        read8 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fp8_stages)
        write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
        if warp_idx == 0:
            for i in cutlass.range(cutlass.min(self.fp8_stages, n_tiles), unroll=1):
                self.k_op.populate(rows, lookup_table, b, (last_tile - i) * bn, num_keys, rows_per_page, oob_row)
                self.load_fp8_tile(pipe_8, load, tma_k, g_k, ring8_k, tma_v, g_v, ring8_v, s_slot, rows, kv_head)
                load.advance()
        for i in cutlass.range(n_tiles, unroll=1):
            tile_base = (last_tile - i) * bn
            if cutlass.const_expr(self.granularity is not None):  # the rows whose scales apply
                self.k_op.populate(rows, lookup_table, b, tile_base, num_keys, rows_per_page, oob_row)
            pipe_8.consumer_wait(read8)
            pipe_k.producer_acquire(write)
            self.dequantize(ring8_k, s_k, read8.index, write.index, k_scales, rows, tile_base, num_keys, kv_head, tidx)
            cute.arch.fence_view_async_shared()  # read by wgmma next
            pipe_k.producer_commit(write)
            pipe_v.producer_acquire(write)
            self.dequantize(ring8_v, s_v, read8.index, write.index, v_scales, rows, tile_base, num_keys, kv_head, tidx)
            cute.arch.fence_view_async_shared()
            pipe_v.producer_commit(write)
            cute.arch.barrier(barrier_id=int(Barrier.DEQUANT), number_of_threads=WG_THREADS)
            pipe_8.consumer_release(read8)
            read8.advance()
            write.advance()
            if warp_idx == 0:
                if i + self.fp8_stages < n_tiles:
                    self.k_op.populate(rows, lookup_table, b, (last_tile - i - self.fp8_stages) * bn, num_keys,
                                       rows_per_page, oob_row)
                    self.load_fp8_tile(pipe_8, load, tma_k, g_k, ring8_k, tma_v, g_v, ring8_v, s_slot, rows, kv_head)
                    load.advance()

    @cute.jit
    def load_fp8_tile(self, pipe_8: pipeline.PipelineTmaAsync, load: pipeline.PipelineState, tma_k: cute.CopyAtom,
                      g_k: cute.Tensor, ring8_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor,
                      ring8_v: cute.Tensor, s_slot: cute.ComposedLayout, rows: cute.Tensor, kv_head: Int32):
        pipe_8.producer_acquire(load)
        bar = pipe_8.producer_get_barrier(load)
        self.copy_tile(tma_k, g_k, ring8_k, s_slot, rows, load.index, kv_head, bar)
        self.copy_tile(tma_v, g_v, ring8_v, s_slot, rows, load.index, kv_head, bar)
        pipe_8.producer_commit(load)

    @cute.jit
    def dequantize(self, ring8: cute.Tensor, ring: cute.Tensor, stage8: Int32, stage: Int32,
                   scales: Optional[cute.Tensor], rows: cute.Tensor, tile_base: Int32, num_keys: Int32,
                   kv_head: Int32, tidx: Int32):
        """fp8 rows of ``ring8[stage8]`` -> the 16-bit ``ring[stage]``, 8 values a thread at a time: ``x * scale`` of
        the values' granule (``scales[row, kv_head, dim // granularity]``, the row from the tile's ``populate``; the
        element offset in 64 bits) or of the plane (``tensor_scales``: ``scales[0]``, read once a tile), rounded once.
        Rows past the request's keys are written as zeros (P is 0 there; stale values could be NaN)."""
        d, per_copy = self.head_dim, self.k_op.rows_per_copy
        plane_scale = Float32(1.0)
        if cutlass.const_expr(self.tensor_scales):
            plane_scale = Float32(scales[0])
        chunks = d // VEC
        step = WG_THREADS // chunks  # rows a pass covers: within one page slot (pages hold >= 16 rows)
        raw = cute.make_rmem_tensor((VEC,), self.kv_dtype)
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for j in cutlass.range_constexpr(self.bn // step):
            r = j * step + tidx // chunks
            c = tidx % chunks
            vals.fill(0.0)
            if tile_base + r < num_keys:
                cute.autovec_copy(cute.local_tile(ring8[r, None, stage8], (VEC,), (c,)), raw)
                x = raw.load().to(Float32)
                if cutlass.const_expr(self.tensor_scales):
                    x = x * plane_scale
                elif cutlass.const_expr(scales is not None):
                    # the pass's page slot is known here: no dynamic index into the rows registers
                    row = rows[j * step // per_copy] + j * step % per_copy + tidx // chunks
                    x = x * granule_scale(scales, row, kv_head, c * VEC // self.granularity, self.e8m0_scales)
                vals.store(x.to(self.dtype))
            cute.autovec_copy(vals, cute.local_tile(ring[r, None, stage], (VEC,), (c,)))

    @cute.jit
    def consume(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, pipe_k: pipeline.PipelineAsync,
                pipe_v: pipeline.PipelineAsync, mbars_q: Optional[cute.Pointer], s_q: cute.Tensor, s_k: cute.Tensor,
                s_v: cute.Tensor, q: cute.Tensor, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor,
                lse_part: cute.Tensor, sinks: Optional[cute.Tensor], wg: Int32, q_start: Int32, seq_len: Int32,
                cache_len: Int32, num_keys: Int32, m0: Int32, kv_head: Int32, split: Int32, num_splits: Int32,
                causal: Int32, window: Int32, first_tile: Int32, last_tile: Int32, n_tiles: Int32, score_scale: Float32,
                softmax_scale_log2: Float32):
        """One consumer warpgroup: rows ``m0 + 64*wg ..`` of the block."""
        dv, bn, group = self.v_dim, self.bn, self.group
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        rows0 = m0 + wg * WG_ROWS
        s_q_wg = s_q[None, None, wg]
        if cutlass.const_expr(self.q_tma):
            cute.arch.mbarrier_wait(mbars_q + wg, 0)  # the producer's TMA of this warpgroup's Q tile
        else:
            self.load_q(s_q_wg, q, q_start, seq_len, rows0, kv_head, tidx, wg)

        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        # This warpgroup's Q tile, picked once here in its descriptors' low word (``descriptors_at``, invariant).
        # Indexing both warpgroups' tiles by warpgroup at each wgmma instead took as many instructions a tile up to
        # head dim 128, more at 192, and spilled at 256.
        t_rq = descriptors_at(tiled_mma_qk.make_fragment_A(thr_qk.partition_A(s_q)), wg, invariant=True)
        t_rk = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(s_k))
        s_vt = cute.composition(s_v, cute.make_ordered_layout((dv, bn, self.stages), order=(1, 0, 2)))
        t_rv = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(s_vt))
        t_rp = tiled_mma_pv.make_fragment_A(thr_pv.partition_shape_A((WG_ROWS, bn)))
        t_rk, t_rv = (pinned_descriptors(t) for t in (t_rk, t_rv))
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((WG_ROWS, dv)), Float32)
        acc_o.fill(0.0)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((WG_ROWS, bn)), Float32)
        # (row, key) of each S register, and the key range of each of the thread's rows
        coords = softmax.mn_view(thr_qk.partition_C(cute.make_identity_tensor((WG_ROWS, bn))))
        n_rows = cute.size(coords, mode=[0])
        row_begin = cute.make_rmem_tensor((n_rows,), Int32)
        row_end = cute.make_rmem_tensor((n_rows,), Int32)
        row_key_ranges(row_begin, row_end, coords, rows0, seq_len, cache_len, num_keys, causal, window, group)

        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)
        row_scale = cute.make_rmem_tensor((n_rows,), Float32)
        row_max.fill(softmax.NEG_INF)
        row_sum.fill(0.0)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if cutlass.const_expr(self.pingpong) and wg == 0:  # the first warpgroup may issue first
            cute.arch.barrier_arrive(barrier_id=int(Barrier.SCHED_WG1), number_of_threads=2 * WG_THREADS)
        if n_tiles > 0:
            # First tile: QK alone, then its softmax; its V rows past the keys are zeroed before any PV reads them.
            self.wait(pipe_k, read)
            self.gemm_qk(tiled_mma_qk, acc_s, t_rq, t_rk, read.index)
            warpgroup.wait_group(0)
            self.release(pipe_k, read)
            softmax.scores(acc_s, coords, row_begin, row_end, last_tile * bn, score_scale, self.softcap, True)
            softmax.online_softmax(acc_s, row_max, row_sum, row_scale, softmax_scale_log2, True)
            softmax.to_16bit(softmax.a_fragment_view(acc_s), t_rp)
            if cutlass.const_expr(not self.kv_fp8):  # (dequantization writes those rows as zeros)
                if (last_tile + 1) * bn > num_keys:
                    self.wait(pipe_v, read)
                    self.zero_stale_rows(s_v, read.index, num_keys - last_tile * bn, tidx + wg * WG_THREADS)
            # Then three loops, so the steady state has no branch: the tiles past the first whose keys some live row
            # does not see (the causal edge, the keys' end), those every live row sees whole, and the window's start.
            masked_end, unmasked_stop = mask_loops(rows0, seq_len, cache_len, num_keys, causal, window, last_tile,
                                                   n_tiles, WG_ROWS, bn, group)
            for i in cutlass.range(1, masked_end, unroll=1):
                read = self.step(i, read, True, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, acc_s, acc_o, t_rq, t_rk,
                                 t_rp, t_rv, coords, row_begin, row_end, row_max, row_sum, row_scale, last_tile, wg,
                                 score_scale, softmax_scale_log2)
            for i in cutlass.range(masked_end, unmasked_stop, unroll=1):
                read = self.step(i, read, False, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, acc_s, acc_o, t_rq,
                                 t_rk, t_rp, t_rv, coords, row_begin, row_end, row_max, row_sum, row_scale, last_tile,
                                 wg, score_scale, softmax_scale_log2)
            for i in cutlass.range(unmasked_stop, n_tiles, unroll=1):
                read = self.step(i, read, True, tiled_mma_qk, tiled_mma_pv, pipe_k, pipe_v, acc_s, acc_o, t_rq, t_rk,
                                 t_rp, t_rv, coords, row_begin, row_end, row_max, row_sum, row_scale, last_tile, wg,
                                 score_scale, softmax_scale_log2)
            self.wait(pipe_v, read)
            self.gemm_pv(tiled_mma_pv, acc_o, t_rp, t_rv, read.index)
            warpgroup.wait_group(0)
            self.release(pipe_v, read)
        self.epilogue(thr_pv, acc_o, row_max, row_sum, softmax_scale_log2, coords, s_q_wg, out, lse, o_part,
                      lse_part, sinks, q_start, seq_len, rows0, kv_head, split, num_splits, tidx, wg)

    @cute.jit
    def step(self, i: Int32, read: pipeline.PipelineState, masked: cutlass.Constexpr[bool], tiled_mma_qk: cute.TiledMma,
             tiled_mma_pv: cute.TiledMma, pipe_k: pipeline.PipelineAsync, pipe_v: pipeline.PipelineAsync,
             acc_s: cute.Tensor, acc_o: cute.Tensor, t_rq: cute.Tensor, t_rk: cute.Tensor, t_rp: cute.Tensor,
             t_rv: cute.Tensor, coords: cute.Tensor, row_begin: cute.Tensor, row_end: cute.Tensor,
             row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, last_tile: Int32, wg: Int32,
             score_scale: Float32, softmax_scale_log2: Float32) -> pipeline.PipelineState:
        """Tile ``last_tile - i``: issue its QK and the previous tile's PV (in this warpgroup's ping-pong turn, if
        any), wait for the QK only, run the softmax while the PV runs, then rescale O (skipped when no row max of the
        warp moved). Returns the read state."""
        prev = read
        read = self.read_state(i, prev)
        self.wait(pipe_k, read)
        self.sched_wait()
        self.gemm_qk(tiled_mma_qk, acc_s, t_rq, t_rk, read.index)
        self.wait(pipe_v, prev)
        self.gemm_pv(tiled_mma_pv, acc_o, t_rp, t_rv, prev.index)
        self.sched_release()
        warpgroup.wait_group(1)  # QK done; PV still runs under the softmax
        self.release(pipe_k, read)
        softmax.scores(acc_s, coords, row_begin, row_end, (last_tile - i) * self.bn, score_scale, self.softcap, masked)
        softmax.online_softmax(acc_s, row_max, row_sum, row_scale, softmax_scale_log2, False)
        warpgroup.wait_group(0)
        self.release(pipe_v, prev)
        softmax.to_16bit(softmax.a_fragment_view(acc_s), t_rp)
        softmax.rescale_rows_if_moved(acc_o, row_scale)
        return read

    @cute.jit
    def read_state(self, i: Int32, prev: pipeline.PipelineState) -> pipeline.PipelineState:
        """The read state of the walk's tile ``i``, the rings' fill ``i`` (the first tile is fill 0): ``prev``
        advanced, or with ``count_read`` the stage and phase computed from ``i`` (the previous tile's state, which its
        V wait and PV take, is then this one of the step before). With K's stage added to the whole descriptor, ptxas
        then forms each k block's K descriptor in one ``UIADD3.64`` where the advanced stage took two (a low add and
        its carry), and at head dim 192 keeps the stage out of vector registers (no ``R2UR`` round trips): 6-23
        instructions a tile fewer at head dims 192 and 256. Up to head dim 128 (K indexed per k block) the two forms
        measured within 2 instructions of each other."""
        if cutlass.const_expr(self.count_read):
            s = self.stages
            return pipeline.PipelineState(s, i, i & (s - 1), (i >> (s.bit_length() - 1)) & 1)
        read = prev.clone()
        read.advance()
        return read

    @cute.jit
    def wait(self, pipe: pipeline.PipelineAsync, state: pipeline.PipelineState):
        """A consumer waits for a K or V stage to fill. Over an fp8 cache a plain try-wait loop: ptxas moves its retry
        out of the loop as it does the TMA rings' wait, where the pipeline's wait (the same PTX) kept a sleep and a
        second check on the fast path of the dequantized rings' (2 instructions a wait)."""
        if cutlass.const_expr(self.kv_fp8):
            ready = cutlass.Boolean(False)
            while not ready:
                ready = pipe.consumer_try_wait(state)
        else:
            pipe.consumer_wait(state)
            if cutlass.const_expr(self.gather is not None):
                cute.arch.fence_view_async_shared()  # cp.async wrote the stage in the generic proxy; wgmma reads next

    @cute.jit
    def release(self, pipe: pipeline.PipelineAsync, state: pipeline.PipelineState):
        """A consumer warp is done with a K or V stage: one lane arrives for it (the stage's empty barrier counts the
        8 consumer warps), lane 0 over an fp8 cache's dequantized rings and gathered ones (whose pipeline's release
        arrives from every lane) as over the TMA ones (no ``elect.sync``)."""
        if cutlass.const_expr(self.kv_fp8 or self.gather is not None):
            _arrive_if(cute.arch.lane_idx() == 0, pipe.sync_object_empty.get_barrier(state.index))
        else:
            pipe.consumer_release(state)

    @cute.jit
    def gemm_qk(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, t_rq: cute.Tensor, t_rk: cute.Tensor,
                stage: Int32):
        """Issue ``S = Q K^T`` for one K stage (no wait). A fresh atom per call: its accumulate flag is set here, and
        an atom shared across the loop's regions would carry the flag out of them."""
        atom = cute.make_mma_atom(tiled_mma.op)
        warpgroup.fence()
        atom.set(warpgroup.Field.ACCUMULATE, False)
        if cutlass.const_expr(self.k_stage_whole):  # (with ``read_state``: each k block's K descriptor one add)
            t_rk = descriptors_at(t_rk, stage)
        for kb in cutlass.range_constexpr(cute.size(t_rq, mode=[2])):
            k_block = t_rk[None, None, kb] if cutlass.const_expr(self.k_stage_whole) else t_rk[None, None, kb, stage]
            cute.gemm(atom, acc, t_rq[None, None, kb], k_block, acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def gemm_pv(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, t_rp: cute.Tensor, t_rv: cute.Tensor,
                stage: Int32):
        """Issue ``O += P V`` with P from registers (no wait). The stage is sliced first: each k block's descriptor is
        then the stage's plus a constant, one 64-bit add per wgmma (indexed together, ptxas re-pairs a low-word add
        with the high word at every k block)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        warpgroup.fence()
        atom.set(warpgroup.Field.ACCUMULATE, True)
        v_stage = t_rv[None, None, None, stage]
        for kb in cutlass.range_constexpr(cute.size(t_rp, mode=[2])):
            cute.gemm(atom, acc, t_rp[None, None, kb], v_stage[None, None, kb], acc)
        warpgroup.commit_group()

    @cute.jit
    def sched_wait(self):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=int(Barrier.SCHED_WG1) + self.thread_wg(),
                              number_of_threads=2 * WG_THREADS)

    @cute.jit
    def sched_release(self):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=int(Barrier.SCHED_WG2) - self.thread_wg(),
                                     number_of_threads=2 * WG_THREADS)

    def thread_wg(self) -> Int32:
        """The consumer warpgroup (0, 1) from the thread index: a barrier id taken from the warp-uniform ``wg``
        lives in a uniform register, which ptxas moves into a vector one at every barrier of the loop."""
        return cute.arch.thread_idx()[0] // WG_THREADS - 1

    @cute.jit
    def load_q_tma(self, tma_q: cute.CopyAtom, g_q: cute.Tensor, s_q: cute.Tensor, mbars_q: cute.Pointer,
                   q_start: Int32, m0: Int32, kv_head: Int32):
        """Producer warp: each consumer warpgroup's 64 packed rows (``64 / group`` tokens from ``m0 / group``, the
        KV head's ``group`` heads) on its own barrier, one box per swizzle row of the head dim (128 bytes; 64 at 96,
        32 at 80). Tokens past the request are the next requests' (their S rows are masked on masked tiles, and a
        row's O, never stored for them, depends on its own S row only) or, past ``T``, zeros."""
        group, tokens = self.group, WG_ROWS // self.group
        for wg in cutlass.range_constexpr(2):
            origin = cute.domain_offset(((kv_head * group, q_start + (m0 + wg * WG_ROWS) // group), 0), g_q)
            src = cute.make_tensor(origin.iterator, cute.make_layout(((group, tokens), self.head_dim),
                                                                     stride=g_q.stride))
            t_s, t_g = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                             cute.group_modes(s_q[None, None, wg], 0, 2), cute.group_modes(src, 0, 2))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbars_q + wg, WG_ROWS * self.head_dim * self.dtype.width // 8)
            cute.copy(tma_q, t_g, t_s, tma_bar_ptr=mbars_q + wg)

    @cute.jit
    def load_q(self, s_q: cute.Tensor, q: cute.Tensor, q_start: Int32, seq_len: Int32, rows0: Int32,
               kv_head: Int32, tidx: Int32, wg: Int32):
        """The warpgroup's 64 packed rows of ``q`` into its swizzled Q tile, 16 bytes a thread at a time (rows past
        the request are 0), for a group that does not divide 64: its rows' (token, head) pairs form no TMA box."""
        d, group = self.head_dim, self.group
        chunks = d // VEC
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for j in cutlass.range_constexpr(WG_ROWS * chunks // WG_THREADS):
            idx = tidx + j * WG_THREADS
            copy_q_chunk(q, s_q, vals, idx // chunks, idx % chunks, rows0, q_start, seq_len, kv_head, group)
        cute.arch.fence_view_async_shared()  # read by wgmma next
        cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE_WG1) + wg, number_of_threads=WG_THREADS)

    @cute.jit
    def zero_stale_rows(self, s_v: cute.Tensor, stage: Int32, first_row: Int32, ctidx: Int32):
        """Both consumer warpgroups zero V rows ``[first_row, BN)`` of ``stage`` (past the request's keys)."""
        chunks = self.v_dim // VEC
        zeros = cute.make_rmem_tensor((VEC,), self.dtype)
        zeros.fill(0.0)
        cute.arch.barrier(barrier_id=int(Barrier.STALE_V), number_of_threads=2 * WG_THREADS)
        for idx in cutlass.range(ctidx, self.bn * chunks, 2 * WG_THREADS, unroll=1):
            if idx // chunks >= first_row:
                cute.autovec_copy(zeros, cute.local_tile(s_v[idx // chunks, None, stage], (VEC,), (idx % chunks,)))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(Barrier.STALE_V), number_of_threads=2 * WG_THREADS)

    @cute.jit
    def epilogue(self, thr_pv: cute.ThrMma, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                 softmax_scale_log2: Float32, coords: cute.Tensor, s_q: cute.Tensor, out: cute.Tensor,
                 lse: Optional[cute.Tensor], o_part: cute.Tensor, lse_part: cute.Tensor,
                 sinks: Optional[cute.Tensor], q_start: Int32, seq_len: Int32, rows0: Int32, kv_head: Int32,
                 split: Int32, num_splits: Int32, tidx: Int32, wg: Int32):
        """Rows' sums over the quad, the sink (split 0 only), ``O / l`` and the base-2 ``lse``; then the output through
        the warpgroup's Q tile (its wgmmas are done with it; O in its first ``v_dim`` columns) in 16-byte stores, or
        the float32 partial."""
        dv, group = self.v_dim, self.group
        n_rows = cute.size(row_max)
        inv = cute.make_rmem_tensor((n_rows,), Float32)
        lse2 = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            sink = softmax.NEG_INF
            if cutlass.const_expr(self.sinks):
                if split == 0:  # the sink joins the denominator once
                    sink = Float32(sinks[kv_head * group + (rows0 + coords[r, 0][0]) % group]) * LOG2E
            inv[r], lse2[r] = softmax.finish_row(softmax.quad_sum(row_sum[r]), row_max[r] * softmax_scale_log2, sink,
                                                 self.sinks)
        softmax.rescale_rows(acc_o, inv)
        o_coords = softmax.mn_view(thr_pv.partition_C(cute.make_identity_tensor((WG_ROWS, dv))))
        o_mn = softmax.mn_view(acc_o)
        if num_splits == 1:
            o_16 = cute.make_rmem_tensor(acc_o.shape, self.dtype)
            o_16.store(acc_o.load().to(self.dtype))
            # every warp of the warpgroup is past its last QK wgmma (the only reader of these Q rows)
            cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE_WG1) + wg, number_of_threads=WG_THREADS)
            s_o = cute.local_tile(s_q, (WG_ROWS, dv), (0, 0))
            thr_pv.partition_C(s_o).store(o_16.load())
            cute.arch.barrier(barrier_id=int(Barrier.EPILOGUE_WG1) + wg, number_of_threads=WG_THREADS)
            self.store_rows(s_o, out, q_start, seq_len, rows0, kv_head, tidx)
            if cutlass.const_expr(self.return_lse):
                self.store_lse(lse, lse2, o_coords, Float32(math.log(2.0)), q_start, seq_len, rows0, kv_head, tidx)
        else:
            for r in cutlass.range_constexpr(n_rows):
                packed = rows0 + o_coords[r, 0][0]
                tok = packed // group
                if tok < seq_len:
                    dst = o_part[split, q_start + tok, kv_head * group + packed % group, None]
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                        pair = cute.make_rmem_tensor((2,), Float32)
                        pair[0] = o_mn[r, 2 * c]
                        pair[1] = o_mn[r, 2 * c + 1]
                        cute.autovec_copy(pair, cute.local_tile(dst, (2,), (o_coords[0, 2 * c][1] // 2,)))
            self.store_lse(lse_part[split, None, None], lse2, o_coords, Float32(1.0), q_start, seq_len, rows0,
                           kv_head, tidx)

    @cute.jit
    def store_rows(self, s_o: cute.Tensor, out: cute.Tensor, q_start: Int32, seq_len: Int32, rows0: Int32,
                   kv_head: Int32, tidx: Int32):
        """Staged 16-bit O rows to their (token, head) rows of ``out``, 16 bytes a thread at a time. Rows are walked
        from the last: with ``load_q``'s walk the compiler would keep its addresses live (spilled) through the loop."""
        group = self.group
        chunks = self.v_dim // VEC
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for j in cutlass.range_constexpr(WG_ROWS * chunks // WG_THREADS):
            idx = tidx + j * WG_THREADS
            r = WG_ROWS - 1 - idx // chunks
            c = idx % chunks
            tok = (rows0 + r) // group
            if tok < seq_len:
                cute.autovec_copy(cute.local_tile(s_o[r, None], (VEC,), (c,)), vals)
                dst = out[q_start + tok, self.group * kv_head + (rows0 + r) % group, None]
                cute.autovec_copy(vals, cute.local_tile(dst, (VEC,), (c,)))

    @cute.jit
    def store_lse(self, dst: cute.Tensor, lse2: cute.Tensor, o_coords: cute.Tensor, factor: Float32,
                  q_start: Int32, seq_len: Int32, rows0: Int32, kv_head: Int32, tidx: Int32):
        """``lse2 * factor`` of the thread's rows into ``dst [T, Hq]``, by the first thread of each quad."""
        group = self.group
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(lse2)):
                packed = rows0 + o_coords[r, 0][0]
                tok = packed // group
                if tok < seq_len:
                    dst[q_start + tok, kv_head * group + packed % group] = lse2[r] * factor
