"""Reference fused QKV projection against a float64 matmul, a from-scratch complex-number RoPE and the fp8 step."""

import pytest
import torch

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err

CACHED = [0, 37, 5, 130, 1]
NEW = [3, 1, 0, 17, 1]
HIDDEN = 48
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rope64(x: torch.Tensor, pos: torch.Tensor, rope_dim: int, interleaved: bool, theta: float) -> torch.Tensor:
    """RoPE from its definition: pairs as complex numbers times ``exp(i * pos * theta^(-2j/R))`` (float64)."""
    d = x.shape[-1]
    angle = pos[:, None, None].double() * theta ** (-2 * torch.arange(rope_dim // 2, dtype=torch.float64) / rope_dim)
    turn = torch.polar(torch.ones_like(angle), angle)
    out = x.clone()
    if interleaved:  # GPT-J: adjacent pairs of the last rope_dim dims
        z = torch.view_as_complex(x[..., d - rope_dim:].reshape(*x.shape[:-1], -1, 2).contiguous()) * turn
        out[..., d - rope_dim:] = torch.view_as_real(z).flatten(-2)
    else:  # neox: x[j] pairs with x[j + R/2] over the first rope_dim dims
        half = rope_dim // 2
        z = torch.complex(x[..., :half], x[..., half:rope_dim]) * turn
        out[..., :half], out[..., half:rope_dim] = z.real, z.imag
    return out


def _step(rng, *, dtype=torch.bfloat16, heads=2, q_heads=4, head_size=16, page_size=16, is_mla=False,
          cache_dtype=None, **cache_kw):
    pb = random_paged_batch(CACHED, NEW, num_heads=heads, head_size=head_size, page_size=page_size, num_layers=2,
                            is_mla=is_mla, dtype=cache_dtype or dtype, generator=rng, **cache_kw)
    n_tot = q_heads * head_size + (1 if is_mla else 2) * heads * head_size
    hidden = torch.randn(pb.total_rows, HIDDEN, generator=rng).to(dtype)
    weight = (torch.randn(n_tot, HIDDEN, generator=rng) / HIDDEN**0.5).to(dtype)
    return pb, hidden, weight


def _positions(pb):
    return torch.cat([torch.arange(cl, cl + n) for cl, n in zip(pb.cache_lengths, pb.new_lengths)])


def _stored_dense(pb, kv_idx, layer):
    """This step's stored K or V rows (dequantized float64), concatenated in row order."""
    return torch.cat([pb.dense(kv_idx, layer, b, cl + n)[cl:] for b, (cl, n)
                      in enumerate(zip(pb.cache_lengths, pb.new_lengths))])


def _check_cache(pb, before, layer, k_want, v_want, tol):
    c = pb.collection
    assert rel_err(_stored_dense(pb, 0, layer), k_want) < tol
    if v_want is not None:
        assert rel_err(_stored_dense(pb, 1, layer), v_want) < tol
    keep = ~pb.step_mask(layer)
    assert torch.equal(_raw(c.blocks)[keep], before[0][keep])
    if c.scales is not None:
        assert torch.equal(_raw(c.scales)[keep], before[1][keep])


def _snapshot(c):
    return _raw(c.blocks).clone(), None if c.scales is None else _raw(c.scales).clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,q_heads,page_size", [(2, 2, 16), (2, 8, 64), (1, 8, 128)])  # GQA 1, 4, 8
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_qkv_matches_matmul(rng, dtype, heads, q_heads, page_size, with_bias):
    pb, hidden, weight = _step(rng, dtype=dtype, heads=heads, q_heads=q_heads, page_size=page_size)
    bias = torch.randn(weight.shape[0], generator=rng).to(dtype) if with_bias else None
    q_dim, hd = q_heads * 16, heads * 16
    output = torch.full((pb.total_rows, q_dim), float("nan"), dtype=dtype)
    before = _snapshot(pb.collection)
    got = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, bias=bias,
                                        output=output)
    c64 = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got is output and not output.isnan().any()
    assert rel_err(output, c64[:, :q_dim]) < TOL[dtype]
    k64 = c64[:, q_dim:q_dim + hd].unflatten(1, (heads, 16))
    v64 = c64[:, q_dim + hd:].unflatten(1, (heads, 16))
    _check_cache(pb, before, 1, k64, v64, TOL[dtype])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rope_dim", [16, 8])  # full and partial RoPE
@pytest.mark.parametrize("is_mla", [False, True])
def test_fused_qkv_rope(rng, interleaved, rope_dim, is_mla):
    heads = 1 if is_mla else 2
    pb, hidden, weight = _step(rng, dtype=torch.float32, heads=heads, q_heads=4, is_mla=is_mla, page_size=64)
    rope = RopeConfig.from_theta(rope_dim, 160, theta=500.0, interleaved=interleaved)
    before = _snapshot(pb.collection)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=rope)
    c64 = hidden.double() @ weight.double().T
    pos = _positions(pb)
    q64 = rope64(c64[:, :64].unflatten(1, (4, 16)), pos, rope_dim, interleaved, 500.0).flatten(1)
    k64 = rope64(c64[:, 64:64 + heads * 16].unflatten(1, (heads, 16)), pos, rope_dim, interleaved, 500.0)
    v64 = None if is_mla else c64[:, 64 + 32:].unflatten(1, (2, 16))  # V is never rotated
    assert rel_err(q, q64) < 1e-5
    _check_cache(pb, before, 0, k64, v64, 1e-5)


