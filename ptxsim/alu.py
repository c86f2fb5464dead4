"""Arithmetic, logic, compare and conversion semantics of PTX instructions, vectorized over a warp's lanes.

Every value is raw bits (see SPEC "Value conventions"): ``.pred`` -> bool, 8/16/32/64-bit -> uint8/16/32/64, f32 is
uint32 bits, f16/bf16 uint16 bits, f16x2/bf16x2 uint32 (low half = first element), f32x2 uint64 (low word = first
element), e4m3x2/e5m2x2 uint16 (low byte = first element).

API
- ``compile(op, mods, types) -> fn(srcs)``: resolves the dispatch once per static instruction (cached).
- ``evaluate(op, mods, types, srcs)`` = ``compile(op, tuple(mods), tuple(types))(srcs)``.
- ``TYPE_WORDS``: the dotted words that are types; ``mods`` are the other words after the opcode, in order.

Operand conventions the core must follow
- ``srcs`` are the source operands in PTX order, already read (a negated predicate source ``!c`` is negated by the
  core).  Immediates are arrays of the operand's raw-bit dtype (0-d or (32,)).  The shift/position/length operands
  of shl/shr/shf/bfe/bfi and the immLut of lop3 are uint32.
- ``setp`` always returns ``(p, q)`` (q = the complement compare combined with c); the core drops q if absent.
  For f16x2/bf16x2 setp, p is the low-half compare and q the high-half one (PTX ISA 9.7.4.7 setp, half types).
- ``lop3.{and,or}`` takes srcs ``[a, b, c, immLut, q]`` and returns ``(d, p)``.
- Carry forms: ``add.cc``/``sub.cc``/``mad.cc`` return ``(d, cf)``; ``addc``/``subc``/``madc`` take the carry flag
  (bool array) as their last source and return ``d`` or, with ``.cc``, ``(d, cf)``.  For sub/subc the flag is the
  borrow, as PTX writes it (``subc: d = a - (b + CC.CF)``).
- ``cvt`` to f16x2/bf16x2/e4m3x2/e5m2x2 from f32 takes ``[a, b]``; a goes to the HIGH half (PTX ISA 9.7.9.21 cvt).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Callable

import numpy as np

from .errors import Unsupported

__all__ = ["TYPE_WORDS", "compile", "evaluate"]

TYPE_WORDS = frozenset(
    "pred b8 b16 b32 b64 b128 u8 u16 u32 u64 s8 s16 s32 s64 u16x2 s16x2 f16 f16x2 bf16 bf16x2 tf32 f32 f32x2 f64 "
    "e4m3 e5m2 e4m3x2 e5m2x2 e4m3x4 e5m2x4 e2m1x2 e2m1x4 e2m3x2 e3m2x2 e2m3x4 e3m2x4 ue8m0x2 f4e2m1 f6e2m3 "
    "f6e3m2 f8e4m3 f8e5m2 s4 u4".split()
)

U8, U16, U32, U64 = np.uint8, np.uint16, np.uint32, np.uint64
_UD = {8: U8, 16: U16, 32: U32, 64: U64}
_SD = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}
_INT_TYPES = {f"{k}{w}" for k in "ubs" for w in (8, 16, 32, 64)}
_ROUND = ("rn", "rz", "rm", "rp")
_IROUND = ("rni", "rzi", "rmi", "rpi")


def _unsup(op, mods, types, why=""):
    words = ".".join((op, *mods, *types))
    return Unsupported(f"alu: {words} is not implemented{': ' + why if why else ''}")



# ----------------------------------------------------------------------------------------------------------------
# Floating-point formats: decode to float64 (exact) and round float64 (+ residual sign) to the format's bits.
# ----------------------------------------------------------------------------------------------------------------


class _Fmt:
    __slots__ = ("name", "nbits", "m", "bias", "udt", "nan", "has_inf", "maxfin", "inf", "sign", "expmask")

    def __init__(self, name, nbits, m, bias, nan, has_inf, maxfin):
        self.name, self.nbits, self.m, self.bias = name, nbits, m, bias
        self.udt = _UD[nbits] if nbits in _UD else U32
        self.nan, self.has_inf, self.maxfin = nan, has_inf, maxfin
        self.inf = ((1 << (nbits - 1 - m)) - 1) << m if has_inf else None
        self.sign = 1 << (nbits - 1)
        self.expmask = ((1 << (nbits - 1 - m)) - 1) << m


_F32 = _Fmt("f32", 32, 23, 127, 0x7FFFFFFF, True, 0x7F7FFFFF)
_F16 = _Fmt("f16", 16, 10, 15, 0x7FFF, True, 0x7BFF)
_BF16 = _Fmt("bf16", 16, 7, 127, 0x7FFF, True, 0x7F7F)
_F64 = _Fmt("f64", 64, 52, 1023, 0x7FFFFFFFFFFFFFFF, True, 0x7FEFFFFFFFFFFFFF)
_E4M3 = _Fmt("e4m3", 8, 3, 7, 0x7F, False, 0x7E)  # OCP FP8 E4M3 (fn): no inf, S.1111.111 is NaN, max 448
_E5M2 = _Fmt("e5m2", 8, 2, 15, 0x7F, True, 0x7B)  # OCP FP8 E5M2: IEEE-like, max 57344
_TF32 = _Fmt("tf32", 19, 10, 127, 0x3FFFF, True, 0x3FBFF)  # f32 with 10 fraction bits; stored as bits << 13
_FMTS = {"f32": _F32, "f16": _F16, "bf16": _BF16, "f64": _F64, "e4m3": _E4M3, "e5m2": _E5M2}


def _fp8_table(fmt):
    out = np.empty(256, np.float64)
    m, bias = fmt.m, fmt.bias
    emax_field = (1 << (7 - m)) - 1
    for i in range(256):
        s, e, f = i >> 7, (i >> m) & emax_field, i & ((1 << m) - 1)
        if fmt is _E4M3 and e == emax_field and f == (1 << m) - 1:
            v = math.nan
        elif fmt is _E5M2 and e == emax_field:
            v = math.inf if f == 0 else math.nan
        elif e == 0:
            v = math.ldexp(f, 1 - bias - m)
        else:
            v = math.ldexp(f + (1 << m), e - bias - m)
        out[i] = -v if s else v
    return out


_FP8_F64 = {"e4m3": _fp8_table(_E4M3), "e5m2": _fp8_table(_E5M2)}


def _dec(bits, fmt):
    """Raw bits -> float64 values (exact for every format here)."""
    if fmt is _F32:
        return bits.view(np.float32).astype(np.float64)
    if fmt is _F64:
        return bits.view(np.float64)
    if fmt is _F16:
        return bits.view(np.float16).astype(np.float64)
    if fmt is _BF16:
        return (bits.astype(U32) << 16).view(np.float32).astype(np.float64)
    return _FP8_F64[fmt.name][bits]


def _flush(bits, fmt):
    """ftz: subnormal -> sign-preserving zero (PTX ISA 9.7.3 "Subnormal numbers")."""
    return np.where(bits & fmt.udt(fmt.expmask) == 0, bits & fmt.udt(fmt.sign), bits)


def _canon_nan(x64, bits, fmt):
    return np.where(np.isnan(x64), fmt.udt(fmt.nan), bits)


def _round(x, fmt, mode="rn", resid=None, satfinite=False):
    """Round float64 ``x`` to ``fmt`` bits under ``mode`` (rn ties-to-even, rna ties-away, rz, rm, rp).

    ``resid`` (optional, same shape) is the sign of (exact value - x) when x is itself a rounding of the exact result
    (from an error-free transformation or an exact rational); with it the final rounding is that of the exact value
    (the f64 rounding never crosses a point of the narrower format, so only ties and exact hits need the sign).
    Overflow follows IEEE 754 per mode (inf or max finite); ``satfinite`` clamps +-inf and overflow to +-max finite
    (PTX ISA 9.7.9.21 cvt, .satfinite).  NaN -> the format's canonical NaN.
    """
    x = np.asarray(x, np.float64)
    m, bias = fmt.m, fmt.bias
    neg = np.signbit(x)
    ax = np.abs(x)
    nan = np.isnan(x)
    inf = np.isinf(x)
    axf = np.where(nan | inf, 0.0, ax)
    _, e = np.frexp(axf)  # axf = f * 2**e, f in [0.5, 1); frexp(0) gives e = 0, so zeros take the subnormal quantum
    q = np.where(axf == 0, 1 - bias, np.maximum(e.astype(np.int64) - 1, 1 - bias)) - m
    scaled = np.ldexp(axf, (-q).astype(np.int32))
    nf = np.floor(scaled)
    frac = scaled - nf
    n = nf.astype(np.int64)
    if resid is None:
        rmag = np.zeros(x.shape, np.int8)
    else:
        r = np.sign(np.asarray(resid)).astype(np.int8)
        r = np.where(np.isnan(resid), 0, r) if np.asarray(resid).dtype.kind == "f" else r
        rmag = np.where(neg, -r, r)
    if mode == "rn":
        up = (frac > 0.5) | ((frac == 0.5) & ((rmag > 0) | ((rmag == 0) & ((n & 1) == 1))))
        down = np.zeros_like(up)
        away = True
    elif mode == "rna":
        up = (frac > 0.5) | ((frac == 0.5) & (rmag >= 0))
        down = np.zeros_like(up)
        away = True
    else:
        if mode == "rz":
            away = np.zeros(x.shape, bool)
        elif mode == "rp":
            away = ~neg
        elif mode == "rm":
            away = neg
        else:
            raise Unsupported(f"alu: rounding mode .{mode}")
        exact = frac == 0
        up = away & (~exact | (rmag > 0))
        down = ~away & exact & (rmag < 0)
    bits = ((q + (m + bias - 1)) << m) + n + up.astype(np.int64) - down.astype(np.int64)
    of = bits > fmt.maxfin
    if satfinite:
        big = np.int64(fmt.maxfin)
        bits = np.where(of | inf, big, bits)
    else:
        top = np.int64(fmt.inf if fmt.has_inf else fmt.nan)
        bits = np.where(of, np.where(away, top, np.int64(fmt.maxfin)), bits)
        bits = np.where(inf, top, bits)
    ub = bits.astype(np.uint64) | (neg.astype(np.uint64) << np.uint64(fmt.nbits - 1))
    ub = np.where(nan, np.uint64(fmt.nan), ub)
    return ub.astype(fmt.udt)


def _to_f32_rn(x64):
    r = x64.astype(np.float32)
    out = r.view(U32)
    np.putmask(out, r != r, _F32.nan)
    return out


_F32_MIN_NORMAL = np.float32(2.0**-126)


def _ftz32(f):
    """.ftz on float32 values: subnormals -> sign-preserving zero (x * False = +-0; NaN/inf/normal unchanged)."""
    return f * (np.abs(f) >= _F32_MIN_NORMAL)


def _f32_out(r, ftz):
    """float32 result -> bits with .ftz flush and canonical NaN."""
    if ftz:
        r = _ftz32(r)
    r = np.asarray(r)
    out = r.view(U32)
    np.putmask(out, r != r, _F32.nan)
    return out


def _bf16_rn_hi(b32):
    """f32 bits -> uint32 whose high 16 bits are the bf16 rounded to nearest even (bit trick: add 0x7FFF + lsb;
    overflow carries into inf; NaN -> 0x7FFF)."""
    r = b32 + ((b32 >> U32(16)) & U32(1))
    r += U32(0x7FFF)
    np.putmask(r, (b32 & U32(0x7FFFFFFF)) > U32(0x7F800000), 0x7FFF0000)
    return r


def _f32_to_bf16_rn(b32):
    """f32 bits -> bf16 bits, round to nearest even."""
    return (_bf16_rn_hi(b32) >> U32(16)).astype(U16)


def _encode(x64, fmt, mode="rn", resid=None, satfinite=False, relu=False, ftz=False):
    """float64 result (+ residual sign) -> bits of ``fmt``, with .relu / .satfinite / .ftz output rules."""
    if relu:  # PTX ISA: .relu clamps negative results to +0; NaN -> canonical NaN
        x64 = np.where(np.signbit(x64) & ~np.isnan(x64), 0.0, x64)
        if resid is not None:
            resid = np.where(x64 == 0, 0, resid)
    if resid is None and mode == "rn" and not satfinite:
        if fmt is _F32:
            out = _to_f32_rn(x64)
        elif fmt is _F16:
            out = np.where(np.isnan(x64), U16(_F16.nan), x64.astype(np.float16).view(U16))
        elif fmt is _F64:
            out = np.where(np.isnan(x64), U64(_F64.nan), x64.view(U64))
        else:
            out = _round(x64, fmt, mode, None, satfinite)
    elif fmt is _F64 and resid is None:
        out = np.where(np.isnan(x64), U64(_F64.nan), np.asarray(x64, np.float64).view(U64))
    else:
        out = _round(x64, fmt, mode, resid, satfinite)
    if ftz:
        out = _flush(out, fmt)
    return out


def _two_sum(a, b):
    """Knuth TwoSum in float64: s = fl(a+b), e = (a+b) - s exactly (no overflow here)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _odd_fix(s, e):
    """Round-to-odd sticky: where e != 0 and s is even, move s one f64 ulp toward s+e.  A following RNE rounding to
    any format with <= 51 significand bits is then the correct rounding of s+e."""
    sb = s.view(np.int64)
    pos, negv = e > 0, e < 0
    adj = (pos | negv) & ((sb & 1) == 0)
    step = np.where(pos == (s > 0), 1, -1)
    return (sb + adj * step).view(np.float64)


