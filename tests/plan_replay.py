"""What the plan-replay models of the attention kernels share: which key tiles a CTA's split covers, and the split-KV
combine. Each model keeps what its kernel does inside a tile; these are the launch rules all of them follow."""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")
LN2 = math.log(2)


def poisoned_partials(splits, t, num_q_heads, v_dim):
    """float64 ``(O [splits, T, Hq, v_dim], lse [splits, T, Hq])`` filled with NaN: a row no CTA writes shows."""
    return (torch.full((splits, t, num_q_heads, v_dim), float("nan"), dtype=torch.float64),
            torch.full((splits, t, num_q_heads), float("nan"), dtype=torch.float64))


def cta_tiles(m0, rows, group, seq_len, cache_len, causal, window, bn, split, splits):
    """``(tok_first, tok_last, first_tile, n_tiles)`` of the CTA whose packed rows start at ``m0`` (``rows`` of them,
    ``group`` heads a token): the key tiles its rows see (causal end, window start), cut into ``splits`` even runs."""
    num_keys = cache_len + seq_len
    tok_first, tok_last = m0 // group, (min(m0 + rows, seq_len * group) - 1) // group
    k_end = cache_len + tok_last + 1 if causal else num_keys
    k_begin = max(cache_len + tok_first - window + 1, 0) if window > 0 else 0
    tile_begin = k_begin // bn
    tiles = -(-k_end // bn) - tile_begin
    per_split = -(-tiles // splits)
    first_tile = tile_begin + split * per_split
    return tok_first, tok_last, first_tile, max(min(per_split, tiles - split * per_split), 0)


def join_sink(row_sum, top, sink):
    """``(row_sum, top, weight)`` after a row's sink (base 2; ``None``: no sink, or a split past 0, which leaves it to
    split 0) joins its softmax denominator; ``weight`` rescales the row's O to the new top."""
    weight = torch.ones_like(row_sum)
    if sink is None:
        return row_sum, top, weight
    new_top = torch.maximum(top, sink)
    ok = new_top != NEG_INF
    weight = torch.where(ok, torch.exp2(top - new_top), 1.0)
    row_sum = torch.where(ok, row_sum * weight + torch.exp2(sink - new_top), row_sum)
    return row_sum, torch.where(ok, new_top, top), weight


def merge_splits(o_part, lse_part):
    """The combine as the SM90 models state it: splits weighted by their base-2 lse, a split's O read only where its
    lse is finite (a skipped split writes none); one split passes through. Returns ``(O, natural-log lse)``."""
    if o_part.shape[0] == 1:
        return o_part[0], lse_part[0] * LN2
    top = lse_part.max(dim=0).values
    seen = lse_part != NEG_INF
    w = torch.where(seen, torch.exp2(lse_part - top), 0.0)
    total = w.sum(0)
    lse = torch.where(total > 0, (top + torch.log2(total)) * LN2, NEG_INF)
    return torch.where(seen[..., None], w[..., None] * o_part, 0.0).sum(0) / total[..., None], lse


def merge_splits_zero_empty(o_part, lse_part):
    """The combine as the SM100 models state it: as ``merge_splits``, with a row no split saw a key for written 0."""
    top = lse_part.max(dim=0).values
    w = torch.where(lse_part == NEG_INF, 0.0, torch.exp2(lse_part - top))
    out = (w[..., None] * o_part).sum(0) / w.sum(0).clamp_min(1e-300)[..., None]
    out = torch.where(w.sum(0)[..., None] > 0, out, 0.0)
    return out, torch.logsumexp(lse_part * LN2, dim=0)
