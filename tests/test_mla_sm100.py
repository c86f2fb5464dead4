"""``MlaDecodeSm100``: which calls it serves (host), its plan replayed in PyTorch (no GPU), what it compiles to for
sm_100a (PTX and ptxas), and the kernel against float64 oracles on a B200 (``gpu``, skipped elsewhere).

The plan replay walks the grid the host launches (``launch_shape`` / ``launch_shape_sparse``: 128 packed (token,
head) rows, two value halves, 32-key tiles (16 over rope-aware FP8 rows), splits) and does per CTA what
``kernels/mla/sm100.py`` does: the split's
tile range, each key's row in the layer's row view (dense: the lookup table; sparse: ``get_tma_row`` of the encoded
entry, the one-past-the-end sentinel for -1, entries past ``topk_lengths`` and entries outside ``[0, N*P)``, read as
TMA's zero fill from the cache flattened to rows), per-row masks, soft-cap, the base-2 online softmax with the
kernel's guards, P rounded to 16 bits, the O half rescaled before each ``P V``, the sink in split 0's denominator,
and the split merge. Rope-aware FP8 rows are read as the converter writes them: ``content * scale`` (the float32
product) and the bf16 rope, each rounded to q's dtype. The oracles index the 6-D cache directly and decode rope-aware
rows by hand from their bytes (e4m3 and bf16 bit fields), in float64.
"""

import math
import os
import re
import subprocess
import sys

from typing import Optional

import cutlass
import cutlass.cute as cute
import pytest
import torch
from cutlass import Int32
from cutlass.cute.runtime import from_dlpack
from hypothesis import given, settings
from hypothesis import strategies as st

import artifacts

from cute_kv import reference as ref
from cute_kv.kernels import catalog
from cute_kv.kernels.mla.sm100_config import (BM, BN, EXCHANGE, FP8_BN, O_COLS, QK_COLS, SLICE, SMEM_PER_CTA,
                                              TMEM_COLUMNS, V_SPLIT, content_boxes, exchange_rotation, exchange_slot,
                                              live_warps, qk_start, slice_start, tiling)
from cute_kv.ops import mla_decode_sm100
from cute_kv.ops.paged_attention import plan
from cute_kv.ops.kernel_args import score_args
from cute_kv.paged_cache import _raw
from cute_kv.reference.batch import random_paged_batch

from numerics import rel_err
from plan_replay import merge_splits_zero_empty, poisoned_partials
from test_mla_rope_aware import decode_by_hand

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)

import barriers  # noqa: E402
import mla_mma_work  # noqa: E402
import static  # noqa: E402

NEG_INF = float("-inf")
LN2 = math.log(2.0)
B200_SMS = 148
LATENT, V_DIM = 576, 512
ROPE, ROW_BYTES = 64, 640  # DeepSeek's rope-aware FP8 rows: 512 e4m3 content bytes, 64 bf16 rope values
FP8 = torch.float8_e4m3fn


def _mla_batch(cache_lengths, new_lengths, page_size, seed=0, num_layers=2, spare_pages=3, dtype=torch.bfloat16,
               rope_aware=False, device="cpu"):
    """A 16-bit latent cache, or (``rope_aware``) DeepSeek's rope-aware FP8 one with fresh scales: random, not the
    powers of two the store's amax gives small values, so ``content * scale`` rounds when made 16-bit."""
    g = torch.Generator().manual_seed(seed)
    if not rope_aware:
        return random_paged_batch(cache_lengths, new_lengths, num_heads=1, head_size=LATENT, page_size=page_size,
                                  is_mla=True, num_layers=num_layers, spare_pages=spare_pages, dtype=dtype,
                                  generator=g, device=device)
    pb = random_paged_batch(cache_lengths, new_lengths, num_heads=1, head_size=ROW_BYTES, page_size=page_size,
                            is_mla=True, num_layers=num_layers, spare_pages=spare_pages, dtype=FP8,
                            scale_dtype=torch.float32, rope_dim=ROPE, generator=g, device=device)
    scales = pb.collection.scales
    scales.copy_((torch.rand(scales.shape, generator=g) * 0.02 + 0.001).to(device))
    return pb


# -- host: what the kernel serves ------------------------------------------------------------------------------------

def test_sm100_mla_serves_16_bit_latent_caches():
    for page_size, dtype in ((1, torch.bfloat16), (16, torch.float16), (64, torch.bfloat16), (3, torch.bfloat16)):
        pb = _mla_batch([5, 40], [3, 1], page_size, dtype=dtype)
        q = torch.zeros(pb.total_rows, 16, LATENT, dtype=dtype)
        path = plan(pb.collection, q, "sm_100a", None, 5.0, torch.zeros(16), True, V_DIM, None)
        assert path.path == "kernel" and path.kernel == "MlaDecodeSm100"
        assert path.key == ("mla_decode_sm100", str(dtype).split(".")[-1], 16, LATENT, V_DIM, page_size, False, True,
                            True, True, False, None)


@pytest.mark.parametrize("case", [
    ({"mla_v_dim": 448}, "mla_v_dim"),
    ({"window": 8}, "sliding window"),
    ({"q_dtype": torch.float16}, "need them equal"),
    ({"head_size": 128}, "latent dims"),
    ({"scale": -1.0}, "non-positive scale"),
    ({"arch": "sm_120a"}, "no attention kernel for sm_120a"),
])
def test_sm100_mla_leaves_the_rest_to_the_reference(case):
    args, reason = case
    pb = random_paged_batch([5], [2], num_heads=1, head_size=args.get("head_size", LATENT), page_size=16,
                            is_mla=True, generator=torch.Generator().manual_seed(1))
    q = torch.zeros(pb.total_rows, 8, pb.collection.head_size, dtype=args.get("q_dtype", torch.bfloat16))
    path = plan(pb.collection, q, args.get("arch", "sm_100a"), args.get("scale"), None, None, False,
                args.get("mla_v_dim", min(V_DIM, pb.collection.head_size)), args.get("window"))
    assert path.path == "reference" and reason in path.reason, path.reason


def test_sm100_mla_dispatch_reaches_the_kernel_plan():
    # paged_attention's explain (what dispatch asks) hands mla_v_dim and window to the MLA plan.
    from cute_kv.ops.paged_attention import explain

    pb = _mla_batch([7], [2], 16)
    q = torch.zeros(pb.total_rows, 16, LATENT, dtype=torch.bfloat16)
    path = explain(q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=V_DIM, arch="sm_100a")
    assert path.kernel == "MlaDecodeSm100" and path.key[4] == V_DIM
    path = explain(q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=V_DIM, window=4, arch="sm_100a")
    assert path.path == "reference" and "sliding window" in path.reason


def test_sm100_mla_serves_rope_aware_fp8_caches():
    for page_size, dtype in ((1, torch.bfloat16), (64, torch.float16), (3, torch.bfloat16)):
        pb = _mla_batch([5, 40], [3, 1], page_size, rope_aware=True)
        q = torch.zeros(pb.total_rows, 16, LATENT, dtype=dtype)
        path = plan(pb.collection, q, "sm_100a", None, None, None, False, V_DIM, None)
        assert path.path == "kernel" and path.kernel == "MlaDecodeSm100", path.reason
        assert path.key == ("mla_decode_sm100", str(dtype).split(".")[-1], 16, LATENT, V_DIM, page_size, False,
                            False, False, False, False, ROPE)
    indices = torch.zeros(1, 64, dtype=torch.int32)
    path = mla_decode_sm100.plan_sparse(pb.collection, q[:1], indices, "sm_100a", mla_v_dim=V_DIM)
    assert path.key[6] and path.key[-1] == ROPE
    assert mla_decode_sm100.launch_shape_sparse(1, 16, 64, B200_SMS, ROPE)[1] <= 64 // FP8_BN


@pytest.mark.parametrize("case", [
    (dict(head_size=96, rope_dim=16), "rope_dim (64,)"),  # 64 content bytes + 16 rope: latent 80
    (dict(head_size=384, rope_dim=64), "latent dims"),  # 256 + 64: latent 320
])
def test_sm100_mla_rope_aware_geometries_left_to_the_reference(case):
    geometry, reason = case
    pb = random_paged_batch([5], [2], num_heads=1, page_size=16, is_mla=True, dtype=FP8, scale_dtype=torch.float32,
                            generator=torch.Generator().manual_seed(1), **geometry)
    q = torch.zeros(pb.total_rows, 8, pb.collection.latent_dim, dtype=torch.bfloat16)
    path = plan(pb.collection, q, "sm_100a", None, None, None, False, 64, None)
    assert path.path == "reference" and reason in path.reason, path.reason


def test_sm100_mla_sparse_plan():
    pb = _mla_batch([5], [2], 64)
    q = torch.zeros(2, 128, LATENT, dtype=torch.bfloat16)
    indices = torch.zeros(2, 2048, dtype=torch.int32)
    path = mla_decode_sm100.plan_sparse(pb.collection, q, indices, "sm_100a", mla_v_dim=V_DIM,
                                        topk_lengths=torch.ones(2, dtype=torch.int32))
    assert path.key == ("mla_decode_sm100", "bfloat16", 128, LATENT, V_DIM, 64, True, False, False, False, True, None)
    no = mla_decode_sm100.plan_sparse(pb.collection, q, indices.long(), "sm_100a", mla_v_dim=V_DIM)
    assert no.path == "reference" and "int32" in no.reason


