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
  factories (``empty``, ``ones``, ``arange``, ...), the rest of it, take a short path to the same result, and fake
  tensors made there are made by copying the attributes of the first one made on the same device. The shapes of what
  factories without tensor arguments make are remembered by their arguments (the meta kernel of ``arange`` is
  Python).
* A detached fake tensor holds no constant (the values torch keeps for small tensors made from Python numbers),
  and the tensors it shares storage with forget theirs: torch would memoize it (a weak reference again), and
  ``nn.Parameter(torch.tensor(2.0))`` could then not be moved.
* Construction-time constants: a fake tensor made from Python numbers and other constants by operations that draw
  no random numbers keeps its values (``FakeTensor.constant``, always a plain CPU tensor, whatever device the fake
  is on), so ``.item()``, ``.tolist()``, ``if``, ``unique`` and ``nonzero`` on it work as in eager code. A
  pointwise operation on contiguous constants runs on the values only, its fake made from the result. See
  "Construction-time constants" below.
* On a machine without a GPU, CUDA devices are refused until fake CUDA is set up (see ``_fake.cuda_guard``): without
  it, some operations fail, and on a build of torch without CUDA autograd aborts the process. Devices past the
  spoofed device count are refused.
* torch's code below the mode asks torch's own ``torch.cuda`` functions whether it may make real CUDA tensors, not
  the spoofed ones (see ``_fake.spoofed_cuda``).

