"""quack 0.6.5's SM100 GEMM (``quack.gemm_sm100.GemmSm100``, known good on B200s) in its 1-CTA form — tile 128 x 128,
no cluster, ``tcgen05.mma.cta_group::1`` — and in its default 2-CTA form — tile 256 x 256 over a cluster of 2,
``tcgen05.mma.cta_group::2`` (the pair's one 256-row MMA, issued by the even CTA; pair alloc; commits multicast to
both CTAs' barriers) — with its clusterlaunchcontrol persistent scheduler, compiled through quack's own host entry and
captured (``ptxsim.peers.quack_sm100``), runs in the simulator against float64.

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


def _gemm(M, N, K, pair=False):
    """``(launch, A, B, D)``: the 1-CTA GEMM (tile 128, ``SMS`` SMs), or with ``pair`` the 2-CTA one (tile 256 x 256,
    cluster 2 x 1, ``2 * SMS`` SMs: two clusters at a time)."""
    if (M, N, K, pair) not in _GEMM:
        g = torch.Generator().manual_seed(M * 7 + N + K)
        A = torch.randn(M, K, generator=g).bfloat16()
        B = torch.randn(N, K, generator=g).bfloat16()
        old = Q.NUM_SMS
        Q.NUM_SMS = SMS * (2 if pair else 1)
        tile, cluster = (2 * TILE, 2) if pair else (TILE, 1)
        try:
            with capturing("sm_100a") as launches:  # build_gemm() compiles: inside the block
                fn, args = Q.build_gemm(A, B, tile_M=tile, tile_N=tile, cluster_M=cluster, cluster_N=1, clc=True)
                fn(*[cuda_view(a) if isinstance(a, torch.Tensor) else a for a in args])
        finally:
            Q.NUM_SMS = old
        (launch,) = launches
        _GEMM[(M, N, K, pair)] = (launch, A, B, args[Q.D_ARG])
    return _GEMM[(M, N, K, pair)]


def _run(launch, A, B, D, seed):
    """Simulate; returns the stats and the CTAs launched (by ctaid)."""
    gmem = GlobalMemory()
    gmem.add_tensor(D, "D", writable=True)
    gmem.add_tensor(A, "A", writable=False)
    gmem.add_tensor(B, "B", writable=False)
    spec = machine.LaunchSpec(launch.ptx, launch.kernel, tuple(launch.grid), tuple(launch.block),
                              tuple(launch.cluster), launch.dyn_smem, list(launch.params))
    sim = machine.Simulator(spec, gmem, seed, concurrent_ctas=SMS * launch.cluster[0])
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
    err = _check(A, B, D)
    print(f"quack sm100 1-CTA {M}x{N}x{K} seed {seed}: {len(launched)} CTAs for {tiles} tiles, max err "
          f"{err.max().item():.3g}, {st['instructions']} instr in {st['seconds']:.2f} s")


def _check(A, B, D):
    """The max error of ``D`` against float64, asserted within bf16's rounding of an fp32 accumulation."""
    assert not torch.isnan(D).any(), f"{int(torch.isnan(D).sum())} outputs never written"
    ref = Q.gemm_reference(A, B)
    err = (D.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + (A.double().abs() @ B.double().abs().T) * 2.0 ** -16
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    return err


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K", [(300, 328, 192), (520, 264, 136)])
def test_gemm_2cta_clc(M, N, K, seed):
    """Each cluster's pair computes 256 x 256 tiles; two clusters run at a time and steal the rest by CLC."""
    launch, A, B, D = _gemm(M, N, K, pair=True)
    clusters = -(-M // 256) * -(-N // 256)
    assert launch.cluster == (2, 1, 1) and launch.grid == (2 * clusters, 1, 1)
    assert "tcgen05.mma.cta_group::2.kind::f16" in launch.ptx and "cta_group::1" not in launch.ptx
    assert "multicast::cluster" in launch.ptx and "clusterlaunchcontrol.try_cancel" in launch.ptx
    D.fill_(float("nan"))
    st, launched = _run(launch, A, B, D, seed)
    assert len(set(launched)) == len(launched) < 2 * clusters  # CLC stole tiles
    err = _check(A, B, D)
    print(f"quack sm100 2-CTA {M}x{N}x{K} seed {seed}: {len(launched)} CTAs for {clusters} pair tiles, max err "
          f"{err.max().item():.3g}, {st['instructions']} instr in {st['seconds']:.2f} s")


def _idesc_lines(lines):
    """The lines holding the f16 instruction descriptors' constants (``selp.b32 %r, c1, c2, %p`` feeding the MMAs'
    idesc operand): M >> 4 at bits 24-28, N >> 3 at bits 17-22 (PTX ISA 9.7.16.4.2, instruction descriptor)."""
    mma = [t for t in lines if "tcgen05.mma.cta_group::2" in t]
    idesc = {re.split(r",\s*", t.split("]", 1)[1])[3].strip() for t in mma}
    assert len(idesc) == 1
    (reg,) = idesc
    (defn,) = [i for i, t in enumerate(lines) if re.match(rf"\s*or\.b32\s+{re.escape(reg)},", t)]
    src = re.findall(r"%r\d+", lines[defn])[1:]
    return [i for i, t in enumerate(lines) if re.match(r"\s*selp\.b32\s+(%r\d+),", t)
            and re.match(r"\s*selp\.b32\s+(%r\d+),", t).group(1) in src and int(t.split(",")[1]) > 1 << 24]


def _mutate_idesc(lines, delta):
    for i in _idesc_lines(lines):
        head, a, b, p = lines[i].split(",")
        lines[i] = f"{head}, {int(a) + delta}, {int(b) + delta},{p}"


def _mutate_tmem_column(lines):
    """The accumulator's TMEM address (the MMAs' ``[d]`` operand) moved 16 columns right."""
    (d,) = {t.split("[", 1)[1].split("]", 1)[0] for t in lines if "tcgen05.mma.cta_group::2" in t}
    (i,) = [i for i, t in enumerate(lines) if re.match(rf"\s*add\.s32\s+{re.escape(d)},", t)]
    lines[i] += f" add.s32 {d}, {d}, 16;"  # same line: line numbers kept


def _mutate_commit_peer(lines):
    """The accumulator-full commit (the one with a constant mask, after the k loop) multicast to the odd CTA only
    (``3`` -> ``2``): the even CTA's epilogue is never released."""
    commits = [i for i, t in enumerate(lines) if "tcgen05.commit.cta_group::2" in t]
    for i in commits:
        mask = lines[i].rsplit(",", 1)[1].strip(" ;")
        defs = [j for j in range(i - 3, i) if re.match(rf"\s*mov\.b16\s+{re.escape(mask)},\s*3;", lines[j])]
        if defs:
            lines[defs[0]] = lines[defs[0]].replace(", 3;", ", 2;")
            return
    raise AssertionError("no constant-mask commit found")


def _mutate_no_cluster_barrier(lines):
    """The cluster barrier after the mbarrier inits removed: the peer CTA may use a barrier before its init is
    visible to it."""
    i = next(i for i, t in enumerate(lines) if "barrier.cluster.arrive" in t)
    assert "barrier.cluster.wait" in lines[i + 1] and "fence.mbarrier_init" in lines[i - 1]
    lines[i] = lines[i + 1] = ""


MUTATIONS = {
    # M 256 -> 240: not an M of the instruction (a valid M = 128 pair MMA, datapath layout B, is not modelled)
    "idesc_M_240": lambda lines: _mutate_idesc(lines, -(1 << 24)),
    "idesc_N_128": lambda lines: _mutate_idesc(lines, -(16 << 17)),   # N 256 -> 128: a valid, narrower MMA
    "tmem_column_16": _mutate_tmem_column,
    "commit_to_odd_cta_only": _mutate_commit_peer,
    "no_cluster_barrier": _mutate_no_cluster_barrier,
}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_gemm_2cta_mutation_fails(name):
    """Each mutation of the 2-CTA GEMM's PTX is caught: a hazard, deadlock or fault from the simulator (not PTX it
    does not implement), or a wrong D."""
    launch, A, B, D = _gemm(300, 328, 192, pair=True)
    lines = launch.ptx.split("\n")
    MUTATIONS[name](lines)
    bad = dataclasses.replace(launch, ptx="\n".join(lines))
    assert bad.ptx != launch.ptx
    D.fill_(float("nan"))
    try:
        _run(bad, A, B, D, 0)
    except ptxsim.SimError as e:
        assert not isinstance(e, ptxsim.Unsupported), e
        print(f"{name}: {type(e).__name__}: {str(e)[:400]}")
        return
    with pytest.raises(AssertionError):
        _check(A, B, D)
    print(f"{name}: wrong D")


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
