"""PagedKVCacheManager: lifecycle, lookup tables, prefix caching, host swap, devices, errors; plus a
hypothesis state machine over random claim/allocate (multistep)/commit/fork/rollback/release sequences that
checks the bookkeeping, the page hashes and the K/V bytes every live request reads back."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cute_kv import (InsufficientBlocksError, KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheManager,
                     input_row_offsets, max_lengths, padded_lut_cols, store_kv)
from cute_kv.manager.prefix_cache import ROOT_HASH, hash_pages

P = 4  # page size: small, so short sequences cross many pages


def make_params(**kw):
    base = dict(dtype=torch.float32, n_kv_heads=2, head_dim=4, page_size=P, total_num_layers=2)
    return KVCacheParams(**{**base, **kw})


def swap_params(host_pages, **kw):
    """Prefix caching with host swap space of exactly ``host_pages`` pages."""
    probe = make_params(**kw)
    return make_params(enable_prefix_caching=True, enable_kvcache_swapping_to_host=True,
                       host_kvcache_swap_space_gb=(host_pages + 0.5) * probe.bytes_per_block / 2**30, **kw)


def expected_kv(tokens, params):
    """Deterministic K/V for every position of ``tokens``: ``[T, KVD, L, H, D]`` over all heads.

    Position t depends on the whole prefix ``tokens[:t+1]`` (as a model's K/V does) and every (K/V, layer,
    head, dim) slot differs; all values are exact in float32.
    """
    v, rolling = [], 0
    for tok in tokens:
        rolling = (rolling * 31 + tok + 1) % 2**16
        v.append(rolling)
    kvd, nl, h, d = params.kv_dim, params.num_layers, params.n_kv_heads, params.head_dim
    plane = torch.arange(kvd * nl * h * d, dtype=torch.float32).reshape(kvd, nl, h, d) * 2**16
    return torch.tensor(v, dtype=torch.float32)[:, None, None, None, None] + plane


def write_step(mgr, inputs, values):
    """What the model's kernels do: write each request's run tokens through every device's collection."""
    hd = mgr.params.n_kv_heads_per_device
    for d, coll in enumerate(inputs.collections):
        heads = slice(d * hd, (d + 1) * hd) if len(mgr.devices) > 1 else slice(None)
        for b, (start, run) in enumerate(zip(coll.cache_lengths.tolist(), inputs.new_token_counts)):
            for layer in range(coll.num_layers):
                for kv, cache in enumerate((coll.get_key_cache(layer), coll.get_value_cache(layer))):
                    cache.scatter(b, start, values[b][start:start + run, kv, layer, heads].to(coll.dtype))


