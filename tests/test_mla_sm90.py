"""``MLADecode`` (SM90): which calls it serves (plan and key, no GPU), what it compiles to for sm_90a (PTX and
ptxas, no GPU), and against the float32 reference on a GPU (``gpu`` marker)."""

import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import artifacts

import cute_kv
from cute_kv import reference as ref
from cute_kv.kernels.mla.config import BM, BN, STAGES, max_latent_dim, supported, tiling
from cute_kv.ops import mla_decode, paged_attention
from cute_kv.ops.paged_attention import plan
from cute_kv.reference.batch import random_paged_batch

from numerics import bits, rel_err

DEEPSEEK = ("bfloat16", 128, 576, 512, 64)  # (dtype, Hq, latent_dim, v_dim, page size)
FP8 = torch.float8_e4m3fn
ROPE = {"rope_dim": 64, "scale_dtype": torch.float32}  # with head_size 640: DeepSeek's rope-aware FP8 rows


def _batch(cached, new, latent=576, page_size=64, dtype=torch.bfloat16, seed=0, device=None, **kw):
    return random_paged_batch(cached, new, num_heads=1, head_size=latent, page_size=page_size, is_mla=True,
                              dtype=dtype, generator=torch.Generator().manual_seed(seed), device=device, **kw)


def _rope_batch(cached, new, page_size=64, seed=0, device=None):
    return _batch(cached, new, 640, page_size, FP8, seed, device, **ROPE)


# -- plan: which calls the kernel serves ---------------------------------------------------------------------------


def test_plan_serves_deepseek_decode_on_sm90():
    pb = _batch([100, 3], [1, 1])
    q = torch.randn(2, 128, 576).to(torch.bfloat16)
    path = plan(pb.collection, q, "sm_90a", mla_v_dim=512)
    assert path.path == "kernel" and path.kernel == "MLADecode"
    assert path.key == ("mla_decode", "bfloat16", 128, 576, 512, 64, True, False, False, False, 0, False)
    sinks = torch.zeros(128)
    featured = plan(pb.collection, q, "sm_90a", softcap=30.0, sinks=sinks, return_lse=True, mla_v_dim=512)
    assert featured.key[-5:] == (True, True, True, 0, False)
    # the key names what the launcher compiles: the kernel and the combine over the value columns
    units = mla_decode.compile_units(path.key, "sm_90a")
    assert [u[0] for u in units] == [path.key, ("attention_combine", "bfloat16", 128, 512, False)]
    chosen = paged_attention.backend(pb.collection, "sm_90a")  # what prebuild compiles
    assert chosen is mla_decode.BACKEND and [u[0] for u in chosen.compile_units(path.key, "sm_90a")] == [
        u[0] for u in units]


def test_plan_serves_rope_aware_fp8_rows_on_sm90():
    """A rope-aware FP8 cache (640-byte rows, q 576 wide): the key names the logical latent width and rope_dim; the
    kernel compiles with them (its cache argument is the e4m3 rows, scales beside them)."""
    pb = _rope_batch([100, 0, 1], [1, 1, 1])
    q = torch.randn(3, 128, 576).to(torch.bfloat16)
    path = plan(pb.collection, q, "sm_90a", mla_v_dim=512)
    assert path.path == "kernel" and path.kernel == "MLADecode"
    assert path.key == ("mla_decode", "bfloat16", 128, 576, 512, 64, True, False, False, False, 64, False)
    assert cute_kv.explain(cute_kv.paged_attention, q, pb.input_row_offsets, pb.collection, 0, mla_v_dim=512,
                           arch="sm_90a").kernel == "MLADecode"


@pytest.mark.parametrize("what,expect", [
    ("q fp16", "a rope-aware FP8 cache takes bfloat16 q"),
    ("rope 32", "rope_dim 64 and a padded_depth that is a multiple of 128, got rope_dim 32"),
    ("depth 448", "got rope_dim 64, padded_depth 448"),
    ("v_dim", "mla_v_dim (512) must be at most the padded_depth (256)"),
])
def test_rope_aware_plan_falls_back_with_a_reason(what, expect):
    head_size, rope_dim, q_dtype = 640, 64, torch.bfloat16
    if what == "q fp16":
        q_dtype = torch.float16
    elif what == "rope 32":
        head_size, rope_dim = 576, 32
    elif what == "depth 448":
        head_size = 576
    elif what == "v_dim":
        head_size = 384
    pb = _batch([5], [1], head_size, 64, FP8, rope_dim=rope_dim, scale_dtype=torch.float32)
    q = torch.randn(1, 16, pb.collection.latent_dim).to(q_dtype)
    path = plan(pb.collection, q, "sm_90a", mla_v_dim=512)
    assert path.path == "reference" and expect in path.reason, path.reason


