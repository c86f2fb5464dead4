"""Rope-aware FP8 MLA cache: params and collection checks, the row codec, store / fused QKV / gather / dense MLA
attention through the references. Rows are decoded by hand from their bytes (e4m3 and bf16 bit fields), not with
torch's casts."""

import math

import pytest
import torch

import cute_kv
from cute_kv import KVCacheParams, KVCacheQuantizationConfig, PagedKVCacheCollection, RopeConfig
from cute_kv.metadata import make_lookup_table
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from test_reference_qkv import rope64

FP8 = torch.float8_e4m3fn
CACHED = [0, 37, 5, 130, 9]
NEW = [5, 1, 0, 17, 1]
# Small rows for most tests (64 content bytes + 16 bf16 rope = 96 bytes, latent 80); DeepSeek's 640 (576) too.
SMALL = dict(head_size=96, rope_dim=16)
DEEPSEEK = dict(head_size=640, rope_dim=64)


def rope_batch(rng, cached=CACHED, new=NEW, *, head_size=96, rope_dim=16, page_size=16, **kw):
    return random_paged_batch(cached, new, num_heads=1, head_size=head_size, page_size=page_size, generator=rng,
                              is_mla=True, dtype=FP8, scale_dtype=torch.float32, rope_dim=rope_dim, **kw)


def e4m3_by_hand(b: torch.Tensor) -> torch.Tensor:
    """float64 of e4m3fn bytes from the bit fields: s.eeee.mmm, bias 7, subnormals at e=0, NaN at eeee.mmm=1111.111."""
    b = b.to(torch.int64)
    s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
    mag = torch.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * torch.exp2((e - 7).double()))
    mag = torch.where((e == 15) & (m == 7), float("nan"), mag)
    return torch.where(s == 1, -mag, mag).double()