def read_kv(mgr, rid, stop):
    """Tokens ``[0, stop)`` of ``rid`` straight from the 6-D pools: ``[T, KVD, L, H_all, D]``."""
    pages = mgr.get_req_blocks(rid)
    pos = torch.arange(stop)
    idx = torch.tensor([pages[t // P] for t in range(stop)], dtype=torch.long)
    return torch.cat([blocks[idx, :, :, pos % P].float() for blocks in mgr.pool.blocks], dim=3)


def snapshot(mgr):
    """Everything allocate/commit/release may change, in comparable form."""
    t, prefix, host = mgr._table, mgr.prefix_cache, mgr.host_swap
    return (
        dict(mgr._slot_of), t.lookup_table.tolist(), t.cache_len.tolist(), t.num_pages.tolist(),
        t.pending.tolist(), t.num_committed.tolist(), t.tail.tolist(), t.tail_len.tolist(), list(t.free_slots),
        [list(h) for h in t.hashes], list(mgr.pool.ref_cnt), list(mgr.pool.free_queue),
        None if prefix is None else (dict(prefix.hash_to_page), list(prefix.page_hash)),
        None if host is None else list(host.hash_to_page.items()),
        [b.view(torch.uint8).sum().item() for b in mgr.pool.blocks], mgr.metrics,
    )


def check_inputs(mgr, inputs, rids, cache_before, chunks):
    """The step's metadata is what MAX specifies and what the metadata helpers compute."""
    n = mgr.pool.total_num_pages
    run, skipped = inputs.new_token_counts, inputs.skipped_tokens
    assert inputs.request_ids == tuple(rids)
    for coll, offsets in zip(inputs.collections, inputs.input_row_offsets):
        lengths = coll.cache_lengths.tolist()
        assert coll.num_pages == coll.sentinel == n
        assert torch.equal(coll.lookup_table, inputs.collections[0].lookup_table)
        assert lengths == [c + s for c, s in zip(cache_before, skipped)]
        assert [r + s for r, s in zip(run, skipped)] == list(chunks)
        assert all(s % P == 0 for s in skipped) and all(r >= 1 for r in run)
        rows = [mgr.get_req_blocks(rid) for rid in rids]
        assert coll.lookup_table.shape[1] == padded_lut_cols(max(map(len, rows), default=0))
        for row, lut_row in zip(rows, coll.lookup_table.tolist()):
            assert lut_row == row + [n] * (len(lut_row) - len(row))
        coll.check_metadata()
        coll.check_writable("step", torch.tensor(run))
        assert torch.equal(offsets, input_row_offsets(run))
        assert (coll.max_seq_length, coll.max_cache_length) == max_lengths(lengths, run)


def run_prompt(mgr, rid, tokens):
    """Claim, allocate, write the K/V, commit; returns the step inputs."""
    mgr.claim(rid)
    inputs = mgr.allocate([rid], token_ids=[tokens])
    write_step(mgr, inputs, [expected_kv(tokens, mgr.params)])
    mgr.commit()
    return inputs


# -- lifecycle and lookup tables -----------------------------------------------------------------------


def test_step_metadata_growth_and_release():
    mgr = PagedKVCacheManager(make_params(), 16)
    mgr.claim("a")
    mgr.claim("b")
    inputs = mgr.allocate(["a", "b"], [5, 9])
    check_inputs(mgr, inputs, ["a", "b"], [0, 0], [5, 9])
    assert inputs.collections[0].blocks.shape[0] == 16 and mgr.pool.blocks[0].shape[0] == 17
    mgr.commit()
    assert (mgr.cache_length("a"), mgr.cache_length("b")) == (5, 9)
    for _ in range(4):  # decode: "a" fills page 2 and starts page 3
        before = [mgr.cache_length("a"), mgr.cache_length("b")]
        check_inputs(mgr, mgr.allocate(["a", "b"], [1, 1]), ["a", "b"], before, [1, 1])
        mgr.commit()
    assert len(mgr.get_req_blocks("a")) == 3 and len(mgr.get_req_blocks("b")) == 4
    assert mgr.metrics.used_pages == 7
    mgr.release("a")
    mgr.release("b")
    assert mgr.num_free_blocks == 16 and "a" not in mgr
    mgr.check_invariants()


def test_null_page_is_in_bounds_and_zero():
    mgr = PagedKVCacheManager(make_params(), 3)
    mgr.claim("a")
    coll = mgr.allocate(["a"], [1]).collections[0]
    sentinel = coll.lookup_table[0, 1].item()
    assert sentinel == coll.sentinel == 3 < mgr.pool.blocks[0].shape[0]
    assert not mgr.pool.blocks[0][sentinel].any()


def test_lookup_table_rows_grow_past_initial_width():
    mgr = PagedKVCacheManager(make_params(), 64)
    mgr.claim("a")
    inputs = mgr.allocate(["a"], [40 * P])
    check_inputs(mgr, inputs, ["a"], [0], [40 * P])
    assert inputs.collections[0].lookup_table.shape[1] == padded_lut_cols(40)


def test_token_id_forms_agree():
    tokens = np.arange(6 * P).reshape(2, 3 * P) % 5
    results = []
    for form in (tokens, torch.from_numpy(tokens), tokens.tolist(), [torch.from_numpy(r) for r in tokens]):
        mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16)
        mgr.claim(0)
        mgr.claim(1)
        mgr.allocate([0, 1], token_ids=form)
        mgr.commit()
        results.append(snapshot(mgr)[:10])
    assert all(r == results[0] for r in results)


def test_step_inputs_drive_store_kv():
    """End to end with an op: the engine hands StepInputs to store_kv, which checks and writes them."""
    params = make_params(enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, 16)
    prompt = list(range(2 * P + 3))
    run_prompt(mgr, "a", prompt)
    mgr.claim("b")
    mgr.claim("c")
    inputs = mgr.allocate(["b", "c"], token_ids=[prompt, [9] * 5])
    assert inputs.skipped_tokens == (2 * P, 0)
    values = [expected_kv(prompt, params), expected_kv([9] * 5, params)]
    coll, offsets = inputs.collections[0], inputs.input_row_offsets[0]
    rows = [v[c:c + n] for v, c, n in zip(values, coll.cache_lengths.tolist(), inputs.new_token_counts)]
    for layer in range(params.num_layers):
        k, v = (torch.cat([r[:, kv, layer] for r in rows]) for kv in (0, 1))
        store_kv(k, v, offsets, coll, layer)
    mgr.commit()
    assert torch.equal(read_kv(mgr, "b", len(prompt)), values[0])
    assert torch.equal(read_kv(mgr, "c", 5), values[1])


# -- errors leave the state unchanged ------------------------------------------------------------------


def test_insufficient_pages_is_atomic():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 6)
    run_prompt(mgr, "a", list(range(3 * P)))
    mgr.claim("b")
    mgr.claim("c")
    before = snapshot(mgr)
    with pytest.raises(InsufficientBlocksError, match="needs 4 new pages but 3 are free.*no request was changed"):
        mgr.allocate(["b", "c"], token_ids=[[9] * P, [8] * (3 * P)])
    assert snapshot(mgr) == before
    mgr.release("a")
    mgr.allocate(["b", "c"], token_ids=[[9] * P, [8] * (3 * P)])
    mgr.check_invariants()
    mgr.claim("d")
    with pytest.raises(InsufficientBlocksError, match="request 'd' alone needs 7 pages and can never fit"):
        mgr.allocate(["d"], token_ids=[[1] * (7 * P)])


def test_insufficient_pages_counts_idle_prefix_hits_as_taken():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 4)
    prompt = list(range(2 * P + 1))
    run_prompt(mgr, "a", prompt)
    mgr.release("a")  # 4 free pages, 2 of them cached
    mgr.claim("b")
    before = snapshot(mgr)
    # 2 hits + 3 fresh pages: the hits leave the free queue, so only 2 remain for the 3.
    with pytest.raises(InsufficientBlocksError, match="needs 3 new pages but 2 are free"):
        mgr.allocate(["b"], token_ids=[prompt[:2 * P] + [5] * (3 * P)])
    assert snapshot(mgr) == before


