"""perf/bench_store_kv.py, perf/bench_fused_qkv.py, perf/bench_paged_attention.py and perf/cases.py: the
CPU-checkable parts.

The torch peers must write exactly what ``cute_kv.reference`` writes, and FlashInfer's page table must address
the same rows, or the speed-ups the benchmarks report compare different work.
"""

import os
import subprocess
import sys

import pytest
import torch

PERF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "perf")
sys.path.insert(0, PERF)

import bench_fused_qkv  # noqa: E402
import bench_store_kv  # noqa: E402
import cases  # noqa: E402
import mla_mma_work  # noqa: E402
import cute_kv  # noqa: E402
from cute_kv import reference  # noqa: E402
from cute_kv.reference.batch import random_paged_batch  # noqa: E402
from cute_kv.reference.ragged import positions, ragged_coords  # noqa: E402

# Ragged on purpose: an empty cache, a partial last page, new tokens crossing pages, a request with none.
CACHED, NEW = [0, 5, 9, 3], [6, 1, 0, 11]


def test_byte_and_flop_counts():
    row = 8 * 128 * 2  # one token's K (or V) row of Llama-3-8B in bf16
    assert bench_store_kv.store_bytes(1) == 4 * row
    assert bench_store_kv.store_bytes(128) == 2**20  # decode: 1 MiB a call
    assert bench_store_kv.store_bytes(3, num_heads=2, head_size=4, element_size=1) == 4 * 3 * 8
    assert bench_fused_qkv.N_OUT == 6144
    assert bench_fused_qkv.qkv_flops(8192) == 2 * 8192 * 4096 * 6144
    assert bench_fused_qkv.qkv_bytes(0) == 6144 * 4096 * 2  # the weight alone
    assert bench_fused_qkv.qkv_bytes(128) - bench_fused_qkv.qkv_bytes(0) == 128 * (4096 + 6144) * 2


def test_steps():
    decode, prefill, bulk = (cases.STEPS[n] for n in ("decode", "prefill", "bulk"))
    assert decode.requests == decode.rows == 128 and set(decode.new_lengths) == {1}
    assert all(1024 <= c <= 4096 for c in decode.cache_lengths) and len(set(decode.cache_lengths)) > 64
    assert decode == cases.decode_step()  # seeded: every run times the same step
    assert (prefill.rows, prefill.max_context) == (8192, 1024) and bulk.rows == 32768


def test_ragged_coords_match_positions():
    ro = torch.tensor([0, 6, 7, 7, 18], dtype=torch.int64).to(torch.uint32)
    cl = torch.tensor(CACHED, dtype=torch.int64).to(torch.uint32)
    batch, pos = ragged_coords(ro, cl)
    assert batch.tolist() == [0] * 6 + [1] + [3] * 11
    assert torch.equal(pos, positions(ro, cl))


@pytest.mark.parametrize("page_size, layer", [(4, 0), (4, 2), (16, 1)])
def test_index_copy_peer_writes_what_the_reference_writes(rng, page_size, layer):
    b = random_paged_batch(CACHED, NEW, num_heads=2, head_size=8, page_size=page_size, generator=rng, num_layers=3)
    c = b.collection
    k, v = (torch.randn((b.total_rows, 2, 8), generator=rng).to(torch.bfloat16) for _ in range(2))
    before = c.blocks.clone()
    reference.store_kv(k, v, b.input_row_offsets, c, layer)
    expected = c.blocks.clone()
    c.blocks.copy_(before)
    cases.index_copy_store(c.blocks.view(-1, 2, 8), *cases.flat_rows(c, b.input_row_offsets, layer), k, v)
    assert not torch.equal(expected, before) and torch.equal(c.blocks, expected)


def _paged_sets(rng, **kw):
    step = cases.Step(tuple(CACHED), tuple(NEW))
    return cases.PagedSets(step, page_size=4, num_layers=2, n_sets=3, generator=rng, num_heads=2, head_size=8, **kw)


