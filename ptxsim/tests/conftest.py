"""The CuTe DSL reads its target (``CUTE_DSL_ARCH``) once, when it is first built, which in a test run may be by a
test of the other arch: the layout tests evaluate sm_90a atoms, so each test module here starts from sm_90a and leaves the
DSL's setting as it found it (``capture.capturing`` sets its own arch for its block)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _dsl_target_sm90a():
    try:
        from cutlass.cutlass_dsl.cutlass import CuTeDSL
    except ImportError:
        yield
        return
    envar = CuTeDSL._get_dsl().envar
    saved = envar._arch
    envar.arch = "sm_90a"
    yield
    envar._arch = saved
