"""Which key tiles a CTA of the attention kernels walks: the tiles any of its packed query rows may see (causal,
sliding window), and its split's share of them; each row's key range and which tiles need no mask; and how a packed
query row is loaded. Written once for the SM90 (MHA and MLA) and SM100 kernels; the host's plan
replay (tests/test_attention_model.py) and split count (``ops/splits.launch_shape``) follow it."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def split_tiles(m0: Int32, seq_len: Int32, cache_len: Int32, num_keys: Int32, causal: Int32, window: Int32,
                split: Int32, num_splits: Int32, bm: cutlass.Constexpr[int], bn: cutlass.Constexpr[int],
                group: cutlass.Constexpr[int]):
    """``(first_tile, n_tiles)`` of the block of ``bm`` packed rows starting at ``m0`` (``group`` query heads a
    token): the ``bn``-key tiles from the window's start to the last row's causal end, split ``num_splits`` ways."""
    tok_first = m0 // group
    tok_last = (cutlass.min(m0 + bm, seq_len * group) - 1) // group
    k_end = num_keys
    if causal != 0:
        k_end = cache_len + tok_last + 1
    k_begin = Int32(0)
    if window > 0:
        k_begin = cutlass.max(cache_len + tok_first - window + 1, 0)
    tile_begin = k_begin // bn
    tiles = (k_end + bn - 1) // bn - tile_begin
    per_split = (tiles + num_splits - 1) // num_splits
    first_tile = tile_begin + split * per_split
    n_tiles = cutlass.max(cutlass.min(per_split, tiles - split * per_split), 0)
    return first_tile, n_tiles


@cute.jit
def copy_q_chunk(q: cute.Tensor, s_q: cute.Tensor, vals: cute.Tensor, r: Int32, c: Int32, row0: Int32,
                 q_start: Int32, seq_len: Int32, kv_head: Int32, group: cutlass.Constexpr[int]):
    """Chunk ``c`` (8 values) of packed query row ``row0 + r`` (token ``(row0 + r) // group``, head ``kv_head *
    group + (row0 + r) % group``) into ``s_q[r]``, zeros past the request's tokens; ``vals`` is the staging
    register fragment. Both attention kernels load their packed Q tile with it."""
    tok = (row0 + r) // group
    vals.fill(0.0)
    if tok < seq_len:
        src = q[q_start + tok, kv_head * group + (row0 + r) % group, None]
        cute.autovec_copy(cute.local_tile(src, (8,), (c,)), vals)
    cute.autovec_copy(vals, cute.local_tile(s_q[r, None], (8,), (c,)))


@cute.jit
def row_key_ranges(row_begin: cute.Tensor, row_end: cute.Tensor, coords: cute.Tensor, rows0: Int32, seq_len: Int32,
                   cache_len: Int32, num_keys: Int32, causal: Int32, window: Int32, group: cutlass.Constexpr[int]):
    """``row_begin``/``row_end``: the keys ``[begin, end)`` each accumulator row of the thread sees (``coords``: the
    ``(row, key)`` of its S registers, rows from packed row ``rows0``); a padding row (token past the request) sees
    none."""
    for r in cutlass.range_constexpr(cute.size(row_begin)):
        tok = (rows0 + coords[r, 0][0]) // group
        row_end[r] = num_keys
        if causal != 0:
            row_end[r] = cutlass.min(cache_len + tok + 1, num_keys)
        row_begin[r] = 0
        if window > 0:  # clamped: the mask's bounds less a tile's first key then stay in int32 for any window
            row_begin[r] = cutlass.max(cache_len + tok - window + 1, 0)
        if tok >= seq_len:
            row_end[r] = 0  # a padding row: everything masked


@cute.jit
def mask_loops(rows0: Int32, seq_len: Int32, cache_len: Int32, num_keys: Int32, causal: Int32, window: Int32,
               last_tile: Int32, n_tiles: Int32, rows: cutlass.Constexpr[int], bn: cutlass.Constexpr[int],
               group: cutlass.Constexpr[int]):
    """``(masked_end, unmasked_stop)`` of a walk from ``last_tile`` down (tile ``i`` of the walk is ``last_tile -
    i``; tile 0 is always masked): tiles ``[1, masked_end)`` hold keys some live row of ``rows`` packed rows from
    ``rows0`` does not see (the causal edge, the keys' end), ``[masked_end, unmasked_stop)`` are seen whole by
    every live row (no mask), ``[unmasked_stop, n_tiles)`` reach the window's start."""
    tok_lo = rows0 // group
    tok_hi = cutlass.min((cutlass.min(rows0 + rows, seq_len * group) - 1) // group, seq_len - 1)
    unmasked_end = num_keys
    if causal != 0:
        unmasked_end = cutlass.min(cache_len + tok_lo + 1, num_keys)
    unmasked_begin = Int32(0)
    if window > 0:
        unmasked_begin = cache_len + tok_hi - window + 1
    masked_end = cutlass.max(cutlass.min(last_tile - unmasked_end // bn + 1, n_tiles), 1)
    unmasked_stop = n_tiles
    if unmasked_begin > 0:
        unmasked_stop = cutlass.max(cutlass.min(last_tile - (unmasked_begin + bn - 1) // bn + 1, n_tiles), masked_end)
    return masked_end, unmasked_stop
