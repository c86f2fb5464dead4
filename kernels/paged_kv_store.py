"""``PagedKVStore``: write a ragged step's new K (and V) rows into one layer of the paged cache.

One CTA per tile of ``ROWS`` consecutive rows of the step. Thread ``t < ROWS`` first resolves row ``t``'s page
and slot (``ragged_rows.resolve_rows``); then the CTA copies the tile's rows as 16-byte vectors, every thread
issuing all its loads before its stores so each has ``VECS_PER_THREAD`` requests in flight (a pure copy is
bound by how many bytes are in flight, not by instructions). Rows past the step are never read or written, and
a row's destination is ``blocks[page, kv, layer, slot, :, :]``, contiguous ``H*D`` elements, so the stores of a
row coalesce.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.ragged_rows import resolve_rows

THREADS = 128
VECS_PER_THREAD = 16  # 16-byte vectors in flight per thread: 32 KiB per CTA
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16, "float32": cutlass.Float32}


class PagedKVStore:
    def __init__(self, dtype_name: str, kv_dim: int, page_size: int, num_heads: int, head_dim: int):
        self.dtype = DTYPES[dtype_name]
        self.kv_dim, self.page_size, self.num_heads, self.head_dim = kv_dim, page_size, num_heads, head_dim
        self.vec = 16 // (self.dtype.width // 8)
        if head_dim % self.vec:
            raise ValueError(f"head_dim {head_dim} is not a multiple of {self.vec} ({dtype_name} 16-byte vectors)")
        self.row_vecs = num_heads * head_dim // self.vec  # vectors per row of K (or V)
        # Enough rows per CTA to give every thread VECS_PER_THREAD vectors (K and V together), at most THREADS
        # (one resolving thread per row).
        self.rows = max(1, min(THREADS, THREADS * VECS_PER_THREAD // (kv_dim * self.row_vecs)))
        self.vecs_per_thread = math.ceil(self.rows * self.row_vecs / THREADS)  # per K (or V) plane

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        """Fake tensors with MAX's contract; the row strides of ``k``/``v`` are runtime (views of a QKV output)."""
        kvd, p, h, d, vec = self.kv_dim, self.page_size, self.num_heads, self.head_dim, self.vec
        n, nl, b, cols, t = (cute.sym_int32() for _ in range(5))
        plane = cute.sym_int64(divisibility=p * h * d)
        pitch = cute.sym_int64(divisibility=kvd * p * h * d)
        blocks = make_fake_tensor(self.dtype, (n, kvd, nl, p, h, d),
                                  stride=(pitch, plane, p * h * d, h * d, d, 1), assumed_align=16)

        def rows():
            return make_fake_tensor(self.dtype, (t, h, d), stride=(cute.sym_int64(divisibility=vec), d, 1),
                                    assumed_align=16)

        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        return (rows(), rows() if kvd == 2 else None, offsets, blocks, lengths, lut, Int32(0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, k: cute.Tensor, v: cute.Tensor, input_row_offsets: cute.Tensor, blocks: cute.Tensor,
                 cache_lengths: cute.Tensor, lookup_table: cute.Tensor, layer_idx: Int32, stream: cuda.CUstream):
        grid = (cute.ceil_div(k.shape[0], self.rows), 1, 1)
        self.kernel(k, v, input_row_offsets, blocks, cache_lengths, lookup_table, layer_idx).launch(
            grid=grid, block=(THREADS, 1, 1), stream=stream)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, k: cute.Tensor, v: cute.Tensor, input_row_offsets: cute.Tensor, blocks: cute.Tensor,
               cache_lengths: cute.Tensor, lookup_table: cute.Tensor, layer_idx: Int32):
        vec, rows, row_vecs = self.vec, self.rows, self.row_vecs
        d_vecs = self.head_dim // vec
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        first_row = bidx * rows
        num_rows = k.shape[0]

        smem = SmemAllocator()
        s_page = smem.allocate_tensor(Int32, cute.make_layout(rows), byte_alignment=4)
        s_pos = smem.allocate_tensor(Int32, cute.make_layout(rows), byte_alignment=4)
        resolve_rows(s_page, s_pos, first_row, num_rows, input_row_offsets, cache_lengths, lookup_table,
                     self.page_size)
        cute.arch.sync_threads()

        for kv in cutlass.range_constexpr(self.kv_dim):
            src = k if cutlass.const_expr(kv == 0) else v
            frags = [cute.make_rmem_tensor((vec,), self.dtype) for _ in range(self.vecs_per_thread)]
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                i = tidx + j * THREADS  # vector i of the tile: row i // row_vecs, head, 16-byte chunk
                r = i // row_vecs
                if i < rows * row_vecs and first_row + r < num_rows:
                    h = (i % row_vecs) // d_vecs
                    cute.autovec_copy(cute.local_tile(src[first_row + r, h, None], (vec,), (i % d_vecs,)), frags[j])
            for j in cutlass.range_constexpr(self.vecs_per_thread):
                i = tidx + j * THREADS
                r = i // row_vecs
                if i < rows * row_vecs and first_row + r < num_rows:
                    h = (i % row_vecs) // d_vecs
                    dst = blocks[s_page[r], kv, layer_idx, s_pos[r] % self.page_size, h, None]
                    cute.autovec_copy(frags[j], cute.local_tile(dst, (vec,), (i % d_vecs,)))
