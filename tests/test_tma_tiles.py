"""TMA descriptor builders (``kernels/paged/tma_tiles.py``) and device ``populate``, through the probe kernels.

Compile (both archs; gather4 on sm_100a only): each descriptor issues the TMA instructions it should, with the
box count its geometry implies. GPU: the paged-tile and ragged round trips are exact.
"""

import functools
import math
import re
import sys
from pathlib import Path

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack

import artifacts

from cute_kv.kernels import compile_cache
from cute_kv.kernels.paged import tma_tiles
from cute_kv.kernels.paged.tma_tiles import padded_depth, swizzle_granularity
from cute_kv.reference.batch import random_paged_batch
from cute_kv.row_indices import lut_chunk, tile_geometry

sys.path.insert(0, str(Path(__file__).parent))
from tma_probes import Gather4Probe, PagedTileProbe, RaggedProbe, ScaleProbe  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")
BF16, FP16, FP8 = cutlass.BFloat16, cutlass.Float16, cutlass.Float8E4M3FN


def _ptx(probe, arch):
    return artifacts.compiled(probe, arch).ptx


def _count(pattern, ptx):
    return len(re.findall(pattern, ptx))


def test_padded_depth():
    assert swizzle_granularity(BF16, 128) == 64 and swizzle_granularity(FP8, 64) == 64
    assert padded_depth(BF16, 128, 128) == 128 and padded_depth(BF16, 128, 80) == 128
    assert padded_depth(FP8, 64, 512) == 512 and padded_depth(BF16, 0, 20) == 24