def test_sm100_mla_sparse_launch_rejects_mismatched_indices():
    pb = _mla_batch([5], [2], 64)
    q = torch.zeros(2, 16, LATENT, dtype=torch.bfloat16)
    out = torch.empty(2, 16, V_DIM, dtype=torch.bfloat16)
    key = ("mla_decode_sm100", "bfloat16", 16, LATENT, V_DIM, 64, True, False, False, False, True, None)
    run = mla_decode_sm100.launch_sparse(key, "sm_100a")  # nothing compiles before the checks pass
    good = torch.zeros(2, 8, dtype=torch.int32)
    lengths = torch.ones(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="indices must be int32"):
        run(q, pb.collection, 0, torch.zeros(1, 8, dtype=torch.int32), topk_lengths=lengths, out=out)
    with pytest.raises(ValueError, match="indices must be int32"):
        run(q, pb.collection, 0, good.long(), topk_lengths=lengths, out=out)
    with pytest.raises(ValueError, match="topk_lengths must be int32"):
        run(q, pb.collection, 0, good, topk_lengths=torch.ones(3, dtype=torch.int32), out=out)
    with pytest.raises(ValueError, match="exactly when the plan"):
        run(q, pb.collection, 0, good, out=out)


def test_sm100_mla_tiling_fits_one_cta_per_sm():
    t = tiling(LATENT)
    # A 128 x 320 Q slice, P 128 x 32 (16-bit), two 128 x 32 float32 exchange buffers, four 32 x 320 key stages,
    # barriers and row arrays: one CTA per SM.
    assert (t.stages, t.q_bytes, t.p_bytes, t.exchange_bytes, t.stage_bytes, t.tx_bytes) == (
        4, 81920, 8192, 32768, 20480, 20480)
    assert t.smem == 205824 <= SMEM_PER_CTA
    assert t.tmem_columns == 2 * BN + O_COLS == 320 <= TMEM_COLUMNS
    assert V_SPLIT * O_COLS == V_DIM
    # Rope-aware FP8: 16-key tiles; P 128 x 16, two converted 16 x 320 16-bit tiles, four landing stages of 16 rows
    # x (512 e4m3 + 64 bf16) bytes, of which a CTA loads 384 a row (three content boxes, or two and the rope); row
    # and scale arrays in the fixed kilobytes.
    f = tiling(LATENT, ROPE)
    assert (f.bn, f.stages, f.q_bytes, f.p_bytes, f.exchange_bytes, f.stage_bytes, f.tx_bytes, f.mma_tiles) == (
        16, 4, 81920, 4096, 16384, 10240, 6144, 20480)
    assert f.fixed == 2048 and f.smem == 165888 <= SMEM_PER_CTA
    assert f.tmem_columns == 2 * FP8_BN + O_COLS == 288 <= TMEM_COLUMNS


def test_sm100_mla_pair_splits_the_latent_columns():
    """The pair's QK columns tile the latent row once, each inside its CTA's slice at 16-column MMA steps; a
    CTA's value half is the start of its slice; an fp8 slice's content lies in the boxes it loads."""
    covered = []
    for rank in range(V_SPLIT):
        cols, qk = cta_slice(rank)
        assert cols.start >= 0 and cols.stop <= LATENT and cols.stop - cols.start == SLICE
        assert qk.start % 16 == 0 and qk.stop <= SLICE
        covered += list(range(cols.start + qk.start, cols.start + qk.stop))
        assert cols.start == rank * O_COLS  # V: the slice's first O_COLS columns
        content = range(cols.start, min(cols.stop, LATENT - ROPE))
        boxes = content_boxes(rank, LATENT - ROPE)
        assert boxes.start * 128 <= content.start and content.stop <= boxes.stop * 128
    assert covered == list(range(LATENT))
    assert [list(content_boxes(r, LATENT - ROPE)) for r in range(V_SPLIT)] == [[0, 1, 2], [2, 3]]


def test_sm100_mla_live_warps_hold_every_request_row():
    for rows in range(1, BM + 1):
        live = live_warps(rows)
        assert 1 <= live <= BM // 32 and (rows - 1) // 32 < live and 32 * (live - 1) < rows


