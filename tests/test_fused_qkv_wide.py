"""Heads wider than a column tile in ``FusedQKVGemm`` (``QKVSpec.wide``): normalized or neox-rotated Q/K heads of
256 dims (Gemma 3), finished by the last of the head's tiles to arrive (``epilogue._finish_heads``).

On the CPU: the epilogue's own tile pass and finish run on the host (CuTe DSL host code, threads one after another)
for RoPE-only heads and match the reference, with the Q/K tiles writing only the workspace and V stored by its tile;
a PyTorch replay of the launch (tiles in any order, one counter per head and M tile, the finish's reduction order)
covers QK-norm; host rules (``supported``, ``plan``, the workspace); PTX for
sm_90a and sm_100a (the fence and the atomic, the mainloop unchanged, no spills); and the op on a GPU against the
reference (``gpu`` marker).
"""

import functools
import os
import re
import sys

import pytest
import torch
from cutlass.cute.runtime import from_dlpack

import artifacts

import cute_kv
import host_plans
from cute_kv import QKNorm, RopeConfig
from cute_kv import reference as ref
from cute_kv.ops.fused_qkv import latent_workspace, plan
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.rope import apply_rope

from numerics import bits, rel_err

pytest.importorskip("quack")
from cute_kv.kernels.qkv.gemm import BN, CTA_ROWS, FusedQKVGemm, QKVSpec, supported  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fused_qkv_gemm import MMA, _bare_ptx, ptxas_report  # noqa: E402
from test_fused_qkv_latent import _butterfly, random_step  # noqa: E402

VEC, LANES = 8, BN // 8
# Gemma 3 12B's attention: 16 Q heads and 8 K/V heads of 256, QK-norm (weight offset 1), neox RoPE over the head
GEMMA3 = dict(dtype_name="bfloat16", q_dim=16 * 256, kv_dim=2, page_size=16, num_heads=8, head_dim=256,
              q_head_dim=256, has_bias=False, rope=(256, False), q_norm_dim=256, k_norm_dim=256, norm_offset=1.0)
SMALL = dict(GEMMA3, q_dim=2 * 256, num_heads=1)  # 2 Q heads, 1 K/V head: 8 column tiles
CASES = {
    "gemma3-12b": QKVSpec(**GEMMA3),
    "gemma3-fp8-g64": QKVSpec(**GEMMA3, fp8=True, granularity=64),
    "small-norm-bias": QKVSpec(**{**SMALL, "has_bias": True}),
    # neox over half the head, Q-norm over its first half: K is wide for its rotation alone
    "small-partial-neox-qnorm": QKVSpec(**{**SMALL, "rope": (128, False), "q_norm_dim": 128, "k_norm_dim": 0}),
}


def test_supported_wide_heads():
    s = CASES["gemma3-12b"]
    assert supported(s) is None and s.wide == (True, True) and s.last_arriver and not s.tile_norm
    assert s.head_groups == (16, 8) and s.counter_groups == 24 and s.workspace_cols == 16 * 256 + 8 * 256
    assert s.workspace_base == 0 and s.max_head_lanes == 0
    # only the normalized side is wide without neox; GPT-J pairs need no whole head
    k_only = QKVSpec(**{**GEMMA3, "rope": (256, True), "q_norm_dim": 0})
    assert k_only.wide == (False, True) and k_only.workspace_base == k_only.q_dim and k_only.head_groups == (0, 8)
    assert not QKVSpec(**{**GEMMA3, "rope": (256, True), "q_norm_dim": 0, "k_norm_dim": 0}).last_arriver
    # 128-dim heads stay inside a tile; the latent is MLA's last arriver, not a wide head
    assert QKVSpec(**{**GEMMA3, "head_dim": 128, "q_head_dim": 128}).wide == (False, False)
    assert "span whole tiles (a multiple of 128)" in supported(QKVSpec(**{**GEMMA3, "head_dim": 192, "q_head_dim": 192,
                                                                         "q_dim": 16 * 192, "rope": (192, False),
                                                                         "q_norm_dim": 192, "k_norm_dim": 192}))
    # a wide K head must start on a tile: q_dim a multiple of 128
    assert "straddle" in supported(QKVSpec(**{**GEMMA3, "q_head_dim": 64, "q_dim": 3 * 64, "rope": (64, True),
                                              "q_norm_dim": 64}))


