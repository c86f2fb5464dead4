"""Markers: ``compile`` (CuTe DSL compiles with fake tensors, no GPU), ``sass`` (ptxas / nvdisasm gate, no GPU;
skipped without the tools) and ``gpu`` (skipped without CUDA; each with a timeout, see ``gpu_timeouts``)."""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

import artifacts
import host_builtins

host_builtins.provide()  # before any test runs kernel code on the host (GCC 12's libgcc_s lacks __truncsfbf2)

if not os.environ.get(artifacts.DIR_ENV):  # the first process of the run (xdist workers inherit the directory)
    os.environ[artifacts.DIR_ENV] = tempfile.mkdtemp(prefix="cute-kv-artifacts-")
    atexit.register(shutil.rmtree, os.environ[artifacts.DIR_ENV], ignore_errors=True)


GPU_TIMEOUT = 150  # seconds: a hung kernel fails its test, not the whole run


def gpu_timeouts(config, items) -> None:
    """``timeout(GPU_TIMEOUT)`` on each gpu test without a timeout of its own, unless the run sets one for every test
    (``--timeout``, ``PYTEST_TIMEOUT`` or the ``timeout`` ini); nothing where pytest-timeout is not installed."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    if config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout"):
        return
    for item in items:
        if "gpu" in item.keywords and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(GPU_TIMEOUT))


def pytest_collection_modifyitems(config, items):
    gpu_timeouts(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng():
    """A fresh, seeded generator per test: random inputs, never zeros, reproducible on failure."""
    return torch.Generator().manual_seed(0x5EED)
