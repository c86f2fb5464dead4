"""The archs cute-kv compiles for, free of CuTe DSL (the torch side imports it to route calls).

Hopper is ``sm_90a``. Blackwell datacenter parts are ``sm_100a`` (B200, GB200) and ``sm_103a`` (B300, GB300): the
same tcgen05 / TMEM / TMA instruction set, 227 KiB of shared memory per CTA and 512 TMEM columns per SM, so one set
of Blackwell kernels serves both, compiled once per arch (an ``sm_100a`` cubin does not run on ``sm_103``: ``a``
targets are not forward compatible).
"""

from __future__ import annotations

SM90 = "sm_90a"
BLACKWELL = ("sm_100a", "sm_103a")
ARCHS = (SM90, *BLACKWELL)
# SMs of the GPU a CPU dry run stands in for (H100 SXM / H200, B200, B300): they decide only whether a launch
# splits the keys; on a GPU the device's own count is used.
SM_COUNTS = {"sm_90a": 132, "sm_100a": 148, "sm_103a": 148}


def is_blackwell(arch) -> bool:
    return arch in BLACKWELL


def generation(arch: str) -> str:
    """The kernel set ``arch`` runs: ``"sm_90a"`` or ``"sm_100a"`` (every Blackwell arch)."""
    return "sm_100a" if is_blackwell(arch) else arch
