"""Which strided K/V tensors a collection takes, and its per-plane views of them.

A collection addresses K and V through two *planes* ``[N, L, P, H, D]`` (``KVPlanes``): ``blocks[:, 0]`` and
``blocks[:, 1]`` of a 6-D ``blocks[N, KVD, L, P, H, D]`` (both ``blocks[:, 0]`` for MLA), or the two ``[N, P, H, D]``
tensors of ``PagedKVCacheCollection.from_kv`` with ``L = 1``. Both planes have the same strides
``(sN, sL, sP, sH, 1)``. Token ``slot`` of page ``page`` is row ``page * (sN // sP) + slot`` of the plane's row view
``[rows, H, D]`` with strides ``(sP, sH, 1)``.

MAX's row-major ``blocks`` is *compact*: the kernels compiled for it apply. Any other layout must be one the
kernels can address (``check_addressable``): D contiguous, every other stride a whole number of 16-byte units (TMA
boxes and 16-byte vector copies), no two elements at one address, and a page pitch that is a whole number of token
rows (``sN % sP == 0``). vLLM's ``[2, N, P, H, D]``, FlashInfer's NHD ``[N, 2, P, H, D]`` and HND
``[N, 2, H, P, D]`` and separate ``k_cache`` / ``v_cache`` tensors all qualify.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from cute_kv.dtypes import KV_DTYPES
from cute_kv.validate import check_tensor

BLOCKS_DIMS = ("N", "KVD", "L", "P", "H", "D")
KV_DIMS = ("N", "P", "H", "D")
PLANE_DIMS = ("N", "L", "P", "H", "D")
ALIGN_BYTES = 16
# Other engines' per-layer caches, by the layout of the tensor(s) holding K and V (``engine_kv``).
ENGINE_LAYOUTS = ("vllm", "flashinfer-nhd", "flashinfer-hnd", "separate")
# The engines' names for the memory order of a page: a token's heads side by side (NHD) or a head's tokens (HND).
PAGE_ORDERS = ("NHD", "HND")


@dataclasses.dataclass(frozen=True)
class KVPlanes:
    """``key`` / ``value`` ``[N, L, P, H, D]`` views with equal strides (one tensor object for MLA); ``blocks`` the 6-D
    tensor they slice, None when K and V are not one tensor's ``[:, 0]`` and ``[:, 1]`` (``from_kv`` of separate
    allocations, or of views with V before K)."""

    key: torch.Tensor
    value: torch.Tensor
    blocks: Optional[torch.Tensor]
    # True when planes_of_blocks / planes_of_kv built them (and checked them): with_metadata's collections, one a
    # step, skip check_planes. Planes built by hand leave it False.
    checked: bool = dataclasses.field(default=False, repr=False)

    @property
    def is_compact(self) -> bool:
        """MAX's row-major ``blocks``: what the compact kernels are compiled for."""
        return self.blocks is not None and self.blocks.is_contiguous()

    @property
    def row_pitch(self) -> int:
        """Token rows between consecutive pages of the row view: ``sN // sP``."""
        return self.key.stride(0) // self.key.stride(2)


