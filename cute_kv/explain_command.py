"""``cute-kv explain OP``: which path an op takes on sm_90a / sm_100a / sm_103a, its CuTe DSL kernel or the PyTorch reference,
and why: ``cute_kv.explain`` for a cache geometry and a step given on the command line.

The op's arguments are built on the meta device (nothing is allocated, so real model sizes are fine) and explained
with ``validate=False``: the decision reads shapes, dtypes and sizes only, and the command builds valid metadata.
"""

from __future__ import annotations

import argparse

import torch

from cute_kv import inspect
from cute_kv.dtypes import dtype_name, is_fp8, parse_dtype
from cute_kv.kernels.archs import ARCHS

OPS = ("paged_attention", "store_kv", "fused_qkv_matmul_kv_cache", "gather_kv", "sparse_mla_attention")
META = torch.device("meta")


def add_parser(commands) -> None:
    p = commands.add_parser(
        "explain", help="which path an op takes on sm_90a / sm_100a / sm_103a (kernel or reference) and why",
        description="Which path OP takes for this cache and step on each arch: its CuTe DSL kernel (with its "
                    "compile-time key) or the PyTorch reference, and why (cute_kv.explain). No GPU needed.")
    p.add_argument("op", choices=OPS, metavar="OP", help=f"one of: {', '.join(OPS)}")
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=list(ARCHS), help="archs to ask about (default all)")
    g = p.add_argument_group("cache geometry (a preset fills what is not given)")
    inspect.add_geometry_arguments(g)
    g.add_argument("--pages", type=int, help="N, physical pages (default: the pages the step needs)")
    s = p.add_argument_group("step")
    s.add_argument("--cached", type=int, nargs="+", default=[1024], metavar="T",
                   help="tokens already in the cache, one value per request (default 1024: one request)")
    s.add_argument("--new", type=int, nargs="+", default=[1], metavar="N",
                   help="new tokens per request, one value for all or one per request (default 1: decode)")
    s.add_argument("--q-heads", type=int, help="query heads (default: the preset's, else the KV heads)")
    s.add_argument("--act-dtype", help="dtype of q / k / hidden (default: the cache's; bf16 for an fp8 cache)")
    o = p.add_argument_group("op options")
    o.add_argument("--no-causal", action="store_true", help="paged_attention: no causal mask")
    o.add_argument("--window", type=int, help="paged_attention: sliding window")
    o.add_argument("--softcap", type=float, help="attention soft-cap")
    o.add_argument("--sinks", action="store_true", help="attention sinks (one logit per query head)")
    o.add_argument("--return-lse", action="store_true", help="attention also returns its LSE")
    o.add_argument("--tensor-scales", action="store_true",
                   help="store_kv, paged_attention: an fp8 cache scaled per tensor (k_scale / v_scale, vLLM's and "
                        "FlashInfer's)")
    o.add_argument("--mla-v-dim", type=int, help="MLA value width (default: the preset's)")
    o.add_argument("--topk", type=int, default=2048, help="sparse_mla_attention: keys per query (default 2048)")
    o.add_argument("--kv", choices=("k", "v"), default="k", help="gather_kv: K or V (default k)")
    o.add_argument("--hidden", type=int, default=4096, help="fused_qkv_matmul_kv_cache: hidden size (default 4096)")
    o.add_argument("--rope", type=int, metavar="DIM", help="fused_qkv_matmul_kv_cache: RoPE over DIM dims (neox)")
    p.set_defaults(func=run, error=p.error)


def run(args: argparse.Namespace) -> int:
    from cute_kv.ops.explain import explain

    try:
        name, params = inspect.cache_params(args, layers=1)
        cached, new = args.cached, args.new * len(args.cached) if len(args.new) == 1 else args.new
        if len(new) != len(cached) or min(cached + new) < 0:
            raise ValueError(f"--new must give one count or one per request ({len(cached)} --cached values), all "
                             f">= 0; got --cached {cached} --new {args.new}")
        coll, offsets = _step(params, cached, new, args.pages)
        call, kwargs, shown = _arguments(args, name, coll, offsets, sum(new))
        paths = [explain(args.op, *call, arch=arch, **kwargs) for arch in args.arch]
    except (TypeError, ValueError) as e:
        args.error(str(e))
    print(inspect.title(name, params, coll))
    print(f"step: {len(cached)} request{'s' * (len(cached) != 1)}, cached {_list(cached)}, new {_list(new)} "
          f"({sum(new)} rows; max_seq_length {coll.max_seq_length}, max_cache_length {coll.max_cache_length})"
          + "".join(f"; {label} {list(t.shape)} {dtype_name(t.dtype)}" for label, t in shown))
    for path in paths:
        print(f"\n{args.op} on {path.arch}: {path.path}{f' {path.kernel}' if path.kernel else ''}")
        print(f"  why: {path.reason}")
        if path.key is not None:
            print(f"  key: {path.key}")
    return 0


