"""Foreign cache layouts in place: ``from_kv`` and strided 6-D ``blocks`` against MAX's compact cache on the CPU
(store, gather, fused QKV writes, attention), the strides the kernels cannot address rejected by name, and the
store, gather and fused QKV kernels' strided variants (their own keys; the compact keys unchanged)."""

import dataclasses

import pytest
import torch

import cute_kv
from cute_kv import reference as ref
from cute_kv.collection import PagedKVCacheCollection
from cute_kv.kv_layout import KVPlanes, planes_of_blocks
from cute_kv.ops import fused_qkv as fused_qkv_op
from cute_kv.ops import gather_kv as gather_kv_op
from cute_kv.ops import paths
from cute_kv.ops import store_kv as store_kv_op
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import ENGINE_LAYOUTS, random_paged_batch, with_layout

CACHED, NEW = [0, 37, 5, 9], [5, 1, 0, 3]
LAYER = 1
KINDS = {"bf16": dict(dtype=torch.bfloat16),
         "fp8-f32": dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, quantization_granularity=32)}


def _pair(kind: str, layout: str, page_size: int = 16):
    """``(compact batch, the same cache in ``layout``, its layer index)``."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=64, page_size=page_size,
                            generator=torch.Generator().manual_seed(1), **KINDS[kind])
    strided, layer = with_layout(pb, layout, LAYER)
    return pb, strided, layer


def _same_cache(compact, strided, layer: int) -> None:
    """Bitwise: every slot of layer ``LAYER`` (K and V, values and scales) equal in both caches."""
    a, b = compact.collection, strided.collection
    for kv in range(a.kv_dim):
        assert torch.equal(_raw(a.plane(kv)[:, LAYER]), _raw(b.plane(kv)[:, layer]))
    if a.scales is not None:
        assert torch.equal(_raw(a.scales[:, :, LAYER]), _raw(b.scales[:, :, layer]))


def _kv(c, rows, gen):
    return [torch.randn((rows, c.num_heads, c.head_size), generator=gen).to(torch.bfloat16) for _ in range(2)]


@pytest.mark.parametrize("kind, page_size", [(kind, 16) for kind in KINDS] + [("bf16", 1)])
@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_store_kv_writes_the_compact_bits(kind, page_size, layout):
    """Pages of one token too (SGLang's token pool, vLLM's block_size=1): a token's row is its page's."""
    compact, strided, layer = _pair(kind, layout, page_size)
    k, v = _kv(compact.collection, compact.total_rows, torch.Generator().manual_seed(2))
    before = strided.collection.key_blocks.clone()
    cute_kv.store_kv(k, v, compact.input_row_offsets, compact.collection, LAYER)
    cute_kv.store_kv(k, v, strided.input_row_offsets, strided.collection, layer)
    assert not torch.equal(_raw(before), _raw(strided.collection.key_blocks))  # the step was written
    _same_cache(compact, strided, layer)


def test_store_kv_leaves_the_padding_of_a_strided_view():
    compact, strided, layer = _pair("bf16", "strided-6d")
    c = strided.collection
    base = c.blocks.permute(0, 2, 1, 4, 3, 5)  # the padded [N, L, KVD, H, P, D] rows' prefix
    whole = base.as_strided((*base.shape[:-1], base.shape[-1] + 8), base.stride())
    before = _raw(whole).clone()
    k, v = _kv(c, compact.total_rows, torch.Generator().manual_seed(2))
    cute_kv.store_kv(k, v, strided.input_row_offsets, c, layer)
    assert torch.equal(_raw(whole)[..., 64:], before[..., 64:])
    assert torch.all(_raw(whole)[..., 64:] == 0x7f)


@pytest.mark.parametrize("kind, page_size", [(kind, 16) for kind in KINDS] + [("bf16", 1)])
@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_gather_kv_reads_the_compact_values(kind, page_size, layout):
    compact, strided, layer = _pair(kind, layout, page_size)
    for kv in ("k", "v"):
        assert torch.equal(cute_kv.gather_kv(compact.collection, LAYER, kv=kv),
                           cute_kv.gather_kv(strided.collection, layer, kv=kv))


@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_fused_qkv_writes_the_compact_bits(layout):
    compact, strided, layer = _pair("fp8-f32", layout)
    c = compact.collection
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn((compact.total_rows, 64), generator=gen).to(torch.bfloat16)
    weight = (torch.randn((256 + 2 * c.num_heads * c.head_size, 64), generator=gen) / 8).to(torch.bfloat16)
    q0 = cute_kv.fused_qkv_matmul_kv_cache(hidden, compact.input_row_offsets, weight, c, LAYER)
    q1 = cute_kv.fused_qkv_matmul_kv_cache(hidden, strided.input_row_offsets, weight, strided.collection, layer)
    assert torch.equal(q0, q1)
    _same_cache(compact, strided, layer)


@pytest.mark.parametrize("page_size", [16, 1])
@pytest.mark.parametrize("layout", ENGINE_LAYOUTS)
def test_attention_reference_reads_the_compact_values(layout, page_size):
    compact, strided, layer = _pair("fp8-f32", layout, page_size)
    q = torch.randn((compact.total_rows, 4, 64), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    a = ref.paged_attention(q, compact.input_row_offsets, compact.collection, LAYER)
    b = ref.paged_attention(q, strided.input_row_offsets, strided.collection, layer)
    assert torch.equal(a, b)


def test_from_kv_recipes_share_the_tensors():
    compact, _, _ = _pair("bf16", "vllm")
    c = compact.collection
    n, _, _, p, h, d = c.shape
    kv = torch.zeros((2, n, p, h, d), dtype=torch.bfloat16)
    vllm = PagedKVCacheCollection.from_kv(kv[0], kv[1], c.cache_lengths, c.lookup_table, c.max_seq_length,
                                          c.max_cache_length)
    assert vllm.key_blocks.data_ptr() == kv.data_ptr() and vllm.value_blocks.data_ptr() == kv[1].data_ptr()
    assert not vllm.is_compact and vllm.row_pitch == p
    nhd = torch.zeros((n, 2, p, h, d), dtype=torch.bfloat16)
    flash = PagedKVCacheCollection.from_kv(nhd[:, 0], nhd[:, 1], c.cache_lengths, c.lookup_table,
                                           c.max_seq_length, c.max_cache_length)
    assert flash.is_compact and flash.blocks.data_ptr() == nhd.data_ptr() and flash.shape == (n, 2, 1, p, h, d)
    k, v = torch.zeros((n, p, h, d), dtype=torch.bfloat16), torch.zeros((n, p, h, d), dtype=torch.bfloat16)
    fa4 = PagedKVCacheCollection.from_kv(k, v, c.cache_lengths, c.lookup_table, c.max_seq_length,
                                         c.max_cache_length)
    assert fa4.blocks is None and not fa4.is_compact
    fa4.get_value_cache(0).store(1, 1, 40, 0, torch.ones(d, dtype=torch.bfloat16))
    assert int(v.count_nonzero()) == d and int(k.count_nonzero()) == 0
    with pytest.raises(ValueError, match="torch.compile takes the cache as one tensor"):
        fa4.traced_blocks("store_kv")


def _meta():
    """Metadata of one request with nothing cached."""
    return (torch.zeros(1, dtype=torch.int32), torch.zeros((1, 1), dtype=torch.int32), 0, 0)


@pytest.mark.parametrize("make, message", [
    (lambda: torch.zeros((4, 2, 1, 16, 2, 64), dtype=torch.bfloat16).transpose(4, 5).contiguous()
     .transpose(4, 5)[..., :64], r"stride of D \(dim 5\) is 2; .* must be 1"),
    (lambda: torch.zeros((4, 2, 1, 16, 2, 68), dtype=torch.bfloat16)[..., :64],
     r"stride of H \(dim 4\) is 68 elements = 136 bytes, not a multiple of 16"),
    (lambda: torch.zeros((4, 2, 1, 16, 2, 64), dtype=torch.bfloat16).expand(4, 2, 3, 16, 2, 64),
     r"stride of L \(dim 2\) is 0; a broadcast"),
    (lambda: torch.zeros((2, 4, 16, 2, 64), dtype=torch.bfloat16).as_strided((4, 2, 1, 16, 2, 64),
                                                                             (1024, 64, 0, 64, 64 * 16, 1)),
     r"steps inside"),
    (lambda: torch.zeros((16, 4, 2, 1, 2, 64), dtype=torch.bfloat16).permute(1, 2, 3, 0, 4, 5),
     r"stride of N \(dim 0\) \(256\) is not a multiple of the stride of P \(dim 3\) \(1024\)"),
])
def test_unaddressable_blocks_name_the_stride(make, message):
    with pytest.raises(ValueError, match=message):
        PagedKVCacheCollection(make(), *_meta())


def test_from_kv_rejects_what_the_kernels_cannot_take():
    kv = torch.zeros((2, 4, 16, 2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="same memory"):
        PagedKVCacheCollection.from_kv(kv[0], kv[0], *_meta())
    with pytest.raises(ValueError, match="same strides"):
        PagedKVCacheCollection.from_kv(kv[0], torch.zeros((4, 2, 16, 64), dtype=torch.bfloat16).permute(0, 2, 1, 3),
                                       *_meta())
    with pytest.raises(ValueError, match=r"k_cache: the stride of D \(dim 3\)"):
        PagedKVCacheCollection.from_kv(kv[0].transpose(2, 3).contiguous().transpose(2, 3), kv[1], *_meta())
    overlap = torch.zeros(4 * 16 * 2 * 64 + 64, dtype=torch.bfloat16)
    k = overlap[:4 * 16 * 2 * 64].view(4, 16, 2, 64)
    v = overlap[64:].view(4, 16, 2, 64)
    with pytest.raises(ValueError, match=r"k_cache and v_cache as one blocks\[N, KVD, L, P, H, D\]: .* steps inside"
                                         r".*K and V must share no element"):
        PagedKVCacheCollection.from_kv(k, v, *_meta())
    with pytest.raises(ValueError, match=r"steps inside"):  # the same memory as two storages (DLPack, from_blob)
        PagedKVCacheCollection.from_kv(k, torch.utils.dlpack.from_dlpack(v), *_meta())


def test_from_kv_errors_say_a_copy_is_not_the_engines_cache():
    """``.contiguous()`` of an engine's K would be a tensor the engine never writes; no error offers it."""
    kv = torch.zeros((2, 4, 16, 2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        PagedKVCacheCollection.from_kv(kv[0].transpose(2, 3).contiguous().transpose(2, 3), kv[1], *_meta())
    assert "a different tensor than the engine's cache" in str(err.value)
    overlap = torch.zeros(4 * 16 * 2 * 64 + 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError) as err:
        PagedKVCacheCollection.from_kv(overlap[:-64].view(4, 16, 2, 64), overlap[64:].view(4, 16, 2, 64), *_meta())
    assert ".contiguous()" not in str(err.value)


def test_from_kv_takes_two_storages_over_disjoint_memory():
    kv = torch.zeros((2, 4, 16, 2, 64), dtype=torch.bfloat16)
    c = PagedKVCacheCollection.from_kv(kv[0], torch.utils.dlpack.from_dlpack(kv[1]), *_meta())
    assert c.blocks is None and c.value_blocks.data_ptr() == kv[1].data_ptr()


@pytest.mark.parametrize("v, message", [
    (torch.zeros((4, 16, 2, 32), dtype=torch.bfloat16), r"v_cache must have shape \[4, 16, 2, 64\]"),
    (torch.zeros((4, 16, 2, 64), dtype=torch.float16), r"v_cache must have dtype torch.bfloat16"),
    (torch.zeros((4, 16, 2, 64), dtype=torch.bfloat16, device="meta"), r"v_cache must be on cpu, got meta"),
])
def test_from_kv_rejects_a_v_cache_unlike_k_cache(v, message):
    with pytest.raises((TypeError, ValueError), match=message):
        PagedKVCacheCollection.from_kv(torch.zeros((4, 16, 2, 64), dtype=torch.bfloat16), v, *_meta())


def test_traced_blocks_names_v_stored_before_k():
    nhd = torch.zeros((4, 2, 16, 2, 64), dtype=torch.bfloat16)
    c = PagedKVCacheCollection.from_kv(nhd[:, 1], nhd[:, 0], *_meta())
    with pytest.raises(ValueError, match="V stored before K"):
        c.traced_blocks("store_kv")


def _planes_made(make):
    blocks = torch.zeros((4, 2, 1, 16, 2, 64), dtype=torch.bfloat16)
    return make(blocks, planes_of_blocks(blocks))


@pytest.mark.parametrize("make, message", [
    (lambda b, p: KVPlanes(p.key, p.key[:], None), r"blocks.key and blocks.value are the same memory"),
    (lambda b, p: KVPlanes(p.key, p.value.transpose(3, 4).contiguous().transpose(3, 4), None),
     r"blocks.value: the stride of D \(dim 4\) is 2"),
    (lambda b, p: KVPlanes(p.key, torch.zeros((4, 1, 2, 16, 64), dtype=torch.bfloat16).transpose(2, 3), None),
     r"blocks.key and blocks.value must have the same strides"),
    (lambda b, p: KVPlanes(p.key, p.value, b.clone()), r"must be the planes of blocks.blocks"),
    (lambda b, p: KVPlanes(p.key, p.key, b), r"must be the planes of blocks.blocks"),
])
def test_planes_are_checked_as_from_kv_checks_its_tensors(make, message):
    with pytest.raises(ValueError, match=message):
        PagedKVCacheCollection(_planes_made(make), *_meta())


def test_planes_of_blocks_and_from_kv_pass_the_check():
    c = PagedKVCacheCollection(_planes_made(lambda b, p: p), *_meta())
    assert c.is_compact and c.with_metadata(*_meta()).planes is c.planes
    by_hand = PagedKVCacheCollection(_planes_made(lambda b, p: KVPlanes(b[:, 0], b[:, 1], b)), *_meta())
    assert by_hand.is_compact and by_hand.kv_dim == 2
    kv = torch.zeros((2, 4, 16, 2, 64), dtype=torch.bfloat16)
    vllm = PagedKVCacheCollection.from_kv(kv[0], kv[1], *_meta())
    assert vllm.with_metadata(*_meta()).blocks.data_ptr() == kv.data_ptr()
    pair = PagedKVCacheCollection(KVPlanes(kv[0].unsqueeze(1), kv[1].unsqueeze(1), None), *_meta())
    assert pair.blocks.data_ptr() == kv.data_ptr() and pair.row_pitch == 16


def test_fused_qkv_sends_a_strided_rope_aware_cache_to_the_reference(rng):
    """As ``store_kv`` does: no strided rope-aware kernel is built."""
    from test_mla_rope_aware import rope_batch

    pb, _ = with_layout(rope_batch(rng), "strided-6d", 0)
    hidden = torch.zeros((pb.total_rows, 32), dtype=torch.bfloat16)
    weight = torch.zeros((2 * 80 + 80, 32), dtype=torch.bfloat16)
    for arch in ("sm_90a", "sm_100a"):
        path = fused_qkv_op.plan(pb.collection, hidden, weight, None, arch)
        assert path.path == paths.REFERENCE and path.reason.endswith("rope-aware rows: a strided cache")


@pytest.mark.parametrize("kind, granularity", [("bf16", None), ("fp8-f32", 32)])
def test_store_plan_keys(kind, granularity):
    """MAX's compact cache keeps the key it always had; a strided one adds the layout flag."""
    compact, strided, _ = _pair(kind, "vllm")
    k = torch.zeros((1, 2, 64), dtype=torch.bfloat16)
    key = ("paged_kv_store", "bfloat16", 2, 16, 2, 64, granularity)
    assert store_kv_op.plan(compact.collection, k, "sm_90a").key == key
    assert store_kv_op.plan(strided.collection, k, "sm_100a").key == (*key, "strided")


def test_gather_plan_keys():
    compact, strided, _ = _pair("bf16", "flashinfer-hnd")
    out = torch.empty(0, dtype=torch.bfloat16)
    key = ("paged_kv_gather", "bfloat16", 2, 16, 2, 64)
    assert gather_kv_op.plan(compact.collection, out, "sm_90a").key == key
    assert gather_kv_op.plan(strided.collection, out, "sm_100a").key == (*key, "strided")


def test_fused_qkv_plan_keys(rng):
    """The strided epilogue's spec differs from the compact one by its flag alone; quantized weights, whose
    mainloops have no strided epilogue yet, take the reference."""
    from test_fused_qkv_w4 import _int4

    compact, strided, _ = _pair("fp8-f32", "flashinfer-hnd")
    hidden = torch.zeros((4, 128), dtype=torch.bfloat16)
    weight = torch.zeros((256 + 256, 128), dtype=torch.bfloat16)
    a = fused_qkv_op.plan(compact.collection, hidden, weight, None, "sm_90a")
    b = fused_qkv_op.plan(strided.collection, hidden, weight, None, "sm_90a")
    assert a.path == b.path == paths.KERNEL and not a.key.strided
    assert b.key == dataclasses.replace(a.key, strided=True)
    w4 = fused_qkv_op.plan(strided.collection, hidden, _int4(rng, 512, 128, 128), None, "sm_90a")
    assert w4.path == paths.REFERENCE and "strided cache with a quantized weight" in w4.reason


def test_store_kv_under_torch_compile_writes_a_strided_view():
    """The custom op takes a strided 6-D view (vLLM's K and V as one ``blocks``) and writes through it."""
    compact, strided, layer = _pair("bf16", "vllm")
    k, v = _kv(compact.collection, compact.total_rows, torch.Generator().manual_seed(2))
    ro = strided.input_row_offsets
    traced = torch.compile(lambda k, v, c: cute_kv.store_kv(k, v, ro, c, layer), fullgraph=True)
    traced(k, v, strided.collection)
    cute_kv.store_kv(k, v, compact.input_row_offsets, compact.collection, LAYER)
    _same_cache(compact, strided, layer)


def test_one_token_pages_of_max_blocks_read_by_their_shape():
    """torch calls MAX's blocks contiguous whatever the stride of a one-token P: the row pitch is the shape's
    ``KVD*L``, as the compact kernels take it, not ``sN // sP``."""
    pb = random_paged_batch(CACHED, NEW, num_heads=2, head_size=64, page_size=1,
                            generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    c = pb.collection
    stride = list(c.blocks.stride())
    stride[3] = 24
    odd = c.blocks.as_strided(c.blocks.shape, stride)
    assert odd.is_contiguous()
    other = PagedKVCacheCollection(odd, c.cache_lengths, c.lookup_table, c.max_seq_length, c.max_cache_length)
    assert other.is_compact and other.blocks.stride() == c.blocks.stride()
    q = torch.randn((pb.total_rows, 4, 64), generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    assert torch.equal(ref.paged_attention(q, pb.input_row_offsets, c, LAYER),
                       ref.paged_attention(q, pb.input_row_offsets, other, LAYER))
