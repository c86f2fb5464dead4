"""MLA's cross-tile latent in ``FusedQKVGemm`` (``QKVSpec.cross_dims``): the latent RMSNorm over a 16-bit cache and
rope-aware FP8 rows, finished by the last tile to arrive.

A PyTorch replay of the launch plan (the tiles of the persistent schedule in any order, the workspace, the per-M-tile
counters, the kernel's chunk routing and reduction orders) shows that every order gives the same bits, every counter
ends at zero, each M tile is finished once by its last arriver, Q columns never reach the workspace; it matches the
reference. Host rules (``supported``, ``plan``, the workspace), PTX for sm_90a and sm_100a (the fence and the atomic,
no spills), and the kernel on a GPU against the reference (``gpu`` marker).
"""

import functools
import os
import re
import sys

import pytest
import torch

import artifacts

import cute_kv
from cute_kv import RopeConfig
from cute_kv import reference as ref
from cute_kv.ops.fused_qkv import latent_workspace, plan
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.qkv import kv_columns
from cute_kv.reference.ragged import positions

from numerics import bits, rel_err

pytest.importorskip("quack")
from cute_kv.kernels.qkv.gemm import BN, CTA_ROWS, FusedQKVGemm, QKVSpec, supported  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_fused_qkv_gemm import MMA, _bare_ptx, ptxas_report  # noqa: E402

VEC, LANES = 8, BN // 8
FLT_MIN = torch.finfo(torch.float32).tiny
MLA = dict(dtype_name="bfloat16", q_dim=1536, kv_dim=1, page_size=16, num_heads=1, head_dim=576, q_head_dim=192,
           has_bias=False, rope=(64, True))
PTX_CASES = {  # QKVSpec of the compiled configurations (DeepSeek-V3: 7168 -> 1536 + 576)
    "mla-latent-norm": QKVSpec(**MLA, k_norm_dim=512, cross_dims=512),
    "rope-aware-fp8": QKVSpec(**MLA, fp8=True, cross_dims=512, rope_tail=64),
    "rope-aware-fp8-norm": QKVSpec(**MLA, k_norm_dim=512, fp8=True, cross_dims=512, rope_tail=64),
    # the latent starts mid-tile (q_dim = 1632): 5 latent tiles, a tail straddling two; bias, Q heads of 32 normed
    "mla-latent-norm-straddles": QKVSpec(**{**MLA, "q_dim": 1632, "q_head_dim": 32, "has_bias": True,
                                            "rope": (32, True)}, q_norm_dim=32, k_norm_dim=512, cross_dims=512),
}


# -- the replay --------------------------------------------------------------------------------------------------


def _butterfly(x):
    """``head_sum`` over a row's 16 lanes (``x [..., 16]``): lane 0's value after the butterfly, in its order."""
    for offset in (1, 2, 4, 8):
        x = x + x[..., torch.arange(LANES) ^ offset]
    return x[..., 0]


