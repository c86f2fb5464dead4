"""``cute_kv.mla_prefill``: the route each step takes (FLOP rule per arch), both routes on the CPU against the
float64 reference, the decompressed path's temporary cache checked by hand, the SM100 192/128 kernel's PTX, and
the GPU runs (``gpu``)."""

import dataclasses
import math
import re
import subprocess

import pytest
import torch

import artifacts

import cute_kv
from cute_kv.ops import mla_prefill as op
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.mla_prefill import DEEPSEEK_V3, flops, mla_prefill as reference

from numerics import rel_err

CACHED = [0, 37, 5, 130, 9, 0]
NEW = [5, 1, 0, 17, 1, 140]  # ragged, 0 and 1 new tokens, a fresh prompt over two temporary pages
HEADS, NOPE, V = 4, 24, 20
CACHES = {  # kv_lora_rank, rope_dim, cache arguments, tolerance against float64
    "fp32": (32, 8, dict(head_size=40, dtype=torch.float32), 1e-5),
    "bf16": (32, 8, dict(head_size=40, dtype=torch.bfloat16), 3e-2),
    "rope-aware fp8": (64, 16, dict(head_size=96, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32,
                                    rope_dim=16), 1e-5),
}
DS = dict(num_heads=DEEPSEEK_V3["num_heads"], kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)


def _inputs(rng, cache, cached=CACHED, new=NEW, page_size=16, heads=HEADS, nope=NOPE, v=V, device=None):
    """``cache``: a ``CACHES`` name or such a tuple."""
    r, dr, kw, tol = CACHES[cache] if isinstance(cache, str) else cache
    pb = random_paged_batch(cached, new, num_heads=1, page_size=page_size, generator=rng, is_mla=True,
                            device=device, **kw)
    q_dtype = torch.float32 if kw["dtype"] == torch.float8_e4m3fn else kw["dtype"]
    t = pb.total_rows

    def randn(*shape, div=1.0):
        return (torch.randn(*shape, generator=rng) / div).to(device=device, dtype=q_dtype)

    return (pb, randn(t, heads, nope), randn(t, heads, dr), randn(heads, nope, r, div=math.sqrt(r)),
            randn(heads, v, r, div=math.sqrt(r)), tol)


def _want(pb, layer, q_nope, q_rope, w_uk, w_uv, scale=None, causal=True):
    return reference(*(x.cpu().double() for x in (q_nope, q_rope)), pb.input_row_offsets.cpu(),
                     _cpu(pb.collection), layer, *(w.cpu().double() for w in (w_uk, w_uv)), scale=scale,
                     causal=causal)


def _cpu(c):
    if c.device.type == "cpu":
        return c
    return cute_kv.PagedKVCacheCollection(c.blocks.cpu(), c.cache_lengths.cpu(), c.lookup_table.cpu(),
                                          c.max_seq_length, c.max_cache_length,
                                          None if c.scales is None else c.scales.cpu(),
                                          quantization_granularity=c.quantization_granularity if c.scales is not None
                                          else None, rope_dim=c.rope_dim)


def _force(monkeypatch, path):
    plan = op.plan
    monkeypatch.setattr(op, "plan", lambda *a, **k: dataclasses.replace(plan(*a, **k), path=path))


# -- the route: FLOP rule per arch -----------------------------------------------------------------------------------

def test_path_flops_are_the_reference_counts_over_visible_pairs():
    for t, s in [(1, 1), (7, 300), (171, 4096), (4096, 4096)]:
        got = op.path_flops(t, s, False, qk_dim=192, pv_dim=128, **DS)
        assert got == {op.ABSORBED: flops(t, s, **DS)["absorbed"], op.DECOMPRESSED: flops(t, s, **DS)["decompressed"]}
        causal = op.path_flops(t, s, True, qk_dim=192, pv_dim=128, **DS)
        masked = t * (t - 1) // 2  # query i of the chunk skips the chunk's later t - 1 - i keys
        assert got[op.ABSORBED] - causal[op.ABSORBED] == masked * 2 * 128 * (2 * 512 + 64)
        assert got[op.DECOMPRESSED] - causal[op.DECOMPRESSED] == masked * 2 * 128 * 320
    assert op.path_flops(0, 500, True, qk_dim=192, pv_dim=128, **DS) == {op.ABSORBED: 0, op.DECOMPRESSED: 0}