def check_addressable(name: str, t: torch.Tensor, dims: tuple[str, ...], fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` naming the stride of ``t`` (dims named ``dims``) that the kernels cannot address; ``fix``
    ends the message (by default: pass ``{name}.contiguous()``)."""
    strides, shape, esize = t.stride(), t.shape, t.element_size()
    fix = fix or f"pass {name}.contiguous() (MAX's row-major layout) or a view of a tensor with a contiguous D"

    def dim(d: str) -> str:
        return f"{d} (dim {dims.index(d)})"

    if shape[-1] > 1 and strides[-1] != 1:
        raise ValueError(f"{name}: the stride of {dim('D')} is {strides[-1]}; kernels copy each head's D elements "
                         f"as one contiguous run, so it must be 1; {fix}")
    for i, (n, s) in enumerate(zip(shape[:-1], strides[:-1])):
        if n == 1:
            continue  # never stepped over
        if s <= 0:
            raise ValueError(f"{name}: the stride of {dim(dims[i])} is {s}; a broadcast or reversed dim stores "
                             f"nothing of its own; {fix}")
        if s * esize % ALIGN_BYTES:
            raise ValueError(f"{name}: the stride of {dim(dims[i])} is {s} elements = {s * esize} bytes, not a "
                             f"multiple of {ALIGN_BYTES}: TMA and 16-byte vector copies address the cache in "
                             f"{ALIGN_BYTES}-byte units; {fix}")
    spanned = sorted((s, n, d) for d, n, s in zip(dims, shape, strides) if n > 1)
    for (s0, n0, d0), (s1, _, d1) in zip(spanned, spanned[1:]):
        if s1 < s0 * n0:
            raise ValueError(f"{name}: {dim(d1)} (stride {s1}) steps inside {dim(d0)} (stride {s0}, extent {n0}): "
                             f"two elements share an address; {fix}")
    n_i, p_i = dims.index("N"), dims.index("P")
    if shape[n_i] > 1 and shape[p_i] > 1 and strides[n_i] % strides[p_i]:
        raise ValueError(f"{name}: the stride of {dim('N')} ({strides[n_i]}) is not a multiple of the stride of "
                         f"{dim('P')} ({strides[p_i]}): kernels address token rows as page * (sN / sP) + slot; "
                         f"{fix}")


def _engine_fix(name: str) -> str:
    """The fix for an engine's cache the kernels cannot address: a copy would not be the engine's cache."""
    return (f"the kernels cannot address this layout in place, and {name}.contiguous() would be a copy, a "
            f"different tensor than the engine's cache: keep the cache in a layout with a contiguous D, such as "
            f"{', '.join(ENGINE_LAYOUTS)} (cute_kv.kv_layout.engine_kv)")


def _canonical(t: torch.Tensor, p_dim: int) -> torch.Tensor:
    """``t`` (N first, P at ``p_dim``) with every extent-1 dim given a stride the kernels read right: a dim never
    stepped over may carry any stride, but the kernels' stride checks read it (the whole span, a multiple of 16
    bytes), and a one-token page's P stride is the page's own, so the row pitch ``sN // sP`` is 1 (row = page).
    MAX's row-major tensor gets its row-major strides (torch calls it contiguous whatever its extent-1 dims' are)."""
    if t.is_contiguous():
        return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())
    if all(n > 1 for n in t.shape):
        return t
    unit = ALIGN_BYTES // t.element_size()
    span = max((s * n for n, s in zip(t.shape, t.stride()) if n > 1), default=1)
    strides = [s if n > 1 else -(-span // unit) * unit for n, s in zip(t.shape, t.stride())]
    if t.shape[p_dim] == 1:
        strides[p_dim] = strides[0]
    return t.as_strided(t.shape, strides)


def planes_of_blocks(blocks: torch.Tensor) -> KVPlanes:
    """The planes of a 6-D ``blocks`` (already shape- and dtype-checked)."""
    if not blocks.is_contiguous():
        check_addressable("blocks", blocks, BLOCKS_DIMS)
    blocks = _canonical(blocks, BLOCKS_DIMS.index("P"))
    key = blocks[:, 0]
    return KVPlanes(key, key if blocks.shape[1] == 1 else blocks[:, 1], blocks, checked=True)


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its last."""
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _pair(names: str, key: torch.Tensor, value: torch.Tensor) -> KVPlanes:
    """The planes of ``[N, L, P, H, D]`` ``key`` and ``value`` (each addressable, equal shapes), after checking that
    they have one layout and share no element; ``blocks`` the ``[N, 2, L, P, H, D]`` view over both when they are
    views of one storage with V after K (compact for FlashInfer NHD). Overlap is judged by address, so tensors of
    separate storages over one memory (DLPack, ``from_blob``) are checked too."""
    if key.stride() != value.stride():
        raise ValueError(f"{names} must have the same strides (the kernels take one layout for both), "
                         f"got {list(key.stride())} and {list(value.stride())}")
    one_storage = key.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
    k0, v0 = key.data_ptr(), value.data_ptr()
    apart = k0 + _extent_bytes(key) <= v0 or v0 + _extent_bytes(value) <= k0
    delta, rem = divmod(v0 - k0, key.element_size())
    canonical = KVPlanes(_canonical(key, 2), _canonical(value, 2), None, checked=True)
    if apart and (rem or delta < 0 or not one_storage):
        return canonical  # no element shared, and no one tensor holds K then V
    if rem:
        raise ValueError(f"{names} overlap {v0 - k0} bytes apart, not a whole number of elements; pass two "
                         f"disjoint planes (e.g. kv[0] and kv[1] of one kv[2, N, P, H, D])")
    if delta == 0:
        raise ValueError(f"{names} are the same memory; pass two planes (e.g. kv[0] and kv[1])")
    n, nl, p, h, d = key.shape
    s_n, s_l, s_p, s_h, s_d = key.stride()
    shape, strides = (n, 2, nl, p, h, d), (s_n, abs(delta), s_l, s_p, s_h, s_d)
    if one_storage:
        both = (key if delta > 0 else value).as_strided(shape, strides)
    else:  # the view cannot span two storages; its strides are what the check reads
        both = torch.empty_strided(shape, strides, dtype=key.dtype, device="meta")
    if not both.is_contiguous():
        try:
            check_addressable(f"{names} as one blocks[N, KVD, L, P, H, D]", both, BLOCKS_DIMS,
                              "K and V must share no element: pass two disjoint planes (e.g. kv[0] and kv[1] of "
                              "one kv[2, N, P, H, D]) or two tensors")
        except ValueError:
            if apart:  # disjoint, just not one view the kernels could take whole
                return canonical
            raise
    if delta < 0 or not one_storage:
        return canonical
    both = _canonical(both, BLOCKS_DIMS.index("P"))
    return KVPlanes(both[:, 0], both[:, 1], both, checked=True)


def planes_of_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, names: tuple[str, str] = ("k_cache", "v_cache")
                 ) -> KVPlanes:
    """The planes of ``from_kv``'s ``[N, P, H, D]`` K and V (already shape- and dtype-checked), with L = 1;
    ``names``: the arguments, for the messages."""
    for name, t in zip(names, (k_cache, v_cache)):
        check_addressable(name, t, KV_DIMS, _engine_fix(name))
    return _pair(" and ".join(names), k_cache.unsqueeze(1), v_cache.unsqueeze(1))


def check_page_order(name: str, t: torch.Tensor, layout: Optional[str] = None, page_size: Optional[int] = None,
                     num_kv_heads: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless the ``[N, P, H, D]`` view ``t`` is what the engine said: its ``layout`` (``"NHD"``:
    the P stride above the H stride; ``"HND"``: below, as vLLM's HND stride order and FlashInfer's HND keep a page),
    ``page_size`` (P) and ``num_kv_heads`` (H), each checked where given. An HND tensor passed as ``[N, H, P, D]``
    has the same shape as an NHD one with P and H swapped: nothing but these facts tells them apart."""
    n, p, h, d = t.shape
    s_p, s_h = t.stride(1), t.stride(2)
    swapped = (f"if {name} is the engine's [N, H, P, D] tensor (an HND cache: P = {h}, H = {p}), pass "
               f"{name}.permute(0, 2, 1, 3) with layout='HND'")
    if layout is not None:
        if layout not in PAGE_ORDERS:
            raise ValueError(f"layout must be 'NHD' (a page holds each token's heads side by side) or 'HND' (each "
                             f"head's tokens side by side), the engine's name for its cache, got {layout!r}")
        if p > 1 and h > 1 and (s_p > s_h) != (layout == "NHD"):
            seen = "NHD" if s_p > s_h else "HND"
            fix = swapped if layout == "HND" else "if the engine's cache is HND, say layout='HND' (read in place)"
            raise ValueError(f"{name}: layout={layout!r}, but {name} [N, P, H, D] = {list(t.shape)} has strides "
                             f"{list(t.stride())}: P (stride {s_p}) {'outside' if s_p > s_h else 'inside'} H "
                             f"(stride {s_h}) is {seen}; {fix}")
    wrong = [f"{dim} = {got} but {arg}={want}" for dim, got, arg, want in
             (("P", p, "page_size", page_size), ("H", h, "num_kv_heads", num_kv_heads))
             if want is not None and got != want]
    if wrong:
        hint = f": the dims look transposed; {swapped}" if (page_size in (None, h) and num_kv_heads in (None, p)) \
            else ""
        raise ValueError(f"{name} [N, P, H, D] = {list(t.shape)} ({layout or 'layout not given'}) has "
                         f"{' and '.join(wrong)}{hint}")


def _same_view(t: torch.Tensor, u: torch.Tensor) -> bool:
    """``t`` and ``u`` address the same elements (the stride of a dim never stepped over aside)."""
    return t.data_ptr() == u.data_ptr() and t.shape == u.shape and \
        all(a == b for a, b, n in zip(t.stride(), u.stride(), t.shape) if n > 1)


def check_planes(name: str, planes: KVPlanes) -> KVPlanes:
    """``planes`` (an argument ``name``) as ``planes_of_blocks`` or ``planes_of_kv`` would build them, if they are
    what those take: views the kernels can address, of one layout, K and V sharing no element (one tensor only as
    ``blocks[:, 0]`` of an MLA ``blocks``), ``blocks`` the 6-D tensor they slice. Else a ``ValueError``."""
    if planes.checked:
        return planes
    key, value, blocks = planes.key, planes.value, planes.blocks
    check_tensor(f"{name}.key", key, dtype=KV_DTYPES, ndim=5)
    check_tensor(f"{name}.value", value, dtype=key.dtype, shape=list(key.shape), device=key.device)
    if blocks is None:
        for part, t in (("key", key), ("value", value)):
            check_addressable(f"{name}.{part}", t, PLANE_DIMS, _engine_fix(f"{name}.{part}"))
        return _pair(f"{name}.key and {name}.value", key, value)
    check_tensor(f"{name}.blocks", blocks, dtype=key.dtype, ndim=6, device=key.device)
    of_blocks = planes_of_blocks(blocks)  # checks blocks as the constructor does (MAX's compact rows of any width)
    if not (_same_view(key, of_blocks.key) and _same_view(value, of_blocks.value)) \
            or (key is value) != (of_blocks.key is of_blocks.value):
        raise ValueError(f"{name}.key and {name}.value must be the planes of {name}.blocks (blocks[:, 0] and "
                         f"blocks[:, 1], or blocks[:, 0] alone for MLA); build them with kv_layout.planes_of_blocks")
    return of_blocks


def engine_kv(layout: str, num_pages: int, page_size: int, num_heads: int, head_size: int, dtype,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """New, uninitialized ``(k_cache, v_cache)`` ``[N, P, H, D]`` views laid out as ``layout`` keeps one layer:
    vLLM ``kv[2, N, P, H, D]``, FlashInfer NHD ``[N, 2, P, H, D]`` and HND ``[N, 2, H, P, D]``, or two separate
    tensors (FA4, transformers); what ``from_kv`` takes."""
    n, p, h, d = num_pages, page_size, num_heads, head_size
    if layout == "vllm":
        kv = torch.empty((2, n, p, h, d), dtype=dtype, device=device)
        return kv[0], kv[1]
    if layout == "flashinfer-nhd":
        t = torch.empty((n, 2, p, h, d), dtype=dtype, device=device)
        return t[:, 0], t[:, 1]
    if layout == "flashinfer-hnd":
        t = torch.empty((n, 2, h, p, d), dtype=dtype, device=device)
        return t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)
    if layout == "separate":
        return (torch.empty((n, p, h, d), dtype=dtype, device=device),
                torch.empty((n, p, h, d), dtype=dtype, device=device))
    raise ValueError(f"layout must be one of {ENGINE_LAYOUTS}, got {layout!r}")
