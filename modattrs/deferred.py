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

import contextlib
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, ParamSpec, TypeVar

import torch
from torch import Tensor, nn

from modattrs import _spoofed_cuda, _torch_changes
from modattrs._attribute import own_attributes
from modattrs._devices import as_device
from modattrs._fake_tensors import ModattrsFakeTensorMode
from modattrs._generator import new_record
from modattrs._module_tensors import own_tensors
from modattrs._names import callable_name, in_library
from modattrs._record import DeferredInitError
from modattrs._recorder import (
    RecordingFakeTensorMode,
    ValueReads,
    recording,
    recording_in_this_thread,
    value_read_errors,
)
from modattrs._replay import replay
from modattrs._torch_private import (
    TABLE_NAMES,
    FakeTensor,
    buffers_of,
    disable_current_modes,
    dtensor_local,
    fsdp_padded_shards,
    hooks_of,
    rebuild_rnn_weights,
    release_rnn_weights,
    restore_hooks,
    rnn_flat_weights,
    use_count,
    view_base_of,
)
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
    if recording_in_this_thread():
        raise DeferredInitError(
            f"deferred_init({callable_name(module_fn)}) was called while another deferred_init records; build the "
            "inner module directly: everything inside the outer call is deferred already"
        )
    _torch_changes.install()
    record = new_record()
    mode = RecordingFakeTensorMode(record)
    with recording(), mode.handed(_handed_tensors(module_fn, args, kwargs)):
        with mode, ValueReads():
            module = module_fn(*args, **kwargs)
            if isinstance(module, nn.Module):
                _detach_graphs(module)
        mode.note_generator()  # a reseed after the last draw still sets where eager construction leaves it
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"deferred_init expects a function returning a module; {callable_name(module_fn)} returned "
            f"a {type(module).__name__}"
        )
    for label, tensor in _tensors(module):
        if isinstance(tensor, FakeTensor):  # real tensors handed in stay as they are
            _ref_of(label, tensor)  # every fake one is accounted for now, not found missing at materialization
    record.root = weakref.ref(module)
    _roots[module] = mode
    return module


_roots: weakref.WeakKeyDictionary[nn.Module, RecordingFakeTensorMode] = weakref.WeakKeyDictionary()


def _handed_tensors(module_fn: Callable[..., Any], args: Any, kwargs: Any) -> list[tuple[str, Tensor]]:
    """The real tensors among ``deferred_init``'s arguments for ``module_fn``, named for messages by where they are
    (``given``, ``layers[0]``, ``backbone.weight``)."""
    try:
        signature = inspect.signature(module_fn)
        bound = signature.bind(*args, **kwargs).arguments
    except (TypeError, ValueError):  # no signature to read, or arguments it refuses (the call will say so)
        named = [*((f"args[{index}]", value) for index, value in enumerate(args)), *kwargs.items()]
    else:
        named = []
        for name, value in bound.items():
            if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                named.extend(value.items())
            else:
                named.append((name, value))
    found: list[tuple[str, Tensor]] = []
    for name, value in named:
        _find_real_tensors(name, value, found, depth=0)
    return found


def _find_real_tensors(name: str, value: object, found: list[tuple[str, Tensor]], *, depth: int) -> None:
    if isinstance(value, Tensor):
        if not isinstance(value, FakeTensor):
            found.append((name, value))
    elif isinstance(value, nn.Module):
        held = [*value.named_parameters(), *value.named_buffers()]
        found.extend((f"{name}.{key}", tensor) for key, tensor in held if not isinstance(tensor, FakeTensor))
    elif depth < 2 and isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _find_real_tensors(f"{name}[{index}]", item, found, depth=depth + 1)
    elif depth < 2 and isinstance(value, dict):
        for key, item in value.items():
            _find_real_tensors(f"{name}[{key!r}]", item, found, depth=depth + 1)