def _exact_lanes(fn, *xs, zero_float=False):
    """Slow exact path: per lane, fn(Fractions...) -> Fraction (or float for inf/nan); returns (f64 nearest, sign of
    exact - f64).  Non-finite inputs (and, with zero_float, zero inputs) use fn on Python floats, which is exact there;
    an exact zero result takes the sign of the float computation.  Used only by rare forms (f64 fma, directed-rounded
    add/sub/mul.f64, div, rcp, sqrt)."""
    shape = np.broadcast(*xs).shape
    xs = [np.broadcast_to(x, shape).ravel() for x in xs]
    n = xs[0].size
    out = np.empty(n, np.float64)
    res = np.zeros(n, np.int8)
    for i in range(n):
        vals = [float(x[i]) for x in xs]
        if not all(math.isfinite(v) for v in vals) or (zero_float and any(v == 0 for v in vals)):
            out[i] = fn(*vals)
            continue
        r = fn(*[Fraction(v) for v in vals])
        if isinstance(r, float):
            out[i] = r
            continue
        if r == 0:
            z = fn(*vals)
            out[i] = math.copysign(0.0, z) if z == z else 0.0
            continue
        try:
            f = float(r)
        except OverflowError:
            f = math.inf if r > 0 else -math.inf
        out[i] = f
        if math.isfinite(f):
            d = r - Fraction(f)
            res[i] = (d > 0) - (d < 0)
    return out.reshape(shape), res.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# mods parsing helpers
# ----------------------------------------------------------------------------------------------------------------


def _check(op, mods, types, allowed):
    bad = [m for m in mods if m not in allowed]
    if bad:
        raise _unsup(op, mods, types, "modifier " + ", ".join("." + b for b in bad))
    return set(mods)


def _rnd_of(ms, default=None, allowed=_ROUND):
    r = [m for m in ms if m in allowed]
    return r[0] if r else default


def _packed(fn, inner_bits, nsrc_packed):
    """Lift a scalar raw-bit function to the two-element packed form (f16x2/bf16x2 in 32 bits, f32x2 in 64 bits).
    Element 0 is the low half (PTX ISA 5.2.5 "Packed data types")."""
    inner, outer = _UD[inner_bits], _UD[2 * inner_bits]
    sh, mask = outer(inner_bits), outer((1 << inner_bits) - 1)

    def run(srcs):
        lo = [(s & mask).astype(inner) if i < nsrc_packed else s for i, s in enumerate(srcs)]
        hi = [(s >> sh).astype(inner) if i < nsrc_packed else s for i, s in enumerate(srcs)]
        return (fn(hi).astype(outer) << sh) | fn(lo).astype(outer)

    return run


_FLOAT_ELEM = {"f32": ("f32", 1), "f64": ("f64", 1), "f16": ("f16", 1), "bf16": ("bf16", 1),
               "f16x2": ("f16", 2), "bf16x2": ("bf16", 2), "f32x2": ("f32", 2)}


# ----------------------------------------------------------------------------------------------------------------
# Floating-point arithmetic: add sub mul fma mad (PTX ISA 9.7.3 floating-point, 9.7.4 half precision)
# ----------------------------------------------------------------------------------------------------------------


def _float_arith(op, mods, types):
    """PTX ISA 9.7.3.1 add / 9.7.3.2 sub / 9.7.3.3 mul / 9.7.3.4 fma / 9.7.3.5 mad (floating point), 9.7.4.1-4 (half
    precision add/sub/mul/fma), sm_100 packed f32x2 and mixed f32.{f16,bf16} forms.

    Computes the exact result and rounds it once with the instruction's mode: f32 add/sub/mul rn in float32 (IEEE,
    exact rounding), otherwise in float64 (products of <= 24-bit significands exact) with a TwoSum residual so that
    fma and directed modes round the exact value; f64 fma by exact rationals per lane (slow, rare).  .ftz flushes
    subnormal f32/f16 inputs and results to sign-preserving zero; .sat clamps to [0, 1] (NaN -> +0); .relu clamps
    negatives to +0.  NaN results are the canonical NaN (f32 0x7FFFFFFF, f16/bf16 0x7FFF).
    Note: without a rounding modifier ptxas may contract mul+add into fma; we round each instruction (rn).
    """
    t = types[0]
    if t not in _FLOAT_ELEM:
        raise _unsup(op, mods, types)
    ename, npk = _FLOAT_ELEM[t]
    fmt = _FMTS[ename]
    ms = _check(op, mods, types, {"rn", "rz", "rm", "rp", "ftz", "sat", "relu", "oob"})
    if "oob" in ms:
        raise _unsup(op, mods, types, ".oob")
    rnd = _rnd_of(ms)
    if rnd is None:
        if op in ("fma", "mad"):
            raise _unsup(op, mods, types, "fma/mad.f* needs a rounding modifier")
        rnd = "rn"
    ftz, sat, relu = "ftz" in ms, "sat" in ms, "relu" in ms
    nin = 3 if op in ("fma", "mad") else 2
    # mixed-precision forms add.f32.bf16 d, a, c / fma.f32.f16 d, a, b, c (sm_100): a (and b) in the narrow type
    in_fmts = [fmt] * nin
    if len(types) == 2:
        if t != "f32" or types[1] not in ("f16", "bf16"):
            raise _unsup(op, mods, types)
        in_fmts = [_FMTS[types[1]]] * (nin - 1) + [_F32]
    elif len(types) != 1:
        raise _unsup(op, mods, types)

    def prep(srcs):
        xs = []
        for s, f in zip(srcs, in_fmts):
            if ftz and f in (_F32, _F16):
                s = _flush(s, f)
            xs.append(s)
        return xs

    if fmt is _F32 and rnd == "rn" and op in ("add", "sub", "mul") and len(types) == 1 and not relu:
        uf = {"add": np.add, "sub": np.subtract, "mul": np.multiply}[op]

        def scal(srcs):
            fa, fb = srcs[0].view(np.float32), srcs[1].view(np.float32)
            if ftz:
                fa, fb = _ftz32(fa), _ftz32(fb)
            r = uf(fa, fb)
            if sat:
                r = np.where(r > 0, np.minimum(r, np.float32(1)), np.float32(0))
            return _f32_out(r, ftz)
    elif fmt is _F32 and rnd == "rn" and op in ("fma", "mad") and len(types) == 1 and not relu and not sat:
        tie_mask, tie_val = np.int64((1 << 29) - 1), np.int64(1 << 28)

        def scal(srcs):
            fa, fb, fc = (x.view(np.float32) for x in srcs)
            if ftz:
                fa, fb, fc = _ftz32(fa), _ftz32(fb), _ftz32(fc)
            p = fa.astype(np.float64) * fb.astype(np.float64)  # exact
            c = fc.astype(np.float64)
            s = p + c
            # double rounding can only go wrong when s lands exactly on an f32 tie (or in the f32 subnormal range)
            risky = ((s.view(np.int64) & tie_mask) == tie_val) | ((np.abs(s) < 2.0**-125) & (s != 0))
            if risky.any():
                s2, e = _two_sum(p, c)
                s = _odd_fix(s2, e)
            return _f32_out(s.astype(np.float32), ftz)
    elif fmt is _F64 and op in ("fma", "mad"):
        def scal(srcs):
            a, b, c = (s.view(np.float64) for s in srcs)
            x, res = _exact_lanes(lambda p, q, r: p * q + r, a, b, c)
            return _encode(x, _F64, rnd, res)
    elif fmt is _F64 and rnd != "rn":
        def scal(srcs):
            a, b = (s.view(np.float64) for s in srcs)
            fn = {"add": lambda p, q: p + q, "sub": lambda p, q: p - q, "mul": lambda p, q: p * q}[op]
            x, res = _exact_lanes(fn, a, b)
            return _encode(x, _F64, rnd, res)
    elif fmt is _F64:
        def scal(srcs):
            a, b = (s.view(np.float64) for s in srcs)
            r = a + b if op == "add" else (a - b if op == "sub" else a * b)
            return np.where(np.isnan(r), U64(_F64.nan), r.view(U64))
    else:
        def scal(srcs):
            xs = prep(srcs)
            v = [_dec(s, f) for s, f in zip(xs, in_fmts)]
            if op == "mul":
                s, e = v[0] * v[1], None
            elif op in ("add", "sub"):
                s, e = _two_sum(v[0], v[1] if op == "add" else -v[1])
            else:
                s, e = _two_sum(v[0] * v[1], v[2])
            if rnd == "rm" and op != "mul":
                # IEEE 754 6.3: an exact zero sum is -0 under roundTowardNegative unless both terms are +0
                t0 = v[0] * v[1] if op == "fma" else v[0]
                t1 = v[2] if op == "fma" else (v[1] if op == "add" else -v[1])
                both_pos0 = (t0 == 0) & (t1 == 0) & ~np.signbit(t0) & ~np.signbit(t1)
                s = np.where((s == 0) & ~both_pos0, -0.0, s)
            if sat:
                s = np.where(s > 0, np.minimum(s, 1.0), 0.0)
                e = None if e is None else np.where((s > 0) & (s < 1), e, 0.0)
            if rnd == "rn" and e is not None and not relu:
                s, e = _odd_fix(s, e), None
            return _encode(s, fmt, rnd, e, relu=relu, ftz=ftz and fmt in (_F32, _F16))

    fn = _packed(scal, fmt.nbits, 3) if npk == 2 else scal
    return _quiet(fn)


