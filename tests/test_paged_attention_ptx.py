"""``PagedAttention`` compiled for sm_90a from fake tensors (no GPU): the pipeline it claims, read from its PTX (and
from ptxas where installed)."""

import os
import re
import shutil
import subprocess
import tempfile

import pytest

import artifacts

from cute_kv.kernels.attention.sm90 import THREADS, WG_THREADS, PagedAttention

pytestmark = pytest.mark.compile

FP8 = "float8_e4m3fn"
CASES = [  # (dtype, Hq, H, D, page size or None for a dense cache, KVD, vector lookup reads[, soft-cap, sinks, lse,
    # fp8 cache, scale granularity, e8m0 scales])
    ("bfloat16", 32, 8, 128, 16, 2, True),  # Llama-3-8B: 8 pages per 128-key tile, two 4-entry lookup vectors
    ("bfloat16", 32, 4, 128, 64, 2, False),  # GQA 8, lookup entries read one by one
    ("float16", 8, 8, 64, 128, 2, True),  # MHA, a page holds the whole tile: one copy
    ("bfloat16", 16, 2, 256, 16, 2, True),  # head dim 256: 80-key tiles, 5 pages a tile, consumers at 240 registers
    ("bfloat16", 32, 8, 192, 64, 2, True),  # head dim 192: 112-key tiles over 64-row pages, slots of 16 rows
    ("bfloat16", 32, 8, 128, None, 2, True),  # contiguous [B, S, H, D] operand
    ("bfloat16", 64, 8, 128, 32, 2, True, True, True, True),  # gpt-oss-like: soft-cap, sinks, lse
    ("bfloat16", 32, 8, 128, 64, 2, True, False, False, False, FP8, 32, True),  # fp8, e8m0 scale per 32 dims
    ("float16", 16, 2, 64, 64, 2, True, False, False, False, FP8),  # fp8 without scales: a plain cast
    ("bfloat16", 32, 8, 128, 16, 2, True, True, True, True, FP8, 16),  # fp8, float32 scale per 16 dims, features
    ("bfloat16", 12, 2, 128, 16, 2, True),  # GQA 6 (does not divide 64 rows): Q by thread copies
    ("bfloat16", 32, 8, 80, 16, 2, True),  # head dim 80: 32-byte swizzle rows, 5 k blocks
    ("bfloat16", 128, 128, 192, 128, 2, True, False, False, False, None, None, False, 128),  # K of 192, V and O of 128
    ("bfloat16", 32, 8, 128, 1, 2, True),  # pages of one row: K/V gathered by cp.async
    ("bfloat16", 12, 2, 256, 8, 2, True),  # gathered 64-key tiles, Q by thread copies
]
MMA = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(?:bf16|f16)\.(?:bf16|f16) \{[^}]*\}, "
SS = re.compile(MMA + r"%rd\d+, %rd\d+")  # A and B from shared memory (descriptors)
RS = re.compile(MMA + r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, %rd\d+")  # A (P) from registers
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);")


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(map(str, c)))
def compiled(request):
    kernel = PagedAttention(*request.param)
    return kernel, artifacts.compiled(kernel, "sm_90a").ptx, request.param


LOOPS = 3  # masked tiles at the keys' end, whole tiles, masked tiles at the window's start: no branch in a loop


def test_mma_forms_and_counts(compiled):
    """QK: D/16 SS wgmmas of N = BN at four sites (the first tile, the three loops); PV: BN/16 RS wgmmas of N = D_v
    (P in registers, V MN-major) at four sites (the loops, the last tile)."""
    kernel, ptx, _ = compiled
    d, bn = kernel.head_dim, kernel.bn
    qk, pv = SS.findall(ptx), RS.findall(ptx)
    assert len(qk) == (1 + LOOPS) * d // 16 and set(qk) == {str(bn)}
    assert len(pv) == (LOOPS + 1) * bn // 16 and set(pv) == {str(kernel.v_dim)}
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == len(qk) + len(pv)


