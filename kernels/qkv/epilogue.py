"""The fused-QKV epilogue, written once for quack's SM90 and SM100 GEMM cores (``kernels/qkv/gemm.py``).

quack's epilogue driver hands each epilogue warp its accumulator one sub-tile at a time (``tRS_rD``, from
registers on SM90, from TMEM on SM100). No ``D`` tensor exists: the hooks below stage every sub-tile in float32
shared memory (``epi_end_loop``), and once the tile is whole (``epi_end``) each thread takes one 8-column chunk
and walks rows: add bias, RMS-normalize (QK-norm: the sum of squares of a head is reduced across the lanes that
hold it), rotate (RoPE at ``cache_lengths[b] + i``; a neox partner is ``R/2`` columns away in the staged tile),
round once, and store 16 bytes to ``output[m, n:n+8]`` or ``blocks[page, kv, layer, pos % P, head, d:d+8]``
(fp8 caches: 8 e4m3 bytes, quantized with the per-granule float32 or e8m0 scale the granule's lanes reduce). A
strided cache (``QKVSpec.strided``) is two ``[N, L, P, H, D]`` planes of runtime strides instead, ``blocks`` (K)
and ``value_blocks`` (V), written at ``[page, layer, pos % P, head, d:d+8]``; its scales stay compact.

Rows are resolved once per tile (``epi_begin``: binary search over ``input_row_offsets``, page from the lookup
table). A row whose page column lies past the table or whose page entry is not below the number of pages is not
written (``page = -1``): no input makes the kernel write outside ``output`` and ``blocks``.
A RoPE position outside ``freqs_cis`` (unchecked metadata) reads no table row: the dims it would rotate become NaN.

MLA's latent norm and rope-aware FP8 rows (``QKVSpec.cross_dims``) reduce over more columns than a tile holds: a
chunk among the latent's first ``cross_dims`` dims goes to the float32 workspace instead of the cache (with the
row's partial sum of squares), and ``arrive`` counts the tile's arrival on its M tile; the last arriver
finishes the rows (``_finish_latent``). Q chunks and the rest of the latent (a rope-aware row's bf16 tail) are
stored by their own tile as above. Normalized or neox-rotated heads wider than a tile (``QKVSpec.wide``: head
size 256, Gemma 3) go the same way, one counter per head: each of the head's tiles writes its columns (bias
added) to the workspace, and the last to arrive normalizes, rotates and stores the head (``_finish_heads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from quack.cute_dsl_utils import ParamsBase, mlir_namedtuple
from quack.epilogue.ops import EpiSmemBytes

from cute_kv.kernels.paged.ragged_rows import resolve_row
from cute_kv.kernels.quant import lane_amax, lanes_scale, quantize_e4m3, to_e4m3

VEC = 8  # 16-bit elements per 16-byte store (8 bytes for an fp8 cache)
C_PAD = 4  # fp32 words of padding per staged row: consecutive rows start on different banks
EPI_THREADS = 128  # epilogue threads per tile on both cores (SM90: an MMA warpgroup; SM100: the 4 epilogue warps)


@mlir_namedtuple
class QKVEpilogueArguments(NamedTuple):
    output: cute.Tensor  # [T, q_dim]
    blocks: cute.Tensor  # [N, KVD, L, P, H, D]
    input_row_offsets: cute.Tensor
    cache_lengths: cute.Tensor
    lookup_table: cute.Tensor
    layer_idx: Int32
    bias: Optional[cute.Tensor] = None  # [N_tot]
    freqs_cis: Optional[cute.Tensor] = None  # [positions, R]
    q_norm: Optional[cute.Tensor] = None  # [C_q] float32
    k_norm: Optional[cute.Tensor] = None  # [C_k] float32
    scales: Optional[cute.Tensor] = None  # [N, KVD, L, P, H, D / granularity] float32 (e8m0: uint8 bytes)
    workspace: Optional[cute.Tensor] = None  # [rows, QKVSpec.workspace_cols] float32: the latent before its finish
    counters: Optional[cute.Tensor] = None  # [M tiles * counter_groups] int32, zero between launches: tiles arrived
    value_blocks: Optional[cute.Tensor] = None  # strided: the V plane [N, L, P, H, D] (``blocks``: the K plane)


@dataclass
class QKVEpilogueParams(ParamsBase):
    output: cute.Tensor
    blocks: cute.Tensor
    input_row_offsets: cute.Tensor
    cache_lengths: cute.Tensor
    lookup_table: cute.Tensor
    layer_idx: Int32
    bias: Optional[cute.Tensor] = None
    freqs_cis: Optional[cute.Tensor] = None
    q_norm: Optional[cute.Tensor] = None
    k_norm: Optional[cute.Tensor] = None
    scales: Optional[cute.Tensor] = None  # [N, KVD, L, P, H, D / granularity] float32
    workspace: Optional[cute.Tensor] = None
    counters: Optional[cute.Tensor] = None
    value_blocks: Optional[cute.Tensor] = None


class QKVEpilogueMixin:
    """Mixed in before ``GemmSm90``/``GemmSm100``. The subclass sets ``self.qkv`` (a ``QKVSpec``) before compiling."""

    EpilogueArguments = QKVEpilogueArguments
    EpilogueParams = QKVEpilogueParams
    epi_threads = EPI_THREADS  # threads running the epilogue (``s_thread`` has one word each)

    def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
        return QKVEpilogueParams(*args)

    @classmethod
    def epi_smem_bytes(cls, args, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
        bm, bn = cta_tile_shape_mnk[0], cta_tile_shape_mnk[1]
        return EpiSmemBytes(unstaged=bm * (bn + C_PAD) * 4 + 2 * bm * 4 + cls.epi_threads * 4 + 64)

    def epi_get_smem_struct(self, params):
        bm, bn = self.cta_tile_shape_mnk[0], self.cta_tile_shape_mnk[1]
        assert self.num_epi_warps * cute.arch.WARP_SIZE == self.epi_threads, "s_thread needs a word per thread"
        fields = {"s_c": cute.struct.Align[cute.struct.MemRange[Float32, bm * (bn + C_PAD)], 16],
                  "s_page": cute.struct.Align[cute.struct.MemRange[Int32, bm], 16],
                  "s_pos": cute.struct.Align[cute.struct.MemRange[Int32, bm], 16],
                  "s_thread": cute.struct.Align[cute.struct.MemRange[Int32, self.epi_threads], 16]}
        if const_expr(self.qkv.last_arriver):  # the last arriver's flag (inside epi_smem_bytes' 64 spare bytes)
            fields["s_last"] = cute.struct.Align[cute.struct.MemRange[Int32, 4], 16]
        # Built from a dict: this module's postponed annotations would reach cute.struct as strings.
        return cute.struct(type("QKVEpiStorage", (), {"__annotations__": fields}))

    def epi_get_smem_tensors(self, params, storage):
        bm, bn = self.cta_tile_shape_mnk[0], self.cta_tile_shape_mnk[1]
        epi = storage.epi
        tensors = {"s_c": epi.s_c.get_tensor(cute.make_layout((bm, bn), stride=(bn + C_PAD, 1))),
                   "s_page": epi.s_page.get_tensor(cute.make_layout(bm)),
                   "s_pos": epi.s_pos.get_tensor(cute.make_layout(bm)),
                   "s_thread": epi.s_thread.get_tensor(cute.make_layout(self.epi_threads))}
        if const_expr(self.qkv.last_arriver):
            tensors["s_last"] = epi.s_last.get_tensor(cute.make_layout(4))
        return tensors

    @cute.jit
    def epi_begin(self, params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                  varlen_manager, epilogue_barrier, tidx, tRS_rD_layout=None):
        """Where each of the tile's rows goes; read after the sub-tile loop's barriers."""
        s_page, s_pos = epi_smem_tensors["s_page"], epi_smem_tensors["s_pos"]
        bm = self.cta_tile_shape_mnk[0]
        num_rows = params.output.shape[0]
        m0 = tile_coord_mnkl[0] * bm
        for r in cutlass.range(tidx, bm, self.num_epi_warps * cute.arch.WARP_SIZE, unroll=1):
            page, pos = resolve_row(m0 + r, num_rows, params.input_row_offsets, params.cache_lengths,
                                    params.lookup_table, params.blocks.shape[0], self.qkv.page_size)
            s_page[r] = page
            s_pos[r] = pos
        # Read back after the staging barrier (epi_end): see there.
        epi_smem_tensors["s_thread"][tidx] = tidx
        return (epi_smem_tensors["s_c"], s_page, s_pos, epi_smem_tensors["s_thread"],
                epi_smem_tensors.get("s_last"))

    @cute.jit
    def epi_end_loop(self, params, epi_tensors, epi_coord, tRS_rD, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                     tile_coord_mnkl, varlen_manager, tidx):
        """Stage this sub-tile's float32 accumulators at their tile coordinates."""
        s_c = epi_tensors[0]
        ident = cute.make_identity_tensor(cute.product_each(cute.shape(epi_tile)))
        if const_expr(tiled_copy_t2r is None):  # SM90: registers in the r2s copy's source order
            coords = tiled_copy_r2s.get_slice(tidx).partition_S(ident)
        else:  # SM100: registers loaded from TMEM, retiled for the r2s copy as quack does
            coords = tiled_copy_r2s.retile(tiled_copy_t2r.get_slice(tidx).partition_D(ident))
        sub = cute.local_tile(s_c, epi_tile, epi_coord)
        for i in cutlass.range_constexpr(cute.size(tRS_rD)):
            sub[coords[i]] = tRS_rD[i]

    @cute.jit
    def epi_end(self, params, epi_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                varlen_manager, tidx):
        s_c, s_page, s_pos, s_thread, s_last = epi_tensors
        self.epilogue_barrier.arrive_and_wait()  # the whole tile is staged
        # The thread's index as a shared-memory value read after the barrier: what the row passes derive from it
        # (columns, partner chunk, first row, norm and RoPE constants) is computed here, per tile, instead of being
        # hoisted out of the persistent tile loop and held in registers across the accumulator drain (SM100: next
        # to the 32 registers a TMEM load fills), which set the kernel's register count.
        tidx = s_thread[tidx]
        qkv_store_tile(self.qkv, s_c, s_page, s_pos, params, tile_coord_mnkl[0] * self.cta_tile_shape_mnk[0],
                       tile_coord_mnkl[1] * self.cta_tile_shape_mnk[1], tidx,
                       self.num_epi_warps * cute.arch.WARP_SIZE, self.epilogue_barrier)
        if const_expr(self.qkv.last_arriver):
            arrive(self.qkv, s_page, s_pos, s_last, params, tile_coord_mnkl[0], tile_coord_mnkl[1],
                   self.cta_tile_shape_mnk[0], self.cta_tile_shape_mnk[1], tidx,
                   self.num_epi_warps * cute.arch.WARP_SIZE, self.epilogue_barrier)
        self.epilogue_barrier.arrive_and_wait()  # staging is read before the next tile overwrites it


