"""``cute_kv.gather_kv``: one layer's K or V of every request as a dense ``[B, max_cache_length, H, D]`` tensor."""

from __future__ import annotations

import math
from typing import Optional

import torch

from cute_kv import dtypes
from cute_kv.ops import paths
from cute_kv.validate import check_tensor

OP = "gather_kv"
_KV_INDEX = {"k": 0, "v": 1}


def gather_kv(collection, layer_idx: int, *, kv: str = "k", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Tokens ``[0, cache_lengths[b])`` of request ``b`` copied to ``out[b, :cache_lengths[b]]`` (cache dtype).

    Positions past a request's cache length are zero in a new tensor and left untouched in a given ``out``.
    On SM90/SM100 GPUs bf16/fp16 caches go through the ``PagedKVGather`` CuTe DSL kernel (paged TMA); every
    other case through ``PagedKVCache.gather``.

    A cache with scales gives the values attention reads, dequantized, since its fp8 bytes alone mean nothing
    without the scales: float32 ``values * scale`` (an fp8 cache without scales is copied as its e4m3 values, as
    MAX's gather does), and a rope-aware MLA cache its logical rows, float32 ``[B, max_cache_length, 1,
    latent_dim]``, ``concat(content * scale, rope)``. The raw bytes and scales are ``get_key_cache(l).row_view()``
    and ``.scales_row_view()``.
    """
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(collection, layer_idx, kv, out)
    if out is None:
        out = torch.zeros(_shape(collection), dtype=_dtype(collection), device=collection.device)
    collection.check_metadata()  # every cached token's lookup entry names a real page
    path = paths.route(OP, collection.device, lambda arch: plan(collection, out, arch))
    if path is not None:
        _launch(path.key, path.arch, collection, layer_idx, _KV_INDEX[kv], out)
        return out
    cache = collection.get_key_cache(layer_idx) if kv == "k" else collection.get_value_cache(layer_idx)
    for b, length in enumerate(collection.cache_lengths.tolist()):
        if length:
            out[b, :length] = cache.gather(b, 0, length, _dtype(collection))
    return out


def explain(collection, layer_idx: int, *, kv: str = "k", out: Optional[torch.Tensor] = None,
            arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(gather_kv, ...)``: the path this call takes on ``arch`` (default: the cache's device)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(collection, layer_idx, kv, out)
    dense = out if out is not None else torch.empty(0, dtype=_dtype(collection), device=collection.device)
    return paths.planned(OP, collection.device, arch, lambda arch: plan(collection, dense, arch))


def _shape(collection) -> list[int]:
    return [collection.batch_size, collection.max_cache_length, collection.num_heads, collection.latent_dim]


def _dtype(collection) -> torch.dtype:
    """The cache dtype; float32 for a scaled cache's dequantized values (a rope-aware cache's logical rows)."""
    return torch.float32 if collection.scales is not None else collection.dtype


def _check(collection, layer_idx, kv, out) -> None:
    if kv not in _KV_INDEX:
        raise ValueError(f"kv must be 'k' or 'v', got {kv!r}")
    if kv == "v" and collection.is_mla:
        raise ValueError("an MLA cache (KVD=1) stores no value cache; use kv='k'")
    collection.check_layer(layer_idx)
    if out is not None:
        check_tensor("out", out, dtype=_dtype(collection), shape=_shape(collection), device=collection.device,
                     contiguous=True)


def plan(collection, out: torch.Tensor, arch: str) -> paths.KernelPath:
    """The ``PagedKVGather`` for this cache on ``arch`` (SM90 and SM100), or why ``PagedKVCache.gather`` runs
    instead: fp8 caches, dtypes, page sizes and head dims it does not tile, misaligned tensors, more requests than
    its grid holds."""
    from cute_kv.kernels.cache.gather import DTYPES, HEAD_DIMS, PAGE_SIZES
    from cute_kv.ops.splits import MAX_GRID_Z

    c = collection
    name = dtypes.dtype_name(c.dtype)
    if c.batch_size > MAX_GRID_Z:
        return paths.reference(OP, f"{c.batch_size} requests exceed the kernel's grid (one z index per request, at "
                                   f"most {MAX_GRID_Z})", arch)
    if c.scales is not None or name not in DTYPES:
        return paths.reference(OP, f"the cache is {name}; the kernel copies {' or '.join(DTYPES)} caches", arch)
    if c.page_size not in PAGE_SIZES or c.head_size not in HEAD_DIMS:
        return paths.reference(OP, f"page_size {c.page_size} / head_size {c.head_size}: the kernel tiles page sizes "
                                   f"{PAGE_SIZES} and head sizes {HEAD_DIMS}", arch)
    if c.key_blocks.data_ptr() % 16 or c.value_blocks.data_ptr() % 16 or out.data_ptr() % 16:
        return paths.reference(OP, "blocks or out is not 16-byte aligned", arch)
    key = ("paged_kv_gather", name, c.kv_dim, c.page_size, c.num_heads, c.head_size)
    # MAX's compact blocks keep their key (and kernel); other layouts add the strided flag
    return paths.kernel(OP, "PagedKVGather", key if c.is_compact else (*key, "strided"), arch)


def _launch(key: tuple, arch: str, collection, layer_idx: int, kv_idx: int, out: torch.Tensor) -> None:
    from cute_kv.kernels.compile_cache import compiled

    c = collection
    page_cols = math.ceil(c.max_cache_length / c.page_size)
    if page_cols and c.batch_size:  # a grid of zero CTAs is a launch error (and nothing is cached)
        # strided: the plane to read; compact: blocks and the plane's kv index
        blocks, index = (c.plane(kv_idx), ()) if key[-1] == "strided" else (c.blocks, (kv_idx,))
        compiled(key, lambda: _build(key), arch)(blocks, c.cache_lengths.contiguous(), c.lookup_table, out, *index,
                                                 layer_idx, page_cols)


def _build(key: tuple):
    from cute_kv.kernels.cache.gather import PagedKVGather

    return PagedKVGather(*key[1:]).build()
