"""``FusedQKVGemm``: ``C = hidden @ weight^T`` on quack's GEMM cores with the fused-QKV epilogue (``epilogue.py``).

MAX's ``generic_fused_qkv_matmul_kv_cache_paged_ragged``. The mainloops are quack's, unchanged (the static test
compares them with the same GEMM without our epilogue): on SM90 ``GemmSm90`` (persistent, warp-specialized: a TMA
producer warp and two MMA warpgroups in ping-pong, each owning a 128 x BN tile, 2x1 multicast cluster); on SM100
``GemmSm100`` (2-CTA ``tcgen05.mma`` 256 x BN tiles, accumulators in TMEM, double-buffered so the epilogue warps
drain one tile while the MMA warp fills the next). Our epilogue replaces quack's D store: Q rows and K/V page
rows leave from a float32 staging tile as 16-byte stores (8-byte e4m3 stores and float32 or e8m0 per-granule
scales for fp8 caches).

``BN`` is 128: every head that is normalized or neox-rotated must lie inside one column tile (its partner and its
sum of squares are in the same CTA), so ``BN`` is a multiple of the head sizes; 128 serves head sizes 64 and 128
(Llama, Qwen, Gemma) and keeps the float32 staging tile at 66 KB. ``supported`` says why a shape is refused (the
entry then runs the reference).

What still takes the reference (the entry's dispatch): norms over more than one tile (MLA's 512-dim latent
norm) and e5m2 caches. Quantized weights (int4 with group scales and zero points, e4m3 with per-channel
scales) run ``FusedQKVGemmW4`` (``w4.py``: quack's SM90 W4 mainloop with this epilogue staged transposed) on
sm_90a and ``FusedQKVGemmW4Sm100`` (``w4_sm100.py``: transform warps decoding into the ``tcgen05.mma`` A stage,
the same epilogue) on sm_100a.

MLA's latent RMSNorm (``kv_lora_rank = 512`` dims, four 128-column tiles) needs a reduction across tiles; so do
rope-aware FP8 MLA rows, whose per-token scale is the amax of all 512 content dims (after the norm). The design
chosen, not yet built: a two-phase "last arriver" epilogue. Each CTA holding a latent tile writes its float32 block
and per-row partial sums of squares to a workspace, fences, and bumps a per-M-tile counter; the CTA that arrives
last (no CTA waits for another, so a persistent schedule cannot deadlock) finalizes the 512-dim rows: rstd, gamma,
then one rounding (bf16) or the per-token amax, scale and e4m3 content (rope-aware rows, whose roped bf16 tail its
own tile stores directly). The mainloop is unchanged; the extra traffic is a write and a read of ``T x 512`` float32
(34 MB at T = 8192: ~11 us at 3 TB/s, an estimate, against ~0.3 ms for DeepSeek-V3's 7168 -> 1536 + 576 GEMM on an
H100). Rejected: a tile N covering the latent (512 columns exceed an MMA instruction's N of 256 and quack's one-BN
tiling; on SM100 it would take all 512 TMEM columns, losing the accumulator double buffer, and every Q tile would
pay for it); a 4-CTA cluster along N exchanging partial sums in distributed shared memory (it changes the mainloop's
multicast, needs the latent aligned to 512 columns and a cluster-wide barrier that quack's warp roles do not offer
the epilogue alone).

Why this replaced the single-warpgroup ``FusedQKVMatmul`` (formerly ``kernels/qkv/sm90.py``): it took exactly the
shapes this kernel takes (the same 128-column rule), had no SM100 mainloop, no warp specialization, no multicast
and no persistence, so no case was left where it is the better choice; keeping both would be two epilogues to
maintain.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from cute_kv.kernels.qkv.epilogue import VEC, QKVEpilogueArguments, QKVEpilogueMixin

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
BN = 128
# (tile M per MMA warpgroup / per 2-CTA pair, cluster): quack's SM90 ping-pong and SM100 2-CTA configurations.
TILES = {"sm_90a": ((128, BN), (2, 1, 1)), "sm_100a": ((256, BN), (2, 1, 1))}
MAX_SWIZZLE = 8


@dataclasses.dataclass(frozen=True)
class QKVSpec:
    """Compile-time description of the column split and the epilogue math.

    ``dtype_name``: hidden, weight and Q dtype (and the cache's unless ``fp8``). ``rope``: None or
    ``(rope_dim, interleaved)``; ``q_norm_dim``/``k_norm_dim``: dims a QK-norm weight covers (0: no norm on that
    side).
    """

    dtype_name: str
    q_dim: int
    kv_dim: int
    page_size: int
    num_heads: int
    head_dim: int
    q_head_dim: int
    has_bias: bool
    rope: Optional[tuple[int, bool]]
    q_norm_dim: int = 0
    k_norm_dim: int = 0
    norm_epsilon: float = 1e-6
    norm_offset: float = 0.0
    fp8: bool = False  # e4m3 cache
    granularity: int = 0  # head dims per scale of an fp8 cache (0: unscaled)
    e8m0: bool = False  # scales are float8_e8m0fnu (powers of two, rounded up), else float32

    @property
    def dtype(self):
        return DTYPES[self.dtype_name]

    @property
    def n_total(self) -> int:
        return self.q_dim + self.kv_dim * self.num_heads * self.head_dim

    @property
    def has_norm(self) -> bool:
        return bool(self.q_norm_dim or self.k_norm_dim)

    @property
    def max_head_lanes(self) -> int:
        """Lanes (8-column chunks) of the widest head: the butterfly width of the norm's reduction."""
        return max(self.q_head_dim, self.head_dim) // VEC

    @property
    def inv_norm_width(self) -> tuple[float, float]:
        return 1.0 / max(self.q_norm_dim, 1), 1.0 / max(self.k_norm_dim, 1)


def supported(spec: QKVSpec) -> Optional[str]:
    """Why the kernel cannot take ``spec``, or None. 16-byte chunks must not straddle a region or a head, and a
    normalized or neox-rotated head must lie inside one ``BN``-column tile."""
    if spec.dtype_name not in DTYPES:
        return f"dtype {spec.dtype_name} is not one of {sorted(DTYPES)}"
    qh, d = spec.q_head_dim, spec.head_dim
    if spec.q_dim % VEC or d % VEC or qh % VEC or spec.q_dim % qh:
        return f"q_dim ({spec.q_dim}), head sizes (Q {qh}, K {d}) must be multiples of {VEC}, Q heads dividing q_dim"
    if spec.rope is not None and spec.rope[0] % (VEC if spec.rope[1] else 2 * VEC):
        return (f"rope_dim {spec.rope[0]} must be a multiple of {VEC if spec.rope[1] else 2 * VEC} "
                f"({'GPT-J' if spec.rope[1] else 'neox'}): a 16-byte chunk is rotated whole or kept whole")
    if spec.q_norm_dim % VEC or spec.k_norm_dim % VEC:
        return (f"QK-norm weights of {spec.q_norm_dim} (Q) and {spec.k_norm_dim} (K) dims must be multiples of {VEC}: "
                f"a 16-byte chunk is normalized whole or kept whole")
    if spec.kv_dim == 1 and spec.k_norm_dim > BN:
        return (f"MLA's latent RMSNorm over {spec.k_norm_dim} dims spans {-(-spec.k_norm_dim // BN)} column tiles: "
                f"the cross-tile reduction is not built (module docstring)")
    whole_heads = spec.has_norm or (spec.rope is not None and not spec.rope[1])
    if whole_heads:
        for name, size in (("Q", qh), ("K", d)):
            lanes = size // VEC
            if BN % size or lanes & (lanes - 1):
                return (f"a normalized or neox-rotated {name} head of {size} dims must tile the {BN}-column tile "
                        f"(a power-of-two number of 16-byte chunks dividing {BN})")
        if spec.q_dim % d:
            return f"K heads of {d} dims start at q_dim = {spec.q_dim}, not a multiple of {d}: they straddle tiles"
    g = spec.granularity
    if spec.e8m0 and not g:
        return "e8m0 scales need a scale granularity"
    if g and (not spec.fp8 or g & (g - 1) or not VEC <= g <= BN or d % g or spec.q_dim % g):
        return (f"fp8 scale granularity {g} must be a power of two in [{VEC}, {BN}] dividing the head size ({d}) "
                f"and q_dim ({spec.q_dim}): a granule's lanes reduce its amax in one aligned group")
    return None


def _gemm_classes():
    """quack is imported only when a fused-QKV kernel is built (its import costs seconds and patches CuTe)."""
    from quack.gemm_sm90 import GemmSm90
    from quack.gemm_sm100 import GemmSm100

    class FusedQKVGemmSm90(QKVEpilogueMixin, GemmSm90):
        pass

    class FusedQKVGemmSm100(QKVEpilogueMixin, GemmSm100):
        pass

    return {"sm_90a": FusedQKVGemmSm90, "sm_100a": FusedQKVGemmSm100}


class FusedQKVGemm:
    """Builds quack's GEMM with our epilogue for ``spec`` on ``arch``; ``build()`` returns ``(gemm, *fake_args)``
    for ``compile_cache.compiled`` and ``args()`` the launch arguments of the compiled function."""

    compile_name = "fused_qkv_gemm"

    def __init__(self, spec: QKVSpec, arch: str):
        problem = supported(spec)
        if problem:
            raise ValueError(problem)
        if arch not in TILES:
            raise ValueError(f"FusedQKVGemm targets {sorted(TILES)}, not {arch}")
        self.spec, self.arch = spec, arch

    @property
    def cluster_shape(self) -> tuple:
        return TILES[self.arch][1]

    def gemm(self):
        tile, cluster = TILES[self.arch]
        cls = _gemm_classes()[self.arch]
        if self.arch == "sm_90a":
            gemm = cls(Float32, self.spec.dtype, tile, cluster, pingpong=True, is_persistent=True)
        else:
            gemm = cls(Float32, self.spec.dtype, tile, cluster)
        gemm.qkv = self.spec
        return gemm

    def build(self) -> tuple:
        return (self.gemm(), *self.fake_args())

    def fake_args(self) -> tuple:
        from quack.tile_scheduler import TileSchedulerOptions

        s = self.spec
        dt = s.dtype
        t, k, n_pages, nl, b, cols, positions = (cute.sym_int32() for _ in range(7))
        row = lambda: cute.sym_int64(divisibility=VEC)  # noqa: E731 -- TMA and 16-byte stores need aligned rows
        hidden = make_fake_tensor(dt, (t, k), stride=(row(), 1), assumed_align=16)
        weight = make_fake_tensor(dt, (s.n_total, k), stride=(row(), 1), assumed_align=16)
        output = make_fake_tensor(dt, (t, s.q_dim), stride=(row(), 1), assumed_align=16)
        kvd, p, h, d = s.kv_dim, s.page_size, s.num_heads, s.head_dim

        def cache(dtype, depth):
            return make_fake_tensor(dtype, (n_pages, kvd, nl, p, h, depth), stride=(
                cute.sym_int64(divisibility=kvd * p * h * depth), cute.sym_int64(divisibility=p * h * depth),
                p * h * depth, h * depth, depth, 1),
                assumed_align=16 if depth * dtype.width % 128 == 0 else dtype.width // 8)

        blocks = cache(cutlass.Float8E4M3FN if s.fp8 else dt, d)
        scales = cache(cutlass.Uint8 if s.e8m0 else Float32, d // s.granularity) if s.granularity else None
        offsets = make_fake_compact_tensor(Uint32, (cute.sym_int32(),), assumed_align=4)
        lengths = make_fake_compact_tensor(Uint32, (b,), assumed_align=4)
        lut = make_fake_tensor(Uint32, (b, cols), stride=(cute.sym_int64(), 1), assumed_align=4)
        bias = make_fake_compact_tensor(dt, (s.n_total,), assumed_align=2) if s.has_bias else None
        freqs = None
        if s.rope is not None:
            # 16-byte aligned rows: a chunk's cos/sin pairs are vector loads
            freqs = make_fake_tensor(Float32, (positions, s.rope[0]), stride=(cute.sym_int64(divisibility=4), 1),
                                     assumed_align=16)
        q_norm = make_fake_compact_tensor(Float32, (s.q_norm_dim,), assumed_align=4) if s.q_norm_dim else None
        k_norm = make_fake_compact_tensor(Float32, (s.k_norm_dim,), assumed_align=4) if s.k_norm_dim else None
        epi = QKVEpilogueArguments(output, blocks, offsets, lengths, lut, Int32(0), bias, freqs, q_norm, k_norm,
                                   scales)
        scheduler = TileSchedulerOptions(max_active_clusters=Int32(1), max_swizzle_size=Int32(MAX_SWIZZLE))
        return (hidden, weight, None, None, epi, scheduler, None, make_fake_stream(use_tvm_ffi_env_stream=True),
                None, None)

    def args(self, hidden, weight, output, blocks, input_row_offsets, cache_lengths, lookup_table, layer_idx, bias,
             freqs_cis, q_norm, k_norm, scales, max_active_clusters: int) -> tuple:
        """Launch arguments (torch tensors) in the compiled signature's order; the stream is the current one."""
        from quack.tile_scheduler import TileSchedulerOptions

        epi = QKVEpilogueArguments(output, blocks, input_row_offsets, cache_lengths, lookup_table, Int32(layer_idx),
                                   bias, freqs_cis, q_norm, k_norm, scales)
        scheduler = TileSchedulerOptions(max_active_clusters=Int32(max_active_clusters), raster_order=None,
                                         max_swizzle_size=MAX_SWIZZLE)
        return hidden, weight, None, None, epi, scheduler, None, None, None
