"""Static evidence for a compiled kernel, without a GPU: ``ptxas -v`` resources, SASS instruction counts, the launch
configuration the host code passes, and the CTAs per SM these allow.

* ``ptxas -arch=sm_90a|sm_100a -v`` on the kernel's PTX: registers per thread, spill stores / loads, stack frame,
  static shared memory, named barriers; the cubin it writes is disassembled with ``nvdisasm``.
* The launch (threads per CTA, dynamic shared memory) is read from the host code the DSL generates: the fields
  ``block`` and ``sharedMemBytes`` of the launch-config struct it fills before ``cudaLaunchKernelEx`` are constants
  for every kernel here. For a kernel whose launch passes ``smem=`` that is the host's figure; for one that lets the
  DSL size it, the DSL's own total of the kernel's allocations.
* SASS counts per kernel: tensor-core MMAs (``HGMMA`` on SM90; tcgen05 ``UTC*MMA`` on SM100), barrier waits
  (``BAR.SYNC``/``BAR.RED`` on barrier 0 without a count: CTA-wide; with an id and count: named barriers of some
  warps; ``SYNCS.PHASECHK``: mbarrier waits), shared loads / stores
  (``LDS``/``LDSM``, ``STS``/``STSM``), ``MUFU.EX2``, local-memory ``LDL``/``STL`` (spills, or an array the
  compiler could not keep in registers: a stack frame without spills).
* The main loop is found on the control-flow graph: SASS is cut into basic blocks, a back edge is a branch to a
  block that dominates it, and its natural loop is the header plus every block that reaches the branch without
  passing the header (so an mbarrier retry the compiler moved past the function's end, branching back into the
  body, is no loop of its own, and interleaved loops keep their own blocks). The main loop is, among the innermost
  loops that issue MMAs (a persistent kernel's loop over work tiles holds the tile loop and is passed over), the one
  with the most MMAs (ties: the fewest instructions, which for a causal prefill is the unmasked steady-state loop
  rather than its masked twins); a kernel without MMAs takes the loop with the most instructions. Its instruction
  count is the fast path of one iteration: from the header to the back edge with every mbarrier wait succeeding at
  its first try (a branch on a ``SYNCS.PHASECHK`` result goes the success way); where other branches leave a choice,
  the longest way (``loop_instructions``) and the shortest (``loop_instructions_shortest``, e.g. an O rescale
  skipped). A loop body may cover several tiles; ``instructions_per_s_block`` divides by
  the 64x64 blocks of S its MMAs compute (attention: QK^T and PV cost 4*64*64*D flops per block; HGMMA shapes are
  in the SASS opcode, tcgen05's are not, so SM100 gives the loop's count alone). The softmax loop (the innermost
  loop with the most exponentials, ties: the fewest instructions) is reported beside it: on SM100 the MMAs are issued by one warp and the softmax
  runs in other warps, so the two loops differ. Its exponentials are counted by pipe: ``MUFU.EX2`` and those emulated
  with FMAs (``ex2_emulated``); a causal kernel's masked twin of it (``masked_loop``) by its longest way, a
  warp with a row the mask cuts.
* The SM100 correction loop (``correction_loop``: the innermost loop storing to tensor memory with no MMA and no
  ``MUFU.EX2``, O rescaled in place) by one steady iteration (``_steady_paths``: no nested loop, such as a tail
  tile's zero fill): its longest way (O rescaled) and its longest way storing nothing (the rescale skipped), per S
  tile (the O columns it loads over the value dim: FA4 rescales both Q tiles in one iteration).
* The load loop (the innermost loop without MMAs that issues the most global-to-shared copies: TMA ``UTMALDG``,
  bulk ``UBLKCP`` or ``LDGSTS``, the cp.async of a row gather) is a producer's walk over key tiles: its fast-path
  instructions (``load_loop_instructions``, ``_shortest``) and copies (``load_loop_copies``) per iteration, those
  of each warp that runs it (a TMA loop runs in one warp, one lane issuing; a gather's in every producer warp).
* CTAs per SM follow the CUDA occupancy rules for sm_90 / sm_100 (``occupancy``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable, Optional

# SM90 and SM100 alike, for what the occupancy rules need (CUDA occupancy calculator, compute capability 9.0/10.0).
REGS_PER_SM = 64 * 1024
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
MAX_REGS_PER_THREAD = 255
MAX_WARPS_PER_SM = 64
MAX_CTAS_PER_SM = 32
SMEM_PER_SM = 228 * 1024
SMEM_PER_CTA_MAX = 227 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the system's share of each resident CTA
SMEM_ALLOC_UNIT = 128


class ToolMissing(RuntimeError):
    pass


def find_tool(name: str) -> str:
    """``ptxas`` / ``nvdisasm``: from the CUDA wheels (``pip install -e .[sass]``), else from PATH."""
    for root in _wheel_bin_dirs():
        path = os.path.join(root, name)
        if os.access(path, os.X_OK):
            return path
    path = shutil.which(name)
    if path is None:
        raise ToolMissing(f"{name} not found: pip install -e '.[sass]' (CUDA 13 wheels), or put a CUDA 13 {name} "
                          "on PATH")
    return path


def _wheel_bin_dirs() -> list[str]:
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return []
    return [os.path.join(p, sub, "bin") for p in nvidia.__path__ for sub in ("cu13", "cuda_nvcc", "cuda_nvdisasm")]


@dataclasses.dataclass(frozen=True)
class Resources:
    """``ptxas -v`` figures of one kernel."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    static_smem: int
    barriers: int


_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")


