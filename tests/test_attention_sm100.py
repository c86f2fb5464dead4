"""``PagedAttentionSm100``: which calls it serves (host), its plan replayed in PyTorch (no GPU), what it compiles to for
sm_100a (PTX and ptxas), and the kernel against the reference on a B200 (``gpu``, skipped elsewhere).

The plan replay walks the grid the host launches (``launch_shape_sm100``, ``step_q_tiles``: one or two
128-row Q tiles, the head dim's key tile) and does per CTA what ``kernels/attention/sm100.py`` does: the split's tile
range, per-row masks, soft-cap, the base-2 online softmax with the kernel's guards (a row max that rose by at most
``RESCALE_THRESHOLD`` not taken), exp2 by the FMA polynomial where the kernel emulates it, P rounded to 16 bits, O
rescaled before each ``P V``, the sink in split 0's denominator, and the split merge. It is checked against a float64 dense oracle written here (soft-cap and
sinks as the API defines them) and against ``reference.paged_attention``.
"""

import math
import re
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import artifacts

from cute_kv import reference as ref
from cute_kv.kernels.attention.config import FP8_HEAD_DIMS
from cute_kv.kernels.attention.sm100_config import (BM, EXP2_POLY, RESCALE_THRESHOLD, TMEM_COLUMNS, exp2_emulation,
                                                    key_tile, q_tiles, supported, tiling)
from cute_kv.ops.paged_attention import plan
from cute_kv.ops.kernel_args import score_args, window_arg
from cute_kv.ops.paged_attention_sm100 import launch_shape_sm100, step_q_tiles
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from plan_replay import cta_tiles, merge_splits_zero_empty, poisoned_partials

NEG_INF = float("-inf")
LN2 = math.log(2.0)
B200_SMS = 148


# -- host: what the kernel serves ------------------------------------------------------------------------------------

def _batch(cache=None, **kw):
    args = {"num_heads": 2, "head_size": 128, "page_size": 16, **(cache or {})}
    return random_paged_batch([5, 40], [3, 1], generator=torch.Generator().manual_seed(0), **args, **kw)


def _key(cache=None, q_dtype=torch.bfloat16, q_heads=8, **flags):
    pb = _batch(cache)
    q = torch.zeros(pb.total_rows, q_heads, pb.collection.head_size, dtype=q_dtype)
    return _plan_key(pb.collection, q, **flags)


def _plan_key(collection, q, softcap=None, sinks=None, return_lse=False):
    return plan(collection, q, "sm_100a", None, softcap, sinks, return_lse).key


def test_sm100_serves_16_bit_paged_caches():
    assert _key() == ("paged_attention_sm100", "bfloat16", 8, 2, 128, 16, 2, True, False, False, False, "bfloat16",
                      None, False, 1)
    assert _key({"dtype": torch.float16}, torch.float16, 16)[1:4] == ("float16", 16, 2)
    assert _key({"head_size": 256, "page_size": 128})[4:6] == (256, 128)
    assert [_key({"head_size": d})[4] for d in (80, 96, 192)] == [80, 96, 192]
    assert _key({"head_size": 64, "page_size": 256}, q_heads=256)[2:6] == (256, 2, 64, 256)  # group 128 = BM
    assert _key({"page_size": 8})[5] == 8  # one 8-row TMA per page slot
    assert _key({"page_size": 4})[5] == 4  # smaller pages: gather4
    assert _key({"page_size": 48})[5] == 48  # neither divides nor is divided by the 128-key tile: gather4
    assert _key({"page_size": 1})[5] == 1
    sinks = torch.zeros(8)
    assert _key(softcap=30.0, sinks=sinks, return_lse=True)[8:11] == (True, True, True)
    assert _key(softcap=0.0)[8] is False  # 0 means off


FP8 = torch.float8_e4m3fn


def test_sm100_serves_fp8_caches():
    fp8 = {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 32}
    assert _key(fp8)[11:14] == ("float8_e4m3fn", 32, False)
    assert _key({**fp8, "page_size": 4})[5] == 4  # gather4 into the fp8 ring, the converter reads its row array
    assert _key({"dtype": FP8, "page_size": 48})[5] == 48
    assert _key({**fp8, "scale_dtype": torch.float8_e8m0fnu})[11:14] == ("float8_e4m3fn", 32, True)
    assert _key({"dtype": FP8})[11:14] == ("float8_e4m3fn", None, False)  # unscaled: a plain cast
    assert _key({**fp8, "page_size": 8}, torch.float16)[1] == "float16"  # q in any 16-bit dtype


@pytest.mark.parametrize("case", [
    {"cache": {"num_heads": 1, "is_mla": True}},
    {"cache": {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 4}},
    {"q_dtype": torch.float16},
    {"q_dtype": torch.float32, "cache": {"dtype": torch.float32}},
    {"cache": {"head_size": 112}},
    {"cache": {"dtype": FP8, "head_size": 96}},  # an fp8 converter warpgroup covers rows of 64, 128, 256 only
    {"q_heads": 3},
    {"cache": {"num_heads": 1}, "q_heads": 256},  # a GQA group larger than the 128-row tile
], ids=lambda c: "-".join(f"{k}={v if not isinstance(v, torch.Tensor) else tuple(v.shape)}" for k, v in c.items()))
def test_sm100_leaves_the_rest_to_the_reference(case):
    assert _key(**case) is None


