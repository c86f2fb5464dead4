"""Compile ahead: the disk layer of the compile cache and ``python -m cute_kv prebuild``."""

import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_kv.prebuild import MODELS, ModelConfig, kernel_keys, kernel_units

REPO = Path(__file__).resolve().parents[1]
STORE_KEY = ("paged_kv_store", "bfloat16", 2, 16, 2, 128, None)


def _build_store():
    from cute_kv.kernels.cache.store import PagedKVStore

    kernel = PagedKVStore(*STORE_KEY[1:])
    return kernel, *kernel.fake_args()


def _never_built():
    raise AssertionError("a disk hit must not build the kernel")


# -- which kernels a model needs (no compile) ----------------------------------------------------------


def test_kernel_keys_follow_the_ops_rules():
    keys = kernel_keys(MODELS["llama3-8b"], "sm_90a", (16, 128))
    names = [k[0] for k in keys]
    assert len(set(keys)) == len(keys)
    # Per page size: the store, the QKV projection (no bias in Llama), paged attention; one combine for both.
    assert names.count("paged_kv_store") == 2 and names.count("fused_qkv_gemm") == 2
    assert names.count("attention_combine") == 1
    assert {(k[1].page_size, k[1].has_bias, k[1].rope) for k in keys if k[0] == "fused_qkv_gemm"} == {
        (16, False, (128, False)), (128, False, (128, False))}
    # Page 16: lookup rows load 4 entries at a time, so both row layouts get a kernel; page 128: one.
    attention = [k for k in keys if k[0] == "paged_attention"]
    assert sorted((k[5], k[7]) for k in attention) == [(16, False), (16, True), (128, True)]
    # SM100: the same ops, its own attention kernel.
    assert {k[0] for k in kernel_keys(MODELS["llama3-8b"], "sm_100a")} == {
        "paged_kv_store", "fused_qkv_gemm", "paged_attention_sm100", "attention_combine"}
    assert [k[1].has_bias for k in kernel_keys(MODELS["qwen2.5-7b"], "sm_90a") if k[0] == "fused_qkv_gemm"] == [True]


def test_kernel_keys_per_rank_and_fp8():
    rank = MODELS["llama3-70b"].sharded(4)
    assert (rank.n_q_heads, rank.n_kv_heads) == (16, 2)
    keys = kernel_keys(rank, "sm_90a")
    assert ("paged_kv_store", "bfloat16", 2, 128, 2, 128, None) in keys
    assert ("attention_combine", "bfloat16", 16, 128, False) in keys
    assert [k[1].q_dim for k in keys if k[0] == "fused_qkv_gemm"] == [16 * 128]
    with pytest.raises(ValueError, match="tp=3 must divide"):
        MODELS["llama3-8b"].sharded(3)
    fp8 = dataclasses.replace(MODELS["llama3-8b"], kv_dtype=torch.float8_e4m3fn, kv_scale_dtype=torch.float32,
                              kv_granularity=64)
    keys = kernel_keys(fp8, "sm_90a")
    # The store and the QKV projection quantize in-kernel with the cache's float32 scales.
    assert ("paged_kv_store", "bfloat16", 2, 128, 8, 128, 64) in keys
    assert [(k[1].fp8, k[1].granularity) for k in keys if k[0] == "fused_qkv_gemm"] == [(True, 64)]
    assert [k[11:] for k in keys if k[0] == "paged_attention"] == [("float8_e4m3fn", 64, False)]


def test_prebuild_needs_a_cache_dir(monkeypatch, capsys):
    from cute_kv.__main__ import main

    monkeypatch.delenv("CUTE_KV_CACHE_DIR", raising=False)
    with pytest.raises(SystemExit, match="--cache-dir"):
        main(["prebuild", "--model", "llama3-8b"])


# -- the disk layer --------------------------------------------------------------------------------------


