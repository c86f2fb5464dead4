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
    """Gloo on the loopback interface (the ranks inherit the setting); skips the module, with the reason, where a
    one-process gloo group cannot start."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    env = pytest.MonkeyPatch()
    loopback = next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    if loopback is not None:  # else gloo picks the interface of the host name
        env.setenv("GLOO_SOCKET_IFNAME", loopback)
    try:
        store = dist.TCPStore("127.0.0.1", _free_port(), 1, True, timeout=datetime.timedelta(seconds=20))
        group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=20))
        group.barrier().wait()
    except Exception as e:  # noqa: BLE001 - any failure to start gloo is the skip reason
        env.undo()
        pytest.skip(f"gloo cannot start on loopback here: {type(e).__name__}: {e}")
    yield
    env.undo()


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


def test_pipeline_of_tensor_parallel_stages(gloo):
    """4 processes: 2 stages x 2 tensor-parallel ranks (a group per stage); equal to the unsplit, unsharded model."""
    spawn(workers.tensor_parallel_pipeline, 4)


def test_disaggregated_prefill_to_decode(gloo):
    """Requests prefilled on rank 0 move to rank 1 (bf16, and fp8 with scales): only pages the receiver's prefix cache
    lacks are sent, bytes arrive bit for bit, other pages are untouched, and decode attention equals the sender's."""
    spawn(workers.disaggregated, 2)


@pytest.mark.parametrize("example,expect", [
    ("tensor_parallel.py", ("step 2: 122 tokens of 3 requests on 2 ranks", "relative difference to the unsharded")),
    ("disaggregated.py", ("prefill worker's: max |diff| 0",)),
])
def test_torchrun_examples(gloo, example, expect):
    """README's torchrun commands (``python -m torch.distributed.run`` is torchrun) on two CPU processes."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(REPO / "examples" / example)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(e in done.stdout for e in expect), done.stdout


# -- bad input, before any communication (one process, no group needed) ----------------------------------


def test_sharding_rejects_bad_shapes():
    from cute_kv import KVCacheParams, PagedKVCacheManager
    from cute_kv.distributed import TensorParallelAttention, head_range

    assert head_range(8, 1, 4) == (2, 4)
    with pytest.raises(ValueError, match=r"n_heads \(6\) must be divisible by the tensor-parallel degree \(4\)"):
        head_range(6, 0, 4)
    w_qkv, w_o = torch.randn((8 + 2 * 4) * 16, 32), torch.randn(32, 8 * 16)
    with pytest.raises(ValueError, match=r"w_qkv must be \[\(n_q_heads \+ 2\*n_kv_heads\) \* head_dim"):
        TensorParallelAttention(w_qkv[1:], w_o, 8, 4, 16)
    with pytest.raises(ValueError, match=r"w_o must be \[hidden, n_q_heads \* head_dim = 128\]"):
        TensorParallelAttention(w_qkv, w_o[:, 1:], 8, 4, 16)
    layer = TensorParallelAttention(w_qkv, w_o, 8, 4, 16, rank=1, world=2)
    assert layer.w_qkv.shape == ((4 + 2 * 2) * 16, 32) and layer.w_o.shape == (32, 4 * 16)
    # Rank 1 keeps Q heads 4-7, K heads 2-3 and V heads 2-3 of the full weight, in that order.
    assert torch.equal(layer.w_qkv[:64], w_qkv[64:128]) and torch.equal(layer.w_qkv[64:96], w_qkv[128 + 32:192])
    assert torch.equal(layer.w_qkv[96:], w_qkv[192 + 32:]) and torch.equal(layer.w_o, w_o[:, 64:])
    # A cache of all heads given to a rank's layer is refused before anything is written.
    mgr = PagedKVCacheManager(KVCacheParams(torch.float32, 4, 16, page_size=8, total_num_layers=1), 4)
    mgr.claim("a")
    step = mgr.allocate(["a"], [3])
    before = mgr.pool.blocks[0].view(torch.uint8).clone()  # uninitialized pages: compare bytes
    with pytest.raises(ValueError, match=r"4 KV heads per page but this rank's layer has 2.*n_devices=2"):
        layer(torch.randn(3, 32), step.input_row_offsets[0], step.collections[0], 0)
    assert torch.equal(mgr.pool.blocks[0].view(torch.uint8), before)


def test_pipeline_stage_rejects_bad_setup():
    from cute_kv import KVCacheParams
    from cute_kv.distributed import PipelineStage

    params = KVCacheParams(torch.float32, 4, 16, page_size=8, total_num_layers=5, pipeline_parallel_degree=2,
                           stage_id=1)
    with pytest.raises(ValueError, match=r"stage 1 holds layers \(3, 5\) \(2\), got 3 layer callables"):
        PipelineStage(params, [None] * 3, ranks=[0, 1])
    with pytest.raises(ValueError, match=r"one rank per stage \(2\)"):
        PipelineStage(params, [None] * 2, ranks=[0])
    with pytest.raises(ValueError, match="stage_id must be set"):
        PipelineStage(KVCacheParams(torch.float32, 4, 16, page_size=8, total_num_layers=2), [None] * 2, ranks=[0])


def test_send_request_checks_token_ids_before_sending():
    from cute_kv import KVCacheParams, PagedKVCacheManager
    from cute_kv.distributed import send_request

    mgr = PagedKVCacheManager(KVCacheParams(torch.float32, 4, 16, page_size=8, total_num_layers=1), 4)
    mgr.claim("a")
    mgr.allocate(["a"], [5])
    mgr.commit()
    with pytest.raises(ValueError, match=r"token_ids has 4 ids but request 'a' has 5 cached tokens"):
        send_request(mgr, "a", 1, token_ids=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="'b' is not claimed"):
        send_request(mgr, "b", 1)
