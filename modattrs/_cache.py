"""Caches of :class:`~modattrs.VirtualTensor` values: each attribute's lasting cache, and ``modattrs.cached()``.

A cached value is reused while the *state* it was computed in holds: the same reference buffer object, of the
same class, dtype and device (all that a zero-element tensor says: every conversion of a module replaces its
buffers, ``ref.data = ...`` and ``torch.utils.swap_tensors`` change them inside the object, so this covers dtype,
device and fake-ness changes by any route), the same dtype, the same grad and inference modes, the same fake mode,
and unchanged declared dependencies. The state is compared field by field.

A value computed inside a fake mode is kept apart from the value computed outside every fake mode: reading in a
fake mode never replaces, and is never served, the real value. Only fake modules keep values read in a fake mode
lastingly.

:func:`read` makes every decision of a read that is not a plain computation: compiling or not, which fake mode the
read belongs to, and which entry, if any, serves it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from modattrs._torch_private import (
    FakeTensor,
    FakeTensorMode,
    active_fake_mode,
    address_of,
    buffers_of,
    dispatch_mode_count,
    parameters_of,
    submodules_of,
    version_of,
)

__all__ = ["cached"]

#: Scopes open in any thread: a cheap test on the hot path before the thread-local one.
open_scopes = 0
_scopes_lock = threading.Lock()
_local = threading.local()

# Looked up once, for the hot path of read(). dynamo knows is_compiling by the function object, whatever its name.
_compiling = torch.compiler.is_compiling
_dispatch_modes = dispatch_mode_count


@contextlib.contextmanager
def cached() -> Iterator[None]:
    """Materialize every :class:`~modattrs.VirtualTensor` at most once per state inside the block.

    Inside the block, reading ``value`` of any attribute, cached or not, computes it once and then returns the same
    tensor while the state it was computed in holds, autograd graph included: one forward and backward pass can
    read a value many times and backpropagate through it once. Nothing is kept after the block. The scope belongs
    to the thread that opens it; nested blocks share the outermost one.
    """
    global open_scopes
    outermost = getattr(_local, "values", None) is None
    if outermost:
        _local.values = {}
    with _scopes_lock:
        open_scopes += 1
    try:
        yield
    finally:
        with _scopes_lock:
            open_scopes -= 1
        if outermost:
            del _local.values


def scope() -> dict[int, Entry] | None:
    """This thread's scoped cache, by attribute id, if a ``cached()`` block is open in it."""
    values: dict[int, Entry] | None = getattr(_local, "values", None)
    return values


class Cached(Protocol):
    """What :func:`read` needs of an attribute (:class:`~modattrs.VirtualTensor`)."""

    _cache: Cache | None  # the lasting cache, if the attribute keeps its value
    _depends_on: tuple[str, ...]
    _dtype_from: str | None  # set when the dtype can change while the reference stays the same
    _name: str

    def _compute(self, owner: nn.Module, ref: Tensor) -> Tensor: ...

    def _value_dtype(self, owner: nn.Module, ref: Tensor) -> torch.dtype: ...

    def _reference_gone(self) -> RuntimeError: ...


