"""``python perf/run.py static``: the static table of every kernel configuration (``cute_kv.kernels.catalog``), and
FA4's paged forward beside our attention for the same shapes. CPU only: ptxas, nvdisasm and the DSL, no GPU.

    python perf/run.py static                       # table, and perf/results/static.json
    python perf/run.py static -- --kernels attention --no-peers
    python perf/run.py static -- --keep perf/results/static-sass   # also keep each kernel's PTX and SASS

Columns (``static.py`` says how each is measured): threads and registers per thread, spill stores/loads (bytes),
shared memory per CTA (static + what the launch passes), CTAs per SM, tensor-core MMAs, barrier waits (CTA-wide +
named + mbarrier) and LDS/STS in the whole kernel; instructions, waits and MMAs of the main loop, on SM100 its MMAs
per key tile of one Q tile (a QK group and its PV) and the MMA in flight (``static.mma_in_flight``: QK groups issued
between two waits for P), its instructions per 64x64 block of S (attention), instructions of the softmax loop
(longest and shortest way through one iteration: one S tile of one softmax warpgroup on SM100, the O rescale or mask
skipped on the short way), its MUFU.EX2 and the exponentials it emulates on the FMA pipe (``static.ex2_emulated``),
the masked softmax loop's instructions (its longest way: a row of the warp cut by the mask), the SM100 correction
loop's instructions per S tile (``static.correction_loop``: rescaling O / skipping the rescale), tensor-memory
columns (tcgen05) and the warp roles' register targets (setmaxnreg).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import static
import static_peers
from report import summary

COLUMNS = [  # (header, record key or function, width)
    ("kernel", "kernel", 22), ("config", "config", 50), ("arch", "arch", 7), ("thr", "threads", 4),
    ("regs", "registers", 4),
    ("spill", lambda r: f"{r['spill_stores']}/{r['spill_loads']}", 5), ("smem", "smem", 6),
    ("CTA/SM", "ctas_per_sm", 6), ("MMA", "mma", 4),
    ("waits", lambda r: f"{r['cta_barriers']}+{r['named_barriers']}+{r['mbarrier_waits']}", 8),
    ("LDS/STS", lambda r: f"{r['lds']}/{r['sts']}", 7), ("loop", "loop_instructions", 5),
    ("loopwaits", lambda r: "loop_cta_barriers" in r and f"{r['loop_cta_barriers']}+{r['loop_named_barriers']}+"
     f"{r['loop_barrier_waits'] - r['loop_cta_barriers'] - r['loop_named_barriers']}" or None, 9),
    ("loopMMA", "loop_mma", 7),
    ("MMA/tile", lambda r: r.get("loop_qk_groups") and r["loop_mma"] // r["loop_qk_groups"], 8),
    ("inflight", "mma_in_flight", 8), ("/S64", "instructions_per_s_block", 6),
    ("/S64min", "instructions_per_s_block_shortest", 7), ("softmax", "softmax_loop_instructions", 7),
    ("smxmin", "softmax_loop_instructions_shortest", 6), ("smxEX2", "softmax_loop_ex2", 6),
    ("smxEmu", "softmax_loop_ex2_emulated", 6), ("masked", "masked_loop_instructions", 6),
    ("corr/skip", lambda r: "correction_loop_instructions" in r and f"{r['correction_loop_instructions']:g}/"
     f"{r['correction_loop_instructions_skip']:g}" or None, 9),
    ("load", "load_loop_instructions", 5), ("copies", "load_loop_copies", 6),
    ("TMEM", "tmem_columns", 4), ("setmaxnreg", lambda r: ",".join(map(str, r["setmaxnreg"])) or None, 10),
]


def _cell(rec: dict, key) -> str:
    if rec.get("status", "ok") != "ok":
        return ""
    value = key(rec) if callable(key) else rec.get(key)
    return "-" if value is None else str(value)


def print_table(records: list[dict], title: str) -> None:
    print(f"\n{title}")
    print(" ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, _, w) in enumerate(COLUMNS)))
    for r in records:
        cells = [_cell(r, k).ljust(w) if i < 3 else _cell(r, k).rjust(w) for i, (_, k, w) in enumerate(COLUMNS)]
        line = " ".join(cells)
        if r.get("status", "ok") != "ok":
            line += f"  {r['status']}: {r.get('error', '')}"
        print(line)


def ours(kernels: list[str], archs: list[str], keep: str | None) -> list[dict]:
    from cute_kv.kernels import catalog

    records = []
    for config in catalog.configs():
        if config.arch not in archs or (kernels and not any(k in config.family.name for k in kernels)):
            continue
        keep_dir = os.path.join(keep, config.id) if keep else None
        records.append(dict(static.analyze_config(config, keep_dir), bench="static", role="ours"))
    return records


def peers(archs: list[str], head_dims, page_sizes, modes) -> list[dict]:
    """FA4 (its own process per arch) and our attention families for the same shapes, side by side."""
    from cute_kv.kernels import catalog

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static_peers.py")
    rows = []
    for arch in archs:
        done = subprocess.run([sys.executable, script, "--arch", arch, "--head-dims", *map(str, head_dims),
                               "--page-sizes", *map(str, page_sizes), "--modes", *modes],
                              capture_output=True, text=True)
        fa4 = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode or not fa4:
            fa4 = [{"impl": "fa4", "arch": arch, "kernel": "fa4_forward", "config": "-", "status": "error",
                    "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}]
        families = [f for f in catalog.FAMILIES if f.peer_case and arch in f.archs]
        for d in head_dims:
            for page in page_sizes:
                for mode in modes:
                    tokens = 1 if mode == "decode" else static_peers.PREFILL_LEN
                    for family in families:
                        config = catalog.Config(family, family.peer_case(d, page, tokens), arch)
                        rec = {"kernel": family.name, "arch": arch, "impl": "cute-kv"}
                        try:
                            rec.update(static.analyze_config(config), status="ok")
                        except Exception as e:  # noqa: BLE001 - a shape our kernel does not take is a row too
                            rec.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
                        rows.append(dict(rec, config=f"{config.label} {mode}", bench="static-peers", role="ours",
                                         head_dim=d, page_size=page, mode=mode))
                    rows += [dict(r, bench="static-peers", role="peer") for r in fa4
                             if (r.get("head_dim"), r.get("page_size"), r.get("mode")) == (d, page, mode)]
        rows += [dict(r, bench="static-peers", role="peer") for r in fa4 if "head_dim" not in r]
    return rows


def fa4_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="perf/run.py static", description=summary(__doc__))
    ap.add_argument("--kernels", nargs="*", default=[], help="substrings of kernel family names (default: all)")
    ap.add_argument("--archs", nargs="+", default=["sm_90a", "sm_100a"])
    ap.add_argument("--no-peers", action="store_true", help="leave out FA4 (default: included when installed)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 80, 96, 128, 192, 256])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--modes", nargs="+", default=["decode", "prefill"])
    ap.add_argument("--keep", help="folder for each kernel's PTX and SASS")
    args = ap.parse_args(argv)
    if static.tools_available():
        raise SystemExit(f"perf/run.py static: {static.tools_available()}")
    records = ours(args.kernels, args.archs, args.keep)
    print_table(records, "cute-kv kernels (every configuration the compile tests build)")
    if not args.no_peers and fa4_available():
        side = peers(args.archs, args.head_dims, args.page_sizes, args.modes)
        print_table(side, "attention beside FA4 (bf16, 32 q / 8 KV heads, paged; FA4 decode and causal prefill)")
        records += side
    elif not args.no_peers:
        print("\nFA4 not installed: no peers section (pip install -e '.[peers]')")
    return records
