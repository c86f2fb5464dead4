"""``cute_kv.gather_kv``: one layer's K or V of every request as a dense ``[B, max_cache_length, H, D]`` tensor."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from cute_kv import dtypes
from cute_kv.validate import check_tensor

_KV_INDEX = {"k": 0, "v": 1}


def gather_kv(collection, layer_idx: int, *, kv: str = "k", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens ``[0, cache_lengths[b])`` of request ``b`` copied to ``out[b, :cache_lengths[b]]`` (cache dtype).

    Positions past a request's cache length are zero in a new tensor and left untouched in a given ``out``.
    On SM90/SM100 GPUs bf16/fp16 caches go through the ``PagedKVGather`` CuTe DSL kernel (paged TMA); every
    other case through ``PagedKVCache.gather``.
    """
    if kv not in _KV_INDEX:
        raise ValueError(f"kv must be 'k' or 'v', got {kv!r}")
    cache = collection.get_key_cache(layer_idx) if kv == "k" else collection.get_value_cache(layer_idx)
    shape = [collection.batch_size, collection.max_cache_length, collection.num_heads, collection.head_size]
    if out is None:
        out = torch.zeros(shape, dtype=collection.dtype, device=collection.device)
    else:
        check_tensor("out", out, dtype=collection.dtype, shape=shape, device=collection.device, contiguous=True)
    collection.check_metadata()  # every cached token's lookup entry names a real page
    run = _kernel_for(collection, out)
    if run is not None:
        run(collection.blocks, collection.cache_lengths, collection.lookup_table, out, _KV_INDEX[kv], layer_idx,
            math.ceil(collection.max_cache_length / collection.page_size))
        return out
    for b, length in enumerate(collection.cache_lengths.tolist()):
        if length:
            out[b, :length] = cache.gather(b, 0, length, collection.dtype)
    return out


def _kernel_for(collection, out: torch.Tensor) -> Optional[Callable]:
    """The compiled ``PagedKVGather`` for this cache, or None where it does not apply (CPU, dtype, geometry)."""
    if collection.device.type != "cuda" or collection.scales is not None:
        return None
    from cute_kv.kernels.compile_cache import target_arch
    from cute_kv.kernels.compile_cache import compiled
    from cute_kv.kernels.cache.gather import DTYPES, HEAD_DIMS, PAGE_SIZES, PagedKVGather

    dtype_name = dtypes.dtype_name(collection.dtype)
    if (dtype_name not in DTYPES or collection.page_size not in PAGE_SIZES or collection.head_size not in HEAD_DIMS
            or collection.lookup_table.stride(0) % 8 or collection.blocks.data_ptr() % 16 or out.data_ptr() % 16):
        return None
    key = ("paged_kv_gather", dtype_name, collection.kv_dim, collection.page_size, collection.num_heads,
           collection.head_size)

    def build():
        kernel = PagedKVGather(*key[1:])
        return kernel, *kernel.fake_args()

    return compiled(key, build, target_arch(collection.device))
