"""``python -m cute_kv selftest``: every kernel family against its PyTorch reference on small random cases.

The first command to run on a GPU. The grid (``GRID``) reaches every kernel of the catalog (``kernels/catalog.py``)
of both archs: the KV stores (rope-aware FP8 rows included), the fused QKV projection (bias, QK-norm, heads of 256,
int4 and fp8 weights, MLA latents and rope-aware rows), paged attention (head dims 64/128/256, 16-bit caches also
80/96/192, pages 16/64/128, window, soft-cap, sinks, LSE, fp8 caches with each scale kind (per-tensor ``k_scale``
/ ``v_scale`` too, for the stores as well), split-KV and its combine), MLA decode, both routes of ``mla_prefill``,
sparse MLA (SM100) and the gather. ``--quick`` runs ``QUICK``, one case per kernel family.

Each case is a decode or ragged step (requests with 0 and 1 new tokens, an empty cache, pages crossed) on shuffled
pages with fresh random inputs, run by the op and by its reference on twin batches: the outputs start as NaN (a row
left unwritten shows), the slots the step writes start as NaN, every slot a reader must not touch is NaN, and the
cache outside the written rows must keep its bits. On CUDA a case passes only if the op launched a kernel; its path
is the kernels the call asked for. Cases run in a worker process (``run_isolated``): one that hangs past ``--timeout``
is killed and the next case runs in a fresh worker, which loads what was compiled from the disk cache. Without CUDA
there is nothing to test: the ops are the reference.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import multiprocessing
import os
import time
import zlib
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

import cute_kv
from cute_kv import reference
from cute_kv.ops import paths
from cute_kv.kernels.archs import ARCHS, BLACKWELL
from cute_kv.reference.batch import random_paged_batch
from cute_kv.reference.mla_prefill import mla_prefill as mla_prefill_reference
from cute_kv.reference.qkv import kv_columns
from cute_kv.reference.sparse_mla import sparse_mla_attention as sparse_mla_reference

FP8 = torch.float8_e4m3fn
# Ragged: an empty cache, a 1-token prompt, a request sitting the step out, a run crossing pages.
RAGGED = ((0, 37, 5, 1, 70), (5, 1, 0, 1, 17))
DECODE = ((0, 37, 5, 1, 70), (1, 1, 1, 1, 1))
# Decode over long contexts, few requests: the grid would leave most SMs idle, so attention splits the keys.
SPLIT = ((0, 1500, 301, 2100), (1, 1, 0, 1))
# Fresh prompts dominate: mla_prefill takes its decompressed route (a decode step takes the absorbed one).
PREFILL = ((0, 5, 40), (300, 1, 0))
STEPS = {"decode": DECODE, "ragged": RAGGED, "split": SPLIT, "prefill": PREFILL}
ROPE_DIM = 64  # rope-aware rows: DeepSeek's 512 e4m3 + 64 bf16
CACHES = {
    "bf16": {"dtype": torch.bfloat16},
    "fp16": {"dtype": torch.float16},
    "fp32": {"dtype": torch.float32},
    "fp8 f32 scales": {"dtype": FP8, "scale_dtype": torch.float32, "quantization_granularity": 64},
    "fp8 e8m0 scales": {"dtype": FP8, "scale_dtype": torch.float8_e8m0fnu, "quantization_granularity": 32},
    "fp8": {"dtype": FP8},
    "mla": {"dtype": torch.bfloat16, "is_mla": True, "num_heads": 1},
    "mla rope-aware": {"dtype": FP8, "scale_dtype": torch.float32, "is_mla": True, "num_heads": 1,
                       "rope_dim": ROPE_DIM},
}
# Relative error (max |ours - ref| / max |ref|) a correct kernel stays under: a unit or two in the last place of the
# output dtype at its largest value; fp8 more (one rounding flip moves a stored e4m3 value by an eighth of itself).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, FP8: 7e-2}
# mla_prefill rounds its intermediates to q's dtype (the up-projected K/V, or q_lat and the latent output), which
# the float32 reference does not: a few 16-bit roundings more.
MLA_PREFILL_TOLERANCE = 3e-2
LAYER = 1
HIDDEN = 256  # fused QKV's K: a multiple of the quantized weights' 64-wide k-tile
WIDE_HIDDEN = 1024  # the "k1024" variants: 16 k-tiles, so SM100's W4 kernel splits K over the idle SMs
MLA_V_DIM = 512
MLA_Q_HEADS = 16
TOPK = 64
PAGES = (16, 64, 128)
SMALL_PAGES = (1, 2, 4, 8)
BOTH = ("decode", "ragged")


@dataclasses.dataclass(frozen=True)
class Case:
    """One op on one cache: ``head_size`` is the logical row width (a rope-aware row's ``latent_dim``), ``variant``
    the op's feature under test, ``archs`` those that have a kernel for it."""

    op: str
    cache: str
    page_size: int
    head_size: int
    step: str
    variant: str = ""
    archs: tuple = ARCHS

    @property
    def config(self) -> str:
        return " ".join(x for x in (self.cache, f"P={self.page_size}", f"D={self.head_size}", self.step,
                                    self.variant) if x)

    def seed(self, salt: int = 0) -> int:
        """Stable across processes (``hash`` of a str is not)."""
        return zlib.crc32(repr(self).encode()) + salt


@dataclasses.dataclass
class Row:
    case: Case
    path: str
    max_err: float
    ok: bool
    ours_ms: Optional[float] = None
    ref_ms: Optional[float] = None
    peer_ms: Optional[float | str] = None  # FlashInfer's time, or why there is none
    error: Optional[str] = None
    compile_s: Optional[float] = None  # bringing the case's kernels in (compiled, or loaded from disk)
    run_s: Optional[float] = None  # the checks and the timing

    def as_json(self) -> dict:
        c = self.case
        return {"op": c.op, "cache": c.cache, "page_size": c.page_size, "head_size": c.head_size, "step": c.step,
                "variant": c.variant, "config": c.config, "path": self.path,
                "max_err": self.max_err if math.isfinite(self.max_err) else str(self.max_err), "ok": self.ok,
                "ours_ms": self.ours_ms, "ref_ms": self.ref_ms, "peer_ms": self.peer_ms,
                "compile_s": self.compile_s, "run_s": self.run_s, "error": self.error}


# (op, caches, page sizes, head sizes, steps, variants[, archs]): every combination is a case.
GRID = [
    ("store_kv", ("bf16", "fp16", "fp32", "fp8 f32 scales", "mla"), PAGES, (128,), BOTH, ("",)),
    ("store_kv", ("mla rope-aware",), PAGES, (576,), BOTH, ("",)),
    ("store_kv", ("fp8",), (16,), (128,), BOTH, ("tensor scales",)),  # vLLM's / FlashInfer's k_scale, v_scale
    ("fused_qkv_matmul_kv_cache", ("bf16", "fp16"), PAGES, (128,), BOTH, ("",)),
    ("fused_qkv_matmul_kv_cache", ("bf16",), (16,), (128,), BOTH,
     ("bias", "qk-norm", "int4 g32", "int4 g64", "int4 g128", "int4 g128 zp", "int4 g128 k1024", "fp8 weights")),
    ("fused_qkv_matmul_kv_cache", ("bf16",), (16,), (256,), BOTH, ("qk-norm",)),  # Gemma 3: neox and norm, wide
    ("fused_qkv_matmul_kv_cache", ("mla",), (64,), (576,), BOTH, ("", "latent-norm")),
    ("fused_qkv_matmul_kv_cache", ("mla rope-aware",), (64,), (576,), BOTH, ("latent-norm",)),
    ("paged_attention", ("bf16", "fp16", "fp8 f32 scales", "fp8 e8m0 scales", "fp8"), PAGES, (64, 128, 256), BOTH,
     ("",)),
    ("paged_attention", ("bf16",), PAGES, (80, 96, 192), BOTH, ("",)),  # 32- and 64-byte swizzles
    # SM90's 112- and 80-key tiles over parts of 64-row pages: a causal prompt of several tiles
    ("paged_attention", ("bf16",), (64,), (192, 256), ("prefill",), ("",)),
    ("paged_attention", ("bf16",), (16,), (80,), ("split",), ("",)),  # the combine's rows of 20 threads
    ("paged_attention", ("bf16",), (16,), (128,), BOTH, ("window", "softcap", "sinks", "lse")),
    ("paged_attention", ("fp8",), (16,), (128,), BOTH, ("tensor scales",)),
    # FlashInfer's HND page order taken in place (from_kv): the kernels' strided path
    ("paged_attention", ("bf16",), (16, 64), (128,), BOTH, ("HND",)),
    # pages under 16 rows (SGLang's 1): SM90 gathers rows by cp.async, SM100 by gather4
    ("paged_attention", ("bf16",), SMALL_PAGES, (64, 128, 256), BOTH, ("",)),
    ("paged_attention", ("bf16",), (1,), (128,), ("split",), ("",)),
    ("paged_attention", ("bf16", "fp8 f32 scales"), (16,), (128,), ("split",), ("",)),
    ("paged_attention", ("mla", "mla rope-aware"), (16, 64), (576,), (*BOTH, "split"), ("",)),  # MLA decode
    # a 300-token prompt: SM100's two Q tiles per CTA (16-bit, D 64 / 128, pages a TMA tiles the key tile with)
    ("paged_attention", ("bf16", "fp16"), (64, 128), (64, 128), ("prefill",), ("",)),
    ("paged_attention", ("bf16",), (64,), (128,), ("prefill",), ("window", "sinks", "lse")),
    ("mla_prefill", ("mla",), (64,), (576,), ("decode", "prefill"), ("",)),
    ("mla_prefill", ("mla rope-aware",), (64,), (576,), ("prefill",), ("",)),
    ("sparse_mla_attention", ("mla", "mla rope-aware"), (64,), (576,), BOTH, ("",), BLACKWELL),
    ("gather_kv", ("bf16", "fp16"), PAGES, (128,), BOTH, ("",)),
]
OPS = tuple(dict.fromkeys(entry[0] for entry in GRID))
# One case per kernel family (tests/test_selftest.py checks each arch's are all reached): the split step also runs
# the combine.
QUICK = (
    Case("store_kv", "bf16", 16, 128, "ragged"),
    Case("store_kv", "mla rope-aware", 16, 576, "ragged"),
    Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "ragged"),
    Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "ragged", "int4 g128"),
    Case("paged_attention", "bf16", 16, 128, "split"),
    Case("paged_attention", "mla", 64, 576, "ragged"),
    Case("sparse_mla_attention", "mla", 64, 576, "ragged", archs=BLACKWELL),
    Case("gather_kv", "bf16", 16, 128, "ragged"),
)


