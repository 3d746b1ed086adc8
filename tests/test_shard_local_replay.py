"""A rank materializes only its shards: each parameter's window is made and drawn alone, with eager values.

Ranks run one at a time in this process on torch's fake process group (no communication happens while sharding
a deferred model or materializing it); ``tests/test_distributed.py`` runs the same flows on real gloo groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from modattrs.deferred import deferred_init, materialize_module
from tests.support import ranks
from tests.support.ranks import fake_world


class Block(nn.Module):
    """Every kind of operation a window handles, and some it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(24, 40)  # kaiming_uniform_ and uniform_: modelled draws
        self.norm = nn.LayerNorm(24)  # ones and zeros
        self.scaled = nn.Parameter(torch.empty(29, 6).normal_(0, 0.5).mul_(3.0))  # a draw, then elementwise
        self.tiny = nn.Parameter(torch.empty(3, 2).normal_())  # normal_ on the scalar path (pairs)
        self.cut = nn.Parameter(torch.empty(11, 4))
        nn.init.trunc_normal_(self.cut, std=0.02)  # bounds 100 deviations away: one normal_, drawn shard-local
        self.rotation = nn.Parameter(torch.empty(8, 8))
        nn.init.orthogonal_(self.rotation)  # not modelled: drawn through
        self.wide = nn.Parameter(torch.empty(5, 3, dtype=torch.float64).uniform_(-1, 1))  # fewer rows than ranks
        self.brain_float = nn.Parameter(torch.randn(33, 5).to(torch.bfloat16))  # a conversion reads all of it


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 24, padding_idx=17)  # normal_, then a row zeroed in place
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(24, 37, bias=False)


