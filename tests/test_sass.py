"""The static gate: every kernel configuration of ``cute_kv.kernels.catalog`` assembled with ``ptxas -v`` and
disassembled: no spills, registers within the plan's budget, shared memory equal to the plan, the CTAs per SM it
claims. Plus the parsers of perf/static.py on fixed text."""

import os
import subprocess
import sys

import pytest

import artifacts
from cute_kv.kernels import catalog

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)

import static  # noqa: E402

needs_tools = pytest.mark.skipif(static.tools_available() is not None, reason=str(static.tools_available()))

# Open defects the gate found, by configuration id: the test fails (strict) once one is fixed, so the entry goes.
KNOWN = {
    "paged_kv_store[float32-1-64-1-576-64]-sm_90a": "168 registers: 3 CTAs per SM, the plan claims 4",
    "paged_kv_store[float32-1-64-1-576-64]-sm_100a": "168 registers: 3 CTAs per SM, the plan claims 4",
    "paged_kv_store[float32-1-64-1-576-64]-sm_103a": "168 registers: 3 CTAs per SM, the plan claims 4",
}


def _params():
    known = {c: [pytest.mark.xfail(reason=why, strict=True)] for c, why in KNOWN.items()}
    return [pytest.param(c, id=c.id, marks=known.get(c.id, [])) for c in catalog.configs()]


@pytest.mark.sass
@pytest.mark.compile
@needs_tools
@pytest.mark.parametrize("config", _params())
def test_kernel_resources_match_plan(config):
    rec = static.analyze_config(config, compiled=artifacts.compiled)
    assert rec["spill_stores"] == 0 and rec["spill_loads"] == 0, rec
    assert rec["stack"] == 0 and rec["local_loads"] == rec["local_stores"] == 0, rec  # no local-memory arrays
    assert rec["threads"] == rec["plan_threads"]
    assert rec["registers"] <= rec["register_budget"], rec
    if rec["plan_smem"] is not None:
        assert rec["smem"] == rec["plan_smem"], rec  # static (ptxas) + dynamic (what the launch passes)
    assert rec["ctas_per_sm"] >= rec["plan_ctas_per_sm"], rec
    if rec["mma"]:
        assert rec["loop_mma"] > 0  # the main loop found is the one issuing the MMAs
    if config.family.name == "paged_attention_sm100":  # a QK issued before each wait for a softmax's P
        assert (rec["mma_in_flight"] or 0) >= 1, rec["loop_mma_order"]


@pytest.mark.sass
@pytest.mark.compile
@needs_tools
def test_sm100_attention_mma_in_flight():
    """Two Q tiles at D = 128 in pages of 128: the MMA warp's loop runs a Q tile's PV, once its P is written, then
    that tile's QK of the next key tile (``PV(j-1, t), QK(j, t)``), so each wait for P comes after a QK of the other
    tile: one S tile for the tensor core while a softmax warpgroup works."""
    (config,) = [c for c in catalog.configs() if c.family.name == "paged_attention_sm100" and c.arch == "sm_100a"
                 and c.case == ("bfloat16", 32, 8, 128, 128, 2, True)]
    assert config.kernel().q_tiles == 2
    rec = static.analyze_config(config, compiled=artifacts.compiled)
    assert (rec["loop_mma_order"], rec["loop_qk_groups"], rec["loop_p_barriers"], rec["mma_in_flight"]) == (
        "w PV w QK", 1, 2, 1)


# PagedAttentionSm100 per S tile (bf16, 32 q / 8 KV heads, pages of 128; prefill: two Q tiles, decode: one), at most
# today's figures (``static.analyze``; correction: O rescaled / rescale skipped, per S tile). FA4 4.0.0b36's SM100
# forward beside it (``perf/run.py static``), which these stay at or below: at D = 128 a softmax loop of 514 (prefill)
# and 559 (decode), MUFU.EX2 113 (16 of the 128 exponentials emulated with FMAs) and 105 (24), a masked loop of 687
# (its decode masks outside a loop), a correction loop of 91 / 10 and 118 / 28; at D = 64 514 and 526, MUFU.EX2 113
# and 113, masked 687, correction 51.5 / 10.5 and 78 / 28.
SM100_TILE_BUDGETS = {
    ("prefill", 128): dict(softmax_loop_instructions=498, softmax_loop_ex2=113, masked_loop_instructions=634,
                           correction_loop_instructions=89.5, correction_loop_instructions_skip=8.5),
    ("decode", 128): dict(softmax_loop_instructions=534, softmax_loop_ex2=105, masked_loop_instructions=637,
                          correction_loop_instructions=108, correction_loop_instructions_skip=18),
    ("prefill", 64): dict(softmax_loop_instructions=498, softmax_loop_ex2=113, masked_loop_instructions=634,
                          correction_loop_instructions=51.5, correction_loop_instructions_skip=8.5),
    ("decode", 64): dict(softmax_loop_instructions=534, softmax_loop_ex2=105, masked_loop_instructions=637,
                         correction_loop_instructions=70, correction_loop_instructions_skip=18),
}
FA4_SM100 = {  # (softmax loop + correction loop, its skip path) of FA4 4.0.0b36, from the figures above
    ("prefill", 128): (514 + 91, 514 + 10), ("decode", 128): (559 + 118, 559 + 28),
    ("prefill", 64): (514 + 51.5, 514 + 10.5), ("decode", 64): (526 + 78, 526 + 28),
}


