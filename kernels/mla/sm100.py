"""``MlaDecodeSm100`` (Blackwell): MLA decode over a paged latent cache with ``tcgen05.mma`` and tensor memory,
dense (every key of the request, causal for multi-token steps) or sparse (DeepSeek-V3.2: each query token's top-k
encoded rows).

An MLA cache has one latent head of ``latent_dim`` = kv_lora_rank + rope_dim (576) values a row; every query head
attends to it, so the heads are packed in M: packed row ``i * Hq + h`` is token ``i``, head ``h``. Keys are the
latent rows, values their first ``v_dim`` (512) columns: ``S = Q K^T`` over 576 columns, ``O = P V`` with V the same
key tile in shared memory read MN-major. A cluster of two CTAs serves a row block, one value half each (tensor
memory cannot hold a 128 x 512 float32 O beside S); each holds a 320-column slice of Q and of the key rows, computes
a partial S over half the latent columns, and the pair sums the partials through distributed shared memory, so no QK
is computed twice (``sm100_config`` gives the columns). A CTA is (row block, value half x split, request) dense, or
(row block of one token's heads, value half x split, token) sparse. Warp roles follow the MHA kernel
(``attention/sm100.py``):

* warps 0-3, softmax: thread ``t`` owns packed row ``t`` (TMEM lane ``t``): reads its row of the partial S
  (``tcgen05.ld``), sends it to the peer CTA and adds the peer's (``exchange``), masks, optionally soft-caps, runs
  the online softmax in base 2, writes P (16-bit) to shared memory and rescales its row of the O half in TMEM before
  the MMA warp adds ``P V``; at the end divides by the row sum (with the sink's term) and writes the output half, or
  a split's partial.
* warp 4, MMA: the partial ``S[j % 2] = Q K_j^T`` (18 MMAs of K=16), then ``O += P_{j-1} V_{j-1}`` (the value half
  of the same stage), so the QK of one tile overlaps the softmax of the previous one. Owns the TMEM allocation.
* warp 5, load: each lane resolves key rows of the tile into the stage's row array, then gather4 TMAs bring 4 rows x
  64 columns of the CTA's slice each straight into the MMA's 128-byte-swizzled tile (the swizzle on the smem pointer,
  so each instruction lands 512 bytes past the previous one). Dense rows: ``lookup_table[b, k // P] *
  rows_per_page + k % P`` for keys of the request. Sparse rows: MAX's ``get_tma_row`` of the encoded entry ``enc =
  page * P + offset``, ``(enc // P) * rows_per_page + enc % P``. A key past the request (past ``topk_lengths``),
  ``-1`` or any entry outside ``[0, N * P)`` gets the row one past the row view, which TMA zero-fills: nothing
  outside the cache is read. The softmax masks those keys: each softmax warp resolves the tile's 32 keys again, a
  lane each, and one ballot gives every thread the tile's valid keys (no hand-off of the load warp's row array
  across proxies).

Rope-aware FP8 caches (MAX's rows ``[padded_depth e4m3 | rope_dim bf16]``, one float32 scale per token; why this
way and the shared-memory budget: ``sm100_config``) take 16-key tiles and 320 threads:

* warp 5 gathers the content boxes of a tile the CTA's slice needs (128 e4m3 bytes each, box ``c`` from byte
  ``128 c`` of the rows: ``sm100_config.content_boxes``) into a landing stage in the 128-byte swizzle and (CTA 1)
  its rope (as MAX's ``create_rope_gather4_tma_tile``: the bf16 view of the same rows from byte ``padded_depth``)
  into a row-major bf16 landing stage, then each lane loads its row's scale
  (``ld.global``, indexed by the row; 0 for no row, whose bytes TMA zero-fills) into the stage's scale array and
  arrives on the stage's full barrier (the expect-tx arrival and the 32 lanes').
* warps 6-9, converter: a tile row per 8 threads writes the slice of ``content * scale`` (float32, rounded once to
  q's dtype) and the rope into one of two 16-bit ``16 x SLICE`` key tiles, which the MMAs read as the 16-bit path
  reads its landing stages (K for QK, its first ``O_COLS`` columns as V); a landing stage is free once converted, a
  key tile once the P V MMA that read it completed.

TMEM accesses handed from one thread to another by an mbarrier or a barrier are fenced on both sides
(``tcgen05.fence::before_thread_sync`` before the arrival, ``::after_thread_sync`` after the wait): the allocation,
S (QK commit -> softmax loads; softmax loads -> the next QK into the buffer), P/O (softmax rescale -> PV MMA), O
(PV commit -> rescale / epilogue loads) and the dealloc.

The pair's exchange barriers count one local arrival (thread 0's expect-tx of the peer's bytes) and the peer's
``st.async`` bytes; a cluster barrier follows their init (before either CTA stores into the other) and precedes the
exit (no store of a CTA's own in flight as it leaves).

Split-KV, sinks, soft-cap and the log-sum-exp follow the MHA kernels: a split writes its half of ``O/l`` and (value
half 0) ``lse = m + log2 l`` for ``AttentionCombine``; the sink joins the denominator of split 0 only.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator, TmemAllocator

from cute_kv.kernels.attention.block_info import copy_q_chunk, split_tiles
from cute_kv.kernels.attention.config import VEC
from cute_kv.kernels.attention.sm100 import PagedAttentionSm100, tmem_fence_after_sync, tmem_fence_before_sync
from cute_kv.kernels.attention.sm100_common import (NEG_INF, O_CHUNK, dequantize_row, exp_scores, o_copies,
                                                      rescale_o, row_reduce, row_normalizer, scale_scores,
                                                      softmax_pipelines, write_lse)
from cute_kv.kernels.mla.sm100_config import (BM, CONTENT_BOX, EXCHANGE, FP8, FP8_MMA_STAGES, GATHER_WIDTH, O_COLS,
                                              QK_COLS, ROW_LANES, SLICE, TMEM_COLUMNS, V_SPLIT, content_boxes,
                                              exchange_rotation, exchange_slot, live_warps, qk_start, slice_start,
                                              supported, tiling)
from cute_kv.kernels.paged import populate, tma_tiles
from cute_kv.kernels.paged.ragged_rows import request_rows
from cute_kv.kernels.quant import granule_scale

SOFTMAX_THREADS = 128  # warps 0-3
MMA_WARP = 4
LOAD_WARP = 5
THREADS = 32 * (LOAD_WARP + 1)
# Rope-aware fp8 caches add warps 6-9, the converter warpgroup (no setmaxnreg: 320 threads leave 200 registers each).
CONVERT_WARPS = (6, 7, 8, 9)
CONVERT_THREADS = 32 * len(CONVERT_WARPS)
FP8_THREADS = 32 * (CONVERT_WARPS[-1] + 1)
TMEM_BARRIER_ID = 1  # named barrier of all threads: barriers initialized, Q staged, TMEM address published
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
SWIZZLE = 128  # bytes: the K-major swizzle of Q and the key tiles (and of the fp8 content landing stages)
CHUNK = 4  # float32 values per st.async of the partial-S exchange (16 bytes)


class MlaDecodeSm100:
    """Compile-time key: dtype (of Q, O, the cache and the MMAs), query heads, ``latent_dim``, ``v_dim``,
    ``page_size``, ``sparse``, the flags ``softcap``, ``sinks``, ``return_lse``, (sparse) whether
    ``topk_lengths`` is given, and ``rope_dim`` for a rope-aware FP8 cache (rows ``[latent_dim - rope_dim e4m3 |
    rope_dim bf16]`` with one float32 scale per token; None: a cache of ``dtype``)."""

    def __init__(self, dtype_name: str, num_q_heads: int, latent_dim: int, v_dim: int, page_size: int,
                 sparse: bool = False, softcap: bool = False, sinks: bool = False, return_lse: bool = False,
                 topk_lengths: bool = False, rope_dim: Optional[int] = None):
        problem = supported(dtype_name, dtype_name if rope_dim is None else FP8, latent_dim, v_dim, page_size,
                            rope_dim)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[dtype_name]
        self.num_q_heads, self.latent_dim, self.v_dim, self.page_size = num_q_heads, latent_dim, v_dim, page_size
        self.group = num_q_heads  # packed rows per token: one latent KV head
        self.sparse, self.softcap, self.sinks, self.return_lse = sparse, softcap, sinks, return_lse
        self.has_topk_lengths = sparse and topk_lengths
        self.rope_dim, self.fp8 = rope_dim, rope_dim is not None
        self.content_dim = latent_dim - rope_dim if self.fp8 else latent_dim  # padded_depth: e4m3 bytes a row
        self.plan = tiling(latent_dim, rope_dim)
        self.bn, self.stages = self.plan.bn, self.plan.stages
        self.mma_stages = FP8_MMA_STAGES if self.fp8 else self.stages  # key tiles the MMAs read
        self.threads = FP8_THREADS if self.fp8 else THREADS

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        dt, d, dv, hq = self.dtype, self.latent_dim, self.v_dim, self.num_q_heads
        t = cute.sym_int32()
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- 16-byte row accesses
        q = make_fake_tensor(dt, (t, hq, d), stride=(row(), d, 1), assumed_align=16)
        out = make_fake_tensor(dt, (t, hq, dv), stride=(row(), dv, 1), assumed_align=16)
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, dv),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        lse = make_fake_compact_tensor(Float32, (cute.sym_int32(), hq), stride_order=(1, 0), assumed_align=4)
        p = self.page_size
        w = self.content_dim + 2 * self.rope_dim if self.fp8 else d  # cache elements a row (fp8: bytes)
        blocks = make_fake_tensor(cutlass.Float8E4M3FN if self.fp8 else dt, (
            cute.sym_int32(), 1, cute.sym_int32(), p, 1, w), stride=(
            cute.sym_int64(divisibility=p * w), cute.sym_int64(divisibility=p * w), p * w, w, w, 1),
            assumed_align=16)
        scales = None
        if self.fp8:
            scales = make_fake_tensor(Float32, (cute.sym_int32(), 1, cute.sym_int32(), p, 1, 1), stride=(
                cute.sym_int64(divisibility=p), cute.sym_int64(divisibility=p), p, 1, 1, 1), assumed_align=4)
        b = cute.sym_int32()
        offsets = lengths = lut = indices = topk_lengths = None
        if self.sparse:
            indices = make_fake_tensor(Int32, (t, cute.sym_int32()), stride=(cute.sym_int64(), 1), assumed_align=4)
            if self.has_topk_lengths:
                topk_lengths = make_fake_compact_tensor(Int32, (t,), assumed_align=4)
        else:
            lut = make_fake_tensor(Uint32, (b, cute.sym_int32()), stride=(cute.sym_int64(), 1), assumed_align=4)
            offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
            lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        sinks = make_fake_compact_tensor(Float32, (hq,), assumed_align=4) if self.sinks else None
        return (q, out, o_part, lse_part, lse, blocks, scales, offsets, lengths, lut, indices, topk_lengths, sinks,
                Int32(0), Int32(1), Int32(1), Int32(1), Int32(1), Float32(1.0), Float32(1.0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, q: cute.Tensor, out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor,
                 lse: cute.Tensor, blocks: cute.Tensor, scales: Optional[cute.Tensor],
                 input_row_offsets: Optional[cute.Tensor], cache_lengths: Optional[cute.Tensor],
                 lookup_table: Optional[cute.Tensor], indices: Optional[cute.Tensor],
                 topk_lengths: Optional[cute.Tensor], sinks: Optional[cute.Tensor], layer_idx: Int32,
                 m_blocks: Int32, num_splits: Int32, batch: Int32, causal: Int32, score_scale: Float32,
                 cap_log2: Float32, stream: cuda.CUstream):
        """Dense: ``input_row_offsets``, ``cache_lengths``, ``lookup_table`` name each request's keys; ``batch``
        requests. Sparse: ``indices [T, topk]`` (and ``topk_lengths [T]``) name each token's keys; ``batch`` = T.
        ``m_blocks``: row blocks per request (dense ``ceil(max_seq_len * Hq / BM)``, sparse ``ceil(Hq / BM)``).
        Logits in base 2 are ``score_scale * q.k``, or with ``softcap`` ``cap_log2 * tanh(score_scale * q.k)``.
        Rope-aware fp8: ``blocks`` e4m3 ``[N, 1, L, P, 1, padded_depth + 2 rope_dim]``, ``scales`` float32
        ``[N, 1, L, P, 1, 1]``; keys are ``concat(content * scale, rope)``."""
        dt, bn = self.dtype, self.bn
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                          tcgen05.CtaGroup.ONE, (BM, bn))
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                          tcgen05.CtaGroup.ONE, (BM, O_COLS))
        rows, rope_rows, scale_rows = self.row_views(blocks, scales, layer_idx)
        # The index tensor only shapes the descriptor; the kernel points it at its shared-memory rows.
        index_src = indices.iterator if cutlass.const_expr(self.sparse) else cute.recast_ptr(lookup_table.iterator,
                                                                                             dtype=Int32)
        index = cute.make_tensor(index_src, cute.make_layout((bn,)))
        tma_r = g_r = None
        if cutlass.const_expr(self.fp8):
            # content: boxes from byte 0 of the fp8 rows; rope: the bf16 view from byte padded_depth of the same
            # rows, one box of rope_dim (MAX's create_rope_gather4_tma_tile, over the view ``row_views`` gives)
            tma_k, g_k, _ = tma_tiles.create_gather4_tma_tile(PagedAttentionSm100.rows_2d(rows), index, bn,
                                                              CONTENT_BOX, SWIZZLE)
            tma_r, g_r, _ = tma_tiles.create_gather4_tma_tile(PagedAttentionSm100.rows_2d(rope_rows), index, bn,
                                                              self.rope_dim)
        else:
            tma_k, g_k, _ = tma_tiles.create_gather4_tma_tile(PagedAttentionSm100.rows_2d(rows), index, bn,
                                                              GATHER_WIDTH, SWIZZLE)
        rows_per_page = blocks.shape[1] * blocks.shape[2] * self.page_size  # KVD*L*P: a page's pitch in rows
        num_slots = blocks.shape[0] * self.page_size  # encoded sparse entries in [0, N*P) name a row
        grid = (m_blocks, V_SPLIT * num_splits, batch)
        self.kernel(tiled_mma_qk, tiled_mma_pv, tma_k, g_k, tma_r, g_r, scale_rows, q, out, o_part, lse_part, lse,
                    input_row_offsets, cache_lengths, lookup_table, indices, topk_lengths, sinks, rows_per_page,
                    rows.shape[0], num_slots, num_splits, causal, score_scale, cap_log2).launch(
            grid=grid, block=(self.threads, 1, 1), cluster=(1, V_SPLIT, 1), stream=stream, min_blocks_per_mp=1)

    def row_views(self, blocks: cute.Tensor, scales: Optional[cute.Tensor], layer_idx):
        """The layer's row views the kernel loads from: rows ``[num_kv_rows, 1, row width]`` of the cache's type
        (gather4 reads content boxes from byte 0), and for a rope-aware cache the bf16 rope view of the same rows
        (``[num_kv_rows, 1, rope_dim]`` from byte ``padded_depth``, ``tma_tiles.rope_row_view``) and
        the scales ``[num_kv_rows, 1, 1]`` (the scale index is the row); None for 16-bit caches."""
        rows = tma_tiles.kv_row_view(blocks, 0, layer_idx)
        if cutlass.const_expr(not self.fp8):
            return rows, None, None
        return (rows, tma_tiles.rope_row_view(blocks, 0, layer_idx, self.content_dim, self.rope_dim),
                tma_tiles.kv_row_view(scales, 0, layer_idx))

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tma_k: cute.CopyAtom,
               g_k: cute.Tensor, tma_r: Optional[cute.CopyAtom], g_r: Optional[cute.Tensor],
               scale_rows: Optional[cute.Tensor], q: cute.Tensor, out: cute.Tensor, o_part: cute.Tensor,
               lse_part: cute.Tensor, lse: cute.Tensor, input_row_offsets: Optional[cute.Tensor],
               cache_lengths: Optional[cute.Tensor], lookup_table: Optional[cute.Tensor],
               indices: Optional[cute.Tensor], topk_lengths: Optional[cute.Tensor], sinks: Optional[cute.Tensor],
               rows_per_page: Int32, oob_row: Int32, num_slots: Int32, num_splits: Int32, causal: Int32,
               score_scale: Float32, cap_log2: Float32):
        dt, group, bn, stages = self.dtype, self.group, self.bn, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        m_block, half_split, b = cute.arch.block_idx()
        v_half = half_split % V_SPLIT  # the CTA's rank in its cluster (1, V_SPLIT, 1): the pair has one split
        split = half_split // V_SPLIT
        # Dense: request b's new tokens, after cache_len keys. Sparse: token b alone, its top-k entries the keys.
        q_start, seq_len, cache_len, num_keys = b, Int32(1), Int32(0), Int32(0)
        if cutlass.const_expr(self.sparse):
            num_keys = Int32(indices.shape[1])
            if cutlass.const_expr(self.has_topk_lengths):
                num_keys = cutlass.max(cutlass.min(Int32(topk_lengths[b]), num_keys), 0)
        else:
            q_start, seq_len = request_rows(input_row_offsets, b, q.shape[0])  # (unchecked offsets stay inside q)
            cache_len = Int32(cache_lengths[b])
            num_keys = cache_len + seq_len
        m0 = m_block * BM
        if m0 < seq_len * group:  # the CTA has query rows (uniform over the cluster: the pair leaves otherwise)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if cutlass.const_expr(self.sparse):
                causal = Int32(0)  # the indices decide which keys a token sees
            first_tile, n_tiles = split_tiles(m0, seq_len, cache_len, num_keys, causal, Int32(0), split,
                                              num_splits, BM, bn, group)

            smem = SmemAllocator()
            kv_bars = smem.allocate_array(cutlass.Int64, 2 * stages)
            s_bars = smem.allocate_array(cutlass.Int64, 4)
            p_bars = smem.allocate_array(cutlass.Int64, 2)
            x_bars = smem.allocate_array(cutlass.Int64, EXCHANGE)
            s_rows = smem.allocate_tensor(Int32, cute.make_layout((ROW_LANES, stages)), byte_alignment=16)
            mma_bars = s_scales = ring_r = None
            if cutlass.const_expr(self.fp8):
                mma_bars = smem.allocate_array(cutlass.Int64, 2 * FP8_MMA_STAGES)
                s_scales = smem.allocate_tensor(Float32, cute.make_layout((ROW_LANES, stages)), byte_alignment=16)
            sq_layout = tma_tiles.smem_tile_layout(dt, BM, SLICE)
            sp_layout = tma_tiles.smem_tile_layout(dt, BM, bn, 2 * bn)  # a row of P: bn 16-bit values
            s_q = smem.allocate_tensor(dt, sq_layout.outer, byte_alignment=1024, swizzle=sq_layout.inner)
            s_p = smem.allocate_tensor(dt, sp_layout.outer, byte_alignment=1024, swizzle=sp_layout.inner)
            # The peer's partial S, a row per softmax thread (its 16-byte chunks rotated by the row: conflict-free
            # stores and loads); written by the peer's st.async, which completes x_bars[buffer].
            s_x = smem.allocate_tensor(Float32, cute.make_layout((BM, bn, EXCHANGE), stride=(bn, 1, BM * bn)),
                                       byte_alignment=16)
            kv_layout = tma_tiles.smem_tile_layout(dt, bn, SLICE, SWIZZLE, stages=self.mma_stages)
            if cutlass.const_expr(self.fp8):
                # Landing stages (content e4m3 in the MMA's swizzle, rope bf16 row-major as its gather4 writes
                # it); the converter turns each into one of two 16-bit key tiles ``s_kv``.
                ring_layout = tma_tiles.smem_tile_layout(cutlass.Float8E4M3FN, bn, self.content_dim, SWIZZLE,
                                                         stages=stages)
                ring = smem.allocate_tensor(cutlass.Float8E4M3FN, ring_layout.outer, byte_alignment=1024,
                                            swizzle=ring_layout.inner)
                r = self.rope_dim
                ring_r = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((bn, r, stages),
                                                                                 stride=(r, 1, bn * r)),
                                              byte_alignment=1024)
                s_kv = smem.allocate_tensor(dt, kv_layout.outer, byte_alignment=1024, swizzle=kv_layout.inner)
            else:
                ring = smem.allocate_tensor(dt, kv_layout.outer, byte_alignment=1024, swizzle=kv_layout.inner)
                s_kv = ring  # what the MMAs read: the landing stages themselves
            # V as the PV MMA's B operand: this CTA's value half, the first O_COLS columns of its key slice, as
            # (O_COLS, bn) with the value dim contiguous (MN-major), the same bytes.
            s_vt = cute.composition(s_kv, cute.make_layout((O_COLS, bn, self.mma_stages), stride=(bn, 1, bn * SLICE)))

            one_cta = cute.make_layout((1, 1, 1, 1))
            thread = pipeline.Agent.Thread
            if cutlass.const_expr(self.fp8):  # landing ring -> converter warpgroup -> 16-bit key tiles -> MMA
                # The full barrier also takes each load lane's arrival after its scale store (33 arrivals); a
                # stage is released by one lane of each converter warp (PipelineTmaAsync's signalling lane).
                kv_pipe = pipeline.PipelineTmaAsync.create(
                    barrier_storage=kv_bars, num_stages=stages,
                    producer_group=pipeline.CooperativeGroup(thread, 1 + ROW_LANES),
                    consumer_group=pipeline.CooperativeGroup(thread, CONVERT_THREADS // 32),
                    tx_count=self.plan.tx_bytes, cta_layout_vmnk=one_cta, defer_sync=True)
                mma_pipe = pipeline.PipelineAsyncUmma.create(
                    barrier_storage=mma_bars, num_stages=FP8_MMA_STAGES,
                    producer_group=pipeline.CooperativeGroup(thread, CONVERT_THREADS),
                    consumer_group=pipeline.CooperativeGroup(thread), cta_layout_vmnk=one_cta, defer_sync=True)
            else:
                kv_pipe = pipeline.PipelineTmaUmma.create(
                    barrier_storage=kv_bars, num_stages=stages, producer_group=pipeline.CooperativeGroup(thread),
                    consumer_group=pipeline.CooperativeGroup(thread), tx_count=self.plan.tx_bytes,
                    cta_layout_vmnk=one_cta, defer_sync=True)
                mma_pipe = kv_pipe
            s_pipe, p_pipe = softmax_pipelines(s_bars, p_bars, one_cta, SOFTMAX_THREADS)
            if tidx == 0:
                for i in cutlass.range_constexpr(EXCHANGE):
                    cute.arch.mbarrier_init(x_bars + i, 1)  # the local arrive.expect_tx; the peer's bytes

            tmem = TmemAllocator(barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID,
                                                                            num_threads=self.threads),
                                 allocator_warp_id=MMA_WARP)
            tmem.allocate(TMEM_COLUMNS)
            self.load_q(s_q, q, q_start, seq_len, m0, v_half)
            cute.arch.mbarrier_init_fence()
            # Both CTAs' barriers initialized before either stores into the other's exchange buffer.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
            tmem_fence_before_sync()  # the allocation before the barrier that publishes it
            tmem.wait_for_alloc()  # all threads: barriers initialized, Q staged, TMEM allocated
            tmem_fence_after_sync()
            tmem.relinquish_alloc_permit()
            tmem_ptr = tmem.retrieve_ptr(Float32)

            thr_qk = tiled_mma_qk.get_slice(0)
            thr_pv = tiled_mma_pv.get_slice(0)
            # TMEM: S tiles at columns [0, bn) and [bn, 2 bn), the O half at [2 bn, 2 bn + O_COLS).
            t_s = thr_qk.make_fragment_C(cute.append(thr_qk.partition_shape_C((BM, bn)), 2))
            t_s = cute.make_tensor(tmem_ptr, t_s.layout)
            t_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BM, O_COLS)))
            t_o = cute.make_tensor(tmem_ptr + 2 * bn, t_o.layout)

            if warp_idx == LOAD_WARP:
                cpasync.prefetch_descriptor(tma_k)
                if cutlass.const_expr(self.fp8):
                    cpasync.prefetch_descriptor(tma_r)
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
                for _ in cutlass.range(n_tiles, unroll=1):
                    self.gather_tile(kv_pipe, prod, first_tile + prod.count, tma_k, g_k, ring, tma_r, g_r, ring_r,
                                     s_rows, s_scales, scale_rows, lookup_table, indices, b, num_keys, rows_per_page,
                                     oob_row, num_slots, v_half)
                    prod.advance()
                kv_pipe.producer_tail(prod)  # every stage released: no MMA commit lands after the CTA exits
            if warp_idx == MMA_WARP:
                self.mma(tiled_mma_qk, tiled_mma_pv, thr_qk, thr_pv, s_q, s_kv, s_p, s_vt, t_s, t_o, mma_pipe,
                         s_pipe, p_pipe, n_tiles, v_half)
            if cutlass.const_expr(self.fp8):
                if warp_idx >= CONVERT_WARPS[0]:
                    self.convert(kv_pipe, mma_pipe, ring, ring_r, s_kv, s_scales, n_tiles, v_half)
            if warp_idx < SOFTMAX_THREADS // 32:
                row_max, row_sum = self.softmax(t_s, t_o, s_p, s_x, x_bars, s_pipe, p_pipe, indices, b, first_tile,
                                                n_tiles, m0, seq_len, cache_len, num_keys, causal, rows_per_page,
                                                oob_row, num_slots, score_scale, cap_log2, v_half)
                self.epilogue(t_o, n_tiles > 0, row_max, row_sum, sinks, out, o_part, lse_part, lse, q_start,
                              seq_len, m0, v_half, split, num_splits)
            tmem_fence_before_sync()  # every thread's TMEM accesses (waited on) before the barrier...
            cute.arch.sync_threads()
            tmem_fence_after_sync()  # ... and the dealloc after it
            tmem.free(tmem_ptr)
            # No CTA of the pair leaves while a store of its own into the peer's buffer may be in flight.
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

    @cute.jit
    def key_row(self, lookup_table: Optional[cute.Tensor], indices: Optional[cute.Tensor], b: Int32, key: Int32,
                num_keys: Int32, rows_per_page: Int32, oob_row: Int32, num_slots: Int32) -> Int32:
        """Row of the layer's row view holding key ``key`` of request (dense) or token (sparse) ``b``; ``oob_row``
        (zero-filled by TMA) past the keys, for dense keys whose page column lies past the lookup table's row
        (unchecked lengths) and for sparse entries outside ``[0, N * P)`` (masked by the softmax)."""
        row = oob_row
        if cutlass.const_expr(self.sparse):
            if key < num_keys:
                enc = Int32(indices[b, key])
                if enc >= 0:
                    if enc < num_slots:
                        row = (enc // self.page_size) * rows_per_page + enc % self.page_size
        else:
            row = populate.key_row(lookup_table, b, key, num_keys, rows_per_page, self.page_size, oob_row)
        return row

    @cute.jit
    def gather_tile(self, pipe, prod: pipeline.PipelineState, tile: Int32, tma_k: cute.CopyAtom, g_k: cute.Tensor,
                    ring: cute.Tensor, tma_r: Optional[cute.CopyAtom], g_r: Optional[cute.Tensor],
                    ring_r: Optional[cute.Tensor], s_rows: cute.Tensor, s_scales: Optional[cute.Tensor],
                    scale_rows: Optional[cute.Tensor], lookup_table: Optional[cute.Tensor],
                    indices: Optional[cute.Tensor], b: Int32, num_keys: Int32, rows_per_page: Int32, oob_row: Int32,
                    num_slots: Int32, rank: Int32):
        """Load warp: key tile ``tile`` into stage ``prod.index``: a lane per key row into the stage's row array,
        then gather4, 4 rows x one 128-byte swizzle row per instruction: the ``SLICE / 64`` column blocks of CTA
        ``rank``'s slice of a 16-bit cache; of a rope-aware fp8 cache the e4m3 blocks of its slice
        (``content_boxes``) and (rank 1) the bf16 rope (one ``rope_dim``-wide box from byte ``padded_depth``), then
        each lane's row scale (``ld.global``; 0 for no row) into the stage's scale array, which every lane's arrival
        on the full barrier publishes."""
        bn = self.bn
        lane = cute.arch.lane_idx()
        pipe.producer_acquire(prod)
        cute.arch.sync_warp()  # the stage's previous gathers were issued before any lane rewrites its rows
        row = self.key_row(lookup_table, indices, b, tile * bn + lane, num_keys, rows_per_page, oob_row, num_slots)
        s_rows[lane, prod.index] = row
        cute.arch.sync_warp()
        bar = pipe.producer_get_barrier(prod)
        rows = s_rows[None, prod.index].iterator
        if cutlass.const_expr(self.fp8):
            for r in cutlass.range_constexpr(V_SPLIT):
                if rank == r:
                    boxes = content_boxes(r, self.content_dim)
                    self.gather(tma_k, g_k, ring[None, None, prod.index], rows, CONTENT_BOX, boxes, bar)
                    if cutlass.const_expr(r == V_SPLIT - 1):  # the rope columns end the last slice
                        self.gather(tma_r, g_r, ring_r[None, None, prod.index], rows, self.rope_dim, range(1), bar)
            scale = Float32(0.0)
            if lane < bn:
                scale = self.row_scale(scale_rows, row, oob_row)
            s_scales[lane, prod.index] = scale
            cute.arch.mbarrier_arrive(bar)
        else:
            self.gather(tma_k, cute.domain_offset((0, slice_start(rank)), g_k), ring[None, None, prod.index], rows,
                        GATHER_WIDTH, range(SLICE // GATHER_WIDTH), bar)

    @cute.jit
    def row_scale(self, scale_rows: cute.Tensor, row: Int32, oob_row: Int32) -> Float32:
        """The per-token scale of key row ``row``; 0, unread, for a row outside the row view: ``oob_row`` (no key)
        and, under unchecked metadata, a dense key's lookup entry that is not a page (the sentinel ``N``, entries
        read as negative rows), whose bytes TMA zero-fills."""
        return granule_scale(scale_rows, row, Int32(0), Int32(0), False)

    @cute.jit
    def gather(self, atom: cute.CopyAtom, g_rows: cute.Tensor, dst: cute.Tensor, rows: cute.Pointer,
               width: cutlass.Constexpr[int], blocks: cutlass.Constexpr, bar):
        """Column blocks ``blocks`` (``width`` columns each) of the stage's ``bn`` rows (``rows``: their indices in
        shared memory) of ``g_rows`` into the same blocks of the tile ``dst``, one gather4 copy per block (``bn /
        4`` instructions each)."""
        bn = self.bn
        index = cute.zipped_divide(cute.make_tensor(rows, cute.make_layout((bn, width), stride=(1, 0))),
                                   (bn, width))
        for c in cutlass.range_constexpr(blocks.start, blocks.stop):
            src = cute.zipped_divide(cute.domain_offset((0, c * width), g_rows), (bn, width))
            t_s, t_g, t_i = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                  cute.group_modes(cute.local_tile(dst, (bn, width), (0, c)), 0, 2),
                                                  [src, index])
            cute.copy(atom, [t_g[None, (0, 0)], t_i[None, (0, 0)]], t_s, tma_bar_ptr=bar)

    @cute.jit
    def convert(self, kv_pipe: pipeline.PipelineTmaAsync, mma_pipe: pipeline.PipelineAsyncUmma, ring: cute.Tensor,
                ring_r: cute.Tensor, s_kv: cute.Tensor, s_scales: cute.Tensor, n_tiles: Int32, rank: Int32):
        """Converter warpgroup (rope-aware fp8): CTA ``rank``'s slice of each landing stage -> one of the two
        16-bit key tiles, once the P V MMA that read it last completed: ``content * scale`` (float32 product,
        rounded once to q's dtype) for the slice's content columns, the rope in q's dtype for its columns past
        ``padded_depth`` (bf16 q: copied unchanged; fp16 q: rounded to fp16, values beyond its range overflow). The
        slice goes in ``rope_dim``-wide pieces; a row of the tile is ``CONVERT_THREADS / bn`` threads' (8), each a
        strided eighth of a piece's 16-byte chunks; the stage is released once converted."""
        per_row = CONVERT_THREADS // self.bn
        width = self.rope_dim
        first = slice_start(rank) // width  # the slice's first piece of the row
        t = cute.arch.thread_idx()[0] - 32 * CONVERT_WARPS[0]
        r, part = t // per_row, t % per_row
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, FP8_MMA_STAGES)
        for _ in cutlass.range(n_tiles, unroll=1):
            kv_pipe.consumer_wait(read)
            mma_pipe.producer_acquire(write)
            scale = s_scales[r, read.index]
            for p in cutlass.range_constexpr(SLICE // width):
                dst = cute.local_tile(s_kv[r, None, write.index], (width,), (p,))
                if first + p < self.content_dim // width:
                    dequantize_row(cute.local_tile(ring[r, None, read.index], (width,), (first + p,)), dst, part,
                                   per_row, True, lambda c: scale, self.dtype)
                else:
                    dequantize_row(ring_r[r, None, read.index], dst, part, per_row, True, None, self.dtype)
            cute.arch.fence_view_async_shared()  # the MMAs read the tile next
            mma_pipe.producer_commit(write)
            write.advance()
            cute.arch.sync_warp()  # every lane's reads of the stage before its warp's one release
            kv_pipe.consumer_release(read)
            read.advance()
        mma_pipe.producer_tail(write)  # the MMA's last releases landed: no commit arrives after the CTA exits

    @cute.jit
    def mma(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, thr_qk: cute.ThrMma,
            thr_pv: cute.ThrMma, s_q: cute.Tensor, s_kv: cute.Tensor, s_p: cute.Tensor, s_vt: cute.Tensor,
            t_s: cute.Tensor, t_o: cute.Tensor, kv_pipe, s_pipe: pipeline.PipelineUmmaAsync,
            p_pipe: pipeline.PipelineAsyncUmma, n_tiles: Int32, rank: Int32):
        """MMA warp: the partial ``S = Q K_j^T`` over CTA ``rank``'s ``QK_COLS`` columns for tile j (its slice's
        k-blocks from ``qk_start(rank) / 16``), then ``O += P V`` of tile j-1 (V: the CTA's value half of the
        same key tile, released by the commit of that PV MMA). ``kv_pipe``: the landing ring (16-bit caches) or the
        converter's two tiles (fp8)."""
        t_rq = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(s_q))
        t_rk = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(s_kv))
        t_rp = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(s_p))
        t_rv = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(s_vt))
        k0 = qk_start(rank) // 16
        kv_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.mma_stages)
        kv_done = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.mma_stages)
        s_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        p_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        for j in cutlass.range(n_tiles + 1, unroll=1):
            if j < n_tiles:
                kv_pipe.consumer_wait(kv_read)
                s_pipe.producer_acquire(s_write)
                tmem_fence_after_sync()  # the softmax's loads of this S buffer before the MMA overwrites it
                acc_s = t_s[None, None, None, s_write.index]
                for kb in cutlass.range_constexpr(QK_COLS // 16):
                    tiled_mma_qk.set(tcgen05.Field.ACCUMULATE, kb != 0)
                    k = k0 + kb
                    cute.gemm(tiled_mma_qk, acc_s, t_rq[None, None, k], t_rk[None, None, k, kv_read.index], acc_s)
                s_pipe.producer_commit(s_write)
                s_write.advance()
                kv_read.advance()
            if j > 0:
                p_pipe.consumer_wait(p_read)  # P of tile j-1 written, O rescaled ...
                tmem_fence_after_sync()  # ... by the softmax's tcgen05.st, ordered before the MMA accumulates O
                tiled_mma_pv.set(tcgen05.Field.ACCUMULATE, j > 1)  # the first tile's PV starts O
                for kb in cutlass.range_constexpr(cute.size(t_rp, mode=[2])):
                    cute.gemm(tiled_mma_pv, t_o, t_rp[None, None, kb], t_rv[None, None, kb, kv_done.index], t_o)
                    tiled_mma_pv.set(tcgen05.Field.ACCUMULATE, True)
                p_pipe.consumer_release(p_read)  # on completion: P free, O final for this tile
                kv_pipe.consumer_release(kv_done)  # on completion: the key stage is free
                p_read.advance()
                kv_done.advance()

    @cute.jit
    def softmax(self, t_s: cute.Tensor, t_o: cute.Tensor, s_p: cute.Tensor, s_x: cute.Tensor, x_bars: cute.Pointer,
                s_pipe: pipeline.PipelineUmmaAsync, p_pipe: pipeline.PipelineAsyncUmma, indices: Optional[cute.Tensor],
                b: Int32, first_tile: Int32, n_tiles: Int32, m0: Int32, seq_len: Int32, cache_len: Int32,
                num_keys: Int32, causal: Int32, rows_per_page: Int32, oob_row: Int32, num_slots: Int32,
                score_scale: Float32, cap_log2: Float32, rank: Int32):
        """Softmax warpgroup: row ``tidx`` of every S tile (the CTA's partial plus the peer's) -> P; rescales the O
        half's row. Masked: keys past the row's causal end (dense), and (sparse) keys past ``topk_lengths`` or
        naming no row. Returns ``(row_max, row_sum)`` (base 2) after waiting for the last PV MMA."""
        tidx, _, _ = cute.arch.thread_idx()
        tok = (m0 + tidx) // self.group
        row_end = num_keys
        if cutlass.const_expr(not self.sparse):
            if causal != 0:
                row_end = cutlass.min(cache_len + tok + 1, num_keys)
        if tok >= seq_len:
            row_end = Int32(0)  # a padding row: everything masked
        live = live_warps(cutlass.min(seq_len * self.group - m0, BM))  # rows past seq_len * group are padding

        s_tile = t_s[(None, None), 0, 0, 0]
        bn = self.bn
        load_s = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(bn)),
                                                            Float32), s_tile).get_slice(tidx)
        t_s_src = load_s.partition_S(s_tile)
        cols = load_s.partition_D(cute.make_identity_tensor((BM, bn)))  # (row, key) of each S register
        scores = cute.make_rmem_tensor(cols.shape, Float32)
        probs = cute.make_rmem_tensor(cols.shape, self.dtype)
        t_p_dst = load_s.partition_D(s_p)  # this thread's row of P, in the same register order

        row_max = NEG_INF
        row_sum = Float32(0.0)
        s_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        p_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        for j in cutlass.range(n_tiles, unroll=1):
            tile_base = (first_tile + j) * bn
            s_pipe.consumer_wait(s_read)
            tmem_fence_after_sync()  # the QK MMA's write of S (its tcgen05.commit arrival) before reading S
            cute.copy(load_s, cute.make_tensor(t_s_src.iterator + s_read.index * bn, t_s_src.layout), scores)
            cute.arch.fence_view_async_tmem_load()
            tmem_fence_before_sync()
            s_pipe.consumer_release(s_read)  # S read: the MMA warp may compute QK of tile j + 2 into it
            s_read.advance()
            self.exchange(scores, s_x, x_bars, j, rank, live)

            scale_scores(scores, score_scale, self.softcap, cap_log2)
            masked = Int32(0)  # most tiles of a dense context are whole
            if tile_base + bn > row_end:
                masked = Int32(1)
            valid = Int32(-1)  # bit k: key k of the tile names a row
            if cutlass.const_expr(self.sparse):
                # Lane k resolves key k as the load warp did, one ballot gives the warp the tile (bits past bn:
                # the next tile's keys, set).
                row = self.key_row(None, indices, b, tile_base + cute.arch.lane_idx(), num_keys, rows_per_page,
                                   oob_row, num_slots)
                valid = cute.arch.vote_ballot_sync(row != oob_row)
                if cutlass.const_expr(bn < 32):
                    valid = valid | Int32(-(1 << bn))
                if valid != -1:
                    masked = Int32(1)
            if masked != 0:
                for c in cutlass.range(cute.size(scores), unroll_full=True):
                    key = cols[c][1]
                    if tile_base + key >= row_end:
                        scores[c] = NEG_INF
                    if cutlass.const_expr(self.sparse):
                        if ((valid >> key) & 1) == 0:
                            scores[c] = NEG_INF
            new_max, corr = exp_scores(scores, row_max)
            row_sum = row_reduce(scores, row_sum * corr, lambda a, b: a + b)
            row_max = new_max
            probs.store(scores.load().to(self.dtype))

            p_pipe.producer_acquire(p_write)  # the PV MMA of tile j-1 is done: P free, O stable ...
            tmem_fence_after_sync()  # ... and ordered before this thread's tcgen05.ld/st of O
            cute.autovec_copy(probs, t_p_dst)
            # O changes only where a row's max moved; the TMEM copies are warp-wide, so a warp skips the
            # rescale only when none of its rows moved (exact: the skipped factor is 1).
            if j > 0:
                if cute.arch.vote_any_sync(corr != 1.0):
                    rescale_o(t_o, corr, O_COLS)  # the value half
            cute.arch.fence_view_async_tmem_store()
            cute.arch.fence_view_async_shared()  # P is read by the MMA next
            tmem_fence_before_sync()
            p_pipe.producer_commit(p_write)
            p_write.advance()
        p_pipe.producer_acquire(p_write)  # the last PV MMA is done: O is final
        tmem_fence_after_sync()
        return row_max, row_sum

    @cute.jit
    def exchange(self, scores: cute.Tensor, s_x: cute.Tensor, x_bars: cute.Pointer, j: Int32, rank: Int32,
                 live: Int32):
        """Thread ``tidx``'s row of tile ``j``'s partial S (``scores``) into the peer CTA's exchange buffer
        (``exchange_slot``; ``st.async``, 16 bytes each, completing the peer's barrier of that buffer), then, once
        the peer's row has landed in ours, ``scores += peer``: the same sum in both CTAs (addition commutes).
        Only the first ``live`` warps exchange (the others' rows are padding, masked whatever their scores);
        thread 0 arms the local barrier with the bytes of their rows. The peer rewrites a buffer for tile j + 2
        only once this CTA's rows of tile j + 1 reached it, each sent after this thread's reads of tile j (and the
        fence.proxy.async of its P write); the wait is followed by a cluster-scope acquire of the completed phase,
        which pairs with the peer's release by ``st.async``."""
        from quack.pipeline import mbarrier_acquire_cluster  # here: importing quack imports triton
        from quack.utils import store_shared_remote_x4

        tidx, _, _ = cute.arch.thread_idx()
        chunks = self.bn // CHUNK
        buf, parity = exchange_slot(j)
        bar = x_bars + buf
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bar, live * 32 * self.bn * 4)
        if tidx // 32 < live:
            row = s_x[tidx, None, buf]
            rotation = exchange_rotation(tidx, chunks)
            for c in cutlass.range_constexpr(chunks):
                slot = cute.local_tile(row, (CHUNK,), (c ^ rotation,))
                store_shared_remote_x4(scores[c * CHUNK], scores[c * CHUNK + 1], scores[c * CHUNK + 2],
                                       scores[c * CHUNK + 3], slot.iterator, bar, 1 - rank)
            cute.arch.mbarrier_wait(bar, parity)
            mbarrier_acquire_cluster(bar, parity)
            peer = cute.make_rmem_tensor((CHUNK,), Float32)
            for c in cutlass.range_constexpr(chunks):
                cute.autovec_copy(cute.local_tile(row, (CHUNK,), (c ^ rotation,)), peer)
                for e in cutlass.range_constexpr(CHUNK):
                    scores[c * CHUNK + e] = scores[c * CHUNK + e] + peer[e]

    @cute.jit
    def epilogue(self, t_o: cute.Tensor, o_written: cutlass.Boolean, row_max: Float32, row_sum: Float32,
                 sinks: Optional[cute.Tensor], out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor,
                 lse: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, v_half: Int32, split: Int32,
                 num_splits: Int32):
        """Row ``tidx``: its O half ``/ l`` to ``out`` (one split) or to this split's float32 partial; value half 0
        writes the row's lse (base 2 for a split, natural with ``return_lse``). The sink joins split 0's
        denominator. A row with no visible key writes 0, and lse = -inf (the sink's with one); O is not read when no
        PV MMA wrote it (``o_written`` false: a split without key tiles)."""
        tidx, _, _ = cute.arch.thread_idx()
        tok = (m0 + tidx) // self.group
        head = (m0 + tidx) % self.group
        top, total, inv = row_normalizer(row_max, row_sum, sinks, head, split, self.sinks)
        load, _, src, _, shape = o_copies(t_o, O_CHUNK)
        vals = cute.make_rmem_tensor(shape, Float32)
        res = cute.make_rmem_tensor(shape, self.dtype)
        chunk0 = v_half * (O_COLS // O_CHUNK)  # the half's first O_CHUNK column block of the output row
        for i in cutlass.range_constexpr(O_COLS // O_CHUNK):
            if o_written:  # CTA-uniform (tcgen05.ld is .sync.aligned): a split without key tiles never wrote O
                cute.copy(load, cute.make_tensor(src.iterator + i * O_CHUNK, src.layout), vals)
                for e in cutlass.range_constexpr(cute.size(vals)):
                    vals[e] = vals[e] * inv
            if row_sum == 0.0:  # no key seen (or no tile): 0 rows, not 0 * inf
                vals.fill(0.0)
            if tok < seq_len:
                row = q_start + tok
                if num_splits == 1:
                    res.store(vals.load().to(self.dtype))
                    cute.autovec_copy(res, cute.local_tile(out[row, head, None], (O_CHUNK,), (chunk0 + i,)))
                else:
                    cute.autovec_copy(vals, cute.local_tile(o_part[split, row, head, None], (O_CHUNK,),
                                                            (chunk0 + i,)))
        # the loads' registers are used in order (a true register dependency), but the columns may be deallocated
        # only once the loads are retired (PTX ISA 9.7.16.6.4.4: tcgen05.ld -> wait::ld -> fence -> sync -> dealloc)
        cute.arch.fence_view_async_tmem_load()
        if tok < seq_len:
            if v_half == 0:
                write_lse(lse, lse_part, q_start, tok, head, split, num_splits, top, total, self.return_lse)

    @cute.jit
    def load_q(self, s_q: cute.Tensor, q: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, rank: Int32):
        """CTA ``rank``'s ``SLICE`` columns of packed rows ``m0 + r`` of ``q`` into the swizzled Q tile, 16 bytes at
        a time (all warps); rows past the request are 0. Made visible to the MMA (async proxy) before the CTA's
        first barrier."""
        chunks = SLICE // VEC
        q = cute.domain_offset((0, 0, cute.assume(slice_start(rank), divby=O_COLS)), q)  # 16-byte loads
        tidx, _, _ = cute.arch.thread_idx()
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for idx in cutlass.range(tidx, BM * chunks, self.threads, unroll=1):
            copy_q_chunk(q, s_q, vals, idx // chunks, idx % chunks, m0, q_start, seq_len, Int32(0), self.group)
        cute.arch.fence_view_async_shared()
