"""``paged_attention`` on SM100 (Blackwell): which calls ``PagedAttentionSm100`` serves, its compile key and launcher.

Kept apart from the SM90 entry (``paged_attention.py``), which calls ``kernel_key_sm100`` and ``launcher_sm100``
for ``sm_100a``. The API flags (``softcap``, ``sinks``, ``return_lse``) are part of the compile key.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.attention.sm100_config import BM, DTYPE_NAMES, FP8, VEC, key_tile, supported, uses_gather4
from cute_kv.ops.vectors import heads_packed, packed_heads
from cute_kv.row_indices import lut_chunk, tile_geometry

LOG2E = math.log2(math.e)
KEY = "paged_attention_sm100"


def kernel_key_sm100(collection, q, *, softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
                     return_lse: bool = False) -> Optional[tuple]:
    """The compile-time key of the ``PagedAttentionSm100`` serving these arguments, or None where the reference
    runs instead: MLA caches, q in another dtype than a 16-bit cache, head dims, page sizes or granules the kernel
    cannot tile (``sm100_config.supported``: fp8 caches need pages of 8+ rows that tile the key tile), a misaligned
    cache, more rows than int32 TMA coordinates reach, or sinks that are not float32 ``[Hq]`` on the cache's
    device."""
    c = collection
    q_dtype_name, kv_dtype_name = dtype_name(q.dtype), dtype_name(c.dtype)
    if c.is_mla or q_dtype_name not in DTYPE_NAMES or (kv_dtype_name != FP8 and c.dtype != q.dtype):
        return None
    granularity = c.quantization_granularity if kv_dtype_name == FP8 and c.scales is not None else None
    e8m0 = granularity is not None and c.scale_dtype == torch.float8_e8m0fnu
    hq, h, d, p = q.shape[1], c.num_heads, c.head_size, c.page_size
    if (supported(hq, h, d, p, kv_dtype_name, granularity) or c.blocks.data_ptr() % 16
            or c.num_pages * c.kv_dim * c.num_layers * p >= 2**31):
        return None
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (hq,)
                              or sinks.device != c.device):
        return None
    bn = key_tile(d)
    lut_vector = False  # gather4 reads one lookup entry per token
    if not uses_gather4(p, bn):
        chunk = lut_chunk(tile_geometry(bn, p)[1], bn, p)
        lut = c.lookup_table
        lut_vector = lut.shape[1] % chunk == 0 and lut.stride(0) % chunk == 0 and lut.data_ptr() % (4 * chunk) == 0
    return (KEY, q_dtype_name, hq, h, d, p, c.kv_dim, lut_vector, bool(softcap), sinks is not None,
            bool(return_lse), kv_dtype_name, granularity, e8m0)


def launch_shape_sm100(collection, num_q_heads: int, slots: int) -> tuple[int, int]:
    """``(m_blocks, splits)``: query blocks of ``BM`` packed rows for the longest new-token run, and key splits for
    ``slots`` resident CTAs (one per SM: a CTA takes all of its tensor memory)."""
    from cute_kv.ops.paged_attention import num_splits

    c = collection
    m_blocks = -(-c.max_seq_length * (num_q_heads // c.num_heads) // BM)
    key_tiles = -(-c.max_cache_length // key_tile(c.head_size))
    return m_blocks, num_splits(c.batch_size * c.num_heads * m_blocks, key_tiles, slots)


def score_args(head_dim: int, scale: Optional[float], softcap: Optional[float]) -> tuple[float, float]:
    """``(score_scale, cap_log2)``: base-2 logits are ``score_scale * q.k``, or with a soft-cap ``c``,
    ``cap_log2 * tanh(score_scale * q.k)`` (``c * tanh(scale * q.k / c)`` in base 2)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if softcap:
        return scale / softcap, softcap * LOG2E
    return scale * LOG2E, 1.0


@functools.lru_cache(maxsize=None)
def launcher_sm100(key: tuple, arch: str) -> Callable:
    """``run(...)`` for one compile-time key, built once (the SM90 launcher's shape, plus the API flags)."""
    from cute_kv.kernels.compile_cache import compiled
    from cute_kv.ops.paged_attention import _build_combine, _scales_arg, _sm_count, _unused_partials, _window_arg

    _, dt_name, hq, h, d, _, _, _, has_softcap, has_sinks, return_lse, _, granularity, e8m0 = key

    def build():
        from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

        kernel = PagedAttentionSm100(*key[1:])
        return kernel, *kernel.fake_args()

    def run(q, input_row_offsets, collection, layer_idx, *, causal=True, window=None, scale=None, mla_v_dim=None,
            out=None, softcap=None, sinks=None, lse=None):
        """``lse``: float32 ``[T, Hq]`` to fill (natural log) when the key has ``return_lse``."""
        t = q.shape[0]
        if t == 0:  # a grid of zero CTAs is a launch error
            return out
        c = collection
        m_blocks, splits = launch_shape_sm100(c, hq, _sm_count(q.device))
        dst = out if heads_packed(out, VEC) else torch.empty_like(out, memory_format=torch.contiguous_format)
        if splits > 1:
            o_part = torch.empty((splits, t, hq, d), dtype=torch.float32, device=q.device)
            lse_part = torch.empty((splits, t, hq), dtype=torch.float32, device=q.device)
        else:  # one split writes the output itself; the kernel's signature still takes partials
            o_part, lse_part = _unused_partials(q.device, hq, d)
        lse_arg = lse if return_lse and splits == 1 else _unused_partials(q.device, hq, d)[1][0]
        score_scale, cap_log2 = score_args(d, scale, softcap if has_softcap else None)
        compiled(key, build, arch)(packed_heads(q, VEC), dst, o_part, lse_part, lse_arg, c.blocks, c.blocks,
                                   input_row_offsets.contiguous(), c.cache_lengths, c.lookup_table,
                                   _scales_arg(c.scales, granularity, e8m0), sinks.contiguous() if has_sinks else None,
                                   layer_idx, m_blocks, splits, int(causal),
                                   _window_arg(window), score_scale, cap_log2)
        if splits > 1:
            combine = compiled(("attention_combine", dt_name, hq, d), lambda: _build_combine(dt_name, hq, d), arch)
            combine(dst, o_part, lse_part, splits)
            if return_lse:  # the splits' base-2 lse merged (the combine kernel writes only O)
                torch.mul(torch.logsumexp(lse_part * math.log(2.0), dim=0), 1.0, out=lse)
        return out if dst is out else out.copy_(dst)

    return run
