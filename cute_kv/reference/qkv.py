"""Reference fused QKV projection: ``C = hidden @ weight^T (+ bias)``, Q returned, K and V written to the cache.

Columns of ``C`` (MAX's epilogue routing): ``[0, q_dim)`` are Q, then K (``H*D``), then V (``H*D``); an MLA
cache takes ``[Q | K]`` with a single latent head of width ``D``. Accumulation, bias and RoPE are float32;
each result is rounded once (Q to ``hidden.dtype``, K/V to the cache dtype, quantized when it has scales).
"""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.reference.ragged import positions
from cute_kv.reference.rope import RopeConfig, apply_rope
from cute_kv.reference.store import write_rows


def kv_columns(collection) -> int:
    """Columns of ``C`` that go to the cache: ``2*H*D``, or ``D`` for MLA."""
    return collection.kv_dim * collection.num_heads * collection.head_size


def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight: torch.Tensor,
                              collection, layer_idx: int, *, bias: Optional[torch.Tensor] = None,
                              rope: Optional[RopeConfig] = None, output: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``hidden [T, K]``, ``weight [N_tot, K]`` -> Q ``[T, q_dim]`` in ``hidden.dtype``; K/V go to layer ``layer_idx``.

    Q is written into ``output`` when given (and ``output`` returned).
    """
    c = hidden.to(torch.float32) @ weight.to(torch.float32).T
    if bias is not None:
        c = c + bias.to(torch.float32)
    d = collection.head_size
    q_dim = c.shape[1] - kv_columns(collection)
    q, kv = c[:, :q_dim], c[:, q_dim:].unflatten(1, (collection.kv_dim, collection.num_heads, d))
    k, v = kv[:, 0], (None if collection.is_mla else kv[:, 1])
    if rope is not None:
        pos = positions(input_row_offsets, collection.cache_lengths)
        q = apply_rope(q.unflatten(1, (-1, rope.q_head_dim or d)), pos, rope).flatten(1)
        k = apply_rope(k, pos, rope)
    write_rows(collection.get_key_cache(layer_idx), input_row_offsets, k)
    if v is not None:
        write_rows(collection.get_value_cache(layer_idx), input_row_offsets, v)
    return q.to(hidden.dtype) if output is None else output.copy_(q)
