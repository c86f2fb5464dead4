"""tcgen05 (sm_100a): the descriptor decoders and the TMEM maps against the PTX ISA tables and CuTe's host layouts,
and small hand-written kernels: alloc -> st -> ld -> dealloc, an MMA chain checked against float64, and each hazard
(a tcgen05.ld before the commit's phase is observed, a register read before wait::ld, a dealloc under an in-flight
MMA, an allocation that never fits, an access outside the warp's lane quarter)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from ptxsim import Deadlock, GlobalMemory, Hazard, LaunchSpec, MemoryFault, Simulator
from ptxsim import layouts as L
from ptxsim.errors import Unsupported

pytestmark = pytest.mark.sim

HEADER = ".version 8.8\n.target sm_100a\n.address_size 64\n"


def kernel(body: str, shared: str = "") -> str:
    return (HEADER + shared + "\n.visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n"
            "\t.reg .pred %p<16>;\n\t.reg .b32 %r<160>;\n\t.reg .b64 %rd<32>;\n" + body + "\n\tret;\n}\n")


def run(ptx: str, out: torch.Tensor, inp: torch.Tensor, block=(128, 1, 1), seed=0, **kw):
    gmem = GlobalMemory()
    gmem.add_tensor(out, "out", writable=True)
    gmem.add_tensor(inp, "inp", writable=False)
    spec = LaunchSpec(ptx, "k", (1, 1, 1), block, (1, 1, 1), 0,
                      [struct.pack("<Q", out.data_ptr()), struct.pack("<Q", inp.data_ptr())])
    return Simulator(spec, gmem, seed, **kw).run()


# ------------------------------------------------------------------------------------------------------------------
# descriptors: bit positions from PTX ISA 9.7.16.4.1 Table 40 / 9.7.16.4.2 Table 42 (independent literals)

def test_smem_desc_fields():
    d = L.umma_smem_desc_encode(0x3F0, 0x80, 0x400, 128)
    assert d == (0x3F | (0x8 << 16) | (0x40 << 32) | (1 << 46) | (2 << 61))
    s = L.umma_smem_desc_decode(d)
    assert (s.start_addr, s.lbo, s.sbo, s.version, s.base_offset, s.lbo_mode, s.swizzle) == \
        (0x3F0, 0x80, 0x400, 1, 0, 0, 128)
    assert L.umma_smem_desc_decode((1 << 46) | (4 << 61)).swizzle == 64
    assert L.umma_smem_desc_decode((1 << 46) | (6 << 61)).swizzle == 32
    assert L.umma_smem_desc_decode(1 << 46).swizzle == 0
    assert L.umma_smem_desc_decode((1 << 46) | (1 << 61)).swizzle == -1  # 128B with 32B atomicity
    assert L.umma_smem_desc_decode((1 << 46) | (3 << 49) | (1 << 52)).base_offset == 3
    for bad in (0, (1 << 46) | (1 << 47), (1 << 46) | (3 << 61), (1 << 46) | (5 << 61), (1 << 46) | (1 << 55)):
        with pytest.raises(Hazard):
            L.umma_smem_desc_decode(bad)  # version bits not 0b001, invalid swizzle, fixed-zero bits set
    with pytest.raises(Unsupported):
        L.umma_operand_addrs((1 << 46) | (1 << 61), 128, 16, 16, True)
    with pytest.raises(Unsupported):
        L.umma_operand_addrs((1 << 46) | (1 << 49), 128, 16, 16, True)


def test_instr_desc_fields():
    # bf16 x bf16 -> f32, M=128, N=256, B transposed: dtype 1 @4, atype 1 @7, btype 1 @10, trans B @16,
    # N>>3 = 32 @17, M>>4 = 8 @24
    v = (1 << 4) | (1 << 7) | (1 << 10) | (1 << 16) | (32 << 17) | (8 << 24)
    assert L.umma_instr_desc_encode(128, 256, 1, 1, 1, trans_b=1) == v
    i = L.umma_instr_desc_decode(v | (1 << 13))
    assert (i.m, i.n, i.dtype, i.atype, i.btype, i.trans_a, i.trans_b, i.neg_a, i.neg_b, i.sparse, i.reserved) == \
        (128, 256, 1, 1, 1, 0, 1, 1, 0, 0, 0)
    assert L.umma_instr_desc_decode((1 << 23) | (1 << 6)).reserved == 3
    assert L.umma_instr_desc_decode(3 << 30).max_shift == 3


def test_tmem_ld_st_map_32x32b():
    # ISA 9.7.16.2.3.1.1: thread t -> lane base + t, register r -> column base + r; 9.7.16.8.1: warp w%4 -> lanes
    for wi in range(4):
        ln, cl = L.tmem_ld_st_map("32x32b", 8, wi + 4, ((32 * wi) << 16) | 40)
        assert ln.shape == (32, 8)
        assert np.array_equal(ln, np.repeat(32 * wi + np.arange(32)[:, None], 8, 1))
        assert np.array_equal(cl, np.repeat(40 + np.arange(8)[None, :], 32, 0))
    with pytest.raises(MemoryFault):
        L.tmem_ld_st_map("32x32b", 1, 1, 0)  # warp 1 may access lanes 32-63 only
    with pytest.raises(Unsupported):
        L.tmem_ld_st_map("16x256b", 1, 0, 0)


# ------------------------------------------------------------------------------------------------------------------
# shared-memory operand maps vs CuTe's SM100 smem layouts (blackwell_helpers.make_smem_layout_a/b) on the host

BASE = 0x2000
SWZ_SPAN = 0x10000
# (a or b, dtype, major K?, (M, N, K tile)) -> the smem layout CuTe picks for that MMA tile
SM100_CASES = [("a", "bf16", True, 64), ("b", "bf16", True, 64), ("a", "bf16", False, 64), ("b", "bf16", False, 64),
               ("a", "bf16", True, 32), ("a", "fp8", True, 128), ("b", "fp8", False, 128), ("a", "tf32", True, 32),
               ("b", "bf16", True, 16)]
EB = {"bf16": 2, "fp8": 1, "tf32": 4}


@pytest.fixture(scope="module")
def cute_sm100():
    cutlass = pytest.importorskip("cutlass")
    from cutlass.cutlass_dsl.cutlass import CuTeDSL
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100
    from cutlass.cute.nvgpu import OperandMajorMode as OM
    from cutlass.cute.nvgpu import tcgen05

    dts = {"bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN, "tf32": cutlass.TFloat32}
    out: dict = {}

    def body():
        for ab, dn, kmaj, kt in SM100_CASES:
            dt = dts[dn]
            om = OM.K if kmaj else OM.MN
            tm = sm100.make_trivial_tiled_mma(dt, om, om, cutlass.Float32, tcgen05.CtaGroup.ONE, (128, 128))
            mk = sm100.make_smem_layout_a if ab == "a" else sm100.make_smem_layout_b
            lay = mk(tm, (128, 128, kt), dt, 1)
            outer = lay.outer
            inner = lay.inner
            kinst = 256 // dt.width  # the MMA atom's K: 32 bytes
            # the layout is ((rows, kinst), m tiles = 1, k tiles, stages); (row, k) -> element offset as the sum of
            # the row and the k contributions (an affine layout)
            rows = np.array([outer(((r, 0), 0, 0, 0)) for r in range(128)], dtype=np.int64)
            ks = np.array([outer(((0, k % kinst), 0, k // kinst, 0)) for k in range(kt)], dtype=np.int64)
            off = rows[:, None] + ks[None, :]
            out[(ab, dn, kmaj, kt)] = off
            out[("inner", ab, dn, kmaj, kt)] = str(inner)
            swz = cute.make_composed_layout(inner, 0, cute.make_layout(SWZ_SPAN))
            out[("swz", ab, dn, kmaj, kt)] = np.array([swz(x) for x in range(0, SWZ_SPAN, 16)], dtype=np.int64)

    @cute.jit
    def probe():
        body()

    envar = CuTeDSL._get_dsl().envar  # the module fixture set sm_90a; these atoms are sm_100a's
    saved = envar._arch
    envar.arch = "sm_100a"
    try:
        probe()
    finally:
        envar._arch = saved
    return out


def _swz_span(inner: str) -> int:
    # CuTe's swizzle functor S<B,4,3> on byte addresses: B = 3/2/1/0 -> 128/64/32/none
    import re
    m = re.search(r"S<(\d),(\d),(\d)>", inner)
    if not m:
        return 0
    b = int(m.group(1))
    return {0: 0, 1: 32, 2: 64, 3: 128}[b]


def _umma_desc(off_b, kmaj, W, r0, k0, rows_i, kinst, eb):
    """The descriptor CUTLASS make_umma_desc builds for the (rows_i x kinst) sub-tile at (r0, k0): start = its first
    element, SBO/LBO = the canonical strides it reads off the layout (mma_sm100_desc.hpp)."""
    start = BASE + off_b[r0, k0]
    d = lambda dr, dk: int(off_b[r0 + dr, k0 + dk] - off_b[r0, k0])
    if kmaj:
        sbo = d(8, 0)
        lbo = d(0, 16 // eb) if W == 0 else 16
    else:
        if W == 0:
            sbo, lbo = d(16 // eb, 0), d(0, 8)
        else:
            lbo = d(W // eb, 0) if rows_i * eb > W else 16
            sbo = d(0, 8) if kinst > 8 else 16
    return L.umma_smem_desc_encode(int(start), lbo, sbo, W)


@pytest.mark.parametrize("ab,dn,kmaj,kt", SM100_CASES)
def test_umma_operand_addrs_match_cute(cute_sm100, ab, dn, kmaj, kt):
    eb = EB[dn]
    off_b = cute_sm100[(ab, dn, kmaj, kt)] * eb
    W = _swz_span(cute_sm100[("inner", ab, dn, kmaj, kt)])
    tab = cute_sm100[("swz", ab, dn, kmaj, kt)]
    kinst = 32 // eb
    rows_i = 128
    checked = 0
    for kb in range(kt // kinst):
        desc = _umma_desc(off_b, kmaj, W, 0, kb * kinst, rows_i, kinst, eb)
        got = L.umma_operand_addrs(desc, rows_i, kinst, eb * 8, kmaj)
        sub = BASE + off_b[:, kb * kinst:(kb + 1) * kinst]
        want = tab[sub // 16] + sub % 16
        assert np.array_equal(got, want), (ab, dn, kmaj, kt, kb, W)
        checked += 1
    assert checked >= 1


# ------------------------------------------------------------------------------------------------------------------
# kernels

ST_LD = """
\tld.param.u64 %rd1, [k_param_0];
\tmov.u32 %r1, %tid.x;
\tshr.u32 %r2, %r1, 5;
\tsetp.eq.u32 %p1, %r2, 0;
\t@!%p1 bra SKIP_ALLOC;
\ttcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [tslot], 64;
\ttcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;
SKIP_ALLOC:
\tbar.sync 0;
\tld.shared.u32 %r3, [tslot];
\tshl.b32 %r4, %r2, 21;
\tadd.u32 %r5, %r3, %r4;
\tadd.u32 %r5, %r5, 8;
\tmul.lo.u32 %r10, %r1, 100;
\tadd.u32 %r11, %r10, 1;
\tadd.u32 %r12, %r10, 2;
\tadd.u32 %r13, %r10, 3;
\ttcgen05.st.sync.aligned.32x32b.x4.b32 [%r5], {%r10, %r11, %r12, %r13};
\ttcgen05.wait::st.sync.aligned;
\ttcgen05.ld.sync.aligned.32x32b.x2.b32 {%r20, %r21}, [%r5+2];
LD_WAIT
\tmul.wide.u32 %rd2, %r1, 8;
\tadd.s64 %rd3, %rd1, %rd2;
\tst.global.v2.u32 [%rd3], {%r20, %r21};
\ttcgen05.fence::before_thread_sync;
\tbar.sync 0;
\t@!%p1 bra DONE;
\ttcgen05.dealloc.cta_group::1.sync.aligned.b32 %r3, 64;
DONE:
"""
TSLOT = ".shared .align 8 .b8 tslot[16];\n"


def test_alloc_st_ld_dealloc():
    out = torch.zeros(128, 2, dtype=torch.int32)
    inp = torch.zeros(4, dtype=torch.int32)
    for seed in range(3):
        out.zero_()
        run(kernel(ST_LD.replace("LD_WAIT", "\ttcgen05.wait::ld.sync.aligned;"), TSLOT), out, inp, seed=seed)
        t = torch.arange(128, dtype=torch.int32)[:, None]
        assert torch.equal(out, t * 100 + torch.tensor([2, 3], dtype=torch.int32)[None, :])


def test_dealloc_under_an_unretired_ld():
    """Without tcgen05.wait::ld the registers may be read (a true register dependency, PTX ISA 9.7.16.6.4.5), but
    the load is not retired when the kernel deallocates its columns: a hazard."""
    with pytest.raises(Hazard, match="wait"):
        run(kernel(ST_LD.replace("LD_WAIT", ""), TSLOT), torch.zeros(128, 2, dtype=torch.int32),
            torch.zeros(4, dtype=torch.int32))


def test_ld_outside_lane_quarter_and_allocation():
    bad_lane = ST_LD.replace("shl.b32 %r4, %r2, 21;", "shl.b32 %r4, %r2, 16;")  # warp w at lane w, not 32w
    with pytest.raises(MemoryFault, match="9.7.16.8.1"):
        run(kernel(bad_lane.replace("LD_WAIT", "\ttcgen05.wait::ld.sync.aligned;"), TSLOT),
            torch.zeros(128, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))
    bad_col = ST_LD.replace("add.u32 %r5, %r5, 8;", "add.u32 %r5, %r5, 62;")  # columns 62..65 of 64 allocated
    with pytest.raises(MemoryFault, match="outside every tcgen05.alloc"):
        run(kernel(bad_col.replace("LD_WAIT", "\ttcgen05.wait::ld.sync.aligned;"), TSLOT),
            torch.zeros(128, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))


def test_ld_of_unwritten_tmem_is_poison():
    src = ST_LD.replace("[%r5+2]", "[%r5+4]").replace("LD_WAIT", "\ttcgen05.wait::ld.sync.aligned;")
    with pytest.raises(Hazard, match="nothing wrote"):
        run(kernel(src, TSLOT), torch.zeros(128, 2, dtype=torch.int32), torch.zeros(4, dtype=torch.int32))


def test_alloc_that_never_fits_deadlocks():
    body = """
