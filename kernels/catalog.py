"""Every kernel configuration the project compiles without a GPU, with the resources its plan claims.

One list for the compile tests (tests/test_compile_kernels.py), the SASS gate (tests/test_sass.py) and the static
table (``python perf/run.py static``). A ``Family`` is a kernel class, the archs it compiles for, its cases
(constructor arguments) and its ``plan``: threads per CTA, the shared memory the host plans per CTA, and the CTAs
per SM the design claims. The register budget is what keeps the claimed CTAs resident. ``roles`` names the warps
that take part in the kernel's mbarrier traffic (the barrier accounting, ``perf/barriers.py``, checks each arrive
and wait against them). Adding a kernel is one ``Family`` in ``FAMILIES``; adding a configuration is one more tuple
in its cases; an attention family with a ``peer_case`` also appears beside FA4 in the static table.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from cute_kv.kernels.archs import ARCHS, BLACKWELL, SM90
from cute_kv.kernels.attention import combine, config as attention_config, sm90 as attention_sm90, sm100 as attention_sm100
from cute_kv.kernels.attention import sm100_config as attention_sm100_config
from cute_kv.kernels.cache import gather, store, store_rope_aware
from cute_kv.kernels.mla import sm90 as mla_sm90
from cute_kv.kernels.mla import sm100 as mla_sm100

REGS_PER_SM = 64 * 1024
SMEM_PER_SM = attention_config.SMEM_PER_SM  # 228 KiB, 1 KiB of it reserved per resident CTA
MAX_THREADS_PER_SM = 2048


@dataclasses.dataclass(frozen=True)
class Plan:
    threads: int
    # Bytes per CTA: what the launch passes, or what the kernel allocates where the DSL sizes it; None where a
    # library sizes its pipeline stages to fill the SM (then only ``ctas_per_sm`` is claimed).
    smem: Optional[int]
    ctas_per_sm: int  # claimed: at least this many CTAs resident per SM

    @property
    def register_budget(self) -> int:
        """The most registers per thread that keep ``ctas_per_sm`` CTAs resident (8-register allocation steps)."""
        return min(255, REGS_PER_SM // (self.ctas_per_sm * self.threads) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class Role:
    """Warps of a kernel that play one part in its mbarrier hand-offs. ``turns``: the warps form that many equal
    groups that take a ring's phases in turn (quack's SM90 ping-pong warpgroups), so a phase has one group's
    arrivals."""

    warps: tuple[int, ...]
    turns: int = 1


def _warps(first: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + count))


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    make: Callable[..., object]
    cases: tuple
    archs: tuple
    plan: Callable[[object], Plan]
    head_dim: Optional[Callable[[object], int]] = None  # attention: S blocks are normalised by the head dim
    # Attention: the case for a bf16, 32 q / 8 KV heads (GQA 4) problem of a head dim, page size and query tokens
    # per request (1: decode), to set beside FA4 compiled for the same shape (``python perf/run.py static``).
    peer_case: Optional[Callable[[int, int, int], tuple]] = None
    # ``(jit function, *fake args)`` of a kernel object: most kernels are the jit function themselves.
    build: Callable[[object], tuple] = lambda kernel: (kernel, *kernel.fake_args())
    roles: Callable[[object], dict] = lambda kernel: {}  # role name -> Role, of a kernel object
    # Kinds of barrier finding (``perf/barriers.py``) that library code of the family gives: reported, not failed.
    barrier_waivers: tuple[str, ...] = ()

    def configs(self) -> list["Config"]:
        return [Config(self, case, arch) for case in self.cases for arch in self.archs]


@dataclasses.dataclass(frozen=True)
class Config:
    family: Family
    case: tuple
    arch: str

    @property
    def label(self) -> str:
        return "-".join(map(str, self.case)).replace(" ", "")

    @property
    def id(self) -> str:
        return f"{self.family.name}[{self.label}]-{self.arch}"

    def kernel(self):
        return self.family.make(*self.case)

    def build(self) -> tuple:
        return self.family.build(self.kernel())


GATHER_CASES = [("bfloat16", 2, 16, 8, 128), ("float16", 2, 64, 1, 256), ("bfloat16", 1, 128, 1, 64),
                ("bfloat16", 2, 16, 8, 128, "strided")]
STORE_CASES = [("bfloat16", 2, 16, 8, 128), ("float16", 2, 128, 1, 64), ("float32", 1, 64, 1, 576)]
# MAX's compact layout's fields plus the layout flag: K and V as two planes of runtime strides (cute_kv/kv_layout.py)
STORE_STRIDED_CASES = [("bfloat16", 2, 16, 8, 128, None, "strided"), ("bfloat16", 2, 16, 8, 128, 128, "strided")]
STORE_FP8_CASES = [("bfloat16", 2, 16, 8, 128, 128), ("float32", 1, 64, 1, 576, 64), ("float16", 2, 128, 2, 64, 8)]
# e4m3 caches scaled per tensor (vLLM's and FlashInfer's k_scale / v_scale): MAX's layout and K/V planes
STORE_TENSOR_SCALED_CASES = [("bfloat16", 2, 16, 8, 128, None, "compact", True),
                             ("float16", 2, 16, 2, 64, None, "strided", True)]
STORE_ROPE_AWARE_CASES = [("bfloat16", 64, 512, 64), ("float32", 16, 256, 32)]  # (dtype, P, padded_depth, rope_dim)
QKV_CASES = [  # QKVSpec fields: (dtype, q_dim, KVD, P, H, D, q_head_dim, bias, rope (R, interleaved), q/k norm dims
    # [, fp8 scale granularity, e8m0 scales[, cross_dims, rope_tail[, strided]]]); fp8 when scaled or rope-aware
    ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0),  # Llama-3-8B
    ("bfloat16", 4096, 2, 64, 8, 128, 128, True, (128, False), 128, 128),  # Qwen3: bias, QK-norm
    ("bfloat16", 1536, 1, 16, 1, 576, 192, False, (64, True), 0, 0),  # MLA latent head straddling tiles
    ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0, 32, True),  # e4m3 cache, e8m0 scales
    # DeepSeek-V3 MLA, finished by the last arriving tile: latent norm (bf16), rope-aware FP8 rows with the norm
    ("bfloat16", 1536, 1, 64, 1, 576, 192, False, (64, True), 0, 512, 0, False, 512, 0),
    ("bfloat16", 1536, 1, 64, 1, 576, 192, False, (64, True), 0, 512, 0, False, 512, 64),
    # Gemma 3: QK-norm and neox over heads of 256, two column tiles each, finished by the last to arrive
    ("bfloat16", 4096, 2, 16, 8, 256, 256, False, (256, False), 256, 256),
    # strided caches (K and V planes of runtime strides): an e4m3 cache with float32 scales, MLA's latent norm
    ("bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0, 32, False, 0, 0, True),
    ("bfloat16", 1536, 1, 64, 1, 576, 192, False, (64, True), 0, 512, 0, False, 512, 0, True),
]
QKV_W4_CASES = [  # (quack decode format, *QKV_CASES fields): int4 (GPTQ, zero points, group 32) and e4m3 weights
    ("int4", "bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0),  # Llama-3-8B GPTQ g128
    ("int4awq", "bfloat16", 4096, 2, 64, 8, 128, 128, True, (128, False), 128, 128),  # Qwen3, zero points
    ("int4_g32", "bfloat16", 1536, 1, 16, 1, 576, 192, False, (64, True), 0, 0),  # MLA latent, group 32
    ("fp8", "bfloat16", 4096, 2, 16, 8, 128, 128, False, (128, False), 0, 0),  # e4m3, per-channel scales
    ("int4", "bfloat16", 1536, 1, 64, 1, 576, 192, False, (64, True), 0, 512, 0, False, 512, 0),  # MLA latent norm
    ("int4", "bfloat16", 4096, 2, 16, 8, 256, 256, False, (256, False), 256, 256),  # Gemma 3 GPTQ: heads of 256
]
ATTENTION_CASES = [  # (dtype, Hq, H, D, page size or None for a dense cache, KVD, vector lookup reads, soft-cap,
    # sinks, lse[, fp8, granularity, e8m0, v_dim, layout]); the pipeline's PTX is
    # checked in tests/test_paged_attention_ptx.py
    ("bfloat16", 32, 8, 128, 16, 2, True),
    ("float16", 8, 8, 64, 128, 2, True),
    ("bfloat16", 16, 2, 256, 16, 2, True),
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, "float8_e4m3fn", 16),
    ("bfloat16", 16, 2, 256, 128, 2, True, False, False, False, "float8_e4m3fn", 256),
    ("bfloat16", 32, 4, 128, 64, 2, False),  # lookup entries read one by one
    ("bfloat16", 32, 8, 128, 16, 2, True, True, True, True),  # soft-cap, sinks, lse
    ("bfloat16", 32, 8, 128, 64, 2, True, False, False, False, "float8_e4m3fn", 32, True),  # e8m0 scales
    # Head dims of 16-bit caches whose rows take 32- and 64-byte swizzles (80, Phi-3's 96) and 64-key tiles (192),
    # and MLA prefill's decompressed heads: K of 192, V of 128 (PV's N and O at 128).
    ("bfloat16", 32, 8, 80, 16, 2, True),
    ("bfloat16", 32, 8, 96, 64, 2, True),
    ("bfloat16", 16, 2, 192, 128, 2, True),
    ("bfloat16", 128, 128, 192, 128, 2, True, False, False, False, None, None, False, 128),
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, None, None, False, None, "strided"),  # K/V planes
    ("bfloat16", 32, 8, 128, 1, 2, True),  # rows gathered by cp.async (SGLang's page of 1)
    ("bfloat16", 32, 8, 128, 1, 2, True, False, False, False, None, None, False, None, "strided"),  # SGLang's pools
    ("bfloat16", 12, 2, 256, 8, 2, True),  # gathered 64-key tiles, Q by thread copies: no load warp
    # e4m3 caches scaled per tensor (k_scale / v_scale): MAX's layout, and vLLM's planes in place
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, "float8_e4m3fn", None, False, None, "compact", True),
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, "float8_e4m3fn", None, False, None, "strided", True),
]
ATTENTION_SM100_CASES = [  # the SM90 fields, q_tiles (None: the most) before v_dim and layout; pages below 8 rows
    # or not tiling the key tile take gather4
    ("bfloat16", 32, 8, 128, 128, 2, True),
    ("bfloat16", 32, 8, 128, 16, 2, True),
    ("bfloat16", 8, 2, 64, 16, 2, True),
    ("float16", 32, 2, 256, 64, 2, True),
    ("bfloat16", 8, 2, 128, 4, 2, False),  # gather4
    ("bfloat16", 64, 8, 128, 32, 2, True, True, True, True),  # soft-cap, sinks, lse
    ("bfloat16", 64, 8, 128, 32, 2, True, False, True, True),  # two Q tiles with sinks and lse (correction WG)
    ("bfloat16", 8, 2, 128, 16, 2, True, False, False, False, "float8_e4m3fn", 32),
    ("float16", 8, 1, 256, 128, 2, True, False, False, False, "float8_e4m3fn", 64, True),  # e8m0 scales
    ("bfloat16", 8, 2, 128, 4, 2, False, False, False, False, "float8_e4m3fn", 32),  # fp8 by gather4
    # MLA prefill's decompressed heads (``cute_kv.mla_prefill``): K of 192, V of 128, 128 heads, 128-token pages.
    ("bfloat16", 128, 128, 192, 128, 2, True, False, False, False, None, None, False, None, 128),
    # head dims 80 (32-byte swizzle, O in 16-column pieces), 96 by gather4 (64-byte swizzle), 192 (64-key tiles)
    ("bfloat16", 32, 8, 80, 16, 2, True),
    ("bfloat16", 8, 2, 96, 4, 2, False),
    ("bfloat16", 16, 2, 192, 64, 2, True),
    # strided K/V planes (foreign layouts in place): by page slot and by gather4
    ("bfloat16", 32, 8, 128, 16, 2, True, False, False, False, None, None, False, None, None, "strided"),
    ("bfloat16", 8, 2, 128, 4, 2, False, False, False, False, None, None, False, None, None, "strided"),
    # e4m3 caches scaled per tensor (k_scale / v_scale): MAX's layout by page slot, vLLM's planes by gather4
    ("bfloat16", 8, 2, 128, 16, 2, True, False, False, False, "float8_e4m3fn", None, False, None, None, "compact",
     True),
    ("bfloat16", 8, 2, 128, 4, 2, False, False, False, False, "float8_e4m3fn", None, False, None, None, "strided",
     True),
]
MLA_CASES = [  # (dtype, Hq, latent dim, v_dim, page size[, lut vector, soft-cap, sinks, lse, rope_dim, pv_overlap])
    ("bfloat16", 128, 576, 512, 64),  # DeepSeek-V3/R1 decode
    ("float16", 16, 576, 512, 16, False),  # four page slots per tile, lookup entries one by one
    ("bfloat16", 128, 576, 512, 128, True, True, True, True),  # soft-cap, sinks, lse
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, 64),  # rope-aware FP8 rows (512 e4m3 | 64 bf16)
    ("bfloat16", 16, 576, 512, 16, False, True, True, True, 64),  # rope-aware, four page slots, features
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, 0, True),  # pv_overlap: each PV behind the next QK
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, 64, True),  # pv_overlap over rope-aware FP8 rows
]
MLA_SM100_CASES = [  # (dtype, Hq, latent dim, v dim, page size, sparse, soft-cap, sinks, lse, topk_lengths, rope_dim)
    ("bfloat16", 128, 576, 512, 64),  # DeepSeek-V3 dense decode, 128 heads
    ("float16", 16, 576, 512, 1),  # 16 heads (TP 8), pages of one row
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, True),  # V3.2 sparse top-k
    ("bfloat16", 64, 576, 512, 3, True, True, True, True),  # sparse with soft-cap, sinks, lse
    # rope-aware FP8 rows (512 e4m3 + 64 bf16, a float32 scale per token): dense, V3.2 sparse, every flag
    ("bfloat16", 128, 576, 512, 64, False, False, False, False, False, 64),
    ("bfloat16", 128, 576, 512, 64, True, False, False, False, True, 64),
    ("float16", 64, 576, 512, 3, True, True, True, True, False, 64),
]
COMBINE_CASES = [("bfloat16", 32, 64), ("bfloat16", 32, 80), ("bfloat16", 32, 128), ("bfloat16", 32, 256),
                 ("bfloat16", 128, 512)]  # 80: 6 rows of 20 threads a CTA, 8 idle


def _smem_bound(threads: int, smem: int) -> int:
    """CTAs per SM that shared memory (and threads) allow: a plan whose tile sets its occupancy claims this many,
    so registers must not lower it."""
    return min(MAX_THREADS_PER_SM // threads, SMEM_PER_SM // (smem + 1024))


def _gather_plan(k: gather.PagedKVGather) -> Plan:
    # The page's 128B-swizzled tile, 1 KiB of alignment slack for it, and the TMA barrier.
    smem = k.page_size * k.head_dim * (k.dtype.width // 8) + 1024 + 8
    return Plan(gather.THREADS, smem, _smem_bound(gather.THREADS, smem))


def _store_plan(k: store.PagedKVStore) -> Plan:
    # A copy is bound by the bytes in flight: 4 CTAs of 128 threads with VECS_PER_THREAD 16-byte vectors each
    # keep 128 KiB per SM in flight, several times what covers HBM latency; shared memory holds the page and
    # position of each of the CTA's rows.
    return Plan(store.THREADS, 2 * k.rows * 4, 4)


def _store_rope_aware_plan(k: store_rope_aware.RopeAwareKVStore) -> Plan:
    # As the store: a copy bound by the bytes in flight (each warp loads its 4 rows before storing), 4 CTAs per SM.
    return Plan(store_rope_aware.THREADS, 2 * store_rope_aware.ROWS * 4, 4)


def _qkv(arch: str):
    """``FusedQKVGemm`` on ``arch`` from a ``QKV_CASES`` tuple (quack is imported only when one is built)."""

    def make(*case):
        from cute_kv.kernels.qkv.gemm import FusedQKVGemm

        return FusedQKVGemm(_qkv_spec(case), arch)

    return make


def _qkv_spec(case):
    """The ``QKVSpec`` of a ``QKV_CASES`` tuple."""
    from cute_kv.kernels.qkv.gemm import QKVSpec

    extra = dict(zip(("granularity", "e8m0", "cross_dims", "rope_tail", "strided"), case[11:]))
    fp8 = bool(extra.get("granularity") or extra.get("rope_tail"))
    return QKVSpec(*case[:9], q_norm_dim=case[9], k_norm_dim=case[10], fp8=fp8, **extra)


def _qkv_w4(fmt, *case):
    """``FusedQKVGemmW4`` (sm_90a) from a ``QKV_W4_CASES`` tuple."""
    from cute_kv.kernels.qkv.w4 import FusedQKVGemmW4, QKVW4Spec

    return FusedQKVGemmW4(QKVW4Spec(_qkv_spec(case), fmt))


def _qkv_w4_sm100(fmt, *case):
    """``FusedQKVGemmW4Sm100`` (Blackwell) from a ``QKV_W4_CASES`` tuple."""
    from cute_kv.kernels.qkv.w4 import QKVW4Spec
    from cute_kv.kernels.qkv.w4_sm100 import FusedQKVGemmW4Sm100

    return FusedQKVGemmW4Sm100(QKVW4Spec(_qkv_spec(case), fmt))


# quack's persistent GEMMs: SM90 ping-pong is a producer and two MMA warpgroups; SM100 is 8 warps (MMA, TMA loads,
# scheduler and 4 epilogue warps). Both size their stages to fill shared memory: one CTA per SM.
_QKV_THREADS = {"sm_90a": 384, "sm_100a": 256}


def _quack_roles(gemm) -> dict:
    """quack's warp roles: SM90, the MMA warpgroups (ping-pong: two taking tiles in turn) and the load warp; SM100,
    epilogue warps, the MMA warp, the load warp and the tile scheduler's warp."""
    load = _warps(gemm.ab_load_warp_id, gemm.num_ab_load_warps)
    if hasattr(gemm, "mma_warp_groups"):
        return {"mma": Role(_warps(0, 4 * gemm.mma_warp_groups), 2 if gemm.pingpong else 1), "load": Role(load)}
    return {"epilogue": Role(tuple(gemm.epilog_warp_id)), "mma": Role((gemm.mma_warp_id,)), "load": Role(load),
            "scheduler": Role((gemm.scheduler_warp_id,))}


