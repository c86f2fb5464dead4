"""Argument checks shared by every public entry point: fail before any launch, naming the argument."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch

from cute_kv.dtypes import is_fp8


def check_tensor(
    name: str,
    t,
    *,
    dtype: Optional[torch.dtype | Iterable[torch.dtype]] = None,
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    device: Optional[torch.device] = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Raise ``TypeError``/``ValueError`` naming ``name`` unless ``t`` is a tensor as described.

    ``shape`` entries of ``None`` match any extent.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            want = " or ".join(str(d) for d in allowed)
            raise TypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != e for s, e in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (row-major)")
    return t


METADATA_DTYPES = (torch.uint32, torch.int32)


def check_metadata_tensor(name: str, t, **kw) -> torch.Tensor:
    """Step metadata (offsets, lengths, lookup tables) in MAX's uint32 or the int32 every peer uses, returned as its
    uint32 bits (``uint32_bits``); ``kw`` as for ``check_tensor``."""
    if isinstance(t, torch.Tensor) and t.dtype not in METADATA_DTYPES:
        raise TypeError(f"{name} must have dtype torch.uint32 (MAX's) or torch.int32, got {t.dtype}; convert with "
                        f"{name}.to(torch.int32)")
    return uint32_bits(check_tensor(name, t, **kw))


def uint32_bits(t: torch.Tensor) -> torch.Tensor:
    """An int32 tensor viewed as uint32 (no copy), a uint32 one as it is: valid values have the same bits in both,
    and the kernels and checks read one dtype. A negative int32 reads as 2^31 or more, which the checks reject
    (``check_not_negative`` names it)."""
    return t.view(torch.uint32) if t.dtype == torch.int32 else t


# What a length past the pages or the bounds may mean: the peers' lengths count the step's tokens in.
NEW_TOKENS_HINT = ("cache_lengths counts the tokens cached before this step: if it counts the step's new tokens too, "
                   "as vLLM's seq_lens, SGLang's seq_lens, FA4's seqused_k and FlashInfer's kv_last_page_len do, "
                   "subtract them (cute_kv.adapters does)")

# What each metadata argument holds, for the message naming a negative entry.
NEGATIVE_FIX = {
    "cache_lengths": "cache_lengths counts each request's tokens already in the cache before this step (an engine's "
                     "lengths minus the step's new tokens: negative when a request has more new tokens than keys, "
                     "such as a padded request given query rows but no pages); pass the true lengths",
    "input_row_offsets": "offsets are prefix sums of the new-token counts, [0, n0, n0 + n1, ...]; build them with "
                         "cute_kv.input_row_offsets(new_lengths)",
}


def lookup_fix(num_pages: int) -> str:
    """What a negative lookup entry should be instead."""
    return (f"pages are indices >= 0: pad with the sentinel num_pages ({num_pages}), as "
            f"cute_kv.make_lookup_table(page_lists, sentinel={num_pages}) does, or with a valid page")


def negative_entry(name: str, index, value: int, fix: str) -> str:
    """The message for entry ``index`` (an int or a tuple) of metadata ``name``, whose int32 ``value`` is negative."""
    where = ", ".join(map(str, index)) if isinstance(index, tuple) else str(index)
    return f"{name}[{where}] is {value}: negative; {fix}"


def check_not_negative(name: str, bits: torch.Tensor, fix: Optional[str] = None) -> None:
    """Raise ``ValueError`` naming the first entry of ``bits`` (int32 metadata as ``uint32_bits``) that is negative
    as int32, ``2^31`` or more as uint32 (so ``-1`` is reported as -1, not 4294967295). It reads device values:
    call it once another check has failed, to say why, so a valid step costs no extra read."""
    signed = bits.view(torch.int32)
    negative = (signed < 0).nonzero()
    if negative.shape[0]:
        index = tuple(int(i) for i in negative[0])
        raise ValueError(negative_entry(name, index if len(index) > 1 else index[0], int(signed[index]),
                                        fix or NEGATIVE_FIX[name]))


def check_uint32_scalar(name: str, value) -> int:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got shape {tuple(value.shape)}")
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an int in [0, 2**32), got {value!r}")
    return value


def check_row_offsets(name: str, input_row_offsets, batch_size: int, total_rows: int, device, *,
                      data_checks: bool = True) -> Optional[torch.Tensor]:
    """``input_row_offsets``: uint32 (or int32) ``[B+1]``, starts at 0, non-decreasing, ends at ``total_rows``.

    Returns the offsets as int64 (torch's uint32 supports few ops). ``data_checks=False`` checks the dtype,
    shape and device only (the value checks read device memory) and returns None; so does a torch.compile trace,
    where reading a device value would break the graph.
    """
    ro = check_metadata_tensor(name, input_row_offsets, shape=[batch_size + 1], device=device)
    if batch_size == 0 and total_rows:  # a shape fact, checked even unvalidated: kernels would read request 0
        raise ValueError(f"{name} has no requests ([0]) but there are {total_rows} rows")
    if not data_checks or torch.compiler.is_compiling():
        return None
    bits, ro = ro, ro.to(torch.int64)
    # One device read for the three checks.
    first, last, decreasing = torch.stack([ro[0], ro[-1], (ro[1:] < ro[:-1]).any().to(torch.int64)]).tolist()
    if first != 0 or decreasing or last != total_rows:
        check_not_negative(name, bits, NEGATIVE_FIX["input_row_offsets"])
    if first != 0:
        raise ValueError(f"{name}[0] must be 0, got {first}")
    if decreasing:
        raise ValueError(f"{name} must be non-decreasing")
    if last != total_rows:
        raise ValueError(f"{name}[-1] ({last}) must equal the number of rows ({total_rows})")
    return ro


def check_activation(name: str, t, collection, *, ndim: int) -> torch.Tensor:
    """Activations of a cache op: on the cache's device, in the cache dtype (bf16/fp16/fp32 for fp8 caches)."""
    allowed = (torch.bfloat16, torch.float16, torch.float32) if is_fp8(collection.dtype) else (collection.dtype,)
    return check_tensor(name, t, dtype=allowed, ndim=ndim, device=collection.device)


def check_step(collection, input_row_offsets, total_rows: int, *, data_checks: bool = True) -> Optional[torch.Tensor]:
    """A ragged step of ``total_rows`` new tokens over ``collection``; returns the new lengths (int64 ``[B]``).

    Each request must own the pages of positions ``[0, cache_length + new)`` (what an op reads or writes)
    and fit ``max_seq_length`` / ``max_cache_length``, which kernels size their grids from.
    ``data_checks=False`` (and a torch.compile trace) checks only the offsets' dtype, shape and device and returns
    None: the other checks read device values, host syncs that CUDA-graph capture forbids.
    """
    ro = check_row_offsets("input_row_offsets", input_row_offsets, collection.batch_size, total_rows,
                           collection.device, data_checks=data_checks)
    if ro is None:
        return None
    lengths = ro[1:] - ro[:-1]
    if lengths.numel():
        if int(lengths.max()) > collection.max_seq_length:
            b = int(lengths.argmax())
            raise ValueError(f"input_row_offsets: request {b} has {int(lengths[b])} new tokens, more than the "
                             f"collection's max_seq_length ({collection.max_seq_length})")
        cached = collection.cache_lengths.to(torch.int64)
        ends = cached + lengths
        if int(ends.max()) > collection.max_cache_length:
            check_not_negative("cache_lengths", collection.cache_lengths)
            b = int(ends.argmax())
            raise ValueError(f"request {b} has cache_lengths[{b}] = {int(cached[b])} cached + {int(lengths[b])} new "
                             f"(input_row_offsets) = {int(ends[b])} tokens in context, more than the collection's "
                             f"max_cache_length ({collection.max_cache_length}); {NEW_TOKENS_HINT}")
    collection.check_writable("input_row_offsets", lengths)
    return lengths


def step_summary(collection, input_row_offsets, total_rows: Optional[int]) -> torch.Tensor:
    """int64 ``[3 + 2B]`` on the metadata's device: the last offset; 1 if ``check_step`` passes for ``total_rows``
    rows (None: the last offset's) else 0; one past the last position a new token takes (0 without tokens), which
    RoPE tables must cover; then each request's new tokens and its keys (cached + new). Every check reduced on the
    device, nothing read on the host, so a caller reads it all in one copy (``plan_step``); ``check_step`` then says
    what is wrong."""
    c = collection
    ro = uint32_bits(input_row_offsets).to(torch.int64)
    last = ro[-1]
    ok = (ro[0] == 0) & (ro[1:] >= ro[:-1]).all()
    if total_rows is not None:
        ok = ok & (last == total_rows)
    lengths = ro[1:] - ro[:-1]
    ends = c.cache_lengths.to(torch.int64) + lengths
    positions_end = torch.zeros_like(last)
    if c.batch_size:
        top = ends.max()
        ok = (ok & (lengths.max() <= c.max_seq_length) & (top <= c.max_cache_length)
              & (top <= c.lookup_table.shape[1] * c.page_size) & ~c.unowned_pages(ends).any())
        positions_end = torch.where(lengths > 0, ends, 0).max()
    return torch.cat([torch.stack([last, ok.to(torch.int64), positions_end]), lengths, ends])
