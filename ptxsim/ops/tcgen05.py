"""The 5th-generation TensorCore family of sm_100a: PTX ISA 9.1 9.7.16 "TensorCore 5th Generation Family
Instructions" — Tensor Memory (9.7.16.1), tcgen05.alloc / dealloc / relinquish_alloc_permit (9.7.16.7.1),
tcgen05.mma (9.7.16.10.9.1), tcgen05.commit (9.7.16.12.1), tcgen05.ld / st / wait (9.7.16.8),
tcgen05.fence (9.7.16.11.1).

Tensor Memory (TMEM): per CTA 128 lanes x 512 columns of 32-bit cells (9.7.16.1, sm_100a), a numpy uint32 array
created on the CTA the first time a tcgen05 instruction touches it, with per-cell state for the hazard checks:

- ``written``: a write (tcgen05.st, an MMA result) landed since the columns were allocated; a read of a cell nothing
  wrote is a ``Hazard`` (TMEM starts as random bits, like shared memory);
- ``mma_w`` / ``mma_r``: in-flight MMAs write (D) / read (A from TMEM) the cell;
- ``land_id`` / ``land_need`` / ``wop``: an MMA result landed there; -1 until the ``tcgen05.commit`` that tracks the
  MMA arrives on its mbarrier, then that mbarrier's completion id and the phase count a reader must have observed
  (9.7.16.6.4.2: mma -> commit -> mbarrier wait -> fence::after_thread_sync -> ld); ``wop``: which MMA wrote it;
  every later commit of the issuing thread releases the result as well (``releases``, ``_released_later``);
- ``ld_pend`` / ``st_pend``: a tcgen05.ld reads / tcgen05.st writes the cell and its warp has not executed
  ``tcgen05.wait::ld`` / ``wait::st`` yet.

Accesses outside the allocated columns are ``MemoryFault``s. Allocation (9.7.16.1.2, 9.7.16.7.1): powers of 2 in
[32, 512] columns; the simulator places each at a free column range aligned to its size, chosen by the seed (so a
kernel that assumes its address breaks under some seed); an allocation that does not fit waits for a dealloc (a
deadlock if none comes).

MMAs (single-thread semantics, 9.7.16.10.9.1): each issuing thread's MMAs run in issue order (9.7.16.6.2 "Pipelined
tcgen05 Instructions": mma -> mma with the same accumulator; we order all MMAs of a thread, which the ISA allows) and
land at times the seed picks. Since the ISA orders only those pairs, an MMA issued over Tensor Memory that an earlier
MMA of the thread, not landed yet, reads or writes as another accumulator is a hazard unless the simulator option
``in_order_tcgen05_mma`` accepts issue order (``_check_unordered``). Shared operands are checked at issue (landed and observed by the issuing warp,
fenced if written by the generic proxy) and locked against writes until the MMA lands. Numerics: exact products
summed in float64, rounded once to the f32/f16 accumulator (the ISA does not specify the order or intermediate
precision of the sums).

``.cta_group::2`` (CTA pairs, 9.7.16.3): alloc/dealloc by a warp of each CTA of the pair (the same columns in both
TMEMs), M = 256 MMAs split across the pair (see ``_mma``), commits (see ``_commit``); M = 128 with .cta_group::2
(datapath Layout B) raises ``Unsupported``. ``.ws``, sparse, block-scaled, ``.kind::i8``/mxf*, sub-byte types,
tcgen05.cp, tcgen05.shift, M = 64 (datapath Layout F) and the .16x* ld/st shapes raise ``Unsupported``.
"""

from __future__ import annotations

import itertools

import numpy as np

from .. import layouts
from .. import parser as P
from ..errors import Hazard, MemoryFault, Unsupported
from ..machine import AsyncOp, Waiter, _lanes
from ..memory import CLUSTER_SHIFT, WINDOW_MASK
from .memops import addr_getter, space_of
from .mma import decode_elems
from .operands import getter

LANES, COLS = 128, 512
_uid = itertools.count(1)

# .kind -> {instruction-descriptor atype/btype code: element type}, K in elements (PTX ISA 9.7.16.4.2 Table 42,
# 9.7.16.2.1 Table 39)
_KIND_TYPES = {"kind::f16": ({0: "f16", 1: "bf16"}, 16), "kind::tf32": ({2: "tf32"}, 8),
               "kind::f8f6f4": ({0: "e4m3", 1: "e5m2"}, 32)}
_KIND_DTYPES = {"kind::f16": {0: "f16", 1: "f32"}, "kind::tf32": {1: "f32"}, "kind::f8f6f4": {0: "f16", 1: "f32"}}
_BITS = {"f16": 16, "bf16": 16, "tf32": 32, "e4m3": 8, "e5m2": 8}


class TMem:
    """One CTA's Tensor Memory and its allocation and hazard state (see the module docstring)."""

    def __init__(self, rng, shared=None):
        self.data = rng.integers(0, 1 << 32, (LANES, COLS), dtype=np.uint32)
        self.written = np.zeros((LANES, COLS), bool)
        self.mma_w = np.zeros((LANES, COLS), np.int16)
        self.mma_r = np.zeros((LANES, COLS), np.int16)
        self.land_id = np.zeros((LANES, COLS), np.int32)
        self.land_need = np.zeros((LANES, COLS), np.int32)
        self.wop = np.zeros((LANES, COLS), np.int64)
        self.ld_pend = np.zeros((LANES, COLS), np.int16)
        self.st_pend = np.zeros((LANES, COLS), np.int16)
        self.allocated = np.zeros(COLS, bool)
        self.allocs: dict = {}  # first column -> number of columns
        self.last_ncols = None
        self.relinquished = False
        self.pair_allocs: set = set()  # first columns of the allocations made by tcgen05.alloc.cta_group::2
        self.waiter = Waiter()  # moves on dealloc
        # the per-thread bookkeeping below is keyed by globally unique ids (warp gid, MMA uid) and shared by every
        # CTA's TMem (``shared``): a .cta_group::2 MMA writes the TMEM of both CTAs of the pair
        sh = shared if shared is not None else {}
        self.fifo: dict = sh.setdefault("fifo", {})  # issuing (warp gid, lane) -> its MMAs not landed, in order
        self.uncommitted: dict = sh.setdefault("uncommitted", {})  # -> MMAs issued since its last tcgen05.commit
        self.issued: dict = sh.setdefault("issued", {})  # -> its MMAs not known complete (a commit tracks them all)
        # every tcgen05.commit tracks all prior MMAs of its thread (9.7.16.12.1), so a result is released by each
        # later commit of the issuing thread, not only by the first: MMA uid -> (issuing thread, issue number);
        # issuing thread -> MMAs it issued; -> [(MMAs issued before the commit, mbarrier completion id, phase)]
        self.mma_src: dict = sh.setdefault("mma_src", {})
        self.mma_count: dict = sh.setdefault("mma_count", {})
        self.releases: dict = sh.setdefault("releases", {})


