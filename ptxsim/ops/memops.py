"""Loads, stores, atomics and register-level matrix moves: PTX ISA 9.7.9.8 ld, 9.7.9.9 ld.global.nc, 9.7.9.10 st,
9.7.13.5 atom, 9.7.13.6 red, 9.7.9.25 cp.async (non-bulk) with its groups, 9.7.9.16 ldmatrix, 9.7.9.17 stmatrix,
9.7.9.26 mapa, 9.7.9.27 getctarank, 9.7.9.20 prefetch / createpolicy / applypriority (no effect here)."""

from __future__ import annotations

import numpy as np

from .. import parser as P
from ..errors import MemoryFault, Unsupported
from ..machine import DTYPE, MASK, AsyncOp
from ..memory import CLUSTER_SHIFT, SHARED_WINDOW, WINDOW_MASK
from .control import converge
from .operands import TYPE_BITS, getter, reg_bits, setter, symbol_getter

SPACES = {"global", "shared", "shared::cta", "shared::cluster", "param", "param::entry", "param::func", "local",
          "const"}


def space_of(words):
    for wd in words[1:]:
        if wd in SPACES:
            return wd
    return "generic"


def addr_getter(sim, op):
    """``w -> int64 array``: the address an ``[base+off]`` operand names (in its state space)."""
    if not isinstance(op, P.Addr):
        raise Unsupported(f"address operand {op!r}")
    off = op.offset
    if op.base is None:
        arr = np.full(32, off, np.int64)
        return lambda w: arr
    if isinstance(op.base, P.Reg) and op.base.name not in sim.prog.reg_index:
        g = symbol_getter(sim, op.base.name, off, 64)
        if g is None:
            raise Unsupported(f"address base {op.base.name}")
        return lambda w: g(w).view(np.int64)
    bits = reg_bits(sim, op.base) or 64
    g = getter(sim, op.base, bits)
    if bits == 32:
        return lambda w: g(w).astype(np.int64) + off
    return lambda w: g(w).view(np.int64) + off


def resolve_generic(space, addrs, ctx):
    """A generic access's state space and its addresses in that space (the windows of ``ptxsim.memory``)."""
    if space != "generic":
        return space, addrs
    top = set((addrs.astype(np.uint64) >> np.uint64(56)).tolist())
    if len(top) != 1:
        raise Unsupported(f"a generic access spanning state spaces{ctx()}")
    t = top.pop()
    return {0: "global", 1: "shared", 2: "local", 3: "param"}[t], (addrs & WINDOW_MASK if t else addrs)


def _is_local(space, addrs) -> bool:
    """A local access: the local space, or generic addresses in the local window (``ptxsim.memory``)."""
    return space == "local" or (space == "generic" and bool((addrs.astype(np.uint64) >> np.uint64(56) == 2).any()))


def read(sim, w, space, addrs, nbytes, ctx, generic_proxy=True, atomic=False):
    """``(n, nbytes)`` uint8 for the addresses ``addrs`` of the lanes (in order)."""
    space, addrs = resolve_generic(space, addrs, ctx)
    if space == "global":
        if nbytes > 1 and (addrs % nbytes).any():
            raise MemoryFault(f"misaligned global read of {nbytes} B at {int(addrs[(addrs % nbytes) != 0][0]):#x}"
                              f"{ctx()}")
        return sim.gmem.read(addrs, nbytes, ctx)
    if space.startswith("shared"):
        cta, idx = sim.shared_index(w.cta, addrs, nbytes, ctx, cluster=True)
        return cta.smem.read(idx, "shared read", ctx, observed=w.observed, reader=None if atomic else w.gid)
    if space.startswith("param"):
        idx = addrs[:, None] + np.arange(nbytes)
        if idx.min() < 0 or idx.max() >= sim.param_buf.size:
            raise MemoryFault(f"param read at {int(addrs[0])} outside the {sim.param_buf.size} B of parameters"
                              f"{ctx()}")
        return sim.param_buf[idx]
    raise Unsupported(f"read from .{space}")


def write(sim, w, space, addrs, data, ctx, line):
    nbytes = data.shape[1]
    space, addrs = resolve_generic(space, addrs, ctx)
    if space == "global":
        if nbytes > 1 and (addrs % nbytes).any():
            raise MemoryFault(f"misaligned global write of {nbytes} B{ctx()}")
        sim.gmem.write(addrs, data, ctx)
        return
    if space.startswith("shared"):
        cta, idx = sim.shared_index(w.cta, addrs, nbytes, ctx, cluster=True)
        cta.smem.write(idx, data, "shared write", ctx, writer=w.gid, line=line, stamp=w.epoch + 1)
        return
    raise Unsupported(f"write to .{space}")