def test_rope_q_head_dim_differs_from_cache(rng):
    """MLA-style: Q heads of 24 dims, a 16-dim latent K; interleaved RoPE rotates the last 8 dims of each."""
    pb, hidden, weight = _step(rng, dtype=torch.float32, heads=1, q_heads=0, is_mla=True)
    weight = torch.cat([torch.randn(3 * 24, HIDDEN, generator=rng) / HIDDEN**0.5, weight])
    rope = RopeConfig.from_theta(8, 160, interleaved=True, q_head_dim=24)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, rope=rope)
    c64 = hidden.double() @ weight.double().T
    pos = _positions(pb)
    assert rel_err(q, rope64(c64[:, :72].unflatten(1, (3, 24)), pos, 8, True, 10000.0).flatten(1)) < 1e-5
    k64 = rope64(c64[:, 72:].unflatten(1, (1, 16)), pos, 8, True, 10000.0)
    assert rel_err(_stored_dense(pb, 0, 1), k64) < 1e-5


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu])
def test_fused_qkv_fp8_cache(rng, scale_dtype):
    pb, hidden, weight = _step(rng, dtype=torch.bfloat16, heads=2, q_heads=4, head_size=32, page_size=16,
                               cache_dtype=torch.float8_e4m3fn, scale_dtype=scale_dtype, quantization_granularity=16)
    before = _snapshot(pb.collection)
    rope = RopeConfig.from_theta(32, 160)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, rope=rope)
    c64 = hidden.double() @ weight.double().T
    pos = _positions(pb)
    assert q.dtype == torch.bfloat16
    assert rel_err(q, rope64(c64[:, :128].unflatten(1, (4, 32)), pos, 32, False, 10000.0).flatten(1)) < 1e-2
    k64 = rope64(c64[:, 128:192].unflatten(1, (2, 32)), pos, 32, False, 10000.0)
    # fp8 e4m3 rounds to 2^-4 relative; a whole-tensor relative error stays well under it
    _check_cache(pb, before, 1, k64, c64[:, 192:].unflatten(1, (2, 32)), 2.0**-4)


# -- quantized weights -------------------------------------------------------------------------------------------------

