"""Reference paged attention against dense float64 attention per request, with every unread slot NaN-poisoned."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_kv import reference as ref
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err

# Mixed step: fresh prefill, decode, empty request, prefill after a multi-page prefix, decode.
CACHED = [0, 37, 5, 130, 9]
NEW = [5, 1, 0, 17, 1]


def dense_attention(pb, q, layer, *, causal=True, window=None, scale=None, mla_v_dim=None, softcap=None, sinks=None,
                    with_lse=False):
    """float64 ``[T, Hq, D_v]`` (and the natural-log ``lse [T, Hq]`` with ``with_lse``): each request's queries
    against a dense copy of its K/V, head by head; soft-cap and sink written out term by term."""
    c = pb.collection
    t, hq, d = q.shape
    group = hq // c.num_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.full((t, hq, mla_v_dim or d), float("nan"), dtype=torch.float64)
    lse = torch.full((t, hq), float("nan"), dtype=torch.float64)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        keys = pb.dense(0, layer, b, cl + n)
        values = keys[..., :mla_v_dim] if c.is_mla else pb.dense(1, layer, b, cl + n)
        rows = pb.rows(b)
        for i in range(n):
            p = cl + i
            lo = 0 if window is None else max(p - window + 1, 0)
            hi = p + 1 if causal else cl + n
            for h in range(hq):
                s = keys[lo:hi, h // group] @ q[rows][i, h].double() * scale
                if softcap:
                    s = softcap * torch.tanh(s / softcap)
                sink = None if sinks is None else float(sinks[h])
                m = s.max() if sink is None else torch.clamp(s.max(), min=sink)
                e = torch.exp(s - m)
                den = e.sum() + (0.0 if sink is None else math.exp(sink - m))
                out[rows.start + i, h] = e @ values[lo:hi, h // group] / den
                lse[rows.start + i, h] = m + torch.log(den)
    return (out, lse) if with_lse else out


def _run(pb, q, layer, **kw):
    out = torch.full((*q.shape[:2], kw.get("mla_v_dim") or q.shape[2]), float("nan"), dtype=q.dtype)
    got = ref.paged_attention(q, pb.input_row_offsets, pb.collection, layer, out=out, **kw)
    assert got is out and not out.isnan().any()  # every row written, nothing read from a poisoned slot
    return out


@pytest.mark.parametrize("heads,q_heads", [(2, 2), (2, 8), (1, 8)])  # GQA ratios 1, 4, 8
@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_attention_mixed_batch(rng, heads, q_heads, page_size):
    pb = random_paged_batch(CACHED, NEW, num_heads=heads, head_size=16, page_size=page_size, generator=rng)
    pb.poison_unread(1)
    q = torch.randn(pb.total_rows, q_heads, 16, generator=rng).to(torch.bfloat16)
    assert rel_err(_run(pb, q, 1), dense_attention(pb, q, 1)) < 1e-2


@pytest.mark.parametrize("causal,window", [(True, None), (True, 1), (True, 6), (True, 40), (False, None)])
def test_attention_masks_fp32(rng, causal, window):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=16, page_size=16, dtype=torch.float32,
                            generator=rng)
    pb.poison_unread(0)
    q = torch.randn(pb.total_rows, 4, 16, generator=rng) * 2  # sharp softmax: a wrong mask shows
    want = dense_attention(pb, q, 0, causal=causal, window=window, scale=0.3)
    assert rel_err(_run(pb, q, 0, causal=causal, window=window, scale=0.3), want) < 1e-5


def test_attention_window_one_is_self(rng):
    """A window of 1 leaves each query its own key only: the output is its own V row."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=8, page_size=16, dtype=torch.float32, generator=rng)
    q = torch.randn(pb.total_rows, 2, 8, generator=rng)
    out = _run(pb, q, 1, window=1)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        assert torch.equal(out[pb.rows(b)], pb.dense(1, 1, b, cl + n)[cl:].float())


