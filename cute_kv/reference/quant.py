"""FP8 (e4m3fn) KV quantization: one scale per (token, head, granule of ``granularity`` head dims).

``scale = amax(|granule|) / FP8_E4M3_MAX`` and ``q = saturate(x / scale)``; dequantization is ``q * scale``.
float8_e8m0fnu scales hold only powers of two, so the scale is rounded *up* to one: ``x / scale`` then stays
within the fp8 range instead of saturating. A granule of zeros gets the smallest scale (never a division by 0).
NaN and infinity propagate as a kernel's float32 arithmetic would: a granule holding a NaN gets a NaN scale and NaN
values; one holding an infinity an infinite scale, NaN where the infinity was and 0 elsewhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from cute_kv.dtypes import FP8_E4M3_MAX

# Scale floors: float32's smallest normal (keeps 1/scale finite) and e8m0's smallest value 2^-127.
_MIN_SCALE = {torch.float32: torch.finfo(torch.float32).tiny, torch.float8_e8m0fnu: 2.0**-127}
_E8M0_MAX = 2.0**127


# The NaN a GPU's float32 arithmetic produces (PTX's canonical NaN): a NaN scale is stored with these bits.
_CANONICAL_NAN = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)


def saturating_cast_fp8(x: torch.Tensor) -> torch.Tensor:
    """``x`` to float8_e4m3fn, clamping to +-FP8_E4M3_MAX (e4m3fn has no infinity). NaN stays NaN, as the positive
    NaN ``0x7F`` whatever its sign (a CPU's 0/0 or inf/inf is negative, a GPU's positive; ``cvt.satfinite`` gives
    ``0x7F``)."""
    x = x.to(torch.float32)
    return torch.where(x.isnan(), float("nan"), x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)).to(torch.float8_e4m3fn)


def _granules(x: torch.Tensor, granularity: int) -> torch.Tensor:
    """``[..., D]`` -> ``[..., G, granularity]``; a ragged last granule is zero-padded (zeros leave amax alone)."""
    d = x.shape[-1]
    g = math.ceil(d / granularity)
    return F.pad(x, (0, g * granularity - d)).unflatten(-1, (g, granularity))


def _power_of_two_ceil(s: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= ``s`` (``s > 0``), exactly: ``s = m * 2**e`` with ``m`` in [0.5, 1). Infinity and
    NaN stay as they are (frexp's exponent of them is meaningless)."""
    m, e = torch.frexp(s)
    return torch.where(s.isfinite(), torch.ldexp(torch.ones_like(s), e - (m == 0.5).to(e.dtype)), s)


def quantize_fp8(x: torch.Tensor, granularity: int, scale_dtype: torch.dtype = torch.float32):
    """``x [..., D]`` (any float dtype) -> ``(q float8_e4m3fn [..., D], scales scale_dtype [..., G])``.

    ``G = ceil(D / granularity)``. Computed in float32 from ``x`` as given (callers pass the float32
    accumulator, not a value already rounded to bf16).
    """
    if scale_dtype not in _MIN_SCALE:
        raise ValueError(f"scale_dtype must be float32 or float8_e8m0fnu, got {scale_dtype}")
    x = x.to(torch.float32)
    amax = _granules(x, granularity).abs().amax(dim=-1)  # NaN-propagating
    # A tensor divisor: CUDA torch turns division by a Python scalar into a multiply by its reciprocal (other bits).
    scale = (amax / torch.tensor(FP8_E4M3_MAX, device=x.device)).clamp_min(_MIN_SCALE[scale_dtype])
    if scale_dtype == torch.float8_e8m0fnu:
        scale = _power_of_two_ceil(scale).clamp_max(_E8M0_MAX)
    else:
        scale = torch.where(scale.isnan(), _CANONICAL_NAN.to(x.device), scale)
    q = saturating_cast_fp8(x / expand_scales(scale, granularity, x.shape[-1]))
    return q, scale.to(scale_dtype)


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (any float dtype) -> float8_e4m3fn ``saturate(x / scale)`` with one float32 ``scale`` (a 0-d tensor) for
    the whole tensor (``cute_kv/tensor_scales.py``); nothing is stored beside the values."""
    return saturating_cast_fp8(x.to(torch.float32) / scale)


def expand_scales(scales: torch.Tensor, granularity: int, head_dim: int) -> torch.Tensor:
    """Per-granule ``[..., G]`` -> per-element ``[..., head_dim]`` float32 (element d uses granule d // gran)."""
    return scales.to(torch.float32).repeat_interleave(granularity, dim=-1)[..., :head_dim]

