"""The ``PagedAttention`` algorithm, replayed in PyTorch, against the reference (no GPU needed).

A GPU run is what proves the kernel; this proves its plan. ``model_attention`` walks the same grid the host launches
(``launch_shape``, ``BM``, ``key_tile``, the window argument) and does per CTA what
``kernels/attention/sm90.py`` does: pack the GQA heads into rows, pick the key tiles any row may see and this
split's share of them, walk them from the last, mask each tile by row (soft-capped first; a warpgroup skips tiles
its live rows all see whole), run the base-2 online
softmax of unscaled scores with the kernel's guards, round P to 16 bits, zero V past the keys, fold the sink in
(split 0), and write either the output and lse or float32 partials that ``AttentionCombine``'s formula merges.
Ragged steps, windows, GQA ratios, soft-caps, sinks and forced splits are drawn by hypothesis; any off-by-one in the
tile or split ranges shows as a mismatch.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kv import reference as ref
from cute_kv.kernels.attention.config import BM, gathers, key_tile
from cute_kv.ops.kernel_args import window_arg
from cute_kv.ops.paged_attention_sm90 import collection_key_tile
from cute_kv.ops.splits import launch_shape
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from plan_replay import cta_tiles, join_sink, merge_splits, poisoned_partials

NEG_INF = float("-inf")
WG_ROWS = 64  # packed rows a consumer warpgroup computes
LOG2E = math.log2(math.e)


def model_cta(q, k, v, q_start, seq_len, cache_len, m_block, kv_head, split, splits, group, causal, window, scale,
              softcap, sinks, k_past=0.0, bn=None):
    """One CTA: ``(rows [(token, head)], live, O/l [rows, D], lse (log2) [rows])`` for its packed rows; O is None
    for a split with no key tile, which writes its lse (-inf) alone. ``k_past``: K rows past the keys as loaded
    (TMA zero-fills them; a gather leaves what the stage held, NaN here). ``bn``: the key tile (default: of values
    as wide as the head dim)."""
    bm, bn = BM, bn or key_tile(q.shape[-1])
    num_keys = cache_len + seq_len
    m0 = m_block * bm
    tok_first, tok_last, first_tile, n_tiles = cta_tiles(m0, bm, group, seq_len, cache_len, causal, window, bn, split,
                                                         splits)

    rows = [(m0 + r) // group for r in range(bm)], [kv_head * group + (m0 + r) % group for r in range(bm)]
    toks = torch.tensor(rows[0])
    live = toks < seq_len
    if n_tiles == 0 and splits > 1:  # skip_split
        assert split > 0  # split 0 holds a tile of every live block: the sink is never skipped
        return rows, live, None, torch.full((bm,), NEG_INF, dtype=torch.float64)
    qr = torch.zeros(bm, q.shape[-1], dtype=torch.float64)
    # Q by TMA (the group divides a warpgroup's rows): rows past the request hold the next requests' tokens, zeros
    # past q's end; the thread copy writes zeros. Either way only masked S entries may come of them.
    loaded = q_start + toks < q.shape[0] if WG_ROWS % group == 0 else live
    qr[loaded] = q[q_start + toks[loaded], torch.tensor(rows[1])[loaded]].double()
    pos = cache_len + toks
    row_end = torch.where(live, torch.clamp(pos + 1, max=num_keys) if causal else torch.full_like(pos, num_keys), 0)
    row_begin = pos - window + 1 if window > 0 else torch.zeros_like(pos)
    # unscaled scores, and the softmax's scale (kernel arguments score_scale, softmax_scale_log2)
    score_scale, scale_log2 = (scale / softcap, softcap * LOG2E) if softcap else (None, scale * LOG2E)

    unmasked = []  # per consumer warpgroup: the keys every live row of it sees
    for w in range(bm // WG_ROWS):
        rows0 = m0 + w * WG_ROWS
        tok_lo = rows0 // group
        tok_hi = min((min(rows0 + WG_ROWS, seq_len * group) - 1) // group, seq_len - 1)
        unmasked.append((cache_len + tok_hi - window + 1 if window > 0 else 0,
                         min(cache_len + tok_lo + 1, num_keys) if causal else num_keys))
    row_max = torch.full((bm,), NEG_INF, dtype=torch.float64)
    row_sum = torch.zeros(bm, dtype=torch.float64)
    acc = torch.zeros(bm, q.shape[-1], dtype=torch.float64)
    for t in reversed(range(first_tile, first_tile + n_tiles)):  # last tile first
        keys = torch.arange(t * bn, (t + 1) * bn)
        kt = torch.full((bn, q.shape[-1]), k_past, dtype=torch.float64)
        vt = torch.zeros_like(kt)
        inside = keys < num_keys  # past the keys: zero-filled pages (or stale gathered rows) / zeroed V rows
        kt[inside] = k[keys[inside], kv_head].double()
        vt[inside] = v[keys[inside], kv_head].double()
        s = qr @ kt.T
        if softcap:
            s = torch.tanh(s * score_scale)
        masked = s.masked_fill((keys[None, :] < row_begin[:, None]) | (keys[None, :] >= row_end[:, None]), NEG_INF)
        for w in range(bm // WG_ROWS):  # a warpgroup skips the masks on a tile all its live rows see whole
            if not (t * bn < unmasked[w][0] or (t + 1) * bn > unmasked[w][1]):
                masked[w * WG_ROWS:(w + 1) * WG_ROWS] = s[w * WG_ROWS:(w + 1) * WG_ROWS]
        s = masked
        new_max = torch.maximum(row_max, s.max(dim=1).values)
        ref_max = torch.where(new_max == NEG_INF, 0.0, new_max * scale_log2)
        corr = torch.exp2((row_max - torch.where(new_max == NEG_INF, 0.0, new_max)) * scale_log2)  # as the kernel
        p = torch.exp2(s * scale_log2 - ref_max[:, None])
        row_sum = row_sum * corr + p.sum(dim=1)
        acc = acc * corr[:, None] + p.to(q.dtype).double() @ vt  # P is rounded to the MMA dtype
        row_max = new_max
    # the sink joins the denominator once, in split 0
    sink = sinks[torch.tensor(rows[1])].double() * LOG2E if sinks is not None and split == 0 else None
    row_sum, top, weight = join_sink(row_sum, row_max * scale_log2, sink)
    pos_sum = row_sum > 0
    out = torch.where(pos_sum[:, None], acc * (weight / row_sum.clamp_min(1e-300))[:, None], 0.0)
    lse = torch.where(pos_sum, top + torch.log2(row_sum.clamp_min(1e-300)), NEG_INF)
    return rows, live, out, lse


def gathered_rows(c, kv_idx, layer, b, num_keys):
    """Keys ``[0, num_keys)`` of request ``b`` as the gather (``kernels/attention/row_gather.py``) addresses them: row
    ``lookup[b, key // P] * KVD*L*P + key % P`` of the plane's row view (``H * D`` elements a row from the plane's
    first element), read from the cache's memory as one flat run of rows."""
    n_pages, kvd, n_layers, p, h, d = c.blocks.shape
    keys = torch.arange(num_keys)
    rows = c.lookup_table[b, keys // p].long() * (kvd * n_layers * p) + keys % p
    flat = c.blocks.reshape(-1, h, d)  # every (page, K/V, layer, slot) row; the plane starts (kv*L + layer)*P in
    return flat[rows + (kv_idx * n_layers + layer) * p]


def model_attention(q, pb, layer, *, causal=True, window=None, scale=None, softcap=None, sinks=None, slots=132,
                    force_splits=None):
    """The whole launch (grid, splits, combine) for ``q [T, Hq, D]`` over ``pb``'s cache: float64 ``[T, Hq, D]``
    and the natural-log ``lse [T, Hq]``."""
    c = pb.collection
    t, hq, d = q.shape
    h = c.num_heads
    group = hq // h
    scale = 1 / math.sqrt(d) if scale is None else scale
    win = window_arg(window)
    bn = collection_key_tile(c)
    m_blocks, splits = launch_shape(c, hq, slots, BM, bn, causal, window, num_tokens=t)
    splits = force_splits or splits
    o_part, lse_part = poisoned_partials(splits, t, hq, d)
    offsets = pb.input_row_offsets.tolist()
    gather = gathers(c.page_size, bn)
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        if gather:
            k, v = (gathered_rows(c, kv_idx, layer, b, cache_len + n) for kv_idx in (0, 1))
        else:
            k = pb.dense(0, layer, b, cache_len + n).to(q.dtype)
            v = pb.dense(1, layer, b, cache_len + n).to(q.dtype)
        for m_block in range(m_blocks):
            if m_block * BM >= n * group:
                continue  # the CTA has no rows
            for kv_head in range(h):
                for split in range(splits):
                    (toks, heads), live, o, lse = model_cta(q, k, v, offsets[b], n, cache_len, m_block, kv_head,
                                                            split, splits, group, causal, win, scale, softcap, sinks,
                                                            math.nan if gather else 0.0, bn)
                    for r in range(BM):
                        if live[r]:
                            if o is not None:
                                o_part[split, offsets[b] + toks[r], heads[r]] = o[r]
                            lse_part[split, offsets[b] + toks[r], heads[r]] = lse[r]
    return merge_splits(o_part, lse_part)


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), min_size=1, max_size=4),
    page_size=st.sampled_from([16, 64, 128]),
    group=st.sampled_from([1, 4, 6, 8]),  # 6: Q by thread copies (6 does not divide 64)
    head_dim=st.sampled_from([64, 256]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 200)),
    splits=st.one_of(st.none(), st.integers(2, 5)),
    softcap=st.sampled_from([None, 0.7, 30.0]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_kernel_plan_matches_reference(lengths, page_size, group, head_dim, causal, window, splits, softcap,
                                       with_sinks, seed):
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    if not sum(new) or (window is not None and not causal):
        return
    pb = random_paged_batch(cached, new, num_heads=2, head_size=head_dim, page_size=page_size, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(2 * group, generator=gen) * 3 if with_sinks else None
    kw = {"causal": causal, "window": window, "softcap": softcap, "sinks": sinks}
    want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, return_lse=True, **kw)
    got, lse = model_attention(q, pb, 0, force_splits=splits, **kw)
    assert not got.isnan().any() and not lse.isnan().any()  # every (token, head) written, by some CTA
    assert rel_err(got, want.float()) < 1e-2
    assert (lse - want_lse.double()).abs().max() < 1e-3


@settings(max_examples=12, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 20)), min_size=1, max_size=4),
    page_size=st.sampled_from([1, 2, 4, 8, 24]),  # 24 neither divides nor is divided by the key tile
    group=st.sampled_from([1, 4, 6]),
    head_dim=st.sampled_from([64, 256]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 200)),
    splits=st.one_of(st.none(), st.integers(2, 4)),
    seed=st.integers(0, 2**31),
)
def test_gathered_pages_plan_matches_reference(lengths, page_size, group, head_dim, causal, window, splits, seed):
    """Pages the gather loads (``row_gather``): each key's row from its own lookup entry in shuffled tables, ragged
    steps with requests of 0 and 1 tokens and empty caches; rows past the keys stale (NaN) in K, zeroed in V."""
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*(lengths + [(0, 1), (1, 0), (0, 0)]))
    if window is not None and not causal:
        return
    pb = random_paged_batch(cached, new, num_heads=2, head_size=head_dim, page_size=page_size, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    kw = {"causal": causal, "window": window}
    want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, return_lse=True, **kw)
    got, lse = model_attention(q, pb, 0, force_splits=splits, **kw)
    assert not got.isnan().any() and not lse.isnan().any()
    assert rel_err(got, want.float()) < 1e-2
    assert (lse - want_lse.double()).abs().max() < 1e-3


