"""Compiled kernels, cached by compile-time key: a second request with the same key does not recompile; and the arch
they are compiled for.

Kernels compile from fake tensors (no GPU needed) with TVM-FFI enabled and the caller's current stream, so the
cached object is called with torch tensors directly (guide §1.6, ~7 µs of host time per call).
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Hashable

import cutlass.cute as cute

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


_cache: dict[Hashable, object] = {}
_compiles = 0


def compiled(key: Hashable, build: Callable[[], tuple], arch: str):
    """The kernel compiled for ``(key, arch)``; ``build()`` returns ``(jit_function, *fake_args)`` on a miss."""
    global _compiles
    full_key = (key, arch)
    fn = _cache.get(full_key)
    if fn is None:
        jit_fn, *args = build()
        fn = cute.compile(jit_fn, *args, options=f"--gpu-arch {arch} --enable-tvm-ffi")
        _compiles += 1
        _cache[full_key] = fn
    return fn


def cache_info() -> dict:
    """``{"entries": ..., "compiles": ...}``: compiles only grow on a miss."""
    return {"entries": len(_cache), "compiles": _compiles}


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