@pytest.mark.parametrize("bn", [BN, FP8_BN])
def test_sm100_mla_exchange_rows_avoid_bank_conflicts(bn):
    """Each 8-thread phase of the exchange's 16-byte stores and loads (chunk ``c`` of rows t..t+7) hits 8 distinct
    bank groups (16 bytes each of a 128-byte line), for every chunk."""
    chunks = bn // 4
    for c in range(chunks):
        for first in range(0, BM, 8):
            groups = {(t * bn * 4 + (c ^ exchange_rotation(t, chunks)) * 16) // 16 % 8 for t in range(first, first + 8)}
            assert len(groups) == 8, (bn, c, first, groups)


class _Barrier:
    """An mbarrier under PTX's phase rules: a phase completes when its pending arrivals and its transaction count
    are both 0 (the count may go negative: bytes landing before the expect-tx)."""

    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def _settle(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def arrive_expect_tx(self, nbytes):
        self.tx += nbytes
        self.pending -= 1
        assert self.pending >= 0
        self._settle()

    def complete_tx(self, nbytes):
        self.tx -= nbytes
        self._settle()

    def parity_done(self, parity):  # try_wait.parity: the phase of that parity has completed
        return self.phase % 2 != parity


def _exchange_schedule(rng, slot, threads, live, tiles, buffers):
    """One random interleaving of ``MlaDecodeSm100.exchange`` over a pair of CTAs of ``threads`` softmax threads,
    the first ``live`` exchanging: thread 0 arms its barrier ``slot(j)[0]`` with ``live`` rows' bytes, each live
    thread stores its row into the peer (landing any time later, in any order), waits on ``slot(j)``'s parity and
    reads the peer's row. Raises on a deadlock, a read of another tile's row, a row overwritten before it was read,
    or a wait that passes on a phase other than its tile's."""
    bars = [[_Barrier(1) for _ in range(buffers)] for _ in range(2)]
    rows = [[[None] * threads for _ in range(buffers)] for _ in range(2)]
    unread = [[[False] * threads for _ in range(buffers)] for _ in range(2)]
    flight = []  # (CTA, buffer, row, tile) stores on their way
    pc = {(c, t): [0, 0] for c in range(2) for t in range(threads)}  # tile, step: arm, send, wait, read
    while True:
        ready = []
        for (c, t), (j, step) in pc.items():
            if j < tiles and not (step == 2 and t < live and not bars[c][slot(j)[0]].parity_done(slot(j)[1])):
                ready.append((c, t))
        if not ready and not flight:
            assert all(j == tiles for j, _ in pc.values()), f"deadlock: {pc}"
            return
        pick = rng.randrange(len(ready) + len(flight))
        if pick >= len(ready):
            c, b, r, j = flight.pop(pick - len(ready))
            assert not unread[c][b][r], f"tile {j} overwrote CTA {c}'s unread row {r} of tile {rows[c][b][r]}"
            rows[c][b][r], unread[c][b][r] = j, True
            bars[c][b].complete_tx(1)
            continue
        c, t = ready[pick]
        j, step = pc[(c, t)]
        b, parity = slot(j)
        if step == 0 and t == 0:
            bars[c][b].arrive_expect_tx(live)
        elif step == 1 and t < live:
            flight.append((1 - c, b, t, j))
        elif step == 2 and t < live:
            assert bars[c][b].phase == j // buffers + 1, f"tile {j} passed its wait in phase {bars[c][b].phase}"
        elif step == 3 and t < live:
            assert rows[c][b][t] == j, f"CTA {c} row {t} read tile {rows[c][b][t]} for tile {j}"
            unread[c][b][t] = False
        pc[(c, t)] = [j, step + 1] if step < 3 else [j + 1, 0]


def test_sm100_mla_exchange_protocol_replays():
    """The exchange's buffers and parities (``exchange_slot``) under random interleavings of the pair's threads and
    of the stores' landing: no deadlock, every row read is the peer's row of the same tile, none is overwritten
    before it is read, with padding warps out of the exchange. The model can fail: one buffer, or a parity that
    alternates every tile, each break it."""
    import random

    rng = random.Random(7)
    for seed in range(300):
        _exchange_schedule(rng, exchange_slot, 4, 1 + seed % 4, 7, EXCHANGE)
    broken = {"one buffer": (lambda j: (0, j % 2), 1), "parity of j": (lambda j: (j % EXCHANGE, j % 2), EXCHANGE)}
    for name, (slot, buffers) in broken.items():
        failures = 0
        for _ in range(300):
            try:
                _exchange_schedule(rng, slot, 4, 4, 7, buffers)
            except AssertionError:
                failures += 1
        assert failures, name


def test_sm100_mla_splits_fill_the_gpu():
    pb = _mla_batch([4000], [1], 64)
    m_blocks, splits = mla_decode_sm100.launch_shape(pb.collection, 128, B200_SMS, num_tokens=1)
    assert m_blocks == 1 and splits > 1  # one request: the key range is split to reach the SMs
    assert V_SPLIT * splits * m_blocks <= 2 * B200_SMS
    m_blocks, splits = mla_decode_sm100.launch_shape_sparse(64, 128, 2048, B200_SMS)
    assert m_blocks == 1 and 1 <= splits
    assert mla_decode_sm100.launch_shape_sparse(3, 16, 0, B200_SMS) == (1, 1)  # no keys: one split, no tile


# -- plan replay -----------------------------------------------------------------------------------------------------

def _split_tiles(m0, seq_len, cache_len, num_keys, causal, split, splits, group, bn):
    tok_last = (min(m0 + BM, seq_len * group) - 1) // group
    k_end = cache_len + tok_last + 1 if causal else num_keys
    tiles = -(-k_end // bn)
    per_split = -(-tiles // splits)
    return split * per_split, max(min(per_split, tiles - split * per_split), 0)


def _row_view(c, layer, dtype):
    """The kernel's gather4 source: the cache flattened to ``[rows, 576]`` from the layer's plane, ``oob_row`` rows.
    Rope-aware FP8 rows as the converter writes them into the 16-bit key tile: ``content * scale`` (float32, the
    scale of the same row of the flattened scales) then the bf16 rope, rounded to q's ``dtype``."""
    n, kvd, nl, p = c.blocks.shape[:4]
    flat = c.blocks.reshape(-1, c.blocks.shape[-1])[layer * p:]
    if c.rope_dim is not None:
        scales = c.scales.reshape(-1)[layer * p:]
        content = flat[:, :c.padded_depth].float() * scales[:, None]
        rope = _raw(flat)[:, c.padded_depth:].contiguous().view(torch.bfloat16).float()
        flat = torch.cat([content.to(dtype), rope.to(dtype)], dim=1)
    return flat, (n - 1) * kvd * nl * p + p, kvd * nl * p


def _key_tile(c):
    return mla_decode_sm100.key_tile(c.rope_dim)


def cta_slice(rank):
    """The latent columns CTA ``rank`` of a pair holds of Q and of each key row, and the part of its slice it
    multiplies into its partial S (the kernel's k-blocks from ``qk_start(rank) / 16``)."""
    return slice(slice_start(rank), slice_start(rank) + SLICE), slice(qk_start(rank), qk_start(rank) + QK_COLS)


def model_cta(qr, keys_rows, rows, oob_row, row_end, first_tile, n_tiles, v_half, score_scale, cap_log2, softcap,
              dtype, bn, sparse=False):
    """CTA ``v_half`` of a pair over its packed rows ``qr [BM, 576]``: ``(O half / l [BM, 256], row_max,
    row_sum)`` (base 2). S is the sum of the pair's partials, each over its own slice's QK columns (the exchange);
    V is the first ``O_COLS`` columns of the CTA's slice. Keys are masked past ``row_end``, and (sparse) where the
    entry names no row; a dense key inside ``row_end`` is not masked even when its row is the zero-filled one (a
    page column past the lookup row)."""
    row_max = torch.full((BM,), NEG_INF, dtype=torch.float64)
    row_sum = torch.zeros(BM, dtype=torch.float64)
    acc = torch.zeros(BM, O_COLS, dtype=torch.float64)
    for t in range(first_tile, first_tile + n_tiles):
        key_rows = [keys_rows(t * bn + i) for i in range(bn)]
        kt = torch.zeros(bn, qr.shape[1], dtype=torch.float64)
        for i, r in enumerate(key_rows):
            if 0 <= r < oob_row:  # TMA: rows outside the view are zero-filled
                kt[i] = rows[r].double()
        partials = []
        for rank in range(V_SPLIT):
            cols, qk = cta_slice(rank)
            partials.append(qr[:, cols][:, qk] @ kt[:, cols][:, qk].T)
        s = sum(partials) * score_scale
        if softcap:
            s = cap_log2 * torch.tanh(s)
        keys = torch.arange(t * bn, (t + 1) * bn)
        invalid = torch.tensor([sparse and r == oob_row for r in key_rows])
        s = s.masked_fill((keys[None, :] >= row_end[:, None]) | invalid[None, :], NEG_INF)
        new_max = torch.maximum(row_max, s.max(dim=1).values)
        ref_max = torch.where(new_max == NEG_INF, 0.0, new_max)
        corr = torch.exp2(row_max - ref_max)
        p = torch.exp2(s - ref_max[:, None])
        row_sum = row_sum * corr + p.sum(dim=1)
        row_max = new_max
        p16 = p.to(dtype).double()
        acc = acc * corr[:, None] + p16 @ kt[:, cta_slice(v_half)[0]][:, :O_COLS]
    return acc, row_max, row_sum


def _epilogue(acc, row_max, row_sum, sinks, heads, split):
    total, top = row_sum.clone(), row_max.clone()
    if sinks is not None and split == 0:
        sink = sinks[heads].double() / LN2
        top = torch.maximum(row_max, sink)
        total = row_sum * torch.exp2(row_max - top) + torch.exp2(sink - top)
    inv = torch.where(row_sum > 0, torch.exp2(row_max - top) / total, 0.0)
    o = torch.where((row_sum > 0)[:, None], acc * inv[:, None], 0.0)
    lse = torch.where(total > 0, top + torch.log2(total), NEG_INF)
    return o, lse


def model_dense(q, pb, layer, *, causal=True, scale=None, softcap=None, sinks=None, slots=B200_SMS,
                force_splits=None):
    """The whole dense launch (grid, value halves, splits, combine): float64 ``(out [T, Hq, 512], lse [T, Hq])``."""
    c = pb.collection
    t, hq, d = q.shape
    score_scale, cap_log2 = score_args(d, scale, softcap)
    m_blocks, splits = mla_decode_sm100.launch_shape(c, hq, slots, causal, num_tokens=t)
    splits = force_splits or splits
    o_part, lse_part = poisoned_partials(splits, t, hq, V_DIM)
    rows, oob_row, rows_per_page = _row_view(c, layer, q.dtype)
    bn = _key_tile(c)
    lut = c.lookup_table.long()
    p = c.page_size
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        num_keys = cache_len + n

        def key_row(key, b=b, num_keys=num_keys):  # a page column past the lookup row (unchecked lengths): no row
            if key >= num_keys or key // p >= lut.shape[1]:
                return oob_row
            return int(lut[b, key // p]) * rows_per_page + key % p

        for m_block in range(m_blocks):
            m0 = m_block * BM
            if m0 >= n * hq:
                continue
            toks = torch.arange(m0, m0 + BM) // hq
            heads = torch.arange(m0, m0 + BM) % hq
            live = toks < n
            qr = torch.zeros(BM, d, dtype=torch.float64)
            qr[live] = q[offsets[b] + toks[live], heads[live]].double()
            row_end = torch.clamp(cache_len + toks + 1, max=num_keys) if causal else torch.full((BM,), num_keys)
            row_end = torch.where(live, row_end, 0)
            for split in range(splits):
                first, count = _split_tiles(m0, n, cache_len, num_keys, causal, split, splits, hq, bn)
                for v_half in range(V_SPLIT):
                    acc, mx, sm = model_cta(qr, key_row, rows, oob_row, row_end, first, count, v_half, score_scale,
                                            cap_log2, bool(softcap), q.dtype, bn)
                    o, lse = _epilogue(acc, mx, sm, sinks, heads, split)
                    o_part[split, offsets[b] + toks[live], heads[live], v_half * O_COLS:(v_half + 1) * O_COLS] = \
                        o[live]
                    lse_part[split, offsets[b] + toks[live], heads[live]] = lse[live]
    return merge_splits_zero_empty(o_part, lse_part)


def model_sparse(q, c, layer, indices, *, topk_lengths=None, scale=None, softcap=None, sinks=None, slots=B200_SMS,
                 force_splits=None):
    """The whole sparse launch: one token's heads per row block, keys from its encoded entries."""
    t, hq, d = q.shape
    topk = indices.shape[1]
    score_scale, cap_log2 = score_args(d, scale, softcap)
    m_blocks, splits = mla_decode_sm100.launch_shape_sparse(t, hq, topk, slots, c.rope_dim)
    splits = force_splits or splits
    o_part, lse_part = poisoned_partials(splits, t, hq, V_DIM)
    rows, oob_row, rows_per_page = _row_view(c, layer, q.dtype)
    bn = _key_tile(c)
    p, num_slots = c.page_size, c.blocks.shape[0] * c.page_size
    for tok in range(t):
        num_keys = topk if topk_lengths is None else max(min(int(topk_lengths[tok]), topk), 0)

        def key_row(key, tok=tok, num_keys=num_keys):
            if key >= num_keys:
                return oob_row
            enc = int(indices[tok, key])
            return (enc // p) * rows_per_page + enc % p if 0 <= enc < num_slots else oob_row

        for m_block in range(m_blocks):
            m0 = m_block * BM
            heads = torch.arange(m0, m0 + BM) % hq
            live = torch.arange(m0, m0 + BM) < hq
            qr = torch.zeros(BM, d, dtype=torch.float64)
            qr[live] = q[tok, heads[live]].double()
            row_end = torch.where(live, num_keys, 0)
            for split in range(splits):
                first, count = _split_tiles(m0, 1, 0, num_keys, False, split, splits, hq, bn)
                for v_half in range(V_SPLIT):
                    acc, mx, sm = model_cta(qr, key_row, rows, oob_row, row_end, first, count, v_half, score_scale,
                                            cap_log2, bool(softcap), q.dtype, bn, sparse=True)
                    o, lse = _epilogue(acc, mx, sm, sinks, heads, split)
                    o_part[split, tok, heads[live], v_half * O_COLS:(v_half + 1) * O_COLS] = o[live]
                    lse_part[split, tok, heads[live]] = lse[live]
    return merge_splits_zero_empty(o_part, lse_part)


def _attend(qv, keys, scale, softcap, sink):
    """float64 attention of one query over ``keys [n, 576]`` (values: their first 512 dims): ``(out, lse)``."""
    s = scale * (keys @ qv)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    terms = s if sink is None else torch.cat([s, sink.reshape(1).double()])
    if terms.numel() == 0 or terms.max() == NEG_INF:
        return torch.zeros(V_DIM, dtype=torch.float64), NEG_INF
    m = terms.max()
    denom = torch.exp(terms - m).sum()
    return (torch.exp(s - m) @ keys[:, :V_DIM]) / denom, float(m + torch.log(denom))


def _oracle_key(c, layer, page, slot):
    """float64 logical row of (page, slot): the 16-bit row, or a rope-aware FP8 row decoded by hand."""
    if c.rope_dim is None:
        return c.blocks[page, 0, layer, slot, 0].double()
    return decode_by_hand(_raw(c.blocks)[page, 0, layer, slot, 0], c.scales[page, 0, layer, slot, 0], c.padded_depth)


def oracle_dense(q, pb, layer, *, causal=True, scale=None, softcap=None, sinks=None):
    c = pb.collection
    t, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, hq, V_DIM, dtype=torch.float64)
    lse = torch.full((t, hq), NEG_INF, dtype=torch.float64)
    offsets = pb.input_row_offsets.tolist()
    for b, (cache_len, n) in enumerate(zip(pb.cache_lengths, pb.new_lengths)):
        pages = c.lookup_table[b].long()
        keys = torch.stack([_oracle_key(c, layer, pages[k // c.page_size], k % c.page_size)
                            for k in range(cache_len + n)]) if cache_len + n else \
            torch.zeros(0, d, dtype=torch.float64)
        for i in range(n):
            visible = cache_len + i + 1 if causal else cache_len + n
            for h in range(hq):
                out[offsets[b] + i, h], lse[offsets[b] + i, h] = _attend(
                    q[offsets[b] + i, h].double(), keys[:visible], scale, softcap, None if sinks is None else sinks[h])
    return out, lse


def oracle_sparse(q, c, layer, indices, *, topk_lengths=None, scale=None, softcap=None, sinks=None):
    t, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    p, n = c.page_size, c.blocks.shape[0]
    out = torch.zeros(t, hq, V_DIM, dtype=torch.float64)
    lse = torch.full((t, hq), NEG_INF, dtype=torch.float64)
    for tok in range(t):
        ents = indices[tok].tolist()
        if topk_lengths is not None:
            ents = ents[:max(int(topk_lengths[tok]), 0)]
        ents = [e for e in ents if 0 <= e < n * p]
        keys = torch.stack([_oracle_key(c, layer, e // p, e % p) for e in ents]) if ents else \
            torch.zeros(0, d, dtype=torch.float64)
        for h in range(hq):
            out[tok, h], lse[tok, h] = _attend(q[tok, h].double(), keys, scale, softcap,
                                               None if sinks is None else sinks[h])
    return out, lse


def _check(got, want):
    out, lse = got
    out_w, lse_w = want
    assert out.shape == out_w.shape
    if out_w.norm() == 0:  # no row sees a key (empty step, no valid entry): zeros exactly
        assert torch.equal(out, torch.zeros_like(out))
    else:
        assert rel_err(out, out_w) < 2e-2
    assert torch.equal(lse == NEG_INF, lse_w == NEG_INF)
    finite = lse_w != NEG_INF
    assert torch.allclose(lse[finite], lse_w[finite], atol=2e-2)


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 90), st.integers(0, 3)), min_size=1, max_size=2),
    page_size=st.sampled_from([1, 3, 16, 64]),
    heads=st.sampled_from([16, 128, 96]),
    causal=st.booleans(),
    splits=st.one_of(st.none(), st.integers(2, 3)),
    softcap=st.one_of(st.none(), st.just(20.0)),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sm100_mla_dense_plan_matches_the_oracle(lengths, page_size, heads, causal, splits, softcap, sinks, seed):
    pb = _mla_batch([a for a, _ in lengths], [b for _, b in lengths], page_size, seed=seed % 1000)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(pb.total_rows, heads, LATENT, generator=g).to(torch.bfloat16)
    sink = torch.randn(heads, generator=g) if sinks else None
    got = model_dense(q, pb, 1, causal=causal, softcap=softcap, sinks=sink, force_splits=splits)
    _check(got, oracle_dense(q, pb, 1, causal=causal, softcap=softcap, sinks=sink))
    if sink is None and not softcap and q.shape[0]:
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, causal=causal, mla_v_dim=V_DIM)
        assert rel_err(got[0], want.double()) < 2e-2


def test_sm100_mla_dense_plan_rows_without_keys():
    pb = _mla_batch([0, 33], [0, 2], 16)
    q = torch.randn(pb.total_rows, 16, LATENT, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    got = model_dense(q, pb, 0, causal=True, force_splits=4)  # more splits than tiles: empty splits merge to 0
    _check(got, oracle_dense(q, pb, 0, causal=True))


def _sparse_indices(c, t, topk, g, invalid_frac=0.2):
    """Random encoded rows over the whole cache (any page, owned or not), with -1, out-of-range and negative
    entries mixed in."""
    n, p = c.blocks.shape[0], c.page_size
    idx = torch.randint(0, n * p, (t, topk), generator=g, dtype=torch.int32)
    bad = torch.rand(t, topk, generator=g) < invalid_frac
    junk = torch.tensor([-1, n * p, n * p + 5, -7, 2**31 - 1], dtype=torch.int32)
    idx[bad] = junk[torch.randint(0, len(junk), (int(bad.sum()),), generator=g)]
    return idx


@settings(max_examples=8, deadline=None)
@given(
    t=st.integers(1, 3),
    topk=st.sampled_from([0, 1, 31, 32, 70]),
    page_size=st.sampled_from([1, 4, 64]),
    heads=st.sampled_from([16, 128, 160]),
    lengths=st.booleans(),
    splits=st.one_of(st.none(), st.integers(2, 3)),
    softcap=st.one_of(st.none(), st.just(20.0)),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sm100_mla_sparse_plan_matches_the_oracle(t, topk, page_size, heads, lengths, splits, softcap, sinks, seed):
    c = _mla_batch([50], [1], page_size, seed=seed % 1000, spare_pages=4).collection
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, LATENT, generator=g).to(torch.bfloat16)
    indices = _sparse_indices(c, t, topk, g)
    topk_lengths = torch.randint(-2, topk + 3, (t,), generator=g, dtype=torch.int32) if lengths else None
    sink = torch.randn(heads, generator=g) if sinks else None
    got = model_sparse(q, c, 1, indices, topk_lengths=topk_lengths, softcap=softcap, sinks=sink, force_splits=splits)
    _check(got, oracle_sparse(q, c, 1, indices, topk_lengths=topk_lengths, softcap=softcap, sinks=sink))


def test_sm100_mla_sparse_plan_all_entries_invalid():
    c = _mla_batch([10], [1], 4).collection
    q = torch.randn(2, 16, LATENT, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    indices = torch.tensor([[-1] * 40, [c.blocks.shape[0] * 4] * 40], dtype=torch.int32)
    out, lse = model_sparse(q, c, 0, indices, force_splits=2)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == NEG_INF).all())


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 50), st.integers(0, 3)), min_size=1, max_size=2),
    page_size=st.sampled_from([1, 3, 16, 64]),
    heads=st.sampled_from([16, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    causal=st.booleans(),
    splits=st.one_of(st.none(), st.integers(2, 3)),
    softcap=st.one_of(st.none(), st.just(20.0)),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sm100_mla_rope_aware_dense_plan_matches_the_oracle(lengths, page_size, heads, dtype, causal, splits,
                                                            softcap, sinks, seed):
    """Rope-aware FP8 rows, 16-key tiles: the replay (the converter's ``content * scale`` rounded to q's dtype)
    against float64 attention over the rows decoded by hand, and against the op's reference."""
    pb = _mla_batch([a for a, _ in lengths], [b for _, b in lengths], page_size, seed=seed % 1000, rope_aware=True)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(pb.total_rows, heads, LATENT, generator=g).to(dtype)
    sink = torch.randn(heads, generator=g) if sinks else None
    got = model_dense(q, pb, 1, causal=causal, softcap=softcap, sinks=sink, force_splits=splits)
    _check(got, oracle_dense(q, pb, 1, causal=causal, softcap=softcap, sinks=sink))
    if sink is None and not softcap and q.shape[0]:
        want = ref.paged_attention(q, pb.input_row_offsets, pb.collection, 1, causal=causal, mla_v_dim=V_DIM)
        assert rel_err(got[0], want.double()) < 2e-2


def test_sm100_mla_rope_aware_rows_are_dequantized_per_token():
    """One key per request: the output is that key's value row, ``content * its own scale`` (decoded by hand), so a
    scale taken from another row (or not at all) shows; rows past the keys (zero-filled, scale 0) add nothing."""
    pb = _mla_batch([0, 0, 0], [1, 1, 1], 16, seed=5, rope_aware=True)
    c = pb.collection
    q = torch.randn(pb.total_rows, 16, LATENT, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out, _ = model_dense(q, pb, 0)
    for b in range(3):
        page = int(c.lookup_table[b, 0])
        want = decode_by_hand(_raw(c.blocks)[page, 0, 0, 0, 0], c.scales[page, 0, 0, 0, 0], c.padded_depth)[:V_DIM]
        assert rel_err(out[b], want.expand(16, V_DIM)) < 4e-3  # the bf16 rounding of content * scale


@settings(max_examples=6, deadline=None)
@given(
    t=st.integers(1, 3),
    topk=st.sampled_from([0, 1, 15, 16, 17, 40]),
    page_size=st.sampled_from([1, 4, 64]),
    heads=st.sampled_from([16, 128]),
    lengths=st.booleans(),
    splits=st.one_of(st.none(), st.integers(2, 3)),
    softcap=st.one_of(st.none(), st.just(20.0)),
    sinks=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_sm100_mla_rope_aware_sparse_plan_matches_the_oracle(t, topk, page_size, heads, lengths, splits, softcap,
                                                             sinks, seed):
    c = _mla_batch([50], [1], page_size, seed=seed % 1000, spare_pages=4, rope_aware=True).collection
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, LATENT, generator=g).to(torch.bfloat16)
    indices = _sparse_indices(c, t, topk, g)
    topk_lengths = torch.randint(-2, topk + 3, (t,), generator=g, dtype=torch.int32) if lengths else None
    sink = torch.randn(heads, generator=g) if sinks else None
    got = model_sparse(q, c, 1, indices, topk_lengths=topk_lengths, softcap=softcap, sinks=sink, force_splits=splits)
    _check(got, oracle_sparse(q, c, 1, indices, topk_lengths=topk_lengths, softcap=softcap, sinks=sink))


# -- key rows, evaluated on the host ---------------------------------------------------------------------------------

@cute.jit
def _host_key_rows(kernel: cutlass.Constexpr, lookup_table: Optional[cute.Tensor], indices: Optional[cute.Tensor],
                   out: cute.Tensor, b: Int32, num_keys: Int32, rows_per_page: Int32, oob_row: Int32,
                   num_slots: Int32, count: cutlass.Constexpr[int]):
    """``out[k]``: the row ``MlaDecodeSm100.key_row`` gives key ``k`` of request / token ``b`` (CPU tensors)."""
    for k in cutlass.range_constexpr(count):
        out[k] = kernel.key_row(lookup_table, indices, b, Int32(k), num_keys, rows_per_page, oob_row, num_slots)


@pytest.mark.compile
def test_sm100_mla_dense_keys_never_read_past_the_lookup_row():
    """Unchecked lengths (validate=False): a key whose page column lies past the lookup table's row gets the
    zero-filled row and the entries past the row (here the next columns of a wider buffer) are not read."""
    from cute_kv.kernels.mla.sm100 import MlaDecodeSm100

    cols, p, rpp, oob = 2, 4, 100, 10_000
    buf = torch.full((2, 2 * cols), 7, dtype=torch.int32)  # 7: what lies past each row
    buf[:, :cols] = torch.tensor([[2, 0], [1, 3]])
    got = torch.full((4 * p,), -5, dtype=torch.int32)
    _host_key_rows(MlaDecodeSm100("bfloat16", 16, LATENT, V_DIM, p), from_dlpack(buf[:, :cols]), None,
                   from_dlpack(got), 1, 3 * p + 1, rpp, oob, 0, 4 * p)
    want = [1 * rpp + k for k in range(p)] + [3 * rpp + k for k in range(p)] + [oob] * (2 * p)
    assert got.tolist() == want


@pytest.mark.compile
def test_sm100_mla_sparse_entries_outside_the_cache_name_no_row():
    """Every int32 entry: ``[0, N*P)`` names ``page * rows_per_page + offset`` (inside the row view), anything else
    (-1, other negatives, ``N*P`` and past, entries past ``num_keys``) the zero-filled row one past the view."""
    from cute_kv.kernels.mla.sm100 import MlaDecodeSm100

    n, p, rpp = 5, 4, 12
    oob = (n - 1) * rpp + p  # the row view's rows
    ents = [0, 3, 4, n * p - 1, n * p, n * p + 1, -1, -2, -p, -2**31, 2**31 - 1, 2**31 - p, 7]
    idx = torch.tensor([[0] * len(ents), ents], dtype=torch.int32)
    got = torch.full((len(ents),), -5, dtype=torch.int32)
    _host_key_rows(MlaDecodeSm100("bfloat16", 16, LATENT, V_DIM, p, sparse=True), None, from_dlpack(idx),
                   from_dlpack(got), 1, len(ents) - 1, rpp, oob, n * p, len(ents))
    want = [(e // p) * rpp + e % p if 0 <= e < n * p else oob for e in ents[:-1]] + [oob]
    assert got.tolist() == want
    assert all(0 <= r < oob for r, e in zip(got.tolist(), ents[:-1]) if 0 <= e < n * p)


@cute.jit
def _host_row_views(kernel: cutlass.Constexpr, blocks: cute.Tensor, scales: cute.Tensor, layer: Int32,
                    rows: cute.Tensor, content: cute.Tensor, rope: cute.Tensor, scale: cute.Tensor):
    """For each row ``rows[i]`` of the layer's row view: its bytes through the content view (the e4m3 bytes the
    content gather4 boxes start at), its rope values through the bf16 rope view and its scale, as
    ``MlaDecodeSm100.row_views`` builds them for the kernel (CPU tensors)."""
    content_rows, rope_rows, scale_rows = kernel.row_views(blocks, scales, layer)
    for i in cutlass.range(cute.size(rows), unroll=1):
        r = rows[i]
        for j in cutlass.range(cute.size(content, mode=[1]), unroll=1):
            content[i, j] = content_rows[r, 0, j]
        for j in cutlass.range(cute.size(rope, mode=[1]), unroll=1):
            rope[i, j] = rope_rows[r, 0, j].to(cutlass.Float32)
        scale[i] = scale_rows[r, 0, 0]


@pytest.mark.compile
def test_sm100_mla_rope_aware_row_views_address_the_row_bytes():
    """The kernel's views of a rope-aware plane: the content boxes start at byte 0 of a row, the rope view at byte
    ``padded_depth`` (values decoded by hand from the bytes), the scale of row ``r`` is ``scales`` flattened at
    ``r``: rows of both layers and of the last page."""
    from cute_kv.kernels.mla.sm100 import MlaDecodeSm100

    c = _mla_batch([20, 7], [1, 1], 4, seed=2, rope_aware=True).collection
    n, _, nl, p = c.blocks.shape[:4]
    raw = _raw(c.blocks)
    kernel = MlaDecodeSm100("bfloat16", 16, LATENT, V_DIM, p, rope_dim=ROPE)
    for layer in range(nl):
        slots = [(0, 0), (1, 3), (n - 1, p - 1), (n // 2, 1)]
        rows = torch.tensor([page * nl * p + slot for page, slot in slots], dtype=torch.int32)
        content = torch.zeros(len(slots), ROW_BYTES, dtype=torch.uint8)
        rope = torch.zeros(len(slots), ROPE, dtype=torch.float32)
        scale = torch.zeros(len(slots), dtype=torch.float32)
        _host_row_views(kernel, from_dlpack(raw), from_dlpack(c.scales), layer, from_dlpack(rows),
                        from_dlpack(content), from_dlpack(rope), from_dlpack(scale))
        for i, (page, slot) in enumerate(slots):
            row = raw[page, 0, layer, slot, 0]
            assert torch.equal(content[i], row)
            hand = decode_by_hand(row, torch.ones(1), c.padded_depth)[c.padded_depth:]
            assert torch.equal(rope[i].double(), hand)
            assert scale[i] == c.scales[page, 0, layer, slot, 0, 0]


@cute.jit
def _host_row_scales(kernel: cutlass.Constexpr, blocks: cute.Tensor, scales: cute.Tensor, layer: Int32,
                     rows: cute.Tensor, got: cute.Tensor, count: cutlass.Constexpr[int]):
    """``got[i]``: the scale the load warp stores for key row ``rows[i]`` of the layer (CPU tensors)."""
    content_rows, _, scale_rows = kernel.row_views(blocks, scales, layer)
    for i in cutlass.range_constexpr(count):
        got[i] = kernel.row_scale(scale_rows, rows[i], content_rows.shape[0])


@pytest.mark.compile
def test_sm100_mla_rope_aware_scales_never_read_outside_the_row_view():
    """Unchecked lookup entries (validate=False: the sentinel N, any entry past the pages, entries >= 2^31 read as
    negative rows) name rows outside the row view: TMA zero-fills their bytes and the load warp stores scale 0
    without reading the scales there (here the scales are a slice of a wider buffer of 7s, so a read shows)."""
    from cute_kv.kernels.mla.sm100 import MlaDecodeSm100

    c = _mla_batch([20, 7], [1, 1], 4, seed=2, rope_aware=True).collection
    n, _, nl, p = c.blocks.shape[:4]
    rpp = nl * p
    oob = (n - 1) * rpp + p
    wide = torch.full((n + 2,) + tuple(c.scales.shape[1:]), 7.0, dtype=torch.float32)
    wide[1:n + 1] = c.scales
    kernel = MlaDecodeSm100("bfloat16", 16, LATENT, V_DIM, p, rope_dim=ROPE)
    for layer in range(nl):
        inside = [0, 3, rpp + 1, oob - 1]
        outside = [oob, oob + 1, oob + p, n * rpp + 2, -1, -rpp, -2**31]  # n * rpp + 2: the sentinel page's
        rows = torch.tensor(inside + outside, dtype=torch.int32)
        got = torch.full((len(rows),), -5.0, dtype=torch.float32)
        _host_row_scales(kernel, from_dlpack(_raw(c.blocks)), from_dlpack(wide[1:n + 1]), layer, from_dlpack(rows),
                         from_dlpack(got), len(rows))
        flat = c.scales[:, 0, layer, :, 0, 0].reshape(-1)  # the layer's scale of row page * rpp + slot
        want = [float(flat[(r // rpp) * p + r % rpp]) for r in inside] + [0.0] * len(outside)
        assert got.tolist() == want


# -- compile (sm_100a, no GPU) ---------------------------------------------------------------------------------------

def _mma(n: int, b_mn_major: bool = False) -> static.Tcgen05Mma:
    """A ``tcgen05.mma`` of the kernel: one CTA, M = ``BM``, K = 16 (``kind::f16``), A and B in shared memory."""
    return static.Tcgen05Mma(BM, n, 16, 1, False, False, b_mn_major)


COMPILE_CASES = [  # (dtype, Hq, page[, flags])
    ("bfloat16", 128, 64),
    ("float16", 16, 1),
    ("bfloat16", 128, 64, {"sparse": True, "topk_lengths": True}),
    ("bfloat16", 64, 3, {"sparse": True, "softcap": True, "sinks": True, "return_lse": True}),
]


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(map(str, c[:3])) + (
    "-" + "-".join(c[3]) if c[3:] else ""))
def test_sm100_mla_ptx(case, tmp_path):
    from cute_kv.kernels.mla.sm100 import THREADS, MlaDecodeSm100

    flags = case[3] if case[3:] else {}
    kernel = MlaDecodeSm100(case[0], case[1], LATENT, V_DIM, case[2], **flags)
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    # Per key tile: the partial QK over the CTA's 288 latent columns (18 MMAs of K=16, N=32) and P V for its value
    # half (BN/16 = 2 MMAs of N=256, V read MN-major), M=128, fp32 accumulators in TMEM.
    assert static.tcgen05_mmas(ptx) == [_mma(BN)] * (QK_COLS // 16) + [_mma(O_COLS, True)] * (BN // 16)
    _check_exchange(kernel, ptx, BN, artifacts.compiled(kernel, "sm_100a").host_ir)
    # S read as one 32-column load; the O half rescaled and stored back (256/32 each), then read by the epilogue.
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x32.b32") == 1 + 2 * O_COLS // 32
    assert ptx.count("tcgen05.st.sync.aligned.32x32b.x32.b32") == O_COLS // 32
    assert ptx.count("tcgen05.wait::ld") >= 1 and ptx.count("tcgen05.wait::st") >= 1
    # TMEM allocated once (512 columns), relinquished, freed once.
    alloc = re.findall(r"tcgen05\.alloc\.cta_group::1\S*\s+\[[^\]]+\],\s*(\S+);", ptx)
    assert len(alloc) == 1 and len(re.findall(r"tcgen05\.dealloc\.cta_group::1", ptx)) == 1
    assert ptx.count("tcgen05.relinquish_alloc_permit") == 1
    # The epilogue's loads of O are retired before the columns are freed (PTX ISA 9.7.16.6.4.4: tcgen05.ld ->
    # wait::ld -> fence::before_thread_sync -> sync -> dealloc; reading the loaded registers does not retire them).
    dealloc = re.search(r"tcgen05\.dealloc\.cta_group::1", ptx).start()
    assert "tcgen05.wait::ld" in ptx[ptx.rindex("tcgen05.ld.sync", 0, dealloc):dealloc]
    # S full, P consumed (O stable), key stage free: MMA completions signalled by tcgen05.commit.
    assert ptx.count("tcgen05.commit.cta_group::1.mbarrier::arrive::one") == 3
    # TMEM handed across threads is fenced on both sides: before the arrivals (allocation, S released, P/O handed
    # over, dealloc) and after the waits (allocation, dealloc, the MMA's S and P waits, the softmax's S wait, its
    # O-stable waits in the loop and after it).
    assert ptx.count("tcgen05.fence::before_thread_sync") == 4
    assert ptx.count("tcgen05.fence::after_thread_sync") == 7
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == str(THREADS)
    waits = re.findall(r"mbarrier\.try_wait\.parity\.shared\.b64\s+\w+,\s*\[[^\]]+\],\s*([^,]+),", ptx)
    assert waits and all(w.startswith("%r") for w in waits), waits
    # gather4: BN/4 instructions per 64-column block, the slice's 5 blocks; every destination distinct, 512 B apart
    # (4 rows of 128 B) and the column blocks back to back (BN x 128 B each): the swizzle is on the pointer.
    g4 = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\S*\s+\[([^\]]*)\]", ptx)
    assert len(g4) == (BN // 4) * (SLICE // 64)
    assert len(set(g4)) == len(g4)
    offsets = [int(re.search(r"\+(\d+)$", x).group(1)) if "+" in x else 0 for x in g4]
    assert all(b - a == 512 for a, b in zip(offsets, offsets[1:]))
    assert "cp.async.bulk.tensor.3d" not in ptx and not re.search(r"wgmma|mma\.sync", ptx)
    # Sparse: the softmax warps resolve the tile's keys again and share them by one ballot.
    assert ptx.count("vote.sync.ballot.b32") == (1 if flags.get("sparse") else 0)
    assert ptx.count("tanh.approx.f32") == (BN if flags.get("softcap") else 0)
    assert ptx.count("ex2.approx.ftz.f32") >= BN
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(ptx)
    info = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(ptx_file), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True).stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in info
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    assert regs <= 168  # measured 96 (dense) to 154 (sparse with every flag); 192 threads, one CTA per SM


PAIR_HELPERS = {  # a variant of each sm100_config helper the kernel must take its arithmetic from
    "exchange_slot: buffer": ("exchange_slot", lambda j: (j * 0, (j // EXCHANGE) % 2)),
    "exchange_slot: parity": ("exchange_slot", lambda j: (j % EXCHANGE, (j // EXCHANGE + 1) % 2)),
    "exchange_rotation": ("exchange_rotation", lambda row, chunks: 0),
    "live_warps": ("live_warps", lambda rows: rows // 32),
    "slice_start": ("slice_start", lambda rank: rank * (O_COLS - 64)),
    "qk_start": ("qk_start", lambda rank: rank * 16),
}


@pytest.mark.compile
@pytest.mark.parametrize("variant", PAIR_HELPERS)
def test_sm100_mla_kernel_takes_the_pair_arithmetic_from_its_helpers(variant, monkeypatch):
    """The tests model the pair with ``sm100_config``'s helpers (the replay, the exchange protocol, the bank
    groups): the kernel must compute with the same ones, so another helper is another kernel."""
    from cute_kv.kernels import compile_cache
    from cute_kv.kernels.mla import sm100

    kernel = sm100.MlaDecodeSm100("bfloat16", 16, LATENT, V_DIM, 64)
    base = artifacts.compiled(kernel, "sm_100a").ptx
    name, helper = PAIR_HELPERS[variant]
    monkeypatch.setattr(sm100, name, helper)
    assert compile_cache.compile_ptx(lambda: (kernel, *kernel.fake_args()), "sm_100a") != base


ROPE_AWARE_CASES = [  # (dtype, Hq, page[, flags]) over DeepSeek's rope-aware FP8 rows
    ("bfloat16", 128, 64),
    ("float16", 16, 1, {"sparse": True, "topk_lengths": True}),
    ("bfloat16", 64, 3, {"sparse": True, "softcap": True, "sinks": True, "return_lse": True}),
]


@pytest.mark.compile
@pytest.mark.parametrize("case", ROPE_AWARE_CASES, ids=lambda c: "-".join(map(str, c[:3])) + (
    "-" + "-".join(c[3]) if c[3:] else ""))
def test_sm100_mla_rope_aware_ptx(case, tmp_path):
    from cute_kv.kernels.mla.sm100 import FP8_THREADS, MlaDecodeSm100

    flags = case[3] if case[3:] else {}
    kernel = MlaDecodeSm100(case[0], case[1], LATENT, V_DIM, case[2], rope_dim=ROPE, **flags)
    ptx = artifacts.compiled(kernel, "sm_100a").ptx
    # Per 16-key tile: the partial QK over the CTA's 288 columns of its converted slice (18 MMAs, N=16), one P V
    # MMA (K=16, N=256).
    assert static.tcgen05_mmas(ptx) == [_mma(FP8_BN)] * (QK_COLS // 16) + [_mma(O_COLS, True)] * (FP8_BN // 16)
    _check_exchange(kernel, ptx, FP8_BN, artifacts.compiled(kernel, "sm_100a").host_ir)
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x16.b32") == 1  # S: one 16-column load
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x32.b32") == 2 * O_COLS // 32
    # S full, P consumed, converted tile free: the only tcgen05.commit arrivals (the converter arrives itself).
    assert ptx.count("tcgen05.commit.cta_group::1.mbarrier::arrive::one") == 3
    assert ptx.count("tcgen05.fence::before_thread_sync") == 4
    assert ptx.count("tcgen05.fence::after_thread_sync") == 7
    assert re.search(r"\.reqntid (\d+)", ptx).group(1) == str(FP8_THREADS)
    # Landing stages: full = the load warp's expect-tx + each lane's arrival after its scale store (33), empty = one
    # lane of each converter warp (4); converted tiles: full = the 128 converter threads, empty = the MMA's commit.
    inits = re.findall(r"mov\.b32\s+(%r\d+), (\d+);\s+((?:mbarrier\.init\.shared\.b64\s+\[[^\]]+\], \1;\s+)+)", ptx)
    counts = [(int(n), block.count("mbarrier.init")) for _, n, block in inits]
    stages = kernel.stages
    assert (33, stages) in counts and (4, stages) in counts and (128, 2) in counts, counts
    # Two descriptors (content, rope). gather4: 4 per 128-byte content box, CTA 0's boxes 0-2 (bytes [0, 384) of
    # the rows), then CTA 1's boxes 2-3 and its 4 for the rope box; within each CTA's run every destination is 512
    # B past the previous one (4 rows x 128 B), the content boxes back to back in their stage (16 x 128 B each, box
    # 2 at the same place for both), the rope tile in its own stage.
    assert len(re.findall(r"\.param \.align 64 \.b8 \S+\[128\]", ptx)) == 2
    g4 = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.tile::gather4\S*\s+\[([^\]]*)\],\s*"
                    r"\[(%rd\d+),", ptx)
    assert len(g4) == (FP8_BN // 4) * (3 + 2 + 1)
    descs = [t for _, t in g4]
    assert len(set(descs[:20])) == 1 and len(set(descs[20:])) == 1 and descs[0] != descs[20]
    offsets = [int(re.search(r"\+(\d+)$", d).group(1)) for d, _ in g4]
    box = FP8_BN * 128
    for run in (offsets[:12], offsets[12:20], offsets[20:]):
        assert all(b - a == 512 for a, b in zip(run, run[1:]))
    assert offsets[12] - offsets[0] == 2 * box  # CTA 1's first box is box 2
    # The scale of each lane's row: read only for a row inside the row view (0 <= row < its rows), a 4-byte global
    # load at row * 4, stored to the stage's scale array, then the lane's arrival on the stage's full barrier.
    tail = ptx[ptx.rindex("tile::gather4"):]
    assert re.search(r"setp\.lt\.s32\s+(%p\d+), (%r\d+), 0;\s+setp\.ge\.s32\s+(%p\d+), \2, %r\d+;\s+"
                     r"or\.pred\s+(%p\d+), \1, \3;\s+@\4 bra[^\n]*\n\s+mul\.wide\.u32\s+(%rd\d+), \2, 4;\s+"
                     r"add\.s64\s+(%rd\d+), %rd\d+, \5;\s+ld\.global\.b32\s+%r\d+, \[\6\];", tail)
    assert re.search(r"st\.shared\.b32[^\n]*\n\s*mov\.b32[^\n]*\n\s*mbarrier\.arrive\.shared\.b64", tail)
    # Converter: e4m3 pairs to half2 by cvt (8 values a chunk), scaled in float32, the rope read as bf16; one
    # conversion per 64-column piece of the slice (the last: content for CTA 0, the rope for CTA 1).
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 4 * SLICE // 64
    assert "cp.async.bulk.tensor.3d" not in ptx and not re.search(r"wgmma|mma\.sync", ptx)
    assert ptx.count("vote.sync.ballot.b32") == (1 if flags.get("sparse") else 0)
    assert ptx.count("tanh.approx.f32") == (FP8_BN if flags.get("softcap") else 0)
    ptx_file = tmp_path / "k.ptx"
    ptx_file.write_text(ptx)
    info = subprocess.run(["ptxas", "-arch=sm_100a", "-v", str(ptx_file), "-o", "/dev/null"], capture_output=True,
                          text=True, check=True).stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in info
    assert int(re.search(r"Used (\d+) registers", info).group(1)) <= 200  # 320 threads, one CTA per SM


def _feeds(ptx: str):
    """``reaches(reg, sources)``: whether register ``reg``'s value is computed (through any chain of definitions)
    from one of ``sources``; ``sources``: registers."""
    defs: dict = {}
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?[a-z][\w.:]*\s+(\{[^}]*\}|%\w+)\s*,(.*);", line)
        if m and not line.strip().startswith(("st.", "@")):
            for dst in re.findall(r"%\w+", m[1]):
                defs.setdefault(dst, set()).update(re.findall(r"%\w+", m[2]))

    def reaches(reg, sources):
        seen, todo = set(), [reg]
        while todo:
            r = todo.pop()
            if r in sources:
                return True
            if r not in seen:
                seen.add(r)
                todo.extend(defs.get(r, ()))
        return False

    return reaches


def _check_exchange(kernel, ptx: str, bn: int, host_ir: str):
    """The pair's partial-S exchange and column split: launched as clusters of the two value halves; the CTA's
    rank (``ctaid.y & 1``) places its slice (``<< 8``: 256 columns, the gather4 column and the Q load), its QK
    k-blocks (``<< 2``: 64 bytes into the first MMA's descriptors; every QK descriptor, no P V one, depends on it)
    and names the peer (``^ 1``, the ``mapa`` of every
    store); each softmax thread's row goes out in ``bn / 4`` 16-byte ``st.async``, completing the peer's barrier,
    which thread 0 arms with the live rows' bytes (``live_warps * 32 * bn * 4``: a shift of the warp count);
    the exchange barriers (two, one arrival each) are waited on, then acquired at cluster scope; the cluster
    barrier after the barriers' init and before the exit."""
    assert static.launch_from_host_ir(host_ir).cluster == (1, V_SPLIT, 1)
    reaches = _feeds(ptx)
    cta_y = re.search(r"mov\.u32\s+(%r\d+), %ctaid\.y;", ptx)[1]
    rank = re.search(rf"and\.b32\s+(%r\d+), {cta_y}, 1;", ptx)[1]
    by = {op: {m[1] for m in re.finditer(rf"{op}\s+(%r\d+), {rank}, (\d+);", ptx) if int(m[2]) == k}
          for op, k in (("shl.b32", 8), ("xor.b32", 1))}
    column = by["shl.b32"]
    kblock = {m[1] for m in re.finditer(rf"shl\.b32\s+(%r\d+), {rank}, 2;", ptx)}
    assert column and kblock and by["xor.b32"]
    g4 = re.findall(r"tile::gather4\S*\s+\[[^\]]*\],\s*\[%rd\d+, \{(%r\d+),", ptx)
    if kernel.fp8:  # the content boxes of each rank's slice (and the rope's at 0) are constants under a branch
        cols = [int(re.search(rf"mov\.b32\s+{c}, (\d+);", ptx)[1]) for c in g4]
        assert cols == [0] * 4 + [128] * 4 + [256] * 4 + [256] * 4 + [384] * 4 + [0] * 4, cols
    else:
        assert g4 and all(reaches(c, column) for c in g4), g4
    q_loads = re.findall(r"ld\.global\.v4\.\w+\s+\{[^}]*\}, \[(%rd\d+)\];", ptx)
    assert any(reaches(a, column) for a in q_loads) and "ld.global.b16" not in ptx  # Q in 16-byte loads
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[%r\d+\], (%rd\d+), (%rd\d+),", ptx)
    qk, pv = mmas[:QK_COLS // 16], mmas[QK_COLS // 16:]
    # Every QK descriptor (Q and the key slice) depends on the rank, the first by the 64-byte shift; V, the first
    # O_COLS columns of the slice, does not.
    assert reaches(qk[0][0], kblock) and reaches(qk[0][1], kblock)
    assert all(reaches(a, {rank}) and reaches(b, {rank}) for a, b in qk), qk
    assert pv and not any(reaches(a, {rank}) or reaches(b, {rank}) for a, b in pv), pv
    stores = re.findall(r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.v4\.f32 \[(%r\d+)\], \w+, "
                        r"\[(%r\d+)\];", ptx)
    assert len(stores) == bn // 4 and len({bar for _, bar in stores}) == 1
    for reg in {r for pair in stores for r in pair}:
        mapa = re.search(rf"mapa\.shared::cluster\.u32\s+{reg}, %r\d+, (%r\d+);", ptx)
        assert mapa and reaches(mapa[1], by["xor.b32"]), reg
    # Thread 0 arms the exchange barrier (the one every store's mapa names in the peer) with the live warps' bytes;
    # warps at or past that count branch over the stores; the wait on the barrier is followed by the cluster-scope
    # acquire of the same barrier and parity.
    (bar, nbytes), = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+, \[(%r\d+)\], (%r\d+);", ptx)
    assert {re.search(rf"mapa\.shared::cluster\.u32\s+{b}, (%r\d+), %r\d+;", ptx)[1] for _, b in stores} == {bar}
    live = re.search(rf"shl\.b32\s+{nbytes}, (%r\d+), {(32 * bn * 4).bit_length() - 1};", ptx)[1]
    tid = re.search(r"mov\.u32\s+(%r\d+), %tid\.x;", ptx)[1]
    warp = {m[1] for m in re.finditer(rf"shr\.u32\s+(%r\d+), {tid}, 5;", ptx)}
    gates = [m for m in re.finditer(rf"setp\.ge\.s32\s+(%p\d+), (%r\d+), {live};\s*@\1 bra\s+(\$L__BB\d+_\d+);",
                                    ptx) if m[2] in warp]
    assert len(gates) == 1 and ptx.index("st.async", gates[0].end()) < ptx.index(gates[0][3] + ":")
    acquired = re.findall(rf"mbarrier\.try_wait\.parity\.shared\.b64 \w+, \[{bar}\], (%r\d+), \d+;\s*(?:[^\n]*\n)"
                          rf"{{1,6}}?\s*mbarrier\.test_wait\.parity\.acquire\.cluster\.shared::cta\.b64 %p\d+, "
                          rf"\[{bar}\], \1;", ptx)
    assert len(acquired) == 1 and ptx.count("mbarrier.test_wait.parity.acquire.cluster") == 1
    family = next(f for f in catalog.FAMILIES if f.name == "mla_decode_sm100")
    report = barriers.analyze(ptx, family.roles(kernel), (1, V_SPLIT, 1))
    exchange = [r for r in report.rows if any("arrive.expect_tx, lane 0" in a for a in r.arrivers)]
    assert [(r.array.stages, r.count, r.per_phase) for r in exchange] == [(EXCHANGE, 1, 1)]
    assert ptx.count("barrier.cluster.arrive.relaxed") == 2 and ptx.count("barrier.cluster.wait") == 2


@pytest.mark.compile
def test_sm100_mla_mma_work_per_key():
    """``perf/run.py mla-mma-work`` on the catalog's 128-head dense kernels (16-bit and rope-aware FP8): the pair's
    CTAs each compute a partial S over half the latent columns and their value half of O, so the pair does the
    minimum work per key."""
    records = mla_mma_work.ours(128, artifacts.compiled)
    assert [r["keys_per_tile"] for r in records] == [BN, FP8_BN]
    minimum = 2 * 128 * (LATENT + V_DIM)
    for r in records:
        assert r["units"] == V_SPLIT and r["qk_mmas"] == QK_COLS // 16 and r["pv_mmas"] == r["keys_per_tile"] // 16
        assert r["flops_per_key"] == V_SPLIT * 2 * BM * (QK_COLS + O_COLS) == minimum and r["ratio"] == 1.0
        assert r["min_flops_per_key"] == minimum and r["ratio"] == round(r["flops_per_key"] / minimum, 3)


# -- GPU (B200) ------------------------------------------------------------------------------------------------------

def _sm100():
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("flags", [{}, {"softcap": 20.0, "sinks": True, "return_lse": True}])
def test_sm100_mla_dense_kernel_matches_the_oracle(page_size, heads, flags):
    import cute_kv
    from cute_kv.ops import paths
    from numerics import bits

    cached, new = [0, 1, 300, 2000], [1, 1, 4, 1]
    cpu = _mla_batch(cached, new, page_size, seed=page_size)
    pb = random_paged_batch(cached, new, num_heads=1, head_size=LATENT, page_size=page_size, is_mla=True,
                            generator=torch.Generator().manual_seed(page_size), device="cuda")
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(pb.total_rows, heads, LATENT, generator=g).to(torch.bfloat16)
    sinks = torch.randn(heads, generator=g) if flags.get("sinks") else None
    want = oracle_dense(q, cpu, 1, softcap=flags.get("softcap"), sinks=sinks)
    before = bits(pb.collection.blocks)
    out = torch.full((q.shape[0], heads, V_DIM), float("nan"), dtype=q.dtype, device="cuda")
    paths.set_strict(True)  # a reference fallback raises
    try:
        res = cute_kv.paged_attention(q.cuda(), pb.input_row_offsets.cuda(), pb.collection, 1, mla_v_dim=V_DIM,
                                      out=out, softcap=flags.get("softcap"),
                                      sinks=None if sinks is None else sinks.cuda(),
                                      return_lse=bool(flags.get("return_lse")))
    finally:
        paths.set_strict(False)
    got = res[0] if flags.get("return_lse") else res
    assert not got.isnan().any()
    assert rel_err(got.cpu().double(), want[0]) < 2e-2
    if flags.get("return_lse"):
        assert torch.allclose(res[1].cpu().double(), want[1], atol=2e-2)
    assert torch.equal(bits(pb.collection.blocks), before)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("topk", [1, 100, 2048])
@pytest.mark.parametrize("lengths", [False, True])
def test_sm100_mla_sparse_kernel_matches_the_oracle(page_size, topk, lengths):
    from numerics import bits

    cpu = _mla_batch([3000], [1], page_size, seed=topk, spare_pages=8).collection
    dev = random_paged_batch([3000], [1], num_heads=1, head_size=LATENT, page_size=page_size, is_mla=True,
                             spare_pages=8, generator=torch.Generator().manual_seed(topk),
                             device="cuda").collection
    g = torch.Generator().manual_seed(page_size)
    t, heads = 5, 128
    q = torch.randn(t, heads, LATENT, generator=g).to(torch.bfloat16)
    indices = _sparse_indices(cpu, t, topk, g)
    topk_lengths = torch.randint(0, topk + 1, (t,), generator=g, dtype=torch.int32) if lengths else None
    want = oracle_sparse(q, cpu, 0, indices, topk_lengths=topk_lengths)
    path = mla_decode_sm100.plan_sparse(dev, q.cuda(), indices.cuda(), "sm_100a", mla_v_dim=V_DIM,
                                        topk_lengths=topk_lengths)
    assert path.path == "kernel", path.reason
    before = bits(dev.blocks)
    out = torch.full((t, heads, V_DIM), float("nan"), dtype=q.dtype, device="cuda")
    mla_decode_sm100.launch_sparse(path.key, path.arch)(
        q.cuda(), dev, 0, indices.cuda(), topk_lengths=None if topk_lengths is None else topk_lengths.cuda(),
        out=out)
    assert not out.isnan().any()
    assert rel_err(out.cpu().double(), want[0]) < 2e-2
    assert torch.equal(bits(dev.blocks), before)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flags", [{}, {"softcap": 20.0, "sinks": True, "return_lse": True}])
def test_sm100_mla_rope_aware_dense_kernel_matches_the_oracle(page_size, dtype, flags):
    import cute_kv
    from cute_kv.ops import paths
    from numerics import bits

    cached, new = [0, 1, 300, 2000], [1, 1, 4, 1]
    cpu = _mla_batch(cached, new, page_size, seed=page_size, rope_aware=True)
    pb = _mla_batch(cached, new, page_size, seed=page_size, rope_aware=True, device="cuda")
    heads = 128
    g = torch.Generator().manual_seed(heads)
    q = torch.randn(pb.total_rows, heads, LATENT, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) if flags.get("sinks") else None
    want = oracle_dense(q, cpu, 1, softcap=flags.get("softcap"), sinks=sinks)
    before = (bits(pb.collection.blocks), bits(pb.collection.scales))
    out = torch.full((q.shape[0], heads, V_DIM), float("nan"), dtype=dtype, device="cuda")
    paths.set_strict(True)  # a reference fallback raises
    try:
        res = cute_kv.paged_attention(q.cuda(), pb.input_row_offsets.cuda(), pb.collection, 1, mla_v_dim=V_DIM,
                                      out=out, softcap=flags.get("softcap"),
                                      sinks=None if sinks is None else sinks.cuda(),
                                      return_lse=bool(flags.get("return_lse")))
    finally:
        paths.set_strict(False)
    got = res[0] if flags.get("return_lse") else res
    assert not got.isnan().any()
    assert rel_err(got.cpu().double(), want[0]) < 2e-2
    if flags.get("return_lse"):
        assert torch.allclose(res[1].cpu().double(), want[1], atol=2e-2)
    assert torch.equal(bits(pb.collection.blocks), before[0]) and torch.equal(bits(pb.collection.scales), before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not _sm100(), reason="needs an SM100 GPU")
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("topk", [1, 100, 2048])
@pytest.mark.parametrize("lengths", [False, True])
def test_sm100_mla_rope_aware_sparse_kernel_matches_the_oracle(page_size, topk, lengths):
    from numerics import bits

    cpu = _mla_batch([3000], [1], page_size, seed=topk, spare_pages=8, rope_aware=True).collection
    dev = _mla_batch([3000], [1], page_size, seed=topk, spare_pages=8, rope_aware=True, device="cuda").collection
    g = torch.Generator().manual_seed(page_size)
    t, heads = 5, 128
    q = torch.randn(t, heads, LATENT, generator=g).to(torch.bfloat16)
    indices = _sparse_indices(cpu, t, topk, g)
    topk_lengths = torch.randint(0, topk + 1, (t,), generator=g, dtype=torch.int32) if lengths else None
    want = oracle_sparse(q, cpu, 0, indices, topk_lengths=topk_lengths)
    path = mla_decode_sm100.plan_sparse(dev, q.cuda(), indices.cuda(), "sm_100a", mla_v_dim=V_DIM,
                                        topk_lengths=topk_lengths)
    assert path.path == "kernel" and path.key[-1] == ROPE, path.reason
    before = (bits(dev.blocks), bits(dev.scales))
    out = torch.full((t, heads, V_DIM), float("nan"), dtype=q.dtype, device="cuda")
    mla_decode_sm100.launch_sparse(path.key, path.arch)(
        q.cuda(), dev, 0, indices.cuda(), topk_lengths=None if topk_lengths is None else topk_lengths.cuda(),
        out=out)
    assert not out.isnan().any()
    assert rel_err(out.cpu().double(), want[0]) < 2e-2
    assert torch.equal(bits(dev.blocks), before[0]) and torch.equal(bits(dev.scales), before[1])
