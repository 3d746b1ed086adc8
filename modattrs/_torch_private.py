"""Every private name of torch that modattrs uses, and why.

Some of what modattrs does has no public API in torch: fake tensors live in ``torch._subclasses``, a module's
parameter, buffer and hook tables are underscore attributes, a tensor's version counter is ``_version``. Each of
those names is reached through this module and nowhere else (``tests/test_package_layout.py`` checks the source),
with a comment that says what public API is missing and the torch releases it was checked on: CI runs the suite on
2.8.0, 2.13.0 and the newest release (``tox.ini``), so a name that moves in a new release fails here first.

"Checked on 2.8 to 2.15" means 2.8.0, 2.13.0 and 2.15.0, the builds of the CI matrix when this was written.

Not names, but torch internals all the same: ``_fake.mode.ModattrsFakeTensorMode`` subclasses FakeTensorMode and
overrides its ``avoid_device_init`` property, and ``_torch_changes`` replaces functions of ``torch.nn.init``,
``torch.autograd``, ``torch.random`` and ``torch.cuda`` (each listed in ``docs/torch_changes.rst``).
"""

from __future__ import annotations

import contextlib
import functools
import struct
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

# The class of aten operators (torch.ops.aten.add.Tensor): torch has no public name for it. Checked on 2.8 to 2.15.
from torch._ops import OpOverload

# The strides torch gives a contiguous tensor of a shape (sizes of 0 count as 1): torch's own rule, from its
# primitives' helpers; no public function. Checked on 2.8 to 2.15.
from torch._prims_common import make_contiguous_strides_for as contiguous_strides

# Fake tensors and their mode: the classes themselves are private, documented in torch's fake tensor notes and
# used across torch (export, dynamo, FSDP's meta init); there is no public module. Checked on 2.8 to 2.15.
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorConverter,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    init_gpu_context,
    unset_fake_temporarily,
)

# The base class of dispatch modes (the write ledger's mode): documented by torch, but defined in a private module.
# There since 1.13; checked on 2.13.
from torch.utils._python_dispatch import TorchDispatchMode

# Leaving every dispatch mode of this thread for a block (a generator state is a real tensor, also inside a fake
# mode): no public API. Checked on 2.8 to 2.15.
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes

# Flattening nested arguments the way the dispatcher does: torch has no public pytree module. Checked on 2.8 to 2.15.
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

__all__ = [
    "DataDependentOutputException",
    "DynamicOutputShapeException",
    "FakeTensor",
    "FakeTensorConfig",
    "FakeTensorConverter",
    "FakeTensorMode",
    "OpOverload",
    "TorchDispatchMode",
    "TreeSpec",
    "UnsupportedFakeTensorException",
    "UnsupportedOperatorException",
    "contiguous_strides",
    "disable_current_modes",
    "tree_flatten",
    "tree_unflatten",
    "unset_fake_temporarily",
]

# --- dispatch modes --------------------------------------------------------------------------------------------------

#: How many dispatch modes are active in this thread. No public function answers this; the hot path of a
#: VirtualTensor read asks it. Checked on 2.8 to 2.15.
dispatch_mode_count: Callable[[], int] = torch._C._len_torch_dispatch_stack


def active_fake_mode() -> FakeTensorMode | None:
    """The fake mode active in this thread, wherever it sits in the mode stack. No public API (torch's own
    ``detect_fake_mode`` is private too, and looks at tensors as well). Checked on 2.8 to 2.15."""
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return mode if isinstance(mode, FakeTensorMode) else None


# --- fake tensors: making them, and the mode's memory of real tensors ------------------------------------------------


