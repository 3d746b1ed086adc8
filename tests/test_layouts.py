"""The layouts large-model training runs (FSDP2 over tensor parallelism, HSDP, a shard on any dim, uneven shards,
trivial mesh dimensions, replicated norm weights): each rank materializes the eager model's local shards, bit for
bit, leaves the generator where eager construction does, and draws about its own elements.

Ranks run one at a time in this process on torch's fake process group, on a 2-D mesh as
``init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))`` makes it. The expected local shard of each
parameter is what the same mesh and placements make of the eager parameter, with DTensor's and FSDP2's own
semantics of a placement: ``torch.chunk`` of the eager parameter along each sharded dim (``expected_local``).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.profiler import ProfilerActivity

from modattrs._deferred.rng.mt19937 import FAR_JUMP_COST
from modattrs.deferred import deferred_init, is_deferred, materialize_module
from tests.support.kernels import torchs_kernels_draw
from tests.support.ranks import fake_world


def fake_mesh(
    dp: int, tp: int, rank: int, names: tuple[str, str] = ("dp", "tp")
) -> contextlib.AbstractContextManager[DeviceMesh]:
    return fake_world((dp, tp), rank, names)


def coordinates_of(rank: int, tp: int, names: tuple[str, str] = ("dp", "tp")) -> dict[str, int]:
    """Where ``rank`` sits on a row-major (dp, tp) mesh, by dimension name."""
    return {names[0]: rank // tp, names[1]: rank % tp}


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)  # replicated under SequenceParallel, sharded by FSDP2
        self.up = nn.Linear(width, hidden)  # column cut: rows of the weight, the bias cut too
        self.down = nn.Linear(hidden, width, bias=False)  # row cut: a strided region of the weight
        nn.init.normal_(self.down.weight, std=0.02)  # normal_'s blocks of 16


class Model(nn.Module):
    def __init__(self, width: int = 32, hidden: int = 72, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(2))
        self.head = nn.Linear(width, vocab + 3, bias=False)  # uneven shards on every mesh here


TP_PLAN = {"norm": SequenceParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        parallelize_module(block, mesh, TP_PLAN, src_data_rank=None)
    parallelize_module(model, mesh, {"head": ColwiseParallel(), "embed": RowwiseParallel()}, src_data_rank=None)


def fsdp(model: nn.Module, mesh: DeviceMesh, **options: object) -> None:
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, **options)  # type: ignore[call-overload]
    fully_shard(model, mesh=mesh, **options)  # type: ignore[call-overload]


def fsdp_over_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    tensor_parallel(model, mesh["tp"])
    fsdp(model, mesh["dp"])


def tp_only(model: nn.Module, mesh: DeviceMesh) -> None:
    tensor_parallel(model, mesh["tp"])


def fsdp_only(model: nn.Module, mesh: DeviceMesh) -> None:
    fsdp(model, mesh["dp"])


def hsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    fsdp(model, mesh)  # a 2-D mesh: replicated over the first dimension, sharded over the second


def shard_on_last_dim(model: nn.Module, mesh: DeviceMesh) -> None:
    fsdp(model, mesh["dp"], shard_placement_fn=lambda parameter: Shard(parameter.dim() - 1))


# layout -> (its parallelization, (dp, tp) at 8 ranks, at 64 ranks)
LAYOUTS: dict[str, tuple[Callable[[nn.Module, DeviceMesh], None], tuple[int, int], tuple[int, int]]] = {
    "fsdp over tp": (fsdp_over_tp, (4, 2), (8, 8)),
    "fsdp over a trivial tp": (fsdp_over_tp, (8, 1), (64, 1)),
    "tp alone": (tp_only, (1, 8), (1, 64)),
    "fsdp alone on a 2-d mesh": (fsdp_only, (8, 1), (64, 1)),
    "hsdp": (hsdp, (2, 4), (8, 8)),
    "fsdp on the last dim": (shard_on_last_dim, (8, 1), (64, 1)),
}


def expected_local(eager: torch.Tensor, parameter: torch.Tensor, coordinates: dict[str, int]) -> torch.Tensor:
    """What this rank holds of ``eager`` under ``parameter``'s mesh and placements, by ``torch.chunk`` as DTensor
    and FSDP2 cut: nested shards in the mesh's order, or, with FSDP2's ``_StridedShard`` (FSDP2 over tensor
    parallelism), the tensor-parallel cut first and FSDP2's cut of it after. ``coordinates``: the rank's place on
    each named mesh dimension (worked out from its rank: the fake process group's submeshes do not know it)."""
    local = eager.detach()
    if not isinstance(parameter, DTensor):
        return local
    mesh, placements = parameter.device_mesh, parameter.placements
    assert mesh.mesh_dim_names is not None
    coordinate = [coordinates[name] for name in mesh.mesh_dim_names]
    order = list(range(mesh.ndim))
    if any(type(placement).__name__ == "_StridedShard" for placement in placements):
        order.reverse()
    for mesh_dim in order:
        placement = placements[mesh_dim]
        dim = getattr(placement, "dim", None)  # Shard's and _StridedShard's
        if isinstance(dim, int):
            chunks = torch.chunk(local, mesh.size(mesh_dim), dim=dim)
            index = coordinate[mesh_dim]
            local = chunks[index] if index < len(chunks) else local.narrow(dim, 0, 0)
    return local


def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    return actual.shape == expected.shape and torch.equal(
        actual.detach().contiguous().view(torch.int32), expected.contiguous().view(torch.int32)
    )


def materialized(
    make: Callable[[], nn.Module], layout: Callable[[nn.Module, DeviceMesh], None], mesh: DeviceMesh
) -> nn.Module:
    torch.manual_seed(0)
    model = deferred_init(make)
    layout(model, mesh)
    materialize_module(model)
    return model


def local_of(parameter: torch.Tensor) -> torch.Tensor:
    return parameter.to_local() if isinstance(parameter, DTensor) else parameter


def assert_eager_shards(model: nn.Module, reference: nn.Module, coordinates: dict[str, int]) -> None:
    assert not is_deferred(model)
    for name, parameter in model.named_parameters():
        assert same_bits(local_of(parameter), expected_local(reference.get_parameter(name), parameter, coordinates)), (
            name
        )


def eager(make: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    return model, torch.get_rng_state()


@pytest.mark.parametrize("world", ["8", "64"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_ranks_first_middle_and_last_of_each_layout_hold_the_eager_shards_and_leave_the_generator_as_eager_code(
    layout: str, world: str
) -> None:
    parallelize, small, large = LAYOUTS[layout]
    dp, tp = small if world == "8" else large
    # FSDP2 shards dims other than 0 evenly only: widths that 64 divides there
    make = functools.partial(Model, 64, 128) if parallelize is shard_on_last_dim else Model
    reference, state_after_eager = eager(make)
    names = ("replicate", "shard") if layout == "hsdp" else ("dp", "tp")
    for rank in sorted({0, dp * tp // 2, dp * tp - 1}):
        with fake_mesh(dp, tp, rank, names) as mesh:
            model = materialized(make, parallelize, mesh)
            assert_eager_shards(model, reference, coordinates_of(rank, tp, names))
        assert torch.equal(torch.get_rng_state(), state_after_eager), rank


def elements_written(run: Callable[[], object]) -> Counter[str]:
    """By operator, the elements of tensors that the calls run by ``run`` write in place (calls made by a call of
    the same operator not counted), counted by torch's profiler; copies of the generator's state, which replays
    save and restore, left out."""
    state_size = [torch.get_rng_state().numel()]
    with torchs_kernels_draw(), torch.profiler.profile(activities=[ProfilerActivity.CPU], record_shapes=True) as seen:
        run()
    written: Counter[str] = Counter()
    for event in seen.events():
        if event.name.endswith("_") and event.input_shapes and event.input_shapes[0] != state_size:
            parent = event.cpu_parent
            if parent is None or parent.name != event.name:
                written[event.name] += math.prod(event.input_shapes[0])
    return written


def drawn_elements(run: Callable[[], object]) -> int:
    """The elements the random fills run by ``run`` write (generator jumps that draw use ``random_``, which is not
    counted)."""
    written = elements_written(run)
    return written["aten::normal_"] + written["aten::uniform_"]


class Columns(nn.Module):
    """Column-cut weights only: a rank of FSDP2 over them keeps whole rows of its tensor-parallel shard."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(64, 512, bias=False)
        self.second = nn.Linear(64, 384, bias=False)
        nn.init.normal_(self.second.weight)


def written_by_a_rank_of_fsdp_over_tensor_parallelism(
    make: Callable[[], nn.Module], style: type[ParallelStyle], dp: int, tp: int, rank: int, src_data_rank: int | None
) -> tuple[int, int, int]:
    """The elements a rank draws and copies to materialize ``make``'s weights cut by ``style`` over tp (each rank
    cutting its own, or rank ``src_data_rank``'s chunks scattered, DTensor's default) then by ``fully_shard`` over
    dp, and its own elements; its shards and the generator checked against eager code's."""
    reference, state_after_eager = eager(make)
    plan: dict[str, ParallelStyle] = {"first": style(), "second": style()}
    with fake_mesh(dp, tp, rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(make)
        parallelize_module(model, mesh["tp"], plan, src_data_rank=src_data_rank)
        fully_shard(model, mesh=mesh["dp"])
        written = elements_written(lambda: materialize_module(model))
        drawn, copied = written["aten::normal_"] + written["aten::uniform_"], written["aten::copy_"]
        assert_eager_shards(model, reference, coordinates_of(rank, tp))
        own = sum(local_of(parameter).numel() for parameter in model.parameters())
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    return drawn, copied, own


#: Each rank cutting its own chunk, or rank 0's chunks scattered (DTensor's default, and torchtitan's): the scatter
#: of a deferred source is recorded as a copy of the rank's own chunk into what ``empty_like`` made, which a replay
#: takes as a clone of that chunk, so the rank's rows are all it draws either way.
SOURCES = pytest.mark.parametrize("src_data_rank", [None, 0], ids=["each rank cuts its own", "rank 0's sent"])


@SOURCES
@pytest.mark.parametrize(("dp", "tp", "rank"), [(4, 2, 0), (4, 2, 5), (8, 1, 7)])
def test_a_rank_of_fsdp_over_tensor_parallelism_draws_its_own_rows_not_its_tensor_parallel_shard(
    dp: int, tp: int, rank: int, src_data_rank: int | None
) -> None:
    drawn, _, own = written_by_a_rank_of_fsdp_over_tensor_parallelism(
        Columns, ColwiseParallel, dp, tp, rank, src_data_rank
    )
    total = 64 * (512 + 384)
    assert own <= drawn <= own + 2 * 16  # normal_ draws whole blocks of 16 at either end
    assert drawn < total // tp  # not the tensor-parallel shard


class RowCut(nn.Module):
    """Row-cut weights (``RowwiseParallel``): a rank's tensor-parallel shard is a strided view of the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(512, 64, bias=False)
        self.second = nn.Linear(384, 64, bias=False)
        nn.init.normal_(self.second.weight)


@SOURCES
@pytest.mark.parametrize(("dp", "tp", "rank"), [(4, 2, 0), (4, 2, 5), (8, 1, 7)])
@pytest.mark.parametrize(
    ("make", "style", "copies"),
    [(Columns, ColwiseParallel, 0), (RowCut, RowwiseParallel, 1)],
    ids=["a column cut is drawn into it", "a row cut is copied into it once"],
)
def test_a_rank_of_fsdp_over_tensor_parallelism_writes_its_rows_straight_into_its_padded_shard(
    dp: int,
    tp: int,
    rank: int,
    make: Callable[[], nn.Module],
    style: type[ParallelStyle],
    copies: int,
    src_data_rank: int | None,
) -> None:
    _, copied, own = written_by_a_rank_of_fsdp_over_tensor_parallelism(make, style, dp, tp, rank, src_data_rank)
    # Not drawn into a window, cloned into a tensor-parallel shard of its own and then copied into FSDP2's padded
    # shard: rows of a column cut are drawn where they end, and the strided rows of a row cut are copied there once
    # (over a trivial tp dimension, the cut is all of the weight: contiguous, drawn where it ends too).
    assert copied == (copies * own if tp > 1 else 0)


class Wide(nn.Module):
    """Rows far longer than a jump costs to draw: a row cut keeps runs with gaps worth jumping. The width is odd and
    not a multiple of 16, so that normal_ redraws its last 16 elements and runs begin inside blocks."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.uniform = nn.Linear(width, 3, bias=False)
        self.normal = nn.Linear(width, 3, bias=False)
        nn.init.normal_(self.normal.weight)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_rank_of_a_row_cut_draws_its_runs_and_jumps_the_long_gaps_between_them(rank: int) -> None:
    width = 2 * FAR_JUMP_COST + 2 * 50 + 3  # each run and each gap longer than a jump's cost in outputs
    make = lambda: Wide(width)  # noqa: E731
    reference, state_after_eager = eager(make)
    plan: dict[str, ParallelStyle] = {"uniform": RowwiseParallel(), "normal": RowwiseParallel()}
    with fake_mesh(1, 3, rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(make)
        parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
        drawn = drawn_elements(lambda: materialize_module(model))
        assert_eager_shards(model, reference, coordinates_of(rank, 3))
        own = sum(local_of(parameter).numel() for parameter in model.parameters())
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    runs = 2 * 3  # per weight, a run per row
    assert own <= drawn <= own + runs * 2 * 16 + 16  # blocks of 16 at a run's ends, the redrawn tail


class Rotated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48, bias=False)
        nn.init.orthogonal_(self.up.weight)  # not modelled: drawn whole, exactly
        self.down = nn.Linear(48, 16, bias=False)


def test_a_layout_whose_initializer_is_not_modelled_is_drawn_whole_and_still_the_eager_shards() -> None:
    reference, state_after_eager = eager(Rotated)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    for rank in (0, 3, 7):
        with fake_mesh(4, 2, rank) as mesh:
            torch.manual_seed(0)
            model = deferred_init(Rotated)
            parallelize_module(model, mesh["tp"], plan, src_data_rank=None)
            fully_shard(model, mesh=mesh["dp"])
            materialize_module(model)
            assert_eager_shards(model, reference, coordinates_of(rank, 2))
        assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize("op", ["uniform_", "normal_"])
@pytest.mark.parametrize(("first", "second"), [((0, 20), (40, 77)), ((5, 17), (60, 100)), ((16, 32), (90, 101))])
def test_runs_drawn_one_from_where_the_last_stopped_are_the_fills_values_and_end_where_it_does(
    op: str, first: tuple[int, int], second: tuple[int, int]
) -> None:
    from modattrs._deferred.rng import draws
    from modattrs._deferred.rng.mt19937 import jumped_state

    before = torch.Generator().manual_seed(3).get_state()
    eager_generator = torch.Generator()
    eager_generator.set_state(before)
    whole = getattr(torch.empty(101), op)(generator=eager_generator)  # 101: normal_ redraws its last 16
    pattern = draws.pattern(getattr(torch.ops.aten, op).default, (torch.empty(101, device="meta"),), {})
    assert pattern is not None
    values, end, position = pattern.draw_with_end(before, *first)
    assert torch.equal(values, whole[slice(*first)])
    assert end is not None
    values, end, position = pattern.draw_with_end(end, *second, behind=position)
    assert torch.equal(values, whole[slice(*second)])
    assert end is not None
    assert torch.equal(jumped_state(end, pattern.outputs(before) - position), eager_generator.get_state())


def test_a_run_that_reads_numbers_before_the_state_it_is_drawn_from_is_refused() -> None:
    from modattrs._deferred.rng import draws

    pattern = draws.pattern(torch.ops.aten.normal_.default, (torch.empty(101, device="meta"),), {})
    assert pattern is not None
    _, end, position = pattern.draw_with_end(torch.Generator().get_state(), 0, 20)
    assert end is not None
    with pytest.raises(ValueError, match=r"(?s)its first output at or after 32.*got:      16"):
        pattern.draw_with_end(end, 20, 40, behind=position)  # its block begins at element 16, drawn already


def rows_of_an_expanded_clone() -> nn.Module:
    module = nn.Module()
    base = torch.randn(1, 64)
    module.p = nn.Parameter(base.expand(1024, 64).clone())  # a clone of a view whose rows are all one row
    return module


def keep_rows_256_to_384(module: nn.Module) -> nn.Module:
    shard = module.p.new_zeros(128, 64)  # as FSDP2 copies a rank's rows into a shard it makes
    shard.copy_(module.p[256:384])
    module.p = nn.Parameter(shard)
    return module


def test_a_cut_of_a_clone_of_an_expanded_view_is_the_eager_rows() -> None:
    torch.manual_seed(0)
    eager = keep_rows_256_to_384(rows_of_an_expanded_clone())
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = keep_rows_256_to_384(deferred_init(rows_of_an_expanded_clone))
    materialize_module(deferred)
    assert not is_deferred(deferred)
    assert torch.equal(deferred.p, eager.p)
    assert torch.equal(torch.get_rng_state(), state_after_eager)
