"""``python -m cute_kv selftest``: every op against its PyTorch reference on small random cases, one table.

The first command to run on a GPU: for each op, each cache dtype and page size its kernel takes, a paged decode
step and a ragged prefill step (requests with 0 and 1 new tokens, an empty cache, pages crossed), on shuffled pages.
Per case: the path the call took (``cute_kv.explain``), the largest error against the reference (the op's output,
and the whole cache after it: rows outside the step must not move), pass/fail, and on CUDA the time of one call
beside the reference's and, for attention, FlashInfer's when it is installed (checked against the reference
first). Outputs start as NaN, so a row left unwritten fails. Without CUDA there is nothing to test: the ops are the
reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import zlib
from typing import Callable, Optional, Sequence

import torch

import cute_kv
from cute_kv import reference
from cute_kv.ops.paths import device_arch
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns

FP8 = torch.float8_e4m3fn
# Ragged: an empty cache, a 1-token prompt, a request sitting the step out, a run crossing pages.
RAGGED = ((0, 37, 5, 1, 70), (5, 1, 0, 1, 17))
DECODE = ((0, 37, 5, 1, 70), (1, 1, 1, 1, 1))
STEPS = {"decode": DECODE, "ragged": RAGGED}
CACHES = {
    "bf16": {"dtype": torch.bfloat16},
    "fp16": {"dtype": torch.float16},
    "fp32": {"dtype": torch.float32},
    "fp8 f32 scales": {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 64},
    "fp8 e8m0 scales": {"dtype": FP8, "scale_dtype": torch.float8_e8m0fnu, "quantization_granularity": 32},
    "fp8": {"dtype": FP8},
    "mla": {"dtype": torch.bfloat16, "is_mla": True, "num_heads": 1},
}
# Relative error (max |ours - ref| / max |ref|) a correct kernel stays under: a unit or two in the last place of the
# output dtype at its largest value; fp8 more (one rounding flip moves a stored e4m3 value by an eighth of itself).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, FP8: 7e-2}
LAYER = 1


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    cache: str
    page_size: int
    head_size: int
    step: str

    @property
    def config(self) -> str:
        return f"{self.cache} P={self.page_size} D={self.head_size} {self.step}"

    def seed(self, salt: int = 0) -> int:
        """Stable across processes (``hash`` of a str is not)."""
        return zlib.crc32(repr(self).encode()) + salt


@dataclasses.dataclass
class Row:
    case: Case
    path: str
    max_err: float
    ok: bool
    ours_ms: Optional[float] = None
    ref_ms: Optional[float] = None
    peer_ms: Optional[float | str] = None  # FlashInfer's time, or why there is none
    error: Optional[str] = None


QUICK_CACHES = ("bf16", "fp8 f32 scales")


def cases(quick: bool = False) -> list[Case]:
    """Every op x the caches, page sizes and head dims its kernel serves, each as a decode and a ragged step;
    ``quick``: bf16 and scaled fp8 caches, pages 16 and 64, the two largest head dims."""
    pages = (16, 64) if quick else (16, 64, 128)
    grid = {
        "store_kv": (["bf16", "fp16", "fp32", "fp8 f32 scales", "mla"], (128,)),
        "fused_qkv_matmul_kv_cache": (["bf16", "fp16"], (128,)),
        "paged_attention": (["bf16", "fp16", "fp8 f32 scales", "fp8 e8m0 scales", "fp8"], (64, 128, 256)),
        "gather_kv": (["bf16", "fp16"], (128,)),
    }
    out = []
    for op, (caches, heads) in grid.items():
        for cache in [x for x in caches if x in QUICK_CACHES] if quick else caches:
            for p in pages:
                for d in heads[-2:] if quick else heads:
                    for step in STEPS:
                        out.append(Case(op, cache, p, d, step))
    return out


# -- one op on one case ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    """``call(fn, collection)`` runs ``fn`` (``ours`` or ``ref``) on one case's inputs; ``peer(fi)`` builds FlashInfer's
    call on the same pages, where it computes the same thing."""

    ours: Callable
    ref: Callable
    call: Callable
    out_dtype: torch.dtype
    peer: Optional[Callable] = None


def _setup(case: Case, pb, g: torch.Generator, device) -> Setup:
    """Random inputs for ``case`` on the batch ``pb`` (activations in the cache dtype, bf16 for fp8 caches)."""
    c = pb.collection
    t, h, d = pb.total_rows, c.num_heads, c.head_size
    act = torch.bfloat16 if c.dtype == FP8 else c.dtype

    def randn(*shape, dtype=act, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)

    buffers = {}

    def nan_buffer(collection, shape, dtype):
        """One output per collection, NaN until written (a row left unwritten shows), reused by timed calls."""
        key = id(collection)
        if key not in buffers:
            buffers[key] = torch.full(shape, math.nan, dtype=dtype, device=device)
        return buffers[key]

    if case.op == "store_kv":
        k, v = randn(t, h, d), None if c.is_mla else randn(t, h, d)
        return Setup(cute_kv.store_kv, reference.store_kv, lambda fn, col: fn(k, v, pb.input_row_offsets, col, LAYER),
                     act)
    if case.op == "fused_qkv_matmul_kv_cache":
        hidden = randn(t, 256)
        weight = randn(4 * h * d + kv_columns(c), 256, scale=1 / 16)
        rope = cute_kv.RopeConfig.from_theta(d, 256, 500000.0, device=device)

        def call(fn, col):
            out = nan_buffer(col, (t, 4 * h * d), act)
            return fn(hidden, pb.input_row_offsets, weight, col, LAYER, rope=rope, output=out)

        return Setup(cute_kv.fused_qkv_matmul_kv_cache, reference.fused_qkv_matmul_kv_cache, call, act)
    if case.op == "paged_attention":
        q = randn(t, 4 * h, d)
        mla_v_dim = d // 2 if c.is_mla else None

        def call(fn, col):
            out = nan_buffer(col, (t, 4 * h, mla_v_dim or d), act)
            return fn(q, pb.input_row_offsets, col, LAYER, causal=True, mla_v_dim=mla_v_dim, out=out)

        peer = None
        if c.dtype in (torch.bfloat16, torch.float16) and not c.is_mla:
            peer = functools.partial(flashinfer_attention, pb=pb, q=q, decode=case.step == "decode")
        return Setup(cute_kv.paged_attention, reference.paged_attention, call, act, peer)
    if case.op == "gather_kv":
        def call(fn, col):
            out = nan_buffer(col, (c.batch_size, c.max_cache_length, h, d), c.dtype)
            fn(col, LAYER, kv="v", out=out)
            return torch.cat([out[b, :n] for b, n in enumerate(pb.cache_lengths)])  # past a request's length: free

        return Setup(cute_kv.gather_kv, _gather_reference, call, c.dtype)
    raise ValueError(f"unknown op {case.op!r}")


def flashinfer_attention(fi, *, pb, q: torch.Tensor, decode: bool) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged attention over the same pages as ``pb`` (layer ``LAYER``'s K/V planes, copied contiguous):
    its CSR page table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), the decode wrapper for one token per
    request, else the causal prefill wrapper over the ragged rows."""
    c, dev, p = pb.collection, q.device, pb.collection.page_size
    k_cache, v_cache = c.blocks[:, 0, LAYER].contiguous(), c.blocks[:, 1, LAYER].contiguous()
    ends = [cl + n for cl, n in zip(pb.cache_lengths, pb.new_lengths)]
    used = [-(-e // p) for e in ends]

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    indices = i32([page for b, n in enumerate(used) for page in pb.pages[b][:n]])
    indptr = i32([0, *itertools.accumulate(used)])
    last = i32([e - (n - 1) * p if n else 0 for e, n in zip(ends, used)])
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=dev)
    heads = (q.shape[1], c.num_heads, c.head_size, p)
    if decode:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(indptr, indices, last, *heads, q_data_type=q.dtype, kv_data_type=c.dtype)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(pb.input_row_offsets.to(torch.int32), indptr, indices, last, *heads, causal=True,
               q_data_type=q.dtype, kv_data_type=c.dtype)
    return lambda: w.run(q, (k_cache, v_cache))


def _gather_reference(collection, layer_idx, *, kv, out):
    cache = collection.get_value_cache(layer_idx) if kv == "v" else collection.get_key_cache(layer_idx)
    for b, n in enumerate(collection.cache_lengths.tolist()):
        out[b, :n] = cache.gather(b, 0, n, collection.dtype)
    return out


def _batch(case: Case, device):
    cached, new = STEPS[case.step]
    kw = {"num_heads": 2, **CACHES[case.cache]}
    return random_paged_batch(cached, new, head_size=case.head_size, page_size=case.page_size, num_layers=2,
                              generator=torch.Generator().manual_seed(case.seed()), device=device, **kw)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float64; inf where they disagree on NaN or any value is not finite."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return math.inf
    finite = ~want.isnan()
    diff = (got - want)[finite].abs()
    if not bool(diff.isfinite().all()):
        return math.inf
    scale = max(float(want[finite].abs().max()) if finite.any() else 0.0, 1e-30)
    return float(diff.max()) / scale if diff.numel() else 0.0


def run_case(case: Case, device, ours: Optional[Callable] = None, *, time_calls: bool = False,
             flashinfer=None) -> Row:
    """``ours`` (default: the ``cute_kv`` entry point) against the reference on twin batches of ``case``; with
    ``time_calls`` on CUDA, both timed, and ``flashinfer`` (a module) beside them where it computes the same."""
    device = torch.device(device)
    try:
        pb, twin = _batch(case, device), _batch(case, device)
        g = torch.Generator().manual_seed(case.seed(1))
        setup = _setup(case, pb, g, device)
        fn = ours or setup.ours
        path = _path(case, setup.ours, setup.call, pb.collection)
        got, want = setup.call(fn, pb.collection), setup.call(setup.ref, twin.collection)
        errs = [rel_err(pb.collection.blocks, twin.collection.blocks)]
        if pb.collection.scales is not None:
            errs.append(rel_err(pb.collection.scales, twin.collection.scales))
        if got is not None:
            errs.append(rel_err(got, want))
        err = max(errs)
        tol = TOLERANCE[pb.collection.dtype if case.op in ("store_kv", "gather_kv") else setup.out_dtype]
        row = Row(case, path, err, err <= tol)
        if time_calls and device.type == "cuda":
            row.ours_ms = _time_ms(lambda: setup.call(fn, pb.collection))
            row.ref_ms = _time_ms(lambda: setup.call(setup.ref, twin.collection))
            if flashinfer is not None and setup.peer is not None:
                row.peer_ms = _peer_ms(setup.peer, flashinfer, want, tol)
        return row
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        return Row(case, "error", math.inf, False, error=f"{type(e).__name__}: {e}")


def _peer_ms(build: Callable, flashinfer, want: torch.Tensor, tol: float):
    """The peer's time, or why there is none ("wrong": its output is off the reference; "error": it raised)."""
    try:
        run = build(flashinfer)
        if rel_err(run(), want) > tol:
            return "wrong"
        return _time_ms(run)
    except Exception:  # noqa: BLE001 - a peer's failure says nothing about cute-kv
        return "error"


def _path(case: Case, entry: Callable, call: Callable, collection) -> str:
    """``kernel <Name>`` or ``reference``, as ``cute_kv.explain`` decides for this call."""
    holder = {}

    def explain(*args, **kwargs):
        holder["path"] = cute_kv.explain(entry, *args, **kwargs)
        return None

    call(explain, collection)
    p = holder["path"]
    return f"kernel {p.kernel}" if p.path == "kernel" else "reference"


def _time_ms(fn: Callable, iters: int = 20) -> float:
    """Median of ``iters`` single calls, CUDA events around each (after a warm-up call that compiles)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def table(rows: Sequence[Row]) -> str:
    """One line per case: op, config, path, max error, pass/fail, and the times where measured."""
    head = (f"{'op':26s} {'config':32s} {'path':24s} {'max err':>9s} {'':4s} {'ours ms':>8s} {'ref ms':>8s} "
            f"{'flashinfer ms':>13s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = "".join(_cell(x, w) for x, w in ((r.ours_ms, 8), (r.ref_ms, 8), (r.peer_ms, 13)))
        lines.append(f"{r.case.op:26s} {r.case.config:32s} {r.path:24s} {r.max_err:9.2e} "
                     f"{'ok' if r.ok else 'FAIL':4s}{ms}" + (f"  {r.error}" if r.error else ""))
    failed = sum(not r.ok for r in rows)
    lines.append(f"{len(rows) - failed} of {len(rows)} passed" + (f"; {failed} FAILED" if failed else ""))
    return "\n".join(lines)


def _cell(x, width: int) -> str:
    if x is None:
        return f" {'-':>{width}s}"
    return f" {x:>{width}.3f}" if isinstance(x, float) else f" {x:>{width}s}"


def add_parser(commands) -> None:
    p = commands.add_parser("selftest", help="run every kernel against the reference on small random cases (GPU)")
    p.add_argument("--quick", action="store_true", help="fewer dtypes, page sizes and head dims")
    p.add_argument("--ops", default=None, help="comma list of ops (default: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("cute-kv selftest: no CUDA device, nothing to test (the kernels run on SM90/SM100 GPUs; on the CPU "
              "every op is its PyTorch reference)")
        return 0
    chosen = cases(args.quick)
    if args.ops:
        wanted = set(args.ops.split(","))
        chosen = [c for c in chosen if c.op in wanted]
    device = torch.device("cuda")
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - an optional peer; a broken install fails at import in many ways
        flashinfer, peer = None, f"flashinfer not timed ({type(e).__name__}; pip install -e '.[peers]')"
    else:
        peer = f"flashinfer {getattr(flashinfer, '__version__', '')} timed beside paged_attention"
    print(f"cute-kv selftest on {torch.cuda.get_device_name(device)} ({device_arch(device)}): {len(chosen)} cases; "
          f"{peer}")
    rows = [run_case(c, device, time_calls=True, flashinfer=flashinfer) for c in chosen]
    print(table(rows))
    return 0 if all(r.ok for r in rows) else 1
