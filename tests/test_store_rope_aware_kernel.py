"""``RopeAwareKVStore``: compiles for sm_90a / sm_100a with the instruction mix it claims (``compile``), its plan, and
bit-exact against the reference store on a GPU (``gpu``)."""

import pytest
import torch

import artifacts

import cute_kv
from cute_kv import reference as ref
from cute_kv.kernels.catalog import ARCHS, STORE_ROPE_AWARE_CASES
from cute_kv.kernels.cache.store_rope_aware import ROWS_PER_WARP, RopeAwareKVStore
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import bits
from test_compile_kernels import _count, _page_guards


@pytest.mark.compile
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("case", STORE_ROPE_AWARE_CASES, ids=lambda c: "-".join(map(str, c)))
def test_rope_aware_store_ptx(arch, case):
    kernel = RopeAwareKVStore(*case)
    ptx = artifacts.compiled(kernel, arch).ptx
    assert f".target {arch}" in ptx
    rows, content, rope = ROWS_PER_WARP, kernel.content_vecs, kernel.rope_vecs_per_lane  # per warp / lane
    loads_per_vec = kernel.in_dtype.width // 16  # 16-byte loads per 8 input values
    assert _count(r"ld\.global\.(?:v4\.b32|v2\.b64)", ptx) == rows * (content + rope) * loads_per_vec
    assert _count(r"st\.global\.v2\.b32", ptx) == rows * content  # 8 e4m3 bytes per content vector
    assert _count(r"st\.global\.v4\.b32", ptx) == rows * rope  # 8 bf16 values: 16 bytes at byte padded_depth + ...
    assert _count(r"st\.global\.(?:b32|f32)", ptx) == rows  # the token's scale, lane 0
    # One 32-lane butterfly per row for the token's amax; NaN-propagating as in the reference; no clamp before cvt.
    assert _count(r"shfl\.sync\.bfly\.b32", ptx) == rows * 5
    assert _count(r"max\.NaN\.xorsign\.abs\.f32", ptx) == rows * content * 8
    assert _count(r"max\.NaN\.f32", ptx) == rows * 5
    assert _count(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx) == rows * content * 4
    assert _count(r"div\.rn\.f32", ptx) == rows * (content * 8 + 1)  # x / scale and amax / 448
    assert _count(r"(?:min|max)\.(?:ftz\.)?f32", ptx) == 0
    bf16_cvts = 0 if kernel.in_dtype.width == 16 and "bfloat16" in case[0] else rows * rope * 4
    assert _count(r"cvt\.rn\.bf16x2\.f32", ptx) == bf16_cvts
    assert "bar.sync" in ptx  # rows resolved once per CTA, then shared


@pytest.mark.compile
def test_rope_aware_store_skips_pages_outside_the_cache():
    """Unchecked metadata past a request's pages: each row's column and lookup entry are compared before a store."""
    kernel = RopeAwareKVStore("bfloat16", 16, 512, 64)
    ptx = artifacts.compiled(kernel, "sm_90a").ptx
    column_checked, entries_checked = _page_guards(ptx, 16)
    assert column_checked and entries_checked == [True]


def test_rope_aware_store_rejects_unsupported_geometry():
    with pytest.raises(ValueError, match="padded_depth 64 is not a positive multiple of 256"):
        RopeAwareKVStore("bfloat16", 16, 64, 16)
    with pytest.raises(ValueError, match="rope_dim 12 is not a positive multiple of 8"):
        RopeAwareKVStore("bfloat16", 16, 256, 12)


def _batch(head_size, rope_dim, device, seed=3, cached=(0, 37, 5, 130, 1, 63), new=(3, 1, 0, 17, 1, 200)):
    return random_paged_batch(list(cached), list(new), num_heads=1, head_size=head_size, page_size=64, num_layers=3,
                              is_mla=True, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=rope_dim,
                              generator=torch.Generator().manual_seed(seed), device=device)


def test_plan_takes_the_kernel_where_the_row_fits():
    for (head_size, rope_dim), dtype, want in [((640, 64), torch.bfloat16, "kernel"),
                                               ((640, 64), torch.float32, "kernel"),
                                               ((96, 16), torch.bfloat16, "reference")]:
        pb = _batch(head_size, rope_dim, "cpu")
        c = pb.collection
        k = torch.randn(pb.total_rows, 1, c.latent_dim).to(dtype)
        for arch in ARCHS:
            path = cute_kv.explain(cute_kv.store_kv, k, None, pb.input_row_offsets, c, 1, arch=arch)
            assert path.path == want, path
            if want == "kernel":
                assert path.kernel == "RopeAwareKVStore"
                assert path.key == ("paged_kv_store_rope_aware", str(dtype)[6:], 64, c.padded_depth, rope_dim)
            else:
                assert "padded_depth 64 is not a positive multiple of 256" in path.reason


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("geometry", [(640, 64), (576, 32)])
def test_rope_aware_store_kernel_matches_reference(dtype, geometry):
    """Bit-exact rows and scales against the reference on the same batch; the step's slots are NaN before the write
    (an unwritten one shows) and the whole cache is compared (a write outside them shows)."""
    batches = [_batch(*geometry, dev) for dev in ("cpu", "cuda")]
    t = batches[0].total_rows
    wide = torch.randn(t, 2, batches[0].collection.latent_dim, generator=torch.Generator().manual_seed(9)) * 5
    k = wide[:, 1:].to(dtype)  # a strided view, the way a projection hands the latent over
    k[7, 0, 3] = float("nan")  # a NaN token: NaN scale and content, its rope unaffected
    for pb in batches:
        mask = pb.step_mask(1)
        _raw(pb.collection.blocks)[mask] = 0xFF  # e4m3 NaN / bf16 NaN bytes
        pb.collection.scales[mask] = float("nan")
    cpu, gpu = batches
    ref.store_kv(k, None, cpu.input_row_offsets, cpu.collection, 1)
    cute_kv.store_kv(k.cuda(), None, gpu.input_row_offsets, gpu.collection, 1)
    torch.cuda.synchronize()
    assert torch.equal(bits(gpu.collection.blocks.cpu()), bits(cpu.collection.blocks))
    assert torch.equal(bits(gpu.collection.scales.cpu()), bits(cpu.collection.scales))
    assert int(cpu.collection.scales[cpu.step_mask(1)].isnan().sum()) == 1  # the NaN token's alone


@pytest.mark.gpu
def test_rope_aware_store_kernel_drops_rows_past_the_pages():
    """validate=False with a step running past a request's pages: those rows are not written (nothing past the
    cache), the others are."""
    pb = _batch(640, 64, "cuda", cached=(60,), new=(10,))
    c = pb.collection
    before = _raw(c.blocks).clone()
    lengths = c.cache_lengths.clone()
    lengths[0] = 64 * len(pb.pages[0]) - 4  # 4 rows fit the last page, 6 run past the request's pages
    short = c.with_metadata(lengths, c.lookup_table, 10, int(lengths[0]) + 10, validate=False)
    cute_kv.store_kv(torch.randn(10, 1, 576, device="cuda"), None, pb.input_row_offsets, short, 1, validate=False)
    torch.cuda.synchronize()
    changed = (_raw(c.blocks) != before).any(dim=-1)
    assert int(changed.sum()) == 4
