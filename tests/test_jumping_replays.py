"""Replays reach a draw by jumping the CPU generator over the draws before it, not by running them: materializing
the last block, or a new head after the body came from a checkpoint, runs only its own draws, and still gives the
values and the generator state of eager construction (Note [Reaching a draw by jumping] in
``modattrs/_deferred/rng/generator.py``)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from modattrs.deferred import deferred_init, is_deferred, materialize_module
from tests.support.kernels import torchs_kernels_draw

#: The kernels that fill the model's weights. Jumping draws raw outputs with other kernels, and modattrs checks its
#: model of each kind of draw on a few tensors of at most 48 elements, once per process: not counted.
WEIGHT_KERNELS = ("aten::normal_", "aten::uniform_")
SMALL = 100


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        nn.init.normal_(self.down.weight, std=0.02)  # a block path draw (normal_, 16 at a time)


class Model(nn.Module):
    def __init__(self, width: int = 64, depth: int = 6, vocabulary: int = 1000, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)


def weights_drawn(action: Callable[[], object]) -> Counter[tuple[str, tuple[int, ...]]]:
    """The random kernels that ran during ``action`` on tensors of more than SMALL elements, with their shapes: the
    tensors a replay drew for real."""
    with torchs_kernels_draw(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        action()
    drawn: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for event in profiler.events():
        shape = tuple(event.input_shapes[0]) if event.input_shapes else ()
        if event.name in WEIGHT_KERNELS and math.prod(shape) > SMALL:
            drawn[event.name, shape] += 1
    return drawn


def eager(seed: int = 0) -> tuple[Model, torch.Tensor]:
    torch.manual_seed(seed)
    model = Model()
    return model, torch.default_generator.get_state()


def test_materializing_the_last_block_runs_only_that_blocks_draws() -> None:
    expected, _ = eager()
    torch.manual_seed(0)
    model = deferred_init(Model)

    drawn = weights_drawn(lambda: materialize_module(model.blocks[-1]))

    # up's weight and bias (kaiming_uniform_, uniform_) and the normal_ drawn over down's weight; the
    # kaiming_uniform_ it draws over is never computed (it only moves the generator), nor is any other block.
    assert drawn == Counter(
        {("aten::uniform_", (256, 64)): 1, ("aten::uniform_", (256,)): 1, ("aten::normal_", (64, 256)): 1}
    )
    for name, tensor in model.blocks[-1].state_dict().items():
        assert torch.equal(tensor, expected.blocks[-1].state_dict()[name]), name


def test_a_new_head_after_loading_the_body_from_a_checkpoint_runs_only_the_heads_draws() -> None:
    expected, generator_after_eager = eager()
    checkpoint = {name: tensor.clone() for name, tensor in expected.state_dict().items() if not name.startswith("head")}
    torch.manual_seed(0)
    model = deferred_init(Model)
    model.load_state_dict(checkpoint, strict=False, assign=True)
    assert is_deferred(model.head)
    assert not is_deferred(model.blocks)

    drawn = weights_drawn(lambda: materialize_module(model))

    assert drawn == Counter({("aten::uniform_", (10, 64)): 1})  # the head's weight: the body's draws are jumped over
    assert torch.equal(model.head.weight, expected.head.weight)
    assert torch.equal(model.head.bias, expected.head.bias)
    assert torch.equal(torch.default_generator.get_state(), generator_after_eager)  # where eager code leaves it


def test_block_by_block_in_any_order_gives_eager_values_and_generator_state() -> None:
    expected, generator_after_eager = eager(seed=3)
    torch.manual_seed(3)
    model = deferred_init(Model)
    for index in (4, 1, 5, 0, 3, 2):
        materialize_module(model.blocks[index])
    materialize_module(model)

    assert not is_deferred(model)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(torch.default_generator.get_state(), generator_after_eager)


class SmallDraws(nn.Module):
    """Draws whose count depends on the generator's state (small normal_ calls use Box-Muller pairs and cache one
    normal in the state) and draws that are not modelled (randperm), between modelled ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.odd = nn.Parameter(torch.randn(3))  # a pair and a half: leaves a normal cached
        self.order = nn.Buffer(torch.randperm(7))
        self.even = nn.Parameter(torch.randn(5))  # starts with the cached normal
        self.last = nn.Linear(8, 8)


def test_draws_that_cannot_be_jumped_over_are_run_and_the_rest_jumped_with_eager_results() -> None:
    torch.manual_seed(7)
    expected = SmallDraws()
    after_eager = torch.default_generator.get_state()
    torch.manual_seed(7)
    model = deferred_init(SmallDraws)

    materialize_module(model.last)
    materialize_module(model)

    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(torch.default_generator.get_state(), after_eager)


def test_code_that_draws_before_materializing_gets_the_numbers_eager_code_gets() -> None:
    torch.manual_seed(0)
    eager = Model()
    eager.head = nn.Linear(64, 5)  # a new head, as timm's reset_classifier makes
    order = torch.randperm(10)
    after_eager = torch.default_generator.get_state()

    torch.manual_seed(0)
    model = deferred_init(Model)
    model.head = nn.Linear(64, 5)  # real: drawn from the generator deferred_init left where eager code leaves it
    assert torch.equal(model.head.weight, eager.head.weight)
    assert torch.equal(torch.randperm(10), order)
    materialize_module(model)

    for name, tensor in eager.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(torch.default_generator.get_state(), after_eager)  # materializing left the generator alone


def test_initialization_of_a_deferred_module_moves_the_generator_as_eager_initialization_does() -> None:
    torch.manual_seed(1)
    eager = Model()
    nn.init.normal_(eager.head.weight)
    drawn_after = torch.rand(4)

    torch.manual_seed(1)
    model = deferred_init(Model)
    nn.init.normal_(model.head.weight)  # recorded: the deferred weight gets eager's values when materialized
    assert torch.equal(torch.rand(4), drawn_after)
    materialize_module(model)
    assert torch.equal(model.head.weight, eager.head.weight)


class Wide(nn.Module):
    """A weight large enough (16.8M elements) for its fill to be split over threads, and smaller ones."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(4096, 4096)  # normal_: 16 at a time
        self.proj = nn.Linear(4096, 8)  # kaiming_uniform_: one output each


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_materializing_on_any_number_of_threads_gives_the_eager_values_and_generator(threads: int) -> None:
    torch.manual_seed(5)
    expected = Wide()
    after_eager = torch.default_generator.get_state()
    torch.manual_seed(5)
    model = deferred_init(Wide)

    materialize_module(model, threads=threads)

    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    assert torch.equal(torch.default_generator.get_state(), after_eager)


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_a_thread_count_that_is_not_a_positive_int_is_refused_and_leaves_the_module_deferred(threads: object) -> None:
    model = deferred_init(nn.Linear, 4, 4)
    with pytest.raises(ValueError, match="threads must be a positive int"):
        materialize_module(model, threads=threads)  # type: ignore[arg-type]
    assert is_deferred(model)
