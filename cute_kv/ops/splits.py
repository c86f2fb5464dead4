"""Split-KV sizing the attention launchers share: query blocks and key splits of a step (``launch_shape``,
``num_splits``), the grid limits they keep within, the SM counts they fill and the float32 partials a split launch
merges."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from cute_kv.ops import paths
from cute_kv.ops.vectors import heads_packed, packed_heads

MAX_SPLITS = 32
# CUDA's grid limits. The attention kernels' grid: (query blocks, KV heads x key splits, requests).
MAX_GRID_X, MAX_GRID_Y, MAX_GRID_Z = 2**31 - 1, 65535, 65535
SPLIT_COST = 1  # key tiles' worth of time a split adds: its prologue, epilogue and combine share


def longest_run(collection, num_tokens: int) -> int:
    """The longest new-token run a launch is sized for: ``max_seq_length`` bounds it, but a collection may set that
    loosely (up to 2**32 - 1), so the step's ``num_tokens`` (``T``) bounds it too."""
    return min(collection.max_seq_length, num_tokens)


def query_blocks(collection, num_q_heads: int, bm: int, num_tokens: int) -> int:
    """Query blocks of ``bm`` packed rows per (request, KV head): the ``longest_run``'s rows of a GQA group."""
    return -(-longest_run(collection, num_tokens) * (num_q_heads // collection.num_heads) // bm)


def grid_problem(num_requests: int, num_kv_heads: int, m_blocks: int) -> Optional[str]:
    """Why an attention grid of ``m_blocks`` query blocks, ``num_kv_heads`` x splits and ``num_requests`` would
    pass CUDA's limits, or None (``launch_shape`` keeps the splits within ``MAX_GRID_Y``)."""
    if num_requests > MAX_GRID_Z:
        return f"{num_requests} requests exceed the kernels' grid (one z index per request, at most {MAX_GRID_Z})"
    if num_kv_heads > MAX_GRID_Y:
        return f"{num_kv_heads} KV heads exceed the kernels' grid (y indices per KV head, at most {MAX_GRID_Y})"
    if m_blocks > MAX_GRID_X:
        return f"{m_blocks} query blocks per request exceed the kernels' grid (at most {MAX_GRID_X} x indices)"
    return None


def launch_shape(collection, num_q_heads: int, slots: int, bm: int, bn: int, causal: bool = True,
                 window: Optional[int] = None, *, num_tokens: int) -> tuple[int, int]:
    """``(m_blocks, splits)``: ``query_blocks`` of ``bm`` packed rows per (request, KV head) for the step's
    ``num_tokens`` (``T``), and key splits of ``bn``-key tiles for ``slots`` resident CTAs (``num_splits``), at
    most ``MAX_GRID_Y`` per KV head and split together. A causal step of several query blocks does not split: its
    blocks see different numbers of tiles, so a split count fit for the longest leaves the shortest with empty
    splits. A sliding window bounds the keys a block sees (the window and its tokens) whatever the context, so the
    splits are fit to those tiles. The CTAs the wave model counts are the (query block, KV head) pairs that hold
    rows: at most ``T * group // bm`` blocks plus one per request with tokens, so requests with no new token and
    the short requests' empty blocks (which exit at once) are not counted."""
    c = collection
    group = num_q_heads // c.num_heads
    m_blocks = query_blocks(c, num_q_heads, bm, num_tokens)
    if causal and m_blocks > 1:
        return m_blocks, 1
    key_tiles = -(-c.max_cache_length // bn)
    if window is not None:  # window + tokens - 1 keys, one tile more where they start inside one
        key_tiles = min(key_tiles, -(-(window + longest_run(c, num_tokens) - 1) // bn) + 1)
    # sum_b ceil(n_b g / bm) <= T g / bm + (requests with n_b > 0)
    blocks = min(c.batch_size * m_blocks, num_tokens * group // bm + min(c.batch_size, num_tokens))
    return m_blocks, num_splits(max(blocks, 1) * c.num_heads, key_tiles, slots,
                                min(MAX_SPLITS, MAX_GRID_Y // c.num_heads))


def num_splits(ctas: int, key_tiles: int, slots: int, limit: int = MAX_SPLITS) -> int:
    """Key splits per (query block, KV head, request) by wave quantization: splitting ``key_tiles`` ``s`` ways makes
    ``ctas * s`` CTAs of ``ceil(key_tiles / s)`` tiles each, which run in ``ceil(ctas * s / slots)`` waves; the
    estimated time is waves x (tiles per CTA + ``SPLIT_COST`` for a CTA's prologue, epilogue and its share of the
    combine). The fastest ``s`` up to ``limit`` wins (the smallest on a tie); every split keeps at least two tiles
    and no split is empty (``(s - 1) * ceil(key_tiles / s) < key_tiles``)."""
    best, best_cost = 1, None
    for s in range(1, min(limit, key_tiles // 2) + 1):
        per = -(-key_tiles // s)
        if (s - 1) * per >= key_tiles:
            continue
        cost = -(-ctas * s // slots) * (per + SPLIT_COST)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def partials(splits: int, t: int, num_q_heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials ``O/l [splits, T, Hq, D]`` and base-2 ``lse [splits, T, Hq]`` (float32); one split writes
    the output itself, but the kernel's signature still takes them."""
    if splits == 1:
        return unused_partials(device, num_q_heads, head_dim)
    return (torch.empty((splits, t, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((splits, t, num_q_heads), dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def unused_partials(device: torch.device, num_q_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholder partials for single-split launches (never written), allocated once per device and shape."""
    return (torch.empty((1, 1, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, 1, num_q_heads), dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def unused_lse(device: torch.device, num_q_heads: int, head_dim: int) -> torch.Tensor:
    """The SM100 kernels' placeholder ``lse [T, Hq]`` argument (never written): ``unused_partials``' one, made once
    rather than indexed per call."""
    return unused_partials(device, num_q_heads, head_dim)[1][0]


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (of the GPU a ``paths.dry_run`` stands in)."""
    target = paths.dry_target()
    return _device_sm_count(device) if target is None else target.sm_count


@functools.lru_cache(maxsize=None)
def _device_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def dense_run(key: tuple, launch_workspace, launch):
    """``run(...)`` with ``paged_attention``'s launcher signature for one compile-time ``key``: an empty step
    returns at once (a grid of zero CTAs is a launch error); otherwise ``launch(q, input_row_offsets, collection,
    layer_idx, workspace, causal, window, scale, softcap, sinks, out, lse, return_lse)`` with the plan's
    ``(m_blocks, splits, o_part, lse_part)`` or ``launch_workspace``'s; per-tensor ``k_scale`` / ``v_scale``, given
    only to the MHA kernels' launchers, are passed on by name."""

    def run(q, input_row_offsets, collection, layer_idx, *, causal=True, window=None, scale=None, softcap=None,
            sinks=None, mla_v_dim=None, out=None, lse=None, return_lse=False, workspace=None, k_scale=None,
            v_scale=None):
        if q.shape[0]:
            workspace = workspace or launch_workspace(key, q, collection, causal, window)
            scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
            launch(q, input_row_offsets, collection, layer_idx, workspace, causal, window, scale, softcap, sinks, out,
                   lse, return_lse, **scales)
        return (out, lse) if return_lse else out

    return run


def launch_and_combine(units: tuple, arch: str, q: torch.Tensor, out: torch.Tensor, vec: int, lse_args: tuple,
                       args: tuple, num_splits: int, o_part, lse_part, combine_lse) -> None:
    """The attention unit of ``units`` (``(attention, combine)`` compile units) launched as ``(q packed, dst,
    *lse_args, *args)`` and, with splits, the combine of its partials into ``combine_lse``; ``dst`` is ``out`` when
    its heads are packed, else a packed copy written back."""
    from cute_kv.kernels.compile_cache import compiled

    attention_unit, combine_unit = units
    dst = out if heads_packed(out, vec) else torch.empty_like(out, memory_format=torch.contiguous_format)
    compiled(*attention_unit, arch)(packed_heads(q, vec), dst, *lse_args, *args)
    if num_splits > 1:
        compiled(*combine_unit, arch)(dst, combine_lse, o_part, lse_part, num_splits)
    if dst is not out:
        out.copy_(dst)
