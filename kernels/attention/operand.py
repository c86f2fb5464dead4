"""What an attention kernel needs from a KV source (MAX's ``MHAOperand``): a row view TMA can load, the rows of a
BN-token tile (``populate``), the scales of an fp8 cache, and where a request's keys end.

Two sources, one kernel: ``KVCacheMHAOperand`` reads one K or V plane of a paged cache (and its scales) through the
lookup table; ``DenseMHAOperand`` reads a ``[B, S, H, D]`` cache (MAX's ``LayoutTensorMHAOperand``: token ``t`` of
request ``b`` is row ``b*stride[0]/stride[1] + t``). Both are compile-time objects: the kernel calls ``row_view``,
``rows_per_page`` and ``scale_view`` while tracing its host side, and ``populate`` on the device. A tile slot past
the request's keys gets the view's row count, a row TMA zero-fills, so no page the request does not own is read.
A request's key count is ``cache_lengths[b]`` plus its new tokens (``input_row_offsets``), as for MAX's operands.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.runtime import make_fake_tensor

from cute_kv.kernels.attention.config import page_slot
from cute_kv.kernels.paged.populate import key_row, populate
from cute_kv.kernels.paged.tma_tiles import kv_row_view, plane_row_view, plane_rows_per_page
from cute_kv.row_indices import lut_chunk


class KVCacheMHAOperand:
    """Plane ``kv_idx`` (0: K, 1: V) of a paged cache ``blocks [N, KVD, L, P, H, D]``, tiles of ``bn`` tokens; with
    ``strided`` the source is the plane itself, ``[N, L, P, H, D]`` with runtime strides (``plane_row_view``: a
    foreign layout read in place; no scales).

    ``lut_vector``: the lookup table's rows are padded and aligned for vector reads of a tile's entries (else one
    entry at a time).

    A tile is ``config.page_slot`` slots of rows, one TMA box each: whole pages of a tile, the tile in a page, or
    (neither dividing the other: a 112-key tile over 64-row pages) parts of pages, each slot's row from its own
    lookup entry, read one by one (``partial_pages``).
    """

    def __init__(self, kv_idx: int, page_size: int, bn: int, lut_vector: bool, strided: bool = False):
        self.kv_idx, self.page_size, self.bn, self.strided = kv_idx, page_size, bn, strided
        self.rows_per_copy = page_slot(page_size, bn)
        self.copies_per_tile = bn // self.rows_per_copy
        self.partial_pages = self.rows_per_copy < min(page_size, bn)
        # A multi-page tile starts on a page; base_alignment = P makes populate read its entries one by one. A tile
        # inside a page (P >= BN) reads one entry either way and starts at a multiple of BN within it.
        self.base_alignment = bn if (lut_vector and not self.partial_pages) or page_size >= bn else page_size
        # Lookup entries per load (1 for a one-page tile): the table's row stride and base must be multiples of it.
        self.lut_width = 1 if self.partial_pages else lut_chunk(self.copies_per_tile, self.base_alignment, page_size)

    def row_view(self, blocks: cute.Tensor, layer_idx: Int32) -> cute.Tensor:
        if self.strided:
            return plane_row_view(blocks, layer_idx)
        return kv_row_view(blocks, self.kv_idx, layer_idx)

    def fake_source(self, dtype, num_kv_heads: int, head_dim: int, kv_dim: int,
                    heads_adjacent: bool = False) -> cute.Tensor:
        """The compile-time stand-in of what ``row_view`` reads: ``blocks [N, KVD, L, P, H, D]``, or (``strided``)
        a plane ``[N, L, P, H, D]`` whose strides but the depth's are runtime values, each a whole number of 16-byte
        units (TMA's stride rule); ``heads_adjacent`` fixes the head stride to ``D`` (a view that reads a token's
        heads as one row: gather4's). K and V share it: their planes have one shape and one set of strides."""
        p, h, d = self.page_size, num_kv_heads, head_dim
        if self.strided:
            unit = lambda: cute.sym_int64(divisibility=128 // dtype.width)  # noqa: E731 -- 16 bytes
            return make_fake_tensor(dtype, (cute.sym_int32(), cute.sym_int32(), p, h, d),
                                    stride=(unit(), unit(), unit(), d if heads_adjacent else unit(), 1),
                                    assumed_align=16)
        return make_fake_tensor(dtype, (cute.sym_int32(), kv_dim, cute.sym_int32(), p, h, d), stride=(
            cute.sym_int64(divisibility=kv_dim * p * h * d), cute.sym_int64(divisibility=p * h * d), p * h * d,
            h * d, d, 1), assumed_align=16)

    def rows_per_page(self, blocks: cute.Tensor):
        """Row pitch of a page in the row view: ``KVD*L*P`` (strided: ``sN / sP``)."""
        if self.strided:
            return plane_rows_per_page(blocks)
        return blocks.shape[1] * blocks.shape[2] * self.page_size

    def scale_view(self, scales: cute.Tensor, layer_idx: Int32) -> cute.Tensor:
        """``[num_kv_rows, H, G]`` scales of this plane, rows numbered as ``row_view``'s (``[N, KVD, L, P, H, G]``
        shares the cache's page geometry)."""
        return kv_row_view(scales, self.kv_idx, layer_idx)

    @cute.jit
    def populate(self, rows: cute.Tensor, lookup_table: cute.Tensor, batch_idx: Int32, base_kv_row: Int32,
                 num_keys: Int32, rows_per_page: Int32, oob_row: Int32):
        if cutlass.const_expr(self.partial_pages):
            for i in cutlass.range_constexpr(self.copies_per_tile):
                rows[i] = key_row(lookup_table, batch_idx, base_kv_row + i * self.rows_per_copy, num_keys,
                                  rows_per_page, self.page_size, oob_row)
        else:
            populate(rows, lookup_table, batch_idx, base_kv_row, rows_per_page, self.bn, self.page_size,
                     self.base_alignment, num_keys, oob_row)


class DenseMHAOperand:
    """A ``[B, S, H, D]`` K or V cache, tiles of ``bn`` tokens: a request's tokens are rows of ``H*D`` back to back
    (``stride[1] == H*D``), requests ``stride[0]`` elements apart, a multiple of ``H*D`` (``S`` rows, or more when the
    cache is a slice of a longer one)."""

    def __init__(self, bn: int):
        self.bn = bn
        self.rows_per_copy, self.copies_per_tile = bn, 1

    def row_view(self, cache: cute.Tensor, layer_idx: Int32) -> cute.Tensor:
        """``[rows, H, D]``: token ``t`` of request ``b`` is row ``b * rows_per_page + t``."""
        b, s, h, d = cache.shape
        rows = (b - 1) * self.rows_per_page(cache) + s
        return cute.make_tensor(cache.iterator, cute.make_layout((rows, h, d), stride=(cache.stride[1],
                                                                                       cache.stride[2], 1)))

    def rows_per_page(self, cache: cute.Tensor):
        """Rows from one request to the next: ``stride[0] / stride[1]``."""
        return Int32(cache.stride[0] // cache.stride[1])

    @cute.jit
    def populate(self, rows: cute.Tensor, lookup_table: cutlass.Constexpr, batch_idx: Int32, base_kv_row: Int32,
                 num_keys: Int32, rows_per_page: Int32, oob_row: Int32):
        rows[0] = oob_row
        if base_kv_row < num_keys:
            rows[0] = batch_idx * rows_per_page + base_kv_row