@pytest.mark.sass
@pytest.mark.compile
@needs_tools
@pytest.mark.parametrize("mode, tokens, q_tiles", [("prefill", 2048, 2), ("decode", 1, 1)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sm100_attention_tile_budgets(mode, tokens, q_tiles, head_dim):
    (family,) = [f for f in catalog.FAMILIES if f.name == "paged_attention_sm100"]
    config = catalog.Config(family, family.peer_case(head_dim, 128, tokens), "sm_100a")
    assert config.kernel().q_tiles == q_tiles
    rec = static.analyze_config(config, compiled=artifacts.compiled)
    assert rec["spill_stores"] == rec["spill_loads"] == 0, rec
    over = {k: (rec[k], budget) for k, budget in SM100_TILE_BUDGETS[mode, head_dim].items() if rec[k] > budget}
    assert not over, over
    # a tile's 128 exponentials of a row and its correction factor, on one pipe or the other: 16 emulated at two Q
    # tiles, 24 at one, 4 in the masked loop (``sm100_config.EXP2_EMULATION``)
    for loop in ("softmax_loop", "masked_loop"):
        assert rec[f"{loop}_ex2"] + rec[f"{loop}_ex2_emulated"] == 129, rec
    assert (rec["softmax_loop_ex2_emulated"], rec["masked_loop_ex2_emulated"]) == ({2: 16, 1: 24}[q_tiles], 4)
    assert rec["correction_loop_s_tiles"] == q_tiles  # both Q tiles' O rescaled in one iteration
    softmax = rec["softmax_loop_instructions"]
    both = (softmax + rec["correction_loop_instructions"], softmax + rec["correction_loop_instructions_skip"])
    assert all(ours <= fa4 for ours, fa4 in zip(both, FA4_SM100[mode, head_dim])), (both, FA4_SM100[mode, head_dim])


def test_ex2_emulated_and_correction_loop_on_fixed_sass():
    """Emulated exp2 are the rounded-down adds of the floor step (two for f32x2); the correction loop is the
    innermost loop storing to tensor memory without MUFU.EX2, counted without its nested zero-fill loop: the rescale
    way, and the longest way that stores nothing."""
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x18], R0 ;
        /*0020*/              @!P0 BRA `(.L_x_9) ;
        /*0030*/                   MUFU.EX2 R3, R3 ;
        /*0040*/                   FADD2.RM R16, R52.F32x2.HI_LO, 12582912 ;
        /*0050*/                   FADD.FTZ.RM R17, R53, 12582912 ;
        /*0060*/                   FFMA.RM R18, R2, R7, R5 ;
        /*0070*/                   STTM.x32 tmem[UR4], R4 ;
        /*0080*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x28], R0 ;
        /*00a0*/              @!P0 BRA `(.L_x_10) ;
        /*00b0*/               @P2 BRA `(.L_x_3) ;
.L_x_2:
        /*00c0*/                   STS.128 [R4], RZ ;
        /*00d0*/                   IADD3 R4, PT, PT, R4, 0x400, RZ ;
        /*00e0*/               @P3 BRA `(.L_x_2) ;
.L_x_3:
        /*00f0*/                   MEMBAR.ALL.CTA ;
        /*0100*/               @P4 BRA `(.L_x_4) ;
        /*0110*/                   LDTM.x32 R36, tmem[UR6] ;
        /*0120*/                   FMUL2 R36, R36.F32x2.HI_LO, R72.F32 ;
        /*0130*/                   STTM.x32 tmem[UR6], R36 ;
        /*0140*/                   LDTM.x32 R36, tmem[UR6+0x20] ;
        /*0150*/                   FMUL2 R36, R36.F32x2.HI_LO, R72.F32 ;
        /*0160*/                   STTM.x32 tmem[UR6+0x20], R36 ;
.L_x_4:
        /*0170*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR8+0x48], RZ ;
        /*0180*/               @P5 BRA `(.L_x_1) ;
        /*0190*/                   EXIT ;
.L_x_9:
        /*01a0*/                   BRA `(.L_x_0) ;
.L_x_10:
        /*01b0*/                   BRA `(.L_x_1) ;
"""
    instrs, labels = static.parse_sass(sass)
    lps = static.loops(instrs, labels)
    softmax = static.softmax_loop(lps)
    assert (softmax.start, softmax.ex2, softmax.ex2_emulated) == (0x10, 1, 3)
    corr = static.correction_loop(lps)
    # rescale: 0x90-0xb0 (the zero fill's loop left out), 0xf0-0x100, 0x110-0x160, 0x170-0x180
    assert (corr.start, corr.steady, corr.steady_columns) == (0x90, (3 + 2 + 6 + 2, 3 + 2 + 2), 64)
    assert static.masked_loop(lps) is None


def _sm90_load_configs():
    return [pytest.param(c, id=c.id) for c in catalog.configs() if c.family.name == "paged_attention_sm90"
            and (c.kernel().gather or (c.kernel().page_size and not c.kernel().kv_fp8))]


@pytest.mark.sass
@pytest.mark.compile
@needs_tools
@pytest.mark.parametrize("config", _sm90_load_configs())
def test_sm90_attention_load_loop_copies_per_tile(config):
    """The SM90 attention's producer loop, found in its SASS: per key tile one TMA per page slot and swizzle row (K's
    and V's own widths) for K and for V (one elected thread), or, with rows gathered, each producer thread's cp.async
    (16 bytes a row piece) for K and for V; either way the copies of a tile move its K and V (``BN * (D + D_v) * 2``
    bytes) once."""
    kernel = config.kernel()
    rec = static.analyze_config(config, compiled=artifacts.compiled)
    tile_bytes = kernel.bn * (kernel.head_dim + kernel.v_dim) * 2
    if kernel.gather:
        assert rec["load_loop_copies"] == 2 * kernel.gather.passes
        assert rec["load_loop_copies"] * 16 * 128 == tile_bytes  # 16 bytes a copy, 128 producer threads
    else:
        boxes = [dim * 2 // sw for dim, sw in zip((kernel.head_dim, kernel.v_dim), kernel.load_swizzles)]
        # the lean producer's loop: one swizzle row of boxes (K's or V's), as many passes as the tile's rows have
        assert rec["load_loop_copies"] == kernel.k_op.copies_per_tile * (1 if kernel.box_loop else sum(boxes))
        box_bytes = sum(n * sw for n, sw in zip(boxes, kernel.load_swizzles)) * kernel.k_op.rows_per_copy
        assert kernel.k_op.copies_per_tile * box_bytes == tile_bytes


# SM90 attention's main-loop instructions per 64 x 64 block of S (``static.analyze``) at the head dims of wide
# values, where the key tile is FA4's (112 keys at 192, 80 at 256): at most these, measured, on the catalog's
# configurations and on the shape set beside FA4 (``peer_case``: 32 q / 8 KV heads, pages of 128, decode). FA4
# 4.0.0b36's forward takes 288.6 and 384.0 causal, 264.0 and 350.4 not (``perf/run.py static``, bf16): at or below
# FA4 on all of them.
S_BLOCK_BUDGETS = {192: 258.3, 256: 344.0}
FA4_S_BLOCK = {192: 264.0, 256: 350.4}
# the masked loop (branchless masks) per key tile: at most these, measured; FA4's causal prefill takes 569 and 521
MASKED_BUDGETS = {192: 565, 256: 525}


def _wide_attention_configs():
    (family,) = [f for f in catalog.FAMILIES if f.name == "paged_attention_sm90"]
    peers = [catalog.Config(family, family.peer_case(d, 128, 1), "sm_90a") for d in S_BLOCK_BUDGETS]
    return [pytest.param(c, id=c.id) for c in catalog.configs() + peers if c.family.name == "paged_attention_sm90"
            and c.kernel().head_dim in S_BLOCK_BUDGETS and c.kernel().v_dim == c.kernel().head_dim
            and c.kernel().bn != 64]


@pytest.mark.sass
@pytest.mark.compile
@needs_tools
@pytest.mark.parametrize("config", _wide_attention_configs())
def test_sm90_attention_instructions_per_s_block(config):
    kernel = config.kernel()
    rec = static.analyze_config(config, compiled=artifacts.compiled)
    assert rec["spill_stores"] == rec["spill_loads"] == 0, rec
    assert rec["instructions_per_s_block"] <= S_BLOCK_BUDGETS[kernel.head_dim], rec
    assert rec["masked_loop_instructions"] <= MASKED_BUDGETS[kernel.head_dim], rec
    assert rec["instructions_per_s_block"] <= FA4_S_BLOCK[kernel.head_dim], rec


def test_sm90_attention_wide_budgets_cover_a_config():
    """The budgets above gate a catalog configuration of each head dim (a 16-bit cache in TMA page slots)."""
    configs = [c.values[0] for c in _wide_attention_configs()]
    assert {c.kernel().head_dim for c in configs if c in catalog.configs()} == set(S_BLOCK_BUDGETS)


def test_load_loop_on_fixed_sass():
    """The load loop is the innermost loop without MMAs issuing global-to-shared copies (cp.async, TMA), counted on
    its fast path."""
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x18], R0 ;
        /*0020*/              @!P0 BRA `(.L_x_2) ;
        /*0030*/                   SHFL.IDX PT, R3, R2, RZ, 0x101f ;
        /*0040*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64] ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R5+0x80], desc[UR4][R8.64] ;
        /*0060*/                   ARRIVES.LDGSTSBAR.64 [UR8] ;
        /*0070*/               @P1 BRA `(.L_x_0) ;
.L_x_1:
        /*0080*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;
        /*0090*/               @P2 BRA `(.L_x_1) ;
        /*00a0*/                   EXIT ;
.L_x_2:
        /*00b0*/                   BRA `(.L_x_0) ;
"""
    instrs, labels = static.parse_sass(sass)
    lp = static.load_loop(static.loops(instrs, labels))
    # the wait's retry (0xb0) branches back to the header: a slow path of the loop, off its count
    assert (lp.start, lp.end, lp.copies_in, lp.instructions) == (0x10, 0xb0, 2, 7)


def test_catalog_ids_are_unique_and_known_defects_exist():
    ids = [c.id for c in catalog.configs()]
    assert len(ids) == len(set(ids))
    assert set(KNOWN) <= set(ids)


def test_register_budget_keeps_the_claimed_ctas():
    plan = catalog.Plan(threads=128, smem=0, ctas_per_sm=4)
    assert plan.register_budget == 128
    assert static.occupancy(plan.register_budget, 128, 0)["ctas_by_regs"] == 4
    assert static.occupancy(plan.register_budget + 1, 128, 0)["ctas_by_regs"] == 3
    assert catalog.Plan(128, 0, 1).register_budget == 255


def test_occupancy_rules():
    # 168 registers x 384 threads (FA4 SM90): 5376 per warp, 12 warps of 12 fit in 64K -> 1 CTA.
    assert static.occupancy(168, 384, 200 * 1024)["ctas_per_sm"] == 1
    # 146 registers -> 152 per thread allocated (4864 per warp): 13 warps -> 3 CTAs of 4 warps.
    assert static.occupancy(146, 128, 0)["ctas_by_regs"] == 3
    # Shared memory: 1 KiB reserved per CTA, 128-byte allocation steps; above 227 KiB nothing launches.
    assert static.occupancy(32, 128, 111408)["ctas_by_smem"] == 2
    assert static.occupancy(32, 128, 113 * 1024)["ctas_by_smem"] == 2  # exactly half of 228 KiB with the reserve
    assert static.occupancy(32, 128, 113 * 1024 + 1)["ctas_by_smem"] == 1
    assert static.occupancy(32, 128, 227 * 1024 + 1)["ctas_per_sm"] == 0
    assert static.occupancy(16, 64, 0)["ctas_per_sm"] == 32  # the CTA limit
    assert static.occupancy(32, 1024, 0)["ctas_by_threads"] == 2


def test_parse_ptxas():
    log = ("ptxas info    : Used 168 registers, used 16 barriers, 1024 bytes smem\n"
           "    16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n")
    r = static.parse_ptxas(log)
    assert (r.registers, r.barriers, r.static_smem, r.stack, r.spill_stores, r.spill_loads) == (168, 16, 1024, 16,
                                                                                                 8, 12)
    r = static.parse_ptxas("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\nUsed 26 registers\n")
    assert (r.registers, r.barriers, r.static_smem) == (26, 0, 0)
    with pytest.raises(ValueError, match="ptxas"):
        static.parse_ptxas("nothing")


SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   IMAD.MOV.U32 R2, RZ, RZ, R4 ;
.L_x_1:
        /*0020*/                   HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], RZ, !UPT ;
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0040*/              @!P0 BRA `(.L_x_4) ;
.L_x_5:
        /*0050*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R3 ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
.L_x_6:
        /*0070*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR5], R3 ;
        /*0080*/              @!P1 BRA `(.L_x_6) ;
