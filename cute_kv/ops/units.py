"""Compile units of a split-KV attention op: the attention kernel of a ``plan`` key, then the combine of its splits.

Each op module names only its kernel class; the combine's compile key (shared by every op that merges rows of the
same dtype, heads and width) is built here once, so ``prebuild`` and the launchers compile the same units.
"""

from __future__ import annotations

from typing import Callable


def with_combine(key: tuple, kernel_class: Callable[[], type], dtype_name: str, num_q_heads: int, v_dim: int,
                 return_lse: bool) -> list[tuple]:
    """``[(key, build), (combine key, build_combine)]``; ``kernel_class()`` imports the kernel class late, so a plan
    never imports the DSL."""

    def build():
        kernel = kernel_class()(*key[1:])
        return kernel, *kernel.fake_args()

    def build_combine():
        from cute_kv.kernels.attention.combine import AttentionCombine

        kernel = AttentionCombine(dtype_name, num_q_heads, v_dim, return_lse)
        return kernel, *kernel.fake_args()

    return [(key, build), (("attention_combine", dtype_name, num_q_heads, v_dim, return_lse), build_combine)]
