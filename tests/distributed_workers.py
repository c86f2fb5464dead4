"""Worker processes of tests/test_distributed.py: a small attention model driven over gloo, one process per rank.

Every rank builds the same weights and embeddings from fixed seeds; rank 0 plays the scheduler (its random token
ids are broadcast). A worker raises on any mismatch, which fails the spawning test with the rank's traceback.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from cute_kv import KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheManager, RopeConfig
from cute_kv.distributed import (PipelineStage, TensorParallelAttention, assert_same_pages, broadcast_step,
                                 head_range, recv_request, send_request)
from numerics import rel_err

HIDDEN, HQ, H, D, P, PAGES, VOCAB = 64, 8, 4, 32, 8, 40, 1000
ROPE = RopeConfig.from_theta(D, 512, 10000.0)
# (request, new tokens) per step: ragged prefill incl. 1 token, a request sitting out (0), decode, a late request
# "d" whose first 24 ids are "c"'s (3 pages served by the prefix cache) and an empty one.
STEPS = (
    {"a": 21, "b": 1, "c": 30},
    {"a": 1, "b": 0, "c": 1},
    {"a": 1, "b": 1, "d": 29, "e": 0},
    {"a": 1, "b": 1, "c": 1, "d": 1, "e": 3},
)
SHARED = ("d", "c", 24)


def init(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)  # ranks share the machine's cores


def layer_weights(layer: int, dtype: torch.dtype):
    """``(w_qkv, w_o, bias)`` of ``layer``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + layer)
    w_qkv = torch.randn((HQ + 2 * H) * D, HIDDEN, generator=g) / math.sqrt(HIDDEN)
    w_o = torch.randn(HIDDEN, HQ * D, generator=g) / math.sqrt(HQ * D)
    bias = torch.randn((HQ + 2 * H) * D, generator=g) / 4
    return w_qkv.to(dtype), w_o.to(dtype), bias.to(dtype)


def embedding(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7)).to(dtype)


def residual(attention):
    return lambda h, ro, coll, layer: h + attention(h, ro, coll, layer)


class Scheduler:
    """Rank 0's choices (request ids, fresh token ids; the late request repeats its donor's prompt prefix), the same
    on every rank through ``broadcast_step``; keeps every request's ids so far."""

    def __init__(self):
        self.g = torch.Generator().manual_seed(42)
        self.tokens: dict[str, list[int]] = {}

    def step(self, counts: dict):
        rids = ids = None
        if dist.get_rank() == 0:
            rids, ids = list(counts), []
            for rid, n in counts.items():
                new = torch.randint(0, VOCAB, (n,), generator=self.g).tolist()
                if rid == SHARED[0] and rid not in self.tokens:
                    new[:SHARED[2]] = self.tokens[SHARED[1]][:SHARED[2]]
                ids.append(new)
        rids, ids = broadcast_step(rids, ids)
        for rid, new in zip(rids, ids):
            self.tokens.setdefault(rid, []).extend(new)
        return rids, ids


def step_hidden(emb: torch.Tensor, ids, step) -> torch.Tensor:
    """Embeddings of the tokens each request runs: its step ids less the prefix-cache hits."""
    rows = [torch.tensor(i[s:], dtype=torch.int64) for i, s in zip(ids, step.skipped_tokens)]
    return emb[torch.cat(rows)] if rows else emb[:0]


def cached_rows(mgr, rid) -> torch.Tensor:
    """The request's cached K/V rows ``[KVD, L, tokens, H, D]`` read through its pages (page tails past its length
    hold whatever the page held before)."""
    blocks = mgr.pool.blocks[0][mgr.get_req_blocks(rid)]
    return blocks.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :mgr.cache_length(rid)]


def claim_new(managers, rids) -> None:
    for mgr in managers:
        for rid in rids:
            if rid not in mgr:
                mgr.claim(rid)


# -- tensor parallelism ---------------------------------------------------------------------------------


