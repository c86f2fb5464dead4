"""``paged_attention``'s host side (no GPU needed): which calls the kernel serves, and how it splits the keys."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_kv.collection import PagedKVCacheCollection
from cute_kv.ops.paged_attention import plan
from cute_kv.ops.splits import MAX_GRID_Y, MAX_SPLITS, SPLIT_COST, launch_shape, num_splits
from cute_kv.reference.batch import random_paged_batch

H100_SMS = 132


@given(ctas=st.integers(1, 5000), key_tiles=st.integers(1, 2000), slots=st.sampled_from([78, 132, 264, 296]))
def test_splits_by_wave_quantization(ctas, key_tiles, slots):
    s = num_splits(ctas, key_tiles, slots)
    assert 1 <= s <= MAX_SPLITS
    per = -(-key_tiles // s)
    assert (s - 1) * per < key_tiles  # no split is empty
    if s > 1:
        assert s * 2 <= key_tiles  # every split keeps at least two tiles
    if ctas % slots == 0:
        assert s == 1  # whole waves already: splitting only adds waves

    def cost(n):
        return -(-ctas * n // slots) * (-(-key_tiles // n) + SPLIT_COST)

    # no admissible split count is estimated faster
    assert all(cost(s) <= cost(n) for n in range(1, min(MAX_SPLITS, key_tiles // 2) + 1)
               if (n - 1) * -(-key_tiles // n) < key_tiles)


def test_issue_decode_shapes():
    """32 q / 8 KV heads, 128-key tiles, one 128-row query block per request, one CTA per SM on an H100 (132
    slots): batch 1 at 16k splits 16 ways (8 x 16 CTAs make one wave), batch 128 at 4k does not split, batch 8 at 2k
    splits until the wave is full."""
    assert num_splits(1 * 8, 16384 // 128, H100_SMS) == 16
    assert num_splits(128 * 8, 4096 // 128, H100_SMS) == 1
    assert num_splits(8 * 8, 2048 // 128, H100_SMS) == 2


def test_causal_prefill_of_several_blocks_does_not_split():
    pb = random_paged_batch([4000], [300], num_heads=2, head_size=128, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    assert launch_shape(pb.collection, 8, H100_SMS, 128, 128, causal=True, num_tokens=300) == (10, 1)
    m_blocks, splits = launch_shape(pb.collection, 8, H100_SMS, 128, 128, causal=False, num_tokens=300)
    assert m_blocks == 10 and splits > 1



def test_window_bounds_the_splits():
    """A 32k-key decode under a 128-key window sees two tiles per block: it is not split the many ways the context
    length alone would say (all but one or two splits empty, and a combine over all of them); no split is empty."""
    gen = torch.Generator().manual_seed(1)
    pb = random_paged_batch([32000], [1], num_heads=1, head_size=64, page_size=128, generator=gen)
    assert launch_shape(pb.collection, 8, H100_SMS, 128, 128, causal=True, num_tokens=1)[1] >= 16
    for window in (128, 1000):
        m_blocks, splits = launch_shape(pb.collection, 8, H100_SMS, 128, 128, causal=True, window=window, num_tokens=1)
        tiles = 32000 // 128 - (32000 - window + 1) // 128 + 1  # the tiles the one block sees
        assert m_blocks == 1 and 1 <= splits and (splits - 1) * -(-tiles // splits) < tiles  # none empty


def test_more_requests_than_the_grid_holds_run_the_reference():
    """The kernels' grid has one z index per request and CUDA allows 65535: a larger batch would fail at launch."""
    from unittest import mock

    pb = random_paged_batch([5, 40], [3, 1], num_heads=2, head_size=128, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    q = torch.zeros(pb.total_rows, 8, 128, dtype=torch.bfloat16)
    assert plan(pb.collection, q, "sm_90a").path == "kernel"
    for batch, path in ((65535, "kernel"), (65536, "reference")):
        with mock.patch.object(type(pb.collection), "batch_size", new_callable=mock.PropertyMock, return_value=batch):
            for arch in ("sm_90a", "sm_100a"):
                got = plan(pb.collection, q, arch)
                assert got.path == path and (path == "kernel" or "65535" in got.reason)

def _wide_cache(num_heads: int, head_size: int, max_cache_length: int, max_seq_length: int = 1,
                kv_dim: int = 2) -> PagedKVCacheCollection:
    """One request over one page of 16 tokens (its lookup table names it for every column: the plans and launch
    shapes read no page) and ``num_heads`` heads; ``blocks`` is left unwritten."""
    blocks = torch.empty((1, kv_dim, 1, 16, num_heads, head_size), dtype=torch.bfloat16)
    lut = torch.zeros((1, -(-max_cache_length // 16)), dtype=torch.int32)
    return PagedKVCacheCollection(blocks, torch.tensor([max_cache_length - 1], dtype=torch.int32), lut,
                                  max_seq_length, max_cache_length)


def test_splits_keep_the_grid_y_within_cuda():
    """The grid's y dimension is KV heads x splits: 4096 KV heads on a GPU of many slots split their 32 key tiles
    at most 15 ways (16 would make a y of 65536)."""
    c = _wide_cache(4096, 64, 32 * 128)
    m_blocks, splits = launch_shape(c, 4096, 10**6, 128, 128, True, None, num_tokens=1)
    assert m_blocks == 1 and 1 < splits and 4096 * splits <= MAX_GRID_Y
    assert num_splits(4096, 32, 10**6) == 16  # what the wave model alone picks


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_grids_past_cuda_limits_run_the_reference(arch):
    """More KV heads than the grid's y dimension holds, or (a loose ``max_seq_length`` and 2^31 tokens) more query
    blocks than its x dimension holds: the plans take the reference, with the reason, before any launch."""
    heads = _wide_cache(MAX_GRID_Y + 1, 64, 16)
    got = plan(heads, torch.empty((1, MAX_GRID_Y + 1, 64), dtype=torch.bfloat16), arch)
    assert got.path == "reference" and f"{MAX_GRID_Y + 1} KV heads exceed the kernels' grid" in got.reason
    for kv_dim, head_size, kw in ((2, 128, {}), (1, 576, {"mla_v_dim": 512})):  # MHA (groups of 128), MLA
        c = _wide_cache(1, head_size, 16, 2**32 - 1, kv_dim)
        q = torch.zeros((1, 128, head_size), dtype=torch.bfloat16)
        assert plan(c, q, arch, **kw).path == "kernel"
        got = plan(c, q.expand(2**31, -1, -1), arch, **kw)  # the plans read q's shape only
        assert got.path == "reference" and "query blocks per request exceed the kernels' grid" in got.reason


FP8 = torch.float8_e4m3fn


def _key(cache=None, q_dtype=torch.bfloat16, q_heads=8, arch="sm_90a", features=(), **kw):
    args = {"num_heads": 2, "head_size": 128, "page_size": 16, **(cache or {})}
    pb = random_paged_batch([5, 40], [3, 1], generator=torch.Generator().manual_seed(0), **args, **kw)
    q = torch.zeros(pb.total_rows, q_heads, args["head_size"], dtype=q_dtype)
    softcap, sinks, return_lse = (tuple(features) + (False,) * 3)[:3]
    return plan(pb.collection, q, arch, None, 30.0 if softcap else None, torch.zeros(q_heads) if sinks else None,
                return_lse).key


def test_kernel_serves_16_bit_and_fp8_caches():
    assert _key() == ("paged_attention", "bfloat16", 8, 2, 128, 16, 2, True, False, False, False, None, None, False)
    assert _key(features=(True, True, True))[8:11] == (True, True, True)  # soft-cap, sinks, lse
    assert _key({"dtype": torch.float16}, torch.float16, 16)[1:4] == ("float16", 16, 2)
    fp8 = {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 32}
    assert _key(fp8)[11:] == ("float8_e4m3fn", 32, False)
    assert _key({**fp8, "scale_dtype": torch.float8_e8m0fnu})[11:] == ("float8_e4m3fn", 32, True)
    assert _key({"dtype": FP8})[11:] == ("float8_e4m3fn", None, False)  # unscaled: a plain cast
    assert _key({"dtype": FP8}, features=(True, True, True))[8:11] == (True, True, True)
    assert _key({"head_size": 256, "page_size": 128})[4:6] == (256, 128)
    for page_size in (1, 2, 4, 8, 24):  # rows gathered by cp.async: one lookup entry a key, no vector reads
        assert _key({"page_size": page_size})[5:8] == (page_size, 2, False)


@pytest.mark.parametrize("case", [
    {"cache": {"num_heads": 1, "is_mla": True}},
    {"q_dtype": torch.float16},  # q in another dtype than the bf16 cache
    {"q_dtype": torch.float32, "cache": {"dtype": torch.float32}},
    {"cache": {"head_size": 112}},
    {"cache": {"page_size": 8, "dtype": FP8}},  # (16-bit pages of 8 are gathered)
    {"cache": {"page_size": 8, "head_size": 80}},  # (gathered only at GATHER_HEAD_DIMS)
    {"cache": {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 4}},
    {"q_heads": 3},
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_reference_serves_what_the_kernel_cannot(case):
    assert _key(**case) is None


def test_lookup_vectors_need_a_padded_table():
    """An 8-page tile reads its 8 entries as two 16-byte vectors only if every row is 8-aligned and padded."""
    pb = random_paged_batch([5, 40], [3, 1], num_heads=2, head_size=128, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    c = pb.collection
    q = torch.zeros(pb.total_rows, 8, 128, dtype=torch.bfloat16)
    assert c.lookup_table.shape[1] % 8 == 0 and plan(c, q, "sm_90a").key[7]
    ragged = c.with_metadata(c.cache_lengths, c.lookup_table[:, :-1], c.max_seq_length, c.max_cache_length)
    assert not plan(ragged, q, "sm_90a").key[7]


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("lut_vector", [True, False])
@pytest.mark.parametrize("bn", [64, 128])
def test_operand_keeps_populates_promises(page_size, lut_vector, bn):
    """Tiles start at multiples of BN, so BN must be a multiple of ``base_alignment`` (else populate drops the
    in-page offset of a tile inside a larger page); a multi-page tile needs it >= P. The lookup table the kernel
    declares (row stride and base) must be exactly as aligned as the vector width populate reads."""
    from cute_kv.kernels.attention.operand import KVCacheMHAOperand
    from cute_kv.row_indices import lut_chunk, tile_geometry

    op = KVCacheMHAOperand(0, page_size, bn, lut_vector)
    assert op.bn % op.base_alignment == 0
    if op.copies_per_tile > 1:
        assert op.base_alignment >= page_size
    pages = tile_geometry(bn, page_size)[1]
    assert op.lut_width == (lut_chunk(pages, bn, page_size) if lut_vector else 1)


def test_index_limits_bound_what_the_kernel_indexes():
    """Row coordinates of a plane, and the zero-filled row one past them, are int32; key positions too. Scales are
    indexed in 64 bits, so an fp8 cache whose ``rows * H * G`` passes 2^31 still takes the kernel."""
    from cute_kv.kernels.attention.config import index_limits

    kvd, layers, p = 2, 32, 16
    pitch = kvd * layers * p
    fits = (2**31 - 1 - p) // pitch + 1  # the most pages whose last row is < 2^31 - 1
    assert (fits - 1) * pitch + p <= 2**31 - 1 < fits * pitch + p
    assert index_limits(fits, pitch, p, 4096) is None
    assert "int32 TMA coordinates" in index_limits(fits + 1, pitch, p, 4096)
    assert "max_cache_length" in index_limits(8, pitch, p, 2**31 - 1)
    assert ((fits - 1) * pitch + p) * 8 * 8 > 2**31  # H=8, G=8 scales per row: past int32, served (64-bit index)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_plan_bounds_rows_by_the_layouts_own_pitch(arch):
    """A FlashInfer HND cache's row pitch is ``2*H*P`` token rows (a page holds K and V of every head), not MAX's
    ``KVD*L*P``: pages that fit int32 rows under MAX's pitch overflow under the layout's, and take the reference."""
    from cute_kv.kv_layout import engine_kv

    h, p, d = 8, 16, 128
    n = (2**31 - 1 - p) // (2 * h * p) + 2
    assert (n - 1) * 2 * p + p < 2**31 - 1  # MAX's pitch would fit
    k, v = engine_kv("flashinfer-hnd", n, p, h, d, torch.bfloat16, "meta")
    meta = dict(device="meta", dtype=torch.int32)
    c = PagedKVCacheCollection.from_kv(k, v, torch.zeros(2, **meta), torch.zeros(2, 4, **meta), 1, 64,
                                       validate=False)
    assert c.row_pitch == 2 * h * p
    got = plan(c, torch.empty(2, 4 * h, d, dtype=torch.bfloat16, device="meta"), arch)  # the plans read shapes
    assert got.path == "reference" and "int32 TMA coordinates" in got.reason, got