\tmov.u32 %r1, %tid.x;
\tshr.u32 %r2, %r1, 5;
\tsetp.eq.u32 %p1, %r2, 0;
\t@%p1 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [tslot], 512;
\tbar.sync 0;
\tsetp.eq.u32 %p2, %r2, 1;
\t@%p2 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [tslot+4], 256;
"""
    with pytest.raises(Deadlock, match="tcgen05.alloc of 256 columns"):
        run(kernel(body, TSLOT), torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), block=(64, 1, 1))


# The MMA kernel: A (128 x 32) and B (N=32 x 32) bf16, K-major, no swizzle, laid out by the host in the canonical
# "interleave" layout of CUTLASS make_umma_desc: core matrices of 8 rows x 16 bytes, row r at (r%8)*16 + (r//8)*SBO,
# K chunk c (8 elements) at c*LBO. Two MMAs (K = 16 each): D = A[:, :16] B[:, :16]^T, then D += A[:, 16:] B[:, 16:]^T.
N_MMA = 32
LBO, SBO = 128, 512
A_BYTES = 128 // 8 * SBO
B_BYTES = N_MMA // 8 * SBO


def _canonical(mat_bits: np.ndarray) -> np.ndarray:
    rows, k = mat_bits.shape
    img = np.zeros(rows // 8 * SBO, np.uint8)
    raw = mat_bits.astype(np.uint16).view(np.uint8).reshape(rows, k * 2)
    for r in range(rows):
        for c in range(k // 8):
            o = (r % 8) * 16 + (r // 8) * SBO + c * LBO
            img[o:o + 16] = raw[r, 16 * c:16 * c + 16]
    return img


def _copy_to_tile(nwords, first=None):
    """PTX: the 128 threads copy ``nwords`` 32-bit words of the global operand image (``%rd2``; from word register
    ``first`` on, if given) into ``tile``, fence them for the async proxy, and set ``%p1`` (warp 0) / ``%p2`` (thread
    0)."""
    index, offset = ("%r41", "") if first is None else ("%r45", f"\tadd.u32 %r45, %r41, {first};\n")
    return f"""\tmov.u32 %r40, tile;
