"""``PagedKVStore``: write a ragged step's new K (and V) rows into one layer of the paged cache.

One CTA per tile of ``ROWS`` consecutive rows of the step. Thread ``t < ROWS`` first resolves row ``t``'s page
and slot (``ragged_rows.resolve_rows``); then the CTA copies the tile's rows as 16-byte vectors, every thread
issuing all its loads before its stores so each has ``VECS_PER_THREAD`` requests in flight (a pure copy is
bound by how many bytes are in flight, not by instructions). Rows past the step are never read or written, rows
whose page is not in the cache (unchecked metadata running past a request's pages) are not written, and
a row's destination is ``blocks[page, kv, layer, slot, :, :]``, contiguous ``H*D`` elements, so the stores of a
row coalesce. The strided variant (``layout="strided"``, ``strided``) writes two ``[N, L, P, H, D]`` planes of
runtime strides instead (``cute_kv/kv_layout.py``), the row's heads ``sH`` apart.

FP8 caches with float32 scales (``granularity`` set): a vector is 8 input elements (bf16/fp16/fp32), the lanes
holding one (token, head, granule) reduce its absolute maximum with warp shuffles, and each element is stored as
``saturate(x / scale)`` in e4m3 with ``scale = max(amax / 448, FLT_MIN)`` (``reference/quant.py``); the granule's
first lane writes the scale. NaN and infinity give the reference's bits: a NaN anywhere in a granule makes its scale
and values NaN, an infinity makes its scale infinite (its own value NaN, the others 0).

FP8 caches scaled per tensor (``tensor_scales``: vLLM's and FlashInfer's ``k_scale`` / ``v_scale``,
``cute_kv/tensor_scales.py``): ``scales`` is the float32 ``[2]`` ``(k_scale, v_scale)``, read once a plane, and
each element is stored as ``saturate(x / scale)``; nothing is written beside the values.
"""

from __future__ import annotations

import math
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.paged.ragged_rows import resolve_rows
from cute_kv.kernels.quant import quantize_e4m3, to_e4m3

THREADS = 128
VECS_PER_THREAD = 16  # vectors in flight per thread
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


def staged_rows(rows: int, first_row: Int32, num_rows: Int32, input_row_offsets: cute.Tensor,
                cache_lengths: cute.Tensor, lookup_table: cute.Tensor, num_pages: Int32, page_size: int):
    """``(s_page, s_pos)`` in shared memory: the tile's ``rows`` rows resolved once (one thread a row), read by the
    whole CTA after the barrier. Traced inline into the calling store kernel."""
    smem = SmemAllocator()
    s_page = smem.allocate_tensor(Int32, cute.make_layout(rows), byte_alignment=4)
    s_pos = smem.allocate_tensor(Int32, cute.make_layout(rows), byte_alignment=4)
    resolve_rows(s_page, s_pos, first_row, num_rows, input_row_offsets, cache_lengths, lookup_table, num_pages,
                 page_size)
    cute.arch.sync_threads()
    return s_page, s_pos


def quantizable(granularity: int, head_dim: int) -> bool:
    """Whether a granule fits the in-kernel reduction: lanes of one warp, whole granules per head."""
    return granularity & (granularity - 1) == 0 and 8 <= granularity <= 256 and head_dim % granularity == 0


