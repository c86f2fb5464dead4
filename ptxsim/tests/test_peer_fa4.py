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


def test_fa4_missing_proxy_fence_is_a_hazard():
    """The epilogue writes O to shared memory with generic stores (``st.shared``/``stmatrix`` by the MMA warpgroups)
    and then a TMA store (``cp.async.bulk.tensor`` shared::cta -> global, an async-proxy read) copies it out. The PTX
    has exactly one ``fence.proxy.async.shared::cta``, between those writes and the TMA store; it is removed. Without
    it the generic writes are not made visible to the async proxy: PTX ISA 8.6 "Proxies" / 9.7.13.4 (membar/fence:
    ``fence.proxy.async`` orders generic-proxy accesses with async-proxy accesses to shared memory), so the TMA store
    may read stale bytes. The simulator's async-proxy read check (``SharedMemory.read(..., generic=False)``) flags it."""
    launch, out, lse, _, reads = _case("dense")
    fence = "\tfence.proxy.async.shared::cta;\n"
    assert launch.ptx.count(fence) == 1
    bad = dataclasses.replace(launch, ptx=launch.ptx.replace(fence, "\n"))  # a blank line: PTX line numbers kept
    with pytest.raises(ptxsim.Hazard, match="no fence.proxy.async") as e:
        ptxsim.simulate(bad, reads=reads, writes={"out": out, "lse": lse}, seed=0)
    print(e.value)


@pytest.mark.parametrize("name", ["paged_tma", "paged_cp_async"])
def test_fa4_page_past_the_cache(name):
    """The request's first page-table entry (page 0 of the keys, seen by every query row, causal included) is set to
    ``num_pages`` (``k.shape[0]``: one past the last page of the pool). The page table is read by the kernel at run
    time, so the captured launch runs as is over the modified table (restored afterwards).

    - page 128 (= tile N; TMA page loads): the page index is the outermost TMA coordinate, so the K and V boxes of that
      page lie wholly outside the tensor and are zero-filled (PTX ISA 9.7.9.25.5.1 cp.async.bulk.tensor / 5.5.6
      "Out of Bound Access": out-of-bound elements of the bounding box are filled, with zeros here): no fault, the
      kernel silently attends to 128 keys of score 0 with value 0, and O differs from the reference with the original
      table (lse too).
    - page 64 (``paged_kv_non_tma``: per-thread ``cp.async`` 16-B copies, PTX ISA 9.7.9.25.3 cp.async): each copy
      reads global memory at the address computed from the page index (no bounds, no fill), one page past the end of
      the K and V pools: a ``MemoryFault`` (``global read ... outside every tensor of the launch``, PTX line of the
      ``cp.async.cg.shared.global``). Which host bytes follow a pool is the allocator's choice: here V's allocation
      starts right where K's ends, so the K read lands in V (legal for the simulator, which knows only the named
      tensors) and the fault comes from the V read past V's end. Were V's end also followed by a named tensor, the run
      would complete with wrong values instead; the test accepts that outcome too (and then requires O to differ)."""
    launch, out, lse, (q, k, v, page_table, seqused_k, causal), reads = _case(name)
    ref_out, ref_lse = fa4_sm90.reference(q, k, v, page_table=page_table, seqused_k=seqused_k, causal=causal)
    saved = page_table.clone()
    page_table[0, 0] = k.shape[0]
    try:
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        try:
            ptxsim.simulate(launch, reads=reads, writes={"out": out, "lse": lse}, seed=0)
        except ptxsim.MemoryFault as e:
            assert name == "paged_cp_async", f"TMA boxes out of bounds are zero-filled, not a fault: {e}"
            assert "global read" in str(e) and "cp.async.cg.shared.global" in str(e), str(e)
            print(e)
        else:
            assert not torch.isnan(out).any()
            err = (out.double() - ref_out).abs().max().item()
            lerr = (lse.double() - ref_lse).abs().max().item()
            print(f"{name}: O max err {err:.3g}, lse max err {lerr:.3g}")
            assert err > 0.05 and lerr > 0.05  # far above _check's bounds (2^-8 relative, lse 1e-5)
    finally:
        page_table.copy_(saved)
