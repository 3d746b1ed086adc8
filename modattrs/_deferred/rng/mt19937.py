"""Jumping torch's CPU generator (MT19937) ahead by any number of 32-bit outputs without drawing them.

``jumped_state(state, k)`` takes a state as ``torch.Generator.get_state()`` returns it and gives the state the
generator would have after drawing ``k`` 32-bit outputs: ``g.set_state(jumped_state(s, k))`` then drawing gives
what ``g.set_state(s)``, drawing ``k`` outputs, then drawing gives. For a state torch produced, the result is
byte for byte what ``get_state()`` returns after those draws.

The state (5,056 bytes, native byte order, in torch's layout, which ``_torch_private`` names): the initial seed
(uint64), ``left`` (int32), ``seeded`` (int32), ``next`` (uint64), the 624 words of the engine's array (each a uint64
holding 32 bits), then the Box-Muller caches (``normal_x``, ``normal_y``, ``normal_rho``, ``normal_is_valid``, the
float sample and its flag). torch's engine
(``aten/src/ATen/core/MT19937RNGEngine.h``) draws an output by decrementing ``left``; when that makes it 0 it
regenerates the whole array (a "twist") and sets ``left = 624, next = 0``; it then tempers and returns
``array[next++]``. So right after ``manual_seed`` the state is ``left = 1, next = 0`` and the array is still the
seeding array, which the first draw twists; after ``j`` outputs of a block ``next = j`` and ``left = 625 - j``; a
block's last output leaves ``next = 624, left = 1``, and the next draw twists. In general ``left - 1`` outputs
remain in the array (``array[next:next + left - 1]``), then come whole twisted blocks.

What a jump changes: ``left``, ``next`` and the array, set as torch's own draws would set them (a jump that ends
on a block's last output leaves ``next = 624, left = 1`` with that block's array, as drawing does, rather than the
equivalent untwisted form). What it keeps: every other byte, copied from ``state``. That is the initial seed, the
``seeded`` flag and the Box-Muller caches: a jump counts raw 32-bit outputs, and the caches are not outputs (a
cached normal is a value already drawn, returned by the next scalar ``normal_`` instead of drawing), so a state
with a valid cached normal keeps it, exactly as drawing 32-bit outputs (``uniform_`` on float32, ``random_``)
leaves it in place. Array words are written as 32-bit values, as ``set_state`` reads them.

Two ways to get there, and ``jumped_state`` picks per jump (a distance within the current block,
``k <= left - 1``, is mere arithmetic on ``left`` and ``next``, which it does itself):

- ``advance_by_drawing`` runs torch's own engine over the outputs (``random_`` on uint8 scratch tensors, one
  output per element, in chunks of 1 MiB): cheapest for short distances.
- ``advance_by_polynomial`` uses that MT19937 is linear over GF(2) (Haramoto, Matsumoto, L'Ecuyer, Nishimura,
  Panneton, "Efficient jump ahead for F2-linear random number generators", INFORMS J. Computing 20(3), 2008). In the
  word-at-a-time view the untempered words satisfy ``w[n + 624] = w[n + 397] ^ twist(w[n], w[n + 1])``, the state
  being the 19,937 bits ``(top bit of w[n], w[n + 1 .. n + 623])`` and ``p`` its characteristic polynomial (degree
  19,937, 135 terms, written out in ``_P_TERMS``; Berlekamp-Massey on one bit of 39,874 of torch's words finds it,
  as a test checks). If ``x^M mod p = sum of c_j x^j``, every word after position ``M`` is the XOR of the words the
  same distance after each ``j`` with ``c_j = 1``: ``w[M + i] = XOR_j c_j w[j + i]`` for ``i >= 1``. So the array
  after ``b`` twists, ``w[624 b .. 624 b + 623]``, comes from ``M = 624 b - 1``: generate the 20,561 words
  ``w[0 ..]`` from the current array and sum them as ``c`` says. Distances are reduced modulo the period
  ``2^19937 - 1``, so any distance works.

Each step has two implementations with the same results, bit for bit: C routines in the optional extension
``modattrs._generator_jump``, used when pip built it, and torch code, used when it did not.

- C: ``x^M mod p`` by squaring, one bit of ``M`` at a time from the top (``x^m`` for the top bits while
  ``m < 19937``): a square over GF(2) spreads the bits apart; reducing it by ``p`` finds the quotient's bits from the
  top down, 512 at a time, each piece a sum of shifted reads of the bits above it (every other term of ``p`` lies at
  least 623 degrees below its top one), then the remainder's the same way. The sums, bit-sliced: bit ``b`` of
  ``w[M + i]`` is the parity of ``c`` AND bit ``b`` of the words from ``w[i]`` on, a coefficient of the product of
  ``c`` reversed and that bit plane of the stream, so the 32 planes are multiplied by ``c`` carry-less (PCLMULQDQ:
  64 x 64 bits an instruction). Without carry-less multiplication (other CPUs, other compilers), and for the few
  terms of a short jump's power, the rows ``w[j + 1 ..]`` with ``c_j = 1`` are XORed 24 output words at a time.
  The extension picks per CPU at run time, and the carry-less method is checked against the portable one at its
  first use in a process (Note [Each jump method checked where it runs]): if it disagrees it is not used again,
  with a warning. Wider vectors for the sums or the squarings are not kept: on a replay they gained less than the
  measure's noise (AVX2) or could not be measured (AVX-512; ``docs/benchmarks.rst`` says why).
- torch: the sums per bit of the words, by FFT (for ``M < 19937`` the words are read off the stream). ``x^M mod p``
  bit by bit of ``M`` by the transpose of Bostan and Mori's halving step (``[x^N] P/Q = [x^(N//2)]
  (P Q)_(N mod 2) / Q`` over GF(2), where ``Q(x) Q(-x) = Q(x^2)``): one FFT correlation of length 20,000 per bit of
  ``M`` beyond its top 14, which start from the power series ``1/Q``.

Either way the last 256 powers ``x^M mod p`` computed are kept, by ``M``, bit-packed (2.5 KB each, at most 0.7 MB in
all): a distance jumped again from the same place in a block (identical layers make the same jumps) skips the
power and pays only the stream and its sums.

What each costs (``benchmarks/generator_jump.py`` measures it; ``docs/benchmarks.rst``, "Jumping the generator",
has the figures): with the C routines a jump costs less than drawing at any distance past the current block, so
``jumped_state`` always jumps (``DRAWING_CROSSOVER`` is 0); with the torch path alone drawing is cheaper up to a few
million outputs, and ``DRAWING_CROSSOVER`` is that. ``FAR_JUMP_COST`` is what a far jump costs, in outputs drawn.

The torch path's FFTs run on torch's intra-op threads (MKL), as many as the process gives torch: a jump never changes
that count, which is process-wide (another thread's matmul would run on the count a jump set). With more busy
threads than cores each FFT can wait for a scheduler time slice. Processes that share a machine (one per
rank) are best run with fewer threads anyway (``torch.set_num_threads``, the caller's choice). The results do not
depend on the count. The C routines use no torch threads and release the GIL: jumps in several threads run at
once.

Only torch and the standard library are used (no numpy).
"""

