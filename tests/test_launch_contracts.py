"""Launch contracts: every op through its real CUDA launcher on the CPU, each call of a compiled kernel checked
against that kernel's TVM-FFI spec (``tests/launch.py``), over both archs, every cache kind and every step shape.

A call whose plan (``cute_kv.explain``) names a kernel must launch it (nothing for ``T = 0``) with arguments its
entry accepts and no fallback warning; a split-KV launch is followed by the combine of its splits. A call the plan
sends to the reference must warn and launch nothing.
"""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import cute_kv
from cute_kv.kernels.archs import generation, is_blackwell
from cute_kv.ops import gather_kv as gather_kv_op
from cute_kv.ops import mla_prefill as mla_prefill_op
from cute_kv.ops import paged_attention_sm100, paths
from cute_kv.reference.batch import ENGINE_LAYOUTS, random_paged_batch, with_layout
from cute_kv.reference.qkv import kv_columns
from launch import ARCHS, Contract, ContractError, as_cuda

HQ = 8  # query heads over 2 KV heads; MLA: 16 over the latent head
MLA_HQ, NOPE, ROPE, RANK, V_DIM = 16, 128, 64, 512, 128  # DeepSeek's MLA, 16 heads

CACHES = {  # random_paged_batch arguments of each cache kind
    "bf16": dict(dtype=torch.bfloat16),
    "fp16": dict(dtype=torch.float16),
    "fp32": dict(dtype=torch.float32),
    "fp8": dict(dtype=torch.float8_e4m3fn),
    "fp8-f32": dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, quantization_granularity=64),
    "fp8-e8m0": dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float8_e8m0fnu, quantization_granularity=64),
    "mla-bf16": dict(dtype=torch.bfloat16, is_mla=True, num_heads=1, head_size=RANK + ROPE),
    "rope-aware": dict(dtype=torch.float8_e4m3fn, is_mla=True, num_heads=1, head_size=RANK + 2 * ROPE,
                       scale_dtype=torch.float32, rope_dim=ROPE),
}
MLA = ("mla-bf16", "rope-aware")
STEPS = {  # (cache_lengths, new tokens) per request
    "decode-split": ([700, 300], [1, 1]),  # long contexts, one token: split-KV
    "ragged": ([0, 37, 5, 9], [5, 1, 0, 3]),  # a fresh prompt, 1- and 0-token requests
    "prefill": ([0, 0, 16], [300, 1, 0]),  # a long prompt: several query blocks
    "empty": ([4, 9], [0, 0]),  # T = 0
    "strided": ([0, 37, 5, 9], [5, 1, 0, 3]),  # views: activations, outputs, metadata, bias, sinks, top-k lengths
}


@pytest.fixture(autouse=True)
def fresh_reporting(monkeypatch):
    monkeypatch.delenv("CUTE_KV_STRICT", raising=False)
    monkeypatch.setattr(paths, "_warned", set())
    monkeypatch.setattr(paths, "_strict", None)


def _batch(kind: str, step: str):
    cached, new = STEPS[step]
    kw = {"num_heads": 2, "head_size": 128, **CACHES[kind]}
    pb = random_paged_batch(cached, new, page_size=32, generator=torch.Generator().manual_seed(0), **kw)
    if step == "strided":
        _strided_metadata(pb)
    return pb


