"""``ShapedTensor``: a buffer or parameter whose sizes along some dimensions are fixed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import increment_version

from modattrs._attribute import OwnedAttribute, set_persistent, stored_tensor
from modattrs._module_tensors import parameter_like, without_data
from modattrs._names import load_error
from modattrs._torch_private import FakeTensor, buffers_of, non_persistent_buffers_of, parameters_of

__all__ = ["ShapedTensor"]

Constraints = dict[int, int]

#: Constrained dims lie in ``[-MAX_DIMS, MAX_DIMS)``; sizes in ``[0, MAX_SIZE]``. Checkpoints are held to the same
#: bounds: the saved form of the constraints is as wide as the largest dim.
MAX_DIMS = 64
MAX_SIZE = 2**63 - 1

_UNINITIALIZED = (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)


class ShapedTensorAttributes(NamedTuple):
    """Names that a :class:`ShapedTensor` registers on its owner."""

    #: The buffer or parameter holding the data, ``_{name}_data``.
    data: str
    #: The ``state_dict`` key (after the module's prefix) of the constraints, ``_{name}_constraints``.
    constraints: str


class ShapedTensor(OwnedAttribute):
    """A buffer or parameter attribute whose size along some dimensions is fixed.

    Constraints map a dimension to its required size, ``{1: 64, -1: 3}``: dim 1 must have 64 elements and the
    last dim 3, the others are free. Negative dims count from the end. The data is registered on the owner as
    ``_{name}_data``, a buffer or, when ``value`` is an ``nn.Parameter``, a parameter; it follows
    ``module.to(...)`` like any other.

    Args:
        owner: the module the attribute belongs to. After construction ``owner.<name>`` is this object.
        name: the attribute's name on ``owner``.
        value: the initial data: a tensor, a parameter, or ``None``.
        constraints: ``{dim: size}``; no constraint when ``None``.
        persist_data: whether buffer data is in the owner's ``state_dict`` (parameters always are).
        persist_constraints: whether the constraints are in the owner's ``state_dict`` and restored by
            ``load_state_dict``.
        strict: whether a non-negative and a negative dim must name different axes (``{0: 2, -1: 3}`` then
            needs at least two dims). Without it they may name the same axis, and must then agree.
        live: whether assigning to :attr:`value` checks the constraints.

    Raises:
        TypeError: ``owner`` is not a module, ``value`` is not a tensor or ``None``, or the constraints are
            not ``{int: int}``.
        ValueError: ``name`` is not an identifier or clashes with an existing attribute, a size is negative,
            ``value`` violates the constraints, or ``persist_data=False`` was given with a parameter.

    Values that are never checked ("ignored"): ``None``, uninitialized parameters and buffers, and tensors with
    no element and at most one dim, such as ``torch.empty(0)``.
    """

    __slots__ = ("_constraints", "_constraints_key", "_data_name", "_live", "_persist_constraints", "_strict")

    LinkedAttributes = ShapedTensorAttributes
    _suffixes = ("data",)
    _key_suffixes = ("constraints",)

    _constraints: Constraints
    _data_name: str
    _constraints_key: str
    _strict: bool
    _live: bool
    _persist_constraints: bool

    def __init__(
        self,
        owner: nn.Module,
        name: str,
        value: Tensor | None,
        constraints: Mapping[int, int] | None = None,
        persist_data: bool = True,
        persist_constraints: bool = False,
        strict: bool = True,
        live: bool = False,
    ) -> None:
        owner, name = self._claim(owner, name)
        checked = _check_constraints(name, {} if constraints is None else constraints)
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"ShapedTensor {name!r}: value must be a Tensor or None, got {type(value).__name__}")
        if value is not None and not _ignored(value) and not _satisfies(value.shape, checked, bool(strict)):
            raise ValueError(_mismatch(name, value.shape, checked, bool(strict)))
        is_parameter = isinstance(value, nn.Parameter)
        if is_parameter and not persist_data:
            raise ValueError(
                f"ShapedTensor {name!r}: persist_data=False cannot hold for a parameter, which is always in the "
                "state_dict.\nPass a plain tensor to store the data as a non-persistent buffer"
            )

        self._data_name, self._constraints_key = self._reserved(name)
        self._constraints = checked
        self._strict = bool(strict)
        self._live = bool(live)
        self._persist_constraints = bool(persist_constraints)
        if is_parameter:
            self._attach(owner, lambda: owner.register_parameter(self._data_name, value))  # type: ignore[arg-type]
        else:
            self._attach(owner, lambda: owner.register_buffer(self._data_name, value, persistent=bool(persist_data)))

    @property
    def attributes(self) -> ShapedTensorAttributes:
        """Names of what this attribute registered on its owner."""
        return ShapedTensorAttributes(self._data_name, self._constraints_key)

    @property
    def value(self) -> Tensor | None:
        """The stored data.

        Assigning checks the constraints when :attr:`live` is set. A plain tensor assigned to parameter-backed
        data replaces the parameter's ``.data``, so the ``Parameter`` object (and an optimizer holding it) stays.
        """
        return stored_tensor(self._live_owner(), self._data_name)

    @value.setter
    def value(self, value: Tensor | None) -> None:
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"ShapedTensor {self._name!r}: value must be a Tensor or None, got {type(value).__name__}")
        with self._lock:
            owner = self._live_owner()
            if self._live and value is not None and not _ignored(value) and not self.compatible(value):
                raise ValueError(_mismatch(self._name, value.shape, self._constraints, self._strict))
            self._store(owner, value)

    @property
    def constraints(self) -> Constraints:
        """A copy of the constraints, ``{dim: size}``."""
        return dict(self._constraints)

    @property
    def dimensionality(self) -> int:
        """The least number of dims that a tensor needs to satisfy the constraints."""
        return _dimensionality(self._constraints, self._strict)

    @property
    def ignored(self) -> bool:
        """Whether the current value is one that constraints do not apply to (``None``, empty, uninitialized)."""
        return _ignored(self.value)

    @property
    def valid(self) -> bool:
        """Whether the owner is alive and the value is ignored or satisfies the constraints."""
        if self._owner_ref() is None:
            return False
        value = self.value
        return value is None or _ignored(value) or self.compatible(value)

    @property
    def live(self) -> bool:
        """Whether assignments to :attr:`value` are checked against the constraints."""
        return self._live

    @live.setter
    def live(self, live: bool) -> None:
        with self._lock:
            self._live_owner()
            self._live = bool(live)

    @property
    def strict(self) -> bool:
        """Whether a non-negative and a negative dim must name different axes."""
        return self._strict

    @strict.setter
    def strict(self, strict: bool) -> None:
        strict = bool(strict)
        with self._lock:
            value = self.value
            if (
                value is not None
                and not _ignored(value)
                and self.compatible(value)
                and not _satisfies(value.shape, self._constraints, strict)
            ):
                raise ValueError(
                    f"cannot make ShapedTensor {self._name!r} {'strict' if strict else 'non-strict'}: its data's "
                    + _violation(value.shape, self._constraints, strict)
                )
            self._strict = strict

    @property
    def persist_data(self) -> bool:
        """Whether the data is in the owner's ``state_dict``; settable for buffer data."""
        owner = self._live_owner()
        return self._data_name not in non_persistent_buffers_of(owner)

    @persist_data.setter
    def persist_data(self, persist: bool) -> None:
        with self._lock:
            owner = self._live_owner()
            if self._data_name in parameters_of(owner):
                if not persist:
                    raise ValueError(f"ShapedTensor {self._name!r}: parameter data is always in the state_dict")
                return
            set_persistent(owner, self._data_name, persist)

    @property
    def persist_constraints(self) -> bool:
        """Whether the constraints are in the owner's ``state_dict``; settable."""
        return self._persist_constraints

    @persist_constraints.setter
    def persist_constraints(self, persist: bool) -> None:
        with self._lock:
            self._live_owner()
            self._persist_constraints = bool(persist)

    def dependency_hint(self) -> str:
        return f"name its data, {self.attributes.data!r}"

    def compatible(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s shape satisfies the constraints (ignored values are not special here)."""
        return _satisfies(tensor.shape, self._constraints, self._strict)

    def reconstrain(self, dim: int, size: int | None) -> Tensor | None:
        """Add, change or (with ``size=None``) remove the constraint on ``dim``, and return the value.

        When the data's size along ``dim`` differs from ``size`` it is resized along that dim: shrinking keeps
        the last elements, growing pads zeros at the head (see :meth:`resize`). Parameter data is resized
        through ``.data``, keeping the ``Parameter`` object.

        Raises:
            TypeError: ``dim`` or ``size`` is not an int.
            ValueError: ``size`` is negative, ``dim`` is not constrained (removal), the data has too few dims,
                or the result would still violate another constraint. Nothing is changed then.
        """
        dim = _check_int(self._name, "dim", dim)
        with self._lock:  # read, resize and store as one step: another thread's resize in between would be lost
            owner = self._live_owner()
            constraints = dict(self._constraints)
            if size is None:
                if dim not in constraints:
                    raise ValueError(
                        f"ShapedTensor {self._name!r}: dim {dim} is not constrained, so there is nothing to "
                        f"remove; constrained dims: {sorted(constraints)}"
                    )
                del constraints[dim]
            else:
                constraints[_check_dim(self._name, dim)] = _check_size(self._name, dim, size)
            value = self.value
            if _ignored(value):
                self._constraints = constraints
                return value
            assert value is not None
            needed = _dimensionality(constraints, self._strict)
            if size is not None and value.dim() < needed:
                raise ValueError(
                    f"ShapedTensor {self._name!r}: constraining dim {dim} needs at least {needed} dims, but the "
                    f"data has shape {tuple(value.shape)}"
                )
            resized = value if size is None else self.resize(value, dim, size)
            if not _satisfies(resized.shape, constraints, self._strict):
                raise ValueError(_mismatch(self._name, resized.shape, constraints, self._strict))
            if resized is not value:
                self._store(owner, resized)
            self._constraints = constraints
            return self.value

    @staticmethod
    def resize(tensor: Tensor, dim: int, size: int, preserve_tail: bool = True, fill: Any = 0) -> Tensor:
        """Return ``tensor`` with ``size`` elements along ``dim``.

        With ``preserve_tail`` a shrink keeps the last elements and a grow pads ``fill`` at the head; without
        it, the first elements are kept and the padding goes at the end. ``tensor`` itself is returned when it
        has the size already; otherwise a new tensor (never a ``Parameter``) of the same dtype and device,
        computed without autograd. ``tensor`` is not modified.
        """
        if not -tensor.dim() <= dim < tensor.dim():
            raise IndexError(f"dim {dim} is out of range for a tensor of shape {tuple(tensor.shape)}")
        if size < 0:
            raise ValueError(f"size must be non-negative, got {size}")
        old = tensor.shape[dim]
        if old == size:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = size
        kept = min(old, size)
        with torch.no_grad():
            out = tensor.new_empty(shape)
            if preserve_tail:
                out.narrow(dim, size - kept, kept).copy_(tensor.narrow(dim, old - kept, kept))
                padding = out.narrow(dim, 0, size - kept)
            else:
                out.narrow(dim, 0, kept).copy_(tensor.narrow(dim, 0, kept))
                padding = out.narrow(dim, kept, size - kept)
            if padding.numel():
                padding.fill_(fill)
        return out

    def __repr__(self) -> str:
        return f"ShapedTensor(name={self._name!r}, constraints={self._constraints}, {self._where()})"

    def _store(self, owner: nn.Module, value: Tensor | None) -> None:
        name = self._data_name
        if name in parameters_of(owner) and isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
            current = parameters_of(owner)[name]
            if current is None or isinstance(current, _UNINITIALIZED):
                value = nn.Parameter(value)  # the data stays a parameter
            elif isinstance(value, FakeTensor) is not isinstance(current, FakeTensor):
                # `.data =` keeps a parameter real or fake: a real one given a fake's data ends up on the meta
                # device. A parameter of the value's kind takes its place, as a buffer would be replaced.
                value = parameter_like(value, current)
            else:
                reshaped = current.shape != value.shape
                current.data = value  # first: it raises for data a parameter cannot hold, with nothing changed
                if not current.is_inference():  # (inference data has no version counter: nothing to bump)
                    # `.data =` keeps the version counter. Cached VirtualTensors depending on the parameter see new
                    # memory by themselves; the bump is how they see data that shares the old (a view of it).
                    increment_version(current)
                if reshaped:
                    current.grad = None  # a gradient of the old shape would break the next backward or step
                return
        setattr(owner, name, value)

    def _on_state_dict(self, owner: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        if self._persist_constraints:
            self._refuse_a_namesake(owner)
            state_dict[prefix + self._constraints_key] = _encode(
                self._constraints, stored_tensor(owner, self._data_name)
            )

    def _on_load(
        self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str], assign: bool
    ) -> None:
        with self._lock:
            self._load(owner, state_dict, prefix, error_msgs, assign)

    def _load(
        self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str], assign: bool
    ) -> None:
        data_key, constraints_key = prefix + self._data_name, prefix + self._constraints_key
        current = stored_tensor(owner, self._data_name)
        if _occupied_by_tensor(owner, self._constraints_key):
            # The key is a namesake's, registered after this attribute: it is left to torch to load.
            if self._persist_constraints:
                error_msgs.append(load_error(prefix + self._name, self._namesake_message(owner)))
                self._keep_data(state_dict, data_key, current)
                return
            saved = None
        else:
            # Saved constraints are consumed in any case, so that switching persist_constraints never breaks a
            # strict load; they replace the current ones only when this attribute persists them, and can be read:
            # a checkpoint loaded with map_location="meta" (or in fake mode) has no values, so the current ones stay.
            saved = state_dict.pop(constraints_key, None)
        constraints = self._constraints
        if saved is not None and self._persist_constraints and _readable(saved):
            try:
                constraints = _check_constraints(self._name, _decode(saved))
            except (TypeError, ValueError) as error:
                error_msgs.append(f"invalid constraints for {prefix}{self._name}: {error}")
                self._keep_data(state_dict, data_key, current)
                return
        persistent = self._data_name not in non_persistent_buffers_of(owner)
        loaded = state_dict.get(data_key) if persistent else None
        if not isinstance(loaded, Tensor) and constraints is self._constraints:
            return  # nothing of this attribute changes: its current data is not this load's business
        if isinstance(loaded, Tensor) and without_data(loaded) and not assign and not without_data(current):
            # torch cannot copy it, and would fail after the constraints were taken: refuse it first.
            error_msgs.append(
                load_error(
                    data_key,
                    f"cannot load the saved data: it has no values ({_where(loaded)}) to copy into the module's "
                    "data.\nLoad with assign=True, or load a checkpoint with values",
                )
            )
            self._keep_data(state_dict, data_key, current)
            return
        incoming = loaded if isinstance(loaded, Tensor) else current  # what the data will be after the load
        if (
            incoming is not None
            and not _ignored(incoming)
            and not _satisfies(incoming.shape, constraints, self._strict)
        ):
            error_msgs.append(
                f"{prefix}{self._name}: {_mismatch(self._name, incoming.shape, constraints, self._strict)}"
            )
            self._keep_data(state_dict, data_key, current)
            return
        if isinstance(loaded, Tensor) and (
            current is None or isinstance(current, _UNINITIALIZED) or current.shape != loaded.shape
        ):
            # torch copies into the existing tensor and refuses another shape, or skips None: put a tensor of the
            # loaded shape, holding the loaded values, in place first (a failed copy leaves nothing behind).
            try:
                with torch.no_grad():
                    template = loaded if current is None else current
                    replacement = torch.empty(loaded.shape, dtype=template.dtype, device=template.device)
                    replacement.copy_(loaded)
            except (RuntimeError, NotImplementedError) as error:
                error_msgs.append(f"{data_key}: cannot load the saved data: {error}")
                self._keep_data(state_dict, data_key, current)
                return
            self._store(owner, replacement)
        self._constraints = constraints

    def _refuse_a_namesake(self, owner: nn.Module) -> None:
        if _occupied_by_tensor(owner, self._constraints_key):
            raise RuntimeError(self._namesake_message(owner))

    def _namesake_message(self, owner: nn.Module) -> str:
        return (
            f"ShapedTensor {self._name!r} saves its constraints under the state_dict key {self._constraints_key!r}, "
            f"and {type(owner).__name__} has a tensor of that name.\n"
            "That tensor was registered after the attribute, and one of them would be lost.\n"
            "Register that tensor under another name, or set persist_constraints = False"
        )

    @staticmethod
    def _keep_data(state_dict: dict[str, Any], key: str, current: Tensor | None) -> None:
        # The load fails (error_msgs), but torch still copies every key it can: make this one a copy onto itself.
        if current is None or isinstance(current, _UNINITIALIZED):
            state_dict.pop(key, None)
        elif key in state_dict:
            state_dict[key] = current


def _occupied_by_tensor(owner: nn.Module, name: str) -> bool:
    return name in buffers_of(owner) or name in parameters_of(owner)


def _where(tensor: Tensor) -> str:
    return "fake" if isinstance(tensor, FakeTensor) else f"on {tensor.device}"


def _readable(saved: object) -> bool:
    """Whether saved constraints have values."""
    return not without_data(saved)


def _ignored(value: Tensor | None) -> bool:
    if value is None or isinstance(value, _UNINITIALIZED):
        return True
    return value.numel() == 0 and value.dim() <= 1


def _dimensionality(constraints: Constraints, strict: bool) -> int:
    forward = max((d + 1 for d in constraints if d >= 0), default=0)
    backward = max((-d for d in constraints if d < 0), default=0)
    if strict:
        return forward + backward
    # Non-strict: a dim d and a dim -e name one axis of an (d + e)-dim tensor, where their sizes must agree.
    for ndim in range(max(forward, backward), forward + backward):
        if all(constraints.get(ndim + d, size) == size for d, size in constraints.items() if d < 0):
            return ndim
    return forward + backward


def _satisfies(shape: torch.Size, constraints: Constraints, strict: bool) -> bool:
    if len(shape) < _dimensionality(constraints, strict):
        return False
    return all(shape[dim] == size for dim, size in constraints.items())


def _mismatch(name: str, shape: torch.Size, constraints: Constraints, strict: bool) -> str:
    return f"ShapedTensor {name!r}: {_violation(shape, constraints, strict)}"


def _violation(shape: torch.Size, constraints: Constraints, strict: bool) -> str:
    wanted = ", ".join(f"dim {d}: {s}" for d, s in sorted(constraints.items()))
    mode = "strict" if strict else "non-strict"
    needed = _dimensionality(constraints, strict)
    return f"shape {tuple(shape)} violates the constraints {{{wanted}}} ({mode}, needs at least {needed} dims)"


def _check_int(name: str, what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"ShapedTensor {name!r}: {what} must be an int, got {value!r}")
    return value


def _check_size(name: str, dim: object, size: object) -> int:
    size = _check_int(name, f"the size of dim {dim}", size)
    if size < 0:
        raise ValueError(f"ShapedTensor {name!r}: the size of dim {dim} must be non-negative, got {size}")
    if size > MAX_SIZE:
        raise ValueError(f"ShapedTensor {name!r}: the size of dim {dim} must be at most {MAX_SIZE}, got {size}")
    return size


def _check_dim(name: str, dim: object) -> int:
    dim = _check_int(name, "a constrained dim", dim)
    if not -MAX_DIMS <= dim < MAX_DIMS:
        raise ValueError(
            f"ShapedTensor {name!r}: constrained dim {dim} is out of range: modattrs constrains dims -{MAX_DIMS} to "
            f"{MAX_DIMS - 1} (torch's operators handle tensors of at most {MAX_DIMS} dims)"
        )
    return dim


def _check_constraints(name: str, constraints: object) -> Constraints:
    if not isinstance(constraints, Mapping):
        raise TypeError(f"ShapedTensor {name!r}: constraints must be a mapping {{dim: size}}, got {constraints!r}")
    return {_check_dim(name, d): _check_size(name, d, s) for d, s in constraints.items()}


def _encode(constraints: Constraints, data: Tensor | None) -> Tensor:
    """The constraints as an int64 tensor of shape (2, width): row 0 holds the sizes of dims 0, 1, ...; row 1 those
    of dims -1, -2, ...; -1 where a dim is free. The width is the data's number of dims, or more if the constraints
    need it, so that a fresh model of the same architecture has a tensor of the same shape: distributed checkpoints
    load in place into the tensors of the destination's state dict, whatever constraints either side has.
    A tensor rather than a dict, so that tensor-only formats (safetensors, weights_only loads) can hold it; on the
    CPU, whatever default device is in effect, since it describes the data rather than being part of it."""
    ndim = data.dim() if isinstance(data, Tensor) and not isinstance(data, _UNINITIALIZED) else 0
    width = max([ndim, *(d + 1 if d >= 0 else -d for d in constraints)])
    encoded = torch.full((2, width), -1, dtype=torch.int64, device="cpu")
    for dim, size in constraints.items():
        encoded[int(dim < 0), dim if dim >= 0 else -dim - 1] = size
    return encoded


def _decode(saved: object) -> dict[object, object]:
    if isinstance(saved, Tensor):
        if saved.dim() != 2 or saved.shape[0] != 2 or saved.dtype != torch.int64:
            raise ValueError(f"expected an int64 tensor of shape (2, n), got {saved.dtype} {tuple(saved.shape)}")
        forward, backward = saved.tolist()
        decoded: dict[object, object] = {d: s for d, s in enumerate(forward) if s != -1}
        decoded.update({-d - 1: s for d, s in enumerate(backward) if s != -1})
        return decoded
    if isinstance(saved, Mapping):
        return dict(saved)
    raise TypeError(f"expected an int64 tensor of shape (2, n) or a mapping, got {type(saved).__name__}")
