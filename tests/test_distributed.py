"""Scale-out over torch.distributed, as 2-4 local processes on the gloo backend (CPU, loopback only).

Each test spawns its ranks (tests/distributed_workers.py) with a bounded wait; a rank's failure fails the test with
that rank's traceback. Skipped only where gloo cannot start on this machine.
"""

import datetime
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed_workers as workers

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo():
    """Skip the module (with the reason) where a one-process gloo group cannot start."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    try:
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=datetime.timedelta(seconds=20))
        group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=20))
        group.barrier().wait()
    except Exception as e:  # noqa: BLE001 - any failure to start gloo is the skip reason
        pytest.skip(f"gloo cannot start on loopback here: {type(e).__name__}: {e}")


def spawn(fn, world: int, *args) -> None:
    """Run ``fn(rank, world, port, *args)`` in ``world`` processes; fail on any rank's error or after TIMEOUT_S."""
    ctx = mp.start_processes(fn, args=(world, _free_port(), *args), nprocs=world, join=False, start_method="spawn")
    try:
        for _ in range(TIMEOUT_S):
            if ctx.join(timeout=1):
                return
        pytest.fail(f"{fn.__name__}: {world} ranks did not finish within {TIMEOUT_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("world,dtype", [(2, "float32"), (4, "bfloat16")])
def test_tensor_parallel_attention_equals_unsharded(gloo, world, dtype):
    """Column-parallel QKV into each rank's heads of the pages, attention on those heads, row-parallel output with
    an all-reduce: equal to one process running the whole layer, over ragged prefill/decode steps with prefix hits;
    every rank's pages agree and hold its heads of the unsharded cache."""
    spawn(workers.tensor_parallel, world, dtype)


def test_two_stage_pipeline_equals_unsplit_model(gloo):
    """5 layers split 3 + 2: stage 0 sends its hidden states to stage 1; each stage's output equals the unsplit
    model's after the same layers, bit for bit, and its cache holds exactly its layers."""
    spawn(workers.pipeline, 2)


def test_disaggregated_prefill_to_decode(gloo):
    """Requests prefilled on rank 0 move to rank 1 (bf16, and fp8 with scales): only pages the receiver's prefix cache
    lacks are sent, bytes arrive bit for bit, other pages are untouched, and decode attention equals the sender's."""
    spawn(workers.disaggregated, 2)


@pytest.mark.parametrize("example,expect", [("tensor_parallel.py", "step 2: 122 tokens of 3 requests on 2 ranks"),
                                            ("disaggregated.py", "prefill worker's: max |diff| 0")])
def test_torchrun_examples(gloo, example, expect):
    """README's torchrun commands (``python -m torch.distributed.run`` is torchrun) on two CPU processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(REPO / "examples" / example)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert expect in done.stdout
