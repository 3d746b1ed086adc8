"""torchtitan's own models and parallelization entry points, run on deferred models as its users run them.

Its Llama3 and DeepSeek-V3 (toy sizes of its own configs, its own initializers through its own ``init_weights()``)
are built under ``deferred_init``, laid out by its ``parallelize_llama`` / ``parallelize_deepseekv3`` with a
``ParallelDims`` (FSDP, HSDP, tensor and expert parallelism) on torch's fake process group, one rank at a time in
this process, then materialized. Each local shard must be the slice of torchtitan's model built and initialized
eagerly on one device (same seed) that its DTensor placements name, and the default generator must end where
eager construction leaves it. tests/torchtitan_models.py says how the setup follows torchtitan's trainer;
tests/test_torchtitan_gloo.py trains a step on real gloo ranks.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import (
    _compute_local_shape_and_global_offset as compute_local_shape_and_global_offset,
)

from modattrs.deferred import deferred_init, is_deferred, materialize_module
from tests.support.kernels import torchs_kernels_draw

try:
    from tests import torchtitan_models as titan
except ImportError as error:  # torchtitan not installed, or its model code needs what this torch lacks
    pytest.skip(
        f"torchtitan's model code does not import on torch {torch.__version__}: {error}", allow_module_level=True
    )


@functools.cache
def eager(config_fn: Callable[[], Any]) -> tuple[nn.Module, torch.Tensor]:
    """torchtitan's model built and initialized on one device from seed 0, and the generator's state after it (the
    same for every rank of every layout: made once)."""
    torch.manual_seed(0)
    model = titan.built_and_initialized(config_fn())
    return model, torch.get_rng_state()


def deferred_and_parallelized(config_fn: Callable[[], Any], dims: Any) -> nn.Module:
    torch.manual_seed(0)
    model = deferred_init(titan.built_and_initialized, config_fn())
    model = titan.parallelize(model, dims)
    materialize_module(model)
    return model


def assert_eager_slices(model: nn.Module, reference: nn.Module, where: str) -> None:
    assert not is_deferred(model)
    parameters = dict(model.named_parameters())
    assert parameters.keys() == dict(reference.named_parameters()).keys()
    for name, parameter in parameters.items():
        full = reference.get_parameter(name).detach()
        assert isinstance(parameter, DTensor), name
        local, expected_local = parameter.to_local(), slice_of(full, parameter)
        assert local.dtype == expected_local.dtype, name
        assert torch.equal(local, expected_local), f"{name}: {where} differs from the eager slice"
    for name, buffer in model.named_buffers():
        full = reference.get_buffer(name)
        if isinstance(buffer, DTensor):  # tensor parallelism distributes buffers too (replicated, for RoPE's)
            buffer, full = buffer.to_local(), slice_of(full, buffer)
        assert torch.equal(buffer, full), f"buffer {name}: {where} differs from eager"


def slice_of(full: torch.Tensor, parameter: DTensor) -> torch.Tensor:
    """The region of ``full`` that ``parameter``'s placements give this rank. The coordinate is found from the
    global rank: a mesh that torch builds for a second fake process group in one process can keep the
    coordinate of the first (``get_coordinate()`` said (0,) on rank 4 of 8), which would name another rank's slice."""
    mesh = parameter.device_mesh
    coordinate = [int(index) for index in (mesh.mesh == dist.get_rank()).nonzero()[0]]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh.shape, coordinate, parameter.placements)
    return full[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]


def check(config_fn: Callable[[], Any], world: int, rank: int, layout: dict[str, int]) -> None:
    reference, state_after_eager = eager(config_fn)
    with titan.fake_rank(world, rank):
        model = deferred_and_parallelized(config_fn, titan.parallel_dims(world, **layout))
        assert_eager_slices(model, reference, f"rank {rank} of {world} ({layout})")
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def tiny_llama3() -> Any:
    return titan.llama3_config(layers=1, dim=16, heads=2, vocab=256)


def deepseek_v3() -> Any:
    return titan.deepseek_v3_config(ep=False)


def deepseek_v3_with_ep() -> Any:
    return titan.deepseek_v3_config(ep=True)


