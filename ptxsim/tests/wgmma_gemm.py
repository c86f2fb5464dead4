"""A small SM90 wgmma GEMM for the simulator's tests: C[M, N] (fp32) = A[M, K] @ B[N, K]^T, A and B bf16 K-major.
One CTA is one warpgroup (128 threads) on a 128x128x64 tile with a 3-stage TMA ring (``PipelineTmaAsync``): warp 0
issues the TMA loads, all four warps the wgmmas; C goes straight from the accumulators to global memory. M and N must
be multiples of 128, K of 64. The pattern of CUTLASS's CuTe DSL Hopper dense GEMM example, cut to its core.
"""
import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.memory import SmemAllocator
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

BM, BN, BK, STAGES = 128, 128, 64, 3


@cute.kernel
def gemm_kernel(tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, mA: cute.Tensor,
                tma_b: cute.CopyAtom, mB: cute.Tensor, mC: cute.Tensor,
                sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
                ab_dtype: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bm, bn, _ = cute.arch.block_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_a)
        cpasync.prefetch_descriptor(tma_b)

    smem = SmemAllocator()
    mbars = smem.allocate_array(cutlass.Int64, 2 * STAGES)  # full + empty barriers
    sA = smem.allocate_tensor(ab_dtype, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
    sB = smem.allocate_tensor(ab_dtype, sB_layout.outer, byte_alignment=1024, swizzle=sB_layout.inner)

    stage_bytes = cute.size_in_bytes(ab_dtype, cute.slice_(sA_layout, (None, None, 0))) \
        + cute.size_in_bytes(ab_dtype, cute.slice_(sB_layout, (None, None, 0)))
    pipe = pipeline.PipelineTmaAsync.create(
        barrier_storage=mbars, num_stages=STAGES,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 4),  # 4 warps arrive
        tx_count=stage_bytes, cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)))
    # (create() without defer_sync=True already fences + syncs the CTA)

    # (BM, BK, k_tiles) / (BN, BK, k_tiles) / (BM, BN)
    gA = cute.local_tile(mA, (BM, BN, BK), (bm, bn, None), proj=(1, None, 1))
    gB = cute.local_tile(mB, (BM, BN, BK), (bm, bn, None), proj=(None, 1, 1))
    gC = cute.local_tile(mC, (BM, BN, BK), (bm, bn, None), proj=(1, 1, None))
    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                       cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
    tBsB, tBgB = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                       cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))

    thr_mma = tiled_mma.get_slice(tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))  # smem descriptors
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    tCgC = thr_mma.partition_C(gC)
    acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
    acc.fill(0.0)

    k_tiles = cute.size(gA, mode=[2])
    prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
    cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)

    # NB: a nested helper `def issue_load()` closing over `pipe` is rejected inside
    # dynamic if/for (SCOPE_CLOSURE_CAPTURE) -> the producer code is written out twice.
    if warp_idx == 0:  # prologue: fill the ring
        for _ in cutlass.range(cutlass.min(STAGES, k_tiles), unroll=1):
            pipe.producer_acquire(prod)  # wait for a free slot, arm expect_tx
            bar = pipe.producer_get_barrier(prod)
            cute.copy(tma_a, tAgA[None, prod.count], tAsA[None, prod.index], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[None, prod.count], tBsB[None, prod.index], tma_bar_ptr=bar)
            pipe.producer_commit(prod)  # no-op for TMA: tx bytes complete the phase
            prod.advance()

    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # acc was zero-filled
    for _ in cutlass.range(k_tiles, unroll=1):
        pipe.consumer_wait(cons)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):  # BK/16 wgmmas
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb, cons.index],
                      tCrB[None, None, kb, cons.index], acc)
        warpgroup.commit_group()
        warpgroup.wait_group(0)  # simplest: no MMA/MMA overlap
        pipe.consumer_release(cons)
        cons.advance()
        if warp_idx == 0 and prod.count < k_tiles:
            pipe.producer_acquire(prod)  # wait for a free slot, arm expect_tx
            bar = pipe.producer_get_barrier(prod)
            cute.copy(tma_a, tAgA[None, prod.count], tAsA[None, prod.index], tma_bar_ptr=bar)
            cute.copy(tma_b, tBgB[None, prod.count], tBsB[None, prod.index], tma_bar_ptr=bar)
            pipe.producer_commit(prod)  # no-op for TMA: tx bytes complete the phase
            prod.advance()

    tCgC.store(acc.load())  # fp32 straight to gmem (no smem/TMA epilogue: keep it small)


@cute.jit
def gemm(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: cuda.CUstream):
    dt = a.element_type
    tiled_mma = sm90_utils.make_trivial_tiled_mma(
        dt, dt, OperandMajorMode.K, OperandMajorMode.K,
        cutlass.Float32, (1, 1, 1), (64, BN))  # wgmma atom is 64xBNx16; 1 warpgroup repeats it 2x in M
    sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (BM, BN, BK), dt, STAGES)
    sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (BM, BN, BK), dt, STAGES)
    tma_a, mA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a,
                                            cute.slice_(sA_layout, (None, None, 0)), (BM, BK))
    tma_b, mB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b,
                                            cute.slice_(sB_layout, (None, None, 0)), (BN, BK))
    smem_bytes = (cute.cosize(sA_layout) + cute.cosize(sB_layout)) * dt.width // 8 + 3 * 1024
    M, N = c.shape
    gemm_kernel(tiled_mma, tma_a, mA, tma_b, mB, c, sA_layout, sB_layout, dt).launch(
        grid=(M // BM, N // BN, 1), block=(128, 1, 1), smem=smem_bytes, stream=stream)


def fake_args(dt=cutlass.BFloat16):
    M, N = (cute.sym_int32(divisibility=128) for _ in range(2))
    K = cute.sym_int32(divisibility=BK)  # TVM-FFI checks these divisibility promises per call
    a = make_fake_compact_tensor(dt, (M, K), stride_order=(1, 0), assumed_align=16)
    b = make_fake_compact_tensor(dt, (N, K), stride_order=(1, 0), assumed_align=16)
    c = make_fake_compact_tensor(cutlass.Float32, (M, N), stride_order=(1, 0), assumed_align=16)
    return a, b, c, make_fake_stream()
