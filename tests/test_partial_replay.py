"""Materializing a deferred model piece by piece: the values of eager construction in any order, in linear time.

Replays remember the generator states they pass, and a draw whose result is overwritten whole before anything
reads it (a constructor's initialization that ``post_init`` redraws) runs only as a draw. The cost is counted in
calls of a registered opaque initializer, which every replay, real or only drawing, calls once per recorded call,
and in reads of recorded operations and visits of modules, which must grow with the model as the work does.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from modattrs import VirtualTensor
from modattrs._deferred.materialize import roots
from modattrs._deferred.record import Op
from modattrs._deferred.rng import generator
from modattrs.deferred import (
    deferred_init,
    is_deferred,
    materialize_module,
    materialize_tensor,
    register_opaque_init,
)
from modattrs.fake import is_fake

CALLS = {"count": 0}


def counted_normal_(tensor: Tensor, std: float = 0.02) -> Tensor:
    CALLS["count"] += 1
    with torch.no_grad():
        return tensor.normal_(0.0, std)


def counted_uniform_(tensor: Tensor) -> Tensor:
    CALLS["count"] += 1
    with torch.no_grad():
        return tensor.uniform_(-0.1, 0.1)


register_opaque_init(sys.modules[__name__], "counted_normal_")
register_opaque_init(sys.modules[__name__], "counted_uniform_")


class CountedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(counted_uniform_(torch.empty(width, width)))


class Redrawn(nn.Module):
    """Every weight drawn at construction, then drawn again by a post_init, as transformers' models do."""

    def __init__(self, depth: int, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Parameter(counted_uniform_(torch.empty(16, width)))
        self.blocks = nn.ModuleList(CountedBlock(width) for _ in range(depth))
        self.head = nn.Parameter(counted_uniform_(torch.empty(width, 16)))
        for parameter in self.parameters():
            counted_normal_(parameter)


def calls_to_materialize(depth: int, order: Callable[[list[nn.Module]], list[nn.Module]]) -> int:
    torch.manual_seed(0)
    eager = Redrawn(depth)
    torch.manual_seed(0)
    model = deferred_init(Redrawn, depth)
    CALLS["count"] = 0
    for block in order(list(model.blocks)):
        materialize_module(block)
    materialize_module(model)
    for (name, real), expected in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(real, expected), name
    return CALLS["count"]


@pytest.mark.parametrize(
    ("order", "most_per_draw"),
    [(lambda blocks: blocks, 1.5), (lambda blocks: blocks[::-1], 2.5)],
    ids=["construction-order", "reverse-order"],
)
def test_materializing_block_by_block_draws_each_number_a_bounded_number_of_times(
    order: Callable[[list[nn.Module]], list[nn.Module]], most_per_draw: float
) -> None:
    depth = 24
    draws = 2 * (depth + 2)  # each weight: once at construction, once in post_init
    calls = calls_to_materialize(depth, order)
    assert calls <= most_per_draw * draws, f"{calls} initializer calls for {draws} recorded ones"
    # and it stays so as the model grows: linear, not quadratic
    assert calls_to_materialize(2 * depth, order) <= 2.2 * calls


def test_a_whole_model_materialization_runs_each_draw_once_at_most() -> None:
    assert calls_to_materialize(12, lambda blocks: []) <= 2 * (12 + 2)


def test_remembered_generator_states_stay_few_as_the_model_grows_and_go_with_the_record() -> None:
    state_bytes = torch.get_rng_state().nbytes
    for depth in (8, 32):
        torch.manual_seed(0)
        model = deferred_init(Redrawn, depth)
        record = roots[model].record
        most = 0
        for block in model.blocks:
            materialize_module(block)
            most = max(most, generator.remembered_bytes(record))
        assert most <= 4 * state_bytes, f"depth {depth}: {most} bytes remembered"
        materialize_module(model)
        assert not is_deferred(model)
        gone = weakref.ref(record)
        del record
        gc.collect()
        assert gone() is None


# --- any order, any mix, same values ----------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.register_buffer("snapshot", self.up.weight.detach().clone())  # the constructor's draw, read before
        packed = torch.empty(2 * width, width)  # the post_init below draws over it
        self.q = nn.Parameter(packed[:width])
        self.k = nn.Parameter(packed[width:])
        nn.init.normal_(packed)
        self.flipped = nn.Parameter(torch.empty(2 * width, width).t_())  # its layout comes from an in-place op


class Mixed(nn.Module):
    """Draws overwritten whole, in part, through views and transposes; a buffer copied from a weight before it is
    redrawn; a reseed inside a fork; tied weights."""

    def __init__(self, depth: int = 3, width: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10, bias=False)
        self.head.weight = self.embed.weight
        with torch.random.fork_rng():
            torch.manual_seed(7)
            self.forked = nn.Parameter(torch.randn(3))
        for name, parameter in self.named_parameters():
            if parameter.dim() == 2 and not name.endswith((".q", ".k")):
                nn.init.normal_(parameter, std=0.02)  # post_init: the constructor's draws are dead
        with torch.no_grad():
            self.blocks[0].down.weight.narrow(0, 0, 2).normal_()  # part of a weight: the rest stays as drawn
            self.blocks[-1].up.bias.zero_()


Step = tuple[str, int]


def apply(model: Mixed, step: Step) -> None:
    kind, index = step
    block = model.blocks[index % len(model.blocks)]
    if kind == "block":
        materialize_module(block)
    elif kind == "buffers":
        materialize_module(block, buffers_only=True)
    elif kind == "tensor":
        tensors = list(block.state_dict(keep_vars=True).values())
        materialize_tensor(tensors[index % len(tensors)])
    elif kind == "embed":
        materialize_module(model.embed)
    else:
        materialize_module(model, check_fn=lambda module: module is model)


steps = st.lists(
    st.tuples(st.sampled_from(["block", "buffers", "tensor", "embed", "root"]), st.integers(0, 20)), max_size=12
)


@functools.cache
def eager_mixed() -> tuple[dict[str, Tensor], Tensor]:
    torch.manual_seed(0)
    model = Mixed()
    torch.rand(5)  # what the test draws between deferred_init and materializing
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, torch.get_rng_state()


@given(steps=steps)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_materializing_in_any_order_and_mix_gives_the_eager_values_and_generator(steps: list[Step]) -> None:
    expected, state_after_eager = eager_mixed()
    torch.manual_seed(0)
    model = deferred_init(Mixed)
    torch.rand(5)  # draws in between come after the model's, as in eager code, and change none of its values
    state_before = torch.get_rng_state()
    for step in steps:
        apply(model, step)
        assert torch.equal(torch.get_rng_state(), state_before)
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not is_fake(tensor):
                assert torch.equal(tensor, expected[name]), f"{name} after {step}"
    materialize_module(model)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert model.head.weight is model.embed.weight
    assert torch.equal(torch.get_rng_state(), state_after_eager)


# --- work that stays linear in the model's size -------------------------------------------------------------------
# Counted, not timed: how many times an operation of a record is looked at (any read of a recorded Op's fields), and
# how many modules walks of the module tree visit. A cost that grows with the model at every block or every draw
# grows fourfold per block here when the model is four times larger, the work in all sixteenfold.


class Work:
    def __init__(self) -> None:
        self.operations_read = 0
        self.modules_visited = 0


@contextlib.contextmanager
def counted_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[Work]:
    work = Work()
    read = Op.__getattribute__
    walk = nn.Module.named_modules

    def reading(op: Op, name: str) -> Any:
        work.operations_read += 1
        return read(op, name)

    def walking(module: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        for found in walk(module, *args, **kwargs):
            work.modules_visited += 1
            yield found

    with monkeypatch.context() as patched:
        patched.setattr(Op, "__getattribute__", reading)
        patched.setattr(nn.Module, "named_modules", walking)
        yield work


def linears(depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(depth)))


def initialize(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight)
        nn.init.uniform_(module.bias)


def work_to_initialize(depth: int, monkeypatch: pytest.MonkeyPatch) -> Work:
    torch.manual_seed(0)
    eager = linears(depth).apply(initialize)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    model = deferred_init(linears, depth)
    with counted_work(monkeypatch) as work:
        model.apply(initialize)
    assert torch.equal(torch.get_rng_state(), after_eager)  # each draw put the generator where eager code has it
    materialize_module(model)
    for (name, real), expected in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(real, expected), name
    return work


def test_initializing_a_deferred_model_with_apply_does_work_linear_in_its_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small, large = work_to_initialize(20, monkeypatch), work_to_initialize(80, monkeypatch)
    assert large.operations_read <= 6 * small.operations_read, (small.operations_read, large.operations_read)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)


