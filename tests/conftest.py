"""Markers: ``compile`` (CuTe DSL compiles with fake tensors, no GPU), ``sass`` (ptxas / nvdisasm gate, no GPU;
skipped without the tools) and ``gpu`` (skipped without CUDA)."""

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


def pytest_collection_modifyitems(config, items):
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
