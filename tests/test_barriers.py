"""Barrier accounting (perf/barriers.py): each mbarrier's init count against the arrivals one phase receives, derived
from the PTX, on fixed PTX for each kind of arriver and on every catalog configuration; and the replay of the rings'
phases (the SM100 W4 kernel's load ring deadlocked: initialized for 128 arrivals, released by 4)."""

import os
import re
import sys

import pytest

import artifacts
from cute_kv.kernels import catalog
from cute_kv.kernels.catalog import Role

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)

import barriers  # noqa: E402
import plan_replay  # noqa: E402  (tests/: the host model of the attention kernels' split-KV tiles)


def _kernel(body: str, inits: list[tuple[int, int]], threads: int = 128, tail: str = "") -> str:
    """A kernel whose warp 0 initializes ``(offset, count)`` barriers (one elected lane, as the pipelines do), then
    runs ``body`` (which may branch to ``$L__end``) and ``tail``. Registers: %r1 the shared-memory base, %r2 the
    thread index, %r3 its warp, %r4 its lane."""
    init = "\n".join(f"\tmov.b32 %r90, {count};\n\tmbarrier.init.shared.b64 [%r1+{offset}], %r90;"
                     for offset, count in inits)
    return f""".version 8.8
.target sm_100a
.address_size 64
.extern .shared .align 1024 .b8 __dynamic_shmem__0[];
.visible .entry k()
.reqntid {threads}, 1, 1
{{
\t.reg .pred %p<64>;
\t.reg .b32 %r<128>;
\t.reg .b64 %rd<16>;
\tmov.b32 %r0, __dynamic_shmem__0;
\tshfl.sync.idx.b32 %r1, %r0, 0, 31, -1;
\tmov.u32 %r2, %tid.x;
\tshr.u32 %r5, %r2, 5;
\tshfl.sync.idx.b32 %r3, %r5, 0, 31, -1;
\tand.b32 %r4, %r2, 31;
\tsetp.ne.b32 %p60, %r3, 0;
\t@%p60 bra $L__init_done;
\telect.sync %r91|%p61, -1;
\tnot.pred %p62, %p61;
\t@%p62 bra $L__init_done;
{init}
$L__init_done:
\tbar.sync 0;
{body}
$L__end:
{tail}
\tret;
}}
"""


WAIT = """\t// begin inline asm
\t{{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r1+{offset}], 0, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}}
\t// end inline asm"""

ALL = {"all": Role((0, 1, 2, 3))}


def _rows(report: barriers.Report) -> dict[str, tuple[int, int]]:
    return {r.array.name: (r.count, r.per_phase) for r in report.rows}


