"""Per-tensor fp8 scales (vLLM's and FlashInfer's ``k_scale`` / ``v_scale``) in ``store_kv`` and ``paged_attention``:
the references against float64, the checks, the kernel path on both archs in every engine layout, the PTX of the
store that quantizes with them, and the strided sm_90a kernels in the simulator (the selftest grid runs the compact
ones)."""

import math
import re

import pytest
import torch

import artifacts
import cute_kv
from cute_kv.kernels.catalog import STORE_TENSOR_SCALED_CASES
from cute_kv.kernels.cache.store import PagedKVStore
from cute_kv import reference, selftest
from cute_kv.ops import paths
from cute_kv.reference.batch import ENGINE_LAYOUTS, random_paged_batch, with_layout
from launch import ARCHS
from numerics import bits, rel_err
from test_reference_attention import CACHED, NEW, dense_attention

FP8 = torch.float8_e4m3fn
LAYER = 1


def _batch(rng, **kw):
    return random_paged_batch(CACHED, NEW, num_heads=2, head_size=64, page_size=16, dtype=FP8, generator=rng,
                              **kw)


def _scales(rng, kind):
    """``(k_scale, v_scale)``: a float32 tensor (vLLM's ``layer._k_scale``: 0-d or ``[1]``) and a float
    (FlashInfer's), random, never 1."""
    k, v = (0.25 + torch.rand((), generator=rng) for _ in range(2))
    if kind == "tensor":
        return k.reshape(()), v.reshape(1)
    return float(k), float(v)


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_store_quantizes_x_over_scale_saturating(rng, kind):
    """Each value is stored as ``saturate(x / scale)`` (vLLM's cache writers): within half an e4m3 step of
    ``x / scale`` (float64) in range, 448 with the sign past it, NaN kept; every other byte of the cache keeps its
    bits and nothing else is written."""
    pb = _batch(rng)
    c = pb.collection
    before = c.blocks.clone()
    t = pb.total_rows
    k, v = (torch.randn(t, 2, 64, generator=rng, dtype=torch.float32) * 3 for _ in range(2))
    k[0, 0, 0], v[1, 1, 5] = math.nan, 1e4  # a NaN, and a value far past the range
    k_scale, v_scale = _scales(rng, kind)
    k_scale = k_scale / 64  # K's scale small: its largest values saturate
    cute_kv.store_kv(k.to(torch.bfloat16), v.to(torch.bfloat16), pb.input_row_offsets, c, LAYER, k_scale=k_scale,
                     v_scale=v_scale)
    step = pb.step_mask(LAYER)
    assert torch.equal(bits(c.blocks)[~step], bits(before)[~step])
    saturated = 0
    for kv, (x, s) in enumerate(((k, k_scale), (v, v_scale))):
        want = x.to(torch.bfloat16).double() / float(s)
        got = torch.cat([pb.tokens(kv, LAYER, b, cl, cl + n)[0] for b, (cl, n)
                         in enumerate(zip(pb.cache_lengths, pb.new_lengths))]).double()
        finite = want.isfinite()
        assert torch.equal(got.isnan(), ~finite)
        big = want.abs() > 448
        saturated += int(big.sum())
        assert torch.equal(got[big], 448 * want[big].sign())
        inside = finite & ~big
        # e4m3: 3 mantissa bits; below 2^-6 a subnormal step of 2^-9
        assert ((got - want)[inside].abs() <= torch.maximum(want[inside].abs() / 16, torch.tensor(2.0**-10))).all()
    assert saturated > 1


