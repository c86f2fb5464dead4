"""``cute_kv.paged_attention``: causal / sliding-window attention of a ragged step over a paged KV cache."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from cute_kv import reference
from cute_kv.dtypes import dtype_name
from cute_kv.kernels.attention.config import BM, DTYPE_NAMES, FP8, VEC, index_limits, key_tile, supported
from cute_kv.ops import mla_decode, mla_decode_sm100, paths, units
from cute_kv.ops.vectors import heads_packed, packed_heads
from cute_kv.row_indices import lut_chunk, tile_geometry
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

OP = "paged_attention"
LOG2E = math.log2(math.e)
MAX_SPLITS = 32
# CUDA's grid limits. The attention kernels' grid: (query blocks, KV heads x key splits, requests).
MAX_GRID_X, MAX_GRID_Y, MAX_GRID_Z = 2**31 - 1, 65535, 65535
SPLIT_COST = 1  # key tiles' worth of time a split adds: its prologue, epilogue and combine share


def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int, *,
                    causal: bool = True, window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, return_lse: bool = False, scale: Optional[float] = None,
                    mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None, validate: bool = True,
                    plan=None):
    """Attention of ``q [T, Hq, D]`` over layer ``layer_idx``; returns ``[T, Hq, D_v]`` in ``q.dtype`` (or ``out``),
    or ``(out, lse)`` with ``return_lse``.

    Query ``i`` of request ``b`` is at position ``p = cache_lengths[b] + i`` and sees keys ``j`` in
    ``[0, cache_lengths[b] + seq_len_b)`` read through the lookup table, so this step's K/V must already be
    stored; ``causal`` keeps ``j <= p`` and ``window`` (needs ``causal``) also ``j > p - window``. GQA: query
    head ``hq`` reads KV head ``hq // (Hq // H)``. ``scale`` defaults to ``1/sqrt(D)``. ``q`` is in the cache
    dtype (bf16/fp16/fp32 for fp8 caches, which are dequantized with their scales). An MLA cache needs
    ``mla_v_dim``: values are the first ``mla_v_dim`` dims of the latent K rows (``D_v = mla_v_dim``). A rope-aware
    FP8 MLA cache (``rope_dim`` set) takes ``q [T, Hq, latent_dim]`` and is read as its dequantized logical rows.

    Logits are ``s = scale * q.k``; ``softcap = c > 0`` (Gemma 2) makes them ``c * tanh(s / c)`` before masking
    (None or 0: off). ``sinks`` (gpt-oss), float32 ``[Hq]``: a logit per query head that joins the softmax
    denominator only, ``out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m))``. ``return_lse`` also
    returns ``lse`` float32 ``[T, Hq]``, the NATURAL log of that denominator plus ``m`` (the sink included), -inf
    for a row that sees no key and no sink: attention computed over disjoint parts of the keys (several caches,
    chunks of context) merges exactly as ``o = sum_i e^(lse_i - lse) o_i`` with ``lse = logsumexp_i lse_i``.

    An MHA/GQA cache (bf16/fp16, or fp8 e4m3 read by bf16/fp16 q) with head_dim 64/128/256 runs ``PagedAttention``
    on SM90 and ``PagedAttentionSm100`` on SM100 (split-KV when the grid would not fill the GPU); other cases (a
    non-positive ``scale`` without soft-cap included), and CPU tensors, run the reference: on CUDA with a
    ``FallbackWarning`` (``cute_kv.explain`` says why). ``validate=False`` (for CUDA-graph capture) skips the
    checks that read device values, as a torch.compile trace does (``store_kv``). ``plan`` (``cute_kv.plan_step``)
    has checked the step and keeps the path, launch shape and split-KV partials chosen by the first call of the same
    signature: the call reads no device value and allocates only its outputs (``store_kv``).
    """
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        collection.check_layer(layer_idx)
        d_v, run = plan.entry(call_key(OP, (q, sinks, out), (causal, window, scale, softcap, return_lse, mla_v_dim)),
                              lambda: _planned(q, input_row_offsets, collection, layer_idx, causal, window, scale,
                                               softcap, sinks, return_lse, mla_v_dim, out, plan))
        out, lse = outputs(q, d_v, out, return_lse)
        run(q, plan.offsets_bits, collection, layer_idx, causal=causal, window=window, scale=scale,
            softcap=softcap or None, sinks=sinks, mla_v_dim=mla_v_dim, out=out, lse=lse, return_lse=return_lse)
        return (out, lse) if return_lse else out
    d_v = _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
                 mla_v_dim, out, validate)
    input_row_offsets = uint32_bits(input_row_offsets)  # int32 offsets: the same bits
    out, lse = outputs(q, d_v, out, return_lse)
    softcap = softcap or None  # 0 means off
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        torch.ops.cute_kv.paged_attention(q, input_row_offsets, c.blocks, c.cache_lengths, c.lookup_table, c.scales,
                                          layer_idx, c.max_seq_length, c.max_cache_length,
                                          c.quantization_granularity, causal, window, scale, softcap, sinks,
                                          mla_v_dim, out, lse, c.rope_dim)
    else:  # eager: skip the op's dispatcher (host time)
        dispatch(q, input_row_offsets, c, layer_idx, causal, window, scale, softcap, sinks, mla_v_dim, out, lse)
    return (out, lse) if return_lse else out


def dispatch(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, mla_v_dim, out,
             lse) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides), writing ``out`` (and
    ``lse`` if given)."""
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, arch, scale, softcap, sinks,
                                                                lse is not None, mla_v_dim, window))
    run = reference.paged_attention if path is None else _launcher(path.key, path.arch)
    run(q, input_row_offsets, collection, layer_idx, causal=causal, window=window, scale=scale, softcap=softcap,
        sinks=sinks, mla_v_dim=mla_v_dim, out=out, lse=lse, return_lse=lse is not None)