def tensor_parallel(rank: int, world: int, port: int, dtype_name: str) -> None:
    init(rank, world, port)
    dtype = getattr(torch, dtype_name)
    layers = 2
    base = dict(dtype=dtype, n_kv_heads=H, head_dim=D, page_size=P, total_num_layers=layers,
                enable_prefix_caching=True)
    shard = PagedKVCacheManager(KVCacheParams(**base, n_devices=world), PAGES, devices=["cpu"])
    full = PagedKVCacheManager(KVCacheParams(**base), PAGES)
    tp = [TensorParallelAttention(*layer_weights(l, dtype)[:2], HQ, H, D, bias=layer_weights(l, dtype)[2], rope=ROPE,
                                  rank=rank, world=world) for l in range(layers)]
    ref = [TensorParallelAttention(*layer_weights(l, dtype)[:2], HQ, H, D, bias=layer_weights(l, dtype)[2], rope=ROPE)
           for l in range(layers)]
    emb, sched = embedding(dtype), Scheduler()
    k0, k1 = head_range(H, rank, world)

    def close(got, want):  # float32: summation order only; bf16: each rank's partial sum is rounded once more
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            assert rel_err(got, want) < 1e-2, rel_err(got, want)
    for counts in STEPS:
        rids, ids = sched.step(counts)
        claim_new((shard, full), rids)
        s, r = shard.allocate(rids, token_ids=ids), full.allocate(rids, token_ids=ids)
        assert_same_pages(s)
        if SHARED[0] in counts and counts[SHARED[0]] > 1:  # the late request's prompt: prefix-cache hits
            assert s.skipped_tokens[rids.index(SHARED[0])] == SHARED[2]
        assert torch.equal(s.collections[0].lookup_table, r.collections[0].lookup_table)  # heads never move pages
        h_tp = h_ref = step_hidden(emb, ids, s)
        for l in range(layers):
            h_tp = h_tp + tp[l](h_tp, s.input_row_offsets[0], s.collections[0], l)
            h_ref = h_ref + ref[l](h_ref, r.input_row_offsets[0], r.collections[0], l)
        assert torch.isfinite(h_tp).all()
        close(h_tp, h_ref)
        # Every rank ends with the same output (the all-reduce), and its cache holds its heads of the full cache.
        gathered = [torch.empty_like(h_tp) for _ in range(world)]
        dist.all_gather(gathered, h_tp)
        assert all(torch.equal(x, h_tp) for x in gathered)
        shard.commit()
        full.commit()
        for rid in rids:
            if shard.cache_length(rid):
                close(cached_rows(shard, rid), cached_rows(full, rid)[..., k0:k1, :])
    assert shard.metrics.cache_hit_tokens == SHARED[2]
    shard.check_invariants()
    dist.destroy_process_group()


# -- pipeline parallelism -------------------------------------------------------------------------------


def pipeline(rank: int, world: int, port: int) -> None:
    init(rank, world, port)
    dtype, layers = torch.float32, 5
    base = dict(dtype=dtype, n_kv_heads=H, head_dim=D, page_size=P, total_num_layers=layers,
                enable_prefix_caching=True)
    params = KVCacheParams(**base, pipeline_parallel_degree=world, stage_id=0).for_stage(rank)
    start, stop = params.stage_layer_range(rank)
    attn = [TensorParallelAttention(*layer_weights(l, dtype)[:2], HQ, H, D, bias=layer_weights(l, dtype)[2],
                                    rope=ROPE) for l in range(layers)]
    stage = PipelineStage(params, [residual(attn[l]) for l in range(start, stop)], ranks=list(range(world)))
    mgr = PagedKVCacheManager(params, PAGES)
    unsplit = PagedKVCacheManager(KVCacheParams(**base), PAGES)
    emb, sched = embedding(dtype), Scheduler()
    for counts in STEPS:
        rids, ids = sched.step(counts)
        claim_new((mgr, unsplit), rids)
        s, r = mgr.allocate(rids, token_ids=ids), unsplit.allocate(rids, token_ids=ids)
        assert_same_pages(s)
        hidden = step_hidden(emb, ids, s)
        out = stage(s, hidden if stage.is_first else None, hidden_size=HIDDEN, dtype=dtype)
        ref = hidden
        for l in range(stop):  # the unsplit model up to this stage's last layer
            ref = residual(attn[l])(ref, r.input_row_offsets[0], r.collections[0], l)
        assert torch.equal(out, ref), f"stage {rank}: max diff {float((out - ref).abs().max())}"
        mgr.commit()
        unsplit.commit()
        for rid in rids:  # the stage's cache holds exactly its layers of the unsplit model's cache
            assert torch.equal(cached_rows(mgr, rid), cached_rows(unsplit, rid)[:, start:stop])
    assert mgr.pool.blocks[0].shape[2] == stop - start
    dist.destroy_process_group()


