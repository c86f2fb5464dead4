"""Torch entries: they dispatch to the reference, and reject bad input naming the argument before writing anything."""

import numpy as np
import pytest
import torch

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

CACHED = [0, 37, 5, 9]
NEW = [5, 1, 0, 3]


def _batch(rng, **kw):
    kw = {"num_heads": 2, "head_size": 16, "page_size": 16, **kw}
    return random_paged_batch(CACHED, NEW, generator=rng, **kw)


def _untouched(c):
    """A check that the cache (blocks, scales, metadata) is bitwise what it was when this was called."""
    saved = [_raw(t).clone() for t in (c.blocks, c.scales, c.cache_lengths) if t is not None]

    def check():
        now = [_raw(t) for t in (c.blocks, c.scales, c.cache_lengths) if t is not None]
        assert all(torch.equal(a, b) for a, b in zip(saved, now))

    return check


def _owning_fewer_pages(pb):
    """Request 3 loses the page its new tokens go to (the lookup entry becomes the sentinel)."""
    pb.collection.lookup_table[3, 0] = pb.collection.num_pages


def _lut_out_of_range(pb):
    pb.collection.lookup_table[1, 2] = pb.collection.num_pages + 7  # a cached prefix page, not even the sentinel


def _negative(tensor, index, value=-1):
    """Set ``tensor[index]`` (uint32 metadata) to the int32 ``value``: what a peer's int32 padding writes."""
    tensor.view(torch.int32)[index] = value


def _short_max_seq(pb):
    c = pb.collection
    pb.collection = c.with_metadata(c.cache_lengths, c.lookup_table, 4, c.max_cache_length)


# -- store_kv ------------------------------------------------------------------------------------------------------

def _store_args(pb, rng):
    t = pb.total_rows
    k = torch.randn(t, 2, 16, generator=rng).to(torch.bfloat16)
    return {"k": k, "v": torch.randn(t, 2, 16, generator=rng).to(torch.bfloat16),
            "input_row_offsets": pb.input_row_offsets, "layer_idx": 1}