def _w4_sm100_roles(k) -> dict:
    """Our SM100 W4 kernel: epilogue warps, the MMA and load warps, the transform warps that decode the weights."""
    from cute_kv.kernels.qkv import w4_sm100

    return {"epilogue": Role(w4_sm100.EPI_WARPS), "mma": Role((w4_sm100.MMA_WARP,)),
            "load": Role((w4_sm100.LOAD_WARP,)), "transform": Role(w4_sm100.TRANSFORM_WARPS)}


def _sm90_roles(module, fp8: bool, gather: bool = False, q_tma: bool = True) -> dict:
    """Our SM90 attention kernels: warp 0 issues the loads, the two consumer warpgroups read every stage; with an fp8
    cache the producer warpgroup converts the landed stages; with gathered rows it loads them (cp.async), warp 0
    loading Q alone (by TMA; none when the consumers copy Q)."""
    wg = module.WG_THREADS // 32
    roles = {"consumers": Role(_warps(wg, module.THREADS // 32 - wg))}
    if not gather or q_tma:
        roles["load"] = Role((0,))
    if fp8 or gather:
        roles["producers"] = Role(_warps(0, wg))
    return roles


def _sm100_roles(module, fp8: bool) -> dict:
    """Our SM100 MLA kernel: the softmax warpgroup, the MMA and load warps; fp8: the converter warpgroup."""
    roles = {"softmax": Role(_warps(0, module.SOFTMAX_THREADS // 32)), "mma": Role((module.MMA_WARP,)),
             "load": Role((module.LOAD_WARP,))}
    if fp8:
        roles["convert"] = Role(module.CONVERT_WARPS)
    return roles


def _attention_sm100_roles(k: attention_sm100.PagedAttentionSm100) -> dict:
    """``PagedAttentionSm100``: a softmax warpgroup per Q tile, the correction warpgroup, the MMA and load warps;
    fp8: the converter warpgroup."""
    roles = {"softmax": Role(k.softmax_warps), "correction": Role(_warps(k.correction_warp, 4)),
             "mma": Role((k.mma_warp,)), "load": Role((k.load_warp,))}
    if k.kv_fp8:
        roles["convert"] = Role(attention_sm100.CONVERT_WARPS)
    return roles


def _attention_plan(k: attention_sm90.PagedAttention) -> Plan:
    # One CTA per SM: the rings take what shared memory the two warpgroups' Q tiles leave (config.tiling); the
    # ping-pong of the two consumer warpgroups is the overlap, not a second CTA.
    return Plan(attention_sm90.THREADS, k.smem_bytes(), 1)


def _mla_plan(k: mla_sm90.MLADecode) -> Plan:
    # One CTA per SM: the Q tile, two 64 x latent key stages and the P tile take the shared memory (mla/config);
    # a rope-aware FP8 tile lands inside the stage it is dequantized into.
    return Plan(mla_sm90.THREADS, k.smem_bytes(), 1)


def _combine_plan(k: combine.AttentionCombine) -> Plan:
    return Plan(combine.THREADS, 0, _smem_bound(combine.THREADS, 0))  # no shared memory: a full SM of threads


FAMILIES = [
    # Warp 0 loads the page (one TMA barrier), every warp copies it out.
    Family("paged_kv_gather", gather.PagedKVGather, tuple(GATHER_CASES), ARCHS, _gather_plan,
           build=lambda kernel: kernel.build(),
           roles=lambda k: {"load": Role((0,)), "copy": Role(_warps(0, gather.THREADS // 32))}),
    Family("paged_kv_store", store.PagedKVStore, tuple(STORE_CASES + STORE_FP8_CASES + STORE_STRIDED_CASES
                                                           + STORE_TENSOR_SCALED_CASES), ARCHS,
           _store_plan, build=lambda kernel: kernel.build()),
    Family("paged_kv_store_rope_aware", store_rope_aware.RopeAwareKVStore, tuple(STORE_ROPE_AWARE_CASES), ARCHS,
           _store_rope_aware_plan),
    # One family per kernel set: sm_103a compiles the sm_100a one (same classes and tiles).
    *(Family(f"fused_qkv_gemm_{arch[3:-1]}", _qkv(arch), tuple(QKV_CASES), archs,
             lambda k: Plan(_QKV_THREADS[k.arch], None, 1), build=lambda k: k.build(),
             roles=lambda k: _quack_roles(k.gemm())) for arch, archs in ((SM90, (SM90,)), ("sm_100a", BLACKWELL))),
    # quack's cooperative W4 GEMM: a producer and two MMA warpgroups sharing a 128-row weight tile; stages fill
    # shared memory (one CTA per SM).
    # quack's mainloop releases a stage from lane 0 of each warp after all its lanes read the weights from shared
    # memory, with no bar.warp.sync between: the "sync" finding, library code.
    Family("fused_qkv_gemm_w4_90", _qkv_w4, tuple(QKV_W4_CASES), (SM90,), lambda k: Plan(384, None, 1),
           build=lambda k: k.build(), roles=lambda k: _quack_roles(k.gemm()), barrier_waivers=("sync",)),
    # Our SM100 W4 kernel: 4 epilogue warps, MMA, load and 4 transform warps; stages fill shared memory beside the
    # epilogue tile and two TMEM accumulators (one CTA per SM).
    Family("fused_qkv_gemm_w4_100", _qkv_w4_sm100, tuple(QKV_W4_CASES), BLACKWELL,
           lambda k: Plan(k.threads, None, 1), build=lambda k: k.build(), roles=_w4_sm100_roles),
    Family("paged_attention_sm90", attention_sm90.PagedAttention, tuple(ATTENTION_CASES), (SM90,),
           # S blocks: QK over the head dim, PV over the value dim.
           _attention_plan, head_dim=lambda k: (k.head_dim + k.v_dim) // 2,
           peer_case=lambda d, page, tokens: ("bfloat16", 32, 8, d, page, 2, True),
           roles=lambda k: _sm90_roles(attention_sm90, k.kv_fp8, k.gather is not None, k.q_tma)),
    Family("paged_attention_sm100", attention_sm100.PagedAttentionSm100, tuple(ATTENTION_SM100_CASES), BLACKWELL,
           # Warps in roles (softmax, correction, MMA, load; fp8: converters); all of tensor memory and the
           # DSL-sized rings: one CTA per SM.
           # S blocks: QK over the head dim, PV over the value dim.
           lambda k: Plan(k.threads, None, 1), head_dim=lambda k: (k.head_dim + k.v_dim) // 2,
           # The Q tiles the host picks for the step (``step_q_tiles``): one for decode's 4 packed rows.
           peer_case=lambda d, page, tokens: ("bfloat16", 32, 8, d, page, 2, True, False, False, False, None, None,
                                              False, attention_sm100_config.q_tiles(d, page_size=page, group=4,
                                                                                    rows=4 * tokens)),
           roles=_attention_sm100_roles),
    Family("mla_decode_sm90", mla_sm90.MLADecode, tuple(MLA_CASES), (SM90,), _mla_plan,
           # S blocks: a 64 x 64 block is QK over latent_dim plus PV over v_dim, 4 * 64 * 64 * their mean flops
           head_dim=lambda k: (k.latent_dim + k.v_dim) // 2, roles=lambda k: _sm90_roles(mla_sm90, bool(k.rope_dim))),
    Family("mla_decode_sm100", mla_sm100.MlaDecodeSm100, tuple(MLA_SM100_CASES), BLACKWELL,
           # Warps in roles (softmax, MMA, load; converter for rope-aware fp8), Q and the key stages: one CTA per SM.
           lambda k: Plan(k.threads, k.plan.smem, 1), head_dim=lambda k: k.latent_dim,
           roles=lambda k: _sm100_roles(mla_sm100, k.fp8)),
    Family("attention_combine", combine.AttentionCombine, tuple(COMBINE_CASES), ARCHS, _combine_plan),
]


def configs() -> list[Config]:
    return [c for f in FAMILIES for c in f.configs()]