ARRIVERS = {  # arrive code (all 4 warps reach it, then their conditions) -> arrivals per phase
    "all threads": ("\tmbarrier.arrive.shared.b64 %rd1, [%r1];", 128),
    "all threads of warps 2-3": ("\tsetp.lt.u32 %p1, %r3, 2;\n\t@%p1 bra $L__end;\n"
                                 "\tmbarrier.arrive.shared.b64 %rd1, [%r1];", 64),
    "an elected lane per warp": ("\telect.sync %r10|%p1, -1;\n\tnot.pred %p2, %p1;\n\t@%p2 bra $L__end;\n"
                                 "\tmbarrier.arrive.shared.b64 %rd1, [%r1];", 4),
    "%laneid == 0": ("\tmov.u32 %r10, %laneid;\n\tsetp.ne.b32 %p1, %r10, 0;\n\t@%p1 bra $L__end;\n"
                     "\tmbarrier.arrive.shared.b64 %rd1, [%r1];", 4),
    "tid % 32 == 0, as a guard": ("\tsetp.eq.b32 %p1, %r4, 0;\n\t@%p1 mbarrier.arrive.shared.b64 %rd1, [%r1];", 4),
    "lane 0 or 1 (setp with .or)": ("\tsetp.eq.b32 %p1, %r4, 1;\n\tsetp.eq.or.b32 %p2, %r4, 0, %p1;\n"
                                    "\t@%p2 mbarrier.arrive.shared.b64 %rd1, [%r1];", 8),
    "lanes 1-31 (setp's second destination, .and)": (
        "\tsetp.ne.b32 %p1, %r3, 9;\n\tsetp.eq.and.b32 %p2|%p3, %r4, 0, %p1;\n"
        "\t@%p3 mbarrier.arrive.shared.b64 %rd1, [%r1];", 124),
    "one thread of the CTA": ("\tsetp.ne.b32 %p1, %r2, 0;\n\t@%p1 bra $L__end;\n"
                              "\tmbarrier.arrive.shared.b64 %rd1, [%r1];", 1),
    "an arrival count of 2 per elected lane": (
        "\telect.sync %r10|%p1, -1;\n\tnot.pred %p2, %p1;\n\t@%p2 bra $L__end;\n\tmov.b32 %r11, 2;\n"
        "\tmbarrier.arrive.shared.b64 %rd1, [%r1], %r11;", 8),
    "expect_tx by warp 0's elected lane, TMA bytes (no arrival)": (
        "\t@%p60 bra $L__end;\n\telect.sync %r10|%p1, -1;\n\tnot.pred %p2, %p1;\n\t@%p2 bra $L__end;\n"
        "\tmbarrier.arrive.expect_tx.shared.b64 %rd1, [%r1], 4096;\n"
        "\tcp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1+1024], "
        "[%rd2, {%r12, %r12}], [%r1];", 1),
    "tcgen05.commit by warp 1's elected lane": (
        "\tsetp.ne.b32 %p1, %r3, 1;\n\t@%p1 bra $L__end;\n\telect.sync %r10|%p2, -1;\n\tnot.pred %p3, %p2;\n"
        "\t@%p3 bra $L__end;\n\ttcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%r1];", 1),
    "cp.async.mbarrier.arrive.noinc by every thread": ("\tcp.async.mbarrier.arrive.noinc.shared.b64 [%r1];", 128),
    "cp.async.mbarrier.arrive (the pending count raised and lowered)": (
        "\tcp.async.mbarrier.arrive.shared.b64 [%r1];", 0),
}


@pytest.mark.parametrize("name", list(ARRIVERS))
def test_barrier_arrivers(name):
    """Each kind of arriver counted from the PTX: who reaches the site and what one arrival of it counts."""
    code, expected = ARRIVERS[name]
    report = barriers.analyze(_kernel(code, [(0, expected or 1)], tail=WAIT.format(offset=0)), ALL)
    assert _rows(report) == {"smem+0": (expected or 1, expected)}
    assert report.ok == (expected > 0), report.problems()


def test_barrier_wrong_count_is_flagged():
    """Negative control: the arrivals are right, the init is not; the finding names the barrier, both counts and
    who arrives."""
    code, _ = ARRIVERS["%laneid == 0"]
    report = barriers.analyze(_kernel(code.replace("[%r1]", "[%r1+8]"), [(8, 128)], tail=WAIT.format(offset=8)),
                              ALL)
    assert not report.ok and _rows(report) == {"smem+8": (128, 4)}
    (finding,) = report.findings
    assert finding.message == ("smem+8 is initialized for 128 arrivals, a phase gets 4: all (warps 0-3): arrive, "
                               "lane 0 = 4")


RING = """\tmov.b32 %r20, 0;
$L__loop:
\tshl.b32 %r21, %r20, 3;
\tadd.s32 %r22, %r1, %r21;
\tsetp.eq.b32 %p1, %r4, 0;
\t@%p1 mbarrier.arrive.shared.b64 %rd1, [%r22+8];
\tadd.s32 %r23, %r20, 1;
\tsetp.eq.b32 %p2, %r23, 3;
\tselp.b32 %r20, 0, %r23, %p2;
\tld.global.b32 %r24, [%rd2];
\tsetp.ne.b32 %p3, %r24, 0;
\t@%p3 bra $L__loop;"""


