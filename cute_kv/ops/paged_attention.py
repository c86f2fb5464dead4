"""``cute_kv.paged_attention``: causal / sliding-window attention of a ragged step over a paged KV cache.

The op checks its arguments and what every attention kernel shares, then looks its backend up in the table
``BACKENDS`` (by the cache kind and the arch: ``FAMILIES``) and hands it the call: plan, launch workspace, launcher."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from cute_kv import reference, tensor_scales
from cute_kv.dtypes import dtype_name
from cute_kv.kernels.archs import BLACKWELL, SM90
from cute_kv.kernels.attention.config import DTYPE_NAMES, FP8, index_limits, layout_problem
from cute_kv.ops import lse_layouts, mla_decode, mla_decode_sm100, paged_attention_sm90, paged_attention_sm100, paths
from cute_kv.ops.attention_backends import OP, Backend, Family
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

# The kernel family of a cache kind (MLA or not) on an arch, and each family's backend.
FAMILIES = {**{(False, a): Family.SM100_MHA for a in BLACKWELL}, **{(True, a): Family.SM100_MLA for a in BLACKWELL},
            (False, SM90): Family.SM90_MHA, (True, SM90): Family.SM90_MLA}
BACKENDS = {b.family: b for b in (paged_attention_sm90.BACKEND, paged_attention_sm100.BACKEND, mla_decode.BACKEND,
                                  mla_decode_sm100.BACKEND)}


def paged_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int, *,
                    causal: bool = True, window: Optional[int] = None, softcap: Optional[float] = None,
                    sinks: Optional[torch.Tensor] = None, return_lse: bool = False, scale: Optional[float] = None,
                    mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None, lse_layout: str = "TH",
                    lse: Optional[torch.Tensor] = None, k_scale=None, v_scale=None, validate: bool = True, plan=None):
    """Attention of ``q [T, Hq, D]`` over layer ``layer_idx``; returns ``[T, Hq, D_v]`` in ``q.dtype`` (or ``out``),
    or ``(out, lse)`` with ``return_lse``.

    Query ``i`` of request ``b`` is at position ``p = cache_lengths[b] + i`` and sees keys ``j`` in
    ``[0, cache_lengths[b] + seq_len_b)`` read through the lookup table, so this step's K/V must already be
    stored; ``causal`` keeps ``j <= p`` and ``window`` (needs ``causal``) also ``j > p - window``. GQA: query
    head ``hq`` reads KV head ``hq // (Hq // H)``. ``scale`` defaults to ``1/sqrt(D)``. ``q`` is in the cache
    dtype (bf16/fp16/fp32 for fp8 caches, which are dequantized with their scales). An MLA cache needs
    ``mla_v_dim``: values are the first ``mla_v_dim`` dims of the latent K rows (``D_v = mla_v_dim``). A rope-aware
    FP8 MLA cache (``rope_dim`` set) takes ``q [T, Hq, latent_dim]`` and is read as its dequantized logical rows.
    ``k_scale`` / ``v_scale``: per-tensor scales of an fp8 MHA cache without ``scales`` (vLLM's and FlashInfer's;
    floats or float32 one-element tensors, ``cute_kv/tensor_scales.py``): K is read as ``k * k_scale``, V as
    ``v * v_scale``, in any layout the kernels take.

    Logits are ``s = scale * q.k``; ``softcap = c > 0`` (Gemma 2) makes them ``c * tanh(s / c)`` before masking
    (None or 0: off). ``sinks`` (gpt-oss), float32 ``[Hq]``: a logit per query head that joins the softmax
    denominator only, ``out = sum_j e^(s_j - m) v_j / (e^(sink - m) + sum_j e^(s_j - m))``. ``return_lse`` also
    returns ``lse`` float32 ``[T, Hq]``, the NATURAL log of that denominator plus ``m`` (the sink included), -inf
    for a row that sees no key and no sink: attention computed over disjoint parts of the keys (several caches,
    chunks of context) merges exactly as ``o = sum_i e^(lse_i - lse) o_i`` with ``lse = logsumexp_i lse_i``.
    ``lse_layout="HT"`` returns it as ``[Hq, T]`` (contiguous), the layout of FA4's and vLLM's ``merge_attn_states``;
    ``lse`` (with ``return_lse``) is a float32 buffer of that shape to write it into, in place of a new one.

    An MHA/GQA cache (bf16/fp16 with head_dim 64/80/96/128/192/256, or fp8 e4m3 read by bf16/fp16 q with head_dim
    64/128/256) runs ``PagedAttention`` on SM90 and ``PagedAttentionSm100`` on SM100 (split-KV when the grid would
    not fill the GPU); other cases (a non-positive ``scale`` without soft-cap included), and CPU tensors, run the
    reference: on CUDA with a ``FallbackWarning`` (``cute_kv.explain`` says why). ``validate=False`` (for CUDA-graph
    capture) skips the checks that read device values, as a torch.compile trace does (``store_kv``). ``plan``
    (``cute_kv.plan_step``) has checked the step and keeps the path, launch shape and split-KV partials chosen by the
    first call of the same signature: the call reads no device value and allocates only its outputs (``store_kv``).
    """
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        scaled = k_scale is not None or v_scale is not None
        d_v, run = plan.entry(call_key(OP, (q, sinks, out, lse), (causal, window, scale, softcap, return_lse,
                                                                 mla_v_dim, lse_layout, scaled)),
                              lambda: _planned(q, input_row_offsets, collection, layer_idx, causal, window, scale,
                                               softcap, sinks, return_lse, mla_v_dim, out, lse_layout, lse, k_scale,
                                               v_scale, plan))
        out, lse, rows = outputs(q, d_v, out, return_lse, lse, lse_layout)
        run(q, plan.offsets_bits, collection, layer_idx, causal=causal, window=window, scale=scale,
            softcap=softcap or None, sinks=sinks, mla_v_dim=mla_v_dim, out=out, lse=rows, return_lse=return_lse,
            **_scale_kwargs(k_scale, v_scale))
        return (out, lse_layouts.written(lse, rows, lse_layout)) if return_lse else out
    d_v = _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
                 mla_v_dim, out, validate, lse_layout, lse, k_scale, v_scale)
    input_row_offsets = uint32_bits(input_row_offsets)  # int32 offsets: the same bits
    out, lse, rows = outputs(q, d_v, out, return_lse, lse, lse_layout)
    softcap = softcap or None  # 0 means off
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        k_scale, v_scale = (None if s is None else tensor_scales.as_tensor(s, c.device) for s in (k_scale, v_scale))
        torch.ops.cute_kv.paged_attention(q, input_row_offsets, c.traced_blocks(OP), c.cache_lengths, c.lookup_table,
                                          c.scales, layer_idx, c.max_seq_length, c.max_cache_length,
                                          c.quantization_granularity, causal, window, scale, softcap, sinks,
                                          mla_v_dim, out, rows, c.rope_dim, k_scale, v_scale)
    else:  # eager: skip the op's dispatcher (host time)
        dispatch(q, input_row_offsets, c, layer_idx, causal, window, scale, softcap, sinks, mla_v_dim, out, rows,
                 k_scale, v_scale)
    return (out, lse_layouts.written(lse, rows, lse_layout)) if return_lse else out


def _scale_kwargs(k_scale, v_scale) -> dict:
    """Per-tensor scales as a runner's keywords: none when not given (the MLA launchers take none)."""
    return {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}


