"""Every CuTe DSL kernel compiles for sm_90a and sm_100a from fake tensors (no GPU) and emits what it claims."""

import re

import pytest

from cute_kv.kernels import compile_cache
from cute_kv.kernels.paged_kv_gather import PagedKVGather

pytestmark = pytest.mark.compile

ARCHS = ("sm_90a", "sm_100a")
GATHER_CASES = [("bfloat16", 2, 16, 8, 128), ("float16", 2, 64, 1, 256), ("bfloat16", 1, 128, 1, 64)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", GATHER_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_gather_ptx(arch, case):
    kernel = PagedKVGather(*case)
    ptx = compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), arch)
    assert f".target {arch}" in ptx
    # One TMA box per 128 bytes of head dim, addressed by (dim, slot, [head,] physical page): extent-1 modes fold.
    loads = re.findall(r"cp\.async\.bulk\.tensor\.[2-5]d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    assert len(loads) == case[4] * 2 // 128
    assert "mbarrier.try_wait" in ptx and "mbarrier.arrive.expect_tx" in ptx
    assert "st.global.v4.b32" in ptx  # 16-byte predicated row stores


def test_compile_cache_compiles_once_per_key():
    kernel = PagedKVGather("bfloat16", 2, 32, 2, 128)
    key = ("test_paged_kv_gather", "bfloat16", 2, 32, 2, 128)
    build = lambda: (kernel, *kernel.fake_args())  # noqa: E731
    first = compile_cache.compiled(key, build, "sm_90a")
    compiles = compile_cache.cache_info()["compiles"]
    assert compile_cache.compiled(key, build, "sm_90a") is first
    assert compile_cache.cache_info()["compiles"] == compiles
    assert type(first).__name__.startswith("TVMFFI")  # called with torch tensors directly
    other = compile_cache.compiled(key, build, "sm_100a")  # the arch is part of the key
    assert other is not first and compile_cache.cache_info()["compiles"] == compiles + 1


def test_target_arch_from_environment(monkeypatch):
    from cute_kv.kernels.arch import target_arch

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert target_arch() == "sm_100a"
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_80")
    with pytest.raises(RuntimeError, match="sm_80"):
        target_arch()
