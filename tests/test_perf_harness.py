"""perf/: the CPU-checkable parts of the harness and runner, and (``gpu``) real timings."""

import importlib
import json
import os
import subprocess
import sys

import pytest

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)

import harness  # noqa: E402
import report  # noqa: E402
import run  # noqa: E402


def test_rotation_count_covers_l2():
    l2 = 50 * 2**20
    n = harness.rotation_count(4 * 2**20, l2)
    assert n * 4 * 2**20 >= 3 * l2 and (n - 1) * 4 * 2**20 < 3 * l2
    assert harness.rotation_count(10 * l2, l2) == 1
    assert harness.rotation_count(1, l2, max_sets=8) == 8
    with pytest.raises(ValueError, match="bytes_per_set"):
        harness.rotation_count(0, l2)


def test_summarize_median_and_spread():
    t = harness.summarize([5.0, 1.0, 3.0, 2.0, 4.0, 100.0, 3.5, 2.5, 3.2, 2.8, 3.1], calls_per_sample=7)
    assert t.median_us == 3.1 and t.samples == 11 and t.calls_per_sample == 7
    assert t.p10_us <= t.median_us <= t.p90_us < 100.0
    with pytest.raises(ValueError):
        harness.summarize([], 1)


def test_roofline_and_speedup():
    # 3 GB at 3000 GB/s takes 1 ms: in 2 ms that is half the roofline
    assert report.bandwidth_fraction(3e9, 2e-3, 3000.0) == pytest.approx(0.5)
    assert report.compute_fraction(800e12 * 1e-3, 1e-3, 800.0) == pytest.approx(1.0)
    assert report.speedup(10.0, 13.4) == pytest.approx(1.34)


def test_host_cost_counts_calls():
    calls = []
    us = harness.host_cost(lambda: calls.append(1), iters=100)
    assert len(calls) == 150 and us > 0  # 50 warm-up + 100 timed


def test_write_json_schema(tmp_path):
    path = tmp_path / "sub" / "r.json"
    report.write_json(str(path), [{"bench": "x", "median_us": 1.5}])
    doc = json.loads(path.read_text())
    assert doc["records"] == [{"bench": "x", "median_us": 1.5}]
    assert {"date", "python", "torch"} <= doc["machine"].keys()


def test_registry_modules_have_main():
    for b in run.BENCHMARKS.values():
        assert callable(importlib.import_module(b.module).main)


def _run(*args):
    return subprocess.run([sys.executable, os.path.join(PERF, "run.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_list_and_cpu_benchmark(tmp_path):
    out = _run("list")
    assert out.returncode == 0 and "manager-step" in out.stdout and "ceilings" in out.stdout
    path = tmp_path / "m.json"
    res = _run("manager-step", "--out", str(path), "--", "--requests", "4", "--context", "64", "--steps", "5")
    assert res.returncode == 0, res.stderr
    records = json.loads(path.read_text())["records"]
    assert len(records) == 4 and all(r["median_us"] > 0 for r in records)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU path")
def test_cuda_benchmark_without_gpu_is_one_line():
    res = _run("ceilings")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in res.stderr and "Traceback" not in res.stderr


def test_benchmark_help_gives_the_whole_summary():
    """A benchmark's ``--help`` opens with its docstring's first paragraph, whole (not its first line)."""
    res = _run("static", "--", "--help")
    assert res.returncode == 0, res.stderr
    assert ("the static table of every kernel configuration (``cute_kv.kernels.catalog``), and FA4's paged forward "
            "beside our attention for the same shapes. CPU only: ptxas, nvdisasm and the DSL, no GPU.") in \
        " ".join(res.stdout.split())
    for name, b in run.BENCHMARKS.items():
        doc = importlib.import_module(b.module).__doc__
        assert report.summary(doc).endswith("."), (name, report.summary(doc))


def test_unknown_benchmark():
    res = _run("nope")
    assert res.returncode == 2 and "unknown benchmark" in res.stderr


@pytest.mark.gpu
def test_time_cuda_eager_and_graph():
    import torch

    x = [torch.randn(1 << 20, device="cuda") for _ in range(4)]
    eager = harness.time_cuda(lambda r: x[r].mul_(1.0), len(x), samples=5)
    graph = harness.time_cuda(lambda r: x[r].mul_(1.0), len(x), samples=5, graph=True)
    assert 0 < graph.median_us and 0 < eager.median_us
    assert eager.calls_per_sample % len(x) == 0


@pytest.mark.gpu
def test_ceilings_are_plausible():
    import ceilings

    copy = ceilings.copy_bandwidth_gbps(256 << 20)
    gemm = ceilings.gemm_tflops(4096, 4096, 4096)
    assert 100 < copy["gbps"] < 20000 and 10 < gemm["tflops"] < 5000