def _planned(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
             mla_v_dim, out, step) -> tuple[int, Callable]:
    """The first call of a plan with this signature: checked (the step's values by the plan), routed, and its launch
    sized once, split-KV partials included; ``(D_v, run)``."""
    d_v = _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
                 mla_v_dim, out, False)
    step.check(OP, collection, input_row_offsets, *q.shape[:2])  # the shapes are the entry's key: once
    softcap = softcap or None
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, arch, scale, softcap, sinks,
                                                                return_lse, mla_v_dim, window))
    if path is None:
        return d_v, reference.paged_attention
    return d_v, functools.partial(_launcher(path.key, path.arch),
                                  workspace=launch_workspace(path.key, q, collection, causal, window))


def explain(q, input_row_offsets, collection, layer_idx: int, *, causal: bool = True, window: Optional[int] = None,
            softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
            scale: Optional[float] = None, mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None,
            validate: bool = True, arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(paged_attention, ...)``: the path this call takes on ``arch`` (default: q's device)."""
    _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse, mla_v_dim,
           out, validate)
    return paths.planned(OP, collection.device, arch,
                         lambda arch: plan(collection, q, arch, scale, softcap or None, sinks, return_lse,
                                           mla_v_dim, window))


def _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse, mla_v_dim,
           out, validate) -> int:
    """Every argument, before anything runs; returns the output head dim ``D_v``."""
    collection.check_layer(layer_idx)
    check_activation("q", q, collection, ndim=3)
    t, hq, d = q.shape
    h = collection.num_heads
    if d != collection.latent_dim:
        what = "latent_dim (padded_depth + rope_dim" if collection.rope_dim is not None else "head_size ("
        raise ValueError(f"q head dim ({d}) must equal the cache {what}{collection.latent_dim})")
    if hq == 0 or hq % h:
        raise ValueError(f"q heads ({hq}) must be a positive multiple of the cache's KV heads ({h})")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise ValueError("window (a sliding causal window) needs causal=True")
    d_v = check_logits_and_output(q, collection, scale, softcap, sinks, return_lse, mla_v_dim, out)
    check_step(collection, input_row_offsets, t, data_checks=validate)
    return d_v


