"""Data movement between registers (mov, cvta) and the glue to ``alu`` for every arithmetic, logic, comparison and
conversion instruction (their semantics and ISA sections are in ``ptxsim/alu.py``)."""

from __future__ import annotations

import numpy as np

from .. import alu
from .. import parser as P
from ..errors import MemoryFault, Unsupported
from ..machine import DTYPE, MASK
from ..memory import LOCAL_WINDOW, PARAM_WINDOW, SHARED_WINDOW, WINDOW_MASK
from .operands import TYPE_BITS, getter, setter


def split_words(words):
    mods, types = [], []
    for wd in words[1:]:
        (types if wd in alu.TYPE_WORDS else mods).append(wd)
    return tuple(mods), tuple(types)


_FLOAT_TYPES = {"f16", "bf16", "f32", "f64", "f16x2", "bf16x2", "tf32", "f32x2"}


def _src_bits(op, mods, types, n):
    """Bit width of each source operand (1 = predicate): PTX ISA per instruction."""
    t0 = TYPE_BITS[types[0]] if types else 32
    if op == "cvt":
        return [TYPE_BITS[types[1]]] * n
    if op in ("shl", "shr"):
        return [t0, 32]
    if op == "shf":
        return [32, 32, 32]
    if op == "selp":
        return [t0, t0, 1]
    if op == "setp":
        return [t0, t0] + [1] * (n - 2)
    if op == "set":
        return [TYPE_BITS[types[1]]] * 2 + [1] * (n - 2)
    if op == "slct":
        return [t0, t0, TYPE_BITS[types[1]]]
    if op == "bfe":
        return [t0, 32, 32]
    if op == "bfi":
        return [t0, t0, 32, 32]
    if op == "mad" and "wide" in mods:
        return [t0, t0, 2 * t0]
    if op in ("lop3",):
        return [32, 32, 32, 32][:n]
    if op in ("prmt",):
        return [32] * n
    if op == "testp":
        return [t0]
    if op in ("popc", "clz", "bfind", "brev") and n == 1:
        return [t0]
    if op in ("and", "or", "xor", "not", "cnot") and types and types[0] == "pred":
        return [1] * n
    return [t0] * n


def _dst_bits(op, mods, types):
    t0 = TYPE_BITS[types[0]] if types else 32
    if op in ("setp", "testp"):
        return 1
    if op in ("mul", "mad") and "wide" in mods:
        return 2 * t0
    if op in ("popc", "clz", "bfind"):
        return 32
    return t0


def compile_alu(sim, ins):
    op = ins.words[0]
    mods, types = split_words(ins.words)
    if not types:
        raise Unsupported(f"instruction {ins.opcode}")
    fn = alu.compile(op, mods, types)
    dst, srcs = ins.operands[0], ins.operands[1:]
    bits = _src_bits(op, mods, types, len(srcs))
    is_float = [(types[1] if op in ("cvt", "set") else types[0]) in _FLOAT_TYPES] * len(srcs)
    signed = types[-1].startswith("s") if op == "cvt" else False
    gets = [getter(sim, s, b, f and b > 1, signed) for s, b, f in zip(srcs, bits, is_float)]
    db = _dst_bits(op, mods, types)
    uses_cc = op in ("addc", "subc", "madc")
    sets_cc = "cc" in mods
    if uses_cc or sets_cc:
        put = setter(sim, dst, db)

        def body(w, m, pc):
            args = [g(w) for g in gets]
            if uses_cc:
                args.append(w.cc if w.cc is not None else np.zeros(32, bool))
            r = fn(args)
            if sets_cc:
                r, cf = r
                w.cc = np.where(m, cf, w.cc if w.cc is not None else False)
            put(w, r, m)
        return body
    if isinstance(dst, P.Pair):
        put_a = setter(sim, dst.a, db)
        put_b = setter(sim, dst.b, db)

        def body(w, m, pc):
            r = fn([g(w) for g in gets])
            put_a(w, r[0], m)
            put_b(w, r[1], m)
        return body
    put = setter(sim, dst, db)
    tup = op in ("setp",) or (op == "lop3" and len(srcs) > 4)
    if tup:
        def body(w, m, pc):
            put(w, fn([g(w) for g in gets])[0], m)
    elif len(gets) == 1:
        g0 = gets[0]

        def body(w, m, pc):
            put(w, fn([g0(w)]), m)
    elif len(gets) == 2:
        g0, g1 = gets

        def body(w, m, pc):
            put(w, fn([g0(w), g1(w)]), m)
    else:
        def body(w, m, pc):
            put(w, fn([g(w) for g in gets]), m)
    return body


