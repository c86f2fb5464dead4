"""CuTe layouts of a rope-aware FP8 MLA plane (``cute_kv/rope_aware.py``): the three views a kernel reads.

A plane's row view is ``[num_kv_rows, row_bytes]`` fp8 (H = 1, ``row_bytes = padded_depth + 2*rope_dim``). Each view
starts at the plane's base (``paged.plane_layout``'s offset), in its own element type:

  ``content``  fp8   ``(rows, padded_depth):(row_bytes, 1)``       bytes ``[0, padded_depth)`` of each row
  ``rope``     bf16  ``(rows, rope_dim):(row_bytes / 2, 1)``        from ``padded_depth / 2`` bf16 elements on (byte
               ``padded_depth``), the pointer MAX's rope TMA tile takes (``blocks.ptr + padded_depth`` bytes)
  ``scales``   f32   ``(rows):(1)``                                 one scale per token: the scale index is the row

``padded_depth`` is a multiple of 64, so the rope tail of every row is 16-byte aligned when the blocks are.
Builders take Python ints (static) or ``Int32``/``Int64`` values (runtime) and emit IR like ``paged.py``'s;
``describe`` evaluates them on the host (nothing runs on a GPU).
"""

from __future__ import annotations

from typing import Sequence

import cutlass.cute as cute
from cutlass import Constexpr

from cute_kv.layouts.paged import _wide, num_kv_rows

VIEWS = ("content", "rope", "scales")
UNIT_BYTES = {"content": 1, "rope": 2, "scales": 4}


def content_layout(num_rows, row_bytes: int, padded_depth: int) -> cute.Layout:
    """fp8 ``(rows, padded_depth):(row_bytes, 1)``: the e4m3 content of each row."""
    return cute.make_layout((_wide(num_rows), padded_depth), stride=(row_bytes, 1))


def rope_layout(num_rows, row_bytes: int, rope_dim: int) -> cute.Layout:
    """bf16 ``(rows, rope_dim):(row_bytes // 2, 1)``, from ``rope_offset`` bf16 elements past the plane's base."""
    return cute.make_layout((_wide(num_rows), rope_dim), stride=(row_bytes // 2, 1))


def rope_offset(padded_depth: int) -> int:
    """bf16 elements from a plane's base to its first rope value (byte ``padded_depth``)."""
    return padded_depth // 2


def scale_layout(num_rows) -> cute.Layout:
    """float32 ``(rows):(1)``: per-token scales indexed by row (MAX's flat ``[1, num_kv_rows]`` scale view)."""
    return cute.make_layout(_wide(num_rows))


def views(num_pages, num_layers, page_size: int, padded_depth: int, rope_dim: int) -> dict:
    """``{view: (layout, offset in the view's elements from the plane's base)}`` of an MLA plane (KVD = 1)."""
    rows = num_kv_rows(num_pages, 1, num_layers, page_size)
    row_bytes = padded_depth + 2 * rope_dim
    return {"content": (content_layout(rows, row_bytes, padded_depth), 0),
            "rope": (rope_layout(rows, row_bytes, rope_dim), rope_offset(padded_depth)),
            "scales": (scale_layout(rows), 0)}


@cute.jit
def _describe(geometry: Constexpr, coords: Constexpr, sink: Constexpr):
    for name, (layout, base) in views(*geometry).items():
        sink[name] = str(layout)
        sink[f"{name}_bytes"] = [(base + layout(c[0] if len(c) == 1 else c)) * UNIT_BYTES[name]
                                 for c in coords[name]]


def describe(num_pages: int, num_layers: int, page_size: int, padded_depth: int, rope_dim: int,
             coords: dict[str, Sequence[tuple]] | None = None) -> dict:
    """Each view's layout as CuTe prints it, and with ``coords`` (``{view: [(row, col) | (row,), ...]}``) the BYTE
    offset of each coordinate from the plane's base (``{view}_bytes``)."""
    coords = {name: [tuple(c) for c in (coords or {}).get(name, ())] for name in VIEWS}
    sink: dict = {}
    cute.compile(_describe, (num_pages, num_layers, page_size, padded_depth, rope_dim), coords, sink)
    return sink