BAD_CALLS = [
    ("release unknown", lambda m: m.release("zz"), ValueError, "request_id 'zz' is not claimed"),
    ("double release", lambda m: m.release("d"), ValueError, "request_id 'd' is not claimed"),
    ("double claim", lambda m: m.claim("a"), ValueError, "already claimed"),
    ("unknown in batch", lambda m: m.allocate(["a", "zz"], [1, 1]), ValueError, r"request_ids\[1\]: 'zz'"),
    ("negative count", lambda m: m.allocate(["a", "b"], [1, -2]), ValueError, r"new_token_counts\[1\] must be >= 0"),
    ("float count", lambda m: m.allocate(["a"], [1.5]), ValueError, "new_token_counts must hold 1 ints"),
    ("count length", lambda m: m.allocate(["a", "b"], [1]), ValueError, "new_token_counts must hold 2 ints"),
    ("duplicate request", lambda m: m.allocate(["a", "a"], [1, 1]), ValueError, "more than once"),
    ("uncommitted step", lambda m: m.allocate(["c"], [1]), ValueError, "'c' has an uncommitted step"),
    ("nothing to commit", lambda m: m.commit(["a"]), ValueError, "no allocated step"),
    ("counts vs ids", lambda m: m.allocate(["a"], [2], token_ids=[[1]]), ValueError, "disagrees"),
    ("ids length", lambda m: m.allocate(["a", "b"], token_ids=[[1]]), ValueError, "1 entries for 2"),
    ("ids 3-D", lambda m: m.allocate(["a"], token_ids=np.zeros((1, 1, 1), int)), ValueError, r"\[1, n\] array"),
    ("no counts", lambda m: m.allocate(["a"]), ValueError, "pass new_token_counts or token_ids"),
]