def cases(quick: bool = False, ops: Optional[Sequence[str]] = None, arch: Optional[str] = None) -> list[Case]:
    """The grid (``QUICK`` with ``quick``), only ``ops`` when given, only the cases with a kernel on ``arch``."""
    if ops is not None:
        unknown = sorted(set(ops) - set(OPS))
        if unknown:
            raise ValueError(f"unknown op(s) {', '.join(unknown)}: choose from {', '.join(OPS)}")
    if quick:
        chosen = list(QUICK)
    else:
        chosen = [Case(op, cache, p, d, step, variant, *archs)
                  for op, caches, pages, heads, steps, variants, *archs in GRID
                  for cache, p, d, step, variant in itertools.product(caches, pages, heads, steps, variants)]
    return [c for c in chosen if (ops is None or c.op in ops) and (arch is None or arch in c.archs)]


# -- one op on one case ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Setup:
    """``call(fn, collection)`` runs ``fn`` (``ours`` or ``ref``) on one case's inputs and returns its outputs (a
    tensor, a tuple of them, or None); ``tolerance`` bounds their error; ``writes`` says whether the op writes the
    step's rows into the cache. ``peer(fi)`` builds FlashInfer's call on the same pages, where it computes the same
    thing."""

    ours: Callable
    ref: Callable
    call: Callable
    tolerance: float
    writes: bool = False
    peer: Optional[Callable] = None


