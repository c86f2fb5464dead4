"""ptxsim.capture: the real compiled host function of a CuTe DSL GEMM runs on the CPU and its one launch is captured."""

import pytest

pytestmark = pytest.mark.sim

pytest.importorskip("cutlass")
import torch  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import from_dlpack, make_fake_stream  # noqa: E402

from ptxsim.capture import capturing, cuda_view, entry_params  # noqa: E402
from ptxsim.tensormap import decode  # noqa: E402

@pytest.fixture(scope="module")
def g06():
    from ptxsim.tests import wgmma_gemm
    return wgmma_gemm


def _tensors():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(256, 128, generator=g).bfloat16()
    b = torch.randn(128, 128, generator=g).bfloat16()
    c = torch.zeros(256, 128)
    return a, b, c


def _check_gemm_launch(launches, a, b, c):
    assert len(launches) == 1
    (l,) = launches
    assert l.kernel.startswith("kernel_cutlass_gemm_kernel")
    assert f".entry {l.kernel}(" in l.ptx and "wgmma.mma_async" in l.ptx
    assert l.grid == (2, 1, 1) and l.block == (128, 1, 1) and l.cluster == (1, 1, 1)
    # the snippet's smem: 3 stages of A and B (128x64 bf16 each) + 3 KiB of barrier/alignment slack
    assert l.dyn_smem == 3 * 2 * 128 * 64 * 2 + 3 * 1024
    sizes = [n for _, n, _ in entry_params(l.ptx, l.kernel)]
    assert [len(p) for p in l.params] == sizes and len(sizes) == 6
    descs = [decode(p) for p in l.params if len(p) == 128]
    assert len(descs) == 2
    da, db = descs
    assert (da.address, da.dims, da.strides, da.box, da.swizzle) == (a.data_ptr(), (128, 256), (2, 256), (64, 128), 128)
    assert (db.address, db.dims, db.strides, db.box, db.swizzle) == (b.data_ptr(), (128, 128), (2, 256), (64, 128), 128)
    assert da.dtype == db.dtype == "bf16"
    # C goes as a plain pointer plus its dynamic (M, N) and row stride: the 24-byte struct parameter
    cp = l.params[5]
    assert int.from_bytes(cp[:8], "little") == c.data_ptr()
    assert (int.from_bytes(cp[8:12], "little"), int.from_bytes(cp[12:16], "little")) == (256, 128)
    assert int.from_bytes(cp[16:24], "little") == 128


def test_gemm_tvm_ffi(g06):
    a, b, c = _tensors()
    fa, fb, fc, _ = g06.fake_args()
    with capturing("sm_90a") as launches:
        fn = cute.compile(g06.gemm, fa, fb, fc, make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--gpu-arch sm_90a --enable-tvm-ffi")
        fn(cuda_view(a), cuda_view(b), cuda_view(c))
    _check_gemm_launch(launches, a, b, c)
    assert launches.unknown_queries == []
    assert not c.any()  # nothing ran


def test_gemm_plain_path(g06):
    import cuda.bindings.driver as cuda
    a, b, c = _tensors()
    with capturing("sm_90a") as launches:
        fn = cute.compile(g06.gemm, *g06.fake_args(), options="--gpu-arch sm_90a")
        # the fake tensors have dynamic extents and strides: the call-time tensors must be marked the same way
        args = [from_dlpack(cuda_view(x), assumed_align=16).mark_layout_dynamic(leading_dim=1) for x in (a, b, c)]
        fn(*args, cuda.CUstream(0))
    _check_gemm_launch(launches, a, b, c)


def test_tvm_ffi_checks_still_run(g06):
    a, b, c = _tensors()
    fa, fb, fc, _ = g06.fake_args()
    with capturing("sm_90a") as launches:
        fn = cute.compile(g06.gemm, fa, fb, fc, make_fake_stream(use_tvm_ffi_env_stream=True),
                          options="--gpu-arch sm_90a --enable-tvm-ffi")
        with pytest.raises(ValueError, match="divisible"):
            fn(cuda_view(a[:, :100]), cuda_view(b), cuda_view(c))  # K = 100 breaks the divisibility promise
    assert len(launches) == 0


def test_entry_params_parse():
    ptx = """.visible .entry k(
\t.param .align 64 .b8 k_param_0[128],
\t.param .u64 .ptr .global .align 16 k_param_1,
\t.param .u32 k_param_2
)"""
    assert entry_params(ptx, "k") == [("k_param_0", 128, 64), ("k_param_1", 8, 8), ("k_param_2", 4, 4)]


def test_sm100_device_and_patches_undone():
    from cutlass.base_dsl import compiler

    from ptxsim.tests._tma_probe import capture_descriptor

    jit_before = compiler.Compiler.jit
    launch, t = capture_descriptor("bf16", (64, 32), (1, 64), (32, 8), 3, arch="sm_100a")
    assert compiler.Compiler.jit is jit_before
    assert ".target sm_100a" in launch.ptx and launch.grid == (1, 1, 1) and launch.block == (32, 1, 1)
    m = decode([p for p in launch.params if len(p) == 128][0])
    assert (m.address, m.dims, m.box, m.swizzle) == (t.data_ptr(), (64, 32), (32, 8), 128)
