"""Every op's CUDA launch path, run on the CPU: the device query answers "a CUDA GPU of arch X" and each compiled
kernel is replaced by its launch contract, which checks every call the way the compiled kernel's TVM-FFI entry
would and records it. Nothing else is replaced: the routing, the plans, the launchers and their argument
preparation are the real ones.

The contract is the kernel's own spec: ``compile_cache.compiled`` compiles ``build()``'s ``(jit_fn, *fake_args)``
with ``--enable-tvm-ffi``, and the DSL turns those fake arguments into the entry's parameter spec
(``cutlass.cute._tvm_ffi_args_spec_converter``). ``Contract`` builds that same spec without compiling and checks a
call against it as the generated entry does (``base_dsl/tvm_ffi_builder``): arity (by name, with defaults), tensor
rank, dtype (signed and unsigned integers of one width alike), every static shape and stride (a stride of a size-1
dim is not checked), a symbolic dim or stride equal wherever it is shared, its divisibility and int32/int64 range,
the data pointer's alignment, ``None`` where ``None`` was compiled, tuples element by element, ints and floats by
kind. Beyond the entry's checks: every tensor on one device and none made on the host (the entry's device-type
check, which CPU tensors standing for GPU ones cannot meet: ``HostTensors``), every grid dimension at least 1
(``GRID``: what each kernel's ``__call__`` sizes its grid from), and its y and z dimensions within CUDA's 65535
(``GRID_Y``, ``GRID_Z``; the attention kernels' x dimension, ``m_blocks``, is an int32 argument, so one past
CUDA's 2^31 - 1 is out of its range).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Optional

import torch
import tvm_ffi
from cutlass.base_dsl.tvm_ffi_builder import spec
from cutlass.cute._tvm_ffi_args_spec_converter import _tvm_ffi_args_spec_converter
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from tvm_ffi._dtype import DataTypeCode

from cute_kv.simulate import standing_in
from cute_kv.kernels.mla.sm100_config import V_SPLIT
from cute_kv.ops.splits import MAX_GRID_Y, MAX_GRID_Z

# What each kernel's grid is made of: int arguments and tensor dims (``"name.shape[i]"``), by the jit class's name.
GRID = {
    "PagedKVStore": ("k.shape[0]",),
    "RopeAwareKVStore": ("k.shape[0]",),
    "PagedKVGather": ("num_page_cols", "cache_lengths.shape[0]"),
    "AttentionCombine": ("out.shape[0]",),
    "PagedAttention": ("m_blocks", "num_splits", "cache_lengths.shape[0]"),
    "PagedAttentionSm100": ("m_blocks", "num_splits", "cache_lengths.shape[0]"),
    "MLADecode": ("m_blocks", "num_splits", "cache_lengths.shape[0]"),
    "MlaDecodeSm100": ("m_blocks", "num_splits", "batch"),
    "W4Sm100Kernel": ("blob.shape[3]", "hidden.shape[0]", "splits", "max_ctas"),
    # quack's persistent GEMMs: min(tiles, clusters); tokens are A's rows, or B's for the transposed W4 GEMM
    "FusedQKVGemmSm90": ("mA.shape[0]", "scheduler_args[0]"),
    "FusedQKVGemmSm100": ("mA.shape[0]", "scheduler_args[0]"),
    "FusedQKVGemmW4Sm90": ("mB.shape[0]", "scheduler_args[0]"),
}

# The kernels whose grid's y dimension is not 1: the product of call values, the kernel's attributes
# (``"self.name"``) and ints. CUDA caps gridDim.y at 65535.
GRID_Y = {"PagedKVGather": ("self.num_heads",), "PagedAttention": ("self.num_kv_heads", "num_splits"),
          "PagedAttentionSm100": ("self.num_kv_heads", "num_splits"), "MLADecode": ("num_splits",),
          "MlaDecodeSm100": (V_SPLIT, "num_splits")}

# The kernels whose grid's z dimension counts requests (or tokens): CUDA caps gridDim.z at 65535.
GRID_Z = {"PagedKVGather": "cache_lengths.shape[0]", "PagedAttention": "cache_lengths.shape[0]",
          "PagedAttentionSm100": "cache_lengths.shape[0]", "MLADecode": "cache_lengths.shape[0]",
          "MlaDecodeSm100": "batch"}

ARCHS = ("sm_90a", "sm_100a")


class ContractError(AssertionError):
    """A call the compiled kernel's entry would reject (or a grid dimension of 0)."""


