"""FA4's SM100 forward (``flash_attn.cute.flash_fwd_sm100.FlashAttentionForwardSm100``) built on the CPU for real
torch CPU tensors, as its own interface (``flash_attn.cute.interface._flash_attn_fwd``) builds and launches it.

    from ptxsim.capture import capturing, cuda_view
    from ptxsim.peers import fa4_sm100
    with capturing("sm_100a") as launches:       # build() compiles: inside the block
        fn, args = fa4_sm100.build(q, k, v, page_table=None, seqused_k=None, causal=False)
        fn(*[cuda_view(a) if torch.is_tensor(a) else a for a in args])
    out = args[fa4_sm100.OUT]                     # written by the launch (simulated)
    ref = fa4_sm100.reference(q, k, v, ...)       # float64 (the SM90 recipe's reference: same semantics)

How the build works: the interface is called under torch ``FakeTensorMode`` with fake CUDA tensors of the real
tensors' shapes, dtypes and strides and ``_arch=100``, so every choice is the interface's own (``_get_fwd_config``:
tile 128 x 128; ``q_stage`` 2 when the packed query rows exceed one 128-row tile (two Q tiles per CTA, two softmax
warpgroups), else 1; 2-CTA MMA (``use_2cta_instrs``, cluster 2 x 1: ``tcgen05.mma.cta_group::2``) for non-causal
dense or page-128 paged K/V with more than one M block (not with ``FA_DISABLE_2CTA=1`` or a CUDA 12 torch);
``paged_kv_non_tma`` (cp.async K/V) when the page size is not tile N; the S ping-pong for ``q_stage`` 1; static
persistent scheduling for non-causal; the CLC scheduler only with ``FA_CLC=1``, read by flash_attn at import, or
``clc=True``). Its ``cute.compile(..., options="--enable-tvm-ffi")`` is wrapped to
keep the compiled object; in fake mode the interface compiles but does not launch, so ``call_args`` is built here
exactly as its non-fake branch does for arch 10x (interface.py, ``call_args = [q_call, k_call, ...]``).

During ``build`` only (restored after): ``FLASH_ATTENTION_NUM_SMS`` = 148 (B200) when unset (the interface's SM count
for split and 2-CTA choices, read at call time), ``cutlass.utils.HardwareInfo`` answering a B200's 148 SMs (the
persistent schedulers' grid is ``min(148, tiles)`` CTAs, fixed at compile time) and the DSL's target arch =
``sm_100a`` unless it already is a Blackwell datacenter arch (``capturing("sm_100a")`` sets it too). Nothing is set at
import. ``fn.__ptx__`` exists
when the DSL keeps PTX (``CUTE_DSL_KEEP_PTX=1`` before cutlass is imported, or inside ``capturing``).

What the compiled object is called with (a TVM-FFI JIT executor; torch tensors through DLPack, ``None`` an absent
optional, NamedTuples flattened, the stream is TVM-FFI's environment stream), in order:

    0 q            (B, Sq, Hq, D) bf16/fp16, last dim contiguous
    1 k            dense (B, Sk, Hkv, D) or paged (num_pages, page_size, Hkv, D)
    2 v            as k (head dim Dv)
    3 out          (B, Sq, Hq, Dv), same dtype as q, written by the kernel (``OUT``)
    4 lse          None, or (B, Hq, Sq) float32 when ``return_lse`` (``LSE``)
    5 softmax_scale  python float (1/sqrt(D) by default)
    6 cu_seqlens_q, 7 cu_seqlens_k, 8 seqused_q: None here
    9 seqused_k    None or (B,) int32
    10 page_table  None or (B, max_pages) int32, row-major
    11 window_size_left, 12 window_size_right: None (causal is compile-time)
    13 learnable_sink: None
    14 descale_tensors: None (fp8 only)
    15 block-sparse tensors: None
    16 AuxData(None, None)
    17 num_splits_dynamic, 18 tile_count_semaphore, 19 virtual_batch_idx, 20 num_nheads_in_l2,
    21 cu_total_m_blocks, 22 cu_total_splits_m_blocks, 23 blocks_to_batch_idx: None (no scheduler metadata: these
       exist only for split-KV with varlen q)
    24 max_seqlen_q  python int (Sq)

Limits of this recipe: bf16/fp16, ``num_splits=1`` (a split would add the combine kernel's launch), no varlen q/k,
no score/mask mods, no local windows, no sinks, no fp8.
"""