# ----------------------------------------------------------------------------------------------------------------
# div / rcp / sqrt / rsqrt / transcendental approximations (PTX ISA 9.7.3.8-9.7.3.22)
# ----------------------------------------------------------------------------------------------------------------


def _float_unary_exact(op, mods, types):
    """PTX ISA 9.7.3.8 div (float), 9.7.3.13 rcp, 9.7.3.15 sqrt, 9.7.3.16 rsqrt, 9.7.3.17 sin, 9.7.3.18 cos,
    9.7.3.19 lg2, 9.7.3.20 ex2, 9.7.3.21 tanh; 9.7.4.x ex2/tanh half precision.

    IEEE forms (.rn/.rz/.rm/.rp) are correctly rounded: rn via float64 (a single f32 division/sqrt in float64 and one
    more rounding is innocuous: 53 >= 2*24+2), directed modes via exact rationals per lane.
    .approx/.full forms: we return the float64 result of the exact function rounded once to the destination (error
    <= 0.5 ulp + the float64 error of numpy's exp2/log2/sin/cos/tanh, ~1e-16 relative), inside every ISA bound:
    div.approx.f32 2 ulp for |b| in [2^-126, 2^126] (for larger |b| the ISA returns 0, NaN if a is inf: mimicked),
    div.full.f32 2 ulp, rcp.approx.f32 1 ulp, sqrt.approx.f32 / rsqrt.approx.f32 relative 2^-23 / 2^-22.9,
    ex2.approx.f32 2 ulp, lg2.approx.f32 absolute 2^-22.6 (in [0.5, 2]), sin/cos.approx.f32 absolute 2^-20.9 in
    [-pi, pi], tanh.approx.f32 relative 2^-11, ex2/tanh .f16/.bf16 (x2) relative ~2^-9.9 / 2^-7.
    The GPU's own approximations differ in the last bits: results are not bit-exact against hardware.
    """
    t = types[0]
    if len(types) != 1 or t not in _FLOAT_ELEM:
        raise _unsup(op, mods, types)
    ename, npk = _FLOAT_ELEM[t]
    fmt = _FMTS[ename]
    ms = _check(op, mods, types, {"rn", "rz", "rm", "rp", "approx", "full", "ftz"})
    rnd = _rnd_of(ms)
    kind = "approx" if "approx" in ms else ("full" if "full" in ms else ("ieee" if rnd else None))
    if kind is None or (kind != "ieee" and rnd) or ("approx" in ms and "full" in ms):
        raise _unsup(op, mods, types, "needs exactly one of .approx/.full/.rnd")
    ftz = "ftz" in ms
    # (op, type) -> the kinds the ISA allows and whether .ftz may appear
    allowed = {
        ("div", "f32"): {"approx", "full", "ieee"}, ("div", "f64"): {"ieee"},
        ("rcp", "f32"): {"approx", "ieee"}, ("rcp", "f64"): {"ieee"},
        ("sqrt", "f32"): {"approx", "ieee"}, ("sqrt", "f64"): {"ieee"},
        ("rsqrt", "f32"): {"approx"}, ("rsqrt", "f64"): {"approx"},
        ("ex2", "f32"): {"approx"}, ("ex2", "f16"): {"approx"}, ("ex2", "f16x2"): {"approx"},
        ("ex2", "bf16"): {"approx"}, ("ex2", "bf16x2"): {"approx"},
        ("lg2", "f32"): {"approx"}, ("sin", "f32"): {"approx"}, ("cos", "f32"): {"approx"},
        ("tanh", "f32"): {"approx"}, ("tanh", "f16"): {"approx"}, ("tanh", "f16x2"): {"approx"},
        ("tanh", "bf16"): {"approx"}, ("tanh", "bf16x2"): {"approx"},
    }.get((op, t), set())
    if kind not in allowed:
        raise _unsup(op, mods, types)
    if ftz and t not in ("f32", "bf16", "bf16x2"):
        raise _unsup(op, mods, types, ".ftz")
    if op == "ex2" and fmt is _BF16 and not ftz:
        raise _unsup(op, mods, types, "ex2.approx.bf16 is .ftz only")
    if ftz and fmt is _BF16 and op != "ex2":
        raise _unsup(op, mods, types, ".ftz")

    fn64 = {
        "div": lambda a, b: a / b,
        "rcp": lambda a: 1.0 / a,
        "sqrt": np.sqrt,
        "rsqrt": lambda a: 1.0 / np.sqrt(a),
        "ex2": np.exp2,
        "lg2": np.log2,
        "sin": np.sin,
        "cos": np.cos,
        "tanh": np.tanh,
    }[op]
    nin = 2 if op == "div" else 1
    directed = kind == "ieee" and rnd != "rn"

    def exact_div(a, b):
        if b == 0:
            return math.nan if (a == 0 or a != a) else math.copysign(math.inf, a) * math.copysign(1.0, b)
        return a / b

    def exact_rcp(a):
        return exact_div(1.0 if isinstance(a, float) else Fraction(1), a)

    def exact_sqrt(a):
        if isinstance(a, float):
            return math.nan if a < 0 else math.sqrt(a)
        if a < 0:
            return math.nan
        r = math.sqrt(a)  # float; sign(sqrt(a) - r) = sign(a - r*r) for r >= 0
        d = a - Fraction(r) ** 2
        return r if d == 0 else Fraction(r) + (Fraction(1, 2**1100) if d > 0 else -Fraction(1, 2**1100))

    exact = {"div": exact_div, "rcp": exact_rcp, "sqrt": exact_sqrt}.get(op)

    if fmt is _F32 and not directed and op != "div":
        def scal32(srcs):
            a = srcs[0].view(np.float32)
            if ftz:
                a = _ftz32(a)
            return _f32_out(fn64(a.astype(np.float64)).astype(np.float32), ftz)

        return _quiet(scal32)

    def scal(srcs):
        xs = [(_flush(s, fmt) if ftz else s) for s in srcs[:nin]]
        v = [_dec(s, fmt) for s in xs]
        if directed:
            x, res = _exact_lanes(exact, *v, zero_float=True)
            return _encode(x, fmt, rnd, res, ftz=ftz)
        r = fn64(*v)
        if op == "div" and kind == "approx":
            ab = np.abs(v[1])
            big = (ab > 2.0**126) & np.isfinite(ab)
            r = np.where(big, np.where(np.isinf(v[0]), np.nan, 0.0 * np.sign(v[0]) * np.sign(v[1])), r)
        return _encode(r, fmt, "rn", None, ftz=ftz)

    fn = _packed(scal, fmt.nbits, 1) if npk == 2 else scal
    return _quiet(fn)


# ----------------------------------------------------------------------------------------------------------------
# abs / neg / min / max / copysign / testp (floating point)
# ----------------------------------------------------------------------------------------------------------------


