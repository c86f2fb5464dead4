"""``cute_kv.adapters``: a step's metadata as vLLM, FlashInfer, SGLang and FA4 keep it, in cute-kv's terms.

cute-kv's step is ``input_row_offsets [B+1]`` (the ragged query rows), ``cache_lengths [B]`` (tokens cached BEFORE
the step), ``lookup_table [B, cols]`` and the max lengths. The engines' lengths count the step's new tokens in
(vLLM's and SGLang's ``seq_lens``, FA4's ``seqused_k``, FlashInfer's ``kv_last_page_len``), so each adapter
subtracts them. Its lookup table holds the request's pages, then the sentinel ``num_pages`` past the pages its
keys need (vLLM's and FA4's tables are padded with 0, a real page): a request whose lengths outrun its pages is then
an error naming it instead of tokens written to page 0.

Every adapter is torch ops on the metadata's device, reading no value on the host: ``plan_step`` (or an op's own
checks) reads and checks the step once. CUDA-graph padding is taken as the engines pad: vLLM and FA4 pad requests
with no query rows and length 0, FlashInfer with no rows and no pages (``kv_last_page_len`` then means nothing);
SGLang's padded decode requests (``num_requests`` on) write their token to its reserved page 0. The adapters
allocate their outputs (a step's metadata are new tensors).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.metadata import padded_lut_cols
from cute_kv.validate import check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class EngineStep:
    """One step's metadata in cute-kv's terms (what ``from_vllm`` and the others return), int32 on the engine's
    device: ``input_row_offsets [B+1]``, ``cache_lengths [B]``, ``lookup_table [B, cols]`` (padded with the sentinel
    ``num_pages``), the max lengths (given, or loose bounds: the table's ``cols * page_size``), ``page_size`` and
    ``num_pages`` of the engine's cache."""

    input_row_offsets: torch.Tensor
    cache_lengths: torch.Tensor
    lookup_table: torch.Tensor
    max_seq_length: int
    max_cache_length: int
    page_size: int
    num_pages: int

    def collection(self, k_cache, v_cache, *, layout: Optional[str] = None, num_kv_heads: Optional[int] = None,
                   validate: bool = False, **kwargs) -> PagedKVCacheCollection:
        """``PagedKVCacheCollection.from_kv`` of the engine's ``[N, P, H, D]`` K and V views (one layer's tensors,
        or per-layer lists) with this step's metadata, checked against ``page_size``, the engine's ``layout``
        (``"NHD"`` / ``"HND"``) and ``num_kv_heads`` where given, and ``num_pages``. ``validate=False``: the
        metadata are read and checked by ``plan_step`` or the ops, once."""
        first = k_cache[0] if isinstance(k_cache, (list, tuple)) and k_cache else k_cache
        if isinstance(first, torch.Tensor) and first.dim() == 4 and first.shape[0] != self.num_pages:
            raise ValueError(f"the K cache has {first.shape[0]} pages ([N, P, H, D] = {list(first.shape)}) but the "
                             f"step's metadata were made for num_pages={self.num_pages}")
        return PagedKVCacheCollection.from_kv(k_cache, v_cache, self.cache_lengths, self.lookup_table,
                                              self.max_seq_length, self.max_cache_length, layout=layout,
                                              page_size=self.page_size, num_kv_heads=num_kv_heads,
                                              validate=validate, **kwargs)


def window_from_left(window_left: int) -> Optional[int]:
    """``paged_attention``'s ``window`` (keys ``j > p - window``: the query's own position and ``window - 1``
    before it) from a count of keys LEFT of the query, -1 for none: FlashInfer's ``window_left``, FA4's (and
    FlashAttention's) ``window_size[0]`` and SGLang's ``sliding_window_size``. ``window = window_left + 1``. vLLM's
    ``sliding_window`` is already ``window``."""
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"window_left must be an int >= -1 (-1: no window), got {window_left!r}")
    return None if window_left < 0 else window_left + 1


def from_vllm(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, *, page_size: int,
              num_pages: int, max_seq_length: Optional[int] = None,
              max_cache_length: Optional[int] = None) -> EngineStep:
    """vLLM's attention metadata: ``query_start_loc [B+1]``, ``seq_lens [B]`` (computed + scheduled tokens),
    ``block_table [B, cols]`` (0-padded), with ``page_size`` its ``block_size`` and ``num_pages`` its
    ``num_blocks``; ``max_seq_length`` / ``max_cache_length``: its ``max_query_len`` / ``max_seq_len``. Its CUDA-graph
    padding (requests past ``num_reqs`` with ``query_start_loc`` repeated and ``seq_lens`` 0) maps to requests of
    nothing; slice the step's rows to ``num_actual_tokens`` as vLLM's own backends do."""
    return _paged(query_start_loc, seq_lens, block_table, ("query_start_loc", "seq_lens", "block_table"),
                  page_size, num_pages, max_seq_length, max_cache_length)


