"""``VirtualTensor``: a tensor attribute computed from other attributes of its module."""

from __future__ import annotations

import inspect
import itertools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from modattrs import _cache
from modattrs._attribute import OwnedAttribute, own_attributes, set_persistent
from modattrs._cache import Cache
from modattrs._compiled import speedups as _speedups
from modattrs._compiled import stale_build
from modattrs._devices import as_device
from modattrs._module_tensors import without_data
from modattrs._names import callable_name, load_error
from modattrs._torch_private import (
    BUFFER_TABLE,
    FakeTensor,
    buffers_of,
    non_persistent_buffers_of,
    parameters_of,
    parse_to,
    submodules_of,
)

__all__ = ["VirtualTensor", "sync_references"]

#: A callable materializer: ``fn(owner, dtype, device) -> Tensor``.
Materializer = Callable[[nn.Module, torch.dtype, torch.device], Tensor]

_CPU = torch.device("cpu")

# dynamo knows is_dynamo_compiling by the function object, whatever its name.
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class VirtualTensorAttributes(NamedTuple):
    """Names that a :class:`VirtualTensor` registers on its owner."""

    #: The zero-element reference buffer, ``_{name}_ref``.
    ref: str


class VirtualTensor(OwnedAttribute):
    """A tensor attribute derived from other attributes of its module.

    The value is not stored: each read of :attr:`value` calls the *materializer* with the dtype and device that
    the attribute currently has. Those are kept by a zero-element reference buffer, ``_{name}_ref``, registered
    on the owner; being a buffer, it follows ``module.to(...)``, ``.half()``, ``.to_empty(...)`` and the meta
    device like any other, and so does the value.

    Args:
        owner: the module the attribute belongs to. After construction ``owner.<name>`` is this object.
        name: the attribute's name on ``owner``.
        materializer: either the name of a method of ``owner``, called as ``method(dtype, device)`` and held
            without any reference to ``owner``, or a callable, held strongly and called as
            ``fn(owner, dtype, device)``.
        dtype: dtype of the value; torch's default dtype when ``None``.
        device: device of the value; torch's default device (including a ``with torch.device(...)`` context)
            when ``None``.
        persist: whether the reference buffer is in the owner's ``state_dict``. Settable later as
            :attr:`persist`.
        follow_dtype: whether the value's dtype follows the module's dtype conversions (``module.half()``,
            ``module.to(torch.float64)``, ...). The default is ``True`` for floating-point dtypes and ``False``
            otherwise. With ``False`` the dtype is fixed and only the device follows the module. Integer and
            bool dtypes are always fixed, as torch never converts such buffers either; complex dtypes are fixed
            by default, since ``module.to(torch.float16)`` would make a following complex value real.

    Raises:
        TypeError: ``owner`` is not a module, ``materializer`` is neither a string nor callable, names an
            attribute that is not a method, or ``dtype``/``device`` have the wrong type.
        AttributeError: ``materializer`` names no attribute of ``owner``.
        ValueError: ``name`` is not an identifier or clashes with an existing attribute, ``device`` is not a
            valid or available device, ``follow_dtype=True`` was asked for a non-floating dtype, or ``depends_on``
            names a modattrs attribute instead of a tensor (a ShapedTensor's data is ``_{name}_data``).

    When the attribute goes away (``del owner.<name>`` or assigning something else to the name), what it
    registered on the owner is removed.
    """

    __slots__ = (
        "_cache",
        "_depends_on",
        "_dtype",
        "_dtype_from",
        "_function",
        "_method",
        "_plain_ref",
        "_ref_name",
        "_ref_seen",
    )

    LinkedAttributes = VirtualTensorAttributes
    _suffixes = ("ref",)

    _method: str | None  # the method's name, for a string materializer
    _function: Materializer  # called as fn(owner, dtype, device); for a method, its underlying function
    _dtype: torch.dtype | None  # None: follow the reference's dtype; otherwise the fixed dtype
    _dtype_from: str | None  # the path of an owner's tensor whose dtype the value takes, at each read
    _cache: Cache | None  # the lasting cache, with cache=True
    _depends_on: tuple[str, ...]
    _ref_name: str
    _ref_seen: Tensor | None  # the last reference found empty: the hot path checks each reference once
    _plain_ref: Tensor | None  # _ref_seen, when value computes it by itself: plain, uncached, no dtype_from

    def __init__(
        self,
        owner: nn.Module,
        name: str,
        materializer: str | Materializer,
        dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        persist: bool = False,
        *,
        follow_dtype: bool | None = None,
        dtype_from: str | None = None,
        cache: bool = False,
        depends_on: Sequence[str] = (),
    ) -> None:
        owner, name = self._claim(owner, name)
        (ref_name,) = self._derived(name)
        method, function = _check_materializer(owner, name, materializer)
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise TypeError(f"VirtualTensor {name!r}: dtype must be a torch.dtype or None, got {dtype!r}")
        if dtype_from is not None:
            _check_dtype_from(owner, name, dtype_from, dtype, follow_dtype)
        depends_on = _check_depends_on(owner, name, depends_on)
        value_dtype = torch.get_default_dtype() if dtype is None else dtype
        follows = value_dtype.is_floating_point if follow_dtype is None else bool(follow_dtype)
        if follows and not _can_follow(value_dtype):
            raise ValueError(
                f"VirtualTensor {name!r}: a {value_dtype} value cannot follow the module's dtype.\n"
                "nn.Module conversions only change floating-point and complex tensors: pass follow_dtype=False"
            )
        ref_dtype = value_dtype if follows else torch.get_default_dtype()
        ref = _make_reference(name, ref_dtype, device)

        self._method = method
        self._function = function
        self._dtype = None if follows else value_dtype
        self._dtype_from = dtype_from
        self._depends_on = depends_on
        self._cache = Cache() if cache else None
        self._ref_name = ref_name
        self._ref_seen = self._plain_ref = None
        self._attach(owner, lambda: owner.register_buffer(ref_name, ref, persistent=bool(persist)))

    @classmethod
    def _registers(cls, tensor: Tensor | None) -> bool:
        return tensor is None or tensor.numel() == 0  # a reference is empty: one with elements is somebody else's

    @property
    def attributes(self) -> VirtualTensorAttributes:
        """Names of what this attribute registered on its owner."""
        return VirtualTensorAttributes(self._ref_name)

    @property
    def value(self) -> Tensor:
        """The materialized tensor, on the attribute's current dtype and device.

        The materializer is asked for that dtype and device; a result that has another one is converted.
        """
        if _dynamo_compiling():  # dynamo traces Python: the compiled read would be called, not traced
            return VirtualTensor._read(self)
        return _read(self)

    def _read(self) -> Tensor:
        """The value: what :attr:`value` means. ``modattrs._speedups.read`` does the same in C."""
        owner = self._owner_ref()
        if owner is None:
            raise self._owner_gone()
        ref = buffers_of(owner).get(self._ref_name)
        if ref is not None and ref is self._plain_ref and type(ref) is Tensor and not _cache.open_scopes:
            # The hot path: nothing kept, nothing to decide (see _compute, which sets _plain_ref). The class is
            # checked again: torch.utils.swap_tensors with a fake tensor makes the same object fake.
            dtype = self._dtype or ref.dtype  # dtypes are truthy: this reads "the fixed dtype, if any"
            if ref.is_cpu:  # the same test without making two device objects and comparing them
                result = self._function(owner, dtype, _CPU)
                if type(result) is Tensor and result.dtype is dtype and result.is_cpu:
                    return result
                return self._converted(result, dtype, _CPU)
            device = ref.device
            result = self._function(owner, dtype, device)
            if type(result) is Tensor and result.dtype is dtype and result.device == device:
                return result
            return self._converted(result, dtype, device)
        return _cache.read(self, owner, ref)

    def _compute(self, owner: nn.Module, ref: Tensor) -> Tensor:
        dtype = self._value_dtype(owner, ref)
        device = ref.device
        if ref is not self._ref_seen:  # the reference changed: make sure it is one, not a namesake's tensor
            if ref.numel():
                raise self._reference_taken(owner, ref)
            if not torch.compiler.is_compiling():  # a side effect that export would refuse
                self._ref_seen = ref
                # value computes an uncached attribute with a plain reference by itself from now on; dtype_from
                # is left to _compute, which reads the dtype.
                plain = type(ref) is Tensor and self._cache is None and self._dtype_from is None
                self._plain_ref = ref if plain else None
        result = self._function(owner, dtype, device)
        # The common case in one test: a plain tensor (isinstance is dearer) of the dtype (singletons: `is` is
        # exact) and device (dearer to compare, so last) asked for.
        if type(result) is Tensor and result.dtype is dtype and result.device == device:
            return result
        return self._converted(result, dtype, device)

    def _converted(self, result: object, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The materializer's ``result``, checked to be a tensor and converted to ``dtype`` and ``device``."""
        if not isinstance(result, Tensor):
            raise TypeError(
                f"the materializer of VirtualTensor {self._name!r} returned {type(result).__name__}, expected a "
                f"Tensor\nmaterializer: {self._materializer_name()}"
            )
        if result.dtype is not dtype or result.device != device:
            result = result.to(device=device, dtype=dtype)
        return result

    def _value_dtype(self, owner: nn.Module, ref: Tensor) -> torch.dtype:
        """The dtype of the value for a read of ``ref``: fixed, taken from ``dtype_from``, or the reference's."""
        if self._dtype_from is not None:
            return _tensor_at(owner, self._dtype_from).dtype
        return self._dtype or ref.dtype

    @property
    def cached(self) -> bool:
        """Whether the attribute keeps its last value (``cache=True``)."""
        return self._cache is not None

    @property
    def depends_on(self) -> tuple[str, ...]:
        """Names of the owner's attributes whose changes invalidate cached values."""
        return self._depends_on

    def invalidate(self) -> None:
        """Forget the cached value, in the lasting cache and in this thread's ``modattrs.cached()`` scope."""
        self._live_owner()
        self._forget()

    def _forget(self) -> None:
        if self._cache is not None:
            self._cache.clear()
        scope = _cache.scope()
        if scope is not None:
            scope.pop(id(self), None)

    @property
    def dtype(self) -> torch.dtype:
        """Data type of the value. Setting it is ``self.to(dtype=...)``."""
        if self._dtype_from is not None:
            return _tensor_at(self._live_owner(), self._dtype_from).dtype
        if self._dtype is not None:
            return self._dtype
        return self._reference().dtype

    @dtype.setter
    def dtype(self, dtype: torch.dtype) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"VirtualTensor {self._name!r}: dtype must be a torch.dtype, got {dtype!r}")
        self.to(dtype=dtype)

    @property
    def device(self) -> torch.device:
        """Device of the value. Setting it is ``self.to(device=...)``."""
        return self._reference().device

    @device.setter
    def device(self, device: torch.device | str | int) -> None:
        self.to(device=_check_device(self._name, device))

    @property
    def follow_dtype(self) -> bool:
        """Whether the value's dtype follows the module's dtype conversions.

        Setting it to ``False`` fixes the current dtype; setting it to ``True`` makes the current dtype the
        starting point that conversions change (it must then be floating-point or complex).
        """
        return self._dtype is None and self._dtype_from is None

    @follow_dtype.setter
    def follow_dtype(self, follow: bool) -> None:
        with self._lock:
            self._set_follow_dtype(bool(follow))

    def _set_follow_dtype(self, follow: bool) -> None:
        owner = self._live_owner()
        ref = self._reference(owner)
        self._refuse_dtype_change()
        if follow and self._dtype is not None:
            if not _can_follow(self._dtype):
                raise ValueError(
                    f"VirtualTensor {self._name!r}: a {self._dtype} value cannot follow the module's dtype; "
                    "set a floating-point dtype first"
                )
            buffers_of(owner)[self._ref_name] = _make_reference(self._name, self._dtype, ref.device, like=ref)
            self._dtype = None
        elif not follow and self._dtype is None:
            self._dtype = ref.dtype
        self.invalidate()

    @property
    def persist(self) -> bool:
        """Whether the reference buffer is in the owner's ``state_dict``; settable at any time."""
        return self._ref_name not in non_persistent_buffers_of(self._live_owner())

    @persist.setter
    def persist(self, persist: bool) -> None:
        with self._lock:
            owner = self._live_owner()
            self._reference(owner)  # raises if it is gone
            set_persistent(owner, self._ref_name, persist)

    def to(self, *args: Any, **kwargs: Any) -> VirtualTensor:
        """Change the dtype and/or device; accepts the arguments of :meth:`torch.Tensor.to`. Returns ``self``.

        ``non_blocking``, ``copy`` and ``memory_format`` are accepted and have no effect: there is no data to move.
        """
        with self._lock:
            return self._to(*args, **kwargs)

    def _to(self, *args: Any, **kwargs: Any) -> VirtualTensor:
        owner = self._live_owner()
        ref = self._reference(owner)
        kwargs.pop("copy", None)
        try:
            device, dtype, _, _ = parse_to(*args, **kwargs)
        except (TypeError, RuntimeError) as error:
            raise type(error)(f"VirtualTensor {self._name!r}: invalid arguments for to(): {error}") from None
        if dtype is not None:
            self._refuse_dtype_change()
        device = ref.device if device is None else device
        dtype = (self._dtype or ref.dtype) if dtype is None else dtype  # not dtype_from's: it is read at each value
        if self._dtype is None and not _can_follow(dtype):
            raise ValueError(
                f"VirtualTensor {self._name!r} follows the module's dtype, which must be floating-point or "
                f"complex, got {dtype}.\nSet follow_dtype = False first to fix a non-floating dtype"
            )
        ref_dtype = dtype if self._dtype is None else ref.dtype
        if ref.device != device or ref.dtype != ref_dtype:
            # A new empty reference rather than ref.to(): a meta reference has no data to copy.
            buffers_of(owner)[self._ref_name] = _make_reference(self._name, ref_dtype, device, like=ref)
        if self._dtype is not None and self._dtype is not dtype:
            self._dtype = dtype
            self.invalidate()
        return self

    @property
    def dtype_from(self) -> str | None:
        """The owner's tensor whose dtype the value takes at each read, if the attribute was created so."""
        return self._dtype_from

    def _refuse_dtype_change(self) -> None:
        if self._dtype_from is not None:
            raise ValueError(
                f"VirtualTensor {self._name!r} takes its dtype from {self._dtype_from!r}; change that tensor's "
                "dtype, or create the attribute without dtype_from"
            )

    def _fields(self) -> dict[str, Any]:
        fields = super()._fields()
        fields["_ref_seen"] = fields["_plain_ref"] = None
        if self._method is not None:
            fields["_function"] = None  # looked up again on the owner's class: nothing to pickle but a name
        return fields

    def _rebind(self, owner: nn.Module) -> None:
        # The owner may still be empty (being unpickled): its class is all there is to check, as at construction.
        if self._method is not None:
            try:
                self._function = _method_function(type(owner), self._name, self._method)
            except (AttributeError, TypeError) as error:
                raise type(error)(f"cannot rebuild VirtualTensor {self._name!r}: {error}") from None

    def _on_load(
        self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str], assign: bool
    ) -> None:
        # The reference holds no data, so its key is tolerated both ways: a checkpoint saved with persist=True
        # loads into a module that does not persist it, and one without the key (saved with persist=False, or
        # before the attribute existed) loads into a module that does.
        key = prefix + self._ref_name
        ref = buffers_of(owner).get(self._ref_name)
        if ref is None:
            return
        if ref.numel():
            error_msgs.append(load_error(prefix + self._name, str(self._reference_taken(owner, ref))))
            return
        incoming = state_dict.get(key)
        if isinstance(incoming, Tensor) and incoming.numel():
            # In swap mode the load would swap it into the reference object, which the hot path knows as checked.
            error_msgs.append(
                load_error(
                    key,
                    f"VirtualTensor {self._name!r} keeps its dtype and device in this empty buffer, and the "
                    f"checkpoint has a tensor of {incoming.numel()} elements under its name.\n"
                    "It was not saved by modattrs: rename that key",
                )
            )
            state_dict[key] = ref  # the load fails; meanwhile torch copies this key onto itself
            return
        if not self.persist:
            state_dict.pop(key, None)
        elif not isinstance(incoming, Tensor):
            state_dict.setdefault(key, ref)
        elif self._dtype is None and not _can_follow(incoming.dtype):
            # A dtype this attribute cannot follow (an integer one): it keeps its own, and takes the device.
            state_dict[key] = incoming.new_empty(0, dtype=ref.dtype)

    def _on_state_dict(self, owner: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        ref = buffers_of(owner).get(self._ref_name)
        if ref is not None and ref.numel():
            raise self._reference_taken(owner, ref)

    def _on_loaded(self, owner: nn.Module) -> None:
        with self._lock:
            # In swap mode (torch.__future__.set_swap_module_params_on_conversion) the load swapped the
            # reference's contents, dtype and device included, into the same object, and its class: a fake
            # checkpoint's reference makes it fake, which the hot path must not take for the plain one it checked.
            self._forget()
            self._ref_seen = self._plain_ref = None
            self._follow_loaded_data(owner)

    def _follow_loaded_data(self, owner: nn.Module) -> None:
        # load_state_dict(assign=True) into a meta-built or fake-built module replaces parameters and persistent
        # buffers but leaves a non-persistent reference on meta or fake, and may assign a persisted reference of
        # any dtype. Put the reference where the loaded data is, real.
        ref = buffers_of(owner).get(self._ref_name)
        if ref is None or ref.numel():
            return
        follows = self._dtype is None
        elsewhere = without_data(ref)
        if not elsewhere and not (follows and not _can_follow(ref.dtype)):
            return
        loaded = _first_real_floating_tensor(owner)
        if loaded is not None:
            self._rebase(owner, loaded.device if elsewhere else ref.device, loaded.dtype)

    def _rebase(self, owner: nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
        """A new, real reference on ``device``, of ``dtype`` if the attribute follows the module's dtype (and
        ``dtype`` is given), of the reference's dtype otherwise; a meta or fake reference has no data to move."""
        ref = self._reference(owner)
        ref_dtype = dtype if self.follow_dtype and dtype is not None else ref.dtype
        buffers_of(owner)[self._ref_name] = _make_reference(self._name, ref_dtype, device)
        self._forget()

    def __repr__(self) -> str:
        return f"VirtualTensor(name={self._name!r}, materializer={self._materializer_name()}, {self._where()})"

    def _reference(self, owner: nn.Module | None = None) -> Tensor:
        """The reference buffer, of ``owner`` when the caller has looked it up already."""
        owner = self._live_owner() if owner is None else owner
        ref = buffers_of(owner).get(self._ref_name)
        if ref is None:
            raise self._reference_gone()
        if ref.numel():
            raise self._reference_taken(owner, ref)
        return ref

    def _reference_taken(self, owner: nn.Module, ref: Tensor) -> RuntimeError:
        # Changing the attribute would replace that tensor by an empty one, and a load would consume its key.
        return RuntimeError(
            f"VirtualTensor {self._name!r} keeps its dtype and device in an empty buffer, {self._ref_name!r}, and "
            f"{type(owner).__name__} now has a tensor of {ref.numel()} elements under that name.\n"
            "That tensor was registered or assigned after the attribute: register it under another name"
        )

    def _reference_gone(self) -> RuntimeError:
        return RuntimeError(
            f"VirtualTensor {self._name!r} lost its reference buffer {self._ref_name!r}: it was deleted from or "
            "set to None on the module; create the VirtualTensor again"
        )

    def _materializer_name(self) -> str:
        if self._method is not None:
            return repr(self._method)
        return callable_name(self._function)


#: What :attr:`VirtualTensor.value` calls outside dynamo: ``VirtualTensor._read``, compiled when it could be built.
_read: Callable[[VirtualTensor], Tensor] = VirtualTensor._read
if _speedups is not None:
    try:
        _speedups.bind(VirtualTensor, BUFFER_TABLE, _cache)
    except (TypeError, AttributeError) as error:  # a build of another version, left in a checkout
        raise stale_build(_speedups) from error
    _read = _speedups.read


def _check_materializer(owner: nn.Module, name: str, materializer: object) -> tuple[str | None, Materializer]:
    """Return the method name (for a string) and a function called as ``fn(owner, dtype, device)``."""
    if isinstance(materializer, str):
        try:
            found = getattr(owner, materializer)
        except AttributeError:
            raise AttributeError(
                f"VirtualTensor {name!r}: {type(owner).__name__} has no attribute {materializer!r} to use as "
                "its materializer"
            ) from None
        if not isinstance(found, types.MethodType) or found.__self__ is not owner:
            # What the name is, unbound: a staticmethod, a classmethod, an instance attribute, a parameter, ...
            raise TypeError(
                _not_a_method(type(owner), name, materializer, inspect.getattr_static(owner, materializer, found))
            )
        return materializer, _method_function(type(owner), name, materializer)
    if not callable(materializer):
        raise TypeError(
            f"VirtualTensor {name!r}: materializer must be a method name or a callable fn(owner, dtype, device), "
            f"got {type(materializer).__name__}"
        )
    if isinstance(materializer, types.MethodType) and materializer.__self__ is owner:
        raise TypeError(
            f"VirtualTensor {name!r}: pass the bound method's name, {materializer.__name__!r}, not the method "
            "itself.\nThe method would be called with the owner twice and would keep the owner alive"
        )
    return None, materializer


def _method_function(cls: type[nn.Module], name: str, method: str) -> Materializer:
    """The plain function that ``method`` names in ``cls``, called with the owner: no bound method, hence no
    reference to the owner, and nothing that torch.compile cannot trace (weakref.WeakMethod is such a thing).

    Construction and rebuilding a copy or a pickle both check through this: a staticmethod, a classmethod or any
    other kind of attribute is refused.
    """
    found = inspect.getattr_static(cls, method, None)
    if found is None:
        raise AttributeError(f"{cls.__name__} has no method {method!r} to use as the materializer of {name!r}")
    if not isinstance(found, types.FunctionType):
        raise TypeError(_not_a_method(cls, name, method, found))
    function: Materializer = found
    return function


def _not_a_method(cls: type[nn.Module], name: str, method: str, found: object) -> str:
    return (
        f"VirtualTensor {name!r}: the materializer {method!r} must name a method of {cls.__name__}, got "
        f"{type(found).__name__}.\nPass a callable fn(owner, dtype, device) instead"
    )


def _check_depends_on(owner: nn.Module, name: str, depends_on: object) -> tuple[str, ...]:
    if isinstance(depends_on, str) or not isinstance(depends_on, Sequence):
        raise TypeError(f"VirtualTensor {name!r}: depends_on must be a sequence of attribute names, got {depends_on!r}")
    for dependency in depends_on:
        if not isinstance(dependency, str):
            raise TypeError(f"VirtualTensor {name!r}: depends_on must name attributes, got {dependency!r}")
        tables = (parameters_of(owner), buffers_of(owner), submodules_of(owner), owner.__dict__)
        if not any(dependency in table for table in tables):
            raise AttributeError(
                f"VirtualTensor {name!r}: depends_on names {dependency!r}, which is not a parameter, buffer, "
                f"submodule or instance attribute of {type(owner).__name__}"
            )
        attribute = owner.__dict__.get(dependency)
        if isinstance(attribute, OwnedAttribute):  # the same object whatever its value does: never a change
            raise ValueError(
                f"VirtualTensor {name!r}: depends_on names {dependency!r}, a {type(attribute).__name__}, which stays "
                f"the same object when its value changes; {attribute.dependency_hint()}"
            )
    return tuple(depends_on)


def _check_dtype_from(
    owner: nn.Module, name: str, path: object, dtype: torch.dtype | None, follow_dtype: bool | None
) -> None:
    if not isinstance(path, str):
        raise TypeError(f"VirtualTensor {name!r}: dtype_from must be a str naming a tensor of the owner, got {path!r}")
    if dtype is not None or follow_dtype is not None:
        raise ValueError(
            f"VirtualTensor {name!r}: dtype_from={path!r} decides the dtype; do not pass dtype or follow_dtype with it"
        )
    try:
        _tensor_at(owner, path)
    except (AttributeError, TypeError) as error:
        raise type(error)(f"VirtualTensor {name!r}: dtype_from={path!r}: {error}") from None


def _tensor_at(owner: nn.Module, path: str) -> Tensor:
    target: object = owner
    for part in path.split("."):
        target = getattr(target, part)
    if not isinstance(target, Tensor):
        raise TypeError(f"{path!r} is a {type(target).__name__}, not a tensor")
    return target


def _check_device(name: str, device: object) -> torch.device:
    return as_device(device, f"VirtualTensor {name!r}")


def _make_reference(name: str, dtype: torch.dtype, device: object, like: Tensor | None = None) -> Tensor:
    """A zero-element reference; ``like`` makes it through that tensor, so a fake reference begets a fake one."""
    checked = None if device is None else _check_device(name, device)
    try:
        if like is not None:
            return like.new_empty(0, dtype=dtype, device=checked)
        return torch.empty(0, dtype=dtype, device=checked)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"VirtualTensor {name!r}: cannot use device {checked}: {error}") from None


def sync_references(
    module: nn.Module, device: torch.device | str | int | None = None, dtype: torch.dtype | None = None
) -> None:
    """Move every :class:`VirtualTensor` reference in ``module`` that is on the meta device to where the data is,
    and make real every fake reference in a part of ``module`` that holds real data (a loaded block of a model
    built in fake mode; blocks still fake keep theirs).

    ``load_state_dict(state, assign=True)`` into a model built on the meta device (or in fake mode) replaces its
    parameters and persistent buffers, and leaves non-persistent buffers, references included, on meta (or fake).
    An attribute whose owner holds parameters or buffers moves its reference by itself after such a load; one whose
    owner holds none (a rotary-embedding module, say) cannot know where the rest of the model went. This function
    does it for the whole model: the device and, for attributes that follow the module's dtype, the dtype are
    ``device`` and ``dtype`` when given, and otherwise those of the first floating-point tensor with data in
    ``module``.

    Raises:
        ValueError: a reference is on meta, no ``device`` was given and ``module`` has no tensor with data.
    """
    loaded = _first_real_floating_tensor(module)
    pending = [
        attribute
        for submodule, holds_real_data in _holding_real_data(module)
        for attribute in own_attributes(submodule)
        if isinstance(attribute, VirtualTensor) and _needs_rebase(attribute._reference(), holds_real_data)
    ]
    if not pending:
        return
    if device is None or dtype is None:
        if loaded is None and device is None:
            raise ValueError(
                f"cannot move {len(pending)} VirtualTensor reference(s) off the meta device: "
                f"{type(module).__name__} holds no tensor with data to take the device from; pass device="
            )
        device = loaded.device if device is None and loaded is not None else device
        dtype = loaded.dtype if dtype is None and loaded is not None else dtype
    if dtype is not None and not _can_follow(dtype) and any(attribute.follow_dtype for attribute in pending):
        raise ValueError(
            f"sync_references: VirtualTensors follow the module's dtype, which must be floating-point or complex, "
            f"got {dtype}.\nPass a floating dtype, or dtype=None to keep theirs"
        )
    target = as_device(device, "sync_references")
    for attribute in pending:
        with attribute._lock:
            attribute._rebase(attribute._live_owner(), target, dtype)


def _holding_real_data(module: nn.Module) -> Iterator[tuple[nn.Module, bool]]:
    """Each submodule of ``module``, and whether it holds real data: the floating-point tensors with elements of its
    subtree are all real (neither fake nor meta), and there is one. A submodule whose subtree holds none (a rotary
    module) takes its parent's answer. A model loaded block by block has blocks that are still fake: their
    references stay fake."""
    kinds: dict[int, tuple[bool, bool]] = {}  # id of a module -> its subtree holds real data, fake or meta data

    def gather(node: nn.Module) -> tuple[bool, bool]:
        if id(node) in kinds:  # shared, or being gathered
            return kinds[id(node)]
        kinds[id(node)] = (False, False)
        real = fake = False
        for tensor in itertools.chain(parameters_of(node).values(), buffers_of(node).values()):
            if tensor is not None and tensor.is_floating_point() and tensor.numel():
                if without_data(tensor):
                    fake = True
                else:
                    real = True
        for child in submodules_of(node).values():
            if child is not None:
                child_real, child_fake = gather(child)
                real, fake = real or child_real, fake or child_fake
        kinds[id(node)] = (real, fake)
        return real, fake

    gather(module)
    answers: dict[str, bool] = {}
    for prefix, submodule in module.named_modules():
        real, fake = kinds[id(submodule)]
        if real or fake:
            answers[prefix] = real and not fake
        else:
            answers[prefix] = answers.get(prefix.rpartition(".")[0], False) if prefix else False
        yield submodule, answers[prefix]


def _first_real_floating_tensor(module: nn.Module) -> Tensor | None:
    """The first floating-point tensor with data of ``module`` (neither meta nor fake): parameters first (its own,
    then its children's), then buffers."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point() and tensor.numel() and not without_data(tensor):
            return tensor
    return None


def _needs_rebase(ref: Tensor, holds_real_data: bool) -> bool:
    """For sync_references: a reference on meta, or a fake one where the module part holds real data."""
    return ref.is_meta or (holds_real_data and isinstance(ref, FakeTensor))


def _can_follow(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex
