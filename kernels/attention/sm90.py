"""``PagedAttention`` (SM90): FlashAttention over a KV operand, for decode and ragged prefill alike.

MAX's ``flash_attention_kv_cache_ragged``. A CTA is (block of ``BM`` packed query rows, KV head, split, request).
Packed rows interleave the ``group = Hq/H`` query heads sharing a KV head with the tokens (row ``i*group + g`` is
token ``i``, head ``kv_head*group + g``; FA's pack-GQA), so a decode step's heads fill the MMA's M instead of one
row per CTA. Keys ``[0, cache_length + seq_len)`` come through the operand (``operand.py``): ``populate`` names
the rows of a BN-token tile and warp 0 issues one TMA per page slot into a ``STAGES``-deep K/V ring
(``PipelineTmaAsync``) that runs ahead of the math.

Per key tile, one warpgroup: ``S = Q K^T`` (wgmma, fp32) is staged in shared memory; two threads per row mask it
(causal / sliding window / past the keys), run the online softmax in base 2, write ``P`` (16-bit, swizzled) and the
row's rescale factor; ``O`` is rescaled in registers and ``O += P V`` (wgmma, V read MN-major from the same tile as
K's layout). V rows past the request's keys (a partly written last page) are zeroed in shared memory first, so stale
values, NaN included, never reach ``O``.

Split-KV: the CTAs of one (rows, head) divide its key tiles; each writes ``O/l`` and ``lse = m + log2 l`` in
float32 and ``AttentionCombine`` merges them. With one split the CTA writes the output itself.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, Uint8, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.attention.config import BM, BN, FP8, S_PAD, VEC, ring_swizzle, supported, tiling
from cute_kv.kernels.attention.operand import DenseMHAOperand, KVCacheMHAOperand
from cute_kv.kernels.quant import e8m0_to_float32

THREADS = 128  # one warpgroup
BATCH = 8  # 16-byte loads a thread issues before it uses them (Q, fp8 K/V)
NEG_INF = Float32(float("-inf"))
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}  # config.DTYPE_NAMES


class PagedAttention:
    """Compile-time key: dtype (of Q, O and the MMAs), heads (Hq, H), head dim, the operand (``page_size``, None for
    a dense ``[B, S, H, D]`` cache), KVD of a paged cache, whether the lookup table takes vector reads, and an fp8
    cache: ``kv_dtype_name`` ``"float8_e4m3fn"`` with scales over ``granularity`` head dims (None: unscaled), float32
    or, with ``e8m0_scales``, float8_e8m0fnu (passed as their uint8 bits, decoded as torch does: ``kernels/quant.py``).

    An fp8 tile lands in a staging ring and is dequantized (``x * scale``, rounded to ``dtype``) into one 16-bit
    K/V tile that the MMAs read; its stage is released once the CTA barrier after the conversion has passed (every
    thread's reads of it done), before the tile's MMAs.
    """

    def __init__(self, dtype_name: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: Optional[int], kv_dim: int = 2, lut_vector: bool = True,
                 kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None, e8m0_scales: bool = False):
        problem = supported(num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype_name, granularity)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[dtype_name]
        self.kv_fp8 = kv_dtype_name == FP8
        self.kv_dtype = cutlass.Float8E4M3FN if self.kv_fp8 else self.dtype
        self.granularity, self.e8m0_scales = granularity, e8m0_scales
        self.swizzle = ring_swizzle(head_dim, self.kv_fp8)
        self.plan = tiling(head_dim, self.kv_fp8)
        self.stages = self.plan.stages
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.page_size, self.kv_dim = page_size, kv_dim
        self.bn = BN
        if page_size is None:
            self.k_op = self.v_op = DenseMHAOperand(self.bn)
        else:
            self.k_op = KVCacheMHAOperand(0, page_size, self.bn, lut_vector)
            self.v_op = KVCacheMHAOperand(1, page_size, self.bn, lut_vector)

    # -- host ------------------------------------------------------------------------------------

    def smem_bytes(self) -> int:
        return self.plan.smem

    def fake_args(self) -> tuple:
        dt, d, hq = self.dtype, self.head_dim, self.num_q_heads
        t = cute.sym_int32()
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- 16-byte row accesses
        q = make_fake_tensor(dt, (t, hq, d), stride=(row(), d, 1), assumed_align=16)
        out = make_fake_tensor(dt, (t, hq, d), stride=(row(), d, 1), assumed_align=16)
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, d),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        b = cute.sym_int32()
        h = self.num_kv_heads
        scales = None
        if self.page_size is None:
            cache = lambda: make_fake_tensor(dt, (cute.sym_int32(), cute.sym_int32(), h, d), stride=(  # noqa: E731
                cute.sym_int64(divisibility=h * d), h * d, d, 1), assumed_align=16)
            k_src, v_src, lut = cache(), cache(), None
        else:
            kvd, p = self.kv_dim, self.page_size
            k_src = v_src = make_fake_tensor(self.kv_dtype, (cute.sym_int32(), kvd, cute.sym_int32(), p, h, d), stride=(
                cute.sym_int64(divisibility=kvd * p * h * d), cute.sym_int64(divisibility=p * h * d), p * h * d,
                h * d, d, 1), assumed_align=16)
            if self.granularity:
                g = d // self.granularity
                scales = make_fake_tensor(Uint8 if self.e8m0_scales else Float32, (
                    cute.sym_int32(), kvd, cute.sym_int32(), p, h, g), stride=(
                    cute.sym_int64(), cute.sym_int64(), p * h * g, h * g, g, 1),
                    assumed_align=1 if self.e8m0_scales else 4)  # whole float32s: one 4-byte load per scale
            # What the TVM-FFI wrapper checks on every call: only what populate's vector loads need.
            width = self.k_op.lut_width
            lut = make_fake_tensor(Uint32, (b, cute.sym_int32()), stride=(cute.sym_int64(divisibility=width), 1),
                                   assumed_align=4 * width)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        return (q, out, o_part, lse_part, k_src, v_src, offsets, lengths, lut, scales, Int32(0), Int32(1), Int32(1),
                Int32(1), Int32(0), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, q: cute.Tensor, out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor,
                 k_src: cute.Tensor, v_src: cute.Tensor, input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor,
                 lookup_table: Optional[cute.Tensor], scales: Optional[cute.Tensor], layer_idx: Int32,
                 m_blocks: Int32, num_splits: Int32, causal: Int32, window: Int32, scale_log2: Float32,
                 stream: cuda.CUstream):
        """``m_blocks``: ``ceil(max_seq_len * group / BM)``; ``window`` 0: none; ``scale_log2``: scale * log2(e);
        ``scales``: the fp8 cache's ``[N, KVD, L, P, H, G]`` (None for unscaled or 16-bit caches)."""
        dt, d, bn = self.dtype, self.head_dim, self.bn
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                         (1, 1, 1), (BM, bn))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                         (1, 1, 1), (BM, d))
        k_rows = self.k_op.row_view(k_src, layer_idx)
        tma_k, g_k, s_slot = tma_tiles.create_tma_tile(k_rows, self.k_op.rows_per_copy, d, self.swizzle)
        tma_v, g_v, _ = tma_tiles.create_tma_tile(self.v_op.row_view(v_src, layer_idx), self.v_op.rows_per_copy, d,
                                                  self.swizzle)
        k_scales = v_scales = None
        if cutlass.const_expr(scales is not None):
            k_scales = self.k_op.scale_view(scales, layer_idx)
            v_scales = self.v_op.scale_view(scales, layer_idx)
        grid = (m_blocks, self.num_kv_heads * num_splits, cache_lengths.shape[0])
        self.kernel(tiled_mma_qk, tiled_mma_pv, tma_k, g_k, tma_v, g_v, s_slot, q, out, o_part, lse_part,
                    input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales,
                    self.k_op.rows_per_page(k_src), k_rows.shape[0], num_splits, causal, window, scale_log2).launch(
            grid=grid, block=(THREADS, 1, 1), smem=self.smem_bytes(), stream=stream)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tma_k: cute.CopyAtom,
               g_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor, s_slot: cute.ComposedLayout, q: cute.Tensor,
               out: cute.Tensor, o_part: cute.Tensor, lse_part: cute.Tensor, input_row_offsets: cute.Tensor,
               cache_lengths: cute.Tensor, lookup_table: Optional[cute.Tensor], k_scales: Optional[cute.Tensor],
               v_scales: Optional[cute.Tensor], rows_per_page: Int32, oob_row: Int32, num_splits: Int32,
               causal: Int32, window: Int32, scale_log2: Float32):
        dt, d, bn, group, stages = self.dtype, self.head_dim, self.bn, self.group, self.stages
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head_split, b = cute.arch.block_idx()
        kv_head = head_split % self.num_kv_heads
        split = head_split // self.num_kv_heads
        q_start = Int32(input_row_offsets[b])
        seq_len = Int32(input_row_offsets[b + 1]) - q_start
        m0 = m_block * BM
        if m0 < seq_len * group:  # the CTA has query rows (uniform: the whole CTA leaves otherwise)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_k)
                cpasync.prefetch_descriptor(tma_v)
            cache_len = Int32(cache_lengths[b])
            num_keys = cache_len + seq_len
            # Key tiles any row of this block may see, then this split's share of them.
            tok_first = m0 // group
            tok_last = (cutlass.min(m0 + BM, seq_len * group) - 1) // group
            k_end = num_keys
            if causal != 0:
                k_end = cache_len + tok_last + 1
            k_begin = Int32(0)
            if window > 0:
                k_begin = cutlass.max(cache_len + tok_first - window + 1, 0)
            tile_begin = k_begin // bn
            tiles = (k_end + bn - 1) // bn - tile_begin
            per_split = (tiles + num_splits - 1) // num_splits
            first_tile = tile_begin + split * per_split
            n_tiles = cutlass.max(cutlass.min(per_split, tiles - split * per_split), 0)

            smem = SmemAllocator()
            mbars = smem.allocate_array(cutlass.Int64, 2 * stages)
            s_corr = smem.allocate_tensor(Float32, cute.make_layout(BM), byte_alignment=16)
            s_max = smem.allocate_tensor(Float32, cute.make_layout(BM), byte_alignment=16)
            s_sum = smem.allocate_tensor(Float32, cute.make_layout(BM), byte_alignment=16)
            sq_layout = tma_tiles.smem_tile_layout(dt, BM, d)
            sp_layout = tma_tiles.smem_tile_layout(dt, BM, bn)
            ring_layout = tma_tiles.smem_tile_layout(self.kv_dtype, bn, d, self.swizzle, stages=stages)
            s_q = smem.allocate_tensor(dt, sq_layout.outer, byte_alignment=1024, swizzle=sq_layout.inner)
            s_p = smem.allocate_tensor(dt, sp_layout.outer, byte_alignment=1024, swizzle=sp_layout.inner)
            s_s = smem.allocate_tensor(Float32, cute.make_layout((BM, bn), stride=(bn + S_PAD, 1)),
                                       byte_alignment=16)
            ring = smem.allocate(self.plan.ring, byte_alignment=1024)
            kv_bytes = stages * self.plan.stage // 2
            ring_k = cute.make_tensor(cute.recast_ptr(ring, ring_layout.inner, dtype=self.kv_dtype), ring_layout.outer)
            ring_v = cute.make_tensor(cute.recast_ptr(ring + kv_bytes, ring_layout.inner, dtype=self.kv_dtype),
                                      ring_layout.outer)
            s_k, s_v = ring_k, ring_v  # what the MMAs read: the ring itself, or the dequantized tiles after it
            if cutlass.const_expr(self.kv_fp8):
                mma_layout = tma_tiles.smem_tile_layout(dt, bn, d, stages=1)
                s_k = cute.make_tensor(cute.recast_ptr(ring + 2 * kv_bytes, mma_layout.inner, dtype=dt),
                                       mma_layout.outer)
                s_v = cute.make_tensor(cute.recast_ptr(ring + 2 * kv_bytes + self.plan.mma_tile // 2,
                                                       mma_layout.inner, dtype=dt), mma_layout.outer)
            # V as the MMA's B operand: (D, BN) with D contiguous (MN-major), the same bytes.
            s_vt = cute.composition(s_v, cute.make_ordered_layout((d, bn, cute.size(s_v, mode=[2])), order=(1, 0, 2)))

            pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=mbars, num_stages=stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),
                tx_count=self.plan.stage, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
            # The producer's rows of its next tile: read from the lookup table one tile ahead (load_tile).
            next_rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
            if warp_idx == 0:
                self.k_op.populate(next_rows, lookup_table, b, first_tile * bn, num_keys, rows_per_page, oob_row)
                for _ in cutlass.range(cutlass.min(stages, n_tiles), unroll=1):
                    self.load_tile(pipe, prod, first_tile + prod.count, next_rows, tma_k, g_k, ring_k, tma_v, g_v,
                                   ring_v, s_slot, lookup_table, b, kv_head, num_keys, rows_per_page, oob_row)
                    prod.advance()

            self.load_q(s_q, q, q_start, seq_len, m0, kv_head)

            thr_qk = tiled_mma_qk.get_slice(tidx)
            thr_pv = tiled_mma_pv.get_slice(tidx)
            t_rq = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(s_q))
            t_rk = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(s_k))
            t_rp = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(s_p))
            t_rv = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(s_vt))
            acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BM, bn)), Float32)
            acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BM, d)), Float32)
            acc_o.fill(0.0)
            tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)  # O starts at 0 and is rescaled, never reset
            rows_o = thr_pv.partition_C(cute.make_identity_tensor((BM, d)))  # (row, col) of each O register

            # Softmax: thread t owns half t % 2 of row t // 2, and the row's key range.
            r = tidx // 2
            half = tidx % 2
            tok = (m0 + r) // group
            pos = cache_len + tok
            row_end = num_keys
            if causal != 0:
                row_end = cutlass.min(pos + 1, num_keys)
            row_begin = Int32(0)
            if window > 0:
                row_begin = pos - window + 1
            if tok >= seq_len:
                row_end = Int32(0)  # a padding row: everything masked
            row_max = NEG_INF
            row_sum = Float32(0.0)
            scores = cute.make_rmem_tensor((bn // 2,), Float32)
            probs = cute.make_rmem_tensor((bn // 2,), dt)

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
            k_blocks = cute.size(t_rq, mode=[2])
            pv_blocks = cute.size(t_rp, mode=[2])
            # fp8 scales: every thread's rows of the tile it dequantizes next, read one tile ahead as the producer's.
            scale_rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
            if cutlass.const_expr(k_scales is not None):
                self.k_op.populate(scale_rows, lookup_table, b, first_tile * bn, num_keys, rows_per_page, oob_row)
            for _ in cutlass.range(n_tiles, unroll=1):
                tile_base = (first_tile + read.count) * bn
                pipe.consumer_wait(read)
                mma_stage = read.index
                if cutlass.const_expr(self.kv_fp8):
                    mma_stage = Int32(0)
                    cute.arch.sync_threads()  # the previous tile's MMAs are done with the 16-bit tiles
                    self.dequantize(ring_k, s_k, read.index, k_scales, scale_rows, tile_base, num_keys, kv_head)
                    self.dequantize(ring_v, s_v, read.index, v_scales, scale_rows, tile_base, num_keys, kv_head)
                    if cutlass.const_expr(k_scales is not None):
                        self.k_op.populate(scale_rows, lookup_table, b, tile_base + bn, num_keys, rows_per_page,
                                           oob_row)
                    cute.arch.fence_view_async_shared()
                    cute.arch.sync_threads()
                    pipe.consumer_release(read)  # every thread's reads of the stage are done (the barrier above)
                    if warp_idx == 0 and prod.count < n_tiles:
                        self.load_tile(pipe, prod, first_tile + prod.count, next_rows, tma_k, g_k, ring_k, tma_v, g_v,
                                       ring_v, s_slot, lookup_table, b, kv_head, num_keys, rows_per_page, oob_row)
                        prod.advance()
                tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, False)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(k_blocks):
                    cute.gemm(tiled_mma_qk, acc_s, t_rq[None, None, kb], t_rk[None, None, kb, mma_stage], acc_s)
                    tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                thr_qk.partition_C(s_s).store(acc_s.load())
                if cutlass.const_expr(not self.kv_fp8):  # (dequantize wrote those rows as zeros)
                    if tile_base + bn > num_keys:
                        self.zero_stale_rows(s_v, read.index, num_keys - tile_base)
                cute.arch.sync_threads()

                # Online softmax of this thread's half row, in base 2.
                cute.autovec_copy(cute.local_tile(s_s[r, None], (bn // 2,), (half,)), scores)
                tile_max = NEG_INF
                for c in cutlass.range(bn // 2, unroll_full=True):
                    key = tile_base + half * (bn // 2) + c
                    x = scores[c] * scale_log2
                    if key < row_begin:
                        x = NEG_INF
                    if key >= row_end:
                        x = NEG_INF
                    scores[c] = x
                    tile_max = cute.arch.fmax(tile_max, x)
                tile_max = cute.arch.warp_reduction(tile_max, cute.arch.fmax, threads_in_group=2)
                new_max = cute.arch.fmax(row_max, tile_max)
                ref = new_max
                if new_max == NEG_INF:
                    ref = Float32(0.0)  # nothing visible yet: every p and the correction are 0
                corr = cute.math.exp2(row_max - ref, fastmath=True)
                tile_sum = Float32(0.0)
                for c in cutlass.range(bn // 2, unroll_full=True):
                    p = cute.math.exp2(scores[c] - ref, fastmath=True)
                    tile_sum = tile_sum + p
                    scores[c] = p
                probs.store(scores.load().to(dt))
                cute.autovec_copy(probs, cute.local_tile(s_p[r, None], (bn // 2,), (half,)))
                row_sum = row_sum * corr + cute.arch.warp_reduction(tile_sum, lambda a, c: a + c,
                                                                    threads_in_group=2)
                row_max = new_max
                if half == 0:
                    s_corr[r] = corr
                cute.arch.fence_view_async_shared()  # P (and zeroed V rows) are read by wgmma next
                cute.arch.sync_threads()

                for i in cutlass.range(cute.size(acc_o), unroll_full=True):
                    acc_o[i] = acc_o[i] * s_corr[rows_o[i][0]]
                warpgroup.fence()
                for kb in cutlass.range_constexpr(pv_blocks):
                    cute.gemm(tiled_mma_pv, acc_o, t_rp[None, None, kb], t_rv[None, None, kb, mma_stage], acc_o)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                if cutlass.const_expr(not self.kv_fp8):
                    pipe.consumer_release(read)
                    if warp_idx == 0 and prod.count < n_tiles:
                        self.load_tile(pipe, prod, first_tile + prod.count, next_rows, tma_k, g_k, ring_k, tma_v, g_v,
                                       ring_v, s_slot, lookup_table, b, kv_head, num_keys, rows_per_page, oob_row)
                        prod.advance()
                read.advance()

            if half == 0:
                s_max[r] = row_max
                s_sum[r] = row_sum
            s_o = cute.make_tensor(cute.recast_ptr(ring, dtype=Float32),
                                   cute.make_layout((BM, d), stride=(d + S_PAD, 1)))
            cute.arch.sync_threads()  # every wgmma has read the ring before it holds O
            thr_pv.partition_C(s_o).store(acc_o.load())
            cute.arch.sync_threads()
            self.store_o(s_o, s_max, s_sum, out, o_part, lse_part, q_start, seq_len, m0, kv_head, split, num_splits)

    @cute.jit
    def load_tile(self, pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, tile: Int32, rows: cute.Tensor,
                  tma_k: cute.CopyAtom, g_k: cute.Tensor, s_k: cute.Tensor, tma_v: cute.CopyAtom, g_v: cute.Tensor,
                  s_v: cute.Tensor, s_slot: cute.ComposedLayout, lookup_table: Optional[cute.Tensor], b: Int32,
                  kv_head: Int32, num_keys: Int32, rows_per_page: Int32, oob_row: Int32):
        """Producer: K and V of key tile ``tile`` into stage ``prod.index``, one TMA per page slot each (K and V
        planes share the row numbering, so one ``populate`` serves both). ``rows`` holds the tile's rows on entry
        and the next tile's on return: their lookup entries load while this stage is in flight, not before the
        next copies."""
        op = self.k_op
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        box = (op.rows_per_copy, cute.size(s_slot, mode=[1]))
        for g_rows, s_tiles, atom in ((g_k, s_k, tma_k), (g_v, s_v, tma_v)):
            for p in cutlass.range_constexpr(op.copies_per_tile):
                src = cute.local_tile(cute.domain_offset((rows[p], 0, 0), g_rows), box, (0, 0, kv_head))
                dst = cute.local_tile(s_tiles[None, None, prod.index], box, (p, 0))
                t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                 cute.group_modes(src, 0, 2))
                cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)
        pipe.producer_commit(prod)
        op.populate(rows, lookup_table, b, (tile + 1) * self.bn, num_keys, rows_per_page, oob_row)

    @cute.jit
    def load_q(self, s_q: cute.Tensor, q: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, kv_head: Int32):
        """Packed rows ``m0 + r`` of ``q`` into the swizzled Q tile, 16 bytes at a time; rows past the request are 0.

        Unrolled: each thread issues ``BATCH`` loads before its first store."""
        d, group = self.head_dim, self.group
        chunks = d // VEC
        tidx, _, _ = cute.arch.thread_idx()
        c = tidx % chunks  # THREADS is a multiple of chunks: a thread keeps its column chunk
        trips = BM * chunks // THREADS
        for j0 in cutlass.range_constexpr(0, trips, BATCH):
            vals = [cute.make_rmem_tensor((VEC,), self.dtype) for _ in range(min(BATCH, trips - j0))]
            for j in cutlass.range_constexpr(len(vals)):
                r = tidx // chunks + (j0 + j) * (THREADS // chunks)
                tok = (m0 + r) // group
                vals[j].fill(0.0)
                if tok < seq_len:
                    src = q[q_start + tok, kv_head * group + (m0 + r) % group, None]
                    cute.autovec_copy(cute.local_tile(src, (VEC,), (c,)), vals[j])
            for j in cutlass.range_constexpr(len(vals)):
                r = tidx // chunks + (j0 + j) * (THREADS // chunks)
                cute.autovec_copy(vals[j], cute.local_tile(s_q[r, None], (VEC,), (c,)))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()

    @cute.jit
    def dequantize(self, ring: cute.Tensor, tile: cute.Tensor, stage: Int32, scales: Optional[cute.Tensor],
                   rows: cute.Tensor, tile_base: Int32, num_keys: Int32, kv_head: Int32):
        """fp8 rows of ``ring[stage]`` -> the 16-bit ``tile``, 8 values at a time: ``x * scale`` of the value's
        granule (``scales[row, kv_head, dim // granularity]``, the row from the tile's ``populate``), rounded once.
        Rows past the request's keys are written as zeros.

        Unrolled like ``load_q``: a thread's ``BATCH`` shared and scale loads are issued before its conversions.
        The scale's element index is 64-bit: ``row * H * G`` passes 2^31 on large caches."""
        d, per_copy = self.head_dim, self.k_op.rows_per_copy
        chunks = d // VEC
        tidx, _, _ = cute.arch.thread_idx()
        c = tidx % chunks
        trips = self.bn * chunks // THREADS
        for j0 in cutlass.range_constexpr(0, trips, BATCH):
            n = min(BATCH, trips - j0)
            raw = [cute.make_rmem_tensor((VEC,), self.kv_dtype) for _ in range(n)]
            scale = cute.make_rmem_tensor((n,), Float32)
            for j in cutlass.range_constexpr(n):
                r = tidx // chunks + (j0 + j) * (THREADS // chunks)
                scale[j] = Float32(1.0)
                if tile_base + r < num_keys:
                    cute.autovec_copy(cute.local_tile(ring[r, None, stage], (VEC,), (c,)), raw[j])
                    if cutlass.const_expr(scales is not None):
                        row = rows[0]
                        for p in cutlass.range_constexpr(1, self.k_op.copies_per_tile):  # a select, not a stack load
                            if r >= p * per_copy:
                                row = rows[p]
                        s = scales[Int64(row) + r % per_copy, kv_head, c * VEC // self.granularity]
                        if cutlass.const_expr(self.e8m0_scales):
                            s = e8m0_to_float32(Uint32(s))
                        scale[j] = s
            for j in cutlass.range_constexpr(n):
                r = tidx // chunks + (j0 + j) * (THREADS // chunks)
                vals = cute.make_rmem_tensor((VEC,), self.dtype)
                vals.fill(0.0)
                if tile_base + r < num_keys:
                    vals.store((raw[j].load().to(Float32) * scale[j]).to(self.dtype))
                cute.autovec_copy(vals, cute.local_tile(tile[r, None, 0], (VEC,), (c,)))

    @cute.jit
    def zero_stale_rows(self, s_v: cute.Tensor, stage: Int32, first_row: Int32):
        """Zero V rows ``[first_row, BN)`` of ``stage``: past the request's keys (P is 0 there, but 0 * NaN is not)."""
        d = self.head_dim
        chunks = d // VEC
        tidx, _, _ = cute.arch.thread_idx()
        zeros = cute.make_rmem_tensor((VEC,), self.dtype)
        zeros.fill(0.0)
        for idx in cutlass.range(tidx, self.bn * chunks, THREADS, unroll=1):
            if idx // chunks >= first_row:
                cute.autovec_copy(zeros, cute.local_tile(s_v[idx // chunks, None, stage], (VEC,), (idx % chunks,)))

    @cute.jit
    def store_o(self, s_o: cute.Tensor, s_max: cute.Tensor, s_sum: cute.Tensor, out: cute.Tensor,
                o_part: cute.Tensor, lse_part: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32,
                kv_head: Int32, split: Int32, num_splits: Int32):
        """Row ``r`` of the staged O, divided by its sum: to ``out`` (one split) or to this split's float32 partial
        with its log2-sum-exp. A row with no visible key writes 0 (and lse = -inf)."""
        d, group = self.head_dim, self.group
        chunks = d // VEC
        tidx, _, _ = cute.arch.thread_idx()
        vals = cute.make_rmem_tensor((VEC,), Float32)
        res = cute.make_rmem_tensor((VEC,), self.dtype)
        for idx in cutlass.range(tidx, BM * chunks, THREADS, unroll=1):
            r = idx // chunks
            c = idx % chunks
            tok = (m0 + r) // group
            if tok < seq_len:
                row = q_start + tok
                head = kv_head * group + (m0 + r) % group
                total = s_sum[r]
                inv = Float32(0.0)
                if total > 0.0:
                    inv = 1.0 / total
                cute.autovec_copy(cute.local_tile(s_o[r, None], (VEC,), (c,)), vals)
                for e in cutlass.range_constexpr(VEC):
                    vals[e] = vals[e] * inv
                if num_splits == 1:
                    res.store(vals.load().to(self.dtype))
                    cute.autovec_copy(res, cute.local_tile(out[row, head, None], (VEC,), (c,)))
                else:
                    cute.autovec_copy(vals, cute.local_tile(o_part[split, row, head, None], (VEC,), (c,)))
                    if c == 0:
                        lse = NEG_INF
                        if total > 0.0:
                            lse = s_max[r] + cute.math.log2(total, fastmath=True)
                        lse_part[split, row, head] = lse
