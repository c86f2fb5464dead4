"""Paged attention, decode and causal prefill: ``cute_kv.paged_attention`` beside FA4, FlashInfer and torch SDPA.

Llama-3-8B heads (32 q / 8 KV, d128, bf16). Every implementation reads the same K/V values through the same page
order: the peers take ``[pages, P, HK, D]`` K and V caches with int32 page tables (FA4's ``page_table``,
FlashInfer's CSR ``kv_indices``), cute-kv a ``[pages, 2, 1, P, HK, D]`` blocks tensor holding a copy of them with a
uint32 lookup table. Shapes: decode at page 16/64 x batch 1/8/32/128 x context 512/4k/16k (contexts drawn around
the target, so requests are ragged); causal prefill of 4 x 2048 new tokens after 0 and 4096 cached. Each shape has
``n_rot`` placements of its pages (shuffled, disjoint) so a batch of calls spans 3x L2. Every output is checked
against the float32 reference (``cute_kv.reference.paged_attention``) on placement 0 before it is timed; a peer that
is not installed is recorded ``absent`` with the reason (FA4 and FlashInfer: ``pip install -e ".[peers]"``).

Records as in ``bench_store_kv``: ``status``, ``rel_err``, ``median_us`` (graph replay, else eager), ``host_us``,
``gbps`` and ``roofline_fraction`` of the copy bandwidth (decode: K/V/Q/O bytes) or ``tflops`` and the fraction of
the bf16 GEMM rate (prefill), and on cute-kv's record ``speedup_vs_<peer>`` / ``speedup_vs_best_peer``.

    python perf/run.py paged-attention --out perf/results/attention.json [-- --sections decode --batches 1,8]
    python perf/bench_paged_attention.py --cpu-smoke   # tiny shapes on the CPU: outputs checked, nothing timed
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math

import torch

import cute_kv
import cases
import ceilings
import harness
import report
from cute_kv import PagedKVCacheCollection, reference
from cute_kv.metadata import input_row_offsets, make_lookup_table, max_lengths

Q_HEADS, KV_HEADS, HEAD_DIM = cases.Q_HEADS, cases.KV_HEADS, cases.HEAD_DIM
TOL = 1e-2  # bf16 output against the float32 reference


@dataclasses.dataclass(frozen=True)
class Shape:
    section: str  # decode | prefill
    batch: int
    new: int  # new tokens per request (decode: 1)
    context: int  # target tokens per request, new ones included
    page_size: int

    @property
    def name(self) -> str:
        return f"{self.section} B={self.batch} new={self.new} ctx={self.context} P={self.page_size}"


def shapes(args) -> list[Shape]:
    out = []
    if "decode" in args.sections:
        out += [Shape("decode", b, 1, c, p) for p in cases.ints(args.page_sizes) for b in cases.ints(args.batches)
                for c in cases.ints(args.contexts)]
    if "prefill" in args.sections:
        out += [Shape("prefill", args.prefill_batch, args.prefill_new, args.prefill_new + c, p)
                for p in cases.ints(args.page_sizes) for c in cases.ints(args.prefill_cached)]
    return out


def step_of(shape: Shape, seed: int) -> cases.Step:
    """Decode contexts drawn in ``[context/2, context]`` (ragged), prefill exactly ``context``."""
    if shape.section == "prefill":
        return cases.Step((shape.context - shape.new,) * shape.batch, (shape.new,) * shape.batch)
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(max(shape.context // 2, 1), shape.context + 1, (shape.batch,), generator=g).tolist()
    return cases.Step(tuple(c - 1 for c in ctx), (1,) * shape.batch)


class Placements:
    """``n_rot`` disjoint, shuffled placements of one step's pages in shared K/V pools, in both layouts."""

    def __init__(self, step: cases.Step, page_size: int, n_rot: int, device, generator: torch.Generator):
        need = [math.ceil((c + n) / page_size) for c, n in zip(step.cache_lengths, step.new_lengths)]
        n_pages = sum(need) * n_rot
        shape = (n_pages, page_size, KV_HEADS, HEAD_DIM)
        values = torch.Generator(device=device).manual_seed(int(torch.randint(2**31, (1,), generator=generator)))
        self.k_cache, self.v_cache = (torch.randn(shape, generator=values, device=device, dtype=torch.bfloat16)
                                      for _ in range(2))  # drawn on the device: a decode pool is gigabytes
        blocks = torch.stack((self.k_cache, self.v_cache), dim=1).unsqueeze(2)  # [N, KVD=2, L=1, P, HK, D]
        self.offsets = input_row_offsets(step.new_lengths, device)
        self.offsets_i32 = self.offsets.to(torch.int32)
        self.seq_lens = torch.tensor([c + n for c, n in zip(step.cache_lengths, step.new_lengths)], dtype=torch.int32,
                                     device=device)
        cache_lengths = torch.tensor(step.cache_lengths, dtype=torch.int64).to(device=device, dtype=torch.uint32)
        max_seq, max_ctx = max_lengths(step.cache_lengths, step.new_lengths)
        perm = torch.randperm(n_pages, generator=generator).tolist()
        self.pages, self.collections, self.page_tables, self.fi_pages = [], [], [], []
        cols = max(need)
        for r in range(n_rot):
            start = r * sum(need)
            pages = [perm[start + s:start + s + n] for s, n in zip(itertools.accumulate([0, *need]), need)]
            self.pages.append(pages)
            self.collections.append(PagedKVCacheCollection(
                blocks, cache_lengths, make_lookup_table(pages, n_pages, device=device), max_seq, max_ctx,
                validate=False))
            self.page_tables.append(torch.tensor([p + [0] * (cols - len(p)) for p in pages], dtype=torch.int32,
                                                 device=device))
            self.fi_pages.append(cases.flashinfer_pages(pages, step, page_size, device))


