"""sm_100a instructions beyond tcgen05's 1-CTA core, on small hand-written kernels: 128-bit registers (mov/ld/st
.b128), cluster launch control (try_cancel / query_cancel driving a persistent tile loop, checked against the
ISA's promise that every cluster is either launched or canceled exactly once), cp.async.bulk.tensor .cta_group::2
(complete_tx on the barrier the rank-carrying address names) and .tile::gather4 (against the ISA's four-row box)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from ptxsim import GlobalMemory, Hazard, LaunchSpec, MemoryFault, Simulator
from ptxsim import layouts as L
from ptxsim.errors import Unsupported
from ptxsim.ops import clc

pytestmark = pytest.mark.sim

HEADER = ".version 8.8\n.target sm_100a\n.address_size 64\n"


def kernel(body: str, shared: str = "", params: int = 2) -> str:
    ps = ",\n".join(f"\t.param .u64 k_param_{i}" for i in range(params))
    return (HEADER + shared + f"\n.visible .entry k(\n{ps}\n)\n{{\n"
            "\t.reg .pred %p<16>;\n\t.reg .b32 %r<64>;\n\t.reg .b64 %rd<32>;\n\t.reg .b128 %q<4>;\n" + body +
            "\n\tret;\n}\n")


def sim_of(ptx, tensors, grid=(1, 1, 1), block=(32, 1, 1), cluster=(1, 1, 1), seed=0, params=None, **kw):
    gmem = GlobalMemory()
    for name, (t, writable) in tensors.items():
        gmem.add_tensor(t, name, writable=writable)
    raw = params if params is not None else [struct.pack("<Q", t.data_ptr()) for t, _ in tensors.values()]
    spec = LaunchSpec(ptx, "k", grid, block, cluster, 0, raw)
    return Simulator(spec, gmem, seed, **kw)


# ------------------------------------------------------------------------------------------------------------------
# 128-bit registers: PTX ISA 5.2.2 (.b128), 9.7.9.10 mov.b128, 9.7.9.8/11 ld/st .b128

def test_b128_mov_pack_unpack_and_ld_st():
    body = """
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_1];
\tmov.u32 %r1, %tid.x;
\tcvt.u64.u32 %rd3, %r1;
\tmul.wide.u32 %rd4, %r1, 16;
\tadd.s64 %rd5, %rd2, %rd4;
\tld.global.b128 %q1, [%rd5];
\tmov.b128 {%rd6, %rd7}, %q1;
\tadd.s64 %rd6, %rd6, %rd3;
\tmov.b128 %q2, {%rd7, %rd6};
\tmov.b128 {%r2, %r3, %r4, %r5}, %q2;
\tmov.b128 %q3, {%r5, %r4, %r3, %r2};
\tadd.s64 %rd8, %rd1, %rd4;
\tst.global.b128 [%rd8], %q3;
"""
    inp = torch.randint(0, 2 ** 62, (32, 2), dtype=torch.int64)
    out = torch.zeros(32, 2, dtype=torch.int64)
    sim_of(kernel(body), {"out": (out, True), "inp": (inp, False)}).run()
    lo = inp[:, 0].numpy().view(np.uint64) + np.arange(32, dtype=np.uint64)
    hi = inp[:, 1].numpy().view(np.uint64)
    # q2 = {hi, lo + tid}; its 32-bit words w0..w3 (low first) come back reversed: q3 = {w3, w2, w1, w0}
    words = np.stack([hi, lo], 1).view(np.uint32)  # (32, 4): w0 w1 (hi) w2 w3 (lo + tid)
    want = words[:, ::-1].copy().view(np.uint64)
    assert (out.numpy().view(np.uint64) == want).all()


def test_b128_register_used_as_64_bits_is_unsupported():
    body = "\tmov.b64 %rd1, %q1;\n"
    out = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(Unsupported, match="128-bit register"):
        sim_of(kernel(body, params=1), {"out": (out, True)}).run()


# ------------------------------------------------------------------------------------------------------------------
# clusterlaunchcontrol: PTX ISA 9.7.13.17 try_cancel, 9.7.13.18 query_cancel

def test_query_cancel_decodes_what_try_cancel_encodes():
    """The response is opaque (9.7.13.18): only the round trip counts. Responses built by ``encode_response`` and
    loaded into a .b128 register decode to (canceled, x, y, z) by every query form."""
    body = """
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_1];
\tmov.u32 %r1, %tid.x;
\tmul.wide.u32 %rd4, %r1, 16;
\tadd.s64 %rd5, %rd2, %rd4;
\tld.global.v2.b64 {%rd6, %rd7}, [%rd5];
\tmov.b128 %q1, {%rd6, %rd7};
\tclusterlaunchcontrol.query_cancel.is_canceled.pred.b128 %p1, %q1;
\tselp.u32 %r2, 1, 0, %p1;
\tclusterlaunchcontrol.query_cancel.get_first_ctaid::x.b32.b128 %r3, %q1;
\tclusterlaunchcontrol.query_cancel.get_first_ctaid::y.b32.b128 %r4, %q1;
\tclusterlaunchcontrol.query_cancel.get_first_ctaid::z.b32.b128 %r5, %q1;
\tclusterlaunchcontrol.query_cancel.get_first_ctaid.v4.b32.b128 {%r6, %r7, %r8, _}, %q1;
\tadd.s64 %rd8, %rd1, %rd4;
\tst.global.v4.u32 [%rd8], {%r2, %r3, %r4, %r5};
\tadd.s64 %rd9, %rd8, 512;
\tst.global.v4.u32 [%rd9], {%r2, %r6, %r7, %r8};
"""
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1 << 16, (32, 3))
    resp = np.stack([clc.encode_response(tuple(int(v) for v in ids[i])) if i % 3 else clc.encode_response(None)
                     for i in range(32)])
    inp = torch.from_numpy(resp.copy())
    out = torch.zeros(64, 4, dtype=torch.int32)
    sim_of(kernel(body), {"out": (out, True), "inp": (inp, False)}).run()
    o = out.numpy()
    canceled = np.arange(32) % 3 != 0
    assert (o[:32, 0] == canceled).all() and (o[32:, 0] == canceled).all()
    assert (o[:32, 1:][canceled] == ids[canceled]).all()
    assert (o[32:, 1:][canceled] == ids[canceled]).all()


# A persistent tile loop in the ISA's pattern (9.7.13.17 example): thread 0 arms the barrier for the 16-byte
# response and asks to cancel a not-yet-launched cluster; everyone waits, reads the response, and either processes
# the canceled cluster's tile next or exits. Every tile t records out[t] += 1 and who[t] = the CTA that did it.
CLC_LOOP = """
\tld.param.u64 %rd1, [k_param_0];
\tld.param.u64 %rd2, [k_param_1];
\tmov.u32 %r1, %tid.x;
\tmov.u32 %r2, %ctaid.x;
\tmov.u32 %r9, %ctaid.x;
\tmov.u32 %r10, 0;
\tmov.u32 %r20, clc_bar;
\tmov.u32 %r21, clc_resp;
\tsetp.eq.u32 %p1, %r1, 0;
\t@%p1 mbarrier.init.shared.b64 [%r20], 1;
\tbar.sync 0;
LOOP:
\tmul.wide.u32 %rd3, %r2, 4;
\tadd.s64 %rd4, %rd1, %rd3;
\tadd.s64 %rd5, %rd2, %rd3;
\t@%p1 atom.global.add.u32 %r3, [%rd4], 1;
\t@%p1 st.global.u32 [%rd5], %r9;
\t@%p1 mbarrier.arrive.expect_tx.shared.b64 %rd6, [%r20], 16;
\t@%p1 clusterlaunchcontrol.try_cancel.async.shared::cta.mbarrier::complete_tx::bytes{MC}.b128 [%r21], [%r20];
WAIT:
\tmbarrier.try_wait.parity.shared.b64 %p2, [%r20], %r10;
\t@!%p2 bra WAIT;
\txor.b32 %r10, %r10, 1;
\tld.shared.b128 %q1, [%r21];
\tclusterlaunchcontrol.query_cancel.is_canceled.pred.b128 %p3, %q1;
\tclusterlaunchcontrol.query_cancel.get_first_ctaid::x.b32.b128 %r2, %q1;
\tbar.sync 0;
\t@%p3 bra LOOP;
"""
CLC_SHARED = ".shared .align 8 .b8 clc_bar[8];\n.shared .align 16 .b8 clc_resp[16];\n"


def _clc_run(seed, fail_rate=None, tiles=6, mc=""):
    count = torch.zeros(tiles, dtype=torch.int32)
    who = torch.full((tiles,), -1, dtype=torch.int32)
    sim = sim_of(kernel(CLC_LOOP.replace("{MC}", mc), CLC_SHARED), {"count": (count, True), "who": (who, True)},
                 grid=(tiles, 1, 1), seed=seed, concurrent_ctas=2)
    if fail_rate is not None:
        sim.clc_fail_rate = fail_rate
    sim.run()
    return count.numpy(), who.numpy()


def test_clc_persistent_loop_cancels_every_later_cluster():
    # seed 0: every request succeeds while a cluster is left; waves of 2 CTAs: CTAs 0 and 1 run every tile
    count, who = _clc_run(0)
    assert (count == 1).all()
    assert set(who.tolist()) <= {0, 1} and who[0] == 0 and who[1] == 1


@pytest.mark.parametrize("seed", [1, 2, 5])
def test_clc_failures_leave_tiles_to_their_own_ctas(seed):
    # requests may fail at any time (the ISA promises nothing): each tile is still processed exactly once, by a CTA
    # of its own launch or by the one whose request canceled it
    count, who = _clc_run(seed)
    assert (count == 1).all()
    assert (who <= np.arange(len(who))).all()


def test_clc_always_failing_runs_every_cluster_itself():
    count, who = _clc_run(3, fail_rate=1.0)
    assert (count == 1).all() and (who == np.arange(len(who))).all()


def test_clc_multicast_to_a_one_cta_cluster():
    count, who = _clc_run(0, mc=".multicast::cluster::all")
    assert (count == 1).all()


def test_clc_request_after_an_observed_failure_is_a_hazard():
    # the loop without its exit: after a failed response is observed the next try_cancel is undefined (9.7.13.17)
    body = CLC_LOOP.replace("{MC}", "").replace("\t@%p3 bra LOOP;", "\t@!%p3 mov.u32 %r2, %ctaid.x;\n\tbra.uni LOOP;")
    count = torch.zeros(2, dtype=torch.int32)
    who = torch.zeros(2, dtype=torch.int32)
    sim = sim_of(kernel(body, CLC_SHARED), {"count": (count, True), "who": (who, True)}, grid=(1, 1, 1))
    with pytest.raises(Hazard, match="already observed a failed"):
        sim.run()


def test_clc_response_read_before_the_barrier_is_a_hazard():
    body = CLC_LOOP.replace("{MC}", "").replace("\t@!%p2 bra WAIT;\n", "")
    count = torch.zeros(4, dtype=torch.int32)
    who = torch.zeros(4, dtype=torch.int32)
    sim = sim_of(kernel(body, CLC_SHARED), {"count": (count, True), "who": (who, True)}, grid=(4, 1, 1), seed=1,
                 concurrent_ctas=1)
    with pytest.raises(Hazard, match="asynchronous"):
        sim.run()


# ------------------------------------------------------------------------------------------------------------------
# TMA: a 2-D tensor map encoded by the field layout of ``tensormap.py`` (checked by decoding it back)

def tmap_bytes(t: torch.Tensor, box, swizzle=0) -> bytes:
    code = {torch.int16: 1, torch.bfloat16: 10}[t.dtype]
    eb = t.element_size()
    rows, cols = t.shape
    stride1 = t.stride(0) * eb
    extent = cols * eb + (rows - 1) * stride1
    w = [0] * 16
    w[0] = t.data_ptr()
    w[1] = 2 | (1 << 4) | (code << 7) | ({0: 0, 32: 1, 64: 2, 128: 3}[swizzle] << 13) | (1 << 18) | \
        ((extent >= 1 << 17) << 21) | ((stride1 >> 4) << 32)
    w[4] = (cols - 1) | ((rows - 1) << 32)
    w[6] = (box[0] - 1) << 56
    w[7] = box[1] - 1
    raw = b"".join(x.to_bytes(8, "little") for x in w)
    from ptxsim import tensormap
    tm = tensormap.decode(raw)
    assert (tm.dims, tm.box, tm.strides, tm.swizzle) == ((cols, rows), tuple(box), (eb, stride1), swizzle)
    return raw


GATHER4 = """
\tld.param.u64 %rd1, [k_param_0];
\tmov.u64 %rd5, k_param_1;
\tcvta.param.u64 %rd5, %rd5;
\tmov.u32 %r1, %tid.x;
\tmov.u32 %r20, g4_bar;
\tmov.u32 %r21, g4_tile;
\tsetp.eq.u32 %p1, %r1, 0;
\t@%p1 mbarrier.init.shared.b64 [%r20], 1;
\tbar.sync 0;
\t@%p1 mbarrier.arrive.expect_tx.shared.b64 %rd6, [%r20], 512;
\t@%p1 cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes.L2::cache_hint [%r21+{OFF}], [%rd5, {{COL}, 5, 39, 0, {R3}}], [%r20], %rd9;
WAIT:
\tmbarrier.try_wait.parity.shared.b64 %p2, [%r20], 0;
\t@!%p2 bra WAIT;
\tmul.lo.u32 %r2, %r1, 16;
\tadd.u32 %r3, %r21, %r2;
\tld.shared.v4.u32 {%r4, %r5, %r6, %r7}, [%r3+{OFF}];
\tmul.wide.u32 %rd7, %r1, 16;
\tadd.s64 %rd8, %rd1, %rd7;
\tst.global.v4.u32 [%rd8], {%r4, %r5, %r6, %r7};
"""
G4_SHARED = ".shared .align 1024 .b8 g4_tile[1024];\n.shared .align 8 .b8 g4_bar[8];\n"


@pytest.mark.parametrize("col,off,r3", [(0, 0, 7), (64, 512, 45), (32, 384, 12)])
def test_gather4_rows_stacked_and_swizzled(col, off, r3):
    """PTX ISA 5.5.3.4: rows (5, 39, 0, r3) at columns col..col+63 stacked into a 4 x 64 bf16 tile; out-of-bound
    elements (row 45 of 40, columns >= 96) zero-filled (5.5.3.3); 128B swizzle (5.5.7 table): in the 128-byte line
    of pattern row r = (address / 128) % 8, 16-byte chunk c of the data sits at chunk c ^ r (a line at 512 / 384
    bytes into the 1024-byte pattern starts at base offset 4 / 3)."""
    src = torch.randint(-30000, 30000, (40, 96), dtype=torch.int16)
    out = torch.zeros(512, dtype=torch.uint8)
    ptx = kernel(GATHER4.replace("{OFF}", str(off)).replace("{COL}", str(col)).replace("{R3}", str(r3)), G4_SHARED)
    gm = {"out": (out, True), "src": (src, False)}
    params = [struct.pack("<Q", out.data_ptr()), tmap_bytes(src, (64, 1), 128)]
    sim = sim_of(ptx.replace(".param .u64 k_param_1", ".param .align 64 .b8 k_param_1[128]"), gm, params=params)
    sim.run()
    s = src.numpy()
    want_rows = np.zeros((4, 64), np.int16)
    for i, r in enumerate((5, 39, 0, r3)):
        for j in range(64):
            if r < 40 and col + j < 96:
                want_rows[i, j] = s[r, col + j]
    logical = want_rows.view(np.uint8).reshape(4, 8, 16)  # (row, 16-byte chunk, bytes)
    got = out.numpy().reshape(4, 8, 16)
    for i in range(4):
        r = (off // 128 + i) % 8
        for c in range(8):
            assert (got[i, c ^ r] == logical[i, c]).all(), (i, c)


def test_gather4_map_rules():
    t = torch.zeros(8, 64, dtype=torch.bfloat16)
    from ptxsim import tensormap
    tm = tensormap.decode(tmap_bytes(t, (64, 1), 128))
    g, inb, s = L.tma_gather4_addrs(tm, 0, (1, 2, 3, 9), 1024)
    assert g.shape == inb.shape == s.shape == (256,)
    assert (inb == np.repeat([True, True, True, False], 64)).all()
    assert (g[:64] == t.data_ptr() + 128 + 2 * np.arange(64)).all()
    with pytest.raises(MemoryFault, match="5.5.3.4.1"):
        L.tma_gather4_addrs(tensormap.decode(tmap_bytes(t, (64, 4), 128)), 0, (0, 1, 2, 3), 1024)
    with pytest.raises(MemoryFault, match="128-byte"):
        L.tma_gather4_addrs(tm, 0, (0, 1, 2, 3), 1024 + 64)


# cta_group::2: each CTA of a pair loads its row into its own tile; both complete_tx on the leader's barrier, named
# by clearing the rank bit of the CTA's own barrier address (CUTLASS's peer-bit mask); the leader waits, then reads
# both tiles (the peer's through shared::cluster) and writes them out.
PAIR = """
\tld.param.u64 %rd1, [k_param_0];
\tmov.u64 %rd5, k_param_1;
\tcvta.param.u64 %rd5, %rd5;
\tmov.u32 %r1, %tid.x;
\tmov.u32 %r8, %cluster_ctarank;
\tmov.u32 %r20, p_bar;
\tmov.u32 %r21, p_tile;
\tsetp.eq.u32 %p1, %r1, 0;
\tsetp.eq.u32 %p4, %r8, 0;
\tand.pred %p5, %p1, %p4;
\t@%p5 mbarrier.init.shared.b64 [%r20], 1;
\t@%p5 mbarrier.arrive.expect_tx.shared.b64 %rd6, [%r20], 256;
\tbarrier.cluster.arrive;
\tbarrier.cluster.wait;
\tand.b32 %r22, %r20, -16777217;
\t@%p1 cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes{CG} [%r21], [%rd5, {0, %r8}], [%r22];
\t@!%p4 bra DONE;
WAIT:
\tmbarrier.try_wait.parity.shared.b64 %p2, [%r20], 0;
\t@!%p2 bra WAIT;
\tsetp.lt.u32 %p6, %r1, 8;
\t@!%p6 bra DONE;
\tmad.lo.u32 %r3, %r1, 16, %r21;
\tld.shared.v4.u32 {%r4, %r5, %r6, %r7}, [%r3];
\tmapa.shared::cluster.u32 %r23, %r3, 1;
\tld.shared::cluster.v4.u32 {%r10, %r11, %r12, %r13}, [%r23];
\tmul.wide.u32 %rd7, %r1, 16;
\tadd.s64 %rd8, %rd1, %rd7;
\tst.global.v4.u32 [%rd8], {%r4, %r5, %r6, %r7};
\tst.global.v4.u32 [%rd8+128], {%r10, %r11, %r12, %r13};
DONE:
\tbarrier.cluster.arrive;
\tbarrier.cluster.wait;
"""
PAIR_SHARED = ".shared .align 128 .b8 p_tile[128];\n.shared .align 8 .b8 p_bar[8];\n"


def _pair_sim(cg):
    src = torch.randint(-30000, 30000, (2, 64), dtype=torch.int16)
    out = torch.zeros(2, 64, dtype=torch.int16)
    ptx = kernel(PAIR.replace("{CG}", cg), PAIR_SHARED).replace(".param .u64 k_param_1",
                                                                 ".param .align 64 .b8 k_param_1[128]")
    sim = sim_of(ptx, {"out": (out, True), "src": (src, False)}, grid=(2, 1, 1), cluster=(2, 1, 1),
                 params=[struct.pack("<Q", out.data_ptr()), tmap_bytes(src, (64, 1))])
    return sim, src, out


def test_tma_cta_group_2_completes_on_the_leaders_barrier():
    sim, src, out = _pair_sim(".cta_group::2")
    sim.run()
    assert torch.equal(out, src)


def test_tma_without_cta_group_2_needs_the_destinations_own_barrier():
    # .cta_group::1 (the default): the barrier is the destination CTA's, uninitialized in the peer
    sim, src, out = _pair_sim("")
    with pytest.raises(Hazard, match="not initialized"):
        sim.run()