@pytest.mark.parametrize("kv_fp8", [False, True])
@pytest.mark.parametrize("page_size", [4, 8, 128])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
def test_sm100_tiling_fits_one_cta_per_sm(head_dim, page_size, kv_fp8):
    if kv_fp8 and head_dim not in FP8_HEAD_DIMS:
        assert "head_dim must be one of" in supported(8, 2, head_dim, page_size, "float8_e4m3fn")
        return
    plan = tiling(head_dim, page_size, kv_fp8)
    assert plan.bn == key_tile(head_dim) and plan.stages >= 2 and plan.gather4 == (page_size == 4)
    assert plan.smem <= 227 * 1024  # the most one CTA may take
    assert plan.tmem_columns == 2 * plan.bn + plan.q_tiles * head_dim <= TMEM_COLUMNS  # S x2 and an O per Q tile
    # Two Q tiles (FA4's plan) with 16-bit pages that tile the key tile in up to 8 TMAs at D = 64 and 128; one at
    # D = 256 (2 x 64 + 2 x 256 columns is past 512), for fp8 (the converter's warpgroup), gather4, 16 page slots a
    # tile and D = 80, 96, 192 (registers).
    assert plan.q_tiles == (2 if head_dim in (64, 128) and not kv_fp8 and page_size == 128 else 1)
    assert plan.rows == plan.q_tiles * BM == q_tiles(head_dim, None, kv_fp8, page_size) * BM
    # P lives in TMEM (over its S tile), so its 16-bit tile takes no shared memory. 192 / 192: two 128-key stages
    # (192 KiB) would not fit beside Q's 48 KiB, so 64-key tiles as at 256.
    stages = {64: 4, 80: 4, 96: 4, 128: 4 if kv_fp8 else 2, 192: 3, 256: 2 + kv_fp8}[head_dim] + (
        head_dim == 128 and page_size == 8 and not kv_fp8) - (head_dim == 128 and plan.gather4 and kv_fp8)
    assert (plan.bn, plan.stages) == ({192: 64, 256: 64}.get(head_dim, 128), stages)
    assert plan.mma_tiles == (2 * plan.bn * head_dim * 2 if kv_fp8 else 0)  # the dequantized K and V
    # Ahead of the 1024-aligned tiles: the barriers, O's factors and the row statistics (float32 rows), and the
    # gather4 row arrays (int32 per key per stage).
    assert plan.fixed >= 64 + 8 * (2 * plan.stages + 14) + 4 * BM * (2 + 2 * plan.q_tiles) + (
        4 * plan.bn * plan.stages if plan.gather4 else 0)


def test_sm100_q_tiles_where_registers_allow():
    """Two Q tiles at D = 128 with up to 8 TMAs per K tile and 4 page slots (pages of 32+ rows, at D = 64 too),
    groups of 2-128 dividing 128; one with soft-cap, a group of 1 or one not dividing 128 (``q_tiles``: measured
    spills)."""
    assert q_tiles(128, page_size=32, group=4) == q_tiles(64, page_size=32, group=4) == 2
    assert q_tiles(64, page_size=16, group=4) == 1  # 8 page slots: the load warp's 48 registers spilled
    assert q_tiles(128, page_size=16, group=4) == q_tiles(128, page_size=32, softcap=True) == 1
    assert q_tiles(128, page_size=32, group=1) == q_tiles(128, page_size=32, group=6) == 1
    # Pages that tile the key tile (gather4 keeps one) of 32+ rows; groups to 128.
    assert q_tiles(128, page_size=48, group=4) == q_tiles(64, page_size=8, group=4) == 1
    assert q_tiles(128, page_size=256, group=4) == q_tiles(128, page_size=32, group=128) == 2
    assert tiling(128, 32, softcap=True).q_tiles == 1 and tiling(128, 32, group=4).q_tiles == 2
    # A step's packed rows that fit one tile take one, and D = 128 its third K/V stage back.
    assert q_tiles(128, page_size=32, group=4, rows=BM) == 1 and q_tiles(128, page_size=32, group=4, rows=BM + 1) == 2
    assert (tiling(128, 32, group=4, tiles=1).stages, tiling(128, 32, group=4).stages) == (3, 2)
    with pytest.raises(ValueError, match=r"q_tiles must be 1 for .* got 2"):
        tiling(128, 32, softcap=True, tiles=2)


