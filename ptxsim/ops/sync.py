"""Synchronization: named barriers (PTX ISA 9.7.13.1 bar/barrier), mbarrier objects (9.7.13.15), cluster barriers
(9.7.13.3 barrier.cluster), memory fences (9.7.13.4 membar/fence, incl. fence.proxy.async), warp collectives (9.7.9.6
shfl.sync, 9.7.13.7 vote.sync, 9.7.13.8 match.sync, 9.7.13.9 activemask, 9.7.13.10 redux.sync, 9.7.13.11 elect.sync,
9.7.13.2 bar.warp.sync), setmaxnreg (9.7.17.1) and griddepcontrol (9.7.13.14).

The simulator runs one instruction at a time over a sequentially consistent memory, so fences that only order
memory have no effect beyond the proxy tracking (``fence.proxy.async``); what they cannot fix (a missing wait) is
still caught by the hazards.
"""

from __future__ import annotations

import numpy as np

from .. import parser as P
from ..errors import Hazard, MemoryFault, Unsupported
from ..machine import DTYPE, Waiter, _lanes
from ..memory import CLUSTER_SHIFT, WINDOW_MASK, merge
from .control import Hold, converge
from .memops import addr_getter, space_of
from .operands import getter, setter

TX_LIMIT = (1 << 20) - 1


class MBarrier(Waiter):
    """PTX ISA 9.7.13.15.1 "Contents of the mbarrier object": phase, expected arrival count, pending arrival count,
    tx-count (range [-(2^20 - 1), 2^20 - 1]). A phase completes when the pending count and the tx-count are both 0;
    the pending count then resets to the expected count. ``phase`` counts completed phases (its parity is the
    current phase's)."""
    __slots__ = ("sim", "cta", "offset", "expected", "pending", "tx", "phase", "line", "cid", "released", "carried",
                 "init_by")

    def __init__(self, sim, cta, offset, count, line):
        super().__init__()
        self.sim, self.cta, self.offset = sim, cta, offset
        self.expected = self.pending = count
        self.tx = 0
        self.phase = 0
        self.line = line
        # memory-model bookkeeping (PTX ISA 8 "Memory Consistency Model": an arrive releases, a wait that observes
        # the phase complete acquires): what the arrivers of this phase had observed, and what every completed
        # phase carried
        self.cid = sim.new_completion(lambda: f"mbarrier at shared offset {offset:#x} of CTA {cta.ctaid}")
        self.released: dict = {}
        self.carried: dict = {}

    def state(self) -> str:
        return (f"mbarrier at shared offset {self.offset:#x} of CTA {self.cta.ctaid} (init at PTX line {self.line}): "
                f"phase {self.phase} (parity {self.phase & 1}), pending arrivals {self.pending} of {self.expected}, "
                f"tx-count {self.tx}")

    def arrive(self, count: int, ctx, observed: dict = None) -> None:
        if observed:
            merge(self.released, observed)
        self.pending -= count
        if self.pending < 0:
            raise Hazard(f"mbarrier arrival beyond its count: {self.state()} after {count} arrival(s){ctx()}")
        self._maybe_complete()

    def expect_tx(self, n: int, ctx) -> None:
        self.tx += n
        if abs(self.tx) > TX_LIMIT:
            raise Hazard(f"mbarrier tx-count out of range: {self.state()}{ctx()}")
        self._maybe_complete()

    def complete_tx(self, n: int, ctx) -> None:
        self.tx -= n
        if self.tx < -TX_LIMIT:
            raise Hazard(f"mbarrier tx-count underflow: {self.state()}{ctx()}")
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            merge(self.carried, self.released)
            self.released = {}
            self.phase += 1
            self.pending = self.expected
            self.version += 1
            self.sim.epoch += 1