def _float_absneg(op, mods, types):
    """PTX ISA 9.7.3.6 abs / 9.7.3.7 neg (float), 9.7.4.5-6 half: clear / flip the sign bit (NaN too); .ftz first
    flushes a subnormal input to sign-preserving zero."""
    ename, npk = _FLOAT_ELEM[types[0]]
    fmt = _FMTS[ename]
    ms = _check(op, mods, types, {"ftz"})
    ftz = "ftz" in ms
    sign = fmt.udt(fmt.sign)

    def scal(srcs):
        a = _flush(srcs[0], fmt) if ftz else srcs[0]
        return a & ~sign if op == "abs" else a ^ sign

    return _packed(scal, fmt.nbits, 1) if npk == 2 else scal


def _float_minmax(op, mods, types):
    """PTX ISA 9.7.3.10 min / 9.7.3.11 max (float), 9.7.4.10-11 (half precision).

    NaN: if both are NaN -> canonical NaN; with .NaN any NaN input -> canonical NaN; else the non-NaN input.
    Signed zeros: -0.0 is treated as smaller than +0.0.  .xorsign.abs: compare |a|, |b| and give the result the
    sign a.sign ^ b.sign (not for NaN).  Three inputs (PTX 8.8, .f32): min(min(a, b), c) with the same rules, .abs
    applying to every input.  .ftz flushes subnormal inputs first.  The result is an input's bits (no rounding).
    """
    ename, npk = _FLOAT_ELEM[types[0]]
    fmt = _FMTS[ename]
    ms = _check(op, mods, types, {"ftz", "NaN", "xorsign", "abs"})
    ftz, nanp, xs, ab = "ftz" in ms, "NaN" in ms, "xorsign" in ms, "abs" in ms
    if xs != ab and not (ab and fmt is _F32):
        raise _unsup(op, mods, types, ".xorsign goes with .abs")
    if fmt is _F64 and ms:
        raise _unsup(op, mods, types)
    sign = fmt.udt(fmt.sign)
    canon = fmt.udt(fmt.nan)
    is_min = op == "min"

    def two(a, b):
        fa, fb = _dec(a, fmt), _dec(b, fmt)
        na, nb = np.isnan(fa), np.isnan(fb)
        if is_min:
            take_a = (fa < fb) | ((fa == fb) & ((a & sign) != 0))
        else:
            take_a = (fa > fb) | ((fa == fb) & ((a & sign) == 0))
        d = np.where(take_a, a, b)
        d = np.where(na, b, d)
        d = np.where(nb, a, d)
        d = np.where(na & nb, canon, d)
        if nanp:
            d = np.where(na | nb, canon, d)
        return d

    if fmt in (_F32, _F64) and not xs and not ab:
        fdt = np.float32 if fmt is _F32 else np.float64
        uf = (np.minimum if is_min else np.maximum) if nanp else (np.fmin if is_min else np.fmax)
        zbits = np.bitwise_or if is_min else np.bitwise_and  # both zeros: min is -0 if either is, max only if both

        def fast(srcs):
            fs = [x.view(fdt) for x in srcs]
            if ftz:
                fs = [_ftz32(f) for f in fs]
            r = uf(fs[0], fs[1])
            out = r.view(fmt.udt)
            z = (fs[0] == 0) & (fs[1] == 0)
            if z.any():
                np.putmask(out, z, zbits(fs[0].view(fmt.udt), fs[1].view(fmt.udt)))
            if len(fs) == 3:
                r2 = uf(r, fs[2])
                out2 = r2.view(fmt.udt)
                z = (r == 0) & (fs[2] == 0)
                if z.any():
                    np.putmask(out2, z, zbits(out, fs[2].view(fmt.udt)))
                r, out = r2, out2
            np.putmask(out, r != r, fmt.nan)
            return out

        return _quiet(fast)

    def scal(srcs):
        vals = [(_flush(s, fmt) if ftz else s) for s in srcs]
        if xs:
            sg = (vals[0] ^ vals[1]) & sign
        if ab:
            vals = [v & ~sign for v in vals]
        d = two(vals[0], vals[1])
        if len(vals) == 3:
            d = two(d, vals[2])
        if xs:
            d = np.where(np.isnan(_dec(d, fmt)), d, (d & ~sign) | sg)
        return d

    return _packed(scal, fmt.nbits, 3) if npk == 2 else scal


def _b_copysign(op, mods, types):
    """PTX ISA 9.7.3.9 copysign: d = b with the sign bit of a."""
    _check(op, mods, types, set())
    if types[0] not in ("f32", "f64"):
        raise _unsup(op, mods, types)
    fmt = _FMTS[types[0]]
    s = fmt.udt(fmt.sign)
    return lambda srcs: (srcs[1] & ~s) | (srcs[0] & s)


def _b_testp(op, mods, types):
    """PTX ISA 9.7.3.12 testp: finite / infinite / number / notanumber / normal / subnormal (zeros count as normal)."""
    if len(mods) != 1 or types[0] not in ("f32", "f64"):
        raise _unsup(op, mods, types)
    fmt = _FMTS[types[0]]
    em, mm = fmt.udt(fmt.expmask), fmt.udt((1 << fmt.m) - 1)
    k = mods[0]

    def fn(srcs):
        a = srcs[0]
        e, f = a & em, a & mm
        if k == "finite":
            return e != em
        if k == "infinite":
            return (e == em) & (f == 0)
        if k == "number":
            return ~((e == em) & (f != 0))
        if k == "notanumber":
            return (e == em) & (f != 0)
        if k == "normal":
            return ((e != em) & (e != 0)) | ((e == 0) & (f == 0))
        return (e == 0) & (f != 0)

    if k not in ("finite", "infinite", "number", "notanumber", "normal", "subnormal"):
        raise _unsup(op, mods, types)
    return fn


# ----------------------------------------------------------------------------------------------------------------
# Integer arithmetic (PTX ISA 9.7.1)
# ----------------------------------------------------------------------------------------------------------------


def _int_info(t):
    if t not in _INT_TYPES:
        return None
    w = int(t[1:])
    return w, t[0] == "s", _UD[w], _SD[w]


def _split16x2(fn16, signed):
    def run(srcs):
        lo = [(s & U32(0xFFFF)).astype(U16) for s in srcs]
        hi = [(s >> U32(16)).astype(U16) for s in srcs]
        return (fn16(hi).astype(U32) << U32(16)) | fn16(lo).astype(U32)

    return run


def _int_addsub(op, mods, types):
    """PTX ISA 9.7.1.1 add / 9.7.1.2 sub (integer), 9.7.1.17-20 add.cc/addc/sub.cc/subc: wrap-around; .sat (s32)
    clamps to [INT_MIN, INT_MAX]; u16x2/s16x2 work per half word; carry/borrow in and out as bool arrays."""
    t = types[0]
    ms = _check(op, mods, types, {"sat", "cc"})
    if t in ("u16x2", "s16x2"):
        if ms:
            raise _unsup(op, mods, types)
        f = (lambda s: s[0] + s[1]) if op == "add" else (lambda s: s[0] - s[1])
        return _split16x2(f, t[0] == "s")
    info = _int_info(t)
    if info is None:
        raise _unsup(op, mods, types)
    w, signed, ud, sd = info
    base = op[:3]
    carry_in = op in ("addc", "subc")
    cc = "cc" in ms
    if "sat" in ms:
        if t != "s32" or cc or carry_in:
            raise _unsup(op, mods, types)

        def sat(srcs):
            a, b = (s.view(np.int32).astype(np.int64) for s in srcs)
            r = a + b if base == "add" else a - b
            return np.clip(r, -(2**31), 2**31 - 1).astype(np.int32).view(U32)

        return sat
    if (cc or carry_in) and w not in (32, 64):
        raise _unsup(op, mods, types)

    def fn(srcs):
        a, b = srcs[0], srcs[1]
        cin = srcs[2].astype(ud) if carry_in else None
        if base == "add":
            s1 = a + b
            d = s1 + cin if carry_in else s1
            if not cc:
                return d
            c = s1 < a
            if carry_in:
                c = c | (d < s1)
            return d, c
        s1 = a - b
        d = s1 - cin if carry_in else s1
        if not cc:
            return d
        bo = a < b
        if carry_in:
            bo = bo | (s1 < cin)
        return d, bo

    return fn


def _mul_parts(a, b, w, signed):
    """Full 2w-bit product of w-bit raw values -> (hi, lo) raw w-bit arrays."""
    ud = _UD[w]
    if w <= 32:
        if signed:
            p = a.view(_SD[w]).astype(np.int64) * b.view(_SD[w]).astype(np.int64)
            p = p.view(U64)
        else:
            p = a.astype(U64) * b.astype(U64)
        return (p >> U64(w)).astype(ud), p.astype(ud)
    M = U64(0xFFFFFFFF)
    a0, a1, b0, b1 = a & M, a >> U64(32), b & M, b >> U64(32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> U64(32)) + (p01 & M) + (p10 & M)
    hi = p11 + (p01 >> U64(32)) + (p10 >> U64(32)) + (mid >> U64(32))
    lo = a * b
    if signed:
        hi = hi - np.where(a >> U64(63) != 0, b, U64(0)) - np.where(b >> U64(63) != 0, a, U64(0))
    return hi, lo