def call_as_meta(mode: FakeTensorMode, func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``func(*args, **kwargs)`` with the mode's fake tensors seen as the meta tensors they are: what torch's
    ``in_kernel_invocation_manager`` does, without its generator context manager (a third of a fake detach). No
    public API; checked on 2.8 to 2.15."""
    was_in_kernel = mode.in_kernel_invocation
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        mode.in_kernel_invocation = True
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            return func(*args, **kwargs)
        finally:
            mode.in_kernel_invocation = was_in_kernel


def meta_alias(fake: FakeTensor) -> torch.Tensor:
    """A plain tensor viewing all of ``fake``'s meta storage, with its sizes, strides, offset, dtype, conjugate and
    negative bits and dispatch keys, for :func:`call_as_meta` to run a kernel on in its stead: a fake tensor answers
    each ``device()`` its kernel asks (a split asks one per result) from Python, through its mode, at ten times what
    the kernel costs. ``_make_subclass`` detaches its argument below the Python dispatch key, as in
    :func:`alias_fake`. No public API; checked on 2.8 to 2.15."""
    with torch._C._DisableTorchDispatch():
        return torch.Tensor._make_subclass(torch.Tensor, fake, False)


def in_kernel(mode: FakeTensorMode) -> bool:
    """Whether ``mode`` is running a kernel, its fake tensors seen as meta tensors (:func:`call_as_meta`). No public
    API; checked on 2.8 to 2.15."""
    return bool(mode.in_kernel_invocation)


#: Whether FakeTensor normalizes devices in a function of its own (2.13, 2.15); torch 2.8 does it inline in the
#: constructor, and :func:`normalize_fake_device` takes its steps there.
NORMALIZES_FAKE_DEVICE_APART: bool = hasattr(FakeTensor, "_normalize_fake_device")


def normalize_fake_device(device: torch.device) -> torch.device:
    """The device a FakeTensor made for ``device`` reports (``cuda`` becomes ``cuda:N``), with what making one does
    first (a GPU context initialized on a machine with a GPU). torch's own function on 2.13 and 2.15; on 2.8, the
    steps its constructor takes inline, copied. Checked on 2.8, 2.13, 2.15."""
    if NORMALIZES_FAKE_DEVICE_APART:
        normalized: torch.device = FakeTensor._normalize_fake_device(device)
        return normalized
    if device.type in ("cuda", "xpu"):
        init_gpu_context(device)
    accelerators = ("cuda", "hpu", "xpu", "mps", torch._C._get_privateuse1_backend_name())
    if device.type in accelerators and device.index is None:
        backend = getattr(torch, device.type)
        if device.type != "mps" and backend.is_initialized():
            return torch.device(device.type, backend.current_device())
        return torch.device(device.type, 0)
    return device


def fake_tensor_attributes(fake: FakeTensor) -> dict[str, Any]:
    """The attributes torch's constructor set on ``fake``, but its mode: what :func:`wrap_meta` copies. The device is
    held as ``_fake_device`` from 2.13 (``fake_device`` on 2.8). Checked on 2.8 to 2.15."""
    return {name: value for name, value in vars(fake).items() if name != "fake_mode"}


#: The name under which a FakeTensor holds its device (see fake_tensor_attributes).
FAKE_DEVICE_ATTRIBUTE = "_fake_device" if NORMALIZES_FAKE_DEVICE_APART else "fake_device"


def wrap_meta(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device, attributes: dict[str, Any]) -> FakeTensor:
    """A FakeTensor of ``mode`` for a fresh meta tensor, made as torch's constructor makes it (``_make_subclass``,
    and the flag that refuses access to its data pointer) with ``attributes`` that the constructor set on an earlier
    one. The constructor checks its arguments, normalizes the device twice and sets its attributes through
    descriptors: a third of the time a model takes to build in fake mode. No public API; checked on 2.8 to 2.15."""
    made = torch.Tensor._make_subclass(
        FakeTensor, meta, meta.requires_grad, dispatch_device=True, device_for_backend_keys=device
    )
    return _fake_made(mode, made, attributes)


def alias_fake(mode: FakeTensorMode, fake: FakeTensor, device: torch.device, attributes: dict[str, Any]) -> FakeTensor:
    """A FakeTensor of ``mode`` that views all of ``fake``, on ``device`` (its own), made as :func:`wrap_meta` makes
    one: what a detach of ``fake`` gives, without making a meta tensor first. ``_make_subclass`` detaches its
    argument, here below the Python dispatch key, where a fake tensor is the meta tensor it holds: ``detach`` has one
    kernel for every device (CompositeExplicitAutograd), which copies the tensor's metadata and touches no data or
    device. No public API; checked on 2.8 to 2.15."""
    with torch._C._DisableTorchDispatch():
        made = torch.Tensor._make_subclass(
            FakeTensor, fake, False, dispatch_device=True, device_for_backend_keys=device
        )
    return _fake_made(mode, made, attributes)


def _fake_made(mode: FakeTensorMode, made: torch.Tensor, attributes: dict[str, Any]) -> FakeTensor:
    """``made``, fresh from ``_make_subclass``, finished as torch's constructor finishes a FakeTensor."""
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(made)
    else:
        torch._C._set_throw_on_mutable_data_ptr(made)
    state = vars(made)
    state.update(attributes)
    state["fake_mode"] = mode
    assert isinstance(made, FakeTensor)
    return made


def retype_converter(mode: FakeTensorMode, converter_type: type[FakeTensorConverter]) -> None:
    """Give ``mode`` a converter of ``converter_type``, a subclass that adds no state: retyping the one it has
    beats building a second. FakeTensorMode takes no converter. Checked on 2.8 to 2.15."""
    mode.fake_tensor_converter.__class__ = converter_type


