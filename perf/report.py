"""Reporting: roofline fractions, speed-ups over peers, and the JSON file with the machine's facts.

A record is a flat dict with at least ``bench`` and ``median_us``; GPU benchmarks add ``roofline_fraction``
(``bandwidth_fraction`` or ``compute_fraction`` against ``ceilings.py``'s figures measured in the same process)
and ``speedup_vs_best_peer``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from typing import Optional


def summary(doc: str) -> str:
    """A module docstring's first paragraph as one line: a benchmark's ``--help`` description (its first line may
    end mid-sentence)."""
    return " ".join(doc.strip().split("\n\n", 1)[0].split())


def bandwidth_fraction(hbm_bytes: float, seconds: float, copy_gbps: float) -> float:
    """Time the bytes need at the measured copy bandwidth, over the time taken (1.0 = at the roofline)."""
    return hbm_bytes / (copy_gbps * 1e9) / seconds


def compute_fraction(flops: float, seconds: float, gemm_tflops: float) -> float:
    """Time the FLOPs need at the measured bf16 GEMM rate, over the time taken."""
    return flops / (gemm_tflops * 1e12) / seconds


def speedup(ours_us: float, peer_us: float) -> float:
    """How many times faster ours is than the peer (> 1: ours wins)."""
    return peer_us / ours_us


def machine_facts() -> dict:
    import torch

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        facts.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                     gpu_memory_gib=round(p.total_memory / 2**30, 1), l2_bytes=p.L2_cache_size,
                     cuda=torch.version.cuda, driver=_driver_version())
    return facts


def _driver_version() -> Optional[str]:
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return f"{version // 1000}.{version % 1000 // 10}" if int(err) == 0 else None
    except ImportError:
        return None


def write_json(path: str, records: list[dict]) -> None:
    """``{"machine": {...}, "records": [...]}``; the folder is created."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"machine": machine_facts(), "records": records}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