def _column(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D) as the first column of a ``[n, 2]`` tensor: its entries 2 apart."""
    return torch.stack([x, torch.zeros_like(x)], 1)[:, 0]


def _strided_metadata(pb) -> None:
    """``cache_lengths`` and ``input_row_offsets`` as columns of ``[n, 2]`` tensors and the lookup table as columns
    1.. of a wider one (its rows 8 entries apart, its base 4 bytes past a 16-byte boundary)."""
    c = pb.collection
    cols = c.lookup_table.shape[1]
    wide = torch.zeros((c.batch_size, -(-(cols + 1) // 8) * 8), dtype=torch.int32)
    wide[:, 1:cols + 1] = c.lookup_table.view(torch.int32)
    pb.collection = c.with_metadata(_column(c.cache_lengths.view(torch.int32)), wide[:, 1:cols + 1],
                                    c.max_seq_length, c.max_cache_length)
    pb.input_row_offsets = _column(pb.input_row_offsets.view(torch.int32))
    assert pb.collection.cache_lengths.stride(0) == 2 and pb.collection.lookup_table.data_ptr() % 16 == 4


def _activation(rows: int, heads: int, dim: int, dtype, strided: bool, rng) -> torch.Tensor:
    """``[rows, heads, dim]``; strided: a slice of wider rows (heads not packed)."""
    x = torch.randn(rows, heads, dim + (8 if strided else 0), generator=rng).to(dtype)
    return x[..., :dim] if strided else x


def _act_dtype(pb):
    c = pb.collection
    return torch.bfloat16 if c.dtype == torch.float8_e4m3fn or c.rope_dim else c.dtype


# -- the ops' calls ---------------------------------------------------------------------------------------------------

def _store_kv(pb, step, rng):
    c = pb.collection
    k = _activation(pb.total_rows, c.num_heads, c.latent_dim, _act_dtype(pb), step == "strided", rng)
    v = None if c.is_mla else _activation(pb.total_rows, c.num_heads, c.latent_dim, _act_dtype(pb),
                                          step == "strided", rng)
    return cute_kv.store_kv, (k, v, pb.input_row_offsets, c, 1), {}


def _fused_qkv(pb, step, rng, weight_kind="dense"):
    from test_fused_qkv_w4 import _fp8, _int4

    c = pb.collection
    k_dim = 512
    # MLA: DeepSeek's Q heads of 192 (nope | rope) and the latent's norm (a cross-tile reduction); RoPE on 64 dims
    q_head = NOPE + ROPE if c.is_mla else c.head_size
    n_tot = (MLA_HQ if c.is_mla else HQ) * q_head + kv_columns(c)
    hidden = torch.randn(pb.total_rows, k_dim + (64 if step == "strided" else 0), generator=rng).to(_act_dtype(pb))
    if step == "strided":
        hidden = hidden[:, :k_dim]
    weight = {"dense": lambda: torch.randn(n_tot, k_dim, generator=rng).to(hidden.dtype),
              "int4": lambda: _int4(rng, n_tot, k_dim, 128), "fp8": lambda: _fp8(rng, n_tot, k_dim)}[weight_kind]()
    kw = {"rope": cute_kv.RopeConfig.from_theta(ROPE, 1024, interleaved=c.is_mla, q_head_dim=q_head)}
    if c.is_mla:
        kw["qk_norm"] = cute_kv.QKNorm(k_weight=torch.rand(RANK, generator=rng))
    if step == "strided":
        kw["output"] = torch.empty(pb.total_rows, n_tot - kv_columns(c) + 64, dtype=hidden.dtype)[:, 64:]
        kw["bias"] = torch.randn(2 * n_tot, generator=rng).to(hidden.dtype)[::2]
    return cute_kv.fused_qkv_matmul_kv_cache, (hidden, pb.input_row_offsets, weight, c, 1), kw


def _paged_attention(pb, step, rng):
    c = pb.collection
    hq = MLA_HQ if c.is_mla else HQ
    q = _activation(pb.total_rows, hq, c.latent_dim, _act_dtype(pb), step == "strided", rng)
    kw = {"mla_v_dim": RANK} if c.is_mla else {}
    if step == "strided":
        d_v = RANK if c.is_mla else c.head_size
        kw["out"] = torch.empty(pb.total_rows, hq, d_v + 8, dtype=q.dtype)[..., 8:]
    kw["return_lse"] = step == "decode-split"
    if step == "decode-split" and not c.is_mla:  # the MLA kernels have no window
        kw["window"] = 200
    if step == "prefill":
        kw.update(softcap=30.0, sinks=torch.randn(hq, generator=rng))
    if step == "strided":
        kw["sinks"] = torch.randn(2 * hq, generator=rng)[::2]
    return cute_kv.paged_attention, (q, pb.input_row_offsets, c, 1), kw


def _sparse_mla(pb, step, rng):
    c = pb.collection
    q = _activation(pb.total_rows, MLA_HQ, c.latent_dim, _act_dtype(pb), step == "strided", rng)
    width = 2 if step == "strided" else 1
    indices = torch.randint(-1, c.num_pages * c.page_size, (pb.total_rows, 64 * width), generator=rng,
                            dtype=torch.int32)[:, ::width]
    kw = {"mla_v_dim": RANK}
    if step == "strided":
        kw["topk_lengths"] = _column(torch.randint(0, 65, (pb.total_rows,), generator=rng, dtype=torch.int32))
    return cute_kv.sparse_mla_attention, (q, pb.input_row_offsets, c, 1, indices), kw


def _gather_kv(pb, step, rng):
    return cute_kv.gather_kv, (pb.collection, 1), {}


OPS = {"store_kv": _store_kv, "fused_qkv": _fused_qkv, "paged_attention": _paged_attention,
       "sparse_mla_attention": _sparse_mla, "gather_kv": _gather_kv}


def _case_list():
    for op in OPS:
        for kind in CACHES:
            if op == "sparse_mla_attention" and kind not in MLA:
                continue
            for step in STEPS:
                for arch in ARCHS:
                    yield pytest.param(op, kind, step, arch, id=f"{op}-{kind}-{step}-{arch}")


CASES = list(_case_list())


# Kernel parameters that carry an op's tensor, by the op's name for it, where the two names differ (quack's GEMMs
# and the SM100 W4 kernel take the epilogue's tensors by position); any other parameter named as one of the op's
# tensors carries that tensor.
_EPILOGUE = (None, "blocks", "input_row_offsets", "cache_lengths", "lookup_table", None, "bias", None, None, None,
             "scales", None, None, "value_blocks")
ROLES = {f"{group}[{i}]": role for group in ("epilogue_args", "epi") for i, role in enumerate(_EPILOGUE) if role}
ROLES_BY_KERNEL = {"FusedQKVGemmSm90": {"mA": "hidden"}, "FusedQKVGemmSm100": {"mA": "hidden"},
                   "FusedQKVGemmW4Sm90": {"mB": "hidden"}}


def _sources(pb, op: str, args: tuple, kwargs: dict) -> dict:
    """The op's tensors a kernel parameter may carry, by role: the cache and its metadata, the activations, the
    optional operands."""
    c = pb.collection
    # a strided kernel's blocks: the K plane
    sources = {"blocks": c.blocks if c.is_compact else c.key_blocks, "key_blocks": c.key_blocks,
               "value_blocks": c.value_blocks,
               # the MHA attention kernels' sources: blocks twice, or (strided) the K and V planes
               "k_src": c.blocks if c.is_compact else c.key_blocks,
               "v_src": c.blocks if c.is_compact else c.value_blocks,
               "cache_lengths": c.cache_lengths, "lookup_table": c.lookup_table,
               "scales": c.scales, "input_row_offsets": pb.input_row_offsets,
               **{k: kwargs.get(k) for k in ("sinks", "bias", "topk_lengths")}}
    if op == "store_kv":
        sources.update(k=args[0], v=args[1])
    elif op == "fused_qkv":
        sources["hidden"] = args[0]
    elif op == "gather_kv":
        sources["plane"] = c.plane(("k", "v").index(kwargs.get("kv", "k")))  # the strided variant's: the plane it reads
    elif op in ("paged_attention", "sparse_mla_attention"):
        sources["q"] = args[0]
    if op == "sparse_mla_attention":
        sources["indices"] = args[4]
    return {role: x for role, x in sources.items() if x is not None}


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _check_sources(launches, sources: dict) -> None:
    """Each kernel parameter that carries one of the op's tensors holds it (or a copy of it: equal shape and bits),
    so an argument order that swaps two tensors the spec cannot tell apart (``k`` and ``v``, ``q`` and ``out``)
    fails."""
    for launch in launches:
        for name, value in launch.values.items():
            role = ROLES_BY_KERNEL.get(launch.kernel, {}).get(name, ROLES.get(name, name))
            if isinstance(value, torch.Tensor) and role in sources:
                want = sources[role]
                assert value.shape == want.shape and torch.equal(_bits(value), _bits(want)), \
                    f"{launch.kernel}.{name} does not hold the op's {role}"


def _run(arch, fn, args, kwargs):
    """``fn(*args, **kwargs)`` on a CUDA GPU of ``arch`` (as seen by the routing): ``(launches, fallbacks)``."""
    with as_cuda(arch) as launches, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(*args, **kwargs)
    return launches, [w for w in caught if issubclass(w.category, cute_kv.FallbackWarning)]


def _check_launches(path, launches, fallbacks, num_rows: int) -> None:
    if path.path == paths.REFERENCE:
        assert fallbacks and not launches, (path, launches.kernels)
        return
    assert not fallbacks, [str(w.message) for w in fallbacks]
    assert bool(launches) == (num_rows > 0), (path, launches.kernels)
    for i, launch in enumerate(launches):
        splits = launch.values.get("num_splits", 1)
        if launch.kernel != "AttentionCombine" and splits > 1:  # the combine of these splits follows
            combine = launches[i + 1]
            assert combine.kernel == "AttentionCombine" and combine.values["num_splits"] == splits


@pytest.mark.parametrize("op, kind, step, arch", CASES)
def test_launch_contract(op, kind, step, arch, rng):
    pb = _batch(kind, step)
    fn, args, kwargs = OPS[op](pb, step, rng)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows if op != "gather_kv" else pb.collection.max_cache_length)
    _check_sources(launches, _sources(pb, op, args, kwargs))


@pytest.mark.parametrize("arch, head_dim", [("sm_90a", 80), ("sm_100a", 96), ("sm_90a", 192), ("sm_90a", 256)])
def test_paged_attention_head_dim_launch_contract(arch, head_dim, rng):
    """A head dim off the powers of two on each arch (a 32- or 64-byte swizzle), and SM90's 112- and 80-key tiles
    (head dims 192, 256) over 32-row pages (slots of 16 rows), on a split decode step: the kernel and the combine of
    its splits (whose rows of ``head_dim / 4`` threads leave a CTA's last threads idle) launch with what their
    entries accept."""
    cached, new = STEPS["decode-split"]
    pb = random_paged_batch(cached, new, num_heads=2, head_size=head_dim, page_size=32, dtype=torch.bfloat16,
                            generator=torch.Generator().manual_seed(0))
    fn, args, kwargs = _paged_attention(pb, "decode-split", rng)
    del kwargs["window"]  # every key: the 700-key request splits
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    assert "AttentionCombine" in launches.kernels
    _check_sources(launches, _sources(pb, "paged_attention", args, kwargs))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["bf16", "fp8-f32", "fp8-e8m0", "mla-bf16", "rope-aware"])
@pytest.mark.parametrize("weight_kind", ["int4", "fp8"])
@pytest.mark.parametrize("step", ["decode-split", "ragged", "strided"])
def test_quantized_weight_launch_contract(weight_kind, kind, step, arch, rng):
    """``FusedQKVGemmW4`` (SM90) and ``FusedQKVGemmW4Sm100`` (split-K on decode steps) launch with what their entry
    takes."""
    pb = _batch(kind, step)
    fn, args, kwargs = _fused_qkv(pb, step, rng, weight_kind)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.kernel == {"sm_90a": "FusedQKVGemmW4", "sm_100a": "FusedQKVGemmW4Sm100"}[generation(arch)], path
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    _check_sources(launches, _sources(pb, "fused_qkv", args, kwargs))
    if is_blackwell(arch) and step == "decode-split":  # 2 tokens leave most of the SMs idle: split-K
        assert launches[0].values["splits"] > 1


@pytest.mark.parametrize("weight_kind", ["int4", "fp8"])
def test_quantized_weight_launch_contract_on_b300(weight_kind, rng):
    """B300 runs the SM100 W4 kernel, split-K on a decode step as on a B200."""
    test_quantized_weight_launch_contract(weight_kind, "bf16", "decode-split", "sm_103a", rng)


def _mla_prefill_args(pb, step, rng, heads=MLA_HQ):
    c = pb.collection
    t = pb.total_rows
    q = torch.randn(t, heads, NOPE + ROPE + (64 if step == "strided" else 0), generator=rng).to(torch.bfloat16)
    w_uk = torch.randn(heads, NOPE, RANK, generator=rng).to(torch.bfloat16) / 23
    w_uv = torch.randn(heads, V_DIM, RANK, generator=rng).to(torch.bfloat16) / 23
    return q[..., :NOPE], q[..., NOPE:NOPE + ROPE], pb.input_row_offsets, c, 1, w_uk, w_uv


def _mla_prefill_kwargs(pb, step):
    """A strided ``out`` (heads not packed) for the strided and prefill steps."""
    if step not in ("strided", "prefill"):
        return {}
    return {"out": torch.empty(pb.total_rows, MLA_HQ, V_DIM + 8, dtype=torch.bfloat16)[..., 8:]}


ROUTES = {"decode-split": "absorbed", "prefill": "decompressed"}


@pytest.mark.parametrize("arch", (*ARCHS, "sm_103a"))
@pytest.mark.parametrize("kind", MLA)
@pytest.mark.parametrize("step", STEPS)
def test_mla_prefill_launch_contract(step, kind, arch, rng):
    """Both routes: the decompressed one (a long fresh prompt; SM100 launches its own ``PagedAttentionSm100``, SM90
    ``paged_attention`` over the temporary cache) and the absorbed one (one token over a long context: the MLA
    decode kernels)."""
    pb = _batch(kind, step)
    args = _mla_prefill_args(pb, step, rng)
    route = mla_prefill_op.plan(mla_prefill_op.step_lengths(pb.input_row_offsets, pb.collection.cache_lengths),
                                num_heads=MLA_HQ, kv_lora_rank=RANK, rope_dim=ROPE, nope_dim=NOPE, v_dim=V_DIM,
                                dtype="bfloat16", arch=arch)
    assert route.path == ROUTES.get(step, route.path)
    launches, fallbacks = _run(arch, cute_kv.mla_prefill, args, _mla_prefill_kwargs(pb, step))
    want = {"absorbed": {"sm_90a": "MLADecode", "sm_100a": "MlaDecodeSm100"},
            "decompressed": {"sm_90a": "PagedAttention", "sm_100a": "PagedAttentionSm100"}}[route.path][generation(arch)]
    _check_launches(paths.kernel(mla_prefill_op.OP, want, (), arch), launches, fallbacks, pb.total_rows)
    # q, the cache and its lookup table are the route's own (decompressed: a temporary cache)
    _check_sources(launches, {"input_row_offsets": pb.input_row_offsets, "cache_lengths": pb.collection.cache_lengths})
    assert launches.kernels[:1] == ([want] if pb.total_rows else [])


def test_the_matrix_reaches_every_kernel():
    """The cases above plan every kernel of both archs (a case that fell back everywhere would test nothing)."""
    rng = torch.Generator().manual_seed(0)
    planned = {arch: set() for arch in ARCHS}
    for op, kind, step, arch in (p.values for p in CASES):
        pb = _batch(kind, step)
        fn, args, kwargs = OPS[op](pb, step, rng)
        path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
        if path.path == paths.KERNEL:
            planned[arch].add(path.kernel)
    assert planned["sm_90a"] >= {"PagedKVStore", "RopeAwareKVStore", "PagedKVGather", "FusedQKVGemm",
                                 "PagedAttention", "MLADecode"}
    assert planned["sm_100a"] >= {"PagedKVStore", "RopeAwareKVStore", "PagedKVGather", "FusedQKVGemm",
                                  "PagedAttentionSm100", "MlaDecodeSm100"}


# -- defects the contracts found --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["store_kv", "gather_kv", "fused_qkv"])
@pytest.mark.parametrize("kind, layout", [("bf16", "vllm"), ("bf16", "flashinfer-hnd"), ("fp8-f32", "separate"),
                                          ("fp8-f32", "strided-6d"), ("mla-bf16", "strided-6d"),
                                          ("bf16", "flashinfer-nhd")])
def test_strided_cache_launch_contract(op, kind, layout, arch, rng):
    """Engine layouts: the strided store, gather and fused QKV kernels take the planes (FlashInfer NHD is MAX's
    compact layout and keeps the compact kernels); what no kernel serves takes the reference, warned."""
    pb, layer = with_layout(_batch(kind, "ragged"), layout, 1)
    fn, args, kwargs = OPS[op](pb, "ragged", rng)
    args = (*args[:-1], layer)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    if op != "gather_kv" or kind == "bf16":
        strided = path.key.strided if op == "fused_qkv" else path.key[-1] == "strided"
        assert path.path == paths.KERNEL and strided == (layout != "flashinfer-nhd")
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows if op != "gather_kv" else pb.collection.max_cache_length)
    _check_sources(launches, _sources(pb, op, args, kwargs))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op", ["store_kv", "paged_attention"])
@pytest.mark.parametrize("layout", ["compact", "vllm", "flashinfer-hnd", "separate"])
@pytest.mark.parametrize("step", ["decode-split", "ragged", "empty", "strided"])
def test_tensor_scaled_fp8_launch_contract(step, layout, op, arch, rng):
    """fp8 caches scaled per tensor (``k_scale`` a device tensor as vLLM keeps it, ``v_scale`` a float as FlashInfer
    takes it), in MAX's layout and in engines' layouts in place: the store and attention kernels launch with the
    pair as the float32 ``[2]`` their entries take, and nothing in MAX's scale layout."""
    pb, layer = _batch("fp8", step), 1
    if layout != "compact":
        pb, layer = with_layout(pb, layout, layer)
    fn, args, kwargs = OPS[op](pb, step, rng)
    args = (*args[:-1], layer)
    kwargs.update(k_scale=torch.tensor(0.75), v_scale=1.5)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL and path.key[-1] is True, path
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    _check_sources(launches, {**_sources(pb, op, args, kwargs), "scales": torch.tensor([0.75, 1.5])})
    assert all("scales" in launch.values for launch in launches if launch.kernel != "AttentionCombine")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["bf16", "mla-bf16"])