def tmem(cta) -> TMem:
    tm = getattr(cta, "tmem", None)
    if tm is None:
        sim = cta.sim
        if not hasattr(sim, "tc_shared"):
            sim.tc_shared = {}
        tm = cta.tmem = TMem(sim.rng, sim.tc_shared)
    return tm


def _pair(w, ctx):
    """The CTA pair of the executing CTA (PTX ISA 9.7.16.3 "CTA pair": the CTAs of cluster ranks r and r ^ 1), even
    rank first."""
    cl, r = w.cta.cluster, w.cta.rank
    if cl is None or (r ^ 1) >= len(cl):
        raise Hazard(f".cta_group::2 tcgen05 instruction in CTA rank {r}, whose peer (rank {r ^ 1}) is not in its "
                     f"cluster of {len(cl) if cl else 1} CTA(s) (PTX ISA 9.7.16.3){ctx()}")
    return cl[r & ~1], cl[r | 1]


class _Ld:
    """A tcgen05.ld its warp has not retired by tcgen05.wait::ld: the TMEM cells it reads (``ld_pend``) and its
    destination registers not read yet (a read of one waits for the load: PTX ISA 9.7.16.6.4.5, see
    ``operands._check_pending``). With the simulator option ``scoreboarded_tcgen05_ld`` (see ``Simulator``), a load
    whose every destination register its warp has read counts as retired for the TMEM hazards too."""
    __slots__ = ("line", "regs", "cells", "tm", "w", "scoreboarded")

    def __str__(self):
        return f"the tcgen05.ld of PTX line {self.line}"

    def read(self, idx):
        self.regs.discard(idx)
        if not self.regs and self.scoreboarded and self in self.w.tc_ld:
            self.w.tc_ld.remove(self)
            self.retire()

    def retire(self):
        np.subtract.at(self.tm.ld_pend, self.cells, 1)
        for i in self.regs:
            self.w.pending_regs.discard(i)
            self.w.pending_kind.pop(i, None)
        self.regs = set()


def _warp_state(w):
    if not hasattr(w, "tc_ld"):
        w.tc_ld = []  # _Ld records of tcgen05.ld not yet waited
        w.tc_st = []  # (lanes, cols) of tcgen05.st not yet waited
        w.pending_kind = {}  # register index -> the tcgen05.ld writing it (operands._check_pending)
    return w


def _split(taddr: int):
    return (taddr >> 16) & 0xFFFF, taddr & 0xFFFF


def _check_alloc(tm, cols, what, ctx):
    cols = np.asarray(cols)
    if cols.size and (cols.min() < 0 or cols.max() >= COLS or not tm.allocated[cols].all()):
        bad = sorted(set(np.asarray(cols).ravel().tolist()) - set(np.flatnonzero(tm.allocated).tolist()))
        raise MemoryFault(f"{what}: Tensor Memory column(s) {bad[:4]}{'...' if len(bad) > 4 else ''} outside every "
                          f"tcgen05.alloc allocation of the CTA (allocated: "
                          f"{ {c: n for c, n in sorted(tm.allocs.items())} }){ctx()}")


def _check_read(tm, lanes, cols, what, ctx, observed, describe=None):
    """A read of TMEM cells (tcgen05.ld, an MMA's A operand): allocated, written, no in-flight MMA writing them, no
    unwaited tcgen05.st, and an MMA result there must have its commit's mbarrier phase observed by the reader."""
    _check_alloc(tm, cols, what, ctx)
    if tm.mma_w[lanes, cols].any():
        i = np.flatnonzero(tm.mma_w[lanes, cols].ravel())[0]
        raise Hazard(f"{what} of TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])} while an in-flight "
                     f"tcgen05.mma still writes it (no wait on the mbarrier its tcgen05.commit arrives on){ctx()}")
    if tm.st_pend[lanes, cols].any():
        i = np.flatnonzero(tm.st_pend[lanes, cols].ravel())[0]
        raise Hazard(f"{what} of TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])}, which a tcgen05.st "
                     f"writes and its warp has not executed tcgen05.wait::st (PTX ISA 9.7.16.6.4.4){ctx()}")
    if not tm.written[lanes, cols].all():
        i = np.flatnonzero(~tm.written[lanes, cols].ravel())[0]
        raise Hazard(f"{what} of TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])}, which nothing "
                     f"wrote since it was allocated{ctx()}")
    ids = tm.land_id[lanes, cols]
    if (ids < 0).any() and not _released_later(tm, tm.wop[lanes, cols][ids < 0], observed):
        i = np.flatnonzero(ids.ravel() < 0)[0]
        raise Hazard(f"{what} of TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])}: an MMA result "
                     f"landed there but no tcgen05.commit tracking that MMA has arrived on its mbarrier, so no reader "
                     f"can have observed its completion{ctx()}")
    if (ids > 0).any() and observed is not None:
        need = tm.land_need[lanes, cols]
        for cid in np.unique(ids[ids > 0]).tolist():
            want = int(need[ids == cid].max())
            if observed.get(cid, 0) < want and not _released_later(tm, tm.wop[lanes, cols][ids == cid], observed):
                i = np.flatnonzero((ids == cid).ravel())[0]
                f = (describe or {}).get(cid)
                d = f() if f else f"completion {cid}"
                raise Hazard(f"{what} of TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])}: the MMA "
                             f"result there is released by {d}, phase {want} needed, but the reader observed "
                             f"{observed.get(cid, 0)} phase(s) (no wait on the tcgen05.commit's mbarrier){ctx()}")


def _released_later(tm, uids, observed) -> bool:
    """Whether the reader observed, for every MMA result in ``uids``, the phase of some tcgen05.commit of the
    issuing thread issued after that MMA: PTX ISA 9.7.16.12.1 tcgen05.commit "makes the mbarrier object at address
    mbar track the completion of all prior asynchronous tcgen05 operations (.mma, .cp, .shift) initiated by the
    executing thread", so a commit releases earlier-committed MMAs too (a GEMM commits each k-block to its smem
    stage's empty barrier, then the whole accumulator to the accumulator-full barrier the epilogue waits on)."""
    if observed is None:
        return False
    for uid in np.unique(uids).tolist():
        src = tm.mma_src.get(uid)
        if src is None:
            return False
        key, n = src
        if not any(lim > n and observed.get(cid, 0) >= need for lim, cid, need in tm.releases.get(key, ())):
            return False
    return True


