"""Every flow composes with every other: a stateful property test over modules holding both attribute kinds.

A hypothesis ``RuleBasedStateMachine`` interleaves, on a ``Host`` module holding ``VirtualTensor`` attributes (with
and without ``cache=True``, with and without ``depends_on``, following the module's dtype, fixed, or taking it from a
parameter) and ``ShapedTensor`` attributes (a buffer and a parameter, with constraints):

* entering and leaving fake modes, nested: modattrs' ``fake_mode()``, torch's ``FakeTensorMode()`` and torch's
  ``FakeTensorMode(allow_non_fake_inputs=True)``;
* module conversions (``.to(dtype)``, ``.half()``, ``.float()``, ``.double()``, ``.to("meta")``,
  ``to_empty(device="cpu")``), in both ``swap_module_params_on_conversion`` modes;
* ``load_state_dict`` strict and not, with ``assign=True`` and without, in both swap modes, from checkpoints that
  convert dtypes, resize free dims, carry other constraints, lack keys or have extra ones;
* changes of what materializers read (a parameter in place or replaced, plain attributes);
* the attributes' own setters (``to``, ``follow_dtype``, ``persist``, ``live``, ``strict``, ``persist_data``,
  ``persist_constraints``, ``value``), ``reconstrain``, ``invalidate``;
* deleting and re-creating attributes, under their names and under names that hold aliases; aliases of the module's
  own attributes and of another module's (``m.alias = m.table``, ``m.cos = peer.table``, ``peer.t_alias = m.table``);
* ``copy.deepcopy``, ``pickle`` and ``torch.save``/``torch.load`` of the whole module; rebuilding it, on the meta
  device too;
* materializing a module built by ``deferred_init`` (a ``Host`` with both attribute kinds, a BatchNorm) inside
  whatever fake modes are open, whole or in part, twice from one record through a deep copy;
* torch's autograd functions called with each argument form they take (generators, iterators, dicts of inputs,
  keywords), in a process where fake CUDA has made modattrs' changes to torch.

The machine keeps a model of every module it made (the main one, the peer whose attributes are aliased, and earlier
main modules, kept as bystanders that nothing touches any more) and checks after every step that each module is what
the model says: every ``VirtualTensor`` value equals a fresh computation from the module's current state with the
attribute's dtype and device, is fake exactly when read inside a fake mode (of that mode), and is the same tensor on
a second read when cached; ``ShapedTensor`` data, constraints and flags are as modelled; parameters, buffers,
persistence and ``state_dict`` keys are exactly the expected ones. Operations that must fail are checked to raise the
documented exception and to leave the module as it was.

Hypothesis profiles are registered in ``tests/conftest.py``: ``ci`` (200 sequences of 25 steps) unless another is
named; run longer with ``--hypothesis-profile long``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import io
import math
import pickle
import traceback
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily

import modattrs
from modattrs import ShapedTensor, VirtualTensor
from modattrs.deferred import deferred_init, is_deferred, materialize_module, materialize_tensor
from modattrs.fake import fake_mode, is_fake

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPES = (*FLOATS, torch.int64)
ATTRIBUTES = (VirtualTensor, ShapedTensor)
NAMES = ("table", "ramp", "state", "weight", "alias", "cos")  # names rules create attributes and aliases under
VIRTUAL_DEPENDS = {"table": ("scale", "offset"), "ramp": ("n",)}


# --- the modules -----------------------------------------------------------------------------------------------------
# At module level, so that they pickle.


def table_values(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    """What ``make_table`` computes: reads the parameter ``scale`` and the plain attribute ``offset``."""
    scale = module.scale.detach().to(dtype=dtype, device=device)
    return scale * torch.arange(1, 4, dtype=dtype, device=device) + module.offset


def ramp_values(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A callable materializer, reading the plain attribute ``n`` only."""
    return torch.arange(module.n, dtype=dtype, device=device) * 0.5


