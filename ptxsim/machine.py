"""The executor: a launch's CTAs, warps and lanes, one PTX instruction at a time, under a seeded schedule.

- **Independent thread scheduling** (PTX ISA 3.1 / Volta+): every lane has its own PC. A warp runs the lanes that sit
  on one PC together (the lowest PC first, so diverged lanes reconverge), and lanes that wait (a failed
  ``mbarrier.try_wait``, a barrier, a collective whose members have not arrived) step aside for the others.
- **Schedules.** The seed picks which warp runs next, how many instructions it runs before another is picked, and
  when each asynchronous operation (TMA, bulk copies, cp.async, wgmma) lands, in any order the ISA allows. A race
  shows under some seeds; tests run several.
- **Deadlock.** When no lane can run and nothing asynchronous is left to land, every waiting warp is reported with
  what it waits for and the state of that barrier.

Instruction semantics live with their families (``alu``, ``ops_*`` modules); each cites its PTX ISA section.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from . import parser as P
from .errors import Deadlock, Hazard, MemoryFault, SimError, Unsupported
from .memory import CLUSTER_SHIFT, GlobalMemory, SharedMemory

LANES = np.arange(32)
FULL = np.ones(32, bool)
DTYPE = {1: np.bool_, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
MAX_SMEM = 232448  # bytes of shared memory one CTA may have on sm_90 and sm_100 (227 KiB)
MASK = {8: 0xFF, 16: 0xFFFF, 32: 0xFFFFFFFF, 64: 0xFFFFFFFFFFFFFFFF}


@dataclasses.dataclass
class LaunchSpec:
    """What a launch is: the PTX module text, the entry, the geometry and the parameter bytes (PTX order)."""
    ptx: str
    kernel: str
    grid: tuple
    block: tuple
    cluster: tuple = (1, 1, 1)
    dyn_smem: int = 0
    params: list = dataclasses.field(default_factory=list)


class Waiter:
    """Something lanes can wait on: its ``version`` moves when its state changes."""
    __slots__ = ("version",)

    def __init__(self):
        self.version = 0


class Warp:
    def __init__(self, sim, cta, wid: int, nthreads: int, nregs: list):
        self.sim, self.cta, self.wid = sim, cta, wid
        self.gid = sim.next_warp_id()
        self.pc = np.zeros(32, np.int64)
        first = wid * 32
        self.active = (first + LANES) < nthreads  # lanes past the block's threads never exist
        self.exists = self.active.copy()
        self.R = sim.prog.new_registers()
        self.waits: list = []  # (mask, waiter, version, why, soft: a failed try_wait)
        self.coll_wait = np.zeros(32, bool)  # lanes at a collective whose members have not arrived
        self.coll_flag = False  # coll_wait has a lane
        self.blocked_epoch = -1  # the simulator's epoch when this warp was last found unable to run
        self.pending_regs: set = set()  # registers an in-flight wgmma will write (no access until its wait)
        self.pending_w: set = set()  # registers an in-flight wgmma reads (A fragments: no write until its wait)
        bx, by, bz = cta.block
        tid = first + LANES
        self.tid = (tid % bx, (tid // bx) % by, tid // (bx * by))
        self.local: Optional[np.ndarray] = None
        self.wg_seq = 0  # wgmma instructions issued
        self.wg_groups: list = []  # committed wgmma groups: lists of ops
        self.wg_open: list = []  # wgmma ops issued since the last commit
        self.cp_open: list = []  # cp.async copies since the last commit_group
        self.cp_groups: list = []
        self.bulk_open: list = []  # bulk (TMA store / bulk copy) ops since the last commit_group
        self.bulk_groups: list = []
        self.nreg_budget = None
        self.last_ins = None
        self.cc = None  # the carry flag of add.cc and friends
        # completion id -> phases observed complete (see SharedMemory.read); ("warp", gid) -> 1 for the warps whose
        # generic writes this warp has synchronized with (its fence.proxy.async covers them)
        self.observed: dict = {("warp", self.gid): 0}
        self.epoch = 0  # release operations so far: a generic write is published by the next one
        self.mbinits = 0  # mbarrier.init instructions executed: ("mbinit", gid) in ``observed`` says how many are seen
        self.elected: dict = {}  # elect.sync's leader per member set

    def release(self) -> None:
        """A release operation (a barrier arrival, an mbarrier arrive): the warp's shared-memory writes so far,
        its mbarrier inits included, become visible to whoever acquires what it carries."""
        self.epoch += 1
        self.observed[("warp", self.gid)] = self.epoch
        self.publish_inits()

    def publish_inits(self) -> None:
        """The warp's mbarrier inits so far travel with what it releases (``fence.mbarrier_init``, or a release)."""
        if self.mbinits:
            self.observed[("mbinit", self.gid)] = self.mbinits

    def runnable(self) -> np.ndarray:
        """The lanes that may run now (not to be modified: it may be ``active`` itself)."""
        if not self.waits and not self.coll_flag:
            return self.active
        m = self.active.copy()
        if self.waits:
            keep = []
            for entry in self.waits:
                mask, waiter, version, why, soft = entry
                if waiter.version == version:
                    m &= ~mask
                    keep.append(entry)
            self.waits = keep
        return m & ~self.coll_wait if self.coll_flag else m

    def describe_wait(self) -> str:
        parts = []
        for mask, waiter, version, why, soft in self.waits:
            parts.append(f"lanes {_lanes(mask)} {why() if callable(why) else why}")
        if self.coll_wait.any():
            pcs = sorted(set(self.pc[self.coll_wait].tolist()))
            parts.append(f"lanes {_lanes(self.coll_wait)} at a warp collective (PTX line "
                         f"{', '.join(str(self.sim.prog.instrs[p].line) for p in pcs)}) whose members never came")
        return "; ".join(parts) or "nothing (runnable)"