from __future__ import annotations

import functools
import operator
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

from modattrs._compiled import generator_jump as _speedups  # the jump's C routines, or None
from modattrs._torch_private import (
    CPU_STATE_ARRAY,
    CPU_STATE_BYTES,
    CPU_STATE_HEADER,
    CPU_STATE_LEFT,
    CPU_STATE_NEXT,
)

__all__ = [
    "DRAWING_CROSSOVER",
    "FAR_JUMP_COST",
    "advance_by_drawing",
    "advance_by_polynomial",
    "forget_powers",
    "jumped_state",
]

#: From this many outputs on ``jumped_state`` jumps; below it, past the current block, it draws. Where both cost
#: the same (module docstring): with the C extension nowhere (a jump past the block costs 0.010 ms, drawing
#: 0.025 ms), so 0; with the torch path alone at about 11 ms.
DRAWING_CROSSOVER = 0 if _speedups is not None else 5_000_000
_CARRY_LESS = _speedups is not None and _speedups.mt19937_methods()["twisted"][-1] != "words"  # this CPU has it
#: What a jump to a distance of 10^6 outputs or more costs, counted in outputs drawn in that time: between what a
#: repeated distance and a fresh one cost (``docs/benchmarks.rst``, "Jumping the generator"), with the C extension
#: on a CPU with carry-less multiplication, on one without, and with the torch path.
FAR_JUMP_COST = 50_000 if _CARRY_LESS else 200_000 if _speedups is not None else 5_000_000

