"""``torch.ops.cute_kv`` custom ops: opcheck, entry points equal to the references, ``validate=False``, torch.compile
and CUDA-graph capture."""

import pytest
import torch

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.dtypes import is_fp8
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns

CACHED = [0, 37, 5, 9]
NEW = [5, 1, 0, 3]
FP8 = torch.float8_e4m3fn
CACHES = {
    "bf16": {},
    "fp8 scales": {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 8},
    "fp8 e8m0 scales": {"dtype": FP8, "scale_dtype": torch.float8_e8m0fnu},
    "fp8 cast": {"dtype": FP8},
    "mla": {"num_heads": 1, "is_mla": True},
}
QKV_CACHES = ["bf16", "fp8 scales", "mla"]
ROPES = {"no rope": None, "neox": RopeConfig.from_theta(16, 64),
         "gptj partial q32": RopeConfig.from_theta(8, 64, interleaved=True, q_head_dim=32)}
Q_DIM, HIDDEN = 64, 32


def _batch(cache="bf16", device=None):
    """The same random batch on every call: one for the entry point, a twin for the reference."""
    kw = {"num_heads": 2, "head_size": 16, "page_size": 16, **CACHES[cache]}
    return random_paged_batch(CACHED, NEW, generator=torch.Generator().manual_seed(0x5EED), device=device, **kw)


def _assert_same_cache(a, b):
    assert torch.equal(_raw(a.blocks), _raw(b.blocks))
    assert (a.scales is None) == (b.scales is None)
    if a.scales is not None:
        assert torch.equal(_raw(a.scales), _raw(b.scales))


def _collection_args(c):
    """The collection as the ops take it: its tensors, then (after ``layer_idx``) its sizes."""
    return (c.blocks, c.cache_lengths, c.lookup_table, c.scales), (c.max_seq_length, c.max_cache_length,
                                                                  c.quantization_granularity)


def _opcheck(op, args, collection):
    # test_schema compares the mutated tensors with allclose, which CPU fp8 tensors lack; bf16 cases cover it.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(op, args, test_utils=utils if is_fp8(collection.dtype) else ("test_schema", *utils))


def _kv(pb, rng, dtype=torch.bfloat16):
    c = pb.collection
    k = torch.randn(pb.total_rows, c.num_heads, c.head_size, generator=rng).to(dtype)
    return k, None if c.is_mla else torch.randn(k.shape, generator=rng).to(dtype)


def _qkv_inputs(pb, rng, with_bias):
    n_tot = Q_DIM + kv_columns(pb.collection)
    hidden = torch.randn(pb.total_rows, HIDDEN, generator=rng).to(torch.bfloat16)
    weight = (torch.randn(n_tot, HIDDEN, generator=rng) / HIDDEN**0.5).to(torch.bfloat16)
    bias = torch.randn(n_tot, generator=rng).to(torch.bfloat16) if with_bias else None
    return hidden, weight, bias


# -- opcheck ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", list(CACHES))
def test_store_kv_opcheck(rng, cache):
    pb = _batch(cache)
    k, v = _kv(pb, rng)
    tensors, sizes = _collection_args(pb.collection)
    _opcheck(torch.ops.cute_kv.store_kv.default, (k, v, pb.input_row_offsets, *tensors, 1, *sizes), pb.collection)


@pytest.mark.parametrize("cache", QKV_CACHES)
@pytest.mark.parametrize("with_bias,rope", [(False, "no rope"), (True, "neox"), (False, "gptj partial q32")])
def test_fused_qkv_opcheck(rng, cache, with_bias, rope):
    pb = _batch(cache)
    hidden, weight, bias = _qkv_inputs(pb, rng, with_bias)
    r = ROPES[rope]
    output = torch.empty(pb.total_rows, Q_DIM, dtype=torch.bfloat16)
    tensors, sizes = _collection_args(pb.collection)
    args = (hidden, pb.input_row_offsets, weight, *tensors, bias, None if r is None else r.freqs_cis,
            r is not None and r.interleaved, None if r is None else r.q_head_dim, output, 0, *sizes,
            None, None, None, None, None, 0.0, 0.0)
    _opcheck(torch.ops.cute_kv.fused_qkv_matmul_kv_cache.default, args, pb.collection)


