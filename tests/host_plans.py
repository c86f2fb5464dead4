"""Host-run CuTe DSL functions that evaluate, on CPU tensors, the views and tiles the kernels build: what a kernel
would index, checked without a GPU (``test_host_plans.py``)."""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr

from cute_kv.kernels.attention.operand import DenseMHAOperand, KVCacheMHAOperand
from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.paged.populate import key_row
from cute_kv.kernels.paged.ragged_rows import request_rows, resolve_row
from cute_kv.kernels.quant import e8m0_byte, e8m0_to_float32, granule_scale, lanes_scale


@cute.jit
def read_swizzled_tile(buf: cute.Tensor, out: cute.Tensor, rows: cutlass.Constexpr[int],
                       depth: cutlass.Constexpr[int]):
    """``out[r, c]`` = element (r, c) of the ``(rows, depth)`` tile at ``buf`` as a gather thread reads it: 8
    elements (16 bytes) at a time."""
    layout = tma_tiles.smem_tile_layout(buf.element_type, rows, depth)
    tile = tma_tiles.swizzled_tile(buf.iterator, layout, buf.element_type)
    frag = cute.make_rmem_tensor((8,), buf.element_type)
    for r in cutlass.range(rows):
        for c in cutlass.range(depth // 8):
            cute.autovec_copy(cute.local_tile(tile[r, None], (8,), (c,)), frag)
            cute.autovec_copy(frag, cute.local_tile(out[r, None], (8,), (c,)))


@cute.jit
def read_layout_swizzled_tile(buf: cute.Tensor, out: cute.Tensor, rows: cutlass.Constexpr[int],
                              depth: cutlass.Constexpr[int]):
    """The same read through a tensor with the swizzle inside its layout (the form that disagrees with TMA)."""
    tile = cute.make_tensor(buf.iterator, tma_tiles.smem_tile_layout(buf.element_type, rows, depth))
    for r in cutlass.range(rows):
        for c in cutlass.range(depth):
            out[r, c] = tile[r, c]


@cute.jit
def dense_rows(cache: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, num_rows: cute.Tensor):
    """``out[i] = row_view[b*rows_per_page + t, h, d]`` for ``coords[i] = (b, t, h, d)``; ``num_rows[0]``: the view's
    rows (what the kernel passes as the out-of-bounds row)."""
    op = DenseMHAOperand(64)
    view = op.row_view(cache, Int32(0))
    pitch = op.rows_per_page(cache)
    num_rows[0] = view.shape[0]
    for i in cutlass.range(coords.shape[0]):
        out[i] = view[coords[i, 0] * pitch + coords[i, 1], coords[i, 2], coords[i, 3]]


@cute.jit
def flat_scale_extent(scales: cute.Tensor, out: cute.Tensor):
    """``out[0]``: the extent of ``tma_tiles.flat_scales`` over plane (K, layer 0)."""
    out[0] = cute.size(tma_tiles.flat_scales(scales, 0, 0))


@cute.jit
def decode_e8m0(codes: cute.Tensor, out: cute.Tensor):
    """``out[i]``: the attention kernel's float32 for e8m0 byte ``codes[i]``."""
    for i in cutlass.range(codes.shape[0]):
        out[i] = e8m0_to_float32(Uint32(codes[i]))


@cute.jit
def scales_of_amax(amax: cute.Tensor, divisors: cute.Tensor, stored: cute.Tensor, e8m0: cutlass.Constexpr[bool]):
    """``divisors[i], stored[i]``: the fp8 quantizer's scale of a one-lane granule of amax ``amax[i]`` (float32, or
    e8m0 and its byte)."""
    for i in cutlass.range(amax.shape[0]):
        scale = lanes_scale(amax[i], 1, e8m0)
        divisors[i] = scale
        if const_expr(e8m0):
            stored[i] = e8m0_byte(scale)
        else:
            stored[i] = scale


@cute.jit
def resolved_rows(offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor, out: cute.Tensor,
                  num_rows: Int32, num_pages: Int32, page_size: cutlass.Constexpr[int]):
    """``out[m] = (page, pos)`` of each step row as the store and fused-QKV kernels resolve it (page -1: not stored)."""
    for m in cutlass.range(out.shape[0]):
        page, pos = resolve_row(Int32(m), num_rows, offsets, cache_lengths, lookup_table, num_pages, page_size)
        out[m, 0] = page
        out[m, 1] = pos


@cute.jit
def fused_qkv_rope_tile(spec: cutlass.Constexpr, s_c: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor,
                        output: cute.Tensor, blocks: cute.Tensor, freqs_cis: cute.Tensor, n0: Int32,
                        threads: cutlass.Constexpr[int], workspace: Optional[cute.Tensor] = None):
    """The fused-QKV epilogue's RoPE and store pass over one staged tile (``s_c``, rows resolved in ``s_page`` and
    ``s_pos``), its threads run one after another (RoPE without bias or QK-norm: no barrier, no shuffle); a wide
    head's columns go to ``workspace``."""
    from cute_kv.kernels.qkv.epilogue import QKVEpilogueParams, qkv_store_tile

    params = QKVEpilogueParams(output, blocks, s_page, s_page, s_page, Int32(0), None, freqs_cis,
                               workspace=workspace)
    for t in cutlass.range(threads):
        qkv_store_tile(spec, s_c, s_page, s_pos, params, Int32(0), n0, t, threads, None)


@cute.jit
def fused_qkv_finish_heads(spec: cutlass.Constexpr, s_page: cute.Tensor, s_pos: cute.Tensor, output: cute.Tensor,
                           blocks: cute.Tensor, freqs_cis: cute.Tensor, workspace: cute.Tensor, group: Int32,
                           bm: cutlass.Constexpr[int], threads: cutlass.Constexpr[int]):
    """The last arriver's finish of wide head ``group`` over the workspace's first ``bm`` rows, its threads one after
    another (RoPE without QK-norm or fp8 scales: no shuffle)."""
    from cute_kv.kernels.qkv.epilogue import QKVEpilogueParams, _finish_heads

    params = QKVEpilogueParams(output, blocks, s_page, s_page, s_page, Int32(0), None, freqs_cis,
                               workspace=workspace)
    for t in cutlass.range(threads):
        _finish_heads(spec, s_page, s_pos, params, Int32(0), group, bm, t, threads)


@cute.jit
def attention_request_rows(offsets: cute.Tensor, out: cute.Tensor, num_rows: Int32):
    """``out[b] = (first row, row count)`` of each request as the attention kernels bound them to the step's rows."""
    for b in cutlass.range(out.shape[0]):
        start, count = request_rows(offsets, Int32(b), num_rows)
        out[b, 0] = start
        out[b, 1] = count


@cute.jit
def attention_tile_rows(lookup_table: cute.Tensor, out: cute.Tensor, b: Int32, base: Int32, num_keys: Int32,
                        rows_per_page: Int32, oob_row: Int32, bn: cutlass.Constexpr[int],
                        page_size: cutlass.Constexpr[int], lut_vector: cutlass.Constexpr[bool]):
    """``out``: the rows of the ``bn``-key tile at key ``base`` of request ``b`` as the attention kernels'
    ``populate`` gives them (``oob_row``: a slot TMA zero-fills, whose lookup entry is not read)."""
    op = KVCacheMHAOperand(0, page_size, bn, lut_vector)
    rows = cute.make_rmem_tensor((op.copies_per_tile,), Int32)
    op.populate(rows, lookup_table, b, base, num_keys, rows_per_page, oob_row)
    for i in cutlass.range_constexpr(op.copies_per_tile):
        out[i] = rows[i]


@cute.jit
def attention_key_rows(lookup_table: cute.Tensor, out: cute.Tensor, b: Int32, num_keys: Int32, rows_per_page: Int32,
                       oob_row: Int32, page_size: cutlass.Constexpr[int], count: cutlass.Constexpr[int]):
    """``out[k]``: the row of key ``k`` of request ``b`` as the gather4 paths resolve it (``populate.key_row``)."""
    for k in cutlass.range_constexpr(count):
        out[k] = key_row(lookup_table, b, Int32(k), num_keys, rows_per_page, page_size, oob_row)


@cute.jit
def attention_scales(scales: cute.Tensor, rows: cute.Tensor, out: cute.Tensor, count: cutlass.Constexpr[int]):
    """``out[i]``: the attention kernels' float32 scale of ``(rows[i], head 1, granule 0)`` of the ``[rows, H, G]``
    view (``quant.granule_scale``)."""
    for i in cutlass.range_constexpr(count):
        out[i] = granule_scale(scales, rows[i], Int32(1), Int32(0), False)


class GatheredStage:
    """``fill(src, image)``: ``image`` (a stage's 16-bit elements) as the row gather ``gather`` (``RowGather``) fills
    it with the rows of ``src [bn, head_dim]``: the piece of pass ``j`` of each producer thread at ``stage_offset`` /
    ``pass_address``, from the row whose lookup its segmented shuffle reads (``source_lane``)."""

    def __init__(self, gather):
        self.gather = gather

    @cute.jit
    def fill(self, src: cute.Tensor, image: cute.Tensor):
        vec, chunks = self.gather.vec, self.gather.chunks
        piece = cute.make_rmem_tensor((vec,), src.element_type)
        for warp in cutlass.range(4):
            for lane in cutlass.range(32):
                base = self.gather.stage_offset(warp, lane)
                for j in cutlass.range(self.gather.passes):
                    row = warp * self.gather.rows_per_warp + self.gather.source_lane(lane, j)
                    cute.autovec_copy(cute.local_tile(src[row, None], (vec,), (lane % chunks,)), piece)
                    dst = self.gather.pass_address(base, j) // (src.element_type.width // 8)
                    cute.autovec_copy(piece, cute.local_tile(image, (vec,), (dst // vec,)))



class GatherSources:
    """``fill(plane, offsets)``: ``offsets[row, head, lane]``, elements from the plane's layer-0 base to what lane
    ``lane``'s copy of ``row`` reads (``RowGather.source`` over ``tma_tiles.plane_row_view`` of the strided plane)."""

    def __init__(self, gather):
        self.gather = gather

    @cute.jit
    def fill(self, plane: cute.Tensor, offsets: cute.Tensor):
        rows = tma_tiles.plane_row_view(plane, 0)
        width = plane.element_type.width // 8
        for r in cutlass.range(offsets.shape[0]):
            for h in cutlass.range(offsets.shape[1]):
                for lane in cutlass.range(offsets.shape[2]):
                    base, row_bytes = self.gather.source(rows, h, lane)
                    offsets[r, h, lane] = Int32((base + r * row_bytes - rows.iterator.toint()) // width)


class GatherRows:
    """``fill(lookup_table, rows, num_keys, rows_per_page, num_rows)``: ``rows[warp, lane]``, what ``RowGather.lane_row``
    gives each producer lane for the tile of request 0 starting at key 0."""

    def __init__(self, gather):
        self.gather = gather

    @cute.jit
    def fill(self, lookup_table: cute.Tensor, rows: cute.Tensor, num_keys: Int32, rows_per_page: Int32,
             num_rows: Int32):
        for warp in cutlass.range(rows.shape[0]):
            for lane in cutlass.range(rows.shape[1]):
                rows[warp, lane] = self.gather.lane_row(lookup_table, 0, 0, warp, lane, num_keys, rows_per_page,
                                                        num_rows)