def test_paged_sets_rotate_rows_and_flashinfer_addresses_the_same_rows(rng):
    sets = _paged_sets(rng)
    new = torch.tensor(NEW)
    batch, pos = sets.fi_batch.long(), sets.fi_positions.long()
    for r, c in enumerate(sets.collections):
        c.check_metadata()
        c.check_writable("step", new)
        assert torch.cat(sets.rows[r]).unique().numel() == 2 * sum(NEW)
        # FlashInfer's append kernel: token pos of request b goes on page kv_indices[kv_indptr[b] + pos // P],
        # written through the layer's strided K plane.
        indices, indptr, last = (x.long() for x in sets.fi_pages[r])
        page = indices[indptr[batch] + pos // 4]
        for plane, rows in zip(sets.planes[sets.layer(r)], sets.rows[r]):
            offset = plane.storage_offset() + page * plane.stride(0) + pos % 4 * plane.stride(1)
            assert torch.equal(offset, rows * 2 * 8)  # flat rows of H*D = 16 elements
        assert indptr[-1] == indices.numel() and all(1 <= x <= 4 for x in last.tolist())
    assert sets.layer(2) == 0 and not torch.equal(sets.rows[0][0], sets.rows[2][0])  # same layer, other pages


def test_write_error_flags_unwritten_rows(rng):
    sets = _paged_sets(rng, dtype=torch.float32)
    k, v = torch.randn((sum(NEW), 2, 8), generator=rng), torch.randn((sum(NEW), 2, 8), generator=rng)
    assert sets.write_error(lambda r: cases.index_copy_store(sets.flat, *sets.rows[r], k, v), k, v) == 0.0
    assert sets.write_error(lambda r: None, k, v) == float("inf")


def test_gemm_index_copy_peer_matches_reference_fused_qkv(rng):
    """``split_kv`` takes the reference's K and V columns: GEMM + index_copy_ stores what the reference stores."""
    b = random_paged_batch(CACHED, NEW, num_heads=cases.KV_HEADS, head_size=cases.HEAD_DIM, page_size=4,
                           generator=rng, num_layers=2)
    c = b.collection
    hidden = torch.randn((b.total_rows, cases.HIDDEN), generator=rng).to(torch.bfloat16)
    weight = (torch.randn((bench_fused_qkv.N_OUT, cases.HIDDEN), generator=rng) / 64).to(torch.bfloat16)
    before = c.blocks.clone()
    reference.fused_qkv_matmul_kv_cache(hidden, b.input_row_offsets, weight, c, 1)
    expected = c.blocks.clone()
    c.blocks.copy_(before)
    k, v = bench_fused_qkv.split_kv((hidden.float() @ weight.float().T).to(torch.bfloat16))
    flat = c.blocks.view(-1, cases.KV_HEADS, cases.HEAD_DIM)
    cases.index_copy_store(flat, *cases.flat_rows(c, b.input_row_offsets, 1), k, v)
    assert not torch.equal(expected, before) and torch.equal(c.blocks, expected)


def test_add_speedups_and_absent_peer():
    absent = cases.measure(cases.Impl("flashinfer", "peer", absent="flashinfer import failed"), 1, tol=0.0,
                           samples=1, host_iters=1)
    assert absent == {"impl": "flashinfer", "role": "peer", "status": "absent", "error": "flashinfer import failed"}
    records = [{"impl": "cute_kv", "role": "ours", "status": "ok", "graph_us": 10.0, "eager_us": 20.0},
               {"impl": "torch_gemm", "role": "bound", "status": "ok", "graph_us": 9.0, "eager_us": 30.0},
               {"impl": "fi", "role": "peer", "status": "ok", "eager_us": 40.0},  # not capturable: eager vs eager
               {"impl": "ic", "role": "peer", "status": "ok", "graph_us": 15.0, "eager_us": 16.0},
               {"impl": "bad", "role": "peer", "status": "wrong", "graph_us": 1.0, "eager_us": 1.0}, absent]
    cases.add_speedups(records)
    ours = records[0]
    assert ours["speedup_vs_torch_gemm"] == pytest.approx(0.9) and ours["speedup_vs_fi"] == pytest.approx(2.0)
    assert ours["speedup_vs_ic"] == pytest.approx(1.5) and ours["speedup_vs_best_peer"] == pytest.approx(1.5)
    assert "speedup_vs_bad" not in ours and "speedup_vs_flashinfer" not in ours
    assert not any(k.startswith("speedup") for r in records[1:] for k in r)


def test_run_list_shows_both():
    out = subprocess.run([sys.executable, os.path.join(PERF, "run.py"), "list"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    names = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()}
    assert names["store-kv"] == names["fused-qkv"] == "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("bench, argv", [
    (bench_store_kv, ["--cases", "prefill", "--page-sizes", "16"]),
    (bench_fused_qkv, ["--cases", "decode", "--page-sizes", "64"]),
])
def test_bench_runs_on_gpu(bench, argv):
    records = bench.main([*argv, "--layers", "2", "--samples", "3", "--host-iters", "10"])
    timed = [r for r in records if "impl" in r]
    assert {r["status"] for r in timed} <= {"ok", "absent"}, [r.get("error") for r in timed]
    assert all(r["median_us"] > 0 for r in timed if r["status"] == "ok")