def _detach_graphs(module: nn.Module) -> None:
    """Replace buffers and tensor attributes that carry an autograd graph by their detached values (recorded).

    A graph made at construction cannot be replayed (``requires_grad_`` is no operation), and it holds the tensors
    it saved, which swap_tensors would then refuse.
    """
    for submodule in module.modules():
        for name, buffer in buffers_of(submodule).items():
            if buffer is not None and buffer.grad_fn is not None:
                buffers_of(submodule)[name] = buffer.detach()
        attributes = vars(submodule)
        for name, value in list(attributes.items()):
            if name not in TABLE_NAMES:
                attributes[name] = _detached(value)


def _detached(value: Any) -> Any:
    """``value`` with every tensor carrying a graph detached, inside lists and dicts too (changed in place)."""
    if isinstance(value, Tensor):
        return value.detach() if value.grad_fn is not None else value
    if isinstance(value, list):
        value[:] = [_detached(item) for item in value]
    elif isinstance(value, dict):
        for key in list(value):
            value[key] = _detached(value[key])
    return value


def is_deferred(obj: nn.Module | Tensor) -> bool:
    """Whether ``obj``, a tensor, or a module with any of its tensors (parameters, buffers, tensor attributes, in
    submodules too), still waits for :func:`materialize_module`."""
    if isinstance(obj, Tensor):
        return _recording_mode(obj) is not None
    return any(_recording_mode(tensor) is not None for _, tensor in _tensors(obj))


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

    The tensors are real whatever mode is active: a fake mode, another dispatch mode, or the recording of an
    enclosing :func:`deferred_init`, are stepped out of for the replay. Replaying never changes the record, so a
    deep copy of a deferred module materializes to the same values, before or after the original.

    Args:
        module: the module :func:`deferred_init` returned, or any of its submodules.
        device: where the real tensors go, whatever the recorded devices were (the CPU to check a ``cuda``
            record on a machine without one). By default, the devices recorded, conversions included. ``cpu:1``
            is the CPU, as for torch's tensors; ``meta`` is refused.
        check_fn: called with every submodule (``module`` included); only the own parameters and buffers of
            those it returns true for are materialized, the rest stay fake (torchdistx's rule, which FSDP1 uses).
        buffers_only: materialize buffers (and plain tensor attributes) only.

    Returns:
        ``module``.

    Raises:
        DeferredInitError: a fake tensor of ``module`` cannot be accounted for by a record, or the replay cannot
            run (a device this machine cannot make tensors on, or a real tensor given to the constructor was changed
            since). The module is left as it was.
        TypeError, ValueError: ``device`` is not a device, or is ``meta``, naming the argument.
    """
    chosen: dict[int, tuple[str, FakeTensor]] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=True):
        if check_fn is not None and not check_fn(submodule):
            continue
        for label, tensor in _own_tensors(submodule, prefix, buffers_only=buffers_only):
            if isinstance(tensor, FakeTensor):
                chosen.setdefault(id(tensor), (label, tensor))
    full = check_fn is None and not buffers_only
    _materialize(list(chosen.values()), module, full=full, device=_replay_device(device))
    return module


def _replay_device(device: torch.device | str | int | None) -> torch.device | None:
    if device is None:
        return None
    parsed = as_device(device, "materialize_module")
    if parsed.type == "meta":
        raise ValueError(
            f"materialize_module: device={device!r} makes tensors without values, and materializing makes the values "
            "eager construction gives; pass a device with memory (device='cpu'), or leave the module deferred"
        )
    # torch puts a tensor asked for on cpu:1 on the CPU, which has no index: so do replays.
    return torch.device("cpu") if parsed.type == "cpu" else parsed


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
    ``torch.nn.init.trunc_normal_``, which modattrs records so already): such code cannot be recorded operation by
    operation, because fake tensors have no values. The function is replaced in ``owner`` (a module or a class),
    now, by a wrapper that, given a deferred tensor as argument ``mutates`` (by position or by name), records the
    call and returns that tensor; given anything else, it calls the function. The function must write into that
    argument in place, whatever it holds before, and not change its shape. Registering twice is harmless.

    ``mutates`` counts the parameters of ``owner.name`` as read from ``owner``: ``self`` counts for a method
    registered on its class, ``cls`` does not for a classmethod. The wrapper is stored as the function was, so it
    is called as before: a staticmethod stays one, a classmethod stays one and is given the class it is called
    through, a method is given its instance.

    Raises:
        TypeError: ``owner.name`` is not callable, is a builtin (whose signature cannot be read: wrap it in a
            Python function and register that), or is a descriptor whose binding the wrapper cannot reproduce.
        ValueError: ``mutates`` is not the index of a positional parameter of the function.
    """
    func = getattr(owner, name)
    if not callable(func):
        raise TypeError(
            f"register_opaque_init: {callable_name(owner)}.{name} is a {type(func).__name__}, not a function"
        )
    if getattr(func, "__modattrs_opaque__", False):
        return
    parameters = list(_signature(owner, name, func).parameters.values())
    if not 0 <= mutates < len(parameters) or parameters[mutates].kind not in _POSITIONAL:
        raise ValueError(
            f"register_opaque_init: mutates is the index of the positional argument {callable_name(owner)}.{name} "
            f"writes into; it takes {[p.name for p in parameters if p.kind in _POSITIONAL]}, got {mutates}"
        )
    setattr(owner, name, _opaque_attribute(owner, name, func, mutates, parameters[mutates].name))


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _signature(owner: object, name: str, func: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError) as error:  # builtins without a text signature: torch's operations, mostly
        raise TypeError(
            "register_opaque_init needs a Python function whose signature can be read, to find the argument it "
            f"writes into; {callable_name(owner)}.{name} is a {type(func).__name__} without one.\n"
            "To record a builtin as one call, wrap it in a Python function that takes the tensor it writes into and "
            "register that. torch's own operations (torch.rand, Tensor.uniform_, ...) are recorded already, one "
            "operation each, and need no registering"
        ) from error


def _opaque_attribute(owner: object, name: str, func: Callable[..., Any], mutates: int, keyword: str) -> object:
    """The wrapper of ``func``, stored so that ``owner.name`` binds as before: read from the class or from an
    instance, the wrapper is given the arguments the function was."""
    if not isinstance(owner, type):  # a module or an instance: attributes of its own do not bind
        return _opaque_wrapper(func, mutates, keyword)
    stored = next((vars(klass)[name] for klass in owner.__mro__ if name in vars(klass)), None)  # None: metaclass
    if isinstance(stored, classmethod):
        return classmethod(_opaque_classmethod(stored, mutates, keyword))
    if isinstance(stored, staticmethod) or not hasattr(type(stored), "__get__"):  # a partial, a metaclass method
        return staticmethod(_opaque_wrapper(func, mutates, keyword))  # not bound (again) when read
    if inspect.isfunction(func):  # a function, or a descriptor binding as one (functools.partialmethod)
        return _opaque_wrapper(func, mutates, keyword)
    raise TypeError(
        f"register_opaque_init: {callable_name(owner)}.{name} is a {type(stored).__name__}, a descriptor whose "
        "binding the wrapper cannot reproduce; it must be a staticmethod, a classmethod or a function (or a callable "
        "object that does not bind). Register a function it calls instead"
    )


def _opaque_wrapper(func: Callable[..., Any], mutates: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(func)
    def recorded_when_deferred(*args: Any, **kwargs: Any) -> Any:
        return _record_or_call(func, args, kwargs, mutates, keyword)

    recorded_when_deferred.__modattrs_opaque__ = True  # type: ignore[attr-defined]
    return recorded_when_deferred


def _opaque_classmethod(method: classmethod[Any, Any, Any], mutates: int, keyword: str) -> Callable[..., Any]:
    @functools.wraps(method.__func__)
    def recorded_when_deferred(cls: type, *args: Any, **kwargs: Any) -> Any:
        return _record_or_call(method.__get__(None, cls), args, kwargs, mutates, keyword)  # bound to the class called

    recorded_when_deferred.__modattrs_opaque__ = True  # type: ignore[attr-defined]
    return recorded_when_deferred


def _record_or_call(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], mutates: int, keyword: str
) -> Any:
    target = args[mutates] if len(args) > mutates else kwargs.get(keyword)
    mode = _recording_mode(target)
    if mode is None:
        return func(*args, **kwargs)
    assert isinstance(target, FakeTensor)
    return mode.opaque_call(func, args, kwargs, target)


# --- materialization --------------------------------------------------------------------------------------------------


Chosen = dict[int, tuple[str, FakeTensor]]  # id of a fake tensor -> (its label for messages, the tensor)


def _materialize(
    chosen: list[tuple[str, FakeTensor]], module: nn.Module | None, *, full: bool, device: torch.device | None
) -> None:
    """Replay what ``chosen`` needs, record by record, and swap the results in.

    Everything that can refuse is checked before anything changes; if a replay fails, the generator is put back.
    Real values are what materializing is for: it steps out of the caller's dispatch modes (a fake mode, modattrs'
    or torch's own, the recording of an enclosing ``deferred_init``) and spoofed CUDA.
    """
    with disable_current_modes(), _spoofed_cuda.truthful():
        _replay_and_swap(chosen, module, full=full, device=device)


def _replay_and_swap(
    chosen: list[tuple[str, FakeTensor]], module: nn.Module | None, *, full: bool, device: torch.device | None
) -> None:
    root_mode = _roots.get(module) if full and module is not None else None
    groups = _by_record(chosen)
    if root_mode is not None:
        groups.setdefault(id(root_mode), (root_mode, {}))  # even with nothing left, the generator is set
    scope = [] if module is None else list(module.modules())
    for mode, tensors in groups.values():
        recorded_root = mode.record.root() if mode.record.root is not None else None
        if recorded_root is not None:
            _add_aliases(tensors, mode, recorded_root)
            scope.extend(recorded_root.modules())
    refs = {key: _ref_of(label, tensor) for _, tensors in groups.values() for key, (label, tensor) in tensors.items()}
    everything = [entry for _, tensors in groups.values() for entry in tensors.values()]
    with _recurrent_weights_released(scope, everything):
        _check_swappable(everything)
        saved = torch.default_generator.get_state()
        swaps: list[tuple[str, FakeTensor, Tensor]] = []
        try:
            for mode, tensors in groups.values():
                targets = {refs[key]: mode.storage_of(tensor) for key, (_, tensor) in tensors.items()}
                labels = {refs[key]: label for key, (label, _) in tensors.items()}
                reals = replay(mode.record, targets, labels, device=device, to_end=mode is root_mode)
                for key, (label, tensor) in tensors.items():
                    swaps.append((label, tensor, _real_twin(label, tensor, reals[refs[key]], device)))
        except BaseException:
            torch.default_generator.set_state(saved)
            raise
        _swap(swaps)
    for owner in {id(m): m for m in scope}.values():  # cached values may have been computed from fake tensors
        for attribute in own_attributes(owner):  # not aliases: theirs is their owners' business
            if isinstance(attribute, VirtualTensor):
                attribute.invalidate()
    if root_mode is not None and module is not None:
        del _roots[module]  # all of it is real: the record can go


def _by_record(chosen: list[tuple[str, FakeTensor]]) -> dict[int, tuple[RecordingFakeTensorMode, Chosen]]:
    groups: dict[int, tuple[RecordingFakeTensorMode, Chosen]] = {}
    for label, tensor in chosen:
        mode = _recording_mode(tensor)
        if mode is None:
            raise _not_recorded(label)
        groups.setdefault(id(mode), (mode, {}))[1][id(tensor)] = (label, tensor)
    return groups


def _add_aliases(tensors: Chosen, mode: RecordingFakeTensorMode, root: nn.Module) -> None:
    """Add the root's tensors that share storage with a chosen one: materialized apart, they would stop aliasing."""
    storages = {mode.storage_of(tensor) for _, tensor in tensors.values()}
    for label, tensor in _tensors(root):
        if id(tensor) in tensors or not isinstance(tensor, FakeTensor) or tensor.fake_mode is not mode:
            continue
        if mode.storage_of(tensor) in storages:
            tensors[id(tensor)] = (label, tensor)


@contextlib.contextmanager
def _recurrent_weights_released(scope: list[nn.Module], tensors: list[tuple[str, FakeTensor]]) -> Iterator[None]:
    """Recurrent layers hold weak references to their weights, which swap_tensors refuses: like their own
    ``_apply``, drop them for the swap and make them again."""
    ids = {id(tensor) for _, tensor in tensors}
    layers = {
        id(layer): layer
        for layer in scope
        if isinstance(layer, nn.RNNBase) and any(id(weight) in ids for weight in rnn_flat_weights(layer))
    }.values()
    for layer in layers:
        release_rnn_weights(layer)
    try:
        yield
    finally:
        for layer in layers:
            rebuild_rnn_weights(layer)


def _check_swappable(tensors: list[tuple[str, FakeTensor]]) -> None:
    """Raise for a tensor that torch.utils.swap_tensors would refuse, once torch's own fake tensor memo (which holds
    weak references to some) has let go of it."""
    views_of: dict[int, int] = {}
    for _, tensor in tensors:
        base = view_base_of(tensor)
        if base is not None:
            views_of[id(base)] = views_of.get(id(base), 0) + 1
    for label, tensor in tensors:
        mode = _recording_mode(tensor)
        assert mode is not None
        mode.forget(tensor)
        if weakref.getweakrefcount(tensor):
            raise DeferredInitError(
                f"{label} cannot be made real in place: something holds a weak reference to it "
                "(torch.utils.swap_tensors refuses such tensors); drop the weak reference first"
            )
        # A fake view holds its base twice (the view's and its meta tensor's view information); the views are
        # swapped first and let go of it.
        allowed = 1 + 2 * views_of.get(id(tensor), 0) + (1 if tensor.is_leaf and tensor.requires_grad else 0)
        if use_count(tensor) > allowed:
            _let_go_of_errors_read_values()
        if use_count(tensor) > allowed:
            raise DeferredInitError(
                f"{label} cannot be made real in place: other tensors hold it (a view of it outside the module, or "
                "the autograd graph of a fake forward pass whose outputs are still alive); drop them first"
            )


def _let_go_of_errors_read_values() -> None:
    """Clear the finished frames of torch and modattrs in the tracebacks of the value-read errors still alive.

    Code that reads the values of a deferred tensor (``t.tolist()`` reads each row, a view of ``t``) raises an error
    saying to materialize first; its traceback keeps the frames that were running, and with them those views, which
    materializing would refuse to leave fake, for as long as anything keeps the error. Those frames have returned:
    their locals are only for post-mortem debugging, and the code of the user's own frames keeps its own.
    """
    for error in list(value_read_errors):
        _clear_library_frames(error.__traceback__)


def _clear_library_frames(traceback: types.TracebackType | None) -> None:
    while traceback is not None:
        frame = traceback.tb_frame
        if in_library(frame.f_code):
            with contextlib.suppress(RuntimeError):  # a frame still running cannot be cleared
                frame.clear()
                # Before Python 3.13, the copy of the locals that reading f_locals made stays on the frame; reading
                # f_locals again updates it to the locals there are now: none.
                frame.f_locals  # noqa: B018
        traceback = traceback.tb_next


def _swap(swaps: list[tuple[str, FakeTensor, Tensor]]) -> None:
    """Swap each real twin into its fake tensor object: views first, then the tensors they view."""
    swaps.sort(key=lambda swap: view_base_of(swap[1]) is None)
    while swaps:
        label, tensor, twin = swaps.pop(0)
        hooks = hooks_of(tensor)
        try:
            torch.utils.swap_tensors(tensor, twin)  # type: ignore[no-untyped-call]
        except RuntimeError as error:  # checked for before: not expected
            raise DeferredInitError(
                f"{label} could not be made real in place ({error}); the tensors listed before it were"
            ) from error
        del twin  # now the fake half: let go of it, and of the base it may hold
        restore_hooks(tensor, hooks)  # they live on the tensor's autograd data, which the swap replaced


def _real_twin(label: str, fake: FakeTensor, real: Tensor, device: torch.device | None) -> Tensor:
    expected = (fake.shape, fake.stride(), fake.dtype)
    got = (real.shape, real.stride(), real.dtype)
    on = fake.device if device is None else device
    if got != expected or not _same_device(real.device, on):
        raise DeferredInitError(
            f"replaying {label} gave a tensor of (shape, strides, dtype) {got} on {real.device}, expected "
            f"{expected} on {on}; this is a bug in modattrs, please report it"
        )
    twin: Tensor
    if isinstance(fake, nn.Parameter):
        twin = nn.Parameter(real, requires_grad=fake.requires_grad)
    else:  # a graph is not replayed: a tensor that had one comes back as its value, a leaf
        twin = real.detach().requires_grad_(fake.requires_grad and fake.is_leaf)
    internal = _fake_tensor_fields()
    vars(twin).update({key: value for key, value in vars(fake).items() if key not in internal})
    return twin


def _same_device(one: torch.device, other: torch.device) -> bool:
    if one.type == "cpu":  # torch puts a tensor asked for on cpu:1 on the CPU, which has no index
        return other.type == "cpu"
    return one.type == other.type and (one.index or 0) == (other.index or 0)  # cuda is cuda:0


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


def _ref_of(label: str, tensor: FakeTensor) -> int:
    mode = _recording_mode(tensor)
    if mode is None:
        raise _not_recorded(label)
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
            "(torch.Tensor._make_subclass); make it with torch operations"
        )
    return ref


