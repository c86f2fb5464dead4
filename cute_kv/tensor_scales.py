"""Per-tensor fp8 scales, as vLLM's and FlashInfer's fp8 caches carry them: ``k_scale`` for all of a layer's K, and
``v_scale`` for all of its V.

A value is stored as ``saturate(x / scale)`` in e4m3 (vLLM's cache writers: ``__nv_cvt_float_to_fp8(x / scale,
__NV_SATFINITE)``; NaN stays NaN) and read as ``q * scale``. No scale is stored in the cache, so such a cache is an
fp8 collection without ``scales`` in any layout the kernels address; ``store_kv`` and ``paged_attention`` take the
pair with each call. Each scale is a Python float or a float32 tensor of one element (0-d or ``[1]``, vLLM's
``layer._k_scale``) on the cache's device; a tensor's value is checked with the other device values (not under
``validate=False``, a plan or a torch.compile trace). The kernels read both from one float32 ``[2]`` tensor
(``kernel_arg``), made per call: from two device scalars by a stack on the device, from floats by a copy of 8 bytes
from the host, which a CUDA graph cannot capture (pass tensors there).
"""

from __future__ import annotations

import math

import torch

NAMES = ("k_scale", "v_scale")


def check(k_scale, v_scale, collection, *, data_checks: bool = True) -> bool:
    """Raise naming the argument unless ``(k_scale, v_scale)`` are both None or both valid per-tensor scales of
    ``collection``; returns whether they are given."""
    given = [name for name, s in zip(NAMES, (k_scale, v_scale)) if s is not None]
    if not given:
        return False
    if len(given) == 1:
        missing = NAMES[1 - NAMES.index(given[0])]
        raise ValueError(f"{given[0]} needs {missing} too: per-tensor scales come as a pair (pass {missing}=1.0 "
                         f"for an unscaled plane)")
    c = collection
    if c.dtype != torch.float8_e4m3fn:
        raise TypeError(f"k_scale / v_scale are per-tensor scales of an fp8 e4m3 cache; this cache is {c.dtype}")
    if c.scales is not None:
        raise ValueError("k_scale / v_scale are per-tensor scales; this cache has per-granule scales (MAX's "
                         "[N, KVD, L, P, H, G]): pass one or the other")
    if c.is_mla:
        raise ValueError("k_scale / v_scale are for MHA/GQA caches with K and V; an MLA cache (KVD=1) is quantized "
                         "per token (rope_dim) or per granule (scales)")
    for name, s in zip(NAMES, (k_scale, v_scale)):
        _check_one(name, s, c.device, data_checks)
    return True


def _check_one(name: str, s, device, data_checks: bool) -> None:
    if isinstance(s, torch.Tensor):
        if s.dtype != torch.float32 or s.numel() != 1 or s.dim() > 1:
            raise ValueError(f"{name} must be a float or a float32 tensor of one element (0-d or [1]), got "
                             f"{s.dtype} of shape {list(s.shape)}")
        if s.device != torch.device(device):
            raise ValueError(f"{name} must be on the cache's device {device}, got {s.device}")
        if data_checks and not torch.compiler.is_compiling():
            value = float(s.reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive and finite, got {value}")
        return
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not (math.isfinite(s) and s > 0):
        raise ValueError(f"{name} must be a positive finite float or a float32 tensor of one element, got {s!r}")


def as_tensor(s, device) -> torch.Tensor:
    """A float32 0-d tensor of scale ``s`` (float or one-element tensor) on ``device``."""
    if isinstance(s, torch.Tensor):
        return s.reshape(())
    return torch.tensor(float(s), dtype=torch.float32, device=device)


def kernel_arg(k_scale, v_scale, device) -> torch.Tensor:
    """The kernels' float32 ``[2]``: ``(k_scale, v_scale)``, made on ``device`` (a copy of two floats, or a stack
    of two device scalars: nothing read on the host)."""
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        return torch.stack((as_tensor(k_scale, device), as_tensor(v_scale, device)))
    return torch.tensor((float(k_scale), float(v_scale)), dtype=torch.float32, device=device)