def _step(params, cached: list[int], new: list[int], pages) -> tuple:
    """The cache on the meta device with one step's metadata, and its ragged row offsets."""
    from cute_kv.collection import PagedKVCacheCollection
    from cute_kv.metadata import max_lengths, padded_lut_cols

    p = params.page_size
    need = [-(-(c + n) // p) for c, n in zip(cached, new)]
    pages = sum(need) if pages is None else pages
    if pages < max(sum(need), 1):
        raise ValueError(f"--pages {pages}: the step needs {sum(need)} pages of {p} tokens")
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, pages, device=META)
    max_seq, max_ctx = max_lengths(cached, new)
    b = len(cached)
    lut = torch.empty((b, padded_lut_cols(max(need))), dtype=torch.uint32, device=META)
    quant = params.kvcache_quant_config
    coll = PagedKVCacheCollection(blocks, torch.empty(b, dtype=torch.uint32, device=META), lut, max_seq, max_ctx,
                                  scales, quantization_granularity=quant and quant.quantization_granularity,
                                  rope_dim=params.rope_dim, validate=False)
    return coll, torch.empty(b + 1, dtype=torch.uint32, device=META)


def _arguments(args, preset: str, coll, offsets, t: int) -> tuple[tuple, dict, list]:
    """``(positional, keyword)`` arguments of ``args.op`` over ``coll`` for ``t`` new rows, as a program would pass
    them, and the tensors among them to show, labelled."""
    act = parse_dtype(args.act_dtype) if args.act_dtype else (torch.bfloat16 if is_fp8(coll.dtype) else coll.dtype)
    model = inspect.PRESETS.get(preset, {})
    q_heads = args.q_heads or model.get("q_heads") or coll.num_heads
    d = coll.latent_dim
    # floats: nothing to allocate, and the same path as tensors
    scales = {"k_scale": 1.0, "v_scale": 1.0} if args.tensor_scales else {}
    if args.tensor_scales and args.op not in ("store_kv", "paged_attention"):
        raise ValueError("--tensor-scales is for store_kv and paged_attention")
    if args.op == "gather_kv":
        return (coll, 0), {"kv": args.kv}, []
    if args.op == "store_kv":
        k = torch.empty((t, coll.num_heads, d), dtype=act, device=META)
        return (k, None if coll.is_mla else k, offsets, coll, 0), {"validate": False, **scales}, [("k", k)]
    if args.op == "fused_qkv_matmul_kv_cache":
        from cute_kv.reference.qkv import kv_columns
        from cute_kv.reference.rope import RopeConfig

        hidden = torch.empty((t, args.hidden), dtype=act, device=META)
        weight = torch.empty((q_heads * d + kv_columns(coll), args.hidden), dtype=act, device=META)
        rope = None
        if args.rope is not None:
            rope = RopeConfig(torch.empty((coll.max_cache_length, args.rope), dtype=torch.float32, device=META))
        return ((hidden, offsets, weight, coll, 0), {"rope": rope, "validate": False},
                [("hidden", hidden), ("weight", weight)])
    q = torch.empty((t, q_heads, d), dtype=act, device=META)
    mla_v_dim = args.mla_v_dim or (model.get("mla_v_dim") if coll.is_mla else None)
    sinks = torch.empty(q_heads, dtype=torch.float32, device=META) if args.sinks else None
    kwargs = {"softcap": args.softcap, "sinks": sinks, "return_lse": args.return_lse, "validate": False}
    if args.op == "sparse_mla_attention":
        if mla_v_dim is None:
            raise ValueError("sparse_mla_attention needs --mla-v-dim (or an MLA --preset)")
        indices = torch.empty((t, args.topk), dtype=torch.int32, device=META)
        return (q, offsets, coll, 0, indices), {"mla_v_dim": mla_v_dim, **kwargs}, [("q", q), ("indices", indices)]
    return ((q, offsets, coll, 0), {"causal": not args.no_causal, "window": args.window, "mla_v_dim": mla_v_dim,
                                    **kwargs, **scales}, [("q", q)])


def _list(values: list[int]) -> str:
    return str(values) if len(values) <= 8 else f"[{', '.join(map(str, values[:8]))}, ...]"
