"""Hugging Face ``transformers`` models on a cute-kv paged cache, through the model's attention interface.

``register()`` adds an attention implementation, ``ATTENTION``, to ``transformers``; a model loaded (or switched
with ``model.set_attn_implementation(ATTENTION)``) to it stores each layer's new K/V rows with ``store_kv`` and
attends with ``paged_attention`` over the pages of a ``PagedKVCacheManager`` step. A step is run as one
sequence holding the ragged rows of every request (continuous batching: prefill chunks and decode tokens
together), with the step's positions for RoPE; the model's own projections, RoPE and MLP run unchanged::

    inputs = mgr.allocate(rids, token_ids=new_ids)                # the manager: pages, prefix hits
    logits = forward_step(model, inputs, step_ids)                # [B, vocab]: next-token logits per request
    mgr.commit()                                                  # the step's K/V is in the cache

``step_ids`` are the rows the step runs: request ``b``'s last ``inputs.new_token_counts[b]`` new ids (the
others were prefix-cache hits). The cache must be built for the model: ``n_kv_heads``, ``head_dim``, one
cache layer per model layer, and the model's dtype (or fp8 with scales).
"""

from __future__ import annotations

import torch

from cute_kv.ops.paged_attention import paged_attention
from cute_kv.ops.store_kv import store_kv

ATTENTION = "cute_kv_paged"


def register() -> str:
    """Make ``ATTENTION`` a ``transformers`` attention implementation (idempotent); returns its name. Models
    with it build no attention mask: causality and windows are the kernel's."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, paged_attention_forward)
    return ATTENTION


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, *,
                            scaling=None, dropout: float = 0.0, cute_kv_step=None, **kwargs):
    """The attention of layer ``module.layer_idx`` for one manager step: ``query [1, Hq, T, D]``, ``key`` /
    ``value [1, H, T, D]`` (RoPE applied) are the step's rows; returns ``([1, T, Hq, D], None)``."""
    if cute_kv_step is None:
        raise ValueError(f"attn_implementation={ATTENTION!r} needs cute_kv_step=StepInputs (use forward_step)")
    if query.shape[0] != 1:
        raise ValueError(f"a cute-kv step is one sequence of ragged rows; got a batch of {query.shape[0]}")
    if dropout:
        raise ValueError("cute-kv attention is for inference: dropout must be 0 (call model.eval())")
    d = next((i for i, c in enumerate(cute_kv_step.collections) if c.device == query.device), None)
    if d is None:
        raise ValueError(f"no collection of the step is on the model's device {query.device}")
    coll, offsets = cute_kv_step.collections[d], cute_kv_step.input_row_offsets[d]
    layer = module.layer_idx
    k, v, q = (x[0].transpose(0, 1).contiguous() for x in (key, value, query))  # [T, heads, D]
    store_kv(k, v, offsets, coll, layer)
    out = paged_attention(q, offsets, coll, layer, scale=scaling, window=getattr(module, "sliding_window", None))
    return out[None], None


@torch.no_grad()
def forward_step(model, inputs, step_ids: torch.Tensor, device_index: int = 0) -> torch.Tensor:
    """Run ``model`` (a causal LM with ``attn_implementation=ATTENTION``) on one manager step; ``step_ids``:
    int ``[T]``, the rows of the step. Returns float ``[B, vocab]``: each request's logits at its last row."""
    step_ids = torch.as_tensor(step_ids).reshape(1, -1)
    positions = inputs.positions[device_index]
    if step_ids.shape[1] != positions.shape[0]:
        raise ValueError(f"step_ids has {step_ids.shape[1]} rows, the step runs {positions.shape[0]} "
                         f"(sum of inputs.new_token_counts)")
    device = positions.device
    out = model(input_ids=step_ids.to(device), position_ids=positions[None], use_cache=False,
                logits_to_keep=inputs.last_row_indices[device_index], cute_kv_step=inputs)
    return out.logits[0]
