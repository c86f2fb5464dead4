"""Disaggregated prefill -> decode: rank 0 prefills a prompt, moves its pages to rank 1, which decodes.

    torchrun --nproc-per-node 2 examples/disaggregated.py       # NCCL on GPUs, gloo on a CPU machine

The pages (K/V of every layer, scales for fp8 caches) travel over torch.distributed; the decode worker's manager
registers them in its lookup table and prefix cache, so the second prompt, sharing a prefix with the first, only
sends the pages the decode worker does not already hold. Both ranks then run the same decode step and compare.
"""

import os

import torch
import torch.distributed as dist

from cute_kv import KVCacheParams, PagedKVCacheManager, paged_attention, store_kv
from cute_kv.distributed import recv_request, send_request

N_Q_HEADS, N_KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 4


def run_step(mgr, rids, ids, device, seed):
    """Store this step's K/V (random, seeded: the same on both ranks) in every layer; attention of the last."""
    step = mgr.allocate(rids, token_ids=ids)
    t = sum(step.new_token_counts)
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        k, v, q = (torch.randn(t, h, HEAD_DIM, generator=g).to(device, torch.bfloat16)
                   for h in (N_KV_HEADS, N_KV_HEADS, N_Q_HEADS))
        store_kv(k, v, step.input_row_offsets[0], step.collections[0], layer)
        out = paged_attention(q, step.input_row_offsets[0], step.collections[0], layer)
    mgr.commit()
    return out


def main():
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    params = KVCacheParams(torch.bfloat16, N_KV_HEADS, HEAD_DIM, page_size=16, total_num_layers=LAYERS,
                           enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, 128, devices=[device])
    g = torch.Generator().manual_seed(0)
    system = torch.randint(0, 32000, (64,), generator=g).tolist()  # a shared system prompt: 4 pages
    prompts = {"p": system + torch.randint(0, 32000, (37,), generator=g).tolist(),
               "q": system + torch.randint(0, 32000, (50,), generator=g).tolist()}
    for seed, (rid, prompt) in enumerate(prompts.items()):
        if rank == 0:
            mgr.claim(rid)
            run_step(mgr, [rid], [prompt], device, seed)
            sent = send_request(mgr, rid, 1, token_ids=prompt)
            print(f"prefill worker: {rid}: {len(prompt)} tokens, sent {sent} of {len(mgr.get_req_blocks(rid))} pages")
        else:
            recv_request(mgr, 0)
            print(f"decode worker: {rid}: pages {mgr.get_req_blocks(rid)}, {mgr.cache_length(rid)} tokens cached")
    out = run_step(mgr, list(prompts), [[1], [2]], device, seed=99)  # one decode step on both sides
    if rank == 0:
        dist.send(out.contiguous(), dst=1)
    else:
        sender = torch.empty_like(out)
        dist.recv(sender, src=0)
        diff = float((out.float() - sender.float()).abs().max())
        print(f"decode worker: attention after the transfer vs the prefill worker's: max |diff| {diff:.3g}")
        if diff:
            raise SystemExit("decode attention after the transfer differs from the prefill worker's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
