"""What the simulator reports. Every error carries the evidence that proves it (threads, PTX line, address, state)."""

from __future__ import annotations


class SimError(Exception):
    """A launch the simulator refuses to continue: a hazard, a deadlock, an access out of bounds, or PTX it does not
    implement. ``str()`` is the whole report."""


class Unsupported(SimError):
    """PTX the simulator does not implement (an instruction, a modifier or an operand form)."""


class MemoryFault(SimError):
    """A global, shared, param or local access outside what the launch may touch, or misaligned."""


class Hazard(SimError):
    """A race or ordering bug the ISA leaves undefined: a read of poison or of an async destination before its
    completion was observed, a write under an in-flight MMA, an mbarrier count broken, a register budget broken."""


class Deadlock(SimError):
    """Every live thread waits and no asynchronous operation is left to complete."""