def _local(sim, w):
    if w.local is None:
        w.local = np.zeros((32, sim.local_size), np.uint8)
    return w.local


def _vec_and_type(words):
    vec = 1
    for wd in words:
        if wd.startswith("v") and wd[1:].isdigit():
            vec = int(wd[1:])
    types = [wd for wd in words if wd in TYPE_BITS]
    return vec, types[-1]


def compile_ld(sim, ins):
    space = space_of(ins.words)
    vec, ty = _vec_and_type(ins.words)
    ebits = TYPE_BITS[ty]
    if ebits == 128 and vec == 1 and space != "local":
        return _ld_b128(sim, ins, space)
    if ebits < 8 or ebits == 128:
        raise Unsupported(f"ld of .{ty}")
    eb = ebits // 8
    nbytes = eb * vec
    dst = ins.operands[0]
    dsts = dst.items if isinstance(dst, P.Vec) else (dst,)
    ag = addr_getter(sim, ins.operands[1])
    signed = ty.startswith("s")
    puts = []
    for d in dsts:
        rb = reg_bits(sim, d) if d is not None else ebits
        puts.append((setter(sim, d, max(rb, ebits)) if d is not None else None, max(rb, ebits)))
    edt = DTYPE[ebits]
    sdt = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)[m]
        if _is_local(space, a):
            loc = _local(sim, w)
            off = (a & WINDOW_MASK) if space == "generic" else a
            lanes = np.flatnonzero(m)
            if off.min() < 0 or off.max() + nbytes > loc.shape[1]:
                raise MemoryFault(f"local read outside the frame{ctx()}")
            raw = loc[lanes[:, None], off[:, None] + np.arange(nbytes)]
        else:
            raw = read(sim, w, space, a, nbytes, ctx)
        vals = np.ascontiguousarray(raw).view(edt).reshape(-1, vec)
        for k, (put, rb) in enumerate(puts):
            if put is None:
                continue
            v = vals[:, k]
            if rb > ebits:
                v = v.view(sdt[ebits]).astype(sdt[rb]).view(DTYPE[rb]) if signed else v.astype(DTYPE[rb])
            full = np.zeros(32, DTYPE[rb])
            full[m] = v
            put(w, full, m)
    return body


def _ld_b128(sim, ins, space):
    """PTX ISA 9.7.9.8 ld ``.b128`` (sm_70+, PTX 8.3): 16 bytes into a .b128 register ((32, 2) uint64, the low 8
    bytes in column 0: little-endian). Local and generic-to-local forms raise Unsupported."""
    ag = addr_getter(sim, ins.operands[1])
    put = setter(sim, ins.operands[0], 128)

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)[m]
        if _is_local(space, a):
            raise Unsupported(f"ld.b128 from local memory{ctx()}")
        raw = read(sim, w, space, a, 16, ctx)
        full = np.zeros((32, 2), np.uint64)
        full[m] = np.ascontiguousarray(raw).view(np.uint64).reshape(-1, 2)
        put(w, full, m)
    return body


def _st_b128(sim, ins, space):
    """PTX ISA 9.7.9.11 st ``.b128``: a .b128 register's 16 bytes, little-endian (see ``_ld_b128``)."""
    ag = addr_getter(sim, ins.operands[0])
    g = getter(sim, ins.operands[1], 128)

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)[m]
        if _is_local(space, a):
            raise Unsupported(f"st.b128 to local memory{ctx()}")
        data = np.ascontiguousarray(g(w)[m]).view(np.uint8).reshape(len(a), 16)
        write(sim, w, space, a, data, ctx, ins.line)
    return body


def compile_st(sim, ins):
    space = space_of(ins.words)
    vec, ty = _vec_and_type(ins.words)
    ebits = TYPE_BITS[ty]
    if ebits == 128 and vec == 1 and space != "local":
        return _st_b128(sim, ins, space)
    if ebits < 8 or ebits == 128:
        raise Unsupported(f"st of .{ty}")
    eb = ebits // 8
    src = ins.operands[1]
    srcs = src.items if isinstance(src, P.Vec) else (src,)
    gets = [getter(sim, s, ebits, ty.startswith("f")) if reg_bits(sim, s) in (0, ebits)
            else _narrow(getter(sim, s, reg_bits(sim, s)), ebits) for s in srcs]
    ag = addr_getter(sim, ins.operands[0])
    edt = DTYPE[ebits]

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)[m]
        vals = np.stack([g(w)[m].astype(edt) for g in gets], axis=1)
        data = np.ascontiguousarray(vals).view(np.uint8).reshape(len(a), eb * len(gets))
        if _is_local(space, a):
            loc = _local(sim, w)
            off = (a & WINDOW_MASK) if space == "generic" else a
            lanes = np.flatnonzero(m)
            if off.min() < 0 or off.max() + data.shape[1] > loc.shape[1]:
                raise MemoryFault(f"local write outside the frame{ctx()}")
            loc[lanes[:, None], off[:, None] + np.arange(data.shape[1])] = data
            return
        write(sim, w, space, a, data, ctx, ins.line)
    return body


