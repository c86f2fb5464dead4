"""``PagedKVCacheCollection``: the K/V cache tensors (and scales) plus one step's metadata.

Layout (MAX, row-major): ``blocks[N, KVD, L, P, H, D]``; ``scales[N, KVD, L, P, H, G]`` with
``G = ceil(D / quantization_granularity)``. A page ``n`` is the slab ``blocks[n]`` holding ``P`` tokens for
every layer, K and V. ``get_key_cache(l)`` / ``get_value_cache(l)`` return per-layer ``PagedKVCache`` views.

Other engines' caches are taken in place (``cute_kv/kv_layout.py``): ``blocks`` may be any strided 6-D view the
kernels can address, and ``from_kv`` takes K and V as two ``[N, P, H, D]`` views (one layer), of one tensor or two,
or per-layer lists of them (a tensor per layer, as engines allocate: each layer is then a one-layer collection of
its own, which ``layer(l)`` resolves to).
Every op reads the cache through ``key_blocks`` / ``value_blocks``, ``[N, L, P, H, D]`` planes with the same strides
``(sN, sL, sP, sH, 1)`` (for MLA both are ``blocks[:, 0]``); ``blocks`` is the 6-D tensor, None when K and V are
not one tensor's ``[:, 0]`` and ``[:, 1]``. ``is_compact`` (MAX's row-major ``blocks``) selects the kernels compiled
for MAX's layout; other layouts take the strided variants, which get the planes with runtime strides. ``scales``
keep MAX's compact ``[N, KVD, L, P, H, G]`` whatever the layout of the values, so a token's scale row may differ from
its value row.

A rope-aware MLA cache (``rope_dim`` set, ``cute_kv/rope_aware.py``) stores rows of ``D`` bytes: ``padded_depth``
e4m3 content bytes, then ``rope_dim`` bf16 values, with one float32 scale per token (``G = 1``).
"""

from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from cute_kv.dtypes import KV_DTYPES, SCALE_DTYPES, is_fp8
from cute_kv.kv_layout import KVPlanes, check_page_order, check_planes, planes_of_blocks, planes_of_kv
from cute_kv.params import KVCacheParams, check_rope_aware
from cute_kv.rope_aware import RopeAwareRow
from cute_kv.validate import (NEW_TOKENS_HINT, check_metadata_tensor, check_not_negative, check_tensor,
                              check_uint32_scalar, lookup_fix, negative_entry)