The process-wide changes that fake mode needs are made by ``_torch_changes``.
"""

from __future__ import annotations

import copy
import functools
import math
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn, SupportsIndex

import torch

from modattrs._compiled import install_dispatch_entry
from modattrs._devices import as_device
from modattrs._fake import cuda_guard, spoofed_cuda
from modattrs._names import where
from modattrs._torch_private import (
    FAKE_DEVICE_ATTRIBUTE,
    TO_COPY,
    DataDependentOutputException,
    DisableTorchDispatch,
    DisableTorchFunction,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorConverter,
    FakeTensorMode,
    OpOverload,
    address_of,
    alias_fake,
    call_as_meta,
    clear_cached_data,
    contiguous_strides,
    fake_tensor_attributes,
    forget_constant_aliases,
    has_constant_aliases,
    in_kernel,
    meta_alias,
    normalize_fake_device,
    note_constant_alias,
    operator_arguments,
    overloads_of,
    returns_aliases,
    retype_converter,
    unlist_constant_alias,
    wrap_meta,
    written_arguments,
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
#: On the meta device ``ones`` and ``zeros`` of these dtypes (None: the default one, always floating) are ``empty``:
#: torch's meta kernels for them are Python, an ``empty`` and a ``fill_`` that checks nothing for them.
_EMPTY_ON_META = frozenset({id(aten.ones.default), id(aten.zeros.default)})
_FILLED_ON_META = frozenset(
    {
        None, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    }
)  # fmt: skip


def _meta_factory(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor:
    """What a tensor factory of ``_FACTORIES`` makes on the meta device."""
    factory = _FACTORIES[func]
    if id(func) in _EMPTY_ON_META and kwargs.get("dtype") in _FILLED_ON_META:
        factory = torch.empty
    return factory(*args, **{**kwargs, "device": _META, "pin_memory": False})


#: The most elements a constant made by an operation may have (a view of a constant has no bound: it adds no memory).
CONSTANT_LIMIT = 4096

_CPU = torch.device("cpu")

#: Factories whose values are given by Python numbers, or by the metadata of their tensor arguments (the
#: ``*_like``/``new_*`` ones), or by the values of constants (``linspace`` and ``logspace`` from tensor ends): their
#: results are constants when small. Not those writing an ``out=`` argument.
_CONSTANT_FACTORIES = frozenset(
    op
    for op in overloads_of(
        aten.arange, aten.linspace, aten.logspace, aten.eye, aten.scalar_tensor, aten.tril_indices,
        aten.triu_indices, aten.hann_window, aten.hamming_window, aten.bartlett_window, aten.blackman_window,
        aten.kaiser_window, aten.fft_fftfreq, aten.fft_rfftfreq, aten.zeros_like, aten.ones_like, aten.full_like,
        aten.new_zeros, aten.new_ones, aten.new_full,
    )
    if not written_arguments(op)
)  # fmt: skip
#: The constant factories that read only the metadata of their tensor arguments.
_READING_METADATA = frozenset(
    id(op)
    for op in overloads_of(
        aten.zeros_like, aten.ones_like, aten.full_like, aten.new_zeros, aten.new_ones, aten.new_full
    )
    if op in _CONSTANT_FACTORIES
)
#: modattrs' own factory short path that also makes constants.
_VALUED_FACTORIES = frozenset({aten.ones.default, aten.zeros.default, aten.full.default})
#: Results that hold whatever memory held, and operations that give a tensor other memory: never constants.
_UNINITIALIZED = overloads_of(
    aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.empty_permuted,
    aten.resize_, aten.resize_as_, aten.set_,
)  # fmt: skip

_VALUE_ONLY, _DETACH, _META_FACTORY, _VALUED_FACTORY, _CONSTANT_FACTORY, _LIFT, _DEVICE, _TO_COPY, _VIEW, _COPY = range(
    1, 11
)
#: View operations whose results, on the meta device, are all that torch's fake kernel makes of them: new geometry
#: on the argument's storage, same device. FSDP2 and DTensor cut every parameter with them (a split into as many
#: chunks as ranks, two per parameter), and torch's path (a cache look-up, then a tensor made and moved onto the
#: argument's storage) cost a fake model's fully_shard 20 times the meta model's.
_VIEWS = frozenset(
    op
    for op in overloads_of(
        aten.view, aten.as_strided, aten.slice, aten.narrow, aten.split, aten.split_with_sizes, aten.unbind,
        aten.t, aten.transpose, aten.permute, aten.expand, aten.unsqueeze, aten.squeeze, aten.select, aten.alias,
        aten.unflatten, aten.diagonal, aten.unfold,
    )
    if op.is_view
)  # fmt: skip
#: Operations that make a fresh tensor on the device of their first argument from its metadata and their sizes
#: (``new_zeros``, FSDP2's padded shard; ``clone``, DTensor's local chunk), run on the meta tensor it is and wrapped:
#: what torch's fake kernels make of them, without the cache look-up. Constants are given after, as before.
_LIKE_FIRST = frozenset(
    id(op)
    for op in overloads_of(
        aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty, aten.new_empty_strided, aten.clone
    )
    if not written_arguments(op)
)  # fmt: skip
#: The ``_LIKE_FIRST`` operations whose result is a fresh contiguous tensor of the sizes given, in the dtype given or
#: their tensor's (``_new_contiguous``).
_NEW_CONTIGUOUS = frozenset(
    id(op) for op in overloads_of(aten.new_zeros, aten.new_ones, aten.new_full, aten.new_empty) if id(op) in _LIKE_FIRST
)
#: The arguments of ``_to_copy`` that its short path takes (all but ``pin_memory=True`` and other layouts).
_TO_COPY_ARGUMENTS = frozenset({"dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format"})
_META = torch.device("meta")
#: Which of modattrs' paths an operation takes.
_ROUTES: dict[Any, int] = {
    **dict.fromkeys(_CONSTANT_FACTORIES, _CONSTANT_FACTORY),
    **dict.fromkeys(_VALUE_ONLY_IN_PLACE, _VALUE_ONLY),
    **dict.fromkeys(_FACTORIES, _META_FACTORY),
    **dict.fromkeys(_VALUED_FACTORIES, _VALUED_FACTORY),
    aten.detach.default: _DETACH,
    TO_COPY: _TO_COPY,
    torch.ops.prim.device.default: _DEVICE,
    aten.lift_fresh.default: _LIFT,
    aten.lift_fresh_copy.default: _LIFT,
    **dict.fromkeys(_VIEWS, _VIEW),
    aten.copy_.default: _COPY,
}
#: The same by the operator's id, found with one look-up per operation: an OpOverload hashes in Python, three times
#: dearer. The operators are kept alive by ``_ROUTES``, so no other object has their ids.
_ROUTE: dict[int, int] = {id(op): route for op, route in _ROUTES.items()}


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

    #: How to get values for this mode's tensors, for the message refusing to save them.
    values_from = "build the model outside fake mode (or with modattrs.deferred.deferred_init, then materialize it)"

    def __deepcopy__(self, memo: dict[int, Any]) -> ModattrsFakeTensorMode:
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # Pickled as part of a fake tensor's __dict__ (torch.save of a fake state_dict): its weak dictionaries made
        # pickle fail naming none of it. See Note [Saving fake tensors].
        raise _unsaveable(self)

    @property
    def avoid_device_init(self) -> bool:
        # torch asks torch.cuda.is_available() whether it may make real tensors on the device (constants of
        # torch.tensor(...)); inside a spoofed block that answers for the spoofed GPU, so the real answer is asked.
        with spoofed_cuda.truthful():
            return bool(super().avoid_device_init)

    def opaque_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], target: FakeTensor
    ) -> FakeTensor:
        """``func(*args, **kwargs)``, an initializer that writes ``target`` in place and reads what it draws
        (``trunc_normal_``), called on a fake tensor of this mode: there are no values to write, so nothing runs.
        A constant it writes forgets its values, and so do the tensors sharing its memory, as after any other write
        that is no constant's (it draws: eager code would have other values there)."""
        if target.constant is not None:
            _forget(self, target)
        return target

    def moving_to_cuda(self, func: Callable[..., Any]) -> None:
        """``func`` (``Tensor.to``, ``Tensor.cuda``) is moving a fake tensor of this mode to CUDA, on a machine
        without a GPU where fake CUDA is not set up: raise what the mode raises for CUDA then (torch's binding would
        fail with a bare "Torch not compiled with CUDA enabled" first)."""
        _check_cuda(torch.device("cuda"), spoofed_cuda.device_limit())

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        # Entered through _dispatch_entry where the C extension is built (see Note [A dispatch entry dynamo cannot
        # see], below the class).
        # Most of a build first, on paths that run no torch code asking about CUDA (see below): random fills of
        # weights, parameters made (detach), tensors made (empty, ones), each as _dispatch would.
        route = _ROUTE.get(id(func))
        if (route is _VALUE_ONLY or route is _DETACH) and args:
            first = args[0]
            if type(first) is FakeTensor and first.fake_mode is self:
                if route is _VALUE_ONLY:
                    if first.constant is None:
                        return first
                else:
                    device = first.device
                    attributes = self._attributes(device)
                    if attributes is not None:
                        if first.constant is not None:
                            _forget_constant(self, first)
                        return alias_fake(self, first, device, attributes)
        elif route is _VIEW and args:
            first = args[0]
            if type(first) is FakeTensor and first.fake_mode is self and first.constant is None:
                viewed = self._view(func, first, args, kwargs)
                if viewed is not None:
                    return viewed
        elif route is _COPY and self._plain_copy(args, kwargs):
            return args[0]  # values only: the target's metadata stays, as copy_ leaves it
        elif (route is _META_FACTORY or route is _VALUED_FACTORY) and kwargs:
            asked = kwargs.get("device")
            if type(asked) is torch.device and kwargs.get("layout") in (None, torch.strided):
                normalized = _NORMALIZED.get(asked)
                attributes = None if normalized is None else self._attributes(normalized)
                if normalized is not None and attributes is not None:
                    check_device(asked)
                    fake = wrap_meta(self, _meta_factory(func, args, kwargs), normalized, attributes)
                    if route is _VALUED_FACTORY and asked.type != "meta":
                        _give_values(fake, func, args, kwargs)
                    return fake
        spoofing = spoofed_cuda.state
        if not spoofing.stack or spoofing.truthful:
            return self._dispatch(func, types, args, kwargs, route)
        # Below the dispatcher is torch's code, which asks torch.cuda.is_available() whether it may make real CUDA
        # tensors (torch 2.8 does, for every new fake CUDA tensor; 2.13 does not): it gets torch's own answers.
        # (spoofed_cuda.truthful(), inlined: a generator context manager here cost a tenth of a fake build.)
        spoofing.truthful = True
        try:
            return self._dispatch(func, types, args, kwargs, route)
        finally:
            spoofing.truthful = False

    def _dispatch(
        self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Mapping[str, Any] | None, route: Any
    ) -> Any:
        first = args[0] if args else None
        if type(first) is FakeTensor and first.fake_mode is not self and isinstance(first.fake_mode, type(self)):
            with first.fake_mode:  # another mode's tensor: its own mode runs the operation
                return func(*args, **(kwargs or {}))
        if route is _VALUE_ONLY and _plain_fake(first, self):
            return first
        if route is _CONSTANT_FACTORY:
            return _factory(self, func, types, args, kwargs or {})
        if route is _LIFT:
            lifted = _lift(self, args)
            if lifted is not None:
                return lifted
        elif route is None or route is _VALUE_ONLY or route is _TO_COPY or route is _VIEW or route is _COPY:
            constants, unknown = _scan(self, args, kwargs)
            if constants:  # off the hot path: most operations meet no constant
                kwargs = kwargs or {}
                if unknown or not isinstance(func, OpOverload) or func in _UNINITIALIZED or _random(func):
                    return _run_forgetting(self, func, types, args, kwargs, constants)
                return _run_both(self, func, types, args, kwargs, constants)
        return self._fake_only(func, types, args, kwargs, route)

    def _fake_only(
        self, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Mapping[str, Any] | None, route: Any
    ) -> Any:
        """The operation on fake tensors, constants hidden or absent: modattrs' short paths, else torch's."""
        first = args[0] if args else None
        if route is _VALUE_ONLY and _plain_fake(first, self):
            return first
        kwargs = kwargs or {}
        check_device(kwargs.get("device"))
        if id(func) in _LIKE_FIRST and self._like_first(first, args, kwargs):
            assert isinstance(first, FakeTensor)
            made = {name: value for name, value in kwargs.items() if name != "device"}  # its own: meta below
            if id(func) in _NEW_CONTIGUOUS:  # torch's meta kernels for these are Python (refs), a tenth of a shard
                meta = _new_contiguous(first, args[1], made.get("dtype"))
            else:
                meta = call_as_meta(self, func, meta_alias(first), *args[1:], **made)
            return self._wrap(meta, first.device)
        # A constant's view or copy, its constant hidden (_run_both, _run_forgetting): the fake part as the short
        # paths of __torch_dispatch__ make it for a fake without one, and the values after, from the real run.
        if route is _VIEW and _plain_fake(first, self):
            assert isinstance(first, FakeTensor)
            viewed = self._view(func, first, args, kwargs)
            if viewed is not None:
                return viewed
        if route is _COPY and self._plain_copy(args, kwargs):
            return first
        if route is _DETACH and type(first) is FakeTensor and first.fake_mode is self:
            if first.constant is not None:
                _forget_constant(self, first)
            attributes = self._attributes(first.device)
            if attributes is None:
                return self._wrap(call_as_meta(self, func, first), first.device)
            return alias_fake(self, first, first.device, attributes)
        if (
            route is _TO_COPY
            and len(args) == 1
            and type(first) is FakeTensor
            and first.fake_mode is self
            and _TO_COPY_ARGUMENTS.issuperset(kwargs)
            and kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory")
        ):  # .to(device, dtype) of a fake: what torch's fake kernel makes, without its cache look-up
            device = kwargs.get("device")
            meta = call_as_meta(self, func, first, **{**kwargs, "device": _META})
            return self._wrap(meta, first.device if device is None else torch.device(device))
        if (route is _META_FACTORY or route is _VALUED_FACTORY) and kwargs.get("layout") in (None, torch.strided):
            return self._factory_fake(func, route, args, kwargs)
        if (
            route is _CONSTANT_FACTORY
            and kwargs.get("layout") in (None, torch.strided)
            and not any(isinstance(value, torch.Tensor) for value in (*args, *kwargs.values()))
        ):  # arange, linspace, ...: what torch's fake kernel for tensor constructors makes, without its cache look-up
            device = torch.device(kwargs.get("device") or "cpu")
            return self._wrap(_constructed(self, func, args, kwargs), device)
        try:
            outs = _out_arguments(func) if type(func) is OpOverload else None
            if outs:
                return self._out_as_eager(func, types, args, kwargs, outs)
            return super().__torch_dispatch__(func, types, args, kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            if isinstance(error, _ClearError):
                raise
            shape = isinstance(error, DynamicOutputShapeException)
        # Raised outside the handler and held by no local: torch's exception as context, or a cycle through this
        # frame, would keep alive the views the reading code made (tolist's rows), which materializing refuses.
        raise _clear(shape, func)

    def _out_as_eager(
        self,
        func: OpOverload,
        types: Sequence[type],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        outs: tuple[str, ...],
    ) -> Any:
        """An operation with ``out=`` tensors, each resized one with the strides eager code gives it.

        Note [Resized out= tensors]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~
        When an ``out=`` tensor has other sizes than the result, eager code resizes it and gives it the strides of
        the result its operation would return (structured kernels restride it to what their meta function says;
        the others compute into it as their functional form does): ``torch.add(t.t(), 1, out=torch.empty(0))`` is
        transposed like ``t.t() + 1``. torch's fake kernels for elementwise operations resize it contiguous, so a
        fake of it had other strides than the real tensor, and a ``reshape`` that copies in eager code was a view of
        the fake (and of the record, which a replay then could not make). A resized ``out=`` tensor gets the
        strides of the operation's functional form, run on the same fakes first (its inputs may be the ``out=``
        tensor itself).
        """
        functional = _functional_of(func)
        given = [kwargs.get(name) for name in outs]
        fakes = [out for out in given if isinstance(out, FakeTensor)]
        if functional is None or len(fakes) != len(given):
            return super().__torch_dispatch__(func, types, args, kwargs)
        sizes = [out.shape for out in fakes]
        inputs = {name: value for name, value in kwargs.items() if name not in outs}
        # The result (computed again below): its strides only, each a fresh fake that nothing else holds.
        strides = [fake.stride() for fake in _leaves(super().__torch_dispatch__(functional, types, args, inputs))]
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if len(strides) == len(fakes):
            for out, size, stride in zip(fakes, sizes, strides, strict=True):
                if out.shape != size and out.stride() != stride:
                    super().__torch_dispatch__(
                        torch.ops.aten.as_strided_.default, types, (out, out.shape, stride, out.storage_offset()), {}
                    )
        return result

    def takes_short_path(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
        """Whether ``func`` on these arguments, whose first is a fake tensor of this mode, is a view or a detach that
        this mode makes without torch's fake kernels, and without the mode entered: from the outside, a fake tensor's
        operation enters its mode and dispatches again (``FakeTensor.__torch_dispatch__``), which cost FSDP2's
        cutting of a deferred parameter more than the cut (see ``_torch_changes``, change 13).

        Such an operation given a fake holding a constant (FSDP2's padded shard of a norm weight, ``new_zeros`` of
        a few elements) goes to this mode's handler too, as the entered mode would get it, where the constant's
        values are kept right (``_run_both``, ``_run_forgetting``), when its tensors are all fakes of this mode."""
        first = args[0]
        if in_kernel(self) or self._attributes(first.device) is None:
            return False
        route = _ROUTE.get(id(func))
        like_first = id(func) in _LIKE_FIRST
        if first.constant is not None or (route is _COPY and _holds_constant(args)):
            return (route is _VIEW or route is _DETACH or route is _COPY or like_first) and _own_fakes_only(
                self, args, kwargs
            )
        if route is _VIEW or route is _DETACH:
            return not _other_tensors(args, kwargs)
        if route is _COPY:
            return self._plain_copy(args, kwargs)
        return like_first and self._like_first(first, args, kwargs or {})

    def whole_alias(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> FakeTensor | None:
        """``func(*args, **kwargs)`` when it is an alias of all of its first argument, a fake of this mode without a
        constant: a ``detach``, or a slice that keeps all of it (see :func:`_slices_all`). None otherwise, or where
        :meth:`_attributes` sends fakes through torch's constructor. Made as the short paths make it."""
        if not args:
            return None
        first = args[0]
        if func is _SLICE:
            if not _plain_fake(first, self) or not _slices_all(first, args, kwargs):
                return None
        elif _ROUTE.get(id(func)) is not _DETACH or len(args) != 1 or kwargs or not _plain_fake(first, self):
            return None
        device = first.device
        attributes = self._attributes(device)
        return None if attributes is None else alias_fake(self, first, device, attributes)

    def _plain_copy(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
        """Whether ``copy_(*args, **kwargs)`` writes values only, and would succeed in eager code: between fakes of
        this mode without constants, of one shape, dtype and device, into a contiguous target (no element written
        twice, which eager code refuses)."""
        if len(args) != 2 or (kwargs and set(kwargs) - {"non_blocking"}):
            return False
        target, source = args
        return (
            _plain_fake(target, self)
            and _plain_fake(source, self)
            and target.shape == source.shape
            and target.dtype == source.dtype
            and target.device == source.device
            and target.is_contiguous()
        )

    def _like_first(self, first: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        """Whether a ``_LIKE_FIRST`` operation makes a strided tensor on the device of ``first``, a fake of this mode,
        from metadata and numbers alone."""
        if type(first) is not FakeTensor or first.fake_mode is not self or _other_tensors(args, kwargs):
            return False
        device = kwargs.get("device")
        return (
            kwargs.get("layout") in (None, torch.strided)
            and not kwargs.get("pin_memory")
            and (device is None or (type(device) is torch.device and device == first.device))
        )

    def _view(
        self, func: Any, first: FakeTensor, args: Sequence[Any], kwargs: Mapping[str, Any] | None
    ) -> FakeTensor | list[FakeTensor] | None:
        """A view operation (``_VIEWS``) of ``first``, a fake of this mode without a constant, given no other tensor:
        run on the meta tensor that ``first`` is below the mode, each result wrapped. None where torch's path is
        needed: another tensor among the arguments, or no attributes to copy yet (see :meth:`_attributes`)."""
        if _other_tensors(args, kwargs):
            return None
        device = first.device
        attributes = self._attributes(device)
        if attributes is None:
            return None
        if func is _SLICE and _slices_all(first, args, kwargs):
            # all of it (FSDP2 narrows an evenly divided padded shard to its own length, twice per parameter)
            return alias_fake(self, first, device, attributes)
        # on a plain alias of ``first``: the kernel's questions about its device stay in C++ (see meta_alias)
        result: Any = call_as_meta(self, func, meta_alias(first), *args[1:], **(kwargs or {}))  # a split's is a list
        if type(result) is list or type(result) is tuple:
            return [wrap_meta(self, meta, device, attributes) for meta in result]
        return wrap_meta(self, result, device, attributes)

    def _factory_fake(self, func: Any, route: int, args: Sequence[Any], kwargs: Mapping[str, Any]) -> FakeTensor:
        """A tensor factory (``_FACTORIES``) of strided tensors, made on the meta device and wrapped; ones, zeros and
        full get their values too, when small."""
        device = torch.device(kwargs.get("device") or "cpu")
        fake = self._wrap(_meta_factory(func, args, kwargs), device)
        if route is _VALUED_FACTORY and device.type != "meta":
            _give_values(fake, func, args, kwargs)
        return fake

    def _attributes(self, device: torch.device) -> dict[str, Any] | None:
        """The attributes :meth:`_wrap` copies onto a fake tensor on ``device`` (normalized), or None where it calls
        torch's constructor, which may ask about CUDA (see ``__torch_dispatch__``)."""
        attributes = self._fake_attributes.get(device)
        if attributes is None or FakeTensorConfig.debug or torch.compiler.is_exporting():
            return None
        return attributes

    def _wrap(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        """``FakeTensor(self, meta, device)`` for a fresh meta tensor, made faster.

        torch's constructor checks its arguments, normalizes the device twice and sets twenty attributes through
        descriptors: a third of the time a model takes to build in fake mode. Past the first fake tensor on a
        device, this makes the tensor as that constructor does and copies the first one's attributes, all None but
        the device (see ``_torch_private.wrap_meta``). While exporting, in torch's fake tensor debug mode, or if torch
        sets an attribute to anything else, it calls the constructor.
        """
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


install_dispatch_entry(ModattrsFakeTensorMode)  # Note [A dispatch entry dynamo cannot see] in modattrs/_compiled.py


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
        or (device.type == "cuda" and not cuda_guard.cuda_built())
    ):
        _NORMALIZED[device] = normalized
    return normalized


def check_device(device: object) -> None:
    """Refuse CUDA devices that cannot be faked: any, until fake CUDA is set up on a machine without a GPU, and
    those past the spoofed device count."""
    if device is None:
        return
    limit = spoofed_cuda.device_limit()
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
    if not cuda_guard.ready():
        raise RuntimeError(
            f"fake tensors on {device} need modattrs.fake.fake_mode(fake_cuda=True) (or fake_copy to a CUDA device) "
            "first, on this machine, which has no GPU"
        )
    if device.index is not None and not 0 <= device.index < limit and not cuda_guard.gpu_present():
        if device.index < 0:  # torch.device(200), for one: the index is 8 bits
            raise ValueError(
                f"{device}: not a CUDA device (torch wraps a device index past 127 around to a negative one); use "
                f"cuda:0 to cuda:{limit - 1}"
            )
        if limit == spoofed_cuda.MAX_DEVICES:
            raise ValueError(f"{device}: torch's fake CUDA device guard knows cuda:0 to cuda:{limit - 1} only")
        raise ValueError(
            f"{device}: this fake_mode spoofs {limit} CUDA devices, cuda:0 to cuda:{limit - 1}; ask for more with "
            f"fake_mode(fake_cuda=True, device_count=N), up to {spoofed_cuda.MAX_DEVICES}"
        )


#: By operation: the names of its ``out=`` arguments (none for most).
_OUTS: dict[OpOverload, tuple[str, ...]] = {}
#: By operation with ``out=`` arguments: its functional form, or None.
_FUNCTIONAL: dict[OpOverload, OpOverload | None] = {}


def _out_arguments(func: OpOverload) -> tuple[str, ...]:
    outs = _OUTS.get(func)
    if outs is None:
        outs = _OUTS[func] = tuple(argument.name for argument in func._schema.arguments if argument.is_out)
    return outs


def _functional_of(func: OpOverload) -> OpOverload | None:
    """The overload of ``func``'s operation that takes the same arguments but the ``out=`` ones and writes none
    (``aten.add.Tensor`` for ``aten.add.out``), or None."""
    if func in _FUNCTIONAL:
        return _FUNCTIONAL[func]
    wanted = [(argument.name, str(argument.type)) for argument in func._schema.arguments if not argument.is_out]
    found = None
    for name in func.overloadpacket.overloads():
        overload = getattr(func.overloadpacket, name)
        schema = overload._schema
        if not schema.is_mutable and [(a.name, str(a.type)) for a in schema.arguments] == wanted:
            found = overload
            break
    _FUNCTIONAL[func] = found
    return found


def _give_values(fake: FakeTensor, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """ones, zeros, full: the values are known, and kept when small."""
    if fake.numel() <= CONSTANT_LIMIT:
        with DisableTorchFunction(), DisableTorchDispatch():
            fake.constant = _FACTORIES[func](*args, **{**kwargs, "device": _CPU, "pin_memory": False})


def _forget_constant(mode: FakeTensorMode, tensor: FakeTensor) -> None:
    """Make ``tensor`` and every fake sharing its constant's storage forget their values.

    Detaching a constant (``nn.Parameter(torch.tensor(2.6592))``, CLIP's ``logit_scale``) takes torch's path
    otherwise, which memoizes the result with a weak reference, and ``Module.to`` swaps fake parameters with
    ``torch.utils.swap_tensors``, which refuses tensors that have one. The detached tensor is made without its
    constant; the tensors it aliases forget theirs, which a write through it would leave stale.
    """
    if has_constant_aliases(mode):
        forget_constant_aliases(mode, tensor)
    tensor.constant = None


_SLICE = aten.slice.Tensor


def _slices_all(first: torch.Tensor, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    """Whether ``aten.slice.Tensor(first, *args[1:], **kwargs)`` keeps all of ``first``: step 1, from the start, to
    its end or past it. Its result is then an alias of ``first``, of the same geometry."""
    dims = first.dim()
    if kwargs or not 1 <= len(args) <= 5 or dims == 0:
        return False
    given: tuple[Any, ...] = tuple(args[1:])
    dim, start, end, step = given + (0, None, None, 1)[len(given) :]
    if type(dim) is not int or not -dims <= dim < dims:
        return False
    return (
        (start is None or (type(start) is int and start == 0))
        and (end is None or (type(end) is int and end >= first.size(dim)))
        and type(step) is int
        and step == 1
    )


def _other_tensors(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    """Whether a tensor is among the arguments but the first (view operations take sizes and numbers)."""
    for value in args[1:]:  # a loop, not any() of a generator: twice per view of a fake tensor
        if isinstance(value, torch.Tensor):
            return True
    if kwargs:
        for value in kwargs.values():
            if isinstance(value, torch.Tensor):
                return True
    return False


def _holds_constant(args: Sequence[Any]) -> bool:
    """Whether a fake tensor holding a constant is among ``args``."""
    return any(type(value) is FakeTensor and value.constant is not None for value in args)


def _own_fakes_only(mode: FakeTensorMode, args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> bool:
    """Whether every tensor among the arguments is a fake tensor of ``mode``, none of them in a list."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            if type(value) is not FakeTensor or value.fake_mode is not mode:
                return False
        elif (type(value) is list or type(value) is tuple) and any(isinstance(item, torch.Tensor) for item in value):
            return False
    return True


def _new_contiguous(first: torch.Tensor, size: Sequence[int], dtype: torch.dtype | None) -> torch.Tensor:
    """The meta tensor ``first.new_zeros(size, dtype=dtype)`` makes (``new_ones``, ``new_full``, ``new_empty``
    alike): contiguous, of ``size``, in ``dtype`` or ``first``'s, with no conjugate or negative bit."""
    with DisableTorchFunction(), DisableTorchDispatch():
        return torch.empty(size, dtype=first.dtype if dtype is None else dtype, device=_META)


def _plain_fake(tensor: object, mode: FakeTensorMode) -> bool:
    # The short paths are for ordinary fakes of this mode: fakes holding a constant (small tensors made from Python
    # values) take torch's path, which keeps the constant right.
    return type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None


# --- construction-time constants --------------------------------------------------------------------------------------
#
# A constant is a fake tensor that also holds its values in ``FakeTensor.constant`` (torch's own attribute, for the
# small tensors torch makes from Python numbers), always a plain CPU tensor whatever device the fake is on. It is
# made by a factory whose values do not depend on tensors' values (``_CONSTANT_FACTORIES``, ones, zeros, full), by
# ``torch.tensor(...)`` (``lift_fresh``, of the real tensor torch made), and by any deterministic operation all of
# whose tensor arguments are constants (or small real CPU tensors), while it has at most CONSTANT_LIMIT elements (a
# view of a constant always qualifies). An operation on constants runs twice: the fake one as before with the
# constants hidden from torch (whose own propagation would make CPU fakes where CUDA ones belong, and memoize them
# under weak references), and the real one on the CPU. A write with anything that is not a constant, a random
# operation, or a view that cannot hold the values makes the constant and its aliases forget their values. A deep copy
# of a constant holds a copy of its values (``deep_copy``).


def _factory(
    mode: ModattrsFakeTensorMode, func: Any, types: Sequence[type], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """A factory: the fake as before, and a constant too when small and its tensor arguments' values, if it reads
    them, are known."""
    held = [a for a in args if type(a) is FakeTensor and a.constant is not None]  # zeros_like(constant)
    with _Hidden(held):
        fake = mode._fake_only(func, types, args, kwargs, _CONSTANT_FACTORY)
    if type(fake) is not FakeTensor or fake.layout is not torch.strided or fake.numel() > CONSTANT_LIMIT:
        return fake  # (numel, from its sizes in C++, asks no mode)
    if fake.device.type == "meta":
        return fake  # on the meta device values are refused, as outside fake mode
    with DisableTorchFunction(), DisableTorchDispatch():
        real_args = [_factory_argument(func, a) for a in args]
        if any(a is None for a in real_args):
            return fake  # linspace from a tensor without values
        real_kwargs = dict(kwargs)
        if "device" in real_kwargs or "device" in operator_arguments(func):
            real_kwargs["device"] = _CPU
        if "pin_memory" in real_kwargs:
            real_kwargs["pin_memory"] = False
        fake.constant = func(*real_args, **real_kwargs)
    return fake


def _factory_argument(func: Any, value: Any) -> Any:
    """``value`` as the real run of a constant factory takes it: a tensor as an empty one like it where the factory
    reads only metadata, else as its values (None where it has none)."""
    if not isinstance(value, torch.Tensor):
        return value
    if id(func) in _READING_METADATA:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=_CPU)
    if type(value) is FakeTensor:
        return value.constant
    return value if _usable_real(value) else None


#: The shapes, strides and dtypes of what constant factories without tensor arguments make, by the arguments and the
#: default dtype, which are all they depend on: torch's meta kernels for some are Python (a float ``arange``, which
#: most language models' rotary embeddings make, costs as much as a hundred other tensors).
_CONSTRUCTED: dict[tuple[Any, ...], tuple[torch.Size, tuple[int, ...], torch.dtype]] = {}
_CONSTRUCTED_LIMIT = 1024


def _constructed(
    mode: ModattrsFakeTensorMode, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> torch.Tensor:
    """The meta tensor a constant factory makes of ``args`` and ``kwargs`` (no tensors among them)."""
    # Each value with its type: 1, 1.0 and True are equal, and make different tensors.
    key = (
        id(func),
        torch.get_default_dtype(),
        *[(type(value), value) for value in args],
        *[(name, type(value), value) for name, value in kwargs.items() if name != "device"],
    )
    try:
        made = _CONSTRUCTED.get(key)
    except TypeError:  # an unhashable argument
        return call_as_meta(mode, func, *args, **{**kwargs, "device": _META})
    if made is None:
        meta = call_as_meta(mode, func, *args, **{**kwargs, "device": _META})
        if meta.layout is torch.strided and meta.storage_offset() == 0:
            if len(_CONSTRUCTED) >= _CONSTRUCTED_LIMIT:
                _CONSTRUCTED.clear()
            _CONSTRUCTED[key] = (meta.shape, meta.stride(), meta.dtype)
        return meta
    shape, stride, dtype = made
    with DisableTorchFunction(), DisableTorchDispatch():
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)


def _lift(mode: ModattrsFakeTensorMode, args: Sequence[Any]) -> FakeTensor | None:
    """``torch.tensor(data)``: a constant holding a copy of the real tensor torch made (torch itself keeps one of at
    most one element, and memoizes the fake under a weak reference); None to take torch's path."""
    real = args[0] if len(args) == 1 else None
    if type(real) is not torch.Tensor or real.layout is not torch.strided or not _usable_real(real):
        return None
    with DisableTorchFunction(), DisableTorchDispatch():
        constant = real.detach().clone()
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
    fake = mode._wrap(meta, real.device)
    fake.constant = constant
    return fake


def _scan(
    mode: ModattrsFakeTensorMode, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> tuple[list[FakeTensor], bool]:
    """The fake arguments of ``mode`` that hold constants, and whether any tensor argument has no known values."""
    constants: list[FakeTensor] = []
    unknown = False
    for value in (*args, *kwargs.values()) if kwargs else args:
        if type(value) is FakeTensor:
            if value.constant is not None and value.fake_mode is mode:
                constants.append(value)
            else:
                unknown = True
        elif type(value) is list or type(value) is tuple:
            for item in value:
                if type(item) is FakeTensor:
                    if item.constant is not None and item.fake_mode is mode:
                        constants.append(item)
                    else:
                        unknown = True
                elif isinstance(item, torch.Tensor) and not _usable_real(item):
                    unknown = True
        elif isinstance(value, torch.Tensor) and not _usable_real(value):
            unknown = True
    return constants, unknown


def _usable_real(tensor: torch.Tensor) -> bool:
    """A real tensor handed in whose values can serve as a constant's (what ``torch.tensor`` lifts is one)."""
    return type(tensor) is torch.Tensor and tensor.device.type == "cpu" and tensor.numel() <= CONSTANT_LIMIT


_RANDOM: dict[Any, bool] = {}


def _random(func: OpOverload) -> bool:
    random = _RANDOM.get(func)
    if random is None:
        random = _RANDOM[func] = torch.Tag.nondeterministic_seeded in func.tags
    return random


def _run_both(
    mode: ModattrsFakeTensorMode,
    func: OpOverload,
    types: Sequence[type],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    constants: list[FakeTensor],
) -> Any:
    """``func`` as a fake operation and for real on the constants: the fake results get the real values. Value
    reads and operations whose output shape depends on values (``item``, ``unique``) fail as fakes and take the
    real result's value or shape."""
    made = _pointwise_of_values(mode, func, args, kwargs, constants)
    if made is not None:
        return made
    dynamic: Exception | None = None
    with _Hidden(constants):
        try:
            result = mode._fake_only(func, types, args, kwargs, _ROUTE.get(id(func)))
        except (DataDependentOutputException, DynamicOutputShapeException) as error:
            result, dynamic = None, error.with_traceback(None)  # no cycle through this frame
    fakes = [] if dynamic else _leaves(result)
    if (
        dynamic is None
        and not any(type(f) is FakeTensor and f.numel() <= CONSTANT_LIMIT for f in fakes)
        and not _views(fakes, constants)
    ):  # too large to keep (a weight made from a constant): no real run
        _forget_written(mode, func, args, kwargs, constants)
        return result
    try:
        real = _real_call(func, args, kwargs)
        failed = False
    except Exception:
        failed = True
    if failed:
        if dynamic is not None:
            try:
                raise dynamic  # outside the handler: the real run's failure is no part of it
            finally:
                dynamic = None  # no cycle through this frame
        _forget_written(mode, func, args, kwargs, constants)
        return result
    if dynamic is not None:
        return _fakes_of(mode, real, constants[0].device)
    reals = _leaves(real)
    if len(reals) != len(fakes):
        _forget_written(mode, func, args, kwargs, constants)
        return result
    held = {_storage(c.constant): c for c in constants if c.constant is not None}
    for fake, value in zip(fakes, reals, strict=True):
        if type(fake) is not FakeTensor or not isinstance(value, torch.Tensor) or fake.constant is value:
            continue  # the last: in place, the real run wrote the constant
        if value.layout is not torch.strided or fake.device.type == "meta":
            continue
        viewed = held.get(_storage(value))
        if (
            fake.shape == value.shape
            and fake.dtype == value.dtype
            and (viewed is not None or value.numel() <= CONSTANT_LIMIT)
        ):
            fake.constant = value
            if viewed is not None:  # aliases: a write through one that is no constant must make all forget
                note_constant_alias(mode, viewed)
                note_constant_alias(mode, fake)
        elif viewed is not None and viewed.constant is not None:  # a view that cannot hold the values
            _forget(mode, viewed)
    return result


def _pointwise_of_values(
    mode: ModattrsFakeTensorMode,
    func: OpOverload,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    constants: list[FakeTensor],
) -> FakeTensor | None:
    """A pointwise operation that makes a new tensor from contiguous constants on one device, small enough to be a
    constant: run on the values first, its fake made from the real result (contiguous, of the broadcast shape and the
    promoted dtype: what torch's fake kernel makes of contiguous inputs), without torch's fake operation, which
    costs ten times more. None to run both as ``_run_both`` does (which also says what is wrong, if anything)."""
    if not _fresh_pointwise(func):
        return None
    device = constants[0].device
    shapes = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            constant = value.constant if type(value) is FakeTensor and value.fake_mode is mode else None
            if constant is None or value.device != device or not value.is_contiguous() or not constant.is_contiguous():
                return None
            shapes.append(value.shape)
        elif (type(value) is list or type(value) is tuple) and any(isinstance(item, torch.Tensor) for item in value):
            return None
    shape = _broadcast(shapes)
    if shape is None or math.prod(shape) > CONSTANT_LIMIT:
        return None
    try:
        real = _real_call(func, args, kwargs)
    except Exception:
        return None
    if type(real) is not torch.Tensor or real.shape != shape or real.stride() != contiguous_strides(shape):
        return None
    made: FakeTensor = _fakes_of(mode, real, device)
    return made


def _broadcast(shapes: list[torch.Size]) -> tuple[int, ...] | None:
    """The shape ``shapes`` broadcast to, or None if they do not (``torch.broadcast_shapes`` is dearer)."""
    result: list[int] = []
    for shape in shapes:
        if len(shape) > len(result):
            result[:0] = [1] * (len(shape) - len(result))
        for at, size in enumerate(shape, len(result) - len(shape)):
            if size != result[at]:
                if result[at] == 1:
                    result[at] = size
                elif size != 1:
                    return None
    return tuple(result)


#: Whether an operator is pointwise, writes no argument, returns no alias of one and takes no device.
_FRESH_POINTWISE: dict[Any, bool] = {}


def _fresh_pointwise(func: OpOverload) -> bool:
    fresh = _FRESH_POINTWISE.get(func)
    if fresh is None:
        fresh = _FRESH_POINTWISE[func] = (
            torch.Tag.pointwise in func.tags
            and not written_arguments(func)
            and not returns_aliases(func)
            and "device" not in operator_arguments(func)
        )
    return fresh


def _run_forgetting(
    mode: ModattrsFakeTensorMode,
    func: Any,
    types: Sequence[type],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    constants: list[FakeTensor],
) -> Any:
    """An operation whose results are no constants (a random one, or one reading tensors without values): the
    constants it writes, and those its results view, forget their values (a write through a view without values
    would leave them stale)."""
    with _Hidden(constants):
        result = mode._fake_only(func, types, args, kwargs, _ROUTE.get(id(func)))
    outputs = [leaf for leaf in _leaves(result) if type(leaf) is FakeTensor]
    written = _written(func, args, kwargs)
    for fake in constants:
        if fake.constant is None:
            continue
        if id(fake) in written or any(out is not fake and _same_storage(out, fake) for out in outputs):
            _forget(mode, fake)
    return result


class _Hidden:
    """Hide constants from torch's fake tensor code while the fake operation runs."""

    __slots__ = ("saved",)

    def __init__(self, constants: list[FakeTensor]) -> None:
        self.saved = [(fake, fake.constant) for fake in constants]

    def __enter__(self) -> None:
        for fake, _ in self.saved:
            fake.constant = None

    def __exit__(self, *exc: object) -> None:
        for fake, constant in self.saved:
            if fake.constant is None:
                fake.constant = constant


def _real_call(func: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``func`` on the constants' values, on the CPU."""
    real_args = [_real(value) for value in args]
    real_kwargs = {name: _real(value) for name, value in kwargs.items()}
    if real_kwargs.get("pin_memory"):
        real_kwargs["pin_memory"] = False
    with DisableTorchFunction(), DisableTorchDispatch():
        return func(*real_args, **real_kwargs)


def _real(value: Any) -> Any:
    if type(value) is FakeTensor:
        return value.constant
    if isinstance(value, torch.device):
        return _CPU
    if type(value) is list or type(value) is tuple:
        return type(value)(_real(item) for item in value)
    return value


def _fakes_of(mode: ModattrsFakeTensorMode, real: Any, device: torch.device) -> Any:
    """Fake tensors on ``device`` for the real results of an operation whose output shapes depend on values."""
    if isinstance(real, torch.Tensor):
        with DisableTorchFunction(), DisableTorchDispatch():
            meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
        fake = mode._wrap(meta, device)
        if real.numel() <= CONSTANT_LIMIT:
            fake.constant = real
        return fake
    if type(real) is list or type(real) is tuple:
        return type(real)(_fakes_of(mode, item, device) for item in real)
    return real  # a value read: a Python number


def _forget_written(
    mode: ModattrsFakeTensorMode, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], constants: list[FakeTensor]
) -> None:
    written = _written(func, args, kwargs)
    for fake in constants:
        if id(fake) in written and fake.constant is not None:
            _forget(mode, fake)


def _forget(mode: ModattrsFakeTensorMode, fake: FakeTensor) -> None:
    forget_constant_aliases(mode, fake)


def _written(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> set[int]:
    """The ids of the tensors ``func`` writes in place (all of them for something that is no aten operation)."""
    if not isinstance(func, OpOverload):
        return {id(value) for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)}
    ids: set[int] = set()
    for index, name in _written_positions(func):
        value = args[index] if index < len(args) else kwargs.get(name)
        if type(value) is list or type(value) is tuple:
            ids.update(id(item) for item in value)
        elif value is not None:
            ids.add(id(value))
    return ids


@functools.cache
def _written_positions(func: OpOverload) -> tuple[tuple[int, str], ...]:
    return written_arguments(func)


def _leaves(result: Any) -> list[Any]:
    if type(result) is list or type(result) is tuple:
        return [leaf for item in result for leaf in _leaves(item)]
    return [result]


def _views(fakes: list[Any], constants: list[FakeTensor]) -> bool:
    return any(type(f) is FakeTensor and any(_same_storage(f, c) for c in constants) for f in fakes)


def _same_storage(one: torch.Tensor, other: torch.Tensor) -> bool:
    return address_of(one.untyped_storage()) == address_of(other.untyped_storage())


def _storage(tensor: torch.Tensor) -> int:
    # The constant's real storage; a storage of no bytes is shared by nothing that matters.
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else -id(tensor)


# Note [Deep copies that share memory as eager ones do]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Eager copy.deepcopy of a tensor copies its storage through the memo, once per storage, and sets the copy to the
# tensor's offset, sizes and strides in the copied storage: tensors sharing memory (a buffer and a view of it) give
# copies sharing the copied memory, at the same offsets. A parameter copies its data by clone (nn.Parameter's own
# __deepcopy__), memory of its own; a meta tensor, with no storage to copy, by clone too. torch's method copies a
# fake tensor by clone(), unless its data pointer is not 0 (a view at an offset), where it sets a copied meta storage
# into it: the copies of a buffer and its view shared nothing, and deferred_init, which records no storages, refused
# the second way. modattrs' fake tensors are copied as eager ones: the first tensor met on a storage copies all of it
# (a clone of it if it covers its storage, else a clone of an as_strided view of the whole storage), kept in the memo
# under the storage, and every tensor on that storage is an as_strided view of that copy at its own place. These are
# torch operations, which fake mode runs and deferred_init records (so a copy materializes as eager's copy does). A
# real tensor deep-copied inside modattrs' fake modes is copied the same way into a fake tensor, as every other
# operation on a real tensor there makes a fake one (torch's own fake mode fails on it: its meta tensor cannot take
# a real storage). A constant (see "Construction-time constants") is copied the same way outside every mode, so the
# copies' values share memory as the copies do; a real tensor's values become its copy's constant, when small.

#: Keys of modattrs' tables in deepcopy's memo (torch keeps its own under "__torch__"): by the address of a storage
#: met, the storage (kept alive) and the fake copy of all of it; and the same for the real storages of constants.
_COPIED_STORAGES = "modattrs: fake copies of storages"
_COPIED_CONSTANTS = "modattrs: copies of constants' storages"


def deep_copy(tensor: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """``copy.deepcopy`` of a fake tensor of modattrs' modes (a graph leaf), or of a plain real tensor inside one: see
    Note [Deep copies that share memory as eager ones do]."""
    if id(tensor) in memo:
        copied: torch.Tensor = memo[id(tensor)]
        return copied
    fake = type(tensor) is FakeTensor
    # A real tensor's values are its copy's constant, when small.
    constant = tensor.constant if isinstance(tensor, FakeTensor) else tensor if _usable_real(tensor) else None
    with torch.no_grad():
        # Memory of its own, as eager copies: a parameter's (nn.Parameter's __deepcopy__ clones), a meta tensor's, and
        # that of a tensor with the conjugate or negative bit (resolved into new memory).
        own_memory = (fake and (isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta")) or (
            tensor.is_conj() or tensor.is_neg()
        )
        copied = _hiding_constants(tensor.clone, tensor) if own_memory else _copied_in_place(tensor, memo)
        if tensor.requires_grad:
            copied.requires_grad_()
        if tensor.grad is not None:
            copied.grad = copy.deepcopy(tensor.grad, memo)
    clear_cached_data(tensor)
    state = {name: value for name, value in vars(tensor).items() if name != "constant"}
    vars(copied).update(copy.deepcopy(state, memo))
    if type(copied) is FakeTensor and isinstance(copied.fake_mode, ModattrsFakeTensorMode):
        if constant is None or copied.device.type == "meta":
            copied.constant = None
        elif own_memory:
            with DisableTorchFunction(), DisableTorchDispatch():
                copied.constant = constant.clone()
        else:
            _copy_constant(copied, constant, memo)
    memo[id(tensor)] = copied
    return copied


def _copied_in_place(tensor: torch.Tensor, memo: dict[Any, Any]) -> torch.Tensor:
    """The copy of ``tensor`` at its place in the copy of its storage, made the first time that storage is met."""
    storages: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = memo.setdefault(_COPIED_STORAGES, {})
    storage = tensor.untyped_storage()
    met = storages.get(address_of(storage))
    if met is None:
        if (
            tensor.storage_offset() == 0
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() == storage.nbytes()
        ):
            # The tensor covers its storage: its clone is the copy of all of it, and the copy of it when it has its
            # strides (a dimension of size 1 may have any stride, and the clone takes the usual one).
            whole = _hiding_constants(tensor.clone, tensor)
            storages[address_of(storage)] = (storage, whole)
            if whole.shape == tensor.shape and whole.stride() == tensor.stride():
                return whole
            met = storages[address_of(storage)]
        else:
            elements = storage.nbytes() // tensor.element_size()
            if type(tensor) is FakeTensor:
                all_of_it = _hiding_constants(tensor.as_strided, tensor, (elements,), (1,), 0)
            else:  # a real view, outside the modes: its copy, below, is the fake mode's
                with DisableTorchFunction(), DisableTorchDispatch():
                    all_of_it = tensor.as_strided((elements,), (1,), 0)
            met = storages[address_of(storage)] = (storage, all_of_it.clone())
    copied_storage = met[1]
    if copied_storage.dtype != tensor.dtype:  # flat first: a dtype view of many dims needs its last one to divide
        flat = _hiding_constants(copied_storage.view, copied_storage, -1)
        copied_storage = _hiding_constants(flat.view, flat, tensor.dtype)
    placed = _hiding_constants(
        copied_storage.as_strided, copied_storage, tensor.shape, tensor.stride(), tensor.storage_offset()
    )
    # Not a view to autograd, as an eager copy (set_ into the copied storage) is not: a view made under no_grad
    # whose base is written since refuses to be viewed again (unbind, tolist) where the eager copy works.
    return placed.detach()


def _hiding_constants(method: Callable[..., torch.Tensor], tensor: torch.Tensor, *args: Any) -> torch.Tensor:
    """``method(*args)`` of ``tensor``, a fake tensor whose constant, if any, is hidden: the copies get theirs from
    ``_copy_constant``, whose values share memory as the copies do."""
    held = [tensor] if type(tensor) is FakeTensor and tensor.constant is not None else []
    with _Hidden(held):
        return method(*args)


def _copy_constant(copied: FakeTensor, constant: torch.Tensor, memo: dict[Any, Any]) -> None:
    """Give ``copied`` a copy of ``constant``, at its place in a copy of the constant's storage, made once per storage
    outside every mode, as eager copy.deepcopy makes it; copies sharing that storage are noted as aliases, so that a
    write through one that leaves no values makes all forget theirs."""
    copies: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage, list[FakeTensor]]]
    copies = memo.setdefault(_COPIED_CONSTANTS, {})
    storage = constant.untyped_storage()
    with DisableTorchFunction(), DisableTorchDispatch():
        met = copies.get(address_of(storage))
        if met is None:
            met = copies[address_of(storage)] = (storage, storage.clone(), [])  # type: ignore[no-untyped-call]
        values = torch.empty((0,), dtype=constant.dtype)
        values.set_(met[1], constant.storage_offset(), constant.shape, constant.stride())
    copied.constant = values
    sharing = met[2]
    sharing.append(copied)
    mode = copied.fake_mode
    if len(sharing) == 2:
        note_constant_alias(mode, sharing[0])
    if len(sharing) >= 2:
        note_constant_alias(mode, copied)


def data_for(tensor: torch.Tensor, data: object) -> object:
    """What ``tensor.data = data`` sets: ``data``, or, for a meta tensor that is no fake given a fake meta tensor of
    modattrs' modes, a meta tensor of the fake's shape, strides and dtype, which is what the two stand for.

    ``torch.tensor(..., device="meta")`` (and ``as_tensor``, ``asarray``, ``new_tensor`` of Python data) is made
    below every dispatch mode, so inside fake mode on the meta device it is a plain meta tensor, and so is
    ``nn.Parameter`` of it; an operation on it inside the mode makes a fake. ``p.data = p.data.to(dtype)`` (CLIP's
    ``logit_scale`` cast to bfloat16) would mix the two, which torch refuses.
    """
    if (
        type(data) is FakeTensor
        and data.device.type == "meta"
        and isinstance(data.fake_mode, ModattrsFakeTensorMode)
        and not isinstance(tensor, FakeTensor)
        and tensor.device.type == "meta"
    ):
        with DisableTorchFunction(), DisableTorchDispatch():
            return torch.empty_strided(data.shape, data.stride(), dtype=data.dtype, device=_META)
    return data


def data_replaced(tensor: torch.Tensor, data: object) -> None:
    """After ``tensor.data = data`` (``set_data``, which no dispatch mode sees): a fake tensor of modattrs' modes
    now shares the memory of ``data``, so it holds ``data``'s values if ``data`` is a constant of its mode (both
    listed as aliases, so that a write through either makes both forget), and none otherwise.

    A parameter holds no values (see ``_forget_constant``): a constant whose memory it now shares forgets its own,
    which a write through the parameter would leave stale. The tensors that shared ``tensor``'s old memory keep
    their values: that memory is unchanged.
    """
    if type(tensor) is not FakeTensor or not isinstance(tensor.fake_mode, ModattrsFakeTensorMode):
        return
    mode = tensor.fake_mode
    given = data.constant if type(data) is FakeTensor and data.fake_mode is mode else None
    if tensor.constant is not None:
        unlist_constant_alias(mode, tensor)  # it no longer shares that memory: writes there no longer reach it
    tensor.constant = None
    if given is None:
        return
    assert isinstance(data, FakeTensor)
    if isinstance(tensor, torch.nn.Parameter):
        _forget(mode, data)
        return
    with DisableTorchFunction(), DisableTorchDispatch():
        tensor.constant = given.detach()  # a tensor of its own over the same values: t_() of one leaves the other
    note_constant_alias(mode, data)
    note_constant_alias(mode, tensor)


# Note [Saving fake tensors]
# torch.save and pickle of a fake tensor pickle its __dict__, which holds its mode: with torch's own FakeTensorMode
# they fail on the mode's weak dictionaries ("Can't pickle local object 'WeakValueDictionary...'"). A fake tensor has
# no values to save, so modattrs' modes refuse to be pickled with a message naming the tensor (the last fake tensor
# this thread reduced: FakeTensor.__reduce_ex__ notes it, change 12 in _torch_changes) and the two ways out: values
# from a real build, or a file of shapes and dtypes only, which torch writes inside
# torch.serialization.skip_data(materialize_fake_tensors=True) without pickling the mode.


class _Reduced(threading.local):
    def __init__(self) -> None:
        self.tensor = "a fake tensor"


_reduced = _Reduced()


def note_reduced(fake: torch.Tensor) -> None:
    """Note ``fake``, a fake tensor of modattrs' modes that this thread is reducing (to pickle it, most likely), so
    that the message refusing to pickle its mode names it."""
    kind = "parameter" if isinstance(fake, torch.nn.Parameter) else "tensor"
    _reduced.tensor = f"a fake {kind} of shape {tuple(fake.shape)}, {fake.dtype}, on {fake.device}"


def _unsaveable(mode: ModattrsFakeTensorMode) -> pickle.PicklingError:
    tensor = _reduced.tensor
    return pickle.PicklingError(
        f"{tensor} cannot be saved or pickled: a fake tensor has no values.\n"
        "expected: tensors with values, or torch.save inside "
        "torch.serialization.skip_data(materialize_fake_tensors=True)\n"
        f"got: {tensor}\n"
        f"To save values, {mode.values_from}. To save shapes, dtypes and devices only, call torch.save inside "
        'torch.serialization.skip_data(materialize_fake_tensors=True), and load the file with map_location="meta" '
        "or inside modattrs.fake.fake_mode()"
    )


# --- what is still refused -------------------------------------------------------------------------------------------


class _ClearError:
    """Mixed into torch's two exceptions: still caught as them (deferred_init's recorder, torch's own callers), with
    a message saying what needed values, where, and what has values in fake mode."""

    message: str

    def __str__(self) -> str:
        return self.message


class FakeValueError(_ClearError, DataDependentOutputException):
    """A value read (``.item()``, ``bool()``, ...) of a fake tensor that holds no values."""


class FakeShapeError(_ClearError, DynamicOutputShapeException):
    """An operation whose output shape depends on the values (``nonzero``, ``unique``) of a fake tensor without."""


_READS = {"aten._local_scalar_dense.default": ".item(), .tolist(), int(), float(), bool() or an if on a tensor"}

#: What a construction-time constant is, for messages (deferred_init's too).
CONSTANTS_EXPLAINED = (
    "Fake tensors keep their values only as construction-time constants, which are\n"
    "- made in fake mode from Python numbers (torch.tensor, arange, linspace, full, zeros, ...) or from other "
    "constants by operations that draw no random numbers\n"
    f"- of at most {CONSTANT_LIMIT} elements\n"
    "- not written since by anything else (a random fill, a parameter, empty)"
)


def _clear(shape: bool, func: Any) -> Exception:
    name = str(func)
    what, named = name, ""
    if name in _READS:  # what it is called in Python first, and its schema name on a line of its own
        what, named = _READS[name], f"operation: {name}\n"
    needs = "the values, which give its output's shape," if shape else "the values"
    made = (FakeShapeError if shape else FakeValueError)(func)
    made.message = (
        f"{what} needs {needs} of a fake tensor that has none.\n{named}where: {where()}\n{CONSTANTS_EXPLAINED}\n"
        "Compute this value from Python numbers, or outside fake mode"
    )
    return made
