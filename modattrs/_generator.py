"""Where the default CPU generator is, as eager code would see it, while records are behind it.

Fake tensors draw nothing, so while modules are recorded the real generator stays put, and eager code would be
further on: after the draws recorded so far. That *position* is a point of a record, ``(record, n)``, meaning "the
state after the first n operations of that record drew"; each recorded draw moves it. It holds for as long as the
real generator is untouched: ``torch.manual_seed`` or ``torch.set_rng_state`` with any other state puts the
position back on the real state. The functions that do it are wrapped (by ``_torch_changes``, with the wrappers
below) to see this (a reseed to the state the generator had would otherwise look as if nothing happened), and
``torch.get_rng_state`` tags the state it returns with the position, so that putting it back (``fork_rng`` does)
returns to that point rather than to the stale state.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from modattrs._recording import Record

__all__: list[str] = []

Point = tuple["Record", int]
Position = Union[torch.Tensor, Point]  # noqa: UP007 (evaluated at runtime on Python 3.10)

# Held by every recorded operation, every replay, and the wrapped functions: they all read or set the generator.
lock = threading.RLock()
epoch = 0  # counts manual_seed and set_rng_state calls that leave the points of records
_point: Point | None = None  # where eager code would be, valid while the real generator is as it was then
_point_state: torch.Tensor | None = None
_point_epoch = 0
_tags: WeakIdKeyDictionary = WeakIdKeyDictionary()  # state tensor handed out by get_rng_state -> the point then
_suspended = 0  # while replays set the generator to states of their own, the position is not theirs to change


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
    with _disable_current_modes():  # inside fake modes too, a generator's state is a real tensor
        return torch.default_generator.get_state()


def same(state: torch.Tensor, other: torch.Tensor | None) -> bool:
    if other is None:
        return False
    with _disable_current_modes():
        return torch.equal(state, other)


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


def restoring(func: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``torch.set_rng_state`` (``func``), going back to the point a state from ``get_rng_state`` stands for, or
    noting that the generator left the points of records."""

    @functools.wraps(func)
    def restoring(new_state: torch.Tensor) -> None:
        global epoch, _point
        if isinstance(new_state, FakeTensor):
            from modattrs._recording import DeferredInitError

            raise DeferredInitError(
                "torch.set_rng_state was given a fake tensor: a generator state copied (.clone()) while deferred_init "
                "records is fake. Put back the tensor torch.get_rng_state returned, unchanged, or use fork_rng"
            )
        with lock:
            point = _tags.get(new_state)  # type: ignore[no-untyped-call]
            func(new_state)
            if _suspended:
                return
            if point is None:
                epoch += 1
                _point = None
            else:
                move_to(point)

    return restoring


def saving(func: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``torch.get_rng_state`` (``func``), tagging the state it returns with the point the generator is at."""

    @functools.wraps(func)
    def saving() -> torch.Tensor:
        if _point is None:  # no record is behind the generator (the common case): nothing to tag
            return func()
        with lock:
            state = func()
            at = position(state)
            if not isinstance(at, torch.Tensor):
                _tags[state] = at
            return state

    return saving
