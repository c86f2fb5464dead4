"""``MLADecode`` (SM90): MLA attention over a paged latent cache (one KV head of ``latent_dim`` = ``kv_lora_rank +
rope_dim``), decode and ragged multi-token steps alike (chunked prefill in the absorbed form).

Every query head reads the same latent rows, so a CTA packs ``BM = 64`` (token, head) rows in M (row ``i * Hq +
h`` is token ``i``, head ``h``; the heads of a token stay together) and each key tile is read once per 64 heads.
``S = Q K^T`` runs over the whole latent width; ``O = P V`` takes V as the first ``v_dim`` columns of the same
K stage in shared memory, so V is never loaded. Three warpgroups:

* the producer (warp 0): one TMA per page slot of each 64-key tile into a two-stage ring (``populate`` reads the
  next tile's lookup entries while the copies fly);
* two consumer warpgroups holding the same 64 rows. Warpgroup ``w`` computes S for keys ``[32w, 32w + 32)`` of the
  tile (SS wgmma, N = 32), masks it, and publishes its rows' maxima; after a named barrier both take the max of the
  two, exponentiate, rescale their O and write their half of P (16-bit) into the shared P tile; after a second
  barrier each issues ``O[:, half w] += P V[:, half w]`` (SS wgmma, N = v_dim / 2) over the whole tile. O is 64 x
  256 float32 per warpgroup (128 registers a thread), so neither the QK nor the PV work is duplicated.

A tile's PV holds both its stage (V is the stage's first columns) and the one P tile (shared memory holds Q, two K
stages and one P: a third stage or a second P, FlashMLA's seesaw, does not fit in the 227 KiB). Where the PV runs is
a compile-time choice, ``pv_overlap``:

* off (what the ops dispatch): each tile's PV is issued and waited for at the end of its step and its stage released
  right then, so the producer refills it while the next tile is computed: a stage's load has a whole step to land
  in, and over 16-bit rows the two stages' copies may fly together. The tensor cores idle through the scores, the
  maxima exchange, the exponentials and the P writes.
* on (FA3's intra-warpgroup overlap): a tile's PV is issued behind the next tile's QK and only the QK is waited for,
  so the PV runs through that tile's scores, the maxima exchange and the exponentials; the next P is written once
  both PVs are done (each warpgroup waits for its own, then both meet on a third named barrier). The tensor cores
  idle only through the O rescale, the P writes and the P barrier, but a stage is released in the middle of the
  next tile's step: the load refilling it has only the rescale, the P writes and the P barrier to hide behind, and
  a tile's PV is issued only once the next tile has landed.

With QK and PV the MMAs' times, S the softmax between them, P the rescale and P writes and L a stage's load (its TMA,
and its dequantization over rope-aware rows), a tile takes at most ``max(QK + S + P + PV, L)`` off and ``QK +
max(S, PV) + max(P, L)`` on: the overlap wins only while ``L < P + min(S, PV)``. In an event model with QK 1,100,
PV 1,000, S 500 and P 250 cycles, on / off is 0.82, 0.98, 1.08, 1.26 and 1.60 at L = 0, 700, 1,000, 1,500 and
2,500 cycles; a 72 KiB TMA takes longer than 750 cycles, hence off by default, and ``perf/bench_mla_decode.py
--pv-overlap`` times both. The steady state has no CTA-wide barrier.

Tiles are walked from the last to the first as in ``PagedAttention``: the first one walked holds the request's
last key, and its rows past the keys are zeroed in the V columns once both QKs have read the stage (P is exactly 0
there, but 0 * NaN is not). Soft-cap, causal and window masks, sinks and split-KV follow ``PagedAttention``; the
splits' float32 partials ``[splits, T, Hq, v_dim]`` go through the same ``AttentionCombine``.

Rope-aware FP8 caches (``rope_dim``; rows ``[padded_depth e4m3 | rope_dim bf16]``, 640 bytes for DeepSeek, one
float32 scale per token) keep the consumers and the shared-memory plan above and change the producer. The 227 KiB
hold Q (72 KiB), two bf16 stages (2 x 72 KiB) and P (8 KiB) with 1 KiB to spare, so a separate fp8 landing ring
(40 KiB a tile: 32 KiB content, 8 KiB rope) does not fit beside them. The ways out, by the numbers:

* one bf16 stage + a 2-deep landing ring (Q 72 + 72 + 2 x 40 + P 8 = 232 KiB, over by 5 KiB; with the rope straight
  into the bf16 stage 224 KiB): one stage serializes each tile's dequantization behind both warpgroups' PV;
* 32-key tiles (2 x 36 KiB bf16 + 2 x 20 KiB landing): halves the QK wgmma's N to 16, whose SS operand reads (2 KiB
  of Q + 0.5 KiB of K per k-step, 20 cycles of shared-memory bandwidth for 8 of tensor work) cost about 1.4x the
  64-key tile's MMA time per key, while the dequantization still moves 96 KiB of shared memory per 64 keys;
* the scale folded into S and P (``S_j = s_j q_lat.c_j + q_rope.r_j``, ``O = sum_j p_j s_j c_j``): saves 2 of the 6
  instructions per 2 values of the conversion but splits QK into two accumulators and puts 64 more multiplies a
  tile on the consumers' critical path; e4m3 -> bf16 is exact either way, so the scale is applied at conversion;
* chosen: the landing ring inside the bf16 ring. Each tile's e4m3 content lands by TMA (box at byte 0,
  ``padded_depth`` wide) in the stage it is dequantized into, at byte ``BN * padded_depth``: the upper half of the
  stage's content bytes, i.e. the bf16 columns ``[padded_depth / 2, padded_depth)`` written last; its rope lands by
  the BF16 rope tile (byte offset ``padded_depth`` of each row) straight into the stage's rope columns. The whole
  producer warpgroup dequantizes 128 content bytes (one landed swizzle row) at a time into 128 bf16 columns, ``x *
  scale`` rounded once (scales per token read from global memory by the rows' ``populate`` entries); the 128-column
  blocks whose bf16 output covers landed bytes (the upper half) read their rows into registers and meet on a
  warpgroup barrier before writing, two rows a thread per pass. A thread's rows lie 16 apart, so its swizzled
  chunks are one offset of its own plus constants: every 16-byte load and store has an immediate offset. Rows past
  the request's keys are written as zeros: only the first tile walked holds any, and only its dequantization clears
  their bytes and scales (the others check no row). A steady-state tile is then the 6 instructions per 2 values of
  the exact conversion (768 a thread) and about 150 more (SASS: 921 for warps 1-3, 965 for warp 0, which issues the
  copies; 1,287 and 1,331 before the per-thread offsets). Shared memory is the 16-bit kernel's plus one landed
  barrier a stage; the consumers run unchanged. The cost is the latency: a stage is refilled only after both
  warpgroups released it (as for 16-bit rows) and then waits for its TMA and the dequantization (32 KiB read, 64 KiB
  written per tile by 128 threads) before the consumers may read it.
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
from cutlass import Float32, Int32, Uint32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.attention import softmax
from cute_kv.kernels.attention.block_info import copy_q_chunk, mask_loops, row_key_ranges, split_tiles
from cute_kv.kernels.attention.operand import KVCacheMHAOperand
from cute_kv.kernels.mla.config import BM, BN, FP8_BLOCK, STAGES, VEC, supported, tiling
from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.quant import granule_scale
from cute_kv.kernels.paged.ragged_rows import request_rows

WG_THREADS = 128
THREADS = 3 * WG_THREADS  # producer + two consumer warpgroups
PRODUCER_REGS = 32
PRODUCER_REGS_FP8 = 40  # the dequantizing warpgroup: all that the launch's 168 x 384 leave beside the consumers' 232
CONSUMER_REGS = 232
LOG2E = math.log2(math.e)
# Dequantizing a rope-aware tile: a thread reads 16 e4m3 bytes of a landed 128-byte row (two 16-byte bf16 writes);
# 8 threads a row, the warpgroup 16 rows a pass, each thread the rows ``tidx // 8 + 16 j`` of every block.
DEQUANT_CHUNK = 2 * VEC
DEQUANT_PER_ROW = FP8_BLOCK // DEQUANT_CHUNK
DEQUANT_STEP = WG_THREADS // DEQUANT_PER_ROW
DEQUANT_HELD = 2  # rows a thread reads before the barrier of a pass that writes over landed bytes
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class Barrier(enum.IntEnum):
    """Named barriers (0 is the CTA-wide one, never used past the prologue)."""

    MAX = 1  # both consumer warpgroups: row maxima published (without pv_overlap: each one's last PV done)
    P = 2  # both consumer warpgroups: P halves written
    PV = 3  # pv_overlap: both consumer warpgroups' previous PVs done, the P tile free
    DEQUANT = 4  # the producer warpgroup: landed fp8 rows read by all before bf16 values are written over them


class MLADecode:
    """Compile-time key: dtype (q, the cache, O and the MMAs), query heads, the latent width, ``v_dim`` (the value
    columns), the page size, whether the lookup table takes vector reads, the optional features (soft-cap,
    sinks, writing the natural-log ``lse``), ``rope_dim``: nonzero for a rope-aware FP8 cache (``latent_dim =
    padded_depth + rope_dim``; rows of ``padded_depth + 2 * rope_dim`` bytes), and ``pv_overlap``: each tile's PV
    left running through the next tile's softmax (module docstring: the ops dispatch it off)."""

    def __init__(self, dtype_name: str, num_q_heads: int, latent_dim: int, v_dim: int, page_size: int,
                 lut_vector: bool = True, softcap: bool = False, sinks: bool = False, return_lse: bool = False,
                 rope_dim: int = 0, pv_overlap: bool = False):
        problem = supported(num_q_heads, latent_dim, v_dim, page_size, dtype_name, rope_dim)
        if problem:
            raise ValueError(problem)
        self.dtype = DTYPES[dtype_name]
        self.num_q_heads, self.latent_dim, self.v_dim, self.page_size = num_q_heads, latent_dim, v_dim, page_size
        self.group = num_q_heads  # one latent KV head: every query head packs with it
        self.softcap, self.sinks, self.return_lse, self.pv_overlap = softcap, sinks, return_lse, pv_overlap
        self.rope_dim, self.padded_depth = rope_dim, latent_dim - rope_dim
        self.row_bytes = self.padded_depth + 2 * rope_dim if rope_dim else latent_dim * self.dtype.width // 8
        self.producer_regs, self.consumer_regs = PRODUCER_REGS_FP8 if rope_dim else PRODUCER_REGS, CONSUMER_REGS
        self.plan = tiling(latent_dim, bool(rope_dim))
        self.k_op = KVCacheMHAOperand(0, page_size, BN, lut_vector)

    # -- host ------------------------------------------------------------------------------------

    def smem_bytes(self) -> int:
        return self.plan.smem

    def fake_args(self) -> tuple:
        dt, d, dv, hq, p = self.dtype, self.latent_dim, self.v_dim, self.num_q_heads, self.page_size
        t = cute.sym_int32()
        q = make_fake_tensor(dt, (t, hq, d), stride=(cute.sym_int64(divisibility=VEC), d, 1), assumed_align=16)
        out = make_fake_tensor(dt, (t, hq, dv), stride=(cute.sym_int64(divisibility=VEC), dv, 1), assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (t, hq), stride_order=(1, 0), assumed_align=4) if self.return_lse \
            else None
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, dv),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        sinks = make_fake_compact_tensor(Float32, (hq,), assumed_align=4) if self.sinks else None
        row = d if not self.rope_dim else self.row_bytes  # (in cache elements: bytes of an fp8 row)
        blocks = make_fake_tensor(cutlass.Float8E4M3FN if self.rope_dim else dt, (
            cute.sym_int32(), 1, cute.sym_int32(), p, 1, row), stride=(
            cute.sym_int64(divisibility=p * row), cute.sym_int64(divisibility=p * row), p * row, row, row, 1),
            assumed_align=16)
        scales = make_fake_tensor(Float32, (cute.sym_int32(), 1, cute.sym_int32(), p, 1, 1), stride=(
            cute.sym_int64(), cute.sym_int64(), p, 1, 1, 1), assumed_align=4) if self.rope_dim else None
        b = cute.sym_int32()
        width = self.k_op.lut_width
        lut = make_fake_tensor(Uint32, (b, cute.sym_int32()), stride=(cute.sym_int64(divisibility=width), 1),
                               assumed_align=4 * width)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        return (q, out, lse, o_part, lse_part, sinks, blocks, scales, offsets, lengths, lut, Int32(0), Int32(1),
                Int32(1), Int32(1), Int32(0), Float32(1.0), Float32(1.0), make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, q: cute.Tensor, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor,
                 lse_part: cute.Tensor, sinks: Optional[cute.Tensor], blocks: cute.Tensor,
                 scales: Optional[cute.Tensor], input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor,
                 lookup_table: cute.Tensor, layer_idx: Int32, m_blocks: Int32, num_splits: Int32, causal: Int32,
                 window: Int32, score_scale: Float32, softmax_scale_log2: Float32, stream: cuda.CUstream):
        """``m_blocks``: ``ceil(max_seq_len * Hq / BM)``; ``window`` 0: none; ``score_scale`` and
        ``softmax_scale_log2`` as for ``PagedAttention`` (soft-cap folded in). ``blocks``: the MLA cache
        ``[N, 1, L, P, 1, latent_dim]``, or rope-aware e4m3 rows ``[N, 1, L, P, 1, padded_depth + 2 * rope_dim]``
        with ``scales [N, 1, L, P, 1, 1]`` float32 (None for 16-bit caches)."""
        dt, d = self.dtype, self.latent_dim
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                         (1, 1, 1), (BM, BN // 2))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                                         (1, 1, 1), (BM, self.v_dim // 2))
        k_rows = self.k_op.row_view(blocks, layer_idx)
        per_copy = self.k_op.rows_per_copy
        tma_r = g_r = s_slot_r = k_scales = None
        if cutlass.const_expr(self.rope_dim):  # e4m3 content (bytes [0, padded_depth)), bf16 rope behind it
            tma_k, g_k, s_slot = tma_tiles.create_tma_tile(k_rows, per_copy, self.padded_depth)
            tma_r, g_r, s_slot_r = tma_tiles.create_rope_tma_tile(blocks, 0, layer_idx, self.padded_depth,
                                                                  self.rope_dim, per_copy)
            k_scales = self.k_op.scale_view(scales, layer_idx)
        else:
            tma_k, g_k, s_slot = tma_tiles.create_tma_tile(k_rows, per_copy, d)
        grid = (m_blocks, num_splits, cache_lengths.shape[0])
        self.kernel(tiled_mma_qk, tiled_mma_pv, tma_k, g_k, s_slot, tma_r, g_r, s_slot_r, k_scales, q, out, lse,
                    o_part, lse_part, sinks, input_row_offsets, cache_lengths, lookup_table,
                    self.k_op.rows_per_page(blocks), k_rows.shape[0],
                    num_splits, causal, window, score_scale, softmax_scale_log2).launch(
            grid=grid, block=(THREADS, 1, 1), smem=self.smem_bytes(), stream=stream, min_blocks_per_mp=1)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, tma_k: cute.CopyAtom,
               g_k: cute.Tensor, s_slot: cute.ComposedLayout, tma_r: Optional[cute.CopyAtom],
               g_r: Optional[cute.Tensor], s_slot_r: Optional[cute.ComposedLayout], k_scales: Optional[cute.Tensor],
               q: cute.Tensor, out: cute.Tensor,
               lse: Optional[cute.Tensor], o_part: cute.Tensor, lse_part: cute.Tensor, sinks: Optional[cute.Tensor],
               input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
               rows_per_page: Int32, oob_row: Int32, num_splits: Int32, causal: Int32, window: Int32,
               score_scale: Float32, softmax_scale_log2: Float32):
        dt, d, group = self.dtype, self.latent_dim, self.group
        m_block, split, b = cute.arch.block_idx()
        q_start, seq_len = request_rows(input_row_offsets, b, q.shape[0])  # (unchecked offsets stay inside q)
        m0 = m_block * BM
        if m0 < seq_len * group:  # the CTA has query rows (uniform: the whole CTA leaves otherwise)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_k)
                if cutlass.const_expr(self.rope_dim):
                    cpasync.prefetch_descriptor(tma_r)
            cache_len = Int32(cache_lengths[b])
            num_keys = cache_len + seq_len
            first_tile, n_tiles = split_tiles(m0, seq_len, cache_len, num_keys, causal, window, split, num_splits,
                                              BM, BN, group)
            last_tile = first_tile + n_tiles - 1  # walked from here down to first_tile

            smem = SmemAllocator()
            mbars = smem.allocate_array(cutlass.Int64, 2 * STAGES)
            if cutlass.const_expr(self.rope_dim):
                mbars_landed = smem.allocate_array(cutlass.Int64, STAGES)
            s_max = smem.allocate_tensor(Float32, cute.make_layout((BM, 2)), byte_alignment=16)
            s_sum = smem.allocate_tensor(Float32, cute.make_layout((BM, 2)), byte_alignment=16)
            q_layout = tma_tiles.smem_tile_layout(dt, BM, d)
            ring_layout = tma_tiles.smem_tile_layout(dt, BN, d, stages=STAGES)
            p_layout = tma_tiles.smem_tile_layout(dt, BM, BN)
            s_q = smem.allocate_tensor(dt, q_layout.outer, byte_alignment=1024, swizzle=q_layout.inner)
            ring = smem.allocate(cute.cosize(ring_layout.outer) * dt.width // 8, byte_alignment=1024)
            s_k = tma_tiles.swizzled_tile(ring, ring_layout, dt)
            s_p = smem.allocate_tensor(dt, p_layout.outer, byte_alignment=1024, swizzle=p_layout.inner)
            if cutlass.const_expr(self.rope_dim):
                # TMA -> each stage's upper content bytes (e4m3) and rope columns -> producer warpgroup -> the stage
                if warp_idx == 0:
                    with cute.arch.elect_one():
                        for s in cutlass.range_constexpr(STAGES):
                            cute.arch.mbarrier_init(mbars_landed + s, 1)
                    cute.arch.mbarrier_init_fence()
                s_c = tma_tiles.swizzled_tile(ring + BN * self.padded_depth, self.landing_layout(),
                                              cutlass.Float8E4M3FN)
                pipe = pipeline.PipelineAsync.create(
                    barrier_storage=mbars, num_stages=STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, WG_THREADS),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * WG_THREADS))
            else:
                pipe = pipeline.PipelineTmaAsync.create(
                    barrier_storage=mbars, num_stages=STAGES,
                    producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                    consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 2 * WG_THREADS // 32),
                    tx_count=BN * d * dt.width // 8, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if cutlass.const_expr(self.rope_dim):
                    self.produce_rope(pipe, mbars_landed, tma_k, g_k, s_c, s_slot, tma_r, g_r, s_slot_r, s_k,
                                      ring, k_scales, lookup_table, b, num_keys, rows_per_page, oob_row, last_tile,
                                      n_tiles, warp_idx)
                elif warp_idx == 0:
                    self.produce(pipe, tma_k, g_k, s_k, s_slot, lookup_table, b, num_keys, rows_per_page, oob_row,
                                 last_tile, n_tiles)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                self.consume(tiled_mma_qk, tiled_mma_pv, pipe, s_q, s_k, s_p, s_max, s_sum, q, out, lse, o_part,
                             lse_part, sinks, warp_idx // 4 - 1, q_start, seq_len, cache_len, num_keys, m0, split,
                             num_splits, causal, window, last_tile, n_tiles, score_scale, softmax_scale_log2)

    @cute.jit
    def produce(self, pipe: pipeline.PipelineTmaAsync, tma_k: cute.CopyAtom, g_k: cute.Tensor, s_k: cute.Tensor,
                s_slot: cute.ComposedLayout, lookup_table: cute.Tensor, b: Int32, num_keys: Int32,
                rows_per_page: Int32, oob_row: Int32, last_tile: Int32, n_tiles: Int32):
        """Warp 0: each tile's rows, last to first; the next tile's lookup entries are read right after this
        tile's copies are issued, so their latency hides behind the wait for a free stage."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
        if n_tiles > 0:
            self.k_op.populate(rows, lookup_table, b, last_tile * BN, num_keys, rows_per_page, oob_row)
        for i in cutlass.range(n_tiles, unroll=1):
            pipe.producer_acquire(state)
            tma_tiles.copy_page_slots(tma_k, g_k, s_k[None, None, state.index], s_slot, rows,
                                      self.k_op.rows_per_copy, 0, pipe.producer_get_barrier(state))
            pipe.producer_commit(state)
            if i + 1 < n_tiles:
                self.k_op.populate(rows, lookup_table, b, (last_tile - i - 1) * BN, num_keys, rows_per_page, oob_row)
            state.advance()

    def landing_layout(self) -> cute.Layout:
        """The e4m3 ``(BN, padded_depth, STAGES)`` tiles TMA lands, in the 128-byte swizzle, one per bf16 stage
        (a stage's stride is the bf16 stage's bytes)."""
        tile = tma_tiles.smem_tile_layout(cutlass.Float8E4M3FN, BN, self.padded_depth)
        stages = cute.make_layout(STAGES, stride=BN * self.latent_dim * self.dtype.width // 8)
        return cute.make_composed_layout(tile.inner, 0, cute.make_layout(
            (*tile.outer.shape, STAGES), stride=(*tile.outer.stride, stages.stride)))

    @cute.jit
    def produce_rope(self, pipe: pipeline.PipelineAsync, mbars_landed: cute.Pointer, tma_k: cute.CopyAtom,
                     g_k: cute.Tensor, s_c: cute.Tensor, s_slot: cute.ComposedLayout, tma_r: cute.CopyAtom,
                     g_r: cute.Tensor, s_slot_r: cute.ComposedLayout, s_k: cute.Tensor, ring: cute.Pointer,
                     k_scales: cute.Tensor, lookup_table: cute.Tensor, b: Int32, num_keys: Int32,
                     rows_per_page: Int32, oob_row: Int32, last_tile: Int32, n_tiles: Int32, warp_idx: Int32):
        """The producer warpgroup over a rope-aware FP8 cache, each tile last to first: once the consumers have
        released its stage, warp 0 issues the tile's content and rope copies on the stage's landed barrier; every
        thread reads the scales of its rows meanwhile, waits for the bytes, dequantizes its share into the stage and
        arrives on the stage's full barrier. Only the first tile walked may hold rows past the request's keys: a
        uniform branch gives it the dequantization that clears them, the others one without a check."""
        tidx = cute.arch.thread_idx()[0]
        per_copy = self.k_op.rows_per_copy
        write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        landed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        rows = cute.make_rmem_tensor((self.k_op.copies_per_tile,), Int32)
        scale = cute.make_rmem_tensor((BN // DEQUANT_STEP,), Float32)
        for i in cutlass.range(n_tiles, unroll=1):
            tile_base = (last_tile - i) * BN
            self.k_op.populate(rows, lookup_table, b, tile_base, num_keys, rows_per_page, oob_row)
            pipe.producer_acquire(write)
            bar = mbars_landed + write.index
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar, BN * self.row_bytes)
                tma_tiles.copy_page_slots(tma_k, g_k, s_c[None, None, write.index], s_slot, rows, per_copy, 0, bar)
                rope = cute.local_tile(s_k[None, None, write.index], (BN, self.rope_dim),
                                       (0, self.padded_depth // self.rope_dim))
                tma_tiles.copy_page_slots(tma_r, g_r, rope, s_slot_r, rows, per_copy, 0, bar)
            self.row_scales(scale, k_scales, rows, tidx)
            cute.arch.mbarrier_wait(bar, landed.phase)
            if tile_base + BN > num_keys:
                self.dequantize(ring, write.index, scale, tile_base, num_keys, tidx, True)
            else:
                self.dequantize(ring, write.index, scale, tile_base, num_keys, tidx, False)
            cute.arch.fence_view_async_shared()  # read by wgmma next
            pipe.producer_commit(write)
            write.advance()
            landed.advance()

    @cute.jit
    def row_scales(self, scale: cute.Tensor, k_scales: cute.Tensor, rows: cute.Tensor, tidx: Int32):
        """The scales of this thread's rows of the tile (``dequantize``'s), by the tile's ``populate`` rows (a row
        outside the cache scales by 0)."""
        per_copy = self.k_op.rows_per_copy
        for j in cutlass.range_constexpr(cute.size(scale)):
            # the pass's page slot is known here: no dynamic index into the rows registers
            row = rows[j * DEQUANT_STEP // per_copy] + j * DEQUANT_STEP % per_copy + tidx // DEQUANT_PER_ROW
            scale[j] = granule_scale(k_scales, row, 0, 0, False)

    @cute.jit
    def dequantize(self, ring: cute.Pointer, stage: Int32, scale: cute.Tensor, tile_base: Int32, num_keys: Int32,
                   tidx: Int32, masked: cutlass.Constexpr[bool]):
        """The landed e4m3 content of ``stage`` -> its bf16 columns ``[0, padded_depth)``, one 128-byte block of
        columns (128 bf16 values a row) at a time, a thread taking 16 bytes of each of its rows (``DEQUANT_*``). The
        bf16 block ``blk`` covers landed blocks ``2 blk - blocks`` and ``2 blk + 1 - blocks``, never a later one: a
        block whose output covers landed bytes (``2 blk + 1 >= blocks``, the upper half) reads two rows a thread,
        then the warpgroup meets before any writes them, so no thread overwrites bytes another has not read (rows of
        earlier blocks were all read before the block's first pass). ``masked``: rows past the request's keys are
        written as zeros (P is 0 there, but their bytes may be NaN). ``x * scale`` is rounded to bf16 once (e4m3 ->
        f16 -> f32 is exact)."""
        raw = cute.make_rmem_tensor((DEQUANT_CHUNK, DEQUANT_HELD), cutlass.Float8E4M3FN)
        for blk in cutlass.range_constexpr(self.padded_depth // FP8_BLOCK):
            for p in cutlass.range_constexpr(self.dequant_passes):
                self.dequant_read(ring, raw, stage, blk, p, tidx)
                if cutlass.const_expr(self.writes_over_landed(blk)):
                    cute.arch.barrier(barrier_id=int(Barrier.DEQUANT), number_of_threads=WG_THREADS)
                self.dequant_write(ring, raw, stage, blk, p, scale, tile_base, num_keys, tidx, masked)

    @property
    def dequant_passes(self) -> int:
        """Passes of ``DEQUANT_HELD`` rows a thread over one 128-byte block of a tile's rows."""
        return BN // DEQUANT_STEP // DEQUANT_HELD

    def writes_over_landed(self, blk: int) -> bool:
        """Whether the bf16 output of landed block ``blk`` covers landed bytes (it covers landed blocks
        ``2 blk - blocks`` and ``2 blk + 1 - blocks``)."""
        return 2 * blk + 1 >= self.padded_depth // FP8_BLOCK

    def ring_chunks(self, ring: cute.Pointer, dtype) -> cute.Tensor:
        """The ring (1024-byte aligned) as ``(16 bytes of dtype, chunk)``: the dequantization's accesses."""
        per_chunk = 128 // dtype.width
        stage_chunks = BN * self.latent_dim * self.dtype.width // 128
        return cute.make_tensor(cute.recast_ptr(ring, dtype=dtype), cute.make_layout((per_chunk,
                                                                                     STAGES * stage_chunks)))

    @cute.jit
    def dequant_read(self, ring: cute.Pointer, raw: cute.Tensor, stage: Int32, blk: cutlass.Constexpr[int],
                     p: cutlass.Constexpr[int], tidx: Int32):
        """Pass ``p`` of block ``blk``: this thread's 16 landed bytes of each of its ``DEQUANT_HELD`` rows. The
        landed tile (``landing_layout``) puts byte chunk ``c`` of row ``r`` of block ``blk`` at chunk ``blk * BN * 8 +
        r * 8 + (c ^ r % 8)``; a thread's rows are ``r0 + 16 j`` and its chunk ``c`` fixed, so its chunks are one
        offset of its own plus constants."""
        chunks = self.ring_chunks(ring, cutlass.Float8E4M3FN)
        r0, c = tidx // DEQUANT_PER_ROW, tidx % DEQUANT_PER_ROW
        own = stage * (BN * self.latent_dim // VEC) + r0 * DEQUANT_PER_ROW + (c ^ r0 % 8)
        for h in cutlass.range_constexpr(DEQUANT_HELD):
            j = p * DEQUANT_HELD + h
            cute.autovec_copy(chunks[None, own + (BN * self.padded_depth + blk * BN * FP8_BLOCK) // DEQUANT_CHUNK +
                                     j * DEQUANT_STEP * DEQUANT_PER_ROW], raw[None, h])

    @cute.jit
    def dequant_write(self, ring: cute.Pointer, raw: cute.Tensor, stage: Int32, blk: cutlass.Constexpr[int],
                      p: cutlass.Constexpr[int], scale: cute.Tensor, tile_base: Int32, num_keys: Int32, tidx: Int32,
                      masked: cutlass.Constexpr[bool]):
        """Pass ``p`` of block ``blk``: ``raw * scale`` of this thread's rows as bf16 (``masked``: the bytes and the
        scale of rows past the keys cleared first, so they convert to zeros, whatever their slots hold; no
        branch)."""
        vals = cute.make_rmem_tensor((DEQUANT_CHUNK,), self.dtype)
        for h in cutlass.range_constexpr(DEQUANT_HELD):
            if cutlass.const_expr(masked):
                self.clear_past_keys(raw, scale, p, h, tile_base, num_keys, tidx)
            vals.store((raw[None, h].load().to(Float32) * scale[p * DEQUANT_HELD + h]).to(self.dtype))
            self.dequant_store(ring, vals, stage, blk, p, h, tidx)

    @cute.jit
    def clear_past_keys(self, raw: cute.Tensor, scale: cute.Tensor, p: cutlass.Constexpr[int],
                        h: cutlass.Constexpr[int], tile_base: Int32, num_keys: Int32, tidx: Int32):
        """The held bytes and the scale of this thread's row ``h`` of pass ``p`` ANDed with zeros if the row is past
        the request's keys (with ones otherwise): no branch."""
        keep = Uint32(0) - Uint32(tile_base + dequant_row(p, h, tidx) < num_keys)  # all ones or zero
        words = cute.recast_tensor(raw[None, h], Uint32)
        for w in cutlass.range_constexpr(cute.size(words)):
            words[w] = words[w] & keep
        scale_bits = cute.recast_tensor(scale, Uint32)
        scale_bits[p * DEQUANT_HELD + h] = scale_bits[p * DEQUANT_HELD + h] & keep

    @cute.jit
    def dequant_store(self, ring: cute.Pointer, vals: cute.Tensor, stage: Int32, blk: cutlass.Constexpr[int],
                      p: cutlass.Constexpr[int], h: cutlass.Constexpr[int], tidx: Int32):
        """The 16 bf16 ``vals`` of this thread's row ``h`` of pass ``p`` into the stage's columns of the bytes read
        (two 16-byte stores). The stage (``smem_tile_layout``: 64-column boxes of ``BN`` 128-byte rows) puts chunk
        ``k`` of row ``r`` of box ``x`` at chunk ``x * BN * 8 + r * 8 + (k ^ r % 8)``; the thread's 16 values are
        chunks ``2 (c % 4)`` and ``2 (c % 4) + 1`` of box ``2 blk + c // 4``."""
        chunks = self.ring_chunks(ring, self.dtype)
        r0, c = tidx // DEQUANT_PER_ROW, tidx % DEQUANT_PER_ROW
        row = stage * (BN * self.latent_dim // VEC) + (c // 4) * BN * 8 + r0 * 8
        for half in cutlass.range_constexpr(2):
            own = row + ((c % 4 * 2 + half) ^ r0 % 8)
            cute.autovec_copy(cute.local_tile(vals, (VEC,), (half,)),
                              chunks[None, own + 2 * blk * BN * 8 + dequant_row(p, h, 0) * 8])

    @cute.jit
    def consume(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, pipe: pipeline.PipelineTmaAsync,
                s_q: cute.Tensor, s_k: cute.Tensor, s_p: cute.Tensor, s_max: cute.Tensor, s_sum: cute.Tensor,
                q: cute.Tensor, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor,
                lse_part: cute.Tensor, sinks: Optional[cute.Tensor], wg: Int32, q_start: Int32, seq_len: Int32,
                cache_len: Int32, num_keys: Int32, m0: Int32, split: Int32, num_splits: Int32, causal: Int32,
                window: Int32, last_tile: Int32, n_tiles: Int32, score_scale: Float32, softmax_scale_log2: Float32):
        """Consumer warpgroup ``wg``: S over keys ``[32 wg, 32 wg + 32)`` of each tile, O over value columns
        ``[v_dim/2 wg, v_dim/2 (wg + 1))``, of the CTA's 64 rows."""
        d, dv, group = self.latent_dim, self.v_dim, self.group
        tidx = cute.arch.thread_idx()[0] % WG_THREADS
        self.load_q(s_q, q, q_start, seq_len, m0, tidx + wg * WG_THREADS)

        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        t_rq = tiled_mma_qk.make_fragment_A(thr_qk.partition_A(s_q))
        t_rk = tiled_mma_qk.make_fragment_B(thr_qk.partition_B(cute.local_tile(s_k, (BN // 2, d, STAGES), (wg, 0, 0))))
        s_vt = cute.composition(s_k, cute.make_ordered_layout((d, BN, STAGES), order=(1, 0, 2)))
        t_rv = tiled_mma_pv.make_fragment_B(thr_pv.partition_B(cute.local_tile(s_vt, (dv // 2, BN, STAGES),
                                                                               (wg, 0, 0))))
        t_rp = tiled_mma_pv.make_fragment_A(thr_pv.partition_A(s_p))
        t_sp = thr_qk.partition_C(cute.local_tile(s_p, (BM, BN // 2), (0, wg)))  # where this half of P goes
        acc_o = cute.make_rmem_tensor(thr_pv.partition_shape_C((BM, dv // 2)), Float32)
        acc_o.fill(0.0)
        acc_s = cute.make_rmem_tensor(thr_qk.partition_shape_C((BM, BN // 2)), Float32)
        # (row, key) of each S register, and the key range of each of the thread's rows
        coords = softmax.mn_view(thr_qk.partition_C(cute.make_identity_tensor((BM, BN // 2))))
        n_rows = cute.size(coords, mode=[0])
        row_begin = cute.make_rmem_tensor((n_rows,), Int32)
        row_end = cute.make_rmem_tensor((n_rows,), Int32)
        row_key_ranges(row_begin, row_end, coords, m0, seq_len, cache_len, num_keys, causal, window, group)

        row_max = cute.make_rmem_tensor((n_rows,), Float32)
        row_sum = cute.make_rmem_tensor((n_rows,), Float32)
        row_scale = cute.make_rmem_tensor((n_rows,), Float32)
        row_max.fill(softmax.NEG_INF)
        row_sum.fill(0.0)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        args = (tiled_mma_qk, tiled_mma_pv, pipe, acc_s, acc_o, t_rq, t_rk, t_rp, t_rv, t_sp, s_k, s_max, coords,
                row_begin, row_end, row_max, row_sum, row_scale, last_tile, num_keys, wg, tidx, score_scale,
                softmax_scale_log2)
        if n_tiles > 0:
            self.step(Int32(0), read, True, True, *args)
            # Three loops, so the steady state has no branch: the tiles past the first whose keys some live row does
            # not see (the causal edge, the keys' end), those every live row sees whole, and the window's start.
            masked_end, unmasked_stop = mask_loops(m0, seq_len, cache_len, num_keys, causal, window, last_tile,
                                                   n_tiles, BM, BN, group)
            for i in cutlass.range(1, masked_end, unroll=1):
                read = self.step(i, read, True, False, *args)
            for i in cutlass.range(masked_end, unmasked_stop, unroll=1):
                read = self.step(i, read, False, False, *args)
            for i in cutlass.range(unmasked_stop, n_tiles, unroll=1):
                read = self.step(i, read, True, False, *args)
            if cutlass.const_expr(self.pv_overlap):
                self.gemm(tiled_mma_pv, acc_o, t_rp, t_rv[None, None, None, read.index], True)  # the last tile's PV
                warpgroup.wait_group(0)
                pipe.consumer_release(read)
        self.epilogue(thr_pv, acc_o, row_max, row_sum, s_sum, softmax_scale_log2, coords, out, lse, o_part,
                      lse_part, sinks, q_start, seq_len, m0, split, num_splits, tidx, wg)

    @cute.jit
    def step(self, i: Int32, read: pipeline.PipelineState, masked: cutlass.Constexpr[bool],
             first: cutlass.Constexpr[bool], tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
             pipe: pipeline.PipelineTmaAsync, acc_s: cute.Tensor, acc_o: cute.Tensor, t_rq: cute.Tensor,
             t_rk: cute.Tensor, t_rp: cute.Tensor, t_rv: cute.Tensor, t_sp: cute.Tensor, s_k: cute.Tensor,
             s_max: cute.Tensor, coords: cute.Tensor, row_begin: cute.Tensor, row_end: cute.Tensor,
             row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor, last_tile: Int32, num_keys: Int32,
             wg: Int32, tidx: Int32, score_scale: Float32, softmax_scale_log2: Float32) -> pipeline.PipelineState:
        """Tile ``last_tile - i``: this warpgroup's QK, its scores, the maxima exchange, the exponentials and its half
        of P, then the PV of the whole tile into its half of O. Without ``pv_overlap`` the PV is issued and waited
        for at the end, and the tile's stage released. With it, the previous tile's PV is issued behind this QK and
        runs through the softmax; once both warpgroups' are done (``Barrier.PV``) that tile's stage is released, O
        rescaled and P written over the one P tile, and this tile's PV is issued by the next step (or after the
        loop). Returns the read state of the tile."""
        behind = self.pv_overlap and not first  # the previous tile's PV runs behind this QK
        if cutlass.const_expr(behind):
            prev = read.clone()
        if cutlass.const_expr(not first):
            read.advance()
        pipe.consumer_wait(read)
        self.gemm(tiled_mma_qk, acc_s, t_rq, t_rk[None, None, None, read.index], False)
        if cutlass.const_expr(behind):
            self.gemm(tiled_mma_pv, acc_o, t_rp, t_rv[None, None, None, prev.index], True)
        warpgroup.wait_group(1 if behind else 0)  # this QK
        tile_base = (last_tile - i) * BN
        softmax.scores(acc_s, coords, row_begin, row_end, tile_base + wg * (BN // 2), score_scale, self.softcap,
                       masked)
        n_rows = cute.size(row_max)
        new_max = cute.make_rmem_tensor((n_rows,), Float32)
        softmax.tile_row_max(acc_s, row_max, new_max, first)
        if tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                s_max[coords[r, 0][0], wg] = new_max[r]
        self.pair_barrier(Barrier.MAX)
        for r in cutlass.range_constexpr(n_rows):
            new_max[r] = cute.arch.fmax(new_max[r], s_max[coords[r, 0][0], 1 - wg])
        softmax.exponentiate(acc_s, new_max, row_max, row_sum, row_scale, softmax_scale_log2, first)
        # both QKs have read the stage: its V rows past the keys may be zeroed (a rope-aware tile's are written 0)
        if cutlass.const_expr(first and not self.rope_dim):
            if tile_base + BN > num_keys:
                self.zero_stale_rows(s_k, read.index, num_keys - tile_base, wg, tidx)
        p16 = cute.make_rmem_tensor(acc_s.shape, self.dtype)
        softmax.to_16bit(acc_s, p16)
        if cutlass.const_expr(behind):
            warpgroup.wait_group(0)  # the previous PV; once the other warpgroup's is done too, the P tile is free
            self.pair_barrier(Barrier.PV)
            # The stage's empty barrier counts every consumer warp, so releasing it before the barrier would gain
            # only the barrier's latency; after it, lane 0's arrive follows a warp-wide sync, not only the other
            # lanes' reads of the maxima (wgmma.wait_group syncs the warp's execution, not its memory accesses).
            pipe.consumer_release(prev)
        if cutlass.const_expr(not first):
            softmax.rescale_rows(acc_o, row_scale)
        t_sp.store(p16.load())
        cute.arch.fence_view_async_shared()  # read by wgmma next
        self.pair_barrier(Barrier.P)
        if cutlass.const_expr(not self.pv_overlap):
            self.gemm(tiled_mma_pv, acc_o, t_rp, t_rv[None, None, None, read.index], True)
            warpgroup.wait_group(0)  # the stage is free; the P tile too, once both warpgroups meet on Barrier.MAX
            pipe.consumer_release(read)
        return read

    @cute.jit
    def gemm(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, t_ra: cute.Tensor, t_rb: cute.Tensor,
             accumulate: cutlass.Constexpr[bool]):
        """Issue ``acc (+)= A B`` over the k blocks (no wait). A fresh atom per call: its accumulate flag is set
        here, and an atom shared across the loop's regions would carry the flag out of them."""
        atom = cute.make_mma_atom(tiled_mma.op)
        warpgroup.fence()
        atom.set(warpgroup.Field.ACCUMULATE, accumulate)
        for kb in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
            cute.gemm(atom, acc, t_ra[None, None, kb], t_rb[None, None, kb], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def pair_barrier(self, barrier: cutlass.Constexpr[Barrier]):
        cute.arch.barrier(barrier_id=int(barrier), number_of_threads=2 * WG_THREADS)

    @cute.jit
    def load_q(self, s_q: cute.Tensor, q: cute.Tensor, q_start: Int32, seq_len: Int32, m0: Int32, ctidx: Int32):
        """Both consumer warpgroups load the CTA's 64 packed rows of ``q`` into the swizzled Q tile, 16 bytes a
        thread at a time (rows past the request are 0)."""
        chunks = self.latent_dim // VEC
        vals = cute.make_rmem_tensor((VEC,), self.dtype)
        for j in cutlass.range_constexpr(BM * chunks // (2 * WG_THREADS)):
            idx = ctidx + j * 2 * WG_THREADS
            copy_q_chunk(q, s_q, vals, idx // chunks, idx % chunks, m0, q_start, seq_len, 0, self.group)
        cute.arch.fence_view_async_shared()  # read by wgmma next
        self.pair_barrier(Barrier.MAX)

    @cute.jit
    def zero_stale_rows(self, s_k: cute.Tensor, stage: Int32, first_row: Int32, wg: Int32, tidx: Int32):
        """Rows ``[first_row, BN)`` of ``stage`` (past the request's keys) in this warpgroup's value columns."""
        chunks = self.v_dim // 2 // VEC
        zeros = cute.make_rmem_tensor((VEC,), self.dtype)
        zeros.fill(0.0)
        for idx in cutlass.range(tidx, BN * chunks, WG_THREADS, unroll=1):
            if idx // chunks >= first_row:
                cute.autovec_copy(zeros, cute.local_tile(s_k[idx // chunks, None, stage], (VEC,),
                                                         (wg * chunks + idx % chunks,)))
        cute.arch.fence_view_async_shared()

    @cute.jit
    def epilogue(self, thr_pv: cute.ThrMma, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                 s_sum: cute.Tensor, softmax_scale_log2: Float32, coords: cute.Tensor, out: cute.Tensor,
                 lse: Optional[cute.Tensor], o_part: cute.Tensor, lse_part: cute.Tensor,
                 sinks: Optional[cute.Tensor], q_start: Int32, seq_len: Int32, m0: Int32, split: Int32,
                 num_splits: Int32, tidx: Int32, wg: Int32):
        """The rows' sums over both warpgroups' keys, the sink (split 0 only), ``O / l`` and the base-2 ``lse``;
        then this warpgroup's half of each row to ``out`` (16-bit pairs) or to the float32 partial. Warpgroup 0
        writes the ``lse``."""
        dv, group = self.v_dim, self.group
        n_rows = cute.size(row_max)
        own = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            own[r] = softmax.quad_sum(row_sum[r])
            if tidx % 4 == 0:
                s_sum[coords[r, 0][0], wg] = own[r]
        self.pair_barrier(Barrier.MAX)
        inv = cute.make_rmem_tensor((n_rows,), Float32)
        lse2 = cute.make_rmem_tensor((n_rows,), Float32)
        for r in cutlass.range_constexpr(n_rows):
            sink = softmax.NEG_INF
            if cutlass.const_expr(self.sinks):
                if split == 0:  # the sink joins the denominator once
                    sink = Float32(sinks[(m0 + coords[r, 0][0]) % group]) * LOG2E
            inv[r], lse2[r] = softmax.finish_row(own[r] + s_sum[coords[r, 0][0], 1 - wg],
                                                 row_max[r] * softmax_scale_log2, sink, self.sinks)
        softmax.rescale_rows(acc_o, inv)
        o_coords = softmax.mn_view(thr_pv.partition_C(cute.make_identity_tensor((BM, dv // 2))))
        o_mn = softmax.mn_view(acc_o)
        col0 = wg * (dv // 2)
        for r in cutlass.range_constexpr(n_rows):
            packed = m0 + o_coords[r, 0][0]
            tok = packed // group
            if tok < seq_len:
                if num_splits == 1:
                    dst = out[q_start + tok, packed % group, None]
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                        pair = cute.make_rmem_tensor((2,), self.dtype)
                        pair[0] = o_mn[r, 2 * c].to(self.dtype)
                        pair[1] = o_mn[r, 2 * c + 1].to(self.dtype)
                        cute.autovec_copy(pair, cute.local_tile(dst, (2,), ((col0 + o_coords[0, 2 * c][1]) // 2,)))
                else:
                    dst = o_part[split, q_start + tok, packed % group, None]
                    for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1]) // 2):
                        pair = cute.make_rmem_tensor((2,), Float32)
                        pair[0] = o_mn[r, 2 * c]
                        pair[1] = o_mn[r, 2 * c + 1]
                        cute.autovec_copy(pair, cute.local_tile(dst, (2,), ((col0 + o_coords[0, 2 * c][1]) // 2,)))
        if wg == 0 and tidx % 4 == 0:
            for r in cutlass.range_constexpr(n_rows):
                packed = m0 + o_coords[r, 0][0]
                tok = packed // group
                if tok < seq_len:
                    if num_splits == 1:
                        if cutlass.const_expr(self.return_lse):
                            lse[q_start + tok, packed % group] = lse2[r] * Float32(math.log(2.0))
                    else:
                        lse_part[split, q_start + tok, packed % group] = lse2[r]


@cute.jit
def dequant_row(p: cutlass.Constexpr[int], h: cutlass.Constexpr[int], tidx: Int32) -> Int32:
    """Row of a tile a dequantizing thread takes as its ``h``-th of pass ``p`` (the ``j``-th, ``j = p * HELD + h``,
    of ``row_scales``)."""
    return (p * DEQUANT_HELD + h) * DEQUANT_STEP + tidx // DEQUANT_PER_ROW
