"""Operand access: a compiled getter or setter per static operand, so the per-instruction work is numpy only."""

from __future__ import annotations

import struct

import numpy as np

from .. import parser as P
from ..errors import Hazard, Unsupported
from ..machine import DTYPE, LANES, MASK
from ..memory import CLUSTER_SHIFT

TYPE_BITS = {"pred": 1, "b8": 8, "u8": 8, "s8": 8, "b16": 16, "u16": 16, "s16": 16, "f16": 16, "bf16": 16,
             "b32": 32, "u32": 32, "s32": 32, "f32": 32, "f16x2": 32, "bf16x2": 32, "b64": 64, "u64": 64, "s64": 64,
             "f64": 64, "tf32": 32, "e4m3x2": 16, "e5m2x2": 16, "e2m1x2": 8, "e2m3x2": 16, "e3m2x2": 16,
             "ue8m0x2": 16, "f32x2": 64, "e4m3x4": 32, "e5m2x4": 32, "e2m1x4": 16, "b128": 128,
             "e4m3": 8, "e5m2": 8}


def imm_bits(text: str, bits: int, is_float: bool) -> int:
    """PTX ISA 4.5 "Constants": integer literals (decimal, hex, octal, binary) are 64-bit two's complement;
    ``0fXXXXXXXX`` / ``0dXXXXXXXXXXXXXXXX`` are exact float bit patterns; a decimal float literal is f64."""
    t = text.rstrip("uU")
    neg = t.startswith("-")
    body = t[1:] if neg or t.startswith("+") else t
    if body[:2] in ("0f", "0F"):
        v = int(body[2:], 16)
        if bits == 64:  # a single-precision literal in a double context
            v = struct.unpack("<Q", struct.pack("<d", struct.unpack("<f", struct.pack("<I", v))[0]))[0]
        if neg:
            v ^= 1 << (bits - 1)
        return v & MASK[bits]
    if body[:2] in ("0d", "0D"):
        v = int(body[2:], 16)
        if bits == 32:
            v = struct.unpack("<I", struct.pack("<f", struct.unpack("<d", struct.pack("<Q", v))[0]))[0]
        if neg:
            v ^= 1 << (bits - 1)
        return v & MASK[bits]
    if is_float or "." in body or ("e" in body.lower() and not body.lower().startswith("0x")):
        f = float(t)
        if bits == 32:
            return struct.unpack("<I", struct.pack("<f", f))[0]
        if bits == 64:
            return struct.unpack("<Q", struct.pack("<d", f))[0]
        if bits == 16:
            return int(np.array(f, np.float16).view(np.uint16))
        raise Unsupported(f"float literal {text} as {bits}-bit")
    v = int(t, 0)
    if bits == 1:
        return int(v != 0)
    return v & MASK[bits]


def _check_pending(w, idx, name, sim, write=False):
    """A register an in-flight asynchronous instruction still writes. ``w.pending_kind`` (when present) maps a
    pending register other than a wgmma's accumulator to its instruction: a tcgen05.ld destination
    (``tcgen05._Ld``, told of the read). Reading one is a true register dependency, which the hardware respects
    (PTX ISA 9.7.16.6.4.5 "Register dependencies, same thread": "For tcgen05.ld, an intra-thread ordering through
    true register dependency will be respected regardless of the presence or absence of other forms of
    synchronization"): the read waits for the load (here the load already moved the data at issue) and the register
    is no longer pending. Writing one first (the load's write may land after it) and any access to a wgmma
    accumulator before its wgmma.wait_group (9.7.15.7.3) are hazards."""
    if not (w.pending_regs and idx in w.pending_regs):
        return
    kinds = getattr(w, "pending_kind", None)
    kind = kinds.get(idx) if kinds else None
    if kind is not None and not write:
        w.pending_regs.discard(idx)
        del kinds[idx]
        kind.read(idx)
        return
    where = (f"; CTA {w.cta.ctaid} warp {w.wid}, PTX line {sim.prog.instrs[w.last_ins].line}: "
             f"{sim.prog.instrs[w.last_ins].text.strip()[:160]}")
    if kind is not None:
        raise Hazard(f"register {name} written while {kind} not yet retired by tcgen05.wait::ld still writes it "
                     f"(only a read of it waits for the load, PTX ISA 9.7.16.6.4.5){where}")
    raise Hazard(f"register {name} read or written while an in-flight wgmma still writes it (no "
                 f"wgmma.wait_group before the access){where}")


