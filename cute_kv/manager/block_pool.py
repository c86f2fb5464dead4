"""The device page pool: one 6-D blocks tensor per device, reference counts and an LRU free queue (MAX's
``BlockPool``).

Pages ``0 .. N-1`` are handed out; page ``N`` is the pinned *null page*: never allocated, zero-filled, the
sentinel every unused lookup entry holds, so a kernel's vector over-read of a lookup row stays inside the
allocation. Page ids are shared by every device: tensor-parallel shard ``d`` stores its heads of page ``p``
in ``blocks[d][p]``.

Free queue (LRU): freed pages go to the tail, allocation pops the head. A freed page keeps its prefix-cache
entry (the owner of the pool evicts it when the page is popped), so recently freed prefixes stay reusable.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

import torch

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.params import KVCacheParams


class InsufficientBlocksError(RuntimeError):
    """Not enough free pages for a step; raised before any request or page changed."""


class BlockPool:
    def __init__(self, params: KVCacheParams, total_num_pages: int, devices: Sequence[torch.device]):
        if isinstance(total_num_pages, bool) or not isinstance(total_num_pages, int) or total_num_pages <= 0:
            raise ValueError(f"total_num_pages must be a positive int, got {total_num_pages!r}")
        self.total_num_pages = total_num_pages
        self.null_page = total_num_pages
        self.blocks: list[torch.Tensor] = []
        self.scales: list[torch.Tensor | None] = []
        for dev in devices:
            # Unused pages are never read unmasked, so only the null page needs defined contents.
            blocks, scales = PagedKVCacheCollection.allocate_blocks(params, total_num_pages + 1, dev, zero=False)
            blocks[self.null_page].zero_()
            self.blocks.append(blocks)
            self.scales.append(scales)
        self.ref_cnt = [0] * total_num_pages
        # OrderedDict keys as an O(1) doubly linked queue: popitem(last=False) is the head, del unlinks a
        # touched page from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def alloc(self, count: int) -> list[int]:
        """Pop ``count`` pages off the free-queue head (the caller checked ``count <= num_free``)."""
        pop, ref = self.free_queue.popitem, self.ref_cnt
        pages = [pop(last=False)[0] for _ in range(count)]
        for p in pages:
            ref[p] = 1
        return pages

    def touch(self, page: int) -> None:
        """Take one more reference to ``page`` (a prefix hit), unlinking it from the free queue if idle."""
        if self.ref_cnt[page] == 0:
            del self.free_queue[page]
        self.ref_cnt[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; idle pages join the free-queue tail in the order given."""
        ref, queue = self.ref_cnt, self.free_queue
        for p in pages:
            if ref[p] <= 0:
                raise RuntimeError(f"page {p} freed more often than it was allocated")
            ref[p] -= 1
            if ref[p] == 0:
                queue[p] = None
