"""``RopeAwareKVStore``: write a ragged step's latent rows into a rope-aware FP8 MLA cache (``cute_kv/rope_aware.py``).

A new row ``k[m, 0, :latent_dim]`` (bf16/fp16/fp32) becomes ``[padded_depth e4m3 bytes | rope_dim bf16]`` at
``blocks[page, 0, layer, slot, 0, :]`` with its float32 scale at ``scales[page, 0, layer, slot, 0, 0]``, bit for bit as
the reference: ``scale = max(amax(|content|) / 448, FLT_MIN)``, content ``saturate(x / scale)``, rope ``bf16(x)``.

One warp per row: lane ``l`` holds content vectors ``l + 32 j`` (8 values each, ``padded_depth / 256`` of them), so
the token's amax is one 32-lane butterfly (``kernels/quant.py``), and rope vectors ``l + 32 j`` (8 values, stored as
16 bytes at byte ``padded_depth + 16 (l + 32 j)``). Each warp takes ``ROWS_PER_WARP`` rows, issuing all their loads
before any store. Rows are resolved once per CTA (``ragged_rows.resolve_rows``); rows past the step are not read and
rows whose page is not in the cache are not written.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cute_kv.kernels.cache.store import DTYPES, staged_rows
from cute_kv.kernels.quant import VEC, lane_amax, lanes_scale, to_e4m3

THREADS = 128
WARP = 32
ROWS_PER_WARP = 4
ROWS = THREADS // WARP * ROWS_PER_WARP  # rows per CTA


def supported(padded_depth: int, rope_dim: int):
    """None, or why the kernel does not take this row geometry."""
    if padded_depth <= 0 or padded_depth % (WARP * VEC):
        return f"padded_depth {padded_depth} is not a positive multiple of {WARP * VEC} (8 values per lane of a warp)"
    if rope_dim <= 0 or rope_dim % VEC:
        return f"rope_dim {rope_dim} is not a positive multiple of {VEC} (16-byte bf16 vectors)"
    return None


class RopeAwareKVStore:
    """``dtype_name``: the input dtype; ``padded_depth`` e4m3 content bytes and ``rope_dim`` bf16 values per row."""

    def __init__(self, dtype_name: str, page_size: int, padded_depth: int, rope_dim: int):
        problem = supported(padded_depth, rope_dim)
        if problem:
            raise ValueError(problem)
        self.in_dtype = DTYPES[dtype_name]
        self.page_size, self.padded_depth, self.rope_dim = page_size, padded_depth, rope_dim
        self.row_bytes = padded_depth + 2 * rope_dim
        self.latent_dim = padded_depth + rope_dim
        self.content_vecs = padded_depth // (WARP * VEC)  # per lane
        self.rope_vecs = rope_dim // VEC  # per row
        self.rope_vecs_per_lane = math.ceil(self.rope_vecs / WARP)

    # -- host ------------------------------------------------------------------------------------

    def fake_args(self) -> tuple:
        """Fake tensors with ``PagedKVStore``'s contract (``v`` is None: an MLA cache stores K only)."""
        p, rb = self.page_size, self.row_bytes
        n, nl, b, cols, t = (cute.sym_int32() for _ in range(5))

        def cache(dtype, depth, align):  # [N, 1, L, P, 1, depth] row-major: page and KV pitches are L*P*depth
            return make_fake_tensor(dtype, (n, 1, nl, p, 1, depth), stride=(
                cute.sym_int64(divisibility=p * depth), cute.sym_int64(divisibility=p * depth), p * depth, depth,
                depth, 1), assumed_align=align)

        k = make_fake_tensor(self.in_dtype, (t, 1, self.latent_dim), stride=(cute.sym_int64(divisibility=VEC),
                                                                                self.latent_dim, 1), assumed_align=16)
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        return (k, None, offsets, cache(cutlass.Float8E4M3FN, rb, 16), cache(Float32, 1, 4), lengths, lut, Int32(0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    @cute.jit
    def __call__(self, k: cute.Tensor, v: None, input_row_offsets: cute.Tensor, blocks: cute.Tensor,
                 scales: cute.Tensor, cache_lengths: cute.Tensor, lookup_table: cute.Tensor, layer_idx: Int32,
                 stream: cuda.CUstream):
        grid = (cute.ceil_div(k.shape[0], ROWS), 1, 1)
        self.kernel(k, input_row_offsets, blocks, scales, cache_lengths, lookup_table, layer_idx).launch(
            grid=grid, block=(THREADS, 1, 1), stream=stream)

    # -- device ----------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, k: cute.Tensor, input_row_offsets: cute.Tensor, blocks: cute.Tensor, scales: cute.Tensor,
               cache_lengths: cute.Tensor, lookup_table: cute.Tensor, layer_idx: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp, lane = tidx // WARP, tidx % WARP
        first_row = bidx * ROWS
        num_rows = k.shape[0]

        s_page, s_pos = staged_rows(ROWS, first_row, num_rows, input_row_offsets, cache_lengths, lookup_table,
                                    blocks.shape[0], self.page_size)

        content = [cute.make_rmem_tensor((self.content_vecs * VEC,), self.in_dtype) for _ in range(ROWS_PER_WARP)]
        rope = [[cute.make_rmem_tensor((VEC,), self.in_dtype) for _ in range(self.rope_vecs_per_lane)]
                for _ in range(ROWS_PER_WARP)]
        for r in cutlass.range_constexpr(ROWS_PER_WARP):
            row = first_row + warp * ROWS_PER_WARP + r
            content[r].fill(0.0)  # rows past the step still join the warp's shuffles
            if row < num_rows:
                src = k[row, 0, None]
                for j in cutlass.range_constexpr(self.content_vecs):
                    cute.autovec_copy(cute.local_tile(src, (VEC,), (lane + j * WARP,)),
                                      cute.local_tile(content[r], (VEC,), (j,)))
                for j in cutlass.range_constexpr(self.rope_vecs_per_lane):
                    if lane + j * WARP < self.rope_vecs:
                        cute.autovec_copy(
                            cute.local_tile(src, (VEC,), (self.padded_depth // VEC + lane + j * WARP,)), rope[r][j])
        for r in cutlass.range_constexpr(ROWS_PER_WARP):
            local = warp * ROWS_PER_WARP + r
            vals = cute.make_rmem_tensor(content[r].shape, Float32)
            vals.store(content[r].load().to(Float32))
            scale = lanes_scale(lane_amax(vals), WARP)
            q = to_e4m3(vals, scale)
            if first_row + local < num_rows:
                page = s_page[local]
                if page >= 0:  # a row whose page is in the cache
                    slot = s_pos[local] % self.page_size
                    dst = blocks[page, 0, layer_idx, slot, 0, None]
                    for j in cutlass.range_constexpr(self.content_vecs):
                        cute.autovec_copy(cute.local_tile(q, (VEC,), (j,)),
                                          cute.local_tile(dst, (VEC,), (lane + j * WARP,)))
                    for j in cutlass.range_constexpr(self.rope_vecs_per_lane):
                        if lane + j * WARP < self.rope_vecs:
                            self.store_rope(rope[r][j], dst, lane + j * WARP)
                    if lane == 0:
                        scales[page, 0, layer_idx, slot, 0, 0] = scale

    @cute.jit
    def store_rope(self, frag: cute.Tensor, dst: cute.Tensor, vec: Int32):
        """8 values as bf16, 16 bytes at byte ``padded_depth + 16 * vec`` of the fp8 row ``dst``."""
        bf16 = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
        bf16.store(frag.load().to(cutlass.BFloat16))
        out = cute.recast_tensor(bf16, cutlass.Float8E4M3FN)  # the same 16 bytes, typed as the row
        cute.autovec_copy(out, cute.local_tile(dst, (2 * VEC,), (self.padded_depth // (2 * VEC) + vec,)))