class Host(nn.Module):
    def __init__(self, specs: dict[str, Any]) -> None:
        super().__init__()
        self.n = 4
        self.offset = 0.5
        self.scale = nn.Parameter(torch.tensor([1.5, -2.0, 3.0]))
        for name, spec in specs.items():
            spec.create(self, name)

    def make_table(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return table_values(self, dtype, device)


MATERIALIZERS = {"table": table_values, "ramp": ramp_values}


@dataclass(frozen=True)
class VSpec:
    kind: str  # "table" (method "make_table") or "ramp" (callable ramp_values)
    cache: bool
    declare: bool  # whether depends_on names what the materializer reads
    mode: str  # "follow", "fixed" or "from_scale" (dtype_from="scale")
    dtype: torch.dtype | None  # the initial dtype (follow) or the fixed one
    persist: bool

    def valid(self) -> bool:
        return self.mode != "follow" or self.dtype in FLOATS

    def create(self, owner: nn.Module, name: str) -> VirtualTensor:
        kwargs: dict[str, Any] = {"cache": self.cache, "persist": self.persist}
        if self.declare:
            kwargs["depends_on"] = VIRTUAL_DEPENDS[self.kind]
        if self.mode == "follow":
            kwargs.update(dtype=self.dtype, follow_dtype=True)
        elif self.mode == "fixed":
            kwargs.update(dtype=self.dtype, follow_dtype=False)
        else:
            kwargs["dtype_from"] = "scale"
        materializer = "make_table" if self.kind == "table" else ramp_values
        return VirtualTensor(owner, name, materializer, **kwargs)


@dataclass(frozen=True)
class SSpec:
    param: bool
    none: bool  # the value is None
    shape: tuple[int, ...]
    base: int
    constraints: tuple[tuple[int, int], ...]
    persist_data: bool
    persist_constraints: bool
    strict: bool
    live: bool

    def value(self) -> Tensor | None:
        """The initial value, made on the default device (meta inside ``with torch.device("meta")``)."""
        if self.none:
            return None
        values = values_of(self.shape, self.base)
        return nn.Parameter(values) if self.param else values

    def valid(self) -> bool:
        if self.param and not self.none and not self.persist_data:
            return False
        return self.none or ignored_shape(self.shape) or satisfies(self.shape, dict(self.constraints), self.strict)

    def create(self, owner: nn.Module, name: str) -> ShapedTensor:
        return ShapedTensor(
            owner,
            name,
            self.value(),
            dict(self.constraints),
            persist_data=self.persist_data,
            persist_constraints=self.persist_constraints,
            strict=self.strict,
            live=self.live,
        )


def values_of(shape: tuple[int, ...], base: float, dtype: torch.dtype = torch.float32) -> Tensor:
    numel = math.prod(shape)
    return (torch.arange(numel, dtype=torch.float32).reshape(shape) * 0.25 + base).to(dtype)


# --- oracles, written from the docs ----------------------------------------------------------------------------------


def satisfies(shape: tuple[int, ...] | torch.Size, constraints: dict[int, int], strict: bool) -> bool:
    """Each constrained dim exists and has its size; strict: non-negative and negative dims name different axes."""
    ndim = len(shape)
    forward = max((d + 1 for d in constraints if d >= 0), default=0)
    backward = max((-d for d in constraints if d < 0), default=0)
    if strict and ndim < forward + backward:
        return False
    return all(-ndim <= d < ndim and shape[d] == s for d, s in constraints.items())


def ignored_shape(shape: tuple[int, ...] | torch.Size) -> bool:
    return math.prod(shape) == 0 and len(shape) <= 1


def ignored(t: Tensor | None) -> bool:
    return t is None or ignored_shape(tuple(t.shape))


def encode(constraints: dict[int, int], ndim: int) -> Tensor:
    """The documented ``_{name}_constraints`` tensor: (2, width) int64, sizes of dims 0, 1, ... and of -1, -2, ..."""
    width = max([ndim, *(d + 1 if d >= 0 else -d for d in constraints)])
    encoded = torch.full((2, width), -1, dtype=torch.int64)
    for d, s in constraints.items():
        encoded[int(d < 0), d if d >= 0 else -d - 1] = s
    return encoded


def decode(saved: Tensor) -> dict[int, int] | None:
    """Constraints from their documented encoding; None when the tensor is not such an encoding."""
    if saved.dtype != torch.int64 or saved.dim() != 2 or saved.shape[0] != 2:
        return None
    forward, backward = saved.tolist()
    decoded = {d: s for d, s in enumerate(forward) if s != -1}
    decoded.update({-d - 1: s for d, s in enumerate(backward) if s != -1})
    return decoded


def resized(t: Tensor, dim: int, size: int) -> Tensor:
    """The documented resize: shrinking keeps the last elements, growing pads zeros at the head."""
    old = t.shape[dim]
    shape = list(t.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    kept = min(old, size)
    if kept:
        out.narrow(dim, size - kept, kept).copy_(t.narrow(dim, old - kept, kept))
    return out


def current_fake_mode() -> FakeTensorMode | None:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


# --- the model -------------------------------------------------------------------------------------------------------


class Slot:
    """An expected tensor: ``t`` has the expected metadata, and the expected values when ``known``."""

    __slots__ = ("known", "t")

    def __init__(self, t: Tensor | None, known: bool) -> None:
        self.t = t
        self.known = known and t is not None and not t.is_meta

    def clone(self) -> Slot:
        return Slot(self.t, self.known)  # model tensors are never modified in place

    def check(self, actual: Tensor | None, what: str, dtype: bool = True) -> None:
        """``dtype=False``: any dtype will do (the reference of an attribute whose dtype it does not give)."""
        if self.t is None:
            assert actual is None, f"{what}: expected None, got {describe(actual)}"
            return
        assert actual is not None, f"{what}: expected {describe(self.t)}, got None"
        assert not isinstance(actual, FakeTensor), f"{what}: became fake: {describe(actual)}"
        assert (actual.shape, actual.device) == (self.t.shape, self.t.device), (
            f"{what}: expected {describe(self.t)}, got {describe(actual)}"
        )
        assert actual.dtype == self.t.dtype or not dtype, f"{what}: expected {describe(self.t)}, got {describe(actual)}"
        if self.known and not self.t.is_meta:
            with unset_fake_temporarily():
                assert torch.equal(actual.detach(), self.t), f"{what}: expected values {self.t}, got {actual}"


def describe(t: object) -> str:
    if not isinstance(t, Tensor):
        return repr(t)
    kind = "fake " if isinstance(t, FakeTensor) else ""
    return f"{kind}{type(t).__name__}{tuple(t.shape)} {t.dtype} on {t.device}"


class Obj:
    """A modattrs attribute object the machine made, and what is expected of it."""

    def __init__(self, kind: str, name: str, host: HostModel) -> None:
        self.kind = kind  # "virtual" or "shaped"
        self.name = name
        self.host = host  # the owner's model
        self.status = "bound"  # bound, held (deleted, still referenced), superseded (name taken over), ownerless
        self.lenient = False  # copied in a state the docs do not speak of: an error or a right value will do
        self.weak: weakref.ref[VirtualTensor | ShapedTensor] | None = None
        # virtual
        self.vkind = ""
        self.cache = False
        self.declare = False
        self.mode = ""
        self.fixed: torch.dtype | None = None
        self.ref: Slot | None = None
        # shaped
        self.data: Slot | None = None
        self.constraints: dict[int, int] = {}
        self.persist_constraints = False
        self.strict = True
        self.live = False
        # both: where the registered tensor is kept, and whether it is in the state_dict
        self.param = False
        self.persistent = False

    @property
    def derived(self) -> str:
        return f"_{self.name}_ref" if self.kind == "virtual" else f"_{self.name}_data"

    @property
    def slot(self) -> Slot:
        slot = self.ref if self.kind == "virtual" else self.data
        assert slot is not None
        return slot

    def value_dtype(self) -> torch.dtype:
        if self.mode == "fixed":
            assert self.fixed is not None
            return self.fixed
        if self.mode == "from_scale":
            assert self.host.scale.t is not None
            return self.host.scale.t.dtype
        assert self.ref is not None
        assert self.ref.t is not None
        return self.ref.t.dtype

    def clone(self, host: HostModel) -> Obj:
        other = copy.copy(self)
        other.host = host
        other.weak = None
        other.constraints = dict(self.constraints)
        other.ref = None if self.ref is None else self.ref.clone()
        other.data = None if self.data is None else self.data.clone()
        return other

    def __repr__(self) -> str:
        return f"<{self.kind} {self.name!r} {self.status}>"


def virtual_obj(host: HostModel, name: str, spec: VSpec) -> Obj:
    obj = Obj("virtual", name, host)
    obj.vkind, obj.cache, obj.declare, obj.mode = spec.kind, spec.cache, spec.declare, spec.mode
    obj.fixed = spec.dtype if spec.mode == "fixed" else None
    ref_dtype = spec.dtype if spec.mode == "follow" else torch.get_default_dtype()
    obj.ref = Slot(torch.empty(0, dtype=ref_dtype, device=torch.get_default_device()), True)
    obj.persistent = spec.persist
    return obj


def shaped_obj(host: HostModel, name: str, spec: SSpec) -> Obj:
    obj = Obj("shaped", name, host)
    value = spec.value()
    obj.data = Slot(None if value is None else value.detach().clone(), True)
    obj.param = isinstance(value, nn.Parameter)
    obj.persistent = spec.persist_data
    obj.constraints = dict(spec.constraints)
    obj.persist_constraints, obj.strict, obj.live = spec.persist_constraints, spec.strict, spec.live
    return obj


class HostModel:
    def __init__(self, label: str) -> None:
        self.label = label
        self.scale = Slot(torch.tensor([1.5, -2.0, 3.0], device=torch.get_default_device()), True)
        self.offset = 0.5
        self.n = 4
        self.own: dict[str, Obj] = {}  # bound attributes, by name
        self.held: list[Obj] = []  # attributes deleted from the module and still referenced: still registered
        self.aliases: dict[str, Obj] = {}  # names of the module's __dict__ that hold some other attribute object

    def objects(self) -> list[Obj]:
        """The attributes whose tensors are registered on the module."""
        return [*self.own.values(), *self.held]

    def registered(self) -> dict[str, Obj | None]:
        """Parameter and buffer names the module must have (None: ``scale``)."""
        names: dict[str, Obj | None] = {"scale": None}
        for obj in self.objects():
            assert obj.derived not in names, f"model error: {obj.derived} registered twice"
            names[obj.derived] = obj
        return names

    def state_dict_keys(self) -> set[str]:
        keys = {"scale"}
        for obj in self.objects():
            if (obj.persistent or obj.param) and obj.slot.t is not None:
                keys.add(obj.derived)
            if obj.kind == "shaped" and obj.status == "bound" and obj.persist_constraints:
                keys.add(f"_{obj.name}_constraints")
        return keys

    def slots(self) -> list[Slot]:
        return [self.scale, *(obj.slot for obj in self.objects())]

    def convert(self, fn: Any, keeps_values: bool = True) -> None:
        """Apply a conversion, as ``Module._apply`` does, to every parameter and buffer."""
        for slot in self.slots():
            if slot.t is not None:
                slot.t = fn(slot.t)
                slot.known = slot.known and keeps_values and not slot.t.is_meta

    def clone(self, label: str) -> tuple[HostModel, dict[int, Obj]]:
        """A model of a deep copy; also the map from each of this model's objects (by id) to its copy."""
        other = HostModel(label)
        other.scale = self.scale.clone()
        other.offset, other.n = self.offset, self.n
        mapping: dict[int, Obj] = {}
        for name, obj in self.own.items():
            other.own[name] = mapping.setdefault(id(obj), obj.clone(other))
        for obj in self.held:
            other.held.append(mapping.setdefault(id(obj), obj.clone(other)))
        return other, mapping


# --- reading and checking --------------------------------------------------------------------------------------------


def attempt(fn: Any) -> tuple[Any, BaseException | None]:
    """``(fn(), None)``, or ``(None, the exception)``. The exception keeps its traceback as a note only: a traceback
    holds the frames it went through, whose ``f_back`` leads to the caller keeping the exception, a reference cycle
    that would keep attribute objects alive (and their tensors registered) until the cyclic collector runs."""
    try:
        return fn(), None
    except Exception as error:
        error.add_note("".join(traceback.format_exception(error)))
        chained: BaseException | None = error
        while chained is not None:
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        return None, error


def fresh(owner: nn.Module, kind: str, dtype: torch.dtype, device: torch.device) -> Tensor:
    """The value computed here and now from the module's current state, converted as the docs say."""
    result = MATERIALIZERS[kind](owner, dtype, device)
    if result.dtype != dtype or result.device != device:
        result = result.to(device=device, dtype=dtype)
    return result


def check_value(actual: Tensor, expected: Tensor, dtype: torch.dtype, device: torch.device, what: str) -> None:
    mode = current_fake_mode()
    if mode is not None:
        assert isinstance(actual, FakeTensor), f"{what}: read inside a fake mode, got {describe(actual)}"
        assert actual.fake_mode is mode, f"{what}: a fake value of another fake mode was served"
    else:
        assert not isinstance(actual, FakeTensor), f"{what}: read outside every fake mode, got {describe(actual)}"
    assert (actual.dtype, actual.device) == (dtype, device), (
        f"{what}: the value is {describe(actual)}, the attribute says {dtype} on {device}"
    )
    assert actual.shape == expected.shape, f"{what}: expected {describe(expected)}, got {describe(actual)}"
    if mode is None and not actual.is_meta:
        with unset_fake_temporarily():
            assert torch.equal(actual, expected) or (
                actual.is_floating_point()
                and torch.equal(actual.isnan(), expected.isnan())
                and torch.equal(actual.nan_to_num(), expected.nan_to_num())
            ), f"{what}: stale or wrong value {actual}, a fresh computation gives {expected}"


def check_virtual(module: nn.Module, obj: Obj, attribute: VirtualTensor, what: str) -> None:
    """A bound virtual attribute: metadata as modelled, value as a fresh computation."""
    assert attribute.cached == obj.cache
    assert attribute.follow_dtype == (obj.mode == "follow"), f"{what}: follow_dtype"
    assert attribute.dtype_from == ("scale" if obj.mode == "from_scale" else None)
    dtype, device = attribute.dtype, attribute.device
    assert obj.ref is not None
    assert obj.ref.t is not None
    assert (dtype, device) == (obj.value_dtype(), obj.ref.t.device), (
        f"{what}: the attribute says {dtype} on {device}, expected {obj.value_dtype()} on {obj.ref.t.device}"
    )
    assert attribute.persist == obj.persistent, f"{what}: persist"
    read_and_compare(module, obj, attribute, dtype, device, what)


def read_and_compare(
    module: nn.Module, obj: Obj, attribute: VirtualTensor, dtype: torch.dtype, device: torch.device, what: str
) -> None:
    expected, expected_error = attempt(lambda: fresh(module, obj.vkind, dtype, device))
    actual, error = attempt(lambda: attribute.value)
    if expected_error is not None:
        assert error is not None, (
            f"{what}: a fresh computation raises {expected_error!r} here, the attribute served {describe(actual)}"
        )
        assert type(error) is type(expected_error), f"{what}: raised {error!r}, a fresh computation {expected_error!r}"
        return
    if error is not None:
        raise AssertionError(f"{what}: reading the value raised {error!r}") from error
    check_value(actual, expected, dtype, device, what)
    if obj.cache and current_fake_mode() is None:
        # The docs: a cached value is the same tensor until something changes. (A real module's value read in a fake
        # mode is computed at each read.)
        again, error = attempt(lambda: attribute.value)
        assert error is None, f"{what}: a second read raised {error!r}"
        assert again is actual, f"{what}: a cached value was computed again with nothing changed"


def check_shaped(obj: Obj, attribute: ShapedTensor, what: str) -> None:
    value = attribute.value
    assert obj.data is not None
    obj.data.check(value, f"{what}.value")
    assert isinstance(value, nn.Parameter) == (obj.param and value is not None), f"{what}: parameter or buffer"
    assert attribute.constraints == obj.constraints, f"{what}: constraints {attribute.constraints} != {obj.constraints}"
    assert attribute.strict == obj.strict, f"{what}: strict"
    assert attribute.live == obj.live, f"{what}: live"
    assert attribute.persist_constraints == obj.persist_constraints, f"{what}: persist_constraints"
    assert attribute.persist_data == (obj.persistent or obj.param), f"{what}: persist_data"
    expected_valid = ignored(obj.data.t) or satisfies(tuple(obj.data.t.shape), obj.constraints, obj.strict)
    assert attribute.valid == expected_valid, f"{what}: valid is {attribute.valid}, expected {expected_valid}"
    assert attribute.ignored == ignored(obj.data.t), f"{what}: ignored"


def check_detached(module: nn.Module | None, obj: Obj, attribute: VirtualTensor | ShapedTensor, what: str) -> None:
    """An attribute that is no longer its module's: held (a deleted virtual attribute keeps reading its own
    reference), superseded or ownerless (``ReferenceError``)."""
    if obj.lenient:
        _, error = attempt(lambda: attribute.value)
        assert error is None or isinstance(error, ReferenceError), f"{what}: reading the value gave {error!r}"
        return
    if obj.status == "held" and obj.kind == "virtual":
        assert module is not None
        assert obj.ref is not None
        assert obj.ref.t is not None
        assert isinstance(attribute, VirtualTensor)
        read_and_compare(module, obj, attribute, obj.value_dtype(), obj.ref.t.device, what)
        return
    if obj.status == "ownerless":
        # A copy or unpickled module of an alias of another module's attribute: the copied module is held only by
        # weak references, and gone (the docs: "copy modules, not attributes"). If it is still there, the value
        # must be right.
        owner = attribute.owner
        if owner is not None:
            return
    _, error = attempt(lambda: attribute.value)
    assert isinstance(error, ReferenceError), f"{what} ({obj.status}): reading the value gave {error!r}"


def check_host(module: nn.Module, model: HostModel) -> None:
    label = model.label
    model.scale.check(module.scale, f"{label}.scale")
    assert isinstance(module.scale, nn.Parameter)
    assert module.offset == model.offset
    assert module.n == model.n
    registered = model.registered()
    actual_names = set(module._parameters) | set(module._buffers)
    assert actual_names == set(registered), (
        f"{label}: parameters and buffers {sorted(actual_names)}, expected {sorted(registered)}"
    )
    for name, obj in registered.items():
        if obj is None:
            continue
        slot_what = f"{label}.{name}"
        in_params = name in module._parameters
        assert in_params == obj.param, f"{slot_what}: expected a {'parameter' if obj.param else 'buffer'}"
        actual = module._parameters[name] if in_params else module._buffers[name]
        # The reference of a fixed or dtype_from attribute keeps its device only: its dtype is not the value's.
        obj.slot.check(actual, slot_what, dtype=obj.kind == "shaped" or obj.mode == "follow")
        if not obj.param:
            persistent = name not in module._non_persistent_buffers_set
            assert persistent == obj.persistent, f"{slot_what}: persistent is {persistent}, expected {obj.persistent}"
    # The module's attribute objects are exactly the modelled ones.
    attributes = {k: v for k, v in vars(module).items() if isinstance(v, ATTRIBUTES)}
    expected = {**model.own, **model.aliases}
    assert set(attributes) == set(expected), f"{label}: attributes {sorted(attributes)}, expected {sorted(expected)}"
    for name, obj in expected.items():
        attribute = attributes[name]
        assert obj.weak is not None
        assert obj.weak() is attribute, f"{label}.{name} is not the modelled object"
        what = f"{label}.{name}" if name == obj.name else f"{label}.{name} (alias of {obj.host.label}.{obj.name})"
        if obj.status == "bound":
            owner = attribute.owner
            assert owner is not None, f"{what}: its owner is gone"
            assert vars(owner).get(obj.name) is attribute, f"{what}: not bound to its owner"
            if name in model.own:
                assert owner is module, f"{what}: owned by another module"
                assert attribute.name == name, f"{what}: named {attribute.name!r}"
                if obj.kind == "virtual":
                    assert isinstance(attribute, VirtualTensor)
                    check_virtual(module, obj, attribute, what)
                else:
                    assert isinstance(attribute, ShapedTensor)
                    check_shaped(obj, attribute, what)
            # an alias of a bound attribute is checked where that attribute is bound
        else:
            check_detached(attribute.owner, obj, attribute, what)
    # The state_dict, outside any fake mode.
    with unset_fake_temporarily():
        state = module.state_dict()
        assert set(state) == model.state_dict_keys(), (
            f"{label}: state_dict keys {sorted(state)}, expected {sorted(model.state_dict_keys())}"
        )
        for obj in model.own.values():
            if obj.kind == "shaped" and obj.persist_constraints:
                assert obj.data is not None
                ndim = 0 if obj.data.t is None else obj.data.t.dim()
                saved = state[f"_{obj.name}_constraints"]
                assert torch.equal(saved, encode(obj.constraints, ndim)), f"{label}.{obj.name}: constraints {saved}"


def snapshot(module: nn.Module) -> Any:
    """Everything a failed operation must leave as it was."""
    with unset_fake_temporarily():
        tensors = {}
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    tensors[name] = None
                else:
                    data = t.detach().clone() if not t.is_meta else None
                    tensors[name] = (type(t), id(t), t.shape, t.dtype, t.device, data)
        attributes: dict[str, Any] = {}
        for name, value in vars(module).items():
            if isinstance(value, ShapedTensor):
                attributes[name] = (id(value), value.owner is module, value.constraints, value.strict, value.live,
                                    value.persist_constraints)  # fmt: skip
            elif isinstance(value, VirtualTensor):
                dtype, _ = attempt(lambda value=value: value.dtype)
                attributes[name] = (id(value), value.owner is module, dtype, value.dtype_from, value.cached)
            elif not name.startswith("_") and not isinstance(value, (Tensor, nn.Module)):
                attributes[name] = value
        return (tensors, set(module._non_persistent_buffers_set), attributes,
                len(module._state_dict_hooks), len(module._load_state_dict_pre_hooks))  # fmt: skip


def same(before: Any, after: Any) -> bool:
    with unset_fake_temporarily():
        return _same(before, after)


def _same(before: Any, after: Any) -> bool:
    tensors_before, *rest_before = before
    tensors_after, *rest_after = after
    if rest_before != rest_after or tensors_before.keys() != tensors_after.keys():
        return False
    for name, b in tensors_before.items():
        a = tensors_after[name]
        if (a is None) != (b is None):
            return False
        if a is None:
            continue
        if a[:5] != b[:5] or (a[5] is None) != (b[5] is None):
            return False
        if a[5] is not None and not torch.equal(a[5].nan_to_num(), b[5].nan_to_num()):
            return False
    return True


@contextlib.contextmanager
def fails_cleanly(module: nn.Module, *errors: type[BaseException], what: str) -> Any:
    """The block must raise one of ``errors`` and leave ``module`` exactly as it was."""
    before = snapshot(module)
    try:
        yield
    except errors:
        after = snapshot(module)
        assert same(before, after), f"{what}: raised, and changed the module"
    else:
        raise AssertionError(f"{what}: expected {' or '.join(e.__name__ for e in errors)}, nothing was raised")


# --- strategies ------------------------------------------------------------------------------------------------------


@st.composite
def vspecs(draw: Any, valid: bool = True, kind: str | None = None) -> VSpec:
    kind = kind or draw(st.sampled_from(["table", "ramp"]))
    cache = draw(st.booleans())
    declare = cache or draw(st.booleans())  # undeclared dependencies are documented to be invisible to the cache
    mode = draw(st.sampled_from(["follow", "fixed", "from_scale"]))
    dtype = draw(st.sampled_from(FLOATS if valid and mode == "follow" else DTYPES)) if mode != "from_scale" else None
    return VSpec(kind, cache, declare, mode, dtype, draw(st.booleans()))


@st.composite
def sspecs(draw: Any, valid: bool = True) -> SSpec:
    param = draw(st.booleans())
    none = draw(st.integers(0, 9)) == 0
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(0 if ndim == 1 else 1, 3)) for _ in range(ndim))
    constraints: dict[int, int] = {}
    for axis in range(ndim):
        choice = draw(st.integers(0, 3))
        if choice == 0:
            continue
        dim = axis if choice != 2 else axis - ndim
        size = shape[axis] if valid or draw(st.integers(0, 3)) else draw(st.integers(0, 3))
        constraints[dim] = size
    if not valid and draw(st.booleans()):
        constraints[draw(st.integers(-4, 3))] = draw(st.integers(0, 3))
    persist_data = True if param and valid else draw(st.booleans())
    strict = draw(st.booleans())
    if valid and not satisfies(shape, constraints, strict):
        strict = False  # {0: s, -1: t} names one axis twice in a 1-dim tensor: only non-strict allows that
    return SSpec(
        param, none, shape, draw(st.integers(0, 5)), tuple(sorted(constraints.items())), persist_data,
        draw(st.booleans()), strict, draw(st.booleans()),
    )  # fmt: skip