def test_barrier_ring_index():
    """``base + 8 * stage`` with a loop-carried stage: the site arrives on each barrier of the ring; an unrelated
    barrier before it gets nothing from it."""
    report = barriers.analyze(_kernel(RING, [(0, 1), (8, 4), (16, 4), (24, 4)], tail=WAIT.format(offset=0)), ALL)
    assert _rows(report)["smem+8[3]"] == (4, 4)
    assert [f.kind for f in report.findings] == ["count"]  # smem+0 is waited on, never arrived on
    assert report.findings[0].message.startswith("smem+0 is initialized for 1 arrivals, a phase gets 0")


RING_ARRIVE = "\t@%p1 mbarrier.arrive.shared.b64 %rd1, [%r22+8];\n"
NEXT_STAGE = """\tadd.s32 %r23, %r20, 1;
\tsetp.eq.b32 %p2, %r23, 3;
\tselp.b32 %r20, 0, %r23, %p2;
\tshl.b32 %r21, %r20, 3;
\tadd.s32 %r22, %r1, %r21;
"""


@pytest.mark.parametrize("between, twice", [("", True), (NEXT_STAGE, False), ("\tbar.sync \t%r4, 64;\n", False),
                                            ("\tbar.arrive \t%r4, 64;\n", True)],
                         ids=["same stage", "next stage", "named sync", "named arrive"])
def test_barrier_arrivals_in_one_phase(between, twice):
    """Two sites with the same arrivers count once (a loop's copies); one right after the other on the same stage,
    with no wait between, gives a phase both (a release repeated): a finding. A release of the next stage (the index
    advanced between, as a release lagging its wait) is not, nor one after a named barrier's sync (a wait, as the SM100
    attention's correction warps' for the softmax's factors); a named barrier's arrive does not wait."""
    ptx = _kernel(RING.replace(RING_ARRIVE, RING_ARRIVE + between + RING_ARRIVE), [(0, 1), (8, 4), (16, 4), (24, 4)],
                  tail=WAIT.format(offset=0))
    report = barriers.analyze(ptx, ALL)
    assert _rows(report)["smem+8[3]"] == (4, 4)  # what the count sees either way
    lines = [n for n, text in enumerate(ptx.splitlines(), 1) if RING_ARRIVE.strip() in text]
    assert [f.message for f in report.findings if f.kind == "twice"] == [
        f"line {lines[0]} and line {lines[1]}: the same arrivals on smem+8[3] follow one another with no wait "
        "between: one phase gets both"] * twice


N_LOADED = "\tld.global.b32 %r11, [%rd2];\n"
MIXED_PHASE = "\tadd.s32 %r12, %r2, %r11;\n\tand.b32 %r12, %r12, 1;\n"  # the thread's index and data decide it
RETRY = ("$L__retry:\n\tmbarrier.try_wait.parity.shared.b64 %p4, [%r1], %r12;\n\tnot.pred %p5, %p4;\n"
         "\t@%p5 bra {target};\n")
LANE0_ARRIVE = "\tsetp.ne.b32 %p1, %r4, 0;\n\t@%p1 bra $L__end;\n\tmbarrier.arrive.shared.b64 %rd1, [%r1];"


@pytest.mark.parametrize("code, mixed", [
    (N_LOADED + "\tsetp.ge.u32 %p3, %r2, %r11;\n\t@%p3 bra $L__end;\n" + LANE0_ARRIVE, True),  # tid < n
    (N_LOADED + "\tsetp.eq.b32 %p3, %r11, 0;\n\t@%p3 bra $L__end;\n" + LANE0_ARRIVE, False),  # n != 0: whether
    (N_LOADED + "\tsetp.ge.u32 %p3, %r2, %r11;\n\t@%p3 bra $L__end;\n" + WAIT.format(offset=0) + "\n" + LANE0_ARRIVE,
     False),  # tid < n before the wait: which loop copy runs
    (N_LOADED + MIXED_PHASE + RETRY.format(target="$L__retry") + LANE0_ARRIVE, False),  # the wait's retry loop
    (N_LOADED + MIXED_PHASE + RETRY.format(target="$L__end") + LANE0_ARRIVE, True),  # a failed test skips the arrive
], ids=["tid < n", "n != 0", "tid < n, then a wait", "retried wait", "tested once"])
def test_barrier_data_decides_arrivers(code, mixed):
    """A condition that data decides per thread (``tid < n``, n loaded) on the way to an arrive since the last wait
    decides who arrives, which the count cannot know (it takes the condition as true): a finding. A condition on
    data alone decides whether the phase happens, not who arrives. A wait retried in plain PTX (not an inline-asm
    loop) until its phase completes, on a phase the thread computed from its index and data, decides when the
    thread arrives, not whether; the same test branching past the arrive does decide who."""
    ptx = _kernel(code, [(0, 4)], tail=WAIT.format(offset=0))
    report = barriers.analyze(ptx, ALL)
    assert _rows(report) == {"smem+0": (4, 4)}
    branch = next(n for n, text in enumerate(ptx.splitlines(), 1) if re.search(r"@%p[35] bra", text))
    assert [f.message.split(": ", 2)[-1] for f in report.findings] == [
        f"who arrives depends on data that differs between threads (the condition at line {branch})"] * mixed