def _narrow(g, bits):
    dt = DTYPE[bits]
    return lambda w: g(w).astype(dt)


_ATOM_OPS = {"add", "inc", "dec", "min", "max", "and", "or", "xor", "exch", "cas"}


def compile_atom(sim, ins):
    """PTX ISA 9.7.13.5 atom / 9.7.13.6 red: read-modify-write, lane by lane in lane order (any order is a legal
    serialization)."""
    is_red = ins.words[0] == "red"
    space = space_of(ins.words)
    opname = [wd for wd in ins.words[1:] if wd in _ATOM_OPS]
    if not opname:
        raise Unsupported(f"{ins.opcode}")
    opname = opname[0]
    vec, ty = _vec_and_type(ins.words)
    if vec != 1:
        raise Unsupported(f"vector {ins.words[0]}")
    bits = TYPE_BITS[ty]
    nb = bits // 8
    ops = ins.operands
    dst = None if is_red else ops[0]
    aop = ops[0] if is_red else ops[1]
    vals = ops[1:] if is_red else ops[2:]
    ag = addr_getter(sim, aop)
    gets = [getter(sim, v, bits, ty.startswith("f")) for v in vals]
    put = setter(sim, dst, bits) if dst is not None else None
    dt = DTYPE[bits]
    fdt = {"f32": np.float32, "f64": np.float64, "f16": np.float16}.get(ty)
    sdt = {"s32": np.int32, "s64": np.int64}.get(ty)

    def combine(old, b, c):
        if opname == "exch":
            return b
        if opname == "cas":
            return c if old == b else old
        if fdt is not None:
            x = np.array([old], dt).view(fdt)[0]
            y = np.array([b], dt).view(fdt)[0]
            r = {"add": x + y, "min": min(x, y), "max": max(x, y)}[opname]
            return int(np.array([r], fdt).view(dt)[0])
        if sdt is not None and opname in ("min", "max"):
            x = int(np.array([old], dt).view(sdt)[0])
            y = int(np.array([b], dt).view(sdt)[0])
            return (min(x, y) if opname == "min" else max(x, y)) & MASK[bits]
        if opname == "add":
            return (old + b) & MASK[bits]
        if opname == "inc":
            return 0 if old >= b else old + 1
        if opname == "dec":
            return b if (old == 0 or old > b) else old - 1
        return {"min": min(old, b), "max": max(old, b), "and": old & b, "or": old | b, "xor": old ^ b}[opname]

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)
        bv = [g(w) for g in gets]
        out = np.zeros(32, dt)
        for lane in np.flatnonzero(m).tolist():
            addr = np.array([a[lane]], np.int64)
            old = int(np.ascontiguousarray(read(sim, w, space, addr, nb, ctx, atomic=True)).view(dt).ravel()[0])
            b = int(bv[0][lane])
            c = int(bv[1][lane]) if len(bv) > 1 else 0
            new = combine(old, b, c)
            write(sim, w, space, addr, np.array([new], dt).view(np.uint8).reshape(1, nb), ctx, ins.line)
            out[lane] = old
        sim.epoch += 1
        if put is not None:
            put(w, out, m)
    return body


def compile_mapa(sim, ins):
    """PTX ISA 9.7.9.26 mapa: the shared::cluster address of the same variable in CTA ``b`` of the cluster."""
    bits = TYPE_BITS[[wd for wd in ins.words if wd in TYPE_BITS][-1]]
    g = getter(sim, ins.operands[1], bits)
    rank = getter(sim, ins.operands[2], 32)
    put = setter(sim, ins.operands[0], bits)
    generic = "shared::cluster" not in ins.words
    dt = DTYPE[bits]

    def body(w, m, pc):
        a = g(w).astype(np.int64)
        if generic:
            a = a & WINDOW_MASK
        r = rank(w).astype(np.int64)
        v = (a & ((1 << CLUSTER_SHIFT) - 1)) | (r << CLUSTER_SHIFT)
        if generic:
            v = v + SHARED_WINDOW
        put(w, v.astype(dt), m)
    return body


