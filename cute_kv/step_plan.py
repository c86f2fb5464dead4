"""``cute_kv.plan_step``: a step's checks and launch choices made once, then reused by every layer's op call.

Per call, the ops (``store_kv``, ``fused_qkv_matmul_kv_cache``, ``paged_attention``, ``sparse_mla_attention``,
``mla_prefill``) check the step's metadata (device reads: a host sync each on CUDA) and choose a kernel and its
launch shape. The step is the same for every layer, so a ``StepPlan`` checks it once
(one device read, none with ``validate=False`` where the caller built the metadata, as the block manager does) and
keeps, per op and per layer-independent call signature (shapes, dtypes, flags), the chosen path, its launch shape
and its split-KV partials. A call with ``plan=`` then reads no device value, allocates only its outputs and does not
synchronise, so the partials are persistent buffers and the calls can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from cute_kv.validate import check_step, step_summary, uint32_bits


_MISSING = object()  # an entry may be None (the reference)


class StepPlan:
    """One step (``plan_step``): ``num_tokens`` rows (``T``), ``batch_size`` requests, and the per-op launch choices
    its calls have made (``entry``). It serves every layer whose collection shares the step's metadata (the same
    ``cache_lengths`` and ``lookup_table`` tensors, the same max lengths) and the cache's geometry (shape, dtype,
    strides, alignment, scales), which the checks and launch choices depend on: a cache tensor per layer is one
    collection each, or one ``from_kv`` of per-layer lists. Ops given ``plan=`` refuse other metadata, another cache
    geometry or other offsets, naming what differs. A plan is for one step: where the metadata tensors are reused
    (CUDA-graph buffers), plan again once their values change."""

    __slots__ = ("collection", "input_row_offsets", "offsets_bits", "num_tokens", "num_q_heads", "positions_end",
                 "lengths", "_entries", "_served")

    def __init__(self, collection, input_row_offsets: torch.Tensor, num_tokens: int, num_q_heads: Optional[int],
                 positions_end: Optional[int] = None, lengths: Optional[list[tuple[int, int]]] = None):
        self.collection = collection
        self.input_row_offsets = input_row_offsets
        self.offsets_bits = uint32_bits(input_row_offsets)
        self.num_tokens = num_tokens
        self.num_q_heads = num_q_heads
        self.positions_end = positions_end
        self.lengths = lengths  # (new tokens, keys) per request, when read
        self._entries: dict = {}
        self._served = {id(collection): collection}  # collections found to share the step (held: ids stay theirs)

    @property
    def batch_size(self) -> int:
        return self.collection.batch_size

    def check(self, op: str, collection, input_row_offsets, num_tokens: Optional[int] = None,
              num_q_heads: Optional[int] = None) -> None:
        """Raise ``ValueError`` unless a call of ``op`` is over this plan's step (host-only; ``num_tokens``: the
        call's rows, ``num_q_heads``: an attention's query heads, each checked where given)."""
        if self._served.get(id(collection)) is not collection:  # compared once per collection: host time per call
            problem = difference(self.collection, collection)
            if problem:
                raise ValueError(f"{op}: the plan does not serve this collection: {problem}. A plan serves the "
                                 f"layers of one step whose collections share its metadata and cache geometry; plan "
                                 f"this one with cute_kv.plan_step(collection, input_row_offsets, ...)")
            self._served[id(collection)] = collection
        if input_row_offsets is not self.input_row_offsets:
            raise ValueError(f"{op}: input_row_offsets is not the tensor the plan was made with; pass that one, or "
                             f"plan this step again")
        if num_tokens is not None and num_tokens != self.num_tokens:
            raise ValueError(f"{op}: the call has {num_tokens} rows but the plan's step has {self.num_tokens}")
        if None not in (num_q_heads, self.num_q_heads) and num_q_heads != self.num_q_heads:
            raise ValueError(f"{op}: q has {num_q_heads} heads but the plan was made with num_q_heads="
                             f"{self.num_q_heads}")

    def check_positions(self, op: str, freqs_cis: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``freqs_cis`` has a row for every new token's position (known when the plan
        checked the step; a ``validate=False`` plan's caller guarantees it, as a ``validate=False`` call's does)."""
        if self.positions_end is not None and self.positions_end > freqs_cis.shape[0]:
            raise ValueError(f"{op}: rope.freqs_cis has {freqs_cis.shape[0]} positions but the step reaches "
                             f"position {self.positions_end - 1}")

    def entry(self, key: tuple, prepare: Callable[[], object]):
        """What ``prepare()`` returned for ``key`` (an op and its layer-independent call signature), made on the
        first call with it."""
        try:
            found = self._entries.get(key, _MISSING)
        except TypeError:  # an unhashable argument: the first call's checks reject it
            return prepare()
        if found is _MISSING:
            found = self._entries[key] = prepare()
        return found

    def __repr__(self) -> str:
        return (f"StepPlan(batch={self.batch_size}, num_tokens={self.num_tokens}, num_q_heads={self.num_q_heads}, "
                f"entries={len(self._entries)})")


