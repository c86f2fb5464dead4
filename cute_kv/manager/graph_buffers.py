"""``GraphStepBuffers``: persistent step metadata, so one captured CUDA graph replays for any batch up to a maximum.

A CUDA graph records device addresses, so the tensors a captured step reads must be the same every step: this
object owns them, sized once for fixed maxima, and ``PagedKVCacheManager.allocate(..., graph_buffers=b)``
refills them in place (FlashInfer's plan/run split; vLLM's padded graph batches):

* ``cache_lengths`` uint32 ``[max_batch_size]``, ``lookup_table`` uint32 ``[max_batch_size,
  padded_lut_cols(ceil(max_context_length / page_size))]``, ``input_row_offsets`` uint32 ``[max_batch_size + 1]``;
* ``positions`` int64 ``[max_step_tokens]`` and ``last_row_indices`` int64 ``[max_batch_size]`` for the model.

A step of ``B <= max_batch_size`` requests and ``T <= max_step_tokens`` rows fills rows ``[0, B)``; the other
requests are padding: cache length 0, no rows (``input_row_offsets[b] = T`` for ``b > B``) and lookup rows of
the null page, so kernels read nothing through them and write nothing (a padding request with rows would
write the null page). Positions past ``T`` are 0 and the model's rows past ``T`` are don't-cares. The
collections carry ``max_seq_length = max_step_tokens`` and ``max_cache_length = max_context_length``: a graph
is captured for those maxima (grids sized for them; work past a step's real lengths exits early).

The host side is staged in pinned memory and copied with ``non_blocking=True``, in stream order before the
step's kernels. Before the staging memory is rewritten, the previous step's copies are waited for (an event),
so an engine may fill step ``n+1`` while step ``n`` runs.
"""

from __future__ import annotations

import numpy as np
import torch

from cute_kv.metadata import padded_lut_cols


class GraphStepBuffers:
    """Persistent per-step metadata of one ``PagedKVCacheManager``, for steps replayed from a captured CUDA graph.

    Build it once for the maxima a graph is captured for, pass it to every ``allocate(..., graph_buffers=b)``, and
    capture with the tensors it holds: ``collections`` and ``input_row_offsets`` (one per manager device; every
    step's ``StepInputs`` hands back the same objects), ``positions`` and ``last_row_indices`` (what the step's
    ``StepInputs`` return too). ``allocate`` refills them in place, so a replay reads the new step, with padding
    requests that read and write nothing; a step past a maximum raises before the manager changes anything.
    Call the ops with ``validate=False`` inside the capture (the checks read device values).
    """

    def __init__(self, manager, max_batch_size: int, max_context_length: int, max_step_tokens: int):
        """Buffers on every device of ``manager`` for steps of at most ``max_batch_size`` requests,
        ``max_step_tokens`` new rows in all, and contexts (cached + new tokens) of at most ``max_context_length``."""
        for name, v in (("max_batch_size", max_batch_size), ("max_context_length", max_context_length),
                        ("max_step_tokens", max_step_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.manager = manager
        self.max_batch_size, self.max_context_length, self.max_step_tokens = (
            max_batch_size, max_context_length, max_step_tokens)
        self.max_pages = -(-max_context_length // manager.page_size)
        null = manager.pool.null_page
        cols = padded_lut_cols(self.max_pages)
        pin = any(d.type == "cuda" for d in manager.devices)
        # Host staging, pinned when a device is CUDA so the copies are asynchronous DMA: cache_lengths,
        # lookup_table, input_row_offsets, positions, last_row_indices.
        self._host = (
            torch.zeros(max_batch_size, dtype=torch.uint32, pin_memory=pin),
            torch.full((max_batch_size, cols), null, dtype=torch.uint32, pin_memory=pin),
            torch.zeros(max_batch_size + 1, dtype=torch.uint32, pin_memory=pin),
            torch.zeros(max_step_tokens, dtype=torch.int64, pin_memory=pin),
            torch.zeros(max_batch_size, dtype=torch.int64, pin_memory=pin),
        )
        self._batch = self._tokens = 0  # the previous step's, whose rows padding must overwrite
        self._copied = None  # CUDA event: the last copies out of the staging memory are done
        per_device = {}
        self.collections, self.input_row_offsets, self.positions, self.last_row_indices = [], [], [], []
        for base in manager._collections:
            dev = base.device
            if dev not in per_device:
                per_device[dev] = (
                    torch.zeros(max_batch_size, dtype=torch.uint32, device=dev),
                    torch.full((max_batch_size, cols), null, dtype=torch.uint32, device=dev),
                    torch.zeros(max_batch_size + 1, dtype=torch.uint32, device=dev),
                    torch.zeros(max_step_tokens, dtype=torch.int64, device=dev),
                    torch.zeros(max_batch_size, dtype=torch.int64, device=dev),
                )
            lengths, lut, offsets, pos, last = per_device[dev]
            self.collections.append(base.with_metadata(lengths, lut, max_step_tokens, max_context_length,
                                                       validate=False))
            self.input_row_offsets.append(offsets)
            self.positions.append(pos)
            self.last_row_indices.append(last)
        self.collections, self.input_row_offsets = tuple(self.collections), tuple(self.input_row_offsets)
        self.positions, self.last_row_indices = tuple(self.positions), tuple(self.last_row_indices)
        self._device_tensors = list(per_device.values())

    def check_fits(self, manager, batch: int, tokens: int, max_pages: int, max_context: int) -> None:
        """Raise before the manager changes anything if a step does not fit the captured maxima."""
        if manager is not self.manager:
            raise ValueError("graph_buffers belong to another PagedKVCacheManager")
        for name, value, limit in (("requests", batch, self.max_batch_size), ("new rows", tokens, self.max_step_tokens),
                                   ("context length", max_context, self.max_context_length),
                                   ("pages per request", max_pages, self.max_pages)):
            if value > limit:
                raise ValueError(f"graph_buffers: the step has {value} {name}, more than the buffers' maximum "
                                 f"{limit}; build GraphStepBuffers for larger maxima (and capture again)")

    def fill(self, cache_lengths: np.ndarray, lookup_rows: np.ndarray, row_offsets: np.ndarray) -> None:
        """Write one step's host metadata (``B`` requests) into the buffers, padding requests after it."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have left the staging memory
        b, cols = lookup_rows.shape
        t = int(row_offsets[-1])
        rows, toks = max(b, self._batch), max(t, self._tokens)  # what this step or the last one touched
        lengths_h, lut_h, offsets_h, pos_h, last_h = (x.numpy() for x in self._host)
        null = self.manager.pool.null_page
        lengths_h[:b], lengths_h[b:rows] = cache_lengths, 0
        lut_h[:b, :cols], lut_h[:b, cols:], lut_h[b:rows] = lookup_rows, null, null
        offsets_h[:b + 1], offsets_h[b + 1:] = row_offsets, t  # every later request: no rows
        starts, runs = row_offsets[:-1].astype(np.int64), np.diff(row_offsets.astype(np.int64))
        pos_h[:t] = np.repeat(cache_lengths.astype(np.int64) - starts, runs) + np.arange(t)
        pos_h[t:toks] = 0
        last_h[:b] = np.where(runs > 0, starts + runs - 1, -1)
        last_h[b:rows] = 0
        for dev_tensors in self._device_tensors:
            for dst, src, n in zip(dev_tensors, self._host, (rows, rows, self.max_batch_size + 1, toks, rows)):
                dst[:n].copy_(src[:n], non_blocking=True)
        self._batch, self._tokens = b, t
        if self._device_tensors[0][0].is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
