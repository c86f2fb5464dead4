"""``FusedQKVGemmW4Sm100``: quantized weights decoded by transform warps into the shared-memory A stage of
``tcgen05.mma`` (sm_100a).

On the CPU: the transform threads' stage positions are the SM90 fragment positions the repack orders the bytes
for, so the SM90 decode replay (``test_fused_qkv_w4.py``: bit for bit against the reference dequantization) holds
for the stage the MMA reads; each decoded pair lands once and a warp's 4-byte stores hit 32 distinct banks of the
128-byte-swizzled tile; ``plan`` routes every format to this kernel on sm_100a; the kernel compiles for sm_100a
with the MMAs, TMEM allocation and the decode in its loops and no spills. The GPU run is
``test_fused_qkv_w4.py::test_fused_qkv_w4_matches_reference`` (SM90 and SM100).
"""

import functools
import os
import re
import sys

import pytest
import torch

import artifacts

from cute_kv.reference.weights import dequantize

pytest.importorskip("quack")
from cute_kv.kernels.qkv.gemm import QKVSpec  # noqa: E402
from cute_kv.kernels.qkv.w4 import BN, K_TILE, TILE_TOKENS, QKVW4Spec, prepare_weight  # noqa: E402
from cute_kv.kernels.qkv.w4_sm100 import (M64, MAX_SPLITS, MIN_SPLIT_K_TILES, THREADS, TOKENS,  # noqa: E402
                                          TRANSFORM_THREADS, FusedQKVGemmW4Sm100, k_range, split_k, stage_coord,
                                          stages, tile_coords)

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)
import static  # noqa: E402
from static_fused_qkv import _sass, transform_loop  # noqa: E402

from test_fused_qkv_w4 import COMPILE_CASES, N_TOT, REPLAY_CASES, _fp8, _fragment_coords, _int4, _plan, _replay  # noqa: E402,E501
from test_fused_qkv_w4 import _w4 as _w4_sm90  # noqa: E402


SM100_CASES = COMPILE_CASES  # the SM90 kernel's, MLA's cross-tile latent and wide heads included


