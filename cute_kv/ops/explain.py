"""``cute_kv.explain``: which path a call of an op takes, over every op module (each decides with ``paths``, so
this registry is its own module: ``paths`` imports no op)."""

from __future__ import annotations

from typing import Optional

from cute_kv.ops import fused_qkv, gather_kv, paged_attention, paths, sparse_mla_attention, store_kv

MODULES = {m.OP: m for m in (store_kv, fused_qkv, paged_attention, gather_kv, sparse_mla_attention)}


def explain(op, *args, arch: Optional[str] = None, **kwargs) -> paths.KernelPath:
    """Which path ``op(*args, **kwargs)`` takes and why, without running it (the arguments are checked as the op
    checks them).

    ``op`` is an entry point (``cute_kv.paged_attention``) or its name (``"paged_attention"``). ``arch``
    (``"sm_90a"`` / ``"sm_100a"``) asks what a GPU of that arch would run, on any machine: tensors may then be on
    the CPU. Without it, the tensors' device decides (off CUDA: the reference).
    """
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    if name not in MODULES:
        raise ValueError(f"op must be one of {sorted(MODULES)} (or the function itself), got {op!r}")
    return MODULES[name].explain(*args, arch=arch, **kwargs)
