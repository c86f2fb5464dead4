"""Merging attention over two disjoint key sets (FlashInfer's ``merge_state``, vLLM's ``merge_attn_states``).

Attention over keys ``A ∪ B`` from attention over each: with ``lse`` the natural-log sum of ``e^logit`` (this
project's convention, ``paged_attention(..., return_lse=True)``), ``lse = log(e^lse_a + e^lse_b)`` and
``o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b``, computed against ``m = max(lse_a, lse_b)`` so no exponent
overflows. A side with ``lse = -inf`` saw no key (an empty split): its weight is 0 and its ``o`` is not read, so it
may hold anything, NaN included. When both are ``-inf`` the row is ``o = 0``, ``lse = -inf``, as in
``AttentionCombine`` (``kernels/attention/combine.py``).
"""

from __future__ import annotations

import torch


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``o_x [T, H, D]``, ``lse_x`` float32 ``[T, H]`` -> ``(o [T, H, D] in o_a.dtype, lse float32 [T, H])``;
    float32 arithmetic."""
    m = torch.maximum(lse_a, lse_b)
    m = torch.where(torch.isneginf(m), 0.0, m)  # both sides empty: any finite shift
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = w_a + w_b
    acc = torch.zeros(o_a.shape, dtype=torch.float32, device=o_a.device)
    for o, w in ((o_a, w_a), (o_b, w_b)):
        w = w[..., None]
        acc = torch.where(w > 0, acc + w * o.to(torch.float32), acc)  # an empty side's o is never mixed in
    acc = acc * torch.where(total > 0, 1.0 / total, 0.0)[..., None]
    return acc.to(o_a.dtype), m + torch.log(total)
