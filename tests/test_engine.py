"""What an inference engine needs from the manager each step: fork, rollback, multistep allocation,
can_allocate, step generations, prefix keys, the scheduler's prefix lookup, CUDA-graph buffers, positions,
and ops that never attach the page pool to autograd."""

import numpy as np
import pytest
import torch

import cute_kv
from cute_kv import (GraphStepBuffers, InsufficientBlocksError, PagedKVCacheManager, PrefixKeys, last_row_indices,
                     padded_lut_cols, positions, store_kv)
from cute_kv.manager.prefix_cache import HASH_ALGORITHMS, ROOT_HASH, hash_pages
from test_manager import P, expected_kv, make_params, read_kv, run_prompt, snapshot, write_step


def prefix_manager(pages=32, **kw):
    return PagedKVCacheManager(make_params(enable_prefix_caching=True), pages, **kw)


def decode(mgr, rid, tokens, token):
    """One decode step of ``rid`` writing the K/V of ``tokens + [token]``; returns the new token list."""
    tokens = tokens + [token]
    inputs = mgr.allocate([rid], token_ids=[[token]])
    write_step(mgr, inputs, [expected_kv(tokens, mgr.params)])
    mgr.commit()
    return tokens


# -- fork ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [0, 3, 8, 10])
def test_fork_shares_full_pages_and_copies_the_partial_one(length):
    mgr = prefix_manager()
    tokens = list(range(1, length + 1))
    if length:
        run_prompt(mgr, "a", tokens)
    else:
        mgr.claim("a")
    mgr.fork("a", "b")
    pa, pb = mgr.get_req_blocks("a"), mgr.get_req_blocks("b")
    full = length // P
    assert pa[:full] == pb[:full] and len(pb) == -(-length // P)
    if length % P:
        assert pa[-1] != pb[-1] and mgr.pool.ref_cnt[pb[-1]] == 1
    assert all(mgr.pool.ref_cnt[p] == 2 for p in pa[:full])
    assert mgr.cache_length("b") == length
    assert torch.equal(read_kv(mgr, "b", length), read_kv(mgr, "a", length))
    mgr.check_invariants()
    # The two diverge: each writes its own next tokens, neither sees the other's.
    ta = decode(mgr, "a", tokens, 100)
    tb = decode(mgr, "b", tokens, 200)
    assert torch.equal(read_kv(mgr, "a", length + 1), expected_kv(ta, mgr.params))
    assert torch.equal(read_kv(mgr, "b", length + 1), expected_kv(tb, mgr.params))
    mgr.check_invariants()
    mgr.release("a")
    mgr.release("b")
    assert mgr.num_free_blocks == 32


def test_fork_errors_change_nothing():
    mgr = PagedKVCacheManager(make_params(), 2)
    run_prompt(mgr, "a", [1, 2, 3, 4, 5])  # both pages, the second partly filled
    before = snapshot(mgr)
    with pytest.raises(InsufficientBlocksError, match="fork"):
        mgr.fork("a", "b")
    with pytest.raises(ValueError, match="already claimed"):
        mgr.fork("a", "a")
    with pytest.raises(ValueError, match="not claimed"):
        mgr.fork("x", "b")
    mgr.allocate(["a"], [1])
    with pytest.raises(ValueError, match="uncommitted step"):
        mgr.fork("a", "c")
    mgr.commit()
    assert "b" not in mgr and "c" not in mgr


# -- rollback -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop", [0, 1, 3, 4, 6, 11])
def test_rollback_restores_the_earlier_state(drop):
    mgr = prefix_manager()
    tokens = [5, 6, 7, 8, 9, 10, 11]
    run_prompt(mgr, "a", tokens)
    before = (mgr.get_req_blocks("a"), list(mgr._table.hashes[0]), mgr._table.tail[0, :3].tolist())
    draft = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50][:drop]
    inputs = mgr.allocate(["a"], token_ids=[draft]) if draft else None
    if draft:
        write_step(mgr, inputs, [expected_kv(tokens + draft, mgr.params)])
        mgr.commit()
    mgr.rollback("a", drop)
    assert mgr.cache_length("a") == len(tokens)
    assert mgr.get_req_blocks("a") == before[0]
    assert mgr._table.hashes[0] == before[1] and mgr._table.tail[0, :3].tolist() == before[2]
    assert mgr._table.tail_len[0] == 3
    assert torch.equal(read_kv(mgr, "a", len(tokens)), expected_kv(tokens, mgr.params))
    mgr.check_invariants()