def _int_mul(op, mods, types):
    """PTX ISA 9.7.1.3 mul / 9.7.1.4 mad (integer), 9.7.1.21 mad.cc / madc: .lo (low w bits), .hi (high w bits of the
    2w-bit product), .wide (2w-bit product, w = 16 or 32); mad adds c (2w bits for .wide) with wrap-around;
    mad.hi.sat.s32 clamps (hi + c) to s32; carry out/in for mad{c}.{hi,lo}.cc on 32/64-bit types."""
    t = types[0]
    info = _int_info(t)
    if info is None or t[0] == "b":
        raise _unsup(op, mods, types)
    w, signed, ud, sd = info
    ms = _check(op, mods, types, {"lo", "hi", "wide", "sat", "cc"})
    half = [m for m in ("lo", "hi", "wide") if m in ms]
    if len(half) != 1:
        raise _unsup(op, mods, types, "needs one of .lo/.hi/.wide")
    half = half[0]
    is_mad = op in ("mad", "madc")
    carry_in, cc = op == "madc", "cc" in ms
    if half == "wide" and w not in (16, 32):
        raise _unsup(op, mods, types)
    if (cc or carry_in) and (half == "wide" or w not in (32, 64)):
        raise _unsup(op, mods, types)
    if "sat" in ms and not (op == "mad" and half == "hi" and t == "s32"):
        raise _unsup(op, mods, types)
    wd = _UD[2 * w] if half == "wide" else ud
    if half == "lo" and not (cc or carry_in):
        if not is_mad:
            return lambda s: s[0] * s[1]
        return lambda s: s[0] * s[1] + s[2]

    def fn(srcs):
        a, b = srcs[0], srcs[1]
        if half == "wide":
            if signed:
                p = (a.view(sd).astype(np.int64) * b.view(sd).astype(np.int64)).view(U64).astype(wd)
            else:
                p = a.astype(U64) * b.astype(U64)
                p = p.astype(wd)
        else:
            hi, lo = _mul_parts(a, b, w, signed)
            p = hi if half == "hi" else lo
        if not is_mad:
            return p
        c = srcs[2]
        if "sat" in ms:
            r = p.view(np.int32).astype(np.int64) + c.view(np.int32).astype(np.int64)
            return np.clip(r, -(2**31), 2**31 - 1).astype(np.int32).view(U32)
        d = p + c
        if carry_in:
            cin = srcs[3].astype(wd)
            d2 = d + cin
            if cc:
                return d2, (d < p) | (d2 < d)
            return d2
        if cc:
            return d, d < p
        return d

    return fn


def _int_mul24(op, mods, types):
    """PTX ISA 9.7.1.5 mul24 / 9.7.1.6 mad24: product of the low 24 bits (sign-extended for .s32) as a 48-bit value;
    .lo gives bits 31..0, .hi bits 47..16; mad24 adds c (wrap-around)."""
    t = types[0]
    ms = _check(op, mods, types, {"lo", "hi"})
    if t not in ("u32", "s32") or len(ms) != 1:
        raise _unsup(op, mods, types)

    def fn(srcs):
        a, b = (s & U32(0xFFFFFF) for s in srcs[:2])
        a, b = a.astype(np.int64), b.astype(np.int64)
        if t == "s32":
            a = np.where(a >= 2**23, a - 2**24, a)
            b = np.where(b >= 2**23, b - 2**24, b)
        p = (a * b).view(U64)
        r = (p >> U64(16)) if "hi" in ms else p
        r = r.astype(U32)
        return r + srcs[2] if op == "mad24" else r

    return fn


def _int_divrem(op, mods, types):
    """PTX ISA 9.7.1.8 div / 9.7.1.9 rem (integer): quotient truncated toward zero, remainder with the dividend's sign
    (C semantics), INT_MIN / -1 wraps to INT_MIN.  Division by zero is machine-specific in the ISA: we return all ones
    for the quotient and the dividend for the remainder (what the hardware does for unsigned division)."""
    info = _int_info(types[0])
    _check(op, mods, types, set())
    if info is None or types[0][0] == "b":
        raise _unsup(op, mods, types)
    w, signed, ud, sd = info

    def fn(srcs):
        a, b = srcs[0].astype(U64), srcs[1].astype(U64)
        if signed:
            sa = srcs[0].view(sd).astype(np.int64)
            sb = srcs[1].view(sd).astype(np.int64)
            na, nb = sa < 0, sb < 0
            ma = np.where(na, (~sa.view(U64)) + U64(1), sa.view(U64))
            mb = np.where(nb, (~sb.view(U64)) + U64(1), sb.view(U64))
        else:
            na = nb = False
            ma, mb = a, b
        zero = mb == 0
        mbs = np.where(zero, U64(1), mb)
        if op == "div":
            qm = ma // mbs
            q = np.where(np.logical_xor(na, nb), (~qm) + U64(1), qm)
            return np.where(zero, ud(~ud(0)), q.astype(ud))
        rm = ma % mbs
        r = np.where(na, (~rm) + U64(1), rm)
        return np.where(zero, srcs[0], r.astype(ud))

    return fn


def _int_absneg(op, mods, types):
    """PTX ISA 9.7.1.10 abs / 9.7.1.11 neg (integer): two's complement, INT_MIN maps to itself."""
    info = _int_info(types[0])
    _check(op, mods, types, set())
    if info is None or not info[1]:
        raise _unsup(op, mods, types)
    w, signed, ud, sd = info
    if op == "neg":
        return lambda srcs: (~srcs[0]) + ud(1)
    return lambda srcs: np.where(srcs[0].view(sd) < 0, (~srcs[0]) + ud(1), srcs[0])


def _int_minmax(op, mods, types):
    """PTX ISA 9.7.1.12 min / 9.7.1.13 max (integer): signed or unsigned compare; u16x2/s16x2 per half word; .relu
    (s32, s16x2) clamps the result at 0."""
    t = types[0]
    ms = _check(op, mods, types, {"relu"})
    relu = "relu" in ms
    if relu and t not in ("s32", "s16x2"):
        raise _unsup(op, mods, types)
    packed = t in ("u16x2", "s16x2")
    info = _int_info(t[:3]) if packed else _int_info(t)
    if info is None:
        raise _unsup(op, mods, types)
    w, signed, ud, sd = info
    f = np.minimum if op == "min" else np.maximum

    def scal(srcs):
        if signed:
            r = f(srcs[0].view(sd), srcs[1].view(sd))
            if relu:
                r = np.maximum(r, sd(0))
            return r.view(ud)
        return f(srcs[0], srcs[1])

    return _split16x2(scal, signed) if packed else scal


# ----------------------------------------------------------------------------------------------------------------
# Bit manipulation (PTX ISA 9.7.1.14-16, 9.7.8 logic and shift)
# ----------------------------------------------------------------------------------------------------------------


def _bitw(t):
    if t in _INT_TYPES:
        return int(t[1:])
    raise KeyError(t)


_BREV8 = np.array([int(f"{i:08b}"[::-1], 2) for i in range(256)], np.uint64)


def _b_logic(op, mods, types):
    """PTX ISA 9.7.8.1 and / 9.7.8.2 or / 9.7.8.3 xor / 9.7.8.4 not / 9.7.8.5 cnot: bitwise on b16/b32/b64 (and
    .pred as booleans); cnot d = (a == 0) ? 1 : 0."""
    _check(op, mods, types, set())
    t = types[0]
    if t != "pred" and t not in _INT_TYPES:
        raise _unsup(op, mods, types)
    if op == "and":
        return lambda s: s[0] & s[1]
    if op == "or":
        return lambda s: s[0] | s[1]
    if op == "xor":
        return lambda s: s[0] ^ s[1]
    if op == "not":
        return lambda s: ~s[0]
    if t == "pred":
        raise _unsup(op, mods, types)
    ud = _UD[_bitw(t)]
    return lambda s: (s[0] == 0).astype(ud)


def _b_shift(op, mods, types):
    """PTX ISA 9.7.8.7 shl / 9.7.8.8 shr: the shift amount is an unsigned 32-bit value; amounts >= the width give 0
    (shl, shr.u/.b) or the replicated sign (shr.s)."""
    _check(op, mods, types, set())
    t = types[0]
    if t not in _INT_TYPES or (op == "shl" and t[0] == "s"):
        raise _unsup(op, mods, types)
    w = _bitw(t)
    ud, sd = _UD[w], _SD[w]
    wu = U32(w)
    if t[0] == "s":
        return lambda s: (s[0].view(sd) >> np.minimum(s[1], U32(w - 1)).astype(ud).view(sd)).view(ud)
    uf = np.left_shift if op == "shl" else np.right_shift

    def sh(s):
        a, n = s
        if n.ndim == 0:
            return uf(a, ud(n)) if n < wu else np.zeros_like(a)
        return uf(a, (n & U32(w - 1)).astype(ud)) * (n < wu)

    return sh


def _b_shf(op, mods, types):
    """PTX ISA 9.7.8.6 shf: funnel shift of the 64-bit {b, a}; n = min(c, 32) (.clamp) or c & 31 (.wrap); .l keeps
    the upper 32 bits of ({b,a} << n), .r the lower 32 bits of ({b,a} >> n)."""
    ms = _check(op, mods, types, {"l", "r", "wrap", "clamp"})
    if types != ("b32",) or len(ms & {"l", "r"}) != 1 or len(ms & {"wrap", "clamp"}) != 1:
        raise _unsup(op, mods, types)
    left, clamp = "l" in ms, "clamp" in ms

    def fn(s):
        a, b, c = s
        n = np.minimum(c, U32(32)) if clamp else c & U32(31)
        v = (b.astype(U64) << U64(32)) | a.astype(U64)
        n = n.astype(U64)
        return ((v << n) >> U64(32)).astype(U32) if left else (v >> n).astype(U32)

    return fn


def _b_bfe(op, mods, types):
    """PTX ISA 9.7.1.15 bfe: pos = b & 0xff, len = c & 0xff; bits [pos, pos+len) of a, zero-extended (.u) or extended
    with the field's sign bit a[min(pos+len-1, msb)] (.s; len 0 gives 0)."""
    _check(op, mods, types, set())
    t = types[0]
    if t not in ("u32", "u64", "s32", "s64"):
        raise _unsup(op, mods, types)
    w = _bitw(t)
    ud = _UD[w]
    signed = t[0] == "s"

    def fn(s):
        a = s[0].astype(U64)
        pos = (s[1] & U32(0xFF)).astype(np.int64)
        ln = (s[2] & U32(0xFF)).astype(np.int64)
        nb = np.clip(np.minimum(ln, w - pos), 0, w)  # bits really taken from a
        sh = np.minimum(pos, w - 1).astype(U64)
        field = np.where(pos >= w, U64(0), a >> sh)
        mask = np.where(nb >= 64, ~U64(0), (U64(1) << np.minimum(nb, 63).astype(U64)) - U64(1))
        field = field & mask
        if signed:
            sbit_pos = np.minimum(pos + ln - 1, w - 1).astype(U64)
            sbit = ((a >> sbit_pos) & U64(1)).astype(bool) & (ln != 0)
            field = np.where(sbit, field | ~mask, field)
        return field.astype(ud)

    return fn