def bench_shape(args, shape: Shape, ceiling: dict, peers: dict) -> list[dict]:
    dev = torch.device(args.device)
    step = step_of(shape, seed=shape.batch * 131 + shape.context)
    kv_bytes = sum(c + n for c, n in zip(step.cache_lengths, step.new_lengths)) * KV_HEADS * HEAD_DIM * 2 * 2
    qo_bytes = 2 * step.rows * Q_HEADS * HEAD_DIM * 2
    n_rot = 1 if dev.type != "cuda" else harness.rotation_count(kv_bytes + qo_bytes, harness.l2_bytes(),
                                                                 max_sets=32)
    gen = torch.Generator().manual_seed(shape.page_size)
    pl = Placements(step, shape.page_size, n_rot, dev, gen)
    q = torch.randn((n_rot, step.rows, Q_HEADS, HEAD_DIM), generator=torch.Generator(device=dev).manual_seed(1),
                    device=dev, dtype=torch.bfloat16)
    want = reference.paged_attention(q[0], pl.offsets, pl.collections[0], 0, causal=True).float()

    def check(fn):
        got = fn(0).float()
        err = float((got - want).norm() / want.norm())
        return err if math.isfinite(err) else math.inf

    def ours(r):
        return cute_kv.paged_attention(q[r], pl.offsets, pl.collections[r], 0, causal=True, validate=False)

    impls = [cases.Impl("cute_kv", "ours", ours), _sdpa(pl, q, step), _fa4(peers, pl, q, step, dev),
             _flashinfer(peers, pl, q, shape, dev)]
    for impl in impls:
        impl.check = check
    causal_pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(step.cache_lengths, step.new_lengths))
    flops = 4 * causal_pairs * Q_HEADS * HEAD_DIM
    base = {"bench": "paged_attention", "section": shape.section, "shape": shape.name, "page_size": shape.page_size,
            "batch": shape.batch, "rows": step.rows, "kv_bytes": kv_bytes, "flops": flops}
    if dev.type != "cuda":  # the CPU smoke checks what each implementation computes; times would mean nothing
        return [{**base, "impl": i.name, "role": i.role, **cases.checked(i, tol=TOL)} for i in impls]

    def figures(seconds):
        if shape.section == "decode":
            return {"gbps": (kv_bytes + qo_bytes) / seconds / 1e9,
                    "roofline_fraction": report.bandwidth_fraction(kv_bytes + qo_bytes, seconds, ceiling["gbps"])}
        return {"tflops": flops / seconds / 1e12,
                "roofline_fraction": report.compute_fraction(flops, seconds, ceiling["tflops"])}

    return cases.measure_case(base, impls, n_rot, args, tol=TOL, figures=figures)


def _sdpa(pl: Placements, q: torch.Tensor, step: cases.Step) -> cases.Impl:
    """torch SDPA per request over its pages gathered into dense K/V (what an engine without paged kernels does)."""
    ends = list(itertools.accumulate(step.new_lengths))
    rows = list(zip([0, *ends[:-1]], ends))

    def fn(r):
        out = torch.empty_like(q[r])
        for b, (lo, hi) in enumerate(rows):
            if hi == lo:
                continue
            n_ctx = step.cache_lengths[b] + hi - lo
            idx = torch.tensor(pl.pages[r][b], device=q.device)
            k = pl.k_cache[idx].flatten(0, 1)[:n_ctx].transpose(0, 1)  # [HK, S, D]
            v = pl.v_cache[idx].flatten(0, 1)[:n_ctx].transpose(0, 1)
            qb = q[r][lo:hi].transpose(0, 1)  # [H, n, D]
            mask = (torch.arange(n_ctx, device=q.device)[None, :]
                    <= step.cache_lengths[b] + torch.arange(hi - lo, device=q.device)[:, None])
            o = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)
            out[lo:hi] = o.transpose(0, 1)
        return out

    return cases.Impl("torch_sdpa_gather", "peer", fn)


