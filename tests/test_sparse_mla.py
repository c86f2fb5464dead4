"""Sparse (top-k) MLA attention and the sparse index remap: the op and its reference against a float64 formula that
reads each selected row by hand (page and slot from the encoded index, rope-aware rows decoded from their bytes),
with every row nobody selected NaN-poisoned."""

import math

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from test_mla_rope_aware import decode_by_hand

FP8 = torch.float8_e4m3fn
CACHED = [0, 37, 5, 130, 9]
NEW = [5, 1, 0, 17, 1]
CACHES = {
    "bf16": dict(head_size=40),
    "fp8 scales": dict(head_size=40, dtype=FP8, scale_dtype=torch.float32, quantization_granularity=8),
    "rope-aware": dict(head_size=96, dtype=FP8, scale_dtype=torch.float32, rope_dim=16),
    "rope-aware deepseek": dict(head_size=640, dtype=FP8, scale_dtype=torch.float32, rope_dim=64),
}
V_DIM = {"bf16": 32, "fp8 scales": 32, "rope-aware": 64, "rope-aware deepseek": 512}


def mla_batch(rng, cache, cached=CACHED, new=NEW, page_size=16):
    return random_paged_batch(cached, new, num_heads=1, page_size=page_size, generator=rng, is_mla=True,
                              **CACHES[cache])


def key_row(c, layer, enc):
    """float64 logical row of encoded index ``enc``: page ``enc // P``, slot ``enc % P``, straight from the 6-D
    tensors."""
    page, slot = divmod(enc, c.page_size)
    raw = _raw(c.blocks)[page, 0, layer, slot, 0]
    if c.rope_dim is not None:
        return decode_by_hand(raw, c.scales[page, 0, layer, slot, 0], c.padded_depth)
    x = raw.view(c.dtype).double()
    if c.scales is not None:
        x = x * c.scales[page, 0, layer, slot, 0].double().repeat_interleave(c.quantization_granularity)
    return x


def hand_sparse(c, q, layer, indices, *, mla_v_dim, scale=None, topk_lengths=None, softcap=None, sinks=None):
    """float64 ``(out [T, Hq, mla_v_dim], lse [T, Hq])``: per token, the keys of its valid entries, term by term."""
    t, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros((t, hq, mla_v_dim), dtype=torch.float64)
    lse = torch.full((t, hq), float("-inf"), dtype=torch.float64)
    for i in range(t):
        n = indices.shape[1] if topk_lengths is None else int(topk_lengths[i])
        encs = [int(e) for e in indices[i, :n] if 0 <= int(e) < c.num_pages * c.page_size]
        keys = torch.stack([key_row(c, layer, e) for e in encs]) if encs else torch.zeros((0, d), dtype=torch.float64)
        for h in range(hq):
            s = keys @ q[i, h].double() * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            logits = s if sinks is None else torch.cat([s, sinks[h:h + 1].double()])
            if not logits.numel():
                continue
            m = logits.max()
            den = torch.exp(logits - m).sum()
            out[i, h] = torch.exp(s - m) @ keys[:, :mla_v_dim] / den
            lse[i, h] = m + torch.log(den)
    return out, lse


def random_indices(rng, c, t, topk, *, unselected=(-1,)):
    """int32 ``[T, topk]``: encoded rows anywhere in the cache (any page, duplicates allowed), a quarter of them
    ``unselected`` values; row 1 selects nothing."""
    idx = torch.randint(0, c.num_pages * c.page_size, (t, topk), generator=rng)
    drop = torch.rand((t, topk), generator=rng) < 0.25
    pick = torch.tensor(unselected)[torch.randint(0, len(unselected), (t, topk), generator=rng)]
    idx = torch.where(drop, pick, idx)
    if t > 1:
        idx[1] = unselected[0]
    return idx.to(torch.int32)


