"""What the benchmark scripts share: medians of repeated timeit runs in one process, peak memory, and the
Llama-2-7B configuration (keyword arguments of ``transformers.LlamaConfig``)."""

from __future__ import annotations

import resource
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


LLAMA_2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
}


def peak_mib() -> float:
    """The process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