def from_fa4(cu_seqlens_q: torch.Tensor, seqused_k: torch.Tensor, page_table: torch.Tensor, *, page_size: int,
             num_pages: int, max_seq_length: Optional[int] = None,
             max_cache_length: Optional[int] = None) -> EngineStep:
    """FA4's (``flash_attn.cute``) paged varlen arguments: ``cu_seqlens_q [B+1]``, ``seqused_k [B]`` (keys per
    request, the step's included), ``page_table [B, cols]``; ``max_seq_length`` / ``max_cache_length``: its
    ``max_seqlen_q`` / ``max_seqlen_k``. Padded requests: repeated ``cu_seqlens_q``, ``seqused_k`` 0."""
    return _paged(cu_seqlens_q, seqused_k, page_table, ("cu_seqlens_q", "seqused_k", "page_table"), page_size,
                  num_pages, max_seq_length, max_cache_length)


def from_flashinfer(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, *, page_size: int, num_pages: int, max_cache_length: int,
                    max_seq_length: Optional[int] = None) -> EngineStep:
    """FlashInfer's paged-KV CSR: ``qo_indptr [B+1]``, ``kv_indptr [B+1]`` into ``kv_indices`` (each request's
    pages in order), ``kv_last_page_len [B]`` (1..P: the last page's fill, the step's tokens appended). A request's
    keys are ``(pages - 1) * P + kv_last_page_len``, and 0 for a request of no pages (CUDA-graph padding, whatever
    its ``kv_last_page_len``). ``max_cache_length`` (the longest context, a host int such as the engine's plan
    inputs give) sizes the table: the CSR alone would need a read."""
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")
    check_tensor(names[0], qo_indptr, dtype=INDEX_DTYPES, ndim=1)
    dev = qo_indptr.device
    b = qo_indptr.shape[0] - 1
    check_tensor(names[1], kv_indptr, dtype=INDEX_DTYPES, shape=[b + 1], device=dev)
    check_tensor(names[2], kv_indices, dtype=INDEX_DTYPES, ndim=1, device=dev)
    check_tensor(names[3], kv_last_page_len, dtype=INDEX_DTYPES, shape=[b], device=dev)
    page_size, num_pages = _geometry(page_size, num_pages)
    cols = -(-_bound("max_cache_length", max_cache_length) // page_size)
    kv_indptr = kv_indptr.to(torch.int64)
    pages = kv_indptr[1:] - kv_indptr[:-1]
    keys = torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len.to(torch.int64), 0)
    column = torch.arange(cols, device=dev)
    owned = column < pages[:, None]
    table = torch.full((b, cols), num_pages, dtype=torch.int64, device=dev)
    if kv_indices.shape[0]:  # a gather of nothing has no index to clamp to
        at = (kv_indptr[:-1, None] + column).clamp(0, kv_indices.shape[0] - 1)
        table = torch.where(owned, kv_indices.to(torch.int64)[at], table)
    return _step(qo_indptr, keys, table, page_size, num_pages, max_seq_length, max_cache_length)


