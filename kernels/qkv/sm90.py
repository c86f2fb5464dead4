"""``FusedQKVMatmul`` (SM90): ``C = hidden @ weight^T (+ bias)`` with Q to ``output`` and K/V straight into pages.

MAX's ``generic_fused_qkv_matmul_kv_cache_paged_ragged``. Mainloop: one warpgroup per CTA, a ``(BM, 128)``
output tile, 64-wide K steps fed by TMA through a ``STAGES``-deep ``PipelineTmaAsync`` ring (warp 0 produces,
all four warps consume with wgmma, one MMA batch kept in flight as CUTLASS's Hopper dense GEMM does). Three
stages keep a CTA under half the shared memory, so two CTAs share an SM and one's epilogue overlaps the other's
mainloop (no warp specialization needed for that).

Epilogue: the fp32 accumulator tile is staged in shared memory (reusing the A/B ring), then each thread takes
one 8-column chunk and walks rows: add bias, rotate (RoPE at ``cache_lengths[b] + i``; a neox pair's partner is
``R/2`` columns away, so the host only picks this kernel when every rotated head lies inside one tile), round
once, and store 16 bytes to ``output[m, n:n+8]`` or to ``blocks[page, kv, layer, slot, h, d:d+8]``. The rows'
pages and positions are resolved once per CTA (``ragged_rows``) while the first TMA loads are in flight.
K/V never exist as a dense tensor in global memory.
"""

from __future__ import annotations

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
from cutlass.tensor_utils import LayoutEnum

from cute_kv.kernels.paged.ragged_rows import resolve_rows

