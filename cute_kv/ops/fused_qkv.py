"""``cute_kv.fused_qkv_matmul_kv_cache``: QKV projection whose K/V columns go straight into a paged cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from cute_kv import reference
from cute_kv.reference.qkv import kv_columns
from cute_kv.reference.rope import RopeConfig
from cute_kv.validate import check_activation, check_step, check_tensor


def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight: torch.Tensor,
                              collection, layer_idx: int, *, output: Optional[torch.Tensor] = None,
                              bias: Optional[torch.Tensor] = None, rope: Optional[RopeConfig] = None) -> torch.Tensor:
    """``C = hidden @ weight^T (+ bias)``: returns Q = ``C[:, :q_dim]``, stores K and V of layer ``layer_idx``.

    ``hidden [T, K]`` (bf16/fp16/fp32; the cache dtype unless the cache is fp8), ``weight [N_tot, K]`` and
    ``bias [N_tot]`` in ``hidden.dtype``. Columns after Q are K then V, ``H*D`` each (MLA: one latent
    head of ``D``), so ``q_dim = N_tot - 2*H*D`` (MLA: ``N_tot - D``) must be positive. New token ``i`` of
    request ``b`` is stored at ``cache_lengths[b] + i`` (quantized for fp8 caches with scales). ``rope``
    rotates Q (heads of ``rope.q_head_dim``, default ``D``) and K at that position (``reference/rope.py``).
    Q is written into ``output [T, q_dim]`` when given. Float32 accumulation; nothing is written on bad input.
    """
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope)
    run = _kernel_for(collection, hidden, weight, rope) or reference.fused_qkv_matmul_kv_cache
    return run(hidden, input_row_offsets, weight, collection, layer_idx, bias=bias, rope=rope, output=output)


def _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope) -> None:
    collection.get_key_cache(layer_idx)  # raises unless 0 <= layer_idx < num_layers
    dev = collection.device
    check_activation("hidden", hidden, collection, ndim=2)
    t, k = hidden.shape
    check_tensor("weight", weight, dtype=hidden.dtype, shape=[None, k], device=dev)
    if collection.is_mla and collection.num_heads != 1:
        raise ValueError(f"an MLA cache must have one (latent) head, got num_heads={collection.num_heads}")
    kv_cols = kv_columns(collection)
    q_dim = weight.shape[0] - kv_cols
    if q_dim <= 0:
        raise ValueError(f"weight has {weight.shape[0]} rows but the cache alone takes {kv_cols} "
                         f"({'D' if collection.is_mla else '2*H*D'}); q_dim = N_tot - {kv_cols} must be positive")
    if bias is not None:
        check_tensor("bias", bias, dtype=hidden.dtype, shape=[weight.shape[0]], device=dev)
    if output is not None:
        check_tensor("output", output, dtype=hidden.dtype, shape=[t, q_dim], device=dev)
    lengths = check_step(collection, input_row_offsets, t)
    if rope is not None:
        _check_rope(rope, collection, q_dim, lengths)


def _check_rope(rope, collection, q_dim: int, lengths: torch.Tensor) -> None:
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a RopeConfig or None, got {type(rope).__name__}")
    check_tensor("rope.freqs_cis", rope.freqs_cis, device=collection.device)
    d, qh, r = collection.head_size, rope.q_head_dim or collection.head_size, rope.rope_dim
    if q_dim % qh:
        raise ValueError(f"q_dim ({q_dim}) must be a multiple of the Q head size ({qh}; set rope.q_head_dim)")
    if r > min(d, qh):
        raise ValueError(f"rope.freqs_cis width (rope_dim={r}) exceeds the head size (K {d}, Q {qh})")
    ends = torch.where(lengths > 0, collection.cache_lengths.to(torch.int64) + lengths, 0)
    if ends.numel() and int(ends.max()) > rope.freqs_cis.shape[0]:
        b = int(ends.argmax())
        raise ValueError(f"rope.freqs_cis has {rope.freqs_cis.shape[0]} positions but request {b} reaches "
                         f"position {int(ends[b]) - 1}")


def _kernel_for(collection, hidden, weight, rope) -> Optional[Callable]:
    """The GPU kernel serving these arguments, or None for the reference (no kernel exists yet)."""
    return None
