"""Bulk asynchronous copies: PTX ISA 9.7.9.24 cp.async.bulk.tensor (tile mode, loads with multicast, stores),
9.7.9.25 cp.reduce.async.bulk.tensor, 9.7.9.23 cp.async.bulk (non-tensor), 9.7.9.26-27 cp.async.bulk.commit_group /
wait_group. Element maps come from ``layouts.tma_box_addrs``; the tensor map from ``tensormap.decode``.

A load marks its shared destination in flight at issue; it lands at a time the seed picks, then completes its bytes
on the mbarrier (``complete_tx``) of every destination CTA. A store reads its shared source through the async proxy
(generic writes must have been fenced before the issue) and may not have that source overwritten before its
``wait_group.read``.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import layouts, tensormap
from .. import parser as P
from ..errors import Hazard, MemoryFault, Unsupported
from ..machine import AsyncOp
from ..memory import CLUSTER_SHIFT
from .memops import addr_getter, read
from .operands import getter
from .sync import mbar_of

_NAN = {1: 0x7F, 2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FF8000000000000}


@functools.lru_cache(maxsize=4096)
def _decode(raw: bytes):
    return tensormap.decode(raw)


def tensor_map(sim, w, gaddr: int, ctx):
    """The tensor map at a generic address (a kernel parameter or global memory): PTX ISA 5.5.8 "Tensor-map"."""
    if gaddr % 64:
        raise MemoryFault(f"tensor map at {gaddr:#x} not 64-byte aligned{ctx()}")
    raw = read(sim, w, "generic", np.array([gaddr], np.int64), 128, ctx)[0]
    return _decode(bytes(raw))


def _coords(sim, vec):
    gets = [getter(sim, c, 32) for c in vec]
    return lambda w: [g(w).view(np.int32) for g in gets]


def compile_tensor(sim, ins):
    words = ins.words
    is_reduce = words[0] == "cp" and words[1] == "reduce"
    if any(wd.startswith("im2col") for wd in words) or "tile::scatter4" in words:
        raise Unsupported(f"{ins.opcode} (only tile and tile::gather4 modes)")
    gather4 = "tile::gather4" in words
    pair = "cta_group::2" in words
    ops = ins.operands
    spaces = [wd for wd in words if wd.startswith("shared") or wd == "global"]
    load = spaces[0].startswith("shared")  # destination first
    if load:
        dst_g = addr_getter(sim, ops[0])
        tmap_op = ops[1]
        bar_g = addr_getter(sim, ops[2])
        multicast = any(wd.startswith("multicast") for wd in words)
        mask_g = getter(sim, ops[3], 16) if multicast else None
    else:
        tmap_op = ops[0]
        src_g = addr_getter(sim, ops[1])
        rop = [wd for wd in words if wd in ("add", "min", "max", "inc", "dec", "and", "or", "xor")]
    tm_g = addr_getter(sim, P.Addr(tmap_op.base, tmap_op.offset))
    co_g = _coords(sim, tmap_op.vec)

    def body(w, m, pc):
        for lane in np.flatnonzero(m).tolist():
            one = np.zeros(32, bool)
            one[lane] = True
            ctx = sim.ctx(w, ins, one)
            tm = tensor_map(sim, w, int(tm_g(w)[lane]), ctx)
            coords = tuple(int(c[lane]) for c in co_g(w))
            if load:
                _issue_load(sim, w, ins, tm, coords, int(dst_g(w)[lane]), int(bar_g(w)[lane]),
                            int(mask_g(w)[lane]) if mask_g is not None else None, ctx, gather4, pair)
            else:
                _issue_store(sim, w, ins, tm, coords, int(src_g(w)[lane]), rop[0] if is_reduce else None, ctx)
    return body


def _fill(tm, n):
    eb = tm.elem_bytes
    if tm.oob_nan:
        return np.frombuffer(int(_NAN[eb]).to_bytes(eb, "little") * n, np.uint8).reshape(n, eb).copy()
    return np.zeros((n, eb), np.uint8)


def _issue_load(sim, w, ins, tm, coords, dst, bar_addr, ctamask, ctx, gather4=False, pair=False):
    """``gather4``: PTX ISA 5.5.3.4 .tile::gather4 (coords = {col, row0..row3}, ``layouts.tma_gather4_addrs``).
    ``pair`` (.cta_group::2, 9.7.9.27.1.2): the mbarrier may be in the destination CTA or its peer (rank ^ 1); for
    each destination CTA the complete-tx goes to the barrier at ``mbar``'s offset in the CTA of its pair whose rank
    parity is that of the CTA holding ``mbar`` (the rank bits of the address). Without it (.cta_group::1), the
    barrier at ``mbar``'s offset in each destination CTA."""
    dst_local = dst & ((1 << CLUSTER_SHIFT) - 1)
    if gather4:
        if len(coords) != 5:
            raise Unsupported(f"tile::gather4 with {len(coords)} coordinates (5 expected){ctx()}")
        try:
            gaddr, inb, saddr = layouts.tma_gather4_addrs(tm, coords[0], coords[1:], dst_local)
        except MemoryFault as e:
            raise MemoryFault(f"{e}{ctx()}") from None
    else:
        gaddr, inb, saddr = layouts.tma_box_addrs(tm, coords, dst_local)
    eb = tm.elem_bytes
    nbytes = gaddr.size * eb
    if ctamask is None:
        if (dst >> CLUSTER_SHIFT) >= len(w.cta.cluster):
            raise MemoryFault(f"TMA destination {dst:#x} outside the cluster's shared memory{ctx()}")
        targets = [w.cta.cluster[dst >> CLUSTER_SHIFT]]
    else:
        targets = [c for c in w.cta.cluster if (ctamask >> c.rank) & 1]
        if not targets:
            raise Hazard(f"multicast TMA with an empty CTA mask{ctx()}")
    idx = saddr[:, None] + np.arange(eb)
    bar_off = bar_addr & ((1 << CLUSTER_SHIFT) - 1)
    for cta in targets:
        cta.smem.check(idx, "TMA destination", ctx)
        if cta.smem.mma_reads[idx].any():
            raise Hazard(f"TMA load into shared memory an in-flight MMA still reads (stage reused before its MMA "
                         f"completed){ctx()}")
        cta.smem.inflight[idx] += 1
    bars = []
    bar_rank = bar_addr >> CLUSTER_SHIFT
    for cta in targets:
        owner = cta
        if pair:
            if ctamask is None and bar_rank not in (cta.rank, cta.rank ^ 1):
                raise Hazard(f"TMA load .cta_group::2 into CTA rank {cta.rank} completing an mbarrier of CTA rank "
                             f"{bar_rank}, neither it nor its peer (PTX ISA 9.7.9.27.1.2){ctx()}")
            r = (cta.rank & ~1) | (bar_rank & 1)
            if r >= len(cta.cluster):
                raise MemoryFault(f"TMA load .cta_group::2: the peer CTA rank {r} of CTA rank {cta.rank} is outside "
                                  f"the cluster of {len(cta.cluster)}{ctx()}")
            owner = cta.cluster[r]
        bar = owner.smem.mbarriers.get(bar_off)
        if bar is None:
            raise Hazard(f"TMA load completing an mbarrier at shared offset {bar_off:#x} of CTA {owner.ctaid}, which "
                         f"is not initialized{ctx()}")
        bars.append(bar)

    def land():
        data = _fill(tm, gaddr.size)
        if inb.any():
            data[inb] = sim.gmem.read(gaddr[inb], eb, ctx)
        for cta, bar in zip(targets, bars):
            cta.smem.inflight[idx] -= 1
            cta.smem.write(idx, data, "TMA load", ctx)
            cta.smem.landed(idx, bar.cid, bar.phase + 1)  # readers must observe the phase this completes
            bar.complete_tx(nbytes, ctx)
    sim.pending.append(AsyncOp(w.cta, "TMA load", ins.line, land))


