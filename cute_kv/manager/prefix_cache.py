"""Prefix caching: chained page hashes, extra keys, and the hash -> committed page registry (as MAX does).

A page is identified by ``h_i = H(h_{i-1}, tokens of page i[, extra key of page i])``. The chain starts at
the request's *root*: ``ROOT_HASH`` for a request without ``PrefixKeys``, else a digest of its LoRA id and
tenant salt, so requests of two adapters or two tenants never share a page; a multimodal input's content
hash is the extra key of every page its placeholder tokens overlap (equal placeholder ids, different
images). Equal hashes therefore mean equal token prefixes under equal keys, not just equal pages.

Hash functions (``hash_algorithm`` of the manager):

* ``"sha256_64"`` (default): MAX's ``sha256_64``, the first 8 bytes (big-endian, signed) of SHA-256 over the
  parent hash (8 bytes, little-endian) and the int64 token ids (plus the 8-byte extra key when a page has
  one). Collision resistant up to its 64-bit width, about 1 µs per page.
* ``"blake2b_64"``: the same input through BLAKE2b with an 8-byte digest, a little faster.
* ``"builtin"``: Python's tuple hash, about 0.3 µs per page. Stable across processes (int and tuple hashes
  ignore ``PYTHONHASHSEED``) but not collision resistant: prompts can be crafted so that one tenant's
  pages answer another tenant's prefix, whatever salt is used. Only for a single trusted tenant.

Every algorithm is deterministic, so tensor-parallel ranks that each run a manager agree on every page.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from typing import Optional, Sequence, Union

ROOT_HASH = 0
HASH_ALGORITHMS = ("sha256_64", "blake2b_64", "builtin")
DEFAULT_HASH_ALGORITHM = "sha256_64"

KeyPart = Union[int, str, bytes]


@dataclasses.dataclass(frozen=True)
class PrefixKeys:
    """What besides the token ids decides a request's K/V, so it must decide which pages it may share.

    ``lora_id``: the adapter the request runs with. ``tenant_salt``: a per-tenant secret (vLLM's
    ``cache_salt``): requests of different salts never share pages, and a tenant cannot probe another's
    prompts through cache timing. ``multimodal``: ``(offset, length, content_hash)`` of each multimodal input,
    whose embeddings replace the placeholder tokens ``[offset, offset + length)``. Parts are ints, strings or
    bytes (hashed by value, the same in every process).
    """

    lora_id: Optional[KeyPart] = None
    tenant_salt: Optional[KeyPart] = None
    multimodal: tuple[tuple[int, int, KeyPart], ...] = ()

    def __post_init__(self):
        for name in ("lora_id", "tenant_salt"):
            part = getattr(self, name)
            if part is not None and (isinstance(part, bool) or not isinstance(part, (int, str, bytes))):
                raise TypeError(f"PrefixKeys.{name} must be an int, str, bytes or None, got {part!r}")
        items = tuple(tuple(m) for m in self.multimodal)
        for i, item in enumerate(items):
            ok = len(item) == 3 and all(isinstance(x, int) and not isinstance(x, bool) for x in item[:2])
            if not ok or item[0] < 0 or item[1] <= 0 or not isinstance(item[2], (int, str, bytes)):
                raise ValueError(f"PrefixKeys.multimodal[{i}] must be (offset >= 0, length > 0, content_hash), "
                                 f"got {item!r}")
        object.__setattr__(self, "multimodal", items)


def _canonical(part: Optional[KeyPart]) -> bytes:
    """Type-tagged bytes of a key part, so 1, "1" and b"1" differ."""
    if part is None:
        return b"n"
    if isinstance(part, int):
        return b"i" + part.to_bytes(16, "little", signed=True)
    if isinstance(part, str):
        part = part.encode()
        tag = b"s"
    else:
        tag = b"b"
    return tag + len(part).to_bytes(8, "little") + part


def _digest64(data: bytes, algorithm: str) -> int:
    if algorithm == "blake2b_64":
        digest = hashlib.blake2b(data, digest_size=8).digest()
    else:
        digest = hashlib.sha256(data).digest()[:8]
    return int.from_bytes(digest, "big", signed=True)


def _key_digest(data: bytes, algorithm: str) -> int:
    # Keys go through a cryptographic digest even with "builtin": str hashes depend on PYTHONHASHSEED.
    return _digest64(data, "sha256_64" if algorithm == "builtin" else algorithm)


def root_hash(keys: Optional[PrefixKeys], algorithm: str) -> int:
    """Parent hash of a request's first page."""
    if keys is None or (keys.lora_id is None and keys.tenant_salt is None):
        return ROOT_HASH
    return _key_digest(b"cute-kv root" + _canonical(keys.lora_id) + _canonical(keys.tenant_salt), algorithm)


def multimodal_spans(keys: Optional[PrefixKeys], algorithm: str) -> tuple[tuple[int, int, int], ...]:
    """``(start, stop, digest)`` of each multimodal input, sorted by start."""
    if keys is None:
        return ()
    return tuple(sorted(
        (off, off + n, _key_digest(b"cute-kv mm" + _canonical(off) + _canonical(n) + _canonical(h), algorithm))
        for off, n, h in keys.multimodal
    ))


def page_extra_keys(spans, first_page: int, num_pages: int, page_size: int,
                    algorithm: str) -> Optional[list[Optional[int]]]:
    """Extra key of pages ``first_page ..`` (the digests of the multimodal inputs they overlap), or None."""
    if not spans:
        return None
    extras = []
    for j in range(first_page, first_page + num_pages):
        lo, hi = j * page_size, (j + 1) * page_size
        hits = [d for start, stop, d in spans if start < hi and stop > lo]
        if len(hits) > 1:
            hits = [_key_digest(b"".join(_canonical(d) for d in hits), algorithm)]
        extras.append(hits[0] if hits else None)
    return extras


def hash_pages(parent: int, pages: Sequence[Sequence[int]], algorithm: str,
               extras: Optional[Sequence[Optional[int]]] = None) -> list[int]:
    """Chained hashes of ``pages`` (token ids of one full page each), continuing from ``parent``; page ``i``
    also hashes ``extras[i]`` when that is not None."""
    hashes = []
    if algorithm == "builtin":  # inlined: this runs for every page of every request
        for i, page in enumerate(pages):
            key = (parent, tuple(page)) if extras is None or extras[i] is None else (parent, tuple(page), extras[i])
            parent = hash(key)
            hashes.append(parent)
        return hashes
    for i, page in enumerate(pages):
        data = parent.to_bytes(8, "little", signed=True) + array("q", page).tobytes()
        if extras is not None and extras[i] is not None:
            data += extras[i].to_bytes(8, "little", signed=True)
        parent = _digest64(data, algorithm)
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Which device page holds the KV of each committed page hash; at most one page per hash."""

    def __init__(self, num_pages: int):
        self.hash_to_page: dict[int, int] = {}
        self.page_hash: list[Optional[int]] = [None] * num_pages

    def __len__(self) -> int:
        return len(self.hash_to_page)

    def commit(self, block_hash: int, page: int) -> int:
        """Register ``page`` under ``block_hash``; returns the page that now holds it (an older one wins)."""
        cached = self.hash_to_page.setdefault(block_hash, page)
        if cached == page:
            self.page_hash[page] = block_hash
        return cached

    def evict(self, page: int) -> Optional[int]:
        """Forget ``page``'s entry (it is about to be overwritten); returns its hash, if it had one."""
        h = self.page_hash[page]
        if h is not None:
            self.page_hash[page] = None
            del self.hash_to_page[h]
        return h