@pytest.mark.parametrize("call, error, message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(call, error, message):
    mgr = PagedKVCacheManager(make_params(), 8)
    for rid in "abcd":
        run_prompt(mgr, rid, [1, 2, 3, 4, 5])
    mgr.allocate(["c"], token_ids=[[6]])  # "c" has a step pending
    mgr.release("d")
    before = snapshot(mgr)
    with pytest.raises(error, match=message):
        call(mgr)
    assert snapshot(mgr) == before


def test_prefix_caching_needs_token_ids():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 8)
    mgr.claim("a")
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="token_ids is required with enable_prefix_caching"):
        mgr.allocate(["a"], [3])
    assert snapshot(mgr) == before


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="total_num_pages must be a positive int"):
        PagedKVCacheManager(make_params(), 0)
    with pytest.raises(ValueError, match="hash_algorithm must be one of"):
        PagedKVCacheManager(make_params(), 4, hash_algorithm="md5")
    with pytest.raises(ValueError, match="devices must list one device per tensor-parallel shard"):
        PagedKVCacheManager(make_params(n_kv_heads=4, n_devices=2), 4, devices=["cpu"] * 3)
    with pytest.raises(TypeError, match="params must be a KVCacheParams"):
        PagedKVCacheManager({"page_size": 4}, 4)


# -- prefix caching ------------------------------------------------------------------------------------


@pytest.mark.parametrize("hash_algorithm", ["builtin", "sha256_64"])
def test_prefix_hit_skips_pages_and_reads_cold_bytes(hash_algorithm):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # 2 full pages + 2 tokens
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16, hash_algorithm=hash_algorithm)
    run_prompt(mgr, "a", prompt)
    inputs = run_prompt(mgr, "b", prompt + [7])
    assert inputs.skipped_tokens == (2 * P,) and inputs.new_token_counts == (3,)
    assert inputs.collections[0].cache_lengths.tolist() == [2 * P]
    assert mgr.get_req_blocks("b")[:2] == mgr.get_req_blocks("a")[:2]
    assert [mgr.pool.ref_cnt[p] for p in mgr.get_req_blocks("a")] == [2, 2, 1]
    cold = PagedKVCacheManager(make_params(), 16)
    run_prompt(cold, "b", prompt + [7])
    hit_coll = mgr.allocate(["b"], token_ids=[[0]]).collections[0]
    cold_coll = cold.allocate(["b"], [1]).collections[0]
    for layer in range(2):
        for get in ("get_key_cache", "get_value_cache"):
            hit_kv = getattr(hit_coll, get)(layer).gather(0, 0, len(prompt) + 1)
            cold_kv = getattr(cold_coll, get)(layer).gather(0, 0, len(prompt) + 1)
            assert torch.equal(hit_kv, cold_kv)
    assert mgr.metrics.cache_hit_tokens == 2 * P
    mgr.check_invariants()


def test_hit_never_covers_the_last_token():
    prompt = list(range(2 * P))
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16)
    run_prompt(mgr, "a", prompt)
    assert run_prompt(mgr, "b", prompt).skipped_tokens == (P,)  # page 2 holds the last token: it runs


def test_hashes_chain_over_the_whole_prefix():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16)
    run_prompt(mgr, "a", [1] * P + [2] * P + [0])
    run_prompt(mgr, "b", [3] * P)
    # "b"'s next step starts with the same page as "a"'s second one, after a different first page.
    assert mgr.allocate(["b"], token_ids=[[2] * P + [0]]).skipped_tokens == (0,)


def test_pages_filled_over_many_steps_are_cached():
    prompt = [5, 3, 5, 8, 9, 7, 9, 3, 2]
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16)
    mgr.claim("a")
    for i in range(len(prompt)):  # decode-like: one token per step
        mgr.allocate(["a"], token_ids=[prompt[i:i + 1]])
        mgr.commit()
    assert run_prompt(mgr, "b", prompt).skipped_tokens == (2 * P,)
    assert mgr.get_req_blocks("b")[:2] == mgr.get_req_blocks("a")[:2]


def test_commit_merges_duplicate_pages():
    prompt = list(range(2 * P + 1))
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 16)
    mgr.claim("a")
    mgr.claim("b")
    inputs = mgr.allocate(["a", "b"], token_ids=[prompt, prompt])  # neither is cached yet: no hit
    assert inputs.skipped_tokens == (0, 0)
    write_step(mgr, inputs, [expected_kv(prompt, mgr.params)] * 2)
    b_own = mgr.get_req_blocks("b")
    mgr.commit()
    a, b = mgr.get_req_blocks("a"), mgr.get_req_blocks("b")
    assert b[:2] == a[:2] and b[2] == b_own[2] and b_own[0] in mgr.pool.free_queue
    assert mgr.metrics.used_pages == 4 and mgr.metrics.cached_pages == 2
    assert torch.equal(read_kv(mgr, "b", len(prompt)), expected_kv(prompt, mgr.params))
    mgr.check_invariants()