CLUSTER_ARRIVE = """\tsetp.ne.b32 %p1, %r3, 0;
\t@%p1 bra $L__end;
\tsetp.gt.u32 %p2, %r4, 1;
\t@%p2 bra $L__end;
\tmapa.shared::cluster.u32 %r10, %r1, %r4;
\tmbarrier.arrive.shared::cluster.b64 _, [%r10];"""

MULTICAST_COMMIT = """\tmov.u32 %r10, %cluster_ctarank;
\tsetp.ne.b32 %p1, %r10, 0;
\t@%p1 bra $L__end;
\tsetp.ne.b32 %p2, %r3, 1;
\t@%p2 bra $L__end;
\telect.sync %r11|%p3, -1;
\tnot.pred %p4, %p3;
\t@%p4 bra $L__end;
\tmov.b16 %rs1, 3;
\ttcgen05.commit.cta_group::2.mbarrier::arrive::one.shared::cluster.multicast::cluster.b64 [%r1], %rs1;"""


@pytest.mark.parametrize("code", [CLUSTER_ARRIVE, MULTICAST_COMMIT], ids=["mapa", "multicast commit"])
def test_barrier_cluster_arrivals(code):
    """Arrivals sent to other CTAs of a 2-CTA cluster: lane ``r`` of warp 0 of each CTA arrives on CTA ``r``'s
    barrier through ``mapa`` (2 a barrier); CTA 0's commit multicast to both (1 each)."""
    expected = 2 if code is CLUSTER_ARRIVE else 1
    ptx = _kernel(code, [(0, expected)], tail=WAIT.format(offset=0))
    ptx = ptx.replace("\t.reg .b64 %rd<16>;", "\t.reg .b64 %rd<16>;\n\t.reg .b16 %rs<4>;")
    report = barriers.analyze(ptx, ALL, cluster=(2, 1, 1))
    assert report.ok, report.problems()
    assert _rows(report) == {"smem+0": (expected, expected)}
    with pytest.raises(ValueError, match="CTA 1 of a 1-CTA cluster"):
        barriers.analyze(ptx, ALL)  # a cluster of one has no CTA 1


def test_barrier_unused_and_roles():
    """An initialized barrier nothing arrives on or waits for is a finding; so is an arrival from warps no declared
    role holds, and a declared role that no barrier site shows."""
    code, _ = ARRIVERS["all threads"]
    ptx = _kernel(code, [(0, 128), (8, 1)], tail=WAIT.format(offset=0))
    line = next(n for n, text in enumerate(ptx.splitlines(), 1) if "[%r1+8]" in text)
    report = barriers.analyze(ptx, ALL)
    assert [f.message for f in report.findings] == [
        f"smem+8 (line {line}, count 1): initialized, but nothing arrives on it or waits for it"]
    report = barriers.analyze(ptx, {"producers": Role((0, 1)), "idle": Role((2, 3))})
    messages = [f.message for f in report.findings]
    assert any("warps 0-3 in no declared role (producers 0-1, idle 2-3)" in m for m in messages)
    assert any(m.startswith("role producers (warps 0-1): no barrier site") for m in messages)


