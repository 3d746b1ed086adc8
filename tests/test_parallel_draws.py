"""One random operation filled by several threads (``Pattern.draw_into``) writes what the operation writes.

The reference is torch itself: the operation runs whole, on a tensor of the same layout in a storage of its own,
from a generator set to the same state; ``draw_into`` must leave every byte of its own storage (gaps between
elements included) and the state after exactly as that run leaves them, for any number of threads.
``jump_cost=0`` splits small results into ``threads`` ranges, so that every boundary case is cheap to reach.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import threading
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modattrs._deferred.rng import draws

aten = torch.ops.aten
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
THREADS = (1, 2, 3, 8)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- helpers ---------------------------------------------------------------------------------------------------------


def alike(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor with ``tensor``'s dtype, shape, strides and storage offset, in a zeroed storage of its own."""
    storage = torch.zeros(tensor.untyped_storage().nbytes() // tensor.element_size(), dtype=tensor.dtype)
    return storage.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def storage_bits(tensor: torch.Tensor) -> torch.Tensor:
    """Every byte of ``tensor``'s storage."""
    return torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage())


def start_state(drawn: int, cached_normal: bool = False) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(4321)
    if drawn:
        torch.empty(drawn, dtype=torch.float32).uniform_(generator=generator)
    if cached_normal:
        torch.empty(1, dtype=torch.float64).normal_(generator=generator)  # the scalar path caches a second normal
    return generator.get_state()


STATES = {"mid-block": (5, False), "with a cached normal": (9, True), "near a block's end": (620, False)}


def check_draw_into(
    op: Callable[..., object],
    parameters: tuple[object, ...],
    layout: torch.Tensor,
    state: torch.Tensor,
    threads: int,
    jump_cost: int = 0,
) -> None:
    """``draw_into`` on a tensor like ``layout`` against ``op`` run whole on another, from ``state``."""
    model = draws.pattern(op, (layout, *parameters), {})
    assert model is not None, f"{op} is not modelled for {layout.dtype}, {tuple(layout.shape)}, {layout.stride()}"
    expected = alike(layout)
    generator = torch.Generator()
    generator.set_state(state)
    op(expected, *parameters, generator=generator)
    out = alike(layout)
    after = model.draw_into(out, state, threads, jump_cost=jump_cost)
    assert torch.equal(storage_bits(out), storage_bits(expected)), f"{threads} threads"
    assert torch.equal(after, generator.get_state()), f"{threads} threads: the state after"


IN_PLACE: dict[str, tuple[Callable[..., object], tuple[object, ...], tuple[torch.dtype, ...]]] = {
    "uniform_": (aten.uniform_.default, (-0.5, 2.0), tuple(FLOATS)),
    "normal_": (aten.normal_.default, (0.25, 3.0), tuple(FLOATS)),
    "log_normal_": (aten.log_normal_.default, (0.0, 0.5), tuple(FLOATS)),
    "bernoulli_": (aten.bernoulli_.float, (0.3,), (torch.float32, torch.float16, torch.int64, torch.bool)),
    "random_": (aten.random_.default, (), (torch.float64, torch.bfloat16, torch.int64, torch.int32, torch.uint8)),
    "random_ from to": (getattr(aten.random_, "from"), (-3, 100), (torch.float16, torch.int32, torch.int8)),
    "random_ over 2^30": (getattr(aten.random_, "from"), (-3, 2**30), (torch.float64, torch.int64)),
    "exponential_": (aten.exponential_.default, (1.5,), (torch.float32, torch.float64)),
    "cauchy_": (aten.cauchy_.default, (0.5, 2.0), (torch.float32, torch.bfloat16)),
    "geometric_": (aten.geometric_.default, (0.25,), (torch.float32, torch.int64)),
}

LAYOUTS: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "7": lambda dtype: torch.zeros(7, dtype=dtype),
    "37": lambda dtype: torch.zeros(37, dtype=dtype),
    "1003": lambda dtype: torch.zeros(1003, dtype=dtype),
    "3x5x16 contiguous": lambda dtype: torch.zeros(3, 5, 16, dtype=dtype),
    "a transposed 40x33 weight": lambda dtype: torch.zeros(33, 40, dtype=dtype).t(),
    "columns 3 to 17 of 9x20": lambda dtype: torch.zeros(9, 20, dtype=dtype)[:, 3:17],
    "channels_last 2x3x5x4": lambda dtype: torch.zeros(2, 3, 5, 4, dtype=dtype).to(memory_format=torch.channels_last),
    "a permuted box with gaps": lambda dtype: torch.zeros(6, 7, 5, dtype=dtype)[1:5, :, 1:4].transpose(0, 2),
}