def pairs(depth: int) -> nn.Module:
    return nn.Sequential(*(Pair() for _ in range(depth)))


def work_to_materialize_block_by_block(depth: int, shape: str, monkeypatch: pytest.MonkeyPatch) -> Work:
    torch.manual_seed(0)
    eager = pairs(depth)
    torch.manual_seed(0)
    model = deferred_init(pairs, depth)
    with counted_work(monkeypatch) as work:
        for block in model:
            if shape == "each block":
                materialize_module(block)
            else:
                materialize_module(model, check_fn=lambda module, block=block: module in (block, block.up, block.down))
        materialize_module(model)
    for (name, real), expected in zip(model.state_dict().items(), eager.state_dict().values(), strict=True):
        assert torch.equal(real, expected), name
    return work


@pytest.mark.parametrize("shape", ["each block", "check_fn"])
def test_materializing_block_by_block_does_work_linear_in_the_blocks(
    shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = work_to_materialize_block_by_block(20, shape, monkeypatch)
    large = work_to_materialize_block_by_block(80, shape, monkeypatch)
    assert large.operations_read <= 6 * small.operations_read, (small.operations_read, large.operations_read)
    if shape == "each block":  # check_fn is called with every submodule, at every call: torchdistx's rule
        assert large.modules_visited <= 6 * small.modules_visited, (small.modules_visited, large.modules_visited)


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "frequencies", "compute_frequencies", cache=True)

    def compute_frequencies(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(4, dtype=dtype, device=device)


def test_materializing_block_by_block_stays_linear_while_another_module_holds_a_virtual_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bystander = Rotary()  # alive in the process, in no deferred model: it must not make every block walk the model
    assert bystander.frequencies.value.tolist() == [0, 1, 2, 3]
    small = work_to_materialize_block_by_block(20, "each block", monkeypatch)
    large = work_to_materialize_block_by_block(80, "each block", monkeypatch)
    assert large.modules_visited <= 6 * small.modules_visited, (small.modules_visited, large.modules_visited)


class Holder(nn.Module):
    """Blocks, and a module outside them holding tensors that share memory with a block's weight: the block
    materialized alone takes them along, so that they stay aliased, and only a search of the whole model finds them.
    """

    def __init__(self, how: str) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Pair() for _ in range(3)), nn.LSTM(4, 4))
        self.outside = nn.Module()
        weight = self.blocks[1].up.weight
        if how == "data":
            self.outside.register_buffer("kept", weight.data)
        elif how == "view":
            self.outside.register_buffer("kept", weight.detach()[2:5])
        else:  # tied
            self.outside.kept = weight


@pytest.mark.parametrize("how", ["data", "view", "tied"])
def test_a_block_materialized_alone_takes_along_what_other_modules_hold_of_its_memory(how: str) -> None:
    torch.manual_seed(0)
    eager = Holder(how)
    torch.manual_seed(0)
    model = deferred_init(Holder, how)
    materialize_module(model.blocks[1])
    materialize_module(model.blocks[3])  # a recurrent layer holds weak references to its weights
    kept, weight = model.outside.kept, model.blocks[1].up.weight
    assert not is_fake(kept)
    assert is_fake(model.blocks[0].up.weight)
    assert kept.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert torch.equal(kept, eager.outside.kept)
    assert torch.equal(weight, eager.blocks[1].up.weight)
    for real, expected in zip(model.blocks[3].parameters(), eager.blocks[3].parameters(), strict=True):
        assert torch.equal(real, expected)
    model.blocks[3](torch.ones(2, 4))  # its weight list was made again from the real weights