PINGPONG = """\tsetp.eq.b32 %p1, %r4, 0;
\tsetp.lt.u32 %p2, %r3, 2;
\t@%p2 bra $L__first;
\t@%p1 mbarrier.arrive.shared.b64 %rd1, [%r1];
\tbra.uni $L__end;
$L__first:
\t@%p1 mbarrier.arrive.shared.b64 %rd1, [%r1];"""


def test_barrier_turns():
    """Two warp groups that take the phases in turn (ping-pong): a phase has one group's arrivals, and a site that
    splits a group is a finding."""
    ptx = _kernel(PINGPONG, [(0, 2)], tail=WAIT.format(offset=0))
    assert barriers.analyze(ptx, {"mma": Role((0, 1, 2, 3), turns=2)}).ok
    report = barriers.analyze(ptx, {"mma": Role((0, 1, 2, 3))})
    assert report.findings[0].message.endswith("a phase gets 4: mma (warps 0-1): arrive, lane 0 = 2; "
                                               "mma (warps 2-3): arrive, lane 0 = 2")
    report = barriers.analyze(ptx.replace("setp.lt.u32 %p2, %r3, 2", "setp.lt.u32 %p2, %r3, 3"),
                              {"mma": Role((0, 1, 2, 3), turns=2)})
    assert [f.message.split(": ")[-1] for f in report.findings] == [
        "warp 3 split a group of mma's turns ['0-1', '2-3']", "warps 0-2 split a group of mma's turns ['0-1', '2-3']"]


# The SM100 W4 kernel's load ring as it was compiled before the fixes (kernels/qkv/w4_sm100.py): the load warp (5)
# arrives with expect_tx on the full barriers, every lane of the transform warps (6-9) reads its words of the stage
# and lane 0 of each releases it (SYNC: no bar.warp.sync between), on empty barriers initialized for 128
# (TRANSFORM_THREADS) arrivals.
W4_RING = """\tsetp.ne.b32 %p10, %r3, 5;
\t@%p10 bra $L__transform;
\tmov.b32 %r30, 0;
\tmov.b32 %r31, 1;
$L__load:
\tshl.b32 %r32, %r30, 3;
\tadd.s32 %r33, %r1, %r32;
\t// begin inline asm
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r33+24], %r31, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
\t// end inline asm
\telect.sync %r34|%p11, -1;
\tnot.pred %p12, %p11;
\t@%p12 bra $L__issued;
\tmbarrier.arrive.expect_tx.shared.b64 %rd1, [%r33], 4352;
\tcp.async.bulk.tensor.2d.shared::cta.global.tile.mbarrier::complete_tx::bytes [%r1+1024], [%rd2, {%r35, %r35}], [%r33];
$L__issued:
\tadd.s32 %r36, %r30, 1;
\tsetp.eq.b32 %p13, %r36, 3;
\tselp.b32 %r30, 0, %r36, %p13;
\tselp.b32 %r37, 1, 0, %p13;
\txor.b32 %r31, %r31, %r37;
\tld.shared.b32 %r38, [%r1+512];
\tsetp.ne.b32 %p14, %r38, 0;
\t@%p14 bra $L__load;
\tbra.uni $L__end;
$L__transform:
\tsetp.lt.u32 %p15, %r3, 6;
\t@%p15 bra $L__end;
\tmov.b32 %r40, 0;
\tmov.b32 %r41, 0;
$L__consume:
\tshl.b32 %r42, %r40, 3;
\tadd.s32 %r43, %r1, %r42;
\t// begin inline asm
\t{
\t.reg .pred P1;
\tLAB_WAIT:
\tmbarrier.try_wait.parity.shared.b64 P1, [%r43], %r41, 10000000;
\t@P1 bra.uni DONE;
\tbra.uni LAB_WAIT;
\tDONE:
\t}
\t// end inline asm
\tld.shared.v4.b32 {%r50, %r51, %r52, %r53}, [%r43+1024];
SYNC
\tsetp.ne.b32 %p16, %r4, 0;
\t@%p16 bra $L__released;
\tmov.b32 %r44, 1;
\tmbarrier.arrive.shared.b64 %rd3, [%r43+24], %r44;
$L__released:
\tadd.s32 %r45, %r40, 1;
\tsetp.eq.b32 %p17, %r45, 3;
\tselp.b32 %r40, 0, %r45, %p17;
\tselp.b32 %r46, 1, 0, %p17;
\txor.b32 %r41, %r41, %r46;
\tld.shared.b32 %r47, [%r1+516];
\tsetp.ne.b32 %p18, %r47, 0;
\t@%p18 bra $L__consume;"""