def outputs(q: torch.Tensor, v_dim: int, out: Optional[torch.Tensor], return_lse: bool):
    """``(out, lse)``: ``out`` as given (checked) or a new ``[T, Hq, v_dim]`` of q's dtype, and a new float32
    ``lse [T, Hq]`` when asked for."""
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], v_dim), dtype=q.dtype, device=q.device)
    return out, torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None


def check_logits_and_output(q, collection, scale, softcap, sinks, return_lse, mla_v_dim, out) -> int:
    """The arguments attention ops share (``paged_attention``, ``sparse_mla_attention``); returns ``D_v``."""
    t, hq = q.shape[:2]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0 or None: off), got {softcap!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, shape=[hq], device=collection.device)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    d_v = _check_mla_v_dim(mla_v_dim, collection)
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=[t, hq, d_v], device=collection.device)
    return d_v


def _check_mla_v_dim(mla_v_dim, collection) -> int:
    """``D_v``: ``mla_v_dim`` for an MLA cache (required, in ``[1, D]``; rope-aware: ``[1, padded_depth]``, values
    come from the content), the head size otherwise (must be None)."""
    d = collection.padded_depth
    if not collection.is_mla:
        if mla_v_dim is not None:
            raise ValueError("mla_v_dim is only for MLA caches (KVD=1); this cache stores V")
        return d
    if isinstance(mla_v_dim, bool) or not isinstance(mla_v_dim, int) or not 0 < mla_v_dim <= d:
        raise ValueError(f"mla_v_dim must be an int in [1, {d}] for an MLA cache, got {mla_v_dim!r}")
    return mla_v_dim


def plan(collection, q, arch: str, scale: Optional[float] = None, softcap: Optional[float] = None,
         sinks: Optional[torch.Tensor] = None, return_lse: bool = False, mla_v_dim: Optional[int] = None,
         window: Optional[int] = None) -> paths.KernelPath:
    """The kernel serving these arguments on ``arch`` (``PagedAttention`` on SM90, ``PagedAttentionSm100`` on
    SM100, MLA caches: ``mla_decode.plan``) with its compile-time key, or why the reference runs instead: q in
    another dtype than a 16-bit cache, head dims, page sizes or granules the kernel cannot tile (``attention/config.supported``,
    ``attention/sm100_config.supported``), a misaligned cache or float32 scales, a cache past the kernels' int32
    indices (``attention/config.index_limits``), a grid past CUDA's limits (``grid_problem``), a non-positive scale
    without soft-cap."""
    c = collection

    def fallback(reason):
        return paths.reference(OP, reason, arch)

    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    if not softcap and scale is not None and scale <= 0:
        return fallback("a non-positive scale without soft-cap (the kernels track the max of unscaled scores)")
    if q_dtype_name not in DTYPE_NAMES:
        return fallback(f"q is {q_dtype_name}; the kernels take {' or '.join(DTYPE_NAMES)}")
    if kv_dtype_name != FP8 and c.dtype != q.dtype:
        return fallback(f"q is {q_dtype_name} but the cache is {kv_dtype_name}; the kernels need them equal")
    if c.blocks.data_ptr() % 16:
        return fallback("blocks is not 16-byte aligned")
    problem = index_limits(c.num_pages, c.kv_dim, c.num_layers, c.page_size, c.max_cache_length)
    if problem:
        return fallback(problem)
    granularity = c.quantization_granularity if kv_dtype_name == FP8 and c.scales is not None else None
    if granularity is not None and c.scales.data_ptr() % c.scales.element_size():
        return fallback("the float32 scales are not 4-byte aligned")
    if c.is_mla:
        return mla_decode.plan(c, q, arch, mla_v_dim, softcap, sinks, return_lse, window, scale)
    if arch == "sm_100a":
        from cute_kv.ops.paged_attention_sm100 import plan_sm100

        return plan_sm100(c, q, granularity, bool(softcap), sinks is not None, return_lse)
    hq, h, d, p = q.shape[1], c.num_heads, c.head_size, c.page_size
    problem = grid_problem(c.batch_size, h, query_blocks(c, hq, BM, q.shape[0])) or supported(
        hq, h, d, p, kv_dtype_name, granularity)
    if problem:
        return fallback(problem)
    e8m0 = granularity is not None and c.scale_dtype == torch.float8_e8m0fnu
    key = ("paged_attention", q_dtype_name, hq, h, d, p, c.kv_dim, lut_vector(c, key_tile(d)), bool(softcap),
           sinks is not None, return_lse, kv_dtype_name if kv_dtype_name == FP8 else None, granularity, e8m0)
    return paths.kernel(OP, "PagedAttention", key, arch)


