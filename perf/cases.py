"""What the cache-write benchmarks (``bench_store_kv``, ``bench_fused_qkv``) share.

Llama-3-8B shapes; ragged steps placed in a shuffled page pool several times over (so calls rotate past L2);
the destination rows an engine's torch or FlashInfer path computes once per step; and the timing of one
implementation (checked first, then eager, CUDA-graph replay and host cost) as a record.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Callable, Optional, Sequence

import torch

from cute_kv import PagedKVCacheCollection
from cute_kv.metadata import input_row_offsets, make_lookup_table, max_lengths
from cute_kv.reference.ragged import ragged_coords

import harness
import report

# Llama-3-8B attention.
HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, ROPE_THETA = 4096, 32, 8, 128, 500000.0


@dataclasses.dataclass(frozen=True)
class Step:
    """Request ``b`` has ``cache_lengths[b]`` tokens cached and writes ``new_lengths[b]`` new ones."""

    cache_lengths: tuple[int, ...]
    new_lengths: tuple[int, ...]

    @property
    def rows(self) -> int:
        return sum(self.new_lengths)

    @property
    def requests(self) -> int:
        return len(self.new_lengths)

    @property
    def max_context(self) -> int:
        return max(c + n for c, n in zip(self.cache_lengths, self.new_lengths))


def decode_step(requests: int = 128, min_context: int = 1024, max_context: int = 4096, seed: int = 0) -> Step:
    """One new token per request after a context drawn uniformly from ``[min_context, max_context]`` (seeded)."""
    g = torch.Generator().manual_seed(seed)
    cached = torch.randint(min_context, max_context + 1, (requests,), generator=g).tolist()
    return Step(tuple(cached), (1,) * requests)


def prefill_step(requests: int, new_tokens: int) -> Step:
    return Step((0,) * requests, (new_tokens,) * requests)


STEPS = {
    "decode": decode_step(),          # B=128 x 1 token, context 1-4k
    "prefill": prefill_step(8, 1024),  # T=8192
    "bulk": prefill_step(32, 1024),    # T=32768: bandwidth-bound
}


def flat_rows(collection, row_offsets: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[T]`` rows of each new token's K and V in ``blocks.view(-1, H, D)`` (``blocks[N, 2, L, P, H, D]``).

    What an engine's torch path computes once per step (outside the per-layer write) from its page table.
    """
    c = collection
    batch, pos = ragged_coords(row_offsets, c.cache_lengths)
    page = c.lookup_table.to(torch.int64)[batch, pos // c.page_size]
    plane = c.num_layers * c.page_size  # rows from K's plane of a layer to V's
    k_rows = (page * c.kv_dim * c.num_layers + layer_idx) * c.page_size + pos % c.page_size
    return k_rows, k_rows + plane


def index_copy_store(flat: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
    """The torch peer: scatter ``k``/``v [T, H, D]`` into the flat row view at precomputed rows."""
    flat.index_copy_(0, k_rows, k)
    flat.index_copy_(0, v_rows, v)


def flashinfer_pages(pages: Sequence[Sequence[int]], step: Step, page_size: int,
                     device=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int32 ``(kv_indices, kv_indptr, kv_last_page_len)`` of FlashInfer's CSR page table, new tokens included
    (``append_paged_kv_cache`` writes token ``pos`` of ``b`` on page ``kv_indices[kv_indptr[b] + pos // P]``)."""
    ends = [c + n for c, n in zip(step.cache_lengths, step.new_lengths)]
    used = [math.ceil(e / page_size) for e in ends]
    indices = [p for b, n in enumerate(used) for p in pages[b][:n]]
    indptr = [0, *itertools.accumulate(used)]
    last = [e - (n - 1) * page_size for e, n in zip(ends, used)]
    return tuple(torch.tensor(x, dtype=torch.int32, device=device) for x in (indices, indptr, last))


class PagedSets:
    """``n_sets`` placements of one step in one shared page pool, each with its own random page order and set ``r``
    on layer ``r % num_layers``: consecutive calls write different rows, so none finds its destination in L2.

    ``blocks[N, 2, L, P, H, D]`` holds exactly the pages the step needs; contents are left as allocated
    (nothing here reads the context). Per set: a collection (``validate=False``: the metadata is built here),
    the torch peer's rows and FlashInfer's page table.
    """

    def __init__(self, step: Step, *, page_size: int, num_layers: int, n_sets: int, generator: torch.Generator,
                 num_heads: int = KV_HEADS, head_size: int = HEAD_DIM, dtype=torch.bfloat16, device=None):
        self.num_layers = num_layers
        need = [math.ceil((c + n) / page_size) for c, n in zip(step.cache_lengths, step.new_lengths)]
        n_pages = sum(need)
        self.blocks = torch.empty((n_pages, 2, num_layers, page_size, num_heads, head_size), dtype=dtype,
                                  device=device)
        self.flat = self.blocks.view(-1, num_heads, head_size)
        # Per layer (K plane, V plane), as an engine holds them: FlashInfer takes the strided views as they are.
        self.planes = [(self.blocks[:, 0, layer], self.blocks[:, 1, layer]) for layer in range(num_layers)]
        self.input_row_offsets = input_row_offsets(step.new_lengths, device)
        cache_lengths = torch.tensor(step.cache_lengths, dtype=torch.int64).to(device=device, dtype=torch.uint32)
        batch, self.positions = ragged_coords(self.input_row_offsets, cache_lengths)
        self.fi_batch, self.fi_positions = batch.to(torch.int32), self.positions.to(torch.int32)
        max_seq, max_ctx = max_lengths(step.cache_lengths, step.new_lengths)
        self.collections, self.rows, self.fi_pages = [], [], []
        for r in range(n_sets):
            perm = torch.randperm(n_pages, generator=generator).tolist()
            pages = [perm[start:start + n] for start, n in zip(itertools.accumulate([0, *need]), need)]
            c = PagedKVCacheCollection(self.blocks, cache_lengths, make_lookup_table(pages, n_pages, device=device),
                                       max_seq, max_ctx, validate=False)
            self.collections.append(c)
            self.rows.append(flat_rows(c, self.input_row_offsets, self.layer(r)))
            self.fi_pages.append(flashinfer_pages(pages, step, page_size, device))

    def layer(self, r: int) -> int:
        return r % self.num_layers

    def write_error(self, fn: Callable[[int], object], k_expected: torch.Tensor, v_expected: torch.Tensor) -> float:
        """Relative error of the rows ``fn(0)`` writes for set 0 (NaN first, so a row left unwritten shows: inf)."""
        k_rows, v_rows = self.rows[0]
        self.flat.index_fill_(0, torch.cat((k_rows, v_rows)), float("nan"))
        fn(0)
        err = 0.0
        for rows, want in ((k_rows, k_expected), (v_rows, v_expected)):
            got, want = self.flat[rows].float(), want.float()
            e = float((got - want).norm() / want.norm())
            err = max(err, e if math.isfinite(e) else math.inf)
        return err


def flashinfer_or_reason():
    """``(flashinfer, None)``, or ``(None, why)`` when it cannot be imported (the peer is then recorded absent).
    FlashInfer is optional: ``pip install -e ".[peers]"``; it JIT-compiles its kernels on first use."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - a broken install fails at import in many ways
        return None, f"flashinfer import failed: {type(e).__name__}: {e}"
    return flashinfer, None


@dataclasses.dataclass
class Impl:
    """One implementation of a case: ``fn(r)`` runs it on input set ``r``; ``role`` is ``ours``, ``peer`` (does the
    same work), ``bound`` (part of the work only, e.g. the GEMM alone) or ``variant`` (our kernel compiled another
    way, for an A/B); ``check`` returns its error on set 0."""

    name: str
    role: str
    fn: Optional[Callable[[int], object]] = None
    check: Optional[Callable[[Callable[[int], object]], float]] = None
    absent: Optional[str] = None  # why it cannot run here


def checked(impl: Impl, *, tol: float) -> dict:
    """``status`` (ok / wrong / error / absent) and ``rel_err`` of ``impl`` without timing it: the CPU smoke, where
    times would mean nothing."""
    if impl.absent:
        return {"status": "absent", "error": impl.absent}
    try:
        err = impl.check(impl.fn)
    except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:1000]}
    return {"status": "ok" if err <= tol else "wrong", "rel_err": err}


def measure(impl: Impl, n_rot: int, *, tol: float, samples: int, host_iters: int) -> dict:
    """``status`` (ok / wrong / error / absent), ``rel_err``, eager and graph times, host cost of one eager call.

    ``median_us``/``p10_us``/``p90_us`` are from graph replay (GPU time) when the calls can be captured, else eager.
    """
    rec: dict = {"impl": impl.name, "role": impl.role}
    if impl.absent:
        return {**rec, "status": "absent", "error": impl.absent}
    try:
        if impl.check:
            rec["rel_err"] = impl.check(impl.fn)
        rec["status"] = "wrong" if rec.get("rel_err", 0.0) > tol else "ok"
        eager = harness.time_cuda(impl.fn, n_rot, samples=samples)
        rec.update(n_rot=n_rot, calls_per_sample=eager.calls_per_sample, eager_us=eager.median_us)
        best = eager
        try:
            best = harness.time_cuda(impl.fn, n_rot, samples=samples, graph=True)
            rec["graph_us"] = best.median_us
        except Exception as e:  # noqa: BLE001 - a call that syncs cannot be captured: it is timed eagerly only
            rec["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        rec.update(timing="graph" if "graph_us" in rec else "eager", median_us=best.median_us, p10_us=best.p10_us,
                   p90_us=best.p90_us)
        calls = itertools.count()
        rec["host_us"] = harness.host_cost(lambda: impl.fn(next(calls) % n_rot), iters=host_iters,
                                           sync=torch.cuda.synchronize)
    except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others' figures
        rec.update(status="error", error=f"{type(e).__name__}: {e}"[:1000])
    return rec


def measure_case(base: dict, impls: Sequence[Impl], n_rot: int, args, *, tol: float,
                 figures: Callable[[float], dict]) -> list[dict]:
    """One record per implementation (``base`` + ``measure``); an ok one also gets ``figures(seconds per call)``,
    and ours get their speed-ups."""
    records = [{**base, **measure(i, n_rot, tol=tol, samples=args.samples, host_iters=args.host_iters)}
               for i in impls]
    for r in records:
        if r["status"] == "ok":
            r.update(figures(r["median_us"] * 1e-6))
    add_speedups(records)
    return records


def add_speedups(records: list[dict]) -> None:
    """On each of our ok records: ``speedup_vs_<impl>`` (its time / ours) for every other ok record, graph times when
    both have them else eager; ``speedup_vs_best_peer`` over the ``peer`` role (those doing the same work)."""
    ok = [r for r in records if r["status"] == "ok"]
    for ours in (r for r in ok if r["role"] == "ours"):
        for other in (r for r in ok if r["role"] != "ours"):
            key = "graph_us" if "graph_us" in ours and "graph_us" in other else "eager_us"
            ours[f"speedup_vs_{other['impl']}"] = report.speedup(ours[key], other[key])
        peers = [ours[f"speedup_vs_{r['impl']}"] for r in ok if r["role"] == "peer"]
        if peers:
            ours["speedup_vs_best_peer"] = min(peers)


def run_grid(args, bench_case: Callable[..., list[dict]]) -> list[dict]:
    """``bench_case(name, page_size, flashinfer, why_absent)`` over ``--cases`` x ``--page-sizes``; prints records."""
    fi, fi_why = flashinfer_or_reason()
    records = []
    for name in args.cases.split(","):
        for page_size in ints(args.page_sizes):
            for r in bench_case(name, page_size, fi, fi_why):
                print(json.dumps(r), flush=True)
                records.append(r)
            torch.cuda.empty_cache()  # the next case's pool may be as large (~10 GiB for decode at 8 layers)
    return records


def common_args(ap) -> None:
    ap.add_argument("--page-sizes", default="16,64", help="comma list")
    ap.add_argument("--layers", type=int, default=8,
                    help="layers per page (the pool's size; 32 makes the decode pool ~40 GiB)")
    ap.add_argument("--samples", type=int, default=30, help="timed samples per measurement")
    ap.add_argument("--host-iters", type=int, default=200, help="eager calls timed for the host cost")


def smoke_args(ap) -> None:
    """The attention benches' timing options and ``--cpu-smoke`` (their shapes are their own)."""
    ap.add_argument("--samples", type=int, default=30, help="timed samples per measurement")
    ap.add_argument("--host-iters", type=int, default=100, help="eager calls timed for the host cost")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes on the CPU: every implementation checked, nothing timed")


def set_device(args) -> None:
    """``args.device``: the CPU for ``--cpu-smoke``, else CUDA with TF32 matmuls off (the float32 references must
    be float32)."""
    args.device = "cpu" if args.cpu_smoke else "cuda"
    if not args.cpu_smoke:
        torch.backends.cuda.matmul.allow_tf32 = False


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]
