"""The torch dtypes a cache may hold, and their MAX shorthand names."""

from __future__ import annotations

import torch

# MAX spells fp8 e4m3 as "f8_m4e3fn" (sic); kept for op-name compatibility.
DTYPE_SHORTHAND = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.float8_e4m3fn: "f8_m4e3fn",
}
KV_DTYPES = frozenset(DTYPE_SHORTHAND)
FP8_DTYPES = frozenset({torch.float8_e4m3fn})
SCALE_DTYPES = frozenset({torch.float32, torch.float8_e8m0fnu})
# Largest finite e4m3fn magnitude: quantization maps each granule's amax onto it.
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)

_NAMES = {v: k for k, v in DTYPE_SHORTHAND.items()}
_NAMES.update({"bfloat16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
               "float32": torch.float32, "fp32": torch.float32, "fp8": torch.float8_e4m3fn,
               "float8_e4m3fn": torch.float8_e4m3fn, "e4m3": torch.float8_e4m3fn})


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """``'bf16'`` / ``'bfloat16'`` / ``'fp8'`` ... -> torch dtype (for the CLI and configs)."""
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_NAMES)}") from None
