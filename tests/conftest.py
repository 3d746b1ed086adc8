"""Hypothesis profiles: registered here so that ``--hypothesis-profile long`` can name one at start-up.

``ci`` is what ``tests/test_composition.py`` runs by default; ``long`` is for a long exploring run of it.

The ``value_reader`` fixture runs a test with each implementation of ``VirtualTensor.value``'s reads; the
``one_torch_thread`` fixture runs it with torch on one intra-op thread.
"""

from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

import modattrs
import modattrs.virtual

settings.register_profile("ci", max_examples=200, stateful_step_count=25, deadline=None)
settings.register_profile("long", max_examples=5000, stateful_step_count=60, deadline=None)


@pytest.fixture(params=["compiled", "python"])
def value_reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with each reader of ``VirtualTensor.value``: the compiled hot path (``modattrs._speedups``) and
    the Python one it must agree with."""
    if request.param == "python":
        monkeypatch.setattr(modattrs.virtual, "_read", modattrs.VirtualTensor._read)
    elif modattrs.virtual._speedups is None:
        pytest.skip("modattrs._speedups is not built in this install (test_compiled_read.py says why)")
    return str(request.param)


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op thread count at 1 for the test, then as it was: random kernels draw serially anyway, and on
    a shared machine threads cost small tensors more than they give."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