def test_pv_runs_under_the_next_softmax(compiled):
    """In each loop QK(j+1) and PV(j) are issued back to back, then only the QK is waited for (wait_group 1): no
    wait_group 0 between the QK issue and the softmax's first exp2, so the PV is in flight during it."""
    _, ptx, _ = compiled
    waits = [(m.start(), int(m.group(1))) for m in WAIT.finditer(ptx)]
    assert sorted(n for _, n in waits) == [0] * (LOOPS + 2) + [1] * LOOPS
    for wait1 in (pos for pos, n in waits if n == 1):
        loop_qk = [m.start() for m in SS.finditer(ptx) if m.start() < wait1][-1]
        loop_pv = [m.start() for m in RS.finditer(ptx) if loop_qk < m.start() < wait1]
        softmax = ptx.index("ex2.approx", wait1)
        assert len(loop_pv) == len(RS.findall(ptx)) // (LOOPS + 1)  # the whole PV of the previous tile
        assert not [pos for pos, n in waits if loop_qk < pos < softmax and n == 0]


def test_qk_descriptors_one_add_each(compiled):
    """In the loops each QK's K descriptors take one add each; Q's k blocks' are built once before them
    (``sm90.descriptors_at``, invariant). Up to head dim 128 K's are the stage's low word plus the k block's offset
    over a constant high word: no 64-bit add in the QK (a 64-bit add on a descriptor rebuilt from the tile's address
    is split by ptxas into a carry chain and high-word moves per wgmma). Past 128 (``k_stage_whole``) the stage is
    added to the whole descriptor once, and each other k block's is that plus its constant offset, one ``add.s64``
    (ptxas: one ``UIADD3.64``, the stage computed from the tile's count)."""
    kernel, ptx, _ = compiled
    per_tile = kernel.head_dim // 16
    qk = list(re.finditer(MMA + r"%rd\d+, (%rd\d+)", ptx))
    for site in range(1, 1 + LOOPS):  # the loops' QK (the first tile's is outside them)
        group = qk[site * per_tile:(site + 1) * per_tile]
        if not kernel.k_stage_whole:
            assert "add.s64" not in ptx[group[0].start():group[-1].start()]
            continue
        first = group[0][2]
        offsets = []
        for m in group[1:]:
            op, args = _definition(ptx, m[2], m.start())
            assert op == "add.s64" and args[0] == first, (site, op, args)
            offsets.append(int(args[1]))
        assert len(set(offsets)) == per_tile - 1 and 0 not in offsets


def test_descriptors_built_once(compiled):
    """The Q, K and V wgmma descriptors are built from their shared-memory addresses once each (the layout bits
    or'ed onto the address field), in the consumers' prologue: between their setmaxnreg and the first wgmma, not
    at each wgmma site of the loops. Q's k blocks' descriptors are then built once each, from the warpgroup's low
    word (``sm90.descriptors_at``, invariant) plus a constant holding the layout bits and the k block's offset, and
    every QK reuses them."""
    kernel, ptx, _ = compiled
    # (the swizzle mode in bits 62-63: 1 for 128 bytes, 2 for 64, 3 for 32; PTX prints the constant signed)
    ops = re.finditer(r"(?:or\.b64|add\.s64)\s+%rd\d+, (%rd\d+), (-?\d+);", ptx)
    builds = [(m.start(), m[1], int(m[2])) for m in ops if int(m[2]) % 2**64 >> 62]
    (low,) = re.findall(r"cvt\.u64\.u32 (%rd\d+), lo;", ptx)  # Q's low word, opaque to LLVM
    from_address = [pos for pos, src, _ in builds if src != low]
    assert len(from_address) == 3
    assert all(ptx.index("setmaxnreg.inc") < pos < ptx.index("wgmma.mma_async") for pos in from_address)
    q_blocks = [c for _, src, c in builds if src == low]
    assert len(q_blocks) == len(set(q_blocks)) == kernel.head_dim // 16


