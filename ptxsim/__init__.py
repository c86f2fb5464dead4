"""ptxsim: a functional simulator of the PTX that CuTe DSL kernels compile to (sm_90a, sm_100a, sm_103a), for running
kernels on a machine without a GPU.

A launch (``capture.capturing`` records the real ones: the compiled host function's grid, cluster, shared memory and
parameter bytes, TMA descriptors included) executes over host memory: ``simulate(launch, reads=..., writes=...)``
names the tensors the kernel may read and write; anything else it touches is an error. Instructions follow the PTX
ISA (each implementation cites its section); hazards the ISA leaves undefined (races on asynchronous copies and MMAs,
missing fences, broken barrier counts, deadlocks) are errors with the evidence. ``seed`` picks the schedule.
"""

from __future__ import annotations

from .errors import Deadlock, Hazard, MemoryFault, SimError, Unsupported
from .machine import LaunchSpec, Simulator
from .memory import GlobalMemory

__all__ = ["simulate", "LaunchSpec", "Simulator", "GlobalMemory", "SimError", "Hazard", "Deadlock", "MemoryFault",
           "Unsupported"]


def simulate(launch, reads: dict = (), writes: dict = (), seed: int = 0, **options) -> dict:
    """Run ``launch`` (a ``capture.Launch`` or a ``LaunchSpec``) to completion. ``reads`` / ``writes``: name ->
    torch CPU tensor the kernel may read / read and write. Returns statistics (instructions, seconds, rate)."""
    gmem = GlobalMemory()
    for name, t in dict(writes).items():
        gmem.add_tensor(t, name, writable=True)
    for name, t in dict(reads).items():
        gmem.add_tensor(t, name, writable=False)
    spec = LaunchSpec(launch.ptx, launch.kernel, tuple(launch.grid), tuple(launch.block), tuple(launch.cluster),
                      launch.dyn_smem, list(launch.params))
    sim = Simulator(spec, gmem, seed, **options)
    return sim.run()
