"""cute-kv: paged KV caches for LLM inference, with CuTe DSL kernels for SM90/SM100 and PyTorch references."""

from cute_kv.adapters import EngineStep, from_fa4, from_flashinfer, from_sglang, from_vllm, window_from_left
from cute_kv.collection import PagedKVCacheCollection
from cute_kv.dtypes import parse_dtype
from cute_kv.manager import (GraphStepBuffers, InsufficientBlocksError, KVCacheMetrics, PagedKVCacheManager,
                             PrefixKeys, StepInputs)
from cute_kv.metadata import input_row_offsets, last_row_indices, make_lookup_table, max_lengths, padded_lut_cols
from cute_kv.ops.fused_qkv import fused_qkv_matmul_kv_cache
from cute_kv.ops.gather_kv import gather_kv
from cute_kv.ops.merge_attention_states import merge_attention_states
from cute_kv.ops.mla_prefill import mla_prefill
from cute_kv.ops.paged_attention import paged_attention
from cute_kv.ops.sparse_mla_attention import sparse_kv_index_remap, sparse_mla_attention
from cute_kv.ops.explain import explain
from cute_kv.ops.paths import FallbackError, FallbackWarning, KernelPath, set_strict
from cute_kv.ops.store_kv import store_kv
from cute_kv.paged_cache import PagedKVCache
from cute_kv.params import KVCacheParams, KVCacheQuantizationConfig, KVCacheStrategy
from cute_kv.reference.ragged import positions
from cute_kv.reference.norm import QKNorm
from cute_kv.reference.rope import RopeConfig
from cute_kv.reference.weights import Fp8Weight, Int4Weight
from cute_kv.row_indices import PagedRowIndices
from cute_kv.step_plan import StepPlan, plan_step

__version__ = "0.1.0"

__all__ = [
    "EngineStep",
    "FallbackError",
    "FallbackWarning",
    "GraphStepBuffers",
    "Fp8Weight",
    "InsufficientBlocksError",
    "Int4Weight",
    "KVCacheMetrics",
    "KVCacheParams",
    "KVCacheQuantizationConfig",
    "KVCacheStrategy",
    "KernelPath",
    "PagedKVCache",
    "PagedKVCacheCollection",
    "PagedKVCacheManager",
    "PagedRowIndices",
    "PrefixKeys",
    "QKNorm",
    "RopeConfig",
    "StepInputs",
    "StepPlan",
    "explain",
    "from_fa4",
    "from_flashinfer",
    "from_sglang",
    "from_vllm",
    "fused_qkv_matmul_kv_cache",
    "gather_kv",
    "input_row_offsets",
    "last_row_indices",
    "make_lookup_table",
    "max_lengths",
    "merge_attention_states",
    "mla_prefill",
    "padded_lut_cols",
    "paged_attention",
    "parse_dtype",
    "plan_step",
    "set_strict",
    "positions",
    "sparse_kv_index_remap",
    "sparse_mla_attention",
    "store_kv",
    "window_from_left",
]
