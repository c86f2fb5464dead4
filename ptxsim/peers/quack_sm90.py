"""quack 0.6.5's SM90 GEMMs built on the CPU for real torch CPU tensors, through quack's own host entries, which
compile (``cute.compile`` of ``GemmSm90`` from fake cute tensors, TVM-FFI) and then launch with
``quack.gemm_tvm_ffi_utils.launch_gemm(plan, ...)``; that launch is intercepted, so what comes back is exactly the
compiled object and the arguments quack would launch it with.

    from ptxsim.peers import quack_sm90          # sets the target env (below) if unset: import before cutlass
    fn, args = quack_sm90.build_gemm(A, B, pingpong=True)       # D = A @ B^T, bf16/fp16 (M, K) x (N, K)
    fn(*args); D = args[quack_sm90.D_ARG]
    ref = quack_sm90.gemm_reference(A, B)                        # float64

    q, sf = quack_sm90.quantize_int4(W)                          # W (N, K) float -> packed uint4b8, bf16 scales
    fn, args = quack_sm90.build_w4a16(act, q, sf, wformat="int4")
    fn(*args); out = quack_sm90.w4_output(args)                  # (M, N) bf16
    ref = quack_sm90.w4a16_reference(act, q, sf, wformat="int4") # float64

Environment (``ENV``, set while building only): ``QUACK_ARCH=sm_90`` (quack's dispatch arch, used instead of asking
CUDA). Build inside ``ptxsim.capture.capturing("sm_90a")``: it sets the compile target, keeps the PTX and turns
quack's compile cache off (a cached function would come without its PTX). ``cutlass.utils.HardwareInfo`` is replaced by one answering the H100's 132 SMs
(quack's persistent scheduler asks ``get_max_active_clusters``): ``max_active_clusters = 132 // cluster size``.

``build_gemm``: ``quack.gemm.gemm`` (the dense entry ``gemm_interface`` dispatches to), persistent, static
scheduler. Ping-pong (default, quack's SM90 default config): tile 128 x 192, cluster 2 x 1, 384 threads = TMA
producer warpgroup + 2 MMA warpgroups each owning a whole 128 x N tile in turn. Cooperative (``pingpong=False``):
tile 256 x 128 (quack's SM90 coop tiles are 256 x N), both MMA warpgroups share one tile (128 rows each).
Call arguments (positional, all one TVM-FFI call; torch tensors go through DLPack, NamedTuples are flattened by
the executor, ``None`` is an absent optional; the stream is TVM-FFI's environment stream):

    0 A (M, K)   1 B (N, K)   2 D (M, N) output (``D_ARG``)   3 C None
    4 epi_args   quack.gemm_default_epi ``EpilogueArguments`` (alpha/beta/row/col vec/...: all None here)
    5 scheduler  quack.tile_scheduler ``TileSchedulerOptions(max_active_clusters=Int32(132 // cluster), ...)``
    6 varlen None   7 SFA None   8 SFB None

``build_w4a16``: ``quack.gemm_w4.gemm_w4a16`` (the W4 mainloop that cute_kv's ``kernels/qkv/w4.py`` inherits:
``GemmSm90`` with ``transform_a=TransformAW4``, cooperative, cluster 1 x 1): the packed weight is the WGMMA A
operand (rows = output channels, decoded in registers), the activations are B, the output is written transposed
(D is (N, M) m-major, i.e. ``out`` (M, N) row-major). Arguments are as above with 0 = quack's ``TransformAOperand``
bundle of the repacked weight blob and scale strip (``quack.operand_transform.host.w4_operand_views``), 1 = act
(M, K), 2 = ``out`` (M, N) row-major as the caller gives it (the trace relabels it to the kernel's (N, M) m-major D,
``cd_transposed``); 4 = the fn-epilogue's arguments (alpha 1.0, per-tensor scale). ``split_k=1``
(quack's auto choice may pick serial split-K 2 for small M, which adds a semaphore and a float32 workspace in the
epilogue arguments; pass ``split_k=None`` for quack's own choice). ``use_pdl`` is quack's default (True): the kernel
contains ``griddepcontrol`` instructions.

The TVM-FFI executor checks tensor devices against the CUDA target when really called: capture has to intercept
the launch, not expect the call to accept CPU tensors as-is.
"""

from __future__ import annotations

import contextlib

import torch

from ptxsim.peers import hardware_info, target_env

