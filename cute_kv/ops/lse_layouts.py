"""The layouts of an attention call's LSE: ``"TH"``, ``[T, Hq]`` (MAX's and FlashInfer's), or ``"HT"``, ``[Hq, T]``
(FA4's, and what vLLM's ``merge_attn_states`` takes), and the ``lse=`` buffer a call writes it into.

The kernels and the reference write a row-major ``[T, Hq]``: an ``"HT"`` LSE, or a buffer whose ``[T, Hq]`` view
is not row-major (a column slice of a wider one), is written through a row-major temporary copied in after the call,
one more pass over ``T * Hq`` floats; a row-major ``"TH"`` buffer is written in place.
"""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.validate import check_tensor

LAYOUTS = ("TH", "HT")


def shape(num_tokens: int, num_heads: int, layout: str) -> list[int]:
    return [num_tokens, num_heads] if layout == "TH" else [num_heads, num_tokens]


def check(lse: Optional[torch.Tensor], layout: str, return_lse: bool, num_tokens: int, num_heads: int,
          device) -> None:
    """Raise naming the argument unless ``layout`` is one of ``LAYOUTS`` and ``lse`` is None or a float32 buffer of
    the layout's shape on ``device``, given with ``return_lse``."""
    if layout not in LAYOUTS:
        raise ValueError(f"lse_layout must be one of {LAYOUTS} ([T, Hq] or [Hq, T]), got {layout!r}")
    if lse is None:
        return
    if not return_lse:
        raise ValueError("lse is the buffer the LSE is written into, which return_lse=True asks for: pass "
                         "return_lse=True with it")
    check_tensor("lse", lse, dtype=torch.float32, shape=shape(num_tokens, num_heads, layout), device=device)


def new(num_tokens: int, num_heads: int, layout: str, device) -> torch.Tensor:
    """A float32 LSE of ``layout``'s shape, contiguous."""
    return torch.empty(shape(num_tokens, num_heads, layout), dtype=torch.float32, device=device)


def as_rows(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """``lse`` as ``[T, Hq]`` (a view)."""
    return lse if layout == "TH" else lse.t()


def in_place(lse: torch.Tensor, layout: str) -> bool:
    """Whether ``lse``'s ``[T, Hq]`` view is row-major: the call writes it directly (decided on strides alone, which
    a torch.compile trace follows)."""
    view = as_rows(lse, layout)
    return view.stride() == (view.shape[1], 1)


def rows(lse: torch.Tensor, layout: str) -> torch.Tensor:
    """The row-major ``[T, Hq]`` a call writes for ``lse``: its own view when ``in_place``, else a new one."""
    if in_place(lse, layout):
        return as_rows(lse, layout)
    return torch.empty(as_rows(lse, layout).shape, dtype=torch.float32, device=lse.device)


def written(lse: torch.Tensor, rows: torch.Tensor, layout: str) -> torch.Tensor:
    """``lse`` once the call has written ``rows`` (``rows(lse, layout)``): copied in unless they are its memory."""
    if not in_place(lse, layout):
        as_rows(lse, layout).copy_(rows)
    return lse
