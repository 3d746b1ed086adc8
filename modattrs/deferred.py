"""Deferred initialization: build a module without allocating it, and materialize it later with the values eager
construction would have given it, bit for bit.

:func:`deferred_init` runs a module's constructor on fake tensors (on the devices the code asks for) and records
every operation on them: creation, initialization, ties, conversions done later. :func:`materialize_module`
replays the part of that record the chosen tensors need, for real, starting from the random generator state of
the moment recording began, and swaps the results into the existing tensor objects, so optimizers and other
references built in between see the real data.

The names and the ``check_fn`` rule are torchdistx's, whose ``deferred_init`` does not work on current PyTorch.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from modattrs import _generator
from modattrs._fake_tensors import ModattrsFakeTensorMode, install_process_hooks
from modattrs._recording import DeferredInitError, RecordingFakeTensorMode, new_record
from modattrs._replay import replay
from modattrs.virtual import VirtualTensor

__all__ = [
    "DeferredInitError",
    "deferred_init",
    "is_deferred",
    "materialize_module",
    "materialize_tensor",
    "register_opaque_init",
]

P = ParamSpec("P")
ModuleT = TypeVar("ModuleT", bound=nn.Module)
TensorT = TypeVar("TensorT", bound=Tensor)


def deferred_init(module_fn: Callable[P, ModuleT], *args: P.args, **kwargs: P.kwargs) -> ModuleT:
    """Call ``module_fn(*args, **kwargs)`` with every tensor fake, recording how each one is made.

    The module returned holds fake tensors on the devices the code asked for and can be inspected, moved,
    converted, sharded and initialized further like any fake module; all of that is recorded too, until
    :func:`materialize_module` makes its tensors real.

    Raises:
        DeferredInitError: the code reads values of its tensors (``.item()``, ``if t.any():``), which do not exist
            yet, or does something else that cannot be recorded; the message names the operation and where it ran.
        TypeError: ``module_fn`` did not return a module.
    """
    if getattr(_this_thread, "recording", False):
        raise DeferredInitError(
            f"deferred_init({_name_of(module_fn)}) was called while another deferred_init records; build the inner "
            "module directly: everything inside the outer call is deferred already"
        )
    install_process_hooks()
    _register_builtin_opaque_inits()
    _generator.watch()
    record = new_record()
    mode = RecordingFakeTensorMode(record)
    _this_thread.recording = True
    try:
        with mode:
            module = module_fn(*args, **kwargs)
            if isinstance(module, nn.Module):
                _detach_graphs(module)
        mode.note_generator()  # a reseed after the last draw still sets where eager construction leaves it
    finally:
        _this_thread.recording = False
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"deferred_init expects a function returning a module; {_name_of(module_fn)} returned "
            f"a {type(module).__name__}"
        )
    for label, tensor in _tensors(module, recurse=True):
        if isinstance(tensor, FakeTensor):  # real tensors handed in stay as they are
            _ref_of(label, tensor)  # every fake one is accounted for now, not found missing at materialization
    record.root = weakref.ref(module)
    _roots[module] = mode
    return module


_this_thread = threading.local()
_roots: weakref.WeakKeyDictionary[nn.Module, RecordingFakeTensorMode] = weakref.WeakKeyDictionary()


def _detach_graphs(module: nn.Module) -> None:
    """Replace buffers and tensor attributes that carry an autograd graph by their detached values (recorded).

    A graph made at construction cannot be replayed (``requires_grad_`` is no operation), and it holds the tensors
    it saved, which swap_tensors would then refuse.
    """
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.grad_fn is not None:
                submodule._buffers[name] = buffer.detach()
        for name, value in vars(submodule).items():
            if isinstance(value, Tensor) and value.grad_fn is not None:
                vars(submodule)[name] = value.detach()


def is_deferred(obj: nn.Module | Tensor) -> bool:
    """Whether ``obj``, a tensor, or a module with any of its tensors (parameters, buffers, tensor attributes, in
    submodules too), still waits for :func:`materialize_module`."""
    if isinstance(obj, Tensor):
        return _recording_mode(obj) is not None
    return any(_recording_mode(tensor) is not None for _, tensor in _tensors(obj, recurse=True))


def materialize_module(
    module: ModuleT,
    *,
    device: torch.device | str | int | None = None,
    check_fn: Callable[[nn.Module], bool] | None = None,
    buffers_only: bool = False,
) -> ModuleT:
    """Make the deferred tensors of ``module`` real, in place, with the values eager construction gives them.

    Each tensor object stays the same Python object (an optimizer or a variable holding it sees the real data);
    parameters stay parameters, with their ``requires_grad`` and attributes; tied and aliased tensors stay so.
    Tensors that alias a chosen one (views of one storage) are materialized with it, so they stay aliased.

    Replays draw from the default CPU generator what eager construction drew, from where eager code had it when
    :func:`deferred_init` began, so every materialization draws the same numbers. Materializing all of what
    :func:`deferred_init` returned (no ``check_fn``, not ``buffers_only``) leaves the generator where eager code
    would have it after that module's last draw; a partial materialization puts it back as it found it.

    Args:
        module: the module :func:`deferred_init` returned, or any of its submodules.
        device: where the real tensors go, whatever the recorded devices were (the CPU to check a ``cuda``
            record on a machine without one). By default, the devices recorded, conversions included.
        check_fn: called with every submodule (``module`` included); only the own parameters and buffers of
            those it returns true for are materialized, the rest stay fake (torchdistx's rule, which FSDP1 uses).
        buffers_only: materialize buffers (and plain tensor attributes) only.

    Returns:
        ``module``.

    Raises:
        DeferredInitError: a fake tensor of ``module`` cannot be accounted for by a record, or the replay cannot
            run (a CUDA device on a machine without one, or a real tensor given to the constructor was changed
            since). The module is left as it was.
    """
    chosen: dict[int, tuple[str, FakeTensor]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=True):
        if check_fn is not None and not check_fn(submodule):
            continue
        for label, tensor in _own_tensors(submodule, prefix, buffers_only=buffers_only):
            if isinstance(tensor, FakeTensor):
                chosen.setdefault(id(tensor), (label, tensor))
    full = check_fn is None and not buffers_only
    _materialize(list(chosen.values()), module, full=full, device=_device(device))
    return module


def materialize_tensor(tensor: TensorT) -> TensorT:
    """Make one deferred tensor real, in place, and return it; a real tensor is returned as it is.

    Raises:
        DeferredInitError: ``tensor`` is fake but no :func:`deferred_init` recorded it.
    """
    if isinstance(tensor, FakeTensor):
        _materialize([("the tensor", tensor)], None, full=False, device=None)
    return tensor


def register_opaque_init(owner: object, name: str, *, mutates: int = 0) -> None:
    """Record calls to the function ``owner.name`` as one call, run for real at materialization.

    For initializers whose work depends on the values they draw (rejection sampling, like
    ``torch.nn.init.trunc_normal_``, which ships registered): such code cannot be recorded operation by
    operation, because fake tensors have no values. The function is replaced in ``owner`` (a module or a class)
    by a wrapper that, given a deferred tensor as argument ``mutates``, records the call and returns that tensor;
    given anything else, it calls the function. The function must write into that argument in place, whatever
    it holds before, and not change its shape. Registering twice is harmless.

    Raises:
        TypeError: ``owner.name`` is not callable.
        ValueError: ``mutates`` is negative.
    """
    func = getattr(owner, name)
    if not callable(func):
        raise TypeError(f"register_opaque_init: {_name_of(owner)}.{name} is a {type(func).__name__}, not a function")
    if mutates < 0:
        raise ValueError(f"register_opaque_init: mutates is the index of a positional argument, got {mutates}")
    if getattr(func, "__modattrs_opaque__", False):
        return
    install_process_hooks()  # fake mode's own hooks go first, so this wrapper is the outer one
    setattr(owner, name, _opaque_wrapper(func, mutates))


def _opaque_wrapper(func: Callable[..., Any], mutates: int) -> Callable[..., Any]:
    @functools.wraps(func)
    def recorded_when_deferred(*args: Any, **kwargs: Any) -> Any:
        target = args[mutates] if len(args) > mutates else None
        mode = _recording_mode(target)
        if mode is None:
            return func(*args, **kwargs)
        return mode.record_opaque(func, args, kwargs, mutates)

    recorded_when_deferred.__modattrs_opaque__ = True  # type: ignore[attr-defined]
    return recorded_when_deferred


@functools.cache
def _register_builtin_opaque_inits() -> None:
    # trunc_normal_ is a rejection sampler; every public caller (and transformers' copy) goes through this helper.
    register_opaque_init(torch.nn.init, "_no_grad_trunc_normal_")


# --- materialization --------------------------------------------------------------------------------------------------


def _materialize(
    chosen: list[tuple[str, FakeTensor]], module: nn.Module | None, *, full: bool, device: torch.device | None
) -> None:
    """Replay what ``chosen`` needs, record by record, then swap every result in."""
    by_mode: dict[int, tuple[RecordingFakeTensorMode, dict[int, tuple[str, FakeTensor]]]] = {}
    for label, tensor in chosen:
        mode = _recording_mode(tensor)
        if mode is None:
            raise DeferredInitError(
                f"{label} is a fake tensor that no deferred_init recorded (made by fake_mode or fake_copy), so "
                "there is nothing to replay for it; make it real by assigning a real tensor"
            )
        by_mode.setdefault(id(mode), (mode, {}))[1][id(tensor)] = (label, tensor)
    root_mode = _roots.get(module) if full and module is not None else None
    if root_mode is not None and id(root_mode) not in by_mode:  # nothing left: still set the generator
        by_mode[id(root_mode)] = (root_mode, {})
    scope = [] if module is None else list(module.modules())
    swaps: list[tuple[str, FakeTensor, Tensor]] = []
    for mode, tensors in by_mode.values():
        record = mode.record
        recorded_root = record.root() if record.root is not None else None
        if recorded_root is not None:
            _add_aliases(tensors, mode, recorded_root)
            scope.extend(recorded_root.modules())
        refs = {key: _ref_of(label, tensor) for key, (label, tensor) in tensors.items()}
        targets = {refs[key]: mode.storage_of(tensor) for key, (_, tensor) in tensors.items()}
        reals = replay(record, targets, device=device, to_end=mode is root_mode)
        for key, (label, tensor) in tensors.items():
            swaps.append((label, tensor, _real_twin(label, tensor, reals[refs[key]], device)))
    _swap(swaps, scope)
    if root_mode is not None and module is not None:
        del _roots[module]  # all of it is real: the record can go


def _swap(swaps: list[tuple[str, FakeTensor, Tensor]], scope: list[nn.Module]) -> None:
    """Swap each real twin into its fake tensor object, checking first what would make torch refuse."""
    # Recurrent layers hold weak references to their weights; like their own _apply, drop them and make them again.
    swapped = {id(tensor) for _, tensor, _ in swaps}
    recurrent = {
        id(layer): layer
        for layer in scope
        if isinstance(layer, nn.RNNBase) and any(id(weight) in swapped for weight in layer._flat_weights)
    }.values()
    for layer in recurrent:
        layer._flat_weight_refs = []
    try:
        _check_swappable(swaps)
        # Views hold their base: they go first, and their fake halves are let go before the bases are swapped.
        swaps.sort(key=lambda swap: swap[1]._base is None)
        while swaps:
            label, tensor, twin = swaps.pop(0)
            hooks = (tensor._backward_hooks, getattr(tensor, "_post_accumulate_grad_hooks", None))
            try:
                torch.utils.swap_tensors(tensor, twin)  # type: ignore[no-untyped-call]
            except RuntimeError as error:
                raise DeferredInitError(
                    f"{label} could not be made real in place ({error}); the tensors listed before it were"
                ) from error
            del twin  # now the fake half: let go of it, and of the base it may hold
            if hooks[0]:  # hooks live on the tensor's autograd data, which the swap replaced
                tensor._backward_hooks = hooks[0]
            if hooks[1]:
                tensor._post_accumulate_grad_hooks = hooks[1]
    finally:
        for layer in recurrent:
            layer._init_flat_weights()
    for module in {id(m): m for m in scope}.values():  # cached values may have been computed from fake tensors
        for value in vars(module).values():
            if isinstance(value, VirtualTensor):
                value.invalidate()


def _check_swappable(swaps: list[tuple[str, FakeTensor, Tensor]]) -> None:
    views_of: dict[int, int] = {}
    for _, tensor, _ in swaps:
        if tensor._base is not None:
            views_of[id(tensor._base)] = views_of.get(id(tensor._base), 0) + 1
    for label, tensor, _ in swaps:
        mode = _recording_mode(tensor)
        assert mode is not None
        mode.forget(tensor)
        if weakref.getweakrefcount(tensor):
            raise DeferredInitError(
                f"{label} cannot be made real in place: something holds a weak reference to it "
                "(torch.utils.swap_tensors refuses such tensors); drop the weak reference first"
            )
        # A fake view holds its base twice (the view's and its meta tensor's view information).
        allowed = 1 + 2 * views_of.get(id(tensor), 0) + (1 if tensor.is_leaf and tensor.requires_grad else 0)
        if tensor._use_count() > allowed:  # type: ignore[attr-defined]
            raise DeferredInitError(
                f"{label} cannot be made real in place: other tensors hold it (a view of it outside the module, or "
                "the autograd graph of a fake forward pass whose outputs are still alive); drop them first"
            )


def _add_aliases(
    tensors: dict[int, tuple[str, FakeTensor]], mode: RecordingFakeTensorMode, root: nn.Module | None
) -> None:
    """Add the root's tensors that share storage with a chosen one: materialized apart, they would stop aliasing."""
    if root is None:
        return
    storages = {mode.storage_of(tensor) for _, tensor in tensors.values()}
    for label, tensor in _tensors(root, recurse=True):
        if id(tensor) in tensors or not isinstance(tensor, FakeTensor) or tensor.fake_mode is not mode:
            continue
        if mode.storage_of(tensor) in storages:
            tensors[id(tensor)] = (label, tensor)


def _real_twin(label: str, fake: FakeTensor, real: Tensor, device: torch.device | None) -> Tensor:
    expected = (fake.shape, fake.stride(), fake.dtype, fake.device if device is None else device)
    got = (real.shape, real.stride(), real.dtype, real.device)
    if expected[:3] != got[:3] or expected[3] != got[3]:
        raise DeferredInitError(
            f"replaying {label} gave a tensor of (shape, strides, dtype, device) {got}, expected {expected}; this is "
            "a bug in modattrs, please report it"
        )
    twin: Tensor
    if isinstance(fake, nn.Parameter):
        twin = nn.Parameter(real, requires_grad=fake.requires_grad)
    else:  # a graph is not replayed: a tensor that had one comes back as its value, a leaf
        twin = real.detach().requires_grad_(fake.requires_grad and fake.is_leaf)
    internal = _fake_tensor_fields()
    vars(twin).update({key: value for key, value in vars(fake).items() if key not in internal})
    return twin


@functools.cache
def _fake_tensor_fields() -> frozenset[str]:
    with torch.device("meta"):
        fake = FakeTensor(ModattrsFakeTensorMode(), torch.empty(0), torch.device("cpu"))
    return frozenset(vars(fake)) | {"_is_param"}


# --- helpers ----------------------------------------------------------------------------------------------------------


def _recording_mode(tensor: object) -> RecordingFakeTensorMode | None:
    if isinstance(tensor, FakeTensor) and isinstance(tensor.fake_mode, RecordingFakeTensorMode):
        return tensor.fake_mode
    return None


def _ref_of(label: str, tensor: Tensor) -> int:
    mode = _recording_mode(tensor)
    if mode is None:
        if isinstance(tensor, FakeTensor):
            raise DeferredInitError(
                f"{label} is a fake tensor that deferred_init did not record (made by fake_mode "
                "or fake_copy); build it inside the deferred_init call"
            )
        raise AssertionError(label)
    assert isinstance(tensor, FakeTensor)
    ref = mode.ref_of(tensor)
    if ref is None and tensor.untyped_storage().device.type != "meta":
        raise DeferredInitError(
            f"{label} had its data replaced by a real tensor (`.data = real`), which no operation records; assign a "
            "new parameter or buffer instead, or copy_ the values in"
        )
    if ref is None:
        raise DeferredInitError(
            f"{label} ({tuple(tensor.shape)}, {tensor.dtype}) is fake, and no recorded operation made a tensor with "
            "its storage and layout; it was likely built from another fake tensor without a torch operation "
            "(torch.Tensor._make_subclass, set_ with a storage object); make it with torch operations"
        )
    return ref


def _tensors(module: nn.Module, *, recurse: bool) -> Iterator[tuple[str, Tensor]]:
    modules = module.named_modules() if recurse else [("", module)]
    for prefix, submodule in modules:
        yield from _own_tensors(submodule, prefix, buffers_only=False)


def _own_tensors(module: nn.Module, prefix: str, *, buffers_only: bool) -> Iterator[tuple[str, Tensor]]:
    """A module's own parameters, buffers and plain tensor attributes, labelled for messages."""
    kind = type(module).__name__
    if not buffers_only:
        for name, parameter in module._parameters.items():
            if parameter is not None:
                yield f"parameter {_join(prefix, name)!r} ({kind})", parameter
    for name, buffer in module._buffers.items():
        if buffer is not None:
            yield f"buffer {_join(prefix, name)!r} ({kind})", buffer
    for name, value in vars(module).items():
        if name not in ("_parameters", "_buffers", "_modules"):
            for path, tensor in _tensors_in(value, name, set()):
                yield f"tensor attribute {_join(prefix, path)!r} ({kind})", tensor


def _tensors_in(value: object, path: str, seen: set[int]) -> Iterator[tuple[str, Tensor]]:
    """Tensors in a plain attribute, also inside lists, tuples and dicts."""
    if isinstance(value, Tensor):
        yield path, value
    elif isinstance(value, (list, tuple, dict)) and id(value) not in seen:
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _tensors_in(item, f"{path}[{key!r}]", seen)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _device(device: torch.device | str | int | None) -> torch.device | None:
    return None if device is None else torch.device(device)


def _name_of(obj: object) -> str:
    return getattr(obj, "__name__", None) or type(obj).__name__
