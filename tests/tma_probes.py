"""Small kernels that issue each ``tma_tiles`` descriptor once, so CI can compile them and read their PTX.

A probe CTA loads its tile into shared memory (and, for the paged tile, stores it back to a dense tensor so
the round trip can be checked on a GPU); they are tests of the descriptors, not ops.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.paged.populate import populate, populate_rows
from cute_kv.row_indices import tile_geometry

THREADS = 128


def fake_blocks(dtype, kvd, p, h, d):
    n, nl = cute.sym_int32(), cute.sym_int32()
    return make_fake_tensor(dtype, (n, kvd, nl, p, h, d), stride=(
        cute.sym_int64(divisibility=kvd * p * h * d), cute.sym_int64(divisibility=p * h * d), p * h * d, h * d, d, 1),
        assumed_align=16)


def fake_lut():
    return make_fake_tensor(Uint32, (cute.sym_int32(), cute.sym_int32()), stride=(cute.sym_int64(divisibility=8), 1),
                            assumed_align=32)


@cute.jit
def init_barrier(mbar: cute.Pointer):
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


class PagedTileProbe:
    """Tile ``j`` (BN tokens) of head ``h`` of request ``b``: ``populate`` + one ``create_tma_tile`` copy per page
    slot, then a TMA store of the tile to ``out[b, j*BN:(j+1)*BN, h, :]``."""

    def __init__(self, dtype, kv_dim, page_size, num_heads, head_dim, bn, base_alignment, rope=None):
        self.dtype, self.kv_dim, self.page_size, self.num_heads, self.head_dim = dtype, kv_dim, page_size, num_heads, head_dim
        self.bn, self.base_alignment, self.rope = bn, base_alignment, rope
        self.eff_page, self.num_pages = tile_geometry(bn, page_size)
        # With ``rope = (content_bytes, rope_depth)``: the BF16 rope tail of rope-aware FP8 rows.
        self.tile_dtype, self.depth = (dtype, head_dim) if rope is None else (cutlass.BFloat16, rope[1])

    def fake_args(self):
        out = make_fake_compact_tensor(self.tile_dtype, (cute.sym_int32(), cute.sym_int32(divisibility=self.bn),
                                                         self.num_heads, self.depth),
                                       stride_order=(3, 2, 1, 0), assumed_align=16)
        return (fake_blocks(self.dtype, self.kv_dim, self.page_size, self.num_heads, self.head_dim), fake_lut(), out,
                Int32(0), Int32(0), Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, blocks: cute.Tensor, lookup_table: cute.Tensor, out: cute.Tensor, kv_idx: Int32,
                 layer_idx: Int32, num_tiles: Int32, stream: cuda.CUstream):
        if cutlass.const_expr(self.rope is None):
            load, g_rows, s_slot = tma_tiles.create_tma_tile(tma_tiles.kv_row_view(blocks, kv_idx, layer_idx),
                                                             self.eff_page, self.head_dim)
        else:
            load, g_rows, s_slot = tma_tiles.create_rope_tma_tile(blocks, kv_idx, layer_idx, *self.rope,
                                                                  self.eff_page)
        s_tile = tma_tiles.smem_tile_layout(self.tile_dtype, self.bn, cute.size(s_slot, mode=[1]))
        out_v = cute.make_tensor(out.iterator, cute.select(out.layout, mode=[1, 3, 2, 0]))  # (S, D, H, B)
        store, g_out = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), out_v, s_tile,
                                                   (self.bn, self.depth))
        rows_per_page = blocks.shape[1] * blocks.shape[2] * self.page_size
        self.kernel(load, g_rows, s_slot, s_tile, store, g_out, lookup_table, rows_per_page).launch(
            grid=(num_tiles, self.num_heads, lookup_table.shape[0]), block=(THREADS, 1, 1),
            smem=cute.size_in_bytes(self.tile_dtype, s_tile) + 2048, stream=stream)

    @cute.kernel
    def kernel(self, load: cute.CopyAtom, g_rows: cute.Tensor, s_slot: cute.ComposedLayout,
               s_tile: cute.ComposedLayout, store: cute.CopyAtom, g_out: cute.Tensor, lookup_table: cute.Tensor,
               rows_per_page: Int32):
        j, h, b = cute.arch.block_idx()
        smem = SmemAllocator()
        tile = smem.allocate_tensor(self.tile_dtype, s_tile, byte_alignment=1024)
        mbar = smem.allocate_array(cutlass.Int64, 1)
        init_barrier(mbar)
        rows = populate_rows(self.bn, self.page_size)
        populate(rows, lookup_table, b, j * self.bn, rows_per_page, self.bn, self.page_size, self.base_alignment)
        bk = cute.size(s_slot, mode=[1])
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, cute.size_in_bytes(self.tile_dtype, s_tile))
            for p in cutlass.range_constexpr(self.num_pages):
                src = cute.local_tile(cute.domain_offset((rows[p], 0, 0), g_rows), (self.eff_page, bk), (0, 0, h))
                dst = cute.local_tile(tile, (self.eff_page, bk), (p, 0))
                t_s, t_g = cpasync.tma_partition(load, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                 cute.group_modes(src, 0, 2))
                cute.copy(load, t_g, t_s, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)
        g_tiles = cute.local_tile(g_out, (self.bn, self.depth), (None, 0, None, None))
        t_s, t_g = cpasync.tma_partition(store, 0, cute.make_layout(1), cute.group_modes(tile, 0, 2),
                                         cute.group_modes(g_tiles, 0, 2))
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            cute.copy(store, t_s, t_g[None, j, h, b])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def load_and_wait(atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, mbar: cute.Pointer, tx_bytes: Int32):
    """Warp 0 issues one TMA load of ``src`` (gmem coordinates) into ``dst`` (smem); every thread waits for it."""
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                         cute.group_modes(src, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, tx_bytes)
        cute.copy(atom, t_g, t_s, tma_bar_ptr=mbar)
    cute.arch.mbarrier_wait(mbar, 0)


class RaggedProbe:
    """Tile ``m`` of request ``b``'s rows of a ragged ``[T, H, D]`` tensor, loaded and stored back (masked)."""

    def __init__(self, dtype, num_heads, head_dim, tile_rows):
        self.dtype, self.num_heads, self.head_dim, self.tile_rows = dtype, num_heads, head_dim, tile_rows

    def fake_args(self):
        t = cute.sym_int32()
        x, y = (make_fake_compact_tensor(self.dtype, (t, self.num_heads, self.head_dim), stride_order=(2, 1, 0),
                                         assumed_align=16) for _ in range(2))
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        return x, y, offsets, Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)

    @cute.jit
    def __call__(self, x: cute.Tensor, y: cute.Tensor, input_row_offsets: cute.Tensor, max_tiles: Int32,
                 stream: cuda.CUstream):
        load, g_x, s_tile = tma_tiles.create_ragged_tma_tile(x, self.tile_rows, self.head_dim)
        store, g_y, _ = tma_tiles.create_ragged_tma_tile(y, self.tile_rows, self.head_dim, store=True)
        self.kernel(load, g_x, store, g_y, s_tile, input_row_offsets).launch(
            grid=(max_tiles, self.num_heads, input_row_offsets.shape[0] - 1), block=(THREADS, 1, 1),
            smem=cute.size_in_bytes(self.dtype, s_tile) + 2048, stream=stream)

    @cute.kernel
    def kernel(self, load: cute.CopyAtom, g_x: cute.Tensor, store: cute.CopyAtom, g_y: cute.Tensor,
               s_tile: cute.ComposedLayout, input_row_offsets: cute.Tensor):
        m, h, b = cute.arch.block_idx()
        offset = Int32(input_row_offsets[b])
        length = Int32(input_row_offsets[b + 1]) - offset
        smem = SmemAllocator()
        mbar = smem.allocate_array(cutlass.Int64, 1)
        tile = smem.allocate_tensor(self.dtype, s_tile, byte_alignment=1024)
        init_barrier(mbar)
        if m * self.tile_rows < length:
            tiler = (self.tile_rows, self.head_dim)
            src = cute.local_tile(tma_tiles.ragged_window(g_x, offset, length), tiler, (m, 0, h))
            load_and_wait(load, src, tile, mbar, cute.size_in_bytes(self.dtype, s_tile))
            dst = cute.local_tile(tma_tiles.ragged_window(g_y, offset, length), tiler, (m, 0, h))
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                t_s, t_g = cpasync.tma_partition(store, 0, cute.make_layout(1), cute.group_modes(tile, 0, 2),
                                                 cute.group_modes(dst, 0, 2))
                cute.copy(store, t_s, t_g)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)