def _b_bfi(op, mods, types):
    """PTX ISA 9.7.1.16 bfi: d = b with bits [pos, pos+len) replaced by the low bits of f (bits past the msb
    dropped); pos = c & 0xff, len = d & 0xff (srcs f, b, pos, len)."""
    _check(op, mods, types, set())
    t = types[0]
    if t not in ("b32", "b64"):
        raise _unsup(op, mods, types)
    w = _bitw(t)
    ud = _UD[w]

    def fn(s):
        f, b = s[0].astype(U64), s[1].astype(U64)
        pos = (s[2] & U32(0xFF)).astype(np.int64)
        ln = (s[3] & U32(0xFF)).astype(np.int64)
        nb = np.clip(np.minimum(ln, w - pos), 0, w)
        mask = np.where(nb >= 64, ~U64(0), (U64(1) << np.minimum(nb, 63).astype(U64)) - U64(1))
        sh = np.minimum(pos, w - 1).astype(U64)
        m = np.where(nb == 0, U64(0), mask << sh)
        return ((b & ~m) | ((f << sh) & m)).astype(ud)

    return fn


def _bitlen(x, w):
    """Number of significant bits of unsigned x (0 for 0)."""
    if w <= 32:
        return np.frexp(x.astype(np.float64))[1].astype(np.int64)
    hi = (x >> U64(32)).astype(U32)
    lo = (x & U64(0xFFFFFFFF)).astype(U32)
    return np.where(hi != 0, _bitlen(hi, 32) + 32, _bitlen(lo, 32))


def _b_bitcount(op, mods, types):
    """PTX ISA 9.7.1.14 popc / clz / bfind / brev (9.7.1.x): popc and clz return u32; bfind returns the position of
    the most significant non-sign bit (0xffffffff if none; .shiftamt: msb - position); brev reverses the bits."""
    ms = _check(op, mods, types, {"shiftamt"} if op == "bfind" else set())
    t = types[0]
    if t not in _INT_TYPES:
        raise _unsup(op, mods, types)
    w = _bitw(t)
    ud, sd = _UD[w], _SD[w]
    if op == "popc":
        if t not in ("b32", "b64"):
            raise _unsup(op, mods, types)
        return lambda s: np.bitwise_count(s[0]).astype(U32)
    if op == "clz":
        if t not in ("b32", "b64"):
            raise _unsup(op, mods, types)
        return lambda s: (w - _bitlen(s[0], w)).astype(U32)
    if op == "brev":
        if t not in ("b32", "b64"):
            raise _unsup(op, mods, types)

        def brev(s):
            x = s[0].astype(U64)
            r = np.zeros(x.shape, U64)
            for k in range(w // 8):
                r |= _BREV8[(x >> U64(8 * k)) & U64(0xFF)] << U64(w - 8 - 8 * k)
            return r.astype(ud)

        return brev
    if op == "bfind":
        if t not in ("u32", "u64", "s32", "s64"):
            raise _unsup(op, mods, types)
        shamt = "shiftamt" in ms

        def bfind(s):
            x = s[0]
            if t[0] == "s":
                x = np.where(x.view(sd) < 0, ~x, x)
            p = _bitlen(x, w) - 1
            r = np.where(p < 0, 0xFFFFFFFF, (w - 1 - p) if shamt else p)
            return r.astype(U32)

        return bfind
    raise _unsup(op, mods, types)


_PRMT_MODES = {  # PTX ISA 9.7.8.9 prmt: source byte for d.b0..d.b3, by c[1:0]
    "f4e": ((0, 1, 2, 3), (1, 2, 3, 4), (2, 3, 4, 5), (3, 4, 5, 6)),
    "b4e": ((0, 7, 6, 5), (1, 0, 7, 6), (2, 1, 0, 7), (3, 2, 1, 0)),
    "rc8": ((0, 0, 0, 0), (1, 1, 1, 1), (2, 2, 2, 2), (3, 3, 3, 3)),
    "ecl": ((0, 1, 2, 3), (1, 1, 2, 3), (2, 2, 2, 3), (3, 3, 3, 3)),
    "ecr": ((0, 0, 0, 0), (0, 1, 1, 1), (0, 1, 2, 2), (0, 1, 2, 3)),
    "rc16": ((0, 1, 0, 1), (2, 3, 2, 3), (0, 1, 0, 1), (2, 3, 2, 3)),
}
_PRMT_TABLES = {k: np.array(v, np.uint64) for k, v in _PRMT_MODES.items()}


def _b_prmt(op, mods, types):
    """PTX ISA 9.7.8.9 prmt: bytes {b, a} = b7..b4 b3..b0.  Generic form: selector nibble k of c picks byte (sel & 7)
    for d.b[k]; sel & 8 replicates that byte's sign bit.  Modes f4e/b4e/rc8/ecl/ecr/rc16 use c[1:0] and the ISA's
    byte table."""
    ms = _check(op, mods, types, set(_PRMT_MODES))
    if types != ("b32",) or len(ms) > 1:
        raise _unsup(op, mods, types)
    mode = next(iter(ms)) if ms else None

    def uniform(a, b, cv):
        v = (b.astype(U64) << U64(32)) | a.astype(U64)
        if mode is None:
            sels = [(cv >> (4 * k)) & 0xF for k in range(4)]
        else:
            sels = list(_PRMT_MODES[mode][cv & 3])
        d = None
        for k, sel in enumerate(sels):
            byte = (v >> U64(8 * (sel & 7))) & U64(0xFF)
            if sel & 8:
                byte = (byte >> U64(7)) * U64(0xFF)
            byte = byte << U64(8 * k) if k else byte
            d = byte if d is None else d | byte
        return d.astype(U32)

    def fn(s):
        a, b, c = s
        if c.ndim == 0:
            return uniform(a, b, int(c))
        if c.size and (c == c.flat[0]).all():
            return uniform(a, b, int(c.flat[0]))
        v = (b.astype(U64) << U64(32)) | a.astype(U64)
        c = c.astype(U64)
        d = np.zeros(np.broadcast(a, b, c).shape, U64)
        if mode is None:
            for k in range(4):
                sel = (c >> U64(4 * k)) & U64(0xF)
                byte = (v >> ((sel & U64(7)) * U64(8))) & U64(0xFF)
                byte = np.where((sel & U64(8)) != 0, np.where((byte & U64(0x80)) != 0, U64(0xFF), U64(0)), byte)
                d |= byte << U64(8 * k)
        else:
            tab = _PRMT_TABLES[mode][(c & U64(3)).astype(np.intp)]
            for k in range(4):
                d |= ((v >> (tab[..., k] * U64(8))) & U64(0xFF)) << U64(8 * k)
        return d.astype(U32)

    return fn


def _b_lop3(op, mods, types):
    """PTX ISA 9.7.8.10 lop3: d = F(a, b, c) with F's truth table in immLut (bit (a<<2|b<<1|c) of the lut, a = 0xF0,
    b = 0xCC, c = 0xAA); .and/.or also give p = (d != 0) BoolOp q."""
    ms = _check(op, mods, types, {"and", "or"})
    if types != ("b32",):
        raise _unsup(op, mods, types)
    boolop = next(iter(ms)) if ms else None

    def fn(s):
        a, b, c, lut = s[0], s[1], s[2], s[3]
        lut = np.asarray(lut)
        if lut.ndim == 0 or np.all(lut == lut.flat[0]):
            lv = int(lut.flat[0])
            d = np.zeros(np.broadcast(a, b, c).shape, U32)
            for i in range(8):
                if lv >> i & 1:
                    d |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
        else:
            d = np.zeros(np.broadcast(a, b, c, lut).shape, U32)
            for i in range(8):
                on = ((lut >> U32(i)) & U32(1)).astype(bool)
                d |= np.where(on, (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c), U32(0))
        if boolop is None:
            return d
        q = s[4]
        return d, ((d != 0) & q) if boolop == "and" else ((d != 0) | q)

    return fn


# ----------------------------------------------------------------------------------------------------------------
# Compare and select (PTX ISA 9.7.7)
# ----------------------------------------------------------------------------------------------------------------

_CMPS = {"eq", "ne", "lt", "le", "gt", "ge", "lo", "ls", "hi", "hs", "equ", "neu", "ltu", "leu", "gtu", "geu",
         "num", "nan"}
_BOOLOPS = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}


def _cmp_fn(cmp, t, ftz):
    """t = a op b as a bool array (PTX ISA 9.3.1 comparisons: ordered compares are false on NaN, the u forms true)."""
    base = {"lo": "lt", "ls": "le", "hi": "gt", "hs": "ge"}.get(cmp, cmp)
    if t in _FLOAT_ELEM and _FLOAT_ELEM[t][1] == 1:
        fmt = _FMTS[t]
        if cmp in ("lo", "ls", "hi", "hs"):
            raise KeyError(cmp)

        def vals(a, b):
            if ftz:
                a, b = _flush(a, fmt), _flush(b, fmt)
            if fmt is _F32:
                return a.view(np.float32), b.view(np.float32)
            if fmt is _F64:
                return a.view(np.float64), b.view(np.float64)
            return _dec(a, fmt), _dec(b, fmt)

        unordered = cmp.endswith("u") and cmp not in ("num",)
        core = base[:-1] if unordered else base
        npf = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
               "ge": np.greater_equal}

        if cmp == "num":
            return lambda a, b: (lambda x, y: ~(np.isnan(x) | np.isnan(y)))(*vals(a, b))
        if cmp == "nan":
            return lambda a, b: (lambda x, y: np.isnan(x) | np.isnan(y))(*vals(a, b))
        f = npf[core]
        if unordered:
            if core == "ne":
                return lambda a, b: f(*vals(a, b))  # numpy's != is already true on NaN
            return lambda a, b: (lambda x, y: f(x, y) | np.isnan(x) | np.isnan(y))(*vals(a, b))
        if core == "ne":
            return lambda a, b: (lambda x, y: (x != y) & ~np.isnan(x) & ~np.isnan(y))(*vals(a, b))
        return lambda a, b: f(*vals(a, b))
    if t not in _INT_TYPES or ftz or base not in ("eq", "ne", "lt", "le", "gt", "ge"):
        raise KeyError(cmp)
    w = _bitw(t)
    signed = t[0] == "s" and cmp not in ("lo", "ls", "hi", "hs")
    sd = _SD[w]
    f = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal, "gt": np.greater,
         "ge": np.greater_equal}[base]
    if signed and base not in ("eq", "ne"):
        return lambda a, b: f(a.view(sd), b.view(sd))
    return f


