"""The paged KV block manager: pages, per-step lookup tables, prefix caching, host swap, fork / rollback /
multistep, and persistent metadata buffers for CUDA graphs."""

from cute_kv.manager.block_pool import InsufficientBlocksError
from cute_kv.manager.graph_buffers import GraphStepBuffers
from cute_kv.manager.manager import PagedKVCacheManager, StepInputs
from cute_kv.manager.metrics import KVCacheMetrics
from cute_kv.manager.prefix_cache import PrefixKeys

__all__ = ["GraphStepBuffers", "InsufficientBlocksError", "KVCacheMetrics", "PagedKVCacheManager", "PrefixKeys",
           "StepInputs"]