def in_place_cases() -> Iterator[object]:
    for name, (op, parameters, dtypes) in IN_PLACE.items():
        for dtype in dtypes:
            yield pytest.param(op, parameters, dtype, id=f"{name}-{str(dtype)[6:]}")


# --- what draw_into writes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "parameters", "dtype"), list(in_place_cases()))
def test_draw_into_writes_what_the_whole_operation_writes_for_every_layout_state_and_thread_count(
    op: Callable[..., object], parameters: tuple[object, ...], dtype: torch.dtype
) -> None:
    for make in LAYOUTS.values():
        for drawn, cached in STATES.values():
            for threads in THREADS:
                check_draw_into(op, parameters, make(dtype), start_state(drawn, cached), threads)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("numel", [16, 17, 31, 32, 48, 50, 100])
def test_the_block_path_keeps_its_redrawn_tail_whatever_the_split(numel: int, dtype: torch.dtype) -> None:
    for threads in range(1, 9):
        check_draw_into(aten.normal_.default, (0.0, 1.0), torch.zeros(numel, dtype=dtype), start_state(3), threads)


@pytest.mark.parametrize(
    ("name", "op", "leading", "dtype"),
    [
        ("randn", aten.randn.generator, (), torch.float16),
        ("rand", aten.rand.generator, (), torch.float64),
        ("randint", aten.randint.low_generator, (-7, 9), torch.int16),
        ("normal(mean, std, size)", aten.normal.float_float, (2.0, 0.5), torch.bfloat16),
    ],
)
def test_draw_into_fills_the_result_of_a_random_factory_as_the_factory_makes_it(
    name: str, op: Callable[..., torch.Tensor], leading: tuple[object, ...], dtype: torch.dtype
) -> None:
    generator = torch.Generator()
    for size in ([7], [100], [3, 5, 37]):
        model = draws.pattern(op, (*leading, size), {"generator": generator, "dtype": dtype})
        assert model is not None
        for threads in THREADS:
            state = start_state(11, cached_normal=True)
            generator.set_state(state)
            expected = op(*leading, size, generator=generator, dtype=dtype)
            out = torch.empty(size, dtype=dtype)
            assert torch.equal(model.draw_into(out, state, threads, jump_cost=0), generator.get_state())
            assert torch.equal(storage_bits(out), storage_bits(expected)), f"{name} {size}, {threads} threads"


def test_draw_into_fills_a_like_factory_in_the_layout_it_preserves() -> None:
    source = torch.zeros(33, 40).t()
    model = draws.pattern(aten.randn_like.default, (source,), {})
    assert model is not None
    for threads in THREADS:
        state = start_state(2)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            expected = torch.randn_like(source)  # the default generator: torch 2.8's randn_like takes no other
            after = torch.get_rng_state()
        out = torch.empty_like(source)
        assert torch.equal(model.draw_into(out, state, threads, jump_cost=0), after)
        assert torch.equal(storage_bits(out), storage_bits(expected))