def test_v_descriptors_advance_from_the_stage(compiled):
    """Each PV's V descriptors are the stage's descriptor (its first k block's) plus the k block's constant offset,
    one 64-bit add each (ptxas: one ``UIADD3.64`` per wgmma), not a low-word add per k block re-paired with the
    high word (an add and a move per wgmma): 16 keys' rows of V's swizzle width further, in 16-byte units."""
    kernel, ptx, _ = compiled
    per_tile = kernel.bn // 16
    descs = [(m.start(), m.group(2)) for m in re.finditer(MMA + r"\{%r\d+, %r\d+, %r\d+, %r\d+\}, (%rd\d+)", ptx)]
    assert len(descs) == (LOOPS + 1) * per_tile
    for site in range(LOOPS + 1):
        (_, base), *rest = descs[site * per_tile:(site + 1) * per_tile]
        for k, (pos, reg) in enumerate(rest, 1):
            assert re.search(rf"add\.s64\s+{reg}, {base}, {k * kernel.v_swizzle};", ptx[:pos]), (site, k, reg)


def _definition(ptx: str, reg: str, before: int) -> tuple[str, list[str]]:
    """Opcode and operands of the last instruction before ``before`` that writes ``reg``."""
    found = list(re.finditer(rf"^\s*([a-z][\w.]*)\s+{re.escape(reg)},\s*([^;]*);", ptx[:before], re.M))
    assert found, reg
    return found[-1][1], [x.strip() for x in found[-1][2].split(",")]


def test_o_scale_exactly_one_when_no_max_moved(compiled):
    """The O scale each loop's vote tests is ``2^((old max - new max) * scale)``: the difference comes first, so a
    max that did not move gives exactly 0 and a scale of exactly 1. ``old * scale - new * scale`` is a multiply
    and a subtract ptxas fuses into one FFMA, whose result is the rounding error of ``old * scale`` (not 0), and
    the vote would see scales a rounding step off 1."""
    _, ptx, _ = compiled
    votes = [m.start() for m in re.finditer(r"vote\.sync\.any\.pred", ptx)]
    assert len(votes) == LOOPS
    for vote in votes:
        scales = re.findall(r"setp\.neu\.f32\s+%p\d+, (%r\d+), 0f3F800000;", ptx[ptx.rindex("wgmma", 0, vote):vote])
        assert len(scales) == 2  # the thread's two rows
        for scale in scales:
            op, (arg,) = _definition(ptx, scale, vote)
            assert op == "ex2.approx.ftz.f32"
            op, factors = _definition(ptx, arg, vote)
            assert op == "mul.f32", (op, factors)
            assert "sub.f32" in [_definition(ptx, f, vote)[0] for f in factors if f.startswith("%r")]


def test_no_cta_wide_barrier_past_the_prologue(compiled):
    """The only CTA-wide barrier publishes the pipelines' barrier init, before the warpgroups part (setmaxnreg);
    the loop synchronizes through mbarriers and named barriers of 256 threads (ping-pong, up to head dim 128) only."""
    kernel, ptx, _ = compiled
    cta_wide = [m.start() for m in re.finditer(r"\b(?:bar|barrier)(?:\.cta)?\.sync(?:\.aligned)?\s+0;", ptx)]
    assert len(cta_wide) == 1 and cta_wide[0] < ptx.index("setmaxnreg.dec")
    named = re.findall(r"\bbar\.(sync|arrive)\s+[^,;]+,\s*(\d+);", ptx)
    assert {n for _, n in named} <= {str(WG_THREADS), str(2 * WG_THREADS)}
    # a warpgroup lets the other issue its wgmmas
    assert (("arrive", str(2 * WG_THREADS)) in named) == kernel.pingpong == (kernel.head_dim <= 128)


def test_register_split(compiled):
    """The producer warpgroup gives registers to the two consumer ones (32 / 232; 40 / 232 when it dequantizes
    fp8, whose scale loads spilled in 32; 24 / 240 beside S, P and O of 112 keys at head dim 192 or 80 at 256):
    within what the CTA holds from its launch (168 x 384), the pool setmaxnreg shares out."""
    kernel, ptx, _ = compiled
    assert re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx) == [
        ("dec", str(kernel.producer_regs)), ("inc", str(kernel.consumer_regs))]
    launch = 65536 // THREADS // 8 * 8  # registers a thread gets at launch (168): the pool setmaxnreg shares out
    assert kernel.producer_regs * WG_THREADS + kernel.consumer_regs * (THREADS - WG_THREADS) <= launch * THREADS
    assert f".reqntid {THREADS}, 1, 1" in ptx


