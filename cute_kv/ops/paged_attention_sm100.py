"""``paged_attention`` on SM100 (Blackwell) over an MHA/GQA cache: which calls ``PagedAttentionSm100`` serves, its
key, compile units, launch workspace and launcher (the SM100 MHA backend).

``paged_attention.plan`` checks what every attention kernel shares (dtypes, alignment, int32 limits) and hands
``sm_100a`` calls over MHA caches here. The API flags (``softcap``, ``sinks``, ``return_lse``) are part of the
compile key.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.attention.sm100_config import BM, FP8, VEC, key_tile, q_tiles, supported, uses_gather4
from cute_kv.ops import paths, splits, units
from cute_kv.ops.attention_backends import OP, Backend, Family
from cute_kv.ops.kernel_args import kv_sources, layout_flags, layout_key, scales_arg, score_args, window_arg
from cute_kv.row_indices import lut_vector

RAGGED_ROWS = 2**30  # kernels/paged/tma_tiles.RAGGED_BIG: a request's rows must stay below it
KEY = "paged_attention_sm100"
KERNEL = "PagedAttentionSm100"
COMPACT_KEY = 15  # a compact cache's key length (the Q tiles last); a strided cache's adds ``v_dim`` (None), ``layout``
# (per-tensor scales: both and their flag, ``kernel_args.layout_key``)


def plan_sm100(collection, q, arch: str, *, granularity: Optional[int], softcap: Optional[float],
               sinks: Optional[torch.Tensor], return_lse: bool, tensor_scaled: bool = False,
               **_) -> paths.KernelPath:
    """``PagedAttentionSm100``'s key for these arguments, or why the reference runs instead: head dims, page sizes
    or granules the kernel cannot tile (``sm100_config.supported``: fp8 caches need pages of 8+ rows that tile the
    key tile), a grid past CUDA's limits (``splits.grid_problem``)."""
    c = collection
    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    hq, h, d, p = q.shape[1], c.num_heads, c.head_size, c.page_size
    tiles = step_q_tiles(c, hq, q.shape[0], bool(softcap))
    problem = splits.grid_problem(c.batch_size, h, splits.query_blocks(c, hq, tiles * BM, q.shape[0])) or supported(
        hq, h, d, p, kv_dtype_name, granularity)
    if not problem and q.shape[0] >= RAGGED_ROWS:
        problem = f"{q.shape[0]} query rows reach the TMA-store epilogue's ragged window shift (2^30 rows)"
    if problem:
        return paths.reference(OP, problem, arch)
    bn = key_tile(d)
    if not c.is_compact and uses_gather4(p, bn) and h > 1 and c.key_blocks.stride(3) != d:
        return paths.reference(OP, f"pages of {p} rows take gather4, which reads a token's {h} heads side by side; "
                               f"this layout's heads are {c.key_blocks.stride(3)} elements apart (as in FlashInfer's HND)", arch)
    e8m0 = granularity is not None and c.scale_dtype == torch.float8_e8m0fnu
    # gather4 reads one lookup entry per token
    key = (KEY, q_dtype_name, hq, h, d, p, c.kv_dim, not uses_gather4(p, bn) and lut_vector(c, bn), bool(softcap),
           sinks is not None, return_lse, kv_dtype_name, granularity, e8m0, tiles)
    return paths.kernel(OP, KERNEL, layout_key(key, c.layout_name, tensor_scaled), arch)


def step_q_tiles(collection, num_q_heads: int, num_tokens: int, softcap: bool) -> int:
    """Q tiles a CTA takes for a step of ``num_tokens`` (``sm100_config.q_tiles`` over the step's most packed rows
    per request and KV head): one for a decode step, two for a prefill past 128 packed rows where the kernel allows."""
    c = collection
    group = num_q_heads // c.num_heads
    return q_tiles(c.head_size, None, dtype_name(c.dtype) == FP8, c.page_size, softcap, group,
                   splits.longest_run(c, num_tokens) * group)


def launch_shape_sm100(collection, num_q_heads: int, slots: int, causal: bool = True,
                       window: Optional[int] = None, *, num_tokens: int, tiles: int) -> tuple[int, int]:
    """``(m_blocks, splits)`` of ``splits.launch_shape`` for this kernel's tiles (``slots``: one CTA per SM, a CTA
    takes all of its tensor memory; ``tiles`` x 128 packed rows a CTA: the key's Q tiles) and the step's
    ``num_tokens``."""
    return splits.launch_shape(collection, num_q_heads, slots, tiles * BM, key_tile(collection.head_size), causal,
                               window, num_tokens=num_tokens)


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of ``PagedAttentionSm100`` for ``key`` and its split-KV combine."""
    def kernel_class():
        from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

        return PagedAttentionSm100

    return units.with_combine(key, kernel_class, key[1], key[2], key[4], key[10])


def launch_workspace(key: tuple, q: torch.Tensor, collection, causal: bool, window: Optional[int]) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of a launch of ``key`` for the step of ``q``: its grid
    (``launch_shape_sm100``) and split-KV partials over its head dim (``paged_attention_sm90.launch_workspace``)."""
    t, hq, d = q.shape
    shape = launch_shape_sm100(collection, hq, splits.sm_count(q.device), causal, window, num_tokens=t,
                               tiles=key[COMPACT_KEY - 1])
    return (*shape, *splits.partials(shape[1], t, hq, d, q.device))


@functools.lru_cache(maxsize=None)
def launcher_sm100(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once (the SM90 launcher's shape)."""
    _, _, hq, h, d, _, _, _, has_softcap, has_sinks, return_lse, _, granularity, e8m0, _ = key[:COMPACT_KEY]
    strided, tensor_scaled = layout_flags(key, COMPACT_KEY)
    units = compile_units(key, arch)

    def launch(q, input_row_offsets, c, layer_idx, workspace, causal, window, scale, softcap, sinks, out, lse,
               return_lse, k_scale=None, v_scale=None):
        m_blocks, num_splits, o_part, lse_part = workspace
        lse_arg = lse if return_lse and num_splits == 1 else splits.unused_lse(q.device, hq, d)
        score_scale, cap_log2 = score_args(d, scale, softcap if has_softcap else None)
        scales = scales_arg(c, granularity, e8m0, tensor_scaled, k_scale, v_scale)
        # With splits the combine merges the splits' base-2 lse into the natural-log lse as well.
        splits.launch_and_combine(
            units, arch, q, out, VEC, (o_part, lse_part, lse_arg),
            (*kv_sources(c, strided), input_row_offsets.contiguous(), c.cache_lengths.contiguous(), c.lookup_table,
             scales, sinks.contiguous() if has_sinks else None, layer_idx, m_blocks, num_splits, int(causal),
             window_arg(window), score_scale, cap_log2), num_splits, o_part, lse_part, lse)

    return splits.dense_run(key, launch_workspace, launch)


BACKEND = Backend(Family.SM100_MHA, KERNEL, plan_sm100, compile_units, launcher_sm100, launch_workspace)
