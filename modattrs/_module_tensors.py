"""The tensors a module holds, walked once for everything that needs them: ``fake_copy`` and deferred init."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from modattrs._torch_private import TABLE_NAMES, buffers_of, parameters_of

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
                yield HeldTensor("parameter", _join(prefix, name), module, parameter)
    for name, buffer in buffers_of(module).items():
        if buffer is not None:
            yield HeldTensor("buffer", _join(prefix, name), module, buffer)
    for name, value in vars(module).items():
        if name in TABLE_NAMES:
            continue
        for path, tensor in _tensors_in(value, name, set()):
            yield HeldTensor("tensor attribute", _join(prefix, path), module, tensor)


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


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