def test_softmax_in_registers(compiled):
    """Per thread and tile: one exp2 per score of its two rows (BN/2), plus the two rows' O rescale in the loops,
    plus a sink's two per row; a quad max per row per tile site and a quad sum per row at the end; one tanh per
    score with soft-cap. No S or P goes through shared memory: the only shared stores are Q (16-byte, unless loaded
    by TMA), the stale V rows (16-byte, one site) and the staged 16-bit O (4-byte pairs)."""
    kernel, ptx, _ = compiled
    bn = kernel.bn
    assert ptx.count("ex2.approx") == bn // 2 + LOOPS * (bn // 2 + 2) + (4 if kernel.sinks else 0)
    assert ptx.count("tanh.approx") == ((1 + LOOPS) * bn // 2 if kernel.softcap else 0)
    assert ptx.count("shfl.sync.bfly.b32") == (1 + LOOPS) * 2 * 2 + 2 * 2
    chunks, o_chunks = (dim // 8 * 64 // WG_THREADS for dim in (kernel.head_dim, kernel.v_dim))
    passes = 2 * kernel.bn // (WG_THREADS // (kernel.head_dim // 8))  # fp8: K and V dequantized 8 values a thread
    # Q (thread copies), then the stale V rows (16-bit cache) or the dequantized K and V (fp8)
    q_stores = 0 if kernel.q_tma else chunks
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) == q_stores + (passes if kernel.kv_fp8 else 1)
    assert len(re.findall(r"st\.shared\.b32", ptx)) == kernel.v_dim // 8 * 2  # O: 2 rows x D_v/8 pairs
    # the staged O read back in 16-byte rows, and 8 fp8 bytes per dequantized vector
    assert len(re.findall(r"ld\.shared\.v4", ptx)) == o_chunks
    assert len(re.findall(r"ld\.shared\.v2\.b32", ptx)) == (passes if kernel.kv_fp8 else 0)


def test_fp8_dequantized_in_the_producer(compiled):
    """fp8: 8 values (4 conversions) a thread at a time, each times its granule's scale: a 4-byte load (float32) or
    a byte made a float32 by shifting it into the exponent field (e8m0, 0 and 255 decoded apart), offset in 64 bits;
    all of it before the consumers' setmaxnreg (the producer warpgroup's code), none in the math loops."""
    kernel, ptx, _ = compiled
    if not kernel.kv_fp8:
        assert "e4m3x2" not in ptx
        return
    passes = 2 * kernel.bn // (WG_THREADS // (kernel.head_dim // 8))
    assert ptx.count("cvt.rn.f16x2.e4m3x2") == 4 * passes
    consumer = ptx.index("setmaxnreg.inc")
    assert ptx.rindex("cvt.rn.f16x2.e4m3x2") < consumer
    if kernel.granularity and not kernel.e8m0_scales:
        assert len(re.findall(r"ld\.global\.(?:nc\.)?b32", ptx[:consumer])) >= passes
    if kernel.e8m0_scales:
        assert len(re.findall(r"ld\.global\.(?:nc\.)?[ub]8", ptx)) == passes
        assert len(re.findall(r"shl\.b32\s+%r\d+, %r\d+, 23;", ptx)) == passes
        assert "0f00400000" in ptx.lower() or "4194304" in ptx  # 2^-127 for e = 0
    if kernel.granularity:
        assert re.search(r"mul\.wide\.[su]32|mul\.lo\.s64|mad\.wide", ptx[:consumer])


def test_one_tma_per_page_slot(compiled):
    """K and V of a tile: one TMA per page slot and swizzle row of the row (128 bytes; an fp8 row of 64: one 64-byte
    box; rows of 160 bytes: five of 32), at one site each (the producer's loop); the lean producer's (head dims 192
    and 256) in a loop over the swizzle rows, one site per page slot for K's and V's."""
    kernel, ptx, _ = compiled
    width = kernel.kv_dtype.width // 8
    boxes = sum(dim * width // sw for dim, sw in zip((kernel.head_dim, kernel.v_dim), kernel.load_swizzles))
    loads = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global\.tile\.mbarrier::complete_tx::bytes", ptx)
    sites = 2 if kernel.kv_fp8 else 1  # fp8: the ring's first fill, then one tile per dequantized tile
    q_loads = 2 * kernel.head_dim * 2 // kernel.swizzle if kernel.q_tma else 0  # per warpgroup, a box a swizzle row
    if kernel.box_loop:
        boxes = 2
        # each tile's K and V still land whole: the bytes its full barriers expect
        producer = ptx[ptx.index("setmaxnreg.dec"):]
        regs = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[[^]]+\], (%r\d+);", producer)
        expected = {int(re.search(rf"mov\.b32\s+{r}, (\d+);", ptx).group(1)) for r in regs}
        assert {kernel.bn * kernel.head_dim * 2, kernel.bn * kernel.v_dim * 2} <= expected
    kv_loads = 0 if kernel.gather else kernel.k_op.copies_per_tile * boxes * sites  # (gathered: cp.async)
    assert len(loads) == kv_loads + q_loads


def test_gathered_rows(compiled):
    """Pages no TMA box tiles: per key tile each producer thread issues ``BN * D * 2 / 16 / 128`` 16-byte cp.async
    for K and as many for V (one site each: the producer's loop), each with its source size in a register (16, or 0
    for a row past the keys: zero-filled, so no stage row keeps stale or unwritten bytes for the wgmmas to read),
    then one ``cp.async.mbarrier.arrive.noinc`` per
    stage; each copy's row comes by ``shfl.sync.idx`` (the pass as a constant lane, segments of a row's lanes) from
    the lane that read its lookup entry (one 4-byte load a lane and tile, no vector). A consumer fences the async
    proxy between each wait and the wgmmas that read the stage (cp.async writes through the generic proxy). TMA
    pages issue none of it."""
    kernel, ptx, _ = compiled
    copies = re.findall(r"cp\.async\.cg\.shared\.global \[%r\d+(?:\+\d+)?\], \[%rd\d+\], 16, %r\d+;", ptx)
    noinc = ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64")
    if not kernel.gather:
        assert not copies and not noinc
        return
    passes = kernel.bn * kernel.head_dim * 2 // 16 // WG_THREADS
    assert len(copies) == 2 * passes and noinc == 2
    producer = ptx[ptx.index("setmaxnreg.dec"):ptx.index("setmaxnreg.inc")]
    chunks = kernel.head_dim * 2 // 16
    segment = chunks if chunks < 32 else 32
    lanes = re.findall(rf"shfl\.sync\.idx\.b32\s+%r\d+, %r\d+, (\d+), {(32 - segment) << 8 | 31}, -1;", producer)
    assert sorted(map(int, lanes)) == sorted(list(range(passes)) * 2)
    lookups = re.findall(r"ld\.global(?:\.nc)?\.(\w+)\s", producer)
    assert lookups and set(lookups) == {"b32"}
    consumer = ptx[ptx.index("setmaxnreg.inc"):]
    waits = [m.start() for m in re.finditer(r"mbarrier\.try_wait", consumer)]
    mmas = [m.start() for m in re.finditer(r"wgmma\.mma_async", consumer)]
    fences = [m.start() for m in re.finditer(r"fence\.proxy\.async\.shared::cta", consumer)]
    for w in waits:
        first_mma = next((m for m in mmas if m > w), None)
        nxt = next((x for x in waits if x > w), len(consumer))
        if first_mma is not None and first_mma < nxt:  # a wait whose stage the next wgmmas read
            assert any(w < f < first_mma for f in fences), consumer[w:w + 400]


def test_q_by_tma(compiled):
    """A group dividing 64 rows: the producer issues each warpgroup's Q tile (expect 64 * D * 2 bytes) as D/64
    3-D boxes (128 bytes of D, the group's heads, 64/group tokens: 8 KiB each, back to back in the swizzled tile)
    before its first K/V copy; a consumer waits on that barrier, then K's, before its first QK, with no 16-byte
    global load or shared store of Q between. Other groups keep the thread copies (16-byte loads, no Q TMA)."""
    kernel, ptx, _ = compiled
    consumer = ptx.index("setmaxnreg.inc")
    first_qk = SS.search(ptx, consumer).start()
    prologue = ptx[consumer:first_qk]
    tma = r"cp\.async\.bulk\.tensor\.3d\.shared::cta\S*\s+\[%r\d+(?:\+(\d+))?\], \[%rd\d+, \{%r\d+, %r\d+, %r\d+\}\]"
    producer = ptx[ptx.index("setmaxnreg.dec"):]
    if not kernel.q_tma:
        assert re.search(r"ld\.global(?:\.nc)?\.v4", prologue)
        return
    tile = 64 * kernel.head_dim * 2
    regs = re.findall(r"mbarrier\.arrive\.expect_tx\.shared\.b64 %rd\d+, \[[^]]+\], (%r\d+);", producer)[:2]
    assert [int(re.search(rf"mov\.b32\s+{r}, (\d+);", ptx).group(1)) for r in regs] == [tile, tile]
    boxes = [int(x or 0) for x in re.findall(tma, producer)][:2 * kernel.head_dim * 2 // kernel.swizzle]
    box = 64 * kernel.swizzle  # 64 packed rows x a swizzle row
    # the first at the Q tile's base (1024 bytes past the barriers, a register), the others at immediate offsets
    assert boxes[1:] == [1024 + i * box for i in range(1, len(boxes))]
    assert len(re.findall(r"mbarrier\.try_wait", prologue)) == 2  # Q's barrier, then the first K stage's
    assert not re.search(r"ld\.global(?:\.nc)?\.v4|st\.shared\.v4", prologue)


def test_request_rows_bounded_by_q(compiled):
    """Unchecked offsets (validate=False) cannot send a request's rows past ``q``/``out``: the kernel reads q's row
    count (its shape at byte 8; parameter 6, or 8 behind Q's TMA atom and coordinates, 2 fewer without K's and V's
    TMA atoms when rows are gathered), which it otherwise never needs (``request_rows``)."""
    kernel, ptx, _ = compiled
    param = (8 if kernel.q_tma else 6) - (2 if kernel.gather else 0)
    assert re.search(rf"ld\.param\.b32\s+%r\d+, \[\w+_param_{param}\+8\];", ptx)


def test_split_without_keys_exits_at_once(compiled):
    """A CTA whose split holds no key tile stores its rows' lse (-inf: the bits -8388608) and returns, before any
    barrier is initialized, any TMA is issued or any O is written: the kernel's first global store, then a branch
    to the ``ret``."""
    _, ptx, _ = compiled
    first = re.search(r"st\.global\.\w+\s+\[%rd\d+\], (-?\w+);\s*bra\.uni\s+(\$L__BB\d+_\d+);", ptx)
    assert first and first[1] == "-8388608"
    assert first.start() == ptx.index("st.global") < ptx.index("mbarrier.init") < ptx.index("cp.async")
    assert re.search(rf"^{re.escape(first[2])}:\s*ret;", ptx, re.M)


def test_shared_memory_within_the_launch(compiled):
    """The barriers come first (the one alignment slack ``tiling`` counts) and the last ring ends within
    ``smem_bytes()``, what the launch requests: the TMA copies of stage 0 write at immediate offsets from the
    shared-memory base, the last of them one box before that ring's first stage ends."""
    kernel, ptx, _ = compiled
    inits = [int(x or 0) for x in re.findall(r"mbarrier\.init\.shared\.b64\s+\[%r\d+(?:\+(\d+))?\]", ptx)]
    assert inits and max(inits) < 1024
    if kernel.gather:  # cp.async rows at per-thread addresses
        return
    dests = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\S*\s+\[%r\d+\+(\d+)\]", ptx)
    width = kernel.k_op.rows_per_copy * kernel.load_swizzles[1]  # one box's bytes (the last ring is V's)
    stages = kernel.fp8_stages if kernel.kv_fp8 else kernel.stages
    stage_bytes = kernel.bn * kernel.v_dim * kernel.kv_dtype.width // 8
    assert max(map(int, dests)) + width + (stages - 1) * stage_bytes <= kernel.smem_bytes()


PTXAS = shutil.which("ptxas") or ("/usr/local/bin/ptxas" if os.path.exists("/usr/local/bin/ptxas") else None)


@pytest.mark.skipif(PTXAS is None, reason="ptxas not installed")
def test_ptxas_fits_without_spills(compiled, tmp_path):
    """The whole kernel in the 168 registers 384 threads get at launch (the consumer code past setmaxnreg.inc may
    use up to 232 or 240), no spill, no stack."""
    _, ptx, _ = compiled
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    info = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    # Exactly the launch pool: with fewer, the consumers' setmaxnreg.inc would wait for registers forever.
    assert regs == 65536 // THREADS // 8 * 8
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in info


PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")


@pytest.fixture(scope="module")
def steady_loop(compiled):
    """The SASS of the unmasked loop, through perf/static.py's control-flow analysis (ptxas and nvdisasm)."""
    import sys

    sys.path.insert(0, PERF)
    import static

    if static.tools_available():
        pytest.skip(static.tools_available())
    kernel, ptx, _ = compiled
    with tempfile.TemporaryDirectory() as work:
        sass = static.disassemble(static.assemble(ptx, "sm_90a", work)[1])
    instrs, labels = static.parse_sass(sass)
    lp = static.main_loop(static.loops(instrs, labels))
    cfg = static.blocks(instrs, labels)
    return kernel, lp, [i for b in sorted(lp.blocks) for i in cfg[b].instrs]


def test_o_rescale_skipped_when_no_max_moved(steady_loop):
    """The loop's two ways differ by exactly the O rescale (D_v/2 FMULs a thread): taken only when some row of the
    warp changed its max (a warp vote), so the common tile skips it."""
    kernel, lp, code = steady_loop
    assert lp.instructions - lp.shortest == kernel.v_dim // 2
    assert any(i.opcode.startswith("VOTE.ANY") for i in code)


def test_ring_waits_and_releases_lean(steady_loop):
    """A tile's fast path checks each of its K and V stages once (its retry and sleep lie where only a failed check
    leads) beside the ping-pong barrier (none past head dim 128), and releases each by a predicated arrive without an
    ``elect.sync``: over an fp8 cache's dequantized rings as over the TMA ones. (ptxas may guard a release's address
    by a vote of the arrive's predicate, ``VOTEU.ALL``: at head dim 256 it does.)"""
    kernel, lp, code = steady_loop
    assert lp.barrier_waits == 2 + kernel.pingpong
    assert sum(i.opcode.startswith("SYNCS.ARRIVE") for i in code) == 2
    assert not any(i.opcode.startswith("ELECT") for i in code)
    assert sum(i.opcode.startswith("VOTEU") for i in code) <= 1


def test_exp2_before_the_pv_wait(steady_loop):
    """The PV of the previous tile is waited for (``WARPGROUP.DEPBAR.LE gsb0, 0x0``) only after the softmax's
    first exp2s have issued: the PV's wgmmas are still in flight under them. Over an fp8 cache too: its dequantized
    rings are released by lane 0 of each warp, as the TMA rings are (with every thread arriving, ptxas hoisted
    the wait and the release above the first exp2)."""
    kernel, lp, code = steady_loop
    ops = [(i.opcode, i.text.strip()) for i in sorted(code, key=lambda i: i.address)]
    wait0 = next(k for k, (op, text) in enumerate(ops) if op.startswith("WARPGROUP.DEPBAR") and text.endswith("0x0"))
    assert sum(op.startswith("MUFU.EX2") for op, _ in ops[:wait0]) > 0