@settings(max_examples=80, deadline=None)
@given(
    op=st.sampled_from(["uniform_", "normal_", "log_normal_", "random_ from to", "bernoulli_"]),
    dtype=st.sampled_from(FLOATS),
    numel=st.integers(1, 3000),
    layout=st.sampled_from(["contiguous", "transposed", "every other column"]),
    drawn=st.integers(0, 1300),
    cached=st.booleans(),
    threads=st.integers(1, 8),
)
def test_any_size_layout_state_and_thread_count_gives_what_the_whole_operation_gives(
    op: str, dtype: torch.dtype, numel: int, layout: str, drawn: int, cached: bool, threads: int
) -> None:
    function, parameters, _ = IN_PLACE[op]
    rows = next(r for r in (7, 5, 3, 2, 1) if numel % r == 0)
    tensor = {
        "contiguous": lambda: torch.zeros(numel, dtype=dtype),
        "transposed": lambda: torch.zeros(numel // rows, rows, dtype=dtype).t(),
        "every other column": lambda: torch.zeros(rows, 2 * (numel // rows), dtype=dtype)[:, ::2],
    }[layout]()
    check_draw_into(function, parameters, tensor, start_state(drawn, cached), threads)


@pytest.mark.parametrize(
    ("op", "numel"),
    [
        (aten.uniform_.default, 3 * draws.JUMP_COST + 5),  # serial: a range starts past the drawing crossover
        (aten.normal_.default, 3 * draws.JUMP_COST + 7),  # blocks, with a redrawn tail
    ],
)
def test_a_result_large_enough_for_the_default_jump_cost_is_split_and_drawn_exactly(
    op: Callable[..., object], numel: int
) -> None:
    layout = torch.empty(numel)
    model = draws.pattern(op, (layout,), {})
    assert model is not None
    recorded = record_ranges(model)
    state = start_state(300)
    generator = torch.Generator()
    generator.set_state(state)
    expected = torch.empty(numel)
    op(expected, generator=generator)
    out = torch.empty(numel)
    assert torch.equal(recorded.model.draw_into(out, state, 3), generator.get_state())
    assert torch.equal(out.view(torch.int32), expected.view(torch.int32))
    assert len(recorded.calls) == 2  # 3 jumps' worth of outputs pay for one jump and a range after it


# --- how it runs -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Recorded:
    model: draws.Pattern
    calls: list[tuple[int, int, int]]  # per kernel run: its first element's address, its elements, its thread


def record_ranges(model: draws.Pattern) -> Recorded:
    """``model`` with a kernel that notes where, on how many elements and in which thread it runs."""
    recorded = Recorded(model, [])
    lock = threading.Lock()

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        with lock:
            recorded.calls.append((tensor.data_ptr(), tensor.numel(), threading.get_ident()))
        return model.fill(tensor, generator)

    recorded.model = dataclasses.replace(model, fill=fill)
    return recorded


@pytest.mark.parametrize(
    ("threads", "jump_cost"), [(1, 0), (4, 10_000), (4, 3_500)], ids=["one thread", "a jump costs more", "3 jumps"]
)
def test_one_thread_or_too_few_outputs_for_a_second_range_runs_the_operation_once_on_out(
    threads: int, jump_cost: int
) -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(100, 100),), {})
    assert model is not None
    recorded = record_ranges(model)
    out = torch.empty(100, 100)
    recorded.model.draw_into(out, start_state(1), threads, jump_cost=jump_cost)
    assert recorded.calls == [(out.data_ptr(), 10_000, threading.get_ident())]


@pytest.mark.parametrize(
    ("threads", "jump_cost", "sizes"),
    [
        (3, 100, [400, 300, 300]),  # the first range draws 100 elements more
        (8, 200, [400, 200, 200, 200]),  # 1000 outputs pay for 4 ranges: 3 jumps, and 200 outputs after each
        (3, 0, [333, 333, 334]),  # no jump cost: ranges of equal size
    ],
)
def test_the_first_range_draws_a_jump_s_cost_more_and_the_others_run_in_other_threads(
    threads: int, jump_cost: int, sizes: list[int]
) -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(1000),), {})
    assert model is not None
    recorded = record_ranges(model)
    out = torch.empty(1000)
    recorded.model.draw_into(out, start_state(1), threads, jump_cost=jump_cost)
    calls = sorted(recorded.calls)
    starts = [out.data_ptr() + 4 * sum(sizes[:i]) for i in range(len(sizes))]
    assert [(address, elements) for address, elements, _ in calls] == list(zip(starts, sizes, strict=True))
    assert calls[0][2] == threading.get_ident()  # the first range in the calling thread
    assert all(thread != threading.get_ident() for _, _, thread in calls[1:])


def test_draw_into_leaves_the_state_it_is_given_and_the_default_generator_as_they_were() -> None:
    model = draws.pattern(aten.normal_.default, (torch.empty(33, 40).t(),), {})
    assert model is not None
    state = start_state(3, cached_normal=True)
    kept = state.clone()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(8)
        default = torch.get_rng_state()
        model.draw_into(torch.empty(33, 40).t(), state, 4, jump_cost=0)
        assert torch.equal(torch.get_rng_state(), default)
    assert torch.equal(state, kept)


