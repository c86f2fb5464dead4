"""cute-kv: paged KV caches for LLM inference, with CuTe DSL kernels for SM90/SM100 and PyTorch references."""

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.dtypes import parse_dtype
from cute_kv.metadata import input_row_offsets, make_lookup_table, max_lengths, padded_lut_cols
from cute_kv.paged_cache import PagedKVCache
from cute_kv.params import KVCacheParams, KVCacheQuantizationConfig, KVCacheStrategy
from cute_kv.row_indices import PagedRowIndices

__version__ = "0.1.0"

__all__ = [
    "KVCacheParams",
    "KVCacheQuantizationConfig",
    "KVCacheStrategy",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "PagedRowIndices",
    "input_row_offsets",
    "make_lookup_table",
    "max_lengths",
    "padded_lut_cols",
    "parse_dtype",
]
