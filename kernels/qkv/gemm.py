"""``FusedQKVGemm``: ``C = hidden @ weight^T`` on quack's GEMM cores with the fused-QKV epilogue (``epilogue.py``).

MAX's ``generic_fused_qkv_matmul_kv_cache_paged_ragged``. The mainloops are quack's, unchanged (the static test
compares them with the same GEMM without our epilogue): on SM90 ``GemmSm90`` (persistent, warp-specialized: a TMA
producer warp and two MMA warpgroups in ping-pong, each owning a 128 x BN tile, 2x1 multicast cluster); on SM100
``GemmSm100`` (2-CTA ``tcgen05.mma`` 256 x BN tiles, accumulators in TMEM, double-buffered so the epilogue warps
drain one tile while the MMA warp fills the next). Our epilogue replaces quack's D store: Q rows and K/V page
rows leave from a float32 staging tile as 16-byte stores (8-byte e4m3 stores and float32 or e8m0 per-granule
scales for fp8 caches).

``BN`` is 128: a head that is normalized or neox-rotated and lies inside one column tile (head sizes 64 and 128:
Llama, Qwen) is finished by its tile (its partner and its sum of squares are in the same CTA), and the float32
staging tile stays at 66 KB. Such heads wider than a tile (``QKVSpec.wide``: 256, Gemma 3) are finished by the
last of their tiles to arrive, as MLA's latent is (below): each tile writes the head's columns (bias added) to the
workspace, and the last arriver normalizes the head, rotates it (neox partners ``R/2`` columns away, in the other
tile) and stores it. Cost: a float32 write and read of every wide-head column (Gemma 3 12B at T = 8192: Q and K are
6144 of its 8192 columns, 2 x 201 MB, ~0.13 ms at 3 TB/s, an estimate), beside ~0.6 ms for its 3840 -> 8192 GEMM
on an H100. Rejected: a 256-column tile for these heads (its float32 staging tile alone is 133 KB: on SM90 it
leaves one A/B stage; SM100 would keep two at half the ring), and staging it in 16 bits (a second rounding before
the norm). ``supported`` says why a shape is refused (the entry then runs the reference).

What still takes the reference (the entry's dispatch): e5m2 caches and the shapes ``supported`` refuses.
Quantized weights (int4 with group scales and zero points, e4m3 with per-channel scales) run ``FusedQKVGemmW4``
(``w4.py``: quack's SM90 W4 mainloop with this epilogue staged transposed) on sm_90a and ``FusedQKVGemmW4Sm100``
(``w4_sm100.py``: transform warps decoding into the ``tcgen05.mma`` A stage, split-K for decode steps, the same
epilogue, MLA's latent and wide heads included) on sm_100a.

MLA's latent RMSNorm (``kv_lora_rank = 512`` dims, four 128-column tiles) needs a reduction across tiles; so do
rope-aware FP8 MLA rows, whose per-token scale is the amax of all 512 content dims (after the norm). Built as a
two-phase "last arriver" epilogue (``QKVSpec.cross_dims``, ``epilogue.arrive``): each CTA holding latent
columns writes their float32 values and per-row partial sums of squares to a workspace (``cross_dims`` columns,
then one partial per tile), fences, and bumps its M tile's counter; the CTA that arrives last (no CTA waits for
another, so a persistent schedule cannot deadlock) resets the counter for the next launch and finalizes the rows:
rstd from the partials added in tile order (the same bits whichever CTA is last), gamma, then one rounding (16-bit
cache) or the per-token amax, scale and e4m3 content (rope-aware rows, whose roped bf16 tail at byte
``cross_dims`` its own tile stores directly). The latent may start anywhere in a tile (``q_dim`` a multiple of 8):
a tile's Q chunks, latent chunks and tail chunks each take their own path. The mainloop is unchanged; the extra
traffic is a write and a read of ``T x 512`` float32 (34 MB at T = 8192: ~11 us at 3 TB/s, an estimate, against
~0.3 ms for DeepSeek-V3's 7168 -> 1536 + 576 GEMM on an H100). The workspace (whole M tiles of rows) and the
counters (zeroed once; each last arriver resets its own) are the op's, cached per device, stream and row width
(``ops/fused_qkv.latent_workspace``). Rejected: a tile N covering the latent (512 columns exceed an MMA instruction's N of 256 and quack's one-BN
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

from cute_kv.kernels.archs import BLACKWELL
from cute_kv.kernels.qkv.epilogue import VEC, QKVEpilogueArguments, QKVEpilogueMixin

DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}
BN = 128
# (tile M per MMA warpgroup / per 2-CTA pair, cluster): quack's SM90 ping-pong and SM100 2-CTA configurations.
TILES = {"sm_90a": ((128, BN), (2, 1, 1)), **{arch: ((256, BN), (2, 1, 1)) for arch in BLACKWELL}}
MAX_SWIZZLE = 8
CTA_ROWS = 128  # token rows of one CTA's tile on both cores (SM100's 256-row tile spans a CTA pair): an M tile
# CTAs of a cluster along M (the most of any core): quack's scheduler rounds the M tiles up to whole clusters,
# and every CTA of a cluster runs the epilogue of its tile, past the last token too.
CLUSTER_M = max(cluster[0] for _, cluster in TILES.values())


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
    # MLA: the latent head's first ``cross_dims`` dims, reduced across column tiles and finished by the tile that
    # arrives last (the latent RMSNorm's ``kv_lora_rank``, or a rope-aware row's e4m3 content); 0: none.
    cross_dims: int = 0
    rope_tail: int = 0  # rope-aware FP8 rows: bf16 dims after the ``cross_dims`` content bytes (``head_dim`` = sum)
    # K and V as two [N, L, P, H, D] planes of runtime strides (cute_kv/kv_layout.py), not MAX's compact blocks
    strided: bool = False

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
    def wide(self) -> tuple[bool, bool]:
        """Whether Q / K heads are wider than a column tile and normalized or neox-rotated: their columns go to the
        workspace and the last of the head's tiles to arrive finishes the head (``epilogue._finish_heads``)."""
        if self.cross_dims:
            return False, False
        neox = self.rope is not None and not self.rope[1]
        return ((bool(self.q_norm_dim) or neox) and self.q_head_dim > BN,
                (bool(self.k_norm_dim) or neox) and self.head_dim > BN)

    @property
    def last_arriver(self) -> bool:
        """Some columns are finished across column tiles (MLA's latent, or wide heads)."""
        return bool(self.cross_dims) or any(self.wide)

    @property
    def tile_norm(self) -> bool:
        """A norm reduced inside a column tile (QK-norm of heads within a tile; the latent norm and wide heads are
        the last arriver's)."""
        q_wide, k_wide = self.wide
        return bool((self.q_norm_dim and not q_wide) or (self.k_norm_dim and not self.cross_dims and not k_wide))

    @property
    def max_head_lanes(self) -> int:
        """Lanes (8-column chunks) of the widest head a tile normalizes: the butterfly width of the norm's
        reduction."""
        q_wide, k_wide = self.wide
        q = self.q_head_dim if self.q_norm_dim and not q_wide else 0
        return max(q, self.head_dim if self.k_norm_dim and not (self.cross_dims or k_wide) else 0) // VEC

    @property
    def head_groups(self) -> tuple[int, int]:
        """Wide heads: ``(Q heads, K heads)`` finished across tiles (0 for a side that is not wide); each counts its
        arrivals on one counter per M tile."""
        q_wide, k_wide = self.wide
        return (self.q_dim // self.q_head_dim if q_wide else 0), (self.num_heads if k_wide else 0)

    @property
    def counter_groups(self) -> int:
        """Arrival counters per M tile: one for the latent, one per wide head."""
        return 1 if self.cross_dims else sum(self.head_groups)

    @property
    def workspace_base(self) -> int:
        """First column of C the workspace holds (the latent's and wide K heads' after Q, wide Q heads' at 0)."""
        return 0 if self.wide[0] else self.q_dim

    @property
    def cross_tiles(self) -> tuple[int, int]:
        """``(first column tile, tiles)`` holding the ``cross_dims`` latent columns: the arrivals an M tile
        counts."""
        first = self.q_dim // BN
        return first, (self.q_dim + self.cross_dims - 1) // BN - first + 1

    @property
    def row_lanes(self) -> int:
        """Lanes holding a row of a column tile (one 8-column chunk each)."""
        return BN // VEC

    @property
    def workspace_cols(self) -> int:
        """float32 words of a workspace row: the latent's ``cross_dims`` values, then one partial sum of squares
        per tile (latent norm), padded to 16 bytes; or the wide heads' columns."""
        if not self.cross_dims:  # wide heads: their columns, no partials (the finish sums the head's squares)
            q_wide, k_wide = self.wide
            return (self.q_dim if q_wide else 0) + (self.num_heads * self.head_dim if k_wide else 0)
        partials = self.cross_tiles[1] if self.k_norm_dim else 0
        return self.cross_dims + -(-partials // 4) * 4

    @property
    def row_bytes(self) -> int:
        """Bytes of a cache row's head (rope-aware: e4m3 content, then the bf16 tail)."""
        if self.rope_tail:
            return self.cross_dims + 2 * self.rope_tail
        return self.head_dim * (1 if self.fp8 else 2)

    @property
    def inv_norm_width(self) -> tuple[float, float]:
        return 1.0 / max(self.q_norm_dim, 1), 1.0 / max(self.k_norm_dim, 1)


def supported(spec: QKVSpec) -> Optional[str]:
    """Why the kernel cannot take ``spec``, or None. 16-byte chunks must not straddle a region or a head, and a
    normalized or neox-rotated head must lie inside one ``BN``-column tile or span whole tiles (``QKVSpec.wide``)."""
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
    if spec.cross_dims or spec.rope_tail:
        problem = _cross_problem(spec)
        if problem:
            return problem
    elif spec.kv_dim == 1 and spec.k_norm_dim:
        return (f"MLA's latent RMSNorm over {spec.k_norm_dim} dims is finished across column tiles: set "
                f"cross_dims = {spec.k_norm_dim}")
    neox = spec.rope is not None and not spec.rope[1]
    whole = (bool(spec.q_norm_dim) or neox, (bool(spec.k_norm_dim) or neox) and not spec.cross_dims)
    for name, size, needs, wide in zip("QK", (qh, d), whole, spec.wide):
        lanes = size // VEC
        if wide and size % BN:
            return (f"a normalized or neox-rotated {name} head of {size} dims, wider than the {BN}-column tile, "
                    f"must span whole tiles (a multiple of {BN}): the last of its tiles to arrive finishes it")
        if needs and not wide and (BN % size or lanes & (lanes - 1)):
            return (f"a normalized or neox-rotated {name} head of {size} dims must tile the {BN}-column tile "
                    f"(a power-of-two number of 16-byte chunks dividing {BN}) or span whole tiles")
    if whole[1] and spec.q_dim % min(d, BN):
        return f"K heads of {d} dims start at q_dim = {spec.q_dim}, not a multiple of {min(d, BN)}: they straddle tiles"
    g = spec.granularity
    if spec.e8m0 and not g:
        return "e8m0 scales need a scale granularity"
    if g and (not spec.fp8 or g & (g - 1) or not VEC <= g <= BN or d % g or spec.q_dim % g):
        return (f"fp8 scale granularity {g} must be a power of two in [{VEC}, {BN}] dividing the head size ({d}) "
                f"and q_dim ({spec.q_dim}): a granule's lanes reduce its amax in one aligned group")
    return None


def _cross_problem(spec: QKVSpec) -> Optional[str]:
    """Why the last-arriver latent path cannot take ``spec`` (an MLA latent norm or rope-aware rows), or None."""
    w, tail = spec.cross_dims, spec.rope_tail
    if spec.kv_dim != 1 or spec.num_heads != 1:
        return "a latent finished across tiles needs an MLA cache (one K head, no V)"
    if w <= 0 or w % (2 * VEC) or w > spec.head_dim:
        return (f"cross_dims ({w}) must be a positive multiple of {2 * VEC} within the latent head "
                f"({spec.head_dim}): whole 16-byte chunks, and a rope tail at a 16-byte offset")
    if spec.k_norm_dim not in (0, w):
        return f"the latent norm's {spec.k_norm_dim} dims must be the {w} dims finished across tiles"
    if tail and (not spec.fp8 or spec.granularity or spec.e8m0 or w + tail != spec.head_dim):
        return (f"rope-aware rows are e4m3 content ({w}) and a bf16 tail ({tail}) summing to the latent head "
                f"({spec.head_dim}), one float32 scale per token")
    if not tail and (spec.fp8 or not spec.k_norm_dim):
        return "cross_dims without a rope tail is MLA's latent norm over a 16-bit cache"
    if spec.rope is not None and (not spec.rope[1] or spec.rope[0] > spec.head_dim - w):
        return (f"RoPE over the latent must be GPT-J pairs within its last {spec.head_dim - w} dims (the tail "
                f"its own tile rotates), got rope_dim {spec.rope[0]} ({'GPT-J' if spec.rope[1] else 'neox'})")
    return None


def _gemm_classes():
    """quack is imported only when a fused-QKV kernel is built (its import costs seconds and patches CuTe)."""
    from quack.gemm_sm90 import GemmSm90
    from quack.gemm_sm100 import GemmSm100

    class FusedQKVGemmSm90(QKVEpilogueMixin, GemmSm90):
        pass

    class FusedQKVGemmSm100(QKVEpilogueMixin, GemmSm100):
        pass

    return {"sm_90a": FusedQKVGemmSm90, **{arch: FusedQKVGemmSm100 for arch in BLACKWELL}}


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

        def plane(dtype, depth):  # strided: whole 16-byte units (kv_layout.check_addressable)
            return make_fake_tensor(dtype, (n_pages, nl, p, h, depth), stride=(
                *(cute.sym_int64(divisibility=128 // dtype.width) for _ in range(4)), 1), assumed_align=16)

        values = plane if s.strided else cache
        value_blocks = None
        if s.rope_tail:  # rope-aware rows: e4m3 content and bf16 tail bytes, one float32 scale per token
            blocks, scales = values(cutlass.Float8E4M3FN, s.row_bytes), cache(Float32, 1)
        else:
            blocks = values(cutlass.Float8E4M3FN if s.fp8 else dt, d)
            scales = cache(cutlass.Uint8 if s.e8m0 else Float32, d // s.granularity) if s.granularity else None
            if s.strided and kvd == 2:
                value_blocks = values(cutlass.Float8E4M3FN if s.fp8 else dt, d)
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
        workspace = counters = None
        if s.last_arriver:
            workspace = make_fake_tensor(Float32, (cute.sym_int32(), s.workspace_cols), stride=(s.workspace_cols, 1),
                                         assumed_align=16)
            counters = make_fake_compact_tensor(Int32, (cute.sym_int32(),), assumed_align=4)
        epi = QKVEpilogueArguments(output, blocks, offsets, lengths, lut, Int32(0), bias, freqs, q_norm, k_norm,
                                   scales, workspace, counters, value_blocks)
        scheduler = TileSchedulerOptions(max_active_clusters=Int32(1), max_swizzle_size=Int32(MAX_SWIZZLE))
        return (hidden, weight, None, None, epi, scheduler, None, make_fake_stream(use_tvm_ffi_env_stream=True),
                None, None)

    def args(self, hidden, weight, output, blocks, input_row_offsets, cache_lengths, lookup_table, layer_idx, bias,
             freqs_cis, q_norm, k_norm, scales, max_active_clusters: int, workspace=None, counters=None,
             value_blocks=None) -> tuple:
        """Launch arguments (torch tensors) in the compiled signature's order; the stream is the current one.
        ``workspace``/``counters``: ``latent_workspace``'s, for a spec with ``cross_dims``; a strided spec takes the
        K plane as ``blocks`` and the V plane as ``value_blocks``."""
        from quack.tile_scheduler import TileSchedulerOptions

        epi = QKVEpilogueArguments(output, blocks, input_row_offsets, cache_lengths, lookup_table, Int32(layer_idx),
                                   bias, freqs_cis, q_norm, k_norm, scales, workspace, counters, value_blocks)
        scheduler = TileSchedulerOptions(max_active_clusters=Int32(max_active_clusters), raster_order=None,
                                         max_swizzle_size=MAX_SWIZZLE)
        return hidden, weight, None, None, epi, scheduler, None, None, None