def test_rows_past_the_request_never_reach_its_output():
    """Q by TMA loads a block's rows past the request from the next request's tokens: with those tokens' Q at
    +-inf (NaN in their S rows of unmasked tiles), the first request's output and lse are unchanged and finite."""
    gen = torch.Generator().manual_seed(5)
    pb = random_paged_batch([300, 0], [3, 40], num_heads=2, head_size=64, page_size=16, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    poisoned = q.clone()
    poisoned[3:] = torch.where(torch.rand(poisoned[3:].shape, generator=gen) < 0.5, -math.inf, math.inf)
    got, lse = model_attention(q, pb, 0, causal=True)
    bad, bad_lse = model_attention(poisoned, pb, 0, causal=True)
    assert torch.isfinite(bad[:3]).all() and torch.isfinite(bad_lse[:3]).all()
    assert torch.equal(bad[:3], got[:3]) and torch.equal(bad_lse[:3], lse[:3])


def test_plan_splits_long_decode_and_merges_exactly():
    """A 3000-key decode split 5 ways (splits empty of visible keys under a window) equals one split, up to P's
    16-bit rounding (which depends on each split's running max); the sink is counted once."""
    gen = torch.Generator().manual_seed(3)
    pb = random_paged_batch([3000, 40], [1, 2], num_heads=1, head_size=64, page_size=64, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen)
    for window in (None, 300):
        one, one_lse = model_attention(q, pb, 0, window=window, sinks=sinks, force_splits=1)
        five, five_lse = model_attention(q, pb, 0, window=window, sinks=sinks, force_splits=5)
        assert rel_err(five, one) < 1e-3 and (five_lse - one_lse).abs().max() < 1e-6
        want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, window=window, sinks=sinks,
                                             return_lse=True)
        assert rel_err(one, want) < 1e-2 and (one_lse - want_lse.double()).abs().max() < 1e-4