def test_attention_mla_latent_values(rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=1, head_size=24, page_size=16, is_mla=True, dtype=torch.float32,
                            generator=rng)
    pb.poison_unread(1)
    q = torch.randn(pb.total_rows, 4, 24, generator=rng)
    got = _run(pb, q, 1, mla_v_dim=16, scale=0.2)
    assert got.shape == (pb.total_rows, 4, 16)
    assert rel_err(got, dense_attention(pb, q, 1, mla_v_dim=16, scale=0.2)) < 1e-5


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_attention_fp8_cache_dequantized(rng, scale_dtype):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=32, page_size=64, dtype=torch.float8_e4m3fn,
                            scale_dtype=scale_dtype, quantization_granularity=16, generator=rng)
    pb.poison_unread(1)
    q = torch.randn(pb.total_rows, 8, 32, generator=rng)
    # the oracle dequantizes the stored fp8 values itself, so only float32 rounding separates the two
    assert rel_err(_run(pb, q, 1), dense_attention(pb, q, 1)) < 1e-5


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 9)), min_size=1, max_size=4),
    page_size=st.sampled_from([16, 64]),
    group=st.sampled_from([1, 4, 8]),
    window=st.one_of(st.none(), st.integers(1, 30)),
    seed=st.integers(0, 2**31),
)
def test_attention_random_steps(lengths, page_size, group, window, seed):
    gen = torch.Generator().manual_seed(seed)
    cached, new = zip(*lengths)
    pb = random_paged_batch(cached, new, num_heads=2, head_size=8, page_size=page_size, dtype=torch.float32,
                            generator=gen)
    pb.poison_unread(0)
    q = torch.randn(pb.total_rows, 2 * group, 8, generator=gen)
    got = _run(pb, q, 0, window=window)
    if pb.total_rows:
        assert rel_err(got, dense_attention(pb, q, 0, window=window)) < 1e-5


@pytest.mark.parametrize("softcap", [None, 0.5, 30.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, 3])
def test_attention_softcap_sinks_lse_fp32(rng, softcap, with_sinks, window):
    """Soft-cap (small and large, so it shapes or merely passes the scores), sinks from far below to far above the
    logits, and the natural-log lse, against the float64 formula; ``lse`` written into a NaN-poisoned tensor."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=16, page_size=16, dtype=torch.float32,
                            generator=rng)
    pb.poison_unread(0)
    q = torch.randn(pb.total_rows, 8, 16, generator=rng) * 3
    sinks = (torch.randn(8, generator=rng) * 4).index_fill_(0, torch.tensor([0, 5]), -30.0).index_fill_(
        0, torch.tensor([3]), 60.0) if with_sinks else None
    kw = {"window": window, "softcap": softcap, "sinks": sinks, "scale": 0.4}
    out = torch.full(q.shape, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"))
    got, got_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 0, out=out, lse=lse, return_lse=True,
                                       **kw)
    assert got is out and got_lse is lse and not lse.isnan().any()
    want, want_lse = dense_attention(pb, q, 0, with_lse=True, **kw)
    assert rel_err(got, want) < 1e-5
    assert (got_lse.double() - want_lse).abs().max() < 1e-4
    if with_sinks:  # a sink far above every logit takes all the weight: head 3 attends to nothing
        assert got[:, 3].abs().max() < 1e-6 and (got_lse[:, 3] - 60).abs().max() < 1e-4


def test_attention_lse_merges_disjoint_caches(rng):
    """What ``lse`` is for: attention over a shared prefix and over each request's own keys, computed separately
    (non-causal), merges as ``o = sum_i e^(lse_i - lse) o_i`` into attention over both."""
    kw = {"num_heads": 2, "head_size": 16, "page_size": 16, "dtype": torch.float32, "generator": rng}
    prefix, own = (random_paged_batch([0, 0], [40, 24], **kw) for _ in range(2))
    both = random_paged_batch([40, 24], [40, 24], **kw)  # keys: the prefix's, then the request's own
    for b, n in enumerate((40, 24)):
        for plane, cache in ((0, both.collection.get_key_cache(0)), (1, both.collection.get_value_cache(0))):
            cache.scatter(b, 0, torch.cat([prefix.dense(plane, 0, b, n), own.dense(plane, 0, b, n)]).float())
    q = torch.randn(both.total_rows, 4, 16, generator=rng)
    (o1, l1), (o2, l2), (o, lse) = (ref.paged_attention(q, x.input_row_offsets, x.collection, 0, causal=False,
                                                        return_lse=True) for x in (prefix, own, both))
    merged_lse = torch.logaddexp(l1, l2)
    merged = torch.exp(l1 - merged_lse)[..., None] * o1 + torch.exp(l2 - merged_lse)[..., None] * o2
    assert (merged_lse - lse).abs().max() < 1e-4
    assert rel_err(merged, o) < 1e-5
