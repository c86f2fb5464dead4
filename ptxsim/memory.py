"""The state spaces a launch touches: global (host memory of registered tensors), shared (per CTA), param, local.

Generic addresses (PTX ISA 5.1.6 "Generic Addressing") map windows onto the other spaces. Global addresses are the
host's own (below 2^47 on x86-64); the shared, local and param windows sit far above them:

- ``SHARED_WINDOW + offset``: the executing CTA's shared memory (``cvta.shared``);
- ``LOCAL_WINDOW + offset``: the executing thread's local memory (``cvta.local``);
- ``PARAM_WINDOW + offset``: the kernel parameter buffer (``cvta.param``, PTX ISA 5.1.6.1, sm_70+).

Shared addresses (PTX ISA 5.1.3 "Shared State Space") carry the CTA's rank in its cluster above ``CLUSTER_SHIFT``
and the offset into its shared memory below: a CTA's shared::cta window lies inside the cluster's shared::cluster
window, so its own addresses are valid shared::cluster addresses, and a peer's differ in the rank (what ``mapa``
returns). Kernels rely on it: a 2-CTA Blackwell MMA names the leader's mbarrier by clearing the rank bit.
"""

from __future__ import annotations

import bisect
import ctypes
from typing import Optional

import numpy as np

from .errors import Hazard, MemoryFault

SHARED_WINDOW = 1 << 56
LOCAL_WINDOW = 2 << 56
PARAM_WINDOW = 3 << 56
WINDOW_MASK = (1 << 56) - 1
CLUSTER_SHIFT = 24


class Region:
    def __init__(self, base: int, size: int, name: str, writable: bool, array: Optional[np.ndarray] = None):
        self.base, self.size, self.name, self.writable = base, size, name, writable
        if array is None:
            array = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(base)) if size else np.zeros(0, np.uint8)
        self.view = array
        self.written = np.zeros(size, bool) if writable else None


class GlobalMemory:
    """Host memory the launch may touch: one region per tensor (its view's extent), named for error reports."""

    def __init__(self):
        self.regions: list[Region] = []
        self._bases: list[int] = []

    def add(self, base: int, size: int, name: str, writable: bool = True, array: Optional[np.ndarray] = None):
        for r in self.regions:
            if base < r.base + r.size and r.base < base + size:
                # views of one storage: widen the existing region instead of overlapping two
                if r.base <= base and base + size <= r.base + r.size:
                    r.writable = r.writable or writable
                    if r.writable and r.written is None:
                        r.written = np.zeros(r.size, bool)
                    return r
                raise ValueError(f"region {name} [{base:#x}, +{size}) overlaps {r.name}")
        reg = Region(base, size, name, writable, array)
        i = bisect.bisect(self._bases, base)
        self._bases.insert(i, base)
        self.regions.insert(i, reg)
        return reg

    def add_tensor(self, t, name: str, writable: bool = True) -> Region:
        """A torch CPU tensor: the bytes its view can reach (lowest to highest element)."""
        if t.numel() == 0:
            return None
        lo = sum(min(0, (s - 1) * st) for s, st in zip(t.shape, t.stride()))
        hi = sum(max(0, (s - 1) * st) for s, st in zip(t.shape, t.stride()))
        esize = t.element_size()
        return self.add(t.data_ptr() + lo * esize, (hi - lo + 1) * esize, name, writable)

    def _find(self, addrs: np.ndarray, nbytes: int, what: str, ctx) -> Region:
        lo = int(addrs.min())
        hi = int(addrs.max())
        i = bisect.bisect(self._bases, lo) - 1
        if i >= 0:
            r = self.regions[i]
            if lo >= r.base and hi + nbytes <= r.base + r.size:
                return r
        # slow path: per address, for the report
        for a in addrs.tolist():
            j = bisect.bisect(self._bases, a) - 1
            if j < 0 or not (a >= self.regions[j].base and a + nbytes <= self.regions[j].base + self.regions[j].size):
                raise MemoryFault(f"{what} of {nbytes} B at {a:#x} outside every tensor of the launch "
                                  f"(nearest: {self.nearest(a)}){ctx() if ctx else ''}")
        return None  # several regions: caller loops

    def nearest(self, addr: int) -> str:
        best = None
        for r in self.regions:
            d = 0 if r.base <= addr < r.base + r.size else min(abs(addr - r.base), abs(addr - (r.base + r.size - 1)))
            if best is None or d < best[0]:
                best = (d, r)
        if best is None:
            return "no tensors registered"
        d, r = best
        return f"{r.name} [{r.base:#x}, {r.base + r.size:#x}), {addr - r.base:+d} B from its start"

    def read(self, addrs: np.ndarray, nbytes: int, ctx=None) -> np.ndarray:
        """``(len(addrs), nbytes)`` uint8."""
        addrs = np.asarray(addrs, np.int64)
        r = self._find(addrs, nbytes, "global read", ctx)
        if r is None:
            return np.stack([self.read(np.array([a]), nbytes, ctx)[0] for a in addrs.tolist()])
        idx = (addrs - r.base)[:, None] + np.arange(nbytes)
        return r.view[idx]

    def write(self, addrs: np.ndarray, data: np.ndarray, ctx=None) -> None:
        addrs = np.asarray(addrs, np.int64)
        nbytes = data.shape[1]
        r = self._find(addrs, nbytes, "global write", ctx)
        if r is None:
            for k, a in enumerate(addrs.tolist()):
                self.write(np.array([a]), data[k:k + 1], ctx)
            return
        if not r.writable:
            raise MemoryFault(f"global write of {nbytes} B at {int(addrs[0]):#x} into {r.name}, which the launch may "
                              f"only read{ctx() if ctx else ''}")
        idx = (addrs - r.base)[:, None] + np.arange(nbytes)
        r.view[idx] = data
        r.written[idx] = True