@pytest.mark.parametrize("cache", QKV_CACHES)
def test_fused_qkv_opcheck_int4_weight_and_qk_norm(rng, cache):
    pb = _batch(cache)
    hidden, weight, _ = _qkv_inputs(pb, rng, False)
    n = weight.shape[0]
    packed = torch.randint(0, 256, (n, HIDDEN // 2), generator=rng, dtype=torch.uint8)
    scales = torch.rand(n, HIDDEN // 16, generator=rng).to(torch.bfloat16)
    zp = torch.randint(0, 16, (n, HIDDEN // 16), generator=rng, dtype=torch.uint8)
    d = pb.collection.head_size
    output = torch.empty(pb.total_rows, Q_DIM, dtype=torch.bfloat16)
    tensors, sizes = _collection_args(pb.collection)
    args = (hidden, pb.input_row_offsets, packed, *tensors, None, None, False, None, output, 0, *sizes,
            scales, zp, 16, torch.rand(d, generator=rng), torch.rand(d, generator=rng), 1e-6, 1.0)
    _opcheck(torch.ops.cute_kv.fused_qkv_matmul_kv_cache.default, args, pb.collection)


def _attention_args(pb, rng, out=None):
    """``(q, out, mla_v_dim)`` for layer 1 of ``pb``; q in bf16 (the dtype an fp8 cache is read in)."""
    c = pb.collection
    q = torch.randn(pb.total_rows, 4, c.head_size, generator=rng).to(torch.bfloat16)
    mla_v_dim = 8 if c.is_mla else None
    if out is None:
        out = torch.full((*q.shape[:2], mla_v_dim or c.head_size), float("nan"), dtype=q.dtype, device=q.device)
    return q, out, mla_v_dim


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("window", [None, 3])
def test_paged_attention_opcheck(rng, cache, window):
    pb = _batch(cache)
    q, out, mla_v_dim = _attention_args(pb, rng)
    tensors, sizes = _collection_args(pb.collection)
    args = (q, pb.input_row_offsets, *tensors, 1, *sizes, True, window, 0.3, None, None, mla_v_dim, out, None)
    _opcheck(torch.ops.cute_kv.paged_attention.default, args, pb.collection)


@pytest.mark.parametrize("cache", ["bf16", "fp8 scales"])
def test_paged_attention_opcheck_softcap_sinks_lse(rng, cache):
    pb = _batch(cache)
    q, out, _ = _attention_args(pb, rng)
    sinks = torch.randn(q.shape[1], generator=rng)
    lse = torch.full(q.shape[:2], float("nan"))
    tensors, sizes = _collection_args(pb.collection)
    args = (q, pb.input_row_offsets, *tensors, 1, *sizes, True, None, None, 20.0, sinks, None, out, lse)
    _opcheck(torch.ops.cute_kv.paged_attention.default, args, pb.collection)


@pytest.mark.parametrize("op,written", [(torch.ops.cute_kv.store_kv, {"blocks", "scales"}),
                                        (torch.ops.cute_kv.fused_qkv_matmul_kv_cache, {"blocks", "scales", "output"}),
                                        (torch.ops.cute_kv.paged_attention, {"out", "lse"})])
def test_ops_declare_what_they_write(op, written):
    """Functionalization and CUDA graphs trust these declarations; opcheck's test_schema cannot check ``scales``."""
    schema = op.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == written
    assert not schema.returns


# -- entry points through the ops == references ----------------------------------------------------------------------

@pytest.mark.parametrize("cache", list(CACHES))
def test_store_kv_entry_matches_reference(rng, cache):
    pb, twin = _batch(cache), _batch(cache)
    k, v = _kv(pb, rng, torch.float32 if is_fp8(pb.collection.dtype) else torch.bfloat16)
    cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, 1)
    ref.store_kv(k, v, twin.input_row_offsets, twin.collection, 1)
    _assert_same_cache(pb.collection, twin.collection)


@pytest.mark.parametrize("cache", QKV_CACHES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("with_output", [False, True])
def test_fused_qkv_entry_matches_reference(rng, cache, with_bias, rope, with_output):
    pb, twin = _batch(cache), _batch(cache)
    hidden, weight, bias = _qkv_inputs(pb, rng, with_bias)
    output = torch.full((pb.total_rows, Q_DIM), float("nan"), dtype=torch.bfloat16) if with_output else None
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, output=output,
                                          bias=bias, rope=ROPES[rope])
    want = ref.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, weight, twin.collection, 1, bias=bias,
                                         rope=ROPES[rope])
    assert q is output if with_output else q.shape == (pb.total_rows, Q_DIM)
    assert torch.equal(q, want)
    _assert_same_cache(pb.collection, twin.collection)


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("with_out", [False, True])
def test_paged_attention_entry_matches_reference(rng, cache, with_out):
    pb = _batch(cache)
    q, out, mla_v_dim = _attention_args(pb, rng)
    got = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, mla_v_dim=mla_v_dim, window=4,
                                  out=out if with_out else None)
    want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, mla_v_dim=mla_v_dim, window=4)
    assert got is out if with_out else got.shape == out.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache", ["bf16", "fp8 e8m0 scales", "mla"])
def test_paged_attention_entry_softcap_sinks_lse_match_reference(rng, cache):
    pb = _batch(cache)
    q, _, mla_v_dim = _attention_args(pb, rng)
    sinks = torch.randn(q.shape[1], generator=rng)
    kw = {"mla_v_dim": mla_v_dim, "softcap": 5.0, "sinks": sinks, "return_lse": True}
    out, lse = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, **kw)
    want_out, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, **kw)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:2]
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    plain = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, mla_v_dim=mla_v_dim, softcap=0.0)
    assert torch.equal(plain, ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, mla_v_dim=mla_v_dim))