def _entry_spec(jit_fn, fake_args: tuple):
    """``(params, signature)``: the TVM-FFI parameter spec ``cute.compile`` builds for ``jit_fn(*fake_args)`` and the
    signature a call binds to (its runtime parameters, defaults kept; the environment stream is not passed)."""
    # cute.compile of a callable instance compiles its class's __call__ with self; of a bound method, its function
    owner = getattr(jit_fn, "__self__", jit_fn)
    func = jit_fn.__func__ if owner is not jit_fn else type(jit_fn).__call__
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    sig = inspect.signature(func, eval_str=True)
    params, wrapper, _ = _tvm_ffi_args_spec_converter(type(owner).__name__, sig, [owner, *fake_args], {})
    runtime = {p.name: p for p in params if not isinstance(p, spec.EnvStream)}
    defaults = dict(zip(wrapper.arg_names[len(wrapper.arg_names) - len(wrapper.arg_defaults):], wrapper.arg_defaults))
    call = inspect.Signature([inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                default=defaults.get(n, inspect.Parameter.empty))
                              for n in wrapper.arg_names])
    assert list(runtime) == wrapper.arg_names, (list(runtime), wrapper.arg_names)
    return list(runtime.values()), call


class Contract:
    """The launch contract of one compiled kernel: ``check(*args, **kwargs)`` raises ``ContractError`` for a call
    its entry would reject, else returns the call's values by spec name (tuples flattened: ``"epi[3]"``)."""

    def __init__(self, build: Callable[[], tuple]):
        jit_fn, *fake_args = build()
        self.kernel = getattr(jit_fn, "__self__", jit_fn)  # a variant's entry is a method bound to the kernel
        self.name = type(self.kernel).__name__
        if self.name not in GRID:
            raise ContractError(f"{self.name}: no GRID entry says what its grid is made of")
        self.params, self.signature = _entry_spec(jit_fn, tuple(fake_args))

    def check(self, *args, **kwargs) -> dict:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ContractError(f"{self.name}: {e}") from None
        bound.apply_defaults()
        state = _Binding(self.name)
        for param in self.params:
            state.check(param, bound.arguments[param.name])
        for source in GRID[self.name]:
            extent = state.grid_extent(source)
            if extent < 1:
                raise ContractError(f"{self.name}: grid dimension from {source} is {extent}: a launch error")
        y = 1
        for factor in GRID_Y.get(self.name, ()):
            y *= factor if isinstance(factor, int) else (
                getattr(self.kernel, factor[5:]) if factor.startswith("self.") else state.grid_extent(factor))
        if y > MAX_GRID_Y:
            raise ContractError(f"{self.name}: grid dimension y from {' x '.join(map(str, GRID_Y[self.name]))} is "
                                f"{y}, past CUDA's {MAX_GRID_Y}: a launch error")
        z = state.grid_extent(GRID_Z[self.name]) if self.name in GRID_Z else 1
        if z > MAX_GRID_Z:
            raise ContractError(f"{self.name}: grid dimension z from {GRID_Z[self.name]} is {z}, past CUDA's "
                                f"{MAX_GRID_Z}: a launch error")
        return state.values