def mbar_of(sim, w, addrs, ctx, cluster=False):
    """The (one) mbarrier the addresses of the executing lanes name."""
    uniq = set(addrs.tolist())
    if len(uniq) != 1:
        raise Unsupported(f"lanes of one instruction on different mbarriers{ctx()}")
    a = uniq.pop()
    cta = w.cta
    rank = a >> CLUSTER_SHIFT
    if rank != cta.rank:
        if rank >= len(w.cta.cluster):
            raise MemoryFault(f"mbarrier address {a:#x} in the window of CTA rank {rank}, outside the cluster{ctx()}")
        cta = w.cta.cluster[rank]
    a &= (1 << CLUSTER_SHIFT) - 1
    if a % 8:
        raise MemoryFault(f"mbarrier at a shared offset {a:#x} not 8-byte aligned{ctx()}")
    bar = cta.smem.mbarriers.get(a)
    if bar is None:
        raise Hazard(f"mbarrier operation on shared offset {a:#x}, where no mbarrier was initialized (or it was "
                     f"invalidated){ctx()}")
    by, nth = bar.init_by
    if by != w.gid and w.observed.get(("mbinit", by), 0) < nth:
        # The init is a write of the object (PTX ISA 9.7.13.15.9); another thread's operation must be ordered after
        # it: a release by the initializing thread (fence.mbarrier_init.release.cluster, PTX ISA 9.7.13.4, or a
        # barrier arrival / release fence) that this thread acquired (bar.sync, barrier.cluster.wait, ...).
        raise Hazard(f"mbarrier operation on {bar.state()}, whose init (by warp {by}) nothing made visible to this "
                     f"thread (fence.mbarrier_init.release.cluster or a release, then a barrier both take part in: "
                     f"PTX ISA 9.7.13.4, 9.7.13.15.9){ctx()}")
    return bar


def _shared_addrs(sim, w, ag, m, space):
    a = ag(w)[m]
    if space == "generic":
        a = a & WINDOW_MASK
    return a


