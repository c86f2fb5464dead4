"""MLA decode at DeepSeek-V3 shapes: ``cute_kv.paged_attention`` over an MLA cache beside FlashInfer's MLA decode.

128 query heads over one latent head of 576 (512 + 64 rope), values the first 512 dims, bf16, page 64; batch 1 / 8 /
32 / 128 x context 1k / 4k / 32k, contexts drawn in ``[ctx/2, ctx]`` (ragged). cute-kv reads a ``[pages, 1, 1, P,
1, 576]`` blocks tensor through a uint32 lookup table; FlashInfer (``BatchMLAPagedAttentionWrapper``, absorbed
form) reads the same rows as a ``[pages, P, 512]`` latent cache and a ``[pages, P, 64]`` rope cache with a CSR page
table in the same shuffled page order. Each shape has ``n_rot`` placements of its pages so a batch of calls spans
3x L2. Every output is checked against the float32 reference (``cute_kv.reference.paged_attention``) on placement
0 before it is timed; a peer that is not installed is recorded ``absent`` with the reason.

``--rope-aware``: cute-kv reads rope-aware FP8 rows instead (``[512 e4m3 | 64 bf16]``, 640 bytes and a float32
scale a token: the same random rows quantized), FlashInfer the bf16 rows they decode to (its caches stay bf16).

``--pv-overlap`` (SM90): also ``cute_kv_pv_overlap``, the op's ``MLADecode`` key with ``pv_overlap`` on (each tile's
PV left running through the next tile's softmax; the op dispatches it off, ``kernels/mla/sm90.py`` says why),
checked and timed beside it: ``cute_kv``'s ``speedup_vs_cute_kv_pv_overlap`` is the A/B of the two schedules.

Records as in ``bench_paged_attention``: ``status``, ``rel_err``, ``median_us``, ``host_us``, ``gbps`` and
``roofline_fraction`` of the copy bandwidth (latent rows, q and the output), ``speedup_vs_<peer>``.

    python perf/run.py mla-decode --out perf/results/mla.json [-- --batches 1,128 --contexts 4096]
    python perf/bench_mla_decode.py --cpu-smoke   # tiny shapes on the CPU: outputs checked, nothing timed
    python perf/run.py mla-decode -- --rope-aware   # cute-kv over rope-aware FP8 rows
    python perf/run.py mla-decode -- --pv-overlap   # SM90: both PV schedules of MLADecode
"""

from __future__ import annotations

import argparse
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
from cute_kv.ops import mla_decode
from cute_kv.rope_aware import RopeAwareRow

Q_HEADS, LATENT, V_DIM = 128, 576, 512  # DeepSeek-V3: kv_lora_rank 512 + rope 64
ROPE_AWARE = RopeAwareRow(V_DIM, LATENT - V_DIM)  # 640-byte rows
TOL = 1e-2


