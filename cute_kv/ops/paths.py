"""Which path a call takes, a CuTe DSL kernel or the PyTorch reference, and why.

Each op module decides in one pure host function, ``plan(..., arch)``, from its arguments and the target arch (so
the decision can be asked for any arch on any machine). The op's dispatch, ``explain`` and strict mode all read that
decision. On CUDA a reference fallback is never silent: it warns once per (op, reason) with ``FallbackWarning``, or
raises ``FallbackError`` in strict mode (``CUTE_KV_STRICT=1``, or ``set_strict(True)``). Off CUDA the reference is
the backend, not a fallback.

``dry_run(arch, sm_count)`` stands a GPU in for the device queries (``device_arch``, and the SM counts launchers
size grids by), so a call on any tensors plans and prepares its launches as on that GPU while compiling and
launching nothing: the compile keys it asks for are what ``prebuild --selftest`` compiles ahead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import warnings
from typing import Callable, Iterator, Optional

KERNEL, REFERENCE = "kernel", "reference"


class FallbackWarning(UserWarning):
    """A call on CUDA tensors ran the PyTorch reference because no kernel serves its arguments."""


class FallbackError(RuntimeError):
    """Strict mode: a call on CUDA tensors would have run the PyTorch reference."""


@dataclasses.dataclass(frozen=True)
class KernelPath:
    """``path`` is ``"kernel"`` (``kernel`` names the class, ``key`` its compile-time key) or ``"reference"``;
    ``reason`` says why, in words."""

    op: str
    path: str
    reason: str
    arch: Optional[str] = None
    kernel: Optional[str] = None
    key: Optional[tuple] = None


def kernel(op: str, name: str, key: tuple, arch: str) -> KernelPath:
    return KernelPath(op, KERNEL, f"{name} serves these arguments on {arch}", arch, name, key)


def reference(op: str, reason: str, arch: Optional[str]) -> KernelPath:
    return KernelPath(op, REFERENCE, reason, arch)


def off_cuda(op: str, device) -> KernelPath:
    return reference(op, f"tensors on {device}: the PyTorch reference is the backend off CUDA", None)


@dataclasses.dataclass(frozen=True)
class Target:
    """The GPU a dry run stands in: its arch and SM count."""

    arch: str
    sm_count: int


_dry: Optional[Target] = None


@contextlib.contextmanager
def dry_run(arch: str, sm_count: int) -> Iterator[list]:
    """Calls inside plan for ``arch`` on any device and launch nothing; yields the ``(key, build, arch)`` of every
    kernel they ask for (``compile_cache.recording``). Fallbacks are not reported: nothing runs on a GPU."""
    global _dry
    from cute_kv.kernels.compile_cache import SUPPORTED_ARCHS, recording

    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS}, got {arch!r}")
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count <= 0:
        raise ValueError(f"sm_count must be a positive int, got {sm_count!r}")
    saved, _dry = _dry, Target(arch, sm_count)
    try:
        with recording(dry=True) as units:
            yield units
    finally:
        _dry = saved


def dry_target() -> Optional[Target]:
    """The GPU a ``dry_run`` stands in, or None."""
    return _dry


def device_arch(device) -> Optional[str]:
    """The arch of ``device`` when it is a CUDA device (``sm_90a``, ``sm_100a``, or one no kernel targets), or the
    arch a ``dry_run`` stands in; None off CUDA (the reference is the backend there)."""
    if _dry is not None:
        return _dry.arch
    if not on_cuda(device):
        return None
    from cute_kv.kernels.compile_cache import cuda_arch

    return cuda_arch(device)


def on_cuda(device) -> bool:
    return device.type == "cuda"


def no_kernels(op: str, arch: str) -> KernelPath:
    """The reference path on a CUDA arch no cute-kv kernel is compiled for."""
    from cute_kv.kernels.compile_cache import SUPPORTED_ARCHS

    return reference(op, f"no cute-kv kernel targets {arch} (they are compiled for {' and '.join(SUPPORTED_ARCHS)})",
                     arch)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_strict: Optional[bool] = None
_warned: set[tuple[str, str]] = set()


def set_strict(on: Optional[bool]) -> None:
    """Strict mode on or off for this process; None returns to ``CUTE_KV_STRICT`` (off unless set to 1)."""
    global _strict
    _strict = on


def is_strict() -> bool:
    if _strict is not None:
        return _strict
    return os.environ.get("CUTE_KV_STRICT", "0").strip().lower() not in ("", "0", "false", "no", "off")


def route(op: str, device, plan: Callable[[str], KernelPath]) -> Optional[KernelPath]:
    """The kernel path to launch for a call of ``op`` on ``device``, or None for the reference: off CUDA silently,
    on CUDA after ``report``. ``plan(arch)`` is the op's decision (on an arch with kernels). Called before anything
    is written."""
    from cute_kv.kernels.compile_cache import SUPPORTED_ARCHS

    arch = device_arch(device)
    if arch is None:
        return None
    path = plan(arch) if arch in SUPPORTED_ARCHS else no_kernels(op, arch)
    if path.path == KERNEL:
        return path
    if _dry is None:
        report(path)
    return None


def report(path: KernelPath) -> None:
    """A reference fallback on CUDA: ``FallbackError`` in strict mode, else a ``FallbackWarning`` the first time
    this (op, reason) is seen."""
    message = f"cute_kv.{path.op} runs the PyTorch reference on CUDA ({path.arch}): {path.reason}"
    if is_strict():
        raise FallbackError(f"{message}. Strict mode (CUTE_KV_STRICT=1 or cute_kv.set_strict(True)) forbids the "
                            f"fallback; cute_kv.explain(...) says which path a call takes")
    if (path.op, path.reason) not in _warned:
        _warned.add((path.op, path.reason))
        warnings.warn(f"{message} (warned once per reason; CUTE_KV_STRICT=1 makes it an error)", FallbackWarning,
                      stacklevel=_caller_level())


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside this package: the user's call."""
    level, frame = 2, sys._getframe(2)  # 1: report, 2: its caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    return level


def planned(op: str, device, arch: Optional[str], plan: Callable[[str], KernelPath]) -> KernelPath:
    """``explain``'s answer: ``plan(arch)`` for a given arch, else for ``device``'s (off CUDA: the reference)."""
    from cute_kv.kernels.compile_cache import SUPPORTED_ARCHS

    if arch is None:
        arch = device_arch(device)
        if arch is None:
            return off_cuda(op, device)
        if arch not in SUPPORTED_ARCHS:
            return no_kernels(op, arch)
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(f"arch must be one of {SUPPORTED_ARCHS} or None (the tensors' device), got {arch!r}")
    return plan(arch)