\tmov.u32 %r41, %r1;
COPY:
{offset}\tmul.wide.u32 %rd3, {index}, 4;
\tadd.s64 %rd4, %rd2, %rd3;
\tld.global.u32 %r42, [%rd4];
\tshl.b32 %r43, %r41, 2;
\tadd.u32 %r44, %r40, %r43;
\tst.shared.u32 [%r44], %r42;
\tadd.u32 %r41, %r41, 128;
\tsetp.lt.u32 %p4, %r41, {nwords};
\t@%p4 bra COPY;
\tfence.proxy.async.shared::cta;
\tsetp.eq.u32 %p1, %r2, 0;
\tsetp.eq.u32 %p2, %r1, 0;
"""


def _mma_kernel(wait=True, dealloc_early=False, idesc=None):
    idesc = L.umma_instr_desc_encode(128, N_MMA, 1, 1, 1) if idesc is None else idesc
    hi = (LBO >> 4) << 16 | (SBO >> 4) << 32 | (1 << 46)
    nwords = (A_BYTES + B_BYTES) // 4
    ld_regs = ", ".join(f"%r{100 + i}" for i in range(32))
    stores = "".join(f"\tst.global.u32 [%rd5+{4 * i}], %r{100 + i};\n" for i in range(32))
    wait_loop = """