class Placements:
    """``n_rot`` disjoint, shuffled placements of one decode step's pages in one latent pool, in both layouts."""

    def __init__(self, step: cases.Step, page_size: int, n_rot: int, device, generator: torch.Generator,
                 rope_aware: bool = False):
        need = [math.ceil((c + n) / page_size) for c, n in zip(step.cache_lengths, step.new_lengths)]
        n_pages = sum(need) * n_rot
        values = torch.Generator(device=device).manual_seed(int(torch.randint(2**31, (1,), generator=generator)))
        rows = torch.randn((n_pages, page_size, LATENT), generator=values, device=device, dtype=torch.bfloat16)
        self.blocks, self.scales, rope_dim = rows[:, None, None, :, None, :], None, None  # [N, 1, 1, P, 1, 576]
        if rope_aware:  # [N, 1, 1, P, 1, 640] e4m3 | bf16 bytes, scales [N, 1, 1, P, 1, 1]; peers read their values
            encoded, scales = ROPE_AWARE.encode(rows.float())
            rows = ROPE_AWARE.decode(encoded, scales).to(torch.bfloat16)
            self.blocks, self.scales = encoded[:, None, None, :, None, :], scales[:, None, None, :, None, :]
            rope_dim = ROPE_AWARE.rope_dim
        self.ckv, self.kpe = rows[..., :V_DIM].contiguous(), rows[..., V_DIM:].contiguous()  # FlashInfer's caches
        self.offsets = input_row_offsets(step.new_lengths, device)
        self.offsets_i32 = self.offsets.to(torch.int32)
        ends = [c + n for c, n in zip(step.cache_lengths, step.new_lengths)]
        self.kv_lens = torch.tensor(ends, dtype=torch.int32, device=device)
        cache_lengths = torch.tensor(step.cache_lengths, dtype=torch.int64).to(device=device, dtype=torch.uint32)
        max_seq, max_ctx = max_lengths(step.cache_lengths, step.new_lengths)
        perm = torch.randperm(n_pages, generator=generator).tolist()
        self.collections, self.csr = [], []
        for r in range(n_rot):
            start = r * sum(need)
            pages = [perm[start + s:start + s + n] for s, n in zip(itertools.accumulate([0, *need]), need)]
            self.collections.append(PagedKVCacheCollection(
                self.blocks, cache_lengths, make_lookup_table(pages, n_pages, device=device), max_seq, max_ctx,
                self.scales, rope_dim=rope_dim, validate=False))
            indices, indptr, _ = cases.flashinfer_pages(pages, step, page_size, device)
            self.csr.append((indptr, indices))