class ScaleProbe:
    """The scales of tile ``j`` of request ``b`` (one copy per page slot), as a paged FP8 attention kernel loads them."""

    def __init__(self, kv_dim, page_size, num_heads, granules, bn):
        self.kv_dim, self.page_size, self.num_heads, self.granules, self.bn = kv_dim, page_size, num_heads, granules, bn
        self.eff_page, self.num_pages = tile_geometry(bn, page_size)

    def fake_args(self):
        scales = fake_blocks(cutlass.Float32, self.kv_dim, self.page_size, self.num_heads, self.granules)
        return scales, fake_lut(), Int32(0), Int32(0), Int32(1), make_fake_stream(use_tvm_ffi_env_stream=True)

    @cute.jit
    def __call__(self, scales: cute.Tensor, lookup_table: cute.Tensor, kv_idx: Int32, layer_idx: Int32,
                 num_tiles: Int32, stream: cuda.CUstream):
        load, g_scales, s_slot = tma_tiles.create_scale_tma_tile(scales, kv_idx, layer_idx, self.eff_page)
        rows_per_page = scales.shape[1] * scales.shape[2] * self.page_size
        self.kernel(load, g_scales, s_slot, lookup_table, rows_per_page).launch(
            grid=(num_tiles, 1, lookup_table.shape[0]), block=(THREADS, 1, 1),
            smem=self.num_pages * cute.size_in_bytes(cutlass.Float32, s_slot) + 1024, stream=stream)

    @cute.kernel
    def kernel(self, load: cute.CopyAtom, g_scales: cute.Tensor, s_slot: cute.Layout, lookup_table: cute.Tensor,
               rows_per_page: Int32):
        j, _, b = cute.arch.block_idx()
        per_row = self.num_heads * self.granules
        width = cute.size(s_slot)
        smem = SmemAllocator()
        mbar = smem.allocate_array(cutlass.Int64, 1)
        tile = smem.allocate_tensor(cutlass.Float32, cute.make_layout((1, self.num_pages * width), stride=(self.num_pages * width, 1)), byte_alignment=128)
        init_barrier(mbar)
        rows = populate_rows(self.bn, self.page_size)
        populate(rows, lookup_table, b, j * self.bn, rows_per_page, self.bn, self.page_size, self.bn)
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, self.num_pages * width * 4)
            for p in cutlass.range_constexpr(self.num_pages):
                src = cute.local_tile(cute.domain_offset((0, rows[p] * per_row), g_scales), (1, width), (0, 0))
                dst = cute.local_tile(tile, (1, width), (0, p))
                t_s, t_g = cpasync.tma_partition(load, 0, cute.make_layout(1), cute.group_modes(dst, 0, 2),
                                                 cute.group_modes(src, 0, 2))
                cute.copy(load, t_g, t_s, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)