STORE_CASES = {
    "k dtype": (lambda a, pb: a.update(k=a["k"].half()), TypeError, "k must have dtype torch.bfloat16"),
    "k heads": (lambda a, pb: a.update(k=a["k"][:, :1]), ValueError, r"k must have shape \[\*, 2, 16\]"),
    "k rank": (lambda a, pb: a.update(k=a["k"].flatten(1)), ValueError, "k must be 3-D"),
    "k device": (lambda a, pb: a.update(k=a["k"].to("meta")), ValueError, "k must be on cpu"),
    "v rows": (lambda a, pb: a.update(v=a["v"][1:]), ValueError, "v must have shape"),
    "v missing": (lambda a, pb: a.update(v=None), TypeError, "v must be a torch.Tensor"),
    "v dtype": (lambda a, pb: a.update(v=a["v"].float()), TypeError, "v must have dtype"),
    "layer": (lambda a, pb: a.update(layer_idx=2), ValueError, r"layer_idx must be in \[0, 2\)"),
    "layer numpy": (lambda a, pb: a.update(layer_idx=np.int64(0)), TypeError,
                    r"layer_idx must be a Python int, got numpy.int64 \(0\); pass int\(layer_idx\)"),
    "layer tensor": (lambda a, pb: a.update(layer_idx=torch.tensor(0)), TypeError,
                     r"layer_idx must be a Python int, got a 0-d torch.Tensor; pass int\(layer_idx\)"),
    "offsets negative": (lambda a, pb: _negative(a["input_row_offsets"], 2, -3), ValueError,
                         r"input_row_offsets\[2\] is -3: negative; .*cute_kv.input_row_offsets\(new_lengths\)"),
    "cache length negative": (lambda a, pb: _negative(pb.collection.cache_lengths, 1), ValueError,
                              r"cache_lengths\[1\] is -1: negative; .*pass the true lengths"),
    "lut negative": (lambda a, pb: _negative(pb.collection.lookup_table, (3, 0)), ValueError,
                     r"lookup_table\[3, 0\] is -1: negative; .*sentinel"),
    "offsets dtype": (lambda a, pb: a.update(input_row_offsets=a["input_row_offsets"].long()), TypeError,
                      r"input_row_offsets must have dtype torch.uint32 \(MAX's\) or torch.int32, got torch.int64; "
                      r"convert with input_row_offsets.to\(torch.int32\)"),
    "offsets total": (lambda a, pb: a.update(k=a["k"][1:], v=a["v"][1:]), ValueError,
                      r"input_row_offsets\[-1\] \(9\) must equal the number of rows \(8\)"),
    "offsets batch": (lambda a, pb: a.update(input_row_offsets=a["input_row_offsets"][:-1]), ValueError,
                      r"input_row_offsets must have shape \[5\]"),
    "unowned page": (lambda a, pb: _owning_fewer_pages(pb), ValueError,
                     "request 3 needs positions .* owns only 0 pages"),
    "lut out of range": (lambda a, pb: _lut_out_of_range(pb), ValueError, r"request 1 .*lookup_table\[1, 2\]"),
    "max_seq_length": (lambda a, pb: _short_max_seq(pb), ValueError, "request 0 has 5 new tokens.*max_seq_length"),
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store_kv_rejects(rng, case):
    pb = _batch(rng, num_layers=2)
    args = _store_args(pb, rng)
    mutate, exc, match = STORE_CASES[case]
    mutate(args, pb)
    check = _untouched(pb.collection)
    with pytest.raises(exc, match=match):
        cute_kv.store_kv(args["k"], args["v"], args["input_row_offsets"], pb.collection, args["layer_idx"])
    check()


def test_store_kv_mla_rejects_v(rng):
    pb = _batch(rng, num_heads=1, is_mla=True)
    k = torch.randn(pb.total_rows, 1, 16, generator=rng).to(torch.bfloat16)
    check = _untouched(pb.collection)
    with pytest.raises(ValueError, match="v must be None for an MLA cache"):
        cute_kv.store_kv(k, k, pb.input_row_offsets, pb.collection, 0)
    check()


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_fp8_cache_takes_any_float(rng, in_dtype):
    pb = _batch(rng, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32)
    twin = _batch(torch.Generator().manual_seed(0x5EED), dtype=torch.float8_e4m3fn, scale_dtype=torch.float32)
    k = torch.randn(pb.total_rows, 2, 16, generator=rng).to(in_dtype)
    cute_kv.store_kv(k, -k, pb.input_row_offsets, pb.collection, 1)
    ref.store_kv(k, -k, twin.input_row_offsets, twin.collection, 1)
    assert torch.equal(_raw(pb.collection.blocks), _raw(twin.collection.blocks))
    assert torch.equal(pb.collection.scales, twin.collection.scales)


# -- fused_qkv_matmul_kv_cache ---------------------------------------------------------------------------------------

def _qkv_args(pb, rng, dtype=torch.bfloat16):
    t = pb.total_rows
    return {"hidden": torch.randn(t, 32, generator=rng).to(dtype),
            "weight": torch.randn(64 + 64, 32, generator=rng).to(dtype),  # q_dim 64 = 4 heads of 16, K and V 32 each
            "input_row_offsets": pb.input_row_offsets, "layer_idx": 0, "output": None, "bias": None, "rope": None,
            "qk_norm": None}


def _call_qkv(pb, a):
    return cute_kv.fused_qkv_matmul_kv_cache(a["hidden"], a["input_row_offsets"], a["weight"], pb.collection,
                                             a["layer_idx"], output=a["output"], bias=a["bias"], rope=a["rope"],
                                             qk_norm=a["qk_norm"])


def _int4(n=128, k=32, group_size=16, scale_dtype=torch.bfloat16):
    return cute_kv.Int4Weight(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(n, k // group_size,
                                                                                    dtype=scale_dtype), group_size)


QKV_CASES = {
    "hidden dtype": (lambda a, pb: a.update(hidden=a["hidden"].half()), TypeError, "hidden must have dtype"),
    "hidden rank": (lambda a, pb: a.update(hidden=a["hidden"][:, None]), ValueError, "hidden must be 2-D"),
    "weight dtype": (lambda a, pb: a.update(weight=a["weight"].float()), TypeError, "weight must have dtype"),
    "weight K": (lambda a, pb: a.update(weight=a["weight"][:, :16]), ValueError, r"weight must have shape \[\*, 32\]"),
    "no Q columns": (lambda a, pb: a.update(weight=a["weight"][:64]), ValueError,
                     "q_dim = N_tot - 64 must be positive"),
    "bias shape": (lambda a, pb: a.update(bias=torch.zeros(64, dtype=torch.bfloat16)), ValueError,
                   r"bias must have shape \[128\]"),
    "output shape": (lambda a, pb: a.update(output=torch.zeros(9, 32, dtype=torch.bfloat16)), ValueError,
                     r"output must have shape \[9, 64\]"),
    "output dtype": (lambda a, pb: a.update(output=torch.zeros(9, 64)), TypeError, "output must have dtype"),
    "layer": (lambda a, pb: a.update(layer_idx=-1), ValueError, "layer_idx must be in"),
    "unowned page": (lambda a, pb: _owning_fewer_pages(pb), ValueError, "request 3 needs positions"),
    "rope type": (lambda a, pb: a.update(rope=object()), TypeError, "rope must be a RopeConfig"),
    "rope too wide": (lambda a, pb: a.update(rope=RopeConfig.from_theta(32, 64)), ValueError,
                      r"rope_dim=32\) exceeds the head size"),
    "rope positions": (lambda a, pb: a.update(rope=RopeConfig.from_theta(16, 30)), ValueError,
                       "rope.freqs_cis has 30 positions but request 1 reaches position 37"),
    "rope q heads": (lambda a, pb: a.update(rope=RopeConfig.from_theta(16, 64, q_head_dim=24)), ValueError,
                     r"q_dim \(64\) must be a multiple of the Q head size \(24"),
    "int4 packed K": (lambda a, pb: a.update(weight=_int4(k=48)), ValueError,
                      r"weight.packed must have shape \[N_tot, K/2\] = \[\*, 16\]"),
    "int4 scales dtype": (lambda a, pb: a.update(weight=_int4(scale_dtype=torch.float16)), TypeError,
                          "weight.scales must be torch.bfloat16"),
    "fp8 weight K": (lambda a, pb: a.update(weight=cute_kv.Fp8Weight(torch.zeros(128, 16, dtype=torch.float8_e4m3fn),
                                                                     torch.ones(128))), ValueError,
                     r"weight.weight must have shape \[\*, 32\]"),
    "qk_norm type": (lambda a, pb: a.update(qk_norm=torch.ones(16)), TypeError, "qk_norm must be a QKNorm"),
    "q norm too wide": (lambda a, pb: a.update(qk_norm=cute_kv.QKNorm(torch.ones(24))), ValueError,
                        r"qk_norm.q_weight has 24 dims, more than a Q head \(16\)"),
    "k norm too wide": (lambda a, pb: a.update(qk_norm=cute_kv.QKNorm(k_weight=torch.ones(17))), ValueError,
                        r"qk_norm.k_weight has 17 dims, more than a cache head \(16"),
}


@pytest.mark.parametrize("case", list(QKV_CASES))
def test_fused_qkv_rejects(rng, case):
    pb = _batch(rng)
    args = _qkv_args(pb, rng)
    mutate, exc, match = QKV_CASES[case]
    mutate(args, pb)
    check = _untouched(pb.collection)
    with pytest.raises(exc, match=match):
        _call_qkv(pb, args)
    check()


@pytest.mark.parametrize("freqs,match", [(torch.zeros(8, 7), "positive even width"),
                                         (torch.zeros(8, 8, dtype=torch.float64), "rope.freqs_cis must have dtype"),
                                         (torch.zeros(8), "rope.freqs_cis must be 2-D")])
def test_rope_config_rejects(freqs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        RopeConfig(freqs)


@pytest.mark.parametrize("make,exc,match", [
    (lambda: _int4(k=40, group_size=16), ValueError, r"group_size \(16\) must divide K \(40"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 0), ValueError, "group_size must be a positive even int"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 3), 8), ValueError,
     r"weight.scales must have shape \[4, 2\]"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, 2), 8), TypeError,
     "weight.packed must have dtype torch.uint8"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 8,
                                zero_points=torch.zeros(4, 2, dtype=torch.uint8)), ValueError,
     "zero_points given without has_zp=True"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 8, True), ValueError,
     "has_zp=True needs weight.zero_points"),
    (lambda: cute_kv.Int4Weight(torch.zeros(4, 8, dtype=torch.uint8), torch.ones(4, 2), 8, True,
                                torch.zeros(4, 1, dtype=torch.uint8)), ValueError,
     r"weight.zero_points must have shape \[4, 2\]"),
    (lambda: cute_kv.Fp8Weight(torch.zeros(4, 8, dtype=torch.float8_e4m3fn), torch.ones(4, dtype=torch.float16)),
     TypeError, "weight.scales must have dtype torch.float32"),
    (lambda: cute_kv.QKNorm(), ValueError, "needs q_weight or k_weight"),
    (lambda: cute_kv.QKNorm(torch.ones(4), epsilon=0.0), ValueError, "epsilon must be positive"),
])
def test_weight_and_norm_specs_reject(make, exc, match):
    """Quantized weights and QK-norm are checked when built, before any call could write."""
    with pytest.raises(exc, match=match):
        make()