def _check_write(tm, lanes, cols, what, ctx, warp=None):
    _check_alloc(tm, cols, what, ctx)
    for arr, why in ((tm.mma_w, "an in-flight tcgen05.mma writes it"), (tm.mma_r, "an in-flight tcgen05.mma reads "
                                                                                 "it (A operand)"),
                     (tm.ld_pend, "a tcgen05.ld not yet retired by tcgen05.wait::ld reads it (a read of the "
                                  "load's registers does not order its Tensor Memory read before this write: PTX ISA "
                                  "9.7.16.6.4.5; see the simulator option scoreboarded_tcgen05_ld)")):
        v = arr[lanes, cols]
        if v.any():
            i = np.flatnonzero(v.ravel())[0]
            raise Hazard(f"{what} to TMEM lane {int(lanes.ravel()[i])} column {int(cols.ravel()[i])} while {why}"
                         f"{ctx()}")


class UmmaOp:
    __slots__ = ("uid", "line", "cta", "m", "n", "k", "dtype", "atype", "btype", "neg_a", "neg_b", "d_lane", "d_col",
                 "a_tmem", "enable_d", "scale_d", "mask", "async_op", "key", "parts")


class _Part:
    """The share of one CTA in an MMA: its TMEM ``tm`` holds D rows ``r0`` .. ``r0 + rows - 1`` in lanes 0 ..
    rows - 1; ``a_idx`` / ``a_cells``: its A rows (shared memory bytes / TMEM cells), ``b_idx``: its B rows (N / 2 of
    them for .cta_group::2, all N for ::1)."""
    __slots__ = ("cta", "tm", "r0", "rows", "a_idx", "a_cells", "b_idx")


# ------------------------------------------------------------------------------------------------------------------
def compile_tcgen05(sim, ins):
    words = ins.words
    kind = words[1]
    groups = [wd for wd in words if wd.startswith("cta_group::")]
    if groups:
        # PTX ISA 9.7.16.7.1: "All tcgen05 instructions within a kernel must specify the same value for the
        # .cta_group qualifier"
        first = getattr(sim, "tc_group", None)
        if first is None:
            sim.tc_group = (groups[0], ins.line)
        elif first[0] != groups[0]:
            raise Hazard(f"{ins.opcode} (PTX line {ins.line}) and the tcgen05 instruction of PTX line {first[1]} "
                         f"specify different .cta_group qualifiers: all tcgen05 instructions of a kernel must specify "
                         f"the same value (PTX ISA 9.7.16.7.1)")
    if kind == "alloc":
        return _alloc(sim, ins)
    if kind == "dealloc":
        return _dealloc(sim, ins)
    if kind == "relinquish_alloc_permit":
        return _relinquish(sim, ins)
    if kind == "mma":
        return _mma(sim, ins)
    if kind == "commit":
        return _commit(sim, ins)
    if kind in ("ld", "st"):
        return _ldst(sim, ins, kind)
    if kind in ("wait::ld", "wait::st"):
        return _wait(sim, ins, kind)
    if kind in ("fence::before_thread_sync", "fence::after_thread_sync"):
        return _fence(sim, ins)
    raise Unsupported(f"tcgen05.{kind}")


def _aligned(sim, w, m, ins, ctx):
    if not (m == w.active).all():
        raise Hazard(f"{ins.opcode} (.sync.aligned) executed by part of a warp (lanes {_lanes(m)} of "
                     f"{_lanes(w.active)}){ctx()}")


def _uniform(vals, what, ctx) -> int:
    u = set(np.asarray(vals).tolist())
    if len(u) != 1:
        raise Hazard(f"{what} differs across the lanes of the warp: {sorted(u)[:4]}{ctx()}")
    return int(u.pop())


def _alloc(sim, ins):
    """PTX ISA 9.7.16.7.1 tcgen05.alloc.cta_group::1.sync.aligned{.shared::cta}.b32 [dst], nCols: allocates nCols
    columns (a power of 2 in [32, 512], not more than the previous allocation of the CTA, never after
    relinquish_alloc_permit) and writes the TMEM address (lane 0 << 16 | first column) to shared memory at dst (a weak
    generic-proxy store). Blocks while the columns are not available.

    ``.cta_group::2``: "one warp from each of the peer CTAs must collectively perform the allocation" (9.7.16.7.1):
    the first warp of the pair to arrive waits for the peer's; then the same columns, free in the TMEM of both CTAs,
    are allocated in both (same nCols required), and each warp's CTA gets the address at its own dst, so the
    d-tmem address of a .cta_group::2 MMA names the same columns in both CTAs."""
    pair = "cta_group::2" in ins.words
    space = space_of(ins.words)
    if space not in ("shared::cta", "generic", "shared"):
        raise Unsupported(f"{ins.opcode}: destination space {space}")
    ag = addr_getter(sim, ins.operands[0])
    ng = getter(sim, ins.operands[1], 32)

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        _aligned(sim, w, m, ins, ctx)
        tm = tmem(w.cta)
        ncols = _uniform(ng(w)[m], "tcgen05.alloc nCols", ctx)
        dst = _uniform(ag(w)[m], "tcgen05.alloc destination", ctx)
        if space == "generic":
            dst &= WINDOW_MASK
        if ncols < 32 or ncols > 512 or ncols & (ncols - 1):
            raise Hazard(f"tcgen05.alloc of {ncols} columns: must be a power of 2 in [32, 512] (PTX ISA "
                         f"9.7.16.7.1){ctx()}")
        if tm.relinquished:
            raise Hazard(f"tcgen05.alloc after the CTA executed tcgen05.relinquish_alloc_permit (PTX ISA "
                         f"9.7.16.7.1){ctx()}")
        if tm.last_ncols is not None and ncols > tm.last_ncols:
            raise Hazard(f"tcgen05.alloc of {ncols} columns after one of {tm.last_ncols}: the number of columns "
                         f"allocated must not increase between two allocations of a CTA (PTX ISA 9.7.16.7.1){ctx()}")
        if pair:
            col = _pair_alloc(w, m, pc, tm, ncols, ctx)
            if col is None:
                return
        else:
            free = [c for c in range(0, COLS, ncols) if not tm.allocated[c:c + ncols].any()]
            if not free:
                w.pc[m] = pc
                w.waits.append((m.copy(), tm.waiter, tm.waiter.version,
                                lambda: f"tcgen05.alloc of {ncols} columns (PTX line {ins.line}): Tensor Memory "
                                        f"allocations {dict(sorted(tm.allocs.items()))} leave no room", False))
                return
            col = free[int(sim.rng.integers(len(free)))]
            _take(tm, col, ncols)
        cta, idx = sim.shared_index(w.cta, np.array([dst]), 4, ctx)
        cta.smem.write(idx, np.array([[col & 0xFF, col >> 8, 0, 0]], np.uint8), "tcgen05.alloc", ctx, writer=w.gid,
                       line=ins.line, stamp=w.epoch + 1)
    return body


