"""``FusedQKVGemmW4Sm100``: the fused-QKV GEMM with quantized weights on SM100 (``tcgen05.mma``, TMEM accumulator).

The SM90 route (``w4.py``) decodes the weight straight into ``wgmma``'s register A operand; ``tcgen05.mma`` reads A
from shared or tensor memory only, so on SM100 dedicated transform warps write the decoded bf16 operand where the
MMA reads it. A persistent, warp-specialized kernel (320 threads, one 128 x 256 tile of ``C^T``, weight rows x
tokens, at a time, static round-robin over the tiles):

* warp 5 (load) TMAs each k-tile's packed weight bytes and scale strip (the ``w4.prepare_weight`` repack, unchanged:
  the same blob and strip the SM90 kernel reads) and the 256-token hidden tile (bf16, 128-byte swizzle) into a
  3-stage ring;
* warps 6-9 (transform, 128 threads) wait for a stage, read thread ``t``'s words and strip words from shared memory
  exactly as an SM90 warpgroup thread does, give the stage back, decode with the SM90 decode
  (``w4.decode_format``: the same ``decode_k16``, so the same bits: int4 ``bf16((q - z) * s)`` rounded once, e4m3
  exact) and store each bf16 pair at its (weight row, k) in a 128-byte-swizzled K-major A stage (2 stages; no bank
  conflicts: a warp's 8 rows land in 8 distinct 16-byte chunks), then fence the async proxy and hand it to the MMA;
* warp 4 (MMA) issues ``tcgen05.mma`` 128 x 256 x 16 (A: the decoded weights, B: the hidden tile, both from shared
  memory) into one of two 256-column TMEM accumulators (all 512 columns), so the epilogue drains one tile while
  the next accumulates;
* warps 0-3 (epilogue) take the tile as two 128-token epilogue tiles (one when the step has no tokens past the
  first 128: decode steps): each thread reads the accumulator row of its TMEM lane (a weight row) 32 tokens at a
  time, stages it transposed (fp8 weights: times the row's float32 per-channel scale) into the float32 tile of
  ``kernels/qkv/epilogue.py`` and runs that epilogue's hooks (``TransposedQKVEpilogueMixin``, shared with SM90).

Why 256 tokens per tile: the transform warps issue ~2 instructions per weight (~220 per thread and k-tile, one warp
per SM sub-partition), while a 128 x 128 x 64 MMA k-tile takes ~256 cycles on a B200 SM (static estimate from the
tensor-core rate, not measured): at 128 tokens the decode alone would fill nearly every issue slot of its
sub-partition. At 256 tokens a decoded k-tile serves twice the MMA work, the decode taking under half the MMA time.

Why the decoded operand goes to shared memory, not TMEM (CUTLASS's SM100 mixed-input mainloop offers both; A
from TMEM is ``tcgen05.mma``'s ``.ts`` form): TMEM is taken by the two 256-column accumulators, and ``tcgen05.st``
lets warp ``w`` write only TMEM lanes ``32 * (w % 4)`` onward, one lane per weight row, so each warp would have to
own 32 whole rows, while the repack's fragment order gives a warp 16 rows of each 64-row block (rows
``16 w + (t % 32) // 4 (+ 8)``): a TMEM route needs a second repack (and its replay tests) or a shuffle per
register. The shared-memory stage keeps the repack and the decode byte for byte with the SM90 kernel, costs 16 KB
per decoded stage and one conflict-free 4-byte store per decoded pair (the MMA reads the B stage from shared
memory in any case). quack 0.6.5's ``GemmSm100`` (the bf16 route) has no seam for a producer of the A stage other
than TMA or its cp.async gather (tied to varlen index tensors), hence a kernel of its own, built from shared
pieces (quack's decode formats through ``w4.decode_format``, the project's epilogue and TMEM helpers, CuTe's
pipelines).

Split-K (``split_k``): when the weight x token tiles leave SMs idle (a decode step of Llama-3-8B has 48 weight
tiles for a B200's 148 SMs), each tile's K is split (3 there) and the splits are consecutive persistent tiles, so
they run at once. A split stages its partial as usual, stores its live token rows to its slot of a float32 scratch
and counts on its tile (``combine_splits``, the epilogue's ``arrived_last``); the last split adds the slots in split
order (the same bits whichever is last) and runs the epilogue. Traffic: a partial's round trip of 512 bytes per
token row and split (at most 64 KB per 128-token tile), against the ~85 KB of int4 weights one of Llama-3-8B's
three splits of a weight tile reads. e4m3 weights' column scales multiply each partial (the sum of scaled
partials: within rounding of the reference's scaled sum).

Not yet: 2-CTA (256-row) MMA and multicast clusters, which the bf16 SM100 route has (a weight tile is not shared
across CTAs: each CTA streams its own). GPU correctness and speed are unmeasured.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator

from cute_kv.kernels.archs import BLACKWELL
from cute_kv.kernels.attention.sm100 import tmem_fence_after_sync, tmem_fence_before_sync
from cute_kv.kernels.attention.sm100_common import O_CHUNK, o_copies
from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.qkv.epilogue import EPI_THREADS, VEC, arrived_last
from cute_kv.kernels.qkv.gemm import BN, FusedQKVGemm
from cute_kv.kernels.qkv.w4 import (K_TILE, TILE_TOKENS, QKVW4EpilogueArguments, QKVW4EpilogueParams, QKVW4Spec,
                                    TransposedQKVEpilogueMixin, _fake_operand, _padded, check_spec, decode_format,
                                    prepare_weight)

ARCH = "sm_100a"
EPI_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
LOAD_WARP = 5
TRANSFORM_WARPS = (6, 7, 8, 9)
TRANSFORM_THREADS = 32 * len(TRANSFORM_WARPS)
THREADS = 32 * (max(TRANSFORM_WARPS) + 1)
TOKENS = 2 * TILE_TOKENS  # the MMA's N: a decoded weight k-tile serves 256 tokens (the epilogue takes 128 at a time)
A_STAGES = 2  # decoded bf16 A stages between the transform warps and the MMA
ACC_STAGES = 2  # TMEM accumulators: the epilogue drains one while the MMA fills the other
TMEM_COLUMNS = ACC_STAGES * TOKENS
TMEM_BARRIER_ID = 1  # every thread: barriers initialized, TMEM address published
EPI_BARRIER_ID = 2  # the epilogue warps (the staging tile's barriers)
SMEM_BYTES = 227 * 1024
MAX_STAGES = 6
M64 = BN // 64  # 64-row weight blocks per tile: the repack's unit (one SM90 warpgroup's rows)
MAX_SPLITS = 8  # split-K: at most this many CTAs per output tile
MIN_SPLIT_K_TILES = 4  # nor fewer than this many k-tiles (256 of K) per split: each split pays a partial's round trip


def split_k(tiles: int, k_tiles: int, ctas: int) -> int:
    """Splits of K per output tile when ``tiles`` (weight x token tiles) leave SMs of the ``ctas``-CTA persistent grid
    idle (decode steps: Llama-3-8B's 48 weight tiles on 148 SMs): as many as fill the grid, within ``MAX_SPLITS``
    and ``MIN_SPLIT_K_TILES``, then evened out so that no split is empty."""
    want = min(MAX_SPLITS, ctas // max(tiles, 1), k_tiles // MIN_SPLIT_K_TILES)
    if want <= 1:
        return 1
    per = -(-k_tiles // want)
    return -(-k_tiles // per)


def tile_coords(tile, w_tiles, splits):
    """``(w_tile, x_tile, split)`` of persistent tile ``tile`` (plain integers or DSL values): a tile's splits are
    consecutive, so that they run at once and their partials meet while in L2."""
    wx = tile // splits
    return wx % w_tiles, wx // w_tiles, tile % splits


def k_range(split, splits, k_tiles):
    """``[k0, k1)``: the k-tiles of ``split`` (non-empty for ``split_k``'s counts)."""
    per = (k_tiles + splits - 1) // splits
    return split * per, cutlass.min(split * per + per, k_tiles)


def stages(weight_format: str, epi_bytes: int) -> int:
    """Load ring depth: a stage is the hidden tile and the packed weights and strip; the shared memory the epilogue
    tile and the ``A_STAGES`` decoded tiles leave (1 KB for alignment)."""
    fmt = decode_format(weight_format)
    packed = M64 * 128 * 4 * _words(fmt)
    per_stage = TOKENS * K_TILE * 2 + packed + M64 * (fmt.sf_bytes if fmt.sf_words else 0) + 4 * 8
    decoded = A_STAGES * (BN * K_TILE * 2 + 2 * 8)
    return min(MAX_STAGES, (SMEM_BYTES - epi_bytes - decoded - 1024) // per_stage)


def stage_coord(t, m, b, j):
    """``(row, k)`` in the A stage of the first value of the bf16 pair that transform thread ``t`` decodes into
    register ``j`` of k16 block ``b`` of 64-row block ``m``: the SM90 wgmma A-fragment position the repack orders
    the bytes for (plain integers or DSL values)."""
    return 64 * m + 16 * (t // 32) + (t % 32) // 4 + 8 * (j % 2), 16 * b + 8 * (j // 2) + 2 * (t % 4)


def _words(fmt) -> int:
    """32-bit words thread ``t`` reads per 64-row block and k-tile (16 bytes of int4, 32 of e4m3)."""
    return (8 if fmt.w8 else 4) * (fmt.tile_k // 64)


class W4Sm100Kernel(TransposedQKVEpilogueMixin):
    """The kernel for one ``QKVW4Spec``: host ``__call__`` (TMA descriptors, grid) and the device ``kernel``."""

    def __init__(self, spec: QKVW4Spec):
        self.qkv = spec.qkv
        self.fmt = decode_format(spec.weight_format)
        self.words = _words(self.fmt)
        self.sf_bytes = self.fmt.sf_bytes if self.fmt.sf_words else 0
        # quack's orientation of C^T: mode 0 the weight rows, mode 1 the tokens (the mixin swaps it back)
        self.cta_tile_shape_mnk = (BN, TILE_TOKENS, K_TILE)
        self.num_epi_warps = len(EPI_WARPS)
        self.epilogue_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER_ID, num_threads=EPI_THREADS)
        epi = self.epi_smem_bytes(None, self.cta_tile_shape_mnk, None).unstaged
        self.stages = stages(spec.weight_format, epi)

    @cute.jit
    def __call__(self, blob: cute.Tensor, sf: Optional[cute.Tensor], hidden: cute.Tensor,
                 epi: QKVW4EpilogueArguments, partials: cute.Tensor, split_counters: cute.Tensor, splits: Int32,
                 max_ctas: Int32, stream: cuda.CUstream):
        """``blob`` ``(256, words, m64, n / BN, k-tiles, 1)`` and ``sf`` ``(bytes, m64, n / BN, k-tiles, 1)``: the
        repack's views (``w4._fake_operand``); ``hidden`` ``[T, K]`` bf16. Split-K (``splits`` > 1, ``split_k``):
        ``partials`` float32 ``[slots * 128, BN]``, a slot per (weight tile, 128-token tile, split), and an int32
        arrival counter per (weight tile, 128-token tile), zero between launches."""
        tiled_mma = sm100_utils.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K,
                                                       OperandMajorMode.K, Float32, tcgen05.CtaGroup.ONE,
                                                       (BN, TOKENS))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        packed_box = (256, 2 * self.words, M64)
        tma_w, g_w = cpasync.make_tiled_tma_atom(g2s, blob[None, None, None, None, None, 0],
                                                 cute.make_ordered_layout(packed_box, order=(0, 1, 2)), packed_box)
        tma_sf = g_sf = None
        if cutlass.const_expr(sf is not None):
            sf_box = (self.sf_bytes, M64)
            tma_sf, g_sf = cpasync.make_tiled_tma_atom(g2s, sf[None, None, None, None, 0],
                                                       cute.make_ordered_layout(sf_box, order=(0, 1)), sf_box)
        x_layout = tma_tiles.smem_tile_layout(cutlass.BFloat16, TOKENS, K_TILE)
        tma_x, g_x = cpasync.make_tiled_tma_atom(g2s, hidden, x_layout, (TOKENS, K_TILE))
        w_tiles = blob.shape[3]
        tiles = w_tiles * cute.ceil_div(hidden.shape[0], TOKENS) * splits
        grid = cutlass.min(tiles, max_ctas)
        self.kernel(tiled_mma, tma_w, g_w, tma_sf, g_sf, tma_x, g_x, epi, partials, split_counters, splits, w_tiles,
                    tiles).launch(
            grid=(grid, 1, 1), block=(THREADS, 1, 1), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_w: cute.CopyAtom, g_w: cute.Tensor,
               tma_sf: Optional[cute.CopyAtom], g_sf: Optional[cute.Tensor], tma_x: cute.CopyAtom,
               g_x: cute.Tensor, epi: QKVW4EpilogueArguments, partials: cute.Tensor, split_counters: cute.Tensor,
               splits: Int32, w_tiles: Int32, tiles: Int32):
        params = QKVW4EpilogueParams(*epi)
        n_stages = self.stages
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        first_tile, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        k_tiles = cute.size(g_x, mode=[1]) // K_TILE

        smem = SmemAllocator()
        storage = smem.allocate(cute.struct(type("W4Sm100Storage", (), {"__annotations__": {
            "epi": self.epi_get_smem_struct(params),
            "split_last": cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]}})))  # split-K's verdict
        epi_smem = self.epi_get_smem_tensors(params, storage)
        s_split_last = storage.split_last.get_tensor(cute.make_layout(4))
        load_bars = smem.allocate_array(cutlass.Int64, 2 * n_stages)
        x_bars = smem.allocate_array(cutlass.Int64, 2 * n_stages)
        a_bars = smem.allocate_array(cutlass.Int64, 2 * A_STAGES)
        acc_bars = smem.allocate_array(cutlass.Int64, 2 * ACC_STAGES)
        s_w = smem.allocate_tensor(cutlass.Uint8, cute.make_ordered_layout((256, 2 * self.words, M64, n_stages),
                                                                           order=(0, 1, 2, 3)), byte_alignment=128)
        s_sf = None
        if cutlass.const_expr(tma_sf is not None):
            s_sf = smem.allocate_tensor(cutlass.Uint8, cute.make_ordered_layout((self.sf_bytes, M64, n_stages),
                                                                                order=(0, 1, 2)), byte_alignment=128)
        x_layout = tma_tiles.smem_tile_layout(cutlass.BFloat16, TOKENS, K_TILE, stages=n_stages)
        s_x = smem.allocate_tensor(cutlass.BFloat16, x_layout.outer, byte_alignment=1024, swizzle=x_layout.inner)
        a_layout = tma_tiles.smem_tile_layout(cutlass.BFloat16, BN, K_TILE, stages=A_STAGES)
        s_a = smem.allocate_tensor(cutlass.BFloat16, a_layout.outer, byte_alignment=1024, swizzle=a_layout.inner)

        one_cta = cute.make_layout((1, 1, 1, 1))
        thread = pipeline.Agent.Thread
        w_bytes = 256 * 2 * self.words * M64 + self.sf_bytes * M64
        load_pipe = pipeline.PipelineTmaAsync.create(  # packed weights -> transform warps
            barrier_storage=load_bars, num_stages=n_stages, producer_group=pipeline.CooperativeGroup(thread),
            # consumer_release arrives from one lane of each warp (its signalling lane), as in our SM100 attention
            consumer_group=pipeline.CooperativeGroup(thread, len(TRANSFORM_WARPS)), tx_count=w_bytes,
            cta_layout_vmnk=one_cta, defer_sync=True)
        x_pipe = pipeline.PipelineTmaUmma.create(  # hidden tile -> MMA
            barrier_storage=x_bars, num_stages=n_stages, producer_group=pipeline.CooperativeGroup(thread),
            consumer_group=pipeline.CooperativeGroup(thread), tx_count=TOKENS * K_TILE * 2,
            cta_layout_vmnk=one_cta, defer_sync=True)
        a_pipe = pipeline.PipelineAsyncUmma.create(  # decoded bf16 weights -> MMA
            barrier_storage=a_bars, num_stages=A_STAGES,
            producer_group=pipeline.CooperativeGroup(thread, TRANSFORM_THREADS),
            consumer_group=pipeline.CooperativeGroup(thread), cta_layout_vmnk=one_cta, defer_sync=True)
        acc_pipe = pipeline.PipelineUmmaAsync.create(  # TMEM accumulator -> epilogue warps
            barrier_storage=acc_bars, num_stages=ACC_STAGES, producer_group=pipeline.CooperativeGroup(thread),
            consumer_group=pipeline.CooperativeGroup(thread, EPI_THREADS), cta_layout_vmnk=one_cta,
            defer_sync=True)

        tmem = TmemAllocator(barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_BARRIER_ID,
                                                                        num_threads=THREADS),
                             allocator_warp_id=MMA_WARP)
        tmem.allocate(TMEM_COLUMNS)
        cute.arch.mbarrier_init_fence()
        tmem_fence_before_sync()
        tmem.wait_for_alloc()  # every thread: barriers initialized, TMEM allocated
        tmem_fence_after_sync()
        tmem.relinquish_alloc_permit()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        thr_mma = tiled_mma.get_slice(0)
        t_acc = thr_mma.make_fragment_C(cute.append(thr_mma.partition_shape_C((BN, TOKENS)), ACC_STAGES))
        t_acc = cute.make_tensor(tmem_ptr, t_acc.layout)

        if warp_idx == LOAD_WARP:
            self.load(tma_w, g_w, tma_sf, g_sf, tma_x, g_x, s_w, s_sf, s_x, load_pipe, x_pipe, first_tile, step,
                      tiles, w_tiles, k_tiles, splits)
        if warp_idx >= TRANSFORM_WARPS[0]:
            self.transform(s_w, s_sf, s_a, load_pipe, a_pipe, first_tile, step, tiles, k_tiles, splits)
        if warp_idx == MMA_WARP:
            self.mma(tiled_mma, thr_mma, s_a, s_x, t_acc, a_pipe, x_pipe, acc_pipe, first_tile, step, tiles,
                     k_tiles, splits)
        if warp_idx < MMA_WARP:
            self.epilogue(params, epi_smem, t_acc, acc_pipe, first_tile, step, tiles, w_tiles,
                          (partials, split_counters, splits, s_split_last))
        tmem_fence_before_sync()
        cute.arch.sync_threads()
        tmem_fence_after_sync()
        tmem.free(tmem_ptr)

    @cute.jit
    def load(self, tma_w: cute.CopyAtom, g_w: cute.Tensor, tma_sf: Optional[cute.CopyAtom],
             g_sf: Optional[cute.Tensor], tma_x: cute.CopyAtom, g_x: cute.Tensor, s_w: cute.Tensor,
             s_sf: Optional[cute.Tensor], s_x: cute.Tensor, load_pipe: pipeline.PipelineTmaAsync,
             x_pipe: pipeline.PipelineTmaUmma, first_tile: Int32, step: Int32, tiles: Int32, w_tiles: Int32,
             k_tiles: Int32, splits: Int32):
        """Load warp: per k-tile of the tile's split the packed weights and strip (to the transform warps) and the
        hidden tile (to the MMA), each under its own stage barrier."""
        w_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        x_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        one = cute.make_layout(1)
        for tile in cutlass.range(first_tile, tiles, step, unroll=1):
            w_tile, x_tile, split = tile_coords(tile, w_tiles, splits)
            k0, k1 = k_range(split, splits, k_tiles)
            t_sw, t_gw = cpasync.tma_partition(tma_w, 0, one, cute.group_modes(s_w, 0, 3),
                                               cute.group_modes(g_w[None, None, None, w_tile, None], 0, 3))
            t_ssf = t_gsf = None
            if cutlass.const_expr(tma_sf is not None):
                t_ssf, t_gsf = cpasync.tma_partition(tma_sf, 0, one, cute.group_modes(s_sf, 0, 2),
                                                     cute.group_modes(g_sf[None, None, w_tile, None], 0, 2))
            g_tile = cute.local_tile(g_x, (TOKENS, K_TILE), (x_tile, None))
            t_sx, t_gx = cpasync.tma_partition(tma_x, 0, one, cute.group_modes(s_x, 0, 2),
                                               cute.group_modes(g_tile, 0, 2))
            for kt in cutlass.range(k0, k1, unroll=1):
                load_pipe.producer_acquire(w_write)
                bar = load_pipe.producer_get_barrier(w_write)
                cute.copy(tma_w, t_gw[None, kt], t_sw[None, w_write.index], tma_bar_ptr=bar)
                if cutlass.const_expr(tma_sf is not None):
                    cute.copy(tma_sf, t_gsf[None, kt], t_ssf[None, w_write.index], tma_bar_ptr=bar)
                w_write.advance()
                x_pipe.producer_acquire(x_write)
                cute.copy(tma_x, t_gx[None, kt], t_sx[None, x_write.index],
                          tma_bar_ptr=x_pipe.producer_get_barrier(x_write))
                x_write.advance()
        load_pipe.producer_tail(w_write)
        x_pipe.producer_tail(x_write)

    @cute.jit
    def transform(self, s_w: cute.Tensor, s_sf: Optional[cute.Tensor], s_a: cute.Tensor,
                  load_pipe: pipeline.PipelineTmaAsync, a_pipe: pipeline.PipelineAsyncUmma, first_tile: Int32,
                  step: Int32, tiles: Int32, k_tiles: Int32, splits: Int32):
        """Transform warps: thread ``t`` is SM90 warpgroup thread ``t`` of each 64-row block. Its words and strip
        words come to registers, the stage goes back to the load warp, the SM90 decode makes the 4 bf16x2
        fragment registers of each k16 block, and each pair is stored at rows ``16 * (t // 32) + (t % 32) // 4
        (+ 8)``, k ``16 b + 2 (t % 4) (+ 8)`` of the K-major A stage."""
        t = cute.arch.thread_idx()[0] - 32 * TRANSFORM_WARPS[0]
        nw, sf_words = self.words, self.fmt.sf_words
        s_w32 = cute.make_tensor(cute.recast_ptr(s_w.iterator, dtype=Int32),
                                 cute.make_ordered_layout((nw, 128, M64, self.stages), order=(0, 1, 2, 3)))
        s_sf32 = None
        if cutlass.const_expr(s_sf is not None):
            s_sf32 = cute.recast_tensor(s_sf, Int32)
        pair_slot = (t // 32) * 8 + (t % 32) // 4  # the strip word of the thread's row pair (repack order)
        consts = self.fmt.make_consts()
        xw = cute.make_rmem_tensor((nw, M64), Int32)
        sfw = cute.make_rmem_tensor((2, M64), Int32)
        pair16 = cute.make_rmem_tensor((2,), cutlass.BFloat16)
        pair = cute.recast_tensor(pair16, Int32)
        w_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        a_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, A_STAGES)
        for tile in cutlass.range(first_tile, tiles, step, unroll=1):
            k0, k1 = k_range(tile % splits, splits, k_tiles)
            for _kt in cutlass.range(k0, k1, unroll=1):
                load_pipe.consumer_wait(w_read)
                for m in cutlass.range_constexpr(M64):
                    cute.autovec_copy(s_w32[None, t, m, w_read.index], xw[None, m])
                    for w in cutlass.range_constexpr(sf_words):
                        sfw[w, m] = s_sf32[sf_words * pair_slot + w, m, w_read.index]
                cute.arch.sync_warp()  # every lane's reads of the stage before its warp's one release (lane 0)
                load_pipe.consumer_release(w_read)
                w_read.advance()
                a_pipe.producer_acquire(a_write)
                tile_a = s_a[None, None, a_write.index]
                for m in cutlass.range_constexpr(M64):
                    for b in cutlass.range_constexpr(K_TILE // 16):
                        regs = self.fmt.decode_k16(xw[None, m], sfw[None, m], b, consts)
                        for j in cutlass.range_constexpr(4):
                            pair[0] = regs[j]
                            row, k = stage_coord(t, m, b, j)
                            cute.autovec_copy(pair16, cute.local_tile(tile_a[row, None], (2,), (k // 2,)))
                cute.arch.fence_view_async_shared()  # the generic-proxy stores before the MMA reads the stage
                a_pipe.producer_commit(a_write)
                a_write.advance()
        a_pipe.producer_tail(a_write)

    @cute.jit
    def mma(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, s_a: cute.Tensor, s_x: cute.Tensor,
            t_acc: cute.Tensor, a_pipe: pipeline.PipelineAsyncUmma, x_pipe: pipeline.PipelineTmaUmma,
            acc_pipe: pipeline.PipelineUmmaAsync, first_tile: Int32, step: Int32, tiles: Int32, k_tiles: Int32,
            splits: Int32):
        """MMA warp: ``C^T[w, x] = sum_k W[w, k] X[x, k]``, 4 k16 MMAs per k-tile; a stage of each ring is released
        by the commit of the MMAs that read it, the accumulator by the commit after the tile's last."""
        t_ra = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rx = tiled_mma.make_fragment_B(thr_mma.partition_B(s_x))
        a_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, A_STAGES)
        x_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        acc_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, ACC_STAGES)
        for tile in cutlass.range(first_tile, tiles, step, unroll=1):
            k0, k1 = k_range(tile % splits, splits, k_tiles)
            acc_pipe.producer_acquire(acc_write)
            acc = t_acc[None, None, None, acc_write.index]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _kt in cutlass.range(k0, k1, unroll=1):
                a_pipe.consumer_wait(a_read)
                x_pipe.consumer_wait(x_read)
                for kb in cutlass.range_constexpr(K_TILE // 16):
                    cute.gemm(tiled_mma, acc, t_ra[None, None, kb, a_read.index], t_rx[None, None, kb, x_read.index],
                              acc)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                a_pipe.consumer_release(a_read)
                x_pipe.consumer_release(x_read)
                a_read.advance()
                x_read.advance()
            acc_pipe.producer_commit(acc_write)
            acc_write.advance()
        acc_pipe.producer_tail(acc_write)

    @cute.jit
    def epilogue(self, params: QKVW4EpilogueParams, epi_smem: dict, t_acc: cute.Tensor,
                 acc_pipe: pipeline.PipelineUmmaAsync, first_tile: Int32, step: Int32, tiles: Int32,
                 w_tiles: Int32, split_k: tuple):
        """Epilogue warps: thread ``r`` holds TMEM lane ``r``, weight row ``r`` of the tile. A tile's 256 tokens
        leave as two 128-token epilogue tiles (the second only when it holds rows of the step: not in a decode step);
        the accumulator is released after its last TMEM read, before the last epilogue tile's stores. ``split_k``:
        ``(partials, counters, splits, verdict word)`` (``combine_splits``)."""
        tidx = cute.arch.thread_idx()[0]
        splits = split_k[2]
        acc_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, ACC_STAGES)
        for tile in cutlass.range(first_tile, tiles, step, unroll=1):
            w_tile, x_tile, split = tile_coords(tile, w_tiles, splits)
            scale = None  # e4m3 weights: C[:, n] * s[n], the reference's order
            if cutlass.const_expr(params.column_scales is not None):
                scale = params.column_scales[w_tile * BN + tidx]
            halves = cutlass.min(2, cute.ceil_div(params.output.shape[0] - 2 * x_tile * TILE_TOKENS, TILE_TOKENS))
            acc_pipe.consumer_wait(acc_read)
            tmem_fence_after_sync()
            acc = t_acc[None, None, None, acc_read.index]
            for half in cutlass.range(halves, unroll=1):
                self.drain(params, epi_smem, acc, scale, w_tile, 2 * x_tile + half, half * TILE_TOKENS,
                           half == halves - 1, acc_pipe, acc_read, tidx, split_k, split)
            acc_read.advance()

    @cute.jit
    def drain(self, params: QKVW4EpilogueParams, epi_smem: dict, acc: cute.Tensor, scale: Optional[Float32],
              w_tile: Int32, epi_tile: Int32, col0: Int32, last, acc_pipe: pipeline.PipelineUmmaAsync,
              acc_read: pipeline.PipelineState, tidx: Int32, split_k: tuple, split: Int32):
        """Tokens ``[col0, col0 + 128)`` of the accumulator (128-token epilogue tile ``epi_tile``): this thread's row
        staged as column ``tidx`` of the float32 tile (consecutive lanes, consecutive words), then the bf16 kernel's
        bias / norm / RoPE / store passes (``epi_begin``, ``epi_end``); split-K: by the split that completes the
        sum (``combine_splits``)."""
        coord = (w_tile, epi_tile, None, 0)
        tensors = self.epi_begin(params, epi_smem, None, None, None, coord, None, None, tidx)
        s_c = tensors[0]
        load, _, src, _, shape = o_copies(acc, O_CHUNK)
        vals = cute.make_rmem_tensor(shape, Float32)
        for i in cutlass.range_constexpr(TILE_TOKENS // O_CHUNK):
            cute.copy(load, cute.make_tensor(src.iterator + col0 + i * O_CHUNK, src.layout), vals)
            for j in cutlass.range_constexpr(O_CHUNK):
                if cutlass.const_expr(scale is not None):
                    vals[j] = vals[j] * scale
                s_c[i * O_CHUNK + j, tidx] = vals[j]
        if last:  # the tile's last TMEM read: the MMA may refill the accumulator
            cute.arch.fence_view_async_tmem_load()
            tmem_fence_before_sync()
            acc_pipe.consumer_release(acc_read)
        finishes = cutlass.Boolean(True)
        if split_k[2] > 1:
            finishes = self.combine_splits(s_c, split_k, w_tile, epi_tile, split, params.output.shape[0], tidx)
        if finishes:
            self.epi_end(params, tensors, None, None, None, coord, None, tidx)

    @cute.jit
    def combine_splits(self, s_c: cute.Tensor, split_k: tuple, w_tile: Int32, epi_tile: Int32, split: Int32,
                       num_rows: Int32, tidx: Int32) -> cutlass.Boolean:
        """Split-K: the staged partial's live token rows go to the split's slot of ``partials``; the split that
        arrives last on the tile's counter (``arrived_last``) adds the slots in split order into the staged tile
        (the same bits whichever split is last) and returns True: it runs the epilogue. Thread ``t`` takes the
        8 columns ``8 (t % 16)`` of rows ``t // 16 + 8 i``: 512-byte rows of 16-byte stores."""
        partials, counters, splits, s_last = split_k
        chunks = BN // VEC
        col = (tidx % chunks) * VEC
        rows = cutlass.min(TILE_TOKENS, num_rows - epi_tile * TILE_TOKENS)
        epi_tiles = 2 * cute.ceil_div(num_rows, TOKENS)
        counter = w_tile * epi_tiles + epi_tile
        vals = cute.make_rmem_tensor((VEC,), Float32)
        part = cute.make_rmem_tensor((VEC,), Float32)
        self.epilogue_barrier.arrive_and_wait()  # the whole partial is staged
        for r in cutlass.range(tidx // chunks, rows, EPI_THREADS // chunks, unroll=1):
            cute.autovec_copy(cute.local_tile(s_c[r, None], (VEC,), (col // VEC,)), vals)
            slot_row = (counter * splits + split) * TILE_TOKENS + r
            cute.autovec_copy(vals, cute.local_tile(partials[slot_row, None], (VEC,), (col // VEC,)))
        last = arrived_last(counters.iterator + counter, splits, s_last, tidx, self.epilogue_barrier)
        if last:
            for r in cutlass.range(tidx // chunks, rows, EPI_THREADS // chunks, unroll=1):
                first_row = counter * splits * TILE_TOKENS + r
                cute.autovec_copy(cute.local_tile(partials[first_row, None], (VEC,), (col // VEC,)), vals)
                for k in cutlass.range(1, splits, unroll=1):
                    cute.autovec_copy(cute.local_tile(partials[first_row + k * TILE_TOKENS, None], (VEC,),
                                                      (col // VEC,)), part)
                    for e in cutlass.range_constexpr(VEC):
                        vals[e] = vals[e] + part[e]
                cute.autovec_copy(vals, cute.local_tile(s_c[r, None], (VEC,), (col // VEC,)))
        return last


class FusedQKVGemmW4Sm100:
    """Builds the SM100 quantized-weight kernel for ``spec``; ``build()`` returns ``(kernel, *fake_args)`` for
    ``compile_cache.compiled`` and ``args()`` the launch arguments (the same as ``FusedQKVGemmW4.args``)."""

    compile_name = "fused_qkv_gemm_w4_sm100"
    cluster_shape = (1, 1, 1)  # one CTA's grid slot: the launcher sizes the persistent grid in clusters
    threads = THREADS

    def __init__(self, spec: QKVW4Spec, arch: str = ARCH):
        check_spec(spec, arch, BLACKWELL, "FusedQKVGemmW4Sm100")
        assert decode_format(spec.weight_format).tile_k == K_TILE, "a stage is one 64-deep k-tile of every format"
        self.spec, self.arch = spec, arch

    @property
    def fmt(self):
        return decode_format(self.spec.weight_format)

    def build(self) -> tuple:
        return (W4Sm100Kernel(self.spec), *self.fake_args())

    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

        s = self.spec.qkv
        n = _padded(s.n_total)
        operand = _fake_operand(self.fmt, n)
        hidden, _, _, _, epi, _, _, stream, *_ = FusedQKVGemm(s, self.arch).fake_args()
        col_scales = make_fake_compact_tensor(Float32, (n,), assumed_align=4) if self.spec.column_scales else None
        partials = make_fake_tensor(Float32, (cute.sym_int32(), BN), stride=(BN, 1), assumed_align=16)
        split_counters = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)
        return (operand.blob, operand.sf, hidden, QKVW4EpilogueArguments(*epi, col_scales), partials, split_counters,
                Int32(1), Int32(1), stream)

    def args(self, hidden, weight, output, blocks, input_row_offsets, cache_lengths, lookup_table, layer_idx, bias,
             freqs_cis, q_norm, k_norm, scales, max_active_clusters: int, workspace=None, counters=None,
             value_blocks=None) -> tuple:
        """Launch arguments (torch tensors) in the compiled signature's order; the stream is the current one.
        ``workspace``/``counters``: a last arriver's (``FusedQKVGemm.args``). Split-K's count (``split_k``) and
        scratch (``kernels/qkv/scratch.py``) are chosen here, from the tiles and the grid."""
        from quack.operand_transform.host import w4_operand_views

        from cute_kv.kernels.qkv.scratch import scratch

        blob, sf, col_scales = prepare_weight(weight)
        operand = w4_operand_views(self.fmt, blob, sf, BN)
        epi = QKVW4EpilogueArguments(output, blocks, input_row_offsets, cache_lengths, lookup_table, Int32(layer_idx),
                                     bias, freqs_cis, q_norm, k_norm, scales, workspace, counters, value_blocks,
                                     col_scales)
        w_tiles, epi_tiles = operand.blob.shape[3], 2 * -(-hidden.shape[0] // TOKENS)
        splits = split_k(w_tiles * epi_tiles // 2, hidden.shape[1] // K_TILE, max_active_clusters)
        partials, split_counters = scratch(hidden.device, "split_k", w_tiles * epi_tiles * splits * TILE_TOKENS
                                           if splits > 1 else 1, BN, w_tiles * epi_tiles if splits > 1 else 1)
        return (operand.blob, operand.sf, hidden, epi, partials, split_counters, Int32(splits),
                Int32(max_active_clusters))
