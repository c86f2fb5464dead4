"""The host cache model: MAX's 6-D layout, per-layer views, row addressing, populate, element access."""

import math

import pytest
import torch

from cute_kv import (KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheCollection, make_lookup_table,
                     padded_lut_cols)


def make_collection(g, *, n=12, kvd=2, nl=3, p=16, h=2, d=8, cache_lengths=(20, 0, 1, 33), scales=False,
                    gran=None, max_seq=0):
    dtype = torch.float8_e4m3fn if scales else torch.bfloat16
    blocks = torch.randn((n, kvd, nl, p, h, d), generator=g).to(dtype)
    sc = None
    if scales:
        gran = gran or d
        sc = torch.rand((n, kvd, nl, p, h, math.ceil(d / gran)), generator=g) + 0.5
    perm = torch.randperm(n, generator=g).tolist()
    pages, k = [], 0
    for c in cache_lengths:
        need = -(-(c + max_seq) // p)
        pages.append(perm[k:k + need])
        k += need
    lut = make_lookup_table(pages, sentinel=n)
    cl = torch.tensor(cache_lengths, dtype=torch.int64).to(torch.uint32)
    return PagedKVCacheCollection(blocks, cl, lut, max_seq, max(cache_lengths) + max_seq, sc,
                                  quantization_granularity=gran if scales else None), pages


def test_max_offset_example():
    # MAX test_paged_kv_cache_types: [4,2,3,2,2,4], (block=1, layer=1, head=1, dim=2) -> 118
    blocks = torch.arange(4 * 2 * 3 * 2 * 2 * 4, dtype=torch.float32).reshape(4, 2, 3, 2, 2, 4)
    lut = make_lookup_table([[1]], sentinel=4)
    c = PagedKVCacheCollection(blocks, torch.tensor([2]).to(torch.uint32), lut, 0, 2)
    k1 = c.get_key_cache(1)
    assert k1.block_paged_ptr(1, 0, 0, 1, 2) == 118
    assert blocks.flatten()[118] == k1.blocks[1, 0, 1, 2]
    assert k1.load(0, 1, 0, 2).item() == 118


@pytest.mark.parametrize("kvd", [1, 2])
@pytest.mark.parametrize("scales", [False, True])
def test_views_are_max_strides(rng, kvd, scales):
    c, _ = make_collection(rng, kvd=kvd, scales=scales, d=16, gran=8 if scales else None)
    n, _, nl, p, h, d = c.blocks.shape
    for layer in range(nl):
        for kv in range(kvd):
            view = c.get_key_cache(layer) if kv == 0 else c.get_value_cache(layer)
            assert view.blocks.shape == (n, p, h, d)
            assert view.blocks.stride() == (kvd * nl * p * h * d, h * d, d, 1)
            assert torch.equal(view.blocks.view(torch.uint8) if scales else view.blocks,
                               (c.blocks.view(torch.uint8) if scales else c.blocks)[:, kv, layer])
            assert view.stride_rows == kvd * nl * p
            if scales:
                assert torch.equal(view.scales, c.scales[:, kv, layer])
                assert view.scales.stride()[0] == kvd * nl * p * h * 2


def test_mla_has_no_value_cache(rng):
    c, _ = make_collection(rng, kvd=1)
    with pytest.raises(ValueError, match="MLA"):
        c.get_value_cache(0)


def test_row_idx_and_row_view(rng):
    c, pages = make_collection(rng)
    v = c.get_value_cache(2)
    rows = v.row_view()
    assert rows.shape[0] == v.num_kv_rows() == (c.num_pages - 1) * v.stride_rows + c.page_size
    for b, cl in enumerate(c.cache_lengths.tolist()):
        for t in {0, cl // 2, cl - 1} if cl else ():
            r = v.row_idx(b, t)
            assert r == pages[b][t // 16] * v.stride_rows + t % 16
            assert torch.equal(rows[r], c.blocks[pages[b][t // 16], 1, 2, t % 16])
        if cl:
            assert torch.equal(v.gather(b, 0, cl, torch.bfloat16),
                               torch.stack([c.blocks[pages[b][t // 16], 1, 2, t % 16] for t in range(cl)]))
    # the last valid row is the last token of the last page, and it is in range
    last = rows[v.num_kv_rows() - 1]
    assert torch.equal(last, c.blocks[-1, 1, 2, -1])


def test_get_tma_row(rng):
    c, _ = make_collection(rng)
    k = c.get_key_cache(1)
    for page, off in [(0, 0), (5, 3), (11, 15)]:
        assert k.get_tma_row(page * 16 + off) == page * k.stride_rows + off


def test_metadata_accessors(rng):
    c, _ = make_collection(rng, max_seq=3)
    k = c.get_key_cache(0)
    assert [k.cache_length(b) for b in range(4)] == [20, 0, 1, 33]
    assert k.max_prompt_length() == 3 and k.max_context_length() == 36
    assert not k.empty_cache() and k.max_tile_size() == 16
    assert c.pages_owned(1) == 1 and c.pages_owned(3) == 3


@pytest.mark.parametrize("bn", [64, 128, 256])
@pytest.mark.parametrize("p", [16, 32, 64, 128])
@pytest.mark.parametrize("align_is_bn", [True, False])
def test_populate_lut_boundary(bn, p, align_is_bn):
    """MAX test_paged_lut_load_boundary: rows[i] / stride == first_lut_idx + i, LUT tail poisoned."""
    n = 64
    blocks = torch.zeros((n + 1, 2, 2, p, 1, 8), dtype=torch.bfloat16)[:n]  # +1: a real null page past N
    g = torch.Generator().manual_seed(p * bn)
    used = 6 * bn // p if p < bn else 6
    lut_pages = torch.randperm(n, generator=g)[: max(used, 1)].tolist()
    lut = make_lookup_table([lut_pages], sentinel=n)
    c = PagedKVCacheCollection(blocks, torch.tensor([len(lut_pages) * p]).to(torch.uint32), lut, 0,
                               len(lut_pages) * p)
    k = c.get_key_cache(1)
    align = bn if align_is_bn else min(p, bn)
    for base in range(0, len(lut_pages) * p, bn):
        r = k.populate(bn, align, 0, base)
        if p >= bn:
            assert r.num_pages == 1
            want = lut_pages[base // p] * k.stride_rows + (0 if align % p == 0 else base % p)
            assert r.rows == (want,)
            assert r.get_row(5) == k.row_idx(0, base + 5)
        else:
            assert r.num_pages == bn // p and r.eff_page == p
            assert r.chunk == min(r.num_pages & -r.num_pages, (align // p) & -(align // p), 8)
            assert [row // k.stride_rows for row in r.rows] == lut_pages[base // p: base // p + r.num_pages]
            assert r.get_row(p + 3) == lut_pages[base // p + 1] * k.stride_rows + 3


def test_populate_sentinel_stays_in_bounds():
    """MAX test_paged_kv_null_block_sentinel: LUT all sentinel, N+1 pages allocated -> row N*stride in range."""
    n, p = 8, 16
    storage = torch.zeros((n + 1, 2, 2, p, 1, 8), dtype=torch.bfloat16)
    lut = torch.full((1, padded_lut_cols(4)), n, dtype=torch.int64).to(torch.uint32)
    c = PagedKVCacheCollection(storage[:n], torch.tensor([0]).to(torch.uint32), lut, 0, 0)
    k = c.get_key_cache(0)
    r = k.populate(64, 64, 0, 0)
    assert r.rows == (n * k.stride_rows,) * 4
    assert (n * k.stride_rows + p) * 8 <= storage.numel()


def test_populate_chunk_rule_bn192_p16():
    # BN=192, P=16 -> 12 pages, chunk = lowbit(12) = 4 (a worked example)
    blocks = torch.zeros((40, 2, 1, 16, 1, 8), dtype=torch.bfloat16)
    lut = make_lookup_table([list(range(39, 14, -1))], sentinel=40)
    c = PagedKVCacheCollection(blocks, torch.tensor([25 * 16]).to(torch.uint32), lut, 0, 25 * 16)
    r = c.get_key_cache(0).populate(192, 64, 0, 192)
    assert r.num_pages == 12 and r.chunk == 4


def test_populate_pair_cta(rng):
    c, pages = make_collection(rng, cache_lengths=(128,), p=16)
    k = c.get_key_cache(0)
    leader = k.populate(64, 64, 0, 64, pair_cta=True, is_leader=True)
    peer = k.populate(64, 64, 0, 64, pair_cta=True, is_leader=False)
    assert leader.k_row(0) == k.row_idx(0, 64)
    assert peer.k_row(0) == k.row_idx(0, 96)


@pytest.mark.parametrize(
    "args,match",
    [((24, 8, 0, 0), "divide"), ((64, 24, 0, 0), "power of two"), ((64, 64, 0, 32), "multiple of base_alignment"),
     ((64, 8, 0, 0), "base_alignment >= page_size")],
)
def test_populate_rejects_bad_tiles(rng, args, match):
    c, _ = make_collection(rng)
    with pytest.raises(ValueError, match=match):
        c.get_key_cache(0).populate(*args)


def test_block_paged_ptr_rules(rng):
    c, pages = make_collection(rng)
    k = c.get_key_cache(1)
    off = k.block_paged_ptr(8, 0, 8, 1, 3)
    assert c.blocks.flatten()[off] == c.blocks[pages[0][0], 0, 1, 8, 1, 3]
    with pytest.raises(ValueError, match="tile_size"):
        k.block_paged_ptr(12, 0, 0, 0)
    with pytest.raises(ValueError, match="multiple of tile_size"):
        k.block_paged_ptr(8, 0, 4, 0)
    with pytest.raises(IndexError, match="does not own"):
        k.block_paged_ptr(8, 1, 0, 0)  # request 1 has no pages


def test_store_then_load_round_trip(rng):
    c, pages = make_collection(rng)
    before = c.blocks.clone()
    v = c.get_value_cache(0)
    val = torch.randn(4, generator=rng).bfloat16()
    v.store(3, 1, 17, 4, val)
    assert torch.equal(v.load(3, 1, 17, 4, width=4), val)
    changed = (c.blocks != before).nonzero().tolist()
    assert all(idx[:4] == [pages[3][1], 1, 0, 1] and 4 <= idx[5] < 8 for idx in changed)
    with pytest.raises(TypeError, match="dtype"):
        v.store(3, 1, 17, 4, val.float())
    with pytest.raises(IndexError, match="does not own"):
        v.store(1, 0, 0, 0, val[:1])
    with pytest.raises(IndexError, match="head dims"):
        v.store(3, 0, 0, 6, val)


def test_quantized_load_dequantizes_with_granule_scale(rng):
    c, pages = make_collection(rng, scales=True, d=16, gran=8)
    k = c.get_key_cache(2)
    raw = k.load_quantized(0, 1, 5, 8, width=8)
    scale = k.load_scale(0, 1, 5, 8)
    assert torch.equal(scale, c.scales[pages[0][0], 0, 2, 5, 1, 1:2])
    assert torch.allclose(k.load(0, 1, 5, 8, width=8, output_dtype=torch.float32), raw.float() * scale)
    with pytest.raises(TypeError, match="dequantize"):
        k.load(0, 1, 5, 8, width=8)
    with pytest.raises(ValueError, match="straddles"):
        k.load(0, 1, 5, 4, width=8, output_dtype=torch.float32)
    new = torch.tensor([2.0, 3.0])
    k.store_scale(0, 1, 5, 0, new)
    assert torch.equal(k.load_scale(0, 1, 5, 0, width=2), new)
    off = k.scales_block_paged_ptr(0, 5, 1, 8)  # MAX order: (batch, tok, head, dim)
    assert c.scales.flatten()[off] == 3.0


def test_scales_of_adjacent_pages_never_alias(rng):
    """K scales of page b and V scales of page b-1 are distinct elements (the bug MAX's runtime stride avoids)."""
    c, _ = make_collection(rng, scales=True, d=16, gran=8)
    seen = {}
    n, kvd, nl, p, h, g = c.scales.shape
    for layer in range(nl):
        for kv, view in enumerate((c.get_key_cache(layer), c.get_value_cache(layer))):
            base = view.scales.storage_offset()
            st = view.scales.stride()
            for page in range(n):
                for s in range(p):
                    off = base + page * st[0] + s * st[1]
                    assert off not in seen, (seen.get(off), (kv, layer, page, s))
                    seen[off] = (kv, layer, page, s)


@pytest.mark.parametrize(
    "mutate,exc,match",
    [
        (lambda a: a.update(blocks=a["blocks"][..., 0]), ValueError, "blocks must be 6-D"),
        (lambda a: a.update(blocks=a["blocks"].to(torch.int32)), TypeError, "blocks must have dtype"),
        (lambda a: a.update(cache_lengths=a["cache_lengths"].to(torch.int64)), TypeError,
         r"cache_lengths must have dtype torch.uint32 \(MAX's\) or torch.int32, got torch.int64; convert with "
         r"cache_lengths.to\(torch.int32\)"),
        (lambda a: a.update(lookup_table=a["lookup_table"].to(torch.int64)), TypeError, "lookup_table"),
        (lambda a: a.update(lookup_table=a["lookup_table"][:1]), ValueError, "one row per request"),
        (lambda a: a.update(max_cache_length=-1), ValueError, "max_cache_length"),
        (lambda a: a.update(max_cache_length=10**6), ValueError, "max_cache_length"),
        (lambda a: a.update(max_cache_length=5), ValueError, "max_cache_length"),
        (lambda a: a["lookup_table"].__setitem__((0, 0), 99), ValueError, "lookup_table entries"),
        (lambda a: a["lookup_table"].__setitem__((3, 2), 12), ValueError, r"lookup_table\[3, 2\] = 12 names no page"),
    ],
)
def test_constructor_rejects_bad_input(rng, mutate, exc, match):
    c, _ = make_collection(rng)
    args = dict(blocks=c.blocks, cache_lengths=c.cache_lengths, lookup_table=c.lookup_table.clone(),
                max_seq_length=0, max_cache_length=33)
    mutate(args)
    with pytest.raises(exc, match=match):
        PagedKVCacheCollection(**args)


def test_int32_metadata_is_taken_as_its_uint32_bits(rng):
    """Every peer's int32 lengths and tables work as MAX's uint32 ones: the same memory, viewed as uint32."""
    c, _ = make_collection(rng)
    lengths, lut = c.cache_lengths.to(torch.int32), c.lookup_table.to(torch.int32)
    c32 = PagedKVCacheCollection(c.blocks, lengths, lut, 0, 33)
    assert c32.cache_lengths.dtype == c32.lookup_table.dtype == torch.uint32
    assert c32.lookup_table.data_ptr() == lut.data_ptr() and torch.equal(c32.lookup_table, c.lookup_table)
    assert [c32.pages_owned(b) for b in range(c.batch_size)] == [c.pages_owned(b) for b in range(c.batch_size)]
    lut[2, 5] = -1  # a peer's padding: reported as the negative int32 it is, not as its uint32 bits
    with pytest.raises(ValueError, match=r"lookup_table\[2, 5\] is -1: negative; pages are indices >= 0: pad with "
                                         r"the sentinel num_pages \(12\)"):
        PagedKVCacheCollection(c.blocks, lengths, lut, 0, 33)
    lut[2, 5] = c.num_pages
    lengths[1] = -1
    with pytest.raises(ValueError, match=r"cache_lengths\[1\] is -1: negative; .*pass the true lengths"):
        PagedKVCacheCollection(c.blocks, lengths, lut, 0, 33)


def test_check_writable_names_the_request(rng):
    c, _ = make_collection(rng)
    c.check_writable("k", torch.tensor([12, 0, 15, 15]))  # fits the pages each request owns
    with pytest.raises(ValueError, match=r"request 1 needs positions \[0, 1\)"):
        c.check_writable("k", torch.tensor([0, 1, 0, 0]))


def test_allocate_from_params():
    q = KVCacheQuantizationConfig(quantization_granularity=32)
    p = KVCacheParams(torch.float8_e4m3fn, 4, 64, page_size=16, total_num_layers=2, kvcache_quant_config=q)
    blocks, scales = PagedKVCacheCollection.allocate_blocks(p, 5)
    assert list(blocks.shape) == [5, 2, 2, 16, 4, 64] and blocks.dtype == torch.float8_e4m3fn
    assert list(scales.shape) == [5, 2, 2, 16, 4, 2] and scales.dtype == torch.float32
    c = PagedKVCacheCollection(blocks, torch.zeros(1, dtype=torch.uint32),
                               make_lookup_table([[]], 5), 0, 0, scales)
    assert c.quantization_granularity == 32 and c.head_dim_granularity == 2