_STATE_BYTES = CPU_STATE_BYTES
_HEADER = CPU_STATE_HEADER  # initial seed, left, seeded, next
_LEFT, _LEFT_AT = CPU_STATE_LEFT
_NEXT, _NEXT_AT = CPU_STATE_NEXT
_ARRAY_START, _ARRAY_END = CPU_STATE_ARRAY.start, CPU_STATE_ARRAY.stop

_N = 624  # words in the array
_M = 397  # the recurrence's middle lag
_SHORTEST_LAG = _N - _M  # 227: how many new words depend only on words already known
_MATRIX_A = 0x9908B0DF
_UPPER_BIT = 0x80000000
_LOWER_BITS = 0x7FFFFFFF
_WORD = 0xFFFFFFFF

_DEGREE = 19937  # of the characteristic polynomial: the state's bits
_PERIOD = (1 << _DEGREE) - 1  # of every non-zero state (2^19937 - 1 is prime, so the polynomial is primitive)
_STREAM = _DEGREE + _N  # untempered words w[0 .. 20560] that a jump correlates with
_STEP_FFT = 20_000  # >= _DEGREE + 2: the cyclic length at which a halving step's correlation does not wrap
_FINAL_FFT = 40_000  # >= 2 * _DEGREE
_WORDS_FFT = 20_736  # >= _STREAM
_TOP_BITS_LIMIT = _DEGREE  # x^m for m below this needs no reduction
_PACKED_BYTES = (_DEGREE + 1 + 7) // 8  # 2,493: a polynomial of degree up to 19,937, 8 coefficients a byte

#: The exponents of ``p``'s terms, the characteristic polynomial of MT19937's transition (135 terms). Berlekamp-Massey
#: on torch's own engine gives it (tests/test_generator_jump.py checks it so); written out, a process's first jump
#: skips that (80 ms).
_P_TERMS = (
    0, 1189, 1416, 1585, 1643, 1870, 2493, 2773, 3000, 3227, 3454, 3681, 3908, 4135, 4362, 4753, 5661, 6337, 6569,
    7129, 7477, 7525, 7583, 7752, 7979, 8206, 9505, 9901, 9969, 10128, 10693, 10761, 10920, 11089, 11147, 11157,
    11215, 11321, 11374, 11384, 11485, 11611, 11712, 11717, 11838, 11881, 11944, 11997, 12277, 12335, 12393, 12504,
    12509, 12620, 12673, 12731, 12736, 12789, 12905, 12958, 12963, 13137, 13185, 13190, 13243, 13301, 13412, 13528,
    13533, 13639, 13697, 13760, 13813, 13866, 14093, 14151, 14209, 14320, 14325, 14436, 14547, 14552, 14605, 14721,
    14774, 14779, 14953, 15001, 15006, 15059, 15117, 15228, 15344, 15349, 15455, 15513, 15576, 15629, 15682, 15909,
    15967, 16025, 16136, 16141, 16252, 16363, 16368, 16421, 16537, 16590, 16595, 16817, 16822, 16875, 16933, 17044,
    17160, 17271, 17329, 17445, 17498, 17725, 17783, 17841, 17952, 18068, 18179, 18237, 18406, 18633, 18691, 18860,
    19087, 19314, 19937,
)  # fmt: skip
_P_PACKED = sum(1 << term for term in _P_TERMS).to_bytes(_PACKED_BYTES, "little")

_DRAW_CHUNK = 1 << 20  # outputs drawn per random_ call: 1 MiB of scratch


def jumped_state(state: torch.Tensor, outputs: int) -> torch.Tensor:
    """The state of torch's CPU generator after ``outputs`` more 32-bit outputs, without drawing them all.

    ``state`` is what ``torch.Generator.get_state()`` returns (a CPU generator's, uint8, 5,056 bytes); the result
    is a new tensor ``set_state`` accepts, and from which the generator draws what it would have drawn after
    ``outputs`` outputs from ``state``. ``left``, ``next`` and the array change; every other byte (the initial
    seed, the Box-Muller caches) is copied from ``state``. Draws below ``DRAWING_CROSSOVER`` outputs
    (``advance_by_drawing``), jumps from there (``advance_by_polynomial``); the module docstring gives the costs.

    Raises ``TypeError`` or ``ValueError`` for a state that is not a CPU generator's, a state torch would refuse or
    read past its array from, and a count of outputs that is not a non-negative integer.
    """
    parsed = _parse(state, outputs, "jumped_state")
    if parsed.outputs <= parsed.left - 1 or parsed.outputs >= DRAWING_CROSSOVER:
        return _advance_by_polynomial(parsed)
    return _advance_by_drawing(parsed)