# What of a cache the plan's checks and launch choices depend on, besides the step's metadata.
GEOMETRY = (
    ("shape [N, KVD, L, P, H, D]", lambda c: list(c.shape)),
    ("dtype", lambda c: c.dtype),
    ("device", lambda c: c.device),
    ("layout", lambda c: c.layout_name),
    ("K/V strides [N, L, P, H, D]", lambda c: list(c.key_blocks.stride())),
    ("K/V 16-byte alignment (data_ptr % 16)", lambda c: (c.key_blocks.data_ptr() % 16,
                                                         c.value_blocks.data_ptr() % 16)),
    ("scales", lambda c: None if c.scales is None
        else (c.scale_dtype, list(c.scales.shape), c.quantization_granularity)),
    ("rope_dim", lambda c: c.rope_dim),
)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one memory read the same way (an int32 tensor and its uint32 view included)."""
    return (a.data_ptr(), a.shape, a.stride(), a.device) == (b.data_ptr(), b.shape, b.stride(), b.device)


def difference(planned, other) -> Optional[str]:
    """What of collection ``other`` differs from ``planned`` (a plan's) in the step's metadata or the cache geometry
    (``GEOMETRY``), said for a message; None when a plan of ``planned`` serves ``other``. Host-only: the metadata
    must be the same tensors, as their values are what the plan read."""
    if planned.step_id != other.step_id:
        return f"it belongs to manager step {other.step_id}, the plan to step {planned.step_id}"
    for name in ("cache_lengths", "lookup_table"):
        if not _same_tensor(getattr(planned, name), getattr(other, name)):
            return f"its {name} is not the tensor the plan checked (another step's metadata?)"
    for name in ("max_seq_length", "max_cache_length"):
        if getattr(planned, name) != getattr(other, name):
            return f"its {name} is {getattr(other, name)}, the plan's {getattr(planned, name)}"
    for name, get in GEOMETRY:
        if get(planned) != get(other):
            return f"its cache's {name} is {get(other)}, the plan's {get(planned)}"
    return None


def signature(x) -> object:
    """What the calls of a plan must share of an argument for one check and one path to serve them all: a tensor's
    shape, strides, dtype, device and 16-byte alignment; a dataclass's (``RopeConfig``, ``QKNorm``, quantized
    weights) fields; a scalar's type and value; anything else its type, for the first call to reject."""
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16
    if x is None or isinstance(x, (bool, int, float, str)):
        return type(x), x
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x), *(signature(getattr(x, f.name)) for f in dataclasses.fields(x))
    return type(x)


def call_key(op: str, tensors: tuple, values: tuple) -> tuple:
    """A plan entry's key: ``op``, the ``signature`` of each of ``tensors`` (tensors, dataclasses, None) and the
    scalar ``values`` with their types (``True`` and ``1`` are equal keys but not equally valid arguments)."""
    return op, *map(signature, tensors), values, tuple(map(type, values))


def plan_step(collection, input_row_offsets: torch.Tensor, *, num_q_heads: Optional[int] = None,
              num_tokens: Optional[int] = None, validate: bool = True) -> StepPlan:
    """Check a step once and return its ``StepPlan``, for ops called with ``plan=`` on every layer of the step
    (``StepPlan`` says which collections it serves).

    ``num_tokens``: the step's rows ``T`` (``input_row_offsets[-1]``); without it, it is read with the checks.
    ``num_q_heads``: the attention's query heads, when known (attention calls with other heads are refused). The
    checks are those of the per-call ops (``check_step``), all reduced on the metadata's device and read in one
    device-to-host copy with the step's lengths (``mla_prefill`` sizes its temporary cache from them); an invalid
    step is then checked again as the ops do, for the message. ``validate=False`` reads nothing: the caller
    guarantees the metadata (the block manager builds them), and must give ``num_tokens``.
    """
    if num_tokens is None:
        if not validate:
            raise ValueError("plan_step(validate=False) reads nothing: pass num_tokens (the step's rows)")
    elif isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be an int >= 0 or None, got {num_tokens!r}")
    if num_q_heads is not None and (isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int)
                                    or num_q_heads <= 0):
        raise ValueError(f"num_q_heads must be a positive int or None, got {num_q_heads!r}")
    collection = collection.layer(0)[0]  # per-layer tensors: the layers share the metadata and geometry
    # Dtype, shape and device first: they need no read (T only matters to the empty-batch check).
    check_step(collection, input_row_offsets, num_tokens or 0, data_checks=False)
    if validate:
        summary = step_summary(collection, input_row_offsets, num_tokens).tolist()  # the one read
        (rows, ok, positions_end), b = summary[:3], collection.batch_size
        if num_tokens is None:
            num_tokens = rows
        if not ok:  # the per-call checks say what is wrong (they test the same, reading more)
            check_step(collection, input_row_offsets, num_tokens)
        return StepPlan(collection, input_row_offsets, num_tokens, num_q_heads, positions_end,
                        list(zip(summary[3:3 + b], summary[3 + b:])))
    return StepPlan(collection, input_row_offsets, num_tokens, num_q_heads)