def _take(tm, col, ncols, pair=False):
    tm.allocated[col:col + ncols] = True
    tm.allocs[col] = ncols
    tm.last_ncols = ncols
    tm.written[:, col:col + ncols] = False
    if pair:
        tm.pair_allocs.add(col)


def _pair_alloc(w, m, pc, tm, ncols, ctx):
    """The rendezvous of a tcgen05.alloc.cta_group::2 (see ``_alloc``): the first column once both CTAs' warps
    arrived and the columns are free in both, else None (the warp waits, re-executing the instruction)."""
    sim = w.sim
    even, odd = _pair(w, ctx)
    st = getattr(even, "tc_pair_alloc", None)
    if st is None:
        st = even.tc_pair_alloc = {"pending": {}, "results": {}, "waiter": Waiter()}
    me, peer = w.cta.rank, w.cta.rank ^ 1
    if me in st["results"]:
        return st["results"].pop(me)
    st["pending"].setdefault(me, ncols)
    if peer not in st["pending"]:
        w.pc[m] = pc
        w.waits.append((m.copy(), st["waiter"], st["waiter"].version,
                        lambda: f"tcgen05.alloc.cta_group::2 of {ncols} columns: the peer CTA (rank {peer}) never "
                                f"performed its tcgen05.alloc.cta_group::2", False))
        return None
    if st["pending"][peer] != ncols:
        raise Hazard(f"tcgen05.alloc.cta_group::2 of {ncols} columns while the peer CTA (rank {peer}) allocates "
                     f"{st['pending'][peer]} (PTX ISA 9.7.16.7.1){ctx()}")
    ptm = tmem(w.cta.cluster[peer])
    free = [c for c in range(0, COLS, ncols) if not tm.allocated[c:c + ncols].any()
            and not ptm.allocated[c:c + ncols].any()]
    if not free:
        w.pc[m] = pc  # a dealloc in either CTA moves both CTAs' waiters
        w.waits.append((m.copy(), tm.waiter, tm.waiter.version,
                        lambda: f"tcgen05.alloc.cta_group::2 of {ncols} columns: the Tensor Memory allocations of "
                                f"the pair ({dict(sorted(tm.allocs.items()))}, {dict(sorted(ptm.allocs.items()))}) "
                                f"leave no columns free in both", False))
        return None
    col = free[int(sim.rng.integers(len(free)))]
    for t in (tm, ptm):
        _take(t, col, ncols, pair=True)
    del st["pending"][me], st["pending"][peer]
    st["results"][peer] = col
    st["waiter"].version += 1
    return col


def _dealloc(sim, ins):
    """PTX ISA 9.7.16.7.1 tcgen05.dealloc.cta_group::1.sync.aligned.b32 taddr, nCols: frees an allocation made by
    tcgen05.alloc (same address and size). A dealloc while an MMA, tcgen05.ld or tcgen05.st on those columns is still
    in flight is a ``Hazard`` (the ISA requires the accesses to be complete). ``.cta_group::2`` frees an allocation
    made by tcgen05.alloc.cta_group::2; each CTA's warp frees its own CTA's columns (the ISA has both warps perform
    it "collectively"; the simulator does not wait for the peer's)."""
    pair = "cta_group::2" in ins.words
    tg = getter(sim, ins.operands[0], 32)
    ng = getter(sim, ins.operands[1], 32)

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        _aligned(sim, w, m, ins, ctx)
        tm = tmem(w.cta)
        taddr = _uniform(tg(w)[m], "tcgen05.dealloc taddr", ctx)
        ncols = _uniform(ng(w)[m], "tcgen05.dealloc nCols", ctx)
        lane, col = _split(taddr)
        if lane != 0 or tm.allocs.get(col) != ncols:
            raise Hazard(f"tcgen05.dealloc of {ncols} columns at TMEM address {taddr:#x}: not an allocation of the "
                         f"CTA (allocations: {dict(sorted(tm.allocs.items()))}){ctx()}")
        sl = np.s_[:, col:col + ncols]
        for arr, why in ((tm.mma_w, "an in-flight tcgen05.mma writes"), (tm.mma_r, "an in-flight tcgen05.mma reads"),
                         (tm.ld_pend, "a tcgen05.ld not retired by wait::ld reads"),
                         (tm.st_pend, "a tcgen05.st not retired by wait::st writes")):
            if arr[sl].any():
                raise Hazard(f"tcgen05.dealloc of columns {col}-{col + ncols - 1} while {why} them{ctx()}")
        ids = tm.land_id[sl]
        # the deallocating warp must know the MMAs complete: a tracking commit arrived (the first one, or a later
        # one of the issuing thread whose phase the warp observed: 9.7.16.12.1, ``_released_later``)
        if (ids < 0).any() and not _released_later(tm, tm.wop[sl][ids < 0], w.observed):
            raise Hazard(f"tcgen05.dealloc of columns {col}-{col + ncols - 1}: an MMA result landed there whose "
                         f"tcgen05.commit has not arrived{ctx()}")
        if pair != (col in tm.pair_allocs):
            raise Hazard(f"tcgen05.dealloc.cta_group::{2 if pair else 1} of the allocation at column {col}, made by "
                         f"tcgen05.alloc.cta_group::{1 if pair else 2}{ctx()}")
        tm.pair_allocs.discard(col)
        del tm.allocs[col]
        tm.allocated[col:col + ncols] = False
        tm.written[sl] = False
        tm.land_id[sl] = 0
        tm.waiter.version += 1
        if pair:
            tmem(w.cta.cluster[w.cta.rank ^ 1]).waiter.version += 1
        sim.epoch += 1
    return body


def _relinquish(sim, ins):
    """PTX ISA 9.7.16.7.1 tcgen05.relinquish_alloc_permit: the CTA may not tcgen05.alloc afterwards."""
    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        _aligned(sim, w, m, ins, ctx)
        tmem(w.cta).relinquished = True
    return body