def advance_by_drawing(state: torch.Tensor, outputs: int) -> torch.Tensor:
    """``jumped_state``'s result by running torch's engine over the ``outputs`` outputs: 2.15 ns each here.

    Draws with ``random_`` on uint8 scratch tensors (one 32-bit output per element) from a private generator, then
    takes ``left``, ``next`` and the array from it; every other byte is copied from ``state``, as
    ``jumped_state`` does. Same arguments and errors as ``jumped_state``.
    """
    return _advance_by_drawing(_parse(state, outputs, "advance_by_drawing"))


def advance_by_polynomial(state: torch.Tensor, outputs: int) -> torch.Tensor:
    """``jumped_state``'s result by polynomial jump-ahead: with the C extension a fraction of a millisecond, with the
    torch path alone (no extension built) several milliseconds (``docs/benchmarks.rst`` has the figures). Short jumps
    cost less (module docstring).

    Same arguments, result and errors as ``jumped_state``; the module docstring describes the method.
    """
    return _advance_by_polynomial(_parse(state, outputs, "advance_by_polynomial"))


# --- reading and writing states --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parsed:
    state: bytearray  # a copy of the caller's state: the result is written into it, so each _Parsed makes one result
    left: int
    next: int
    outputs: int


def _parse(state: torch.Tensor, outputs: int, caller: str) -> _Parsed:
    if not isinstance(state, torch.Tensor):
        raise TypeError(
            f"{caller}: `state` must be a tensor as torch.Generator.get_state() returns it, got {type(state).__name__}"
        )
    if state.dtype != torch.uint8 or state.dim() != 1 or state.numel() != _STATE_BYTES or state.device.type != "cpu":
        raise ValueError(
            f"{caller}: `state` is not a CPU generator's state; pass what a CPU torch.Generator's get_state() "
            f"returns\n  expected: a 1-D torch.uint8 CPU tensor of {_STATE_BYTES} bytes\n"
            f"  got: a {state.dim()}-D {state.dtype} {state.device.type} tensor of {state.numel()} elements"
        )
    if isinstance(outputs, bool):
        raise TypeError(f"{caller}: `outputs` must be an int (a count of 32-bit outputs), got a bool")
    try:
        count = operator.index(outputs)
    except TypeError:
        raise TypeError(
            f"{caller}: `outputs` must be an int (a count of 32-bit outputs), got {type(outputs).__name__}"
        ) from None
    if count < 0:
        raise ValueError(f"{caller}: `outputs` must be 0 or more (the generator cannot go back), got {count}")
    # one copy, read and written as bytes: 4 us a jump, where tensor slices, clones and .tolist() took 24
    copy = bytearray(_STATE_BYTES)
    torch.frombuffer(copy, dtype=torch.uint8).copy_(state)
    _, left, seeded, next_ = _HEADER.unpack_from(copy)
    if not seeded:
        raise ValueError(
            f"{caller}: `state` has its `seeded` flag cleared, and torch's set_state refuses such a state; pass a "
            f"state a generator's get_state() returned"
        )
    if not 1 <= left <= _N or next_ > _N:
        raise ValueError(
            f"{caller}: `state` has a position torch's set_state refuses; pass a state a generator's get_state() "
            f"returned\n  expected: 1 <= left <= {_N} and next <= {_N}\n  got: left={left}, next={next_}"
        )
    if next_ + left - 1 > _N:
        raise ValueError(
            f"{caller}: `state` has a position from which torch's engine would read past its array; pass a state a "
            f"generator's get_state() returned\n  expected: next + left - 1 <= {_N}\n  got: left={left}, next={next_}"
        )
    return _Parsed(copy, left, next_, count)


def _array(state: bytearray) -> torch.Tensor:
    """The engine's array in ``state``, as int64 words sharing its memory."""
    return torch.frombuffer(state, dtype=torch.int64, count=_N, offset=_ARRAY_START)