def symbol_getter(sim, name: str, offset: int, bits: int):
    """``w -> array``: the state-space address of a variable or parameter (plus ``offset``), or None. A shared
    variable's address carries the CTA's rank in the cluster (``memory.CLUSTER_SHIFT``): a CTA's shared::cta window
    lies in the cluster's shared::cluster window (PTX ISA 5.1.3)."""
    v = symbol_value(sim, name)
    if v is None:
        return None
    dt = DTYPE[bits]
    const = np.full(32, (v + offset) & MASK[bits], dt)
    if name not in sim.shared_offset:
        return lambda w: const
    per_rank = [np.full(32, ((r << CLUSTER_SHIFT) + v + offset) & MASK[bits], dt) for r in range(16)]
    return lambda w: per_rank[w.cta.rank]


def symbol_value(sim, name: str):
    """The state-space address of a variable or parameter named in an operand (for a shared one, in a CTA of rank
    0), or None."""
    if name in sim.shared_offset:
        return sim.shared_offset[name]
    if name in sim.param_offset:
        return sim.param_offset[name]
    if name in sim.local_offset:
        return sim.local_offset[name]
    if name in getattr(sim, "global_vars", {}):
        return sim.global_vars[name]
    return None


def getter(sim, op, bits: int, is_float: bool = False, signed: bool = False):
    """``w -> array`` of raw bits of width ``bits`` (bool for 1)."""
    dt = DTYPE[bits] if bits in DTYPE else None
    if isinstance(op, P.Reg):
        idx = sim.prog.reg_index.get(op.name)
        if idx is None:
            g = symbol_getter(sim, op.name, 0, bits) if bits > 1 else None
            if g is None:
                raise Unsupported(f"operand {op.name}: neither a register nor a variable")
            return g
        rb = sim.prog.reg_bits[idx]
        name = op.name
        if rb == bits:
            def get(w):
                if w.pending_regs:
                    _check_pending(w, idx, name, sim)
                return w.R[idx]
            return get
        if bits == 1 or rb == 1:
            raise Unsupported(f"predicate {name} used as {bits}-bit value (or the reverse)")
        if bits == 128 or rb == 128:
            raise Unsupported(f"the {rb}-bit register {name} used as a {bits}-bit value")
        if signed and rb < bits:
            sdt = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
            return lambda w: w.R[idx].view(sdt[rb]).astype(sdt[bits]).view(dt)
        return lambda w: w.R[idx].astype(dt)
    if isinstance(op, P.Imm):
        const = np.full(32, imm_bits(op.text, bits, is_float), dt)
        return lambda w: const
    if isinstance(op, P.SReg):
        return sreg_getter(sim, op.name, bits)
    if isinstance(op, P.Not):
        inner = getter(sim, op.inner, bits)
        return lambda w: ~inner(w)
    if isinstance(op, P.Addr) and op.vec is None:  # sym+off as a value
        if op.base is None:
            const = np.full(32, op.offset & MASK[bits], dt)
            return lambda w: const
        g = symbol_getter(sim, op.base.name, op.offset, bits) if isinstance(op.base, P.Reg) else None
        if g is None:
            raise Unsupported(f"address expression {op} as a value")
        return g
    raise Unsupported(f"operand {op!r} as a {bits}-bit source")


