"""Deferred initialization: recording a Llama-2-7B-shaped model, and replaying a smaller one against eager.

Run with ``python benchmarks/deferred.py`` (needs ``transformers``). Prints:

* the time ``deferred_init`` takes to record the 7B configuration, and the peak memory it adds to the process
  (after a first, small recording has imported everything);
* the time ``materialize_module`` takes to replay a Llama of 150M parameters on the CPU, as a ratio against
  constructing the same model eagerly, measured alternately in the same process.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable

import torch
from _timing import LLAMA_2_7B, peak_mib
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs.deferred import deferred_init, materialize_module

LLAMA_7B = LlamaConfig(**LLAMA_2_7B)
LLAMA_150M = LlamaConfig(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
)


def seconds(fn: Callable[[], object]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    deferred_init(LlamaForCausalLM, LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1))
    before = peak_mib()
    record = seconds(lambda: deferred_init(LlamaForCausalLM, LLAMA_7B))
    added = peak_mib() - before
    records = [record] + [seconds(lambda: deferred_init(LlamaForCausalLM, LLAMA_7B)) for _ in range(4)]
    print(f"record Llama-2-7B: {statistics.median(records):.3f} s (target: under 1 s)")
    print(f"peak memory added by recording it: {added:.1f} MiB (target: under 100 MiB)")

    eager_times, replay_times = [], []
    for _ in range(5):  # alternate, so that both see the same state of the allocator and the machine
        torch.manual_seed(0)
        eager_times.append(seconds(lambda: LlamaForCausalLM(LLAMA_150M)))
        torch.manual_seed(0)
        replay_times.append(seconds(functools.partial(materialize_module, deferred_init(LlamaForCausalLM, LLAMA_150M))))
    eager, replay = statistics.median(eager_times), statistics.median(replay_times)
    verdict = "within target" if replay / eager <= 1.1 else "ABOVE target 1.1x"
    print(f"replay Llama 150M on the CPU: {replay:.3f} s vs eager {eager:.3f} s = {replay / eager:.2f}x  {verdict}")


if __name__ == "__main__":
    main()
