"""Which GPU architecture to compile for: ``CUTE_DSL_ARCH`` when set (CI compiles without a GPU), else the device's."""

from __future__ import annotations

import os

SUPPORTED_ARCHS = ("sm_90a", "sm_100a")


def target_arch(device=None) -> str:
    """``sm_90a`` (Hopper) or ``sm_100a`` (Blackwell); raises for anything else."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: set CUTE_DSL_ARCH=sm_90a or sm_100a to compile without one")
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}a"
    if arch not in SUPPORTED_ARCHS:
        raise RuntimeError(f"cute-kv kernels target {SUPPORTED_ARCHS}, not {arch}")
    return arch