def poison_unselected(c, layer, indices, topk_lengths=None):
    """NaN into every (page, slot) of every layer except the rows the valid entries select in ``layer``."""
    valid = ref.sparse_mla.selected_keys(indices, topk_lengths, c.num_pages, c.page_size)
    enc = indices.to(torch.int64)[valid]
    keep = torch.zeros(c.blocks.shape[:4], dtype=torch.bool)
    keep[enc // c.page_size, 0, layer, enc % c.page_size] = True
    for tensor in (c.blocks, c.scales):
        if tensor is not None:
            nan = torch.full((), float("nan"), dtype=tensor.dtype)
            _raw(tensor)[~keep] = _raw(nan.reshape(1))


def run(pb, q, layer, indices, **kw):
    c = pb.collection
    out = torch.full((*q.shape[:2], kw["mla_v_dim"]), float("nan"), dtype=q.dtype)
    got = cute_kv.sparse_mla_attention(q, pb.input_row_offsets, c, layer, indices, out=out, **kw)
    if kw.get("return_lse"):
        got, lse = got
        assert not lse.isnan().any()
    assert got is out and not out.isnan().any()  # every row written, no poisoned row read
    return (got, lse) if kw.get("return_lse") else got


@pytest.mark.parametrize("cache", list(CACHES))
def test_sparse_matches_formula(rng, cache):
    pb = mla_batch(rng, cache, *(([0, 9], [3, 1]) if cache == "rope-aware deepseek" else (CACHED, NEW)))
    c = pb.collection
    t, v = pb.total_rows, V_DIM[cache]
    indices = random_indices(rng, c, t, 24)
    topk_lengths = torch.randint(0, 25, (t,), generator=rng, dtype=torch.int32)
    topk_lengths[0], topk_lengths[-1] = 24, 1
    poison_unselected(c, 1, indices, topk_lengths)
    q = torch.randn(t, 8, c.latent_dim, generator=rng).to(torch.bfloat16)
    got, lse = run(pb, q, 1, indices, mla_v_dim=v, topk_lengths=topk_lengths, return_lse=True)
    want, want_lse = hand_sparse(c, q, 1, indices, mla_v_dim=v, topk_lengths=topk_lengths)
    assert rel_err(got, want) < 1e-2
    assert torch.equal(lse.isinf(), want_lse.isinf()) and torch.allclose(lse.double(), want_lse, rtol=1e-5)
    assert not got[1].any() and torch.isneginf(lse[1]).all()  # row 1 selects no key: 0 and -inf


def test_sparse_softcap_sinks_scale_fp32(rng):
    pb = mla_batch(rng, "bf16")
    c = pb.collection
    indices = random_indices(rng, c, pb.total_rows, 9)
    poison_unselected(c, 0, indices)
    q = torch.randn(pb.total_rows, 4, 40, generator=rng) * 3
    sinks = torch.randn(4, generator=rng)
    kw = dict(mla_v_dim=40, scale=0.2, softcap=5.0, sinks=sinks)
    want, want_lse = hand_sparse(c, q, 0, indices, **kw)
    # float32 q over the bf16 cache (the entry point takes q in the cache dtype): the reference itself, tightly.
    got, lse = ref.sparse_mla_attention(q, c, 0, indices, return_lse=True, **kw)
    assert rel_err(got, want) < 1e-5 and torch.allclose(lse.double(), want_lse, rtol=1e-5)
    assert not got[1].any() and torch.allclose(lse[1], sinks)  # no key: the sink alone


def test_sparse_validate_false_drops_out_of_range_entries(rng):
    """Entries outside ``[0, N*P)`` select no key, read nothing (the rest of the cache is NaN) and match the formula
    with them dropped."""
    pb = mla_batch(rng, "rope-aware")
    c = pb.collection
    rows = c.num_pages * c.page_size
    indices = random_indices(rng, c, pb.total_rows, 16, unselected=(-1, -2, rows, rows + 77, 2**31 - 1, -2**31))
    poison_unselected(c, 1, indices)
    q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"indices\[\d+, \d+\] = -?\d+ is outside \[-1, "):
        cute_kv.sparse_mla_attention(q, pb.input_row_offsets, c, 1, indices, mla_v_dim=64)
    got = run(pb, q, 1, indices, mla_v_dim=64, validate=False)
    assert rel_err(got, hand_sparse(c, q, 1, indices, mla_v_dim=64)[0]) < 1e-2


