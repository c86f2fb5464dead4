"""``cute_kv.fused_qkv_matmul_kv_cache``: QKV projection whose K/V columns go straight into a paged cache."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch

from cute_kv import dtypes, reference
from cute_kv.kernels.archs import ARCHS, is_blackwell
from cute_kv.ops import paths
from cute_kv.ops.vectors import rows_aligned
from cute_kv.reference.norm import QKNorm
from cute_kv.reference.qkv import kv_columns, q_head_dim
from cute_kv.reference.rope import RopeConfig
from cute_kv.reference.weights import Fp8Weight, Int4Weight
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

OP = "fused_qkv_matmul_kv_cache"


def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight, collection,
                              layer_idx: int, *, output: Optional[torch.Tensor] = None,
                              bias: Optional[torch.Tensor] = None, rope: Optional[RopeConfig] = None,
                              qk_norm: Optional[QKNorm] = None, validate: bool = True, plan=None) -> torch.Tensor:
    """``C = hidden @ weight^T (+ bias)``: returns Q = ``C[:, :q_dim]``, stores K and V of layer ``layer_idx``.

    ``hidden [T, K]`` (bf16/fp16/fp32; the cache dtype unless the cache is fp8) and ``bias [N_tot]`` in
    ``hidden.dtype``; ``weight [N_tot, K]`` in ``hidden.dtype``, or quantized: ``Int4Weight`` (packed int4 with a
    ``group_size`` and optional zero points) or ``Fp8Weight`` (per-channel scales), see ``reference/weights.py``.
    Columns after Q are K then V, ``H*D`` each (MLA: one latent head of ``D``), so ``q_dim = N_tot - 2*H*D``
    (MLA: ``N_tot - D``) must be positive. New token ``i`` of request ``b`` is stored at ``cache_lengths[b] + i``
    (quantized for fp8 caches with scales). ``qk_norm`` RMS-normalizes Q and K heads (MLA: the latent's first
    ``kv_lora_rank`` dims, ``reference/norm.py``), then ``rope`` rotates Q (heads of ``rope.q_head_dim``, default
    ``D``) and K at that position (``reference/rope.py``). Q is written into ``output [T, q_dim]`` when given.
    Float32 accumulation; nothing is written on bad input.

    ``validate=False`` is for CUDA-graph capture: it skips the checks that read device values (the offsets, each
    request's pages and lengths against the collection, RoPE positions against ``rope.freqs_cis``), so the caller
    guarantees the step fits the pages and the table. Shapes, dtypes and devices are still checked; a torch.compile
    trace skips the same checks. Rows whose page entry is not a page of the cache are never written by the kernel.
    A RoPE position outside ``rope.freqs_cis`` reads no table row: the kernel makes the dims it rotates NaN.

    ``plan`` (``cute_kv.plan_step``) has checked the step (RoPE positions included): the call reads no device value
    and reuses the path chosen by the first call of the same signature (``store_kv``).
    """
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        path = plan.entry(call_key(OP, (hidden, weight, output, bias, rope, qk_norm), ()),
                          lambda: _planned(hidden, input_row_offsets, weight, collection, layer_idx, output, bias,
                                           rope, qk_norm, plan))
        if output is None:
            output = hidden.new_empty((hidden.shape[0], weight.shape[0] - kv_columns(collection)))
        _run(path, hidden, plan.offsets_bits, weight, collection, layer_idx, bias, rope, output, qk_norm)
        return output
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate, qk_norm)
    input_row_offsets = uint32_bits(input_row_offsets)  # int32 offsets: the same bits
    if output is None:
        output = hidden.new_empty((hidden.shape[0], weight.shape[0] - kv_columns(collection)))
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        w, *w_quant = _weight_args(weight)
        torch.ops.cute_kv.fused_qkv_matmul_kv_cache(
            hidden, input_row_offsets, w, c.traced_blocks(OP), c.cache_lengths, c.lookup_table, c.scales, bias,
            None if rope is None else rope.freqs_cis, rope is not None and rope.interleaved,
            None if rope is None else rope.q_head_dim, output, layer_idx, c.max_seq_length, c.max_cache_length,
            c.quantization_granularity, *w_quant, *_norm_args(qk_norm), c.rope_dim)
    else:  # eager: skip the op's dispatcher (host time)
        dispatch(hidden, input_row_offsets, weight, c, layer_idx, bias, rope, output, qk_norm)
    return output


def _weight_args(weight) -> tuple:
    """A weight as the custom op's ``(weight, weight_scales, weight_zero_points, group_size)``."""
    if isinstance(weight, Int4Weight):
        return weight.packed, weight.scales, weight.zero_points, weight.group_size
    if isinstance(weight, Fp8Weight):
        return weight.weight, weight.scales, None, None
    return weight, None, None, None


def weight_from_args(weight, weight_scales, weight_zero_points, group_size):
    """Inverse of ``_weight_args`` (the packed int4 weight is the uint8 one)."""
    if weight.dtype == torch.uint8:
        return Int4Weight(weight, weight_scales, group_size, weight_zero_points is not None, weight_zero_points)
    if weight.dtype == torch.float8_e4m3fn:
        return Fp8Weight(weight, weight_scales)
    return weight


def _norm_args(qk_norm) -> tuple:
    if qk_norm is None:
        return None, None, 0.0, 0.0
    return qk_norm.q_weight, qk_norm.k_weight, float(qk_norm.epsilon), float(qk_norm.weight_offset)


def dispatch(hidden, input_row_offsets, weight, collection, layer_idx, bias, rope, output, qk_norm=None) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides); Q goes into
    ``output``."""
    _run(paths.route(OP, collection.device, lambda arch: plan(collection, hidden, weight, rope, arch, qk_norm)),
         hidden, input_row_offsets, weight, collection, layer_idx, bias, rope, output, qk_norm)


def _planned(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, qk_norm,
             step) -> Optional[paths.KernelPath]:
    """The first call of a plan with this signature: checked (the step's values by the plan), then routed."""
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, False, qk_norm)
    step.check(OP, collection, input_row_offsets, hidden.shape[0])  # the shapes are the entry's key: once
    if rope is not None:
        step.check_positions(OP, rope.freqs_cis)
    return paths.route(OP, collection.device, lambda arch: plan(collection, hidden, weight, rope, arch, qk_norm))


