"""Binding of a modattrs attribute to the module that owns it.

Both :class:`~modattrs.VirtualTensor` and :class:`~modattrs.ShapedTensor` are objects stored in their owner's
``__dict__`` under the attribute's name, and both register tensors and state-dict hooks on the owner under
*derived* names (``_{name}_ref``, ``_{name}_data``, ...). This module holds what they share:

* validation of the owner and of the names, done before anything is changed;
* a weak reference to the owner, so that an attribute never keeps its module alive;
* a finalizer that removes the derived names when the attribute goes away, unless a newer attribute of the
  same name has claimed them;
* per-attribute state-dict hooks, dispatched to the attribute currently bound under the name;
* rebinding on ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the module: an attribute reduces to its class,
  its owner and its own fields, so that the copy is bound to the copied module and gets a finalizer of its own.
"""

from __future__ import annotations

import copy
import keyword
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from modattrs._torch_private import (
    PUBLIC_STATE_DICT_HOOK_FLAG,
    buffers_of,
    module_initialized,
    non_persistent_buffers_of,
    parameters_of,
    state_dict_hook_tables,
    submodules_of,
)

__all__: list[str] = []

AttributeT = TypeVar("AttributeT", bound="OwnedAttribute")


class _Constructor:
    """``Kind.create``: the class itself, so ``Kind.create(...)`` takes exactly the constructor's arguments (a
    hand-written copy of its signature would drift from it) and returns what ``Kind(...)`` returns."""

    def __get__(self, instance: object, owner: type[AttributeT]) -> type[AttributeT]:
        return owner