def test_sparse_validate_false_topk_lengths_past_topk_read_all(rng):
    pb = mla_batch(rng, "bf16")
    c = pb.collection
    indices = random_indices(rng, c, pb.total_rows, 6)
    lengths = torch.full((pb.total_rows,), 99, dtype=torch.int32)
    q = torch.randn(pb.total_rows, 4, 40, generator=rng).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"topk_lengths\[0\] = 99 is outside \[0, 6\]"):
        cute_kv.sparse_mla_attention(q, pb.input_row_offsets, c, 0, indices, mla_v_dim=8, topk_lengths=lengths)
    got = run(pb, q, 0, indices, mla_v_dim=8, topk_lengths=lengths, validate=False)
    assert torch.equal(got, run(pb, q, 0, indices, mla_v_dim=8))


def _bad_args(pb, rng):
    c = pb.collection
    q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng).to(torch.bfloat16)
    return q, random_indices(rng, c, pb.total_rows, 4)


@pytest.mark.parametrize("change,error,match", [
    (dict(indices="int64"), TypeError, "indices must have dtype torch.int32"),
    (dict(indices="short"), ValueError, r"indices must have one row per query token"),
    (dict(topk_lengths="long"), ValueError, r"topk_lengths must have shape \[\d+\]"),
    (dict(q="wide"), ValueError, r"q's last dim \(97\) must equal the cache's latent_dim \(80\)"),
    (dict(mla_v_dim=65), ValueError, r"mla_v_dim must be an int in \[1, 64\]"),
    (dict(mla_v_dim=None), ValueError, r"mla_v_dim must be an int"),
    (dict(scale=float("inf")), ValueError, "scale must be a finite float"),
    (dict(sinks="f16"), TypeError, "sinks must have dtype torch.float32"),
    (dict(offsets="bad"), ValueError, r"input_row_offsets\[-1\]"),
    (dict(out="wrong"), ValueError, r"out must have shape"),
])
def test_sparse_rejects_bad_arguments(rng, change, error, match):
    pb = mla_batch(rng, "rope-aware")
    q, indices = _bad_args(pb, rng)
    kw = dict(mla_v_dim=64)
    offsets = pb.input_row_offsets
    for name, value in change.items():
        if name == "indices":
            indices = indices.long() if value == "int64" else indices[1:]
        elif name == "topk_lengths":
            kw["topk_lengths"] = torch.ones(q.shape[0] + 1, dtype=torch.int32)
        elif name == "q":
            q = torch.randn(q.shape[0], 4, 97).to(torch.bfloat16)
        elif name == "sinks":
            kw["sinks"] = torch.zeros(4, dtype=torch.float16)
        elif name == "offsets":
            offsets = offsets.view(torch.int32).clone()
            offsets[-1] += 1
        elif name == "out":
            kw["out"] = torch.empty(q.shape[0], 4, 63, dtype=q.dtype)
        else:
            kw[name] = value
    with pytest.raises(error, match=match):
        cute_kv.sparse_mla_attention(q, offsets, pb.collection, 1, indices, **kw)


def test_sparse_rejects_non_mla_cache(rng):
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=16, page_size=16, generator=rng)
    q = torch.randn(pb.total_rows, 4, 16).to(torch.bfloat16)
    with pytest.raises(ValueError, match="reads an MLA cache"):
        cute_kv.sparse_mla_attention(q, pb.input_row_offsets, pb.collection, 0,
                                     torch.zeros(pb.total_rows, 2, dtype=torch.int32), mla_v_dim=8)


# -- plan, custom op, torch.compile ---------------------------------------------------------------------------------

