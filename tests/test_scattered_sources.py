"""DTensor's scatter and broadcast of a deferred tensor (``distribute_tensor``'s default ``src_data_rank=0``) give
each rank the eager model's slice, as if each rank had cut its own; other collectives are refused, naming the tensor.

Every rank records the same deferred model, so the chunk that rank 0 would send a rank holds that rank's own
values. Ranks run one at a time in this process on torch's fake process group (nothing is sent); ``tests/
test_distributed.py`` runs ``parallelize_module``'s default on real gloo groups.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

from modattrs._deferred.fingerprint import digest_of
from modattrs._deferred.recorder import recording_mode
from modattrs.deferred import DeferredInitError, deferred_init, is_deferred, materialize_module
from modattrs.fake import fake_mode
from tests.support import ranks
from tests.support.ranks import fake_world


def holder(rows: int, columns: int) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        module = nn.Module()
        module.before = nn.Parameter(torch.empty(7, 3).uniform_())  # draws before and after the distributed one
        module.weight = nn.Parameter(torch.empty(rows, columns))
        nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5))
        module.after = nn.Parameter(torch.randn(13))
        return module

    return make


def eager(make: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    return model, torch.get_rng_state()


def dtensor_slice(full: torch.Tensor, placements: Sequence[Placement], mesh: DeviceMesh) -> torch.Tensor:
    """The local tensor DTensor gives this rank: for each mesh dim in order, the chunk of its coordinate along the
    sharded dim (torch.chunk's sizes; an empty one past the last chunk)."""
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    local = full.detach()
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            chunks = torch.chunk(local, mesh.size(mesh_dim), dim=placement.dim)
            index = coordinate[mesh_dim]
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


LAYOUTS: dict[str, tuple[tuple[int, ...], list[Placement], tuple[int, int]]] = {
    "Shard(0)": ((8,), [Shard(0)], (48, 5)),
    "Shard(1)": ((8,), [Shard(1)], (5, 48)),
    "Shard(0), uneven: 13 rows over 8 ranks": ((8,), [Shard(0)], (13, 5)),
    "Shard(1), uneven: 30 columns over 8 ranks": ((8,), [Shard(1)], (4, 30)),
    "Replicate": ((8,), [Replicate()], (9, 5)),
    "2-D mesh, Shard(0) x Shard(1)": ((2, 4), [Shard(0), Shard(1)], (10, 18)),
    "2-D mesh, Replicate x Shard(0) (HSDP)": ((2, 4), [Replicate(), Shard(0)], (22, 3)),
    "2-D mesh, Shard(0) x Shard(0)": ((2, 4), [Shard(0), Shard(0)], (24, 3)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 4, 7])
def test_distribute_tensor_sending_rank_0s_deferred_values_gives_each_rank_the_eager_slice(
    layout: str, rank: int
) -> None:
    shape, placements, (rows, columns) = LAYOUTS[layout]
    make = holder(rows, columns)
    reference, state_after_eager = eager(make)
    with fake_world(shape, rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(make)
        model.weight = nn.Parameter(distribute_tensor(model.weight, mesh, placements))  # src_data_rank=0
        materialize_module(model)
        assert not is_deferred(model)
        local = model.weight.to_local()  # type: ignore[operator]
        assert torch.equal(local, dtensor_slice(reference.weight, placements, mesh))
        assert torch.equal(model.before, reference.before)
        assert torch.equal(model.after, reference.after)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize("rank", [0, 5, 7])
def test_tensor_parallel_with_rank_0s_values_sent_then_fsdp2_on_a_2d_mesh_gives_each_rank_the_eager_slice(
    rank: int,
) -> None:
    """torchtitan's FSDP x TP: parallelize_module over tp with its default src_data_rank=0, fully_shard over dp
    (FSDP2 cuts each local tensor again, along dim 0)."""
    make = lambda: nn.Sequential(nn.Linear(16, 40), nn.ReLU(), nn.Linear(40, 16))  # noqa: E731
    reference, state_after_eager = eager(make)
    with contextlib.ExitStack() as stack:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
        stack.callback(dist.destroy_process_group)
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = deferred_init(make)
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        materialize_module(model)
        assert not is_deferred(model)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        dp, tp = coordinate
        tensor_parallel_dim = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}
        for name, parameter in model.named_parameters():
            full = reference.get_parameter(name).detach()
            dim = tensor_parallel_dim[name]
            part = full if dim is None else torch.chunk(full, 2, dim)[tp]
            chunks = torch.chunk(part, 4, dim=0)
            expected = chunks[dp] if dp < len(chunks) else part[:0]
            assert torch.equal(parameter.to_local(), expected), name  # type: ignore[operator]
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(5, 6, 5))  # 5 rows over 4 ranks: FSDP2 pads, into new memory


