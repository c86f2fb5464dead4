"""The paged KV block manager: pages, per-step lookup tables, prefix caching, host swap."""

from cute_kv.manager.block_pool import InsufficientBlocksError
from cute_kv.manager.manager import PagedKVCacheManager, StepInputs
from cute_kv.manager.metrics import KVCacheMetrics

__all__ = ["InsufficientBlocksError", "KVCacheMetrics", "PagedKVCacheManager", "StepInputs"]
