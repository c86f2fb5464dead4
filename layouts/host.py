"""Evaluate the cache layouts to integers on the CPU (no GPU, nothing launched).

The probes are ``@cute.jit`` host functions executed on the CPU (guide recipe B): the geometry arrives
as a runtime ``int64[8]`` vector and coordinates/offsets as runtime-shaped int64 arrays, so each
(probe, view) pair is compiled once per process and serves every geometry. Offsets are element offsets
into the 6-D tensor whose shape is ``cache_shape`` (``blocks.shape`` or ``scales.shape``), so the same
element has the same offset in every view; ``token_row`` maps ``(page, slot)`` to a row index instead.

Views (coordinate order):
  ``cache``          ``(n, kv, layer, p, h, d)``   the 6-D tensor
  ``plane``          ``(n, p, h, d)``              ``get_key_cache(l).blocks`` (``kv_idx`` = 1 for V)
  ``row_view``       ``(row, h, d)``               ``PagedKVCache.row_view()``
  ``tma_page_view``  ``(p, d, h, n)``              the plane permuted for paged TMA
  ``token_row``      ``(n, p)`` -> row             ``PagedKVCache.row_idx`` once the LUT gave ``n``
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

import cutlass
import cutlass.cute as cute
from cutlass import Constexpr, Int32, Int64
from cutlass.cute.runtime import from_dlpack

from cute_kv.layouts.paged import (
    cache_layout, num_kv_rows, plane_layout, row_view_layout, tma_page_view, token_row_layout,
)

VIEWS = ("cache", "plane", "row_view", "tma_page_view", "token_row")


def _view(view: str, geometry) -> tuple[cute.Layout, object]:
    """``(layout, base offset)`` of ``view``; ``geometry`` = ``(N, KVD, L, P, H, D|G, kv_idx, layer_idx)``."""
    n, kvd, nl, p, h, d, kv_idx, layer_idx = geometry
    if view == "token_row":
        return token_row_layout(n, kvd, nl, p), 0
    cache = cache_layout(n, kvd, nl, p, h, d)
    if view == "cache":
        return cache, 0
    plane, base = plane_layout(cache, kv_idx, layer_idx)
    if view == "plane":
        return plane, base
    if view == "tma_page_view":
        return tma_page_view(plane), base
    return row_view_layout(num_kv_rows(n, kvd, nl, p), h, d), base


def _coord_of(layout: cute.Layout, offset) -> tuple:
    """Candidate coordinate of ``offset``: ``(offset // stride_i) % shape_i`` per mode.

    Exact for every offset the layout reaches when each stride is at least the span of the modes with
    smaller strides (true of all cache views); callers re-evaluate the layout to reject the rest.
    Extent-1 modes (H or KVD of MLA) get stride 0 from CuTe: their coordinate is 0, no division.
    """
    crd = []
    for i in range(cute.rank(layout)):
        extent = cute.get(layout.shape, mode=[i])
        crd.append(0 if isinstance(extent, int) and extent == 1 else
                   (offset // cute.get(layout.stride, mode=[i])) % extent)
    return tuple(crd)


def _geometry_values(geometry: cute.Tensor) -> tuple:
    return tuple(geometry[i] for i in range(8))


def _coord_row(coords: cute.Tensor, i, rank: int) -> tuple:
    return tuple(coords[i, j] for j in range(rank))


@cute.jit
def _shape_probe(view: Constexpr, geometry: cute.Tensor, shape: cute.Tensor):
    layout, _ = _view(view, _geometry_values(geometry))
    for j in cutlass.range_constexpr(cute.rank(layout)):
        shape[j] = cute.get(layout.shape, mode=[j])


@cute.jit
def _offset_probe(view: Constexpr, geometry: cute.Tensor, coords: cute.Tensor, out: cute.Tensor, count: Int32):
    layout, base = _view(view, _geometry_values(geometry))
    for i in cutlass.range(count, unroll=1):
        out[i] = base + layout(_coord_row(coords, i, cute.rank(layout)))


@cute.jit
def _coord_probe(view: Constexpr, geometry: cute.Tensor, offsets: cute.Tensor, out: cute.Tensor, count: Int32):
    layout, base = _view(view, _geometry_values(geometry))
    for i in cutlass.range(count, unroll=1):
        rel = offsets[i] - base
        for j in cutlass.range_constexpr(cute.rank(layout)):
            out[i, j] = Int64(-1)
        if rel >= 0:
            crd = _coord_of(layout, rel)
            if layout(crd) == rel:
                for j in cutlass.range_constexpr(cute.rank(layout)):
                    out[i, j] = crd[j]


def _to_cute(a: np.ndarray):
    """Every array crosses the same way at compile and call time (runtime extents and strides)."""
    return from_dlpack(a).mark_layout_dynamic(leading_dim=a.ndim - 1)


@functools.cache
def _compiled(probe: str, view: str):
    """One compile per (probe, view) for the whole process; the example arrays' extents do not matter."""
    geometry = _to_cute(np.ones(8, np.int64))
    if probe == "shape":
        return cute.compile(_shape_probe, view, geometry, _to_cute(np.zeros(6, np.int64)))
    table, vector = _to_cute(np.zeros((1, 6), np.int64)), _to_cute(np.zeros(1, np.int64))
    if probe == "offsets":
        return cute.compile(_offset_probe, view, geometry, table, vector, Int32(1))
    return cute.compile(_coord_probe, view, geometry, vector, table, Int32(1))


def _geometry(view: str, cache_shape: Sequence[int], kv_idx: int, layer_idx: int) -> np.ndarray:
    if view not in VIEWS:
        raise ValueError(f"view must be one of {VIEWS}, got {view!r}")
    shape = tuple(cache_shape)
    if len(shape) != 6 or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x <= 0 for x in shape):
        raise ValueError(f"cache_shape must be 6 positive ints [N, KVD, L, P, H, D|G], got {list(shape)}")
    if not 0 <= kv_idx < shape[1]:
        raise ValueError(f"kv_idx must be in [0, {shape[1]}), got {kv_idx}")
    if not 0 <= layer_idx < shape[2]:
        raise ValueError(f"layer_idx must be in [0, {shape[2]}), got {layer_idx}")
    return np.array([*shape, kv_idx, layer_idx], np.int64)


