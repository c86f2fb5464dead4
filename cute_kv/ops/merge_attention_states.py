"""``cute_kv.merge_attention_states``: attention over two disjoint key sets merged from their outputs and LSEs.

It runs as PyTorch ops on the tensors' device (``cute_kv/reference/merge.py``): elementwise passes in float32, on
the CPU and on CUDA alike, so not a fallback. There is no CuTe DSL kernel for it: ``AttentionCombine``
(``kernels/attention/combine.py``) merges the split-KV partials the attention kernels write into one float32
``[splits, T, H, D]`` buffer with base-2 LSEs, and two separate outputs would first have to be copied into that
buffer (12 bytes per element of bf16 inputs, twice what a merge reading them in place moves).
"""

from __future__ import annotations

import torch

from cute_kv.ops import lse_layouts
from cute_kv.reference.merge import merge_attention_states as _reference
from cute_kv.validate import check_tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def merge_attention_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor, *,
                           lse_layout: str = "TH") -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of attention over keys ``A ∪ B``, from ``(o_a, lse_a)`` over ``A`` and ``(o_b, lse_b)`` over ``B``
    (FlashInfer's ``merge_state(v_a, s_a, v_b, s_b)``): ``lse = log(e^lse_a + e^lse_b)``,
    ``o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b``.

    ``o_a``, ``o_b``: ``[T, H, D]``, bf16/fp16/fp32, the same dtype; ``lse_a``, ``lse_b``: float32 ``[T, H]``, natural
    log, as ``paged_attention(..., return_lse=True)`` returns them, or ``[H, T]`` with ``lse_layout="HT"`` (FA4's and
    vLLM's ``merge_attn_states``; the merged ``lse`` then comes back as ``[H, T]`` too, contiguous). FlashInfer's
    LSEs are base 2: multiply them by ``math.log(2)`` first (and the merged ``lse`` by ``1 / math.log(2)`` to hand it
    back). A row whose ``lse`` is
    ``-inf`` on one side (no key there) takes the other side as it is, whatever that side's ``o`` holds (NaN
    included); ``-inf`` on both gives ``o = 0`` and ``lse = -inf``. Returns ``o`` in ``o_a.dtype`` and ``lse``
    float32, computed in float32.
    """
    check_tensor("o_a", o_a, dtype=DTYPES, ndim=3)
    check_tensor("o_b", o_b, dtype=o_a.dtype, shape=list(o_a.shape), device=o_a.device)
    if lse_layout not in lse_layouts.LAYOUTS:
        raise ValueError(f"lse_layout must be one of {lse_layouts.LAYOUTS} ([T, H] or [H, T]), got {lse_layout!r}")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        check_tensor(name, lse, dtype=torch.float32, shape=lse_layouts.shape(*o_a.shape[:2], lse_layout),
                     device=o_a.device)
    o, lse = _reference(o_a, lse_layouts.as_rows(lse_a, lse_layout), o_b, lse_layouts.as_rows(lse_b, lse_layout))
    return o, lse if lse_layout == "TH" else lse.t().contiguous()