@pytest.mark.parametrize("kind", ["tensor", "float"])
def test_attention_dequantizes_per_tensor(rng, kind):
    """K read as ``k * k_scale`` and V as ``v * v_scale``: the float64 oracle with the logits' scale times
    ``k_scale`` and the output times ``v_scale``."""
    pb = _batch(rng)
    pb.poison_unread(LAYER)
    q = torch.randn(pb.total_rows, 8, 64, generator=rng)
    k_scale, v_scale = _scales(rng, kind)
    out = torch.full(q.shape, math.nan)
    got = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, LAYER, out=out, k_scale=k_scale,
                                  v_scale=v_scale)
    assert got is out and not out.isnan().any()
    want = dense_attention(pb, q, LAYER, scale=float(k_scale) / 8) * float(v_scale)
    assert rel_err(out, want) < 1e-5
    assert rel_err(out, dense_attention(pb, q, LAYER)) > 1e-2  # the scales matter


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_engine_layouts_take_the_kernels_on_both_archs(rng, layout):
    """A per-tensor-scaled fp8 cache in every engine's layout plans the store and the attention kernel on SM90 and
    SM100 (no scale tensor in MAX's layout); the key carries the flag."""
    pb, layer = with_layout(_batch(rng), layout, LAYER)
    c = pb.collection
    k = torch.randn(pb.total_rows, 2, 64, dtype=torch.bfloat16)
    q = torch.randn(pb.total_rows, 8, 64, dtype=torch.bfloat16)
    scales = dict(zip(("k_scale", "v_scale"), _scales(rng, "tensor")))
    for arch in ARCHS:
        store = cute_kv.explain(cute_kv.store_kv, k, k, pb.input_row_offsets, c, layer, arch=arch, **scales)
        attention = cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, c, layer, arch=arch, **scales)
        for path in (store, attention):
            assert path.path == paths.KERNEL and path.key[-2:] == (c.layout_name, True), path
        # without the scales, the unscaled kernels (attention) or the saturating cast's reference (store)
        unscaled = cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, c, layer, arch=arch)
        assert unscaled.path == paths.KERNEL and unscaled.key != attention.key
        assert cute_kv.explain(cute_kv.store_kv, k, k, pb.input_row_offsets, c, layer, arch=arch).path == \
            paths.REFERENCE


@pytest.mark.parametrize("kwargs, error, match", [
    ({"k_scale": 0.5}, ValueError, "k_scale needs v_scale too"),
    ({"v_scale": 0.5}, ValueError, "v_scale needs k_scale too"),
    ({"k_scale": 0.0, "v_scale": 1.0}, ValueError, "k_scale must be a positive finite float"),
    ({"k_scale": 1.0, "v_scale": math.inf}, ValueError, "v_scale must be a positive finite float"),
    ({"k_scale": True, "v_scale": 1.0}, ValueError, "k_scale must be"),
    ({"k_scale": torch.ones(1, dtype=torch.float16), "v_scale": 1.0}, ValueError, "float32 tensor of one element"),
    ({"k_scale": torch.ones(2), "v_scale": 1.0}, ValueError, r"shape \[2\]"),
    ({"k_scale": 1.0, "v_scale": torch.tensor(-1.0)}, ValueError, "v_scale must be positive and finite, got -1.0"),
    ({"k_scale": torch.tensor(math.nan), "v_scale": 1.0}, ValueError, "k_scale must be positive and finite"),
])
@pytest.mark.parametrize("op", ["store_kv", "paged_attention"])
def test_bad_scales_raise_before_anything_is_written(rng, op, kwargs, error, match):
    pb = _batch(rng)
    c = pb.collection
    before = c.blocks.clone()
    t = pb.total_rows
    x = torch.randn(t, 2, 64, dtype=torch.bfloat16)
    out = torch.full((t, 8, 64), math.nan, dtype=torch.bfloat16)
    with pytest.raises(error, match=match):
        if op == "store_kv":
            cute_kv.store_kv(x, x, pb.input_row_offsets, c, LAYER, **kwargs)
        else:
            cute_kv.paged_attention(torch.randn(t, 8, 64, dtype=torch.bfloat16), pb.input_row_offsets, c, LAYER,
                                    out=out, **kwargs)
    assert torch.equal(bits(c.blocks), bits(before)) and out.isnan().all()


def test_a_tensor_value_is_checked_only_with_the_device_checks(rng):
    """``validate=False`` (CUDA-graph capture) reads no device value: a tensor scale's value is then trusted."""
    pb = _batch(rng)
    x = torch.randn(pb.total_rows, 2, 64, dtype=torch.bfloat16)
    cute_kv.store_kv(x, x, pb.input_row_offsets, pb.collection, LAYER, k_scale=torch.tensor(-1.0), v_scale=1.0,
                     validate=False)


@pytest.mark.parametrize("cache, match", [
    (dict(dtype=torch.bfloat16), "per-tensor scales of an fp8 e4m3 cache; this cache is torch.bfloat16"),
    (dict(scale_dtype=torch.float32, quantization_granularity=64), "has per-granule scales"),
    (dict(is_mla=True, num_heads=1), "MLA cache"),
])
def test_scales_only_for_unscaled_fp8_mha_caches(rng, cache, match):
    kw = {"dtype": FP8, "num_heads": 2, **cache}
    pb = random_paged_batch(CACHED, NEW, head_size=64, page_size=16, generator=rng, **kw)
    c = pb.collection
    x = torch.randn(pb.total_rows, c.num_heads, 64, dtype=torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=match):
        cute_kv.store_kv(x, None if c.is_mla else x, pb.input_row_offsets, c, LAYER, k_scale=0.5, v_scale=0.5)
    with pytest.raises((TypeError, ValueError), match=match):
        cute_kv.paged_attention(torch.randn(pb.total_rows, 8, 64, dtype=torch.bfloat16), pb.input_row_offsets, c,
                                LAYER, k_scale=0.5, v_scale=0.5, mla_v_dim=32 if c.is_mla else None)