class Experts(nn.Module):
    """Embeddings first, then expert weights: the latter alone go through a collective."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(11, 6)
        self.moe = MoE()
        self.output = nn.Linear(6, 11)


def broadcast_directly(model: nn.Module, mesh: DeviceMesh) -> None:
    dist.broadcast(model.moe.experts.detach(), src=0)  # c10d's own broadcast: not DTensor's, not modelled


def scatter_real_chunks(model: nn.Module, mesh: DeviceMesh) -> None:
    # rank 0's real data, from outside the record, into this rank's part of the deferred weight
    chunks = list(torch.ones(4, 6, 5).chunk(4)) if dist.get_rank() == 0 else None
    dist.scatter(model.moe.experts.detach()[:1], chunks, src=0)


def all_reduced(model: nn.Module, mesh: DeviceMesh) -> None:
    dist.all_reduce(model.moe.experts.detach())  # the sum of every rank's values: not this rank's own


REFUSED = {
    "c10d's broadcast": broadcast_directly,
    "a scatter of real data": scatter_real_chunks,
    "an all-reduce": all_reduced,
}


def c10d_runs_on_fake_tensors() -> bool:
    """Whether this torch has fake kernels for c10d's operators (torch 2.8 has none: there a collective on a deferred
    tensor is refused where it is called, before anything is recorded)."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(torch.ops.c10d.broadcast_.default.name(), "Meta"))


#: (collective, sharded by FSDP2, rank): every one but rank 3's FSDP2 shard after the scatter, which holds nothing
#: the scatter wrote (see the test after this one).
REFUSALS = [
    (collective, sharded, rank)
    for collective in REFUSED
    for sharded in (False, True)
    for rank in (0, 3)
    if (collective, sharded, rank) != ("a scatter of real data", True, 3)
]


@pytest.mark.parametrize(("collective", "sharded", "rank"), REFUSALS)
def test_a_collective_the_replay_does_not_model_is_refused_naming_the_tensor_it_filled(
    collective: str, sharded: bool, rank: int
) -> None:
    with fake_world((4,), rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(Experts)
        if not c10d_runs_on_fake_tensors():
            with pytest.raises(
                DeferredInitError, match=r"^c10d\.\w+\.default is a collective .* cannot run it on fake"
            ):
                REFUSED[collective](model, mesh)
            assert is_deferred(model)
            return
        REFUSED[collective](model, mesh)
        if sharded:  # FSDP2 copies each parameter into a padded shard of its own: not what the collective filled
            fully_shard(model, mesh=mesh)
        with pytest.raises(DeferredInitError) as raised:
            materialize_module(model)
        message = str(raised.value)
        assert re.match(
            r"parameter 'moe\.experts' \((FSDP)?MoE\).* cannot be materialized: its values come from a collective\.\n",
            message,
        ), message
        assert re.search(r"\ncollective: c10d\.\w+\.default\n", message), message
        assert is_deferred(model)  # left as it was


def test_a_rank_whose_shard_holds_nothing_a_collective_wrote_materializes_it_as_eager_code_has_it() -> None:
    # The scatter writes row 0 of the experts, which FSDP2 gives rank 0; rank 3's shard of 5 rows over 4 ranks is
    # empty, padded with zeros, and its padded shard reads only the experts' dtype and device.
    reference, state_after_eager = eager(Experts)
    with fake_world((4,), 3) as mesh:
        torch.manual_seed(0)
        model = deferred_init(Experts)
        if not c10d_runs_on_fake_tensors():
            pytest.skip("this torch refuses the collective where it is called (see the test above)")
        scatter_real_chunks(model, mesh)
        fully_shard(model, mesh=mesh)
        materialize_module(model)
        assert not is_deferred(model)
        experts = model.moe.experts.to_local()  # type: ignore[operator]
        assert experts.shape == (0, 6, 5)
        for name in ("tok_embeddings.weight", "output.weight", "output.bias"):
            full = reference.get_parameter(name)
            local = model.get_parameter(name).to_local()  # type: ignore[operator]
            assert torch.equal(local, full.chunk(4)[3]), name  # 11 rows: 3, 3, 3 and rank 3's 2
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@ranks.needs_high_water_mark
def test_a_rank_given_its_scattered_chunk_makes_that_chunk_not_the_whole_parameter() -> None:
    # rank 0's chunks scattered; rank 5's chunk is 8 MiB, chunks 0 to 5 48 MiB
    growth_mib, shard_mib = ranks.peak_growth_of_a_rank(
        "model.weight = nn.Parameter(distribute_tensor(model.weight, mesh, [Shard(0)]))"
    )
    parameter_mib = ranks.WEIGHT_MIB
    assert growth_mib < parameter_mib / 2, f"peak grew by {growth_mib:.1f} MiB for a {shard_mib:.1f} MiB chunk"


def digest_of_weight(seed: int, device: str, *, draw_first: bool = False) -> bytes:
    """What the ranks compare before a scatter of a deferred ``nn.Linear``'s weight (Note [Ranks must agree on a
    deferred source]), as this process would send it when built from ``seed`` on ``device``."""
    torch.manual_seed(seed)

    def make() -> nn.Module:
        if draw_first:
            torch.randn(2)
        return nn.Linear(16, 32, device=device)

    model = deferred_init(make)
    mode = recording_mode(model.weight)
    assert mode is not None
    ref, storage = mode.ref_and_storage_of(model.weight)
    assert ref is not None
    return digest_of(mode.record, {ref: storage})


def test_ranks_that_built_alike_agree_on_a_source_whatever_their_device_index() -> None:
    assert digest_of_weight(0, "cpu") == digest_of_weight(0, "cpu")
    with fake_mode(fake_cuda=True):  # rank r builds on cuda:r
        assert digest_of_weight(0, "cuda:0") == digest_of_weight(0, "cuda:1")


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_ranks_seeded_apart_or_that_drew_otherwise_disagree_on_a_source(device: str) -> None:
    with fake_mode(fake_cuda=True):
        alike = digest_of_weight(0, device)
        assert digest_of_weight(1, device) != alike
        assert digest_of_weight(0, device, draw_first=True) != alike