THREADS = 128  # one warpgroup
BN, BK, STAGES = 128, 64, 3
VEC = 8  # 16-bit elements per 16-byte store
C_PAD = 4  # fp32 words of padding per staged row: rows start on different banks
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class FusedQKVMatmul:
    """Compile-time key: dtype, the column split (``q_dim``, KVD, H, D), page size, bias, RoPE, tile height.

    ``rope``: ``None`` or ``(rope_dim, interleaved, q_head_dim)``.
    """

    def __init__(self, dtype_name: str, q_dim: int, kv_dim: int, page_size: int, num_heads: int, head_dim: int,
                 has_bias: bool, rope: Optional[tuple[int, bool, int]], tile_m: int):
        self.dtype = DTYPES[dtype_name]
        self.q_dim, self.kv_dim, self.page_size, self.num_heads, self.head_dim = (
            q_dim, kv_dim, page_size, num_heads, head_dim)
        self.n_total = q_dim + kv_dim * num_heads * head_dim
        self.has_bias, self.rope, self.tile_m = has_bias, rope, tile_m
        problem = supported(q_dim, kv_dim, num_heads, head_dim, rope, tile_m)
        if problem:
            raise ValueError(problem)

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        dt, kvd, p, h, d = self.dtype, self.kv_dim, self.page_size, self.num_heads, self.head_dim
        t, k, n, nl, b, cols, positions = (cute.sym_int32() for _ in range(7))
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- TMA and 16-byte stores need aligned rows
        hidden = make_fake_tensor(dt, (t, k), stride=(row(), 1), assumed_align=16)
        weight = make_fake_tensor(dt, (self.n_total, k), stride=(row(), 1), assumed_align=16)
        output = make_fake_tensor(dt, (t, self.q_dim), stride=(row(), 1), assumed_align=16)
        blocks = make_fake_tensor(dt, (n, kvd, nl, p, h, d), stride=(
            cute.sym_int64(divisibility=kvd * p * h * d), cute.sym_int64(divisibility=p * h * d), p * h * d, h * d,
            d, 1), assumed_align=16)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        bias = make_fake_compact_tensor(dt, (self.n_total,), assumed_align=2) if self.has_bias else None
        freqs = None
        if self.rope is not None:
            freqs = make_fake_tensor(Float32, (positions, self.rope[0]), stride=(cute.sym_int64(), 1), assumed_align=4)
        return (hidden, weight, output, blocks, offsets, lengths, lut, bias, freqs, Int32(0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, hidden: cute.Tensor, weight: cute.Tensor, output: cute.Tensor, blocks: cute.Tensor,
                 input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
                 bias: Optional[cute.Tensor], freqs_cis: Optional[cute.Tensor], layer_idx: Int32,
                 stream: cuda.CUstream):
        dt, bm = self.dtype, self.tile_m
        # wgmma's atom is 64 x BN x 16; a 128-row tile repeats it twice in M within the one warpgroup.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                                      (1, 1, 1), (64, BN))
        sa_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (bm, BN, BK), dt, STAGES)
        sb_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (bm, BN, BK), dt, STAGES)
        tma_a, g_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), hidden,
                                                 cute.slice_(sa_layout, (None, None, 0)), (bm, BK))
        tma_b, g_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), weight,
                                                 cute.slice_(sb_layout, (None, None, 0)), (BN, BK))
        grid = (cute.ceil_div(hidden.shape[0], bm), cute.ceil_div(self.n_total, BN), 1)
        self.kernel(tiled_mma, tma_a, g_a, tma_b, g_b, sa_layout, sb_layout, output, blocks, input_row_offsets,
                    cache_lengths, lookup_table, bias, freqs_cis, layer_idx, hidden.shape[0]).launch(
            grid=grid, block=(THREADS, 1, 1), smem=self.smem_bytes(), stream=stream)

    def ring_bytes(self) -> tuple[int, int]:
        """Bytes of the A and B stages of the ring."""
        width = self.dtype.width // 8
        return STAGES * self.tile_m * BK * width, STAGES * BN * BK * width

    def buffer_bytes(self) -> int:
        """The ring, reused after the mainloop for the fp32 accumulator tile."""
        return max(sum(self.ring_bytes()), self.tile_m * (BN + C_PAD) * 4)

    def smem_bytes(self) -> int:
        return self.buffer_bytes() + 1024 + 2 * STAGES * 8 + 2 * self.tile_m * 4 + 64

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, g_a: cute.Tensor, tma_b: cute.CopyAtom,
               g_b: cute.Tensor, sa_layout: cute.ComposedLayout, sb_layout: cute.ComposedLayout,
               output: cute.Tensor, blocks: cute.Tensor, input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor,
               lookup_table: cute.Tensor, bias: Optional[cute.Tensor], freqs_cis: Optional[cute.Tensor],
               layer_idx: Int32, num_rows: Int32):
        dt, bm = self.dtype, self.tile_m
        tidx, _, _ = cute.arch.thread_idx()
        tile_m_idx, tile_n_idx, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = SmemAllocator()
        mbars = smem.allocate_array(cutlass.Int64, 2 * STAGES)  # full + empty barrier per stage
        s_page = smem.allocate_tensor(Int32, cute.make_layout(bm), byte_alignment=4)
        s_pos = smem.allocate_tensor(Int32, cute.make_layout(bm), byte_alignment=4)
        buf = smem.allocate(self.buffer_bytes(), byte_alignment=1024)
        a_bytes, _ = self.ring_bytes()
        s_a = cute.make_tensor(cute.recast_ptr(buf, sa_layout.inner, dtype=dt), sa_layout.outer)
        s_b = cute.make_tensor(cute.recast_ptr(buf + a_bytes, sb_layout.inner, dtype=dt), sb_layout.outer)

        stage_bytes = (cute.size_in_bytes(dt, cute.slice_(sa_layout, (None, None, 0)))
                       + cute.size_in_bytes(dt, cute.slice_(sb_layout, (None, None, 0))))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=mbars, num_stages=STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS // 32),  # one arrive per warp
            tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))

        g_a_tiles = cute.local_tile(g_a, (bm, BN, BK), (tile_m_idx, tile_n_idx, None), proj=(1, None, 1))
        g_b_tiles = cute.local_tile(g_b, (bm, BN, BK), (tile_m_idx, tile_n_idx, None), proj=(None, 1, 1))
        t_as, t_ag = cpasync.tma_partition(tma_a, 0, cute.make_layout(1), cute.group_modes(s_a, 0, 2),
                                           cute.group_modes(g_a_tiles, 0, 2))
        t_bs, t_bg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1), cute.group_modes(s_b, 0, 2),
                                           cute.group_modes(g_b_tiles, 0, 2))
        thr_mma = tiled_mma.get_slice(tidx)
        t_ra = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))  # smem descriptors, not registers
        t_rb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((bm, BN)), Float32)

        k_tiles = cute.size(g_a_tiles, mode=[2])  # ceil(K / BK): TMA zero-fills the ragged last step
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        if warp_idx == 0:
            for _ in cutlass.range(cutlass.min(STAGES, k_tiles), unroll=1):
                self.load_k_tile(pipe, prod, tma_a, t_ag, t_as, tma_b, t_bg, t_bs)
                prod.advance()

        # While the first stages land: where each of the tile's rows goes (read only after the mainloop's sync).
        resolve_rows(s_page, s_pos, tile_m_idx * bm, num_rows, input_row_offsets, cache_lengths, lookup_table,
                     blocks.shape[0], self.page_size)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        k_blocks = cute.size(t_ra, mode=[2])
        # First k-tile: zero-initialising MMAs, then one batch stays in flight while the next is issued.
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        pipe.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(k_blocks):
            cute.gemm(tiled_mma, acc, t_ra[None, None, kb, read.index], t_rb[None, None, kb, read.index], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        read.advance()
        for _ in cutlass.range(1, k_tiles, 1, unroll=1):
            pipe.consumer_wait(read)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(k_blocks):
                cute.gemm(tiled_mma, acc, t_ra[None, None, kb, read.index], t_rb[None, None, kb, read.index], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # the previous batch is done: its stage can be refilled
            pipe.consumer_release(release)
            read.advance()
            release.advance()
            if warp_idx == 0 and prod.count < k_tiles:
                self.load_k_tile(pipe, prod, tma_a, t_ag, t_as, tma_b, t_bg, t_bs)
                prod.advance()
        warpgroup.wait_group(0)
        cute.arch.sync_threads()  # every warp is done reading the ring before it becomes the C tile

        s_c = cute.make_tensor(cute.recast_ptr(buf, dtype=Float32),
                               cute.make_layout((bm, BN), stride=(BN + C_PAD, 1)))
        thr_mma.partition_C(s_c).store(acc.load())
        cute.arch.sync_threads()
        self.epilogue(s_c, s_page, s_pos, output, blocks, bias, freqs_cis, layer_idx, tile_m_idx * bm,
                      tile_n_idx * BN, num_rows)

    @cute.jit
    def load_k_tile(self, pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, tma_a: cute.CopyAtom,
                    t_ag: cute.Tensor, t_as: cute.Tensor, tma_b: cute.CopyAtom, t_bg: cute.Tensor, t_bs: cute.Tensor):
        """Producer: wait for stage ``prod.index`` to be free, then TMA k-tile ``prod.count`` of A and B into it."""
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        cute.copy(tma_a, t_ag[None, prod.count], t_as[None, prod.index], tma_bar_ptr=bar)
        cute.copy(tma_b, t_bg[None, prod.count], t_bs[None, prod.index], tma_bar_ptr=bar)
        pipe.producer_commit(prod)

    @cute.jit
    def epilogue(self, s_c: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor, output: cute.Tensor,
                 blocks: cute.Tensor, bias: Optional[cute.Tensor], freqs_cis: Optional[cute.Tensor],
                 layer_idx: Int32, m0: Int32, n0: Int32, num_rows: Int32):
        """Thread ``t`` owns columns ``[c, c+8)`` (``c = 8 * (t % 16)``) of rows ``t // 16 + 8*i`` of the tile."""
        dt, bm, d, h = self.dtype, self.tile_m, self.head_dim, self.num_heads
        chunks = BN // VEC
        tidx, _, _ = cute.arch.thread_idx()
        col = (tidx % chunks) * VEC
        n = n0 + col
        if n < self.n_total:
            # Where this chunk goes and how it rotates are the same for every row: decide once.
            is_q = n < self.q_dim
            kk = n - self.q_dim
            kv = kk // (h * d)
            head = (kk // d) % h
            dim = kk % d
            bias_v = cute.make_rmem_tensor((VEC,), Float32)
            partner = cute.make_rmem_tensor((VEC,), Int32)  # staged column paired with each element by RoPE
            partner_bias = cute.make_rmem_tensor((VEC,), Float32)
            sign = cute.make_rmem_tensor((VEC,), Float32)  # -1/+1 rotated (first/second of the pair), 0 kept
            freq = cute.make_rmem_tensor((VEC,), Int32)  # column of cos in freqs_cis; sin follows it
            for e in cutlass.range_constexpr(VEC):
                partner[e] = col + e
                sign[e] = Float32(0.0)
                freq[e] = Int32(0)
            if cutlass.const_expr(self.rope is not None):
                rope_dim, interleaved, q_head_dim = self.rope
                if is_q or kv == 0:
                    head_dim = Int32(d)
                    dim0 = dim
                    if is_q:
                        head_dim = Int32(q_head_dim)
                        dim0 = n % q_head_dim
                    for e in cutlass.range_constexpr(VEC):
                        dd = dim0 + e
                        if cutlass.const_expr(interleaved):  # pairs (2j, 2j+1) of the last R dims
                            rel = dd - (head_dim - rope_dim)
                            if rel >= 0:
                                odd = rel % 2
                                sign[e] = Float32(2 * odd - 1)
                                partner[e] = col + e + 1 - 2 * odd
                                freq[e] = rel - odd
                        else:  # pairs (j, j + R/2) of the first R dims
                            half = rope_dim // 2
                            if dd < half:
                                sign[e] = Float32(-1.0)
                                partner[e] = col + e + half
                                freq[e] = dd * 2
                            elif dd < rope_dim:
                                sign[e] = Float32(1.0)
                                partner[e] = col + e - half
                                freq[e] = (dd - half) * 2
            for e in cutlass.range_constexpr(VEC):
                bias_v[e] = Float32(0.0)
                partner_bias[e] = Float32(0.0)
                if cutlass.const_expr(self.has_bias):
                    bias_v[e] = Float32(bias[n + e])
                    partner_bias[e] = Float32(bias[n0 + partner[e]])

            vals = cute.make_rmem_tensor((VEC,), Float32)
            out = cute.make_rmem_tensor((VEC,), dt)
            for r in cutlass.range(tidx // chunks, bm, THREADS // chunks, unroll=1):
                m = m0 + r
                if m < num_rows:
                    pos = s_pos[r]
                    cute.autovec_copy(cute.local_tile(s_c[r, None], (VEC,), (col // VEC,)), vals)  # 2 x 16 B
                    for e in cutlass.range_constexpr(VEC):
                        x = vals[e] + bias_v[e]
                        if cutlass.const_expr(self.rope is not None):
                            if sign[e] != 0.0:
                                y = s_c[r, partner[e]] + partner_bias[e]
                                x = x * freqs_cis[pos, freq[e]] + sign[e] * y * freqs_cis[pos, freq[e] + 1]
                        vals[e] = x
                    out.store(vals.load().to(dt))
                    if is_q:
                        cute.autovec_copy(out, cute.local_tile(output[m, None], (VEC,), (n // VEC,)))
                    else:
                        page = s_page[r]
                        if page >= 0:  # -1: the row's page is not in the cache (unchecked metadata)
                            dst = blocks[page, kv, layer_idx, pos % self.page_size, head, None]
                            cute.autovec_copy(out, cute.local_tile(dst, (VEC,), (dim // VEC,)))


def supported(q_dim: int, kv_dim: int, num_heads: int, head_dim: int, rope: Optional[tuple[int, bool, int]],
              tile_m: int) -> Optional[str]:
    """Why this kernel cannot take the problem, or None. Its 16-byte chunks must not straddle a region or head,
    and a neox rotation's pairs (``R/2`` apart) must be staged in the same tile."""
    if tile_m not in (64, 128):
        return f"tile_m must be 64 or 128, got {tile_m}"
    if q_dim % VEC or head_dim % VEC:
        return f"q_dim ({q_dim}) and head_dim ({head_dim}) must be multiples of {VEC}"
    if rope is None:
        return None
    rope_dim, interleaved, q_head_dim = rope
    if q_head_dim % VEC or q_dim % q_head_dim:
        return f"q_head_dim ({q_head_dim}) must be a multiple of {VEC} dividing q_dim ({q_dim})"
    if not interleaved:
        starts = [i * q_head_dim for i in range(q_dim // q_head_dim)]
        starts += [q_dim + i * head_dim for i in range(num_heads)]
        if any(s % BN + rope_dim > BN for s in starts):
            return f"a neox rotation of {rope_dim} dims crosses a {BN}-column tile"
    return None
