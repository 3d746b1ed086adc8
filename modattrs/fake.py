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
from collections.abc import Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn

from modattrs import _torch_changes
from modattrs._devices import as_device
from modattrs._fake import spoofed_cuda
from modattrs._fake.mode import FakeShapeError, FakeValueError, ModattrsFakeTensorMode, check_device
from modattrs._fake.spoofed_cuda import A100, GPU, H100, DeviceProperties
from modattrs._module_tensors import all_tensors, parameter_like
from modattrs._torch_private import (
    FakeTensor,
    FakeTensorMode,
    active_fake_mode,
    forget_real_tensors,
    unset_fake_temporarily,
)

__all__ = [
    "A100", "GPU", "H100", "DeviceProperties", "FakeShapeError", "FakeValueError", "fake_copy", "fake_mode", "is_fake",
    "meta_like",
]  # fmt: skip

ModuleT = TypeVar("ModuleT", bound=nn.Module)


@contextlib.contextmanager
def fake_mode(
    *, fake_cuda: bool = False, gpu: GPU | None = None, device_count: int | None = None
) -> Iterator[FakeTensorMode]:
    """Make every tensor created inside the block fake, on the device it was asked for.

    Modules built inside are complete but hold no data: initializers run without writing values (and
    ``trunc_normal_``, whose sampling depends on values, returns at once), so building even a model of hundreds
    of billions of parameters takes a moment and no memory. Fake tensors keep working after the block, each in
    the mode it was made in; modules made inside can be moved with ``.to()``, ``.half()`` and the like, inside
    any fake mode or outside.

    Args:
        fake_cuda: allow ``cuda`` and ``cuda:0`` to ``cuda:7`` on a machine without a GPU, whatever the build of
            torch. On a CPU-only build this registers torch's fake CUDA device guard in the process (compiled
            once, at the first use, and cached); real CUDA tensors still cannot be made. Backward passes over such
            tensors are simulated, since torch's autograd engine cannot run for a GPU the machine lacks: every
            leaf reached gets a fake ``.grad`` of its own shape, dtype and device, and hooks and custom
            ``backward`` functions do not run. From then on, fake CUDA tensors work in any fake mode of the
            process. Inside the block, in its thread only, ``torch.cuda.is_available()``, ``device_count()``,
            ``current_device()``, ``get_device_name()``, ``get_device_capability()`` and
            ``get_device_properties()`` answer as ``device_count`` of ``gpu``, ``set_device()`` and
            ``torch.cuda.device()`` accept the current device (``cuda:0``, always) and refuse others, and an int
            given as a device (``.cuda(1)``, ``device=1``) is that CUDA device, on any build.
        gpu: the GPU that spoofed CUDA describes: :data:`H100` (the default, 80 GB), :data:`A100`, or a
            :class:`GPU` of your own. Needs ``fake_cuda=True``.
        device_count: how many spoofed GPUs there are, 1 to 8 (default 8): ``cuda:0`` to
            ``cuda:<device_count - 1>`` can be used inside the block. Needs ``fake_cuda=True``.

    Yields:
        the ``FakeTensorMode`` in effect.

    Raises:
        RuntimeError: ``fake_cuda`` was asked for on a CPU-only build where the device guard cannot be built
            (no C++ compiler); the message names the alternatives.
        ValueError: ``gpu`` or ``device_count`` without ``fake_cuda=True``, or a device count out of range.
    """
    if not fake_cuda and (gpu is not None or device_count is not None):
        raise ValueError(
            "fake_mode: gpu= and device_count= choose the GPU that spoofed CUDA describes; pass fake_cuda=True too"
        )
    spoof = spoofed_cuda.check(
        H100 if gpu is None else gpu, spoofed_cuda.MAX_DEVICES if device_count is None else device_count
    )
    if fake_cuda:
        _torch_changes.install_fake_cuda()
    else:
        _torch_changes.install()
    mode = ModattrsFakeTensorMode()
    try:
        with mode, spoofed_cuda.spoofing(spoof) if fake_cuda else contextlib.nullcontext():
            yield mode
    finally:
        forget_real_tensors(mode)


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

    No data is copied: parameters, buffers and tensors kept as plain attributes of the modules become fake. Tied
    weights (one tensor reachable under several names) stay tied, parameters stay parameters with their
    ``requires_grad`` and their Python attributes, and modattrs attributes are bound to the twin. Tensors kept
    inside lists, tuples and dicts of plain attributes become fake too. Tensors that are views of one another
    become independent fakes.

    Args:
        module: a module on any device, the meta device included.
        device: where the twin's tensors are; by default where each of the module's tensors is. A module on the
            meta device needs one.

    Raises:
        ValueError: a tensor is on the meta device and no ``device`` was given.
    """
    target = None if device is None else as_device(device, "fake_copy")
    if target is not None and target.type == "cuda":
        _torch_changes.install_fake_cuda()
        check_device(target)
    else:
        _torch_changes.install()
    mode = _active_mode() or ModattrsFakeTensorMode()
    memo: dict[int, object] = {}  # deepcopy's memo: each tensor, reached under any name, becomes one fake
    for held in all_tensors(module):
        if id(held.tensor) not in memo:
            memo[id(held.tensor)] = _fake_of(mode, held.path, held.tensor, target)
    return copy.deepcopy(module, memo)


def _fake_of(mode: FakeTensorMode, name: str, tensor: Tensor, device: torch.device | None) -> Tensor:
    if device is None and tensor.is_meta:
        raise ValueError(f"fake_copy: {name!r} is on the meta device; pass device= to say where the twin is")
    with unset_fake_temporarily():  # inside a fake mode, torch 2.8 would make this meta tensor a fake already
        meta = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")
    fake = FakeTensor(mode, meta, tensor.device if device is None else device)
    if isinstance(tensor, nn.Parameter):
        return parameter_like(fake, tensor)
    return fake


def _active_mode() -> ModattrsFakeTensorMode | None:
    mode = active_fake_mode()
    return mode if isinstance(mode, ModattrsFakeTensorMode) else None


# Names defined in the engine say where users import them: in tracebacks, reprs, pickles and the docs.
for _public in (GPU, DeviceProperties, FakeValueError, FakeShapeError):
    _public.__module__ = __name__
