"""Jumping torch's CPU generator ahead (``modattrs._deferred.rng.mt19937``) lands where drawing lands.

The reference is torch itself: a generator set to the state, then ``k`` 32-bit outputs drawn by ``uniform_`` on
float32 tensors, which take one output per element (measured on torch 2.13 by counting the engine's steps, and
confirmed here: the polynomial jumps, computed without torch's engine, agree with it). Each jump is checked byte for
byte against the state torch reaches, and by the values drawn after it. Where ``modattrs._generator_jump`` is built,
jumps run its C routines, and the tests at the end check them against the torch path that runs without them.
"""

from __future__ import annotations

import contextlib
import functools
import struct
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modattrs._deferred.rng import mt19937

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


@pytest.mark.parametrize("path", ["c", "torch"])
def test_jumps_in_several_threads_at_once_leave_torchs_thread_count_as_it_was(path: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        state = torch.Generator().manual_seed(3).get_state()
        with jump_path(path), ThreadPoolExecutor(max_workers=4) as pool:
            jumped = list(pool.map(lambda k: mt19937.advance_by_polynomial(state, k), [10**7 + k for k in range(8)]))
        assert torch.get_num_threads() == 2
        assert torch.equal(jumped[3], mt19937.advance_by_polynomial(state, 10**7 + 3))
    finally:
        torch.set_num_threads(threads)


# --- the C routines, the cache of powers, threads and the crossover ------------------------------------------------

needs_speedups = pytest.mark.skipif(
    mt19937._speedups is None, reason="modattrs._generator_jump is not built in this install"
)


@contextlib.contextmanager
def jump_path(path: str) -> Iterator[None]:
    """Jumps by the C routines ("c") or by the torch path that runs without them ("torch"), with no power cached."""
    if path == "c" and mt19937._speedups is None:
        pytest.skip("modattrs._generator_jump is not built in this install")
    with speedups_as(mt19937._speedups if path == "c" else None):
        yield


@contextlib.contextmanager
def speedups_as(replacement: object) -> Iterator[None]:
    """``mt19937``'s C routines replaced for the block, with no power cached before or after."""
    kept = mt19937._speedups
    mt19937._speedups = replacement  # type: ignore[assignment]
    mt19937._powers.clear()
    try:
        yield
    finally:
        mt19937._speedups = kept
        mt19937._powers.clear()


def berlekamp_massey_polynomial() -> int:
    """``p``, bit i the coefficient of x^i: Berlekamp-Massey on the top bits of 39,874 words of torch's engine.

    The words are the arrays of 64 consecutive blocks, read from the state after each block's first output. Every
    non-zero sequence of one bit of the words has minimal polynomial ``p`` (``p`` is irreducible): the sequence's
    connection polynomial is ``p`` reversed.
    """
    generator = torch.Generator()
    generator.manual_seed(5489)
    arrays = []
    for block in range(64):
        draw(generator, 1 if block == 0 else 624)
        arrays.append(generator.get_state()[24 : 24 + 624 * 8].view(torch.int64) & 0xFFFFFFFF)
    length = 2 * 19937
    digits = (torch.cat(arrays)[:length] >> 31) + ord("0")
    # `sequence` holds s_0 at its highest bit, so `sequence >> (length - 1 - t)` ends with s_t at bit 0
    sequence = int(bytes(digits.tolist()).decode("ascii"), 2)
    connection, previous, degree, gap = 1, 1, 0, 1
    for t in range(length):
        if (((sequence >> (length - 1 - t)) & connection).bit_count() & 1) == 0:
            gap += 1
        elif 2 * degree <= t:
            connection, previous, degree, gap = connection ^ (previous << gap), connection, t + 1 - degree, 1
        else:
            connection ^= previous << gap
            gap += 1
    return int(bin(connection)[2:].zfill(degree + 1)[::-1], 2)


def test_the_written_out_characteristic_polynomial_is_the_one_torchs_engine_follows() -> None:
    assert berlekamp_massey_polynomial() == sum(1 << term for term in mt19937._P_TERMS)
    assert len(mt19937._P_TERMS) == 135
    assert mt19937._P_TERMS[-1] == 19937


PATHS = ["c", "torch"]
#: Distances of every kind: within the block, a few blocks (x^M needs no reduction), short and long jumps.
DISTANCES = st.one_of(st.integers(0, 20_000), st.integers(0, 10**7), st.integers(0, 2**70))


@needs_speedups
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), drawn=st.integers(0, 1500), distance=DISTANCES)
def test_the_c_routines_and_the_torch_path_jump_to_the_same_state(seed: int, drawn: int, distance: int) -> None:
    start = state_after(seed, drawn)
    with jump_path("c"):
        compiled = mt19937.advance_by_polynomial(start, distance)
    with jump_path("torch"):
        assert torch.equal(mt19937.advance_by_polynomial(start, distance), compiled)