# -- the epilogue's own code on the host -------------------------------------------------------------------------


def _rows(bm, num_pages, page_size, g):
    """Positions and pages of ``bm`` tile rows: consecutive positions from 7, pages shuffled; two rows without a
    page (not stored), one position past the table (its rotated dims NaN)."""
    pos = torch.arange(7, 7 + bm, dtype=torch.int32)
    perm = torch.randperm(num_pages, generator=g).to(torch.int32)
    page = perm[pos.long() // page_size]
    page[[3, 50]] = -1
    return pos, page


@pytest.mark.compile
@pytest.mark.parametrize("rope_dim", [256, 128])
def test_host_tiles_and_finish_match_the_reference(rope_dim):
    """RoPE-only wide heads (no shuffles: the host runs the threads one after another; bf16, as the host cannot
    convert to e4m3): the Q and K tiles write their columns to the workspace and nothing else, the V tiles store V;
    then each head's finish, as the last arriver runs it, stores Q and K rotated at the row's position, as the
    reference does, into shuffled pages; rows without a page are not written and the rest of the cache is
    unchanged."""
    spec = QKVSpec(**{**SMALL, "rope": (rope_dim, False), "q_norm_dim": 0, "k_norm_dim": 0})
    assert spec.wide == (True, True) and supported(spec) is None
    bm, d, positions_ = CTA_ROWS, spec.head_dim, 300
    g = torch.Generator().manual_seed(11)
    c = torch.randn(bm, spec.n_total, generator=g) * 2
    pos, page = _rows(bm, 40, spec.page_size, g)
    pos[9] = positions_ + 4  # unchecked metadata: past freqs_cis
    rope = RopeConfig.from_theta(rope_dim, positions_)
    blocks = torch.randn(40, 2, 1, spec.page_size, 1, d, generator=g).to(torch.bfloat16)
    before = blocks.clone()
    out = torch.full((bm, spec.q_dim), float("nan"), dtype=torch.bfloat16)
    ws = torch.full((bm, spec.workspace_cols), float("nan"))
    args = [from_dlpack(x) for x in (page, pos, out, blocks, rope.freqs_cis)]
    for n0 in range(0, spec.n_total, BN):
        staged = c[:, n0:n0 + BN].contiguous()
        host_plans.fused_qkv_rope_tile(spec, from_dlpack(staged), *args, n0, 128, from_dlpack(ws))
    assert out.isnan().all() and bits(blocks[:, 0]).equal(bits(before[:, 0]))  # Q, K: the finish's alone
    assert torch.equal(ws, c[:, :spec.workspace_cols])  # the workspace holds Q and K as the tiles staged them
    for group in range(spec.counter_groups):
        host_plans.fused_qkv_finish_heads(spec, *args, from_dlpack(ws), group, bm, 128)
    ok = pos < positions_
    at = pos.long().clamp(max=positions_ - 1)
    q = apply_rope(c[:, :spec.q_dim].unflatten(1, (-1, d)), at, rope).flatten(1)
    k = apply_rope(c[:, spec.q_dim:spec.q_dim + d][:, None], at, rope)[:, 0]
    assert rel_err(out[ok].float(), q[ok]) < 1e-2 and not out[ok].isnan().any()
    assert out[9, :rope_dim].isnan().all() and not out[9, rope_dim:d].isnan().any()  # kept dims stay
    stored = page >= 0
    slot = (pos % spec.page_size).long()
    got_k = blocks[page[stored & ok].long(), 0, 0, slot[stored & ok], 0].float()
    assert rel_err(got_k, k[stored & ok]) < 1e-2
    assert torch.equal(blocks[page[stored].long(), 1, 0, slot[stored], 0], c[:, spec.q_dim + d:][stored].bfloat16())
    written = torch.zeros(blocks.shape[:4], dtype=torch.bool)
    written[page[stored].long(), :, 0, slot[stored]] = True
    assert torch.equal(bits(blocks[~written]), bits(before[~written]))  # pages of rows 3 and 50, and all others


# -- the replay: arrivals, counters and the finish with norms and fp8 scales -------------------------------------


class Replay:
    """A launch of a wide-head spec on the float32 accumulator ``c [T, N_tot]`` (+ bias), tile by tile as the
    epilogue runs it: the Q/K tiles write the workspace and count on their head's counter, the last arriver finishes
    the head in the kernel's order (a lane's squares chunk by chunk, then the row's butterfly)."""

    def __init__(self, spec, c, bias, q_gamma, k_gamma, pos, freqs):
        self.spec, self.c = spec, c + (0 if bias is None else bias)
        self.gamma = (q_gamma, k_gamma)
        self.pos, self.freqs = pos, freqs
        self.m_tiles = -(-c.shape[0] // CTA_ROWS)
        self.workspace = torch.full((self.m_tiles * CTA_ROWS, spec.workspace_cols), float("nan"))
        self.counters = torch.zeros(self.m_tiles * spec.counter_groups, dtype=torch.int32)

    def tiles(self):
        return [(m, n) for m in range(self.m_tiles) for n in range(-(-self.spec.n_total // BN))]

    def group(self, n_tile):
        """``epilogue.arrive``'s (counter group, tiles counted) of a column tile, or None."""
        s = self.spec
        (q_heads, k_heads), q_tiles = s.head_groups, s.q_dim // BN
        if q_heads and n_tile < q_tiles:
            return n_tile // (s.q_head_dim // BN), s.q_head_dim // BN
        k_tile = n_tile - q_tiles
        if k_heads and 0 <= k_tile < k_heads * (s.head_dim // BN):
            return q_heads + k_tile // (s.head_dim // BN), s.head_dim // BN
        return None

    def run(self, order):
        self.finished_by, self.out = {}, {}
        for m_tile, n_tile in order:
            s, m0, n0 = self.spec, m_tile * CTA_ROWS, n_tile * BN
            staged = torch.zeros(CTA_ROWS, BN)  # rows past the step: TMA's zero fill
            rows, cols = min(CTA_ROWS, self.c.shape[0] - m0), min(BN, s.n_total - n0)
            staged[:rows, :cols] = self.c[m0:m0 + rows, n0:n0 + cols]
            arrival = self.group(n_tile)
            if arrival is None:
                continue  # V (or a side that is not wide): stored by the tile
            ws0 = n0 - s.workspace_base
            self.workspace[m0:m0 + CTA_ROWS, ws0:ws0 + BN] = staged
            group, count = arrival
            counter = m_tile * s.counter_groups + group
            arrived = int(self.counters[counter])
            self.counters[counter] += 1
            if arrived == count - 1:
                self.counters[counter] = 0
                assert (m_tile, group) not in self.finished_by
                self.finished_by[(m_tile, group)] = n_tile
                self.finish(m_tile, group)
        return self

    def finish(self, m_tile, group):
        s = self.spec
        q_heads = s.head_groups[0]
        is_q = group < q_heads
        size = s.q_head_dim if is_q else s.head_dim
        n0 = group * size if is_q else s.q_dim + (group - q_heads) * size
        norm_dim, gamma = (s.q_norm_dim, self.gamma[0]) if is_q else (s.k_norm_dim, self.gamma[1])
        m0 = m_tile * CTA_ROWS
        x = self.workspace[m0:m0 + CTA_ROWS, n0 - s.workspace_base:n0 - s.workspace_base + size].clone()
        assert not x.isnan().any(), "the last arriver read a workspace value no tile wrote"
        if norm_dim:
            chunks = x.unflatten(1, (-1, LANES, VEC))  # [row, j, lane, 8]: lane l holds chunks l, l + 16, ...
            normed = (torch.arange(size).unflatten(0, (-1, LANES, VEC)) < norm_dim)
            ss = torch.zeros(CTA_ROWS, LANES)
            for j in range(chunks.shape[1]):
                for e in range(VEC):
                    ss = ss + torch.where(normed[j, :, e], chunks[:, j, :, e] * chunks[:, j, :, e], 0.0)
            rstd = torch.rsqrt(_butterfly(ss) * torch.tensor(1.0 / norm_dim) + s.norm_epsilon)
            w = torch.ones(size)
            w[:norm_dim] = gamma + s.norm_offset
            x = torch.where(torch.arange(size) < norm_dim, x * rstd[:, None] * w, x)
        r, _ = s.rope
        rows = min(CTA_ROWS, self.c.shape[0] - m0)
        rope = RopeConfig(self.freqs, False)
        x = apply_rope(x[:rows, None], self.pos[m0:m0 + rows].long(), rope)[:, 0]
        for i in range(rows):
            self.out[(m0 + i, n0)] = x[i]


def _problem(spec, new, seed):
    g, c, bias, pos, offsets, cached = random_step(spec, new, seed)
    q_gamma = torch.rand(spec.q_norm_dim, generator=g) - 0.5 if spec.q_norm_dim else None
    k_gamma = torch.rand(spec.k_norm_dim, generator=g) - 0.5 if spec.k_norm_dim else None
    freqs = RopeConfig.from_theta(spec.rope[0], 1024).freqs_cis
    return c, bias, q_gamma, k_gamma, pos, freqs, offsets, cached


NEW = [0, 1, 131, 17, 1, 150]  # 300 tokens: three M tiles, one partial; requests of 0, 1 and odd lengths


@pytest.mark.parametrize("case", ["small-norm-bias", "small-partial-neox-qnorm"])
def test_any_arrival_order_finishes_each_head_once(case):
    spec = CASES[case]
    args = _problem(spec, NEW, seed=5)[:6]
    want = Replay(spec, *args)
    want.run(want.tiles())
    g = torch.Generator().manual_seed(6)
    for _ in range(3):
        r = Replay(spec, *args)
        tiles = r.tiles()
        order = [tiles[i] for i in torch.randperm(len(tiles), generator=g)]
        r.run(order)
        assert not r.counters.any()  # every counter back at zero for the next launch
        groups = {(m, r.group(n)[0]) for m, n in tiles if r.group(n) is not None}
        assert set(r.finished_by) == groups  # each (M tile, head) finished once ...
        for (m_tile, group), n_tile in r.finished_by.items():  # ... by the last of the head's tiles to arrive
            assert n_tile == [n for m, n in order if m == m_tile and r.group(n) and r.group(n)[0] == group][-1]
        assert r.out.keys() == want.out.keys()
        assert all(torch.equal(bits(r.out[k]), bits(want.out[k])) for k in want.out)


@pytest.mark.parametrize("case", ["small-norm-bias", "small-partial-neox-qnorm"])
def test_replay_matches_the_reference(case):
    """The replay's Q and K heads against ``reference.fused_qkv_matmul_kv_cache`` (hidden = I, weight = c^T: the
    reference's float32 accumulator is the replay's)."""
    spec = CASES[case]
    c, bias, q_gamma, k_gamma, pos, freqs, offsets, cached = _problem(spec, NEW, seed=7)
    t, d = c.shape[0], spec.head_dim
    replay = Replay(spec, c, bias, q_gamma, k_gamma, pos, freqs)
    replay.run(replay.tiles())
    pb = random_paged_batch(cached, NEW, num_heads=spec.num_heads, head_size=d, page_size=spec.page_size,
                            generator=torch.Generator().manual_seed(8), num_layers=1)
    rope = RopeConfig(freqs, False, spec.q_head_dim)
    norm = QKNorm(q_weight=q_gamma, k_weight=k_gamma, weight_offset=spec.norm_offset)
    q = ref.fused_qkv_matmul_kv_cache(torch.eye(t), pb.input_row_offsets, c.T.contiguous(), pb.collection, 0,
                                      rope=rope, qk_norm=norm, bias=None if bias is None else bias)
    heads = spec.q_dim // spec.q_head_dim
    got_q = torch.stack([torch.cat([replay.out[(m, h * d)] for h in range(heads)]) for m in range(t)])
    assert rel_err(got_q, q.float()) < 1e-5
    want_k = torch.cat([pb.dense(0, 0, b, cl + n)[cl:, 0] for b, (cl, n) in enumerate(zip(cached, NEW))])
    got_k = torch.stack([replay.out[(m, spec.q_dim)] for m in range(t)])
    assert rel_err(got_k.to(torch.bfloat16).double(), want_k) < 1e-2


# -- host rules --------------------------------------------------------------------------------------------------


def _gemma_batch(fp8=False):
    pb = random_paged_batch([5, 0, 40], [3, 1, 9], num_heads=8, head_size=256, page_size=16,
                            generator=torch.Generator().manual_seed(3), num_layers=1,
                            dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
                            scale_dtype=torch.float32 if fp8 else None, quantization_granularity=64 if fp8 else None)
    rope = RopeConfig.from_theta(256, 128, q_head_dim=256)
    norm = QKNorm(q_weight=torch.rand(256), k_weight=torch.rand(256), weight_offset=1.0)
    return pb, rope, norm


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("fp8", [False, True])
def test_plan_serves_wide_heads(arch, fp8):
    pb, rope, norm = _gemma_batch(fp8)
    hidden = torch.randn(13, 512).to(torch.bfloat16)
    weight = torch.randn(16 * 256 + 2 * 8 * 256, 512).to(torch.bfloat16)
    path = plan(pb.collection, hidden, weight, rope, arch, norm)
    assert path.kernel == "FusedQKVGemm", path
    assert path.key.wide == (True, True) and path.key.fp8 == fp8


def test_workspace_counts_a_counter_per_head():
    spec = CASES["gemma3-12b"]
    ws, counters = latent_workspace(torch.device("cpu"), spec, 300)
    assert ws.shape[1] == 6144 and ws.shape[0] >= 4 * CTA_ROWS  # 300 rows: 3 M tiles, 4 as whole clusters
    assert counters.numel() >= 4 * 24 and not counters.any()


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("quantized", [False, True])
def test_launcher_passes_the_workspace(rng, monkeypatch, quantized, arch):
    """The launcher hands a last-arriver kernel its workspace and counters, a quantized weight's (``QKVW4Spec``,
    whose ``QKVSpec`` holds the flag) too, on both archs: captured in place of the compiled kernel (no GPU
    needed)."""
    from cute_kv.kernels import compile_cache as cache
    from cute_kv.ops import fused_qkv
    from test_fused_qkv_w4 import _int4

    calls = []
    monkeypatch.setattr(cache, "compiled", lambda key, build, arch: lambda *args: calls.append(args))
    monkeypatch.setattr(fused_qkv, "_max_active_clusters", lambda device, shape: 132)
    pb, rope, norm = _gemma_batch()
    hidden = torch.randn(pb.total_rows, 256).to(torch.bfloat16)
    weight = torch.randn(16 * 256 + 2 * 8 * 256, 256).to(torch.bfloat16)
    if quantized:
        weight = _int4(rng, *weight.shape, 128)
    path = plan(pb.collection, hidden, weight, rope, arch, norm)
    w4 = "FusedQKVGemmW4Sm100" if arch == "sm_100a" else "FusedQKVGemmW4"
    assert path.kernel == (w4 if quantized else "FusedQKVGemm")
    fused_qkv._launcher(path.key, arch, norm)(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=rope)
    (args,) = calls
    epi = next(a for a in args if hasattr(a, "workspace"))
    spec = getattr(path.key, "qkv", path.key)
    assert epi.workspace.shape[1] == spec.workspace_cols and epi.counters.numel() >= spec.counter_groups


# -- compiled ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _ptx(case, arch):
    return artifacts.compiled(FusedQKVGemm(CASES[case], arch), arch).ptx


@pytest.mark.compile
@pytest.mark.parametrize("case,arch", [("gemma3-12b", "sm_90a"), ("gemma3-fp8-g64", "sm_90a"),
                                       ("gemma3-12b", "sm_100a"), ("gemma3-fp8-g64", "sm_100a")])
def test_wide_heads_ptx(case, arch, tmp_path):
    spec, ptx = CASES[case], _ptx(case, arch)
    assert len(re.findall(MMA[arch], ptx)) == len(re.findall(MMA[arch], _bare_ptx(arch))) > 0  # mainloop unchanged
    assert re.findall(r"atom\.\S+", ptx) == ["atom.global.acq_rel.add.u32", "atom.global.exch.b32"]
    assert ptx.count("fence.acq_rel.gpu") == 2
    # the finish's sum of squares over a row's 16 lanes (4 steps); fp8 granules of 64 dims: 3 NaN-max steps in the
    # tile pass (V) and 3 per chunk a lane finishes (K: two, unrolled)
    amax = 3 * (1 + spec.head_dim // BN) if spec.granularity else 0
    assert ptx.count("shfl.sync.bfly") == 4 + amax and ptx.count("max.NaN.f32") == amax
    report = ptxas_report(ptx, arch, tmp_path)
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"] and "0 bytes stack frame" in report


# -- on a GPU ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_wide_heads_kernel_matches_reference(fp8):
    """Gemma 3 12B's projection (three M tiles, ragged 0/1/odd requests, shuffled pages) against the reference on a
    CPU copy: Q within bf16 tolerance, the step's cache rows within their format's, every other byte unchanged; a
    second launch (counters reset by the first) stores the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from cute_kv.ops.paths import device_arch

    g = torch.Generator().manual_seed(21)
    cached = [5, 0, 37, 130, 1, 64]
    kw = dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, quantization_granularity=64) if fp8 else {}
    batches = [random_paged_batch(cached, NEW, num_heads=8, head_size=256, page_size=16, num_layers=2, device=dev,
                                  generator=torch.Generator().manual_seed(22), **kw) for dev in ("cpu", "cuda")]
    for pb in batches:
        pb.collection.blocks.view(torch.uint8)[pb.step_mask(1)] = 0xFF  # NaN in e4m3 bytes and bf16 byte pairs
    cpu, gpu = batches
    t, k = sum(NEW), 512
    hidden = torch.randn(t, k, generator=g).to(torch.bfloat16)
    weight = (torch.randn(16 * 256 + 2 * 8 * 256, k, generator=g) / k**0.5).to(torch.bfloat16)
    freqs = RopeConfig.from_theta(256, 512).freqs_cis
    q_w, k_w = torch.rand(256, generator=g) - 0.5, torch.rand(256, generator=g) - 0.5
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1,
                                         rope=RopeConfig(freqs, False, 256),
                                         qk_norm=QKNorm(q_weight=q_w, k_weight=k_w, weight_offset=1.0))
    rope = RopeConfig(freqs.cuda(), False, 256)
    norm = QKNorm(q_weight=q_w.cuda(), k_weight=k_w.cuda(), weight_offset=1.0)
    assert plan(gpu.collection, hidden.cuda(), weight.cuda(), rope, device_arch(torch.device("cuda")),
                norm).path == "kernel"
    runs = []
    for _ in range(2):
        out = torch.full((t, 16 * 256), float("nan"), dtype=torch.bfloat16, device="cuda")
        cute_kv.fused_qkv_matmul_kv_cache(hidden.cuda(), gpu.input_row_offsets, weight.cuda(), gpu.collection, 1,
                                          output=out, rope=rope, qk_norm=norm)
        torch.cuda.synchronize()
        runs.append((out.cpu(), gpu.collection.blocks.view(torch.uint8).cpu().clone()))
    out, blocks = runs[0]
    assert not out.isnan().any() and rel_err(out, want) < 1e-2
    step = cpu.step_mask(1)
    assert torch.equal(blocks[~step], cpu.collection.blocks.view(torch.uint8)[~step])
    for kv in (0, 1):
        got = torch.cat([gpu.dense(kv, 1, b, cl + n)[cl:].cpu() for b, (cl, n) in enumerate(zip(cached, NEW))])
        rows = torch.cat([cpu.dense(kv, 1, b, cl + n)[cl:] for b, (cl, n) in enumerate(zip(cached, NEW))])
        assert not got.isnan().any() and rel_err(got, rows) < (2.0**-4 if fp8 else 1e-2)
    assert torch.equal(runs[1][1], blocks)  # the second launch: the same bits