# -- validate=False --------------------------------------------------------------------------------------------------

def _store(pb, rng, collection, **kw):
    k, v = _kv(pb, rng)
    cute_kv.store_kv(k, v, pb.input_row_offsets, collection, 1, **kw)
    return lambda twin: ref.store_kv(k, v, twin.input_row_offsets, twin.collection, 1)


def _fused_qkv(pb, rng, collection, **kw):
    hidden, weight, bias = _qkv_inputs(pb, rng, True)
    cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, collection, 1, bias=bias,
                                      rope=ROPES["neox"], **kw)
    return lambda twin: ref.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, weight, twin.collection, 1,
                                                      bias=bias, rope=ROPES["neox"])


@pytest.mark.parametrize("call", [_store, _fused_qkv], ids=["store_kv", "fused_qkv"])
def test_validate_false_skips_data_checks(rng, call):
    """Request 0 brings 5 new tokens but the collection claims ``max_seq_length`` 4: only reading the offsets
    tells. The write itself stays in the request's pages, so the unchecked call can run and match the reference."""
    pb, twin = _batch(), _batch()
    c = pb.collection
    short = c.with_metadata(c.cache_lengths, c.lookup_table, 4, c.max_cache_length)
    with pytest.raises(ValueError, match="request 0 has 5 new tokens.*max_seq_length"):
        call(pb, rng, short)
    call(pb, rng, short, validate=False)(twin)
    _assert_same_cache(c, twin.collection)


STILL_CHECKED = {
    "offsets dtype": (lambda a: a.update(input_row_offsets=a["input_row_offsets"].long()), TypeError,
                      r"input_row_offsets must have dtype torch.uint32 \(MAX's\) or torch.int32, got torch.int64; "
                      r"convert with input_row_offsets.to\(torch.int32\)"),
    "offsets batch": (lambda a: a.update(input_row_offsets=a["input_row_offsets"][:-1]), ValueError,
                      r"input_row_offsets must have shape \[5\]"),
    "k dtype": (lambda a: a.update(k=a["k"].half()), TypeError, "k must have dtype torch.bfloat16"),
    "layer": (lambda a: a.update(layer_idx=2), ValueError, r"layer_idx must be in \[0, 2\)"),
}


