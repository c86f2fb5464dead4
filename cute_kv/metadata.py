"""Per-step metadata builders: lookup tables, row offsets, max lengths (MAX's host-side conventions)."""

from __future__ import annotations

from typing import Sequence

import torch


def padded_lut_cols(num_pages: int) -> int:
    """Lookup-table columns MAX allocates: ``ceil(c/8)*8 + 16`` so a 16-wide vector read stays in bounds."""
    return -(-num_pages // 8) * 8 + 16


def make_lookup_table(page_lists: Sequence[Sequence[int]], sentinel: int, cols: int | None = None,
                      device=None) -> torch.Tensor:
    """uint32 ``[B, cols]``: row b starts with ``page_lists[b]``, the rest is ``sentinel``."""
    longest = max((len(p) for p in page_lists), default=0)
    cols = padded_lut_cols(longest) if cols is None else cols
    if cols < longest:
        raise ValueError(f"cols ({cols}) is below the longest page list ({longest})")
    lut = torch.full((len(page_lists), cols), sentinel, dtype=torch.int64)
    for b, pages in enumerate(page_lists):
        if len(pages):
            lut[b, : len(pages)] = torch.as_tensor(list(pages), dtype=torch.int64)
    return lut.to(torch.uint32).to(device)


def input_row_offsets(new_lengths: Sequence[int], device=None) -> torch.Tensor:
    """uint32 ``[B+1]`` prefix sums of the new-token counts."""
    ro = torch.zeros(len(new_lengths) + 1, dtype=torch.int64)
    if len(new_lengths):
        ro[1:] = torch.cumsum(torch.as_tensor(list(new_lengths), dtype=torch.int64), 0)
    return ro.to(torch.uint32).to(device)


def max_lengths(cache_lengths: Sequence[int], new_lengths: Sequence[int]) -> tuple[int, int]:
    """``(max_seq_length, max_cache_length)``: longest new run, longest context including it."""
    max_seq = max(new_lengths, default=0)
    max_ctx = max((c + n for c, n in zip(cache_lengths, new_lengths)), default=0)
    return int(max_seq), int(max_ctx)


def last_row_indices(input_row_offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]``: the row of each request's last new token (where its next-token logits are), ``-1`` for a
    request with no row this step."""
    ro = input_row_offsets.to(torch.int64)
    return torch.where(ro[1:] > ro[:-1], ro[1:] - 1, -1)
