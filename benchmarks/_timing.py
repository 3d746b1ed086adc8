"""What the benchmark scripts share: medians of repeated timeit runs in one process, peak memory, and the
Llama-2-7B configuration (keyword arguments of ``transformers.LlamaConfig``).

Times are the CPU time of the measuring thread (``time.thread_time``), not the wall clock: on a machine that other
processes keep busy, the time this process spends waiting for a core does not count. What they do to the caches
it shares with them still does; :func:`paired_ns` puts a measurement and its baseline under the same conditions by
alternating their runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import statistics
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def median_ns(fn: Callable[[], object], number: int, repeat: int = 9) -> float:
    """Median time of one call of ``fn`` in nanoseconds, over ``repeat`` runs of ``number`` calls."""
    fn()  # warm up
    runs = timeit.Timer(fn, timer=time.thread_time).repeat(number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e9


def paired_ns(
    fn: Callable[[], object], baseline: Callable[[], object], number: int, repeat: int = 21
) -> tuple[float, float]:
    """Median times of one call of ``fn`` and of ``baseline`` in nanoseconds, their runs of ``number`` calls
    alternating ``repeat`` times."""
    fn()
    baseline()
    timers = timeit.Timer(fn, timer=time.thread_time), timeit.Timer(baseline, timer=time.thread_time)
    runs: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for timer, times in zip(timers, runs, strict=True):
            times.append(timer.timeit(number))
    return statistics.median(runs[0]) / number * 1e9, statistics.median(runs[1]) / number * 1e9


def report(label: str, measured: float, baseline: float, target: float | None = None) -> None:
    ratio = measured / baseline
    verdict = "" if target is None else ("  within target" if ratio <= target else f"  ABOVE target {target}x")
    print(f"{label:<58} {measured:>12,.0f} ns vs {baseline:>12,.0f} ns  = {ratio:5.2f}x{verdict}")


LLAMA_2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
}


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere nothing).

    Without it, a run that follows another reuses the pages the first freed, which the kernel no longer has to
    fault in: eager construction of a 300M-parameter model took 1.0 s so, against 1.33 to 1.47 s on fresh memory,
    as in a process that has just started; which of the two a best-of-3 got was chance. Trimmed before every
    measured run, a baseline and the run it is compared with both start from fresh memory, as they would in a job.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _glibc() if sys.platform.startswith("linux") else None


def peak_mib() -> float:
    """The process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@contextlib.contextmanager
def collected() -> Iterator[None]:
    """Collect garbage, then keep the collector off for the block, as ``timeit`` does: a collection of the
    benchmark's own garbage does not land inside a measured run. Then hand the memory freed so far back to the
    system (:func:`trim_heap`), so that a measured run starts as in a process of its own."""
    gc.collect()
    trim_heap()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def wall_s(fn: Callable[[], T]) -> tuple[float, T]:
    """Wall-clock seconds of one call of ``fn``, and its result. The wall clock, not the thread's CPU time: for work
    spread over several threads, which :func:`median_ns` would undercount."""
    with collected():
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result


def resident_kib(field: str) -> int:
    """A memory figure of this process from ``/proc/self/status`` (``VmRSS``, ``VmHWM``), in KiB; 0 off Linux."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak() -> int:
    """Start measuring the peak of the resident set (``VmHWM``) from now (Linux); return the resident set's size
    in KiB. Where the mark cannot be reset, the peak since the process began stands in."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return resident_kib("VmRSS")