def compile_mbarrier(sim, ins):
    words = ins.words
    kind = words[1]
    space = space_of(words)
    ops = ins.operands
    if kind == "init":
        ag = addr_getter(sim, ops[0])
        cg = getter(sim, ops[1], 32)

        def body(w, m, pc):
            ctx = sim.ctx(w, ins, m)
            a = _shared_addrs(sim, w, ag, m, space)
            counts = cg(w)[m]
            w.mbinits += 1
            for addr, cnt in set(zip(a.tolist(), counts.tolist())):
                cta, idx = sim.shared_index(w.cta, np.array([addr]), 8, ctx)
                addr = int(idx[0, 0])  # the offset in the CTA's shared memory (the rank bits off)
                if cnt < 1 or cnt > TX_LIMIT:
                    raise Hazard(f"mbarrier.init with count {cnt} (range 1..2^20-1){ctx()}")
                if cta.smem.mbar_bytes[idx].any():
                    raise Hazard(f"mbarrier.init of a live mbarrier at shared offset {addr:#x} (initialized at PTX "
                                 f"line {cta.smem.mbarriers[addr].line if addr in cta.smem.mbarriers else '?'}; "
                                 f"PTX ISA 9.7.13.15: mbarrier.inval first){ctx()}")
                cta.smem.write(idx, np.zeros((1, 8), np.uint8), "mbarrier.init", ctx, writer=w.gid, line=ins.line)
                cta.smem.dirty[idx] = 0
                cta.smem.gen_writer[idx] = 0  # only mbarrier operations touch it from here
                cta.smem.mbar_bytes[idx] = True
                cta.smem.mbarriers[addr] = bar = MBarrier(sim, cta, addr, cnt, ins.line)
                bar.init_by = (w.gid, w.mbinits)
            sim.epoch += 1
        return body
    if kind == "inval":
        ag = addr_getter(sim, ops[0])

        def body(w, m, pc):
            a = _shared_addrs(sim, w, ag, m, space)
            for addr in set(a.tolist()):
                cta, idx = sim.shared_index(w.cta, np.array([addr]), 8, sim.ctx(w, ins, m))
                cta.smem.mbarriers.pop(int(idx[0, 0]), None)
                cta.smem.mbar_bytes[idx] = False
        return body
    if kind in ("expect_tx", "complete_tx"):
        ag = addr_getter(sim, ops[0])
        tg = getter(sim, ops[1], 32)

        def body(w, m, pc):
            ctx = sim.ctx(w, ins, m)
            bar = mbar_of(sim, w, _shared_addrs(sim, w, ag, m, space), ctx)
            n = int(tg(w)[m].astype(np.int64).sum())
            (bar.expect_tx if kind == "expect_tx" else bar.complete_tx)(n, ctx)
        return body
    if kind in ("arrive", "arrive_drop"):
        expect = "expect_tx" in words
        drop = kind == "arrive_drop"
        state_put = setter(sim, ops[0], 64) if ops[0] is not None else None
        ag = addr_getter(sim, ops[1])
        rest = ops[2:]
        tx_get = getter(sim, rest[0], 32) if expect else None
        cnt_get = getter(sim, rest[1 if expect else 0], 32) if len(rest) > (1 if expect else 0) else None
        relaxed = "relaxed" in words

        def body(w, m, pc):
            # PTX ISA 9.7.13.15.13 mbarrier.arrive: each executing thread arrives on the mbarrier its own address
            # names; lanes of one instruction may name different mbarriers (e.g. one per CTA of the cluster through
            # mapa), so the lanes are grouped by address and each group arrives on its barrier.
            ctx = sim.ctx(w, ins, m)
            a_all = np.zeros(32, np.int64)
            a_all[m] = _shared_addrs(sim, w, ag, m, space)
            tokens = np.zeros(32, np.uint64)
            for addr in sorted(set(a_all[m].tolist())):
                g = m & (a_all == addr)
                bar = mbar_of(sim, w, np.array([addr], np.int64), ctx)
                if expect:
                    bar.expect_tx(int(tx_get(w)[g].astype(np.int64).sum()), ctx)
                count = int(cnt_get(w)[g].astype(np.int64).sum()) if cnt_get is not None else int(g.sum())
                tokens[g] = bar.phase
                if drop:
                    bar.expected -= count
                if not relaxed:  # .release is the default (PTX ISA 9.7.13.15.13)
                    w.release()
                bar.arrive(count, ctx, None if relaxed else w.observed)
            if state_put is not None:
                state_put(w, tokens, m)
        return body
    if kind in ("test_wait", "try_wait"):
        parity = "parity" in words
        put = setter(sim, ops[0], 1)
        ag = addr_getter(sim, ops[1])
        sg = getter(sim, ops[2], 32 if parity else 64)
        relaxed = "relaxed" in words

        def body(w, m, pc):
            ctx = sim.ctx(w, ins, m)
            bar = mbar_of(sim, w, _shared_addrs(sim, w, ag, m, space), ctx)
            s = sg(w)
            if parity:
                done = (np.int64(bar.phase & 1) != (s.astype(np.int64) & 1))
            else:
                done = bar.phase > s.astype(np.int64)
            put(w, done, m)
            if not parity and (bar.phase > s.astype(np.int64)[m] + 1).any():
                raise Hazard(f"mbarrier wait on a state token older than the preceding phase (valid only in the "
                             f"current or the immediately preceding phase, PTX ISA 9.7.13.15.16): {bar.state()}"
                             f"{ctx()}")
            if (done & m).any() and not relaxed:  # the lanes that saw the phase complete acquire what it carried
                merge(w.observed, bar.carried)
                if w.observed.get(bar.cid, 0) < bar.phase:
                    w.observed[bar.cid] = bar.phase
            waiting = m & ~done
            if waiting.any():
                # the lanes retry only after the barrier changes (or when nothing else can run)
                w.waits.append((waiting, bar, bar.version, lambda b=bar, p=s[waiting][0]:
                                f"wait on {'parity ' + str(int(p)) if parity else 'state ' + str(int(p))} of "
                                f"{b.state()} (PTX line {ins.line})", True))
        return body
    if kind == "pending_count":
        put = setter(sim, ops[0], 32)
        return lambda w, m, pc: put(w, np.zeros(32, np.uint32), m)
    raise Unsupported(f"mbarrier.{kind}")


