"""FA4's paged forward compiled on the CPU and put through ``static.analyze``: one JSON line per shape.

    python perf/static_peers.py --arch sm_90a [--head-dims 64 80 96 128 192 256] [--page-sizes 16 64 128] \
        [--modes decode prefill]

Runs in its own process (``perf/run.py static`` starts one per arch): the DSL reads its target arch at import,
FA4 is compiled from torch ``FakeTensorMode`` tensors, and quack (FA4's dependency) imports triton at import time,
which a stub module satisfies while flash_attn is imported and is removed from ``sys.modules`` right after. SM100's
persistent scheduler asks the device for its SM count; the answer is the B200's here. Needs ``pip install -e
'.[peers]'``; prints a record with ``status: "unavailable"`` without it.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import json
import os
import sys
import types

from report import summary

SMS = {"sm_90a": 132, "sm_100a": 148}  # H100 SXM, B200
NUM_HEADS, NUM_KV_HEADS, BATCH, PAGES_PER_SEQ, PREFILL_LEN = 32, 8, 2, 8, 2048  # bf16, GQA 4


class _StubMeta(type):
    def __getattr__(cls, name):
        return cls

    def __getitem__(cls, key):
        return cls


class _Stub(metaclass=_StubMeta):
    """Any attribute, call, subscript or base class quack's import-time use of triton asks for."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return self


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub


class _TritonStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StubModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def import_fa4():
    """``flash_attn.cute.flash_attn_varlen_func``; triton is stubbed only while it imports, unless installed."""
    try:
        import triton  # noqa: F401

        from flash_attn.cute import flash_attn_varlen_func

        return flash_attn_varlen_func
    except ImportError:
        pass
    import torch._dynamo  # noqa: F401 - what quack's import-time torch.compile needs, imported with the real modules
    import torch._dynamo.repro.after_dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401

    finder = _TritonStub()
    sys.meta_path.insert(0, finder)
    try:
        from flash_attn.cute import flash_attn_varlen_func
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]
    return flash_attn_varlen_func


class _HardwareInfo:
    """What FA4's host code asks of the device, answered for the target GPU."""

    def __init__(self, *args, **kwargs):
        pass

    def get_device_multiprocessor_count(self):
        return int(os.environ["FLASH_ATTENTION_NUM_SMS"])

    def get_max_active_clusters(self, cluster_size):
        return self.get_device_multiprocessor_count() // cluster_size


def capture_compiles():
    """Wrap ``cute.compile`` so each compiled FA4 kernel (its PTX and host IR) can be analyzed."""
    import cutlass.cute as cute

    compiled, original = [], cute.compile

    def compile_and_keep(*args, **kwargs):
        fn = original(*args, **kwargs)
        compiled.append(fn)
        return fn

    cute.compile = compile_and_keep
    return compiled


def run(arch: str, head_dims, page_sizes, modes) -> list[dict]:
    import tempfile

    os.environ.update(FLASH_ATTENTION_ARCH=arch.rstrip("a"), CUTE_DSL_ARCH=arch,
                      FLASH_ATTENTION_NUM_SMS=str(SMS[arch]), CUTE_DSL_KEEP_PTX="1",
                      CUTE_DSL_DISABLE_FILE_CACHING="1", CUTE_DSL_DUMP_DIR=tempfile.mkdtemp(prefix="fa4-ptx-"))
    try:
        fa4 = import_fa4()
    except ImportError as e:
        return [{"impl": "fa4", "arch": arch, "status": "unavailable", "error": f"{e} (pip install -e '.[peers]')"}]
    from importlib.metadata import version

    import torch
    import cutlass.utils
    from flash_attn.cute import tile_scheduler
    from flash_attn.cute.interface import _flash_attn_fwd
    from torch._subclasses.fake_tensor import FakeTensorMode

    import static

    cutlass.utils.HardwareInfo = tile_scheduler.HardwareInfo = _HardwareInfo
    compiled = capture_compiles()
    records = []
    for d in head_dims:
        for page in page_sizes:
            for mode in modes:
                rec = {"kernel": "fa4_forward", "impl": "fa4", "version": version("flash-attn-4"), "arch": arch,
                       "config": f"bfloat16-{NUM_HEADS}-{NUM_KV_HEADS}-{d}-{page}-{mode}", "head_dim": d,
                       "page_size": page, "mode": mode}
                lq = 1 if mode == "decode" else PREFILL_LEN
                _flash_attn_fwd.compile_cache.clear()  # its key leaves out the page size: compile every shape
                n = len(compiled)
                try:
                    with FakeTensorMode():
                        dev = torch.device("cuda")
                        q = torch.empty(BATCH, lq, NUM_HEADS, d, dtype=torch.bfloat16, device=dev)
                        k = torch.empty(BATCH * PAGES_PER_SEQ, page, NUM_KV_HEADS, d, dtype=torch.bfloat16,
                                        device=dev)
                        table = torch.empty(BATCH, PAGES_PER_SEQ, dtype=torch.int32, device=dev)
                        lens = torch.empty(BATCH, dtype=torch.int32, device=dev)
                        fa4(q, k, torch.empty_like(k), seqused_k=lens, page_table=table, causal=mode == "prefill")
                    (fn,) = [f for f in compiled[n:] if "FlashAttentionForward" in f.__ptx__]
                    rec.update(static.analyze(fn.__ptx__, arch, static.launch_from_host_ir(str(fn.ir_module)), d))
                    rec["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - a shape FA4 does not take is a record, not a crash
                    rec.update(status="error", error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(json.dumps(rec), flush=True)
                records.append(rec)
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=summary(__doc__))
    ap.add_argument("--arch", choices=sorted(SMS), default="sm_90a")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 80, 96, 128, 192, 256])
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--modes", nargs="+", choices=["decode", "prefill"], default=["decode", "prefill"])
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    records = run(args.arch, args.head_dims, args.page_sizes, args.modes)
    if any(r["status"] == "unavailable" for r in records):
        print(json.dumps(records[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
