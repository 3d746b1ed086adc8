"""Caches of :class:`~modattrs.VirtualTensor` values: each attribute's lasting cache, and ``modattrs.cached()``.

A cached value is reused while the *state* it was computed in holds: the same reference buffer, object and
TensorImpl (every conversion of a module replaces its buffers, and ``torch.utils.swap_tensors``, which
``load_state_dict`` uses in swap mode, replaces the TensorImpl inside the object, so this covers dtype and device
changes by any route), the same dtype, the same grad and inference modes, the same fake mode, and unchanged
declared dependencies. The state is compared field by field.

A value computed inside a fake mode is kept apart from the value computed outside every fake mode: reading in a
fake mode never replaces, and is never served, the real value. (Only fake modules keep values read in a fake mode
lastingly: see ``VirtualTensor._value_slowly``.)
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["cached"]

#: Scopes open in any thread: a cheap test on the hot path before the thread-local one.
open_scopes = 0
_scopes_lock = threading.Lock()
_local = threading.local()


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


class Entry:
    """A value and what it was computed from.

    The reference buffer object stands for the device, and for the dtype of attributes that follow the module
    (conversions replace it); it is held strongly: it has no elements, and holding it keeps its id from being
    reused. The dtype is kept too, for fixed dtypes and ``dtype_from``. See :func:`snapshot_of` for dependencies.
    """

    __slots__ = ("dependencies", "dtype", "grad", "impl", "inference", "mode", "plain", "ref", "value")

    def __init__(
        self, ref: Tensor, dtype: torch.dtype, mode: object, dependencies: list[Dependency], value: Tensor
    ) -> None:
        self.ref = ref
        self.impl = ref._cdata  # swap_tensors keeps the object and replaces this
        self.dtype = dtype  # for dtype_from, whose dtype changes without the reference
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.mode = mode
        self.dependencies = dependencies
        self.value = value
        # Computed with grad enabled and outside inference mode (and, having been kept, with no graph): valid in
        # any grad mode. A value computed under no_grad or in inference mode is reused only in that mode.
        self.plain = self.grad and not self.inference

    def unchanged(self, owner: nn.Module) -> bool:
        """Whether the dependencies are as they were."""
        current: Any
        for table, name, saved, address, version, requires_grad in self.dependencies:
            # (_table, inlined: this runs on every cache hit.)
            if table == _BUFFERS:
                current = owner._buffers.get(name, _MISSING)
            elif table == _PARAMETERS:
                current = owner._parameters.get(name, _MISSING)
            else:
                current = (owner._modules if table == _MODULES else owner.__dict__).get(name, _MISSING)
            if address is None:  # not a tensor: compared by identity, then equality
                if current is not saved and not _equal(current, saved):
                    return False
                continue
            if (
                current is not saved
                or current._cdata != address
                or current.requires_grad is not requires_grad
                or (version >= 0 and current._version != version)
            ):
                return False
        return True

    def current(self, owner: nn.Module, ref: Tensor, dtype: torch.dtype, mode: object) -> bool:
        """Whether the value still holds for a read of ``ref`` as ``dtype`` in fake mode ``mode`` (or none)."""
        if self.ref is not ref or self.impl != ref._cdata or self.dtype is not dtype or self.mode is not mode:
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


#: (which dictionary of the owner, name, value, TensorImpl address, version, requires_grad); the last three are
#: None for a dependency that is not a tensor.
Dependency = tuple[int, str, Any, Any, Any, Any]

_PARAMETERS, _BUFFERS, _MODULES, _ATTRIBUTES = range(4)


def _table(owner: nn.Module, table: int) -> dict[str, Any]:
    # Looked up through the owner at each check: an entry holding the owner's dictionaries would be a cycle.
    if table == _PARAMETERS:
        return owner._parameters
    if table == _BUFFERS:
        return owner._buffers
    return owner._modules if table == _MODULES else owner.__dict__


def snapshot_of(owner: nn.Module, names: tuple[str, ...], attribute: str) -> list[Dependency]:
    """The dependencies' current state: which of the owner's dictionaries holds each (read directly: ``getattr``
    on a module is slow), and its value. A tensor is held with its TensorImpl's address, version counter and
    ``requires_grad``: ``torch.utils.swap_tensors`` keeps the Python object and changes the TensorImpl. It is held
    strongly, as any weak reference, Python's or the TensorImpl's, makes ``swap_tensors`` refuse it, and an id
    alone could be reused; so a replaced dependency stays alive until the next read or ``invalidate()``."""
    snapshot: list[Dependency] = []
    for name in names:
        table = next((i for i in (_PARAMETERS, _BUFFERS, _MODULES) if name in _table(owner, i)), _ATTRIBUTES)
        current = _table(owner, table).get(name, _MISSING)
        if current is _MISSING:
            raise AttributeError(
                f"{name!r}, which a VirtualTensor depends on, is no longer a parameter, buffer, submodule or "
                f"instance attribute of {type(owner).__name__} (was it parametrized or deleted?); recreate "
                f"VirtualTensor {attribute!r} with the depends_on its module has now"
            )
        if isinstance(current, Tensor):
            # Inference tensors have no version counter (and can be modified in place only in inference mode):
            # for them, identity and requires_grad only.
            version = -1 if current.is_inference() else current._version
            snapshot.append((table, name, current, current._cdata, version, current.requires_grad))
        else:
            snapshot.append((table, name, current, None, None, None))
    return snapshot


_MISSING = object()


def _equal(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # an == that does not give a bool (arrays): not provably equal, so a change
        return False


def keeps_graph(value: Tensor) -> bool:
    """Whether ``value`` carries an autograd graph, which a lasting cache must not keep (it is freed by backward)."""
    return value.grad_fn is not None
