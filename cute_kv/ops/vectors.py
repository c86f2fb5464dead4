"""What the kernels' 16-byte row accesses (TMA boxes, vector loads and stores) need of a torch tensor."""

from __future__ import annotations

from typing import Optional

import torch


def rows_aligned(x: torch.Tensor) -> bool:
    """Row-major 2-D with 16-byte aligned rows."""
    return x.stride(1) == 1 and x.stride(0) % (16 // x.element_size()) == 0 and x.data_ptr() % 16 == 0


def heads_packed(x: torch.Tensor, vec: int) -> bool:
    """``[T, H, D]`` with heads back to back, rows ``vec``-element aligned and apart (an expanded, stride-0 token dim
    is copied: TMA descriptors and stores need distinct rows) and a 16-byte aligned base."""
    return (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) % vec == 0
            and (x.shape[0] <= 1 or x.stride(0) >= x.shape[1] * x.shape[2]) and x.data_ptr() % 16 == 0)


def packed_heads(x: Optional[torch.Tensor], vec: int) -> Optional[torch.Tensor]:
    """``x`` itself when ``heads_packed``, else a contiguous copy."""
    if x is None or heads_packed(x, vec):
        return x
    return x.clone(memory_format=torch.contiguous_format)
