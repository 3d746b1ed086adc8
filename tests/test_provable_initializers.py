"""The initializers large models use, replayed at the cost of what a rank keeps where their draws are provable.

``nn.init.trunc_normal_`` whose bounds lie beyond anything ``normal_`` returns is one ``normal_`` (see Note
[trunc_normal_ as one normal_] in ``modattrs/_fake/trunc_normal.py``): recorded as such, a rank of an FSDP2 world
draws only its shard of it. Elsewhere it stays one opaque call, run for real, with eager values. Ranks run one at a
time in this process on torch's fake process group, as in ``tests/test_shard_local_replay.py``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from modattrs import _torch_changes
from modattrs._torch_private import TRUNC_NORMAL_HELPER
from modattrs.deferred import deferred_init, materialize_module, materialize_tensor
from modattrs.fake import fake_mode, is_fake
from tests.support.ranks import fake_world

# torch 2.8's helper is uniform_ then erfinv_, never one normal_; 2.13's and later are rejection samplers.
REJECTION_SAMPLER = "erfinv_" not in inspect.getsource(getattr(nn.init, TRUNC_NORMAL_HELPER))
needs_rejection_sampler = pytest.mark.skipif(
    not REJECTION_SAMPLER, reason="this torch's trunc_normal_ is not a rejection sampler: it is never one normal_"
)


class Block(nn.Module):
    """Weights initialized as torchtitan and timm do, with other draws between them."""

    def __init__(self, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.wide = nn.Parameter(torch.empty(96, 40, dtype=dtype))
        nn.init.trunc_normal_(self.wide, std=0.02, generator=generator)  # the vectorized path, 16 at a time
        self.bias = nn.Parameter(torch.empty(17, dtype=dtype).uniform_())
        self.odd = nn.Parameter(torch.empty(37, 3, dtype=dtype))
        nn.init.trunc_normal_(self.odd, mean=0.1, std=0.5, a=-20.0, b=20.0, generator=generator)  # last 16 redrawn
        self.tiny = nn.Parameter(torch.empty(3, 5, dtype=dtype))
        nn.init.trunc_normal_(self.tiny, std=0.02, generator=generator)  # the scalar path, pairs
        self.turned = nn.Parameter(torch.empty(6, 20, dtype=dtype))
        nn.init.trunc_normal_(self.turned.t(), std=0.02, generator=generator)  # not contiguous: the scalar path
        self.scaled = nn.Parameter(torch.empty(24, 8, dtype=dtype))
        nn.init.trunc_normal_(self.scaled, std=0.02 / math.sqrt(2 * 3), generator=generator)  # torchtitan's depth init


class Model(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)  # normal_
        nn.init.trunc_normal_(self.embed.weight, std=0.02, generator=generator)
        self.blocks = nn.ModuleList(Block(dtype, generator) for _ in range(2))
        self.head = nn.Linear(16, 50, bias=False)


def eager(make: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    return model, torch.get_rng_state()


def assert_same_bits(expected: torch.Tensor, got: torch.Tensor, name: str) -> None:
    assert got.dtype == expected.dtype, name
    assert got.shape == expected.shape, name
    integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
    assert torch.equal(got.detach().view(integer), expected.detach().view(integer)), f"{name} differs from eager"


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("how", ["whole model", "one tensor at a time"])
def test_trunc_normal_far_beyond_normals_reach_materializes_eagers_values_and_generator_state(
    dtype: torch.dtype, how: str
) -> None:
    reference, state_after_eager = eager(lambda: Model(dtype))
    torch.manual_seed(0)
    model = deferred_init(Model, dtype)
    if how == "whole model":
        materialize_module(model)
    else:
        for _, parameter in reversed(list(model.named_parameters())):  # any order
            materialize_tensor(parameter)
    for name, tensor in reference.state_dict().items():
        assert_same_bits(tensor, model.state_dict()[name], name)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_trunc_normal_from_a_generator_of_its_own_gets_that_generators_numbers_and_leaves_it_as_eager_code_does() -> (
    None
):
    generator = torch.Generator().manual_seed(7)
    reference, _ = eager(lambda: Model(generator=generator))
    state_after_eager = generator.get_state()
    generator.manual_seed(7)
    torch.manual_seed(0)
    model = deferred_init(Model, generator=generator)
    materialize_module(model)
    for name, tensor in reference.state_dict().items():
        assert_same_bits(tensor, model.state_dict()[name], name)
    assert torch.equal(generator.get_state(), state_after_eager)


def shard_of(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full.detach(), size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


def sharded(make: Callable[[], nn.Module], mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = deferred_init(make)
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize(
    ("size", "rank"), [(2, 1), (8, 0), (8, 4), (8, 7), (64, 0), (64, 63)], ids=lambda value: str(value)
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_rank_materializes_the_eager_slices_of_trunc_normal_weights_and_the_eager_generator_state(
    size: int, rank: int, dtype: torch.dtype
) -> None:
    reference, state_after_eager = eager(lambda: Model(dtype))
    with fake_world((size,), rank) as mesh:
        model = sharded(lambda: Model(dtype), mesh)
        materialize_module(model)
        for name, parameter in model.named_parameters():
            expected = shard_of(reference.get_parameter(name), size, rank)
            assert_same_bits(expected, parameter.to_local(), name)  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class Decoder(nn.Module):
    """Every weight drawn by ``trunc_normal_(std=0.02)``, as torchtitan's ``init_weights`` and timm do."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(4))
        for block in self.blocks:
            nn.init.trunc_normal_(block.weight, std=0.02)


