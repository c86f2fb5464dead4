"""``PagedKVCacheManager``: owns the pages, builds each step's lookup table, reuses prefixes (as MAX does).

Per request, per step::

    mgr.claim(rid, prefix_keys=...)                  # once; PrefixKeys: LoRA id, tenant salt, multimodal
    hit = mgr.lookup_prefix(rid, prompt_ids)         # optional: cached leading tokens, to size a prefill chunk
    if mgr.can_allocate([rid, ...], token_ids=...):  # optional: no side effects
        inputs = mgr.allocate([rid, ...], token_ids=...)  # a [B, n] tensor/array, or one sequence per request
    # run the model on the last inputs.new_token_counts[b] of request b's new ids (the first
    # inputs.skipped_tokens[b] were prefix-cache hits); kernels write K/V through inputs.collections[d]
    mgr.commit()                                     # the K/V is written: count it, cache the full pages
    mgr.rollback(rid, n)                             # speculative decoding: drop n rejected tokens
    mgr.fork(rid, child)                             # parallel sampling / beam search: share the pages
    mgr.release(rid)                                 # when the request finishes

``allocate`` is atomic: on bad input (``ValueError``/``TypeError``) or too few free pages
(``InsufficientBlocksError``) no request and no page changed; so are ``fork`` and ``rollback``.
``allocate(..., num_steps=k)`` also reserves the pages of ``k - 1`` more one-token steps (MAX's multistep
decoding), which later ``allocate`` calls then use without touching the free queue.

Page ``total_num_pages`` is the null page: unused lookup entries hold it, and the returned collections view
``blocks[:total_num_pages]``, so it reads as the sentinel while every lookup entry stays inside the allocation.

Step generations: every ``allocate`` returns a new ``StepInputs.step_id``, and its collections are refused
by the ops (``ValueError``) once a request of that step is committed or released: by then its pages may be
shared, freed or owned by another request. ``release`` of a request whose step is not committed is an error
unless ``discard_step=True``. ``allocate(..., graph_buffers=b)`` instead fills the persistent buffers of a
``GraphStepBuffers`` (CUDA graphs) and returns their collections, valid for every step.

Devices. Page bookkeeping does not depend on heads, so one manager drives every tensor-parallel shard:
``devices[d]`` stores heads ``[d*H, (d+1)*H)`` (``H = n_kv_heads_per_device``) of every page, and all shards
get the same ``lookup_table`` / ``cache_lengths``. Under ``torch.distributed`` (one process per GPU) give each
rank ``devices=[its device]`` and make the same calls in the same order on every rank: the manager is
deterministic (every page hash ignores ``PYTHONHASHSEED``), so page ids agree without communication;
only the scheduler's decisions (request ids, token ids) need broadcasting. A pipeline stage builds its manager
from ``params.for_stage(stage_id)``: its pages hold the layers ``layer_range``, and its metadata equals the
other stages' when they are driven alike.
"""

from __future__ import annotations

import dataclasses
import functools
from itertools import chain
from typing import Hashable, Optional, Sequence

import numpy as np
import torch

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.manager.block_pool import BlockPool, InsufficientBlocksError
from cute_kv.manager.graph_buffers import GraphStepBuffers
from cute_kv.manager.host_swap import HostSwapPool
from cute_kv.manager.metrics import KVCacheMetrics
from cute_kv.manager.prefix_cache import (DEFAULT_HASH_ALGORITHM, HASH_ALGORITHMS, PrefixCache, PrefixKeys,
                                          hash_pages, multimodal_spans, page_extra_keys, root_hash)
from cute_kv.manager.slot_table import NO_STEP, SlotTable, ragged_columns
from cute_kv.metadata import last_row_indices, padded_lut_cols
from cute_kv.reference.ragged import positions
from cute_kv.step_plan import StepPlan, plan_step
from cute_kv.params import KVCacheParams, KVCacheStrategy


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """One step's kernel inputs; entry ``d`` of ``collections`` / ``input_row_offsets`` is on ``devices[d]``."""

    request_ids: tuple
    collections: tuple[PagedKVCacheCollection, ...]
    input_row_offsets: tuple[torch.Tensor, ...]  # uint32 [B+1] over new_token_counts
    new_token_counts: tuple[int, ...]  # tokens each request runs this step, prefix hits removed
    skipped_tokens: tuple[int, ...]  # leading tokens of the step served by the prefix cache
    step_id: int = NO_STEP  # this allocate() call; its collections are refused once the step is committed
    graph_buffers: Optional[GraphStepBuffers] = None  # set when the step filled them

    @functools.cached_property
    def positions(self) -> tuple[torch.Tensor, ...]:
        """int64 ``[T]`` per device: the position ``cache_lengths[b] + i`` of every row (for RoPE)."""
        if self.graph_buffers is not None:
            return self.graph_buffers.positions
        return tuple(positions(ro, c.cache_lengths) for ro, c in zip(self.input_row_offsets, self.collections))

    def plan(self, device_index: int = 0, *, num_q_heads: Optional[int] = None) -> StepPlan:
        """``cute_kv.plan_step`` of this step on ``devices[device_index]``, reading nothing: the manager built these
        metadata on the host and they hold by construction (as its collections skip their scan)."""
        return plan_step(self.collections[device_index], self.input_row_offsets[device_index],
                         num_q_heads=num_q_heads, num_tokens=sum(self.new_token_counts), validate=False)

    @functools.cached_property
    def last_row_indices(self) -> tuple[torch.Tensor, ...]:
        """int64 ``[B]`` per device: each request's last row this step (its logits), -1 if it runs none."""
        if self.graph_buffers is not None:
            return self.graph_buffers.last_row_indices
        return tuple(last_row_indices(ro) for ro in self.input_row_offsets)


