"""What the kernels' row accesses accept of a torch tensor as is, and what they get a contiguous copy of."""

import torch

from cute_kv.ops.vectors import heads_packed, packed_heads


def test_heads_packed_takes_contiguous_and_padded_rows():
    x = torch.randn(5, 4, 64)
    assert heads_packed(x, 8) and packed_heads(x, 8) is x
    padded = torch.randn(5, 4 * 64 + 8)[:, : 4 * 64].view(5, 4, 64)  # row pitch past the heads, still aligned
    assert heads_packed(padded, 8)


def test_expanded_or_misaligned_rows_are_copied():
    expanded = torch.randn(1, 4, 64).expand(5, 4, 64)  # stride 0 over tokens: TMA needs distinct rows
    assert not heads_packed(expanded, 8)
    copy = packed_heads(expanded, 8)
    assert copy.stride(0) == 4 * 64 and torch.equal(copy, expanded)
    assert heads_packed(torch.randn(1, 4, 64).expand(1, 4, 64), 8)  # one token: its stride is never used
    assert not heads_packed(torch.randn(5, 4, 64).transpose(0, 1).contiguous().transpose(0, 1), 8)
    assert not heads_packed(torch.randn(5, 4 * 64 + 4)[:, : 4 * 64].view(5, 4, 64), 8)  # rows not 8-aligned
