"""``PagedAttentionSm100`` (Blackwell): FlashAttention over a paged KV cache with ``tcgen05.mma`` and tensor memory.

Same problem as the SM90 kernel (``sm90.py``), FA4's plan: a CTA is (block of ``q_tiles`` x 128 packed query
rows, KV head, split, request); packed row ``i*group + g`` is token ``i``, query head ``kv_head*group + g``
(pack-GQA), so decode fills M with the heads of a KV head and prefill with tokens. Two Q tiles where tensor memory,
shared memory and registers allow (``sm100_config.q_tiles``) and the step packs over 128 rows (the host's choice,
part of the key), so each K/V tile serves 256 rows and one Q tile's softmax runs while the tensor core works on the
other's. Warp roles:

* a softmax warpgroup per Q tile (warps 0-3, 4-7): thread ``t`` owns packed row ``t % 128`` of its tile (TMEM lane
  ``t % 128``). Per key tile it reads its row of S from TMEM (``tcgen05.ld``), masks it (causal / window / past the
  keys: only in the loops over the tiles the mask cuts for some row, branchless: a bit mask per 32 keys and a select
  per score; the middle loop has no mask code), optionally soft-caps it, takes the row max in base 2 with no
  cross-thread reduction and hands O's factor to the correction warpgroup at once (a max that rose by at most
  ``RESCALE_THRESHOLD`` is not taken: the factor is exactly 1), then per 32 scores: ``2^(scale s - max)`` (at D <=
  128 some pairs of each middle piece by a polynomial on the FMA pipe, ``sm100_config.EXP2_EMULATION``: 16 of a
  128-key row at two Q tiles, 24 at one; the rest on the MUFU), the row sum, and P (16-bit) written
  back to TMEM over the upper half of its S tile (``tcgen05.st``; the PV MMA takes A from TMEM, so P never goes
  through shared memory). At the end it hands its row's max and sum over.
* the correction warpgroup: per key tile, both Q tiles unrolled, it rescales the row of O in TMEM by the softmax's
  factor once the previous PV is done (a warp skips it when none of its rows moved; the first key tile has nothing to
  rescale and is peeled, as is the last, the only one that zeroes V rows past the request's keys), and hands O to the
  MMA warp with the softmax's P; at the end it divides O by the row sum (adding the sink's term) and writes the
  output (by TMA, see below), or a split's partial.
* the MMA warp: per (key tile j, Q tile t) ``S = Q_t K_j^T`` as soon as K/V tile j lands, and ``O_t += P V`` two
  pairs later (``tcgen05.mma`` with A in TMEM): with two Q tiles ``PV(j-1, 0), QK(j, 0), PV(j-1, 1), QK(j, 1)``, so
  the tensor core works on one Q tile while the other's softmax runs; with one ``PV(j-2), QK(j)`` into two S slots,
  so QK_j runs during the softmax of j-1. It owns the TMEM allocation (all 512 columns, so it starts at column 0:
  two S/P slots and an O per Q tile).
* the load warp: K and V tiles into a ``stages``-deep ring, straight in the MMA's swizzled layout. Pages that tile
  the key tile: ``populate`` names the tile's page rows, one TMA per page slot. Other pages (under 8 rows, or not
  dividing the tile): the lanes resolve each token's row into a shared row array and gather4 TMAs fetch 4 rows
  each, the swizzle on the smem pointer so each instruction lands 512 bytes past the previous one.

* fp8 caches (one Q tile) add warps 12-15, the converter warpgroup: each ring stage is dequantized (``x * scale`` of
  the value's granule, float32 or e8m0 scales, or of the plane: per-tensor ``k_scale`` / ``v_scale``) into one
  16-bit K and one 16-bit V tile that the MMAs read.

The warpgroups rebalance registers with ``setmaxnreg`` (``REGS``). Hand-offs are mbarriers: K/V ring (TMA -> MMA;
a stage is released by ``tcgen05.commit`` after the PV MMA that last reads it, so a stage is never overwritten
while an MMA may still read it), S full per slot (MMA -> softmax; a slot is free again for the QK two pairs later
because the PV MMA that reads its P is issued before it and the tensor core runs one thread's MMAs in issue order:
S has full barriers only, no "empty" side. FA4 relies on the same; the PTX ISA promises that order only between
MMAs of the same accumulator and shape, which PV and QK are not, so an ISA-strict schedule would wait for the PV's
commit before the next QK into its slot), P and O ready per slot (softmax and correction -> MMA, 256 arrivals), PV
done per slot (MMA commit -> correction: O stable for a rescale with one Q tile, each PV; with two only the last PV
commits, for the epilogue: PV(j-1, t) is issued before QK(j, t), whose commit the softmax waited for before handing
over the factor of (j, t), so O is stable by then, FA4's plan), and the final row statistics per Q tile (softmax ->
correction, one phase).
O's factor per slot goes from a softmax warp to the correction warp of the same rows by a named barrier of the two
warps (``SCALE_BARRIER_ID``: an arrive releases the float32 per row it stored in shared memory, a sync acquires it;
no phase to track; reused two pairs later, after the PV that waited for the correction's read).
TMEM accesses handed from one thread to another by an mbarrier or a barrier are fenced on both sides
(``tcgen05.fence::before_thread_sync`` before the arrival, ``::after_thread_sync`` after the wait), as the PTX memory
model asks: TMEM allocation, S (QK commit -> softmax loads), P and O (softmax and correction stores -> PV MMA), O
(PV commit -> correction's rescale / epilogue loads), and the dealloc.

Split-KV, sinks, soft-cap and the log-sum-exp follow ``sm90.py`` and the API: a split writes ``O/l`` and
``lse = m + log2 l`` (float32) for ``AttentionCombine``; the sink joins the denominator of split 0 only; with
``return_lse`` a single split writes ``lse`` (natural log) itself.

The epilogue stages O (16-bit, one split) in its Q tile's shared memory and one thread stores it with a TMA store per
swizzle row (64 columns; 32 at head dim 96, 16 at 80) when the group divides BM: a tile's packed rows are (token,
head) pairs, a token's group heads contiguous in ``out``, so a box is (a swizzle row's columns, group heads, 128 /
group tokens). A request's rows are ragged inside ``out`` and a TMA store clips only at its tensor map's bounds, so
the map is the ragged window (``tma_tiles.create_packed_ragged_store``: base shifted back 2^30 tokens, the request's
end as an extra coordinate): rows past the request fall out of bounds and are dropped, never written into the next
request's rows. Other groups, and split partials (float32 rows of
``o_part``), leave by the threads' 16-byte stores (a thread's row is contiguous).

No 2-CTA MMA (``cta_group::2``, M = 256 over a CTA pair, each CTA holding half of each K and V tile): it halves a
CTA's K/V shared-memory traffic and stage size, which pays when the MMAs are fed too slowly. A 128-key tile at D =
128 is 16 MMAs per Q tile (8 QK of K = 16, 8 PV) of 128 x 128 x 16, about 1024 cycles of an SM's tensor core (B200
dense 16-bit: ~8K FLOP a cycle an SM), and its 128 x 128 exponentials take the MUFU as long (16 a cycle an SM): the
two Q tiles' softmax warpgroups keep the MUFU busy while the tensor core works on the other tile, with the K/V ring 2 stages deep and the TMA ahead of it. Decode gains nothing
either: a KV head's query rows fill at most one 128-row tile, and the K/V bytes from HBM are the same. TMEM does not
limit it (each CTA of a pair keeps its 128 lanes).
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Uint8, Uint32
from cutlass._mlir.dialects import llvm, nvvm
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator, TmemAllocator

from cute_kv.kernels.attention.block_info import copy_q_chunk, split_tiles
from cute_kv.kernels.attention.config import layout_problem
from cute_kv.kernels.attention.operand import KVCacheMHAOperand
from cute_kv.kernels.attention.softmax import keep_range, to_16bit
from cute_kv.kernels.attention.config import ring_swizzle
from cute_kv.kernels.attention.sm100_common import (NEG_INF, dequantize_row, exp2_scores, o_chunk, o_copies,
                                                      rescale_o, row_add, row_normalizer, scale_scores,
                                                      update_max, write_lse)
from cute_kv.kernels.attention.sm100_config import (BM, FP8, RESCALE_THRESHOLD, SLOTS, TMEM_COLUMNS,
                                                      VEC, exp2_emulation, supported, tiling)
from cute_kv.kernels.paged import populate, tma_tiles
from cute_kv.kernels.paged.ragged_rows import request_rows
from cute_kv.kernels.quant import granule_scale, tensor_scale_views

# Warps: a softmax warpgroup per Q tile (0-3, 4-7), then the correction warpgroup, then the MMA warp, the load warp
# and two idle warps; fp8 caches (one Q tile) add the converter warpgroup, which dequantizes the K/V ring into the
# MMA's 16-bit tiles.
CONVERT_WARPS = (12, 13, 14, 15)
CONVERT_THREADS = 32 * len(CONVERT_WARPS)
# Registers per thread of each role (setmaxnreg), by (Q tiles, fp8 cache, soft-cap). ptxas sizes a CTA of 512 threads at 128 a
# thread, of 384 at 168; setmaxnreg.inc takes registers only from the CTA's pool, what the other warpgroups release
# of that launch count, so a warpgroup's targets may sum to (warpgroups x launch count) at most (more leaves the
# softmax's inc waiting forever). The softmax holds a row of S (BN floats) and a piece of P; the correction a
# 32-column piece of O; the MMA / load warps little, but 80 TMAs a key tile (D = 80: five 32-byte boxes a row, pages of
# 16) spilled the load warp under 184. The splits ptxas measured without spills (two Q tiles: FA4's 192 / 80 / 48).
def launch_registers(threads: int) -> int:
    """Registers a thread launches with in a CTA of ``threads`` (one CTA per SM): ptxas's 128 at 512, 168 at 384."""
    return min(255, 65536 // threads) // 8 * 8


REGS = {(2, False, False): {"softmax": 192, "correction": 80, "other": 48},
        (1, False, False): {"softmax": 232, "correction": 88, "other": 184},
        (1, False, True): {"softmax": 240, "correction": 136, "other": 128},
        (1, True, False): {"softmax": 200, "correction": 80, "other": 120, "convert": 112},
        (1, True, True): {"softmax": 184, "correction": 96, "other": 120, "convert": 112}}
TMEM_BARRIER_ID = 1  # named barrier of all threads: barriers initialized, Q staged, TMEM address published
EPILOGUE_BARRIER_ID = 2  # named barrier of the correction warpgroup: O staged in shared memory for the TMA store
# Named barriers 3-10: O's factors of an S slot handed from a softmax warp to the correction warp of the same 32 rows
# (ids ``SCALE_BARRIER_ID + warp % 4 + 4 * slot``): a bar.arrive and a bar.sync of 64 threads, no phase to track
# (FA4's ``sm_stats_barrier``).
SCALE_BARRIER_ID = 3
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
P_STORE_COLUMNS = 16  # P columns per tcgen05.st (32 scores): a piece's scores die once it is stored


@dsl_user_op
def tmem_fence_before_sync(*, loc=None, ip=None):
    """``tcgen05.fence::before_thread_sync``: this thread's earlier tcgen05 operations (TMEM loads/stores, MMAs)
    are ordered before its next thread synchronization (mbarrier arrival, barrier), as the PTX memory model asks of
    TMEM accesses that another thread's tcgen05 operations depend on."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.BEFORE_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def tmem_fence_after_sync(*, loc=None, ip=None):
    """``tcgen05.fence::after_thread_sync``: this thread's later tcgen05 operations are ordered after the
    synchronization it just completed (an mbarrier wait, a barrier), so they see the TMEM the other side wrote."""
    nvvm.tcgen05_fence(nvvm.Tcgen05FenceKind.AFTER_THREAD_SYNC, loc=loc, ip=ip)


@dsl_user_op
def cta_index(*, loc=None, ip=None):
    """``(%ctaid.x, %ctaid.y, %ctaid.z)`` read anew (volatile): a role derives the CTA's coordinates in its own
    branch, where values shared with the prologue would stay live into the branches of low register budgets
    (setmaxnreg) and be spilled."""
    return tuple(Int32(llvm.inline_asm(T.i32(), [], f"mov.u32 $0, %ctaid.{axis};", "=r", has_side_effects=True,
                                       is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))
                 for axis in "xyz")


class PagedAttentionSm100:
    """Compile-time key: dtype (of Q, O and the MMAs), heads (Hq, H), head dim, ``page_size``, KVD, whether the
    lookup table takes vector reads, the flags ``softcap``, ``sinks``, ``return_lse``, an fp8 cache:
    ``kv_dtype_name`` ``"float8_e4m3fn"`` with scales over ``granularity`` head dims (None: unscaled), float32 or,
    with ``e8m0_scales``, float8_e8m0fnu passed as their uint8 bits, ``q_tiles`` (None: as many as
    ``sm100_config.q_tiles`` allows; the host takes one for a step whose packed rows fit one tile), ``v_dim`` (None:
    the head dim): values are the first ``v_dim`` dims of the V rows (``sm100_config.VALUE_DIMS``: K of 192, V of
    128), O is ``v_dim`` wide, and ``layout`` ``"strided"``: K and V come as two strided planes ``[N, L, P, H, D]``
    instead of ``blocks`` (``KVCacheMHAOperand``; gather4 pages take a token's heads side by side, ``sH == D``).
    ``tensor_scales``: an fp8 cache scaled per tensor (``k_scale`` / ``v_scale``, ``cute_kv/tensor_scales.py``), its
    two scales passed as one float32 ``[2]`` in place of ``scales``, in either layout.

    An fp8 ring is dequantized (``x * scale``, rounded to ``dtype``) by a converter warpgroup (warps 12-15) into one
    16-bit K and one 16-bit V tile; a ring stage is released once both are converted, the K tile once the QK MMA
    that reads it completes, the V tile once the PV MMA completes.
    """

    def __init__(self, dtype_name: str, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                 kv_dim: int = 2, lut_vector: bool = True, softcap: bool = False, sinks: bool = False,
                 return_lse: bool = False, kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None,
                 e8m0_scales: bool = False, q_tiles: Optional[int] = None, v_dim: Optional[int] = None,
                 layout: str = "compact", tensor_scales: bool = False):
        kv_dtype_name = kv_dtype_name or dtype_name
        problem = supported(num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype_name, granularity,
                            v_dim) or layout_problem(layout, page_size, granularity)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[dtype_name]
        self.kv_fp8 = kv_dtype_name == FP8
        if tensor_scales and (not self.kv_fp8 or granularity):
            raise ValueError("tensor_scales needs an fp8 cache without granule scales")
        self.tensor_scales = tensor_scales
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else self.dtype
        self.granularity, self.e8m0_scales = granularity, e8m0_scales
        self.v_dim = v_dim or head_dim
        # K-major swizzle (bytes) of the 16-bit tiles (Q, O staged in it, dequantized K and V) and of the ring as
        # loaded, by the row's width (``config.ring_swizzle``); K and V rows alike (every ``VALUE_DIMS`` pair's do)
        self.swizzle = ring_swizzle(head_dim, False)
        self.ring_swizzle = ring_swizzle(head_dim, self.kv_fp8)
        assert ring_swizzle(self.v_dim, self.kv_fp8) == self.ring_swizzle
        self.plan = tiling(head_dim, page_size, self.kv_fp8, self.v_dim, softcap, num_q_heads // num_kv_heads, q_tiles)
        self.bn, self.stages, self.q_tiles = self.plan.bn, self.plan.stages, self.plan.q_tiles
        self.softmax_warps = tuple(range(4 * self.q_tiles))
        self.correction_warp = 4 * self.q_tiles  # the first of its warpgroup
        self.mma_warp, self.load_warp = self.correction_warp + 4, self.correction_warp + 5
        self.threads = 32 * (max(CONVERT_WARPS) + 1 if self.kv_fp8 else self.correction_warp + 8)  # 512 or 384
        self.exp2_emulation = {masked: exp2_emulation(head_dim, self.q_tiles, masked, self.kv_fp8)
                               for masked in (False, True)}
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.page_size, self.kv_dim = page_size, kv_dim
        self.softcap, self.sinks, self.return_lse = softcap, sinks, return_lse
        self.gather4 = self.plan.gather4
        # The planes' row views; without gather4 also one TMA per page slot, rows from populate.
        self.k_op = KVCacheMHAOperand(0, page_size, self.bn, lut_vector, layout == "strided")
        self.v_op = KVCacheMHAOperand(1, page_size, self.bn, lut_vector, layout == "strided")
        self.box_width = self.ring_swizzle * 8 // self.kv_dtype.width  # gather4 columns an instruction: a swizzle row
        self.s_cols = self.bn  # TMEM columns of one S tile
        self.p_cols = self.bn * self.dtype.width // 32  # TMEM columns of one P tile (two 16-bit values a column)
        self.o_col = 2 * self.bn  # first TMEM column of O
        # O leaves by TMA stores of (group heads, BM / group tokens, a swizzle row's columns) boxes when the group
        # divides BM.
        self.tma_store = BM % self.group == 0
        self.o_box_width = self.swizzle * 8 // self.dtype.width
        self.o_chunk = o_chunk(self.v_dim)

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        dt, d, dv, hq = self.dtype, self.head_dim, self.v_dim, self.num_q_heads
        t = cute.sym_int32()
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- 16-byte row accesses
        q = make_fake_tensor(dt, (t, hq, d), stride=(row(), d, 1), assumed_align=16)
        out = make_fake_tensor(dt, (t, hq, dv), stride=(row(), dv, 1), assumed_align=16)
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, dv),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        lse = make_fake_compact_tensor(Float32, (cute.sym_int32(), hq), stride_order=(1, 0), assumed_align=4)
        b, h, kvd, p = cute.sym_int32(), self.num_kv_heads, self.kv_dim, self.page_size
        blocks = self.k_op.fake_source(self.kv_dtype, h, d, kvd, heads_adjacent=self.gather4)  # rows_2d's view
        scales = None
        if self.granularity:
            g = d // self.granularity
            scales = make_fake_tensor(Uint8 if self.e8m0_scales else Float32, (
                cute.sym_int32(), kvd, cute.sym_int32(), p, h, g), stride=(
                cute.sym_int64(), cute.sym_int64(), p * h * g, h * g, g, 1), assumed_align=1)
        elif self.tensor_scales:
            scales = make_fake_compact_tensor(Float32, (2,), assumed_align=4)
        width = 1 if self.gather4 else self.k_op.lut_width  # what populate's vector loads need (TVM-FFI checks)
        lut = make_fake_tensor(Uint32, (b, cute.sym_int32()), stride=(cute.sym_int64(divisibility=width), 1),
                               assumed_align=4 * width)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        sinks = make_fake_compact_tensor(Float32, (hq,), assumed_align=4) if self.sinks else None
        return (q, out, o_part, lse_part, lse, blocks, blocks, offsets, lengths, lut, scales, sinks, Int32(0),
                Int32(1), Int32(1), Int32(1), Int32(0), Float32(1.0), Float32(1.0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, q: cute.Tensor, out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor,
                 lse: cute.Tensor, k_src: cute.Tensor, v_src: cute.Tensor, input_row_offsets: cute.Tensor,
                 cache_lengths: cute.Tensor, lookup_table: cute.Tensor, scales: Optional[cute.Tensor],
                 sinks: Optional[cute.Tensor], layer_idx: Int32, m_blocks: Int32, num_splits: Int32, causal: Int32,
                 window: Int32, score_scale: Float32, cap_log2: Float32, stream: cuda.CUstream):
        """``m_blocks``: ``ceil(max_seq_len * group / plan.rows)``; ``window`` 0: none. Logits in base 2 are
        ``score_scale * q.k`` (``scale * log2 e``), or with ``softcap`` ``cap_log2 * tanh(score_scale * q.k)``
        (``score_scale = scale / c``, ``cap_log2 = c * log2 e``). ``sinks``: float32 ``[Hq]`` (natural log units).
        ``scales``: an fp8 cache's ``[N, KVD, L, P, H, G]``, or with ``tensor_scales`` its ``(k_scale, v_scale)`` (None
        for unscaled or 16-bit caches)."""
        dt, d, dv, bn = self.dtype, self.head_dim, self.v_dim, self.bn
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                          tcgen05.CtaGroup.ONE, (BM, bn))
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                          tcgen05.CtaGroup.ONE, (BM, dv), tcgen05.OperandSource.TMEM)
        k_rows = self.k_op.row_view(k_src, layer_idx)
        v_rows = self.v_op.row_view(v_src, layer_idx)
        if cutlass.const_expr(self.gather4):
            # The index tensor only shapes the descriptor here; the kernel points it at its shared-memory rows.
            index = cute.make_tensor(cute.recast_ptr(lookup_table.iterator, dtype=Int32), cute.make_layout((bn,)))
            tma_k, g_k, _ = tma_tiles.create_gather4_tma_tile(self.rows_2d(k_rows), index, bn, self.box_width,
                                                              self.ring_swizzle)
            tma_v, g_v, _ = tma_tiles.create_gather4_tma_tile(self.rows_2d(v_rows), index, bn, self.box_width,
                                                              self.ring_swizzle)
        else:
            tma_k, g_k, _ = tma_tiles.create_tma_tile(k_rows, self.k_op.rows_per_copy, d, self.ring_swizzle)
            tma_v, g_v, _ = tma_tiles.create_tma_tile(v_rows, self.v_op.rows_per_copy, dv, self.ring_swizzle)
        tma_o = g_out = None
        if cutlass.const_expr(self.tma_store):
            tma_o, g_out, _ = tma_tiles.create_packed_ragged_store(out, self.group, BM, self.o_box_width, self.swizzle)
        k_scales = v_scales = None
        if cutlass.const_expr(self.tensor_scales):
            k_scales, v_scales = tensor_scale_views(scales)
        elif cutlass.const_expr(scales is not None):
            # [N, KVD, L, P, H, G] shares the cache's page geometry: rows numbered as the K/V row views'.
            k_scales = tma_tiles.kv_row_view(scales, 0, layer_idx)
            v_scales = tma_tiles.kv_row_view(scales, 1, layer_idx)
        rows_per_page = self.k_op.rows_per_page(k_src)
        grid = (m_blocks, self.num_kv_heads * num_splits, cache_lengths.shape[0])  # m_blocks of plan.rows rows
        # No smem= at launch: the DSL sizes it from what the kernel allocates (``plan.smem`` bounds that). One CTA
        # per SM declared (.minnctapersm 1): ptxas then knows the register count at entry and applies setmaxnreg.
        self.kernel(tiled_mma_qk, tiled_mma_pv, tma_k, g_k, tma_v, g_v, tma_o, g_out, q, out, o_part,
                    lse_part, lse,
                    input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales, sinks, rows_per_page,
                    k_rows.shape[0], num_splits, causal, window, score_scale, cap_log2).launch(
            grid=grid, block=(self.threads, 1, 1), stream=stream, min_blocks_per_mp=1)

    def slot_use(self, j: Int32, tile) -> tuple:
        """``(slot, parity)``: the S/P slot of the pair (key tile ``j`` of the split, Q tile ``tile``) and the parity of
        its barriers' phase. Two Q tiles: slot ``tile``, a phase per key tile; one: the slots alternate, a phase per
        two key tiles. Bit operations (``j >= 0``): signed ``%`` and ``//`` would add sign fix-ups to every loop."""
        if self.q_tiles == 2:
            return tile, j & 1
        return j & 1, (j >> 1) & 1

    def p_col(self, buf: Int32) -> Int32:
        """First TMEM column of P in S buffer ``buf``: the buffer's upper half, read into registers before."""
        return buf * self.s_cols + self.s_cols - self.p_cols

    @staticmethod
    def rows_2d(rows: cute.Tensor) -> cute.Tensor:
        """``[rows, H, D]`` -> ``[rows, H*D]``: gather4's 2-D view (the column picks head and depth)."""
        return cute.make_tensor(rows.iterator, cute.make_layout((rows.shape[0], rows.shape[1] * rows.shape[2]),
                                                                stride=(rows.stride[0], 1)))

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tma_k: cute.CopyAtom,
               g_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor, tma_o: Optional[cute.CopyAtom],
               g_out: Optional[cute.Tensor], q: cute.Tensor, out: cute.Tensor,
               o_part: cute.Tensor, lse_part: cute.Tensor, lse: cute.Tensor,
               input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
               k_scales: Optional[cute.Tensor], v_scales: Optional[cute.Tensor], sinks: Optional[cute.Tensor],
               rows_per_page: Int32, oob_row: Int32, num_splits: Int32, causal: Int32, window: Int32,
               score_scale: Float32, cap_log2: Float32):
        dt, d, dv, bn, group, stages = self.dtype, self.head_dim, self.v_dim, self.bn, self.group, self.stages
        tiles = self.q_tiles
        m_block, head_split, b = cute.arch.block_idx()
        kv_head = head_split % self.num_kv_heads
        q_start, seq_len = request_rows(input_row_offsets, b, q.shape[0])  # (unchecked offsets stay inside q)
        m0 = m_block * self.plan.rows
        if m0 < seq_len * group:  # the CTA has query rows (uniform: the whole CTA leaves otherwise)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            # Each role works out the CTA's coordinates and keys in its own branch (``keys``; names of its own, not
            # the prologue's, which the DSL would carry out of the branch): values live from here into the branches
            # of low register budgets (setmaxnreg) would be spilled.
            keys = (cache_lengths, seq_len, causal, window, num_splits)

            smem = SmemAllocator()
            kv_bars = smem.allocate_array(cutlass.Int64, 2 * stages)
            s_bars = smem.allocate_array(cutlass.Int64, SLOTS)  # S full: nothing releases S (see the module)
            p_bars = smem.allocate_array(cutlass.Int64, SLOTS)  # P written and O rescaled: the PV MMA may run
            o_bars = smem.allocate_array(cutlass.Int64, SLOTS)  # a PV done, per P slot: O stable
            stats_bars = smem.allocate_array(cutlass.Int64, tiles)  # a Q tile's final max and sum handed over
            k_bars = smem.allocate_array(cutlass.Int64, 2)  # fp8: dequantized K and V tiles
            v_bars = smem.allocate_array(cutlass.Int64, 2)
            s_scale = smem.allocate_tensor(Float32, cute.make_layout((BM, SLOTS)), byte_alignment=16)
            s_stats = smem.allocate_tensor(Float32, cute.make_layout((BM, 2, tiles)), byte_alignment=16)
            s_rows = None
            if cutlass.const_expr(self.gather4):  # each stage's token rows, read by its gather4 instructions
                s_rows = smem.allocate_tensor(Int32, cute.make_layout((bn, stages)), byte_alignment=16)
            sq_layout = tma_tiles.smem_tile_layout(dt, BM, d, self.swizzle, stages=tiles)
            ring_k_layout = tma_tiles.smem_tile_layout(self.kv_dtype, bn, d, self.ring_swizzle, stages=stages)
            ring_v_layout = tma_tiles.smem_tile_layout(self.kv_dtype, bn, dv, self.ring_swizzle, stages=stages)
            s_q = smem.allocate_tensor(dt, sq_layout.outer, byte_alignment=1024, swizzle=sq_layout.inner)
            ring_k = smem.allocate_tensor(self.kv_dtype, ring_k_layout.outer, byte_alignment=1024,
                                          swizzle=ring_k_layout.inner)
            ring_v = smem.allocate_tensor(self.kv_dtype, ring_v_layout.outer, byte_alignment=1024,
                                          swizzle=ring_v_layout.inner)
            s_k, s_v = ring_k, ring_v  # what the MMAs read: the ring itself, or the dequantized tiles
            if cutlass.const_expr(self.kv_fp8):
                k_layout = tma_tiles.smem_tile_layout(dt, bn, d, self.swizzle, stages=1)
                v_layout = tma_tiles.smem_tile_layout(dt, bn, dv, self.swizzle, stages=1)
                s_k = smem.allocate_tensor(dt, k_layout.outer, byte_alignment=1024, swizzle=k_layout.inner)
                s_v = smem.allocate_tensor(dt, v_layout.outer, byte_alignment=1024, swizzle=v_layout.inner)
            # V as the PV MMA's B operand: (D_v, BN) with D_v contiguous (MN-major), the same bytes.
            s_vt = cute.composition(s_v, cute.make_ordered_layout((dv, bn, cute.size(s_v, mode=[2])),
                                                                  order=(1, 0, 2)))

            one_cta = cute.make_layout((1, 1, 1, 1))
            thread = pipeline.Agent.Thread
            k_pipe = v_pipe = None
            if cutlass.const_expr(self.kv_fp8):  # ring -> converter warpgroup -> 16-bit K, V tiles -> MMA
                kv_pipe = pipeline.PipelineTmaAsync.create(
                    barrier_storage=kv_bars, num_stages=stages, producer_group=pipeline.CooperativeGroup(thread),
                    consumer_group=pipeline.CooperativeGroup(thread, CONVERT_THREADS // 32),  # a lane a warp
                    tx_count=self.plan.stage_bytes, cta_layout_vmnk=one_cta, defer_sync=True)
                k_pipe, v_pipe = [pipeline.PipelineAsyncUmma.create(
                    barrier_storage=bars, num_stages=1,
                    producer_group=pipeline.CooperativeGroup(thread, CONVERT_THREADS),
                    consumer_group=pipeline.CooperativeGroup(thread), cta_layout_vmnk=one_cta, defer_sync=True)
                    for bars in (k_bars, v_bars)]
            else:
                kv_pipe = pipeline.PipelineTmaUmma.create(
                    barrier_storage=kv_bars, num_stages=stages, producer_group=pipeline.CooperativeGroup(thread),
                    consumer_group=pipeline.CooperativeGroup(thread), tx_count=self.plan.stage_bytes,
                    cta_layout_vmnk=one_cta, defer_sync=True)
            # Hand-offs of the tile loop, each an array of plain mbarriers (module docstring): the MMA's commits
            # (S full, PV done), the softmax's arrivals (factors, P; final statistics), the correction's (O).
            mma_agent = (pipeline.PipelineOp.TCGen05Mma, pipeline.CooperativeGroup(thread))
            s_full = pipeline.MbarrierArray(barrier_storage=s_bars, num_stages=SLOTS, agent=mma_agent)
            o_done = pipeline.MbarrierArray(barrier_storage=o_bars, num_stages=SLOTS, agent=mma_agent)
            rows_agent = (pipeline.PipelineOp.AsyncThread, pipeline.CooperativeGroup(thread, BM))
            stats_full = pipeline.MbarrierArray(barrier_storage=stats_bars, num_stages=tiles, agent=rows_agent)
            p_ready = pipeline.MbarrierArray(barrier_storage=p_bars, num_stages=SLOTS, agent=(
                pipeline.PipelineOp.AsyncThread, pipeline.CooperativeGroup(thread, 2 * BM)))  # softmax + correction

            tmem = TmemAllocator(barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID,
                                                                            num_threads=self.threads),
                                 allocator_warp_id=self.mma_warp)
            tmem.allocate(TMEM_COLUMNS)
            self.load_q(s_q, q, q_start, seq_len, m0, kv_head)
            cute.arch.mbarrier_init_fence()
            tmem_fence_before_sync()  # the allocation (tcgen05.alloc) before the barrier that publishes it
            tmem.wait_for_alloc()  # all threads: barriers initialized, Q staged, TMEM allocated
            tmem_fence_after_sync()
            tmem.relinquish_alloc_permit()

            thr_qk = tiled_mma_qk.get_slice(0)
            thr_pv = tiled_mma_pv.get_slice(0)

            # Each role sets its register budget first thing in its own branch, so ptxas allocates each branch
            # under its own limit.
            if warp_idx == self.load_warp:
                self.set_registers("other")
                _, b_, kv_head_, _, _, num_keys, first_tile, n_tiles = self.keys(*keys)
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for _ in cutlass.range(n_tiles, unroll=1):
                    if cutlass.const_expr(self.gather4):
                        self.gather_tile(kv_pipe, prod, first_tile + prod.count, tma_k, g_k, ring_k, tma_v, g_v,
                                         ring_v, s_rows, lookup_table, b_, kv_head_, num_keys, rows_per_page, oob_row)
                    else:
                        self.load_tile(kv_pipe, prod, first_tile + prod.count, tma_k, g_k, ring_k, tma_v, g_v,
                                       ring_v, lookup_table, b_, kv_head_, num_keys, rows_per_page, oob_row)
                    prod.advance()
                kv_pipe.producer_tail(prod)  # every stage released: no MMA commit lands after the CTA exits
            if warp_idx == self.mma_warp:
                self.set_registers("other")
                n_tiles = self.keys(*keys)[7]
                t_s, t_o = self.tmem_tensors(tmem, thr_qk, thr_pv)
                self.mma(tiled_mma_qk, tiled_mma_pv, thr_qk, thr_pv, s_q, s_k, s_vt, t_s, t_o, kv_pipe, s_full,
                         p_ready, o_done, k_pipe, v_pipe, n_tiles)
            if warp_idx > self.load_warp and warp_idx < self.load_warp + 3:
                self.set_registers("other")  # the idle warps of the MMA / load warpgroup
            if cutlass.const_expr(self.kv_fp8):
                if warp_idx >= CONVERT_WARPS[0]:
                    self.set_registers("convert")
                    _, b_, kv_head_, _, _, num_keys, first_tile, n_tiles = self.keys(*keys)
                    self.convert(kv_pipe, k_pipe, v_pipe, ring_k, ring_v, s_k, s_v, k_scales, v_scales, s_rows,
                                 lookup_table, first_tile, n_tiles, b_, kv_head_, num_keys, rows_per_page, oob_row)
            if warp_idx >= self.correction_warp and warp_idx < self.correction_warp + 4:
                self.set_registers("correction")
                row0, _, kv_head_, split_, _, num_keys, first_tile, n_tiles = self.keys(*keys)
                t_o = self.tmem_tensors(tmem, thr_qk, thr_pv)[1]
                self.correction(t_o, s_v, s_scale, p_ready, o_done, first_tile, n_tiles, num_keys,
                                SCALE_BARRIER_ID + warp_idx % 4)
                for t in cutlass.range(tiles, unroll=1):  # one copy of the epilogue's code
                    stats_full.wait(t, 0)
                    row_max = s_stats[cute.arch.thread_idx()[0] % BM, 0, t]
                    row_sum = s_stats[cute.arch.thread_idx()[0] % BM, 1, t]
                    if n_tiles > 0:  # the last PV MMA of the tile is done (its commit: every earlier one too)
                        if cutlass.const_expr(tiles == 2):
                            o_done.wait(t, 0)  # (its only commit: ``mma``)
                        else:
                            o_done.wait(*self.slot_use(n_tiles - 1, t))
                        tmem_fence_after_sync()
                    self.epilogue(self.o_tile(t_o, t), n_tiles > 0, row_max, row_sum, sinks, out, o_part, lse_part,
                                  lse, tma_o, g_out, s_q[None, None, t], q_start, seq_len, row0 + t * BM, kv_head_,
                                  split_, num_splits)
            if warp_idx < self.correction_warp:
                self.set_registers("softmax")
                row0, _, _, _, cache_len, num_keys, first_tile, n_tiles = self.keys(*keys)
                t_s = self.tmem_tensors(tmem, thr_qk, thr_pv)[0]
                self.softmax(warp_idx // 4, SCALE_BARRIER_ID + warp_idx % 4, t_s, s_scale, s_stats, s_full, p_ready,
                             stats_full,
                             first_tile, n_tiles, row0 + warp_idx // 4 * BM, seq_len, cache_len, num_keys, causal,
                             window, score_scale, cap_log2)
            tmem_fence_before_sync()  # every thread's TMEM accesses (waited on) before the barrier...
            cute.arch.sync_threads()
            tmem_fence_after_sync()  # ... and the dealloc after it
            tmem.free(tmem.retrieve_ptr(Float32))

    @cute.jit
    def keys(self, cache_lengths: cute.Tensor, seq_len: Int32, causal: Int32, window: Int32, num_splits: Int32):
        """``(m0, b, kv_head, split, cache_len, num_keys, first_tile, n_tiles)``: the CTA's first packed row, request,
        KV head and split (``cta_index``), the request's keys and the key tiles this CTA's split walks."""
        m_block, head_split, b = cta_index()
        m0 = m_block * self.plan.rows
        kv_head = head_split % self.num_kv_heads
        split = head_split // self.num_kv_heads
        cache_len = Int32(cache_lengths[b])
        num_keys = cache_len + seq_len
        first_tile, n_tiles = split_tiles(m0, seq_len, cache_len, num_keys, causal, window, split, num_splits,
                                          self.plan.rows, self.bn, self.group)
        return m0, b, kv_head, split, cache_len, num_keys, first_tile, n_tiles

    def tmem_tensors(self, tmem: TmemAllocator, thr_qk: cute.ThrMma, thr_pv: cute.ThrMma):
        """``(S slots, O)`` in tensor memory, from the allocation's address (read where a role needs it, like
        ``keys``): S slots at columns [0, BN) and [BN, 2 BN), Q tile t's O at [2 BN + t D_v, 2 BN + (t+1) D_v)."""
        ptr = tmem.retrieve_ptr(Float32)
        t_s = thr_qk.make_fragment_C(cute.append(thr_qk.partition_shape_C((BM, self.bn)), SLOTS))
        t_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BM, self.v_dim)))
        return cute.make_tensor(ptr, t_s.layout), cute.make_tensor(ptr + self.o_col, t_o.layout)

    def set_registers(self, role: str):
        """Moves registers between the warpgroups (``REGS``): a role above the launch count increases, one below
        decreases (PTX ISA 9.7.19.5: ``.dec`` from a count below its target, or ``.inc`` from one above, is
        undefined), so one Q tile's MMA / load warpgroup raises itself to 184 from 168."""
        regs = REGS[self.q_tiles, self.kv_fp8, self.softcap][role]
        if regs > launch_registers(self.threads):
            cute.arch.setmaxregister_increase(regs)
        elif regs < launch_registers(self.threads):
            cute.arch.setmaxregister_decrease(regs)

    def o_tile(self, t_o: cute.Tensor, tile: int) -> cute.Tensor:
        """Q tile ``tile``'s O accumulator: ``D_v`` TMEM columns after the previous tile's."""
        return cute.make_tensor(t_o.iterator + tile * self.v_dim, t_o.layout)

    @cute.jit
    def load_tile(self, pipe: pipeline.PipelineTmaUmma, prod: pipeline.PipelineState, tile: Int32,
                  tma_k: cute.CopyAtom, g_k: cute.Tensor, s_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor,
                  s_v: cute.Tensor, lookup_table: cute.Tensor, b: Int32, kv_head: Int32, num_keys: Int32,
                  rows_per_page: Int32, oob_row: Int32):
        """Load warp: K and V of key tile ``tile`` into stage ``prod.index``, one TMA per page slot each (the K and
        V planes share the row numbering, so one ``populate`` serves both); boxes of the K rows' ``head_dim`` and
        the V rows' first ``v_dim`` columns."""
        op = self.k_op
        rows = cute.make_rmem_tensor((op.copies_per_tile,), Int32)
        op.populate(rows, lookup_table, b, tile * self.bn, num_keys, rows_per_page, oob_row)
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        for g_rows, s_tiles, atom, width in ((g_k, s_k, tma_k, self.head_dim), (g_v, s_v, tma_v, self.v_dim)):
            box = (op.rows_per_copy, width)
            for p in cutlass.range_constexpr(op.copies_per_tile):
                src = cute.local_tile(cute.domain_offset((rows[p], 0, 0), g_rows), box, (0, 0, kv_head))
                dst = cute.local_tile(s_tiles[None, None, prod.index], box, (p, 0))
                t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                 cute.group_modes(src, 0, 2))
                cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)

    @cute.jit
    def gather_tile(self, pipe: pipeline.PipelineTmaUmma, prod: pipeline.PipelineState, tile: Int32,
                    tma_k: cute.CopyAtom, g_k: cute.Tensor, s_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor,
                    s_v: cute.Tensor, s_rows: cute.Tensor, lookup_table: cute.Tensor, b: Int32, kv_head: Int32,
                    num_keys: Int32, rows_per_page: Int32, oob_row: Int32):
        """Load warp, small or uneven pages: each lane resolves BN/32 of the tile's token rows
        (``populate.key_row``: ``oob_row``, which TMA zero-fills, past the keys or the lookup table's row) into the
        stage's row array, then gather4 brings K and V, 4 rows x one 128-byte swizzle row per instruction, straight
        into the MMA's swizzled tiles."""
        bn, width = self.bn, self.box_width
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.kv_fp8):
            # The converter reads the rows once the stage's full barrier completes, so the arrival on it (a
            # release) follows the rows' stores; ``producer_acquire`` would arrive before them.
            pipe.sync_object_empty.wait(prod.index, prod.phase)
        else:
            pipe.producer_acquire(prod)
        cute.arch.sync_warp()  # the stage's previous gathers were issued before any lane rewrites its rows
        for t in cutlass.range(lane, bn, 32, unroll=1):
            s_rows[t, prod.index] = populate.key_row(lookup_table, b, tile * bn + t, num_keys, rows_per_page,
                                                     self.page_size, oob_row)
        cute.arch.sync_warp()  # (orders every lane's rows before the elected lane's arrival)
        if cutlass.const_expr(self.kv_fp8):
            pipe.sync_object_full.arrive(prod.index, pipe.producer_mask)
        bar = pipe.producer_get_barrier(prod)
        index = cute.zipped_divide(cute.make_tensor(s_rows[None, prod.index].iterator,
                                                    cute.make_layout((bn, width), stride=(1, 0))), (bn, width))
        for g_rows, s_tiles, atom, depth in ((g_k, s_k, tma_k, self.head_dim), (g_v, s_v, tma_v, self.v_dim)):
            for c in cutlass.range_constexpr(depth // width):
                src = cute.zipped_divide(cute.domain_offset((0, kv_head * self.head_dim + c * width), g_rows),
                                         (bn, width))
                dst = cute.local_tile(s_tiles[None, None, prod.index], (bn, width), (0, c))
                t_s, t_g, t_i = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                      [src, index])
                cute.copy(atom, [t_g[None, (0, 0)], t_i[None, (0, 0)]], t_s, tma_bar_ptr=bar)

    @cute.jit
    def mma(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, thr_qk: cute.ThrMma,
            thr_pv: cute.ThrMma, s_q: cute.Tensor, s_k: cute.Tensor, s_vt: cute.Tensor,
            t_s: cute.Tensor, t_o: cute.Tensor, kv_pipe: pipeline.PipelineTmaUmma, s_full: pipeline.MbarrierArray,
            p_ready: pipeline.MbarrierArray, o_done: pipeline.MbarrierArray,
            k_pipe: Optional[pipeline.PipelineAsyncUmma], v_pipe: Optional[pipeline.PipelineAsyncUmma],
            n_tiles: Int32):
        """MMA warp: the QK and PV of every (key tile, Q tile) pair, a QK two pairs ahead of its PV: with two Q
        tiles ``PV(j-1, t)`` then ``QK(j, t)`` for t = 0, 1 (S slot t), so one Q tile's MMAs run while the other's
        softmax reads its S; with one Q tile ``PV(j-2)`` then ``QK(j)`` (S slot j % 2), so QK_j runs while the
        softmax reads S_{j-1}. K and V come from the ring, or with an fp8 cache from the converter's 16-bit tiles
        (``k_pipe``, ``v_pipe``; each released by the commit of the MMA that reads it)."""
        tiles = self.q_tiles
        lag = SLOTS // tiles  # key tiles between a pair's QK and its PV
        t_rq = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(s_q))
        t_rk = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(s_k))
        # P as the PV MMA's A operand in TMEM (K-major, two 16-bit values per column), at its S tile's upper half. The
        # fragment's addresses are columns from 0, where the allocation starts: it takes all 512 columns.
        p_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, (BM, self.v_dim, self.bn), self.dtype, 1)
        t_rp = thr_pv.make_fragment_A(cute.make_tensor(t_s.iterator, p_layout.outer))[None, None, None, 0]
        t_rv = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(s_vt))
        kv_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        kv_done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        k_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)  # fp8: the 16-bit tiles
        v_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for j in cutlass.range(n_tiles + lag, unroll=1):
            for t in cutlass.range(tiles, unroll=1):  # a loop, not unrolled: one set of live descriptors
                if j >= lag:  # PV of (j - lag, t)
                    jp = j - lag
                    slot, parity = self.slot_use(jp, t)
                    v_stage = kv_done.index
                    if cutlass.const_expr(self.kv_fp8):  # (one Q tile)
                        v_stage = Int32(0)
                        v_pipe.consumer_wait(v_read)
                    p_ready.wait(slot, parity)  # P of the pair written, O rescaled
                    tmem_fence_after_sync()  # ... by the softmax's and correction's tcgen05.st, before the MMA
                    t_rp_j = cute.make_tensor(t_rp.iterator + self.p_col(slot) * (32 // self.dtype.width),
                                              t_rp.layout)  # (the A fragment counts 16-bit elements)
                    acc_o = self.o_tile(t_o, t)
                    tiled_mma_pv.set(tcgen05.Field.ACCUMULATE, jp > 0)  # the first tile's PV starts O
                    for kb in cutlass.range_constexpr(cute.size(t_rp, mode=[2])):
                        cute.gemm(tiled_mma_pv, acc_o, t_rp_j[None, None, kb], t_rv[None, None, kb, v_stage], acc_o)
                        tiled_mma_pv.set(tcgen05.Field.ACCUMULATE, True)
                    # On completion: O stable for the epilogue and, with one Q tile, a rescale; with two nothing
                    # waits for the others (``correction``), so only the last PV commits, one phase (FA4's).
                    if cutlass.const_expr(tiles == 1):
                        o_done.arrive(slot, None, tcgen05.CtaGroup.ONE)
                    elif jp == n_tiles - 1:
                        o_done.arrive(slot, None, tcgen05.CtaGroup.ONE)
                    if t == tiles - 1:  # the key tile's last PV: its V (and K) free
                        if cutlass.const_expr(self.kv_fp8):
                            v_pipe.consumer_release(v_read)
                            v_read.advance()
                        else:
                            kv_pipe.consumer_release(kv_done)
                        kv_done.advance()
                if j < n_tiles:  # QK of (j, t)
                    k_stage = kv_read.index
                    if cutlass.const_expr(self.kv_fp8):  # (one Q tile)
                        k_stage = Int32(0)
                        k_pipe.consumer_wait(k_read)
                    elif t == 0:
                        kv_pipe.consumer_wait(kv_read)
                    # The slot last held P of the pair two before, read by the PV MMA issued before this one: the
                    # MMAs run in issue order (beyond the ISA's same-accumulator pairs: see the module), so S has
                    # no empty barrier (the softmax read that S before handing its P over).
                    slot = self.slot_use(j, t)[0]
                    acc_s = t_s[None, None, None, slot]
                    for kb in cutlass.range_constexpr(cute.size(t_rq, mode=[2])):
                        tiled_mma_qk.set(tcgen05.Field.ACCUMULATE, kb != 0)
                        cute.gemm(tiled_mma_qk, acc_s, t_rq[None, None, kb, t], t_rk[None, None, kb, k_stage], acc_s)
                    s_full.arrive(slot, None, tcgen05.CtaGroup.ONE)  # the QK MMAs' commit: S written
                    if t == tiles - 1:
                        if cutlass.const_expr(self.kv_fp8):
                            k_pipe.consumer_release(k_read)  # on completion: the converter may write the next K
                            k_read.advance()
                        kv_read.advance()

    @cute.jit
    def softmax(self, tile: Int32, scale_bar: Int32, t_s: cute.Tensor, s_scale: cute.Tensor, s_stats: cute.Tensor,
                s_full: pipeline.MbarrierArray, p_ready: pipeline.MbarrierArray,
                stats_full: pipeline.MbarrierArray, first_tile: Int32, n_tiles: Int32, m0: Int32, seq_len: Int32,
                cache_len: Int32, num_keys: Int32, causal: Int32, window: Int32, score_scale: Float32,
                cap_log2: Float32):
        """Softmax warpgroup of Q tile ``tile`` (packed rows from ``m0``): row ``tidx % 128`` of each of its S tiles
        -> P, in place in TMEM; O's factor of the tile to the correction warpgroup (``s_scale``, then named barrier
        ``scale_bar + 4 * slot``: ``SCALE_BARRIER_ID``) as soon as the row max is known; the final ``(row_max,
        row_sum)`` (base 2) to ``s_stats``."""
        bn = self.bn
        row = cute.arch.thread_idx()[0] % BM
        tok = (m0 + row) // self.group
        pos = cache_len + tok
        row_end = num_keys
        if causal != 0:
            row_end = cutlass.min(pos + 1, num_keys)
        row_begin = Int32(0)
        if window > 0:
            row_begin = cutlass.max(pos - window + 1, 0)  # (so the mask's bounds less a tile's keys stay in int32)
        if tok >= seq_len:
            row_end = Int32(0)  # a padding row: everything masked

        s_tile = t_s[(None, None), 0, 0, 0]
        load_s = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)),
                                                            Float32), s_tile).get_slice(row)
        t_s_src = load_s.partition_S(s_tile)
        cols = load_s.partition_D(cute.make_identity_tensor((BM, bn)))  # (row, key) of each S register
        scores = cute.make_rmem_tensor(cols.shape, Float32)
        # P goes back to TMEM over the upper half of its S tile: the thread's row, 16-bit pairs in 32-bit columns,
        # one piece of P_STORE_COLUMNS columns (2 x P_STORE_COLUMNS scores) at a time.
        p_piece = cute.make_tensor(s_tile.iterator + self.p_col(0),
                                   cute.composition(s_tile.layout, cute.make_layout((BM, P_STORE_COLUMNS))))
        store_p = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(P_STORE_COLUMNS)), Float32), p_piece).get_slice(row)
        t_p_dst = store_p.partition_D(p_piece)
        packed = cute.make_rmem_tensor(store_p.partition_S(cute.make_identity_tensor((BM, P_STORE_COLUMNS))).shape,
                                       Float32)
        piece = 2 * P_STORE_COLUMNS  # scores a P piece holds
        probs = cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=self.dtype), cute.make_layout(piece))
        flat = cute.make_tensor(scores.iterator, cute.make_layout(cute.size(scores)))  # register c: key c

        # Three loops over the split's tiles: those the mask cuts for some live row of the warpgroup (the window's
        # start), those every live row sees whole (no mask code at all), those the mask cuts again (the causal
        # edge, the keys' end). Padding rows take the middle loop's unmasked values, never stored.
        tok_lo = m0 // self.group
        tok_hi = cutlass.min((cutlass.min(m0 + BM, seq_len * self.group) - 1) // self.group, seq_len - 1)
        whole_end = num_keys
        if causal != 0:
            whole_end = cutlass.min(cache_len + tok_lo + 1, num_keys)
        whole_begin = Int32(0)
        if window > 0:
            whole_begin = cutlass.max(cache_len + tok_hi - window + 1, 0)
        first_whole = cutlass.min(cutlass.max((whole_begin + bn - 1) // bn - first_tile, 0), n_tiles)
        end_whole = cutlass.min(cutlass.max(whole_end // bn - first_tile, first_whole), n_tiles)
        row_max = NEG_INF
        row_sum = Float32(0.0)
        copies = (load_s, t_s_src, scores, cols, flat, store_p, packed, probs, t_p_dst)
        bars = (s_scale, s_full, p_ready, scale_bar)
        if cutlass.const_expr(self.softcap):  # one loop: tanh's registers leave none for three copies (ptxas)
            for j in cutlass.range(n_tiles, unroll=1):
                row_max, row_sum = self.softmax_tile(True, j, row_max, row_sum, tile, first_tile, row_begin,
                                                     row_end, copies, bars, score_scale, cap_log2)
        else:
            for j in cutlass.range(first_whole, unroll=1):
                row_max, row_sum = self.softmax_tile(True, j, row_max, row_sum, tile, first_tile, row_begin,
                                                     row_end, copies, bars, score_scale, cap_log2)
            for j in cutlass.range(first_whole, end_whole, unroll=1):
                row_max, row_sum = self.softmax_tile(False, j, row_max, row_sum, tile, first_tile, row_begin,
                                                     row_end, copies, bars, score_scale, cap_log2)
            for j in cutlass.range(end_whole, n_tiles, unroll=1):
                row_max, row_sum = self.softmax_tile(True, j, row_max, row_sum, tile, first_tile, row_begin,
                                                     row_end, copies, bars, score_scale, cap_log2)
        s_stats[row, 0, tile] = row_max
        s_stats[row, 1, tile] = row_sum
        stats_full.arrive(tile, None)

    @cute.jit
    def softmax_tile(self, mask: cutlass.Constexpr[bool], j: Int32, row_max: Float32, row_sum: Float32, tile: Int32,
                     first_tile: Int32, row_begin: Int32, row_end: Int32, copies: tuple, bars: tuple,
                     score_scale: Float32, cap_log2: Float32):
        """One S tile (``j`` of the split) of the softmax warpgroup's row: returns the running ``(row_max, row_sum)``.
        ``mask``: the row's ``[row_begin, row_end)`` cuts the tile for some row (else no mask code)."""
        load_s, t_s_src, scores, cols, flat, store_p, packed, probs, t_p_dst = copies
        s_scale, s_full, p_ready, scale_bar = bars
        bn = self.bn
        row = cute.arch.thread_idx()[0] % BM
        piece = 2 * P_STORE_COLUMNS
        tile_base = (first_tile + j) * bn
        slot, parity = self.slot_use(j, tile)
        s_full.wait(slot, parity)
        tmem_fence_after_sync()  # the QK MMA's write of S (its tcgen05.commit arrival) before reading S
        cute.copy(load_s, cute.make_tensor(t_s_src.iterator + slot * self.s_cols, t_s_src.layout), scores)
        cute.arch.fence_view_async_tmem_load()  # S is in registers before P overwrites half of it

        exp_scale = score_scale  # raw scores: the scale is folded into the max and the exponent's FMA
        if cutlass.const_expr(self.softcap):
            scale_scores(scores, score_scale, True, cap_log2)
            exp_scale = Float32(1.0)
        if cutlass.const_expr(mask):  # branchless: the row's visible keys [lo, hi), a constant column a score
            keep_range(scores, [cols[j][1] for j in range(bn)], row_begin - tile_base, row_end - tile_base)
        new_max, ref, corr = update_max(scores, row_max, RESCALE_THRESHOLD, exp_scale)
        s_scale[row, slot] = corr  # the correction warpgroup rescales O meanwhile
        cute.arch.barrier_arrive(barrier_id=scale_bar + 4 * slot, number_of_threads=64)
        # Piece by piece: 2^(s - ref) (FMA-emulated in part of the middle pieces, whose MUFU latency the others
        # fill), the row sum, P rounded and stored: a piece's float32 scores die once its P is in TMEM. The
        # slot's P columns are free (the PV of the pair two before precedes this QK): no wait.
        row_sum = row_sum * corr
        pieces = bn // piece
        for i in cutlass.range_constexpr(pieces):
            vals = cute.local_tile(flat, (piece,), (i,))
            exp2_scores(vals, ref, self.exp2_emulation[mask] if 0 < i < pieces - 1 else 0, exp_scale)
            row_sum = row_add(vals, row_sum)
            to_16bit(vals, probs)  # one cvt per pair
            cute.copy(store_p, packed, cute.make_tensor(
                t_p_dst.iterator + slot * self.s_cols + i * P_STORE_COLUMNS, t_p_dst.layout))
        row_max = new_max
        cute.arch.fence_view_async_tmem_store()  # P in TMEM: the MMA reads it next
        tmem_fence_before_sync()
        p_ready.arrive(slot, None)
        return row_max, row_sum

    @cute.jit
    def correction(self, t_o: cute.Tensor, s_v: cute.Tensor, s_scale: cute.Tensor,
                   p_ready: pipeline.MbarrierArray,
                   o_done: pipeline.MbarrierArray, first_tile: Int32, n_tiles: Int32, num_keys: Int32,
                   scale_bar: Int32):
        """Correction warpgroup: per (key tile, Q tile) pair, O's row ``tidx % 128`` *= the softmax's factor once
        the previous PV is done, skipped by a warp none of whose rows moved (the factor is exactly 1: the softmax's
        threshold makes that the common case); with a 16-bit ring it also zeroes the key tile's V rows past the
        request's keys before the first PV reads them. Then hands the pair to the MMA (``p_ready``, with the
        softmax's P)."""
        # The first key tile has nothing to rescale (O is not written yet) and only the last can hold V rows past
        # the keys: both are peeled, so the loop between checks neither (one copy of the zero fill: the last).
        args = (t_o, s_v, s_scale, p_ready, o_done, first_tile, num_keys, scale_bar)
        if n_tiles > 1:
            self.correction_tile(Int32(0), False, False, *args)
        for j in cutlass.range(1, n_tiles - 1, unroll=1):
            self.correction_tile(j, True, False, *args)
        if n_tiles > 0:
            self.correction_tile(n_tiles - 1, n_tiles > 1, True, *args)

    @cute.jit
    def correction_tile(self, j: Int32, rescale, last: cutlass.Constexpr[bool], t_o: cute.Tensor, s_v: cute.Tensor,
                        s_scale: cute.Tensor, p_ready: pipeline.MbarrierArray,
                        o_done: pipeline.MbarrierArray, first_tile: Int32, num_keys: Int32, scale_bar: Int32):
        """Key tile ``j`` of the correction warpgroup's split, both Q tiles: ``rescale`` (a bool, or a traced one)
        false for the first (O not written yet), ``last`` for the last, which may hold V rows past the keys."""
        row = cute.arch.thread_idx()[0] % BM
        for t in cutlass.range_constexpr(self.q_tiles):
            slot = self.slot_use(j, t)[0]
            cute.arch.barrier(barrier_id=scale_bar + 4 * slot, number_of_threads=64)
            if cutlass.const_expr(t == 0 and not self.kv_fp8 and last):
                # (fp8: the converter writes those rows as zeros.) The stage's TMA has landed: the S of the same
                # tile, which the softmax read, came from it.
                tile_base = (first_tile + j) * self.bn
                if tile_base + self.bn > num_keys:
                    self.zero_stale_rows(s_v, j % self.stages, num_keys - tile_base)
                    # The zeroed rows are generic-proxy stores the MMA reads through the async proxy
                    # (fence.proxy.async, PTX ISA 9.7.13.4). Rows the TMA wrote need no fence: the MMA reads
                    # them through the same proxy, after the stage's full barrier.
                    cute.arch.fence_view_async_shared()
            if cutlass.const_expr(rescale is not False):
                corr = s_scale[row, slot]
                # The TMEM copies are warp-wide: a warp skips the rescale when none of its rows moved.
                if cute.arch.vote_any_sync(corr != 1.0) & rescale:
                    if cutlass.const_expr(self.q_tiles == 1):
                        # PV(j-1) follows QK(j) (``mma``): wait for it. With two Q tiles it precedes QK(j, t),
                        # whose commit (all of the MMA warp's earlier MMAs: PTX ISA 9.7.16.12.1) the softmax
                        # waited for before handing this factor over, so O is already stable (FA4's plan).
                        o_done.wait(*self.slot_use(j - 1, 0))
                    tmem_fence_after_sync()
                    rescale_o(self.o_tile(t_o, t), corr, self.v_dim)
                    cute.arch.fence_view_async_tmem_store()
                    tmem_fence_before_sync()  # the TMEM stores before the hand-off (none when skipped)
            p_ready.arrive(slot, None)

    @cute.jit
    def convert(self, kv_pipe: pipeline.PipelineTmaAsync, k_pipe: pipeline.PipelineAsyncUmma,
                v_pipe: pipeline.PipelineAsyncUmma, ring_k: cute.Tensor, ring_v: cute.Tensor, s_k: cute.Tensor,
                s_v: cute.Tensor, k_scales: Optional[cute.Tensor], v_scales: Optional[cute.Tensor],
                s_rows: Optional[cute.Tensor], lookup_table: cute.Tensor, first_tile: Int32, n_tiles: Int32, b: Int32,
                kv_head: Int32, num_keys: Int32, rows_per_page: Int32, oob_row: Int32):
        """Converter warpgroup (fp8): each ring stage -> the 16-bit K tile (once the previous QK read it) and V tile
        (once the previous PV read it); the stage is released when both are written. A thread keeps one row of
        the tile (BN = 128; two threads a row at BN = 64): with granule scales it looks that row's cache row up once
        per tile, from the tile's ``populate`` or, for gather4 pages, from the stage's row array the load warp
        wrote (read before the stage is released, so before the load warp rewrites it)."""
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        k_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        v_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        r = (cute.arch.thread_idx()[0] - 32 * CONVERT_WARPS[0]) // (CONVERT_THREADS // self.bn)
        rows = None
        if cutlass.const_expr(self.granularity is not None and not self.gather4):
            rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
        for j in cutlass.range(n_tiles, unroll=1):
            tile_base = (first_tile + j) * self.bn
            if cutlass.const_expr(rows is not None):
                self.k_op.populate(rows, lookup_table, b, tile_base, num_keys, rows_per_page, oob_row)
            kv_pipe.consumer_wait(read)
            row = Int32(0)  # (unused without granule scales)
            if cutlass.const_expr(self.granularity is not None):
                row = self.cache_row(rows, s_rows, read.index, r)
            # The states advance by their own names: the loop carries only the variables its body names, so a
            # state advanced through an alias would wait on the first phase's parity every tile.
            self.convert_tile(k_pipe, k_write, ring_k, s_k, k_scales, read.index, r, row, tile_base, num_keys,
                              kv_head, self.head_dim)
            k_write.advance()
            self.convert_tile(v_pipe, v_write, ring_v, s_v, v_scales, read.index, r, row, tile_base, num_keys,
                              kv_head, self.v_dim)
            v_write.advance()
            cute.arch.sync_warp()  # every lane's reads of the stage (and its row array) before its warp's one release
            kv_pipe.consumer_release(read)
            read.advance()
        k_pipe.producer_tail(k_write)  # the MMA's last releases landed: no commit arrives after the CTA exits
        v_pipe.producer_tail(v_write)

    @cute.jit
    def cache_row(self, rows: Optional[cute.Tensor], s_rows: Optional[cute.Tensor], stage: Int32, r: Int32) -> Int32:
        """Cache row of the tile's row ``r``: gather4's row array, or ``populate``'s page slot picked by a select
        over the slots (indexing ``rows`` by a runtime slot would put the array in local memory)."""
        row = Int32(0)
        if cutlass.const_expr(self.gather4):
            row = s_rows[r, stage]
        else:
            per_copy = self.k_op.rows_per_copy
            for p in cutlass.range_constexpr(self.k_op.copies_per_tile):
                if r // per_copy == p:
                    row = rows[p]
            row = row + r % per_copy
        return row

    @cute.jit
    def convert_tile(self, pipe: pipeline.PipelineAsyncUmma, state: pipeline.PipelineState, ring: cute.Tensor,
                     tile: cute.Tensor, scales: Optional[cute.Tensor], stage: Int32, r: Int32, row: Int32,
                     tile_base: Int32, num_keys: Int32, kv_head: Int32, width: cutlass.Constexpr[int]):
        """Ring ``stage`` -> the 16-bit ``tile`` (``width`` columns) once the MMA that read it last is done, then hand
        it over."""
        pipe.producer_acquire(state)
        self.dequantize(ring, tile, stage, scales, r, row, tile_base, num_keys, kv_head, width)
        cute.arch.fence_view_async_shared()  # the MMA reads the tile next
        pipe.producer_commit(state)

    @cute.jit
    def dequantize(self, ring: cute.Tensor, tile: cute.Tensor, stage: Int32, scales: Optional[cute.Tensor],
                   r: Int32, row: Int32, tile_base: Int32, num_keys: Int32, kv_head: Int32,
                   width: cutlass.Constexpr[int]):
        """Row ``r`` of ``ring[stage]`` (fp8, its first ``width`` columns) -> the 16-bit ``tile``, 8 values at a time
        (this thread's share of the row): ``x * scale`` of the value's granule (cache row ``row``; the offset in 64
        bits: rows x H x G can pass 2^31) or of the plane (``tensor_scales``), rounded once. A row past the
        request's keys is written as zeros."""
        per_row = CONVERT_THREADS // self.bn
        first = (cute.arch.thread_idx()[0] - 32 * CONVERT_WARPS[0]) % per_row
        scale_of = None
        if cutlass.const_expr(self.tensor_scales):
            plane_scale = Float32(scales[0])
            scale_of = lambda c: plane_scale  # noqa: E731
        elif cutlass.const_expr(scales is not None):
            scale_of = lambda c: granule_scale(scales, row, kv_head, c * VEC // self.granularity,  # noqa: E731
                                               self.e8m0_scales)
        dequantize_row(cute.local_tile(ring[r, None, stage], (width,), (0,)), tile[r, None, 0], first, per_row,
                       tile_base + r < num_keys, scale_of, self.dtype)

    @cute.jit
    def zero_stale_rows(self, s_v: cute.Tensor, stage: Int32, first_row: Int32):
        """Zero V rows ``[first_row, BN)`` of ``stage`` (the correction warpgroup): past the request's keys (P is 0
        there, but 0 * NaN is not)."""
        chunks = self.v_dim // VEC
        zeros = cute.make_rmem_tensor((VEC,), self.dtype)
        zeros.fill(0.0)
        for idx in cutlass.range(cute.arch.thread_idx()[0] % BM, self.bn * chunks, BM, unroll=1):
            if idx // chunks >= first_row:
                cute.autovec_copy(zeros, cute.local_tile(s_v[idx // chunks, None, stage], (VEC,), (idx % chunks,)))

    @cute.jit
    def epilogue(self, t_o: cute.Tensor, o_written: cutlass.Boolean, row_max: Float32, row_sum: Float32,
                 sinks: Optional[cute.Tensor], out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor,
                 lse: cute.Tensor, tma_o: Optional[cute.CopyAtom], g_out: Optional[cute.Tensor], s_o: cute.Tensor,
                 q_start: Int32, seq_len: Int32, m0: Int32, kv_head: Int32, split: Int32, num_splits: Int32):
        """Row ``tidx % 128`` of the Q tile from packed row ``m0`` (the correction warpgroup): ``O / l`` to ``out``
        (one split) or to this split's float32 partial with its base-2 lse. The sink joins split 0's denominator. A
        row with no visible key writes 0, and lse = -inf (the sink with one); O is not read when no PV MMA wrote it
        (``o_written`` false: a split without key tiles). ``out`` rows go through ``s_o`` (the Q tile's, free: its last PV completed after its last QK) and TMA stores when
        the group divides BM (``store_o``), else straight from the thread."""
        tidx = cute.arch.thread_idx()[0] % BM
        tok = (m0 + tidx) // self.group
        head = kv_head * self.group + (m0 + tidx) % self.group
        top, total, inv = row_normalizer(row_max, row_sum, sinks, head, split, self.sinks)
        chunk = self.o_chunk
        load, _, src, _, shape = o_copies(t_o, chunk)
        vals = cute.make_rmem_tensor(shape, Float32)
        res = cute.make_rmem_tensor(shape, self.dtype)
        for i in cutlass.range_constexpr(self.v_dim // chunk):
            if o_written:  # CTA-uniform (tcgen05.ld is .sync.aligned): a split without key tiles never wrote O
                cute.copy(load, cute.make_tensor(src.iterator + i * chunk, src.layout), vals)
                for e in cutlass.range_constexpr(0, cute.size(vals), 2):
                    vals[e], vals[e + 1] = cute.arch.mul_packed_f32x2((vals[e], vals[e + 1]), (inv, inv))
            if row_sum == 0.0:  # no key seen (or no tile): 0 rows, not 0 * inf
                vals.fill(0.0)
            if num_splits == 1:
                res.store(vals.load().to(self.dtype))
                if cutlass.const_expr(self.tma_store):  # every row: the TMA drops those past the request
                    cute.autovec_copy(res, cute.local_tile(s_o[tidx, None], (chunk,), (i,)))
                elif tok < seq_len:
                    cute.autovec_copy(res, cute.local_tile(out[q_start + tok, head, None], (chunk,), (i,)))
            elif tok < seq_len:
                cute.autovec_copy(vals, cute.local_tile(o_part[split, q_start + tok, head, None], (chunk,), (i,)))
        # the columns may be deallocated only once the loads are retired (PTX ISA 9.7.16.6.4.4: tcgen05.ld ->
        # wait::ld -> fence -> sync -> dealloc); reading their registers does not retire them
        cute.arch.fence_view_async_tmem_load()
        if cutlass.const_expr(self.tma_store):
            if num_splits == 1:
                self.store_o(tma_o, g_out, s_o, q_start, seq_len, m0, kv_head)
        if tok < seq_len:
            write_lse(lse, lse_part, q_start, tok, head, split, num_splits, top, total, self.return_lse)

    @cute.jit
    def store_o(self, tma_o: cute.CopyAtom, g_out: cute.Tensor, s_o: cute.Tensor, q_start: Int32, seq_len: Int32,
                m0: Int32, kv_head: Int32):
        """The staged O tile to ``out``: one thread issues one TMA store per swizzle row (``o_box_width`` columns),
        box (group heads, BM / group tokens), over the request's ragged window (rows past it are dropped), and waits
        until they have read shared memory, so the tile outlives them (the CTA's last barrier follows)."""
        cute.arch.fence_view_async_shared()  # this thread's row (generic stores) before the TMA reads it
        pipeline.NamedBarrier(barrier_id=EPILOGUE_BARRIER_ID, num_threads=BM).arrive_and_wait()
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == self.correction_warp:
            window = tma_tiles.packed_ragged_window(g_out, q_start, seq_len)[None, None, None, kv_head]
            width, group = self.o_box_width, self.group
            with cute.arch.elect_one():  # one thread issues, commits and waits for its bulk group
                for c in cutlass.range_constexpr(self.v_dim // width):
                    src = tma_tiles.packed_box(cute.local_tile(s_o, (BM, width), (0, c)), group)
                    dst = cute.local_tile(window, (group, BM // group, width), (0, m0 // BM, c))
                    t_s, t_g = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(src, 0, 3),
                                                     cute.group_modes(dst, 0, 3))
                    cute.copy(tma_o, t_s, t_g)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def load_q(self, s_q: cute.Tensor, q: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, kv_head: Int32):
        """Packed rows ``m0 + r`` of ``q`` into the swizzled Q tiles (row r in tile ``r // 128``), 16 bytes at a time
        (all warps); rows past the request are 0. Made visible to the MMA (async proxy) before the CTA's first
        barrier."""
        d, group = self.head_dim, self.group
        chunks = d // VEC
        tidx, _, _ = cute.arch.thread_idx()
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for idx in cutlass.range(tidx, self.plan.rows * chunks, self.threads, unroll=1):
            r = idx // chunks
            copy_q_chunk(q, s_q[None, None, r // BM], vals, r % BM, idx % chunks, m0 + r // BM * BM, q_start,
                         seq_len, kv_head, group)
        cute.arch.fence_view_async_shared()
