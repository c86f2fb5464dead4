"""The SM90 softmax's branchless mask (``softmax.scores``) counts a row's visible keys in the thread's registers:
it holds only while a thread's accumulator columns are keys ``first + 8 j + e`` (``e`` 0 or 1), the layout of one
wgmma atom along N. Traced (no compile) for the QK tiles the SM90 kernels build."""

import re

import pytest

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.base_dsl.dsl import BaseDSL
from cutlass.cute.nvgpu import OperandMajorMode

from cute_kv.kernels.attention import softmax

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float8_e4m3fn": cutlass.Float8E4M3FN}


def register_keys(dtype_name: str, n: int) -> str:
    layouts = []

    @cute.jit
    def trace(name: cutlass.Constexpr, cols: cutlass.Constexpr):
        dt = DTYPES[name]
        mma = sm90_utils.make_trivial_tiled_mma(dt, dt, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
                                                (1, 1, 1), (64, cols))
        coords = softmax.mn_view(mma.get_slice(0).partition_C(cute.make_identity_tensor((64, cols))))
        layouts.append(str(coords.layout))

    trace(dtype_name, n)
    return layouts[0]


@pytest.mark.parametrize("dtype_name, n", [("bfloat16", 64), ("bfloat16", 80), ("bfloat16", 112), ("bfloat16", 128),
                                           ("float16", 112), ("bfloat16", 32), ("float8_e4m3fn", 32)])
def test_a_threads_columns_are_pairs_every_8_keys(dtype_name, n, monkeypatch):
    """(attention's key tiles of 64-128, MLA's 32-key halves): rows 8 apart, columns (2, n/8) with strides (1, 8)."""
    # the wgmma atom's arch, whatever the DSL's default (read once, at its import)
    monkeypatch.setattr(BaseDSL._get_dsl().envar, "arch", "sm_90a")
    layout = register_keys(dtype_name, n)
    assert re.fullmatch(rf"\(\(2,1\),\(2,{n // 8},1\)\):\(\(8@0,0\),\(1@1,8@1,0\)\)", layout), layout
