"""Scratch memory of the fused-QKV kernels' reductions across CTAs (MLA's latent, wide heads, split-K): float32 rows
and int32 arrival counters that are zero between launches."""

from __future__ import annotations

import torch

_HELD: dict = {}


def scratch(device, name, rows: int, cols: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float32 [>= rows, cols], int32 [>= counters])`` for ``name`` on ``device`` and its current stream.

    Cached, grown by powers of two; the counters are zeroed once, here (every launch leaves them at zero: the last
    arriver resets its own). A launch sizes nothing else, so a CUDA graph captures these pointers: a pair that a
    larger one replaces stays alive (the sum is under twice the largest). Launches sharing a stream run in order;
    launches on different streams get different buffers."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    held = _HELD.setdefault((device, stream, name, cols), [])
    if not held or held[-1][0].shape[0] < rows or held[-1][1].numel() < counters:
        grow = lambda n, have: max(1 << max(n - 1, 0).bit_length(), have)  # noqa: E731
        have_rows, have_counters = (held[-1][0].shape[0], held[-1][1].numel()) if held else (0, 0)
        held.append((torch.empty((grow(rows, have_rows), cols), dtype=torch.float32, device=device),
                     torch.zeros(grow(counters, have_counters), dtype=torch.int32, device=device)))
    return held[-1]