def ranks(world: int) -> list[int]:
    return [0, world // 2, world - 1]


def cases(world: int, layout: dict[str, int]) -> list[Any]:
    name = "-".join(f"{axis}{degree}" for axis, degree in layout.items()) or "fsdp"
    return [pytest.param(world, rank, layout, id=f"{name}-rank{rank}of{world}") for rank in ranks(world)]


@pytest.mark.parametrize(
    ("world", "rank", "layout"),
    [
        *cases(8, {}),
        *cases(64, {}),
        *cases(8, {"dp_replicate": 2}),
        *cases(8, {"tp": 8}),
        *cases(8, {"tp": 2}),
        *cases(8, {"dp_replicate": 2, "tp": 2}),
    ],
)
def test_a_rank_of_parallelize_llama_holds_the_slices_of_torchtitans_eager_llama3(
    world: int, rank: int, layout: dict[str, int]
) -> None:
    check(titan.llama3_config, world, rank, layout)


# HSDP, 128 replicas of 8 shards: FSDP2 makes one empty chunk per rank of its shard dimension, each of them a
# recorded operation on a deferred model (1-D FSDP over 1024 ranks takes about a minute to shard this toy model).
@pytest.mark.parametrize(
    ("world", "rank", "layout"),
    [
        pytest.param(1024, rank, {"dp_replicate": 128}, id=f"dp_replicate128-rank{rank}of1024")
        for rank in (0, 517, 1023)
    ],
)
def test_a_rank_of_1024_holds_its_slices_of_a_tiny_llama3(world: int, rank: int, layout: dict[str, int]) -> None:
    check(tiny_llama3, world, rank, layout)


@pytest.mark.parametrize(
    ("world", "rank", "layout"),
    [
        *cases(8, {}),
        *cases(64, {}),
        *cases(8, {"ep": 4}),
        *cases(64, {"dp_replicate": 2, "tp": 2, "ep": 8}),
    ],
)
def test_a_rank_of_parallelize_deepseekv3_holds_the_slices_of_torchtitans_eager_deepseek_v3(
    world: int, rank: int, layout: dict[str, int]
) -> None:
    check(deepseek_v3_with_ep if layout.get("ep", 1) > 1 else deepseek_v3, world, rank, layout)


def drawn_by_kind(run: Callable[[], object]) -> tuple[int, int, int]:
    """The elements that the random fills run by ``run`` write, counted by torch's profiler: ``uniform_``'s,
    ``normal_``'s into windows of a rank's part (1-D: see ``modattrs/_deferred/windows.py``), and ``normal_``'s of
    whole tensors (a fill the replay does not make alone)."""
    with (
        torchs_kernels_draw(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile,
    ):
        run()
    uniform = parts = whole = 0
    for event in profile.events():
        if event.name not in ("aten::uniform_", "aten::normal_") or not event.input_shapes:
            continue
        parent = event.cpu_parent
        if parent is not None and parent.name == event.name:
            continue  # the same fill, counted once
        shape = event.input_shapes[0]
        elements = math.prod(shape)
        if event.name == "aten::uniform_":
            uniform += elements
        elif len(shape) == 1:
            parts += elements
        else:
            whole += elements
    return uniform, parts, whole


def span_of(full: torch.Tensor, parameter: DTensor) -> int:
    """How many elements of ``full``, in its order, lie from the first this rank holds to the last (its rows, or
    the rows a column cut of them runs through)."""
    region = slice_of(torch.arange(full.numel()).view(full.shape), parameter)
    return 0 if region.numel() == 0 else int(region.max() - region.min()) + 1


@pytest.mark.parametrize("layout", [{}, {"tp": 2}], ids=["fsdp", "fsdp-tp2"])
def test_a_rank_of_parallelize_llama_draws_no_constructors_fill_and_only_its_own_part_of_each_modelled_weight(
    layout: dict[str, int],
) -> None:
    # No weight is drawn whole. Every weight is one normal_ (its trunc_normal_ provably so), drawn over the rank's
    # span alone, however tensor parallelism sent it (a scatter of rank 0's chunks, torchtitan's default); the
    # fused wqkv, a copy_ of a cat of q, k and v, as the runs of q, k and v its rows come from (a run per input and
    # KV group); the output layer's trunc_normal_, whose bounds normal_ can reach, as rounds of normal_: its span,
    # then at most its span again where round 0 left elements out of bounds, then a few blocks (rng/rejection.py).
    world, rank = 8, 5
    reference, state_after_eager = eager(titan.llama3_config)
    with titan.fake_rank(world, rank):
        torch.manual_seed(0)
        model = deferred_init(titan.built_and_initialized, titan.llama3_config())
        model = titan.parallelize(model, titan.parallel_dims(world, **layout))
        uniform, parts, whole = drawn_by_kind(lambda: materialize_module(model, threads=1))
        assert_eager_slices(model, reference, f"rank {rank} of {world} ({layout})")
        spans = {
            name: span_of(reference.get_parameter(name), parameter)
            for name, parameter in model.named_parameters()
            if isinstance(parameter, DTensor)
        }
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    assert uniform == 0, f"drew {uniform} elements of constructors' kaiming_uniform_, which init_weights overwrites"
    assert whole == 0, f"drew {whole} elements of whole tensors"
    head = spans.pop("lm_head.weight")
    assert 0 < head < reference.get_parameter("lm_head.weight").numel()
    groups = 8  # llama3_config's heads: at most as many KV groups, each a run of q, of k and of v
    fused = sum(1 for name in spans if "wqkv" in name) * 3 * groups
    # normal_ draws blocks of 16 at a part's ends; a later round's part is a block around each element drawn again
    assert parts <= sum(spans.values()) + 2 * 16 * (len(spans) + fused) + 2 * (head + 2 * 16) + 16 * 16