def test_rollback_into_a_cached_page_copies_or_evicts_it():
    mgr = prefix_manager()
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    run_prompt(mgr, "a", tokens)
    mgr.fork("a", "b")  # shares pages 0 and 1 (both in the prefix cache)
    shared = mgr.get_req_blocks("a")[1]
    mgr.rollback("a", 6)  # "a" keeps 3 tokens: its page 0 is shared, so it gets a private copy
    pa = mgr.get_req_blocks("a")
    assert len(pa) == 1 and pa[0] != mgr.get_req_blocks("b")[0]
    assert torch.equal(read_kv(mgr, "a", 3), expected_kv(tokens[:3], mgr.params))
    assert mgr.prefix_cache.hash_to_page.get(mgr._table.hashes[mgr._slot_of["b"]][1]) == shared
    # Continuing "a" with other ids writes its copy, never the page "b" (and the cache) holds.
    ta = decode(mgr, "a", tokens[:3], 77)
    assert torch.equal(read_kv(mgr, "b", 9), expected_kv(tokens, mgr.params))
    assert torch.equal(read_kv(mgr, "a", 4), expected_kv(ta, mgr.params))
    mgr.check_invariants()
    # Alone on a cached page: its prefix-cache entry goes (the page is about to change), no copy.
    mgr.release("a")
    mgr.rollback("b", 2)
    page = mgr.get_req_blocks("b")[1]
    assert mgr.prefix_cache.page_hash[page] is None and mgr.pool.ref_cnt[page] == 1
    mgr.check_invariants()


def test_rollback_errors_change_nothing():
    mgr = prefix_manager()
    run_prompt(mgr, "a", [1, 2, 3])
    before = snapshot(mgr)
    for n in (-1, 4, 1.0, True):
        with pytest.raises(ValueError, match="num_tokens"):
            mgr.rollback("a", n)
    assert snapshot(mgr) == before
    mgr.allocate(["a"], token_ids=[[4]])
    with pytest.raises(ValueError, match="uncommitted step"):
        mgr.rollback("a", 1)


# -- multistep, can_allocate, release, step generations -------------------------------------------------------


def test_multistep_reserves_pages_for_later_steps():
    mgr = PagedKVCacheManager(make_params(), 8)
    mgr.claim("a")
    mgr.allocate(["a"], [3], num_steps=6)  # 3 tokens now, 5 more one-token steps: 8 tokens, 2 pages
    mgr.commit()
    assert len(mgr.get_req_blocks("a")) == 2 and mgr.num_free_blocks == 6
    for _ in range(5):
        assert mgr.can_allocate(["a"], [1])
        inputs = mgr.allocate(["a"], [1])
        assert mgr.num_free_blocks == 6  # no page taken
        assert inputs.collections[0].pages_owned(0) == 2
        mgr.commit()
    mgr.allocate(["a"], [1])  # past the reservation: a new page
    assert mgr.num_free_blocks == 5
    mgr.commit()
    mgr.check_invariants()
    with pytest.raises(ValueError, match="num_steps"):
        mgr.allocate(["a"], [1], num_steps=0)


def test_can_allocate_has_no_side_effects_and_counts_prefix_hits():
    mgr = prefix_manager(pages=4)
    run_prompt(mgr, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 3 pages, 2 cached
    mgr.claim("b")
    before = snapshot(mgr)
    assert mgr.can_allocate(["b"], token_ids=[[1, 2, 3, 4, 5, 6, 7, 8, 1]])  # 2 hits + 1 free page
    assert not mgr.can_allocate(["b"], token_ids=[[9] * 9])  # 3 pages, 1 free
    assert mgr.can_allocate(["b"], token_ids=[[9] * 4]) and not mgr.can_allocate(["b"], token_ids=[[9] * 5])
    assert not mgr.can_allocate(["b"], token_ids=[[9]], num_steps=5)
    assert snapshot(mgr) == before
    with pytest.raises(ValueError, match="not claimed"):
        mgr.can_allocate(["zz"], [1])


def test_release_with_an_uncommitted_step_is_an_error():
    mgr = PagedKVCacheManager(make_params(), 8)
    mgr.claim("a")
    mgr.allocate(["a"], [5])
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="uncommitted step.*discard_step=True"):
        mgr.release("a")
    assert snapshot(mgr) == before
    mgr.release("a", discard_step=True)
    assert mgr.num_free_blocks == 8 and not mgr._live_steps
    mgr.check_invariants()


