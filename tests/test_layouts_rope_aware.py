"""``cute_kv.layouts.rope_aware``: the content, rope and scale layouts of a rope-aware plane, evaluated on the CPU,
address the bytes torch's views of the collection hold."""

import pytest
import torch

from cute_kv.layouts import rope_aware
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("head_size,rope_dim,layer", [(640, 64, 1), (96, 16, 0), (192, 32, 2)])
def test_views_address_the_collection_bytes(rng, head_size, rope_dim, layer):
    pb = random_paged_batch([20, 3], [2, 1], num_heads=1, head_size=head_size, page_size=16, generator=rng,
                            num_layers=3, is_mla=True, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                            rope_dim=rope_dim)
    c = pb.collection
    cache = c.get_key_cache(layer)
    pd, rows = c.padded_depth, cache.num_kv_rows()
    row = torch.randint(0, rows, (12,), generator=rng).tolist()
    col = torch.randint(0, pd, (12,), generator=rng).tolist()
    rcol = torch.randint(0, rope_dim, (12,), generator=rng).tolist()
    got = rope_aware.describe(c.num_pages, c.num_layers, c.page_size, pd, rope_dim,
                              {"content": list(zip(row, col)), "rope": list(zip(row, rcol)),
                               "scales": [(r,) for r in row]})
    row_bytes = pd + 2 * rope_dim
    assert got["content"].endswith(f":({row_bytes},1)") and got["rope"].endswith(f":({row_bytes // 2},1)")
    flat = _raw(c.blocks).flatten()
    base = cache.base_offset  # fp8: elements are bytes
    view = _raw(cache.row_view())
    scales = c.scales.flatten()
    for i, (r, j, k) in enumerate(zip(row, col, rcol)):
        assert flat[base + got["content_bytes"][i]] == view[r, 0, j]
        off = base + got["rope_bytes"][i]
        assert torch.equal(flat[off:off + 2].view(torch.bfloat16), c.row_format.rope(view[r, 0])[k:k + 1])
        assert got["rope_bytes"][i] == r * row_bytes + pd + 2 * k  # the byte MAX's rope tile starts from: pd
        assert scales[cache.scales_base_offset + got["scales_bytes"][i] // 4] == cache.scales_row_view()[r, 0, 0]
