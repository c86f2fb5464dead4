"""Host time per op call at Llama-3-8B decode (B=128 x 1 token after 1-4k cached, 32 q / 8 KV heads x 128, bf16,
page 16): ``store_kv`` and ``paged_attention`` checked per call (the default), with ``validate=False``, and with a
``cute_kv.plan_step`` plan; plus ``plan_step`` itself, once per step.

``--device cpu`` (the default) drives the launch path on the CPU: ``paths.dry_run`` stands in for the GPU (its arch
and SM count) and hands back a kernel that launches nothing, so the figures are the host's work per call without
the launch itself. ``--device cuda`` times real launches (the host cost of eager calls, ``harness.host_cost``).

    python perf/run.py plan-step [-- --device cpu --arch sm_90a --iters 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

import cute_kv
import cases
import harness
import report
from cute_kv.ops import paths


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=report.summary(__doc__))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--arch", default="sm_90a", help="the GPU a CPU run stands in (sm_90a or sm_100a)")
    ap.add_argument("--sms", type=int, default=132, help="its SM count")
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args(argv)
    device = None if args.device == "cpu" else "cuda"
    step = cases.decode_step()
    # One layer per page and nothing read from the cache: the host's work does not depend on them.
    sets = cases.PagedSets(step, page_size=16, num_layers=1, n_sets=1, generator=torch.Generator().manual_seed(0),
                           device=device)
    c, ro = sets.collections[0], sets.input_row_offsets
    k, v = (torch.randn((step.rows, cases.KV_HEADS, cases.HEAD_DIM), dtype=torch.bfloat16, device=device)
            for _ in range(2))
    q = torch.randn((step.rows, cases.Q_HEADS, cases.HEAD_DIM), dtype=torch.bfloat16, device=device)
    sync = torch.cuda.synchronize if device else (lambda: None)
    stand_in = paths.dry_run(args.arch, args.sms) if device is None else contextlib.nullcontext()
    records = []
    with stand_in:
        plan = cute_kv.plan_step(c, ro, num_q_heads=cases.Q_HEADS)
        calls = {
            "store_kv": {
                "validate": lambda: cute_kv.store_kv(k, v, ro, c, 0),
                "validate_false": lambda: cute_kv.store_kv(k, v, ro, c, 0, validate=False),
                "plan": lambda: cute_kv.store_kv(k, v, ro, c, 0, plan=plan),
            },
            "paged_attention": {
                "validate": lambda: cute_kv.paged_attention(q, ro, c, 0),
                "validate_false": lambda: cute_kv.paged_attention(q, ro, c, 0, validate=False),
                "plan": lambda: cute_kv.paged_attention(q, ro, c, 0, plan=plan),
            },
            "plan_step": {"validate": lambda: cute_kv.plan_step(c, ro, num_q_heads=cases.Q_HEADS)},
        }
        for op, modes in calls.items():
            for mode, fn in modes.items():
                rec = {"bench": "plan_step", "op": op, "mode": mode, "device": args.device,
                       "arch": args.arch if device is None else None, "requests": step.requests, "rows": step.rows,
                       "host_us": harness.host_cost(fn, iters=args.iters, sync=sync)}
                print(json.dumps(rec), flush=True)
                records.append(rec)
    return records


if __name__ == "__main__":
    main()
