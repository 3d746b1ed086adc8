"""A replay changes nothing process-wide: not torch's default dtype, not its intra-op thread count.

Both are global in torch: another thread building a model or running a matmul while a replay runs would see them.
The operations that read the default dtype (factories without ``dtype``, integer tensors promoted to a float by a
Python float or by a float operation) are given the recorded one instead, and give eager construction's bits.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from modattrs._deferred.rng import generator, mt19937
from modattrs.deferred import DeferredInitError, deferred_init, is_deferred, materialize_module, register_opaque_init
from tests.test_generator_jump import speedups_as


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def jumps_by(path: str) -> Iterator[None]:
    """Jumps by the C routines ("c") or by the torch path that runs without them ("torch")."""
    if path == "c" and mt19937._speedups is None:
        pytest.skip("modattrs._generator_jump is not built in this install")
    with speedups_as(mt19937._speedups if path == "c" else None):
        yield


class Mixed(nn.Module):
    """Built under a float64 default, with a stretch under bfloat16: factories without dtype, integer tensors
    promoted by Python floats and by float operations, and enough random weights for a replay to jump."""

    def __init__(self, width: int = 48, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.register_buffer("positions", torch.arange(16) / 16)  # int / int: true division
        self.register_buffer("scaled", torch.arange(12) * 1.1)  # int * Python float
        self.register_buffer("sines", torch.sin(torch.arange(8)))  # a float operation of an int tensor
        self.register_buffer("table", torch.full((5,), 0.1))
        self.register_buffer("steps", torch.arange(0.5, 3.0, 0.25))
        self.register_buffer("compared", torch.arange(4100) == 4097.0)  # compared in the default dtype
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        self.narrow = nn.Linear(32, 32)
        self.register_buffer("narrow_scaled", torch.arange(64) * 0.1)
        self.register_buffer("narrow_noise", torch.randn(40))
        torch.set_default_dtype(previous)
        self.head = nn.Linear(width, 3)


def eager_and_deferred(build: Callable[[], nn.Module], dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    with default_dtype(dtype):
        torch.manual_seed(0)
        expected = build()
        torch.manual_seed(0)
        deferred = deferred_init(build)
    return expected, deferred


def assert_same_bits(actual: nn.Module, expected: nn.Module) -> None:
    wanted = expected.state_dict()
    for name, tensor in actual.state_dict().items():
        assert tensor.dtype == wanted[name].dtype, name
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), wanted[name].reshape(-1).view(torch.uint8)), name


class Spies:
    """Calls of ``torch.set_default_dtype`` and ``torch.set_num_threads`` made while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, Any]] = []
        for name in ("set_default_dtype", "set_num_threads"):
            original = getattr(torch, name)

            def spy(value: Any, *, _name: str = name, _original: Any = original) -> None:
                self.calls.append((_name, value))
                _original(value)

            monkeypatch.setattr(torch, name, spy)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_a_replay_sets_neither_the_default_dtype_nor_the_thread_count(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected, model = eager_and_deferred(Mixed, torch.float64)
    assert isinstance(model, Mixed)
    spies = Spies(monkeypatch)
    with jumps_by(path):
        materialize_module(model.blocks[3])  # jumps over the draws of the blocks before
        materialize_module(model.narrow)
        materialize_module(model)
    assert spies.calls == []
    assert_same_bits(model, expected)


@pytest.mark.parametrize("path", ["c", "torch"])
def test_another_thread_keeps_its_default_dtype_thread_count_and_values_while_a_replay_runs(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other thread samples torch's state in a loop, and once more at a point that is surely inside the replay:
    when the replay's first jump begins (a handshake, not timing)."""
    expected, model = eager_and_deferred(Mixed, torch.float64)
    assert isinstance(model, Mixed)
    threads = torch.get_num_threads()
    inputs = torch.randn(64, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    product = inputs @ inputs
    replay_done = threading.Event()
    sample_now, sampled = threading.Event(), threading.Event()
    seen: list[tuple[torch.dtype, torch.dtype, int, bool]] = []

    def sample() -> None:
        built = nn.Linear(4, 4, device="meta")  # a model built: its factories take the default dtype
        made = torch.ones(3)
        seen.append((built.weight.dtype, made.dtype, torch.get_num_threads(), torch.equal(inputs @ inputs, product)))

    def other_thread() -> None:
        while not replay_done.is_set():
            sample()
            if sample_now.is_set() and not sampled.is_set():
                sample()
                sampled.set()

    jumped_state = generator.jumped_state

    def jump_after_a_sample(state: torch.Tensor, outputs: int) -> torch.Tensor:
        if not sampled.is_set():
            sample_now.set()
            assert sampled.wait(timeout=60)
        return jumped_state(state, outputs)

    monkeypatch.setattr(generator, "jumped_state", jump_after_a_sample)
    worker = threading.Thread(target=other_thread)
    with jumps_by(path):
        worker.start()
        try:
            materialize_module(model.blocks[3])
            materialize_module(model)
        finally:
            replay_done.set()
            sampled.set()
            worker.join()
    assert sample_now.is_set()  # the replay jumped, and the other thread sampled then
    assert seen
    assert all(sample == (torch.float32, torch.float32, threads, True) for sample in seen)
    assert_same_bits(model, expected)


# --- the operations that read the default dtype, replayed under another one ----------------------------------------


def integer_promotions() -> dict[str, torch.Tensor]:
    """Each way an operation reads the default dtype: as ``deferred_init`` records it (factories and operations on
    the integer tensors that factories made)."""
    counts = torch.arange(-7, 160_000, 37)  # past 2048 and 65504 (float16 rounds, overflows); no constant
    flags = counts % 2 == 0
    return {
        "zeros": torch.zeros(3),
        "empty_strided": torch.empty_strided((2, 3), (1, 2)).fill_(1.5),
        "full": torch.full((4,), 0.1),
        "full_int": torch.full((4,), 7),
        "scalar_tensor": torch.scalar_tensor(3),
        "arange_float": torch.arange(0.1, 2.0, 0.3),
        "arange_int": torch.arange(5),
        "linspace": torch.linspace(0, 1, 7),
        "linspace_of_tensors": torch.linspace(torch.tensor(0.25), torch.tensor(1.0), 7),
        "eye": torch.eye(3),
        "rand": torch.rand(20),
        "randn": torch.randn(33),
        "normal": torch.normal(0.5, 2.0, (19,)),
        "times_float": counts * 1.1,
        "plus_float": counts + 0.3,
        "float_minus": 0.7 - counts,
        "divided_int": counts / 7,
        "divided_tensors": counts / (counts.abs() + 1),
        "sine": torch.sin(counts),
        "exp": torch.exp(counts / 1000),
        "root": counts.abs().pow(0.5),
        "power_of": 1.01**counts,
        "clamped": counts.clamp(min=0.5),
        "equal": counts == 1.1,
        "equal_rounded": counts == 2064.0,  # 2065 is 2064 in float16: compared in the default dtype
        "less": counts < 300.7,
        "flags_times": flags * 2.5,
        "where": torch.where(flags, counts, 0.1),
        "filled": counts.masked_fill(flags, 1.5),  # stays an integer tensor
    }


class Promotions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, tensor in integer_promotions().items():
            self.register_buffer(name, tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_operations_that_read_the_default_dtype_replay_eagers_bits_under_another_default(dtype: torch.dtype) -> None:
    expected, model = eager_and_deferred(Promotions, dtype)
    other = torch.float64 if dtype != torch.float64 else torch.float16
    with default_dtype(other):
        materialize_module(model)
    assert_same_bits(model, expected)
    assert expected.zeros.dtype == dtype  # the default was read


def rotated() -> nn.Module:
    module = nn.Module()
    module.register_buffer("made", torch.arange(6) * 1j)  # the default complex dtype: complex64 under bfloat16
    return module


def sines_into_a_given_tensor() -> nn.Module:
    module = nn.Module()
    module.register_buffer("made", torch.sin(torch.arange(6), out=torch.empty(6, dtype=torch.float64)))
    return module


@pytest.mark.parametrize(
    ("build", "name"), [(rotated, r"aten\.mul\.Tensor"), (sines_into_a_given_tensor, r"aten\.sin\.out")]
)
def test_an_operation_reading_the_default_dtype_in_a_way_that_cannot_be_passed_is_refused_naming_it(
    build: Callable[[], nn.Module], name: str
) -> None:
    """The operations the replay cannot hand the default dtype: integers promoted by a complex number under a
    bfloat16 default (to complex64), and integers computed in the default dtype into an ``out=`` tensor."""
    expected, model = eager_and_deferred(build, torch.bfloat16)
    with pytest.raises(DeferredInitError, match=name + r" computes in torch's default dtype"):
        materialize_module(model)
    assert model.made.dtype == expected.made.dtype
    assert is_deferred(model)
    with default_dtype(torch.bfloat16):  # under the default it was recorded with, it replays
        materialize_module(model)
    assert_same_bits(model, expected)


def scaled_normal(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.copy_(torch.randn(tensor.shape) * 0.5)  # randn without dtype: reads the default


def test_an_opaque_initializer_is_refused_under_another_default_dtype_and_runs_under_its_own() -> None:
    register_opaque_init(sys.modules[__name__], "scaled_normal")

    def build() -> nn.Module:
        layer = nn.Linear(4, 4)
        scaled_normal(layer.weight)
        return layer

    expected, model = eager_and_deferred(build, torch.float64)
    with pytest.raises(DeferredInitError, match="scaled_normal"):
        materialize_module(model)
    with default_dtype(torch.float64):
        materialize_module(model)
    assert_same_bits(model, expected)


def test_trunc_normal_replays_under_another_default_dtype() -> None:
    def build() -> nn.Module:
        layer = nn.Linear(64, 64)
        nn.init.trunc_normal_(layer.weight, std=1.0, a=-0.5, b=0.5)  # opaque: bounds within reach
        return layer

    expected, model = eager_and_deferred(build, torch.float64)
    materialize_module(model)
    assert_same_bits(model, expected)