class SharedMemory:
    """One CTA's shared memory with the state the hazard checks need, per byte:

    - ``written``: some write landed since the CTA began (a read of a byte never written reads poison);
    - ``inflight``: an asynchronous copy (TMA, cp.async) will write it and has not completed;
    - ``mma_reads``: an in-flight MMA reads it (writing it is a hazard);
    - ``dirty``: the global warp id + 1 of a generic-proxy write not yet followed by that warp's
      ``fence.proxy.async`` (an async-proxy read of it is a hazard), and the PTX line of that write.
    """

    def __init__(self, size: int, rng: np.random.Generator, completions: Optional[dict] = None):
        self.size = size
        self.completions = {} if completions is None else completions  # completion id -> describe()
        self.data = rng.integers(0, 256, size, dtype=np.uint8)  # poison: random bytes, never zeros
        self.written = np.zeros(size, bool)
        self.inflight = np.zeros(size, np.int16)
        self.mma_reads = np.zeros(size, np.int16)
        self.dirty = np.zeros(size, np.int32)
        self.dirty_line = np.zeros(size, np.int32)
        # bytes an asynchronous write landed in, and what a reader must have observed first: the completion id (an
        # mbarrier's, or a cp.async's) and the count of its phases that must have completed
        # generic writes: the writer (global warp id + 1) and the release epoch of the writer that publishes it (a
        # reader in another warp must have acquired that epoch: happens-before through a barrier)
        self.gen_writer = np.zeros(size, np.int32)
        self.gen_stamp = np.zeros(size, np.int32)
        self.gen_line = np.zeros(size, np.int32)
        self.mbar_bytes = np.zeros(size, bool)  # live mbarrier objects: only mbarrier operations may touch them
        self.land_id = np.zeros(size, np.int32)
        self.land_need = np.zeros(size, np.int32)
        self.mbarriers: dict = {}  # offset -> MBarrier
        self.strict_poison = True

    def check(self, idx: np.ndarray, what: str, ctx) -> None:
        if idx.size == 0:
            return
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self.size:
            bad = lo if lo < 0 else hi
            raise MemoryFault(f"{what} at shared offset {bad:#x} outside the CTA's {self.size} B of shared memory"
                              f"{ctx()}")

    def read(self, idx: np.ndarray, what: str, ctx, generic: bool = True, observed: Optional[dict] = None,
             reader: Optional[int] = None) -> np.ndarray:
        """``observed``: the reader's completion ids -> phases it has observed complete (its own waits, and what
        barriers it synchronized on carried to it); bytes an asynchronous write landed in need theirs. With
        ``reader`` (its global warp id), bytes another warp wrote need that warp's write released to the reader
        (PTX ISA 8 "Memory Consistency Model": a data race is undefined)."""
        self.check(idx, what, ctx)
        self.not_mbarrier(idx, what, ctx)
        if reader is not None and observed is not None:
            wr = self.gen_writer[idx]
            other = (wr != 0) & (wr != reader + 1)
            if other.any():
                stamps = self.gen_stamp[idx]
                for g in np.unique(wr[other]).tolist():
                    sel = other & (wr == g)
                    need = int(stamps[sel].max())
                    if observed.get(("warp", g - 1), -1) < need:
                        bad = idx[sel & (stamps == need)].ravel()[0]
                        raise Hazard(f"{what} of shared offset {int(bad):#x}, written by warp {g - 1} (PTX line "
                                     f"{int(self.gen_line[bad])}) with nothing ordering that write before this read "
                                     f"(no barrier both take part in after it, nor an mbarrier the writer arrives on "
                                     f"after it and the reader waits on): a data race{ctx()}")
        if self.inflight[idx].any():
            bad = idx[self.inflight[idx] > 0].ravel()[0]
            raise Hazard(f"{what} of shared offset {int(bad):#x}: an asynchronous copy into it has not completed "
                         f"(its mbarrier phase or wait_group was not observed){ctx()}")
        if observed is not None:
            ids = self.land_id[idx]
            if ids.any():
                need = self.land_need[idx]
                for cid in np.unique(ids[ids > 0]).tolist():
                    want = int(need[ids == cid].max())
                    if observed.get(cid, 0) < want:
                        bad = idx[ids == cid].ravel()[0]
                        raise Hazard(f"{what} of shared offset {int(bad):#x}: an asynchronous write landed there, but "
                                     f"the reader has not observed its completion ({self.describe(cid, want)}; "
                                     f"it observed {observed.get(cid, 0)} phase(s)): no wait on that barrier, or on "
                                     f"one ordered after it{ctx()}")
        if self.strict_poison and not self.written[idx].all():
            bad = idx[~self.written[idx]].ravel()[0]
            raise Hazard(f"{what} of shared offset {int(bad):#x}, which nothing wrote since the CTA began{ctx()}")
        if not generic:  # an async-proxy read: generic writes must be fenced (fence.proxy.async)
            d = self.dirty[idx]
            if d.any():
                k = np.flatnonzero(d.ravel())[0]
                bad = idx.ravel()[k]
                raise Hazard(f"{what} (async proxy) of shared offset {int(bad):#x} written by the generic proxy "
                             f"(warp {int(d.ravel()[k]) - 1}, PTX line {int(self.dirty_line[bad])}) with no "
                             f"fence.proxy.async after it{ctx()}")
        return self.data[idx]

    def write(self, idx: np.ndarray, data: np.ndarray, what: str, ctx, writer: int = -1, line: int = 0,
              stamp: int = 0) -> None:
        """``writer``: the global warp id for a generic-proxy write, -1 for the async proxy; ``stamp``: the writer's
        release epoch that will publish the write."""
        self.check(idx, what, ctx)
        self.not_mbarrier(idx, what, ctx)
        if self.mma_reads[idx].any():
            bad = idx[self.mma_reads[idx] > 0].ravel()[0]
            raise Hazard(f"{what} to shared offset {int(bad):#x}, which an in-flight MMA still reads (a stage "
                         f"released or reused before its wgmma/tcgen05 completed){ctx()}")
        if writer >= 0 and self.inflight[idx].any():
            bad = idx[self.inflight[idx] > 0].ravel()[0]
            raise Hazard(f"{what} to shared offset {int(bad):#x}, the destination of an asynchronous copy in "
                         f"flight{ctx()}")
        self.data[idx] = data
        self.written[idx] = True
        self.land_id[idx] = 0
        if writer >= 0:
            self.dirty[idx] = writer + 1
            self.dirty_line[idx] = line
            self.gen_writer[idx] = writer + 1
            self.gen_stamp[idx] = stamp
            self.gen_line[idx] = line
        else:
            self.dirty[idx] = 0
            self.gen_writer[idx] = 0

    def not_mbarrier(self, idx: np.ndarray, what: str, ctx) -> None:
        """PTX ISA 9.7.13.15: any non-mbarrier operation on an initialized mbarrier object is undefined."""
        if self.mbar_bytes[idx].any():
            bad = idx[self.mbar_bytes[idx]].ravel()[0]
            raise Hazard(f"{what} of shared offset {int(bad):#x}, inside a live mbarrier object (only mbarrier "
                         f"operations may touch it until mbarrier.inval){ctx()}")

    def describe(self, cid: int, need: int) -> str:
        d = self.completions.get(cid)
        return f"{d() if d else 'completion ' + str(cid)}, phase {need} needed"

    def landed(self, idx: np.ndarray, cid: int, need: int) -> None:
        """Bytes an asynchronous write just wrote: readers must have observed ``need`` phases of ``cid``."""
        self.land_id[idx] = cid
        self.land_need[idx] = need


def merge(into: dict, other: dict) -> None:
    """What ``other`` observed becomes observed by ``into`` (max per completion)."""
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v