def int4_weight64(packed, scales, group_size, zero_points):
    """Int4 dequantization element by element from the documented layout (float64)."""
    n, kb = packed.shape
    w = torch.empty(n, 2 * kb, dtype=torch.float64)
    for k in range(2 * kb):
        code = (packed[:, k // 2].to(torch.int64) >> (4 * (k % 2))) & 0xF  # even k: low nibble
        zero = 8 if zero_points is None else zero_points[:, k // group_size].to(torch.int64)
        w[:, k] = (code - zero).double() * scales[:, k // group_size].double()
    return w


@pytest.mark.parametrize("group_size", [16, 48])
@pytest.mark.parametrize("has_zp", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_fused_qkv_int4_weight(rng, group_size, has_zp, scale_dtype):
    pb, hidden, weight = _step(rng, dtype=torch.bfloat16, heads=2, q_heads=8, page_size=16)
    n = weight.shape[0]
    packed = torch.randint(0, 256, (n, HIDDEN // 2), generator=rng, dtype=torch.uint8)
    scales = (torch.rand(n, HIDDEN // group_size, generator=rng) * 0.1 + 0.01).to(scale_dtype)
    zp = torch.randint(0, 16, (n, HIDDEN // group_size), generator=rng, dtype=torch.uint8) if has_zp else None
    w = cute_kv.Int4Weight(packed, scales, group_size, has_zp, zp)
    before = _snapshot(pb.collection)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, w, pb.collection, 1)
    c64 = hidden.double() @ int4_weight64(packed, scales, group_size, zp).T
    assert rel_err(q, c64[:, :128]) < 1e-2
    _check_cache(pb, before, 1, c64[:, 128:160].unflatten(1, (2, 16)), c64[:, 160:].unflatten(1, (2, 16)), 1e-2)


def test_int4_weight_symmetric_codes_are_offset_binary():
    """Codes 0..15 decode to -8..7 times the scale without zero points; nibble order low-then-high."""
    packed = torch.tensor([[0x80, 0xF7]], dtype=torch.uint8)  # k = 0: 0, k = 1: 8, k = 2: 7, k = 3: 15
    w = cute_kv.Int4Weight(packed, torch.tensor([[2.0]]), 4).dequantize()
    assert w.tolist() == [[-16.0, 0.0, -2.0, 14.0]]
    zp = cute_kv.Int4Weight(packed, torch.tensor([[2.0]]), 4, True, torch.tensor([[1]], dtype=torch.uint8))
    assert zp.dequantize().tolist() == [[-2.0, 14.0, 12.0, 28.0]]


def test_fused_qkv_fp8_weight(rng):
    pb, hidden, weight = _step(rng, dtype=torch.float16, heads=1, q_heads=4, is_mla=True, page_size=64)
    w8 = (torch.randn(weight.shape, generator=rng) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(weight.shape[0], generator=rng) * 0.01 + 1e-3
    before = _snapshot(pb.collection)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, cute_kv.Fp8Weight(w8, scales), pb.collection, 0)
    c64 = hidden.double() @ (w8.double() * scales.double()[:, None]).T
    assert rel_err(q, c64[:, :64]) < 2e-3
    _check_cache(pb, before, 0, c64[:, 64:].unflatten(1, (1, 16)), None, 2e-3)


# -- QK-norm -----------------------------------------------------------------------------------------------------------

def rms64(x, gamma, eps, offset):
    """RMSNorm of the first len(gamma) dims of every head, from its definition, in float64."""
    c = gamma.shape[0]
    out = x.clone()
    ms = (x[..., :c] ** 2).sum(-1, keepdim=True) / c
    out[..., :c] = x[..., :c] / torch.sqrt(ms + eps) * (gamma.double() + offset)
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("sides", ["qk", "q", "k"])
@pytest.mark.parametrize("offset", [0.0, 1.0])  # Gemma stores gamma - 1
def test_fused_qkv_qk_norm_then_rope(rng, interleaved, sides, offset):
    pb, hidden, weight = _step(rng, dtype=torch.float32, heads=2, q_heads=8, page_size=16)
    gq = torch.randn(16, generator=rng) if "q" in sides else None
    gk = torch.randn(16, generator=rng).to(torch.bfloat16) if "k" in sides else None
    norm = cute_kv.QKNorm(gq, gk, epsilon=0.25, weight_offset=offset)  # an epsilon that shows
    rope = RopeConfig.from_theta(16, 160, interleaved=interleaved)
    bias = torch.randn(weight.shape[0], generator=rng)
    before = _snapshot(pb.collection)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, bias=bias, rope=rope,
                                      qk_norm=norm)
    c64 = hidden.double() @ weight.double().T + bias.double()
    pos = _positions(pb)
    q64, k64 = c64[:, :128].unflatten(1, (8, 16)), c64[:, 128:160].unflatten(1, (2, 16))
    q64 = q64 if gq is None else rms64(q64, gq, 0.25, offset)
    k64 = k64 if gk is None else rms64(k64, gk, 0.25, offset)
    assert rel_err(q, rope64(q64, pos, 16, interleaved, 10000.0).flatten(1)) < 1e-5
    _check_cache(pb, before, 1, rope64(k64, pos, 16, interleaved, 10000.0), c64[:, 160:].unflatten(1, (2, 16)), 1e-5)


def test_fused_qkv_mla_latent_norm(rng):
    """MLA: RMSNorm over the latent's first kv_lora_rank = 24 dims; GPT-J RoPE on its last 8 (untouched by the
    norm); Q heads of 24 with rope on their last 8 and no Q norm; fp8 cache quantizes the result."""
    pb, hidden, weight = _step(rng, dtype=torch.bfloat16, heads=1, q_heads=0, head_size=32, is_mla=True,
                               cache_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                               quantization_granularity=32)
    weight = torch.cat([(torch.randn(2 * 24, HIDDEN, generator=rng) / HIDDEN**0.5).to(torch.bfloat16), weight])
    gamma = torch.rand(24, generator=rng) + 0.5
    rope = RopeConfig.from_theta(8, 160, interleaved=True, q_head_dim=24)
    before = _snapshot(pb.collection)
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, rope=rope,
                                      qk_norm=cute_kv.QKNorm(k_weight=gamma))
    c64 = hidden.double() @ weight.double().T
    pos = _positions(pb)
    assert rel_err(q, rope64(c64[:, :48].unflatten(1, (2, 24)), pos, 8, True, 10000.0).flatten(1)) < 1e-2
    k64 = rope64(rms64(c64[:, 48:].unflatten(1, (1, 32)), gamma, 1e-6, 0.0), pos, 8, True, 10000.0)
    _check_cache(pb, before, 1, k64, None, 2.0**-4)


@pytest.mark.parametrize("with_norm", [False, True])
def test_fused_qkv_rope_aware_rows(rng, with_norm):
    """Rope-aware FP8 MLA rows ([64 e4m3 content bytes | 16 bf16]): the float64 latent, latent-normed over its 64
    content dims, GPT-J RoPE on the 16 tail dims; content quantized per token (amax / 448), tail rounded to bf16."""
    pb, hidden, weight = _step(rng, heads=1, q_heads=0, head_size=96, is_mla=True, page_size=16,
                               cache_dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=16)
    weight = torch.cat([(torch.randn(40 + 80, HIDDEN, generator=rng) / HIDDEN**0.5).to(torch.bfloat16),
                        weight[:0]])  # Q (2 heads of 20) and the 80-dim latent
    gamma = torch.rand(64, generator=rng) + 0.5
    rope = RopeConfig.from_theta(16, 160, interleaved=True, q_head_dim=20)
    before = _snapshot(pb.collection)
    norm = cute_kv.QKNorm(k_weight=gamma) if with_norm else None
    ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 1, rope=rope, qk_norm=norm)
    c64 = hidden.double() @ weight.double().T
    k64 = c64[:, 40:].unflatten(1, (1, 80))
    k64 = rope64(rms64(k64, gamma, 1e-6, 0.0) if with_norm else k64, _positions(pb), 16, True, 10000.0)
    c = pb.collection
    rows = torch.cat([pb.tokens(0, 1, b, cl, cl + n)[0] for b, (cl, n) in enumerate(zip(pb.cache_lengths,
                                                                                           pb.new_lengths))])
    scales = torch.cat([pb.tokens(0, 1, b, cl, cl + n)[1] for b, (cl, n) in enumerate(zip(pb.cache_lengths,
                                                                                           pb.new_lengths))])
    raw = rows.view(torch.uint8)[:, 0]
    tail = raw[:, 64:].contiguous().view(torch.bfloat16).double()  # decoded by hand: bytes 64.. are bf16
    assert rel_err(tail, k64[:, 0, 64:]) < 1e-2
    want_scale = k64[:, 0, :64].abs().amax(-1) / 448
    assert rel_err(scales.double().flatten(), want_scale) < 1e-6
    content = raw[:, :64].view(torch.float8_e4m3fn).double() * scales.double().flatten()[:, None]
    assert rel_err(content, k64[:, 0, :64]) < 2.0**-4
    keep = ~pb.step_mask(1)
    assert torch.equal(_raw(c.blocks)[keep], before[0][keep]) and torch.equal(_raw(c.scales)[keep], before[1][keep])