def tensor_parallel_pipeline(rank: int, world: int, port: int) -> None:
    """2 stages x 2 tensor-parallel ranks: stage s is ranks (2s, 2s+1), each stage's TP pair all-reduces in its own
    group and sends to its peer of the next stage; the last stage equals the unsplit, unsharded model."""
    init(rank, world, port)
    dtype, layers, tp = torch.float32, 5, 2
    stage_id, tp_rank = divmod(rank, tp)
    groups = [dist.new_group([s * tp + r for r in range(tp)]) for s in range(world // tp)]  # every rank makes all
    base = dict(dtype=dtype, n_kv_heads=H, head_dim=D, page_size=P, total_num_layers=layers,
                enable_prefix_caching=True)
    params = KVCacheParams(**base, n_devices=tp, pipeline_parallel_degree=world // tp, stage_id=0).for_stage(stage_id)
    start, stop = params.stage_layer_range(stage_id)
    weights = [layer_weights(l, dtype) for l in range(layers)]
    sharded = [TensorParallelAttention(w, o, HQ, H, D, bias=b, rope=ROPE, rank=tp_rank, world=tp,
                                       group=groups[stage_id]) for w, o, b in weights[start:stop]]
    stage = PipelineStage(params, [residual(a) for a in sharded], ranks=[s * tp + tp_rank for s in range(world // tp)])
    full = [TensorParallelAttention(w, o, HQ, H, D, bias=b, rope=ROPE) for w, o, b in weights]
    mgr = PagedKVCacheManager(params, PAGES, devices=["cpu"])
    unsplit = PagedKVCacheManager(KVCacheParams(**base), PAGES)
    emb, sched = embedding(dtype), Scheduler()
    k0, k1 = head_range(H, tp_rank, tp)
    for counts in STEPS:
        rids, ids = sched.step(counts)
        claim_new((mgr, unsplit), rids)
        s, r = mgr.allocate(rids, token_ids=ids), unsplit.allocate(rids, token_ids=ids)
        assert_same_pages(s)
        hidden = step_hidden(emb, ids, s)
        out = stage(s, hidden if stage.is_first else None, hidden_size=HIDDEN, dtype=dtype)
        ref = hidden
        for l in range(stop):
            ref = residual(full[l])(ref, r.input_row_offsets[0], r.collections[0], l)
        # Five layers of sharded matmuls summed across ranks round differently from the unsharded ones: float32
        # rounding (~1e-5 of these activations near 0.1), not a wrong shard, which would be off by the activations.
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=5e-5)
        mgr.commit()
        unsplit.commit()
        for rid in rids:  # this rank's heads of this stage's layers
            torch.testing.assert_close(cached_rows(mgr, rid), cached_rows(unsplit, rid)[:, start:stop, :, k0:k1],
                                       rtol=1e-5, atol=1e-5)
    dist.destroy_process_group()


# -- disaggregated prefill -> decode ----------------------------------------------------------------------


def disaggregated(rank: int, world: int, port: int) -> None:
    init(rank, world, port)
    fp8 = dict(dtype=torch.float8_e4m3fn, kvcache_quant_config=KVCacheQuantizationConfig(torch.float32, 16))
    for cache in (dict(dtype=torch.bfloat16), fp8):
        _transfer_case(rank, cache)
    _refused_transfer(rank)
    dist.destroy_process_group()


def _transfer_case(rank: int, cache: dict) -> None:
    act, layers = torch.bfloat16, 2
    params = KVCacheParams(n_kv_heads=H, head_dim=D, page_size=P, total_num_layers=layers, enable_prefix_caching=True,
                           **cache)
    mgr = PagedKVCacheManager(params, PAGES)
    attn = [residual(TensorParallelAttention(*layer_weights(l, act)[:2], HQ, H, D, bias=layer_weights(l, act)[2],
                                             rope=ROPE)) for l in range(layers)]
    emb, g = embedding(act), torch.Generator().manual_seed(3)
    prompt_p = torch.randint(0, VOCAB, (29,), generator=g).tolist()
    prompt_q = prompt_p[:16] + torch.randint(0, VOCAB, (13,), generator=g).tolist()  # 2 pages shared with p

    def run(step, ids):
        h = step_hidden(emb, ids, step)
        for l, layer in enumerate(attn):
            h = layer(h, step.input_row_offsets[0], step.collections[0], l)
        return h

    if rank == 0:  # prefill worker
        for rid, prompt in (("p", prompt_p), ("q", prompt_q)):
            mgr.claim(rid)
            run(mgr.allocate([rid], token_ids=[prompt]), [prompt])
            mgr.commit()
        assert mgr.metrics.cache_hit_tokens == 16
        assert send_request(mgr, "p", 1, token_ids=prompt_p) == 4
        assert send_request(mgr, "q", 1, token_ids=prompt_q) == 2  # the receiver already holds q's first 2 pages
        for tensors in (mgr.pool.blocks, mgr.pool.scales):  # the request's page bytes, for the receiver to compare
            if tensors[0] is not None:
                dist.send(tensors[0].view(torch.uint8)[mgr.get_req_blocks("q")], dst=1)
    else:  # decode worker: another request already lives in its cache
        mgr.claim("z")
        z_ids = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(9)).tolist()
        run(mgr.allocate(["z"], token_ids=[z_ids]), [z_ids])
        mgr.commit()
        before = [None if t is None else t.view(torch.uint8).clone() for t in (mgr.pool.blocks[0], mgr.pool.scales[0])]
        assert recv_request(mgr, 0) == "p" and recv_request(mgr, 0) == "q"
        pages_p, pages_q = mgr.get_req_blocks("p"), mgr.get_req_blocks("q")
        assert pages_q[:2] == pages_p[:2] and len(set(pages_p + pages_q)) == 6  # q's prefix shares p's pages
        assert (mgr.cache_length("p"), mgr.cache_length("q")) == (29, 29)
        assert mgr.metrics.cached_pages == 2 + 3 + 1  # z's, p's and q's own full pages are prefix-cache entries
        mgr.check_invariants()
        written = set(pages_p + pages_q)
        for old, new in zip(before, (mgr.pool.blocks[0], mgr.pool.scales[0])):
            if old is not None:
                new = new.view(torch.uint8)
                untouched = [i for i in range(old.shape[0]) if i not in written]
                assert torch.equal(old[untouched], new[untouched])
                sent = torch.empty_like(new[pages_q])
                dist.recv(sent, src=0)
                assert torch.equal(sent, new[pages_q])  # K/V and scales arrived bit for bit
        # A local request with q's prompt now hits the received pages.
        mgr.claim("r")
        hit = mgr.allocate(["r"], token_ids=[prompt_q + [5]])
        assert hit.skipped_tokens == (24,)
        mgr.release("r", discard_step=True)  # the probe step is never committed
    # Decode after the transfer: the same step on both sides gives the same attention output.
    decode = [[11], [12]]
    out = run(mgr.allocate(["p", "q"], token_ids=decode), decode)
    mgr.commit()
    assert torch.isfinite(out).all()
    if rank == 0:
        dist.send(out, dst=1)
    else:
        sender_out = torch.empty_like(out)
        dist.recv(sender_out, src=0)
        assert torch.equal(out, sender_out), f"max diff {float((out.float() - sender_out.float()).abs().max())}"


def _refused_transfer(rank: int) -> None:
    """A receiver whose pages differ refuses before any page moves, and both sides raise."""
    params = KVCacheParams(torch.bfloat16, H, D, page_size=P if rank == 0 else 2 * P, total_num_layers=1)
    mgr = PagedKVCacheManager(params, 8)
    if rank == 0:
        mgr.claim("x")
        mgr.allocate(["x"], [5])
        mgr.commit()
        try:
            send_request(mgr, "x", 1)
        except RuntimeError as e:
            assert "refused" in str(e) and "geometry differs" in str(e)
        else:
            raise AssertionError("send_request to a receiver with another page size did not raise")
    else:
        try:
            recv_request(mgr, 0)
        except ValueError as e:
            assert "geometry differs" in str(e)
        else:
            raise AssertionError("recv_request with another page size did not raise")
        assert "x" not in mgr and mgr.num_free_blocks == 8
