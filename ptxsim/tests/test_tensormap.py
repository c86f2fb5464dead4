"""tensormap.decode against descriptors the CuTe DSL host code really writes (captured on the CPU)."""

import pytest

from ptxsim.errors import Unsupported
from ptxsim.tensormap import decode

pytestmark = pytest.mark.sim

pytest.importorskip("cutlass")
from ptxsim.tests._tma_probe import capture_descriptor  # noqa: E402

ELEM = {"u8": 1, "i8": 1, "e4m3": 1, "u16": 2, "f16": 2, "bf16": 2, "i32": 4, "f32": 4, "tf32": 4, "i64": 8, "f64": 8}
TMA_DTYPE = {"u8": "u8", "i8": "u8", "e4m3": "u8", "u16": "u16", "f16": "f16", "bf16": "bf16", "i32": "u32",
             "f32": "f32", "tf32": "tf32", "i64": "u64", "f64": "f64"}


def _desc(launch):
    (raw,) = [p for p in launch.params if len(p) == 128]
    return decode(raw)


@pytest.mark.parametrize("dt,shape,stride,box,sw", [
    ("bf16", (256, 128), (1, 256), (64, 32), 0),
    ("bf16", (256, 128), (1, 256), (64, 32), 3),
    ("bf16", (256, 128), (1, 264), (16, 32), 1),
    ("bf16", (256, 128), (1, 256), (32, 32), 2),
    ("e4m3", (256, 64), (1, 256), (128, 16), 3),
    ("f32", (96, 40), (1, 96), (32, 8), 3),
    ("i32", (64, 32), (1, 64), (8, 8), 0),
    ("f16", (64,), (1,), (32,), 0),
    ("bf16", (64, 16, 8), (1, 128, 4096), (32, 4, 2), 0),
    ("bf16", (64, 16, 8, 6), (1, 128, 4096, 65536), (32, 4, 2, 3), 0),
    ("f32", (32, 16, 8, 6, 5), (1, 40, 1280, 16384, 131072), (32, 4, 2, 3, 5), 0),
])
def test_decode_captured(dt, shape, stride, box, sw):
    eb = ELEM[dt]
    launch, t = capture_descriptor(dt, shape, stride, box, sw, offset=64 // eb)   # a 16-byte aligned view offset
    m = _desc(launch)
    assert m.address == t.data_ptr()
    assert (m.rank, m.dtype, m.elem_bytes) == (len(shape), TMA_DTYPE[dt], eb)
    assert m.dims == shape
    assert m.strides == tuple(s * eb for s in stride)
    assert m.box == box
    assert m.swizzle == (0, 32, 64, 128)[sw]
    assert m.elem_strides == (1,) * len(shape) and m.interleave == 0 and not m.oob_nan


@pytest.mark.parametrize("dt", ["u8", "i8", "u16", "f16", "bf16", "i32", "f32", "tf32", "i64", "f64"])
def test_decode_dtypes(dt):
    launch, t = capture_descriptor(dt, (64, 32), (1, 64), (8, 8))
    m = _desc(launch)
    assert (m.dtype, m.elem_bytes, m.dims, m.strides[1]) == (TMA_DTYPE[dt], ELEM[dt], (64, 32), 64 * ELEM[dt])


def test_decode_rejects_unknown_bits():
    launch, _ = capture_descriptor("bf16", (64, 32), (1, 64), (8, 8))
    (raw,) = [p for p in launch.params if len(p) == 128]
    decode(raw[:64] + bytes(range(64)))          # bytes 64..127 are not written by the DSL: ignored
    # w0 bits 0/63, w1 bits 3/12/15/17/24 (unknown or fixed), w3 bit 48, unused dim 2, w6 bit 32, w7 bit 32
    for byte, bit in [(0, 0), (7, 7), (8, 3), (9, 4), (9, 7), (10, 1), (11, 0), (30, 0), (40, 0), (52, 0), (60, 0)]:
        bad = bytearray(raw)
        bad[byte] ^= 1 << bit
        with pytest.raises(Unsupported):
            decode(bytes(bad))
    with pytest.raises(ValueError):
        decode(raw[:64])