def test_step_plan_takes_the_scales(rng):
    """With ``plan=`` (one check per step) the calls give the per-call results, scales included."""
    pb = _batch(rng)
    c = pb.collection
    q = torch.randn(pb.total_rows, 8, 64)
    scales = dict(zip(("k_scale", "v_scale"), _scales(rng, "tensor")))
    plan = cute_kv.plan_step(c, pb.input_row_offsets, num_q_heads=8)
    planned = cute_kv.paged_attention(q, pb.input_row_offsets, c, LAYER, plan=plan, **scales)
    assert torch.equal(planned, cute_kv.paged_attention(q, pb.input_row_offsets, c, LAYER, **scales))
    assert not torch.equal(planned, cute_kv.paged_attention(q, pb.input_row_offsets, c, LAYER, plan=plan))


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STORE_TENSOR_SCALED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_store_ptx_divides_by_the_plane_scale(arch, case):
    """Each value ``x / scale`` (one ``div.rn``, as the reference divides) converted with saturation; one scale
    load per plane, no amax reduction, no scale stored."""
    kernel = PagedKVStore(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    vectors = kernel.kv_dim * kernel.vecs_per_thread  # 8 values each
    assert ptx.count("div.rn.f32") == vectors * 8
    assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == vectors * 4
    assert len(re.findall(r"ld\.global\.(?:nc\.)?(?:b32|f32)\s+%r\d+, \[%rd\d+\+4\];", ptx)) == 1  # V's scale
    assert "shfl.sync.bfly" not in ptx and "max.NaN" not in ptx
    assert len(re.findall(r"st\.global\.v2\.b32", ptx)) == vectors  # 8 fp8 bytes per vector, nothing else
    assert len(re.findall(r"st\.global\.(?:b32|f32)", ptx)) == 0


@pytest.mark.sim
@pytest.mark.parametrize("layout", ["vllm", "flashinfer-hnd"])
def test_strided_kernels_run_in_the_simulator(layout):
    """vLLM's ``kv[2, N, P, H, D]`` and FlashInfer's HND cache read in place: the strided store writes the
    reference's bits (the rest of the cache kept), the strided attention is within the selftest's tolerance of the
    reference, every output row written."""
    from cute_kv.simulate import simulated

    cases = {op: next(c for c in selftest.cases(ops=[op], arch="sm_90a")
                      if c.variant == "tensor scales" and c.step == "ragged") for op in ("store_kv", "paged_attention")}
    pb, layer = with_layout(selftest._batch(cases["store_kv"], "cpu"), layout, LAYER)
    twin, _ = with_layout(selftest._batch(cases["store_kv"], "cpu"), layout, LAYER)
    g = torch.Generator().manual_seed(1)
    scales = {"k_scale": torch.tensor(0.004), "v_scale": 0.75}
    t = pb.total_rows
    k, v = (torch.randn(t, 2, 128, generator=g).to(torch.bfloat16) for _ in range(2))
    with simulated("sm_90a", seed=1) as record:
        cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, layer, **scales)
    reference.store_kv(k, v, twin.input_row_offsets, twin.collection, layer, **scales)
    assert record.launches
    for kv in range(2):
        assert torch.equal(bits(pb.collection.plane(kv)), bits(twin.collection.plane(kv)))

    pb, layer = with_layout(selftest._batch(cases["paged_attention"], "cpu"), layout, LAYER)
    q = torch.randn(pb.total_rows, 8, 128, generator=g).to(torch.bfloat16)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16)
    scales = {"k_scale": torch.tensor(1.5), "v_scale": 0.75}
    with simulated("sm_90a", seed=1) as record:
        cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, layer, out=out, **scales)
    want = reference.paged_attention(q, pb.input_row_offsets, pb.collection, layer, **scales)
    assert record.launches and selftest.rel_err(out, want) <= selftest.TOLERANCE[torch.bfloat16]