def test_plan_at_tile_and_block_boundaries():
    """Steps whose last key starts or ends a 128-key tile, and whose packed rows fill or spill a 128-row block."""
    gen = torch.Generator().manual_seed(4)
    cached, new = [128, 127, 0, 255, 0, 64], [1, 1, 129, 2, 1, 32]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=64, page_size=16, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    for window, splits in ((None, None), (None, 3), (1, None), (128, 2)):
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, window=window)
        assert rel_err(model_attention(q, pb, 0, window=window, force_splits=splits)[0], want.float()) < 1e-2


@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_plan_at_the_narrow_and_wide_head_dims(head_dim):
    """Head dims 80 and 96 (128-key tiles) and 192 (112-key tiles, ``key_tile``), split and not, over pages that
    hold several tiles, several pages a tile, or parts of a tile (128-row pages at 112 keys)."""
    gen = torch.Generator().manual_seed(head_dim)
    for page_size, splits in ((16, None), (128, 3)):
        pb = random_paged_batch([300, 64, 0], [1, 17, 70], num_heads=2, head_size=head_dim, page_size=page_size,
                                dtype=torch.bfloat16, generator=gen)
        q = torch.randn(pb.total_rows, 8, head_dim, generator=gen).to(torch.bfloat16)
        want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, return_lse=True)
        got, lse = model_attention(q, pb, 0, force_splits=splits)
        assert rel_err(got, want.float()) < 1e-2
        assert (lse - want_lse.double()).abs().max() < 1e-3


