"""Reference MLA prefill, MAX's decompressed path: latent rows gathered from the cache, up-projected per head.

An MLA cache row is ``[c_kv (kv_lora_rank) | k_rope (rope_dim)]`` (rope-aware FP8 rows are dequantized first). Query
head ``h`` has ``q_nope [nope_dim]`` and ``q_rope [rope_dim]``; ``W_UK [H, nope_dim, kv_lora_rank]`` and
``W_UV [H, v_dim, kv_lora_rank]`` up-project the latent. For keys ``j`` of the query's request (causal):

* decompressed (this module, MAX's ``mla_prefill``): ``k_nope[j, h] = W_UK[h] c_kv[j]``, ``v[j, h] = W_UV[h]
  c_kv[j]``; ``s = scale * (q_nope . k_nope + q_rope . k_rope)``; ``out[h] = softmax(s) v``.
* absorbed (what decode runs: ``paged_attention`` on the latent cache): ``q_lat[h] = W_UK[h]^T q_nope[h]``,
  attention of ``[q_lat | q_rope]`` over the latent rows with values ``c_kv`` (``mla_v_dim = kv_lora_rank``), then
  ``out[h] = W_UV[h] o_lat[h]``. Both are the same sums, reassociated (tests/test_mla_prefill.py checks it in
  float64).

Which path a prefill kernel should take. ``flops`` counts each path's multiply-adds (x2); the counts are checked
against torch's FLOP counter on the code below. With ``T`` query tokens over ``S`` keys per request and DeepSeek-V3
shapes (H=128, kv_lora_rank=512, rope_dim=64, nope_dim=v_dim=128):

* absorbed: ``T*S * 2H(2r + rope) = 278,528`` per (query, key) pair, plus ``T * 2H r (nope + v) = 33.5 M`` per
  query token (q absorption and output projection);
* decompressed: ``T*S * 2H(nope + rope + v) = 81,920`` per pair, plus ``S * 2H r (nope + v) = 33.5 M`` per key
  (up-projecting it once for the chunk).

So the pair term is 3.4x smaller decompressed, and decompression costs per key what absorption costs per query:
decompressed is cheaper once ``T*S*196,608 > (S - T) * 33.5 M``, i.e. for chunks of about 171 new tokens or more per
request (``1/T - 1/S < 1/170.7``). Per layer and request: a 4k-token prefill (T = S = 4096) takes 1.51 TFLOP
decompressed against 4.81 absorbed (3.2x fewer); a 512-token chunk over 4k keys 0.31 against 0.60 (1.9x); a
128-token chunk over 4k keys 0.18 against 0.15 (absorbed 1.2x fewer); a decode step (T = 1, S = 4096) 1.2 GFLOP
absorbed against 138 decompressed (117x fewer absorbed). Prefill kernels take the decompressed path (a dense
per-head attention of head dim nope + rope = 192 with values of 128, MAX's ``mla_prefill`` split), decode and chunks
of fewer than about 171 tokens per request the absorbed one (the MLA decode kernels).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from cute_kv.reference.attention import causal_mask
from cute_kv.reference.ragged import requests

DEEPSEEK_V3 = dict(num_heads=128, kv_lora_rank=512, rope_dim=64, nope_dim=128, v_dim=128)


def flops(num_q: int, num_keys: int, *, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int,
          v_dim: int) -> dict[str, int]:
    """Matmul FLOPs (2 per multiply-add) of one request's attention of ``num_q`` queries over ``num_keys`` keys (all
    pairs: a causal kernel skips about half of them on both paths alike), for each path."""
    h, r = num_heads, kv_lora_rank
    projection = 2 * h * r * (nope_dim + v_dim)  # W_UK and W_UV applied to one vector per head
    return {
        "absorbed": num_q * num_keys * 2 * h * (2 * r + rope_dim) + num_q * projection,
        "decompressed": num_q * num_keys * 2 * h * (nope_dim + rope_dim + v_dim) + num_keys * projection,
    }


def mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, input_row_offsets: torch.Tensor, collection,
                layer_idx: int, w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: Optional[float] = None,
                causal: bool = True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``q_nope [T, H, nope_dim]``, ``q_rope [T, H, rope_dim]`` -> ``[T, H, v_dim]`` in ``q_nope.dtype`` (or ``out``),
    by the decompressed path. ``w_uk [H, nope_dim, kv_lora_rank]``, ``w_uv [H, v_dim, kv_lora_rank]``; the cache's
    rows are ``kv_lora_rank + rope_dim`` wide (``latent_dim``). ``scale`` defaults to ``1/sqrt(nope_dim +
    rope_dim)``. Computed in float64 for float64 inputs, else float32."""
    t, h, dn = q_nope.shape
    r = w_uk.shape[2]
    if r + q_rope.shape[2] != collection.latent_dim:
        raise ValueError(f"kv_lora_rank ({r}) + rope_dim ({q_rope.shape[2]}) must equal the cache's latent_dim "
                         f"({collection.latent_dim})")
    acc_dtype = torch.float64 if q_nope.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(dn + q_rope.shape[2]) if scale is None else scale
    cache = collection.get_key_cache(layer_idx)
    w_uk, w_uv = w_uk.to(acc_dtype), w_uv.to(acc_dtype)
    acc = torch.empty((t, h, w_uv.shape[1]), dtype=acc_dtype, device=q_nope.device)
    for b, start, stop, cache_length in requests(input_row_offsets, collection.cache_lengths):
        rows = cache.gather(b, 0, cache_length + stop - start, acc_dtype)[:, 0]  # [S, latent_dim]
        c_kv, k_rope = rows[:, :r], rows[:, r:]
        k_nope = torch.einsum("hnr,sr->hsn", w_uk, c_kv)  # decompressed once per key and head
        v = torch.einsum("hvr,sr->hsv", w_uv, c_kv)
        s = (torch.einsum("thn,hsn->hts", q_nope[start:stop].to(acc_dtype), k_nope)
             + torch.einsum("thd,sd->hts", q_rope[start:stop].to(acc_dtype), k_rope)) * scale
        if causal:
            s = s.masked_fill(~causal_mask(cache_length, stop - start, None, s.device), float("-inf"))
        acc[start:stop] = torch.einsum("hts,hsv->thv", s.softmax(dim=-1), v)
    return acc.to(q_nope.dtype) if out is None else out.copy_(acc)