.L_x_2:
        /*0090*/                   HGMMA.64x128x16.F32.BF16 R24, R88, gdesc[UR12], R24, gsb0 ;
        /*00a0*/                   MUFU.EX2 R5, R5 ;
        /*00b0*/                   LDS.128 R8, [R2] ;
        /*00c0*/                   STS.128 [R2], R8 ;
        /*00d0*/                   BAR.SYNC.DEFER_BLOCKING 0x1, 0x100 ;
        /*00e0*/               @P2 BRA `(.L_x_1) ;
        /*00f0*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT ;
        /*0100*/               @P3 BRA `(.L_x_0) ;
        /*0110*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0120*/                   EXIT ;
.L_x_4:
        /*0130*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3 ;
        /*0140*/              @!P0 BRA `(.L_x_4) ;
        /*0150*/                   BRA `(.L_x_5) ;
.L_x_3:
        /*0160*/                   BRA `(.L_x_3);
"""


def test_sass_loops_and_counts():
    """Loops come from the control-flow graph: a wait's retry moved past the function's end (0x130, branching back
    into the body at 0x50) is a loop of its own but makes no loop of [0x50, 0x150] the way an address range would;
    code the entry does not reach (0x160) is an entry of its own. The main loop's count is its fast path: the
    out-of-line retry and the second try after a first that succeeded (0x70, FA4's form) are left out."""
    instrs, labels = static.parse_sass(SASS)
    assert len(instrs) == 23 and labels[".L_x_4"] == 0x130 and labels[".L_x_5"] == 0x50
    assert instrs[4].guard == "!P0" and instrs[0].guard == ""
    assert [static.is_mma(i.opcode) for i in instrs].count(True) == 3  # two HGMMA, one tcgen05
    all_loops = static.loops(instrs, labels)
    # the loop over work tiles, the main loop, the two retries, the trailing self-branch
    assert sorted((lp.start, lp.end) for lp in all_loops) == [(0x10, 0x100), (0x20, 0xe0), (0x70, 0x80),
                                                              (0x130, 0x140), (0x160, 0x160)]
    main = static.main_loop(all_loops)  # the innermost loop with MMAs, not the one with the most
    assert (main.start, main.end, main.instructions, main.mma, main.ex2, main.lds, main.sts, main.barrier_waits,
            main.cta_barriers, main.named_barriers, main.shortest) == (0x20, 0xe0, 11, 2, 1, 1, 1, 3, 0, 1, 11)
    assert main.blocks == {0x20, 0x50, 0x70, 0x90, 0x130, 0x150}  # the slow paths belong to it, uncounted
    assert [static.is_cta_barrier(i) for i in instrs].count(True) == 1  # barrier 0, no count: __syncthreads
    assert main.mma_flops == 2 * 64 * 64 * 16 + 2 * 64 * 128 * 16
    assert static.softmax_loop(all_loops) == main


def test_mma_in_flight():
    """The MMA warp's loop as waits and MMA groups (a group starts at an MMA whose accumulate operand is not UPT; A in
    tensor memory: PV), the P barriers it waits on (an address the loop changes each iteration, a slot index it
    carries, is two) and the QK groups issued between two waits for P, at most one less than the P barriers. Ours:
    a Q tile's PV, then its next QK, the slot alternating; the same loop on one slot (FA4's one Q tile without its S
    ping-pong): the QK before the wait is the one whose P it waits for, 0. FA4's two Q tiles (a wait for the last part
    of P inside each PV group) and its S ping-pong; a loop that waits for both tiles' P before its QKs: 0."""
    sass = """
.L_x_0:
        /*0000*/                   ULEA UR15, UR12, UR7, 0x3 ;
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15+0x48], R4 ;
        /*0020*/              @!P0 BRA `(.L_x_1) ;