def test_paged_attention_validate_false_skips_data_checks(rng):
    pb = _batch()
    c = pb.collection
    short = c.with_metadata(c.cache_lengths, c.lookup_table, 4, c.max_cache_length)
    q, _, _ = _attention_args(pb, rng)
    with pytest.raises(ValueError, match="request 0 has 5 new tokens.*max_seq_length"):
        cute_kv.paged_attention(q, pb.input_row_offsets, short, 1)
    got = cute_kv.paged_attention(q, pb.input_row_offsets, short, 1, validate=False)
    assert torch.equal(got, ref.paged_attention(q, pb.input_row_offsets, c, 1))
    with pytest.raises(ValueError, match="q head dim"):  # shapes are still checked
        cute_kv.paged_attention(q[..., :8], pb.input_row_offsets, short, 1, validate=False)


@pytest.mark.parametrize("case", list(STILL_CHECKED))
def test_validate_false_keeps_shape_checks(rng, case):
    pb = _batch()
    k, v = _kv(pb, rng)
    args = {"k": k, "v": v, "input_row_offsets": pb.input_row_offsets, "layer_idx": 1}
    mutate, exc, match = STILL_CHECKED[case]
    mutate(args)
    with pytest.raises(exc, match=match):
        cute_kv.store_kv(args["k"], args["v"], args["input_row_offsets"], pb.collection, args["layer_idx"],
                         validate=False)


def test_validate_false_keeps_rope_shape_checks(rng):
    pb = _batch()
    hidden, weight, _ = _qkv_inputs(pb, rng, False)
    with pytest.raises(ValueError, match=r"rope_dim=32\) exceeds the head size"):
        cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0,
                                          rope=RopeConfig.from_theta(32, 64), validate=False)


# -- torch.compile ---------------------------------------------------------------------------------------------------

# Inductor imports torch.utils.mkldnn, which warns about its own use of torch.jit.script_method.
inductor_noise = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@inductor_noise
def test_store_kv_compiles_fullgraph(rng):
    """With ``validate=False`` nothing reads device values, so the entry point traces into one graph."""
    pb, twin = _batch(), _batch()
    step = torch.compile(lambda k, v: cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, 1, validate=False),
                         fullgraph=True)
    for _ in range(2):  # the second call writes new values: the compiled graph runs the op every time
        k, v = _kv(pb, rng)
        step(k, v)
        cute_kv.store_kv(k, v, twin.input_row_offsets, twin.collection, 1)
        _assert_same_cache(pb.collection, twin.collection)


@inductor_noise
def test_default_validate_compiles_fullgraph(rng):
    """A trace skips the data checks that read device values (a graph break), so the default traces into one graph
    with everything built inside it; the eager call keeps them."""
    pb, twin = _batch(), _batch()
    c = pb.collection

    def step(k, v, offsets, cache_lengths, lookup_table):
        collection = cute_kv.PagedKVCacheCollection(c.blocks, cache_lengths, lookup_table, c.max_seq_length,
                                                    c.max_cache_length)
        cute_kv.store_kv(k, v, offsets, collection, 1)
        q = torch.cat((k, k), dim=1)
        return cute_kv.paged_attention(q, offsets, collection, 1)

    compiled = torch.compile(step, fullgraph=True)
    k, v = _kv(pb, rng)
    out = compiled(k, v, pb.input_row_offsets, c.cache_lengths, c.lookup_table)
    cute_kv.store_kv(k, v, twin.input_row_offsets, twin.collection, 1)
    _assert_same_cache(c, twin.collection)
    assert torch.equal(out, ref.paged_attention(torch.cat((k, k), dim=1), twin.input_row_offsets, twin.collection, 1))
    short = c.with_metadata(c.cache_lengths, c.lookup_table, 4, c.max_cache_length)
    with pytest.raises(ValueError, match="max_seq_length"):
        cute_kv.store_kv(k, v, pb.input_row_offsets, short, 1)


