"""Device-side FP8: e4m3 quantization with per-granule float32 or e8m0 scales, and e8m0 scale decoding, bit for bit
as the reference (``reference/quant.py``) and torch do; the views of per-tensor scales (``tensor_scale_views``).

float8_e8m0fnu holds a biased exponent ``e``: the scale is ``2^(e - 127)``, a float32 whose exponent field is ``e``,
except for the two bytes a shift gets wrong: ``e = 0`` is ``2^-127`` (a float32 subnormal, not 0) and ``e = 255``
is NaN (not infinity).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, const_expr

VEC = 8  # values a lane quantizes: 16 bytes of 16-bit input, 8 bytes of e4m3 output
FP8_E4M3_MAX = 448.0
FLT_MIN = 1.1754943508222875e-38  # the reference's scale floor (float32 tiny): 1 / scale stays finite

E8M0_MIN_BITS = 0x00400000  # 2^-127: torch's float32 for e8m0 byte 0
E8M0_NAN_BITS = 0x7F800001  # torch's float32 for e8m0 byte 255
E8M0_MAX_BITS = 0x7F000000  # 2^127, e8m0's largest value (byte 254)
MANTISSA_MASK = 0x007FFFFF


@cute.jit
def e8m0_to_float32(e: Uint32) -> Float32:
    """The float32 value of e8m0 byte ``e`` (given widened to 32 bits)."""
    bits = cute.make_rmem_tensor((1,), Uint32)
    bits[0] = e << 23
    if e == 0:
        bits[0] = Uint32(E8M0_MIN_BITS)
    if e == 255:
        bits[0] = Uint32(E8M0_NAN_BITS)
    return cute.recast_tensor(bits, Float32)[0]


@cute.jit
def _from_bits(bits: Uint32) -> Float32:
    word = cute.make_rmem_tensor((1,), Uint32)
    word[0] = bits
    return cute.recast_tensor(word, Float32)[0]


@cute.jit
def _bits(x: Float32) -> Uint32:
    word = cute.make_rmem_tensor((1,), Float32)
    word[0] = x
    return cute.recast_tensor(word, Uint32)[0]


@cute.jit
def e8m0_ceil(scale: Float32) -> Float32:
    """``scale`` (``>= 2^-127`` or NaN) rounded up to a power of two, at most ``2^127``: the reference's frexp-based
    ceiling. On the float32 bits: a nonzero mantissa carries into the exponent once the mantissa is filled
    (``(bits + 0x7FFFFF) & ~0x7FFFFF``), except for ``2^-127``, the subnormal ``0x00400000``, already a power of two
    (the carry would double it); above ``2^127`` (an infinite amax) the ceiling is clamped; NaN stays NaN."""
    b = _bits(scale)
    if scale == scale:
        if b > Uint32(E8M0_MIN_BITS) and b & Uint32(MANTISSA_MASK) != Uint32(0):
            b = (b + Uint32(MANTISSA_MASK)) & Uint32(~MANTISSA_MASK & 0xFFFFFFFF)
        if b > Uint32(E8M0_MAX_BITS):
            b = Uint32(E8M0_MAX_BITS)
    return _from_bits(b)


@cute.jit
def e8m0_byte(scale: Float32) -> Uint32:
    """The e8m0 byte of an ``e8m0_ceil`` scale: its float32 exponent field (0 for the subnormal ``2^-127``, 255 for
    NaN, as torch's cast gives them)."""
    return (_bits(scale) >> 23) & Uint32(0xFF)


@cute.jit
def quantize_e4m3(vals: cute.Tensor, granularity: cutlass.Constexpr[int], e8m0: cutlass.Constexpr[bool] = False):
    """``(e4m3 values, stored scale)`` of 8 float32 values; with ``granularity`` the scale is shared by the
    ``granularity // 8`` aligned lanes holding the granule: ``scale = max(amax / 448, FLT_MIN)``, values
    ``x / scale`` converted with saturation (``cvt.rn.satfinite``: NaN stays NaN, as in ``reference/quant.py``).
    ``e8m0``: the scale is ``e8m0_ceil(max(amax / 448, 2^-127))``, stored as its byte (``e8m0_byte``, a Uint32).
    ``granularity == 0`` (no scales): the values themselves, saturated."""
    out = cute.make_rmem_tensor((VEC,), cutlass.Float8E4M3FN)
    scale = Float32(1.0)
    stored = scale
    if const_expr(granularity == 0):
        out.store(vals.load().to(cutlass.Float8E4M3FN))
    else:
        scale = lanes_scale(lane_amax(vals), granularity // VEC, e8m0)
        out = to_e4m3(vals, scale)
        stored = e8m0_byte(scale) if const_expr(e8m0) else scale
    return out, stored


@cute.jit
def lane_amax(vals: cute.Tensor) -> Float32:
    """This lane's running max of ``|x|`` over ``vals`` (max.xorsign.abs: its sign is garbage, see ``lanes_scale``);
    a NaN poisons it."""
    amax = Float32(0.0)
    for e in cutlass.range_constexpr(cute.size(vals)):
        amax = cute.arch.fmax(amax, vals[e], abs=True, nan=True)
    return amax


@cute.jit
def lanes_scale(amax: Float32, lanes: cutlass.Constexpr[int], e8m0: cutlass.Constexpr[bool] = False) -> Float32:
    """The scale ``max(amax / 448, FLT_MIN)`` of a granule held by ``lanes`` aligned lanes (a power of two), each
    with its ``lane_amax``; NaN propagates. ``e8m0``: ``e8m0_ceil(max(amax / 448, 2^-127))``, the reference's
    e8m0 scale (its floor is e8m0's smallest value, not float32's)."""
    # abs=True is max.xorsign.abs: the magnitude of the max with the XOR of the operands' signs; clear the
    # sign before the lanes' plain max, else a negative partial loses to a smaller positive one.
    amax = cute.math.absf(amax)
    offset = 1
    while const_expr(offset < lanes):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=offset), nan=True)
        offset *= 2
    scale = amax / Float32(FP8_E4M3_MAX)
    floor = _from_bits(Uint32(E8M0_MIN_BITS)) if const_expr(e8m0) else Float32(FLT_MIN)
    if scale < floor:  # false for NaN: it propagates
        scale = floor
    if const_expr(e8m0):
        scale = e8m0_ceil(scale)
    return scale