@pytest.mark.compile
def test_disk_cache_serves_a_fresh_process_cache(tmp_path, monkeypatch):
    from cute_kv.kernels import compile_cache, disk_cache

    monkeypatch.setenv("CUTE_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_cache", {})
    before = compile_cache.cache_info()
    compile_cache.compiled(STORE_KEY, _build_store, "sm_90a")
    assert compile_cache.cache_info()["compiles"] == before["compiles"] + 1
    entry = tmp_path / f"{disk_cache.entry_name(STORE_KEY, 'sm_90a')}.o"
    assert entry.is_file()
    if platform.machine() == "x86_64" and shutil.which("objdump"):
        # The launcher runs on any x86-64 server: no AVX (VEX/EVEX) instructions even when the build machine has them.
        code = subprocess.run(["objdump", "-d", str(entry)], capture_output=True, text=True, check=True).stdout
        assert "callq" in code or "call " in code
        assert not re.search(r"%[yz]mm\d|\bv(mov|add|xor|pxor|broadcast)", code)

    monkeypatch.setattr(compile_cache, "_cache", {})  # as a new process would start
    fn = compile_cache.compiled(STORE_KEY, _never_built, "sm_90a")
    info = compile_cache.cache_info()
    assert info["compiles"] == before["compiles"] + 1 and info["disk_loads"] == before["disk_loads"] + 1
    assert compile_cache.compiled(STORE_KEY, _never_built, "sm_90a") is fn  # then served from memory

    # The loaded entry takes the op's positional arguments: with host tensors it gets as far as the device check.
    k = torch.randn(3, 2, 128).to(torch.bfloat16)
    blocks = torch.zeros(4, 2, 1, 16, 2, 128, dtype=torch.bfloat16)
    lengths, lut = torch.zeros(1, dtype=torch.uint32), torch.zeros(1, 24, dtype=torch.uint32)
    offsets = torch.tensor([0, 3], dtype=torch.uint32)
    with pytest.raises(ValueError, match="device_type=cuda"):
        fn(k, k.clone(), offsets, blocks, None, lengths, lut, 0)
    with pytest.raises(TypeError, match="Expects 8 parameters"):
        fn(k, k.clone(), offsets, blocks, None, lengths, lut)


@pytest.mark.compile
def test_disk_cache_misses_after_a_kernel_source_change(tmp_path, monkeypatch):
    from cute_kv.kernels import compile_cache, disk_cache

    monkeypatch.setenv("CUTE_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_cache", {})
    compile_cache.compiled(STORE_KEY, _build_store, "sm_100a")
    assert disk_cache.load(STORE_KEY, "sm_100a", tmp_path) is not None
    assert disk_cache.load(STORE_KEY, "sm_90a", tmp_path) is None  # another arch is another entry
    monkeypatch.setattr(disk_cache, "code_version", lambda: "edited-kernels")
    assert disk_cache.load(STORE_KEY, "sm_100a", tmp_path) is None


