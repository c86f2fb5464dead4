"""``cute_kv.plan_step``: one check of the step, then layer calls that read no device value and allocate only their
outputs, on the launch paths (``launch.as_cuda``) and the reference alike."""

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cute_kv
from cute_kv import PagedKVCacheCollection
from cute_kv import reference as ref
from cute_kv.reference.batch import random_paged_batch
from launch import ARCHS, as_cuda
from test_launch_contracts import (MLA, _batch, _fused_qkv, _mla_prefill_args, _mla_prefill_kwargs,
                                   _paged_attention, _sparse_mla, _store_kv)

READ_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
                torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}
READ_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
            torch.ops.aten.item.default}


class _Reads(TorchFunctionMode):
    """Host reads of tensor values by method (``tolist`` reaches no aten op)."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READ_METHODS:
            self.work.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    """aten reads (``_local_scalar_dense``, ``is_nonzero``) and every op whose output is new memory."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in READ_OPS:
            self.work.aten_reads.append(str(func))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        result = func(*args, **kwargs)
        for t in tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self.work.allocations.append(str(func))
        return result


class HostWork:
    def __init__(self):
        self.reads, self.aten_reads, self.allocations = [], [], []


@contextlib.contextmanager
def host_work():
    work = HostWork()
    with _Reads(work), _Ops(work):
        yield work


def _plan(pb, **kw):
    return cute_kv.plan_step(pb.collection, pb.input_row_offsets, **kw)


def _with_layer(args, layer):
    """An op call's arguments with another layer: every op takes ``layer_idx`` after the collection."""
    at = next(i for i, a in enumerate(args) if isinstance(a, cute_kv.PagedKVCacheCollection)) + 1
    return (*args[:at], layer, *args[at + 1:])