def test_draw_into_writes_a_parameter_that_requires_grad_without_recording_autograd() -> None:
    weight = torch.nn.Parameter(torch.zeros(64, 33))
    model = draws.pattern(aten.normal_.default, (weight,), {})
    assert model is not None
    state = start_state(0)
    expected = torch.empty(64, 33)
    generator = torch.Generator()
    generator.set_state(state)
    expected.normal_(generator=generator)
    for threads in (1, 3):
        weight.data.zero_()
        model.draw_into(weight, state, threads, jump_cost=0)
        assert torch.equal(weight.detach(), expected)
        assert weight.grad_fn is None
        assert weight.requires_grad


def test_inside_inference_mode_draw_into_fills_a_tensor_made_there() -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(1000),), {})
    assert model is not None
    state = start_state(1)
    expected = torch.empty(1000)
    model.draw_into(expected, state, 1)
    with torch.inference_mode():
        out = torch.empty(1000)
        model.draw_into(out, state, 3, jump_cost=0)
    assert torch.equal(out, expected)


# --- what it refuses -------------------------------------------------------------------------------------------------


BAD_OUTS: dict[str, Callable[[], object]] = {
    "another dtype": lambda: torch.zeros(33, 40, dtype=torch.float64).t(),
    "another shape": lambda: torch.zeros(40, 33),
    "other strides": lambda: torch.zeros(40, 33).t().contiguous(),
    "a meta tensor": lambda: torch.empty(33, 40, device="meta").t(),
    "a negated view": lambda: torch.zeros(33, 40).t()._neg_view(),
}


@pytest.mark.parametrize("make", BAD_OUTS.values(), ids=BAD_OUTS.keys())
def test_an_out_unlike_the_pattern_s_result_is_refused_before_anything_is_written(make: Callable[[], object]) -> None:
    model = draws.pattern(aten.normal_.default, (torch.empty(33, 40).t(),), {})
    assert model is not None
    out = make()
    assert isinstance(out, torch.Tensor)
    before = out.clone() if out.device.type == "cpu" else None
    with pytest.raises(ValueError, match=r"Pattern\.draw_into"):
        model.draw_into(out, start_state(0), 2)
    if before is not None:
        assert torch.equal(out, before)


def test_a_fake_out_is_refused() -> None:
    from modattrs.fake import fake_mode

    model = draws.pattern(aten.uniform_.default, (torch.empty(10),), {})
    assert model is not None
    with fake_mode():
        fake = torch.empty(10)
    with pytest.raises(ValueError, match="real strided CPU tensor; `out` is a fake tensor"):
        model.draw_into(fake, start_state(0), 2)


@pytest.mark.parametrize(
    ("keywords", "error"),
    [
        ({"threads": 0}, ValueError),
        ({"threads": True}, TypeError),
        ({"threads": 2.0}, TypeError),
        ({"threads": 2, "jump_cost": -1}, ValueError),
    ],
)
def test_a_count_of_threads_or_a_jump_cost_out_of_range_is_refused(
    keywords: dict[str, object], error: type[Exception]
) -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(10),), {})
    assert model is not None
    out = torch.zeros(10)
    threads = keywords.pop("threads")
    with pytest.raises(error, match=r"Pattern\.draw_into"):
        model.draw_into(out, start_state(0), threads, **keywords)  # type: ignore[arg-type]
    assert torch.equal(out, torch.zeros(10))


def _draw_in_a_forked_child(connection: Connection) -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(1000),), {})
    assert model is not None
    out = torch.empty(1000)
    model.draw_into(out, start_state(1), 3, jump_cost=0)
    connection.send(out.tolist())  # floats, exactly: a tensor would travel as shared memory


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_fills_in_parallel_with_threads_of_its_own() -> None:
    model = draws.pattern(aten.uniform_.default, (torch.empty(1000),), {})
    assert model is not None
    expected = torch.empty(1000)
    model.draw_into(expected, start_state(1), 3, jump_cost=0)  # the parent's threads, idle when it forks
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_draw_in_a_forked_child, args=(sending,))
    child.start()
    try:
        assert receiving.poll(20), "the child did not answer: it waited for threads it does not have"
        assert torch.equal(torch.tensor(receiving.recv()), expected)
    finally:
        child.kill()
        child.join()
