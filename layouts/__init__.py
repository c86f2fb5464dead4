"""CuTe layout algebra of the paged KV cache: builders for kernels (``paged``), host evaluation (``host``)."""

from cute_kv.layouts.host import VIEWS, coordinates, layout_strings, offsets, view_shape
from cute_kv.layouts import rope_aware
from cute_kv.layouts.paged import (
    cache_layout, num_kv_rows, plane_layout, row_view_layout, tma_page_view, token_row_layout,
)

__all__ = [
    "VIEWS",
    "cache_layout",
    "coordinates",
    "layout_strings",
    "num_kv_rows",
    "offsets",
    "plane_layout",
    "rope_aware",
    "row_view_layout",
    "tma_page_view",
    "token_row_layout",
    "view_shape",
]