class OwnedAttribute:
    """Base of the attributes that a module owns through its ``__dict__``."""

    __slots__ = ("__weakref__", "_hook_ids", "_lock", "_name", "_owner_ref")

    #: Suffixes of the names this kind of attribute registers on its owner, e.g. ``("ref",)``.
    _suffixes: ClassVar[tuple[str, ...]] = ()
    #: Suffixes of ``state_dict`` keys it adds without registering anything: names it needs free at creation, and
    #: never removes (a tensor registered under one later is somebody else's).
    _key_suffixes: ClassVar[tuple[str, ...]] = ()

    #: Create the attribute on its owner and return it: the same as calling the class.
    create = _Constructor()

    _owner_ref: weakref.ref[nn.Module]
    _name: str
    _hook_ids: tuple[int, int, int]
    _lock: threading.RLock  # held by every change of the attribute, so that threads change it one at a time

    def __init_subclass__(cls) -> None:
        super().__init_subclass__()
        _KINDS.update(dict.fromkeys(cls._suffixes, cls))

    @classmethod
    def _registers(cls, tensor: Tensor | None) -> bool:
        """Whether ``tensor``, found under one of this kind's derived names, can be what the attribute registered
        there, as opposed to somebody else's tensor registered under that name later."""
        return True

    def dependency_hint(self) -> str:
        """What a ``depends_on`` that names this attribute should name instead, for its error message."""
        return "name the tensors its materializer reads"

    @classmethod
    def _derived(cls, name: str) -> tuple[str, ...]:
        return tuple(f"_{name}_{suffix}" for suffix in cls._suffixes)

    @classmethod
    def _reserved(cls, name: str) -> tuple[str, ...]:
        return cls._derived(name) + tuple(f"_{name}_{suffix}" for suffix in cls._key_suffixes)

    @property
    def name(self) -> str:
        """Name of the attribute on its owner."""
        return self._name

    @property
    def owner(self) -> nn.Module | None:
        """The module that owns this attribute, or ``None`` once that module is gone."""
        return self._owner_ref()

    def _live_owner(self) -> nn.Module:
        """The owner, for an attribute that is still ``owner.<name>``; otherwise a clear error."""
        owner = self._owner_ref()
        if owner is None:
            raise self._owner_gone()
        if owner.__dict__.get(self._name) is not self:
            raise ReferenceError(
                f"this {type(self).__name__} {self._name!r} is detached: it was deleted from or replaced on its "
                f"{type(owner).__name__}; use {type(owner).__name__}.{self._name} instead of an old reference"
            )
        return owner

    def _replaced(self) -> ReferenceError:
        return ReferenceError(
            f"this {type(self).__name__} {self._name!r} is detached: a newer attribute of the same name replaced it "
            "on its module; read the module's attribute instead of an old reference"
        )

    def _where(self) -> str:
        owner = self._owner_ref()
        return "no owner" if owner is None else f"owner={type(owner).__name__}"

    def _owner_gone(self) -> ReferenceError:
        if self._owner_ref is _DETACHED:
            return self._replaced()
        return ReferenceError(
            f"{type(self).__name__} {self._name!r} has no owner: the module it belonged to was deleted.\n"
            "A temporary, as in Model().attr.value, is deleted at once.\n"
            "Copying (copy.deepcopy, pickle, fake_copy) a module that holds another module's attribute (an alias) "
            "copies that owner too, which nothing else holds.\n"
            "Keep a reference to the module while its attributes are used, and copy the module that owns them"
        )

    def _claim(self, owner: object, name: object) -> tuple[nn.Module, str]:
        """First step of construction: check ``owner`` and ``name`` before anything is changed, and remember them
        (so that later checks can name the attribute)."""
        module = check_owner(type(self).__name__, owner)
        checked = check_names(type(self), module, name)
        self._name = checked
        self._owner_ref = weakref.ref(module)
        self._lock = threading.RLock()
        return module, checked

    def _attach(self, owner: nn.Module, register: Callable[[], None]) -> None:
        """Last step of construction, once every check passed: take the name over from this module's earlier
        attribute of that name, register the derived tensors (``register``), and become ``owner.<name>``."""
        take_over(owner, self._name)
        register()
        bind(self, owner)

    # Subclasses override these three; the hooks below call them on the attribute bound under the name.
    def _on_state_dict(self, owner: nn.Module, state_dict: dict[str, Any], prefix: str) -> None:
        pass

    def _on_load(
        self, owner: nn.Module, state_dict: dict[str, Any], prefix: str, error_msgs: list[str], assign: bool
    ) -> None:
        pass

    def _on_loaded(self, owner: nn.Module) -> None:
        pass

    def __copy__(self) -> OwnedAttribute:
        # A second object bound to the same owner, name and hooks would remove them when it goes away.
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> OwnedAttribute:
        # The owner first: an alias (another module's reference to this attribute) may be reached before the
        # owner, and the owner's copy holds the copy of this attribute, which the alias must share.
        owner = copy.deepcopy(self._live_owner(), memo)
        copied = memo.get(id(self))
        if copied is None:
            copied = _rebuild(type(self), owner, copy.deepcopy(self._fields(), memo))
            memo[id(self)] = copied
        return copied

    # Copying and pickling. The owner is passed strongly: copy.deepcopy maps it through its memo to the module
    # being copied, and pickle to the module being unpickled (memoized before its state, so the cycle resolves).
    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self._live_owner(), self._fields()))

    def _fields(self) -> dict[str, Any]:
        """The attribute's own state: every slot but the binding to an owner."""
        return {
            slot: getattr(self, slot)
            for cls in type(self).__mro__
            for slot in cls.__dict__.get("__slots__", ())
            if slot not in _BINDING
        }

    def _rebind(self, owner: nn.Module) -> None:
        """Finish a copy bound to ``owner``, which may still be empty (being unpickled): do not read its state."""


_BINDING = frozenset({"__weakref__", "_owner_ref", "_lock"})


class _Nothing:
    """Stands for the owner of a replaced attribute: a weak reference to it is always dead."""


_DETACHED: weakref.ref[Any] = weakref.ref(_Nothing())


