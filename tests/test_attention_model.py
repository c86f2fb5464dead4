"""The ``PagedAttention`` algorithm, replayed in PyTorch, against the reference (no GPU needed).

A GPU run is what proves the kernel; this proves its plan. ``model_attention`` walks the same grid the host launches
(``launch_shape``, ``BM``, ``BN``, the window argument) and does per CTA what ``kernels/attention/sm90.py`` does:
pack the GQA heads into rows, pick the key tiles any row may see and this split's share of them, mask each tile by
row, run the base-2 online softmax with the kernel's guards, round P to 16 bits, zero V past the keys, and write
either the output or float32 partials that ``AttentionCombine``'s formula merges. Ragged steps, windows, GQA ratios
and forced splits are drawn by hypothesis; any off-by-one in the tile or split ranges shows as a mismatch.
"""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kv import reference as ref
from cute_kv.kernels.attention.config import BM, BN
from cute_kv.ops.paged_attention import _window_arg, launch_shape
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err

NEG_INF = float("-inf")


def model_cta(q, k, v, q_start, seq_len, cache_len, m_block, kv_head, split, splits, group, causal, window, scale):
    """One CTA: ``(rows [(token, head)], O/l [rows, D], lse (log2) [rows])`` for its packed rows."""
    bn = BN
    num_keys = cache_len + seq_len
    m0 = m_block * BM
    tok_first, tok_last = m0 // group, (min(m0 + BM, seq_len * group) - 1) // group
    k_end = cache_len + tok_last + 1 if causal else num_keys
    k_begin = max(cache_len + tok_first - window + 1, 0) if window > 0 else 0
    tile_begin = k_begin // bn
    tiles = -(-k_end // bn) - tile_begin
    per_split = -(-tiles // splits)
    first_tile = tile_begin + split * per_split
    n_tiles = max(min(per_split, tiles - split * per_split), 0)

    rows = [(m0 + r) // group for r in range(BM)], [kv_head * group + (m0 + r) % group for r in range(BM)]
    toks = torch.tensor(rows[0])
    live = toks < seq_len
    qr = torch.zeros(BM, q.shape[-1], dtype=torch.float64)
    qr[live] = q[q_start + toks[live], torch.tensor(rows[1])[live]].double()
    pos = cache_len + toks
    row_end = torch.where(live, torch.clamp(pos + 1, max=num_keys) if causal else torch.full_like(pos, num_keys), 0)
    row_begin = pos - window + 1 if window > 0 else torch.zeros_like(pos)

    row_max = torch.full((BM,), NEG_INF, dtype=torch.float64)
    row_sum = torch.zeros(BM, dtype=torch.float64)
    acc = torch.zeros(BM, q.shape[-1], dtype=torch.float64)
    scale_log2 = scale * math.log2(math.e)
    for t in range(first_tile, first_tile + n_tiles):
        keys = torch.arange(t * bn, (t + 1) * bn)
        kt = torch.zeros(bn, q.shape[-1], dtype=torch.float64)
        vt = torch.zeros_like(kt)
        inside = keys < num_keys  # past the keys: zero-filled pages / zeroed V rows
        kt[inside] = k[keys[inside], kv_head].double()
        vt[inside] = v[keys[inside], kv_head].double()
        x = (qr @ kt.T) * scale_log2
        x = x.masked_fill((keys[None, :] < row_begin[:, None]) | (keys[None, :] >= row_end[:, None]), NEG_INF)
        new_max = torch.maximum(row_max, x.max(dim=1).values)
        ref_max = torch.where(new_max == NEG_INF, 0.0, new_max)
        corr = torch.exp2(row_max - ref_max)
        p = torch.exp2(x - ref_max[:, None])
        row_sum = row_sum * corr + p.sum(dim=1)
        acc = acc * corr[:, None] + p.to(q.dtype).double() @ vt  # P is rounded to the MMA dtype
        row_max = new_max
    out = torch.where(row_sum[:, None] > 0, acc / row_sum.clamp_min(1e-300)[:, None], 0.0)
    lse = torch.where(row_sum > 0, row_max + torch.log2(row_sum.clamp_min(1e-300)), NEG_INF)
    return rows, live, out, lse


def model_attention(q, pb, layer, *, causal=True, window=None, scale=None, slots=264, force_splits=None):
    """The whole launch (grid, splits, combine) for ``q [T, Hq, D]`` over ``pb``'s cache; float64 ``[T, Hq, D]``."""
    c = pb.collection
    t, hq, d = q.shape
    h = c.num_heads
    group = hq // h
    scale = 1 / math.sqrt(d) if scale is None else scale
    win = _window_arg(window)
    m_blocks, splits = launch_shape(c, hq, slots)
    splits = force_splits or splits
    o_part = torch.full((splits, t, hq, d), float("nan"), dtype=torch.float64)
    lse_part = torch.full((splits, t, hq), float("nan"), dtype=torch.float64)
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        k = pb.dense(0, layer, b, cache_len + n).to(q.dtype)
        v = pb.dense(1, layer, b, cache_len + n).to(q.dtype)
        for m_block in range(m_blocks):
            if m_block * BM >= n * group:
                continue  # the CTA has no rows
            for kv_head in range(h):
                for split in range(splits):
                    (toks, heads), live, o, lse = model_cta(q, k, v, offsets[b], n, cache_len, m_block, kv_head,
                                                            split, splits, group, causal, win, scale)
                    for r in range(BM):
                        if live[r]:
                            o_part[split, offsets[b] + toks[r], heads[r]] = o[r]
                            lse_part[split, offsets[b] + toks[r], heads[r]] = lse[r]
    if splits == 1:
        return o_part[0]
    top = lse_part.max(dim=0).values
    w = torch.where(lse_part == NEG_INF, 0.0, torch.exp2(lse_part - top))
    return (w[..., None] * o_part).sum(0) / w.sum(0)[..., None]


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)), min_size=1, max_size=4),
    page_size=st.sampled_from([16, 64, 128]),
    group=st.sampled_from([1, 4, 8]),
    head_dim=st.sampled_from([64, 256]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 200)),
    splits=st.one_of(st.none(), st.integers(2, 5)),
    seed=st.integers(0, 2**31),
)
def test_kernel_plan_matches_reference(lengths, page_size, group, head_dim, causal, window, splits, seed):
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    if not sum(new) or (window is not None and not causal):
        return
    pb = random_paged_batch(cached, new, num_heads=2, head_size=head_dim, page_size=page_size, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 2 * group, head_dim, generator=gen).to(torch.bfloat16)
    want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, causal=causal, window=window)
    got = model_attention(q, pb, 0, causal=causal, window=window, force_splits=splits)
    assert not got.isnan().any()  # every (token, head) written, by some CTA
    assert rel_err(got, want.float()) < 1e-2


