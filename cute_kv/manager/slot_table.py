"""Per-request state in persistent numpy arrays, one row ("slot") per claimed request.

The step's metadata is gathered from these rows with a few vectorised numpy operations instead of being
rebuilt from Python lists, which is what keeps a 256-request decode step under a millisecond. Row
``s`` of ``lookup_table`` is the canonical page list of the request in slot ``s`` (``num_pages[s]`` leading
entries; the rest hold the null page).
"""

from __future__ import annotations

import numpy as np

from cute_kv.metadata import padded_lut_cols

NO_STEP = -1  # ``pending`` of a request with no allocated, uncommitted step


def ragged_columns(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Columns ``first[r], first[r]+1, ..., first[r]+counts[r]-1`` for each row r, concatenated (pair with
    ``np.repeat(rows, counts)`` to address a ragged run per row)."""
    return np.repeat(first - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


class SlotTable:
    def __init__(self, null_page: int, max_pages: int, page_size: int):
        self.null_page = null_page
        self.max_cols = padded_lut_cols(max_pages)  # a request never owns more than every page
        self.page_size = page_size
        self.lookup_table = np.full((0, padded_lut_cols(0)), null_page, dtype=np.uint32)
        self.cache_len = np.zeros(0, dtype=np.int64)  # tokens whose K/V is in the cache (incl. prefix hits)
        self.num_pages = np.zeros(0, dtype=np.int64)
        self.pending = np.zeros(0, dtype=np.int64)  # tokens of the allocated step, or NO_STEP
        self.step_id = np.full(0, NO_STEP, dtype=np.int64)  # the allocate() call of the pending step
        # Prefix caching: chained hashes of the leading full pages of the tokens seen so far (from the
        # request's root hash, with its multimodal spans as extra keys), their token ids (for rollback),
        # how many of those pages are registered in the prefix cache, and the token ids past the last
        # full page.
        self.hashes: list[list[int]] = []
        self.page_ids: list[list[np.ndarray]] = []
        self.root: list[int] = []
        self.spans: list[tuple] = []
        self.num_committed = np.zeros(0, dtype=np.int64)
        self.tail = np.zeros((0, page_size), dtype=np.int64)
        self.tail_len = np.zeros(0, dtype=np.int64)
        self.free_slots: list[int] = []

    def __len__(self) -> int:
        return len(self.cache_len)

    def claim(self) -> int:
        if not self.free_slots:
            rows = len(self)
            self._resize(max(2 * rows, 8), self.lookup_table.shape[1])
            self.free_slots = list(range(len(self) - 1, rows - 1, -1))  # hand out low slots first
        return self.free_slots.pop()

    def release(self, slot: int) -> list[int]:
        """Reset ``slot`` and return the pages it held."""
        n = int(self.num_pages[slot])
        pages = self.lookup_table[slot, :n].tolist()
        self.lookup_table[slot, :n] = self.null_page
        self.cache_len[slot] = self.num_pages[slot] = self.num_committed[slot] = self.tail_len[slot] = 0
        self.pending[slot] = self.step_id[slot] = NO_STEP
        self.hashes[slot], self.page_ids[slot], self.root[slot], self.spans[slot] = [], [], 0, ()
        self.free_slots.append(slot)
        return pages

    def reserve_pages(self, max_pages: int) -> None:
        """Make lookup-table rows wide enough for ``max_pages`` pages (and the padding)."""
        cols = padded_lut_cols(max_pages)
        if cols > self.lookup_table.shape[1]:
            self._resize(len(self), min(max(2 * self.lookup_table.shape[1], cols), self.max_cols))

    def _resize(self, rows: int, cols: int) -> None:
        old = len(self)
        lut = np.full((rows, cols), self.null_page, dtype=np.uint32)
        lut[:old, :self.lookup_table.shape[1]] = self.lookup_table
        self.lookup_table = lut
        grow = rows - old
        self.cache_len = np.concatenate([self.cache_len, np.zeros(grow, np.int64)])
        self.num_pages = np.concatenate([self.num_pages, np.zeros(grow, np.int64)])
        self.pending = np.concatenate([self.pending, np.full(grow, NO_STEP, np.int64)])
        self.step_id = np.concatenate([self.step_id, np.full(grow, NO_STEP, np.int64)])
        self.num_committed = np.concatenate([self.num_committed, np.zeros(grow, np.int64)])
        self.tail = np.concatenate([self.tail, np.zeros((grow, self.page_size), np.int64)])
        self.tail_len = np.concatenate([self.tail_len, np.zeros(grow, np.int64)])
        self.hashes += [[] for _ in range(grow)]
        self.page_ids += [[] for _ in range(grow)]
        self.root += [0] * grow
        self.spans += [()] * grow
