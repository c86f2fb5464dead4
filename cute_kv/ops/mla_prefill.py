"""``cute_kv.mla_prefill``: MLA attention of a prefill step, by the decompressed or the absorbed path per step.

Query head ``h`` has ``q_nope [nope_dim]`` and ``q_rope [rope_dim]``; the cache holds latent rows ``[c_kv
(kv_lora_rank) | k_rope (rope_dim)]`` (``cute_kv/reference/mla_prefill.py`` has the two formulations and their
FLOPs). Each step takes the path of fewer FLOPs (``plan``), summed over its requests with the causal mask's visible
(query, key) pairs: ``T * S - T (T - 1) / 2`` for ``T`` new tokens over ``S`` keys.

* decompressed (MAX's ``mla_prefill``): the latent rows of every request with new tokens are gathered (rope-aware
  FP8 rows dequantized), up-projected by two cuBLAS matmuls (``c_kv W_UK^T``, ``c_kv W_UV^T``, every head at once)
  into a temporary paged cache of pages of ``PAGE`` tokens, KVD = 2, one head per query head: K rows ``[k_nope |
  k_rope | 0]`` and V rows ``[v | unused]`` of ``head_dim`` columns; then a dense causal attention over it with the
  step's ``cache_lengths`` and ``input_row_offsets``. A request's pages are consecutive, so the temporary lookup
  table is an iota per request.
* absorbed (what decode runs): ``q_lat = W_UK^T q_nope`` by a batched matmul, ``paged_attention`` of ``[q_lat |
  q_rope]`` over the latent cache (``mla_v_dim = kv_lora_rank``: the MLA decode kernels), ``W_UV`` on its output.

Per (query, key) pair the absorbed path costs ``2H (2 r + rope)`` FLOPs, the decompressed one ``2H (qk + pv)``; the
absorbed path projects every query (``2 H r (nope + v)`` each), the decompressed one every key. At DeepSeek-V3
shapes (H = 128, r = 512, rope 64, nope = v = 128; per request, all pairs):

* SM100 and SM90: ``PagedAttentionSm100`` / ``PagedAttention`` at head dim 192 with values of 128 (``qk + pv =
  320``: 81,920 FLOPs a pair against 278,528). Decompressed wins for ``1/T - 1/S < 196,608 / 33,554,432 =
  1/170.7``: chunks of about 171 new tokens or more (any fresh prompt: ``T = S``). 4k prefill: 1.51 TFLOP against
  4.81 (3.2x fewer); 512 new over 4k keys: 0.31 against 0.60 (1.9x).
* Other head dims: padded to the smallest kernel head dim that holds ``nope + rope`` and ``v`` (or unpadded, for
  the reference). CPU tensors take the SM100 rule (``qk + pv = nope + rope + v``) and the reference attention.

The counts leave out memory traffic: the decompressed path also writes and reads its temporary K/V (``S * H * 2 *
head_dim`` 16-bit values); the thresholds are FLOP counts, not timings. The step's lengths are read on the host (one
device-to-host copy) to size the temporary cache: this op is not for CUDA-graph capture.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Optional

import torch

from cute_kv.dtypes import dtype_name
from cute_kv.kernels.archs import generation
from cute_kv.kernels.attention.config import BM, DTYPE_NAMES, HEAD_DIMS, VALUE_DIMS
from cute_kv.kernels.attention.sm100_config import q_tiles
from cute_kv.ops import paths, units
from cute_kv.step_plan import call_key
from cute_kv.validate import check_activation, check_step, check_tensor, uint32_bits

OP = "mla_prefill"
KEYS = {"sm_90a": "mla_prefill_sm90", "sm_100a": "mla_prefill_sm100"}  # the route's compile key, per arch
KERNELS = {"sm_90a": "PagedAttention", "sm_100a": "PagedAttentionSm100"}
DECOMPRESSED, ABSORBED = "decompressed", "absorbed"
PAGE = 128  # tokens per page of the temporary cache: one key tile of the kernels at head dims 64-192


@dataclasses.dataclass(frozen=True)
class Route:
    """A step's path (``DECOMPRESSED`` or ``ABSORBED``), both paths' FLOPs, and how the decompressed path runs:
    the temporary cache's row width ``head_dim`` and the kernel it launches itself (SM100 at 192/128; None: it runs
    ``paged_attention`` on the temporary cache, which plans its own kernel)."""

    path: str
    flops: dict
    head_dim: int
    kernel: Optional[paths.KernelPath] = None


def mla_prefill(q_nope: torch.Tensor, q_rope: torch.Tensor, input_row_offsets: torch.Tensor, collection,
                layer_idx: int, w_uk: torch.Tensor, w_uv: torch.Tensor, *, scale: Optional[float] = None,
                causal: bool = True, out: Optional[torch.Tensor] = None, validate: bool = True,
                plan=None) -> torch.Tensor:
    """MLA attention of ``q_nope [T, H, nope_dim]``, ``q_rope [T, H, rope_dim]`` over layer ``layer_idx`` of an MLA
    cache (KVD = 1: bf16/fp16/fp32, fp8 with scales, or rope-aware FP8); returns ``[T, H, v_dim]`` in q's dtype (or
    ``out``). ``w_uk [H, nope_dim, kv_lora_rank]``, ``w_uv [H, v_dim, kv_lora_rank]`` in q's dtype;
    ``kv_lora_rank + rope_dim`` is the cache's ``latent_dim``. Query ``i`` of request ``b`` sees keys ``j <=
    cache_lengths[b] + i`` (``causal``) of its request; this step's latent rows must be stored. ``scale`` defaults
    to ``1/sqrt(nope_dim + rope_dim)``. The path (decompressed or absorbed) is chosen per step: see the module.
    ``validate=False`` skips the checks of ``input_row_offsets`` that read device values.

    ``plan`` (``cute_kv.plan_step``) has checked the step and read its lengths (a ``validate=False`` plan: read on
    the first call): the path, the temporary cache's layout and buffers, and the launch are chosen once for every
    layer, whose call reads no device value (the decompressed path still allocates its up-projected operands)."""
    collection, layer_idx = collection.layer(layer_idx)  # per-layer tensors: that layer's own collection
    if plan is not None and not torch.compiler.is_compiling():  # traced: the custom op below, as without a plan
        plan.check(OP, collection, input_row_offsets)
        v_dim, run = plan.entry(call_key(OP, (q_nope, q_rope, w_uk, w_uv, out), (scale, causal)),
                                lambda: _planned(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk,
                                                 w_uv, scale, causal, out, plan))
        if out is None:
            out = torch.empty((*q_nope.shape[:2], v_dim), dtype=q_nope.dtype, device=q_nope.device)
        if run is not None:
            run(q_nope, q_rope, layer_idx, w_uk, w_uv, out)
        return out
    v_dim = _check(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out,
                   validate)
    input_row_offsets = uint32_bits(input_row_offsets)
    if out is None:
        out = torch.empty((*q_nope.shape[:2], v_dim), dtype=q_nope.dtype, device=q_nope.device)
    c = collection
    if torch.compiler.is_compiling():  # traced: the custom op declares what it writes
        torch.ops.cute_kv.mla_prefill(q_nope, q_rope, input_row_offsets, c.traced_blocks(OP), c.cache_lengths,
                                      c.lookup_table, c.scales, layer_idx, c.max_seq_length, c.max_cache_length,
                                      c.quantization_granularity, c.rope_dim, w_uk, w_uv, scale, causal, out)
    else:
        dispatch(q_nope, q_rope, input_row_offsets, c, layer_idx, w_uk, w_uv, scale, causal, out)
    return out


def _check(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out,
           validate) -> int:
    """Every argument, before anything runs; returns ``v_dim``."""
    c = collection
    c.check_layer(layer_idx)
    if not c.is_mla or c.num_heads != 1:
        raise ValueError("mla_prefill reads an MLA cache (KVD=1, one latent head); this cache has "
                         f"KVD={c.kv_dim}, {c.num_heads} heads")
    check_activation("q_nope", q_nope, c, ndim=3)
    t, h, nope = q_nope.shape
    if h == 0 or nope == 0:
        raise ValueError(f"q_nope must have heads and dims, got shape {list(q_nope.shape)}")
    check_tensor("q_rope", q_rope, dtype=q_nope.dtype, ndim=3, device=c.device)
    if q_rope.shape[:2] != q_nope.shape[:2] or q_rope.shape[2] == 0:
        raise ValueError(f"q_rope must be [T={t}, H={h}, rope_dim > 0], got {list(q_rope.shape)}")
    check_tensor("w_uk", w_uk, dtype=q_nope.dtype, ndim=3, device=c.device)
    r = w_uk.shape[2]
    if list(w_uk.shape[:2]) != [h, nope]:
        raise ValueError(f"w_uk must be [H={h}, nope_dim={nope}, kv_lora_rank], got {list(w_uk.shape)}")
    if r + q_rope.shape[2] != c.latent_dim:
        raise ValueError(f"kv_lora_rank ({r}, w_uk.shape[2]) + rope_dim ({q_rope.shape[2]}) must equal the cache's "
                         f"latent_dim ({c.latent_dim})")
    check_tensor("w_uv", w_uv, dtype=q_nope.dtype, ndim=3, device=c.device)
    if w_uv.shape[0] != h or w_uv.shape[2] != r or w_uv.shape[1] == 0:
        raise ValueError(f"w_uv must be [H={h}, v_dim, kv_lora_rank={r}], got {list(w_uv.shape)}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    v_dim = w_uv.shape[1]
    if out is not None:
        check_tensor("out", out, dtype=q_nope.dtype, shape=[t, h, v_dim], device=c.device)
    check_step(c, input_row_offsets, t, data_checks=validate)
    return v_dim


def step_lengths(input_row_offsets: torch.Tensor, cache_lengths: torch.Tensor) -> list[tuple[int, int]]:
    """``(new tokens T, keys S)`` of every request, on the host (one copy from the device)."""
    ro = input_row_offsets.to(torch.int64).tolist()
    return [(ro[b + 1] - ro[b], cl + ro[b + 1] - ro[b]) for b, cl in enumerate(cache_lengths.to(torch.int64).tolist())]


def path_flops(num_q: int, num_keys: int, causal: bool, *, num_heads: int, kv_lora_rank: int, rope_dim: int,
               nope_dim: int, v_dim: int, qk_dim: int, pv_dim: int) -> dict[str, int]:
    """Matmul FLOPs of one request's ``num_q`` queries over ``num_keys`` keys on each path, over the visible pairs
    (``reference.mla_prefill.flops`` counts all pairs); the decompressed attention's dims ``qk_dim`` (``nope_dim +
    rope_dim``, or padded) and ``pv_dim`` (``v_dim``, or padded)."""
    if num_q == 0:
        return {ABSORBED: 0, DECOMPRESSED: 0}  # no query: its keys are neither read nor decompressed
    pairs = num_q * num_keys - (num_q * (num_q - 1) // 2 if causal else 0)
    h, r = num_heads, kv_lora_rank
    projection = 2 * h * r * (nope_dim + v_dim)
    return {ABSORBED: pairs * 2 * h * (2 * r + rope_dim) + num_q * projection,
            DECOMPRESSED: pairs * 2 * h * (qk_dim + pv_dim) + num_keys * projection}


def plan(lengths: list[tuple[int, int]], *, num_heads: int, kv_lora_rank: int, rope_dim: int, nope_dim: int,
         v_dim: int, dtype: str, arch: Optional[str], causal: bool = True) -> Route:
    """The step's path on ``arch`` (None: off CUDA) for ``lengths`` (``step_lengths``): the one of fewer FLOPs
    (decompressed on a tie), with the decompressed attention's dims as the kernel of ``arch`` runs them; the SM100
    kernel only for a grid within CUDA's limits (``splits.grid_problem``)."""
    from cute_kv.ops.splits import grid_problem

    qk = nope_dim + rope_dim
    gen = None if arch is None else generation(arch)  # sm_103a runs the sm_100a kernels
    native = arch is None or (gen in KERNELS and VALUE_DIMS.get(qk) == v_dim and dtype in DTYPE_NAMES)
    wide = max(qk, v_dim)
    head_dim = wide if native else min((d for d in HEAD_DIMS if d >= wide), default=wide)
    pv = v_dim if native else head_dim
    total = {ABSORBED: 0, DECOMPRESSED: 0}
    for num_q, num_keys in lengths:
        for path, f in path_flops(num_q, num_keys, causal, num_heads=num_heads, kv_lora_rank=kv_lora_rank,
                                  rope_dim=rope_dim, nope_dim=nope_dim, v_dim=v_dim, qk_dim=head_dim,
                                  pv_dim=pv).items():
            total[path] += f
    path = DECOMPRESSED if total[DECOMPRESSED] <= total[ABSORBED] else ABSORBED
    kernel = None
    # The temporary cache has the step's requests, a KV head per query head and its longest run; a grid past CUDA's
    # limits leaves the attention to paged_attention, whose plan takes the reference (with the reason). SM100's key
    # holds its Q tiles (one: a group of 1), which size the host's grid too (``prefill_workspace``).
    longest = max((n for n, _ in lengths), default=0)
    tiles = (q_tiles(qk, v_dim, page_size=PAGE, group=1, rows=longest),) if gen == "sm_100a" else ()
    rows = BM * max(tiles, default=1)
    if native and arch is not None and not grid_problem(len(lengths), num_heads, -(-longest // rows)):
        key = (KEYS[gen], dtype, num_heads, num_heads, qk, PAGE, 2, True, False, False, False, dtype, None, False,
               *tiles, v_dim)
        kernel = paths.kernel(OP, KERNELS[gen], key, arch)
    return Route(path, total, head_dim, kernel)


def dispatch(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out) -> None:
    """Checked arguments to the step's path, writing ``out``."""
    if q_nope.shape[0] == 0:
        return
    lengths = step_lengths(input_row_offsets, collection.cache_lengths)
    _runner(q_nope, q_rope, input_row_offsets, collection, w_uk, w_uv, scale, causal, lengths)(
        q_nope, q_rope, layer_idx, w_uk, w_uv, out)


def _planned(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out,
             step) -> tuple[int, Optional[Callable]]:
    """The first call of a plan with this signature: checked (the step's values by the plan), then its path and
    buffers chosen for every layer; ``(v_dim, run)``, no run for a step without tokens."""
    v_dim = _check(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out, False)
    step.check(OP, collection, input_row_offsets, *q_nope.shape[:2])  # the shapes are the entry's key: once
    if q_nope.shape[0] == 0:
        return v_dim, None
    lengths = step.lengths if step.lengths is not None else step_lengths(input_row_offsets, collection.cache_lengths)
    return v_dim, _runner(q_nope, q_rope, input_row_offsets, collection, w_uk, w_uv, scale, causal, lengths, step)


def _runner(q_nope, q_rope, input_row_offsets, collection, w_uk, w_uv, scale, causal, lengths,
            step=None) -> Callable:
    """``run(q_nope, q_rope, layer_idx, w_uk, w_uv, out)`` for the step's path (``plan``), its temporary cache and
    launch made here; with a ``StepPlan`` ``step``, the attention is planned too (``plan=``), so every layer reuses
    them."""
    c, (t, h, nope) = collection, q_nope.shape
    scale = 1.0 / math.sqrt(nope + q_rope.shape[2]) if scale is None else scale
    route = plan(lengths, num_heads=h, kv_lora_rank=w_uk.shape[2], rope_dim=q_rope.shape[2], nope_dim=nope,
                 v_dim=w_uv.shape[1], dtype=dtype_name(q_nope.dtype), arch=paths.device_arch(c.device), causal=causal)
    if route.path == ABSORBED:
        def run(q_nope, q_rope, layer_idx, w_uk, w_uv, out):
            absorbed(q_nope, q_rope, input_row_offsets, c, layer_idx, w_uk, w_uv, scale, causal, out, step)

        return run
    tmp = temporary_cache(c, lengths, h, route.head_dim, q_nope.dtype, q_nope.device)
    if route.kernel is not None:
        key, arch = route.kernel.key, route.kernel.arch
        launch = functools.partial(_launcher(key, arch), workspace=None if step is None else prefill_workspace(
            key, arch, tmp.cache, t, q_nope.device, causal))

        def run(q_nope, q_rope, layer_idx, w_uk, w_uv, out):
            q = decompress(q_nope, q_rope, c, layer_idx, w_uk, w_uv, tmp)
            launch(q, uint32_bits(input_row_offsets), tmp.cache, scale, causal, out)

        return run
    from cute_kv.ops.paged_attention import paged_attention
    from cute_kv.step_plan import plan_step

    sub = None if step is None else plan_step(tmp.cache, input_row_offsets, num_tokens=t, validate=False)

    def run(q_nope, q_rope, layer_idx, w_uk, w_uv, out):
        q = decompress(q_nope, q_rope, c, layer_idx, w_uk, w_uv, tmp)
        o = paged_attention(q, input_row_offsets, tmp.cache, 0, causal=causal, scale=scale, validate=False, plan=sub)
        out.copy_(o[..., :out.shape[2]])

    return run


def absorbed(q_nope, q_rope, input_row_offsets, collection, layer_idx, w_uk, w_uv, scale, causal, out,
             step=None) -> None:
    """``W_UV (attention of [W_UK^T q_nope | q_rope] over the latent rows)``, the matmuls batched over heads; the
    attention planned by ``step`` when given."""
    from cute_kv.ops.paged_attention import paged_attention

    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk)  # [H, T, r]
    q = torch.cat([q_lat.transpose(0, 1), q_rope], dim=2)
    o_lat = paged_attention(q, input_row_offsets, collection, layer_idx, causal=causal, scale=scale,
                            mla_v_dim=w_uk.shape[2], validate=False, plan=step)
    out.copy_(torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1))


