"""The MHA attention kernels over strided K/V planes (foreign cache layouts read in place): the ``strided`` variant of
``PagedAttention`` (SM90) and ``PagedAttentionSm100``, compiled without a GPU."""

import pytest
import torch

import artifacts
import cute_kv
from cute_kv.ops.kernel_args import LAYOUT_PROBLEM
from cute_kv.reference.batch import random_paged_batch, with_layout

from cute_kv.kernels.attention.sm90 import PagedAttention
from cute_kv.kernels.attention.sm100 import PagedAttentionSm100
from cute_kv.kernels.catalog import ATTENTION_CASES, ATTENTION_SM100_CASES

# The catalog's strided cases (``layout``, the constructors' last argument): each compiles in the SASS gate too.
STRIDED = [(PagedAttention, case, "sm_90a") for case in ATTENTION_CASES if case[-1] == "strided"] + [
    (PagedAttentionSm100, case, "sm_100a") for case in ATTENTION_SM100_CASES if case[-1] == "strided"]


def test_the_catalog_has_the_strided_variants():
    """SM90 by page slot and by cp.async row gather, SM100 by page slot and by gather4 (each compiled by the SASS
    gate; the TMA ones by the test below too)."""
    kernels = [cls(*case) for cls, case, _ in STRIDED]
    assert all(k.k_op.strided and k.v_op.strided for k in kernels)
    gathered = [k.gather4 if isinstance(k, PagedAttentionSm100) else k.gather is not None for k in kernels]
    assert list(zip((type(k).__name__ for k in kernels), gathered)) == [
        ("PagedAttention", False), ("PagedAttention", True), ("PagedAttentionSm100", False),
        ("PagedAttentionSm100", True)]


@pytest.mark.compile
@pytest.mark.parametrize("cls, case, arch", [pytest.param(*s, id=f"{s[0].__name__}-{'-'.join(map(str, s[1]))}")
                                             for s in STRIDED if getattr(s[0](*s[1]), "gather", None) is None])
def test_strided_planes_change_only_the_host_descriptors(cls, case, arch):
    """By TMA the kernel reads K and V only through descriptors the host builds from the planes' runtime strides: its
    device code is the compact variant's, byte for byte; the host side (descriptors, entry) is not. (The SM90 row
    gather addresses rows by the planes' strides in device code.)"""
    strided, compact = artifacts.compiled(cls(*case), arch), artifacts.compiled(cls(*case[:-1]), arch)
    assert strided.ptx == compact.ptx
    assert strided.host_ir != compact.host_ir


@pytest.mark.parametrize("cls", [PagedAttention, PagedAttentionSm100])
def test_strided_planes_carry_no_scales(cls):
    fp8 = ("bfloat16", 8, 2, 128, 16, 2, True, False, False, False, "float8_e4m3fn")
    with pytest.raises(ValueError, match="a scaled fp8 cache must be compact"):
        cls(*fp8, 32, False, layout="strided")
    assert cls(*fp8, None, False, layout="strided").k_op.strided  # unscaled fp8 planes: the plain cast


def test_strided_planes_are_paged():
    with pytest.raises(ValueError, match="strided K/V planes must be paged"):
        PagedAttention("bfloat16", 8, 2, 128, None, layout="strided")
    with pytest.raises(ValueError, match="layout must be one of"):
        PagedAttention("bfloat16", 8, 2, 128, 16, layout="hnd")


# -- what the op leaves to the reference -----------------------------------------------------------------------------

def _step(layout: str, cache: dict):
    """``(q, input_row_offsets, collection, layer)`` of a step over a cache of ``cache``'s kind in ``layout``."""
    pb = random_paged_batch([37, 5], [3, 1], num_heads=cache.pop("num_heads", 2), head_size=cache.pop("head_size", 64),
                            page_size=16, generator=torch.Generator().manual_seed(5), **cache)
    pb, layer = with_layout(pb, layout, 1)
    c = pb.collection
    q = torch.zeros(pb.total_rows, 16 if c.is_mla else 8, c.latent_dim, dtype=torch.bfloat16)
    return q, pb.input_row_offsets, c, layer


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_what_the_strided_variants_leave_to_the_reference(arch):
    """Scaled fp8 caches (their scales keep MAX's geometry, not the values' rows) and MLA caches in a strided layout
    take the reference, and ``explain`` says why."""
    fp8 = {"dtype": torch.float8_e4m3fn, "scale_dtype": torch.float32, "quantization_granularity": 64}
    path = cute_kv.explain(cute_kv.paged_attention, *_step("vllm", fp8), arch=arch)
    assert path.path == "reference" and "a scaled fp8 cache must be compact" in path.reason
    unscaled = cute_kv.explain(cute_kv.paged_attention, *_step("vllm", {"dtype": torch.float8_e4m3fn}), arch=arch)
    assert unscaled.path == "kernel" and unscaled.key[-1] == "strided"
    mla = _step("strided-6d", {"is_mla": True, "num_heads": 1, "head_size": 576})
    path = cute_kv.explain(cute_kv.paged_attention, *mla, mla_v_dim=512, arch=arch)
    assert path.path == "reference" and LAYOUT_PROBLEM in path.reason
    if arch == "sm_100a":
        indices = torch.zeros(mla[0].shape[0], 64, dtype=torch.int32)
        path = cute_kv.explain(cute_kv.sparse_mla_attention, *mla, indices, mla_v_dim=512, arch=arch)
        assert path.path == "reference" and LAYOUT_PROBLEM in path.reason