def test_lru_eviction_and_tail_first_release():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 4)
    prompt = list(range(3 * P + 1))
    run_prompt(mgr, "a", prompt)
    pages = mgr.get_req_blocks("a")
    mgr.release("a")
    assert list(mgr.pool.free_queue) == pages[::-1]  # freed tail first
    assert mgr.metrics.cached_pages == 3  # still reusable while free
    run_prompt(mgr, "x", [9] * (P - 1))  # pops the queue head: the uncached last page
    assert mgr.get_req_blocks("x") == pages[3:] and mgr.metrics.cached_pages == 3
    run_prompt(mgr, "y", [8] * (P - 1))  # pops the chain's last page: evicted
    assert mgr.get_req_blocks("y") == pages[2:3] and mgr.metrics.cached_pages == 2
    mgr.release("x")
    mgr.release("y")
    assert run_prompt(mgr, "b", prompt).skipped_tokens == (2 * P,)


def test_reset_prefix_cache_keeps_held_pages():
    mgr = PagedKVCacheManager(make_params(enable_prefix_caching=True), 8)
    run_prompt(mgr, "a", list(range(P + 1)))
    run_prompt(mgr, "b", [7] * (P + 1))
    mgr.release("b")
    mgr.reset_prefix_cache()
    assert mgr.metrics.cached_pages == 1
    mgr.check_invariants()
    assert run_prompt(mgr, "c", [7] * (P + 1)).skipped_tokens == (0,)


# -- host swap -----------------------------------------------------------------------------------------


def test_host_swap_round_trip_is_byte_exact():
    """Evicted pages go to host swap space and come back bit for bit (fp8 data and their scales)."""
    params = swap_params(8, dtype=torch.float8_e4m3fn, head_dim=4,
                         kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=2))
    mgr = PagedKVCacheManager(params, 4)
    gen = torch.Generator().manual_seed(1)
    prompt = list(range(2 * P + 1))
    mgr.claim("a")
    mgr.allocate(["a"], token_ids=[prompt])
    mgr.commit()
    pages = mgr.get_req_blocks("a")
    blocks, scales = mgr.pool.blocks[0], mgr.pool.scales[0]
    raw = blocks.view(torch.uint8)  # fp8 has no CPU indexing kernels; its bytes do
    raw[pages] = torch.randint(0, 256, raw[pages].shape, dtype=torch.uint8, generator=gen)
    scales[pages] = torch.rand(scales[pages].shape, generator=gen)
    want = raw[pages[:2]].clone(), scales[pages[:2]].clone()
    mgr.release("a")
    run_prompt(mgr, "evict", [5] * (4 * P - 1))  # takes every page: the cached two go to the host
    assert mgr.metrics.host_cached_pages == 2
    mgr.release("evict")
    run_prompt(mgr, "churn", [6] * (4 * P - 1))  # overwrites the device pages again
    mgr.release("churn")
    inputs = run_prompt(mgr, "b", prompt)
    assert inputs.skipped_tokens == (2 * P,)
    back = mgr.get_req_blocks("b")[:2]
    assert torch.equal(raw[back], want[0]) and torch.equal(scales[back], want[1])
    assert mgr.metrics.host_hit_tokens == 2 * P
    mgr.check_invariants()


def test_host_hit_shared_by_two_requests_of_one_step_loads_once():
    mgr = PagedKVCacheManager(swap_params(4), 6)
    prompt = list(range(2 * P + 1))
    run_prompt(mgr, "a", prompt)
    mgr.release("a")
    run_prompt(mgr, "x", [9] * (6 * P - 1))  # evicts "a"'s cached pages to the host
    mgr.release("x")
    mgr.claim("b")
    mgr.claim("c")
    inputs = mgr.allocate(["b", "c"], token_ids=[prompt, prompt])
    assert inputs.skipped_tokens == (2 * P, 2 * P) and mgr.metrics.host_hit_tokens == 2 * P
    write_step(mgr, inputs, [expected_kv(prompt, mgr.params)] * 2)
    mgr.commit()
    b, c = mgr.get_req_blocks("b"), mgr.get_req_blocks("c")
    assert b[:2] == c[:2] and b[2] != c[2] and mgr.metrics.used_pages == 4
    for rid in "bc":
        assert torch.equal(read_kv(mgr, rid, len(prompt)), expected_kv(prompt, mgr.params))
    mgr.check_invariants()


