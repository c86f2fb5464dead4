"""``FusedQKVGemmW4``: the fused-QKV GEMM with quantized weights decoded in the mainloop (SM90).

Weights are quack's W4 operand: the packed weight tile (and its group scales) arrive by TMA, each MMA warpgroup
decodes its 16 bytes per thread straight into the RS ``wgmma`` A fragment (``TransformAW4``), and the bf16 hidden
states are the B operand. The accumulator tile is therefore ``C^T`` (weight rows x tokens); this module's epilogue
mixin stages it transposed into the same float32 tile ``kernels/qkv/epilogue.py`` reads, so bias, QK-norm, RoPE,
the fp8 cache and the page stores are the bf16 kernel's, unchanged.

Why this route (static evidence: ``tests/test_fused_qkv_w4.py``, ``python perf/run.py fused-qkv-static``, which
compiles quack's W4 GEMM with the same decode and its own epilogue beside ours):

* (a) quack's W4, chosen for sm_90a. Measured for Llama-3-8B (6144 x 4096, every format): 168 registers, no
  spills, 12 HGMMA in the SASS as in quack's own W4 GEMM (4 m64n128k16 per warpgroup and 64-deep k-tile: the
  bf16 GEMM's 8 per 128 x 128 x 64 tile), and the decode's instructions identical in number (PTX ``mul.rn.bf16x2``,
  ``add.rn.bf16x2``, e4m3 ``cvt``). In the k-tile loop's SASS a thread decodes its 32 weights per k-tile with
  16 HMUL2 + 16 HADD2 + 17 LOP3 + 14 SHF (int4, every group size and zero points: 1.97 a weight, quack's own
  1.94) or 32 F2FP + 32 HADD2 + 3 (e4m3: 2.09), from 2 ``ld.shared`` (words and scale word), interleaved between
  the k16 wgmmas. No shared-memory round trip, and a stage carries a quarter (int4) or half (e4m3) of the bf16
  weight bytes: 6 stages (e4m3: 5) fit beside our 66 KB staging tile, quack's own epilogue leaves 10 (8). Its
  formats use our packing already (low nibble = even ``k``, offset-binary codes, bf16 group scales), so the host
  repack is a byte permutation (``prepare_weight``).
* (b) a load-side transform warpgroup writing the bf16 B stage would serve both archs with one helper, but on SM90
  it adds a shared-memory write and read of every weight per tile (16 KB per 64-deep k-tile at BN = 128), a
  fourth warpgroup's registers, and the full bf16 stage back in the ring; quack 0.6.5's mainloops have no seam
  for a B-stage producer, so it also means carrying a fork of their ~1000-line kernel.
* SM100 takes ``FusedQKVGemmW4Sm100`` (``w4_sm100.py``): quack 0.6.5 has no SM100 W4 mainloop, and
  ``tcgen05.mma`` reads A from shared or tensor memory, never registers, so (a) does not carry over; the SM100
  route is (b)'s transform warps writing the bf16 stage, from this module's repack and decode.

Costs of the route: the accumulator is ``C^T``, so staging writes it transposed (lane ``4r + c`` to words
``2c * 132 + r``: no bank conflicts); quack's W4 GEMM takes its weight-row extent from a ``D`` it would store, so
a never-written one-row broadcast stands in for it and its shared-memory tile (bf16, quack's epilogue stages)
stays allocated; clusters are 1x1 (quack's W4 takes ``(1, N, 1)``; a weight tile is not multicast).

Exact dequantization (``cute_kv/reference/weights.py`` rounds the same way): int4 ``w = bf16((q - z) * s)``, the
product of an exact small integer and the bf16 group scale rounded once (round to nearest even); e4m3 weights are
exact in bf16 and their float32 per-channel scale multiplies the float32 accumulator column when it is staged
(``C[:, n] * s[n]``, the order the reference uses too).

Tiles: the weight side is 128 rows (``BN`` of the bf16 kernel: a normalized or neox head lies inside one tile),
the token side 128 (two MMA warpgroups of 64 weight rows each, cooperative: quack's W4 has no ping-pong). Formats:
int4 symmetric with groups 32, 64, 128 (quack's ``int4``/``int4_g64``/``int4_g32``), int4 with zero points at
group 128 (``int4awq``), e4m3 (``fp8``); bf16 activations and bf16 scales only (others take the reference).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from quack.cute_dsl_utils import mlir_namedtuple

from cute_kv.kernels.qkv.epilogue import C_PAD, EPI_THREADS, VEC, QKVEpilogueMixin, QKVEpilogueParams
from cute_kv.kernels.qkv.gemm import BN, CTA_ROWS, MAX_SWIZZLE, FusedQKVGemm, QKVSpec, supported

TILE_TOKENS = CTA_ROWS  # token rows of a tile: also the cross-tile latent's M tile (its workspace and counters)
K_TILE = 64  # the decode formats' k-tile: K must be a multiple
ARCH = "sm_90a"
# (weight_dtype, group_size, has_zp) -> quack's decode format.
FORMATS = {("int4", 32, False): "int4_g32", ("int4", 64, False): "int4_g64", ("int4", 128, False): "int4",
           ("int4", 128, True): "int4awq", ("float8_e4m3fn", 0, False): "fp8"}


@dataclasses.dataclass(frozen=True)
class QKVW4Spec:
    """Compile-time key: the bf16 kernel's ``QKVSpec`` and the quack decode format of the weight."""

    qkv: QKVSpec
    weight_format: str

    @property
    def column_scales(self) -> bool:
        """Per-channel float32 weight scales applied to the staged accumulator (fp8 weights)."""
        return self.weight_format == "fp8"


