"""Device-side ``PagedKVCache.populate``: the physical rows of one BN-token KV tile, read from the lookup table.

The host twin is ``cute_kv.row_indices`` (same geometry rules, checked against MAX's). ``rows[i]`` is the row view
row (``tma_tiles.kv_row_view``) of token ``base_kv_row + i * eff_page``; a tile that spans ``num_pages`` pages reads
their lookup entries as aligned vectors of ``chunk`` uint32 (up to 32 bytes per load) instead of one by one.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_kv.row_indices import lut_chunk, tile_geometry


def populate_rows(bn: int, page_size: int) -> cute.Tensor:
    """Register storage for one tile's rows (one per page slot)."""
    return cute.make_rmem_tensor((tile_geometry(bn, page_size)[1],), Int32)


@cute.jit
def populate(rows: cute.Tensor, lookup_table: cute.Tensor, batch_idx: Int32, base_kv_row: Int32,
             rows_per_page: Int32, bn: cutlass.Constexpr[int], page_size: cutlass.Constexpr[int],
             base_alignment: cutlass.Constexpr[int], num_tokens: Int32 = None, oob_row: Int32 = None):
    """Fill ``rows`` for tokens ``[base_kv_row, base_kv_row + bn)`` of request ``batch_idx``.

    ``rows_per_page``: the page pitch in rows, ``KVD*L*P``. ``base_alignment``: compile-time promise that
    ``base_kv_row`` is a multiple of it (MAX's ``start_column_alignment``); a multi-page tile needs it ``>= P``
    (its first token starts a page), and the lookup table's row stride must be a multiple of the vector width.

    With ``num_tokens`` (the request's length), a page slot starting at or past it, or whose column lies past the
    lookup table's row (unchecked lengths), gets ``oob_row`` (a row past the descriptor, which TMA zero-fills) and its
    lookup entries are not read: a tile's last pages may lie past the pages the request owns, or past the end of the
    lookup table's row. A vector is read when its first entry is needed, so the row length must then be a multiple
    of the vector width too.
    """
    eff_page, num_pages = tile_geometry(bn, page_size)
    lut = lookup_table[batch_idx, None]
    first = base_kv_row // page_size
    if cutlass.const_expr(num_pages == 1):
        if cutlass.const_expr(num_tokens is None):
            rows[0] = _page_row(lut, first, rows_per_page, base_kv_row, page_size, base_alignment)
        else:
            rows[0] = oob_row
            if base_kv_row < num_tokens and first < lut.shape[0]:
                rows[0] = _page_row(lut, first, rows_per_page, base_kv_row, page_size, base_alignment)
    else:
        if cutlass.const_expr(base_alignment < page_size):
            raise ValueError(f"a tile of {num_pages} pages needs base_alignment >= page_size ({page_size}), "
                             f"got {base_alignment}")
        chunk = lut_chunk(num_pages, base_alignment, page_size)
        for c in cutlass.range_constexpr(num_pages // chunk):
            if cutlass.const_expr(num_tokens is None):
                _read_vector(rows, lut, first, c, chunk, rows_per_page)
            else:
                for i in cutlass.range_constexpr(chunk):
                    rows[c * chunk + i] = oob_row
                if base_kv_row + c * chunk * page_size < num_tokens and first + c * chunk < lut.shape[0]:
                    _read_vector(rows, lut, first, c, chunk, rows_per_page)
                    for i in cutlass.range_constexpr(chunk):
                        if base_kv_row + (c * chunk + i) * page_size >= num_tokens:
                            rows[c * chunk + i] = oob_row


@cute.jit
def _page_row(lut: cute.Tensor, first: Int32, rows_per_page: Int32, base_kv_row: Int32,
              page_size: cutlass.Constexpr[int], base_alignment: cutlass.Constexpr[int]) -> Int32:
    """Row of token ``base_kv_row`` for a tile inside one page."""
    row = Int32(lut[first]) * rows_per_page
    if cutlass.const_expr(base_alignment % page_size != 0):  # the tile may start inside its page
        row = row + base_kv_row % page_size
    return row


@cute.jit
def _read_vector(rows: cute.Tensor, lut: cute.Tensor, first: Int32, c: cutlass.Constexpr[int],
                 chunk: cutlass.Constexpr[int], rows_per_page: Int32):
    """Rows of the ``c``-th ``chunk`` of the tile's pages, from one aligned vector load of lookup entries."""
    entries = cute.make_rmem_tensor((chunk,), lut.element_type)
    # first % chunk == 0 (from base_alignment), so this is the aligned chunk-th vector of the row.
    cute.autovec_copy(cute.local_tile(lut, (chunk,), (first // chunk + c,)), entries)
    for i in cutlass.range_constexpr(chunk):
        rows[c * chunk + i] = Int32(entries[i]) * rows_per_page


@cute.jit
def key_row(lookup_table: cute.Tensor, batch_idx: Int32, key: Int32, num_keys: Int32, rows_per_page: Int32,
            page_size: cutlass.Constexpr[int], oob_row: Int32) -> Int32:
    """Row of key ``key`` (>= 0) of request ``batch_idx``, one key at a time (the gather4 paths): lookup entry x
    page pitch + offset in the page. ``oob_row`` (which TMA zero-fills) for a key past ``num_keys`` or whose page
    column lies past the lookup table's row (unchecked lengths); that entry is not read."""
    row = oob_row
    if key < num_keys:
        page = key // page_size
        if page < lookup_table.shape[1]:
            row = Int32(lookup_table[batch_idx, page]) * rows_per_page + key % page_size
    return row
