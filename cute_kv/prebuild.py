"""``python -m cute_kv prebuild``: compile ahead, on a CPU machine, every kernel a model serves with, into the disk
cache (``CUTE_KV_CACHE_DIR``) that GPU servers then load instead of compiling.

A model's kernels are those its steps request through the ops, one per compile-time key: the KV store, the fused
QKV projection (with or without bias, as the model has it), paged attention (both lookup-table load widths) and the
split-KV combine, for this rank's heads under tensor parallelism and each page size asked for. Keys are built by
each op's own ``plan`` and ``compile_unit(s)``, so they are the keys a step asks for; a key that was not prebuilt
is compiled on first use and added to the cache.

``--selftest`` compiles instead what ``python -m cute_kv selftest`` launches (``--quick``: its quick cases): each
case's call run for the arch with the device query replaced (``selftest.kernel_units``), so the GPU's minutes go to
running kernels. By default into selftest's own directory (``selftest.cache_dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path
from typing import Optional

import torch

from cute_kv.dtypes import parse_dtype
from cute_kv.kernels.archs import ARCHS, SM_COUNTS


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


def kernel_units(model: ModelConfig, arch: str, page_sizes=(128,)) -> list[tuple]:
    """``(compile key, build)`` of every kernel ``model`` (one rank's heads) runs on ``arch``: each op's own
    ``plan`` decides on a one-page cache of the model's geometry, and its ``compile_unit(s)`` name what its launcher
    compiles, so a key here is exactly the key a step asks for. Ops that take the reference add nothing."""
    from cute_kv.ops import fused_qkv, paged_attention, store_kv

    units = []
    for p in page_sizes:
        coll, q = _step(model, p, lut_vector=True)
        k = torch.empty((1, model.n_kv_heads, model.head_dim), dtype=model.dtype)
        path = store_kv.plan(coll, k, arch)
        if path.key is not None:
            units.append(store_kv.compile_unit(path.key, arch))
        path = fused_qkv.plan(coll, *_projection(model, coll), arch)
        if path.key is not None:
            units.append(fused_qkv.compile_unit(dataclasses.replace(path.key, has_bias=model.qkv_bias), arch))
        for lut_vector in (True, False):  # both lookup-row load widths a step may take
            step = _step(model, p, lut_vector)
            path = paged_attention.plan(*step, arch)
            if path.key is not None:
                units += paged_attention.backend(step[0], arch).compile_units(path.key, arch)
    return list({repr(key): (key, build) for key, build in units}.values())  # the combine serves every page size




def selftest_units(arch: str, quick: bool = False, ops=None) -> list[tuple]:
    """``(compile key, build)`` of every kernel the selftest cases (``quick``: ``QUICK``; ``ops``: only theirs) launch
    on ``arch``, each once."""
    from cute_kv import selftest

    units: dict = {}
    for case in selftest.cases(quick, ops, arch):
        for key, build in selftest.kernel_units(case, arch, SM_COUNTS[arch]):
            units.setdefault(repr(key), (key, build))
    return list(units.values())


def kernel_keys(model: ModelConfig, arch: str, page_sizes=(128,)) -> list[tuple]:
    """The compile keys of ``kernel_units``."""
    return [key for key, _ in kernel_units(model, arch, page_sizes)]


def _step(model: ModelConfig, page_size: int, lut_vector: bool):
    """``(collection, q)`` of a one-page cache whose lookup rows do (not) allow vector loads, on the CPU."""
    from cute_kv.collection import PagedKVCacheCollection
    from cute_kv.kernels.attention.config import key_tile
    from cute_kv.params import KVCacheParams, KVCacheQuantizationConfig
    from cute_kv.row_indices import lut_chunk, tile_geometry

    quant = None
    if model.kv_scale_dtype is not None:
        quant = KVCacheQuantizationConfig(model.kv_scale_dtype, model.kv_granularity or model.head_dim)
    params = KVCacheParams(model.kv_dtype or model.dtype, model.n_kv_heads, model.head_dim, page_size=page_size,
                           total_num_layers=1, kvcache_quant_config=quant)
    blocks, scales = PagedKVCacheCollection.allocate_blocks(params, 1)
    bn = key_tile(model.head_dim, None, page_size, model.kv_dtype == torch.float8_e4m3fn)
    chunk = lut_chunk(tile_geometry(bn, page_size)[1], bn, page_size)
    lut = torch.zeros((1, chunk if lut_vector else chunk + 1), dtype=torch.uint32)
    coll = PagedKVCacheCollection(blocks, torch.zeros(1, dtype=torch.uint32), lut, 0, 0, scales)
    return coll, torch.empty((1, model.n_q_heads, model.head_dim), dtype=model.dtype)


def _projection(model: ModelConfig, coll) -> tuple:
    """``(hidden, weight, rope)`` of the model's QKV projection (the hidden size does not enter the kernel key)."""
    from cute_kv.reference.qkv import kv_columns
    from cute_kv.reference.rope import RopeConfig

    hidden = torch.empty((1, 64), dtype=model.dtype)
    weight = torch.empty((model.n_q_heads * model.head_dim + kv_columns(coll), 64), dtype=model.dtype)
    rope = None
    if model.rope_dim is not None:
        rope = RopeConfig.from_theta(model.rope_dim, 1, interleaved=model.rope_interleaved)
    return hidden, weight, rope


def prebuild(units: list[tuple], arch: str, report=lambda row: None) -> list[tuple[tuple, float, str]]:
    """Bring every ``(key, build)`` into the compile cache (disk included): ``(key, seconds, source)`` each (also
    given to ``report`` as it comes), ``source`` being ``"compiled"``, ``"disk"`` or ``"memory"`` (already in this
    process)."""
    from cute_kv.kernels import compile_cache

    rows = []
    for key, build in units:
        before = compile_cache.cache_info()
        start = time.perf_counter()
        compile_cache.compiled(key, build, arch)
        seconds = time.perf_counter() - start
        after = compile_cache.cache_info()
        source = ("compiled" if after["compiles"] > before["compiles"] else
                  "disk" if after["disk_loads"] > before["disk_loads"] else "memory")
        rows.append((key, seconds, source))
        report(rows[-1])
    return rows


def add_parser(commands) -> None:
    p = commands.add_parser(
        "prebuild", help="compile a model's kernels ahead (no GPU needed) into the disk cache GPU servers load",
        description="Compile every kernel a model's steps use, for each arch, into the disk cache "
                    "($CUTE_KV_CACHE_DIR or --cache-dir). Serve with the same CUTE_KV_CACHE_DIR.")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    p.add_argument("--arch", nargs="+", choices=ARCHS, default=["sm_90a"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: each rank's heads (default 1)")
    p.add_argument("--page-size", type=int, nargs="+", default=[128], help="page sizes served (default 128)")
    p.add_argument("--kv-dtype", default=None, help="cache dtype: the model dtype (default) or fp8")
    p.add_argument("--scale-dtype", choices=("f32", "e8m0"), default=None, help="fp8 scales (default: unscaled)")
    p.add_argument("--granularity", type=int, default=128, help="fp8 scale granule in head dims (default 128)")
    p.add_argument("--cache-dir", default=None, help="disk cache directory (default $CUTE_KV_CACHE_DIR; with "
                                                     "--selftest, else selftest's ./build/kernels)")
    p.add_argument("--selftest", action="store_true", help="compile what 'selftest' launches instead of a model's "
                                                           "kernels")
    p.add_argument("--quick", action="store_true", help="with --selftest: its --quick cases")
    p.add_argument("--ops", default=None, help="with --selftest: comma list of ops (default: all)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cute_kv.kernels import compile_cache, disk_cache

    if args.selftest:
        return _run_selftest(args)
    if args.quick or args.ops:
        raise SystemExit("cute-kv prebuild: error: --quick and --ops choose selftest cases: add --selftest")
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
        def show(row, arch=arch):
            key, seconds, source = row
            print(f"  {arch} {source:8s} {seconds:7.2f} s  {' '.join(map(str, key))}", flush=True)

        rows += prebuild(kernel_units(model, arch, tuple(args.page_size)), arch, show)
    info = compile_cache.cache_info()
    print(f"total: {len(rows)} kernels, {info['compiles']} compiled, {info['disk_loads']} loaded from disk, "
          f"{time.perf_counter() - start:.2f} s")
    return 0


def _run_selftest(args: argparse.Namespace) -> int:
    """``--selftest``: the selftest's kernels, each arch's, then their count, time and size on disk."""
    from cute_kv import selftest
    from cute_kv.kernels import compile_cache, disk_cache

    ops = None if args.ops is None else [op for op in args.ops.split(",") if op]
    try:  # before the cache directory is set: a bad --ops leaves the process's environment as it was
        units = {arch: selftest_units(arch, args.quick, ops) for arch in args.arch}
    except ValueError as e:
        raise SystemExit(f"cute-kv prebuild: error: --ops: {e}") from None
    directory = selftest.cache_dir(args.cache_dir)
    os.environ[disk_cache.CACHE_DIR_ENV] = str(directory)
    print(f"cute-kv prebuild: selftest{' --quick' if args.quick else ''} kernels into {directory}")
    start, count, size = time.perf_counter(), 0, 0
    for arch in args.arch:
        def show(row, arch=arch):
            key, seconds, source = row
            print(f"  {arch} {source:8s} {seconds:7.2f} s  {key[0]}", flush=True)

        for key, _, _ in prebuild(units[arch], arch, show):
            entry = directory / disk_cache.entry_name(key, arch)
            size += sum(f.stat().st_size for f in (entry.with_suffix(".o"), entry.with_suffix(".json")))
            count += 1
    info = compile_cache.cache_info()
    print(f"total: {count} kernels, {info['compiles']} compiled, {info['disk_loads']} loaded from disk, "
          f"{time.perf_counter() - start:.2f} s, {size / 2**20:.2f} MiB")
    return 0
