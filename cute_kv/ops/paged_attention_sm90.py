"""``paged_attention`` on SM90 (Hopper) over an MHA/GQA cache: which calls ``PagedAttention`` serves, its key,
compile units, launch workspace and launcher (the SM90 MHA backend).

``paged_attention.plan`` checks what every attention kernel shares (dtypes, alignment, int32 limits) and hands
``sm_90a`` calls over MHA caches here.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.attention.config import BM, FP8, VEC, gathers, key_tile, supported
from cute_kv.ops import paths, splits, units
from cute_kv.ops.attention_backends import OP, Backend, Family
from cute_kv.ops.kernel_args import kv_sources, layout_flags, layout_key, scales_arg, softmax_args, window_arg
from cute_kv.row_indices import lut_vector

KERNEL = "PagedAttention"
COMPACT_KEY = 14  # a compact cache's key length; a strided cache's adds ``v_dim`` (None) and ``layout``, per-tensor
# scales add both and their flag


def plan(collection, q, arch: str, *, granularity: Optional[int], softcap: Optional[float],
         sinks: Optional[torch.Tensor], return_lse: bool, tensor_scaled: bool = False, **_) -> paths.KernelPath:
    """``PagedAttention``'s key for these arguments, or why the reference runs instead: head dims, page sizes or
    granules the kernel cannot tile (``attention/config.supported``), a grid past CUDA's limits
    (``splits.grid_problem``)."""
    c = collection
    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    hq, h, d, p = q.shape[1], c.num_heads, c.head_size, c.page_size
    problem = splits.grid_problem(c.batch_size, h, splits.query_blocks(c, hq, BM, q.shape[0])) or supported(
        hq, h, d, p, kv_dtype_name, granularity)
    if problem:
        return paths.reference(OP, problem, arch)
    e8m0 = granularity is not None and c.scale_dtype == torch.float8_e8m0fnu
    # a gather reads one lookup entry a key: no vector reads to key on
    bn = collection_key_tile(c)
    vector = not gathers(p, bn) and lut_vector(c, bn)
    key = ("paged_attention", q_dtype_name, hq, h, d, p, c.kv_dim, vector, bool(softcap),
           sinks is not None, return_lse, kv_dtype_name if kv_dtype_name == FP8 else None, granularity, e8m0)
    return paths.kernel(OP, KERNEL, layout_key(key, c.layout_name, tensor_scaled), arch)


def collection_key_tile(collection) -> int:
    """The key tile ``PagedAttention`` walks the collection's keys in (``config.key_tile``: its page size and an fp8
    cache decide it at head dims 192 and 256)."""
    c = collection
    return key_tile(c.head_size, None, c.page_size, dtype_name(c.dtype) == FP8)


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of ``PagedAttention`` for ``key`` and its split-KV combine."""
    def kernel_class():
        from cute_kv.kernels.attention.sm90 import PagedAttention

        return PagedAttention

    return units.with_combine(key, kernel_class, key[1], key[2], key[4], key[10])


def launch_workspace(key: tuple, q: torch.Tensor, collection, causal: bool, window: Optional[int]) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of a launch of ``key`` for the step of ``q``: its grid
    (``splits.launch_shape``) and split-KV partials over its head dim. A launcher makes one per call, a
    ``StepPlan`` once for all its layers (persistent partials)."""
    t, hq, d = q.shape
    shape = splits.launch_shape(collection, hq, splits.sm_count(q.device), BM, collection_key_tile(collection),
                                causal, window, num_tokens=t)
    return (*shape, *splits.partials(shape[1], t, hq, d, q.device))


@functools.lru_cache(maxsize=None)
def launcher(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once: what stays per call is sizing the grid and launching."""
    d, softcap_on, granularity, e8m0 = key[4], key[8], key[12], key[13]
    strided, tensor_scaled = layout_flags(key, COMPACT_KEY)
    units = compile_units(key, arch)

    def launch(q, input_row_offsets, c, layer_idx, workspace, causal, window, scale, softcap, sinks, out, lse,
               return_lse, k_scale=None, v_scale=None):
        m_blocks, num_splits, o_part, lse_part = workspace
        score_scale, softmax_scale_log2 = softmax_args(d, scale, softcap if softcap_on else None)
        sinks = None if sinks is None else sinks.contiguous()
        scales = scales_arg(c, granularity, e8m0, tensor_scaled, k_scale, v_scale)
        splits.launch_and_combine(
            units, arch, q, out, VEC, (lse, o_part, lse_part),
            (sinks, *kv_sources(c, strided), input_row_offsets.contiguous(), c.cache_lengths.contiguous(),
             c.lookup_table, scales, layer_idx, m_blocks, num_splits, int(causal), window_arg(window), score_scale,
             softmax_scale_log2), num_splits, o_part, lse_part, lse)

    return splits.dense_run(key, launch_workspace, launch)


BACKEND = Backend(Family.SM90_MHA, KERNEL, plan, compile_units, launcher, launch_workspace)