def drawn_while_materializing(model: nn.Module) -> dict[str, int]:
    """The elements ``normal_`` and ``uniform_`` fill while ``model`` materializes, counted by torch's profiler
    (an event nested in one of its own name is the same call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        materialize_module(model, threads=1)
    drawn = {"normal_": 0, "uniform_": 0}
    for event in profile.events():
        kind = event.name.removeprefix("aten::")
        parent = event.cpu_parent
        if kind in drawn and (parent is None or parent.name != event.name) and event.input_shapes:
            drawn[kind] += math.prod(event.input_shapes[0])
    return drawn


@needs_rejection_sampler
def test_a_rank_of_an_8_rank_fsdp2_world_draws_only_about_its_shard_of_trunc_normal_weights() -> None:
    size, rank = 8, 3
    reference, state_after_eager = eager(Decoder)
    with fake_world((size,), rank) as mesh:
        model = sharded(Decoder, mesh)
        drawn = drawn_while_materializing(model)["normal_"]
        own = sum(parameter.to_local().numel() for parameter in model.parameters())  # type: ignore[attr-defined]
        for name, parameter in model.named_parameters():
            assert_same_bits(shard_of(reference.get_parameter(name), size, rank), parameter.to_local(), name)  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    whole = sum(parameter.numel() for parameter in reference.parameters())
    assert own == whole // size
    # its shard, and at most a block of 16 more on either side of each weight's rows (the vectorized path)
    assert drawn <= own + 2 * 16 * len(reference.blocks), f"drew {drawn} normals for a shard of {own} of {whole}"


class WithinReach(nn.Module):
    """``trunc_normal_`` whose bounds ``normal_`` can reach: rejection sampling (more than 30% of the mass
    inside), candidates and acceptance draws (less), or bounds too close to prove."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        self.before = nn.Parameter(torch.empty(40).normal_())
        self.weight = nn.Parameter(torch.empty(300, 7))
        nn.init.trunc_normal_(self.weight, std=0.02, a=low * 0.02, b=high * 0.02)
        self.after = nn.Parameter(torch.empty(33, 3).normal_())


BOUNDS_WITHIN_REACH = {
    "rejection, half a deviation": (-0.5, 0.5),
    "candidates and acceptance": (-0.1, 0.1),
    "one side near": (-0.5, 1e9),
    "beyond any value but too near to prove": (-12.0, 12.0),
}