def steps(args) -> list[tuple[int, int, cases.Step]]:
    """``(batch, context, step)``: one new token per request after ``[context/2, context]`` cached (seeded)."""
    out = []
    for b in cases.ints(args.batches):
        for ctx in cases.ints(args.contexts):
            g = torch.Generator().manual_seed(b * 131 + ctx)
            cached = torch.randint(max(ctx // 2, 1), ctx + 1, (b,), generator=g).tolist()
            out.append((b, ctx, cases.Step(tuple(c - 1 for c in cached), (1,) * b)))
    return out


def bench_step(args, batch: int, context: int, step: cases.Step, ceiling: dict, fi) -> list[dict]:
    dev = torch.device(args.device)
    page = args.page_size
    row_bytes = ROPE_AWARE.row_bytes + 4 if args.rope_aware else LATENT * 2  # (a float32 scale a token)
    kv_bytes = sum(c + n for c, n in zip(step.cache_lengths, step.new_lengths)) * row_bytes
    qo_bytes = step.rows * Q_HEADS * (LATENT + V_DIM) * 2
    n_rot = 1 if dev.type != "cuda" else harness.rotation_count(kv_bytes + qo_bytes, harness.l2_bytes(),
                                                                max_sets=32)
    pl = Placements(step, page, n_rot, dev, torch.Generator().manual_seed(page), args.rope_aware)
    q = torch.randn((n_rot, step.rows, Q_HEADS, LATENT), generator=torch.Generator(device=dev).manual_seed(1),
                    device=dev, dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(LATENT)
    want = reference.paged_attention(q[0], pl.offsets, pl.collections[0], 0, mla_v_dim=V_DIM, scale=scale).float()

    def check(fn):
        err = float((fn(0).float() - want).norm() / want.norm())
        return err if math.isfinite(err) else math.inf

    def ours(r):
        return cute_kv.paged_attention(q[r], pl.offsets, pl.collections[r], 0, mla_v_dim=V_DIM, scale=scale,
                                       validate=False)

    impls = [cases.Impl("cute_kv", "ours", ours), _flashinfer(fi, pl, q, page, scale, dev)]
    if args.pv_overlap:
        impls.append(_pv_overlap(pl, q, scale, dev))
    for impl in impls:
        impl.check = check
    base = {"bench": "mla_decode", "shape": f"decode B={batch} ctx={context} P={page}", "batch": batch,
            "context": context, "page_size": page, "kv_bytes": kv_bytes, "rope_aware": args.rope_aware}
    if dev.type != "cuda":  # the CPU smoke checks what each implementation computes; times would mean nothing
        return [{**base, "impl": i.name, "role": i.role, **cases.checked(i, tol=TOL)} for i in impls]

    def figures(seconds):
        return {"gbps": (kv_bytes + qo_bytes) / seconds / 1e9,
                "roofline_fraction": report.bandwidth_fraction(kv_bytes + qo_bytes, seconds, ceiling["gbps"])}

    return cases.measure_case(base, impls, n_rot, args, tol=TOL, figures=figures)


def _flashinfer(fi, pl: Placements, q: torch.Tensor, page: int, scale: float, dev) -> cases.Impl:
    """FlashInfer's absorbed MLA decode over the split latent / rope caches (its flat-CSR plan form)."""
    fi, why = fi
    if fi is None or dev.type != "cuda":
        return cases.Impl("flashinfer_mla", "peer", absent=why or "needs a CUDA device")
    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device=dev)
    wrappers = []
    for indptr, indices in pl.csr:
        w = fi.mla.BatchMLAPagedAttentionWrapper(workspace)
        w.plan(pl.offsets_i32, indptr, indices, pl.kv_lens, Q_HEADS, V_DIM, LATENT - V_DIM, page, False, scale,
               torch.bfloat16, torch.bfloat16)
        wrappers.append(w)
    return cases.Impl("flashinfer_mla", "peer",
                      lambda r: wrappers[r].run(q[r][..., :V_DIM], q[r][..., V_DIM:], pl.ckv, pl.kpe))


def _pv_overlap(pl: Placements, q: torch.Tensor, scale: float, dev) -> cases.Impl:
    """``MLADecode`` with ``pv_overlap`` on: the op's key for this call with its last field set, launched by the op's
    own launcher."""
    name = "cute_kv_pv_overlap"
    if dev.type != "cuda":
        return cases.Impl(name, "variant", absent="needs a CUDA device")
    path = cute_kv.explain(cute_kv.paged_attention, q[0], pl.offsets, pl.collections[0], 0, mla_v_dim=V_DIM,
                           scale=scale)
    if path.kernel != mla_decode.KERNEL:
        return cases.Impl(name, "variant", absent=f"the op runs {path.kernel or 'the reference'} here: {path.reason}")
    run = mla_decode.launcher((*path.key[:-1], True), path.arch)

    def call(r):
        out = torch.empty((q.shape[1], Q_HEADS, V_DIM), dtype=q.dtype, device=q.device)
        return run(q[r], pl.offsets, pl.collections[r], 0, mla_v_dim=V_DIM, scale=scale, out=out)

    return cases.Impl(name, "variant", call)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=report.summary(__doc__))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--batches", default="1,8,32,128", help="comma list")
    ap.add_argument("--contexts", default="1024,4096,32768", help="comma list")
    ap.add_argument("--rope-aware", action="store_true", help="cute-kv over rope-aware FP8 rows (640 bytes)")
    ap.add_argument("--pv-overlap", action="store_true",
                    help="SM90: also MLADecode with each tile's PV left running through the next softmax")
    cases.smoke_args(ap)
    args = ap.parse_args(argv)
    cases.set_device(args)
    if args.cpu_smoke:
        args.batches, args.contexts, args.page_size = "3", "70", 16
    fi = cases.flashinfer_or_reason()
    records, ceiling = [], {}
    if args.device == "cuda":
        ceiling = {"gbps": ceilings.copy_bandwidth_gbps()["gbps"]}
        print(json.dumps({"bench": "ceilings", **ceiling}), flush=True)
    for batch, context, step in steps(args):
        for r in bench_step(args, batch, context, step, ceiling, fi):
            print(json.dumps(r), flush=True)
            records.append(r)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return records


if __name__ == "__main__":
    main()