def test_paged_attention_cpu_smoke_checks_every_implementation_and_times_nothing(capsys):
    """The CPU smoke in a bare clone: cute-kv (its reference here) and torch SDPA over gathered pages agree with the
    float32 reference on ragged decode and on prefill after 0 and 20 cached tokens; the optional peers are recorded
    absent or checked; nothing is timed, so no speed-up is printed."""
    import bench_paged_attention

    records = bench_paged_attention.main(["--cpu-smoke"])
    ours = [r for r in records if r.get("impl") == "cute_kv"]
    assert [r["section"] for r in ours] == ["decode", "prefill", "prefill"]
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in ours)
    sdpa = [r for r in records if r.get("impl") == "torch_sdpa_gather"]
    assert len(sdpa) == 3 and all(r["status"] == "ok" and r["rel_err"] < 1e-2 for r in sdpa)
    assert {r["status"] for r in records if r["impl"] not in ("cute_kv", "torch_sdpa_gather")} <= {"ok", "absent"}
    assert not any(k.endswith("_us") or k.startswith("speedup") for r in records for k in r)
    assert "speedup" not in capsys.readouterr().out


def test_paged_attention_shapes_are_ragged_and_placements_disjoint():
    import bench_paged_attention as bench

    decode = bench.step_of(bench.Shape("decode", 32, 1, 4096, 16), seed=1)
    assert set(decode.new_lengths) == {1} and len(set(decode.cache_lengths)) > 8
    assert all(2047 <= c < 4096 for c in decode.cache_lengths)
    step = cases.Step((0, 5, 17), (3, 1, 16))
    pl = bench.Placements(step, 4, 3, "cpu", torch.Generator().manual_seed(0))
    flat = [p for placement in pl.pages for request in placement for p in request]
    assert len(flat) == len(set(flat)) == pl.k_cache.shape[0] == 3 * (1 + 2 + 9)
    for r, c in enumerate(pl.collections):
        c.check_writable("step", torch.tensor(step.new_lengths))
        assert torch.equal(c.blocks[:, 0, 0], pl.k_cache) and torch.equal(c.blocks[:, 1, 0], pl.v_cache)
        for b, pages in enumerate(pl.pages[r]):  # every layout names the same pages in the same order
            assert c.lookup_table[b, :len(pages)].tolist() == pages == pl.page_tables[r][b, :len(pages)].tolist()


@pytest.mark.gpu
def test_paged_attention_bench_runs_on_gpu():
    import bench_paged_attention

    records = bench_paged_attention.main(["--sections", "decode,prefill", "--batches", "8", "--contexts", "512",
                                          "--page-sizes", "16", "--prefill-batch", "2", "--prefill-new", "256",
                                          "--prefill-cached", "0", "--samples", "3", "--host-iters", "10"])
    timed = [r for r in records if "impl" in r]
    assert {r["status"] for r in timed} <= {"ok", "absent"}, [r.get("error") for r in timed]
    ours = [r for r in timed if r["impl"] == "cute_kv"]
    assert len(ours) == 2 and all(r["median_us"] > 0 and "speedup_vs_torch_sdpa_gather" in r for r in ours)


def test_mla_decode_cpu_smoke_and_flashinfer_rows():
    """The MLA bench's CPU smoke checks cute-kv against the reference and times nothing; FlashInfer's CSR pages over
    its split latent / rope caches hold exactly the rows the collection's lookup table names."""
    import bench_mla_decode as bench

    for extra in ([], ["--rope-aware"]):  # 576 bf16 rows; 640-byte rope-aware FP8 rows
        records = bench.main(["--cpu-smoke", *extra])
        assert [(r["impl"], r["status"]) for r in records if r["impl"] == "cute_kv"] == [("cute_kv", "ok")]
        assert not any(k.endswith("_us") or k.startswith("speedup") for r in records for k in r)
    records = bench.main(["--cpu-smoke", "--pv-overlap"])
    assert [(r["impl"], r["status"]) for r in records if r["role"] == "variant"] == [("cute_kv_pv_overlap", "absent")]
    step = cases.Step((40, 0, 17), (1, 1, 1))
    pl = bench.Placements(step, 16, 2, "cpu", torch.Generator().manual_seed(0))
    for r, coll in enumerate(pl.collections):
        indptr, indices = pl.csr[r]
        for b, n in enumerate(pl.kv_lens.tolist()):
            pages = indices[indptr[b]:indptr[b + 1]].long()
            fi_rows = torch.cat([pl.ckv[pages], pl.kpe[pages]], dim=-1).flatten(0, 1)[:n]
            ours = coll.get_key_cache(0).gather(b, 0, n)[:, 0]
            assert torch.equal(fi_rows.float(), ours.float())