def _result(parsed: _Parsed, left: int, next_: int) -> torch.Tensor:
    """``parsed.state`` with that position, as a tensor sharing its memory (its array already written)."""
    _LEFT.pack_into(parsed.state, _LEFT_AT, left)
    _NEXT.pack_into(parsed.state, _NEXT_AT, next_)
    return torch.frombuffer(parsed.state, dtype=torch.uint8)


# --- drawing ---------------------------------------------------------------------------------------------------------


def _advance_by_drawing(parsed: _Parsed) -> torch.Tensor:
    generator = torch.Generator(device="cpu")
    generator.set_state(torch.frombuffer(parsed.state, dtype=torch.uint8))
    scratch = torch.empty(min(parsed.outputs, _DRAW_CHUNK), dtype=torch.uint8, device="cpu")
    remaining = parsed.outputs
    while remaining > 0:
        take = min(remaining, _DRAW_CHUNK)
        scratch[:take].random_(generator=generator)  # one 32-bit output per uint8 element
        remaining -= take
    drawn = generator.get_state()
    _, left, _, next_ = _HEADER.unpack(bytes(drawn[: _HEADER.size].tolist()))
    _array(parsed.state).copy_(drawn[_ARRAY_START:_ARRAY_END].view(torch.int64) & _WORD)
    return _result(parsed, left, next_)


# --- jumping ---------------------------------------------------------------------------------------------------------


def _advance_by_polynomial(parsed: _Parsed) -> torch.Tensor:
    in_block = parsed.left - 1  # outputs still in the current array
    if parsed.outputs <= in_block:
        _array(parsed.state).bitwise_and_(_WORD)  # words written as 32-bit values, as a twist writes them
        return _result(parsed, parsed.left - parsed.outputs, parsed.next + parsed.outputs)
    beyond = parsed.outputs - in_block  # >= 1 outputs from the twisted blocks
    blocks, last = divmod(beyond - 1, _N)  # the output lands in twisted block `blocks + 1`, at index `last`
    _twist(parsed.state, blocks + 1)
    return _result(parsed, _N - last, last + 1)


def _twist(state: bytearray, blocks: int) -> None:
    """Replace the array in ``state`` by the array after ``blocks`` (>= 1) twists: ``w[624 blocks .. + 623]``."""
    exponent = (_N * blocks - 1) % _PERIOD
    speedups = _speedups
    if speedups is not None:  # the same sums in C, from the same bits: the same words
        array = memoryview(state)[_ARRAY_START:_ARRAY_END]
        coefficients = _coefficients(exponent)
        speedups.mt19937_twisted(array, coefficients, _twist_method(speedups, coefficients))
        return
    words = _array(state) & _WORD
    if exponent < _DEGREE:  # x^M mod p is x^M itself: the words are the stream's, from M + 1 on
        twisted = _untempered(words, exponent + 1 + _N)[exponent + 1 :]
    else:
        twisted = _correlate(_unpacked(_coefficients(exponent)), _untempered(words, _STREAM))
    _array(state).copy_(twisted)


def _coefficients(exponent: int) -> bytes:
    """``x^exponent mod p`` bit-packed (coefficient ``j`` in bit ``j % 8`` of byte ``j // 8``): from ``_powers``."""
    if exponent < _DEGREE:
        return (1 << exponent).to_bytes(_PACKED_BYTES, "little")
    return _powers.get(exponent)


class _Powers:
    """The last ``kept`` results of ``x^M mod p`` by ``M``, bit-packed: a distance jumped again (identical layers
    make the same jumps) costs only the stream and its sums. Each entry is a 2,493-byte ``bytes`` (about 2.6 KB with
    its key and link), so 256 of them hold at most 0.7 MB. Shared by threads: the lock guards the table only, and a
    power is computed outside it (two threads missing the same one compute it twice, with the same result)."""

    def __init__(self, kept: int) -> None:
        self.kept = kept
        self._lock = threading.Lock()
        self._table: OrderedDict[int, bytes] = OrderedDict()

    def get(self, exponent: int) -> bytes:
        with self._lock:
            packed = self._table.get(exponent)
            if packed is not None:
                self._table.move_to_end(exponent)
                return packed
        packed = _power_of_x_packed(exponent)
        with self._lock:
            self._table[exponent] = packed
            self._table.move_to_end(exponent)
            while len(self._table) > self.kept:
                self._table.popitem(last=False)
        return packed

    def clear(self) -> None:
        with self._lock:
            self._table.clear()

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, exponent: object) -> bool:
        return exponent in self._table


