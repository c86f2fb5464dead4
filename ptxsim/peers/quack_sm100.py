"""quack 0.6.5's SM100 GEMM (``quack.gemm_sm100.GemmSm100`` through ``GemmDefaultSm100``) built on the CPU for real
torch CPU tensors, through quack's own host entry ``quack.gemm.gemm`` (the dense entry ``gemm_interface``
dispatches to), which compiles (``cute.compile`` from fake cute tensors, TVM-FFI) and then launches with
``quack.gemm_tvm_ffi_utils.launch_gemm(plan, ...)``; that launch is intercepted, so what comes back is exactly the
compiled object and the arguments quack would launch it with.

    from ptxsim.capture import capturing, cuda_view
    from ptxsim.peers import quack_sm100
    with capturing("sm_100a") as launches:        # build_gemm() compiles: inside the block
        fn, args = quack_sm100.build_gemm(A, B)     # D = A @ B^T, bf16/fp16 (M, K) x (N, K)
        fn(*[cuda_view(a) if torch.is_tensor(a) else a for a in args])
    D = args[quack_sm100.D_ARG]
    ref = quack_sm100.gemm_reference(A, B)          # float64

Defaults are quack's SM100 default config (``quack.gemm_config._default_config_for_cap(10)``): tile 256 x 256,
cluster 2 x 1, so ``use_2cta_instrs`` (``tcgen05.mma.cta_group::2``: the CTA pair shares one 256-row MMA, each CTA
holding 128 rows of A and half of B's tile), not ping-pong (none on SM100), persistent with the dynamic scheduler
``is_dynamic_persistent=True`` = CLC persistence (``clusterlaunchcontrol.try_cancel`` multicast to the cluster:
the grid is every output tile's cluster, each cluster steals the next unlaunched one). ``clc=False`` gives the static
persistent scheduler (grid = min(tiles, max active clusters)). 1-CTA MMA: ``tile_M=128, cluster_M=1``.

During ``build_gemm`` only (restored after; nothing is set at import): ``QUACK_ARCH=sm_100`` (quack's dispatch arch,
its lru cache of it cleared before and after), ``cutlass.utils.HardwareInfo`` answering a B200's 148 SMs
(``max_active_clusters = 148 // cluster size``), quack's compile cache off, the DSL's target arch ``sm_100a`` unless
it already is a Blackwell datacenter arch (``capturing("sm_100a")`` sets it too).

Call arguments (positional, one TVM-FFI call; torch tensors through DLPack, NamedTuples flattened by the executor,
``None`` an absent optional; the stream is TVM-FFI's environment stream), as ``ptxsim.peers.quack_sm90``:

    0 A (M, K)   1 B (N, K)   2 D (M, N) output (``D_ARG``)   3 C None
    4 epi_args   quack.gemm_default_epi ``EpilogueArguments`` (all None: alpha 1, beta 0, no vectors)
    5 scheduler  quack.tile_scheduler ``TileSchedulerOptions(max_active_clusters=Int32(148 // cluster), ...)``
    6 varlen None   7 SFA None   8 SFB None
"""

from __future__ import annotations

import contextlib
import os

import torch

from ptxsim.peers import hardware_info

NUM_SMS = 148  # B200
D_ARG = 2
BLACKWELL = ("sm_100a", "sm_103a")


@contextlib.contextmanager
def _captured_launch():
    """quack's SM100 launches recorded instead of run: yields a list that receives ``(compiled_fn, args)``."""
    import cutlass.utils
    import quack.cache
    import quack.cute_dsl_utils as qutils
    import quack.gemm
    import quack.gemm_runtime.host as host
    from cutlass.base_dsl.dsl import BaseDSL

    launches = []

    def record(plan, A, B, D, C, epi_args, scheduler_args, varlen_args, SFA=None, SFB=None):
        launches.append((plan.compiled_fn, [A, B, D, C, epi_args, scheduler_args, varlen_args, SFA, SFB]))

    envar = BaseDSL._get_dsl().envar
    saved = (quack.gemm.launch_gemm, host.launch_gemm, cutlass.utils.HardwareInfo, quack.cache.CACHE_ENABLED,
             envar._arch, os.environ.get("QUACK_ARCH"))
    quack.gemm.launch_gemm = host.launch_gemm = record
    cutlass.utils.HardwareInfo = hardware_info(NUM_SMS)
    quack.cache.CACHE_ENABLED = False
    if envar.arch not in BLACKWELL:
        envar.arch = "sm_100a"
    os.environ["QUACK_ARCH"] = "sm_100"
    _clear_memos(qutils)
    try:
        yield launches
    finally:
        (quack.gemm.launch_gemm, host.launch_gemm, cutlass.utils.HardwareInfo, quack.cache.CACHE_ENABLED,
         envar._arch, quack_arch) = saved
        if quack_arch is None:
            os.environ.pop("QUACK_ARCH", None)
        else:
            os.environ["QUACK_ARCH"] = quack_arch
        _clear_memos(qutils)


def _clear_memos(qutils):
    """quack's memos of the device: its capability, and the clusters that fit (keyed by cluster size only, so an
    answer for one SM count would outlive it)."""
    qutils._get_device_capacity_cached.cache_clear()
    qutils.get_max_active_clusters.cache_clear()


def build_gemm(A, B, tile_M=256, tile_N=256, cluster_M=2, cluster_N=1, clc=True, D=None):
    """``(compiled_fn, call_args)`` of quack's SM100 GEMM ``D = A @ B^T`` (A (M, K), B (N, K), both K-major bf16 or
    fp16; D (M, N) of their dtype, allocated unless given). Defaults: quack's SM100 default (256 x 256, cluster 2 x 1,
    2-CTA MMA, CLC persistence)."""
    import quack.gemm

    assert A.dtype == B.dtype and A.dtype in (torch.bfloat16, torch.float16)
    if D is None:
        D = torch.empty(A.shape[0], B.shape[0], dtype=A.dtype)
    quack.gemm._gemm_plan_cache.clear()
    with _captured_launch() as launches:
        quack.gemm.gemm(A, B, D, None, None, tile_M, tile_N, cluster_M, cluster_N, pingpong=False,
                        persistent=True, is_dynamic_persistent=clc)
    (launch,) = launches
    return launch


def gemm_reference(A, B):
    """``A @ B^T`` in float64."""
    return A.double() @ B.double().T