def _rebuild(cls: type[OwnedAttribute], owner: nn.Module, fields: dict[str, Any]) -> OwnedAttribute:
    attribute = cls.__new__(cls)
    for slot, value in fields.items():
        setattr(attribute, slot, value)
    attribute._owner_ref = weakref.ref(owner)
    attribute._lock = threading.RLock()
    attribute._rebind(owner)
    arm_finalizer(attribute)
    _note_bound(attribute, owner)
    _skip_hook_ids(attribute._hook_ids)
    return attribute


def _skip_hook_ids(ids: tuple[int, ...]) -> None:
    """Make sure that torch never hands out ``ids`` again in this process. Hook ids count from 0 in each process,
    and a module loaded from another process keeps its ids: the next hook registered on it, ours or anybody's,
    would take the place of one of these (hook dictionaries are keyed by id)."""
    with _bound_lock:
        RemovableHandle.next_id = max(RemovableHandle.next_id, max(ids) + 1)


# Every attribute bound to a module, by module and name, until a newer attribute takes the name over: take_over
# detaches them all, those deleted from the module but still held included (the module no longer knows them).
# Detaching makes their weak reference to the owner a dead one, which every read tests anyway: nothing is added to
# the hot path of VirtualTensor.value. Keyed by identity (modules may define __eq__), weakly on both sides.
_bound: WeakIdKeyDictionary = WeakIdKeyDictionary()
_bound_lock = threading.Lock()


def _note_bound(attribute: OwnedAttribute, owner: nn.Module) -> None:
    with _bound_lock:
        names: dict[str, list[weakref.ref[OwnedAttribute]]] = _bound.setdefault(owner, {})  # type: ignore[no-untyped-call]
        alive = [ref for ref in names.get(attribute._name, ()) if ref() is not None]
        names[attribute._name] = [*alive, weakref.ref(attribute)]


def _detach_all(owner: nn.Module, name: str) -> None:
    with _bound_lock:
        names: dict[str, list[weakref.ref[OwnedAttribute]]] | None = _bound.get(owner)  # type: ignore[no-untyped-call]
        for ref in names.pop(name, ()) if names is not None else ():
            attribute = ref()
            if attribute is not None:
                attribute._owner_ref = _DETACHED


def check_owner(kind: str, owner: object) -> nn.Module:
    if not isinstance(owner, nn.Module):
        raise TypeError(f"{kind} needs an nn.Module as its owner, got {type(owner).__name__}")
    if not module_initialized(owner):
        raise RuntimeError(f"{kind} cannot be attached to {type(owner).__name__} before nn.Module.__init__() ran")
    return owner


def check_names(kind: type[OwnedAttribute], owner: nn.Module, name: object) -> str:
    """Validate ``name`` and its derived names on ``owner``; raise before anything is changed.

    The name may be taken over only from this module's own attribute of that name (see :func:`take_over`): an
    alias (``module.name = other.attribute``) is an occupied name like any other instance attribute.
    """
    what = kind.__name__
    if not isinstance(name, str):
        raise TypeError(f"{what} name must be a str, got {type(name).__name__}")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{what} name must be a Python identifier that is not a keyword, got {name!r}")
    current = owner.__dict__.get(name)
    if isinstance(current, OwnedAttribute):
        if not _is_own(current, owner, name):
            raise ValueError(
                f"cannot create {what} {name!r}: {type(owner).__name__}.{name} is an alias of another attribute, "
                f"which is left as it is.\nalias of: {current!r}\n"
                f"Delete the alias first (del module.{name}) or choose another name"
            )
    elif _occupied(owner, name):
        raise ValueError(
            f"cannot create {what} {name!r}: {type(owner).__name__} already has an attribute {name!r} "
            f"({_describe(owner, name)}); choose another name or delete the attribute first"
        )
    claimed = {
        derived
        for hook in _hooks_of(owner, name)
        for derived in hook.derived
        if _kind_of(name, derived)._registers(buffers_of(owner).get(derived, parameters_of(owner).get(derived)))
    }
    for derived_name in kind._reserved(name):
        if derived_name not in claimed and _occupied(owner, derived_name):
            raise ValueError(
                f"cannot create {what} {name!r}: it stores its data as {derived_name!r}, which "
                f"{type(owner).__name__} already has ({_describe(owner, derived_name)}); choose another name"
            )
    return name


