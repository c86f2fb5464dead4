"""The arguments the attention kernels take, made the same way by every launcher: the K and V sources, the logits'
scales (SM90's ``softmax_args``, SM100's ``score_args``), the fp8 scales and the sliding window; and the MHA kernels'
trailing compile-time arguments (layout, per-tensor scales) in their keys (``layout_key``, ``layout_flags``)."""

from __future__ import annotations

import math
from typing import Optional

import torch

from cute_kv import tensor_scales

LOG2E = math.log2(math.e)
# Why an MLA cache in another layout than MAX's compact ``blocks`` takes the reference.
LAYOUT_PROBLEM = "a strided cache layout: the MLA kernels read MAX's compact blocks only"


def layout_key(key: tuple, layout: str, tensor_scaled: bool) -> tuple:
    """An MHA kernel's key for a compact cache as it is; a strided cache's adds ``v_dim`` (None) and the layout, a
    per-tensor-scaled cache's (either layout) also its flag: the kernel classes' trailing arguments."""
    if tensor_scaled:
        return key + (None, layout, True)
    return key if layout == "compact" else key + (None, layout)


def layout_flags(key: tuple, compact_len: int) -> tuple[bool, bool]:
    """``(strided, tensor_scaled)`` of a ``layout_key`` over a compact key of ``compact_len`` entries."""
    return "strided" in key[compact_len:], key[compact_len + 2:] == (True,)


def kv_sources(collection, strided: bool) -> tuple:
    """The MHA kernels' ``(k_src, v_src)``: MAX's compact ``blocks`` twice (the kernel picks each plane), or for a
    ``strided`` variant the K and V planes ``[N, L, P, H, D]`` with their own strides."""
    c = collection
    return (c.key_blocks, c.value_blocks) if strided else (c.blocks, c.blocks)


def softmax_args(head_dim: int, scale: Optional[float], softcap: Optional[float]) -> tuple[float, float]:
    """The SM90 kernels' ``(score_scale, softmax_scale_log2)``: ``q.k`` is scaled inside the base-2 exponent, or,
    soft-capped, by ``scale / softcap`` inside the tanh with ``softcap`` moved into the exponent's scale."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return (scale / softcap, softcap * LOG2E) if softcap else (1.0, scale * LOG2E)


def score_args(head_dim: int, scale: Optional[float], softcap: Optional[float]) -> tuple[float, float]:
    """``(score_scale, cap_log2)``: base-2 logits are ``score_scale * q.k``, or with a soft-cap ``c``,
    ``cap_log2 * tanh(score_scale * q.k)`` (``c * tanh(scale * q.k / c)`` in base 2)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


def scales_arg(collection, granularity: Optional[int], e8m0: bool, tensor_scaled: bool = False, k_scale=None,
               v_scale=None) -> Optional[torch.Tensor]:
    """What the kernel takes for the scales: none unless it dequantizes with them; e8m0 as its uint8 bits; per-tensor
    ``k_scale`` / ``v_scale`` as one float32 ``[2]`` (``tensor_scales.kernel_arg``)."""
    if tensor_scaled:
        return tensor_scales.kernel_arg(k_scale, v_scale, collection.device)
    if granularity is None:
        return None
    return collection.scales.view(torch.uint8) if e8m0 else collection.scales


def window_arg(window: Optional[int]) -> int:
    """The kernel's int32 ``window``: 0 for none; a wider window than int32 holds masks nothing more than 2^31-1."""
    return 0 if window is None else min(window, 2**31 - 1)
