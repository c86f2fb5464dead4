"""``paged_attention``'s host side (no GPU needed): which calls the kernel serves, and how it splits the keys."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from cute_kv.ops.paged_attention import MAX_SPLITS, kernel_key, num_splits
from cute_kv.reference.batch import random_paged_batch

H100_SMS = 132


@given(ctas=st.integers(1, 5000), key_tiles=st.integers(1, 2000), slots=st.sampled_from([78, 132, 264, 296]))
def test_splits_fill_the_gpu_without_thin_splits(ctas, key_tiles, slots):
    s = num_splits(ctas, key_tiles, slots)
    assert 1 <= s <= MAX_SPLITS
    if ctas >= slots or key_tiles < 4:
        assert s == 1  # the grid already fills the GPU, or there is too little to split
    else:
        assert s * 2 <= key_tiles  # every split keeps at least two tiles (the K/V ring's depth)
        assert ctas * s >= slots or s in (MAX_SPLITS, key_tiles // 2)


def test_issue_decode_shapes():
    """32 q / 8 KV heads, 64-key tiles, one 64-row query block per request, 2 CTAs per SM on an H100 (264 slots):
    batch 1 at 16k splits 32 ways (the cap), batch 128 at 4k does not split, batch 8 at 512 keeps two tiles a
    split."""
    assert num_splits(1 * 8, 16384 // 64, 2 * H100_SMS) == MAX_SPLITS
    assert num_splits(128 * 8, 4096 // 64, 2 * H100_SMS) == 1
    assert num_splits(8 * 8, 512 // 64, 2 * H100_SMS) == 4


FP8 = torch.float8_e4m3fn


def _key(cache=None, q_dtype=torch.bfloat16, q_heads=8, arch="sm_90a", **kw):
    args = {"num_heads": 2, "head_size": 128, "page_size": 16, **(cache or {})}
    pb = random_paged_batch([5, 40], [3, 1], generator=torch.Generator().manual_seed(0), **args, **kw)
    q = torch.zeros(pb.total_rows, q_heads, args["head_size"], dtype=q_dtype)
    return kernel_key(pb.collection, q, arch)


def test_kernel_serves_16_bit_and_fp8_caches():
    assert _key() == ("paged_attention", "bfloat16", 8, 2, 128, 16, 2, True, "bfloat16", None, False)
    assert _key({"dtype": torch.float16}, torch.float16, 16)[1:4] == ("float16", 16, 2)
    fp8 = {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 32}
    assert _key(fp8)[8:] == ("float8_e4m3fn", 32, False)
    assert _key({**fp8, "scale_dtype": torch.float8_e8m0fnu})[8:] == ("float8_e4m3fn", 32, True)
    assert _key({"dtype": FP8})[8:] == ("float8_e4m3fn", None, False)  # unscaled: a plain cast
    assert _key({"head_size": 256, "page_size": 128})[4:6] == (256, 128)


@pytest.mark.parametrize("case", [
    {"cache": {"num_heads": 1, "is_mla": True}},
    {"q_dtype": torch.float16},  # q in another dtype than the bf16 cache
    {"q_dtype": torch.float32, "cache": {"dtype": torch.float32}},
    {"cache": {"head_size": 96}},
    {"cache": {"page_size": 8}},
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
    assert c.lookup_table.shape[1] % 8 == 0 and kernel_key(c, q, "sm_90a")[7]
    ragged = c.with_metadata(c.cache_lengths, c.lookup_table[:, :-1], c.max_seq_length, c.max_cache_length)
    assert not kernel_key(ragged, q, "sm_90a")[7]


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("lut_vector", [True, False])
def test_operand_keeps_populates_promises(page_size, lut_vector):
    """Tiles start at multiples of BN, so BN must be a multiple of ``base_alignment`` (else populate drops the
    in-page offset of a tile inside a larger page); a multi-page tile needs it >= P. The lookup table the kernel
    declares (row stride and base) must be exactly as aligned as the vector width populate reads."""
    from cute_kv.kernels.attention.config import BN
    from cute_kv.kernels.attention.operand import KVCacheMHAOperand
    from cute_kv.row_indices import lut_chunk, tile_geometry

    op = KVCacheMHAOperand(0, page_size, BN, lut_vector)
    assert op.bn % op.base_alignment == 0
    if op.copies_per_tile > 1:
        assert op.base_alignment >= page_size
    pages = tile_geometry(BN, page_size)[1]
    assert op.lut_width == (lut_chunk(pages, BN, page_size) if lut_vector else 1)
