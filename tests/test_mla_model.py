"""The ``MLADecode`` algorithm, replayed in PyTorch, against the reference (no GPU needed).

A GPU run is what proves the kernel; this proves its plan. ``model_mla`` walks the grid the host launches
(``mla_decode.launch_shape``: 64 packed (token, head) rows a CTA over the one latent head, key splits) and does per
CTA what ``kernels/mla/sm90.py`` does: pack the heads of each token together in rows, pick the key tiles any row may
see and this split's share, walk them from the last; per tile, each of the two consumer warpgroups masks S over its
half of the keys (rows' key ranges; a tile every live row sees whole is not masked), the rows' maxima are the max of
the two halves', P is rounded to 16 bits and each warpgroup accumulates its half of O's value columns from the whole
P and the first ``v_dim`` columns of the same K tile (zeroed past the keys); the sums of the two halves meet in the
epilogue with the sink (split 0); partials merge by ``AttentionCombine``'s formula. Over a rope-aware FP8 cache the
key tile is what the producer warpgroup writes into the bf16 stage: ``bf16(float32(e4m3) * scale)`` beside the stored
bf16 rope, zeros past the keys.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kv import reference as ref
from cute_kv.kernels.mla.config import BM, BN, supported
from cute_kv.ops.mla_decode import launch_shape
from cute_kv.ops.kernel_args import window_arg
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from plan_replay import cta_tiles, join_sink, merge_splits, poisoned_partials

NEG_INF = float("-inf")
LOG2E = math.log2(math.e)
HALVES = 2  # consumer warpgroups: S split by keys, O by value columns


def model_cta(q, k, q_start, seq_len, cache_len, m_block, split, splits, v_dim, causal, window, scale, softcap,
              sinks):
    """One CTA: ``(tokens, heads, live, O/l [BM, v_dim], lse (log2) [BM])`` of its packed rows."""
    hq = q.shape[1]
    num_keys = cache_len + seq_len
    m0 = m_block * BM
    tok_first, tok_last, first_tile, n_tiles = cta_tiles(m0, BM, hq, seq_len, cache_len, causal, window, BN, split,
                                                         splits)

    toks = torch.arange(m0, m0 + BM) // hq
    heads = torch.arange(m0, m0 + BM) % hq  # a token's heads are consecutive rows
    live = toks < seq_len
    qr = torch.zeros(BM, q.shape[-1], dtype=torch.float64)
    qr[live] = q[q_start + toks[live], heads[live]].double()
    pos = cache_len + toks
    row_end = torch.where(live, torch.clamp(pos + 1, max=num_keys) if causal else torch.full_like(pos, num_keys), 0)
    row_begin = pos - window + 1 if window > 0 else torch.zeros_like(pos)
    score_scale, scale_log2 = (scale / softcap, softcap * LOG2E) if softcap else (None, scale * LOG2E)
    # The kernel's three loops after the first tile (always masked): masked tiles at the keys' end, whole tiles,
    # masked tiles at the window's start; a tile of the middle loop some live row does not see whole is a mismatch.
    unmasked_begin = cache_len + min(tok_last, seq_len - 1) - window + 1 if window > 0 else 0
    unmasked_end = min(cache_len + tok_first + 1, num_keys) if causal else num_keys
    last_tile = first_tile + n_tiles - 1
    masked_end = max(min(last_tile - unmasked_end // BN + 1, n_tiles), 1)
    unmasked_stop = n_tiles
    if unmasked_begin > 0:
        unmasked_stop = max(min(last_tile - (unmasked_begin + BN - 1) // BN + 1, n_tiles), masked_end)

    half_n, half_v = BN // HALVES, v_dim // HALVES
    row_max = torch.full((BM,), NEG_INF, dtype=torch.float64)
    sums = torch.zeros(HALVES, BM, dtype=torch.float64)  # each warpgroup sums its own keys' P
    acc = [torch.zeros(BM, half_v, dtype=torch.float64) for _ in range(HALVES)]
    for t in reversed(range(first_tile, first_tile + n_tiles)):  # last tile first
        keys = torch.arange(t * BN, (t + 1) * BN)
        kt = torch.zeros(BN, q.shape[-1], dtype=torch.float64)
        inside = keys < num_keys  # past the keys: zero-filled page slots, V columns zeroed in shared memory
        kt[inside] = k[keys[inside], 0].double()
        i = last_tile - t
        whole = masked_end <= i < unmasked_stop
        s_halves, maxima = [], []
        for w in range(HALVES):  # warpgroup w: S of keys [32w, 32w + 32), masked on a masked tile
            cols = slice(w * half_n, (w + 1) * half_n)
            s = qr @ kt[cols].T
            if softcap:
                s = torch.tanh(s * score_scale)
            if not whole:
                kw = keys[cols]
                s = s.masked_fill((kw[None, :] < row_begin[:, None]) | (kw[None, :] >= row_end[:, None]), NEG_INF)
            s_halves.append(s)
            maxima.append(torch.maximum(row_max, s.max(dim=1).values))
        new_max = torch.maximum(*maxima)  # the exchange through shared memory
        ref_max = torch.where(new_max == NEG_INF, 0.0, new_max * scale_log2)
        corr = torch.exp2(row_max * scale_log2 - ref_max)
        p = torch.cat([torch.exp2(s * scale_log2 - ref_max[:, None]) for s in s_halves], dim=1)
        for w in range(HALVES):
            sums[w] = sums[w] * corr + p[:, w * half_n:(w + 1) * half_n].sum(dim=1)
        p16 = p.to(q.dtype).double()  # the P tile in shared memory, read whole by both warpgroups
        vt = kt[:, :v_dim]  # V: the first v_dim columns of the same K tile
        for w in range(HALVES):
            acc[w] = acc[w] * corr[:, None] + p16 @ vt[:, w * half_v:(w + 1) * half_v]
        row_max = new_max
    row_sum = sums.sum(0)
    # the sink joins the denominator once, in split 0
    sink = sinks[heads].double() * LOG2E if sinks is not None and split == 0 else None
    row_sum, top, weight = join_sink(row_sum, row_max * scale_log2, sink)
    pos_sum = row_sum > 0
    inv = torch.where(pos_sum, weight / row_sum.clamp_min(1e-300), 0.0)
    out = torch.cat(acc, dim=1) * inv[:, None]
    lse = torch.where(pos_sum, top + torch.log2(row_sum.clamp_min(1e-300)), NEG_INF)
    return toks, heads, live, out, lse


def model_mla(q, pb, layer, v_dim, *, causal=True, window=None, scale=None, softcap=None, sinks=None, slots=132,
              force_splits=None):
    """The whole launch (grid, splits, combine): float64 ``[T, Hq, v_dim]`` and the natural-log ``lse [T, Hq]``."""
    c = pb.collection
    t, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    m_blocks, splits = launch_shape(c, hq, slots, causal, window, num_tokens=t)
    splits = force_splits or splits
    o_part, lse_part = poisoned_partials(splits, t, hq, v_dim)
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        k = kernel_keys(pb, layer, b, cache_len + n, q.dtype)
        for m_block in range(m_blocks):
            if m_block * BM >= n * hq:
                continue  # the CTA has no rows
            for split in range(splits):
                toks, heads, live, o, lse = model_cta(q, k, offsets[b], n, cache_len, m_block, split, splits, v_dim,
                                                      causal, window_arg(window), scale, softcap, sinks)
                o_part[split, offsets[b] + toks[live], heads[live]] = o[live]
                lse_part[split, offsets[b] + toks[live], heads[live]] = lse[live]
    return merge_splits(o_part, lse_part)


def kernel_keys(pb, layer, b, stop, dtype):
    """Request ``b``'s keys ``[0, stop)`` as the kernel's stage holds them, ``[n, 1, latent_dim]``: 16-bit rows as
    stored; rope-aware rows dequantized once (e4m3 to float32, times the token's float32 scale, rounded to bf16)
    beside their bf16 rope."""
    fmt = pb.collection.row_format
    if fmt is None:
        return pb.dense(0, layer, b, stop).to(dtype)
    values, scales = pb.tokens(0, layer, b, 0, stop)
    content = (fmt.content(values).to(torch.float32) * scales.to(torch.float32)).to(dtype)
    return torch.cat([content, fmt.rope(values)], dim=-1)


def _batch(cached, new, latent, page_size, gen, dtype=torch.bfloat16):
    return random_paged_batch(cached, new, num_heads=1, head_size=latent, page_size=page_size, is_mla=True,
                              dtype=dtype, generator=gen)


@settings(max_examples=20, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 6)), min_size=1, max_size=3),
    page_size=st.sampled_from([16, 64, 128]),
    hq=st.sampled_from([8, 16, 24, 128]),
    dims=st.sampled_from([(576, 512), (192, 128), (256, 256)]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.integers(1, 200)),
    splits=st.one_of(st.none(), st.integers(2, 5)),
    softcap=st.sampled_from([None, 0.7, 30.0]),
    with_sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_plan_matches_reference(lengths, page_size, hq, dims, causal, window, splits, softcap, with_sinks, seed):
    """Ragged steps (decode and multi-token chunks, empty requests), head counts filling, splitting or sharing the
    64-row blocks (24 heads: a token's heads straddle two blocks), latent/value widths, masks, splits, features."""
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    if not sum(new) or (window is not None and not causal):
        return
    latent, v_dim = dims
    assert supported(hq, latent, v_dim, page_size, "bfloat16") is None
    pb = _batch(cached, new, latent, page_size, gen)
    q = torch.randn(pb.total_rows, hq, latent, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(hq, generator=gen) * 3 if with_sinks else None
    kw = {"causal": causal, "window": window, "softcap": softcap, "sinks": sinks}
    want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=v_dim, return_lse=True,
                                         **kw)
    got, lse = model_mla(q, pb, 0, v_dim, force_splits=splits, **kw)
    assert not got.isnan().any() and not lse.isnan().any()  # every (token, head) written, by some CTA
    assert rel_err(got, want.float()) < 1e-2
    assert (lse - want_lse.double()).abs().max() < 1e-3


def test_deepseek_decode_splits_and_merges():
    """DeepSeek decode (128 heads, 576/512, page 64): two 64-row blocks per token; a 2000-key request split as the
    host plans it for a small batch (and forced 5 ways) equals the reference, the sink counted once."""
    gen = torch.Generator().manual_seed(7)
    pb = _batch([2000, 1, 0, 63], [1, 1, 1, 1], 576, 64, gen)
    q = torch.randn(pb.total_rows, 128, 576, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(128, generator=gen)
    # the plan splits this batch's long request
    assert launch_shape(pb.collection, 128, 132, num_tokens=pb.total_rows)[1] > 1
    want, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, mla_v_dim=512, sinks=sinks,
                                         return_lse=True)
    for splits in (None, 5):
        got, lse = model_mla(q, pb, 1, 512, sinks=sinks, force_splits=splits)
        assert rel_err(got, want.float()) < 1e-2
        assert (lse - want_lse.double()).abs().max() < 1e-3


@pytest.mark.parametrize("cached,new", [([64, 127, 128, 0], [1, 1, 1, 65]), ([0, 1, 191], [2, 63, 1])])
def test_plan_at_tile_and_block_boundaries(cached, new):
    """Last keys that end or start a 64-key tile; chunks whose (token, head) rows fill or spill 64-row blocks."""
    gen = torch.Generator().manual_seed(8)
    pb = _batch(cached, new, 192, 16, gen)
    q = torch.randn(pb.total_rows, 24, 192, generator=gen).to(torch.bfloat16)
    for window, splits in ((None, None), (None, 3), (1, None), (70, 2)):
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=128, window=window)
        assert rel_err(model_mla(q, pb, 0, 128, window=window, force_splits=splits)[0], want.float()) < 1e-2


@pytest.mark.parametrize("cached,new,page_size,hq,splits", [
    ([0, 1, 130, 64, 5], [1, 1, 1, 1, 0], 64, 128, None),  # DeepSeek decode: contexts of 1 and 2 keys, an empty step
    ([2000, 3], [1, 1], 64, 128, 5),  # a long context split five ways, merged
    ([0, 37, 70], [3, 1, 17], 16, 16, 2),  # chunked steps over four page slots a tile, 16 heads (TP 8)
])
def test_rope_aware_plan_matches_hand_decoded_formula(cached, new, page_size, hq, splits):
    """Rope-aware FP8 rows (512 e4m3 | 64 bf16, one float32 scale a token): the replayed kernel (tiles dequantized
    as the producer does) against float64 causal attention over rows decoded by hand from their bytes."""
    from test_mla_rope_aware import dense_mla

    gen = torch.Generator().manual_seed(sum(cached) + hq)
    pb = random_paged_batch(cached, new, num_heads=1, head_size=640, page_size=page_size, is_mla=True,
                            dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=64, generator=gen)
    pb.poison_unread(0)  # NaN bytes and scales in every slot the step must not read
    assert supported(hq, 576, 512, page_size, "bfloat16", 64) is None
    q = torch.randn(pb.total_rows, hq, 576, generator=gen).to(torch.bfloat16)
    got, lse = model_mla(q, pb, 0, 512, force_splits=splits)
    assert not got.isnan().any() and not lse.isnan().any()
    assert rel_err(got, dense_mla(pb, q, 0, 512, 1 / math.sqrt(576))) < 1e-2
