"""Walking a ragged step: request ``b`` owns rows ``[ro[b], ro[b+1])`` and starts at position ``cache_lengths[b]``."""

from __future__ import annotations

from typing import Iterator

import torch


def requests(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
    """``(b, row_start, row_stop, cache_length)`` for every request with at least one new row."""
    ro = input_row_offsets.to(torch.int64).tolist()
    cl = cache_lengths.to(torch.int64).tolist()
    for b, cache_length in enumerate(cl):
        if ro[b + 1] > ro[b]:
            yield b, ro[b], ro[b + 1], cache_length


def ragged_coords(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``([T], [T])``: the request ``b`` of every ragged row and its position ``cache_lengths[b] + i``."""
    ro = input_row_offsets.to(torch.int64)
    lengths = ro[1:] - ro[:-1]
    batch = torch.repeat_interleave(torch.arange(lengths.shape[0], device=ro.device), lengths)
    rows = torch.arange(batch.shape[0], device=ro.device)
    return batch, cache_lengths.to(torch.int64)[batch] + rows - ro[batch]


def positions(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]``: the absolute position ``cache_lengths[b] + i`` of every ragged row (the RoPE positions),
    on the tensors' device. Takes the uint32 metadata as is (torch has no uint32 arithmetic)."""
    return ragged_coords(input_row_offsets, cache_lengths)[1]
