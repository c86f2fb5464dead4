"""ptxsim.layouts checked against CuTe's own layout algebra, evaluated on the host by the CuTe DSL (no GPU):

* wgmma accumulator / A-register maps  vs  the TV layouts of ``hopper_helpers.make_trivial_tiled_mma``.
* wgmma smem operand addresses          vs  ``warpgroup.make_smem_layout_atom`` tiled by ``cute.tile_to_shape``
  (what ``make_smem_layout_a/b`` build), evaluated to element offsets, scaled to bytes and swizzled by CuTe's
  own Swizzle functor; the descriptor is built from those layouts by CUTLASS ``make_gmma_desc``'s stride rule.
* TMA box shared addresses               vs  the same layouts (the TMA writes what the MMA reads).
* ldmatrix / stmatrix                     vs  the TV layouts of the DSL's LdMatrix/StMatrix copy atoms.
The DSL is only imported here (ptxsim itself stays numpy-only).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ptxsim import layouts as L
from ptxsim.errors import MemoryFault, Unsupported
from ptxsim.tensormap import TensorMap

pytestmark = pytest.mark.sim

BASE = 0x2000  # smem base of the tile (1024-aligned), as CuTe's allocator gives
SWZ_SPAN = 0x10000  # bytes over which CuTe's swizzle functor is tabulated

# (kind, dtype name, rows, K tile, k_major)
SMEM_CASES = [
    ("K_SW128", "bf16", 64, 128, True), ("K_SW64", "bf16", 64, 64, True), ("K_SW32", "bf16", 64, 32, True),
    ("K_INTER", "bf16", 64, 32, True),
    ("MN_SW128", "bf16", 128, 32, False), ("MN_SW64", "bf16", 64, 32, False), ("MN_SW32", "bf16", 64, 32, False),
    ("MN_INTER", "bf16", 64, 32, False),
    ("K_SW128", "fp8", 32, 256, True), ("K_SW64", "fp8", 32, 128, True), ("K_SW32", "fp8", 32, 64, True),
    ("K_INTER", "fp8", 32, 64, True),
    ("K_SW128", "tf32", 64, 64, True), ("K_SW32", "tf32", 16, 16, True), ("K_INTER", "tf32", 16, 16, True),
]
EB = {"bf16": 2, "fp8": 1, "tf32": 4}
SW = {"SW128": 128, "SW64": 64, "SW32": 32, "INTER": 0}
LDSM = [(n, t) for n in (1, 2, 4) for t in (False, True)]


@pytest.fixture(scope="module")
def cute_ref():
    """Everything evaluated by CuTe in one host trace (static layouts -> Python ints)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cutlass = pytest.importorskip("cutlass")
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode as OM
    from cutlass.cute.nvgpu import warp, warpgroup

    dts = {"bf16": cutlass.BFloat16, "fp8": cutlass.Float8E4M3FN, "tf32": cutlass.TFloat32}
    out: dict = {}

    def tv2(tv, nt, nv):
        # a layout is the sum of its modes' contributions: tv((t, v)) = tv((t, 0)) + tv((0, v)) - tv((0, 0))
        a = np.array([tv((t, 0)) for t in range(nt)])[:, None]
        b = np.array([tv((0, v)) for v in range(nv)])[None, :]
        return a + b - tv((0, 0))

    def body():
        # accumulator TV layouts: (thread, value) -> m + 64*n
        for n, acc in ((64, cutlass.Float32), (256, cutlass.Float32), (64, cutlass.Float16), (24, cutlass.Float32)):
            ab = cutlass.Float16 if acc is cutlass.Float16 else cutlass.BFloat16
            tm = sm90_utils.make_trivial_tiled_mma(ab, ab, OM.K, OM.K, acc, (1, 1, 1), (64, n))
            tv = tm.tv_layout_C
            out[("C", n, acc.width)] = tv2(tv, 128, n // 2)
        # A from registers: (thread, value) -> m + 64*k
        for name, dt in (("bf16", cutlass.BFloat16), ("fp8", cutlass.Float8E4M3FN)):
            tm = sm90_utils.make_trivial_tiled_mma(dt, dt, OM.K, OM.K, cutlass.Float32, (1, 1, 1), (64, 64),
                                                   a_source=warpgroup.OperandSource.RMEM)
            tv = tm.tv_layout_A
            nv = 4 * 32 // dt.width
            out[("A", name)] = tv2(tv, 128, nv)
        # smem operand layouts: outer layout at (row, k, stage=1), and CuTe's swizzle functor on byte addresses
        for kind, dn, rows, kt, kmaj in SMEM_CASES:
            atom = warpgroup.make_smem_layout_atom(getattr(warpgroup.SmemLayoutAtomKind, kind), dts[dn])
            lay = cute.tile_to_shape(atom, (rows, kt, 2), order=(0, 1, 2) if kmaj else (1, 0, 2))
            outer = lay.outer if hasattr(lay, "outer") else lay
            off = (np.array([outer((r, 0, 1)) for r in range(rows)], dtype=np.int64)[:, None]
                   + np.array([outer((0, k, 0)) for k in range(kt)], dtype=np.int64)[None, :])
            out[("S", kind, dn)] = off
            sw = SW[kind.split("_")[1]]
            if sw and ("SWZ", sw) not in out:  # CuTe's Swizzle functor of this atom, on byte addresses
                swz = cute.make_composed_layout(lay.inner, 0, cute.make_layout(SWZ_SPAN))
                out[("SWZ", sw)] = np.array([swz(x) for x in range(0, SWZ_SPAN, 16)], dtype=np.int64)
        # ldmatrix / stmatrix copy atoms: src/dst TV layouts
        for n, t in LDSM:
            for nm, op in (("ld", warp.LdMatrix8x8x16bOp(t, n)), ("st", warp.StMatrix8x8x16bOp(t, n))):
                atom = cute.make_copy_atom(op, cutlass.BFloat16)
                for side in ("src", "dst"):
                    tv = getattr(atom, f"layout_{side}_tv")
                    nv = cute.size(tv, mode=[1])
                    out[(nm, n, t, side)] = tv2(tv, 32, nv)

    @cute.jit
    def probe():
        body()

    probe()
    return out


def _cute_swizzle(cute_ref, kind, dn, addr):
    """CuTe's swizzle functor (sampled at 16-byte granularity) applied to byte addresses < SWZ_SPAN."""
    sw = SW[kind.split("_")[1]]
    if sw == 0:
        return addr
    tab = cute_ref[("SWZ", sw)]
    assert np.all(addr < SWZ_SPAN)
    return tab[addr // 16] + addr % 16


def test_swizzle_matches_cute(cute_ref):
    x = np.arange(0, SWZ_SPAN, 16, dtype=np.int64)
    for sw in (128, 64, 32):
        assert np.array_equal(L.swizzle_addr(x, sw), cute_ref[("SWZ", sw)]), sw
    assert L.swizzle_addr(0x2345, 0) == 0x2345
    with pytest.raises(Unsupported):
        L.swizzle_addr(0, 16)


def test_desc_roundtrip_and_fields():
    d = L.smem_desc_encode(0x3F0, 0x10, 0x400, 128)
    # bit positions (ISA 9.7.15.5.1.2.1 / cute GmmaDescriptor): addr>>4 at 0, LBO>>4 at 16, SBO>>4 at 32, type at 62
    assert d == (0x3F | (1 << 16) | (0x40 << 32) | (1 << 62))
    s = L.smem_desc_decode(d | (5 << 49) | (1 << 14) | (1 << 46))  # junk in reserved bits is ignored
    assert (s.start_addr, s.lbo, s.sbo, s.base_offset, s.swizzle) == (0x3F0, 0x10, 0x400, 5, 128)
    assert L.smem_desc_decode(2 << 62).swizzle == 64 and L.smem_desc_decode(3 << 62).swizzle == 32
    assert L.smem_desc_decode(0).swizzle == 0


def _gmma_desc(off_b, kind, rb, kb, rows_i, kinst, eb):
    """The descriptor CUTLASS make_gmma_desc builds for the (rows_i x kinst) sub-tile at (rb, kb) of a layout whose
    unswizzled byte offsets are off_b[row, k]: start = its first element, LBO/SBO = the canonical strides."""
    r0, k0 = rb * rows_i, kb * kinst
    start = BASE + off_b[r0, k0]
    sw = SW[kind.split("_")[1]]
    d = lambda dr, dk: int(off_b[r0 + dr, k0 + dk] - off_b[r0, k0]) if r0 + dr < off_b.shape[0] else 16
    if kind.startswith("K_"):
        sbo = d(8, 0)
        lbo = d(0, 16 // eb) if sw == 0 else 16  # LBO unused for swizzled K-major (CUTLASS writes 1)
    else:
        if sw == 0:
            sbo, lbo = d(16 // eb, 0), d(0, 8)
        else:
            lbo, sbo = d(sw // eb, 0), d(0, 8)
    return L.smem_desc_encode(int(start), lbo, sbo, sw)


@pytest.mark.parametrize("kind,dn,rows,kt,kmaj", SMEM_CASES)
def test_wgmma_operand_addrs_match_cute_smem_layouts(cute_ref, kind, dn, rows, kt, kmaj):
    eb = EB[dn]
    off_b = cute_ref[("S", kind, dn)] * eb
    kinst = 32 // eb
    rows_i = 64 if rows >= 64 else rows  # A (M = 64) or a narrow B (N = rows)
    n_checked = 0
    for rb in range(rows // rows_i):
        for kb in range(kt // kinst):
            desc = _gmma_desc(off_b, kind, rb, kb, rows_i, kinst, eb)
            got = L.wgmma_operand_addrs(desc, rows_i, kinst, eb * 8, kmaj)
            sub = off_b[rb * rows_i:(rb + 1) * rows_i, kb * kinst:(kb + 1) * kinst]
            want = _cute_swizzle(cute_ref, kind, dn, BASE + sub)
            assert np.array_equal(got, want), (kind, dn, rb, kb)
            n_checked += 1
    assert n_checked >= 2


def test_wgmma_operand_addrs_rejects():
    desc = L.smem_desc_encode(0, 16, 1024, 128)
    with pytest.raises(Unsupported):
        L.wgmma_operand_addrs(desc, 64, 32, 8, False)  # MN-major fp8
    with pytest.raises(Unsupported):
        L.wgmma_operand_addrs(desc, 64, 16, 8, True)  # wrong K for 8-bit
    with pytest.raises(Unsupported):
        L.wgmma_operand_addrs(desc | (1 << 49), 64, 16, 16, True)  # base_offset


@pytest.mark.parametrize("n,bits", [(64, 32), (256, 32), (24, 32), (64, 16)])
def test_acc_map_matches_cute_tv(cute_ref, n, bits):
    idx = cute_ref[("C", n, bits)]  # (128 threads, n/2 values) -> m + 64*col
    want = np.stack([idx % 64, idx // 64], axis=-1).reshape(4, 32, n // 2, 2)
    got = L.wgmma_acc_map(n, bits)
    if bits == 16:
        assert got.shape == (4, 32, n // 4, 2, 2)
        got = got.reshape(4, 32, n // 2, 2)  # value v = 2*reg + half (low half first)
    assert np.array_equal(got, want)
    # every element of the 64 x n tile exactly once
    flat = got[..., 0] * n + got[..., 1]
    assert np.array_equal(np.sort(flat.ravel()), np.arange(64 * n))


@pytest.mark.parametrize("dn,bits", [("bf16", 16), ("fp8", 8)])
def test_a_reg_map_matches_cute_tv(cute_ref, dn, bits):
    idx = cute_ref[("A", dn)]  # (128, 4*per) -> m + 64*k ; value v = reg*per + element
    per = 32 // bits
    want = np.stack([idx % 64, idx // 64], axis=-1).reshape(4, 32, 4, per, 2)
    assert np.array_equal(L.wgmma_a_reg_map(bits), want)


def test_a_reg_map_tf32_from_isa_figure():
    # ISA figure "WGMMA .m64nNk8 register fragment layout for matrix A" (.tf32): a0:(g, t) a1:(g+8, t) a2:(g, t+4)
    # a3:(g+8, t+4); CuTe's make_trivial_tiled_mma does not build tf32, so spot values from the figure.
    m = L.wgmma_a_reg_map(32)
    assert m.shape == (4, 32, 4, 1, 2)
    assert m[0, 0, :, 0].tolist() == [[0, 0], [8, 0], [0, 4], [8, 4]]
    assert m[2, 13, :, 0].tolist() == [[35, 1], [43, 1], [35, 5], [43, 5]]


def _tmap(dims, box, eb, sw, estr=None, dtype="bf16", addr=0x7F0000000000):
    strides = [eb]
    for dd in dims[:-1]:
        strides.append(strides[-1] * dd)
    return TensorMap(address=addr, rank=len(dims), dtype=dtype, elem_bytes=eb, dims=tuple(dims),
                     strides=tuple(strides), box=tuple(box), elem_strides=tuple(estr or [1] * len(dims)),
                     interleave=0, swizzle=sw, l2_promotion=0, oob_nan=False)


@pytest.mark.parametrize("kind,dn,rows,kt,kmaj", [c for c in SMEM_CASES if "INTER" not in c[0]])
def test_tma_box_smem_matches_mma_layout(cute_ref, kind, dn, rows, kt, kmaj):
    """The boxes CuTe's TMA would issue for the staged tile (one per swizzle-span column block) land each element
    (row, k) exactly where the smem layout (hence the wgmma) expects it."""
    eb = EB[dn]
    sw = SW[kind.split("_")[1]]
    off_b = cute_ref[("S", kind, dn)] * eb
    span = sw // eb  # elements per swizzled row
    if kmaj:  # inner dim K
        tm = _tmap((kt, rows), (span, rows), eb, sw)
        nblk, elems = kt // span, lambda j: off_b[:, j * span:(j + 1) * span]
    else:  # inner dim MN
        tm = _tmap((rows, kt), (span, kt), eb, sw)
        nblk, elems = rows // span, lambda j: off_b[j * span:(j + 1) * span, :].T
    for j in range(nblk):
        blk = elems(j)  # (outer, inner) element offsets in bytes
        dst = BASE + int(blk.min())
        coords = (j * span, 0)
        g, inb, s = L.tma_box_addrs(tm, coords, dst)
        want = _cute_swizzle(cute_ref, kind, dn, BASE + blk).reshape(-1)  # flat order: inner fastest
        assert np.array_equal(s, want), (kind, dn, j)
        assert inb.all()
        o, i = np.meshgrid(np.arange(blk.shape[0]), np.arange(blk.shape[1]), indexing="ij")
        assert np.array_equal(g, tm.address + (i.ravel() + j * span) * eb + o.ravel() * tm.strides[1])


def test_tma_oob_elem_strides_rank3():
    tm = _tmap((40, 5, 3), (8, 4, 2), 4, 0, estr=(2, 1, 1), dtype="f32")
    g, inb, s = L.tma_box_addrs(tm, (36, -2, 1), 0x400)
    assert g.shape == inb.shape == s.shape == (4 * 4 * 2,)
    j0, j1, j2 = np.meshgrid(np.arange(4), np.arange(4), np.arange(2), indexing="ij")  # -> flat j0 fastest
    j0, j1, j2 = (a.transpose(2, 1, 0).ravel() for a in (j0, j1, j2))
    c0, c1, c2 = 36 + 2 * j0, -2 + j1, 1 + j2
    assert np.array_equal(g, tm.address + c0 * 4 + c1 * 160 + c2 * 800)
    assert np.array_equal(inb, (c0 < 40) & (c1 >= 0) & (c1 < 5) & (c2 < 3))
    assert np.array_equal(s, 0x400 + 4 * (j0 + 4 * j1 + 16 * j2))


def test_tma_rules():
    with pytest.raises(MemoryFault):  # inner box 256 B > 128B swizzle span
        L.tma_box_addrs(_tmap((256, 8), (128, 8), 2, 128), (0, 0), 0)
    with pytest.raises(MemoryFault):  # inner box not a multiple of 16 bytes
        L.tma_box_addrs(_tmap((64, 8), (4, 8), 2, 0), (0, 0), 0)
    with pytest.raises(MemoryFault):  # 128B swizzle needs a 1024-aligned box
        L.tma_box_addrs(_tmap((64, 8), (64, 8), 2, 128), (0, 0), 512)
    with pytest.raises(MemoryFault):  # 128-byte alignment of any box
        L.tma_box_addrs(_tmap((64, 8), (64, 8), 2, 0), (0, 0), 64)
    with pytest.raises(Unsupported):
        L.tma_box_addrs(_tmap((64, 8), (32, 8), 2, 128), (0, 0), 0)
    with pytest.raises(Unsupported):
        L.tma_box_addrs(_tmap((64, 8), (64, 8), 2, 0), (0,), 0)


@pytest.mark.parametrize("num,trans", LDSM)
def test_ldmatrix_stmatrix_match_cute_atoms(cute_ref, num, trans):
    addr_lane, frag = L.ldmatrix_map(num, trans)
    assert addr_lane.shape == (num, 8) and frag.shape == (32, num, 2, 3)
    for nm, mem_side, reg_side in (("ld", "src", "dst"), ("st", "dst", "src")):
        rows_tv = cute_ref[(nm, num, trans, mem_side)]  # (32, 8): lane -> the 8 elements of the row it addresses
        reg_tv = cute_ref[(nm, num, trans, reg_side)]  # (32, 2*num): value v = 2*reg + half
        # memory element index -> (first lane addressing that row, position in the row); CuTe repeats the rows
        # for lanes past 8*num (their addresses are unused by the ISA)
        mem_of = {}
        for lane in range(32):
            for c in range(8):
                mem_of.setdefault(int(rows_tv[lane, c]), (lane, c))
        assert sorted({ln for ln, _ in mem_of.values()}) == sorted(addr_lane.ravel().tolist())
        for lane in range(32):
            for reg in range(num):
                for h in range(2):
                    pl, c = mem_of[int(reg_tv[lane, 2 * reg + h])]
                    m, r, col = frag[lane, reg, h]
                    assert addr_lane[m, r] == pl and col == c, (nm, lane, reg, h)
    assert L.stmatrix_map(num, trans)[1].tolist() == frag.tolist()


def test_ldmatrix_unsupported_shapes():
    with pytest.raises(Unsupported):
        L.ldmatrix_map(4, True, 8, "m16n16")
    with pytest.raises(Unsupported):
        L.ldmatrix_map(3, False)