class PagedKVCacheCollection:
    """A paged KV cache (``blocks``, optional fp8 ``scales``) with one step's metadata: what every op takes.

    ``cache_lengths[b]``: tokens of request ``b`` already in the cache before this step (this step's new tokens
    excluded; they are stored at ``cache_lengths[b] + i``). ``lookup_table[b, j]``: the physical page holding the
    request's tokens ``[j*P, (j+1)*P)``; entries past the pages a request owns hold the sentinel ``num_pages`` (any
    value ``>= num_pages`` names no page). Both are uint32 (MAX) or int32, never negative. A table padded with 0
    instead, as vLLM's block tables are, is valid: ops read only the pages under each request's length, but the
    checks cannot tell a request that outgrew its pages from one that owns page 0, so its new tokens would go to
    page 0; pad with the sentinel to have that caught. ``max_seq_length`` / ``max_cache_length``: the longest new
    run and the longest context (cached + new) of the step, which kernels size their grids from.

    ``get_key_cache(l)`` / ``get_value_cache(l)`` give per-layer ``PagedKVCache`` views; ``with_metadata`` the same
    cache with another step's metadata; ``allocate_blocks(params, pages)`` the tensors for ``KVCacheParams``. The
    block manager (``PagedKVCacheManager.allocate``) builds collections for each step.
    """

    name_str = "paged"
    # Set by the block manager (bind_step): the step these metadata belong to, and its live steps.
    step_id: Optional[int] = None
    _live_steps: Optional[set] = None
    # Set by from_kv of per-layer tensors: each layer's one-layer collection (``layer``).
    _layers: Optional[tuple] = None

    def __init__(
        self,
        blocks: torch.Tensor | KVPlanes,
        cache_lengths: torch.Tensor,
        lookup_table: torch.Tensor,
        max_seq_length: int,
        max_cache_length: int,
        scales: Optional[torch.Tensor] = None,
        *,
        quantization_granularity: Optional[int] = None,
        rope_dim: Optional[int] = None,
        validate: bool = True,
    ):
        """Wrap existing tensors (nothing is copied).

        ``blocks``: ``[N, KVD, L, P, H, D]``, MAX's row-major layout or any strided view the kernels can address
        (``kv_layout.check_addressable``: the error names the stride that is not); or the ``KVPlanes`` that
        ``from_kv`` builds (``kv_layout.check_planes``: checked as ``from_kv`` checks its tensors).

        ``cache_lengths`` and ``lookup_table`` are uint32 (MAX) or int32; int32 ones are kept as their uint32 view
        (same memory: later writes to them show), which is what ``cache_lengths`` / ``lookup_table`` return.

        ``validate=False`` skips the lookup-table scan (a device sync on GPU) for callers that built the
        metadata themselves, such as the block manager; shapes and dtypes are always checked.

        ``rope_dim`` makes it a rope-aware MLA cache (``KVCacheQuantizationConfig.rope_dim``): KVD=1, H=1, fp8
        ``blocks`` of ``head_size = padded_depth + 2*rope_dim`` bytes per row and float32 ``scales`` of one per token.
        """
        if isinstance(blocks, KVPlanes):
            planes = check_planes("blocks", blocks)
        else:
            check_tensor("blocks", blocks, dtype=KV_DTYPES, ndim=6)
            if blocks.shape[1] not in (1, 2):
                raise ValueError(f"blocks.shape[1] (KVD) must be 2 (K and V) or 1 (MLA), got {blocks.shape[1]}")
            if min(blocks.shape) <= 0:
                raise ValueError(f"blocks must have no empty dimension, got shape {list(blocks.shape)}")
            planes = planes_of_blocks(blocks)
        n, nl, p, h, d = planes.key.shape
        kvd = 1 if planes.value is planes.key else 2
        dev = planes.key.device
        cache_lengths = check_metadata_tensor("cache_lengths", cache_lengths, ndim=1, device=dev)
        bsz = cache_lengths.shape[0]
        lookup_table = check_metadata_tensor("lookup_table", lookup_table, ndim=2, device=dev)
        if lookup_table.shape[0] != bsz:
            raise ValueError(
                f"lookup_table must have one row per request ({bsz}), got shape {list(lookup_table.shape)}"
            )
        if lookup_table.stride(1) != 1:
            raise ValueError("lookup_table must be row-major (stride 1 along its columns)")
        self.max_seq_length = check_uint32_scalar("max_seq_length", max_seq_length)
        self.max_cache_length = check_uint32_scalar("max_cache_length", max_cache_length)
        if self.max_cache_length > lookup_table.shape[1] * p:
            raise ValueError(
                f"lookup_table has {lookup_table.shape[1]} columns ({lookup_table.shape[1] * p} tokens at "
                f"page_size {p}), fewer than max_cache_length={self.max_cache_length}"
            )
        self.planes = planes
        self.blocks = planes.blocks
        self.key_blocks, self.value_blocks = planes.key, planes.value
        self.cache_lengths = cache_lengths
        self.lookup_table = lookup_table
        self.num_pages, self.kv_dim, self.num_layers, self.page_size, self.num_heads, self.head_size = (
            n, kvd, nl, p, h, d)
        self.is_mla = kvd == 1
        # Per-layer 4-D view [N, P, H, D]: stride[0] is the full page pitch, not P*H*D (MAX's dim-skipping rule).
        s_n, _, s_p, s_h, s_d = planes.key.stride()
        self.kv_cache_dynamic_shape = (n, p, h, d)
        self.kv_cache_dynamic_strides = (s_n, s_p, s_h, s_d)
        self.scales = scales
        self.quantization_granularity = 1
        self.kv_cache_scales_dynamic_shape = (0, 0, 0, 0)
        self.kv_cache_scales_dynamic_strides = (0, 0, 0, 0)
        if scales is not None:
            self._init_scales(scales, quantization_granularity)
        elif quantization_granularity is not None:
            raise ValueError("quantization_granularity given without scales")
        self.rope_dim = None
        if rope_dim is not None:
            self._init_rope(rope_dim)
        if validate and not torch.compiler.is_compiling():  # the scan reads device values: traced, it is skipped
            self.check_metadata()

    def _init_scales(self, scales: torch.Tensor, granularity: Optional[int]):
        n, kvd, nl, p, h, d = self.shape
        if not is_fp8(self.dtype):
            raise TypeError(f"scales need an fp8 blocks tensor, got blocks dtype {self.dtype}")
        check_tensor("scales", scales, dtype=SCALE_DTYPES, ndim=6, device=self.device, contiguous=True)
        g = scales.shape[5]
        if granularity is None:
            if g <= 0 or d % g:
                raise ValueError(
                    f"cannot infer quantization_granularity from scales.shape[5]={g} and head_size={d}; pass it"
                )
            granularity = d // g
        if not isinstance(granularity, int) or granularity <= 0:
            raise ValueError(f"quantization_granularity must be a positive int, got {granularity!r}")
        if list(scales.shape) != [n, kvd, nl, p, h, math.ceil(d / granularity)]:
            raise ValueError(
                f"scales must have shape {[n, kvd, nl, p, h, math.ceil(d / granularity)]} for "
                f"quantization_granularity={granularity}, got {list(scales.shape)}"
            )
        self.quantization_granularity = granularity
        self.kv_cache_scales_dynamic_shape = (n, p, h, g)
        self.kv_cache_scales_dynamic_strides = (kvd * nl * p * h * g, h * g, g, 1)

    def _init_rope(self, rope_dim) -> None:
        if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim <= 0:
            raise ValueError(f"rope_dim must be a positive int (bf16 rope values per row) or None, got {rope_dim!r}")
        if self.num_heads != 1:
            raise ValueError(f"rope_dim is for MLA caches of one latent head; blocks.shape[4] (H) is {self.num_heads}")
        if self.scales is None:
            raise ValueError(f"rope_dim={rope_dim} needs scales: float32 [N, 1, L, P, 1, 1], one per token")
        check_rope_aware(self.is_mla, self.dtype, self.scale_dtype, self.quantization_granularity, self.head_size,
                         rope_dim)
        self.rope_dim = rope_dim

    # -- construction helpers ---------------------------------------------------------------------

    @classmethod
    def from_kv(cls, k_cache, v_cache, cache_lengths: torch.Tensor, lookup_table: torch.Tensor,
                max_seq_length: int, max_cache_length: int, scales=None, *, layout: Optional[str] = None,
                page_size: Optional[int] = None, num_kv_heads: Optional[int] = None,
                **kwargs) -> "PagedKVCacheCollection":
        """A collection over K and V given as ``[N, P, H, D]`` views, of one tensor or two (nothing is copied).

        One layer: ``k_cache`` / ``v_cache`` tensors (call the ops with ``layer_idx=0``). vLLM
        ``kv[2, N, P, H, D]``: ``from_kv(kv[0], kv[1], ...)``; FlashInfer NHD ``t[N, 2, P, H, D]``:
        ``(t[:, 0], t[:, 1])``; FlashInfer HND ``t[N, 2, H, P, D]``: ``(t[:, 0].permute(0, 2, 1, 3),
        t[:, 1].permute(0, 2, 1, 3))``; FA4 / transformers: ``(k_cache, v_cache)``. Several layers: lists (or tuples)
        of per-layer tensors, ``k_caches[l]`` / ``v_caches[l]``, as engines keep one cache tensor per layer (vLLM's
        ``kv_caches``: ``[kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches]``); every layer has the first's
        shape, dtype and strides, and ``layer_idx`` selects the layer (``layer``). One step's metadata serve them all,
        and so does one ``plan_step``. ``scales``: MAX's compact ``[N, 2, 1, P, H, G]`` (a list of one per layer with
        lists); the other arguments as for the constructor, whose metadata checks run once.

        ``layout`` (``"NHD"`` / ``"HND"``, the engine's name for the memory order of a page), ``page_size`` and
        ``num_kv_heads`` are what the engine allocated: each given one is checked against the tensors
        (``kv_layout.check_page_order``), so an HND cache passed as an NHD one (P and H swapped) is refused instead
        of read wrong."""
        per_layer = [isinstance(x, (list, tuple)) for x in (k_cache, v_cache)]
        if per_layer[0] != per_layer[1]:
            raise TypeError(f"k_cache and v_cache must both be tensors (one layer) or both lists of one tensor per "
                            f"layer, got {type(k_cache).__name__} and {type(v_cache).__name__}")
        if not per_layer[0]:
            return cls(_kv_planes((k_cache, v_cache), ("k_cache", "v_cache"), layout, page_size, num_kv_heads),
                       cache_lengths, lookup_table, max_seq_length, max_cache_length, scales, **kwargs)
        if not k_cache or len(k_cache) != len(v_cache):
            raise ValueError(f"k_caches and v_caches must hold one tensor per layer each, got {len(k_cache)} and "
                             f"{len(v_cache)}")
        if scales is not None and (not isinstance(scales, (list, tuple)) or len(scales) != len(k_cache)):
            raise ValueError(f"with per-layer k_caches, scales must be None or a list of one [N, 2, 1, P, H, G] "
                             f"tensor per layer ({len(k_cache)}), got {type(scales).__name__}")
        layers, seen = [], {}
        for i, kv in enumerate(zip(k_cache, v_cache)):
            names = (f"k_caches[{i}]", f"v_caches[{i}]")
            planes = _kv_planes(kv, names, layout, page_size, num_kv_heads)
            for name, t in zip(names, kv):
                if t.data_ptr() in seen:
                    raise ValueError(f"{name} is the memory of {seen[t.data_ptr()]}: each layer needs its own cache")
                seen[t.data_ptr()] = name
            if i:
                first = layers[0].key_blocks
                check_tensor(names[0], kv[0], dtype=first.dtype, shape=[first.shape[0], *first.shape[2:]],
                             device=first.device)
                if planes.key.stride() != first.stride():
                    raise ValueError(f"{names[0]} has strides {list(kv[0].stride())}, k_caches[0] "
                                     f"{list(k_cache[0].stride())}: the layers must share one layout (one plan and "
                                     f"one set of kernels serve them all)")
            layers.append(cls(planes, cache_lengths, lookup_table, max_seq_length, max_cache_length,
                              None if scales is None else scales[i],
                              **{**kwargs, "validate": kwargs.get("validate", True) and not i}))
        return cls._of_layers(layers)

    @classmethod
    def _of_layers(cls, layers: list["PagedKVCacheCollection"]) -> "PagedKVCacheCollection":
        """One collection over one-layer ``layers`` of one geometry and metadata (``from_kv`` of lists): layer 0's
        attributes (its planes too: ops resolve their layer with ``layer`` before reading any), ``num_layers`` of
        them, and ``layer(l)`` resolving to ``layers[l]``."""
        if len(layers) == 1:
            return layers[0]
        c = copy.copy(layers[0])
        c.num_layers, c._layers = len(layers), tuple(layers)
        return c

    @staticmethod
    def allocate_blocks(params: KVCacheParams, total_num_pages: int, device=None, *, zero: bool = True):
        """``(blocks, scales|None)`` for ``params``: ``[N, KVD, L, P, H_per_dev, D]`` on ``device``."""
        if not isinstance(total_num_pages, int) or total_num_pages <= 0:
            raise ValueError(f"total_num_pages must be a positive int, got {total_num_pages!r}")
        alloc = torch.zeros if zero else torch.empty
        blocks = alloc([total_num_pages, *params.shape_per_block], dtype=params.dtype, device=device)
        scales = None
        if params.quantized_kv_cache:
            scales = torch.ones([total_num_pages, *params.shape_per_scale_block],
                                dtype=params.kvcache_quant_config.scale_dtype, device=device)
        return blocks, scales

    def with_metadata(self, cache_lengths, lookup_table, max_seq_length, max_cache_length, *, validate=True):
        """A collection over the same blocks/scales (every layer's tensors) with another step's metadata."""
        return self._of_layers([
            PagedKVCacheCollection(
                c.planes, cache_lengths, lookup_table, max_seq_length, max_cache_length, c.scales,
                quantization_granularity=c.quantization_granularity if c.scales is not None else None,
                rope_dim=c.rope_dim, validate=validate and not i,
            ) for i, c in enumerate(self._layers or (self,))])

    # -- metadata --------------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        return self.cache_lengths.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.key_blocks.dtype

    @property
    def device(self) -> torch.device:
        return self.key_blocks.device

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """``(N, KVD, L, P, H, D)``: ``blocks.shape`` of the 6-D tensor, or of the one K and V would make."""
        return (self.num_pages, self.kv_dim, self.num_layers, self.page_size, self.num_heads, self.head_size)

    @property
    def is_compact(self) -> bool:
        """MAX's row-major ``blocks``: the kernels compiled for it apply; other layouts take the strided
        variants."""
        return self.planes.is_compact

    @property
    def layout_name(self) -> str:
        """``"compact"`` or ``"strided"``: the kernels' layout flag."""
        return "compact" if self.is_compact else "strided"

    def plane(self, kv_idx: int) -> torch.Tensor:
        """``key_blocks`` (0) or ``value_blocks`` (1): ``[N, L, P, H, D]``."""
        return self.key_blocks if kv_idx == 0 else self.value_blocks

    @property
    def row_pitch(self) -> int:
        """Token rows between consecutive pages of a plane's row view: ``sN // sP`` (``KVD*L*P`` when compact)."""
        return self.planes.row_pitch

    @property
    def scale_row_pitch(self) -> int:
        """Rows between consecutive pages of the (always compact) scales: ``KVD*L*P``."""
        return self.kv_dim * self.num_layers * self.page_size

    def traced_blocks(self, op: str) -> torch.Tensor:
        """``blocks`` for a torch.compile trace (the custom ops take one cache tensor), or a ``ValueError``."""
        if self.blocks is None:
            raise ValueError(f"{op} under torch.compile takes the cache as one tensor; this collection's K and V are "
                             f"not one tensor's [:, 0] and [:, 1] (from_kv of separate allocations, or of views with "
                             f"V stored before K): run it eagerly, or keep K and V in one tensor with V after K")
        return self.blocks

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        return None if self.scales is None else self.scales.dtype

    @property
    def quantization_enabled(self) -> bool:
        return self.scales is not None

    @property
    def padded_depth(self) -> int:
        """Content width of a row: ``head_size - 2*rope_dim`` fp8 bytes (rope-aware), else ``head_size``."""
        return self.head_size - 2 * (self.rope_dim or 0)

    @property
    def latent_dim(self) -> int:
        """Logical width of a row, the last dim of the q/k an op takes: ``padded_depth + rope_dim`` for a
        rope-aware cache (DeepSeek: 576), ``head_size`` otherwise."""
        return self.padded_depth + (self.rope_dim or 0)

    @property
    def row_format(self) -> Optional[RopeAwareRow]:
        """The rope-aware row codec (``cute_kv/rope_aware.py``); None for other caches."""
        return None if self.rope_dim is None else RopeAwareRow(self.padded_depth, self.rope_dim)

    @property
    def head_dim_granularity(self) -> int:
        return math.ceil(self.head_size / self.quantization_granularity)

    @property
    def sentinel(self) -> int:
        """Lookup entries ``>= num_pages`` name no page of this tensor (MAX fills unused entries with N); pad with
        it rather than with 0, a real page (see the class docstring)."""
        return self.num_pages

    def cache_length(self, batch_idx: int) -> int:
        self._check_batch(batch_idx)
        return int(self.cache_lengths[batch_idx])

    def pages_owned(self, batch_idx: int) -> int:
        """Leading lookup entries of request ``batch_idx`` that name real pages (the pages it owns)."""
        self._check_batch(batch_idx)
        row = self.lookup_table[batch_idx].to(torch.int64)
        bad = (row >= self.num_pages).nonzero()
        return int(bad[0]) if bad.numel() else row.shape[0]

    def check_metadata(self) -> None:
        """Every cached token's page is a real page; no entry past the sentinel."""
        lut = self.lookup_table.to(torch.int64)
        if lut.numel() and int(lut.max()) > self.num_pages:
            check_not_negative("lookup_table", self.lookup_table, lookup_fix(self.num_pages))
            raise ValueError(
                f"lookup_table entries must be < num_pages ({self.num_pages}) or the sentinel {self.num_pages}; "
                f"found {int(lut.max())}"
            )
        cl = self.cache_lengths.to(torch.int64)
        if cl.numel() and int(cl.max()) > self.max_cache_length:
            check_not_negative("cache_lengths", self.cache_lengths)
            raise ValueError(
                f"max_cache_length ({self.max_cache_length}) is below the longest cache_lengths entry "
                f"({int(cl.max())}); {NEW_TOKENS_HINT}"
            )
        unowned = self._first_unowned(cl)
        if unowned:
            b, j, entry = unowned
            raise ValueError(
                f"lookup_table[{b}, {j}] = {entry} names no page but request {b} has {int(cl[b])} cached tokens "
                f"(needs {int(-(-cl[b] // self.page_size))} pages); {NEW_TOKENS_HINT}"
            )

    def check_writable(self, name: str, new_lengths: torch.Tensor) -> None:
        """Raise unless every request owns the pages of positions ``[0, cache_length + new_lengths)``.

        Those are the pages an op writes this step's tokens to and reads the context from.
        """
        cl = self.cache_lengths.to(torch.int64)
        end = cl + new_lengths.to(device=cl.device, dtype=torch.int64)
        if end.numel() and int(end.max()) > self.lookup_table.shape[1] * self.page_size:
            check_not_negative("cache_lengths", self.cache_lengths)
            b = int(end.argmax())
            raise ValueError(
                f"{name}: request {b} would write up to position {int(end[b])}, past the "
                f"{self.lookup_table.shape[1]} lookup_table columns (page_size {self.page_size}); {NEW_TOKENS_HINT}"
            )
        unowned = self._first_unowned(end)
        if unowned:
            b, j, entry = unowned
            raise ValueError(
                f"{name}: request {b} needs positions [0, {int(end[b])}) ({int(cl[b])} cached + {int(end[b] - cl[b])} "
                f"new) but owns only {j} pages (lookup_table[{b}, {j}] = {entry} names no page < {self.num_pages}); "
                f"{NEW_TOKENS_HINT}"
            )

    def unowned_pages(self, end: torch.Tensor, lut: Optional[torch.Tensor] = None) -> torch.Tensor:
        """bool ``[B, cols]``: the lookup entries below ``ceil(end[b] / P)`` (int64 ``end``) that are not pages; read
        nothing on the host (``lut``: the table as int64, when the caller has it)."""
        lut = self.lookup_table.to(torch.int64) if lut is None else lut
        need = (end + self.page_size - 1) // self.page_size
        cols = torch.arange(lut.shape[1], device=lut.device)
        return (cols[None, :] < need[:, None]) & (lut >= self.num_pages)

    def _first_unowned(self, end: torch.Tensor) -> Optional[tuple[int, int, int]]:
        """``(b, column, entry)`` of the first lookup entry below ``ceil(end[b] / P)`` that is not a page."""
        lut = self.lookup_table.to(torch.int64)
        bad = self.unowned_pages(end, lut)
        if not bool(bad.any()):
            return None
        b, j = (int(x) for x in bad.nonzero()[0])
        if int(lut[b, j]) >= 2**31:  # an int32 table's negative padding
            raise ValueError(negative_entry("lookup_table", (b, j), int(lut[b, j]) - 2**32, lookup_fix(self.num_pages)))
        return b, j, int(lut[b, j])

    # -- per-layer views -------------------------------------------------------------------------

    def get_key_cache(self, layer_idx: int):
        return self._get_cache(0, layer_idx)

    def get_value_cache(self, layer_idx: int):
        if self.is_mla:
            raise ValueError("an MLA cache (KVD=1) stores no value cache; use get_key_cache")
        return self._get_cache(1, layer_idx)

    def check_layer(self, layer_idx: int) -> None:
        """Raise unless ``0 <= layer_idx < num_layers`` and the collection's manager step is still live
        (host-only, unlike building a view: torch.compile traces it). Every op calls it first."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            # Not converted: ops hand layer_idx on to compiled kernels and custom ops as a Python int, and a tensor's
            # value would be read on the host (a device sync for a CUDA tensor).
            what = (f"a {layer_idx.dim()}-d torch.Tensor" if isinstance(layer_idx, torch.Tensor)
                    else f"{type(layer_idx).__module__}.{type(layer_idx).__qualname__} ({layer_idx})")
            raise TypeError(f"layer_idx must be a Python int, got {what.replace('builtins.', '')}; "
                            f"pass int(layer_idx)")
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx}")
        if self._live_steps is not None and self.step_id not in self._live_steps \
                and not torch.compiler.is_compiling():
            raise ValueError(
                f"this collection belongs to manager step {self.step_id}, which was committed or released: its "
                f"pages may be shared or freed since; use the collections of the latest allocate()"
            )

    def layer(self, layer_idx: int) -> tuple["PagedKVCacheCollection", int]:
        """``(collection, index)`` that hold layer ``layer_idx`` (checked as ``check_layer`` does): this collection
        and ``layer_idx``, or, over per-layer tensors (``from_kv`` of lists), that layer's own one-layer collection
        and 0. Every op resolves its layer through it first."""
        self.check_layer(layer_idx)
        return (self, layer_idx) if self._layers is None else (self._layers[layer_idx], 0)

    def bind_step(self, step_id: int, live_steps: set) -> None:
        """Tie these metadata to block-manager step ``step_id``: ops refuse them once it leaves ``live_steps``."""
        self.step_id, self._live_steps = step_id, live_steps

    def _get_cache(self, kv_idx: int, layer_idx: int):
        from cute_kv.paged_cache import PagedKVCache

        c, layer_idx = self.layer(layer_idx)
        return PagedKVCache(c, kv_idx, layer_idx)

    def _check_batch(self, batch_idx: int):
        if not 0 <= batch_idx < self.batch_size:
            raise IndexError(f"batch_idx must be in [0, {self.batch_size}), got {batch_idx}")

    def __repr__(self) -> str:
        n, kvd, nl, p, h, d = self.shape
        q = "" if self.is_compact else f", strided {list(self.key_blocks.stride())}"
        q += "" if self._layers is None else ", a tensor per layer"
        q += f", scales={self.scale_dtype} gran={self.quantization_granularity}" if self.scales is not None else ""
        if self.rope_dim is not None:
            q += f", rope-aware [{self.padded_depth} fp8 | {self.rope_dim} bf16]"
        return (
            f"PagedKVCacheCollection(blocks[N={n}, KVD={kvd}, L={nl}, P={p}, H={h}, D={d}] {self.dtype} "
            f"on {self.device}{q}, batch={self.batch_size}, lut_cols={self.lookup_table.shape[1]}, "
            f"max_seq_length={self.max_seq_length}, max_cache_length={self.max_cache_length})"
        )


def _kv_planes(kv: tuple[torch.Tensor, torch.Tensor], names: tuple[str, str], layout: Optional[str],
               page_size: Optional[int], num_kv_heads: Optional[int]) -> KVPlanes:
    """The planes of one layer's ``[N, P, H, D]`` K and V (``from_kv``), checked against what the engine said."""
    for name, t in zip(names, kv):
        check_tensor(name, t, dtype=KV_DTYPES, ndim=4)
        if min(t.shape) <= 0:
            raise ValueError(f"{name} must have no empty dimension, got shape {list(t.shape)}")
    check_tensor(names[1], kv[1], dtype=kv[0].dtype, shape=list(kv[0].shape), device=kv[0].device)
    for name, t in zip(names, kv):
        check_page_order(name, t, layout, page_size, num_kv_heads)
    return planes_of_kv(*kv, names)
