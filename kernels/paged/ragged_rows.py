"""Where a ragged batch's row goes in the paged cache: the device-side half of MAX's ``input_row_offsets`` contract.

Row ``m`` of a step belongs to request ``b`` with ``ro[b] <= m < ro[b+1]`` and is token ``m - ro[b]`` of its new
tokens, so it lands at position ``cache_lengths[b] + m - ro[b]``: slot ``pos % P`` of page ``lut[b, pos // P]``.
Kernels that write rows (the KV store, the fused QKV epilogue) resolve a tile's rows once into shared memory,
one thread per row, so the binary searches run in parallel instead of in every thread that touches the row.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

# ``uint32`` offsets with B < 2^31 requests: the search halves [0, B) at most 31 times.
_MAX_SEARCH_STEPS = 31


@cute.jit
def request_of_row(m: Int32, input_row_offsets: cute.Tensor, batch: Int32) -> Int32:
    """The request ``b`` owning row ``m < ro[batch]``: the last ``b`` with ``ro[b] <= m`` (skips empty requests)."""
    lo = Int32(0)  # invariant: ro[lo] <= m < ro[hi]
    hi = batch
    for _ in cutlass.range(_MAX_SEARCH_STEPS, unroll=1):
        if hi - lo > 1:
            mid = (lo + hi) >> 1
            if Int32(input_row_offsets[mid]) <= m:
                lo = mid
            else:
                hi = mid
    return lo


@cute.jit
def request_rows(input_row_offsets: cute.Tensor, b: Int32, num_rows: Int32):
    """``(first row, row count)`` of request ``b``'s new tokens for a kernel that walks requests (attention), kept
    inside the step's ``num_rows`` rows: unchecked offsets (past the rows, decreasing, 2^31 or more, which the DSL's
    signed compares read as negative) give fewer or no rows, never rows past ``q`` or the output."""
    start = Int32(input_row_offsets[b])
    end = Int32(input_row_offsets[b + 1])
    if start < 0 or start > num_rows:
        start = num_rows
    if end < start:
        end = start
    if end > num_rows:
        end = num_rows
    return start, end - start


@cute.jit
def resolve_row(m: Int32, num_rows: Int32, input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor,
                lookup_table: cute.Tensor, num_pages: Int32, page_size: cutlass.Constexpr[int]):
    """``(page, pos)`` of step row ``m``: its slot is ``pos % page_size``, and the position is also what RoPE needs.

    Page -1 means "do not store": a row past the step, a page column past the lookup table's row, or an entry that
    is not a page of the cache (``>= num_pages``: the sentinel of an unowned column). With unchecked metadata
    (CUDA-graph steps) a step running past its pages is dropped instead of written past the allocation. Positions
    wrap as ``uint32`` metadata does, and a column or entry of 2^31 or more is refused like any other past the
    table or the pages.
    """
    page = Int32(-1)
    pos = Uint32(0)
    if m < num_rows:
        b = request_of_row(m, input_row_offsets, cache_lengths.shape[0])
        pos = Uint32(cache_lengths[b]) + Uint32(m) - Uint32(input_row_offsets[b])
        # The DSL compares 32-bit integers signed: values past 2^31 read as negative, so both bounds are checked.
        col = Int32(pos // page_size)
        if col >= 0 and col < lookup_table.shape[1]:
            entry = Int32(lookup_table[b, col])
            if entry >= 0 and entry < num_pages:
                page = entry
    return page, Int32(pos)


@cute.jit
def resolve_rows(s_page: cute.Tensor, s_pos: cute.Tensor, first_row: Int32, num_rows: Int32,
                 input_row_offsets: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
                 num_pages: Int32, page_size: cutlass.Constexpr[int]):
    """Thread ``t < size(s_page)`` writes row ``first_row + t``'s ``resolve_row`` to shared memory (page -1: no
    row). The caller synchronizes the CTA before reading them."""
    t, _, _ = cute.arch.thread_idx()
    if t < cute.size(s_page):
        page, pos = resolve_row(first_row + t, num_rows, input_row_offsets, cache_lengths, lookup_table, num_pages,
                                page_size)
        s_page[t] = page
        s_pos[t] = pos
