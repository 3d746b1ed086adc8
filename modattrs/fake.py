"""Fake mode: build, move, inspect and export models whose tensors hold no data, on any device.

A fake tensor has a shape, a dtype, a device and strides, and no data: operations on fake tensors compute the
metadata of their results and nothing else. A model of any size can be built, moved and traced in fake mode on
a laptop, on the device it is meant for, including ``cuda`` on a machine that has none.

The names follow torchdistx's ``fake_mode``, ``is_fake`` and ``meta_like``; the mode underneath is PyTorch's own
``FakeTensorMode``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from modattrs import _cuda_guard
from modattrs._fake_tensors import ModattrsFakeTensorMode, SimulatedBackward, skip_data_dependent_init

__all__ = ["fake_copy", "fake_mode", "is_fake", "meta_like"]

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@contextlib.contextmanager
def fake_mode(*, fake_cuda: bool = False) -> Iterator[FakeTensorMode]:
    """Make every tensor created inside the block fake, on the device it was asked for.

    Modules built inside are complete but hold no data: initializers run without writing values (and
    ``trunc_normal_``, whose sampling depends on values, returns at once), so building even a model of hundreds
    of billions of parameters takes a moment and no memory. Fake tensors keep working after the block, each in
    the mode it was made in; modules made inside can be moved with ``.to()``, ``.half()`` and the like.

    Args:
        fake_cuda: allow ``cuda`` and ``cuda:N`` devices on a build of torch without CUDA. On such a build this
            registers torch's fake CUDA device guard in the process (compiled once, at the first use, and cached);
            ``torch.cuda.is_available()`` stays false, and real CUDA tensors still cannot be made. Backward passes
            over such tensors are simulated inside the block, since torch's autograd engine cannot run for a
            device the build lacks: every leaf reached gets a fake ``.grad`` of its own shape, dtype and device,
            and hooks and custom ``backward`` functions do not run.

    Yields:
        the ``FakeTensorMode`` in effect.

    Raises:
        RuntimeError: ``fake_cuda`` was asked for on a CPU-only build where the device guard cannot be built
            (no C++ compiler); the message names the alternatives.
    """
    mode = ModattrsFakeTensorMode(fake_cuda=fake_cuda)
    with contextlib.ExitStack() as stack:
        if fake_cuda and not _cuda_guard.cuda_built():
            _cuda_guard.require()
            stack.enter_context(SimulatedBackward())
        stack.enter_context(mode)
        stack.enter_context(skip_data_dependent_init())
        # torch.Tensor.__deepcopy__ reads data_ptr(), which warns for fake tensors: deep copies are expected here.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor", UserWarning)
        yield mode


def is_fake(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a fake tensor (a meta tensor is not)."""
    return isinstance(tensor, FakeTensor)


def meta_like(fake: Tensor) -> Tensor:
    """A meta tensor with the shape, dtype and strides of the fake tensor ``fake``.

    Raises:
        ValueError: ``fake`` is not a fake tensor.
    """
    if not is_fake(fake):
        raise ValueError(f"meta_like expects a fake tensor, got a {type(fake).__name__} on {fake.device}")
    return torch.empty_strided(fake.size(), fake.stride(), dtype=fake.dtype, device="meta")


def fake_copy(module: ModuleT, device: torch.device | str | int | None = None) -> ModuleT:
    """A fake twin of ``module``: the same structure and attributes, with fake parameters and buffers.

    No data is copied. Tied weights (one tensor reachable under several names) stay tied, parameters stay
    parameters with their ``requires_grad``, and modattrs attributes are bound to the twin.

    Args:
        module: a module on any device, the meta device included.
        device: where the twin's tensors are; by default where each of the module's tensors is. A module on the
            meta device needs one.

    Raises:
        ValueError: a tensor is on the meta device and no ``device`` was given.
    """
    target = None if device is None else torch.device(device)
    if target is not None and target.type == "cuda" and not torch.cuda.is_available():
        _cuda_guard.require()
    mode = _active_mode() or ModattrsFakeTensorMode(fake_cuda=target is not None and target.type == "cuda")
    memo: dict[int, object] = {}  # deepcopy's memo: each tensor, reached under any name, becomes one fake
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if id(tensor) not in memo:
            memo[id(tensor)] = _fake_of(mode, name, tensor, target)
    return copy.deepcopy(module, memo)


def _fake_of(mode: FakeTensorMode, name: str, tensor: Tensor, device: torch.device | None) -> Tensor:
    if device is None and tensor.is_meta:
        raise ValueError(f"fake_copy: {name!r} is on the meta device; pass device= to say where the twin is")
    meta = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    fake = FakeTensor(mode, meta, tensor.device if device is None else device)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake


def _active_mode() -> ModattrsFakeTensorMode | None:
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return mode if isinstance(mode, ModattrsFakeTensorMode) else None
