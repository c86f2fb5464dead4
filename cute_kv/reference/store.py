"""Reference ragged KV store: new token ``i`` of request ``b`` goes to position ``cache_lengths[b] + i``.

Values are converted to the cache dtype as a kernel epilogue would: a plain cast for bf16/fp16/fp32
caches, a saturating cast for fp8 caches without scales, ``x / scale`` saturated with a per-tensor ``k_scale`` /
``v_scale`` (``cute_kv/tensor_scales.py``), and per-granule quantization (``quant.py``) when the collection has
scales. A rope-aware MLA cache takes logical rows ``[T, 1, latent_dim]`` and stores each as
its content quantized per token and its rope part in bf16 (``cute_kv/rope_aware.py``). ``cache_lengths`` is never
modified.
"""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.dtypes import is_fp8
from cute_kv.paged_cache import PagedKVCache
from cute_kv import tensor_scales
from cute_kv.reference.quant import quantize_fp8, quantize_per_tensor, saturating_cast_fp8
from cute_kv.reference.ragged import requests


def to_cache_dtype(x: torch.Tensor, cache: PagedKVCache,
                   tensor_scale=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x [..., H, D]`` (any float dtype; rope-aware: ``D = latent_dim``) -> ``(values in the cache dtype, scales or
    None)``; ``tensor_scale``: the plane's per-tensor scale (float or one-element tensor), if any."""
    if tensor_scale is not None:
        return quantize_per_tensor(x, tensor_scales.as_tensor(tensor_scale, x.device)), None
    fmt = cache.collection.row_format
    if fmt is not None:
        return fmt.encode(x)
    if cache.quantization_enabled:
        return quantize_fp8(x, cache.quantization_granularity, cache.scale_dtype)
    if is_fp8(cache.dtype):
        return saturating_cast_fp8(x), None
    return x.to(cache.dtype), None


def write_rows(cache: PagedKVCache, input_row_offsets: torch.Tensor, x: torch.Tensor, tensor_scale=None) -> None:
    """Write the ragged rows ``x [T, H, D]`` of every request into ``cache`` (converted once, scattered per request)."""
    values, scales = to_cache_dtype(x, cache, tensor_scale)
    for b, start, stop, cache_length in requests(input_row_offsets, cache.cache_lengths):
        cache.scatter(b, cache_length, values[start:stop], None if scales is None else scales[start:stop])


def store_kv(k: torch.Tensor, v: Optional[torch.Tensor], input_row_offsets: torch.Tensor, collection,
             layer_idx: int, *, k_scale=None, v_scale=None) -> None:
    """Store ``k`` (and ``v``; ``None`` for an MLA cache) ``[T, H, D]`` into layer ``layer_idx`` of ``collection``;
    ``k_scale`` / ``v_scale``: per-tensor fp8 scales (``cute_kv/tensor_scales.py``)."""
    write_rows(collection.get_key_cache(layer_idx), input_row_offsets, k, k_scale)
    if v is not None:
        write_rows(collection.get_value_cache(layer_idx), input_row_offsets, v, v_scale)
