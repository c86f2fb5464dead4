"""The compiler builtins the CuTe DSL's host JIT links against, where the machine's libgcc_s lacks one.

Kernel code run on the host (tests that execute a kernel's own tile code on the CPU) lowers a float32 -> bfloat16
conversion to a call to ``__truncsfbf2``, which libgcc_s exports only from GCC 13 on: on Debian 12 (GCC 12) the JIT
fails with "Symbols not found: [ __truncsfbf2 ]". ``provide()`` builds the builtin with the machine's C compiler and
loads it process-wide (``RTLD_GLOBAL``), so the JIT resolves it as it would from a newer libgcc_s. It rounds to
nearest even and keeps NaN a (quiet) NaN of the same sign, as libgcc does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

SYMBOL = "__truncsfbf2"
# The result is a bfloat16 in the low 16 bits of the first floating-point return register (xmm0 / h0), as the
# target ABIs return __bf16; GCC 12 has no __bf16 type, but its _Float16 travels in the same register.
SOURCE = r"""
#include <stdint.h>
#include <string.h>

_Float16 __truncsfbf2(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint16_t b;
    if ((u & 0x7fffffffu) > 0x7f800000u)
        b = (uint16_t)((u >> 16) | 0x0040u);                 /* NaN: keep sign and payload top, force quiet */
    else
        b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); /* round to nearest, ties to even */
    _Float16 r;
    memcpy(&r, &b, sizeof r);
    return r;
}
"""


def find():
    """The builtin as loaded in this process (from libgcc_s or from ``provide()``), or None."""
    for name in (None, ctypes.util.find_library("gcc_s")):
        try:
            return getattr(ctypes.CDLL(name), SYMBOL)
        except (OSError, AttributeError):
            continue
    return None


def missing() -> bool:
    """True when no library loaded in this process (libgcc_s included) defines the builtin."""
    return find() is None


def provide(cache_dir: Optional[str] = None) -> Optional[str]:
    """Make ``__truncsfbf2`` visible to the host JIT. Returns the shared object loaded, or None when the machine
    already has the builtin. Raises when it is missing and no C compiler is found."""
    if not missing():
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError(f"{SYMBOL} is missing from libgcc_s (GCC < 13) and no C compiler (cc) is installed to "
                           f"build it: install gcc (apt-get install gcc)")
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    directory = Path(cache_dir or tempfile.gettempdir())
    lib = directory / f"cute_kv_host_builtins_{digest}.so"
    if not lib.exists():
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as work:
            src = Path(work) / "builtins.c"
            src.write_text(SOURCE)
            tmp = Path(work) / lib.name
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True,
                           capture_output=True, text=True)
            os.replace(tmp, lib)  # atomic: parallel test processes may build it at once
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    return str(lib)