@pytest.mark.parametrize("step", ["decode-split", "ragged", "empty"])
@pytest.mark.parametrize("layout", ["TH", "HT"])
def test_lse_layout_launch_contract(layout, step, kind, arch, rng):
    """An ``[Hq, T]`` LSE, or an ``lse=`` buffer that is a column slice of a wider one: the attention kernels (and
    the split-KV combine) still get a row-major ``[T, Hq]`` their entries take."""
    pb = _batch(kind, step)
    fn, args, kwargs = _paged_attention(pb, step, rng)
    t, hq = args[0].shape[:2]
    rows, cols = (t, hq) if layout == "TH" else (hq, t)
    kwargs.update(return_lse=True, lse_layout=layout, lse=torch.empty(rows, cols + 1)[:, 1:])
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL, path
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    # (SM100's split attention writes its splits' LSEs only, and a placeholder of another shape for the call's)
    written = [x for x in (launch.values.get("lse") for launch in launches) if x is not None and x.shape == (t, hq)]
    assert bool(written) == (t > 0) and all(x.stride() == (hq, 1) for x in written)


@pytest.mark.parametrize("arch", ARCHS)
def test_strided_gather_of_v_reads_the_v_plane(arch, rng):
    """The strided gather takes one plane: for ``kv="v"`` the V plane, not the K plane beside it."""
    pb, layer = with_layout(_batch("bf16", "ragged"), "vllm", 1)
    args, kwargs = (pb.collection, layer), {"kv": "v"}
    path = cute_kv.explain(cute_kv.gather_kv, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL and path.key[-1] == "strided"
    launches, fallbacks = _run(arch, cute_kv.gather_kv, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.collection.max_cache_length)
    _check_sources(launches, _sources(pb, "gather_kv", args, kwargs))
    """A lookup table whose base is 4 bytes past a 16-byte boundary (columns 1.. of a wider table) reaches
    ``PagedKVGather``, which reads one entry per CTA: compiled for any 4-byte aligned table."""
    pb = _batch("bf16", "ragged")
    c = pb.collection
    wide = torch.zeros((c.batch_size, c.lookup_table.shape[1] + 8), dtype=torch.int32)
    wide[:, 1:c.lookup_table.shape[1] + 1] = c.lookup_table.view(torch.int32)
    c = c.with_metadata(c.cache_lengths, wide[:, 1:c.lookup_table.shape[1] + 1], c.max_seq_length,
                        c.max_cache_length)
    assert c.lookup_table.data_ptr() % 16 == 4
    assert cute_kv.explain(cute_kv.gather_kv, c, 1, arch=arch).kernel == "PagedKVGather"
    launches, fallbacks = _run(arch, cute_kv.gather_kv, (c, 1), {})
    assert launches.kernels == ["PagedKVGather"] and not fallbacks


@pytest.mark.parametrize("arch", ARCHS)
def test_gather_kv_of_an_empty_cache_launches_nothing(arch):
    """``max_cache_length == 0``: no page column to copy (a grid of 0 CTAs would be a launch error); the zeros of a
    new ``out`` are the answer."""
    pb = random_paged_batch([0, 0], [0, 0], num_heads=2, head_size=128, page_size=32,
                            generator=torch.Generator().manual_seed(0))
    c = pb.collection
    assert c.max_cache_length == 0 and cute_kv.explain(cute_kv.gather_kv, c, 0, arch=arch).path == paths.KERNEL
    with as_cuda(arch) as launches:
        out = cute_kv.gather_kv(c, 0)
    assert not launches and out.shape == (2, 0, 2, 128)


def test_mla_v_dim_whose_rows_do_not_tile_the_combine_cta(rng):
    """``MLADecode`` at ``mla_v_dim`` 384 splits a decode step and the combine merges it (a row's 96 threads: one row
    a CTA, its last 32 threads idle), as at the widths whose rows tile its 128 threads."""
    pb = _batch("mla-bf16", "decode-split")
    q = torch.randn(pb.total_rows, MLA_HQ, RANK + ROPE, generator=rng).to(torch.bfloat16)
    args = (q, pb.input_row_offsets, pb.collection, 1)
    for v_dim in (128, 256, 384, 512):
        launches, fallbacks = _run("sm_90a", cute_kv.paged_attention, args, {"mla_v_dim": v_dim})
        assert not fallbacks and launches.kernels == ["MLADecode", "AttentionCombine"]
        _check_launches(cute_kv.explain(cute_kv.paged_attention, *args, arch="sm_90a", mla_v_dim=v_dim), launches,
                        fallbacks, pb.total_rows)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("op, kind", [("store_kv", "bf16"), ("fused_qkv", "fp8-f32"), ("paged_attention", "bf16"),
                                      ("paged_attention", "mla-bf16"), ("gather_kv", "fp16")])
def test_strided_cache_lengths_are_made_compact(op, kind, arch, rng):
    """``cache_lengths`` as a column of a ``[B, 2]`` tensor passes the collection and every plan; every kernel is
    compiled for a compact one, so the launcher hands it a compact copy (as it does ``input_row_offsets``)."""
    pb = _batch(kind, "ragged")
    c = pb.collection
    lengths = torch.stack([c.cache_lengths.view(torch.int32)] * 2, 1)[:, 1]
    pb.collection = c.with_metadata(lengths, c.lookup_table, c.max_seq_length, c.max_cache_length)
    fn, args, kwargs = OPS[op](pb, "ragged", rng)
    assert cute_kv.explain(fn, *args, arch=arch, **kwargs).path == paths.KERNEL
    launches, fallbacks = _run(arch, fn, args, kwargs)
    assert launches and not fallbacks


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same view: address, shape and strides."""
    return (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("step", ["decode-split", "ragged"])
@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_attention_over_other_layouts_launch_contract(layout, step, arch, rng):
    """``paged_attention`` over another engine's cache (``reference.batch.with_layout``) launches the MHA kernel's
    strided variant with the K and V planes themselves, split-KV and its combine included; FlashInfer's NHD of one
    layer is MAX's layout, so the compact kernel reads its ``blocks``."""
    pb, layer = with_layout(_batch("bf16", step), layout, 1)
    c = pb.collection
    fn, (q, offsets, _, _), kwargs = _paged_attention(pb, step, rng)
    kwargs.pop("window", None)  # decode over the whole contexts: split-KV
    args = (q, offsets, c, layer)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL and (path.key[-1] == "strided") == (not c.is_compact), path
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    attention = launches[0]
    assert attention.key == path.key and (launches.kernels[-1] == "AttentionCombine") == (step == "decode-split")
    k, v = (c.blocks, c.blocks) if c.is_compact else (c.key_blocks, c.value_blocks)
    assert _same(attention.values["k_src"], k) and _same(attention.values["v_src"], v)


def test_gather4_pages_of_other_layouts(rng):
    """SM100 reads pages of 4 rows by gather4, whose 2-D view takes a token's heads as one row: vLLM's planes launch
    the strided gather4 variant; FlashInfer HND's heads are ``P*D`` apart, so its plan takes the reference and says
    why, and the kernel's entry refuses its planes."""
    pb = random_paged_batch([37, 5], [3, 1], num_heads=2, head_size=128, page_size=4,
                            generator=torch.Generator().manual_seed(0))
    q = torch.randn(pb.total_rows, HQ, 128, generator=rng).to(torch.bfloat16)
    vllm, hnd = (with_layout(pb, layout, 1)[0].collection for layout in ("vllm", "flashinfer-hnd"))
    launches, fallbacks = _run("sm_100a", cute_kv.paged_attention, (q, pb.input_row_offsets, vllm, 0), {})
    assert launches.kernels == ["PagedAttentionSm100"] and not fallbacks and launches[0].key[-1] == "strided"
    path = cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, hnd, 0, arch="sm_100a")
    assert path.path == paths.REFERENCE and "take gather4" in path.reason and "HND" in path.reason
    hnd_launches, fallbacks = _run("sm_100a", cute_kv.paged_attention, (q, pb.input_row_offsets, hnd, 0), {})
    assert not hnd_launches and fallbacks
    launch = launches[0]
    contract = Contract(dict(paged_attention_sm100.compile_units(launch.key, "sm_100a"))[launch.key])
    contract.check(**launch.values)
    with pytest.raises(ContractError, match=r"k_src\.strides\[3\] is 512, expected 128"):
        contract.check(**{**launch.values, "k_src": hnd.key_blocks, "v_src": hnd.value_blocks})


