"""``torch.ops.cute_kv``: the entry points as ``torch.library`` custom ops.

The ops take a collection as its tensors and sizes, declare the tensors they write (``blocks``, ``scales``,
``output``, ``out``, ``lse``) and return nothing, so torch.compile traces through them. They expect arguments already
validated by the entry points (``cute_kv/ops/store_kv.py``, ``cute_kv/ops/fused_qkv.py``,
``cute_kv/ops/paged_attention.py``, ``cute_kv/ops/sparse_mla_attention.py``, ``cute_kv/ops/mla_prefill.py``) and run
the entry point's ``dispatch`` (its kernel where one applies, else the reference). The entry points call these ops
only while torch.compile traces; an eager call (CUDA-graph capture included) goes straight to ``dispatch``, without
the dispatcher's host time.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.ops import fused_qkv as fused_qkv_entry
from cute_kv.ops import mla_prefill as mla_prefill_entry
from cute_kv.ops import paged_attention as paged_attention_entry
from cute_kv.ops import sparse_mla_attention as sparse_mla_attention_entry
from cute_kv.ops import store_kv as store_kv_entry
from cute_kv.reference.norm import QKNorm
from cute_kv.reference.rope import RopeConfig


def _custom_op(*mutates_args: str):
    """``torch.library.custom_op("cute_kv::<name>")`` with the function's docstring as the op's ``__doc__`` (what
    ``help(torch.ops.cute_kv.<name>)`` shows), which the dispatcher's op objects do not carry otherwise."""

    def register(fn):
        op = torch.library.custom_op(f"cute_kv::{fn.__name__}", mutates_args=mutates_args)(fn)
        packet = getattr(torch.ops.cute_kv, fn.__name__)
        op.__doc__ = packet.__doc__ = packet.default.__doc__ = inspect.cleandoc(fn.__doc__)
        return op

    return register


def _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                quantization_granularity, rope_dim=None) -> PagedKVCacheCollection:
    # validate=False: the entry point checked the metadata, and the lookup-table scan is a device sync.
    return PagedKVCacheCollection(blocks, cache_lengths, lookup_table, max_seq_length, max_cache_length, scales,
                                  quantization_granularity=None if scales is None else quantization_granularity,
                                  rope_dim=rope_dim, validate=False)


@_custom_op("blocks", "scales")
def store_kv(k: torch.Tensor, v: Optional[torch.Tensor], input_row_offsets: torch.Tensor, blocks: torch.Tensor,
             cache_lengths: torch.Tensor, lookup_table: torch.Tensor, scales: Optional[torch.Tensor], layer_idx: int,
             max_seq_length: int, max_cache_length: int, quantization_granularity: int,
             rope_dim: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
             v_scale: Optional[torch.Tensor] = None) -> None:
    """``cute_kv.store_kv`` as a custom op: new token ``i`` of request ``b`` (``k``/``v`` rows ``[T, H, D]``, ragged
    by ``input_row_offsets``) written at position ``cache_lengths[b] + i`` of layer ``layer_idx``, into ``blocks``
    (and ``scales``, quantized, for an fp8 cache). The collection comes as its tensors and sizes
    (``PagedKVCacheCollection``); ``v`` is None for an MLA cache; ``k_scale`` / ``v_scale``: per-tensor fp8 scales
    (float32, one element). Arguments are not checked here: call ``cute_kv.store_kv``, which checks them and calls
    this op while torch.compile traces."""
    collection = _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                             quantization_granularity, rope_dim)
    store_kv_entry.dispatch(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale)


@_custom_op("blocks", "scales", "output")
def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight: torch.Tensor,
                              blocks: torch.Tensor, cache_lengths: torch.Tensor, lookup_table: torch.Tensor,
                              scales: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                              freqs_cis: Optional[torch.Tensor], rope_interleaved: bool,
                              rope_q_head_dim: Optional[int], output: torch.Tensor, layer_idx: int,
                              max_seq_length: int, max_cache_length: int, quantization_granularity: int,
                              weight_scales: Optional[torch.Tensor], weight_zero_points: Optional[torch.Tensor],
                              group_size: Optional[int], q_norm_weight: Optional[torch.Tensor],
                              k_norm_weight: Optional[torch.Tensor], norm_epsilon: float,
                              norm_weight_offset: float, rope_dim: Optional[int] = None) -> None:
    """``cute_kv.fused_qkv_matmul_kv_cache`` as a custom op: ``hidden @ weight^T (+ bias)``, K and V columns
    stored into ``blocks`` (and ``scales``) at layer ``layer_idx``, Q into ``output`` (a custom op may not return an
    alias of an input). No ``freqs_cis``: no RoPE; no norm weights: no QK-norm. A uint8 ``weight`` is packed int4
    (``weight_scales``, ``group_size``, optional ``weight_zero_points``), a float8 one has per-channel scales.
    Arguments are not checked here: call ``cute_kv.fused_qkv_matmul_kv_cache``, which checks them and calls this op
    while torch.compile traces."""
    collection = _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                             quantization_granularity, rope_dim)
    rope = None if freqs_cis is None else RopeConfig(freqs_cis, rope_interleaved, rope_q_head_dim)
    qk_norm = None
    if q_norm_weight is not None or k_norm_weight is not None:
        qk_norm = QKNorm(q_norm_weight, k_norm_weight, norm_epsilon, norm_weight_offset)
    weight = fused_qkv_entry.weight_from_args(weight, weight_scales, weight_zero_points, group_size)
    fused_qkv_entry.dispatch(hidden, input_row_offsets, weight, collection, layer_idx, bias, rope, output, qk_norm)


