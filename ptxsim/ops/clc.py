"""Cluster launch control (sm_100a): PTX ISA 9.7.13.17 clusterlaunchcontrol.try_cancel and 9.7.13.18
clusterlaunchcontrol.query_cancel — the persistent-scheduler instructions (CUTLASS/quack's CLC tile scheduler).

The simulator runs a launch's clusters in waves (``machine.Simulator.run``): the clusters of the grid not started yet
wait in ``sim.unlaunched``, in launch order. ``try_cancel`` asks to cancel one of them: on success that cluster is
removed from the queue (it never launches) and the response names its first CTA (``%cluster_ctaid`` = 0 in every
axis); otherwise the response says "not canceled". The ISA never promises success, so a request may fail at any time:
the seed picks (``Simulator.clc_fail_rate``; seed 0 always succeeds while a cluster is left, others fail at random),
which exercises a kernel's fallback. Which not-yet-launched cluster is canceled is not specified either: seed 0 takes
the next in launch order, other seeds a random one.

The response is 16 bytes the ISA calls opaque: only ``query_cancel`` may decode it, so only the round trip
(try_cancel writes, query_cancel reads) has meaning. The encoding used here, as four little-endian 32-bit words:
word 0..2 = x, y, z of the first CTA of the canceled cluster, word 3 = 1 when canceled; a failed request writes
word 3 = 0 and random words 0..2 (get_first_ctaid of a failed response is undefined, 9.7.13.18).
"""

from __future__ import annotations

import numpy as np

from ..errors import Hazard, MemoryFault, Unsupported
from ..machine import AsyncOp
from ..memory import CLUSTER_SHIFT, WINDOW_MASK
from .memops import addr_getter, space_of
from .operands import getter, setter

RESPONSE_BYTES = 16


def encode_response(ctaid) -> np.ndarray:
    """The 16 response bytes for a cluster whose first CTA is ``ctaid`` (x, y, z), or None for a failed request
    (the ctaid words then are filled by the caller). See the module docstring: the ISA calls it opaque."""
    words = np.zeros(4, np.uint32)
    if ctaid is not None:
        words[:3] = ctaid
        words[3] = 1
    return words.view(np.uint8)


def _clc_fail_rate(sim) -> float:
    rate = getattr(sim, "clc_fail_rate", None)
    if rate is None:
        rate = 0.0 if sim.seed == 0 else (0.5 if sim.seed == 1 else float(np.random.default_rng(sim.seed + 7).
                                                                              uniform(0.0, 0.6)))
        sim.clc_fail_rate = rate
    return rate


def compile_try_cancel(sim, ins):
    """PTX ISA 9.7.13.17 clusterlaunchcontrol.try_cancel.async{.shared::cta}.mbarrier::complete_tx::bytes
    {.multicast::cluster::all}.b128 [addr], [mbar]: asynchronously cancels a cluster of the grid that has not started
    (or fails), writes the 16-byte response at ``addr`` (weak async-proxy writes; with .multicast::cluster::all at
    the same offset in every CTA of the cluster) and performs complete-tx of 16 bytes on the mbarrier at ``mbar``
    (in each CTA that receives the response, at that CTA's ``mbar`` offset). Without ``.shared::cta`` both addresses
    are generic. Undefined (a Hazard here): a try_cancel by a CTA that has already observed a failed response, a
    multicast while a CTA of the cluster has exited; ``addr`` not 16-byte aligned or outside the executing CTA's
    shared::cta window is a MemoryFault."""
    words = ins.words
    if "mbarrier::complete_tx::bytes" not in words or "b128" not in words:
        raise Unsupported(f"{ins.opcode}")
    multicast = "multicast::cluster::all" in words
    space = space_of(words)
    if space not in ("shared::cta", "generic"):
        raise Unsupported(f"{ins.opcode}: state space .{space}")
    ag = addr_getter(sim, ins.operands[0])
    bg = addr_getter(sim, ins.operands[1])

    def body(w, m, pc):
        addrs, bars = ag(w), bg(w)
        for lane in np.flatnonzero(m).tolist():  # every executing thread issues one request
            one = np.zeros(32, bool)
            one[lane] = True
            _issue(sim, w, ins, int(addrs[lane]), int(bars[lane]), multicast, space, sim.ctx(w, ins, one))
    return body


def _local_offset(sim, w, a, space, what, ctx):
    if space == "generic":
        if a >> 56 != 1:
            raise MemoryFault(f"clusterlaunchcontrol.try_cancel {what} {a:#x} is not a generic shared address{ctx()}")
        a &= WINDOW_MASK
    if a >> CLUSTER_SHIFT != w.cta.rank:
        raise MemoryFault(f"clusterlaunchcontrol.try_cancel {what} {a:#x} outside the executing CTA's shared::cta "
                          f"window (PTX ISA 9.7.13.17: undefined){ctx()}")
    return a & ((1 << CLUSTER_SHIFT) - 1)


