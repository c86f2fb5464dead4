"""The run-wide compile cache of the compile and SASS gates (``tests/artifacts.py``): a kernel is compiled once per
test run, whichever test or process asks first."""

import os
import subprocess
import sys

import pytest

import artifacts
from cute_kv.kernels.attention import combine
from cute_kv.kernels.attention.combine import AttentionCombine
from cute_kv.kernels.attention.sm90 import PagedAttention
from cute_kv.kernels.catalog import configs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf"))
import static  # noqa: E402


def test_kernels_are_keyed_by_what_they_are_built_from():
    a, b = PagedAttention("bfloat16", 32, 8, 128, 16, 2, True), PagedAttention("bfloat16", 32, 8, 128, 16, 2, True)
    assert artifacts.describe(a) == artifacts.describe(b)  # two objects, one kernel
    assert "0x" not in artifacts.describe(a)  # no addresses: the same text in every process
    assert artifacts.describe(a) != artifacts.describe(PagedAttention("bfloat16", 32, 8, 128, 64, 2, True))
    texts = {artifacts.describe(c.kernel()) + c.arch for c in configs()}
    assert len(texts) == len(configs())  # every catalog configuration is its own entry


@pytest.mark.compile
def test_a_kernel_compiles_once_per_run_across_processes():
    kernel = AttentionCombine("bfloat16", 32, 64)
    before = artifacts.compiles
    first = artifacts.compiled(kernel, "sm_90a")
    assert ".target sm_90a" in first.ptx
    assert static.launch_from_host_ir(first.host_ir).threads == combine.THREADS  # the host side of the same compile
    assert artifacts.compiled(AttentionCombine("bfloat16", 32, 64), "sm_90a") is first
    assert artifacts.compiles <= before + 1
    # Another process of the run (an xdist worker) finds it on disk and compiles nothing.
    code = ("import sys; sys.path.insert(0, 'tests'); import artifacts; "
            "from cute_kv.kernels.attention.combine import AttentionCombine; "
            "art = artifacts.compiled(AttentionCombine('bfloat16', 32, 64), 'sm_90a'); "
            "print(artifacts.compiles, len(art.ptx))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True,
                         env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"))
    assert out.stdout.split() == ["0", str(len(first.ptx))]
