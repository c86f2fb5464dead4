"""A one-TMA-descriptor kernel for the capture and tensor-map tests: the host builds a tiled TMA atom over one tensor
(box = ``box``, optional swizzle) and launches a kernel that only prefetches the descriptor."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

from ptxsim.capture import capturing, cuda_view

DTYPES = {
    "u8": (cutlass.Uint8, torch.uint8), "i8": (cutlass.Int8, torch.int8), "e4m3": (cutlass.Float8E4M3FN, torch.float8_e4m3fn),
    "u16": (cutlass.Uint16, torch.uint16), "f16": (cutlass.Float16, torch.float16), "bf16": (cutlass.BFloat16, torch.bfloat16),
    "i32": (cutlass.Int32, torch.int32), "f32": (cutlass.Float32, torch.float32), "tf32": (cutlass.TFloat32, torch.float32),
    "i64": (cutlass.Int64, torch.int64), "f64": (cutlass.Float64, torch.float64),
}


def _host(box, swizzle_b):
    @cute.kernel
    def probe_kernel(tma: cute.CopyAtom, t: cute.Tensor):
        cpasync.prefetch_descriptor(tma)

    @cute.jit
    def probe_host(a: cute.Tensor, stream):
        lay = cute.make_layout(box)
        if cutlass.const_expr(swizzle_b):
            # CuTe DSL swizzles act on byte offsets: Swizzle<B,4,3> is the 2**B * 16-byte TMA swizzle.
            lay = cute.make_composed_layout(cute.make_swizzle(swizzle_b, 4, 3), 0, cute.make_layout(box))
        tma, tt = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, lay, box)
        probe_kernel(tma, tt).launch(grid=(1, 1, 1), block=(32, 1, 1), stream=stream)

    return probe_host


def capture_descriptor(dt, shape, stride, box, swizzle_b=0, offset=0, arch="sm_90a"):
    """Compile for ``arch``, call with a CPU tensor of that shape/stride (elements), return (launch, tensor)."""
    cdt, tdt = DTYPES[dt]
    with capturing(arch) as launches:
        fake = make_fake_tensor(cdt, shape, stride=stride, assumed_align=16)
        fn = cute.compile(_host(box, swizzle_b), fake, make_fake_stream(use_tvm_ffi_env_stream=True),
                          options=f"--gpu-arch {arch} --enable-tvm-ffi")
        n = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        t = torch.zeros(n + 64, dtype=tdt).as_strided(shape, stride, offset)
        fn(cuda_view(t))
    assert len(launches) == 1
    return launches[0], t