def test_a_collection_from_an_earlier_step_is_refused():
    mgr = PagedKVCacheManager(make_params(), 8)
    mgr.claim("a")
    mgr.claim("b")
    first = mgr.allocate(["a"], [2])
    second = mgr.allocate(["b"], [1])
    assert second.step_id == first.step_id + 1
    k = torch.randn(2, 2, 4)
    store_kv(k, k, first.input_row_offsets[0], first.collections[0], 0)  # live: fine
    mgr.commit(["a"])
    for op in (lambda: store_kv(k, k, first.input_row_offsets[0], first.collections[0], 0),
               lambda: cute_kv.paged_attention(k, first.input_row_offsets[0], first.collections[0], 1),
               lambda: first.collections[0].get_key_cache(0)):
        with pytest.raises(ValueError, match=f"manager step {first.step_id}, which was committed or released"):
            op()
    store_kv(k[:1], k[:1], second.input_row_offsets[0], second.collections[0], 0)  # the other step still is
    mgr.release("b", discard_step=True)
    with pytest.raises(ValueError, match="which was committed or released"):
        store_kv(k[:1], k[:1], second.input_row_offsets[0], second.collections[0], 0)


# -- prefix keys and the scheduler's lookup -------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", HASH_ALGORITHMS)
def test_prefix_keys_separate_tenants_adapters_and_images(algorithm):
    mgr = prefix_manager(pages=64, hash_algorithm=algorithm)
    prompt = list(range(1, 14))  # 3 full pages + 1
    hit = {}

    def serve(rid, keys):
        mgr.claim(rid, prefix_keys=keys)
        hit[rid] = mgr.allocate([rid], token_ids=[prompt]).skipped_tokens[0]
        mgr.commit()

    serve("plain", None)
    serve("plain2", PrefixKeys())  # empty keys: the plain chain
    serve("t1", PrefixKeys(tenant_salt="tenant-1"))
    serve("t1b", PrefixKeys(tenant_salt="tenant-1"))
    serve("t2", PrefixKeys(tenant_salt=b"tenant-2"))
    serve("lora", PrefixKeys(lora_id=7, tenant_salt="tenant-1"))
    serve("img_a", PrefixKeys(multimodal=((5, 2, "sha-of-image-a"),)))  # placeholders at 5, 6: page 1
    serve("img_a2", PrefixKeys(multimodal=((5, 2, "sha-of-image-a"),)))
    serve("img_b", PrefixKeys(multimodal=((5, 2, "sha-of-image-b"),)))
    assert hit == {"plain": 0, "plain2": 12, "t1": 0, "t1b": 12, "t2": 0, "lora": 0,
                   "img_a": 4, "img_a2": 12, "img_b": 4}  # images share the page before theirs
    mgr.check_invariants()
    with pytest.raises(TypeError, match="prefix_keys"):
        mgr.claim("bad", prefix_keys={"tenant_salt": "x"})
    with pytest.raises(ValueError, match="multimodal"):
        PrefixKeys(multimodal=((0, 0, "x"),))
    with pytest.raises(TypeError, match="tenant_salt"):
        PrefixKeys(tenant_salt=1.5)


def test_hash_algorithms_are_deterministic_and_distinct():
    pages = [[1, 2, 3, 4], [5, 6, 7, 8]]
    chains = {a: hash_pages(ROOT_HASH, pages, a) for a in HASH_ALGORITHMS}
    assert len({tuple(c) for c in chains.values()}) == len(HASH_ALGORITHMS)
    for a, chain in chains.items():
        assert hash_pages(ROOT_HASH, pages, a) == chain
        assert hash_pages(chain[0], pages[1:], a) == chain[1:]  # chained
        extra_second, extra_first = (hash_pages(ROOT_HASH, pages, a, e)[0] for e in ([None, 5], [5, None]))
        assert extra_second == chain[0] != extra_first
    assert PagedKVCacheManager(make_params(), 4).hash_algorithm == "sha256_64"