@pytest.mark.parametrize("arch,threshold", [("sm_100a", 171), ("sm_90a", 171), (None, 171)])
def test_chunk_threshold(arch, threshold):
    """Chunks over a long context (all pairs: ``causal=False``) go decompressed from the documented size on: 171
    new tokens at 192/128 (SM100, SM90, and the CPU's rule)."""
    s = 1 << 20  # 1/T - 1/S ~ 1/T
    route = lambda t: op.plan([(t, s)], dtype="bfloat16", arch=arch, causal=False, **DS)  # noqa: E731
    assert route(threshold).path == op.DECOMPRESSED
    assert route(threshold - 1).path == op.ABSORBED
    assert route(threshold).head_dim == 192


def test_documented_figures():
    """The module docstring's per-request figures (all pairs)."""
    def tflop(arch, t, s):
        f = op.plan([(t, s)], dtype="bfloat16", arch=arch, causal=False, **DS).flops
        return round(f[op.DECOMPRESSED] / 1e12, 2), round(f[op.ABSORBED] / 1e12, 2)

    assert tflop("sm_100a", 4096, 4096) == (1.51, 4.81)
    assert tflop("sm_100a", 512, 4096) == (0.31, 0.60)
    assert tflop("sm_90a", 4096, 4096) == (1.51, 4.81)
    assert tflop("sm_90a", 512, 4096) == (0.31, 0.60)
    assert tflop("sm_90a", 128, 4096) == (0.18, 0.15)


def test_route_per_step():
    kw = dict(dtype="bfloat16", **DS)
    prefill = op.plan([(4096, 4096), (0, 9000)], arch="sm_100a", **kw)
    assert prefill.path == op.DECOMPRESSED and prefill.head_dim == 192
    assert prefill.kernel.kernel == "PagedAttentionSm100" and prefill.kernel.key == (
        "mla_prefill_sm100", "bfloat16", 128, 128, 192, op.PAGE, 2, True, False, False, False, "bfloat16", None, False,
        1, 128)  # one Q tile (a group of 1), then v_dim
    sm90 = op.plan([(4096, 4096)], arch="sm_90a", **kw)
    assert (sm90.path, sm90.head_dim, sm90.kernel.kernel) == (op.DECOMPRESSED, 192, "PagedAttention")
    assert sm90.kernel.key == ("mla_prefill_sm90", *prefill.kernel.key[1:14], 128)  # (no Q tiles)
    decode = op.plan([(1, 4096)] * 64, arch="sm_100a", **kw)
    assert decode.path == op.ABSORBED and decode.kernel == prefill.kernel  # (what a decompressed run would launch)
    # A step decides as a whole: a 4k prompt saves 1.65 TFLOP decompressed (causal), a decode row beside it over 4k
    # keys costs 0.14 more (its keys up-projected): 8 of them still go decompressed, 64 absorbed.
    assert op.plan([(4096, 4096)] + [(1, 4096)] * 8, arch="sm_100a", **kw).path == op.DECOMPRESSED
    assert op.plan([(4096, 4096)] + [(1, 4096)] * 64, arch="sm_100a", **kw).path == op.ABSORBED
    # fp32 q or other dims: no native 192/128 kernel; padded to the smallest head dim holding them.
    assert op.plan([(4096, 4096)], arch="sm_100a", **{**kw, "dtype": "float32"}).kernel is None
    small = op.plan([(64, 64)], arch="sm_100a", dtype="bfloat16", num_heads=4, kv_lora_rank=32, rope_dim=8,
                    nope_dim=24, v_dim=20)
    # (K 24 + 8 and V 20 padded to 64: a pair costs 128 against the absorbed 2 * 32 + 8 = 72 per head.)
    assert (small.path, small.head_dim, small.kernel) == (op.ABSORBED, 64, None)
    assert op.plan([(64, 64)], arch=None, dtype="bfloat16", num_heads=4, kv_lora_rank=32, rope_dim=8, nope_dim=24,
                   v_dim=20).path == op.DECOMPRESSED  # unpadded: 52 a pair


def test_grid_past_cuda_limits_leaves_the_attention_to_paged_attention():
    """The SM100 kernel's grid over the temporary cache has a z index per request and y indices per head (65535
    each): past them the route launches no kernel of its own (``paged_attention``'s plan takes the reference)."""
    kw = dict(dtype="bfloat16", arch="sm_100a", **DS)
    assert op.plan([(4096, 4096)] + [(0, 1)] * 65534, **kw).kernel is not None
    assert op.plan([(4096, 4096)] + [(0, 1)] * 65535, **kw).kernel is None
    assert op.plan([(4096, 4096)], **{**kw, "num_heads": 65536}).kernel is None


