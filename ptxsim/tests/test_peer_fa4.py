"""FA4's SM90 forward (``flash_attn.cute.flash_fwd_sm90``, known good on H100s), compiled by its own interface and
captured from its real host code, runs in the simulator against float64 under several schedules: dense K/V
(non-causal and causal, ragged last key tile, GQA packed), causal with query rows that see no key (out 0, lse -inf),
and paged K/V with a shuffled page table (page 128 = tile N: TMA page loads; page 64: the cp.async path).

The kernel's choices are the interface's (tile 128 x 128, pack_gqa for 2 query heads on 1 KV head, intra-WG overlap,
RS PV wgmma, TMA store of O): see ``ptxsim.peers.fa4_sm90``. Outputs (O and lse) are NaN-poisoned before each run.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest

pytestmark = pytest.mark.sim

from ptxsim.peers import fa4_sm90  # noqa: E402  (sets CUTE_DSL_ARCH etc. if unset: before cutlass is imported)

pytest.importorskip("cutlass")
pytest.importorskip("flash_attn.cute")
import torch  # noqa: E402

import ptxsim  # noqa: E402

HQ, HKV, D = 2, 1, 128


@pytest.fixture(autouse=True)
def _target_sm90a():
    """FA4 asks the DSL for its target (``BaseDSL._get_dsl().get_arch_enum()``: ``CUTE_DSL_ARCH`` as read when the DSL
    singleton was built). In a test run cutlass is imported before this module sets the variable, so the DSL's copy
    is set for the test and restored after."""
    from cutlass.base_dsl.dsl import BaseDSL

    envar = BaseDSL._get_dsl().envar
    saved = envar._arch
    envar.arch = "sm_90a"
    yield
    envar._arch = saved


def _tensors(seqlen_q, seqlen_k, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seqlen_q, HQ, D, generator=g).bfloat16()
    if page_size is None:
        k = torch.randn(1, seqlen_k, HKV, D, generator=g).bfloat16()
        v = torch.randn(1, seqlen_k, HKV, D, generator=g).bfloat16()
        return q, k, v, None, None
    npages = -(-seqlen_k // page_size)
    # one spare page in the pool, never referenced: the table picks a shuffled subset
    k = torch.randn(npages + 1, page_size, HKV, D, generator=g).bfloat16()
    v = torch.randn(npages + 1, page_size, HKV, D, generator=g).bfloat16()
    page_table = torch.randperm(npages + 1, generator=g)[:npages].to(torch.int32)[None].contiguous()
    seqused_k = torch.tensor([seqlen_k], dtype=torch.int32)  # the last page is only partly used
    return q, k, v, page_table, seqused_k


@functools.lru_cache(maxsize=None)
def _case(name):
    """``(launch, out, lse, tensors, reads)`` of one case, captured once per process."""
    seqlen_q, seqlen_k, page_size, causal = CASES[name]
    q, k, v, page_table, seqused_k = _tensors(seqlen_q, seqlen_k, page_size, seed=len(name))
    launch, out, lse = _capture(q, k, v, page_table, seqused_k, causal)
    reads = {"q": q, "k": k, "v": v}
    if page_table is not None:
        reads.update(page_table=page_table, seqused_k=seqused_k)
    return launch, out, lse, (q, k, v, page_table, seqused_k, causal), reads


def _capture(q, k, v, page_table, seqused_k, causal):
    from ptxsim.capture import capturing, cuda_view

    with capturing("sm_90a") as launches:  # build() compiles: it must run inside the block
        fn, args = fa4_sm90.build(q, k, v, page_table=page_table, seqused_k=seqused_k, causal=causal,
                                  return_lse=True)
        fn(*[cuda_view(a) if isinstance(a, torch.Tensor) else a for a in args])
    (launch,) = launches
    assert launch.block == (384, 1, 1) and "wgmma.mma_async" in launch.ptx
    return launch, args[fa4_sm90.OUT], args[fa4_sm90.LSE]


def _check(out, lse, ref_out, ref_lse, ref_abs_pv):
    """O: P is rounded to bf16 before the PV wgmma and O is rounded to bf16 once, each round-to-nearest with unit
    roundoff u = 2^-8 (8 significand bits), so |err| <= u (|ref| + sum_j p_j |v_j|) (``ref_abs_pv``: the reference
    with |V|), plus 1e-4 for the f32 accumulation and ex2.approx (2^-22-ish relative). lse: f32 from
    ex2/lg2.approx: 1e-5 absolute. A row that sees no key: O exactly 0, lse -inf (as the reference)."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "outputs left unwritten"
    err = (out.double() - ref_out).abs()
    bound = (ref_out.abs() + ref_abs_pv) * 2.0 ** -8 + 1e-4
    assert (err <= bound).all(), f"O: max err {err.max().item():.3g}, worst err/bound {(err / bound).max().item():.3g}"
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[~finite] == -math.inf).all()
    lerr = (lse.double() - ref_lse)[finite].abs().max().item()
    assert lerr < 1e-5, f"lse: max err {lerr:.3g}"
    return (err / bound).max().item(), lerr


CASES = {
    # name: (seqlen_q, seqlen_k, page_size, causal)
    "dense": (160, 300, None, False),
    "causal": (160, 300, None, True),
    "causal_empty_rows": (192, 150, None, True),  # bottom-right aligned: query rows 0..41 see no key
    "paged_tma": (128, 300, 128, False),
    "paged_cp_async": (128, 300, 64, True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fa4_sm90_forward_matches_float64(name):
    launch, out, lse, (q, k, v, page_table, seqused_k, causal), reads = _case(name)
    ref_out, ref_lse = fa4_sm90.reference(q, k, v, page_table=page_table, seqused_k=seqused_k, causal=causal)
    ref_abs_pv, _ = fa4_sm90.reference(q, k, v.abs(), page_table=page_table, seqused_k=seqused_k, causal=causal)
    for seed in (0, 1):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        stats = ptxsim.simulate(launch, reads=reads, writes={"out": out, "lse": lse}, seed=seed)
        ratio, lerr = _check(out, lse, ref_out, ref_lse, ref_abs_pv)
        print(f"{name} seed {seed}: O err/bound {ratio:.3g}, lse err {lerr:.3g}, {stats}")


def test_fa4_weakened_wgmma_wait_is_a_hazard():
    """The softmax warpgroups wait for all but the newest wgmma group (``wgmma.wait_group 1``: the S = QK^T of this
    block is done, the PV of the previous may still run) before reading S. Allowing two groups in flight lets them read
    accumulator registers an in-flight wgmma still writes: PTX ISA 9.7.15 (wgmma.wait_group: accessing the accumulator
    registers of a wgmma.mma_async before a wait_group that covers its group is undefined behavior)."""
    launch, out, lse, _, reads = _case("dense")
    old = "wgmma.wait_group.sync.aligned \t1;"
    assert old in launch.ptx
    bad = dataclasses.replace(launch, ptx=launch.ptx.replace(old, "wgmma.wait_group.sync.aligned \t2;"))
    with pytest.raises(ptxsim.Hazard, match="in-flight wgmma"):
        ptxsim.simulate(bad, reads=reads, writes={"out": out, "lse": lse}, seed=0)