# --- deferred modules and autograd argument forms --------------------------------------------------------------------


def deferred_builds(specs: dict[str, Any]) -> dict[str, Any]:
    """What the deferred rule builds: a Host with both attribute kinds, and modules holding a BatchNorm (whose
    ``num_batches_tracked`` is a constant changed in place in ``__init__``)."""
    return {
        "host": lambda: Host(specs),
        "batch norm": lambda: nn.BatchNorm1d(3),
        "linear and batch norm": lambda: nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)),
    }


DEFERRED_WAYS = {
    "whole": lambda m: materialize_module(m),
    "check_fn": lambda m: materialize_module(m, check_fn=lambda sub: not isinstance(sub, nn.Linear)),
    "buffers_only": lambda m: materialize_module(m, buffers_only=True),
    "one tensor": lambda m: materialize_tensor(next(iter([*m.parameters(), *m.buffers()]))),
}


def real_state(module: nn.Module) -> dict[str, Tensor]:
    """Parameters, buffers and virtual values, read outside every fake mode."""
    with unset_fake_temporarily():
        state = dict([*module.named_parameters(), *module.named_buffers()])
        for name, attribute in list(vars(module).items()):
            if isinstance(attribute, VirtualTensor):
                state[f"{name}.value"] = attribute.value
        return state