def _fa4(peers, pl, q, step, dev) -> cases.Impl:
    fa4, why = peers["fa4"]
    if fa4 is None or dev.type != "cuda":
        return cases.Impl("fa4", "peer", absent=why or "needs a CUDA device")
    same_new = len(set(step.new_lengths)) == 1
    if not same_new:
        return cases.Impl("fa4", "peer", absent="the step's new-token counts differ (FA4 takes q as [B, Lq, H, D])")
    b, lq = step.requests, step.new_lengths[0]

    def fn(r):
        out, _ = fa4(q[r].view(b, lq, Q_HEADS, HEAD_DIM), pl.k_cache, pl.v_cache, seqused_k=pl.seq_lens,
                     page_table=pl.page_tables[r], causal=True)
        return out.view(b * lq, Q_HEADS, HEAD_DIM)

    return cases.Impl("fa4", "peer", fn)


def _flashinfer(peers, pl, q, shape, dev) -> cases.Impl:
    fi, why = peers["flashinfer"]
    name = f"flashinfer_{shape.section}"
    if fi is None or dev.type != "cuda":
        return cases.Impl(name, "peer", absent=why or "needs a CUDA device")
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=dev)
    wrappers = []
    for indices, indptr, last in pl.fi_pages:
        if shape.section == "decode":
            w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, shape.page_size, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16)
        else:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            w.plan(pl.offsets_i32, indptr, indices, last, Q_HEADS, KV_HEADS, HEAD_DIM, shape.page_size, causal=True,
                   q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        wrappers.append(w)
    return cases.Impl(name, "peer", lambda r: wrappers[r].run(q[r], (pl.k_cache, pl.v_cache)))


def optional_peers() -> dict:
    """``{"fa4": (fn | None, why), "flashinfer": (module | None, why)}``: the peers are optional imports."""
    out = {}
    try:
        from flash_attn.cute import flash_attn_varlen_func

        out["fa4"] = (flash_attn_varlen_func, None)
    except Exception as e:  # noqa: BLE001 - a missing or broken install fails at import in many ways
        out["fa4"] = (None, f"flash_attn.cute import failed: {type(e).__name__}: {e}"[:300])
    fi, why = cases.flashinfer_or_reason()
    out["flashinfer"] = (fi, why)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=report.summary(__doc__))
    ap.add_argument("--sections", default="decode,prefill", help="comma list of decode, prefill")
    ap.add_argument("--page-sizes", default="16,64", help="comma list")
    ap.add_argument("--batches", default="1,8,32,128", help="decode batch sizes")
    ap.add_argument("--contexts", default="512,4096,16384", help="decode context lengths")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-new", type=int, default=2048)
    ap.add_argument("--prefill-cached", default="0,4096", help="cached tokens before the prefill")
    cases.smoke_args(ap)
    args = ap.parse_args(argv)
    cases.set_device(args)
    if args.cpu_smoke:
        args.batches, args.contexts, args.page_sizes = "3", "70", "16"
        args.prefill_batch, args.prefill_new, args.prefill_cached = 2, 9, "0,20"
    peers = optional_peers()
    records, ceiling = [], {}
    if args.device == "cuda":
        ceiling = {"gbps": ceilings.copy_bandwidth_gbps()["gbps"],
                   "tflops": ceilings.gemm_tflops(8192, 8192, 8192)["tflops"]}
        print(json.dumps({"bench": "ceilings", **ceiling}), flush=True)
    for shape in shapes(args):
        for r in bench_shape(args, shape, ceiling, peers):
            print(json.dumps(r), flush=True)
            records.append(r)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    records += geomean(records)
    return records


def geomean(records: list[dict]) -> list[dict]:
    """The geometric mean of cute-kv's decode speed-ups over the best peer (timed runs only)."""
    ups = [r["speedup_vs_best_peer"] for r in records
           if r.get("impl") == "cute_kv" and r.get("section") == "decode" and "speedup_vs_best_peer" in r]
    if not ups:
        return []
    rec = {"bench": "paged_attention", "summary": "decode-geomean", "shapes": len(ups),
           "geomean_speedup_vs_best_peer": math.exp(sum(map(math.log, ups)) / len(ups)),
           "min_speedup_vs_best_peer": min(ups)}
    print(json.dumps(rec), flush=True)
    return [rec]


if __name__ == "__main__":
    main()