def _fence(sim, ins):
    """PTX ISA 9.7.16.11.1 tcgen05.fence::before_thread_sync / after_thread_sync: order asynchronous tcgen05
    operations before/after a thread synchronization (9.7.16.6.3). No effect here: the simulator performs each
    tcgen05.ld/st's TMEM access when it is issued and each MMA when it lands, under one sequentially consistent
    order; what the fences cannot fix (a missing tcgen05.wait or mbarrier wait) is caught by the TMEM hazards. A
    missing fence is not detected."""
    return lambda w, m, pc: None


def _wait(sim, ins, kind):
    """PTX ISA 9.7.16.8.5 tcgen05.wait::ld / wait::st: the executing thread's prior tcgen05.ld (their destination
    registers become readable) / tcgen05.st have completed."""
    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        _aligned(sim, w, m, ins, ctx)
        _warp_state(w)
        tm = tmem(w.cta)
        if kind == "wait::ld":
            for rec in w.tc_ld:
                rec.retire()
            w.tc_ld = []
        else:
            for ln, cl in w.tc_st:
                np.subtract.at(tm.st_pend, (ln, cl), 1)
            w.tc_st = []
    return body


def _ldst(sim, ins, kind):
    """PTX ISA 9.7.16.8.3 tcgen05.ld.sync.aligned.shape.num.b32 r, [taddr] and 9.7.16.8.4 tcgen05.st: move
    32-bit cells between TMEM and registers by ``layouts.tmem_ld_st_map`` (only .32x32b). The access happens at
    issue. A read of a tcgen05.ld destination register waits for the load (9.7.16.6.4.5: "For tcgen05.ld, an
    intra-thread ordering through true register dependency will be respected regardless of the presence or absence
    of other forms of synchronization"; ``operands._check_pending``); a write of one before ``tcgen05.wait::ld`` or a
    read of it is a hazard. The cells a tcgen05.ld reads / tcgen05.st writes may not be written / read by others
    until the matching wait (9.7.16.6.4.5: "To enforce such memory orderings and avoiding anti-dependency hazards
    around tcgen05.ld, tcgen05.wait::ld must be used"; the option ``scoreboarded_tcgen05_ld`` relaxes this for FA4,
    see ``_Ld``). .pack::16b / .unpack::16b, .red and .16x32bx2 raise ``Unsupported``."""
    words = ins.words
    shapes = [wd for wd in words if wd in ("32x32b", "16x64b", "16x128b", "16x256b", "16x32bx2")]
    nums = [wd for wd in words if wd.startswith("x") and wd[1:].isdigit()]
    if len(shapes) != 1 or len(nums) != 1 or "b32" not in words:
        raise Unsupported(f"{ins.opcode}")
    if "red" in words or any(wd.startswith(("pack::", "unpack::")) for wd in words):
        raise Unsupported(f"{ins.opcode}: .red / .pack::16b / .unpack::16b")
    shape, num = shapes[0], int(nums[0][1:])
    if shape != "32x32b":
        raise Unsupported(f"{ins.opcode}: shape .{shape} (only .32x32b is modelled; the ISA defines the others by "
                          f"figures not encoded here)")
    ops = ins.operands
    vec, addr = (ops[0], ops[1]) if kind == "ld" else (ops[1], ops[0])
    if not isinstance(vec, P.Vec) or len(vec.items) != num:
        raise Unsupported(f"{ins.opcode}: {num} registers expected")
    ag = addr_getter(sim, addr)
    regs = [sim.prog.reg_index[r.name] for r in vec.items]
    srcs = [getter(sim, r, 32) for r in vec.items] if kind == "st" else None

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        _aligned(sim, w, m, ins, ctx)
        _warp_state(w)
        tm = tmem(w.cta)
        taddr = _uniform(ag(w)[m] & 0xFFFFFFFF, f"tcgen05.{kind} taddr", ctx)
        try:
            ln, cl = layouts.tmem_ld_st_map(shape, num, w.wid % 4, taddr)
        except MemoryFault as e:
            raise MemoryFault(f"{e}{ctx()}") from None
        act = np.flatnonzero(w.active)
        ln, cl = ln[act], cl[act]  # lanes of threads that do not exist move nothing
        if kind == "ld":
            _check_read(tm, ln, cl, "tcgen05.ld", ctx, w.observed, sim.completions)
            vals = tm.data[ln, cl]
            for r, idx in enumerate(regs):
                if idx in w.pending_regs:
                    raise Hazard(f"tcgen05.ld into register {vec.items[r].name}, which an earlier tcgen05.ld not yet "
                                 f"retired by tcgen05.wait::ld also writes{ctx()}")
                w.R[idx][act] = vals[:, r]
            np.add.at(tm.ld_pend, (ln, cl), 1)
            rec = _Ld()
            rec.line, rec.regs, rec.cells, rec.tm, rec.w = ins.line, set(regs), (ln, cl), tm, w
            rec.scoreboarded = sim.scoreboarded_tcgen05_ld
            w.tc_ld.append(rec)
            w.pending_regs.update(regs)
            w.pending_kind.update((i, rec) for i in regs)
        else:
            _check_write(tm, ln, cl, "tcgen05.st", ctx)
            if tm.st_pend[ln, cl].any():
                raise Hazard(f"tcgen05.st to TMEM cells another tcgen05.st not yet retired by wait::st writes{ctx()}")
            vals = np.stack([g(w) for g in srcs], axis=1)[act]
            tm.data[ln, cl] = vals
            tm.written[ln, cl] = True
            tm.land_id[ln, cl] = 0
            tm.wop[ln, cl] = 0
            np.add.at(tm.st_pend, (ln, cl), 1)
            w.tc_st.append((ln, cl))
    return body


