"""The executor on small hand-written kernels: control flow and divergence, warp collectives, named barriers,
mbarriers, and each hazard with the evidence its report must carry."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from ptxsim import Deadlock, GlobalMemory, Hazard, LaunchSpec, MemoryFault, Simulator, SimError

pytestmark = pytest.mark.sim

HEADER = ".version 8.8\n.target sm_90a\n.address_size 64\n"


def kernel(body: str, regs: str = "", shared: str = "") -> str:
    return (HEADER + shared + "\n.visible .entry k(\n\t.param .u64 k_param_0\n)\n{\n"
            "\t.reg .pred %p<16>;\n\t.reg .b32 %r<64>;\n\t.reg .b64 %rd<32>;\n" + regs + body + "\n\tret;\n}\n")


def run(ptx: str, out: torch.Tensor, block=(32, 1, 1), grid=(1, 1, 1), seed=0, dyn_smem=0, writable=True, **kw):
    gmem = GlobalMemory()
    gmem.add_tensor(out, "out", writable=writable)
    spec = LaunchSpec(ptx, "k", grid, block, (1, 1, 1), dyn_smem, [struct.pack("<Q", out.data_ptr())])
    return Simulator(spec, gmem, seed, **kw).run()


# out[tid] = f(tid): the address of out[tid] in %rd3
PROLOGUE = """
\tld.param.u64 %rd1, [k_param_0];
\tmov.u32 %r1, %tid.x;
\tmul.wide.u32 %rd2, %r1, 4;
\tadd.s64 %rd3, %rd1, %rd2;
"""


def test_divergent_branches_reconverge():
    body = PROLOGUE + """
\tand.b32 %r2, %r1, 1;
\tsetp.eq.b32 %p1, %r2, 0;
\t@%p1 bra EVEN;
\tmul.lo.s32 %r3, %r1, 3;
\tbra.uni JOIN;
EVEN:
\tadd.s32 %r3, %r1, 100;
JOIN:
\tadd.s32 %r3, %r3, 1;
\tst.global.u32 [%rd3], %r3;
"""
    out = torch.full((32,), -1, dtype=torch.int32)
    run(kernel(body), out)
    t = torch.arange(32, dtype=torch.int32)
    assert torch.equal(out, torch.where(t % 2 == 0, t + 101, 3 * t + 1))


def test_shfl_modes():
    body = PROLOGUE + """
\tshfl.sync.bfly.b32 %r2, %r1, 1, 31, -1;
\tshfl.sync.down.b32 %r3|%p2, %r1, 3, 31, -1;
\tselp.b32 %r4, 1000, 0, %p2;
\tadd.s32 %r2, %r2, %r3;
\tadd.s32 %r2, %r2, %r4;
\tst.global.u32 [%rd3], %r2;
"""
    out = torch.full((32,), -1, dtype=torch.int32)
    run(kernel(body), out)
    t = np.arange(32)
    down = np.where(t + 3 <= 31, t + 3, t)
    want = (t ^ 1) + down + np.where(t + 3 <= 31, 1000, 0)
    assert out.numpy().tolist() == want.tolist()


def test_vote_and_elect():
    body = PROLOGUE + """
\tsetp.lt.u32 %p1, %r1, 5;
\tvote.sync.ballot.b32 %r2, %p1, -1;
\telect.sync %r5|%p3, -1;
\tselp.b32 %r6, 1, 0, %p3;
\tvote.sync.ballot.b32 %r7, %p3, -1;
\tpopc.b32 %r8, %r7;
\tadd.s32 %r2, %r2, %r8;
\tst.global.u32 [%rd3], %r2;
"""
    for seed in range(4):
        out = torch.full((32,), -1, dtype=torch.int32)
        run(kernel(body), out, seed=seed)
        assert (out == 0b11111 + 1).all()  # one leader, whichever the seed picks


def test_named_barrier_orders_shared_memory():
    # warp 1 writes shared memory, bar.sync, warp 0 reads it
    body = PROLOGUE + """
\tmov.u32 %r10, smem;
\tshl.b32 %r11, %r1, 2;
\tadd.s32 %r12, %r10, %r11;
\tsetp.ge.u32 %p1, %r1, 32;
\t@!%p1 bra SKIP;
\tsub.s32 %r13, %r12, 128;
\tst.shared.u32 [%r13], %r1;
SKIP:
\tbar.sync 0;
\tsetp.ge.u32 %p2, %r1, 32;
\t@%p2 bra DONE;
\tld.shared.u32 %r14, [%r12];
\tst.global.u32 [%rd3], %r14;
DONE:
"""
    out = torch.full((64,), -1, dtype=torch.int32)
    for seed in range(3):
        run(kernel(body, shared=".shared .align 16 .b8 smem[256];\n"), out, block=(64, 1, 1), seed=seed)
        assert out[:32].tolist() == list(range(32, 64))


def test_read_of_unwritten_shared_memory_is_poison():
    body = PROLOGUE + """