# -- both routes on the CPU ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", [op.DECOMPRESSED, op.ABSORBED])
@pytest.mark.parametrize("cache", list(CACHES))
def test_op_cpu_matches_reference(rng, monkeypatch, cache, path):
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, cache)
    pb.poison_unread(1)
    _force(monkeypatch, path)
    out = torch.full((pb.total_rows, HEADS, V), float("nan"), dtype=q_nope.dtype)
    blocks = pb.collection.blocks.clone()
    got = cute_kv.mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 1, w_uk, w_uv, scale=0.2,
                              out=out)
    assert got is out and not out.isnan().any()
    assert rel_err(out, _want(pb, 1, q_nope, q_rope, w_uk, w_uv, 0.2)) < tol
    assert torch.equal(pb.collection.blocks.view(torch.uint8), blocks.view(torch.uint8))  # the cache is read only


def test_op_cpu_default_route_and_scale(rng):
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, "fp32")
    got = cute_kv.mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 0, w_uk, w_uv, causal=False)
    assert got.shape == (pb.total_rows, HEADS, V) and got.dtype == torch.float32
    assert rel_err(got, _want(pb, 0, q_nope, q_rope, w_uk, w_uv, causal=False)) < tol


def test_op_under_torch_compile(rng):
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, "fp32")
    c = pb.collection

    @torch.compile(backend="eager", fullgraph=True)
    def step(q_nope, q_rope):
        return cute_kv.mla_prefill(q_nope, q_rope, pb.input_row_offsets, c, 1, w_uk, w_uv, validate=False)

    assert rel_err(step(q_nope, q_rope), _want(pb, 1, q_nope, q_rope, w_uk, w_uv)) < tol


@pytest.mark.parametrize("cache", list(CACHES))
def test_op_opcheck(rng, cache):
    pb, q_nope, q_rope, w_uk, w_uv, _ = _inputs(rng, cache)
    c = pb.collection
    out = torch.full((pb.total_rows, HEADS, V), float("nan"), dtype=q_nope.dtype)
    args = (q_nope, q_rope, op.uint32_bits(pb.input_row_offsets), c.blocks, c.cache_lengths, c.lookup_table,
            c.scales, 1, c.max_seq_length, c.max_cache_length, c.quantization_granularity, c.rope_dim, w_uk, w_uv,
            0.2, True, out)
    # test_schema compares inputs with allclose, which CPU fp8 tensors lack; the other caches cover it.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.cute_kv.mla_prefill.default, args,
                          test_utils=utils if c.rope_dim is not None else ("test_schema", *utils))


def test_op_declares_what_it_writes():
    schema = torch.ops.cute_kv.mla_prefill.default._schema
    assert {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write} == {"out"}
    assert not schema.returns


