"""FA4's SM100 forward (``flash_attn.cute.flash_fwd_sm100``, known good on B200s), compiled by its own interface and
captured from its real host code, runs in the simulator against float64 under two schedules, in the forms its
interface picks by shape (``ptxsim.peers.fa4_sm100``):

- one Q tile per CTA (``q_stage`` 1, ``tcgen05.mma.cta_group::1``): dense K/V non-causal and causal (ragged last key
  tile, GQA packed: 2 query heads on 1 KV head, so Sq query tokens are 2 Sq rows of the one 128-row tile) and paged
  K/V with a shuffled page table (page 128 = tile N: TMA page loads);
- two Q tiles per CTA (``q_stage`` 2: 256 rows, two softmax warpgroups), causal, 1-CTA MMAs;
- two Q tiles per CTA over a CTA pair (cluster 2 x 1, ``tcgen05.mma.cta_group::2``: the pair's 256-row MMAs, issued by
  the even CTA, commits multicast to both), dense and paged.

O and lse are NaN-poisoned before each run.

FA4's SM100 PTX has no ``tcgen05.wait::ld``: it reads tcgen05.ld destinations directly (ordered by the ISA, PTX ISA
9.7.16.6.4.5 "Register dependencies, same thread") and then overwrites the Tensor Memory those loads read (P stored
over S, O rescaled in place), which the ISA orders only through ``tcgen05.wait::ld`` (same section). The runs set
the simulator's explicit acceptance ``scoreboarded_tcgen05_ld=True`` (``ptxsim.machine.Simulator``); without it the
simulator reports the overwrite (``test_fa4_sm100_without_wait_ld_acceptance``).

FA4 issues the QK MMA into an S slot right after the PV MMA that reads that slot's P (A operand in Tensor Memory),
with no commit and wait between; the ISA orders two MMAs of a thread only as a pipelined pair, with the same
accumulator and shape (PTX ISA 9.7.16.6.2). The runs also set ``in_order_tcgen05_mma=True``; without it the simulator
reports the pair (``test_fa4_sm100_relies_on_mma_issue_order``).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

pytestmark = pytest.mark.sim

pytest.importorskip("cutlass")
pytest.importorskip("flash_attn.cute")
import numpy as np  # noqa: E402
import torch  # noqa: E402

import ptxsim  # noqa: E402
from ptxsim.peers import fa4_sm100  # noqa: E402

HQ, HKV, D = 2, 1, 128
ACCEPT = {"scoreboarded_tcgen05_ld": True, "in_order_tcgen05_mma": True}

CASES = {
    # name: (seqlen_q, seqlen_k, page_size, causal)
    "dense": (64, 257, None, False),      # 128 rows: one full Q tile; last key tile 1 key
    "causal": (48, 231, None, True),      # 96 rows: a partial Q tile; bottom-right aligned causal
    "paged_tma": (64, 300, 128, False),   # 3 pages (last one 44 keys used), shuffled, one spare page in the pool
    "causal_two_q_tiles": (160, 300, None, True),  # 320 rows: 2 CTAs of 256 (q_stage 2), the second partial
    "pair_dense": (300, 300, None, False),         # 600 rows: 2 CTA pairs of 2 x 256 rows, the last pair partial
    "pair_paged": (200, 400, 128, False),          # 400 rows: 1 pair; 4 shuffled pages, the last 16 keys used
}
# name -> (grid, cluster, MMA form): the geometry the interface's rules give (test_peer_sm100_capture)
GEOMETRY = {
    "dense": ((1, 1, 1), (1, 1, 1), "cta_group::1"),
    "causal": ((1, 1, 1), (1, 1, 1), "cta_group::1"),
    "paged_tma": ((1, 1, 1), (1, 1, 1), "cta_group::1"),
    "causal_two_q_tiles": ((2, 1, 1), (1, 1, 1), "cta_group::1"),
    "pair_dense": ((4, 1, 1), (2, 1, 1), "cta_group::2"),
    "pair_paged": ((2, 1, 1), (2, 1, 1), "cta_group::2"),
}


def _tensors(seqlen_q, seqlen_k, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seqlen_q, HQ, D, generator=g).bfloat16()
    if page_size is None:
        k = torch.randn(1, seqlen_k, HKV, D, generator=g).bfloat16()
        v = torch.randn(1, seqlen_k, HKV, D, generator=g).bfloat16()
        return q, k, v, None, None
    npages = -(-seqlen_k // page_size)
    k = torch.randn(npages + 1, page_size, HKV, D, generator=g).bfloat16()
    v = torch.randn(npages + 1, page_size, HKV, D, generator=g).bfloat16()
    page_table = torch.randperm(npages + 1, generator=g)[:npages].to(torch.int32)[None].contiguous()
    seqused_k = torch.tensor([seqlen_k], dtype=torch.int32)
    return q, k, v, page_table, seqused_k


@functools.lru_cache(maxsize=None)
def _case(name):
    """``(launch, out, lse, tensors, reads)`` of one case, captured once per process."""
    from ptxsim.capture import capturing, cuda_view

    seqlen_q, seqlen_k, page_size, causal = CASES[name]
    q, k, v, page_table, seqused_k = _tensors(seqlen_q, seqlen_k, page_size, seed=len(name))
    with capturing("sm_100a") as launches:  # build() compiles: inside the block
        fn, args = fa4_sm100.build(q, k, v, page_table=page_table, seqused_k=seqused_k, causal=causal,
                                   return_lse=True)
        fn(*[cuda_view(a) if isinstance(a, torch.Tensor) else a for a in args])
    (launch,) = launches
    grid, cluster, form = GEOMETRY[name]
    assert launch.grid == grid and launch.cluster == cluster and launch.block == (512, 1, 1)
    other = "cta_group::2" if form == "cta_group::1" else "cta_group::1"
    assert f"tcgen05.mma.{form}.kind::f16" in launch.ptx and f"tcgen05.mma.{other}" not in launch.ptx
    assert "tcgen05.wait::ld" not in launch.ptx  # the pattern the acceptance is for
    reads = {"q": q, "k": k, "v": v}
    if page_table is not None:
        reads.update(page_table=page_table, seqused_k=seqused_k)
    return launch, args[fa4_sm100.OUT], args[fa4_sm100.LSE], (q, k, v, page_table, seqused_k, causal), reads


@functools.lru_cache(maxsize=None)
def _ex2_poly_rel_err():
    """Largest relative error of FA4's degree-3 exp2 polynomial (``flash_attn.cute.utils.POLY_EX2[3]``, used for
    part of the softmax exponentials: ``ex2_emu_freq``) on [0, 1), evaluated here in float64."""
    from flash_attn.cute.utils import POLY_EX2

    x = np.linspace(0.0, 1.0, 100001)
    p = np.polynomial.polynomial.polyval(x, np.array(POLY_EX2[3], np.float64))
    return float(np.abs(p / np.exp2(x) - 1.0).max())


def _check(out, lse, ref_out, ref_lse, ref_abs_pv):
    """O: P is rounded to bf16 before the PV MMA and O is rounded to bf16 once (unit roundoff u = 2^-8 each), and
    some of P's exponentials come from FA4's exp2 polynomial (relative error e, ``_ex2_poly_rel_err``, about 1e-4),
    so |err| <= (u + 2 e)(|ref| + sum_j p_j |v_j|) (``ref_abs_pv``: the reference with |V|) + 1e-4 (f32 sums,
    ex2.approx). lse: log of a sum of such exponentials: e + 1e-5 absolute."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "outputs left unwritten"
    e = _ex2_poly_rel_err()
    err = (out.double() - ref_out).abs()
    bound = (ref_out.abs() + ref_abs_pv) * (2.0 ** -8 + 2 * e) + 1e-4
    assert (err <= bound).all(), f"O: max err {err.max().item():.3g}, worst err/bound {(err / bound).max().item():.3g}"
    assert torch.isfinite(ref_lse).all()
    lerr = (lse.double() - ref_lse).abs().max().item()
    assert lerr < e + 1e-5, f"lse: max err {lerr:.3g}"
    return err.max().item(), (err / bound).max().item(), lerr


