"""``python -m cute_kv selftest``: the CPU answer, the case grid against the kernel catalog (each case's launches
planned for sm_90a and sm_100a by a dry run), the harness pieces that can fail, run with the CPU as the device (the
ops are then their references, so a correct op scores 0 and a broken one must be caught), and the worker processes
that survive a case that hangs, raises, kills its process or leaves NaN."""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

import cute_kv
from cute_kv import reference, selftest
from cute_kv.kernels import catalog, compile_cache
from cute_kv.kernels.archs import SM_COUNTS, generation
from cute_kv.selftest import Case

NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU answer, also on a GPU machine


def test_cli_on_cpu_says_nothing_to_test(tmp_path):
    rows = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, "-m", "cute_kv", "selftest", "--quick", "--json", str(rows)],
                         capture_output=True, text=True, timeout=120, env=NO_GPU)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device, nothing to test" in out.stdout
    assert json.loads(rows.read_text()) == {"device": "cpu", "rows": []}


def test_cli_on_an_arch_without_kernels_writes_its_json(tmp_path, monkeypatch, capsys):
    """An A100 (sm_80): no case has a kernel, and ``--json`` still gets its (empty) rows, as on the CPU."""
    from launch import as_cuda

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    rows = tmp_path / "rows.json"
    args = argparse.Namespace(quick=True, ops=None, list=False, json=str(rows), timeout=60.0, cache_dir=None)
    with as_cuda("sm_80a"):
        assert selftest.run(args) == 0
    assert "has a kernel on sm_80a" in capsys.readouterr().out
    assert json.loads(rows.read_text()) == {"device": "NVIDIA A100", "arch": "sm_80a", "rows": []}


def test_cli_lists_the_cases_without_a_gpu():
    out = subprocess.run([sys.executable, "-m", "cute_kv", "selftest", "--list", "--quick", "--ops",
                          "store_kv,sparse_mla_attention"], capture_output=True, text=True, timeout=120, env=NO_GPU)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "3 cases"
    assert lines[0].split() == ["store_kv", "bf16", "P=16", "D=128", "ragged", "sm_90a", "sm_100a", "sm_103a"]
    assert lines[2].split()[-2:] == ["sm_100a", "sm_103a"] and "sm_90a" not in lines[2]  # sparse MLA: Blackwell's
    bad = subprocess.run([sys.executable, "-m", "cute_kv", "selftest", "--list", "--ops", "store_kv,nope"],
                         capture_output=True, text=True, timeout=120, env=NO_GPU)
    assert bad.returncode != 0 and "--ops: unknown op(s) nope: choose from store_kv" in bad.stderr


