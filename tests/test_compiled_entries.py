"""The C entries of ``modattrs/_speedups.c``: the dispatch entry that fake mode, deferred init's recording mode and
the write ledger's mode enter through (Note [A dispatch entry dynamo cannot see] in ``modattrs/_compiled.py``), and
the filter in front of the torch function mode that makes int devices CUDA devices, choose as the Python they
stand in front of would.

Both only choose a path; what the paths do is tested with the features (``test_fake.py``, ``test_spoofed_cuda.py``,
``test_deferred.py``, ``test_ledger.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from modattrs._compiled import speedups
from modattrs._deferred.recorder import RecordingFakeTensorMode
from modattrs._fake.mode import ModattrsFakeTensorMode
from modattrs._fake.spoofed_cuda import IntDevicesAreCuda
from modattrs._ledger.tracking import LedgerMode
from modattrs.deferred import deferred_init, is_deferred, materialize_module
from modattrs.fake import fake_mode, is_fake
from modattrs.ledger import watch

pytestmark = pytest.mark.skipif(speedups is None, reason="modattrs._speedups is not built in this install")


def recorder(name: str, calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> Callable[..., str]:
    def call(*args: Any, **kwargs: Any) -> str:
        calls.append((name, args, kwargs))
        return name

    return call


@pytest.mark.parametrize(("hook", "expected"), [(None, "raw"), (object(), "wrapped"), (False, "wrapped")])
def test_the_dispatch_entry_calls_the_method_as_written_only_while_no_dynamo_frame_hook_is_set(
    hook: object, expected: str
) -> None:
    assert speedups is not None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    result = speedups.dispatch_unless_compiling(
        lambda: hook, recorder("raw", calls), recorder("wrapped", calls), "mode", "func", key="value"
    )
    assert result == expected
    assert calls == [(expected, ("mode", "func"), {"key": "value"})]


def test_the_dispatch_entry_passes_on_an_error_of_the_hook_and_calls_neither_method() -> None:
    assert speedups is not None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def broken_hook() -> object:
        raise LookupError("no hook")

    with pytest.raises(LookupError, match="no hook"):
        speedups.dispatch_unless_compiling(broken_hook, recorder("raw", calls), recorder("wrapped", calls))
    assert calls == []


def fake_mode_works() -> None:
    with fake_mode():
        assert is_fake(torch.ones(2) + 1)


def recording_works() -> None:
    deferred = deferred_init(torch.nn.Linear, 2, 2)
    assert is_deferred(deferred)
    assert not is_deferred(materialize_module(deferred))


def ledger_works() -> None:
    layer = torch.nn.Linear(2, 2, device="meta")
    with watch() as ledger:
        layer.to_empty(device="cpu")
        torch.nn.init.zeros_(layer.weight)
    assert [entry.status for entry in ledger.report(layer)] == ["initialized", "unwritten"]


@pytest.mark.parametrize(
    ("mode", "works"),
    [(ModattrsFakeTensorMode, fake_mode_works), (RecordingFakeTensorMode, recording_works), (LedgerMode, ledger_works)],
    ids=["fake", "recording", "ledger"],
)
def test_each_dispatch_mode_goes_through_torchs_dynamo_wrapper_exactly_when_torch_wraps_it(
    mode: type[torch.utils._python_dispatch.TorchDispatchMode], works: Callable[[], None]
) -> None:
    entry = vars(mode)["__torch_dispatch__"]
    # torch 2.13 and 2.15 wrap every dispatch mode subclass's method in a dynamo "disable"; 2.8 does not.
    torch_wraps = hasattr(torch.utils._python_dispatch.TorchDispatchMode, "_should_skip_dynamo")
    assert (type(entry).__name__ == "instancemethod") == torch_wraps
    works()


def same_position(mode: IntDevicesAreCuda, func: object, stand_in: object) -> None:
    """Give ``stand_in`` the device argument position the mode reads for ``func``."""
    position = mode._positions.get(func)
    if position is not None:
        mode._positions[stand_in] = position


def python_rewrites(
    mode: IntDevicesAreCuda, func: object, args: tuple[Any, ...], kwargs: dict[str, Any] | None
) -> bool:
    """Whether the Python method gives the call other arguments: what the C filter must send to it."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def spy(*given: Any, **given_kwargs: Any) -> None:
        seen.append((given, given_kwargs))

    same_position(mode, func, spy)
    python_method = vars(IntDevicesAreCuda)["__torch_function__"].__func__.args[0]
    python_method(mode, spy, (), args, kwargs)
    return seen != [(args, kwargs or {})]


DEVICE_VALUES: list[object] = [
    0, 3, -1, True, False, None, "cuda", "cuda:1", torch.device("cuda", 0), torch.device("cpu"), np.int64(2),
    torch.tensor(1), 2.0,
]  # fmt: skip


@pytest.mark.parametrize("value", DEVICE_VALUES, ids=repr)
@pytest.mark.parametrize("where", ["keyword", "position 1 of Tensor.to", "position 1 elsewhere"])
def test_the_int_device_filter_hands_the_python_method_every_call_that_method_would_rewrite(
    value: object, where: str
) -> None:
    assert speedups is not None
    mode = IntDevicesAreCuda()
    func: Any = torch.Tensor.to if where == "position 1 of Tensor.to" else torch.ones
    args: tuple[Any, ...] = (1,) if where == "keyword" else (torch.zeros(1), value)
    kwargs = {"device": value} if where == "keyword" else None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    forward, python = recorder("forward", calls), recorder("python", calls)
    same_position(mode, func, forward)

    chosen = speedups.forward_unless_index(python, mode, forward, (), args, kwargs)

    if python_rewrites(mode, func, args, kwargs):
        assert chosen == "python"  # the filter may send more calls to Python, never fewer
    if chosen == "forward":
        assert calls == [("forward", args, kwargs or {})]
    else:
        assert calls == [("python", (mode, forward, (), args, kwargs), {})]


def test_the_int_device_filter_forwards_calls_without_keywords_as_torch_passes_them() -> None:
    assert speedups is not None
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
    chosen = speedups.forward_unless_index(
        recorder("python", calls), IntDevicesAreCuda(), recorder("forward", calls), (), (1, 2)
    )
    assert chosen == "forward"
    assert calls == [("forward", (1, 2), {})]