def test_fused_qkv_mla_needs_one_head(rng):
    pb = _batch(rng, num_heads=2, is_mla=True)
    a = _qkv_args(pb, rng)
    check = _untouched(pb.collection)
    with pytest.raises(ValueError, match="one \\(latent\\) head"):
        _call_qkv(pb, a)
    check()


def test_fused_qkv_entry_matches_reference(rng):
    pb = _batch(rng)
    twin = _batch(torch.Generator().manual_seed(0x5EED))
    a = _qkv_args(pb, rng)
    a["rope"] = RopeConfig.from_theta(16, 64, interleaved=True)
    a["output"] = torch.full((pb.total_rows, 64), float("nan"), dtype=torch.bfloat16)
    assert _call_qkv(pb, a) is a["output"]
    want = ref.fused_qkv_matmul_kv_cache(a["hidden"], twin.input_row_offsets, a["weight"], twin.collection, 0,
                                         rope=a["rope"])
    assert torch.equal(a["output"], want)
    assert torch.equal(pb.collection.blocks, twin.collection.blocks)


# -- paged_attention -------------------------------------------------------------------------------------------------

def _attn_args(pb, rng):
    return {"q": torch.randn(pb.total_rows, 4, 16, generator=rng).to(torch.bfloat16),
            "input_row_offsets": pb.input_row_offsets, "layer_idx": 1, "causal": True, "window": None,
            "scale": None, "mla_v_dim": None, "out": torch.full((pb.total_rows, 4, 16), float("nan"),
                                                                dtype=torch.bfloat16)}


