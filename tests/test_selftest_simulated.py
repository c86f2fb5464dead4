"""The quick selftest grid (one case per kernel family) with its sm_90a and sm_100a kernels executed by the PTX
simulator: the op's real launch path on CPU tensors standing for CUDA ones, every check of the selftest (NaN-poisoned
outputs, the cache's bits outside the step, tolerances), and a kernel must have run.

On sm_100a these are the regression tests of two kernel fixes: the attention and MLA epilogues read O from Tensor
Memory in splits without key tiles, where no MMA had written it (now skipped), and ``rescale_o`` stored the
rescaled O over the cells its tcgen05.ld had read without ``tcgen05.wait::ld``, an order the PTX ISA does not give
(9.7.16.6.4.5); the simulator reported both on every schedule."""

import pytest

pytestmark = pytest.mark.sim

from cute_kv import selftest  # noqa: E402
from cute_kv.simulate import simulated  # noqa: E402

ARCH = "sm_90a"
QUICK = selftest.cases(quick=True, arch=ARCH)
GRID = [(arch, c) for arch in (ARCH, "sm_100a") for c in selftest.cases(quick=True, arch=arch)]


@pytest.mark.parametrize("arch,case", GRID, ids=[f"{a}-{c.op}-{c.config}".replace(" ", "_") for a, c in GRID])
def test_quick_case_runs_in_the_simulator(arch, case):
    with simulated(arch, seed=1) as record:
        row = selftest.run_case(case, "cpu")
    assert row.path.startswith("kernel"), row.path
    assert record.launches, "no kernel ran in the simulator"
    assert row.ok, (row.error, row.max_err)


