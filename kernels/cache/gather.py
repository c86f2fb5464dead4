"""``PagedKVGather``: copy each request's cached tokens of one (K or V, layer) plane into a dense tensor.

One CTA per (page column j, KV head h, request b). The page is loaded with one TMA tile addressed by its
*physical page id* (read from the lookup table) as the last coordinate of the plane's ``(P, D, H, N)`` view,
whose N-stride is the runtime page pitch ``KVD*L*P*H*D`` (as FA4's paged TMA does). The tile's valid rows
(``j*P + row < cache_lengths[b]``) are then stored to ``out[b, j*P + row, h, :]`` with predicated 16-byte
vector stores, so rows past a request's length are never written. It reads the cache the way the attention
kernels will, and serves as a dense view for debugging and for unpaged consumers. The strided variant
(``layout="strided"``, ``call_strided``) takes the one ``[N, L, P, H, D]`` plane to read, its strides runtime
(``cute_kv/kv_layout.py``): the same view of it, with its own page pitch.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor
from cutlass.memory import SmemAllocator

from cute_kv.kernels.paged import tma_tiles
from cute_kv.layouts.paged import tma_page_view

THREADS = 128
PAGE_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (64, 128, 256)
DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


class PagedKVGather:
    def __init__(self, dtype_name: str, kv_dim: int, page_size: int, num_heads: int, head_dim: int,
                 layout: str = "compact"):
        if layout not in ("compact", "strided"):
            raise ValueError(f"layout must be 'compact' or 'strided', got {layout!r}")
        self.strided = layout == "strided"
        self.dtype = DTYPES[dtype_name]
        self.kv_dim, self.page_size, self.num_heads, self.head_dim = kv_dim, page_size, num_heads, head_dim
        # 16-byte vectors per row for the predicated store.
        self.vec = 16 // (self.dtype.width // 8)

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        """Fake tensors with MAX's contract: N, L, B, lookup columns, S runtime; KVD, P, H, D static (strided: the
        plane's strides runtime, whole 16-byte units)."""
        kvd, p, h, d = self.kv_dim, self.page_size, self.num_heads, self.head_dim
        n, nl, b, cols, s = (cute.sym_int32() for _ in range(5))
        plane = cute.sym_int64(divisibility=p * h * d)  # L*P*H*D: stride of the KVD mode
        pitch = cute.sym_int64(divisibility=kvd * p * h * d)  # KVD*L*P*H*D: page pitch
        if self.strided:
            unit = 128 // self.dtype.width
            blocks = make_fake_tensor(self.dtype, (n, nl, p, h, d), stride=(
                *(cute.sym_int64(divisibility=unit) for _ in range(4)), 1), assumed_align=16)
        else:
            blocks = make_fake_tensor(self.dtype, (n, kvd, nl, p, h, d),
                                      stride=(pitch, plane, p * h * d, h * d, d, 1), assumed_align=16)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        # one entry read per CTA: any row stride and a 4-byte base (a column slice of a wider table)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        out = make_fake_compact_tensor(self.dtype, (b, s, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
        index = (Int32(0),) if self.strided else (Int32(0), Int32(0))  # strided: the layer (its plane is given)
        return (blocks, lengths, lut, out, *index, Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True))

    def build(self) -> tuple:
        """``(jit function, *fake args)``: ``__call__`` for MAX's compact layout, ``call_strided`` else."""
        return (self.call_strided if self.strided else self), *self.fake_args()

    @cute.jit
    def __call__(self, blocks: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
                 out: cute.Tensor, kv_idx: Int32, layer_idx: Int32, num_page_cols: Int32, stream: cuda.CUstream):
        plane = blocks[None, kv_idx, layer_idx, None, None, None]  # (N, P, H, D), runtime offset
        self.launch(plane, cache_lengths, lookup_table, out, num_page_cols, stream)

    @cute.jit
    def call_strided(self, plane: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor,
                     out: cute.Tensor, layer_idx: Int32, num_page_cols: Int32, stream: cuda.CUstream):
        """The strided variant: ``plane`` is the ``[N, L, P, H, D]`` plane (K or V) to read."""
        self.launch(plane[None, layer_idx, None, None, None], cache_lengths, lookup_table, out, num_page_cols,
                    stream)

    def launch(self, plane: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor, out: cute.Tensor,
               num_page_cols: Int32, stream: cuda.CUstream):
        """Traced inline by both entries: the TMA view of ``plane`` ``(N, P, H, D)`` and the launch."""
        p, d = self.page_size, self.head_dim
        # 128B-swizzled K-major smem tile, the layout the MMA kernels consume; TMA moves it in 128-byte boxes.
        smem_layout = tma_tiles.smem_tile_layout(self.dtype, p, d)
        tma_load, g_kv = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), tma_page_view(plane), smem_layout, (p, d))
        smem_bytes = cute.size_in_bytes(self.dtype, smem_layout) + 1024 + 8
        self.kernel(tma_load, g_kv, cache_lengths, lookup_table, out, smem_layout).launch(
            grid=(num_page_cols, self.num_heads, cache_lengths.shape[0]), block=(THREADS, 1, 1),
            smem=smem_bytes, stream=stream)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, tma_load: cute.CopyAtom, g_kv: cute.Tensor, cache_lengths: cute.Tensor,
               lookup_table: cute.Tensor, out: cute.Tensor, smem_layout: cute.ComposedLayout):
        p, d, vec = self.page_size, self.head_dim, self.vec
        j, h, b = cute.arch.block_idx()
        tidx, _, _ = cute.arch.thread_idx()
        valid = Int32(cache_lengths[b]) - j * p  # rows of this page that hold cached tokens
        if valid > 0:
            smem = SmemAllocator()
            mbar = smem.allocate_array(cutlass.Int64, 1)
            # The swizzle on the pointer: the threads below read the tile in the pattern TMA wrote it.
            s_tile = tma_tiles.swizzled_tile(smem.allocate(cute.size_in_bytes(self.dtype, smem_layout),
                                                           byte_alignment=1024), smem_layout, self.dtype)
            warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            # elect_one() picks one lane per warp: barrier setup and the TMA issue stay in warp 0.
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            g_tiles = cute.local_tile(g_kv, (p, d), (0, 0, None, None))  # (P, D, H, N)
            t_s, t_g = cpasync.tma_partition(tma_load, 0, cute.make_layout(1), cute.group_modes(s_tile, 0, 2),
                                             cute.group_modes(g_tiles, 0, 2))
            if warp_idx == 0:
                page = Int32(lookup_table[b, j])
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(mbar, cute.size_in_bytes(self.dtype, smem_layout))
                cute.copy(tma_load, t_g[None, h, page], t_s, tma_bar_ptr=mbar)
            cute.arch.mbarrier_wait(mbar, 0)
            rows = cutlass.min(valid, p)
            vecs_per_row = d // vec
            for i in cutlass.range(tidx, rows * vecs_per_row, THREADS, unroll=1):
                row = i // vecs_per_row
                frag = cute.make_rmem_tensor((vec,), self.dtype)
                # 16 contiguous bytes: the swizzle permutes whole 16-byte chunks.
                cute.autovec_copy(cute.local_tile(s_tile[row, None], (vec,), (i % vecs_per_row,)), frag)
                dst = cute.local_tile(out[b, j * p + row, h, None], (vec,), (i % vecs_per_row,))
                cute.autovec_copy(frag, dst)
