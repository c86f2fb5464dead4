"""quack 0.6.5's SM100 GEMM (``quack.gemm_sm100.GemmSm100``, known good on B200s) in its 1-CTA form — tile 128 x 128,
no cluster, ``tcgen05.mma.cta_group::1`` — with its clusterlaunchcontrol persistent scheduler, compiled through
quack's own host entry and captured (``ptxsim.peers.quack_sm100``), runs in the simulator against float64.

CLC persistence launches one CTA per output tile; the simulator runs 2 CTAs at a time (``concurrent_ctas=2``, and
quack is told 2 SMs), so the two running CTAs cancel the unlaunched ones (``clusterlaunchcontrol.try_cancel``) and
each walks several tiles through the TMA ring, the 2-stage accumulator in Tensor Memory and the epilogue. Seed 0's
requests always succeed (one wave of 2 CTAs does every tile, checked); seed 1's fail at random (the fallback: some
tiles run in CTAs of their own). M and N have ragged tails (TMA out-of-bounds fill, clipped stores). D is
NaN-poisoned before each run; ``|D - ref| <= 2^-8 |ref| + 2^-16 sum_k |a_k b_k|`` (bf16 of an fp32 accumulation).

quack commits each k-block's MMAs to the smem stage's empty barrier and then the whole accumulator to the
accumulator-full barrier the epilogue waits on; the results are released by the second commit too (PTX ISA
9.7.16.12.1: a commit tracks all prior tcgen05 operations of the thread). The mutation test removes that wait.
"""

import dataclasses
import importlib.util
import re

import pytest

pytestmark = pytest.mark.sim

if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("quack") is None:
    pytest.skip("cutlass (CuTe DSL) and quack needed", allow_module_level=True)
import torch  # noqa: E402

import ptxsim  # noqa: E402
from ptxsim import machine  # noqa: E402
from ptxsim.capture import capturing, cuda_view  # noqa: E402
from ptxsim.memory import GlobalMemory  # noqa: E402
from ptxsim.peers import quack_sm100 as Q  # noqa: E402

SMS = 2
TILE = 128
_GEMM = {}


def _gemm(M, N, K):
    if (M, N, K) not in _GEMM:
        g = torch.Generator().manual_seed(M * 7 + N + K)
        A = torch.randn(M, K, generator=g).bfloat16()
        B = torch.randn(N, K, generator=g).bfloat16()
        old = Q.NUM_SMS
        Q.NUM_SMS = SMS
        try:
            with capturing("sm_100a") as launches:  # build_gemm() compiles: inside the block
                fn, args = Q.build_gemm(A, B, tile_M=TILE, tile_N=TILE, cluster_M=1, cluster_N=1, clc=True)
                fn(*[cuda_view(a) if isinstance(a, torch.Tensor) else a for a in args])
        finally:
            Q.NUM_SMS = old
        (launch,) = launches
        _GEMM[(M, N, K)] = (launch, A, B, args[Q.D_ARG])
    return _GEMM[(M, N, K)]


def _run(launch, A, B, D, seed):
    """Simulate; returns the stats and the CTAs launched (by ctaid)."""
    gmem = GlobalMemory()
    gmem.add_tensor(D, "D", writable=True)
    gmem.add_tensor(A, "A", writable=False)
    gmem.add_tensor(B, "B", writable=False)
    spec = machine.LaunchSpec(launch.ptx, launch.kernel, tuple(launch.grid), tuple(launch.block),
                              tuple(launch.cluster), launch.dyn_smem, list(launch.params))
    sim = machine.Simulator(spec, gmem, seed, concurrent_ctas=SMS)
    launched = []
    run_wave = sim._run_wave

    def wave(ctas):
        launched.extend(c.ctaid for c in ctas)
        return run_wave(ctas)
    sim._run_wave = wave
    return sim.run(), launched


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K", [(300, 328, 192), (376, 264, 136)])
def test_gemm_1cta_clc(M, N, K, seed):
    launch, A, B, D = _gemm(M, N, K)
    tiles = -(-M // TILE) * -(-N // TILE)
    assert launch.cluster == (1, 1, 1) and launch.block == (256, 1, 1) and launch.grid == (tiles, 1, 1)
    assert "tcgen05.mma.cta_group::1.kind::f16" in launch.ptx and "cta_group::2" not in launch.ptx
    assert "clusterlaunchcontrol.try_cancel" in launch.ptx
    D.fill_(float("nan"))
    st, launched = _run(launch, A, B, D, seed)
    assert len(set(launched)) == len(launched) < tiles  # CLC stole tiles: the running CTAs walked several
    if seed == 0:
        assert sorted(launched) == [(0, 0, 0), (1, 0, 0)]
    assert not torch.isnan(D).any(), f"{int(torch.isnan(D).sum())} outputs never written"
    ref = Q.gemm_reference(A, B)
    err = (D.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + (A.double().abs() @ B.double().abs().T) * 2.0 ** -16
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    print(f"quack sm100 1-CTA {M}x{N}x{K} seed {seed}: {len(launched)} CTAs for {tiles} tiles, max err "
          f"{err.max().item():.3g}, {st['instructions']} instr in {st['seconds']:.2f} s")


def test_epilogue_without_accumulator_wait_is_a_hazard():
    """The epilogue's wait on the accumulator-full barrier (the spin loop right before its first tcgen05.ld) is
    made to succeed at once: it reads Tensor Memory whose MMA results no commit it observed released
    (PTX ISA 9.7.16.6.4.2: mma -> commit -> mbarrier wait -> tcgen05.fence::after_thread_sync -> ld)."""
    launch, A, B, D = _gemm(300, 328, 192)
    lines = launch.ptx.split("\n")
    first_ld = next(i for i, t in enumerate(lines) if "tcgen05.ld.sync" in t)
    wait = max(i for i in range(first_ld) if "mbarrier.try_wait" in lines[i])
    m = re.search(r"mbarrier\.try_wait\.parity\.shared\.b64\s+(\w+),", lines[wait])
    assert m and first_ld - wait < 12
    lines[wait] = f"\tmov.pred {m.group(1)}, -1;"  # line numbers kept
    bad = dataclasses.replace(launch, ptx="\n".join(lines))
    with pytest.raises(ptxsim.Hazard, match=r"tcgen05\.ld of TMEM lane \d+ column \d+") as e:
        _run(bad, A, B, D, 0)
    print(e.value)