def test_plan_picks_the_sm100_kernel_or_names_why_not(rng):
    """sm_100a serves bf16 DeepSeek shapes with ``MlaDecodeSm100`` in sparse mode (its key records topk_lengths and
    lse); SM90 has no gather4, and the SM100 kernel does not read rope-aware rows yet: both name their reason."""
    pb = mla_batch(rng, "rope-aware")
    q, indices = _bad_args(pb, rng)
    args = (q, pb.input_row_offsets, pb.collection, 1, indices)
    path = cute_kv.explain(cute_kv.sparse_mla_attention, *args, mla_v_dim=64, arch="sm_90a")
    assert (path.path, path.arch) == ("reference", "sm_90a") and "no sparse MLA kernel on sm_90a" in path.reason
    path = cute_kv.explain(cute_kv.sparse_mla_attention, *args, mla_v_dim=64, arch="sm_100a")
    assert path.path == "reference" and "rope" in path.reason, path
    assert cute_kv.explain("sparse_mla_attention", *args, mla_v_dim=64).reason.startswith("tensors on cpu")

    pb = random_paged_batch([3, 70], [1, 1], num_heads=1, head_size=576, page_size=64, generator=rng, is_mla=True,
                            dtype=torch.bfloat16)
    q = torch.randn(pb.total_rows, 128, 576, generator=rng).to(torch.bfloat16)
    indices = random_indices(rng, pb.collection, pb.total_rows, 8)
    args = (q, pb.input_row_offsets, pb.collection, 0, indices)
    lengths = torch.full((pb.total_rows,), 5, dtype=torch.int32)
    path = cute_kv.explain(cute_kv.sparse_mla_attention, *args, mla_v_dim=512, topk_lengths=lengths,
                           return_lse=True, arch="sm_100a")
    assert (path.path, path.kernel) == ("kernel", "MlaDecodeSm100"), path
    assert path.key == ("mla_decode_sm100", "bfloat16", 128, 576, 512, 64, True, False, False, True, True, None)
    path = cute_kv.explain(cute_kv.sparse_mla_attention, *args, mla_v_dim=256, arch="sm_100a")
    assert path.path == "reference", path  # the kernel's value width is 512


@pytest.mark.parametrize("cache", ["bf16", "rope-aware"])
@pytest.mark.parametrize("extras", [False, True])
def test_sparse_opcheck(rng, cache, extras):
    pb = mla_batch(rng, cache)
    c = pb.collection
    q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng).to(torch.bfloat16)
    indices = random_indices(rng, c, pb.total_rows, 8)
    lengths = torch.randint(0, 9, (pb.total_rows,), generator=rng, dtype=torch.int32) if extras else None
    sinks = torch.randn(4, generator=rng) if extras else None
    out = torch.full((pb.total_rows, 4, 16), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((pb.total_rows, 4), float("nan")) if extras else None
    args = (q, pb.input_row_offsets, c.blocks, c.cache_lengths, c.lookup_table, c.scales, 1, c.max_seq_length,
            c.max_cache_length, c.quantization_granularity, c.rope_dim, indices, lengths, 16, 0.1,
            3.0 if extras else None, sinks, out, lse)
    # test_schema compares inputs with allclose, which CPU fp8 tensors lack; the bf16 case covers it.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.cute_kv.sparse_mla_attention.default, args,
                          test_utils=utils if c.rope_dim is not None else ("test_schema", *utils))


def test_sparse_op_declares_what_it_writes():
    schema = torch.ops.cute_kv.sparse_mla_attention.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == {"out", "lse"}
    assert not schema.returns


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_sparse_compiles_fullgraph(rng):
    pb = mla_batch(rng, "rope-aware")
    c = pb.collection
    indices = random_indices(rng, c, pb.total_rows, 8)
    step = torch.compile(lambda q: cute_kv.sparse_mla_attention(q, pb.input_row_offsets, c, 1, indices, mla_v_dim=64,
                                                                return_lse=True, validate=False), fullgraph=True)
    for _ in range(2):
        q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng).to(torch.bfloat16)
        out, lse = step(q)
        want, want_lse = ref.sparse_mla_attention(q, c, 1, indices, mla_v_dim=64, return_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)


# -- index remap ------------------------------------------------------------------------------------------------------

