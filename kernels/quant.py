"""Device-side FP8 scale decoding, bit for bit as torch decodes (the reference dequantizes with torch).

float8_e8m0fnu holds a biased exponent ``e``: the scale is ``2^(e - 127)``, a float32 whose exponent field is ``e``,
except for the two bytes a shift gets wrong: ``e = 0`` is ``2^-127`` (a float32 subnormal, not 0) and ``e = 255``
is NaN (not infinity).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Uint32

E8M0_MIN_BITS = 0x00400000  # 2^-127: torch's float32 for e8m0 byte 0
E8M0_NAN_BITS = 0x7F800001  # torch's float32 for e8m0 byte 255


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