def test_cases_cover_every_op_dtype_page_size_and_ragged_step():
    all_cases = selftest.cases()
    assert len(set(all_cases)) == len(all_cases)
    assert {c.op for c in all_cases} == set(selftest.OPS) == {
        "store_kv", "fused_qkv_matmul_kv_cache", "paged_attention", "mla_prefill", "sparse_mla_attention", "gather_kv"}
    for op in ("store_kv", "fused_qkv_matmul_kv_cache", "paged_attention", "gather_kv"):
        mine = [c for c in all_cases if c.op == op]
        small = {1, 2, 4, 8} if op == "paged_attention" else set()  # gathered rows (SM90 cp.async, SM100 gather4)
        assert {c.step for c in mine} >= {"decode", "ragged"} and {c.page_size for c in mine} == {16, 64, 128} | small
    attention = [c for c in all_cases if c.op == "paged_attention"]
    assert {c.cache for c in attention} == {"bf16", "fp16", "fp8 f32 scales", "fp8 e8m0 scales", "fp8", "mla",
                                            "mla rope-aware"}
    assert {c.head_size for c in attention if not c.cache.startswith("mla")} == {64, 80, 96, 128, 192, 256}
    small = {(c.page_size, c.head_size, c.step) for c in attention if c.page_size < 16}
    assert small >= {(p, d, step) for p in (1, 2, 4, 8) for d in (64, 128, 256) for step in selftest.BOTH} | {
        (1, 128, "split")}
    assert {c.variant for c in attention} == {"", "window", "softcap", "sinks", "lse", "tensor scales", "HND"}
    # two Q tiles per CTA on SM100 (a 300-token prompt, 16-bit, D 64 / 128) and SM90's 112- / 80-key tiles
    assert {(c.cache, c.head_size) for c in attention if c.step == "prefill"} >= {
        (dt, d) for dt in ("bf16", "fp16") for d in (64, 128)} | {("bf16", 192), ("bf16", 256)}
    assert {c.cache for c in attention if c.step == "split"} == {"bf16", "fp8 f32 scales", "mla", "mla rope-aware"}
    assert {c.cache for c in all_cases if c.op == "store_kv"} == {"bf16", "fp16", "fp32", "fp8 f32 scales", "mla",
                                                                  "mla rope-aware", "fp8"}
    # the unscaled fp8 cache with per-tensor k_scale / v_scale, for the store and the attention
    assert {c.variant for c in all_cases if c.op == "store_kv" and c.cache == "fp8"} == {"tensor scales"}
    assert "tensor scales" in {c.variant for c in attention if c.cache == "fp8"}
    qkv = [c for c in all_cases if c.op == "fused_qkv_matmul_kv_cache"]
    assert {c.variant for c in qkv} == {"", "bias", "qk-norm", "int4 g32", "int4 g64", "int4 g128", "int4 g128 zp",
                                        "int4 g128 k1024", "fp8 weights", "latent-norm"}
    assert {(c.cache, c.head_size) for c in qkv} >= {("bf16", 256), ("mla", 576), ("mla rope-aware", 576)}
    assert {c.archs for c in all_cases if c.op == "sparse_mla_attention"} == {("sm_100a", "sm_103a")}
    cached, new = selftest.RAGGED
    assert 0 in cached and 0 in new and 1 in new and max(new) > 16  # empty cache, 0/1 new tokens, pages crossed
    assert set(selftest.DECODE[1]) == {1} and 0 in selftest.DECODE[0]
    quick = selftest.cases(quick=True)
    assert set(quick) < set(all_cases) and {c.op for c in quick} == {c.op for c in all_cases} - {"mla_prefill"}
    assert selftest.cases(ops=["gather_kv"], arch="sm_90a") == [c for c in all_cases if c.op == "gather_kv"]
    assert selftest.cases(ops=["sparse_mla_attention"], arch="sm_90a") == []


# The catalog family each compile key's kernel belongs to (``kernels/catalog.py``), per arch: mla_prefill runs
# PagedAttention (SM90) or PagedAttentionSm100 at 192/128.
FAMILY = {
    "paged_kv_store": "paged_kv_store", "paged_kv_store_rope_aware": "paged_kv_store_rope_aware",
    "paged_kv_gather": "paged_kv_gather", "attention_combine": "attention_combine",
    ("fused_qkv_gemm", "sm_90a"): "fused_qkv_gemm_90", ("fused_qkv_gemm", "sm_100a"): "fused_qkv_gemm_100",
    "fused_qkv_gemm_w4": "fused_qkv_gemm_w4_90", "fused_qkv_gemm_w4_sm100": "fused_qkv_gemm_w4_100",
    "paged_attention": "paged_attention_sm90", "paged_attention_sm100": "paged_attention_sm100",
    "mla_prefill_sm90": "paged_attention_sm90", "mla_prefill_sm100": "paged_attention_sm100",
    "mla_decode": "mla_decode_sm90",
    "mla_decode_sm100": "mla_decode_sm100",
}


def _families(case, arch):
    units = selftest.kernel_units(case, arch, SM_COUNTS[arch])
    return {FAMILY.get((key[0], generation(arch)), FAMILY.get(key[0])) for key, _ in units}, units