def test_host_swap_smaller_than_one_eviction_batch():
    mgr = PagedKVCacheManager(swap_params(1), 3)
    prompt = list(range(2 * P + 1))
    run_prompt(mgr, "a", prompt)
    mgr.release("a")
    run_prompt(mgr, "x", [5] * (3 * P - 1))  # evicts both cached pages in one step: the host keeps the last
    mgr.release("x")
    inputs = run_prompt(mgr, "b", prompt)
    assert inputs.skipped_tokens == (P,) and mgr.metrics.host_hit_tokens == P
    assert torch.equal(read_kv(mgr, "b", len(prompt)), expected_kv(prompt, mgr.params))


def test_host_swap_replaces_least_recently_used():
    mgr = PagedKVCacheManager(swap_params(2), 2)
    for i, rid in enumerate("abc"):  # each caches one page, evicting the previous one to the host
        run_prompt(mgr, rid, [i] * P + [9])
        mgr.release(rid)
    hashes = list(mgr.host_swap.hash_to_page)
    run_prompt(mgr, "d", [3] * (2 * P - 1))  # evicts "c"'s page: host replaces "a"'s (the oldest)
    assert list(mgr.host_swap.hash_to_page)[:1] == hashes[1:2] and len(mgr.host_swap) == 2
    mgr.release("d")
    assert run_prompt(mgr, "a2", [0] * P + [9]).skipped_tokens == (0,)
    mgr.release("a2")
    assert run_prompt(mgr, "c2", [2] * P + [9]).skipped_tokens == (P,)


# -- devices, stages, metrics --------------------------------------------------------------------------


def test_tensor_parallel_head_split_on_cpu_devices():
    params = make_params(n_kv_heads=4, n_devices=2, enable_prefix_caching=True)
    mgr = PagedKVCacheManager(params, 8, devices=["cpu", "cpu"])
    assert [b.shape[4] for b in mgr.pool.blocks] == [2, 2]
    assert mgr.pool.blocks[0].data_ptr() != mgr.pool.blocks[1].data_ptr()
    prompt = list(range(2 * P + 1))
    inputs = run_prompt(mgr, "a", prompt)
    assert all(torch.equal(c.lookup_table, inputs.collections[0].lookup_table) for c in inputs.collections)
    assert all(c.num_heads == 2 for c in inputs.collections)
    want = expected_kv(prompt, params)
    assert torch.equal(read_kv(mgr, "a", len(prompt)), want)  # shard d holds heads [2d, 2d+2)
    assert run_prompt(mgr, "b", prompt).skipped_tokens == (2 * P,)
    assert torch.equal(read_kv(mgr, "b", len(prompt)), want)
    # One manager per rank (torch.distributed): same calls, same page ids, only this rank's heads.
    rank1 = PagedKVCacheManager(params, 8, devices=["cpu"])
    rank1.claim("a")
    rank1_coll = rank1.allocate(["a"], token_ids=[prompt]).collections[0]
    assert rank1_coll.num_heads == 2
    assert torch.equal(rank1_coll.lookup_table, inputs.collections[0].lookup_table)


def test_pipeline_stages_own_their_layers():
    base = make_params(total_num_layers=5, pipeline_parallel_degree=2, stage_id=0)
    stages = [PagedKVCacheManager(base.for_stage(s), 8) for s in range(2)]
    assert [m.layer_range for m in stages] == [(0, 3), (3, 5)]
    assert [m.pool.blocks[0].shape[2] for m in stages] == [3, 2]
    luts = []
    for m in stages:
        m.claim("a")
        luts.append(m.allocate(["a"], [6]).collections[0].lookup_table)
    assert torch.equal(*luts)


