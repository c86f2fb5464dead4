"""Reference attention of ragged queries over a paged KV cache (MAX's ``flash_attention_kv_cache_ragged``).

Query ``i`` of request ``b`` sits at absolute position ``p = cache_lengths[b] + i`` and attends keys
``j`` in ``[0, cache_lengths[b] + seq_len_b)`` (the new K/V must already be in the cache), with
``j <= p`` when causal and ``j > p - window`` with a sliding window. Query head ``hq`` reads KV head
``hq // (Hq // H)`` (GQA). Scores, softmax and the weighted sum are float32; fp8 caches are dequantized
with their scales (per granule, or per tensor: ``k_scale`` / ``v_scale``). An MLA cache (KVD=1) holds one latent
head: keys are whole rows and values are their first ``mla_v_dim`` dims; a rope-aware FP8 MLA cache is read as its
logical rows ``concat(content * scale, rope)`` (``cute_kv/rope_aware.py``), ``latent_dim`` wide.

Logits are ``s = scale * q.k``, soft-capped first when ``softcap = c > 0`` (Gemma 2: ``s <- c * tanh(s / c)``),
then masked. A sink (gpt-oss: ``sinks[hq]``, a logit per query head) joins the softmax denominator only:
``out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m))`` with ``m`` the max of the logits and the
sink. ``lse`` is the natural log of that denominator plus ``m``, so attention over disjoint key sets merges as
``o = sum_i e^(lse_i - lse) o_i`` with ``lse = log sum_i e^(lse_i)``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from cute_kv.reference.ragged import requests


def causal_mask(cache_length: int, seq_len: int, window: Optional[int], device=None) -> torch.Tensor:
    """bool ``[seq_len, cache_length + seq_len]``: may query ``i`` see key ``j``."""
    p = cache_length + torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(cache_length + seq_len, device=device)[None, :]
    visible = j <= p
    return visible if window is None else visible & (j > p - window)


def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int, *,
                    causal: bool = True, window: Optional[int] = None, scale: Optional[float] = None,
                    softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                    mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None,
                    lse: Optional[torch.Tensor] = None, return_lse: bool = False, k_scale=None, v_scale=None):
    """``q [T, Hq, D]`` -> ``[T, Hq, D_v]`` in ``q.dtype`` (``D_v`` = ``D``, or ``mla_v_dim`` for MLA), or into ``out``;
    with ``return_lse`` also ``lse`` float32 ``[T, Hq]`` (into ``lse`` when given): ``(out, lse)``.

    Rows of requests with no new tokens do not exist; every query sees at least itself, so no row is NaN.
    ``k_scale`` / ``v_scale`` (floats or one-element tensors) dequantize an fp8 cache's K and V per tensor.
    """
    t, hq, d = q.shape
    h = collection.num_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k_cache = collection.get_key_cache(layer_idx)
    v_cache = None if collection.is_mla else collection.get_value_cache(layer_idx)
    d_v = mla_v_dim if collection.is_mla else collection.head_size
    acc = torch.empty((t, hq, d_v), dtype=torch.float32, device=q.device)
    lse_acc = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    sink = None if sinks is None else sinks.to(torch.float32).view(h, hq // h, 1, 1)
    for b, start, stop, cache_length in requests(input_row_offsets, collection.cache_lengths):
        n_keys = cache_length + stop - start
        k = k_cache.gather(b, 0, n_keys)  # [S, H, D] float32
        v = k[..., :d_v] if v_cache is None else v_cache.gather(b, 0, n_keys)
        if k_scale is not None:
            k, v = k * k_scale, v * v_scale
        qb = q[start:stop].to(torch.float32).unflatten(1, (h, hq // h))  # [n, H, group, D]
        s = torch.einsum("nhgd,shd->hgns", qb, k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            s = s.masked_fill(~causal_mask(cache_length, stop - start, window, s.device), float("-inf"))
        if sink is not None:  # one more logit per row, whose value row is zero
            s = torch.cat([s, sink.expand(*s.shape[:3], 1)], dim=-1)
        row_lse = s.logsumexp(dim=-1)  # [H, group, n]
        p = (s - row_lse[..., None]).exp()[..., :n_keys]
        acc[start:stop] = torch.einsum("hgns,shd->nhgd", p, v).flatten(1, 2)
        lse_acc[start:stop] = row_lse.permute(2, 0, 1).flatten(1, 2)
    out = acc.to(q.dtype) if out is None else out.copy_(acc)
    if not return_lse:
        return out
    return out, lse_acc if lse is None else lse.copy_(lse_acc)