def _run(path, hidden, input_row_offsets, weight, collection, layer_idx, bias, rope, output, qk_norm) -> None:
    """The kernel of ``path``, or the reference for None; Q goes into ``output``."""
    if path is None:
        reference.fused_qkv_matmul_kv_cache(hidden, input_row_offsets, weight, collection, layer_idx, bias=bias,
                                            rope=rope, output=output, qk_norm=qk_norm)
    else:
        _launcher(path.key, path.arch, qk_norm)(hidden, input_row_offsets, weight, collection, layer_idx, bias=bias,
                                                 rope=rope, output=output)


def explain(hidden, input_row_offsets, weight, collection, layer_idx: int, *, output=None, bias=None,
            rope: Optional[RopeConfig] = None, qk_norm: Optional[QKNorm] = None, validate: bool = True,
            arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(fused_qkv_matmul_kv_cache, ...)``: the path this call takes on ``arch`` (default: the
    cache's device)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate, qk_norm)
    return paths.planned(OP, collection.device, arch,
                         lambda arch: plan(collection, hidden, weight, rope, arch, qk_norm))


def _check_weight(weight, hidden, dev) -> None:
    k = hidden.shape[1]
    if isinstance(weight, Int4Weight):
        if weight.packed.shape[1] * 2 != k:
            raise ValueError(f"weight.packed must have shape [N_tot, K/2] = [*, {k / 2:g}] (two int4 per byte) for "
                             f"hidden's K = {k}, got {list(weight.packed.shape)}")
        if weight.device != dev:
            raise ValueError(f"weight.packed must be on {dev}, got {weight.device}")
        if weight.scales.dtype not in (hidden.dtype, torch.float32):
            raise TypeError(f"weight.scales must be {hidden.dtype} (hidden's dtype) or float32, got "
                            f"{weight.scales.dtype}")
    elif isinstance(weight, Fp8Weight):
        check_tensor("weight.weight", weight.weight, shape=[None, k], device=dev)
    else:
        check_tensor("weight", weight, dtype=hidden.dtype, shape=[None, k], device=dev)


def _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate,
           qk_norm=None) -> None:
    collection.check_layer(layer_idx)
    dev = collection.device
    check_activation("hidden", hidden, collection, ndim=2)
    t, k = hidden.shape
    _check_weight(weight, hidden, dev)
    if collection.is_mla and collection.num_heads != 1:
        raise ValueError(f"an MLA cache must have one (latent) head, got num_heads={collection.num_heads}")
    kv_cols = kv_columns(collection)
    q_dim = weight.shape[0] - kv_cols
    if q_dim <= 0:
        raise ValueError(f"weight has {weight.shape[0]} rows but the cache alone takes {kv_cols} "
                         f"({'D' if collection.is_mla else '2*H*D'}); q_dim = N_tot - {kv_cols} must be positive")
    if bias is not None:
        check_tensor("bias", bias, dtype=hidden.dtype, shape=[weight.shape[0]], device=dev)
    if output is not None:
        check_tensor("output", output, dtype=hidden.dtype, shape=[t, q_dim], device=dev)
    lengths = check_step(collection, input_row_offsets, t, data_checks=validate)
    if rope is not None:
        _check_rope(rope, collection, q_dim, lengths)
    if qk_norm is not None:
        _check_qk_norm(qk_norm, collection, q_dim, q_head_dim(rope, collection.latent_dim))


def _check_qk_norm(qk_norm, collection, q_dim: int, qh: int) -> None:
    if not isinstance(qk_norm, QKNorm):
        raise TypeError(f"qk_norm must be a QKNorm or None, got {type(qk_norm).__name__}")
    d = collection.latent_dim
    if qk_norm.q_weight is not None:
        check_tensor("qk_norm.q_weight", qk_norm.q_weight, device=collection.device)
        if q_dim % qh:
            raise ValueError(f"q_dim ({q_dim}) must be a multiple of the Q head size ({qh}) for qk_norm.q_weight "
                             f"(set rope.q_head_dim when Q heads differ from the cache's)")
        if qk_norm.q_weight.shape[0] > qh:
            raise ValueError(f"qk_norm.q_weight has {qk_norm.q_weight.shape[0]} dims, more than a Q head ({qh})")
    if qk_norm.k_weight is not None:
        check_tensor("qk_norm.k_weight", qk_norm.k_weight, device=collection.device)
        if qk_norm.k_weight.shape[0] > d:
            raise ValueError(f"qk_norm.k_weight has {qk_norm.k_weight.shape[0]} dims, more than a cache head ({d}; "
                             f"MLA: kv_lora_rank <= head_size)")


def _check_rope(rope, collection, q_dim: int, lengths: Optional[torch.Tensor]) -> None:
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a RopeConfig or None, got {type(rope).__name__}")
    check_tensor("rope.freqs_cis", rope.freqs_cis, device=collection.device)
    d, qh, r = collection.latent_dim, rope.q_head_dim or collection.latent_dim, rope.rope_dim
    if q_dim % qh:
        raise ValueError(f"q_dim ({q_dim}) must be a multiple of the Q head size ({qh}; set rope.q_head_dim)")
    if r > min(d, qh):
        raise ValueError(f"rope.freqs_cis width (rope_dim={r}) exceeds the head size (K {d}, Q {qh})")
    if lengths is None:  # validate=False: positions are device values
        return
    ends = torch.where(lengths > 0, collection.cache_lengths.to(torch.int64) + lengths, 0)
    if ends.numel() and int(ends.max()) > rope.freqs_cis.shape[0]:
        b = int(ends.argmax())
        raise ValueError(f"rope.freqs_cis has {rope.freqs_cis.shape[0]} positions but request {b} reaches "
                         f"position {int(ends[b]) - 1}")


def plan(collection, hidden, weight, rope, arch: str, qk_norm=None) -> paths.KernelPath:
    """The ``FusedQKVGemm`` serving these checked arguments on ``arch`` (its ``QKVSpec`` key, without bias), for a
    quantized weight the ``FusedQKVGemmW4`` (a ``QKVW4Spec`` key: the spec and the decode format, which names the
    weight dtype, group size and zero points), or why the reference runs instead: quantized weights the decode does
    not take (``_quantized_problem``), fp32 activations, e5m2 caches, strided rope-aware caches, unaligned rows,
    or a shape the kernel cannot tile (``kernels/qkv/gemm.py`` ``supported``). Host values only: testable without a
    GPU."""
    from cute_kv.kernels.qkv.gemm import DTYPES, QKVSpec, supported

    def fallback(reason):
        return paths.reference(OP, reason, arch)

    dtype_name = dtypes.dtype_name(hidden.dtype)  # the cache's too, unless it is fp8
    c = collection
    quantized = not isinstance(weight, torch.Tensor)
    weight_format = None
    k_norm_dim = _norm_key(qk_norm)[1] if qk_norm is not None else 0
    # MLA's latent norm and rope-aware rows reduce across column tiles: the last-arriver epilogue (kernels/qkv/gemm.py)
    cross_dims = c.padded_depth if c.rope_dim is not None else (k_norm_dim if c.is_mla else 0)
    if quantized:
        weight_format, problem = _quantized_problem(weight, hidden, arch)
        if problem:
            return fallback(problem)
    if dtype_name not in DTYPES:
        return fallback(f"hidden is {dtype_name}; the kernel takes {' or '.join(sorted(DTYPES))}")
    if hidden.shape[1] == 0:
        return fallback("hidden has no columns (K = 0)")
    if quantized and not c.is_compact:
        return fallback("a strided cache with a quantized weight: its epilogue writes MAX's compact blocks")
    if c.rope_dim is not None and not c.is_compact:  # as store_kv routes it: no strided rope-aware kernel is built
        return fallback("rope-aware rows: a strided cache")
    if not (rows_aligned(hidden) and (quantized or rows_aligned(weight))) or c.key_blocks.data_ptr() % 16 \
            or c.value_blocks.data_ptr() % 16:
        return fallback("hidden, weight and blocks need row-major, 16-byte aligned rows")
    if rope is not None and not rows_aligned(rope.freqs_cis):
        return fallback("rope.freqs_cis needs row-major, 16-byte aligned rows")
    fp8 = dtypes.is_fp8(c.dtype)
    if fp8 and c.dtype != torch.float8_e4m3fn:
        return fallback(f"{dtypes.dtype_name(c.dtype)} caches: the kernel quantizes to float8_e4m3fn")
    e8m0 = c.scales is not None and c.scales.dtype == torch.float8_e8m0fnu
    if fp8 and c.scales is not None and c.scales.dtype != torch.float32 and not e8m0:
        return fallback(f"{dtypes.dtype_name(c.scales.dtype)} scales: the kernel writes float32 or e8m0 scales")
    granularity = 0 if c.scales is None or c.rope_dim is not None else c.quantization_granularity
    d = c.latent_dim  # rope-aware rows: the logical width (their content and tail bytes are the epilogue's)
    spec = QKVSpec(dtype_name, weight.shape[0] - kv_columns(c), c.kv_dim, c.page_size, c.num_heads, d,
                   q_head_dim(rope, d), False, None if rope is None else (rope.rope_dim, rope.interleaved),
                   *_norm_key(qk_norm), fp8=fp8, granularity=granularity, e8m0=e8m0, cross_dims=cross_dims,
                   rope_tail=c.rope_dim or 0, strided=not c.is_compact)
    problem = supported(spec)
    if problem:
        return fallback(problem)
    if quantized:
        from cute_kv.kernels.qkv.w4 import QKVW4Spec

        name = "FusedQKVGemmW4Sm100" if is_blackwell(arch) else "FusedQKVGemmW4"
        return paths.kernel(OP, name, QKVW4Spec(spec, weight_format), arch)
    return paths.kernel(OP, "FusedQKVGemm", spec, arch)


def _quantized_problem(weight, hidden, arch: str) -> tuple[Optional[str], str]:
    """``(decode format, "")`` when ``FusedQKVGemmW4`` takes this quantized weight on ``arch``, else
    ``(None, why not)``."""
    from cute_kv.kernels.qkv import w4

    name = type(weight).__name__
    if arch not in ARCHS:
        return None, f"{name} weights on {arch}: the quantized-weight mainloops are {', '.join(ARCHS)}'s"
    if hidden.dtype != torch.bfloat16:
        return None, f"{name} weights decode to bfloat16; hidden is {dtypes.dtype_name(hidden.dtype)}"
    fmt, problem = w4.weight_format(weight)
    if problem:
        return None, problem
    if hidden.shape[1] % w4.K_TILE:
        return None, f"{name} weights need K ({hidden.shape[1]}) to be a multiple of {w4.K_TILE} (the decode's k-tile)"
    return fmt, ""


def _launcher(spec, arch: str, qk_norm) -> Callable:
    """``run(...)`` for one ``plan`` key: the ``FusedQKVGemm`` (quack's SM90/SM100 GEMM core with our epilogue) or
    ``FusedQKVGemmW4`` (quantized weights, repacked once per weight), compiled once per bias flag, Q into
    ``output``."""
    from cute_kv.kernels.compile_cache import compiled

    qkv = getattr(spec, "qkv", spec)  # a QKVW4Spec's QKVSpec
    norm_weights = (None, None) if qk_norm is None else tuple(
        None if w is None else w.to(torch.float32).contiguous() for w in (qk_norm.q_weight, qk_norm.k_weight))

    def run(hidden, input_row_offsets, weight, collection, layer_idx, *, bias=None, rope=None, output=None):
        t, q_dim = hidden.shape[0], qkv.q_dim
        out = output if output is not None and rows_aligned(output) else torch.empty(
            (t, q_dim), dtype=hidden.dtype, device=hidden.device)
        scales = collection.scales
        if qkv.e8m0:  # the kernel stores e8m0 scales as their bytes
            scales = scales.view(torch.uint8)
        if t:  # a persistent grid over zero tiles still launches: skip it
            kernel = _gemm(_with_bias(spec, bias is not None), arch)
            fn = compiled(*compile_unit(kernel.spec, arch), arch)
            latent = latent_workspace(hidden.device, qkv, t) if qkv.last_arriver else ()
            c = collection
            # strided: the K plane as blocks, the V plane beside it (MLA: K only)
            blocks, value_blocks = (c.key_blocks, None if c.is_mla else c.value_blocks) if qkv.strided else (
                c.blocks, None)
            fn(*kernel.args(hidden, weight, out, blocks, input_row_offsets.contiguous(), c.cache_lengths.contiguous(),
                            c.lookup_table, layer_idx, None if bias is None else bias.contiguous(),
                            None if rope is None else rope.freqs_cis, *norm_weights, scales,
                            _max_active_clusters(c.device, kernel.cluster_shape), *latent, value_blocks=value_blocks))
        return out if output is None or out is output else output.copy_(out)

    return run


def latent_workspace(device, spec, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(workspace, counters)`` for a ``QKVSpec`` with a ``last_arriver`` over ``num_rows`` tokens: float32
    ``[rows, spec.workspace_cols]`` (the latent before its finish, then the tiles' partial sums of squares; or the
    wide heads' columns) with ``rows`` whole M tiles of whole clusters (each CTA writes every row of its tile, past
    ``num_rows`` too, and counts on its M tile), and ``spec.counter_groups`` int32 arrival counters per M tile
    (``kernels/qkv/scratch.py``: cached per device and stream, zero between launches)."""
    from cute_kv.kernels.qkv.gemm import CLUSTER_M, CTA_ROWS
    from cute_kv.kernels.qkv.scratch import scratch

    tiles = -(-num_rows // (CTA_ROWS * CLUSTER_M)) * CLUSTER_M  # the grid's M tiles: whole clusters
    return scratch(device, ("latent", spec.counter_groups), tiles * CTA_ROWS, spec.workspace_cols,
                   tiles * spec.counter_groups)


def compile_unit(spec, arch: str) -> tuple:
    """``(compile key, build)`` of the kernel for one ``QKVSpec`` or ``QKVW4Spec`` (bias flag included): what the
    launcher compiles and ``prebuild`` compiles ahead."""
    kernel = _gemm(spec, arch)
    return (kernel.compile_name, kernel.spec), kernel.build


def _with_bias(spec, has_bias: bool):
    """The compile key with its bias flag set (a ``QKVW4Spec`` carries it in its ``QKVSpec``)."""
    from cute_kv.kernels.qkv.w4 import QKVW4Spec

    if isinstance(spec, QKVW4Spec):
        return dataclasses.replace(spec, qkv=dataclasses.replace(spec.qkv, has_bias=has_bias))
    return dataclasses.replace(spec, has_bias=has_bias)


@functools.lru_cache(maxsize=None)
def _gemm(spec, arch: str):
    """The kernel builder per compile key (built once: its checks and quack's classes stay off the call path)."""
    from cute_kv.kernels.qkv.gemm import FusedQKVGemm
    from cute_kv.kernels.qkv.w4 import FusedQKVGemmW4, QKVW4Spec

    if isinstance(spec, QKVW4Spec) and is_blackwell(arch):
        from cute_kv.kernels.qkv.w4_sm100 import FusedQKVGemmW4Sm100

        return FusedQKVGemmW4Sm100(spec, arch)
    return (FusedQKVGemmW4 if isinstance(spec, QKVW4Spec) else FusedQKVGemm)(spec, arch)


def _norm_key(qk_norm) -> tuple:
    """``QKVSpec``'s norm fields: dims each weight covers (0: none), epsilon, offset."""
    if qk_norm is None:
        return 0, 0
    width = lambda w: 0 if w is None else w.shape[0]  # noqa: E731
    return (width(qk_norm.q_weight), width(qk_norm.k_weight), float(qk_norm.epsilon), float(qk_norm.weight_offset))


def _max_active_clusters(device, cluster_shape) -> int:
    """Clusters of ``cluster_shape`` resident at once on ``device``: the persistent scheduler's grid (a
    ``paths.dry_run``: one per ``size`` SMs of the GPU it stands in)."""
    size = cluster_shape[0] * cluster_shape[1] * cluster_shape[2]
    target = paths.dry_target()
    return _device_max_active_clusters(device, size) if target is None else target.sm_count // size


@functools.lru_cache(maxsize=None)
def _device_max_active_clusters(device, size: int) -> int:
    from quack.cute_dsl_utils import get_max_active_clusters

    return get_max_active_clusters(size, device_id=device.index or 0)
