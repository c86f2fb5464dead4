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


def dense_attention(pb, q, layer, *, causal=True, window=None, scale=None, mla_v_dim=None):
    """float64 ``[T, Hq, D_v]``: each request's queries against a dense copy of its K/V, head by head."""
    c = pb.collection
    t, hq, d = q.shape
    group = hq // c.num_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.full((t, hq, mla_v_dim or d), float("nan"), dtype=torch.float64)
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
                out[rows.start + i, h] = torch.softmax(s, 0) @ values[lo:hi, h // group]
    return out


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