W4_ROLES = {"load": Role((5,)), "transform": Role((6, 7, 8, 9))}


def _w4_ring(empty_count: int, synced: bool) -> str:
    sync = "\tbar.warp.sync -1;\n" if synced else ""
    return _kernel(W4_RING.replace("SYNC\n", sync),
                   [(0, 1), (8, 1), (16, 1), (24, empty_count), (32, empty_count), (40, empty_count)], threads=320)


@pytest.mark.parametrize("empty_count, synced", [(128, False), (4, False), (4, True)])
def test_barrier_w4_sm100_load_ring(empty_count, synced):
    """Regression: the load ring of the SM100 W4 kernel as it was (empty barriers for 128 arrivals, 4 a phase) is
    flagged and its replay stalls: at the 4th k-block of a tile (3 stages) and, with one k-block, in the producer's
    tail. With a lane per warp (4) it accounts and replays clean; lane 0's release must follow a bar.warp.sync, as
    the other lanes read the stage too."""
    ptx = _w4_ring(empty_count, synced)
    report = barriers.analyze(ptx, W4_ROLES)
    assert _rows(report) == {"smem+0[3]": (1, 1), "smem+24[3]": (empty_count, 4)}
    (ring,) = report.rings
    assert (ring.stages, ring.full_arrivals, ring.empty_arrivals, ring.tx) == (3, 1, 4, True)
    if synced:
        assert report.ok, report.problems()
        return
    read = next(n for n, text in enumerate(ptx.splitlines(), 1) if "ld.shared.v4" in text)
    assert report.findings[-1].kind == "sync" and report.findings[-1].message.endswith(
        f"arrives for some lanes of its warps, after other lanes of them access shared memory (line {read}: "
        "ld.shared.v4.b32) with no bar.warp.sync between")
    if empty_count == 4:
        assert len(report.findings) == 1 and not report.stalls
        waived = barriers.analyze(ptx, W4_ROLES, waive=("sync",))  # a family's waiver: reported, not failed
        assert waived.ok and waived.waived == report.findings
        return
    assert [f.kind for f in report.findings] == ["count"] * 3 + ["sync"]
    assert report.findings[0].message == ("smem+24 (stage 0 of smem+24[3]) is initialized for 128 arrivals, a phase "
                                          "gets 4: transform (warps 6-9): arrive, lane 0 = 4")
    assert barriers.replay(ring, [4]).startswith("producer acquire of step 3 waits on stage 0 for parity 0")
    assert barriers.replay(ring, [3]).startswith("producer tail waits on stage 0 for parity 0")
    assert barriers.replay(ring, [1]) == ("producer tail waits on stage 0 for parity 0 (phase 0, 124 of 128 "
                                          "arrivals pending, 0 tx bytes)")
    assert len(report.stalls) == len(barriers.schedules(3)) - 1  # all but the CTA without work


def test_barrier_mbarrier_phase_rules():
    """The replay's mbarrier: a wait on parity 1 passes at init, one on 0 waits for the phase's arrivals and its
    transaction bytes; arrivals past the count belong to the next phase."""
    bar = barriers.Mbarrier(2)
    assert bar.passed(1) and not bar.passed(0)
    bar.arrive(1, expect_tx=64)
    bar.arrive(1)
    assert not bar.passed(0)  # the bytes have not landed
    bar.complete_tx(64)
    assert bar.passed(0) and not bar.passed(1) and bar.phase == 1
    bar.arrive(3)
    assert bar.phase == 2 and bar.pending == 1


def _ring(count: int, arrivals: int, stages: int = 3) -> barriers.Ring:
    full = barriers.BarrierArray(0, stages, 1, 0)
    return barriers.Ring(full, barriers.BarrierArray(8 * stages, stages, count, 0), 1, arrivals, True)


