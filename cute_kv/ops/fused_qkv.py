"""``cute_kv.fused_qkv_matmul_kv_cache``: QKV projection whose K/V columns go straight into a paged cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from cute_kv import dtypes, reference
from cute_kv.ops import paths
from cute_kv.ops.vectors import rows_aligned
from cute_kv.reference.qkv import kv_columns
from cute_kv.reference.rope import RopeConfig
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

OP = "fused_qkv_matmul_kv_cache"


def fused_qkv_matmul_kv_cache(hidden: torch.Tensor, input_row_offsets: torch.Tensor, weight: torch.Tensor,
                              collection, layer_idx: int, *, output: Optional[torch.Tensor] = None,
                              bias: Optional[torch.Tensor] = None, rope: Optional[RopeConfig] = None,
                              validate: bool = True) -> torch.Tensor:
    """``C = hidden @ weight^T (+ bias)``: returns Q = ``C[:, :q_dim]``, stores K and V of layer ``layer_idx``.

    ``hidden [T, K]`` (bf16/fp16/fp32; the cache dtype unless the cache is fp8), ``weight [N_tot, K]`` and
    ``bias [N_tot]`` in ``hidden.dtype``. Columns after Q are K then V, ``H*D`` each (MLA: one latent
    head of ``D``), so ``q_dim = N_tot - 2*H*D`` (MLA: ``N_tot - D``) must be positive. New token ``i`` of
    request ``b`` is stored at ``cache_lengths[b] + i`` (quantized for fp8 caches with scales). ``rope``
    rotates Q (heads of ``rope.q_head_dim``, default ``D``) and K at that position (``reference/rope.py``).
    Q is written into ``output [T, q_dim]`` when given. Float32 accumulation; nothing is written on bad input.

    ``validate=False`` is for CUDA-graph capture: it skips the checks that read device values (the offsets, each
    request's pages and lengths against the collection, RoPE positions against ``rope.freqs_cis``), so the caller
    guarantees the step fits the pages and the table. Shapes, dtypes and devices are still checked; a torch.compile
    trace skips the same checks.
    """
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate)
    input_row_offsets = uint32_bits(input_row_offsets)  # int32 offsets: the same bits
    if output is None:
        output = hidden.new_empty((hidden.shape[0], weight.shape[0] - kv_columns(collection)))
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        torch.ops.cute_kv.fused_qkv_matmul_kv_cache(
            hidden, input_row_offsets, weight, c.blocks, c.cache_lengths, c.lookup_table, c.scales, bias,
            None if rope is None else rope.freqs_cis, rope is not None and rope.interleaved,
            None if rope is None else rope.q_head_dim, output, layer_idx, c.max_seq_length, c.max_cache_length,
            c.quantization_granularity)
    else:  # eager: skip the op's dispatcher (host time)
        dispatch(hidden, input_row_offsets, weight, c, layer_idx, bias, rope, output)
    return output


def dispatch(hidden, input_row_offsets, weight, collection, layer_idx, bias, rope, output) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides); Q goes into
    ``output``."""
    path = paths.route(collection.device, lambda arch: plan(collection, hidden, weight, rope, arch))
    run = reference.fused_qkv_matmul_kv_cache if path is None else _launcher(path.key, path.arch)
    run(hidden, input_row_offsets, weight, collection, layer_idx, bias=bias, rope=rope, output=output)


def explain(hidden, input_row_offsets, weight, collection, layer_idx: int, *, output=None, bias=None,
            rope: Optional[RopeConfig] = None, validate: bool = True, arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(fused_qkv_matmul_kv_cache, ...)``: the path this call takes on ``arch`` (default: the
    cache's device)."""
    _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate)
    return paths.planned(OP, collection.device, arch, lambda arch: plan(collection, hidden, weight, rope, arch))


def _check(hidden, input_row_offsets, weight, collection, layer_idx, output, bias, rope, validate) -> None:
    collection.check_layer(layer_idx)
    dev = collection.device
    check_activation("hidden", hidden, collection, ndim=2)
    t, k = hidden.shape
    check_tensor("weight", weight, dtype=hidden.dtype, shape=[None, k], device=dev)
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


def _check_rope(rope, collection, q_dim: int, lengths: Optional[torch.Tensor]) -> None:
    if not isinstance(rope, RopeConfig):
        raise TypeError(f"rope must be a RopeConfig or None, got {type(rope).__name__}")
    check_tensor("rope.freqs_cis", rope.freqs_cis, device=collection.device)
    d, qh, r = collection.head_size, rope.q_head_dim or collection.head_size, rope.rope_dim
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


def plan(collection, hidden, weight, rope, arch: str) -> paths.KernelPath:
    """The SM90 ``FusedQKVMatmul`` serving these arguments (its compile-time key, less the bias flag), or why the
    reference runs instead: SM100 (no tcgen05 mainloop yet), fp8 caches, rows that are not 16-byte aligned, or a
    shape the kernel cannot tile (``qkv/sm90.supported``)."""
    from cute_kv.kernels.qkv.sm90 import DTYPES, supported

    def fallback(reason):
        return paths.reference(OP, reason, arch)

    c = collection
    name = dtypes.dtype_name(c.dtype)
    t, k = hidden.shape
    if arch != "sm_90a":
        return fallback(f"no {arch} fused QKV kernel yet (tcgen05 mainloop); the kernel is SM90's")
    if name not in DTYPES:
        return fallback(f"the cache is {name}; the kernel writes {' or '.join(DTYPES)} caches")
    if k == 0:
        return fallback("hidden has no columns (K = 0)")
    if not (rows_aligned(hidden) and rows_aligned(weight)):
        return fallback("hidden and weight need row-major, 16-byte aligned rows")
    if rope is not None and (rope.freqs_cis.stride(1) != 1 or rope.freqs_cis.device != c.device):
        return fallback("rope.freqs_cis must be row-major on the cache's device")
    q_dim = weight.shape[0] - kv_columns(c)
    rope_key = None if rope is None else (rope.rope_dim, rope.interleaved, rope.q_head_dim or c.head_size)
    tile_m = 64 if t < 2048 else 128  # small steps: more CTAs to stream the weight with
    problem = supported(q_dim, c.kv_dim, c.num_heads, c.head_size, rope_key, tile_m)
    if problem:
        return fallback(problem)
    if c.blocks.data_ptr() % 16:
        return fallback("blocks is not 16-byte aligned")
    key = (name, q_dim, c.kv_dim, c.page_size, c.num_heads, c.head_size, rope_key, tile_m)
    return paths.kernel(OP, "FusedQKVMatmul", key, arch)


def _launcher(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one ``plan`` key: compiles (once per bias flag) and launches, Q into ``output``."""
    from cute_kv.kernels.compile_cache import compiled
    from cute_kv.kernels.qkv.sm90 import FusedQKVMatmul

    *geometry, rope_key, tile_m = key
    q_dim = geometry[1]

    def build(has_bias):
        kernel = FusedQKVMatmul(*geometry, has_bias, rope_key, tile_m)
        return kernel, *kernel.fake_args()

    def run(hidden, input_row_offsets, weight, collection, layer_idx, *, bias=None, rope=None, output=None):
        t = hidden.shape[0]
        out = output if output is not None and rows_aligned(output) else torch.empty(
            (t, q_dim), dtype=hidden.dtype, device=hidden.device)
        if t:  # a grid of zero CTAs is a launch error
            has_bias = bias is not None
            fn = compiled(("fused_qkv_matmul", *geometry, has_bias, rope_key, tile_m), lambda: build(has_bias), arch)
            fn(hidden, weight, out, collection.blocks, input_row_offsets.contiguous(), collection.cache_lengths,
               collection.lookup_table, None if bias is None else bias.contiguous(),
               None if rope is None else rope.freqs_cis, layer_idx)
        return out if output is None or out is output else output.copy_(out)

    return run
