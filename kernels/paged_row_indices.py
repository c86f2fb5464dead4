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
             base_alignment: cutlass.Constexpr[int]):
    """Fill ``rows`` for tokens ``[base_kv_row, base_kv_row + bn)`` of request ``batch_idx``.

    ``rows_per_page``: the page pitch in rows, ``KVD*L*P``. ``base_alignment``: compile-time promise that
    ``base_kv_row`` is a multiple of it (MAX's ``start_column_alignment``); a multi-page tile needs it ``>= P``
    (its first token starts a page), and the lookup table's row stride must be a multiple of the vector width.
    """
    eff_page, num_pages = tile_geometry(bn, page_size)
    lut = lookup_table[batch_idx, None]
    first = base_kv_row // page_size
    if cutlass.const_expr(num_pages == 1):
        row = Int32(lut[first]) * rows_per_page
        if cutlass.const_expr(base_alignment % page_size != 0):  # the tile may start inside its page
            row = row + base_kv_row % page_size
        rows[0] = row
    else:
        if cutlass.const_expr(base_alignment < page_size):
            raise ValueError(f"a tile of {num_pages} pages needs base_alignment >= page_size ({page_size}), "
                             f"got {base_alignment}")
        chunk = lut_chunk(num_pages, base_alignment, page_size)
        entries = cute.make_rmem_tensor((chunk,), lookup_table.element_type)
        for c in cutlass.range_constexpr(num_pages // chunk):
            # first % chunk == 0 (from base_alignment), so this is the aligned chunk-th vector of the row.
            cute.autovec_copy(cute.local_tile(lut, (chunk,), (first // chunk + c,)), entries)
            for i in cutlass.range_constexpr(chunk):
                rows[c * chunk + i] = Int32(entries[i]) * rows_per_page