def _not_recorded(label: str) -> DeferredInitError:
    return DeferredInitError(
        f"{label} is a fake tensor that no deferred_init recorded: fake_mode or fake_copy made it, outside "
        "deferred_init or in a fake_mode block inside the function deferred_init records, so there is nothing to "
        "replay for it; build it inside the deferred_init call without fake_mode, or assign a real tensor"
    )


def _tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of ``module`` and its submodules (see ``_own_tensors``), and the shard storage FSDP2 keeps for
    them, labelled for messages."""
    for prefix, submodule in module.named_modules():
        yield from _own_tensors(submodule, prefix, buffers_only=False)
        yield from _fsdp_shards(submodule, prefix)


def _own_tensors(module: nn.Module, prefix: str, *, buffers_only: bool) -> Iterator[tuple[str, Tensor]]:
    """A module's own tensors (see ``_module_tensors.own_tensors``), labelled for messages; for a DTensor (sharded by
    FSDP2 or by tensor parallelism), the local tensor it wraps, which is what the record made."""
    for held in own_tensors(module, prefix, buffers_only=buffers_only):
        yield _local(held.label, held.tensor)


def _local(label: str, tensor: Tensor) -> tuple[str, Tensor]:
    """``tensor``, or the local tensor of a DTensor: the DTensor itself is a wrapper without data of its own, and its
    local tensor is a fake tensor that the record made (``fully_shard`` and ``distribute_tensor`` run torch
    operations on the deferred tensor to cut this rank's part out of it)."""
    dtensor_type = _dtensor_type()
    if dtensor_type is None or not isinstance(tensor, dtensor_type):
        return label, tensor
    return f"{label} (this rank's local tensor of the DTensor)", dtensor_local(tensor)


def _dtensor_type() -> type[Tensor] | None:
    """DTensor, if torch.distributed.tensor was imported (no DTensor can exist otherwise, and importing it is slow)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def _fsdp_shards(module: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """The padded shard storage FSDP2 keeps for each parameter it manages in ``module`` (a ``fully_shard`` unit).

    ``fully_shard`` pads this rank's part of each parameter to an equal size on every rank and keeps the padded
    tensor flat, next to the DTensor parameter whose local tensor is a view of its first rows; all-gathers read it.
    Materialized with the parameter (they share storage), it stays a view of the same real storage, as FSDP2 made it.
    """
    for holder, parameter_name, shard in fsdp_padded_shards(module):
        owner = next((path for path, sub in module.named_modules() if sub is holder), "?")
        name = _join(_join(prefix, owner) if owner else prefix, parameter_name)
        yield f"FSDP2's padded shard of parameter {name!r}", shard


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