def test_code_version_covers_kernel_sources(tmp_path, monkeypatch):
    from cute_kv.kernels import disk_cache

    assert re.fullmatch(r"[0-9a-f]{16}", disk_cache.code_version())
    assert "cute_kv.row_indices" in disk_cache.KERNEL_SOURCES  # traced into the kernels (lookup-table geometry)
    assert disk_cache.entry_name(STORE_KEY, "sm_90a") != disk_cache.entry_name(STORE_KEY[:-1] + (64,), "sm_90a")
    # Editing any file of a kernel source package changes every entry's name.
    (tmp_path / "fake_kernels").mkdir()
    source = tmp_path / "fake_kernels" / "tile.py"
    (tmp_path / "fake_kernels" / "__init__.py").write_text("")
    source.write_text("BN = 64\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(disk_cache, "KERNEL_SOURCES", ("fake_kernels",))
    disk_cache.code_version.cache_clear()
    try:
        before = disk_cache.entry_name(STORE_KEY, "sm_90a")
        source.write_text("BN = 128\n")
        disk_cache.code_version.cache_clear()
        assert disk_cache.entry_name(STORE_KEY, "sm_90a") != before
    finally:
        disk_cache.code_version.cache_clear()


def test_code_version_covers_traced_libraries(monkeypatch):
    """quack's GEMMs and cluster stores are traced into our kernels: another quack release is another entry."""
    import importlib.metadata

    from cute_kv.kernels import disk_cache

    disk_cache.code_version.cache_clear()
    try:
        before = disk_cache.entry_name(STORE_KEY, "sm_90a")
        real = importlib.metadata.version
        monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.0.0" if d == "quack-kernels" else real(d))
        disk_cache.code_version.cache_clear()
        assert disk_cache.entry_name(STORE_KEY, "sm_90a") != before
    finally:
        disk_cache.code_version.cache_clear()


@pytest.mark.compile
def test_prebuild_then_a_second_process_compiles_nothing(tmp_path):
    cmd = [sys.executable, "-m", "cute_kv", "prebuild", "--model", "llama3-8b", "--arch", "sm_90a",
           "--cache-dir", str(tmp_path)]
    env = {**os.environ, "CUTE_DSL_DISABLE_FILE_CACHING": "1"}  # measure real compiles, not the DSL's own cache
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    n = len(kernel_keys(MODELS["llama3-8b"], "sm_90a"))
    assert f"total: {n} kernels, {n} compiled, 0 loaded from disk" in first.stdout
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert f"total: {n} kernels, 0 compiled, {n} loaded from disk" in second.stdout
    assert len(list(tmp_path.glob("*.o"))) == n


@pytest.mark.gpu
def test_ops_run_prebuilt_kernels_without_compiling(tmp_path, monkeypatch):
    """On the GPU: after a prebuild into the disk cache, a fresh in-process cache serves every op from disk."""
    import cute_kv
    from cute_kv.kernels import compile_cache
    from cute_kv.kernels.compile_cache import target_arch
    from cute_kv.prebuild import prebuild

    model = ModelConfig(torch.bfloat16, 8, 2, 128, rope_dim=128)
    arch = target_arch()
    monkeypatch.setenv("CUTE_KV_CACHE_DIR", str(tmp_path))
    prebuild(kernel_units(model, arch, (16,)), arch)
    monkeypatch.setattr(compile_cache, "_cache", {})
    compiles = compile_cache.cache_info()["compiles"]

    params = cute_kv.KVCacheParams(torch.bfloat16, 2, 128, page_size=16, total_num_layers=1)
    mgr = cute_kv.PagedKVCacheManager(params, 16, devices=["cuda"])
    mgr.claim("a")
    step = mgr.allocate(["a"], [40])
    coll, ro = step.collections[0], step.input_row_offsets[0]
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(40, 256, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(1024 + 2 * 256, 256, device="cuda", generator=g).to(torch.bfloat16) / 16
    rope = cute_kv.RopeConfig.from_theta(128, 64, 10000.0, device="cuda")
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden, ro, w, coll, 0, rope=rope)
    out = cute_kv.paged_attention(q.view(40, 8, 128), ro, coll, 0)
    k = torch.randn(40, 2, 128, device="cuda", generator=g).to(torch.bfloat16)
    cute_kv.store_kv(k, k, ro, coll, 0)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert compile_cache.cache_info()["compiles"] == compiles


@pytest.mark.compile
def test_unloadable_entry_names_the_file(tmp_path):
    from cute_kv.kernels import disk_cache

    entry = tmp_path / f"{disk_cache.entry_name(STORE_KEY, 'sm_90a')}.o"
    entry.write_bytes(b"not an object file")
    with pytest.raises(RuntimeError, match=f"cannot load the cached kernel {re.escape(str(entry))}.*delete the file"):
        disk_cache.load(STORE_KEY, "sm_90a", tmp_path)


def test_selftest_units_are_what_the_selftest_cases_launch():
    from cute_kv.prebuild import selftest_units

    quick = selftest_units("sm_90a", quick=True)
    assert [key[0] for key, _ in quick] == ["paged_kv_store", "paged_kv_store_rope_aware", "fused_qkv_gemm",
                                            "fused_qkv_gemm_w4", "paged_attention", "attention_combine",
                                            "mla_decode", "paged_kv_gather"]
    assert [key[0] for key, _ in selftest_units("sm_100a", quick=True, ops=["sparse_mla_attention"])] == [
        "mla_decode_sm100"]
    assert selftest_units("sm_90a", quick=True, ops=["sparse_mla_attention"]) == []  # no SM90 kernel


@pytest.mark.compile
def test_prebuild_selftest_then_a_second_process_compiles_nothing(tmp_path):
    cmd = [sys.executable, "-m", "cute_kv", "prebuild", "--selftest", "--quick", "--ops", "store_kv", "--arch",
           "sm_90a", "--cache-dir", str(tmp_path)]
    env = {**os.environ, "CUTE_DSL_DISABLE_FILE_CACHING": "1"}
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert re.search(r"total: 2 kernels, 2 compiled, 0 loaded from disk, [\d.]+ s, 0\.\d\d MiB", first.stdout)
    assert [line.split()[-1] for line in first.stdout.splitlines()[1:3]] == ["paged_kv_store",
                                                                             "paged_kv_store_rope_aware"]
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "total: 2 kernels, 0 compiled, 2 loaded from disk" in second.stdout
    assert len(list(tmp_path.glob("*.o"))) == 2 and len(list(tmp_path.glob("*.json"))) == 2


def test_prebuild_selftest_options(capsys):
    from cute_kv.__main__ import main

    with pytest.raises(SystemExit, match="--quick and --ops choose selftest cases: add --selftest"):
        main(["prebuild", "--quick", "--cache-dir", "unused"])
    with pytest.raises(SystemExit, match="--ops: unknown op.s. nope"):
        main(["prebuild", "--selftest", "--ops", "nope", "--cache-dir", "unused"])
    # a refused call leaves no cache directory set for the rest of the process (its compiles would land there)
    assert os.environ.get("CUTE_KV_CACHE_DIR") != str(Path("unused").resolve())


class _Compiled:
    """What ``disk_cache.store`` uses of a compiled kernel; ``export_to_c`` writes ``data`` (half of it, then fails,
    with ``fail``)."""

    ir_module = None

    def __init__(self, data: bytes, fail: bool = False):
        self.data, self.fail = data, fail

    def export_to_c(self, path, function_name):
        Path(path).write_bytes(self.data[: len(self.data) // 2] if self.fail else self.data)
        if self.fail:
            raise OSError(28, "No space left on device")


def test_disk_cache_writes_whole_files_or_none(tmp_path, monkeypatch):
    """Every file of an entry appears whole or not at all (parallel processes compiling one key, readers meanwhile):
    a write that fails part way (a full disk) leaves the entry as it was and no temporary file."""
    from cute_kv.kernels import disk_cache

    monkeypatch.setattr(disk_cache, "_portable_host_code", lambda ir_module: None)
    stem = disk_cache.entry_name(STORE_KEY, "sm_90a")
    disk_cache.store(STORE_KEY, "sm_90a", _Compiled(b"first object"), tmp_path)
    info = (tmp_path / f"{stem}.json").read_text()
    with pytest.raises(OSError, match="No space"):
        disk_cache.store(STORE_KEY, "sm_90a", _Compiled(b"second object", fail=True), tmp_path)
    assert (tmp_path / f"{stem}.o").read_bytes() == b"first object"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.json", f"{stem}.o"]

    real = Path.write_text

    def half_then_full_disk(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    (tmp_path / f"{stem}.json").unlink()
    monkeypatch.setattr(Path, "write_text", half_then_full_disk)
    with pytest.raises(OSError, match="No space"):
        disk_cache.store(STORE_KEY, "sm_90a", _Compiled(b"third object"), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{stem}.o"]  # no half-written description
    assert (tmp_path / f"{stem}.o").read_bytes() == b"third object"
    monkeypatch.setattr(Path, "write_text", real)
    disk_cache.store(STORE_KEY, "sm_90a", _Compiled(b"third object"), tmp_path)
    assert (tmp_path / f"{stem}.json").read_text() == info