def test_int32_metadata_runs_as_uint32(rng):
    """int32 offsets, lengths and lookup table (every peer's dtype) write and read what MAX's uint32 ones do."""
    pb, twin = _batch(), _batch()
    c = pb.collection
    c32 = cute_kv.PagedKVCacheCollection(c.blocks, c.cache_lengths.to(torch.int32), c.lookup_table.to(torch.int32),
                                         c.max_seq_length, c.max_cache_length)
    offsets = pb.input_row_offsets.to(torch.int32)
    k, v = _kv(pb, rng)
    cute_kv.store_kv(k, v, offsets, c32, 0)
    cute_kv.store_kv(k, v, twin.input_row_offsets, twin.collection, 0)
    _assert_same_cache(c, twin.collection)
    q, _, _ = _attention_args(pb, rng)
    assert torch.equal(cute_kv.paged_attention(q, offsets, c32, 0),
                       cute_kv.paged_attention(q, twin.input_row_offsets, twin.collection, 0))
    hidden, weight, _ = _qkv_inputs(pb, rng, False)
    assert torch.equal(cute_kv.fused_qkv_matmul_kv_cache(hidden, offsets, weight, c32, 1),
                       cute_kv.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, weight, twin.collection, 1))
    _assert_same_cache(c, twin.collection)


@inductor_noise
def test_fused_qkv_compiles_fullgraph(rng):
    pb, twin = _batch(), _batch()
    hidden, weight, bias = _qkv_inputs(pb, rng, True)
    rope = ROPES["gptj partial q32"]
    step = torch.compile(lambda h: cute_kv.fused_qkv_matmul_kv_cache(h, pb.input_row_offsets, weight, pb.collection, 0,
                                                                     bias=bias, rope=rope, validate=False),
                         fullgraph=True)
    q = step(hidden)
    want = cute_kv.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, weight, twin.collection, 0, bias=bias,
                                             rope=rope)
    assert torch.equal(q, want)
    _assert_same_cache(pb.collection, twin.collection)


@inductor_noise
def test_paged_attention_compiles_fullgraph(rng):
    pb = _batch()
    step = torch.compile(lambda q: cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, window=6,
                                                           validate=False), fullgraph=True)
    for _ in range(2):
        q, _, _ = _attention_args(pb, rng)
        assert torch.equal(step(q), ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, window=6))


@inductor_noise
def test_paged_attention_with_lse_compiles_fullgraph(rng):
    pb = _batch()
    sinks = torch.randn(4, generator=rng)
    kw = {"softcap": 2.0, "sinks": sinks, "return_lse": True}
    step = torch.compile(lambda q: cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, validate=False,
                                                           **kw), fullgraph=True)
    q, _, _ = _attention_args(pb, rng)
    out, lse = step(q)
    want_out, want_lse = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, **kw)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@inductor_noise
def test_paged_attention_lse_buffer_and_tensor_scales_compile_fullgraph(rng):
    """An ``[H, T]`` LSE written into a given buffer, over an fp8 cache with per-tensor scales (a float and a
    tensor): one graph, the eager call's values."""
    pb = _batch("fp8 cast")
    k_scale = torch.tensor(0.5)
    kw = {"return_lse": True, "lse_layout": "HT", "k_scale": k_scale, "v_scale": 1.5}

    def attention(q, lse):
        return cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, validate=False, lse=lse, **kw)

    step = torch.compile(attention, fullgraph=True)
    q, _, _ = _attention_args(pb, rng)
    lse = torch.full((4, pb.total_rows), float("nan"))
    out, got = step(q, lse)
    want_out, want_lse = attention(q, None)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


