"""``cute_kv.paged_attention``: causal / sliding-window attention of a ragged step over a paged KV cache."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from cute_kv import reference
from cute_kv.dtypes import dtype_name
from cute_kv.kernels.attention.config import BM, BN, DTYPE_NAMES, FP8, VEC, supported, tiling
from cute_kv.ops.vectors import heads_packed, packed_heads
from cute_kv.row_indices import lut_chunk, tile_geometry
from cute_kv.validate import check_activation, check_step, check_tensor

LOG2E = math.log2(math.e)
MAX_SPLITS = 32


def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int, *,
                    causal: bool = True, window: Optional[int] = None, scale: Optional[float] = None,
                    mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None,
                    validate: bool = True) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over layer ``layer_idx``; returns ``[T, Hq, D_v]`` in ``q.dtype`` (or ``out``).

    Query ``i`` of request ``b`` is at position ``p = cache_lengths[b] + i`` and sees keys ``j`` in
    ``[0, cache_lengths[b] + seq_len_b)`` read through the lookup table, so this step's K/V must already be
    stored; ``causal`` keeps ``j <= p`` and ``window`` (needs ``causal``) also ``j > p - window``. GQA: query
    head ``hq`` reads KV head ``hq // (Hq // H)``. ``scale`` defaults to ``1/sqrt(D)``. ``q`` is in the cache
    dtype (bf16/fp16/fp32 for fp8 caches, which are dequantized with their scales). An MLA cache needs
    ``mla_v_dim``: values are the first ``mla_v_dim`` dims of the latent K rows (``D_v = mla_v_dim``).

    On SM90 a bf16/fp16 MHA/GQA cache with head_dim 64/128/256 runs the ``PagedAttention`` kernel (split-KV when
    the grid would not fill the GPU), on SM100 ``PagedAttentionSm100`` (16-bit caches); other cases, and CPU
    tensors, run the reference. ``validate=False`` (for
    CUDA-graph capture) skips the checks that read device values, as in ``store_kv``.
    """
    d_v = _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, mla_v_dim, out, validate)
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], d_v), dtype=q.dtype, device=q.device)
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        torch.ops.cute_kv.paged_attention(q, input_row_offsets, c.blocks, c.cache_lengths, c.lookup_table, c.scales,
                                          layer_idx, c.max_seq_length, c.max_cache_length,
                                          c.quantization_granularity, causal, window, scale, mla_v_dim, out)
    else:  # eager: skip the op's dispatcher (host time)
        dispatch(q, input_row_offsets, c, layer_idx, causal, window, scale, mla_v_dim, out)
    return out


def dispatch(q, input_row_offsets, collection, layer_idx, causal, window, scale, mla_v_dim, out) -> None:
    """Checked arguments to the kernel serving them, else to the reference, writing ``out``."""
    run = _kernel_for(collection, q, window, mla_v_dim) or reference.paged_attention
    run(q, input_row_offsets, collection, layer_idx, causal=causal, window=window, scale=scale, mla_v_dim=mla_v_dim,
        out=out)


def _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, mla_v_dim, out, validate) -> int:
    """Every argument, before anything runs; returns the output head dim ``D_v``."""
    collection.check_layer(layer_idx)
    check_activation("q", q, collection, ndim=3)
    t, hq, d = q.shape
    h = collection.num_heads
    if d != collection.head_size:
        raise ValueError(f"q head dim ({d}) must equal the cache head_size ({collection.head_size})")
    if hq == 0 or hq % h:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the cache's KV heads ({h})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise ValueError("window (a sliding causal window) needs causal=True")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    d_v = _check_mla_v_dim(mla_v_dim, collection)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=[t, hq, d_v], device=collection.device)
    check_step(collection, input_row_offsets, t, data_checks=validate)
    return d_v


def _check_mla_v_dim(mla_v_dim, collection) -> int:
    """``D_v``: ``mla_v_dim`` for an MLA cache (required, in ``[1, D]``), the head size otherwise (must be None)."""
    d = collection.head_size
    if not collection.is_mla:
        if mla_v_dim is not None:
            raise ValueError("mla_v_dim is only for MLA caches (KVD=1); this cache stores V")
        return d
    if isinstance(mla_v_dim, bool) or not isinstance(mla_v_dim, int) or not 0 < mla_v_dim <= d:
        raise ValueError(f"mla_v_dim must be an int in [1, {d}] for an MLA cache, got {mla_v_dim!r}")
    return mla_v_dim


def _kernel_for(collection, q, window, mla_v_dim) -> Optional[Callable]:
    """The SM90 ``PagedAttention`` launcher for these arguments, or None for the reference (``kernel_key``)."""
    c = collection
    if c.device.type != "cuda":
        return None
    from cute_kv.kernels.compile_cache import target_arch

    arch = target_arch(c.device)
    key = kernel_key(c, q, arch)
    return None if key is None else _launcher(key, arch)