@dataclasses.dataclass
class _PageHashes:
    """A step's token ids seen per page (prefix caching). Per request of the batch: ``tail_len`` ids past
    its last hashed page before the step and ``full`` pages the step completes; per request in
    ``batch_index`` (those with ``full > 0``): the new pages' hashes and their prefix-cache matches
    ``(hash, device page | None for host swap space)``."""

    tail_len: np.ndarray
    full: np.ndarray
    batch_index: np.ndarray
    hashes: list[list[int]]
    matched: list[list[tuple[int, Optional[int]]]]
    ids: list[np.ndarray]  # per request in batch_index: [full, page_size] token ids of its new pages


class PagedKVCacheManager:
    def __init__(self, params: KVCacheParams, total_num_pages: int, devices: Optional[Sequence] = None, *,
                 hash_algorithm: str = DEFAULT_HASH_ALGORITHM):
        """Allocate ``total_num_pages`` pages (plus the null page) on each device; ``devices`` defaults to
        ``params.n_devices`` CPU devices. Host swap space is ``params.total_num_host_pages()`` pages.
        ``hash_algorithm`` names the prefix-cache page hash (``prefix_cache`` module: ``"builtin"`` is faster
        and unsafe when tenants share the cache)."""
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a KVCacheParams, got {type(params).__name__}")
        if params.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(f"params.cache_strategy must be PAGED, got {params.cache_strategy.value}")
        if hash_algorithm not in HASH_ALGORITHMS:
            raise ValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS}, got {hash_algorithm!r}")
        devices = [torch.device(d) for d in (["cpu"] * params.n_devices if devices is None else devices)]
        if len(devices) not in (1, params.n_devices):
            raise ValueError(
                f"devices must list one device per tensor-parallel shard ({params.n_devices}), or only this "
                f"rank's device under torch.distributed; got {len(devices)}"
            )
        self.params = params
        self.devices = tuple(devices)
        self.page_size = params.page_size
        self.hash_algorithm = hash_algorithm
        self.pool = BlockPool(params, total_num_pages, devices)
        self.layer_range = params.stage_layer_range(params.stage_id or 0)
        self.prefix_cache = PrefixCache(total_num_pages) if params.enable_prefix_caching else None
        self.host_swap = (
            HostSwapPool(params, params.total_num_host_pages(), self.pool)
            if params.enable_kvcache_swapping_to_host else None
        )
        n = total_num_pages
        granularity = params.kvcache_quant_config.quantization_granularity if params.quantized_kv_cache else None
        # Each step's collections derive from these through with_metadata; the blocks are checked once here.
        self._collections = [
            PagedKVCacheCollection(
                blocks[:n], torch.zeros(0, dtype=torch.uint32, device=blocks.device),
                torch.zeros(0, padded_lut_cols(0), dtype=torch.uint32, device=blocks.device), 0, 0,
                None if scales is None else scales[:n], quantization_granularity=granularity,
                rope_dim=params.rope_dim,
            )
            for blocks, scales in zip(self.pool.blocks, self.pool.scales)
        ]
        self._slot_of: dict[Hashable, int] = {}
        self._table = SlotTable(self.pool.null_page, n, self.page_size)
        self._input_tokens = self._hit_tokens = self._host_hit_tokens = 0
        self._last_step_id = 0
        self._live_steps: set[int] = set()  # steps allocated, none of whose requests was committed or released

    # -- request lifecycle ------------------------------------------------------------------------

    def claim(self, request_id: Hashable, *, prefix_keys: Optional[PrefixKeys] = None) -> None:
        """Start tracking ``request_id`` (no pages yet). ``prefix_keys``: what besides its token ids its
        K/V depends on (LoRA adapter, tenant salt, multimodal inputs); it only shares pages with requests
        of equal keys."""
        if request_id in self._slot_of:
            raise ValueError(f"request_id {request_id!r} is already claimed")
        if prefix_keys is not None and not isinstance(prefix_keys, PrefixKeys):
            raise TypeError(f"prefix_keys must be a PrefixKeys or None, got {type(prefix_keys).__name__}")
        slot = self._table.claim()
        self._slot_of[request_id] = slot
        self._table.root[slot] = root_hash(prefix_keys, self.hash_algorithm)
        self._table.spans[slot] = multimodal_spans(prefix_keys, self.hash_algorithm)

    def allocate(self, request_ids: Sequence[Hashable], new_token_counts: Optional[Sequence[int]] = None, *,
                 token_ids=None, num_steps: int = 1, graph_buffers=None) -> StepInputs:
        """Grow each request's pages for its next tokens and return the step's inputs.

        Request ``b`` brings ``new_token_counts[b]`` tokens, or the ids ``token_ids[b]`` (a ``[B, n]``
        tensor/array or ``B`` sequences; required with prefix caching). When its step starts on a page
        boundary, the longest run of cached pages (never covering its last token) is reused: those tokens are
        skipped (``skipped_tokens``) and ``cache_lengths`` includes them. Commit before the next ``allocate``
        of the same request. ``num_steps > 1`` also reserves pages for ``num_steps - 1`` more tokens per
        request. ``graph_buffers`` (a ``GraphStepBuffers`` of this manager): fill its persistent buffers in
        place and return its collections instead of new tensors.
        """
        plan = self._plan(request_ids, new_token_counts, token_ids, num_steps)
        request_ids, slots, counts, flat, offsets, owned, num_pages, fresh, hashed, touched = plan
        needed = int(fresh.sum())
        available = self.pool.num_free - len(touched)
        if needed > available:
            too_long = np.flatnonzero(num_pages > self.pool.total_num_pages)
            never = (f"; request {request_ids[too_long[0]]!r} alone needs {num_pages[too_long[0]]} pages and can "
                     f"never fit" if len(too_long) else "")
            raise InsufficientBlocksError(
                f"allocate: the step needs {needed} new pages but {available} are free "
                f"(total_num_pages={self.pool.total_num_pages}, {self.pool.num_free} in the free queue, "
                f"{len(touched)} of them prefix hits of this step){never}; no request was changed"
            )
        if graph_buffers is not None:
            if not isinstance(graph_buffers, GraphStepBuffers):
                raise TypeError(f"graph_buffers must be a GraphStepBuffers, got {type(graph_buffers).__name__}")
            skipped = sum(len(m) for m in hashed.matched) * self.page_size if hashed else 0
            context = self._table.cache_len[slots] + counts
            graph_buffers.check_fits(self, len(slots), int(counts.sum()) - skipped,
                                     int(num_pages.max()) if len(slots) else 0,
                                     int(context.max()) if len(slots) else 0)
        return self._apply(request_ids, slots, counts, flat, offsets, owned, num_pages, fresh, hashed,
                           graph_buffers)

    def can_allocate(self, request_ids: Sequence[Hashable], new_token_counts: Optional[Sequence[int]] = None, *,
                     token_ids=None, num_steps: int = 1) -> bool:
        """Whether ``allocate`` with these arguments would find enough free pages (counting the prefix hits it
        would take); changes nothing. Bad arguments raise as in ``allocate``."""
        plan = self._plan(request_ids, new_token_counts, token_ids, num_steps)
        fresh, touched = plan[7], plan[9]
        return int(fresh.sum()) <= self.pool.num_free - len(touched)

    def lookup_prefix(self, request_id: Hashable, token_ids) -> int:
        """Leading tokens of ``token_ids`` (the request's next ids) that ``allocate`` would serve from the
        prefix cache (device or host swap space) right now; changes nothing. A scheduler calls it before
        choosing a prefill chunk, then allocates ``hit + chunk`` ids so the hits are not recomputed."""
        if self.prefix_cache is None:
            return 0
        slots = self._slots((request_id,))
        self._require_idle((request_id,), slots, "lookup_prefix")
        counts, flat, offsets = self._step_tokens(1, None, [token_ids])
        hashed = self._hash_new_pages(slots, counts, flat, offsets)
        return len(hashed.matched[0]) * self.page_size if hashed.matched else 0

    def _require_idle(self, request_ids, slots, what: str) -> None:
        busy = self._table.pending[slots] != NO_STEP
        if busy.any():
            rid = request_ids[int(busy.argmax())]
            raise ValueError(f"{what}: {rid!r} has an uncommitted step; call commit() first")

    def _plan(self, request_ids, new_token_counts, token_ids, num_steps):
        """Check an allocation and work out its pages and prefix hits, changing nothing."""
        request_ids = tuple(request_ids)
        slots = self._slots(request_ids)
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request_ids lists a request more than once")
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        self._require_idle(request_ids, slots, "request_ids")
        counts, flat, offsets = self._step_tokens(len(slots), new_token_counts, token_ids)

        t, psize = self._table, self.page_size
        owned = t.num_pages[slots]
        # Pages a multistep reservation already holds are kept (never fewer pages than owned).
        num_pages = np.maximum(-(-(t.cache_len[slots] + counts + (num_steps - 1)) // psize), owned)
        fresh = num_pages - owned  # new pages per request, less device prefix hits below
        hashed = None
        touched = set()  # idle cached pages this step takes off the free queue
        if self.prefix_cache is not None:
            hashed = self._hash_new_pages(slots, counts, flat, offsets)
            ref = self.pool.ref_cnt
            for i, matched in zip(hashed.batch_index.tolist(), hashed.matched):
                for _, p in matched:
                    if p is not None:
                        fresh[i] -= 1
                        if ref[p] == 0:
                            touched.add(p)
        return request_ids, slots, counts, flat, offsets, owned, num_pages, fresh, hashed, touched

    def commit(self, request_ids: Optional[Sequence[Hashable]] = None) -> None:
        """Mark the allocated step's tokens as written (every pending request, or ``request_ids``) and
        register newly full pages in the prefix cache; a page whose prefix is already cached is replaced
        by the cached page and freed."""
        t = self._table
        if request_ids is None:
            slots = np.flatnonzero(t.pending != NO_STEP)
        else:
            request_ids = tuple(request_ids)
            slots = self._slots(request_ids)
            idle = t.pending[slots] == NO_STEP
            if idle.any():
                raise ValueError(f"request_ids[{int(idle.argmax())}]: {request_ids[int(idle.argmax())]!r} has "
                                 f"no allocated step to commit")
            if len(set(request_ids)) != len(request_ids):
                raise ValueError("request_ids lists a request more than once")
        t.cache_len[slots] += t.pending[slots]
        t.pending[slots] = NO_STEP
        self._retire_steps(slots)
        if self.prefix_cache is not None:
            self._commit_pages(slots)

    def release(self, request_id: Hashable, *, discard_step: bool = False) -> None:
        """Free the request's pages, tail first (so a cached chain is evicted from its end). A request with an
        allocated, uncommitted step is refused unless ``discard_step`` (the engine aborts that step)."""
        slot = self._slot(request_id)
        if self._table.pending[slot] != NO_STEP:
            if not discard_step:
                raise ValueError(f"request_id {request_id!r} has an uncommitted step: commit() it first, or "
                                 f"release(..., discard_step=True) to drop it")
            self._retire_steps(np.array([slot]))
        del self._slot_of[request_id]
        self.pool.free(reversed(self._table.release(slot)))

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Claim ``child_id`` as a copy of ``parent_id`` (parallel sampling, beam search): it shares the
        parent's full pages and gets a private copy of the partly filled last page (copy-on-write: the only
        page either of them writes next), with the same cache length, page hashes and prefix keys."""
        slot = self._slot(parent_id)
        self._require_idle((parent_id,), np.array([slot]), "fork")
        if child_id in self._slot_of:
            raise ValueError(f"child_id {child_id!r} is already claimed")
        t, pool = self._table, self.pool
        length = int(t.cache_len[slot])
        full, partial = divmod(length, self.page_size)
        if partial and pool.num_free < 1:
            raise InsufficientBlocksError("fork: copying the parent's partly filled last page needs 1 free page, "
                                          "none is free; nothing was changed")
        pages = t.lookup_table[slot, :full + (partial > 0)].tolist()
        for p in pages[:full]:
            pool.touch(p)
        if partial:
            pages[-1] = self._copy_of(pages[-1])
        child = t.claim()
        self._slot_of[child_id] = child
        t.reserve_pages(len(pages))
        t.lookup_table[child, :len(pages)] = pages
        t.num_pages[child], t.cache_len[child] = len(pages), length
        t.num_committed[child], t.tail_len[child] = t.num_committed[slot], t.tail_len[slot]
        t.tail[child] = t.tail[slot]
        t.hashes[child], t.page_ids[child] = list(t.hashes[slot]), list(t.page_ids[slot])
        t.root[child], t.spans[child] = t.root[slot], t.spans[slot]

    def rollback(self, request_id: Hashable, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` committed tokens of ``request_id`` (rejected speculative tokens), as
        if they had never been allocated: pages past the new length go back to the pool (committed ones
        stay in the prefix cache, their K/V is still right for their ids) and the new last page, if partly
        filled and shared with another request, is replaced by a private copy (copy-on-write)."""
        slot = self._slot(request_id)
        self._require_idle((request_id,), np.array([slot]), "rollback")
        t, pool, prefix, psize = self._table, self.pool, self.prefix_cache, self.page_size
        length = int(t.cache_len[slot])
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) \
                or not 0 <= num_tokens <= length:
            raise ValueError(f"num_tokens must be an int in [0, {length}] (the cache length of {request_id!r}), "
                             f"got {num_tokens!r}")
        new_length = length - int(num_tokens)
        full, partial = divmod(new_length, self.page_size)
        keep = full + (partial > 0)
        pages = t.lookup_table[slot, :t.num_pages[slot]].tolist()
        last = pages[keep - 1] if partial else None
        copy = last is not None and pool.ref_cnt[last] > 1
        if copy and pool.num_free + sum(pool.ref_cnt[p] == 1 for p in pages[keep:]) < 1:
            raise InsufficientBlocksError(f"rollback: {request_id!r} shares its new last page and copying it needs "
                                          f"1 free page, none is free; nothing was changed")
        t.lookup_table[slot, keep:len(pages)] = pool.null_page
        pool.free(reversed(pages[keep:]))
        if copy:
            t.lookup_table[slot, keep - 1] = self._copy_of(last)
            pool.free((last,))
        elif last is not None and prefix is not None:
            prefix.evict(last)  # ours alone and about to be overwritten: its cached content goes stale
        t.num_pages[slot], t.cache_len[slot] = keep, new_length
        if prefix is not None:
            if full < len(t.hashes[slot]):
                t.tail[slot, :partial] = t.page_ids[slot][full][:partial]
                del t.hashes[slot][full:], t.page_ids[slot][full:]
            t.tail_len[slot] = partial
            t.num_committed[slot] = min(int(t.num_committed[slot]), full)

    def _copy_of(self, page: int) -> int:
        """A fresh page holding the bytes (and scales) of ``page`` on every device (copy-on-write)."""
        new = self._take_pages(1, frozenset())[0]
        for tensors in (self.pool.blocks, self.pool.scales):
            for x in tensors:
                if x is not None:
                    x[new].view(torch.uint8).copy_(x[page].view(torch.uint8))
        return new

    def _retire_steps(self, slots: np.ndarray) -> None:
        """The steps of ``slots`` end (commit, release): their collections become stale."""
        t = self._table
        self._live_steps.difference_update(set(t.step_id[slots].tolist()))
        t.step_id[slots] = NO_STEP

    def reset_prefix_cache(self) -> None:
        """Forget every cached page no request holds (and the host swap space), e.g. after a weight update."""
        if self.prefix_cache is None:
            return
        for page in self.pool.free_queue:
            self.prefix_cache.evict(page)
        if self.host_swap is not None:
            self.host_swap.clear()

    # -- queries ----------------------------------------------------------------------------------

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._slot_of

    def get_req_blocks(self, request_id: Hashable) -> list[int]:
        """The pages of ``request_id`` in token order."""
        slot = self._slot(request_id)
        return self._table.lookup_table[slot, :self._table.num_pages[slot]].tolist()

    def cache_length(self, request_id: Hashable) -> int:
        """Tokens of ``request_id`` in the cache (committed steps and prefix hits)."""
        return int(self._table.cache_len[self._slot(request_id)])

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def metrics(self) -> KVCacheMetrics:
        return KVCacheMetrics(
            total_pages=self.pool.total_num_pages,
            used_pages=self.pool.total_num_pages - self.pool.num_free,
            free_pages=self.pool.num_free,
            cached_pages=0 if self.prefix_cache is None else len(self.prefix_cache),
            host_pages=0 if self.host_swap is None else self.host_swap.num_pages,
            host_cached_pages=0 if self.host_swap is None else len(self.host_swap),
            num_requests=len(self._slot_of),
            input_tokens=self._input_tokens,
            cache_hit_tokens=self._hit_tokens,
            host_hit_tokens=self._host_hit_tokens,
            bytes_per_page=self.params.bytes_per_block,
        )

    def check_invariants(self) -> None:
        """Raise ``RuntimeError`` if the bookkeeping is inconsistent: every page idle xor held, reference
        counts equal to holders, lookup rows consistent with lengths, prefix-cache maps inverse of each
        other and holding every committed page. O(pages): for tests and debugging."""
        t, pool, prefix, psize = self._table, self.pool, self.prefix_cache, self.page_size
        n, lut = pool.total_num_pages, t.lookup_table
        holders = [0] * n
        for rid, s in self._slot_of.items():
            pages = lut[s, :t.num_pages[s]].tolist()
            known = int(t.cache_len[s]) + max(int(t.pending[s]), 0)
            _require(len(set(pages)) == len(pages) and all(p < n for p in pages),
                     f"request {rid!r} holds a page twice or the null page: {pages}")
            # More pages than tokens only through a multistep reservation.
            _require(len(pages) >= -(-known // psize), f"request {rid!r} has {len(pages)} pages for {known} tokens")
            for p in pages:
                holders[p] += 1
            if prefix is not None:
                committed, hashes = int(t.num_committed[s]), t.hashes[s]
                _require(len(hashes) == known // psize == len(t.page_ids[s]) and t.tail_len[s] == known % psize,
                         f"request {rid!r}: {len(hashes)} hashes and {t.tail_len[s]} tail ids for {known} tokens")
                _require(committed <= t.cache_len[s] // psize and (t.pending[s] != NO_STEP
                                                                   or committed == t.cache_len[s] // psize),
                         f"request {rid!r}: {committed} committed pages for {t.cache_len[s]} cached tokens")
                _require(all(prefix.hash_to_page.get(hashes[j]) == pages[j] for j in range(committed)),
                         f"request {rid!r} holds a committed page missing from the prefix cache")
        live = set(t.step_id[[s for s in self._slot_of.values() if t.pending[s] != NO_STEP]].tolist())
        # A step is retired as soon as one of its requests is committed or released, so others may remain.
        _require(self._live_steps <= live and NO_STEP not in live,
                 f"live steps {sorted(self._live_steps)} are not all steps of uncommitted requests {sorted(live)}")
        cols = np.arange(lut.shape[1])
        _require(bool((lut[cols[None, :] >= t.num_pages[:, None]] == pool.null_page).all()),
                 "a lookup entry past a request's pages is not the null page")
        _require(holders == pool.ref_cnt, "reference counts differ from the number of holders")
        _require(sorted(pool.free_queue) == [p for p in range(n) if holders[p] == 0],
                 "the free queue is not exactly the unreferenced pages")
        if prefix is not None:
            _require(all(prefix.page_hash[p] == h for h, p in prefix.hash_to_page.items())
                     and len(prefix) == sum(h is not None for h in prefix.page_hash),
                     "prefix cache maps hash -> page and page -> hash disagree")
        if self.host_swap is not None:
            host_pages = list(self.host_swap.hash_to_page.values())
            _require(len(set(host_pages)) == len(host_pages) and all(0 <= p < self.host_swap.num_pages
                                                                     for p in host_pages),
                     "host swap space maps two hashes to one page")

    def __repr__(self) -> str:
        p, (start, stop) = self.params, self.layer_range
        return (
            f"PagedKVCacheManager({self.metrics}; page_size={self.page_size}, {len(self.devices)} device(s) "
            f"x {p.n_kv_heads_per_device} heads, layers [{start}, {stop}), {p.dtype_shorthand})"
        )

    # -- allocate internals -----------------------------------------------------------------------

    def _slot(self, request_id: Hashable) -> int:
        slot = self._slot_of.get(request_id)
        if slot is None:
            raise ValueError(f"request_id {request_id!r} is not claimed (unknown or already released)")
        return slot

    def _slots(self, request_ids: tuple) -> np.ndarray:
        try:
            return np.fromiter(map(self._slot_of.__getitem__, request_ids), np.int64, len(request_ids))
        except KeyError:
            i = next(i for i, rid in enumerate(request_ids) if rid not in self._slot_of)
            raise ValueError(
                f"request_ids[{i}]: {request_ids[i]!r} is not claimed (unknown or already released)"
            ) from None

    def _step_tokens(self, nreq: int, new_token_counts, token_ids):
        """``(counts, flat token ids | None, offsets | None)`` with request ``b``'s ids at
        ``flat[offsets[b]:offsets[b+1]]``."""
        flat = offsets = None
        if token_ids is None:
            if self.prefix_cache is not None:
                raise ValueError("token_ids is required with enable_prefix_caching (pages are hashed over them)")
            if new_token_counts is None:
                raise ValueError("pass new_token_counts or token_ids")
        else:
            if isinstance(token_ids, torch.Tensor):
                token_ids = token_ids.cpu().numpy()
            if isinstance(token_ids, np.ndarray):
                if token_ids.ndim != 2 or len(token_ids) != nreq or token_ids.dtype.kind not in "iu":
                    raise ValueError(f"token_ids must be an integer [{nreq}, n] array, got "
                                     f"{token_ids.dtype} {list(token_ids.shape)}")
                flat = token_ids.reshape(-1).astype(np.int64)
                lengths = np.full(nreq, token_ids.shape[1], dtype=np.int64)
            else:
                rows = [t.tolist() if hasattr(t, "tolist") else list(t) for t in token_ids]
                if len(rows) != nreq:
                    raise ValueError(f"token_ids has {len(rows)} entries for {nreq} request_ids")
                flat = np.fromiter(chain.from_iterable(rows), np.int64)
                lengths = np.fromiter(map(len, rows), np.int64, nreq)
            offsets = np.zeros(nreq + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
        if new_token_counts is None:
            return lengths, flat, offsets
        counts = np.asarray(new_token_counts)
        if counts.shape != (nreq,) or (nreq and counts.dtype.kind not in "iu"):
            raise ValueError(f"new_token_counts must hold {nreq} ints, got {new_token_counts!r}")
        counts = counts.astype(np.int64)
        if nreq and counts.min() < 0:
            i = int(counts.argmin())
            raise ValueError(f"new_token_counts[{i}] must be >= 0, got {counts[i]}")
        if flat is not None and not np.array_equal(counts, lengths):
            raise ValueError("new_token_counts disagrees with the lengths of token_ids")
        return counts, flat, offsets

    def _hash_new_pages(self, slots, counts, flat, offsets) -> _PageHashes:
        """Hash the pages the step completes; for requests whose step starts on a page boundary, also find the
        leading run of them cached on the device (page id) or in host swap space (None)."""
        t, psize = self._table, self.page_size
        tail_len = t.tail_len[slots]
        full = (tail_len + counts) // psize
        idx = np.flatnonzero(full)
        out = _PageHashes(tail_len, full, idx, [], [], [])
        if not len(idx):
            return out
        k = full[idx] * psize
        ids = self._step_ids(slots, flat, offsets, tail_len, np.repeat(idx, k), ragged_columns(np.zeros_like(k), k))
        ids = ids.reshape(-1, psize)
        rows = ids.tolist()
        sl, known = slots[idx], t.cache_len[slots[idx]]
        # Pages wholly before the step's last token: that token always runs, so no step becomes empty.
        matchable = np.where(known == t.num_pages[sl] * psize, (known + counts[idx] - 1) // psize - known // psize, 0)
        lookup, host, history, start = self.prefix_cache.hash_to_page.get, self.host_swap, t.hashes, 0
        algorithm, spans = self.hash_algorithm, t.spans
        for s, num, m in zip(sl.tolist(), full[idx].tolist(), matchable.tolist()):
            parent = history[s][-1] if history[s] else t.root[s]
            extras = page_extra_keys(spans[s], len(history[s]), num, psize, algorithm) if spans[s] else None
            hashes = hash_pages(parent, rows[start:start + num], algorithm, extras)
            out.ids.append(ids[start:start + num])
            start += num
            matched = []
            for h in hashes[:m]:
                p = lookup(h)
                if p is None and (host is None or h not in host):
                    break
                matched.append((h, p))
            out.hashes.append(hashes)
            out.matched.append(matched)
        return out

    def _step_ids(self, slots, flat, offsets, tail_len, batch, pos) -> np.ndarray:
        """Token ids at positions ``pos`` past the last hashed page of requests ``batch`` (batch indices):
        first the stored tail, then the step's new ids."""
        ids = self._table.tail[slots[batch], np.minimum(pos, self.page_size - 1)]
        if len(flat):
            before = tail_len[batch]
            new = flat[np.clip(offsets[batch] + pos - before, 0, len(flat) - 1)]
            ids = np.where(pos < before, ids, new)
        return ids

    def _apply(self, request_ids, slots, counts, flat, offsets, owned, num_pages, fresh, hashed,
               graph_buffers) -> StepInputs:
        t, pool, prefix, psize = self._table, self.pool, self.prefix_cache, self.page_size
        # Take prefix hits off the free queue first, so allocating cannot evict them.
        host_hits = []
        for matched in hashed.matched if hashed else ():
            for h, p in matched:
                if p is None:
                    host_hits.append(h)
                else:
                    pool.touch(p)
        new_pages = self._take_pages(int(fresh.sum()), frozenset(host_hits))
        max_pages = int(num_pages.max()) if len(slots) else 0
        t.reserve_pages(max_pages)
        lut = t.lookup_table
        skipped = np.zeros(len(slots), dtype=np.int64)
        loads, taken = [], 0
        for i, matched in zip(hashed.batch_index.tolist() if hashed else (), hashed.matched if hashed else ()):
            if not matched:
                continue
            row = []  # this request's new pages: the hits, then fresh ones
            for h, p in matched:
                if p is None:
                    p = prefix.hash_to_page.get(h)
                    if p is None:
                        p = new_pages[taken]
                        taken += 1
                        loads.append((h, p))
                        prefix.commit(h, p)
                    else:  # an earlier request of this step already loaded it
                        pool.touch(p)
                row.append(p)
            more = int(num_pages[i] - owned[i]) - len(row)
            row += new_pages[taken:taken + more]
            taken += more
            lut[slots[i], owned[i]:num_pages[i]] = row
            fresh[i] = 0
            skipped[i] = len(matched) * psize
            t.num_committed[slots[i]] += len(matched)
        # Everyone else: fresh pages in batch order, placed after each request's last page.
        grow = fresh > 0
        if grow.any():
            k = fresh[grow]
            total = int(k.sum())
            lut[np.repeat(slots[grow], k), ragged_columns(owned[grow], k)] = new_pages[taken:taken + total]
            taken += total
        pool.free(new_pages[taken:])  # meant for host loads that an earlier request of the step did
        if loads:
            self.host_swap.load(loads)
            self._host_hit_tokens += len(loads) * psize
        if prefix is not None:
            self._update_tails(slots, counts, flat, offsets, hashed)
        t.num_pages[slots] = num_pages
        t.cache_len[slots] += skipped
        run = counts - skipped
        t.pending[slots] = run
        self._input_tokens += int(counts.sum())
        self._hit_tokens += int(skipped.sum())
        self._last_step_id += 1
        t.step_id[slots] = self._last_step_id
        self._live_steps.add(self._last_step_id)
        return self._step_inputs(request_ids, slots, run, skipped, max_pages, graph_buffers)

    def _update_tails(self, slots, counts, flat, offsets, hashed: _PageHashes) -> None:
        """Record the step's token ids: the new page hashes, and the ids past the last full page."""
        t, psize, idx = self._table, self.page_size, hashed.batch_index
        tail_len, full = hashed.tail_len, hashed.full
        if len(idx):  # requests that completed pages: hashes, and a new tail written whole
            for s, hashes, ids in zip(slots[idx].tolist(), hashed.hashes, hashed.ids):
                t.hashes[s] += hashes
                t.page_ids[s] += list(ids)
            k = tail_len[idx] + counts[idx] - full[idx] * psize
            batch, cols = np.repeat(idx, k), ragged_columns(np.zeros_like(k), k)
            t.tail[slots[batch], cols] = self._step_ids(slots, flat, offsets, tail_len, batch,
                                                        full[batch] * psize + cols)
            t.tail_len[slots[idx]] = k
            keep = full == 0
            slots, counts, tail_len, flat = slots[keep], counts[keep], tail_len[keep], flat[np.repeat(keep, counts)]
        if len(flat):  # the others append the step's ids to their tails
            t.tail[np.repeat(slots, counts), ragged_columns(tail_len, counts)] = flat
            t.tail_len[slots] = tail_len + counts

    def _take_pages(self, count: int, protected: frozenset) -> list[int]:
        """Pop ``count`` pages; cached ones leave the prefix cache, offloaded to host swap space first."""
        pages = self.pool.alloc(count)
        if self.prefix_cache is not None:
            evict = self.prefix_cache.evict
            evicted = [(h, p) for p in pages if (h := evict(p)) is not None]
            if evicted and self.host_swap is not None:
                self.host_swap.offload(evicted, protected)
        return pages

    def _step_inputs(self, request_ids, slots, run, skipped, max_pages, graph_buffers) -> StepInputs:
        # Same definitions as cute_kv.metadata.input_row_offsets / max_lengths, vectorised (tests compare).
        lengths = self._table.cache_len[slots]
        offsets = np.zeros(len(slots) + 1, dtype=np.uint32)
        offsets[1:] = np.cumsum(run)
        step_id = self._last_step_id
        if graph_buffers is not None:
            graph_buffers.fill(lengths, self._table.lookup_table[slots, :padded_lut_cols(max_pages)], offsets)
            return StepInputs(request_ids, graph_buffers.collections, graph_buffers.input_row_offsets,
                              tuple(run.tolist()), tuple(skipped.tolist()), step_id, graph_buffers)
        max_seq = int(run.max()) if len(slots) else 0
        max_cache = int((lengths + run).max()) if len(slots) else 0
        host = (
            torch.from_numpy(lengths.astype(np.uint32)),
            torch.from_numpy(self._table.lookup_table[slots, :padded_lut_cols(max_pages)]),
            torch.from_numpy(offsets),
        )
        on_device = {}
        collections, row_offsets = [], []
        for base in self._collections:
            if base.device not in on_device:
                on_device[base.device] = tuple(x.to(base.device) for x in host)
            lengths_d, lut_d, offsets_d = on_device[base.device]
            coll = base.with_metadata(lengths_d, lut_d, max_seq, max_cache, validate=False)
            coll.bind_step(step_id, self._live_steps)
            collections.append(coll)
            row_offsets.append(offsets_d)
        return StepInputs(request_ids, tuple(collections), tuple(row_offsets), tuple(run.tolist()),
                          tuple(skipped.tolist()), step_id)

    # -- commit internals -------------------------------------------------------------------------

    def _commit_pages(self, slots: np.ndarray) -> None:
        t, prefix, pool = self._table, self.prefix_cache, self.pool
        full = t.cache_len[slots] // self.page_size
        start = t.num_committed[slots]
        todo = full > start
        if not todo.any():
            return
        slots, start, full = slots[todo], start[todo], full[todo]
        rows, cols = np.repeat(slots, full - start), ragged_columns(start, full - start)
        for s, j, page in zip(rows.tolist(), cols.tolist(), t.lookup_table[rows, cols].tolist()):
            cached = prefix.commit(t.hashes[s][j], page)
            if cached != page:  # the same prefix is already cached: share that page, give ours back
                pool.touch(cached)
                pool.free((page,))
                t.lookup_table[s, j] = cached
        t.num_committed[slots] = full


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(f"PagedKVCacheManager invariant broken: {message}")
