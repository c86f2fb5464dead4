"""The ops' kernels executed by the PTX simulator (``ptxsim``), on a machine without a GPU.

``simulated(arch)`` makes CPU tensors stand for CUDA ones: the ops plan, prepare and launch exactly as on a GPU of
``arch`` (the routing, the launchers, the DSL's compiled host function with its TMA descriptors, grid and shared
memory), and every launch runs in ``ptxsim`` over the tensors' host memory instead of on a GPU. What it leaves out:
the CUDA driver (no cubin is loaded or validated), and, since the tensors the kernel may touch are known only as the
call's tensor arguments, an access outside the argument's whole storage is caught while one outside its view but
inside its storage is not (the selftest's bit checks of the cache and the NaN-poisoned outputs see those).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import types
from typing import Iterator

import torch

from cute_kv.kernels import compile_cache
from cute_kv.ops import paths


def capability(arch: str) -> tuple[int, int]:
    """``sm_90a`` -> (9, 0), ``sm_103a`` -> (10, 3)."""
    digits = arch[3:].rstrip("a")
    return int(digits[:-1]), int(digits[-1])


@dataclasses.dataclass
class Record:
    """What ran: one entry per simulated launch (kernel, grid, block, statistics)."""
    launches: list = dataclasses.field(default_factory=list)

    @property
    def instructions(self) -> int:
        return sum(s["instructions"] for *_, s in self.launches)


def _flatten(x, out: list, name: str) -> None:
    if isinstance(x, torch.Tensor):
        out.append((name, x))
    elif isinstance(x, (tuple, list)):
        for i, y in enumerate(x):
            _flatten(y, out, f"{name}[{i}]")
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            _flatten(getattr(x, f.name), out, f"{name}.{f.name}")


def _views(x):
    from ptxsim.capture import cuda_view

    if isinstance(x, torch.Tensor):
        return cuda_view(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_views(y) for y in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_views(y) for y in x)
    return x


def _reset_memos() -> None:
    """The op modules memoize launchers and device counts: forget them on the way in and out."""
    for name, module in list(sys.modules.items()):
        if name.startswith("cute_kv.ops."):
            for value in vars(module).values():
                if hasattr(value, "cache_clear") and getattr(value, "__module__", None) == name:
                    value.cache_clear()


@contextlib.contextmanager
def standing_in(arch: str, sms: int, compiled) -> Iterator[None]:
    """CPU tensors taken for tensors of a CUDA GPU of ``arch`` with ``sms`` SMs: the device-type test, torch's device
    queries and quack's cluster count answer for that GPU, and ``compile_cache.compiled`` is ``compiled``."""
    import quack.cute_dsl_utils

    saved = (paths.on_cuda, torch.cuda.is_available, torch.cuda.get_device_capability,
             torch.cuda.get_device_properties, quack.cute_dsl_utils.get_max_active_clusters, compile_cache.compiled,
             os.environ.pop("CUTE_DSL_ARCH", None))
    paths.on_cuda = lambda device: True
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: capability(arch)
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(multi_processor_count=sms)
    quack.cute_dsl_utils.get_max_active_clusters = lambda cluster_size, device_capacity=None, device_id=0: \
        sms // cluster_size
    compile_cache.compiled = compiled
    _reset_memos()
    try:
        yield
    finally:
        (paths.on_cuda, torch.cuda.is_available, torch.cuda.get_device_capability, torch.cuda.get_device_properties,
         quack.cute_dsl_utils.get_max_active_clusters, compile_cache.compiled, env) = saved
        if env is not None:
            os.environ["CUTE_DSL_ARCH"] = env
        _reset_memos()


# Kernel classes whose MMA warp relies on one thread's tcgen05.mma operations executing in issue order (``simulated``)
ISSUE_ORDER_KERNELS = ("PagedAttentionSm100",)


@contextlib.contextmanager
def simulated(arch: str = "sm_90a", seed: int = 0, sms: int = 132, **sim_options) -> Iterator[Record]:
    """Ops called inside on CPU tensors run their kernels in the simulator (schedule ``seed``); yields a ``Record``
    of the launches. A simulator error (hazard, deadlock, fault) propagates out of the op call.

    One acceptance is on for ``ISSUE_ORDER_KERNELS`` unless ``in_order_tcgen05_mma`` is given: one thread's MMAs
    execute in issue order (see ``ptxsim.Simulator``). ``PagedAttentionSm100`` issues the QK MMA into an S slot right
    after the PV MMA that reads that slot's P, as FA4's SM100 forward does; the PTX ISA orders the two only through a
    commit and a wait, which would serialize the tensor core. ``in_order_tcgen05_mma=False`` shows the hazard
    (tests/test_selftest_simulated.py)."""
    import cutlass.cute as cute

    import ptxsim
    from ptxsim.capture import capturing

    record = Record()
    compiled: dict = {}

    def simulated_compiled(key, build, arch_):
        if compile_cache._recordings:
            for units, _ in compile_cache._recordings:
                units.append((key, build, arch_))
            if compile_cache._recordings[-1][1]:
                return compile_cache._no_launch
        fn = compiled.get((key, arch_))
        if fn is None:
            jit_fn, *args = build()
            fn = compiled[(key, arch_)] = cute.compile(jit_fn, *args,
                                                       options=f"--gpu-arch {arch_} --enable-tvm-ffi")

        def launch(*args):
            first = len(launches)
            fn(*_views(args))
            tensors: list = []
            _flatten(args, tensors, "arg")
            regions, seen = {}, set()
            for name, t in tensors:
                if t.numel() == 0:
                    continue
                s = t.untyped_storage()
                if s.data_ptr() in seen:
                    continue
                seen.add(s.data_ptr())
                # the whole storage: a launcher may hand the kernel a view and the kernel address the rest
                regions[f"{name} ({key[0] if isinstance(key, tuple) else key})"] = torch.empty(
                    0, dtype=torch.uint8).set_(s, 0, (s.nbytes(),))
            for lau in launches[first:]:
                accept = {"in_order_tcgen05_mma": any(name in lau.kernel for name in ISSUE_ORDER_KERNELS)}
                stats = ptxsim.simulate(lau, writes=regions, seed=seed, **{**accept, **sim_options})
                record.launches.append((lau.kernel, lau.grid, lau.block, stats))
        return launch

    with capturing(arch) as launches, standing_in(arch, sms, simulated_compiled):
        yield record