def _setup(case: Case, pb, g: torch.Generator, device) -> Setup:
    """Random inputs for ``case`` on the batch ``pb`` (activations in the cache dtype, bf16 for fp8 caches)."""
    c = pb.collection
    act = torch.bfloat16 if c.dtype == FP8 else c.dtype

    def randn(*shape, dtype=act, scale=1.0):
        return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)

    buffers = {}

    def nan_buffer(collection, shape, dtype=act):
        """One output per collection and shape, NaN until written (a row left unwritten shows), reused by timed
        calls."""
        key = (id(collection), tuple(shape), dtype)
        if key not in buffers:
            buffers[key] = torch.full(shape, math.nan, dtype=dtype, device=device)
        return buffers[key]

    return _SETUPS[case.op](case, pb, g, randn, nan_buffer)


def _store_setup(case, pb, g, randn, nan_buffer) -> Setup:
    c = pb.collection
    t, h, d = pb.total_rows, c.num_heads, c.latent_dim
    k, v = randn(t, h, d), None if c.is_mla else randn(t, h, d)
    # K's scale small enough that the largest values saturate at 448
    scales = _tensor_scales(case, g, c.device, k_range=(2e-3, 4e-3))
    return Setup(cute_kv.store_kv, reference.store_kv,
                 lambda fn, col: fn(k, v, pb.input_row_offsets, col, LAYER, **scales), TOLERANCE[c.dtype], writes=True)


def _tensor_scales(case, g: torch.Generator, device, k_range=(0.5, 2.0)) -> dict:
    """The ``tensor scales`` variant's ``k_scale`` (a device tensor, as vLLM's ``layer._k_scale``) and ``v_scale`` (a
    float, as FlashInfer takes it), random in ``k_range`` and [0.5, 2); none for other variants."""
    if case.variant != "tensor scales":
        return {}
    low, high = k_range
    k_scale = (low + (high - low) * torch.rand((), generator=g)).to(device)
    return {"k_scale": k_scale, "v_scale": 0.5 + 1.5 * float(torch.rand((), generator=g))}


def _qkv_setup(case, pb, g, randn, nan_buffer) -> Setup:
    """Llama-like heads (neox RoPE over the head) or, over an MLA cache, DeepSeek's: Q heads of 192 whose last 64
    dims and the latent's last 64 take GPT-J RoPE, the latent's first 512 the norm (``latent-norm``)."""
    c = pb.collection
    t, d = pb.total_rows, c.latent_dim
    positions = max(256, c.max_cache_length)
    if c.is_mla:
        q_head, rope_dim, interleaved = 192, ROPE_DIM, True
    else:
        q_head, rope_dim, interleaved = d, d, False
    q_dim = 8 * q_head
    rope = cute_kv.RopeConfig.from_theta(rope_dim, positions, 500000.0, interleaved=interleaved, q_head_dim=q_head,
                                         device=pb.collection.device)
    hidden = randn(t, WIDE_HIDDEN if case.variant.endswith("k1024") else HIDDEN)
    weight = _weight(case.variant, q_dim + kv_columns(c), hidden.shape[1], g, randn, c.device)

    def gamma(n):
        return randn(n, dtype=torch.float32, scale=0.25) + 1.0

    qk_norm = None
    if case.variant == "qk-norm":
        qk_norm = cute_kv.QKNorm(gamma(q_head), gamma(d))
    elif case.variant == "latent-norm":
        qk_norm = cute_kv.QKNorm(k_weight=gamma(d - ROPE_DIM))
    bias = randn(q_dim + kv_columns(c)) if case.variant == "bias" else None

    def call(fn, col):
        out = nan_buffer(col, (t, q_dim))
        return fn(hidden, pb.input_row_offsets, weight, col, LAYER, rope=rope, output=out, bias=bias,
                  qk_norm=qk_norm)

    return Setup(cute_kv.fused_qkv_matmul_kv_cache, reference.fused_qkv_matmul_kv_cache, call,
                 TOLERANCE[hidden.dtype], writes=True)


