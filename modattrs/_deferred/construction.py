"""What ``deferred_init`` does around the recording: finding the real tensors handed to the constructor (which
messages name and writes into must not change), and detaching graphs made at construction."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from modattrs._torch_private import TABLE_NAMES, FakeTensor, buffers_of

__all__: list[str] = []


def handed_tensors(module_fn: Callable[..., Any], args: Any, kwargs: Any) -> list[tuple[str, Tensor]]:
    """The real tensors among ``deferred_init``'s arguments for ``module_fn``, named for messages by where they are
    (``given``, ``layers[0]``, ``backbone.weight``)."""
    try:
        signature = inspect.signature(module_fn)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to read, or arguments it refuses (the call will say so)
        named = [*((f"args[{index}]", value) for index, value in enumerate(args)), *kwargs.items()]
    else:
        named = []
        for name, value in bound.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.extend(value.items())
            else:
                named.append((name, value))
    found: list[tuple[str, Tensor]] = []
    for name, value in named:
        _find_real_tensors(name, value, found, depth=0)
    return found


def _find_real_tensors(name: str, value: object, found: list[tuple[str, Tensor]], *, depth: int) -> None:
    if isinstance(value, Tensor):
        if not isinstance(value, FakeTensor):
            found.append((name, value))
    elif isinstance(value, nn.Module):
        held = [*value.named_parameters(), *value.named_buffers()]
        found.extend((f"{name}.{key}", tensor) for key, tensor in held if not isinstance(tensor, FakeTensor))
    elif depth < 2 and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _find_real_tensors(f"{name}[{index}]", item, found, depth=depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for key, item in value.items():
            _find_real_tensors(f"{name}[{key!r}]", item, found, depth=depth + 1)


def detach_graphs(module: nn.Module) -> None:
    """Replace buffers and tensor attributes that carry an autograd graph by their detached values (recorded).

    A graph made at construction cannot be replayed (``requires_grad_`` is no operation), and it holds the tensors
    it saved, which swap_tensors would then refuse.
    """
    for submodule in module.modules():
        for name, buffer in buffers_of(submodule).items():
            if buffer is not None and buffer.grad_fn is not None:
                buffers_of(submodule)[name] = buffer.detach()
        attributes = vars(submodule)
        for name, value in list(attributes.items()):
            if name not in TABLE_NAMES:
                attributes[name] = _detached(value)


def _detached(value: Any) -> Any:
    """``value`` with every tensor carrying a graph detached, inside lists and dicts too (changed in place)."""
    if isinstance(value, Tensor):
        return value.detach() if value.grad_fn is not None else value
    if isinstance(value, list):
        value[:] = [_detached(item) for item in value]
    elif isinstance(value, dict):
        for key in list(value):
            value[key] = _detached(value[key])
    return value
