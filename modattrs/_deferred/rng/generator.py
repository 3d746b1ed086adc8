"""The default CPU generator's timeline: where eager code would have it, and how replays get it there.

This module owns every rule about the random generator in deferred initialization; the recorder and the replayer
ask it and do what it says.

Positions. Fake tensors draw nothing, so while modules are recorded the real generator stays put, and eager code
would be further on: after the draws recorded so far. That *position* is a point of a record, ``(record, n)``,
meaning "the state after the first n operations of that record drew"; each recorded draw moves it. It holds for as
long as the real generator is untouched: ``torch.manual_seed`` or ``torch.set_rng_state`` with any other state puts
the position back on the real state. The functions that do it are wrapped (by ``_torch_changes``, with the wrappers
below) to see this, and each recorded draw also moves the real generator on by one draw of its own, so that a
reseed through a name that is not wrapped still changes the state it finds (see ``drew``); and
``torch.get_rng_state`` returns the state eager code has at the position, worked out by a replay of the record's
draws up to it, tagged with the position, so that putting it back (``fork_rng`` does) returns to that point. A
``deferred_init`` that raises puts the generator back as it found it (``undone_on_failure``).

Records. A record notes where the generator was when it began (``start``) and after its last draw (``point``). A
draw from the default CPU generator notes where the generator was set to before it (``Op.reset``) when that is not
where the record's previous draw left it: after a reseed, a ``fork_rng``, or draws recorded by another record in
between. A draw from another device's default generator notes the CPU state after a reseed: materialized on the
CPU, eager code would have drawn from the reseeded CPU generator.

Replays. To run a draw as eager code did, a replay needs the generator's state right before it: it sets the
nearest state it knows at or before that point and moves the generator over the draws in between, by jumping where
it can (Note [Reaching a draw by jumping]) and otherwise by running them on scratch tensors of the same layout,
freed at once. The states it knows: the one recording began from, the resets noted, the one it holds after the draw
it ran last, and the states that earlier replays of the record passed through and remembered. So materializing a
model block by block, in any order, runs each draw a small number of times in all rather than again from the start
for every block. A remembered state (5 KB for the CPU generator) is dropped when every draw between it and the next
remembered one has been materialized, or is dead (overwritten before anything reads it): no replay would start
there. The state after the last draw stays, for replays to the end.

Note [The generator where eager code has it]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When ``deferred_init`` returns, and after each draw recorded later (initialization of a deferred module), the real
generator is put where eager code would have it: past every draw of the record, by a jump over what ``draws`` counts
and by running on scratch tensors what it does not (``randperm``, an opaque init: as a replay to the end would). A
``trunc_normal_`` that ``rejection`` models is jumped over by its rounds, counted once, in chunks (Note
[trunc_normal_ as rounds of normal_]), and noted in the record (``Record.rounds``). Code that draws before
materializing (a new head, a data order, a dropout mask) then gets eager code's numbers, and a record so settled is
replayed without touching the generator: a full materialization leaves it where it finds it, which is where eager
code has it. Settling after a draw starts from the state before it (the draw's reset: the generator was settled
after the previous one), so that it costs that one draw, not a walk of the record (Note [Slicing from the needed
tensors] in ``slicing``): ``model.apply(init)`` on a deferred model stays linear in its draws. Until then (while
``deferred_init`` records, and for a record drawn into from inside another ``deferred_init``) the position is a
point, as described above.

Note [Reaching a draw by jumping]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
MT19937 can be moved ahead by any number of outputs without drawing them (``mt19937.jumped_state``: drawing raw
outputs below five million, a polynomial jump of milliseconds above), and ``draws`` knows how many outputs each
random operation takes, checked against torch at the first use of each kind of call. So the draws between a known
state and the one a replay needs are added up and jumped over at once: materializing a head after the body came from
a checkpoint, or the last block of a model, costs about what its own draws cost, not the whole stream before them.
A draw neither ``draws`` nor ``rejection`` models (``randperm``, an opaque init), or whose count depends on the state
(the Box-Muller pairs of small ``normal_`` calls, which read the cached normal), is run as before, after the jump to
it. States are remembered only where the generator really is.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from modattrs._deferred.record import Copies, DeferredInitError, Op, Point, Position, Record, scratch_arguments
from modattrs._deferred.rng import draws, rejection
from modattrs._deferred.rng.mt19937 import jumped_state
from modattrs._deferred.slicing import keep_results, slice_of
from modattrs._torch_private import FakeTensor, OpOverload, disable_current_modes, written_arguments

__all__: list[str] = []

#: A draw whose parts a walk draws: a kernel ``draws`` models, or a ``trunc_normal_`` of known rounds.
Modelled = draws.Pattern | rejection.Rejection

# Held by every recorded operation, every replay, and the wrapped functions: they all read or set the generator.
lock = threading.RLock()
epoch = 0  # counts manual_seed and set_rng_state calls that leave the points of records
_point: Point | None = None  # where eager code would be, valid while the real generator is as it was then
_point_state: torch.Tensor | None = None
_point_epoch = 0
_tags: WeakIdKeyDictionary = WeakIdKeyDictionary()  # state tensor handed out by get_rng_state -> the point then
_suspended = 0  # while replays set the generator to states of their own, the position is not theirs to change
_META = torch.device("meta")


# --- where eager code would be ----------------------------------------------------------------------------------------


def position(state: torch.Tensor | None = None) -> Position:
    """Where the default CPU generator is now: a point of a record, or its real state (``state``, if the caller
    has just read it)."""
    global _point, _point_state
    with lock:
        state = real_state() if state is None else state
        if _suspended:
            return state
        if _point is not None and _point_epoch == epoch and same(state, _point_state):
            return _point
        _point = _point_state = None  # gone for good: let its record go
        return state


def move_to(point: Point) -> None:
    """Note that eager code would now be at ``point``: a record drew (or a state tagged with it was put back)."""
    global _point, _point_state, _point_epoch
    with lock:
        _point, _point_state, _point_epoch = point, real_state(), epoch


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Hold the position as it is while a replay runs real operations (which may call the wrapped functions)."""
    global _suspended
    with lock:
        _suspended += 1
        try:
            yield
        finally:
            _suspended -= 1