def _call_attn(pb, a):
    a = dict(a)
    return cute_kv.paged_attention(a.pop("q"), a.pop("input_row_offsets"), pb.collection, a.pop("layer_idx"), **a)


ATTN_CASES = {
    "q dtype": (lambda a, pb: a.update(q=a["q"].float()), TypeError, "q must have dtype torch.bfloat16"),
    "q head dim": (lambda a, pb: a.update(q=a["q"][..., :8]), ValueError, r"q head dim \(8\) must equal"),
    "q heads": (lambda a, pb: a.update(q=a["q"][:, :3]), ValueError, r"q heads \(3\) must be a positive multiple"),
    "layer": (lambda a, pb: a.update(layer_idx=5), ValueError, "layer_idx must be in"),
    "window": (lambda a, pb: a.update(window=0), ValueError, "window must be a positive int"),
    "window noncausal": (lambda a, pb: a.update(window=4, causal=False), ValueError, "needs causal=True"),
    "causal type": (lambda a, pb: a.update(causal=1), TypeError, "causal must be a bool"),
    "scale": (lambda a, pb: a.update(scale=float("nan")), ValueError, "scale must be a finite float"),
    "mla_v_dim": (lambda a, pb: a.update(mla_v_dim=8), ValueError, "mla_v_dim is only for MLA caches"),
    "softcap negative": (lambda a, pb: a.update(softcap=-1.0), ValueError, "softcap must be a finite float >= 0"),
    "softcap inf": (lambda a, pb: a.update(softcap=float("inf")), ValueError, "softcap must be a finite float"),
    "softcap bool": (lambda a, pb: a.update(softcap=True), ValueError, "softcap must be a finite float"),
    "sinks dtype": (lambda a, pb: a.update(sinks=torch.zeros(4, dtype=torch.bfloat16)), TypeError,
                    "sinks must have dtype torch.float32"),
    "sinks shape": (lambda a, pb: a.update(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \[4\]"),
    "sinks list": (lambda a, pb: a.update(sinks=[0.0] * 4), TypeError, "sinks must be a torch.Tensor"),
    "return_lse type": (lambda a, pb: a.update(return_lse=1), TypeError, "return_lse must be a bool"),
    "out shape": (lambda a, pb: a.update(out=a["out"][:, :2]), ValueError, r"out must have shape \[9, 4, 16\]"),
    "out dtype": (lambda a, pb: a.update(out=a["out"].float()), TypeError, "out must have dtype"),
    "unowned prefix page": (lambda a, pb: _lut_out_of_range(pb), ValueError, r"lookup_table\[1, 2\]"),
    "max_cache_length": (lambda a, pb: setattr(pb, "collection", pb.collection.with_metadata(
        pb.collection.cache_lengths, pb.collection.lookup_table, 5, 37)), ValueError,
        r"request 1 has cache_lengths\[1\] = 37 cached \+ 1 new \(input_row_offsets\) = 38 tokens in context, "
        r"more than the collection.s max_cache_length \(37\); cache_lengths counts the tokens cached before this step"),
}


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_paged_attention_rejects(rng, case):
    pb = _batch(rng)
    a = _attn_args(pb, rng)
    mutate, exc, match = ATTN_CASES[case]
    mutate(a, pb)
    out = a["out"].clone()
    with pytest.raises(exc, match=match):
        _call_attn(pb, a)
    assert torch.equal(a["out"].isnan(), out.isnan())  # out untouched (still all NaN)


@pytest.mark.parametrize("mla_v_dim", [None, 0, 17])
def test_paged_attention_mla_v_dim_required(rng, mla_v_dim):
    pb = _batch(rng, num_heads=1, is_mla=True)
    q = torch.randn(pb.total_rows, 4, 16, generator=rng).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"mla_v_dim must be an int in \[1, 16\]"):
        cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=mla_v_dim)


