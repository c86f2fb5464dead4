"""Rotary position embedding (RoPE) in MAX's ``freqs_cis`` convention, and its reference application.

Pair ``j`` of a head is the complex number ``x_re + i*x_im``, multiplied by
``freqs_cis[pos, 2j] + i*freqs_cis[pos, 2j+1]`` (``cos`` and ``sin`` of ``pos * theta_j``):

* neox / rotate-half (``interleaved=False``): pair ``j`` = ``(x[j], x[j + R/2])`` over the *first* ``R`` dims;
* GPT-J (``interleaved=True``): pair ``j`` = ``(x[D-R+2j], x[D-R+2j+1])`` over the *last* ``R`` dims;

with ``R = rope_dim = freqs_cis.shape[1]``; the other ``D - R`` dims pass through (partial RoPE, as MAX's
``fused_qk_rope``: MLA latent rows carry their rope part last).
"""

from __future__ import annotations

import dataclasses
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
        inv_freq = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inv_freq
        freqs_cis = torch.stack((angles.cos(), angles.sin()), dim=-1).flatten(1)
        return cls(freqs_cis.to(device=device, dtype=torch.float32), interleaved, q_head_dim)


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
