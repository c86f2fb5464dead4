"""Tensor-parallel attention over a paged KV cache, one process per rank:

    torchrun --nproc-per-node 2 examples/tensor_parallel.py     # NCCL on GPUs, gloo on a CPU machine

Every rank owns n_kv_heads / world heads of every page. Rank 0 schedules (request ids, token ids) and broadcasts;
every rank's manager then makes the same page decisions. Each layer: column-parallel fused QKV writing the rank's
K/V heads into its pages, paged attention on its heads, row-parallel output projection and an all-reduce.

Every rank also runs the same steps unsharded (all heads, its own cache) and exits with an error if the
tensor-parallel output differs by more than bf16 rounding: each rank's partial output is rounded before the sum.
"""

import math
import os
import sys

import torch
import torch.distributed as dist

from cute_kv import KVCacheParams, PagedKVCacheManager, RopeConfig
from cute_kv.distributed import TensorParallelAttention, assert_same_pages, broadcast_step

HIDDEN, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 1024, 8, 4, 128, 2, 32000
STEPS = ({"a": 37, "b": 1, "c": 100}, {"a": 1, "b": 1, "c": 1}, {"a": 1, "c": 1, "d": 120})
# max |tensor-parallel - unsharded| / max |unsharded|: bf16 rounds each layer's partial sums and residual adds (about
# 4e-3 each, 8e-3 measured on the CPU); a wrong shard or a missing all-reduce is off by tens of percent.
TOLERANCE = 3e-2


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16
    geometry = dict(page_size=16, total_num_layers=LAYERS, enable_prefix_caching=True)
    params = KVCacheParams(dtype, N_KV_HEADS, HEAD_DIM, n_devices=world, **geometry)
    mgr = PagedKVCacheManager(params, 256, devices=[device])
    full = PagedKVCacheManager(KVCacheParams(dtype, N_KV_HEADS, HEAD_DIM, **geometry), 256, devices=[device])
    rope = RopeConfig.from_theta(HEAD_DIM, 4096, 500000.0, device=device)
    g = torch.Generator().manual_seed(0)  # the same full weights on every rank; each keeps its shard
    layers, unsharded = [], []
    for _ in range(LAYERS):
        w_qkv = torch.randn((N_Q_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, HIDDEN, generator=g) / math.sqrt(HIDDEN)
        w_o = torch.randn(HIDDEN, N_Q_HEADS * HEAD_DIM, generator=g) / math.sqrt(N_Q_HEADS * HEAD_DIM)
        w_qkv, w_o = w_qkv.to(device, dtype), w_o.to(device, dtype)
        layers.append(TensorParallelAttention(w_qkv, w_o, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, rope=rope, rank=rank,
                                              world=world))
        unsharded.append(TensorParallelAttention(w_qkv, w_o, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, rope=rope))
    embedding = torch.randn(VOCAB, HIDDEN, generator=g).to(device, dtype)
    sched = torch.Generator().manual_seed(1)
    for i, counts in enumerate(STEPS):
        choice = (list(counts), [torch.randint(0, VOCAB, (n,), generator=sched).tolist() for n in counts.values()])
        rids, ids = broadcast_step(*(choice if rank == 0 else (None, None)))
        for m in (mgr, full):
            for rid in rids:
                if rid not in m:
                    m.claim(rid)
        step, whole = mgr.allocate(rids, token_ids=ids), full.allocate(rids, token_ids=ids)
        assert_same_pages(step)
        tokens = torch.tensor([t for row, s in zip(ids, step.skipped_tokens) for t in row[s:]], device=device)
        hidden = want = embedding[tokens]
        for layer_idx, (layer, reference) in enumerate(zip(layers, unsharded)):
            hidden = hidden + layer(hidden, step.input_row_offsets[0], step.collections[0], layer_idx)
            want = want + reference(want, whole.input_row_offsets[0], whole.collections[0], layer_idx)
        mgr.commit()
        full.commit()
        err = float((hidden.float() - want.float()).abs().max() / want.float().abs().max())
        if not err <= TOLERANCE:  # NaN fails too
            sys.exit(f"rank {rank}, step {i}: the tensor-parallel output differs from the unsharded layers: "
                     f"max |diff| / max |unsharded| = {err:.3g} > {TOLERANCE}")
        if rank == 0:
            print(f"step {i}: {hidden.shape[0]} tokens of {len(rids)} requests on {world} ranks x "
                  f"{params.n_kv_heads_per_device} KV heads; output norm {float(hidden.float().norm()):.3f}, "
                  f"relative difference to the unsharded layers {err:.1e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
