"""Timing on the GPU: CUDA events, many samples, median; inputs rotated past L2; optional CUDA-graph replay.

Every implementation of a benchmark, peers included, is timed the same way in one process, so figures compare: each
sample times a batch of calls cycling over ``n_rot`` input sets whose bytes exceed L2 several
times over, so no call finds its inputs cached; the reported time is per call.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Timing:
    median_us: float
    p10_us: float
    p90_us: float
    samples: int
    calls_per_sample: int


def rotation_count(bytes_per_set: int, l2_bytes: int, *, l2_multiple: float = 3.0, max_sets: int = 64) -> int:
    """Input sets to cycle through so that one pass touches ``l2_multiple`` x L2 (at least 1, at most ``max_sets``)."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    return max(1, min(max_sets, math.ceil(l2_multiple * l2_bytes / bytes_per_set)))


def summarize(per_call_us: Sequence[float], calls_per_sample: int) -> Timing:
    """Median and p10/p90 of per-call times (one entry per sample)."""
    if not per_call_us:
        raise ValueError("no samples")
    xs = sorted(per_call_us)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
    return Timing(statistics.median(xs), q[0], q[-1], len(xs), calls_per_sample)


def l2_bytes(device=None) -> int:
    import torch

    return torch.cuda.get_device_properties(device).L2_cache_size


def time_cuda(fn: Callable[[int], object], n_rot: int, *, samples: int = 30, warmup: int = 5,
              sample_ms: float = 2.0, graph: bool = False) -> Timing:
    """Per-call time of ``fn(r)`` (``r`` = input set in ``[0, n_rot)``), eager or replayed from a CUDA graph."""
    import torch

    for i in range(max(warmup, 1)):
        fn(i % n_rot)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n_rot):
        fn(i)
    torch.cuda.synchronize()
    est_s = (time.perf_counter() - t0) / n_rot
    # Batch enough calls per sample that event resolution (~µs) is noise; whole passes over the inputs.
    calls = math.ceil(max(n_rot, sample_ms * 1e-3 / max(est_s, 1e-7)) / n_rot) * n_rot

    def run_calls():
        for i in range(calls):
            fn(i % n_rot)

    launch = run_calls
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture stream, as torch's graph docs require
            fn(0)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run_calls()
        launch = g.replay
        launch()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(samples)]
    for start, stop in events:
        start.record()
        launch()
        stop.record()
    torch.cuda.synchronize()
    return summarize([a.elapsed_time(b) * 1e3 / calls for a, b in events], calls)


def host_cost(fn: Callable[[], object], *, iters: int = 2000, sync: Callable[[], None] = lambda: None) -> float:
    """Eager host time per call in µs: wall clock over ``iters`` calls, ``sync()`` once at the end.

    With a fast GPU kernel the host is the bottleneck, so this is the launch cost an engine pays per call.
    """
    for _ in range(min(iters, 50)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters * 1e6