def _b_setp(op, mods, types):
    """PTX ISA 9.7.7.3 setp (and 9.7.4.7 for f16/bf16/x2): t = a CmpOp b; p = BoolOp(t, c), q = BoolOp(!t, c)
    (without BoolOp p = t, q = !t).  Returns (p, q).  Half x2: p from the low halves, q from the high halves.
    .ftz flushes subnormal f32/f16 inputs."""
    cmps = [m for m in mods if m in _CMPS]
    bo = [m for m in mods if m in _BOOLOPS]
    rest = [m for m in mods if m not in _CMPS and m not in _BOOLOPS and m != "ftz"]
    if len(cmps) != 1 or len(bo) > 1 or rest or len(types) != 1:
        raise _unsup(op, mods, types)
    ftz = "ftz" in mods
    t = types[0]
    packed = t in ("f16x2", "bf16x2")
    try:
        f = _cmp_fn(cmps[0], t[:-2] if packed else t, ftz)
    except KeyError:
        raise _unsup(op, mods, types) from None
    bop = _BOOLOPS[bo[0]] if bo else None
    if packed:
        def fn(s):
            a, b = s[0], s[1]
            tl = f((a & U32(0xFFFF)).astype(U16), (b & U32(0xFFFF)).astype(U16))
            th = f((a >> U32(16)).astype(U16), (b >> U32(16)).astype(U16))
            if bop is None:
                return tl, th
            return bop(tl, s[2]), bop(th, s[2])
    else:
        def fn(s):
            tt = f(s[0], s[1])
            if bop is None:
                return tt, ~tt
            return bop(tt, s[2]), bop(~tt, s[2])

    return _quiet(fn)


def _b_set(op, mods, types):
    """PTX ISA 9.7.7.2 set: like setp, the boolean result written as 1.0f (f32 dtype) or 0xffffffff (u32/s32),
    else 0.  (set.*.f16x2/bf16x2 destinations are not implemented.)"""
    cmps = [m for m in mods if m in _CMPS]
    bo = [m for m in mods if m in _BOOLOPS]
    rest = [m for m in mods if m not in _CMPS and m not in _BOOLOPS and m != "ftz"]
    if len(cmps) != 1 or len(bo) > 1 or rest or len(types) != 2 or types[0] not in ("u32", "s32", "f32"):
        raise _unsup(op, mods, types)
    try:
        f = _cmp_fn(cmps[0], types[1], "ftz" in mods)
    except KeyError:
        raise _unsup(op, mods, types) from None
    bop = _BOOLOPS[bo[0]] if bo else None
    one = U32(0x3F800000) if types[0] == "f32" else U32(0xFFFFFFFF)

    def fn(s):
        tt = f(s[0], s[1])
        if bop is not None:
            tt = bop(tt, s[2])
        return np.where(tt, one, U32(0))

    return _quiet(fn)


def _b_selp(op, mods, types):
    """PTX ISA 9.7.7.4 selp: d = c ? a : b (any 16/32/64-bit type)."""
    _check(op, mods, types, set())
    return lambda s: np.where(s[2], s[0], s[1])


def _b_slct(op, mods, types):
    """PTX ISA 9.7.7.5 slct: d = (c >= 0) ? a : b with c s32 or f32 (NaN c selects b; .ftz flushes a subnormal c)."""
    ms = _check(op, mods, types, {"ftz"})
    if len(types) != 2 or types[1] not in ("s32", "f32"):
        raise _unsup(op, mods, types)
    if types[1] == "s32":
        return lambda s: np.where(s[2].view(np.int32) >= 0, s[0], s[1])
    ftz = "ftz" in ms
    return _quiet(lambda s: np.where((_flush(s[2], _F32) if ftz else s[2]).view(np.float32) >= 0, s[0], s[1]))


# ----------------------------------------------------------------------------------------------------------------
# cvt (PTX ISA 9.7.9.21)
# ----------------------------------------------------------------------------------------------------------------

_F8 = {"e4m3x2": _E4M3, "e5m2x2": _E5M2}


def _int_to_f64(x, t):
    """Integer raw bits -> (float64 nearest, sign(exact - f64)) ."""
    w, signed, ud, sd = _int_info(t)
    if w < 64:
        v = x.view(sd).astype(np.float64) if signed else x.astype(np.float64)
        return v, None
    if signed:
        iv = x.view(np.int64)
        f = iv.astype(np.float64)
        big = f >= 2.0**63
        back = np.where(big, np.int64(2**63 - 1), f.astype(np.int64))
        res = np.where(big, -1, np.sign(iv - back))  # iv - back is exact: |iv - back| < 2^11
        return f, res
    f = x.astype(np.float64)
    big = f >= 2.0**64
    back = np.where(big, U64(2**64 - 1), f.astype(U64))
    res = np.where(big, -1, np.where(x > back, 1, np.where(x < back, -1, 0)))
    return f, res


