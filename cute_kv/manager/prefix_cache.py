"""Prefix caching: chained page hashes and the hash -> committed page registry (as MAX does).

A page is identified by ``h_i = H(h_{i-1}, tokens of page i)`` with root parent ``ROOT_HASH``, so equal
hashes mean equal token prefixes, not just equal pages. Two hash functions:

* ``"builtin"`` (default): Python's tuple hash, 64-bit, about 1 µs per page. Stable across processes (int and
  tuple hashes ignore ``PYTHONHASHSEED``), so tensor-parallel ranks that each run a manager agree. It is not
  collision resistant: prompts can be crafted to collide, so a multi-tenant server should use
  ``"sha256_64"``.
* ``"sha256_64"``: MAX's ``sha256_64``, the first 8 bytes (big-endian, signed) of SHA-256 over the parent
  hash and the int64 token ids.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

ROOT_HASH = 0
HASH_ALGORITHMS = ("builtin", "sha256_64")


def hash_pages(parent: int, pages: Sequence[Sequence[int]], algorithm: str) -> list[int]:
    """Chained hashes of ``pages`` (token ids of one full page each), continuing from ``parent``."""
    hashes = []
    if algorithm == "builtin":  # inlined: this runs for every page of every request
        for page in pages:
            parent = hash((parent, tuple(page)))
            hashes.append(parent)
        return hashes
    for page in pages:
        data = parent.to_bytes(8, "little", signed=True) + array("q", page).tobytes()
        parent = int.from_bytes(hashlib.sha256(data).digest()[:8], "big", signed=True)
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