@pytest.mark.parametrize("bounds", BOUNDS_WITHIN_REACH.values(), ids=BOUNDS_WITHIN_REACH.keys())
@pytest.mark.parametrize(("size", "rank"), [(1, 0), (8, 5)], ids=str)
def test_trunc_normal_with_bounds_within_normals_reach_is_drawn_through_with_eagers_values(
    bounds: tuple[float, float], size: int, rank: int
) -> None:
    make = lambda: WithinReach(*bounds)  # noqa: E731
    reference, state_after_eager = eager(make)
    with fake_world((size,), rank) as mesh:
        model = sharded(make, mesh)
        materialize_module(model)
        for name, parameter in model.named_parameters():
            expected = shard_of(reference.get_parameter(name), size, rank)
            assert_same_bits(expected, parameter.to_local(), name)  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def uniform_then_erfinv(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """torch 2.8's helper: never one ``normal_``, whatever the bounds."""

    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    with torch.no_grad():
        low, high = norm_cdf((a - mean) / std), norm_cdf((b - mean) / std)
        tensor.uniform_(2 * low - 1, 2 * high - 1, generator=generator)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
    return tensor


def test_a_trunc_normal_helper_that_is_not_one_normal_is_run_as_it_is_with_its_own_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _torch_changes.install()
    monkeypatch.setattr(nn.init, "_no_grad_trunc_normal_", uniform_then_erfinv)
    reference, state_after_eager = eager(Model)
    monkeypatch.setattr(nn.init, "_no_grad_trunc_normal_", _torch_changes._trunc_normal_for_fakes(uniform_then_erfinv))
    torch.manual_seed(0)
    model = deferred_init(Model)
    materialize_module(model)
    for name, tensor in reference.state_dict().items():
        assert_same_bits(tensor, model.state_dict()[name], name)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


@pytest.mark.parametrize("fake_cuda", [False, True], ids=["cpu", "spoofed cuda"])
def test_trunc_normal_of_fakes_in_fake_mode_writes_nothing_and_keeps_the_tensor(fake_cuda: bool) -> None:
    device = "cuda:1" if fake_cuda else "cpu"
    with fake_mode(fake_cuda=fake_cuda), torch.device(device):
        layer = nn.Linear(8, 8)
        returned = nn.init.trunc_normal_(layer.weight, std=0.02)
        beyond = nn.init.trunc_normal_(torch.empty(4, 4), std=0.02, a=-0.01, b=0.01)
    assert returned is layer.weight
    assert is_fake(returned)
    assert is_fake(beyond)
    assert returned.device == torch.device(device)


def test_a_spoofed_cuda_record_of_trunc_normal_materializes_on_the_cpu_with_eager_cpu_values() -> None:
    reference, _ = eager(Model)  # eager CUDA draws would not move the CPU generator: its state is not compared
    with fake_mode(fake_cuda=True):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = deferred_init(Model)
    assert model.embed.weight.device.type == "cuda"
    materialize_module(model, device="cpu")
    for name, tensor in reference.state_dict().items():
        assert_same_bits(tensor, model.state_dict()[name], name)


class FusedQKV(nn.Module):
    """A fused projection whose constructor's ``kaiming_uniform_`` a ``copy_`` then overwrites (torchtitan's
    ``wqkv``), whole or, as a control, in part."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.wqkv = nn.Linear(32, 96, bias=False)
        weight = self.wqkv.weight
        # torchtitan makes q, k and v with new_empty on the weight: reads of its dtype and device, not of its values
        made = weight.new_empty if how == TORCHTITANS else torch.empty
        q, k, v = (made(32, 32).normal_() for _ in range(3))
        with torch.no_grad():
            if how in ("a cat", TORCHTITANS):
                weight.copy_(torch.cat([q, k, v]))
            elif how == "a cat, through a transposed view":
                weight.t().copy_(torch.cat([q, k, v]).t())
            elif how == "heads interleaved":
                weight.view(3, 32, 32).transpose(0, 1).copy_(torch.stack([q, k, v], dim=1))
            else:
                weight[:64].copy_(torch.cat([q, k]))


TORCHTITANS = "a cat of parts made by new_empty on the weight"
OVERWRITES = ["a cat", "a cat, through a transposed view", "heads interleaved", TORCHTITANS]


@pytest.mark.parametrize("how", [*OVERWRITES, "in part"])
@pytest.mark.parametrize(("size", "rank"), [(1, 0), (8, 6)], ids=str)
def test_a_fill_a_copy_overwrites_whole_is_jumped_over_not_drawn_and_values_are_eagers(
    how: str, size: int, rank: int
) -> None:
    make = lambda: FusedQKV(how)  # noqa: E731
    reference, state_after_eager = eager(make)
    with fake_world((size,), rank) as mesh:
        model = sharded(make, mesh)
        drawn = drawn_while_materializing(model)["uniform_"]
        for name, parameter in model.named_parameters():
            expected = shard_of(reference.get_parameter(name), size, rank)
            assert_same_bits(expected, parameter.to_local(), name)  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    if how in OVERWRITES:
        assert drawn == 0, f"drew {drawn} elements of the constructor's kaiming_uniform_"
    else:
        assert drawn > 0  # the rows the copy leaves are the constructor's


class Concatenated(nn.Module):
    """A weight that a ``copy_`` overwrites with a ``cat`` of parts drawn whole, each ``normal_`` (no generator
    state between them), in several layouts: torchtitan's KV groups and simpler ones, and, as a control, a part
    that is not contiguous."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        groups, per_group, head, width = 4, 2, 8, 64
        self.proj = nn.Linear(width, groups * (per_group + 2) * head, bias=False)
        weight = self.proj.weight
        q = weight.new_empty(groups * per_group * head, width)
        k = weight.new_empty(groups * head, width)
        v = weight.new_empty(groups * head, width)
        for part in (q, k, v):
            nn.init.normal_(part, std=0.02)  # trunc_normal_ on 2.13 and later; 2.8's is uniform_ then erfinv_
        if layout == "kv groups":  # torchtitan's fused wqkv (models/common/config_utils.py)
            parts = [
                q.view(groups, per_group, head, width),
                k.view(groups, 1, head, width),
                v.view(groups, 1, head, width),
            ]
            fused = torch.cat(parts, dim=1).view(-1, width)
        elif layout == "rows":
            fused = torch.cat([q, k, v])
        elif layout == "columns":
            fused = torch.cat([q.view(-1, 4 * width), k.view(-1, 2 * width), v.view(-1, 2 * width)], dim=1)
            fused = fused.view(-1, width)
        else:  # a part read through a transposed view
            turned = q.view(width, -1).t()
            fused = torch.cat([turned, k.view(-1, width)[: turned.shape[0]], v.view(-1, width)[: turned.shape[0]]])
            fused = fused.reshape(-1, width)[: weight.shape[0]]
        with torch.no_grad():
            weight.copy_(fused)


CAT_LAYOUTS = ["kv groups", "rows", "columns"]


@pytest.mark.parametrize("layout", [*CAT_LAYOUTS, "a transposed part"])
@pytest.mark.parametrize(("size", "rank"), [(8, 0), (8, 3), (8, 7), (64, 63)], ids=str)
def test_a_rank_draws_only_the_runs_of_the_parts_its_rows_of_a_cat_come_from(layout: str, size: int, rank: int) -> None:
    make = lambda: Concatenated(layout)  # noqa: E731
    reference, state_after_eager = eager(make)
    with fake_world((size,), rank) as mesh:
        model = sharded(make, mesh)
        drawn = drawn_while_materializing(model)
        own = model.proj.weight.to_local()
        assert_same_bits(shard_of(reference.proj.weight, size, rank), own, f"{layout}, rank {rank} of {size}")
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    assert drawn["uniform_"] == 0  # the constructor's kaiming_uniform_ is overwritten whole
    whole = reference.proj.weight.numel()
    if layout in CAT_LAYOUTS:
        # a run of each part per KV group at most, each drawn in blocks of 16 (at most 15 more at either end)
        assert drawn["normal_"] <= own.numel() + 2 * 16 * (3 * 4 + 2), f"drew {drawn['normal_']} for {own.numel()}"
    else:  # an input the replay does not cut (not contiguous): drawn whole, with eager's values
        assert drawn["normal_"] >= whole // 2