def sreg_getter(sim, name: str, bits: int):
    """PTX ISA 10 "Special Registers"."""
    dt = DTYPE[bits]
    parts = name.split(".")
    base, axis = parts[0], (parts[1] if len(parts) > 1 else None)
    ax = {"x": 0, "y": 1, "z": 2}.get(axis, 0)
    spec = sim.spec
    cl = spec.cluster

    def const(v):
        arr = np.full(32, v, dt)
        return lambda w: arr
    if base == "%tid":
        return lambda w: w.tid[ax].astype(dt)
    if base == "%ntid":
        return const(spec.block[ax])
    if base == "%laneid":
        lanes = LANES.astype(dt)
        return lambda w: lanes
    if base == "%warpid":
        return lambda w: np.full(32, w.wid, dt)
    if base == "%nwarpid":
        return const(64)
    if base == "%ctaid":
        return lambda w: np.full(32, w.cta.ctaid[ax], dt)
    if base == "%nctaid":
        return const(spec.grid[ax])
    if base == "%cluster_ctarank":
        return lambda w: np.full(32, w.cta.rank, dt)
    if base == "%cluster_nctarank":
        return const(cl[0] * cl[1] * cl[2])
    if base == "%cluster_ctaid":
        return lambda w: np.full(32, w.cta.ctaid[ax] % cl[ax], dt)
    if base == "%cluster_nctaid":
        return const(cl[ax])
    if base == "%clusterid":
        return lambda w: np.full(32, w.cta.cluster_id[ax], dt)
    if base == "%nclusterid":
        return const(spec.grid[ax] // cl[ax])
    if base == "%is_explicit_cluster":
        return const(1 if tuple(cl) != (1, 1, 1) else 0)
    if base == "%dynamic_smem_size":
        return const(spec.dyn_smem)
    if base in ("%total_smem_size", "%aggr_smem_size"):
        return const(sim.smem_size)
    if base == "%smid":
        return lambda w: np.full(32, (w.cta.ctaid[0] + w.cta.ctaid[1] * 7) % 132, dt)
    if base == "%nsmid":
        return const(132)
    if base in ("%clock", "%clock64", "%globaltimer", "%globaltimer_lo", "%globaltimer_hi"):
        return lambda w: np.full(32, sim.instructions & MASK[bits], dt)
    if base.startswith("%lanemask_"):
        kind = base[len("%lanemask_"):]
        rel = {"eq": lambda l: 1 << l, "lt": lambda l: (1 << l) - 1, "le": lambda l: (1 << (l + 1)) - 1,
               "gt": lambda l: (0xFFFFFFFF << (l + 1)) & 0xFFFFFFFF, "ge": lambda l: (0xFFFFFFFF << l) & 0xFFFFFFFF}
        arr = np.array([rel[kind](l) for l in range(32)], dt)
        return lambda w: arr
    raise Unsupported(f"special register {name}")


def setter(sim, op, bits: int):
    """``(w, value, mask) -> None`` writing raw bits of width ``bits`` to a destination operand."""
    if op is None:
        return lambda w, v, m: None
    if isinstance(op, P.Reg):
        idx = sim.prog.reg_index.get(op.name)
        if idx is None:
            raise Unsupported(f"destination {op.name} is not a register")
        rb = sim.prog.reg_bits[idx]
        name = op.name
        if rb == 128 or bits == 128:  # a .b128 register: (32, 2) uint64, low half first (PTX ISA 5.2.2)
            if rb != bits:
                raise Unsupported(f"{bits}-bit value written to the {rb}-bit register {name}")
            return lambda w, v, m: np.copyto(w.R[idx], v, where=m[:, None])
        dt = DTYPE[rb]

        def put(w, v, m):
            if w.pending_regs:
                _check_pending(w, idx, name, sim, write=True)
            if w.pending_w and idx in w.pending_w:
                raise Hazard(f"register {name} written while an in-flight wgmma still reads it as its A fragment (no "
                             f"wgmma.wait_group before the write); CTA {w.cta.ctaid} warp {w.wid}, PTX line "
                             f"{sim.prog.instrs[w.last_ins].line}: {sim.prog.instrs[w.last_ins].text.strip()[:160]}")
            if v.dtype != dt:
                v = v.astype(dt)
            np.copyto(w.R[idx], v, where=m)
        return put
    raise Unsupported(f"destination operand {op!r}")


def reg_bits(sim, op) -> int:
    if isinstance(op, P.Reg) and op.name in sim.prog.reg_index:
        return sim.prog.reg_bits[sim.prog.reg_index[op.name]]
    return 0