def test_barrier_replay_schedules():
    """Every schedule replays on a ring whose counts match, from no work to more one-block tiles than stages; a ring
    short of one release stalls in each schedule with work."""
    for stages in (1, 2, 3, 6):
        for name, tiles in barriers.schedules(stages).items():
            assert barriers.replay(_ring(4, 4, stages), tiles) is None, (stages, name)
            assert (barriers.replay(_ring(4, 3, stages), tiles) is None) == (tiles == []), (stages, name)


def _w4_sm100_schedules(stages: int) -> list[list[int]]:
    """What one CTA's load ring sees in the SM100 W4 kernel: the k-blocks of its persistent tiles, split-K splits
    from the kernel's own ``split_k`` / ``k_range`` (a decode step of Llama-3-8B: 3 splits of 22, 22 and 20 of its 64
    k-tiles; K of 9 k-tiles: 5 and 4), or whole tiles when the weight tiles fill the grid."""
    from cute_kv.kernels.qkv import w4_sm100

    out = []
    for w_tiles, k_tiles, ctas in ((48, 64, 148), (2, 9, 148), (48, 64, 20), (3, stages + 1, 2), (1, 1, 148)):
        splits = w4_sm100.split_k(w_tiles, k_tiles, ctas)
        tiles = w_tiles * splits
        grid = min(tiles, ctas)
        for cta in range(grid):
            out.append([k1 - k0 for k0, k1 in (w4_sm100.k_range(t % splits, splits, k_tiles)
                                               for t in range(cta, tiles, grid))])
    return out


def _attention_schedules() -> list[list[int]]:
    """What one CTA's K/V ring sees in the attention kernels: the tiles of its split-KV split (``plan_replay``, the
    host model of ``block_info.split_tiles``; a decode row, 128-key tiles), splits of one tile or none included."""
    return [[plan_replay.cta_tiles(0, 128, 4, 1, cache_len, 1, 0, 128, split, splits)[3]]
            for cache_len, splits in ((0, 1), (100, 4), (300, 3), (5000, 2)) for split in range(splits)]


@pytest.mark.compile
@pytest.mark.parametrize("family", ["fused_qkv_gemm_w4_100", "paged_attention_sm100"])
def test_barrier_replay_kernel_splits(family):
    """The rings of an SM100 W4 and an SM100 attention kernel, with the counts their PTX gives, replay the work a CTA
    of theirs sees: split-K splits of unequal length (the last finishing early) or several whole tiles, split-KV
    splits of one tile or none."""
    config = next(c for c in catalog.configs() if c.family.name == family)
    report = barriers.analyze_config(config, *_compiled(config))
    assert report.ok, report.problems()
    assert report.rings
    for ring in report.rings:
        if family == "fused_qkv_gemm_w4_100":
            work = _w4_sm100_schedules(ring.stages)
            assert {(22,), (20,), (5,), (4,), (1,), (64, 64), (ring.stages + 1,) * 2} <= set(map(tuple, work))
        else:
            work = _attention_schedules()
            assert {(0,), (1,), (20,)} <= set(map(tuple, work))
        for tiles in work:
            assert barriers.replay(ring, tiles) is None, (ring, tiles)


def _compiled(config) -> tuple[str, str]:
    """The PTX and host IR of a catalog configuration (compiled once per run, shared with the SASS gate)."""
    return artifacts.compiled(config.kernel(), config.arch)


@pytest.mark.compile
@pytest.mark.parametrize("config", catalog.configs(), ids=lambda c: c.id)
def test_barrier_accounting(config):
    """Every catalog configuration: each mbarrier's init count equals the arrivals a phase gets from the threads the
    PTX lets reach each arrive (warps of the family's declared roles), no barrier is initialized for nothing, the
    arrivals are ordered (``Analysis.ordering``), and every producer/consumer ring replays without a stall."""
    report = barriers.analyze_config(config, *_compiled(config))
    assert report.ok, report.problems()
    if config.family.roles(config.kernel()):
        assert report.rows and all(r.per_phase == r.count for r in report.rows)
    # a family's waivers name what its library code gives (catalog), no more
    assert {f.kind for f in report.waived} == set(config.family.barrier_waivers), report.problems()
