"""``torch.nn.init.trunc_normal_`` drawn by rounds of ``normal_``, any part of it alone.

Note [trunc_normal_ as rounds of normal_]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where its bounds hold more than 30% of the mass, torch 2.13's helper (``torch.nn.init._no_grad_trunc_normal_``)
samples by rejection: round 0 is ``tensor.normal_(mean, std)``; while any element of the result lies below ``lo``
or above ``hi`` (the bounds cast to the tensor's dtype), it draws a fresh ``normal_`` of the same layout and takes
its elements where the result is out of bounds (``torch.where``), and nowhere else. So after ``R`` rounds:

- element ``i`` holds the first of its ``R`` draws that lies in ``[lo, hi]``, and the result is element by element
  a function of ``R`` parts of ``normal_``, each a round apart in the generator's stream;
- the generator has moved by ``R`` times one ``normal_``'s outputs (``Pattern.outputs``).

``R`` depends on every element, so a replay finds it once, from the state before the call
(``RejectionSampler.rounds_from``). The scan draws round 0 in chunks (ranges of it on threads, each from a private
generator jumped to its range), keeping the positions still out of bounds, and each later round only at those
positions, through parts of the ``normal_`` joined where they lie less than a jump apart (``draws.JUMP_COST``) and
drawn from where the one before stopped: at 3 standard deviations, two rounds drawn through and a few hundred jumps
for a tensor of a billion elements, in the memory of a chunk and the positions. The helper itself holds the tensor,
a mask, a fresh draw and the merge's result at once, and draws ``R`` whole rounds.

Given ``R``, any part of the result (``Rejection.draw_runs``) is round 0 of that part, then, round by round, the
fresh draws at the part's positions still out of bounds: a rank keeping a shard of an output layer draws about
twice its shard and jumps, never the whole tensor. The model covers a contiguous tensor of 16 elements or more
(``normal_``'s block path, whose outputs do not depend on the state) and the default generator; anything else stays
an opaque call, run whole. Whether this process's helper samples so is checked once, on real tensors, against the
model (``helper_samples_by_rounds``): 2.8's helper is ``uniform_`` then ``erfinv_``, and stays opaque there.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from modattrs._deferred.rng import draws
from modattrs._deferred.rng.mt19937 import jumped_state
from modattrs._fake.trunc_normal import as_normal_rounds
from modattrs._torch_private import TRUNC_NORMAL_HELPER, disable_current_modes

__all__ = ["Rejection", "RejectionSampler", "helper_samples_by_rounds", "sampler"]

_Work = TypeVar("_Work")
_CHUNK = 1 << 22  # elements drawn at once by the scan and by a long part: 16 MB of float32
_BLOCK = 16  # normal_'s block path transforms 16 elements at a time: parts are cut on these


@dataclass(frozen=True)
class RejectionSampler:
    """A ``trunc_normal_`` call that ``Rejection`` models, before its number of rounds is known: one round (the
    ``normal_`` of the tensor's layout) and the bounds, in the tensor's dtype."""

    normal: draws.Pattern
    lo: float
    hi: float

    def rounds_from(self, state: torch.Tensor, threads: int = 1) -> int:
        """How many rounds of ``normal_`` the helper draws from ``state`` (Note [trunc_normal_ as rounds of
        normal_]), found without holding the tensor, on up to ``threads`` threads (each a range of the elements, from
        a private generator jumped to it)."""
        normal, per_round = self.normal, self.normal.outputs(state)
        ranges = _split(normal, threads)
        found = _on_threads(functools.partial(self._out_of_bounds_in, state), ranges)
        positions = torch.cat(found)
        rounds = 1
        while positions.numel():
            cuts = _even_cuts(positions.numel(), len(ranges))
            parts = [positions[start:stop] for start, stop in itertools.pairwise(cuts) if start < stop]
            values = torch.cat(_on_threads(functools.partial(_at_values, normal, state, rounds * per_round), parts))
            positions = positions[self._out_of_bounds(values)]
            rounds += 1
        return rounds

    def _out_of_bounds_in(self, state: torch.Tensor, elements: tuple[int, int]) -> torch.Tensor:
        """The positions out of bounds among ``elements`` (start, stop) of round 0 from ``state``, drawn in chunks."""
        start, stop = elements
        found: list[torch.Tensor] = []
        end, position = state, 0
        for first, last in _chunks(self.normal, start, stop):
            values, end, position = _drawn(self.normal, end, position, 0, first, last)
            found.append(self._out_of_bounds(values).nonzero().flatten().add_(first))
        return torch.cat(found) if found else torch.empty(0, dtype=torch.int64)

    def in_rounds(self, rounds: int) -> Rejection:
        return Rejection(self.normal, self.lo, self.hi, rounds, self.normal.kind)

    def _out_of_bounds(self, values: torch.Tensor) -> torch.Tensor:
        return (values < self.lo) | (values > self.hi)  # as the helper compares: in the dtype, to the cast bounds


@dataclass(frozen=True)
class Rejection(RejectionSampler):
    """A ``trunc_normal_`` call of ``rounds`` rounds of ``normal_``: what the walk and the shard-local planner
    ask of a ``draws.Pattern``, for the whole call (Note [trunc_normal_ as rounds of normal_])."""

    rounds: int
    kind: str  # the normal_'s (draws.BLOCKS), read as a Pattern's is

    @property
    def numel(self) -> int:
        return self.normal.numel

    @property
    def dtype(self) -> torch.dtype:
        return self.normal.dtype

    def outputs(self, state: torch.Tensor) -> int:
        return self.rounds * self.normal.outputs(state)

    def state_after(self, state: torch.Tensor) -> torch.Tensor:
        return jumped_state(state, self.outputs(state))

    def draw_with_end(
        self, state: torch.Tensor, start: int, stop: int, *, ahead: int = 0, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Elements ``start:stop`` of the result from ``state``, ``ahead`` outputs before the call's first (into
        ``out`` if given), with where the last private generator stopped, as ``Pattern.draw_with_end``."""
        values = torch.empty(stop - start, dtype=self.dtype, device="cpu") if out is None else out
        end, position = self.draw_runs(state, ahead, [range(start, stop)] if start < stop else [], values, start)
        return values, end, position

    def draw_runs(
        self, state: torch.Tensor, ahead: int, runs: Sequence[range], out: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor | None, int]:
        """Write elements ``runs`` (sorted, at least a block of 16 apart) of the result into ``out``, which holds
        the result's elements from ``offset`` on, from ``state``, ``ahead`` outputs before the call's first; return
        the state where the last private generator stopped and its position in outputs after the call's first
        (None, 0 when nothing was drawn)."""
        normal, per_round = self.normal, self.normal.outputs(state)
        end: torch.Tensor | None = state
        position = -ahead
        pending: list[torch.Tensor] = []
        for run in runs:  # round 0: the runs themselves
            for start, stop in _chunks(normal, run.start, run.stop):
                part = out[start - offset : stop - offset]
                assert end is not None
                _, end, position = _drawn(normal, end, position, 0, start, stop, out=part)
                pending.append(self._out_of_bounds(part).nonzero().flatten().add_(start))
        positions = torch.cat(pending) if pending else torch.empty(0, dtype=torch.int64)
        for round_ in range(1, self.rounds):
            if not positions.numel():
                break  # no element of the runs is drawn again: the walk jumps over the other rounds
            assert end is not None
            values, end, position = _at(normal, end, position, round_ * per_round, positions)
            out[positions - offset] = values
            positions = positions[self._out_of_bounds(values)]
        return (None, 0) if position <= 0 else (end, position)

    def draw_into(self, out: torch.Tensor, state: torch.Tensor, threads: int) -> torch.Tensor:
        """Write the whole result into ``out`` (a real contiguous CPU tensor of the call's layout) from ``state``,
        round 0 on up to ``threads`` threads (``Pattern.draw_into``), then each later round only where elements are
        still out of bounds; return the generator's state after the call. Holds ``out`` and the positions, where
        the helper holds three more tensors of its size."""
        normal = self.normal
        normal.draw_into(out, state, threads)
        flat = out.detach().view(-1)
        found = [self._out_of_bounds(flat[a:b]).nonzero().flatten().add_(a) for a, b in _chunks(normal, 0, self.numel)]
        positions = torch.cat(found) if found else torch.empty(0, dtype=torch.int64)
        end, position, per_round = state, 0, normal.outputs(state)
        for round_ in range(1, self.rounds):
            if not positions.numel():
                break
            values, end, position = _at(normal, end, position, round_ * per_round, positions)
            flat[positions] = values
            positions = positions[self._out_of_bounds(values)]
        return self.state_after(state)


def _drawn(
    normal: draws.Pattern,
    state: torch.Tensor,
    position: int,
    first: int,
    start: int,
    stop: int,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Elements ``start:stop`` of the round of ``normal`` whose first output is ``first`` outputs after the call's,
    from ``state``, ``position`` outputs after the call's first (negative: before it); the values, and where the
    private generator stopped, in outputs after the call's first."""
    here = position - first  # where `state` is, from this round's first output
    if here <= 0:
        values, end, stop_at = normal.draw_with_end(state, start, stop, ahead=-here, out=out)
    else:
        values, end, stop_at = normal.draw_with_end(state, start, stop, behind=here, out=out)
    assert end is not None
    return values, end, first + stop_at


def _at(
    normal: draws.Pattern, state: torch.Tensor, position: int, first: int, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The elements at ``positions`` (sorted) of the round of ``normal`` whose first output is ``first`` outputs
    after the call's, drawn as parts cut on blocks of 16, those less than a jump apart joined."""
    gap = draws.JUMP_COST // normal.per_draw
    values = torch.empty(positions.numel(), dtype=normal.dtype, device="cpu")
    end, taken = state, 0
    for part in _parts(positions.tolist(), normal, gap):
        drawn, end, position = _drawn(normal, end, position, first, part.start, part.stop)
        inside = positions[taken : taken + part.count]
        values[taken : taken + part.count] = drawn[inside - part.start]
        taken += part.count
    return values, end, position


@dataclass(frozen=True)
class _Part:
    start: int
    stop: int
    count: int  # how many of the positions it holds


def _parts(positions: list[int], normal: draws.Pattern, gap: int) -> list[_Part]:
    """``positions`` (sorted) covered by ranges cut on blocks of 16, joined when at most ``gap`` elements apart and
    kept below ``_CHUNK`` elements where a cut may fall (``_chunks``): each drawn in one piece."""
    parts: list[_Part] = []
    tail = _tail_begin(normal)
    for position in positions:
        start = position - position % _BLOCK
        stop = min(start + _BLOCK, normal.numel)
        if parts and start - parts[-1].stop <= gap and (stop - parts[-1].start <= _CHUNK or parts[-1].stop > tail):
            last = parts[-1]
            parts[-1] = _Part(last.start, max(last.stop, stop), last.count + 1)
        else:
            parts.append(_Part(start, stop, 1))
    return parts


def _chunks(normal: draws.Pattern, start: int, stop: int) -> list[tuple[int, int]]:
    """Elements ``start:stop`` of a round in pieces of at most ``_CHUNK`` (but the last), cut on blocks of 16 and
    never inside the redrawn last 16, which each piece after such a cut would draw again."""
    tail = _tail_begin(normal)
    cuts = [cut for cut in range(start - start % _CHUNK + _CHUNK, stop, _CHUNK) if cut <= tail]
    bounds = [start, *cuts, stop]
    return [(first, last) for first, last in itertools.pairwise(bounds) if first < last]


def _split(normal: draws.Pattern, threads: int) -> list[tuple[int, int]]:
    """The elements of a round in up to ``threads`` ranges of at least ``_CHUNK`` elements each, cut where a chunk
    may be (``_chunks``)."""
    count = max(1, min(threads, normal.numel // _CHUNK))
    tail = _tail_begin(normal)
    cuts = {min(cut - cut % _BLOCK, tail - tail % _BLOCK) for cut in _even_cuts(normal.numel, count)[1:-1]}
    bounds = [0, *sorted(cut for cut in cuts if 0 < cut < normal.numel), normal.numel]
    return [(start, stop) for start, stop in itertools.pairwise(bounds) if start < stop]


def _even_cuts(total: int, count: int) -> list[int]:
    return [total * index // count for index in range(count + 1)]


def _at_values(normal: draws.Pattern, state: torch.Tensor, first: int, positions: torch.Tensor) -> torch.Tensor:
    return _at(normal, state, 0, first, positions)[0]


def _on_threads(work: Callable[[_Work], torch.Tensor], items: Sequence[_Work]) -> list[torch.Tensor]:
    """``work`` of each of ``items``, the first in this thread and the others in ``draws.workers``'s (torch's
    kernels release the GIL), in their order."""
    if len(items) <= 1:
        return [work(item) for item in items] or [torch.empty(0, dtype=torch.int64)]
    pool = draws.workers(len(items) - 1)
    rest = [pool.submit(work, item) for item in items[1:]]
    try:
        first = work(items[0])
    finally:
        others = [future.result() for future in rest]
    return [first, *others]


def _tail_begin(normal: draws.Pattern) -> int:
    """The first of the last 16 elements, which the block path redraws after the others when the size is not a
    multiple of 16 (else ``numel``)."""
    return normal.numel if normal.tail_output is None else normal.numel - _BLOCK


def sampler(func: object, args: Sequence[Any], kwargs: Mapping[str, Any]) -> RejectionSampler | None:
    """The ``RejectionSampler`` of an opaque call of torch's ``trunc_normal_`` helper as a replay sees it (its
    tensor a stand-in of the recorded layout), or None where the model does not cover it (the module docstring)."""
    helper = _helper()
    if helper is None or func is not helper or not args or not isinstance(args[0], torch.Tensor):
        return None
    found = _covered(helper, args[0], args, kwargs)
    return found if found is not None and helper_samples_by_rounds(helper) else None


def _covered(
    helper: Callable[..., Any], tensor: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> RejectionSampler | None:
    """The model of ``helper(*args, **kwargs)`` on ``tensor`` where its arguments are ones the model covers,
    whether or not this process's helper samples so."""
    call = as_normal_rounds(helper, tensor.dtype, args, kwargs)
    if call is None or call.generator is not None or not math.isfinite(call.lo) or not math.isfinite(call.hi):
        return None
    normal = draws.pattern(torch.ops.aten.normal_.default, (tensor, call.mean, call.std), {})
    if normal is None or normal.kind != draws.BLOCKS:
        return None
    return RejectionSampler(normal, call.lo, call.hi)


def _helper() -> Callable[..., Any] | None:
    """torch's helper as it is defined (the fake mode's wrapper, when installed, holds it as ``__wrapped__``)."""
    helper = getattr(torch.nn.init, TRUNC_NORMAL_HELPER, None)
    return getattr(helper, "__wrapped__", helper)


def helper_samples_by_rounds(helper: Callable[..., Any]) -> bool:
    """Whether ``helper`` draws, in this process's torch, what ``Rejection`` models: checked on real tensors the
    first time it is asked, then remembered."""
    with _lock:
        known = _checked.get(id(helper))
        if known is None:
            known = _checked[id(helper)] = _agrees(helper)
        return known


_checked: dict[int, bool] = {}
_lock = threading.Lock()


def _agrees(helper: Callable[..., Any]) -> bool:
    """Run ``helper`` and the model from equal states of private generators, on real contiguous CPU tensors of each
    float dtype and sizes around the block path's edges, with bounds that take several rounds; compare the values
    bit for bit and the states after."""
    calls = [(0.0, 1.0, -1.5, 2.0), (0.5, 2.0, -1.0, 3.0), (0.0, 0.02, -0.06, 0.06)]
    shapes = [(16,), (17,), (100,), (33, 40)]
    with disable_current_modes(), torch.no_grad():
        generator = torch.Generator(device="cpu")
        generator.manual_seed(20_261_130)
        try:
            for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                for mean, std, a, b in calls:
                    for shape in shapes:
                        tensor = torch.empty(shape, dtype=dtype, device="cpu")
                        found = _covered(helper, tensor, (tensor, mean, std, a, b), {})
                        if found is None:
                            return False
                        state = generator.get_state()
                        rejection = found.in_rounds(found.rounds_from(state))
                        expected = rejection.draw_with_end(state, 0, tensor.numel())[0]
                        helper(tensor, mean, std, a, b, generator=generator)
                        if not draws.same_bits(tensor.flatten(), expected):
                            return False
                        if not torch.equal(generator.get_state(), rejection.state_after(state)):
                            return False
        except Exception:  # a helper that refuses these arguments is not the one the Note describes
            return False
        return True