def test_lookup_prefix_lets_chunked_prefill_keep_its_hits():
    mgr = prefix_manager(pages=64)
    prompt = list(range(100, 123))  # 5 full pages + 3
    run_prompt(mgr, "donor", prompt)
    mgr.claim("a")
    before = snapshot(mgr)
    assert mgr.lookup_prefix("a", prompt) == 20  # 5 pages
    assert mgr.lookup_prefix("a", prompt[:9]) == 8  # never the last token's page
    assert mgr.lookup_prefix("a", [1] + prompt[1:]) == 0
    assert snapshot(mgr) == before
    # A scheduler with 4-token chunks: allocate hit + chunk ids, all 20 hits kept.
    hit = mgr.lookup_prefix("a", prompt)
    inputs = mgr.allocate(["a"], token_ids=[prompt[:hit + 4]])
    assert inputs.skipped_tokens == (20,) and inputs.new_token_counts == (3,)
    mgr.commit()
    assert PagedKVCacheManager(make_params(), 4).lookup_prefix("x", [1]) == 0  # no prefix caching: no hits


# -- positions, last rows, CUDA-graph buffers ----------------------------------------------------------------


def test_positions_and_last_rows_from_uint32_metadata():
    ro = torch.tensor([0, 3, 3, 4, 9], dtype=torch.uint32)
    cl = torch.tensor([5, 7, 0, 2], dtype=torch.uint32)
    assert positions(ro, cl).tolist() == [5, 6, 7, 0, 2, 3, 4, 5, 6]
    assert last_row_indices(ro).tolist() == [2, -1, 3, 8]
    mgr = PagedKVCacheManager(make_params(), 16)
    for rid in "abc":
        mgr.claim(rid)
    mgr.allocate(["a"], [6])
    mgr.commit()
    inputs = mgr.allocate(["a", "b", "c"], [1, 4, 2])
    assert inputs.positions[0].tolist() == [6, 0, 1, 2, 3, 0, 1]
    assert inputs.last_row_indices[0].tolist() == [0, 4, 6]


def test_graph_buffers_are_filled_in_place_with_padding_on_the_null_page():
    """Each step equals the same step without buffers (a twin manager driven alike), padded after it."""
    steps = [(["a", "b", "c"], [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9]]), (["b"], [[8]]), (["a", "c"], [[6], [1]])]
    mgr, twin = prefix_manager(pages=32), prefix_manager(pages=32)
    buffers = GraphStepBuffers(mgr, max_batch_size=4, max_context_length=24, max_step_tokens=12)
    null = mgr.pool.null_page
    assert buffers.collections[0].lookup_table.shape == (4, padded_lut_cols(6))
    assert (buffers.collections[0].max_seq_length, buffers.collections[0].max_cache_length) == (12, 24)
    tensors = [buffers.collections[0].cache_lengths, buffers.collections[0].lookup_table,
               buffers.input_row_offsets[0], buffers.positions[0], buffers.last_row_indices[0]]
    addresses = [t.data_ptr() for t in tensors]
    for m in (mgr, twin):
        for rid in "abc":
            m.claim(rid)
    for rids, ids in steps:
        got = mgr.allocate(rids, token_ids=ids, graph_buffers=buffers)
        want = twin.allocate(rids, token_ids=ids)
        b, t = len(rids), sum(want.new_token_counts)
        assert got.collections is buffers.collections and got.graph_buffers is buffers
        assert [x.data_ptr() for x in tensors] == addresses  # filled in place
        coll, wcoll = got.collections[0], want.collections[0]
        assert coll.cache_lengths[:b].tolist() == wcoll.cache_lengths.tolist()
        assert coll.cache_lengths[b:].tolist() == [0] * (4 - b)
        w = wcoll.lookup_table.shape[1]
        assert torch.equal(coll.lookup_table[:b, :w], wcoll.lookup_table)
        assert (coll.lookup_table[:b, w:] == null).all() and (coll.lookup_table[b:] == null).all()
        assert got.input_row_offsets[0].tolist() == want.input_row_offsets[0].tolist() + [t] * (4 - b)
        assert got.positions[0][:t].tolist() == want.positions[0].tolist()
        assert (got.positions[0][t:] == 0).all()
        assert got.last_row_indices[0][:b].tolist() == want.last_row_indices[0].tolist()
        # The padded step drives the ops like the real one: the same K/V lands in the same rows.
        k = torch.randn(t, 2, 4)
        store_kv(k, k, got.input_row_offsets[0], coll, 0)
        store_kv(k, k, want.input_row_offsets[0], wcoll, 0)
        mgr.commit()
        twin.commit()
        for rid in "abc":
            n = mgr.cache_length(rid)
            assert mgr.get_req_blocks(rid) == twin.get_req_blocks(rid)
            assert torch.equal(read_kv(mgr, rid, n)[:, :, 0], read_kv(twin, rid, n)[:, :, 0])  # layer 0 written
        assert (mgr.pool.blocks[0][null] == 0).all()
    for rid in "defg":
        mgr.claim(rid)
    mgr.allocate(["d"], token_ids=[list(range(100, 120))])  # a step the buffers need not hold
    mgr.commit()
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="5 requests, more than the buffers' maximum 4"):
        mgr.allocate(list("abcde"), token_ids=[[1]] * 5, graph_buffers=buffers)
    with pytest.raises(ValueError, match="context length"):
        mgr.allocate(["d"], token_ids=[[1] * 5], graph_buffers=buffers)  # 25 > 24
    with pytest.raises(ValueError, match="new rows"):
        mgr.allocate(["e"], token_ids=[list(range(13))], graph_buffers=buffers)
    with pytest.raises(ValueError, match="another PagedKVCacheManager"):
        twin.allocate(["a"], token_ids=[[1]], graph_buffers=buffers)
    assert snapshot(mgr) == before
    mgr.check_invariants()


