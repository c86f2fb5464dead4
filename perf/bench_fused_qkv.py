"""Llama-3-8B QKV projection with the K/V columns written into a paged cache: ``cute_kv.fused_qkv_matmul_kv_cache``.

``hidden [T, 4096] @ weight[6144, 4096]^T`` -> Q 4096 | K 1024 | V 1024 (bf16), K/V stored into one layer
(8 x 128, page 16 and 64). Cases: ``decode`` T=128 (128 requests x 1 token after 1-4k cached) and ``prefill``
T=8192 (8 x 1024). Ours without and with RoPE (``RopeConfig``, theta 500000), and with Qwen3-style QK-norm
before RoPE (per-head RMSNorm of Q and K). In the same process on the same
inputs: torch GEMM alone (``hidden @ weight.T``, the lower bound), GEMM + FlashInfer ``append_paged_kv_cache`` on
the output's K/V column views, GEMM + torch ``index_copy_`` (rows computed once per step). The rows each
implementation writes are checked against a float32 GEMM (RoPE'd for ours with RoPE) before it is timed.
Figures: ``tflops``, ``roofline_fraction`` of the bf16 GEMM rate measured at start, ``ratio_to_gemm`` (goal <= 1.03)
and ``speedup_vs_torch_gemm_flashinfer`` (goal >= 1.05). ``--weights int4`` adds records (``weight: int4``) for
GPTQ int4 weights (group 128) on SM90: ours against quack's W4A16 GEMM followed by the same ``index_copy_`` write
(``speedup_vs_quack_w4a16_index_copy``, goal >= 1).

    python perf/run.py fused-qkv [--out perf/results/fused_qkv.json] [-- --cases decode,prefill --page-sizes 16,64
                                                                         --weights bf16,int4]
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import torch

import cute_kv
import cases
import ceilings
import harness
import report
from cute_kv.reference import apply_rope
from cute_kv.reference.norm import rms_norm_heads
from cute_kv.reference.weights import dequantize

Q_DIM, KV_DIM = cases.Q_HEADS * cases.HEAD_DIM, cases.KV_HEADS * cases.HEAD_DIM
N_OUT = Q_DIM + 2 * KV_DIM
GOAL_RATIO_TO_GEMM, GOAL_SPEEDUP_VS_FLASHINFER = 1.03, 1.05


def qkv_flops(rows: int, hidden: int = cases.HIDDEN, n_out: int = N_OUT) -> int:
    return 2 * rows * hidden * n_out


def qkv_bytes(rows: int, hidden: int = cases.HIDDEN, n_out: int = N_OUT, element_size: int = 2) -> int:
    """HBM bytes of the fused call at best: weight and hidden read, Q | K | V written once."""
    return (n_out * hidden + rows * hidden + rows * n_out) * element_size


def split_kv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[T, H, D]`` views of the GEMM output's columns (no copy: both peers take strided rows)."""
    heads = (cases.KV_HEADS, cases.HEAD_DIM)
    return qkv[:, Q_DIM:Q_DIM + KV_DIM].unflatten(1, heads), qkv[:, Q_DIM + KV_DIM:].unflatten(1, heads)


