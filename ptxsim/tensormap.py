"""The TMA tensor map (``CUtensorMap``, 128 bytes) as the simulator reads it.

``decode`` turns the 128 bytes a kernel receives as a ``.param`` into a ``TensorMap``; the DSL's compiled host code
writes those bytes field by field (no driver call), so decoding them checks the host code as well.
"""

from __future__ import annotations

import dataclasses

from .errors import Unsupported


@dataclasses.dataclass(frozen=True)
class TensorMap:
    address: int                    # global base address (bytes)
    rank: int                       # 1..5
    dtype: str                      # 'u8','u16','u32','s32','u64','s64','f16','f32','f64','bf16','f32_ftz','tf32', ...
    elem_bytes: int                 # bytes per element (for sub-byte types: see dtype)
    dims: tuple[int, ...]           # elements per dimension, innermost first
    strides: tuple[int, ...]        # bytes per step of each dimension, innermost first (strides[0] == elem_bytes)
    box: tuple[int, ...]            # box extent per dimension (elements), innermost first
    elem_strides: tuple[int, ...]   # traversal stride per dimension (1 = every element)
    interleave: int                 # 0 = none (others are not supported)
    swizzle: int                    # 0, 32, 64 or 128 (bytes of the swizzle span)
    l2_promotion: int
    oob_nan: bool                   # out-of-bounds fill: NaN (True) or zero (False)


# --------------------------------------------------------------------------------------------------------------
# The 128-byte layout, as the CuTe DSL 4.8.1 host code writes it (words w0..w7 are little-endian u64 at bytes 0..63;
# bytes 64..127 are left unwritten by the DSL - an uninitialised stack buffer - and are ignored). Established by reading
# the host function's LLVM dialect IR (``fn.ir_module``: the stores into the 16 x i64 alloca) for a dynamic-shape
# rank-5 bf16 tensor, then checked on captured descriptors for ranks 1..5, box sizes, 15 element types and the four
# swizzle modes (ptxsim/tests/test_tensormap.py):
#   w0  bits 4..56   address >> 4   (the IR: ((addr / 16) & (2**53 - 1)) << 4; bits 0..3 and 57..63 are 0)
#   w1  bits 0..3    2 in every descriptor (not varied by the DSL; see _W1_FIXED)
#       bits 4..6    rank - 1
#       bits 7..11   element type code (_DTYPES); bit 16: tf32 (with the f32 code)
#       bits 13..14  swizzle: 0 none, 1 32B, 2 64B, 3 128B
#       bit 18       1 in every descriptor
#       bit 21       1 when dims[0]*elem_bytes + sum((dims[i]-1)*strides[i]) >= 128 KiB (the IR computes exactly that)
#       bits 32..63  strides[1] >> 4 (low 32 bits)
#   w2  bits 0..31 strides[2] >> 4,  bits 32..63 strides[3] >> 4
#   w3  bits 0..31 strides[4] >> 4;  bits 32+4*(i-1) .. +3: bits 36..39 of strides[i] (i = 1..4)
#   w4  dims[0]-1 | dims[1]-1 << 32;  w5  dims[2]-1 | dims[3]-1 << 32;  w6 bits 0..31  dims[4]-1
#   w6  bits 56..63  box[0]-1;  w7 bytes 0..3: box[1..4]-1
# Every other bit is 0 in what the DSL writes; a non-zero one (element strides, interleave, im2col, OOB NaN fill, L2
# promotion other than the DSL's) raises Unsupported rather than being guessed.

_DTYPES = {0: ("u8", 1), 1: ("u16", 2), 2: ("u32", 4), 4: ("u64", 8), 6: ("f16", 2), 7: ("f32", 4), 9: ("f64", 8),
           10: ("bf16", 2)}
_W1_FIXED = 0x2 | (1 << 18)
_W1_KNOWN = 0xF | (0x7 << 4) | (0x1F << 7) | (0x3 << 13) | (1 << 16) | (1 << 18) | (1 << 21) | (0xFFFFFFFF << 32)
_M32 = 0xFFFFFFFF