@pytest.mark.parametrize("arch", selftest.ARCHS)
def test_the_grid_reaches_every_kernel_family_of_the_arch(arch):
    """Each case's call, planned and prepared for ``arch`` with nothing compiled (``kernel_units``), launches a
    kernel exactly on the archs it names; together the cases reach every catalog family of the arch, and the quick
    ones do with one case and one compile per family and op (SM100's sparse MLA is a mode of its MLA decode)."""
    compiles = compile_cache.cache_info()["compiles"]
    want = {f.name for f in catalog.FAMILIES if arch in f.archs}
    reached = set()
    for case in selftest.cases():
        families, units = _families(case, arch)
        assert bool(units) == (arch in case.archs), (case, units)
        assert None not in families, (case, [key[0] for key, _ in units])  # a kernel the map above does not know
        reached |= families
    assert reached == want
    quick_units, quick_reached = {}, set()
    for case in selftest.cases(quick=True, arch=arch):
        families, units = _families(case, arch)
        assert {(f, case.op) for f in families} - quick_reached, f"{case} adds no kernel family"
        quick_reached |= {(f, case.op) for f in families}
        quick_units.update((repr(key), key) for key, _ in units)
    assert {f for f, _ in quick_reached} == want and len(quick_units) == len(quick_reached)
    assert compile_cache.cache_info()["compiles"] == compiles  # dry runs compile nothing


def test_dry_run_arguments_and_its_keys_are_the_launchers():
    case = Case("paged_attention", "bf16", 16, 128, "split")
    with pytest.raises(ValueError, match="arch must be one of"):
        selftest.kernel_units(case, "sm_80", 132)
    with pytest.raises(ValueError, match="sm_count must be a positive int"):
        selftest.kernel_units(case, "sm_90a", 0)
    # Split-KV needs SMs to spare: on a GPU of a few SMs the same decode step takes one split and no combine.
    names = lambda sms: [key[0] for key, _ in selftest.kernel_units(case, "sm_90a", sms)]  # noqa: E731
    assert names(132) == ["paged_attention", "attention_combine"] and names(1) == ["paged_attention"]
    # The bias flag is part of the fused QKV kernel's key, set by the launcher, not by the plan.
    bias = selftest.kernel_units(Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "ragged", "bias"), "sm_90a", 132)
    assert [key[1].has_bias for key, _ in bias] == [True]
    assert cute_kv.ops.paths.dry_target() is None  # left when done


ONE_PER_OP = [Case("store_kv", "fp8 f32 scales", 16, 128, "ragged"), Case("store_kv", "mla", 64, 128, "decode"),
              Case("store_kv", "mla rope-aware", 16, 576, "ragged"),
              Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "ragged"),
              Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "decode", "int4 g64"),
              Case("fused_qkv_matmul_kv_cache", "mla rope-aware", 64, 576, "ragged", "latent-norm"),
              Case("paged_attention", "fp8 e8m0 scales", 64, 64, "ragged"),
              Case("paged_attention", "bf16", 16, 128, "ragged", "lse"),
              Case("paged_attention", "mla rope-aware", 16, 576, "split"),
              Case("sparse_mla_attention", "mla", 64, 576, "ragged", archs=("sm_100a",)),
              Case("gather_kv", "fp16", 16, 128, "ragged")]


@pytest.mark.parametrize("case", ONE_PER_OP, ids=lambda c: f"{c.op}-{c.config}")
def test_reference_against_itself_passes(case):
    row = selftest.run_case(case, "cpu")
    assert (row.ok, row.max_err, row.path, row.error) == (True, 0.0, "reference", None)
    assert row.ours_ms is None  # timed on CUDA only


@pytest.mark.parametrize("step", ["decode", "prefill"])
def test_mla_prefill_on_the_cpu_is_within_its_tolerance(step):
    """On the CPU the op runs its route (absorbed for decode, decompressed for the prefill, rounding to bf16 between
    matmuls), not the float32 reference's formulation: close, not equal."""
    row = selftest.run_case(Case("mla_prefill", "mla", 64, 576, step), "cpu")
    assert row.ok and 0 < row.max_err < selftest.MLA_PREFILL_TOLERANCE / 3, row


def _noisy_attention(*args, **kwargs):
    out = cute_kv.paged_attention(*args, **kwargs)
    return out.add_(0.1)


def _store_skipping_last_request(k, v, ro, collection, layer_idx):
    end = int(ro[-2])  # rows of every request but the last
    trimmed = ro.to(torch.int64).clamp(max=end).to(torch.uint32)
    cut = collection.with_metadata(collection.cache_lengths, collection.lookup_table, collection.max_seq_length,
                                   collection.max_cache_length)
    reference.store_kv(k[:end], None if v is None else v[:end], trimmed, cut, layer_idx)


