"""Barrier accounting from a kernel's PTX: for every mbarrier, the arrivals one phase receives against the count it
is initialized with, and a replay of each producer/consumer ring's phases. No GPU: the PTX the DSL emits.

* Barriers: every ``mbarrier.init`` names a shared-memory address (the dynamic shared memory's base plus a constant)
  and an arrival count. Inits that follow one another at 8-byte steps form one array, a pipeline's full or empty
  barriers (one per stage).
* Sites and what each counts per thread that executes it: ``mbarrier.arrive`` its count operand (1 without one),
  ``mbarrier.arrive.expect_tx`` 1 (and transaction bytes), ``tcgen05.commit`` 1 on its CTA or on each CTA of its
  multicast mask, ``cp.async.mbarrier.arrive.noinc`` 1 (without ``.noinc`` the pending count is raised and lowered:
  0). TMA (``complete_tx`` of ``cp.async.bulk``, ``st.async``, ``clusterlaunchcontrol``) and ``mbarrier.expect_tx``
  move transaction bytes only; ``mbarrier.try_wait`` / ``test_wait`` wait. A ``mapa`` in an address's definition
  sends the arrival to the CTA it names; CUTLASS's 2-CTA peer mask (an ``and`` clearing rank bits above bit 24) to
  the pair's even CTA.
* Values: a register's definition is the one that reaches the use (reaching definitions over the control-flow
  graph). Registers decided by the thread's identity (``%tid``, ``%laneid``, ``%cluster_ctarank``, ``%ctaid`` modulo
  the cluster's extent, warp-uniform ``shfl`` broadcasts and arithmetic on them) are evaluated per thread. An address
  is the base plus constants plus multiples of registers; one the thread's identity does not decide (a loop's stage
  index, several definitions reaching it) is a ring index: the site arrives on each barrier of the array it starts,
  one stage per step.
* Who reaches a site: the branch conditions that hold on every path to it (a must-analysis over the control-flow
  graph) and its guard, evaluated for every thread of the CTA (``.reqntid``) in every CTA of the cluster (the
  launch's cluster shape). A condition on the thread's identity (warp index, lane, ``tid % 32``, the CTA's rank)
  decides per thread; one on data is taken as possibly true (it decides whether a phase happens, which the replay
  models, not who arrives). An ``elect.sync`` predicate keeps one lane of each warp that reaches it. A condition
  that data decides differently per thread (``tid < n`` with ``n`` loaded) decides who arrives: since the thread's
  last wait it is a finding (before it, it picks which copy of a loop runs, each with its wait and arrival).
* Arrivals per phase: the sum over a barrier's distinct arrivers (sites reached by the same threads with the same
  kind are alternative paths of one arrival, e.g. a loop's peeled copy). The warps reaching each site must lie in a
  role the kernel declares (``cute_kv.kernels.catalog.Role``), and each declared role must be the warps of some
  site; a role whose warp groups take turns (SM90 ping-pong) gives one group's arrivals to each phase. A count that
  differs from the init, or an array nothing arrives on or waits for, is a finding naming the barrier, the count
  and the arrivers.
* Order (``Analysis.ordering``): sites the count takes as one arrival (the same arrivers) must not follow one
  another on the same barrier with no wait between (an mbarrier's, or a named barrier's sync; a ring's index
  advancing between them makes it the next stage); and an arrive by some lanes of a warp (lane 0, an elected lane) must come after a ``bar.warp.sync``
  when other lanes of the warp accessed shared memory since the last one: the arrival's release orders only its own
  thread's accesses (CUTLASS's one-lane-per-warp ``consumer_release``). Not seen: an arrive that a loop repeats
  within one phase (the count takes a site once), a per-thread condition that skips a wait and its arrive together.

``replay``: a model of the mbarrier phase rules (pending arrivals, transaction bytes, the phase, waits on parity)
driving a ring's ``stages`` full / empty barrier pairs with ``PipelineState``'s index and phase walk: producer
acquire and commit, consumer wait and release, and the producer's tail (a wait on every stage).

    python perf/run.py barriers                       # the table for every catalog configuration
    python perf/run.py barriers -- --kernels w4_100 attention_sm100
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import re
import sys
from collections import defaultdict
from typing import Optional

WARP = 32
MBARRIER_BYTES = 8


# -- PTX -------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Instr:
    index: int
    line: int
    op: str
    args: list[str]
    guard: Optional[tuple[str, bool]]  # (predicate, value it must have)
    asm: bool  # inside an inline-asm scope: not part of the control-flow graph

    @property
    def text(self) -> str:
        g = "" if self.guard is None else f"@{'' if self.guard[1] else '!'}{self.guard[0]} "
        return f"{g}{self.op} {', '.join(self.args)}"


_LABEL = re.compile(r"([$A-Za-z_][\w$]*):(?!:)")
# Instructions whose first operand is not a register they write (everything else may define its first operand).
_NOT_DEFINING = ("st.", "red.", "bra", "bar.", "barrier.", "mbarrier.init", "mbarrier.expect_tx", "cp.", "fence.",
                 "tcgen05.mma", "tcgen05.commit", "tcgen05.st", "tcgen05.cp", "tcgen05.fence", "tcgen05.alloc",
                 "tcgen05.dealloc", "tcgen05.relinquish", "tcgen05.wait", "tcgen05.shift", "prefetch",
                 "griddepcontrol", "setmaxnreg", "ret", "exit", "trap", "wgmma.fence", "wgmma.commit", "wgmma.wait",
                 "stmatrix", "clusterlaunchcontrol.try_cancel", "membar", "nanosleep", "discard", "applypriority")


def _split_args(s: str) -> list[str]:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    tail = "".join(cur).strip()
    return out + ([tail] if tail else [])


def _entry_body(ptx: str) -> tuple[str, int]:
    """The text of the (single) kernel's body and the line it starts on."""
    m = re.search(r"\.entry\s+[\w$]+\s*\(", ptx)
    if m is None:
        raise ValueError("the PTX has no .entry")
    start = ptx.index("{", ptx.index(")", m.end()))
    depth = 0
    for pos in range(start, len(ptx)):
        depth += {"{": 1, "}": -1}.get(ptx[pos], 0)
        if depth == 0:
            return ptx[start + 1:pos], ptx.count("\n", 0, start) + 1
    raise ValueError("unbalanced braces in the PTX")


def parse(ptx: str) -> tuple[list[Instr], dict[str, int]]:
    """The kernel's instructions (inline-asm scopes flattened, marked ``asm``) and its labels -> instruction index."""
    body, line0 = _entry_body(re.sub(r"//[^\n]*", "", ptx))
    newlines = [i for i, ch in enumerate(body) if ch == "\n"]
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pos, depth = 0, 0
    while pos < len(body):
        if body[pos].isspace():
            pos += 1
            continue
        if body[pos] in "{}":
            depth += 1 if body[pos] == "{" else -1
            pos += 1
            continue
        m = _LABEL.match(body, pos)
        if m:
            if depth == 0:
                labels[m[1]] = len(instrs)
            pos = m.end()
            continue
        end = body.find(";", pos)
        stmt = body[pos:end].strip()
        line = line0 + bisect.bisect_left(newlines, pos)
        pos = end + 1
        if stmt.startswith("."):  # declarations (.reg, .pragma)
            continue
        guard = None
        g = re.match(r"@(!?)(%?\w+)\s+", stmt)
        if g:
            guard = (g[2], not g[1])
            stmt = stmt[g.end():]
        op, *rest = re.split(r"\s+", stmt, maxsplit=1)
        instrs.append(Instr(len(instrs), line, op, _split_args(rest[0] if rest else ""), guard, depth > 0))
    return instrs, labels


