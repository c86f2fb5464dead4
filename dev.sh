#!/usr/bin/env bash
# One command per job, set-up included, on a fresh clone:
#   bash dev.sh demo   build a Llama-3-8B-like paged cache, run ragged steps, check attention, print the layout
#   bash dev.sh test   the test suite: python -m pytest -q in the environment (what CI runs)
#   bash dev.sh setup  only create / complete the environment
# Extra arguments go to the demo / to pytest. CUTE_KV_VENV picks the virtual environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")"
job=${1:-test}
shift || true
venv=${CUTE_KV_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
extras="test,plot,sass"
if ! "$py" -c "import cute_kv, ptxsim, torch, cutlass, quack, pytest, xdist, pytest_timeout, coverage, hypothesis, matplotlib, transformers
from importlib.metadata import version
for extra in ('nvidia-cuda-nvcc', 'nvidia-cuda-nvdisasm', 'nvidia-cuda-cuobjdump', 'flash-attn-4'): version(extra)" 2>/dev/null; then
    # torch first and pinned: an open 'torch' requirement would pull a multi-GB CUDA build onto a CPU box.
    "$py" -c "import torch" 2>/dev/null || "$py" -m pip install -q "torch==${CUTE_KV_TORCH:-2.13.0}"
    "$py" -m pip install -q -e ".[$extras]"
fi
case "$job" in
    demo) exec "$py" -m cute_kv demo "$@" ;;
    test) exec "$py" -m pytest -q "$@" ;;
    setup) ;;
    *) echo "usage: bash dev.sh demo|test|setup [args...]" >&2; exit 2 ;;
esac