@pytest.mark.gpu
def test_graph_buffers_replay_one_cuda_graph_for_steps_of_any_batch():
    """Pinned staging + non-blocking copies feed a captured graph: each replay reads the latest step."""
    mgr = PagedKVCacheManager(make_params(), 64, devices=["cuda"])
    buffers = GraphStepBuffers(mgr, max_batch_size=8, max_context_length=64, max_step_tokens=32)
    assert all(t.is_pinned() for t in buffers._host)
    coll, ro = buffers.collections[0], buffers.input_row_offsets[0]
    for rid in range(8):
        mgr.claim(rid)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        mgr.allocate([0], [1], graph_buffers=buffers)
    mgr.commit()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            # What a captured step computes from the metadata alone (kernels read the same tensors).
            summary = torch.stack((coll.cache_lengths.long().sum(), ro.long()[-1], buffers.positions[0].sum(),
                                   coll.lookup_table.long().sum(), buffers.last_row_indices[0].sum()))
    for rids, counts in (([0, 1, 2], [1, 5, 3]), ([3], [20]), (list(range(8)), [1] * 8), ([4, 5], [2, 2])):
        with torch.cuda.stream(stream):  # the copies and the replay in one stream's order
            step = mgr.allocate(rids, counts, graph_buffers=buffers)
            graph.replay()
        twin_lengths = [mgr.cache_length(r) for r in rids]
        stream.synchronize()
        t = sum(counts)
        pos = [c + i for c, n in zip(twin_lengths, counts) for i in range(n)]
        lut = sum(sum(mgr.get_req_blocks(r)) for r in rids)
        cols = coll.lookup_table.shape[1]
        lut += (8 * cols - sum(len(mgr.get_req_blocks(r)) for r in rids)) * mgr.pool.null_page
        last = sum(int(x) for x in torch.tensor(counts).cumsum(0) - 1)
        assert summary.tolist() == [sum(twin_lengths), t, sum(pos), lut, last]
        assert step.positions[0][:t].tolist() == pos
        mgr.commit()


# -- autograd -----------------------------------------------------------------------------------------------


def test_ops_never_attach_the_page_pool_to_autograd():
    mgr = PagedKVCacheManager(make_params(), 8)
    mgr.claim("a")
    inputs = mgr.allocate(["a"], [3])
    coll, ro = inputs.collections[0], inputs.input_row_offsets[0]
    k = torch.randn(3, 2, 4, requires_grad=True)
    store_kv(k, k * 2, ro, coll, 0)
    weight = torch.randn(4 * 4 + 2 * 2 * 4, 8, requires_grad=True)
    q = cute_kv.fused_qkv_matmul_kv_cache(torch.randn(3, 8), ro, weight, coll, 1)
    out = cute_kv.paged_attention(q.view(3, 4, 4), ro, coll, 1)
    assert not mgr.pool.blocks[0].requires_grad and mgr.pool.blocks[0].grad_fn is None
    out.sum().backward()  # the activations keep their own graph
    assert weight.grad is not None
    assert torch.equal(read_kv(mgr, "a", 3)[:, :, 0], torch.stack((k, 2 * k), 1).detach())