def _issue(sim, w, ins, addr, mbar, multicast, space, ctx):
    cta = w.cta
    off = _local_offset(sim, w, addr, space, "response address", ctx)
    boff = _local_offset(sim, w, mbar, space, "mbarrier", ctx)
    if off % RESPONSE_BYTES:
        raise MemoryFault(f"clusterlaunchcontrol.try_cancel response address {addr:#x} not 16-byte aligned{ctx()}")
    for cid, need in getattr(cta, "clc_failed", []):
        if w.observed.get(cid, 0) >= need:
            raise Hazard(f"clusterlaunchcontrol.try_cancel by a CTA that already observed a failed try_cancel "
                         f"response (PTX ISA 9.7.13.17: undefined){ctx()}")
    targets = list(cta.cluster) if multicast else [cta]
    if multicast and any(c.exited for c in targets):
        raise Hazard(f"clusterlaunchcontrol.try_cancel.multicast::cluster::all while a CTA of the cluster has "
                     f"exited (PTX ISA 9.7.13.17: undefined){ctx()}")
    idx = (off + np.arange(RESPONSE_BYTES))[None, :]
    bars = []
    for t in targets:
        t.smem.check(idx, "clusterlaunchcontrol.try_cancel response", ctx)
        bar = t.smem.mbarriers.get(boff)
        if bar is None:
            raise Hazard(f"clusterlaunchcontrol.try_cancel completing an mbarrier at shared offset {boff:#x} of CTA "
                         f"{t.ctaid}, which is not initialized{ctx()}")
        bars.append(bar)
        t.smem.inflight[idx] += 1

    def land():
        if multicast and any(c.exited for c in targets):
            raise Hazard(f"clusterlaunchcontrol.try_cancel.multicast::cluster::all response landing after a CTA of "
                         f"the cluster exited (PTX ISA 9.7.13.17: undefined){ctx()}")
        queue = sim.unlaunched
        if queue and sim.rng.random() >= _clc_fail_rate(sim):
            k = 0 if sim.seed == 0 else int(sim.rng.integers(len(queue)))
            members = queue[k]
            del queue[k]
            data = encode_response(members[0][0])
            failed = False
        else:
            data = encode_response(None)
            data[:12] = sim.rng.integers(0, 256, 12, dtype=np.uint8)
            failed = True
        for t, bar in zip(targets, bars):
            t.smem.inflight[idx] -= 1
            t.smem.write(idx, data[None, :], "clusterlaunchcontrol.try_cancel response", ctx)
            t.smem.landed(idx, bar.cid, bar.phase + 1)
            if failed:
                if not hasattr(t, "clc_failed"):
                    t.clc_failed = []
                t.clc_failed.append((bar.cid, bar.phase + 1))
            bar.complete_tx(RESPONSE_BYTES, ctx)
    sim.pending.append(AsyncOp(cta, "clusterlaunchcontrol.try_cancel", ins.line, land))
    sim.epoch += 1


def compile_query_cancel(sim, ins):
    """PTX ISA 9.7.13.18 clusterlaunchcontrol.query_cancel: decodes a try_cancel response held in a .b128 register
    (the inverse of ``encode_response``): ``.is_canceled.pred.b128 p, r`` (canceled or not);
    ``.get_first_ctaid::{x,y,z}.b32.b128 d, r`` one coordinate of the canceled cluster's first CTA;
    ``.get_first_ctaid.v4.b32.b128 {x, y, z, _}, r`` all three (the 4th element unspecified: written 0). On a failed
    response get_first_ctaid is undefined: it returns the response's (random) bits."""
    words = ins.words
    dst, src = ins.operands
    g = getter(sim, src, 128)
    if "is_canceled" in words:
        put = setter(sim, dst, 1)
        return lambda w, m, pc: put(w, (g(w)[:, 1] >> np.uint64(32)) & np.uint64(1) == 1, m)
    first = [wd for wd in words if wd.startswith("get_first_ctaid")]
    if not first:
        raise Unsupported(f"{ins.opcode}")
    axis = first[0].split("::")[1] if "::" in first[0] else None

    def word(v, k):
        return ((v[:, k // 2] >> np.uint64(32 * (k % 2))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    if axis is not None:
        k = "xyz".index(axis)
        put = setter(sim, dst, 32)
        return lambda w, m, pc: put(w, word(g(w), k), m)
    if "v4" not in words or not hasattr(dst, "items") or len(dst.items) != 4:
        raise Unsupported(f"{ins.opcode}")
    puts = [setter(sim, d, 32) for d in dst.items]

    def body(w, m, pc):
        v = g(w)
        for k, p in enumerate(puts):
            p(w, word(v, k) if k < 3 else np.zeros(32, np.uint32), m)
    return body


def compile_clc(sim, ins):
    kind = ins.words[1] if len(ins.words) > 1 else ""
    if kind == "try_cancel":
        return compile_try_cancel(sim, ins)
    if kind == "query_cancel":
        return compile_query_cancel(sim, ins)
    raise Unsupported(f"{ins.opcode}")


COMPILERS = {"clusterlaunchcontrol": compile_clc}