@cute.jit
def head_sum(x: Float32, lanes: Int32, max_lanes: cutlass.Constexpr[int]) -> Float32:
    """Sum of ``x`` over aligned groups of ``lanes`` consecutive lanes (a power of two <= ``max_lanes``): every
    lane runs the same butterfly shuffles and adds only those inside its group."""
    offset = 1
    while const_expr(offset < max_lanes):
        other = cute.arch.shuffle_sync_bfly(x, offset=offset)
        if offset < lanes:
            x = x + other
        offset *= 2
    return x


class _Chunk(NamedTuple):
    """Where a thread's 8 columns go; the same for every row of the tile."""

    col: Int32  # first column in the tile
    n: Int32  # first column of C
    in_range: cutlass.Boolean
    is_q: cutlass.Boolean
    kv: Int32  # K/V: 0 or 1
    head: Int32
    dim: Int32  # K/V: first dim within the head
    dim0: Int32  # first dim within its (Q or K/V) head
    head_size: Int32
    rotated: cutlass.Boolean  # Q or K, normalized and rotated here (V is neither; nor is a cross chunk in its tile)
    cross: cutlass.Boolean  # the latent's first cross_dims dims or a wide head: to the workspace, for the last arriver
    latent_tile: Int32  # the tile's index among the latent's column tiles (cross_dims only)


