"""Instruction families. ``compile_instr`` turns one static PTX instruction into a handler ``(warp, lanes, pc)``.

A handler runs for the lanes of one warp that sit at ``pc``; it moves their PCs (``pc + 1``, a branch target) or
leaves them to wait. The guard predicate (``@p`` / ``@!p``) is applied here: guarded-off lanes only advance.
"""

from __future__ import annotations

from ..errors import Unsupported
from . import control, memops, sync, bulk, mma, arith, tcgen05, clc

_FAMILIES = {}
for _mod in (arith, control, memops, sync, bulk, mma, tcgen05, clc):
    for _name, _fn in _mod.COMPILERS.items():
        _FAMILIES[_name] = _fn


def _lookup(words):
    for n in (3, 2, 1):
        key = ".".join(words[:n])
        if key in _FAMILIES:
            return _FAMILIES[key]
    return None


def compile_instr(sim, ins, index):
    comp = _lookup(ins.words)
    try:
        if comp is None:
            body = arith.compile_alu(sim, ins)
        else:
            body = comp(sim, ins)
    except Unsupported as e:
        msg = f"{e} (PTX line {ins.line}: {ins.text.strip()[:160]})"

        def unsupported(w, group, pc, msg=msg):
            raise Unsupported(msg)
        return unsupported
    return control.wrap(sim, ins, body)