def test_plan_over_fp8_caches():
    """An fp8 cache (float32 and e8m0 scales, and unscaled): the plan reads the dequantized values rounded once to
    the MMA dtype, as the producer warpgroup writes them."""
    gen = torch.Generator().manual_seed(5)
    for fp8 in ({"scale_dtype": torch.float32, "quantization_granularity": 16},
                {"scale_dtype": torch.float8_e8m0fnu, "quantization_granularity": 32}, {}):
        pb = random_paged_batch([300, 17, 0], [1, 3, 40], num_heads=2, head_size=64, page_size=16,
                                dtype=torch.float8_e4m3fn, generator=gen, **fp8)
        q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0)
        assert rel_err(model_attention(q, pb, 0)[0], want.float()) < 1e-2


def test_causal_ragged_step_skips_empty_splits():
    """A causal step mixing a long decode with short prefills, requests of 0 and 1 tokens and an empty cache: the
    plan splits it (one 128-row block, the long cache), so the short requests' later splits hold no key tile. Those
    CTAs write their rows' lse (-inf) and no O (left NaN here): the combine reads no O of theirs, and every output
    row still equals the reference."""
    gen = torch.Generator().manual_seed(6)
    cached, new = [4000, 0, 5, 0, 130, 1], [1, 0, 20, 1, 3, 1]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=64, page_size=64, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen)
    m_blocks, splits = launch_shape(pb.collection, 8, 132, BM, key_tile(64), True, None, num_tokens=pb.total_rows)
    assert m_blocks == 1 and splits > 2
    skipped = [b for b, (c, n) in enumerate(zip(cached, new))
               if n and cta_tiles(0, BM, 4, n, c, True, 0, key_tile(64), splits - 1, splits)[3] == 0]
    assert skipped == [2, 3, 4, 5]  # all but the long decode (request 1 has no token, so no CTA rows)
    for kw in ({}, {"sinks": sinks}, {"window": 50}, {"softcap": 30.0}):
        want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, return_lse=True, **kw)
        got, lse = model_attention(q, pb, 0, **kw)
        assert not got.isnan().any() and rel_err(got, want.float()) < 1e-2
        assert (lse - want_lse.double()).abs().max() < 1e-3


def test_wave_model_counts_blocks_with_rows():
    """The split count's CTAs are the query blocks that hold rows: a batch of one long decode beside many requests
    with no new token splits as that decode alone does, not as if every request filled a block."""
    gen = torch.Generator().manual_seed(7)
    alone = random_paged_batch([8192], [1], num_heads=8, head_size=128, page_size=64, dtype=torch.bfloat16,
                               generator=gen)
    crowd = random_paged_batch([8192] + [0] * 63, [1] + [0] * 63, num_heads=8, head_size=128, page_size=64,
                               dtype=torch.bfloat16, generator=gen)
    want = launch_shape(alone.collection, 32, 132, BM, 128, True, None, num_tokens=1)
    assert want[1] > 1
    assert launch_shape(crowd.collection, 32, 132, BM, 128, True, None, num_tokens=1) == want