def lut_vector(collection, key_tile: int) -> bool:
    """Whether the kernel may read the lookup table's rows in ``lut_chunk`` vectors (width, stride, alignment)."""
    p = collection.page_size
    chunk = lut_chunk(tile_geometry(key_tile, p)[1], key_tile, p)
    lut = collection.lookup_table
    return lut.shape[1] % chunk == 0 and lut.stride(0) % chunk == 0 and lut.data_ptr() % (4 * chunk) == 0


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of each kernel one ``plan`` key launches (the attention kernel, then the split-KV
    combine): what the launcher compiles and ``prebuild`` compiles ahead."""
    if key[0] == mla_decode.KEY:
        return mla_decode.compile_units(key, arch)
    if key[0] == mla_decode_sm100.KEY:
        return mla_decode_sm100.compile_units(key, arch)
    def kernel_class():
        if key[0] == "paged_attention_sm100":
            from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

            return PagedAttentionSm100
        from cute_kv.kernels.attention.sm90 import PagedAttention

        return PagedAttention

    return units.with_combine(key, kernel_class, key[1], key[2], key[4], key[10])


def launch_workspace(key: tuple, q: torch.Tensor, collection, causal: bool, window: Optional[int]) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of a launch of ``plan`` key ``key`` for the step of ``q``: its grid
    (each kernel's ``launch_shape``) and split-KV ``partials`` over its value width. A launcher makes one per call,
    a ``StepPlan`` once for all its layers (persistent partials)."""
    from cute_kv.ops.paged_attention_sm100 import launch_shape_sm100

    c, (t, hq, d), slots = collection, q.shape, sm_count(q.device)
    if key[0] == mla_decode.KEY:
        shape, v_dim = mla_decode.launch_shape(c, hq, slots, causal, window, num_tokens=t), key[4]
    elif key[0] == mla_decode_sm100.KEY:  # no window: the plan sends windowed calls to the reference
        shape, v_dim = mla_decode_sm100.launch_shape(c, hq, slots, causal, num_tokens=t), key[4]
    elif key[0] == "paged_attention_sm100":
        shape, v_dim = launch_shape_sm100(c, hq, slots, causal, window, num_tokens=t), d
    else:
        shape, v_dim = launch_shape(c, hq, slots, BM, key_tile(d), causal, window, num_tokens=t), d
    return (*shape, *partials(shape[1], t, hq, v_dim, q.device))


