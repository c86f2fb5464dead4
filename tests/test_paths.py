"""Which path a call takes (``cute_kv.explain``), and reference fallbacks on CUDA: warned once per reason, an error
in strict mode. The decisions are host functions of the arguments and an arch, so a CPU machine asks them for any
arch; the fallback reporting is exercised by making CPU tensors look like a GPU of an arch without a kernel."""

import re
import warnings

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.ops import paths
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns

CACHED, NEW = [0, 37, 5, 9], [5, 1, 0, 3]
FP8 = torch.float8_e4m3fn


@pytest.fixture(autouse=True)
def fresh_reporting(monkeypatch):
    monkeypatch.delenv("CUTE_KV_STRICT", raising=False)
    monkeypatch.setattr(paths, "_warned", set())
    monkeypatch.setattr(paths, "_strict", None)


@pytest.fixture
def as_gpu(monkeypatch):
    """CPU tensors routed as if on a GPU of ``arch``: kernel paths must not be taken (nothing could launch)."""

    def use(arch):
        monkeypatch.setattr(paths, "device_arch", lambda device: arch)

    return use


def _batch(head_size=128, page_size=16, seed=0, **kw):
    kw = {"num_heads": 2, **kw}
    return random_paged_batch(CACHED, NEW, head_size=head_size, page_size=page_size,
                              generator=torch.Generator().manual_seed(seed), **kw)


def _q(pb, rng, heads=8):
    return torch.randn(pb.total_rows, heads, pb.collection.head_size, generator=rng).to(torch.bfloat16)


def _attention(pb, q, **kw):
    return cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, 1, **kw)


# -- explain ---------------------------------------------------------------------------------------------------------

def test_explain_attention_on_each_arch(rng):
    pb = _batch()
    q = _q(pb, rng)
    args = (q, pb.input_row_offsets, pb.collection, 1)
    on_cpu = cute_kv.explain(cute_kv.paged_attention, *args)
    assert (on_cpu.path, on_cpu.arch, on_cpu.kernel) == ("reference", None, None) and "cpu" in on_cpu.reason
    h100 = cute_kv.explain("paged_attention", *args, arch="sm_90a")
    assert (h100.op, h100.path, h100.kernel, h100.arch) == ("paged_attention", "kernel", "PagedAttention", "sm_90a")
    assert h100.key[:5] == ("paged_attention", "bfloat16", 8, 2, 128)
    b200 = cute_kv.explain(cute_kv.paged_attention, *args, arch="sm_100a")
    assert (b200.path, b200.kernel, b200.key[0]) == ("kernel", "PagedAttentionSm100", "paged_attention_sm100")
    d112 = _batch(head_size=112)
    args = (_q(d112, rng), d112.input_row_offsets, d112.collection, 1)
    assert cute_kv.explain(cute_kv.paged_attention, *args, arch="sm_100a").path == "reference"


def test_explain_gathered_pages_on_sm90(rng):
    """Pages of 1 and 8 rows (and 24, which does not tile the key tile) run ``PagedAttention`` on SM90 (rows gathered
    by cp.async), keyed without vector lookup reads whatever the table's alignment."""
    for page_size in (1, 8, 24):
        pb = _batch(page_size=page_size)
        path = cute_kv.explain("paged_attention", _q(pb, rng), pb.input_row_offsets, pb.collection, 1, arch="sm_90a")
        assert (path.path, path.kernel) == ("kernel", "PagedAttention") and path.key[5:8] == (page_size, 2, False)


@pytest.mark.parametrize("cache, word", [
    ({"head_size": 112}, "head_dim must be one of"),
    ({"num_heads": 1, "is_mla": True}, "MLA"),
    ({"page_size": 8, "dtype": FP8}, "other pages gather 16-bit rows only"),
])
def test_explain_names_why_the_reference_runs(rng, cache, word):
    pb = _batch(**cache)
    mla = {"mla_v_dim": 64} if pb.collection.is_mla else {}
    path = cute_kv.explain("paged_attention", _q(pb, rng), pb.input_row_offsets, pb.collection, 1, arch="sm_90a",
                           **mla)
    assert path.path == "reference" and word in path.reason


def test_explain_fused_qkv_and_store_kv(rng):
    for cache, arch, int4, want in [({}, "sm_90a", False, "FusedQKVGemm"), ({}, "sm_100a", False, "FusedQKVGemm"),
                                    ({"dtype": FP8, "scale_dtype": torch.float32}, "sm_100a", False, "FusedQKVGemm"),
                                    ({}, "sm_90a", True, "FusedQKVGemmW4"),
                                    ({}, "sm_100a", True, "FusedQKVGemmW4Sm100")]:
        pb = _batch(**cache)
        hidden = torch.randn(pb.total_rows, 64, generator=rng).to(torch.bfloat16)
        n = 128 + kv_columns(pb.collection)
        weight = torch.randn(n, 64, generator=rng).to(torch.bfloat16)
        if int4:
            weight = cute_kv.Int4Weight(torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=rng),
                                        torch.rand(n, 1, generator=rng).to(torch.bfloat16), 64)
        path = cute_kv.explain(cute_kv.fused_qkv_matmul_kv_cache, hidden, pb.input_row_offsets, weight,
                               pb.collection, 0, arch=arch)
        assert path.kernel == want, path
    pb = _batch()
    k = torch.randn(pb.total_rows, 2, 128, generator=rng).to(torch.bfloat16)
    for arch in ("sm_90a", "sm_100a"):  # one store kernel for both
        assert cute_kv.explain("store_kv", k, k, pb.input_row_offsets, pb.collection, 0, arch=arch).kernel == \
            "PagedKVStore"
    fp8_cast = _batch(dtype=FP8)
    path = cute_kv.explain("store_kv", k, k, fp8_cast.input_row_offsets, fp8_cast.collection, 0, arch="sm_90a")
    assert path.path == "reference" and "without scales" in path.reason
    assert cute_kv.explain("gather_kv", pb.collection, 0, kv="v", arch="sm_100a").kernel == "PagedKVGather"


