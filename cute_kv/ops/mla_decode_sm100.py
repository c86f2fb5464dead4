"""MLA attention on SM100 (Blackwell): which calls ``MlaDecodeSm100`` serves, its keys and launchers (two backends).

Dense (``paged_attention`` over an MLA cache on ``sm_100a``): ``plan`` / ``launcher``, ``BACKEND``. Sparse
(``sparse_mla_attention``, DeepSeek-V3.2 top-k): ``plan_sparse`` / ``launch_sparse``, ``SPARSE``.
Both launch the kernel on ``2 * splits`` CTAs per row block (clusters of two, one per value half,
``kernels/mla/sm100_config``) and
merge split partials with the attention combine (512-wide rows). Caches: 16-bit of q's dtype, or MAX's rope-aware
FP8 rows (``rope_dim`` set: the kernel dequantizes them with their per-token scales, in 16-key tiles).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.mla.sm100_config import BM, BN, FP8_BN, V_SPLIT, supported
from cute_kv.ops import paths, splits, units
from cute_kv.ops.attention_backends import OP, Backend, Family
from cute_kv.ops.kernel_args import LAYOUT_PROBLEM, score_args

KEY = "mla_decode_sm100"
KERNEL = "MlaDecodeSm100"
SPARSE_OP = "sparse_mla_attention"
VEC = 8


def _problem(collection, q, scale, softcap, mla_v_dim) -> Optional[str]:
    """What both modes share: why the kernel cannot take these arguments, or None."""
    from cute_kv.kernels.attention.config import index_limits

    c = collection
    if not c.is_mla:
        return "the MLA kernel reads MLA caches (KVD=1)"
    if not softcap and scale is not None and scale <= 0:
        return "a non-positive scale without soft-cap (the kernel tracks the max of unscaled scores)"
    problem = supported(dtype_name(q.dtype), dtype_name(c.dtype), q.shape[-1], mla_v_dim, c.page_size,
                        getattr(c, "rope_dim", None))
    if problem:
        return problem
    if c.num_heads != 1:
        return f"an MLA cache has one latent head, got {c.num_heads}"
    if not c.is_compact:
        return LAYOUT_PROBLEM
    if c.blocks.data_ptr() % 16:
        return "blocks is not 16-byte aligned"
    if c.rope_dim is not None and c.scales.data_ptr() % 4:
        return "scales is not 4-byte aligned"
    return index_limits(c.num_pages, c.row_pitch, c.page_size, c.max_cache_length)


def plan(collection, q, arch: str, *, scale: Optional[float], softcap: Optional[float],
         sinks: Optional[torch.Tensor], return_lse: bool, mla_v_dim: Optional[int], window: Optional[int],
         **_) -> paths.KernelPath:
    """Dense MLA decode/prefill on ``sm_100a``: ``MlaDecodeSm100``'s key, or why the reference runs instead."""
    c = collection
    problem = _problem(c, q, scale, softcap, mla_v_dim)
    if problem is None and window is not None:
        problem = "the MLA kernel has no sliding window"
    if problem is None:
        problem = splits.grid_problem(c.batch_size, c.num_heads, splits.query_blocks(c, q.shape[1], BM, q.shape[0]))
    if problem:
        return paths.reference(OP, problem, arch)
    key = (KEY, dtype_name(q.dtype), q.shape[1], q.shape[2], mla_v_dim, collection.page_size, False, bool(softcap),
           sinks is not None, return_lse, False, collection.rope_dim)
    return paths.kernel(OP, KERNEL, key, arch)