def forget_constant_aliases(mode: FakeTensorMode, fake: FakeTensor) -> None:
    """Make ``fake`` and every fake of ``mode`` sharing its constant's storage forget the constant (the values torch
    keeps for small tensors made from Python numbers). No public API; checked on 2.8 to 2.15."""
    assert fake.constant is not None
    mode.fake_tensor_converter.invalidate_constant_aliases(fake.constant)
    fake.constant = None  # in case torch's mapping did not list it


def has_constant_aliases(mode: FakeTensorMode) -> bool:
    """Whether ``mode`` lists any constant storage shared by several fakes (torch's look-up makes a TypedStorage,
    dearer than this test). No public API; checked on 2.8 to 2.15."""
    return bool(mode.fake_tensor_converter.constant_storage_mapping)


def note_constant_alias(mode: FakeTensorMode, fake: FakeTensor) -> None:
    """List ``fake`` under its constant's storage in ``mode``, so that :func:`forget_constant_aliases` of any fake
    sharing that storage makes it forget too. No public API; checked on 2.8 to 2.15."""
    from torch.multiprocessing.reductions import StorageWeakRef

    assert fake.constant is not None
    converter = mode.fake_tensor_converter
    key = StorageWeakRef(fake.constant._typed_storage())  # type: ignore[no-untyped-call]
    refs = converter.constant_storage_mapping.get(key)
    if refs is None or not any(ref() is fake for ref in refs):
        converter.add_constant_storage_mapping(fake)


def unlist_constant_alias(mode: FakeTensorMode, fake: FakeTensor) -> None:
    """Take ``fake`` off the list of the fakes sharing its constant's storage in ``mode``, before it holds other
    memory (``.data =``): a later :func:`forget_constant_aliases` of that storage must leave it alone, or it would
    forget values that the tensors now sharing its memory keep. No public API; checked on 2.8 to 2.15."""
    from torch.multiprocessing.reductions import StorageWeakRef

    assert fake.constant is not None
    key = StorageWeakRef(fake.constant._typed_storage())  # type: ignore[no-untyped-call]
    refs = mode.fake_tensor_converter.constant_storage_mapping.get(key)
    if refs is not None:
        refs[:] = [ref for ref in refs if ref() is not fake]


#: Guards for a block in which torch functions and operations run as plain CPU torch, past every torch function mode
#: (the device context, spoofed CUDA) and dispatch mode: the real half of an operation on constants. ``torch._C``'s
#: guards have no public counterpart (``disable_current_modes`` pops the modes, several times dearer). Checked on 2.8
#: to 2.15.
DisableTorchFunction: Callable[[], Any] = torch._C.DisableTorchFunction
DisableTorchDispatch: Callable[[], Any] = torch._C._DisableTorchDispatch


def overloads_of(*packets: Any) -> frozenset[OpOverload]:
    """Every overload of aten operator packets (``aten.arange``): the packet class and its ``overloads()`` are
    private. Checked on 2.8 to 2.15."""
    return frozenset(getattr(packet, name) for packet in packets for name in packet.overloads())


def operator_arguments(func: OpOverload) -> tuple[str, ...]:
    """The names of an aten operation's arguments, from its schema: no public accessor. Checked on 2.8 to 2.15.
    Read once per operator (by its id: an OpOverload hashes in Python code, as dear as reading the schema)."""
    found = _ARGUMENT_NAMES.get(id(func))
    if found is None or found[0] is not func:
        found = _ARGUMENT_NAMES[id(func)] = (func, tuple(argument.name for argument in func._schema.arguments))
    return found[1]


_ARGUMENT_NAMES: dict[int, tuple[OpOverload, tuple[str, ...]]] = {}


def forget_real_tensors(mode: FakeTensorMode) -> None:
    """Drop ``mode``'s weak references to the real tensors and storages it made fakes of, once the mode is left.

    The converter keeps them (to give one real tensor one fake) for as long as the mode lives, and
    ``torch.utils.swap_tensors``, which ``Module.to`` uses in swap mode, refuses a tensor that has one: a module read
    inside ``fake_mode()`` could not be moved while the mode object lived. A later use of the mode makes new fakes
    of the real tensors it meets.

    The mappings are replaced, not cleared: ``clear()`` pops each entry, calling its weak reference, and on torch
    2.8 doing that to the storages' entries leaves the process to crash in a segmentation fault when it exits. No
    public API; checked on 2.8 to 2.15.
    """
    from torch.utils.weak import WeakIdKeyDictionary

    describer = mode.fake_tensor_converter.meta_converter.describer
    describer.lookup_tensor = WeakIdKeyDictionary()
    describer.lookup_storage = WeakIdKeyDictionary()