@pytest.mark.parametrize("op, kind, step", sorted({(op, kind, step) for op, kind, step, arch in (p.values for p in CASES)
                                                    if arch == "sm_100a"}))
def test_b300_runs_the_blackwell_kernels(op, kind, step, rng):
    """A B300 (sm_103) takes the B200's path, kernel and compile key, compiled for ``sm_103a`` (an ``sm_100a``
    cubin does not run there), and launches it with what its entry takes."""
    pb = _batch(kind, step)
    fn, args, kwargs = OPS[op](pb, step, rng)
    b200, b300 = (cute_kv.explain(fn, *args, arch=arch, **kwargs) for arch in ("sm_100a", "sm_103a"))
    assert (b300.path, b300.kernel, b300.key) == (b200.path, b200.kernel, b200.key)
    launches, fallbacks = _run("sm_103a", fn, args, kwargs)
    _check_launches(b300, launches, fallbacks, pb.total_rows if op != "gather_kv" else pb.collection.max_cache_length)
    assert {launch.arch for launch in launches} <= {"sm_103a"}


@pytest.mark.parametrize("arch", ["sm_80a", "sm_120a"])
def test_other_cuda_archs_run_the_reference_with_a_warning(arch, rng):
    """A100, RTX 50xx (sm_120): no kernel is compiled for them, so every op runs the reference and says so once
    (``FallbackWarning``), as on any CUDA call no kernel serves; ``explain`` gives the same answer."""
    for op in OPS:
        paths._warned.clear()
        pb = _batch("mla-bf16" if op == "sparse_mla_attention" else "bf16", "ragged")
        fn, args, kwargs = OPS[op](pb, "ragged", rng)
        with as_cuda(arch):
            path = cute_kv.explain(fn, *args, **kwargs)  # the device's arch
        assert path.path == paths.REFERENCE and f"no cute-kv kernel targets {arch}" in path.reason
        launches, fallbacks = _run(arch, fn, args, kwargs)
        assert not launches and len(fallbacks) == 1 and path.reason in str(fallbacks[0].message), op
    args = _mla_prefill_args(_batch("mla-bf16", "prefill"), "prefill", rng)
    launches, fallbacks = _run(arch, cute_kv.mla_prefill, args, {})
    assert not launches and fallbacks