def _weight(variant: str, rows: int, cols: int, g: torch.Generator, randn, dev):
    """The projection's ``[rows, cols]`` weight: 16-bit, or ``int4 g<group>[ zp]`` / ``fp8 weights`` (scaled so the
    output is of unit size, like the 16-bit one's)."""
    if variant.startswith("int4"):
        group, zero_points = int(variant.split()[1][1:]), variant.endswith("zp")
        packed = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).to(dev)
        scales = randn(rows, cols // group, dtype=torch.float32).abs().mul(1 / 64).add(1 / 256).to(torch.bfloat16)
        zp = torch.randint(0, 16, (rows, cols // group), generator=g, dtype=torch.uint8).to(dev)
        return cute_kv.Int4Weight(packed, scales, group, zero_points, zp if zero_points else None)
    if variant == "fp8 weights":
        return cute_kv.Fp8Weight(randn(rows, cols, dtype=FP8), randn(rows, dtype=torch.float32).abs() / 16 + 1 / 64)
    return randn(rows, cols, scale=1 / 16)


def _attention_setup(case, pb, g, randn, nan_buffer) -> Setup:
    """GQA 4 (MHA caches) or 16 heads over the latent (MLA), causal; the variant adds its feature."""
    c = pb.collection
    t = pb.total_rows
    hq = MLA_Q_HEADS if c.is_mla else 4 * c.num_heads
    q = randn(t, hq, c.latent_dim)
    mla_v_dim = MLA_V_DIM if c.is_mla else None
    features = {}
    if case.variant and case.variant != "HND":
        features = {"window": lambda: {"window": 24}, "softcap": lambda: {"softcap": 2.0},
                    "sinks": lambda: {"sinks": randn(hq, dtype=torch.float32)},
                    "lse": lambda: {"return_lse": True},
                    "tensor scales": lambda: _tensor_scales(case, g, c.device)}[case.variant]()

    def call(fn, col):
        layer = LAYER
        if case.variant == "HND":
            col, layer = _hnd(col), 0
        out = nan_buffer(col, (t, hq, mla_v_dim or c.head_size))
        return fn(q, pb.input_row_offsets, col, layer, causal=True, mla_v_dim=mla_v_dim, out=out, **features)

    peer = None
    if c.dtype in (torch.bfloat16, torch.float16) and not c.is_mla and not features:
        peer = functools.partial(flashinfer_attention, pb=pb, q=q, decode=set(pb.new_lengths) == {1})
    return Setup(cute_kv.paged_attention, reference.paged_attention, call, TOLERANCE[q.dtype], peer=peer)


def _hnd(col):
    """Layer ``LAYER`` of ``col`` copied into FlashInfer's HND cache (``[N, 2, H, P, D]``, contiguous) and taken in
    place by ``from_kv``: one layer, whose K and V are strided ``[N, P, H, D]`` views."""
    kv = col.blocks[:, :, LAYER].permute(0, 1, 3, 2, 4).contiguous()  # [N, 2, P, H, D] -> [N, 2, H, P, D]
    return cute_kv.PagedKVCacheCollection.from_kv(
        kv[:, 0].permute(0, 2, 1, 3), kv[:, 1].permute(0, 2, 1, 3), col.cache_lengths, col.lookup_table,
        col.max_seq_length, col.max_cache_length, layout="HND", page_size=col.page_size, num_kv_heads=col.num_heads)


def _mla_prefill_setup(case, pb, g, randn, nan_buffer) -> Setup:
    """DeepSeek's heads (nope 128 + rope 64, values of 128, kv_lora_rank 512), 16 of them."""
    c = pb.collection
    t, h, nope, v = pb.total_rows, MLA_Q_HEADS, 128, 128
    r = c.latent_dim - ROPE_DIM
    q_nope, q_rope = randn(t, h, nope), randn(t, h, ROPE_DIM)
    w_uk, w_uv = randn(h, nope, r, scale=r**-0.5), randn(h, v, r, scale=r**-0.5)

    def call(fn, col):
        return fn(q_nope, q_rope, pb.input_row_offsets, col, LAYER, w_uk, w_uv, out=nan_buffer(col, (t, h, v)))

    return Setup(cute_kv.mla_prefill, mla_prefill_reference, call, MLA_PREFILL_TOLERANCE)


def _sparse_setup(case, pb, g, randn, nan_buffer) -> Setup:
    """Each query row picks ``TOPK`` of the keys it may see (distinct, random; -1 past them); the ragged step also
    cuts rows short with ``topk_lengths``."""
    c = pb.collection
    t, dev = pb.total_rows, c.device
    q = randn(t, MLA_Q_HEADS, c.latent_dim)
    positions = torch.full((t, TOPK), -1, dtype=torch.int32)
    row = 0
    for cache_length, n in zip(pb.cache_lengths, pb.new_lengths):
        for i in range(n):
            seen = cache_length + i + 1
            picked = torch.randperm(seen, generator=g)[:TOPK]
            positions[row, :picked.numel()] = picked.to(torch.int32)
            row += 1
    indices = cute_kv.sparse_kv_index_remap(positions.to(dev), pb.input_row_offsets, c)
    lengths = None
    if case.step == "ragged":
        lengths = torch.randint(0, TOPK + 1, (t,), generator=g, dtype=torch.int32).to(dev)

    def call(fn, col):
        return fn(q, pb.input_row_offsets, col, LAYER, indices, mla_v_dim=MLA_V_DIM, topk_lengths=lengths,
                  out=nan_buffer(col, (t, MLA_Q_HEADS, MLA_V_DIM)))

    def ref(q, input_row_offsets, collection, layer_idx, indices, **kwargs):
        return sparse_mla_reference(q, collection, layer_idx, indices, **kwargs)

    return Setup(cute_kv.sparse_mla_attention, ref, call, TOLERANCE[q.dtype])


def _gather_setup(case, pb, g, randn, nan_buffer) -> Setup:
    c = pb.collection

    def call(fn, col):
        out = nan_buffer(col, (c.batch_size, c.max_cache_length, c.num_heads, c.head_size), c.dtype)
        fn(col, LAYER, kv="v", out=out)
        return torch.cat([out[b, :n] for b, n in enumerate(pb.cache_lengths)])  # past a request's length: free

    return Setup(cute_kv.gather_kv, _gather_reference, call, TOLERANCE[c.dtype])


_SETUPS = {"store_kv": _store_setup, "fused_qkv_matmul_kv_cache": _qkv_setup, "paged_attention": _attention_setup,
           "mla_prefill": _mla_prefill_setup, "sparse_mla_attention": _sparse_setup, "gather_kv": _gather_setup}


def flashinfer_attention(fi, *, pb, q: torch.Tensor, decode: bool) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged attention over the same pages as ``pb`` (layer ``LAYER``'s K/V planes, copied contiguous):
    its CSR page table (``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), the decode wrapper for one token per
    request, else the causal prefill wrapper over the ragged rows."""
    c, dev, p = pb.collection, q.device, pb.collection.page_size
    k_cache, v_cache = c.blocks[:, 0, LAYER].contiguous(), c.blocks[:, 1, LAYER].contiguous()
    ends = [cl + n for cl, n in zip(pb.cache_lengths, pb.new_lengths)]
    used = [-(-e // p) for e in ends]

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    indices = i32([page for b, n in enumerate(used) for page in pb.pages[b][:n]])
    indptr = i32([0, *itertools.accumulate(used)])
    last = i32([e - (n - 1) * p if n else 0 for e, n in zip(ends, used)])
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=dev)
    heads = (q.shape[1], c.num_heads, c.head_size, p)
    if decode:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(indptr, indices, last, *heads, q_data_type=q.dtype, kv_data_type=c.dtype)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        w.plan(pb.input_row_offsets.to(torch.int32), indptr, indices, last, *heads, causal=True,
               q_data_type=q.dtype, kv_data_type=c.dtype)
    return lambda: w.run(q, (k_cache, v_cache))


def _gather_reference(collection, layer_idx, *, kv, out):
    cache = collection.get_value_cache(layer_idx) if kv == "v" else collection.get_key_cache(layer_idx)
    for b, n in enumerate(collection.cache_lengths.tolist()):
        out[b, :n] = cache.gather(b, 0, n, collection.dtype)
    return out


def _batch(case: Case, device):
    """The case's random batch: the step's slots NaN when the op writes them, else every slot it must not read."""
    cached, new = STEPS[case.step]
    kw = {"num_heads": 2, **CACHES[case.cache]}
    rope_dim = kw.get("rope_dim")
    head_size = case.head_size + rope_dim if rope_dim else case.head_size  # bytes: the rope tail is bf16
    pb = random_paged_batch(cached, new, head_size=head_size, page_size=case.page_size, num_layers=2,
                            generator=torch.Generator().manual_seed(case.seed()), device=device, **kw)
    if case.op in ("store_kv", "fused_qkv_matmul_kv_cache"):
        step = pb.step_mask(LAYER)
        for t in (pb.collection.blocks, pb.collection.scales):
            if t is not None:
                _bits(t)[step] = 0xFF  # all bits set: NaN in every float format
    else:
        pb.poison_unread(LAYER)
    return pb


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor contiguous in its last dim, one more dim of them (NaN compares equal to its bits)."""
    return t.view(torch.uint8)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` in float64; inf where they disagree on NaN or any value is not finite."""
    got, want = got.to(torch.float64), want.to(torch.float64)
    if got.shape != want.shape or not torch.equal(got.isnan(), want.isnan()):
        return math.inf
    finite = ~want.isnan()
    diff = (got - want)[finite].abs()
    if not bool(diff.isfinite().all()):
        return math.inf
    scale = max(float(want[finite].abs().max()) if finite.any() else 0.0, 1e-30)
    return float(diff.max()) / scale if diff.numel() else 0.0


def cache_err(pb, twin, writes: bool) -> float:
    """How far ``pb``'s cache is from ``twin``'s: inf if a byte outside the step's rows differs (all of them for an
    op that writes none), else the step's rows (dequantized) by ``rel_err``."""
    c, t = pb.collection, twin.collection
    outside = ~pb.step_mask(LAYER) if writes else torch.ones(c.blocks.shape[:4], dtype=torch.bool, device=c.device)
    for a, b in ((c.blocks, t.blocks), (c.scales, t.scales)):
        if a is not None and not torch.equal(_bits(a)[outside], _bits(b)[outside]):
            return math.inf
    if not writes:
        return 0.0

    def rows(batch):
        return torch.cat([batch.dense(kv, LAYER, b, cl + n)[cl:] for kv in range(c.kv_dim)
                          for b, (cl, n) in enumerate(zip(batch.cache_lengths, batch.new_lengths))])

    return rel_err(rows(pb), rows(twin))


def _outputs(x) -> tuple:
    return () if x is None else tuple(x) if isinstance(x, tuple) else (x,)


def run_case(case: Case, device, ours: Optional[Callable] = None, *, time_calls: bool = False,
             flashinfer=None) -> Row:
    """``ours`` (default: the ``cute_kv`` entry point) against the reference on twin batches of ``case``; with
    ``time_calls`` on CUDA, both timed, and ``flashinfer`` (a module) beside them where it computes the same. On CUDA
    the call must launch a kernel (a reference fallback fails)."""
    device = torch.device(device)
    try:
        pb, twin = _batch(case, device), _batch(case, device)
        g = torch.Generator().manual_seed(case.seed(1))
        setup = _setup(case, pb, g, device)
        fn = ours or setup.ours
        path, got = _launched(lambda: setup.call(fn, pb.collection), device)
        want = setup.call(setup.ref, twin.collection)
        checks = [(cache_err(pb, twin, setup.writes), TOLERANCE[pb.collection.dtype])]
        got, want = _outputs(got), _outputs(want)
        if len(got) != len(want):
            checks.append((math.inf, 0.0))
        checks += [(rel_err(a, b), setup.tolerance) for a, b in zip(got, want)]
        err = max(e for e, _ in checks)
        row = Row(case, path, err, all(e <= tol for e, tol in checks))
        if paths.on_cuda(device) and path == "reference":
            row.ok, row.error = False, "no kernel launched (cute_kv.explain says why)"
        if time_calls and device.type == "cuda":
            row.ours_ms = _time_ms(lambda: setup.call(fn, pb.collection))
            row.ref_ms = _time_ms(lambda: setup.call(setup.ref, twin.collection))
            if flashinfer is not None and setup.peer is not None:
                row.peer_ms = _peer_ms(setup.peer, flashinfer, want[0], setup.tolerance)
        return row
    except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
        return Row(case, "error", math.inf, False, error=f"{type(e).__name__}: {e}")


def _launched(call: Callable, device) -> tuple[str, object]:
    """``(path, result)`` of ``call()``: ``kernel <compile keys' names>`` for the kernels it asked for on CUDA, else
    ``reference``."""
    if not paths.on_cuda(device):
        return "reference", call()
    from cute_kv.kernels import compile_cache

    with compile_cache.recording() as asked:
        result = call()
    names = list(dict.fromkeys(key[0] for key, _, _ in asked))
    return ("kernel " + " + ".join(names) if names else "reference"), result


def kernel_units(case: Case, arch: str, sm_count: int, device="cpu") -> list[tuple]:
    """``(compile key, build)`` of every kernel ``case``'s call launches on a GPU of ``arch`` with ``sm_count`` SMs:
    the call planned and prepared as there (``paths.dry_run``) on a twin of its batch on ``device``, nothing compiled
    or launched. Empty where the reference runs."""
    pb = _batch(case, device)
    setup = _setup(case, pb, torch.Generator().manual_seed(case.seed(1)), device)
    with paths.dry_run(arch, sm_count) as asked:
        setup.call(setup.ours, pb.collection)
    return list({repr(key): (key, build) for key, build, _ in asked}.values())


def bring_in(case: Case, device, arch: str, sm_count: int) -> int:
    """Compile, or load from the disk cache, every kernel ``case``'s call launches on ``arch``; how many."""
    from cute_kv.prebuild import prebuild

    return len(prebuild(kernel_units(case, arch, sm_count, device), arch))


def _peer_ms(build: Callable, flashinfer, want: torch.Tensor, tol: float):
    """The peer's time, or why there is none ("wrong": its output is off the reference; "error": it raised)."""
    try:
        run = build(flashinfer)
        if rel_err(run(), want) > tol:
            return "wrong"
        return _time_ms(run)
    except Exception:  # noqa: BLE001 - a peer's failure says nothing about cute-kv
        return "error"


def _time_ms(fn: Callable, iters: int = 20) -> float:
    """Median of ``iters`` single calls, CUDA events around each (after a warm-up call that compiles)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# -- cases in a worker process ----------------------------------------------------------------------------------

COMPILE_TIMEOUT = 900.0  # seconds to bring one case's kernels in: compiling is slow, not stuck


def run_isolated(chosen: Sequence[Case], device, *, timeout: float, runner: Callable = run_case,
                 cache_dir: Optional[str] = None, on_start: Callable = lambda info: None,
                 on_row: Callable = lambda row: None) -> list[Row]:
    """Every case of ``chosen`` in a worker process on ``device``, one ``Row`` each (also given to ``on_row`` as it
    comes; ``on_start`` gets the first worker's device description).

    The worker brings a case's kernels in (``kernel_units``, compiled into the disk cache at ``cache_dir``, or
    loaded from it), then calls ``runner(case, device, time_calls=..., flashinfer=...)`` (``run_case``). A case
    whose run takes longer than ``timeout`` seconds is recorded as hung and its worker killed (a hung kernel cannot
    be interrupted in its process); one that raised or killed its worker leaves a worker whose CUDA context may be
    broken, so it is replaced too. The next case then starts a fresh worker."""
    rows, worker = [], None
    try:
        for case in chosen:
            if worker is None:
                worker = _Worker(device, runner, cache_dir)
                if len(rows) == 0:
                    on_start(worker.info)
            row = worker.run(case, timeout)
            if row.error is not None:
                worker.close(kill=row.path == "hung")
                worker = None
            rows.append(row)
            on_row(row)
    except BaseException:  # interrupted (Ctrl-C, a test's timeout): the worker may be mid-case
        if worker is not None:
            worker.close(kill=True)
        raise
    if worker is not None:
        worker.close()
    return rows


class _Stopped(Exception):
    """The worker sent nothing in time (``hung``) or exited (``crashed``)."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path = path


class _Worker:
    """A ``_serve`` process (spawned: its own CUDA context) and the pipe to it."""

    def __init__(self, device, runner: Callable, cache_dir: Optional[str]):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, str(device), runner, cache_dir))
        self.process.start()
        child.close()
        try:
            self.info = self._receive(COMPILE_TIMEOUT, "starting")
        except _Stopped as e:
            self.close(kill=True)
            raise RuntimeError(f"the selftest worker did not start: {e}") from None

    def _receive(self, timeout: float, doing: str):
        if not self.conn.poll(timeout):
            raise _Stopped("hung", f"hung {doing}: nothing within {timeout:g} s; its worker was killed")
        try:
            return self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise _Stopped("crashed", f"its worker exited (code {self.process.exitcode}) {doing}") from None

    def run(self, case: Case, timeout: float) -> Row:
        start = time.perf_counter()
        self.conn.send(case)
        try:
            compile_s, problem = self._receive(COMPILE_TIMEOUT, "bringing its kernels in")
            if problem is not None:
                return Row(case, "error", math.inf, False, error=f"compiling: {problem}", compile_s=compile_s)
            row = self._receive(timeout, "running")
        except _Stopped as e:
            return Row(case, e.path, math.inf, False, error=str(e), run_s=time.perf_counter() - start)
        row.compile_s = compile_s
        return row

    def close(self, kill: bool = False) -> None:
        """Closing the pipe ends a waiting worker; ``kill`` (or a worker that does not end) is for a hung one, whose
        kernel ignores gentler signals."""
        self.conn.close()
        if not kill:
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)


def _serve(conn, device_name: str, runner: Callable, cache_dir: Optional[str]) -> None:
    """The worker: describe the device, then for each case received send ``(compile seconds, problem or None)`` and
    the runner's ``Row``, until the pipe closes."""
    from cute_kv.kernels.disk_cache import CACHE_DIR_ENV

    if cache_dir is not None:
        os.environ[CACHE_DIR_ENV] = cache_dir
    device = torch.device(device_name)
    flashinfer, info = None, {"device": str(device), "arch": None, "sm_count": None, "peer": None}
    if device.type == "cuda":
        from cute_kv.ops.splits import sm_count

        info.update(device=torch.cuda.get_device_name(device), arch=paths.device_arch(device),
                    sm_count=sm_count(device))
        try:
            import flashinfer
        except Exception as e:  # noqa: BLE001 - an optional peer; a broken install fails at import in many ways
            info["peer"] = f"flashinfer not timed ({type(e).__name__}; pip install -e '.[peers]')"
        else:
            info["peer"] = f"flashinfer {getattr(flashinfer, '__version__', '')} timed beside paged_attention"
    conn.send(info)
    while True:
        try:
            case = conn.recv()
        except EOFError:
            return
        start, problem = time.perf_counter(), None
        if info["arch"] is not None:
            try:
                bring_in(case, device, info["arch"], info["sm_count"])
            except Exception as e:  # noqa: BLE001 - reported as the case's failure
                problem = f"{type(e).__name__}: {e}"
        conn.send((time.perf_counter() - start, problem))
        if problem is not None:
            continue
        start = time.perf_counter()
        try:
            row = runner(case, device, time_calls=device.type == "cuda", flashinfer=flashinfer)
        except Exception as e:  # noqa: BLE001 - a runner that raises fails its case
            row = Row(case, "error", math.inf, False, error=f"{type(e).__name__}: {e}")
        row.run_s = time.perf_counter() - start
        conn.send(row)


# -- the command ------------------------------------------------------------------------------------------------

DEFAULT_CACHE_DIR = "build/kernels"  # under the working directory, when CUTE_KV_CACHE_DIR is unset


def cache_dir(given: Optional[str] = None) -> Path:
    """Where selftest keeps (and ``prebuild --selftest`` writes) compiled kernels: ``given``, else
    ``$CUTE_KV_CACHE_DIR``, else ``DEFAULT_CACHE_DIR``."""
    from cute_kv.kernels.disk_cache import CACHE_DIR_ENV

    return Path(given or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR).resolve()


def line(r: Row) -> str:
    """A case's line of the table: op, config, path, max error, pass/fail, the times where measured, the error."""
    ms = "".join(_cell(x, w) for x, w in ((r.ours_ms, 8), (r.ref_ms, 8), (r.peer_ms, 13)))
    return (f"{r.case.op:26s} {r.case.config:36s} {r.path:40s} {r.max_err:9.2e} {'ok' if r.ok else 'FAIL':4s}{ms}"
            + (f"  {r.error}" if r.error else ""))


HEADER = (f"{'op':26s} {'config':36s} {'path':40s} {'max err':>9s} {'':4s} {'ours ms':>8s} {'ref ms':>8s} "
          f"{'flashinfer ms':>13s}")


def summary(rows: Sequence[Row]) -> str:
    failed = sum(not r.ok for r in rows)
    return f"{len(rows) - failed} of {len(rows)} passed" + (f"; {failed} FAILED" if failed else "")


def table(rows: Sequence[Row]) -> str:
    """One line per case, then how many passed."""
    return "\n".join([HEADER, "-" * len(HEADER), *map(line, rows), summary(rows)])


def _cell(x, width: int) -> str:
    if x is None:
        return f" {'-':>{width}s}"
    return f" {x:>{width}.3f}" if isinstance(x, float) else f" {x:>{width}s}"


def _write_json(path: str, info: dict, rows: Sequence[Row]) -> None:
    """Rewritten after every case, so a run cut short keeps what it finished."""
    Path(path).write_text(json.dumps({**info, "rows": [r.as_json() for r in rows]}, indent=1) + "\n")


def add_parser(commands) -> None:
    p = commands.add_parser("selftest", help="run every kernel family against the reference on small random cases "
                                             "(GPU)")
    p.add_argument("--quick", action="store_true", help="one case per kernel family")
    p.add_argument("--ops", default=None, help=f"comma list of ops (default: all of {','.join(OPS)})")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to FILE")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a case may run (its kernels brought in) before it counts as hung (default 60)")
    p.add_argument("--cache-dir", default=None,
                   help=f"compiled kernels (default $CUTE_KV_CACHE_DIR, else ./{DEFAULT_CACHE_DIR}; "
                        f"'prebuild --selftest' fills it)")
    p.add_argument("--simulate", action="store_true",
                   help="run the kernels in the PTX simulator on the CPU (no GPU needed; small cases, minutes)")
    p.add_argument("--arch", default="sm_90a", help="with --simulate: the arch compiled for (default sm_90a)")
    p.add_argument("--seeds", type=int, default=1, help="with --simulate: schedules per case (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    ops = None if args.ops is None else [op for op in args.ops.split(",") if op]
    if args.timeout <= 0:
        raise SystemExit(f"cute-kv selftest: error: --timeout must be positive, got {args.timeout:g}")
    try:
        chosen = cases(args.quick, ops)
    except ValueError as e:
        raise SystemExit(f"cute-kv selftest: error: --ops: {e}") from None
    if args.list:
        for c in chosen:
            print(f"{c.op:26s} {c.config:36s} {' '.join(c.archs)}")
        print(f"{len(chosen)} cases")
        return 0
    if getattr(args, "simulate", False):
        return run_simulated(chosen, args)
    if not torch.cuda.is_available():
        print("cute-kv selftest: no CUDA device, nothing to test (the kernels run on SM90/SM100 GPUs; on the CPU "
              "every op is its PyTorch reference)")
        if args.json:
            _write_json(args.json, {"device": "cpu"}, [])
        return 0
    arch = paths.device_arch(torch.device("cuda"))
    here = [c for c in chosen if arch in c.archs]
    if not here:
        print(f"cute-kv selftest: none of the {len(chosen)} cases chosen has a kernel on {arch}")
        if args.json:
            _write_json(args.json, {"device": torch.cuda.get_device_name(), "arch": arch}, [])
        return 0
    info: dict = {}
    rows: list[Row] = []
    directory = str(cache_dir(args.cache_dir))

    def start(worker_info):
        info.update(worker_info)
        print(f"cute-kv selftest on {info['device']} ({info['arch']}, {info['sm_count']} SMs): {len(here)} cases "
              f"({len(chosen) - len(here)} without a kernel on {info['arch']} left out); kernels in {directory}; "
              f"{info['peer']}", flush=True)
        print(HEADER + "\n" + "-" * len(HEADER), flush=True)

    def done(row):
        rows.append(row)
        print(line(row), flush=True)
        if args.json:
            _write_json(args.json, info, rows)

    run_isolated(here, "cuda", timeout=args.timeout, cache_dir=directory, on_start=start, on_row=done)
    print(summary(rows))
    return 0 if all(r.ok for r in rows) else 1


def run_simulated(chosen: Sequence[Case], args: argparse.Namespace) -> int:
    """Every case with a kernel on ``args.arch``, its kernels executed by the PTX simulator under ``args.seeds``
    schedules, in this process. A case passes only if a kernel ran and every check held under every seed."""
    from cute_kv.simulate import simulated

    arch = args.arch
    here = [c for c in chosen if arch in c.archs]
    print(f"cute-kv selftest --simulate ({arch}, {args.seeds} seed(s) per case): {len(here)} cases "
          f"({len(chosen) - len(here)} without a kernel on {arch} left out)", flush=True)
    print(f"{'op':26s} {'config':40s} {'seed':>4s} {'launches':>8s} {'warp instr':>10s} {'s':>7s}  result")
    rows: list[Row] = []
    for case in here:
        for seed in range(args.seeds):
            start = time.perf_counter()
            try:
                with simulated(arch, seed=seed) as record:
                    row = run_case(case, "cpu")
                if row.ok and not record.launches:
                    row.ok, row.error = False, "no kernel ran in the simulator"
            except Exception as e:  # noqa: BLE001 - a hazard or deadlock fails this case, not the run
                record = None
                row = Row(case, "error", math.inf, False, error=f"{type(e).__name__}: {e}")
            row.run_s = time.perf_counter() - start
            rows.append(row)
            result = "ok" if row.ok else f"FAIL {row.error or f'max error {row.max_err:.3g}'}"
            print(f"{case.op:26s} {case.config:40s} {seed:4d} {len(record.launches) if record else 0:8d} "
                  f"{record.instructions if record else 0:10d} {row.run_s:7.1f}  {result}", flush=True)
    print(summary(rows))
    if args.json:
        _write_json(args.json, {"device": f"ptxsim {arch}", "arch": arch}, rows)
    return 0 if rows and all(r.ok for r in rows) else 1
