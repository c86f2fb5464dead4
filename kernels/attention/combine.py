"""``AttentionCombine``: merge the split-KV partials of ``PagedAttention`` into the output.

For each (token, query head): ``out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``
(``o_s`` already divided by its split's sum, ``lse_s`` its log2-sum-exp; an empty split has ``lse = -inf``, weight
0, and its ``o_s`` is never read: it may be unwritten). ``D / 4`` threads share a row, 16 bytes of float32 each; a
128-thread CTA takes ``128 // (D / 4)`` rows (6 at D = 80, its last 8 threads idle).
With ``return_lse`` the merged natural-log ``lse = (M + log2 sum_s 2^(lse_s - M)) * ln 2`` (-inf for a row no split
saw) is written too.
"""

from __future__ import annotations

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cute_kv.kernels.attention.config import COMBINE_THREADS as THREADS
from cute_kv.kernels.attention.config import F32_VEC, VEC, combine_problem
from cute_kv.kernels.attention.softmax import LN2, NEG_INF
from cute_kv.kernels.attention.sm90 import DTYPES


class AttentionCombine:
    """Compile-time key: output dtype, query heads, head dim, whether the merged ``lse`` is written."""

    def __init__(self, dtype_name: str, num_q_heads: int, head_dim: int, return_lse: bool = False):
        problem = combine_problem(head_dim)
        if problem:
            raise ValueError(f"head_dim ({head_dim}): {problem}")
        self.dtype = DTYPES[dtype_name]
        self.num_q_heads, self.head_dim, self.return_lse = num_q_heads, head_dim, return_lse
        self.threads_per_row = head_dim // F32_VEC
        self.rows_per_cta = THREADS // self.threads_per_row

    def fake_args(self) -> tuple:
        hq, d = self.num_q_heads, self.head_dim
        t = cute.sym_int32()
        out = make_fake_tensor(self.dtype, (t, hq, d), stride=(cute.sym_int64(divisibility=VEC), d, 1),
                               assumed_align=16)
        lse = make_fake_compact_tensor(Float32, (t, hq), stride_order=(1, 0), assumed_align=4) if self.return_lse \
            else None
        o_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq, d),
                                          stride_order=(3, 2, 1, 0), assumed_align=16)
        lse_part = make_fake_compact_tensor(Float32, (cute.sym_int32(), cute.sym_int32(), hq),
                                            stride_order=(2, 1, 0), assumed_align=4)
        return out, lse, o_part, lse_part, Int32(2), make_fake_stream(use_tvm_ffi_env_stream=True)

    @cute.jit
    def __call__(self, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor, lse_part: cute.Tensor,
                 num_splits: Int32, stream: cuda.CUstream):
        rows = out.shape[0] * self.num_q_heads
        self.kernel(out, lse, o_part, lse_part, num_splits, rows).launch(
            grid=(cute.ceil_div(rows, self.rows_per_cta), 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, out: cute.Tensor, lse: Optional[cute.Tensor], o_part: cute.Tensor, lse_part: cute.Tensor,
               num_splits: Int32, rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        row = cta * self.rows_per_cta + tidx // self.threads_per_row
        chunk = tidx % self.threads_per_row
        if row < rows and tidx < self.rows_per_cta * self.threads_per_row:
            t = row // self.num_q_heads
            h = row % self.num_q_heads
            top = NEG_INF
            for s in cutlass.range(num_splits, unroll=1):
                top = cute.arch.fmax(top, lse_part[s, t, h])
            acc = cute.make_rmem_tensor((F32_VEC,), Float32)
            acc.fill(0.0)
            part = cute.make_rmem_tensor((F32_VEC,), Float32)
            total = Float32(0.0)
            for s in cutlass.range(num_splits, unroll=1):
                split_lse = lse_part[s, t, h]
                if split_lse != NEG_INF:
                    w = cute.math.exp2(split_lse - top, fastmath=True)
                    total = total + w
                    cute.autovec_copy(cute.local_tile(o_part[s, t, h, None], (F32_VEC,), (chunk,)), part)
                    for e in cutlass.range_constexpr(F32_VEC):
                        acc[e] = acc[e] + w * part[e]
            inv = Float32(0.0)
            if total > 0.0:
                inv = 1.0 / total
            if cutlass.const_expr(self.return_lse):
                if chunk == 0:
                    merged = NEG_INF
                    if total > 0.0:
                        merged = (top + cute.math.log2(total, fastmath=True)) * LN2
                    lse[t, h] = merged
            for e in cutlass.range_constexpr(F32_VEC):
                acc[e] = acc[e] * inv
            res = cute.make_rmem_tensor((F32_VEC,), self.dtype)
            res.store(acc.load().to(self.dtype))
            cute.autovec_copy(res, cute.local_tile(out[t, h, None], (F32_VEC,), (chunk,)))
