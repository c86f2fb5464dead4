"""``python -m cute_kv selftest``: the CPU answer, and the harness pieces that can fail, run with the CPU as the
device (the ops are then their references, so a correct op scores 0 and a broken one must be caught)."""

import math
import subprocess
import sys

import pytest
import torch

import cute_kv
from cute_kv import reference, selftest
from cute_kv.selftest import Case


def test_cli_on_cpu_says_nothing_to_test():
    out = subprocess.run([sys.executable, "-m", "cute_kv", "selftest"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device, nothing to test" in out.stdout


def test_cases_cover_every_op_dtype_page_size_and_ragged_step():
    all_cases = selftest.cases()
    assert {c.op for c in all_cases} == {"store_kv", "fused_qkv_matmul_kv_cache", "paged_attention", "gather_kv"}
    for op in {c.op for c in all_cases}:
        mine = [c for c in all_cases if c.op == op]
        assert {c.step for c in mine} == {"decode", "ragged"} and {c.page_size for c in mine} == {16, 64, 128}
    assert {c.cache for c in all_cases if c.op == "paged_attention"} >= {"bf16", "fp16", "fp8 f32 scales",
                                                                         "fp8 e8m0 scales", "fp8"}
    assert {c.head_size for c in all_cases if c.op == "paged_attention"} == {64, 128, 256}
    assert {c.cache for c in all_cases if c.op == "store_kv"} >= {"bf16", "fp16", "fp32", "fp8 f32 scales", "mla"}
    cached, new = selftest.RAGGED
    assert 0 in cached and 0 in new and 1 in new and max(new) > 16  # empty cache, 0/1 new tokens, pages crossed
    assert set(selftest.DECODE[1]) == {1} and 0 in selftest.DECODE[0]
    quick = selftest.cases(quick=True)
    assert set(quick) < set(all_cases) and {c.op for c in quick} == {c.op for c in all_cases}
    assert {c.cache for c in quick if c.op == "paged_attention"} == {"bf16", "fp8 f32 scales"}
    assert len(set(all_cases)) == len(all_cases)


ONE_PER_OP = [Case("store_kv", "fp8 f32 scales", 16, 128, "ragged"), Case("store_kv", "mla", 64, 128, "decode"),
              Case("fused_qkv_matmul_kv_cache", "bf16", 16, 128, "ragged"),
              Case("paged_attention", "fp8 e8m0 scales", 64, 64, "ragged"), Case("gather_kv", "fp16", 16, 128, "ragged")]


@pytest.mark.parametrize("case", ONE_PER_OP, ids=lambda c: f"{c.op}-{c.config}")
def test_reference_against_itself_passes(case):
    row = selftest.run_case(case, "cpu")
    assert (row.ok, row.max_err, row.path, row.error) == (True, 0.0, "reference", None)
    assert row.ours_ms is None  # timed on CUDA only


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


@pytest.mark.parametrize("case, ours, what", [
    (Case("paged_attention", "bf16", 16, 128, "ragged"), _noisy_attention, "wrong values"),
    (Case("store_kv", "bf16", 16, 128, "ragged"), _store_skipping_last_request, "rows not written"),
    (Case("store_kv", "fp16", 64, 128, "decode"), _store_also_writing_a_spare_page, "a write outside the step"),
    (Case("paged_attention", "fp16", 16, 64, "ragged"), _attention_leaving_rows_unwritten, "NaN left in the output"),
    (Case("gather_kv", "bf16", 16, 128, "decode"), _raises, "an exception"),
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


@pytest.mark.gpu
def test_selftest_passes_on_the_gpu(capsys):
    """Every quick case on this GPU: the kernels against their references, timed."""
    from cute_kv.__main__ import main

    code = main(["selftest", "--quick"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "kernel PagedAttention" in out and "kernel PagedKVStore" in out and "FAIL" not in out
