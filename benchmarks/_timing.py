"""Timing helpers shared by the benchmark scripts: medians of repeated timeit runs, in one process."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable


def median_ns(fn: Callable[[], object], number: int, repeat: int = 9) -> float:
    """Median time of one call of ``fn`` in nanoseconds, over ``repeat`` runs of ``number`` calls."""
    fn()  # warm up
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e9


def report(label: str, measured: float, baseline: float, target: float | None = None) -> None:
    ratio = measured / baseline
    verdict = "" if target is None else ("  within target" if ratio <= target else f"  ABOVE target {target}x")
    print(f"{label:<58} {measured:>12,.0f} ns vs {baseline:>12,.0f} ns  = {ratio:5.2f}x{verdict}")