@pytest.mark.parametrize("name", list(CASES))
def test_fa4_sm100_forward_matches_float64(name):
    launch, out, lse, (q, k, v, page_table, seqused_k, causal), reads = _case(name)
    ref_out, ref_lse = fa4_sm100.reference(q, k, v, page_table=page_table, seqused_k=seqused_k, causal=causal)
    ref_abs_pv, _ = fa4_sm100.reference(q, k, v.abs(), page_table=page_table, seqused_k=seqused_k, causal=causal)
    for seed in (0, 1):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        stats = ptxsim.simulate(launch, reads=reads, writes={"out": out, "lse": lse}, seed=seed, **ACCEPT)
        err, ratio, lerr = _check(out, lse, ref_out, ref_lse, ref_abs_pv)
        print(f"{name} seed {seed}: O max err {err:.3g} (err/bound {ratio:.3g}), lse err {lerr:.3g}, {stats}")


def test_fa4_sm100_without_wait_ld_acceptance():
    """Without ``scoreboarded_tcgen05_ld`` the softmax's tcgen05.st of P over the S cells its tcgen05.ld read (no
    tcgen05.wait::ld between) is reported: PTX ISA 9.7.16.6.4.5 "a register dependency does not imply that a
    dependee instruction's memory accesses will be performed before a dependent instruction's memory accesses. To
    enforce such memory orderings and avoiding anti-dependency hazards around tcgen05.ld, tcgen05.wait::ld must be
    used." The reads of the loaded registers before it are not (same section: true register dependencies are
    respected), so the report is about Tensor Memory, not registers."""
    launch, out, lse, _, reads = _case("dense")
    with pytest.raises(ptxsim.Hazard, match=r"tcgen05\.st to TMEM .* tcgen05\.ld not yet retired by "
                                            r"tcgen05\.wait::ld") as e:
        ptxsim.simulate(launch, reads=reads, writes={"out": out, "lse": lse}, seed=0)
    assert not str(e.value).startswith("register")
    print(e.value)