class Replay:
    """The launch of a ``cross_dims`` spec on the float32 accumulator ``c [T, N_tot]`` (+ bias), modelled tile by
    tile as the epilogue runs it; ``cache`` holds the rows it writes (logical float32, or e4m3 content + scale +
    bf16 tail for rope-aware rows) keyed by token."""

    def __init__(self, spec, c, bias, gamma, pos, freqs):
        self.spec, self.c, self.gamma, self.pos, self.freqs = spec, c + (0 if bias is None else bias), gamma, pos, freqs
        t = c.shape[0]
        self.m_tiles = -(-t // CTA_ROWS)
        self.workspace = torch.full((self.m_tiles * CTA_ROWS, spec.workspace_cols), float("nan"))
        self.counters = torch.zeros(self.m_tiles, dtype=torch.int32)

    def tiles(self):
        return [(m, n) for m in range(self.m_tiles) for n in range(-(-self.spec.n_total // BN))]

    def run(self, order):
        """One launch over ``order``; the workspace and the counters carry over from the last."""
        self.finished_by = {}
        self.q_written = torch.zeros(self.c.shape[0], self.spec.q_dim, dtype=torch.int32)
        self.tail = {}  # (token, dim) -> bf16 value stored by the tile
        self.rows = {}  # token -> finished cross dims (bf16 values, or (e4m3 content, scale))
        for m_tile, n_tile in order:
            self.tile(m_tile, n_tile)
        return self

    def tile(self, m_tile, n_tile):
        s, t = self.spec, self.c.shape[0]
        m0, n0 = m_tile * CTA_ROWS, n_tile * BN
        staged = torch.zeros(CTA_ROWS, BN)  # rows past the step: TMA's zero fill
        rows = min(CTA_ROWS, t - m0)
        cols = min(BN, s.n_total - n0)
        staged[:rows, :cols] = self.c[m0:m0 + rows, n0:n0 + cols]
        vals = staged.unflatten(1, (LANES, VEC))  # [row, lane, 8]
        n = n0 + VEC * torch.arange(LANES)
        in_range, is_q = n < s.n_total, n < s.q_dim
        dim = n - s.q_dim
        cross = in_range & ~is_q & (dim < s.cross_dims)
        first, count = s.cross_tiles
        latent_tile = n_tile - first
        ws = self.workspace[m0:m0 + CTA_ROWS]
        if s.k_norm_dim:
            ss = torch.zeros(CTA_ROWS, LANES)
            for e in range(VEC):  # the kernel's order: element by element, then the row's butterfly
                ss = ss + torch.where(cross, vals[..., e] * vals[..., e], 0.0)
            partial = _butterfly(ss)
            if 0 <= latent_tile < count:
                ws[:, s.cross_dims + latent_tile] = partial
        for lane in range(LANES):
            if cross[lane]:
                ws[:, int(dim[lane]):int(dim[lane]) + VEC] = vals[:, lane]
            elif in_range[lane] and is_q[lane]:
                self.q_written[m0:m0 + rows, int(n[lane]):int(n[lane]) + VEC] += 1
            elif in_range[lane]:
                self._tail(vals[:rows, lane], m0, int(dim[lane]))
        if 0 <= latent_tile < count:
            arrived = int(self.counters[m_tile])
            self.counters[m_tile] += 1
            if arrived == count - 1:
                self.counters[m_tile] = 0
                assert m_tile not in self.finished_by
                self.finished_by[m_tile] = n_tile
                self.finish(m_tile)

    def _tail(self, v, m0, d):
        """A tail chunk (dims past ``cross_dims``) of every row: GPT-J RoPE where it rotates, bf16."""
        s = self.spec
        r, inter = s.rope
        rel = d - (s.head_dim - r)
        if rel >= 0:
            f = self.freqs[self.pos[m0:m0 + v.shape[0]].long(), rel:rel + VEC]
            x, y = v[:, 0::2], v[:, 1::2]
            v = torch.stack((x * f[:, 0::2] - y * f[:, 1::2], x * f[:, 1::2] + y * f[:, 0::2]), -1).flatten(1)
        for i in range(v.shape[0]):
            for e in range(VEC):
                self.tail[(m0 + i, d + e)] = v[i, e].to(torch.bfloat16)

    def finish(self, m_tile):
        s, t = self.spec, self.c.shape[0]
        m0 = m_tile * CTA_ROWS
        ws = self.workspace[m0:m0 + CTA_ROWS]
        x = ws[:, :s.cross_dims].clone()
        assert not x.isnan().any(), "the last arriver read a workspace value no tile wrote"
        if s.k_norm_dim:
            ss = torch.zeros(CTA_ROWS)
            for j in range(s.cross_tiles[1]):  # tile order, not arrival order
                ss = ss + ws[:, s.cross_dims + j]
            rstd = torch.rsqrt(ss * torch.tensor(1.0 / s.k_norm_dim, dtype=torch.float32) + s.norm_epsilon)
            x = x * rstd[:, None] * (self.gamma + s.norm_offset)
        for i in range(min(CTA_ROWS, t - m0)):
            if s.rope_tail:
                scale = torch.clamp(x[i].abs().max() / 448.0, min=FLT_MIN)
                self.rows[m0 + i] = ((x[i] / scale).to(torch.float8_e4m3fn), scale)
            else:
                self.rows[m0 + i] = x[i].to(torch.bfloat16)

    def bits(self):
        """Everything the launch stored, as comparable bits."""
        out = [torch.tensor([float(v) for _, v in sorted(self.tail.items())])]
        for m in sorted(self.rows):
            r = self.rows[m]
            out += [r[0].view(torch.uint8).float(), r[1].reshape(1)] if self.spec.rope_tail else [r.float()]
        return torch.cat(out)

    def latent(self, t):
        """The stored latent rows, decoded, ``[T, head_dim]`` float64."""
        s = self.spec
        out = torch.zeros(t, s.head_dim, dtype=torch.float64)
        for m, r in self.rows.items():
            out[m, :s.cross_dims] = (r[0].double() * r[1].double()) if s.rope_tail else r.double()
        for (m, d), v in self.tail.items():
            out[m, d] = float(v)
        return out


def random_step(spec, new, seed):
    """A random step of ``new`` tokens per request after random cache lengths: ``(generator, accumulator c, bias,
    positions, offsets, cache lengths)``; the generator draws what the caller adds."""
    g = torch.Generator().manual_seed(seed)
    cached = [int(x) for x in torch.randint(0, 300, (len(new),), generator=g)]
    offsets = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int64)
    c = torch.randn(int(offsets[-1]), spec.n_total, generator=g) * 3
    bias = torch.randn(spec.n_total, generator=g) if spec.has_bias else None
    return g, c, bias, positions(offsets, torch.tensor(cached)), offsets, cached


def _problem(spec, new, seed):
    """A random step: ``(accumulator c, bias, gamma, positions, freqs, offsets, cache lengths)``."""
    g, c, bias, pos, offsets, cached = random_step(spec, new, seed)
    gamma = torch.rand(spec.k_norm_dim or spec.cross_dims, generator=g) + 0.5
    freqs = RopeConfig.from_theta(spec.rope[0], 1024, interleaved=True).freqs_cis
    return c, bias, gamma, pos, freqs, offsets, cached


REPLAY_CASES = ["mla-latent-norm", "rope-aware-fp8", "rope-aware-fp8-norm", "mla-latent-norm-straddles"]
NEW = [0, 1, 131, 17, 1, 150]  # 300 tokens: three M tiles, one partial; requests of 0, 1 and odd lengths


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_any_arrival_order_gives_the_same_bits(case):
    spec = PTX_CASES[case]
    args = _problem(spec, NEW, seed=5)[:5]
    base = Replay(spec, *args)
    want = base.run(base.tiles()).bits()
    g = torch.Generator().manual_seed(6)
    for k in range(3):
        r = Replay(spec, *args)
        tiles = r.tiles()
        order = [tiles[i] for i in torch.randperm(len(tiles), generator=g)]
        got = r.run(order).bits()
        assert torch.equal(bits(got), bits(want))
        assert not r.counters.any()  # every counter back at zero for the next launch
        first, count = spec.cross_tiles
        assert set(r.finished_by) == set(range(r.m_tiles))  # each M tile finished once ...
        for m_tile, n_tile in r.finished_by.items():  # ... by the last of its latent tiles to arrive
            latent = [n for m, n in order if m == m_tile and first <= n < first + count]
            assert n_tile == latent[-1]
        # Q columns are the tile path's alone: each written once, none by the finish
        assert torch.equal(r.q_written, torch.ones_like(r.q_written))
    # a second launch on the same counters and workspace (no re-zeroing): the same bits
    assert torch.equal(bits(r.run(r.tiles()).bits()), bits(want))


@pytest.mark.parametrize("case", REPLAY_CASES)
def test_replay_matches_the_reference(case):
    """The replay's cache rows against ``reference.fused_qkv_matmul_kv_cache`` on a paged cache (shuffled pages)
    whose accumulator is the replay's."""
    spec = PTX_CASES[case]
    c, bias, gamma, pos, freqs, offsets, cached = _problem(spec, NEW, seed=7)
    t = c.shape[0]
    replay = Replay(spec, c, bias, gamma, pos, freqs).run(Replay(spec, c, bias, gamma, pos, freqs).tiles())
    rope_aware = bool(spec.rope_tail)
    pb = random_paged_batch(cached, NEW, num_heads=1, head_size=spec.row_bytes if rope_aware else spec.head_dim,
                            page_size=16, is_mla=True, generator=torch.Generator().manual_seed(8),
                            dtype=torch.float8_e4m3fn if rope_aware else torch.bfloat16,
                            **(dict(scale_dtype=torch.float32, rope_dim=spec.rope_tail) if rope_aware else {}))
    # hidden = I, weight = c^T: the reference's float32 accumulator is c exactly
    hidden, weight = torch.eye(t), c.T.contiguous()
    rope = RopeConfig(freqs, True, spec.q_head_dim)
    norm = cute_kv.QKNorm(k_weight=gamma) if spec.k_norm_dim else None
    q = ref.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=rope,
                                      qk_norm=norm, bias=bias)
    want = torch.cat([pb.dense(0, 0, b, cl + n)[cl:, 0] for b, (cl, n) in enumerate(zip(cached, NEW))])
    got = replay.latent(t)
    assert rel_err(got[:, spec.cross_dims:], want[:, spec.cross_dims:]) < 1e-2  # bf16 tail
    assert rel_err(got[:, :spec.cross_dims], want[:, :spec.cross_dims]) < (2.0**-4 if rope_aware else 1e-2)
    assert q.shape == (t, spec.q_dim)


def test_supported_cross_tile_latent():
    assert supported(PTX_CASES["mla-latent-norm"]) is None
    assert supported(PTX_CASES["rope-aware-fp8"]) is None
    assert supported(PTX_CASES["mla-latent-norm-straddles"]) is None
    assert "set cross_dims = 512" in supported(QKVSpec(**MLA, k_norm_dim=512))
    assert "must be the 512 dims" in supported(QKVSpec(**MLA, k_norm_dim=256, cross_dims=512))
    assert "GPT-J pairs within its last 64" in supported(QKVSpec(**{**MLA, "rope": (128, True)}, k_norm_dim=512,
                                                                 cross_dims=512))
    assert "neox" in supported(QKVSpec(**{**MLA, "rope": (64, False)}, k_norm_dim=512, cross_dims=512))
    assert "one K head" in supported(QKVSpec(**{**MLA, "kv_dim": 2}, k_norm_dim=512, cross_dims=512))
    assert "summing to the latent head" in supported(QKVSpec(**MLA, fp8=True, cross_dims=448, rope_tail=64))
    assert "one float32 scale" in supported(QKVSpec(**MLA, fp8=True, granularity=64, cross_dims=512, rope_tail=64))
    assert "multiple of 16" in supported(QKVSpec(**MLA, k_norm_dim=504, cross_dims=504))
    s = PTX_CASES["mla-latent-norm-straddles"]
    assert s.cross_tiles == (12, 5) and s.workspace_cols == 512 + 8 and s.max_head_lanes == 4
    assert PTX_CASES["rope-aware-fp8"].workspace_cols == 512 and PTX_CASES["rope-aware-fp8"].row_bytes == 640


def _mla_batch(rope_aware):
    kw = dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=64) if rope_aware else {}
    return random_paged_batch([3, 0], [2, 5], num_heads=1, head_size=640 if rope_aware else 576, page_size=16,
                              is_mla=True, generator=torch.Generator().manual_seed(0), **kw)


@pytest.mark.parametrize("rope_aware", [False, True])
def test_plan_serves_the_latent(rope_aware):
    c = _mla_batch(rope_aware).collection
    hidden = torch.zeros(7, 256, dtype=torch.bfloat16)
    weight = torch.zeros(1536 + kv_columns(c), 256, dtype=torch.bfloat16)
    rope = RopeConfig.from_theta(64, 64, interleaved=True, q_head_dim=192)
    norm = cute_kv.QKNorm(k_weight=torch.ones(512))
    for arch in ("sm_90a", "sm_100a"):
        spec = plan(c, hidden, weight, rope, arch, norm).key
        assert (spec.head_dim, spec.cross_dims, spec.k_norm_dim, spec.rope_tail) == (
            576, 512, 512, 64 if rope_aware else 0)
        assert spec.fp8 == rope_aware and spec.granularity == 0
    no_norm = plan(c, hidden, weight, rope, "sm_90a", None).key
    assert (no_norm.cross_dims, no_norm.rope_tail) == ((512, 64) if rope_aware else (0, 0))
    int4 = cute_kv.Int4Weight(torch.zeros(weight.shape[0], 128, dtype=torch.uint8),
                              torch.ones(weight.shape[0], 2, dtype=torch.bfloat16), 128)
    w4 = plan(c, hidden, int4, rope, "sm_90a", norm)  # the W4 mainloop with the same epilogue
    assert w4.kernel == "FusedQKVGemmW4" and w4.key.qkv.cross_dims == 512
    sm100 = plan(c, hidden, int4, rope, "sm_100a", norm)  # the same epilogue after the SM100 W4 mainloop
    assert sm100.kernel == "FusedQKVGemmW4Sm100" and sm100.key.qkv.cross_dims == 512
    neox = RopeConfig.from_theta(64, 64, q_head_dim=192)
    assert plan(c, hidden, weight, neox, "sm_90a", norm).path == "reference"


def test_latent_workspace_is_cached_and_grows():
    spec = PTX_CASES["mla-latent-norm-straddles"]
    dev = torch.device("cpu")
    ws, counters = latent_workspace(dev, spec, 300)
    assert ws.shape == (4 * CTA_ROWS, spec.workspace_cols) and ws.dtype == torch.float32
    assert counters.shape == (4,) and not counters.any()
    assert latent_workspace(dev, spec, 129)[0] is ws  # fits: reused
    bigger, _ = latent_workspace(dev, spec, 600)
    assert bigger.shape[0] == 8 * CTA_ROWS
    assert latent_workspace(dev, spec, 1)[0] is bigger


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
@pytest.mark.parametrize("t", [1, 100, 128, 129, 300, 384])
def test_latent_workspace_covers_the_grid(arch, t, monkeypatch):
    """Every CTA of the grid writes all rows of its M tile to the workspace and counts on its M tile's counter.
    quack's scheduler makes ``ceil(M tiles / cluster M)`` clusters and every CTA of one takes a tile, so a decode
    step of T <= 128 tokens runs M tiles 0 and 1 (cluster 2x1): the buffers must hold both, even on a first launch."""
    from cute_kv.kernels.qkv import scratch

    monkeypatch.setattr(scratch, "_HELD", {})
    spec = PTX_CASES["rope-aware-fp8-norm"]
    cluster_m = FusedQKVGemm(spec, arch).cluster_shape[0]
    grid_m_tiles = -(-(-(-t // CTA_ROWS)) // cluster_m) * cluster_m
    ws, counters = latent_workspace(torch.device("cpu"), spec, t)
    assert ws.shape[0] >= grid_m_tiles * CTA_ROWS and counters.numel() >= grid_m_tiles


# -- compiled ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _ptx(case, arch):
    return artifacts.compiled(FusedQKVGemm(PTX_CASES[case], arch), arch).ptx


@pytest.mark.compile
@pytest.mark.parametrize("case,arch", [("mla-latent-norm", "sm_90a"), ("rope-aware-fp8-norm", "sm_90a"),
                                       ("mla-latent-norm-straddles", "sm_90a"), ("mla-latent-norm", "sm_100a"),
                                       ("rope-aware-fp8-norm", "sm_100a")])
def test_latent_ptx(case, arch, tmp_path):
    spec, ptx = PTX_CASES[case], _ptx(case, arch)
    assert len(re.findall(MMA[arch], ptx)) == len(re.findall(MMA[arch], _bare_ptx(arch))) > 0  # mainloop unchanged
    # one arrival per tile (acq_rel at gpu scope), one reset by the last arriver; fences before the arrival
    # (release) and after the verdict (acquire)
    assert re.findall(r"atom\.\S+", ptx) == ["atom.global.acq_rel.add.u32", "atom.global.exch.b32"]
    assert ptx.count("fence.acq_rel.gpu") == 2
    stores = set(re.findall(r"st\.global\.\S+", ptx))
    assert {"st.global.v4.b32"} <= stores  # Q, workspace and 16-bit rows: 16 bytes
    if spec.rope_tail:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx
    # butterflies: the partial sum of squares over a row's 16 lanes (4 steps), the rope-aware amax (4, NaN-max),
    # Q-norm heads of 32 dims (2 steps)
    amax = 4 if spec.rope_tail else 0
    q_norm = spec.max_head_lanes.bit_length() - 1 if spec.tile_norm else 0
    assert ptx.count("shfl.sync.bfly") == (4 if spec.k_norm_dim else 0) + amax + q_norm
    assert ptx.count("max.NaN.f32") == amax
    report = ptxas_report(ptx, arch, tmp_path)
    assert re.findall(r"(\d+) bytes spill stores", report) == ["0"] and "0 bytes stack frame" in report


# -- on a GPU ----------------------------------------------------------------------------------------------------

GPU_CASES = {  # (q heads, Q head size, RoPE dims, bias, rope-aware, latent norm)
    "mla-norm-straddles": (51, 32, 32, True, False, True),  # q_dim 1632: the latent starts mid-tile
    "rope-aware-fp8": (8, 192, 64, False, True, False),
    "rope-aware-fp8-norm": (8, 192, 64, True, True, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_latent_kernel_matches_reference(case):
    """The kernel (three M tiles, ragged 0/1/odd requests, shuffled pages) against the reference on a CPU copy:
    Q within bf16 tolerance, the step's cache rows decoded within their format's, every other byte unchanged; a
    second launch (counters reset by the first) stores the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    qh, qd, r, with_bias, rope_aware, with_norm = GPU_CASES[case]
    g = torch.Generator().manual_seed(11)
    cached = [5, 0, 37, 130, 1, 64]
    kw = dict(dtype=torch.float8_e4m3fn, scale_dtype=torch.float32, rope_dim=64) if rope_aware else {}
    batches = [random_paged_batch(cached, NEW, num_heads=1, head_size=640 if rope_aware else 576, page_size=64,
                                  num_layers=2, is_mla=True, generator=torch.Generator().manual_seed(12), device=dev,
                                  **kw) for dev in ("cpu", "cuda")]
    for pb in batches:
        pb.collection.blocks.view(torch.uint8)[pb.step_mask(1)] = 0xFF  # NaN in e4m3 bytes and bf16 byte pairs
    t, k = sum(NEW), 512
    hidden = torch.randn(t, k, generator=g).to(torch.bfloat16)
    weight = (torch.randn(qh * qd + 576, k, generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(weight.shape[0], generator=g).to(torch.bfloat16) if with_bias else None
    freqs = RopeConfig.from_theta(r, 512, interleaved=True).freqs_cis
    gamma = torch.rand(512, generator=g) + 0.5 if with_norm else None
    cpu, gpu = batches
    want = ref.fused_qkv_matmul_kv_cache(hidden, cpu.input_row_offsets, weight, cpu.collection, 1, bias=bias,
                                         rope=RopeConfig(freqs, True, qd),
                                         qk_norm=cute_kv.QKNorm(k_weight=gamma) if with_norm else None)
    cuda = lambda x: None if x is None else x.cuda()  # noqa: E731
    rope = RopeConfig(freqs.cuda(), True, qd)
    norm = cute_kv.QKNorm(k_weight=gamma.cuda()) if with_norm else None
    assert plan(gpu.collection, cuda(hidden), cuda(weight), rope, _arch(), norm).path == "kernel"
    runs = []
    for _ in range(2):
        out = torch.full((t, qh * qd), float("nan"), dtype=torch.bfloat16, device="cuda")
        cute_kv.fused_qkv_matmul_kv_cache(cuda(hidden), gpu.input_row_offsets, cuda(weight), gpu.collection, 1,
                                          output=out, bias=cuda(bias), rope=rope, qk_norm=norm)
        torch.cuda.synchronize()
        runs.append((out.cpu(), gpu.collection.blocks.view(torch.uint8).cpu().clone(),
                     None if gpu.collection.scales is None else gpu.collection.scales.cpu().clone()))
    out, blocks, scales = runs[0]
    assert not out.isnan().any() and rel_err(out, want) < 1e-2
    step = cpu.step_mask(1)
    assert torch.equal(blocks[~step], cpu.collection.blocks.view(torch.uint8)[~step])
    got = torch.cat([gpu.dense(0, 1, b, cl + n)[cl:, 0].cpu() for b, (cl, n) in enumerate(zip(cached, NEW))])
    ref_rows = torch.cat([cpu.dense(0, 1, b, cl + n)[cl:, 0] for b, (cl, n) in enumerate(zip(cached, NEW))])
    assert not got.isnan().any()
    assert rel_err(got[:, 512:], ref_rows[:, 512:]) < 1e-2
    assert rel_err(got[:, :512], ref_rows[:, :512]) < (2.0**-4 if rope_aware else 1e-2)
    if scales is not None:
        assert torch.equal(bits(scales[~step]), bits(cpu.collection.scales[~step]))
    assert torch.equal(runs[1][1], blocks)  # the second launch: the same bits


def _arch():
    from cute_kv.ops.paths import device_arch

    return device_arch(torch.device("cuda"))