@functools.lru_cache(maxsize=None)
def _launcher(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once: what stays per call is sizing the grid and launching."""
    if key[0] == "paged_attention_sm100":
        from cute_kv.ops.paged_attention_sm100 import launcher_sm100

        return launcher_sm100(key, arch)
    if key[0] == mla_decode.KEY:
        return mla_decode.launcher(key, arch)
    if key[0] == mla_decode_sm100.KEY:
        return mla_decode_sm100.launcher(key, arch)
    from cute_kv.kernels.compile_cache import compiled

    d, softcap_on, granularity, e8m0 = key[4], key[8], key[12], key[13]
    attention_unit, combine_unit = compile_units(key, arch)

    def run(q, input_row_offsets, collection, layer_idx, *, causal=True, window=None, scale=None, softcap=None,
            sinks=None, mla_v_dim=None, out=None, lse=None, return_lse=False, workspace=None):
        if q.shape[0] == 0:  # a grid of zero CTAs is a launch error
            return (out, lse) if return_lse else out
        c = collection
        m_blocks, splits, o_part, lse_part = workspace or launch_workspace(key, q, c, causal, window)
        dst = out if heads_packed(out, VEC) else torch.empty_like(out, memory_format=torch.contiguous_format)
        score_scale, softmax_scale_log2 = softmax_args(d, scale, softcap if softcap_on else None)
        sinks = None if sinks is None else sinks.contiguous()
        compiled(*attention_unit, arch)(packed_heads(q, VEC), dst, lse, o_part, lse_part, sinks, c.blocks, c.blocks,
                                        input_row_offsets.contiguous(), c.cache_lengths.contiguous(), c.lookup_table,
                                        scales_arg(c.scales, granularity, e8m0), layer_idx, m_blocks, splits,
                                        int(causal), window_arg(window), score_scale, softmax_scale_log2)
        if splits > 1:
            compiled(*combine_unit, arch)(dst, lse, o_part, lse_part, splits)
        if dst is not out:
            out.copy_(dst)
        return (out, lse) if return_lse else out

    return run


def softmax_args(head_dim: int, scale: Optional[float], softcap: Optional[float]) -> tuple[float, float]:
    """The SM90 kernels' ``(score_scale, softmax_scale_log2)``: ``q.k`` is scaled inside the base-2 exponent, or,
    soft-capped, by ``scale / softcap`` inside the tanh with ``softcap`` moved into the exponent's scale."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return (scale / softcap, softcap * LOG2E) if softcap else (1.0, scale * LOG2E)


def partials(splits: int, t: int, num_q_heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV partials ``O/l [splits, T, Hq, D]`` and base-2 ``lse [splits, T, Hq]`` (float32); one split writes
    the output itself, but the kernel's signature still takes them."""
    if splits == 1:
        return unused_partials(device, num_q_heads, head_dim)
    return (torch.empty((splits, t, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((splits, t, num_q_heads), dtype=torch.float32, device=device))


def scales_arg(scales: Optional[torch.Tensor], granularity: Optional[int], e8m0: bool) -> Optional[torch.Tensor]:
    """What the kernel takes for the scales: none unless it dequantizes with them; e8m0 as its uint8 bits."""
    if granularity is None:
        return None
    return scales.view(torch.uint8) if e8m0 else scales


def longest_run(collection, num_tokens: int) -> int:
    """The longest new-token run a launch is sized for: ``max_seq_length`` bounds it, but a collection may set that
    loosely (up to 2**32 - 1), so the step's ``num_tokens`` (``T``) bounds it too."""
    return min(collection.max_seq_length, num_tokens)


def query_blocks(collection, num_q_heads: int, bm: int, num_tokens: int) -> int:
    """Query blocks of ``bm`` packed rows per (request, KV head): the ``longest_run``'s rows of a GQA group."""
    return -(-longest_run(collection, num_tokens) * (num_q_heads // collection.num_heads) // bm)


def grid_problem(num_requests: int, num_kv_heads: int, m_blocks: int) -> Optional[str]:
    """Why an attention grid of ``m_blocks`` query blocks, ``num_kv_heads`` x splits and ``num_requests`` would
    pass CUDA's limits, or None (``launch_shape`` keeps the splits within ``MAX_GRID_Y``)."""
    if num_requests > MAX_GRID_Z:
        return f"{num_requests} requests exceed the kernels' grid (one z index per request, at most {MAX_GRID_Z})"
    if num_kv_heads > MAX_GRID_Y:
        return f"{num_kv_heads} KV heads exceed the kernels' grid (y indices per KV head, at most {MAX_GRID_Y})"
    if m_blocks > MAX_GRID_X:
        return f"{m_blocks} query blocks per request exceed the kernels' grid (at most {MAX_GRID_X} x indices)"
    return None


def launch_shape(collection, num_q_heads: int, slots: int, bm: int, bn: int, causal: bool = True,
                 window: Optional[int] = None, *, num_tokens: int) -> tuple[int, int]:
    """``(m_blocks, splits)``: ``query_blocks`` of ``bm`` packed rows per (request, KV head) for the step's
    ``num_tokens`` (``T``), and key splits of ``bn``-key tiles for ``slots`` resident CTAs (``num_splits``), at
    most ``MAX_GRID_Y`` per KV head and split together. A causal step of several query blocks does not split: its
    blocks see different numbers of tiles, so a split count fit for the longest leaves the shortest with empty
    splits. A sliding window bounds the keys a block sees (the window and its tokens) whatever the context, so the
    splits are fit to those tiles. The CTAs the wave model counts are the (query block, KV head) pairs that hold
    rows: at most ``T * group // bm`` blocks plus one per request with tokens, so requests with no new token and
    the short requests' empty blocks (which exit at once) are not counted."""
    c = collection
    group = num_q_heads // c.num_heads
    m_blocks = query_blocks(c, num_q_heads, bm, num_tokens)
    if causal and m_blocks > 1:
        return m_blocks, 1
    key_tiles = -(-c.max_cache_length // bn)
    if window is not None:  # window + tokens - 1 keys, one tile more where they start inside one
        key_tiles = min(key_tiles, -(-(window + longest_run(c, num_tokens) - 1) // bn) + 1)
    # sum_b ceil(n_b g / bm) <= T g / bm + (requests with n_b > 0)
    blocks = min(c.batch_size * m_blocks, num_tokens * group // bm + min(c.batch_size, num_tokens))
    return m_blocks, num_splits(max(blocks, 1) * c.num_heads, key_tiles, slots,
                                min(MAX_SPLITS, MAX_GRID_Y // c.num_heads))


def num_splits(ctas: int, key_tiles: int, slots: int, limit: int = MAX_SPLITS) -> int:
    """Key splits per (query block, KV head, request) by wave quantization: splitting ``key_tiles`` ``s`` ways makes
    ``ctas * s`` CTAs of ``ceil(key_tiles / s)`` tiles each, which run in ``ceil(ctas * s / slots)`` waves; the
    estimated time is waves x (tiles per CTA + ``SPLIT_COST`` for a CTA's prologue, epilogue and its share of the
    combine). The fastest ``s`` up to ``limit`` wins (the smallest on a tie); every split keeps at least two tiles
    and no split is empty (``(s - 1) * ceil(key_tiles / s) < key_tiles``)."""
    best, best_cost = 1, None
    for s in range(1, min(limit, key_tiles // 2) + 1):
        per = -(-key_tiles // s)
        if (s - 1) * per >= key_tiles:
            continue
        cost = -(-ctas * s // slots) * (per + SPLIT_COST)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def window_arg(window: Optional[int]) -> int:
    """The kernel's int32 ``window``: 0 for none; a wider window than int32 holds masks nothing more than 2^31-1."""
    return 0 if window is None else min(window, 2**31 - 1)


@functools.lru_cache(maxsize=None)
def unused_partials(device: torch.device, num_q_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Placeholder partials for single-split launches (never written), allocated once per device and shape."""
    return (torch.empty((1, 1, num_q_heads, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, 1, num_q_heads), dtype=torch.float32, device=device))


@functools.lru_cache(maxsize=None)
def unused_lse(device: torch.device, num_q_heads: int, head_dim: int) -> torch.Tensor:
    """The SM100 kernels' placeholder ``lse [T, Hq]`` argument (never written): ``unused_partials``' one, made once
    rather than indexed per call."""
    return unused_partials(device, num_q_heads, head_dim)[1][0]


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (of the GPU a ``paths.dry_run`` stands in)."""
    target = paths.dry_target()
    return _device_sm_count(device) if target is None else target.sm_count


@functools.lru_cache(maxsize=None)
def _device_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
