"""Jumping torch's CPU generator ahead (``modattrs._deferred.mt19937``) lands where drawing lands.

The reference is torch itself: a generator set to the state, then ``k`` 32-bit outputs drawn by ``uniform_`` on
float32 tensors, which take one output per element (measured on torch 2.13 by counting the engine's steps, and
confirmed here: the polynomial jumps, computed without torch's engine, agree with it). Each jump is checked byte for
byte against the state torch reaches, and by the values drawn after it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modattrs._deferred import mt19937

Jump = Callable[[torch.Tensor, int], torch.Tensor]

JUMPS: dict[str, Jump] = {
    "jumped_state": mt19937.jumped_state,
    "advance_by_polynomial": mt19937.advance_by_polynomial,
    "advance_by_drawing": mt19937.advance_by_drawing,
}
#: Bytes of the state after the 624 words: the Box-Muller caches.
CACHES = slice(24 + 624 * 8, None)


def draw(generator: torch.Generator, outputs: int) -> None:
    """Draw exactly ``outputs`` 32-bit outputs from ``generator``."""
    while outputs:
        chunk = min(outputs, 1 << 22)
        torch.empty(chunk, dtype=torch.float32).uniform_(generator=generator)
        outputs -= chunk


def state_after(seed: int, drawn: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(seed)
    draw(generator, drawn)
    return generator.get_state()


def drawn_state(state: torch.Tensor, outputs: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.set_state(state)
    draw(generator, outputs)
    return generator.get_state()


def values_from(state: torch.Tensor) -> torch.Tensor:
    """What a generator set to ``state`` draws next: 1,500 outputs, across a block boundary wherever it starts."""
    generator = torch.Generator()
    generator.set_state(state)
    return torch.empty(1500, dtype=torch.float32).uniform_(generator=generator)


def header(state: torch.Tensor) -> tuple[int, int, int, int]:
    seed, left, seeded, next_ = struct.unpack("=QiiQ", bytes(state[:24].tolist()))
    return seed, left, seeded, next_


STARTS = {
    "right after manual_seed": 0,
    "mid-block": 5,
    "at a block's last output": 624,
    "mid-block after a twist": 1000,
}


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
@pytest.mark.parametrize("distance", [0, 1, 623, 624, 625, 1247, 1248, 10**6 + 7])
@pytest.mark.parametrize("drawn", STARTS.values(), ids=STARTS.keys())
def test_a_jumped_state_is_the_state_torch_reaches_by_drawing_that_many_outputs(
    jump: Jump, distance: int, drawn: int
) -> None:
    start = state_after(1234, drawn)
    jumped = jump(start, distance)
    reference = drawn_state(start, distance)
    assert torch.equal(jumped, reference)
    assert torch.equal(values_from(jumped), values_from(reference))


@pytest.mark.parametrize(
    ("distance", "position"), [(0, (1, 1, 0)), (624, (1, 1, 624)), (625, (624, 1, 1)), (624 * 5000, (1, 1, 624))]
)
def test_a_jump_to_a_block_end_leaves_the_position_torch_leaves_there(
    distance: int, position: tuple[int, int, int]
) -> None:
    # torch's engine twists on the draw after a block's last output, so that output leaves left = 1, next = 624
    start = state_after(7, 0)
    assert header(drawn_state(start, distance))[1:] == position
    assert header(mt19937.advance_by_polynomial(start, distance))[1:] == position


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    drawn=st.integers(0, 2000),
    distance=st.integers(0, 5000),
)
def test_jumping_up_to_5000_outputs_from_any_seed_and_position_matches_drawing(
    jump: Jump, seed: int, drawn: int, distance: int
) -> None:
    start = state_after(seed, drawn)
    assert torch.equal(jump(start, distance), drawn_state(start, distance))


def test_a_jump_of_about_2_to_the_27_outputs_matches_drawing_them() -> None:
    start = state_after(99, 311)
    distance = 2**27 + 12345
    jumped = mt19937.jumped_state(start, distance)  # past DRAWING_CROSSOVER: a polynomial jump
    drawn = drawn_state(start, distance)
    assert torch.equal(jumped, drawn)
    assert torch.equal(values_from(jumped), values_from(drawn))


@pytest.mark.parametrize(
    ("drawn", "first", "second"),
    [(0, 2**32 + 5, 2**64 + 3), (5, 3, 2**64), (624, 2**40, 7 * 624), (5, 123_456_789, 987_654_321)],
)
def test_jumping_a_then_b_outputs_equals_jumping_a_plus_b(drawn: int, first: int, second: int) -> None:
    start = state_after(5, drawn)
    twice = mt19937.jumped_state(mt19937.jumped_state(start, first), second)
    assert torch.equal(twice, mt19937.jumped_state(start, first + second))


def test_jumping_2_to_the_33_outputs_equals_jumping_2_to_the_32_twice() -> None:
    start = state_after(11, 3)
    twice = mt19937.jumped_state(mt19937.jumped_state(start, 2**32), 2**32)
    assert torch.equal(twice, mt19937.jumped_state(start, 2**33))
    assert not torch.equal(twice, mt19937.jumped_state(start, 2**32))


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
@pytest.mark.parametrize("distance", [10, 5000, 10**6 + 7])
def test_a_jump_keeps_a_cached_normal_and_returns_it_next_as_drawing_does(jump: Jump, distance: int) -> None:
    generator = torch.Generator()
    generator.manual_seed(3)
    torch.empty(1).normal_(generator=generator)  # the scalar path draws a pair and caches the second
    start = generator.get_state()
    assert struct.unpack_from("=i", bytes(start[CACHES].tolist()), 24) == (1,)  # normal_is_valid
    jumped = jump(start, distance)
    assert torch.equal(jumped[CACHES], start[CACHES])
    reference = torch.Generator()
    reference.set_state(start)
    draw(reference, distance)
    generator.set_state(jumped)
    for _ in range(3):
        assert torch.equal(torch.empty(1).normal_(generator=generator), torch.empty(1).normal_(generator=reference))
    assert torch.equal(generator.get_state(), reference.get_state())


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
def test_a_jump_keeps_every_byte_past_the_array_even_those_torch_ignores(jump: Jump) -> None:
    start = state_after(8, 40)
    # a cached float normal (torch restores it) and bytes torch's get_state() would zero
    start[CACHES] = torch.arange(start[CACHES].numel(), dtype=torch.uint8) + 1
    start[CACHES][36] = 1  # the float cache's flag, a C++ bool
    jumped = jump(start, 10**6 + 7)
    assert torch.equal(jumped[CACHES], start[CACHES])
    generator = torch.Generator()
    generator.set_state(jumped)
    assert bytes(generator.get_state()[CACHES][32:37].tolist()) == bytes(start[CACHES][32:36].tolist()) + b"\x01"


def test_a_jump_keeps_the_initial_seed() -> None:
    start = state_after(2**63 + 17, 9)
    assert header(mt19937.jumped_state(start, 2**50))[0] == 2**63 + 17


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
def test_jumping_leaves_the_state_it_is_given_as_it_was(jump: Jump) -> None:
    start = state_after(4, 17)
    kept = start.clone()
    jump(start, 10**6 + 7)
    assert torch.equal(start, kept)


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (torch.zeros(5055, dtype=torch.uint8), "1-D torch.uint8 CPU tensor of 5056 bytes"),
        (torch.zeros(5057, dtype=torch.uint8), "got: a 1-D torch.uint8 cpu tensor of 5057 elements"),
        (torch.zeros(5056, dtype=torch.int8), "got: a 1-D torch.int8 cpu tensor of 5056 elements"),
        (torch.zeros(2, 2528, dtype=torch.uint8), "got: a 2-D torch.uint8 cpu tensor of 5056 elements"),
    ],
)
def test_a_state_of_the_wrong_size_or_type_is_refused_with_a_value_error(state: torch.Tensor, expected: str) -> None:
    with pytest.raises(ValueError, match="`state` is not a CPU generator's state") as raised:
        mt19937.jumped_state(state, 10)
    assert expected in str(raised.value)


def test_a_state_torch_would_refuse_is_refused_with_a_value_error() -> None:
    state = state_after(1, 0)
    state[8:12] = 0  # left = 0
    with pytest.raises(ValueError, match="position torch's set_state refuses") as raised:
        mt19937.jumped_state(state, 10)
    assert "got: left=0, next=0" in str(raised.value)
    with pytest.raises(RuntimeError):
        torch.Generator().set_state(state)


def test_a_state_from_which_torch_would_read_past_its_array_is_refused() -> None:
    state = state_after(1, 0)
    state[8:12] = torch.tensor([100, 0, 0, 0], dtype=torch.uint8)  # left = 100 with next = 624
    state[16:24] = torch.tensor([624 % 256, 624 // 256, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    with pytest.raises(ValueError, match="read past its array"):
        mt19937.jumped_state(state, 1)


@pytest.mark.parametrize(("outputs", "error"), [(-1, ValueError), (1.0, TypeError), (True, TypeError)])
def test_a_count_of_outputs_that_is_not_a_non_negative_int_is_refused(outputs: object, error: type) -> None:
    with pytest.raises(error, match="`outputs`"):
        mt19937.jumped_state(state_after(1, 0), outputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("jump", JUMPS.values(), ids=JUMPS.keys())
def test_jumping_works_on_the_cpu_whatever_the_default_device_is(jump: Jump) -> None:
    start = state_after(6, 10)
    with torch.device("meta"):
        jumped = jump(start, 10**6 + 7)
    assert torch.equal(jumped, drawn_state(start, 10**6 + 7))


def test_jumps_in_several_threads_at_once_leave_torchs_thread_count_as_it_was() -> None:
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = torch.Generator().manual_seed(3).get_state()
        with ThreadPoolExecutor(max_workers=4) as pool:
            jumped = list(pool.map(lambda k: mt19937.advance_by_polynomial(state, k), [10**7 + k for k in range(8)]))
        assert torch.get_num_threads() == 2
        assert torch.equal(jumped[3], mt19937.advance_by_polynomial(state, 10**7 + 3))
    finally:
        torch.set_num_threads(threads)