@pytest.mark.parametrize("head_dim", [32, 64, 256])  # unpadded K (24 + 8) and V (20), a kernel head dim, SM90's
def test_decompressed_operands(rng, head_dim):
    """The temporary cache by hand: each request with new tokens on consecutive pages, K = [W_UK c_kv | k_rope | 0],
    V = [W_UV c_kv | unwritten], zero rows past its keys; attention over it (the reference) is the MLA prefill, with
    NaN in V's unwritten columns."""
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, "fp32")
    c = pb.collection
    lengths = op.step_lengths(pb.input_row_offsets, c.cache_lengths)
    assert lengths == [(n, cl + n) for cl, n in zip(CACHED, NEW)]
    q, tmp = op.decompressed_operands(q_nope, q_rope, c, 1, w_uk, w_uv, lengths, head_dim)
    assert q.shape == (pb.total_rows, HEADS, head_dim) and not q[..., NOPE + 8:].any()
    assert torch.equal(q[..., :NOPE], q_nope) and torch.equal(q[..., NOPE:NOPE + 8], q_rope)
    assert tmp.page_size == op.PAGE and tmp.kv_dim == 2 and tmp.cache_lengths is c.cache_lengths
    page = 0
    for b, (num_q, num_keys) in enumerate(lengths):
        if not num_q:
            continue
        pages = -(-num_keys // op.PAGE)
        assert tmp.lookup_table[b, :pages].tolist() == list(range(page, page + pages))
        page += pages
        rows = pb.dense(0, 1, b, num_keys)[:, 0].float()  # [S, 40]
        k = tmp.blocks[page - pages:page, 0, 0].flatten(0, 1)  # [pages * PAGE, H, head_dim]
        v = tmp.blocks[page - pages:page, 1, 0].flatten(0, 1)
        torch.testing.assert_close(k[:num_keys, :, :NOPE], torch.einsum("hnr,sr->shn", w_uk, rows[:, :32]))
        assert torch.equal(k[:num_keys, :, NOPE:NOPE + 8], rows[:, None, 32:].expand(-1, HEADS, -1))
        torch.testing.assert_close(v[:num_keys, :, :V], torch.einsum("hvr,sr->shv", w_uv, rows[:, :32]))
        assert not k[:num_keys, :, NOPE + 8:].any()
        assert not k[num_keys:].any() and not v[num_keys:, :, :V].any()
    assert tmp.num_pages == page
    tmp.blocks[:, 1, ..., V:] = float("nan")
    o = cute_kv.paged_attention(q, pb.input_row_offsets, tmp, 0, scale=0.2)
    assert rel_err(o[..., :V], _want(pb, 1, q_nope, q_rope, w_uk, w_uv, 0.2)) < tol


@pytest.mark.parametrize("bad,match", [
    (dict(w_uk=torch.zeros(HEADS, NOPE + 1, 32)), "w_uk must be"),
    (dict(w_uk=torch.zeros(HEADS, NOPE, 31)), "latent_dim"),
    (dict(w_uv=torch.zeros(HEADS, V, 16)), "w_uv must be"),
    (dict(q_rope=torch.zeros(3, HEADS, 8)), "q_rope must be"),
    (dict(scale=-1.0), "scale must be"),
    (dict(out=torch.zeros(1, HEADS, V)), "out"),
    (dict(layer_idx=2), "layer"),
])
def test_bad_arguments(rng, bad, match):
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, "fp32")
    args = dict(q_nope=q_nope, q_rope=q_rope, input_row_offsets=pb.input_row_offsets, collection=pb.collection,
                layer_idx=0, w_uk=w_uk, w_uv=w_uv)
    args.update(bad)
    with pytest.raises((ValueError, TypeError, IndexError), match=match):
        cute_kv.mla_prefill(**args)


def test_needs_an_mla_cache(rng):
    pb = random_paged_batch([3], [2], num_heads=2, head_size=40, page_size=16, generator=rng, dtype=torch.float32)
    with pytest.raises(ValueError, match="MLA cache"):
        cute_kv.mla_prefill(torch.zeros(2, 4, 24), torch.zeros(2, 4, 8), pb.input_row_offsets, pb.collection, 0,
                            torch.zeros(4, 24, 32), torch.zeros(4, 20, 32))