# -- one check per step ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("num_tokens", [None, 9])
def test_plan_step_reads_the_step_once(num_tokens):
    pb = random_paged_batch([0, 37, 5, 9], [5, 1, 0, 3], num_heads=2, head_size=16, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    with host_work() as work:
        plan = _plan(pb, num_q_heads=4, num_tokens=num_tokens)
    assert work.reads == ["tolist"] and work.aten_reads == []
    assert (plan.num_tokens, plan.batch_size, plan.num_q_heads) == (9, 4, 4)
    with host_work() as work:
        _plan(pb, num_tokens=9, validate=False)
    assert work.reads == [] and work.aten_reads == []


def _bad_steps():
    """``(name, collection, offsets, num_tokens)`` of steps check_step rejects."""
    pb = random_paged_batch([0, 37, 5, 9], [5, 1, 0, 3], num_heads=2, head_size=16, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    c, ro = pb.collection, pb.input_row_offsets
    unowned = c.lookup_table.clone()
    unowned[1, 2] = c.num_pages  # request 1 (38 tokens) needs its third page
    return {
        "rows": (c, ro, 8),
        "first offset": (c, ro.to(torch.int32).add(1).to(torch.uint32), 10),
        "decreasing": (c, cute_kv.input_row_offsets([5, 1, 0, 3]).view(torch.int32).flip(0), 0),
        "max_seq_length": (c.with_metadata(c.cache_lengths, c.lookup_table, 4, c.max_cache_length), ro, 9),
        "max_cache_length": (c.with_metadata(c.cache_lengths, c.lookup_table, 5, 37), ro, 9),
        "unowned page": (c.with_metadata(c.cache_lengths, unowned, 5, c.max_cache_length, validate=False), ro, 9),
    }


@pytest.mark.parametrize("name", list(_bad_steps()))
def test_plan_step_rejects_what_the_per_call_checks_reject(name):
    c, ro, rows = _bad_steps()[name]
    k = torch.zeros(rows, c.num_heads, c.head_size, dtype=c.dtype)
    with pytest.raises(ValueError) as per_call:
        cute_kv.store_kv(k, k, ro, c, 0)
    with pytest.raises(ValueError) as planned:
        cute_kv.plan_step(c, ro, num_tokens=rows)
    assert str(planned.value) == str(per_call.value)


def test_plan_step_arguments():
    pb = random_paged_batch([3], [2], num_heads=1, head_size=16, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="pass num_tokens"):
        _plan(pb, validate=False)
    with pytest.raises(ValueError, match="num_tokens must be"):
        _plan(pb, num_tokens=-1)
    with pytest.raises(ValueError, match="num_q_heads must be"):
        _plan(pb, num_q_heads=0)
    with pytest.raises(TypeError, match="input_row_offsets must have dtype"):
        cute_kv.plan_step(pb.collection, pb.input_row_offsets.to(torch.int64))


def test_a_plan_serves_only_its_step(rng):
    pb = random_paged_batch([0, 37, 5, 9], [5, 1, 0, 3], num_heads=2, head_size=16, page_size=16,
                            generator=torch.Generator().manual_seed(0))
    c, ro = pb.collection, pb.input_row_offsets
    plan = _plan(pb)
    k = torch.randn(9, 2, 16, generator=rng).to(c.dtype)
    q = torch.randn(9, 4, 16, generator=rng).to(c.dtype)
    same_step = c.with_metadata(c.cache_lengths, c.lookup_table, c.max_seq_length, c.max_cache_length)
    cute_kv.store_kv(k, k, ro, same_step, 1, plan=plan)  # another object of the step's metadata: served
    for other, differs in (
            (c.with_metadata(c.cache_lengths.clone(), c.lookup_table, c.max_seq_length, c.max_cache_length),
             "its cache_lengths is not the tensor the plan checked"),
            (c.with_metadata(c.cache_lengths, c.lookup_table, c.max_seq_length + 1, c.max_cache_length),
             f"its max_seq_length is {c.max_seq_length + 1}, the plan's {c.max_seq_length}"),
            (PagedKVCacheCollection(c.blocks.clone().transpose(3, 4).contiguous().transpose(3, 4), c.cache_lengths,
                                    c.lookup_table, c.max_seq_length, c.max_cache_length),
             "its cache.s layout is strided, the plan.s compact")):
        with pytest.raises(ValueError, match=f"store_kv: the plan does not serve this collection: {differs}"):
            cute_kv.store_kv(k, k, ro, other, 0, plan=plan)
    with pytest.raises(ValueError, match="not the tensor the plan was made with"):
        cute_kv.paged_attention(q, ro.clone(), c, 0, plan=plan)
    with pytest.raises(ValueError, match="the call has 8 rows but the plan's step has 9"):
        cute_kv.store_kv(k[:8], k[:8], ro, c, 0, plan=plan)
    with pytest.raises(ValueError, match="layer_idx must be in"):
        cute_kv.store_kv(k, k, ro, c, 2, plan=plan)
    cute_kv.paged_attention(q, ro, c, 0, window=1, plan=plan)
    for window in ([3], True):  # unhashable; equal to the planned 1 as a key, but a bool
        with pytest.raises(ValueError, match="window must be a positive int"):
            cute_kv.paged_attention(q, ro, c, 0, window=window, plan=plan)
    with pytest.raises(ValueError, match="q has 4 heads but the plan was made with num_q_heads=8"):
        cute_kv.paged_attention(q, ro, c, 0, plan=_plan(pb, num_q_heads=8))


# -- layer calls on the launch paths ----------------------------------------------------------------------------------

def _mla_prefill(pb, step, rng):
    return cute_kv.mla_prefill, _mla_prefill_args(pb, step, rng), _mla_prefill_kwargs(pb, step)


# Each op's call and what it allocates: its outputs (None: mla_prefill's up-projections and their products too).
OPS = {"store_kv": (_store_kv, 0), "paged_attention": (_paged_attention, 1), "fused_qkv": (_fused_qkv, 1),
       "sparse_mla": (_sparse_mla, 1), "mla_prefill": (_mla_prefill, None)}


LAYER_CASES = [(op, step, kind, arch) for op in OPS for step in ("decode-split", "ragged", "prefill", "empty")
               for kind in ("bf16", "fp8-f32", *MLA) for arch in ARCHS
               if op not in ("sparse_mla", "mla_prefill") or kind in MLA
               if op != "sparse_mla" or arch == "sm_100a"]  # sparse MLA's kernel is SM100's


@pytest.mark.parametrize("op, step, kind, arch", LAYER_CASES)
def test_a_planned_layer_call_reads_nothing_and_launches_as_per_call(op, step, kind, arch, rng):
    """The second layer's call reads no value and allocates only its outputs (``out``, and ``lse`` when asked);
    every layer launches the kernels, grids and split-KV partials of the per-call path, the partials kept by the
    plan for every layer."""
    make, num_outputs = OPS[op]
    pb = _batch(kind, step)
    fn, args, kw = make(pb, step, rng)
    with as_cuda(arch) as per_call:
        for layer in (0, 1):
            fn(*_with_layer(args, layer), **kw)
    plan = _plan(pb)
    with as_cuda(arch) as planned:
        fn(*_with_layer(args, 0), plan=plan, **kw)
        with host_work() as work:
            fn(*_with_layer(args, 1), plan=plan, **kw)
    assert work.reads == [] and work.aten_reads == []
    if num_outputs is not None:
        assert len(work.allocations) == num_outputs + kw.get("return_lse", False), work.allocations
    assert planned.kernels == per_call.kernels and (planned.kernels or step == "empty")  # T = 0: no launch
    for a, b in zip(planned, per_call):
        assert a.key == b.key
        for name, value in b.values.items():
            for x, y in zip(tree_leaves(a.values[name]), tree_leaves(value), strict=True):
                if isinstance(y, torch.Tensor):
                    assert (x.shape, x.dtype) == (y.shape, y.dtype), name
                else:
                    assert x == y, name
    attention = [launch for launch in planned if "o_part" in launch.values]
    for first, second in zip(attention, attention[len(attention) // 2:]):
        assert first.values["o_part"] is second.values["o_part"]


# -- the reference, torch.compile, the block manager ------------------------------------------------------------------

@pytest.mark.parametrize("mla", [False, True])
def test_planned_calls_equal_per_call_ones_on_the_reference(mla, rng):
    kw = dict(num_heads=1, is_mla=True) if mla else dict(num_heads=2)
    pb, twin = (random_paged_batch([0, 37, 5, 9], [5, 1, 0, 3], head_size=16, page_size=16,
                                   generator=torch.Generator().manual_seed(0), **kw) for _ in range(2))
    plan = _plan(pb, num_q_heads=4)
    k = torch.randn(9, pb.collection.num_heads, 16, generator=rng).to(pb.collection.dtype)
    v = None if mla else k.flip(0)
    q = torch.randn(9, 4, 16, generator=rng).to(pb.collection.dtype)
    attn = dict(mla_v_dim=8) if mla else dict(window=7)
    for layer in (0, 1):
        cute_kv.store_kv(k, v, pb.input_row_offsets, pb.collection, layer, plan=plan)
        cute_kv.store_kv(k, v, twin.input_row_offsets, twin.collection, layer)
        out, lse = cute_kv.paged_attention(q, pb.input_row_offsets, pb.collection, layer, plan=plan,
                                           return_lse=True, **attn)
        want, want_lse = ref.paged_attention(q, twin.input_row_offsets, twin.collection, layer, return_lse=True,
                                             **attn)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
    assert torch.equal(pb.collection.blocks, twin.collection.blocks)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_planned_layer_compiles_fullgraph(rng):
    pb, twin = (random_paged_batch([0, 37, 5, 9], [5, 1, 0, 3], num_heads=2, head_size=16, page_size=16,
                                   generator=torch.Generator().manual_seed(0)) for _ in range(2))
    c, ro = pb.collection, pb.input_row_offsets
    plan = _plan(pb)

    def layer(k, v, q):
        cute_kv.store_kv(k, v, ro, c, 1, plan=plan)
        return cute_kv.paged_attention(q, ro, c, 1, plan=plan)

    k = torch.randn(9, 2, 16, generator=rng).to(c.dtype)
    q = torch.randn(9, 4, 16, generator=rng).to(c.dtype)
    out = torch.compile(layer, fullgraph=True)(k, k, q)
    cute_kv.store_kv(k, k, twin.input_row_offsets, twin.collection, 1)
    assert torch.equal(c.blocks, twin.collection.blocks)
    assert torch.equal(out, ref.paged_attention(q, twin.input_row_offsets, twin.collection, 1))


def test_the_managers_step_plans_without_reading():
    params = cute_kv.KVCacheParams(torch.bfloat16, n_kv_heads=2, head_dim=16, page_size=16, total_num_layers=2)
    mgr = cute_kv.PagedKVCacheManager(params, 16)
    for rid in range(3):
        mgr.claim(rid)
    step = mgr.allocate([0, 1, 2], [5, 17, 1])
    with host_work() as work:
        plan = step.plan(num_q_heads=4)
    assert work.reads == [] and work.aten_reads == []
    assert (plan.num_tokens, plan.batch_size) == (23, 3)
    k = torch.zeros(23, 2, 16, dtype=torch.bfloat16)
    cute_kv.store_kv(k, k, step.input_row_offsets[0], step.collections[0], 0, plan=plan)
    mgr.commit()
    with pytest.raises(ValueError, match="committed or released"):
        cute_kv.store_kv(k, k, step.input_row_offsets[0], step.collections[0], 0, plan=plan)


def test_the_plan_checks_rope_positions_from_its_one_read(rng):
    # Request 2 runs no token: its 50 cached positions need no rope row.
    pb, twin = (random_paged_batch([0, 37, 50, 9], [5, 1, 0, 3], num_heads=2, head_size=16, page_size=16,
                                   generator=torch.Generator().manual_seed(0)) for _ in range(2))
    plan = _plan(pb)
    assert plan.positions_end == 38
    hidden = torch.randn(9, 32, generator=rng).to(torch.bfloat16)
    weight = torch.randn(4 * 16 + 2 * 2 * 16, 32, generator=rng).to(torch.bfloat16)
    short = cute_kv.RopeConfig.from_theta(16, 37)
    with pytest.raises(ValueError, match="reaches position 37"):
        cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=short)
    with pytest.raises(ValueError, match="freqs_cis has 37 positions but the step reaches position 37"):
        cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=short,
                                          plan=plan)
    rope = cute_kv.RopeConfig.from_theta(16, 38)
    q = cute_kv.fused_qkv_matmul_kv_cache(hidden, pb.input_row_offsets, weight, pb.collection, 0, rope=rope,
                                          plan=plan)
    want = cute_kv.fused_qkv_matmul_kv_cache(hidden, twin.input_row_offsets, weight, twin.collection, 0, rope=rope)
    assert torch.equal(q, want) and torch.equal(pb.collection.blocks, twin.collection.blocks)
