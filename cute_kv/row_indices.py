"""``PagedRowIndices``: the physical rows of one BN-row KV tile, as ``PagedKVCache.populate`` returns them."""

from __future__ import annotations

import dataclasses


def lowbit(x: int) -> int:
    """Largest power of two dividing ``x`` (``x > 0``)."""
    return x & -x


def tile_geometry(bn: int, page_size: int) -> tuple[int, int]:
    """``(eff_page, num_pages)``: rows per page slot of a BN tile, and page slots per tile (MAX's rule)."""
    eff_page = bn if (page_size <= 0 or page_size >= bn) else page_size
    return eff_page, bn // eff_page


def lut_chunk(num_pages: int, base_alignment: int, page_size: int) -> int:
    """Width (uint32 entries) of each aligned vector load of the lookup table, capped at 8."""
    return min(lowbit(num_pages), lowbit(max(base_alignment // page_size, 1)), 8)


@dataclasses.dataclass(frozen=True)
class PagedRowIndices:
    """Rows ``rows[i]`` = physical row of token ``base_kv_row + i * eff_page`` (flattened row view).

    With ``pair_cta`` (SM100 2-CTA MMA) the storage covers V's full BN; K's TMA covers BN/2 and the
    non-leader CTA reads the second half (``k_row``).
    """

    bn: int
    page_size: int
    eff_page: int
    num_pages: int
    chunk: int
    rows: tuple[int, ...]
    pair_cta: bool = False
    is_leader: bool = True

    def get_row(self, offset: int) -> int:
        """Physical row of token ``base_kv_row + offset``, ``0 <= offset < BN``."""
        if not 0 <= offset < self.bn:
            raise IndexError(f"offset must be in [0, {self.bn}), got {offset}")
        if self.num_pages == 1:
            return self.rows[0] + offset
        return self.rows[offset // self.eff_page] + offset % self.eff_page

    def k_row(self, offset: int) -> int:
        """Row of K token ``offset`` of this CTA's half when ``pair_cta`` (else the same as ``get_row``)."""
        if self.pair_cta and not self.is_leader:
            return self.get_row(offset + self.bn // 2)
        return self.get_row(offset)


def lut_vector(collection, key_tile: int) -> bool:
    """Whether the kernel may read the lookup table's rows in ``lut_chunk`` vectors (width, stride, alignment)."""
    p = collection.page_size
    chunk = lut_chunk(tile_geometry(key_tile, p)[1], key_tile, p)
    lut = collection.lookup_table
    return lut.shape[1] % chunk == 0 and lut.stride(0) % chunk == 0 and lut.data_ptr() % (4 * chunk) == 0