class Gather4Probe:
    """SM100: tokens ``[j*BN, (j+1)*BN)`` of request ``b`` by per-token physical rows, four rows per instruction.

    ``rope``: read the BF16 rope tail of rope-aware FP8 rows (``content_bytes`` fp8, then ``rope_depth`` bf16)
    instead of whole rows.
    """

    def __init__(self, dtype, kv_dim, page_size, num_heads, head_dim, bn, rope=None):
        self.dtype, self.kv_dim, self.page_size, self.num_heads, self.head_dim = dtype, kv_dim, page_size, num_heads, head_dim
        self.bn, self.rope = bn, rope
        self.tile_dtype = dtype if rope is None else cutlass.BFloat16

    def fake_args(self):
        rows = make_fake_compact_tensor(Int32, (cute.sym_int32(), cute.sym_int32(divisibility=self.bn)),
                                        stride_order=(1, 0), assumed_align=16)
        return (fake_blocks(self.dtype, self.kv_dim, self.page_size, self.num_heads, self.head_dim), rows, Int32(0),
                Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, blocks: cute.Tensor, token_rows: cute.Tensor, kv_idx: Int32, layer_idx: Int32,
                 stream: cuda.CUstream):
        request_rows = token_rows[0, None]  # the index layout is per request; the kernel rebases the pointer
        if cutlass.const_expr(self.rope is None):
            view = tma_tiles.kv_row_view(blocks, kv_idx, layer_idx)
            rows_2d = cute.make_tensor(view.iterator, cute.make_layout(
                (view.shape[0], self.num_heads * self.head_dim), stride=(view.stride[0], 1)))
            g4, g_kv, s_tile = tma_tiles.create_gather4_tma_tile(rows_2d, request_rows, self.bn, self.head_dim)
        else:
            g4, g_kv, s_tile = tma_tiles.create_rope_gather4_tma_tile(blocks, kv_idx, layer_idx, *self.rope,
                                                                       request_rows, self.bn)
        self.kernel(g4, g_kv, s_tile, token_rows).launch(
            grid=(token_rows.shape[1] // self.bn, 1, token_rows.shape[0]), block=(THREADS, 1, 1),
            smem=cute.size_in_bytes(self.tile_dtype, s_tile) + 2048, stream=stream)

    @cute.kernel
    def kernel(self, g4: cute.CopyAtom, g_kv: cute.Tensor, s_tile: cute.Layout, token_rows: cute.Tensor):
        j, _, b = cute.arch.block_idx()
        tile_dtype = self.tile_dtype
        width = cute.size(s_tile, mode=[1])
        smem = SmemAllocator()
        mbar = smem.allocate_array(cutlass.Int64, 1)
        tile = smem.allocate_tensor(tile_dtype, s_tile, byte_alignment=128)
        init_barrier(mbar)
        index = cute.make_tensor(token_rows[b, None].iterator,
                                 cute.make_layout((token_rows.shape[1], width), stride=(1, 0)))
        g_kv_t = cute.zipped_divide(g_kv, (self.bn, width))
        g_idx_t = cute.zipped_divide(index, (self.bn, width))
        t_s, t_g, t_i = cpasync.tma_partition(g4, 0, cute.make_layout(1), cute.group_modes(tile, 0, 2),
                                              [g_kv_t, g_idx_t])
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(mbar, cute.size_in_bytes(tile_dtype, s_tile))
            cute.copy(g4, [t_g[None, (j, 0)], t_i[None, (j, 0)]], t_s, tma_bar_ptr=mbar)
        cute.arch.mbarrier_wait(mbar, 0)