.L_x_4:
        /*0030*/                   UTCHMMA tmem[UR6], gdesc[UR8], tmem[UR4], tmem[UR54], idesc[UR55], UR44, UP0 ;
        /*0040*/                   UTCHMMA tmem[UR30], gdesc[UR16], tmem[UR4], tmem[UR38], idesc[UR39], UR44, UPT ;
        /*0050*/                   UTCBAR [UR34], URZ ;
        /*0060*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4+0x8], R4 ;
        /*0070*/              @!P0 BRA `(.L_x_2) ;
        /*0080*/                   UTCHMMA gdesc[UR8], gdesc[UR10], tmem[UR6], tmem[UR52], idesc[UR53], UR40, !UPT ;
        /*0090*/                   UTCHMMA gdesc[UR22], gdesc[UR26], tmem[UR6], tmem[UR68], idesc[UR69], UR40, UPT ;
        /*00a0*/                   UTCBAR [UR15], URZ ;
        /*00b0*/                   ULOP3.LUT UR12, UR12, 0x1, URZ, 0x3c, !UPT ;
        /*00c0*/               @P1 BRA `(.L_x_0) ;
        /*00d0*/                   EXIT ;
.L_x_1:
        /*00e0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R0+URZ+0x48], R4 ;
        /*00f0*/              @!P0 BRA `(.L_x_1) ;
        /*0100*/                   BRA `(.L_x_4) ;
