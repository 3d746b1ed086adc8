"""The fake tensor mode behind :func:`modattrs.fake.fake_mode`: torch's ``FakeTensorMode``, with a few changes.

* A deep copy of the mode is the mode itself. ``copy.deepcopy`` of a fake tensor copies the mode it belongs to,
  so layers that clone submodules (``nn.Transformer``) would otherwise spread their parameters over many modes,
  which cannot be mixed.
* Fake tensors made from fresh meta tensors are not memoized. The memo holds weak references to them, and
  ``torch.utils.swap_tensors``, which ``Module.to`` uses for fake parameters, refuses tensors that have any. For
  the same reason an operation on a fake tensor of another such mode is handed to that mode, as torch does
  outside any mode, rather than converted.
* In-place operations that only write values (random fills, ``fill_``, ``zero_``) return their input at once:
  a fake tensor has no values, and these are most of what initializing a model costs. ``detach`` and the tensor
  factories (``empty``, ``ones``, ...), the rest of it, take a short path to the same result, and fake tensors made
  there are made by copying the attributes of the first one made on the same device.
* A detached fake tensor holds no constant (the values torch keeps for small tensors made from Python numbers),
  and the tensors it shares storage with forget theirs: torch would memoize it (a weak reference again), and
  ``nn.Parameter(torch.tensor(2.0))`` could then not be moved.
* On a machine without a GPU, CUDA devices are refused until fake CUDA is set up (see ``_cuda_guard``): without
  it, some operations fail, and on a build of torch without CUDA autograd aborts the process. Devices past the
  spoofed device count are refused.
* torch's code below the mode asks torch's own ``torch.cuda`` functions whether it may make real CUDA tensors, not
  the spoofed ones (see ``_spoofed_cuda``).

The process-wide changes that fake mode needs are made by ``_torch_changes``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from modattrs import _cuda_guard, _spoofed_cuda
from modattrs._devices import as_device
from modattrs._torch_private import (
    FAKE_DEVICE_ATTRIBUTE,
    NORMALIZES_FAKE_DEVICE_APART,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorConverter,
    FakeTensorMode,
    call_as_meta,
    disable_current_modes,
    fake_tensor_attributes,
    forget_constant_aliases,
    normalize_fake_device,
    retype_converter,
    wrap_meta,
)

__all__: list[str] = []

aten = torch.ops.aten

_VALUE_ONLY_IN_PLACE = frozenset(
    {
        aten.uniform_.default,
        aten.normal_.default,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
        aten.cauchy_.default,
        aten.log_normal_.default,
        aten.geometric_.default,
        aten.fill_.Scalar,
        aten.zero_.default,
    }
)

#: Tensor factories without tensor arguments, and the torch functions that make them: made on the meta device and
#: wrapped, which is what torch's fake mode does with them after looking them up in its cache (dearer than the work).
#: The functions take the operators' arguments, and their bindings parse them faster than calling the operator.
_FACTORIES: dict[Any, Callable[..., torch.Tensor]] = {
    aten.empty.memory_format: torch.empty,
    aten.empty_strided.default: torch.empty_strided,
    aten.ones.default: torch.ones,
    aten.zeros.default: torch.zeros,
    aten.full.default: torch.full,
}


class _Converter(FakeTensorConverter):
    def from_meta_and_device(
        self,
        fake_mode: FakeTensorMode,
        t: torch.Tensor,
        device: torch.device,
        pytype: type[torch.Tensor] | None = None,
        dispatch_keys: torch.DispatchKeySet | None = None,
    ) -> FakeTensor:
        # `t` is a fresh meta tensor (torch's own comment says so), so there is nothing to look up. torch before 2.7
        # passes neither `pytype` nor `dispatch_keys`, and its FakeTensor takes neither.
        if pytype is None and dispatch_keys is None:
            return FakeTensor(fake_mode, t, device)
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class ModattrsFakeTensorMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """``FakeTensorMode(allow_non_fake_inputs=True)`` with the changes listed in this module's docstring."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        retype_converter(self, _Converter)
        # By normalized device: the attributes of the first fake tensor made there, or None when torch set one that
        # is not None (a later torch); see _wrap.
        self._fake_attributes: dict[torch.device, dict[str, Any] | None] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> ModattrsFakeTensorMode:
        return self

    @property
    def avoid_device_init(self) -> bool:
        # torch asks torch.cuda.is_available() whether it may make real tensors on the device (constants of
        # torch.tensor(...)); inside a spoofed block that answers for the spoofed GPU, so the real answer is asked.
        with _spoofed_cuda.truthful():
            return bool(super().avoid_device_init)

    def opaque_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], target: FakeTensor
    ) -> FakeTensor:
        """``func(*args, **kwargs)``, an initializer that writes ``target`` in place and reads what it draws
        (``trunc_normal_``), called on a fake tensor of this mode: there are no values to write, so nothing runs."""
        return target

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        spoofing = _spoofed_cuda.state
        if not spoofing.stack or spoofing.truthful:
            return self._dispatch(func, types, args, kwargs)
        # Below the dispatcher is torch's code, which asks torch.cuda.is_available() whether it may make real CUDA
        # tensors (torch 2.8 does, for every new fake CUDA tensor; 2.13 does not): it gets torch's own answers.
        # (_spoofed_cuda.truthful(), inlined: a generator context manager here cost a tenth of a fake build.)
        spoofing.truthful = True
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            spoofing.truthful = False

    def _dispatch(self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> Any:
        first = args[0] if args else None
        if type(first) is FakeTensor and first.fake_mode is not self and isinstance(first.fake_mode, type(self)):
            with first.fake_mode:  # another mode's tensor: its own mode runs the operation
                return func(*args, **(kwargs or {}))
        if func in _VALUE_ONLY_IN_PLACE and _plain_fake(first, self):
            return first
        kwargs = kwargs or {}
        check_device(kwargs.get("device"))
        if func is aten.detach.default and type(first) is FakeTensor and first.fake_mode is self:
            if first.constant is not None:
                _forget_constant(self, first)
            return self._wrap(call_as_meta(self, func, *args), first.device)
        factory = _FACTORIES.get(func)
        if factory is not None and kwargs.get("layout") in (None, torch.strided):
            device = torch.device(kwargs.get("device") or "cpu")
            return self._wrap(factory(*args, **{**kwargs, "device": "meta", "pin_memory": False}), device)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _wrap(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self, meta, device)`` for a fresh meta tensor, made faster.

        torch's constructor checks its arguments, normalizes the device twice and sets twenty attributes through
        descriptors: a third of the time a model takes to build in fake mode. Past the first fake tensor on a
        device, this makes the tensor as that constructor does and copies the first one's attributes, all None but
        the device (see ``_torch_private.wrap_meta``). While exporting, in torch's fake tensor debug mode, or if torch
        sets an attribute to anything else, it calls the constructor, and always on a torch whose constructor
        normalizes the device inline (2.8).
        """
        if not NORMALIZES_FAKE_DEVICE_APART:
            return FakeTensor(self, meta, device)
        device = _normalized(device)
        attributes = self._fake_attributes.get(device)
        if attributes is None or FakeTensorConfig.debug or torch.compiler.is_exporting():
            fake = FakeTensor(self, meta, device)
            if device not in self._fake_attributes:
                state = fake_tensor_attributes(fake)
                plain = all(value is None for name, value in state.items() if name != FAKE_DEVICE_ATTRIBUTE)
                self._fake_attributes[device] = state if plain and state.get(FAKE_DEVICE_ATTRIBUTE) == device else None
            return fake
        return wrap_meta(self, meta, device, attributes)


#: Devices and what torch's fake device normalization makes of them, where that cannot change.
_NORMALIZED: dict[torch.device, torch.device] = {}


def _normalized(device: torch.device) -> torch.device:
    """``normalize_fake_device(device)``, remembered where its answer cannot change: a device with an
    index (``cuda:1`` stays ``cuda:1``; the GPU context it initializes stays initialized), a CPU or meta device, and
    ``cuda`` on a build without CUDA, which is ``cuda:0`` for good."""
    known = _NORMALIZED.get(device)
    if known is not None:
        return known
    normalized = normalize_fake_device(device)
    if (
        device.index is not None
        or device.type in ("cpu", "meta")
        or (device.type == "cuda" and not _cuda_guard.cuda_built())
    ):
        _NORMALIZED[device] = normalized
    return normalized


def parameter_like(data: torch.Tensor, old: torch.Tensor) -> nn.Parameter:
    """A parameter of ``data`` that takes the place of ``old``: its ``requires_grad``, and the Python attributes a
    user set on it (a ``no_decay`` flag, say).

    Not the rest of its ``__dict__``: a fake tensor keeps its mode, its device and more there, and a parameter made
    of one a flag; copied onto another tensor they would give it the old one's device and mode.
    """
    parameter = nn.Parameter(data, requires_grad=old.requires_grad)
    internal = _torch_fields()
    vars(parameter).update((name, value) for name, value in vars(old).items() if name not in internal)
    return parameter


@functools.cache
def _torch_fields() -> frozenset[str]:
    """The names torch keeps in the ``__dict__`` of a fake tensor and of a parameter made of one."""
    with disable_current_modes():
        fake = FakeTensor(FakeTensorMode(), torch.empty(1, device="meta"), torch.device("cpu"))
        parameter = nn.Parameter(fake)
    return frozenset(vars(fake)) | frozenset(vars(parameter))


def check_device(device: object) -> None:
    """Refuse CUDA devices that cannot be faked: any, until fake CUDA is set up on a machine without a GPU, and
    those past the spoofed device count."""
    if device is None:
        return
    limit = _spoofed_cuda.device_limit()
    key = (type(device), device, limit)  # the type too: True == 1, and as_device refuses a bool
    try:
        if key in _ACCEPTED:  # every factory call with a device= comes here
            return
    except TypeError:  # not hashable: as_device says what is wrong with it
        pass
    device = as_device(device, "fake tensor")
    if device.type == "cuda":
        _check_cuda(device, limit)
    _ACCEPTED.add(key)  # what fake CUDA's setup and the count allow stays allowed: neither can be undone


#: (type, device argument, spoofed device count) that check_device accepted.
_ACCEPTED: set[tuple[type, object, int]] = set()


def _check_cuda(device: torch.device, limit: int) -> None:
    if not _cuda_guard.ready():
        raise RuntimeError(
            f"fake tensors on {device} need modattrs.fake.fake_mode(fake_cuda=True) (or fake_copy to a CUDA device) "
            "first, on this machine, which has no GPU"
        )
    if device.index is not None and not 0 <= device.index < limit and not _cuda_guard.gpu_present():
        if device.index < 0:  # torch.device(200), for one: the index is 8 bits
            raise ValueError(
                f"{device}: not a CUDA device (torch wraps a device index past 127 around to a negative one); use "
                f"cuda:0 to cuda:{limit - 1}"
            )
        if limit == _spoofed_cuda.MAX_DEVICES:
            raise ValueError(f"{device}: torch's fake CUDA device guard knows cuda:0 to cuda:{limit - 1} only")
        raise ValueError(
            f"{device}: this fake_mode spoofs {limit} CUDA devices, cuda:0 to cuda:{limit - 1}; ask for more with "
            f"fake_mode(fake_cuda=True, device_count=N), up to {_spoofed_cuda.MAX_DEVICES}"
        )


def _forget_constant(mode: FakeTensorMode, tensor: FakeTensor) -> None:
    """Make ``tensor`` and every fake sharing its constant's storage forget their values.

    Detaching a constant (``nn.Parameter(torch.tensor(2.6592))``, CLIP's ``logit_scale``) takes torch's path
    otherwise, which memoizes the result with a weak reference, and ``Module.to`` swaps fake parameters with
    ``torch.utils.swap_tensors``, which refuses tensors that have one. The detached tensor is made without its
    constant; the tensors it aliases forget theirs, which a write through it would leave stale.
    """
    forget_constant_aliases(mode, tensor)


def _plain_fake(tensor: object, mode: FakeTensorMode) -> bool:
    # The short paths are for ordinary fakes of this mode: fakes holding a constant (small tensors made from Python
    # values) take torch's path, which keeps the constant right.
    return type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None