def bf16_by_hand(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """float64 of little-endian bf16 byte pairs: the top half of a float32."""
    bits32 = (hi.to(torch.int64) << 24) | (lo.to(torch.int64) << 16)
    return torch.where(bits32 >= 2**31, bits32 - 2**32, bits32).to(torch.int32).view(torch.float32).double()


def decode_by_hand(row_bytes: torch.Tensor, scale: torch.Tensor, padded_depth: int) -> torch.Tensor:
    """``row_bytes`` uint8 ``[..., padded_depth + 2R]``, ``scale [..., 1]`` -> float64 ``[..., padded_depth + R]``."""
    content = e4m3_by_hand(row_bytes[..., :padded_depth]) * scale.double()
    tail = row_bytes[..., padded_depth:]
    return torch.cat([content, bf16_by_hand(tail[..., 0::2], tail[..., 1::2])], dim=-1)


def stored_rows(pb, layer, b, start, stop):
    """float64 logical rows ``[n, latent_dim]`` of request ``b``'s tokens, decoded by hand from the page lists."""
    page, slot = pb.slots(b, start, stop)
    c = pb.collection
    rows = _raw(c.blocks)[page, 0, layer, slot, 0]
    scales = c.scales[page, 0, layer, slot, 0]
    return decode_by_hand(rows, scales, c.padded_depth)


def snapshot(c):
    return _raw(c.blocks).clone(), c.scales.clone()


def assert_only_step_rows_changed(pb, before, layer):
    """Bit for bit: every byte and scale outside this step's slots of ``layer`` is as before."""
    blocks, scales = before
    keep = ~pb.step_mask(layer)
    assert torch.equal(_raw(pb.collection.blocks)[keep], blocks[keep])
    assert torch.equal(_raw(pb.collection.scales)[keep].view(torch.int32), scales[keep].view(torch.int32))


# -- params / collection ---------------------------------------------------------------------------------------------

def deepseek_params(**kw):
    quant = dict(scale_dtype=torch.float32, quantization_granularity=640, rope_dim=64)
    quant.update(kw.pop("quant", {}))
    args = dict(dtype=FP8, n_kv_heads=1, head_dim=640, is_mla=True, page_size=64, total_num_layers=3)
    args.update(kw)
    return KVCacheParams(kvcache_quant_config=KVCacheQuantizationConfig(**quant), **args)


def test_params_deepseek_geometry():
    p = deepseek_params()
    assert (p.rope_dim, p.padded_depth, p.latent_dim) == (64, 512, 576)
    assert p.shape_per_block == [1, 3, 64, 1, 640] and p.shape_per_scale_block == [1, 3, 64, 1, 1]
    assert p.bytes_per_token == 3 * (640 + 4)  # one row and one float32 scale per layer
    plain = KVCacheParams(torch.bfloat16, 1, 576, is_mla=True, total_num_layers=1)
    assert (plain.rope_dim, plain.padded_depth, plain.latent_dim) == (None, 576, 576)


@pytest.mark.parametrize("kw,match", [
    (dict(is_mla=False, n_kv_heads=1), "MLA caches only"),
    (dict(dtype=torch.bfloat16), "kvcache_quant_config needs an fp8 dtype"),
    (dict(quant=dict(scale_dtype=torch.float8_e8m0fnu)), "float32 scales"),
    (dict(quant=dict(quantization_granularity=128)), "quantization_granularity must equal head_dim"),
    (dict(head_dim=600, quant=dict(quantization_granularity=600)), "multiple of 64"),
    (dict(head_dim=128, quant=dict(quantization_granularity=128)), "positive multiple of 64"),
    (dict(quant=dict(rope_dim=0)), "rope_dim must be a positive int"),
    (dict(quant=dict(rope_dim=True)), "rope_dim must be a positive int"),
])
def test_params_reject_bad_rope_aware_layouts(kw, match):
    with pytest.raises(ValueError, match=match):
        deepseek_params(**kw)


def _tensors(n=3, kvd=1, h=1, d=640, dtype=FP8, scale_dtype=torch.float32, g=1):
    blocks = torch.zeros((n, kvd, 2, 16, h, d), dtype=dtype)
    scales = None if scale_dtype is None else torch.ones((n, kvd, 2, 16, h, g), dtype=scale_dtype)
    return blocks, scales


def _wrap(blocks, scales, rope_dim, **kw):
    return PagedKVCacheCollection(blocks, torch.zeros(1, dtype=torch.int32), make_lookup_table([[0]], sentinel=3),
                                  0, 0, scales, rope_dim=rope_dim, **kw)


def test_collection_properties_and_allocation():
    p = deepseek_params()
    blocks, scales = PagedKVCacheCollection.allocate_blocks(p, 4)
    assert blocks.shape == (4, 1, 3, 64, 1, 640) and scales.shape == (4, 1, 3, 64, 1, 1)
    c = _wrap(blocks, scales, 64)
    assert (c.rope_dim, c.padded_depth, c.latent_dim, c.quantization_granularity) == (64, 512, 576, 640)
    assert c.with_metadata(c.cache_lengths, c.lookup_table, 0, 0).rope_dim == 64
    assert "rope-aware [512 fp8 | 64 bf16]" in repr(c)
    plain = _wrap(*_tensors(dtype=torch.bfloat16, d=576, scale_dtype=None), None)
    assert (plain.rope_dim, plain.padded_depth, plain.latent_dim) == (None, 576, 576)


def test_manager_collections_are_rope_aware():
    manager = cute_kv.PagedKVCacheManager(deepseek_params(page_size=16), total_num_pages=4)
    assert all(c.rope_dim == 64 and c.latent_dim == 576 for c in manager._collections)


@pytest.mark.parametrize("tensors,rope_dim,match", [
    (dict(kvd=2), 64, "MLA caches only"),
    (dict(h=2, g=1), 64, "one latent head"),
    (dict(scale_dtype=None), 64, "needs scales"),
    (dict(g=5), 64, "quantization_granularity must equal head_dim"),
    (dict(d=608), 64, "multiple of 64"),
    (dict(), -1, "rope_dim must be a positive int"),
])
def test_collection_rejects_bad_rope_aware_tensors(tensors, rope_dim, match):
    with pytest.raises(ValueError, match=match):
        _wrap(*_tensors(**tensors), rope_dim)


# -- the row codec ---------------------------------------------------------------------------------------------------

def test_codec_roundtrip_matches_hand_decoding(rng):
    c = rope_batch(rng, **DEEPSEEK).collection
    fmt = c.row_format
    assert (fmt.row_bytes, fmt.latent_dim, fmt.rope_offset) == (640, 576, 512)
    x = torch.randn(7, 576, generator=rng) * torch.exp2(torch.randint(-6, 6, (7, 1), generator=rng).double()).float()
    x[3, :512] = 0.0  # a zero content row: the smallest scale, zeros back
    rows, scales = fmt.encode(x)
    assert rows.dtype == FP8 and rows.shape == (7, 640) and scales.shape == (7, 1)
    want_scale = (x[:, :512].abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(torch.finfo(torch.float32).tiny)
    assert torch.equal(scales, want_scale)
    back = decode_by_hand(rows.view(torch.uint8), scales, 512)
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).double())  # rope: exactly bf16
    err = (back[:, :512] - x[:, :512].double()).abs()
    assert bool((err <= x[:, :512].double().abs() * 2**-4 + scales.double() * 2**-10).all())  # e4m3 rounding
    assert torch.equal(fmt.decode(rows, scales), back.float())  # float32 products of exact factors


