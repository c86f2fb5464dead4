"""Engines' own caches and step metadata through ``cute_kv.adapters``: vLLM (NHD and HND stride orders), FlashInfer
(NHD, HND), SGLang and FA4 at page sizes 1, 8, 16 and 64, several layers under one ``plan_step``. ``store_kv`` and
``paged_attention`` (full and windowed) are compared with a store and an attention written here through each
engine's own indexing (its block table, CSR or token pool), not through ``cute_kv.reference``. Then the traps: an
HND cache passed as NHD, new tokens counted in ``cache_lengths``, a plan across layers."""

import math
import os
import re

import pytest
import torch

import cute_kv
from cute_kv import PagedKVCacheCollection, adapters

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A ragged step: empty prefixes, a decode, a request with no new token, several pages and partial last pages.
CACHED = [0, 37, 5, 0, 130, 3]
NEW = [5, 1, 0, 1, 12, 7]
PADDED = 2  # CUDA-graph padding requests after the real ones
H, HQ, D, LAYERS = 2, 4, 16, 2
WINDOW_LEFT = 6  # the engines' count of keys left of the query
DTYPE = torch.bfloat16


class Engine:
    """One engine's per-layer caches and step metadata as it allocates them, its own read / write of a request's
    tokens, and its adapter call. ``pages[b]``: request b's pages in order, from a shuffled pool."""

    layout = "NHD"
    reserved = 0  # leading pages the engine never hands out (SGLang's padding page)

    def __init__(self, page_size: int, gen: torch.Generator):
        self.p, self.gen = page_size, gen
        need = [-(-(c + n) // page_size) for c, n in zip(CACHED, NEW)]
        self.num_pages = self.reserved + sum(need) + 3
        pool = (self.reserved + torch.randperm(self.num_pages - self.reserved, generator=gen)).tolist()
        self.pages, at = [], 0
        for n in need:
            self.pages.append(pool[at:at + n])
            at += n
        self.caches = [self.allocate() for _ in range(LAYERS)]

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(DTYPE)

    def int32(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32)

    def zero_padded_table(self, cols: int) -> torch.Tensor:
        """vLLM's / FA4's ``[B, cols]`` table: zeros past a request's pages, stale pages in the padded rows."""
        table = torch.zeros(len(CACHED) + PADDED, cols, dtype=torch.int32)
        for b, pages in enumerate(self.pages):
            table[b, :len(pages)] = self.int32(pages)
        table[len(CACHED):] = torch.randint(0, self.num_pages, (PADDED, cols), generator=self.gen)
        return table

    def window(self) -> int:
        return adapters.window_from_left(WINDOW_LEFT)


class VLLM(Engine):
    """FlashAttention backend: ``kv_caches[l]`` is ``[2, N, P, H, D]``; HND stride order allocates
    ``[2, N, H, P, D]`` and hands the backend the permuted (logical NHD) view. Slot ``block_table[b, t // P] * P +
    t % P``."""

    def allocate(self):
        if self.layout == "NHD":
            return self.randn(2, self.num_pages, self.p, H, D)
        return self.randn(2, self.num_pages, H, self.p, D).permute(0, 1, 3, 2, 4)

    def metadata(self):
        ends = [c + n for c, n in zip(CACHED, NEW)]
        self.query_start_loc = self.int32([0, *torch.tensor(NEW).cumsum(0).tolist()] + [sum(NEW)] * PADDED)
        self.seq_lens = self.int32(ends + [0] * PADDED)
        self.block_table = self.zero_padded_table(max(map(len, self.pages)) + 2)
        return adapters.from_vllm(self.query_start_loc, self.seq_lens, self.block_table, page_size=self.p,
                                  num_pages=self.num_pages, max_seq_length=max(NEW), max_cache_length=max(ends))

    def views(self, cache):
        return cache[0], cache[1]

    def rows(self, cache, b, t):
        slot = self.block_table[b, t // self.p].long() * self.p + t % self.p
        return [(kv, slot // self.p, slot % self.p) for kv in (cache[0], cache[1])]

    def window(self):
        return 1 + WINDOW_LEFT  # vLLM's sliding_window counts the query's own key


class VLLMHND(VLLM):
    layout = "HND"


class FA4(VLLM):
    """``flash_attn.cute``'s paged varlen call: separate ``k_cache`` / ``v_cache [N, P, H, D]``, ``page_table``,
    ``seqused_k``, ``cu_seqlens_q``; window ``window_size=(left, 0)``."""

    def allocate(self):
        return self.randn(self.num_pages, self.p, H, D), self.randn(self.num_pages, self.p, H, D)

    def metadata(self):
        self.cu_seqlens_q = self.int32([0, *torch.tensor(NEW).cumsum(0).tolist()] + [sum(NEW)] * PADDED)
        self.seqused_k = self.int32([c + n for c, n in zip(CACHED, NEW)] + [0] * PADDED)
        self.page_table = self.zero_padded_table(max(map(len, self.pages)))
        return adapters.from_fa4(self.cu_seqlens_q, self.seqused_k, self.page_table, page_size=self.p,
                                 num_pages=self.num_pages)

    def rows(self, cache, b, t):
        page = self.page_table[b, t // self.p].long()
        return [(c, page, t % self.p) for c in cache]

    def window(self):
        return adapters.window_from_left(WINDOW_LEFT)


class FlashInfer(Engine):
    """Paged KV ``[N, 2, P, H, D]`` (NHD) or ``[N, 2, H, P, D]`` (HND) per layer, CSR ``kv_indptr`` /
    ``kv_indices`` (a buffer longer than the step's pages) / ``kv_last_page_len``; padded requests have no pages and
    ``kv_last_page_len`` 1. Token ``t`` of request ``b``: page ``kv_indices[kv_indptr[b] + t // P]``."""

    def allocate(self):
        if self.layout == "NHD":
            return self.randn(self.num_pages, 2, self.p, H, D)
        return self.randn(self.num_pages, 2, H, self.p, D)

    def metadata(self):
        ends = [c + n for c, n in zip(CACHED, NEW)]
        counts = [len(pages) for pages in self.pages] + [0] * PADDED
        self.qo_indptr = self.int32([0, *torch.tensor(NEW).cumsum(0).tolist()] + [sum(NEW)] * PADDED)
        self.kv_indptr = self.int32([0, *torch.tensor(counts).cumsum(0).tolist()])
        self.kv_indices = self.int32([p for pages in self.pages for p in pages] + [0] * 5)
        self.kv_last_page_len = self.int32([e - (len(pg) - 1) * self.p for e, pg in zip(ends, self.pages)]
                                           + [1] * PADDED)
        return adapters.from_flashinfer(self.qo_indptr, self.kv_indptr, self.kv_indices, self.kv_last_page_len,
                                        page_size=self.p, num_pages=self.num_pages, max_cache_length=max(ends))

    def views(self, cache):
        if self.layout == "NHD":
            return cache[:, 0], cache[:, 1]
        return cache[:, 0].permute(0, 2, 1, 3), cache[:, 1].permute(0, 2, 1, 3)

    def rows(self, cache, b, t):
        page = self.kv_indices[self.kv_indptr[b] + t // self.p].long()
        if self.layout == "NHD":
            return [(cache, page, kv, t % self.p) for kv in (0, 1)]
        return [(cache, page, kv, slice(None), t % self.p) for kv in (0, 1)]


class FlashInferHND(FlashInfer):
    layout = "HND"


class SGLang(Engine):
    """``MHATokenToKVPool``: per-layer ``k_buffer`` / ``v_buffer [N * P, H, D]`` indexed by token slot, page 0
    reserved (its padding slot 0); ``req_to_token[req_pool_indices[b], t]`` is the slot of token ``t``, page
    ``slot // P``. The CUDA-graph padding decodes one token per padded request as pool row 0, which here is a real
    request's row."""

    reserved = 1

    def allocate(self):
        return self.randn(self.num_pages * self.p, H, D), self.randn(self.num_pages * self.p, H, D)

    def metadata(self):
        real = len(CACHED)
        self.req_pool_indices = torch.tensor(torch.randperm(real, generator=self.gen).tolist() + [0] * PADDED)
        self.req_to_token = torch.zeros(real + 3, 160, dtype=torch.int32)
        for b, pages in enumerate(self.pages):
            t = torch.arange(CACHED[b] + NEW[b])
            self.req_to_token[self.req_pool_indices[b], t] = (torch.tensor(pages)[t // self.p] * self.p
                                                              + t % self.p).to(torch.int32)
        self.seq_lens = torch.tensor([c + n for c, n in zip(CACHED, NEW)] + [1] * PADDED)  # fill value 1
        self.extend_seq_lens = self.int32(NEW + [1] * PADDED)
        return adapters.from_sglang(self.req_to_token, self.req_pool_indices, self.seq_lens, self.extend_seq_lens,
                                    page_size=self.p, num_pages=self.num_pages, num_requests=real)

    def views(self, cache):
        return tuple(buffer.view(-1, self.p, H, D) for buffer in cache)

    def rows(self, cache, b, t):
        if b >= len(CACHED):  # padding: SGLang's out_cache_loc 0
            return [(buffer, torch.zeros_like(t)) for buffer in cache]
        return [(buffer, self.req_to_token[self.req_pool_indices[b], t].long()) for buffer in cache]


ENGINES = {"vllm": VLLM, "vllm-hnd": VLLMHND, "flashinfer": FlashInfer, "flashinfer-hnd": FlashInferHND,
           "sglang": SGLang, "fa4": FA4}


def _read(engine, cache, b, t):
    """K and V ``[len(t), H, D]`` of request ``b``'s tokens ``t`` through the engine's indexing."""
    return [where[0][where[1:]] for where in engine.rows(cache, b, t)]


def _write(engine, cache, b, t, k, v):
    for where, rows in zip(engine.rows(cache, b, t), (k, v)):
        where[0][where[1:]] = rows


def _attention(engine, cache, b, q, window_left):
    """float64 attention of request ``b``'s queries ``q [n, HQ, D]`` over its keys read through the engine's own
    indexing, causal, keys ``j >= p - window_left`` when given (the engines' own convention)."""
    keys = CACHED[b] + NEW[b]
    k, v = (x.double() for x in _read(engine, cache, b, torch.arange(keys)))
    group = HQ // H
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(D)
    p = CACHED[b] + torch.arange(q.shape[0])[:, None]
    j = torch.arange(keys)[None, :]
    seen = (j <= p) & (j >= p - window_left if window_left is not None else True)
    s = s.masked_fill(~seen, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("page_size", [1, 8, 16, 64])
@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_step_matches_attention_through_its_own_indexing(name, page_size):
    gen = torch.Generator().manual_seed(page_size)
    engine = ENGINES[name](page_size, gen)
    step = engine.metadata()
    ours = [tuple(x.clone() for x in c) if isinstance(c, tuple) else c.clone() for c in engine.caches]
    coll = step.collection([engine.views(c)[0] for c in ours], [engine.views(c)[1] for c in ours],
                           layout=engine.layout, num_kv_heads=H)
    assert coll.num_layers == LAYERS
    ro = step.input_row_offsets
    plan = cute_kv.plan_step(coll, ro, num_q_heads=HQ)
    rows = sum(NEW) + (PADDED if name == "sglang" else 0)
    spans = [(b, sum(NEW[:b]), NEW[b]) for b in range(len(CACHED))]
    spans += [(len(CACHED) + i, sum(NEW) + i, 1) for i in range(rows - sum(NEW))]
    for layer in range(LAYERS):
        k, v, q = engine.randn(rows, H, D), engine.randn(rows, H, D), engine.randn(rows, HQ, D)
        if rows > sum(NEW):  # padded requests share one slot: give it one value, as any order then writes
            k[sum(NEW):], v[sum(NEW):] = k[sum(NEW)], v[sum(NEW)]
        cute_kv.store_kv(k, v, ro, coll, layer, plan=plan)
        outs = {}
        for window_left in (None, WINDOW_LEFT):
            out = torch.full((rows, HQ, D), float("nan"), dtype=DTYPE)
            cute_kv.paged_attention(q, ro, coll, layer, plan=plan, out=out,
                                    window=None if window_left is None else engine.window())
            outs[window_left] = out
        cache = engine.caches[layer]
        for b, start, n in spans:  # the engine's own store of the step's tokens
            t = torch.arange(CACHED[b], CACHED[b] + n) if b < len(CACHED) else torch.zeros(1, dtype=torch.long)
            _write(engine, cache, b, t, k[start:start + n], v[start:start + n])
        for mine, theirs in zip(ours[layer] if isinstance(cache, tuple) else [ours[layer]],
                                cache if isinstance(cache, tuple) else [cache]):
            assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16))  # bit for bit, untouched rows too
        for window_left, out in outs.items():
            assert not out.isnan().any()
            for b, start, n in spans[:len(CACHED)]:
                want = _attention(engine, cache, b, q[start:start + n], window_left)
                torch.testing.assert_close(out[start:start + n].double(), want, atol=2e-2, rtol=2e-2)


# -- the traps ---------------------------------------------------------------------------------------------------------


def _vllm_step(page_size=8):
    engine = VLLM(page_size, torch.Generator().manual_seed(1))
    return engine, engine.metadata()


def test_hnd_passed_as_nhd_is_refused():
    """vLLM's HND stride order at page size 8 with 16 heads: the physical ``[2, N, H, P, D]`` passed as the logical
    ``[N, P, H, D]`` swaps P and H. The engine's layout, page size or head count catches it; the adapter's
    collection knows the page size; store_kv says the dims look transposed."""
    n, p, h = 4, 8, 16
    physical = torch.zeros(2, n, h, p, D, dtype=DTYPE)
    k, v = physical[0], physical[1]  # [N, 16, 8, D]: read as P = 16, H = 8
    meta = (torch.zeros(1, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match=re.escape("k_cache: layout='HND', but k_cache [N, P, H, D] = [4, 16, 8, 16] "
                                                   "has strides [2048, 128, 16, 1]: P (stride 128) outside H "
                                                   "(stride 16) is NHD; if k_cache is the engine's [N, H, P, D] "
                                                   "tensor (an HND cache: P = 8, H = 16), pass "
                                                   "k_cache.permute(0, 2, 1, 3) with layout='HND'")):
        PagedKVCacheCollection.from_kv(k, v, *meta, layout="HND")
    with pytest.raises(ValueError, match=re.escape("k_cache [N, P, H, D] = [4, 16, 8, 16] (layout not given) has P = "
                                                   "16 but page_size=8: the dims look transposed")):
        PagedKVCacheCollection.from_kv(k, v, *meta, page_size=8)
    with pytest.raises(ValueError, match=re.escape("has H = 8 but num_kv_heads=16: the dims look transposed")):
        PagedKVCacheCollection.from_kv(k, v, *meta, num_kv_heads=16)
    with pytest.raises(ValueError, match="layout must be 'NHD'"):
        PagedKVCacheCollection.from_kv(k, v, *meta, layout="nhd")
    logical = physical.permute(0, 1, 3, 2, 4)  # what vLLM hands its backend: read in place, as HND
    with pytest.raises(ValueError, match="layout='NHD', but k_cache .* is HND; if the engine's cache is HND"):
        PagedKVCacheCollection.from_kv(logical[0], logical[1], *meta, layout="NHD")
    c = PagedKVCacheCollection.from_kv(logical[0], logical[1], *meta, layout="HND", page_size=p, num_kv_heads=h)
    assert (c.page_size, c.num_heads) == (p, h)
    unguarded = PagedKVCacheCollection.from_kv(k, v, *meta)
    with pytest.raises(ValueError, match=r"k has 16 heads but the cache has 8 heads and pages of 16 tokens: the "
                                         r"cache's P and H look transposed, an HND cache"):
        cute_kv.store_kv(torch.zeros(1, h, D, dtype=DTYPE), torch.zeros(1, h, D, dtype=DTYPE),
                         torch.tensor([0, 1], dtype=torch.int32), unguarded, 0)
    step = adapters.from_vllm(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                              torch.zeros(1, 2, dtype=torch.int32), page_size=p, num_pages=n)
    with pytest.raises(ValueError, match=re.escape("has P = 16 but page_size=8: the dims look transposed")):
        step.collection(k, v)  # the adapter's collection checks the engine's page size


def test_new_tokens_in_cache_lengths_are_named():
    """An engine's lengths (new tokens counted in) given as ``cache_lengths``: over the adapter's sentinel-padded
    table it is an error saying so, whatever the bound; at a tight bound it names cache_lengths, not the offsets.
    The adapter subtracts them (the engine tests above)."""
    engine, step = _vllm_step()
    seq_lens = engine.seq_lens
    capacity = step.lookup_table.shape[1] * engine.p  # the loosest bound the table allows
    loose = PagedKVCacheCollection.from_kv(*engine.views(engine.caches[0]), seq_lens, step.lookup_table, capacity,
                                           capacity, validate=False)
    k = torch.zeros(sum(NEW), H, D, dtype=DTYPE)
    hint = "if it counts the step's new tokens too, as vLLM's seq_lens"
    with pytest.raises(ValueError, match=re.escape("request 0 needs positions [0, 10) (5 cached + 5 new) but owns "
                                                   "only 1 pages") + ".*" + re.escape(hint)):
        cute_kv.plan_step(loose, step.input_row_offsets)
    with pytest.raises(ValueError, match=re.escape(hint)):
        cute_kv.store_kv(k, k, step.input_row_offsets, loose, 0)
    tight = PagedKVCacheCollection.from_kv(*engine.views(engine.caches[0]), seq_lens, step.lookup_table, max(NEW),
                                           max(c + n for c, n in zip(CACHED, NEW)), validate=False)
    with pytest.raises(ValueError, match=re.escape("request 4 has cache_lengths[4] = 142 cached + 12 new "
                                                   "(input_row_offsets) = 154 tokens in context, more than the "
                                                   "collection's max_cache_length (142); ") + ".*" + re.escape(hint)):
        cute_kv.plan_step(tight, step.input_row_offsets)


def test_a_padded_request_given_rows_but_no_pages_is_named():
    """FlashInfer's padding with query rows (0 pages, last_page_len 1): the step's cache_lengths go negative, and
    the error says what that means."""
    ro = torch.tensor([0, 1, 2], dtype=torch.int32)
    step = adapters.from_flashinfer(ro, torch.tensor([0, 1, 1], dtype=torch.int32),
                                    torch.tensor([3], dtype=torch.int32), torch.tensor([4, 1], dtype=torch.int32),
                                    page_size=8, num_pages=4, max_cache_length=8)
    assert step.cache_lengths.tolist() == [3, -1]
    kv = torch.zeros(2, 4, 8, H, D, dtype=DTYPE)
    coll = step.collection(kv[0], kv[1])
    with pytest.raises(ValueError, match=r"cache_lengths\[1\] is -1: negative; .*a padded request given query rows "
                                         r"but no pages"):
        cute_kv.plan_step(coll, ro)


def test_one_plan_serves_the_layers_of_a_step():
    """vLLM's per-layer caches, a collection each (same metadata tensors): one plan serves every layer, and a
    collection of other metadata or another geometry is refused naming what differs. ``from_kv`` of lists is one
    collection whose ``layer_idx`` selects the layer's own tensors."""
    engine, step = _vllm_step()
    layers = [step.collection(*engine.views(c)) for c in engine.caches]
    listed = step.collection([engine.views(c)[0] for c in engine.caches],
                             [engine.views(c)[1] for c in engine.caches])
    plan = cute_kv.plan_step(layers[0], step.input_row_offsets, num_q_heads=HQ)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(NEW), HQ, D, generator=gen).to(DTYPE)
    k = torch.randn(sum(NEW), H, D, generator=gen).to(DTYPE)
    for layer, coll in enumerate(layers):
        before = [c.clone() for c in engine.caches]
        cute_kv.store_kv(k, k, step.input_row_offsets, coll, 0, plan=plan)
        assert [not torch.equal(a, b) for a, b in zip(before, engine.caches)] == [i == layer for i in range(LAYERS)]
        by_list = cute_kv.paged_attention(q, step.input_row_offsets, listed, layer, plan=plan)
        assert torch.equal(by_list, cute_kv.paged_attention(q, step.input_row_offsets, coll, 0, plan=plan))
        assert listed.get_key_cache(layer).blocks.data_ptr() == engine.views(engine.caches[layer])[0].data_ptr()
    other = engine.metadata()
    with pytest.raises(ValueError, match="the plan does not serve this collection: its cache_lengths is not the "
                                         "tensor the plan checked"):
        cute_kv.store_kv(k, k, step.input_row_offsets, other.collection(*engine.views(engine.caches[0])), 0,
                         plan=plan)
    wide = torch.zeros(2, engine.num_pages, 8, H, 2 * D, dtype=DTYPE)
    with pytest.raises(ValueError, match=r"its cache's shape \[N, KVD, L, P, H, D\] is \[\d+, 2, 1, 8, 2, 32\]"):
        cute_kv.paged_attention(q, step.input_row_offsets, step.collection(wide[0], wide[1]), 0, plan=plan)
    with pytest.raises(ValueError, match=r"layer_idx must be in \[0, 2\)"):
        cute_kv.store_kv(k, k, step.input_row_offsets, listed, 2, plan=plan)


def test_from_kv_lists_are_checked():
    engine, step = _vllm_step()
    ks = [engine.views(c)[0] for c in engine.caches]
    vs = [engine.views(c)[1] for c in engine.caches]
    with pytest.raises(TypeError, match="both be tensors .* or both lists"):
        step.collection(ks, vs[0])
    with pytest.raises(ValueError, match="one tensor per layer each, got 2 and 1"):
        step.collection(ks, vs[:1])
    with pytest.raises(ValueError, match=re.escape("k_caches[1] is the memory of k_caches[0]")):
        step.collection([ks[0], ks[0]], [vs[0], vs[1]])
    narrow = torch.zeros(2, engine.num_pages, 8, H, D // 2, dtype=DTYPE)
    with pytest.raises(ValueError, match=re.escape("k_caches[1] must have shape")):
        step.collection([ks[0], narrow[0]], [vs[0], narrow[1]])
    hnd = VLLMHND(8, torch.Generator().manual_seed(1)).caches[0]
    with pytest.raises(ValueError, match=re.escape("k_caches[1] has strides") + ".*share one layout"):
        step.collection([ks[0], hnd[0]], [vs[0], hnd[1]])
    with pytest.raises(ValueError, match="the K cache has 3 pages"):
        step.collection(ks[0][:3], vs[0][:3])


def test_adapters_stay_on_the_metadata_device_and_read_nothing():
    """Metadata on the meta device (no values: any host read raises): every adapter's step is made there."""
    def meta(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    steps = [adapters.from_vllm(meta(4), meta(3), meta(3, 5), page_size=16, num_pages=9),
             adapters.from_fa4(meta(4), meta(3), meta(3, 5), page_size=16, num_pages=9, max_seq_length=4,
                               max_cache_length=70),
             adapters.from_flashinfer(meta(4), meta(4), meta(11), meta(3), page_size=16, num_pages=9,
                                      max_cache_length=70),
             adapters.from_sglang(meta(5, 64), meta(3, dtype=torch.int64), meta(3, dtype=torch.int64), meta(3),
                                  page_size=16, num_pages=9, num_requests=2)]
    for step in steps:
        assert {t.device.type for t in (step.input_row_offsets, step.cache_lengths, step.lookup_table)} == {"meta"}
        assert step.lookup_table.shape == (3, 24)  # 5 (or 4) pages a request, in MAX's padded rows
    assert (steps[0].max_seq_length, steps[0].max_cache_length) == (24 * 16, 24 * 16)  # loose: the table's
    assert (steps[1].max_seq_length, steps[1].max_cache_length) == (4, 70)


def test_adapters_reject_bad_arguments():
    i32 = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        adapters.from_vllm(i32, i32[:2].float(), torch.zeros(2, 1, dtype=torch.int32), page_size=8, num_pages=4)
    with pytest.raises(ValueError, match=r"block_table must have one row per request \(2, as seq_lens\)"):
        adapters.from_vllm(i32, i32[:2], torch.zeros(3, 1, dtype=torch.int32), page_size=8, num_pages=4)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        adapters.from_fa4(i32, i32[:2], torch.zeros(2, 1, dtype=torch.int32), page_size=0, num_pages=4)
    with pytest.raises(ValueError, match="max_cache_length must be an int >= 0"):
        adapters.from_flashinfer(i32, i32, i32, i32[:2], page_size=8, num_pages=4, max_cache_length=None)
    with pytest.raises(ValueError, match=r"num_requests must be an int in \[0, 2\]"):
        adapters.from_sglang(torch.zeros(2, 8, dtype=torch.int32), i32[:2], i32[:2], page_size=1, num_pages=8,
                             num_requests=3)
    with pytest.raises(ValueError, match="window_left must be an int >= -1"):
        adapters.window_from_left(-2)
    assert adapters.window_from_left(-1) is None and adapters.window_from_left(0) == 1
