"""Register-resident online softmax over an SM90 wgmma accumulator (one warpgroup's 64 x N tile of S).

A thread of the warpgroup holds two rows of the accumulator (``lane // 4`` and ``+ 8`` within its warp's 16), each
as ``N / 4`` values in pairs; the four threads of a quad share a row. ``mn_view`` re-indexes the accumulator as
``(rows, cols)`` of that thread, ``a_fragment_view`` as the A operand of the next wgmma (P fed from registers).

Scores stay unscaled: ``p = 2^(s * scale_log2 - max * scale_log2)`` is one FFMA and one EX2 per score; the row max
is reduced over the quad every tile, the row sum only once at the end.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

NEG_INF = Float32(float("-inf"))
LN2 = math.log(2.0)


def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """``((2, 2, N/8), 1, 1)`` accumulator -> ``((2, 1), (2, N/8, 1))``: a thread's (row, column) grid."""
    col_major = cute.make_layout(acc.layout.shape)
    shape = ((col_major.shape[0][1], col_major.shape[1]), (col_major.shape[0][0], col_major.shape[0][2],
                                                           col_major.shape[2]))
    stride = ((col_major.stride[0][1], col_major.stride[1]), (col_major.stride[0][0], col_major.stride[0][2],
                                                              col_major.stride[2]))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def a_fragment_view(acc: cute.Tensor) -> cute.Tensor:
    """The 16-bit P registers (accumulator-shaped) as the wgmma A fragment ``((2, 2, 2), 1, N/16)``: two
    adjacent 8-column groups of the accumulator form one k16 block of the A operand."""
    layout = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    view = cute.make_layout(
        ((layout.shape[0][0], layout.shape[0][1], layout.shape[0][2][0]), layout.shape[1],
         (layout.shape[0][2][1], layout.shape[2])),
        stride=((layout.stride[0][0], layout.stride[0][1], layout.stride[0][2][0]), layout.stride[1],
                (layout.stride[0][2][1], layout.stride[2])))
    return cute.make_tensor(acc.iterator, view)


@dsl_user_op
def _cvt_pair(lo: Float32, hi: Float32, dtype, *, loc=None, ip=None) -> Int32:
    """Two float32 -> one packed 16-bit pair (``lo`` in the low half), one ``cvt.rn.{bf16x2,f16x2}.f32``."""
    kind = "bf16x2" if dtype is cutlass.BFloat16 else "f16x2"
    return Int32(llvm.inline_asm(T.i32(), [Float32(lo).ir_value(loc=loc, ip=ip), Float32(hi).ir_value(loc=loc, ip=ip)],
                                 f"cvt.rn.{kind}.f32 $0, $2, $1;", "=r,f,f", has_side_effects=False,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """``dst`` (16-bit) = ``src`` (float32, same shape), a pair per instruction, converted where written: a plain
    ``.to()`` lets the compiler sink the conversion into the next iteration, which keeps the float32 P live (in 32
    more registers) across the next QK issue and makes ptxas wait for the PV before the softmax."""
    packed = cute.recast_tensor(dst, Int32)
    for i in cutlass.range(cute.size(packed), unroll_full=True):
        packed[i] = _cvt_pair(src[2 * i], src[2 * i + 1], dst.element_type)


@cute.jit
def quad_max(x: Float32) -> Float32:
    x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=2))


@cute.jit
def quad_sum(x: Float32) -> Float32:
    x = x + cute.arch.shuffle_sync_bfly(x, offset=1)
    return x + cute.arch.shuffle_sync_bfly(x, offset=2)


@cute.jit
def online_softmax(s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                   scale_log2: Float32, is_first: cutlass.Constexpr[bool]):
    """``s`` (accumulator of one tile, masked with -inf) becomes ``p``; ``row_scale`` gets ``2^(old - new max)``
    for O. A row with nothing visible yet keeps max -inf and takes 0 as reference: its p and rescale are 0."""
    s_mn = mn_view(s)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_mn[r, None].load()
        tile_max = row.reduce(cute.ReductionOp.MAX, NEG_INF if is_first else row_max[r], 0)
        new_max = quad_max(tile_max)
        ref = new_max * scale_log2
        if new_max == NEG_INF:
            ref = Float32(0.0)
        p = cute.math.exp2(row * scale_log2 - ref, fastmath=True)
        s_mn[r, None].store(p)
        if cutlass.const_expr(is_first):
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        else:
            row_scale[r] = cute.math.exp2(row_max[r] * scale_log2 - ref, fastmath=True)
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, row_sum[r] * row_scale[r], 0)
        row_max[r] = new_max


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    acc_mn = mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])