# -- the kernels at 192/128 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("force_splits", [None, 3])
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_plan_replay_over_the_temporary_cache(rng, arch, force_splits):
    """The 192/128 kernel's grid over the op's temporary cache, replayed per CTA (``model_cta`` of
    ``test_attention_model`` (SM90) or ``test_attention_sm100``: 128-key tiles, masks, online softmax, P in 16 bits;
    O over V's 192-wide rows, of which the kernel keeps the first 128), then the split merge: the MLA prefill of the
    float64 reference."""
    import test_attention_model
    import test_attention_sm100
    from plan_replay import merge_splits, merge_splits_zero_empty, poisoned_partials

    from cute_kv.kernels.attention import config, sm100_config
    from cute_kv.ops.kernel_args import score_args
    from cute_kv.ops.splits import launch_shape

    spec = (64, 64, dict(head_size=128, dtype=torch.bfloat16), 2e-2)  # kv_lora_rank 64 + rope 64; K 128 + 64, V 128
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, spec, cached=[0, 300, 2], new=[130, 1, 40], nope=128, v=128)
    c = pb.collection
    lengths = op.step_lengths(pb.input_row_offsets, c.cache_lengths)
    route = op.plan(lengths, num_heads=HEADS, kv_lora_rank=64, rope_dim=64, nope_dim=128, v_dim=128,
                    dtype="bfloat16", arch=arch)
    assert route.kernel is not None and route.head_dim == 192
    q, tmp = op.decompressed_operands(q_nope, q_rope, c, 1, w_uk, w_uv, lengths, route.head_dim)
    bn = (config if arch == "sm_90a" else sm100_config).key_tile(192, 128)
    assert bn == 128 and sm100_config.q_tiles(192, 128, page_size=op.PAGE, group=1) == 1  # one Q tile at SM100
    slots = 132 if arch == "sm_90a" else test_attention_sm100.B200_SMS
    m_blocks, splits = launch_shape(tmp, HEADS, slots, config.BM, bn, True, num_tokens=q.shape[0])
    splits = force_splits or splits
    score_scale, cap_log2 = score_args(192, 0.1, None)
    o_part, lse_part = poisoned_partials(splits, pb.total_rows, HEADS, 192)
    offsets = pb.input_row_offsets.tolist()
    for b, (n, num_keys) in enumerate(lengths):
        pages = tmp.lookup_table[b, :-(-num_keys // op.PAGE)].long()
        k, v = (tmp.blocks[pages, kv, 0].flatten(0, 1)[:num_keys] for kv in (0, 1))  # the kernel's TMA rows
        for m_block in range(m_blocks):
            for head in range(HEADS if m_block * config.BM < n else 0):
                for split in range(splits):
                    if arch == "sm_90a":
                        (toks, heads), live, o, lse = test_attention_model.model_cta(
                            q, k, v, offsets[b], n, num_keys - n, m_block, head, split, splits, 1, True, 0, 0.1,
                            None, None, bn=bn)
                        toks, heads = torch.tensor(toks), torch.tensor(heads)
                        if o is None:
                            lse_part[split, offsets[b] + toks[live], heads[live]] = lse[live]
                            continue
                    else:
                        toks, heads, live, o, lse = test_attention_sm100.model_cta(
                            q, k, v, offsets[b], n, num_keys - n, m_block, head, split, splits, 1, True, 0,
                            score_scale, cap_log2, False, None, bn, config.BM)
                    o_part[split, offsets[b] + toks[live], heads[live]] = o[live]
                    lse_part[split, offsets[b] + toks[live], heads[live]] = lse[live]
    merge = merge_splits if arch == "sm_90a" else merge_splits_zero_empty  # (SM90: a skipped split writes no O)
    got = merge(o_part, lse_part)[0][..., :128]  # (V's other columns are unwritten: any value)
    assert not got.isnan().any()
    assert rel_err(got, _want(pb, 1, q_nope, q_rope, w_uk, w_uv, 0.1)) < tol


def test_sm100_value_dims():
    """K of 192 with V of 128: one Q tile and two 128-key stages (Q 48 KiB + 2 x 80 KiB), O in 128 TMEM columns; the
    other widths and an fp8 cache are refused by name."""
    from cute_kv.kernels.attention.sm100_config import SMEM_PER_CTA, TMEM_COLUMNS, key_tile, supported, tiling

    plan = tiling(192, op.PAGE, False, 128)
    assert (plan.bn, plan.stages, plan.gather4, plan.stage_bytes) == (128, 2, False, 128 * 320 * 2)
    assert plan.q_tiles == 1  # two 48 KiB Q tiles leave no room for two stages
    assert plan.smem == 3072 + 128 * 192 * 2 + 2 * 128 * 320 * 2 == 216064 <= SMEM_PER_CTA
    assert plan.tmem_columns == 2 * 128 + 128 <= TMEM_COLUMNS
    assert key_tile(192, 128) == 128 and key_tile(256) == 64 and key_tile(128) == 128
    assert supported(128, 128, 192, op.PAGE, "bfloat16", v_dim=128) is None
    assert "v_dim (64)" in supported(128, 128, 192, op.PAGE, "bfloat16", v_dim=64)
    assert "v_dim (64)" in supported(8, 8, 128, op.PAGE, "bfloat16", v_dim=64)
    assert "16-bit cache" in supported(8, 8, 192, op.PAGE, "float8_e4m3fn", v_dim=128)
    assert supported(8, 8, 192, op.PAGE, "bfloat16") is None  # 192 / 192 too, in 64-key tiles
    assert "head_dim must be" in supported(8, 8, 160, op.PAGE, "bfloat16")


@pytest.mark.compile
def test_sm100_192_128_ptx():
    """DeepSeek's decompressed heads (128 of them, as a TP-1 prefill runs): K of 192, V of 128 in pages of 128."""
    (_, build), _ = op.compile_units(op.plan([(4096, 4096)], dtype="bfloat16", arch="sm_100a", **DS).kernel.key,
                                     "sm_100a")
    kernel, *_ = build()
    assert (kernel.head_dim, kernel.v_dim, kernel.bn, kernel.stages, kernel.gather4) == (192, 128, 128, 2, False)
    assert kernel.plan.tmem_columns == 384 and kernel.plan.smem == 216064
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    mma = r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\],\s*"
    assert len(re.findall(mma + r"%rd\d+,\s*%rd\d+,", ptx)) == 192 // 16  # QK over the 192 head dims
    assert len(re.findall(mma + r"\[%r\d+\],\s*%rd\d+,", ptx)) == 128 // 16  # PV: K = the 128-key tile
    # S read in 4 loads of 32 columns (in each of the softmax's three loops), O (128 columns) rescaled (in the
    # correction's loop and its peeled last key tile) and read by the epilogue in 4 each; O leaves by two 64-column
    # TMA stores.
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x32.b32") == 3 * 4 + 3 * 4
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x32.b32") == 2 * 4
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)) == 2
    # K and V of a tile (the page is the tile) in boxes of 64 columns, the 128-byte swizzle: 3 of K, 2 of V (its
    # first 128 of the 192-wide rows); the stage's transaction bytes are those 320 columns of 128 rows.
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile", ptx)) == 3 + 2
    assert re.search(r"mov\.b32\s+%r\d+,\s*81920;\s*mbarrier\.arrive\.expect_tx", ptx)
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == str(kernel.threads)


