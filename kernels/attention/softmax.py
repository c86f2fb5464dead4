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
from cutlass import Float32, Int32, Uint32
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
    new_max = cute.make_rmem_tensor(row_max.shape, Float32)
    tile_row_max(s, row_max, new_max, is_first)
    exponentiate(s, new_max, row_max, row_sum, row_scale, scale_log2, is_first)


@cute.jit
def tile_row_max(s: cute.Tensor, row_max: cute.Tensor, new_max: cute.Tensor, is_first: cutlass.Constexpr[bool]):
    """``new_max`` = the max of each row over the tile (reduced over the quad) and its running ``row_max``."""
    s_mn = mn_view(s)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        tile_max = s_mn[r, None].load().reduce(cute.ReductionOp.MAX, NEG_INF if is_first else row_max[r], 0)
        new_max[r] = quad_max(tile_max)


@cute.jit
def exponentiate(s: cute.Tensor, new_max: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                 row_scale: cute.Tensor, scale_log2: Float32, is_first: cutlass.Constexpr[bool]):
    """The second half of ``online_softmax`` once the rows' maxima ``new_max`` are known (a tile split over
    warpgroups takes the max of theirs): ``s`` becomes ``p``, the sums and ``row_max`` move on."""
    s_mn = mn_view(s)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        top = new_max[r]
        if top == NEG_INF:
            top = Float32(0.0)
        ref = top * scale_log2
        p = cute.math.exp2(s_mn[r, None].load() * scale_log2 - ref, fastmath=True)
        s_mn[r, None].store(p)
        if cutlass.const_expr(is_first):
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        else:
            # The difference first: exactly 0 (a scale of exactly 1) when the max did not move. ``old * scale -
            # ref`` is fused into one FFMA whose result is the rounding error of ``old * scale``, not 0.
            row_scale[r] = cute.math.exp2((row_max[r] - top) * scale_log2, fastmath=True)
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, row_sum[r] * row_scale[r], 0)
        row_max[r] = new_max[r]


@cute.jit
def rescale_rows(acc: cute.Tensor, row_scale: cute.Tensor):
    acc_mn = mn_view(acc)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])


@dsl_user_op
def visible_bits(first: Int32, past_end: Int32, *, loc=None, ip=None) -> Uint32:
    """The 32-bit mask of a chunk's 32 visible positions (a row's keys on SM100, a thread's registers of a row on
    SM90): bit i set for ``first <= i`` and ``i < 32 - past_end`` (``first``: the row's first visible position less
    the chunk's, ``past_end``: the chunk's end less the row's end).
    Negative amounts shift by 0; amounts of 32 or more give 0 (PTX clamps ``shl`` / ``shr`` amounts to the width,
    ISA 9.7.8.7-8), so any bounds give the right mask with no branch; a select per score then applies it (R2P
    and FSEL in SASS: FA4's ``mask_r2p``)."""
    return Uint32(llvm.inline_asm(
        T.i32(), [Int32(first).ir_value(loc=loc, ip=ip), Int32(past_end).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 ones, lo, hi;\nmov.b32 ones, -1;\nmax.s32 lo, $1, 0;\nmax.s32 hi, $2, 0;\n"
        "shl.b32 lo, ones, lo;\nshr.b32 hi, ones, hi;\nand.b32 $0, lo, hi;\n}", "=r,r,r", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def keep_range(values: cute.Tensor, positions: cutlass.Constexpr, lo: Int32, hi: Int32):
    """-inf to each of ``values`` whose position (``positions``: a constant each) lies outside ``[lo, hi)``, with no
    branch: a bit mask per 32 positions (``visible_bits``), then a select per value (a constant bit: R2P + FSEL)."""
    keep = [visible_bits(lo - 32 * k, 32 * (k + 1) - hi) for k in range(max(positions) // 32 + 1)]
    for i in cutlass.range_constexpr(len(positions)):
        bit = keep[positions[i] // 32] & (Uint32(1) << (positions[i] % 32))
        values[i] = values[i] if cutlass.Boolean(bit) else NEG_INF


@cute.jit
def scores(acc_s: cute.Tensor, coords: cute.Tensor, row_begin: cute.Tensor, row_end: cute.Tensor, key_base: Int32,
           score_scale: Float32, softcap: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool]):
    """Soft-cap (``tanh(s * scale / c)``; ``c * log2(e)`` is the softmax's scale) then, on a ``masked`` tile, each
    row's key range (``coords``: ``(row, key)`` of the registers; ``key_base``: the key of column 0).

    The mask is branchless (FA4's R2P form): a thread's columns are keys ``first + 8 j + e`` (``e`` 0 or 1, the
    accumulator's pairs), so a row's range ``[lo, hi)`` of keys is a range of its registers, ``2 (x / 8) +
    min(x % 8, 2)`` registers lying below key ``first + x`` (``keep_range``: one select per score)."""
    if cutlass.const_expr(softcap):
        for i in cutlass.range(cute.size(acc_s), unroll_full=True):
            acc_s[i] = cute.math.tanh(acc_s[i] * score_scale, fastmath=True)
    if cutlass.const_expr(masked):
        s_mn = mn_view(acc_s)
        n = cute.size(s_mn, mode=[1])
        first = coords[0, 0][1]
        span = coords[0, n - 1][1] + 1 - first
        for r in cutlass.range_constexpr(cute.size(s_mn, mode=[0])):  # bounds clamped to the thread's keys
            lo = cutlass.min(cutlass.max(row_begin[r] - key_base - first, 0), span)
            hi = cutlass.min(cutlass.max(row_end[r] - key_base - first, 0), span)
            keep_range(s_mn[r, None], list(range(n)), (lo >> 3) * 2 + cutlass.min(lo & 7, 2),
                       (hi >> 3) * 2 + cutlass.min(hi & 7, 2))


@cute.jit
def finish_row(total: Float32, top: Float32, sink: Float32, with_sink: cutlass.Constexpr[bool]):
    """``(1/l, base-2 lse)`` of a row from its sum ``total`` of ``2^(s - top)`` (``top``: its max, base 2) and, with
    ``with_sink``, a sink's base-2 logit ``sink`` (-inf: none here), which joins the denominator only; ``(0, -inf)``
    for a row that sees nothing."""
    weight = Float32(1.0)
    if cutlass.const_expr(with_sink):
        new_top = cute.arch.fmax(top, sink)
        if new_top != NEG_INF:
            weight = cute.math.exp2(top - new_top, fastmath=True)  # 0 for a row with no key
            total = total * weight + cute.math.exp2(sink - new_top, fastmath=True)
            top = new_top
    inv = Float32(0.0)
    lse2 = NEG_INF
    if total > 0.0:
        inv = weight / total
        lse2 = top + cute.math.log2(total, fastmath=True)
    return inv, lse2


@cute.jit
def rescale_rows_if_moved(acc: cute.Tensor, row_scale: cute.Tensor):
    """``rescale_rows`` unless no row of the warp changed its max (every scale exactly 1, the common case once the
    largest scores are seen): a warp-uniform vote, so the branch never diverges and the result is bit-identical."""
    moved = row_scale[0] != Float32(1.0)
    for r in cutlass.range_constexpr(1, cute.size(row_scale)):
        moved = moved | (row_scale[r] != Float32(1.0))
    if cute.arch.vote_any_sync(moved):
        rescale_rows(acc, row_scale)