@cute.jit
def _chunk(spec: cutlass.Constexpr, n0: Int32, col: Int32, n_tile: Int32, tile: cutlass.Constexpr[bool]) -> _Chunk:
    """The chunk at column ``n0 + col`` of C; ``tile``: in its column tile's pass (a finish has no cross chunks)."""
    d, h = spec.head_dim, spec.num_heads
    n = n0 + col
    is_q = n < spec.q_dim
    kk = n - spec.q_dim
    kv = kk // (h * d)
    dim = kk % d
    head_size = Int32(d)
    dim0 = dim
    if is_q:
        head_size = Int32(spec.q_head_dim)
        dim0 = n % spec.q_head_dim
    in_range = n < spec.n_total
    cross = cutlass.Boolean(False)
    if const_expr(tile and spec.cross_dims):
        cross = in_range and not is_q and dim < spec.cross_dims
    if const_expr(tile and spec.wide[0]):
        if is_q:
            cross = cutlass.Boolean(True)
    if const_expr(tile and spec.wide[1]):
        if in_range and not is_q and kv == 0:
            cross = cutlass.Boolean(True)
    rotated = in_range and (is_q or kv == 0)
    if const_expr(tile and spec.last_arriver):
        rotated = rotated and not cross
    return _Chunk(col, n, in_range, is_q, kv, (kk // d) % h, dim, dim0, head_size, rotated, cross,
                  n_tile - spec.cross_tiles[0])


@cute.jit
def qkv_store_tile(spec: cutlass.Constexpr, s_c: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor, params,
                   m0: Int32, n0: Int32, tidx: Int32, threads: cutlass.Constexpr[int], barrier):
    """Thread ``t`` owns columns ``[c, c+8)`` (``c = 8 * (t % chunks)``) of rows ``t // chunks + k * rows_per_pass``.

    With RoPE after bias or QK-norm, a first pass adds the bias and normalizes in place, so the rotation (which
    reads its partner column from the staged tile) sees finished values and neither pass holds the other's
    per-column constants in registers.
    """
    bm, bn = s_c.shape
    chunks = bn // VEC
    chunk = _chunk(spec, n0, (tidx % chunks) * VEC, n0 // bn, True)
    first_row = tidx // chunks
    rows_per_pass = threads // chunks
    prepare = const_expr(spec.has_bias or spec.tile_norm)
    if const_expr(spec.rope is None):
        _bias_norm_rows(spec, s_c, s_page, s_pos, params, m0, first_row, rows_per_pass, chunk, True)
    else:
        if const_expr(prepare):
            _bias_norm_rows(spec, s_c, s_page, s_pos, params, m0, first_row, rows_per_pass, chunk, False)
            barrier.arrive_and_wait()
        _rope_rows(spec, s_c, s_page, s_pos, params, m0, first_row, rows_per_pass, chunk)


@cute.jit
def _bias_norm_rows(spec: cutlass.Constexpr, s_c: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor, params,
                    m0: Int32, first_row: Int32, rows_per_pass: cutlass.Constexpr[int], chunk: _Chunk,
                    store: cutlass.Constexpr[bool]):
    """``x + bias``, then RMSNorm of the head's first C dims; stored (``store``) or written back to the tile."""
    bias_v = cute.make_rmem_tensor((VEC,), Float32)
    gamma = cute.make_rmem_tensor((VEC,), Float32)  # norm weight (+ offset) where the chunk is normalized, else 1
    for e in cutlass.range_constexpr(VEC):
        bias_v[e] = Float32(0.0)
        gamma[e] = Float32(1.0)
    if const_expr(spec.has_bias):
        if chunk.in_range:
            for e in cutlass.range_constexpr(VEC):
                bias_v[e] = Float32(params.bias[chunk.n + e])
    inv_width = Float32(spec.inv_norm_width[1])  # 1 / (dims a head's norm spans): K, or Q below
    # Norm weights cover whole chunks (``supported``): one flag per chunk, not a mask per element in registers.
    normed = cutlass.Boolean(False)
    if const_expr(spec.tile_norm):
        # the latent's and wide heads' norms are the last arriver's
        q_norm = None if const_expr(spec.wide[0]) else params.q_norm
        k_norm = None if const_expr(spec.cross_dims or spec.wide[1]) else params.k_norm
        normed = (_norm_weights(q_norm, chunk.rotated and chunk.is_q, chunk.dim0, gamma, spec.norm_offset)
                  or _norm_weights(k_norm, chunk.rotated and not chunk.is_q, chunk.dim0, gamma, spec.norm_offset))
        if chunk.is_q:
            inv_width = Float32(spec.inv_norm_width[0])
    vals = cute.make_rmem_tensor((VEC,), Float32)
    for r in cutlass.range(first_row, s_c.shape[0], rows_per_pass, unroll=1):
        staged = cute.local_tile(s_c[r, None], (VEC,), (chunk.col // VEC,))
        cute.autovec_copy(staged, vals)  # 2 x 16 B
        for e in cutlass.range_constexpr(VEC):
            vals[e] = vals[e] + bias_v[e]
        if const_expr(spec.tile_norm):
            # Every lane takes part in the shuffles (rows past the step hold zeros from TMA's fill).
            ss = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                ss += vals[e] * vals[e]
            if not normed:
                ss = Float32(0.0)
            ss = head_sum(ss, chunk.head_size // VEC, spec.max_head_lanes)
            rstd = cute.math.rsqrt(ss * inv_width + Float32(spec.norm_epsilon), fastmath=False)
            if not normed:
                rstd = Float32(1.0)  # with gamma 1: kept exactly
            for e in cutlass.range_constexpr(VEC):
                vals[e] = vals[e] * rstd * gamma[e]
        if const_expr(store):
            _store_row(spec, vals, s_page, s_pos, params, m0, r, chunk, True)
        else:
            cute.autovec_copy(vals, staged)


@cute.jit
def _rope_rows(spec: cutlass.Constexpr, s_c: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor, params,
               m0: Int32, first_row: Int32, rows_per_pass: cutlass.Constexpr[int], chunk: _Chunk):
    """Rotate Q and K chunks at the row's position and store.

    A chunk lies wholly in one part of its head (``supported`` keeps ``R/2`` (neox) or ``R`` (GPT-J) a multiple of
    8): kept, the first or second neox half (partner chunk ``R/2`` columns away, two 16-byte shared loads), or
    GPT-J pairs (partners inside the chunk).
    """
    sign, freq0, partner = _rope_plan(spec, chunk)
    vals = cute.make_rmem_tensor((VEC,), Float32)
    for r in cutlass.range(first_row, s_c.shape[0], rows_per_pass, unroll=1):
        cute.autovec_copy(cute.local_tile(s_c[r, None], (VEC,), (chunk.col // VEC,)), vals)
        if sign != 0.0:
            _rotate(spec, vals, s_c[r, None], partner, None, params, s_pos[r], sign, freq0)
        _store_row(spec, vals, s_page, s_pos, params, m0, r, chunk, True)


@cute.jit
def _rope_plan(spec: cutlass.Constexpr, chunk: _Chunk):
    """``(sign, freq0, partner)`` of a chunk: ``sign`` 0 kept, -1 first neox half (``x*cos - y*sin``), +1 second
    half (``x*cos + y*sin``) or GPT-J; ``freq0`` the first ``freqs_cis`` column it reads; ``partner`` the neox
    partner chunk's column in the tile (``chunk.col ± R/2``)."""
    rope_dim, interleaved = spec.rope
    half = rope_dim // 2
    sign = Float32(0.0)
    freq0 = Int32(0)
    partner = chunk.col
    if chunk.rotated:
        if const_expr(interleaved):
            rel = chunk.dim0 - (chunk.head_size - rope_dim)
            if rel >= 0:
                sign = Float32(1.0)
                freq0 = rel
        else:
            if chunk.dim0 < half:
                sign = Float32(-1.0)
                freq0 = chunk.dim0 * 2
                partner = chunk.col + half
            elif chunk.dim0 < rope_dim:
                sign = Float32(1.0)
                freq0 = (chunk.dim0 - half) * 2
                partner = chunk.col - half
    return sign, freq0, partner


@cute.jit
def _rotate(spec: cutlass.Constexpr, vals: cute.Tensor, row: cute.Tensor, partner: Int32,
            partner_norm: Optional[tuple], params, pos: Int32, sign: Float32, freq0: Int32):
    """Rotate a chunk's ``vals`` at ``pos``: its 8 cos/sin pairs (neox) or 4 (GPT-J) are consecutive in the
    position's ``freqs_cis`` row (16-byte loads); a neox partner's 8 values are read at column ``partner`` of
    ``row`` (``partner_norm``: ``(rstd, gamma)`` the finish normalizes it with, as a tile does its own chunk).
    Unchecked positions (validate=False) read no row outside the table: what they rotate becomes NaN."""
    interleaved = spec.rope[1]
    pairs = VEC // 2 if const_expr(interleaved) else VEC  # cos/sin pairs a chunk reads
    f = cute.make_rmem_tensor((2 * pairs,), Float32)
    if pos >= 0 and pos < params.freqs_cis.shape[0]:
        cute.autovec_copy(cute.local_tile(params.freqs_cis[pos, None], (2 * pairs,), (freq0 // (2 * pairs),)), f)
        if const_expr(interleaved):
            for j in cutlass.range_constexpr(pairs):
                x, y = vals[2 * j], vals[2 * j + 1]
                vals[2 * j] = x * f[2 * j] - y * f[2 * j + 1]
                vals[2 * j + 1] = x * f[2 * j + 1] + y * f[2 * j]
        else:
            other = cute.make_rmem_tensor((VEC,), Float32)
            cute.autovec_copy(cute.local_tile(row, (VEC,), (partner // VEC,)), other)
            if const_expr(partner_norm is not None):
                rstd, gamma = partner_norm
                for e in cutlass.range_constexpr(VEC):
                    other[e] = other[e] * rstd * gamma[e]
            for e in cutlass.range_constexpr(VEC):
                vals[e] = vals[e] * f[2 * e] + sign * other[e] * f[2 * e + 1]
    else:
        vals.fill(float("nan"))


@cute.jit
def _store_row(spec: cutlass.Constexpr, vals: cute.Tensor, s_page: cute.Tensor, s_pos: cute.Tensor, params,
               m0: Int32, r: Int32, chunk: _Chunk, tile: cutlass.Constexpr[bool]):
    """Round once and store: Q (16 bytes) to ``output``, K/V into the row's page (skipped without a page); an fp8
    cache takes e4m3 values (8 bytes) and, with scales, the granule's scale (float32 or e8m0 byte) from its first
    lane. In a tile's pass (``tile``), cross chunks go to the workspace instead (``arrive`` finishes them)."""
    out = cute.make_rmem_tensor((VEC,), spec.dtype)
    out.store(vals.load().to(spec.dtype))
    kv_out, scale = out, Float32(0.0)
    if const_expr(spec.fp8 and not spec.rope_tail):
        kv_out, scale = quantize_e4m3(vals, spec.granularity, spec.e8m0)  # every lane joins the shuffles
    m = m0 + r
    if const_expr(tile and spec.last_arriver):
        _to_workspace(spec, vals, params, m, chunk)  # every lane joins the partial sum's shuffles
    stores = m < params.output.shape[0] and chunk.in_range
    if const_expr(tile and spec.last_arriver):
        stores = stores and not chunk.cross
    if stores:
        if chunk.is_q:
            cute.autovec_copy(out, cute.local_tile(params.output[m, None], (VEC,), (chunk.n // VEC,)))
        elif s_page[r] >= 0:
            slot = s_pos[r] % spec.page_size
            if const_expr(not spec.strided):
                dst = params.blocks[s_page[r], chunk.kv, params.layer_idx, slot, chunk.head, None]
                _store_cache(spec, vals, kv_out, scale, dst, params, s_page, r, slot, chunk)
            elif const_expr(spec.kv_dim == 1):
                dst = params.blocks[s_page[r], params.layer_idx, slot, chunk.head, None]
                _store_cache(spec, vals, kv_out, scale, dst, params, s_page, r, slot, chunk)
            elif chunk.kv == 0:  # a plane each: one store, its destination tensor chosen per chunk
                dst = params.blocks[s_page[r], params.layer_idx, slot, chunk.head, None]
                _store_cache(spec, vals, kv_out, scale, dst, params, s_page, r, slot, chunk)
            else:
                dst = params.value_blocks[s_page[r], params.layer_idx, slot, chunk.head, None]
                _store_cache(spec, vals, kv_out, scale, dst, params, s_page, r, slot, chunk)


@cute.jit
def _store_cache(spec: cutlass.Constexpr, vals: cute.Tensor, kv_out: cute.Tensor, scale: Float32, dst: cute.Tensor,
                 params, s_page: cute.Tensor, r: Int32, slot: Int32, chunk: _Chunk):
    """A K/V chunk into its cache row ``dst`` (``H*D`` of one head at ``dim``), and its granule's scale (page
    ``s_page[r]``)."""
    if const_expr(spec.rope_tail):  # the bf16 tail, from byte cross_dims of the row
        _store_bf16(vals, dst, 2 * chunk.dim - spec.cross_dims)
    else:
        cute.autovec_copy(kv_out, cute.local_tile(dst, (VEC,), (chunk.dim // VEC,)))
        if const_expr(spec.granularity > 0):
            if chunk.dim % spec.granularity == 0:
                params.scales[s_page[r], chunk.kv, params.layer_idx, slot, chunk.head,
                              chunk.dim // spec.granularity] = scale.to(params.scales.element_type)


@cute.jit
def _store_bf16(vals: cute.Tensor, row: cute.Tensor, byte: Int32):
    """8 values as bf16: 16 bytes at byte ``byte`` (a multiple of 16) of the e4m3 row ``row``."""
    bf16 = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
    bf16.store(vals.load().to(cutlass.BFloat16))
    cute.autovec_copy(cute.recast_tensor(bf16, cutlass.Float8E4M3FN),
                      cute.local_tile(row, (2 * VEC,), (byte // (2 * VEC),)))


@cute.jit
def _to_workspace(spec: cutlass.Constexpr, vals: cute.Tensor, params, m: Int32, chunk: _Chunk):
    """A cross chunk's float32 values into row ``m`` of the workspace (every row of the tile: the workspace has
    whole M tiles); with the latent norm, the first lane of the row stores the tile's partial sum of squares, the
    row's lanes reduced in a fixed butterfly (the same bits whichever tile finishes the row)."""
    ws = params.workspace[m, None]
    if const_expr(spec.cross_dims and spec.k_norm_dim):
        if chunk.latent_tile >= 0 and chunk.latent_tile < spec.cross_tiles[1]:  # the same for the whole tile
            ss = Float32(0.0)
            if chunk.cross:
                for e in cutlass.range_constexpr(VEC):
                    ss += vals[e] * vals[e]
            ss = head_sum(ss, spec.row_lanes, spec.row_lanes)
            if chunk.col == 0:
                ws[spec.cross_dims + chunk.latent_tile] = ss
    if chunk.cross:
        cute.autovec_copy(vals, cute.local_tile(ws, (VEC,), ((chunk.n - spec.workspace_base) // VEC,)))


@cute.jit
def arrive(spec: cutlass.Constexpr, s_page: cute.Tensor, s_pos: cute.Tensor, s_last: cute.Tensor, params,
           m_tile: Int32, n_tile: Int32, bm: cutlass.Constexpr[int], bn: cutlass.Constexpr[int], tidx: Int32,
           threads: cutlass.Constexpr[int], barrier):
    """A tile holding cross columns counts its arrival on its M tile's counter of their group (the latent: one;
    wide heads: one per head); the last of the group's tiles to arrive finishes the group's columns of the M tile's
    rows (``_finish_latent``, ``_finish_heads``; ``arrived_last``). No tile waits for another, so any persistent
    schedule completes."""
    holds = cutlass.Boolean(False)
    group = Int32(0)
    count = Int32(0)
    if const_expr(spec.cross_dims):
        first, tiles = spec.cross_tiles
        if n_tile >= first and n_tile < first + tiles:
            holds = cutlass.Boolean(True)
            count = Int32(tiles)
    else:
        q_heads, k_heads = spec.head_groups
        if const_expr(q_heads):
            if n_tile < spec.q_dim // bn:
                holds = cutlass.Boolean(True)
                group = n_tile // (spec.q_head_dim // bn)
                count = Int32(spec.q_head_dim // bn)
        if const_expr(k_heads):
            k_tile = n_tile - spec.q_dim // bn
            if k_tile >= 0 and k_tile < k_heads * (spec.head_dim // bn):
                holds = cutlass.Boolean(True)
                group = q_heads + k_tile // (spec.head_dim // bn)
                count = Int32(spec.head_dim // bn)
    if holds:
        counter = params.counters.iterator + m_tile * spec.counter_groups + group
        if arrived_last(counter, count, s_last, tidx, barrier):
            if const_expr(spec.cross_dims):
                _finish_latent(spec, s_page, s_pos, params, m_tile * bm, bm, tidx, threads)
            else:
                _finish_heads(spec, s_page, s_pos, params, m_tile * bm, group, bm, tidx, threads)


@cute.jit
def arrived_last(counter, count: Int32, s_last: cute.Tensor, tidx: Int32, barrier) -> cutlass.Boolean:
    """Counts the CTA's arrival on ``counter`` (one of ``count`` arrivals per launch): True, after an acquire fence,
    in the CTA that arrived last, which resets the counter for the next launch.

    Ordering: every thread's global stores, then its fence (release) and the CTA barrier, happen before thread 0's
    acq_rel atomic; the last arriver's atomic reads the others' releases, and its threads fence (acquire) after the
    barrier that publishes the verdict, before reading what the others stored."""
    cute.arch.fence_acq_rel_gpu()
    barrier.arrive_and_wait()
    if tidx == 0:
        arrived = cute.arch.atomic_add(counter.llvm_ptr, Int32(1), sem="acq_rel", scope="gpu")
        last = Int32(0)
        if arrived == count - 1:
            last = Int32(1)
            # every arrival of this launch is in: none touches the counter again
            cute.arch.atomic_exch(counter.llvm_ptr, Int32(0), sem="relaxed", scope="gpu")
        s_last[0] = last
    barrier.arrive_and_wait()
    last = s_last[0] != 0
    if last:
        cute.arch.fence_acq_rel_gpu()
    return last


@cute.jit
def _finish_heads(spec: cutlass.Constexpr, s_page: cute.Tensor, s_pos: cute.Tensor, params, m0: Int32,
                  group: Int32, bm: cutlass.Constexpr[int], tidx: Int32, threads: cutlass.Constexpr[int]):
    """Wide head ``group`` (Q heads, then K heads) of the M tile's rows from the workspace, as a tile would have
    finished it: RMSNorm over the head's first C dims (the row's lanes add their squares, then a fixed butterfly:
    the same bits whichever tile is last), RoPE (a neox partner read from the workspace and normalized with its own
    weights), then ``_store_row`` (Q to ``output``, K into the page; fp8 caches quantized by granule). Lane ``l`` of
    a row takes chunks ``l, l + 16, ...`` of the head: a granule's chunks are consecutive lanes, as in a tile."""
    lanes = spec.row_lanes
    q_heads, _ = spec.head_groups
    q_wide, k_wide = spec.wide
    is_q = group < q_heads
    n0 = group * spec.q_head_dim  # the head's first column of C
    head_size = Int32(spec.q_head_dim)
    inv_width = Float32(spec.inv_norm_width[0])
    if not is_q:
        n0 = spec.q_dim + (group - q_heads) * spec.head_dim
        head_size = Int32(spec.head_dim)
        inv_width = Float32(spec.inv_norm_width[1])
    q_norm = params.q_norm if const_expr(q_wide) else None
    k_norm = params.k_norm if const_expr(k_wide) else None
    has_norm = bool((q_wide and spec.q_norm_dim) or (k_wide and spec.k_norm_dim))
    per_lane = max(spec.q_head_dim if q_wide else 0, spec.head_dim if k_wide else 0) // (lanes * VEC)
    lane = tidx % lanes
    # What a lane's chunks need besides the row (the same for every row): where they are, their norm weights and
    # their RoPE plan, with the neox partner's weights.
    chunks, live, gammas, normed, plans, partner_gammas, partner_normed = [], [], [], [], [], [], []
    for j in cutlass.range_constexpr(per_lane):
        chunk = _chunk(spec, n0, (lane + j * lanes) * VEC, Int32(0), False)
        chunks.append(chunk)
        live.append(chunk.col < head_size)  # the same for the row's lanes (whole 16-chunk passes)
        gamma = cute.make_rmem_tensor((VEC,), Float32)
        gamma.fill(1.0)
        normed.append(_norm_weights(q_norm, is_q, chunk.dim0, gamma, spec.norm_offset)
                      or _norm_weights(k_norm, not is_q, chunk.dim0, gamma, spec.norm_offset))
        gammas.append(gamma)
        if const_expr(spec.rope is not None):
            sign, freq0, partner = _rope_plan(spec, chunk)
            plans.append((sign, freq0, partner - chunk.col))  # the partner's offset: the same in the workspace row
            partner_gamma = cute.make_rmem_tensor((VEC,), Float32)
            partner_gamma.fill(1.0)
            partner_normed.append(
                _norm_weights(q_norm, is_q, partner - chunk.col + chunk.dim0, partner_gamma, spec.norm_offset)
                or _norm_weights(k_norm, not is_q, partner - chunk.col + chunk.dim0, partner_gamma,
                                 spec.norm_offset))
            partner_gammas.append(partner_gamma)
    base = (n0 - spec.workspace_base) // VEC  # the head's first chunk in a workspace row
    vals = cute.make_rmem_tensor((VEC,), Float32)
    for r in cutlass.range(tidx // lanes, bm, threads // lanes, unroll=1):
        ws = params.workspace[m0 + r, None]
        rstd = Float32(1.0)
        if const_expr(has_norm):
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(per_lane):
                if live[j] and normed[j]:
                    cute.autovec_copy(cute.local_tile(ws, (VEC,), (base + chunks[j].col // VEC,)), vals)
                    for e in cutlass.range_constexpr(VEC):
                        ss += vals[e] * vals[e]
            ss = head_sum(ss, lanes, lanes)
            rstd = cute.math.rsqrt(ss * inv_width + Float32(spec.norm_epsilon), fastmath=False)
        for j in cutlass.range_constexpr(per_lane):
            if live[j]:
                col = base * VEC + chunks[j].col  # the chunk's column in the workspace row
                cute.autovec_copy(cute.local_tile(ws, (VEC,), (col // VEC,)), vals)
                if normed[j]:
                    for e in cutlass.range_constexpr(VEC):
                        vals[e] = vals[e] * rstd * gammas[j][e]
                if const_expr(spec.rope is not None):
                    sign, freq0, partner = plans[j]
                    if sign != 0.0:
                        partner_rstd = Float32(1.0)  # x * 1 * 1 is x: a partner past the norm is kept exactly
                        if partner_normed[j]:
                            partner_rstd = rstd
                        _rotate(spec, vals, ws, col + partner, (partner_rstd, partner_gammas[j]), params, s_pos[r],
                                sign, freq0)
                _store_row(spec, vals, s_page, s_pos, params, m0, r, chunks[j], False)


@cute.jit
def _finish_latent(spec: cutlass.Constexpr, s_page: cute.Tensor, s_pos: cute.Tensor, params, m0: Int32,
                   bm: cutlass.Constexpr[int], tidx: Int32, threads: cutlass.Constexpr[int]):
    """The ``cross_dims`` latent dims of the M tile's rows from the workspace: times ``rstd * gamma`` (latent
    norm: ``rstd`` from the tiles' partial sums, added in tile order), then rounded once into the cache (16-bit)
    or, for rope-aware rows, quantized with the token's scale (the amax over all of them: a first pass) and the
    float32 scale stored. Lanes ``l`` of a row take chunks ``l, l + 16, ...``: the row's 16 lanes reduce the
    amax."""
    lanes = spec.row_lanes
    chunks = spec.cross_dims // VEC
    per_lane = -(-chunks // lanes)
    lane = tidx % lanes
    vals = cute.make_rmem_tensor((VEC,), Float32)
    for r in cutlass.range(tidx // lanes, bm, threads // lanes, unroll=1):
        m = m0 + r
        ws = params.workspace[m, None]
        rstd = Float32(1.0)
        if const_expr(spec.k_norm_dim):
            ss = Float32(0.0)
            for j in cutlass.range_constexpr(spec.cross_tiles[1]):
                ss += ws[spec.cross_dims + j]
            rstd = cute.math.rsqrt(ss * Float32(1.0 / spec.k_norm_dim) + Float32(spec.norm_epsilon),
                                   fastmath=False)
        scale = Float32(1.0)
        if const_expr(spec.rope_tail):
            amax = Float32(0.0)
            for j in cutlass.range_constexpr(per_lane):
                if lane + j * lanes < chunks:
                    _latent_chunk(spec, ws, params, lane + j * lanes, rstd, vals)
                    amax = cute.arch.fmax(amax, lane_amax(vals), abs=True, nan=True)
            scale = lanes_scale(amax, lanes)
        page = s_page[r]
        if m < params.output.shape[0] and page >= 0:
            slot = s_pos[r] % spec.page_size
            if const_expr(spec.strided):
                dst = params.blocks[page, params.layer_idx, slot, 0, None]
            else:
                dst = params.blocks[page, 0, params.layer_idx, slot, 0, None]
            for j in cutlass.range_constexpr(per_lane):
                c = lane + j * lanes
                if c < chunks:
                    _latent_chunk(spec, ws, params, c, rstd, vals)
                    if const_expr(spec.rope_tail):
                        cute.autovec_copy(to_e4m3(vals, scale), cute.local_tile(dst, (VEC,), (c,)))
                    else:
                        out = cute.make_rmem_tensor((VEC,), spec.dtype)
                        out.store(vals.load().to(spec.dtype))
                        cute.autovec_copy(out, cute.local_tile(dst, (VEC,), (c,)))
            if const_expr(spec.rope_tail):
                if lane == 0:
                    params.scales[page, 0, params.layer_idx, slot, 0, 0] = scale


@cute.jit
def _latent_chunk(spec: cutlass.Constexpr, ws: cute.Tensor, params, c: Int32, rstd: Float32, vals: cute.Tensor):
    """Chunk ``c`` of a workspace row into ``vals``, normalized (latent norm)."""
    cute.autovec_copy(cute.local_tile(ws, (VEC,), (c,)), vals)
    if const_expr(spec.k_norm_dim):
        for e in cutlass.range_constexpr(VEC):
            vals[e] = vals[e] * rstd * (Float32(params.k_norm[c * VEC + e]) + Float32(spec.norm_offset))


@cute.jit
def _norm_weights(weight: Optional[cute.Tensor], applies, dim0: Int32, gamma: cute.Tensor,
                  offset: cutlass.Constexpr[float]) -> cutlass.Boolean:
    """Whether the weight covers the chunk at ``dim0`` (wholly: its dims are a multiple of 8); if so ``gamma`` takes
    its 8 weights (+ offset)."""
    covered = cutlass.Boolean(False)
    if const_expr(weight is not None):
        if applies and dim0 < weight.shape[0]:
            covered = cutlass.Boolean(True)
            for e in cutlass.range_constexpr(VEC):
                gamma[e] = Float32(weight[dim0 + e]) + Float32(offset)
    return covered