@_custom_op("out", "lse")
def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, blocks: torch.Tensor,
                    cache_lengths: torch.Tensor, lookup_table: torch.Tensor, scales: Optional[torch.Tensor],
                    layer_idx: int, max_seq_length: int, max_cache_length: int, quantization_granularity: int,
                    causal: bool, window: Optional[int], scale: Optional[float], softcap: Optional[float],
                    sinks: Optional[torch.Tensor], mla_v_dim: Optional[int], out: torch.Tensor,
                    lse: Optional[torch.Tensor], rope_dim: Optional[int] = None,
                    k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> None:
    """``cute_kv.paged_attention`` as a custom op: ragged queries ``q [T, Hq, D]`` over layer ``layer_idx`` of the
    cache (this step's K/V already stored), into ``out [T, Hq, D_v]``; ``lse`` (float32 ``[T, Hq]``, natural log) is
    written when given: the entry point's ``return_lse``; ``k_scale`` / ``v_scale``: per-tensor fp8 scales (float32,
    one element). Arguments are not checked here: call ``cute_kv.paged_attention``, which checks them and calls this
    op while torch.compile traces."""
    collection = _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                             quantization_granularity, rope_dim)
    paged_attention_entry.dispatch(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks,
                                   mla_v_dim, out, lse, k_scale, v_scale)


@_custom_op("out", "lse")
def sparse_mla_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, blocks: torch.Tensor,
                         cache_lengths: torch.Tensor, lookup_table: torch.Tensor, scales: Optional[torch.Tensor],
                         layer_idx: int, max_seq_length: int, max_cache_length: int, quantization_granularity: int,
                         rope_dim: Optional[int], indices: torch.Tensor, topk_lengths: Optional[torch.Tensor],
                         mla_v_dim: int, scale: Optional[float], softcap: Optional[float],
                         sinks: Optional[torch.Tensor], out: torch.Tensor, lse: Optional[torch.Tensor]) -> None:
    """``cute_kv.sparse_mla_attention`` as a custom op: each query over the top-k cache rows ``indices`` names
    (``sparse_kv_index_remap``'s encoded rows; -1 and entries past ``topk_lengths`` are no key), into
    ``out [T, Hq, mla_v_dim]``; ``lse`` (float32 ``[T, Hq]``, natural log) is written when given: the entry point's
    ``return_lse``. Arguments are not checked here: call ``cute_kv.sparse_mla_attention``, which checks them and
    calls this op while torch.compile traces."""
    collection = _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                             quantization_granularity, rope_dim)
    sparse_mla_attention_entry.dispatch(q, input_row_offsets, collection, layer_idx, indices, topk_lengths, mla_v_dim,
                                        scale, softcap, sinks, out, lse)


@_custom_op("out")
def mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, input_row_offsets: torch.Tensor, blocks: torch.Tensor,
                cache_lengths: torch.Tensor, lookup_table: torch.Tensor, scales: Optional[torch.Tensor],
                layer_idx: int, max_seq_length: int, max_cache_length: int, quantization_granularity: int,
                rope_dim: Optional[int], w_uk: torch.Tensor, w_uv: torch.Tensor, scale: Optional[float],
                causal: bool, out: torch.Tensor) -> None:
    """``cute_kv.mla_prefill`` as a custom op: MLA attention of ``q_nope``/``q_rope`` over the latent cache with
    the up-projections ``w_uk``/``w_uv`` (decompressed or absorbed, whichever takes fewer FLOPs), into
    ``out [T, H, v_dim]``. Arguments are not checked here: call ``cute_kv.mla_prefill``, which checks them and calls
    this op while torch.compile traces."""
    collection = _collection(blocks, cache_lengths, lookup_table, scales, max_seq_length, max_cache_length,
                             quantization_granularity, rope_dim)
    mla_prefill_entry.dispatch(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal,
                               out)


@store_kv.register_fake
@fused_qkv_matmul_kv_cache.register_fake
@paged_attention.register_fake
@sparse_mla_attention.register_fake
@mla_prefill.register_fake
def _writes_in_place_only(*args) -> None:
    """Nothing to describe to fake-tensor tracing: the ops only write into arguments (declared in mutates_args)."""