@pytest.mark.parametrize("new, tiles", [([1, 1], 1), ([32, 1], 1), ([33, 1], 2), ([300, 0], 2)])
def test_sm100_q_tiles_per_step(new, tiles):
    """The Q-tile count is the step's, in the key and the grid alike: a decode step (or any whose longest run packs
    into 128 rows: 32 tokens x a group of 4) takes one tile, a longer prefill two; the kernel of the key has them."""
    from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

    pb = random_paged_batch([700, 30], new, num_heads=2, head_size=128, page_size=32,
                            generator=torch.Generator().manual_seed(0))
    c = pb.collection
    q = torch.zeros(pb.total_rows, 8, 128, dtype=torch.bfloat16)
    key = _plan_key(c, q)
    assert key[14] == step_q_tiles(c, 8, pb.total_rows, False) == tiles
    assert PagedAttentionSm100(*key[1:]).q_tiles == tiles
    m_blocks = launch_shape_sm100(c, 8, B200_SMS, num_tokens=pb.total_rows, tiles=key[14])[0]
    assert m_blocks == -(-max(new) * 4 // (tiles * BM))


def test_sm100_decode_splits_fill_the_gpu():
    """Batch 1 at 16k keys, 8 KV heads: 8 CTAs, so the keys split 18 ways (144 CTAs, one wave of 148 SMs; 19 would
    take a second wave); batch 128 does not split."""
    pb = random_paged_batch([16000], [1], num_heads=8, head_size=128, page_size=128,
                            generator=torch.Generator().manual_seed(1))
    assert launch_shape_sm100(pb.collection, 32, B200_SMS, num_tokens=1, tiles=1) == (1, 18)
    pb = random_paged_batch([100] * 128, [1] * 128, num_heads=8, head_size=128, page_size=16,
                            generator=torch.Generator().manual_seed(1))
    assert launch_shape_sm100(pb.collection, 32, B200_SMS, num_tokens=128, tiles=1) == (1, 1)


# -- plan replay --------------------------------------------------------------------------------------------------

def exp2_fma(x):
    """The kernel's FMA exp2 (``sm100_common.exp2_fma``) in float64: ``2^floor(x)`` times ``EXP2_POLY`` at the
    fraction, x clamped at -127. Its floor goes into the exponent field as an integer: at -127 the field is 0, so the
    value is the subnormal ``(poly - 1) 2^-126``, and exactly 0 for x <= -127 (the fraction 0, the polynomial 1)."""
    x = x.clamp_min(-127.0)
    floor = torch.floor(x)
    frac = x - floor
    poly = torch.zeros_like(x)
    for c in reversed(EXP2_POLY):
        poly = poly * frac + c
    return torch.where(floor == -127, (poly - 1) * 2.0**-126, torch.ldexp(poly, floor.to(torch.int64)))


def test_sm100_fma_exp2_error():
    """The FMA exp2's polynomial is within 8.8e-5 of 2^x (relative) over the exponents P takes (masked -inf: 0)."""
    x = torch.linspace(-126.0, RESCALE_THRESHOLD, 200001, dtype=torch.float64)
    assert ((exp2_fma(x) / torch.exp2(x) - 1).abs().max() < 8.8e-5).item()
    assert exp2_fma(torch.tensor([NEG_INF, -127.0, -300.0], dtype=torch.float64)).eq(0).all()


def test_sm100_fma_exp2_bits():
    """The kernel's FMA exp2 bit for bit in float32 (numpy): the clamp, the floor by an add rounded down
    (``add.rm``) of ``ROUND_SHIFT``, the f32x2 Horner FMAs, then ``shl 23`` of the shifted sum's bits added to the
    polynomial's (``add.s32``): 0 at -127 and below, exact powers of two, within 1e-4 of 2^x from -126 up to past
    the lagging max's +8 and up to the top of its range (x < 128)."""
    from cute_kv.kernels.attention.sm100_common import ROUND_SHIFT

    def add_rm(a, b):  # float32 a + b rounded toward -inf (exact in float64 first)
        exact = a.astype(np.float64) + b
        near = exact.astype(np.float32)
        return np.where(near.astype(np.float64) > exact, np.nextafter(near, np.float32(-np.inf)), near)

    def kernel_exp2(x):
        x = np.maximum(np.float32(x), np.float32(-127.0))
        shifted = add_rm(x, ROUND_SHIFT)
        frac = x - (shifted - np.float32(ROUND_SHIFT))
        poly = np.full_like(x, EXP2_POLY[3])
        for c in EXP2_POLY[2::-1]:  # an FMA rounds once
            poly = (poly.astype(np.float64) * frac + c).astype(np.float32)
        return ((shifted.view(np.uint32) << np.uint32(23)) + poly.view(np.uint32)).view(np.float32)

    assert (kernel_exp2([-np.inf, -128.0, -127.0]) == 0).all()
    assert (kernel_exp2([0.0, 8.0, -126.0, 127.0]) == np.float32([1.0, 256.0, 2.0**-126, 2.0**127])).all()
    x = np.concatenate([np.linspace(-126, RESCALE_THRESHOLD + 1, 200001, dtype=np.float32),
                        np.float32([100.5, 127.9])])
    assert np.abs(kernel_exp2(x) / np.exp2(x.astype(np.float64)) - 1).max() < 1e-4


def emulated_columns(bn, emulate):
    """Key columns of a tile whose exp2 the kernel computes by ``exp2_fma``: in 32-score pieces other than the first
    and last, the first ``emulate`` pairs."""
    cols = torch.zeros(bn, dtype=torch.bool)
    pieces = bn // 32
    for c in range(0, bn, 2):
        if 0 < c // 32 < pieces - 1 and (c % 32) // 2 < emulate:
            cols[c:c + 2] = True
    return cols


def masked_tiles(m0, group, seq_len, cache_len, causal, window, bn, first_tile, n_tiles, softcap):
    """Which of its split's key tiles the softmax warpgroup of packed rows ``m0 + [0, 128)`` takes through its masked
    loops (``sm100.softmax``: the tiles before the first that every live row of the warpgroup sees whole, and from
    the first a causal row cuts; all of them with the soft-cap)."""
    if softcap:
        return [True] * n_tiles
    num_keys = cache_len + seq_len
    tok_lo = m0 // group
    tok_hi = min((min(m0 + BM, seq_len * group) - 1) // group, seq_len - 1)
    whole_end = min(cache_len + tok_lo + 1, num_keys) if causal else num_keys
    whole_begin = max(cache_len + tok_hi - window + 1, 0) if window > 0 else 0
    first_whole = min(max(-(-whole_begin // bn) - first_tile, 0), n_tiles)
    end_whole = min(max(whole_end // bn - first_tile, first_whole), n_tiles)
    return [not first_whole <= j < end_whole for j in range(n_tiles)]


def model_cta(q, k, v, q_start, seq_len, cache_len, m_block, kv_head, split, splits, group, causal, window,
              score_scale, cap_log2, softcap, sinks, bn, rows, kv_fp8=False):
    """One CTA of ``rows`` packed rows (``rows // BM`` Q tiles): ``(rows, live, O/l [rows, D], lse (log2) [rows])``.
    Each Q tile's softmax emulates the exponentials ``exp2_emulation`` names, by its own masked tiles."""
    num_keys = cache_len + seq_len
    m0 = m_block * rows
    tok_first, tok_last, first_tile, n_tiles = cta_tiles(m0, rows, group, seq_len, cache_len, causal, window, bn,
                                                         split, splits)

    toks = torch.tensor([(m0 + r) // group for r in range(rows)])
    heads = torch.tensor([kv_head * group + (m0 + r) % group for r in range(rows)])
    live = toks < seq_len
    qr = torch.zeros(rows, q.shape[-1], dtype=torch.float64)
    qr[live] = q[q_start + toks[live], heads[live]].double()
    pos = cache_len + toks
    row_end = torch.where(live, torch.clamp(pos + 1, max=num_keys) if causal else torch.full_like(pos, num_keys), 0)
    row_begin = pos - window + 1 if window > 0 else torch.zeros_like(pos)

    row_max = torch.full((rows,), NEG_INF, dtype=torch.float64)
    row_sum = torch.zeros(rows, dtype=torch.float64)
    acc = torch.zeros(rows, q.shape[-1], dtype=torch.float64)
    tiles = rows // BM
    masked = [masked_tiles(m0 + t * BM, group, seq_len, cache_len, causal, window, bn, first_tile, n_tiles, softcap)
              for t in range(tiles)]
    for j, t in enumerate(range(first_tile, first_tile + n_tiles)):
        keys = torch.arange(t * bn, (t + 1) * bn)
        kt = torch.zeros(bn, q.shape[-1], dtype=torch.float64)
        vt = torch.zeros_like(kt)
        inside = keys < num_keys  # past the keys: zero-filled page slots / zeroed V rows
        kt[inside] = k[keys[inside], kv_head].double()
        vt[inside] = v[keys[inside], kv_head].double()
        x = (qr @ kt.T) * score_scale
        if softcap:
            x = cap_log2 * torch.tanh(x)
        x = x.masked_fill((keys[None, :] < row_begin[:, None]) | (keys[None, :] >= row_end[:, None]), NEG_INF)
        new_max = torch.maximum(row_max, x.max(dim=1).values)
        new_max = torch.where(new_max - row_max <= RESCALE_THRESHOLD, row_max, new_max)  # (false from -inf)
        ref_max = torch.where(new_max == NEG_INF, 0.0, new_max)
        corr = torch.exp2(row_max - ref_max)
        p = torch.exp2(x - ref_max[:, None])
        for t in range(tiles):
            fma_cols = emulated_columns(bn, exp2_emulation(q.shape[-1], tiles, masked[t][j], kv_fp8))
            rows_t = slice(t * BM, (t + 1) * BM)
            p[rows_t, fma_cols] = exp2_fma(x[rows_t][:, fma_cols] - ref_max[rows_t, None])
        row_sum = row_sum * corr + p.sum(dim=1)
        if j > 0:
            acc = acc * corr[:, None]  # O rescaled in TMEM before the PV MMA adds this tile
        acc = acc + p.to(q.dtype).double() @ vt  # P is rounded to the MMA dtype
        row_max = new_max
    top, total = row_max, row_sum
    if sinks is not None and split == 0:
        sink = sinks[heads].double() / LN2
        top = torch.maximum(row_max, sink)
        total = row_sum * torch.exp2(row_max - top) + torch.exp2(sink - top)
    inv = torch.where(total > 0, torch.exp2(row_max - top) / total.clamp_min(1e-300), 0.0)
    out = acc * inv[:, None]
    lse = torch.where(total > 0, top + torch.log2(total.clamp_min(1e-300)), NEG_INF)
    return toks, heads, live, out, lse


def model_attention(q, pb, layer, *, causal=True, window=None, scale=None, softcap=None, sinks=None,
                    slots=B200_SMS, force_splits=None):
    """The whole launch (grid, splits, combine) for ``q [T, Hq, D]``: float64 ``(out [T, Hq, D], lse [T, Hq])``."""
    c = pb.collection
    t, hq, d = q.shape
    h = c.num_heads
    group = hq // h
    bn = key_tile(d)
    tiles = step_q_tiles(c, hq, t, bool(softcap))
    block = tiles * BM
    score_scale, cap_log2 = score_args(d, scale, softcap)
    win = window_arg(window)
    m_blocks, splits = launch_shape_sm100(c, hq, slots, causal, window, num_tokens=t, tiles=tiles)
    splits = force_splits or splits
    o_part, lse_part = poisoned_partials(splits, t, hq, d)
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        k = pb.dense(0, layer, b, cache_len + n).to(q.dtype)
        v = pb.dense(1, layer, b, cache_len + n).to(q.dtype)
        for m_block in range(m_blocks):
            if m_block * block >= n * group:
                continue  # the CTA has no rows
            for kv_head in range(h):
                for split in range(splits):
                    toks, heads, live, o, lse = model_cta(q, k, v, offsets[b], n, cache_len, m_block, kv_head, split,
                                                          splits, group, causal, win, score_scale, cap_log2,
                                                          bool(softcap), sinks, bn, block, c.dtype == FP8)
                    rows = offsets[b] + toks[live]
                    o_part[split, rows, heads[live]] = o[live]
                    lse_part[split, rows, heads[live]] = lse[live]
    return merge_splits_zero_empty(o_part, lse_part)


def oracle(q, pb, layer, *, causal=True, window=None, scale=None, softcap=None, sinks=None):
    """The API's definition, dense, float64: ``s = scale q.k``, soft-capped, masked; the sink in the denominator
    only; ``lse`` the natural log of the denominator (-inf with no key and no sink)."""
    c = pb.collection
    t, hq, d = q.shape
    group = hq // c.num_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, hq, d, dtype=torch.float64)
    lse = torch.full((t, hq), NEG_INF, dtype=torch.float64)
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        k = pb.dense(0, layer, b, cache_len + n).to(q.dtype).double()
        v = pb.dense(1, layer, b, cache_len + n).to(q.dtype).double()
        for i in range(n):
            pos = cache_len + i
            keys = torch.arange(cache_len + n)
            visible = keys <= pos if causal else torch.ones_like(keys, dtype=torch.bool)
            if window is not None:
                visible &= keys > pos - window
            for hh in range(hq):
                s = scale * (k[:, hh // group] @ q[offsets[b] + i, hh].double())
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                s = s.masked_fill(~visible, NEG_INF)
                terms = s if sinks is None else torch.cat([s, sinks[hh:hh + 1].double()])
                m = terms.max()
                if m == NEG_INF:
                    continue
                e = torch.exp(s - m)
                denom = torch.exp(terms - m).sum()
                out[offsets[b] + i, hh] = (e @ v[:, hh // group]) / denom
                lse[offsets[b] + i, hh] = m + torch.log(denom)
    return out, lse


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 40)), min_size=1, max_size=3),
    page_size=st.sampled_from([1, 4, 8, 16, 48, 64, 128, 256]),
    group=st.sampled_from([1, 4, 16]),
    head_dim=st.sampled_from([64, 256]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 200)),
    splits=st.one_of(st.none(), st.integers(2, 5)),
    softcap=st.one_of(st.none(), st.sampled_from([5.0, 30.0])),
    sinks=st.booleans(),
    fp8=st.sampled_from([None, {}, {"scale_dtype": torch.float32, "quantization_granularity": 16}]),
    seed=st.integers(0, 2**31),
)
def test_sm100_plan_matches_the_api(lengths, page_size, group, head_dim, causal, window, splits, softcap, sinks, fp8,
                                    seed):
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    if not sum(new) or (window is not None and not causal):
        return
    cache = {"dtype": torch.bfloat16} if fp8 is None else {"dtype": FP8, **fp8}
    pb = random_paged_batch(cached, new, num_heads=2, head_size=head_dim, page_size=page_size, generator=gen,
                            **cache)
    q = (2 * torch.randn(pb.total_rows, 2 * group, head_dim, generator=gen)).to(torch.bfloat16)
    sink = 3 * torch.randn(2 * group, generator=gen) if sinks else None
    kw = dict(causal=causal, window=window, softcap=softcap, sinks=sink)
    want, want_lse = oracle(q, pb, 0, **kw)
    got, got_lse = model_attention(q, pb, 0, force_splits=splits, **kw)
    assert not got.isnan().any()  # every (token, head) written, by some CTA
    assert rel_err(got, want) < 1e-2
    assert torch.equal(got_lse == NEG_INF, want_lse == NEG_INF)
    finite = want_lse != NEG_INF
    # The FMA exp2 (head dims <= 128) is within 8.8e-5 of 2^x: the sum, and so 2^lse, within that.
    tol = math.log2(1 + 8.8e-5) if head_dim <= 128 else 1e-6
    assert (got_lse[finite] - want_lse[finite]).abs().max().item() < tol if finite.any() else True
    if softcap is None and sink is None:
        plain = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, causal=causal, window=window)
        assert rel_err(got, plain.double()) < 1e-2


def test_sm100_plan_at_tile_and_block_boundaries():
    """Keys ending on / just past a 128-key tile, packed rows filling / spilling the 128-row block, empty splits."""
    gen = torch.Generator().manual_seed(4)
    cached, new = [128, 127, 0, 255, 0, 64], [1, 1, 129, 2, 1, 32]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=64, page_size=16, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    for window, splits in ((None, None), (None, 3), (1, None), (128, 2)):
        want, _ = oracle(q, pb, 0, window=window)
        got, _ = model_attention(q, pb, 0, window=window, force_splits=splits)
        assert rel_err(got, want) < 1e-2


def test_sm100_plan_rows_without_keys():
    """A row that sees no key writes 0 and lse -inf; with a sink, 0 and lse = the sink."""
    gen = torch.Generator().manual_seed(5)
    pb = random_paged_batch([0], [3], num_heads=1, head_size=64, page_size=16, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(3, 2, 64, generator=gen).to(torch.bfloat16)
    # A 3-key request split 3 ways: splits 1 and 2 see no key; the merge must ignore them.
    for sinks in (None, torch.tensor([0.5, -2.0])):
        got, lse = model_attention(q, pb, 0, sinks=sinks, force_splits=3)
        want, want_lse = oracle(q, pb, 0, sinks=sinks)
        assert rel_err(got, want) < 1e-2 and (lse - want_lse).abs().max() < 1e-6


# -- compile: PTX and ptxas for sm_100a ----------------------------------------------------------------------------

COMPILE_CASES = [  # (dtype, Hq, H, D, page[, flags])
    ("bfloat16", 8, 2, 128, 128),
    ("bfloat16", 8, 2, 64, 16),
    ("float16", 32, 2, 256, 64),
    ("bfloat16", 64, 8, 128, 32, {"softcap": True, "sinks": True, "return_lse": True}),
    ("bfloat16", 64, 8, 128, 32, {"sinks": True, "return_lse": True}),  # two Q tiles: the correction WG's epilogue
    ("bfloat16", 8, 2, 128, 4),  # gather4
    ("bfloat16", 8, 2, 64, 8),  # 16 TMAs of 8 rows per K tile
    ("float16", 16, 2, 256, 48),  # gather4: a page that does not tile the 64-key tile
    ("bfloat16", 8, 2, 128, 16, {"kv_dtype_name": "float8_e4m3fn", "granularity": 32}),
    ("float16", 8, 1, 256, 128, {"kv_dtype_name": "float8_e4m3fn", "granularity": 64, "e8m0_scales": True}),
    ("bfloat16", 4, 2, 64, 8, {"kv_dtype_name": "float8_e4m3fn", "softcap": True, "sinks": True}),
    ("bfloat16", 8, 2, 128, 4, {"kv_dtype_name": "float8_e4m3fn", "granularity": 32}),  # fp8 by gather4
    ("float16", 8, 2, 64, 3, {"kv_dtype_name": "float8_e4m3fn"}),  # fp8 gather4, 64-byte rows: 64-byte swizzle
    ("bfloat16", 12, 2, 128, 16),  # a group of 6 does not divide the 128-row tile: O by per-thread stores
    ("bfloat16", 2, 2, 64, 128),  # group 1: boxes of 128 tokens
]


@pytest.mark.compile
def test_sm100_head_dim_80_moves_all_of_o():
    """At D = 80 O leaves tensor memory in 16-column pieces, 5 a pass (the rescale's, in the correction's loop and its
    peeled last key tile, and the epilogue's: pieces of 32 would drop columns 64-79), and shared memory by 5 TMA
    stores of a 32-byte swizzle row (16 columns) each."""
    from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

    ptx = artifacts.compiled(PagedAttentionSm100("bfloat16", 32, 8, 80, 16, 2, True), "sm_100a").ptx
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x16.b32") == 3 * 5
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.5d\.global\.shared::cta", ptx)) == 5


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(map(str, c[:5])) + ("-flags" if c[5:] else ""))
def test_sm100_ptx(case, tmp_path):
    from cute_kv.kernels.attention.sm100 import REGS, PagedAttentionSm100, launch_registers

    kernel = PagedAttentionSm100(*case[:5], **(case[5] if case[5:] else {}))
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    d, bn, page = kernel.head_dim, kernel.bn, kernel.page_size
    # One QK (D/16 MMAs of K=16, Q and K from shared memory) and one PV (BN/16, A = P from TMEM: ``[d], [a], b``)
    # per key tile, M=128, fp32 accumulators in TMEM.
    mma = r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*"
    assert len(re.findall(mma + r"%rd\d+,\s*%rd\d+,", ptx)) == d // 16
    assert len(re.findall(mma + r"\[%r\d+\],\s*%rd\d+,", ptx)) == bn // 16
    assert ptx.count("tcgen05.mma") == d // 16 + bn // 16
    # S read as BN/32 loads of 32 columns; P written back as BN/32 stores of 16 columns (two 16-bit values each), in
    # each of the softmax's three loops (masked, whole, masked tiles); O rescaled and stored back (D/32 each: in the
    # correction's loop and its peeled last key tile, per Q tile), then read by the epilogue.
    flags = case[5] if case[5:] else {}
    loops = 1 if flags.get("softcap") else 3  # (soft-cap: one loop, every tile through the mask code)
    rescales = 2 * kernel.q_tiles
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x32.b32") == loops * bn // 32 + (rescales + 1) * d // 32
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x16.b32") == loops * bn // 32
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x32.b32") == rescales * d // 32
    # P never goes through shared memory: the only shared stores are Q's staging, V rows zeroed past the keys (16-bit
    # rings), the dequantized tiles (fp8), gather4's row numbers, O's rows staged for the TMA store (D/8 each), and
    # the float32 row values the softmax hands the correction warpgroup (O's factor, in each of its three loops; the
    # final max and sum).
    stores = re.findall(r"st\.shared\S*", ptx)
    assert len(stores) == 4 + loops + kernel.kv_fp8 + kernel.gather4 + (d // 8 if kernel.tma_store else 0), stores
    # O: with a group dividing the 128-row tile, D/64 TMA stores of (64 columns, group heads, 128/group tokens) boxes
    # over the request's ragged window (token coordinate shifted by 2^30, so rows past the request are dropped), one
    # thread issuing and waiting for their reads; split partials (float32), and O for other groups, by the threads'
    # 16-byte stores. (Modes of static extent 1, a group of 1 or one KV head, leave the tensor map.)
    o_tma = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.global\.shared::cta\.tile\.bulk_group", ptx)
    assert len(o_tma) == (d // 64 if kernel.tma_store else 0)
    assert set(o_tma) <= {str(5 - (kernel.group == 1) - (kernel.num_kv_heads == 1))}
    assert ptx.count("cp.async.bulk.wait_group.read") == (1 if kernel.tma_store else 0)
    shifts = [int(c) for c in re.findall(r"add\.s32\s+%r\d+,\s*%r\d+,\s*(\d+);", ptx)]  # 2^30 - (first token)
    assert any(2**30 - BM <= c <= 2**30 for c in shifts) == kernel.tma_store
    assert ptx.count("st.global.v4") == d * 4 // 16 + (0 if kernel.tma_store else d * 2 // 16)
    # TMEM handed between threads is fenced on both sides of the sync: before the allocation's barrier, the
    # softmax's hand-over of P (in each of its three loops) and the correction's of O, and the dealloc's barrier;
    # after those barriers, the S wait (three loops), the O waits (rescale, epilogue) and the MMA's wait for P and O.
    assert ptx.count("tcgen05.fence::before_thread_sync") == 2 + rescales + loops
    assert ptx.count("tcgen05.fence::after_thread_sync") == 4 + rescales + loops
    assert ptx.count("tcgen05.wait::ld") >= 1 and ptx.count("tcgen05.wait::st") >= 1
    # TMEM allocated once (512 columns), relinquished, freed once.
    assert len(re.findall(r"tcgen05\.alloc\.cta_group::1", ptx)) == 1
    assert len(re.findall(r"tcgen05\.dealloc\.cta_group::1", ptx)) == 1
    assert ptx.count("tcgen05.relinquish_alloc_permit") == 1
    # S full, PV done (O stable), K/V stage free (fp8: the 16-bit K tile after QK, V after PV): MMA completions
    # signalled by tcgen05.commit, so a stage is never refilled while an MMA may read it.
    assert ptx.count("tcgen05.commit.cta_group::1.mbarrier::arrive::one") == (4 if kernel.kv_fp8 else 3)
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == str(kernel.threads)
    # Every pipeline wait is on a phase its loop carries: a wait on a constant parity inside a tile loop (a state
    # the loop does not carry) passes once, then deadlocks or lets a buffer be rewritten while an MMA reads it. The
    # exceptions: each Q tile's final row statistics, a barrier of one phase per CTA, and with two Q tiles its O's
    # (only its last PV commits).
    waits = re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64\s+\w+,\s*\[[^\]]+\],\s*([^,]+),", ptx)
    assert waits and [w for w in waits if not w.startswith("%r")] == ["0"] * kernel.q_tiles, waits
    # Registers move between the roles: one setmaxnreg per role's branch (softmax, load, MMA, idle, correction,
    # converter), an increase exactly where the target is above the launch count (PTX ISA 9.7.19.5: .dec from below
    # its target, or .inc from above, is undefined).
    regs = REGS[kernel.q_tiles, kernel.kv_fp8, kernel.softcap]
    launch = launch_registers(kernel.threads)
    moves = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)
    assert len(moves) == 5 + kernel.kv_fp8, moves
    assert all((kind == "inc") == (int(n) > launch) for kind, n in moves), (launch, moves)
    assert moves.count(("inc", str(regs["softmax"]))) == 1
    assert (".minnctapersm 1") in ptx  # without it ptxas ignores setmaxnreg
    if kernel.kv_fp8:  # converter warpgroup: 8 fp8 -> 4 cvt.f16x2 per 16-byte chunk
        assert ptx.count("cvt.rn.f16x2.e4m3x2") >= 4
        # The converter's branch waits on the ring, its K and V tiles in the loop, then on the MMA's last releases
        # of K and V (their tails): no tcgen05.commit arrives on the CTA's shared memory after it exits.
        start = ptx.index(f"setmaxnreg.dec.sync.aligned.u32 \t{regs['convert']}")
        converter = ptx[start:ptx.index("setmaxnreg", start + 1)]
        assert converter.count("mbarrier.try_wait") == 5
        # A ring stage is released by one lane of each converter warp (PipelineTmaAsync's signalling lane): its
        # empty barriers count 4 arrivals (128 would never complete once the ring wraps).
        inits = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s+((?:mbarrier\.init\.shared\.b64\s+\[[^\]]+\], \1;\s+)+)",
                           ptx)
        assert (4, kernel.stages) in [(int(n), block.count("mbarrier.init")) for _, n, block in inits]
        # That lane's arrival orders its own reads only: a warp barrier between the converter's last reads of the
        # stage and the release (its last arrival), so no lane still reads the stage when the load warp refills it.
        release = converter.rindex("mbarrier.arrive")
        assert "bar.warp.sync" in converter[converter.rindex("ld.shared", 0, release):release]
    if kernel.gather4:  # 4 rows x one swizzle row (128 B; 64 B for fp8 rows of 64) per instruction, for K and for V
        g4 = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\S*\s+\[([^\]]*)\]", ptx)
        row_bytes = kernel.ring_swizzle
        assert kernel.box_width * kernel.kv_dtype.width // 8 == row_bytes
        assert len(g4) == 2 * (bn // 4) * (d // kernel.box_width)
        # Swizzle on the pointer: every instruction has its own destination, 4 swizzle rows apart within a column
        # block, and blocks follow each other (K's then V's).
        offsets = [int(re.search(r"\+(\d+)$", x).group(1)) if "+" in x else 0 for x in g4]
        assert len(set(g4)) == len(g4)
        k_offsets = offsets[:len(g4) // 2]
        assert all(b - a == 4 * row_bytes for a, b in zip(k_offsets, k_offsets[1:]))
        assert "cp.async.bulk.tensor.3d" not in ptx
        if kernel.kv_fp8:  # the converter reads the row array after the full barrier: its arrival (a release)
            # follows the lanes' row stores and the warp barrier ordering them, not the empty wait before them
            load = ptx[:ptx.index("gather4")]
            arrive = load.rindex("mbarrier.arrive.expect_tx")
            assert arrive > load.rindex("st.shared.b32") and arrive > load.rindex("bar.warp.sync")
    else:  # one TMA per page slot, per swizzle-wide box of the head dim, for K and for V
        slots = max(bn // page, 1)
        boxes = d * kernel.kv_dtype.width // 8 // kernel.ring_swizzle
        assert len(re.findall(r"cp\.async\.bulk\.tensor\.[23]d\.shared::cta\.global\.tile\.", ptx)) == 2 * slots * boxes
        assert "gather4" not in ptx
    # Softmax (three loops): one ex2 per score, or the FMA exp2 (one rounded-down f32x2 add a pair) where emulated
    # (D <= 128: 16 of a tile's exponentials at two Q tiles, 24 at one, 4 in the masked loops and with fp8 caches); tanh
    # only with the soft-cap.
    assert ptx.count("tanh.approx.f32") == (bn if flags.get("softcap") else 0)
    whole, cut = (int(emulated_columns(bn, kernel.exp2_emulation[m]).sum()) for m in (False, True))
    assert (whole, cut) == ((0, 0) if d > 128 else (4, 4) if kernel.kv_fp8 else ({2: 16, 1: 24}[kernel.q_tiles], 4))
    masked = loops if loops == 1 else 2
    emulated = (loops - masked) * whole + masked * cut
    assert ptx.count("add.rm.f32x2") == emulated // 2
    assert ptx.count("ex2.approx.ftz.f32") >= loops * bn - emulated
    assert not re.search(r"wgmma|mma\.sync", ptx)
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(ptx)
    info = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(ptx_file), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True).stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in info
    assert "C7508" not in info  # setmaxnreg applied, not ignored
    launch = int(re.search(r"Used (\d+) registers", info).group(1))
    assert launch <= min(255, 65536 // kernel.threads)  # one CTA per SM; measured 128 (512 threads), 168 (384)
    # setmaxnreg.inc draws only on what the CTA's other warpgroups release of their launch count.
    assert sum(regs[role] * (kernel.q_tiles if role == "softmax" else 1) for role in regs) <= (
        kernel.threads // 128 * launch)


# -- GPU (B200) ----------------------------------------------------------------------------------------------------

def _sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


GPU_CASES = [  # (dtype, kv heads, q heads, D, page[, fp8 cache: {scale dtype, granularity}])
    (torch.bfloat16, 8, 32, 128, 16),
    (torch.bfloat16, 2, 16, 128, 128),
    (torch.float16, 4, 4, 64, 256),
    (torch.bfloat16, 1, 4, 256, 64),
    (torch.bfloat16, 2, 8, 128, 4),  # gather4
    (torch.bfloat16, 2, 8, 64, 8),  # 8-row TMA boxes
    (torch.bfloat16, 2, 8, 128, 16, {"scale_dtype": torch.float32, "quantization_granularity": 16}),
    (torch.float16, 1, 8, 256, 128, {"scale_dtype": torch.float8_e8m0fnu, "quantization_granularity": 64}),
    (torch.bfloat16, 2, 4, 64, 64, {}),  # fp8 without scales
    (torch.float16, 2, 4, 64, 3),  # gather4, a page of 3
    (torch.bfloat16, 2, 8, 128, 4, {"scale_dtype": torch.float32, "quantization_granularity": 32}),  # fp8 gather4
    (torch.float16, 2, 4, 64, 3, {}),  # fp8 gather4, unscaled, 64-byte rows
]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("window", [None, 37])
def test_sm100_kernel_matches_reference(case, window):
    import cute_kv
    from numerics import bits

    dtype, h, hq, d, page = case[:5]
    cache = {"dtype": dtype} if len(case) == 5 else {"dtype": FP8, **case[5]}
    cached, new = [0, 37, 5, 300, 1, 1000], [3, 1, 0, 17, 1, 90]
    gen = torch.Generator().manual_seed(7)
    pb = random_paged_batch(cached, new, num_heads=h, head_size=d, page_size=page, generator=gen, device="cuda",
                            **cache)
    cpu = random_paged_batch(cached, new, num_heads=h, head_size=d, page_size=page,
                             generator=torch.Generator().manual_seed(7), **cache)
    q = torch.randn(pb.total_rows, hq, d, generator=gen).to(dtype)
    key = _plan_key(pb.collection, q.cuda())
    assert key is not None and key[0] == "paged_attention_sm100"
    before = bits(pb.collection.blocks)
    out = torch.full((pb.total_rows, hq, d), float("nan"), dtype=dtype, device="cuda")
    cute_kv.paged_attention(q.cuda(), pb.input_row_offsets.cuda(), pb.collection, 0, window=window, out=out)
    want = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 0, window=window)
    assert not out.isnan().any()
    assert rel_err(out.cpu().float(), want.float()) < 2e-2
    assert torch.equal(bits(pb.collection.blocks), before)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("splits", [1, 4])
def test_sm100_flags_match_the_oracle(splits, monkeypatch):
    """Soft-cap, sinks and lse through the SM100 launcher, one split and forced splits."""
    from cute_kv.ops import paged_attention_sm100 as entry

    gen = torch.Generator().manual_seed(8)
    cached, new = [0, 700, 3], [5, 1, 2]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=128, page_size=64, dtype=torch.bfloat16,
                            generator=gen, device="cuda")
    q = (2 * torch.randn(pb.total_rows, 8, 128, generator=gen)).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen)
    monkeypatch.setattr(entry, "launch_shape_sm100",
                        lambda c, hq, slots, causal=True, window=None, *, num_tokens: (
                            -(-min(c.max_seq_length, num_tokens) * 4 // BM), splits))
    key = _plan_key(pb.collection, q.cuda(), softcap=20.0, sinks=sinks.cuda(), return_lse=True)
    run = entry.launcher_sm100(key, "sm_100a")
    out = torch.full((pb.total_rows, 8, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((pb.total_rows, 8), float("nan"), device="cuda")
    run(q.cuda(), pb.input_row_offsets.cuda(), pb.collection, 0, out=out, softcap=20.0, sinks=sinks.cuda(), lse=lse)
    cpu = random_paged_batch(cached, new, num_heads=2, head_size=128, page_size=64, dtype=torch.bfloat16,
                             generator=torch.Generator().manual_seed(8))
    want, want_lse = oracle(q, cpu, 0, softcap=20.0, sinks=sinks)
    assert rel_err(out.cpu().double(), want) < 2e-2
    assert (lse.cpu().double() - want_lse).abs().max() < 1e-2


@pytest.mark.compile
def test_sm100_fp8_scales_decode_and_bound_as_torch():
    """e8m0 bytes 0 and 255 decode to torch's float32 bits (2^-127, NaN 0x7F800001), and every scale read is bounded
    by the scale view in 64 bits (one shared helper with SM90: ``quant.granule_scale``)."""
    from cute_kv.kernels.attention.sm100 import PagedAttentionSm100
    from cute_kv.kernels.quant import E8M0_MIN_BITS, E8M0_NAN_BITS

    kernel = PagedAttentionSm100("float16", 8, 1, 256, 128, kv_dtype_name="float8_e4m3fn", granularity=64,
                                 e8m0_scales=True)
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    loads = len(re.findall(r"ld\.global\.(?:nc\.)?[ub]8", ptx))
    assert loads and all(ptx.count(f"0f{bits:08X}") == loads for bits in (E8M0_MIN_BITS, E8M0_NAN_BITS))
    assert "0f7FC00000" not in ptx
    assert len(re.findall(r"setp\.\w+\.s64", ptx)) >= loads  # offset >= 0 and < rows * H * G, per read


def test_sm100_refuses_steps_past_the_store_window():
    """The TMA-store epilogue shifts a request's rows by 2^30 so rows past it fall out of bounds: a step of that
    many query rows (a meta tensor: nothing is allocated) takes the reference."""
    from cute_kv.ops.paged_attention_sm100 import RAGGED_ROWS, plan_sm100
    from cute_kv.reference.batch import random_paged_batch

    pb = random_paged_batch([3], [1], num_heads=8, head_size=128, page_size=16, dtype=torch.bfloat16,
                            generator=torch.Generator().manual_seed(0))
    q = torch.empty(RAGGED_ROWS, 32, 128, dtype=torch.bfloat16, device="meta")
    flags = dict(granularity=None, softcap=None, sinks=None, return_lse=False)
    path = plan_sm100(pb.collection, q, "sm_100a", **flags)
    assert path.path == "reference" and "2^30" in path.reason
    assert plan_sm100(pb.collection, q[: RAGGED_ROWS - 1], "sm_100a", **flags).path == "kernel"
