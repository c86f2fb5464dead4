"""How ``paged_attention`` splits the keys of a step across CTAs (host side, no GPU needed)."""

from hypothesis import given
from hypothesis import strategies as st

from cute_kv.ops.paged_attention import MAX_SPLITS, num_splits

H100_SMS = 132


@given(ctas=st.integers(1, 5000), key_tiles=st.integers(1, 2000), sms=st.sampled_from([78, 114, 132, 148]))
def test_splits_fill_the_gpu_without_thin_splits(ctas, key_tiles, sms):
    s = num_splits(ctas, key_tiles, sms)
    assert 1 <= s <= MAX_SPLITS
    if ctas >= sms or key_tiles < 4:
        assert s == 1  # the grid already covers every SM, or there is too little to split
    else:
        assert s * 2 <= key_tiles  # every split keeps at least two tiles (the K/V ring's depth)
        assert ctas * s >= sms or s in (MAX_SPLITS, key_tiles // 2)


def test_issue_decode_shapes():
    """32 q / 8 KV heads, 128-key tiles, one 64-row query block per request: batch 1 at 16k splits 16 ways, batch
    128 at 4k does not split, batch 8 at 512 keeps two tiles per split."""
    assert num_splits(1 * 8, 16384 // 128, H100_SMS) == 17
    assert num_splits(128 * 8, 4096 // 128, H100_SMS) == 1
    assert num_splits(8 * 8, 512 // 128, H100_SMS) == 2