def compile_getctarank(sim, ins):
    g = getter(sim, ins.operands[1], reg_bits(sim, ins.operands[1]) or 32)
    put = setter(sim, ins.operands[0], 32)

    def body(w, m, pc):
        a = g(w).astype(np.int64) & WINDOW_MASK
        put(w, (a >> CLUSTER_SHIFT).astype(np.uint32), m)
    return body


def compile_nop(sim, ins):
    return lambda w, m, pc: None


def compile_createpolicy(sim, ins):
    """PTX ISA 9.7.9.18 createpolicy: an opaque L2 policy; only cache hints use it."""
    put = setter(sim, ins.operands[0], 64)
    zero = np.zeros(32, np.uint64)
    return lambda w, m, pc: put(w, zero, m)


def compile_isspacep(sim, ins):
    space = ins.words[1]
    g = getter(sim, ins.operands[1], 64)
    put = setter(sim, ins.operands[0], 1)
    want = {"global": 0, "shared": 1, "local": 2, "param": 3}.get(space.split("::")[0])

    def body(w, m, pc):
        put(w, (g(w) >> np.uint64(56)) == want, m)
    return body


# ---------------------------------------------------------------------------------------------------------------------
# cp.async (non-bulk): PTX ISA 9.7.9.25.3


def compile_cp_async(sim, ins):
    ops = ins.operands
    dga = addr_getter(sim, ops[0])
    sga = addr_getter(sim, ops[1])
    size = int(ops[2].text, 0)
    src_size = getter(sim, ops[3], 32) if len(ops) > 3 and not _is_policy(sim, ops[3]) else None

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        d = dga(w)[m]
        s = sga(w)[m]
        n = src_size(w)[m].astype(np.int64) if src_size is not None else np.full(len(d), size)
        cta, idx = sim.shared_index(w.cta, d, size, ctx)
        cta.smem.check(idx, "cp.async destination", ctx)
        cta.smem.inflight[idx] += 1
        cid = sim.new_completion(lambda: f"cp.async of PTX line {ins.line} by warp {w.wid} of CTA {w.cta.ctaid}")

        def land():
            data = np.zeros((len(d), size), np.uint8)
            live = n > 0
            if live.any():
                got = sim.gmem.read(s[live], size, ctx) if (n[live] == size).all() else None
                if got is None:
                    for k in np.flatnonzero(live):
                        data[k, :n[k]] = sim.gmem.read(s[k:k + 1], int(n[k]), ctx)[0]
                else:
                    data[live] = got
            cta.smem.inflight[idx] -= 1
            cta.smem.write(idx, data, "cp.async", ctx)
            cta.smem.landed(idx, cid, 1)  # observed by the issuer's wait_group, or through the noinc arrive
        op = AsyncOp(w.cta, "cp.async", ins.line, land)
        op.cid = cid
        sim.pending.append(op)
        w.cp_open.append(op)
    return body


def _is_policy(sim, op):
    return isinstance(op, P.Reg) and reg_bits(sim, op) == 64


def compile_cp_async_commit(sim, ins):
    def body(w, m, pc):
        w.cp_groups.append(w.cp_open)
        w.cp_open = []
    return body


def compile_cp_async_wait(sim, ins):
    n = 0 if ins.words[2] == "wait_all" else int(ins.operands[0].text, 0)

    def body(w, m, pc):
        if ins.words[2] == "wait_all":
            w.cp_groups.append(w.cp_open)
            w.cp_open = []
        cut = max(0, len(w.cp_groups) - n)
        keep = w.cp_groups[cut:]
        for grp in w.cp_groups[:cut]:
            for op in grp:
                sim.land(op)
                w.observed[op.cid] = 1
        w.cp_groups = keep
    return body