@pytest.mark.compile
@pytest.mark.parametrize("page_size,flags", [(4, {}), (32, {"softcap": True, "sinks": True, "return_lse": True})],
                         ids=["gather4", "page-slots-flags"])
def test_sm100_192_128_other_pages(page_size, flags, tmp_path):
    """The 192/128 kernel beyond the op's 128-token pages: pages of 4 by gather4 (4 rows of one 64-column box per
    instruction: 32 groups x (3 K + 2 V boxes)), pages of 32 by one TMA per page slot (4 x (3 + 2)), with the flags;
    no spills."""
    from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

    kernel = PagedAttentionSm100("bfloat16", 32, 8, 192, page_size, 2, page_size > 4, v_dim=128, **flags)
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    assert ptx.count("tcgen05.mma") == 192 // 16 + 128 // 16
    gather4 = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4", ptx))
    tiles = len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.", ptx))
    assert (gather4, tiles) == ((32 * 5, 0) if kernel.gather4 else (0, 4 * 5))
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x32.b32") == 2 * 128 // 32  # O's rescale (two copies): 128 columns
    (tmp_path / "k.ptx").write_text(ptx)
    info = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(tmp_path / "k.ptx"), "-o", "/dev/null"],
                          capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in info


# -- GPU --------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [([0, 300, 1, 0], [200, 129, 1, 0]), ([1000], [100])],
                         ids=["ragged", "split-kv"])  # one 100-token block over 9 key tiles: the kernel splits
@pytest.mark.parametrize("path", [op.DECOMPRESSED, op.ABSORBED])
@pytest.mark.parametrize("cache", ["bf16", "rope-aware fp8"])
def test_op_gpu(rng, monkeypatch, cache, path, lengths):
    """DeepSeek head dims (nope 128 + rope 64, v 128; kv_lora_rank 512 through a 576-wide or 640-byte cache), 16
    heads; the decompressed path runs the 192/128 kernel on SM100 and SM90 (strict: no reference
    fallback; the absorbed path over rope-aware FP8 caches has no kernel yet)."""
    kw = dict(head_size=576, dtype=torch.bfloat16) if cache == "bf16" else dict(
        head_size=640, dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=64)
    pb, q_nope, q_rope, w_uk, w_uv, tol = _inputs(rng, (512, 64, kw, 2e-2), *lengths, page_size=64, heads=16,
                                                  nope=128, v=128, device="cuda")
    q_nope, q_rope, w_uk, w_uv = (x.to(torch.bfloat16) for x in (q_nope, q_rope, w_uk, w_uv))
    pb.poison_unread(1)
    _force(monkeypatch, path)
    if path == op.DECOMPRESSED or cache == "bf16":
        monkeypatch.setenv("CUTE_KV_STRICT", "1")
    out = torch.full((pb.total_rows, 16, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    blocks = pb.collection.blocks.clone()
    cute_kv.mla_prefill(q_nope, q_rope, pb.input_row_offsets, pb.collection, 1, w_uk, w_uv, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any()
    assert rel_err(out, _want(pb, 1, q_nope, q_rope, w_uk, w_uv)) < tol
    assert torch.equal(pb.collection.blocks.view(torch.uint8), blocks.view(torch.uint8))
