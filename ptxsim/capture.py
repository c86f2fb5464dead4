"""Capture the real launches of CuTe DSL compiled functions on a machine without a GPU.

A function compiled by ``cute.compile`` carries a JIT-compiled *host* function. That host function loads the cubin
(``_cudaLibraryLoadData``), looks the kernel up, queries the device, sets kernel attributes, encodes every TMA
descriptor inline (128 bytes written field by field, no ``cuTensorMapEncode*`` call) and finally calls
``_cudaLaunchKernelEx`` (or ``_cudaLaunchKernel``). Under :func:`capturing` those CUDA runtime entry points are
replaced by ctypes callbacks registered with the JIT engine (``raw_register_runtime``), so the *real* compiled host
code runs on the CPU up to its launch call and we hand back each launch as a :class:`Launch`: kernel name, the PTX of
the module holding it, grid / block / cluster / dynamic shared memory, and the exact bytes of every kernel parameter.

Usage::

    with capturing("sm_90a") as launches:
        fn = cute.compile(jit_fn, *fake_args, options="--gpu-arch sm_90a --enable-tvm-ffi")
        fn(cuda_view(a), cuda_view(b), cuda_view(c))          # torch CPU tensors, relabelled as CUDA device 0
    (launch,) = launches

Functions must be *compiled* inside a ``capturing`` block: the stubs are registered when the JIT engine is created,
before it resolves its symbols (registering later crashes the process), and only launches of functions compiled
inside a block are captured. Inside the outermost block the DSL is patched (undone on leaving it): ``Compiler.jit``
registers the stubs on each new engine; ``keep_ptx`` is forced, which makes the DSL bypass its in-memory and disk
caches (every compile is fresh, its PTX dumped to a temporary dir and kept as the launch's PTX, matched to the
launch through the engine that loaded the library); the "can the runtime arch run this" test answers yes (without a
GPU the DSL assumes sm_100a and would build no engine for sm_90a); ``num_devices`` answers 1. A project cache of
compiled functions (``compile_cache.compiled``) must be bypassed inside the block.

What the capture path exercises (real, unmodified):
  * the DSL front end and MLIR pipeline as for a GPU of the requested arch (tensors relabelled as CUDA device 0, so
    the memory space is ``gmem``, exactly as for real CUDA tensors), nvvm/ptxas, and the compiled host function:
    argument unpacking, the TVM-FFI argument checks (dtype, device, shape, divisibility, alignment), the inline
    TMA-descriptor encoding, grid/cluster/shared-memory computation and its attribute calls.
What it leaves unexercised:
  * the CUDA driver and runtime entirely: no cubin is loaded (``_cudaLibraryLoadData`` returns a handle), the
    driver's ``cuTensorMapEncode*`` validation never runs (a descriptor the driver would reject is captured as is),
    no launch-configuration checks by the driver (too many threads, too much shared memory, cluster size limits),
    no occupancy computation (``cudaOccupancyMaxActiveBlocksPerMultiprocessor`` answers 1), device attributes come
    from a fixed table (H100 SXM for sm_90a, B200 for sm_100a; an attribute not in the table fails the call with
    cudaErrorInvalidValue and is recorded in ``Capture.unknown_queries``);
  * the stream: TVM-FFI's env stream for a relabelled CPU tensor is whatever TVM-FFI answers for cuda:0 (NULL on a
    CPU-only torch); the stream value is recorded in ``Launch.attrs['stream']`` but nothing is ordered by it;
  * TVM-FFI's device check sees relabelled tensors (device cuda:0), so it cannot catch a real CPU/GPU mix-up;
  * TVM-FFI functions are called through the MCJIT engine that the DSL built first (the DSL normally rebuilds the
    object with JITLink, ``BinaryExecutionEngine``, which cannot take runtime stubs); same IR module, other linker.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import re
import tempfile
import threading
from typing import Any, Iterator

# --------------------------------------------------------------------------------------------------------------
# Launch record


@dataclasses.dataclass
class Launch:
    kernel: str                     # the PTX .entry name launched
    ptx: str                        # PTX text of the module holding it (exact: the compile's --keep-ptx dump)
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    cluster: tuple[int, int, int]   # (1,1,1) without a cluster attribute
    dyn_smem: int
    params: list[bytes]             # one per kernel parameter, PTX .param order, sizes from the .entry
    attrs: dict                     # launch attributes (id -> raw/decoded), kernel attributes set, stream


# --------------------------------------------------------------------------------------------------------------
# Devices. cudaDeviceAttr values (CUDA runtime API, driver_types.h).

_COMMON_ATTRS = {
    1: 1024,          # MaxThreadsPerBlock
    2: 1024, 3: 1024, 4: 64,            # MaxBlockDim x/y/z
    5: 2147483647, 6: 65535, 7: 65535,  # MaxGridDim x/y/z
    8: 49152,         # MaxSharedMemoryPerBlock
    9: 65536,         # TotalConstantMemory
    10: 32,           # WarpSize
    12: 65536,        # MaxRegistersPerBlock
    15: 1,            # GpuOverlap
    31: 1,            # ConcurrentKernels
    39: 2048,         # MaxThreadsPerMultiProcessor
    82: 65536,        # MaxRegistersPerMultiprocessor
    95: 1,            # CooperativeLaunch
    106: 32,          # MaxBlocksPerMultiprocessor
    120: 1,           # ClusterLaunch
}

DEVICES = {
    # H100 SXM5: 132 SMs, cc 9.0, 227 KiB opt-in shared memory per block, 228 KiB per SM.
    "sm_90a": {**_COMMON_ATTRS, **{16: 132, 75: 9, 76: 0, 97: 232448, 81: 233472, 13: 1980000, 36: 2619000,
                                   37: 5120, 38: 52428800}},
    # B200: 148 SMs, cc 10.0, same shared-memory limits as H100.
    "sm_100a": {**_COMMON_ATTRS, **{16: 148, 75: 10, 76: 0, 97: 232448, 81: 233472, 13: 1965000,
                                    36: 3996000, 37: 8192, 38: 132120576}},
}
# B300 (sm_103a): the B200's answers but compute capability 10.3 (its kernels are the sm_100a ones, retargeted)
DEVICES["sm_103a"] = {**DEVICES["sm_100a"], 76: 3}

# cudaLaunchAttributeID
_LAUNCH_ATTR_NAMES = {
    1: "access_policy_window", 2: "cooperative", 3: "synchronization_policy", 4: "cluster_dimension",
    5: "cluster_scheduling_policy", 6: "programmatic_stream_serialization", 7: "programmatic_event",
    8: "priority", 9: "mem_sync_domain_map", 10: "mem_sync_domain", 11: "preferred_cluster_dimension",
    12: "launch_completion_event", 13: "device_updatable_kernel_node",
}


# --------------------------------------------------------------------------------------------------------------
# PTX helpers

_ENTRY_RE = re.compile(r"\.entry\s+([A-Za-z_$.][\w$.]*)\s*\((.*?)\)", re.S)
_TYPE_BYTES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
               "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}


def entry_params(ptx: str, kernel: str) -> list[tuple[str, int, int]]:
    """``[(name, size_bytes, align)]`` of the ``.entry kernel`` parameters, in declaration order."""
    for m in _ENTRY_RE.finditer(ptx):
        if m.group(1) != kernel:
            continue
        out = []
        for decl in m.group(2).split(","):
            toks = decl.split()
            if not toks:
                continue
            name, count = re.fullmatch(r"([\w$.]+)(?:\[(\d+)\])?", toks[-1]).groups()
            if toks[0] != ".param" or len(toks) < 3:
                raise ValueError(f"unparsed .param declaration {decl!r} of {kernel}")
            i, align = 1, None
            if toks[1] == ".align":  # alignment of the parameter itself (a later .ptr ... .align is the pointee's)
                align, i = int(toks[2]), 3
            ty = toks[i].lstrip(".")
            if ty not in _TYPE_BYTES:
                raise ValueError(f"unknown .param type .{ty} in {decl!r}")
            size = _TYPE_BYTES[ty] * (int(count) if count else 1)
            out.append((name, size, align or _TYPE_BYTES[ty]))
        return out
    raise KeyError(f".entry {kernel} not in the PTX")


_SHARED_RE = re.compile(r"^\s*\.shared\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+[\w$.]+\s*(?:\[(\d+)\])?\s*;", re.M)


def static_smem_bytes(ptx: str) -> int:
    """Bytes of non-extern ``.shared`` variables declared in the module (upper bound of one kernel's static smem)."""
    total = 0
    for align, ty, count in _SHARED_RE.findall(ptx):
        a = int(align) if align else 1
        total = (total + a - 1) // a * a + _TYPE_BYTES.get(ty, 1) * (int(count) if count else 1)
    return total


# --------------------------------------------------------------------------------------------------------------
# The capture state and the runtime stubs


class _State:
    def __init__(self) -> None:
        self.arch: str = "sm_90a"
        self.active: list[Launch] | None = None
        self.next_handle = 0x1000
        self.libraries: dict[int, int] = {}                   # library handle -> engine token
        self.engine_tokens: dict[int, tuple[Any, int]] = {}   # id(engine) -> (engine, token)
        self.ptx_by_token: dict[int, str] = {}                # engine token -> PTX of the function it runs
        self.kernels: dict[int, tuple[str, int]] = {}         # kernel handle -> (name, library)
        self.kernel_attrs: dict[int, dict] = {}
        self.unknown_queries: list[tuple[str, int]] = []
        self.errors: list[BaseException] = []

    def handle(self) -> int:
        self.next_handle += 0x10
        return self.next_handle


_STATE = _State()
_LOCK = threading.RLock()

_i32 = ctypes.c_int32
_vp = ctypes.c_void_p
_SIGS = {
    "_cudaLibraryLoadData": (_i32, _vp, _vp, _vp, _vp, ctypes.c_uint32, _vp, _vp, ctypes.c_uint32),
    "_cudaGetDevice": (_i32, _vp),
    "cudaGetDeviceCount": (_i32, _vp),
    "_cudaGetDeviceCount": (_i32, _vp),
    "_cudaDeviceGetAttribute": (_i32, _vp, _i32, _i32),
    "_cudaLibraryGetKernel": (_i32, _vp, _vp, ctypes.c_char_p),
    "_cuKernelGetAttribute": (_i32, _vp, _i32, _vp, _i32),
    "_cudaKernelSetAttributeForDevice": (_i32, _vp, _i32, _i32, _i32),
    "_cudaFuncSetAttribute": (_i32, _vp, _i32, _i32),
    "_cudaOccupancyMaxActiveBlocksPerMultiprocessor": (_i32, _vp, _vp, _i32, ctypes.c_uint64),
    "_cudaLaunchKernelEx": (_i32, _vp, _vp, _vp),
    "_cudaLaunchKernel": (_i32, _vp, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32,
                          ctypes.c_uint32, ctypes.c_uint32, _vp, ctypes.c_uint64, _vp),
    "_cudaLibraryUnload": (_i32, _vp),
    "_cudaSetDevice": (_i32, _i32),
    "cuda_dialect_init_library_once": (_i32, _vp, _vp, _vp, _vp),
}
_CUDA_ERROR_INVALID_VALUE = 1
_CUDA_ERROR_LAUNCH_FAILURE = 719


def _guard(fn):
    def wrapped(*a):
        try:
            return fn(*a)
        except BaseException as e:  # never unwind through JIT frames
            _STATE.errors.append(e)
            return _CUDA_ERROR_LAUNCH_FAILURE
    return wrapped


def _w_i32(ptr: int, v: int) -> None:
    ctypes.c_int32.from_address(ptr).value = v


def _library_load_for(token: int):
    def _library_load(lib_out, code, *_rest):
        h = _STATE.handle()
        _STATE.libraries[h] = token
        ctypes.c_void_p.from_address(lib_out).value = h
        return 0
    return _library_load


_INIT_FN = ctypes.CFUNCTYPE(_i32, _vp)
_SAFE_CALL = ctypes.CFUNCTYPE(_i32, _vp, _vp, _i32, _vp)  # TVMFFISafeCallType
_LOAD_FN = ctypes.CFUNCTYPE(_i32, _vp, _i32)


def _init_library_once(state, cuda_init, cuda_load_to_device, _set_error):
    """libcute_dsl_runtime's ``cuda_dialect_init_library_once`` (TVM-FFI entries): load the library once into
    ``*state`` (a cudaLibrary_t), then run the module's per-device setup for device 0."""
    if ctypes.c_uint64.from_address(state).value == 0:
        rc = _INIT_FN(cuda_init)(state)
        if rc:
            return rc
        return _LOAD_FN(cuda_load_to_device)(state, 0)
    return 0


def _get_device(out):
    _w_i32(out, 0)
    return 0


def _device_count(out):
    _w_i32(out, 1)
    return 0


def _device_attr(out, attr, dev):
    table = DEVICES[_STATE.arch]
    if dev != 0 or attr not in table:
        _STATE.unknown_queries.append(("cudaDeviceGetAttribute", attr))
        return _CUDA_ERROR_INVALID_VALUE
    _w_i32(out, table[attr])
    return 0


def _library_get_kernel(k_out, lib, name):
    h = _STATE.handle()
    _STATE.kernels[h] = (name.decode(), lib or 0)
    ctypes.c_void_p.from_address(k_out).value = h
    return 0


def _kernel_ptx(kernel_handle: int) -> tuple[str, str | None]:
    name, lib = _STATE.kernels.get(kernel_handle, (None, 0))
    if name is None:
        raise RuntimeError(f"launch of an unknown kernel handle {kernel_handle:#x}")
    ptx = _STATE.ptx_by_token.get(_STATE.libraries.get(lib, -1))
    if ptx is not None and f".entry {name}" not in ptx:
        raise RuntimeError(f"kernel {name} is not an .entry of the PTX of its library")
    return name, ptx


def _ku_get_attr(out, attr, kernel, dev):
    # CUfunction_attribute: 0 max threads/block, 1 static smem, 2 const, 3 local, 4 regs, 8 max dyn smem
    name, ptx = _kernel_ptx(kernel or 0)
    vals = {0: 1024, 1: static_smem_bytes(ptx) if ptx else 0, 2: 0, 3: 0, 8: 0}
    vals[8] = _STATE.kernel_attrs.get(kernel or 0, {}).get(8, 0)
    if attr not in vals:
        _STATE.unknown_queries.append(("cuKernelGetAttribute", attr))
        return _CUDA_ERROR_INVALID_VALUE
    _w_i32(out, vals[attr])
    return 0


def _kernel_set_attr(kernel, attr, value, dev):
    _STATE.kernel_attrs.setdefault(kernel or 0, {})[attr] = value
    return 0


def _func_set_attr(func, attr, value):
    _STATE.kernel_attrs.setdefault(func or 0, {})[attr] = value
    return 0


def _occupancy(out, func, block, smem):
    _w_i32(out, 1)
    return 0


def _record(kernel_handle, grid, block, smem, stream, args, launch_attrs):
    name, ptx = _kernel_ptx(kernel_handle)
    if ptx is None:
        raise RuntimeError(f"no PTX known for kernel {name} (compile it inside capturing())")
    params = []
    argv = ctypes.cast(args, ctypes.POINTER(ctypes.c_void_p)) if args else None
    for i, (_pname, size, _align) in enumerate(entry_params(ptx, name)):
        params.append(ctypes.string_at(argv[i], size))
    cluster = (1, 1, 1)
    if 4 in launch_attrs:
        cluster = tuple(int.from_bytes(launch_attrs[4][4 * j:4 * j + 4], "little") for j in range(3))
    attrs = {"stream": stream or 0,
             "kernel_attributes": dict(_STATE.kernel_attrs.get(kernel_handle, {}))}
    for aid, raw in launch_attrs.items():
        if aid == 4:
            continue
        key = _LAUNCH_ATTR_NAMES.get(aid, aid)
        attrs[key] = int.from_bytes(raw[:4], "little") if aid in (2, 3, 6, 8, 10) else raw
    launch = Launch(kernel=name, ptx=ptx, grid=tuple(grid), block=tuple(block), cluster=cluster,
                    dyn_smem=int(smem), params=params, attrs=attrs)
    if _STATE.active is None:
        raise RuntimeError("a kernel launch outside capturing()")
    _STATE.active.append(launch)


def _launch_ex(config, func, args):
    u32 = lambda off: ctypes.c_uint32.from_address(config + off).value  # noqa: E731
    grid = (u32(0), u32(4), u32(8))
    block = (u32(12), u32(16), u32(20))
    smem = ctypes.c_uint64.from_address(config + 24).value
    stream = ctypes.c_uint64.from_address(config + 32).value
    attrs_ptr = ctypes.c_uint64.from_address(config + 40).value
    n_attrs = ctypes.c_uint32.from_address(config + 48).value
    launch_attrs = {}
    for i in range(n_attrs):
        base = attrs_ptr + 72 * i
        launch_attrs[ctypes.c_int32.from_address(base).value] = ctypes.string_at(base + 8, 64)
    _record(func or 0, grid, block, smem, stream, args, launch_attrs)
    return 0


def _launch(func, gx, gy, gz, bx, by, bz, args, smem, stream):
    _record(func or 0, (gx, gy, gz), (bx, by, bz), smem, stream, args, {})
    return 0


def _noop(*_a):
    return 0


_IMPLS = {
    "_cudaGetDevice": _get_device, "cudaGetDeviceCount": _device_count,
    "_cudaGetDeviceCount": _device_count, "_cudaDeviceGetAttribute": _device_attr,
    "_cudaLibraryGetKernel": _library_get_kernel, "_cuKernelGetAttribute": _ku_get_attr,
    "_cudaKernelSetAttributeForDevice": _kernel_set_attr, "_cudaFuncSetAttribute": _func_set_attr,
    "_cudaOccupancyMaxActiveBlocksPerMultiprocessor": _occupancy, "_cudaLaunchKernelEx": _launch_ex,
    "_cudaLaunchKernel": _launch, "_cudaLibraryUnload": _noop, "_cudaSetDevice": _noop,
    "cuda_dialect_init_library_once": _init_library_once,
}
_CALLBACKS = {name: ctypes.CFUNCTYPE(*_SIGS[name])(_guard(_IMPLS[name])) for name in _IMPLS}


_KEEP: list = []


def _register(engine: Any) -> None:
    """Register the stubs with a fresh JIT engine; its ``_cudaLibraryLoadData`` is its own (the engine's token
    names the library, and so the PTX, of every kernel it launches)."""
    token = _STATE.handle()
    load = ctypes.CFUNCTYPE(*_SIGS["_cudaLibraryLoadData"])(_guard(_library_load_for(token)))
    _KEEP.append(load)
    _STATE.engine_tokens[id(engine)] = (engine, token)
    engine.raw_register_runtime("_cudaLibraryLoadData", ctypes.cast(load, ctypes.c_void_p))
    for name, cb in _CALLBACKS.items():
        engine.raw_register_runtime(name, ctypes.cast(cb, ctypes.c_void_p))


# --------------------------------------------------------------------------------------------------------------
# Hooks into the DSL

_MISSING = object()


class _Patches:
    """Attribute replacements made on entering the outermost ``capturing`` block and undone on leaving it."""

    def __init__(self) -> None:
        self.undo: list = []
        self.depth = 0

    def set(self, obj: Any, name: str, value: Any) -> None:
        old = vars(obj).get(name, _MISSING) if isinstance(obj, type) else getattr(obj, name)
        self.undo.append((obj, name, old))
        setattr(obj, name, value)

    def restore(self) -> None:
        for obj, name, old in reversed(self.undo):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self.undo.clear()


_PATCHES = _Patches()


def _install() -> None:
    """Patch the DSL so that compiles made from now on get stubbed JIT engines (undone by ``_PATCHES.restore``)."""
    from cutlass.base_dsl import compiler as _compiler
    from cutlass.base_dsl import jit_executor as _jx
    from cutlass.cutlass_dsl import cuda_jit_executor as _cjx
    from cutlass.cutlass_dsl import tvm_ffi_provider as _tvm
    from cutlass.cutlass_dsl.cutlass import CuTeDSL

    P = _PATCHES
    orig_jit = _compiler.Compiler.jit

    def jit(self, module, opt_level=2, shared_libs=()):
        engine = orig_jit(self, module, opt_level=opt_level, shared_libs=shared_libs)
        _register(engine)
        return engine

    P.set(_compiler.Compiler, "jit", jit)

    # Every compile keeps its PTX (the DSL then bypasses its in-memory and disk caches, so each compile builds a
    # fresh, stubbed engine; a cached function compiled before the block would call the real runtime).
    dsl = CuTeDSL._get_dsl()
    P.set(dsl.envar, "keep_ptx", True)
    P.set(dsl.envar, "dump_dir", tempfile.mkdtemp(prefix="ptxsim_capture_"))
    # No GPU: the DSL's runtime arch defaults to sm_100a and it would build no JIT engine for another arch.
    P.set(type(dsl), "_runtime_can_run_compiled", lambda self, runtime_arch, compile_arch: True)

    # Remember each compiled function's PTX under its engine's token.
    orig_init = _jx.JitCompiledFunction.__init__

    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        entry = _STATE.engine_tokens.get(id(self.engine))
        if entry is not None and entry[0] is self.engine and self.__ptx__:
            _STATE.ptx_by_token[entry[1]] = self.__ptx__

    P.set(_jx.JitCompiledFunction, "__init__", init)
    P.set(_cjx.CudaDialectJitCompiledFunction, "num_devices", property(lambda self: 1))

    # TVM-FFI: use the stubbed MCJIT engine's entry instead of rebuilding the object with JITLink.
    def create_tvm_ffi_function(self):
        if self.engine is None:
            return None
        import tvm_ffi
        # raw_lookup(x) finds the packed wrapper "_mlir_" + x: void f(void **args), args = (&a0, .., &a3, &ret).
        packed = self.engine.raw_lookup("__tvm_ffi_" + self.function_name)
        if not packed:
            raise RuntimeError(f"__tvm_ffi_{self.function_name} not in the JIT engine")
        packed_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(packed)

        def safe_call(handle, args, num_args, result):
            vals = (ctypes.c_void_p(handle), ctypes.c_void_p(args), ctypes.c_int32(num_args),
                    ctypes.c_void_p(result), ctypes.c_int32(0))
            arr = (ctypes.c_void_p * 5)(*[ctypes.addressof(v) for v in vals])
            packed_fn(arr)
            return vals[4].value

        cb = _SAFE_CALL(safe_call)
        _KEEP.append((cb, packed_fn, self.engine))
        return tvm_ffi.Function.__from_extern_c__(ctypes.cast(cb, ctypes.c_void_p).value,
                                                   keep_alive_object=self.engine)

    P.set(_tvm.TVMFFIJitCompiledFunctionBase, "_create_tvm_ffi_function", create_tvm_ffi_function)


class Capture(list):
    """The launches captured in one ``capturing`` block (a list of :class:`Launch`)."""
    unknown_queries: list


@contextlib.contextmanager
def capturing(arch: str = "sm_90a") -> Iterator[list[Launch]]:
    """Collect every launch made inside the block by functions compiled inside it (``arch``: the device the
    queries describe). The DSL patches are in place only inside the outermost block."""
    if arch not in DEVICES:
        raise ValueError(f"arch {arch!r}: one of {sorted(DEVICES)}")
    with _LOCK:
        if _PATCHES.depth == 0:
            _install()
        _PATCHES.depth += 1
        prev = (_STATE.active, _STATE.arch, _STATE.unknown_queries, _STATE.errors)
        out = Capture()
        out.unknown_queries = _STATE.unknown_queries = []
        _STATE.errors = []
        _STATE.active, _STATE.arch = out, arch
        # the DSL's target (what FA4 and quack ask for): CUTE_DSL_ARCH as read when the DSL was first built, which
        # may precede the caller's setting; the block's arch while it lasts
        from cutlass.cutlass_dsl.cutlass import CuTeDSL
        envar = CuTeDSL._get_dsl().envar
        saved_arch = envar._arch
        envar.arch = arch
        # quack's compile cache would hand back a function built before the block (its engine unstubbed)
        try:  # imported here: a quack first imported inside the block would start with its cache on
            import quack.cache as quack_cache
        except ImportError:
            quack_cache = None
        saved_quack = quack_cache.CACHE_ENABLED if quack_cache is not None else None
        if quack_cache is not None:
            quack_cache.CACHE_ENABLED = False
        try:
            yield out
            if _STATE.errors:
                raise RuntimeError(f"a CUDA runtime stub failed: {_STATE.errors[0]!r}") from _STATE.errors[0]
        finally:
            envar._arch = saved_arch
            if quack_cache is not None:
                quack_cache.CACHE_ENABLED = saved_quack
            _STATE.active, _STATE.arch, _STATE.unknown_queries, _STATE.errors = prev
            _PATCHES.depth -= 1
            if _PATCHES.depth == 0:
                _PATCHES.restore()


# --------------------------------------------------------------------------------------------------------------
# CPU tensors seen as CUDA device 0

_KDLCUDA = 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", ctypes.c_uint32), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("byte_offset", ctypes.c_uint64)]


_PyCapsule_GetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_GetName = ctypes.pythonapi.PyCapsule_GetName
_PyCapsule_GetName.restype = ctypes.c_char_p
_PyCapsule_GetName.argtypes = [ctypes.py_object]


class CudaView:
    """A torch CPU tensor offered through DLPack as if it lived on CUDA device 0 (data pointer = host memory)."""

    def __init__(self, t):
        if t.device.type != "cpu":
            raise ValueError("cuda_view takes a CPU tensor")
        self.tensor = t
        self.shape = tuple(t.shape)
        self.dtype = t.dtype

    def __dlpack_device__(self):
        return (_KDLCUDA, 0)

    def __dlpack__(self, stream=None, max_version=None, **_kw):
        kw = {} if max_version is None else {"max_version": max_version}
        cap = self.tensor.__dlpack__(**kw)
        name = _PyCapsule_GetName(cap)
        ptr = _PyCapsule_GetPointer(cap, name)
        if not ptr:
            raise RuntimeError(f"DLPack capsule {name!r} without a pointer")
        if name == b"dltensor":            # DLManagedTensor: {DLTensor dl_tensor; ...}
            dl = _DLTensor.from_address(ptr)
        elif name == b"dltensor_versioned":  # DLManagedTensorVersioned: {version(8); ctx; deleter; flags(8); dl_tensor}
            dl = _DLTensor.from_address(ptr + 8 + 8 + 8 + 8)
        else:
            raise RuntimeError(f"unknown DLPack capsule name {name!r}")
        dl.device.device_type = _KDLCUDA
        dl.device.device_id = 0
        return cap

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def cuda_view(t) -> CudaView:
    """Relabel a torch CPU tensor as CUDA device 0 for ``from_dlpack`` / TVM-FFI compiled functions."""
    return CudaView(t)