def read(attribute: Cached, owner: nn.Module, ref: Tensor | None) -> Tensor:
    """The value of ``attribute`` for a read of its reference buffer ``ref``, computed or served from a cache.

    The decisions, in order:

    1. A plain reference, a value kept from a read outside every fake mode, no compilation, no dispatch mode, no
       ``cached()`` block, unchanged dependencies: that value (the hot path).
    2. Compiling: computed, in the graph. A kept tensor would be lifted as a constant, stale after any change; and
       dynamo cannot trace the mode lookups below.
    3. The fake mode the read belongs to: the active one, or the reference's own when none is active (a fake
       module read outside its mode is computed in it, as the same state). Under another kind of dispatch mode
       (export, a counter), or with a fake mode that is not the reference's own (torch refuses to mix them and
       says so), the value is computed and not kept.
    4. An entry of this thread's ``cached()`` block, then of the attribute's lasting cache, computed in the same
       state; otherwise computed, and kept where it may be.
    """
    cache = attribute._cache
    if cache is not None and not open_scopes:
        # cache.entry only ever holds a value read outside every fake mode, of a reference that is not fake.
        # Conversions replace the reference, but `ref.data = ...` (FSDP2's fully_shard moves buffers so) and
        # torch.utils.swap_tensors keep the object: its class (swapping in a fake tensor makes it fake), dtype and
        # device are compared too. A fixed dtype changes only through the attribute, which then clears the cache.
        entry = cache.entry
        if (
            entry is not None
            and entry.ref is ref
            and type(ref) is entry.ref_type
            and entry.hot
            and not _compiling()
            and not _dispatch_modes()
            and ref.dtype is entry.ref_dtype
            and ref.device == entry.device
            and (not entry.dependencies or entry.unchanged(owner))
        ):
            return entry.value
    if ref is None:
        raise attribute._reference_gone()
    if torch.compiler.is_compiling():
        return attribute._compute(owner, ref)
    mode, enter, keep = _modes_of(ref)
    values = scope()
    if not keep or (cache is None and values is None):
        return _compute_in(enter, attribute, owner, ref)
    dtype = attribute._value_dtype(owner, ref)
    if values is not None:
        entry = values.get(id(attribute))
        if entry is not None and entry.current(owner, ref, dtype, mode):
            return entry.value
    # Taken before computing: a dependency changed meanwhile makes the entry stale, never wrongly current.
    snapshot = snapshot_of(owner, attribute._depends_on, attribute._name)
    if cache is None:
        value = _compute_in(enter, attribute, owner, ref)
    else:
        with cache.lock:  # concurrent readers compute once
            entry = cache.get(mode)
            if entry is not None and entry.current(owner, ref, dtype, mode):
                return entry.value
            generation = cache.generation
            value = _compute_in(enter, attribute, owner, ref)
            # A value with an autograd graph is never kept: backward frees the graph. Nor one whose cache was
            # cleared while it was computed (by the materializer itself, or another thread). Nor a real module's
            # value read inside a fake mode: it would keep the mode alive, and with it the weak references the
            # mode holds to the module's tensors, which torch.utils.swap_tensors (Module.to in swap mode) refuses.
            if not keeps_graph(value) and (mode is None or isinstance(ref, FakeTensor)) and _keepable(value, mode):
                cache.put(mode, Entry(ref, dtype, mode, snapshot, value, attribute._dtype_from is None), generation)
    if values is not None and _keepable(value, mode):
        values[id(attribute)] = Entry(ref, dtype, mode, snapshot, value, attribute._dtype_from is None)
    return value


def _keepable(value: Tensor, mode: FakeTensorMode | None) -> bool:
    """Whether ``value``, read in ``mode``, may be kept for that mode. A fake value read outside every fake mode
    comes from fake tensors of the real module (a deferred submodule's, say) that will be replaced by real ones
    without the module seeing a change: the entry for real values never holds it."""
    return mode is not None or not isinstance(value, FakeTensor)


def _modes_of(ref: Tensor) -> tuple[FakeTensorMode | None, FakeTensorMode | None, bool]:
    """For a read of ``ref``: the fake mode it belongs to (None: outside every fake mode), the mode to enter to
    compute it (None: the current one), and whether its value may be kept."""
    own = ref.fake_mode if isinstance(ref, FakeTensor) else None
    if not dispatch_mode_count():
        return own, own, True  # a fake reference read outside its mode: in its mode, as the same state
    active = active_fake_mode()
    if active is None:  # another kind of dispatch mode drives
        return None, own, False
    if own is not None and active is not own:  # another fake mode: computed as it is, for torch to refuse
        return active, None, False
    return active, None, True


def _compute_in(mode: FakeTensorMode | None, attribute: Cached, owner: nn.Module, ref: Tensor) -> Tensor:
    if mode is None:
        return attribute._compute(owner, ref)
    with mode:
        return attribute._compute(owner, ref)