def decode(raw: bytes) -> TensorMap:
    """Decode the 128 descriptor bytes a kernel receives (a ``.param .align 64 .b8 [128]``) into a ``TensorMap``.

    Fields as laid out above. Ranks whose unused dims/strides/boxes hold non-zero bits, unknown type codes and any bit
    outside the known fields raise ``Unsupported``."""
    if len(raw) != 128:
        raise ValueError(f"a tensor map is 128 bytes, got {len(raw)}")
    w = [int.from_bytes(raw[8 * i:8 * i + 8], "little") for i in range(8)]
    if w[0] & ~(((1 << 53) - 1) << 4):
        raise Unsupported(f"tensor map word 0 {w[0]:#018x}: bits outside the address field")
    address = w[0]
    w1 = w[1]
    if w1 & ~_W1_KNOWN or (w1 & (0xF | (1 << 18))) != _W1_FIXED:
        raise Unsupported(f"tensor map word 1 {w1:#018x}: unknown mode bits (interleave/im2col/fill/L2 promotion?)")
    rank = ((w1 >> 4) & 7) + 1
    if rank > 5:
        raise Unsupported(f"tensor map rank {rank}")
    code = (w1 >> 7) & 0x1F
    if code not in _DTYPES:
        raise Unsupported(f"tensor map element type code {code}")
    dtype, elem_bytes = _DTYPES[code]
    if (w1 >> 16) & 1:
        if dtype != "f32":
            raise Unsupported(f"tensor map tf32 bit with element type {dtype}")
        dtype = "tf32"
    swizzle = (0, 32, 64, 128)[(w1 >> 13) & 3]
    lo = [(w1 >> 32) & _M32, w[2] & _M32, w[2] >> 32, w[3] & _M32]            # strides[1..4] >> 4, low 32 bits
    hi = [(w[3] >> (32 + 4 * i)) & 0xF for i in range(4)]                     # bits 36..39 of strides[1..4]
    all_strides = [elem_bytes] + [((hi[i] << 32) | lo[i]) << 4 for i in range(4)]
    all_dims = [(w[4] & _M32) + 1, (w[4] >> 32) + 1, (w[5] & _M32) + 1, (w[5] >> 32) + 1, (w[6] & _M32) + 1]
    all_box = [(w[6] >> 56) + 1] + [((w[7] >> (8 * i)) & 0xFF) + 1 for i in range(4)]
    if w[3] >> 48:
        raise Unsupported(f"tensor map word 3 {w[3]:#018x}: bits above the stride fields")
    if (w[6] >> 32) & 0xFFFFFF or w[7] >> 32:
        raise Unsupported(f"tensor map words 6/7 {w[6]:#018x} {w[7]:#018x}: element strides or other fields set")
    # Unused ranks hold zeros (dims/box then read as 1, strides as 0).
    for i in range(rank, 5):
        if all_dims[i] != 1 or all_box[i] != 1 or all_strides[i] != 0:
            raise Unsupported(f"tensor map rank {rank} with non-zero fields for dimension {i}")
    extent = all_dims[0] * elem_bytes + sum((all_dims[i] - 1) * all_strides[i] for i in range(1, rank))
    if bool((w1 >> 21) & 1) != (extent >= 1 << 17):
        raise Unsupported(f"tensor map bit 21 = {(w1 >> 21) & 1} but the tensor spans {extent} bytes")
    return TensorMap(address=address, rank=rank, dtype=dtype, elem_bytes=elem_bytes, dims=tuple(all_dims[:rank]),
                     strides=tuple(all_strides[:rank]), box=tuple(all_box[:rank]), elem_strides=(1,) * rank,
                     interleave=0, swizzle=swizzle, l2_promotion=(w1 & 0xF), oob_nan=False)
