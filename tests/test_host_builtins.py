"""The float32 -> bfloat16 builtin the host JIT links against (``tests/host_builtins.py``): whichever this machine
has (libgcc_s from GCC 13, or the one built at test setup) rounds as torch does, and kernel code run on the host
converts the same way."""

import ctypes
import struct

import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack

import host_builtins


def _values(rng) -> torch.Tensor:
    one = 1.0 + 2.0 ** -8  # halfway between two bfloat16 values: ties go to the even one (down here, up next)
    specials = [one, 1.0 + 3 * 2.0 ** -8, -one, 3.4e38, -3.4e38, float("inf"), -float("inf"), 0.0, -0.0, 65504.0,
                1e-40, -3e-39]  # denormals too
    scale = torch.exp2(torch.randint(-120, 120, (500,), generator=rng).float())
    return torch.cat([torch.tensor(specials), torch.randn(500, generator=rng) * scale]).float()


def _check(x: torch.Tensor, got: torch.Tensor):
    finite = ~x.isnan()
    assert torch.equal(got[finite].view(torch.int16), x[finite].to(torch.bfloat16).view(torch.int16))
    assert got[~finite].isnan().all() and torch.equal(got[~finite].signbit(), x[~finite].signbit())


def test_builtin_rounds_to_nearest_even_and_keeps_nan(rng):
    fn = host_builtins.find()
    assert fn is not None  # conftest provided it where libgcc_s lacks it
    # The bfloat16 comes back in the low 16 bits of the float return register: read that register as a float32.
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    nans = torch.tensor([0x7FC00000, -0x00400000, 0x7F800001, -0x007FFFFF], dtype=torch.int32).view(torch.float32)
    x = torch.cat([_values(rng), nans])
    bits = [struct.unpack("<I", struct.pack("<f", fn(v)))[0] & 0xFFFF for v in x.tolist()]
    _check(x, torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16))


@cute.jit
def _to_bf16(src: cute.Tensor, dst: cute.Tensor):
    for i in cutlass.range(cute.size(src)):
        dst[i] = src[i].to(cutlass.BFloat16)


def test_host_jit_converts_float32_to_bfloat16_like_torch(rng):
    """Kernel code run on the host: a CPU with AVX512-BF16 converts inline (denormals flushed), others call the
    builtin."""
    x = _values(rng)
    x = torch.cat([x[x.abs() >= 2.0 ** -126], torch.tensor([float("nan"), -float("nan")])])  # no denormals
    got = torch.full(x.shape, 7.0, dtype=torch.bfloat16)
    _to_bf16(from_dlpack(x), from_dlpack(got))
    _check(x, got)
