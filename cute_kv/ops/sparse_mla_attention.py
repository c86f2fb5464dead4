"""``cute_kv.sparse_mla_attention`` (DeepSeek-V3.2 top-k MLA attention) and ``cute_kv.sparse_kv_index_remap``."""

from __future__ import annotations

from typing import Optional

import torch

from cute_kv.kernels.archs import is_blackwell
from cute_kv.ops import lse_layouts, paths
from cute_kv.ops.mla_decode_sm100 import SPARSE
from cute_kv.ops.paged_attention import check_logits_and_output, outputs
from cute_kv.reference import sparse_mla as reference
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_row_offsets, check_tensor, uint32_bits

OP = "sparse_mla_attention"
INT32_MAX = 2**31 - 1


def sparse_mla_attention(q: torch.Tensor, input_row_offsets: torch.Tensor, collection, layer_idx: int,
                         indices: torch.Tensor, *, mla_v_dim: int, scale: Optional[float] = None,
                         topk_lengths: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                         sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
                         out: Optional[torch.Tensor] = None, lse_layout: str = "TH",
                         lse: Optional[torch.Tensor] = None, validate: bool = True, plan=None):
    """Attention of each query token over the keys its ``indices`` select; returns ``[T, Hq, mla_v_dim]`` in
    ``q.dtype`` (or ``out``), or ``(out, lse)`` with ``return_lse``.

    ``q [T, Hq, latent_dim]`` over an MLA cache (KVD=1: bf16/fp16, fp8 with scales, or rope-aware FP8 read as its
    dequantized logical rows). ``indices`` int32 ``[T, topk]``: ENCODED rows ``physical_page * P + offset_in_page``
    (``sparse_kv_index_remap`` makes them from logical positions); -1 selects no key, and so do entries at or past
    ``topk_lengths[t]`` (int32 ``[T]``, optional). No causal mask: the indices decide. Values are the first
    ``mla_v_dim`` dims of the selected rows. ``scale`` (default ``1/sqrt(latent_dim)``), ``softcap``, ``sinks`` and
    the LSE (``return_lse``, ``lse_layout``, ``lse``) as in ``paged_attention``; a row that selects no key gives 0
    and ``lse = -inf`` (with a sink: 0 and the sink).

    ``validate=True`` rejects entries outside ``[-1, N*P)``, ``topk_lengths`` outside ``[0, topk]`` and bad
    ``input_row_offsets`` before anything runs. ``validate=False`` (CUDA-graph capture) skips those device reads;
    every entry outside ``[0, N*P)`` then still selects no key, and nothing outside the cache is read.

    ``plan`` (``cute_kv.plan_step``) has checked the step's offsets and keeps the path, launch shape and split-KV
    partials chosen by the first call of the same signature: the call reads no device value (the indices are not
    checked, as with ``validate=False``) and allocates only its outputs (``paged_attention``).
    """
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        path, workspace = plan.entry(
            call_key(OP, (q, indices, topk_lengths, sinks, out, lse), (mla_v_dim, scale, softcap, return_lse,
                                                                        lse_layout)),
            lambda: _planned(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths,
                             softcap, sinks, return_lse, out, lse_layout, lse, plan))
        out, lse, rows = outputs(q, mla_v_dim, out, return_lse, lse, lse_layout)
        _run(path, q, collection, layer_idx, indices, topk_lengths, mla_v_dim, scale, softcap or None, sinks, out,
             rows, workspace)
        return (out, lse_layouts.written(lse, rows, lse_layout)) if return_lse else out
    _check(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths, softcap, sinks,
           return_lse, out, validate, lse_layout, lse)
    input_row_offsets = uint32_bits(input_row_offsets)
    out, lse, rows = outputs(q, mla_v_dim, out, return_lse, lse, lse_layout)
    softcap = softcap or None  # 0 means off
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        torch.ops.cute_kv.sparse_mla_attention(q, input_row_offsets, c.traced_blocks(OP), c.cache_lengths,
                                               c.lookup_table, c.scales, layer_idx, c.max_seq_length,
                                               c.max_cache_length, c.quantization_granularity, c.rope_dim, indices,
                                               topk_lengths, mla_v_dim, scale, softcap, sinks, out, rows)
    else:
        dispatch(q, input_row_offsets, c, layer_idx, indices, topk_lengths, mla_v_dim, scale, softcap, sinks, out,
                 rows)
    return (out, lse_layouts.written(lse, rows, lse_layout)) if return_lse else out


