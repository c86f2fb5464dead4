"""Compiled kernels, cached by compile-time key: a second request with the same key does not recompile; and the arch
they are compiled for.

With ``CUTE_KV_CACHE_DIR`` set, a miss first looks on disk (``disk_cache``: kernels compiled ahead with
``python -m cute_kv prebuild``, or by an earlier process) and every compile is written there.

``recording()`` lists the kernels calls ask for (what ``selftest`` reports as a call's path); a dry one compiles
nothing and hands back a launch that does nothing (``cute_kv.ops.paths.dry_run``: the keys a call would compile).

Kernels compile from fake tensors (no GPU needed) with TVM-FFI enabled and the caller's current stream, so the
cached object is called with torch tensors directly (~7 µs of host time per call).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Callable, Hashable, Iterator, Optional

import cutlass.cute as cute

from cute_kv.kernels import disk_cache
from cute_kv.kernels.archs import ARCHS as SUPPORTED_ARCHS


_overridden: set[tuple[str, str]] = set()


def target_arch(device=None) -> str:
    """``sm_90a`` (Hopper), ``sm_100a`` or ``sm_103a`` (Blackwell); raises for anything else.

    With a CUDA device its arch wins (``cuda_arch``); ``CUTE_DSL_ARCH`` is for compiling without one.
    """
    arch = cuda_arch(device)
    if arch is None:
        arch = os.environ.get("CUTE_DSL_ARCH")
        if arch is None:
            raise RuntimeError(f"no CUDA device: set CUTE_DSL_ARCH to one of {SUPPORTED_ARCHS} to compile without one")
    if arch not in SUPPORTED_ARCHS:
        raise RuntimeError(f"cute-kv kernels target {SUPPORTED_ARCHS}, not {arch}")
    return arch


def cuda_arch(device=None) -> Optional[str]:
    """The CUDA device's arch, ``sm_{major}{minor}a`` (one of ``SUPPORTED_ARCHS`` or not), None without CUDA.

    A kernel compiled for another arch would not run, or run the wrong code, so a ``CUTE_DSL_ARCH`` that differs only
    warns (once per setting and device: this runs on every op call).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    arch = f"sm_{major}{minor}a"
    env = os.environ.get("CUTE_DSL_ARCH")
    if env is not None and env != arch and (env, arch) not in _overridden:
        _overridden.add((env, arch))
        warnings.warn(f"CUTE_DSL_ARCH={env} ignored: the CUDA device is {arch} (unset CUTE_DSL_ARCH; it is "
                      f"for compiling without a device)", RuntimeWarning, stacklevel=3)
    return arch


_cache: dict[Hashable, object] = {}
_compiles = 0
_disk_loads = 0
_recordings: list[tuple[list, bool]] = []  # (units asked for, dry), innermost last


@contextlib.contextmanager
def recording(dry: bool = False) -> Iterator[list]:
    """A list that fills with the ``(key, build, arch)`` of every ``compiled`` call made inside (repeats included);
    ``dry``: nothing is compiled, and the kernel handed back launches nothing."""
    units: list = []
    _recordings.append((units, dry))
    try:
        yield units
    finally:
        _recordings.pop()  # contexts nest


def _no_launch(*args) -> None:
    """A dry recording's kernel."""


def compiled(key: Hashable, build: Callable[[], tuple], arch: str):
    """The kernel compiled for ``(key, arch)``; ``build()`` returns ``(jit_function, *fake_args)`` on a miss
    (in memory, then on disk when ``CUTE_KV_CACHE_DIR`` is set)."""
    global _compiles, _disk_loads
    if _recordings:
        for units, _ in _recordings:
            units.append((key, build, arch))
        if _recordings[-1][1]:
            return _no_launch
    full_key = (key, arch)
    fn = _cache.get(full_key)
    if fn is None:
        directory = disk_cache.cache_dir()
        fn = None if directory is None else disk_cache.load(key, arch, directory)
        if fn is not None:
            _disk_loads += 1
        else:
            jit_fn, *args = build()
            fn = cute.compile(jit_fn, *args, options=f"--gpu-arch {arch} --enable-tvm-ffi")
            _compiles += 1
            if directory is not None:
                disk_cache.store(key, arch, fn, directory)
        _cache[full_key] = fn
    return fn


def cache_info() -> dict:
    """``{"entries": ..., "compiles": ..., "disk_loads": ...}``: compiles and disk loads only grow on a miss."""
    return {"entries": len(_cache), "compiles": _compiles, "disk_loads": _disk_loads}


def compile_ptx(build: Callable[[], tuple], arch: str) -> str:
    """PTX of one uncached compile (for tests that check what a kernel claims to emit)."""
    return compile_uncached(build, arch).__ptx__


def compile_uncached(build: Callable[[], tuple], arch: str):
    """One uncached compile that keeps its PTX (``__ptx__``) beside the host IR (``ir_module``: the launch)."""
    jit_fn, *args = build()
    saved = os.environ.get("CUTE_DSL_DISABLE_FILE_CACHING")
    os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = "1"  # a file-cache hit would dump nothing
    try:
        with tempfile.TemporaryDirectory() as dump:  # the dump directory must exist before compiling
            return cute.compile(jit_fn, *args, options=f"--gpu-arch {arch} --keep-ptx --dump-dir {dump}")
    finally:
        if saved is None:
            del os.environ["CUTE_DSL_DISABLE_FILE_CACHING"]
        else:
            os.environ["CUTE_DSL_DISABLE_FILE_CACHING"] = saved
