"""Comparisons the kernel and reference tests share."""

import torch

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error, in float64."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    return float((got - want).norm() / want.norm())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns, so a NaN compares equal to the same NaN."""
    return t.view(_INT[t.element_size()])
