"""The attention kernel families, one ``Backend`` each: the table ``paged_attention`` dispatches through
(``paged_attention.BACKENDS``) and the sparse op's backend (``mla_decode_sm100.SPARSE``).

A backend's ``plan(collection, q, arch, **arguments)`` gives its ``paths.KernelPath`` (the kernel's compile-time key,
or why the reference runs), ``compile_units(key, arch)`` the kernels that key launches (``prebuild`` compiles them
ahead), ``launcher(key, arch)`` the ``run(...)`` built once per key, and ``launch_workspace(key, q, ...)`` a
launch's grid and split-KV partials (made per call, or once by a ``StepPlan``); the sparse backend's take the op's
``indices`` as well (``mla_decode_sm100.plan_sparse``, ``launch_sparse``, ``sparse_workspace``). Family modules
import this one and shared helpers (``splits``, ``kernel_args``, ``units``, ``vectors``, ``paths``), never an op entry
or each other: the ``ops`` modules import no cycle (``tests/test_ops_imports.py``).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

OP = "paged_attention"


class Family(enum.Enum):
    """A kernel family (its value: the kernel class and mode)."""

    SM90_MHA = "PagedAttention"
    SM100_MHA = "PagedAttentionSm100"
    SM90_MLA = "MLADecode"
    SM100_MLA = "MlaDecodeSm100"
    SPARSE_MLA = "MlaDecodeSm100 (sparse)"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One family's host side (module docstring); ``launcher`` and ``compile_units`` take a key its ``plan`` gave."""

    family: Family
    name: str  # the kernel class
    plan: Callable
    compile_units: Callable[[tuple, str], list[tuple]]
    launcher: Callable[[tuple, str], Callable]
    launch_workspace: Callable[..., tuple]
