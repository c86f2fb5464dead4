"""The LSE options of the attention ops: ``lse_layout`` ``"TH"`` / ``"HT"`` (FA4's and vLLM's ``[H, T]``), an
``lse=`` buffer written in place, and ``merge_attention_states`` over either layout."""

import math

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.reference.batch import random_paged_batch
from numerics import bits
from test_merge_attention_states import attention64
from test_reference_attention import CACHED, NEW, dense_attention

HQ, D, LAYER = 8, 32, 1


@pytest.fixture
def step(rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=D, page_size=16, dtype=torch.float32, generator=rng)
    pb.poison_unread(LAYER)
    return pb, torch.randn(pb.total_rows, HQ, D, generator=rng)


def _attention(pb, q, **kw):
    return cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, LAYER, return_lse=True, **kw)


def test_ht_is_th_transposed_and_matches_float64(step):
    pb, q = step
    _, want = dense_attention(pb, q, LAYER, with_lse=True)
    _, th = _attention(pb, q)
    _, ht = _attention(pb, q, lse_layout="HT")
    assert th.shape == (pb.total_rows, HQ) and ht.shape == (HQ, pb.total_rows) and ht.is_contiguous()
    assert torch.equal(ht, th.t())
    torch.testing.assert_close(ht.double(), want.t(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("layout", ["TH", "HT"])
@pytest.mark.parametrize("kind", ["contiguous", "column slice"])
def test_lse_buffer_is_written_in_place(step, layout, kind):
    """``lse=`` is returned, every entry written; a column slice of a wider buffer keeps its neighbours' bits. A
    row-major ``[T, Hq]`` buffer is written directly (no temporary)."""
    pb, q = step
    shape = [pb.total_rows, HQ] if layout == "TH" else [HQ, pb.total_rows]
    base = torch.full((shape[0], shape[1] + (3 if kind == "column slice" else 0)), math.nan)
    buf = base[:, 1:shape[1] + 1] if kind == "column slice" else base
    before = base.clone()
    _, want = _attention(pb, q, lse_layout=layout)
    _, got = _attention(pb, q, lse_layout=layout, lse=buf)
    assert got is buf and torch.equal(buf, want)
    if kind == "column slice":
        for col in (0, -1, -2):
            assert torch.equal(bits(base[:, col]), bits(before[:, col]))


def test_a_row_major_buffer_is_the_written_memory(step, monkeypatch):
    """The reference writes a row-major ``"TH"`` buffer itself: what it is handed is the buffer's memory."""
    pb, q = step
    buf = torch.full((pb.total_rows, HQ), math.nan)
    handed = []
    real = ref.paged_attention

    def spy(*args, lse=None, **kw):
        handed.append(lse)
        return real(*args, lse=lse, **kw)

    monkeypatch.setattr(ref, "paged_attention", spy)
    _attention(pb, q, lse=buf)
    assert handed[0].data_ptr() == buf.data_ptr() and handed[0].stride() == buf.stride()
    _attention(pb, q, lse=torch.empty(HQ, pb.total_rows), lse_layout="HT")
    assert handed[1].is_contiguous() and handed[1].shape == (pb.total_rows, HQ)  # a temporary, copied in after


def test_step_plan_and_explain_take_the_options(step):
    pb, q = step
    plan = cute_kv.plan_step(pb.collection, pb.input_row_offsets, num_q_heads=HQ)
    buf = torch.full((HQ, pb.total_rows), math.nan)
    _, got = _attention(pb, q, lse_layout="HT", lse=buf, plan=plan)
    assert got is buf and torch.equal(buf, _attention(pb, q)[1].t())
    path = cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, pb.collection, LAYER, return_lse=True,
                           lse_layout="HT", lse=buf)
    assert path.path == "reference"


@pytest.mark.parametrize("kw, error, match", [
    ({"return_lse": True, "lse_layout": "th"}, ValueError, r"lse_layout must be one of \('TH', 'HT'\)"),
    ({"lse": "TH"}, ValueError, "pass return_lse=True with it"),
    ({"return_lse": True, "lse": "TH", "lse_layout": "HT"}, ValueError, r"lse must have shape \[8, "),
    ({"return_lse": True, "lse": "HT"}, ValueError, r"lse must have shape \[\d+, 8\]"),
    ({"return_lse": True, "lse": "float64"}, TypeError, "lse must have dtype torch.float32"),
])
def test_bad_lse_options_raise_before_anything_is_written(step, kw, error, match):
    pb, q = step
    t = pb.total_rows
    buffers = {"TH": torch.full((t, HQ), math.nan), "HT": torch.full((HQ, t), math.nan),
               "float64": torch.full((t, HQ), math.nan, dtype=torch.float64)}
    if "lse" in kw:
        kw = {**kw, "lse": buffers[kw["lse"]]}
    out = torch.full((t, HQ, D), math.nan)
    with pytest.raises(error, match=match):
        cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, LAYER, out=out, **kw)
    assert out.isnan().all() and all(b.isnan().all() for b in buffers.values())


def test_sparse_mla_attention_takes_the_options(rng):
    pb = random_paged_batch([3, 40], [2, 1], num_heads=1, head_size=64, page_size=16, generator=rng, is_mla=True,
                            dtype=torch.float32)
    t = pb.total_rows
    q = torch.randn(t, 4, 64, generator=rng)
    indices = torch.randint(0, 40, (t, 8), generator=rng, dtype=torch.int32)
    args = (q, pb.input_row_offsets, pb.collection, LAYER, indices)
    _, th = cute_kv.sparse_mla_attention(*args, mla_v_dim=32, return_lse=True)
    buf = torch.full((4, t), math.nan)
    _, ht = cute_kv.sparse_mla_attention(*args, mla_v_dim=32, return_lse=True, lse_layout="HT", lse=buf)
    assert ht is buf and torch.equal(buf, th.t())


def test_merge_takes_either_layout(rng):
    """The same merge over ``[T, H]`` and ``[H, T]`` LSEs, against float64 attention over the union; the merged
    ``lse`` comes back in the inputs' layout, contiguous."""
    t, h = 7, 4
    q = torch.randn(t, h, 32, generator=rng) * 2
    k, v = torch.randn(50, h, 32, generator=rng), torch.randn(50, h, 32, generator=rng)
    want_o, want_lse = attention64(q, k, v)
    (o_a, lse_a), (o_b, lse_b) = attention64(q, k[:13], v[:13]), attention64(q, k[13:], v[13:])
    o_a, o_b, lse_a, lse_b = o_a.float(), o_b.float(), lse_a.float(), lse_b.float()
    o_th, lse_th = cute_kv.merge_attention_states(o_a, lse_a, o_b, lse_b)
    o_ht, lse_ht = cute_kv.merge_attention_states(o_a, lse_a.t().contiguous(), o_b, lse_b.t().contiguous(),
                                                  lse_layout="HT")
    assert torch.equal(o_ht, o_th) and lse_ht.is_contiguous() and torch.equal(lse_ht, lse_th.t())
    torch.testing.assert_close(o_ht.double(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse_ht.double(), want_lse.t(), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"lse_a must have shape \[4, 7\]"):
        cute_kv.merge_attention_states(o_a, lse_a, o_b, lse_b, lse_layout="HT")
    with pytest.raises(ValueError, match="lse_layout must be one of"):
        cute_kv.merge_attention_states(o_a, lse_a, o_b, lse_b, lse_layout="TT")
