"""CuTe layouts of MAX's paged KV cache and of the views kernels address it through.

``blocks[N, KVD, L, P, H, D]`` and ``scales[N, KVD, L, P, H, G]`` are row-major; everything else is a
slice or a mode permutation of them. As in MAX, ``N`` (pages) and ``L`` (layers), hence the page pitch
``KVD*L*P*H*D``, are runtime values while ``KVD``, ``P``, ``H``, ``D`` are compile-time: every builder
takes Python ints (static) or ``Int32``/``Int64`` values (runtime). Builders emit IR, so call them while a
``@cute.jit`` / ``@cute.kernel`` function is traced. The scales tensor has the blocks tensor's layout with
``G`` in place of ``D``, so each builder serves both (``head_size`` = ``D`` or ``G``).
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int64

# Mode orders of the row-major tensors (0 = fastest mode).
_ROW_MAJOR_6D = (5, 4, 3, 2, 1, 0)
_ROW_MAJOR_3D = (2, 1, 0)
# (N, P, H, D) -> (P, D, H, N): a (P, D) TMA box per (head, page); the page id is the last TMA coordinate.
_TMA_PAGE_MODES = (1, 3, 2, 0)


def _wide(x):
    """Runtime extents as Int64: an Int32 N or L makes Int32 strides that overflow past 2**31 elements."""
    return x if isinstance(x, int) else Int64(x)


def cache_layout(num_pages, kv_dim, num_layers, page_size, num_heads, head_size) -> cute.Layout:
    """``[N, KVD, L, P, H, D]`` row-major: ``blocks`` (or ``scales`` with ``head_size=G``)."""
    shape = tuple(_wide(x) for x in (num_pages, kv_dim, num_layers, page_size, num_heads, head_size))
    return cute.make_ordered_layout(shape, order=_ROW_MAJOR_6D)


def plane_layout(cache: cute.Layout, kv_idx, layer_idx) -> tuple[cute.Layout, object]:
    """``(layout, offset)`` of the ``[N, P, H, D]`` view of plane (``kv_idx``, ``layer_idx``).

    The layout keeps the cache's page pitch as ``stride[0]`` (MAX's dim-skipping rule: a packed
    ``P*H*D`` pitch would make K-scales of page b alias V-scales of page b-1); ``offset`` is the plane's
    base, the cache layout at ``(0, kv_idx, layer_idx, 0, 0, 0)``.
    """
    return cute.slice_and_offset((None, kv_idx, layer_idx, None, None, None), cache)


def token_row_layout(num_pages, kv_dim, num_layers, page_size) -> cute.Layout:
    """``(page, slot) -> row`` of the flattened row view: ``(N, P):(KVD*L*P, 1)``.

    ``row_idx(b, t)`` is this layout at ``(LUT[b, t // P], t % P)``; rows are identical for data and
    scales, and for every (kv, layer) plane.
    """
    pitch = _wide(kv_dim) * _wide(num_layers) * page_size
    return cute.make_layout((_wide(num_pages), page_size), stride=(pitch, 1))


def num_kv_rows(num_pages, kv_dim, num_layers, page_size):
    """Rows a row-view descriptor must span: one past the last slot of the last page, ``(N-1)*KVD*L*P + P``."""
    return cute.cosize(token_row_layout(num_pages, kv_dim, num_layers, page_size))


def row_view_layout(num_rows, num_heads, head_size) -> cute.Layout:
    """``[rows, H, D]`` rows of ``H*D`` elements from a plane's base (the TMA row / gather4 view)."""
    return cute.make_ordered_layout((_wide(num_rows), num_heads, head_size), order=_ROW_MAJOR_3D)


def tma_page_view(plane):
    """``(P, D, H, N)`` mode permutation of a plane layout or tensor (FA4's paged-TMA view).

    A ``(P, D)`` TMA box then covers one page of one head and the physical page id is the last
    coordinate: an int32 TMA coordinate, valid even where the flat row ``page*KVD*L*P + slot``
    exceeds 2**31.
    """
    if isinstance(plane, cute.Tensor):
        return cute.make_tensor(plane.iterator, tma_page_view(plane.layout))
    return cute.select(plane, mode=list(_TMA_PAGE_MODES))