def parse_ptxas(log: str) -> Resources:
    frame, used = _PTXAS_FRAME.search(log), _PTXAS_USED.search(log)
    if frame is None or used is None:
        raise ValueError(f"unexpected ptxas -v output:\n{log}")
    return Resources(registers=int(used[1]), spill_stores=int(frame[2]), spill_loads=int(frame[3]),
                     stack=int(frame[1]), static_smem=int(used[3] or 0), barriers=int(used[2] or 0))


def assemble(ptx: str, arch: str, workdir: str) -> tuple[Resources, str]:
    """``ptxas -v`` resources and the path of the cubin it wrote."""
    src, cubin = os.path.join(workdir, "k.ptx"), os.path.join(workdir, "k.cubin")
    with open(src, "w") as f:
        f.write(ptx)
    done = subprocess.run([find_tool("ptxas"), f"-arch={arch}", "-v", src, "-o", cubin],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ptxas -arch={arch} failed:\n{done.stderr}")
    return parse_ptxas(done.stdout + done.stderr), cubin


def disassemble(cubin: str) -> str:
    done = subprocess.run([find_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvdisasm failed:\n{done.stderr}")
    return done.stdout


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str  # with modifiers, e.g. HGMMA.64x128x16.F32.BF16
    text: str
    guard: str = ""  # the predicate it runs under, e.g. "!P0" ("" when unguarded)


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@(!?U?P\w+)\s+)?([A-Z][A-Z0-9_.x]*)(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def parse_sass(text: str) -> tuple[list[Instruction], dict[str, int]]:
    """Instructions of one kernel's SASS, and each label's address."""
    instrs: list[Instruction] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            pending.append(m[1])
            continue
        m = _INSTR.search(line)
        if m:
            ins = Instruction(int(m[1], 16), m[3], m[4], m[2] or "")
            for name in pending:
                labels[name] = ins.address
            pending = []
            instrs.append(ins)
    return instrs, labels


def is_tcgen05_mma(op: str) -> bool:
    return bool(re.match(r"UTC\w*MMA", op))


def is_mma(op: str) -> bool:
    return op.startswith("HGMMA") or is_tcgen05_mma(op)


def is_barrier_wait(op: str) -> bool:
    return op.startswith(("BAR.SYNC", "BAR.RED", "SYNCS.PHASECHK"))


def is_cta_barrier(ins: Instruction) -> bool:
    """``__syncthreads``: barrier 0 with no thread count (``BAR.SYNC.DEFER_BLOCKING 0x0``)."""
    return ins.opcode.startswith(("BAR.SYNC", "BAR.RED")) and ins.text.strip() == "0x0"


def is_named_barrier(ins: Instruction) -> bool:
    """A wait on a named barrier of some warps (an id and a thread count, e.g. FA4's warpgroup turns)."""
    return ins.opcode.startswith(("BAR.SYNC", "BAR.RED")) and not is_cta_barrier(ins)


def is_lds(op: str) -> bool:
    return op == "LDS" or op.startswith(("LDS.", "LDSM"))


def is_copy_in(op: str) -> bool:
    """An asynchronous global-to-shared copy: TMA (``UTMALDG``), bulk copy (``UBLKCP``), cp.async (``LDGSTS``)."""
    return op.startswith(("UTMALDG", "UBLKCP", "LDGSTS"))


def is_sts(op: str) -> bool:
    return op == "STS" or op.startswith(("STS.", "STSM"))


def hgmma_flops(op: str) -> int:
    """2*M*N*K of one warpgroup MMA (``HGMMA.64x128x16...``); 0 where the shape is not in the opcode (tcgen05)."""
    m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op)
    return 2 * int(m[1]) * int(m[2]) * int(m[3]) if m else 0


# K of one tcgen05.mma by kind: 32 bytes of each A row (PTX ISA, "tcgen05.mma" shapes).
TCGEN05_K = {"tf32": 8, "f16": 16, "f8f6f4": 32, "i8": 32, "mxf8f6f4": 32, "mxf4": 64, "mxf4nvf4": 64}
_TCGEN05_MMA = re.compile(r"tcgen05\.mma(\.ws)?\.cta_group::(\d)\.kind::(\w+)\S*\s+\[[^\]]+\],\s*(\[[^\]]+\]|%\w+),"
                          r"\s*%\w+,\s*(%\w+|\d+)\b")
_PTX_DEF = re.compile(r"^\s*(mov|or|selp)\.b32\s+(%r\d+),\s*([^;]+);", re.M)
_PTX_FUNCTION = re.compile(r"^\s*(?:\.visible\s+|\.weak\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)", re.M)


@dataclasses.dataclass(frozen=True)
class Tcgen05Mma:
    """One ``tcgen05.mma`` of a PTX text, its shape from the instruction descriptor (PTX ISA, "Instruction
    descriptor": N / 8 in bits 17-22, M / 16 in bits 24-28, B MN-major in bit 16); ``m`` is the pair's M for
    ``cta_group::2``, so ``flops`` is the instruction's work over both CTAs."""

    m: int
    n: int
    k: int
    cta_group: int
    ws: bool  # weight-stationary
    a_tmem: bool  # A read from tensor memory
    b_mn_major: bool

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


def _ptx_values(defs: dict, operand: str, depth: int = 0) -> set:
    """Every value a 32-bit operand may hold: an immediate, or a register built by ``mov``/``or``/``selp`` of
    immediates (how an instruction descriptor is assembled); ValueError for anything else."""
    if not operand.startswith("%"):
        return {int(operand, 0)}
    op, args = defs.get(operand, (None, ()))
    if op is None or depth > 16:
        raise ValueError(f"cannot resolve {operand} to constants")
    if op == "mov":
        return _ptx_values(defs, args[0], depth + 1)
    if op == "selp":
        return _ptx_values(defs, args[0], depth + 1) | _ptx_values(defs, args[1], depth + 1)
    return {a | b for a in _ptx_values(defs, args[0], depth + 1) for b in _ptx_values(defs, args[1], depth + 1)}


def _ptx_functions(ptx: str) -> list[tuple[str, str]]:
    """``(name, body)`` of each ``.entry`` / ``.func`` of a PTX text (registers are per function); a fragment
    without one is one unnamed body."""
    starts = list(_PTX_FUNCTION.finditer(ptx))
    if not starts:
        return [("", ptx)]
    return [(m[1], ptx[m.start():starts[i + 1].start() if i + 1 < len(starts) else len(ptx)])
            for i, m in enumerate(starts)]


def tcgen05_mmas(ptx: str, entry: Optional[str] = None) -> list[Tcgen05Mma]:
    """The ``tcgen05.mma`` instructions of the one function of ``ptx`` that issues any (or of the one whose name
    contains ``entry``), in order, shapes decoded. ValueError where several functions issue them and ``entry``
    picks none, or where a descriptor is not built from constants or its possible values disagree on a shape."""
    found = []
    for name, body in _ptx_functions(ptx):
        if entry is not None and entry not in name:
            continue
        defs = {}
        for m in _PTX_DEF.finditer(body):  # a register set twice holds no one expression: left unresolved
            defs[m[2]] = (None, ()) if m[2] in defs else (m[1], [a.strip() for a in m[3].split(",")])
        mmas = []
        for m in _TCGEN05_MMA.finditer(body):
            fields = {(v >> 24 & 0x1F, v >> 17 & 0x3F, v >> 16 & 1) for v in _ptx_values(defs, m[5])}
            if len(fields) != 1:
                raise ValueError(f"instruction descriptor {m[5]} has several shapes: {sorted(fields)}")
            (m16, n8, b_mn), = fields
            mmas.append(Tcgen05Mma(16 * m16, 8 * n8, TCGEN05_K[m[3]], int(m[2]), bool(m[1]), m[4].startswith("["),
                                   bool(b_mn)))
        if mmas:
            found.append((name, mmas))
    if len(found) > 1:
        raise ValueError(f"several functions issue tcgen05.mma ({', '.join(n for n, _ in found)}): name one")
    return found[0][1] if found else []


@dataclasses.dataclass(frozen=True)
class Loop:
    start: int  # the header's address
    end: int  # the last back edge's branch
    instructions: int  # on the longest fast path of one iteration (the counts below too)
    mma: int
    mma_flops: int
    ex2: int
    lds: int
    sts: int
    barrier_waits: int
    cta_barriers: int
    named_barriers: int
    blocks: frozenset = dataclasses.field(default=frozenset(), compare=False)  # every block's start, slow paths too
    shortest: int = 0  # instructions on the shortest fast path (``instructions``: the longest; equal without branches)
    copies_in: int = 0  # global-to-shared copies issued (``is_copy_in``)
    mma_order: str = ""  # the longest fast path's mbarrier waits and tcgen05 MMA groups in issue order (``mma_order``)
    p_barriers: int = 0  # mbarriers the loop waits on for P, at least (``p_barriers``)
    ex2_emulated: int = 0  # exponentials computed on the FMA pipe (``ex2_emulated``)
    tmem_stores: int = 0  # tcgen05.st (``STTM``)
    steady: tuple = (0, 0)  # instructions of a steady iteration: longest, longest without STTM (``_steady_paths``)
    steady_columns: int = 0  # tensor-memory columns loaded (``LDTM``) on the steady longest way


_ENDS_BLOCK = ("BRA", "EXIT", "RET", "BRX", "JMP", "JMX", "KILL")


@dataclasses.dataclass
class Block:
    start: int
    instrs: list
    succs: list  # (block start, taken only when an mbarrier wait failed)


def blocks(instrs: list[Instruction], labels: dict[str, int]) -> dict[int, Block]:
    """Basic blocks by start address. Each edge says whether it is taken only when an mbarrier try-wait failed: a
    branch on the predicate a ``SYNCS.PHASECHK`` just wrote goes to the retry when guarded by its negation (its
    fall-through is the success way) and past the retry when guarded by it (then the fall-through is the retry)."""
    targets = set(labels.values())
    out: dict[int, Block] = {}
    cur: Optional[Block] = None
    for k, ins in enumerate(instrs):
        if cur is None or ins.address in targets:
            if cur is not None:
                cur.succs.append((ins.address, False))
            cur = out[ins.address] = Block(ins.address, [], [])
        cur.instrs.append(ins)
        if not ins.opcode.startswith(_ENDS_BLOCK):
            continue
        nxt = instrs[k + 1].address if k + 1 < len(instrs) else None
        m = _TARGET.search(ins.text)
        cond = _condition(ins)
        waited = _waited_predicate(instrs, k, cond)
        fails = cond == "!" + waited if waited else False  # taken on failure
        succeeds = cond == waited if waited else False  # taken on success: the fall-through is the retry
        if m and m[1] in labels:
            cur.succs.append((labels[m[1]], fails))
        if cond and nxt is not None:
            cur.succs.append((nxt, succeeds))
        cur = None
    return out


_PRED_OPERAND = re.compile(r"\s*(!?U?P\d+)\s*,")


def _condition(ins: Instruction) -> str:
    """The predicate a branch or exit is taken under ("" when always): its guard, or a predicate operand
    (``BRA.U !UP0, target``; ``@P1 BRA P0, target`` is taken under both, named here by the guard)."""
    if ins.guard:
        return ins.guard
    m = _PRED_OPERAND.match(ins.text)
    return m[1] if m and m[1].lstrip("!") != "PT" else ""


def _waited_predicate(instrs: list[Instruction], k: int, cond: str) -> str:
    """The predicate the branch ``instrs[k]`` tests, when its last writer since the previous branch is an mbarrier
    wait (``SYNCS.PHASECHK``); "" otherwise."""
    pred = cond.lstrip("!")
    for ins in reversed(instrs[:k]):
        if ins.opcode.startswith(_ENDS_BLOCK):
            return ""
        if pred and ins.text.strip().startswith(pred + ","):  # the destination is the first operand
            return pred if ins.opcode.startswith("SYNCS.PHASECHK") else ""
    return ""


def _dominators(cfg: dict[int, Block], entry: int) -> dict[int, set]:
    """Each block's dominators (the blocks every path from an entry to it passes): the iterative data-flow solution
    over reverse postorder. Besides the kernel's entry, the first block (by address) of code no entry reaches yet
    is one, until every block is reached: the targets of an indirect ``BRX`` (a switch over warp roles) whose jump
    table the SASS does not show."""
    roots, reached = [], set()
    for b in sorted(cfg, key=lambda b: b != entry):  # the entry first, then by address
        if b in reached:
            continue
        roots.append(b)
        work = [b]
        while work:
            n = work.pop()
            if n not in reached:
                reached.add(n)
                work.extend(succ for succ, _ in cfg[n].succs)
    root = -1  # a virtual block before the entries
    cfg = {**cfg, root: Block(root, [], [(b, False) for b in roots])}
    entry = root
    order, seen, stack = [], {entry}, [(entry, iter(cfg[entry].succs))]
    while stack:  # reverse postorder by an iterative depth-first walk
        node, it = stack[-1]
        for succ, _ in it:
            if succ not in seen:
                seen.add(succ)
                stack.append((succ, iter(cfg[succ].succs)))
                break
        else:
            order.append(node)
            stack.pop()
    order.reverse()
    preds: dict[int, list] = {n: [] for n in order}
    for n in order:
        for succ, _ in cfg[n].succs:
            preds[succ].append(n)
    dom = {n: set(order) for n in order}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for n in order[1:]:
            new = set.intersection(*(dom[p] for p in preds[n])) | {n} if preds[n] else {n}
            if new != dom[n]:
                dom[n], changed = new, True
    return {n: d - {root} for n, d in dom.items() if n != root}


def loops(instrs: list[Instruction], labels: dict[str, int]) -> list[Loop]:
    """Every natural loop (back edges to one header merged), with its fast-path counts."""
    if not instrs:
        return []
    cfg = blocks(instrs, labels)
    dom = _dominators(cfg, instrs[0].address)
    preds: dict[int, list] = {n: [] for n in dom}
    back: dict[int, list] = {}
    for n in dom:
        for succ, _ in cfg[n].succs:
            preds[succ].append(n)
            if succ in dom[n]:
                back.setdefault(succ, []).append(n)
    bodies = {}
    for header, latches in sorted(back.items()):
        body, work = {header}, list(latches)
        while work:
            n = work.pop()
            if n not in body:
                body.add(n)
                work.extend(preds[n])
        bodies[header] = body
    out = []
    for header, latches in sorted(back.items()):
        body = bodies[header]
        longest, shortest = _paths(cfg, dom, body, header, set(latches))
        code = [i for n in longest for i in cfg[n].instrs]
        order = mma_order(code)
        nested = set().union(*(b for h, b in bodies.items() if h != header and b < body))
        steady, quiet = _steady_paths(cfg, dom, body - nested, header, set(latches))
        out.append(Loop(header, max(cfg[n].instrs[-1].address for n in latches), len(code),
                        sum(is_mma(i.opcode) for i in code), sum(hgmma_flops(i.opcode) for i in code),
                        sum(i.opcode.startswith("MUFU.EX2") for i in code), sum(is_lds(i.opcode) for i in code),
                        sum(is_sts(i.opcode) for i in code), sum(is_barrier_wait(i.opcode) for i in code),
                        sum(map(is_cta_barrier, code)), sum(map(is_named_barrier, code)), frozenset(body),
                        sum(len(cfg[n].instrs) for n in shortest), sum(is_copy_in(i.opcode) for i in code),
                        order, p_barriers(cfg, body, code) if "PV" in order else 0,
                        sum(map(ex2_emulated, code)), sum(i.opcode.startswith("STTM") for i in code),
                        (steady[0] if steady else 0, quiet[0] if quiet else 0),
                        sum(tmem_load_columns(i.opcode) for n in (steady or (0, ()))[1] for i in cfg[n].instrs)))
    return out


def ex2_emulated(ins: Instruction) -> int:
    """Exponentials an instruction starts on the FMA pipe: our ``exp2_fma`` and FA4's ``ex2_emulation`` (its
    ``ex2_emu_freq``) both take ``floor(x)`` by adding 2^23 + 2^22 rounded down (``add.rm``), then a polynomial in
    FMAs. A rounded-down add is that floor step, and nothing else in a softmax rounds down: ``FADD2.RM`` starts two
    (f32x2), ``FADD.RM`` one."""
    if not re.match(r"FADD2?\.(\w+\.)*RM\b", ins.opcode):
        return 0
    return 2 if ins.opcode.startswith("FADD2") else 1


def tmem_load_columns(op: str) -> int:
    """Columns of a row a ``tcgen05.ld`` of the 32x32b shape reads (``LDTM.x32``: 32)."""
    m = re.match(r"LDTM\.(?:\w+\.)*x(\d+)$", op)
    return int(m[1]) if m else 0


def _steady_paths(cfg: dict[int, Block], dom: dict[int, set], body: set, header: int, latches: set) -> tuple:
    """The longest way of a steady iteration and the longest that stores nothing to tensor memory (``STTM``: the
    correction warpgroup skipping the O rescale), each ``(instructions, blocks)`` or None: fast paths (no failed wait)
    through ``body``, a loop less its nested loops' blocks (a pass that runs an inner loop, such as the zero fill of
    a tail tile, is no steady iteration)."""
    memo: dict[int, tuple] = {}

    def walk(n: int) -> tuple:  # (longest, longest storing nothing) from n on, None where no iteration ends
        if n not in memo:
            size = len(cfg[n].instrs)
            stores = any(i.opcode.startswith("STTM") for i in cfg[n].instrs)
            tails = [walk(succ) for succ, failed in cfg[n].succs
                     if succ in body and not failed and succ not in dom[n]]
            tails += [((0, ()), (0, ()))] if n in latches else []
            hi = max((t[0] for t in tails if t[0]), key=lambda w: w[0], default=None)
            quiet = None if stores else max((t[1] for t in tails if t[1]), key=lambda w: w[0], default=None)
            memo[n] = tuple(w and (size + w[0], (n,) + w[1]) for w in (hi, quiet))
        return memo[n]

    return walk(header)


def _starts_group(ins: Instruction) -> bool:
    """A tcgen05 MMA that starts an accumulation: its accumulate operand (the last) is not the constant ``UPT``."""
    return is_tcgen05_mma(ins.opcode) and ins.text.split(",")[-1].strip() != "UPT"


def _reads_p(ins: Instruction) -> bool:
    """A tcgen05 MMA whose A operand is in tensor memory: attention's PV, P the softmax wrote there."""
    return ins.text.strip().startswith("tmem")


def mma_order(code: list[Instruction]) -> str:
    """The mbarrier waits and tcgen05 MMA groups of a sequence in issue order: ``w`` a wait (``SYNCS.PHASECHK``),
    ``QK`` / ``PV`` a group's first MMA, the one whose accumulate operand (the last) is not the constant ``UPT``
    (zero-init, or a first k-block accumulating on a condition); ``PV`` when its A operand is in tensor memory (P, the
    softmax's output), ``QK`` when in shared memory. Later k-blocks of a group (``UPT``) are not listed, so a wait
    between them (FA4 waits for the last part of P half-way through a PV) stands inside its group."""
    out = []
    for ins in code:
        if ins.opcode.startswith("SYNCS.PHASECHK"):
            out.append("w")
        elif _starts_group(ins):
            out.append("PV" if _reads_p(ins) else "QK")
    return " ".join(out)


_REGISTER = re.compile(r"\bU?R\d+\b")


def p_barriers(cfg: dict[int, Block], body: set, code: list[Instruction]) -> int:
    """How many mbarriers a loop waits on for P, at least: its waits whose next MMA or wait, on any way through the
    body, is a PV group's first MMA, told apart by address; one whose address the loop changes from one iteration
    to the next (a register it computes from one the loop carries: a slot index) is two. One P barrier is one S
    buffer: the QK a warp issues before waiting on it is the one whose P it waits for."""
    fast, work = set(), [code[0].address] if code else []
    while work:  # the blocks an iteration reaches with every wait succeeding: no retry
        n = work.pop()
        if n not in fast:
            fast.add(n)
            work.extend(succ for succ, failed in cfg[n].succs if succ in body and not failed)
    written = {r for n in body for i in cfg[n].instrs for r in _destination(i)}
    sites = {}
    for n in fast:
        instrs = cfg[n].instrs
        for k, ins in enumerate(instrs):
            if ins.opcode.startswith("SYNCS.PHASECHK") and _next_starts_pv(cfg, body, n, k + 1):
                address = ins.text.split("[")[1].split("]")[0]
                sites[address] = max(sites.get(address, 1), 2 if _varies(code, written, ins, address) else 1)
    return sum(sites.values())


def _destination(ins: Instruction) -> list[str]:
    """The register an instruction writes (its first operand), none where that is a memory or descriptor operand."""
    first = ins.text.split(",")[0]
    return [] if "[" in first else _REGISTER.findall(first)


def _next_starts_pv(cfg: dict[int, Block], body: set, block: int, k: int) -> bool:
    """Whether, from instruction ``k`` of ``block`` on, some fast way through the loop body meets a PV group's first
    MMA before any other MMA or mbarrier wait."""
    seen, work = set(), [(block, k)]
    while work:
        n, k = work.pop()
        for ins in cfg[n].instrs[k:]:
            if ins.opcode.startswith("SYNCS.PHASECHK") or is_tcgen05_mma(ins.opcode):
                if _starts_group(ins) and _reads_p(ins):
                    return True
                break
        else:
            for succ, failed in cfg[n].succs:
                if succ in body and not failed and succ not in seen:
                    seen.add(succ)
                    work.append((succ, 0))
    return False


def _varies(code: list[Instruction], written: set, at: Instruction, operands: str) -> bool:
    """Whether registers of ``operands`` read by ``at`` (an instruction of ``code``, one iteration's way) may hold
    another value each iteration: the last write before ``at`` is guarded or reads such a register, or there is none
    in the iteration and the loop writes the register (``written``: its value comes from the previous iteration)."""
    if at not in code:  # off the iteration's longest way: its own address
        return False
    pos = code.index(at)
    for reg in _REGISTER.findall(operands):
        last = next((i for i in reversed(code[:pos]) if _destination(i) == [reg]), None)
        if last is None:
            if reg in written:
                return True
        elif last.guard or _varies(code, written, last, ",".join(last.text.split(",")[1:])):
            return True
    return False


def mma_in_flight(order: str, p_barriers: int) -> Optional[int]:
    """QK groups an MMA warp's loop (``mma_order``, one iteration, repeated) issues between two waits for P, the least
    over its P waits (a P wait: the last wait before a PV group), and at most one less than the P barriers (S
    buffers): with one, the QK issued before a wait is the one whose P it waits for. 0: the warp blocks on a
    softmax's P with no S tile given to the tensor core since that softmax's S. None without a PV group, or without
    a wait before one."""
    events = order.split()
    n = len(events)
    if "PV" not in events:
        return None
    waits = set()
    for k in (k for k, ev in enumerate(events) if ev == "PV"):
        back = [(k - d) % n for d in range(1, n + 1)]
        wait = next((i for i in back if events[i] == "w"), None)
        if wait is None:
            return None  # no wait in the loop: P is not waited for here
        waits.add(wait)
    ring = sorted(waits)
    return min([p_barriers - 1] + [sum(events[i % n] == "QK" for i in range(a + 1, b + (n if b <= a else 0)))
                                   for a, b in zip(ring, ring[1:] + ring[:1])])


def _paths(cfg: dict[int, Block], dom: dict[int, set], body: set, header: int, latches: set) -> tuple:
    """The longest and the shortest block sequences of one iteration's fast path (no failed wait, no nested back
    edge), header to latch: a branch's two ways are never added together."""
    memo: dict[int, tuple] = {}

    def walk(n: int) -> tuple:  # (longest, shortest) from n on, each (instructions, blocks); an acyclic walk
        if n not in memo:
            size = len(cfg[n].instrs)
            tails = [walk(succ) for succ, failed in cfg[n].succs
                     if succ in body and not failed and succ not in dom[n]]  # (a back edge goes to a dominator)
            ends = [((0, ()), (0, ()))] if n in latches else []
            options = tails + ends
            if not options:  # leaves the loop: no iteration ends here
                memo[n] = ((float("-inf"), ()), (float("inf"), ()))
            else:
                hi = max((t[0] for t in options), key=lambda t: t[0])
                lo = min((t[1] for t in options), key=lambda t: t[0])
                memo[n] = ((size + hi[0], (n,) + hi[1]), (size + lo[0], (n,) + lo[1]))
        return memo[n]

    (_, longest), (_, shortest) = walk(header)
    return longest, shortest


def _innermost(candidates: list[Loop]) -> list[Loop]:
    """Loops that hold no other candidate: a persistent kernel's loop over work tiles holds its tile loop."""
    return [a for a in candidates if not any(b is not a and b.blocks <= a.blocks for b in candidates)]


def main_loop(all_loops: list[Loop]) -> Optional[Loop]:
    if not all_loops:
        return None
    with_mma = _innermost([lp for lp in all_loops if lp.mma])
    if with_mma:
        return max(with_mma, key=lambda lp: (lp.mma, -lp.instructions))
    return max(all_loops, key=lambda lp: lp.instructions)


def load_loop(all_loops: list[Loop]) -> Optional[Loop]:
    """The innermost loop without MMAs with the most global-to-shared copies (ties: the fewest instructions)."""
    loading = _innermost([lp for lp in all_loops if lp.copies_in and not lp.mma])
    return max(loading, key=lambda lp: (lp.copies_in, -lp.instructions)) if loading else None


def exponentials(lp: Loop) -> int:
    """Exponentials a loop computes, on either pipe."""
    return lp.ex2 + lp.ex2_emulated


def softmax_loop(all_loops: list[Loop]) -> Optional[Loop]:
    with_exp = _innermost([lp for lp in all_loops if lp.ex2])
    return max(with_exp, key=lambda lp: (exponentials(lp), -lp.instructions)) if with_exp else None


def masked_loop(all_loops: list[Loop]) -> Optional[Loop]:
    """The softmax loop's masked twin: of the other innermost loops with as many exponentials (whichever pipe: a
    masked tile may emulate fewer), the longest (its longest way: a warp with a row cut by the mask). None where the
    mask is applied outside a loop (FA4's decode)."""
    steady = softmax_loop(all_loops)
    twins = [lp for lp in _innermost([lp for lp in all_loops if lp.ex2])
             if lp is not steady and exponentials(lp) == exponentials(steady)]
    return max(twins, key=lambda lp: lp.instructions) if twins else None


def correction_loop(all_loops: list[Loop]) -> Optional[Loop]:
    """The SM100 correction warpgroup's walk over key tiles: the innermost loop that stores to tensor memory (O
    rescaled in place) with no MMA and no ``MUFU.EX2`` (the softmax's loops store P), the most columns rescaled."""
    rescaling = _innermost([lp for lp in all_loops if lp.tmem_stores and not lp.mma and not lp.ex2])
    return max(rescaling, key=lambda lp: (lp.steady_columns, -lp.instructions)) if rescaling else None


@dataclasses.dataclass(frozen=True)
class Launch:
    threads: int
    dynamic_smem: int
    cluster: tuple[int, int, int] = (1, 1, 1)


# The struct the generated host code fills for cudaLaunchKernelEx: grid, block, sharedMemBytes, stream, attrs, count;
# a launch attribute (id, pad, value) and the cluster dimension's value (x, y, z).
_LAUNCH_STRUCT = "!llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
_ATTR_STRUCT = "!llvm.struct<(i32, array<4 x i8>, array<64 x i8>)>"
_DIM3_STRUCT = "!llvm.struct<(i32, i32, i32)>"
CLUSTER_DIMENSION = 4  # cudaLaunchAttributeClusterDimension
_CONST = re.compile(r"(%\w+) = llvm\.mlir\.constant\((-?\d+) : i\d+\)")
_GEP = re.compile(r"(%\w+) = llvm\.getelementptr %\w+\[0, ([\d, ]+)\] .*" + re.escape(_LAUNCH_STRUCT))
_ATTR_ID = re.compile(r"(%\w+) = llvm\.getelementptr %\w+\[0, 0\] .*" + re.escape(_ATTR_STRUCT))
_DIM3 = re.compile(r"(%\w+) = llvm\.getelementptr %\w+\[0, (\d)\] .*" + re.escape(_DIM3_STRUCT))
_STORE = re.compile(r"llvm\.store (%\w+), (%\w+) :")


def launch_from_host_ir(ir: str) -> Launch:
    """Threads per CTA, dynamic shared memory and cluster shape of the (single) kernel launch in the compiled host
    IR (the cluster from a cluster-dimension launch attribute; (1, 1, 1) without one)."""
    consts: dict[str, int] = {}
    fields: dict[str, tuple[int, ...]] = {}
    found: dict[tuple[int, ...], Optional[int]] = {}
    attr_ids, dims, attr, cluster = set(), {}, None, [1, 1, 1]
    for line in ir.splitlines():
        s = line.strip()
        if s.startswith("llvm.func"):
            consts, fields = {}, {}
        elif m := _CONST.match(s):
            consts[m[1]] = int(m[2])
        elif m := _GEP.match(s):
            fields[m[1]] = tuple(int(x) for x in m[2].split(","))
        elif m := _ATTR_ID.match(s):
            attr_ids.add(m[1])
        elif m := _DIM3.match(s):
            dims[m[1]] = int(m[2])
        elif m := _STORE.match(s):
            if m[2] in fields:
                found[fields[m[2]]] = consts.get(m[1])
            elif m[2] in attr_ids:
                attr = consts.get(m[1])
            elif m[2] in dims and attr == CLUSTER_DIMENSION:
                cluster[dims[m[2]]] = consts.get(m[1])
    block = [found.get((1, i)) for i in range(3)]
    smem = found.get((2,))
    if None in block or smem is None or None in cluster:
        raise ValueError("no launch with a constant block, shared-memory size and cluster in the host IR")
    return Launch(block[0] * block[1] * block[2], smem, tuple(cluster))


def occupancy(registers: int, threads: int, smem: int) -> dict:
    """CTAs per SM allowed by each resource, and the least of them (``ctas_per_sm``)."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = (REGS_PER_SM // regs_per_warp) // warps if registers else MAX_CTAS_PER_SM
    by_threads = MAX_WARPS_PER_SM // warps
    if smem > SMEM_PER_CTA_MAX:
        by_smem = 0
    else:
        per_cta = -(-smem // SMEM_ALLOC_UNIT) * SMEM_ALLOC_UNIT + SMEM_RESERVED_PER_CTA
        by_smem = SMEM_PER_SM // per_cta
    return {"ctas_by_regs": by_regs, "ctas_by_threads": by_threads, "ctas_by_smem": by_smem,
            "ctas_per_sm": min(by_regs, by_threads, by_smem, MAX_CTAS_PER_SM)}


def analyze(ptx: str, arch: str, launch: Optional[Launch] = None, head_dim: Optional[int] = None,
            keep_dir: Optional[str] = None, v_dim: Optional[int] = None) -> dict:
    """One flat record: ptxas resources, launch, occupancy, SASS counts and the main / softmax loops. ``v_dim``: the
    width of O, where it is not ``head_dim`` (the correction loop's S tiles are its O columns over it)."""
    with tempfile.TemporaryDirectory() as work:
        res, cubin = assemble(ptx, arch, work)
        sass = disassemble(cubin)
        if keep_dir:
            os.makedirs(keep_dir, exist_ok=True)
            for ext, text in (("ptx", ptx), ("sass", sass)):
                with open(os.path.join(keep_dir, f"kernel.{arch}.{ext}"), "w") as f:
                    f.write(text)
    if launch is None:
        launch = _launch_from_ptx(ptx)
    instrs, labels = parse_sass(sass)
    rec = dataclasses.asdict(res)
    rec.update(arch=arch, threads=launch.threads, dynamic_smem=launch.dynamic_smem,
               smem=res.static_smem + launch.dynamic_smem)
    rec.update(occupancy(res.registers, launch.threads, rec["smem"]))
    ops = [i.opcode for i in instrs]
    rec.update(instructions=len(instrs), mma=sum(map(is_mma, ops)), barrier_waits=sum(map(is_barrier_wait, ops)),
               cta_barriers=sum(map(is_cta_barrier, instrs)), named_barriers=sum(map(is_named_barrier, instrs)),
               mbarrier_waits=sum(op.startswith("SYNCS.PHASECHK") for op in ops),
               lds=sum(map(is_lds, ops)), sts=sum(map(is_sts, ops)), ex2=sum(op.startswith("MUFU.EX2") for op in ops),
               local_loads=sum(op.startswith("LDL") for op in ops),
               local_stores=sum(op.startswith("STL") for op in ops))
    rec.update(ptx_facts(ptx))
    all_loops = loops(instrs, labels)
    for name, lp in (("loop", main_loop(all_loops)), ("softmax_loop", softmax_loop(all_loops))):
        if lp is None:
            continue
        rec.update({f"{name}_instructions": lp.instructions, f"{name}_instructions_shortest": lp.shortest,
                    f"{name}_mma": lp.mma, f"{name}_ex2": lp.ex2,
                    f"{name}_lds": lp.lds, f"{name}_sts": lp.sts, f"{name}_barrier_waits": lp.barrier_waits,
                    f"{name}_cta_barriers": lp.cta_barriers, f"{name}_named_barriers": lp.named_barriers})
        if name == "loop" and set(lp.mma_order.split()) - {"w"}:  # tcgen05 MMAs: the MMA warp's loop
            rec.update(loop_mma_order=lp.mma_order, loop_qk_groups=lp.mma_order.split().count("QK"),
                       loop_p_barriers=lp.p_barriers, mma_in_flight=mma_in_flight(lp.mma_order, lp.p_barriers))
        if name == "loop" and head_dim and lp.mma_flops:
            rec["loop_s_blocks"] = lp.mma_flops / (4 * 64 * 64 * head_dim)
            rec["instructions_per_s_block"] = round(lp.instructions / rec["loop_s_blocks"], 1)
            rec["instructions_per_s_block_shortest"] = round(lp.shortest / rec["loop_s_blocks"], 1)
    lp = softmax_loop(all_loops)
    if lp is not None:
        rec["softmax_loop_ex2_emulated"] = lp.ex2_emulated
        masked = masked_loop(all_loops)
        if masked is not None:
            rec.update(masked_loop_instructions=masked.instructions, masked_loop_ex2=masked.ex2,
                       masked_loop_ex2_emulated=masked.ex2_emulated)
    lp = correction_loop(all_loops)
    o_cols = v_dim or head_dim
    if lp is not None and o_cols and lp.steady_columns and lp.steady_columns % o_cols == 0:
        # per S tile: FA4 rescales both Q tiles' O in one iteration (its q_stage), ours one Q tile's
        tiles = lp.steady_columns // o_cols
        rec.update(correction_loop_s_tiles=tiles, correction_loop_instructions=lp.steady[0] / tiles,
                   correction_loop_instructions_skip=lp.steady[1] / tiles)
    lp = load_loop(all_loops)
    if lp is not None:
        rec.update(load_loop_instructions=lp.instructions, load_loop_instructions_shortest=lp.shortest,
                   load_loop_copies=lp.copies_in)
    return rec


def analyze_config(config, keep_dir: Optional[str] = None, compiled: Optional[Callable] = None) -> dict:
    """Compile one ``cute_kv.kernels.catalog`` configuration and analyze it beside its plan. ``compiled(kernel,
    arch)`` may supply the ``(ptx, host IR)`` of a compile made elsewhere (the tests' run-wide cache)."""
    kernel = config.kernel()
    if compiled is None:
        from cute_kv.kernels import compile_cache

        fn = compile_cache.compile_uncached(lambda: config.family.build(kernel), config.arch)
        ptx, host_ir = fn.__ptx__, str(fn.ir_module)
    else:
        ptx, host_ir = compiled(kernel, config.arch)
    head_dim = config.family.head_dim(kernel) if config.family.head_dim else None
    rec = {"kernel": config.family.name, "config": config.label, "impl": "cute-kv"}
    rec.update(analyze(ptx, config.arch, launch_from_host_ir(host_ir), head_dim, keep_dir,
                       getattr(kernel, "v_dim", None)))
    plan = config.family.plan(kernel)
    rec.update(plan_threads=plan.threads, plan_smem=plan.smem, plan_ctas_per_sm=plan.ctas_per_sm,
               register_budget=plan.register_budget)
    return rec


def ptx_facts(ptx: str) -> dict:
    """Warp-role register splits (``setmaxnreg`` targets) and the tensor-memory columns a tcgen05 kernel allocates
    (``tcgen05.alloc``'s count, a constant moved into its register)."""
    facts = {"setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})}
    m = re.search(r"tcgen05\.alloc\.[\w:.]+\s+\[[^\]]+\],\s*(%r\d+|\d+);", ptx)
    if m:
        count = m[1] if m[1].isdigit() else re.search(rf"mov\.[bu]32\s+{m[1]},\s*(\d+);", ptx)
        facts["tmem_columns"] = int(count if isinstance(count, str) else count[1]) if count else None
    return facts


def _launch_from_ptx(ptx: str) -> Launch:
    """Threads from the kernel's ``.reqntid`` where the host IR is not at hand (no dynamic shared memory known)."""
    m = re.search(r"\.reqntid\s+(\d+),\s*(\d+),\s*(\d+)", ptx)
    if m is None:
        raise ValueError("the PTX has no .reqntid: pass the launch")
    return Launch(int(m[1]) * int(m[2]) * int(m[3]), 0)


@functools.lru_cache(maxsize=None)
def tools_available() -> Optional[str]:
    """None when ptxas and nvdisasm are found, else why not."""
    try:
        find_tool("ptxas"), find_tool("nvdisasm")
    except ToolMissing as e:
        return str(e)
    return None


if __name__ == "__main__":  # python perf/static.py k.ptx sm_90a
    import json

    print(json.dumps(analyze(open(sys.argv[1]).read(), sys.argv[2]), indent=1))
