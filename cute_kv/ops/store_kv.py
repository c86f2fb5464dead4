"""``cute_kv.store_kv``: write a ragged step's new K/V rows into one layer of a paged KV cache."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from cute_kv import dtypes, reference, tensor_scales
from cute_kv.ops import paths
from cute_kv.ops.vectors import packed_heads
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

OP = "store_kv"
ROPE_AWARE_KEY = "paged_kv_store_rope_aware"  # plan keys of RopeAwareKVStore start with it


def store_kv(k: torch.Tensor, v: Optional[torch.Tensor], input_row_offsets: torch.Tensor, collection,
             layer_idx: int, *, k_scale=None, v_scale=None, validate: bool = True, plan=None) -> None:
    """Write new token ``i`` of request ``b`` (row ``ro[b] + i`` of ``k``/``v``) at position ``cache_lengths[b] + i``.

    ``k``, ``v``: ``[T, H, D]`` in the cache dtype; an fp8 cache takes bf16/fp16/fp32 and quantizes them
    per (token, head, granule) when the collection has scales (else a saturating cast). ``v`` must be
    ``None`` for an MLA cache (K only); a rope-aware MLA cache takes ``k [T, 1, latent_dim]`` (its logical rows) and
    stores the content quantized per token, the rope part as bf16 (``cute_kv/rope_aware.py``). ``k_scale`` /
    ``v_scale``: per-tensor scales of an fp8 cache without ``scales`` (vLLM's and FlashInfer's; floats or float32
    one-element tensors, ``cute_kv/tensor_scales.py``): values are stored as ``saturate(x / scale)``, no scale is
    written. ``input_row_offsets``: uint32 (MAX) or int32 ``[B+1]``. ``cache_lengths`` is not modified. Every
    argument is checked before anything is written.

    ``validate=False`` is for CUDA-graph capture: it skips the checks that read device values (the offsets, and
    each request's pages and lengths against the collection), so the caller guarantees the step fits the pages.
    Shapes, dtypes and devices are still checked. A torch.compile trace skips the same checks, so the default
    compiles with ``fullgraph=True``. CUDA calls that no kernel serves warn (``cute_kv.explain`` says why).

    ``plan`` (``cute_kv.plan_step`` of this collection and these offsets) has checked the step: the call reads no
    device value and reuses the path chosen by the first call of the same shapes (``validate`` is then moot).
    """
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        scaled = k_scale is not None or v_scale is not None
        run = plan.entry(call_key(OP, (k, v), (scaled,)),
                         lambda: _planned(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, plan))
        run(k, v, plan.offsets_bits, collection, layer_idx, k_scale=k_scale, v_scale=v_scale)
        return
    _check(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, validate)
    input_row_offsets = uint32_bits(input_row_offsets)  # int32 offsets: the same bits
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        k_scale, v_scale = (None if s is None else tensor_scales.as_tensor(s, c.device) for s in (k_scale, v_scale))
        torch.ops.cute_kv.store_kv(k, v, input_row_offsets, c.traced_blocks(OP), c.cache_lengths, c.lookup_table,
                                   c.scales, layer_idx, c.max_seq_length, c.max_cache_length,
                                   c.quantization_granularity, c.rope_dim, k_scale, v_scale)
    else:  # eager: the op's dispatcher would add ~14 µs of host time for nothing
        dispatch(k, v, input_row_offsets, c, layer_idx, k_scale, v_scale)


def dispatch(k, v, input_row_offsets, collection, layer_idx, k_scale=None, v_scale=None) -> None:
    """Checked arguments to the kernel serving them, else to the reference (``plan`` decides)."""
    scaled = k_scale is not None
    path = paths.route(OP, collection.device, lambda arch: plan(collection, k, arch, scaled))
    run = reference.store_kv if path is None else _launcher(path.key, path.arch)
    run(k, v, input_row_offsets, collection, layer_idx, k_scale=k_scale, v_scale=v_scale)


def _planned(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, step) -> Callable:
    """The first call of a plan with these shapes: checked (the step's values by the plan), then routed."""
    _check(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, False)
    step.check(OP, collection, input_row_offsets, k.shape[0])  # the shapes are the entry's key: once
    path = paths.route(OP, collection.device, lambda arch: plan(collection, k, arch, k_scale is not None))
    return reference.store_kv if path is None else _launcher(path.key, path.arch)


def explain(k, v, input_row_offsets, collection, layer_idx: int, *, k_scale=None, v_scale=None,
            validate: bool = True, arch: Optional[str] = None) -> paths.KernelPath:
    """``cute_kv.explain(store_kv, ...)``: the path this call takes on ``arch`` (default: the cache's device)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    _check(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, validate)
    return paths.planned(OP, collection.device, arch, lambda arch: plan(collection, k, arch, k_scale is not None))


def _check(k, v, input_row_offsets, collection, layer_idx, k_scale, v_scale, validate) -> None:
    collection.check_layer(layer_idx)
    rows = [None, collection.num_heads, collection.latent_dim]
    check_activation("k", k, collection, ndim=3)
    if k.shape[1] != collection.num_heads and k.shape[1] == collection.page_size:
        raise ValueError(f"k has {k.shape[1]} heads but the cache has {collection.num_heads} heads and pages of "
                         f"{collection.page_size} tokens: the cache's P and H look transposed, an HND cache "
                         f"([N, H, P, D]) taken as NHD ([N, P, H, D]); build the collection with from_kv(..., "
                         f"layout='HND') over the [N, P, H, D] views (tensor.permute(0, 2, 1, 3))")
    check_tensor("k", k, shape=rows)
    if collection.is_mla:
        if v is not None:
            raise ValueError("v must be None for an MLA cache (KVD=1 stores K only)")
    else:
        check_tensor("v", v, dtype=k.dtype, shape=[k.shape[0], *rows[1:]], device=collection.device)
    tensor_scales.check(k_scale, v_scale, collection, data_checks=validate)
    check_step(collection, input_row_offsets, k.shape[0], data_checks=validate)


def plan(collection, k, arch: str, tensor_scaled: bool = False) -> paths.KernelPath:
    """The ``PagedKVStore`` serving these arguments on ``arch`` (SM90 and SM100 alike), or why the reference runs
    instead: an fp8 cache with neither float32 scales nor per-tensor ones (``tensor_scaled``: ``k_scale`` /
    ``v_scale`` given; else a saturating cast) or whose granule the kernel cannot reduce in one warp, head dims that
    are not whole vectors, a misaligned cache. Rope-aware MLA rows take ``RopeAwareKVStore`` where their geometry
    fits it."""
    from cute_kv.kernels.cache.store import DTYPES, quantizable

    c = collection
    name = dtypes.dtype_name(k.dtype)
    if c.rope_dim is not None:
        return _plan_rope_aware(c, name, arch)
    granularity = None
    if c.dtype == torch.float8_e4m3fn and not tensor_scaled:  # (per tensor: any head of whole vectors)
        granularity = c.quantization_granularity
        if c.scales is None:
            return paths.reference(OP, "an fp8 cache without scales (a saturating cast) has no kernel", arch)
        if c.scale_dtype != torch.float32:
            return paths.reference(OP, f"the kernel quantizes with float32 scales, not {c.scale_dtype}", arch)
        if not quantizable(granularity, c.head_size):
            return paths.reference(OP, f"quantization granularity {granularity} is not a power of two in [8, 256] "
                                       f"dividing head_size {c.head_size}", arch)
    vec = 8 if granularity or tensor_scaled else 16 // k.element_size()
    if name not in DTYPES:
        return paths.reference(OP, f"k is {name}; the kernel takes {', '.join(DTYPES)}", arch)
    if c.head_size % vec:
        return paths.reference(OP, f"head_size {c.head_size} is not a whole number of {vec}-element vectors", arch)
    if c.key_blocks.data_ptr() % 16 or c.value_blocks.data_ptr() % 16:
        return paths.reference(OP, "blocks is not 16-byte aligned", arch)
    key = ("paged_kv_store", name, c.kv_dim, c.page_size, c.num_heads, c.head_size, granularity)
    # MAX's compact blocks keep their key (and kernel); other layouts add the strided flag, per-tensor scales the
    # layout and their flag
    if tensor_scaled:
        key += (c.layout_name, True)
    elif not c.is_compact:
        key += ("strided",)
    return paths.kernel(OP, "PagedKVStore", key, arch)


def _plan_rope_aware(c, name: str, arch: str) -> paths.KernelPath:
    """``RopeAwareKVStore`` for a rope-aware MLA cache, or why the reference runs instead."""
    from cute_kv.kernels.cache.store import DTYPES
    from cute_kv.kernels.cache.store_rope_aware import supported

    if name not in DTYPES:
        return paths.reference(OP, f"k is {name}; the kernel takes {', '.join(DTYPES)}", arch)
    problem = supported(c.padded_depth, c.rope_dim) or (not c.is_compact and "a strided cache")
    if problem:
        return paths.reference(OP, f"rope-aware rows: {problem}", arch)
    if c.blocks.data_ptr() % 16:
        return paths.reference(OP, "blocks is not 16-byte aligned", arch)
    key = (ROPE_AWARE_KEY, name, c.page_size, c.padded_depth, c.rope_dim)
    return paths.kernel(OP, "RopeAwareKVStore", key, arch)


def compile_unit(key: tuple, arch: str) -> tuple:
    """``(compile key, build)`` of the kernel for one ``plan`` key: what the launcher compiles and ``prebuild``
    compiles ahead."""

    def build():
        if key[0] == ROPE_AWARE_KEY:
            from cute_kv.kernels.cache.store_rope_aware import RopeAwareKVStore as kernel_class
        else:
            from cute_kv.kernels.cache.store import PagedKVStore as kernel_class
        kernel = kernel_class(*key[1:])
        return kernel.build() if hasattr(kernel, "build") else (kernel, *kernel.fake_args())

    return key, build


def _launcher(key: tuple, arch: str) -> Callable:
    from cute_kv.kernels.compile_cache import compiled

    fn = compiled(*compile_unit(key, arch), arch)
    tensor_scaled = key[8:] == (True,)
    # fp8 rows: vectors of 8 input values
    quantized = key[0] == ROPE_AWARE_KEY or key[6] is not None or tensor_scaled
    strided = "strided" in key[7:]

    def run(k, v, input_row_offsets, collection, layer_idx, k_scale=None, v_scale=None):
        if k.shape[0]:  # a grid of zero CTAs is a launch error
            vec = 8 if quantized else 16 // k.element_size()
            c = collection
            cache = (c.key_blocks, None if c.is_mla else c.value_blocks) if strided else (c.blocks,)
            scales = tensor_scales.kernel_arg(k_scale, v_scale, c.device) if tensor_scaled else c.scales
            fn(packed_heads(k, vec), packed_heads(v, vec), input_row_offsets.contiguous(), *cache, scales,
               c.cache_lengths.contiguous(), c.lookup_table, layer_idx)

    return run