def forget_fakes(mode: FakeTensorMode, fakes: Iterable[FakeTensor]) -> None:
    """Drop the weak references ``mode``'s machinery keeps to ``fakes`` (the memo of fakes made from real tensors,
    and of constants), which ``torch.utils.swap_tensors`` refuses: one pass over each table for all of them. No
    public API; checked on 2.8 to 2.15."""
    gone = {id(fake) for fake in fakes}
    converter = mode.fake_tensor_converter
    memo = converter.meta_converter.tensor_memo
    for key in [key for key, value in memo.items() if id(value) in gone]:
        del memo[key]
    for refs in converter.constant_storage_mapping.values():
        refs[:] = [ref for ref in refs if id(ref()) not in gone]


# --- the CPU generator's state ---------------------------------------------------------------------------------------

# The bytes of a CPU torch.Generator's state as get_state() returns them and set_state() takes them: torch's legacy
# layout (CPUGeneratorImplStateLegacy and its THGeneratorState in aten/src/ATen/CPUGeneratorImpl.cpp), in native byte
# order. torch documents only that the state is a uint8 tensor; the jump (``_deferred.rng.mt19937``) and the models of
# the random kernels (``_deferred.rng.draws``) read and write these fields. tests/test_generator_jump.py checks them
# against torch's own draws. Checked on 2.8 to 2.15.
CPU_STATE_BYTES = 5056
CPU_STATE_HEADER = struct.Struct("=QiiQ")  # the initial seed, left, seeded, next
CPU_STATE_LEFT = struct.Struct("=i"), 8  # the format and offset of `left`
CPU_STATE_NEXT = struct.Struct("=Q"), 16  # of `next`
CPU_STATE_ARRAY = range(24, 24 + 624 * 8)  # the engine's 624 words, each a uint64 holding 32 bits
# The scalar Box-Muller cache for doubles: normal_x, normal_y, normal_rho (doubles), then normal_is_valid (int32).
CPU_STATE_NORMAL_CACHE = range(5016, 5044)
CPU_STATE_NORMAL_VALID = range(5040, 5044)


# --- aten operators --------------------------------------------------------------------------------------------------


def written_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """Position and name of each argument that an aten operation writes in place, from its schema: OpOverload has
    no public accessor for the schema. Checked on 2.8 to 2.15."""
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    )


def tensor_arguments(func: OpOverload) -> tuple[tuple[int, str], ...]:
    """Position and name of each argument of an operation whose type can hold tensors (``Tensor``, ``Tensor?``,
    ``Tensor[]``...), from its schema: OpOverload has no public accessor for the schema. Checked on 2.8 to 2.15."""
    return tuple(
        (index, argument.name)
        for index, argument in enumerate(func._schema.arguments)
        if "Tensor" in str(argument.type)
    )


@functools.cache  # asked of every factory recorded; a schema's arguments are made anew on each read
def optional_dtype_keyword(func: OpOverload) -> bool:
    """Whether an aten operation's schema has a keyword-only ``dtype`` that may be None (a factory's ``ScalarType?
    dtype``, None meaning torch's default dtype): OpOverload has no public accessor for the schema. Checked on 2.8
    to 2.15."""
    return any(
        argument.name == "dtype" and argument.kwarg_only and isinstance(argument.type, torch.OptionalType)
        for argument in func._schema.arguments
    )


class SchemaArgument(NamedTuple):
    """One argument of an aten operation's schema, as ``_deferred.ops`` reads it."""

    name: str
    kwarg_only: bool  # after the ``*``
    required: bool  # no default in the schema
    default: object  # the schema's default (None when required); a ``ScalarType`` default is a torch.dtype
    tensor: bool  # a Tensor, Tensor?, Tensor[] or Tensor?[]
    out: bool  # an ``out=`` argument
    written: bool  # marked ``(a!)``: written in place


@functools.cache  # a schema's arguments are made anew on each read
def schema_arguments(func: OpOverload) -> tuple[SchemaArgument, ...]:
    """The arguments of an aten operation's schema: OpOverload has no public accessor for the schema. A ``dtype``
    default is a ScalarType, which the schema hands over as its number (``randint``'s ``dtype=long`` is 4): torch's
    dispatcher takes that number for a dtype, so an empty meta tensor made with it names the dtype. Checked on 2.8, 2.13
    and 2.14."""
    arguments = []
    for argument in func._schema.arguments:
        required = not argument.has_default_value()
        default = None if required else argument.default_value
        if argument.name == "dtype" and type(default) is int:
            with DisableTorchFunction(), DisableTorchDispatch():  # plain torch, whatever mode asks (the recorder)
                default = torch.ops.aten.empty.memory_format([0], dtype=default, device="meta").dtype
        alias = argument.alias_info
        arguments.append(
            SchemaArgument(
                name=argument.name,
                kwarg_only=argument.kwarg_only,
                required=required,
                default=default,
                tensor="Tensor" in str(argument.type),
                out=argument.is_out,
                written=alias is not None and alias.is_write,
            )
        )
    return tuple(arguments)