# ------------------------------------------------------------------------------------------------------------------
def _mma(sim, ins):
    """PTX ISA 9.7.16.10.9.1 tcgen05.mma.cta_group::1.kind [d-tmem], a-desc | [a-tmem], b-desc, idesc,
    {disable-output-lane}?, enable-input-d {, scale-input-d}: D = A*B + (enable-input-d ? D * 2^-scale-input-d : 0),
    A M x K, B K x N, D M x N in TMEM at d-tmem (row m in lane m, column n in column d + n: datapath Layout D, M = 128,
    9.7.16.10.5.4; an f16 D element sits unpacked in the low 16 bits of its cell, 9.7.16.10.4.1; we write the high
    16 bits as 0). The instruction descriptor (``layouts.umma_instr_desc_decode``) gives M, N, types, negation and
    transposes; shared operands are read by ``layouts.umma_operand_addrs``. A in TMEM: row m in lane a + m, K
    elements packed low bits first in consecutive 32-bit columns (9.7.16.10.4.2). Lanes whose disable-output-lane
    bit is set keep their D. Only ``.collector::a::discard`` (the default) is accepted: A is read from memory.
    Operands are read when the MMA lands; they are locked against writes from issue to landing.

    ``.cta_group::2`` (9.7.16.3 CTA pair; one thread of either CTA of the pair issues, 9.7.16.5 Table 46), M = 256
    only (datapath Layout A, 9.7.16.10.5.1): the CTA of even rank holds D rows 0-127 and A rows 0-127, its peer
    D rows 128-255 and A rows 128-255, each in TMEM lanes 0-127 at the same d-tmem / a-tmem address, A read from each
    CTA's own shared memory at the same descriptor (M = 128 rows per CTA); B's N columns are split in halves, N/2 x K
    described by b-desc in each CTA's shared memory, the even CTA's being columns 0 .. N/2 - 1. The split is that of
    CUTLASS's ``MMA_Traits<SM100_MMA_F16BF16_2x1SM_SS>`` (cute/atom/mma_traits_sm100.hpp): ThrID = 2 CTAs, ALayout
    (2, (M/2, K)) : (M/2, (1, M)), BLayout (2, (N/2, K)) : (N/2, (1, N)), CLayout (2, (M/2, N)) : (M/2, (1, M)).
    No known-good 2-CTA kernel has run on it yet (FA4's two-Q-tile forward, quack's 2-CTA GEMM are next).
    disable-output-lane has 8 registers, bit m for row m of the 256. M = 128 with .cta_group::2 (Layout B) raises
    ``Unsupported``."""
    words = ins.words
    kinds = [wd for wd in words if wd.startswith("kind::")]
    if len(kinds) != 1:
        raise Unsupported(f"{ins.opcode}")
    knd = kinds[0]
    if knd not in _KIND_TYPES:
        raise Unsupported(f"tcgen05.mma .{knd}")
    extra = [wd for wd in words[2:] if not (wd.startswith(("cta_group::", "kind::")) or wd == "collector::a::discard")]
    if extra:
        raise Unsupported(f"tcgen05.mma qualifier(s) {extra} (.ws, .sp, .block_scale, .ashift and the collector "
                          f"buffer fill/use/lastuse are not modelled)")
    types, kelems = _KIND_TYPES[knd]
    pair = "cta_group::2" in words
    ops = ins.operands
    d_get = addr_getter(sim, ops[0])
    a_tmem = isinstance(ops[1], P.Addr)
    a_get = addr_getter(sim, ops[1]) if a_tmem else getter(sim, ops[1], 64)
    b_get = getter(sim, ops[2], 64)
    i_get = getter(sim, ops[3], 32)
    rest = list(ops[4:])
    mask_gets = None
    if rest and isinstance(rest[0], P.Vec):
        if len(rest[0].items) != (8 if pair else 4):
            raise Unsupported(f"{ins.opcode}: disable-output-lane of {len(rest[0].items)} registers (4 for ::1, 8 "
                              f"for ::2)")
        mask_gets = [getter(sim, r, 32) for r in rest[0].items]
        rest = rest[1:]
    if not rest:
        raise Unsupported(f"{ins.opcode}: no enable-input-d operand")
    en_get = getter(sim, rest[0], 1)
    scale_get = getter(sim, rest[1], 32) if len(rest) > 1 else None
    if len(rest) > 2:
        raise Unsupported(f"{ins.opcode}: operands {rest[2:]}")

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        cta = w.cta
        tm = tmem(cta)
        dv, av, bv, iv, ev = d_get(w), a_get(w), b_get(w), i_get(w), en_get(w)
        sv = scale_get(w) if scale_get is not None else None
        mv = [g(w) for g in mask_gets] if mask_gets is not None else None
        for lane in np.flatnonzero(m).tolist():  # single-thread semantics: every executing thread issues one MMA
            _issue(sim, w, lane, ctx, tm, int(dv[lane]) & 0xFFFFFFFF,
                   int(av[lane]) & (0xFFFFFFFF if a_tmem else 0xFFFFFFFFFFFFFFFF), int(bv[lane]), int(iv[lane]),
                   bool(ev[lane]), int(sv[lane]) if sv is not None else 0,
                   sum(int(x[lane]) << (32 * j) for j, x in enumerate(mv)) if mv is not None else 0)

    def _issue(sim, w, lane, ctx, tm, d, a, b, idesc, enable_d, scale_d, mask):
        cta = w.cta
        i = layouts.umma_instr_desc_decode(idesc)
        bad = []
        if i.sparse or i.sparse_sel:
            bad.append("sparsity")
        if i.saturate:
            bad.append("saturate (integer kinds only)")
        if i.reserved:
            bad.append("reserved bits 6/23/29 set")
        if i.max_shift:
            bad.append("maximum shift (.ws only)")
        if i.dtype not in _KIND_DTYPES[knd]:
            bad.append(f"dtype {i.dtype}")
        if i.atype not in types or i.btype not in types:
            bad.append(f"atype {i.atype} / btype {i.btype}")
        if pair:
            if i.n < 32 or i.n > 256 or i.n % 16:
                bad.append(f"N = {i.n} (.cta_group::2)")
            if i.m not in (128, 256):
                bad.append(f"M = {i.m} (.cta_group::2)")
        else:
            if i.n < 8 or i.n > 256 or i.n % 8:
                bad.append(f"N = {i.n}")
            if i.m not in (64, 128):
                bad.append(f"M = {i.m}")
        if scale_d and (knd == "kind::f8f6f4" or not 0 <= scale_d <= 15):
            bad.append(f"scale-input-d {scale_d}")
        if bad:
            raise Hazard(f"tcgen05.mma .{knd} instruction descriptor {idesc:#010x} invalid for the instruction: "
                         f"{', '.join(bad)} (PTX ISA 9.7.16.4.2 Table 42, 9.7.16.2.1 Table 39){ctx()}")
        if i.m != (256 if pair else 128):
            raise Unsupported(f"tcgen05.mma{'.cta_group::2' if pair else ''} with M = {i.m} (datapath Layout "
                              f"{'B' if pair else 'F'} is not modelled){ctx()}")
        atype, btype = types[i.atype], types[i.btype]
        if (atype == "bf16") != (btype == "bf16"):
            raise Hazard(f"tcgen05.mma .kind::f16 mixing f16 and bf16 operands{ctx()}")
        ebits = _BITS[atype]
        M, N, K = i.m, i.n, kelems
        op = UmmaOp()
        op.uid, op.line, op.cta = next(_uid), ins.line, cta
        op.m, op.n, op.k = M, N, K
        op.dtype, op.atype, op.btype = _KIND_DTYPES[knd][i.dtype], atype, btype
        op.neg_a, op.neg_b = i.neg_a, i.neg_b
        op.enable_d, op.scale_d, op.mask = enable_d, scale_d, mask
        dl, dc = _split(d)
        if dl != 0:
            raise MemoryFault(f"tcgen05.mma M = {M} D at TMEM lane {dl}: Layout {'A' if pair else 'D'} uses lanes "
                              f"0-127 (PTX ISA 9.7.16.10.5){ctx()}")
        op.d_lane, op.d_col = dl, dc
        dcols = dc + np.arange(N)
        ctas = list(_pair(w, ctx)) if pair else [cta]
        rows, nb = M // len(ctas), N // len(ctas)
        op.a_tmem = a_tmem
        op.parts = []
        key = (w.gid, lane)
        for j, pc_ in enumerate(ctas):
            pt = _Part()
            pt.cta, pt.tm, pt.r0, pt.rows = pc_, tmem(pc_), j * rows, rows
            ptm = pt.tm
            where = f" (in CTA rank {pc_.rank} of the pair)" if pair else ""
            _check_alloc(ptm, dcols, "tcgen05.mma D" + where, ctx)
            smem = pc_.smem
            b_addrs = layouts.umma_operand_addrs(b, nb, K, ebits, i.trans_b == 0)
            pt.b_idx = (b_addrs[..., None] + np.arange(ebits // 8)).astype(np.int64)
            idxs = [pt.b_idx]
            pt.a_idx = pt.a_cells = None
            if a_tmem:
                if i.trans_a:
                    raise Hazard(f"tcgen05.mma with A in Tensor Memory and Transpose A set{ctx()}")
                al, ac = _split(a)
                if al != 0:
                    raise MemoryFault(f"tcgen05.mma M = {M} A at TMEM lane {al}: lanes 0-127 expected{ctx()}")
                per = 32 // ebits
                ln = np.broadcast_to(np.arange(rows)[:, None], (rows, K // per))
                cl = np.broadcast_to(ac + np.arange(K // per)[None, :], (rows, K // per))
                pt.a_cells = (ln.copy(), cl.copy())
                own = [o for o in tm.fifo.get(key, []) if any(q.tm is ptm for q in o.parts)]
                # an earlier MMA of the same thread writing A's cells is pipelined before this one (9.7.16.6.2)
                if not any(o.d_col <= ac < o.d_col + o.n for o in own):
                    _check_read(ptm, pt.a_cells[0], pt.a_cells[1], "tcgen05.mma A (Tensor Memory)" + where, ctx,
                                w.observed, sim.completions)
            else:
                a_addrs = layouts.umma_operand_addrs(a, rows, K, ebits, i.trans_a == 0)
                pt.a_idx = (a_addrs[..., None] + np.arange(ebits // 8)).astype(np.int64)
                idxs.append(pt.a_idx)
            for ix in idxs:
                smem.read(ix, "tcgen05.mma operand" + where, ctx, generic=False, observed=w.observed)
            _check_write_d(ptm, dcols, ctx)
            if not sim.in_order_tcgen05_mma:
                _check_unordered(tm.fifo.get(key, []), ptm, M, N, dc, pair, dcols, ctx)
            op.parts.append(pt)
        for pt in op.parts:
            for ix in [pt.b_idx] + ([pt.a_idx] if pt.a_idx is not None else []):
                pt.cta.smem.mma_reads[ix] += 1
            # D: in flight from now (a tcgen05.ld or st of it is a hazard until the commit's phase is observed)
            pt.tm.mma_w[:, dcols] += 1
            if a_tmem:
                pt.tm.mma_r[pt.a_cells] += 1
        op.key = key
        fifo = tm.fifo.setdefault(key, [])
        fifo.append(op)
        tm.uncommitted.setdefault(key, []).append(op)
        tm.issued.setdefault(key, []).append(op)
        tm.mma_src[op.uid] = (key, tm.mma_count.get(key, 0))
        tm.mma_count[key] = tm.mma_count.get(key, 0) + 1

        def ready(op=op, fifo=fifo):
            return fifo and fifo[0] is op

        def land(op=op):
            _execute(sim, op)
            fifo.remove(op)
        op.async_op = AsyncOp(cta, "tcgen05.mma", ins.line, land, ready)
        sim.pending.append(op.async_op)
        sim.epoch += 1

    def _check_unordered(earlier, ptm, M, N, dc, pair, dcols, ctx):
        """An earlier MMA of the issuing thread still in flight that reads (A in TMEM) or writes (another
        accumulator, or another shape) columns this one writes: the ISA does not order the two (9.7.16.6.2; see
        ``Simulator``'s ``in_order_tcgen05_mma``)."""
        for o in earlier:
            for q in o.parts:
                if q.tm is not ptm:
                    continue
                same = o.d_col == dc and o.n == N and o.m == M and (len(o.parts) == 2) == pair
                hit = None
                if not same and np.intersect1d(o.d_col + np.arange(o.n), dcols).size:
                    hit = "writes them as another accumulator"
                elif o.a_tmem and np.isin(q.a_cells[1], dcols).any():
                    hit = "reads them (its A operand)"
                if hit:
                    raise Hazard(f"tcgen05.mma D at TMEM columns {int(dcols[0])}-{int(dcols[-1])} while the "
                                 f"tcgen05.mma of PTX line {o.line}, issued earlier by this thread and not completed, "
                                 f"{hit}: the ISA orders the two only as a pipelined pair (the same accumulator and "
                                 f"shape, PTX ISA 9.7.16.6.2); wait for its commit first, or accept in-order "
                                 f"execution (simulator option in_order_tcgen05_mma){ctx()}")

    def _check_write_d(tm, dcols, ctx):
        v = tm.ld_pend[:, dcols] | tm.st_pend[:, dcols]
        if v.any():
            ln, c = np.unravel_index(np.flatnonzero(v.ravel())[0], v.shape)
            raise Hazard(f"tcgen05.mma issued with D at TMEM column {int(dcols[c])} (lane {int(ln)}) while a "
                         f"tcgen05.ld/st of it is not retired by tcgen05.wait (its warp must wait, fence and "
                         f"synchronize first){ctx()}")

    def _execute(sim, op):
        M, N, K = op.m, op.n, op.k
        ctx = lambda: f"\n  tcgen05.mma of PTX line {op.line}, CTA {op.cta.ctaid}, landing"
        dcols = op.d_col + np.arange(N)
        As, Bs = [], []
        for pt in op.parts:
            smem, tm = pt.cta.smem, pt.tm
            for ix in ([pt.b_idx] + ([pt.a_idx] if pt.a_idx is not None else [])):
                smem.mma_reads[ix] -= 1
            tm.mma_w[:, dcols] -= 1
            if op.a_tmem:
                tm.mma_r[pt.a_cells] -= 1
            Bs.append(decode_elems(smem.data[pt.b_idx], op.btype))  # (N / parts, K)
            if op.a_tmem:
                ebits = _BITS[op.atype]
                per = 32 // ebits
                cells = tm.data[pt.a_cells]  # (rows, K/per)
                parts = np.stack([(cells >> np.uint32(ebits * j)) & np.uint32((1 << ebits) - 1) for j in range(per)],
                                 axis=-1).reshape(pt.rows, K)
                raw = parts.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[ebits]).view(np.uint8)
                As.append(decode_elems(raw.reshape(pt.rows, K, ebits // 8), op.atype))
            else:
                As.append(decode_elems(smem.data[pt.a_idx], op.atype))
        Am, Bm = np.concatenate(As), np.concatenate(Bs)
        if op.neg_a:
            Am = -Am
        if op.neg_b:
            Bm = -Bm
        Dall = Am @ Bm.T  # (M, N) float64
        keep_all = np.array([(op.mask >> l) & 1 for l in range(M)], bool)
        for pt in op.parts:
            tm = pt.tm
            D = Dall[pt.r0:pt.r0 + pt.rows]
            keep = keep_all[pt.r0:pt.r0 + pt.rows]
            sub = np.s_[op.d_lane:op.d_lane + pt.rows, op.d_col:op.d_col + N]
            if (tm.ld_pend[sub].any()):
                raise Hazard(f"a tcgen05.mma result lands on TMEM cells a tcgen05.ld not retired by wait::ld still "
                             f"reads{ctx()}")
            old = tm.data[sub]
            if op.enable_d:
                if not tm.written[sub][~keep].all():
                    raise Hazard(f"tcgen05.mma with enable-input-d accumulates into TMEM cells nothing wrote{ctx()}")
                if op.dtype == "f32":
                    prev = old.view(np.float32).astype(np.float64)
                else:
                    prev = (old & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
                D = D + prev * 2.0 ** (-op.scale_d)
            if op.dtype == "f32":
                new = D.astype(np.float32).view(np.uint32)
            else:
                new = D.astype(np.float16).view(np.uint16).astype(np.uint32)
            new = np.where(keep[:, None], old, new)
            tm.data[sub] = new
            rws = ~keep
            tm.written[sub][rws] = True
            tm.land_id[sub][rws] = -1
            tm.wop[sub][rws] = op.uid
    return body


def _commit(sim, ins):
    """PTX ISA 9.7.16.12.1 tcgen05.commit.cta_group::1.mbarrier::arrive::one{.shared::cluster}{.multicast::cluster}
    .b64 [mbar] {, ctaMask}: once every prior async tcgen05 operation of the executing thread has completed (those
    an earlier commit tracked too), one arrive-on
    (count 1) on the mbarrier (on the same offset in each CTA of ctaMask with .multicast::cluster). The MMA results
    become readable by threads that observe the phase that arrival completes (9.7.16.6.4.2). Modelled as an
    asynchronous arrival that lands after the tracked MMAs, at a time the seed picks. ``.cta_group::2``: the same,
    the tracked MMAs being the executing thread's .cta_group::2 MMAs (whose D spans both CTAs of the pair); the D
    cells in a CTA holding one of the commit's mbarriers are released by the phase of that CTA's mbarrier (with
    ``.multicast::cluster`` and both CTAs of the pair in ctaMask, each CTA waits on its own)."""
    words = ins.words
    if "mbarrier::arrive::one" not in words:
        raise Unsupported(f"{ins.opcode}")
    multicast = "multicast::cluster" in words
    space = space_of(words)
    ag = addr_getter(sim, ins.operands[0])
    mask_get = getter(sim, ins.operands[1], 16) if multicast else None
    from .sync import mbar_of

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        cta = w.cta
        tm = tmem(cta)
        addrs = ag(w)
        masks = mask_get(w) if multicast else None
        for lane in np.flatnonzero(m).tolist():
            a = int(addrs[lane])
            if space == "generic":
                a &= WINDOW_MASK
            if multicast:
                cm = int(masks[lane])
                off = a & ((1 << CLUSTER_SHIFT) - 1)
                targets = [r for r in range(len(cta.cluster)) if (cm >> r) & 1]
                if cm >> len(cta.cluster):
                    raise Hazard(f"tcgen05.commit ctaMask {cm:#x} names CTAs outside the cluster of "
                                 f"{len(cta.cluster)}{ctx()}")
                bars = [mbar_of(sim, w, np.array([off | (r << CLUSTER_SHIFT)]),
                                ctx) for r in targets]
            else:
                bars = [mbar_of(sim, w, np.array([a]), ctx)]
            key = (w.gid, lane)
            ops = tm.uncommitted.pop(key, [])
            # the arrival waits for every prior async tcgen05 operation of the thread, committed before or not
            tracked = [o for o in tm.issued.get(key, []) if not o.async_op.done]
            tm.issued[key] = tracked
            observed = dict(w.observed)
            own = next((b for b in bars if b.cta is cta), bars[0] if bars else None)

            def ready(tracked=tracked):
                return all(o.async_op.done for o in tracked)

            def land(ops=ops, bars=bars, own=own, observed=observed, key=key, lim=tm.mma_count.get(key, 0)):
                if own is not None:
                    need = own.phase + 1
                    tm.releases.setdefault(key, []).append((lim, own.cid, need))
                    for b in bars:
                        if b is not own:
                            tm.releases[key].append((lim, b.cid, b.phase + 1))
                    for o in ops:
                        for pt in o.parts:
                            # cells in a CTA with one of the commit's mbarriers are released by that one
                            bar = next((b for b in bars if b.cta is pt.cta), own)
                            sl = np.s_[o.d_lane:o.d_lane + pt.rows, o.d_col:o.d_col + o.n]
                            mine = pt.tm.wop[sl] == o.uid
                            pt.tm.land_id[sl][mine] = bar.cid
                            pt.tm.land_need[sl][mine] = bar.phase + 1
                for bar in bars:
                    bar.arrive(1, ctx, observed)
            op = AsyncOp(cta, "tcgen05.commit", ins.line, land, ready)
            sim.pending.append(op)
        sim.epoch += 1
    return body


COMPILERS = {"tcgen05": compile_tcgen05}
