"""Watching the user's changes of the default CPU generator while records are behind it (see ``_recording``).

A reseed to the state the generator had before looks as if nobody touched it, so calls to ``torch.manual_seed`` and
``torch.set_rng_state`` are counted. And a state saved with ``torch.get_rng_state`` while a record is behind the
generator (its draws not made yet) stands for the state after those draws: restoring it, as ``fork_rng`` does,
resets the generator to that point of the record, not to the state saved.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

if TYPE_CHECKING:
    from modattrs._recording import Record

__all__: list[str] = []

reseeds = 0
_saved: WeakIdKeyDictionary = WeakIdKeyDictionary()  # state tensor handed out -> (record, its op count then)
_restored: tuple[torch.Tensor, Record, int] | None = None  # the last such state put back
_last_record: weakref.ref[Record] | None = None
chain_lock = threading.Lock()  # held while a new record looks at the last one
_watching = False


def watch() -> None:
    """Wrap ``torch.manual_seed``, ``get_rng_state`` and ``set_rng_state`` (under both their names), once."""
    global _watching
    if _watching:
        return
    for owner in (torch, torch.random):
        for name, wrap in (("manual_seed", _counted), ("set_rng_state", _restoring), ("get_rng_state", _saving)):
            setattr(owner, name, wrap(getattr(owner, name)))
    _watching = True


def _counted(func: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(func, "__modattrs_watch__", False):
        return func

    @functools.wraps(func)
    def counted(*args: Any, **kwargs: Any) -> Any:
        global reseeds, _restored
        reseeds += 1
        _restored = None
        return func(*args, **kwargs)

    counted.__modattrs_watch__ = True  # type: ignore[attr-defined]
    return counted


def _restoring(func: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    if getattr(func, "__modattrs_watch__", False):
        return func

    @functools.wraps(func)
    def restoring(new_state: torch.Tensor) -> None:
        global reseeds, _restored
        reseeds += 1
        saved = _saved.get(new_state)  # type: ignore[no-untyped-call]
        with _disable_current_modes():
            _restored = None if saved is None else (new_state.clone(), *saved)
        func(new_state)

    restoring.__modattrs_watch__ = True  # type: ignore[attr-defined]
    return restoring


def _saving(func: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    if getattr(func, "__modattrs_watch__", False):
        return func

    @functools.wraps(func)
    def saving() -> torch.Tensor:
        state = func()
        record = last_record()
        if record is not None:
            with record.lock:
                if record.continued_by(state):
                    _saved[state] = (record, len(record.ops))
        return state

    saving.__modattrs_watch__ = True  # type: ignore[attr-defined]
    return saving


def same(state: torch.Tensor, other: torch.Tensor) -> bool:
    with _disable_current_modes():  # generator states are real tensors, also while a fake mode records
        return torch.equal(state, other)


def reset_to(state: torch.Tensor) -> torch.Tensor | tuple[Record, int]:
    """What a draw seeing the generator changed to ``state`` resets it to: that state, or a point of a record."""
    if _restored is not None and same(state, _restored[0]):
        return _restored[1], _restored[2]
    return state


def last_record() -> Record | None:
    """The record of the last deferred_init call, if it is alive."""
    return _last_record() if _last_record is not None else None


def set_last_record(record: Record) -> None:
    global _last_record
    _last_record = weakref.ref(record)
