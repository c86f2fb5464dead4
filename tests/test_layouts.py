"""``cute_kv.layouts``: the CuTe layouts, evaluated on the CPU, equal torch's views of a collection."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

from cute_kv import (
    KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheCollection, make_lookup_table, max_lengths,
)
from cute_kv import layouts
from cute_kv.layouts import host

pytestmark = pytest.mark.compile

SETTINGS = settings(max_examples=20, deadline=None)


@st.composite
def caches(draw):
    """A small collection (MHA or MLA, maybe fp8 with scales) with a shuffled, ragged lookup table."""
    mla = draw(st.booleans())
    quantized = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 64, 128]))
    heads = 1 if mla else draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([64, 576] if mla else [32, 64, 128]))
    quant = None
    if quantized:
        gran = draw(st.sampled_from([g for g in (16, 32, 64, 128) if head_dim % g == 0]))
        quant = KVCacheQuantizationConfig(scale_dtype=torch.float32, quantization_granularity=gran)
    params = KVCacheParams(torch.float8_e4m3fn if quantized else torch.bfloat16, heads, head_dim,
                           page_size=page_size, total_num_layers=draw(st.integers(1, 4)), is_mla=mla,
                           kvcache_quant_config=quant)
    lengths = draw(st.lists(st.sampled_from([0, 1, 2, page_size - 1, page_size, page_size + 1, 2 * page_size + 3]),
                            min_size=1, max_size=3))
    pages_needed = [-(-n // page_size) for n in lengths]
    num_pages = sum(pages_needed) + draw(st.integers(1, 3))
    perm = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(num_pages).tolist()
    page_lists, start = [], 0
    for k in pages_needed:
        page_lists.append(perm[start:start + k])
        start += k
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, num_pages, zero=False)
    max_seq, max_cache = max_lengths([0] * len(lengths), lengths)
    return PagedKVCacheCollection(
        blocks, torch.tensor(lengths, dtype=torch.uint32), make_lookup_table(page_lists, sentinel=num_pages),
        max_seq, max_cache, scales, quantization_granularity=quant and quant.quantization_granularity)


def torch_offsets(t: torch.Tensor, coords: np.ndarray) -> np.ndarray:
    """Storage offsets of ``t[coords]`` from torch's own strides and storage offset."""
    return t.storage_offset() + coords.astype(np.int64) @ np.array(t.stride(), np.int64)


def random_coords(rng: np.random.Generator, shape, n: int = 24) -> np.ndarray:
    return np.stack([rng.integers(0, e, size=n) for e in shape], axis=1)


def views(c: PagedKVCacheCollection, scales: bool):
    """``(cache_shape, kv, layer, {view: torch tensor})`` for every (kv, layer) plane of blocks or scales."""
    full = c.scales if scales else c.blocks
    for kv in range(c.kv_dim):
        for layer in range(c.num_layers):
            plane = c._get_cache(kv, layer)
            p = plane.scales if scales else plane.blocks
            rows = plane.scales_row_view() if scales else plane.row_view()
            yield tuple(full.shape), kv, layer, {
                "cache": full, "plane": p, "row_view": rows, "tma_page_view": p.permute(1, 3, 2, 0)}


def layout_str(t: torch.Tensor) -> str:
    return f"({','.join(map(str, t.shape))}):({','.join(map(str, t.stride()))})"


@SETTINGS
@given(c=caches(), seed=st.integers(0, 2**32 - 1))
def test_views_match_torch_strides_and_offsets(c, seed):
    rng = np.random.default_rng(seed)
    for scales in ([False, True] if c.quantization_enabled else [False]):
        for shape, kv, layer, tviews in views(c, scales):
            for name, t in tviews.items():
                assert layouts.view_shape(name, shape, kv, layer) == tuple(t.shape), name
                coords = random_coords(rng, t.shape)
                got = layouts.offsets(name, shape, coords, kv, layer)
                np.testing.assert_array_equal(got, torch_offsets(t, coords), err_msg=name)
                np.testing.assert_array_equal(layouts.coordinates(name, shape, got, kv, layer), coords, err_msg=name)


@SETTINGS
@given(c=caches(), seed=st.integers(0, 2**32 - 1))
def test_plane_coordinates_reject_other_planes(c, seed):
    """Offsets anywhere in the tensor: a plane claims exactly its own (kv, layer) elements."""
    rng = np.random.default_rng(seed)
    shape = tuple(c.blocks.shape)
    offs = rng.integers(0, c.blocks.numel(), size=64)
    full = np.stack(np.unravel_index(offs, shape), axis=1)
    for kv in range(c.kv_dim):
        for layer in range(c.num_layers):
            got = layouts.coordinates("plane", shape, offs, kv, layer)
            mine = (full[:, 1] == kv) & (full[:, 2] == layer)
            np.testing.assert_array_equal(got[mine], full[mine][:, [0, 3, 4, 5]])
            assert (got[~mine] == -1).all()


