"""QK-norm fused into ``fused_qkv_matmul_kv_cache``: per-head RMSNorm of Q and K (Qwen3, Gemma 3) and MLA's latent
RMSNorm, applied to the float32 projection before RoPE (MAX's ``fused_qk_rms_norm_rope`` and the MLA latent norm).

A weight ``gamma`` of length ``C`` normalizes the first ``C`` dims of every head (the rest pass through):
``y[:C] = x[:C] * rsqrt(mean(x[:C]^2) + eps) * (gamma + weight_offset)``. Per-head QK-norm uses ``C`` equal to the
head size; MLA's latent norm uses ``C = kv_lora_rank`` on the single latent head, leaving its RoPE dims alone.
V is never normalized.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cute_kv.validate import check_tensor

_GAMMA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """``q_weight`` (``[C_q]``, ``C_q <=`` Q head size) and/or ``k_weight`` (``[C_k]``, ``C_k <=`` cache head size);
    ``None`` leaves that side unnormalized. ``weight_offset`` is added to gamma (Gemma's ``1 + gamma``)."""

    q_weight: Optional[torch.Tensor] = None
    k_weight: Optional[torch.Tensor] = None
    epsilon: float = 1e-6
    weight_offset: float = 0.0

    def __post_init__(self):
        if self.q_weight is None and self.k_weight is None:
            raise ValueError("qk_norm needs q_weight or k_weight (pass qk_norm=None for no norm)")
        for name in ("q_weight", "k_weight"):
            w = getattr(self, name)
            if w is not None:
                check_tensor(f"qk_norm.{name}", w, dtype=_GAMMA_DTYPES, ndim=1)
                if w.numel() == 0:
                    raise ValueError(f"qk_norm.{name} must not be empty")
        for name in ("epsilon", "weight_offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise ValueError(f"qk_norm.{name} must be a finite number, got {v!r}")
        if self.epsilon <= 0:
            raise ValueError(f"qk_norm.epsilon must be positive, got {self.epsilon}")


def rms_norm_heads(x: torch.Tensor, gamma: torch.Tensor, epsilon: float, weight_offset: float) -> torch.Tensor:
    """float32 ``x [T, heads, D]``: RMSNorm of the first ``len(gamma)`` dims of every head; returns a new tensor."""
    c = gamma.shape[0]
    span = x[..., :c]
    inv_rms = torch.rsqrt(span.square().mean(dim=-1, keepdim=True) + epsilon)
    normed = span * inv_rms * (gamma.to(torch.float32) + weight_offset)
    return torch.cat((normed, x[..., c:]), dim=-1)
