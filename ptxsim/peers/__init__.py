"""Peer kernels (FA4, quack) built on the CPU for real tensors: ``(compiled_fn, call_args)`` plus float64
references, for ptxsim to run. Not imported by ptxsim itself (they need torch, cutlass and the peers installed)."""

import contextlib
import math
import os


@contextlib.contextmanager
def target_env(values: dict):
    """The peers read their target from environment variables: set them for the block only (those the caller set
    are kept), so importing a recipe changes nothing for the rest of the process."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hardware_info(num_sms: int) -> type:
    """A stand-in for ``cutlass.utils.HardwareInfo`` answering what the peers' host code asks of a device with
    ``num_sms`` SMs (persistent schedulers size their grids by it)."""

    class HardwareInfo:
        def __init__(self, *args, **kwargs):
            pass

        def get_device_multiprocessor_count(self):
            return num_sms

        def get_max_active_clusters(self, cluster_size):
            return num_sms // cluster_size

    return HardwareInfo


@contextlib.contextmanager
def keeping_compiles():
    """``cute.compile`` keeps what it compiles for the block: yields the list of compiled functions (a peer's
    interface compiles under fake tensors and launches nothing, so this is how its kernel is had)."""
    import cutlass.cute as cute

    compiled, original = [], cute.compile

    def keep(*args, **kwargs):
        fn = original(*args, **kwargs)
        compiled.append(fn)
        return fn

    cute.compile = keep
    try:
        yield compiled
    finally:
        cute.compile = original


def fake_cuda(t):
    """A fake CUDA tensor of ``t``'s shape, strides and dtype (inside ``FakeTensorMode``), or None."""
    import torch

    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")


def attention_args(q, k, v, page_table, seqused_k, softmax_scale):
    """FA4's forward takes what its interface would not copy: 16-bit q/k/v with a contiguous last dim, int32 page
    table and lengths. Returns the softmax scale (1/sqrt(D) unless given)."""
    import torch

    assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == q.dtype == v.dtype
    for t in (q, k, v):
        assert t.stride(-1) == 1, "last dim must be contiguous (the interface would copy)"
    if page_table is not None:
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
    if seqused_k is not None:
        assert seqused_k.dtype == torch.int32 and seqused_k.is_contiguous()
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