class Entry:
    """A value and what it was computed from.

    The reference buffer object, with its class, dtype and device (``ref.data = ...`` and ``swap_tensors`` change
    them and keep the object), stands for the device, and for the dtype of attributes that follow the module; it is
    held strongly: it has no elements, and holding it keeps its id from being reused. Its TensorImpl is not
    compared: a zero-element tensor says nothing else, and the address of a TensorImpl swapped out and freed may be
    given to the next one. The value's dtype is kept too, for fixed dtypes and ``dtype_from``. See
    :func:`snapshot_of` for dependencies.
    """

    __slots__ = (
        "dependencies",
        "device",
        "dtype",
        "grad",
        "hot",
        "inference",
        "mode",
        "plain",
        "ref",
        "ref_dtype",
        "ref_type",
        "value",
    )

    def __init__(
        self,
        ref: Tensor,
        dtype: torch.dtype,
        mode: object,
        dependencies: list[Dependency],
        value: Tensor,
        ref_implies_dtype: bool,
    ) -> None:
        self.ref = ref
        self.ref_type = type(ref)  # swap_tensors with a fake tensor makes a real reference fake
        self.ref_dtype = ref.dtype
        self.device = ref.device
        self.dtype = dtype  # for dtype_from, whose dtype changes without the reference
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.mode = mode
        self.dependencies = dependencies
        self.value = value
        # Computed with grad enabled and outside inference mode (and, having been kept, with no graph): valid in
        # any grad mode. A value computed under no_grad or in inference mode is reused only in that mode.
        self.plain = self.grad and not self.inference
        # What the hot path of read() may serve, checking the reference object and the dependencies only.
        self.hot = self.plain and mode is None and ref_implies_dtype

    def unchanged(self, owner: nn.Module) -> bool:
        """Whether the dependencies are as they were."""
        current: Any
        for table, name, saved, address, version, requires_grad, storage in self.dependencies:
            # (_table, inlined: this runs on every cache hit.)
            if table == _BUFFERS:
                current = buffers_of(owner).get(name, _MISSING)
            elif table == _PARAMETERS:
                current = parameters_of(owner).get(name, _MISSING)
            else:
                current = (submodules_of(owner) if table == _MODULES else owner.__dict__).get(name, _MISSING)
            if address is None:  # not a tensor: compared by identity, then equality
                if current is not saved and not _equal(current, saved):
                    return False
                continue
            if (
                current is not saved
                or address_of(current) != address
                or current.requires_grad is not requires_grad
                or (version >= 0 and version_of(current) != version)
            ):
                return False
            try:
                if storage is not None and current.untyped_storage() is not storage:
                    return False
            except (NotImplementedError, RuntimeError):  # swapped with a tensor that has no storage (sparse)
                return False
        return True

    def current(self, owner: nn.Module, ref: Tensor, dtype: torch.dtype, mode: object) -> bool:
        """Whether the value still holds for a read of ``ref`` as ``dtype`` in fake mode ``mode`` (or none)."""
        if self.ref is not ref or type(ref) is not self.ref_type or self.dtype is not dtype or self.mode is not mode:
            return False
        if ref.device != self.device:  # ref.data = ... or swap_tensors, on another device
            return False
        if not self.plain and (
            self.grad is not torch.is_grad_enabled() or self.inference is not torch.is_inference_mode_enabled()
        ):
            return False
        return self.unchanged(owner)


class Cache:
    """The lasting cache of one attribute, and a lock so that concurrent readers compute once.

    It keeps two entries at most: ``entry``, a value read outside every fake mode (the one the hot path of
    ``VirtualTensor.value`` looks at), and ``fake_entry``, a fake module's value read in a fake mode (the latest
    such mode).
    """

    __slots__ = ("entry", "fake_entry", "generation", "lock")

    def __init__(self) -> None:
        self.entry: Entry | None = None
        self.fake_entry: Entry | None = None
        # Taken by readers computing a value, so that concurrent readers compute once; reentrant, as a materializer
        # may read other attributes. Never by clear(): a materializer reading an attribute in one thread while
        # another thread's materializer invalidates it would otherwise deadlock.
        self.lock = threading.RLock()
        self.generation = 0  # counts clear() calls: a value computed across one is not kept

    def __reduce__(self) -> tuple[Any, ...]:
        return (Cache, ())  # copies and pickles start empty

    def get(self, mode: object) -> Entry | None:
        return self.entry if mode is None else self.fake_entry

    def put(self, mode: object, entry: Entry, generation: int) -> None:
        """Keep ``entry``, computed from the state at ``generation``, unless the cache was cleared since."""
        if generation != self.generation:
            return
        if mode is None:
            self.entry = entry
        else:
            self.fake_entry = entry
        if generation != self.generation:  # cleared meanwhile, after the test above: take it back
            self.clear()

    def clear(self) -> None:
        self.generation += 1  # first: a reader storing now sees it (readers store holding the lock, one at a time)
        self.entry = self.fake_entry = None


