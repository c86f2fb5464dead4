"""Disaggregated serving: move a request's pages (K/V of every layer, and their scales) from one cache to another.

A prefill worker computes a request's K/V and ``send_request``s it; the decode worker ``recv_request``s it into its
own manager, where it becomes an ordinary request: its pages are in the lookup table, its full pages in the prefix
cache, and decoding continues with ``allocate([request_id], ...)``. The receiver allocates with the request's
token ids first, so pages its prefix cache already holds are not sent again.

Protocol, both sides in lockstep over any ``torch.distributed`` backend (tensors on the caches' devices)::

    sender                                      receiver
    header (geometry, cache length, ids)  --->  check, claim, allocate (prefix hits skip leading pages)
                                          <---  first page to send, or why it refused (both raise)
    page bytes (and scales), per device   --->  copied into the allocated pages; commit

Pages are moved as raw bytes, so fp8 values and their scales arrive bit for bit. Under tensor or pipeline
parallelism each prefill rank moves its shard (its heads, its stage's layers) to its peer on the decode side.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from cute_kv.manager import InsufficientBlocksError, PagedKVCacheManager


def send_request(manager: PagedKVCacheManager, request_id: Hashable, dst: int, *,
                 token_ids: Optional[Sequence[int]] = None, group=None) -> int:
    """Send ``request_id``'s cached tokens (its committed steps) to rank ``dst``; returns the pages sent.

    ``token_ids``: the request's ids so far (one per cached token), required when the receiver caches prefixes.
    The request stays in ``manager``; release it when done."""
    length = manager.cache_length(request_id)
    if token_ids is not None:
        token_ids = [int(t) for t in token_ids]
        if len(token_ids) != length:
            raise ValueError(f"token_ids has {len(token_ids)} ids but request {request_id!r} has {length} cached "
                             f"tokens")
    pages = manager.get_req_blocks(request_id)[:-(-length // manager.page_size)]
    header = {"request_id": request_id, "length": length, "token_ids": token_ids, "geometry": _geometry(manager)}
    _send_object(header, dst, group)
    reply = _recv_object(dst, group)
    if "error" in reply:
        raise RuntimeError(f"rank {dst} refused request {request_id!r}: {reply['error']}")
    pages = pages[reply["first_page"]:]
    if pages:
        for tensors in (manager.pool.blocks, manager.pool.scales):
            for t in tensors:
                if t is not None:
                    index = torch.tensor(pages, device=t.device)
                    dist.send(t.view(torch.uint8).index_select(0, index), dst=dst, group=group)
    return len(pages)


def recv_request(manager: PagedKVCacheManager, src: int, *, group=None) -> Hashable:
    """Receive a request sent by rank ``src`` into ``manager`` (claimed, allocated, filled, committed); returns
    its request id. Raises, after telling the sender, when the geometry differs, the id is taken, prefix caching
    needs token ids the sender did not give, or the pages do not fit."""
    header = _recv_object(src, group)
    rid, length, token_ids = header["request_id"], header["length"], header["token_ids"]
    try:
        if header["geometry"] != _geometry(manager):
            raise ValueError(f"cache geometry differs: sender {header['geometry']}, receiver {_geometry(manager)}")
        if manager.prefix_cache is not None and token_ids is None:
            raise ValueError("the receiver caches prefixes: the sender must pass token_ids")
        manager.claim(rid)
        try:
            if token_ids is not None:
                step = manager.allocate([rid], token_ids=[token_ids])
            else:
                step = manager.allocate([rid], [length])
        except (ValueError, InsufficientBlocksError):
            manager.release(rid)
            raise
    except (ValueError, InsufficientBlocksError) as e:
        _send_object({"error": str(e)}, src, group)
        raise
    first = step.skipped_tokens[0] // manager.page_size
    _send_object({"first_page": first}, src, group)
    pages = manager.get_req_blocks(rid)[first:]
    if pages:
        for tensors in (manager.pool.blocks, manager.pool.scales):
            for t in tensors:
                if t is not None:
                    raw = t.view(torch.uint8)
                    buf = torch.empty((len(pages), *raw.shape[1:]), dtype=torch.uint8, device=t.device)
                    dist.recv(buf, src=src, group=group)
                    raw.index_copy_(0, torch.tensor(pages, device=t.device), buf)
    manager.commit([rid])
    return rid


def _geometry(manager: PagedKVCacheManager) -> tuple:
    """What must match for page bytes to mean the same on both sides: per device, the page and scale shapes and
    dtypes (layers of the stage, heads of the shard, head dim, page size)."""
    pool = manager.pool
    return tuple((str(b.dtype), tuple(b.shape[1:]), None if s is None else (str(s.dtype), tuple(s.shape[1:])))
                 for b, s in zip(pool.blocks, pool.scales))


def _send_object(obj, dst: int, group) -> None:
    dist.send_object_list([obj], dst=dst, group=group)


def _recv_object(src: int, group):
    box = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]
