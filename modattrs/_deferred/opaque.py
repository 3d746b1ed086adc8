"""``register_opaque_init``'s wrappers: a call of a registered function on a deferred tensor is recorded as one
call, stored so that the function binds as it did (a staticmethod stays one, a classmethod is given its class)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from modattrs._deferred.recorder import recording_mode
from modattrs._names import callable_name
from modattrs._torch_private import FakeTensor

__all__: list[str] = []


def register(owner: object, name: str, mutates: int) -> None:
    """``register_opaque_init(owner, name, mutates=mutates)``; see its docstring in ``modattrs.deferred``."""
    func = getattr(owner, name)
    if not callable(func):
        raise TypeError(
            f"register_opaque_init: {callable_name(owner)}.{name} is a {type(func).__name__}, not a function"
        )
    if getattr(func, "__modattrs_opaque__", False):
        return
    parameters = list(_signature(owner, name, func).parameters.values())
    if not 0 <= mutates < len(parameters) or parameters[mutates].kind not in _POSITIONAL:
        raise ValueError(
            "register_opaque_init: mutates must be the index of the positional argument "
            f"{callable_name(owner)}.{name} writes into.\n"
            f"positional arguments: {[p.name for p in parameters if p.kind in _POSITIONAL]}\n"
            f"got: mutates={mutates}"
        )
    setattr(owner, name, _opaque_attribute(owner, name, func, mutates, parameters[mutates].name))


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(owner: object, name: str, func: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError) as error:  # builtins without a text signature: torch's operations, mostly
        raise TypeError(
            f"register_opaque_init: {callable_name(owner)}.{name} is a {type(func).__name__} without a signature to "
            "read.\nIt needs a Python function whose signature can be read, to find the argument it writes into.\n"
            "To record a builtin as one call, wrap it in a Python function that takes the tensor it writes into and "
            "register that.\ntorch's own operations (torch.rand, Tensor.uniform_, ...) are recorded already, one "
            "operation each, and need no registering"
        ) from error


def _opaque_attribute(owner: object, name: str, func: Callable[..., Any], mutates: int, keyword: str) -> object:
    """The wrapper of ``func``, stored so that ``owner.name`` binds as before: read from the class or from an
    instance, the wrapper is given the arguments the function was."""
    if not isinstance(owner, type):  # a module or an instance: attributes of its own do not bind
        return _opaque_wrapper(func, mutates, keyword)
    stored = next((vars(klass)[name] for klass in owner.__mro__ if name in vars(klass)), None)  # None: metaclass
    if isinstance(stored, classmethod):
        return classmethod(_opaque_classmethod(stored, mutates, keyword))
    if isinstance(stored, staticmethod) or not hasattr(type(stored), "__get__"):  # a partial, a metaclass method
        return staticmethod(_opaque_wrapper(func, mutates, keyword))  # not bound (again) when read
    if inspect.isfunction(func):  # a function, or a descriptor binding as one (functools.partialmethod)
        return _opaque_wrapper(func, mutates, keyword)
    raise TypeError(
        f"register_opaque_init: {callable_name(owner)}.{name} is a {type(stored).__name__}, a descriptor whose "
        "binding the wrapper cannot reproduce.\nIt must be a staticmethod, a classmethod or a function (or a "
        "callable object that does not bind).\nRegister a function it calls instead"
    )


def _opaque_wrapper(func: Callable[..., Any], mutates: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(func)
    def recorded_when_deferred(*args: Any, **kwargs: Any) -> Any:
        return _record_or_call(func, args, kwargs, mutates, keyword)

    recorded_when_deferred.__modattrs_opaque__ = True  # type: ignore[attr-defined]
    return recorded_when_deferred


def _opaque_classmethod(method: classmethod[Any, Any, Any], mutates: int, keyword: str) -> Callable[..., Any]:
    # Not classmethod(_opaque_wrapper(method.__func__)): ``mutates`` counts the arguments after ``cls``, and the
    # call is recorded on the method bound to the class it was called through.
    @functools.wraps(method.__func__)
    def recorded_when_deferred(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _record_or_call(method.__get__(None, cls), args, kwargs, mutates, keyword)  # bound to the class called

    recorded_when_deferred.__modattrs_opaque__ = True  # type: ignore[attr-defined]
    return recorded_when_deferred


def _record_or_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], mutates: int, keyword: str
) -> Any:
    target = args[mutates] if len(args) > mutates else kwargs.get(keyword)
    mode = recording_mode(target)
    if mode is None:
        return func(*args, **kwargs)
    assert isinstance(target, FakeTensor)
    return mode.opaque_call(func, args, kwargs, target)