def view_shape(view: str, cache_shape: Sequence[int], kv_idx: int = 0, layer_idx: int = 0) -> tuple[int, ...]:
    """Shape of ``view``'s CuTe layout (e.g. ``row_view`` -> ``(num_kv_rows, H, D)``)."""
    g = _geometry(view, cache_shape, kv_idx, layer_idx)
    shape = np.full(6, -1, np.int64)
    _compiled("shape", view)(_to_cute(g), _to_cute(shape))
    return tuple(int(x) for x in shape if x >= 0)


def offsets(view: str, cache_shape: Sequence[int], coords, kv_idx: int = 0, layer_idx: int = 0) -> np.ndarray:
    """int64 ``[n]``: ``view`` evaluated at each row of ``coords`` (``[n, rank]``, or one coordinate)."""
    g = _geometry(view, cache_shape, kv_idx, layer_idx)
    extents = view_shape(view, cache_shape, kv_idx, layer_idx)
    c = np.atleast_2d(np.asarray(coords))
    if c.dtype.kind not in "iu" or c.ndim != 2 or c.shape[1] != len(extents):
        raise ValueError(f"coords must be integers of shape [n, {len(extents)}] for view {view!r}, got "
                         f"{c.dtype} {list(c.shape)}")
    bad = np.nonzero(((c < 0) | (c >= np.array(extents))).any(axis=1))[0]
    if bad.size:
        raise ValueError(f"coords[{bad[0]}] = {tuple(int(x) for x in c[bad[0]])} is outside the {view} "
                         f"shape {extents}")
    c = np.ascontiguousarray(c, np.int64)
    out = np.empty(c.shape[0], np.int64)
    if c.shape[0]:
        _compiled("offsets", view)(_to_cute(g), _to_cute(c), _to_cute(out), Int32(c.shape[0]))
    return out


def coordinates(view: str, cache_shape: Sequence[int], offsets, kv_idx: int = 0, layer_idx: int = 0) -> np.ndarray:
    """int64 ``[n, rank]``: the coordinate of each offset in ``view``; a row of -1 where ``view`` does not
    reach that offset (another plane, the gap between a plane's pages, past the end)."""
    g = _geometry(view, cache_shape, kv_idx, layer_idx)
    rank = len(view_shape(view, cache_shape, kv_idx, layer_idx))
    o = np.atleast_1d(np.asarray(offsets))
    if o.dtype.kind not in "iu" or o.ndim != 1:
        raise ValueError(f"offsets must be a 1-D array of integers, got {o.dtype} {list(o.shape)}")
    if o.size and (o.min() < 0 or o.max() >= 2**63):
        raise ValueError(f"offsets must be in [0, 2**63), got {int(o.min())}..{int(o.max())}")
    o = np.ascontiguousarray(o, np.int64)
    out = np.full((o.shape[0], rank), -1, np.int64)
    if o.shape[0]:
        _compiled("coords", view)(_to_cute(g), _to_cute(o), _to_cute(out), Int32(o.shape[0]))
    return out


def _record(sink: dict, geometry) -> None:
    for view in VIEWS:
        layout, base = _view(view, geometry)
        sink[view] = str(layout)
        if view == "plane":
            sink["plane_offset"] = str(base)


@cute.jit
def _describe(geometry: Constexpr, sink: Constexpr):
    _record(sink, geometry)


@cute.jit
def _describe_kernel(num_pages: Int64, num_layers: Int64, kv_idx: Int64, layer_idx: Int64,
                     static: Constexpr, sink: Constexpr):
    kvd, p, h, d = static
    _record(sink, (num_pages, kvd, num_layers, p, h, d, kv_idx, layer_idx))


def layout_strings(cache_shape: Sequence[int], kv_idx: int = 0, layer_idx: int = 0, *,
                   kernel: bool = False) -> dict[str, str]:
    """Each view's layout as CuTe prints it, plus ``plane_offset`` (the plane's base offset).

    ``kernel=True`` traces what a kernel sees: ``N``, ``L``, ``kv_idx`` and ``layer_idx`` runtime (``?``),
    ``KVD``, ``P``, ``H``, ``D`` static. Tracing only: nothing is executed.
    """
    g = _geometry("cache", cache_shape, kv_idx, layer_idx)
    n, kvd, nl, p, h, d, kv, layer = (int(x) for x in g)
    sink: dict[str, str] = {}
    if kernel:
        cute.compile(_describe_kernel, Int64(n), Int64(nl), Int64(kv), Int64(layer), (kvd, p, h, d), sink)
    else:
        cute.compile(_describe, (n, kvd, nl, p, h, d, kv, layer), sink)
    return sink