class PagedKVStore:
    """``dtype_name``: the cache dtype, or with ``granularity`` the input dtype of an e4m3 cache with float32
    scales over ``granularity`` head dims (a power of two in [8, 256] dividing ``head_dim``), or with
    ``tensor_scales`` the input dtype of an e4m3 cache scaled per tensor (K and V planes: ``kv_dim`` 2)."""

    def __init__(self, dtype_name: str, kv_dim: int, page_size: int, num_heads: int, head_dim: int,
                 granularity: Optional[int] = None, layout: str = "compact", tensor_scales: bool = False):
        if layout not in ("compact", "strided"):
            raise ValueError(f"layout must be 'compact' or 'strided', got {layout!r}")
        if tensor_scales and (granularity is not None or kv_dim != 2):
            raise ValueError("tensor_scales needs K and V planes (kv_dim 2) without granule scales")
        self.strided = layout == "strided"
        self.in_dtype = DTYPES[dtype_name]
        self.kv_dim, self.page_size, self.num_heads, self.head_dim = kv_dim, page_size, num_heads, head_dim
        self.granularity, self.tensor_scales = granularity, tensor_scales
        if tensor_scales:
            self.dtype, self.vec = cutlass.Float8E4M3FN, 8  # 8 values: 8 bytes stored
        elif granularity is None:
            self.dtype, self.vec = self.in_dtype, 16 // (self.in_dtype.width // 8)
        else:
            if not quantizable(granularity, head_dim):
                raise ValueError(f"granularity {granularity} must be a power of two in [8, 256] dividing head_dim "
                                 f"{head_dim}")
            self.dtype, self.vec = cutlass.Float8E4M3FN, 8  # 8 values: 8 bytes stored, one lane of a granule
        if head_dim % self.vec:
            raise ValueError(f"head_dim {head_dim} is not a multiple of {self.vec} ({dtype_name} vectors)")
        self.row_vecs = num_heads * head_dim // self.vec  # vectors per row of K (or V)
        # Enough rows per CTA to give every thread VECS_PER_THREAD vectors (K and V together), at most THREADS
        # (one resolving thread per row).
        self.rows = max(1, min(THREADS, THREADS * VECS_PER_THREAD // (kv_dim * self.row_vecs)))
        self.vecs_per_thread = math.ceil(self.rows * self.row_vecs / THREADS)  # per K (or V) plane

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        """Fake tensors with MAX's contract (strided: the planes' strides runtime, whole 16-byte units); the row
        strides of ``k``/``v`` are runtime (views of a QKV output)."""
        kvd, p, h, d, vec = self.kv_dim, self.page_size, self.num_heads, self.head_dim, self.vec
        n, nl, b, cols, t = (cute.sym_int32() for _ in range(5))

        def cache(dtype, depth):
            return make_fake_tensor(dtype, (n, kvd, nl, p, h, depth), stride=(
                cute.sym_int64(divisibility=kvd * p * h * depth), cute.sym_int64(divisibility=p * h * depth),
                p * h * depth, h * depth, depth, 1), assumed_align=16 if depth * dtype.width % 128 == 0 else 4)

        def rows():
            return make_fake_tensor(self.in_dtype, (t, h, d), stride=(cute.sym_int64(divisibility=vec), d, 1),
                                    assumed_align=16)

        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        def plane():
            unit = 128 // self.dtype.width
            return make_fake_tensor(self.dtype, (n, nl, p, h, d), stride=(
                *(cute.sym_int64(divisibility=unit) for _ in range(4)), 1), assumed_align=16)

        scales = None if self.granularity is None else cache(cutlass.Float32, d // self.granularity)
        if self.tensor_scales:
            scales = make_fake_compact_tensor(cutlass.Float32, (2,), assumed_align=4)
        tail = (scales, lengths, lut, Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True))
        if self.strided:
            return (rows(), rows() if kvd == 2 else None, offsets, plane(), plane() if kvd == 2 else None, *tail)
        return (rows(), rows() if kvd == 2 else None, offsets, cache(self.dtype, d), *tail)

    def build(self) -> tuple:
        """``(jit function, *fake args)``: ``__call__`` for MAX's compact layout, ``call_strided`` else."""
        return (self.call_strided if self.strided else self), *self.fake_args()

    @cute.jit
    def __call__(self, k: cute.Tensor, v: Optional[cute.Tensor], input_row_offsets: cute.Tensor,
                 blocks: cute.Tensor, scales: Optional[cute.Tensor], cache_lengths: cute.Tensor,
                 lookup_table: cute.Tensor, layer_idx: Int32, stream: cuda.CUstream):
        grid = (cute.ceil_div(k.shape[0], self.rows), 1, 1)
        self.kernel(k, v, input_row_offsets, blocks, None, scales, cache_lengths, lookup_table, layer_idx).launch(
            grid=grid, block=(THREADS, 1, 1), stream=stream)

    @cute.jit
    def call_strided(self, k: cute.Tensor, v: Optional[cute.Tensor], input_row_offsets: cute.Tensor,
                     key_blocks: cute.Tensor, value_blocks: Optional[cute.Tensor], scales: Optional[cute.Tensor],
                     cache_lengths: cute.Tensor, lookup_table: cute.Tensor, layer_idx: Int32, stream: cuda.CUstream):
        """The strided variant: ``key_blocks`` / ``value_blocks`` ``[N, L, P, H, D]`` (``value_blocks`` None for
        MLA), the compact ``scales`` as ever."""
        grid = (cute.ceil_div(k.shape[0], self.rows), 1, 1)
        self.kernel(k, v, input_row_offsets, key_blocks, value_blocks, scales, cache_lengths, lookup_table,
                    layer_idx).launch(grid=grid, block=(THREADS, 1, 1), stream=stream)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: Optional[cute.Tensor], input_row_offsets: cute.Tensor, blocks: cute.Tensor,
               value_blocks: Optional[cute.Tensor], scales: Optional[cute.Tensor], cache_lengths: cute.Tensor,
               lookup_table: cute.Tensor, layer_idx: Int32):
        vec, rows, row_vecs = self.vec, self.rows, self.row_vecs
        d_vecs = self.head_dim // vec
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        first_row = bidx * rows
        num_rows = k.shape[0]

        s_page, s_pos = staged_rows(rows, first_row, num_rows, input_row_offsets, cache_lengths, lookup_table,
                                    blocks.shape[0], self.page_size)

        for kv in cutlass.range_constexpr(self.kv_dim):
            src = k if cutlass.const_expr(kv == 0) else v
            plane_scale = Float32(1.0)
            if cutlass.const_expr(self.tensor_scales):
                plane_scale = Float32(scales[kv])
            frags = [cute.make_rmem_tensor((vec,), self.in_dtype) for _ in range(self.vecs_per_thread)]
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                i = tidx + j * THREADS  # vector i of the tile: row i // row_vecs, head, vector within the head
                r = i // row_vecs
                if cutlass.const_expr(self.granularity is not None):
                    frags[j].fill(0.0)  # idle lanes still join their granule's shuffles
                if i < rows * row_vecs and first_row + r < num_rows:
                    h = (i % row_vecs) // d_vecs
                    cute.autovec_copy(cute.local_tile(src[first_row + r, h, None], (vec,), (i % d_vecs,)), frags[j])
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                i = tidx + j * THREADS
                r = i // row_vecs
                out = frags[j]
                scale = Float32(0.0)
                if cutlass.const_expr(self.tensor_scales):
                    vals = cute.make_rmem_tensor((vec,), Float32)
                    vals.store(frags[j].load().to(Float32))
                    out = to_e4m3(vals, plane_scale)
                elif cutlass.const_expr(self.granularity is not None):
                    out, scale = self.quantize(frags[j])
                if i < rows * row_vecs and first_row + r < num_rows:
                    page = s_page[r]
                    if page >= 0:  # a row whose page is in the cache
                        h = (i % row_vecs) // d_vecs
                        slot = s_pos[r] % self.page_size
                        if cutlass.const_expr(self.strided):
                            plane = blocks if cutlass.const_expr(kv == 0) else value_blocks
                            dst = plane[page, layer_idx, slot, h, None]
                        else:
                            dst = blocks[page, kv, layer_idx, slot, h, None]
                        cute.autovec_copy(out, cute.local_tile(dst, (vec,), (i % d_vecs,)))
                        if cutlass.const_expr(self.granularity is not None):
                            lanes = self.granularity // vec
                            if i % lanes == 0:
                                scales[page, kv, layer_idx, slot, h, (i % d_vecs) // lanes] = scale

    @cute.jit
    def quantize(self, frag: cute.Tensor):
        """``(e4m3 values, scale)`` of this lane's 8 values; the scale is shared by the granule's lanes."""
        vals = cute.make_rmem_tensor((self.vec,), Float32)
        vals.store(frag.load().to(Float32))
        return quantize_e4m3(vals, self.granularity)