def test_fa4_sm100_missing_wait_st_is_a_hazard():
    """The softmax warps store P to Tensor Memory (tcgen05.st), execute ``tcgen05.wait::st`` and then arrive on the
    mbarrier the MMA warp waits on before its PV MMA reads P from Tensor Memory (A operand). The wait::st right after
    the last P store of the first softmax step is removed: the arrival no longer follows the stores' completion and
    the MMA reads cells a tcgen05.st may still write (PTX ISA 9.7.16.6.4.4 "Non-pipelined instructions, different
    thread": the producer must wait for its tcgen05 instructions' completion before synchronizing)."""
    launch, out, lse, _, reads = _case("dense")
    lines = launch.ptx.split("\n")
    stores = [i for i, t in enumerate(lines) if "tcgen05.st.sync.aligned" in t]
    waits = [i for i, t in enumerate(lines) if "tcgen05.wait::st.sync.aligned" in t]
    # the second wait::st of the PTX: after the softmax's last P chunk, before its arrive (the first comes after
    # the first three chunks)
    target = waits[1]
    assert target - 1 in stores and "mbarrier.arrive" in "\n".join(lines[target + 1:target + 8])
    lines[target] = ""  # a blank line: PTX line numbers kept
    bad = dataclasses.replace(launch, ptx="\n".join(lines))
    with pytest.raises(ptxsim.Hazard, match=r"tcgen05\.mma A \(Tensor Memory\).*tcgen05\.wait::st") as e:
        ptxsim.simulate(bad, reads=reads, writes={"out": out, "lse": lse}, seed=0, **ACCEPT)
    print(e.value)



@pytest.mark.parametrize("name,seed", [("dense", 1), ("pair_dense", 0)])
def test_fa4_sm100_relies_on_mma_issue_order(name, seed):
    """Without ``in_order_tcgen05_mma`` the QK MMA into a slot whose P an earlier PV MMA still reads is reported, with
    one Q tile (seed 1: the PV lands late) and with two over a CTA pair."""
    launch, out, lse, _, reads = _case(name)
    with pytest.raises(ptxsim.Hazard, match=r"tcgen05\.mma D at TMEM columns .* reads them \(its A operand\)") as e:
        ptxsim.simulate(launch, reads=reads, writes={"out": out, "lse": lse}, seed=seed, scoreboarded_tcgen05_ld=True)
    print(e.value)