def _is_own(attribute: OwnedAttribute, owner: nn.Module, name: str) -> bool:
    return attribute._owner_ref() is owner and attribute._name == name


def take_over(owner: nn.Module, name: str) -> None:
    """Remove what earlier attributes named ``name`` registered, and detach them: the bound one, and any deleted
    from the module but still referenced elsewhere (their finalizers have not run). Call once validation passed."""
    for hooks in state_dict_hook_tables(owner):
        for hook_id, registered in list(hooks.items()):
            hook = _unwrap(registered)
            if isinstance(hook, _Hook) and hook.name == name:
                del hooks[hook_id]
                for derived_name in hook.derived:
                    remove_registered(owner, name, derived_name)
    _detach_all(owner, name)


def _hooks_of(owner: nn.Module, name: str) -> list[_Hook]:
    # Every attribute registers one SaveHook until its finalizer runs: the hooks are the record of who owns what.
    return [h for h in state_dict_hook_tables(owner)[0].values() if isinstance(h, SaveHook) and h.name == name]


def _unwrap(hook: object) -> object:
    # register_load_state_dict_pre_hook wraps hooks in torch's _WrappedHook, which keeps them as `.hook`.
    return getattr(hook, "hook", hook)


def _occupied(owner: nn.Module, name: str) -> bool:
    return (
        name in owner.__dict__
        or name in parameters_of(owner)
        or name in buffers_of(owner)
        or name in submodules_of(owner)
        or hasattr(type(owner), name)
    )


def _describe(owner: nn.Module, name: str) -> str:
    if name in parameters_of(owner):
        return "a parameter"
    if name in buffers_of(owner):
        return "a buffer"
    if name in submodules_of(owner):
        return "a submodule"
    if name in owner.__dict__:
        return f"an instance attribute of type {type(owner.__dict__[name]).__name__}"
    return f"a class attribute of {type(owner).__name__}"


def bind(attribute: OwnedAttribute, owner: nn.Module) -> None:
    """Install ``attribute`` as ``owner.<name>`` with its finalizer and state-dict hooks.

    Call this only after the derived names were registered: from here on, the attribute's death removes them.
    """
    attribute._hook_ids = register_hooks(owner, attribute._name, type(attribute)._derived(attribute._name))
    arm_finalizer(attribute)
    _note_bound(attribute, owner)
    setattr(owner, attribute._name, attribute)


def arm_finalizer(attribute: OwnedAttribute) -> None:
    # The callback and its arguments must not reference the owner strongly: the registry is global, so a
    # strong reference there would keep the module alive forever. The registry also keeps the finalizer alive.
    finalizer = weakref.finalize(
        attribute,
        _release,
        attribute._owner_ref,
        attribute._name,
        type(attribute)._derived(attribute._name),
        attribute._hook_ids,
    )
    finalizer.atexit = False


def _release(
    owner_ref: weakref.ref[nn.Module], name: str, derived: tuple[str, ...], hook_ids: tuple[int, int, int]
) -> None:
    owner = owner_ref()
    if owner is None:
        return
    save, load, loaded = hook_ids
    save_hooks, load_hooks, loaded_hooks = state_dict_hook_tables(owner)
    save_hooks.pop(save, None)
    load_hooks.pop(load, None)
    loaded_hooks.pop(loaded, None)
    current = current_attribute(owner, name)
    kept = type(current)._derived(name) if current is not None else ()
    for derived_name in derived:
        if derived_name not in kept:
            remove_registered(owner, name, derived_name)


def set_persistent(owner: nn.Module, buffer: str, persist: bool) -> None:
    """Put the owner's buffer into its ``state_dict``, or take it out."""
    if persist:
        non_persistent_buffers_of(owner).discard(buffer)
    else:
        non_persistent_buffers_of(owner).add(buffer)


