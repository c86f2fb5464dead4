"""``paged_attention`` over an MLA cache: which kernel serves the call on each arch (``MlaDecodeSm100`` on
``sm_100a``), or why the reference runs."""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.ops import paths

OP = "paged_attention"


def plan(collection, q, arch: str, scale: Optional[float] = None, softcap: Optional[float] = None,
         sinks: Optional[torch.Tensor] = None, return_lse: bool = False, mla_v_dim: Optional[int] = None,
         window: Optional[int] = None) -> paths.KernelPath:
    if arch == "sm_100a":
        from cute_kv.ops import mla_decode_sm100

        return mla_decode_sm100.plan(collection, q, arch, scale, softcap, sinks, return_lse, mla_v_dim, window, OP)
    return paths.reference(OP, f"MLA caches have no attention kernel on {arch} yet", arch)
