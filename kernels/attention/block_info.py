"""Which key tiles a CTA of the attention kernels walks: the tiles any of its packed query rows may see (causal,
sliding window), and its split's share of them; and how a packed query row is loaded. Written once for the SM90
and SM100 kernels; the host's plan
replay (tests/test_attention_model.py) and split count (``ops/paged_attention.launch_shape``) follow it."""

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