.L_x_2:
        /*0110*/                   BRA `(.L_x_2) ;
"""
    instrs, labels = static.parse_sass(sass)
    lp = static.main_loop(static.loops(instrs, labels))
    assert (lp.mma, lp.mma_order, lp.p_barriers) == (4, "w PV w QK", 2)  # the retry's wait (0xe0) is no site
    assert static.mma_in_flight(lp.mma_order, lp.p_barriers) == 1
    one_slot = sass.replace("ULOP3.LUT UR12, UR12", "ULOP3.LUT UR13, UR12")
    instrs, labels = static.parse_sass(one_slot)
    lp = static.main_loop(static.loops(instrs, labels))
    assert (lp.mma_order, lp.p_barriers, static.mma_in_flight(lp.mma_order, lp.p_barriers)) == ("w PV w QK", 1, 0)
    assert static.mma_in_flight("w w PV w w QK w PV w QK", 2) == 1  # FA4, two Q tiles
    assert static.mma_in_flight("w QK w w PV w", 2) == 1  # FA4's S ping-pong, one Q tile
    assert static.mma_in_flight("w PV w PV w QK QK", 2) == 0  # blocks on the second P with no QK since the first
    assert static.mma_in_flight("w QK QK", 2) is None  # no PV: not an attention MMA loop
    assert static.mma_in_flight("QK PV", 2) is None  # no wait for P in the loop


def test_wait_branches():
    """A branch on a try-wait's predicate: guarded by its negation it goes to the retry (the fall-through is the
    success way); guarded by it, past the retry. A branch on a predicate something else wrote since is data."""
    instrs, labels = static.parse_sass(SASS)
    cfg = static.blocks(instrs, labels)
    assert cfg[0x20].succs == [(0x130, True), (0x50, False)]
    assert cfg[0x50].succs == [(0x90, False), (0x70, True)]
    assert cfg[0x90].succs == [(0x20, False), (0xf0, False)]
    isetp = "        /*0058*/                   ISETP.NE.AND P1, PT, R2, RZ, PT ;\n"
    data = SASS.replace("        /*0060*/               @P1 BRA", isetp + "        /*0060*/               @P1 BRA")
    instrs, labels = static.parse_sass(data)
    assert static.blocks(instrs, labels)[0x50].succs == [(0x90, False), (0x70, False)]
    lp = static.main_loop(static.loops(instrs, labels))
    assert (lp.instructions, lp.shortest) == (3 + 3 + 2 + 6, 3 + 3 + 6)  # a data branch: the longest and shortest way


def test_indirect_branch_targets_are_entries():
    """A switch over warp roles compiles to ``BRX`` through a jump table the SASS does not show: the blocks no branch
    names are entries of their own, so a role's loop is still found."""
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   BRX R2 -0x20 ;
.L_x_0:
        /*0020*/                   EXIT ;
.L_x_1:
        /*0030*/                   UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT ;
        /*0040*/               @P0 BRA `(.L_x_1) ;
        /*0050*/                   EXIT ;