def test_codec_nan_content_propagates(rng):
    fmt = rope_batch(rng).collection.row_format
    x = torch.randn(2, 80, generator=rng)
    x[1, 5] = float("nan")
    rows, scales = fmt.encode(x)
    assert scales[1].isnan().all() and not scales[0].isnan().any()
    assert fmt.decode(rows, scales)[1, :64].isnan().all() and not fmt.decode(rows, scales)[1, 64:].isnan().any()


# -- store / fused QKV -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("geometry", [SMALL, DEEPSEEK])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_writes_rope_aware_rows(rng, geometry, dtype):
    pb = rope_batch(rng, **geometry)
    c = pb.collection
    before = snapshot(c)
    k = (torch.randn(pb.total_rows, 1, c.latent_dim, generator=rng) * 3).to(dtype)
    cute_kv.store_kv(k, None, pb.input_row_offsets, c, 1)
    assert_only_step_rows_changed(pb, before, 1)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        got = stored_rows(pb, 1, b, cl, cl + n)
        want = k[pb.rows(b), 0].double()
        pd = c.padded_depth
        assert torch.equal(got[:, pd:], want[:, pd:].to(torch.bfloat16).double())
        scale = (k[pb.rows(b), 0, :pd].float().abs().amax(dim=1, keepdim=True) / 448.0).double()
        assert torch.equal(_raw(c.scales)[pb.slots(b, cl, cl + n)[0], 0, 1, pb.slots(b, cl, cl + n)[1], 0]
                           .view(torch.float32).double(), scale)
        assert bool(((got[:, :pd] - want[:, :pd]).abs() <= want[:, :pd].abs() * 2**-4 + scale * 2**-10).all())


def test_store_kv_rejects_bad_rope_aware_input(rng):
    pb = rope_batch(rng)
    c = pb.collection
    before = snapshot(c)
    with pytest.raises(ValueError, match=r"k must have shape \[\*, 1, 80\]"):
        cute_kv.store_kv(torch.randn(pb.total_rows, 1, 96), None, pb.input_row_offsets, c, 0)
    with pytest.raises(ValueError, match="v must be None"):
        cute_kv.store_kv(torch.randn(pb.total_rows, 1, 80), torch.randn(pb.total_rows, 1, 80),
                         pb.input_row_offsets, c, 0)
    assert torch.equal(_raw(c.blocks), before[0]) and torch.equal(c.scales, before[1])


def test_store_plan_routes_narrow_rope_aware_rows_to_reference(rng):
    """64 content bytes: too narrow for the store kernel's warp per row; the fused-QKV kernel takes them (its
    last-arriving tile quantizes the content, tests/test_fused_qkv_latent.py)."""
    pb = rope_batch(rng)
    c = pb.collection
    k = torch.randn(pb.total_rows, 1, 80, generator=rng).to(torch.bfloat16)
    for arch in ("sm_90a", "sm_100a"):
        path = cute_kv.explain(cute_kv.store_kv, k, None, pb.input_row_offsets, c, 0, arch=arch)
        assert path.path == "reference" and "rope-aware rows: padded_depth 64" in path.reason
        hidden = torch.randn(pb.total_rows, 32, generator=rng).to(torch.bfloat16)
        weight = torch.randn(2 * 80 + 80, 32, generator=rng).to(torch.bfloat16)  # Q: two heads of 80
        path = cute_kv.explain(cute_kv.fused_qkv_matmul_kv_cache, hidden, pb.input_row_offsets, weight, c, 0,
                               arch=arch)
        assert path.kernel == "FusedQKVGemm" and (path.key.cross_dims, path.key.rope_tail) == (64, 16)


