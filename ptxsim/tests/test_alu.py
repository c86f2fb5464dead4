"""ptxsim.alu against independent computations: Python ints, exact rationals (Fraction) with a separate rounding
routine whose encoding goes through struct / torch, numpy/torch float ops, math."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from ptxsim import alu
from ptxsim.errors import Unsupported

pytestmark = pytest.mark.sim

RNG = np.random.default_rng(1234)
U32, U64, U16 = np.uint32, np.uint64, np.uint16


def ev(op, mods, types, *srcs):
    return alu.evaluate(op, tuple(mods), tuple(types), list(srcs))


# ---------------------------------------------------------------------------------------------------------------
# helpers: float bits <-> python values, an exact reference rounding
# ---------------------------------------------------------------------------------------------------------------


def f32b(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bf32(b):
    return struct.unpack("<f", struct.pack("<I", int(b)))[0]


def f16b(x):
    return struct.unpack("<H", struct.pack("<e", x))[0]


def bf16v(b):  # f16 bits -> float
    return struct.unpack("<e", struct.pack("<H", int(b)))[0]


def bfloat16v(b):
    return bf32(int(b) << 16)


FMT = {  # name: (fraction bits, bias, max finite value, has inf)
    "f32": (23, 127, (2 - 2.0**-23) * 2.0**127, True),
    "f16": (10, 15, 65504.0, True),
    "bf16": (7, 127, (2 - 2.0**-7) * 2.0**127, True),
    "e4m3": (3, 7, 448.0, False),
    "e5m2": (2, 15, 57344.0, True),
}


def encode_value(v, fmt):
    """A value exactly representable in fmt (or +-inf / nan) -> bits, through struct / torch (not the code under
    test)."""
    if fmt == "f32":
        return f32b(v)
    if fmt == "f16":
        return f16b(v)
    if fmt == "bf16":
        if math.isnan(v):
            return 0x7FFF
        b = f32b(v)
        assert b & 0xFFFF == 0
        return b >> 16
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    if math.isnan(v):
        return 0x7F
    return int(torch.tensor([v], dtype=torch.float64).to(dt).view(torch.uint8)[0])


def ref_round(x, fmt, mode, satfinite=False):
    """Exact value x (Fraction, or float inf/nan/signed zero) -> bits of fmt rounded with mode (IEEE 754)."""
    m, bias, maxv, has_inf = FMT[fmt]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        if math.isnan(x):
            return {"f32": 0x7FFFFFFF, "f16": 0x7FFF, "bf16": 0x7FFF, "e4m3": 0x7F, "e5m2": 0x7F}[fmt]
        v = math.copysign(maxv, x) if (satfinite or not has_inf) else x
        return encode_value(v, fmt)
    if isinstance(x, float) and x == 0:
        return encode_value(x, fmt)
    x = Fraction(x)
    neg = x < 0
    a = -x if neg else x
    if a == 0:
        return encode_value(-0.0 if neg else 0.0, fmt)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if Fraction(2) ** e > a:
        e -= 1
    q = max(e, 1 - bias) - m
    scaled = a / Fraction(2) ** q
    n = math.floor(scaled)
    rem = scaled - n
    away = {"rn": None, "rz": False, "rp": not neg, "rm": neg}[mode]
    if mode == "rn":
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
            n += 1
    elif away and rem > 0:
        n += 1
    v = Fraction(n) * Fraction(2) ** q
    if v > Fraction(maxv):
        if satfinite or not has_inf:
            v = Fraction(maxv)
        elif mode == "rn" or away:
            return encode_value(-math.inf if neg else math.inf, fmt)
        else:
            v = Fraction(maxv)
    fv = float(v)
    return encode_value(-fv if neg else fv, fmt)


F32_EDGE = [0.0, -0.0, 1.0, -1.0, 1.5, 2.0**-149, -(2.0**-149), 2.0**-126, 2.0**-127 * 1.5, 3.4028234663852886e38,
            -3.4028234663852886e38, math.inf, -math.inf, math.nan, 1e-30, 1e30, 0.1, 1 / 3, 16777217.0, 2.0**100]


def rand_f32(n, wide=True):
    """Random f32 bit patterns: mostly ordinary magnitudes, some anywhere (incl. subnormals/inf/nan), plus edges."""
    e = np.array([f32b(v) for v in F32_EDGE], np.uint32)
    ordinary = (RNG.standard_normal(n) * np.exp2(RNG.integers(-20, 20, n))).astype(np.float32).view(U32)
    anyb = RNG.integers(0, 2**32, n, dtype=np.uint64).astype(U32)
    return np.concatenate([e, ordinary, anyb if wide else ordinary])


def fr(b, fmt="f32"):
    """bits -> Fraction or special float."""
    v = {"f32": bf32, "f16": bf16v, "bf16": bfloat16v}[fmt](b)
    if math.isnan(v) or math.isinf(v) or v == 0:
        return v
    return Fraction(v)


def exact_op(op, mode, *vals):
    """IEEE 754 result of op on float inputs: a Fraction when finite and nonzero, else a float (inf/nan/signed 0)."""
    fl = [float(v) for v in vals]
    if not all(math.isfinite(v) for v in fl):
        if op == "add":
            return fl[0] + fl[1]
        if op == "sub":
            return fl[0] - fl[1]
        if op == "mul":
            return fl[0] * fl[1]
        p = fl[0] * fl[1] if not ((fl[0] == 0 and math.isinf(fl[1])) or (fl[1] == 0 and math.isinf(fl[0]))) else math.nan
        return p + fl[2]
    F = [Fraction(v) for v in fl]
    sg = [math.copysign(1.0, v) < 0 for v in fl]
    if op == "mul":
        r = F[0] * F[1]
        zero_sign = sg[0] != sg[1]
    else:
        if op == "fma":
            t0, t0neg = F[0] * F[1], sg[0] != sg[1]
            t1, t1neg = F[2], sg[2]
        else:
            t0, t0neg = F[0], sg[0]
            t1, t1neg = (F[1], sg[1]) if op == "add" else (-F[1], not sg[1])
        r = t0 + t1
        if t0 == 0 and t1 == 0 and t0neg == t1neg:
            zero_sign = t0neg
        else:
            zero_sign = mode == "rm"
    if r != 0:
        return r
    return -0.0 if zero_sign else 0.0


# ---------------------------------------------------------------------------------------------------------------
# integers
# ---------------------------------------------------------------------------------------------------------------

I32_EDGE = [0, 1, 2, 31, 32, 40, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 0x12345678, 0x80000001]


def rand_u32(n=64):
    return np.concatenate([np.array(I32_EDGE, U32), RNG.integers(0, 2**32, n, dtype=np.uint64).astype(U32)])


def rand_u64(n=64):
    edge = [0, 1, 2**63, 2**63 - 1, 2**64 - 1, 2**32, 2**32 - 1]
    return np.concatenate([np.array(edge, U64), RNG.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)])


def s(v, w):
    v &= (1 << w) - 1
    return v - (1 << w) if v >> (w - 1) else v


def pairs(x):
    a = x
    b = np.roll(x, 7)
    return a, b


@pytest.mark.parametrize("t", ["u32", "s32", "u64", "s64", "u16", "s16"])
def test_int_add_sub_mul(t):
    w = int(t[1:])
    x = rand_u64() if w == 64 else rand_u32()
    x = x.astype(np.dtype(f"uint{w}"))
    a, b = pairs(x)
    M = (1 << w) - 1
    sg = t[0] == "s"
    A = [s(int(v), w) if sg else int(v) for v in a]
    B = [s(int(v), w) if sg else int(v) for v in b]
    assert [int(v) for v in ev("add", (), (t,), a, b)] == [(p + q) & M for p, q in zip(A, B)]
    assert [int(v) for v in ev("sub", (), (t,), a, b)] == [(p - q) & M for p, q in zip(A, B)]
    assert [int(v) for v in ev("mul", ("lo",), (t,), a, b)] == [(p * q) & M for p, q in zip(A, B)]
    assert [int(v) for v in ev("mul", ("hi",), (t,), a, b)] == [((p * q) >> w) & M for p, q in zip(A, B)]
    c = np.roll(x, 3)
    C = [int(v) for v in c]
    assert [int(v) for v in ev("mad", ("lo",), (t,), a, b, c)] == [(p * q + r) & M for p, q, r in zip(A, B, C)]
    assert [int(v) for v in ev("mad", ("hi",), (t,), a, b, c)] == [(((p * q) >> w) + r) & M
                                                                   for p, q, r in zip(A, B, C)]
    if w in (16, 32):
        M2 = (1 << 2 * w) - 1
        assert [int(v) for v in ev("mul", ("wide",), (t,), a, b)] == [(p * q) & M2 for p, q in zip(A, B)]


def test_add_sat_and_16x2():
    a, b = pairs(rand_u32())
    got = ev("add", ("sat",), ("s32",), a, b)
    exp = [max(-(2**31), min(2**31 - 1, s(int(p), 32) + s(int(q), 32))) & 0xFFFFFFFF for p, q in zip(a, b)]
    assert [int(v) for v in got] == exp
    got = ev("add", (), ("u16x2",), a, b)
    exp = [(((int(p) >> 16) + (int(q) >> 16)) & 0xFFFF) << 16 | ((int(p) + int(q)) & 0xFFFF) for p, q in zip(a, b)]
    assert [int(v) for v in got] == exp
    got = ev("max", (), ("s16x2",), a, b)
    exp = []
    for p, q in zip(a, b):
        hi = max(s(int(p) >> 16, 16), s(int(q) >> 16, 16)) & 0xFFFF
        lo = max(s(int(p), 16), s(int(q), 16)) & 0xFFFF
        exp.append(hi << 16 | lo)
    assert [int(v) for v in got] == exp


def test_carry_chain_128bit_add_and_sub():
    x, y = rand_u64(40), np.roll(rand_u64(40), 5)
    for op, opc, pyop in (("add", "addc", lambda p, q: p + q), ("sub", "subc", lambda p, q: p - q)):
        lo, cf = ev(op, ("cc",), ("u32",), (x & U64(0xFFFFFFFF)).astype(U32), (y & U64(0xFFFFFFFF)).astype(U32))
        hi, cf2 = ev(opc, ("cc",), ("u32",), (x >> U64(32)).astype(U32), (y >> U64(32)).astype(U32), cf)
        got = [(int(h) << 32) | int(l) for h, l in zip(hi, lo)]
        assert got == [pyop(int(p), int(q)) & (2**64 - 1) for p, q in zip(x, y)]
        # final carry / borrow out
        assert [bool(c) for c in cf2] == [not (0 <= pyop(int(p), int(q)) < 2**64) for p, q in zip(x, y)]
    # 64-bit chain: u64 add.cc + addc
    lo, cf = ev("add", ("cc",), ("u64",), x, y)
    hi = ev("addc", (), ("u64",), x, y, cf)
    assert [(int(h) << 64) | int(l) for h, l in zip(hi, lo)] == [
        ((int(p) + int(q)) & (2**64 - 1)) + ((int(p) + int(q) + ((int(p) + int(q)) >> 64)) << 64) - 0
        if False else ((int(p) << 64 | int(p)) + (int(q) << 64 | int(q))) & (2**128 - 1) for p, q in zip(x, y)]


def test_madc_hi_lo_chain():
    a, b = pairs(rand_u32())
    c = np.roll(a, 11)
    lo, cf = ev("mad", ("lo", "cc"), ("u32",), a, b, c)
    hi = ev("madc", ("hi",), ("u32",), a, b, np.zeros_like(a), cf)
    got = [(int(h) << 32) | int(l) for h, l in zip(hi, lo)]
    assert got == [(int(p) * int(q) + int(r)) & (2**64 - 1) for p, q, r in zip(a, b, c)]


@pytest.mark.parametrize("t", ["u32", "s32", "s64", "u64"])
def test_div_rem(t):
    w = int(t[1:])
    x = rand_u64() if w == 64 else rand_u32()
    a, b = pairs(x)
    b = b.copy()
    b[5] = 0
    if t[0] == "s":
        a = a.copy()
        a[0] = 1 << (w - 1)
        b[0] = (1 << w) - 1  # INT_MIN / -1
    q = ev("div", (), (t,), a, b)
    r = ev("rem", (), (t,), a, b)
    for i in range(len(a)):
        A, B = int(a[i]), int(b[i])
        if t[0] == "s":
            A, B = s(A, w), s(B, w)
        if B == 0:
            assert int(q[i]) == (1 << w) - 1 and int(r[i]) == int(a[i])
            continue
        qq = abs(A) // abs(B) * (1 if (A < 0) == (B < 0) else -1)
        assert int(q[i]) == qq & ((1 << w) - 1)
        assert int(r[i]) == (A - qq * B) & ((1 << w) - 1)


def test_mul24():
    a, b = pairs(rand_u32())
    for t in ("u32", "s32"):
        A = [int(v) & 0xFFFFFF for v in a]
        B = [int(v) & 0xFFFFFF for v in b]
        if t == "s32":
            A, B = [s(v, 24) for v in A], [s(v, 24) for v in B]
        p = [x * y for x, y in zip(A, B)]
        assert [int(v) for v in ev("mul24", ("lo",), (t,), a, b)] == [v & 0xFFFFFFFF for v in p]
        assert [int(v) for v in ev("mul24", ("hi",), (t,), a, b)] == [(v >> 16) & 0xFFFFFFFF for v in p]


def test_abs_neg_min_max_int():
    a, b = pairs(rand_u32())
    S = [s(int(v), 32) for v in a]
    T = [s(int(v), 32) for v in b]
    assert [int(v) for v in ev("abs", (), ("s32",), a)] == [abs(v) & 0xFFFFFFFF for v in S]
    assert [int(v) for v in ev("neg", (), ("s32",), a)] == [(-v) & 0xFFFFFFFF for v in S]
    assert [int(v) for v in ev("min", (), ("s32",), a, b)] == [min(p, q) & 0xFFFFFFFF for p, q in zip(S, T)]
    assert [int(v) for v in ev("max", (), ("u32",), a, b)] == [max(int(p), int(q)) for p, q in zip(a, b)]
    assert [int(v) for v in ev("max", ("relu",), ("s32",), a, b)] == [max(p, q, 0) for p, q in zip(S, T)]


@pytest.mark.parametrize("t", ["b32", "b64", "b16"])
def test_shifts(t):
    w = int(t[1:])
    x = (rand_u64() if w == 64 else rand_u32()).astype(np.dtype(f"uint{w}"))
    n = np.array(([0, 1, 15, 31, 32, 40, 63, 64, 65, 255, 2**31, 2**32 - 1] * 20)[: len(x)], U32)
    M = (1 << w) - 1
    assert [int(v) for v in ev("shl", (), (t,), x, n)] == [(int(a) << int(k)) & M if k < w else 0
                                                            for a, k in zip(x, n)]
    assert [int(v) for v in ev("shr", (), (t,), x, n)] == [int(a) >> int(k) if k < w else 0 for a, k in zip(x, n)]
    st = "s" + t[1:]
    assert [int(v) for v in ev("shr", (), (st,), x, n)] == [(s(int(a), w) >> min(int(k), w - 1)) & M
                                                             for a, k in zip(x, n)]


def test_shf():
    a, b = pairs(rand_u32())
    c = np.array(([0, 1, 8, 31, 32, 33, 40, 63, 64, 2**32 - 1] * 20)[: len(a)], U32)
    for d in ("l", "r"):
        for mode in ("wrap", "clamp"):
            got = ev("shf", (d, mode), ("b32",), a, b, c)
            for i in range(len(a)):
                n = min(int(c[i]), 32) if mode == "clamp" else int(c[i]) & 31
                v = (int(b[i]) << 32) | int(a[i])
                exp = ((v << n) >> 32) & 0xFFFFFFFF if d == "l" else (v >> n) & 0xFFFFFFFF
                assert int(got[i]) == exp, (d, mode, hex(int(a[i])), hex(int(b[i])), n)


def bfe_ref(a, pos, ln, w, signed):
    pos, ln = pos & 0xFF, ln & 0xFF
    msb = w - 1
    sbit = 0 if (not signed or ln == 0) else (a >> min(pos + ln - 1, msb)) & 1
    d = 0
    for i in range(w):
        bit = (a >> (pos + i)) & 1 if (i < ln and pos + i <= msb) else sbit
        d |= bit << i
    return d


@pytest.mark.parametrize("t", ["u32", "s32", "u64", "s64"])
def test_bfe_bfi(t):
    w = int(t[1:])
    x = rand_u64(30) if w == 64 else rand_u32(30)
    n = len(x)
    pos = RNG.integers(0, 80, n).astype(U32)
    ln = RNG.integers(0, 80, n).astype(U32)
    pos[:4] = [0, 31, 64, 300]
    ln[:4] = [0, 1, 5, 0x105]
    got = ev("bfe", (), (t,), x, pos, ln)
    assert [int(v) for v in got] == [bfe_ref(int(a), int(p), int(q), w, t[0] == "s") for a, p, q in zip(x, pos, ln)]
    bt = "b" + t[1:]
    f = np.roll(x, 3)
    got = ev("bfi", (), (bt,), f, x, pos, ln)
    for i in range(n):
        P, L = int(pos[i]) & 0xFF, int(ln[i]) & 0xFF
        d = int(x[i])
        for k in range(L):
            if P + k <= w - 1:
                d = (d & ~(1 << (P + k))) | (((int(f[i]) >> k) & 1) << (P + k))
        assert int(got[i]) == d


def test_bit_counts():
    x32, x64 = rand_u32(), rand_u64()
    assert [int(v) for v in ev("popc", (), ("b32",), x32)] == [bin(int(v)).count("1") for v in x32]
    assert [int(v) for v in ev("popc", (), ("b64",), x64)] == [bin(int(v)).count("1") for v in x64]
    assert [int(v) for v in ev("clz", (), ("b32",), x32)] == [32 - int(v).bit_length() for v in x32]
    assert [int(v) for v in ev("clz", (), ("b64",), x64)] == [64 - int(v).bit_length() for v in x64]
    assert [int(v) for v in ev("brev", (), ("b32",), x32)] == [int(f"{int(v):032b}"[::-1], 2) for v in x32]
    assert [int(v) for v in ev("brev", (), ("b64",), x64)] == [int(f"{int(v):064b}"[::-1], 2) for v in x64]

    def bfind(v, w, signed, sh):
        if signed and v >> (w - 1):
            v = ~v & ((1 << w) - 1)
        d = v.bit_length() - 1
        if d < 0:
            return 0xFFFFFFFF
        return (w - 1 - d) if sh else d

    for t, x in (("u32", x32), ("s32", x32), ("u64", x64), ("s64", x64)):
        w = int(t[1:])
        for sh in (False, True):
            got = ev("bfind", ("shiftamt",) if sh else (), (t,), x)
            assert [int(v) for v in got] == [bfind(int(v), w, t[0] == "s", sh) for v in x]


def test_prmt_generic_and_modes():
    a, b = pairs(rand_u32())
    c = RNG.integers(0, 2**16, len(a)).astype(U32)
    got = ev("prmt", (), ("b32",), a, b, c)
    for i in range(len(a)):
        v = (int(b[i]) << 32) | int(a[i])
        d = 0
        for k in range(4):
            sel = (int(c[i]) >> (4 * k)) & 0xF
            byte = (v >> (8 * (sel & 7))) & 0xFF
            if sel & 8:
                byte = 0xFF if byte & 0x80 else 0
            d |= byte << (8 * k)
        assert int(got[i]) == d
    # modes, hand-checked against the ISA's table with a = 0x33221100, b = 0x77665544
    A, B = np.array([0x33221100] * 4, U32), np.array([0x77665544] * 4, U32)
    C = np.arange(4, dtype=U32)
    exp = {
        "f4e": [0x33221100, 0x44332211, 0x55443322, 0x66554433],
        "b4e": [0x55667700, 0x66770011, 0x77001122, 0x00112233],
        "rc8": [0x00000000, 0x11111111, 0x22222222, 0x33333333],
        "ecl": [0x33221100, 0x33221111, 0x33222222, 0x33333333],
        "ecr": [0x00000000, 0x11111100, 0x22221100, 0x33221100],
        "rc16": [0x11001100, 0x33223322, 0x11001100, 0x33223322],
    }
    for mode, e in exp.items():
        assert [int(v) for v in ev("prmt", (mode,), ("b32",), A, B, C)] == e, mode
        for k in range(4):  # a uniform selector (0-d immediate or all lanes equal) takes the fast path
            assert int(ev("prmt", (mode,), ("b32",), A, B, np.array(k, U32))[0]) == e[k]
            assert [int(v) for v in ev("prmt", (mode,), ("b32",), A, B, np.full(4, k, U32))] == [e[k]] * 4
    for sel in (0x5410, 0x3210, 0x7654, 0x1F1E, 0x8888, 0xC0C0, int(RNG.integers(2**16))):
        lanes = ev("prmt", (), ("b32",), a, b, np.full(len(a), sel, U32))
        per_lane = ev("prmt", (), ("b32",), a, b, np.concatenate([np.full(len(a) - 1, sel, U32), [sel ^ 1]]))
        assert np.array_equal(lanes[:-1], per_lane[:-1])
        assert np.array_equal(ev("prmt", (), ("b32",), a, b, np.array(sel, U32)), lanes)


def test_lop3_and_logic():
    a, b = pairs(rand_u32())
    c = np.roll(a, 13)
    for lut in (0x00, 0xFF, 0x80, 0xFE, 0x40, 0x1A, 0x96, 0xE8, 0x3C, int(RNG.integers(256))):
        got = ev("lop3", (), ("b32",), a, b, c, np.array(lut, U32))
        for i in range(0, len(a), 7):
            d = 0
            for bit in range(32):
                idx = (((int(a[i]) >> bit) & 1) << 2) | (((int(b[i]) >> bit) & 1) << 1) | ((int(c[i]) >> bit) & 1)
                d |= ((lut >> idx) & 1) << bit
            assert int(got[i]) == d, hex(lut)
    q = np.array([True, False] * (len(a) // 2), bool)
    d, p = ev("lop3", ("or",), ("b32",), a, b, c, np.array(0x80, U32), q)
    assert np.array_equal(p, (d != 0) | q)
    assert np.array_equal(ev("and", (), ("b32",), a, b), a & b)
    assert np.array_equal(ev("xor", (), ("pred",), a > b, a < c), (a > b) ^ (a < c))
    assert [int(v) for v in ev("cnot", (), ("b32",), np.array([0, 1, 5], U32))] == [1, 0, 0]
    assert np.array_equal(ev("not", (), ("pred",), a > b), ~(a > b))


def test_setp_int_and_boolops():
    a, b = pairs(rand_u32())
    S, T = [s(int(v), 32) for v in a], [s(int(v), 32) for v in b]
    U, V = [int(v) for v in a], [int(v) for v in b]
    py = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
          "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}
    for cmp, f in py.items():
        p, q = ev("setp", (cmp,), ("s32",), a, b)
        assert list(p) == [f(x, y) for x, y in zip(S, T)] and list(q) == [not f(x, y) for x, y in zip(S, T)]
        p, _ = ev("setp", (cmp,), ("u32",), a, b)
        assert list(p) == [f(x, y) for x, y in zip(U, V)]
    for cmp, base in (("lo", "lt"), ("ls", "le"), ("hi", "gt"), ("hs", "ge")):
        p, _ = ev("setp", (cmp,), ("s32",), a, b)  # unsigned compares even on s32
        assert list(p) == [py[base](x, y) for x, y in zip(U, V)]
    c = a > np.roll(a, 1)
    for bo, f in (("and", lambda x, y: x and y), ("or", lambda x, y: x or y), ("xor", lambda x, y: x != y)):
        p, q = ev("setp", ("lt", bo), ("s32",), a, b, c)
        t = [x < y for x, y in zip(S, T)]
        assert list(p) == [f(x, bool(z)) for x, z in zip(t, c)]
        assert list(q) == [f(not x, bool(z)) for x, z in zip(t, c)]
    assert list(ev("selp", (), ("b32",), a, b, c)) == [x if z else y for x, y, z in zip(a, b, c)]
    assert list(ev("slct", (), ("b32", "s32"), a, b, a)) == [x if sx >= 0 else y for x, y, sx in zip(a, b, S)]


@pytest.mark.parametrize("dt,st", [("u8", "s32"), ("s8", "u32"), ("s16", "s32"), ("u16", "s64"), ("s32", "u64"),
                                   ("u32", "s32"), ("s64", "s16"), ("u64", "s32"), ("s32", "s8"), ("u32", "u64")])
def test_cvt_int_int(dt, st):
    dw, sw = int(dt[1:]), int(st[1:])
    x = (rand_u64() if sw == 64 else rand_u32()).astype(np.dtype(f"uint{sw}"))
    X = [s(int(v), sw) if st[0] == "s" else int(v) for v in x]
    lo, hi = (-(2 ** (dw - 1)), 2 ** (dw - 1) - 1) if dt[0] == "s" else (0, 2**dw - 1)
    M = (1 << dw) - 1
    assert [int(v) for v in ev("cvt", (), (dt, st), x)] == [v & M for v in X]
    assert [int(v) for v in ev("cvt", ("sat",), (dt, st), x)] == [max(lo, min(hi, v)) & M for v in X]


# ---------------------------------------------------------------------------------------------------------------
# floating point
# ---------------------------------------------------------------------------------------------------------------


def check_f32(got, exp_bits, ctx):
    for i, (g, e) in enumerate(zip(got, exp_bits)):
        g = int(g)
        if (e & 0x7FFFFFFF) > 0x7F800000:
            assert g == 0x7FFFFFFF, (ctx, i)
        else:
            assert g == e, (ctx, i, hex(g), hex(e))


@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
@pytest.mark.parametrize("op", ["add", "sub", "mul", "fma"])
def test_f32_arith_exact_rounding(op, mode):
    x = rand_f32(60)
    a, b, c = x, np.roll(x, 5), np.roll(x, 11)
    # make fma cancellations / ties likely: c = -(a*b) rounded, for some lanes
    if op == "fma":
        c = c.copy()
        ab = (a.view(np.float32).astype(np.float64) * b.view(np.float32).astype(np.float64))
        with np.errstate(all="ignore"):
            c[::3] = (-ab[::3]).astype(np.float32).view(U32)
    srcs = [a, b, c] if op == "fma" else [a, b]
    got = ev(op, (mode,), ("f32",), *srcs)
    exp = [ref_round(exact_op(op, mode, *[bf32(int(t[i])) for t in srcs]), "f32", mode) for i in range(len(a))]
    check_f32(got, exp, (op, mode))
    if mode == "rn" and op != "fma":  # independent cross-check with torch float32 (IEEE rn)
        ta, tb = torch.from_numpy(a.view(np.float32)), torch.from_numpy(b.view(np.float32))
        tr = {"add": ta + tb, "sub": ta - tb, "mul": ta * tb}[op].numpy().view(U32)
        check_f32(got, [int(v) for v in tr], (op, "torch"))


def test_fma_false_tie_in_float64():
    """(2^12+1)^2 = 2^24 + 2^13 + 1 is an f32 tie; +-2^-30 decides it, but float64 alone would round it onto the tie
    and then to even."""
    a = np.array([f32b(4097.0)] * 2, U32)
    c = np.array([f32b(2.0**-30), f32b(-(2.0**-30))], U32)
    got = ev("fma", ("rn",), ("f32",), a, a, c)
    assert [bf32(v) for v in got] == [2.0**24 + 2.0**13 + 2, 2.0**24 + 2.0**13]
    got = ev("fma", ("rn",), ("bf16",), np.array([0x4381] * 2, U16), np.array([0x4381] * 2, U16),  # 258*258
             np.array([f32b(2.0**-30) >> 16, f32b(-(2.0**-30)) >> 16], U16))
    # 258^2 = 66564 = 2^16 + 2^10 + 4: bf16 keeps 8 bits, ulp 512 there; 66564 - 65536 = 1028 = 2*512 + 4 -> rounds
    assert [bfloat16v(v) for v in got] == [66560.0, 66560.0]


def test_f32_ftz_sat():
    sub = [f32b(2.0**-130), f32b(-(2.0**-140)), f32b(1.0), f32b(2.0**-70), f32b(0.75), f32b(math.nan)]
    a = np.array(sub, U32)
    b = np.array([f32b(1.0), f32b(1.0), f32b(2.0**-140), f32b(2.0**-70), f32b(0.5), f32b(1.0)], U32)
    got = ev("mul", ("rn", "ftz"), ("f32",), a, b)
    # subnormal inputs flush (sign kept), subnormal results flush
    assert [int(v) for v in got] == [0, 0x80000000, 0, 0, f32b(0.375), 0x7FFFFFFF]
    got = ev("mul", ("rn",), ("f32",), a, b)
    assert int(got[0]) == f32b(2.0**-130) and int(got[3]) == f32b(2.0**-140)
    got = ev("add", ("sat",), ("f32",), a, b)
    assert [bf32(v) for v in got[[2, 4, 5]]] == [1.0, 1.0, 0.0]
    got = ev("fma", ("rn", "sat"), ("f32",), np.array([f32b(-2.0)], U32), a[:1], a[:1])
    assert int(got[0]) == 0


def check_bits(got, exp, ctx):
    assert [int(v) for v in got] == [int(v) for v in exp], ctx


@pytest.mark.parametrize("t", ["f16", "bf16"])
@pytest.mark.parametrize("op", ["add", "mul", "fma", "sub"])
def test_half_arith(t, op):
    n = 80
    if t == "f16":
        vals = (RNG.standard_normal(n) * np.exp2(RNG.integers(-14, 14, n))).astype(np.float16).view(U16)
    else:
        vals = (torch.from_numpy(RNG.standard_normal(n) * np.exp2(RNG.integers(-60, 60, n)))
                .to(torch.bfloat16).view(torch.int16).numpy().view(U16))
    edge = {"f16": [0x0000, 0x8000, 0x0001, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00],
            "bf16": [0x0000, 0x8000, 0x0001, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x3F80]}[t]
    x = np.concatenate([np.array(edge, U16), vals])
    a, b, c = x, np.roll(x, 3), np.roll(x, 9)
    srcs = [a, b, c] if op == "fma" else [a, b]
    got = ev(op, ("rn",), (t,), *srcs)
    fl = {"f16": bf16v, "bf16": bfloat16v}[t]
    exp = [ref_round(exact_op(op, "rn", *[fl(int(s_[i])) for s_ in srcs]), t, "rn") for i in range(len(a))]
    nan = 0x7FFF
    assert [int(v) for v in got] == [e if (e & 0x7FFF) <= (0x7C00 if t == "f16" else 0x7F80) else nan
                                     for e in exp], (t, op)
    # the x2 form: two independent lanes, low half first
    pa = (a.astype(U32) << U32(16)) | np.roll(a, 1).astype(U32)
    pb = (b.astype(U32) << U32(16)) | np.roll(b, 1).astype(U32)
    pc = (c.astype(U32) << U32(16)) | np.roll(c, 1).astype(U32)
    g2 = ev(op, ("rn",), (t + "x2",), *([pa, pb, pc] if op == "fma" else [pa, pb]))
    lo = ev(op, ("rn",), (t,), *([np.roll(a, 1), np.roll(b, 1), np.roll(c, 1)] if op == "fma"
                                 else [np.roll(a, 1), np.roll(b, 1)]))
    assert np.array_equal(g2 >> U32(16), got.astype(U32)) and np.array_equal(g2 & U32(0xFFFF), lo.astype(U32))


def test_f32x2_packed():
    x = rand_f32(40, wide=False)
    a, b, c = x, np.roll(x, 3), np.roll(x, 7)
    pk = lambda h, l: (h.astype(U64) << U64(32)) | l.astype(U64)  # noqa: E731
    for op in ("add", "sub", "mul", "fma"):
        srcs = [a, b, c] if op == "fma" else [a, b]
        srcs2 = [np.roll(v, 1) for v in srcs]
        got = ev(op, ("rn", "ftz"), ("f32x2",), *[pk(h, l) for h, l in zip(srcs, srcs2)])
        hi = ev(op, ("rn", "ftz"), ("f32",), *srcs)
        lo = ev(op, ("rn", "ftz"), ("f32",), *srcs2)
        assert np.array_equal(got, pk(hi, lo)), op


def test_fma_relu_and_mixed():
    a = np.array([f32b(v) for v in (1.0, -1.0, 2.0, math.nan)], U32)
    got = ev("fma", ("rn", "relu"), ("bf16",), *(_to_bf16(a),) * 3)
    assert [int(v) for v in got] == [f16raw_bf16(2.0), 0, f16raw_bf16(6.0), 0x7FFF]
    got = ev("add", ("rn",), ("f32", "bf16"), _to_bf16(a), a)  # d = f32(a_bf16) + c_f32
    assert [bf32(v) for v in got[:3]] == [2.0, -2.0, 4.0]


def _to_bf16(b32):
    return (b32 >> U32(16)).astype(U16)


def f16raw_bf16(v):
    return f32b(v) >> 16


def test_f64_arith():
    x = np.concatenate([np.array([0.0, -0.0, 1e308, -1e308, 5e-324, math.inf, math.nan, 1 / 3]),
                        RNG.standard_normal(40) * 10.0 ** RNG.integers(-100, 100, 40)])
    a, b, c = x, np.roll(x, 3), np.roll(x, 5)
    ab, bb, cb = a.view(U64), b.view(U64), c.view(U64)
    got = ev("add", ("rn",), ("f64",), ab, bb).view(np.float64)
    assert np.array_equal(got, a + b, equal_nan=True)
    got = ev("fma", ("rn",), ("f64",), ab, bb, cb).view(np.float64)
    for i in range(len(a)):
        if all(math.isfinite(v) for v in (a[i], b[i], c[i])):
            ex = Fraction(a[i]) * Fraction(b[i]) + Fraction(c[i])
            try:
                e = float(ex)
            except OverflowError:
                e = math.inf if ex > 0 else -math.inf
            assert got[i] == e or (e == 0 and got[i] == 0), i
    got = ev("add", ("rz",), ("f64",), np.array([1.0]).view(U64), np.array([-(2.0**-80)]).view(U64))
    assert got.view(np.float64)[0] == np.nextafter(1.0, 0)


@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
def test_div_rcp_sqrt_f32(mode):
    x = rand_f32(60)
    a, b = x, np.roll(x, 7)
    got = ev("div", (mode,), ("f32",), a, b)
    exp = []
    for p, q in zip(a, b):
        P, Q = bf32(int(p)), bf32(int(q))
        if not (math.isfinite(P) and math.isfinite(Q)) or Q == 0 or P == 0:
            with np.errstate(all="ignore"):
                v = float(np.float64(P) / np.float64(Q))
            exp.append(ref_round(v if (math.isnan(v) or math.isinf(v) or v == 0) else Fraction(v), "f32", mode))
        else:
            exp.append(ref_round(Fraction(P) / Fraction(Q), "f32", mode))
    check_f32(got, exp, ("div", mode))
    got = ev("sqrt", (mode,), ("f32",), a)
    for g, p in zip(got, a):
        P = bf32(int(p))
        if math.isnan(P) or P < 0:
            assert int(g) == 0x7FFFFFFF
            continue
        if math.isinf(P) or P == 0:
            assert int(g) == int(p)
            continue
        r = int(g)
        R = Fraction(bf32(r))
        lo_ok = R * R <= Fraction(P) if mode in ("rz", "rm") else True
        nxt = Fraction(bf32(r + 1))
        prv = Fraction(bf32(r - 1))
        if mode in ("rz", "rm"):
            assert R * R <= P < nxt * nxt and lo_ok
        elif mode == "rp":
            assert prv * prv < P <= R * R
        else:
            assert abs(R * R - P) <= min(abs(nxt * nxt - P), abs(prv * prv - P))
    got = ev("rcp", (mode,), ("f32",), a)
    exp = [ref_round(Fraction(1) / fr(int(p)) if isinstance(fr(int(p)), Fraction) else
                     float(np.float64(1.0) / np.float64(bf32(int(p)))) if bf32(int(p)) != 0 else
                     math.copysign(math.inf, bf32(int(p))), "f32", mode) for p in a]
    check_f32(got, exp, ("rcp", mode))


def ulp_f32(v):
    v = abs(v)
    if v < 2.0**-126:
        return 2.0**-149
    return 2.0 ** (math.floor(math.log2(v)) - 23)


def test_approx_f32_within_isa_bounds():
    x = (RNG.standard_normal(200) * 8).astype(np.float32)
    xb = x.view(U32)
    for op, f, kind, bound in (
        ("ex2", lambda v: 2.0**v, "ulp", 2),
        ("lg2", math.log2, "abs", 2.0**-22.6),
        ("sin", math.sin, "abs", 2.0**-20.9),
        ("cos", math.cos, "abs", 2.0**-20.9),
        ("tanh", math.tanh, "rel", 2.0**-11),
        ("rcp", lambda v: 1.0 / v, "ulp", 1),
        ("sqrt", math.sqrt, "rel", 2.0**-23),
        ("rsqrt", lambda v: 1.0 / math.sqrt(v), "rel", 2.0**-22.9),
    ):
        got = ev(op, ("approx", "ftz"), ("f32",), xb).view(np.float32)
        for v, g in zip(x.astype(float), got.astype(float)):
            if op in ("lg2", "sqrt", "rsqrt") and v <= 0:
                continue
            if op in ("sin", "cos") and abs(v) > math.pi:
                continue
            if op == "lg2" and not (0.5 <= v <= 2):
                bound_v = 2.0**-22 * max(1.0, abs(math.log2(v)))
            else:
                bound_v = None
            e = f(v)
            err = abs(g - e)
            if kind == "ulp":
                assert err <= bound * ulp_f32(e), (op, v, g, e)
            elif kind == "abs":
                assert err <= (bound_v or bound), (op, v, g, e)
            else:
                assert err <= bound * abs(e), (op, v, g, e)
    specials = np.array([f32b(v) for v in (math.inf, -math.inf, 0.0, -0.0, math.nan)], U32)
    assert [bf32(v) for v in ev("ex2", ("approx",), ("f32",), specials)][:4] == [math.inf, 0.0, 1.0, 1.0]
    assert [bf32(v) for v in ev("rcp", ("approx",), ("f32",), specials)][:4] == [0.0, -0.0, math.inf, -math.inf]
    assert bf32(ev("lg2", ("approx",), ("f32",), specials)[2]) == -math.inf
    assert int(ev("div", ("approx",), ("f32",), np.array([f32b(1.0)], U32), np.array([f32b(2.0**127)], U32))[0]) == 0
    got = ev("div", ("full",), ("f32",), xb, np.roll(xb, 1)).view(np.float32)
    assert np.array_equal(got, (x / np.roll(x, 1)).astype(np.float32))


def test_approx_half_types():
    x = (RNG.standard_normal(64) * 3).astype(np.float16)
    xb = x.view(U16)
    g = ev("ex2", ("approx",), ("f16",), xb).view(np.float16).astype(float)
    e = np.exp2(x.astype(float))
    assert np.all(np.abs(g - e) <= 2.0**-9.9 * np.abs(e) + 2.0**-24)
    g = ev("tanh", ("approx",), ("f16",), xb).view(np.float16).astype(float)
    assert np.all(np.abs(g - np.tanh(x.astype(float))) <= 2.0**-10.7 * 4)
    bx = _to_bf16(x.astype(np.float32).view(U32))
    pk = (bx.astype(U32) << U32(16)) | np.roll(bx, 1).astype(U32)
    g = ev("ex2", ("approx", "ftz"), ("bf16x2",), pk)
    hi = np.array([bfloat16v(v) for v in (g >> U32(16))])
    e = np.exp2(np.array([bfloat16v(v) for v in bx]))
    assert np.all(np.abs(hi - e) <= 2.0**-7 * np.abs(e))


def test_float_min_max():
    nan, inf = math.nan, math.inf
    A = [1.0, -0.0, 0.0, nan, 3.0, nan, -inf, 2.0, -3.0]
    B = [2.0, 0.0, -0.0, 1.0, nan, nan, 5.0, -2.0, 2.0]
    a = np.array([f32b(v) for v in A], U32)
    b = np.array([f32b(v) for v in B], U32)
    mn = [bf32(v) for v in ev("min", (), ("f32",), a, b)]
    mx = [bf32(v) for v in ev("max", (), ("f32",), a, b)]
    assert mn[0] == 1.0 and math.copysign(1, mn[1]) < 0 and math.copysign(1, mn[2]) < 0
    assert math.copysign(1, mx[1]) > 0 and math.copysign(1, mx[2]) > 0
    assert mn[3] == 1.0 and mn[4] == 3.0 and math.isnan(mn[5]) and mn[6] == -inf and mx[7] == 2.0
    assert int(ev("min", (), ("f32",), a, b)[5]) == 0x7FFFFFFF
    g = ev("max", ("NaN",), ("f32",), a, b)
    assert [int(v) for v in g[3:6]] == [0x7FFFFFFF] * 3
    g = [bf32(v) for v in ev("max", ("xorsign", "abs"), ("f32",), a, b)]
    assert g[7] == -2.0 and g[8] == -3.0 and g[0] == 2.0
    c = np.array([f32b(v) for v in [0.5, -1.0, 7.0, 0.0, 9.0, nan, 6.0, 1.0, 1.0]], U32)
    g = [bf32(v) for v in ev("max", (), ("f32",), a, b, c)]
    assert g[0] == 2.0 and g[2] == 7.0 and g[4] == 9.0 and g[6] == 6.0
    # f16x2 / bf16x2 per half
    ha = np.array([(f16b(1.0) << 16) | f16b(-5.0)], U32)
    hb = np.array([(f16b(2.0) << 16) | f16b(3.0)], U32)
    assert int(ev("max", (), ("f16x2",), ha, hb)[0]) == (f16b(2.0) << 16) | f16b(3.0)
    assert int(ev("min", (), ("f16x2",), ha, hb)[0]) == (f16b(1.0) << 16) | f16b(-5.0)


def test_setp_float_all_compares():
    vals = [1.0, 2.0, -0.0, 0.0, math.nan, math.inf, -math.inf, 2.0**-140]
    A = [x for x in vals for _ in vals]
    B = [y for _ in vals for y in vals]
    a = np.array([f32b(v) for v in A], U32)
    b = np.array([f32b(v) for v in B], U32)
    ordered = {"eq": lambda x, y: x == y, "ne": lambda x, y: x != y, "lt": lambda x, y: x < y,
               "le": lambda x, y: x <= y, "gt": lambda x, y: x > y, "ge": lambda x, y: x >= y}
    for cmp, f in ordered.items():
        un = lambda x, y: math.isnan(x) or math.isnan(y)  # noqa: E731
        p, q = ev("setp", (cmp,), ("f32",), a, b)
        assert list(p) == [(not un(x, y)) and f(x, y) for x, y in zip(A, B)], cmp
        assert list(q) == [not ((not un(x, y)) and f(x, y)) for x, y in zip(A, B)], cmp
        p, _ = ev("setp", (cmp + "u",), ("f32",), a, b)
        assert list(p) == [un(x, y) or f(x, y) for x, y in zip(A, B)], cmp + "u"
        p64, _ = ev("setp", (cmp,), ("f64",), np.array(A).view(U64), np.array(B).view(U64))
        assert list(p64) == [(not un(x, y)) and f(x, y) for x, y in zip(A, B)]
    p, _ = ev("setp", ("num",), ("f32",), a, b)
    assert list(p) == [not (math.isnan(x) or math.isnan(y)) for x, y in zip(A, B)]
    p, _ = ev("setp", ("nan",), ("f32",), a, b)
    assert list(p) == [math.isnan(x) or math.isnan(y) for x, y in zip(A, B)]
    # .ftz: the subnormal compares equal to zero
    p, _ = ev("setp", ("eq", "ftz"), ("f32",), np.array([f32b(2.0**-140)], U32), np.array([0], U32))
    assert bool(p[0])
    # f16x2: p low, q high
    ha = np.array([(f16b(1.0) << 16) | f16b(5.0)], U32)
    hb = np.array([(f16b(2.0) << 16) | f16b(3.0)], U32)
    p, q = ev("setp", ("lt",), ("f16x2",), ha, hb)
    assert (bool(p[0]), bool(q[0])) == (False, True)
    d = ev("set", ("lt",), ("f32", "s32"), np.array([1, 5], U32), np.array([2, 2], U32))
    assert [int(v) for v in d] == [0x3F800000, 0]
    d = ev("set", ("lt",), ("u32", "f32"), a[:3], b[:3])
    assert [int(v) for v in d] == [0, 0xFFFFFFFF, 0]


def test_testp_copysign_abs_neg():
    vals = [0.0, -0.0, 2.0**-140, 1.0, math.inf, -math.inf, math.nan]
    a = np.array([f32b(v) for v in vals], U32)
    assert list(ev("testp", ("finite",), ("f32",), a)) == [True, True, True, True, False, False, False]
    assert list(ev("testp", ("infinite",), ("f32",), a)) == [False] * 4 + [True, True, False]
    assert list(ev("testp", ("notanumber",), ("f32",), a)) == [False] * 6 + [True]
    assert list(ev("testp", ("number",), ("f32",), a)) == [True] * 6 + [False]
    assert list(ev("testp", ("normal",), ("f32",), a)) == [True, True, False, True, False, False, False]
    assert list(ev("testp", ("subnormal",), ("f32",), a)) == [False, False, True] + [False] * 4
    b = np.array([f32b(-1.0)] * len(vals), U32)
    assert [int(v) for v in ev("copysign", (), ("f32",), b, a)] == [int(v) | 0x80000000 for v in a]
    assert [int(v) for v in ev("abs", (), ("f32",), a)] == [int(v) & 0x7FFFFFFF for v in a]
    assert [int(v) for v in ev("neg", (), ("f32",), a)] == [int(v) ^ 0x80000000 for v in a]
    assert int(ev("neg", ("ftz",), ("f32",), a[2:3])[0]) == 0x80000000
    assert int(ev("neg", (), ("bf16x2",), np.array([0x3F80BF80], U32))[0]) == 0xBF803F80


# ---------------------------------------------------------------------------------------------------------------
# cvt
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_cvt_f32_to_half(dt, mode):
    x = rand_f32(100)
    got = ev("cvt", (mode,), (dt, "f32"), x)
    exp = [ref_round(fr(int(v)), dt, mode) for v in x]
    nanb = 0x7FFF
    assert [int(g) for g in got] == [e if (e & 0x7FFF) <= (0x7F80 if dt == "bf16" else 0x7C00) else nanb
                                     for e in exp]
    if mode == "rn":  # torch cross-check (its f32 -> bf16/f16 casts are RNE)
        td = torch.bfloat16 if dt == "bf16" else torch.float16
        tb = torch.from_numpy(x.view(np.float32)).to(td).view(torch.int16).numpy().view(U16)
        ok = ~np.isnan(x.view(np.float32))
        assert np.array_equal(got[ok], tb[ok])
    got = ev("cvt", (mode, "satfinite", "relu"), (dt, "f32"), x)
    exp = [ref_round(fr(int(v)), dt, mode, satfinite=True) for v in x]
    exp = [0 if (e & 0x8000 and (e & 0x7FFF) <= 0x7F80) else e for e in exp]
    assert [int(g) for g in got] == [e if (e & 0x7FFF) <= (0x7F80 if dt == "bf16" else 0x7C00) else nanb
                                     for e in exp]


def test_cvt_packed_order():
    a = np.array([f32b(1.0)], U32)
    b = np.array([f32b(2.0)], U32)
    # PTX ISA cvt: a goes to the upper half
    assert int(ev("cvt", ("rn",), ("bf16x2", "f32"), a, b)[0]) == 0x3F804000
    assert int(ev("cvt", ("rn",), ("f16x2", "f32"), a, b)[0]) == (f16b(1.0) << 16) | f16b(2.0)
    assert int(ev("cvt", ("rn", "satfinite"), ("e4m3x2", "f32"), a, b)[0]) == 0x3840
    h = np.array([(f16b(1.0) << 16) | f16b(2.0)], U32)
    assert int(ev("cvt", ("rn", "satfinite"), ("e5m2x2", "f16x2"), h)[0]) == 0x3C40
    assert int(ev("cvt", ("rn",), ("f16x2", "e4m3x2"), np.array([0x3840], U16))[0]) == (f16b(1.0) << 16) | f16b(2.0)


@pytest.mark.parametrize("f8", ["e4m3", "e5m2"])
def test_cvt_fp8(f8):
    x = np.concatenate([rand_f32(60, wide=False), (RNG.standard_normal(100) * 2.0 ** RNG.integers(-20, 18, 100))
                        .astype(np.float32).view(U32), np.array([f32b(v) for v in (1e9, -1e9, 464.0, 480.0,
                                                                                     57344.0, 61440.0, 2.0**-10,
                                                                                     2.0**-17, 0.0)], U32)])
    y = np.roll(x, 1)
    got = ev("cvt", ("rn", "satfinite"), (f8 + "x2", "f32"), x, y)
    hi, lo = (got >> U16(8)).astype(int), (got & U16(0xFF)).astype(int)
    for g, v in zip(np.concatenate([hi, lo]), np.concatenate([x, y])):
        assert g == ref_round(fr(int(v)), f8, "rn", satfinite=True), (f8, bf32(int(v)))
    # in range: torch's float8 casts agree (torch does not saturate, so only finite in-range values)
    fx = x.view(np.float32)
    m = np.abs(fx) <= FMT[f8][2]
    td = torch.float8_e4m3fn if f8 == "e4m3" else torch.float8_e5m2
    tb = torch.from_numpy(fx[m]).to(td).view(torch.uint8).numpy()
    assert np.array_equal(hi[m], tb.astype(int))
    # relu
    got = ev("cvt", ("rn", "satfinite", "relu"), (f8 + "x2", "f32"), x, y)
    assert all(int(g) >> 8 == 0 for g, v in zip(got, x) if bf32(int(v)) < 0)
    # every fp8 code -> f16x2 agrees with torch's decode
    codes = np.arange(65536, dtype=np.uint32)[::257].astype(U16)
    dec = ev("cvt", ("rn",), ("f16x2", f8 + "x2"), codes)
    tv = torch.from_numpy((codes & U16(0xFF)).astype(np.uint8)).view(td).to(torch.float16)
    tvh = torch.from_numpy((codes >> U16(8)).astype(np.uint8)).view(td).to(torch.float16)
    lo16 = (dec & U32(0xFFFF)).astype(U16).view(np.float16)
    hi16 = (dec >> U32(16)).astype(U16).view(np.float16)
    assert np.array_equal(lo16, tv.numpy(), equal_nan=True) and np.array_equal(hi16, tvh.numpy(), equal_nan=True)


def test_cvt_float_int():
    vals = [0.4, 0.5, 1.5, 2.5, -0.5, -1.5, -2.6, 3e9, -3e9, 1e20, -1e20, math.nan, math.inf, -math.inf,
            2147483647.0, -2147483648.0, 4294967295.0, 2.0**-140]
    x = np.array([f32b(v) for v in vals], U32)
    rf = {"rni": lambda v: round(v), "rzi": math.trunc, "rmi": math.floor, "rpi": math.ceil}
    for irnd, f in rf.items():
        for dt in ("s32", "u32", "s64", "u64", "s16", "u8"):
            w = int(dt[1:])
            lo, hi = (-(2 ** (w - 1)), 2 ** (w - 1) - 1) if dt[0] == "s" else (0, 2**w - 1)
            got = ev("cvt", (irnd,), (dt, "f32"), x)
            exp = []
            for v in vals:
                v32 = bf32(f32b(v))
                if math.isnan(v32):
                    r = 0
                elif math.isinf(v32):
                    r = hi if v32 > 0 else lo
                else:
                    r = max(lo, min(hi, f(v32)))
                exp.append(r & ((1 << w) - 1))
            assert [int(g) for g in got] == exp, (irnd, dt)
    # round to integral in float format
    got = ev("cvt", ("rni",), ("f32", "f32"), x)
    assert [bf32(v) for v in got[:7]] == [0.0, 0.0, 2.0, 2.0, -0.0, -2.0, -3.0]
    assert int(ev("cvt", ("rzi", "ftz"), ("f32", "f32"), x[-1:])[0]) == 0


@pytest.mark.parametrize("mode", ["rn", "rz", "rm", "rp"])
def test_cvt_int_to_float(mode):
    x64 = rand_u64(80)
    for st in ("u64", "s64"):
        got = ev("cvt", (mode,), ("f32", st), x64)
        X = [s(int(v), 64) if st == "s64" else int(v) for v in x64]
        assert [int(g) for g in got] == [ref_round(Fraction(v) if v else 0.0, "f32", mode) for v in X], st
        got = ev("cvt", (mode,), ("f16", st), x64)
        assert [int(g) for g in got] == [ref_round(Fraction(v) if v else 0.0, "f16", mode) for v in X], st
    x32 = rand_u32()
    got = ev("cvt", (mode,), ("f32", "s32"), x32)
    assert [int(g) for g in got] == [ref_round(Fraction(s(int(v), 32)) if int(v) else 0.0, "f32", mode)
                                     for v in x32]
    got = ev("cvt", (mode,), ("bf16", "u32"), x32)
    assert [int(g) for g in got] == [ref_round(Fraction(int(v)) if int(v) else 0.0, "bf16", mode) for v in x32]


def test_cvt_float_float():
    x = rand_f32(50)
    f = x.view(np.float32)
    assert np.array_equal(ev("cvt", (), ("f64", "f32"), x).view(np.float64), f.astype(np.float64), equal_nan=True)
    h = ev("cvt", ("rn",), ("f16", "f32"), x)
    back = ev("cvt", (), ("f32", "f16"), h).view(np.float32)
    assert np.array_equal(back, h.view(np.float16).astype(np.float32), equal_nan=True)
    bb = ev("cvt", ("rn",), ("bf16", "f32"), x)
    assert np.array_equal(ev("cvt", (), ("f32", "bf16"), bb), bb.astype(U32) << U32(16))
    d = (RNG.standard_normal(60) * 10.0 ** RNG.integers(-45, 45, 60))
    for mode in ("rn", "rz", "rm", "rp"):
        got = ev("cvt", (mode,), ("f32", "f64"), d.view(U64))
        assert [int(g) for g in got] == [ref_round(Fraction(v), "f32", mode) for v in d], mode
        got = ev("cvt", (mode,), ("bf16", "f64"), d.view(U64))
        assert [int(g) for g in got] == [ref_round(Fraction(v), "bf16", mode) for v in d], mode
    got = ev("cvt", ("ftz",), ("f32", "f32"), np.array([f32b(-(2.0**-140)), f32b(1.0)], U32))
    assert [int(v) for v in got] == [0x80000000, f32b(1.0)]
    got = ev("cvt", ("sat",), ("f32", "f32"), np.array([f32b(v) for v in (-1.0, 0.5, 7.0, math.nan)], U32))
    assert [bf32(v) for v in got] == [0.0, 0.5, 1.0, 0.0]
    got = ev("cvt", ("rna", "satfinite"), ("tf32", "f32"), np.array([f32b(1.0 + 2.0**-11), f32b(1.0 + 2.0**-12)], U32))
    assert [int(v) for v in got] == [f32b(1.0 + 2.0**-10), f32b(1.0)]


def test_unsupported():
    for op, mods, types in (("frobnicate", (), ("u32",)), ("add", ("rn",), ("u32",)),
                            ("fma", (), ("f32",)), ("cvt", (), ("s32", "f32")),
                            ("cvt", ("rn",), ("e4m3x2", "f32")), ("mul", (), ("u32",)),
                            ("ex2", ("rn",), ("f32",)), ("setp", ("lt", "foo"), ("s32",)),
                            ("shf", ("l",), ("b32",)), ("rcp", ("approx", "ftz"), ("f64",))):
        with pytest.raises(Unsupported, match=op):
            alu.compile(op, mods, types)


def test_compile_is_cached_and_broadcasts():
    f1 = alu.compile("fma", ("rn",), ("f32",))
    assert f1 is alu.compile("fma", ("rn",), ("f32",))
    a = np.full(32, f32b(2.0), U32)
    got = f1([a, np.array(f32b(3.0), U32), np.array(f32b(1.0), U32)])
    assert got.shape == (32,) and bf32(got[0]) == 7.0
    assert {"f32", "bf16x2", "e4m3x2", "pred", "u16x2", "f32x2"} <= alu.TYPE_WORDS