# -- negative controls: what the contract rejects ---------------------------------------------------------------------

def _store_contract():
    from cute_kv.ops import store_kv

    pb = _batch("bf16", "ragged")
    c = pb.collection
    k = torch.randn(pb.total_rows, 2, 128).to(torch.bfloat16)
    path = store_kv.plan(c, k, "sm_90a")
    contract = Contract(store_kv.compile_unit(path.key, "sm_90a")[1])
    args = dict(k=k, v=k.clone(), input_row_offsets=pb.input_row_offsets, blocks=c.blocks, scales=None,
                cache_lengths=c.cache_lengths, lookup_table=c.lookup_table, layer_idx=1)
    contract.check(**args)  # the call the launcher makes passes
    return contract, args


def _misaligned(x: torch.Tensor) -> torch.Tensor:
    """``x``'s values at a base 2 bytes past its alignment."""
    flat = torch.empty(x.numel() + 1, dtype=x.dtype)[1:]
    return flat.view(x.shape).copy_(x)


@pytest.mark.parametrize("inject, message", [
    (lambda a: {**a, "k": a["k"].half()}, "k is float16, expected bfloat16"),
    (lambda a: {**a, "cache_lengths": torch.stack([a["cache_lengths"]] * 2, 1)[:, 0]},
     "cache_lengths.strides[0] is 2, expected 1"),
    (lambda a: {**a, "k": _misaligned(a["k"])}, "k's data is 2 bytes past a 16-byte boundary"),
    (lambda a: {**a, "v": a["v"][:-1]}, "v.shape[0] is 8, expected to match k.shape[0] = 9"),
    (lambda a: {**a, "lookup_table": a["lookup_table"][:-1]},
     "lookup_table.shape[0] is 3, expected to match cache_lengths.shape[0] = 4"),
    (lambda a: {**a, "layer_idx": 2**31}, "layer_idx = 2147483648 is outside int32's"),
    (lambda a: {**a, "k": a["k"][:0], "v": a["v"][:0]}, "grid dimension from k.shape[0] is 0"),
    (lambda a: {**a, "k": a["k"][..., :64]}, "k.shape[2] is 64, expected 128"),
    (lambda a: {**a, "k": torch.empty(9, 260, dtype=torch.bfloat16)[:, :256].unflatten(1, (2, 128))},
     "k.strides[0] = 260 is not a multiple of 8"),
    (lambda a: {**a, "scales": torch.ones(1)}, "scales is Tensor, compiled as None"),
    (lambda a: {**a, "v": None}, "v is NoneType, expected Tensor"),
    (lambda a: {**a, "blocks": a["blocks"][0]}, "blocks has 5 dims, expected 6"),
    (lambda a: {**a, "layer_idx": 1.0}, "layer_idx is float, expected int"),
    (lambda a: {k: v for k, v in a.items() if k != "layer_idx"}, "missing a required argument: 'layer_idx'"),
    (lambda a: {**a, "stream": 0}, "unexpected keyword argument 'stream'"),
], ids=["dtype", "strided", "misaligned", "shared-dim", "shared-dim-2", "int32", "grid", "static-shape",
        "divisibility", "not-none", "none", "rank", "int-kind", "arity", "extra"])
