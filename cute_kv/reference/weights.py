"""Quantized projection weights for ``fused_qkv_matmul_kv_cache`` (MAX's ``weight_dtype``, ``group_size``, ``has_zp``).

Both formats describe a logical weight ``W [N, K]`` (row ``n`` is output column ``n`` of ``C = hidden @ W^T``):

* ``Int4Weight`` (GPTQ/AWQ-style, ``weight_dtype`` int4): ``packed`` uint8 ``[N, K/2]``. Weight ``(n, k)`` is
  the *low* nibble of ``packed[n, k // 2]`` for even ``k`` and the *high* nibble for odd ``k``, an unsigned
  code ``q`` in ``[0, 15]``. ``scales [N, K/group_size]`` (``hidden.dtype`` or float32) hold one scale per
  row and group of ``group_size`` consecutive ``k``. Dequantization: ``W[n, k] = (q - z) * scales[n, k // g]``
  with ``z = zero_points[n, k // g]`` (uint8 in ``[0, 15]``, one per scale, unpacked) when ``has_zp``, else
  ``z = 8`` (symmetric: the code is offset binary, ``q - 8`` in ``[-8, 7]``).
* ``Fp8Weight`` (``weight_dtype`` float8_e4m3fn): ``weight [N, K]`` float8_e4m3fn and float32 per-channel
  ``scales [N]``: ``W[n, k] = float(weight[n, k]) * scales[n]``.

Rounding (what the kernels do, bit for bit in the weight): an int4 weight is dequantized into the activations'
16-bit dtype, ``W[n, k] = round((q - z) * s)`` with the product exact in float32 (a small integer times a 16-bit
scale; float32 scales are rounded there once) and rounded once to ``hidden.dtype`` (nearest even), the operand a
16-bit tensor-core mainloop multiplies; float32 activations keep it in float32. An fp8 weight's value is exact in
any 16-bit dtype; the fused-QKV reference multiplies its float32 scale into the float32 product's column
(``sum(x * w) * s``, what the kernel's epilogue does; ``dequantize`` gives ``w * s``). The product itself is
float32, so kernels and this reference agree to accumulation order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from cute_kv.validate import check_tensor

INT4_ZERO = 8  # implicit zero point without ``has_zp``: offset-binary codes


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """Packed int4 weight ``[N, K]`` with per-group scales and optional zero points (see the module doc)."""

    packed: torch.Tensor
    scales: torch.Tensor
    group_size: int
    has_zp: bool = False
    zero_points: Optional[torch.Tensor] = None

    def __post_init__(self):
        check_tensor("weight.packed", self.packed, dtype=torch.uint8, ndim=2)
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g <= 0 or g % 2:
            raise ValueError(f"weight.group_size must be a positive even int, got {g!r}")
        n, k = self.shape
        if k % g:
            raise ValueError(f"weight.group_size ({g}) must divide K ({k} = 2 * packed.shape[1]); pad K or pick a "
                             f"group size that divides it")
        check_tensor("weight.scales", self.scales, dtype=(torch.bfloat16, torch.float16, torch.float32),
                     shape=[n, k // g], device=self.packed.device)
        if not isinstance(self.has_zp, bool):
            raise TypeError(f"weight.has_zp must be a bool, got {self.has_zp!r}")
        if self.has_zp != (self.zero_points is not None):
            raise ValueError("weight.zero_points given without has_zp=True" if self.zero_points is not None
                             else "weight.has_zp=True needs weight.zero_points (uint8 [N, K/group_size])")
        if self.zero_points is not None:
            check_tensor("weight.zero_points", self.zero_points, dtype=torch.uint8, shape=[n, k // g],
                         device=self.packed.device)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(N, K)``."""
        return self.packed.shape[0], 2 * self.packed.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def weight_dtype(self) -> str:
        return "int4"

    def dequantize(self) -> torch.Tensor:
        """``W [N, K]`` in float32."""
        n, k = self.shape
        q = torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1).reshape(n, k).to(torch.float32)
        z = INT4_ZERO if self.zero_points is None else self.zero_points.to(torch.float32)
        s = self.scales.to(torch.float32)
        return ((q.unflatten(1, (-1, self.group_size)) - (z if isinstance(z, int) else z[..., None]))
                * s[..., None]).flatten(1)


@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """float8_e4m3fn weight ``[N, K]`` with float32 per-output-channel scales ``[N]``."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        check_tensor("weight.weight", self.weight, dtype=torch.float8_e4m3fn, ndim=2)
        check_tensor("weight.scales", self.scales, dtype=torch.float32, shape=[self.weight.shape[0]],
                     device=self.weight.device)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def weight_dtype(self) -> str:
        return "float8_e4m3fn"

    def dequantize(self) -> torch.Tensor:
        return self.weight.to(torch.float32) * self.scales[:, None]


QuantizedWeight = Union[Int4Weight, Fp8Weight]


def dequantize(weight, activation_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Any accepted weight as float32 ``[N, K]``, an int4 one rounded once to ``activation_dtype`` (see the module
    doc)."""
    if isinstance(weight, torch.Tensor):
        return weight.to(torch.float32)
    w = weight.dequantize()
    return w.to(activation_dtype).to(torch.float32) if isinstance(weight, Int4Weight) else w