@pytest.mark.parametrize("what,expect", [
    ("sm120", "MLA cache: no attention kernel for sm_120a"),
    ("fp8", "fp8 MLA caches take the reference"),
    ("q dtype", "q is float16 but the cache is bfloat16"),
    ("v_dim", "mla_v_dim (96) must be a multiple of 128"),
    ("page", "page_size (8) must be at least 16"),
    ("latent", "latent_dim (640) must be a multiple of 64 whose Q tile and two key stages fit"),
])
def test_plan_falls_back_with_a_reason(what, expect):
    latent, page, dtype, v_dim, arch, q_dtype = 576, 64, torch.bfloat16, 512, "sm_90a", torch.bfloat16
    extra = {}
    if what == "sm120":
        arch = "sm_120a"
    elif what == "fp8":
        dtype = torch.float8_e4m3fn
        extra = {"scale_dtype": torch.float32}
    elif what == "q dtype":
        q_dtype = torch.float16
    elif what == "v_dim":
        v_dim = 96
    elif what == "page":
        page = 8
    elif what == "latent":
        latent = 640
    pb = _batch([5], [1], latent=latent, page_size=page, dtype=dtype, **extra)
    q = torch.randn(1, 16, latent).to(q_dtype)
    path = plan(pb.collection, q, arch, mla_v_dim=v_dim)
    assert path.path == "reference" and expect in path.reason, path.reason


def test_supported_shapes():
    assert supported(*DEEPSEEK[1:], "bfloat16") is None and max_latent_dim() == 576
    assert supported(1, 64, 128, 16, "bfloat16") is not None  # v_dim past the latent width
    assert tiling(576).smem <= 227 * 1024  # Q + two key stages + P + barriers and exchange
    assert tiling(576).smem == 2 * STAGES * 8 + 2 * 2 * BM * 4 + 1024 + BM * 576 * 2 + STAGES * BN * 576 * 2 + \
        BM * BN * 2
    # rope-aware FP8 rows land inside the 16-bit stages: one more barrier a stage, nothing else
    assert supported(128, 576, 512, 64, "bfloat16", 64) is None
    assert tiling(576, True).smem == tiling(576).smem + STAGES * 8 <= 227 * 1024


def test_decode_splits_one_tokens_blocks():
    """128 heads are two 64-row blocks of one token: a small decode batch with long contexts splits its keys (a
    causal multi-token step does not)."""
    pb = _batch([8000, 8000], [1, 1])
    m_blocks, splits = mla_decode.launch_shape(pb.collection, 128, 132, num_tokens=2)
    assert m_blocks == 2 and splits > 1
    chunk = _batch([8000], [3])
    assert mla_decode.launch_shape(chunk.collection, 128, 132, num_tokens=3) == (6, 1)


# -- compile: sm_90a PTX and ptxas ---------------------------------------------------------------------------------

COMPILE_CASES = [  # MLADecode args: (dtype, Hq, latent, v_dim, page[, lut vector, soft-cap, sinks, lse])
    DEEPSEEK,  # one 64-row page per tile: one copy (nine 128-byte boxes)
    ("float16", 16, 576, 512, 16, False),  # four page slots per tile, lookup entries one by one
    ("bfloat16", 128, 576, 512, 128, True, True, True, True),  # soft-cap, sinks, lse
    ("bfloat16", 32, 192, 128, 32),  # a narrower latent head
]
ROPE_CASES = [  # rope-aware FP8 rows: (..., lut vector, soft-cap, sinks, lse, rope_dim)
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, 64),  # DeepSeek: 512 e4m3 | 64 bf16, 640 bytes
    ("bfloat16", 16, 576, 512, 16, False, True, True, True, 64),  # four page slots a tile, features
]
OVERLAP = (*DEEPSEEK, True, False, False, False, 0, True)  # pv_overlap: each tile's PV behind the next tile's QK
MMA = r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.(?:bf16|f16)\.(?:bf16|f16) \{[^}]*\}, "
SS = re.compile(MMA + r"%rd\d+, %rd\d+")
SITES = 4  # the first tile and the three loops (masked at the keys' end, whole, masked at the window's start)
PTXAS = shutil.which("ptxas") or ("/usr/local/bin/ptxas" if os.path.exists("/usr/local/bin/ptxas") else None)


def _compile(case):
    from cute_kv.kernels.mla.sm90 import MLADecode

    kernel = MLADecode(*case)
    return kernel, artifacts.compiled(kernel, "sm_90a")


@pytest.fixture(scope="module", params=COMPILE_CASES + ROPE_CASES + [OVERLAP], ids=lambda c: "-".join(map(str, c)))
def compiled_unit(request):
    return _compile(request.param)


@pytest.fixture(scope="module")
def compiled(compiled_unit):
    kernel, unit = compiled_unit
    return kernel, unit.ptx