def test_fused_qkv_writes_rope_aware_rows(rng):
    """``C = hidden @ W^T``: Q (4 heads of the latent width) returned; the latent K, GPT-J RoPE on its last 16 dims
    (MLA's rope tail), stored as rope-aware rows."""
    pb = rope_batch(rng, page_size=64)
    c = pb.collection
    before = snapshot(c)
    hidden = torch.randn(pb.total_rows, 48, generator=rng)
    weight = torch.randn(4 * 80 + 80, 48, generator=rng) / 7
    rope = RopeConfig.from_theta(16, 256, interleaved=True)
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, c, 0, rope=rope)
    c64 = hidden.double() @ weight.double().T
    pos = cute_kv.positions(pb.input_row_offsets, c.cache_lengths)
    want_q = rope64(c64[:, :320].unflatten(1, (4, 80)), pos, 16, True, 10000.0).flatten(1)
    assert rel_err(q, want_q) < 1e-5
    want_k = rope64(c64[:, None, 320:], pos, 16, True, 10000.0)[:, 0]
    assert_only_step_rows_changed(pb, before, 0)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        got, want = stored_rows(pb, 0, b, cl, cl + n), want_k[pb.rows(b)]
        if not n:
            continue
        assert torch.allclose(got[:, 64:], want[:, 64:], rtol=2**-8, atol=0)  # bf16 rope
        assert rel_err(got[:, :64], want[:, :64]) < 0.05  # e4m3 content


# -- gather ----------------------------------------------------------------------------------------------------------

def test_gather_kv_returns_dequantized_logical_rows(rng):
    pb = rope_batch(rng)
    c = pb.collection
    pb.poison_unread(1)
    out = cute_kv.gather_kv(c, 1)
    assert out.dtype == torch.float32 and out.shape == (5, c.max_cache_length, 1, 80)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        assert torch.equal(out[b, :cl, 0].double(), stored_rows(pb, 1, b, 0, cl))
        assert not out[b, cl:].any()
    with pytest.raises(TypeError, match="out must have dtype torch.float32"):
        cute_kv.gather_kv(c, 1, out=torch.zeros(out.shape, dtype=FP8))


# -- dense MLA attention over rope-aware rows ------------------------------------------------------------------------

def dense_mla(pb, q, layer, mla_v_dim, scale):
    """float64 causal attention per request and head over the hand-decoded rows (values: their first dims)."""
    out = torch.full((*q.shape[:2], mla_v_dim), float("nan"), dtype=torch.float64)
    for b, (cl, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        keys = stored_rows(pb, layer, b, 0, cl + n)
        for i in range(n):
            row = pb.rows(b).start + i
            for h in range(q.shape[1]):
                s = keys[: cl + i + 1] @ q[row, h].double() * scale
                w = torch.softmax(s, dim=0)
                out[row, h] = w @ keys[: cl + i + 1, :mla_v_dim]
    return out


@pytest.mark.parametrize("geometry,mla_v_dim", [(SMALL, 64), (SMALL, 48), (DEEPSEEK, 512)])
def test_paged_attention_reads_rope_aware_rows(rng, geometry, mla_v_dim):
    cached, new = ([0, 37, 5, 9], [5, 1, 0, 1]) if geometry is DEEPSEEK else (CACHED, NEW)
    pb = rope_batch(rng, cached, new, **geometry)
    c = pb.collection
    pb.poison_unread(1)
    q = torch.randn(pb.total_rows, 8, c.latent_dim, generator=rng).to(torch.bfloat16)
    out = torch.full((pb.total_rows, 8, mla_v_dim), float("nan"), dtype=torch.bfloat16)
    scale = 1 / math.sqrt(c.latent_dim)
    cute_kv.paged_attention(q, pb.input_row_offsets, c, 1, mla_v_dim=mla_v_dim, out=out)
    assert not out.isnan().any()
    assert rel_err(out, dense_mla(pb, q, 1, mla_v_dim, scale)) < 1e-2


def test_paged_attention_rejects_bad_rope_aware_args(rng):
    pb = rope_batch(rng)
    c = pb.collection
    q = torch.randn(pb.total_rows, 8, 80, generator=rng).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"q head dim \(96\) must equal the cache latent_dim"):
        cute_kv.paged_attention(torch.randn(pb.total_rows, 8, 96).to(torch.bfloat16), pb.input_row_offsets, c, 0,
                                mla_v_dim=64)
    with pytest.raises(ValueError, match=r"mla_v_dim must be an int in \[1, 64\]"):
        cute_kv.paged_attention(q, pb.input_row_offsets, c, 0, mla_v_dim=80)
    path = cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, c, 0, mla_v_dim=64, arch="sm_90a")
    assert path.path == "reference"