def test_index_remap_matches_page_lists(rng):
    """Positions of each row's request (-1, other negatives, past the request's pages, past the lookup table) ->
    ``page * P + slot`` through the request's page list, -1 where it has no page."""
    pb = mla_batch(rng, "rope-aware")
    c = pb.collection
    p, cols = c.page_size, c.lookup_table.shape[1]
    t = pb.total_rows
    positions = torch.randint(-3, cols * p + 40, (t, 12), generator=rng, dtype=torch.int32)
    positions[:, 0] = -1
    positions[:, 1] = 2**31 - 1
    got = cute_kv.sparse_kv_index_remap(positions, pb.input_row_offsets, c)
    assert got.dtype == torch.int32 and got.shape == positions.shape
    for b in range(len(pb.new_lengths)):
        for r in range(pb.rows(b).start, pb.rows(b).stop):
            for j, pos in enumerate(positions[r].tolist()):
                owned = 0 <= pos and pos // p < len(pb.pages[b])
                want = pb.pages[b][pos // p] * p + pos % p if owned else -1
                assert int(got[r, j]) == want, (b, r, pos)
    assert (got >= 0).any() and (got == -1).any()


def test_index_remap_feeds_attention_like_dense_over_the_same_keys(rng):
    """Selecting each query's whole causal context by position gives dense causal MLA attention."""
    pb = mla_batch(rng, "rope-aware")
    c = pb.collection
    width = max(cl + n for cl, n in zip(pb.cache_lengths, pb.new_lengths))
    pos = torch.full((pb.total_rows, width), -1, dtype=torch.int32)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        for i in range(n):
            pos[pb.rows(b).start + i, : cl + i + 1] = torch.arange(cl + i + 1)
    indices = cute_kv.sparse_kv_index_remap(pos, pb.input_row_offsets, c)
    q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng)
    sparse, sparse_lse = ref.sparse_mla_attention(q, c, 1, indices, mla_v_dim=64, return_lse=True)
    dense, dense_lse = ref.paged_attention(q, pb.input_row_offsets, c, 1, mla_v_dim=64, return_lse=True)
    assert torch.allclose(sparse, dense, atol=1e-5) and torch.allclose(sparse_lse, dense_lse, atol=1e-5)


def test_index_remap_rejects_bad_arguments(rng):
    pb = mla_batch(rng, "bf16")
    with pytest.raises(TypeError, match="positions must have dtype torch.int32"):
        cute_kv.sparse_kv_index_remap(torch.zeros(pb.total_rows, 3, dtype=torch.int64), pb.input_row_offsets,
                                      pb.collection)
    with pytest.raises(ValueError, match=r"input_row_offsets\[-1\] \(\d+\) must equal the number of rows \(2\)"):
        cute_kv.sparse_kv_index_remap(torch.zeros(2, 3, dtype=torch.int32), pb.input_row_offsets, pb.collection)


def test_sparse_reference_in_token_chunks(rng, monkeypatch):
    """The reference gathers keys for a chunk of tokens at a time (memory); chunks of 3 tokens give the same rows."""
    pb = mla_batch(rng, "rope-aware")
    c = pb.collection
    indices = random_indices(rng, c, pb.total_rows, 7)
    q = torch.randn(pb.total_rows, 4, c.latent_dim, generator=rng)
    kw = dict(mla_v_dim=64, sinks=torch.randn(4, generator=rng), return_lse=True)
    whole, whole_lse = ref.sparse_mla_attention(q, c, 1, indices, **kw)
    monkeypatch.setattr(ref.sparse_mla, "_CHUNK_ELEMENTS", 3 * 7 * c.latent_dim)
    out, lse = ref.sparse_mla_attention(q, c, 1, indices, **kw)
    assert torch.allclose(out, whole, rtol=1e-6, atol=1e-6) and torch.allclose(lse, whole_lse, rtol=1e-6)


def test_sparse_no_tokens(rng):
    pb = mla_batch(rng, "rope-aware", [3, 0], [0, 0])
    q = torch.zeros(0, 4, 80, dtype=torch.bfloat16)
    out, lse = cute_kv.sparse_mla_attention(q, pb.input_row_offsets, pb.collection, 0,
                                            torch.zeros(0, 5, dtype=torch.int32), mla_v_dim=64, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)