def test_plan_splits_long_decode_and_merges_exactly():
    """A 3000-key decode split 5 ways (splits empty of visible keys under a window) equals one split, up to P's
    16-bit rounding (which depends on each split's running max)."""
    gen = torch.Generator().manual_seed(3)
    pb = random_paged_batch([3000, 40], [1, 2], num_heads=1, head_size=64, page_size=64, dtype=torch.bfloat16,
                            generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    for window in (None, 300):
        one = model_attention(q, pb, 0, window=window, force_splits=1)
        five = model_attention(q, pb, 0, window=window, force_splits=5)
        assert rel_err(five, one) < 1e-3
        assert rel_err(one, ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, window=window)) < 1e-2


def test_plan_at_tile_and_block_boundaries():
    """Steps whose last key starts or ends a 128-key tile, and whose packed rows fill or spill a 64-row block."""
    gen = torch.Generator().manual_seed(4)
    cached, new = [128, 127, 0, 255, 0, 64], [1, 1, 129, 2, 1, 16]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=64, page_size=16, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(pb.total_rows, 8, 64, generator=gen).to(torch.bfloat16)
    for window, splits in ((None, None), (None, 3), (1, None), (128, 2)):
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, window=window)
        assert rel_err(model_attention(q, pb, 0, window=window, force_splits=splits), want.float()) < 1e-2
