"""``paged_attention`` over an MLA cache (one latent KV head): which calls ``MLADecode`` serves on SM90, its
compile-time key, compile units, launch workspace and launcher (the SM90 MLA backend).

``paged_attention.plan`` checks what every attention kernel shares (dtypes, alignment, int32 limits) and hands
``sm_90a`` calls over MLA caches here, rope-aware FP8 caches (``[padded_depth e4m3 | rope_dim bf16]`` rows, one
float32 scale per token) among them: their q is ``latent_dim = padded_depth + rope_dim`` wide and the kernel
dequantizes each key tile. The grid is (64-row blocks of packed (token, head) rows, key splits, requests); a split-KV
launch merges its float32 partials with ``AttentionCombine`` over the ``v_dim`` value columns.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.mla.config import BM, BN, VEC, supported
from cute_kv.ops import paths, splits, units
from cute_kv.ops.attention_backends import OP, Backend, Family
from cute_kv.ops.kernel_args import LAYOUT_PROBLEM, softmax_args, window_arg
from cute_kv.row_indices import lut_vector

KEY = "mla_decode"
KERNEL = "MLADecode"


def plan(collection, q, arch: str, *, mla_v_dim: Optional[int], softcap: Optional[float],
         sinks: Optional[torch.Tensor], return_lse: bool, **_) -> paths.KernelPath:
    """``MLADecode``'s key for these arguments, or why the reference runs instead: fp8 caches other than rope-aware
    ones, q in another dtype than a 16-bit cache (bfloat16 for a rope-aware one), latent and value widths or page
    sizes the kernel cannot tile (``mla/config.supported``), a grid past CUDA's limits (``splits.grid_problem``)."""
    c = collection

    def fallback(reason):
        return paths.reference(OP, f"MLA cache: {reason}", arch)

    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    rope_dim = c.rope_dim or 0
    if not rope_dim and c.dtype != q.dtype:
        return fallback(f"q is {q_dtype_name} but the cache is {kv_dtype_name}; the kernel reads 16-bit caches "
                        "of q's dtype (fp8 MLA caches take the reference for now)")
    if c.num_heads != 1:
        return fallback(f"{c.num_heads} KV heads; the kernel reads one latent head")
    if not c.is_compact:
        return fallback(LAYOUT_PROBLEM)
    if mla_v_dim is None:
        return fallback("no mla_v_dim")
    hq, d, p = q.shape[1], c.latent_dim, c.page_size
    problem = supported(hq, d, mla_v_dim, p, q_dtype_name, rope_dim) or splits.grid_problem(
        c.batch_size, c.num_heads, splits.query_blocks(c, hq, BM, q.shape[0]))
    if problem:
        return fallback(problem)
    # the last field, pv_overlap, stays off: the stages refill sooner (kernels/mla/sm90.py); a bench sets it on
    key = (KEY, q_dtype_name, hq, d, mla_v_dim, p, lut_vector(c, BN), bool(softcap), sinks is not None, return_lse,
           rope_dim, False)
    return paths.kernel(OP, KERNEL, key, arch)


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of the MLA kernel of ``key`` and its split-KV combine (over ``v_dim`` columns)."""
    def kernel_class():
        from cute_kv.kernels.mla.sm90 import MLADecode

        return MLADecode

    return units.with_combine(key, kernel_class, key[1], key[2], key[4], key[9])


def launch_shape(collection, num_q_heads: int, slots: int, causal: bool = True, window: Optional[int] = None, *,
                 num_tokens: int) -> tuple[int, int]:
    """``(m_blocks, splits)``: ``splits.launch_shape`` for 64 packed rows a CTA over one KV head and the
    step's ``num_tokens``. A decode step's several blocks (more than 64 heads) are one token's heads, which all see
    the same keys: they split like one block (the causal rule against splitting several blocks is for blocks of
    different tokens)."""
    return splits.launch_shape(collection, num_q_heads, slots, BM, BN,
                               causal and splits.longest_run(collection, num_tokens) > 1, window,
                               num_tokens=num_tokens)


def launch_workspace(key: tuple, q: torch.Tensor, collection, causal: bool, window: Optional[int]) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of a launch of ``key`` for the step of ``q``: its grid
    (``launch_shape``) and split-KV partials over the value width (``paged_attention_sm90.launch_workspace``)."""
    t, hq = q.shape[:2]
    shape = launch_shape(collection, hq, splits.sm_count(q.device), causal, window, num_tokens=t)
    return (*shape, *splits.partials(shape[1], t, hq, key[4], q.device))


@functools.lru_cache(maxsize=None)
def launcher(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once: what stays per call is sizing the grid and launching."""
    d, softcap_on, rope_dim = key[3], key[7], key[10]
    units = compile_units(key, arch)

    def launch(q, input_row_offsets, c, layer_idx, workspace, causal, window, scale, softcap, sinks, out, lse,
               return_lse):
        m_blocks, num_splits, o_part, lse_part = workspace
        score_scale, softmax_scale_log2 = softmax_args(d, scale, softcap if softcap_on else None)
        sinks = None if sinks is None else sinks.contiguous()
        splits.launch_and_combine(
            units, arch, q, out, VEC, (lse, o_part, lse_part),
            (sinks, c.blocks, c.scales if rope_dim else None, input_row_offsets.contiguous(),
             c.cache_lengths.contiguous(), c.lookup_table, layer_idx, m_blocks, num_splits, int(causal),
             window_arg(window), score_scale, softmax_scale_log2), num_splits, o_part, lse_part, lse)

    return splits.dense_run(key, launch_workspace, launch)


BACKEND = Backend(Family.SM90_MLA, KERNEL, plan, compile_units, launcher, launch_workspace)
