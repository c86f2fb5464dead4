"""Compiled kernels on disk: one object file per compile-time key, shared by processes and machines.

A kernel compiled on a CPU machine for ``sm_90a`` / ``sm_100a`` (``python -m cute_kv prebuild``) is exported as a
relocatable object (host launcher + cubin, TVM-FFI entry point) and loaded by a GPU server in milliseconds instead
of being traced and compiled again. Enabled by ``CUTE_KV_CACHE_DIR``; without it nothing touches the disk.

An entry's file name is a digest of the compile-time key, the arch, the host ISA, the versions of the CuTe DSL and of
the libraries kernels are traced with (``TRACED_LIBRARIES``) and the source of every module kernels are traced from
(``KERNEL_SOURCES``), so editing a kernel or upgrading the DSL never serves a stale binary: it is a miss, and the
fresh compile is written beside the old entry.

The host launcher in an entry is built for the ISA's baseline CPU (x86-64 with SSE2, or generic AArch64), not for
the compiling machine's CPU, which the DSL targets by default: a build machine with AVX-512 would otherwise emit
launchers that fault on a server without it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import tempfile
from pathlib import Path
from typing import Callable, Hashable, Optional

CACHE_DIR_ENV = "CUTE_KV_CACHE_DIR"
# Packages and modules whose code runs when a kernel is traced (the kernels import the lookup-table geometry).
KERNEL_SOURCES = ("cute_kv.kernels", "cute_kv.layouts", "cute_kv.row_indices")
TRACED_LIBRARIES = ("quack-kernels",)  # distributions whose device code is traced into ours (GEMMs, st.async)
_SYMBOL = "cute_kv_kernel"  # every object exports one function; each is loaded into its own engine
# LLVM (target_cpu, target_features) of the host functions per ISA: each ISA's baseline.
_PORTABLE_HOST = {"x86_64": ("x86-64", "+sse2"), "aarch64": ("generic", "+neon")}


def cache_dir() -> Optional[Path]:
    """The disk cache directory (``$CUTE_KV_CACHE_DIR``), or None when disk caching is off."""
    path = os.environ.get(CACHE_DIR_ENV)
    return Path(path) if path else None


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """Digest of what decides the generated code besides the key: the DSL version, the host ISA, the versions of
    ``TRACED_LIBRARIES`` and the source of every module kernels are traced from (``KERNEL_SOURCES``)."""
    import cutlass

    h = hashlib.sha256(f"{getattr(cutlass, '__version__', 'unknown')} {platform.machine()}".encode())
    for dist in TRACED_LIBRARIES:
        h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
    for name in KERNEL_SOURCES:
        module = importlib.import_module(name)
        root = Path(module.__file__).parent
        files = sorted(root.rglob("*.py")) if hasattr(module, "__path__") else [Path(module.__file__)]
        for path in files:
            h.update(f"{name}:{path.relative_to(root)}".encode())
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

    try:
        return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), _SYMBOL)
    except Exception as e:  # noqa: BLE001 - whatever the loader raises, name the entry and the way out
        raise RuntimeError(f"cannot load the cached kernel {path} for {key!r} on {arch} ({type(e).__name__}: {e}); "
                           f"delete the file to recompile it, or unset {CACHE_DIR_ENV}") from e


def store(key: Hashable, arch: str, compiled_fn, directory: Path) -> Path:
    """Write ``compiled_fn`` (from ``cute.compile(..., --enable-tvm-ffi)``) for ``(key, arch)``; each file atomically
    (``write_atomic``)."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = entry_name(key, arch)
    _portable_host_code(compiled_fn.ir_module)
    write_atomic(directory / f"{stem}.o", lambda tmp: compiled_fn.export_to_c(str(tmp), function_name=_SYMBOL))
    # What the entry holds, for people listing the directory (never read back).
    info = json.dumps({"key": repr(key), "arch": arch, "code": code_version()})
    write_atomic(directory / f"{stem}.json", lambda tmp: tmp.write_text(info))
    return directory / f"{stem}.o"


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` fills a new file beside ``path`` that then replaces ``path`` in one step, so concurrent writers
    (tensor-parallel ranks, parallel test processes compiling the same key) and readers never see a partial file; a
    write that fails leaves ``path`` as it was and no temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _portable_host_code(ir_module) -> None:
    """Pin every host function of the compiled module to the ISA's baseline CPU (the functions' own target
    attributes override the build machine's CPU in code generation). The kernel's cubin is not touched."""
    target = _PORTABLE_HOST.get(platform.machine())
    if target is None:
        return
    from cutlass._mlir import ir

    with ir_module.context:
        cpu, features = ir.StringAttr.get(target[0]), ir.Attribute.parse(f'#llvm.target_features<["{target[1]}"]>')

        def pin(op):
            if op.name == "llvm.func":
                op.attributes["target_cpu"] = cpu
                op.attributes["target_features"] = features
            return ir.WalkResult.ADVANCE

        ir_module.operation.walk(pin)