# -- CUDA graphs -----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_store_kv_cuda_graph_replay(rng):
    """Captured once with ``validate=False``, replayed on new values written into the captured inputs."""
    pb, twin = _batch(device="cuda"), _batch(device="cuda")
    k, v = (x.cuda() for x in _kv(pb, rng))

    def step():
        cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, 1, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (kernel compile) off the capture stream, as torch's graph docs require
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_k, new_v = (x.cuda() for x in _kv(pb, rng))
    k.copy_(new_k)
    v.copy_(new_v)
    graph.replay()
    torch.cuda.synchronize()
    ref.store_kv(new_k, new_v, twin.input_row_offsets, twin.collection, 1)
    _assert_same_cache(pb.collection, twin.collection)


@pytest.mark.gpu
def test_paged_attention_cuda_graph_replay(rng):
    """Captured once with ``validate=False`` (kernel, split-KV workspace and combine inside the graph), replayed on
    new queries written into the captured input."""
    pb = random_paged_batch([3000, 0, 17], [1, 6, 2], num_heads=2, head_size=128, page_size=64,
                            generator=torch.Generator().manual_seed(1), device="cuda")
    q = torch.randn(pb.total_rows, 8, 128, generator=rng).to(torch.bfloat16).cuda()
    out = torch.empty_like(q)

    def step():
        cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, out=out, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_q = torch.randn(q.shape, generator=rng).to(torch.bfloat16)
    q.copy_(new_q)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.paged_attention(new_q.cuda(), pb.input_row_offsets, pb.collection, 1)
    assert float((out.double() - want.double()).norm() / want.double().norm()) < 2e-2


@inductor_noise
def test_fused_qkv_int4_qk_norm_compiles_fullgraph(rng):
    """A quantized weight and QK-norm travel through the traced op as plain tensors and come back as specs."""
    pb, twin = _batch("fp8 scales"), _batch("fp8 scales")
    hidden, weight, _ = _qkv_inputs(pb, rng, False)
    n = weight.shape[0]
    w = cute_kv.Int4Weight(torch.randint(0, 256, (n, HIDDEN // 2), generator=rng, dtype=torch.uint8),
                           torch.rand(n, HIDDEN // 8, generator=rng).to(torch.bfloat16), 8, True,
                           torch.randint(0, 16, (n, HIDDEN // 8), generator=rng, dtype=torch.uint8))
    norm = cute_kv.QKNorm(torch.rand(16, generator=rng), torch.rand(16, generator=rng), 1e-5, 1.0)
    rope = ROPES["neox"]
    step = torch.compile(lambda h: cute_kv.fused_qkv_matmul_kv_cache(h, pb.input_row_offsets, w, pb.collection, 1,
                                                                     rope=rope, qk_norm=norm, validate=False),
                         fullgraph=True)
    q = step(hidden)
    want = ref.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, w, twin.collection, 1, rope=rope,
                                         qk_norm=norm)
    assert torch.equal(q, want)
    _assert_same_cache(pb.collection, twin.collection)


def test_public_classes_and_custom_ops_are_documented():
    """``help()`` says what each is: the classes' own docstrings, and a ``__doc__`` on every ``torch.ops.cute_kv``
    op (the dispatcher's op objects carry none unless given) naming the entry point that checks its arguments."""
    from torch._library.custom_ops import CustomOpDef

    from cute_kv.ops import library

    for cls, words in ((cute_kv.PagedKVCacheCollection, ("cache_lengths", "lookup_table", "sentinel")),
                       (cute_kv.GraphStepBuffers, ("allocate(", "graph_buffers", "validate=False"))):
        doc = cls.__dict__.get("__doc__") or ""
        assert len(doc) > 300 and all(w in doc for w in words), (cls.__name__, doc)
    names = [name for name, op in vars(library).items() if isinstance(op, CustomOpDef)]
    assert set(names) == {"store_kv", "fused_qkv_matmul_kv_cache", "paged_attention", "sparse_mla_attention",
                          "mla_prefill"}
    for name in names:
        packet = getattr(torch.ops.cute_kv, name)
        for doc in (packet.__doc__, packet.default.__doc__):
            assert doc and len(doc) > 200 and f"``cute_kv.{name}`` as a custom op" in doc, (name, doc)