def forms_of(items: list[Tensor], form: str) -> Any:
    """``items`` as torch's autograd functions take them: one tensor, a sequence, a one-pass iterable, a dict."""
    return {
        "tensor": lambda: items[0],
        "list": lambda: list(items),
        "tuple": lambda: tuple(items),
        "generator": lambda: (item for item in items),
        "iterator": lambda: iter(items),
        "dict": lambda: dict(zip("wv", items, strict=False)),  # as many leaves as items
    }[form]()


def takes_dict_inputs(call: str) -> bool:
    """Whether this torch's ``call`` takes its inputs as a dict (torch 2.8's read the keys; 2.13's take the values)."""
    w = torch.ones(1, requires_grad=True)
    try:
        if call == "autograd.grad":
            torch.autograd.grad((w * 2).sum(), {"w": w})
        else:
            torch.autograd.backward((w * 2).sum(), inputs={"w": w})
    except (RuntimeError, TypeError):
        return False
    return True


DICT_INPUTS = {call: takes_dict_inputs(call) for call in ("autograd.backward", "autograd.grad")}
DICT_INPUTS["Tensor.backward"] = DICT_INPUTS["autograd.backward"]


# --- the machine -----------------------------------------------------------------------------------------------------


class Composition(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.swap_before = torch.__future__.get_swap_module_params_on_conversion()
        self.modes: list[tuple[Any, FakeTensorMode, str]] = []
        self.m: Host = None  # type: ignore[assignment]
        self.model: HostModel = None  # type: ignore[assignment]
        self.peer: Host = None  # type: ignore[assignment]
        self.peer_model: HostModel = None  # type: ignore[assignment]
        self.bystanders: list[tuple[Host, HostModel]] = []
        self.generation = 0

    # -- bookkeeping

    def hosts(self) -> list[tuple[Host, HostModel]]:
        return [(self.m, self.model), (self.peer, self.peer_model), *self.bystanders]

    def build(self, specs: dict[str, Any], meta: bool, label: str) -> tuple[Host, HostModel]:
        device = "meta" if meta else "cpu"
        with torch.device(device):
            module = Host(specs)
            model = HostModel(label)
            for name, spec in specs.items():
                maker = virtual_obj if isinstance(spec, VSpec) else shaped_obj
                model.own[name] = maker(model, name, spec)
        bind_objects(module, model)
        return module, model

    def retire_main(self, module: Host, model: HostModel) -> None:
        """Replace the main module; the old one becomes a bystander, which nothing changes any more."""
        old, old_model = self.m, self.model
        self.m, self.model = module, model
        self.keep_bystander(old, old_model)

    def keep_bystander(self, module: Host, model: HostModel) -> None:
        self.bystanders.append((module, model))
        del module
        while len(self.bystanders) > 2:
            self.drop_oldest()

    def drop_oldest(self) -> None:
        """Forget the oldest bystander: the module is deleted, and with it what only it held."""
        module = weakref.ref(self.bystanders[0][0])
        model = self.bystanders.pop(0)[1]
        for obj in [*model.own.values(), *model.held]:
            if obj.status in ("bound", "held", "orphan"):
                obj.status = "ownerless"
        # The docs: a module with attributes is freed by reference counting as soon as its last reference goes.
        assert module() is None, f"{model.label} was not freed when its last reference went"
        self.release()

    def holders(self) -> set[int]:
        return {id(obj) for _, model in self.hosts() for obj in model.aliases.values()}

    def release(self) -> None:
        """Held attributes no longer referenced by any alias die: their finalizers unregister their tensors."""
        held = self.holders()
        for _, model in self.hosts():
            for obj in list(model.held):
                if id(obj) not in held and obj.status == "held":
                    model.held.remove(obj)
                    obj.status = "gone"

    def unbind(self, model: HostModel, name: str) -> None:
        """``name`` of the module stops referring to what it referred to (deleted, or assigned something else)."""
        if name in model.own:
            obj = model.own.pop(name)
            obj.status = "held"
            model.held.append(obj)
        else:
            model.aliases.pop(name, None)

    def supersede(self, model: HostModel, name: str) -> None:
        """A new attribute takes ``name`` over: what earlier attributes of that name registered is removed."""
        if name in model.own:
            model.own.pop(name).status = "superseded"
        for obj in [o for o in model.held if o.name == name]:
            model.held.remove(obj)
            obj.status = "superseded"

    def in_fake_mode(self) -> bool:
        return bool(self.modes)

    def collect_fake_modes(self) -> None:
        """Fake modes are freed by the cyclic collector only; until then their memo keeps weak references to the
        real tensors they saw, which swap_tensors (swap_module_params_on_conversion) refuses. Free exited modes, as
        time would."""
        if not torch.__future__.get_swap_module_params_on_conversion():
            return
        gc.collect(1)
        tensors = [*self.m.parameters(), *self.m.buffers()]
        if any(weakref.getweakrefcount(t) for t in tensors):
            gc.collect()

    # -- setup

    @initialize(
        table=vspecs(kind="table"),
        ramp=vspecs(kind="ramp"),
        state=sspecs(),
        weight=sspecs(),
        peer_table=vspecs(kind="table"),
        peer_state=sspecs(),
        meta=st.booleans(),
        peer_meta=st.booleans(),
        swap=st.booleans(),
    )
    def setup(self, table, ramp, state, weight, peer_table, peer_state, meta, peer_meta, swap) -> None:  # type: ignore[no-untyped-def]
        torch.__future__.set_swap_module_params_on_conversion(swap)
        with fake_mode(fake_cuda=True):  # once in the process: modattrs changes torch (autograd_argument_forms)
            pass
        weight = dataclasses.replace(weight, param=True, persist_data=True)  # a parameter, unless None
        self.m, self.model = self.build({"table": table, "ramp": ramp, "state": state, "weight": weight}, meta, "m")
        self.peer, self.peer_model = self.build({"table": peer_table, "state": peer_state}, peer_meta, "peer")

    def teardown(self) -> None:
        while self.modes:
            self.pop_fake_mode_now()
        torch.__future__.set_swap_module_params_on_conversion(self.swap_before)

    # -- fake modes

    @precondition(lambda self: len(self.modes) < 3)
    @rule(kind=st.sampled_from(["modattrs", "torch", "torch-lenient"]))
    def push_fake_mode(self, kind: str) -> None:
        if kind == "modattrs":
            context: Any = fake_mode()
        elif kind == "torch":
            context = FakeTensorMode()
        else:
            context = FakeTensorMode(allow_non_fake_inputs=True)
        mode = context.__enter__()
        self.modes.append((context, mode, kind))

    @precondition(lambda self: bool(self.modes))
    @rule()
    def pop_fake_mode(self) -> None:
        self.pop_fake_mode_now()

    def pop_fake_mode_now(self) -> None:
        context, _, _ = self.modes.pop()
        context.__exit__(None, None, None)
        if not self.modes:
            gc.collect(0)

    @rule(flag=st.booleans())
    def set_swap_mode(self, flag: bool) -> None:
        torch.__future__.set_swap_module_params_on_conversion(flag)

    # -- module conversions (outside fake modes: inside, torch makes the module's tensors fake)

    @precondition(lambda self: not self.in_fake_mode())
    @rule(how=st.sampled_from(["half", "float", "double", "bfloat16", *(f"to({d})" for d in FLOATS)]))
    def convert_dtype(self, how: str) -> None:
        self.collect_fake_modes()
        methods = {"half": torch.float16, "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}
        if how in methods:
            dtype = methods[how]
            result = getattr(self.m, how)()
        else:
            dtype = next(d for d in FLOATS if how == f"to({d})")
            result = self.m.to(dtype)
        assert result is self.m
        self.model.convert(lambda t: t.to(dtype) if t.is_floating_point() else t)

    @precondition(lambda self: not self.in_fake_mode())
    @rule()
    def to_meta(self) -> None:
        self.collect_fake_modes()
        self.m.to("meta")
        self.model.convert(lambda t: t.to("meta"), keeps_values=False)

    @precondition(lambda self: not self.in_fake_mode())
    @rule()
    def to_empty(self) -> None:
        self.collect_fake_modes()
        self.m.to_empty(device="cpu")
        self.model.convert(lambda t: torch.empty_like(t, device="cpu"), keeps_values=False)

    # -- what the materializers read

    @precondition(lambda self: not self.in_fake_mode())
    @rule(amount=st.integers(1, 3))
    def scale_in_place(self, amount: int) -> None:
        with torch.no_grad():
            self.m.scale.add_(amount)
        if self.model.scale.known:
            assert self.model.scale.t is not None
            self.model.scale.t = self.model.scale.t + amount

    @precondition(lambda self: not self.in_fake_mode())
    @rule(dtype=st.sampled_from(FLOATS), base=st.integers(-3, 3))
    def replace_scale(self, dtype: torch.dtype, base: int) -> None:
        values = values_of((3,), base, dtype)
        self.m.scale = nn.Parameter(values.clone())
        self.model.scale = Slot(values, True)

    @rule(offset=st.sampled_from([0.5, 0.25, -1.0]))
    def set_offset(self, offset: float) -> None:
        self.m.offset = offset
        self.model.offset = offset

    @rule(n=st.integers(2, 5))
    def set_n(self, n: int) -> None:
        self.m.n = n
        self.model.n = n

    # -- the attributes' own setters

    def own(self, kind: str) -> list[str]:
        return sorted(name for name, obj in self.model.own.items() if obj.kind == kind)

    @precondition(lambda self: not self.in_fake_mode() and bool(self.own("virtual")))
    @rule(
        data=st.data(),
        dtype=st.sampled_from((None, *DTYPES)),
        device=st.sampled_from((None, "cpu", "meta")),
        setters=st.booleans(),
    )
    def virtual_to(self, data: st.DataObject, dtype: torch.dtype | None, device: str | None, setters: bool) -> None:
        name = data.draw(st.sampled_from(self.own("virtual")), label="name")
        obj = self.model.own[name]
        attribute = getattr(self.m, name)
        kwargs: dict[str, Any] = {}
        if dtype is not None:
            kwargs["dtype"] = dtype
        if device is not None:
            kwargs["device"] = device

        def change() -> None:
            if not setters:
                assert attribute.to(**kwargs) is attribute
                return
            for key, value in kwargs.items():  # the dtype first
                setattr(attribute, key, value)

        if dtype is not None and (obj.mode == "from_scale" or (obj.mode == "follow" and dtype not in FLOATS)):
            with fails_cleanly(self.m, ValueError, what=f"m.{name}.to({kwargs})"):
                change()
            return
        change()
        assert obj.ref is not None
        assert obj.ref.t is not None
        if device is not None:
            obj.ref.t = torch.empty(0, dtype=obj.ref.t.dtype, device=device)
        if dtype is not None:
            if obj.mode == "follow":
                obj.ref.t = torch.empty(0, dtype=dtype, device=obj.ref.t.device)
            else:
                obj.fixed = dtype

    @precondition(lambda self: not self.in_fake_mode() and bool(self.own("virtual")))
    @rule(data=st.data(), follow=st.booleans())
    def virtual_follow_dtype(self, data: st.DataObject, follow: bool) -> None:
        name = data.draw(st.sampled_from(self.own("virtual")), label="name")
        obj = self.model.own[name]
        attribute = getattr(self.m, name)
        if obj.mode == "from_scale" or (follow and obj.mode == "fixed" and obj.fixed not in FLOATS):
            with fails_cleanly(self.m, ValueError, what=f"m.{name}.follow_dtype = {follow}"):
                attribute.follow_dtype = follow
            return
        attribute.follow_dtype = follow
        assert obj.ref is not None
        assert obj.ref.t is not None
        if follow and obj.mode == "fixed":
            obj.ref.t = torch.empty(0, dtype=obj.fixed, device=obj.ref.t.device)
            obj.mode, obj.fixed = "follow", None
        elif not follow and obj.mode == "follow":
            obj.mode, obj.fixed = "fixed", obj.ref.t.dtype

    @precondition(lambda self: bool(self.own("virtual")))
    @rule(data=st.data(), persist=st.booleans())
    def virtual_persist(self, data: st.DataObject, persist: bool) -> None:
        name = data.draw(st.sampled_from(self.own("virtual")), label="name")
        getattr(self.m, name).persist = persist
        self.model.own[name].persistent = persist

    @precondition(lambda self: bool(self.own("virtual")))
    @rule(data=st.data())
    def virtual_invalidate(self, data: st.DataObject) -> None:
        getattr(self.m, data.draw(st.sampled_from(self.own("virtual")), label="name")).invalidate()

    @precondition(lambda self: bool(self.own("shaped")))
    @rule(data=st.data(), which=st.sampled_from(["live", "persist_constraints", "persist_data", "strict"]),
          flag=st.booleans())  # fmt: skip
    def shaped_flag(self, data: st.DataObject, which: str, flag: bool) -> None:
        name = data.draw(st.sampled_from(self.own("shaped")), label="name")
        obj = self.model.own[name]
        attribute = getattr(self.m, name)
        assert obj.data is not None
        if which == "persist_data" and obj.param and not flag:
            with fails_cleanly(self.m, ValueError, what=f"m.{name}.persist_data = False"):
                attribute.persist_data = False
            return
        if which == "strict":
            t = obj.data.t
            valid_now = ignored(t) or satisfies(tuple(t.shape), obj.constraints, obj.strict)
            if not ignored(t) and valid_now and not satisfies(tuple(t.shape), obj.constraints, flag):
                with fails_cleanly(self.m, ValueError, what=f"m.{name}.strict = {flag}"):
                    attribute.strict = flag
                return
        setattr(attribute, which, flag)
        if which == "persist_data":
            if not obj.param:
                obj.persistent = flag
        else:
            setattr(obj, which, flag)

    @precondition(lambda self: not self.in_fake_mode() and bool(self.own("shaped")))
    @rule(data=st.data(), dim=st.integers(-3, 2), size=st.one_of(st.none(), st.integers(0, 3)))
    def reconstrain(self, data: st.DataObject, dim: int, size: int | None) -> None:
        name = data.draw(st.sampled_from(self.own("shaped")), label="name")
        obj = self.model.own[name]
        attribute = getattr(self.m, name)
        assert obj.data is not None
        t = obj.data.t
        constraints = dict(obj.constraints)
        what = f"m.{name}.reconstrain({dim}, {size})"
        if size is None:
            if dim not in constraints:
                with fails_cleanly(self.m, ValueError, what=what):
                    attribute.reconstrain(dim, size)
                return
            del constraints[dim]
            if not ignored(t) and not satisfies(tuple(t.shape), constraints, obj.strict):
                with fails_cleanly(self.m, ValueError, what=what):
                    attribute.reconstrain(dim, size)
                return
            result = attribute.reconstrain(dim, size)
            obj.constraints = constraints
            assert result is attribute.value
            return
        constraints[dim] = size
        if ignored(t):
            result = attribute.reconstrain(dim, size)
            obj.constraints = constraints
            assert result is attribute.value
            return
        assert t is not None
        ndim = t.dim()
        in_range = -ndim <= dim < ndim
        shape = list(t.shape)
        if in_range:
            shape[dim] = size
        if not in_range or not satisfies(tuple(shape), constraints, obj.strict):
            with fails_cleanly(self.m, ValueError, what=what):
                attribute.reconstrain(dim, size)
            return
        result = attribute.reconstrain(dim, size)
        obj.constraints = constraints
        obj.data = Slot(resized(t, dim, size), obj.data.known) if t.shape[dim] != size else obj.data
        assert result is attribute.value

    @precondition(lambda self: not self.in_fake_mode() and bool(self.own("shaped")))
    @rule(data=st.data(), none=st.booleans(), ndim=st.integers(1, 3), dtype=st.sampled_from(FLOATS))
    def shaped_assign(self, data: st.DataObject, none: bool, ndim: int, dtype: torch.dtype) -> None:
        name = data.draw(st.sampled_from(self.own("shaped")), label="name")
        obj = self.model.own[name]
        attribute = getattr(self.m, name)
        assert obj.data is not None
        value = None
        if not none:
            shape = tuple(data.draw(st.integers(0 if ndim == 1 else 1, 3), label="size") for _ in range(ndim))
            value = values_of(shape, data.draw(st.integers(0, 5), label="base"), dtype)
        what = f"m.{name}.value = {describe(value)}"
        if obj.live and not ignored(value) and not satisfies(tuple(value.shape), obj.constraints, obj.strict):
            with fails_cleanly(self.m, ValueError, what=what):
                attribute.value = value
            return
        current = obj.data.t
        if obj.param and value is not None and current is not None and current.is_meta:
            # torch refuses `.data =` across meta and cpu: either the value is stored, or nothing changes.
            before = snapshot(self.m)
            _, error = attempt(lambda: setattr(attribute, "value", value.clone()))
            if error is not None:
                assert same(before, snapshot(self.m)), f"{what}: failed ({error!r}) and changed the module"
                return
        else:
            attribute.value = None if value is None else value.clone()
        obj.data = Slot(value, True)

    # -- delete, re-create, alias

    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        names = sorted({*self.model.own, *self.model.aliases})
        if not names:
            return
        name = data.draw(st.sampled_from(names), label="name")
        delattr(self.m, name)
        self.unbind(self.model, name)
        self.release()

    @precondition(lambda self: not self.in_fake_mode())
    @rule(name=st.sampled_from(NAMES), spec=st.one_of(vspecs(valid=False), sspecs(valid=False)))
    def create(self, name: str, spec: VSpec | SSpec) -> None:
        what = f"{'VirtualTensor' if isinstance(spec, VSpec) else 'ShapedTensor'}(m, {name!r}, {spec})"
        if not spec.valid():
            with fails_cleanly(self.m, ValueError, what=what):
                spec.create(self.m, name)
            return
        alias = self.model.aliases.get(name)
        if alias is not None:
            # The docs: creating an attribute under the alias's name raises ValueError, leaving the original alone.
            with fails_cleanly(self.m, ValueError, what=f"{what} over an alias"):
                spec.create(self.m, name)
            return
        attribute = spec.create(self.m, name)
        self.supersede(self.model, name)
        maker = virtual_obj if isinstance(spec, VSpec) else shaped_obj
        obj = maker(self.model, name, spec)
        obj.weak = weakref.ref(attribute)
        self.model.own[name] = obj
        del attribute
        self.release()

    @rule(data=st.data(), source_name=st.sampled_from(["own", "peer"]), into=st.sampled_from(["m", "peer"]))
    def alias(self, data: st.DataObject, source_name: str, into: str) -> None:
        target = source_name
        source = self.model if target == "own" else self.peer_model
        if not source.own:
            return
        source_module = self.m if target == "own" else self.peer
        name = data.draw(st.sampled_from(sorted(source.own)), label="of")
        obj = source.own[name]
        if into == "m":
            module, model = self.m, self.model
            aname = data.draw(st.sampled_from([n for n in NAMES if n != name or target != "own"]), label="as")
        else:
            if target == "peer":
                return
            module, model, aname = self.peer, self.peer_model, "t_alias"
        setattr(module, aname, getattr(source_module, name))
        self.unbind(model, aname)
        model.aliases[aname] = obj
        self.release()

    @rule(data=st.data(), into=st.sampled_from(["m", "peer"]))
    def detached_setter(self, data: st.DataObject, into: str) -> None:
        """Every setter and method of an attribute that is no longer its module's raises ``ReferenceError``."""
        module, model = (self.m, self.model) if into == "m" else (self.peer, self.peer_model)
        stale = sorted(name for name, obj in model.aliases.items() if obj.status != "bound" and not obj.lenient)
        if not stale:
            return
        name = data.draw(st.sampled_from(stale), label="alias")
        attribute = getattr(module, name)
        if isinstance(attribute, VirtualTensor):
            operations: dict[str, Any] = {
                "persist": lambda: setattr(attribute, "persist", True),
                "follow_dtype": lambda: setattr(attribute, "follow_dtype", False),
                "to": lambda: attribute.to(torch.float64),
                "dtype": lambda: setattr(attribute, "dtype", torch.float64),
                "device": lambda: setattr(attribute, "device", "cpu"),
                "invalidate": attribute.invalidate,
            }
        else:
            operations = {
                "live": lambda: setattr(attribute, "live", True),
                "strict": lambda: setattr(attribute, "strict", False),
                "persist_data": lambda: setattr(attribute, "persist_data", True),
                "persist_constraints": lambda: setattr(attribute, "persist_constraints", True),
                "value": lambda: setattr(attribute, "value", None),
                "reconstrain": lambda: attribute.reconstrain(0, 1),
            }
        operation = data.draw(st.sampled_from(sorted(operations)), label="operation")
        owner = attribute.owner
        watched = [module] if owner is None or owner is module else [module, owner]
        befores = [snapshot(w) for w in watched]
        _, error = attempt(operations[operation])
        what = f"{model.label}.{name}.{operation} ({model.aliases[name].status})"
        assert isinstance(error, ReferenceError), f"{what}: expected ReferenceError, got {error!r}"
        for w, before in zip(watched, befores, strict=True):
            assert same(before, snapshot(w)), f"{what}: raised, and changed {type(w).__name__}"

    @precondition(lambda self: not self.in_fake_mode())
    @rule(device=st.sampled_from((None, "cpu")), dtype=st.sampled_from((None, *DTYPES)))
    def sync_references(self, device: str | None, dtype: torch.dtype | None) -> None:
        pending = [obj for obj in self.model.own.values() if obj.kind == "virtual" and obj.slot.t.is_meta]
        loaded = first_real_floating(self.m)
        what = f"sync_references(m, device={device}, dtype={dtype})"
        if not pending:
            modattrs.sync_references(self.m, device=device, dtype=dtype)
            return
        if device is None and loaded is None:
            with fails_cleanly(self.m, ValueError, what=what):
                modattrs.sync_references(self.m, device=device, dtype=dtype)
            return
        target_device = device if device is not None else loaded.device  # type: ignore[union-attr]
        target_dtype = dtype if dtype is not None else (None if loaded is None else loaded.dtype)
        if target_dtype is not None and target_dtype not in FLOATS and any(o.mode == "follow" for o in pending):
            with fails_cleanly(self.m, ValueError, what=what):
                modattrs.sync_references(self.m, device=device, dtype=dtype)
            return
        modattrs.sync_references(self.m, device=device, dtype=dtype)
        for obj in pending:
            assert obj.ref is not None
            assert obj.ref.t is not None
            # only an attribute that follows the module takes the dtype
            ref_dtype = target_dtype if obj.mode == "follow" and target_dtype is not None else obj.ref.t.dtype
            obj.ref.t = torch.empty(0, dtype=ref_dtype, device=target_device)

    # -- load_state_dict

    @precondition(lambda self: not self.in_fake_mode())
    @rule(data=st.data(), strict=st.booleans(), assign=st.booleans())
    def load_state_dict(self, data: st.DataObject, strict: bool, assign: bool) -> None:
        checkpoint = self.draw_checkpoint(data)
        note(f"checkpoint: { {k: describe(v) for k, v in checkpoint.items()} }")
        self.collect_fake_modes()
        expect_error, missing, unexpected = self.model_load(checkpoint, strict, assign)
        with warnings.catch_warnings():
            # torch warns that copying into a meta tensor without assign=True does nothing: that is modelled.
            warnings.filterwarnings("ignore", "for .*: copying from a non-meta parameter", UserWarning)
            result, error = attempt(lambda: self.m.load_state_dict(checkpoint, strict=strict, assign=assign))
        self.finish_load()
        if expect_error:
            assert isinstance(error, RuntimeError), f"load_state_dict: expected a RuntimeError, got {error!r}"
            return
        if error is not None:
            raise AssertionError(f"load_state_dict raised {error!r}") from error
        assert set(result.missing_keys) == missing, f"missing keys {result.missing_keys}, expected {missing}"
        assert set(result.unexpected_keys) == unexpected, f"unexpected {result.unexpected_keys}, expected {unexpected}"

    def draw_checkpoint(self, data: st.DataObject) -> dict[str, Tensor]:
        """A checkpoint shaped like the main module's state_dict, drawn from the model."""
        model = self.model
        meta = data.draw(st.integers(0, 4), label="meta checkpoint") == 0  # torch.load(..., map_location="meta")
        dtype = data.draw(st.sampled_from((None, *FLOATS)), label="checkpoint dtype")
        base = data.draw(st.integers(-2, 2), label="checkpoint base")
        checkpoint: dict[str, Tensor] = {}

        def real(t: Tensor, shape: tuple[int, ...] | None = None) -> Tensor:
            shape = tuple(t.shape) if shape is None else shape
            target = t.dtype if dtype is None or not t.is_floating_point() else dtype
            return values_of(shape, base, target)

        assert model.scale.t is not None
        checkpoint["scale"] = real(model.scale.t)
        for obj in model.objects():
            t = obj.slot.t
            if obj.kind == "virtual":
                assert t is not None
                if obj.persistent or (obj.status == "bound" and data.draw(st.integers(0, 4), label="extra ref") == 0):
                    ref_dtype = data.draw(st.sampled_from((None, *DTYPES)), label=f"{obj.derived} dtype")
                    checkpoint[obj.derived] = torch.empty(0, dtype=ref_dtype or real(t).dtype)
                continue
            if not (obj.persistent or obj.param):
                continue
            if t is None:
                # Data for a placeholder. (Not from a meta checkpoint: whether a placeholder takes data without
                # values when assign=False is not specified.)
                if obj.status != "bound" or meta or not data.draw(st.booleans(), label=f"fill {obj.derived}"):
                    continue
                shape = tuple(data.draw(st.integers(1, 3), label="size") for _ in range(data.draw(st.integers(1, 3))))
                checkpoint[obj.derived] = values_of(shape, base, dtype or torch.float32)
                continue
            shape = list(t.shape)
            if t.dim() and data.draw(st.integers(0, 2), label=f"resize {obj.derived}") == 0:
                shape[data.draw(st.integers(0, t.dim() - 1), label="dim")] = data.draw(st.integers(0, 3), label="to")
            checkpoint[obj.derived] = real(t, tuple(shape))
        for obj in model.own.values():
            if obj.kind == "shaped" and (obj.persist_constraints or data.draw(st.integers(0, 3), label="extra c") == 0):
                assert obj.data is not None
                saved = data.draw(
                    st.sampled_from(["own", "other", "none", "malformed"]), label=f"_{obj.name}_constraints"
                )
                if saved == "none":
                    continue
                if saved == "malformed":
                    checkpoint[f"_{obj.name}_constraints"] = torch.zeros(3)
                    continue
                constraints = dict(obj.constraints)
                if saved == "other":
                    constraints = {data.draw(st.integers(-3, 2), label="dim"): data.draw(st.integers(0, 3))}
                ndim = 0 if obj.data.t is None else obj.data.t.dim()
                checkpoint[f"_{obj.name}_constraints"] = encode(constraints, ndim)
        keys = sorted(checkpoint)
        for key in data.draw(st.sets(st.sampled_from(keys), max_size=2) if keys else st.just(set()), label="drop"):
            del checkpoint[key]
        if data.draw(st.integers(0, 5), label="unexpected") == 0:
            checkpoint["bogus"] = torch.zeros(1)
        if meta:
            checkpoint = {key: t.to("meta") for key, t in checkpoint.items()}
        return checkpoint

    def model_load(self, checkpoint: dict[str, Tensor], strict: bool, assign: bool) -> tuple[bool, set, set]:
        """What ``load_state_dict`` does, from torch's rules and modattrs' docs; the model is updated."""
        model = self.model
        sd = dict(checkpoint)
        errors = False
        itself = object()  # a key made a copy of the current tensor onto itself

        def keep(key: str, current: Tensor | None) -> bool:
            """A failing attribute: its key, if any, loads its current data onto itself (an error is reported)."""
            if current is None:
                sd.pop(key, None)
            elif key in sd:
                sd[key] = itself  # type: ignore[assignment]
            return True

        # Pre-hooks: the bound attributes.
        for obj in model.own.values():
            if obj.kind == "virtual":
                key = obj.derived
                if obj.persistent:
                    if key not in sd:
                        sd[key] = itself  # type: ignore[assignment]
                    elif obj.mode != "fixed" and not (sd[key].dtype.is_floating_point or sd[key].dtype.is_complex):
                        # The docs: a dtype the attribute cannot follow is not taken; the device is.
                        assert obj.ref is not None
                        assert obj.ref.t is not None
                        sd[key] = torch.empty(0, dtype=obj.ref.t.dtype, device=sd[key].device)
                else:
                    sd.pop(key, None)
                continue
            assert obj.data is not None
            saved = sd.pop(f"_{obj.name}_constraints", None)  # consumed in any case
            key = obj.derived
            current = obj.data.t
            constraints = obj.constraints
            if saved is not None and obj.persist_constraints and not saved.is_meta:  # meta: no values to read
                decoded = decode(saved)
                if decoded is None:
                    errors = keep(key, current)  # malformed constraints: the attribute keeps data and constraints
                    continue
                constraints = decoded
            loaded = sd.get(key) if (obj.persistent or obj.param) else None
            if loaded is None and constraints is obj.constraints:
                continue  # nothing for this attribute: its data is left alone, valid or not
            if loaded is not None and loaded.is_meta and not assign and (current is None or not current.is_meta):
                errors = keep(key, current)  # no values to copy into data that has them
                continue
            incoming = loaded if loaded is not None else current
            if not ignored(incoming) and not satisfies(tuple(incoming.shape), constraints, obj.strict):
                errors = keep(key, current)
                continue
            if loaded is not None and (current is None or current.shape != loaded.shape):
                template = loaded if current is None else current
                if loaded.is_meta and not template.is_meta:
                    errors = keep(key, current)  # the saved data cannot be copied
                    continue
                obj.data = Slot(loaded.to(dtype=template.dtype, device=template.device), True)
            obj.constraints = constraints
        # torch: every parameter and persistent buffer.
        local = model.registered()
        local_state = {}
        for name, obj in local.items():
            slot = model.scale if obj is None else obj.slot
            if slot.t is None:
                continue
            if obj is not None and not (obj.param or obj.persistent):
                continue
            local_state[name] = slot
        for name, slot in local_state.items():
            if name not in sd or sd[name] is itself:
                continue
            incoming = sd[name]
            assert slot.t is not None
            if incoming.shape != slot.t.shape:
                errors = True  # size mismatch
                continue
            if assign:
                slot.t, slot.known = incoming.clone(), not incoming.is_meta
            elif not slot.t.is_meta:
                if incoming.is_meta:
                    errors = True  # torch cannot copy out of a meta tensor
                    continue
                slot.t, slot.known = incoming.to(slot.t.dtype), True
        missing = {name for name in local_state if name not in sd}
        unexpected = {key for key in sd if key not in local_state}
        if strict and (missing or unexpected):
            errors = True
        return errors, missing, unexpected

    def finish_load(self) -> None:
        """Post-hooks: a reference left on meta, or given a dtype it cannot follow, goes where the loaded data is."""
        loaded = first_real_floating(self.m)
        for obj in self.model.own.values():
            if obj.kind != "virtual":
                continue
            assert obj.ref is not None
            assert obj.ref.t is not None
            ref = obj.ref.t
            follows = obj.mode != "fixed"  # a dtype_from attribute's reference follows the module (its dtype unused)
            if not ref.is_meta and not (follows and not (ref.dtype.is_floating_point or ref.dtype.is_complex)):
                continue
            if loaded is None:
                continue
            device = loaded.device if ref.is_meta else ref.device
            obj.ref.t = torch.empty(0, dtype=loaded.dtype if follows else ref.dtype, device=device)

    # -- copies

    @precondition(lambda self: not self.in_fake_mode())
    @rule(how=st.sampled_from(["deepcopy", "pickle", "torch.save"]), keep_copy=st.booleans())
    def copy_module(self, how: str, keep_copy: bool) -> None:
        # Copying or pickling a module copies what its attributes reach: other modules, through aliases of their
        # attributes. A detached attribute among them cannot be (the docs: its methods raise ReferenceError).
        reached, todo, stale = {id(self.model)}, [self.model], False
        while todo:
            for obj in todo.pop().aliases.values():
                stale = stale or obj.status != "bound"
                if obj.status == "bound" and id(obj.host) not in reached:
                    reached.add(id(obj.host))
                    todo.append(obj.host)
        before = snapshot(self.m)
        if how == "deepcopy":
            twin, error = attempt(lambda: copy.deepcopy(self.m))
        elif how == "pickle":
            twin, error = attempt(lambda: pickle.loads(pickle.dumps(self.m)))
        else:

            def save_and_load() -> Host:
                buffer = io.BytesIO()
                torch.save(self.m, buffer)
                buffer.seek(0)
                return torch.load(buffer, weights_only=False)

            twin, error = attempt(save_and_load)
        assert same(before, snapshot(self.m)), f"{how} changed the module"
        if error is not None:
            # A module holding an attribute that is no longer its owner's cannot be copied: an error naming it.
            assert stale, f"{how} raised {error!r}"
            assert isinstance(error, ReferenceError), f"{how} raised {error!r}"
            return
        self.generation += 1
        label = f"m{self.generation}"
        model, mapping = self.model.clone(label)
        aliased = {id(obj) for obj in self.model.aliases.values()}
        for original in self.model.held:
            # Registered by an attribute deleted from the module that something outside it holds: the copy has the
            # tensors and no attribute that could ever remove them. (Held by an alias in the module, it was copied
            # too, which is not specified: only an error or a correct value is expected of it.)
            copied = mapping[id(original)]
            copied.status, copied.lenient = ("held", True) if id(original) in aliased else ("orphan", False)
        for name, obj in self.model.aliases.items():
            if id(obj) in mapping:
                model.aliases[name] = mapping[id(obj)]
            else:
                # another module's attribute: copied with a copy of its module, which nothing holds
                other = obj.clone(obj.host)
                other.status = "ownerless"
                model.aliases[name] = other
        bind_objects(twin, model)
        if keep_copy:
            self.retire_main(twin, model)
        else:
            self.keep_bystander(twin, model)

    @precondition(lambda self: not self.in_fake_mode())
    @rule(table=vspecs(kind="table"), ramp=vspecs(kind="ramp"), state=sspecs(), meta=st.booleans())
    def rebuild(self, table: VSpec, ramp: VSpec, state: SSpec, meta: bool) -> None:
        self.generation += 1
        module, model = self.build({"table": table, "ramp": ramp, "state": state}, meta, f"m{self.generation}")
        self.retire_main(module, model)

    # -- the invariant

    # -- deferred initialization, materialized inside the open fake modes

    @rule(
        table=vspecs(kind="table"),
        state=sspecs(),
        build=st.sampled_from(["host", "batch norm", "linear and batch norm"]),
        how=st.sampled_from(sorted(DEFERRED_WAYS)),
        copy_first=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def materialize_a_deferred_module(
        self, table: VSpec, state: SSpec, build: str, how: str, copy_first: bool, seed: int
    ) -> None:
        # Materializing gives the eager values whatever fake modes are open, and a deep copy of the deferred module
        # (timm's ModelEmaV3) replays the same record again; the open modes are left as they were, and the generator
        # where eager construction leaves it.
        make = deferred_builds({"table": table, "state": state})[build]
        with unset_fake_temporarily():
            torch.manual_seed(seed)
            expected = real_state(make())
            generator = torch.get_rng_state()
            torch.manual_seed(seed)
            deferred = deferred_init(make)
            twin = copy.deepcopy(deferred) if copy_first else None
        before = current_fake_mode()
        DEFERRED_WAYS[how](deferred)
        materialize_module(deferred)  # what the first way left deferred
        if twin is not None:
            materialize_module(twin)
        assert current_fake_mode() is before
        with unset_fake_temporarily():
            assert torch.equal(torch.get_rng_state(), generator)
            for module in filter(None, (deferred, twin)):
                assert not is_deferred(module)
                got = real_state(module)
                assert got.keys() == expected.keys()
                for name, tensor in expected.items():
                    assert not is_fake(got[name]), name
                    assert got[name].dtype == tensor.dtype, name
                    assert torch.equal(got[name], tensor), name

    # -- torch's autograd functions, in a process where fake CUDA changed torch (tests/conftest.py)

    @precondition(lambda self: not self.in_fake_mode())
    @rule(
        call=st.sampled_from(["autograd.backward", "Tensor.backward", "autograd.grad"]),
        outputs=st.sampled_from(["tensor", "list", "tuple", "generator", "iterator"]),
        inputs=st.sampled_from([None, "tensor", "list", "tuple", "generator", "dict"]),
        gradients=st.sampled_from([None, "list", "generator"]),
        keywords=st.booleans(),
    )
    def autograd_argument_forms(
        self, call: str, outputs: str, inputs: str | None, gradients: str | None, keywords: bool
    ) -> None:
        w = torch.arange(3.0, requires_grad=True)
        v = torch.ones(2, requires_grad=True)
        expected = {"w": 2 * w.detach(), "v": torch.full((2,), 3.0)}
        if call == "Tensor.backward":
            outputs = "tensor"  # a method of one output
        if inputs == "dict" and not DICT_INPUTS[call]:
            inputs = "list"  # a form this torch does not take, with or without modattrs
        used = [(w * w).sum(), (v * 3).sum()][: 1 if outputs == "tensor" else 2]
        leaves = {"w": w, "v": v} if len(used) == 2 and inputs != "tensor" else {"w": w}
        grads = None if gradients is None else forms_of([torch.ones(()) for _ in used], gradients)
        if call == "Tensor.backward" and gradients is not None:
            grads = torch.ones(())
        targets = None if inputs is None else forms_of(list(leaves.values()), inputs)
        if call == "autograd.grad":
            targets = forms_of(list(leaves.values()), inputs or "list")
            arguments = {"outputs": forms_of(used, outputs), "inputs": targets, "grad_outputs": grads}
            result = torch.autograd.grad(**arguments) if keywords else torch.autograd.grad(*arguments.values())
            got = dict(result) if isinstance(result, dict) else dict(zip(leaves, result, strict=True))
        else:
            if call == "autograd.backward" and keywords:
                torch.autograd.backward(tensors=forms_of(used, outputs), grad_tensors=grads, inputs=targets)
            elif call == "autograd.backward":
                torch.autograd.backward(forms_of(used, outputs), grads, None, False, None, targets)
            elif keywords:
                used[0].backward(gradient=grads, inputs=targets)
            else:
                used[0].backward(grads, None, False, targets)
            got = {name: leaf.grad for name, leaf in leaves.items()}
        for name in leaves:
            assert got[name] is not None, f"{call} given {outputs} outputs filled no gradient of {name}"
            assert torch.equal(got[name], expected[name]), name

    @invariant()
    def everything_is_as_modelled(self) -> None:
        if self.m is None:
            return
        for module, model in self.hosts():
            check_host(module, model)


def first_real_floating(module: nn.Module) -> Tensor | None:
    """The docs' "first floating-point tensor with data": parameters first, then buffers."""
    tensors = [*module.parameters(), *module.buffers()]
    return next((t for t in tensors if t.is_floating_point() and t.numel() and not t.is_meta), None)


def bind_objects(module: nn.Module, model: HostModel) -> None:
    """Point the model's objects at the module's attributes: its own by name, and aliases not known yet."""
    for name, obj in model.own.items():
        obj.weak = weakref.ref(vars(module)[name])
    for name, obj in model.aliases.items():
        if obj.weak is None:
            obj.weak = weakref.ref(vars(module)[name])


# The profiles are registered in conftest.py; without --hypothesis-profile, this test runs the "ci" one.
_profile = settings.get_current_profile_name()
Composition.TestCase.settings = settings.get_profile("ci" if _profile == "default" else _profile)
TestComposition = Composition.TestCase
