"""Ragged K/V row writes into one layer of a paged bf16 cache: ``cute_kv.store_kv`` against FlashInfer and torch.

Llama-3-8B KV heads (8 x 128, bf16), ``--layers`` layers per page, page sizes 16 and 64. Cases (``cases.STEPS``):
``decode`` 128 requests x 1 new token after 1-4k cached, ``prefill`` 8 x 1024 new, ``bulk`` 32 x 1024 new (32768
rows, bandwidth-bound). Peers in the same process on the same cache and inputs: FlashInfer
``append_paged_kv_cache`` on the layer's strided K/V planes (recorded absent when not installed) and torch
``index_copy_`` into the flat row view, its destination rows computed once per step outside the timing. Each
implementation's rows are checked (exact copies) before it is timed. Figures: ``hbm_bytes`` (K and V rows read and
written), ``gbps``, ``roofline_fraction`` of the copy bandwidth measured at start, ``speedup_vs_<peer>``.

    python perf/run.py store-kv [--out perf/results/store_kv.json] [-- --cases decode,prefill,bulk --page-sizes 16,64]
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

import cute_kv
import cases
import ceilings
import harness
import report


def store_bytes(rows: int, num_heads: int = cases.KV_HEADS, head_size: int = cases.HEAD_DIM,
                element_size: int = 2) -> int:
    """HBM bytes of one call: K and V rows read, then written (the lookup metadata is negligible)."""
    return 4 * rows * num_heads * head_size * element_size


def bench_case(args, copy_gbps: float, l2: int, name: str, page_size: int, fi, fi_why) -> list[dict]:
    step = cases.STEPS[name]
    nbytes = store_bytes(step.rows)
    # Decode moves 1 MiB a call: it takes ~150 sets (distinct rows, layers and inputs) to span 3x L2.
    n_rot = harness.rotation_count(nbytes, l2, max_sets=256)
    gen = torch.Generator().manual_seed(page_size)
    sets = cases.PagedSets(step, page_size=page_size, num_layers=args.layers, n_sets=n_rot, generator=gen,
                           device="cuda")
    k, v = (torch.randn((n_rot, step.rows, cases.KV_HEADS, cases.HEAD_DIM), dtype=torch.bfloat16, device="cuda")
            for _ in range(2))

    def check(fn):
        return sets.write_error(fn, k[0], v[0])

    def ours(r):
        cute_kv.store_kv(k[r], v[r], sets.input_row_offsets, sets.collections[r], sets.layer(r), validate=False)

    def torch_index_copy(r):
        cases.index_copy_store(sets.flat, *sets.rows[r], k[r], v[r])

    def flashinfer(r):
        fi.append_paged_kv_cache(k[r], v[r], sets.fi_batch, sets.fi_positions, sets.planes[sets.layer(r)],
                                 *sets.fi_pages[r], "NHD")

    impls = [cases.Impl("cute_kv", "ours", ours, check),
             cases.Impl("flashinfer", "peer", flashinfer, check, absent=fi_why),
             cases.Impl("torch_index_copy", "peer", torch_index_copy, check)]
    base = {"bench": "store_kv", "case": name, "page_size": page_size, "requests": step.requests,
            "rows": step.rows, "max_context": step.max_context,
            "layers": args.layers, "hbm_bytes": nbytes, "copy_gbps": copy_gbps}
    return cases.measure_case(base, impls, n_rot, args, tol=0.0, figures=lambda s: {
        "gbps": nbytes / s / 1e9, "roofline_fraction": report.bandwidth_fraction(nbytes, s, copy_gbps)})


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=report.summary(__doc__))
    ap.add_argument("--cases", default="decode,prefill,bulk", help="comma list of " + ",".join(cases.STEPS))
    cases.common_args(ap)
    args = ap.parse_args(argv)
    copy = ceilings.copy_bandwidth_gbps()
    print(json.dumps(copy), flush=True)
    return [copy, *cases.run_grid(args, functools.partial(bench_case, args, copy["gbps"], harness.l2_bytes()))]


if __name__ == "__main__":
    main()
