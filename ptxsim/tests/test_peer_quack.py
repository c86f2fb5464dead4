"""quack 0.6.5's SM90 GEMMs (known good on H100s) run in the simulator against float64: the persistent ping-pong
GEMM (cluster 2 x 1: multicast TMA, cluster barriers, the tile scheduler's st.async broadcast to both CTAs), the
cooperative GEMM, and the W4A16 mainloop (int4 weights with group scales, decoded in registers) that cute-kv's
FusedQKVGemmW4 inherits.

Each kernel is compiled through quack's own host entry inside ``capturing("sm_90a")`` and its real launch captured
(``peers.quack_sm90``); the persistent grid is kept small by answering 2 SMs to quack's ``max_active_clusters`` query,
so each CTA walks several tiles, ragged M/N tails included. Outputs are NaN-poisoned before each run.

Tolerances: D is bf16 of an fp32 accumulation, so ``|D - ref| <= 2^-8 |ref| + 2^-16 sum_k |a_k b_k|`` (half a bf16
ulp plus fp32 accumulation); quack's W4 decode multiplies in bf16 (``bf16((code - 8) * scale)``), so its sharp
reference takes those bf16 weights, and the exact-weight float64 reference holds within the extra 2^-8 sum|a||w|.
"""

import dataclasses
import importlib.util

import pytest

pytestmark = pytest.mark.sim

if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("quack") is None:
    pytest.skip("cutlass (CuTe DSL) and quack needed", allow_module_level=True)
from ptxsim.peers import quack_sm90 as Q  # noqa: E402  (sets quack's env: import before cutlass)
import torch  # noqa: E402

import ptxsim  # noqa: E402
from ptxsim.capture import capturing, cuda_view  # noqa: E402

SMS = 2  # what quack's HardwareInfo answers: max_active_clusters = 2 // cluster size


@pytest.fixture(scope="module", autouse=True)
def _dsl_arch():
    """quack compiles for the DSL's arch (``CUTE_DSL_ARCH``, read when cutlass is first imported: another test
    module may have imported it before ``peers.quack_sm90`` set it): sm_90a for this module."""
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    envar.arch = "sm_90a"
    yield
    del envar.arch  # back to the construction-time state


def _cv(x):
    if isinstance(x, torch.Tensor):
        return cuda_view(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*[_cv(y) for y in x])
    if isinstance(x, tuple):
        return tuple(_cv(y) for y in x)
    return x


def _tensors(x, name, out):
    """Every tensor inside ``x`` (NamedTuples included), by dotted name."""
    if isinstance(x, torch.Tensor):
        out[name] = x
    elif isinstance(x, tuple):
        for n, y in zip(getattr(x, "_fields", None) or range(len(x)), x):
            _tensors(y, f"{name}.{n}", out)
    return out


def _capture(build):
    old = Q.NUM_SMS
    Q.NUM_SMS = SMS
    try:
        with capturing("sm_90a") as launches:
            fn, args = build()
            fn(*[_cv(a) for a in args])
    finally:
        Q.NUM_SMS = old
    (launch,) = launches
    return launch, args


def _check(out, ref, mag):
    assert not torch.isnan(out).any(), f"{int(torch.isnan(out).sum())} outputs never written"
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + mag * 2.0 ** -16
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"
    return err.max().item()


_GEMM = {}


def _gemm(M, N, K, pingpong):
    key = (M, N, K, pingpong)
    if key not in _GEMM:
        g = torch.Generator().manual_seed(M * 7 + N + K)
        A = torch.randn(M, K, generator=g).bfloat16()
        B = torch.randn(N, K, generator=g).bfloat16()
        launch, args = _capture(lambda: Q.build_gemm(A, B, pingpong=pingpong))
        _GEMM[key] = (launch, A, B, args[Q.D_ARG])
    return _GEMM[key]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K,pingpong", [(192, 192, 128, True), (320, 320, 256, True), (320, 384, 128, False)])