ENV = {"QUACK_ARCH": "sm_90"}  # what quack reads to pick its SM90 kernels (set only while building)

NUM_SMS = 132  # H100 SXM
D_ARG = 2


@contextlib.contextmanager
def _captured_launch():
    """quack's launches recorded instead of run: yields a list that receives ``(compiled_fn, args)``."""
    import cutlass.utils
    import quack.gemm
    import quack.gemm_runtime.host as host

    launches = []

    def record(plan, A, B, D, C, epi_args, scheduler_args, varlen_args, SFA=None, SFB=None):
        launches.append((plan.compiled_fn, (A, B, D, C, epi_args, scheduler_args, varlen_args, SFA, SFB)))

    saved = quack.gemm.launch_gemm, host.launch_gemm, cutlass.utils.HardwareInfo
    quack.gemm.launch_gemm = host.launch_gemm = record
    cutlass.utils.HardwareInfo = hardware_info(NUM_SMS)
    try:
        with target_env(ENV):
            yield launches
    finally:
        quack.gemm.launch_gemm, host.launch_gemm, cutlass.utils.HardwareInfo = saved


def build_gemm(A, B, pingpong=True, tile_M=None, tile_N=None, cluster_M=2, cluster_N=1, D=None):
    """``(compiled_fn, call_args)`` of quack's SM90 GEMM ``D = A @ B^T`` (A (M, K), B (N, K), both K-major bf16 or
    fp16; D (M, N) of their dtype, allocated unless given). Defaults: ping-pong 128 x 192, cooperative 256 x 128."""
    import quack.gemm

    assert A.dtype == B.dtype and A.dtype in (torch.bfloat16, torch.float16)
    if tile_M is None:
        tile_M = 128 if pingpong else 256
    if tile_N is None:
        tile_N = 192 if pingpong else 128
    if D is None:
        D = torch.empty(A.shape[0], B.shape[0], dtype=A.dtype)
    quack.gemm._gemm_plan_cache.clear()
    with _captured_launch() as launches:
        quack.gemm.gemm(A, B, D, None, None, tile_M, tile_N, cluster_M, cluster_N, pingpong=pingpong,
                        persistent=True)
    (launch,) = launches
    return launch


def gemm_reference(A, B):
    """``A @ B^T`` in float64."""
    return A.double() @ B.double().T


def quantize_int4(w, group=128):
    """quack's reference quantizer: ``(N, K)`` float -> (uint4b8 codes packed two per byte ``(N, K/2)``, bf16 scales
    ``(N, K/group)``); value = (code - 8) * scale."""
    from quack.blockscaled import nvfp4_utils as U

    return U.quantize_int4_reference(w, group=group)


def build_w4a16(act, q, sf, wformat="int4", tile_m=None, tile_n=None, split_k=1, out=None):
    """``(compiled_fn, call_args)`` of quack's SM90 W4A16 GEMM ``out = act @ dequant(q, sf)^T``: ``act`` (M, K)
    bf16 contiguous, ``q``/``sf`` as ``quantize_int4`` gives (``wformat`` "int4" = group 128, "int4_g64",
    "int4_g32"); N must be a multiple of 128 (quack pads the weight otherwise and the output is sliced)."""
    from quack.gemm_w4 import gemm_w4a16, prepare_w4_weight

    with target_env(ENV):
        blob, sf_blob = prepare_w4_weight(q, sf, wformat=wformat)
    assert q.shape[0] % 128 == 0, "N a multiple of 128 (the padded weight would need a padded out)"
    if out is None:
        out = torch.empty(act.shape[0], q.shape[0], dtype=torch.bfloat16)
    with _captured_launch() as launches:
        gemm_w4a16(act, blob, sf_blob, out=out, tile_m=tile_m, tile_n=tile_n, wformat=wformat, split_k=split_k)
    (launch,) = launches
    return launch


def w4_output(call_args):
    """The ``(M, N)`` output of a ``build_w4a16`` launch (passed caller-oriented; the kernel relabels it)."""
    return call_args[D_ARG]


def w4a16_reference(act, q, sf, wformat="int4"):
    """``act @ dequant(q, sf)^T`` in float64 (dequant by quack's ``dequant_reference`` of the format)."""
    from quack.operand_transform.formats import decode_format

    w = decode_format(wformat).dequant_reference(q, sf)
    return act.double() @ w.double().T
