"""TMA descriptors over one (K or V, layer) plane of a paged cache: MAX's ``PagedKVCache.create_*_tma_tile``.

Host side: call these from a ``@cute.jit`` function; each returns ``(atom, coordinate tensor, smem layout)``
(what ``cute.copy`` and ``cpasync.tma_partition`` take in the kernel). Rows are MAX's flattened row view: row
``page * KVD*L*P + slot`` of ``[num_kv_rows, H, D]`` from the plane's base, the row ``PagedRowIndices.populate``
returns (``populate.py``); TMA coordinates are int32, so a descriptor spans at most 2^31 - 1 rows.

A strided plane ``[N, L, P, H, D]`` (K and V apart, any page, layer and head strides) has the same row view,
row ``page * sN/sP + slot`` (``plane_row_view``): ``create_tma_tile`` takes it as it is, gather4's 2-D view
needs a token's heads side by side (``sH == D``).

* ``create_tma_tile``: 3-D ``[rows, H, D]`` seen as ``(rows, D, H)``; box ``(rows_per_copy, 1, swizzle width)``,
  the depth padded to the swizzle width (TMA zero-fills past ``D``). One copy per page slot of a BN tile.
* ``create_ragged_tma_tile``: ``[total_rows, H, D]`` rows packed back to back (``input_row_offsets``); a request's
  window is masked by the descriptor itself (FA4 / Triton's ragged TMA: base shifted back by 2^30 rows, an extra
  mode with the row stride), so loads past the request zero-fill and stores past it are dropped.
* ``create_packed_ragged_store``: the same ragged window over pack-GQA rows of ``[total_rows, Hq, D]`` (token,
  head of a KV head's group): a box of (group heads, tokens) rows, for an attention epilogue's TMA store.
* ``create_scale_tma_tile``: the plane's scales, flat (``flat_scales``, its extent in 64 bits): a page slot's rows
  are consecutive, so one box of ``rows * H * G`` float32 covers them.
* ``create_gather4_tma_tile`` (SM100): 2-D ``[rows, tile_stride]``; each ``cp.async.bulk.tensor...gather4`` fetches
  four arbitrary rows named by an int32 row-index tensor.
* ``create_rope_tma_tile`` / ``create_rope_gather4_tma_tile``: the BF16 rope tail of MAX's rope-aware FP8 rows
  (``[padded_depth fp8 bytes | rope_depth bf16]``), viewed from ``padded_depth`` bytes into each row.

In the kernel, ``swizzled_tile`` puts a loaded tile's swizzle on its pointer, so thread accesses agree with TMA's.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass.cute.nvgpu import cpasync, warpgroup

RAGGED_BIG = 2**30  # ragged window shift: rows past a request's length land at coordinates >= 2^30
_RAGGED_LIM = 2**31 - 1
_SWIZZLE = {128: warpgroup.SmemLayoutAtomKind.K_SW128, 64: warpgroup.SmemLayoutAtomKind.K_SW64,
            32: warpgroup.SmemLayoutAtomKind.K_SW32, 0: warpgroup.SmemLayoutAtomKind.K_INTER}


def swizzle_granularity(dtype, swizzle_bytes: int) -> int:
    """Elements per swizzle row (MAX's ``swizzle_granularity``); 16 bytes for no swizzle."""
    return max(swizzle_bytes, 16) * 8 // dtype.width


def padded_depth(dtype, swizzle_bytes: int, depth: int) -> int:
    """``depth`` rounded up to the swizzle width: the BK of a full-depth tile."""
    gran = swizzle_granularity(dtype, swizzle_bytes)
    return -(-depth // gran) * gran


def smem_tile_layout(dtype, rows: int, depth: int, swizzle_bytes: int = 128, stages: int = 0) -> cute.ComposedLayout:
    """K-major ``(rows, depth)`` shared-memory tile in the swizzle the MMA atoms read (``(rows, depth, stages)``
    for a ring of ``stages`` tiles)."""
    atom = warpgroup.make_smem_layout_atom(_SWIZZLE[swizzle_bytes], dtype)
    if stages:
        return cute.tile_to_shape(atom, (rows, depth, stages), order=(0, 1, 2))
    return cute.tile_to_shape(atom, (rows, depth), order=(0, 1))


def swizzled_tile(ptr: cute.Pointer, layout: cute.ComposedLayout, dtype) -> cute.Tensor:
    """The ``smem_tile_layout`` tile at ``ptr`` (1024-byte aligned) with the swizzle on the pointer, so thread reads
    and writes follow the address pattern TMA and the MMAs use. (A swizzle inside the layout acts on element
    offsets instead: element (1, 0) of a 128-byte-swizzled bf16 tile would be read at byte 128, where TMA wrote
    element (1, 8).)"""
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=dtype), layout.outer)


