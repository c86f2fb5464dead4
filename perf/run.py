"""Run a benchmark by name and write its records, with the machine's facts, to JSON.

    python perf/run.py list
    python perf/run.py ceilings --out perf/results/ceilings.json
    python perf/run.py manager-step --out perf/results/manager.json -- --requests 256 --steps 512
    python perf/run.py static                # CPU: registers, spills, smem, CTAs/SM, SASS counts (+ FA4)
    python perf/run.py mla-mma-work          # CPU: MLA decode's MMA work per key against the minimum

A benchmark is a module of this folder whose ``main(argv) -> list[dict]`` prints one JSON line per record and
returns the records; register it in ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Benchmark:
    module: str
    needs_cuda: bool
    help: str
    default_out: Optional[str] = None  # JSON written when --out is not given


BENCHMARKS = {
    "ceilings": Benchmark("ceilings", True, "copy bandwidth and bf16 GEMM rate of this GPU"),
    "manager-step": Benchmark("bench_manager_step", False,
                              "block manager allocate+commit for 256 requests x 4k tokens (host, one core)"),
    "store-kv": Benchmark("bench_store_kv", True,
                          "store_kv ragged K/V writes (decode, prefill, 32k rows) vs FlashInfer append, index_copy_"),
    "fused-qkv": Benchmark("bench_fused_qkv", True,
                           "QKV GEMM + K/V cache write (T=128, 8192) vs GEMM alone, + FlashInfer, + index_copy_"),
    "fused-qkv-static": Benchmark("static_fused_qkv", False,
                                  "fused QKV kernels vs quack's bare GEMM, compiled for sm_90a/sm_100a: registers, "
                                  "spills, MMA instructions, epilogue instructions per element (ptxas, cuobjdump)"),
    "barriers": Benchmark("barriers", False,
                          "mbarrier accounting of every kernel configuration from its PTX: init count against the "
                          "arrivals a phase gets, and a replay of each ring (no GPU)"),
    "static": Benchmark("bench_static", False,
                        "ptxas/SASS figures of every kernel configuration, FA4's forward beside ours (no GPU)",
                        os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "static.json")),
    "plan-step": Benchmark("bench_plan_step", False,
                           "host us per store_kv / paged_attention call at Llama-3-8B decode (B=128): checked per "
                           "call, validate=False, with a plan_step plan (CPU: launch path driven, nothing launched)"),
    "paged-attention": Benchmark("bench_paged_attention", True,
                                 "paged decode (24 shapes) and causal prefill vs FA4, FlashInfer, torch SDPA"),
    "mla-mma-work": Benchmark("mla_mma_work", False,
                              "MMA instructions per key tile and FLOPs per key of MLA decode on SM100 against the "
                              "minimum, from PTX; FlashMLA's head64 decode beside it given its PTX (no GPU)"),
    "mla-decode": Benchmark("bench_mla_decode", True,
                            "MLA decode at DeepSeek-V3 shapes (128 heads, 576/512, page 64) vs FlashInfer's MLA"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="perf/run.py", description="cute-kv benchmarks",
                                 epilog="arguments after '--' go to the benchmark")
    ap.add_argument("name", help="a benchmark name, or 'list'")
    ap.add_argument("--out", help="JSON file for the records (default: print only)")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, rest = ap.parse_args(argv[:split]), argv[split + 1:]  # after '--': the benchmark's own arguments
    if args.name == "list":
        for name, b in BENCHMARKS.items():
            print(f"{name:14s} {'cuda' if b.needs_cuda else 'cpu ':4s}  {b.help}")
        return 0
    bench = BENCHMARKS.get(args.name)
    if bench is None:
        print(f"perf/run.py: unknown benchmark {args.name!r} (try: list)", file=sys.stderr)
        return 2
    if bench.needs_cuda:
        import torch

        if not torch.cuda.is_available():
            print(f"perf/run.py: {args.name} needs a CUDA GPU and torch sees none", file=sys.stderr)
            return 2
    records = importlib.import_module(bench.module).main(rest)  # benchmarks print their own JSON lines
    out = args.out or bench.default_out
    if out:
        from report import write_json

        write_json(out, records)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
