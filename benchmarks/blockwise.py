"""Deferred initialization materialized block by block, the way FSDP2 flows do, against eager construction.

Run with ``python benchmarks/blockwise.py`` (needs ``transformers``, but for ``--growth``). For transformers'
``LlamaForCausalLM`` (hidden 512, 8 layers; ``post_init`` redraws every weight after construction) and a
plain-torch decoder of the same shape, it prints the time of materializing every decoder block, then the rest, in
construction order and in reverse order, and of one full ``materialize_module``, each as a ratio against eager
construction with the same seed, measured alternately in the same process; and the most memory that remembered
generator states took.
Every materialized model is checked to equal the eager one, bit for bit.

Then, at two sizes of a model of many small blocks, how the cost grows with the model (issue 34): an
initialization applied to a deferred model (``model.apply(init)``, ``normal_`` and ``uniform_`` per layer of
``Sequential(Linear(4, 4) x N)``) against the same on an eager model, and block by block materialization of
``N`` blocks of ``Linear(16, 64)`` and ``Linear(64, 16)`` in both shapes users write (``materialize_module(block)``
per block; ``materialize_module(model, check_fn=...)`` per block, torchdistx's and FSDP1's rule), then the rest,
against eager construction. A ratio that stays flat from the smaller size to the larger one is a cost linear in
the model. ``python benchmarks/blockwise.py --growth`` runs only these.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from _timing import collected
from torch import nn

from modattrs._deferred.materialize import roots
from modattrs._deferred.rng import generator
from modattrs.deferred import deferred_init, materialize_module

LLAMA = {  # keyword arguments of transformers' LlamaConfig
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
}
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
    from transformers import LlamaConfig, LlamaForCausalLM  # imported here: --growth runs without it

    return LlamaForCausalLM(LlamaConfig(**LLAMA))


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


# --- how the cost grows with the model --------------------------------------------------------------------------------


def cpu_seconds(fn: Callable[[], object]) -> float:
    """The CPU time of this thread for one call of ``fn`` (waiting for a core on a busy machine does not count),
    from a collected heap."""
    with collected():
        start = time.thread_time()
        fn()
        return time.thread_time() - start


def linears(depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(depth)))


def initialize(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight)
        nn.init.uniform_(module.bias)


def initialization_runs(depth: int, repeats: int) -> str:
    """``model.apply(initialize)`` on a deferred model against the same on an eager one, alternately."""
    eager_times, deferred_times = [], []
    for _ in range(repeats):
        torch.manual_seed(0)
        eager = linears(depth)
        eager_times.append(cpu_seconds(lambda eager=eager: eager.apply(initialize)))  # type: ignore[misc]
        after_eager = torch.get_rng_state()
        torch.manual_seed(0)
        model = deferred_init(linears, depth)
        deferred_times.append(cpu_seconds(lambda model=model: model.apply(initialize)))  # type: ignore[misc]
        if not torch.equal(torch.get_rng_state(), after_eager):
            raise AssertionError("the generator is not where eager initialization leaves it")
    eager_s, deferred_s = statistics.median(eager_times), statistics.median(deferred_times)
    return (
        f"  {depth:>4} layers: deferred {deferred_s:7.3f} s, eager {eager_s:7.4f} s = {deferred_s / eager_s:6.1f}x, "
        f"{deferred_s / depth * 1e3:.2f} ms a layer"
    )


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)


def pairs(depth: int) -> nn.Module:
    return nn.Sequential(*(Pair() for _ in range(depth)))


def each_block(model: nn.Module) -> None:
    for block in model:
        materialize_module(block)
    materialize_module(model)


def each_block_by_check_fn(model: nn.Module) -> None:
    for block in model:
        members = set(block.modules())
        materialize_module(model, check_fn=members.__contains__)
    materialize_module(model)


SHAPES: dict[str, Callable[[nn.Module], None]] = {
    "materialize_module(block)": each_block,
    "materialize_module(model, check_fn=...)": each_block_by_check_fn,
}


def block_runs(depth: int, repeats: int) -> Iterator[str]:
    """Block by block materialization, in each shape, against eager construction, alternately."""
    torch.manual_seed(0)
    expected = pairs(depth)
    eager_times: list[float] = []
    shape_times: dict[str, list[float]] = {name: [] for name in SHAPES}
    for _ in range(repeats):
        torch.manual_seed(0)
        eager_times.append(cpu_seconds(lambda: pairs(depth)))
        for name, shape in SHAPES.items():
            torch.manual_seed(0)
            model = deferred_init(pairs, depth)
            shape_times[name].append(cpu_seconds(lambda shape=shape, model=model: shape(model)))  # type: ignore[misc]
            check_equal(model, expected)
    eager = statistics.median(eager_times)
    yield f"  {depth:>4} blocks: eager construction {eager:.4f} s"
    for name, times in shape_times.items():
        seconds = statistics.median(times)
        yield f"    {name:<42} {seconds:7.3f} s = {seconds / eager:6.1f}x, {seconds / depth * 1e3:.2f} ms a block"


def growth(repeats: int) -> None:
    print("model.apply(init) on a deferred Sequential(Linear(4, 4) x N), against the same on an eager one")
    for depth in (150, 600):
        print(initialization_runs(depth, repeats))
    print("block by block: N blocks of Linear(16, 64) + Linear(64, 16), then the rest, against eager construction")
    for depth in (150, 400):
        for line in block_runs(depth, repeats):
            print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--growth", action="store_true", help="only how the cost grows with the model")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each growth measurement (median)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    if not arguments.growth:
        for label, build in (("LlamaForCausalLM, hidden 512, 8 layers", llama), ("plain-torch decoder", Decoder)):
            print(label)
            for line in runs(build, repeats=5):
                print(line)
    growth(arguments.repeats)


if __name__ == "__main__":
    main()