def decompressed_operands(q_nope, q_rope, collection, layer_idx, w_uk, w_uv, lengths: list[tuple[int, int]],
                          head_dim: int):
    """``(q [T, H, head_dim], temporary cache)``: ``temporary_cache`` for the step, filled for ``layer_idx``
    (``decompress``)."""
    tmp = temporary_cache(collection, lengths, q_nope.shape[1], head_dim, q_nope.dtype, q_nope.device)
    return decompress(q_nope, q_rope, collection, layer_idx, w_uk, w_uv, tmp), tmp.cache


@dataclasses.dataclass(frozen=True)
class Temporary:
    """The decompressed path's temporary cache for one step (every layer refills it) and where its rows come from:
    each temporary page's request ``owner``, the positions ``pos [pages, PAGE]`` its rows hold and the request's
    ``keys``."""

    cache: object
    owner: torch.Tensor
    pos: torch.Tensor
    keys: torch.Tensor


def temporary_cache(collection, lengths: list[tuple[int, int]], num_heads: int, head_dim: int, dtype,
                    device) -> Temporary:
    """The temporary cache (``PAGE``-token pages, KVD = 2, L = 1, H heads of ``head_dim``) holding each request's
    keys (requests with new tokens) on consecutive pages, with the step's ``cache_lengths`` and this layout's lookup
    table; its rows are left for ``decompress`` to write."""
    from cute_kv.collection import PagedKVCacheCollection

    c = collection
    owner, first, keys = [], [], []  # each temporary page's request, index among its pages, request's keys
    # Sized by the step's own lengths (the grid too), not the collection's maxima: they only bound them.
    max_seq_length = max(num_q for num_q, _ in lengths)
    max_cache_length = max(num_keys for num_q, num_keys in lengths if num_q)
    lut = torch.zeros((c.batch_size, -(-max_cache_length // PAGE)), dtype=torch.int64)
    for b, (num_q, num_keys) in enumerate(lengths):
        if num_q:
            pages = -(-num_keys // PAGE)
            lut[b, :pages] = torch.arange(len(owner), len(owner) + pages)
            owner += [b] * pages
            first += range(pages)
            keys += [num_keys] * pages
    owner_t, first_t, keys_t = torch.tensor([owner, first, keys], dtype=torch.int64).to(device)
    pos = first_t[:, None] * PAGE + torch.arange(PAGE, device=device)
    blocks = torch.empty((len(owner), 2, 1, PAGE, num_heads, head_dim), dtype=dtype, device=device)
    tmp = PagedKVCacheCollection(blocks, c.cache_lengths, lut.to(device=device, dtype=torch.int32), max_seq_length,
                                 max_cache_length, validate=False)
    return Temporary(tmp, owner_t, pos, keys_t)


def decompress(q_nope, q_rope, collection, layer_idx, w_uk, w_uv, tmp: Temporary) -> torch.Tensor:
    """Write layer ``layer_idx``'s keys into ``tmp``: K rows ``[W_UK c_kv | k_rope | 0]`` and V rows ``[W_UV c_kv |
    unwritten]``, zero rows past the keys of a request's last page; returns q, ``[q_nope | q_rope | 0]``."""
    t, h, nope = q_nope.shape
    r, rope, v_dim = w_uk.shape[2], q_rope.shape[2], w_uv.shape[1]
    blocks = tmp.cache.blocks
    pages, head_dim = blocks.shape[0], blocks.shape[-1]
    latent = _latent_rows(collection, layer_idx, tmp.owner, tmp.pos, tmp.keys, q_nope.dtype)  # [pages*PAGE, r+rope]
    k, v = blocks[:, 0, 0], blocks[:, 1, 0]  # [pages, PAGE, H, head_dim]
    shape = (pages, PAGE, h, -1)
    # c_kv [rows, r] times W^T [r, H*dim] (a transposed view: no copy of the weights): every head in one matmul.
    k[..., :nope] = torch.matmul(latent[:, :r], w_uk.flatten(0, 1).T).view(shape)
    k[..., nope:nope + rope] = latent[:, None, r:].view(pages, PAGE, 1, rope)
    k[..., nope + rope:] = 0  # q's padding is 0 too: the products are exactly 0
    # V's padding columns stay unwritten: an output column reads only its own V column, and out's padding columns
    # are sliced away (the SM100 kernel does not load them).
    v[..., :v_dim] = torch.matmul(latent[:, :r], w_uv.flatten(0, 1).T).view(shape)
    return torch.cat([q_nope, q_rope, q_nope.new_zeros((t, h, head_dim - nope - rope))], dim=2)


def _latent_rows(collection, layer_idx: int, owner: torch.Tensor, pos: torch.Tensor, num_keys: torch.Tensor,
                 dtype) -> torch.Tensor:
    """Latent rows ``[pages * PAGE, latent_dim]`` in ``dtype`` at positions ``pos [pages, PAGE]`` of requests
    ``owner [pages]`` of ``num_keys [pages]`` keys (dequantized, rope-aware FP8 rows decoded), 0 past the keys and
    where the lookup entry names no page of the cache (a sentinel)."""
    c = collection
    cache = c.get_key_cache(layer_idx)
    lut = c.lookup_table.to(torch.int64)
    cols = torch.clamp(pos // c.page_size, max=lut.shape[1] - 1)
    pages = lut[owner[:, None], cols]
    valid = (pos < num_keys[:, None]) & (pages < c.num_pages)
    rows = torch.where(valid, pages * cache.stride_rows + pos % c.page_size, 0).flatten()
    latent = cache.read_rows(rows, dtype)[:, 0]
    return latent.masked_fill_(~valid.flatten()[:, None], 0)


def compile_units(key: tuple, arch: str) -> list[tuple]:
    """``(compile key, build)`` of ``arch``'s attention kernel (``KERNELS``) at ``key``'s head and value dims, and
    its split-KV combine over the value columns."""
    def kernel_class():
        if arch == "sm_90a":
            from cute_kv.kernels.attention.sm90 import PagedAttention

            return PagedAttention
        from cute_kv.kernels.attention.sm100 import PagedAttentionSm100

        return PagedAttentionSm100

    return units.with_combine(key, kernel_class, key[1], key[2], key[-1], key[10])


def prefill_workspace(key: tuple, arch: str, tmp, num_tokens: int, device, causal: bool) -> tuple:
    """``(m_blocks, splits, o_part, lse_part)`` of the launch of ``key`` on ``arch`` over the temporary cache ``tmp``
    (``paged_attention_sm90.launch_workspace``)."""
    from cute_kv.kernels.attention import config, sm100_config
    from cute_kv.ops.splits import launch_shape, partials, sm_count

    h, d, v_dim = key[2], key[4], key[-1]
    key_tile, rows = (config.key_tile, BM) if arch == "sm_90a" else (sm100_config.key_tile, key[14] * BM)  # Q tiles
    m_blocks, splits = launch_shape(tmp, h, sm_count(device), rows, key_tile(d, v_dim), causal, num_tokens=num_tokens)
    return m_blocks, splits, *partials(splits, num_tokens, h, v_dim, device)


@functools.lru_cache(maxsize=None)
def _launcher(key: tuple, arch: str) -> Callable:
    """``run(q, input_row_offsets, tmp, scale, causal, out)`` for one compile-time key, built once: ``arch``'s
    kernel over the temporary cache, ``out`` its ``v_dim`` columns (``paged_attention_sm90`` / ``_sm100``'s
    launches: no sinks, scales, window or lse)."""
    from cute_kv.kernels.attention.config import VEC
    from cute_kv.ops.kernel_args import score_args, softmax_args
    from cute_kv.ops.splits import launch_and_combine, unused_lse

    h, d, v_dim = key[2], key[4], key[-1]  # SM100's key has its Q tiles before v_dim
    units = compile_units(key, arch)

    def run(q, input_row_offsets, tmp, scale, causal, out, workspace=None):
        m_blocks, splits, o_part, lse_part = workspace or prefill_workspace(key, arch, tmp, q.shape[0], q.device,
                                                                            causal)
        cache = (tmp.blocks, tmp.blocks, input_row_offsets.contiguous(), tmp.cache_lengths.contiguous(),
                 tmp.lookup_table, None)
        if arch == "sm_90a":
            lse_args, args = (None, o_part, lse_part), (None, *cache, 0, m_blocks, splits, int(causal), 0,
                                                        *softmax_args(d, scale, None))
        else:
            lse_args, args = (o_part, lse_part, unused_lse(q.device, h, v_dim)), (
                *cache, None, 0, m_blocks, splits, int(causal), 0, *score_args(d, scale, None))
        launch_and_combine(units, arch, q, out, VEC, lse_args, args, splits, o_part, lse_part, None)

    return run
