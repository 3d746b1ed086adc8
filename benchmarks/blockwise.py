"""Deferred initialization materialized block by block, the way FSDP2 flows do, against eager construction.

Run with ``python benchmarks/blockwise.py`` (needs ``transformers``). For transformers' ``LlamaForCausalLM``
(hidden 512, 8 layers; ``post_init`` redraws every weight after construction) and a plain-torch decoder of the
same shape, it prints the time of materializing every decoder block, then the rest, in construction order and in
reverse order, and of one full ``materialize_module``, each as a ratio against eager construction with the same
seed, measured alternately in the same process; and the most memory that remembered generator states took.
Every materialized model is checked to equal the eager one, bit for bit.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs._deferred import generator
from modattrs._deferred.materialize import roots
from modattrs.deferred import deferred_init, materialize_module

LLAMA = LlamaConfig(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
)
TARGETS = {"in order": 1.3, "reverse order": 2.0, "whole model": 1.1}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 8, batch_first=True)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)


class Decoder(nn.Module):
    """A plain-torch decoder: every weight drawn once, at construction, by torch's own initializers."""

    def __init__(self, width: int = 512, depth: int = 8, vocabulary: int = 32000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocabulary, bias=False)


def llama() -> nn.Module:
    return LlamaForCausalLM(LLAMA)


def blocks(model: nn.Module) -> list[nn.Module]:
    inner = getattr(model, "model", model)
    return list(inner.layers)


def blockwise(order: Callable[[list[nn.Module]], list[nn.Module]]) -> Callable[[nn.Module], None]:
    def materialize(model: nn.Module) -> None:
        for block in order(blocks(model)):
            materialize_module(block)
        materialize_module(model)

    return materialize


FLOWS: dict[str, Callable[[nn.Module], None]] = {
    "in order": blockwise(lambda layers: layers),
    "reverse order": blockwise(lambda layers: layers[::-1]),
    "whole model": materialize_module,
}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def remembered_peak(flow: Callable[[nn.Module], None], model: nn.Module) -> int:
    """The most memory remembered generator states took at any point of ``flow``."""
    record = roots[model].record
    peak = 0
    original = generator.Walk.finish

    def finish(walk: generator.Walk) -> None:
        nonlocal peak
        original(walk)
        peak = max(peak, generator.remembered_bytes(record))

    generator.Walk.finish = finish  # type: ignore[method-assign]
    try:
        flow(model)
    finally:
        generator.Walk.finish = original  # type: ignore[method-assign]
    return peak


def check_equal(model: nn.Module, eager: nn.Module) -> None:
    for (name, real), (_, expected) in zip(model.state_dict().items(), eager.state_dict().items(), strict=True):
        if not torch.equal(real, expected):
            raise AssertionError(f"{name} differs from eager construction")


def runs(build: Callable[[], nn.Module], repeats: int) -> Iterator[str]:
    torch.manual_seed(0)
    eager_model = build()
    eager_times: list[float] = []
    flow_times: dict[str, list[float]] = {name: [] for name in FLOWS}
    for _ in range(repeats):  # alternate, so that all see the same state of the allocator and the machine
        torch.manual_seed(0)
        eager_times.append(timed(build)[0])
        for name, flow in FLOWS.items():
            torch.manual_seed(0)
            model = deferred_init(build)
            seconds, _ = timed(lambda flow=flow, model=model: flow(model))  # type: ignore[misc]
            flow_times[name].append(seconds)
            check_equal(model, eager_model)
    eager = statistics.median(eager_times)
    yield f"  eager construction: {eager:.3f} s"
    for name, times in flow_times.items():
        ratio = statistics.median(times) / eager
        verdict = "within target" if ratio <= TARGETS[name] else f"ABOVE target {TARGETS[name]}x"
        yield f"  {name:<14} {statistics.median(times):.3f} s = {ratio:5.2f}x eager  {verdict}"
    for name in ("in order", "reverse order"):
        torch.manual_seed(0)
        peak = remembered_peak(FLOWS[name], deferred_init(build))
        yield f"  remembered generator states, {name}: at most {peak / 1024:.0f} KiB"


def main() -> None:
    torch.set_num_threads(1)
    for label, build in (("LlamaForCausalLM, hidden 512, 8 layers", llama), ("plain-torch decoder", Decoder)):
        print(label)
        for line in runs(build, repeats=5):
            print(line)


if __name__ == "__main__":
    main()
