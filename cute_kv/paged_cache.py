"""``PagedKVCache``: one (K or V, layer) plane of a collection, MAX's per-layer 4-D view.

``blocks`` is the strided view ``[N, P, H, D]`` of the collection's plane at this layer, whose ``stride[0]`` is the
full page pitch (``KVD*L*P*H*D`` for MAX's compact layout). The flattened *row view* treats the plane as rows of
``H`` heads of ``D`` elements, ``sP`` apart: ``row_idx(b, t) = LUT[b, t // P] * stride_rows + t % P`` with
``stride_rows = sN // sP`` (``KVD*L*P`` when compact). Scales keep MAX's compact layout: their rows are
``scale_stride_rows = KVD*L*P`` apart. The host methods here are the executable spec that the GPU kernels are
tested against; all indices are Python ints (int64 math, no uint32 overflow).
"""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.row_indices import PagedRowIndices, lut_chunk, tile_geometry


def _raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 (same bytes) so indexing works on every backend; detached, so a write of values
    that require grad never attaches the page pool to the autograd graph."""
    t = t.detach()
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


class PagedKVCache:
    def __init__(self, collection, kv_idx: int, layer_idx: int):
        c = collection
        self.collection = c
        self.kv_idx = kv_idx
        self.layer_idx = layer_idx
        n, kvd, nl, p, h, d = c.shape
        self.page_size, self.num_heads, self.head_size = p, h, d
        self.dtype = c.dtype
        # Rows between consecutive physical pages in the flattened row view, of the values and of the scales.
        self.stride_rows = c.row_pitch
        self.scale_stride_rows = c.scale_row_pitch
        self.blocks = c.plane(kv_idx)[:, layer_idx]
        # Element offset of this plane's (page 0, slot 0, head 0, dim 0) from the start of ``c.blocks`` (of the
        # plane's own tensor, ``c.key_blocks`` / ``c.value_blocks``, when ``c.blocks`` is None).
        root = c.blocks if c.blocks is not None else c.plane(kv_idx)
        self.base_offset = self.blocks.storage_offset() - root.storage_offset()
        self.scales: Optional[torch.Tensor] = None
        self.scales_base_offset = 0
        if c.scales is not None:
            g = c.scales.shape[5]
            self.scales_base_offset = (kv_idx * nl + layer_idx) * p * h * g
            self.scales = c.scales.as_strided(
                c.kv_cache_scales_dynamic_shape, c.kv_cache_scales_dynamic_strides,
                c.scales.storage_offset() + self.scales_base_offset,
            )
        self.cache_lengths = c.cache_lengths
        self.lookup_table = c.lookup_table
        self.max_seq_length = c.max_seq_length
        self.max_cache_length = c.max_cache_length

    # -- compile-time facts ----------------------------------------------------------------------

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        return self.collection.scale_dtype

    @property
    def quantization_enabled(self) -> bool:
        return self.scales is not None

    @property
    def quantization_granularity(self) -> int:
        return self.collection.quantization_granularity

    @property
    def head_dim_granularity(self) -> int:
        return self.collection.head_dim_granularity

    def max_tile_size(self) -> int:
        return self.page_size

    # -- metadata --------------------------------------------------------------------------------

    def cache_length(self, batch_idx: int) -> int:
        return self.collection.cache_length(batch_idx)

    def max_prompt_length(self) -> int:
        return self.max_seq_length

    def max_context_length(self) -> int:
        return self.max_cache_length

    def empty_cache(self) -> bool:
        # MAX's code tests max_cache_length (its docstring says "all cache_lengths are 0"); they differ
        # when new tokens exist. We follow the code.
        return self.max_cache_length == 0

    # -- row addressing --------------------------------------------------------------------------

    def num_kv_rows(self) -> int:
        """One past the largest valid row: the last token of the last page is in range."""
        return (self.collection.num_pages - 1) * self.stride_rows + self.page_size

    def _page(self, batch_idx: int, tok_idx: int) -> int:
        self.collection._check_batch(batch_idx)
        col = tok_idx // self.page_size
        if tok_idx < 0 or col >= self.lookup_table.shape[1]:
            raise IndexError(
                f"tok_idx {tok_idx} is outside the lookup table ({self.lookup_table.shape[1]} pages of {self.page_size})"
            )
        return int(self.lookup_table[batch_idx, col])

    def row_idx(self, batch_idx: int, tok_idx: int) -> int:
        return self._page(batch_idx, tok_idx) * self.stride_rows + tok_idx % self.page_size

    def token_rows(self, batch_idx: int, positions: torch.Tensor) -> torch.Tensor:
        """Vectorised ``row_idx`` over int64 ``positions`` of one request (raises on unowned pages)."""
        positions = positions.to(device=self.lookup_table.device, dtype=torch.int64)
        if positions.numel() == 0:
            return positions
        cols = positions // self.page_size
        if int(positions.min()) < 0 or int(cols.max()) >= self.lookup_table.shape[1]:
            raise IndexError(f"positions of request {batch_idx} fall outside its lookup table row")
        pages = self.lookup_table[batch_idx].to(torch.int64)[cols]
        if int(pages.max()) >= self.collection.num_pages:
            raise IndexError(f"request {batch_idx} addresses a position on a page it does not own (sentinel entry)")
        return pages * self.stride_rows + positions % self.page_size

    def scale_rows(self, rows):
        """The scale rows (int64 tensor or int) of value rows ``rows``: the same tokens,
        ``page * scale_stride_rows + slot``."""
        if self.scale_stride_rows == self.stride_rows:
            return rows
        return rows // self.stride_rows * self.scale_stride_rows + rows % self.stride_rows

    def get_tma_row(self, encoded_index: int) -> int:
        """Encoded sparse index ``physical_block * P + offset`` -> flattened row."""
        return (encoded_index // self.page_size) * self.stride_rows + encoded_index % self.page_size

    def row_view(self) -> torch.Tensor:
        """The plane as ``[num_kv_rows, H, D]`` rows of ``H`` heads, ``sP`` elements apart (what the TMA
        descriptors see)."""
        _, s_p, s_h, s_d = self.blocks.stride()
        return self.blocks.as_strided((self.num_kv_rows(), self.num_heads, self.head_size), (s_p, s_h, s_d))

    def scales_row_view(self) -> torch.Tensor:
        """Scales as ``[num_scale_rows, H, G]`` (row pitch ``KVD*L*P``; ``scale_rows`` maps value rows to them)."""
        self._require_scales()
        h, g = self.num_heads, self.scales.shape[3]
        s = self.collection.scales
        rows = (self.collection.num_pages - 1) * self.scale_stride_rows + self.page_size
        return s.as_strided((rows, h, g), (h * g, g, 1), s.storage_offset() + self.scales_base_offset)

    def block_paged_ptr(self, tile_size: int, batch_idx: int, start_tok_idx: int, head_idx: int,
                        head_dim_idx: int = 0) -> int:
        """Element offset (into ``blocks``) of a ``tile_size``-token run that lies inside one page."""
        p = self.page_size
        if not (0 < tile_size <= p and p % tile_size == 0):
            raise ValueError(f"tile_size must divide page_size ({p}), got {tile_size}")
        if start_tok_idx % tile_size:
            raise ValueError(f"start_tok_idx ({start_tok_idx}) must be a multiple of tile_size ({tile_size})")
        self._check_hd(head_idx, head_dim_idx)
        page = self._page(batch_idx, start_tok_idx)
        if page >= self.collection.num_pages:
            raise IndexError(f"request {batch_idx} does not own the page of token {start_tok_idx}")
        s_n, s_p, s_h, _ = self.blocks.stride()
        return self.base_offset + page * s_n + start_tok_idx % p * s_p + head_idx * s_h + head_dim_idx

    def scales_block_paged_ptr(self, batch_idx: int, start_tok_idx: int, head_idx: int, head_dim_idx: int = 0) -> int:
        """Element offset (into ``scales``) of the scale of (token, head, ``head_dim_idx // granularity``)."""
        self._require_scales()
        self._check_hd(head_idx, head_dim_idx)
        g = self.scales.shape[3]
        row = self._page(batch_idx, start_tok_idx) * self.scale_stride_rows + start_tok_idx % self.page_size
        return self.scales_base_offset + (row * self.num_heads + head_idx) * g + head_dim_idx // self.quantization_granularity

    def populate(self, bn: int, base_alignment: int, batch_idx: int, base_kv_row: int, *,
                 pair_cta: bool = False, is_leader: bool = True) -> PagedRowIndices:
        """Physical rows of the BN-token tile starting at ``base_kv_row`` (MAX's chunked LUT-load rule).

        ``base_alignment`` is the caller's promise that ``base_kv_row % base_alignment == 0`` (a power of two).
        Page slots past the request's pages read the sentinel, like the kernel's vector loads do.
        """
        p = self.page_size
        if bn <= 0 or (p < bn and bn % p) or (p >= bn and p % bn):
            raise ValueError(f"BN ({bn}) and page_size ({p}) must divide one another")
        if base_alignment <= 0 or base_alignment & (base_alignment - 1):
            raise ValueError(f"base_alignment must be a power of two, got {base_alignment}")
        if base_kv_row % base_alignment:
            raise ValueError(f"base_kv_row ({base_kv_row}) is not a multiple of base_alignment ({base_alignment})")
        self.collection._check_batch(batch_idx)
        eff_page, num_pages = tile_geometry(bn, p)
        lut = self.lookup_table[batch_idx]
        cols = lut.shape[0]
        first = base_kv_row // p
        if num_pages == 1:
            if base_kv_row % p + bn > p:
                raise ValueError(f"tile [{base_kv_row}, {base_kv_row + bn}) crosses a page boundary (page_size {p})")
            if first >= cols:
                raise IndexError(f"base_kv_row {base_kv_row} is past the lookup table ({cols} columns)")
            in_page = 0 if base_alignment % p == 0 else base_kv_row % p
            rows = (int(lut[first]) * self.stride_rows + in_page,)
            chunk = 1
        else:
            if base_alignment < p:
                raise ValueError(f"a {num_pages}-page tile needs base_alignment >= page_size ({p}), got {base_alignment}")
            chunk = lut_chunk(num_pages, base_alignment, p)
            row_stride = self.lookup_table.stride(0)
            if row_stride % chunk or first % chunk or first + num_pages > row_stride or first + num_pages > cols:
                raise ValueError(
                    f"lookup table row (stride {row_stride}, {cols} columns) cannot serve {num_pages} pages from "
                    f"column {first} in aligned loads of {chunk}"
                )
            entries = lut[first:first + num_pages].to(torch.int64).tolist()
            rows = tuple(e * self.stride_rows for e in entries)
        return PagedRowIndices(bn, p, eff_page, num_pages, chunk, rows, pair_cta, is_leader)

    # -- element access --------------------------------------------------------------------------

    def _check_hd(self, head_idx: int, head_dim_idx: int, width: int = 1):
        if not 0 <= head_idx < self.num_heads:
            raise IndexError(f"head_idx must be in [0, {self.num_heads}), got {head_idx}")
        if not (0 <= head_dim_idx and head_dim_idx + width <= self.head_size):
            raise IndexError(f"head dims [{head_dim_idx}, {head_dim_idx + width}) exceed head_size {self.head_size}")

    def _owned_row(self, batch_idx: int, tok_idx: int) -> int:
        page = self._page(batch_idx, tok_idx)
        if page >= self.collection.num_pages:
            raise IndexError(
                f"request {batch_idx} does not own the page of token {tok_idx} (lookup entry {page} is the sentinel)"
            )
        return page * self.stride_rows + tok_idx % self.page_size

    def _require_scales(self):
        if self.scales is None:
            raise ValueError("this cache has no quantization scales")

    def load_quantized(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx: int, width: int = 1) -> torch.Tensor:
        """``width`` raw stored values (no dequantization)."""
        self._check_hd(head_idx, head_dim_idx, width)
        row = self._owned_row(bs, tok_idx)
        return self.row_view()[row, head_idx, head_dim_idx:head_dim_idx + width].clone()

    def load_scale(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx: int, width: int = 1) -> torch.Tensor:
        """``width`` consecutive granule scales starting at granule ``head_dim_idx // granularity``."""
        self._require_scales()
        self._check_hd(head_idx, head_dim_idx)
        gi = head_dim_idx // self.quantization_granularity
        if gi + width > self.scales.shape[3]:
            raise IndexError(f"scale granules [{gi}, {gi + width}) exceed {self.scales.shape[3]}")
        row = self.scale_rows(self._owned_row(bs, tok_idx))
        return self.scales_row_view()[row, head_idx, gi:gi + width].clone()

    def load(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx: int, width: int = 1,
             output_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``width`` consecutive head-dim values; quantized caches dequantize with one granule scale."""
        if self.collection.rope_dim is not None:
            raise ValueError("load() reads one granule of one dtype; a rope-aware row mixes fp8 content and bf16 "
                             "rope: use gather() (dequantized rows) or load_quantized() (raw bytes)")
        output_dtype = output_dtype or self.dtype
        raw = self.load_quantized(bs, head_idx, tok_idx, head_dim_idx, width)
        if not self.quantization_enabled:
            return raw.to(output_dtype)
        if output_dtype == self.dtype:
            raise TypeError("a quantized load must dequantize to another output_dtype")
        gran = self.quantization_granularity
        if head_dim_idx // gran != (head_dim_idx + width - 1) // gran:
            raise ValueError(f"a load of {width} dims at {head_dim_idx} straddles a granule of {gran}")
        scale = self.load_scale(bs, head_idx, tok_idx, head_dim_idx)
        return (raw.to(torch.float32) * scale.to(torch.float32)).to(output_dtype)

    def store(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx: int, val: torch.Tensor) -> None:
        """Raw store of already-typed values (no quantization, no scale write)."""
        val = torch.as_tensor(val).reshape(-1)
        if val.dtype != self.dtype:
            raise TypeError(f"val must have the cache dtype {self.dtype}, got {val.dtype}")
        self._check_hd(head_idx, head_dim_idx, val.numel())
        row = self._owned_row(bs, tok_idx)
        _raw(self.row_view())[row, head_idx, head_dim_idx:head_dim_idx + val.numel()] = _raw(val.to(self.blocks.device))

    def store_scale(self, bs: int, head_idx: int, tok_idx: int, head_dim_idx: int, scales: torch.Tensor) -> None:
        self._require_scales()
        scales = torch.as_tensor(scales).reshape(-1)
        if scales.dtype != self.scale_dtype:
            raise TypeError(f"scales must have dtype {self.scale_dtype}, got {scales.dtype}")
        self._check_hd(head_idx, head_dim_idx)
        gi = head_dim_idx // self.quantization_granularity
        if gi + scales.numel() > self.scales.shape[3]:
            raise IndexError(f"scale granules [{gi}, {gi + scales.numel()}) exceed {self.scales.shape[3]}")
        row = self.scale_rows(self._owned_row(bs, tok_idx))
        _raw(self.scales_row_view())[row, head_idx, gi:gi + scales.numel()] = _raw(scales.to(self.scales.device))

    # -- whole-token access (used by the reference ops) ------------------------------------------

    def gather(self, batch_idx: int, start: int, stop: int, output_dtype=torch.float32) -> torch.Tensor:
        """Tokens ``[start, stop)`` of a request as ``[n, H, D]`` in ``output_dtype`` (dequantized); a rope-aware
        cache gives its logical rows ``[n, 1, latent_dim]`` (``cute_kv/rope_aware.py``)."""
        return self.read_rows(self.token_rows(batch_idx, torch.arange(start, stop)), output_dtype)

    def read_rows(self, rows: torch.Tensor, output_dtype=torch.float32) -> torch.Tensor:
        """Rows ``rows`` (int64, of the row view; the caller keeps them in ``[0, num_kv_rows)``) as ``[n, H, D]``
        dequantized, or a rope-aware cache's logical rows ``[n, 1, latent_dim]``."""
        vals = self.row_view()
        fmt = self.collection.row_format
        if fmt is not None:
            return fmt.decode(_raw(vals)[rows], _raw(self.scales_row_view())[self.scale_rows(rows)].view(
                self.scale_dtype)).to(output_dtype)
        x = _raw(vals)[rows].view(vals.dtype).to(torch.float32)
        if self.quantization_enabled:
            s = _raw(self.scales_row_view())[self.scale_rows(rows)].view(self.scale_dtype).to(torch.float32)
            x = x * s.repeat_interleave(self.quantization_granularity, dim=-1)[..., : self.head_size]
        return x.to(output_dtype)

    def scatter(self, batch_idx: int, start: int, values: torch.Tensor, scales: Optional[torch.Tensor] = None) -> None:
        """Write ``values [n, H, D]`` (cache dtype) at tokens ``[start, start+n)``, and their scales."""
        rows = self.token_rows(batch_idx, torch.arange(start, start + values.shape[0]))
        _raw(self.row_view())[rows] = _raw(values)
        if scales is not None:
            self._require_scales()
            _raw(self.scales_row_view())[self.scale_rows(rows)] = _raw(scales)

    def __repr__(self) -> str:
        which = "K" if self.kv_idx == 0 else "V"
        return (
            f"PagedKVCache({which}, layer={self.layer_idx}, view {list(self.blocks.shape)} strides "
            f"{list(self.blocks.stride())}, row pitch {self.stride_rows} rows, num_kv_rows={self.num_kv_rows()})"
        )
