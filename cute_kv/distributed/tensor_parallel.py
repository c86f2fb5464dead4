"""Tensor parallelism by heads: each rank owns ``n_kv_heads_per_device`` KV heads of every page and the query heads
that read them.

An attention layer splits as Megatron's does: the fused QKV projection is column-parallel (a rank's rows of
``w_qkv`` are its Q heads, then its K heads, then its V heads, so ``fused_qkv_matmul_kv_cache`` writes its heads
of K/V straight into its cache), attention runs on the rank's heads alone, and the output projection is
row-parallel (the rank's columns of ``w_o``) followed by one all-reduce. The cache of rank ``r`` is
``KVCacheParams(n_devices=world)``'s shard ``r``: page ids and lookup tables are the same on every rank.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cute_kv.ops.fused_qkv import fused_qkv_matmul_kv_cache
from cute_kv.ops.paged_attention import paged_attention
from cute_kv.reference.rope import RopeConfig


def head_range(n_heads: int, rank: int, world: int) -> tuple[int, int]:
    """Heads ``[start, stop)`` of ``rank`` when ``n_heads`` split evenly over ``world`` ranks."""
    if n_heads % world:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by the tensor-parallel degree ({world})")
    per = n_heads // world
    return rank * per, (rank + 1) * per


class TensorParallelAttention:
    """One attention layer over a paged cache, this rank's share of it; ``world == 1`` is the unsharded layer."""

    def __init__(self, w_qkv: torch.Tensor, w_o: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int, *,
                 bias: Optional[torch.Tensor] = None, rope: Optional[RopeConfig] = None, rank: int = 0,
                 world: int = 1, group=None):
        """From the full weights: ``w_qkv [(Hq + 2*H) * D, hidden]`` (rows Q, K, V), ``w_o [hidden, Hq * D]``,
        ``bias [(Hq + 2*H) * D]``; keeps rank ``rank``'s rows / columns of ``world``."""
        d = head_dim
        if w_qkv.ndim != 2 or w_qkv.shape[0] != (n_q_heads + 2 * n_kv_heads) * d:
            raise ValueError(f"w_qkv must be [(n_q_heads + 2*n_kv_heads) * head_dim, hidden] = "
                             f"[{(n_q_heads + 2 * n_kv_heads) * d}, ...], got {list(w_qkv.shape)}")
        if w_o.ndim != 2 or w_o.shape[1] != n_q_heads * d:
            raise ValueError(f"w_o must be [hidden, n_q_heads * head_dim = {n_q_heads * d}], got {list(w_o.shape)}")
        q0, q1 = head_range(n_q_heads, rank, world)
        k0, k1 = head_range(n_kv_heads, rank, world)
        kv = n_q_heads * d
        rows = torch.cat([torch.arange(q0 * d, q1 * d), kv + torch.arange(k0 * d, k1 * d),
                          kv + n_kv_heads * d + torch.arange(k0 * d, k1 * d)]).to(w_qkv.device)
        self.w_qkv = w_qkv.index_select(0, rows).contiguous()
        self.bias = None if bias is None else bias.index_select(0, rows).contiguous()
        self.w_o = w_o[:, q0 * d:q1 * d].contiguous()
        self.n_q_heads, self.n_kv_heads, self.head_dim, self.rope = q1 - q0, k1 - k0, d, rope
        self.world, self.group = world, group

    def __call__(self, hidden: torch.Tensor, input_row_offsets: torch.Tensor, collection,
                 layer_idx: int) -> torch.Tensor:
        """``hidden [T, hidden]`` (every rank the same) -> the layer's output ``[T, hidden]`` (every rank the same);
        this step's K/V of the rank's heads go into ``collection`` (the rank's shard) at layer ``layer_idx``."""
        if collection.num_heads != self.n_kv_heads:
            raise ValueError(f"collection holds {collection.num_heads} KV heads per page but this rank's layer has "
                             f"{self.n_kv_heads}: build the cache with KVCacheParams(n_devices={self.world})")
        t = hidden.shape[0]
        q = fused_qkv_matmul_kv_cache(hidden, input_row_offsets, self.w_qkv, collection, layer_idx, bias=self.bias,
                                      rope=self.rope)
        o = paged_attention(q.view(t, self.n_q_heads, self.head_dim), input_row_offsets, collection, layer_idx)
        out = o.flatten(1) @ self.w_o.T  # row-parallel: this rank's heads' share of the projection
        if self.world > 1:
            dist.all_reduce(out, group=self.group)
        return out