def _lanes(mask: np.ndarray) -> str:
    idx = np.flatnonzero(mask)
    if idx.size == 0:
        return "none"
    runs, start, prev = [], idx[0], idx[0]
    for i in idx[1:]:
        if i != prev + 1:
            runs.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = i
        prev = i
    runs.append(f"{start}-{prev}" if prev > start else f"{start}")
    return ",".join(runs)


class NamedBarrier(Waiter):
    __slots__ = ("arrived", "expected", "first_line", "waiting", "partial")

    def __init__(self):
        super().__init__()
        self.arrived = 0
        self.expected = None
        self.waiting = []
        self.partial: dict = {}  # warp -> lanes arrived so far at a non-aligned barrier


class CTA:
    def __init__(self, sim, ctaid: tuple, cluster_id: tuple, rank: int):
        self.sim = sim
        self.ctaid, self.cluster_id, self.rank = ctaid, cluster_id, rank
        self.block = sim.spec.block
        self.smem = SharedMemory(sim.smem_size, sim.rng, sim.completions)
        self.barriers = [NamedBarrier() for _ in range(16)]
        nthreads = self.block[0] * self.block[1] * self.block[2]
        self.nthreads = nthreads
        nwarps = (nthreads + 31) // 32
        self.warps = [Warp(sim, self, w, nthreads, sim.prog.reg_bits) for w in range(nwarps)]
        self.wgmma_fifo: dict = {}  # warpgroup -> list of formed ops in issue order
        self.exited = False
        self.cluster = None  # list of CTAs of the cluster (set by the simulator)
        self.async_waiter = Waiter()  # moves when an async op of this CTA lands


class AsyncOp:
    """An asynchronous operation in flight: lands by ``complete()``; ``ready()`` says whether it may land now."""

    def __init__(self, cta, kind: str, line: int, complete: Callable[[], None], ready=None):
        self.cta, self.kind, self.line = cta, kind, line
        self._complete, self._ready = complete, ready
        self.done = False
        self.release = None  # what the op holds until the wait that retires it (a store's source)

    def ready(self) -> bool:
        return self._ready is None or self._ready()

    def complete(self):
        if not self.done:
            self.done = True
            self._complete()
            self.cta.async_waiter.version += 1


