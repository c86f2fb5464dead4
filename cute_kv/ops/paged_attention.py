"""``cute_kv.paged_attention``: causal / sliding-window attention of a ragged step over a paged KV cache."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from cute_kv import reference
from cute_kv.validate import check_activation, check_step, check_tensor


def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int, *,
                    causal: bool = True, window: Optional[int] = None, scale: Optional[float] = None,
                    mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over layer ``layer_idx``; returns ``[T, Hq, D_v]`` in ``q.dtype`` (or ``out``).

    Query ``i`` of request ``b`` is at position ``p = cache_lengths[b] + i`` and sees keys ``j`` in
    ``[0, cache_lengths[b] + seq_len_b)`` read through the lookup table, so this step's K/V must already be
    stored; ``causal`` keeps ``j <= p`` and ``window`` (needs ``causal``) also ``j > p - window``. GQA: query
    head ``hq`` reads KV head ``hq // (Hq // H)``. ``scale`` defaults to ``1/sqrt(D)``. ``q`` is in the cache
    dtype (bf16/fp16/fp32 for fp8 caches, which are dequantized with their scales). An MLA cache needs
    ``mla_v_dim``: values are the first ``mla_v_dim`` dims of the latent K rows (``D_v = mla_v_dim``).
    """
    _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, mla_v_dim, out)
    run = _kernel_for(collection, q, window, mla_v_dim) or reference.paged_attention
    return run(q, input_row_offsets, collection, layer_idx, causal=causal, window=window, scale=scale,
               mla_v_dim=mla_v_dim, out=out)


def _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, mla_v_dim, out) -> None:
    collection.check_layer(layer_idx)
    check_activation("q", q, collection, ndim=3)
    t, hq, d = q.shape
    h = collection.num_heads
    if d != collection.head_size:
        raise ValueError(f"q head dim ({d}) must equal the cache head_size ({collection.head_size})")
    if hq == 0 or hq % h:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the cache's KV heads ({h})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise ValueError("window (a sliding causal window) needs causal=True")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    d_v = _check_mla_v_dim(mla_v_dim, collection)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=[t, hq, d_v], device=collection.device)
    check_step(collection, input_row_offsets, t)


def _check_mla_v_dim(mla_v_dim, collection) -> int:
    """``D_v``: ``mla_v_dim`` for an MLA cache (required, in ``[1, D]``), the head size otherwise (must be None)."""
    d = collection.head_size
    if not collection.is_mla:
        if mla_v_dim is not None:
            raise ValueError("mla_v_dim is only for MLA caches (KVD=1); this cache stores V")
        return d
    if isinstance(mla_v_dim, bool) or not isinstance(mla_v_dim, int) or not 0 < mla_v_dim <= d:
        raise ValueError(f"mla_v_dim must be an int in [1, {d}] for an MLA cache, got {mla_v_dim!r}")
    return mla_v_dim


def _kernel_for(collection, q, window, mla_v_dim) -> Optional[Callable]:
    """The GPU kernel serving these arguments, or None for the reference (no kernel exists yet)."""
    return None
