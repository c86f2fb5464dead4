"""Control flow and the guard: PTX ISA 9.7.12 "Control Flow Instructions" (bra, ret, exit, call) and 9.3
"Predicated execution" (``@p``)."""

from __future__ import annotations

import numpy as np

from .. import parser as P
from ..errors import Unsupported
from .operands import getter

# A body is ``fn(w, m, pc) -> None``, run for the lanes ``m`` (guard applied) after their PCs moved to pc + 1. A body
# that must hold lanes back (a collective whose members have not arrived) raises ``Hold``.


class Hold(Exception):
    """The lanes did not execute the instruction: their PCs go back and they step aside."""


def converge(w, m, pc, what, ctx) -> None:
    """An ``.aligned`` instruction is executed by all non-exited lanes of the warp together (PTX ISA 9.7.13.1 and
    the ``.aligned`` rule of each). Lanes still behind it (at a lower PC, or waiting) are waited for (ptxas
    reconverges the warp there); a lane past it means the warp diverged across it: a hazard."""
    from ..errors import Hazard
    from ..machine import _lanes

    missing = w.active & ~m
    if not missing.any():
        return
    if (w.pc[missing] > pc).any():
        ahead = missing & (w.pc > pc)
        raise Hazard(f"{what} (.aligned) executed by lanes {_lanes(m)} while lanes {_lanes(ahead)} of the warp went "
                     f"past it{ctx()}")
    raise Hold()


def wrap(sim, ins, body):
    if ins.guard is not None:
        g = getter(sim, ins.guard, 1)
        neg = ins.guard_neg

        def handler(w, group, pc):
            w.pc[group] = pc + 1
            gv = g(w)
            m = group & (~gv if neg else gv)
            if m.any():
                try:
                    body(w, m, pc)
                except Hold:
                    w.pc[group] = pc
                    w.coll_wait |= group
                    w.coll_flag = True
        return handler

    def handler(w, group, pc):
        w.pc[group] = pc + 1
        try:
            body(w, group, pc)
        except Hold:
            w.pc[group] = pc
            w.coll_wait |= group
            w.coll_flag = True
    return handler


def _bra(sim, ins):
    """PTX ISA 9.7.12.2 bra: jump to the label (``.uni`` only promises the warp does not diverge)."""
    tgt = ins.operands[0]
    if not isinstance(tgt, P.Reg) or tgt.name not in sim.fn.labels:
        raise Unsupported(f"branch target {tgt!r}")
    dest = sim.fn.labels[tgt.name]

    def body(w, m, pc):
        w.pc[m] = dest
    return body


def _exit(sim, ins):
    """PTX ISA 9.7.12.5 exit / 9.7.12.4 ret (from the entry): the lanes terminate."""
    def body(w, m, pc):
        w.active &= ~m
        sim.epoch += 1
        if not any(x.active.any() for x in w.cta.warps):
            w.cta.exited = True
            sim.ops.sync.cta_exit(sim, w.cta)
        else:
            sim.ops.sync.warp_exited(sim, w)
    return body


def _trap(sim, ins):
    def body(w, m, pc):
        from ..errors import SimError
        raise SimError(f"trap executed by CTA {w.cta.ctaid} warp {w.wid} lanes {np.flatnonzero(m).tolist()} "
                       f"(PTX line {ins.line})")
    return body


def _nop(sim, ins):
    return lambda w, m, pc: None


COMPILERS = {"bra": _bra, "ret": _exit, "exit": _exit, "trap": _trap, "brkpt": _trap,
             "nanosleep": _nop, "pmevent": _nop}