def _b_cvt(op, mods, types):
    """PTX ISA 9.7.9.21 cvt.

    int <-> int: truncate or sign/zero-extend; .sat clamps to the destination range.
    float -> int: .rni/.rzi/.rmi/.rpi rounding (required), NaN -> 0, saturating to the destination range (always,
      the ISA says float-to-int saturates by default).
    int -> float: exact value rounded once (.rn default, .rz/.rm/.rp).
    float -> float: widening is exact; narrowing rounds once with .rn/.rz/.rm/.rp (.rna for tf32); .satfinite clamps
      inf/overflow to max finite (NaN stays NaN); .relu clamps negatives to +0; .ftz flushes subnormal f32
      inputs/results; same-size .rni/.rzi/.rmi/.rpi round to an integral value; f32.f32 with .sat clamps to [0, 1].
    packed: f16x2/bf16x2 <- f32 a, b with a in bits 31..16; e4m3x2/e5m2x2 <- f32 a, b (a in bits 15..8,
      always satfinite) or <- f16x2 (high half -> high byte); f16x2 <- e4m3x2/e5m2x2 (high byte -> high half).
    FP8 follows OCP OFP8: e4m3 has no inf (0x7F/0xFF NaN, max 448), e5m2 is IEEE-like (max 57344).
    """
    if len(types) != 2:
        raise _unsup(op, mods, types)
    dt, st = types
    ms = _check(op, mods, types, {"rn", "rz", "rm", "rp", "rna", "rni", "rzi", "rmi", "rpi", "ftz", "sat",
                                  "satfinite", "relu"})
    frnd = _rnd_of(ms, None, ("rn", "rz", "rm", "rp", "rna"))
    irnd = _rnd_of(ms, None, _IROUND)
    ftz, sat, satf, relu = "ftz" in ms, "sat" in ms, "satfinite" in ms, "relu" in ms
    if frnd and irnd:
        raise _unsup(op, mods, types)
    d_int, s_int = _int_info(dt), _int_info(st)

    # ---- int -> int
    if d_int and s_int:
        if frnd or irnd or ftz or satf or relu:
            raise _unsup(op, mods, types)
        dw, dsg, dud, dsd = d_int
        sw, ssg, sud, ssd = s_int

        def i2i(s):
            x = s[0].astype(sud)
            if ssg:
                v = x.view(ssd).astype(np.int64)
                if sat:
                    lo, hi = (-(2 ** (dw - 1)), 2 ** (dw - 1) - 1) if dsg else (0, min(2**dw - 1, 2**63 - 1))
                    v = np.clip(v, lo, hi)
                return v.view(U64).astype(dud)
            v = x.astype(U64)
            if sat:
                hi = 2 ** (dw - 1) - 1 if dsg else 2**dw - 1
                v = np.minimum(v, U64(hi))
            return v.astype(dud)

        return i2i

    # ---- float -> int
    if d_int and st in _FMTS and st not in ("e4m3", "e5m2"):
        sf = _FMTS[st]
        if irnd is None or frnd or satf or relu:
            raise _unsup(op, mods, types, "float-to-int cvt needs .rni/.rzi/.rmi/.rpi")
        dw, dsg, dud, dsd = d_int
        rf = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[irnd]
        lo, hi = (-(2.0 ** (dw - 1)), 2.0 ** (dw - 1)) if dsg else (0.0, 2.0**dw)

        def f2i(s):
            x = _dec(_flush(s[0], sf) if ftz and sf is _F32 else s[0], sf)
            r = rf(x)
            r = np.where(np.isnan(r), 0.0, r)
            r = np.clip(r, lo, hi)
            top = r >= hi  # hi itself is one past the range
            if dsg:
                v = np.where(top, np.int64(2 ** (dw - 1) - 1), r.astype(np.int64))
                return v.view(U64).astype(dud)
            v = np.where(top, U64(2**dw - 1), np.where(top, 0.0, r).astype(U64))
            return v.astype(dud)

        return _quiet(f2i)

    # ---- int -> float
    if s_int and dt in _FMTS and dt not in ("e4m3", "e5m2"):
        df = _FMTS[dt]
        if irnd or satf or relu or sat:
            raise _unsup(op, mods, types)
        mode = frnd or "rn"

        def i2f(s):
            x, res = _int_to_f64(s[0].astype(_UD[s_int[0]]), st)
            if df is _F64 and res is not None and mode == "rn":
                res = None
            if df is _F32 and res is None and mode == "rn":
                return _to_f32_rn(x)
            return _encode(x, df, mode, res, ftz=ftz and df is _F32)

        return _quiet(i2f)

    # ---- float -> float (scalar)
    if dt in _FMTS and st in _FMTS and dt not in ("e4m3", "e5m2") and st not in ("e4m3", "e5m2"):
        df, sf = _FMTS[dt], _FMTS[st]
        narrowing = (df.m < sf.m) or (df.bias < sf.bias)
        if irnd:
            if df is not sf or frnd or satf or relu:
                raise _unsup(op, mods, types)
            rf = {"rni": np.rint, "rzi": np.trunc, "rmi": np.floor, "rpi": np.ceil}[irnd]

            def rint(s):
                a = _flush(s[0], sf) if ftz and sf in (_F32, _F16) else s[0]
                r = rf(_dec(a, sf))
                out = _encode(r, df, "rn")
                out = np.where(np.isnan(_dec(a, sf)), df.udt(df.nan), out)
                if sat:
                    out = _encode(np.where(r > 0, np.minimum(r, 1.0), 0.0), df, "rn")
                return out

            return _quiet(rint)
        if narrowing and frnd is None:
            raise _unsup(op, mods, types, "narrowing float cvt needs a rounding modifier")
        if frnd == "rna" and dt != "tf32":
            raise _unsup(op, mods, types)
        mode = frnd or "rn"
        fast_bf16 = df is _BF16 and sf is _F32 and mode == "rn" and not (satf or relu or sat or ftz)

        widen = not narrowing and not sat and not satf and not relu

        def f2f(s):
            a = s[0]
            if fast_bf16:
                return _f32_to_bf16_rn(a)
            if widen:  # exact; NaN payloads carried over as the hardware's bit moves do
                if sf is _BF16 and df is _F32:
                    out = a.astype(U32) << U32(16)
                elif df is _F32:
                    out = _dec(a, sf).astype(np.float32).view(U32)
                elif df is _F64:
                    out = (_flush(a, sf) if ftz and sf is _F32 else a).view(np.float32).astype(np.float64).view(U64) \
                        if sf is _F32 else _dec(a, sf).view(U64).copy()
                else:
                    out = _encode(_dec(a, sf), df, "rn")
                return _flush(out, df) if ftz and df is _F32 else out
            if ftz and sf is _F32:
                a = _flush(a, sf)
            x = _dec(a, sf)
            if sat:
                x = np.where(x > 0, np.minimum(x, 1.0), 0.0)
            return _encode(x, df, mode, None, satfinite=satf, relu=relu, ftz=ftz and df is _F32)

        return _quiet(f2f)

    # ---- tf32
    if dt == "tf32" and st == "f32":
        if frnd not in ("rna", "rn", "rz") or sat or ftz:
            raise _unsup(op, mods, types)

        def tf32(s):
            x = _dec(s[0], _F32)
            if relu:
                x = np.where(np.signbit(x) & ~np.isnan(x), 0.0, x)
            r = _round(x, _TF32, frnd, None, satf).astype(U32)
            return np.where(np.isnan(x), U32(0x7FFFFFFF), r << U32(13))

        return _quiet(tf32)

    # ---- packed: f16x2 / bf16x2 <- f32, f32
    if dt in ("f16x2", "bf16x2") and st == "f32":
        df = _F16 if dt == "f16x2" else _BF16
        if frnd not in ("rn", "rz") or irnd or sat or ftz:
            raise _unsup(op, mods, types)
        fast = df is _BF16 and frnd == "rn" and not (satf or relu)

        if fast:
            def pack2f(s):
                hi = _bf16_rn_hi(s[0])
                hi &= U32(0xFFFF0000)
                hi |= _bf16_rn_hi(s[1]) >> U32(16)
                return hi

            return pack2f

        def pack2(s):
            hi = _encode(_dec(s[0], _F32), df, frnd, None, satfinite=satf, relu=relu)
            lo = _encode(_dec(s[1], _F32), df, frnd, None, satfinite=satf, relu=relu)
            return (hi.astype(U32) << U32(16)) | lo.astype(U32)

        return _quiet(pack2)

    # ---- packed fp8 <- f32, f32 / f16x2
    if dt in _F8 and st in ("f32", "f16x2"):
        df = _F8[dt]
        if frnd != "rn" or not satf or irnd or sat or ftz:
            raise _unsup(op, mods, types, "cvt to fp8 is .rn.satfinite{.relu}")

        def packf8(s):
            if st == "f32":
                xh, xl = _dec(s[0], _F32), _dec(s[1], _F32)
            else:
                xh = _dec((s[0] >> U32(16)).astype(U16), _F16)
                xl = _dec((s[0] & U32(0xFFFF)).astype(U16), _F16)
            xh, xl = np.broadcast_arrays(xh, xl)
            both = _encode(np.stack([xh, xl]), df, "rn", None, satfinite=True, relu=relu).astype(U16)
            return (both[0] << U16(8)) | both[1]

        return _quiet(packf8)

    # ---- f16x2 <- fp8x2
    if dt == "f16x2" and st in _F8:
        sf = _F8[st]
        if frnd != "rn" or irnd or sat or satf or ftz:
            raise _unsup(op, mods, types)
        table = _FP8_F64[sf.name]
        if relu:
            table = np.where(np.signbit(table) & ~np.isnan(table), 0.0, table)
        t16 = np.where(np.isnan(table), U16(0x7FFF), table.astype(np.float16).view(U16)).astype(U32)

        def unpackf8(s):
            a = s[0].astype(U32)
            return (t16[(a >> U32(8)) & U32(0xFF)] << U32(16)) | t16[a & U32(0xFF)]

        return _quiet(unpackf8)

    raise _unsup(op, mods, types)


# ----------------------------------------------------------------------------------------------------------------
# dispatch
# ----------------------------------------------------------------------------------------------------------------


def _is_float(types):
    return bool(types) and types[0] in _FLOAT_ELEM


def _b_addsub(op, mods, types):
    if op in ("add", "sub") and _is_float(types):
        return _float_arith(op, mods, types)
    return _int_addsub(op, mods, types)


def _b_mul(op, mods, types):
    if op == "mul" and _is_float(types):
        return _float_arith(op, mods, types)
    if op == "mad" and _is_float(types):
        return _float_arith(op, mods, types)
    return _int_mul(op, mods, types)


def _b_div(op, mods, types):
    if _is_float(types):
        return _float_unary_exact(op, mods, types)
    return _int_divrem(op, mods, types)


def _b_absneg(op, mods, types):
    if _is_float(types):
        return _float_absneg(op, mods, types)
    return _int_absneg(op, mods, types)


def _b_minmax(op, mods, types):
    if _is_float(types):
        return _float_minmax(op, mods, types)
    return _int_minmax(op, mods, types)


def _b_fma(op, mods, types):
    if not _is_float(types):
        raise _unsup(op, mods, types)
    return _float_arith(op, mods, types)


def _b_unary(op, mods, types):
    return _float_unary_exact(op, mods, types)


_BUILDERS: dict[str, Callable] = {
    "add": _b_addsub, "sub": _b_addsub, "addc": _int_addsub, "subc": _int_addsub,
    "mul": _b_mul, "mad": _b_mul, "madc": _int_mul, "fma": _b_fma,
    "mul24": _int_mul24, "mad24": _int_mul24,
    "div": _b_div, "rem": _int_divrem,
    "abs": _b_absneg, "neg": _b_absneg, "min": _b_minmax, "max": _b_minmax,
    "copysign": _b_copysign, "testp": _b_testp,
    "rcp": _b_unary, "sqrt": _b_unary, "rsqrt": _b_unary, "ex2": _b_unary, "lg2": _b_unary,
    "sin": _b_unary, "cos": _b_unary, "tanh": _b_unary,
    "and": _b_logic, "or": _b_logic, "xor": _b_logic, "not": _b_logic, "cnot": _b_logic,
    "shl": _b_shift, "shr": _b_shift, "shf": _b_shf,
    "bfe": _b_bfe, "bfi": _b_bfi, "popc": _b_bitcount, "clz": _b_bitcount, "bfind": _b_bitcount,
    "brev": _b_bitcount, "prmt": _b_prmt, "lop3": _b_lop3,
    "setp": _b_setp, "set": _b_set, "selp": _b_selp, "slct": _b_slct,
    "cvt": _b_cvt,
}

OPS = frozenset(_BUILDERS)


_QUIET = True


def _quiet(fn):  # noqa: F811 - the dispatch decides at compile time whether to wrap
    if not _QUIET:
        return fn

    @functools.wraps(fn)
    def wrapped(srcs):
        with np.errstate(all="ignore"):
            return fn(srcs)

    return wrapped


@functools.lru_cache(maxsize=None)
def _compile(op, mods, types, quiet=True):
    global _QUIET
    b = _BUILDERS.get(op)
    if b is None or not types:
        raise _unsup(op, mods, types)
    _QUIET = quiet
    try:
        return b(op, mods, types)
    finally:
        _QUIET = True


def compile(op: str, mods: tuple[str, ...], types: tuple[str, ...], quiet: bool = True) -> Callable:  # noqa: A001
    """Resolve one static instruction to ``fn(srcs) -> bits | tuple``; raises Unsupported for forms not implemented.

    quiet=True wraps float forms in ``np.errstate(all="ignore")`` (~1 us a call); a caller that runs its whole loop
    under ``np.errstate(all="ignore")`` can pass quiet=False."""
    return _compile(op, tuple(mods), tuple(types), quiet)


def evaluate(op: str, mods: tuple[str, ...], types: tuple[str, ...], srcs: list[np.ndarray]):
    """``compile(op, mods, types)(srcs)``."""
    return _compile(op, tuple(mods), tuple(types))(srcs)