WAIT:
\tmbarrier.try_wait.parity.shared::cta.b64 %p3, [mbar], 0;
\t@!%p3 bra WAIT;
""" if wait else "\tbar.sync 0;\n"  # issued, but no wait on the commit's mbarrier
    early = "\t@%p1 tcgen05.dealloc.cta_group::1.sync.aligned.b32 %r3, 64;\n" if dealloc_early else ""
    body = f"""
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_1];
\tmov.u32 %r1, %tid.x;
\tshr.u32 %r2, %r1, 5;
{_copy_to_tile(nwords)}\t@%p1 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [tslot], 64;
\t@%p2 mbarrier.init.shared::cta.b64 [mbar], 1;
\tbar.sync 0;
\tld.shared.u32 %r3, [tslot];
\ttcgen05.fence::after_thread_sync;
\t@!%p2 bra ISSUED;
\tshr.u32 %r50, %r40, 4;
\tand.b32 %r50, %r50, 16383;
\tcvt.u64.u32 %rd10, %r50;
\tor.b64 %rd10, %rd10, {hi};
\tadd.s64 %rd11, %rd10, {A_BYTES >> 4};
\tadd.s64 %rd12, %rd10, {2 * LBO >> 4};
\tadd.s64 %rd13, %rd11, {2 * LBO >> 4};
\tmov.u32 %r51, {idesc};
\tsetp.ne.u32 %p5, %r1, 0;
\ttcgen05.mma.cta_group::1.kind::f16 [%r3], %rd10, %rd11, %r51, %p5;
\tsetp.eq.u32 %p6, %r1, 0;
\ttcgen05.mma.cta_group::1.kind::f16.collector::a::discard [%r3], %rd12, %rd13, %r51, {{%r60, %r60, %r60, %r60}}, %p6;
\ttcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [mbar];
ISSUED:
{early}{wait_loop}\ttcgen05.fence::after_thread_sync;
\tshl.b32 %r4, %r2, 21;
\tadd.u32 %r5, %r3, %r4;
\ttcgen05.ld.sync.aligned.32x32b.x32.b32 {{{ld_regs}}}, [%r5];
\ttcgen05.wait::ld.sync.aligned;
\tmul.wide.u32 %rd6, %r1, 128;
\tadd.s64 %rd5, %rd1, %rd6;
{stores}\ttcgen05.fence::before_thread_sync;
\tbar.sync 0;
\t@!%p1 bra DONE;
\ttcgen05.dealloc.cta_group::1.sync.aligned.b32 %r3, 64;
DONE:
"""
    body = body.replace("\tmov.u32 %r51", "\tmov.u32 %r60, 0;\n\tmov.u32 %r51")
    shared = TSLOT + ".shared .align 8 .b8 mbar[8];\n.shared .align 1024 .b8 tile[%d];\n" % (A_BYTES + B_BYTES)
    return kernel(body, shared)


def _mma_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(128, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(N_MMA, 32, generator=g).to(torch.bfloat16)
    img = np.concatenate([_canonical(a.view(torch.int16).numpy().view(np.uint16)),
                          _canonical(b.view(torch.int16).numpy().view(np.uint16))])
    return a, b, torch.from_numpy(img.view(np.int32).copy())


def test_mma_chain_matches_float64():
    a, b, inp = _mma_inputs()
    ref = (a.double() @ b.double().T).float()
    for seed in range(3):
        out = torch.zeros(128, 32, dtype=torch.float32)
        run(_mma_kernel(), out, inp, seed=seed)
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6), seed


def test_mma_ld_without_mbarrier_wait():
    # the readers pass a bar.sync after the issue but never wait on the commit's mbarrier: by the schedule, the MMA
    # is in flight, or landed with its commit not arrived, or arrived with the phase not observed
    a, b, inp = _mma_inputs()
    whys = set()
    for seed, kw in [(s, {}) for s in range(3)] + [(s, {"async_rate": 1.0}) for s in range(3)]:
        with pytest.raises(Hazard, match="tcgen05.ld of TMEM") as e:
            run(_mma_kernel(wait=False), torch.zeros(128, 32), inp, seed=seed, **kw)
        msg = str(e.value)
        assert "nothing wrote" not in msg
        whys.add("in-flight" if "in-flight" in msg else "commit" if "no tcgen05.commit" in msg else "observed")
    assert len(whys) >= 2, whys


def test_dealloc_under_inflight_mma():
    a, b, inp = _mma_inputs()
    with pytest.raises(Hazard, match="dealloc"):
        run(_mma_kernel(dealloc_early=True), torch.zeros(128, 32), inp, async_rate=0.0)


def test_mma_bad_descriptor_and_unsupported():
    a, b, inp = _mma_inputs()
    with pytest.raises(Hazard, match="Table 42"):
        run(_mma_kernel(idesc=L.umma_instr_desc_encode(128, 32, 1, 1, 1) | 4), torch.zeros(128, 32), inp)  # sparse
    with pytest.raises(Unsupported, match="M = 64"):
        run(_mma_kernel(idesc=L.umma_instr_desc_encode(64, 32, 1, 1, 1)), torch.zeros(128, 32), inp)
    src = _mma_kernel().replace("tcgen05.commit.cta_group::1", "tcgen05.commit.cta_group::2")
    with pytest.raises(Hazard, match="same value"):  # PTX ISA 9.7.16.7.1: one .cta_group per kernel
        run(src, torch.zeros(128, 32), inp)


# ------------------------------------------------------------------------------------------------------------------
# .cta_group::2: a cluster of 2 CTAs (one CTA pair) computes D (256 x 32) = A (256 x 32) B (32 x 32)^T in two MMAs of
# K = 16 issued by thread 0 of the even CTA. Each CTA's shared memory holds its A rows (0-127 / 128-255) and its half
# of B's N rows (0-15 / 16-31) at the same offsets (the 2x1SM split: A and D by M halves, B by N halves); each CTA
# reads its 128 rows of D from its own TMEM.
N2 = 32
B2_BYTES = N2 // 2 // 8 * SBO


def _pair_kernel(mask=3, m=256):
    idesc = L.umma_instr_desc_encode(m, N2, 1, 1, 1)
    hi = (LBO >> 4) << 16 | (SBO >> 4) << 32 | (1 << 46)
    nwords = (A_BYTES + B2_BYTES) // 4
    ld_regs = ", ".join(f"%r{100 + i}" for i in range(32))
    stores = "".join(f"\tst.global.u32 [%rd5+{4 * i}], %r{100 + i};\n" for i in range(32))
    body = f"""
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_1];
\tmov.u32 %r1, %tid.x;
\tshr.u32 %r2, %r1, 5;
\tmov.u32 %r7, %cluster_ctarank;
\tmul.lo.u32 %r8, %r7, {nwords};
{_copy_to_tile(nwords, "%r8")}\t@%p1 tcgen05.alloc.cta_group::2.sync.aligned.shared::cta.b32 [tslot], 64;
\t@%p2 mbarrier.init.shared::cta.b64 [mbar], 1;
\tbarrier.cluster.arrive.release.aligned;
\tbarrier.cluster.wait.acquire.aligned;
\tld.shared.u32 %r3, [tslot];
\ttcgen05.fence::after_thread_sync;
\tsetp.eq.u32 %p7, %r7, 0;
\tand.pred %p2, %p2, %p7;
\t@!%p2 bra ISSUED;
\tshr.u32 %r50, %r40, 4;
\tand.b32 %r50, %r50, 16383;
\tcvt.u64.u32 %rd10, %r50;
\tor.b64 %rd10, %rd10, {hi};
\tadd.s64 %rd11, %rd10, {A_BYTES >> 4};
\tadd.s64 %rd12, %rd10, {2 * LBO >> 4};
\tadd.s64 %rd13, %rd11, {2 * LBO >> 4};
\tmov.u32 %r51, {idesc};
\tsetp.ne.u32 %p5, %r1, 0;
\ttcgen05.mma.cta_group::2.kind::f16 [%r3], %rd10, %rd11, %r51, %p5;
\tsetp.eq.u32 %p6, %r1, 0;
\ttcgen05.mma.cta_group::2.kind::f16 [%r3], %rd12, %rd13, %r51, %p6;
\ttcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64 [mbar], {mask};
ISSUED:
WAIT:
\tmbarrier.try_wait.parity.shared::cta.b64 %p3, [mbar], 0;
\t@!%p3 bra WAIT;
\ttcgen05.fence::after_thread_sync;
\tshl.b32 %r4, %r2, 21;
\tadd.u32 %r5, %r3, %r4;
\ttcgen05.ld.sync.aligned.32x32b.x32.b32 {{{ld_regs}}}, [%r5];
\ttcgen05.wait::ld.sync.aligned;
\tshl.b32 %r9, %r7, 7;
\tadd.u32 %r9, %r9, %r1;
\tmul.wide.u32 %rd6, %r9, 128;
\tadd.s64 %rd5, %rd1, %rd6;
{stores}\ttcgen05.fence::before_thread_sync;
\tbarrier.cluster.arrive.release.aligned;
\tbarrier.cluster.wait.acquire.aligned;
\t@!%p1 bra DONE;
\ttcgen05.dealloc.cta_group::2.sync.aligned.b32 %r3, 64;
DONE:
"""
    shared = TSLOT + ".shared .align 8 .b8 mbar[8];\n.shared .align 1024 .b8 tile[%d];\n" % (A_BYTES + B2_BYTES)
    return kernel(body, shared)


def _pair_inputs(seed):
    g = torch.Generator().manual_seed(100 + seed)
    a = torch.randn(256, 32, generator=g).to(torch.bfloat16)
    b = torch.randn(N2, 32, generator=g).to(torch.bfloat16)
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)
    img = np.concatenate([_canonical(bits(a[:128])), _canonical(bits(b[:N2 // 2])),
                          _canonical(bits(a[128:])), _canonical(bits(b[N2 // 2:]))])
    return a, b, torch.from_numpy(img.view(np.int32).copy())


def run_pair(ptx, out, inp, seed=0, **kw):
    gmem = GlobalMemory()
    gmem.add_tensor(out, "out", writable=True)
    gmem.add_tensor(inp, "inp", writable=False)
    spec = LaunchSpec(ptx, "k", (2, 1, 1), (128, 1, 1), (2, 1, 1), 0,
                      [struct.pack("<Q", out.data_ptr()), struct.pack("<Q", inp.data_ptr())])
    return Simulator(spec, gmem, seed, **kw).run()


@pytest.mark.parametrize("seed", [0, 1])
def test_pair_mma_matches_float64(seed):
    a, b, inp = _pair_inputs(seed)
    ref = (a.double() @ b.double().T).float()
    for kw in ({}, {"async_rate": 1.0}):
        out = torch.full((256, N2), float("nan"))
        run_pair(_pair_kernel(), out, inp, seed=seed, **kw)
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6), (seed, kw)


def test_pair_commit_to_one_cta_only_and_unsupported():
    a, b, inp = _pair_inputs(0)
    # the commit arrives on the even CTA's mbarrier only: the odd CTA waits forever on its own
    with pytest.raises(Deadlock):
        run_pair(_pair_kernel(mask=1), torch.zeros(256, N2), inp)
    with pytest.raises(Unsupported, match="Layout B"):
        run_pair(_pair_kernel(m=128), torch.zeros(256, N2), inp)
    # a .cta_group::2 instruction in a CTA without a peer
    with pytest.raises(Hazard, match="peer"):
        run(_pair_kernel(), torch.zeros(256, N2), inp)
