"""The MHA attention kernels over strided K/V planes (foreign cache layouts read in place): the ``strided`` variant of
``PagedAttention`` (SM90) and ``PagedAttentionSm100``, compiled without a GPU."""

import pytest

import artifacts

from cute_kv.kernels.attention.sm90 import PagedAttention
from cute_kv.kernels.attention.sm100 import PagedAttentionSm100
from cute_kv.kernels.catalog import ATTENTION_CASES, ATTENTION_SM100_CASES

# The catalog's strided cases (``strided``, the constructors' last argument, set): each compiles in the SASS gate too.
STRIDED = [(PagedAttention, case, "sm_90a") for case in ATTENTION_CASES if len(case) == 14 and case[13]] + [
    (PagedAttentionSm100, case, "sm_100a") for case in ATTENTION_SM100_CASES if len(case) == 15 and case[14]]


def test_the_catalog_compiles_the_strided_variants():
    """SM90, and SM100 by page slot and by gather4."""
    kernels = [cls(*case) for cls, case, _ in STRIDED]
    assert all(k.k_op.strided and k.v_op.strided for k in kernels)
    assert [(type(k).__name__, getattr(k, "gather4", None)) for k in kernels] == [
        ("PagedAttention", None), ("PagedAttentionSm100", False), ("PagedAttentionSm100", True)]


@pytest.mark.compile
@pytest.mark.parametrize("cls, case, arch", [pytest.param(*s, id=f"{s[0].__name__}-{'-'.join(map(str, s[1]))}")
                                             for s in STRIDED])
def test_strided_planes_change_only_the_host_descriptors(cls, case, arch):
    """The kernel reads K and V only through TMA descriptors the host builds from the planes' runtime strides: its
    device code is the compact variant's, byte for byte; the host side (descriptors, entry) is not."""
    strided, compact = artifacts.compiled(cls(*case), arch), artifacts.compiled(cls(*case[:-1]), arch)
    assert strided.ptx == compact.ptx
    assert strided.host_ir != compact.host_ir


@pytest.mark.parametrize("cls", [PagedAttention, PagedAttentionSm100])
def test_strided_planes_carry_no_scales(cls):
    fp8 = ("bfloat16", 8, 2, 128, 16, 2, True, False, False, False, "float8_e4m3fn")
    with pytest.raises(ValueError, match="a scaled fp8 cache must be compact"):
        cls(*fp8, 32, False, **({"v_dim": None} if cls is PagedAttentionSm100 else {}), strided=True)
    assert cls(*fp8, None, False, strided=True).k_op.strided  # unscaled fp8 planes: the plain cast


def test_strided_planes_are_paged():
    with pytest.raises(ValueError, match="strided K/V planes must be paged"):
        PagedAttention("bfloat16", 8, 2, 128, None, strided=True)
