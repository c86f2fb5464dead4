"""``cute_kv.store_kv``: write a ragged step's new K/V rows into one layer of a paged KV cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from cute_kv import reference
from cute_kv.validate import check_activation, check_step, check_tensor


def store_kv(k: torch.Tensor, v: Optional[torch.Tensor], input_row_offsets: torch.Tensor, collection,
             layer_idx: int) -> None:
    """Write new token ``i`` of request ``b`` (row ``ro[b] + i`` of ``k``/``v``) at position ``cache_lengths[b] + i``.

    ``k``, ``v``: ``[T, H, D]`` in the cache dtype; an fp8 cache takes bf16/fp16/fp32 and quantizes them
    per (token, head, granule) when the collection has scales (else a saturating cast). ``v`` must be
    ``None`` for an MLA cache (K only). ``input_row_offsets``: uint32 ``[B+1]``. ``cache_lengths`` is not
    modified. Every argument is checked before anything is written.
    """
    _check(k, v, input_row_offsets, collection, layer_idx)
    run = _kernel_for(collection, k) or reference.store_kv
    run(k, v, input_row_offsets, collection, layer_idx)


def _check(k, v, input_row_offsets, collection, layer_idx) -> None:
    collection.get_key_cache(layer_idx)  # raises unless 0 <= layer_idx < num_layers
    rows = [None, collection.num_heads, collection.head_size]
    check_activation("k", k, collection, ndim=3)
    check_tensor("k", k, shape=rows)
    if collection.is_mla:
        if v is not None:
            raise ValueError("v must be None for an MLA cache (KVD=1 stores K only)")
    else:
        check_tensor("v", v, dtype=k.dtype, shape=[k.shape[0], *rows[1:]], device=collection.device)
    check_step(collection, input_row_offsets, k.shape[0])


def _kernel_for(collection, k) -> Optional[Callable]:
    """The compiled ``PagedKVStore`` for this cache, or None where it does not apply (CPU, fp8 cache, geometry)."""
    if collection.device.type != "cuda":
        return None
    from cute_kv.kernels.arch import target_arch
    from cute_kv.kernels.compile_cache import compiled
    from cute_kv.kernels.paged_kv_store import DTYPES, PagedKVStore

    dtype_name = str(collection.dtype).removeprefix("torch.")
    vec = 16 // k.element_size()
    if dtype_name not in DTYPES or collection.head_size % vec or collection.blocks.data_ptr() % 16:
        return None
    key = ("paged_kv_store", dtype_name, collection.kv_dim, collection.page_size, collection.num_heads,
           collection.head_size)

    def build():
        kernel = PagedKVStore(dtype_name, *key[2:])
        return kernel, *kernel.fake_args()

    fn = compiled(key, build, target_arch(collection.device))

    def rows(x):
        """``x`` itself when the kernel can read it in 16-byte vectors (heads packed, rows aligned), else a copy."""
        if x is None or (x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) % vec == 0
                         and x.data_ptr() % 16 == 0):
            return x
        return x.clone(memory_format=torch.contiguous_format)

    def run(k, v, input_row_offsets, collection, layer_idx):
        if k.shape[0]:  # a grid of zero CTAs is a launch error
            fn(rows(k), rows(v), input_row_offsets.contiguous(), collection.blocks, collection.cache_lengths,
               collection.lookup_table, layer_idx)

    return run