def test_metrics_and_repr():
    mgr = PagedKVCacheManager(swap_params(3), 10)
    run_prompt(mgr, "a", list(range(2 * P + 1)))
    run_prompt(mgr, "b", list(range(2 * P + 1)))
    m = mgr.metrics
    assert (m.total_pages, m.used_pages, m.free_pages, m.cached_pages, m.num_requests) == (10, 4, 6, 2, 2)
    assert (m.input_tokens, m.cache_hit_tokens, m.host_pages) == (18, 8, 3)
    assert m.hit_rate == pytest.approx(8 / 18)
    assert m.used_bytes == 4 * mgr.params.bytes_per_block
    text = repr(mgr)
    for part in ("pages 4/10 used", "6 free, 2 cached", "2 requests", "prefix hits 44.4% (8/18 tokens)",
                 "host 0/3 pages", "page_size=4", "1 device(s) x 2 heads", "layers [0, 2)", "f32"):
        assert part in text, (part, text)


# -- state machine -------------------------------------------------------------------------------------

# Few shared prefixes, a tiny vocabulary and a small pool: requests hit, duplicate and evict each other's pages.
PREFIXES = [[7] * 6, [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9]]


class ManagerMachine(RuleBasedStateMachine):
    params = make_params()
    total_num_pages = 8
    devices = None

    def __init__(self):
        super().__init__()
        self.mgr = PagedKVCacheManager(self.params, self.total_num_pages, self.devices)
        self.tokens, self.values, self.known, self.pending = {}, {}, {}, set()
        self.next_rid = 0

    def ready(self):
        return [r for r in self.tokens if r not in self.pending and self.known[r] < len(self.tokens[r])]

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 1), min_size=1, max_size=6))
    def claim(self, prefix, suffix):
        self.new_request(prefix + suffix)

    def new_request(self, tokens):
        rid = self.next_rid = self.next_rid + 1
        self.mgr.claim(rid)
        self.tokens[rid], self.values[rid], self.known[rid] = tokens, expected_kv(tokens, self.params), 0
        return rid

    @precondition(lambda self: self.ready())
    @rule(data=st.data(), num_steps=st.sampled_from([1, 1, 2, 3]))
    def allocate(self, data, num_steps):
        rids = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=3, unique=True))
        left = [len(self.tokens[r]) - self.known[r] for r in rids]
        chunks = [data.draw(st.one_of(st.just(n), st.integers(1, n))) for n in left]  # often the whole rest
        if self.step(rids, chunks, num_steps) and data.draw(st.booleans()):
            self.commit()

    def idle(self):
        return sorted(r for r in self.tokens if r not in self.pending)

    @precondition(lambda self: self.idle() and len(self.tokens) < 5)
    @rule(data=st.data(), suffix=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def fork(self, data, suffix):
        """A child sharing the parent's cached tokens, then going its own way."""
        parent = data.draw(st.sampled_from(self.idle()))
        child = self.next_rid = self.next_rid + 1
        before = snapshot(self.mgr)
        try:
            self.mgr.fork(parent, child)
        except InsufficientBlocksError:
            assert snapshot(self.mgr) == before
            return
        tokens = self.tokens[parent][:self.known[parent]] + suffix
        self.tokens[child], self.values[child], self.known[child] = (tokens, expected_kv(tokens, self.params),
                                                                     self.known[parent])
        assert self.mgr.get_req_blocks(child)[:self.known[parent] // P] == \
            self.mgr.get_req_blocks(parent)[:self.known[parent] // P]

    @precondition(lambda self: any(self.known[r] for r in self.idle()))
    @rule(data=st.data(), replacement=st.lists(st.integers(0, 1), max_size=3))
    def rollback(self, data, replacement):
        """Speculative decoding: drop the last n tokens; the request then continues with other ids."""
        rid = data.draw(st.sampled_from([r for r in self.idle() if self.known[r]]))
        n = data.draw(st.integers(0, self.known[rid]))
        before = snapshot(self.mgr)
        try:
            self.mgr.rollback(rid, n)
        except InsufficientBlocksError:
            assert snapshot(self.mgr) == before
            return
        self.known[rid] -= n
        tokens = self.tokens[rid][:self.known[rid]] + replacement
        self.tokens[rid], self.values[rid] = tokens, expected_kv(tokens, self.params)
        assert self.mgr.cache_length(rid) == self.known[rid]

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def serve(self, prefix, suffix):
        """A whole short request at once: its pages get cached, then freed (cached until evicted)."""
        rid = self.new_request(prefix + suffix)
        if self.step([rid], [len(self.tokens[rid])]):
            self.mgr.commit([rid])
            self.pending.discard(rid)
            self.bookkeeping_and_bytes()
        self.forget(rid)

    def step(self, rids, chunks, num_steps=1) -> bool:
        """Allocate and write one step (like the model); False if the pool was too small."""
        ids = [self.tokens[r][self.known[r]:self.known[r] + n] for r, n in zip(rids, chunks)]
        before = snapshot(self.mgr)
        fits = self.mgr.can_allocate(rids, chunks, token_ids=ids, num_steps=num_steps)
        assert snapshot(self.mgr) == before
        try:
            inputs = self.mgr.allocate(rids, chunks, token_ids=ids, num_steps=num_steps)
        except InsufficientBlocksError:
            assert not fits and snapshot(self.mgr) == before
            return False
        assert fits
        check_inputs(self.mgr, inputs, rids, [self.known[r] for r in rids], chunks)
        write_step(self.mgr, inputs, [self.values[r] for r in rids])
        for r, n in zip(rids, chunks):
            self.known[r] += n
            self.pending.add(r)
        return True

    @rule()
    def commit(self):
        self.mgr.commit()
        self.pending.clear()

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def commit_some(self, data):
        rids = data.draw(st.lists(st.sampled_from(sorted(self.pending)), min_size=1, unique=True))
        self.mgr.commit(rids)
        self.pending -= set(rids)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        self.forget(data.draw(st.sampled_from(sorted(self.tokens))))

    def forget(self, rid):
        self.mgr.release(rid, discard_step=rid in self.pending)
        for d in (self.tokens, self.values, self.known):
            del d[rid]
        self.pending.discard(rid)

    @rule(data=st.data())
    def bad_input(self, data):
        live = sorted(self.tokens)
        call = data.draw(st.sampled_from([
            lambda: self.mgr.release(-1),
            lambda: self.mgr.allocate([-1], [1]),
            lambda: self.mgr.allocate(live[:1] * 2, [1, 1]),
            lambda: self.mgr.allocate(live[:1], [-1]),
            lambda: self.mgr.allocate(sorted(self.pending)[:1] or [-1], [1]),
            lambda: self.mgr.claim(live[0] if live else -1) if live else self.mgr.release(-1),
            lambda: self.mgr.release(sorted(self.pending)[0] if self.pending else -1),
            lambda: self.mgr.rollback(sorted(self.pending)[0] if self.pending else -1, 0),
            lambda: self.mgr.rollback(live[0] if live else -1, (self.known[live[0]] if live else 0) + 1),
            lambda: self.mgr.fork(live[0] if live else -1, live[-1] if live else -2),
            lambda: self.mgr.allocate(live[:1] or [-1], [1], num_steps=0),
        ]))
        before = snapshot(self.mgr)
        with pytest.raises(ValueError):
            call()
        assert snapshot(self.mgr) == before

    @invariant()
    def bookkeeping_and_bytes(self):
        self.mgr.check_invariants()
        t, cached = self.mgr._table, self.mgr.prefix_cache is not None
        for rid, known in self.known.items():
            assert self.mgr.cache_length(rid) <= known
            assert torch.equal(read_kv(self.mgr, rid, known), self.values[rid][:known])
            if cached:  # the page hashes and tail are exactly those of the request's tokens so far
                s, full = self.mgr._slot_of[rid], known // P
                tokens = self.tokens[rid]
                pages = [tokens[j * P:(j + 1) * P] for j in range(full)]
                assert t.hashes[s] == hash_pages(ROOT_HASH, pages, self.mgr.hash_algorithm)
                assert t.tail[s, :t.tail_len[s]].tolist() == tokens[full * P:known]

    def teardown(self):
        for rid in list(self.tokens):
            self.mgr.release(rid, discard_step=rid in self.pending)
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == self.total_num_pages


class PrefixMachine(ManagerMachine):
    params = make_params(enable_prefix_caching=True)


class SwapMachine(ManagerMachine):
    """Prefix caching, host swap, and two tensor-parallel CPU shards."""

    params = swap_params(6, n_kv_heads=4, n_devices=2)
    total_num_pages = 5
    devices = ["cpu", "cpu"]


_machine_settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = _machine_settings
TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = _machine_settings
TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = _machine_settings
