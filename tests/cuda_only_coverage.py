"""How much of the CUDA-only host code the CPU tests execute: ``python tests/cuda_only_coverage.py [pytest args]``.

CUDA-only host code: the functions of ``cute_kv/ops`` that only a kernel path runs (``CUDA_ONLY``: the launchers,
their compile units, launch sizing and argument preparation), every executable line of their bodies (nested
functions included; ``def`` lines and docstrings are not code that runs on a call). The script runs pytest under
``coverage`` in this process (``-n 0``: an xdist worker's lines would not be measured; default:
``tests/test_launch_contracts.py``; pass other test paths or options to measure those), prints the table (module,
CUDA-only lines, lines executed) and exits 1 below ``THRESHOLD``.
"""

from __future__ import annotations

import ast
import os
import sys

THRESHOLD = 0.90
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = os.path.join(ROOT, "cute_kv", "ops")

CUDA_ONLY = {
    "store_kv.py": ["compile_unit", "_launcher"],
    "gather_kv.py": ["_launch", "_build"],
    "fused_qkv.py": ["_launcher", "latent_workspace", "compile_unit", "_with_bias", "_gemm", "_max_active_clusters",
                     "_device_max_active_clusters"],
    "paged_attention_sm90.py": ["compile_units", "launch_workspace", "launcher"],
    "kernel_args.py": ["softmax_args", "score_args", "scales_arg", "window_arg", "layout_flags"],
    "splits.py": ["partials", "launch_shape", "num_splits", "unused_partials", "unused_lse", "sm_count",
                  "_device_sm_count", "launch_and_combine"],
    "paged_attention_sm100.py": ["compile_units", "launch_workspace", "launch_shape_sm100", "launcher_sm100"],
    "mla_decode.py": ["compile_units", "launch_shape", "launch_workspace", "launcher"],
    "mla_decode_sm100.py": ["compile_units", "key_tile", "launch_shape", "launch_shape_sparse", "_run", "launcher",
                            "launch_sparse", "_check_sparse", "sparse_workspace", "launch_workspace"],
    "mla_prefill.py": ["compile_units", "_launcher", "prefill_workspace"],
    "units.py": ["with_combine"],
    "vectors.py": ["heads_packed", "packed_heads"],
}


def body_lines(path: str, names: list[str]) -> set[int]:
    """Line numbers spanned by the bodies of the module-level functions ``names`` of ``path``, docstrings left
    out."""
    tree = ast.parse(open(path).read())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    lines = set()
    for name in names:
        body = functions[name].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and len(body) > 1:
            body = body[1:]
        lines |= set(range(body[0].lineno, functions[name].end_lineno + 1))
    return lines


def main(pytest_args: list[str]) -> int:
    import coverage

    cov = coverage.Coverage(source=[OPS], data_file=None)
    cov.start()
    import pytest

    args = pytest_args or [os.path.join(ROOT, "tests", "test_launch_contracts.py"), "-q", "-p", "no:cacheprovider"]
    status = pytest.main([*args, "-n", "0"])
    cov.stop()
    if status != 0:
        print(f"pytest failed ({status}): no measurement")
        return int(status)
    rows, total, run = [], 0, 0
    for module, names in CUDA_ONLY.items():
        path = os.path.join(OPS, module)
        _, statements, _, missing, _ = cov.analysis2(path)
        lines = body_lines(path, names) & set(statements)
        executed = lines - set(missing)
        rows.append((module, len(lines), len(executed)))
        total, run = total + len(lines), run + len(executed)
    print(f"\n{'module (cute_kv/ops)':<26} {'CUDA-only lines':>15} {'executed':>9}")
    for module, n, e in rows:
        print(f"{module:<26} {n:>15} {e:>9}")
    print(f"{'total':<26} {total:>15} {run:>9}  ({100 * run / total:.1f}%)")
    return 0 if run >= THRESHOLD * total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