def _defined(ins: Instr) -> list[str]:
    if not ins.args or ins.op.startswith(_NOT_DEFINING) or ins.op.startswith("mbarrier.arrive") and ins.args[0] == "_":
        return []
    dest = ins.args[0].strip("{}")
    return [r.strip() for part in dest.split(",") for r in part.split("|") if r.strip().startswith("%")]


@dataclasses.dataclass
class Block:
    start: int
    end: int  # exclusive
    # (successor block start, the condition the edge implies: (predicate, value, the branch's index))
    succs: list[tuple[int, Optional[tuple[str, bool, int]]]]


def blocks(instrs: list[Instr], labels: dict[str, int]) -> dict[int, Block]:
    """Basic blocks, by the index of their first instruction. An inline-asm scope is straight-line code (a wait's
    retry loop): its branches are not edges."""
    leaders = {0} | {i for i in labels.values() if i < len(instrs)}
    leaders |= {i.index + 1 for i in instrs if not i.asm and i.op.startswith(("bra", "ret", "exit", "trap"))
                and i.index + 1 < len(instrs)}
    starts = sorted(leaders)
    out = {}
    for n, s in enumerate(starts):
        e = starts[n + 1] if n + 1 < len(starts) else len(instrs)
        flow = [i for i in instrs[s:e] if not i.asm]
        last = flow[-1] if flow else None
        nxt = e if e < len(instrs) else None
        succs = []
        if last is not None and last.op.startswith("bra"):
            target = labels[last.args[0]]
            if last.guard is None:
                succs.append((target, None))
            else:
                p, v = last.guard
                succs.append((target, (p, v, last.index)))
                if nxt is not None:
                    succs.append((nxt, (p, not v, last.index)))
        elif (last is None or not last.op.startswith(("ret", "exit", "trap"))) and nxt is not None:
            succs.append((nxt, None))
        out[s] = Block(s, e, succs)
    return out


def must_facts(cfg: dict[int, Block], keep) -> dict[int, frozenset]:
    """Conditions ``(predicate, value, branch)`` that hold on entry to each block on every path from the entry
    (``keep(predicate, branch)``: the ones worth tracking)."""
    facts: dict[int, Optional[frozenset]] = {s: None for s in cfg}  # None: not reached yet (every fact holds)
    facts[0] = frozenset()
    preds = defaultdict(list)
    for s, b in cfg.items():
        for t, cond in b.succs:
            preds[t].append((s, cond))
    order = sorted(cfg)
    changed = True
    while changed:
        changed = False
        for s in order:
            if s == 0:
                continue
            acc = None
            for p, cond in preds[s]:
                if facts[p] is None:
                    continue
                f = facts[p] | ({cond} if cond is not None and keep(cond[0], cond[2]) else set())
                acc = f if acc is None else acc & f
            if acc is not None and acc != facts[s]:
                facts[s] = frozenset(acc)
                changed = True
    return {s: f or frozenset() for s, f in facts.items()}


# -- values ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ctx:
    """One thread: its index in the CTA and its CTA's rank in the cluster."""

    tid: int
    rank: int


@dataclasses.dataclass(frozen=True)
class Affine:
    const: int
    terms: tuple[tuple[str, int], ...] = ()  # (leaf, coefficient), sorted

    def __add__(self, o: "Affine") -> "Affine":
        t = dict(self.terms)
        for k, c in o.terms:
            t[k] = t.get(k, 0) + c
        return Affine(self.const + o.const, tuple(sorted((k, c) for k, c in t.items() if c)))

    def scale(self, f: int) -> "Affine":
        return Affine(self.const * f, tuple((k, c * f) for k, c in self.terms))


SMEM = "$smem"  # the dynamic shared memory's base: the one base every barrier address here is relative to
# What decides a value (``Program.taint``): the thread's identity, data (loads, parameters, the CTA's index), or both
# in one expression (a per-thread value from data: ``tid < n`` with n loaded, a load at a thread's own address).
ID, DATA, MIXED = 1, 2, 4
_IDENTITY = re.compile(r"%(tid|laneid|warpid|cluster_ctarank|cluster_ctaid)(\.[xyz])?$")
_CONSTANT = re.compile(r"%(ntid|nctaid|cluster_nctarank|cluster_nctaid|nwarpid)(\.[xyz])?$")
_REG = re.compile(r"%[A-Za-z_$][\w$]*")
_SPECIAL = re.compile(r"%(tid|ntid|laneid|cluster_ctarank|cluster_nctarank|cluster_ctaid|cluster_nctaid)(\.[xyz])?$")
_IMM = re.compile(r"-?(0[xX][0-9a-fA-F]+|\d+)[uU]?$")


def _imm(s: str) -> Optional[int]:
    """An integer immediate's value (None for registers, symbols and float immediates)."""
    s = s.strip()
    return int(s.rstrip("uU"), 0) if _IMM.match(s) else None


def _peer_mask(operand: str) -> Optional[int]:
    """The CTA-rank bits a 32-bit ``and`` mask keeps when it keeps every offset bit from 3 to 23 of a shared-memory
    window address (the low 3 bits of an 8-byte barrier are 0 anyway); None for other masks."""
    m = _imm(operand)
    if m is None:
        return None
    m &= 0xFFFFFFFF
    return m >> 24 if m & 0xFFFFF8 == 0xFFFFF8 and m >> 24 != 0xFF else None