_REDUCE = {"add": np.add, "min": np.minimum, "max": np.maximum}


def _issue_store(sim, w, ins, tm, coords, src, rop, ctx):
    _, first = sim.shared_index(w.cta, np.array([src]), 1, ctx)  # the executing CTA's own shared memory
    src = int(first[0, 0])
    gaddr, inb, saddr = layouts.tma_box_addrs(tm, coords, src)
    eb = tm.elem_bytes
    idx = saddr[:, None] + np.arange(eb)
    smem = w.cta.smem
    data = smem.read(idx, "TMA store source", ctx, generic=False, observed=w.observed, reader=w.gid).copy()
    smem.mma_reads[idx] += 1  # the source is read until the bulk group's wait_group.read

    def land():
        if not inb.any():
            return
        if rop is None:
            sim.gmem.write(gaddr[inb], data[inb], ctx)
            return
        ftype = {"f32": np.float32, "f16": np.float16, "bf16": None, "f64": np.float64}.get(tm.dtype)
        old = sim.gmem.read(gaddr[inb], eb, ctx)
        if tm.dtype == "bf16":
            a = (np.ascontiguousarray(old).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            b = (np.ascontiguousarray(data[inb]).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            r = _REDUCE[rop](a, b).astype(np.float32).view(np.uint32)
            r = ((r + 0x7FFF + ((r >> 16) & 1)) >> 16).astype(np.uint16)
        elif ftype is not None:
            r = _REDUCE[rop](np.ascontiguousarray(old).view(ftype), np.ascontiguousarray(data[inb]).view(ftype))
        else:
            raise Unsupported(f"TMA reduce {rop} on {tm.dtype}")
        sim.gmem.write(gaddr[inb], np.ascontiguousarray(r).view(np.uint8).reshape(-1, eb), ctx)
    op = AsyncOp(w.cta, "TMA store", ins.line, land)
    op.release = lambda: smem.mma_reads.__setitem__(idx, smem.mma_reads[idx] - 1)
    sim.pending.append(op)
    w.bulk_open.append(op)


def compile_bulk(sim, ins):
    """cp.async.bulk (non-tensor): ``[dst], [src], size, [mbar]`` global -> shared::cluster, or
    ``[dst], [src], size`` shared::cta -> global with a bulk group."""
    words = ins.words
    ops = ins.operands
    spaces = [wd for wd in words if wd.startswith("shared") or wd == "global"]
    load = spaces[0].startswith("shared")
    dg, sg = addr_getter(sim, ops[0]), addr_getter(sim, ops[1])
    ng = getter(sim, ops[2], 32)
    bg = addr_getter(sim, ops[3]) if load else None

    def body(w, m, pc):
        for lane in np.flatnonzero(m).tolist():
            one = np.zeros(32, bool)
            one[lane] = True
            ctx = sim.ctx(w, ins, one)
            d, s, n = int(dg(w)[lane]), int(sg(w)[lane]), int(ng(w)[lane])
            if n % 16 or d % 16 or s % 16:
                raise MemoryFault(f"cp.async.bulk of {n} B from {s:#x} to {d:#x}: size and addresses must be "
                                  f"multiples of 16{ctx()}")
            if load:
                cta, idx = sim.shared_index(w.cta, np.array([d]), n, ctx, cluster=True)
                bar = mbar_of(sim, w, np.array([int(bg(w)[lane])]), ctx)
                cta.smem.inflight[idx] += 1

                def land(cta=cta, idx=idx, s=s, n=n, bar=bar, ctx=ctx):
                    data = sim.gmem.read(np.array([s]), n, ctx)
                    cta.smem.inflight[idx] -= 1
                    cta.smem.write(idx, data, "cp.async.bulk", ctx)
                    cta.smem.landed(idx, bar.cid, bar.phase + 1)
                    bar.complete_tx(n, ctx)
                sim.pending.append(AsyncOp(w.cta, "bulk load", ins.line, land))
            else:
                cta, idx = sim.shared_index(w.cta, np.array([s]), n, ctx)
                data = cta.smem.read(idx, "bulk store source", ctx, generic=False).copy()
                cta.smem.mma_reads[idx] += 1

                def land(d=d, data=data, ctx=ctx):
                    sim.gmem.write(np.array([d]), data, ctx)
                op = AsyncOp(w.cta, "bulk store", ins.line, land)
                op.release = lambda cta=cta, idx=idx: cta.smem.mma_reads.__setitem__(idx, cta.smem.mma_reads[idx] - 1)
                sim.pending.append(op)
                w.bulk_open.append(op)
    return body


def compile_bulk_commit(sim, ins):
    def body(w, m, pc):
        w.bulk_groups.append(w.bulk_open)
        w.bulk_open = []
    return body


def compile_bulk_wait(sim, ins):
    n = int(ins.operands[0].text, 0)

    def body(w, m, pc):
        old = w.bulk_groups[:max(0, len(w.bulk_groups) - n)]
        for grp in old:
            for op in grp:
                sim.land(op)
                if op.release is not None:  # the source may be reused only after the wait (.read or not)
                    op.release()
                    op.release = None
        w.bulk_groups = w.bulk_groups[len(old):]
    return body


def compile_nop(sim, ins):
    return lambda w, m, pc: None


def compile_cp_async_bulk(sim, ins):
    words = ins.words
    if len(words) > 3 and words[3] == "tensor":
        return compile_tensor(sim, ins)
    if words[3] == "commit_group":
        return compile_bulk_commit(sim, ins)
    if words[3] == "wait_group":
        return compile_bulk_wait(sim, ins)
    if words[3] == "prefetch":
        return compile_nop(sim, ins)
    return compile_bulk(sim, ins)


COMPILERS = {"cp.async.bulk": compile_cp_async_bulk, "cp.reduce.async": compile_tensor}