TILE_CASES = [  # (dtype, KVD, P, H, D, BN, base_alignment)
    (BF16, 2, 16, 8, 128, 128, 128),  # 8 pages per tile: lookup entries read as one 32-byte vector
    (BF16, 2, 256, 2, 64, 128, 128),  # page larger than the tile: one copy at an in-page offset
    (FP16, 1, 64, 1, 128, 128, 64),  # 2 pages, alignment one page: scalar lookup loads
    (BF16, 2, 128, 4, 256, 128, 128),  # one page per tile, 4 depth boxes
]


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", TILE_CASES, ids=lambda c: "-".join(map(str, c[1:])))
def test_paged_tile_ptx(arch, case):
    dtype, kvd, p, h, d, bn, align = case
    ptx = _ptx(PagedTileProbe(*case), arch)
    eff_page, num_pages = tile_geometry(bn, p)
    boxes = num_pages * math.ceil(d / swizzle_granularity(dtype, 128))  # one box per page slot per 128 B of depth
    rank = 2 if h == 1 else 3  # extent-1 modes fold out of the descriptor
    assert _count(rf"cp\.async\.bulk\.tensor\.{rank}d\.shared::cta\.global\.tile\.mbarrier", ptx) == boxes
    chunk = lut_chunk(num_pages, align, p) if num_pages > 1 else 1
    vector = {1: r"ld\.global\.(?:nc\.)?[bu]32", 2: r"ld\.global\.v2\.b32", 4: r"ld\.global\.v4\.b32",
              8: r"ld\.global\.(?:v8\.b32|v4\.b32)"}[chunk]
    assert _count(vector, ptx) >= num_pages // chunk  # populate: aligned vector loads of the lookup table


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_rope_tile_ptx(arch):
    # DeepSeek rope-aware FP8 rows: 512 fp8 content bytes then 64 bf16 rope values (640 bytes).
    ptx = _ptx(PagedTileProbe(FP8, 1, 64, 1, 640, 128, 128, rope=(512, 64)), arch)
    assert _count(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile\.mbarrier", ptx) == 2  # 128 B per page
    with pytest.raises(ValueError, match="head_size = 512"):
        _ptx(PagedTileProbe(FP8, 1, 64, 1, 576, 128, 128, rope=(512, 64)), arch)


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_tile_ptx(arch):
    ptx = _ptx(RaggedProbe(BF16, 2, 128, 64), arch)
    # [2^30, D, H, 2^31-1]: a 4-D descriptor; 128 bf16 of depth = two 128-byte boxes each way.
    assert _count(r"cp\.async\.bulk\.tensor\.4d\.shared::cta\.global", ptx) == 2
    assert _count(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta", ptx) == 2


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
def test_scale_tile_ptx(arch):
    ptx = _ptx(ScaleProbe(2, 16, 8, 1, 128), arch)
    assert _count(r"cp\.async\.bulk\.tensor\.1d\.shared::cta\.global", ptx) == 8  # one per page slot


@pytest.mark.compile
@pytest.mark.parametrize("rope", [None, (512, 64)])
def test_gather4_ptx(rope):
    probe = Gather4Probe(BF16, 2, 16, 8, 128, 64) if rope is None else Gather4Probe(FP8, 1, 64, 1, 640, 64, rope=rope)
    ptx = _ptx(probe, "sm_100a")
    g4 = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\S*\s+\[([^\]]*)\]", ptx)
    assert len(g4) == 64 // 4  # four rows per instruction
    assert len(set(g4)) == len(g4)  # every instruction fills its own four smem rows
    with pytest.raises(Exception):
        _ptx(probe, "sm_90a")  # gather4 is SM100+


@cute.jit
def _plane_rows_probe(plane: cute.Tensor, layer: Int32, coords: cute.Tensor, out: cute.Tensor, meta: cute.Tensor,
                      count: Int32):
    """On the CPU: ``plane_row_view(plane, layer)``'s element at each ``(row, h, d)`` of ``coords``, its row count
    and ``plane_rows_per_page``."""
    rows = tma_tiles.plane_row_view(plane, layer)
    meta[0] = rows.shape[0]
    meta[1] = tma_tiles.plane_rows_per_page(plane)
    for i in cutlass.range(count, unroll=1):
        out[i] = rows[coords[i, 0], coords[i, 1], coords[i, 2]]


def _dynamic(t: torch.Tensor):
    return from_dlpack(t).mark_layout_dynamic(leading_dim=t.ndim - 1)


@functools.cache
def _plane_rows():
    """One compile serves every plane: extents and strides are runtime values."""
    plane, table, vector = (torch.zeros(shape, dtype=torch.int32) for shape in ((1, 1, 1, 1, 1), (1, 3), (2,)))
    return cute.compile(_plane_rows_probe, _dynamic(plane), Int32(0), _dynamic(table), _dynamic(vector),
                        _dynamic(vector), Int32(1))


def _planes(layout: str, n: int, nl: int, p: int, h: int, d: int) -> list[torch.Tensor]:
    """The K and V planes ``[N, L, P, H, D]`` of a cache of distinct int32 values in ``layout``."""
    values = lambda *shape: torch.arange(math.prod(shape), dtype=torch.int32).reshape(shape)  # noqa: E731
    if layout == "max":
        blocks = values(n, 2, nl, p, h, d)
        return [blocks[:, 0], blocks[:, 1]]
    if layout == "padded":  # MAX's blocks, each head's row 4 values wider
        blocks = values(n, 2, nl, p, h, d + 4)[..., :d]
        return [blocks[:, 0], blocks[:, 1]]
    if layout == "vllm":  # [2, N, P, H, D], one layer
        kv = values(2, n, p, h, d)
        return [kv[0].unsqueeze(1), kv[1].unsqueeze(1)]
    if layout == "nhd":  # FlashInfer [N, 2, P, H, D]
        t = values(n, 2, p, h, d)
        return [t[:, 0].unsqueeze(1), t[:, 1].unsqueeze(1)]
    assert layout == "hnd"  # FlashInfer [N, 2, H, P, D]
    t = values(n, 2, h, p, d)
    return [t[:, i].transpose(1, 2).unsqueeze(1) for i in (0, 1)]


@pytest.mark.parametrize("layout", ["max", "padded", "vllm", "nhd", "hnd"])
def test_plane_row_view_on_the_cpu(layout):
    """``plane_row_view`` evaluated on the CPU (the kernels' row view of a strided plane, before TMA sees it): token
    ``slot`` of page ``page``, head ``h``, dim ``d`` of layer ``l`` is row ``page * sN/sP + slot``, every element of
    every plane; the view spans ``(N-1) * sN/sP + P`` rows, ``KVD*L*P`` a page in MAX's layout."""
    n, nl, p, h, d = 3, (2 if layout in ("max", "padded") else 1), 4, 2, 8
    pages, layers, slots, heads, dims = torch.meshgrid(*(torch.arange(x) for x in (n, nl, p, h, d)), indexing="ij")
    for plane in _planes(layout, n, nl, p, h, d):
        pitch = plane.stride(0) // plane.stride(2)
        assert pitch * plane.stride(2) == plane.stride(0)
        if layout == "max":
            assert pitch == 2 * nl * p
        for layer in range(nl):
            at = layers == layer
            coords = torch.stack([pages[at] * pitch + slots[at], heads[at], dims[at]], 1).to(torch.int32)
            out, meta = torch.full((len(coords),), -1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
            _plane_rows()(_dynamic(plane), Int32(layer), _dynamic(coords), _dynamic(out), _dynamic(meta),
                          Int32(len(coords)))
            assert torch.equal(out, plane[:, layer].flatten())
            assert meta.tolist() == [(n - 1) * pitch + p, pitch]


# -- GPU round trips ---------------------------------------------------------------------------------------


def _compiled(probe, key):
    from cute_kv.kernels.compile_cache import target_arch

    return compile_cache.compiled(key, lambda: (probe, *probe.fake_args()), target_arch())


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in TILE_CASES if c[0] is BF16], ids=lambda c: "-".join(map(str, c[1:])))
def test_paged_tile_round_trip(case):
    dtype, kvd, p, h, d, bn, align = case
    lengths = [3 * bn + 5, 1, bn]
    pb = random_paged_batch(lengths, [0] * len(lengths), num_heads=h, head_size=d, page_size=p, num_layers=2,
                            is_mla=kvd == 1, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1),
                            device="cuda")
    c = pb.collection
    tiles = math.ceil(max(lengths) / bn)
    lut = torch.full((c.batch_size, 8 * math.ceil(tiles * bn / p / 8)), c.num_pages, dtype=torch.uint32, device="cuda")
    lut[:, : c.lookup_table.shape[1]] = c.lookup_table
    out = torch.full((c.batch_size, tiles * bn, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    _compiled(PagedTileProbe(*case), ("test_paged_tile", *case[1:]))(c.blocks, lut, out, kvd - 1, 1, tiles)
    torch.cuda.synchronize()
    for b, length in enumerate(lengths):
        want, _ = pb.tokens(kvd - 1, 1, b, 0, length)
        assert torch.equal(out[b, :length], want)
        owned = math.ceil(length / p) * p
        assert bool((out[b, owned:] == 0).all())  # sentinel pages: rows past the cache, zero-filled by TMA


@pytest.mark.gpu
def test_ragged_round_trip():
    from cute_kv.metadata import input_row_offsets

    new = [0, 70, 1, 129, 64]
    x = torch.randn(sum(new), 2, 128, dtype=torch.bfloat16, device="cuda")
    y = torch.full_like(x, float("nan"))
    _compiled(RaggedProbe(BF16, 2, 128, 64), ("test_ragged_tile",))(x, y, input_row_offsets(new, "cuda"),
                                                                    math.ceil(max(new) / 64))
    torch.cuda.synchronize()
    assert torch.equal(y, x)  # every row copied once; rows past a request neither read nor clobbered
