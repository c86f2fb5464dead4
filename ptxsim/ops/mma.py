"""Warpgroup MMA: PTX ISA 9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate" — wgmma.fence,
wgmma.mma_async (A from a shared-memory descriptor or from registers, B from a descriptor), wgmma.commit_group,
wgmma.wait_group.

The four warps of a warpgroup each issue the instruction (``.sync.aligned``); the k-th issue of every warp forms one
operation. Its shared operands are checked at issue (landed, fenced if written by the generic proxy) and locked
against writes until it completes; its accumulator registers may not be touched until a ``wait_group`` retires it
(reads and writes are hazards), its A registers may not be written. Operations of one warpgroup complete in issue
order (chained accumulators), at times the seed picks or when a ``wait_group`` needs them.

Numerics: products and sums in float64, rounded once to the f32 (or f16) accumulator. The ISA leaves the order and
the intermediate precision of the sums unspecified, so this is one of the results it allows up to that rounding.
"""

from __future__ import annotations

import collections
import re

import numpy as np

from .. import layouts
from .. import parser as P
from ..errors import Hazard, Unsupported
from ..machine import AsyncOp, Waiter
from .control import converge
from .operands import getter

_ELEM_BITS = {"f16": 16, "bf16": 16, "tf32": 32, "e4m3": 8, "e5m2": 8, "s8": 8, "u8": 8, "b1": 1}


def _fp8_table(exp_bits: int, man_bits: int, bias: int, finite_max_nan: bool) -> np.ndarray:
    vals = np.zeros(256, np.float64)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> man_bits) & ((1 << exp_bits) - 1)
        m = b & ((1 << man_bits) - 1)
        if finite_max_nan:  # e4m3 (OCP E4M3FN): only S.1111.111 is NaN, no infinities
            if e == (1 << exp_bits) - 1 and m == (1 << man_bits) - 1:
                vals[b] = np.nan
                continue
        elif e == (1 << exp_bits) - 1:  # e5m2: IEEE-like
            vals[b] = s * np.inf if m == 0 else np.nan
            continue
        if e == 0:
            vals[b] = s * m * 2.0 ** (1 - bias - man_bits)
        else:
            vals[b] = s * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return vals


# PTX ISA 5.2.5.1 "Alternate floating-point data formats": e4m3 (bias 7, max 448, NaN only), e5m2 (bias 15)
E4M3 = _fp8_table(4, 3, 7, True)
E5M2 = _fp8_table(5, 2, 15, False)


def decode_elems(raw: np.ndarray, ty: str) -> np.ndarray:
    """Raw element bytes (..., elem_bytes) of an MMA operand to float64."""
    if ty == "bf16":
        return (np.ascontiguousarray(raw).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)[..., 0]
    if ty == "f16":
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float64)[..., 0]
    if ty == "tf32":
        bits = np.ascontiguousarray(raw).view(np.uint32) & np.uint32(0xFFFFE000)
        return bits.view(np.float32).astype(np.float64)[..., 0]
    if ty == "e4m3":
        return E4M3[raw[..., 0]]
    if ty == "e5m2":
        return E5M2[raw[..., 0]]
    if ty == "s8":
        return raw[..., 0].view(np.int8).astype(np.float64)
    if ty == "u8":
        return raw[..., 0].astype(np.float64)
    raise Unsupported(f"wgmma operand type {ty}")


