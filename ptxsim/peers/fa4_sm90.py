"""FA4's SM90 forward (``flash_attn.cute.flash_fwd_sm90.FlashAttentionForwardSm90``) built on the CPU for real
torch CPU tensors, as its own interface (``flash_attn.cute.interface._flash_attn_fwd``) builds and launches it.

    from ptxsim.peers import fa4_sm90
    with capturing("sm_90a") as launches:      # ptxsim.capture: the DSL's target for the block
        fn, args = fa4_sm90.build(q, k, v, page_table=None, seqused_k=None, causal=False)
    fn(*args)                                     # the peer's real launch (on a GPU; ptxsim.capture on the CPU)
    out = args[fa4_sm90.OUT]                      # written by the launch
    ref = fa4_sm90.reference(q, k, v, page_table=..., seqused_k=..., causal=...)   # float64

How the build works: the interface is called under torch ``FakeTensorMode`` with fake CUDA tensors of the real
tensors' shapes, dtypes and strides (``ENV``: ``FLASH_ATTENTION_ARCH=sm_90``, ``FLASH_ATTENTION_NUM_SMS=132``, set
while building only; the compile target is the capturing block's), so every choice (tile 128 x N, pack_gqa, intra-WG overlap, RS PV MMA,
``paged_kv_non_tma`` when the page size is not tile N, the compile key) is the interface's own; its
``cute.compile(..., options="--enable-tvm-ffi")`` is wrapped to keep the compiled object. In fake mode the interface
compiles but does not launch; ``call_args`` is then built exactly as its non-fake branch does for arch 9x
(interface.py, ``call_args = [q_call, k_call, ...]``).

What the compiled object is called with (a ``TVMFFI...`` JIT executor: torch tensors are passed directly, through
DLPack; ``None`` is an absent optional; the stream is TVM-FFI's environment stream, not an argument), in order:

    0 q            (B, Sq, Hq, D) bf16/fp16, last dim contiguous
    1 k            dense (B, Sk, Hkv, D) or paged (num_pages, page_size, Hkv, D)
    2 v            as k (head dim Dv)
    3 out          (B, Sq, Hq, Dv), same dtype as q, written by the kernel (``OUT``)
    4 lse          None, or (B, Hq, Sq) float32 when ``return_lse``
    5 softmax_scale  python float (1/sqrt(D) by default)
    6 cu_seqlens_q, 7 cu_seqlens_k, 8 seqused_q: None here
    9 seqused_k    None or (B,) int32: keys used per batch (paged: a page table row may be longer)
    10 page_table  None or (B, max_pages) int32, row-major
    11 window_size_left, 12 window_size_right: None (causal is compile-time; the interface maps causal to
       window_right=0 and back to causal=True, windows None)
    13 learnable_sink: None
    14 block-sparse tensors: None
    15 AuxData(None, None)  (flash_attn.cute.utils.AuxData, a NamedTuple of aux tensors/scalars)
    16 cu_total_m_blocks, 17 cu_total_splits_m_blocks: None (only varlen-q with large batches)

The launch itself (grid, cluster, block 384 threads = producer WG + 2 MMA WGs, dynamic smem) is decided inside the
compiled host function from these arguments; ``fn.__ptx__`` is the kernel's PTX when ``CUTE_DSL_KEEP_PTX=1`` (set
here). The TVM-FFI executor checks the tensors' device against what it was compiled for (CUDA) when it is really
called: capture has to intercept the launch, not expect the call to accept CPU tensors as-is.

Limits of this recipe: bf16/fp16 only (FA4 takes fp8 only on SM100), no varlen q/k, no split-KV (SM90 asserts
``num_splits == 1``), no score/mask mods, no local windows, no sinks.
"""

from __future__ import annotations

import math

import torch

from ptxsim.peers import attention_args, fake_cuda, keeping_compiles, target_env

# What FA4's interface reads from the environment to pick and size its SM90 kernel (set only while building).
ENV = {"FLASH_ATTENTION_ARCH": "sm_90", "FLASH_ATTENTION_NUM_SMS": "132"}

OUT = 3  # index of the output tensor in call_args
LSE = 4


def _import_interface():
    """``flash_attn.cute.interface``; quack (FA4's dependency) imports triton at import time: it must be installed
    (perf/static_peers.py shows a stub for machines without it)."""
    from flash_attn.cute import interface

    return interface


def build(q, k, v, page_table=None, seqused_k=None, causal=False, softmax_scale=None, return_lse=False):
    """``(compiled_fn, call_args)`` of FA4's SM90 forward for these real CPU tensors (see the module docstring);
    ``call_args[OUT]`` is a fresh output tensor, ``call_args[LSE]`` a float32 LSE when ``return_lse``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with target_env(ENV):
        iface = _import_interface()
    from flash_attn.cute.utils import AuxData

    softmax_scale = attention_args(q, k, v, page_table, seqused_k, softmax_scale)

    iface._flash_attn_fwd.compile_cache.clear()  # a hit would compile nothing to keep
    with keeping_compiles() as compiled, target_env(ENV), FakeTensorMode():
        iface._flash_attn_fwd(fake_cuda(q), fake_cuda(k), fake_cuda(v), seqused_k=fake_cuda(seqused_k),
                              page_table=fake_cuda(page_table), softmax_scale=softmax_scale, causal=causal,
                              return_lse=return_lse, _arch=90)
    (fn,) = compiled

    batch, seqlen_q, num_head = q.shape[:3]
    out = torch.empty(batch, seqlen_q, num_head, v.shape[-1], dtype=q.dtype)
    lse = torch.empty(batch, num_head, seqlen_q, dtype=torch.float32) if return_lse else None
    call_args = [q.detach(), k.detach(), v.detach(), out, lse, softmax_scale,
                 None, None, None, seqused_k, page_table,  # cu_seqlens_q, cu_seqlens_k, seqused_q
                 None, None, None,  # window_size_left, window_size_right, learnable_sink
                 None, AuxData(None, None),  # block-sparse tensors, aux data
                 None, None]  # cu_total_m_blocks, cu_total_splits_m_blocks
    return fn, call_args


def dense_kv(k, v, page_table):
    """Paged ``(num_pages, page_size, H, D)`` K/V gathered to dense ``(B, pages * page_size, H, D)``."""
    idx = page_table.long()
    b, n = idx.shape
    kd = k[idx].reshape(b, n * k.shape[1], *k.shape[2:])
    vd = v[idx].reshape(b, n * v.shape[1], *v.shape[2:])
    return kd, vd


def reference(q, k, v, page_table=None, seqused_k=None, causal=False, softmax_scale=None):
    """``(out, lse)`` in float64: softmax(scale * Q K^T) V per batch and query head (GQA: head h reads KV head
    h // (Hq / Hkv)); keys past ``seqused_k[b]`` are masked; causal is bottom-right aligned as FA's (query i sees key
    j iff j <= i + Sk_b - Sq); a row with no key gives out 0 and lse -inf. ``lse`` is (B, Hq, Sq)."""
    if page_table is not None:
        k, v = dense_kv(k, v, page_table)
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lens = torch.full((b,), sk) if seqused_k is None else seqused_k.long()
    j = torch.arange(sk)
    mask = j[None, None, None, :] < lens[:, None, None, None]
    if causal:
        i = torch.arange(sq)
        mask = mask & (j[None, None, None, :] <= (i[None, None, :, None] + lens[:, None, None, None] - sq))
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v)
    return out, lse