def weight_format(weight) -> tuple[Optional[str], str]:
    """``(quack format, "")`` for a quantized weight the kernel decodes, or ``(None, why not)``."""
    import torch

    from cute_kv.reference.weights import Fp8Weight, Int4Weight

    if isinstance(weight, Fp8Weight):
        return FORMATS[("float8_e4m3fn", 0, False)], ""
    if not isinstance(weight, Int4Weight):
        return None, f"{type(weight).__name__} weights"
    if weight.scales.dtype != torch.bfloat16:
        return None, f"{weight.scales.dtype} int4 group scales: the decode multiplies by bf16 scales"
    key = ("int4", weight.group_size, weight.has_zp)
    if key not in FORMATS:
        zp = "with zero points" if weight.has_zp else "symmetric"
        groups = sorted(g for (f, g, z) in FORMATS if f == "int4" and z == weight.has_zp)
        return None, f"int4 {zp} at group_size {weight.group_size}: the decode takes groups {groups}"
    return FORMATS[key], ""


def _padded(n: int) -> int:
    return -(-n // BN) * BN


_PREPARED: dict = {}  # id(data tensor) -> (stamp, prepared); an entry leaves with its tensor


def prepare_weight(weight) -> tuple:
    """``(blob, sf, column_scales)``: the weight in quack's decode order (rows padded to ``BN`` with codes that
    decode to zero). A repack reads every weight byte, so it is kept while the weight's data tensor lives and reused
    while the same scale and zero-point tensors come with it, none changed in place (their version counters): a
    traced step rebuilds the ``Int4Weight`` around the same tensors every call."""
    data = weight.packed if hasattr(weight, "packed") else weight.weight
    parts = tuple(t for t in (data, weight.scales, getattr(weight, "zero_points", None)) if t is not None)
    cached = _PREPARED.get(id(data))
    if cached is None:
        weakref.finalize(data, _PREPARED.pop, id(data), None)
    fresh = cached is not None and len(cached[0]) == len(parts) and all(
        ref() is t and version == t._version for (ref, version), t in zip(cached[0], parts))
    if not fresh:  # weak references, not ids: a freed scale tensor's id may come back on a new one
        cached = _PREPARED[id(data)] = (tuple((weakref.ref(t), t._version) for t in parts), _repack(weight))
    return cached[1]


def _repack(weight) -> tuple:
    import torch
    from quack.blockscaled import nvfp4_utils

    from cute_kv.reference.weights import Fp8Weight

    fmt = decode_format(weight_format(weight)[0])
    n = weight.shape[0]
    pad = lambda t, value=0: torch.cat([t, t.new_full((_padded(n) - n, *t.shape[1:]), value)])  # noqa: E731
    if isinstance(weight, Fp8Weight):
        blob, _ = fmt.prepare(pad(weight.weight.view(torch.uint8)).view(torch.float8_e4m3fn), None)
        return blob, None, pad(weight.scales, 1.0).contiguous()
    packed, scales = pad(weight.packed), pad(weight.scales)  # padding rows: scale 0, so they decode to zero
    if weight.has_zp:
        blob, sf = fmt.prepare(packed, (scales, pad(weight.zero_points)))
    else:  # the SM90 word order (quack's ``prepare`` would pick the order of the machine it runs on)
        blob = nvfp4_utils.repack_int4_weight(packed, s2f6=False)
        sf = nvfp4_utils.repack_int4_sf(scales, weight.shape[1], group=weight.group_size)
    return blob, sf, None


@functools.lru_cache(maxsize=None)
def decode_format(name: str):
    """quack's decode format ``name``; the symmetric int4 ones pinned to the SM90 (magic-number) decode and word
    order, which ``_repack`` writes: quack picks between it and Blackwell's converter by the compile target it
    first sees in the process (a cached global), not by the kernel being built. e4m3 is pinned to the f16 convert
    (the SM90 one), so both architectures' kernels decode the same bytes with the same instructions."""
    from quack.blockscaled import nvfp4_utils as U
    from quack.operand_transform.formats import Fp8, Int4, decode_format as quack_format

    fmt = quack_format(name)
    if type(fmt) is Fp8:
        class Fp8F16Route(Fp8):
            @cute.jit
            def decode_k16(self, xw, sfw, b, consts):
                """Block ``b``'s 8 e4m3 bytes (words ``2b``, ``2b + 1``), two per register, through the f16
                convert on every target (quack picks Blackwell's direct bf16x2 convert on sm_100a, which needs a
                newer PTX ISA than the toolkit's assembler takes); exact either way."""
                return (_e4m3x2_to_bf16x2(xw[2 * b], False), _e4m3x2_to_bf16x2(xw[2 * b], True),
                        _e4m3x2_to_bf16x2(xw[2 * b + 1], False), _e4m3x2_to_bf16x2(xw[2 * b + 1], True))

        return Fp8F16Route()
    if type(fmt) is not Int4:
        return fmt

    class Int4Sm90(Int4):
        def make_consts(self):
            return U.pin_b32_vreg(0x43004300), U.pin_b32_vreg(0xC308C308)  # bf16x2 (128, 128), (-136, -136)

        @cute.jit
        def decode_k16(self, xw, sfw, b, consts):
            """Pair ``j``: ``128 + code`` by the magic mantissa, ``- 136`` exact, times the row's bf16 scale (the
            word's low half serves fragment row ``r``, its high half ``r + 8``)."""
            magic, bias = consts
            h = sfw[0]
            if cutlass.const_expr(self.group == 32):
                h = sfw[b // 2]  # a word per 32-column group
            t0, t1, t2, t3 = U.decode_u4x8_to_magicx8(xw[b], magic)
            return (U.mul_bf16x2_bcast(U.add_bf16x2(t0, bias), h, False),
                    U.mul_bf16x2_bcast(U.add_bf16x2(t1, bias), h, True),
                    U.mul_bf16x2_bcast(U.add_bf16x2(t2, bias), h, False),
                    U.mul_bf16x2_bcast(U.add_bf16x2(t3, bias), h, True))

    return Int4Sm90(fmt.group)


@cute.jit
def _e4m3x2_to_bf16x2(pair: Int32, hi: cutlass.Constexpr[bool]) -> Int32:
    """Two e4m3 bytes (the word's low or high half) -> bf16x2: e4m3 -> f16x2 -> f32 -> bf16x2, each step exact."""
    from quack.blockscaled.nvfp4_utils import asm_i32

    sel = "{_, p}" if hi else "{p, _}"
    return Int32(asm_i32([Int32(pair).ir_value()],
                         "{.reg .b16 lo, hi, p; .reg .b32 h2; .reg .f32 f0, f1; "
                         f"mov.b32 {sel}, $1; cvt.rn.f16x2.e4m3x2 h2, p; "
                         "mov.b32 {lo, hi}, h2; cvt.f32.f16 f0, lo; cvt.f32.f16 f1, hi; "
                         "cvt.rn.bf16x2.f32 $0, f1, f0;}", "=r,r"))


@mlir_namedtuple
class QKVW4EpilogueArguments(NamedTuple):
    """``QKVEpilogueArguments``' fields (same order) and the fp8 weight's per-channel scales."""

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
    scales: Optional[cute.Tensor] = None
    workspace: Optional[cute.Tensor] = None
    counters: Optional[cute.Tensor] = None
    value_blocks: Optional[cute.Tensor] = None
    column_scales: Optional[cute.Tensor] = None  # [N padded to BN] float32


@dataclasses.dataclass
class QKVW4EpilogueParams(QKVEpilogueParams):
    """``QKVEpilogueParams`` (fields inherited in order, so the bf16 epilogue's hooks read them unchanged) and the
    per-channel scales."""

    column_scales: Optional[cute.Tensor] = None


class TransposedQKVEpilogueMixin(QKVEpilogueMixin):
    """``QKVEpilogueMixin`` for an accumulator tile of ``C^T``: tile mode 0 walks C's columns (weight rows), mode 1
    its rows (tokens). The staged tile is ``C``'s orientation, so every hook after staging is the bf16 kernel's, run
    with the tile shape and coordinates swapped back."""

    EpilogueArguments = QKVW4EpilogueArguments

    def epi_to_underlying_arguments(self, args, *, loc=None, ip=None):
        return QKVW4EpilogueParams(*args)

    @classmethod
    def epi_smem_bytes(cls, args, cta_tile_shape_mnk, epi_tile, warp_shape_mnk=None):
        m, n, k = cta_tile_shape_mnk
        return super().epi_smem_bytes(args, (n, m, k), epi_tile, warp_shape_mnk)

    @contextlib.contextmanager
    def _c_tile(self):
        """The bf16 kernel's view for the duration of a hook: ``cta_tile_shape_mnk`` in C's orientation."""
        m, n, k = self.cta_tile_shape_mnk
        self.cta_tile_shape_mnk = (n, m, k)
        try:
            yield
        finally:
            self.cta_tile_shape_mnk = (m, n, k)

    @staticmethod
    def _c_coord(tile_coord_mnkl):
        return (tile_coord_mnkl[1], tile_coord_mnkl[0], *tile_coord_mnkl[2:])

    def epi_get_smem_struct(self, params):
        with self._c_tile():
            return super().epi_get_smem_struct(params)

    def epi_get_smem_tensors(self, params, storage):
        with self._c_tile():
            return super().epi_get_smem_tensors(params, storage)

    def epi_begin(self, params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                  varlen_manager, epilogue_barrier, tidx, tRS_rD_layout=None):
        with self._c_tile():
            return super().epi_begin(params, epi_smem_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                                     self._c_coord(tile_coord_mnkl), varlen_manager, epilogue_barrier, tidx,
                                     tRS_rD_layout)

    @cute.jit
    def epi_end_loop(self, params, epi_tensors, epi_coord, tRS_rD, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                     tile_coord_mnkl, varlen_manager, tidx):
        """Stage this sub-tile of ``C^T`` at its transposed coordinates (fp8 weights: times the column's scale).
        Lane ``4r + c`` writes word ``2c * (BN + C_PAD) + r`` of a row pair: 32 distinct banks."""
        s_c = epi_tensors[0]
        tokens, cols = s_c.shape
        s_ct = cute.make_tensor(s_c.iterator, cute.make_layout((cols, tokens), stride=(1, cols + C_PAD)))
        ident = cute.make_identity_tensor(cute.product_each(cute.shape(epi_tile)))
        coords = tiled_copy_r2s.get_slice(tidx).partition_S(ident)
        sub = cute.local_tile(s_ct, epi_tile, epi_coord)
        if cutlass.const_expr(params.column_scales is not None):
            n0 = tile_coord_mnkl[0] * cols + epi_coord[0] * cute.size(epi_tile[0])
            for i in cutlass.range_constexpr(cute.size(tRS_rD)):
                sub[coords[i]] = tRS_rD[i] * params.column_scales[n0 + coords[i][0]]
        else:
            for i in cutlass.range_constexpr(cute.size(tRS_rD)):
                sub[coords[i]] = tRS_rD[i]

    def epi_end(self, params, epi_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s, tile_coord_mnkl,
                varlen_manager, tidx):
        with self._c_tile():
            return super().epi_end(params, epi_tensors, epi_tile, tiled_copy_t2r, tiled_copy_r2s,
                                   self._c_coord(tile_coord_mnkl), varlen_manager, tidx)

    # No D: the W4 mainloop takes its weight-row extent from a D-shaped tensor, which is never stored.
    def make_tma_epilogue_atoms_and_tensors(self, mD, mC, epilogue_args, varlen_m):
        return None, mD, None, None

    def epilog_gmem_copy_and_partition(self, atom, mD_mn, tile_shape_mn, epi_tile, sD, tile_coord_mnkl):
        assert atom is None, "the fused-QKV W4 epilogue stores no D"
        return None, None, None


@functools.lru_cache(maxsize=None)
def _gemm_class():
    from quack.gemm_sm90 import GemmSm90

    class FusedQKVGemmW4Sm90(TransposedQKVEpilogueMixin, GemmSm90):
        epi_threads = 2 * EPI_THREADS  # cooperative: both MMA warpgroups run the epilogue of their shared tile

    return FusedQKVGemmW4Sm90


def check_spec(spec: QKVW4Spec, arch: str, targets: tuple, name: str) -> None:
    """Raises why the quantized-weight kernel ``name`` (built for ``targets``) cannot take ``spec`` on ``arch``."""
    problem = supported(spec.qkv)
    if problem:
        raise ValueError(problem)
    if spec.weight_format not in FORMATS.values():
        raise ValueError(f"weight_format {spec.weight_format!r} is not one of {sorted(FORMATS.values())}")
    if spec.qkv.dtype_name != "bfloat16":
        raise ValueError(f"quantized weights decode to bfloat16: hidden must be bfloat16, not {spec.qkv.dtype_name}")
    if arch not in targets:
        raise ValueError(f"{name} targets {' / '.join(targets)}, not {arch}")


class FusedQKVGemmW4:
    """Builds quack's SM90 W4 GEMM with the transposed fused-QKV epilogue for ``spec``; ``build()`` returns
    ``(gemm, *fake_args)`` for ``compile_cache.compiled`` and ``args()`` the launch arguments."""

    compile_name = "fused_qkv_gemm_w4"
    cluster_shape = (1, 1, 1)  # quack's W4 takes (1, cluster_N, 1); a weight tile is not shared across tokens' CTAs

    def __init__(self, spec: QKVW4Spec, arch: str = ARCH):
        check_spec(spec, arch, (ARCH,), "FusedQKVGemmW4")
        self.spec, self.arch = spec, arch

    @property
    def fmt(self):
        return decode_format(self.spec.weight_format)

    def gemm(self):
        from quack.operand_transform.transform import TransformAW4

        fmt = self.fmt
        gemm = _gemm_class()(Float32, cutlass.BFloat16, (BN, TILE_TOKENS, fmt.tile_k), self.cluster_shape,
                             pingpong=False,
                             is_persistent=True, transform_a=lambda g: TransformAW4(g, fmt))
        gemm.qkv = self.spec.qkv
        return gemm

    def build(self) -> tuple:
        return (self.gemm(), *self.fake_args())

    def fake_args(self) -> tuple:
        from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor
        s = self.spec.qkv
        n = _padded(s.n_total)
        mA = _fake_operand(self.fmt, n)
        hidden, _, _, _, epi, scheduler, _, stream, *_ = FusedQKVGemm(s, self.arch).fake_args()
        t = hidden.shape[0]
        d = make_fake_tensor(cutlass.BFloat16, (n, t), stride=(1, cute.sym_int64(divisibility=VEC)),
                             assumed_align=16)
        col_scales = make_fake_compact_tensor(Float32, (n,), assumed_align=4) if self.spec.column_scales else None
        epi = QKVW4EpilogueArguments(*epi, col_scales)
        return (mA, hidden, d, None, epi, scheduler, None, stream, None, None)

    def args(self, hidden, weight, output, blocks, input_row_offsets, cache_lengths, lookup_table, layer_idx, bias,
             freqs_cis, q_norm, k_norm, scales, max_active_clusters: int, workspace=None, counters=None,
             value_blocks=None) -> tuple:
        """Launch arguments (torch tensors) in the compiled signature's order; the stream is the current one.
        ``workspace``/``counters``: the cross-tile latent's (``FusedQKVGemm.args``)."""
        from quack.operand_transform.host import w4_operand_views
        from quack.tile_scheduler import TileSchedulerOptions

        blob, sf, col_scales = prepare_weight(weight)
        epi = QKVW4EpilogueArguments(output, blocks, input_row_offsets, cache_lengths, lookup_table, Int32(layer_idx),
                                     bias, freqs_cis, q_norm, k_norm, scales, workspace, counters, value_blocks,
                                     col_scales)
        scheduler = TileSchedulerOptions(max_active_clusters=Int32(max_active_clusters), raster_order=None,
                                         max_swizzle_size=MAX_SWIZZLE)
        extent = _row_extent(hidden.device, blob.shape[0] * 64).as_strided((blob.shape[0] * 64, hidden.shape[0]),
                                                                            (1, 0))
        return w4_operand_views(self.fmt, blob, sf, BN), hidden, extent, None, epi, scheduler, None, None, None


@functools.lru_cache(maxsize=None)
def _row_extent(device, n: int):
    """The ``D`` quack's W4 mainloop takes its ``(weight rows, tokens)`` extent from: shaped, never read or stored
    (one row, broadcast over the tokens)."""
    import torch

    return torch.zeros(n, dtype=torch.bfloat16, device=device)


def _fake_operand(fmt, n: int):
    """quack's ``TransformAOperand`` views (``host._w4_views``) of an ``n``-row weight with a symbolic number of
    k-tiles: blob ``(256, words, m64 blocks, n / BN, k-tiles, 1)`` and the scale strip ``(bytes, m64 blocks,
    n / BN, k-tiles, 1)``."""
    from cutlass.cute.runtime import make_fake_tensor
    from quack.operand_transform.transform import TransformAOperand

    tm64, gt, kt = BN // 64, n // BN, cute.sym_int32()
    words = (16 if fmt.w8 else 8) * (fmt.tile_k // 64)
    run = words * 256  # bytes of one (m64 block, k-tile)
    block = cute.sym_int64(divisibility=run)  # kt * run
    blob = make_fake_tensor(cutlass.Uint8, (256, words, tm64, gt, kt, 1),
                            stride=(1, 256, block, cute.sym_int64(divisibility=run), run, 1), assumed_align=16)
    sf = None
    if fmt.sf_words:
        b = fmt.sf_bytes
        sf = make_fake_tensor(cutlass.Uint8, (b, tm64, gt, kt, 1), stride=(
            1, cute.sym_int64(divisibility=b), cute.sym_int64(divisibility=b), b, 1), assumed_align=16)
    return TransformAOperand(blob, sf)