def bench_case(args, gemm_tflops: float, l2: int, name: str, page_size: int, fi, fi_why) -> list[dict]:
    step = cases.STEPS[name]
    t = step.rows
    # A weight per set (an engine's layers differ): prefill spans 3x L2 in one set, decode takes 3.
    n_rot = harness.rotation_count(qkv_bytes(t), l2, max_sets=8)
    gen = torch.Generator().manual_seed(page_size)
    sets = cases.PagedSets(step, page_size=page_size, num_layers=args.layers, n_sets=n_rot, generator=gen,
                           device="cuda")
    hidden = torch.randn((n_rot, t, cases.HIDDEN), dtype=torch.bfloat16, device="cuda")
    weight = torch.randn((n_rot, N_OUT, cases.HIDDEN), dtype=torch.bfloat16, device="cuda") / math.sqrt(cases.HIDDEN)
    rope = cute_kv.RopeConfig.from_theta(cases.HEAD_DIM, step.max_context, cases.ROPE_THETA, device="cuda")
    k_exact, v_exact = split_kv(hidden[0].float() @ weight[0].float().T)
    k_roped = apply_rope(k_exact, sets.positions, rope)
    gamma = torch.rand((2, cases.HEAD_DIM), generator=gen).add_(0.5).to("cuda")
    qk_norm = cute_kv.QKNorm(gamma[0], gamma[1])
    k_normed = apply_rope(rms_norm_heads(k_exact, gamma[1], qk_norm.epsilon, 0.0), sets.positions, rope)

    def check(fn):
        return sets.write_error(fn, k_exact, v_exact)

    def check_rope(fn):
        return sets.write_error(fn, k_roped, v_exact)

    def check_norm(fn):
        return sets.write_error(fn, k_normed, v_exact)

    def ours(r, with_rope=False, norm=None):
        return cute_kv.fused_qkv_matmul_kv_cache(hidden[r], sets.input_row_offsets, weight[r], sets.collections[r],
                                                 sets.layer(r), rope=rope if with_rope else None, qk_norm=norm,
                                                 validate=False)

    def gemm(r):
        return hidden[r] @ weight[r].T

    def gemm_index_copy(r):
        cases.index_copy_store(sets.flat, *sets.rows[r], *split_kv(gemm(r)))

    def gemm_flashinfer(r):
        fi.append_paged_kv_cache(*split_kv(gemm(r)), sets.fi_batch, sets.fi_positions, sets.planes[sets.layer(r)],
                                 *sets.fi_pages[r], "NHD")

    impls = [cases.Impl("cute_kv", "ours", ours, check),
             cases.Impl("cute_kv_rope", "ours", lambda r: ours(r, with_rope=True), check_rope),
             cases.Impl("cute_kv_qknorm_rope", "ours", lambda r: ours(r, True, qk_norm), check_norm),
             cases.Impl("torch_gemm", "bound", gemm),
             cases.Impl("torch_gemm_flashinfer", "peer", gemm_flashinfer, check, absent=fi_why),
             cases.Impl("torch_gemm_index_copy", "peer", gemm_index_copy, check)]
    flops = qkv_flops(t)
    if "int4" in args.weights.split(","):
        int4 = _int4_impls(hidden, sets)
    base = {"bench": "fused_qkv", "case": name, "page_size": page_size, "requests": step.requests, "rows": t,
            "max_context": step.max_context, "shape": [t, N_OUT, cases.HIDDEN], "layers": args.layers,
            "flops": flops, "gemm_tflops": gemm_tflops}
    # bf16 outputs against a float32 GEMM: rounding alone is ~4e-3.
    figures = lambda s: {"tflops": flops / s / 1e12,  # noqa: E731
                         "roofline_fraction": report.compute_fraction(flops, s, gemm_tflops)}
    records = []
    if "bf16" in args.weights.split(","):
        records += cases.measure_case(base, impls, n_rot, args, tol=2e-2, figures=figures)
    if "int4" in args.weights.split(","):
        records += cases.measure_case({**base, "weight": "int4"}, int4, n_rot, args, tol=2e-2, figures=figures)
    for r in records:
        if "speedup_vs_torch_gemm" in r:
            r["ratio_to_gemm"] = 1 / r["speedup_vs_torch_gemm"]
            r["goal_ratio_to_gemm"], r["goal_speedup_vs_flashinfer"] = GOAL_RATIO_TO_GEMM, GOAL_SPEEDUP_VS_FLASHINFER
            r["meets_goals"] = (r["ratio_to_gemm"] <= GOAL_RATIO_TO_GEMM and
                                r.get("speedup_vs_torch_gemm_flashinfer", 0.0) >= GOAL_SPEEDUP_VS_FLASHINFER)
        if "speedup_vs_quack_w4a16_index_copy" in r:
            r["meets_goals"] = r["speedup_vs_quack_w4a16_index_copy"] >= 1.0
    return records


def _int4_impls(hidden, sets) -> list:
    """Ours and quack's W4A16 GEMM + ``index_copy_`` on GPTQ int4 weights (group 128, codes and scales drawn so
    outputs are O(1)), each checked against the float32 product with the dequantized weight."""
    n_rot, n, k = hidden.shape[0], N_OUT, cases.HIDDEN
    gen = torch.Generator().manual_seed(n)
    w4 = [cute_kv.Int4Weight(torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).cuda(),
                             (torch.rand(n, k // 128, generator=gen) / (4 * math.sqrt(k))).to(torch.bfloat16).cuda(),
                             128) for _ in range(n_rot)]
    k_exact, v_exact = split_kv(hidden[0].float() @ dequantize(w4[0], torch.bfloat16).T)

    def check(fn):
        return sets.write_error(fn, k_exact, v_exact)

    def ours(r):
        return cute_kv.fused_qkv_matmul_kv_cache(hidden[r], sets.input_row_offsets, w4[r], sets.collections[r],
                                                 sets.layer(r), validate=False)

    impls = [cases.Impl("cute_kv_int4", "ours", ours, check)]
    try:
        from quack.gemm_w4 import gemm_w4a16

        from cute_kv.kernels.qkv.w4 import prepare_weight
    except ImportError as e:
        return impls + [cases.Impl("quack_w4a16_index_copy", "peer", absent=f"quack W4: {e}")]
    prepared = [prepare_weight(w)[:2] for w in w4]  # once, as an engine would

    def quack_index_copy(r):
        cases.index_copy_store(sets.flat, *sets.rows[r], *split_kv(gemm_w4a16(hidden[r], *prepared[r],
                                                                              wformat="int4")))

    return impls + [cases.Impl("quack_w4a16_index_copy", "peer", quack_index_copy, check)]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=report.summary(__doc__))
    ap.add_argument("--cases", default="decode,prefill", help="comma list of decode,prefill")
    ap.add_argument("--weights", default="bf16", help="comma list of bf16,int4 (int4: SM90)")
    cases.common_args(ap)
    args = ap.parse_args(argv)
    gemm = ceilings.gemm_tflops(8192, 8192, 8192)
    print(json.dumps(gemm), flush=True)
    return [gemm, *cases.run_grid(args, functools.partial(bench_case, args, gemm["tflops"], harness.l2_bytes()))]


if __name__ == "__main__":
    main()