@needs_speedups
@pytest.mark.parametrize(
    ("exponent", "expected"),
    [(2**19937 - 1, 1), (2**19937, 2), (2 * (2**19937 - 1) + 5, 2**5)],
    ids=["the period", "the period plus 1", "twice the period plus 5"],
)
def test_the_c_power_of_x_wraps_around_at_the_period(exponent: int, expected: int) -> None:
    # p is primitive of degree 19,937, and 2^19937 - 1 is prime: x has order 2^19937 - 1 modulo p
    assert mt19937._speedups is not None
    exponent_bytes = exponent.to_bytes((exponent.bit_length() + 7) // 8, "big")
    packed = mt19937._speedups.mt19937_power_of_x(exponent_bytes, mt19937._P_PACKED)
    assert int.from_bytes(packed, "little") == expected


@needs_speedups
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ((b"\x05", b"\x01" * 2493), ValueError, "not MT19937's characteristic polynomial"),
        ((b"\x05", b"\x01" * 100), ValueError, "must have 2493 bytes, got 100"),
        ((b"\x05",), TypeError, "expected 2 arguments"),
    ],
)
def test_the_c_power_of_x_refuses_another_modulus(arguments: tuple[bytes, ...], error: type, message: str) -> None:
    assert mt19937._speedups is not None
    with pytest.raises(error, match=message):
        mt19937._speedups.mt19937_power_of_x(*arguments)


@needs_speedups
def test_the_c_twist_refuses_arrays_of_another_size_and_leaves_the_array_as_it_was() -> None:
    assert mt19937._speedups is not None
    array = bytearray(range(256)) * 19 + bytearray(128)
    kept = bytes(array)
    with pytest.raises(ValueError, match="expected an array of 4992 bytes and coefficients of 2493 bytes"):
        mt19937._speedups.mt19937_twisted(array, bytes(2492))
    with pytest.raises(ValueError, match="got 4991 and 2493"):
        mt19937._speedups.mt19937_twisted(array[:-1], bytes(2493))
    with pytest.raises(BufferError):  # the array is written in place: read-only bytes are refused
        mt19937._speedups.mt19937_twisted(kept, bytes(2493))
    assert array == kept


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("distance", [30_000, 10**6 + 7, 2**40 + 3])
def test_a_jump_to_a_cached_distance_gives_the_state_an_uncached_jump_gives(path: str, distance: int) -> None:
    first, second = state_after(21, 5), state_after(22, 5)  # the same position: the same x^M
    with jump_path(path):
        uncached = mt19937.advance_by_polynomial(second, distance)
        mt19937._powers.clear()
        mt19937.advance_by_polynomial(first, distance)  # caches x^M
        assert len(mt19937._powers) == 1
        assert torch.equal(mt19937.advance_by_polynomial(second, distance), uncached)
        assert len(mt19937._powers) == 1
    if distance < 2**40:
        assert torch.equal(uncached, drawn_state(second, distance))


def test_the_cache_of_powers_keeps_the_most_recently_used_up_to_its_bound() -> None:
    powers = mt19937._Powers(3)
    exponents = [624 * blocks - 1 for blocks in (100, 200, 300, 400)]
    for exponent in exponents[:3]:
        powers.get(exponent)
    powers.get(exponents[0])  # used again: now the most recent
    powers.get(exponents[3])
    assert len(powers) == 3
    assert [exponent in powers for exponent in exponents] == [True, False, True, True]
    assert powers.get(exponents[1]) == mt19937._Powers(1).get(exponents[1])