@pytest.mark.compile
def test_mma_forms_and_counts(compiled):
    """Per site: QK is latent/16 SS wgmmas of N = 32 (a warpgroup's half of the keys), PV BN/16 SS wgmmas of
    N = v_dim/2 (its half of the value columns, P from the shared P tile); nothing else."""
    kernel, ptx = compiled
    ns = SS.findall(ptx)
    assert ns.count(str(BN // 2)) == SITES * kernel.latent_dim // 16
    assert ns.count(str(kernel.v_dim // 2)) == SITES * BN // 16
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == len(ns)


@pytest.mark.compile
def test_no_cta_wide_barrier_past_the_prologue(compiled):
    """``bar.sync 0`` once (barrier init); the loop's exchanges are 256-thread named barriers, the maxima and P
    ones, and with ``pv_overlap`` the one both PVs are done at (and over rope-aware rows the producer warpgroup's
    128-thread dequantization barrier)."""
    kernel, ptx = compiled
    assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 1
    named = set(re.findall(r"bar\.sync\s+(\d+),\s*(\d+);", ptx))
    assert named == {("1", "256"), ("2", "256")} | ({("3", "256")} if kernel.pv_overlap else set()) | (
        {("4", "128")} if kernel.rope_dim else set())


WGMMA_EVENTS = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16|"
                          r"wgmma\.(commit_group|wait_group)\.sync\.aligned\s*(\d*);|bar\.sync\s+(\d+)\b|"
                          r"mbarrier\.arrive\.shared\.b64")


def _wgmma_events(kernel, ptx):
    """``(event, pending)`` along the PTX: each wgmma group committed (``"qk"``: N = 32, ``"pv"``: N = v_dim / 2),
    wait (``"wait 1"``, ...), named barrier (``"bar 1"``, ...) and mbarrier arrive (``"arrive"``), with the groups
    committed and not yet waited for after it, oldest first. A wait leaves the newest ``wait_group`` operand groups
    pending; each site is straight-line code and leaves none pending, so reading the text in order follows every
    path."""
    pending, issued, out = [], set(), []
    for m in WGMMA_EVENTS.finditer(ptx):
        if m.group(1):
            issued.add(int(m.group(1)))
            continue
        if m.group(2) == "commit_group":
            assert issued in ({BN // 2}, {kernel.v_dim // 2}), issued  # one MMA per group
            event = "qk" if issued == {BN // 2} else "pv"
            pending.append(event)
            issued = set()
        elif m.group(2):
            event = f"wait {m.group(3)}"
            pending = pending[len(pending) - int(m.group(3)):] if int(m.group(3)) else []
        else:
            event = f"bar {m.group(4)}" if m.group(4) else "arrive"
        out.append((event, tuple(pending)))
    return out


@pytest.mark.compile
def test_pv_schedule(compiled):
    """The consumers' MMAs, waits, barriers and stage releases (``arrive``) in order (they follow the producer's
    code): the first tile and the three loops, then the epilogue's barrier. Without ``pv_overlap`` a tile's PV is
    issued once P is published, waited for at once and its stage released right after, so the producer refills it
    through the whole next step. With it, each loop site issues its tile's QK, then the previous tile's PV behind it,
    and waits for the QK alone (``wait 1``) before the max-exchange barrier, so that PV is in flight across the
    barrier and the softmax around it; its stage is released once both warpgroups' PVs are done (``bar 3``, after
    which the next P is written); the last tile's PV follows the loop."""
    kernel, ptx = compiled
    events = [event for event, _ in _wgmma_events(kernel, ptx)]
    consumers = events[events.index("qk"):]
    if kernel.pv_overlap:
        want = ["qk", "wait 0", "bar 1", "bar 2"] + ["qk", "pv", "wait 1", "bar 1", "wait 0", "bar 3", "arrive",
                                                     "bar 2"] * (SITES - 1) + ["pv", "wait 0", "arrive"]
    else:
        want = ["qk", "wait 0", "bar 1", "bar 2", "pv", "wait 0", "arrive"] * SITES
    assert consumers == want + ["bar 1"]


PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")


_SASS = {}


def _sass(case):
    """``(kernel, instructions, labels, static)``: the kernel's SASS through perf/static.py (ptxas, nvdisasm)."""
    sys.path.insert(0, PERF)
    import static

    if static.tools_available():
        pytest.skip(static.tools_available())
    if case not in _SASS:
        kernel, unit = _compile(case)
        with tempfile.TemporaryDirectory() as work:
            text = static.disassemble(static.assemble(unit.ptx, "sm_90a", work)[1])
        _SASS[case] = (kernel, *static.parse_sass(text), static)
    return _SASS[case]


@pytest.fixture(params=[DEEPSEEK, ROPE_CASES[0], OVERLAP], ids=lambda c: "-".join(map(str, c)))
def sass(request):
    return _sass(request.param)


@pytest.mark.sass
@pytest.mark.compile
def test_sass_keeps_the_pv_schedule(sass):
    """ptxas keeps the order of ``test_pv_schedule`` in the steady-state loop. Without ``pv_overlap``: the QK's
    HGMMAs, a wait for them (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), the max-exchange and P barriers, the PV's HGMMAs
    (64 x v_dim/2) and a wait for them. With it: the PV's HGMMAs follow the QK's, the warpgroup waits for all but the
    newest group (``0x1``: the QK) and meets on the max-exchange barrier, and waits for the PV (``0x0``) only after
    it, before the PV and P barriers."""
    kernel, instrs, labels, static = sass
    lp = static.main_loop(static.loops(instrs, labels))
    cfg = static.blocks(instrs, labels)
    events = []
    for ins in (i for b in sorted(lp.blocks) for i in cfg[b].instrs):
        if static.is_mma(ins.opcode):
            kind = "pv" if ins.opcode.startswith(f"HGMMA.64x{kernel.v_dim // 2}x16") else "qk"
            events += [kind] if events[-1:] != [kind] else []
        elif ins.opcode.startswith("WARPGROUP.DEPBAR"):
            events.append("wait " + ins.text.split(",")[-1].strip())
        elif static.is_named_barrier(ins):
            events.append("bar " + ins.text.split(",")[0].strip())
    if kernel.pv_overlap:
        assert events == ["qk", "pv", "wait 0x1", "bar 0x1", "wait 0x0", "bar 0x3", "bar 0x2"]
    else:
        assert events == ["qk", "wait 0x0", "bar 0x1", "bar 0x2", "pv", "wait 0x0"]


@pytest.mark.sass
@pytest.mark.compile
def test_fp8_producer_tile_instructions():
    """The rope-aware producer's tile (its loop), at most 6 instructions per 2 values (``bf16(float32(e4m3) *
    scale)`` rounded once: ``cvt.rn.f16x2.e4m3x2``, two ``cvt.f32.f16``, two multiplies, one ``cvt.rn.bf16x2.f32``)
    plus 160 a thread (one 16-byte load per 16 values and one 16-byte store per 8 at constant offsets from one
    address a thread, the stage's waits, scales and copies): no per-row branch, no swizzle arithmetic per access.
    Only the first tile walked takes the longer way, which clears the bytes and scales of rows past the keys (one
    AND a word, no branch); warp 0 issues the copies. Before, a steady tile took 1,287 instructions (1,331 in
    warp 0)."""
    from cute_kv.kernels.mla.sm90 import WG_THREADS

    kernel, instrs, labels, static = _sass(ROPE_CASES[0])
    cfg = static.blocks(instrs, labels)
    converts = [lp for lp in static.loops(instrs, labels)
                if any(i.opcode.startswith("F2FP.F16.E4M3") for b in lp.blocks for i in cfg[b].instrs)]
    assert len(converts) == 1
    lp = converts[0]
    ops = [i.opcode for b in lp.blocks for i in cfg[b].instrs]
    per_thread = BN * kernel.padded_depth // WG_THREADS  # values a producer thread converts a tile
    assert not any(op.startswith("BSSY") for op in ops)
    assert (lp.lds, lp.sts) == (per_thread // 16, per_thread // 8)
    assert lp.shortest <= 3 * per_thread + 160, lp.shortest  # 921 at this writing (warps 1-3, a steady tile)
    # 1,046 at this writing: warp 0's first tile, which clears rows past the keys
    assert lp.instructions - lp.shortest <= per_thread // 2 + 32, lp.instructions


@pytest.mark.compile
def test_p_tile_and_stage_reused_after_both_pvs(compiled):
    """The one P tile and a K stage (V is its first columns) are reused only once both warpgroups' PV wgmmas are
    done: a warpgroup waits for all its wgmmas before it arrives on a stage's empty barrier, which counts the 8 warps
    of both consumer warpgroups, and before the barrier behind which both write the next P (``Barrier.PV`` with
    ``pv_overlap``, else the next max exchange); P is published (``Barrier.P``) with nothing in flight."""
    kernel, ptx = compiled
    events = _wgmma_events(kernel, ptx)
    free = ("arrive", "bar 2", "bar 3") if kernel.pv_overlap else ("arrive", "bar 1", "bar 2")
    assert all(pending == () for event, pending in events if event in free), events
    assert [event for event, _ in events].count("bar 3") == (SITES - 1 if kernel.pv_overlap else 0)
    counts = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx))
    inits = re.findall(r"mbarrier\.init\.shared\.b64\s+\[%r\d+(?:\+\d+)?\], (%r\d+);", ptx)
    if kernel.rope_dim:  # landed: the copies; full: the 128 dequantizing threads; empty: the 256 consumer threads
        assert sorted(int(counts[r]) for r in inits) == [1] * STAGES + [128] * STAGES + [256] * STAGES
    else:  # full: the copies; empty: 8 consumer warps
        assert sorted(int(counts[r]) for r in inits) == [1] * STAGES + [8] * STAGES


@pytest.mark.compile
def test_one_tma_per_page_slot_and_no_v_load(compiled):
    """One site issues the tile's copies: a 128-byte box per 64 latent columns per page slot, K only (V is read
    from the K stage); over rope-aware rows a 128-byte box per 128 e4m3 content bytes and one rope box per slot."""
    kernel, ptx = compiled
    loads = re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)
    boxes = kernel.padded_depth // 128 + 1 if kernel.rope_dim else kernel.latent_dim // 64
    assert len(loads) == kernel.k_op.copies_per_tile * boxes


@pytest.mark.compile
def test_register_split(compiled):
    kernel, ptx = compiled
    producer = "40" if kernel.rope_dim else "32"  # the dequantizing warpgroup takes what the consumers leave
    assert re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+);", ptx) == [("dec", producer), ("inc", "232")]


@pytest.mark.compile
def test_shared_memory_within_the_launch(compiled):
    """The last TMA destination (stage 0's last box, at an immediate offset) leaves room for stage 1 and P inside
    ``smem_bytes()`` (a rope-aware tile's boxes land inside stage 0)."""
    kernel, ptx = compiled
    dests = [int(x) for x in re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\S*\s+\[%r\d+\+(\d+)\]", ptx)]
    box = kernel.k_op.rows_per_copy * 128
    assert dests and max(dests) + box + BN * kernel.latent_dim * 2 + BM * BN * 2 <= kernel.smem_bytes()


@pytest.fixture(scope="module", params=ROPE_CASES, ids=lambda c: "-".join(map(str, c)))
def compiled_rope(request):
    return _compile(request.param)


@pytest.mark.compile
def test_rope_tile_reads_from_byte_padded_depth(compiled_rope):
    """The host builds two descriptors over the same plane: the e4m3 content from its base, the BF16 rope tile from
    ``padded_depth`` bytes into it (MAX's ``create_rope_tma_tile``)."""
    kernel, unit = compiled_rope
    host = unit.host_ir
    base = r"(%\d+) = llvm\.getelementptr %\d+\[%\d+\] : \(!llvm\.ptr<1>, i32\) -> !llvm\.ptr<1>, i8"
    rope = re.findall(r"= llvm\.getelementptr (%\d+)\[(\d+)\] : \(!llvm\.ptr<1>\) -> !llvm\.ptr<1>, i8", host)
    assert [int(off) for _, off in rope] == [kernel.padded_depth]
    assert rope[0][0] in re.findall(base, host)  # the layer's plane: the content descriptor's address as well
    assert re.search(rf"llvm\.ptrtoint {re.escape(rope[0][0])} : !llvm\.ptr<1> to i64", host)


@pytest.mark.compile
def test_rope_tile_lands_inside_its_bf16_stage(compiled_rope):
    """Per page slot: the content's 128-byte boxes land from ``BN * padded_depth`` bytes into the stage (the bf16
    columns dequantized last), the rope box at the stage's rope columns (``2 * BN * padded_depth``); every e4m3
    value of a tile is converted once (two per ``cvt.rn.f16x2.e4m3x2``, 128 threads) in each of the two
    dequantizations (the first tile's, which clears rows past the keys, and the other tiles'; the compiler may
    share their last conversions)."""
    kernel, unit = compiled_rope
    ptx = unit.ptx
    dests = sorted(int(x) for x in re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\S*\s+\[%r\d+\+(\d+)\]", ptx))
    per_copy, pd = kernel.k_op.rows_per_copy, kernel.padded_depth
    stage = dests[0] - BN * pd
    slots = range(kernel.k_op.copies_per_tile)
    content = [stage + BN * pd + blk * BN * 128 + p * per_copy * 128 for blk in range(pd // 128) for p in slots]
    rope = [stage + 2 * BN * pd + p * per_copy * 128 for p in slots]
    assert dests == sorted(content + rope)
    assert BN * pd // 2 // 128 < len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)) <= 2 * BN * pd // 2 // 128


@pytest.mark.compile
@pytest.mark.skipif(PTXAS is None, reason="ptxas not installed")
def test_ptxas_fits_without_spills(compiled, tmp_path):
    """The kernel in the 168 registers 384 threads get at launch, no spill, no stack."""
    _, ptx = compiled
    src = tmp_path / "k.ptx"
    src.write_text(ptx)
    info = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True).stderr
    assert int(re.search(r"Used (\d+) registers", info).group(1)) <= 65536 // 384 // 8 * 8
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in info


# -- host: the dequantization of a rope-aware tile, run on CPU tensors ------------------------------------------------


def _tma_image(values: torch.Tensor, buf: torch.Tensor):
    """Write a ``(rows, depth)`` tile into ``buf`` as TMA does with the 128-byte swizzle: 128-byte boxes of columns
    one after another, each row 128 bytes, its 16-byte chunk ``j`` at chunk ``j ^ (row % 8)``."""
    rows, depth = values.shape
    per_box, per_chunk = 128 // values.element_size(), 16 // values.element_size()
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(depth), indexing="ij")
    chunk = (c % per_box // per_chunk) ^ (r % 8)
    element = c // per_box * rows * per_box + r * per_box + chunk * per_chunk + c % per_chunk
    buf[element.flatten()] = values.flatten()


def _host_dequantize(kernel):
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32

    from cute_kv.kernels.mla.sm90 import DEQUANT_CHUNK, DEQUANT_HELD, WG_THREADS
    from cute_kv.kernels.paged import tma_tiles

    @cute.jit
    def store(raw: cute.Tensor, ring: cute.Pointer, stage: Int32, blk: cutlass.Constexpr[int],
              p: cutlass.Constexpr[int], t: Int32):
        """Each held row's 16 bytes as the bf16 of their unsigned values (exact), stored where the kernel stores
        the dequantized values (the e4m3 conversion has no host lowering)."""
        vals = cute.make_rmem_tensor((DEQUANT_CHUNK,), kernel.dtype)
        for h in cutlass.range_constexpr(DEQUANT_HELD):
            vals.store(cute.recast_tensor(raw[None, h], cutlass.Uint8).load().to(cutlass.Float32).to(kernel.dtype))
            kernel.dequant_store(ring, vals, stage, blk, p, h, t)

    @cute.jit
    def run(buf: cute.Tensor, stage: Int32):
        """``MLADecode.dequantize``'s reads and stores of ``stage`` on the host, for all 128 threads in an order its
        barriers allow: a pass that writes over landed bytes reads for every thread before any stores; other passes
        read and store thread by thread, the last thread first (a store over bytes a later thread reads would
        show)."""
        ring = buf.iterator
        raw = cute.make_rmem_tensor((DEQUANT_CHUNK, DEQUANT_HELD, WG_THREADS), cutlass.Float8E4M3FN)
        for blk in cutlass.range_constexpr(kernel.padded_depth // 128):
            for p in cutlass.range_constexpr(kernel.dequant_passes):
                if cutlass.const_expr(kernel.writes_over_landed(blk)):
                    for t in cutlass.range(WG_THREADS):
                        kernel.dequant_read(ring, raw[None, None, t], stage, blk, p, t)
                    for t in cutlass.range(WG_THREADS):
                        store(raw[None, None, t], ring, stage, blk, p, t)
                else:
                    for t in cutlass.range(WG_THREADS - 1, -1, -1):
                        kernel.dequant_read(ring, raw[None, None, t], stage, blk, p, t)
                        store(raw[None, None, t], ring, stage, blk, p, t)

    return run


@pytest.mark.compile
@pytest.mark.parametrize("latent,v_dim,stage", [(576, 512, 1), (448, 256, 0), (320, 256, 1)])
def test_dequantization_in_place_on_the_host(latent, v_dim, stage):
    """The e4m3 tile TMA lands at byte ``BN * padded_depth`` of a stage and the kernel's own reads and stores
    (``dequant_read`` / ``dequant_store``) move it into the stage's bf16 columns: every byte arrives at its
    column, bit for bit, and no store lands on bytes not yet read (4, 3 and 2 landed blocks: the upper-half rule for
    even and odd counts), in either stage; the other stage is left as it was. The values stored here are the bytes
    themselves (``store``)."""
    from cutlass.cute.runtime import from_dlpack

    import host_plans
    from cute_kv.kernels.mla.sm90 import MLADecode

    kernel = MLADecode("bfloat16", 16, latent, v_dim, 64, True, False, False, False, 64)
    pd = kernel.padded_depth
    gen = torch.Generator().manual_seed(latent)
    content = torch.randint(0, 256, (BN, pd), generator=gen, dtype=torch.uint8)
    stage_bytes = BN * latent * 2
    raw = torch.zeros(STAGES * stage_bytes + 1024, dtype=torch.uint8)
    buf = raw[-raw.data_ptr() % 1024:][:STAGES * stage_bytes]
    buf.fill_(0xFF)  # bf16 NaN wherever nothing is written
    here, other = buf[stage * stage_bytes:][:stage_bytes], buf[(1 - stage) * stage_bytes:][:stage_bytes]
    _tma_image(content, here[BN * pd:2 * BN * pd])
    _host_dequantize(kernel)(from_dlpack(buf, assumed_align=1024), stage)
    got = torch.zeros(BN, pd, dtype=torch.bfloat16)
    host_plans.read_swizzled_tile(from_dlpack(here[:BN * pd * 2].view(torch.bfloat16)), from_dlpack(got), BN, pd)
    assert torch.equal(got, content.to(torch.bfloat16))
    assert torch.equal(here[BN * pd * 2:], torch.full_like(here[BN * pd * 2:], 0xFF)) and (other == 0xFF).all()


@pytest.mark.compile
def test_first_tile_clears_rows_past_the_keys_on_the_host():
    """``clear_past_keys`` (the first tile's dequantization) run for all 128 threads, every pass and held row: the
    bytes and the scale of a row at or past the request's keys come out zero, the others as they were, bit for bit,
    whether the keys end before the tile, inside it (mid-pass, at a pass edge) or past it; and the threads' rows
    (``dequant_row``) cover each of the tile's rows once per 16-byte column chunk."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, Uint32
    from cutlass.cute.runtime import from_dlpack

    from cute_kv.kernels.mla.sm90 import (DEQUANT_CHUNK, DEQUANT_HELD, DEQUANT_PER_ROW, DEQUANT_STEP, WG_THREADS,
                                          MLADecode, dequant_row)

    kernel = MLADecode("bfloat16", 16, 576, 512, 64, True, False, False, False, 64)
    held = BN // DEQUANT_STEP  # rows a thread holds over a tile
    words = DEQUANT_CHUNK // 4

    @cute.jit
    def run(out: cute.Tensor, scales: cute.Tensor, rows: cute.Tensor, tile_base: Int32, num_keys: Int32):
        for t in cutlass.range(WG_THREADS):
            raw = cute.make_rmem_tensor((DEQUANT_CHUNK, DEQUANT_HELD), cutlass.Float8E4M3FN)
            scale = cute.make_rmem_tensor((held,), Float32)
            scale.fill(1.5)
            for p in cutlass.range_constexpr(kernel.dequant_passes):
                bits = cute.recast_tensor(raw, Uint32)
                for w in cutlass.range_constexpr(cute.size(bits)):
                    bits[w] = Uint32(0xFFFFFFFF)
                for h in cutlass.range_constexpr(DEQUANT_HELD):
                    kernel.clear_past_keys(raw, scale, p, h, tile_base, num_keys, t)
                    row_bits = cute.recast_tensor(raw[None, h], Int32)
                    for w in cutlass.range_constexpr(words):
                        out[t, p * DEQUANT_HELD + h, w] = row_bits[w]
                    rows[t, p * DEQUANT_HELD + h] = dequant_row(p, h, t)
            for j in cutlass.range_constexpr(held):
                scales[t, j] = scale[j]

    tile_base = 3 * BN
    for num_keys in (tile_base - 5, tile_base, tile_base + 1, tile_base + 37, tile_base + 2 * DEQUANT_STEP,
                     tile_base + BN, tile_base + BN + 9):
        out = torch.zeros(WG_THREADS, held, words, dtype=torch.int32)
        scales = torch.zeros(WG_THREADS, held)
        rows = torch.zeros(WG_THREADS, held, dtype=torch.int32)
        run(from_dlpack(out), from_dlpack(scales), from_dlpack(rows), tile_base, num_keys)
        keep = (tile_base + rows < num_keys)
        assert torch.equal(out, torch.where(keep[..., None], -1, 0).to(torch.int32).expand_as(out)), num_keys
        assert torch.equal(scales, torch.where(keep, 1.5, 0.0)), num_keys
    assert torch.equal(torch.bincount(rows.flatten(), minlength=BN), torch.full((BN,), DEQUANT_PER_ROW))


# -- GPU: against the reference ------------------------------------------------------------------------------------

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _gpu_run(cached, new, hq=128, latent=576, v_dim=512, page_size=64, dtype=torch.bfloat16, seed=0, rope=False,
             **kw):
    """``rope``: a rope-aware FP8 cache (640-byte rows, q ``latent`` = 576 wide)."""
    from cute_kv.kernels.compile_cache import cache_info

    if rope:
        batches = [_rope_batch(cached, new, page_size, seed, device=dev) for dev in ("cpu", "cuda")]
    else:
        batches = [_batch(cached, new, latent, page_size, dtype, seed, device=dev) for dev in ("cpu", "cuda")]
    for pb in batches:
        pb.poison_unread(1)  # NaN in every slot attention must not read
    cpu, gpu = batches
    q = torch.randn(sum(new), hq, latent, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    want = ref.paged_attention(q, cpu.input_row_offsets, cpu.collection, 1, mla_v_dim=v_dim, **kw)
    blocks = bits(gpu.collection.blocks).clone()
    scales = None if gpu.collection.scales is None else bits(gpu.collection.scales).clone()
    out = torch.full((q.shape[0], hq, v_dim), float("nan"), dtype=dtype, device="cuda")
    gpu_kw = {**kw, "sinks": kw["sinks"].cuda()} if kw.get("sinks") is not None else kw
    assert cute_kv.explain(cute_kv.paged_attention, q.cuda(), gpu.input_row_offsets, gpu.collection, 1,
                           mla_v_dim=v_dim, **gpu_kw).kernel == "MLADecode"
    compiles = cache_info()["compiles"]
    got = cute_kv.paged_attention(q.cuda(), gpu.input_row_offsets, gpu.collection, 1, mla_v_dim=v_dim, out=out,
                                  **gpu_kw)
    torch.cuda.synchronize()
    if kw.get("return_lse"):
        got, lse = got
        assert (lse.cpu() - want[1]).abs().max() < 1e-2
        want = want[0]
    assert got is out and not out.isnan().any()  # every row written, no stale (NaN) key reached it
    assert rel_err(out.cpu(), want) < TOL[dtype]
    assert torch.equal(bits(gpu.collection.blocks), blocks)
    assert scales is None or torch.equal(bits(gpu.collection.scales), scales)
    assert cache_info()["compiles"] - compiles <= 2  # the kernel (and the split combine)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 1024), (8, 4096), (32, 8192), (128, 1024), (4, 32768)])
def test_deepseek_decode(batch, ctx):
    """128 heads, 576/512, page 64, shuffled pages, ragged lengths around ``ctx`` (one request of 0 cached keys)."""
    gen = torch.Generator().manual_seed(batch * 7 + ctx)
    cached = [int(x) for x in torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen)]
    cached[0] = 0
    _gpu_run(cached, [1] * batch, seed=batch)


@pytest.mark.gpu
def test_ragged_chunks_empty_and_one_key():
    """Multi-token (chunked prefill) steps with the causal mask, an empty request, contexts of 0 and 1 keys."""
    _gpu_run([0, 1, 37, 500, 64, 0], [3, 1, 0, 17, 1, 40], seed=3)
    _gpu_run([0, 1, 37, 500, 64, 0], [3, 1, 0, 17, 1, 40], hq=16, page_size=16, dtype=torch.float16, seed=4)


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{"causal": False}, {"window": 100}, {"softcap": 30.0}, {"return_lse": True},
                                {"sinks": "random", "return_lse": True}, {"scale": 0.05}])
def test_features(kw):
    kw = dict(kw)
    if kw.get("sinks") == "random":
        kw["sinks"] = torch.randn(128, generator=torch.Generator().manual_seed(1)) * 3
    _gpu_run([3000, 10, 200], [1, 1, 5], seed=5, **kw)


@pytest.mark.gpu
def test_split_kv_decode_matches_one_split():
    """A small batch of long contexts takes several splits and the combine over 512 columns."""
    pb = _batch([30000, 20000], [1, 1])
    assert mla_decode.launch_shape(pb.collection, 128, torch.cuda.get_device_properties(0).multi_processor_count,
                              num_tokens=2)[1] > 1
    _gpu_run([30000, 20000], [1, 1], seed=6, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,ctx", [(1, 1024), (32, 4096), (128, 1024), (4, 32768)])
def test_rope_aware_deepseek_decode(batch, ctx):
    """Rope-aware FP8 rows (512 e4m3 | 64 bf16, a float32 scale a token): 128 heads, page 64, shuffled pages,
    ragged lengths around ``ctx`` (one request of 0 cached keys), unread slots NaN."""
    gen = torch.Generator().manual_seed(batch * 11 + ctx)
    cached = [int(x) for x in torch.randint(ctx // 2, ctx + 1, (batch,), generator=gen)]
    cached[0] = 0
    _gpu_run(cached, [1] * batch, seed=batch, rope=True)


@pytest.mark.gpu
def test_rope_aware_ragged_splits_and_features():
    """Chunked steps with contexts of 0 and 1 keys and an empty request, four page slots a tile; soft-cap, sinks
    and lse; a split-KV decode."""
    _gpu_run([0, 1, 37, 500, 64, 0], [3, 1, 0, 17, 1, 40], seed=7, rope=True)
    sinks = torch.randn(16, generator=torch.Generator().manual_seed(2)) * 3
    _gpu_run([0, 1, 37, 500, 64, 0], [3, 1, 0, 17, 1, 40], hq=16, page_size=16, seed=8, rope=True, softcap=30.0,
             sinks=sinks, return_lse=True)
    pb = _rope_batch([30000, 20000], [1, 1])
    assert mla_decode.launch_shape(pb.collection, 128, torch.cuda.get_device_properties(0).multi_processor_count,
                              num_tokens=2)[1] > 1
    _gpu_run([30000, 20000], [1, 1], seed=9, rope=True, return_lse=True)
