"""Compiled kernels on disk: one object file per compile-time key, shared by processes and machines.

A kernel compiled on a CPU machine for ``sm_90a`` / ``sm_100a`` (``python -m cute_kv prebuild``) is exported as a
relocatable object (host launcher + cubin, TVM-FFI entry point) and loaded by a GPU server in milliseconds instead
of being traced and compiled again. Enabled by ``CUTE_KV_CACHE_DIR``; without it nothing touches the disk.

An entry's file name is a digest of the compile-time key, the arch, the CuTe DSL version and the source of every
kernel module (``cute_kv.kernels`` and ``cute_kv.layouts``), so editing a kernel or upgrading the DSL never serves
a stale binary: it is a miss, and the fresh compile is written beside the old entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Hashable, Optional

CACHE_DIR_ENV = "CUTE_KV_CACHE_DIR"
_SYMBOL = "cute_kv_kernel"  # every object exports one function; each is loaded into its own engine


def cache_dir() -> Optional[Path]:
    """The disk cache directory (``$CUTE_KV_CACHE_DIR``), or None when disk caching is off."""
    path = os.environ.get(CACHE_DIR_ENV)
    return Path(path) if path else None


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """Digest of what decides the generated code besides the key: the DSL version and the kernel sources."""
    import cutlass

    from cute_kv import kernels, layouts

    h = hashlib.sha256(getattr(cutlass, "__version__", "unknown").encode())
    for package in (kernels, layouts):
        root = Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def entry_name(key: Hashable, arch: str) -> str:
    """File stem of ``(key, arch)``: keys are tuples of str/int/bool/None, whose repr is the same in every process."""
    return hashlib.sha256(repr((key, arch, code_version())).encode()).hexdigest()[:32]


def load(key: Hashable, arch: str, directory: Path):
    """The kernel stored for ``(key, arch)`` as a callable (positional arguments, as the compiled function takes
    them), or None on a miss."""
    path = directory / f"{entry_name(key, arch)}.o"
    if not path.is_file():
        return None
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), _SYMBOL)


def store(key: Hashable, arch: str, compiled_fn, directory: Path) -> Path:
    """Write ``compiled_fn`` (from ``cute.compile(..., --enable-tvm-ffi)``) for ``(key, arch)``; atomic, so
    concurrent writers (tensor-parallel ranks compiling the same key) and readers never see a partial file."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = entry_name(key, arch)
    fd, tmp = tempfile.mkstemp(suffix=".o", dir=directory)
    os.close(fd)
    try:
        compiled_fn.export_to_c(tmp, function_name=_SYMBOL)
        os.replace(tmp, directory / f"{stem}.o")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    # What the entry holds, for people listing the directory (never read back).
    (directory / f"{stem}.json").write_text(json.dumps({"key": repr(key), "arch": arch, "code": code_version()}))
    return directory / f"{stem}.o"