@SETTINGS
@given(c=caches())
def test_token_rows_match_row_idx(c):
    """``(LUT[b, t // P], t % P)`` through the token-row layout is ``row_idx(b, t)`` for every cached token."""
    shape = tuple(c.blocks.shape)
    lut = c.lookup_table.to(torch.int64)
    p = c.page_size
    for b, n in enumerate(c.cache_lengths.tolist()):
        t = torch.arange(n)
        coords = np.stack([lut[b, t // p].numpy(), (t % p).numpy()], axis=1).reshape(-1, 2)
        rows = layouts.offsets("token_row", shape, coords)
        for plane in (c.get_key_cache(c.num_layers - 1), c._get_cache(c.kv_dim - 1, 0)):
            np.testing.assert_array_equal(rows, [plane.row_idx(b, i) for i in range(n)])
            np.testing.assert_array_equal(rows, plane.token_rows(b, t).numpy())
        np.testing.assert_array_equal(layouts.coordinates("token_row", shape, rows), coords)
    plane = c.get_key_cache(0)
    assert layouts.view_shape("row_view", shape) == (plane.num_kv_rows(), c.num_heads, c.head_size)
    # Rows between one plane's pages (other layers / V) are no (page, slot).
    rows = np.arange(plane.num_kv_rows())
    got = layouts.coordinates("token_row", shape, rows)
    inside = rows % plane.stride_rows < p
    np.testing.assert_array_equal(got[inside], np.stack([rows[inside] // plane.stride_rows, rows[inside] % p], 1))
    assert (got[~inside] == -1).all()


def plane_offsets(view, shape, kv, layer, page) -> np.ndarray:
    """Offsets of every (slot, head, dim) of ``page`` in plane (kv, layer), from the CuTe layout."""
    n, _, _, p, h, d = shape
    grid = np.stack(np.meshgrid(np.arange(p), np.arange(h), np.arange(d), indexing="ij"), -1).reshape(-1, 3)
    return view(np.concatenate([np.full((grid.shape[0], 1), page), grid], axis=1), kv, layer)


def assert_no_k_v_alias(shape, view):
    """K of page b and V of page b-1 share no offset, for every layer."""
    for layer in range(shape[2]):
        for b in range(1, shape[0]):
            k = plane_offsets(view, shape, 0, layer, b)
            v = plane_offsets(view, shape, 1, layer, b - 1)
            assert not np.intersect1d(k, v).size, (layer, b)


@pytest.mark.parametrize("gran", [16, 64])
def test_k_scales_never_alias_v_scales_of_previous_page(gran):
    params = KVCacheParams(torch.float8_e4m3fn, 2, 64, page_size=16, total_num_layers=3,
                           kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=gran))
    _, scales = PagedKVCacheCollection.allocate_blocks(params, 4)
    shape = tuple(scales.shape)
    assert_no_k_v_alias(shape, lambda crd, kv, layer: layouts.offsets("plane", shape, crd, kv, layer))
    # Stronger: the planes tile the tensor, every (kv, layer, page, slot, head, granule) its own offset.
    everything = np.concatenate([
        plane_offsets(lambda crd, kv, layer: layouts.offsets("plane", shape, crd, kv, layer), shape, kv, layer, n)
        for kv in range(2) for layer in range(3) for n in range(4)])
    np.testing.assert_array_equal(np.sort(everything), np.arange(scales.numel()))


def test_packed_page_pitch_would_alias():
    """The check above can fail: MAX's old compile-time ``P*H*G`` pitch makes K of page b hit V of page b-1."""
    n, kvd, nl, p, h, g = shape = (4, 2, 1, 16, 2, 1)
    base = torch.empty(shape, dtype=torch.float32)

    def packed(crd, kv, layer):
        t = base.as_strided((n, p, h, g), (p * h * g, h * g, g, 1), (kv * nl + layer) * p * h * g)
        return torch_offsets(t, crd)

    with pytest.raises(AssertionError):
        assert_no_k_v_alias(shape, packed)


def meta_collection(params: KVCacheParams, num_pages: int) -> PagedKVCacheCollection:
    """Shapes and strides of any size, nothing allocated."""
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, num_pages, device="meta")
    return PagedKVCacheCollection(blocks, torch.zeros(1, dtype=torch.uint32, device="meta"),
                                  torch.zeros(1, 8, dtype=torch.uint32, device="meta"), 0, 0, scales, validate=False)


def test_layout_strings_match_torch():
    c = meta_collection(KVCacheParams(torch.bfloat16, 4, 64, page_size=16, total_num_layers=3), 5)
    v = c.get_value_cache(2)
    s = layouts.layout_strings(c.blocks.shape, 1, 2)
    assert s["cache"] == layout_str(c.blocks)
    assert s["plane"] == layout_str(v.blocks) and int(s["plane_offset"]) == v.blocks.storage_offset()
    assert s["row_view"] == layout_str(v.row_view())
    assert s["tma_page_view"] == layout_str(v.blocks.permute(1, 3, 2, 0))
    assert s["token_row"] == f"(5,16):({v.stride_rows},1)"
    # What a kernel sees: N and L (hence every pitch) runtime and 64-bit, KVD/P/H/D compile-time.
    k = layouts.layout_strings(c.blocks.shape, 1, 2, kernel=True)
    assert k["cache"].startswith("(?{i64},2,?{i64},16,4,64):(?{i64") and k["cache"].endswith(",256,64,1)")
    assert k["plane"].startswith("(?{i64},16,4,64):(?{i64") and k["plane_offset"].startswith("?")
    assert k["tma_page_view"].startswith("(16,64,4,?{i64}):(256,1,64,?{i64")


def test_offsets_past_int32():
    """A Llama-3-8B geometry with 3M pages: offsets and rows beyond 2**31 stay exact (int64)."""
    c = meta_collection(KVCacheParams(torch.bfloat16, 8, 128, page_size=16, total_num_layers=32), 3_000_000)
    blocks, shape = c.blocks, tuple(c.blocks.shape)
    coords = np.array([[2_999_999, 1, 31, 15, 7, 127], [1_234_567, 0, 17, 3, 2, 5]])
    got = layouts.offsets("cache", shape, coords)
    np.testing.assert_array_equal(got, torch_offsets(blocks, coords))
    assert got[0] == blocks.numel() - 1 > 2**33
    np.testing.assert_array_equal(layouts.coordinates("cache", shape, got), coords)
    rows = layouts.offsets("token_row", shape, [[2_999_999, 15]])
    assert rows[0] == c.get_value_cache(5).get_tma_row(2_999_999 * 16 + 15) > 2**31


@cute.jit
def last_element_i32(num_pages: Int32, num_layers: Int32, out: cute.Tensor):
    """Builders traced with Int32 runtime N and L, as a kernel taking ``Int32`` arguments would."""
    cache = layouts.cache_layout(num_pages, 2, num_layers, 16, 8, 128)
    out[0] = cache((num_pages - 1, 1, num_layers - 1, 15, 7, 127))
    out[1] = layouts.num_kv_rows(num_pages, 2, num_layers, 16)


def test_int32_extents_are_widened():
    c = meta_collection(KVCacheParams(torch.bfloat16, 8, 128, page_size=16, total_num_layers=32), 3_000_000)
    out = np.zeros(2, np.int64)
    last_element_i32(Int32(c.num_pages), Int32(c.num_layers), from_dlpack(out))
    assert out.tolist() == [c.blocks.numel() - 1, c.get_key_cache(0).num_kv_rows()]


def test_probes_compile_once(monkeypatch):
    shape = (3, 2, 2, 16, 2, 32)
    for view in layouts.VIEWS:  # warm every probe
        origin = np.zeros((1, len(layouts.view_shape(view, shape))), int)
        layouts.coordinates(view, shape, layouts.offsets(view, shape, origin))

    def no_compile(*a, **k):
        raise AssertionError("recompiled")

    monkeypatch.setattr(host.cute, "compile", no_compile)
    other = (7, 1, 5, 64, 1, 576)  # another geometry, kv/layer: same compiled probes
    for view in layouts.VIEWS:
        crd = random_coords(np.random.default_rng(1), layouts.view_shape(view, other, 0, 4), 5)
        offs = layouts.offsets(view, other, crd, 0, 4)
        np.testing.assert_array_equal(layouts.coordinates(view, other, offs, 0, 4), crd)


@pytest.mark.parametrize("call, match", [
    (lambda: layouts.offsets("pages", (2, 2, 1, 16, 1, 8), [[0, 0, 0, 0]]), "view must be one of"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1), [[0, 0, 0, 0]]), "cache_shape"),
    (lambda: layouts.offsets("plane", (2, 2, 0, 16, 1, 8), [[0, 0, 0, 0]]), "cache_shape"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0, 0, 0, 0]], kv_idx=2), "kv_idx"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0, 0, 0, 0]], layer_idx=1), "layer_idx"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0, 0, 0]]), "coords must be"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0.5, 0, 0, 0]]), "coords must be"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0, 0, 0, 0], [2, 0, 0, 0]]), r"coords\[1\]"),
    (lambda: layouts.offsets("plane", (2, 2, 1, 16, 1, 8), [[0, -1, 0, 0]]), r"coords\[0\]"),
    (lambda: layouts.coordinates("cache", (2, 2, 1, 16, 1, 8), [3, -1]), "offsets must be in"),
    (lambda: layouts.coordinates("cache", (2, 2, 1, 16, 1, 8), [[3]]), "offsets must be a 1-D"),
])
def test_bad_arguments_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_empty_batches():
    shape = (2, 2, 1, 16, 1, 8)
    assert layouts.offsets("plane", shape, np.zeros((0, 4), int)).shape == (0,)
    assert layouts.coordinates("plane", shape, np.zeros(0, int)).shape == (0, 4)
    assert math.prod(layouts.view_shape("cache", shape)) == math.prod(shape)
