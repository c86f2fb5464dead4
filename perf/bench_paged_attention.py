"""Paged attention, decode and causal prefill: ``cute_kv.paged_attention`` beside FA4, FlashInfer and torch SDPA.

The peers' own harness times every implementation in this one process (``bench_peers.py`` from
``$PEERS_DIR``, ``.peers/`` or ``../shared/peers/``: Llama-3-8B heads 32q/8kv, d128, bf16; shuffled page pools
rotated past 3x L2; every output checked against a float32 reference; CUDA-graph replay timing), with cute-kv added
as one more peer on the very same pages, page tables and queries: its ``[N, 2, 1, P, H, D]`` blocks hold a copy of
the peers' K and V caches. Shapes: decode at page 16/64 x batch 1/8/32/128 x context 512/4k/16k; prefill 4 x 2048
new tokens after 0 and 4096 cached, causal; a ragged correctness pass. A peer that cannot run is recorded as
unavailable, with the reason.

On top of the peers' rows, one ``summary`` record per shape: cute-kv's time, the best peer and its time,
``speedup_vs_best_peer``, the fraction of the measured copy bandwidth (decode: K/V/Q/O bytes) or bf16 GEMM rate
(prefill), and ``host_us`` (wall clock per eager call with one sync at the end: the host cost where the GPU is
faster); then the geometric mean of the decode speed-ups.

    python perf/run.py paged-attention --out perf/results/attention.json [-- --sections decode --batches 1,8]
    python perf/bench_paged_attention.py --cpu-smoke   # tiny shapes on the CPU: cute-kv runs its reference
"""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

import cute_kv
from cute_kv import PagedKVCacheCollection
from cute_kv.metadata import input_row_offsets

import cases
import harness

SECTIONS = "decode,ragged,prefill"


def paged_call(case):
    """``fn(r)``: cute-kv on rotation ``r`` of a peers' case (same K/V values, page tables and queries)."""
    dev = case.q.device
    blocks = torch.stack((case.k_cache, case.v_cache), dim=1).unsqueeze(2)  # [N, KVD=2, L=1, P, HK, D]
    lengths = torch.tensor(case.lens, dtype=torch.int64)
    cache_lengths = (lengths - case.Lq).to(torch.uint32).to(dev)
    offsets = input_row_offsets([case.Lq] * case.B, dev)
    collections = [PagedKVCacheCollection(blocks, cache_lengths, case.page_table[r].to(torch.uint32), case.Lq,
                                          max(case.lens), validate=False) for r in range(case.n_rot)]

    def fn(r):
        return cute_kv.paged_attention(case.q[r], offsets, collections[r], 0, causal=case.causal, validate=False)

    return fn


def cute_kv_peer(peers, env):
    """cute-kv as a ``bench_peers.Peer``; its note carries the eager host cost measured on the case."""

    class CuteKV(peers.Peer):
        name = "cute-kv"
        sections = ("decode", "ragged", "prefill")
        api = ("cute_kv.paged_attention(q (B*Lq,H,D), input_row_offsets, collection ([N,2,1,P,HK,D] blocks, uint32 "
               "lookup table), 0, causal=, validate=False)")

        def attention(self, case):
            fn = paged_call(case)
            fn(0)  # compile outside the host-cost timing
            if env.dev.type == "cuda":
                calls = itertools.count()
                host = harness.host_cost(lambda: fn(next(calls) % case.n_rot), iters=100,
                                         sync=torch.cuda.synchronize)
                self.note = f"host_us={host:.1f}"
            return fn

    return CuteKV(env)