_powers = _Powers(256)


def forget_powers() -> None:
    """Empty the cache of powers ``x^M mod p``: the next jumps compute theirs, as a fresh process's would (for
    benchmarks that measure several ranks in one process)."""
    _powers.clear()


def _power_of_x_packed(exponent: int) -> bytes:
    """``x^exponent mod p``, bit-packed: in C by squaring, else by ``_power_of_x`` in torch, with the same result."""
    speedups = _speedups
    if speedups is not None:
        big_endian = exponent.to_bytes((exponent.bit_length() + 7) // 8, "big")
        packed: bytes = speedups.mt19937_power_of_x(big_endian, _P_PACKED)
        return packed
    return _packed(_power_of_x(exponent))


# --- the C routines' methods, each checked where it runs --------------------------------------------------------

# Note [Each jump method checked where it runs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The C routine of the sums has two methods for the same bytes, chosen by the CPU's features at run time (carry-less
# multiplication or not): a CI host tests only those its CPU has, and a wrong one on a user's CPU would give other
# weights, silently. So the first time a process is about to use a method other than the portable one (``words``),
# that method and the portable one compute the same sums (over a polynomial whose coefficients are half ones, as a
# far jump's power, and a seeded generator's words: a full pass of the vector loops); a method that disagrees is not
# used again in the process, with a warning, and the next one down is checked the same way. The check costs about a
# millisecond, once per process; a disabled method costs speed, never a different tensor. The power has one method,
# the portable one.

_TWISTED = "twisted"
_PORTABLE = {_TWISTED: "words"}
#: Below how many terms of ``x^M mod p`` the C routine sums rows of words rather than use carry-less multiplication,
#: per method (``mt_words_below`` in ``_generator_jump.c``): used when a checked method is not the routine's own choice.
_WORDS_BELOW = {"words": 0, "clmul128": 2000}
_CHECK_SEED = 20_251_129


@dataclass(frozen=True)
class _Method:
    name: str
    best: bool  # the routine's own choice when given no method: it may then be passed None


# Keyed by the routines' module itself (tests put stand-ins in its place), held: an id could be reused.
_chosen: dict[tuple[object, str], _Method] = {}  # (routines, function) -> the method to use
_verdicts: dict[tuple[object, str, str], bool] = {}  # (routines, function, method) -> agrees
_checking = threading.Lock()


def _checked_method(speedups: object, function: str) -> _Method:
    """The best method of the C routine ``function`` that agrees with the portable one, each checked at its first
    use (see Note [Each jump method checked where it runs])."""
    key = (speedups, function)
    chosen = _chosen.get(key)
    if chosen is not None:
        return chosen
    with _checking:
        methods: tuple[str, ...] = speedups.mt19937_methods()[function]  # type: ignore[attr-defined]
        for method in reversed(methods):
            if method == _PORTABLE[function] or _agrees(speedups, function, method):
                chosen = _chosen[key] = _Method(method, method == methods[-1])
                return chosen
    raise AssertionError(f"mt19937_{function} lists no portable method")  # the C file always has it


def _twist_method(speedups: object, coefficients: bytes) -> str | None:
    """The method to pass ``mt19937_twisted`` for ``coefficients``: None (its own choice) while its best method is
    trusted, else the best checked one, or ``words`` for a power of few terms, as the routine chooses."""
    method = _checked_method(speedups, _TWISTED)
    if method.best:
        return None
    if int.from_bytes(coefficients, "little").bit_count() < _WORDS_BELOW.get(method.name, 0):
        return _PORTABLE[_TWISTED]
    return method.name


def _agrees(speedups: object, function: str, method: str) -> bool:
    """Whether ``method`` of the C routine ``function`` gives the portable method's bytes on a far jump; warns,
    once per process and method, when it does not. Call with ``_checking`` held."""
    key = (speedups, function, method)
    verdict = _verdicts.get(key)
    if verdict is None:
        portable = _PORTABLE[function]
        # Any polynomial serves to compare sums: half its coefficients ones (a far jump's power has as many), none
        # of degree 19,937 or more; and words of a seeded generator.
        generator = torch.Generator(device="cpu").manual_seed(_CHECK_SEED)
        size = (_PACKED_BYTES + _ARRAY_END - _ARRAY_START,)
        random = torch.randint(0, 256, size, generator=generator, device="cpu")  # whatever the default device is
        drawn = bytes(random.to(torch.uint8).tolist())
        coefficients = drawn[: _PACKED_BYTES - 1] + bytes([drawn[_PACKED_BYTES - 1] & 1])
        arrays = [bytearray(drawn[_PACKED_BYTES:]) for _ in range(2)]
        speedups.mt19937_twisted(memoryview(arrays[0]), coefficients, method)  # type: ignore[attr-defined]
        speedups.mt19937_twisted(memoryview(arrays[1]), coefficients, portable)  # type: ignore[attr-defined]
        verdict = arrays[0] == arrays[1]
        _verdicts[key] = verdict
        if not verdict:
            warnings.warn(
                f"modattrs: the C routine mt19937_{function} gives other bytes with its method {method!r} than with "
                f"the portable {portable!r} on this CPU; {method!r} is not used again in this process (jumps of the "
                "generator take a slower method, with the same results). Please report it with this CPU's model",
                RuntimeWarning,
                stacklevel=2,
            )
    return verdict


def forget_checked_methods() -> None:
    """Forget which methods of the C routines were checked: the next jumps check theirs again, as a fresh process's
    would (for tests)."""
    with _checking:
        _chosen.clear()
        _verdicts.clear()


def _packed(coefficients: torch.Tensor) -> bytes:
    """A float64 tensor of 0s and 1s, lowest degree first, bit-packed."""
    bits = torch.zeros(_PACKED_BYTES * 8, dtype=torch.int64, device="cpu")
    bits[: coefficients.numel()] = coefficients.to(torch.int64)
    weights = torch.arange(8, dtype=torch.int64, device="cpu")
    packed = bytearray(_PACKED_BYTES)
    torch.frombuffer(packed, dtype=torch.uint8).copy_((bits.view(-1, 8) << weights).sum(1))
    return bytes(packed)


def _unpacked(packed: bytes) -> torch.Tensor:
    """``_packed``'s inverse: the coefficients of degree 0 to 19,936 as a float64 tensor of 0s and 1s."""
    digits = torch.frombuffer(bytearray(packed), dtype=torch.uint8).to(torch.int64)
    bits = (digits[:, None] >> torch.arange(8, dtype=torch.int64, device="cpu")) & 1
    return bits.view(-1)[:_DEGREE].to(torch.float64)


def _untempered(words: torch.Tensor, count: int) -> torch.Tensor:
    """The untempered words ``w[0 .. count - 1]`` that follow from the array ``words = w[0 .. 623]``."""
    stream = torch.empty(count, dtype=torch.int64, device="cpu")
    stream[:_N] = words
    known = _N
    while known < count:
        # every twist(w[n], w[n + 1]) with n + 1 < known is computable now: that is the next 623 words' worth
        end = min(known + _N - 1, count)
        upper = stream[known - _N : end - _N]
        lower = stream[known - _N + 1 : end - _N + 1]
        mixed = (upper & _UPPER_BIT) | (lower & _LOWER_BITS)
        twisted = (mixed >> 1) ^ ((lower & 1) * _MATRIX_A)
        # w[m] = w[m - 227] ^ twisted, in runs no longer than 227 so that each run reads finished words only
        for start in range(known, end, _SHORTEST_LAG):
            stop = min(start + _SHORTEST_LAG, end)
            torch.bitwise_xor(
                stream[start - _SHORTEST_LAG : stop - _SHORTEST_LAG],
                twisted[start - known : stop - known],
                out=stream[start:stop],
            )
        known = end
    return stream


def _correlate(coefficients: torch.Tensor, stream: torch.Tensor) -> torch.Tensor:
    """``XOR_j c_j w[j + i]`` for ``i`` in 1..624: each bit is a parity of a correlation, computed by FFT."""
    # row s holds bits s and s + 16 of every word; a count of ones is at most 19,937 < 2^16, so they stay apart
    shifts = torch.arange(16, dtype=torch.int64, device="cpu")[:, None]
    planes = ((stream[None, :] >> shifts) & 0x10001).to(torch.float64)
    spectrum = torch.fft.rfft(planes, n=_WORDS_FFT) * torch.fft.rfft(coefficients, n=_WORDS_FFT).conj()
    counts = torch.fft.irfft(spectrum, n=_WORDS_FFT)[:, 1 : _N + 1].round().to(torch.int64)
    words: torch.Tensor = ((counts & 0x10001) << shifts).sum(0)
    return words


def _power_of_x(exponent: int) -> torch.Tensor:
    """The coefficients of ``x^exponent mod p`` as a float64 tensor of 0s and 1s, lowest degree first.

    Works on the linear form ``rho`` with ``a_N = rho . P`` for every sequence ``a = P / Q`` the recurrence allows
    (``Q`` the reversed ``p``, ``P`` of degree below 19,937): ``a_N = a_(N // 2)`` of ``P' = (P Q)_(N mod 2)``, the
    coefficients of ``P Q`` of ``N``'s parity, so ``rho(N)`` is the transpose of that map applied to
    ``rho(N // 2)``, one bit of ``N`` at a time from the top. For ``m < 19937``, ``x^m mod p = x^m`` and
    ``rho(m)_i = u_(m - i)`` with ``u = 1 / Q``, which starts the chain. Finally ``c_j = sum_i rho_i Q_(i - j)``.
    """
    tables = _tables()
    bits = bin(exponent)[2:]
    top = 0
    used = 0
    while used < len(bits) and 2 * top + int(bits[used]) < _TOP_BITS_LIMIT:
        top = 2 * top + int(bits[used])
        used += 1
    rho = torch.zeros(_DEGREE, dtype=torch.float64, device="cpu")
    rho[: top + 1] = tables.inverse[: top + 1].flip(0)
    for bit in bits[used:]:
        correlations = torch.fft.irfft(torch.fft.rfft(rho, n=_STEP_FFT) * tables.halving[int(bit)], n=_STEP_FFT)
        # row 0 holds the even-indexed results, row 1 the odd ones: interleave them
        rho = correlations[:, : (_DEGREE + 1) // 2].T.reshape(-1)[:_DEGREE].round_().remainder_(2)
    coefficients = torch.fft.irfft(torch.fft.rfft(rho, n=_FINAL_FFT) * tables.final, n=_FINAL_FFT)[:_DEGREE]
    parities: torch.Tensor = coefficients.round_().remainder_(2)
    return parities


@dataclass(frozen=True)
class _Tables:
    inverse: torch.Tensor  # 1 / Q mod x^19937, float64 0s and 1s
    halving: tuple[torch.Tensor, torch.Tensor]  # per parity e, the conjugate spectra of rows (Q_(2t+e), Q_(2t+e-1))
    final: torch.Tensor  # conjugate spectrum of Q


@functools.cache
def _tables() -> _Tables:
    """Built on the first jump by the torch path (0.05 to 0.15 s): the spectra its jumps use.

    Every tensor here and below is made on the CPU explicitly, whatever ``torch.set_default_device`` says.
    """
    q = sum(1 << (_DEGREE - term) for term in _P_TERMS)  # Q: p reversed
    q_bits = _bits(bin(q)[2:].zfill(_DEGREE + 1)[::-1])
    # u = 1 / Q: u_0 = 1 and u_t = sum_(i=1..t) Q_i u_(t - i); `reversed_u` holds u_(t-1), ..., u_0 from bit 0 up
    shifted, reversed_u = q >> 1, 1
    for _ in range(1, _DEGREE):
        reversed_u = (reversed_u << 1) | ((shifted & reversed_u).bit_count() & 1)
    inverse = _bits(bin(reversed_u)[2:].zfill(_DEGREE))
    # Q_(2t + s) for t in 0 .. 9,969 and s in -1, 0, 1, zero outside 0 .. 19,937
    padded = torch.zeros(_DEGREE + 4, dtype=torch.float64, device="cpu")
    padded[1 : _DEGREE + 2] = q_bits
    spectra = {s: torch.fft.rfft(padded[s + 1 :: 2][: _DEGREE // 2 + 2], n=_STEP_FFT).conj() for s in (-1, 0, 1)}
    halving = (torch.stack([spectra[0], spectra[-1]]), torch.stack([spectra[1], spectra[0]]))
    return _Tables(inverse, halving, torch.fft.rfft(q_bits, n=_FINAL_FFT).conj())


def _bits(digits: str) -> torch.Tensor:
    """A string of 0s and 1s as a float64 tensor of them, in the same order."""
    return torch.frombuffer(bytearray(digits.encode("ascii")), dtype=torch.uint8).to(torch.float64) - ord("0")