def test_contract_rejects_injected_mismatches(inject, message):
    contract, args = _store_contract()
    with pytest.raises(ContractError, match=re.escape(message)):
        contract.check(**inject(args))


def test_contract_rejects_a_tensor_made_on_the_host():
    """Inside ``as_cuda`` the CPU stands for the GPU, so a tensor made without naming a device (or computed from one)
    is what a launch would find on the host; naming the call's device makes it the device's."""
    contract, args = _store_contract()
    with as_cuda("sm_90a"):
        host = torch.tensor(args["cache_lengths"].view(torch.int32).tolist(), dtype=torch.int32).view(torch.uint32)
        with pytest.raises(ContractError, match=re.escape("PagedKVStore: cache_lengths was made on the host")):
            contract.check(**{**args, "cache_lengths": host})
        contract.check(**{**args, "cache_lengths": host.to(args["k"].device)})


def test_contract_catches_a_launcher_that_allocates_on_the_host(rng, monkeypatch):
    """End to end: split-KV partials allocated without ``device=`` are CPU tensors on a GPU, and the op fails on the
    contract."""
    from cute_kv.ops import splits

    pb = _batch("mla-bf16", "decode-split")
    fn, args, kwargs = _paged_attention(pb, "decode-split", rng)
    assert _run("sm_90a", fn, args, kwargs)[0].kernels == ["MLADecode", "AttentionCombine"]

    def partials(splits, t, num_q_heads, head_dim, device):  # device forgotten
        return (torch.empty((splits, t, num_q_heads, head_dim), dtype=torch.float32),
                torch.empty((splits, t, num_q_heads), dtype=torch.float32))

    monkeypatch.setattr(splits, "partials", partials)
    with pytest.raises(ContractError, match=re.escape("MLADecode: o_part was made on the host")):
        _run("sm_90a", fn, args, kwargs)


