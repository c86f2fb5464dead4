"""``python -m cute_kv demo``: a Llama-3-8B-like paged cache driven like an inference engine would drive it.

The block manager owns the pages and builds each step's metadata; each step stores new K/V with
``store_kv`` and runs ``paged_attention`` over the paged cache, and the result is checked against dense
attention over K/V kept, per request, outside the cache. Runs on the GPU when torch sees one.
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from cute_kv.manager import PagedKVCacheManager
from cute_kv.ops.paged_attention import paged_attention
from cute_kv.ops.store_kv import store_kv
from cute_kv.params import KVCacheParams

# (request, new tokens) per step: ragged prefill incl. a 1-token prompt, decode, then a chunked extend beside
# decodes, a request that sits a step out (0 tokens), and late arrivals; "e" repeats the first 100 prompt
# tokens of "c" and then 5 of its own, so the prefix cache serves its first 6 pages.
STEPS = (
    {"a": 37, "b": 1, "c": 100},
    {"a": 1, "b": 1, "c": 1},
    {"a": 1, "b": 0, "c": 40, "d": 17},
    {"a": 1, "b": 1, "c": 1, "d": 1, "e": 105},
)
SHARED_PREFIX = ("e", "c", 100)


def add_parser(commands) -> None:
    p = commands.add_parser("demo", help="run ragged prefill/decode steps on a Llama-3-8B-like paged cache")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--layers", type=int, default=32, help="layers in the cache (default 32, as Llama-3-8B)")
    p.add_argument("--check-layers", default="0,-1",
                   help="comma-separated layers the steps run on, negative from the end (default 0,-1)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pages", type=int, default=None,
                   help="physical pages (default: what the steps need at this page size, plus 4)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, error=p.error)


def pages_needed(page_size: int) -> int:
    """Pages the steps hold at their peak: every request's final length in whole pages (prefix reuse not counted)."""
    totals: dict = {}
    for counts in STEPS:
        for rid, n in counts.items():
            totals[rid] = totals.get(rid, 0) + n
    return sum(-(-n // page_size) for n in totals.values())


def _layers(text: str, num_layers: int) -> list[int]:
    """``--check-layers``: ints in ``[-L, L)``, negative ones counted from the end."""
    try:
        picked = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--check-layers must be comma-separated ints, got {text!r}") from None
    for x in picked:
        if not -num_layers <= x < num_layers:
            raise ValueError(f"--check-layers: layer {x} is outside the cache's {num_layers} layers "
                             f"(use [{-num_layers}, {num_layers}))")
    return sorted({x % num_layers for x in picked})


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    try:
        params = KVCacheParams(torch.bfloat16, n_kv_heads=8, head_dim=128, page_size=args.page_size,
                               total_num_layers=args.layers, enable_prefix_caching=True)
        layers = _layers(args.check_layers, args.layers)
        need = pages_needed(args.page_size)
        if args.pages is None:
            args.pages = need + 4
        elif args.pages < need:
            raise ValueError(f"--pages {args.pages} is below the {need} pages the steps need at page size "
                             f"{args.page_size}")
    except ValueError as e:
        args.error(str(e))
    n_q_heads, d = 32, params.head_dim
    g = torch.Generator().manual_seed(args.seed)
    mgr = PagedKVCacheManager(params, args.pages, devices=[device])
    print(f"cute-kv demo on {device}: Llama-3-8B-like cache, {n_q_heads} q heads / {params.n_kv_heads} kv heads, "
          f"head_dim {d}, bf16, page {params.page_size}, {args.pages} pages x "
          f"{params.bytes_per_block / 2**20:.1f} MiB, running layers {layers} of {args.layers}")
    history = {}  # (request, layer) -> dense (K, V) float64 of every token written so far
    tokens = {}  # request -> token ids so far (the prefix cache hashes them)
    worst = 0.0
    for step, counts in enumerate(STEPS):
        for rid in counts:
            if rid not in mgr:
                mgr.claim(rid)
        rids = list(counts)
        new_ids = [_token_ids(rid, counts[rid], tokens, g) for rid in rids]
        inputs = mgr.allocate(rids, token_ids=new_ids)
        for rid, skipped in zip(rids, inputs.skipped_tokens):
            if skipped:  # served by the prefix cache: its K/V is the donor's
                donor = SHARED_PREFIX[1]
                for layer in layers:
                    history[(rid, layer)] = tuple(x[:skipped] for x in history[(donor, layer)])
                print(f"  prefix cache: request {rid} reuses {skipped} tokens ({skipped // params.page_size} pages) "
                      f"of request {donor}")
        coll, ro = inputs.collections[0], inputs.input_row_offsets[0]
        t = int(ro[-1])
        start = time.perf_counter()
        for layer in layers:
            k, v, q = (torch.randn(t, h, d, generator=g).to(device, torch.bfloat16)
                       for h in (params.n_kv_heads, params.n_kv_heads, n_q_heads))
            store_kv(k, v, ro, coll, layer)
            out = paged_attention(q, ro, coll, layer)
            worst = max(worst, _check(out, q, k, v, ro, rids, layer, history))
        mgr.commit()
        ms = (time.perf_counter() - start) * 1e3
        lengths = ", ".join(f"{r}: {mgr.cache_length(r)}" for r in rids)
        print(f"step {step}: {t:4d} new tokens over {len(rids)} requests -> cache lengths {{{lengths}}}, "
              f"{ms:.1f} ms for {len(layers)} layers")
    mgr.release("b")
    print(mgr)
    ok = worst < 2e-2
    print(f"attention vs dense float64 reference: max relative error {worst:.2e} -> {'OK' if ok else 'FAILED'}")
    _print_layout(params, args.pages, layers[-1])
    return 0 if ok else 1


def _token_ids(rid: str, count: int, tokens: dict, g: torch.Generator) -> list[int]:
    """Random ids for ``count`` new tokens of ``rid``; the late request copies its donor's prompt prefix."""
    ids = torch.randint(0, 128_000, (count,), generator=g).tolist()
    if rid == SHARED_PREFIX[0] and rid not in tokens:
        ids[: SHARED_PREFIX[2]] = tokens[SHARED_PREFIX[1]][: SHARED_PREFIX[2]]
    tokens.setdefault(rid, []).extend(ids)
    return ids


def _check(out, q, k, v, ro, rids, layer, history) -> float:
    """Append this step's K/V to the dense history; return the worst relative error of ``out`` per request."""
    worst = 0.0
    offsets = ro.to(torch.int64).tolist()
    for b, rid in enumerate(rids):
        rows = slice(offsets[b], offsets[b + 1])
        kh, vh = history.get((rid, layer), (k[:0].double().cpu(), v[:0].double().cpu()))
        kh, vh = torch.cat([kh, k[rows].double().cpu()]), torch.cat([vh, v[rows].double().cpu()])
        history[(rid, layer)] = (kh, vh)
        n = rows.stop - rows.start
        if n == 0:
            continue
        qb = q[rows].double().cpu()
        group = qb.shape[1] // kh.shape[1]
        kk, vv = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
        s = torch.einsum("nhd,shd->hns", qb, kk) / math.sqrt(qb.shape[-1])
        pos = kh.shape[0] - n + torch.arange(n)
        s = s.masked_fill(torch.arange(kh.shape[0])[None, :] > pos[:, None], float("-inf"))
        ref = torch.einsum("hns,shd->nhd", s.softmax(-1), vv)
        got = out[rows].double().cpu()
        if not torch.isfinite(got).all():
            return math.inf
        worst = max(worst, float((got - ref).norm() / ref.norm()))
    return worst


def _print_layout(params: KVCacheParams, pages: int, layer: int) -> None:
    """The layout summary of ``inspect`` for this cache (shapes, strides, bytes, CuTe layouts)."""
    from cute_kv.__main__ import build_parser

    print()
    args = build_parser().parse_args(
        ["inspect", "--preset", "llama3-8b", "--layers", str(params.num_layers), "--page-size", str(params.page_size),
         "--pages", str(pages), "--layer", str(layer)])
    args.func(args)