# ---------------------------------------------------------------------------------------------------------------------
# named barriers


class _BarrierGen(Waiter):
    pass


def _bar_check(sim, cta, bid, ctx):
    b = cta.barriers[bid]
    expected = b.expected if b.expected is not None else 32 * sum(1 for x in cta.warps if x.active.any())
    if b.arrived and b.arrived >= expected:
        if b.arrived > expected:
            raise Hazard(f"named barrier {bid}: {b.arrived} threads arrived for a count of {expected}{ctx()}")
        # every participant's observations reach the waiters (bar.sync orders memory among them)
        seen: dict = {}
        for x, _ in b.waiting:
            merge(seen, x.observed)
        for x, waits in b.waiting:
            if waits:
                merge(x.observed, seen)
        b.waiting = []
        b.arrived = 0
        b.expected = None
        b.version += 1
        sim.epoch += 1


def compile_bar(sim, ins):
    words = ins.words
    op = words[1] if words[0] == "bar" else words[1]
    if words[0] == "bar" and op == "warp":
        return compile_bar_warp(sim, ins)
    if words[0] == "barrier" and op == "cluster":
        return compile_barrier_cluster(sim, ins)
    if op in ("cta",):
        op = words[2]
    aligned = words[0] == "bar" or "aligned" in words
    ops = ins.operands
    if op == "red":
        raise Unsupported("bar.red")
    bg = getter(sim, ops[0], 32)
    cg = getter(sim, ops[1], 32) if len(ops) > 1 else None
    wait = op == "sync"
    if op not in ("sync", "arrive"):
        raise Unsupported(f"{ins.opcode}")

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        bids = set(bg(w)[m].tolist())
        if len(bids) != 1:
            raise Hazard(f"lanes of one warp at different named barriers {sorted(bids)}{ctx()}")
        bid = bids.pop()
        if bid > 15:
            raise MemoryFault(f"named barrier {bid} (0..15){ctx()}")
        if aligned:
            converge(w, m, pc, ins.opcode, ctx)
        b = w.cta.barriers[bid]
        if cg is not None:
            cnts = set(cg(w)[m].tolist())
            cnt = cnts.pop()
            if cnt % 32:
                raise Hazard(f"named barrier {bid} count {cnt}, not a multiple of the warp size{ctx()}")
            if b.expected is not None and b.expected != cnt:
                raise Hazard(f"named barrier {bid}: count {cnt} here, {b.expected} from an earlier arrival in the "
                             f"same phase{ctx()}")
            b.expected = cnt
        elif b.expected is not None and b.arrived:
            raise Hazard(f"named barrier {bid} used without a count here, with {b.expected} by others in the "
                         f"same phase{ctx()}")
        # PTX ISA 9.7.13.1: a warp's arrival is marked once all its non-exited threads arrived (barrier
        # counts are in threads, a warp counting 32)
        if aligned:
            b.arrived += 32
        else:
            got = b.partial.get(w.gid, np.zeros(32, bool)) | m
            if (w.active & ~got).any():
                b.partial[w.gid] = got
            else:
                b.partial.pop(w.gid, None)
                b.arrived += 32
        w.release()  # a barrier arrival releases the warp's writes to the participants (PTX ISA 9.7.13.1)
        b.waiting.append((w, wait))
        version = b.version
        if wait:
            w.waits.append((m.copy(), b, version, lambda bid=bid, b=b:
                            f"bar.sync {bid} (PTX line {ins.line}): {b.arrived} threads arrived of "
                            f"{b.expected if b.expected is not None else 'all'}", False))
        _bar_check(sim, w.cta, bid, ctx)
    return body


def warp_exited(sim, w):
    """Barriers counting the CTA's live threads may complete when a warp exits."""
    ctx = lambda: f" (after lanes of warp {w.wid} of CTA {w.cta.ctaid} exited)"
    for bid, b in enumerate(w.cta.barriers):
        got = b.partial.get(w.gid)
        if got is not None and not (w.active & ~got).any():  # its remaining lanes had all arrived
            del b.partial[w.gid]
            b.arrived += 32
        if b.arrived:
            _bar_check(sim, w.cta, bid, ctx)
    _cluster_check(sim, w.cta)