def test_sources_catch_a_launcher_that_passes_another_tensor(rng, monkeypatch):
    """A kernel parameter named for one of the op's tensors must hold it: a q the contract cannot tell from the op's
    (same shape, dtype and strides, here a fresh one) fails the source check."""
    from cute_kv.ops import splits

    pb = _batch("bf16", "ragged")
    fn, args, kwargs = _paged_attention(pb, "ragged", rng)
    launches, _ = _run("sm_100a", fn, args, kwargs)
    _check_sources(launches, _sources(pb, "paged_attention", args, kwargs))
    monkeypatch.setattr(splits, "packed_heads", lambda x, vec: torch.zeros_like(x))
    launches, _ = _run("sm_100a", fn, args, kwargs)
    with pytest.raises(AssertionError, match=re.escape("PagedAttentionSm100.q does not hold the op's q")):
        _check_sources(launches, _sources(pb, "paged_attention", args, kwargs))


@pytest.mark.parametrize("page_size", [1, 8])
def test_gathered_pages_launch(page_size, rng):
    """SM90 over pages of 1 and 8 rows (K/V gathered by cp.async): a ragged step and a split decode launch
    ``PagedAttention`` (and its combine) with arguments its entry accepts, each parameter holding its op tensor."""
    for step in ("ragged", "decode-split"):
        cached, new = STEPS[step]
        pb = random_paged_batch(cached, new, page_size=page_size, num_heads=2, head_size=128, dtype=torch.bfloat16,
                                generator=torch.Generator().manual_seed(page_size))
        fn, args, kwargs = _paged_attention(pb, step, rng)
        launches, fallbacks = _run("sm_90a", fn, args, kwargs)
        assert not fallbacks, [str(w.message) for w in fallbacks]
        assert launches.kernels[0] == "PagedAttention", launches.kernels
        _check_sources(launches, _sources(pb, "paged_attention", args, kwargs))


def test_gather_kv_of_more_requests_than_the_grid_takes_the_reference(rng):
    """``PagedKVGather`` takes a request per z index of its grid, at most 65535: more requests plan the reference
    (with the fallback warning) instead of a launch the GPU rejects."""
    pb = _batch("bf16", "ragged")
    c = pb.collection
    many = 65536
    lengths = torch.zeros(many, dtype=torch.int32)
    lengths[:c.batch_size] = c.cache_lengths.view(torch.int32)
    lut = torch.full((many, c.lookup_table.shape[1]), c.num_pages, dtype=torch.int32)
    lut[:c.batch_size] = c.lookup_table.view(torch.int32)
    c = c.with_metadata(lengths, lut, c.max_seq_length, c.max_cache_length)
    for arch in ARCHS:
        paths._warned.clear()
        path = cute_kv.explain(cute_kv.gather_kv, c, 1, arch=arch)
        assert path.path == paths.REFERENCE and "65536 requests exceed the kernel's grid" in path.reason
        launches, fallbacks = _run(arch, cute_kv.gather_kv, (c, 1), {})
        assert not launches and fallbacks
    key = cute_kv.explain(cute_kv.gather_kv, pb.collection, 1, arch="sm_90a").key
    contract = Contract(lambda: gather_kv_op._build(key))
    out = torch.zeros((many, c.max_cache_length, c.num_heads, c.head_size), dtype=c.dtype)
    with pytest.raises(ContractError, match=re.escape("grid dimension z from cache_lengths.shape[0] is 65536")):
        contract.check(c.blocks, c.cache_lengths, c.lookup_table, out, 0, 1, 1)


