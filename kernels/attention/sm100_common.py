"""Softmax-warpgroup device helpers shared by the SM100 attention kernels (``sm100.PagedAttentionSm100`` and the
MLA kernel ``mla/sm100.MlaDecodeSm100``): thread ``t`` of the softmax warpgroup owns row ``t`` of O in tensor
memory (TMEM lane ``t``). The kernels differ in how many O columns a CTA holds (the MHA head dim; MLA's value
half), which the callers pass."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05

from cute_kv.kernels.attention.config import BM

O_CHUNK = 32  # O columns per tcgen05.ld/st in the rescale and the epilogue


@cute.jit
def o_copies(t_o: cute.Tensor):
    """This thread's row of O in ``O_CHUNK``-column pieces: (TMEM load, TMEM store, source, destination, register
    shape); piece ``i`` is the source / destination iterator moved by ``i * O_CHUNK``."""
    tidx, _, _ = cute.arch.thread_idx()
    piece = cute.composition(t_o, cute.make_layout((BM, O_CHUNK)))
    load = tcgen05.make_tmem_copy(cute.make_copy_atom(
        tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32), piece).get_slice(tidx)
    store = tcgen05.make_tmem_copy(cute.make_copy_atom(
        tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(O_CHUNK)), Float32), piece).get_slice(tidx)
    shape = load.partition_D(cute.make_identity_tensor((BM, O_CHUNK))).shape
    return load, store, load.partition_S(piece), store.partition_D(piece), shape


@cute.jit
def rescale_o(t_o: cute.Tensor, corr: Float32, cols: cutlass.Constexpr[int]):
    """This thread's row of O (its first ``cols`` columns) *= ``corr`` in TMEM, between the PV MMAs of two tiles."""
    load, store, src, dst, shape = o_copies(t_o)
    vals = cute.make_rmem_tensor(shape, Float32)
    for i in cutlass.range_constexpr(cols // O_CHUNK):
        cute.copy(load, cute.make_tensor(src.iterator + i * O_CHUNK, src.layout), vals)
        for e in cutlass.range_constexpr(0, cute.size(vals), 2):
            vals[e], vals[e + 1] = cute.arch.mul_packed_f32x2((vals[e], vals[e + 1]), (corr, corr))
        cute.copy(store, vals, cute.make_tensor(dst.iterator + i * O_CHUNK, dst.layout))
