"""``trunc_normal_`` whose bounds ``normal_`` can reach, replayed as rounds of ``normal_`` (Note [trunc_normal_ as
rounds of normal_] in ``modattrs/_deferred/rng/rejection.py``): any part of it, bit for bit, at about twice the
part's cost, and its rounds found without holding the tensor. Ranks run one at a time in this process on torch's
fake process group, as in ``tests/test_provable_initializers.py``."""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from collections.abc import Callable, Iterator
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.fsdp import fully_shard

from modattrs._deferred.rng import draws, rejection
from modattrs._deferred.rng.mt19937 import jumped_state
from modattrs._torch_private import TRUNC_NORMAL_HELPER
from modattrs.deferred import deferred_init, materialize_module
from tests.support.ranks import fake_world

HELPER = getattr(nn.init, TRUNC_NORMAL_HELPER)
pytestmark = pytest.mark.skipif(
    "erfinv_" in inspect.getsource(HELPER),
    reason="this torch's trunc_normal_ is uniform_ then erfinv_ (2.8): one fill, never rounds of normal_",
)

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def mass_inside(low: float, high: float) -> float:
    return (math.erf(high / math.sqrt(2)) - math.erf(low / math.sqrt(2))) / 2


@contextlib.contextmanager
def cut_small(chunk: int, jump: int) -> Iterator[None]:
    """Rounds drawn in chunks of ``chunk`` elements, and later rounds' parts joined only when less than ``jump``
    outputs apart: the cuts and jumps of a tensor of billions of elements, on a small one."""
    with mock.patch.object(rejection, "_CHUNK", chunk), mock.patch.object(draws, "JUMP_COST", jump):
        yield


@st.composite
def runs_of(draw: st.DrawFn, numel: int) -> list[range]:
    cuts = sorted(set(draw(st.lists(st.integers(0, numel), max_size=8))) | {0, numel})
    kept = draw(st.lists(st.booleans(), min_size=len(cuts) - 1, max_size=len(cuts) - 1))
    runs: list[range] = []
    for (start, stop), keep in zip(itertools.pairwise(cuts), kept, strict=True):
        if keep and start < stop and (not runs or start - runs[-1].stop >= 32):  # blocks apart, as windows give them
            runs.append(range(start, stop))
    return runs


@settings(max_examples=120, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    numel=st.integers(16, 1500),
    mean=st.floats(-1, 1),
    std=st.floats(0.01, 2),
    low=st.floats(-3.5, -0.05),
    high=st.floats(0.05, 3.5),
    seed=st.integers(0, 2**32 - 1),
    ahead=st.integers(0, 300),
    cuts=st.sampled_from([(64, 16), (1 << 22, 16), (1 << 22, draws.JUMP_COST)]),
    threads=st.sampled_from([1, 3]),
    data=st.data(),
)
def test_any_runs_of_rounds_of_normal_are_the_helpers_values_and_the_generator_goes_where_it_does(
    dtype: torch.dtype,
    numel: int,
    mean: float,
    std: float,
    low: float,
    high: float,
    seed: int,
    ahead: int,
    cuts: tuple[int, int],
    threads: int,
    data: st.DataObject,
) -> None:
    assume(mass_inside(low, high) > 0.3)
    a, b = mean + low * std, mean + high * std
    generator = torch.Generator().manual_seed(seed)
    state = generator.get_state()
    generator.set_state(jumped_state(state, ahead))
    eager = HELPER(torch.empty(numel, dtype=dtype), mean, std, a, b, generator=generator)
    found = rejection.sampler(HELPER, (torch.empty(numel, dtype=dtype, device="meta"), mean, std, a, b), {})
    assert found is not None
    runs = data.draw(runs_of(numel))
    out = torch.full((numel,), 7.0, dtype=dtype)
    with cut_small(*cuts):
        model = found.in_rounds(found.rounds_from(jumped_state(state, ahead), threads))
        end, position = model.draw_runs(state, ahead, runs, out, 0)
    for run in runs:
        assert torch.equal(bits(out[run.start : run.stop]), bits(eager[run.start : run.stop])), run
    assert torch.equal(model.state_after(jumped_state(state, ahead)), generator.get_state())
    if runs:  # where the last private generator stopped is where the walk goes on from
        assert end is not None
        assert 0 < position <= model.outputs(state)
        assert torch.equal(end, jumped_state(state, ahead + position))
    else:
        assert (end, position) == (None, 0)


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_rounds_of_a_tensor_are_found_in_chunks_of_it_with_the_helpers_count(threads: int) -> None:
    weight = torch.empty(5000)
    generator = torch.Generator().manual_seed(3)
    state = generator.get_state()
    found = rejection.sampler(HELPER, (weight, 0.0, 1.0, -1.0, 1.0), {})
    assert found is not None
    with cut_small(64, 16):
        rounds = found.rounds_from(state, threads)
    HELPER(weight, 0.0, 1.0, -1.0, 1.0, generator=generator)
    outputs = found.normal.outputs(state)
    assert rounds >= 5  # a third of the mass outside: several rounds, each a whole normal_ of 5,000
    assert torch.equal(generator.get_state(), jumped_state(state, rounds * outputs))