def shard_of(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full.detach(), size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


def eager(model_fn: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = model_fn()
    return model, torch.get_rng_state()


def sharded(model_fn: Callable[[], nn.Module], mesh: DeviceMesh, *, blockwise: bool) -> nn.Module:
    torch.manual_seed(0)
    model = deferred_init(model_fn)
    units = list(getattr(model, "blocks", []))
    for block in units:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if blockwise:
        for block in reversed(units):  # any order
            materialize_module(block)
    materialize_module(model)
    return model


def assert_slices_of(model: nn.Module, reference: nn.Module, size: int, rank: int) -> None:
    for name, parameter in model.named_parameters():
        expected = shard_of(reference.get_parameter(name), size, rank)
        local = parameter.to_local()  # type: ignore[attr-defined]
        assert local.dtype == expected.dtype, name
        assert torch.equal(local, expected), f"{name}: rank {rank} of {size} differs from the eager slice"


@pytest.mark.parametrize(
    ("size", "rank"), [(1, 0), (2, 1), (4, 0), (4, 3), (64, 0), (64, 32), (64, 63)], ids=lambda value: str(value)
)
@pytest.mark.parametrize("blockwise", [True, False], ids=["block by block", "in one call"])
def test_every_rank_materializes_the_eager_models_slices_and_leaves_the_generator_where_eager_code_does(
    size: int, rank: int, blockwise: bool
) -> None:
    reference, state_after_eager = eager(Model)
    with fake_world((size,), rank) as mesh:
        model = sharded(Model, mesh, blockwise=blockwise)
        assert_slices_of(model, reference, size, rank)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize(("size", "rank"), [(4, 1), (64, 63)], ids=str)
def test_a_draw_between_deferred_init_and_materializing_gets_eager_codes_numbers(size: int, rank: int) -> None:
    torch.manual_seed(0)
    reference = Model()
    between = torch.rand(5)
    with fake_world((size,), rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(Model)
        fully_shard(model, mesh=mesh)
        assert torch.equal(torch.rand(5), between)
        materialize_module(model)
        assert_slices_of(model, reference, size, rank)


dtypes = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])
inits = st.sampled_from(["uniform_", "normal_", "kaiming_uniform_", "zeros_then_fill", "exponential_", "randn"])


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    columns=st.integers(1, 19),
    dtype=dtypes,
    init=inits,
    size=st.sampled_from([2, 3, 4, 8, 64]),
    data=st.data(),
)
def test_any_parameter_sharded_over_any_world_is_the_eager_slice(
    rows: int, columns: int, dtype: torch.dtype, init: str, size: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, size - 1), label="rank")

    def make() -> nn.Module:
        holder = nn.Module()
        holder.before = nn.Parameter(torch.empty(7, 3).uniform_())  # draws before and after: the walk jumps
        weight = torch.empty(rows, columns, dtype=dtype)
        if init == "zeros_then_fill":
            weight.zero_().add_(0.5)
        elif init == "kaiming_uniform_":
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        elif init == "randn":
            weight = torch.randn(rows, columns, dtype=dtype)
        else:
            getattr(weight, init)()
        holder.weight = nn.Parameter(weight)
        holder.after = nn.Parameter(torch.empty(13).normal_())
        return holder

    reference, state_after_eager = eager(make)
    with fake_world((size,), rank) as mesh:
        model = sharded(make, mesh, blockwise=False)
        assert_slices_of(model, reference, size, rank)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_tensor_parallel_shards_are_the_eager_slices(style: str) -> None:
    size, rank = 4, 2
    make = lambda: nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 32))  # noqa: E731
    reference, _ = eager(make)
    plan = {"0": ColwiseParallel(), "1": RowwiseParallel()}
    with fake_world((size,), rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(make)
        parallelize_module(model, mesh, plan, src_data_rank=None)
        materialize_module(model)
        layer = 0 if style == "colwise" else 1
        weight = model[layer].weight.to_local()
        dim = 0 if style == "colwise" else 1
        expected = torch.chunk(reference[layer].weight.detach(), size, dim=dim)[rank]
        assert torch.equal(weight, expected)


@ranks.needs_high_water_mark
def test_a_rank_holds_its_shard_alone_neither_the_unsharded_parameter_nor_a_second_copy_of_the_shard() -> None:
    growth_mib, shard_mib = ranks.peak_growth_of_a_rank("fully_shard(model, mesh=mesh)")  # the shard 8 MiB
    parameter_mib = ranks.WEIGHT_MIB
    assert growth_mib < parameter_mib / 2, f"peak grew by {growth_mib:.1f} MiB for a {shard_mib:.1f} MiB shard"
    # drawn straight into FSDP2's padded shard: not into a window first, then copied
    assert growth_mib < 1.25 * shard_mib, f"peak grew by {growth_mib:.1f} MiB for a {shard_mib:.1f} MiB shard"


class Carved(nn.Module):
    """A part of a drawn tensor copied into a new one, as ``fully_shard`` does, with something in between."""

    def __init__(self, between: str) -> None:
        super().__init__()
        whole = torch.empty(40, 3).normal_()
        if between == "source not drawn":
            whole = torch.ones(40, 3)  # the copy's source holds its factory's ones, not the host's zeros
        if between == "float64 factory":
            whole = torch.empty(40, 3, dtype=torch.float64).normal_()
            torch.set_default_dtype(torch.float64)  # the factory's dtype comes from the default
            host = torch.zeros(12, 3)
            torch.set_default_dtype(torch.float32)
        else:
            host = whole.new_zeros(12, 3)
        if between == "host written first":
            host.add_(1.0)  # read and written before the copy: the drawn part must not be there yet
        if between == "host read first":
            self.register_buffer("sum_before", host.sum())
        host[1:11].copy_(whole[10:20])  # not from the host's start: its first and last rows stay as they were
        if between == "source written after":
            whole.mul_(2.0)  # after the copy: written into the host, it would change the copied rows
            self.register_buffer("later", whole[12:14].clone())
        if between == "factory reads another tensor":
            self.other = nn.Parameter(torch.empty(5).uniform_())
            host = self.other.new_zeros(12, 3)
            host[1:11].copy_(whole[10:20])
        self.part = nn.Parameter(host)
        self.after = nn.Parameter(torch.empty(9).uniform_())


@pytest.mark.parametrize(
    "between",
    [
        "nothing",
        "source not drawn",
        "float64 factory",
        "host written first",
        "host read first",
        "source written after",
        "factory reads another tensor",
    ],
)
def test_a_part_of_a_draw_copied_into_another_tensor_is_eagers_whatever_touches_either_around_the_copy(
    between: str,
) -> None:
    reference, state_after_eager = eager(lambda: Carved(between))
    torch.manual_seed(0)
    model = deferred_init(Carved, between)
    materialize_module(model)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
        assert model.state_dict()[name].dtype == tensor.dtype, name
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize("op", ["normal_", "uniform_", "exponential_"])
@pytest.mark.parametrize(("start", "stop"), [(0, 0), (3, 20), (16, 37), (0, 37), (36, 37)])
@pytest.mark.parametrize("ahead", [0, 1000, 3_000_000])
@pytest.mark.parametrize("into", [False, True], ids=["new tensor", "into out"])
def test_a_part_drawn_from_an_earlier_state_is_the_parts_values_and_ends_where_the_whole_draw_does(
    op: str, start: int, stop: int, ahead: int, into: bool
) -> None:
    from modattrs._deferred.rng import draws
    from modattrs._deferred.rng.mt19937 import jumped_state

    earlier = torch.Generator().manual_seed(7).get_state()
    before = jumped_state(earlier, ahead)
    eager_generator = torch.Generator()
    eager_generator.set_state(before)
    whole = getattr(torch.empty(37), op)(generator=eager_generator)
    pattern = draws.pattern(getattr(torch.ops.aten, op).default, (torch.empty(37, device="meta"),), {})
    assert pattern is not None
    host = torch.full((stop - start + 5,), 7.0)
    out = host[3 : 3 + stop - start] if into else None  # not at the start of its storage
    values, end, position = pattern.draw_with_end(earlier, start, stop, ahead=ahead, out=out)
    assert torch.equal(values, whole[start:stop])
    if into and stop > start:
        assert values.data_ptr() == host[3:].data_ptr()
        assert torch.equal(host[:3], torch.full((3,), 7.0))
        assert torch.equal(host[-2:], torch.full((2,), 7.0))
    if end is not None:  # the rest of the draw from there is the state after it
        assert torch.equal(jumped_state(end, pattern.outputs(before) - position), eager_generator.get_state())
    else:
        assert start == stop


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (torch.empty(4, dtype=torch.float64), "expected: torch.float32, shape \\(4,\\)"),
        (torch.empty(5), "got:      torch.float32, shape \\(5,\\)"),
        (torch.empty(8)[::2], "stride \\(2,\\)"),
        (torch.empty(4, device="meta"), "real strided CPU tensor"),
    ],
    ids=["dtype", "size", "stride", "meta"],
)
def test_drawing_into_a_tensor_that_cannot_hold_the_part_raises_before_drawing(out: torch.Tensor, message: str) -> None:
    from modattrs._deferred.rng import draws

    pattern = draws.pattern(torch.ops.aten.normal_.default, (torch.empty(37, device="meta"),), {})
    assert pattern is not None
    with pytest.raises(ValueError, match=message):
        pattern.draw_with_end(torch.Generator().get_state(), 3, 7, out=out)