def kv_row_view(blocks: cute.Tensor, kv_idx, layer_idx, dtype=None, byte_offset: int = 0, depth=None) -> cute.Tensor:
    """``[num_kv_rows, H, depth]`` row view of plane (``kv_idx``, ``layer_idx``) of ``blocks [N, KVD, L, P, H, D]``.

    Row stride ``H*D``; ``num_kv_rows = (N-1)*KVD*L*P + P`` (one past the last slot of the last page). With
    ``dtype``/``byte_offset``/``depth`` the rows are reinterpreted (the rope tail of an FP8 row as bf16).
    """
    n, kvd, nl, p, h, d = blocks.shape
    plane = blocks[None, kv_idx, layer_idx, None, None, None]
    num_rows = (n - 1) * (kvd * nl * p) + p
    if dtype is None:
        return cute.make_tensor(plane.iterator, cute.make_ordered_layout((num_rows, h, d), order=(2, 1, 0)))
    ratio = dtype.width // blocks.element_type.width  # cache elements per view element
    ptr = cute.recast_ptr(plane.iterator + byte_offset * 8 // blocks.element_type.width, dtype=dtype)
    layout = cute.make_layout((num_rows, h, depth), stride=(h * d // ratio, d // ratio, 1))
    return cute.make_tensor(ptr, layout)


def plane_rows_per_page(plane: cute.Tensor) -> Int32:
    """Rows from one page to the next in ``plane_row_view``: ``sN / sP`` (the page stride a whole number of token
    rows)."""
    return Int32(plane.stride[0] // plane.stride[2])


def plane_row_view(plane: cute.Tensor, layer_idx) -> cute.Tensor:
    """``[num_kv_rows, H, D]`` row view of layer ``layer_idx`` of a strided K or V plane ``[N, L, P, H, D]`` (strides
    ``(sN, sL, sP, sH, 1)``: vLLM's, FlashInfer's NHD / HND or FA4's separate caches read in place): row
    ``page * sN/sP + slot``, strides ``(sP, sH, 1)``, ``num_kv_rows = (N-1) * sN/sP + P``.
    """
    n, nl, p, h, d = plane.shape
    layer = plane[None, layer_idx, None, None, None]
    num_rows = (n - 1) * plane_rows_per_page(plane) + p
    return cute.make_tensor(layer.iterator, cute.make_layout((num_rows, h, d),
                                                             stride=(plane.stride[2], plane.stride[3], 1)))


def tma_order(t: cute.Tensor) -> cute.Tensor:
    """``(rows, H, D, ...)`` -> ``(rows, D, H, ...)``: a ``(rows, depth)`` tiler covers the first two modes."""
    modes = [0, 2, 1] + list(range(3, cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def create_tma_tile(row_view: cute.Tensor, rows_per_copy: int, depth: int, swizzle_bytes: int = 128, *,
                    store: bool = False):
    """Load (or ``store``) ``rows_per_copy`` consecutive rows x ``padded_depth(depth)`` of one head.

    Address a copy with ``cute.domain_offset((row, 0, 0), coords)`` then ``cute.local_tile(.., tiler, (0, 0, h))``:
    ``row`` is a ``populate`` row, so a BN tile spanning several pages issues one copy per page slot.
    """
    dtype = row_view.element_type
    bk = padded_depth(dtype, swizzle_bytes, depth)
    smem = smem_tile_layout(dtype, rows_per_copy, bk, swizzle_bytes)
    op = cpasync.CopyBulkTensorTileS2GOp() if store else cpasync.CopyBulkTensorTileG2SOp()
    atom, coords = cpasync.make_tiled_tma_atom(op, tma_order(row_view), smem, (rows_per_copy, bk))
    return atom, coords, smem


@cute.jit
def copy_page_slots(atom: cute.CopyAtom, g_rows: cute.Tensor, dst: cute.Tensor, s_slot: cute.ComposedLayout,
                    rows: cute.Tensor, rows_per_copy: cutlass.Constexpr[int], head: Int32, bar,
                    box_loop: cutlass.Constexpr[bool] = False):
    """One ``create_tma_tile`` copy per page slot of a key tile: slot ``p`` is rows ``rows[p]`` onward (a
    ``populate`` result) into rows ``[p * rows_per_copy, ...)`` of the ``(rows, depth)`` tile ``dst``.

    A row wider than its swizzle (256 bf16 under 128-byte swizzle) is several TMA boxes across. ``box_loop`` issues
    them by a loop over those columns, each pass one box per slot: unrolled, every box's operands (a tuple of uniform
    registers each) are built at once, which spilled a 24-register producer (head dims 192 and 256, partial pages)."""
    width = cute.size(s_slot, mode=[1])
    if cutlass.const_expr(box_loop):
        whole, _ = _slot_copy(atom, g_rows, dst, rows[0], (rows_per_copy, width), 0, 0, head)
        boxes = cute.size(whole, mode=[0, 1]) if cute.rank(whole.shape[0]) > 1 else 1
        assert width % boxes == 0, (width, whole)
        box = (rows_per_copy, width // boxes)
        for c in cutlass.range(boxes, unroll=1):
            for p in cutlass.range_constexpr(cute.size(rows)):
                t_s, t_g = _slot_copy(atom, g_rows, dst, rows[p], box, p, c, head)
                cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)
    else:
        for p in cutlass.range_constexpr(cute.size(rows)):
            t_s, t_g = _slot_copy(atom, g_rows, dst, rows[p], (rows_per_copy, width), p, 0, head)
            cute.copy(atom, t_g, t_s, tma_bar_ptr=bar)


def _slot_copy(atom: cute.CopyAtom, g_rows: cute.Tensor, dst: cute.Tensor, row, box: tuple, p: int, c, head):
    """The TMA partition of box ``(p, c)`` of a tile: rows ``row`` onward, columns ``c * box[1]`` onward."""
    src = cute.local_tile(cute.domain_offset((row, 0, 0), g_rows), box, (0, c, head))
    slot = cute.local_tile(dst, box, (p, c))
    return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(slot, 0, 2),
                                 cute.group_modes(src, 0, 2))


def ragged_view(rows: cute.Tensor) -> cute.Tensor:
    """``[total, H, D]`` -> ``[2^30, H, D, 2^31-1]``: base shifted back 2^30 rows, extra mode with the row stride.

    Extents are dynamic: a static layout of that size overflows the layout algebra.
    """
    shape = (Int32(RAGGED_BIG),) + tuple(rows.shape[1:]) + (Int32(_RAGGED_LIM),)
    stride = tuple(rows.stride) + (rows.stride[0],)
    ptr = cute.domain_offset((-RAGGED_BIG, None, None), rows).iterator
    return cute.make_tensor(ptr, cute.make_layout(shape, stride=stride))


def create_ragged_tma_tile(rows: cute.Tensor, tile_rows: int, depth: int, swizzle_bytes: int = 128, *,
                           store: bool = False):
    """Ragged ``[total, H, D]`` tile; ``ragged_window(coords, offset, length)`` selects a request."""
    return create_tma_tile(ragged_view(rows), tile_rows, depth, swizzle_bytes, store=store)


def ragged_window(coords: cute.Tensor, offset, length) -> cute.Tensor:
    """``(2^30, D, H)`` coordinates whose row ``r`` is packed row ``offset + r``, in bounds only for ``r < length``."""
    return cute.domain_offset((RAGGED_BIG - length, None, None), coords[None, None, None, offset + length])


def create_packed_ragged_store(rows: cute.Tensor, group: int, tile_rows: int, width: int, swizzle_bytes: int = 128):
    """TMA store of ``tile_rows`` pack-GQA rows x ``width`` columns into ragged ``[total, Hq, D]`` rows: packed row
    ``p`` of a tile is token ``p // group``, head ``p % group`` of the KV head's group, so the box is ``(group heads,
    tile_rows / group tokens, width)`` (``group`` must divide ``tile_rows``) over the view ``[group, 2^30, D,
    Hq/group, 2^31-1]`` (``ragged_view``'s window on the token mode). The smem tile is the usual K-major
    ``(tile_rows, width)``; ``packed_box`` sees it in the box's shape. Address a request with
    ``packed_ragged_window``."""
    dtype = rows.element_type
    t, hq, d = rows.shape
    view = cute.make_tensor(cute.domain_offset((-RAGGED_BIG, None, None), rows).iterator, cute.make_layout(
        (group, Int32(RAGGED_BIG), d, hq // group, Int32(_RAGGED_LIM)),
        stride=(rows.stride[1], rows.stride[0], rows.stride[2], rows.stride[1] * group, rows.stride[0])))
    smem = smem_tile_layout(dtype, tile_rows, width, swizzle_bytes)
    box = cute.make_composed_layout(smem.inner, smem.offset, packed_box(smem.outer, group))
    atom, coords = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), view, box,
                                               (group, tile_rows // group, width))
    return atom, coords, smem


def packed_box(layout, group: int):
    """A ``(rows, width)`` tile (layout or tensor) as ``(group, rows / group, width)``: row ``p`` is ``(p % group,
    p // group)``."""
    rows, width = cute.size(layout, mode=[0]), cute.size(layout, mode=[1])
    return cute.composition(layout, cute.make_layout((group, rows // group, width), stride=(1, group, rows)))


def packed_ragged_window(coords: cute.Tensor, offset, length) -> cute.Tensor:
    """``(group, 2^30, D, H)`` coordinates whose token ``r`` is token ``offset + r``, in bounds only for
    ``r < length``."""
    return cute.domain_offset((None, RAGGED_BIG - length, None, None),
                              coords[None, None, None, None, offset + length])


def create_scale_tma_tile(scales: cute.Tensor, kv_idx, layer_idx, rows_per_copy: int):
    """Scales ``[N, KVD, L, P, H, G]`` of one plane as one flat float32 run ``[1, rows * H * G]`` (MAX's 2-D
    ``[1, total]`` scale descriptor; a 1-D descriptor does not build in 4.8.1). Row ``r`` starts at ``r * H * G``,
    so a copy at ``(0, row * H * G)`` brings ``rows_per_copy`` consecutive rows' scales.
    """
    n, kvd, nl, p, h, g = scales.shape
    flat = flat_scales(scales, kv_idx, layer_idx)
    width = rows_per_copy * h * g
    smem = cute.make_layout((1, width), stride=(width, 1))
    atom, coords = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), flat, smem, (1, width))
    return atom, coords, smem


def flat_scales(scales: cute.Tensor, kv_idx, layer_idx) -> cute.Tensor:
    """Plane (``kv_idx``, ``layer_idx``) of scales ``[N, KVD, L, P, H, G]`` as ``[1, rows * H * G]``, the extent
    counted in 64 bits: it passes 2^31 on large caches (a TMA extent may reach 2^32)."""
    n, kvd, nl, p, h, g = scales.shape
    plane = scales[None, kv_idx, layer_idx, None, None, None]
    total = (Int64(n - 1) * (kvd * nl * p) + p) * (h * g)
    return cute.make_tensor(plane.iterator, cute.make_layout((1, total), stride=(total, 1)))


def create_gather4_tma_tile(row_view_2d: cute.Tensor, row_indices: cute.Tensor, tile_height: int, tile_width: int,
                            swizzle_bytes: int = 0):
    """SM100 gather4: ``tile_height`` (a multiple of 4) rows named by ``row_indices`` x ``tile_width`` columns.

    ``row_view_2d``: ``[num_kv_rows, tile_stride]`` (``tile_stride >= tile_width``, the row pitch).
    ``row_indices``: int32 ``[T]`` physical rows of one request's tokens. ``tile_width`` is at most 256 elements (a
    TMA box limit). Default: unswizzled row-major smem (MAX's SWIZZLE_NONE). With ``swizzle_bytes`` the tile is the
    MMA's K-major swizzled layout (``tile_width`` = the swizzle width); the kernel must then allocate it with the
    swizzle on the pointer (``allocate_tensor(dtype, layout.outer, swizzle=layout.inner)``): a swizzle inside the
    layout leaves each 4-row group's offset where the copy lowering ignores it, and every gather4 of the tile gets
    the same destination.
    """
    if tile_height % 4:
        raise ValueError(f"gather4 tile_height must be a multiple of 4, got {tile_height}")
    if swizzle_bytes:
        smem = smem_tile_layout(row_view_2d.element_type, tile_height, tile_width, swizzle_bytes)
    else:
        smem = cute.make_layout((tile_height, tile_width), stride=(tile_width, 1))  # row-major: one box per 4 rows
    index_layout = cute.make_tensor(row_indices.iterator,
                                    cute.make_layout((row_indices.shape[0], tile_width), stride=(1, 0)))
    atom, coords = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensor2DGather4G2SOp(), row_view_2d, smem,
                                               (tile_height, tile_width), gmem_coord_tensor=index_layout)
    return atom, coords, smem


def rope_row_view(blocks: cute.Tensor, kv_idx, layer_idx, content_bytes: int, rope_depth: int) -> cute.Tensor:
    """The BF16 rope tail ``[num_kv_rows, H, rope_depth]`` of rope-aware FP8 rows (``content_bytes`` fp8 first)."""
    if blocks.shape[5] != content_bytes + 2 * rope_depth:
        raise ValueError(f"rope-aware rows need head_size = {content_bytes} + 2*{rope_depth} bytes, "
                         f"got {blocks.shape[5]}")
    return kv_row_view(blocks, kv_idx, layer_idx, cutlass.BFloat16, content_bytes, rope_depth)


def create_rope_tma_tile(blocks: cute.Tensor, kv_idx, layer_idx, content_bytes: int, rope_depth: int,
                         rows_per_copy: int, swizzle_bytes: int = 128):
    """``create_tma_tile`` over the BF16 rope tail of rope-aware FP8 rows."""
    return create_tma_tile(rope_row_view(blocks, kv_idx, layer_idx, content_bytes, rope_depth), rows_per_copy,
                           rope_depth, swizzle_bytes)


def create_rope_gather4_tma_tile(blocks: cute.Tensor, kv_idx, layer_idx, content_bytes: int, rope_depth: int,
                                 row_indices: cute.Tensor, tile_height: int):
    """``create_gather4_tma_tile`` over the BF16 rope tail: rows of ``H * row_bytes / 2`` bf16 pitch."""
    view = rope_row_view(blocks, kv_idx, layer_idx, content_bytes, rope_depth)
    rows_2d = cute.make_tensor(view.iterator, cute.make_layout((view.shape[0], rope_depth),
                                                               stride=(view.stride[0], 1)))
    return create_gather4_tma_tile(rows_2d, row_indices, tile_height, rope_depth)