def compile_mov(sim, ins):
    """PTX ISA 9.7.9.1 mov (and 9.7.9.2 pack/unpack forms: ``mov.b64 d, {a, b}`` / ``mov.b64 {a, b}, d``, the first
    vector element in the low bits)."""
    mods, types = split_words(ins.words)
    bits = TYPE_BITS[types[0]]
    dst, src = ins.operands
    if bits == 128:
        return _mov_b128(sim, dst, src)
    if isinstance(src, P.Vec):  # pack
        n = len(src.items)
        part = bits // n
        gets = [getter(sim, s, part) for s in src.items]
        put = setter(sim, dst, bits)
        dt = DTYPE[bits]

        def body(w, m, pc):
            acc = np.zeros(32, dt)
            for k, g in enumerate(gets):
                acc |= g(w).astype(dt) << dt(part * k)
            put(w, acc, m)
        return body
    if isinstance(dst, P.Vec):  # unpack
        n = len(dst.items)
        part = bits // n
        g = getter(sim, src, bits)
        puts = [setter(sim, d, part) for d in dst.items]
        dt = DTYPE[bits]
        pdt = DTYPE[part]

        def body(w, m, pc):
            v = g(w)
            for k, p in enumerate(puts):
                p(w, ((v >> dt(part * k)) & dt(MASK[part])).astype(pdt), m)
        return body
    g = getter(sim, src, bits, types[0] in _FLOAT_TYPES)
    put = setter(sim, dst, bits)
    return lambda w, m, pc: put(w, g(w), m)


def _mov_b128(sim, dst, src):
    """PTX ISA 9.7.9.10 mov ``.b128``: ``mov.b128 d, {lo, hi}`` packs two .b64 (or four .b32, first in the low bits)
    into a 128-bit register, ``mov.b128 {lo, hi}, d`` unpacks it, ``mov.b128 d, s`` copies. A .b128 register is a
    (32, 2) uint64 array (column 0 the low 64 bits)."""
    def parts(vec):
        n = len(vec.items)
        if n not in (2, 4):
            raise Unsupported(f"mov.b128 with a vector of {n} elements")
        return n, 128 // n
    if isinstance(src, P.Vec):
        n, part = parts(src)
        gets = [getter(sim, s, part) for s in src.items]
        put = setter(sim, dst, 128)
        per = 64 // part

        def body(w, m, pc):
            v = np.zeros((32, 2), np.uint64)
            for k, g in enumerate(gets):
                v[:, k // per] |= g(w).astype(np.uint64) << np.uint64(part * (k % per))
            put(w, v, m)
        return body
    g = getter(sim, src, 128)
    if isinstance(dst, P.Vec):
        n, part = parts(dst)
        puts = [setter(sim, d, part) for d in dst.items]
        per = 64 // part

        def body(w, m, pc):
            v = g(w)
            for k, p in enumerate(puts):
                p(w, ((v[:, k // per] >> np.uint64(part * (k % per))) & np.uint64(MASK[part])).astype(DTYPE[part]), m)
        return body
    put = setter(sim, dst, 128)
    return lambda w, m, pc: put(w, g(w).copy(), m)


def compile_cvta(sim, ins):
    """PTX ISA 9.7.9.15 cvta: state-space address <-> generic (windows in ``ptxsim.memory``)."""
    mods, types = split_words(ins.words)
    bits = TYPE_BITS[types[0]]
    to = "to" in mods
    space = [m for m in mods if m != "to"][0]
    g = getter(sim, ins.operands[1], bits)
    put = setter(sim, ins.operands[0], bits)
    window = {"shared": SHARED_WINDOW, "local": LOCAL_WINDOW, "param": PARAM_WINDOW, "global": 0,
              "const": None}.get(space.split("::")[0])
    if window is None:
        raise Unsupported(f"cvta to/from .{space}")
    dt = DTYPE[bits]
    if to:
        def body(w, m, pc):
            v = g(w).astype(np.uint64)
            top = v[m] >> np.uint64(56)
            if window and (top != window >> 56).any() or (not window and top.any()):
                raise MemoryFault(f"cvta.to.{space} of a generic address outside .{space}: "
                                  f"{int(v[m][0]):#x} (PTX line {ins.line})")
            put(w, (v & np.uint64(WINDOW_MASK)).astype(dt), m)
        return body

    def body(w, m, pc):
        put(w, (g(w).astype(np.uint64) + np.uint64(window)).astype(dt), m)
    return body


COMPILERS = {"mov": compile_mov, "cvta": compile_cvta}