def decode_packed(bits: np.ndarray, ty: str, per: int) -> np.ndarray:
    """32-bit registers holding ``per`` elements (low bits first) to float64 (..., per)."""
    eb = 32 // per
    parts = np.stack([(bits >> np.uint32(eb * j)) & np.uint32((1 << eb) - 1) for j in range(per)], axis=-1)
    raw = parts.astype({16: np.uint16, 8: np.uint8}[eb]).view(np.uint8).reshape(parts.shape + (eb // 8,))
    return decode_elems(raw, ty)


class WgmmaOp:
    def __init__(self, sim, cta, wg, line, shape, dtype, atype, btype):
        self.sim, self.cta, self.wg, self.line = sim, cta, wg, line
        self.m, self.n, self.k = shape
        self.dtype, self.atype, self.btype = dtype, atype, btype
        self.parts = {}  # warp index in the warpgroup -> (warp, dregs, aregs or None, scale_d, ...)
        self.async_op = None
        self.smem_idx = []


def _retire(op) -> None:
    """The first wait_group that covers ``op`` ends its reads of shared memory (the stage may be reused after it)."""
    if not getattr(op, "retired", False):
        op.retired = True
        for ix in op.smem_idx:
            op.cta.smem.mma_reads[ix] -= 1


def _wg_state(cta):
    if not hasattr(cta, "wg_waiter"):
        cta.wg_waiter = Waiter()
        cta.wg_ops = collections.defaultdict(list)  # warpgroup -> ops in issue order
    return cta


def compile_wgmma(sim, ins):
    words = ins.words
    kind = words[1]
    if kind == "fence":
        return lambda w, m, pc: None
    if kind == "commit_group":
        def body(w, m, pc):
            w.wg_groups.append(w.wg_open)
            w.wg_open = []
        return body
    if kind == "wait_group":
        n = int(ins.operands[0].text, 0)

        def body(w, m, pc):
            cta = _wg_state(w.cta)
            old = w.wg_groups[:max(0, len(w.wg_groups) - n)]
            ops = [op for grp in old for op in grp]
            if any(op.async_op is None for op in ops):
                # another warp of the warpgroup has not issued its part yet: wait for it
                w.pc[m] = pc
                w.waits.append((m.copy(), cta.wg_waiter, cta.wg_waiter.version,
                                f"wgmma.wait_group {n} (PTX line {ins.line}): a wgmma of its group lacks the other "
                                f"warps' issue", False))
                return
            for op in ops:
                sim.land(op.async_op)
                _retire(op)
            w.wg_groups = w.wg_groups[len(old):]
            # only this warp's wait retires its registers (PTX ISA 9.7.15.7.3: an access before a wait_group of
            # the executing warp that covers the wgmma is undefined, whoever else waited)
            live = [o for grp in w.wg_groups for o in grp] + w.wg_open
            done_d = set().union(*[o.dregs for o in ops]) - set().union(*[o.dregs for o in live])
            w.pending_regs -= done_d  # (a tcgen05.ld's pending registers are not the wait_group's)
            w.pending_w = set().union(*[o.aregs for o in live])
        return body
    if kind != "mma_async":
        raise Unsupported(f"wgmma.{kind}")
    shape = [wd for wd in words if re.fullmatch(r"m\d+n\d+k\d+", wd)][0]
    M, N, K = map(int, re.findall(r"\d+", shape))
    types = [wd for wd in words if wd in ("f32", "f16", "s32") or wd in _ELEM_BITS]
    dtype, atype, btype = types[0], types[1], types[2]
    if "sp" in words or atype in ("s8", "u8", "b1"):
        raise Unsupported(f"wgmma {ins.opcode}")
    ops = ins.operands
    dregs = [sim.prog.reg_index[r.name] for r in ops[0].items]
    a_regs = isinstance(ops[1], P.Vec)
    aregs = [sim.prog.reg_index[r.name] for r in ops[1].items] if a_regs else None
    adesc = None if a_regs else getter(sim, ops[1], 64)
    bdesc = getter(sim, ops[2], 64)
    scale_d = getter(sim, ops[3], 1)
    imms = [int(o.text, 0) for o in ops[4:]]
    scale_a, scale_b = imms[0], imms[1]
    trans_a = 0 if a_regs else (imms[2] if len(imms) > 2 else 0)
    trans_b = imms[-1] if len(imms) > (2 if a_regs else 3) else 0
    ebits = _ELEM_BITS[atype]
    acc_bits = 16 if dtype == "f16" else 32
    acc_map = layouts.wgmma_acc_map(N, acc_bits)
    a_map = layouts.wgmma_a_reg_map(ebits) if a_regs else None

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        converge(w, m, pc, "wgmma.mma_async", ctx)
        cta = _wg_state(w.cta)
        wg, wi = w.wid // 4, w.wid % 4
        seq = w.wg_seq
        w.wg_seq += 1
        lst = cta.wg_ops[wg]
        op = next((o for o in lst if o.seq == seq), None)
        if op is None:
            op = WgmmaOp(sim, cta, wg, ins.line, (M, N, K), dtype, atype, btype)
            op.seq = seq
            op.dregs = set(dregs)
            op.aregs = set(aregs or ())
            lst.append(op)
        if wi in op.parts:
            raise Hazard(f"warp issued two parts of one wgmma{ctx()}")
        lane0 = int(np.flatnonzero(m)[0])
        part = {"warp": w, "scale_d": bool(scale_d(w)[lane0]), "b": int(bdesc(w)[lane0]),
                "a": int(adesc(w)[lane0]) if adesc is not None else None,
                "aval": np.stack([w.R[i].copy() for i in aregs], axis=1) if a_regs else None}
        for key in ("b", "a"):
            vals = (bdesc if key == "b" else adesc)
            if vals is not None and len(set(vals(w)[m].tolist())) != 1:
                raise Hazard(f"wgmma {key.upper()} descriptor differs across the lanes of a warp{ctx()}")
        op.parts[wi] = part
        w.pending_regs |= op.dregs
        w.pending_w |= op.aregs  # the A fragment may be read until the wait: not to be written
        w.wg_open.append(op)
        members = [x for x in cta.warps[4 * wg:4 * wg + 4] if x.exists.any()]
        if len(op.parts) == len(members):
            _form(sim, cta, op, ins, ctx)

    def _form(sim, cta, op, ins, ctx):
        descs = {(p["a"], p["b"], p["scale_d"]) for p in op.parts.values()}
        if len(descs) != 1:
            raise Hazard(f"the warps of a warpgroup issued one wgmma with different descriptors or scale-d: "
                         f"{sorted(descs)}{ctx()}")
        a, b, sd = descs.pop()
        smem = cta.smem
        b_addrs = layouts.wgmma_operand_addrs(b, N, 256 // ebits, ebits, trans_b == 0)
        b_idx = (b_addrs[..., None] + np.arange(ebits // 8)).astype(np.int64)
        idxs = [b_idx]
        if not a_regs:
            a_addrs = layouts.wgmma_operand_addrs(a, M, 256 // ebits, ebits, trans_a == 0)
            idxs.append((a_addrs[..., None] + np.arange(ebits // 8)).astype(np.int64))
        for ix in idxs:
            for p in op.parts.values():  # each issuing warp must have observed what landed in its operands
                smem.read(ix, "wgmma operand", ctx, generic=False, observed=p["warp"].observed,
                          reader=p["warp"].gid)
            smem.mma_reads[ix] += 1
        op.smem_idx = idxs
        cta.wg_waiter.version += 1
        sim.epoch += 1
        prev = [o for o in cta.wg_ops[op.wg] if o.seq < op.seq]

        def ready():
            return all(o.async_op is not None and o.async_op.done for o in prev)

        def land():
            _execute(sim, cta, op, a, sd, a_regs, ins)
            cta.wg_ops[op.wg].remove(op)
            cta.wg_waiter.version += 1
        op.async_op = AsyncOp(cta, "wgmma", ins.line, land, ready)
        sim.pending.append(op.async_op)

    def _execute(sim, cta, op, a, sd, a_regs, ins):
        smem = cta.smem
        Bm = decode_elems(smem.data[op.smem_idx[0]], btype)  # (N, K)
        if a_regs:
            Am = np.zeros((M, 256 // ebits))
            per = 32 // ebits
            for wi, p in op.parts.items():
                vals = decode_packed(p["aval"], atype, per)  # (32, 4, per)
                rc = a_map[wi]  # (32, 4, per, 2)
                Am[rc[..., 0], rc[..., 1]] = vals
        else:
            Am = decode_elems(smem.data[op.smem_idx[1]], atype)
        if scale_a < 0:
            Am = -Am
        if scale_b < 0:
            Bm = -Bm
        D = Am @ Bm.T  # (M, N) float64
        for wi, p in op.parts.items():
            w = p["warp"]
            rc = acc_map[wi]
            if acc_bits == 32:
                # rc: (32, nregs, 2)
                for r, idx in enumerate(dregs):
                    rows, cols = rc[:, r, 0], rc[:, r, 1]
                    val = D[rows, cols]
                    if sd:
                        if dtype == "s32":
                            raise Unsupported("integer wgmma")
                        val = val + w.R[idx].view(np.float32).astype(np.float64)
                    w.R[idx][:] = val.astype(np.float32).view(np.uint32)
            else:
                for r, idx in enumerate(dregs):
                    lo = D[rc[:, r, 0, 0], rc[:, r, 0, 1]]
                    hi = D[rc[:, r, 1, 0], rc[:, r, 1, 1]]
                    if sd:
                        old = w.R[idx]
                        lo = lo + (old & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)
                        hi = hi + (old >> 16).astype(np.uint16).view(np.float16).astype(np.float64)
                    w.R[idx][:] = (lo.astype(np.float16).view(np.uint16).astype(np.uint32)
                                   | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16))
    return body


COMPILERS = {"wgmma": compile_wgmma}