def run(peers, args) -> list[dict]:
    """The peers' driver, cute-kv first among the peers that need no JIT; FlashInfer's modules as they build."""
    env = peers.Env(args)
    runner = peers.Runner(env, peers.Budget(args.budget_s))
    first = [cute_kv_peer(peers, env), peers.TorchSDPAGather(env), peers.TorchSDPADense(env), peers.FA4(env)]
    fi_decode = [peers.FlashInferDecode(env, False), peers.FlashInferDecode(env, True)]
    fi_prefill = [peers.FlashInferPrefill(env, "fa2"), peers.FlashInferPrefill(env, "fa3")]

    def sel(group, section):
        return [p for p in group if runner.want(p) and section in p.sections]

    fi = sel(fi_decode, "decode") + sel(fi_prefill, "prefill")
    fi_ready = env.dev.type == "cuda" and env.flashinfer is not None and fi
    runner.probe_roofline()
    if fi_ready:
        env.prepare_flashinfer_toolchain()
        env.start_flashinfer_build()
    sections = [s for s in SECTIONS.split(",") if s in args.section_set]
    for section in sections:
        getattr(runner, section)(sel(first, section))
    if fi_ready:
        steps = [("decode", "decode", [fi_decode[0]]), ("prefill-fa2", "decode", [fi_decode[1]]),
                 ("prefill-fa2", "prefill", [fi_prefill[0]]), ("prefill-fa3", "prefill", [fi_prefill[1]]),
                 (None, "ragged", fi_decode + fi_prefill)]
        for module, section, group in steps:
            if section in sections and sel(group, section):
                env.wait_flashinfer_module(module, runner.budget, reserve_s=45)
                getattr(runner, section)(sel(group, section))
    else:
        for p in fi:
            runner.record(section=p.sections[0], peer=p.name, shape="(all)", params={}, status="unavailable",
                          error=p.unavailable() or "needs CUDA and FlashInfer")
    peers.print_tables(runner.rows, args)
    return runner.rows + summarize(runner.rows, runner.roof)


def summarize(rows: list[dict], roof: dict) -> list[dict]:
    """Per timed shape: cute-kv against the fastest ok peer, roofline fractions, host cost; then the geomean."""
    out = []
    for section in ("decode", "prefill"):
        timed = [r for r in rows if r.get("section") == section and r.get("status") == "ok" and r.get("time_us")]
        for shape in dict.fromkeys(r["shape"] for r in timed):
            here = [r for r in timed if r["shape"] == shape]
            ours = next((r for r in here if r["peer"] == "cute-kv"), None)
            others = [r for r in here if r["peer"] != "cute-kv"]
            rec = {"bench": "paged_attention", "summary": section, "shape": shape}
            if ours is not None:
                rec.update(cute_kv_us=ours["time_us"], mode=ours["mode"], gbs=ours["gbs"], tflops=ours["tflops"],
                           frac_copy=ours.get("frac_copy"), frac_gemm=ours.get("frac_gemm"))
                if ours.get("note", "").startswith("host_us="):
                    rec["host_us"] = float(ours["note"].split("=")[1])
            if others:
                best = min(others, key=lambda r: r["time_us"])
                rec.update(best_peer=best["peer"], best_peer_us=best["time_us"])
                if ours is not None:
                    rec["speedup_vs_best_peer"] = best["time_us"] / ours["time_us"]
            out.append(rec)
    speedups = [r["speedup_vs_best_peer"] for r in out if r["summary"] == "decode" and "speedup_vs_best_peer" in r]
    if speedups:
        out.append({"bench": "paged_attention", "summary": "decode-geomean", "shapes": len(speedups),
                    "geomean_speedup_vs_best_peer": math.exp(sum(map(math.log, speedups)) / len(speedups)),
                    "min_speedup_vs_best_peer": min(speedups), "copy_gbs": roof.get("copy_gbs")})
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def main(argv=None) -> list[dict]:
    peers = cases.peers_module()
    if peers is None:
        raise SystemExit("bench_peers.py not found: set PEERS_DIR, or copy ../shared/peers to .peers/")
    # The peers' options (--batches, --contexts, --page-sizes, --peers, --budget-s, --cpu-smoke, ...); later wins.
    args = peers.parse_args(["--sections", SECTIONS, *(sys.argv[1:] if argv is None else argv)])
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference must be float32
    return run(peers, args)


if __name__ == "__main__":
    main()