def test_simulated_selftest_fails_a_wrong_kernel(monkeypatch):
    """The harness can fail: a kernel that writes one stored element wrong is caught by the cache bit check."""
    import ptxsim

    case = next(c for c in QUICK if c.op == "store_kv")
    real = ptxsim.simulate

    def corrupting(launch, reads=(), writes=(), seed=0, **kw):
        stats = real(launch, reads=reads, writes=writes, seed=seed, **kw)
        cache = max(dict(writes).values(), key=lambda t: t.numel())
        cache.view(-1)[cache.numel() // 3] ^= 0x40  # one byte of the cache storage flipped after the kernel
        return stats
    monkeypatch.setattr(ptxsim, "simulate", corrupting)
    with simulated(ARCH) as record:
        row = selftest.run_case(case, "cpu")
    assert record.launches
    assert not row.ok


def test_cli_simulate_prints_its_table(capsys, tmp_path):
    import argparse
    import json

    parser = argparse.ArgumentParser()
    selftest.add_parser(parser.add_subparsers())
    args = parser.parse_args(["selftest", "--simulate", "--quick", "--ops", "gather_kv", "--seeds", "2",
                              "--json", str(tmp_path / "rows.json")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "selftest --simulate (sm_90a, 2 seed(s) per case)" in out and "2 of 2 passed" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert len(rows["rows"]) == 2 and all(r["ok"] for r in rows["rows"])


def test_row_gathered_pages_run_in_the_simulator():
    """Pages of one row take the cp.async row gather: rows past the keys are zero-filled by the copy (source size
    0). They used to issue no copy and leave the stage's rows unwritten, which the QK wgmma read: the simulator's
    poison hazard on every schedule."""
    case = selftest.Case("paged_attention", "bf16", 1, 64, "decode")
    assert case in selftest.cases(arch=ARCH)
    for seed in (0, 1):
        with simulated(ARCH, seed=seed) as record:
            row = selftest.run_case(case, "cpu")
        assert record.launches and row.ok, (row.error, row.max_err)


def test_sm100_attention_relies_on_mma_issue_order():
    """``PagedAttentionSm100``'s MMA warp issues the QK MMA into an S slot right after the PV MMA that reads that
    slot's P, as FA4's SM100 forward does. The PTX ISA orders two MMAs of a thread only as a pipelined pair (same
    accumulator and shape, 9.7.16.6.2), so the simulated selftest accepts issue order for this kernel
    (``cute_kv.simulate.ISSUE_ORDER_KERNELS``); without the acceptance the simulator reports the pair when the PV
    lands late (seed 1). Should the kernel stop relying on it, this test fails: then drop the acceptance."""
    case = next(c for c in QUICK if c.op == "paged_attention" and c.step == "split")
    with simulated("sm_100a", seed=1, in_order_tcgen05_mma=False) as record:
        row = selftest.run_case(case, "cpu")
    assert not row.ok and "reads them (its A operand)" in row.error and "9.7.16.6.2" in row.error, row.error
    assert not record.launches  # the hazard stopped the attention launch

def test_sm100_gather4_row_off_by_one_fails(monkeypatch):
    """Pages of 4 rows reach the SM100 attention's ring by TMA gather4 (four rows a copy, each row index a
    coordinate). Every gather4's first row index moved on by one row (a block-scoped register, so nothing else
    changes) must fail the case: the wrong K/V rows reach the MMAs."""
    import dataclasses
    import re

    import ptxsim

    (case,) = [c for c in selftest.cases(ops=["paged_attention"], arch="sm_100a")
               if (c.cache, c.page_size, c.head_size, c.step, c.variant) == ("bf16", 4, 64, "ragged", "")]
    real, mutated = ptxsim.simulate, []

    def off_by_one(launch, **kw):
        if "tile::gather4" in launch.ptx:
            lines = launch.ptx.split("\n")
            for i, t in enumerate(lines):
                m = re.search(r"tile::gather4.*\{(%r\d+), (%r\d+),", t)
                if m:
                    row = m.group(2)
                    body = t.replace(m.group(0), m.group(0).replace(f", {row},", ", mut_row,"))
                    lines[i] = f"{{ .reg .b32 mut_row; add.s32 mut_row, {row}, 1; {body.strip()} }}"
                    mutated.append(i)
            launch = dataclasses.replace(launch, ptx="\n".join(lines))
        return real(launch, **kw)

    monkeypatch.setattr(ptxsim, "simulate", off_by_one)
    with simulated("sm_100a", seed=0) as record:
        row = selftest.run_case(case, "cpu")
    assert mutated and record.launches
    assert not row.ok, "a gather4 row index off by one went unnoticed"
    assert row.error is None or "Unsupported" not in row.error, row.error  # wrong values, not PTX left unrun
    print(f"{len(mutated)} gather4 lines mutated: max err {row.max_err:.3g}, {row.error}")


def test_sm103a_kernels_run_in_the_simulator():
    """``--arch sm_103a``: the launches are captured against a B300 stand-in (compute capability 10.3) and run; the
    gather kernel as the witness (the sm_103a PTX is the sm_100a PTX but for its target: tests/test_sass.py)."""
    case = next(c for c in selftest.cases(quick=True, arch="sm_103a") if c.op == "gather_kv")
    with simulated("sm_103a", seed=0) as record:
        row = selftest.run_case(case, "cpu")
    assert record.launches and row.ok, (row.error, row.max_err)


def test_sm90_attention_sees_every_key_under_the_widest_window():
    """A window wider than int32 reaches the kernel as 2^31 - 1 (``kernel_args.window_arg``), and every key is then
    in it. A row's first visible key used to be ``position - window + 1`` unclamped, near -2^31: less a masked
    tile's first key past the row's position it wrapped to a large positive bound, and the row lost that tile's
    keys. The checked API pairs a window with ``causal=True``, where such a tile is past the row's causal end
    anyway; the launcher below it takes a non-causal window. Prefill of 300 new tokens from an empty cache, against
    the reference with no window."""
    import math

    import torch

    from cute_kv import reference
    from cute_kv.ops import paged_attention

    case = selftest.Case("paged_attention", "bf16", 64, 64, "prefill")
    pb = selftest._batch(case, "cpu")
    c = pb.collection
    assert int(c.cache_lengths[0]) == 0 and pb.new_lengths[0] > 2 * 64  # early tokens' masked tile starts past them
    q = torch.randn(pb.total_rows, 4 * c.num_heads, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16)
    with simulated(ARCH, seed=1) as record:
        paged_attention.dispatch(q, pb.input_row_offsets, c, selftest.LAYER, False, 2**40, None, None, None, None,
                                 out, None)
    want = reference.paged_attention(q, pb.input_row_offsets, c, selftest.LAYER, causal=False)
    assert record.launches and all("PagedAttention" in str(kernel) for kernel, *_ in record.launches)
    assert not out.isnan().any()
    assert selftest.rel_err(out, want) <= selftest.TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("cache,head_dim,page_size", [("bf16", 256, 128), ("bf16", 192, 16), ("bf16", 256, 8),
                                                       ("fp8 f32 scales", 256, 16)])
def test_wide_sm90_attention_walks_many_tiles(cache, head_dim, page_size):
    """Past head dim 128 a tile's ring stage and phase are computed from its count in the walk
    (``PagedAttention.read_state``), not carried: a causal step over 600 keys (6-10 tiles of 112, 80 or 64 keys, the
    rings' phases flipping every two), two query blocks on the long request so that it does not split, beside a
    3-token request from an empty cache. A 16-bit cache in page slots of 128 and 16 rows and in gathered pages of
    8, and an fp8 one dequantized into the rings. Unread slots and the output NaN-poisoned, against the float64
    reference."""
    import math

    import torch

    from cute_kv import reference
    from cute_kv.ops import paged_attention
    from cute_kv.reference.batch import random_paged_batch

    pb = random_paged_batch((560, 0), (40, 3), num_heads=2, head_size=head_dim, page_size=page_size,
                            generator=torch.Generator().manual_seed(head_dim + page_size), **selftest.CACHES[cache])
    pb.poison_unread(selftest.LAYER)
    c = pb.collection
    q = torch.randn(pb.total_rows, 8, head_dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16)
    with simulated(ARCH, seed=2) as record:
        paged_attention.dispatch(q, pb.input_row_offsets, c, selftest.LAYER, True, None, None, None, None, None, out,
                                 None)
    want = reference.paged_attention(q, pb.input_row_offsets, c, selftest.LAYER)
    assert [str(kernel) for kernel, *_ in record.launches] and all(
        "PagedAttention" in str(kernel) for kernel, *_ in record.launches)
    assert not out.isnan().any()
    assert selftest.rel_err(out, want) <= selftest.TOLERANCE[torch.bfloat16]