@pytest.fixture
def empty_is_nan() -> Iterator[None]:
    """torch.empty and the like fill what they make with NaN (deterministic mode): unfilled memory shows."""
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("rank", [0, 3])
def test_the_padding_fsdp2_adds_to_an_uneven_shard_is_zeros_as_in_eager_sharding(rank: int, empty_is_nan: None) -> None:
    from modattrs._torch_private import fsdp_padded_shards

    make = lambda: nn.Linear(4, 10)  # noqa: E731  (10 rows over 4 ranks: the last has 1 row and 2 of padding)
    with fake_world((4,), rank) as mesh:
        reference, _ = eager(make)
        fully_shard(reference, mesh=mesh)  # eager sharding pads with zeros
        expected = {name: shard.clone() for _, name, shard in fsdp_padded_shards(reference)}
        torch.manual_seed(0)
        model = deferred_init(make)
        fully_shard(model, mesh=mesh)
        materialize_module(model)
        got = {name: shard for _, name, shard in fsdp_padded_shards(model)}
    assert expected.keys() == got.keys()
    for name, shard in got.items():
        assert torch.equal(shard, expected[name]), name


class CreatorFilled(nn.Module):
    """Parameters holding their creator's fill, written in place or not, as a norm's weight: FSDP2 copies each rank's
    rows of them into its padded shard."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(24))
        self.filled = nn.Parameter(torch.full((26, 3), 2.0).mul_(1.5))  # elementwise, all of it
        marked = torch.ones(30, 2)
        marked[5].fill_(4.0)  # elementwise, a part of it: inside some ranks' rows, outside others'
        marked[29].zero_()
        self.marked = nn.Parameter(marked)


@pytest.mark.parametrize(("size", "rank"), [(1, 0), (4, 0), (4, 3), (8, 7)], ids=str)
def test_parameters_holding_their_creators_fill_are_the_eager_slices_in_the_padded_shard(
    size: int, rank: int, empty_is_nan: None
) -> None:
    reference, state_after_eager = eager(CreatorFilled)
    with fake_world((size,), rank) as mesh:
        assert_slices_of(sharded(CreatorFilled, mesh, blockwise=False), reference, size, rank)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class SameShapesOtherDraws(nn.Module):
    """Parameters of one layout drawn by calls that differ only in their numbers, or in how those are passed."""

    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Parameter(torch.empty(40, 3).uniform_(0.5))  # from=0.5, to=1
        self.high = nn.Parameter(torch.empty(40, 3).uniform_(to=0.5))  # from=0, to=0.5
        self.wide = nn.Parameter(torch.empty(40, 3).uniform_(-4.0, 4.0))
        self.spread = nn.Parameter(torch.empty(40, 3).normal_(std=3.0))
        self.shifted = nn.Parameter(torch.empty(40, 3).normal_(3.0))


@pytest.mark.parametrize(("size", "rank"), [(4, 2), (8, 7)], ids=str)
def test_draws_of_one_layout_with_other_numbers_each_give_their_own_eager_slice(size: int, rank: int) -> None:
    reference, state_after_eager = eager(SameShapesOtherDraws)
    for _ in range(2):  # the second time, each call's model of its draws is one seen before
        with fake_world((size,), rank) as mesh:
            torch.manual_seed(0)
            model = deferred_init(SameShapesOtherDraws)
            fully_shard(model, mesh=mesh)
            materialize_module(model)
            assert_slices_of(model, reference, size, rank)
        assert torch.equal(torch.get_rng_state(), state_after_eager)


class CopiedWhole(nn.Module):
    """A buffer of zeros that a copy then overwrites, whole or in part (FSDP2's padded shard, when uneven)."""

    def __init__(self, rows: slice) -> None:
        super().__init__()
        drawn = torch.empty(8, 3).uniform_()
        copy = drawn.new_zeros(8, 3)
        copy[rows].copy_(drawn[rows])
        self.copy = nn.Parameter(copy)
        self.drawn = nn.Parameter(drawn)


@pytest.mark.parametrize(
    ("rows", "zeros_written"), [(slice(0, 8), 0), (slice(1, 7), 1)], ids=["overwritten whole", "overwritten in part"]
)
def test_zeros_that_a_copy_overwrites_whole_are_never_written_and_zeros_it_leaves_are(
    rows: slice, zeros_written: int
) -> None:
    reference, _ = eager(lambda: CopiedWhole(rows))
    torch.manual_seed(0)
    model = deferred_init(CopiedWhole, rows)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        materialize_module(model)
    assert sum(event.name == "aten::zero_" for event in profile.events()) == zeros_written
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