def returns_tensors(func: OpOverload) -> bool:
    """Whether an aten operation's schema returns a tensor (or tensors): OpOverload has no public accessor for the
    schema. Checked on 2.8, 2.13 and 2.14."""
    return any("Tensor" in str(result.type) for result in func._schema.returns)


def returns_aliases(func: OpOverload) -> bool:
    """Whether an aten operation returns a view of an argument, or an argument itself, by its schema: OpOverload has
    no public accessor for the schema. Checked on 2.8 to 2.15."""
    return any(result.alias_info is not None for result in func._schema.returns)


#: The operator behind ``Tensor.to`` when it copies: underscored, yet what every ``.to(device, dtype)`` dispatches.
TO_COPY: OpOverload = torch.ops.aten._to_copy.default


def math_attention(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's math kernel of ``scaled_dot_product_attention`` (its own fallback), which asks no driver which
    kernel to use: an underscore operator. Checked on 2.8 to 2.15."""
    output: tuple[torch.Tensor, torch.Tensor] = torch.ops.aten._scaled_dot_product_attention_math(*args, **kwargs)
    return output


def parse_to(*args: Any, **kwargs: Any) -> tuple[torch.device | None, torch.dtype | None, bool, Any]:
    """``Tensor.to``'s arguments as (device, dtype, non_blocking, memory_format), parsed by the binding that
    ``Module.to`` uses too: there is no public parser. Checked on 2.8 to 2.15."""
    parsed: tuple[torch.device | None, torch.dtype | None, bool, Any] = torch._C._nn._parse_to(*args, **kwargs)
    return parsed


# --- modules ---------------------------------------------------------------------------------------------------------
# nn.Module keeps its parameters, buffers and submodules in three dictionaries, read directly: the public
# named_parameters() and friends walk the tree and copy, and getattr on a module is slow. Plain functions, not
# operator.attrgetter: torch.compile traces these (a VirtualTensor read), and dynamo cannot call an attrgetter.
# Checked on 2.8 to 2.15.


def parameters_of(module: nn.Module) -> dict[str, nn.Parameter | None]:
    return module._parameters


def buffers_of(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return module._buffers


def submodules_of(module: nn.Module) -> dict[str, nn.Module | None]:
    return module._modules


def non_persistent_buffers_of(module: nn.Module) -> set[str]:
    """The names of a module's own buffers left out of its state_dict. No public accessor."""
    return module._non_persistent_buffers_set


#: The name of the buffer dictionary, for modattrs/_speedups.c, which reads it for VirtualTensor.value.
BUFFER_TABLE = "_buffers"

#: The names of those three dictionaries in a module's ``__dict__``, which also holds its plain attributes.
TABLE_NAMES = frozenset({"_parameters", BUFFER_TABLE, "_modules"})

#: The names of the tables of hooks ``nn.Module.__init__`` makes (``_forward_pre_hooks``, ``_state_dict_hooks``,
#: ...): callables and flags by handle id, never the module's tensors. Read from a module as torch makes it.
HOOK_TABLE_NAMES = frozenset(
    name for name, value in vars(nn.Module()).items() if "hooks" in name and isinstance(value, dict)
)


#: The method every conversion of a module runs through (``to``, ``to_empty``, ``half``, ``cuda``...), each module's
#: calling its children's: torch offers no hook around a conversion. The write ledger wraps it while it watches, to
#: note the ties a module has before a conversion. Checked on 2.13.
MODULE_CONVERSION = "_apply"


def module_initialized(module: nn.Module) -> bool:
    """Whether ``nn.Module.__init__`` ran on ``module`` (it made the tables). Checked on 2.8 to 2.15."""
    return "_buffers" in vars(module)


def state_dict_hook_tables(module: nn.Module) -> tuple[dict[int, Any], dict[int, Any], dict[int, Any]]:
    """A module's state_dict post hooks, load_state_dict pre hooks and post hooks, by handle id: hooks are removed
    through their handles only, and an attribute's copy or unpickled twin has none. Checked on 2.8 to 2.15."""
    return module._state_dict_hooks, module._load_state_dict_pre_hooks, module._load_state_dict_post_hooks


#: The hook object torch puts in a hook table for a hook registered with ``with_module=True``: a pickled module holds
#: it, so ``torch.load(weights_only=True)`` must be allowed to build it. Checked on 2.8 to 2.15.
WrappedHook: type = torch.nn.modules.module._WrappedHook

#: The attribute that marks a state_dict post hook registered through the public API, which torch then lets edit
#: the state dict in place; a hook object put into the table directly sets it itself. Checked on 2.8 to 2.15.
PUBLIC_STATE_DICT_HOOK_FLAG = "_from_public_api"


def rnn_flat_weights(layer: nn.RNNBase) -> list[torch.Tensor | None]:
    """The weights a recurrent layer hands cuDNN as one list. Checked on 2.8 to 2.15."""
    weights: list[torch.Tensor | None] = layer._flat_weights
    return weights


def release_rnn_weights(layer: nn.RNNBase) -> None:
    """Drop a recurrent layer's weak references to its weights (``swap_tensors`` refuses weakly referenced
    tensors), as its own ``_apply`` does. Checked on 2.8 to 2.15."""
    layer._flat_weight_refs = []


def rebuild_rnn_weights(layer: nn.RNNBase) -> None:
    """Make a recurrent layer's weight list and weak references again, as its own ``_apply`` does after a
    conversion. Checked on 2.8 to 2.15."""
    layer._init_flat_weights()


# --- tensors, storages, generators -----------------------------------------------------------------------------------

# Plain functions, as above: torch.compile traces the first two.


def version_of(tensor: torch.Tensor) -> int:
    """A tensor's version counter, bumped by every in-place write. No public accessor; checked on 2.8 to 2.15."""
    return tensor._version


def address_of(obj: torch.Tensor | torch.UntypedStorage | torch.Generator) -> int:
    """The address of the C++ object a tensor, storage or generator wraps: ``torch.utils.swap_tensors`` keeps the
    Python object and replaces it, and the dispatcher hands the default generator over as a new Python object. No
    public API; checked on 2.8 to 2.15."""
    address: int = obj._cdata  # type: ignore[union-attr]
    return address


def negative_view(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor`` with the negative bit set, as ``torch._neg_view`` makes. Checked on 2.8 to 2.15."""
    return torch._neg_view(tensor)


def clear_cached_data(tensor: torch.Tensor) -> None:
    """Drop what torch caches on a tensor that its deep copy must not carry (what ``torch.Tensor.__deepcopy__``
    clears first). Checked on 2.13."""
    tensor._clear_non_serializable_cached_data()  # type: ignore[no-untyped-call]


def view_base_of(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor a view was made from, or None. Checked on 2.8 to 2.15."""
    return tensor._base


def use_count(tensor: torch.Tensor) -> int:
    """How many references the C++ side holds to the tensor's implementation: ``swap_tensors`` refuses a tensor
    held elsewhere, and this says so before a swap starts. No public API; checked on 2.8 to 2.15."""
    count: int = tensor._use_count()  # type: ignore[attr-defined]
    return count


def storage_use_count(storage: torch.UntypedStorage) -> int | None:
    """How many references the C++ side holds to a storage: one per tensor on it, and one for its Python object
    (one per storage: torch keeps it as long as the storage lives, or as long as Python holds it). None where this
    torch counts otherwise, or has no such function. No public API; checked on 2.13."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None or not _storage_references_are_tensors_and_one_object(count):
        return None
    used: int = count(storage._cdata)
    return used


@functools.cache
def _storage_references_are_tensors_and_one_object(count: Callable[[int], int]) -> bool:
    """Whether ``count`` (torch's ``_storage_Use_Count``) counts a storage's references as ``storage_use_count``
    says: tried once, on a meta tensor and an alias of it."""
    tensor = torch.empty(2, device="meta")
    storage = tensor.untyped_storage()
    if tensor.untyped_storage() is not storage:
        return False
    alone = count(storage._cdata)
    alias = tensor.detach()
    with_alias = count(storage._cdata)
    del alias
    return alone == 2 and with_alias == 3 and count(storage._cdata) == 2


def hooks_of(tensor: torch.Tensor) -> tuple[Any, Any]:
    """A tensor's backward hooks and post-accumulate-grad hooks (None where it has none). They live on its autograd
    data, which ``swap_tensors`` replaces: no public API moves them. Checked on 2.8 to 2.15."""
    return tensor._backward_hooks, getattr(tensor, "_post_accumulate_grad_hooks", None)


def restore_hooks(tensor: torch.Tensor, hooks: tuple[Any, Any]) -> None:
    """Put back what :func:`hooks_of` returned."""
    if hooks[0]:
        tensor._backward_hooks = hooks[0]
    if hooks[1]:
        tensor._post_accumulate_grad_hooks = hooks[1]


# --- torch.nn.init ---------------------------------------------------------------------------------------------------

#: The helper of torch.nn.init.trunc_normal_ that every caller (transformers' copy too) goes through; fake tensors
#: are handed to their mode there. Checked on 2.8 to 2.15.
TRUNC_NORMAL_HELPER = "_no_grad_trunc_normal_"

#: The name the helper's module warns through (``import warnings``): the helper warns with ``stacklevel=2``, and
#: nothing public lets a wrapper's frame not count; a stand-in for the module is put under this name. Checked on 2.8
#: to 2.15.
TRUNC_NORMAL_WARNINGS = "warnings"

# --- autograd --------------------------------------------------------------------------------------------------------

#: The entry of torch's autograd engine, which ``torch.autograd.backward`` and ``grad`` call once they have taken
#: their arguments (outputs and inputs made tuples, default gradients made, deprecated arguments warned about) and
#: look up in ``torch.autograd``'s namespace at each call. It is defined in ``torch.autograd.graph`` and imported
#: from there; torch.compiler patches it in both modules. No public hook sits between the arguments and the engine.
#: Checked on 2.8 and 2.13.
ENGINE_ENTRY = "_engine_run_backward"
ENGINE_ENTRY_OWNERS: tuple[object, object] = (torch.autograd, torch.autograd.graph)


def gradient_metadata(node: Any) -> Sequence[Any]:
    """Shape, dtype and device (``.shape``, ``.dtype``, ``.device``) of each gradient a graph node receives, by
    input number: no public accessor. Checked on 2.8 and 2.13; a node without it counts as receiving none."""
    metadata: Sequence[Any] = getattr(node, "_input_metadata", ())
    return metadata


def is_reentrant_checkpoint(node: object) -> bool:
    """Whether an autograd graph node is the one ``torch.utils.checkpoint(..., use_reentrant=True)`` puts in the
    graph. Its class is made in C++ for the private ``CheckpointFunction``, and no public API identifies it: its
    name does. Checked on 2.8 to 2.15."""
    return type(node).__name__ == "CheckpointFunctionBackward"


def imported_dtensor_type() -> type[torch.Tensor] | None:
    """``DTensor``, if ``torch.distributed.tensor`` was imported (no DTensor can exist otherwise, and importing it
    is slow): looked up by name in the imported module. Checked on 2.8 to 2.15."""
    module = sys.modules.get("torch.distributed.tensor")
    found: type[torch.Tensor] | None = getattr(module, "DTensor", None) if module is not None else None
    return found


# --- CUDA ------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def cuda_initialization_skipped() -> Iterator[None]:
    """In this thread, have ``torch.cuda._lazy_init`` return at once, as it does while it runs (torch's own
    re-entrance flag): a binding that moves a tensor to CUDA calls it and counts CUDA initialized once it returns.
    No public API; checked on 2.8 to 2.15."""
    state = torch.cuda._tls
    state.is_initializing = True
    try:
        yield
    finally:
        del state.is_initializing


#: The functions of ``torch.cuda`` that ``torch.cuda.device`` (so ``device_of`` too) calls to switch the current device
#: and back, looked up at each call; spoofed CUDA answers them (``torch.cuda.set_device`` is public). No public hook.
#: Checked on 2.8 to 2.15.
CUDA_DEVICE_EXCHANGES = ("_exchange_device", "_maybe_exchange_device")

#: The binding that parses ``Module.to``'s arguments (:func:`parse_to`), as torch hands it to torch function modes,
#: which see an int device there before the binding makes it a device. Checked on 2.8 to 2.15.
PARSE_TO_BINDING: Callable[..., Any] = torch._C._nn._parse_to


#: Dynamo's frame hook for this thread: None unless dynamo is compiling or running compiled code (the public
#: ``torch.compiler.is_compiling()`` is False there). Checked on 2.8 to 2.15.
dynamo_frame_hook: Callable[[], object] = torch._C._dynamo.eval_frame.get_eval_frame_callback


def dispatch_as_written(method: Callable[..., Any]) -> Callable[..., Any] | None:
    """The ``__torch_dispatch__`` a dispatch mode class wrote, if ``method`` is torch's dynamo "disable" wrapper
    of it (``TorchDispatchMode.__init_subclass__`` makes one with ``functools.wraps`` on 2.13 and 2.15), else None
    (2.8 wraps nothing)."""
    written = getattr(method, "__wrapped__", None)
    return written if callable(written) and getattr(written, "__name__", None) == "__torch_dispatch__" else None


@functools.cache
def torch_tensor_fields() -> frozenset[str]:
    """The names torch keeps in the ``__dict__`` of a fake tensor and of a parameter made of one (its mode, its
    device, the parameter flag and more), as opposed to attributes a user sets. No public API lists them: they are
    found by making one. Checked on 2.8 to 2.15."""
    with disable_current_modes():
        fake = FakeTensor(FakeTensorMode(), torch.empty(1, device="meta"), torch.device("cpu"))
        parameter = nn.Parameter(fake)
    return frozenset(vars(fake)) | frozenset(vars(parameter))


def import_dynamo() -> None:
    """Import ``torch._dynamo``, which wraps ``torch.manual_seed`` when it is imported (see _torch_changes)."""
    import torch._dynamo  # noqa: F401


# --- distributed -----------------------------------------------------------------------------------------------------


def set_state_dict_element(state_dict: Any, path: tuple[str | int, ...], value: Any) -> None:
    """Set the element at ``path`` of a nested state dict, as the distributed checkpoint loader does: its helper is
    private. Checked on 2.8 to 2.15."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(state_dict, path, value)


#: The module of DTensor's placements, whose ``Shard``, ``_StridedShard`` and ``Replicate`` send the data of
#: ``src_data_rank`` (0 unless given None: ``distribute_tensor``'s default, and ``parallelize_module``'s) through
#: the two helpers below, imported there by name from ``torch.distributed.tensor._collective_utils`` and looked up
#: in its namespace at each call. ``mesh_scatter(output, scatter_list, mesh, mesh_dim, async_op, ...)`` gets the
#: whole list on every rank (only the source's list reaches c10d) and delivers ``scatter_list[i]`` to the rank of
#: local rank ``i`` on ``mesh_dim``; ``mesh_broadcast(tensor, mesh, mesh_dim, async_op, ...)`` fills ``tensor``
#: in place. Checked on 2.8 and 2.13.
DTENSOR_PLACEMENTS = "torch.distributed.tensor.placement_types"
DTENSOR_SCATTER = "mesh_scatter"
DTENSOR_BROADCAST = "mesh_broadcast"

#: FSDP2 cuts each parameter into as many chunks as ranks with ``_chunk_with_empty(tensor, num_chunks, dim)``
#: (``list(torch.chunk(...))``, padded with empty tensors to ``num_chunks``), imported by name into the module below
#: and looked up in its namespace at each call; ``FSDPParam`` reads the rank's chunk and the first. Checked on 2.8,
#: 2.13 and 2.14.
FSDP_PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"
FSDP_CHUNKS = "_chunk_with_empty"

#: ``FSDPParam._init_sharded_post_forward_param_metadata(self, param)`` cuts the parameter's local tensor again with
#: ``_chunk_with_empty`` and reads the size of the rank's chunk alone (``_get_dim_chunked_size``), keeping no chunk.
#: Checked on 2.8, 2.13 and 2.14.
FSDP_PARAM_CLASS = "FSDPParam"
FSDP_POST_FORWARD_SIZES = "_init_sharded_post_forward_param_metadata"

#: ``FSDPParam._init_sharded_param(self, param, ...)`` cuts the parameter with ``_chunk_with_empty``, reads the
#: rank's chunk, then chunk 0 for its size alone (``padded_sharded_size = chunks[0].size()``), and no other chunk.
#: Checked on 2.8, 2.13 and 2.14.
FSDP_SHARDED_PARAM = "_init_sharded_param"


def dtensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor a DTensor holds: ``DTensor.to_local()`` returns another tensor object each time, and
    ``swap_tensors`` has to reach this one. Checked on 2.8 to 2.15."""
    local: torch.Tensor = tensor._local_tensor  # type: ignore[attr-defined]
    return local


def fsdp_padded_shards(module: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """For each parameter that FSDP2 manages in ``module`` (a ``fully_shard`` unit): the module holding it, its
    name there, and the padded flat shard storage its all-gathers read.

    FSDP2 has no public API to reach that storage, nor one to rebuild it after the local tensor changed
    (``reset_sharded_param`` is private too, and copies into new storage when the shard is padded). 2.13 and 2.15
    keep the groups as ``_fsdp_param_groups``; 2.8 keeps one group as ``_fsdp_param_group`` (None when the unit
    manages no parameter). Checked on 2.8 to 2.15.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module_type = getattr(fsdp, "FSDPModule", None)
    if fsdp_module_type is None or not isinstance(module, fsdp_module_type):
        return
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [group] if (group := state._fsdp_param_group) is not None else []
    for group in groups:
        for fsdp_param in group.fsdp_params:
            info = fsdp_param._module_info
            yield info.module, info.param_name, fsdp_param._sharded_param_data