#: (which dictionary of the owner, name, value, TensorImpl address, version, requires_grad, storage); the last four
#: are None for a dependency that is not a tensor, the storage for a tensor that has none (a sparse one).
Dependency = tuple[int, str, Any, Any, Any, Any, Any]

_PARAMETERS, _BUFFERS, _MODULES, _ATTRIBUTES = range(4)


def _table(owner: nn.Module, table: int) -> dict[str, Any]:
    # Looked up through the owner at each check: an entry holding the owner's dictionaries would be a cycle.
    if table == _PARAMETERS:
        return parameters_of(owner)
    if table == _BUFFERS:
        return buffers_of(owner)
    return submodules_of(owner) if table == _MODULES else owner.__dict__


def snapshot_of(owner: nn.Module, names: tuple[str, ...], attribute: str) -> list[Dependency]:
    """The dependencies' current state: which of the owner's dictionaries holds each (read directly: ``getattr``
    on a module is slow), and its value. A tensor is held with its TensorImpl's address, version counter,
    ``requires_grad`` and storage: ``torch.utils.swap_tensors`` keeps the Python object and changes the TensorImpl,
    and ``tensor.data = ...`` keeps both and changes the storage without a version bump (which an inference tensor
    does not even have). It is held strongly, as any weak reference, Python's or the TensorImpl's, makes
    ``swap_tensors`` refuse it, and an id alone could be reused; so a replaced dependency stays alive until the next
    read or ``invalidate()``. The TensorImpl cannot be held (``swap_tensors`` refuses a tensor whose TensorImpl has
    another owner), so one swapped out and freed may give its address to the next one: the storage, held, is what
    tells them apart. Data that shares the held storage (``tensor.data = tensor.data.t()``) and bumps no version
    is not seen."""
    snapshot: list[Dependency] = []
    for name in names:
        table = next((i for i in (_PARAMETERS, _BUFFERS, _MODULES) if name in _table(owner, i)), _ATTRIBUTES)
        current = _table(owner, table).get(name, _MISSING)
        if current is _MISSING:
            raise AttributeError(
                f"VirtualTensor {attribute!r} depends on {name!r}, which is no longer a parameter, buffer, "
                f"submodule or instance attribute of {type(owner).__name__}.\n"
                "Was it parametrized or deleted? "
                f"Recreate VirtualTensor {attribute!r} with the depends_on its module has now"
            )
        if isinstance(current, Tensor):
            # Inference tensors have no version counter (and can be modified in place only in inference mode):
            # for them, all but the version.
            version = -1 if current.is_inference() else version_of(current)
            address, requires_grad = address_of(current), current.requires_grad
            snapshot.append((table, name, current, address, version, requires_grad, _storage_of(current)))
        else:
            snapshot.append((table, name, current, None, None, None, None))
    return snapshot


_MISSING = object()


def _storage_of(tensor: Tensor) -> torch.UntypedStorage | None:
    """``tensor``'s storage, the same object at each call while it lives; None for a tensor without one."""
    try:
        return tensor.untyped_storage()
    except (NotImplementedError, RuntimeError):  # sparse and other layouts without a storage
        return None


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an == that does not give a bool (arrays): not provably equal, so a change
        return False


def keeps_graph(value: Tensor) -> bool:
    """Whether ``value`` carries an autograd graph, which a lasting cache must not keep (it is freed by backward)."""
    return value.grad_fn is not None
