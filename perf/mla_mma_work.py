"""``python perf/run.py mla-mma-work``: tensor-core work per key of MLA decode on SM100, read from PTX (no GPU).

Per kernel: the ``tcgen05.mma`` instructions of one key tile (every MMA of the PTX: the kernel's loop issues each
once a tile; ``static.tcgen05_mmas`` decodes the shapes), as QK (B: the keys, K-major) and P V (B: the values,
MN-major), and the FLOPs a key costs the CTAs that together serve ``--heads`` query heads of one token, against the
minimum ``2 * (kv_lora_rank + rope_dim) * heads + 2 * kv_lora_rank * heads`` (S over 576 columns, O over 512, each
computed once).

    python perf/run.py mla-mma-work
    python perf/run.py mla-mma-work -- --flashmla-ptx head64_v32.ptx

cute-kv: ``MlaDecodeSm100`` over a 16-bit cache and over rope-aware FP8 rows (the catalog's 128-head dense
configurations); a CTA takes ``BM`` packed rows and one of ``V_SPLIT`` value halves, so ``ceil(heads / BM) *
V_SPLIT`` CTAs serve a token. FlashMLA's SM100 decode (``csrc/sm100/decode/head64``: ``B_H`` = 64 heads and
``B_TOPK`` = 64 keys a tile; 128 heads run as two head64 CTAs) is C++: its PTX comes from ``nvcc -std=c++20
-arch=sm_100a -ptx`` of ``instantiations/v32.cu`` with its CUTLASS submodule's ``include`` on the path.
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

import static
from report import summary

LATENT, V_DIM = 576, 512  # DeepSeek-V3: kv_lora_rank + rope_dim, kv_lora_rank
ARCH = "sm_100a"


def min_flops_per_key(heads: int, latent_dim: int = LATENT, v_dim: int = V_DIM) -> int:
    """S = Q K^T over ``latent_dim`` and O = P V over ``v_dim``, once per head."""
    return 2 * latent_dim * heads + 2 * v_dim * heads


def _shapes(mmas: list) -> str:
    counts: dict = {}
    for m in mmas:
        counts[m] = counts.get(m, 0) + 1
    return " + ".join(f"{c} x {m.m}x{m.n}x{m.k}{'.ws' if m.ws else ''}{'/2cta' if m.cta_group == 2 else ''}"
                      for m, c in counts.items())


def work(impl: str, config: str, mmas: list, keys_per_tile: int, ctas: int, heads: int) -> dict:
    """The record of a kernel whose CTA issues ``mmas`` per tile of ``keys_per_tile`` keys, ``ctas`` CTAs serving
    ``heads`` heads (a ``cta_group::2`` MMA is issued once for its pair: count the pair as one)."""
    qk = [m for m in mmas if not m.b_mn_major]
    pv = [m for m in mmas if m.b_mn_major]
    flops = ctas * sum(m.flops for m in mmas) // keys_per_tile
    low = min_flops_per_key(heads)
    return {"bench": "mla-mma-work", "impl": impl, "config": config, "heads": heads, "ctas": ctas,
            "keys_per_tile": keys_per_tile, "qk_mmas": len(qk), "qk": _shapes(qk), "pv_mmas": len(pv),
            "pv": _shapes(pv), "flops_per_key": flops, "min_flops_per_key": low, "ratio": round(flops / low, 3)}


def ours(heads: int, compiled: Optional[Callable] = None) -> list[dict]:
    """The catalog's dense 128-head ``MlaDecodeSm100`` configurations; ``compiled(kernel, arch)`` may supply
    ``(ptx, host IR)`` (the tests' run-wide cache)."""
    from cute_kv.kernels import catalog, compile_cache
    from cute_kv.kernels.mla.sm100_config import BM, V_SPLIT

    records = []
    for config in catalog.configs():
        if config.family.name != "mla_decode_sm100" or config.arch != ARCH:
            continue
        kernel = config.kernel()
        if kernel.sparse or kernel.num_q_heads != 128:
            continue
        if compiled is None:
            ptx = compile_cache.compile_uncached(lambda: config.family.build(kernel), ARCH).__ptx__
        else:
            ptx = compiled(kernel, ARCH)[0]
        records.append(work("cute-kv", config.label, static.tcgen05_mmas(ptx), kernel.bn,
                            -(-heads // BM) * V_SPLIT, heads))
    return records


def flashmla(ptx: str, heads: int, heads_per_cta: int, keys_per_tile: int) -> dict:
    return work("flashmla", f"sm100 decode head{heads_per_cta}", static.tcgen05_mmas(ptx), keys_per_tile,
                -(-heads // heads_per_cta), heads)


COLUMNS = [("impl", "impl", 8), ("config", "config", 58), ("CTAs", "ctas", 4), ("keys", "keys_per_tile", 4),
           ("QK MMAs / tile / CTA", "qk", 24), ("PV MMAs / tile / CTA", "pv", 24), ("FLOPs/key", "flops_per_key", 9),
           ("minimum", "min_flops_per_key", 9), ("ratio", "ratio", 5)]


def print_table(records: list[dict]) -> None:
    print(" ".join(h.ljust(w) for h, _, w in COLUMNS))
    for r in records:
        print(" ".join(str(r[k]).ljust(w) for _, k, w in COLUMNS))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="perf/run.py mla-mma-work", description=summary(__doc__))
    ap.add_argument("--heads", type=int, default=128, help="query heads of a token (one latent KV head)")
    ap.add_argument("--flashmla-ptx", help="PTX of FlashMLA's csrc/sm100/decode/head64/instantiations/v32.cu")
    ap.add_argument("--flashmla-heads-per-cta", type=int, default=64, help="its config.h B_H")
    ap.add_argument("--flashmla-keys", type=int, default=64, help="its config.h B_TOPK: keys a tile")
    args = ap.parse_args(argv)
    records = ours(args.heads)
    if args.flashmla_ptx:
        with open(args.flashmla_ptx) as f:
            records.append(flashmla(f.read(), args.heads, args.flashmla_heads_per_cta, args.flashmla_keys))
    for r in records:
        print(json.dumps(r))
    print_table(records)
    return records