def plan_sparse(collection, q, indices: torch.Tensor, arch: str, *, mla_v_dim: int, scale: Optional[float] = None,
                topk_lengths: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None, return_lse: bool = False) -> paths.KernelPath:
    """Sparse MLA decode on ``sm_100a`` (arguments checked by the op): ``MlaDecodeSm100``'s key, or why not."""
    problem = _problem(collection, q, scale, softcap, mla_v_dim)
    if problem is None and q.shape[0] > splits.MAX_GRID_Z:
        problem = (f"{q.shape[0]} query tokens exceed the kernel's grid (one z index per token, at most "
                   f"{splits.MAX_GRID_Z})")
    if problem is None and indices.dtype != torch.int32:
        problem = f"indices must be int32, got {indices.dtype}"
    if problem:
        return paths.reference(SPARSE_OP, problem, arch)
    key = (KEY, dtype_name(q.dtype), q.shape[1], q.shape[2], mla_v_dim, collection.page_size, True, bool(softcap),
           sinks is not None, return_lse, topk_lengths is not None, collection.rope_dim)
    return paths.kernel(SPARSE_OP, KERNEL, key, arch)


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of the MLA kernel and the split-KV combine of its 512-wide rows."""
    def kernel_class():
        from cute_kv.kernels.mla.sm100 import MlaDecodeSm100

        return MlaDecodeSm100

    return units.with_combine(key, kernel_class, key[1], key[2], key[4], key[9])


def key_tile(rope_dim: Optional[int]) -> int:
    """Keys per tile: 32, or 16 for a rope-aware FP8 cache (``sm100_config``)."""
    return BN if rope_dim is None else FP8_BN


def launch_shape(collection, num_q_heads: int, slots: int, causal: bool = True, *,
                 num_tokens: int) -> tuple[int, int]:
    """Dense ``(m_blocks, splits)``: ``splits.launch_shape`` for 128-row blocks, the cache's key tiles and
    the step's ``num_tokens``, each block taking two CTAs (the value halves), so half the ``slots`` per block."""
    return splits.launch_shape(collection, num_q_heads, max(slots // V_SPLIT, 1), BM, key_tile(collection.rope_dim),
                               causal, None, num_tokens=num_tokens)


def launch_workspace(key: tuple, q: torch.Tensor, collection, causal: bool, window: Optional[int]) -> tuple:
    """Dense ``(m_blocks, splits, o_part, lse_part)`` of a launch of ``key`` for the step of ``q``: its grid
    (``launch_shape``; no window: the plan sends windowed calls to the reference) and split-KV partials over the
    value width (``paged_attention_sm90.launch_workspace``)."""
    t, hq = q.shape[:2]
    shape = launch_shape(collection, hq, splits.sm_count(q.device), causal, num_tokens=t)
    return (*shape, *splits.partials(shape[1], t, hq, key[4], q.device))


def launch_shape_sparse(num_tokens: int, num_q_heads: int, topk: int, slots: int,
                        rope_dim: Optional[int] = None) -> tuple[int, int]:
    """Sparse ``(m_blocks, splits)``: a token's heads in ``ceil(Hq / 128)`` blocks, its ``topk`` entries split so
    the ``2 * T * m_blocks * splits`` CTAs fill the GPU (``splits.num_splits``)."""
    m_blocks = -(-num_q_heads // BM)
    return m_blocks, splits.num_splits(num_tokens * m_blocks, -(-topk // key_tile(rope_dim)), max(slots // V_SPLIT, 1))


def _run(unit, combine_unit, arch, q, out, lse, num_splits, o_part, lse_part, launch_args, return_lse) -> None:
    """Launch the kernel (``launch_args`` after ``q, out, o_part, lse_part, lse``: ``blocks, scales, ...``) and,
    with splits, the combine."""
    hq, d_v = q.shape[1], out.shape[-1]
    lse_arg = lse if return_lse and num_splits == 1 else splits.unused_lse(q.device, hq, d_v)
    # With splits the combine merges the splits' base-2 lse into the natural-log lse as well.
    splits.launch_and_combine((unit, combine_unit), arch, q, out, VEC, (o_part, lse_part, lse_arg), launch_args,
                              num_splits, o_part, lse_part, lse if return_lse else None)


@functools.lru_cache(maxsize=None)
def launcher(key: tuple, arch: str) -> Callable:
    """Dense ``run(...)`` with ``paged_attention``'s launcher signature, for one compile-time key, built once."""
    _, _, hq, d, _, _, _, has_softcap, has_sinks, _, _, rope_dim = key
    unit, combine_unit = compile_units(key, arch)

    def launch(q, input_row_offsets, c, layer_idx, workspace, causal, window, scale, softcap, sinks, out, lse,
               return_lse):
        m_blocks, num_splits, o_part, lse_part = workspace
        score_scale, cap_log2 = score_args(d, scale, softcap if has_softcap else None)
        _run(unit, combine_unit, arch, q, out, lse, num_splits, o_part, lse_part, (
            c.blocks, c.scales if rope_dim else None, input_row_offsets.contiguous(), c.cache_lengths.contiguous(),
            c.lookup_table, None, None, sinks.contiguous() if has_sinks else None, layer_idx, m_blocks, num_splits,
            c.batch_size, int(causal), score_scale, cap_log2), return_lse)

    return splits.dense_run(key, launch_workspace, launch)


@functools.lru_cache(maxsize=None)
def launch_sparse(key: tuple, arch: str) -> Callable:
    """Sparse ``run(q, collection, layer_idx, indices, *, topk_lengths, scale, softcap, sinks, out, lse)`` for one
    compile-time key (``plan_sparse``), built once; the op has checked the arguments and allocated ``out``
    ``[T, Hq, mla_v_dim]`` (and ``lse [T, Hq]`` float32 with ``return_lse``)."""
    _, _, hq, d, v_dim, _, _, has_softcap, has_sinks, return_lse, has_lengths, rope_dim = key
    unit, combine_unit = compile_units(key, arch)

    def run(q, collection, layer_idx, indices, *, topk_lengths=None, scale=None, softcap=None, sinks=None,
            out=None, lse=None, workspace=None):
        _check_sparse(q, indices, topk_lengths, has_lengths, out)
        t = q.shape[0]
        if t == 0:
            return out
        m_blocks, num_splits, o_part, lse_part = workspace or sparse_workspace(key, q, indices)
        score_scale, cap_log2 = score_args(d, scale, softcap if has_softcap else None)
        indices = indices if indices.stride(-1) == 1 else indices.contiguous()
        _run(unit, combine_unit, arch, q, out, lse, num_splits, o_part, lse_part, (
            collection.blocks, collection.scales if rope_dim else None, None, None, None, indices,
            topk_lengths.contiguous() if has_lengths else None, sinks.contiguous() if has_sinks else None, layer_idx,
            m_blocks, num_splits, t, 0, score_scale, cap_log2), return_lse)
        return out

    return run


def sparse_workspace(key: tuple, q: torch.Tensor, indices: torch.Tensor) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of a sparse launch of ``plan_sparse`` key ``key``: its grid
    (``launch_shape_sparse``) and split-KV partials over its value width. A launch makes one per call, a
    ``StepPlan`` once for all its layers (``launch_workspace``)."""
    t, hq = q.shape[:2]
    m_blocks, num_splits = launch_shape_sparse(t, hq, indices.shape[1], splits.sm_count(q.device), key[11])
    return m_blocks, num_splits, *splits.partials(num_splits, t, hq, key[4], q.device)


def _check_sparse(q, indices, topk_lengths, has_lengths: bool, out) -> None:
    """What the kernel reads by the query token's index (``indices[t]``, ``topk_lengths[t]``) must exist for every
    token: a clear error before any launch (the op checks values; these are shapes)."""
    t = q.shape[0]
    if indices.dtype != torch.int32 or indices.dim() != 2 or indices.shape[0] != t or indices.device != q.device:
        raise ValueError(f"indices must be int32 [T={t}, topk] on {q.device}, got {indices.dtype} "
                         f"{list(indices.shape)} on {indices.device}")
    if (topk_lengths is not None) != has_lengths:
        raise ValueError("topk_lengths must be given exactly when the plan was made with it (plan_sparse again)")
    if topk_lengths is not None and (topk_lengths.dtype != torch.int32 or list(topk_lengths.shape) != [t]
                                     or topk_lengths.device != q.device):
        raise ValueError(f"topk_lengths must be int32 [T={t}] on {q.device}, got {topk_lengths.dtype} "
                         f"{list(topk_lengths.shape)} on {topk_lengths.device}")
    if out is None or out.shape[:2] != q.shape[:2] or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} [T, Hq, mla_v_dim] on {q.device} (the op allocates it)")


BACKEND = Backend(Family.SM100_MLA, KERNEL, plan, compile_units, launcher, launch_workspace)
SPARSE = Backend(Family.SPARSE_MLA, KERNEL, plan_sparse, compile_units, launch_sparse, sparse_workspace)