@cute.jit
def to_e4m3(vals: cute.Tensor, scale: Float32) -> cute.Tensor:
    """``vals / scale`` (divided as the reference divides) converted to e4m3 with saturation."""
    q = cute.make_rmem_tensor(vals.shape, Float32)
    for e in cutlass.range_constexpr(cute.size(vals)):
        q[e] = vals[e] / scale
    out = cute.make_rmem_tensor(vals.shape, cutlass.Float8E4M3FN)
    out.store(q.load().to(cutlass.Float8E4M3FN))
    return out


@cute.jit
def granule_scale(scales: cute.Tensor, row: Int32, kv_head: Int32, granule: Int32,
                  e8m0: cutlass.Constexpr[bool]) -> Float32:
    """The scale of ``(row, kv_head, granule)`` of a ``[rows, H, G]`` scale view (float32, or e8m0 bytes decoded as
    torch does). The offset is computed in 64 bits (rows x H x G passes 2^31 in a large cache) and bounded in 64
    bits (on the row alone the compiler narrows the offset math to 32 bits): a row outside the view, from a lookup
    entry that is not a page under unchecked metadata, is not read and scales by 0."""
    per_row = cute.size(scales, mode=[1]) * cute.size(scales, mode=[2])
    offset = Int64(row) * per_row + kv_head * cute.size(scales, mode=[2]) + granule
    scale = Float32(0.0)
    if offset >= 0 and offset < Int64(cute.size(scales, mode=[0])) * per_row:
        value = cute.make_tensor(scales.iterator + offset, cute.make_layout(1))[0]
        if const_expr(e8m0):
            scale = e8m0_to_float32(Uint32(value))
        else:
            scale = Float32(value)
    return scale


def tensor_scale_views(scales: cute.Tensor) -> tuple[cute.Tensor, cute.Tensor]:
    """K's and V's one-element views of per-tensor scales, a float32 ``[2]`` ``(k_scale, v_scale)``
    (``cute_kv/tensor_scales.py``); a kernel reads each once a tile."""
    return (cute.make_tensor(scales.iterator, cute.make_layout(1)),
            cute.make_tensor(scales.iterator + 1, cute.make_layout(1)))
