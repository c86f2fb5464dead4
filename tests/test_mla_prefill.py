"""MLA prefill: the decompressed reference equals the absorbed formulation (in float64, and through
``paged_attention`` on the latent cache), and its FLOP counts are what torch's FLOP counter measures."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import cute_kv
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.mla_prefill import DEEPSEEK_V3, flops, mla_prefill

from numerics import rel_err

CACHED = [0, 37, 5, 130, 9]
NEW = [5, 1, 0, 17, 1]
HEADS, NOPE, V = 4, 24, 20
CACHES = {  # kv_lora_rank, rope_dim, cache arguments
    "fp32": (32, 8, dict(head_size=40, dtype=torch.float32)),
    "rope-aware fp8": (64, 16, dict(head_size=96, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                                    rope_dim=16)),
}


def _inputs(rng, cache):
    r, dr, kw = CACHES[cache]
    pb = random_paged_batch(CACHED, NEW, num_heads=1, page_size=16, generator=rng, is_mla=True, **kw)
    t = pb.total_rows
    q_nope = torch.randn(t, HEADS, NOPE, generator=rng, dtype=torch.float64)
    q_rope = torch.randn(t, HEADS, dr, generator=rng, dtype=torch.float64)
    w_uk = torch.randn(HEADS, NOPE, r, generator=rng, dtype=torch.float64) / math.sqrt(r)
    w_uv = torch.randn(HEADS, V, r, generator=rng, dtype=torch.float64) / math.sqrt(r)
    return pb, r, q_nope, q_rope, w_uk, w_uv


def absorbed64(pb, layer, q_nope, q_rope, w_uk, w_uv, scale):
    """float64 absorbed MLA per request: q through W_UK, attention over the latent rows, output through W_UV."""
    r = w_uk.shape[2]
    out = torch.full((q_nope.shape[0], HEADS, V), float("nan"), dtype=torch.float64)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        if not n:
            continue
        rows = pb.dense(0, layer, b, cl + n)[:, 0]  # [S, r + rope]
        sl = pb.rows(b)
        q = torch.cat([torch.einsum("thn,hnr->thr", q_nope[sl], w_uk), q_rope[sl]], dim=-1)
        s = torch.einsum("thd,sd->hts", q, rows) * scale
        mask = torch.arange(cl + n)[None, :] <= cl + torch.arange(n)[:, None]
        p = s.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[sl] = torch.einsum("thr,hvr->thv", torch.einsum("hts,sr->thr", p, rows[:, :r]), w_uv)
    return out


@pytest.mark.parametrize("cache", list(CACHES))
def test_decompressed_equals_absorbed_float64(rng, cache):
    pb, r, q_nope, q_rope, w_uk, w_uv = _inputs(rng, cache)
    pb.poison_unread(1)
    scale = 0.15
    out = torch.full((pb.total_rows, HEADS, V), float("nan"), dtype=torch.float64)
    got = mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 1, w_uk, w_uv, scale=scale, out=out)
    assert got is out and not out.isnan().any()
    assert rel_err(got, absorbed64(pb, 1, q_nope, q_rope, w_uk, w_uv, scale)) < 1e-12


@pytest.mark.parametrize("cache", list(CACHES))
def test_decompressed_equals_absorbed_through_paged_attention(rng, cache):
    """The absorbed path as decode runs it: ``paged_attention`` on the latent cache (mla_v_dim = kv_lora_rank)."""
    pb, r, q_nope, q_rope, w_uk, w_uv = _inputs(rng, cache)
    c = pb.collection
    scale = 1 / math.sqrt(NOPE + q_rope.shape[2])
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_rope], dim=-1).float()
    o_lat = cute_kv.paged_attention(q_abs, pb.input_row_offsets, c, 0, mla_v_dim=r, scale=scale)
    absorbed = torch.einsum("thr,hvr->thv", o_lat.double(), w_uv)
    decompressed = mla_prefill(q_nope.float(), q_rope.float(), pb.input_row_offsets, c, 0, w_uk.float(),
                               w_uv.float())
    assert decompressed.dtype == torch.float32
    assert rel_err(decompressed, absorbed) < 1e-5


def test_flops_are_what_torch_counts(rng):
    """``flops`` against torch's FLOP counter on the reference (decompressed) and the absorbed einsums above, one
    request of T queries after S - T cached keys."""
    pb = random_paged_batch([11], [6], num_heads=1, head_size=40, page_size=16, generator=rng, is_mla=True,
                            dtype=torch.float32)
    r, dr, t, s = 32, 8, 6, 17
    q_nope, q_rope = torch.randn(t, HEADS, NOPE, generator=rng), torch.randn(t, HEADS, dr, generator=rng)
    w_uk, w_uv = torch.randn(HEADS, NOPE, r, generator=rng), torch.randn(HEADS, V, r, generator=rng)
    want = flops(t, s, num_heads=HEADS, kv_lora_rank=r, rope_dim=dr, nope_dim=NOPE, v_dim=V)
    with FlopCounterMode(display=False) as counter:
        mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 0, w_uk, w_uv)
    assert counter.get_total_flops() == want["decompressed"]
    with FlopCounterMode(display=False) as counter:
        absorbed64(pb, 0, q_nope.double(), q_rope.double(), w_uk.double(), w_uv.double(), 0.1)
    assert counter.get_total_flops() == want["absorbed"]


def test_deepseek_v3_crossover():
    """The module's claim: decompressed wins for chunks of about 171 tokens or more, absorbed for decode."""
    ratio = {t: flops(t, 100_000, **DEEPSEEK_V3)["absorbed"] / flops(t, 100_000, **DEEPSEEK_V3)["decompressed"]
             for t in (1, 170, 172, 4096)}
    assert ratio[1] < 0.01 and ratio[170] < 1 < ratio[172] and ratio[4096] > 3


def test_prefill_rejects_rank_mismatch(rng):
    pb, r, q_nope, q_rope, w_uk, w_uv = _inputs(rng, "fp32")
    with pytest.raises(ValueError, match=r"kv_lora_rank \(31\) \+ rope_dim \(8\) must equal the cache's latent_dim"):
        mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 0, w_uk[..., :31], w_uv[..., :31])