class Program:
    """A kernel's instructions compiled to handlers, and its register layout."""

    def __init__(self, module: P.Module, fn: P.Function):
        self.module, self.fn = module, fn
        self.reg_index = {}
        self.reg_bits = []
        for name, bits in fn.regs.items():
            self.reg_index[name] = len(self.reg_bits)
            self.reg_bits.append(bits)
        self.instrs = fn.instrs
        self.handlers: list = [None] * len(fn.instrs)
        self._by_width = {b: [i for i, x in enumerate(self.reg_bits) if x == b] for b in set(self.reg_bits)}

    def new_registers(self) -> list:
        """One warp's register file: a (32,) array per register, rows of one block per width (cheap to make)."""
        regs = [None] * len(self.reg_bits)
        for bits, idxs in self._by_width.items():
            # a .b128 register (PTX ISA 5.2.2) is a (32, 2) uint64 array: column 0 the low 64 bits, 1 the high
            block = np.zeros((len(idxs), 32), DTYPE[bits]) if bits != 128 else np.zeros((len(idxs), 32, 2), np.uint64)
            for i, row in zip(idxs, block):
                regs[i] = row
        return regs


class Simulator:
    """One launch. ``run()`` executes it to completion or raises a ``SimError`` with the evidence.

    ``scoreboarded_tcgen05_ld`` (off by default): an explicit acceptance of a pattern outside the PTX ISA, for FA4's
    SM100 forward (flash_attn.cute.flash_fwd_sm100, known good on B200), which has no tcgen05.wait::ld (its
    ``fence_view_async_tmem_load`` calls are commented out): its softmax warps tcgen05.ld S, compute P from those
    registers and tcgen05.st P over S's cells, and its correction warps rescale O in place likewise. Reading a load's
    registers is ordered by the ISA (9.7.16.6.4.5: "For tcgen05.ld, an intra-thread ordering through true register
    dependency will be respected"), but the overwrite of the cells is not: "This form of register dependency does not
    imply any other form of ordering. For example, a register dependency does not imply that a dependee
    instruction's memory accesses will be performed before a dependent instruction's memory accesses. To enforce such
    memory orderings and avoiding anti-dependency hazards around tcgen05.ld, tcgen05.wait::ld must be used." With the
    option, a tcgen05.ld whose every destination register its warp has read counts as retired by tcgen05.wait::ld
    (its Tensor Memory reads done: the hardware delivered all its data), which is what FA4 relies on.

    ``in_order_tcgen05_mma`` (off by default): a second explicit acceptance, of one thread's tcgen05.mma operations
    executing in issue order. The ISA orders two MMAs of a thread only when they form a pipelined pair (9.7.16.6.2
    "Pipelined tcgen05 Instructions": "The asynchronous tcgen05 operations may execute and complete in a different
    order than they were issued. However, some specific pairs of asynchronous tcgen05 instructions form tcgen05
    pipelines, where in the two asynchronous operations are guaranteed to execute in the same order as the
    instructions that issued them"; for mma -> mma the pair needs the same .cta_group, accumulator and shape). Without
    the option an MMA issued over Tensor Memory that an earlier, not yet completed MMA of the thread reads (its A
    operand) or writes as another accumulator is a hazard, whatever the landing order. FA4's SM100 forward (known
    good on B200) issues the QK MMA into an S slot right after the PV MMA that reads that slot's P, with no wait
    between (with one Q tile and with two); so does ``PagedAttentionSm100``. The simulator lands one thread's MMAs
    in issue order either way (an order the ISA allows)."""

    # Schedules by seed: (chance an async op lands between two warp quanta, longest quantum). Seed 0 interleaves
    # finely with prompt landings; seed 1 lands late (copies and MMAs stay in flight across many instructions, so a
    # read that does not wait meets them); seed 2 runs warps in long stretches; others vary both.
    SCHEDULES = ((0.25, 48), (0.02, 16), (0.6, 400))

    def __init__(self, spec: LaunchSpec, gmem: GlobalMemory, seed: int = 0, *, async_rate: Optional[float] = None,
                 max_quantum: Optional[int] = None, max_steps: int = 200_000_000, strict_poison: bool = True,
                 concurrent_ctas: int = 132, trace: bool = False, scoreboarded_tcgen05_ld: bool = False,
                 in_order_tcgen05_mma: bool = False):
        self.spec, self.gmem, self.seed = spec, gmem, seed
        self.scoreboarded_tcgen05_ld = scoreboarded_tcgen05_ld
        self.in_order_tcgen05_mma = in_order_tcgen05_mma
        self.rng = np.random.default_rng(seed)
        self.module = P.parse(spec.ptx)
        self.fn = self.module.entry(spec.kernel)
        self.prog = Program(self.module, self.fn)
        if seed < len(self.SCHEDULES):
            rate, quantum = self.SCHEDULES[seed]
        else:
            rate, quantum = float(self.rng.uniform(0.01, 0.7)), int(self.rng.integers(1, 300))
        self.async_rate = rate if async_rate is None else async_rate
        self.max_quantum = quantum if max_quantum is None else max_quantum
        self.max_steps = max_steps
        self.strict_poison = strict_poison
        self.concurrent_ctas = concurrent_ctas
        self.trace = trace
        self.elect_random = True
        self._warp_ids = 0
        self.completions: dict = {}  # completion id -> describe() (mbarriers, cp.async copies)
        self.instructions = 0
        self.pending: list[AsyncOp] = []
        self.epoch = 0  # moves on every synchronization state change (deadlock detection)
        # parameter buffer, laid out as the PTX declares it
        self.param_buf = np.zeros(max(self.fn.param_bytes, 1), np.uint8)
        if len(spec.params) != len(self.fn.params):
            raise SimError(f"{spec.kernel}: {len(spec.params)} parameter values for {len(self.fn.params)} "
                           f"parameters")
        for p, raw in zip(self.fn.params, spec.params):
            if len(raw) != p.size:
                raise SimError(f"parameter {p.name}: {len(raw)} bytes for a {p.size}-byte .param")
            self.param_buf[p.offset:p.offset + p.size] = np.frombuffer(bytes(raw), np.uint8)
        self.param_offset = {p.name: p.offset for p in self.fn.params}
        # shared memory: reserved 1 KiB (as sm_90's first 1 KiB), module-scope statics, then the dynamic array
        off = 1024
        self.shared_offset = {}
        for name, var in self.module.shared.items():
            if var.extern:
                continue
            off = (off + var.align - 1) // var.align * var.align
            self.shared_offset[name] = off
            off += var.size
        dyn_align = max([v.align for v in self.module.shared.values() if v.extern] or [16])
        off = (off + dyn_align - 1) // dyn_align * dyn_align
        for name, var in self.module.shared.items():
            if var.extern:
                self.shared_offset[name] = off
        self.static_smem = off - 1024
        self.smem_size = off + spec.dyn_smem
        self.local_size = sum(s for s, a in self.fn.local_vars.values()) + 64
        self.local_offset = {}
        lo = 0
        for name, (size, align) in self.fn.local_vars.items():
            lo = (lo + align - 1) // align * align
            self.local_offset[name] = lo
            lo += size
        from . import ops  # noqa: the instruction families register their compilers
        self.ops = ops
        for i, ins in enumerate(self.prog.instrs):
            self.prog.handlers[i] = ops.compile_instr(self, ins, i)
        self.reg_budget_total = 65536

    # ------------------------------------------------------------------------------------------------------------
    def new_completion(self, describe) -> int:
        """A fresh completion id (``SharedMemory.landed``); ``describe()`` names it in reports."""
        cid = len(self.completions) + 1
        self.completions[cid] = describe
        return cid

    def next_warp_id(self) -> int:
        self._warp_ids += 1
        return self._warp_ids - 1

    def ctx(self, warp: Warp, ins: P.Instr, lanes=None) -> Callable[[], str]:
        def text():
            where = f"\n  kernel {self.spec.kernel[:90]}, PTX line {ins.line}: {ins.text.strip()[:200]}"
            who = f"\n  CTA {warp.cta.ctaid} warp {warp.wid}" + (f" lanes {_lanes(lanes)}" if lanes is not None
                                                                   else "")
            return where + who
        return text

    def cluster_ctas(self):
        """CTAs in launch order, grouped by cluster."""
        gx, gy, gz = self.spec.grid
        cx, cy, cz = self.spec.cluster
        for ccz in range(gz // cz):
            for ccy in range(gy // cy):
                for ccx in range(gx // cx):
                    members = []
                    for z in range(cz):
                        for y in range(cy):
                            for x in range(cx):
                                ctaid = (ccx * cx + x, ccy * cy + y, ccz * cz + z)
                                rank = x + y * cx + z * cx * cy
                                members.append((ctaid, (ccx, ccy, ccz), rank))
                    yield members

    def run(self) -> dict:
        t0 = time.perf_counter()
        g, c = self.spec.grid, self.spec.cluster
        if any(gi % ci for gi, ci in zip(g, c)):
            raise SimError(f"grid {g} is not a multiple of the cluster {c}")
        if self.fn.reqntid and tuple(self.fn.reqntid) != tuple(self.spec.block):
            raise SimError(f"block {self.spec.block} but the kernel requires .reqntid {self.fn.reqntid}")
        # what the driver would refuse (cudaLaunchKernelEx): block, cluster and shared-memory limits of sm_90/100
        threads = self.spec.block[0] * self.spec.block[1] * self.spec.block[2]
        if not 0 < threads <= 1024:
            raise SimError(f"block {self.spec.block}: {threads} threads (1..1024)")
        if c[0] * c[1] * c[2] > 16:
            raise SimError(f"cluster {c}: more than 16 CTAs")
        if self.smem_size - 1024 > MAX_SMEM:
            raise SimError(f"{self.smem_size - 1024} B of shared memory per CTA ({self.static_smem} static + "
                           f"{self.spec.dyn_smem} dynamic), past the {MAX_SMEM} B a CTA may have")
        # clusters not launched yet, in launch order: each wave takes the next ones; clusterlaunchcontrol.try_cancel
        # (ops/clc.py) removes one before it starts
        self.unlaunched = collections.deque(self.cluster_ctas())
        per_wave = max(1, self.concurrent_ctas // (c[0] * c[1] * c[2]))
        while self.unlaunched:
            ctas = []
            wave = [self.unlaunched.popleft() for _ in range(min(per_wave, len(self.unlaunched)))]
            for members in wave:
                group = [CTA(self, ctaid, cid, rank) for ctaid, cid, rank in members]
                for cta in group:
                    cta.cluster = group
                    cta.smem.strict_poison = self.strict_poison
                ctas.extend(group)
            self._run_wave(ctas)
        dt = time.perf_counter() - t0
        return {"instructions": self.instructions, "seconds": dt,
                "instructions_per_second": self.instructions / dt if dt else 0.0}

    def _run_wave(self, ctas: list) -> None:
        live = [w for cta in ctas for w in cta.warps if w.active.any()]
        rng = self.rng
        released_at = -1
        while live or self.pending:
            # land asynchronous work now and then
            if self.pending and rng.random() < self.async_rate:
                self._land_one()
            w = self._pick(live)
            if w is None:
                if self.pending:
                    if not self._land_one(force=True):
                        self._deadlock(live, "asynchronous operations are pending but none may land")
                    continue
                if not live:
                    break
                # lanes whose try_wait failed retry only after their barrier changes; if nothing else can run,
                # they retry once more (a try_wait may legally fail and the code go on) before it is a deadlock
                soft = [x for x in live if any(e[4] for e in x.waits)]
                if soft and released_at != self.epoch:
                    for x in soft:
                        x.waits = [e for e in x.waits if not e[4]]
                    self.epoch += 1
                    released_at = self.epoch
                    continue
                self._deadlock(live, "every live thread waits")
            self._run_warp(w, int(rng.integers(1, self.max_quantum + 1)))
            if not w.active.any():
                live.remove(w)
            if self.instructions > self.max_steps:
                raise SimError(f"more than {self.max_steps} warp instructions: a livelock?")

    def _pick(self, live: list):
        """A random warp that can run, or None. A warp found unable to run stays so until the epoch moves (every
        change that can release a waiting lane moves it)."""
        epoch, n = self.epoch, len(live)
        if not n:
            return None
        for _ in range(6):
            w = live[int(self.rng.integers(n))]
            if w.blocked_epoch != epoch:
                if w.runnable().any():
                    return w
                w.blocked_epoch = epoch
        cands = []
        for w in live:
            if w.blocked_epoch != epoch:
                if w.runnable().any():
                    cands.append(w)
                else:
                    w.blocked_epoch = epoch
        return cands[int(self.rng.integers(len(cands)))] if cands else None

    def _land_one(self, force: bool = False) -> bool:
        ready = [op for op in self.pending if op.ready()]
        if not ready:
            return False
        op = ready[int(self.rng.integers(len(ready)))]
        self.pending.remove(op)
        op.complete()
        self.epoch += 1
        return True

    def land(self, op: AsyncOp) -> None:
        """Complete ``op`` now (a wait that requires it), with everything it depends on."""
        guard = 0
        while not op.done:
            if op.ready():
                if op in self.pending:
                    self.pending.remove(op)
                op.complete()
                self.epoch += 1
                return
            # land something ready first (a FIFO predecessor)
            if not self._land_one():
                raise SimError(f"cannot complete the {op.kind} op of PTX line {op.line}: its predecessors never "
                               f"become ready")
            guard += 1

    def _run_warp(self, w: Warp, quantum: int) -> None:
        handlers = self.prog.handlers
        instrs = self.prog.instrs
        for _ in range(quantum):
            r = w.runnable()
            if not r.any():
                return
            pcs = w.pc[r]
            pc = int(pcs.min())
            group = r & (w.pc == pc)
            if pc >= len(instrs):
                raise SimError(f"warp {w.wid} of CTA {w.cta.ctaid} ran past the last instruction (no ret/exit)")
            w.last_ins = pc
            self.instructions += 1
            if w.coll_flag:
                w.coll_wait[:] = False  # others moved: collectives may retry
                w.coll_flag = False
            if self.trace:
                print(f"[{w.cta.ctaid} w{w.wid} {_lanes(group)}] {instrs[pc].line}: {instrs[pc].text.strip()}")
            handlers[pc](w, group, pc)

    def _deadlock(self, live: list, why: str):
        lines = [f"deadlock: {why} (kernel {self.spec.kernel[:90]})"]
        for w in live:
            lines.append(f"  CTA {w.cta.ctaid} warp {w.wid}: {w.describe_wait()}")
        if self.pending:
            lines.append(f"  pending async: {[(op.kind, op.line) for op in self.pending]}")
        raise Deadlock("\n".join(lines))

    # ------------------------------------------------------------------------------------------------------------
    # address translation
    def shared_index(self, cta: CTA, addrs: np.ndarray, nbytes: int, ctx, cluster: bool = False):
        """``(cta, byte index array (n, nbytes))`` for shared addresses: the CTA's rank in the cluster above
        ``CLUSTER_SHIFT``, the offset in its shared memory below; a peer's only for a shared::cluster access."""
        addrs = np.asarray(addrs, np.int64)
        target = cta
        ranks = set((addrs >> CLUSTER_SHIFT).tolist())
        if ranks != {cta.rank}:
            if len(ranks) > 1:
                raise Unsupported("one access spanning several CTAs of the cluster")
            rank = ranks.pop()
            if not cluster:
                raise MemoryFault(f"shared::cta access at {int(addrs[0]):#x}, in the window of CTA rank {rank}, "
                                  f"not the executing CTA's (rank {cta.rank}){ctx()}")
            if rank >= len(cta.cluster):
                raise MemoryFault(f"shared::cluster address of rank {rank}, outside the cluster{ctx()}")
            target = cta.cluster[rank]
            if target.exited:
                raise Hazard(f"shared memory of CTA {target.ctaid} (rank {rank}) accessed after it exited{ctx()}")
        addrs = addrs & ((1 << CLUSTER_SHIFT) - 1)
        if nbytes > 1 and (addrs % nbytes).any():
            bad = int(addrs[(addrs % nbytes) != 0][0])
            raise MemoryFault(f"misaligned shared access: {nbytes} B at {bad:#x}{ctx()}")
        return target, addrs[:, None] + np.arange(nbytes)