@pytest.mark.parametrize("path", PATHS)
def test_jumps_in_several_threads_at_once_give_the_states_jumps_one_at_a_time_give(path: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    start = state_after(13, 100)
    # repeated distances too: threads meet on the same cached (or being computed) power
    distances = [10**6 + 624 * (i % 5) + i for i in range(16)] + [2**33 + i for i in range(4)]
    with jump_path(path):
        alone = [mt19937.jumped_state(start, distance) for distance in distances]
        mt19937._powers.clear()
        with ThreadPoolExecutor(max_workers=4) as pool:
            together = list(pool.map(lambda distance: mt19937.jumped_state(start, distance), distances))
    for distance, one, other in zip(distances, alone, together, strict=True):
        assert torch.equal(one, other), distance
    assert torch.equal(alone[0], drawn_state(start, distances[0]))


@pytest.mark.parametrize(
    ("crossover", "expected"),
    [
        (0, ["polynomial"] * 5),  # jumping costs less than drawing at any distance: the C routines' crossover
        (1000, ["polynomial", "drawing", "drawing", "polynomial", "polynomial"]),
    ],
)
def test_jumped_state_draws_below_the_crossover_and_jumps_from_it(
    monkeypatch: pytest.MonkeyPatch, crossover: int, expected: list[str]
) -> None:
    start = state_after(17, 5)  # 619 outputs left in the block
    chosen: list[str] = []
    drawing, jumping = mt19937._advance_by_drawing, mt19937._advance_by_polynomial

    def by_drawing(parsed: mt19937._Parsed) -> torch.Tensor:
        chosen.append("drawing")
        return drawing(parsed)

    def by_polynomial(parsed: mt19937._Parsed) -> torch.Tensor:
        chosen.append("polynomial")
        return jumping(parsed)

    monkeypatch.setattr(mt19937, "_advance_by_drawing", by_drawing)
    monkeypatch.setattr(mt19937, "_advance_by_polynomial", by_polynomial)
    monkeypatch.setattr(mt19937, "DRAWING_CROSSOVER", crossover)
    for distance in [619, 620, 999, 1000, 1001]:
        assert torch.equal(mt19937.jumped_state(start, distance), drawn_state(start, distance))
    assert chosen == expected


# --- each method of the C routines: every CPU runs one, so each is checked here against torch ----------------------

#: Every method the C routines have; those this CPU or build lacks are skipped.
TWIST_METHODS = ["words", "clmul128"]


def supported(function: str, method: str) -> None:
    """Skip unless the C routine ``function`` (``"twisted"``) has ``method`` here."""
    if mt19937._speedups is None:
        pytest.skip("modattrs._generator_jump is not built in this install")
    if method not in mt19937._speedups.mt19937_methods()[function]:
        pytest.skip(f"this CPU or build lacks the method {method!r} of mt19937_{function}")


class Forced:
    """``modattrs._generator_jump`` with its sums bound to one method (None: the default)."""

    def __init__(self, twist: str | None) -> None:
        assert mt19937._speedups is not None
        self.module, self.twist = mt19937._speedups, twist

    def mt19937_twisted(self, array: memoryview, coefficients: bytes, method: str | None = None) -> None:
        self.module.mt19937_twisted(array, coefficients, self.twist or method)

    def mt19937_power_of_x(self, exponent: bytes, modulus: bytes) -> bytes:
        return self.module.mt19937_power_of_x(exponent, modulus)

    def mt19937_methods(self) -> dict[str, tuple[str, ...]]:
        return self.module.mt19937_methods()


@contextlib.contextmanager
def forced(twist: str | None = None) -> Iterator[None]:
    """Jumps by the C routines with that method of the sums, with no power cached."""
    with speedups_as(Forced(twist)):
        yield


def exponent_bytes(exponent: int) -> bytes:
    return exponent.to_bytes((exponent.bit_length() + 7) // 8, "big")


@functools.cache
def power_near_the_period(below: int) -> bytes:
    """``x^(2^19937 - 1 - below) mod p``, by the default C method (the torch path would take 12 s)."""
    assert mt19937._speedups is not None
    return mt19937._speedups.mt19937_power_of_x(exponent_bytes(mt19937._PERIOD - below), mt19937._P_PACKED)


def array_of(state: torch.Tensor) -> bytearray:
    return bytearray(bytes(state[24 : 24 + 624 * 8].tolist()))


#: Exponents M of x^M mod p: a single term (a few twists, or none), a few hundred (just past 19,937), about 10,000
#: (far jumps), and the period's last ones (2^19937 - 1 - b: the powers of x^-1, which wrap around it).
EXPONENTS = st.one_of(
    st.integers(0, 19936),
    st.integers(19937, 2 * 19937),
    st.integers(2 * 19937, 2**64),
    st.integers(1, 3).map(lambda below: -below),  # negative: power_near_the_period(-exponent)
)


@pytest.mark.parametrize("method", TWIST_METHODS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), drawn=st.integers(0, 1500), exponent=EXPONENTS, garbage=st.booleans())
def test_each_c_twist_method_gives_the_words_the_torch_path_computes(
    method: str, seed: int, drawn: int, exponent: int, garbage: bool
) -> None:
    supported("twisted", method)
    assert mt19937._speedups is not None
    start = state_after(seed, drawn)
    if garbage:  # the array's words are 32-bit values: the upper halves of their uint64s are not read
        start[24 : 24 + 624 * 8].view(torch.int64).add_(torch.arange(624, dtype=torch.int64) << 32)
    words = start[24 : 24 + 624 * 8].view(torch.int64) & 0xFFFFFFFF
    if exponent < 0:
        coefficients = power_near_the_period(-exponent)
    else:
        coefficients = mt19937._speedups.mt19937_power_of_x(exponent_bytes(exponent), mt19937._P_PACKED)
    # the torch path's sums, by FFT (it needs no extension): XOR_j c_j w[j + i], i = 1 .. 624
    expected = mt19937._correlate(mt19937._unpacked(coefficients), mt19937._untempered(words, mt19937._STREAM))
    array = array_of(start)
    mt19937._speedups.mt19937_twisted(array, coefficients, method)
    assert torch.equal(torch.frombuffer(array, dtype=torch.int64), expected)


@needs_speedups
@settings(max_examples=8, deadline=None)
@given(exponent=st.one_of(st.integers(0, 40_000), st.integers(0, 2**80)))
def test_the_c_power_gives_the_power_the_torch_path_computes(exponent: int) -> None:
    assert mt19937._speedups is not None
    packed = mt19937._speedups.mt19937_power_of_x(exponent_bytes(exponent), mt19937._P_PACKED)
    with jump_path("torch"):
        assert packed == mt19937._power_of_x_packed(exponent)


@pytest.mark.parametrize("twist", TWIST_METHODS)
@pytest.mark.parametrize("distance", [625, 1248, 30_000, 10**6 + 7])
def test_a_jump_by_each_c_method_lands_where_drawing_lands(twist: str, distance: int) -> None:
    supported("twisted", twist)
    for drawn in STARTS.values():
        start = state_after(31, drawn)
        with forced(twist):
            jumped = mt19937.advance_by_polynomial(start, distance)
        assert torch.equal(jumped, drawn_state(start, distance)), drawn


@needs_speedups
def test_the_c_methods_are_listed_and_others_refused() -> None:
    assert mt19937._speedups is not None
    methods = mt19937._speedups.mt19937_methods()
    assert set(methods) == {"twisted"}  # the power has one method
    assert set(methods["twisted"]) <= set(TWIST_METHODS)
    assert methods["twisted"][0] == "words"  # the portable method: every build has it
    array = array_of(state_after(1, 0))
    kept = bytes(array)
    with pytest.raises(ValueError, match="mt19937_twisted: no method 'squaring'; use one of those mt19937_methods"):
        mt19937._speedups.mt19937_twisted(array, bytes(2493), "squaring")
    with pytest.raises(TypeError, match="`method` must be a str, got int"):
        mt19937._speedups.mt19937_twisted(array, bytes(2493), 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"mt19937_power_of_x expected 2 arguments \(exponent, modulus\), got 3"):
        mt19937._speedups.mt19937_power_of_x(b"\x05", mt19937._P_PACKED, "squaring")
    assert array == kept
