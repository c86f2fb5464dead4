"""Peer kernels (FA4, quack) built on the CPU for real tensors: ``(compiled_fn, call_args)`` plus float64
references, for ptxsim to run. Not imported by ptxsim itself (they need torch, cutlass and the peers installed)."""

import contextlib
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
