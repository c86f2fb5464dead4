"""The machine's two ceilings every benchmark is reported against: copy bandwidth and bf16 GEMM rate.

* copy: device-to-device ``copy_`` of a 2 GiB buffer (far past L2), counting read + write bytes;
* GEMM: ``torch.mm`` in bf16 on a large square and on the Llama-3-8B QKV projection (8192x4096 @ 4096x6144).

    python perf/run.py ceilings --out perf/results/ceilings.json
"""

from __future__ import annotations

import argparse
import json

from harness import time_cuda
from report import summary


def copy_bandwidth_gbps(nbytes: int = 2 << 30) -> dict:
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    t = time_cuda(lambda r: dst.copy_(src), 1, samples=20, sample_ms=20.0)
    return {"bench": "ceiling_copy", "bytes": nbytes, "median_us": t.median_us,
            "gbps": 2 * nbytes / (t.median_us * 1e-6) / 1e9}


def gemm_tflops(m: int, n: int, k: int) -> dict:
    import torch

    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, n, dtype=torch.bfloat16, device="cuda")
    t = time_cuda(lambda r: torch.mm(a, b), 1, samples=20, sample_ms=20.0)
    return {"bench": "ceiling_gemm_bf16", "shape": [m, n, k], "median_us": t.median_us,
            "tflops": 2 * m * n * k / (t.median_us * 1e-6) / 1e12}


def main(argv=None) -> list[dict]:
    argparse.ArgumentParser(description=summary(__doc__)).parse_args(argv)
    records = [copy_bandwidth_gbps(), gemm_tflops(8192, 8192, 8192), gemm_tflops(8192, 6144, 4096)]
    for r in records:
        print(json.dumps(r), flush=True)
    return records