def _stage_coords():
    """``(row, k)`` of every value transform thread ``t`` stores for (block ``m``, k16 block ``b``, register ``j``,
    half ``e``), from the kernel's own ``stage_coord``."""
    t = torch.arange(TRANSFORM_THREADS)[:, None, None, None, None]
    m = torch.arange(M64)[None, :, None, None, None]
    b = torch.arange(K_TILE // 16)[None, None, :, None, None]
    j = torch.arange(4)[None, None, None, :, None]
    e = torch.arange(2)[None, None, None, None, :]
    row, k = stage_coord(t, m, b, j)
    shape = (TRANSFORM_THREADS, M64, K_TILE // 16, 4, 2)
    return row.expand(shape), (k + e).expand(shape)


def test_stage_positions_are_the_fragment_positions():
    """Block ``m`` of the stage holds what SM90 warpgroup thread ``t`` holds in its wgmma A fragment: the replay's
    positions, so its bit-for-bit result is the stage's."""
    rows, ks = _stage_coords()
    frag_rows, frag_ks = _fragment_coords()  # (t, b, j, e) of one 64-row block
    for m in range(M64):
        assert torch.equal(rows[:, m] - 64 * m, frag_rows) and torch.equal(ks[:, m], frag_ks)


def test_stage_is_written_once_without_bank_conflicts():
    rows, ks = _stage_coords()
    flat = (rows * K_TILE + ks).flatten()
    assert torch.equal(flat.sort().values, torch.arange(BN * K_TILE))  # every element of the stage, once
    # 128-byte swizzle of a K-major bf16 tile: 16-byte chunk c of row r sits at chunk c ^ (r % 8) of the row
    chunk = (ks[..., 0] * 2 // 16) ^ (rows[..., 0] % 8)
    bank = (chunk * 4 + (ks[..., 0] * 2 % 16) // 4) % 32
    for w in range(TRANSFORM_THREADS // 32):  # one 4-byte store per lane: (m, b, j) fixed across the warp
        lanes = bank[32 * w:32 * (w + 1)].permute(1, 2, 3, 0).reshape(-1, 32)
        assert all(len(set(store.tolist())) == 32 for store in lanes)


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_sm100_decode_replay_matches_reference(rng, case):
    """The repack is the SM90 one (``prepare_weight``): the same bytes, the same decode, the same bits."""
    fmt, make = REPLAY_CASES[case]
    n, k = 200, 384
    weight = make(rng, n, k)
    path = _plan(rng, make(rng, N_TOT, k), arch="sm_100a", k=k)
    assert (path.kernel, path.key.weight_format) == ("FusedQKVGemmW4Sm100", fmt), path
    blob, sf, _ = prepare_weight(weight)
    got = _replay(fmt, blob, sf, -(-n // BN) * BN, k)
    want = weight.weight.float() if fmt == "fp8" else dequantize(weight, torch.bfloat16).float()
    assert torch.equal(got[:n].float(), want) and not got[n:].float().any()


def test_plan_routes_quantized_weights_on_sm100(rng):
    keys = {}
    for name, (fmt, make) in REPLAY_CASES.items():
        path = _plan(rng, make(rng, N_TOT, 256), arch="sm_100a")
        assert (path.path, path.kernel, path.key.weight_format) == ("kernel", "FusedQKVGemmW4Sm100", fmt), path
        keys[name] = path.key
    assert len(set(keys.values())) == len(keys)


def test_sm100_kernel_rejects_what_it_cannot_decode():
    spec = QKVSpec("bfloat16", 4096, 2, 16, 8, 128, 128, False, None)
    with pytest.raises(ValueError, match="weight_format"):
        FusedQKVGemmW4Sm100(QKVW4Spec(spec, "nvfp4"))
    with pytest.raises(ValueError, match="bfloat16"):
        FusedQKVGemmW4Sm100(QKVW4Spec(QKVSpec("float16", 4096, 2, 16, 8, 128, 128, False, None), "int4"))
    with pytest.raises(ValueError, match="targets sm_100a"):
        FusedQKVGemmW4Sm100(QKVW4Spec(spec, "int4"), "sm_90a")


def test_stages_fill_shared_memory():
    assert stages("int4", 69184) == stages("int4_g32", 69184) == stages("fp8", 69184) == 3


# -- compiled for sm_100a --------------------------------------------------------------------------------------------

def _w4(case) -> FusedQKVGemmW4Sm100:
    return FusedQKVGemmW4Sm100(_w4_sm90(case).spec)


@functools.lru_cache(maxsize=None)
def _ptx(case):
    return artifacts.compiled(_w4(case), "sm_100a").ptx


UTCMMA = r"tcgen05\.mma\.cta_group::1\.kind::f16"


@pytest.mark.compile
@pytest.mark.parametrize("case", SM100_CASES)
def test_fused_qkv_w4_sm100_ptx(case, tmp_path):
    from test_fused_qkv_gemm import ptxas_report

    kernel = _w4(case)
    ptx = _ptx(case)
    # one k-tile body: 4 MMAs of 128 x 128 x 16, A and B from shared memory descriptors
    assert len(re.findall(UTCMMA, ptx)) == K_TILE // 16
    for op in ("tcgen05.alloc", "tcgen05.dealloc", "tcgen05.relinquish_alloc_permit"):
        assert ptx.count(op) == 1, op
    assert ptx.count("tcgen05.ld.sync.aligned.32x32b.x32") == 4  # the accumulator row, 32 tokens at a time
    # the decode: 32 values a thread per 64-row block and k-tile, two blocks; one bf16x2 store per pair
    fp8 = kernel.spec.column_scales
    assert ptx.count("mul.rn.bf16x2") == (0 if fp8 else 32) and ptx.count("add.rn.bf16x2") == (0 if fp8 else 32)
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == (32 if fp8 else 0)
    assert ptx.count("cvt.rn.bf16x2.e4m3x2") == 0  # the f16 route the toolkit's assembler takes
    assert ptx.count("fence.proxy.async.shared::cta") >= 1  # the stage's generic stores before the MMA reads it
    # what the load warp brings: packed weights, (int4) the scale strip, the hidden tile
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)) == (2 if fp8 else 3)
    stores = ["st.global.v4.b32", "st.global.v4.b32"]
    if kernel.spec.qkv.fp8:
        stores = ["st.global.v2.b32", "st.global.v4.b32", "st.global.b32"]
    # split-K: a partial's 8 floats as two 16-byte stores, one arrival (acq_rel) and one reset per tile
    arrival = ["atom.global.acq_rel.add.u32", "atom.global.exch.b32"]
    if kernel.spec.qkv.last_arriver:  # and the latent's or wide heads' (test_fused_qkv_latent, test_fused_qkv_wide)
        assert re.findall(r"atom\.\S+", ptx) == 2 * arrival
    else:
        assert re.findall(r"atom\.\S+", ptx) == arrival
        # the bf16 kernel's epilogue stores
        assert sorted(re.findall(r"st\.global\.\S+", ptx)) == sorted(stores + 2 * ["st.global.v2.b64"])
    report = ptxas_report(ptx, "sm_100a", tmp_path)
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"]
    assert "0 bytes stack frame" in report
    assert int(re.search(r"Used (\d+) registers", report).group(1)) <= 65536 // THREADS // 8 * 8


@pytest.mark.compile
@pytest.mark.sass
@pytest.mark.skipif(static.tools_available() is not None, reason=str(static.tools_available()))
@pytest.mark.parametrize("case", ["int4-llama-neox", "fp8-gptj-partial"])
def test_fused_qkv_w4_sm100_sass_loops(case):
    """In the SASS: the MMA warp's k-loop issues 4 UTC*MMA per k-tile, the transform warps' k-loop loads its words
    (2 LDS.128 per block pair, the strip words) and decodes 64 weights a thread with about 2 instructions each (SM90's
    decode: HMUL2/HADD2/LOP3/SHF for int4, F2FP/HADD2 for e4m3), then 32 stage stores."""
    loop = transform_loop(_sass(_ptx(case), "sm_100a")[1], BN * K_TILE // TRANSFORM_THREADS)
    assert loop["utcmma_per_k_tile"] == K_TILE // 16
    assert loop["stage_stores_per_k_tile"] == 32 and loop["stage_loads_per_k_tile"] <= 4
    assert 1.5 <= loop["decode_per_weight"] <= 2.2, loop


@pytest.mark.parametrize("t", [1, 131, 300])
def test_sm100_schedule_finishes_the_latent(t):
    """MLA's latent through this kernel's schedule: the persistent tiles in any order, split-K on, each (weight tile,
    128-token tile) running the epilogue once, by its last split, as the latent's (M tile, N tile) with the M tile its
    128 tokens: exactly the tiles the latent replay expects, whose launch then gives the in-order bits and leaves the
    counters at zero (tests/test_fused_qkv_latent.py)."""
    from test_fused_qkv_latent import PTX_CASES, Replay, _problem

    spec = PTX_CASES["rope-aware-fp8-norm"]
    c, bias, gamma, pos, freqs, *_ = _problem(spec, [t], seed=3)
    w_tiles, x_tiles = -(-spec.n_total // BN), -(-t // TOKENS)
    splits = split_k(w_tiles * x_tiles, 64, 148)
    assert splits > 1
    g = torch.Generator().manual_seed(t)
    tiles = list(range(w_tiles * x_tiles * splits))
    arrivals, order = {}, []
    for tile in [tiles[i] for i in torch.randperm(len(tiles), generator=g)]:
        w_tile, x_tile, _ = tile_coords(tile, w_tiles, splits)
        for half in range(min(2, -(-(t - 2 * x_tile * TILE_TOKENS) // TILE_TOKENS))):
            key = (2 * x_tile + half, w_tile)
            arrivals[key] = arrivals.get(key, 0) + 1
            if arrivals[key] == splits:  # the last split runs the epilogue
                order.append(key)
    want = Replay(spec, c, bias, gamma, pos, freqs)
    assert sorted(order) == sorted(want.tiles())
    got = Replay(spec, c, bias, gamma, pos, freqs).run(order)
    assert torch.equal(got.bits(), want.run(want.tiles()).bits()) and not got.counters.any()


@pytest.mark.parametrize("case", SM100_CASES)
def test_sm100_launch_arguments_match_the_compiled_signature(rng, case):
    kernel = _w4(case)
    s = kernel.spec.qkv
    fmt, k = kernel.spec.weight_format, 256
    weight = _fp8(rng, s.n_total, k) if fmt == "fp8" else _int4(
        rng, s.n_total, k, {"int4": 128, "int4awq": 128, "int4_g32": 32}[fmt], has_zp=fmt == "int4awq")
    t = 5
    hidden = torch.randn(t, k).to(torch.bfloat16)
    some = lambda on: torch.empty(1) if on else None  # noqa: E731 -- the operands the spec compiled in
    real = kernel.args(hidden, weight, torch.empty(t, s.q_dim, dtype=torch.bfloat16), torch.empty(1), torch.empty(1),
                       torch.empty(1), torch.empty(1, 1), 0, some(s.has_bias), some(s.rope), some(s.q_norm_dim),
                       some(s.k_norm_dim), some(s.granularity), 148, some(s.last_arriver), some(s.last_arriver))
    fake = kernel.fake_args()[:-1]  # the stream: the current one at launch
    assert [x is None for x in real] == [x is None for x in fake]
    for r, f in zip(real[:2], fake[:2]):
        if r is None:
            continue
        assert len(r.shape) == len(f.shape)
        for got, want in [*zip(r.shape, f.shape), *zip(r.stride(), f.stride)]:
            if isinstance(want, int):
                assert got == want, (r.shape, r.stride(), f.shape, f.stride)
    assert [x is None for x in real[3]] == [x is None for x in fake[3]]  # the epilogue's optional operands
    assert (real[3].column_scales is None) == (fmt != "fp8")
    assert real[4].shape[1] == fake[4].shape[1] == BN and real[4].stride() == (BN, 1)  # split-K's partials


# -- split-K ---------------------------------------------------------------------------------------------------------


def test_split_k_counts():
    """Splits fill the grid when the tiles do not (Llama-3-8B's 48 weight tiles on 148 SMs: 3), within MAX_SPLITS
    and MIN_SPLIT_K_TILES; none when the tiles fill it; every split non-empty, together covering K once."""
    assert split_k(48, 64, 148) == 3 and split_k(8, 64, 148) == MAX_SPLITS
    assert split_k(148, 64, 148) == split_k(300, 64, 148) == 1
    assert split_k(48, 2 * MIN_SPLIT_K_TILES - 1, 148) == 1 and split_k(48, 2 * MIN_SPLIT_K_TILES, 148) == 2
    for tiles in (1, 2, 5, 17, 48, 74, 149):
        for k_tiles in (1, 3, 8, 9, 13, 64, 65, 112):
            s = split_k(tiles, k_tiles, 148)
            assert 1 <= s <= MAX_SPLITS and (s == 1 or k_tiles // s >= MIN_SPLIT_K_TILES - 1)
            ranges = [k_range(i, s, k_tiles) for i in range(s)]
            assert all(k0 < k1 for k0, k1 in ranges), (tiles, k_tiles, s, ranges)
            assert [r[0] for r in ranges] == [0] + [r[1] for r in ranges[:-1]] and ranges[-1][1] == k_tiles


@pytest.mark.parametrize("t", [1, 5, 128, 131, 300])
def test_split_k_replay(t):
    """The launch of a split-K step modelled as the epilogue runs it: each (weight tile, 128-token tile, split) of the
    persistent schedule (``tile_coords``), in any order, stages its partial over its k-range (``k_range``), stores its
    live rows to its slot and counts on its tile; the last split adds the slots in split order. Every order gives the
    same bits, close to the unsplit product; each tile is finished once by its last split; the counters end at zero;
    no two partials share a slot."""
    g = torch.Generator().manual_seed(t)
    w_tiles, k_tiles = 3, 13
    k = k_tiles * K_TILE
    x_tiles = -(-t // TOKENS)
    splits = split_k(w_tiles * x_tiles, k_tiles, 148)
    assert splits > 1
    w, x = torch.randn(w_tiles * BN, k, generator=g), torch.randn(t, k, generator=g)
    epi_tiles = 2 * x_tiles
    counters = torch.zeros(w_tiles * epi_tiles, dtype=torch.int32)

    def launch(order):
        partials = torch.full((w_tiles * epi_tiles * splits * TILE_TOKENS, BN), float("nan"))
        out, finished, slots = {}, {}, set()
        for tile in order:
            w_tile, x_tile, split = tile_coords(tile, w_tiles, splits)
            k0, k1 = k_range(split, splits, k_tiles)
            ks = slice(k0 * K_TILE, k1 * K_TILE)
            halves = min(2, -(-(t - 2 * x_tile * TILE_TOKENS) // TILE_TOKENS))
            for half in range(halves):
                epi_tile = 2 * x_tile + half
                rows = min(TILE_TOKENS, t - epi_tile * TILE_TOKENS)
                m0 = epi_tile * TILE_TOKENS
                staged = x[m0:m0 + rows, ks] @ w[w_tile * BN:(w_tile + 1) * BN, ks].T  # [tokens, weight rows]
                counter = w_tile * epi_tiles + epi_tile
                slot = (counter * splits + split) * TILE_TOKENS
                assert slot not in slots
                slots.add(slot)
                partials[slot:slot + rows] = staged
                arrived = int(counters[counter])
                counters[counter] += 1
                if arrived == splits - 1:
                    counters[counter] = 0
                    assert counter not in finished
                    finished[counter] = split
                    first = counter * splits * TILE_TOKENS
                    acc = partials[first:first + rows].clone()
                    for s in range(1, splits):
                        acc = acc + partials[first + s * TILE_TOKENS:first + s * TILE_TOKENS + rows]
                    assert not acc.isnan().any()
                    out[counter] = acc
        assert not counters.any() and len(finished) == w_tiles * -(-t // TILE_TOKENS)
        return out

    tiles = list(range(w_tiles * x_tiles * splits))
    want = launch(tiles)
    for _ in range(3):
        got = launch([tiles[i] for i in torch.randperm(len(tiles), generator=g)])
        assert got.keys() == want.keys() and all(torch.equal(got[c], want[c]) for c in want)
    full = x @ w.T
    for counter, acc in want.items():
        w_tile, epi_tile = divmod(counter, epi_tiles)
        m0 = epi_tile * TILE_TOKENS
        assert torch.allclose(acc, full[m0:m0 + acc.shape[0], w_tile * BN:(w_tile + 1) * BN], atol=1e-3)


def test_sm100_split_k_arguments(rng):
    """A decode step of Llama-3-8B's shape on 148 SMs: the launch splits K in 3 (48 weight tiles), with partials for
    every (weight tile, 128-token tile, split) and a counter per tile, zero; a prefill step does not split."""
    kernel = _w4("int4-llama-neox")
    s = kernel.spec.qkv
    k = 4096
    weight = _int4(rng, s.n_total, k, 128)
    for t, splits in ((3, 3), (2048, 1)):
        hidden = torch.randn(t, k).to(torch.bfloat16)
        args = kernel.args(hidden, weight, torch.empty(t, s.q_dim, dtype=torch.bfloat16), torch.empty(1),
                           torch.empty(1), torch.empty(1), torch.empty(1, 1), 0, None, torch.empty(1), None, None,
                           None, 148)
        partials, counters, got = args[4:7]
        assert int(got) == splits
        if splits > 1:
            assert partials.shape[0] >= 48 * 2 * splits * TILE_TOKENS and counters.numel() >= 48 * 2
            assert not counters.any()


# -- on a GPU --------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fmt,ctas,new", [("int4awq", 3, [130, 0, 200, 1]), ("fp8", 3, [130, 0, 200, 1]),
                                          ("int4awq", 148, [1, 0, 2, 1]), ("fp8", 148, [1, 0, 131, 1])])
def test_fused_qkv_w4_sm100_persistent_rings(monkeypatch, fmt, ctas, new):
    """Three CTAs for 24 tiles of 10 k-tiles each (331 tokens: a 256-token tile drained as two epilogue tiles, one
    as one): every ring wraps several times within a tile and both TMEM accumulators alternate across a CTA's
    tiles; 148 CTAs for a decode step or a short prefill: split-K (two splits of 5 k-tiles). Against the reference,
    cache untouched outside the step."""
    import cute_kv
    from cute_kv import reference as ref
    from cute_kv.ops import fused_qkv
    from cute_kv.ops.paths import device_arch

    from numerics import rel_err
    from test_fused_qkv_kernel import _inputs
    from test_fused_qkv_w4 import _cuda_weight

    if device_arch(torch.device("cuda")) != "sm_100a":
        pytest.skip("FusedQKVGemmW4Sm100 is sm_100a's")
    monkeypatch.setattr(fused_qkv, "_max_active_clusters", lambda *_: ctas)
    kcase = (torch.bfloat16, 2, 8, 128, 16, 640, True, (128, False, None), False, None)
    (cpu, gpu), hidden, dense, bias, rope, q_dim, _ = _inputs(kcase, [0, 37, 5, 130], new, seed=9)
    g = torch.Generator().manual_seed(10)
    weight = (_fp8(g, *dense.shape) if fmt == "fp8" else _int4(g, *dense.shape, 128, has_zp=True))
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias, rope=rope)
    w = _cuda_weight(weight)
    rope_gpu = cute_kv.RopeConfig(rope.freqs_cis.cuda(), rope.interleaved, rope.q_head_dim)
    assert fused_qkv.plan(gpu.collection, hidden.cuda(), w, rope_gpu, "sm_100a").kernel == "FusedQKVGemmW4Sm100"
    out = torch.full((hidden.shape[0], q_dim), float("nan"), dtype=hidden.dtype, device="cuda")
    cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, w, gpu.collection, 1, output=out,
                                      bias=bias.cuda(), rope=rope_gpu)
    torch.cuda.synchronize()
    assert not out.isnan().any() and rel_err(out.cpu(), want) < 1e-2
    step = cpu.step_mask(1)
    blocks, want_blocks = gpu.collection.blocks.cpu(), cpu.collection.blocks
    assert not blocks[step].isnan().any() and rel_err(blocks[step], want_blocks[step]) < 1e-2
    assert torch.equal(blocks[~step].view(torch.int16), want_blocks[~step].view(torch.int16))
