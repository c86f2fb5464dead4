"""Random ragged steps over shuffled paged caches: inputs for the reference and kernel tests and benchmarks.

``PagedBatch.tokens`` reads the cache back by plain 6-D indexing through the page lists (not the lookup
table, not ``PagedKVCache``), so tests can check the cache ops against it independently.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from cute_kv import kv_layout
from cute_kv.collection import PagedKVCacheCollection
from cute_kv.dtypes import is_fp8
from cute_kv.metadata import input_row_offsets, make_lookup_table, max_lengths
from cute_kv.paged_cache import _raw


@dataclasses.dataclass
class PagedBatch:
    collection: PagedKVCacheCollection
    input_row_offsets: torch.Tensor
    cache_lengths: list[int]
    new_lengths: list[int]
    pages: list[list[int]]  # pages[b][j]: the physical page of request b's tokens [j*P, (j+1)*P)

    @property
    def total_rows(self) -> int:
        return sum(self.new_lengths)

    def rows(self, b: int) -> slice:
        """Request ``b``'s rows of the ragged ``[T, ...]`` inputs."""
        start = sum(self.new_lengths[:b])
        return slice(start, start + self.new_lengths[b])

    def slots(self, b: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page, in-page slot)`` of request ``b``'s tokens ``[start, stop)``."""
        dev = self.collection.device
        pos = torch.arange(start, stop, device=dev)
        p = self.collection.page_size
        return torch.tensor(self.pages[b], dtype=torch.int64, device=dev)[pos // p], pos % p

    def step_mask(self, layer_idx: int, *, context: bool = False) -> torch.Tensor:
        """bool ``[N, KVD, L, P]``: the slots of layer ``layer_idx`` (K and V) of this step's new tokens, or with
        ``context`` of each request's whole context ``[0, cache_length + new)`` (what attention reads)."""
        c = self.collection
        mask = torch.zeros(c.shape[:4], dtype=torch.bool, device=c.device)
        for b, (cache_length, n) in enumerate(zip(self.cache_lengths, self.new_lengths)):
            page, slot = self.slots(b, 0 if context else cache_length, cache_length + n)
            mask[page, :, layer_idx, slot] = True
        return mask

    def poison_unread(self, layer_idx: int) -> None:
        """NaN into every slot (values and scales) outside the contexts of layer ``layer_idx``: other layers,
        pages nobody owns, and the unwritten tail of each request's last page. A reader that touches one shows."""
        unread = ~self.step_mask(layer_idx, context=True)
        c = self.collection
        for t, mask in ((c.key_blocks, unread[:, 0]), (c.value_blocks, unread[:, -1]), (c.scales, unread)):
            if t is not None:
                nan = torch.full((), float("nan"), dtype=t.dtype, device=t.device)
                _raw(t)[mask] = _raw(nan.reshape(1))  # byte view: fp8 tensors lack masked_fill

    def tokens(self, kv_idx: int, layer_idx: int, b: int, start: int, stop: int):
        """Stored ``(values [n, H, D], scales [n, H, G] or None)`` of tokens ``[start, stop)`` (cache dtypes)."""
        page, slot = self.slots(b, start, stop)
        c = self.collection
        values = _raw(c.plane(kv_idx))[page, layer_idx, slot].view(c.dtype)
        scales = None if c.scales is None else _raw(c.scales)[page, kv_idx, layer_idx, slot].view(c.scale_dtype)
        return values, scales

    def dense(self, kv_idx: int, layer_idx: int, b: int, stop: int) -> torch.Tensor:
        """Tokens ``[0, stop)`` of request ``b`` as float64 ``[n, H, D]``, dequantized (``q * scale``); a rope-aware
        cache's logical rows ``[n, 1, latent_dim]``."""
        values, scales = self.tokens(kv_idx, layer_idx, b, 0, stop)
        fmt = self.collection.row_format
        if fmt is not None:
            return fmt.decode(values, scales).to(torch.float64)
        x = values.to(torch.float64)
        if scales is not None:
            gran = self.collection.quantization_granularity
            x = x * scales.to(torch.float64).repeat_interleave(gran, dim=-1)[..., : x.shape[-1]]
        return x


def random_paged_batch(cache_lengths: Sequence[int], new_lengths: Sequence[int], *, num_heads: int, head_size: int,
                       page_size: int, generator: torch.Generator, num_layers: int = 2, is_mla: bool = False,
                       dtype: torch.dtype = torch.bfloat16, scale_dtype: Optional[torch.dtype] = None,
                       quantization_granularity: Optional[int] = None, spare_pages: int = 3,
                       rope_dim: Optional[int] = None, device=None) -> PagedBatch:
    """A collection whose requests own pages in random order, with ``spare_pages`` pages nobody owns.

    Every stored value (and scale) is random, including the slots this step will write. ``scale_dtype``
    (fp8 ``dtype`` only) adds scales with ``quantization_granularity`` (default ``head_size``). ``rope_dim`` makes a
    rope-aware MLA cache (``is_mla``, fp8, float32 scales, one per token): ``head_size`` counts the bytes of a row,
    whose content bytes are random e4m3 values and whose tail holds ``rope_dim`` random bf16 values.
    """
    g = generator
    need = [math.ceil((c + n) / page_size) for c, n in zip(cache_lengths, new_lengths)]
    n_pages = sum(need) + spare_pages
    perm = torch.randperm(n_pages, generator=g).tolist()
    pages = [perm[sum(need[:b]):sum(need[:b + 1])] for b in range(len(need))]
    shape = (n_pages, 1 if is_mla else 2, num_layers, page_size, num_heads, head_size)
    blocks = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    if rope_dim is not None:
        if not (is_mla and is_fp8(dtype) and scale_dtype == torch.float32):
            raise ValueError("rope_dim needs is_mla=True, an fp8 dtype and scale_dtype=torch.float32")
        rope = torch.randn((*shape[:-1], rope_dim), generator=g).to(device=device, dtype=torch.bfloat16)
        _raw(blocks)[..., head_size - 2 * rope_dim:] = rope.view(torch.uint8)
        quantization_granularity = head_size
    scales = None
    if scale_dtype is not None:
        if not is_fp8(dtype):
            raise ValueError(f"scale_dtype needs an fp8 dtype, got {dtype}")
        quantization_granularity = quantization_granularity or head_size
        g_dims = math.ceil(head_size / quantization_granularity)
        # Powers of two in [1/4, 2]: exact in both float32 and float8_e8m0fnu.
        scales = torch.exp2(torch.randint(-2, 2, (*shape[:-1], g_dims), generator=g).to(torch.float32))
        scales = scales.to(device=device, dtype=scale_dtype)
    max_seq, max_ctx = max_lengths(cache_lengths, new_lengths)
    collection = PagedKVCacheCollection(
        blocks, torch.tensor(list(cache_lengths), dtype=torch.int64).to(device=device, dtype=torch.uint32),
        make_lookup_table(pages, sentinel=n_pages, device=device), max_seq, max_ctx, scales,
        quantization_granularity=quantization_granularity if scales is not None else None, rope_dim=rope_dim,
    )
    return PagedBatch(collection, input_row_offsets(new_lengths, device), list(cache_lengths), list(new_lengths), pages)



ENGINE_LAYOUTS = (*kv_layout.ENGINE_LAYOUTS, "strided-6d")


def with_layout(pb: PagedBatch, layout: str, layer_idx: int) -> tuple[PagedBatch, int]:
    """``(pb over a copy of its cache in another engine's layout, the layer index there)``: the same values and
    metadata. ``vllm`` ``kv[2, N, P, H, D]``, ``flashinfer-nhd`` ``[N, 2, P, H, D]``, ``flashinfer-hnd``
    ``[N, 2, H, P, D]`` and ``separate`` K / V tensors (FA4) hold layer ``layer_idx`` alone (``from_kv``, layer 0);
    ``strided-6d`` every layer, as the 6-D view ``[N, L, KVD, H, P, D + 16 bytes]`` permuted to
    ``[N, KVD, L, P, H, D]`` and sliced to ``D`` (rows padded, heads outermost in a page). Scales stay compact."""
    c = pb.collection
    n, kvd, nl, p, h, d = c.shape
    pad = 16 // c.key_blocks.element_size()
    if layout == "strided-6d":
        base = torch.empty((n, nl, kvd, h, p, d + pad), dtype=c.dtype, device=c.device)
        _raw(base)[..., d:] = 0x7f  # padding a store must not touch
        blocks = base.permute(0, 2, 1, 4, 3, 5)[..., :d]
        for kv in range(kvd):
            _raw(blocks)[:, kv] = _raw(c.plane(kv))
        out = PagedKVCacheCollection(blocks, c.cache_lengths, c.lookup_table, c.max_seq_length, c.max_cache_length,
                                     c.scales, quantization_granularity=c.quantization_granularity if c.scales
                                     is not None else None, rope_dim=c.rope_dim)
        return dataclasses.replace(pb, collection=out), layer_idx
    if c.is_mla:
        raise ValueError(f"layout {layout!r} holds K and V; an MLA cache has K only")
    k, v = kv_layout.engine_kv(layout, n, p, h, d, c.dtype, c.device)
    _raw(k)[:] = _raw(c.key_blocks[:, layer_idx])
    _raw(v)[:] = _raw(c.value_blocks[:, layer_idx])
    scales = None if c.scales is None else c.scales[:, :, layer_idx:layer_idx + 1].contiguous()
    out = PagedKVCacheCollection.from_kv(k, v, c.cache_lengths, c.lookup_table, c.max_seq_length, c.max_cache_length,
                                         scales, quantization_granularity=c.quantization_granularity if scales
                                         is not None else None)
    return dataclasses.replace(pb, collection=out), 0