def test_gemm(M, N, K, pingpong, seed):
    launch, A, B, D = _gemm(M, N, K, pingpong)
    assert launch.cluster == (2, 1, 1) and launch.block == (384, 1, 1) and launch.grid == (2, 1, 1)
    D.fill_(float("nan"))
    st = ptxsim.simulate(launch, reads={"A": A, "B": B}, writes={"D": D}, seed=seed)
    err = _check(D, Q.gemm_reference(A, B), A.double().abs() @ B.double().abs().T)
    print(f"quack gemm {'pingpong' if pingpong else 'coop'} {M}x{N}x{K} seed {seed}: max err {err:.3g}, "
          f"{st['instructions']} instr in {st['seconds']:.2f} s ({st['instructions_per_second']:.0f}/s)")


_W4 = {}


def _w4(M, N, K, wformat):
    key = (M, N, K, wformat)
    if key not in _W4:
        g = torch.Generator().manual_seed(M + N * 3 + K)
        act = torch.randn(M, K, generator=g).bfloat16()
        group = int(wformat.split("_g")[1]) if "_g" in wformat else 128
        q, sf = Q.quantize_int4(torch.randn(N, K, generator=g), group=group)
        launch, args = _capture(lambda: Q.build_w4a16(act, q, sf, wformat=wformat))
        _W4[key] = (launch, act, q, sf, args)
    return _W4[key]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("M,N,K,wformat", [(192, 256, 256, "int4"), (200, 384, 256, "int4_g64")])
def test_w4a16(M, N, K, wformat, seed):
    from quack.operand_transform.formats import decode_format

    launch, act, q, sf, args = _w4(M, N, K, wformat)
    out = Q.w4_output(args)
    reads = _tensors(args[0], "W", {"act": act})
    assert set(reads) == {"act", "W.blob", "W.sf"}
    out.fill_(float("nan"))
    st = ptxsim.simulate(launch, reads=reads, writes={"out": out}, seed=seed)
    w = decode_format(wformat).dequant_reference(q, sf).double()
    mag = act.double().abs() @ w.abs().T
    err = _check(out, act.double() @ w.bfloat16().double().T, mag)  # the kernel's bf16 weights, float64 sums
    exact = Q.w4a16_reference(act, q, sf, wformat=wformat)
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + mag * 2.0 ** -8).all()
    print(f"quack w4a16 {wformat} {M}x{N}x{K} seed {seed}: max err {err:.3g}, {st['instructions']} instr in "
          f"{st['seconds']:.2f} s ({st['instructions_per_second']:.0f}/s)")


def test_gemm_missing_proxy_fence_is_a_hazard():
    """quack's epilogue writes each D subtile to shared memory with generic stores (``stmatrix``/``st.shared`` from
    the accumulator registers), then one thread issues a TMA store (``cp.async.bulk.tensor`` shared::cta -> global,
    an async-proxy read) of it. Its PTX has 16 ``fence.proxy.async.shared::cta``: 12 in the epilogue (one per unrolled
    subtile, after the ``stmatrix`` writes and before the named barrier and the TMA store) and 4 in the tile
    scheduler (after its ``ld.shared`` of the tile info, before the slot is released for the next ``st.async``);
    every one is removed (the epilogue's are the ones this test needs). Without them the generic writes are not made
    visible to the async proxy (PTX ISA 8.6 "Proxies" / 9.7.13.4: ``fence.proxy.async`` orders generic-proxy
    accesses with async-proxy accesses), so the TMA store may read stale bytes: the simulator's async-proxy read check
    (``SharedMemory.read(..., generic=False)``) flags the first TMA store."""
    launch, A, B, D = _gemm(192, 192, 128, True)
    fence = "\tfence.proxy.async.shared::cta;\n"
    assert launch.ptx.count(fence) == 16
    bad = dataclasses.replace(launch, ptx=launch.ptx.replace(fence, "\n"))  # blank lines: PTX line numbers kept
    D.fill_(float("nan"))
    with pytest.raises(ptxsim.Hazard, match="no fence.proxy.async") as e:
        ptxsim.simulate(bad, reads={"A": A, "B": B}, writes={"D": D}, seed=0)
    print(e.value)
