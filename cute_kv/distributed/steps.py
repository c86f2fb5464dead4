"""The same page decisions on every rank: the scheduler's choices come from one rank, the manager does the rest.

``PagedKVCacheManager`` is deterministic, so ranks that make the same calls in the same order get the same page
ids without exchanging them; what must agree is the input: which requests run and their token ids.
``broadcast_step`` sends rank ``src``'s choice to every rank; ``assert_same_pages`` checks the outcome.
"""

from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch.distributed as dist


def broadcast_step(request_ids: Optional[Sequence], token_ids: Optional[Sequence], *, src: int = 0,
                   group=None) -> tuple[list, list]:
    """``(request_ids, token_ids)`` as chosen on rank ``src`` (other ranks pass None): token ids as one list of
    ints per request, ready for ``manager.allocate(request_ids, token_ids=...)``."""
    if dist.get_rank() == src:
        if request_ids is None or token_ids is None:
            raise ValueError(f"rank {src} (src) must pass request_ids and token_ids")
        token_ids = [t.tolist() if hasattr(t, "tolist") else list(t) for t in token_ids]
        if len(token_ids) != len(request_ids):
            raise ValueError(f"token_ids has {len(token_ids)} entries for {len(request_ids)} request_ids")
    box = [(list(request_ids), token_ids) if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def assert_same_pages(step, group=None) -> None:
    """Raise ``RuntimeError`` unless every rank of ``group`` got the same lookup table, cache lengths and
    token counts for this step (``StepInputs``): a debugging check, one small all-gather."""
    c = step.collections[0]
    h = hashlib.sha256(repr((step.request_ids, step.new_token_counts, step.skipped_tokens)).encode())
    for t in (c.cache_lengths, c.lookup_table):
        h.update(t.cpu().contiguous().numpy().tobytes())
    digests = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, h.hexdigest(), group=group)
    if len(set(digests)) != 1:
        raise RuntimeError(f"ranks disagree on the step's pages (digest per rank: {digests}); drive every rank's "
                           f"manager with the same calls in the same order (broadcast_step)")