def kernel_key(collection, q, arch: str) -> Optional[tuple]:
    """The compile-time key of the ``PagedAttention`` serving these arguments on ``arch``, or None where the
    reference runs instead: MLA caches, q in another dtype than a 16-bit cache, head dims, page sizes or granules
    the kernel cannot tile (``attention/config.supported``), a misaligned cache, or more rows than int32 TMA
    coordinates reach. ``sm_100a`` takes ``PagedAttentionSm100``'s key (``paged_attention_sm100.py``)."""
    if arch == "sm_100a":
        from cute_kv.ops.paged_attention_sm100 import kernel_key_sm100

        return kernel_key_sm100(collection, q)
    c = collection
    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    if arch != "sm_90a" or c.is_mla or q_dtype_name not in DTYPE_NAMES:
        return None
    if kv_dtype_name != FP8 and c.dtype != q.dtype:
        return None
    granularity = c.quantization_granularity if kv_dtype_name == FP8 and c.scales is not None else None
    e8m0 = granularity is not None and c.scale_dtype == torch.float8_e8m0fnu
    hq, h, d, p = q.shape[1], c.num_heads, c.head_size, c.page_size
    if (supported(hq, h, d, p, kv_dtype_name, granularity) or c.blocks.data_ptr() % 16
            or c.num_pages * c.kv_dim * c.num_layers * p >= 2**31):
        return None
    chunk = lut_chunk(tile_geometry(BN, p)[1], BN, p)
    lut = c.lookup_table
    lut_vector = lut.shape[1] % chunk == 0 and lut.stride(0) % chunk == 0 and lut.data_ptr() % (4 * chunk) == 0
    return ("paged_attention", q_dtype_name, hq, h, d, p, c.kv_dim, lut_vector, kv_dtype_name, granularity, e8m0)


@functools.lru_cache(maxsize=None)
def _launcher(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once: what stays per call is sizing the grid and launching."""
    from cute_kv.kernels.compile_cache import compiled

    if key[0] == "paged_attention_sm100":
        from cute_kv.ops.paged_attention_sm100 import launcher_sm100

        return launcher_sm100(key, arch)

    _, dtype_name, hq, h, d, _, _, _, kv_dtype_name, granularity, e8m0 = key
    ctas_per_sm = tiling(d, kv_dtype_name == FP8).ctas_per_sm

    def build():
        from cute_kv.kernels.attention.sm90 import PagedAttention

        kernel = PagedAttention(*key[1:])
        return kernel, *kernel.fake_args()

    def run(q, input_row_offsets, collection, layer_idx, *, causal=True, window=None, scale=None, mla_v_dim=None,
            out=None):
        t = q.shape[0]
        if t == 0:  # a grid of zero CTAs is a launch error
            return out
        c = collection
        m_blocks, splits = launch_shape(c, hq, _sm_count(q.device) * ctas_per_sm)
        dst = out if heads_packed(out, VEC) else torch.empty_like(out, memory_format=torch.contiguous_format)
        if splits > 1:
            o_part = torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((splits, t, hq), dtype=torch.float32, device=q.device)
        else:  # one split writes the output itself; the kernel's signature still takes partials
            o_part, lse_part = _unused_partials(q.device, hq, d)
        scale = 1.0 / math.sqrt(d) if scale is None else scale
        compiled(key, build, arch)(packed_heads(q, VEC), dst, o_part, lse_part, c.blocks, c.blocks,
                                   input_row_offsets.contiguous(), c.cache_lengths, c.lookup_table,
                                   _scales_arg(c.scales, granularity, e8m0), layer_idx, m_blocks, splits, int(causal),
                                   _window_arg(window), scale * LOG2E)
        if splits > 1:
            combine = compiled(("attention_combine", dtype_name, hq, d), lambda: _build_combine(dtype_name, hq, d),
                               arch)
            combine(dst, o_part, lse_part, splits)
        return out if dst is out else out.copy_(dst)

    return run


def _scales_arg(scales: Optional[torch.Tensor], granularity: Optional[int], e8m0: bool) -> Optional[torch.Tensor]:
    """What the kernel takes for the scales: none unless it dequantizes with them; e8m0 as its uint8 bits."""
    if granularity is None:
        return None
    return scales.view(torch.uint8) if e8m0 else scales


def launch_shape(collection, num_q_heads: int, slots: int) -> tuple[int, int]:
    """``(m_blocks, splits)``: query blocks of ``BM`` packed rows per (request, KV head) for the longest new-token
    run, and key splits for ``slots`` resident CTAs (SMs x CTAs per SM)."""
    c = collection
    m_blocks = -(-c.max_seq_length * (num_q_heads // c.num_heads) // BM)
    key_tiles = -(-c.max_cache_length // BN)
    return m_blocks, num_splits(c.batch_size * c.num_heads * m_blocks, key_tiles, slots)


def num_splits(ctas: int, key_tiles: int, slots: int) -> int:
    """Key splits per (query block, KV head, request): none once the grid fills the ``slots`` CTAs the GPU holds at
    once, else enough to fill them, keeping at least two key tiles per split (the ring's depth)."""
    if ctas >= slots or key_tiles < 4:
        return 1
    return max(1, min(-(-slots // ctas), key_tiles // 2, MAX_SPLITS))


def _window_arg(window: Optional[int]) -> int:
    """The kernel's int32 ``window``: 0 for none; a wider window than int32 holds masks nothing more than 2^31-1."""
    return 0 if window is None else min(window, 2**31 - 1)


@functools.lru_cache(maxsize=None)
def _unused_partials(device: torch.device, num_q_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholder partials for single-split launches (never written), allocated once per device and shape."""
    return (torch.empty((1, 1, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, 1, num_q_heads), dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _build_combine(dtype_name: str, num_q_heads: int, head_dim: int):
    from cute_kv.kernels.attention.combine import AttentionCombine

    kernel = AttentionCombine(dtype_name, num_q_heads, head_dim)
    return kernel, *kernel.fake_args()
