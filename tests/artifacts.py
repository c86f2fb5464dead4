"""Compiled kernels for the compile and SASS gates, one compile per kernel per test run.

The PTX gates (``compile`` marker), the resource gate (``sass``) and the barrier accounting all read the same
kernels; compiling each once per test, per file or per xdist process would compile most of them several times.
``compiled(kernel, arch)`` keys a kernel by its construction (the class and its attributes, recursively), so the
same kernel reached from the catalog or built by a test is one entry. Entries live in memory and in a directory
shared by the run's processes (``CUTE_KV_TEST_ARTIFACTS``, made by conftest); a lock per entry makes a process wait
for another's compile of the same kernel instead of repeating it.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from cute_kv.kernels import compile_cache

DIR_ENV = "CUTE_KV_TEST_ARTIFACTS"


class Artifact(NamedTuple):
    ptx: str
    host_ir: str  # the host launch (threads, dynamic shared memory)


_memory: dict[str, Artifact] = {}
compiles = 0  # this process's compiles (tests check that a second request compiles nothing)


def describe(obj) -> str:
    """A canonical text of what a kernel is built from: stable across processes (no addresses, sorted fields)."""
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    if obj is None or isinstance(obj, (bool, int, float, str, enum.Enum)):
        return repr(obj)
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}({', '.join(map(describe, obj))})"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in sorted(obj.items(), key=repr)) + "}"
    fields = vars(obj) if hasattr(obj, "__dict__") else None
    if fields is None:
        raise TypeError(f"cannot key a kernel attribute of type {type(obj).__name__}: {obj!r}")
    return f"{describe(type(obj))}({', '.join(f'{k}={describe(v)}' for k, v in sorted(fields.items()))})"


def _build(kernel):
    """``(jit function, *fake args)``: kernels that wrap a library GEMM build themselves, others are the function."""
    return kernel.build() if hasattr(kernel, "build") else (kernel, *kernel.fake_args())


def _directory() -> Path:
    if not os.environ.get(DIR_ENV):  # outside pytest's conftest: this process only
        os.environ[DIR_ENV] = tempfile.mkdtemp(prefix="cute-kv-artifacts-")
    return Path(os.environ[DIR_ENV])


def compiled(kernel, arch: str) -> Artifact:
    """PTX and host IR of ``kernel`` compiled for ``arch``, compiled at most once in this test run."""
    global compiles
    digest = hashlib.sha256(f"{describe(kernel)} {arch}".encode()).hexdigest()[:24]
    art = _memory.get(digest)
    if art is not None:
        return art
    directory = _directory()
    ptx_file, ir_file = directory / f"{digest}.ptx", directory / f"{digest}.host.mlir"
    with open(directory / f"{digest}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process compiling this kernel: wait for its files
        if not ir_file.exists():
            fn = compile_cache.compile_uncached(lambda: _build(kernel), arch)
            compiles += 1
            for path, text in ((ptx_file, fn.__ptx__), (ir_file, str(fn.ir_module))):
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)  # the IR last: its presence says the entry is whole
    art = _memory[digest] = Artifact(ptx_file.read_text(), ir_file.read_text())
    return art
