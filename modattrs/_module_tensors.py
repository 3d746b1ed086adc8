"""The tensors a module holds, walked once for everything that needs them (``fake_copy`` and deferred init), and
tensors made to take another's place."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from modattrs._torch_private import (
    HOOK_TABLE_NAMES,
    TABLE_NAMES,
    FakeTensor,
    buffers_of,
    parameters_of,
    torch_tensor_fields,
)

__all__: list[str] = []


@dataclass(frozen=True)
class HeldTensor:
    """A tensor a module holds, and where."""

    kind: str  # "parameter", "buffer" or "tensor attribute"
    path: str  # from the root of the walk: "layers.0.weight", "cache[0]", "table['cos']"
    owner: nn.Module  # the module whose parameter, buffer or attribute it is
    tensor: torch.Tensor

    @property
    def label(self) -> str:
        """How messages name it: ``parameter 'layers.0.weight' (Linear)``."""
        return f"{self.kind} {self.path!r} ({type(self.owner).__name__})"


def own_tensors(module: nn.Module, prefix: str = "", *, buffers_only: bool = False) -> Iterator[HeldTensor]:
    """A module's own parameters, buffers and tensors kept as plain attributes, also inside lists, tuples and dicts
    of them, not its submodules'; with ``buffers_only``, all but its parameters."""
    if not buffers_only:
        for name, parameter in parameters_of(module).items():
            if parameter is not None:
                yield HeldTensor("parameter", join(prefix, name), module, parameter)
    for name, buffer in buffers_of(module).items():
        if buffer is not None:
            yield HeldTensor("buffer", join(prefix, name), module, buffer)
    for name, value in vars(module).items():
        if name in _NOT_ATTRIBUTES:
            continue
        if isinstance(value, torch.Tensor):
            yield HeldTensor("tensor attribute", join(prefix, name), module, value)
            continue
        if not isinstance(value, (list, tuple, dict)) or not value:
            continue  # most attributes: flags, sizes, tables of hooks without hooks
        for path, tensor in _tensors_in(value, name, set()):
            yield HeldTensor("tensor attribute", join(prefix, path), module, tensor)


# What a module's __dict__ holds besides its plain attributes: its tables of tensors, submodules and hooks (the hooks of
# an FSDP2 unit or of a module with hooks would be looked through, one by one, for tensors they never hold).
_NOT_ATTRIBUTES = TABLE_NAMES | HOOK_TABLE_NAMES


def all_tensors(module: nn.Module) -> Iterator[HeldTensor]:
    """:func:`own_tensors` of ``module`` and of each of its submodules, each submodule once."""
    for prefix, submodule in module.named_modules():
        yield from own_tensors(submodule, prefix)


def _tensors_in(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (list, tuple, dict)) and id(value) not in seen:
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _tensors_in(item, f"{path}[{key!r}]", seen)


def join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def user_attributes(tensor: torch.Tensor) -> dict[str, object]:
    """The Python attributes a user set on ``tensor`` (a ``no_decay`` flag, say), without those torch keeps in its
    ``__dict__``: copied onto another tensor, a fake tensor's mode and device would give it the old one's."""
    internal = torch_tensor_fields()
    return {name: value for name, value in vars(tensor).items() if name not in internal}


def parameter_like(data: torch.Tensor, old: torch.Tensor) -> nn.Parameter:
    """A parameter of ``data`` that takes the place of ``old``: its ``requires_grad`` and its user attributes."""
    parameter = nn.Parameter(data, requires_grad=old.requires_grad)
    vars(parameter).update(user_attributes(old))
    return parameter


def without_data(tensor: object) -> bool:
    """Whether ``tensor`` is a tensor with a device and no data there: on the meta device, or fake."""
    return isinstance(tensor, torch.Tensor) and (tensor.is_meta or isinstance(tensor, FakeTensor))


# Note [Writes no dispatch mode sees]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# materialize_module replays deferred initialization below every dispatch mode (it steps out of the caller's modes
# on purpose: a replay computes what eager construction computed, whatever mode the caller is in), so a write
# ledger watching the caller's thread never sees the values it computes. It announces the tensors it put in place
# of fake ones, with what made them, to the listeners of its thread: a watching ledger labels their bytes. Nothing
# listens unless a ledger watches, and an announcement then costs a dictionary look-up.

#: Called with the tensors written and the operation that wrote them (its public name).
WriteListener = Callable[[Sequence[torch.Tensor], str], None]

_listeners: dict[int, list[WriteListener]] = {}  # by thread
_listeners_lock = threading.Lock()


def listen_for_writes(listener: WriteListener) -> None:
    """Have ``listener`` told of the writes this thread makes below every dispatch mode."""
    with _listeners_lock:
        _listeners.setdefault(threading.get_ident(), []).append(listener)


def stop_listening_for_writes(listener: WriteListener) -> None:
    with _listeners_lock:
        listeners = _listeners.get(threading.get_ident(), [])
        if listener in listeners:
            listeners.remove(listener)
        if not listeners:
            _listeners.pop(threading.get_ident(), None)


def announce_written(tensors: Sequence[torch.Tensor], operation: str) -> None:
    """Tell this thread's listeners that ``operation`` wrote all of ``tensors`` (see Note [Writes no dispatch mode
    sees])."""
    listeners = _listeners.get(threading.get_ident())
    for listener in list(listeners or ()):
        listener(tensors, operation)
