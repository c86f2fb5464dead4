"""``PagedAttention``'s tiling rules, free of CuTe DSL: the torch entry decides on them without importing cutlass."""

from __future__ import annotations

from typing import Optional

BM = 64  # packed query rows per CTA: one wgmma M
VEC = 8  # 16-bit elements per 16-byte access
HEAD_DIMS = (64, 128, 256)
DTYPE_NAMES = ("bfloat16", "float16")  # Q, O and the MMAs
FP8 = "float8_e4m3fn"


def key_tile(head_dim: int) -> int:
    """Keys per tile: 128, or 64 for head_dim 256 (two stages of K and V must fit beside Q, S and P)."""
    return 128 if head_dim <= 128 else 64


def supported(num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: Optional[int],
              kv_dtype_name: Optional[str] = None, granularity: Optional[int] = None) -> Optional[str]:
    """Why the kernel cannot take the problem, or None."""
    if kv_dtype_name not in (None, FP8, *DTYPE_NAMES):
        return f"the cache dtype must be 16-bit or {FP8}, got {kv_dtype_name}"
    if kv_dtype_name == FP8 and page_size is None:
        return "an fp8 cache must be paged"
    if granularity is not None and (kv_dtype_name != FP8 or granularity < VEC or granularity & (granularity - 1)
                                    or head_dim % granularity):
        return (f"scales need an fp8 cache and a power-of-two granularity >= {VEC} dividing head_dim, "
                f"got {granularity}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        return f"q heads ({num_q_heads}) must be a positive multiple of the KV heads ({num_kv_heads})"
    if num_q_heads // num_kv_heads > BM:
        return f"a GQA group of {num_q_heads // num_kv_heads} heads exceeds the {BM}-row tile"
    if head_dim not in HEAD_DIMS:
        return f"head_dim must be one of {HEAD_DIMS}, got {head_dim}"
    bn = key_tile(head_dim)
    if page_size is not None and (page_size < 16 or (page_size % bn and bn % page_size)):
        return f"page_size ({page_size}) must be at least 16 and divide or be divided by the {bn}-key tile"
    return None
