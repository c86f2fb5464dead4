"""Host swap space for evicted prefix-cache pages (MAX's seed-era ``enable_kvcache_swapping_to_host``).

When the device pool overwrites an idle cached page, its bytes are first copied to a host page kept under
the same hash; a later prefix hit that misses on the device but hits here allocates a device page and copies
the bytes back. Host pages are LRU by hash and never referenced by requests, so any of them may be replaced.
Host tensors mirror the device pool's 6-D layout per device (pinned when the device is CUDA, so the copies
are DMA transfers) and copies are issued in order on the current stream, before the kernels of the step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from cute_kv.manager.block_pool import BlockPool
from cute_kv.params import KVCacheParams


class HostSwapPool:
    def __init__(self, params: KVCacheParams, num_pages: int, device_pool: BlockPool):
        if num_pages <= 0:
            raise ValueError(
                f"host_kvcache_swap_space_gb={params.host_kvcache_swap_space_gb} holds no page "
                f"({params.bytes_per_block} bytes per page)"
            )
        self.num_pages = num_pages
        self.device_pool = device_pool
        self.blocks: list[torch.Tensor] = []
        self.scales: list[torch.Tensor | None] = []
        for dev_blocks, dev_scales in zip(device_pool.blocks, device_pool.scales):
            pin = dev_blocks.device.type == "cuda"
            self.blocks.append(_host_like(dev_blocks, num_pages, pin))
            self.scales.append(None if dev_scales is None else _host_like(dev_scales, num_pages, pin))
        # hash -> host page, least recently used first.
        self.hash_to_page: OrderedDict[int, int] = OrderedDict()
        self._unused = list(range(num_pages - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.hash_to_page)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.hash_to_page

    def offload(self, evicted: Sequence[tuple[int, int]], protected: frozenset = frozenset()) -> None:
        """Copy evicted ``(hash, device_page)`` pairs to host pages, replacing the least recently used
        entries not in ``protected`` (hashes this step still has to load) when the host pool is full."""
        copies = {}  # host page -> device page; one replaced again within this batch keeps its last copy
        for h, page in evicted:
            if h in self.hash_to_page:
                self.hash_to_page.move_to_end(h)
                continue
            host_page = self._unused.pop() if self._unused else self._replace(protected)
            if host_page is None:
                continue  # every host page is about to be loaded: drop this one
            self.hash_to_page[h] = host_page
            copies[host_page] = page
        if copies:
            dst, src = list(copies), list(copies.values())
            self._copy(self.blocks, dst, self.device_pool.blocks, src)
            self._copy(self.scales, dst, self.device_pool.scales, src)

    def _replace(self, protected: frozenset):
        for h, host_page in self.hash_to_page.items():
            if h not in protected:
                del self.hash_to_page[h]
                return host_page
        return None

    def load(self, loads: Sequence[tuple[int, int]]) -> None:
        """Copy the host pages of ``(hash, device_page)`` pairs into those device pages (a prefix hit)."""
        if not loads:
            return
        src = []
        for h, _ in loads:
            self.hash_to_page.move_to_end(h)
            src.append(self.hash_to_page[h])
        dst = [page for _, page in loads]
        self._copy(self.device_pool.blocks, dst, self.blocks, src)
        self._copy(self.device_pool.scales, dst, self.scales, src)

    def clear(self) -> None:
        self._unused.extend(self.hash_to_page.values())
        self.hash_to_page.clear()

    @staticmethod
    def _copy(dst_tensors, dst_pages, src_tensors, src_pages) -> None:
        for dst, src in zip(dst_tensors, src_tensors):
            if dst is None:
                continue
            # Copied as raw bytes: exact for every dtype, and fp8 has no index kernels on CPU.
            src, dst = src.view(torch.uint8), dst.view(torch.uint8)
            rows = src.index_select(0, torch.tensor(src_pages, device=src.device))
            # Host-to-device may run async (the gathered rows stay alive until the copy is staged);
            # device-to-host must not, since index_copy_ reads the result right away.
            rows = rows.to(dst.device, non_blocking=dst.device.type == "cuda")
            dst.index_copy_(0, torch.tensor(dst_pages, device=dst.device), rows)


def _host_like(t: torch.Tensor, num_pages: int, pin: bool) -> torch.Tensor:
    """``num_pages`` host pages shaped like the device pages of ``t`` (allocated pinned, not copied into)."""
    return torch.empty((num_pages, *t.shape[1:]), dtype=t.dtype, pin_memory=pin)
