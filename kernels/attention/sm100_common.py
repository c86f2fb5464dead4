"""Softmax-warpgroup device helpers shared by the SM100 attention kernels (``sm100.PagedAttentionSm100`` and the
MLA kernel ``mla/sm100.MlaDecodeSm100``): thread ``t`` of a warpgroup owns row ``t % 128`` of O in tensor
memory (TMEM lane ``t % 128``; a warp reaches only its 32 lanes of the 128, ``warp % 4``). The kernels differ in how many O columns a CTA holds (the MHA head dim; MLA's value
half), which the callers pass. Also the fp8 converter's row dequantization (``dequantize_row``), which both use."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import T, dsl_user_op

from cute_kv.kernels.attention.config import BM, VEC
from cute_kv.kernels.attention.sm100_config import EXP2_POLY

NEG_INF = Float32(float("-inf"))
LN2 = math.log(2.0)
O_CHUNK = 32  # O columns per tcgen05.ld/st in the rescale and the epilogue (``o_chunk``)


def o_chunk(cols: int) -> int:
    """O columns per tcgen05.ld/st for an O of ``cols`` columns: ``O_CHUNK``, or 16 where that leaves a remainder
    (80: pieces of 32 would drop the last 16 columns)."""
    return math.gcd(O_CHUNK, cols)


@cute.jit
def o_copies(t_o: cute.Tensor, chunk: cutlass.Constexpr[int]):
    """This thread's row of O in ``chunk``-column pieces: (TMEM load, TMEM store, source, destination, register
    shape); piece ``i`` is the source / destination iterator moved by ``i * chunk``."""
    tidx = cute.arch.thread_idx()[0] % BM
    piece = cute.composition(t_o, cute.make_layout((BM, chunk)))
    load = tcgen05.make_tmem_copy(cute.make_copy_atom(
        tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), piece).get_slice(tidx)
    store = tcgen05.make_tmem_copy(cute.make_copy_atom(
        tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(chunk)), Float32), piece).get_slice(tidx)
    shape = load.partition_D(cute.make_identity_tensor((BM, chunk))).shape
    return load, store, load.partition_S(piece), store.partition_D(piece), shape


@cute.jit
def rescale_o(t_o: cute.Tensor, corr: Float32, cols: cutlass.Constexpr[int]):
    """This thread's row of O (its first ``cols`` columns) *= ``corr`` in TMEM, between the PV MMAs of two tiles."""
    chunk = o_chunk(cols)
    load, store, src, dst, shape = o_copies(t_o, chunk)
    vals = cute.make_rmem_tensor(shape, Float32)
    for i in cutlass.range_constexpr(cols // chunk):
        cute.copy(load, cute.make_tensor(src.iterator + i * chunk, src.layout), vals)
        # tcgen05.wait::ld before the store overwrites the cells just loaded: a register dependency orders the
        # load's data, not its Tensor Memory read before a later write (PTX ISA 9.7.16.6.4.5). The multiply needs
        # the data anyway, so the wait costs no time.
        cute.arch.fence_view_async_tmem_load()
        for e in cutlass.range_constexpr(0, cute.size(vals), 2):
            vals[e], vals[e + 1] = cute.arch.mul_packed_f32x2((vals[e], vals[e + 1]), (corr, corr))
        cute.copy(store, vals, cute.make_tensor(dst.iterator + i * chunk, dst.layout))


def row_reduce(vals: cute.Tensor, init: Float32, op) -> Float32:
    """``op`` over ``init`` and the row's values (traced inline), in four independent chains: a quarter of the
    dependency latency of one chain."""
    part = [op(init, vals[0]), vals[1], vals[2], vals[3]]
    for c in range(4, cute.size(vals)):
        part[c % 4] = op(part[c % 4], vals[c])
    return op(op(part[0], part[1]), op(part[2], part[3]))


def row_add(vals: cute.Tensor, init: Float32) -> Float32:
    """``init`` + the row's values in two f32x2 chains (four lanes): half the add instructions of scalar
    chains, a quarter of one chain's latency."""
    a = (vals[0], vals[1])
    b = (vals[2], vals[3])
    for c in range(4, cute.size(vals), 4):
        a = cute.arch.add_packed_f32x2(a, (vals[c], vals[c + 1]))
        b = cute.arch.add_packed_f32x2(b, (vals[c + 2], vals[c + 3]))
    a = cute.arch.add_packed_f32x2(a, b)
    return init + (a[0] + a[1])


@cute.jit
def scale_scores(scores: cute.Tensor, score_scale: Float32, softcap: cutlass.Constexpr[bool], cap_log2: Float32):
    """This thread's row of S, in place, to base-2 logits: ``* score_scale`` (f32x2: two scores an instruction),
    then with ``softcap`` ``cap_log2 * tanh``."""
    for c in cutlass.range(0, cute.size(scores), 2, unroll_full=True):
        scores[c], scores[c + 1] = cute.arch.mul_packed_f32x2((scores[c], scores[c + 1]),
                                                              (score_scale, score_scale))
        if cutlass.const_expr(softcap):
            scores[c] = cap_log2 * cute.math.tanh(scores[c], fastmath=True)
            scores[c + 1] = cap_log2 * cute.math.tanh(scores[c + 1], fastmath=True)


@cute.jit
def exp_scores(scores: cute.Tensor, row_max: Float32):
    """The online softmax's step over this thread's (masked) row of S, in place: ``p = 2^(s - new max)``. Returns
    ``(new_max, corr)``, ``corr = 2^(row_max - new_max)`` the factor of the running sum and of O. The sum is the
    caller's (the kernels reduce it differently)."""
    new_max, ref, corr = update_max(scores, row_max, 0.0, None)
    exp2_scores(scores, ref, 0, None)
    return new_max, corr


@cute.jit
def update_max(scores: cute.Tensor, row_max: Float32, threshold: cutlass.Constexpr[float], scale):
    """The row's new running max over this tile of (masked) logits: ``(new_max, ref, corr)`` in base 2, the scores'
    exponent reference ``ref`` (the max, 0 while nothing is visible) and ``corr = 2^(row_max - ref)``. ``scale``:
    the scores are raw, ``scale`` (> 0) times them the base-2 logits (None: they are base-2 logits). With
    ``threshold`` > 0 a max that moved up by at most ``threshold`` is not taken (FA4's ``rescale_threshold``): the row
    keeps its old reference and ``corr`` is exactly 1, so O needs no rescale; ``p`` then reaches ``2^threshold`` at
    most, and the final ``O / l`` uses the same reference for both, so the result is unchanged."""
    new_max = row_max
    if cutlass.const_expr(scale is None):
        new_max = row_reduce(scores, row_max, cute.arch.fmax)
    else:
        new_max = cute.arch.fmax(row_max, row_reduce(scores, NEG_INF, cute.arch.fmax) * scale)
    if cutlass.const_expr(threshold > 0.0):
        if new_max - row_max <= Float32(threshold):  # false while row_max is -inf (inf or NaN)
            new_max = row_max
    ref = new_max
    if new_max == NEG_INF:
        ref = Float32(0.0)  # nothing visible yet: every p and the correction are 0
    corr = cute.math.exp2(row_max - ref, fastmath=True)
    return new_max, ref, corr


@cute.jit
def exp2_scores(scores: cute.Tensor, ref: Float32, emulate: cutlass.Constexpr[int], scale):
    """``p = 2^(scale * s - ref)`` over the row in place (``scale`` None: ``2^(s - ref)``), one f32x2 FMA (or
    subtraction) for two scores. With ``emulate`` n > 0, the row's first n pairs (``sm100_config.EXP2_EMULATION``) go to
    ``exp2_fma`` on the FMA pipe instead of the MUFU (16 results a clock per SM, against 128 FMA lanes; FA4's
    ``ex2_emu_freq``)."""
    for c in cutlass.range_constexpr(0, cute.size(scores), 2):
        if cutlass.const_expr(scale is None):
            scores[c], scores[c + 1] = cute.arch.sub_packed_f32x2((scores[c], scores[c + 1]), (ref, ref))
        else:
            scores[c], scores[c + 1] = cute.arch.fma_packed_f32x2((scores[c], scores[c + 1]), (scale, scale),
                                                                  (-ref, -ref))
        if cutlass.const_expr(c // 2 < emulate):
            scores[c], scores[c + 1] = exp2_fma(scores[c], scores[c + 1])
        else:
            scores[c] = cute.math.exp2(scores[c], fastmath=True)
            scores[c + 1] = cute.math.exp2(scores[c + 1], fastmath=True)


ROUND_SHIFT = float(2**23 + 2**22)  # x + this, rounded down, holds floor(x) in its low mantissa bits


def exp2_fma(x: Float32, y: Float32):
    """``(2^x, 2^y)`` on the FMA pipe for x, y in [-127, 128) (the lagging row max lets them reach
    ``RESCALE_THRESHOLD``, +8): floor by a rounded-down add of ``ROUND_SHIFT``, ``2^frac`` by ``EXP2_POLY`` in f32x2
    Horner steps, the floor added to the exponent bits (field 1-254 for floors -126 to 127). Inputs are clamped at
    -127, where the field is 0 and the result exactly 0; from -127 to -126 it stays under 2^-126."""
    lo = Float32(-127.0)
    xy = (cute.arch.fmax(x, lo), cute.arch.fmax(y, lo))
    shifted = cute.arch.add_packed_f32x2(xy, (ROUND_SHIFT, ROUND_SHIFT), rnd="rm")
    floors = cute.arch.sub_packed_f32x2(shifted, (ROUND_SHIFT, ROUND_SHIFT))
    frac = cute.arch.sub_packed_f32x2(xy, floors)
    c = EXP2_POLY
    poly = (Float32(c[3]), Float32(c[3]))
    for k in (2, 1, 0):
        poly = cute.arch.fma_packed_f32x2(poly, frac, (Float32(c[k]), Float32(c[k])))
    return _add_exponent(shifted[0], poly[0]), _add_exponent(shifted[1], poly[1])


@dsl_user_op
def _add_exponent(shifted: Float32, mantissa: Float32, *, loc=None, ip=None) -> Float32:
    """``mantissa * 2^floor``: the floor (low bits of ``shifted``) shifted into the exponent field and added as an
    integer (``shl`` and ``add.s32``, no float op)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(shifted).ir_value(loc=loc, ip=ip), Float32(mantissa).ir_value(loc=loc, ip=ip)],
        "{\n.reg .b32 s, m, e;\nmov.b32 s, $1;\nmov.b32 m, $2;\nshl.b32 e, s, 23;\nadd.s32 e, e, m;\n"
        "mov.b32 $0, e;\n}", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def row_normalizer(row_max: Float32, row_sum: Float32, sinks, head, split, has_sinks: cutlass.Constexpr[bool]):
    """The epilogue's factor of a row (base 2): ``(top, total, inv)``, O / l = O * ``inv`` with ``total`` the
    denominator and ``top`` its max, so ``lse = top + log2 total``. The sink (natural log, of query head
    ``head``) joins split 0's denominator only. ``inv`` is 0 for a row with no visible key."""
    total = row_sum
    top = row_max
    if cutlass.const_expr(has_sinks):
        if split == 0:
            sink = Float32(sinks[head]) * Float32(1.0 / LN2)
            top = cute.arch.fmax(row_max, sink)
            total = row_sum * cute.math.exp2(row_max - top, fastmath=True) + cute.math.exp2(sink - top,
                                                                                            fastmath=True)
    inv = Float32(0.0)
    if row_sum > 0.0:
        inv = cute.math.exp2(row_max - top, fastmath=True) / total
    return top, total, inv


@cute.jit
def write_lse(lse: cute.Tensor, lse_part: cute.Tensor, q_start, tok, head, split, num_splits, top: Float32,
              total: Float32, return_lse: cutlass.Constexpr[bool]):
    """A row's log-sum-exp: base 2 into this split's ``lse_part`` for ``AttentionCombine``, or (one split, with
    ``return_lse``) natural into ``lse``; -inf for a row with no visible key and no sink. The row ``q_start + tok``
    is formed at each store, as the kernels wrote it inline (their PTX unchanged by the sharing)."""
    lse2 = NEG_INF
    if total > 0.0:
        lse2 = top + cute.math.log2(total, fastmath=True)
    if num_splits == 1:
        if cutlass.const_expr(return_lse):
            lse[q_start + tok, head] = lse2 * Float32(LN2)
    else:
        lse_part[split, q_start + tok, head] = lse2


def softmax_pipelines(s_bars, p_bars, one_cta: cute.Layout, softmax_threads: int, s_released: bool = True):
    """The CTA's S pipeline (MMA warp -> softmax warpgroup: two S buffers in TMEM, each released once read) and
    P/O pipeline (softmax warpgroup -> MMA warp: P written and O rescaled, one stage); their barriers are
    initialized here and made visible by the caller's first CTA barrier (``defer_sync``). ``s_released`` False: S
    is only its two full barriers (an ``MbarrierArray``: the MMA warp commits to it, the softmax waits on it) for a
    kernel whose MMAs' issue order stands in for S's release (``attention/sm100.py``): ``s_bars`` holds 2 barriers,
    not 4, and no empty barrier is initialized that nothing would arrive on."""
    thread = pipeline.Agent.Thread
    if s_released:
        s_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=s_bars, num_stages=2, producer_group=pipeline.CooperativeGroup(thread),
            consumer_group=pipeline.CooperativeGroup(thread, softmax_threads), cta_layout_vmnk=one_cta,
            defer_sync=True)
    else:
        s_pipe = pipeline.MbarrierArray(barrier_storage=s_bars, num_stages=2,
                                        agent=(pipeline.PipelineOp.TCGen05Mma, pipeline.CooperativeGroup(thread)))
    p_pipe = pipeline.PipelineAsyncUmma.create(
        barrier_storage=p_bars, num_stages=1,
        producer_group=pipeline.CooperativeGroup(thread, softmax_threads),
        consumer_group=pipeline.CooperativeGroup(thread), cta_layout_vmnk=one_cta, defer_sync=True)
    return s_pipe, p_pipe


@cute.jit
def dequantize_row(src: cute.Tensor, dst: cute.Tensor, first, step: cutlass.Constexpr[int], valid, scale_of,
                   dtype: cutlass.Constexpr):
    """Chunks ``first, first + step, ...`` of ``VEC`` values of the row ``src`` (fp8, or 16-bit) -> the 16-bit row
    ``dst``: ``x * scale_of(c)`` in float32 (``scale_of`` None: ``x``), rounded to ``dtype`` once; zeros where
    ``valid`` is false. A converter thread's share of a row of a tile the MMAs read."""
    raw = cute.make_rmem_tensor((VEC,), src.element_type)
    vals = cute.make_rmem_tensor((VEC,), dtype)
    for c in cutlass.range(first, cute.size(src) // VEC, step, unroll=1):
        vals.fill(0.0)
        if valid:
            cute.autovec_copy(cute.local_tile(src, (VEC,), (c,)), raw)
            x = raw.load().to(Float32)
            if cutlass.const_expr(scale_of is not None):
                x = x * scale_of(c)
            vals.store(x.to(dtype))
        cute.autovec_copy(vals, cute.local_tile(dst, (VEC,), (c,)))