def merging_where_in_bounds(
    tensor: torch.Tensor, mean: float, std: float, a: float, b: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A helper that redraws the elements in bounds, not those out of them: not what the model describes."""
    with torch.no_grad():
        result = tensor.normal_(mean, std, generator=generator)
        for _ in range(3):
            inside = (result >= a) & (result <= b)
            result = torch.where(inside, torch.empty_like(result).normal_(mean, std, generator=generator), result)
        tensor.copy_(result)
    return tensor


def test_a_helper_that_samples_otherwise_is_not_modelled_and_stays_an_opaque_call() -> None:
    assert rejection.helper_samples_by_rounds(HELPER)
    assert not rejection.helper_samples_by_rounds(merging_where_in_bounds)


class Head(nn.Module):
    """torchtitan's output layer init: ``trunc_normal_`` cut at 3 standard deviations, which ``normal_`` reaches,
    with fills of other paths around it."""

    def __init__(self, vocab: int = 300, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.trunc_normal_(self.embed.weight, std=1.0, a=-2.0, b=3.0)
        self.norm = nn.Parameter(torch.ones(dim))
        self.output = nn.Linear(dim, vocab, bias=False)  # its kaiming_uniform_ is overwritten whole
        std = dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
        self.odd = nn.Parameter(torch.empty(37, 3))  # the last 16 redrawn by each round
        nn.init.trunc_normal_(self.odd, mean=0.1, std=0.5, a=-0.6, b=0.4)
        self.tiny = nn.Parameter(torch.empty(3, 5))  # the scalar path: run whole, as it is
        nn.init.trunc_normal_(self.tiny, std=0.02, a=-0.03, b=0.03)
        self.after = nn.Parameter(torch.empty(40, 4).normal_())


def eager(make: Callable[[], nn.Module]) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = make()
    return model, torch.get_rng_state()


def shard_of(full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full.detach(), size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


def sharded(make: Callable[[], nn.Module], size: int, rank: int) -> contextlib.AbstractContextManager[nn.Module]:
    @contextlib.contextmanager
    def run() -> Iterator[nn.Module]:
        with fake_world((size,), rank) as mesh:
            torch.manual_seed(0)
            model = deferred_init(make)
            fully_shard(model, mesh=mesh)
            yield model

    return run()


@pytest.mark.parametrize(("size", "rank"), [(1, 0), (2, 1), (8, 0), (8, 3), (8, 7), (64, 0), (64, 63)], ids=str)
def test_every_rank_materializes_the_eager_slices_of_weights_drawn_in_rounds_and_the_eager_generator_state(
    size: int, rank: int
) -> None:
    reference, state_after_eager = eager(Head)
    with sharded(Head, size, rank) as model:
        materialize_module(model)
        for name, parameter in model.named_parameters():
            expected = shard_of(reference.get_parameter(name), size, rank)
            assert torch.equal(bits(parameter.to_local()), bits(expected)), name  # type: ignore[attr-defined]
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def normals_drawn(run: Callable[[], object]) -> tuple[int, int]:
    """The elements ``normal_`` fills while ``run`` runs, as parts (1-D) and as whole tensors, counted by torch's
    profiler (an event nested in one of its own name is the same call)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
        run()
    parts = whole = 0
    for event in profile.events():
        parent = event.cpu_parent
        if event.name != "aten::normal_" or not event.input_shapes or (parent and parent.name == event.name):
            continue
        if len(event.input_shapes[0]) == 1:
            parts += math.prod(event.input_shapes[0])
        else:
            whole += math.prod(event.input_shapes[0])
    return parts, whole


def test_a_rank_draws_about_twice_its_shard_of_an_output_layer_cut_at_3_deviations_not_every_round_of_it() -> None:
    make = lambda: Head(vocab=4096, dim=64)  # noqa: E731
    reference, state_after_eager = eager(make)
    size, rank = 8, 5
    with sharded(make, size, rank) as model:
        parts, whole = normals_drawn(lambda: materialize_module(model, threads=1))
        own = model.output.weight.to_local()
        assert torch.equal(bits(own), bits(shard_of(reference.output.weight, size, rank)))
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    full = reference.output.weight.numel()
    assert whole <= 2 * 2 * 16 * 3 + 4 * 40  # the scalar path's rounds of `tiny`, and `after`
    # the embedding and `odd` in parts, then the output layer: its shard, again at most, and blocks of 16
    others = shard_of(reference.embed.weight, size, rank).numel() * 4 + 4 * reference.odd.numel() + 4 * 16
    assert own.numel() == full // size
    assert parts <= 2 * own.numel() + 16 * 16 + others, f"drew {parts} normals for a shard of {own.numel()} of {full}"


def largest_allocation(run: Callable[[], object]) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        run()
    return max((event.cpu_memory_usage for event in profile.events()), default=0)


class WideHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2048, 8192))  # 64 MB
        nn.init.trunc_normal_(self.weight, std=0.01, a=-0.03, b=0.03)


