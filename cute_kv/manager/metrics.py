"""A snapshot of the block manager's occupancy and prefix-cache effectiveness (MAX's ``KVCacheMetrics``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVCacheMetrics:
    total_pages: int
    used_pages: int  # referenced by at least one request
    free_pages: int  # in the free queue (cached ones included: they are reusable until popped)
    cached_pages: int  # registered in the prefix cache, referenced or not
    host_pages: int  # host swap capacity (0 without swapping)
    host_cached_pages: int
    num_requests: int
    input_tokens: int  # tokens the engine asked to process, prefix hits included
    cache_hit_tokens: int  # of those, served from the prefix cache (device or host) and skipped
    host_hit_tokens: int  # of the hits, the ones copied back from host swap space
    bytes_per_page: int  # one page over all tensor-parallel shards (KVCacheParams.bytes_per_block)

    @property
    def hit_rate(self) -> float:
        return self.cache_hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.bytes_per_page

    @property
    def total_bytes(self) -> int:
        return self.total_pages * self.bytes_per_page

    def __str__(self) -> str:
        pct = 100 * self.used_pages / self.total_pages
        s = (
            f"pages {self.used_pages}/{self.total_pages} used ({pct:.1f}%, {self.used_bytes / 2**20:.1f} MiB), "
            f"{self.free_pages} free, {self.cached_pages} cached; {self.num_requests} requests; "
            f"prefix hits {100 * self.hit_rate:.1f}% ({self.cache_hit_tokens}/{self.input_tokens} tokens)"
        )
        if self.host_pages:
            s += f"; host {self.host_cached_pages}/{self.host_pages} pages, {self.host_hit_tokens} hit tokens"
        return s
