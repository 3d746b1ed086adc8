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

import weakref
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor, nn

from modattrs import _torch_changes
from modattrs._deferred import opaque, rng
from modattrs._deferred.construction import detach_graphs, handed_tensors
from modattrs._deferred.materialize import materialize, module_tensors, own_tensors_of, ref_of, roots
from modattrs._deferred.record import DeferredInitError
from modattrs._deferred.recorder import (
    RecordingFakeTensorMode,
    ValueReads,
    recording,
    recording_in_this_thread,
    recording_mode,
)
from modattrs._devices import as_device
from modattrs._names import callable_name
from modattrs._torch_private import (
    FakeTensor,
)

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

    When it returns, the default CPU generator is where eager construction leaves it, so code that draws next
    gets eager code's numbers; later initialization of the module's tensors moves it as eager code would.

    Raises:
        DeferredInitError: the code reads values of its tensors (``.item()``, ``if t.any():``), which do not exist
            yet, or does something else that cannot be recorded; the message names the operation and where it ran.
            Also when the code catches such a refused read and goes on: eager code would have had the values.
        TypeError: ``module_fn`` did not return a module.

    Raising, it leaves the default CPU generator as it found it.
    """
    if recording_in_this_thread():
        raise DeferredInitError(
            f"deferred_init({callable_name(module_fn)}) was called while another deferred_init records.\n"
            "Build the inner module directly: everything inside the outer call is deferred already"
        )
    _torch_changes.install_deferred()
    with rng.undone_on_failure():  # raising, it leaves the generator as it found it
        record = rng.new_record()
        mode = RecordingFakeTensorMode(record, _torch_changes.install_fake_cuda)
        with recording() as refused, mode.handed(handed_tensors(module_fn, args, kwargs)):
            with mode, ValueReads():
                module = module_fn(*args, **kwargs)
                if isinstance(module, nn.Module):
                    detach_graphs(module)
            if refused:  # see Note [A refused read that the constructor catches]
                raise DeferredInitError(
                    f"{callable_name(module_fn)} went on after deferred_init refused to read values, and caught the "
                    f"error:\n{refused[0]}\n"
                    "Eager construction reads them there and may take another path, so the module recorded may not "
                    "be the one eager code builds.\n"
                    "Let the error propagate, or move the read after materialize_module"
                )
            mode.note_generator()  # a reseed after the last draw still sets where eager construction leaves it
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"deferred_init expects a function returning a module; {callable_name(module_fn)} returned "
                f"a {type(module).__name__}"
            )
        for label, tensor in module_tensors(module):
            if isinstance(tensor, FakeTensor):  # real tensors handed in stay as they are
                ref_of(label, tensor)  # every fake one is accounted for now, not found missing at materialization
        record.root = weakref.ref(module)
        roots[module] = mode
        rng.settle(record)  # the generator where eager construction leaves it, from now on
    return module


def is_deferred(obj: nn.Module | Tensor) -> bool:
    """Whether ``obj``, a tensor, or a module with any of its tensors (parameters, buffers, tensor attributes, in
    submodules too), still waits for :func:`materialize_module`."""
    if isinstance(obj, Tensor):
        return recording_mode(obj) is not None
    return any(recording_mode(tensor) is not None for _, tensor in module_tensors(obj))


def materialize_module(
    module: ModuleT,
    *,
    device: torch.device | str | int | None = None,
    check_fn: Callable[[nn.Module], bool] | None = None,
    buffers_only: bool = False,
    threads: int | None = None,
) -> ModuleT:
    """Make the deferred tensors of ``module`` real, in place, with the values eager construction gives them.

    Each tensor object stays the same Python object (an optimizer or a variable holding it sees the real data);
    parameters stay parameters, with their ``requires_grad`` and attributes; tied and aliased tensors stay so.
    Tensors that alias a chosen one (views of one storage) are materialized with it, so they stay aliased.

    Replays draw from the default CPU generator what eager construction drew, from where eager code had it when
    :func:`deferred_init` began, so every materialization draws the same numbers, and put the generator back as
    they found it: it has been where eager code has it since :func:`deferred_init` returned.

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
        threads: how many threads a large random fill (``normal_``, ``uniform_``, ... of more than 150,000 32-bit
            outputs; 600,000 on a CPU without carry-less multiplication, 15 million without modattrs' C extension)
            is split over, each drawing its own range from a
            jumped copy of the generator's state: the same values as one thread, faster on a machine with free
            cores. By default, torch's intra-op thread count (``torch.get_num_threads()``); 1 draws on the calling
            thread alone.

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
        for label, tensor in own_tensors_of(submodule, prefix, buffers_only=buffers_only):
            if isinstance(tensor, FakeTensor):
                chosen.setdefault(id(tensor), (label, tensor))
    full = check_fn is None and not buffers_only
    threads = _threads(threads)
    materialize(list(chosen.values()), module, full=full, device=_replay_device(device), threads=threads)
    return module


def _threads(threads: int | None) -> int:
    if threads is None:
        return torch.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"materialize_module: threads must be a positive int or None (torch's count), got {threads!r}")
    return threads


def _replay_device(device: torch.device | str | int | None) -> torch.device | None:
    if device is None:
        return None
    parsed = as_device(device, "materialize_module")
    if parsed.type == "meta":
        raise ValueError(
            f"materialize_module: device={device!r} makes tensors without values, and materializing makes the values "
            "eager construction gives.\nPass a device with memory (device='cpu'), or leave the module deferred"
        )
    # torch puts a tensor asked for on cpu:1 on the CPU, which has no index: so do replays.
    return torch.device("cpu") if parsed.type == "cpu" else parsed


def materialize_tensor(tensor: TensorT) -> TensorT:
    """Make one deferred tensor real, in place, and return it; a real tensor is returned as it is.

    Raises:
        DeferredInitError: ``tensor`` is fake but no :func:`deferred_init` recorded it.
    """
    if isinstance(tensor, FakeTensor):
        materialize([("the tensor", tensor)], None, full=False, device=None)
    return tensor


def register_opaque_init(owner: object, name: str, *, mutates: int = 0) -> None:
    """Record calls to the function ``owner.name`` as one call, run for real at materialization.

    For initializers whose work depends on the values they draw (rejection sampling, like
    ``torch.nn.init.trunc_normal_``, which modattrs records itself): such code cannot be recorded operation by
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
    opaque.register(owner, name, mutates)


# Defined in the engine; says where users import it: in tracebacks, reprs, pickles and the docs.
DeferredInitError.__module__ = __name__
