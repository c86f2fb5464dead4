"""A wgmma GEMM captured from the DSL's real host code and executed by the simulator against float64, under several
schedules; and mutations of its PTX or of its launch that must fail, with the hazard that explains them or with
wrong values."""

from __future__ import annotations

import dataclasses

import pytest

pytestmark = pytest.mark.sim

pytest.importorskip("cutlass")
import torch  # noqa: E402

import ptxsim  # noqa: E402
from ptxsim import Deadlock, Hazard, MemoryFault  # noqa: E402


def _capture(m: int, n: int, k: int):
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from ptxsim.capture import capturing, cuda_view
    from ptxsim.tests import wgmma_gemm

    g = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, generator=g).bfloat16()
    b = torch.randn(n, k, generator=g).bfloat16()
    c = torch.full((m, n), float("nan"))
    fa, fb, fc, _ = wgmma_gemm.fake_args()
    with capturing("sm_90a") as launches:
        fn = cute.compile(wgmma_gemm.gemm, fa, fb, fc, make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--gpu-arch sm_90a --enable-tvm-ffi")
        fn(cuda_view(a), cuda_view(b), cuda_view(c))
    (launch,) = launches
    return launch, a, b, c


@pytest.fixture(scope="module")
def small():
    return _capture(128, 128, 128)


@pytest.fixture(scope="module")
def deep():
    """8 k-tiles through the 3-stage ring: the producer waits for released stages."""
    return _capture(128, 128, 512)


def _run(launch, a, b, c, seed=0, **kw):
    c.fill_(float("nan"))
    stats = ptxsim.simulate(launch, reads={"a": a, "b": b}, writes={"c": c}, seed=seed, **kw)
    return stats, (c.double() - a.double() @ b.double().T).abs().max().item()


@pytest.mark.parametrize("shape", [(128, 128, 128), (256, 384, 512)])
def test_gemm_matches_float64(shape):
    launch, a, b, c = _capture(*shape)
    for seed in range(3):
        stats, err = _run(launch, a, b, c, seed)
        assert not torch.isnan(c).any()
        assert err < 1e-4 * shape[2] ** 0.5, (seed, err)
        assert stats["instructions"] > 0


def _mutate_ptx(launch, old: str, new: str, count: int = 1):
    assert launch.ptx.count(old) >= count, old
    return dataclasses.replace(launch, ptx=launch.ptx.replace(old, new, count))


def _mutate_param(launch, index: int, fn):
    params = list(launch.params)
    params[index] = fn(bytearray(params[index]))
    return dataclasses.replace(launch, params=params)


def _tma_param_indices(launch):
    return [i for i, p in enumerate(launch.params) if len(p) == 128]


def test_wgmma_descriptor_swizzle_changed(small):
    launch, a, b, c = small
    # the B operand's descriptor constant: 128B swizzle (layout type 1 << 62) read as 64B (2 << 62)
    bad = _mutate_ptx(launch, "4611686293305360384", str(0x8000004000010000), 1)
    with pytest.raises(Exception) as e:
        _, err = _run(bad, a, b, c)
        assert err < 1e-2  # wrong values would land here
    assert isinstance(e.value, (AssertionError, ptxsim.SimError))


def test_tma_descriptor_swizzle_changed(small):
    launch, a, b, c = small
    i = _tma_param_indices(launch)[0]

    def to_64b(p):
        w1 = int.from_bytes(p[8:16], "little")
        w1 = (w1 & ~(3 << 13)) | (2 << 13)
        p[8:16] = w1.to_bytes(8, "little")
        return bytes(p)
    with pytest.raises(MemoryFault, match="swizzle span"):
        _run(_mutate_param(launch, i, to_64b), a, b, c)


def test_mbarrier_init_count_high_deadlocks(deep):
    launch, a, b, c = deep
    bad = _mutate_ptx(launch, "mov.b32 \t%r18, 4;", "mov.b32 \t%r18, 5;")
    with pytest.raises(Deadlock, match="pending arrivals 1 of 5"):
        _run(bad, a, b, c)


def test_full_barrier_init_count_high_deadlocks(deep):
    """The full barriers (one producer arrival + the TMA bytes) initialized for two arrivals never complete. (An
    init count one too low on the consumer-release barriers is not observable in this kernel: each consumer waits
    for its MMAs before it releases, and the ISA lets the extra arrival count toward the next phase.)"""
    launch, a, b, c = deep
    bad = _mutate_ptx(launch, "mov.b32 \t%r16, 1;", "mov.b32 \t%r16, 2;")
    with pytest.raises(Deadlock, match="pending arrivals 1 of 2"):
        _run(bad, a, b, c)


def test_dropped_wait_group(deep):
    launch, a, b, c = deep
    bad = _mutate_ptx(launch, "wgmma.wait_group.sync.aligned \t0;", "")
    with pytest.raises(Hazard, match="in-flight"):
        for seed in range(3):
            _run(bad, a, b, c, seed)


def test_tma_box_shifted_by_a_row(small):
    launch, a, b, c = small
    i = _tma_param_indices(launch)[0]

    def shift(p):
        w0 = int.from_bytes(p[0:8], "little")
        p[0:8] = (w0 + ((a.stride(0) * a.element_size()) >> 4 << 4)).to_bytes(8, "little")
        return bytes(p)
    with pytest.raises((AssertionError, MemoryFault)):
        _, err = _run(_mutate_param(launch, i, shift), a, b, c)
        assert err < 1e-2


def test_elect_leader_is_any_lane(small):
    """elect.sync's leader is the seed's choice; the GEMM is right whichever lane leads."""
    launch, a, b, c = small
    for seed in (3, 4):
        _, err = _run(launch, a, b, c, seed)
        assert err < 1e-3


def test_consumer_skips_its_full_barrier_wait(deep):
    """The consumers' wait on the full barrier made a no-op: their wgmmas read stages whose TMA has not landed, or
    has landed without the consumers observing the phase that completes it. Under every schedule a hazard, whether
    the copy is still in flight (late landings) or already there (prompt ones: the memory model's check)."""
    import re

    launch, a, b, c = deep
    waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait\.parity\.shared\.b64 P1, \[(%r\d+)\], (%r\d+), \d+;",
                                            launch.ptx)]
    assert len(waits) >= 2
    start = waits[1]  # the first is the producer's wait for an empty stage, the second the consumers'
    end = launch.ptx.index(";", start) + 1
    bad = dataclasses.replace(launch, ptx=launch.ptx[:start] + "setp.eq.u32 P1, 0, 0;" + launch.ptx[end:])
    for seed in (0, 1, 2):
        with pytest.raises(Hazard, match="not observed its completion|has not completed"):
            _run(bad, a, b, c, seed)


def test_only_one_warp_waits_for_the_wgmmas(deep):
    """Warp 0 alone runs wgmma.wait_group; warps 1-3 read their accumulators relying on it. Each warp's own wait
    retires its registers (PTX ISA 9.7.15.7.3), so the other warps' reads are hazards even after the MMA landed."""
    launch, a, b, c = deep
    wait = "wgmma.wait_group.sync.aligned \t0;"
    assert "shfl.sync.idx.b32 \t%r3, %r14, 0, 31, -1;" in launch.ptx  # %r3: the warp index, warp-uniform
    bad = _mutate_ptx(launch, wait, "{ .reg .pred q; setp.eq.u32 q, %r3, 0; @q " + wait + " }")
    for seed in (0, 2):
        with pytest.raises(Hazard, match="in-flight wgmma"):
            _run(bad, a, b, c, seed)
