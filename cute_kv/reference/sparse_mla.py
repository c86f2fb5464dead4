"""Reference sparse (top-k) MLA attention over a paged MLA cache, and MAX's ``paged_sparse_kv_index_remap``.

DeepSeek-V3.2's indexer picks, per query token ``t``, ``topk`` keys of its request. The attention kernels take them
ENCODED: ``enc = physical_page * P + offset_in_page`` (MAX's ``get_tma_row`` input), and read row
``(enc // P) * (KVD*L*P) + enc % P`` of the layer's row view. ``-1``, any entry outside ``[0, N*P)`` and the entries
past ``topk_lengths[t]`` select no key: nothing is read for them. No causal mask: the indices decide. Keys are the
(dequantized, for a rope-aware cache logical) latent rows, values their first ``mla_v_dim`` dims; logits, soft-cap,
sinks and ``lse`` as in ``reference/attention.py``. A row with no key (and no sink) gives 0 and ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from cute_kv.reference.ragged import ragged_coords

_CHUNK_ELEMENTS = 1 << 24  # gathered key values per chunk of tokens (64 MiB of float32)


def selected_keys(indices: torch.Tensor, topk_lengths: Optional[torch.Tensor], num_pages: int,
                  page_size: int) -> torch.Tensor:
    """bool ``[T, topk]``: the entries that select a key (in ``[0, N*P)`` and before ``topk_lengths[t]``)."""
    enc = indices.to(torch.int64)
    valid = (enc >= 0) & (enc < num_pages * page_size)
    if topk_lengths is not None:
        j = torch.arange(indices.shape[1], device=indices.device)
        valid &= j[None, :] < topk_lengths.to(torch.int64)[:, None]
    return valid


def sparse_mla_attention(q: torch.Tensor, collection, layer_idx: int, indices: torch.Tensor, *, mla_v_dim: int,
                         scale: Optional[float] = None, topk_lengths: Optional[torch.Tensor] = None,
                         softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                         out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                         return_lse: bool = False):
    """``q [T, Hq, latent_dim]``, ``indices`` int32 ``[T, topk]`` -> ``[T, Hq, mla_v_dim]`` in ``q.dtype`` (or into
    ``out``); with ``return_lse`` also float32 ``lse [T, Hq]``."""
    t, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    cache = collection.get_key_cache(layer_idx)
    p = collection.page_size
    valid = selected_keys(indices, topk_lengths, collection.num_pages, p)
    acc = torch.empty((t, hq, mla_v_dim), dtype=torch.float32, device=q.device)
    lse_acc = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, indices.shape[1] * d))  # tokens whose keys are gathered at once
    for start in range(0, t, chunk):
        rows = slice(start, start + chunk)
        sel = valid[rows]
        enc = indices[rows].to(torch.int64)[sel]
        k = torch.zeros((*sel.shape, d), dtype=torch.float32, device=q.device)
        k[sel] = cache.read_rows((enc // p) * cache.stride_rows + enc % p)[:, 0]  # only the selected rows are read
        s = torch.einsum("thd,tjd->thj", q[rows].to(torch.float32), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~sel[:, None, :], float("-inf"))
        if sinks is not None:  # one more logit per row, whose value row is zero
            s = torch.cat([s, sinks.to(torch.float32)[None, :, None].expand(*s.shape[:2], 1)], dim=-1)
        row_lse = s.logsumexp(dim=-1)  # -inf for a row with no key and no sink
        probs = torch.where(torch.isneginf(s), 0.0, (s - row_lse[..., None]).exp())[..., : sel.shape[1]]
        acc[rows] = torch.einsum("thj,tjd->thd", probs, k[..., :mla_v_dim])
        lse_acc[rows] = row_lse
    out = acc.to(q.dtype) if out is None else out.copy_(acc)
    if not return_lse:
        return out
    return out, lse_acc if lse is None else lse.copy_(lse_acc)


def sparse_kv_index_remap(positions: torch.Tensor, input_row_offsets: torch.Tensor, collection) -> torch.Tensor:
    """Logical key positions ``positions`` int32 ``[T, topk]`` of each query row's request -> encoded indices int32
    ``[T, topk]``: ``LUT[b, pos // P] * P + pos % P``; -1 for ``pos < 0``, ``pos // P`` past the lookup table's
    columns, or a lookup entry that names no page (``>= N``, the sentinel)."""
    p, n = collection.page_size, collection.num_pages
    batch = ragged_coords(input_row_offsets, collection.cache_lengths)[0]
    pos = positions.to(torch.int64)
    lut = collection.lookup_table
    if lut.shape[1] == 0:  # no page to name
        return torch.full_like(positions, -1, dtype=torch.int32)
    col = torch.div(pos, p, rounding_mode="floor")
    inside = (pos >= 0) & (col < lut.shape[1])
    page = lut.to(torch.int64)[batch[:, None], torch.where(inside, col, 0)]
    enc = torch.where(inside & (page < n), page * p + pos % p, -1)
    return enc.to(torch.int32)