def dispatch(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, mla_v_dim, out,
             lse, k_scale=None, v_scale=None) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides), writing ``out`` (and
    ``lse`` if given)."""
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, arch, scale, softcap, sinks,
                                                                lse is not None, mla_v_dim, window,
                                                                k_scale is not None))
    run = reference.paged_attention if path is None else backend(collection, path.arch).launcher(path.key, path.arch)
    run(q, input_row_offsets, collection, layer_idx, causal=causal, window=window, scale=scale, softcap=softcap,
        sinks=sinks, mla_v_dim=mla_v_dim, out=out, lse=lse, return_lse=lse is not None,
        **_scale_kwargs(k_scale, v_scale))


def _planned(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
             mla_v_dim, out, lse_layout, lse, k_scale, v_scale, step) -> tuple[int, Callable]:
    """The first call of a plan with this signature: checked (the step's values by the plan), routed, and its launch
    sized once, split-KV partials included; ``(D_v, run)``."""
    d_v = _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse,
                 mla_v_dim, out, False, lse_layout, lse, k_scale, v_scale)
    step.check(OP, collection, input_row_offsets, *q.shape[:2])  # the shapes are the entry's key: once
    softcap = softcap or None
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, arch, scale, softcap, sinks,
                                                                return_lse, mla_v_dim, window, k_scale is not None))
    if path is None:
        return d_v, reference.paged_attention
    chosen = backend(collection, path.arch)
    return d_v, functools.partial(chosen.launcher(path.key, path.arch),
                                  workspace=chosen.launch_workspace(path.key, q, collection, causal, window))


def explain(q, input_row_offsets, collection, layer_idx: int, *, causal: bool = True, window: Optional[int] = None,
            softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
            scale: Optional[float] = None, mla_v_dim: Optional[int] = None, out: Optional[torch.Tensor] = None,
            lse_layout: str = "TH", lse: Optional[torch.Tensor] = None, k_scale=None, v_scale=None,
            validate: bool = True, arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(paged_attention, ...)``: the path this call takes on ``arch`` (default: q's device)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse, mla_v_dim,
           out, validate, lse_layout, lse, k_scale, v_scale)
    return paths.planned(OP, collection.device, arch,
                         lambda arch: plan(collection, q, arch, scale, softcap or None, sinks, return_lse,
                                           mla_v_dim, window, k_scale is not None))


def _check(q, input_row_offsets, collection, layer_idx, causal, window, scale, softcap, sinks, return_lse, mla_v_dim,
           out, validate, lse_layout="TH", lse=None, k_scale=None, v_scale=None) -> int:
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
    d_v = check_logits_and_output(q, collection, scale, softcap, sinks, return_lse, mla_v_dim, out, lse_layout, lse)
    tensor_scales.check(k_scale, v_scale, collection, data_checks=validate)
    check_step(collection, input_row_offsets, t, data_checks=validate)
    return d_v


def outputs(q: torch.Tensor, v_dim: int, out: Optional[torch.Tensor], return_lse: bool,
            lse: Optional[torch.Tensor] = None, lse_layout: str = "TH"):
    """``(out, lse, rows)``: ``out`` as given (checked) or a new ``[T, Hq, v_dim]`` of q's dtype; when asked for, the
    float32 ``lse`` the call returns (as given, or new in ``lse_layout``) and ``rows``, the row-major ``[T, Hq]``
    the kernels and the reference write (``lse_layouts.rows``)."""
    if out is None:
        out = torch.empty((q.shape[0], q.shape[1], v_dim), dtype=q.dtype, device=q.device)
    if not return_lse:
        return out, None, None
    if lse is None:
        lse = lse_layouts.new(*q.shape[:2], lse_layout, q.device)
    return out, lse, lse_layouts.rows(lse, lse_layout)


def check_logits_and_output(q, collection, scale, softcap, sinks, return_lse, mla_v_dim, out, lse_layout="TH",
                            lse=None) -> int:
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
    lse_layouts.check(lse, lse_layout, return_lse, t, hq, collection.device)
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
         window: Optional[int] = None, tensor_scaled: bool = False) -> paths.KernelPath:
    """The kernel serving these arguments on ``arch`` (``PagedAttention`` on SM90, ``PagedAttentionSm100`` on
    SM100, MLA caches: ``MLADecode``, ``MlaDecodeSm100``; each backend's ``plan``) with its compile-time key, or why
    the reference runs instead: q in another dtype than a 16-bit cache, head dims, page sizes or granules the kernel
    cannot tile (``attention/config.supported``, ``attention/sm100_config.supported``), a misaligned cache or float32
    scales, a cache past the kernels' int32 indices (``attention/config.index_limits``), a grid past CUDA's limits
    (``splits.grid_problem``), a non-positive scale without soft-cap, an fp8 cache with granule scales in a strided
    layout (``attention/config.layout_problem``), an MLA cache in a strided layout. Other strided caches (vLLM's,
    FlashInfer's NHD / HND, separate K and V) take the MHA kernels' strided variants, which read the K and V planes
    in place; ``tensor_scaled`` (``k_scale`` / ``v_scale`` given) selects the variants that dequantize per tensor,
    compact or strided."""
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
    if c.is_compact and c.blocks.data_ptr() % 16:
        return fallback("blocks is not 16-byte aligned")
    if not c.is_compact and (c.key_blocks.data_ptr() % 16 or c.value_blocks.data_ptr() % 16):
        return fallback("the K or V plane is not 16-byte aligned")
    problem = index_limits(c.num_pages, c.row_pitch, c.page_size, c.max_cache_length)
    if problem:
        return fallback(problem)
    granularity = c.quantization_granularity if kv_dtype_name == FP8 and c.scales is not None else None
    if not c.is_mla:  # the MLA backends say why they read only compact caches
        problem = layout_problem(c.layout_name, c.page_size, granularity)
        if problem:
            return fallback(problem)
    if granularity is not None and c.scales.data_ptr() % c.scales.element_size():
        return fallback("the float32 scales are not 4-byte aligned")
    family = FAMILIES.get((c.is_mla, arch))
    if family is None:  # plan asked directly for an arch without kernels (route and explain refuse it)
        return fallback(f"{'MLA cache: ' if c.is_mla else ''}no attention kernel for {arch} yet")
    return BACKENDS[family].plan(c, q, arch, granularity=granularity, scale=scale, softcap=softcap, sinks=sinks,
                                 return_lse=return_lse, mla_v_dim=mla_v_dim, window=window,
                                 tensor_scaled=tensor_scaled)


def backend(collection, arch: str) -> Backend:
    """The backend serving ``collection`` (MHA/GQA or MLA) on ``arch``: its plan, compile units, launch workspace
    and launcher."""
    return BACKENDS[FAMILIES[collection.is_mla, arch]]