class Program:
    """A parsed kernel: its instructions, control flow, and the values of registers per thread."""

    def __init__(self, ptx: str, cluster: tuple[int, int, int] = (1, 1, 1)):
        self.instrs, self.labels = parse(ptx)
        m = re.search(r"\.reqntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", ptx)
        if m is None:
            raise ValueError("the PTX has no .reqntid: the threads per CTA are not known")
        self.threads = int(m[1]) * int(m[2] or 1) * int(m[3] or 1)
        self.cluster = cluster
        self.ranks = cluster[0] * cluster[1] * cluster[2]
        self.cfg = blocks(self.instrs, self.labels)
        self.block_of: dict[int, int] = {}
        for s, b in self.cfg.items():
            for i in range(b.start, b.end):
                self.block_of[i] = s
        self._reaching_definitions()
        self.facts = must_facts(self.cfg, lambda p, at: True)
        self.contexts = [Ctx(t, r) for r in range(self.ranks) for t in range(self.threads)]
        self._values: dict[tuple, Optional[int]] = {}
        self._affine: dict[tuple, Optional[Affine]] = {}
        self._taint: dict[tuple, int] = {}
        self._reached: dict[int, tuple] = {}
        self.preds: dict[int, list[int]] = defaultdict(list)
        for s, b in self.cfg.items():
            for t, _ in b.succs:
                self.preds[t].append(s)

    def def_of(self, reg: str, at: int) -> Optional[Instr]:
        """The one definition of ``reg`` that reaches instruction ``at`` (None: several reach it, as a loop's
        induction variable, or none, or it is inside an inline-asm scope)."""
        defs = self.defs_reaching(reg, at)
        return defs[0] if len(defs) == 1 and not defs[0].asm else None

    def defs_reaching(self, reg: str, at: int) -> list[Instr]:
        """Every definition of ``reg`` that reaches instruction ``at``."""
        block = self.block_of.get(at)
        if block is None:
            return []
        ids = self._reach_in[block] & self._reg_defs.get(reg, 0)
        for i in range(block, at):
            if reg in self._defined_at.get(i, ()):
                ids = 1 << self._def_id[(i, reg)]
        out = []
        while ids:
            low = ids & -ids
            out.append(self.instrs[self._def_site[low.bit_length() - 1]])
            ids ^= low
        return out

    def _reaching_definitions(self):
        """Reaching definitions over the control-flow graph, as bit sets of definition ids."""
        self._def_id, self._def_site, self._reg_defs, self._defined_at = {}, [], {}, {}
        for ins in self.instrs:
            regs = _defined(ins)
            if regs:
                self._defined_at[ins.index] = regs
            for r in regs:
                self._def_id[(ins.index, r)] = len(self._def_site)
                self._reg_defs[r] = self._reg_defs.get(r, 0) | 1 << len(self._def_site)
                self._def_site.append(ins.index)
        gen, kill = {}, {}
        for s, b in self.cfg.items():
            last = {}
            for i in range(b.start, b.end):
                for r in self._defined_at.get(i, ()):
                    last[r] = self._def_id[(i, r)]
            gen[s] = sum(1 << k for k in last.values())
            kill[s] = 0
            for r in last:
                kill[s] |= self._reg_defs[r]
        preds = defaultdict(list)
        for s, b in self.cfg.items():
            for t, _ in b.succs:
                preds[t].append(s)
        reach_in = {s: 0 for s in self.cfg}
        out = {s: gen[s] for s in self.cfg}
        changed = True
        while changed:
            changed = False
            for s in sorted(self.cfg):
                i = 0
                for p in preds[s]:
                    i |= out[p]
                o = gen[s] | (i & ~kill[s])
                if i != reach_in[s] or o != out[s]:
                    reach_in[s], out[s], changed = i, o, True
        self._reach_in = reach_in

    # values for one thread (None: not decided by the thread's identity)

    def value(self, operand: str, at: int, ctx: Ctx) -> Optional[int]:
        operand = operand.strip()
        imm = _imm(operand)
        if imm is not None:
            return imm
        m = _SPECIAL.match(operand)
        if m:
            return self._special(m[1], (m[2] or ".x")[1:], ctx)
        ins = self.def_of(operand, at) if operand.startswith("%") else None
        if ins is None:
            return None
        key = (operand, ins.index, ctx)
        if key not in self._values:
            self._values[key] = None  # a definition through itself decides nothing
            self._values[key] = self._eval(ins, ctx, operand)
        return self._values[key]

    def _special(self, name: str, axis: str, ctx: Ctx) -> Optional[int]:
        cx, cy, _ = self.cluster
        if name == "tid":
            return ctx.tid if axis == "x" else 0
        if name == "ntid":
            return self.threads if axis == "x" else 1
        if name == "laneid":
            return ctx.tid % WARP
        if name == "cluster_ctarank":
            return ctx.rank
        if name == "cluster_nctarank":
            return self.ranks
        if name == "cluster_ctaid":
            return {"x": ctx.rank % cx, "y": ctx.rank // cx % cy, "z": ctx.rank // (cx * cy)}[axis]
        return dict(zip("xyz", self.cluster))[axis]  # cluster_nctaid

    def _eval(self, ins: Instr, ctx: Ctx, dest: str) -> Optional[int]:
        op, a = ins.op, ins.args
        base = op.split(".")[0]
        v = lambda k: self.value(a[k], ins.index, ctx)  # noqa: E731
        if base == "shfl" and ".idx" in op:  # the source lane's value (the warp-uniform broadcasts)
            lane = _imm(a[2])
            src = Ctx(ctx.tid - ctx.tid % WARP + lane, ctx.rank) if lane is not None else None
            return None if src is None else self.value(a[1], ins.index, src)
        if base in ("mov", "cvt", "cvta"):
            return v(1)
        if base == "setp":  # setp.cmp[.boolop] p[|q], x, y[, c]: p = (x cmp y) boolop c, q its negation
            x, y = v(1), v(2)
            r = None
            if x is not None and y is not None:
                if ".u" in op or ".b" in op:
                    x, y = x & 0xFFFFFFFF, y & 0xFFFFFFFF
                r = {"eq": x == y, "ne": x != y, "lt": x < y, "le": x <= y, "gt": x > y, "ge": x >= y,
                     "lo": x < y, "ls": x <= y, "hi": x > y, "hs": x >= y}.get(op.split(".")[1])
                r = None if r is None else int(r)
            if len(a) == 4:
                c = self.value(a[3].lstrip("!"), ins.index, ctx)
                c = None if c is None else c ^ a[3].startswith("!")
                boolop = op.split(".")[2]
                absorbing = {"and": 0, "or": 1}.get(boolop)
                if absorbing is not None and absorbing in (r, c):
                    r = absorbing
                elif r is None or c is None:
                    r = None
                else:
                    r = {"and": r & c, "or": r | c, "xor": r ^ c}[boolop]
            if r is not None and dest != _defined(ins)[0]:
                r ^= 1
            return r
        if base == "not":
            x = v(1)
            return None if x is None else (int(not x) if ".pred" in op else ~x)
        if base in ("and", "or") and ".pred" in op:  # three-valued: a decided operand may decide the result
            x, y = v(1), v(2)
            absorbing = 0 if base == "and" else 1
            return absorbing if absorbing in (x, y) else (None if None in (x, y) else 1 - absorbing)
        if base in ("and", "rem") and _imm(a[2]) is not None:
            grid = self._grid_residue(a[1], ins.index, _imm(a[2]) + (base == "and"), ctx)
            if grid is not None:
                return grid
        if base == "selp":
            c = v(3)
            return None if c is None else (v(1) if c else v(2))
        if base == "mad":
            x, y, z = v(1), v(2), v(3)
            return None if None in (x, y, z) else x * y + z
        if base == "neg":
            x = v(1)
            return None if x is None else -x
        binary = {"add": lambda x, y: x + y, "sub": lambda x, y: x - y, "mul": lambda x, y: x * y,
                  "shl": lambda x, y: x << y, "and": lambda x, y: x & y, "or": lambda x, y: x | y,
                  "xor": lambda x, y: x ^ y, "min": min, "max": max,
                  "shr": lambda x, y: (x & 0xFFFFFFFF) >> y if ".s" not in op else x >> y,
                  "div": lambda x, y: None if y == 0 else int(x / y), "rem": lambda x, y: None if y == 0 else x % y}
        if base in binary and len(a) == 3:
            x, y = v(1), v(2)
            return None if x is None or y is None else binary[base](x, y)
        return None  # elect.sync, loads, and what a thread's identity does not decide

    def _grid_residue(self, operand: str, at: int, modulus: int, ctx: Ctx) -> Optional[int]:
        """``%ctaid.<axis> % modulus`` where the modulus divides the cluster's extent on that axis (a power of two
        for ``and``): the CTA's coordinate in its cluster decides it (clusters tile the grid)."""
        ins = self.def_of(operand.strip(), at) if operand.strip().startswith("%") else None
        src = ins.args[1] if ins is not None and ins.op.split(".")[0] == "mov" else operand
        m = re.match(r"%ctaid\.([xyz])$", src.strip())
        if m is None or modulus <= 0 or modulus & (modulus - 1):
            return None
        axis = "xyz".index(m[1])
        if self.cluster[axis] % modulus:
            return None
        return self._special("cluster_ctaid", m[1], ctx) % modulus

    # addresses: affine forms over leaves, registers their definition does not make affine ("reg@use")

    def affine(self, operand: str, at: int) -> Optional[Affine]:
        operand = operand.strip()
        imm = _imm(operand)
        if imm is not None:
            return Affine(imm)
        if re.match(r"__dynamic_shmem__\d+$", operand):
            return Affine(0, ((SMEM, 1),))
        if not operand.startswith("%"):
            return None
        ins = self.def_of(operand, at)
        leaf = Affine(0, ((f"{operand}@{at}", 1),))
        if ins is None or _SPECIAL.match(operand):
            return leaf
        key = (operand, ins.index)
        if key not in self._affine:
            self._affine[key] = leaf
            self._affine[key] = self._affine_of(ins) or leaf
        return self._affine[key]

    def _affine_of(self, ins: Instr) -> Optional[Affine]:
        op, a, at = ins.op, ins.args, ins.index
        base = op.split(".")[0]
        if base in ("mov", "cvt", "cvta", "mapa") or base == "shfl" and ".idx" in op:
            return self.affine(a[1], at)
        if base == "and" and _peer_mask(a[2]) is not None:  # a CTA's address in the cluster: the offset stays
            return self.affine(a[1], at)
        if base in ("add", "sub"):
            x, y = self.affine(a[1], at), self.affine(a[2], at)
            if x is not None and y is not None:
                return x + (y if base == "add" else y.scale(-1))
        if base in ("shl", "mul") and len(a) == 3:
            x, k = self.affine(a[1], at), _imm(a[2])
            if k is None:
                x, k = self.affine(a[2], at), _imm(a[1])
            if x is not None and k is not None:
                return x.scale(1 << k if base == "shl" else k)
        if base == "mad":
            x, k, z = self.affine(a[1], at), _imm(a[2]), self.affine(a[3], at)
            if x is not None and k is not None and z is not None:
                return x.scale(k) + z
        return None

    def taint(self, operand: str, at: int) -> int:
        """``ID`` / ``DATA`` / ``MIXED`` flags of what decides ``operand`` at ``at``, over every definition reaching
        it. Predicates combined by ``and`` / ``or`` / ``not`` keep their parts apart (``warp == 0 && j < n``: the warp
        decides who, the data whether); any other operation on both makes them ``MIXED``, as does a load from an
        address the thread decides."""
        operand = operand.strip().lstrip("!")
        if _imm(operand) is not None or not operand.startswith("%") or _CONSTANT.match(operand):
            return 0
        if _IDENTITY.match(operand):
            return ID
        if _SPECIAL.match(operand) or re.match(r"%\w+\.[xyz]$|%(clock|globaltimer|smid)", operand):
            return DATA  # the CTA's index, clocks: the same for the CTA's threads or not decided by them
        defs = self.defs_reaching(operand, at)
        if any(d.index not in self._taint for d in defs):
            self._settle(defs)
        return _union(self._taint[d.index] for d in defs) if defs else DATA

    def _settle(self, defs: list[Instr]):
        """``_taint`` of ``defs`` and every definition they read, to a fixed point (loops carry registers)."""
        closure, todo = [], list(defs)
        while todo:
            d = todo.pop()
            if d.index in self._taint:
                continue
            self._taint[d.index] = 0
            closure.append(d)
            todo += [r for x in d.args[1:] for reg in _REG.findall(x) for r in self.defs_reaching(reg, d.index)]
        changed = True
        while changed:
            changed = False
            for d in closure:
                flags = self._taint_of(d)
                if flags != self._taint[d.index]:
                    self._taint[d.index], changed = flags, True

    def _taint_of(self, ins: Instr) -> int:
        op, a, at = ins.op, ins.args, ins.index
        base = op.split(".")[0]
        if ins.asm:
            return DATA
        if base == "elect":
            return ID
        taints = lambda args: [self.taint(r, at) for x in args for r in _REG.findall(x)]  # noqa: E731
        if base == "setp" and len(a) == 4:  # (x cmp y) boolop c: the comparison and c are parts, as in and.pred
            return _union([_mix(taints(a[1:3])), self.taint(a[3], at)])
        if ".pred" in op and base in ("and", "or", "xor", "not", "mov"):
            return _union(taints(a[1:]))
        if base == "shfl" and ".idx" in op and _imm(a[2]) is not None:  # one lane's value: what decides it there
            return self.taint(a[1], at)
        if base in ("ld", "ldu", "atom", "ldmatrix", "tcgen05", "vote", "redux", "match", "shfl"):
            return DATA | (MIXED if _union(taints(a[1:])) & (ID | MIXED) else 0)  # from the thread's own address
        return _mix(taints(a[1:]))

    def leaf_value(self, leaf: str, ctx: Ctx) -> Optional[int]:
        reg, at = leaf.rsplit("@", 1)
        return self.value(reg, int(at), ctx)

    def destination(self, operand: str, at: int) -> tuple[Optional[tuple[str, int]], int]:
        """Where an address register sends its access: the rank operand (and position) of the ``mapa`` it comes from
        through moves and adds (None: none), and the rank bits an ``and`` above bit 24 keeps (CUTLASS's 2-CTA peer
        mask: the barrier of the pair's even CTA; -1: all)."""
        seen, rank, keep = set(), None, -1
        todo = [(operand.strip(), at)]
        while todo:
            r, pos = todo.pop()
            ins = self.def_of(r, pos) if r.startswith("%") else None
            if ins is None or ins.index in seen:
                continue
            seen.add(ins.index)
            base = ins.op.split(".")[0]
            if base == "mapa":
                rank = (ins.args[2], ins.index)
            elif base == "and" and _peer_mask(ins.args[2]) is not None:
                keep &= _peer_mask(ins.args[2])
                todo.append((ins.args[1], ins.index))
            elif base in ("mov", "add", "sub", "cvt", "cvta"):
                todo.extend((x, ins.index) for x in ins.args[1:])
        return rank, keep

    def reaches(self, ins: Instr) -> tuple[list[Ctx], bool, tuple[int, ...]]:
        """The threads that may execute ``ins``, whether an ``elect.sync`` predicate keeps one lane a warp, and the
        branches (instruction indices) on the way whose conditions data decides differently for those threads
        (``MIXED``: taken as possibly true, as data that decides for the CTA or the warp)."""
        if ins.index in self._reached:
            return self._reached[ins.index]
        facts = set(self.facts[self.block_of[ins.index]])
        if ins.guard is not None:
            facts.add((*ins.guard, ins.index))
        elected = False
        checks = []
        for p, want, at in facts:
            if self._leaves_wait_loop(p, want, at):
                continue
            e = self._elect_polarity(p, at)
            if e is None:
                checks.append((p, want, at))
            else:
                elected |= e == want
        threads, undecided = [], set()
        for c in self.contexts:
            values = [(self.value(p, at, c), want, p, at) for p, want, at in checks]
            if all(v in (None, int(want)) for v, want, _, _ in values):
                threads.append(c)
                undecided |= {(p, at) for v, _, p, at in values if v is None}
        mixed = tuple(sorted(at for p, at in undecided if self.taint(p, at) & MIXED))
        self._reached[ins.index] = threads, elected, mixed
        return self._reached[ins.index]

    def scan(self, start: int, step: int, stop) -> set[int]:
        """Instructions reachable from ``start`` (excluded) forward (``step`` 1) or backward (-1) along the control
        flow without passing one that ``stop`` holds for (that one is reached)."""
        out, seen = set(), set()
        todo = [(self.block_of[start], start + step)]
        while todo:
            block, i = todo.pop()
            b = self.cfg[block]
            while b.start <= i < b.end:
                out.add(i)
                if stop(self.instrs[i]):
                    break
                i += step
            else:
                nxt = [t for t, _ in b.succs] if step > 0 else self.preds[block]
                for t in nxt:
                    if t not in seen:
                        seen.add(t)
                        todo.append((t, t if step > 0 else self.cfg[t].end - 1))
        return out

    def _leaves_wait_loop(self, pred: str, want: bool, at: int) -> bool:
        """Whether ``pred == want`` is the way out of a wait's retry loop: ``pred`` (or its negation) is an
        mbarrier wait's result and the branch at ``at`` otherwise goes back to the block of that wait. Every thread
        leaves such a loop the same way, once the phase completes: it decides when a thread goes on, not whether (as
        a retry loop inside an inline-asm wait, which ``blocks`` takes as straight-line code)."""
        ins, _ = self._negations_of(pred, at)
        if ins is None or _kind(ins.op) != "wait":
            return False
        block = self.cfg[self.block_of[at]]
        return any(cond is not None and cond[2] == at and cond[1] != want and t == self.block_of[ins.index]
                   for t, cond in block.succs)

    def _negations_of(self, pred: str, at: int) -> tuple[Optional[Instr], bool]:
        """The instruction that defines ``pred`` through any ``not.pred``s, and whether they negate it."""
        ins, negated = self.def_of(pred, at), False
        while ins is not None and ins.op == "not.pred":
            ins, negated = self.def_of(ins.args[1], ins.index), not negated
        return ins, negated

    def _elect_polarity(self, pred: str, at: int) -> Optional[bool]:
        """True: ``pred`` is an ``elect.sync`` result; False: its negation; None: neither."""
        ins, negated = self._negations_of(pred, at)
        if ins is None or not ins.op.startswith("elect.sync"):
            return None
        return not negated


# -- barriers and arrivals -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BarrierArray:
    """``stages`` mbarriers at ``offset + 8 i`` bytes of dynamic shared memory, each initialized for ``count``."""

    offset: int
    stages: int
    count: int
    line: int

    def index(self, offset: int) -> Optional[int]:
        k, r = divmod(offset - self.offset, MBARRIER_BYTES)
        return k if r == 0 and 0 <= k < self.stages else None

    @property
    def name(self) -> str:
        return f"smem+{self.offset}" + (f"[{self.stages}]" if self.stages > 1 else "")


@dataclasses.dataclass(frozen=True)
class Arrival:
    """``count`` arrivals of thread ``tid`` of CTA ``rank`` on barrier ``offset`` (the first of a ring's barriers
    when ``ring``: the ring's current stage) of CTA ``dest``."""

    rank: int
    tid: int
    dest: int
    offset: int
    ring: bool
    count: int


@dataclasses.dataclass(frozen=True)
class Site:
    """An instruction that arrives on, moves transaction bytes of, or waits on an mbarrier."""

    line: int
    kind: str  # "arrive", "expect_tx", "commit", "cp.async", "tx", "wait"
    text: str
    arrivals: tuple[Arrival, ...]  # one per thread that executes it (and destination CTA)
    elected: bool  # one elected lane of each warp that reaches it
    index: int  # the instruction's
    mixed: tuple[int, ...]  # branches on the way whose conditions data decides differently per thread
    address: Affine  # the barrier's address (its leaves: registers at this instruction)


def _kind(op: str) -> Optional[str]:
    if op.startswith("mbarrier.arrive.expect_tx"):
        return "expect_tx"
    if op.startswith("mbarrier.arrive_drop"):
        raise NotImplementedError(f"{op}: arrivals that drop the expected count are not modelled")
    if op.startswith("mbarrier.arrive"):
        return "arrive"
    if op.startswith("tcgen05.commit"):
        return "commit"
    if op.startswith("cp.async.mbarrier.arrive"):
        return "cp.async"
    if op.startswith("mbarrier.expect_tx") or "complete_tx" in op:
        return "tx"
    if op.startswith(("mbarrier.try_wait", "mbarrier.test_wait")):
        return "wait"
    return None


def _named_sync(op: str) -> bool:
    """A named barrier's wait (``bar.sync``, ``barrier{.cta}.sync``; not ``.arrive``)."""
    return op.startswith(("bar.sync", "bar.cta.sync", "barrier.sync", "barrier.cta.sync"))


def _barrier_operand(ins: Instr) -> str:
    """The ``[address]`` operand naming the mbarrier."""
    kind = _kind(ins.op)
    if kind == "tx":  # the last address operand: cp.async.bulk [dst], [map, coords], [bar]; expect_tx [bar], bytes
        return [a for a in ins.args if a.startswith("[")][-1]
    if kind in ("commit", "cp.async"):
        return ins.args[0]
    return ins.args[1]  # mbarrier.arrive{.expect_tx} state, [addr], ...; try_wait / test_wait pred, [addr], ...


def _address(operand: str) -> tuple[str, int]:
    m = re.match(r"\[\s*([^\]+]+?)\s*(?:\+\s*(-?\d+))?\s*\]$", operand.strip())
    if m is None:
        raise ValueError(f"unexpected address operand {operand}")
    return m[1], int(m[2] or 0)


class Analysis:
    """Barrier arrays, arrive / wait sites and their arrivals of one kernel's PTX."""

    def __init__(self, ptx: str, cluster: tuple[int, int, int] = (1, 1, 1)):
        self.prog = prog = Program(ptx, cluster)
        self.arrays = self._arrays()
        self.sites: list[Site] = []
        for ins in prog.instrs:
            kind = _kind(ins.op)
            if kind is not None:
                self.sites.append(self._site(ins, kind))

    def _arrays(self) -> list[BarrierArray]:
        runs: list[list[tuple[int, int, int]]] = []  # (offset, count, line) of consecutive inits
        prev = None
        for ins in self.prog.instrs:
            if not ins.op.startswith("mbarrier.init"):
                if ins.op not in ("mov.b32", "mov.u32"):
                    prev = None
                continue
            reg, off = _address(ins.args[0])
            addr = self.prog.affine(reg, ins.index)
            if addr is None or addr.terms != ((SMEM, 1),):
                raise ValueError(f"line {ins.line}: mbarrier.init of {ins.args[0]}, not the shared-memory base plus "
                                 "a constant")
            count = self.prog.value(ins.args[1], ins.index, self.prog.contexts[0])
            if count is None:
                raise ValueError(f"line {ins.line}: mbarrier.init count {ins.args[1]} is not a constant")
            offset = addr.const + off
            if prev is not None and prev[-1][1] == count and offset == prev[-1][0] + MBARRIER_BYTES:
                prev.append((offset, count, ins.line))
            else:
                prev = [(offset, count, ins.line)]
                runs.append(prev)
        return [BarrierArray(r[0][0], len(r), r[0][1], r[0][2]) for r in runs]

    def array_at(self, offset: int) -> Optional[BarrierArray]:
        for a in self.arrays:
            if a.index(offset) is not None:
                return a
        return None

    def _site(self, ins: Instr, kind: str) -> Site:
        prog = self.prog
        reg, off = _address(_barrier_operand(ins))
        addr = prog.affine(reg, ins.index)
        if addr is None or dict(addr.terms).get(SMEM) != 1:
            raise ValueError(f"line {ins.line}: {ins.text}: the barrier address is not the shared-memory base plus "
                             "an offset")
        threads, elected, mixed = prog.reaches(ins)
        if elected:  # one lane of each warp that reaches it
            firsts = {}
            for c in threads:
                firsts.setdefault((c.rank, c.tid // WARP), c)
            threads = list(firsts.values())
        rank_operand, peer_mask = prog.destination(reg, ins.index)
        arrivals = []
        for ctx in threads:
            const, ring = addr.const + off, False
            for leaf, coef in addr.terms:
                if leaf != SMEM:
                    v = prog.leaf_value(leaf, ctx)
                    ring |= v is None
                    const += 0 if v is None else coef * v
            dests = [ctx.rank & peer_mask]
            if rank_operand is not None:
                r = prog.value(*rank_operand, ctx)
                if r is None:
                    raise ValueError(f"line {ins.line}: {ins.text}: the mapa rank {rank_operand} is not decided by "
                                     "the thread")
                dests = [r]
            if kind == "commit" and "multicast" in ins.op:
                mask = prog.value(ins.args[1], ins.index, ctx)
                if mask is None:
                    raise ValueError(f"line {ins.line}: {ins.text}: the multicast mask is not decided by the thread")
                dests = [r for r in range(mask.bit_length()) if mask >> r & 1]
            if max(dests) >= prog.ranks:
                raise ValueError(f"line {ins.line}: {ins.text}: arrives on CTA {max(dests)} of a {prog.ranks}-CTA "
                                 "cluster")
            n = {"arrive": lambda: prog.value(ins.args[2], ins.index, ctx) if len(ins.args) > 2 else 1,
                 "expect_tx": lambda: 1, "commit": lambda: 1,
                 "cp.async": lambda: 1 if ".noinc" in ins.op else 0, "tx": lambda: 0, "wait": lambda: 0}[kind]()
            if n is None:
                raise ValueError(f"line {ins.line}: {ins.text}: the arrival count is not a constant")
            array = self.array_at(const)
            if array is None:
                raise ValueError(f"line {ins.line}: {ins.text}: smem+{const} is no initialized mbarrier")
            if ring and const != array.offset:
                raise ValueError(f"line {ins.line}: {ins.text}: a ring index from smem+{const}, inside {array.name}")
            arrivals.extend(Arrival(ctx.rank, ctx.tid, d, const, ring, n) for d in dests)
        return Site(ins.line, kind, ins.text, tuple(arrivals), elected, ins.index, mixed, addr + Affine(off))

    def account(self, roles: dict) -> tuple[list["Row"], list["Finding"]]:
        """The barrier table and its findings. ``roles``: name -> an object with ``warps`` (warp indices) and
        ``turns`` (groups of those warps that take phases in turn; 1: every phase has all of them)."""
        findings: list[Finding] = []
        site_role = {}  # site index -> role name
        seen_warps = defaultdict(set)
        for k, site in enumerate(self.sites):
            warps = frozenset(a.tid // WARP for a in site.arrivals)
            if not warps:
                continue
            fits = sorted((len(r.warps), name) for name, r in roles.items() if warps <= set(r.warps))
            if not fits:
                findings.append(Finding("roles", f"line {site.line}: {site.text}: {_warps(warps)} in no declared "
                                                 f"role ({_roles_text(roles)})"))
                continue
            name = fits[0][1]
            site_role[k] = name
            seen_warps[name].add(warps)
            role = roles[name]
            if role.turns > 1 and any(g & warps and not g <= warps for g in _groups(role)):
                findings.append(Finding("turns", f"line {site.line}: {site.text}: {_warps(warps)} split a group of "
                                                 f"{name}'s turns {[_span(g) for g in _groups(role)]}"))
        for name, role in roles.items():
            if frozenset(role.warps) not in seen_warps[name]:
                findings.append(Finding("roles", f"role {name} ({_warps(role.warps)}): no barrier site is reached "
                                                 "by exactly its warps"))
        # per (array, barrier, rank): role -> group -> {arriver: arrivals}; and who waits
        given: dict[tuple, dict] = defaultdict(lambda: defaultdict(lambda: defaultdict(dict)))
        used: dict[tuple, set] = defaultdict(set)
        waiters: dict[BarrierArray, set] = defaultdict(set)
        for k, site in enumerate(self.sites):
            name = site_role.get(k)
            if name is None:
                continue
            role = roles[name]
            parts: dict[tuple, list[Arrival]] = defaultdict(list)
            for a in site.arrivals:
                array = self.array_at(a.offset)
                group = next((k for k, g in enumerate(_groups(role)) if a.tid // WARP in g), 0)
                for i in (range(array.stages) if a.ring else [array.index(a.offset)]):
                    used[(array, i, a.dest)].add(site.kind)
                    parts[(array, i, a.dest, group)].append(a)
                if site.kind == "wait":
                    waiters[array].add(name)
            if site.kind in ("wait", "tx"):
                continue
            for (array, i, dest, group), arrs in parts.items():
                who = (site.kind, tuple(sorted((a.rank, a.tid, a.count) for a in arrs)))
                given[(array, i, dest)][name][group][who] = (sum(a.count for a in arrs),
                                                             _describe(name, site, arrs, self.prog.ranks))
        rows: list[Row] = []
        for array in self.arrays:
            keys = [(array, i, r) for i in range(array.stages) for r in range(self.prog.ranks)]
            if not any(used[k] for k in keys):
                findings.append(Finding("unused", f"{array.name} (line {array.line}, count {array.count}): "
                                                  "initialized, but nothing arrives on it or waits for it"))
                rows.append(Row(array, array.count, 0, [], []))
                continue
            phase = {}
            for k in keys:
                if not used[k]:
                    continue
                total, text = 0, []
                for name, groups in given[k].items():
                    sums = {g: sum(n for n, _ in arrivers.values()) for g, arrivers in groups.items()}
                    if len(set(sums.values())) > 1:
                        findings.append(Finding("turns", f"{_barrier(k, self.prog.ranks)}: the turns of {name} give "
                                                         f"{sorted(sums.values())} arrivals"))
                    total += max(sums.values())
                    first = groups[min(groups)]
                    text += [t + (f" (one of {len(_groups(roles[name]))} groups in turn)"
                                  if roles[name].turns > 1 else "") for _, t in first.values()]
                if total != array.count:
                    findings.append(Finding("count", f"{_barrier(k, self.prog.ranks)} is initialized for "
                                                     f"{array.count} arrivals, a phase gets {total}: "
                                                     + ("; ".join(sorted(text)) or "none")))
                phase.setdefault(total, sorted(text))  # the first barrier (and CTA) with this count speaks for all
            for total, text in sorted(phase.items()):
                rows.append(Row(array, array.count, total, text, sorted(waiters[array])))
        return rows, findings

    def _same_step(self, one: Site, two: Site) -> bool:
        """Whether a thread that reaches ``one`` can reach ``two`` with no wait between (an mbarrier's, or a named
        barrier's sync: both hold the thread until another side moves on) and find the same barrier there: the same
        constant address, or a ring's address from the same registers, on a path that does not redefine them (a
        release lagging its wait by a stage advances its index in between)."""
        form = lambda a: (a.const, sorted((leaf.split("@")[0], c) for leaf, c in a.terms))  # noqa: E731
        if form(one.address) != form(two.address):
            return False
        regs = {leaf.split("@")[0] for leaf, _ in one.address.terms if leaf != SMEM}
        stop = lambda i: (_kind(i.op) == "wait" or _named_sync(i.op)  # noqa: E731
                          or bool(regs.intersection(_defined(i))))
        return two.index in self.prog.scan(one.index, 1, stop)

    def ordering(self) -> list["Finding"]:
        """What the per-phase count cannot see: an arrive whose arrivers data decides per thread (``mixed``), two
        arrive sites that the same thread can reach one after the other with no wait between (``twice``:
        one phase would get both), and an arrive by some lanes of a warp after other lanes of it accessed shared
        memory with no warp-wide barrier since (``sync``: the arrival orders only its own lanes' accesses, so the
        waiter may overwrite what those lanes still read)."""
        prog, findings = self.prog, []
        wait = lambda i: _kind(i.op) == "wait"  # noqa: E731
        arriving = [s for s in self.sites if s.kind not in ("wait", "tx") and any(a.count for a in s.arrivals)]
        for site in arriving:
            # since the thread's last wait: a condition before it chooses which copy of a loop (or which loop)
            # runs, each with its own wait and arrival, which the count takes as one
            since = prog.scan(site.index, -1, wait) | {site.index}
            lines = [prog.instrs[at].line for at in site.mixed if at in since]
            if lines:
                findings.append(Finding("mixed", f"line {site.line}: {site.text}: who arrives depends on data that "
                                                 f"differs between threads (the condition at line "
                                                 f"{', '.join(map(str, lines))})"))
        alike = defaultdict(list)  # the arrivals the count takes once: the same arrivers, the same way
        for site in arriving:
            alike[(site.kind, tuple(sorted((a.rank, a.tid, a.dest, a.offset, a.ring, a.count)
                                           for a in site.arrivals)))].append(site)
        for sites in alike.values():
            for one in sites:
                for two in sites:
                    if one is not two and self._same_step(one, two):
                        findings.append(Finding("twice", f"line {one.line} and line {two.line}: the same arrivals "
                                                         f"on {self.array_at(one.arrivals[0].offset).name} follow "
                                                         "one another with no wait between: one phase "
                                                         "gets both"))
        for site in arriving:
            if site.kind != "arrive":
                continue
            arrivers = {(a.rank, a.tid) for a in site.arrivals}
            lanes = {(r, t - t % WARP + lane) for r, t in arrivers for lane in range(WARP)} - arrivers
            if not lanes:
                continue
            accesses = prog.scan(site.index, -1, lambda i: i.op.startswith(_WARP_SYNC))
            for k in sorted(accesses, key=lambda k: (k > site.index, -k)):  # the nearest before it first
                ins = prog.instrs[k]
                if ins.op.split(".")[0] in _SHARED_ACCESS and ".shared" in ins.op and lanes & {
                        (c.rank, c.tid) for c in prog.reaches(ins)[0]}:
                    findings.append(Finding("sync", f"line {site.line}: {site.text}: arrives for some lanes of "
                                                    f"its warps, after other lanes of them access shared memory "
                                                    f"(line {ins.line}: {ins.op}) with no bar.warp.sync between"))
                    break
        return findings


_WARP_SYNC = ("bar.warp.sync", "bar.sync", "barrier.sync", "bar.red", "barrier.red")  # order the lanes' accesses
_SHARED_ACCESS = ("ld", "st", "atom", "red", "ldmatrix", "stmatrix")


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # "count", "unused", "roles", "turns", "mixed", "twice", "sync"
    message: str


@dataclasses.dataclass(frozen=True)
class Row:
    """One barrier array of the table (one row per distinct arrivals per phase among its barriers and CTAs)."""

    array: BarrierArray
    count: int
    per_phase: int
    arrivers: list[str]
    waiters: list[str]


def _union(flags) -> int:
    out = 0
    for f in flags:
        out |= f
    return out


def _mix(flags) -> int:
    """Flags of a value computed from values with ``flags``: identity and data together are ``MIXED``."""
    out = _union(flags)
    return out | MIXED if out & ID and out & DATA else out


def _groups(role) -> list[frozenset]:
    warps = sorted(role.warps)
    n = len(warps) // role.turns
    return [frozenset(warps[k * n:(k + 1) * n]) for k in range(role.turns)]


def _span(warps) -> str:
    w = sorted(warps)
    if len(w) > 1 and w == list(range(w[0], w[-1] + 1)):
        return f"{w[0]}-{w[-1]}"
    return ",".join(map(str, w))


def _warps(warps) -> str:
    return f"warp{'s' if len(warps) > 1 else ''} {_span(warps)}"


def _roles_text(roles: dict) -> str:
    return ", ".join(f"{n} {_span(r.warps)}" for n, r in roles.items())


def _barrier(key: tuple, ranks: int) -> str:
    array, i, rank = key
    name = f"smem+{array.offset + MBARRIER_BYTES * i}" + (f" (stage {i} of {array.name})" if array.stages > 1 else "")
    return name + (f" of CTA {rank}" if ranks > 1 else "")


_KIND_TEXT = {"arrive": "arrive", "expect_tx": "arrive.expect_tx", "commit": "tcgen05.commit",
              "cp.async": "cp.async.mbarrier.arrive.noinc"}


def _describe(role: str, site: Site, arrivals: list[Arrival], ranks: int) -> str:
    """``role (warps ...): how = arrivals``: which lanes of which warps (of which CTAs) arrive, and how many."""
    warps = {a.tid // WARP for a in arrivals}
    lanes = {a.tid % WARP for a in arrivals}
    if site.elected:
        how = "elected lane"
    elif len(lanes) == WARP and len(arrivals) == WARP * len(warps) * len({a.rank for a in arrivals}):
        how = "all lanes"
    else:
        how = f"lane{'s' if len(lanes) > 1 else ''} {_span(lanes)}"
    per = {a.count for a in arrivals}
    how += f" x{per.pop()}" if len(per) == 1 and max({a.count for a in arrivals}) > 1 else ""
    src = {a.rank for a in arrivals}
    where = f" of CTA{'s' if len(src) > 1 else ''} {_span(src)}" if ranks > 1 else ""
    return f"{role} ({_warps(warps)}{where}): {_KIND_TEXT[site.kind]}, {how} = {sum(a.count for a in arrivals)}"


# -- rings and their replay ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Ring:
    """A producer/consumer ring: ``stages`` full barriers, then (CUTLASS's layout) as many empty ones, with the
    arrivals one phase of each gets; ``tx``: the full barriers also wait for transaction bytes."""

    full: BarrierArray
    empty: BarrierArray
    full_arrivals: int
    empty_arrivals: int
    tx: bool

    @property
    def stages(self) -> int:
        return self.full.stages


def rings(analysis: Analysis, rows: list[Row]) -> list[Ring]:
    """Pairs of arrays laid out as one CUTLASS pipeline (the empty barriers right after the full ones, as many), the
    full side's arrivers waiting on the empty side and the reverse. Arrivals per phase from the table (an array
    whose barriers differ takes the smallest)."""
    per_phase = defaultdict(list)
    for r in rows:
        per_phase[r.array].append(r.per_phase)
    roles_of = defaultdict(set)  # array -> ("arrive" | "wait", role)
    for r in rows:
        roles_of[r.array] |= {("wait", w) for w in r.waiters}
        roles_of[r.array] |= {("arrive", a.split(" (")[0]) for a in r.arrivers}
    tx = {analysis.array_at(a.offset) for s in analysis.sites if s.kind in ("tx", "expect_tx") for a in s.arrivals}
    out, taken = [], set()
    for full in sorted(analysis.arrays, key=lambda a: a.offset):  # a pipeline's full array comes first
        empty = analysis.array_at(full.offset + MBARRIER_BYTES * full.stages)
        if (full in taken or empty is None or empty.offset != full.offset + MBARRIER_BYTES * full.stages
                or empty.stages != full.stages):
            continue
        producers = {n for k, n in roles_of[full] if k == "arrive"}
        consumers = {n for k, n in roles_of[empty] if k == "arrive"}
        if not (producers & {n for k, n in roles_of[empty] if k == "wait"}
                and consumers & {n for k, n in roles_of[full] if k == "wait"}):
            continue
        out.append(Ring(full, empty, min(per_phase[full]), min(per_phase[empty]), full in tx))
        taken |= {full, empty}
    return out


class Mbarrier:
    """The phase rules of one mbarrier: a phase completes when its pending arrivals and transaction bytes reach
    zero; then the phase advances and the pending count is the init count again (arrivals past zero belong to the
    next phase). A wait on parity ``p`` passes once the current phase's parity differs from ``p``: at init (phase
    0 under way) a wait on 1 passes, a wait on 0 waits for phase 0 to complete."""

    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, n: int = 1, expect_tx: int = 0):
        self.tx += expect_tx
        self.pending -= n
        self._complete()

    def complete_tx(self, nbytes: int):
        self.tx -= nbytes
        self._complete()

    def _complete(self):
        while self.pending <= 0 and self.tx == 0:
            self.phase += 1
            self.pending += self.count

    def passed(self, parity: int) -> bool:
        return self.phase % 2 != parity

    def __repr__(self):
        return f"phase {self.phase}, {self.pending} of {self.count} arrivals pending, {self.tx} tx bytes"


class _State:
    """``PipelineState``: a stage index and phase bit; producers start on phase 1 (every stage empty)."""

    def __init__(self, stages: int, phase: int):
        self.stages, self.index, self.phase = stages, 0, phase

    def advance(self):
        self.index += 1
        if self.index == self.stages:
            self.index, self.phase = 0, self.phase ^ 1


def replay(ring: Ring, tiles: list[int], tx_bytes: int = 1) -> Optional[str]:
    """Runs the ring's producer and consumer over ``tiles`` (k-blocks per work tile, one ring step each, the pipeline
    state carried across tiles as in a persistent kernel): producer acquire (wait on empty), commit (the full side's
    arrivals, with ``tx_bytes`` expected and then delivered when it waits for bytes), consumer wait (on full) and
    release (the empty side's arrivals), then the producer's tail (a wait on every stage, from where it stopped).
    Returns None when both finish, else where they stall."""
    full = [Mbarrier(ring.full.count) for _ in range(ring.stages)]
    empty = [Mbarrier(ring.empty.count) for _ in range(ring.stages)]
    steps = sum(tiles)

    def producer():
        state = _State(ring.stages, 1)
        for k in range(steps):
            yield f"producer acquire of step {k}", empty[state.index], state.phase, state.index
            full[state.index].arrive(ring.full_arrivals, tx_bytes if ring.tx else 0)
            if ring.tx:
                full[state.index].complete_tx(tx_bytes)
            state.advance()
        for _ in range(ring.stages):
            yield "producer tail", empty[state.index], state.phase, state.index
            state.advance()

    def consumer():
        state = _State(ring.stages, 0)
        for k in range(steps):
            yield f"consumer wait of step {k}", full[state.index], state.phase, state.index
            empty[state.index].arrive(ring.empty_arrivals)
            state.advance()

    agents = {"producer": producer(), "consumer": consumer()}
    waiting = {name: next(gen, None) for name, gen in agents.items()}
    while any(w is not None for w in waiting.values()):
        progressed = False
        for name, w in waiting.items():
            if w is not None and w[1].passed(w[2]):
                waiting[name] = next(agents[name], None)
                progressed = True
        if not progressed:
            return "; ".join(f"{w[0]} waits on stage {w[3]} for parity {w[2]} ({w[1]})"
                             for w in waiting.values() if w is not None)
    return None


def schedules(stages: int) -> dict[str, list[int]]:
    """Work a ring sees: k-blocks per tile. Past the stages in one tile, one k-block, more one-block tiles than
    stages, a CTA without work, and tiles of unequal length (splits finishing early: a short tile between full
    ones, a ring stopping mid-way round)."""
    return {"one tile, more k-blocks than stages": [2 * stages + 1], "one k-block": [1],
            "more one-block tiles than stages": [1] * (stages + 2), "no work": [],
            "tiles of unequal length": [stages + 1, stages + 1, 1, stages, 2]}


# -- reports ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Report:
    rows: list[Row]
    findings: list[Finding]
    rings: list[Ring]
    stalls: list[str]  # "<ring>: <schedule>: <where it stalls>"
    waived: list[Finding] = dataclasses.field(default_factory=list)  # of the kinds the caller waives

    @property
    def ok(self) -> bool:
        return not self.findings and not self.stalls

    def problems(self) -> str:
        return "\n".join([f.message for f in self.findings] + self.stalls
                         + [f"waived: {f.message}" for f in self.waived])


def analyze(ptx: str, roles: dict, cluster: tuple[int, int, int] = (1, 1, 1), waive: tuple[str, ...] = ()) -> Report:
    """The barrier table of one kernel, its findings (those of the kinds in ``waive`` apart), and the replay of its
    rings."""
    analysis = Analysis(ptx, cluster)
    rows, findings = analysis.account(roles)
    findings += analysis.ordering()
    waived = [f for f in findings if f.kind in waive]
    findings = [f for f in findings if f.kind not in waive]
    found = rings(analysis, rows)
    stalls = []
    for ring in found:
        for name, tiles in schedules(ring.stages).items():
            stall = replay(ring, tiles)
            if stall:
                stalls.append(f"ring {ring.full.name} / {ring.empty.name}: {name} {tiles}: {stall}")
    return Report(rows, findings, found, stalls, waived)


def analyze_config(config, ptx: Optional[str] = None, host_ir: Optional[str] = None) -> Report:
    """``analyze`` of a ``cute_kv.kernels.catalog`` configuration: its PTX, the cluster its launch asks for and the
    warp roles its family declares (compiled here unless given)."""
    import static

    if ptx is None or host_ir is None:
        from cute_kv.kernels import compile_cache

        fn = compile_cache.compile_uncached(lambda: config.build(), config.arch)
        ptx, host_ir = fn.__ptx__, str(fn.ir_module)
    return analyze(ptx, config.family.roles(config.kernel()), static.launch_from_host_ir(host_ir).cluster,
                   config.family.barrier_waivers)


def table(records: list[tuple[str, Report]]) -> str:
    """kernel | barrier | init count | arrivals per phase | arrivers | waiters, one line per row."""
    lines = [f"{'kernel':44s} {'barrier':16s} {'init':>4s} {'phase':>5s}  arrivers -> waiters"]
    for name, rep in records:
        for r in rep.rows:
            arrivers = "; ".join(r.arrivers) or "nothing"
            lines.append(f"{name[:44]:44s} {r.array.name:16s} {r.count:4d} {r.per_phase:5d}  {arrivers} -> "
                         f"{', '.join(r.waiters) or 'nobody'}")
        lines += [f"{'':44s} !! {p}" for p in rep.problems().splitlines()]
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="perf/run.py barriers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="*", default=[], help="families whose name contains one of these")
    args = ap.parse_args(argv)
    from cute_kv.kernels import catalog

    records, out = [], []
    for config in catalog.configs():
        if args.kernels and not any(k in config.family.name for k in args.kernels):
            continue
        rep = analyze_config(config)
        records.append((config.id, rep))
        out += [{"kernel": config.family.name, "config": config.label, "arch": config.arch,
                 "barrier": r.array.name, "init_count": r.count, "arrivals_per_phase": r.per_phase,
                 "arrivers": r.arrivers, "waiters": r.waiters} for r in rep.rows]
        out += [{"kernel": config.family.name, "config": config.label, "arch": config.arch, "problem": p}
                for p in rep.problems().splitlines()]
    print(table(records))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
