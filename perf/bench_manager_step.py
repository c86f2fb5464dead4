"""Host-side decode step of the paged KV block manager: ``allocate`` + ``commit`` for a running batch.

Default: 256 requests holding 4096 tokens each, page size 16, one new token per request per step, timed with
``time.perf_counter`` on one CPU core. ``lockstep``: every request crosses a page boundary in the same step
(every 16th step allocates 256 pages and, with prefix caching, hashes and commits 256 pages: the worst step);
``staggered``: contexts of 4096 + (r mod 16) spread that work evenly. Prefix-cache pages are hashed with the
manager's default (SHA-256) unless ``--hash-algorithm`` names another. Prints one JSON line per configuration.

    python perf/bench_manager_step.py [--requests 256 --context 4096 --page-size 16 --steps 512 --hash-algorithm X]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from cute_kv import KVCacheParams, PagedKVCacheManager
from cute_kv.manager.prefix_cache import DEFAULT_HASH_ALGORITHM, HASH_ALGORITHMS
from report import summary


def bench(requests: int, context: int, page_size: int, steps: int, prefix_caching: bool, staggered: bool,
          hash_algorithm: str = DEFAULT_HASH_ALGORITHM) -> dict:
    # Tiny heads: the step's host cost does not depend on them, and the pool stays small.
    params = KVCacheParams(torch.float16, n_kv_heads=1, head_dim=16, page_size=page_size, total_num_layers=1,
                           enable_prefix_caching=prefix_caching)
    lengths = [context + (r % page_size if staggered else 0) for r in range(requests)]
    mgr = PagedKVCacheManager(params, sum(-(-(n + steps) // page_size) for n in lengths),
                              hash_algorithm=hash_algorithm)
    rids = list(range(requests))
    gen = torch.Generator().manual_seed(0)
    for rid, n in zip(rids, lengths):
        mgr.claim(rid)
        mgr.allocate([rid], token_ids=torch.randint(0, 32000, (1, n), generator=gen))
        mgr.commit()
    # The sampler's output as the engine holds it: one [B, 1] tensor per step.
    next_tokens = torch.randint(0, 32000, (steps, requests, 1), generator=gen)
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        mgr.allocate(rids, token_ids=next_tokens[step])
        mgr.commit()
        times.append(time.perf_counter() - t0)
    assert [mgr.cache_length(r) for r in rids] == [n + steps for n in lengths]
    # Steps whose allocate starts new pages (in lockstep, every page_size-th: the worst steps).
    boundary_us = [t * 1e6 for step, t in enumerate(times) if not staggered and (context + step) % page_size == 0]
    times_us = sorted(t * 1e6 for t in times)
    return {
        "bench": "manager_step",
        "requests": requests,
        "context": context,
        "page_size": page_size,
        "prefix_caching": prefix_caching,
        "hash_algorithm": hash_algorithm if prefix_caching else None,
        "boundaries": "staggered" if staggered else "lockstep",
        "steps": steps,
        "median_us": round(statistics.median(times_us), 1),
        "mean_us": round(statistics.fmean(times_us), 1),
        "p99_us": round(times_us[int(0.99 * (len(times_us) - 1))], 1),
        "max_us": round(times_us[-1], 1),
        "page_boundary_median_us": round(statistics.median(boundary_us), 1) if boundary_us else None,
        "target_us": 1000,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--hash-algorithm", choices=HASH_ALGORITHMS, default=DEFAULT_HASH_ALGORITHM)
    args = ap.parse_args(argv)
    if hasattr(os, "sched_setaffinity"):  # one core, like an engine's scheduler thread
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)
    results = []
    for prefix_caching in (False, True):
        for staggered in (False, True):
            result = bench(args.requests, args.context, args.page_size, args.steps, prefix_caching, staggered,
                           args.hash_algorithm)
            print(json.dumps(result), flush=True)
            results.append(result)
    return results


if __name__ == "__main__":
    main()
