"""Counting draws with torch's profiler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from modattrs._deferred.rng import kernels


@contextlib.contextmanager
def torchs_kernels_draw() -> Iterator[None]:
    """Every random fill drawn by torch's own kernel, which torch's profiler shows with its shapes: modattrs' own
    ``uniform_`` kernel is not an operator, so the profiler does not see what it draws (the same elements)."""
    with mock.patch.object(kernels, "_extension", None):
        yield
