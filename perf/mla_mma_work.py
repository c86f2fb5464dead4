"""``python perf/run.py mla-mma-work``: tensor-core work per key of MLA decode on SM100, read from PTX (no GPU).

Per kernel: the ``tcgen05.mma`` instructions of one key tile (every MMA of the kernel's PTX: its loop issues each
once a tile; ``static.tcgen05_mmas`` decodes the shapes), as QK (B: the keys, K-major) and P V (B: the values,
MN-major), and the FLOPs a key costs the CTAs that together serve ``--heads`` query heads of one token, against the
minimum ``2 * latent_dim * heads + 2 * v_dim * heads`` (S and O each computed once).

    python perf/run.py mla-mma-work
    python perf/run.py mla-mma-work -- --flashmla head64=head64_v32.ptx head128=head128_decode_k512.ptx

cute-kv: ``MlaDecodeSm100`` over a 16-bit cache and over rope-aware FP8 rows (the catalog's 128-head dense
configurations); a CTA takes ``BM`` packed rows, half the latent columns of QK and one of ``V_SPLIT`` value
halves, so ``ceil(heads / BM) * V_SPLIT`` CTAs serve a token. FlashMLA's SM100 decode is C++, compiled outside (``nvcc -arch=sm_100a -ptx`` with its
CUTLASS submodule's includes, ``perf/README.md``) and read the same way: ``head64``
(``csrc/sm100/decode/head64/instantiations/v32.cu``, DeepSeek-V3.2's 576/512: 64 heads a CTA, 64 keys a tile; 128
heads run as two) and ``head128`` (``csrc/sm100/prefill/sparse/fwd_for_small_topk/head128/instantiations/
phase1_decode_k512.cu``, its 512/512 model: 128 heads a ``cta_group::2`` CTA pair, 64 keys a tile).
"""

from __future__ import annotations

import argparse
import json
from typing import Callable, Optional

import static
from report import summary

LATENT, V_DIM = 576, 512  # DeepSeek-V3: kv_lora_rank + rope_dim, kv_lora_rank
ARCH = "sm_100a"
# FlashMLA's SM100 decode kernels (config.h): the kernel issuing the MMAs in the PTX (part of its name; None: the
# only one), the latent dim, and the heads and keys of one MMA-issuing CTA's (or CTA pair's) tile.
FLASHMLA = {"head64": (None, LATENT, 64, 64),
            "head128": ("flash_fwd_splitkv_mla_fp8_sparse_kernel", V_DIM, 128, 64)}


def min_flops_per_key(heads: int, latent_dim: int = LATENT, v_dim: int = V_DIM) -> int:
    """S = Q K^T over ``latent_dim`` and O = P V over ``v_dim``, once per head."""
    return 2 * latent_dim * heads + 2 * v_dim * heads


def _shapes(mmas: list) -> str:
    counts: dict = {}
    for m in mmas:
        counts[m] = counts.get(m, 0) + 1
    return " + ".join(f"{c} x {m.m}x{m.n}x{m.k}{'.ws' if m.ws else ''}{'/2cta' if m.cta_group == 2 else ''}"
                      for m, c in counts.items())


def work(impl: str, config: str, mmas: list, keys_per_tile: int, units: int, heads: int,
         latent_dim: int = LATENT) -> dict:
    """The record of a kernel issuing ``mmas`` per tile of ``keys_per_tile`` keys in each of ``units`` CTAs (or
    ``cta_group::2`` pairs, whose MMA is issued once for both) that together serve ``heads`` heads."""
    qk = [m for m in mmas if not m.b_mn_major]
    pv = [m for m in mmas if m.b_mn_major]
    flops = units * sum(m.flops for m in mmas) // keys_per_tile
    low = min_flops_per_key(heads, latent_dim)
    return {"bench": "mla-mma-work", "impl": impl, "config": config, "latent_dim": latent_dim, "heads": heads,
            "units": units, "keys_per_tile": keys_per_tile, "qk_mmas": len(qk), "qk": _shapes(qk),
            "pv_mmas": len(pv), "pv": _shapes(pv), "flops_per_key": flops, "min_flops_per_key": low,
            "ratio": round(flops / low, 3)}


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
                            -(-heads // BM) * V_SPLIT, heads, kernel.latent_dim))
    return records


def flashmla(kernel: str, ptx: str, heads: int) -> dict:
    """``kernel``: a key of ``FLASHMLA``; ``ptx``: its compiled text."""
    entry, latent_dim, unit_heads, keys = FLASHMLA[kernel]
    return work("flashmla", f"sm100 decode {kernel}", static.tcgen05_mmas(ptx, entry), keys,
                -(-heads // unit_heads), heads, latent_dim)


COLUMNS = [("impl", "impl", 8), ("config", "config", 58), ("latent", "latent_dim", 6), ("units", "units", 5),
           ("keys", "keys_per_tile", 4), ("QK MMAs / tile / unit", "qk", 24), ("PV MMAs / tile / unit", "pv", 24),
           ("FLOPs/key", "flops_per_key", 9), ("minimum", "min_flops_per_key", 9), ("ratio", "ratio", 5)]


def print_table(records: list[dict]) -> None:
    print(" ".join(h.ljust(w) for h, _, w in COLUMNS))
    for r in records:
        print(" ".join(str(r[k]).ljust(w) for _, k, w in COLUMNS))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="perf/run.py mla-mma-work", description=summary(__doc__))
    ap.add_argument("--heads", type=int, default=128, help="query heads of a token (one latent KV head)")
    ap.add_argument("--flashmla", nargs="+", default=[], metavar="KERNEL=PTX",
                    help=f"FlashMLA kernels' PTX files, KERNEL one of {', '.join(FLASHMLA)}")
    args = ap.parse_args(argv)
    records = ours(args.heads)
    for item in args.flashmla:
        kernel, _, path = item.partition("=")
        if kernel not in FLASHMLA or not path:
            ap.error(f"--flashmla takes KERNEL=PTX with KERNEL one of {', '.join(FLASHMLA)}, got {item!r}")
        with open(path) as f:
            records.append(flashmla(kernel, f.read(), args.heads))
    for r in records:
        print(json.dumps(r))
    print_table(records)
    return records