def dispatch(q, input_row_offsets, collection, layer_idx, indices, topk_lengths, mla_v_dim, scale, softcap, sinks,
             out, lse) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides)."""
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, indices, topk_lengths, arch,
                                                                mla_v_dim, scale, softcap, sinks, lse is not None))
    _run(path, q, collection, layer_idx, indices, topk_lengths, mla_v_dim, scale, softcap, sinks, out, lse)


def _planned(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths, softcap, sinks,
             return_lse, out, lse_layout, lse, step) -> tuple:
    """The first call of a plan with this signature: checked (the offsets by the plan), routed, its launch sized
    once; ``(path, workspace)``, None for the reference."""
    _check(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths, softcap, sinks,
           return_lse, out, False, lse_layout, lse)
    step.check(OP, collection, input_row_offsets, *q.shape[:2])  # the shapes are the entry's key: once
    path = paths.route(OP, collection.device, lambda arch: plan(collection, q, indices, topk_lengths, arch,
                                                                mla_v_dim, scale, softcap or None, sinks,
                                                                return_lse))
    if path is None:
        return None, None
    return path, SPARSE.launch_workspace(path.key, q, indices)


def _run(path, q, collection, layer_idx, indices, topk_lengths, mla_v_dim, scale, softcap, sinks, out, lse,
         workspace=None) -> None:
    """The kernel of ``path`` (with ``workspace``: a plan's), or the reference for None."""
    if path is None:
        reference.sparse_mla_attention(q, collection, layer_idx, indices, mla_v_dim=mla_v_dim, scale=scale,
                                       topk_lengths=topk_lengths, softcap=softcap, sinks=sinks, out=out, lse=lse,
                                       return_lse=lse is not None)
        return
    SPARSE.launcher(path.key, path.arch)(q, collection, layer_idx, indices, topk_lengths=topk_lengths, scale=scale,
                                         softcap=softcap, sinks=sinks, out=out, lse=lse, workspace=workspace)


def explain(q, input_row_offsets, collection, layer_idx: int, indices, *, mla_v_dim: int,
            scale: Optional[float] = None, topk_lengths: Optional[torch.Tensor] = None,
            softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None, return_lse: bool = False,
            out: Optional[torch.Tensor] = None, lse_layout: str = "TH", lse: Optional[torch.Tensor] = None,
            validate: bool = True, arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(sparse_mla_attention, ...)``: the path this call takes on ``arch`` (default: q's device)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths, softcap, sinks,
           return_lse, out, validate, lse_layout, lse)
    return paths.planned(OP, collection.device, arch, lambda arch: plan(collection, q, indices, topk_lengths, arch,
                                                                         mla_v_dim, scale, softcap or None, sinks,
                                                                         return_lse))


def plan(collection, q, indices, topk_lengths, arch: str, mla_v_dim: int, scale: Optional[float] = None,
         softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
         return_lse: bool = False) -> paths.KernelPath:
    """The kernel serving these checked arguments on ``arch`` (``MlaDecodeSm100`` in sparse mode on Blackwell:
    the ``SPARSE`` backend's ``plan_sparse``), or why the reference runs instead. Host values only."""
    if not is_blackwell(arch):
        return paths.reference(OP, f"no sparse MLA kernel on {arch} yet (gather4 is SM100's)", arch)
    return SPARSE.plan(collection, q, indices, arch, mla_v_dim=mla_v_dim, scale=scale, topk_lengths=topk_lengths,
                       softcap=softcap, sinks=sinks, return_lse=return_lse)


def _check(q, input_row_offsets, collection, layer_idx, indices, mla_v_dim, scale, topk_lengths, softcap, sinks,
           return_lse, out, validate, lse_layout="TH", lse=None) -> None:
    """Every argument, before anything runs."""
    collection.check_layer(layer_idx)
    if not collection.is_mla:
        raise ValueError("sparse_mla_attention reads an MLA cache (KVD=1, one latent head); for this cache use "
                         "paged_attention")
    check_activation("q", q, collection, ndim=3)
    t, hq, d = q.shape
    if d != collection.latent_dim:
        raise ValueError(f"q's last dim ({d}) must equal the cache's latent_dim ({collection.latent_dim})")
    if hq == 0:
        raise ValueError("q must have at least one head")
    check_logits_and_output(q, collection, scale, softcap, sinks, return_lse, mla_v_dim, out, lse_layout, lse)
    dev = collection.device
    check_tensor("indices", indices, dtype=torch.int32, ndim=2, device=dev)
    if indices.shape[0] != t:
        raise ValueError(f"indices must have one row per query token ({t}), got shape {list(indices.shape)}")
    if topk_lengths is not None:
        check_tensor("topk_lengths", topk_lengths, dtype=torch.int32, shape=[t], device=dev)
    rows = collection.num_pages * collection.page_size
    if rows > INT32_MAX + 1:
        raise ValueError(f"the cache's {collection.num_pages} pages x {collection.page_size} slots exceed the int32 "
                         f"encoded indices (page * page_size + slot < 2^31); use fewer pages or smaller pages")
    check_row_offsets("input_row_offsets", input_row_offsets, collection.batch_size, t, dev, data_checks=validate)
    if not validate or torch.compiler.is_compiling() or indices.numel() == 0:
        return
    bad = (indices < -1) | (indices >= rows)
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"indices[{i}, {j}] = {int(indices[i, j])} is outside [-1, {rows}) (encoded rows "
                         f"page * {collection.page_size} + slot of {collection.num_pages} pages; -1: no key); "
                         f"sparse_kv_index_remap makes them from positions")
    if topk_lengths is not None and t:
        bad_len = (topk_lengths < 0) | (topk_lengths > indices.shape[1])
        if bool(bad_len.any()):
            i = int(bad_len.nonzero()[0])
            raise ValueError(f"topk_lengths[{i}] = {int(topk_lengths[i])} is outside [0, {indices.shape[1]}] "
                             f"(indices' topk)")


def sparse_kv_index_remap(positions: torch.Tensor, input_row_offsets: torch.Tensor, collection,
                          *, validate: bool = True) -> torch.Tensor:
    """MAX's ``paged_sparse_kv_index_remap``: logical key positions ``positions`` int32 ``[T, topk]`` of each query
    row's request (row ``r`` belongs to request ``b`` with ``input_row_offsets[b] <= r < input_row_offsets[b+1]``)
    -> encoded indices int32 ``[T, topk]`` for ``sparse_mla_attention``: ``lookup_table[b, pos // P] * P + pos % P``.
    ``-1`` passes through; a negative position, one past the lookup table's columns or on a page the request does
    not own (the sentinel) gives ``-1``. A PyTorch function (it runs as a few elementwise kernels on CUDA)."""
    c = collection
    check_tensor("positions", positions, dtype=torch.int32, ndim=2, device=c.device)
    check_row_offsets("input_row_offsets", input_row_offsets, c.batch_size, positions.shape[0], c.device,
                      data_checks=validate)
    if c.num_pages * c.page_size > INT32_MAX + 1:
        raise ValueError(f"the cache's {c.num_pages} pages x {c.page_size} slots exceed the int32 encoded indices")
    return reference.sparse_kv_index_remap(positions, uint32_bits(input_row_offsets), c)