def remove_registered(owner: nn.Module, name: str, derived_name: str) -> None:
    """Remove what attribute ``name`` registered as ``derived_name``, unless a tensor registered there later by
    somebody else replaced it (see :meth:`OwnedAttribute._registers`)."""
    tensor = buffers_of(owner).get(derived_name, parameters_of(owner).get(derived_name))
    if tensor is not None and not _kind_of(name, derived_name)._registers(tensor):
        return
    parameters_of(owner).pop(derived_name, None)
    buffers_of(owner).pop(derived_name, None)
    non_persistent_buffers_of(owner).discard(derived_name)
    owner.__dict__.pop(derived_name, None)


def _kind_of(name: str, derived_name: str) -> type[OwnedAttribute]:
    return _KINDS.get(derived_name[len(name) + 2 :], OwnedAttribute)


#: The kind of attribute that registers each suffix.
_KINDS: dict[str, type[OwnedAttribute]] = {}


def register_hooks(owner: nn.Module, name: str, derived: tuple[str, ...]) -> tuple[int, int, int]:
    """Register the state-dict hooks of attribute ``name`` and return their ids (kept by copies of the module)."""
    save = owner.register_state_dict_post_hook(SaveHook(name, derived))  # type: ignore[no-untyped-call]
    load = owner.register_load_state_dict_pre_hook(LoadHook(name, derived))  # type: ignore[no-untyped-call]
    loaded = owner.register_load_state_dict_post_hook(LoadedHook(name, derived))  # type: ignore[no-untyped-call]
    return save.id, load.id, loaded.id


def own_attributes(module: nn.Module) -> list[OwnedAttribute]:
    """The modattrs attributes bound to ``module`` under their own names: aliases of attributes of other names or
    other modules are left out, as they are their owners' business."""
    return [
        value
        for name, value in list(module.__dict__.items())
        if isinstance(value, OwnedAttribute) and _is_own(value, module, name)
    ]


def current_attribute(module: nn.Module, name: str) -> OwnedAttribute | None:
    """The attribute bound to ``module`` as ``name``: not an alias there of another module's (or name's)."""
    attribute = module.__dict__.get(name)
    return attribute if isinstance(attribute, OwnedAttribute) and _is_own(attribute, module, name) else None


# The hooks are small objects naming the attribute, not bound methods: a module holding a bound method of itself
# would be a reference cycle. They pickle as (class, name), so a weights_only load needs only these classes.
class _Hook:
    __slots__ = ("derived", "name")

    def __init__(self, name: str, derived: tuple[str, ...]) -> None:
        self.name = name
        self.derived = derived  # what the attribute registered: a record for take_over

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.name, self.derived))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class SaveHook(_Hook):
    __slots__ = (PUBLIC_STATE_DICT_HOOK_FLAG,)  # as register_state_dict_post_hook sets it: the hook edits in place

    def __init__(self, name: str, derived: tuple[str, ...]) -> None:
        super().__init__(name, derived)
        setattr(self, PUBLIC_STATE_DICT_HOOK_FLAG, True)

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: object) -> None:
        attribute = current_attribute(module, self.name)
        if attribute is not None:
            attribute._on_state_dict(module, state_dict, prefix)


class LoadHook(_Hook):
    __slots__ = ()

    def __call__(
        self,
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: Mapping[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        attribute = current_attribute(module, self.name)
        if attribute is not None:
            assign = bool(local_metadata.get("assign_to_params_buffers", False))
            attribute._on_load(module, state_dict, prefix, error_msgs, assign)


class LoadedHook(_Hook):
    __slots__ = ()

    def __call__(self, module: nn.Module, incompatible_keys: object) -> None:
        attribute = current_attribute(module, self.name)
        if attribute is not None:
            attribute._on_loaded(module)


def stored_tensor(owner: nn.Module, name: str) -> Tensor | None:
    """The buffer or parameter registered as ``name``; ``KeyError`` when there is neither."""
    buffers = buffers_of(owner)
    if name in buffers:
        return buffers[name]
    return parameters_of(owner)[name]