def _store_also_writing_a_spare_page(k, v, ro, collection, layer_idx):
    reference.store_kv(k, v, ro, collection, layer_idx)
    collection.blocks[-1, 0, 0, 0, 0, 0] += 1  # a page nobody owns


def _attention_leaving_rows_unwritten(q, ro, collection, layer_idx, *, out, **kwargs):
    reference.paged_attention(q[1:], _drop_first_row(ro), collection, layer_idx, out=out[1:], **kwargs)
    return out


def _drop_first_row(ro):
    r = ro.to(torch.int64) - 1
    return r.clamp(min=0).to(torch.uint32)


def _raises(*args, **kwargs):
    raise RuntimeError("launch failed")


def _attention_writing_the_cache(q, ro, collection, layer_idx, **kwargs):
    out = cute_kv.paged_attention(q, ro, collection, layer_idx, **kwargs)
    collection.blocks[0, 0, layer_idx, 0, 0, 0] = 0.5  # a reader must leave the cache as it was
    return out


def _qkv_skipping_the_cache(hidden, ro, weight, collection, layer_idx, **kwargs):
    blocks = collection.blocks.clone()
    out = cute_kv.fused_qkv_matmul_kv_cache(hidden, ro, weight, collection, layer_idx, **kwargs)
    collection.blocks.copy_(blocks)  # Q right, the step's K/V rows left NaN
    return out


