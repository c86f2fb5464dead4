"""``python -m cute_kv prebuild``: compile ahead, on a CPU machine, every kernel a model serves with, into the disk
cache (``CUTE_KV_CACHE_DIR``) that GPU servers then load instead of compiling.

A model's kernels are those its steps request through the ops, one per compile-time key: the KV store, the fused
QKV projection (both M tiles: small steps and prefill), paged attention (both lookup-table load widths) and the
split-KV combine, for this rank's heads under tensor parallelism and each page size asked for. Keys are built by
the same rules as the ops (``paged_attention.plan``, the kernels' ``supported``); a key the ops ask for
that was not prebuilt is compiled on first use and added to the cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import torch

from cute_kv.dtypes import dtype_name, parse_dtype


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What decides a model's kernels: activation dtype, heads, head dim, QKV bias, RoPE, and the KV cache dtype
    (``kv_dtype`` None: the activation dtype; fp8 e4m3 with ``kv_scale_dtype`` scales per ``kv_granularity``)."""

    dtype: torch.dtype
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    rope_dim: Optional[int] = None
    rope_interleaved: bool = False
    kv_dtype: Optional[torch.dtype] = None
    kv_scale_dtype: Optional[torch.dtype] = None
    kv_granularity: Optional[int] = None

    def sharded(self, tp: int) -> "ModelConfig":
        """This rank's share under ``tp``-way tensor parallelism (heads split evenly)."""
        if self.n_q_heads % tp or self.n_kv_heads % tp:
            raise ValueError(f"tp={tp} must divide n_q_heads ({self.n_q_heads}) and n_kv_heads ({self.n_kv_heads})")
        return dataclasses.replace(self, n_q_heads=self.n_q_heads // tp, n_kv_heads=self.n_kv_heads // tp)


MODELS = {
    "llama3-8b": ModelConfig(torch.bfloat16, 32, 8, 128, rope_dim=128),
    "llama3-70b": ModelConfig(torch.bfloat16, 64, 8, 128, rope_dim=128),
    "qwen2.5-7b": ModelConfig(torch.bfloat16, 28, 4, 128, qkv_bias=True, rope_dim=128),
    "mistral-7b": ModelConfig(torch.float16, 32, 8, 128, rope_dim=128),
}


def kernel_keys(model: ModelConfig, arch: str, page_sizes=(128,)) -> list[tuple]:
    """Compile-time keys of the kernels ``model`` (one rank's heads) runs on ``arch``, in the ops' spelling."""
    from cute_kv.kernels.cache.store import DTYPES as STORE_DTYPES, quantizable
    from cute_kv.kernels.qkv.sm90 import DTYPES as QKV_DTYPES, supported as qkv_supported

    act, kv = dtype_name(model.dtype), dtype_name(model.kv_dtype or model.dtype)
    h, d, q_dim = model.n_kv_heads, model.head_dim, model.n_q_heads * model.head_dim
    fp8 = model.kv_dtype == torch.float8_e4m3fn
    keys = []
    for p in page_sizes:
        granularity = model.kv_granularity if fp8 and model.kv_scale_dtype == torch.float32 else None
        if act in STORE_DTYPES and (not fp8 or (granularity and quantizable(granularity, d))):
            keys.append(("paged_kv_store", act, 2, p, h, d, granularity))
        if arch == "sm_90a" and not fp8 and kv in QKV_DTYPES:
            rope = None if model.rope_dim is None else (model.rope_dim, model.rope_interleaved, d)
            keys += [("fused_qkv_matmul", kv, q_dim, 2, p, h, d, model.qkv_bias, rope, tile_m)
                     for tile_m in (64, 128) if qkv_supported(q_dim, 2, h, d, rope, tile_m) is None]
        attention = [k for k in {_attention_key(model, p, arch, vector) for vector in (True, False)} if k]
        keys += sorted(attention, key=repr)
        if attention:
            keys.append(("attention_combine", act, model.n_q_heads, d))
    return list(dict.fromkeys(keys))  # the combine is the same for every page size


def _attention_key(model: ModelConfig, page_size: int, arch: str, lut_vector: bool) -> Optional[tuple]:
    """``paged_attention.plan`` of a step over a one-page cache whose lookup rows do (not) allow vector loads."""
    from cute_kv.collection import PagedKVCacheCollection
    from cute_kv.kernels.attention.config import BN
    from cute_kv.ops.paged_attention import plan
    from cute_kv.params import KVCacheParams, KVCacheQuantizationConfig
    from cute_kv.row_indices import lut_chunk, tile_geometry

    quant = None
    if model.kv_scale_dtype is not None:
        quant = KVCacheQuantizationConfig(model.kv_scale_dtype, model.kv_granularity or model.head_dim)
    params = KVCacheParams(model.kv_dtype or model.dtype, model.n_kv_heads, model.head_dim, page_size=page_size,
                           total_num_layers=1, kvcache_quant_config=quant)
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, 1)
    chunk = lut_chunk(tile_geometry(BN, page_size)[1], BN, page_size)
    cols = chunk if lut_vector else chunk + 1
    lut = torch.zeros((1, cols), dtype=torch.uint32)
    coll = PagedKVCacheCollection(blocks, torch.zeros(1, dtype=torch.uint32), lut, 0, 0, scales)
    q = torch.empty((1, model.n_q_heads, model.head_dim), dtype=model.dtype)
    return plan(coll, q, arch).key