def test_paged_attention_entry_matches_reference(rng):
    pb = _batch(rng, dtype=torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu, quantization_granularity=8)
    q = torch.randn(pb.total_rows, 8, 16, generator=rng)
    got = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, window=3, scale=0.5)
    assert got.dtype == torch.float32 and got.shape == (9, 8, 16)
    want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, window=3, scale=0.5)
    assert torch.equal(got, want)


def test_empty_step_is_a_no_op(rng):
    pb = random_paged_batch([3, 0], [0, 0], num_heads=2, head_size=16, page_size=16, generator=rng)
    check = _untouched(pb.collection)
    empty = torch.zeros(0, 2, 16, dtype=torch.bfloat16)
    cute_kv.store_kv(empty, empty, pb.input_row_offsets, pb.collection, 0)
    q = cute_kv.fused_qkv_matmul_kv_cache(torch.zeros(0, 32, dtype=torch.bfloat16), pb.input_row_offsets,
                                          torch.ones(96, 32, dtype=torch.bfloat16), pb.collection, 0)
    out = cute_kv.paged_attention(empty, pb.input_row_offsets, pb.collection, 0)
    assert q.shape == (0, 32) and out.shape == (0, 2, 16)
    check()



def test_rows_without_requests_are_refused_unvalidated(rng):
    """A batch of no requests has offsets ``[0]``: rows with it are a shape contradiction, refused even with
    ``validate=False`` (the kernels would resolve every row to request 0, reading an empty ``cache_lengths``)."""
    pb = random_paged_batch([], [], num_heads=2, head_size=16, page_size=16, generator=rng)
    check = _untouched(pb.collection)
    rows = torch.zeros(3, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="input_row_offsets has no requests"):
        cute_kv.fused_qkv_matmul_kv_cache(torch.zeros(3, 32, dtype=torch.bfloat16), pb.input_row_offsets,
                                          torch.ones(96, 32, dtype=torch.bfloat16), pb.collection, 0,
                                          validate=False)
    with pytest.raises(ValueError, match="input_row_offsets has no requests"):
        cute_kv.store_kv(rows, rows, pb.input_row_offsets, pb.collection, 0, validate=False)
    check()

def test_entries_take_strided_inputs(rng):
    """Views (column slices, transposes) give bitwise the results of their contiguous copies."""
    pb, twin = _batch(rng), _batch(torch.Generator().manual_seed(0x5EED))
    t = pb.total_rows
    kv = torch.randn(t, 2, 48, generator=rng).to(torch.bfloat16)
    k, v = kv[..., :16], kv[..., 32:]
    cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, 0)
    cute_kv.store_kv(k.contiguous(), v.contiguous(), twin.input_row_offsets, twin.collection, 0)
    hidden_t = torch.randn(32, t, generator=rng).to(torch.bfloat16)
    weight = torch.randn(128, 32, generator=rng).to(torch.bfloat16)
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden_t.T, pb.input_row_offsets, weight, pb.collection, 1)
    q2 = cute_kv.fused_qkv_matmul_kv_cache(hidden_t.T.contiguous(), twin.input_row_offsets, weight, twin.collection, 1)
    assert torch.equal(q, q2) and torch.equal(pb.collection.blocks, twin.collection.blocks)
    qs = q.unflatten(1, (4, 16))[:, ::2]  # every other head: a strided [T, 2, 16]
    out = cute_kv.paged_attention(qs, pb.input_row_offsets, pb.collection, 1)
    assert torch.equal(out, cute_kv.paged_attention(qs.contiguous(), twin.input_row_offsets, twin.collection, 1))