from __future__ import annotations

import contextlib

import torch

from ptxsim.peers import attention_args, fake_cuda, hardware_info, keeping_compiles, target_env
from ptxsim.peers.fa4_sm90 import dense_kv, reference  # noqa: F401  (same semantics: re-exported)

OUT = 3  # index of the output tensor in call_args
LSE = 4
NUM_SMS = 148  # B200
ENV = {"FLASH_ATTENTION_NUM_SMS": str(NUM_SMS)}  # the interface's SM count (set only while building, if unset)
BLACKWELL = ("sm_100a", "sm_103a")


@contextlib.contextmanager
def _target():
    """The interface's SM count, ``cutlass.utils.HardwareInfo`` (as quack_sm90 does) and the DSL's target arch for
    the duration of a build (restored after)."""
    import cutlass.utils
    from cutlass.base_dsl.dsl import BaseDSL
    from flash_attn.cute import tile_scheduler

    saved_hw = cutlass.utils.HardwareInfo, tile_scheduler.HardwareInfo
    cutlass.utils.HardwareInfo = tile_scheduler.HardwareInfo = hardware_info(NUM_SMS)
    envar = BaseDSL._get_dsl().envar
    saved_arch = envar._arch
    if envar.arch not in BLACKWELL:
        envar.arch = "sm_100a"
    try:
        with target_env(ENV):
            yield
    finally:
        cutlass.utils.HardwareInfo, tile_scheduler.HardwareInfo = saved_hw
        envar._arch = saved_arch


def build(q, k, v, page_table=None, seqused_k=None, causal=False, softmax_scale=None, return_lse=False, clc=None):
    """``(compiled_fn, call_args)`` of FA4's SM100 forward for these real CPU tensors (see the module docstring);
    ``call_args[OUT]`` is a fresh output tensor, ``call_args[LSE]`` a float32 LSE when ``return_lse``. ``clc``: the
    interface's CLC-scheduler request (``FA_CLC``, read by flash_attn at import) for this build; None keeps it. The
    interface still declines CLC for dense non-causal attention and for varlen MHA."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from flash_attn.cute import interface as iface
    from flash_attn.cute.utils import AuxData

    softmax_scale = attention_args(q, k, v, page_table, seqused_k, softmax_scale)

    from flash_attn.cute import utils as fa_utils

    iface._flash_attn_fwd.compile_cache.clear()  # a hit would compile nothing to keep
    saved_clc = fa_utils._fa_clc_enabled
    if clc is not None:
        fa_utils._fa_clc_enabled = bool(clc)
    try:
        with keeping_compiles() as compiled, _target(), FakeTensorMode():
            iface._flash_attn_fwd(fake_cuda(q), fake_cuda(k), fake_cuda(v), seqused_k=fake_cuda(seqused_k),
                                  page_table=fake_cuda(page_table), softmax_scale=softmax_scale, causal=causal,
                                  return_lse=return_lse, num_splits=1, _arch=100)
    finally:
        fa_utils._fa_clc_enabled = saved_clc
    (fn,) = compiled

    batch, seqlen_q, num_head = q.shape[:3]
    out = torch.empty(batch, seqlen_q, num_head, v.shape[-1], dtype=q.dtype)
    lse = torch.empty(batch, num_head, seqlen_q, dtype=torch.float32) if return_lse else None
    call_args = [q.detach(), k.detach(), v.detach(), out, lse, softmax_scale,
                 None, None, None, seqused_k, page_table,  # cu_seqlens_q, cu_seqlens_k, seqused_q
                 None, None, None,  # window_size_left, window_size_right, learnable_sink
                 None,  # descale_tensors
                 None, AuxData(None, None),  # block-sparse tensors, aux data
                 None, None, None, None,  # num_splits_dynamic, tile_count_semaphore, virtual_batch_idx, nheads_in_l2
                 None, None, None,  # cu_total_m_blocks, cu_total_splits_m_blocks, blocks_to_batch_idx
                 seqlen_q]  # max_seqlen_q
    return fn, call_args
