"""Reference fused QKV projection: ``C = hidden @ weight^T (+ bias)``, Q returned, K and V written to the cache.

Columns of ``C`` (MAX's epilogue routing): ``[0, q_dim)`` are Q, then K (``H*D``), then V (``H*D``); an MLA
cache takes ``[Q | K]`` with a single latent head of width ``D``. Per row, in float32: the product (weights
dequantized first, int4 rounded to ``hidden.dtype``, fp8 scaled after: ``reference/weights.py``), ``+ bias``,
QK-norm of Q and K (``reference/norm.py``), then RoPE of Q and K; each result is rounded once (Q to
``hidden.dtype``, K/V to the cache dtype, quantized when it has scales).
"""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.reference.norm import QKNorm, rms_norm_heads
from cute_kv.reference.ragged import positions
from cute_kv.reference.rope import RopeConfig, apply_rope
from cute_kv.reference.store import write_rows
from cute_kv.reference.weights import Fp8Weight, dequantize


def kv_columns(collection) -> int:
    """Columns of ``C`` that go to the cache: ``2*H*D``, or ``D`` for MLA (``latent_dim`` for a rope-aware cache,
    whose rows store it in ``D`` bytes)."""
    return collection.kv_dim * collection.num_heads * collection.latent_dim


def q_head_dim(rope: Optional[RopeConfig], head_size: int) -> int:
    """Width of a Q head: ``rope.q_head_dim`` when RoPE sets it, else the cache head size."""
    return (rope.q_head_dim if rope is not None else None) or head_size


def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight, collection,
                              layer_idx: int, *, bias: Optional[torch.Tensor] = None, rope: Optional[RopeConfig] = None,
                              output: Optional[torch.Tensor] = None, qk_norm: Optional[QKNorm] = None) -> torch.Tensor:
    """``hidden [T, K]``, ``weight [N_tot, K]`` (a tensor, ``Int4Weight`` or ``Fp8Weight``) -> Q ``[T, q_dim]`` in
    ``hidden.dtype``; K/V go to layer ``layer_idx``.

    Q is written into ``output`` when given (and ``output`` returned).
    """
    if isinstance(weight, Fp8Weight):  # the per-channel scale on the float32 product, as the kernel applies it
        c = (hidden.to(torch.float32) @ weight.weight.to(torch.float32).T) * weight.scales
    else:
        c = hidden.to(torch.float32) @ dequantize(weight, hidden.dtype).T
    if bias is not None:
        c = c + bias.to(torch.float32)
    d = collection.latent_dim
    q_dim = c.shape[1] - kv_columns(collection)
    q, kv = c[:, :q_dim], c[:, q_dim:].unflatten(1, (collection.kv_dim, collection.num_heads, d))
    k, v = kv[:, 0], (None if collection.is_mla else kv[:, 1])
    heads = lambda x: x.unflatten(1, (-1, q_head_dim(rope, d)))  # noqa: E731 -- Q as [T, heads, head size]
    if qk_norm is not None:
        norm = qk_norm.epsilon, qk_norm.weight_offset
        if qk_norm.q_weight is not None:
            q = rms_norm_heads(heads(q), qk_norm.q_weight, *norm).flatten(1)
        if qk_norm.k_weight is not None:
            k = rms_norm_heads(k, qk_norm.k_weight, *norm)
    if rope is not None:
        pos = positions(input_row_offsets, collection.cache_lengths)
        q = apply_rope(heads(q), pos, rope).flatten(1)
        k = apply_rope(k, pos, rope)
    write_rows(collection.get_key_cache(layer_idx), input_row_offsets, k)
    if v is not None:
        write_rows(collection.get_value_cache(layer_idx), input_row_offsets, v)
    return q.to(hidden.dtype) if output is None else output.copy_(q)