class _Binding:
    """One call's walk over the spec: symbolic values bound at their first use, checked at every other."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.vars: dict[int, tuple[int, str]] = {}  # id(spec.Var) -> (value, where it was bound)
        self.values: dict[str, Any] = {}
        self.device: Optional[torch.device] = None

    def fail(self, message: str):
        raise ContractError(f"{self.kernel}: {message}")

    def check(self, param, value) -> None:
        name = param.name
        self.values[name] = value
        if isinstance(param, spec.Tensor):
            self.tensor(param, value)
        elif isinstance(param, spec.ConstNone):
            if value is not None:
                self.fail(f"{name} is {type(value).__name__}, compiled as None")
        elif isinstance(param, (spec.ConstInt, spec.ConstBool, spec.ConstFloat)):
            if value != param.value:
                self.fail(f"{name} = {value!r}, compiled as the constant {param.value!r}")
        elif isinstance(param, spec.TupleParam):
            self.tuple(param, value)
        elif isinstance(param, spec.Var):
            self.scalar(param, value)
        else:
            self.fail(f"{name}: no check for a {type(param).__name__} parameter")

    def tuple(self, param, value) -> None:
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = tuple(getattr(value, f.name) for f in dataclasses.fields(value))
        if not isinstance(value, (tuple, list)):
            self.fail(f"{param.name} is {type(value).__name__}, expected a tuple of {len(param.params)}")
        if len(value) != len(param.params):
            self.fail(f"{param.name} has {len(value)} elements, expected {len(param.params)}")
        for p, v in zip(param.params, value):
            self.check(p, v)

    def scalar(self, param, value) -> None:
        code = param.dtype.type_code
        if code in (DataTypeCode.INT, DataTypeCode.UINT, DataTypeCode.BOOL):
            number = _as_int(value)
            if number is None:
                self.fail(f"{param.name} is {type(value).__name__}, expected int")
            self.bind(param, number, param.name)
        elif code in (DataTypeCode.FLOAT, DataTypeCode.BFLOAT):
            if _as_int(value) is None and not isinstance(value, float) and not hasattr(value, "__tvm_ffi_float__"):
                self.fail(f"{param.name} is {type(value).__name__}, expected float")
        elif value is not None and _as_int(value) is None:  # a handle: a pointer, an int address or None
            self.fail(f"{param.name} is {type(value).__name__}, expected a handle")

    def tensor(self, param, value) -> None:
        name = param.name
        if not isinstance(value, torch.Tensor):
            self.fail(f"{name} is {type(value).__name__}, expected Tensor")
        if getattr(value, HostTensors.MARK, False):
            self.fail(f"{name} was made on the host (a factory without device=, or computed from one): a CPU tensor "
                      f"on a GPU")
        if self.device is None:
            self.device = value.device
        elif value.device != self.device:
            self.fail(f"{name} is on {value.device}, the call's other tensors on {self.device}")
        dl = tvm_ffi.from_dlpack(value)  # what the entry receives
        if param.data_alignment is not None and dl.data_ptr() % param.data_alignment:
            self.fail(f"{name}'s data is {dl.data_ptr() % param.data_alignment} bytes past a "
                      f"{param.data_alignment}-byte boundary")
        if len(dl.shape) != len(param.shape):
            self.fail(f"{name} has {len(dl.shape)} dims, expected {len(param.shape)}")
        ints = (DataTypeCode.INT, DataTypeCode.UINT)
        same_code = dl.dtype.type_code == param.dtype.type_code or (
            dl.dtype.type_code in ints and param.dtype.type_code in ints)
        if not (same_code and dl.dtype.bits == param.dtype.bits and dl.dtype.lanes == param.dtype.lanes):
            self.fail(f"{name} is {dl.dtype}, expected {param.dtype}")
        for i, (want, got) in enumerate(zip(param.shape, dl.shape)):
            self.bind(want, got, f"{name}.shape[{i}]")
        for i, (want, got) in enumerate(zip(param.strides, dl.strides)):
            if dl.shape[i] != 1:  # the entry does not check a size-1 dim's stride (torch may report any)
                self.bind(want, got, f"{name}.strides[{i}]")

    def bind(self, want, got: int, where: str) -> None:
        if isinstance(want, int):
            if got != want:
                self.fail(f"{where} is {got}, expected {want}")
            return
        bits = want.dtype.bits
        if bits < 64:
            low, high = (0, (1 << bits) - 1) if want.dtype.type_code == DataTypeCode.UINT else (
                -(1 << (bits - 1)), (1 << (bits - 1)) - 1)
            if not low <= got <= high:
                self.fail(f"{where} = {got} is outside {want.dtype}'s [{low}, {high}]")
        if want.divisibility is not None and got % want.divisibility:
            self.fail(f"{where} = {got} is not a multiple of {want.divisibility}")
        first = self.vars.setdefault(id(want), (got, where))
        if first[0] != got:
            self.fail(f"{where} is {got}, expected to match {first[1]} = {first[0]}")

    def grid_extent(self, source: str) -> int:
        name, _, dim = source.partition(".shape[")
        value = self.values[name]
        return value.shape[int(dim[:-1])] if dim else _as_int(value)


def _as_int(value) -> Optional[int]:
    """An int as the entry reads it (Python ints and bools, DSL integers), else None."""
    if isinstance(value, (bool, int)):
        return int(value)
    if hasattr(value, "__tvm_ffi_int__"):
        return int(value.__tvm_ffi_int__())
    return None


class HostTensors(TorchFunctionMode):
    """Marks what the code run inside makes on the host. The tests' CPU tensors stand for GPU tensors, so a tensor a
    launcher makes with a factory that names no device (torch's default device: the CPU, on a GPU machine too), and
    whatever is computed from it, is the one a real launch would find on the CPU; naming a device (``device=``,
    ``.to(device)``, ``.cuda()``) makes a tensor of the call's device."""

    MARK = "_made_on_host"
    FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
                 torch.empty_strided, torch.rand, torch.randn, torch.randint, torch.randperm, torch.eye,
                 torch.linspace, torch.from_numpy}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if kwargs.get("device") is not None or func is torch.Tensor.cuda or (
                func is torch.Tensor.to and any(isinstance(a, (torch.device, str, int)) and not isinstance(a, bool)
                                            for a in args[1:])):
            if any(result is x for x in inputs) and getattr(result, self.MARK, False):
                result = result.view_as(result)  # moved: on a GPU a new tensor, while the host one stays marked
            return result
        host = func in self.FACTORIES or any(getattr(x, self.MARK, False) for x in inputs)
        if host:
            for out in tree_leaves(result):  # an input handed back (in-place ops, ``out=``) keeps its own mark
                if isinstance(out, torch.Tensor) and not any(out is x for x in inputs):
                    setattr(out, self.MARK, True)
        return result


