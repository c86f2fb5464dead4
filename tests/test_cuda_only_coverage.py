"""The launch contracts execute at least 90% of the CUDA-only host code (``tests/cuda_only_coverage.py``), and its
list of CUDA-only functions names every function of ``cute_kv/ops`` that fetches a compiled kernel."""

import ast
import os
import subprocess
import sys

import cuda_only_coverage as cov


def test_every_kernel_fetching_function_is_listed():
    for module in sorted(os.listdir(cov.OPS)):
        if not module.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(cov.OPS, module)).read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
                if "compiled" in names:
                    assert node.name in cov.CUDA_ONLY.get(module, []), f"{module}:{node.name} launches a kernel"


def test_contracts_cover_the_cuda_only_host_code():
    out = subprocess.run([sys.executable, cov.__file__], cwd=cov.ROOT, capture_output=True, text=True,
                         env=dict(os.environ, CUTE_DSL_ARCH="sm_90a"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "total" in out.stdout