\tmov.u32 %r10, smem;
\tld.shared.u32 %r14, [%r10];
\tst.global.u32 [%rd3], %r14;
"""
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(Hazard, match="nothing wrote since the CTA began"):
        run(kernel(body, shared=".shared .align 16 .b8 smem[256];\n"), out)


def test_global_write_outside_the_tensors():
    body = PROLOGUE + """
\tadd.s64 %rd4, %rd3, 128;
\tst.global.u32 [%rd4], %r1;
"""
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(MemoryFault, match="outside every tensor of the launch.*out"):
        run(kernel(body), out)


def test_write_to_a_read_only_tensor():
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(MemoryFault, match="may only read"):
        run(kernel(PROLOGUE + "\tst.global.u32 [%rd3], %r1;\n"), out, writable=False)


def test_misaligned_global_access():
    body = PROLOGUE + """
\tadd.s64 %rd4, %rd3, 2;
\tld.global.u32 %r2, [%rd4];
"""
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(MemoryFault, match="misaligned"):
        run(kernel(body), out)


MBAR = """
\tmov.u32 %r10, bar;
\tsetp.eq.u32 %p1, %r1, 0;
\t@!%p1 bra W;
\tmbarrier.init.shared.b64 [%r10], {count};
W:
\tbar.sync 0;
"""


def test_mbarrier_phase_and_parity():
    # each of 2 warps arrives once (lane 0); both then wait for phase 0 to complete
    body = PROLOGUE + MBAR.format(count=2) + """
\tand.b32 %r2, %r1, 31;
\tsetp.eq.u32 %p2, %r2, 0;
\t@!%p2 bra WAIT;
\tmbarrier.arrive.shared.b64 %rd5, [%r10];
WAIT:
\tmov.u32 %r3, 0;
LOOP:
\tmbarrier.try_wait.parity.shared.b64 %p3, [%r10], %r3;
\t@!%p3 bra LOOP;
\tst.global.u32 [%rd3], %r1;
"""
    for seed in range(3):
        out = torch.full((64,), -1, dtype=torch.int32)
        run(kernel(body, shared=".shared .align 8 .b8 bar[8];\n"), out, block=(64, 1, 1), seed=seed)
        assert out.tolist() == list(range(64))


def test_mbarrier_deadlock_reports_the_barrier_state():
    body = PROLOGUE + MBAR.format(count=3) + """
\tand.b32 %r2, %r1, 31;
\tsetp.eq.u32 %p2, %r2, 0;
\t@!%p2 bra WAIT;
\tmbarrier.arrive.shared.b64 %rd5, [%r10];
WAIT:
\tmov.u32 %r3, 0;
LOOP:
\tmbarrier.try_wait.parity.shared.b64 %p3, [%r10], %r3;
\t@!%p3 bra LOOP;
"""
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(Deadlock) as e:
        run(kernel(body, shared=".shared .align 8 .b8 bar[8];\n"), out, block=(64, 1, 1))
    msg = str(e.value)
    assert "pending arrivals 1 of 3" in msg and "warp 0" in msg and "warp 1" in msg and "parity 0" in msg


def test_mbarrier_arrival_beyond_count():
    body = PROLOGUE + MBAR.format(count=1) + """
\tmbarrier.arrive.shared.b64 %rd5, [%r10], 2;
"""
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(Hazard, match="arrival beyond its count"):
        run(kernel(body, shared=".shared .align 8 .b8 bar[8];\n"), out, block=(32, 1, 1))


def test_bar_sync_count_mismatch():
    body = PROLOGUE + """
\tsetp.ge.u32 %p1, %r1, 32;
\t@%p1 bra B;
\tbar.sync 1, 64;
\tbra.uni E;
B:
\tbar.sync 1, 96;
E:
"""
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(Hazard, match="count 96 here, 64 from an earlier|count 64 here, 96 from an earlier"):
        run(kernel(body), out, block=(64, 1, 1))


def test_bar_sync_never_completed_is_a_deadlock():
    body = PROLOGUE + """