def cta_exit(sim, cta):
    for m in (cta.smem.inflight,):
        if m.any():
            raise Hazard(f"CTA {cta.ctaid} exited with asynchronous copies into its shared memory in flight")
    _cluster_check(sim, cta)


def compile_bar_warp(sim, ins):
    mg = getter(sim, ins.operands[0], 32)

    def body(w, m, pc):
        _collective(w, m, mg)
    return body


def _members(w, m, mg):
    mem = mg(w)[m]
    mask = int(mem[0])
    bits = ((mask >> np.arange(32)) & 1).astype(bool) & w.active
    return bits


def _collective(w, m, mg):
    """Hold the lanes until every member of the membermask executes this instruction with them. An executing lane
    outside the membermask is undefined (PTX ISA 9.7.9.6 and the other .sync collectives)."""
    mem = _members(w, m, mg)
    if (m & ~mem & w.active).any():
        raise Hazard(f"warp collective executed by lanes {_lanes(m & ~mem)} outside its membermask "
                     f"(CTA {w.cta.ctaid} warp {w.wid})")
    if (mem & ~m).any():
        raise Hold()
    return mem


def compile_shfl(sim, ins):
    mode = ins.words[2]
    dst = ins.operands[0]
    a, b, c, mask = ins.operands[1:5]
    ga, gb, gc, gm = (getter(sim, x, 32) for x in (a, b, c, mask))
    put_p = None
    if isinstance(dst, P.Pair):
        put = setter(sim, dst.a, 32)
        put_p = setter(sim, dst.b, 1)
    else:
        put = setter(sim, dst, 32)
    lane = np.arange(32)

    def body(w, m, pc):
        _collective(w, m, gm)
        av, bv, cv = ga(w), gb(w).astype(np.int64) & 31, gc(w).astype(np.int64)
        cval = cv & 31
        seg = (cv >> 8) & 31
        maxl = (lane & seg) | (cval & ~seg)
        minl = lane & seg
        if mode == "up":
            j = lane - bv
            ok = j >= maxl
        elif mode == "down":
            j = lane + bv
            ok = j <= maxl
        elif mode == "bfly":
            j = lane ^ bv
            ok = j <= maxl
        elif mode == "idx":
            j = minl | (bv & ~seg)
            ok = j <= maxl
        else:
            raise Unsupported(f"shfl mode {mode}")
        j = np.where(ok, j, lane)
        if (~m[j[m]]).any():
            bad = int(np.flatnonzero(m & ~m[j])[0])
            raise Hazard(f"shfl.sync: lane {bad} reads lane {int(j[bad])}, which did not execute it (undefined)"
                         f"{sim.ctx(w, ins, m)()}")
        put(w, av[j], m)
        if put_p is not None:
            put_p(w, ok, m)
    return body