def compile_cp_async_mbarrier_arrive(sim, ins):
    """PTX ISA 9.7.13.15.12 cp.async.mbarrier.arrive: an arrive-on triggered when every prior cp.async of the thread
    has completed; without ``.noinc`` the pending count is incremented at issue (net zero)."""
    from .sync import mbar_of
    noinc = "noinc" in ins.words
    ag = addr_getter(sim, ins.operands[0])

    def body(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        a = ag(w)[m]
        bar = mbar_of(sim, w, a, ctx)
        count = int(m.sum())
        prior = [op for grp in w.cp_groups for op in grp] + list(w.cp_open)
        if not noinc:
            bar.pending += count
        copies = {p.cid: 1 for p in prior}  # the arrive releases the copies it waited for
        op = AsyncOp(w.cta, "cp.async.mbarrier.arrive", ins.line, lambda: bar.arrive(count, ctx, copies),
                     ready=lambda: all(p.done for p in prior))
        sim.pending.append(op)
    return body


# ---------------------------------------------------------------------------------------------------------------------
# ldmatrix / stmatrix


def _matrix_rows(sim, ins, addr_op):
    """``(matrices, .trans, rows_of)`` of an ldmatrix/stmatrix: ``rows_of(w, m, pc) -> (ctx, rows)`` with ``rows``
    (matrices, 8) the shared row addresses, lane 8j + r giving row r of matrix j (the warp converged first)."""
    words = ins.words
    num = int([wd for wd in words if wd.startswith("x")][0][1:])
    shape = [wd for wd in words if wd.startswith("m") and "n" in wd][0]
    if shape != "m8n8" or "b16" not in words:
        raise Unsupported(f"{words[0]} .{shape}")
    ag = addr_getter(sim, addr_op)
    generic = space_of(words) == "generic"

    def rows_of(w, m, pc):
        ctx = sim.ctx(w, ins, m)
        converge(w, m, pc, words[0], ctx)
        a = ag(w)
        if generic:
            a = a & WINDOW_MASK
        return ctx, a[:8 * num].reshape(num, 8)
    return num, "trans" in words, rows_of


def compile_ldmatrix(sim, ins):
    """PTX ISA 9.7.9.16 ldmatrix: each 8x8 matrix of b16 elements has its 8 row addresses given by 8 lanes; every
    lane receives two elements of each matrix (``layouts.ldmatrix_map``)."""
    num, trans, rows_of = _matrix_rows(sim, ins, ins.operands[1])
    puts = [setter(sim, d, 32) for d in ins.operands[0].items]

    def body(w, m, pc):
        ctx, rows = rows_of(w, m, pc)
        cta, idx = sim.shared_index(w.cta, rows.ravel(), 16, ctx)
        data = cta.smem.read(idx, "ldmatrix", ctx, observed=w.observed, reader=w.gid).reshape(num, 8, 8, 2).view(
            np.uint16)[..., 0]
        for j in range(num):
            mat = data[j].T if trans else data[j]
            # thread t holds row t // 4, cols 2 (t % 4) and 2 (t % 4) + 1
            t = np.arange(32)
            lo = mat[t // 4, 2 * (t % 4)].astype(np.uint32)
            hi = mat[t // 4, 2 * (t % 4) + 1].astype(np.uint32)
            puts[j](w, lo | (hi << np.uint32(16)), m)
    return body


def compile_stmatrix(sim, ins):
    """PTX ISA 9.7.9.17 stmatrix: the inverse of ldmatrix."""
    num, trans, rows_of = _matrix_rows(sim, ins, ins.operands[0])
    gets = [getter(sim, s, 32) for s in ins.operands[1].items]

    def body(w, m, pc):
        ctx, rows = rows_of(w, m, pc)
        t = np.arange(32)
        out = np.zeros((num, 8, 8), np.uint16)
        for j in range(num):
            v = gets[j](w)
            mat = np.zeros((8, 8), np.uint16)
            mat[t // 4, 2 * (t % 4)] = (v & 0xFFFF).astype(np.uint16)
            mat[t // 4, 2 * (t % 4) + 1] = (v >> 16).astype(np.uint16)
            out[j] = mat.T if trans else mat
        cta, idx = sim.shared_index(w.cta, rows.ravel(), 16, ctx)
        cta.smem.write(idx, out.reshape(num * 8, 8).view(np.uint8).reshape(num * 8, 16), "stmatrix", ctx,
                       writer=w.gid, line=ins.line, stamp=w.epoch + 1)
    return body


COMPILERS = {"ld": compile_ld, "st": compile_st, "atom": compile_atom, "red": compile_atom, "mapa": compile_mapa,
             "getctarank": compile_getctarank, "prefetch": compile_nop, "prefetchu": compile_nop,
             "applypriority": compile_nop, "discard": compile_nop, "createpolicy": compile_createpolicy,
             "isspacep": compile_isspacep,
             "cp.async.ca": compile_cp_async, "cp.async.cg": compile_cp_async,
             "cp.async.commit_group": compile_cp_async_commit, "cp.async.wait_group": compile_cp_async_wait,
             "cp.async.wait_all": compile_cp_async_wait, "cp.async.mbarrier": compile_cp_async_mbarrier_arrive,
             "ldmatrix": compile_ldmatrix, "stmatrix": compile_stmatrix}