@dataclasses.dataclass
class Launch:
    kernel: str
    key: Any
    arch: str
    values: dict


class Launches(list):
    """The checked launches of a test, in order; ``compiled`` stands in for ``compile_cache.compiled``."""

    def compiled(self, key, build, arch):
        contract = _contract(key, arch, build)

        def launch(*args, **kwargs):
            self.append(Launch(contract.name, key, arch, contract.check(*args, **kwargs)))

        return launch

    @property
    def kernels(self) -> list[str]:
        return [launch.kernel for launch in self]


_contracts: dict = {}


def _contract(key, arch: str, build) -> Contract:
    """One ``Contract`` per compile key and arch, as ``compile_cache`` keeps one compiled kernel."""
    if (key, arch) not in _contracts:
        _contracts[(key, arch)] = Contract(build)
    return _contracts[(key, arch)]


@contextlib.contextmanager
def as_cuda(arch: str, sms: int = 132):
    """CPU tensors seen as on a CUDA GPU of ``arch`` with ``sms`` SMs; yields the ``Launches`` of the ops run
    inside. Replaced (``cute_kv.simulate.standing_in``): the device-type test (``paths.on_cuda``), torch's device
    queries, quack's cluster count and ``compile_cache.compiled``; tensors made inside on the host are marked
    (``HostTensors``)."""
    launches = Launches()
    with standing_in(arch, sms, launches.compiled), HostTensors():
        yield launches