def test_mla_decode_pv_overlap_variant_launches_the_ops_key_with_pv_overlap():
    """``--pv-overlap``'s variant on CPU tensors posing as an H100's: ``MLADecode`` launched by the op's own launcher
    with the key ``paged_attention`` plans for the call, ``pv_overlap`` on, meeting the compiled entry's contract."""
    import bench_mla_decode as bench
    from launch import as_cuda

    step = cases.Step((40, 0, 17), (1, 1, 1))
    pl = bench.Placements(step, 64, 1, "cpu", torch.Generator().manual_seed(0))
    q = torch.randn(1, step.rows, bench.Q_HEADS, bench.LATENT, generator=torch.Generator().manual_seed(1))
    q = q.to(torch.bfloat16)
    with as_cuda("sm_90a") as launches:
        path = cute_kv.explain(cute_kv.paged_attention, q[0], pl.offsets, pl.collections[0], 0, mla_v_dim=bench.V_DIM)
        impl = bench._pv_overlap(pl, q, 0.05, torch.device("cuda"))
        assert impl.absent is None and impl.role == "variant"
        impl.fn(0)
    assert path.key[-1] is False
    assert [(launch.kernel, launch.key) for launch in launches] == [("MLADecode", (*path.key[:-1], True))]


def test_plan_step_bench_runs_the_launch_paths_on_the_cpu(capsys):
    import bench_plan_step

    records = bench_plan_step.main(["--iters", "5"])
    modes = {(r["op"], r["mode"]) for r in records}
    assert modes == {(op, mode) for op in ("store_kv", "paged_attention")
                     for mode in ("validate", "validate_false", "plan")} | {("plan_step", "validate")}
    assert all(r["host_us"] > 0 and r["device"] == "cpu" and r["rows"] == 128 for r in records)
    assert len(capsys.readouterr().out.splitlines()) == len(records)


def _mmas(count: int, m: int, n: int, b_mn_major: bool, cta_group: int, reg: int) -> str:
    """PTX of ``count`` bf16 MMAs of one shape, their descriptor moved into ``%r<reg>`` once."""
    desc = (m // 16) << 24 | (n // 8) << 17 | b_mn_major << 16 | 0x490  # f32 accumulator, bf16 A and B
    mma = f"\ttcgen05.mma.cta_group::{cta_group}.kind::f16 [%r1], [%r2], %rd1, %r{reg}, p;\n"
    return f"\tmov.b32 \t%r{reg}, {desc};\n" + mma * count


def test_mla_mma_work_counts_a_cta_pair_once():
    # FlashMLA's head128 tile as its PTX has it: 16 QK MMAs (M=128 over the pair, N=128: 64 keys x the two halves of
    # the 512 latent columns) and 8 P V MMAs (N=256) per 64 keys, issued once for the pair serving 128 heads.
    ptx = ".visible .entry flash_fwd_splitkv_mla_fp8_sparse_kernel(\n" + _mmas(16, 128, 128, False, 2, 5) + \
        _mmas(8, 128, 256, True, 2, 6)
    rec = mla_mma_work.flashmla("head128", ptx, 128)
    assert (rec["units"], rec["qk_mmas"], rec["pv_mmas"], rec["latent_dim"]) == (1, 16, 8, 512)
    assert rec["flops_per_key"] == rec["min_flops_per_key"] == 2 * 512 * 128 * 2 and rec["ratio"] == 1.0
    assert rec["qk"] == "16 x 128x128x16/2cta" and rec["pv"] == "8 x 128x256x16/2cta"
    # 256 heads: two pairs; head64 at 128 heads: two CTAs of one CTA each.
    assert mla_mma_work.flashmla("head128", ptx, 256)["units"] == 2
    head64 = _mmas(18, 64, 128, False, 1, 5) + _mmas(8, 64, 256, True, 1, 6)
    rec = mla_mma_work.flashmla("head64", head64, 128)
    assert rec["units"] == 2 and rec["flops_per_key"] == rec["min_flops_per_key"] == 2 * (576 + 512) * 128