\tsetp.ge.u32 %p1, %r1, 32;
\t@%p1 bra E;
\tbar.sync 1, 64;
E:
"""
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(Deadlock, match="bar.sync 1"):
        run(kernel(body), out, block=(64, 1, 1))


def test_setmaxnreg_budget_beyond_the_register_file():
    # 384 threads (3 warpgroups, 168 registers each at launch) all raising to 240: 92160 > 65536 registers
    body = PROLOGUE + "\tsetmaxnreg.inc.sync.aligned.u32 240;\n"
    out = torch.zeros(384, dtype=torch.int32)
    with pytest.raises(Deadlock, match="setmaxnreg.inc 240"):
        run(kernel(body), out, block=(384, 1, 1))


def test_setmaxnreg_within_the_register_file():
    # FA3/FA4's split: the producer warpgroup gives registers back (24), two consumers take 240 each
    body = PROLOGUE + """
\tsetp.lt.u32 %p1, %r1, 128;
\t@!%p1 bra C;
\tsetmaxnreg.dec.sync.aligned.u32 24;
\tbra.uni E;
C:
\tsetmaxnreg.inc.sync.aligned.u32 240;
E:
\tst.global.u32 [%rd3], %r1;
"""
    out = torch.full((384,), -1, dtype=torch.int32)
    for seed in range(3):
        run(kernel(body), out, block=(384, 1, 1), seed=seed)
        assert out.tolist() == list(range(384))


def test_atomics_serialize():
    body = """
\tld.param.u64 %rd1, [k_param_0];
\tatom.global.add.u32 %r2, [%rd1], 1;
\tmul.wide.u32 %rd2, %r2, 4;
\tadd.s64 %rd3, %rd1, %rd2;
\tst.global.u32 [%rd3+4], %r2;
"""
    out = torch.full((65,), -1, dtype=torch.int32)
    out[0] = 0
    run(kernel(body), out, block=(64, 1, 1))
    assert out[0] == 64 and sorted(out[1:].tolist()) == list(range(64))


def test_unsupported_instruction_names_the_line():
    body = "\tbrev.b32 %r1, %r2;\n\tfoo.bar.b32 %r1, %r2;\n"
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(SimError, match="foo.bar"):
        run(kernel(body), out)


def test_instruction_rate_is_reported():
    body = PROLOGUE + "\tst.global.u32 [%rd3], %r1;\n"
    out = torch.zeros(32, dtype=torch.int32)
    stats = run(kernel(body), out)
    assert stats["instructions"] == 6 and stats["instructions_per_second"] > 0


def test_aligned_barrier_waits_for_lanes_parked_in_a_wait():
    """Lane 0 of warp 0 spins on an mbarrier that warp 1 completes later; the other lanes reach bar.sync first.
    ptxas reconverges the warp there: the simulator waits for the parked lane instead of calling the warp
    diverged."""
    body = PROLOGUE + MBAR.format(count=1) + """
\tand.b32 %r2, %r1, 31;
\tsetp.lt.u32 %p2, %r1, 32;
\t@!%p2 bra W1;
\tsetp.ne.u32 %p3, %r2, 0;
\t@%p3 bra SYNC;
\tmov.u32 %r3, 0;
SPIN:
\tmbarrier.try_wait.parity.shared.b64 %p4, [%r10], %r3;
\t@!%p4 bra SPIN;
\tbra.uni SYNC;
W1:
\tsetp.ne.u32 %p5, %r2, 0;
\t@%p5 bra SYNC;
\tmbarrier.arrive.shared.b64 %rd5, [%r10];
SYNC:
\tbar.sync 1, 64;
\tst.global.u32 [%rd3], %r1;
"""
    for seed in range(4):
        out = torch.full((64,), -1, dtype=torch.int32)
        run(kernel(body, shared=".shared .align 8 .b8 bar[8];\n"), out, block=(64, 1, 1), seed=seed)
        assert out.tolist() == list(range(64))


def test_elect_picks_one_leader_per_member_set():
    body = PROLOGUE + """
