"""Static figures of the fused QKV kernels (no GPU): ours against quack's GEMM on the same tiles without our epilogue.

    python perf/run.py fused-qkv-static

Per arch (sm_90a, sm_100a) and problem: registers and spills (ptxas -v), tensor-core MMA instructions in the SASS
(HGMMA on SM90, UTC*MMA on SM100: equal counts mean the mainloop is quack's, unchanged), A/B pipeline stages
(quack sizes the ring from the shared memory our float32 staging tile leaves), total SASS instructions,
and the epilogue's instructions per output element: the SASS instructions of the row loops (loops that read a
staged row chunk and store it to global memory or back to the tile), divided by the 8 elements an iteration
handles. Quantized weights: sm_90a's ``FusedQKVGemmW4`` against quack's W4 GEMM (decode instructions per weight in
the HGMMA k-loop); sm_100a's ``FusedQKVGemmW4Sm100`` beside the bf16 SM100 kernel (registers), with UTC*MMA per
k-tile and the transform warps' decode instructions per weight, stage stores and loads per k-tile. Needs ``ptxas``
and ``cuobjdump`` (``pip install nvidia-cuda-cuobjdump``) on PATH or in the environment.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from report import summary

PROBLEMS = {  # name: QKVSpec fields (Llama-3-8B projection 4096 -> 6144, Qwen3-8B-like QK-norm, fp8 caches)
    "llama3-8b": dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8, head_dim=128,
                      q_head_dim=128, has_bias=False, rope=(128, False)),
    "qwen3-qknorm-bias": dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8, head_dim=128,
                              q_head_dim=128, has_bias=True, rope=(128, False), q_norm_dim=128, k_norm_dim=128),
    "llama3-8b-fp8-g64": dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8,
                              head_dim=128, q_head_dim=128, has_bias=False, rope=(128, False), fp8=True,
                              granularity=64),
    "llama3-8b-fp8-e8m0-g32": dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8,
                                   head_dim=128, q_head_dim=128, has_bias=False, rope=(128, False), fp8=True,
                                   granularity=32, e8m0=True),
    # DeepSeek-V3's 7168 -> 1536 + 576: the latent norm (bf16 cache) and rope-aware FP8 rows, finished across tiles
    "deepseek-v3-latent-norm": dict(dtype_name="bfloat16", q_dim=1536, kv_dim=1, page_size=64, num_heads=1,
                                    head_dim=576, q_head_dim=192, has_bias=False, rope=(64, True), k_norm_dim=512,
                                    cross_dims=512),
    "deepseek-v3-rope-aware-fp8": dict(dtype_name="bfloat16", q_dim=1536, kv_dim=1, page_size=64, num_heads=1,
                                       head_dim=576, q_head_dim=192, has_bias=False, rope=(64, True),
                                       k_norm_dim=512, fp8=True, cross_dims=512, rope_tail=64),
    # Gemma 3 12B (3840 -> 4096 + 2 x 2048): QK-norm and neox RoPE over heads of 256, finished across tiles
    "gemma3-12b-qknorm": dict(dtype_name="bfloat16", q_dim=4096, kv_dim=2, page_size=16, num_heads=8, head_dim=256,
                              q_head_dim=256, has_bias=False, rope=(256, False), q_norm_dim=256, k_norm_dim=256,
                              norm_offset=1.0),
}
MMA = {"sm_90a": r"\bHGMMA\.", "sm_100a": r"\bUTC\w*MMA\b"}
VEC = 8


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:  # pip's nvidia-cuda-* wheels put their binaries under nvidia/cu13/bin
        candidate = Path(entry) / "nvidia" / "cu13" / "bin" / name
        if candidate.exists():
            return str(candidate)
    raise SystemExit(f"static_fused_qkv: {name} not found (ptxas comes with CUDA; pip install nvidia-cuda-{name})")


def _sass(ptx: str, arch: str) -> tuple[str, str]:
    """(ptxas -v report, SASS listing)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        src.write_text(ptx)
        report = subprocess.run([_tool("ptxas"), f"-arch={arch}", "-v", str(src), "-o", str(cubin)],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    return report, sass


def _instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every SASS instruction."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """``(first, last)`` instruction indices of every loop: a backward branch and its target."""
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    spans = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in index:
            spans.append((index[int(m.group(1), 16)], i))
    return spans


def _innermost(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The loops with no other loop inside (not the persistent tile loop or a sub-tile loop)."""
    return [(a, b) for a, b in spans if not any(a <= s and e <= b and (s, e) != (a, b) for s, e in spans)]


def _opcodes(texts: list[str]) -> list[str]:
    return [t.split()[1] if t.startswith("@") else t.split()[0] for t in texts]


def epilogue_loops(sass: str) -> list[int]:
    """Instruction counts of the row loops: innermost loops whose body reads a staged chunk (LDS.128) and stores it
    (STG, or STS.128 back to the tile), without MMAs."""
    ins = _instructions(sass)
    loops = []
    for start, end in _innermost(_loops(ins)):
        body = [t for _, t in ins[start:end + 1]]
        if (any("LDS.128" in t for t in body) and any(re.search(r"\bSTG\b|STS\.128", t) for t in body)
                and not any("MMA" in t for t in body)):
            loops.append(len(body))
    return loops


DECODE_OPS = ("HADD2", "HMUL2", "HFMA2", "LOP3", "SHF", "F2FP", "PRMT")  # what a W4 decode issues per register


def finish_loops(sass: str) -> list[int]:
    """Instruction counts of the last arriver's row loops (MLA's latent, wide heads): innermost loops that read the
    workspace (LDG.E.128) and store (STG), without MMAs or staged chunks (LDS.128)."""
    loops = []
    for ops in _innermost_loops(sass):
        if (any(o.startswith("LDG.E.128") for o in ops) and any(o.startswith("STG") for o in ops)
                and not any("MMA" in o or o.startswith("LDS.128") for o in ops)):
            loops.append(len(ops))
    return loops


def finish_elements(spec) -> int:
    """Elements a thread's iteration of the finish handles: a chunk of 8 per 16 lanes of the finished width (the
    latent's ``cross_dims``, or the widest wide head)."""
    from cute_kv.kernels.qkv.gemm import BN

    width = spec.cross_dims or max(size for size, wide in zip((spec.q_head_dim, spec.head_dim), spec.wide) if wide)
    return VEC * -(-width // BN)


def epilogue_figures(ours: dict, spec) -> dict:
    """The tile pass's instructions per output element (its row loops over the 8 elements of an iteration) and,
    with a last arriver, the finish's per element it finishes."""
    out = {"epilogue_instructions_per_element": round(sum(ours["row_loops"]) / VEC, 2)}
    if spec.last_arriver:
        out["finish_instructions_per_element"] = round(sum(ours["finish_loops"]) / finish_elements(spec), 2)
    return out


def decode_per_weight(sass: str) -> float:
    """Decode instructions per weight in the W4 k-tile loop (the innermost loop issuing HGMMA): each m64n128k16
    HGMMA consumes 8 weights a thread decoded (64 rows x 16 k over 128 threads)."""
    ins = _instructions(sass)
    loops = [[t for _, t in ins[a:b + 1]] for a, b in _loops(ins)]
    ops = _opcodes(min((body for body in loops if any("HGMMA" in t for t in body)), key=len))
    decode = sum(op.split(".")[0] in DECODE_OPS for op in ops)
    return round(decode / (8 * sum(op.startswith("HGMMA") for op in ops)), 2)


def _innermost_loops(sass: str) -> list[list[str]]:
    """Opcode lists of the innermost loops."""
    ins = _instructions(sass)
    return [_opcodes([t for _, t in ins[a:b + 1]]) for a, b in _innermost(_loops(ins))]


def transform_loop(sass: str, weights_per_thread: int) -> dict:
    """The SM100 W4 kernel's transform k-loop (the innermost loop that decodes and stores to shared memory, no
    MMA): decode instructions per weight, stage stores and shared loads per k-tile; and the MMA warp's k-loop's
    UTC*MMA count."""
    loops = _innermost_loops(sass)
    body = min((ops for ops in loops if any(o.startswith("STS") for o in ops)
                and any(o.split(".")[0] in ("HMUL2", "F2FP") for o in ops)
                and not any("MMA" in o for o in ops)), key=len)
    mma = min((ops for ops in loops if any(re.match(r"UTC\w*MMA", o) for o in ops)), key=len)
    return {"decode_per_weight": round(sum(o.split(".")[0] in DECODE_OPS for o in body) / weights_per_thread, 2),
            "transform_loop_instructions": len(body), "stage_stores_per_k_tile": sum(o.startswith("STS") for o in body),
            "stage_loads_per_k_tile": sum(o.startswith("LDS") for o in body),
            "utcmma_per_k_tile": sum(bool(re.match(r"UTC\w*MMA", o)) for o in mma)}


def figures(ptx: str, arch: str) -> dict:
    report, sass = _sass(ptx, arch)
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
    return {"registers": max(regs), "spill_bytes": sum(spills), "mma": len(re.findall(MMA[arch], sass)),
            "sass_instructions": len(_instructions(sass)), "row_loops": epilogue_loops(sass),
            "finish_loops": finish_loops(sass)}


def bare_gemm_ptx(arch: str) -> tuple[str, int]:
    """quack's GEMM on our tiles and cluster with its own epilogue (bf16 D through TMA): PTX and A/B stages."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream
    from quack.gemm_default_epi import GemmDefaultSm90, GemmDefaultSm100
    from quack.gemm_tvm_ffi_utils import make_fake_gemm_tensors, make_fake_scheduler_args

    from cute_kv.kernels.compile_cache import compile_ptx
    from cute_kv.kernels.qkv.gemm import TILES

    bf = cutlass.BFloat16
    tile, cluster = TILES[arch]
    a, b, d, c, _, _, _, l = make_fake_gemm_tensors(bf, bf, bf, None, "k", "k", "n", None, batched=False)
    if arch == "sm_90a":
        gemm = GemmDefaultSm90(cutlass.Float32, bf, tile, cluster, pingpong=True, is_persistent=True)
    else:
        gemm = GemmDefaultSm100(cutlass.Float32, bf, tile, cluster)
    args = (a, b, d, c, gemm.EpilogueArguments(), make_fake_scheduler_args(False, False, l), None,
            make_fake_stream(use_tvm_ffi_env_stream=True), None, None)
    return compile_ptx(lambda: (gemm, *args), arch), gemm.ab_stage


def bare_w4_ptx(weight_format: str) -> tuple[str, int]:
    """quack's SM90 W4 GEMM (``weight_format``'s SM90 decode) on ``FusedQKVGemmW4``'s tiles with its own epilogue (bf16
    ``D``, the output transposed, through TMA): PTX and A/B stages. Compiled for a 6144 x 4096 weight."""
    import cutlass
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.operand_transform.host import w4_fake_operands
    from quack.operand_transform.transform import TransformAW4
    from quack.tile_scheduler import TileSchedulerOptions

    from cute_kv.kernels.compile_cache import compile_ptx
    from cute_kv.kernels.qkv.w4 import BN, TILE_TOKENS, FusedQKVGemmW4, decode_format

    bf, fmt, n, k = cutlass.BFloat16, decode_format(weight_format), 6144, 4096
    gemm = GemmDefaultSm90(cutlass.Float32, bf, (BN, TILE_TOKENS, fmt.tile_k), FusedQKVGemmW4.cluster_shape,
                           pingpong=False, is_persistent=True, transform_a=lambda g: TransformAW4(g, fmt))
    t = cutlass.cute.sym_int32()
    act = make_fake_tensor(bf, (t, k), stride=(k, 1), assumed_align=16)
    d = make_fake_tensor(bf, (n, t), stride=(1, n), assumed_align=16)
    sched = TileSchedulerOptions(max_active_clusters=cutlass.Int32(1), max_swizzle_size=cutlass.Int32(8))
    args = (w4_fake_operands(fmt, n, k, BN), act, d, None, gemm.EpilogueArguments(), sched, None,
            make_fake_stream(use_tvm_ffi_env_stream=True), None, None)
    return compile_ptx(lambda: (gemm, *args), "sm_90a"), gemm.ab_stage


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="static_fused_qkv", description=summary(__doc__))
    ap.add_argument("--arch", choices=["sm_90a", "sm_100a"], action="append")
    ap.add_argument("--problem", choices=sorted(PROBLEMS), action="append")
    args = ap.parse_args(argv)
    from cute_kv.kernels.compile_cache import compile_ptx
    from cute_kv.kernels.qkv.gemm import BN, TILES, FusedQKVGemm, QKVSpec

    records = []
    for arch in args.arch or ["sm_90a", "sm_100a"]:
        os.environ["CUTE_DSL_ARCH"] = arch
        bare_ptx, bare_stages = bare_gemm_ptx(arch)
        bare = {**figures(bare_ptx, arch), "ab_stages": bare_stages}
        for name in args.problem or list(PROBLEMS):
            spec = QKVSpec(**PROBLEMS[name])
            gemm, *fake = FusedQKVGemm(spec, arch).build()
            ours = {**figures(compile_ptx(lambda: (gemm, *fake), arch), arch), "ab_stages": gemm.ab_stage}
            rec = {"bench": "fused-qkv-static", "arch": arch, "problem": name, "tile": [*TILES[arch][0], 64],
                   "cluster": list(TILES[arch][1]), **{f"ours_{k}": v for k, v in ours.items()},
                   **{f"bare_{k}": v for k, v in bare.items() if k not in ("row_loops", "finish_loops")},
                   "mainloop_unchanged": ours["mma"] == bare["mma"],
                   **epilogue_figures(ours, spec),
                   "staging_bytes": TILES[arch][0][0] // (2 if arch == "sm_100a" else 1) * (BN + 4) * 4}
            print(json.dumps(rec), flush=True)
            records.append(rec)
        if arch == "sm_90a":
            records += _w4_records(args.problem or list(PROBLEMS))
        else:
            records += _w4_sm100_records(args.problem or list(PROBLEMS))
    return records


def _w4_sm100_records(problems) -> list[dict]:
    """``FusedQKVGemmW4Sm100`` per decode format beside the bf16 SM100 kernel (quack's 2-CTA ``GemmSm100`` with the
    same epilogue) on the same problem: registers, the MMA count per k-tile and what the transform warps issue."""
    from cute_kv.kernels.compile_cache import compile_ptx
    from cute_kv.kernels.qkv.gemm import BN, FusedQKVGemm, QKVSpec
    from cute_kv.kernels.qkv.w4 import FORMATS, K_TILE, TILE_TOKENS, QKVW4Spec
    from cute_kv.kernels.qkv.w4_sm100 import (A_STAGES, THREADS, TOKENS, TRANSFORM_THREADS, FusedQKVGemmW4Sm100,
                                              split_k)

    records = []
    for name in problems:
        spec = QKVSpec(**PROBLEMS[name])
        gemm, *fake = FusedQKVGemm(spec, "sm_100a").build()
        bf16_registers = figures(compile_ptx(lambda: (gemm, *fake), "sm_100a"), "sm_100a")["registers"]  # noqa: B023
        for fmt in FORMATS.values():
            kernel = FusedQKVGemmW4Sm100(QKVW4Spec(spec, fmt))
            ptx = compile_ptx(kernel.build, "sm_100a")
            ours = figures(ptx, "sm_100a")
            loop = transform_loop(_sass(ptx, "sm_100a")[1], BN * K_TILE // TRANSFORM_THREADS)
            built = kernel.build()[0]
            w_tiles = -(-spec.n_total // BN)
            splits = split_k(w_tiles, 4096 // K_TILE, 148)
            rec = {"bench": "fused-qkv-static", "arch": "sm_100a", "problem": f"{name}-{fmt}", "weight_format": fmt,
                   "tile": [BN, TOKENS, K_TILE], "cluster": list(kernel.cluster_shape), "threads": THREADS,
                   **{f"ours_{k}": v for k, v in ours.items()}, "ours_ab_stages": built.stages,
                   "decoded_stages": A_STAGES, **loop,
                   "bf16_kernel_registers": bf16_registers,
                   # a decode step (one token tile) at K = 4096 on a B200's 148 SMs: splits per weight tile, CTAs busy
                   "decode_split_k": splits, "decode_ctas": w_tiles * splits,
                   **epilogue_figures(ours, spec),
                   "staging_bytes": TILE_TOKENS * (BN + 4) * 4}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


def _w4_records(problems) -> list[dict]:
    """``FusedQKVGemmW4`` per decode format against quack's W4 GEMM with the same decode and its own epilogue."""
    from cute_kv.kernels.compile_cache import compile_ptx
    from cute_kv.kernels.qkv.gemm import BN, QKVSpec
    from cute_kv.kernels.qkv.w4 import FORMATS, TILE_TOKENS, FusedQKVGemmW4, QKVW4Spec

    records = []
    for fmt in FORMATS.values():
        bare_ptx, bare_stages = bare_w4_ptx(fmt)
        bare = {**figures(bare_ptx, "sm_90a"), "ab_stages": bare_stages,
                "decode_per_weight": decode_per_weight(_sass(bare_ptx, "sm_90a")[1])}
        for name in problems:
            if PROBLEMS[name].get("rope_tail"):  # one latent row per W4 format suffices
                continue
            spec = QKVSpec(**PROBLEMS[name])
            kernel = FusedQKVGemmW4(QKVW4Spec(spec, fmt))
            gemm, *fake = kernel.build()
            ptx = compile_ptx(lambda: (gemm, *fake), "sm_90a")  # noqa: B023 -- called at once
            ours = {**figures(ptx, "sm_90a"), "ab_stages": gemm.ab_stage,
                    "decode_per_weight": decode_per_weight(_sass(ptx, "sm_90a")[1])}
            rec = {"bench": "fused-qkv-static", "arch": "sm_90a", "problem": f"{name}-{fmt}", "weight_format": fmt,
                   "tile": [BN, TILE_TOKENS, kernel.fmt.tile_k], "cluster": list(kernel.cluster_shape),
                   **{f"ours_{k}": v for k, v in ours.items()},
                   **{f"bare_{k}": v for k, v in bare.items() if k not in ("row_loops", "finish_loops")},
                   "mainloop_unchanged": ours["mma"] == bare["mma"],
                   **epilogue_figures(ours, spec),
                   "staging_bytes": TILE_TOKENS * (BN + 4) * 4}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    return records


if __name__ == "__main__":
    main()