@pytest.mark.parametrize("case, ours, what", [
    (Case("paged_attention", "bf16", 16, 128, "ragged"), _noisy_attention, "wrong values"),
    (Case("store_kv", "bf16", 16, 128, "ragged"), _store_skipping_last_request, "rows not written"),
    (Case("store_kv", "fp16", 64, 128, "decode"), _store_also_writing_a_spare_page, "a write outside the step"),
    (Case("paged_attention", "fp16", 16, 64, "ragged"), _attention_leaving_rows_unwritten, "NaN left in the output"),
    (Case("gather_kv", "bf16", 16, 128, "decode"), _raises, "an exception"),
    (Case("paged_attention", "mla", 16, 576, "decode"), _attention_writing_the_cache, "a reader writing the cache"),
    (Case("fused_qkv_matmul_kv_cache", "mla", 64, 576, "ragged"), _qkv_skipping_the_cache, "K/V not stored"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_broken_op_is_reported_as_fail(case, ours, what):
    row = selftest.run_case(case, "cpu", ours)
    assert not row.ok, what
    assert row.max_err > selftest.TOLERANCE[torch.float16]
    if ours is _raises:
        assert row.path == "error" and row.error == "RuntimeError: launch failed"


def test_rel_err():
    a = torch.tensor([1.0, 2.0, -4.0])
    assert selftest.rel_err(a, a.clone()) == 0.0
    assert selftest.rel_err(a + torch.tensor([0.0, 0.0, 0.4]), a) == pytest.approx(0.1)
    assert selftest.rel_err(torch.tensor([1.0, math.nan, -4.0]), a) == math.inf
    assert selftest.rel_err(a[:2], a) == math.inf
    both = torch.tensor([math.nan, 1.0])
    assert selftest.rel_err(both, both.clone()) == 0.0  # NaN where the reference has NaN (fp8 NaN inputs)


def test_table_lists_each_case_and_the_failures():
    good = selftest.Row(ONE_PER_OP[0], "kernel PagedKVStore", 1e-3, True, 0.012, 0.5)
    bad = selftest.Row(ONE_PER_OP[2], "reference", math.inf, False, error="ValueError: boom")
    timed = selftest.Row(ONE_PER_OP[3], "kernel PagedAttention", 0.0, True, 0.02, 1.0, 0.025)
    wrong_peer = selftest.Row(ONE_PER_OP[3], "kernel PagedAttention", 0.0, True, 0.02, 1.0, "wrong")
    lines = selftest.table([good, bad, timed, wrong_peer]).splitlines()
    assert lines[0].split() == ["op", "config", "path", "max", "err", "ours", "ms", "ref", "ms", "flashinfer", "ms"]
    assert "store_kv" in lines[2] and "kernel PagedKVStore" in lines[2] and " ok " in lines[2]
    assert lines[2].split()[-3:] == ["0.012", "0.500", "-"]
    assert "FAIL" in lines[3] and "ValueError: boom" in lines[3]
    assert lines[4].split()[-3:] == ["0.020", "1.000", "0.025"] and lines[5].split()[-1] == "wrong"
    assert lines[-1] == "3 of 4 passed; 1 FAILED"


class FakeFlashInfer:
    """FlashInfer's paged-attention contract, written out in float64: request ``b`` reads pages
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``, all of them full but the last (``kv_last_page_len[b]`` tokens);
    causal queries sit at the end of the keys (bottom-right). Checks the page table ``flashinfer_attention`` builds."""

    class _Wrapper:
        def __init__(self, workspace, layout):
            assert layout == "NHD" and workspace.dtype == torch.uint8

        def plan(self, *args, causal=True, q_data_type=None, kv_data_type=None):
            *qo, self.indptr, self.indices, self.last, self.hq, self.hkv, self.d, self.p = args
            self.qo = qo[0] if qo else torch.arange(self.indptr.numel(), dtype=torch.int32)  # decode: one each
            assert causal and all(x.dtype == torch.int32 for x in (self.qo, self.indptr, self.indices, self.last))

        def run(self, q, kv):
            k_cache, v_cache = kv
            out = torch.empty_like(q)
            for b in range(self.indptr.numel() - 1):
                pages = self.indices[self.indptr[b]:self.indptr[b + 1]].long()
                n_kv = (pages.numel() - 1) * self.p + int(self.last[b]) if pages.numel() else 0
                lo, hi = int(self.qo[b]), int(self.qo[b + 1])
                if hi == lo:
                    continue
                k = k_cache[pages].flatten(0, 1)[:n_kv].double().repeat_interleave(self.hq // self.hkv, 1)
                v = v_cache[pages].flatten(0, 1)[:n_kv].double().repeat_interleave(self.hq // self.hkv, 1)
                s = torch.einsum("nhd,shd->hns", q[lo:hi].double(), k) / math.sqrt(self.d)
                pos = n_kv - (hi - lo) + torch.arange(hi - lo)
                s = s.masked_fill(torch.arange(n_kv)[None, :] > pos[:, None], -math.inf)
                out[lo:hi] = torch.einsum("hns,shd->nhd", s.softmax(-1), v).to(q.dtype)
            return out

    BatchDecodeWithPagedKVCacheWrapper = _Wrapper
    BatchPrefillWithPagedKVCacheWrapper = _Wrapper


@pytest.mark.parametrize("step", ["decode", "ragged"])
def test_flashinfer_peer_reads_the_same_pages(step):
    case = Case("paged_attention", "bf16", 16, 64, step)
    pb = selftest._batch(case, "cpu")
    setup = selftest._setup(case, pb, torch.Generator().manual_seed(3), "cpu")
    want = setup.call(reference.paged_attention, pb.collection)
    got = setup.peer(FakeFlashInfer)()
    assert selftest.rel_err(got, want) < selftest.TOLERANCE[torch.bfloat16]
    fp8 = Case("paged_attention", "fp8", 16, 64, step)
    assert selftest._setup(fp8, selftest._batch(fp8, "cpu"), torch.Generator(), "cpu").peer is None  # not the same


# -- cases in worker processes ----------------------------------------------------------------------------------

def _nan_in_a_row(*args, **kwargs):
    out, lse = cute_kv.paged_attention(*args, **kwargs)
    out[3, 1, 5] = math.nan
    return out, lse


def _misbehaving(case, device, **kwargs):
    """``run_case`` in the worker, but by variant: ``window`` hangs, ``softcap`` raises, ``sinks`` kills its process,
    ``lse`` leaves a NaN in the output."""
    if case.variant == "window":
        time.sleep(600)
    if case.variant == "softcap":
        raise RuntimeError("an illegal memory access was encountered")
    if case.variant == "sinks":
        os._exit(3)
    return selftest.run_case(case, device, _nan_in_a_row if case.variant == "lse" else None, **kwargs)


def test_a_case_that_hangs_raises_dies_or_leaves_nan_fails_and_the_next_runs():
    plain = Case("paged_attention", "bf16", 16, 128, "ragged")
    chosen = [Case("paged_attention", "bf16", 16, 128, "ragged", v) for v in ("window", "softcap", "sinks")]
    chosen += [plain, Case("paged_attention", "bf16", 16, 128, "ragged", "lse"), Case("store_kv", "bf16", 16, 128,
                                                                                       "decode")]
    started, seen = [], []
    start = time.perf_counter()
    rows = selftest.run_isolated(chosen, "cpu", timeout=6, runner=_misbehaving, on_start=started.append,
                                 on_row=seen.append)
    assert time.perf_counter() - start < 120  # the hung case was killed after its 6 s
    assert seen == rows and [r.case for r in rows] == chosen and started == [
        {"device": "cpu", "arch": None, "sm_count": None, "peer": None}]
    assert [(r.path, r.ok) for r in rows] == [("hung", False), ("error", False), ("crashed", False),
                                              ("reference", True), ("reference", False), ("reference", True)]
    assert rows[0].error == "hung running: nothing within 6 s; its worker was killed"
    assert rows[1].error == "RuntimeError: an illegal memory access was encountered"
    assert rows[2].error == "its worker exited (code 3) running"
    assert rows[4].max_err == math.inf and rows[4].error is None  # the NaN
    assert all(r.compile_s is not None and r.run_s is not None for r in rows[3:])


@pytest.mark.compile
def test_a_worker_brings_a_cases_kernels_in_through_the_disk_cache(tmp_path, monkeypatch):
    """What a worker on a GPU does before running a case: its kernels compiled into the disk cache, which a fresh
    worker then loads."""
    monkeypatch.setenv("CUTE_KV_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_cache", {})
    case = Case("store_kv", "mla rope-aware", 16, 576, "ragged")
    info = compile_cache.cache_info()
    assert selftest.bring_in(case, "cpu", "sm_90a", SM_COUNTS["sm_90a"]) == 1
    assert compile_cache.cache_info()["compiles"] == info["compiles"] + 1 and len(list(tmp_path.glob("*.o"))) == 1
    monkeypatch.setattr(compile_cache, "_cache", {})  # a fresh worker
    assert selftest.bring_in(case, "cpu", "sm_90a", SM_COUNTS["sm_90a"]) == 1
    assert compile_cache.cache_info()["disk_loads"] == info["disk_loads"] + 1


def test_json_rows(tmp_path):
    good = selftest.Row(ONE_PER_OP[0], "kernel paged_kv_store", 1e-3, True, 0.012, 0.5, compile_s=2.0, run_s=0.3)
    hung = selftest.Row(ONE_PER_OP[6], "hung", math.inf, False, error="hung running")
    path = tmp_path / "rows.json"
    selftest._write_json(str(path), {"device": "H100", "arch": "sm_90a"}, [good, hung])
    got = json.loads(path.read_text())
    assert (got["device"], got["arch"], len(got["rows"])) == ("H100", "sm_90a", 2)
    assert got["rows"][0] == {"op": "store_kv", "cache": "fp8 f32 scales", "page_size": 16, "head_size": 128,
                              "step": "ragged", "variant": "", "config": "fp8 f32 scales P=16 D=128 ragged",
                              "path": "kernel paged_kv_store", "max_err": 1e-3, "ok": True, "ours_ms": 0.012,
                              "ref_ms": 0.5, "peer_ms": None, "compile_s": 2.0, "run_s": 0.3, "error": None}
    assert (got["rows"][1]["max_err"], got["rows"][1]["ok"], got["rows"][1]["error"]) == ("inf", False, "hung running")


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu(capsys):
    """Every quick case on this GPU: the kernels against their references, timed."""
    from cute_kv.__main__ import main

    code = main(["selftest", "--quick"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kernel paged_attention" in out and "kernel paged_kv_store" in out and "FAIL" not in out