def from_sglang(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                extend_seq_lens: Optional[torch.Tensor] = None, *, page_size: int, num_pages: int,
                num_requests: Optional[int] = None, max_seq_length: Optional[int] = None,
                max_cache_length: Optional[int] = None) -> EngineStep:
    """SGLang's forward batch: ``req_to_token [max_reqs, max_context]`` (each request's token slots in the KV pool),
    ``req_pool_indices [B]``, ``seq_lens [B]`` (prefix + extend tokens) and ``extend_seq_lens [B]`` (the step's
    tokens; None: a decode step, one each). Token ``t`` of a request lives in slot ``req_to_token[r, t]``, of page
    ``slot // page_size`` (its paged allocator keeps a page's tokens together), so the table is each page's first
    slot over ``page_size``; the cache is the pool's per-layer ``k_buffer[l].view(-1, P, H, D)``, ``num_pages``
    pages. ``num_requests``: the real requests of a CUDA-graph batch (SGLang's ``raw_bs``); the padded ones after
    them, decoded as request pool row 0, write their token to page 0, the page SGLang's allocators never hand out
    (its padding slot 0), as its own ``out_cache_loc`` of 0 does, not into a real request's page."""
    check_tensor("req_to_token", req_to_token, dtype=INDEX_DTYPES, ndim=2)
    dev = req_to_token.device
    check_tensor("req_pool_indices", req_pool_indices, dtype=INDEX_DTYPES, ndim=1, device=dev)
    b = req_pool_indices.shape[0]
    check_tensor("seq_lens", seq_lens, dtype=INDEX_DTYPES, shape=[b], device=dev)
    if extend_seq_lens is None:
        extend_seq_lens = torch.ones(b, dtype=torch.int64, device=dev)
    check_tensor("extend_seq_lens", extend_seq_lens, dtype=INDEX_DTYPES, shape=[b], device=dev)
    page_size, num_pages = _geometry(page_size, num_pages)
    if num_requests is not None and (isinstance(num_requests, bool) or not isinstance(num_requests, int)
                                     or not 0 <= num_requests <= b):
        raise ValueError(f"num_requests must be an int in [0, {b}] (the batch's real requests) or None, got "
                         f"{num_requests!r}")
    new = extend_seq_lens.to(torch.int64)
    keys = seq_lens.to(torch.int64)
    first_slots = req_to_token[req_pool_indices][:, ::page_size].to(torch.int64)
    if max_cache_length is not None:
        first_slots = first_slots[:, :-(-_bound("max_cache_length", max_cache_length) // page_size)]
    table = first_slots // page_size
    if num_requests is not None and num_requests < b:
        padded = torch.arange(b, device=dev) >= num_requests
        keys = torch.where(padded, new, keys)  # nothing cached: the new token alone, at position 0 of page 0
        table = torch.where(padded[:, None], 0, table)
    offsets = torch.zeros(b + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(new, 0)
    return _step(offsets, keys, table, page_size, num_pages, max_seq_length, max_cache_length)


def _paged(offsets, keys, table, names, page_size, num_pages, max_seq_length, max_cache_length) -> EngineStep:
    """vLLM's and FA4's metadata: offsets, keys per request (the step's included) and a ``[B, cols]`` page table."""
    check_tensor(names[0], offsets, dtype=INDEX_DTYPES, ndim=1)
    b = offsets.shape[0] - 1
    check_tensor(names[1], keys, dtype=INDEX_DTYPES, shape=[b], device=offsets.device)
    check_tensor(names[2], table, dtype=INDEX_DTYPES, ndim=2, device=offsets.device)
    if table.shape[0] != b:
        raise ValueError(f"{names[2]} must have one row per request ({b}, as {names[1]}), got shape "
                         f"{list(table.shape)}; slice the engine's persistent buffer to the step's requests")
    page_size, num_pages = _geometry(page_size, num_pages)
    return _step(offsets, keys.to(torch.int64), table.to(torch.int64), page_size, num_pages, max_seq_length,
                 max_cache_length)


def _step(offsets: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, page_size: int, num_pages: int,
          max_seq_length: Optional[int], max_cache_length: Optional[int]) -> EngineStep:
    """The ``EngineStep`` of int64 ``offsets [B+1]``, ``keys [B]`` (cached + new) and ``table [B, cols]``: entries
    past ``ceil(keys / P)`` become the sentinel, so only the pages the keys need are the request's, and the rows
    are padded to MAX's ``padded_lut_cols`` (whole vectors for the kernels' loads)."""
    offsets = offsets.to(torch.int64)
    cache_lengths = keys - (offsets[1:] - offsets[:-1])
    need = (keys + page_size - 1) // page_size
    column = torch.arange(padded_lut_cols(table.shape[1]), device=table.device)
    table = torch.cat([table, table.new_zeros((table.shape[0], column.shape[0] - table.shape[1]))], 1)
    table = torch.where(column < need[:, None], table, num_pages)
    capacity = table.shape[1] * page_size
    return EngineStep(offsets.to(torch.int32), cache_lengths.to(torch.int32), table.to(torch.int32).contiguous(),
                      capacity if max_seq_length is None else _bound("max_seq_length", max_seq_length),
                      capacity if max_cache_length is None else _bound("max_cache_length", max_cache_length),
                      page_size, num_pages)


def _geometry(page_size, num_pages) -> tuple[int, int]:
    for name, value in (("page_size", page_size), ("num_pages", num_pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int (the engine cache's), got {value!r}")
    return page_size, num_pages


def _bound(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0 (a host value: the engine's own), got {value!r}")
    return value