def test_explain_checks_its_arguments(rng):
    pb = _batch()
    q = _q(pb, rng)
    with pytest.raises(ValueError, match="op must be one of"):
        cute_kv.explain("attention", q, pb.input_row_offsets, pb.collection, 1)
    with pytest.raises(ValueError, match="arch must be one of"):
        cute_kv.explain("paged_attention", q, pb.input_row_offsets, pb.collection, 1, arch="sm_80")
    with pytest.raises(ValueError, match="layer_idx"):  # the op's own checks
        cute_kv.explain("paged_attention", q, pb.input_row_offsets, pb.collection, 9, arch="sm_90a")


# -- fallback reporting ----------------------------------------------------------------------------------------------

def test_fallback_on_cuda_warns_once_per_reason(rng, as_gpu):
    as_gpu("sm_100a")
    pb = _batch(head_size=112)  # no kernel tiles head dim 112
    q = _q(pb, rng)
    with pytest.warns(cute_kv.FallbackWarning, match=r"paged_attention runs the PyTorch reference.*sm_100a") as got:
        out = _attention(pb, q)
    assert len(got) == 1 and got[0].filename == __file__  # points at the caller, not at cute_kv
    assert torch.equal(out, ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1))
    want = cute_kv.explain("paged_attention", q, pb.input_row_offsets, pb.collection, 1, arch="sm_100a")
    assert want.reason in str(got[0].message)  # one decision: the warning says what explain says
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attention(pb, _q(pb, rng))  # same reason: silent
    mla = _batch(num_heads=1, is_mla=True)  # another op's reason warns on its own
    k = torch.randn(mla.total_rows, 1, 128, generator=rng).to(torch.bfloat16)
    as_gpu("sm_90a")
    with pytest.warns(cute_kv.FallbackWarning, match="MLA"):
        _attention(mla, _q(mla, rng), mla_v_dim=64)
    with pytest.warns(cute_kv.FallbackWarning, match="store_kv.*without scales"):
        fp8 = _batch(dtype=FP8)
        cute_kv.store_kv(k.expand(-1, 2, -1), k.expand(-1, 2, -1), fp8.input_row_offsets, fp8.collection, 0)


def test_off_cuda_the_reference_is_silent(rng):
    pb = _batch(head_size=112)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _attention(pb, _q(pb, rng))


@pytest.mark.parametrize("how", ["env", "function"])
def test_strict_mode_raises_before_anything_is_written(rng, as_gpu, monkeypatch, how):
    as_gpu("sm_100a")
    if how == "env":
        monkeypatch.setenv("CUTE_KV_STRICT", "1")
    else:
        cute_kv.set_strict(True)
    pb = _batch(head_size=112)  # no kernel tiles head dim 112
    q = _q(pb, rng)
    out = torch.full((q.shape[0], 8, 112), float("nan"), dtype=q.dtype)
    with pytest.raises(cute_kv.FallbackError, match="sm_100a.*CUTE_KV_STRICT=1"):
        _attention(pb, q, out=out)
    assert out.isnan().all()
    hidden = torch.randn(pb.total_rows, 64, generator=rng).to(torch.bfloat16)
    n = 128 + kv_columns(pb.collection)
    weight = cute_kv.Int4Weight(torch.randint(0, 256, (n, 32), dtype=torch.uint8, generator=rng),
                                torch.rand(n, 1, generator=rng).to(torch.bfloat16), 64)  # Q heads of 112: no kernel
    before = pb.collection.blocks.clone()
    with pytest.raises(cute_kv.FallbackError, match="fused_qkv_matmul_kv_cache"):
        cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0)
    assert torch.equal(pb.collection.blocks.view(torch.int16), before.view(torch.int16))
    cute_kv.set_strict(False)  # the function wins over the environment
    with pytest.warns(cute_kv.FallbackWarning):
        _attention(pb, q, out=out)
    assert not out.isnan().any()


@pytest.mark.parametrize("value, strict", [("0", False), ("", False), ("false", False), ("1", True), ("yes", True)])
def test_strict_environment_values(monkeypatch, value, strict):
    monkeypatch.setenv("CUTE_KV_STRICT", value)
    assert paths.is_strict() is strict


@pytest.mark.gpu
def test_explain_on_the_device_says_what_runs(rng):
    """On a GPU, without ``arch``: the device's arch decides; a kernel path launches without a fallback warning."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=128, page_size=16, generator=rng, device="cuda")
    q = _q(pb, rng).cuda()
    path = cute_kv.explain("paged_attention", q, pb.input_row_offsets, pb.collection, 1)
    assert path.arch == paths.device_arch(q.device)
    if path.path == "kernel":
        with warnings.catch_warnings():
            warnings.simplefilter("error", cute_kv.FallbackWarning)
            _attention(pb, q)
    else:
        with pytest.warns(cute_kv.FallbackWarning, match=re.escape(path.reason)):
            _attention(pb, q)
