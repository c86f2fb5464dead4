"""``cute_kv.merge_attention_states``: attention over two disjoint key sets from each set's output and LSE."""

import math

import pytest
import torch

import cute_kv
from cute_kv.reference.batch import random_paged_batch

T, H, D = 7, 4, 32


def attention64(q, k, v):
    """float64 ``(o [T, H, D], natural-log lse [T, H])`` of ``q [T, H, D]`` over keys ``k, v [S, H, D]``;
    ``lse = -inf`` and ``o = NaN`` (0/0) where ``S = 0``."""
    s = torch.einsum("thd,shd->ths", q.double(), k.double()) / math.sqrt(D)
    lse = s.logsumexp(-1)
    return torch.einsum("ths,shd->thd", (s - lse[..., None]).exp(), v.double()), lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_merge_equals_attention_over_the_union(rng, dtype):
    q = torch.randn(T, H, D, generator=rng) * 2  # spread logits, so the two sides' weights differ
    k, v = torch.randn(50, H, D, generator=rng), torch.randn(50, H, D, generator=rng)
    want_o, want_lse = attention64(q, k, v)
    (o_a, lse_a), (o_b, lse_b) = attention64(q, k[:13], v[:13]), attention64(q, k[13:], v[13:])
    o, lse = cute_kv.merge_attention_states(o_a.to(dtype), lse_a.float(), o_b.to(dtype), lse_b.float())
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == (T, H, D)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(o.double(), want_o, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def test_an_empty_side_is_not_read_and_nothing_is_nan(rng):
    """lse = -inf (no key on that side, an empty split): its o is never mixed in, even NaN; both empty: 0, -inf.
    Large LSEs on both sides do not overflow."""
    o_a, o_b = torch.randn(T, H, D, generator=rng), torch.randn(T, H, D, generator=rng)
    lse_a, lse_b = torch.randn(T, H, generator=rng) + 500, torch.randn(T, H, generator=rng) + 500
    lse_a[0], lse_b[1], lse_a[2], lse_b[2] = (float("-inf"),) * 4
    o_a[0], o_b[1], o_a[2], o_b[2] = (float("nan"),) * 4
    o, lse = cute_kv.merge_attention_states(o_a, lse_a, o_b, lse_b)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o[0], o_b[0]) and torch.equal(lse[0], lse_b[0])
    assert torch.equal(o[1], o_a[1]) and torch.equal(lse[1], lse_a[1])
    assert not o[2].any() and bool(torch.isneginf(lse[2]).all())
    want = torch.logaddexp(lse_a[3:].double(), lse_b[3:].double())
    torch.testing.assert_close(lse[3:].double(), want)
    w_a = (lse_a[3:].double() - want).exp()[..., None]
    torch.testing.assert_close(o[3:].double(), w_a * o_a[3:].double() + (1 - w_a) * o_b[3:].double())


def test_merges_paged_attention_over_two_caches(rng):
    """Three queries attending (not causally) two caches that hold the two halves of one context, with
    ``return_lse``: merged, they equal attention over the whole context (float64)."""
    halves = [random_paged_batch([17], [3], num_heads=2, head_size=D, page_size=8, generator=rng,
                                 dtype=torch.float32) for _ in range(2)]  # keys [0, 20) of each, all stored
    q = torch.randn(3, H, D, generator=rng)
    parts = [cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 0, causal=False, return_lse=True)
             for pb in halves]
    o, lse = cute_kv.merge_attention_states(*parts[0], *parts[1])
    k, v = (torch.cat([pb.dense(kv, 0, 0, 20) for pb in halves]).repeat_interleave(H // 2, dim=1) for kv in (0, 1))
    want_o, want_lse = attention64(q, k, v)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("change,exc,match", [
    (lambda a: a.update(o_b=a["o_b"].double()), TypeError, "o_b must have dtype torch.float32"),
    (lambda a: a.update(o_a=a["o_a"][0]), ValueError, "o_a must be 3-D"),
    (lambda a: a.update(o_b=a["o_b"][1:]), ValueError, r"o_b must have shape \[7, 4, 32\]"),
    (lambda a: a.update(lse_a=a["lse_a"].half()), TypeError, "lse_a must have dtype torch.float32"),
    (lambda a: a.update(lse_b=a["lse_b"].T), ValueError, r"lse_b must have shape \[7, 4\]"),
])
def test_rejects_bad_input(rng, change, exc, match):
    args = dict(o_a=torch.randn(T, H, D), lse_a=torch.randn(T, H), o_b=torch.randn(T, H, D), lse_b=torch.randn(T, H))
    change(args)
    with pytest.raises(exc, match=match):
        cute_kv.merge_attention_states(**args)