def real_state() -> torch.Tensor:
    with disable_current_modes():  # inside fake modes too, a generator's state is a real tensor
        return torch.default_generator.get_state()


def same(state: torch.Tensor, other: torch.Tensor | None) -> bool:
    if other is None:
        return False
    with disable_current_modes():
        return torch.equal(state, other)


# --- torch functions that read or set the generator (installed by _torch_changes) ---------------------------------


def seeding(func: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.manual_seed`` (``func``), noting that the generator left the points of records."""

    @functools.wraps(func)
    def seeding(*args: Any, **kwargs: Any) -> Any:
        global epoch, _point
        with lock:
            if not _suspended:
                epoch += 1
                _point = None
            return func(*args, **kwargs)

    return seeding


def restoring(func: Callable[..., None]) -> Callable[..., None]:
    """``torch.set_rng_state`` (``func``), going back to the point a state from ``get_rng_state`` stands for, or
    noting that the generator left the points of records. It takes its arguments as ``func`` does, and hands them
    to it as given: ``func`` checks them."""

    @functools.wraps(func)
    def restoring(*args: Any, **kwargs: Any) -> None:
        global epoch, _point
        new_state = args[0] if args else kwargs.get("new_state")
        if isinstance(new_state, FakeTensor):
            raise DeferredInitError(
                "torch.set_rng_state was given a fake tensor: a generator state copied (.clone()) while deferred_init "
                "records is fake.\nPut back the tensor torch.get_rng_state returned, unchanged, or use fork_rng"
            )
        with lock:
            # Only tensors are tagged (and can be held weakly): anything else is torch's to refuse.
            point = _tags.get(new_state) if isinstance(new_state, torch.Tensor) else None  # type: ignore[no-untyped-call]
            func(*args, **kwargs)
            if _suspended:
                return
            if point is None:
                epoch += 1
                _point = None
            else:
                move_to(point)

    return restoring


def saving(func: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``torch.get_rng_state`` (``func``). At a point of a record, it returns the state eager code has there
    (``state_at``, a replay of the record's draws up to that point: the real generator is elsewhere), tagged with
    the point, so that putting it back returns there, and drawing from it gives eager code's numbers. Its arguments
    (torch's takes none) are handed to ``func`` as given."""

    @functools.wraps(func)
    def saving(*args: Any, **kwargs: Any) -> torch.Tensor:
        if _point is None:  # no record is behind the generator (the common case): nothing to tag
            return func(*args, **kwargs)
        with lock:
            state = func(*args, **kwargs)
            at = position(state)
            if isinstance(at, torch.Tensor):
                return state
            eager = state_at(at)  # a tensor of its own: the caller may change it
            _tags[eager] = at
            return eager

    return saving


# --- what records note while recording --------------------------------------------------------------------------------


@contextlib.contextmanager
def undone_on_failure() -> Iterator[None]:
    """Put the default CPU generator back as it was, its state and its position, if the body raises: a
    ``deferred_init`` whose construction raises leaves it as it found it. Recording moved it (each recorded draw
    moves it on by one draw of its own, see ``drew``); where eager code would be, after the draws up to the
    failure, is no state the caller could plan for. So a fallback built after the ``except`` gets the numbers it
    would get had the failed call not been made."""
    global epoch, _point, _point_state, _point_epoch
    with lock:
        saved = real_state()
        at, saved_epoch = position(saved), epoch
    try:
        yield
    except BaseException:
        with lock:
            _set_state(saved)
            epoch = saved_epoch  # a reseed inside the failed call is undone with the rest
            if isinstance(at, torch.Tensor):
                _point = _point_state = None
            else:
                _point, _point_state, _point_epoch = at, saved, epoch
        raise


def new_record() -> Record:
    """An empty record that begins where the generator is now."""
    with lock:
        start = position()
        return Record(start=start, point=start, point_epoch=epoch, epoch=epoch)


def reset_before_draw(record: Record) -> Position | None:
    """Where the default CPU generator is before a draw of ``record``, unless it is where the record's last draw
    left it (then the draw needs no reset)."""
    with lock:
        now = position()
        last = record.point
        if now is last or (isinstance(now, torch.Tensor) and isinstance(last, torch.Tensor) and same(now, last)):
            return None
        return now


def drew(record: Record) -> None:
    """Note that the operation just appended to ``record`` drew from the default CPU generator.

    The real generator is moved on by one draw of its own: left where it was, a reseed that sets the state it had
    (``torch.manual_seed(0)`` before each of two ``deferred_init`` calls) through a name that is not wrapped (an
    earlier ``from torch import manual_seed``, ``torch.default_generator.manual_seed``) would look as if nothing
    happened, and the second record would continue the first's draws.
    """
    with lock:
        point = (record, len(record.ops))
        record.point, record.point_epoch, record.settled = point, epoch, False
        with disable_current_modes():  # on the CPU whatever the default device (its generator is the one)
            torch.empty((), dtype=torch.float32, device="cpu").random_()
        move_to(point)


def settle(record: Record) -> None:
    """Put the real generator where eager code has it after ``record``'s draws, if it is at the record's point
    (nothing reseeded it since the last draw); see Note [The generator where eager code has it]."""
    with lock:
        if position() is record.point and not isinstance(record.point, torch.Tensor):
            _set_state(state_at(record.point))
            _forget_point_of(record)  # the real state now is what the point stood for
            record.states.pop("", None)  # what working it out passed: replays jump from the start as cheaply
        record.settled = True


def reset_for_other_device(record: Record) -> torch.Tensor | None:
    """For a draw from another device's default generator: the CPU state to draw from if ``record`` is
    materialized on the CPU, when the generator was reseeded since the record's last such draw."""
    with lock:
        if epoch == record.epoch:
            return None
        record.epoch = epoch
        return real_state()


# --- replays ----------------------------------------------------------------------------------------------------------


def state_at(point: Point) -> torch.Tensor:
    """The default CPU generator's state at ``point`` (after the first ``count`` operations of ``record`` drew), as
    in eager code: the record's draws up to there jumped over, and those whose count of outputs depends on values
    (the pinned ones) run for real, with what they read."""
    record, count = point
    with replaying(record, None, to_end=False) as walk:
        sliced = slice_of(record, {}, count)  # nothing is needed but the pinned operations and what they read
        env: dict[int, torch.Tensor] = {}
        copies: Copies = {}
        for index in sliced.kept:
            op = record.ops[index]
            drawn = walk.is_draw(index)
            if drawn:
                walk.before(index)
            args, kwargs = op.arguments({slot.index: env[slot.ref] for slot in op.slots}, None, copies=copies)
            keep_results(op, op.func(*args, **kwargs), env, sliced.wanted, None, copies)
            if drawn:
                walk.ran(index)
            for ref in sliced.frees.get(index, ()):
                env.pop(ref, None)
        walk.reach(count)
        return real_state()


class Walk:
    """Moves the default CPU generator along one record's CPU draws, for one replay (see the module's docstring).

    What the replay and the shard-local planner ask of it: whether an operation draws from the default CPU
    generator (``is_draw``) and how, when ``draws`` models it (``pattern_of``); set the state a draw is run from
    (``before``, then ``ran``); draw a part of a fill into a tensor, the generator moved on as if all of it were
    drawn (``draw_part``, ``draw_runs``); jump to a point of the record (``reach``).
    """

    def __init__(self, record: Record, device: torch.device | None) -> None:
        self.record = record
        self.device = device
        # The record's own lists (draws_on_cpu of each, noted as it was recorded), read and never changed here: a
        # walk, made for every replay and for each draw an initialization of a deferred module records (settle),
        # costs what it walks, not a pass over every draw.
        self.draws, self.resets = _draws_for(record, device)
        replayed_on = "" if device is None else str(device)
        self.states = record.states.setdefault(replayed_on, {})
        # The rounds of each trunc_normal_ the walk models (rng.rejection): they depend on the state before it, which
        # depends on the draws a replay on this device makes, as the states do.
        self.rounds = record.rounds.setdefault(replayed_on, {})
        self.live: int | None = None  # the generator holds the state after the first `live` operations ...
        self.pending = 0  # ... but for this many outputs, which it is yet to be jumped over
        self._scratch: dict[int, torch.Tensor] = {}  # memory the draws it runs without keeping write into
        self._outputs: dict[int, int | None] = {}  # by draw: see _outputs_of
        self._patterns: dict[int, Modelled | None] = {}  # by draw: see pattern_of

    def is_draw(self, index: int) -> bool:
        at = bisect.bisect_left(self.draws, index)
        return at < len(self.draws) and self.draws[at] == index

    def before(self, index: int) -> None:
        """Set the generator to the state the draw at ``index`` draws from in eager code (a ``trunc_normal_``'s
        rounds are counted first, from that state: every kept operation before it has run)."""
        self.pattern_of(index)
        self._ahead_of(index)
        self._jump_pending()
        self.live = None

    def draw_part(self, index: int, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Draw elements ``start:stop`` of the random fill at ``index`` (a draw ``pattern_of`` models) as eager code's
        whole fill has them, into ``out`` if given (else into memory of their own), and return them; the fill is
        not run, and the generator goes on from where the part stopped (``_drew_part``)."""
        pattern = self._modelled(index)
        state, ahead = self._ahead_of(index)
        values, end, position = pattern.draw_with_end(state, start, stop, ahead=ahead, out=out)
        self._drew_part(index, end, position)
        return values

    def draw_runs(self, index: int, runs: Sequence[range], out: torch.Tensor, offset: int) -> None:
        """``draw_part`` of each of ``runs`` (sorted, disjoint elements of the fill at ``index``) into its place in
        ``out``, which holds the fill's elements from ``offset`` on: each run drawn from where the one before stopped,
        the gaps jumped (Note [A window drawn as runs] in ``windows``)."""
        pattern = self._modelled(index)
        state, ahead = self._ahead_of(index)
        self._drew_part(index, *pattern.draw_runs(state, ahead, runs, out, offset))

    def filled(self, index: int, args: Sequence[Any], kwargs: dict[str, Any], *, threads: int) -> torch.Tensor | None:
        """Run the draw at ``index`` (``before`` set the generator for it) with ``args`` and ``kwargs`` a faster way
        to the same values and state after, and return what it filled; None, and nothing done, where there is none:
        a ``trunc_normal_`` of known rounds drawn into its tensor by its model (Note [trunc_normal_ as rounds of
        normal_]), without the helper's temporaries, round 0 on ``threads`` threads; a fill ``draws`` models, on
        ``threads`` threads (``filled_on_threads``), or on this one where modattrs' own kernel draws it
        (``draws.own_kernel_draws``)."""
        found = self._patterns.get(index)
        tensor = args[0] if args else None
        if isinstance(found, rejection.Rejection) and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
            _set_state(found.draw_into(tensor, _get_state(), threads))
            return tensor
        func = self.record.ops[index].func
        if threads > 1 or draws.own_kernel_draws(func, args):
            return filled_on_threads(func, args, kwargs, threads)
        return None

    def _modelled(self, index: int) -> Modelled:
        found = self.pattern_of(index)
        assert found is not None, f"a part drawn of operation {index}, which draws does not model"
        return found

    def _ahead_of(self, index: int) -> tuple[torch.Tensor, int]:
        """The generator's state and how many outputs before the draw at ``index`` it is: the draw reads the state
        ``jumped_state(state, outputs)``, jumped here by whoever draws a part of it, in one jump with the jump to
        that part (``_drew_part`` then notes the draw)."""
        op = self.record.ops[index]
        if op.reset is not None:
            _set_state(self._reset_of(index))
            self.pending = 0
        else:
            self._reach(index)
        return _get_state(), self.pending

    def ran(self, index: int) -> None:
        """Note that the draw at ``index`` ran for real, from the state ``before`` set."""
        self.live = index + 1
        self.record.drawn.add(index)

    def _skipped(self, index: int) -> None:
        """Note that the draw at ``index`` was not run (a part of its result was drawn apart, see
        ``Note [Replaying only the part that is kept]``): the generator is where ``_ahead_of`` left it."""
        self.live = index
        self.record.drawn.add(index)

    def _drew_part(self, index: int, state: torch.Tensor | None, position: int) -> None:
        """Note that a part of the draw at ``index`` was drawn apart (``_ahead_of``), by a private generator that
        stopped in ``state``, ``position`` outputs after the draw's first: the generator goes there, so that the
        next jump starts from a place that repeats from one identical layer to the next. Without a ``state``, or
        for a draw whose count of outputs depends on the state, the generator stays (``skipped``)."""
        outputs = self._outputs_of(index)
        if state is None or outputs is None:
            self._skipped(index)
            return
        _set_state(state)
        self.live, self.pending = index + 1, outputs - position
        self.record.drawn.add(index)

    def reach(self, count: int) -> None:
        """Set the generator to the state after the first ``count`` operations drew, as in eager code."""
        self._reach(count)
        self._jump_pending()

    def _jump_pending(self) -> None:
        if self.pending:
            _set_state(jumped_state(_get_state(), self.pending))
            self.pending = 0

    def _reach(self, count: int) -> None:
        """``reach``, leaving the last jump pending: ``self.pending`` outputs."""
        if self.live == count:
            return
        start = self._nearest_known(count)
        behind = self.pending if start == self.live else 0  # outputs the generator has yet to move by
        self.pending = 0
        if start != self.live:
            if start in self.states:
                _set_state(self.states[start])
            elif start == 0:
                _set_state(self._start())
            # else: a reset at `start`, set below
        ops = self.record.ops
        for index in self.draws[bisect.bisect_left(self.draws, start) : bisect.bisect_left(self.draws, count)]:
            op = ops[index]
            if op.reset is not None:
                behind = 0
                _set_state(self._reset_of(index))
            elif behind == 0 and index not in self.states:
                self.states[index] = _get_state()
            outputs = self._outputs_of(index, functools.partial(_jumped_from_here, behind))
            if outputs is not None:
                behind += outputs
                continue
            if behind:
                _set_state(jumped_state(_get_state(), behind))
                behind = 0
            args, kwargs = op.arguments(scratch_arguments(op, self.device, self._scratch), self.device)
            op.func(*args, **kwargs)
        self.pending = behind
        self.live = count

    def pattern_of(self, index: int, state: Callable[[], torch.Tensor] | None = None) -> Modelled | None:
        """How the operation at ``index`` reads the default CPU generator, if it is a draw from it that ``draws``
        or ``rejection`` models; else None. A ``trunc_normal_`` the first time: its rounds are found from the state
        before it (``state()``, else worked out by reaching it, which moves the walk there: ask only once every kept
        operation before it has run, as the replay does at its turn) and noted in the record, by replay device."""
        if not self.is_draw(index):
            return None
        if index not in self._patterns:
            found = self._model_of(index)
            if isinstance(found, rejection.RejectionSampler) and not isinstance(found, rejection.Rejection):
                rounds = self.rounds.get(index)
                if rounds is None:
                    before = self._state_before(index) if state is None else state()
                    rounds = self.rounds[index] = found.rounds_from(before, torch.get_num_threads())
                found = found.in_rounds(rounds)
            self._patterns[index] = found
        return self._patterns[index]

    def kind_of(self, index: int) -> str | None:
        """The kind (``draws.SERIAL``, ``BLOCKS``, ``PAIRS``) of the draw at ``index`` if ``pattern_of`` models it,
        else None; without counting a ``trunc_normal_``'s rounds, so that the planner may ask before the operations
        before it have run (a value-dependent draw among them runs only then)."""
        if not self.is_draw(index):
            return None
        found = self._patterns[index] if index in self._patterns else self._model_of(index)
        if isinstance(found, rejection.RejectionSampler):
            return found.normal.kind
        return None if found is None else found.kind

    def _model_of(self, index: int) -> draws.Pattern | rejection.RejectionSampler | None:
        op = self.record.ops[index]
        key = _call_key(op, self.device)
        found = _PATTERNS.get(key, _UNKNOWN) if key is not None else _UNKNOWN
        if found is _UNKNOWN:
            args, kwargs = op.arguments(scratch_arguments(op, _META), self.device)
            found = draws.pattern(op.func, args, kwargs) or rejection.sampler(op.func, args, kwargs)
            if key is not None:
                if len(_PATTERNS) >= _PATTERNS_KEPT:
                    _PATTERNS.clear()
                _PATTERNS[key] = found
        return found  # type: ignore[no-any-return]  # _UNKNOWN is gone

    def _state_before(self, index: int) -> torch.Tensor:
        """The state the draw at ``index`` draws from, the walk moved there."""
        if self.record.ops[index].reset is not None:
            return self._reset_of(index)
        self.reach(index)
        return _get_state()

    def _outputs_of(self, index: int, state: Callable[[], torch.Tensor] | None = None) -> int | None:
        """How many outputs of the generator the draw at ``index`` takes, when that does not depend on the state
        and ``draws`` models it; else None, and the draw is run (see Note [Reaching a draw by jumping]). ``state``:
        the state before it, for ``pattern_of``."""
        if index not in self._outputs:
            found = self.pattern_of(index, state)
            modelled = found is not None and found.kind is not draws.PAIRS  # PAIRS: counts depend on the state
            self._outputs[index] = found.outputs(_get_state()) if modelled and found is not None else None
        return self._outputs[index]

    def finish(self) -> None:
        """Remember where the replay got to, and forget the states no later replay would start from: those followed,
        up to the next state remembered, only by draws that are materialized or dead (see ``Record.dead_writes``)."""
        self._jump_pending()
        if self.live is not None and self.live not in self.states:
            self.states[self.live] = _get_state()
        drawn, dead, draws = self.record.drawn, None, self.draws
        for start, end in itertools.pairwise([*sorted(self.states), len(self.record.ops) + 1]):
            # Looked at one by one up to the first that a replay may still need: the draws after where this one
            # stopped are the next block's, and a walk costs what it walks.
            rest = (draws[at] for at in range(bisect.bisect_left(draws, start), bisect.bisect_left(draws, end)))
            needed = False
            for index in rest:
                if index in drawn:
                    continue
                if dead is None:  # worked out only then: a whole materialization has drawn every draw
                    dead = self.record.dead_writes()
                if index not in dead:
                    needed = True
                    break
            if not needed:
                del self.states[start]

    def _nearest_known(self, count: int) -> int:
        """The latest point at or before ``count`` whose state is known: 0 (the start), a remembered state, a reset,
        or where the generator is now."""
        candidates = [0]
        if self.live is not None and self.live <= count:
            candidates.append(self.live)
        known = [index for index in self.states if index <= count]
        if known:
            candidates.append(max(known))
        before = bisect.bisect_left(self.resets, count)  # the last reset before `count`
        if before:
            candidates.append(self.resets[before - 1])
        return max(candidates)

    def _reset_of(self, index: int) -> torch.Tensor:
        op = self.record.ops[index]
        assert op.reset is not None
        op.reset = self._state_of(op.reset)  # worked out once; the record it pointed into can then go
        return op.reset

    def _start(self) -> torch.Tensor:
        self.record.start = self._state_of(self.record.start)
        return self.record.start

    def _state_of(self, position: Position) -> torch.Tensor:
        return position if isinstance(position, torch.Tensor) else state_at(position)


def _draws_for(record: Record, device: torch.device | None) -> tuple[list[int], list[int]]:
    """The operations of ``record`` that draw from the default CPU generator when replayed on ``device`` (None:
    where they were recorded), and those of them with a reset: ``draws_on_cpu`` of each, as the record noted them."""
    if device is None:
        return record.cpu_draws, record.cpu_resets
    if device.type == "cpu":
        return record.default_draws, record.default_resets
    return [], []


# The patterns of calls seen before, by what decides them (``_call_key``): a model's identical layers make the same
# calls, each of which would cost ``draws.pattern`` about 70 us again. Patterns are frozen; shared by records.
_PATTERNS: dict[tuple[Any, ...], draws.Pattern | rejection.RejectionSampler | None] = {}
_PATTERNS_KEPT = 4096
_UNKNOWN: Any = object()


def _call_key(op: Op, device: torch.device | None) -> tuple[Any, ...] | None:
    """What ``draws.pattern`` reads of a recorded call, hashable: the operation, its arguments but tensors, the
    tensors' layouts, the replay's device and, for a factory without tensor arguments, the defaults it takes. None
    for a call with a real tensor among its arguments (its kernel in the pattern holds that tensor) or an unhashable
    argument."""
    if op.constant_slots:
        return None
    key = (
        op.func,
        op.spec if op.plain is None else op.plain,  # the same, hashed faster
        tuple(op.flat),
        tuple((slot.index, slot.size, slot.stride, slot.dtype, slot.device) for slot in op.slots),
        device,
        None if op.slots else (op.default_dtype, torch.get_default_device()),
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


@contextlib.contextmanager
def replaying(record: Record, device: torch.device | None, *, to_end: bool) -> Iterator[Walk]:
    """Run a replay of ``record``, one at a time, with the walk that moves the generator along its draws.

    Afterwards the generator is put back, unless the replay ran ``to_end`` (every draw
    of the record) and the caller did not reseed since recording: eager code would then be past the record's
    draws, and the generator stays there.
    """
    with lock:
        # A settled record's draws are behind the real generator already: whatever drew since is eager code's own.
        keep = to_end and not record.settled and (position() is record.point or epoch == record.point_epoch)
        with suspended(), disable_current_modes(), torch.no_grad():
            saved = real_state()
            walk = Walk(record, device)
            finished = False
            try:
                yield walk
                finished = True
            finally:
                if finished:
                    walk.finish()
                if finished and keep:
                    _forget_point_of(record)
                else:
                    _set_state(saved)


def filled_on_threads(func: object, args: Sequence[Any], kwargs: dict[str, Any], threads: int) -> torch.Tensor | None:
    """Run a draw from the default CPU generator that fills its first argument in place (``func`` called with
    ``args`` and ``kwargs``) on ``threads`` threads (``draws.Pattern.draw_into``: the same values, each thread
    drawing its own range from a jumped copy of the state), and move the generator past it; return the filled
    tensor. None, and nothing done, for a call ``draws`` does not model so."""
    if not isinstance(func, OpOverload) or not args or not isinstance(args[0], torch.Tensor):
        return None
    if 0 not in (index for index, _ in written_arguments(func)):
        return None
    found = draws.pattern(func, args, kwargs)
    if found is None:
        return None
    torch.default_generator.set_state(found.draw_into(args[0], real_state(), threads))
    return args[0]


def _forget_point_of(record: Record) -> None:
    """The generator now holds the state after ``record``'s last draw for real: the point that stood for it can go,
    and with it the last reference to the record."""
    global _point, _point_state
    if _point is not None and _point[0] is record:
        _point = _point_state = None


def remembered_bytes(record: Record) -> int:
    """The memory that states remembered for ``record``'s replays take."""
    return sum(state.nbytes for states in record.states.values() for state in states.values())


def _jumped_from_here(outputs: int) -> torch.Tensor:
    return jumped_state(_get_state(), outputs)


def _get_state() -> torch.Tensor:
    # Walks run inside `replaying`, out of every dispatch mode already: real_state's step out of them costs more
    # than reading the state.
    return torch.default_generator.get_state()


def _set_state(state: torch.Tensor) -> None:
    # Not torch.set_rng_state: that one is watched for the user's changes (see restoring).
    torch.default_generator.set_state(state)