def compile_vote(sim, ins):
    mode = ins.words[2]
    ga = getter(sim, ins.operands[1], 1)
    gm = getter(sim, ins.operands[2], 32)
    put = setter(sim, ins.operands[0], 32 if mode == "ballot" else 1)

    def body(w, m, pc):
        mem = _collective(w, m, gm)
        v = ga(w) & mem
        if mode == "ballot":
            r = np.uint32(int((v.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum()))
            put(w, np.full(32, r, np.uint32), m)
        elif mode == "all":
            put(w, np.full(32, bool(v[mem].all())), m)
        elif mode == "any":
            put(w, np.full(32, bool(v[mem].any())), m)
        elif mode == "uni":
            put(w, np.full(32, bool(v[mem].all() or not v[mem].any())), m)
        else:
            raise Unsupported(f"vote.{mode}")
    return body


def compile_elect(sim, ins):
    """PTX ISA 9.7.13.11 elect.sync: one leader among the member lanes. Which one is unspecified: the seed picks it,
    so a kernel that assumes lane 0 fails under some seeds."""
    dst = ins.operands[0]
    gm = getter(sim, ins.operands[1], 32)
    put_r = setter(sim, dst.a, 32) if isinstance(dst, P.Pair) else None
    put_p = setter(sim, dst.b if isinstance(dst, P.Pair) else dst, 1)

    def body(w, m, pc):
        mem = _collective(w, m, gm)
        cand = np.flatnonzero(mem)
        # "the same leader thread is elected for the same membermask every time" (PTX ISA 9.7.13.14): one choice
        # per warp and member set, the seed's
        key = tuple(cand.tolist())
        leader = w.elected.get(key)
        if leader is None:
            leader = w.elected[key] = int(cand[sim.rng.integers(len(cand))]) if sim.elect_random else int(cand[0])
        if put_r is not None:
            put_r(w, np.full(32, leader, np.uint32), m)
        put_p(w, np.arange(32) == leader, m)
    return body


def compile_activemask(sim, ins):
    put = setter(sim, ins.operands[0], 32)

    def body(w, m, pc):
        put(w, np.full(32, int((m.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum()), np.uint32), m)
    return body


def compile_match(sim, ins):
    mode = ins.words[1]
    bits = 64 if "b64" in ins.words else 32
    dst = ins.operands[0]
    ga = getter(sim, ins.operands[1], bits)
    gm = getter(sim, ins.operands[2], 32)
    put = setter(sim, dst.a if isinstance(dst, P.Pair) else dst, 32)
    put_p = setter(sim, dst.b, 1) if isinstance(dst, P.Pair) else None

    def body(w, m, pc):
        mem = _collective(w, m, gm)
        v = ga(w)
        weights = np.uint64(1) << np.arange(32, dtype=np.uint64)
        if mode == "any":
            r = np.array([int((((v == v[i]) & mem).astype(np.uint64) * weights).sum()) for i in range(32)], np.uint32)
            put(w, r, m)
        else:
            same = bool((v[mem] == v[mem][0]).all())
            r = int((mem.astype(np.uint64) * weights).sum()) if same else 0
            put(w, np.full(32, r, np.uint32), m)
            if put_p is not None:
                put_p(w, np.full(32, same), m)
    return body


def compile_redux(sim, ins):
    op = ins.words[2]
    ty = ins.words[3]
    ga = getter(sim, ins.operands[1], 32)
    gm = getter(sim, ins.operands[2], 32)
    put = setter(sim, ins.operands[0], 32)

    def body(w, m, pc):
        mem = _collective(w, m, gm)
        v = ga(w)[mem]
        if ty == "s32":
            v = v.view(np.int32)
        r = {"add": lambda x: x.astype(np.int64).sum(), "min": np.min, "max": np.max,
             "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce, "xor": np.bitwise_xor.reduce}[op](v)
        put(w, np.full(32, int(r) & 0xFFFFFFFF, np.uint32), m)
    return body


# ---------------------------------------------------------------------------------------------------------------------


def compile_fence(sim, ins):
    """``fence.proxy.async``: the executing warp's generic writes to shared memory become visible to the async
    proxy (PTX ISA 9.7.13.4 / 8.6 "Proxies"); ``fence.mbarrier_init`` publishes the warp's mbarrier inits (see
    ``mbar_of``); other fences only order memory, which is sequential here."""
    words = ins.words
    if "mbarrier_init" in words:
        # PTX ISA 9.7.13.4: fence.mbarrier_init.release.cluster, a release fence for the thread's prior mbarrier.init
        # operations only (a following barrier.cluster.arrive.relaxed carries them to the cluster)
        return lambda w, m, pc: w.publish_inits()
    if "proxy" in words and "async" in "".join(words[2:]) and "tensormap" not in "".join(words):
        def body(w, m, pc):
            # a fence covers the generic writes of this warp and of the warps it synchronized with since
            # (PTX ISA 8.9.5: an alias proxy fence on the causality path from the write to the async read)
            d = w.cta.smem.dirty
            covered = [k[1] + 1 for k in w.observed if isinstance(k, tuple) and k[0] == "warp"]
            d[np.isin(d, covered)] = 0
        return body
    if words[0] == "membar" or any(x in words for x in ("sc", "acq_rel", "release")):
        return lambda w, m, pc: w.publish_inits()  # a release fence orders the inits before it as well
    return lambda w, m, pc: None


def compile_setmaxnreg(sim, ins):
    """PTX ISA 9.7.17.1 setmaxnreg: a warpgroup's register budget. An increase waits until the CTA's register file
    (64K 32-bit registers) can hold every warp's budget; decreases free registers."""
    inc = ins.words[1] == "inc"
    n = int(ins.operands[0].text, 0)
    if n % 8 or not 24 <= n <= 256:
        raise Hazard(f"setmaxnreg {n}: must be a multiple of 8 in [24, 256] (PTX line {ins.line})")

    def body(w, m, pc):
        cta = w.cta
        if not hasattr(cta, "reg_pool"):
            cta.reg_pool = Waiter()
            base = min(255, 65536 // max(128, (cta.nthreads + 127) // 128 * 128)) // 8 * 8
            # The per-thread count at launch is the kernel's register count, which ptxas picks (it is not in the
            # PTX). ptxas (CUDA 13.0, sm_90a) gives a kernel with setmaxnreg its largest .inc target when that fits
            # the launch bounds: 232 for a 256-thread kernel that increases to 232, 168 = 65536/384 for 384 threads.
            incs = [int(i.operands[0].text, 0) for i in sim.prog.instrs if i.words[:2] == ("setmaxnreg", "inc")]
            if incs:
                base = min(base, max(incs))
            for x in cta.warps:
                x.nreg_budget = base
        if w.nreg_budget is None:
            w.nreg_budget = 0
        old = w.nreg_budget
        if inc and n < old or (not inc and n > old):
            raise Hazard(f"setmaxnreg.{'inc' if inc else 'dec'} {n} from a budget of {old} (PTX line {ins.line}, "
                         f"CTA {cta.ctaid} warp {w.wid})")
        total = sum(x.nreg_budget for x in cta.warps) * 32 - old * 32 + n * 32
        if inc and total > sim.reg_budget_total:
            # wait for other warpgroups to release registers
            w.pc[m] = pc
            w.waits.append((m.copy(), cta.reg_pool, cta.reg_pool.version,
                            lambda: f"setmaxnreg.inc {n} (PTX line {ins.line}): the CTA's budgets would total "
                                    f"{total} registers of {sim.reg_budget_total}", False))
            return
        w.nreg_budget = n
        cta.reg_pool.version += 1
        sim.epoch += 1
    return body


def compile_griddep(sim, ins):
    """PTX ISA 9.7.13.14 griddepcontrol: one grid at a time here, so its prerequisites are complete."""
    return lambda w, m, pc: None


# cluster barrier: PTX ISA 9.7.13.3


class ClusterBarrier(Waiter):
    def __init__(self):
        super().__init__()
        self.arrived = 0
        self.phase = 0


def _cluster_bar(cta):
    lead = cta.cluster[0]
    if not hasattr(lead, "cluster_bar"):
        lead.cluster_bar = ClusterBarrier()
    return lead.cluster_bar


def _cluster_check(sim, cta):
    """PTX ISA 9.7.13.3: the barrier completes when all non-exited threads of the cluster have arrived (in this
    phase); arrive releases and wait acquires by default, so the arrivers' observations reach every waiter."""
    if cta.cluster is None:
        return
    cb = _cluster_bar(cta)
    warps = [x for c in cta.cluster for x in c.warps if x.active.any()]
    if not warps:
        return
    arrived = [getattr(x, "cluster_arrived", None) for x in warps]
    if all(a is not None and (a[x.active] == cb.phase).all() for a, x in zip(arrived, warps)):
        seen: dict = {}
        for x in warps:
            merge(seen, x.observed)
        for x in warps:
            merge(x.observed, seen)
        cb.arrived = 0
        cb.phase += 1
        cb.version += 1
        sim.epoch += 1


def compile_barrier_cluster(sim, ins):
    kind = ins.words[2]

    def body(w, m, pc):
        cb = _cluster_bar(w.cta)
        if kind == "arrive":
            if not hasattr(w, "cluster_arrived"):
                w.cluster_arrived = np.full(32, -1, np.int64)
            if (w.cluster_arrived[m] == cb.phase).any():
                raise Hazard(f"barrier.cluster.arrive twice in one phase (PTX line {ins.line})")
            w.cluster_arrived[m] = cb.phase
            if "relaxed" not in ins.words:  # .release is the default (PTX ISA 9.7.13.3)
                w.release()
            cb.arrived += int(m.sum())
            _cluster_check(sim, w.cta)
        elif kind == "wait":
            arrived = getattr(w, "cluster_arrived", None)
            if arrived is None or (arrived[m] < 0).any():
                raise Hazard(f"barrier.cluster.wait without a prior arrive (PTX line {ins.line})")
            ph = int(arrived[m].max())
            if cb.phase <= ph:
                w.pc[m] = pc
                w.waits.append((m.copy(), cb, cb.version, lambda: f"barrier.cluster.wait (PTX line {ins.line}): "
                                f"{cb.arrived} threads arrived", False))
        else:
            raise Unsupported(f"barrier.cluster.{kind}")
    return body


def compile_st_async(sim, ins):
    """PTX ISA 9.7.9.12 st.async: an asynchronous store into the shared memory of a CTA of the cluster (a
    shared::cluster address) whose completion performs complete-tx of its bytes on the mbarrier ``[remote_bar]`` of
    that same CTA. The bytes are in flight until then (a read of them before the barrier's phase is observed is a
    hazard)."""
    from ..machine import AsyncOp
    from .memops import _vec_and_type
    from .operands import TYPE_BITS
    words = ins.words
    if "mbarrier::complete_tx::bytes" not in words:
        raise Unsupported(f"{ins.opcode}")
    vec, ty = _vec_and_type(words)
    ebits = TYPE_BITS[ty]
    ag = addr_getter(sim, ins.operands[0])
    src = ins.operands[1]
    gets = [getter(sim, s, ebits) for s in (src.items if isinstance(src, P.Vec) else (src,))]
    bg = addr_getter(sim, ins.operands[2])
    nb = ebits // 8 * len(gets)
    edt = DTYPE[ebits]

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a, b = ag(w), bg(w)
        vals = np.stack([g(w).astype(edt) for g in gets], axis=1)
        for lane in np.flatnonzero(m).tolist():
            if (a[lane] >> CLUSTER_SHIFT) != (b[lane] >> CLUSTER_SHIFT):
                raise Hazard(f"st.async into one CTA completing the mbarrier of another (lane {lane}){ctx()}")
            cta, idx = sim.shared_index(w.cta, np.array([a[lane]]), nb, ctx, cluster=True)
            bar = mbar_of(sim, w, np.array([int(b[lane])]), ctx)
            data = np.ascontiguousarray(vals[lane]).view(np.uint8).reshape(1, nb)
            cta.smem.check(idx, "st.async destination", ctx)
            cta.smem.inflight[idx] += 1

            def land(cta=cta, idx=idx, data=data, bar=bar, ctx=ctx):
                cta.smem.inflight[idx] -= 1
                cta.smem.write(idx, data, "st.async", ctx)
                cta.smem.landed(idx, bar.cid, bar.phase + 1)
                bar.complete_tx(nb, ctx)
            sim.pending.append(AsyncOp(w.cta, "st.async", ins.line, land))
    return body


COMPILERS = {"mbarrier": compile_mbarrier, "bar": compile_bar, "barrier": compile_bar, "shfl": compile_shfl,
             "vote": compile_vote, "elect": compile_elect, "activemask": compile_activemask, "match": compile_match,
             "redux": compile_redux, "fence": compile_fence, "membar": compile_fence, "setmaxnreg": compile_setmaxnreg,
             "griddepcontrol": compile_griddep, "st.async": compile_st_async}
