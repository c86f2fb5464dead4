"""Rotary position embedding (RoPE) in MAX's ``freqs_cis`` convention, and its reference application.

Pair ``j`` of a head is the complex number ``x_re + i*x_im``, multiplied by
``freqs_cis[pos, 2j] + i*freqs_cis[pos, 2j+1]`` (``cos`` and ``sin`` of ``pos * theta_j``):

* neox / rotate-half (``interleaved=False``): pair ``j`` = ``(x[j], x[j + R/2])`` over the *first* ``R`` dims;
* GPT-J (``interleaved=True``): pair ``j`` = ``(x[D-R+2j], x[D-R+2j+1])`` over the *last* ``R`` dims;

with ``R = rope_dim = freqs_cis.shape[1]``; the other ``D - R`` dims pass through (partial RoPE, as MAX's
``fused_qk_rope``: MLA latent rows carry their rope part last).

The table layout and the pairing are independent: the table always stores frequency ``j``'s cos and sin side
by side in columns ``2j, 2j+1``, whichever dims ``interleaved`` pairs. Hugging Face Llama / Mistral / Qwen
models (``rotate_half``) are ``interleaved=False``; GPT-J, GPT-NeoX's ``rotary_interleaved`` and Meta's
original Llama checkpoints (complex multiplication of adjacent dims) are ``interleaved=True``. Scaled RoPE
(llama3, YaRN, LongRoPE) changes only the frequencies ``theta_j`` and, for YaRN / LongRoPE, multiplies cos
and sin by an attention factor; the constructors below build those tables in float64 and store float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from cute_kv.validate import check_tensor


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE fused into ``fused_qkv_matmul_kv_cache``: applied to Q and to the new K rows at ``cache_lengths[b] + i``.

    ``freqs_cis``: float32 ``[max_positions, rope_dim]`` (interleaved cos/sin, see the module doc); positions
    must be below ``max_positions``. ``q_head_dim``: head size Q is split into (default: the cache head size).
    """

    freqs_cis: torch.Tensor
    interleaved: bool = False
    q_head_dim: Optional[int] = None

    def __post_init__(self):
        check_tensor("rope.freqs_cis", self.freqs_cis, dtype=torch.float32, ndim=2)
        r = self.freqs_cis.shape[1]
        if r <= 0 or r % 2:
            raise ValueError(f"rope.freqs_cis must have a positive even width (rope_dim), got {r}")
        if not isinstance(self.interleaved, bool):
            raise TypeError(f"rope.interleaved must be a bool, got {self.interleaved!r}")
        q = self.q_head_dim
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q <= 0):
            raise ValueError(f"rope.q_head_dim must be a positive int or None, got {q!r}")

    @property
    def rope_dim(self) -> int:
        return self.freqs_cis.shape[1]

    @classmethod
    def from_theta(cls, rope_dim: int, max_positions: int, theta: float = 10000.0, *, interleaved: bool = False,
                   q_head_dim: Optional[int] = None, device=None) -> "RopeConfig":
        """The standard table ``theta_j = theta ** (-2j / rope_dim)`` (computed in float64, stored float32)."""
        return cls.from_inv_freq(_base_inv_freq(rope_dim, theta), max_positions, interleaved=interleaved,
                                 q_head_dim=q_head_dim, device=device)

    @classmethod
    def from_inv_freq(cls, inv_freq, max_positions: int, *, attention_factor: float = 1.0,
                      interleaved: bool = False, q_head_dim: Optional[int] = None, device=None) -> "RopeConfig":
        """The table of frequencies ``inv_freq [rope_dim / 2]`` (a Hugging Face rotary embedding's ``inv_freq``;
        its ``attention_scaling`` is ``attention_factor``, multiplied into cos and sin)."""
        inv_freq = torch.as_tensor(inv_freq, dtype=torch.float64).cpu()
        if inv_freq.ndim != 1 or inv_freq.numel() == 0:
            raise ValueError(f"inv_freq must be a non-empty 1-D tensor, got shape {list(inv_freq.shape)}")
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq
        freqs_cis = torch.stack((angles.cos(), angles.sin()), dim=-1).flatten(1) * attention_factor
        return cls(freqs_cis.to(device=device, dtype=torch.float32), interleaved, q_head_dim)

    @classmethod
    def from_cos_sin(cls, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False,
                     q_head_dim: Optional[int] = None) -> "RopeConfig":
        """The table of a model's own ``cos, sin [max_positions, n]`` (position ``p`` in row ``p``): one column per
        frequency (``n = rope_dim / 2``), or Hugging Face's ``[max_positions, rope_dim]`` with the frequencies
        repeated (``cat(f, f)``, checked). The values are taken as they are (attention factor included), so the
        rotation matches the model's bit for bit where it rotates in float32."""
        if cos.shape != sin.shape or cos.ndim != 2:
            raise ValueError(f"cos and sin must have one equal 2-D shape, got {list(cos.shape)} and {list(sin.shape)}")
        n = cos.shape[1]
        if n % 2 == 0 and torch.equal(cos[:, : n // 2], cos[:, n // 2:]) and torch.equal(sin[:, : n // 2],
                                                                                         sin[:, n // 2:]):
            cos, sin = cos[:, : n // 2], sin[:, : n // 2]
        freqs_cis = torch.stack((cos.float(), sin.float()), dim=-1).flatten(1).contiguous()
        return cls(freqs_cis, interleaved, q_head_dim)

    @classmethod
    def llama3(cls, rope_dim: int, max_positions: int, theta: float = 500000.0, *, factor: float = 8.0,
               low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
               original_max_position_embeddings: int = 8192, **kw) -> "RopeConfig":
        """Llama 3.1's scaling: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
        inv_freq = _base_inv_freq(rope_dim, theta)
        wavelen = 2 * math.pi / inv_freq
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > original_max_position_embeddings / low_freq_factor, inv_freq / factor,
                               torch.where(wavelen < original_max_position_embeddings / high_freq_factor, inv_freq,
                                           scaled))
        return cls.from_inv_freq(inv_freq, max_positions, **kw)

    @classmethod
    def yarn(cls, rope_dim: int, max_positions: int, theta: float = 10000.0, *, factor: float,
             original_max_position_embeddings: int, beta_fast: float = 32.0, beta_slow: float = 1.0,
             attention_factor: Optional[float] = None, mscale: Optional[float] = None,
             mscale_all_dim: Optional[float] = None, truncate: bool = True, **kw) -> "RopeConfig":
        """YaRN: frequencies blended between interpolated (``/ factor``) and original by a ramp over the dims
        whose rotations within ``original_max_position_embeddings`` lie between ``beta_slow`` and ``beta_fast``;
        cos/sin scaled by ``attention_factor`` (default ``0.1 ln(factor) + 1``, or DeepSeek's mscale ratio)."""
        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if attention_factor is None:
            attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                                if mscale and mscale_all_dim else get_mscale(factor))

        def correction_dim(rotations):
            turns = original_max_position_embeddings / (rotations * 2 * math.pi)
            return rope_dim * math.log(turns) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rope_dim - 1)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / max(high - low, 1e-3)).clamp(0, 1)
        inv_freq = _base_inv_freq(rope_dim, theta)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
        return cls.from_inv_freq(inv_freq, max_positions, attention_factor=attention_factor, **kw)

    @classmethod
    def longrope(cls, rope_dim: int, max_positions: int, theta: float = 10000.0, *, short_factor, long_factor,
                 original_max_position_embeddings: int, factor: Optional[float] = None,
                 attention_factor: Optional[float] = None, use_long: Optional[bool] = None, **kw) -> "RopeConfig":
        """LongRoPE (Phi-3): frequency ``j`` divided by ``long_factor[j]`` or ``short_factor[j]``, cos/sin scaled by
        ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))``. A paged cache keeps K rotated once, so the
        choice is static: the long factors when ``max_positions > original_max_position_embeddings`` (as vLLM;
        Hugging Face switches per call on the current length), unless ``use_long`` says otherwise."""
        factor = max_positions / original_max_position_embeddings if factor is None else factor
        if attention_factor is None:
            attention_factor = (1.0 if factor <= 1 else
                                math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings)))
        use_long = max_positions > original_max_position_embeddings if use_long is None else use_long
        ext = torch.as_tensor(long_factor if use_long else short_factor, dtype=torch.float64)
        if ext.shape != (rope_dim // 2,):
            raise ValueError(f"longrope factors must hold rope_dim / 2 = {rope_dim // 2} values, got {ext.numel()}")
        return cls.from_inv_freq(_base_inv_freq(rope_dim, theta) / ext, max_positions,
                                 attention_factor=attention_factor, **kw)


def _base_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Rotate float32 ``x [T, heads, D]`` whose row ``t`` sits at ``positions[t]``; returns a new float32 tensor."""
    d, r = x.shape[-1], rope.rope_dim
    f = rope.freqs_cis[positions][:, None, :]  # [T, 1, R]: broadcast over heads
    cos, sin = f[..., 0::2], f[..., 1::2]
    if rope.interleaved:
        keep, span = x[..., : d - r], x[..., d - r:]
        re, im = span[..., 0::2], span[..., 1::2]
        rotated = torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)
        return torch.cat((keep, rotated), dim=-1)
    span, keep = x[..., :r], x[..., r:]
    re, im = span[..., : r // 2], span[..., r // 2:]
    return torch.cat((re * cos - im * sin, re * sin + im * cos, keep), dim=-1)
