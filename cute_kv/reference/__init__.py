"""PyTorch reference ops: the CPU backend of every entry point and the ground truth the GPU kernels are tested against.

They assume arguments already validated by the ``cute_kv`` entry points (``cute_kv/ops``).
"""

from cute_kv.reference.attention import paged_attention
from cute_kv.reference.merge import merge_attention_states
from cute_kv.reference.qkv import fused_qkv_matmul_kv_cache
from cute_kv.reference.quant import quantize_fp8, saturating_cast_fp8
from cute_kv.reference.rope import RopeConfig, apply_rope
from cute_kv.reference.sparse_mla import sparse_kv_index_remap, sparse_mla_attention
from cute_kv.reference.store import store_kv

__all__ = [
    "RopeConfig",
    "apply_rope",
    "fused_qkv_matmul_kv_cache",
    "merge_attention_states",
    "paged_attention",
    "quantize_fp8",
    "saturating_cast_fp8",
    "sparse_kv_index_remap",
    "sparse_mla_attention",
    "store_kv",
]