WIDE_HQ = 128  # DeepSeek's MLA heads; over the 2 KV heads of the MHA caches, GQA groups of 64
# Each attention kernel family with a kernel on the arch (sparse MLA: SM100 only), by op, cache kind and arch.
ATTENTION_FAMILIES = [(op, kind, arch) for op, kinds in (("paged_attention", ("bf16", *MLA)),
                                                         ("sparse_mla_attention", MLA), ("mla_prefill", MLA))
                      for kind in kinds for arch in ARCHS if op != "sparse_mla_attention" or arch == "sm_100a"]


def _wide_call(op, pb, collection, rng):
    """``op``'s call with ``WIDE_HQ`` query heads over ``collection`` (``pb``'s cache and step)."""
    if op == "mla_prefill":
        q_nope, q_rope, ro, _, layer, w_uk, w_uv = _mla_prefill_args(pb, "decode-split", rng, WIDE_HQ)
        return cute_kv.mla_prefill, (q_nope, q_rope, ro, collection, layer, w_uk, w_uv), {}
    c = collection
    q = torch.randn(pb.total_rows, WIDE_HQ, c.latent_dim, generator=rng).to(_act_dtype(pb))
    kw = {"mla_v_dim": RANK} if c.is_mla else {}
    if op == "sparse_mla_attention":
        indices = torch.randint(-1, c.num_pages * c.page_size, (pb.total_rows, 64), generator=rng,
                                dtype=torch.int32)
        return cute_kv.sparse_mla_attention, (q, pb.input_row_offsets, c, 1, indices), kw
    return cute_kv.paged_attention, (q, pb.input_row_offsets, c, 1), kw


@pytest.mark.parametrize("op, kind, arch", ATTENTION_FAMILIES)
def test_loose_max_seq_length_launches_the_steps_grid(op, kind, arch):
    """A valid but loose ``max_seq_length`` (2^32 - 1) on a 2-token decode step of 128 query heads launches what
    ``max_seq_length = T`` launches: sized by the bound, the query blocks were 8,589,934,590 (SM90 MLA),
    4,294,967,295 (SM100 MLA) or 2^31 (MHA, groups of 64), past int32 and CUDA's grid."""
    pb = _batch(kind, "decode-split")
    c = pb.collection
    runs = []
    for max_seq_length in (2**32 - 1, pb.total_rows):
        coll = c.with_metadata(c.cache_lengths, c.lookup_table, max_seq_length, c.max_cache_length)
        launches, fallbacks = _run(arch, *_wide_call(op, pb, coll, torch.Generator().manual_seed(0)))
        assert not fallbacks, [str(w.message) for w in fallbacks]
        runs.append([(launch.kernel, launch.values.get("m_blocks"), launch.values.get("num_splits"))
                     for launch in launches])
    assert runs[0] and runs[0] == runs[1], runs


def test_contract_checks_the_grids_y_dimension(rng, monkeypatch):
    """The attention grid's y dimension is KV heads x splits, at most 65535: a split count past it fails the
    contract (2 KV heads x 32768 splits)."""
    from cute_kv.ops import splits

    pb = _batch("bf16", "decode-split")
    fn, args, kwargs = _paged_attention(pb, "decode-split", rng)
    monkeypatch.setattr(splits, "num_splits", lambda ctas, key_tiles, slots, limit: 32768)
    with pytest.raises(ContractError, match=re.escape(
            "PagedAttention: grid dimension y from self.num_kv_heads x num_splits is 65536, past CUDA's 65535")):
        _run("sm_90a", fn, args, kwargs)


def test_contract_catches_a_launcher_that_skips_its_preparation(rng, monkeypatch):
    """End to end: a launcher that stopped packing q's heads hands a strided q to a kernel compiled for packed
    heads, and the op fails on the contract."""
    from cute_kv.ops import splits

    pb = _batch("bf16", "ragged")
    fn, args, kwargs = _paged_attention(pb, "strided", rng)
    launches, _ = _run("sm_90a", fn, args, kwargs)
    assert launches.kernels == ["PagedAttention"]
    monkeypatch.setattr(splits, "packed_heads", lambda x, vec: x)
    with pytest.raises(ContractError, match=re.escape("PagedAttention: q.strides[1] is 136, expected 128")):
        _run("sm_90a", fn, args, kwargs)



def test_cuda_only_coverage_measures_the_tests_it_runs():
    """``tests/cuda_only_coverage.py`` runs its tests in its own process: the suite's ``-n auto`` would hand them to
    xdist workers, whose lines it cannot see (every count 0)."""
    here = Path(__file__)
    run = subprocess.run([sys.executable, str(here.with_name("cuda_only_coverage.py")), str(here), "-q",
                          "-p", "no:cacheprovider", "-k", "gather_kv-bf16-ragged-sm_90a"],
                         capture_output=True, text=True, timeout=600)
    rows = {m: (int(n), int(e)) for m, n, e in re.findall(r"^(\w+\.py) +(\d+) +(\d+)$", run.stdout, re.M)}
    lines, executed = rows.get("gather_kv.py", (0, 0))
    assert lines and executed == lines, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["separate", "vllm"])
def test_one_token_pages_of_other_layouts_launch_contract(layout, arch, rng):
    """SGLang's token pools (separate K and V, one token a page): SM90 gathers the rows by cp.async from the planes'
    strides, SM100 by gather4; each launches its strided variant with what its entry takes."""
    cached, new = STEPS["ragged"]
    pb = random_paged_batch(cached, new, page_size=1, num_heads=2, head_size=128, dtype=torch.bfloat16,
                            generator=torch.Generator().manual_seed(0))
    pb, layer = with_layout(pb, layout, 1)
    fn, (q, offsets, _, _), kwargs = _paged_attention(pb, "ragged", rng)
    args = (q, offsets, pb.collection, layer)
    path = cute_kv.explain(fn, *args, arch=arch, **kwargs)
    assert path.path == paths.KERNEL and path.key[-1] == "strided", path
    launches, fallbacks = _run(arch, fn, args, kwargs)
    _check_launches(path, launches, fallbacks, pb.total_rows)
    assert _same(launches[0].values["k_src"], pb.collection.key_blocks)