"""
    instrs, labels = static.parse_sass(sass)
    main = static.main_loop(static.loops(instrs, labels))
    assert (main.start, main.end, main.instructions, main.mma) == (0x30, 0x40, 2, 1)


def test_launch_from_host_ir():
    struct = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
    ir = "\n".join([
        "  llvm.func @launch() {",
        "    %9 = llvm.mlir.constant(111408 : i64) : i64",
        "    %18 = llvm.mlir.constant(1 : i32) : i32",
        "    %19 = llvm.mlir.constant(128 : i32) : i32",
        *(f"    %{20 + i} = llvm.getelementptr %7[0, 1, {i}] : (!llvm.ptr) -> !llvm.ptr, {struct}" for i in range(3)),
        f"    %30 = llvm.getelementptr %7[0, 2] : (!llvm.ptr) -> !llvm.ptr, {struct}",
        "    llvm.store %19, %20 : i32, !llvm.ptr",
        "    llvm.store %18, %21 : i32, !llvm.ptr",
        "    llvm.store %18, %22 : i32, !llvm.ptr",
        "    llvm.store %9, %30 : i64, !llvm.ptr",
    ])
    assert static.launch_from_host_ir(ir) == static.Launch(threads=128, dynamic_smem=111408, cluster=(1, 1, 1))
    with pytest.raises(ValueError, match="launch"):
        static.launch_from_host_ir(ir.replace("%9, %30", "%arg3, %30"))
    # a cluster-dimension launch attribute (id 4) of (2, 1, 1), as quack's 2-CTA GEMMs pass; other attributes pass by
    attr, dim3 = "!llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>", "!llvm.struct<(i32, i32, i32)>"
    ir += "\n" + "\n".join([
        "    %40 = llvm.mlir.constant(4 : i32) : i32",
        "    %41 = llvm.mlir.constant(2 : i32) : i32",
        "    %42 = llvm.mlir.constant(6 : i32) : i32",
        f"    %50 = llvm.getelementptr %49[0, 0] : (!llvm.ptr) -> !llvm.ptr, {attr}",
        "    llvm.store %42, %50 : i32, !llvm.ptr",
        f"    %51 = llvm.getelementptr %49[0, 2] : (!llvm.ptr) -> !llvm.ptr, {attr}",
        f"    %52 = llvm.getelementptr %51[0, 0] : (!llvm.ptr) -> !llvm.ptr, {dim3}",
        "    llvm.store %41, %52 : i32, !llvm.ptr",
        f"    %60 = llvm.getelementptr %59[0, 0] : (!llvm.ptr) -> !llvm.ptr, {attr}",
        "    llvm.store %40, %60 : i32, !llvm.ptr",
        f"    %61 = llvm.getelementptr %59[0, 2] : (!llvm.ptr) -> !llvm.ptr, {attr}",
        *(f"    %{62 + i} = llvm.getelementptr %61[0, {i}] : (!llvm.ptr) -> !llvm.ptr, {dim3}" for i in range(3)),
        "    llvm.store %41, %62 : i32, !llvm.ptr",
        "    llvm.store %18, %63 : i32, !llvm.ptr",
        "    llvm.store %18, %64 : i32, !llvm.ptr",
    ])
    assert static.launch_from_host_ir(ir).cluster == (2, 1, 1)


@pytest.mark.sass
@needs_tools
def test_fa4_sm90_forward_through_the_same_analysis():
    """FA4's SM90 forward compiled on the CPU (its own process) gives a full record: 12 warps, HGMMAs in the main
    loop, no spills."""
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:  # not imported here: quack needs the stubbed triton
        pytest.skip("flash-attn-4 not installed (pip install -e '.[peers]')")
    done = subprocess.run([sys.executable, os.path.join(PERF, "static_peers.py"), "--arch", "sm_90a",
                           "--head-dims", "128", "--page-sizes", "64", "--modes", "decode"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    (rec,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert rec["impl"] == "fa4" and rec["threads"] == 384 and rec["spill_stores"] == 0
    assert rec["loop_mma"] > 0 and rec["instructions_per_s_block"] > 0 and rec["ctas_per_sm"] >= 1


def test_ptx_facts():
    ptx = ("\tsetmaxnreg.dec.sync.aligned.u32 \t40;\n\tsetmaxnreg.inc.sync.aligned.u32 \t224;\n"
           "\tmov.b32 \t%r586, 512;\n\ttcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 \t[%r3+216], %r586;\n")
    assert static.ptx_facts(ptx) == {"setmaxnreg": [40, 224], "tmem_columns": 512}
    assert static.ptx_facts("ld.global.v4.b32") == {"setmaxnreg": []}


def test_tcgen05_mmas():
    # The DSL builds a descriptor by or/selp of immediates (M=128 N=32 bf16 K-major; the selp bits are negations),
    # nvcc moves one (FlashMLA's weight-stationary M=64 N=128, A in TMEM); cta_group::2 M=128 N=256 with B
    # MN-major: the pair's M.
    ptx = ("\tselp.b32 \t%r678, 16384, 0, %p2;\n\tselp.b32 \t%r679, 134751376, 134743184, %p1;\n"
           "\tor.b32 \t%r324, %r679, %r678;\n"
           "\ttcgen05.mma.cta_group::1.kind::f16.collector::a::discard [%r322], %rd43, %rd297, %r324, "
           "{%r682, %r683, %r684, %r685}, %p198;\n"
           "\tmov.b32 \t%r1318, 69207184;\n"
           "\ttcgen05.mma.ws.cta_group::1.kind::f16 [%r1316], [%r1246], %rd332, %r1318, p, 0;\n"
           f"\tmov.b32 \t%r9, {(8 << 24) | (32 << 17) | (1 << 16) | 0x490};\n"
           "\ttcgen05.mma.cta_group::2.kind::f16 [%r8], %rd1, %rd2, %r9, p;\n")
    mmas = static.tcgen05_mmas(ptx)
    assert mmas == [static.Tcgen05Mma(128, 32, 16, 1, False, False, False),
                    static.Tcgen05Mma(64, 128, 16, 1, True, True, False),
                    static.Tcgen05Mma(128, 256, 16, 2, False, False, True)]
    assert [m.flops for m in mmas] == [2 * 128 * 32 * 16, 2 * 64 * 128 * 16, 2 * 128 * 256 * 16]
    with pytest.raises(ValueError, match="several shapes"):  # alternatives naming two N
        static.tcgen05_mmas("\tselp.b32 \t%r1, 134743184, 134874256, %p1;\n"
                            "\ttcgen05.mma.cta_group::1.kind::f16 [%r2], %rd1, %rd2, %r1, p;\n")
    # Registers are per function: two kernels issuing MMAs are told apart by name.
    two = ".visible .entry first(\n" + ptx + "}\n.visible .entry second(\n" + ptx.replace("69207184", "69338256")
    with pytest.raises(ValueError, match="several functions"):
        static.tcgen05_mmas(two)
    assert static.tcgen05_mmas(two, "second")[1] == static.Tcgen05Mma(64, 136, 16, 1, True, True, False)
    assert static.tcgen05_mmas(two, "first") == mmas
    with pytest.raises(ValueError, match="cannot resolve"):  # a descriptor loaded from memory
        static.tcgen05_mmas("\tld.shared.b32 \t%r1, [%r5];\n\ttcgen05.mma.cta_group::1.kind::f16 [%r2], %rd1, "
                            "%rd2, %r1, p;\n")


def _sm103a_twins():
    """Each sm_103a configuration with its sm_100a twin (same family and case)."""
    by = {(c.family.name, c.case, c.arch): c for c in catalog.configs()}
    return [pytest.param(c, by[(c.family.name, c.case, "sm_100a")], id=c.id) for c in catalog.configs()
            if c.arch == "sm_103a"]


@pytest.mark.compile
@pytest.mark.parametrize("config,twin", _sm103a_twins())
def test_sm103a_ptx_is_the_sm100a_ptx(config, twin):
    """The Blackwell kernels compile to the same PTX for sm_103a as for sm_100a but for the ``.target`` line, so what
    the simulator runs for sm_100a (``selftest --simulate --arch sm_100a``) is what sm_103a gets too."""
    ptx = {c.arch: artifacts.compiled(c.kernel(), c.arch).ptx for c in (config, twin)}
    lines = {arch: p.splitlines() for arch, p in ptx.items()}
    assert len(lines["sm_103a"]) == len(lines["sm_100a"])
    diff = [(a, b) for a, b in zip(lines["sm_103a"], lines["sm_100a"]) if a != b]
    assert diff == [(".target sm_103a", ".target sm_100a")], diff[:5]