def test_neither_deferred_init_nor_a_rank_holds_a_weight_drawn_in_rounds_whole() -> None:
    weight_bytes = 2048 * 8192 * 4
    made: list[nn.Module] = []
    torch.manual_seed(0)
    # deferred_init puts the generator past the rounds, which it counts chunk by chunk (16 MB each)
    assert largest_allocation(lambda: made.append(deferred_init(WideHead))) <= weight_bytes // 4
    reference, state_after_eager = eager(WideHead)
    assert torch.equal(torch.get_rng_state(), state_after_eager)  # what deferred_init left, from seed 0 too
    size, rank = 8, 2
    with sharded(WideHead, size, rank) as model:
        assert largest_allocation(lambda: materialize_module(model, threads=1)) <= weight_bytes // size
        assert torch.equal(bits(model.weight.to_local()), bits(shard_of(reference.weight, size, rank)))


@pytest.mark.parametrize("threads", [1, 2])
def test_a_whole_materialization_draws_rounds_of_normal_into_the_weight_without_the_helpers_temporaries(
    threads: int,
) -> None:
    weight_bytes = 2048 * 8192 * 4
    reference, state_after_eager = eager(WideHead)
    torch.manual_seed(0)
    model = deferred_init(WideHead)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        materialize_module(model, threads=threads)
    # the weight is the one allocation of its size (the helper makes a fresh draw and a merge each round)
    assert [event.cpu_memory_usage >= weight_bytes for event in profile.events()].count(True) == 1
    assert torch.equal(bits(model.weight), bits(reference.weight))
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class OnTwoDevices(nn.Module):
    """A weight drawn in rounds between draws of another device's generator: replayed on the CPU, those draws move
    the CPU generator too, so the state before the rounds is not the recorded devices' one."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.first = nn.Linear(64, 64, device=device)
        self.cut = nn.Parameter(torch.empty(64, 64, device="cpu"))
        nn.init.trunc_normal_(self.cut, std=1.0, a=-1.5, b=2.0)
        self.after = nn.Linear(8, 8, device="cpu")


def test_a_record_of_another_device_materialized_on_the_cpu_counts_the_rounds_from_the_cpus_states() -> None:
    torch.manual_seed(5)
    reference = OnTwoDevices("cpu")
    torch.manual_seed(5)
    model = deferred_init(OnTwoDevices, "cuda")  # counted when deferred_init returns, from the CPU draws alone
    materialize_module(model, device="cpu")
    for name, tensor in reference.state_dict().items():
        assert torch.equal(bits(model.state_dict()[name]), bits(tensor)), name


class AfterPoisson(nn.Module):
    """A draw whose count of outputs depends on values (``poisson``) before a weight drawn in rounds, and a reseed at
    the end, so that ``deferred_init`` leaves the rounds uncounted."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("counts", torch.poisson(torch.ones(50) * 30))
        self.inner = nn.Module()
        self.inner.cut = nn.Parameter(torch.empty(64, 64))
        nn.init.trunc_normal_(self.inner.cut, std=1.0, a=-1.5, b=2.0)
        self.rows = nn.Parameter(self.inner.cut.detach()[:8].clone())
        self.after = nn.Linear(8, 8)
        torch.manual_seed(1234)


@pytest.mark.parametrize("seed", range(8))
def test_rounds_counted_while_materializing_come_after_the_value_dependent_draws_before_them(seed: int) -> None:
    torch.manual_seed(seed)
    reference = AfterPoisson()
    torch.manual_seed(seed)
    model = deferred_init(AfterPoisson)
    # the rows cut from the weight, not the weight: a window of it, planned before anything runs
    materialize_module(model, check_fn=lambda module: module is model or module is model.after)
    for name in ("counts", "rows", "after.weight", "after.bias"):
        assert torch.equal(bits(model.state_dict()[name]), bits(reference.state_dict()[name])), name