def build(key: tuple):
    """``(kernel, *fake_args)`` for a key of ``kernel_keys``: each kernel class takes its key's fields."""
    from cute_kv.kernels.attention.combine import AttentionCombine
    from cute_kv.kernels.attention.sm90 import PagedAttention
    from cute_kv.kernels.cache.store import PagedKVStore
    from cute_kv.kernels.qkv.sm90 import FusedQKVMatmul

    kernel_class = {"paged_kv_store": PagedKVStore, "fused_qkv_matmul": FusedQKVMatmul,
                    "paged_attention": PagedAttention, "attention_combine": AttentionCombine}[key[0]]
    kernel = kernel_class(*key[1:])
    return kernel, *kernel.fake_args()


def prebuild(keys: list[tuple], arch: str) -> list[tuple[tuple, float, str]]:
    """Bring every key into the compile cache (disk included): ``(key, seconds, source)`` each, ``source`` being
    ``"compiled"``, ``"disk"`` or ``"memory"`` (already in this process)."""
    from cute_kv.kernels import compile_cache

    rows = []
    for key in keys:
        before = compile_cache.cache_info()
        start = time.perf_counter()
        compile_cache.compiled(key, lambda: build(key), arch)
        seconds = time.perf_counter() - start
        after = compile_cache.cache_info()
        source = ("compiled" if after["compiles"] > before["compiles"] else
                  "disk" if after["disk_loads"] > before["disk_loads"] else "memory")
        rows.append((key, seconds, source))
    return rows


def add_parser(commands) -> None:
    p = commands.add_parser(
        "prebuild", help="compile a model's kernels ahead (no GPU needed) into the disk cache GPU servers load",
        description="Compile every kernel a model's steps use, for each arch, into the disk cache "
                    "($CUTE_KV_CACHE_DIR or --cache-dir). Serve with the same CUTE_KV_CACHE_DIR.")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--arch", nargs="+", choices=("sm_90a", "sm_100a"), default=["sm_90a"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: each rank's heads (default 1)")
    p.add_argument("--page-size", type=int, nargs="+", default=[128], help="page sizes served (default 128)")
    p.add_argument("--kv-dtype", default=None, help="cache dtype: the model dtype (default) or fp8")
    p.add_argument("--scale-dtype", choices=("f32", "e8m0"), default=None, help="fp8 scales (default: unscaled)")
    p.add_argument("--granularity", type=int, default=128, help="fp8 scale granule in head dims (default 128)")
    p.add_argument("--cache-dir", default=None, help="disk cache directory (default $CUTE_KV_CACHE_DIR)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cute_kv.kernels import compile_cache, disk_cache

    directory = args.cache_dir or os.environ.get(disk_cache.CACHE_DIR_ENV)
    if not directory:
        raise SystemExit(f"cute-kv prebuild: error: pass --cache-dir or set {disk_cache.CACHE_DIR_ENV}")
    os.environ[disk_cache.CACHE_DIR_ENV] = str(Path(directory).resolve())
    model = MODELS[args.model].sharded(args.tp)
    if args.kv_dtype is not None:
        scale = {"f32": torch.float32, "e8m0": torch.float8_e8m0fnu}.get(args.scale_dtype)
        model = dataclasses.replace(model, kv_dtype=parse_dtype(args.kv_dtype), kv_scale_dtype=scale,
                                    kv_granularity=args.granularity if scale is not None else None)
    print(f"cute-kv prebuild: {args.model} (tp={args.tp}: {model.n_q_heads} q / {model.n_kv_heads} kv heads per rank, "
          f"head_dim {model.head_dim}), pages {args.page_size}, into {os.environ[disk_cache.CACHE_DIR_ENV]}")
    start, rows = time.perf_counter(), []
    for arch in args.arch:
        for key, seconds, source in prebuild(kernel_keys(model, arch, tuple(args.page_size)), arch):
            rows.append(source)
            print(f"  {arch} {source:8s} {seconds:7.2f} s  {' '.join(map(str, key))}", flush=True)
    info = compile_cache.cache_info()
    print(f"total: {len(rows)} kernels, {info['compiles']} compiled, {info['disk_loads']} loaded from disk, "
          f"{time.perf_counter() - start:.2f} s")
    return 0