\telect.sync %r2|%p1, -1;
\telect.sync %r3|%p2, -1;
\tsub.s32 %r4, %r2, %r3;
\tst.global.u32 [%rd3], %r4;
"""
    for seed in range(4):
        out = torch.full((32,), -1, dtype=torch.int32)
        run(kernel(body), out, seed=seed)
        assert (out == 0).all()


BULK_STORE = """
\tmov.u32 %r10, smem;
\tshl.b32 %r11, %r1, 2;
\tadd.s32 %r12, %r10, %r11;
\tst.shared.u32 [%r12], %r1;
\tbar.sync 0;
\tsetp.ne.u32 %p1, %r1, 0;
\t@%p1 bra DONE;
{fence}
\tcp.async.bulk.global.shared::cta.bulk_group [%rd1], [%r10], 256;
\tcp.async.bulk.commit_group;
\tcp.async.bulk.wait_group 0;
DONE:
"""


def test_one_proxy_fence_after_the_barrier_covers_every_writer():
    """Two warps write shared memory, bar.sync, then the issuing thread alone fences and bulk-stores it (the
    pattern CUTLASS epilogues use): the fence covers the writes it is ordered after."""
    body = PROLOGUE + BULK_STORE.replace("{fence}", "\tfence.proxy.async.shared::cta;")
    out = torch.full((64,), -1, dtype=torch.int32)
    for seed in range(3):
        run(kernel(body, shared=".shared .align 128 .b8 smem[256];\n"), out, block=(64, 1, 1), seed=seed)
        assert out.tolist() == list(range(64))


def test_bulk_store_without_the_proxy_fence():
    body = PROLOGUE + BULK_STORE.replace("{fence}", "")
    out = torch.full((64,), -1, dtype=torch.int32)
    with pytest.raises(Hazard, match="no fence.proxy.async"):
        run(kernel(body, shared=".shared .align 128 .b8 smem[256];\n"), out, block=(64, 1, 1))


def test_store_over_a_live_mbarrier():
    body = PROLOGUE + MBAR.format(count=1) + "\tst.shared.u32 [%r10+4], %r1;\n"
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(Hazard, match="inside a live mbarrier"):
        run(kernel(body, shared=".shared .align 8 .b8 bar[8];\n"), out)


def test_nonaligned_barrier_counts_warps_with_exited_lanes():
    """barrier.sync (not .aligned) marks a warp's arrival once its non-exited threads arrived: half of warp 0 exits
    first, and the default count (the CTA's non-exited warps) still completes."""
    body = PROLOGUE + """
\tsetp.ge.u32 %p1, %r1, 16;
\tsetp.lt.u32 %p2, %r1, 32;
\tand.pred %p3, %p1, %p2;
\t@%p3 bra OUT;
\tbarrier.sync 0;
\tst.global.u32 [%rd3], %r1;
OUT:
"""
    out = torch.full((64,), -1, dtype=torch.int32)
    run(kernel(body), out, block=(64, 1, 1))
    assert out[:16].tolist() == list(range(16)) and out[32:].tolist() == list(range(32, 64))


def test_launch_past_the_shared_memory_limit():
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(SimError, match="shared memory per CTA"):
        run(kernel(PROLOGUE), out, dyn_smem=232448 + 16)


def test_shared_memory_data_race_between_warps():
    """Warp 1 writes shared memory, warp 0 reads it with no barrier between: a data race, whichever runs first
    (after the write lands, the reader has not acquired it)."""
    body = PROLOGUE + """
\tmov.u32 %r10, smem;
\tand.b32 %r2, %r1, 31;
\tshl.b32 %r11, %r2, 2;
\tadd.s32 %r12, %r10, %r11;
\tsetp.ge.u32 %p1, %r1, 32;
\t@!%p1 bra READ;
\tst.shared.u32 [%r12], %r1;
\tbra.uni DONE;
READ:
\tmov.u32 %r13, 0;
SPIN:
\tadd.s32 %r13, %r13, 1;
\tsetp.lt.u32 %p2, %r13, 200;
\t@%p2 bra SPIN;
\tld.shared.u32 %r14, [%r12];
\tst.global.u32 [%rd3], %r14;
DONE:
"""
    out = torch.full((64,), -1, dtype=torch.int32)
    with pytest.raises(Hazard, match="data race"):
        for seed in range(3):
            run(kernel(body, shared=".shared .align 16 .b8 smem[256];\n"), out, block=(64, 1, 1), seed=seed)


@pytest.mark.parametrize("trans", [False, True])
def test_stmatrix_then_ldmatrix_round_trip(trans):
    """An 8x8 b16 matrix stored by stmatrix (each lane's pair of elements) and loaded back by ldmatrix with the same
    .trans: every lane gets its own register back (PTX ISA 9.7.9.16 / 9.7.9.17); lane l gives row l's address."""
    t = ".trans" if trans else ""
    body = PROLOGUE + f"""
\tmov.u32 %r10, smem;
\tand.b32 %r2, %r1, 7;
\tshl.b32 %r3, %r2, 4;
\tadd.s32 %r4, %r10, %r3;
\tmul.lo.s32 %r5, %r1, 65537;
\tstmatrix.sync.aligned.m8n8.x1{t}.shared.b16 [%r4], {{%r5}};
\tldmatrix.sync.aligned.m8n8.x1{t}.shared.b16 {{%r6}}, [%r4];
\tst.global.u32 [%rd3], %r6;
"""
    out = torch.full((32,), -1, dtype=torch.int32)
    run(kernel(body, shared=".shared .align 128 .b8 smem[128];\n"), out)
    assert out.tolist() == [l * 65537 for l in range(32)]
