"""The sm_100a peers (``ptxsim.peers.fa4_sm100``, ``ptxsim.peers.quack_sm100``) compiled by their own host entries
and captured on the CPU: the launch geometry each interface chooses, the Blackwell instruction families in its PTX,
and TMA descriptors (decoded from the parameter bytes) that point at the caller's tensors.

Expected geometry, derived from the peers' own rules (not from a previous run):
- FA4 (``interface._get_fwd_config`` / ``use_2cta_instrs``): 512 threads (16 warps: 2 softmax warpgroups,
  correction warpgroup, MMA, load, epilogue and empty warps), 227 KiB of dynamic shared memory (the opt-in maximum,
  232448 B). 2 query heads on 1 KV head are packed (pack_gqa), so Sq query tokens are 2 Sq rows. Sq = 64: 128 rows,
  one Q tile (q_stage 1), one M block, so no 2-CTA: grid 1, no cluster. Sq = 160: 320 rows > 128, two Q tiles
  (q_stage 2, 256 rows per CTA); non-causal dense with more than one M block takes the 2-CTA MMA: cluster 2 x 1,
  each cluster covering 2 x 256 rows, so one cluster, grid 2.
- quack (``_default_config_for_cap(10)``): tile 256 x 256, cluster 2 x 1 (2-CTA MMA, each CTA 128 rows), 256 threads;
  CLC persistence launches one CTA per CTA tile: (M / 128) x (N / 256) CTAs; the static persistent scheduler launches
  min(tiles, 148 // 2 clusters) clusters, the same count here.
"""

from __future__ import annotations

import functools
import math
import re

import pytest

pytestmark = pytest.mark.sim

pytest.importorskip("cutlass")
pytest.importorskip("flash_attn.cute")
pytest.importorskip("quack")
import torch  # noqa: E402

from ptxsim.capture import capturing, cuda_view, entry_params  # noqa: E402
from ptxsim.peers import fa4_sm100, quack_sm100  # noqa: E402
from ptxsim.tensormap import decode  # noqa: E402

SMEM_OPTIN = 232448  # 227 KiB: the B200's opt-in shared memory per block


def _call(fn, args):
    fn(*[cuda_view(a) if isinstance(a, torch.Tensor) else a for a in args])


def _tma_addresses(launch):
    return {decode(p).address for p in launch.params if len(p) == 128}


def _check_common(launch):
    assert re.search(r"^\.target sm_100a", launch.ptx, re.M)
    assert len(launch.params) == len(entry_params(launch.ptx, launch.kernel))


@functools.lru_cache(maxsize=None)
def _fa4(seqlen_q):
    g = torch.Generator().manual_seed(seqlen_q)
    q = torch.randn(1, seqlen_q, 2, 128, generator=g).bfloat16()
    k = torch.randn(1, 300, 1, 128, generator=g).bfloat16()
    v = torch.randn(1, 300, 1, 128, generator=g).bfloat16()
    with capturing("sm_100a") as launches:
        fn, args = fa4_sm100.build(q, k, v, return_lse=True)
        _call(fn, args)
    (launch,) = launches
    return launch, (q, k, v), args


@pytest.mark.parametrize("seqlen_q, q_tiles, cta_group", [(64, 1, 1), (160, 2, 2)])
def test_fa4_sm100_capture(seqlen_q, q_tiles, cta_group):
    from flash_attn.cute import utils as fa_utils

    if fa_utils._get_disable_2cta_default(is_fwd=True):  # FA_DISABLE_2CTA=1, or a CUDA 12 torch
        cta_group = 1
    launch, (q, k, v), args = _fa4(seqlen_q)
    _check_common(launch)
    assert "FlashAttentionForwardSm100" in launch.kernel
    rows = 2 * seqlen_q  # pack_gqa: 2 query heads per KV head
    assert launch.block == (512, 1, 1) and launch.dyn_smem == SMEM_OPTIN
    assert launch.cluster == (cta_group, 1, 1)
    ctas = math.ceil(rows / (q_tiles * 128))  # one M block of q_stage x 128 rows per CTA
    assert launch.grid == (-(-ctas // cta_group) * cta_group, 1, 1)
    assert f"tcgen05.mma.cta_group::{cta_group}.kind::f16" in launch.ptx
    assert f"tcgen05.mma.cta_group::{3 - cta_group}" not in launch.ptx
    assert "tcgen05.alloc" in launch.ptx and "tcgen05.ld.sync.aligned.32x32b" in launch.ptx
    assert {q.data_ptr(), k.data_ptr(), v.data_ptr()} <= _tma_addresses(launch)
    assert args[fa4_sm100.OUT].shape == q.shape and args[fa4_sm100.LSE].shape == (1, 2, seqlen_q)


@functools.lru_cache(maxsize=None)
def _quack(clc):
    g = torch.Generator().manual_seed(1)
    A = torch.randn(512, 256, generator=g).bfloat16()
    B = torch.randn(512, 256, generator=g).bfloat16()
    with capturing("sm_100a") as launches:
        fn, args = quack_sm100.build_gemm(A, B, clc=clc)
        _call(fn, args)
    (launch,) = launches
    return launch, (A, B), args


@pytest.mark.parametrize("clc", [True, False])
def test_quack_sm100_capture(clc):
    launch, (A, B), args = _quack(clc)
    _check_common(launch)
    assert "GemmDefaultSm100" in launch.kernel
    assert launch.block == (256, 1, 1) and launch.cluster == (2, 1, 1)
    ctas = (A.shape[0] // 128) * (B.shape[0] // 256)
    assert math.prod(launch.grid) == ctas and launch.grid[0] % 2 == 0
    assert "tcgen05.mma.cta_group::2.kind::f16" in launch.ptx
    assert ("clusterlaunchcontrol.try_cancel" in launch.ptx) == clc
    assert launch.attrs.get("programmatic_stream_serialization") == 1  # quack's PDL default
    D = args[quack_sm100.D_ARG]
    assert {A.data_ptr(), B.data_ptr(), D.data_ptr()} <= _tma_addresses(launch)
