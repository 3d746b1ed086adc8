"""The record behind :mod:`modattrs.deferred`: a fake tensor mode that writes down every operation on its tensors.

Identity. A tensor is known by where its data would live: (storage, offset, sizes, strides, dtype, conj and neg
bits). Python objects and tensor impls are no good as keys, because ``nn.Parameter(t)``, ``t.data`` and
``p.data = t`` make or rewire them without an operation that a mode could see; all three keep storage and
geometry, though. Every storage the record has seen is kept alive (a fake storage holds no data), so no two
storages ever share an address.

Random numbers. Fake tensors draw nothing, so the real generators stay where they were while recording; what each
random operation would have drawn is worked out at replay (``_replay``). A draw from the default CPU generator
notes where eager code would have the generator before it (see ``_generator``) when that is not where the record's
previous draw left it: after a reseed, a ``fork_rng``, or draws recorded by another module in between. A
``torch.Generator`` passed explicitly is advanced for real, on a scratch tensor, and its state before each operation
is kept, so replays use it in constant time and the object ends where eager code leaves it.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from modattrs import _cuda_guard, _generator, _torch_changes
from modattrs._fake_tensors import ModattrsFakeTensorMode
from modattrs._generator import Position

__all__: list[str] = []

Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, bool, bool]


class DeferredInitError(RuntimeError):
    """Deferred initialization cannot reproduce what eager construction would do."""


class Draws(enum.Enum):
    """Which generator an operation draws from."""

    NONE = 0
    DEFAULT = 1  # the default generator of the device it runs on
    EXPLICIT = 2  # torch.Generator objects passed to it: their state before the operation is recorded


@dataclass(frozen=True, slots=True)
class Slot:
    """A fake tensor argument: its index in the flattened arguments, its ref, its storage, and its layout."""

    index: int
    ref: int
    storage: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    written: bool


@dataclass(slots=True)
class Op:
    """One recorded call: an aten operation, or an opaque initializer (a Python function)."""

    func: Callable[..., Any]
    flat: list[Any]  # the flattened (args, kwargs); fake tensors and real ones left as None
    spec: TreeSpec
    slots: tuple[Slot, ...]
    constant_slots: tuple[tuple[int, torch.Tensor, int], ...]  # (position, real tensor, its version when recorded)
    device_slots: tuple[int, ...]
    generator_states: tuple[tuple[int, torch.Tensor], ...]  # (position, state before the operation)
    in_refs: frozenset[int]
    in_storages: frozenset[int]
    out_refs: tuple[int | None, ...]  # one per leaf of the result; None for leaves that are not tensors
    writes: frozenset[int]  # storages written in place
    draws: Draws
    device: torch.device | None  # where it ran: the device of its result, or of what it wrote
    reset: Position | None  # for draws: where the default CPU generator was set to before it (see _generator)
    pinned: bool  # draws from a default generator as many numbers as fake values say: it runs in every replay
    default_dtype: torch.dtype

    @property
    def name(self) -> str:
        return _name(self.func)

    @property
    def opaque(self) -> bool:
        return not isinstance(self.func, torch._ops.OpOverload)

    def arguments(
        self,
        tensors: Mapping[int, torch.Tensor],
        device: torch.device | None,
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> tuple[Any, Any]:
        """The arguments to call ``func`` with: fake tensors replaced from ``tensors`` (by position), real ones
        checked, devices replaced by ``device`` if given, generators by ``generators`` or by copies at their
        recorded state."""
        flat = list(self.flat)
        for position, tensor in tensors.items():
            flat[position] = tensor
        for position, constant, version in self.constant_slots:
            if constant._version != version:
                raise DeferredInitError(
                    f"a real tensor ({tuple(constant.shape)}, {constant.dtype}) given to {self.name} while recording "
                    "was changed in place since; the recorded "
                    "result would differ from what eager construction computed. Leave tensors handed to a deferred "
                    "module unchanged until it is materialized"
                )
            flat[position] = constant if device is None else constant.to(device)
        if device is not None:
            for position in self.device_slots:
                flat[position] = device
        for position, state in self.generator_states:
            generator = torch.Generator(self.flat[position].device)
            generator.set_state(state)
            flat[position] = generator
        for position, generator in (generators or {}).items():
            flat[position] = generator
        return tree_unflatten(flat, self.spec)  # type: ignore[no-any-return]


@dataclass(eq=False)  # identity: points of records are compared with `is`
class Record:
    """Everything that happened to the tensors of one ``deferred_init`` call, in order."""

    start: Position  # of the default CPU generator when recording began (see _generator)
    ops: list[Op] = field(default_factory=list)
    keys: dict[Key, int] = field(default_factory=dict)
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    next_ref: int = 0
    root: weakref.ref[torch.nn.Module] | None = None  # what deferred_init returned
    point: Position = field(init=False)  # the default CPU generator's position after the record's last draw
    point_epoch: int = field(init=False)  # _generator.epoch then: a reseed since makes the point history
    epoch: int = field(init=False)  # _generator.epoch at the record's last draw on another device
    states_after: dict[int, torch.Tensor] = field(default_factory=dict)  # CPU state after the first n ops

    def __post_init__(self) -> None:
        self.point = self.start
        self.epoch = self.point_epoch = _generator.epoch


def new_record() -> Record:
    return Record(start=_generator.position())


class RecordingFakeTensorMode(ModattrsFakeTensorMode):  # type: ignore[no-untyped-call]
    """modattrs' fake tensor mode, writing every operation on its tensors into a :class:`Record`.

    The mode records for as long as its tensors live, inside ``deferred_init`` and after it: conversions
    (``.half()``, ``.to()``) and in-place initialization done later are part of the record, so materializing
    honours them.
    """

    def __init__(self, record: Record) -> None:
        super().__init__()
        self.record = record
        self._depth = threading.local()  # the mode calls itself for decompositions: only the outer call counts

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        depth: int = getattr(self._depth, "n", 0)
        if depth:
            return super().__torch_dispatch__(func, types, args, kwargs)
        kwargs = kwargs or {}
        with _generator.lock:
            random = torch.Tag.nondeterministic_seeded in func.tags
            pending = self._begin(func, args, kwargs, _mutated_arguments(func, args, kwargs), random=random)
            self._depth.n = 1
            try:
                result = super().__torch_dispatch__(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException) as error:
                raise _needs_values(_name(func)) from error
            except (UnsupportedFakeTensorException, UnsupportedOperatorException) as error:
                raise DeferredInitError(
                    f"{_name(func)} cannot run on fake tensors ({where()}): {error}. deferred_init records on fake "
                    "tensors; build this part outside deferred_init and hand it in real"
                ) from error
            finally:
                self._depth.n = 0
            self._finish(pending, result)
        return result

    def opaque_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], target: FakeTensor
    ) -> FakeTensor:
        """Record ``func(*args, **kwargs)`` as one call that writes ``target`` in place, without running it."""
        with _generator.lock:
            pending = self._begin(func, args, kwargs, (target,), random=True)
            self._finish(pending, target)
        return target

    def note_generator(self) -> None:
        """Record where the default CPU generator is if it moved since the last draw (a reseed at the end of
        construction), so that a full replay leaves it there."""
        with _generator.lock:
            reset = self._cpu_reset()
            if reset is None:
                return
            self._append(
                Op(
                    func=_no_draw,
                    flat=[],
                    spec=tree_flatten(((), {}))[1],
                    slots=(),
                    constant_slots=(),
                    device_slots=(),
                    generator_states=(),
                    in_refs=frozenset(),
                    in_storages=frozenset(),
                    out_refs=(),
                    writes=frozenset(),
                    draws=Draws.DEFAULT,
                    device=torch.device("cpu"),
                    reset=reset,
                    pinned=False,
                    default_dtype=torch.get_default_dtype(),
                )
            )

    def ref_of(self, tensor: FakeTensor) -> int | None:
        """The record's name for ``tensor``, or None if the record cannot account for it."""
        with _generator.lock:
            return self.record.keys.get(self._key_of(tensor))

    def storage_of(self, tensor: FakeTensor) -> int:
        with _generator.lock:
            return self._storage_of(tensor)

    def forget(self, tensor: FakeTensor) -> None:
        """Drop the weak references torch's fake tensor machinery keeps to ``tensor`` (the memo of fakes made from
        real tensors, and of constants), which ``torch.utils.swap_tensors`` would refuse."""
        converter = self.fake_tensor_converter
        memo = converter.meta_converter.tensor_memo
        for key in [key for key, value in memo.items() if value is tensor]:
            del memo[key]
        for refs in converter.constant_storage_mapping.values():
            refs[:] = [ref for ref in refs if ref() is not tensor]

    # --- recording --------------------------------------------------------------------------------------------------

    def _begin(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        mutated: Sequence[torch.Tensor],
        *,
        random: bool,
    ) -> _Pending:
        originals, spec = tree_flatten((tuple(args), dict(kwargs)))
        flat = list(originals)
        written = {id(t) for t in mutated}
        slots: list[Slot] = []
        constant_slots: list[tuple[int, torch.Tensor, int]] = []
        device_slots: list[int] = []
        generators: list[tuple[int, torch.Generator]] = []
        for position, value in enumerate(originals):
            if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)) or (
                isinstance(value, torch.Tensor) and value.layout is not torch.strided
            ):
                raise DeferredInitError(
                    f"{_name(func)} was given a {type(value).__name__} ({where()}); deferred_init records strided "
                    "tensors only, not storages (set_ with a storage; copy.deepcopy of a view at an offset) or sparse "
                    "tensors: do this after materialize_module"
                )
            if isinstance(value, FakeTensor):
                ref, storage = self._ref_of(value, func)
                slots.append(
                    Slot(
                        position,
                        ref,
                        storage,
                        tuple(value.shape),
                        tuple(value.stride()),
                        value.dtype,
                        value.device,
                        id(value) in written,
                    )
                )
                flat[position] = None
            elif isinstance(value, torch.Tensor):  # a real tensor from outside (torch.tensor(...), a loaded weight)
                constant_slots.append((position, value, value._version))
                flat[position] = None
            elif isinstance(value, torch.device):
                device_slots.append(position)
                if value.type == "cuda" and not _cuda_guard.ready():
                    _make_fake_cuda_possible(func)
            elif isinstance(value, torch.Generator) and not _is_default(value):
                generators.append((position, value))
        draws = Draws.NONE if not random else Draws.EXPLICIT if generators else Draws.DEFAULT
        return _Pending(
            func=func,
            flat=flat,
            spec=spec,
            slots=tuple(slots),
            constant_slots=tuple(constant_slots),
            device_slots=tuple(device_slots),
            generators=tuple(generators),
            draws=draws,
            mutated=written,
            arg_refs={id(originals[slot.index]): slot.ref for slot in slots},
        )

    def _finish(self, pending: _Pending, result: Any) -> None:
        """Name the results, then append the operation, noting what it drew from."""
        out_refs, writes, device = self._name_results(pending, result)
        op = Op(
            func=pending.func,
            flat=pending.flat,
            spec=pending.spec,
            slots=pending.slots,
            constant_slots=pending.constant_slots,
            device_slots=pending.device_slots,
            generator_states=(),
            in_refs=frozenset(slot.ref for slot in pending.slots),
            in_storages=frozenset(slot.storage for slot in pending.slots),
            out_refs=out_refs,
            writes=writes,
            draws=pending.draws,
            device=device,
            reset=None,
            pinned=pending.draws is Draws.DEFAULT and _reads_values(pending),
            default_dtype=torch.get_default_dtype(),
        )
        if pending.draws is Draws.EXPLICIT:
            if _reads_values(pending):
                raise DeferredInitError(
                    f"{_name(pending.func)} draws from a torch.Generator as many numbers as the values of its fake "
                    f"inputs say ({where()}), which cannot be known while recording; draw from the default generator "
                    "or do this after materialize_module"
                )
            op.generator_states = tuple((index, generator.get_state()) for index, generator in pending.generators)
            _advance(op, dict(pending.generators))  # so the generator object ends where eager code leaves it
        elif pending.draws is Draws.DEFAULT and device is not None and device.type == "cpu":
            op.reset = self._cpu_reset()
            self._append(op)
            return
        elif pending.draws is Draws.DEFAULT and _generator.epoch != self.record.epoch:
            # Another device's generator: eager code on the CPU (device='cpu' at materialization) would have used
            # the CPU generator, reseeded here.
            op.reset = _generator.real_state()
            self.record.epoch = _generator.epoch
        self.record.ops.append(op)

    def _name_results(
        self, pending: _Pending, result: Any
    ) -> tuple[tuple[int | None, ...], frozenset[int], torch.device | None]:
        """Give each fake tensor in ``result`` its ref (a new one, or its argument's if written in place), and find
        the storages written and the device the operation ran on."""
        record = self.record
        out_refs: list[int | None] = []
        writes = {slot.storage for slot in pending.slots if slot.written}
        device: torch.device | None = None
        for leaf in tree_flatten(result)[0]:
            if not isinstance(leaf, FakeTensor):
                out_refs.append(None)
                continue
            if leaf.layout is not torch.strided:
                raise DeferredInitError(
                    f"{_name(pending.func)} made a {leaf.layout} tensor ({where()}); deferred_init records strided "
                    "tensors only: make this one after materialize_module"
                )
            device = device or leaf.device
            ref = pending.arg_refs.get(id(leaf))
            if ref is None:
                ref = record.next_ref
                record.next_ref += 1
            elif id(leaf) in pending.mutated:
                writes.add(self._storage_of(leaf))  # set_ and resize_ move it to another storage
            record.keys[self._key_of(leaf)] = ref
            out_refs.append(ref)
        if device is None:
            device = next((slot.device for slot in pending.slots if slot.written), None)
        return tuple(out_refs), frozenset(writes), device

    def _cpu_reset(self) -> Position | None:
        """Where the default CPU generator is before a draw, unless it is where this record's last draw left it."""
        now = _generator.position()
        if now is self.record.point or (
            isinstance(now, torch.Tensor)
            and isinstance(self.record.point, torch.Tensor)
            and _generator.same(now, self.record.point)
        ):
            return None
        return now

    def _append(self, op: Op) -> None:
        """Append a draw from the default CPU generator, which moves the generator's position past it."""
        self.record.ops.append(op)
        point = (self.record, len(self.record.ops))
        self.record.point, self.record.point_epoch = point, _generator.epoch
        _generator.move_to(point)

    def _ref_of(self, tensor: FakeTensor, func: Callable[..., Any]) -> tuple[int, int]:
        """The ref and the storage of a fake tensor given to ``func``."""
        if tensor.fake_mode is not self:
            raise DeferredInitError(
                f"{_name(func)} was given a fake tensor that this deferred_init did not record (made by another fake "
                f"mode or another deferred_init call) ({where()}); deferred modules can only be combined with tensors "
                "made in the same deferred_init call or real ones"
            )
        key = self._key_of(tensor)
        ref = self.record.keys.get(key)
        if ref is None:
            raise DeferredInitError(
                f"{_name(func)} was given a fake tensor ({tuple(tensor.shape)}, {tensor.dtype}) whose making was not "
                f"recorded ({where()}); make tensors with torch operations inside deferred_init"
            )
        return ref, key[0]

    def _storage_of(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        address: int = storage._cdata
        if address not in self.record.storages:
            self.record.storages[address] = storage
        return address

    def _key_of(self, tensor: torch.Tensor) -> Key:
        return (
            self._storage_of(tensor),
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
            tensor.is_conj(),
            tensor.is_neg(),
        )


class ValueReads(TorchFunctionMode):
    """Active while ``deferred_init`` records: reads of values that torch does not send through the dispatcher.

    ``.numpy()``, ``np.asarray``, DLPack and formatting (``f"{t:.2f}"``) of a recorded fake tensor raise a
    :class:`DeferredInitError` naming the operation and where it ran, as reads that do reach the dispatcher
    (``.item()``, ``bool(t)``) do, rather than torch's error for tensor subclasses. Value reads of real tensors run
    outside the fake mode: inside it, ``.numpy()`` detaches into a fake tensor and reads memory that is not its
    data, and ``.item()`` makes a fake of the tensor first, which has no values.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = _VALUE_READS.get(func) if args else None
        if name is None:
            return func(*args, **kwargs)
        tensor = args[0]
        if not isinstance(tensor, FakeTensor):
            with _disable_current_modes():
                return func(*args, **kwargs)
        if isinstance(tensor.fake_mode, RecordingFakeTensorMode) and _skips_dispatch(name, tensor, args):
            raise _needs_values(name)
        return func(*args, **kwargs)


def _skips_dispatch(name: str, tensor: torch.Tensor, args: Sequence[Any]) -> bool:
    """Whether ``name`` reads values without an operation that the recording mode would see (and refuse)."""
    if name == "Tensor.__format__":  # a format spec on a tensor of one value formats that value; repr otherwise
        return tensor.dim() == 0 and any(args[1:])
    return name in _SKIPPING_DISPATCH


# Tensor methods that read values; the first ones do so without an operation a dispatch mode sees.
_SKIPPING_DISPATCH = ("Tensor.numpy", "Tensor.__array__", "Tensor.__dlpack__")
_VALUE_READS: dict[Any, str] = {
    getattr(torch.Tensor, name): f"Tensor.{name}"
    for name in (
        "numpy", "__array__", "__dlpack__", "__format__",
        "item", "tolist", "__float__", "__int__", "__bool__", "__complex__", "__index__",
    )
}  # fmt: skip


def _needs_values(operation: str) -> DeferredInitError:
    return DeferredInitError(
        f"{operation} needs the values of fake tensors, which do not exist while deferred_init records ({where()}). "
        "Values that depend on data cannot be recorded one operation at a time: move this code after "
        "materialize_module, or record the function doing it as one call with modattrs.deferred.register_opaque_init"
    )


@dataclass(slots=True, kw_only=True)
class _Pending:
    func: Callable[..., Any]
    flat: list[Any]
    spec: TreeSpec
    slots: tuple[Slot, ...]
    constant_slots: tuple[tuple[int, torch.Tensor, int], ...]
    device_slots: tuple[int, ...]
    generators: tuple[tuple[int, torch.Generator], ...]
    draws: Draws
    mutated: set[int]
    arg_refs: dict[int, int]


def _make_fake_cuda_possible(func: Callable[..., Any]) -> None:
    """A record that asks for CUDA on a build of torch without it gets fake CUDA, as torchdistx's did: what
    ``fake_mode(fake_cuda=True)`` sets up."""
    try:
        _torch_changes.install_fake_cuda()
    except RuntimeError as error:
        raise DeferredInitError(
            f"{_name(func)} asks for a CUDA device ({where()}), which this build of torch lacks: deferred_init makes "
            f"fake CUDA tensors then, and cannot here. {error} Or build the module for the CPU: materialized, its "
            "values are those of eager construction on the CPU either way"
        ) from error


def _no_draw() -> None:
    """Stands for a reset of the default CPU generator that no draw followed."""


def scratch_arguments(op: Op, device: torch.device | None) -> dict[int, torch.Tensor]:
    """Stand-ins for an operation's fake arguments, to make it draw what it would draw: empty tensors of the same
    layout for what it writes, ones for what it reads."""
    tensors = {}
    for slot in op.slots:
        on = device or slot.device
        if slot.written:
            tensors[slot.index] = torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype, device=on)
        else:
            tensors[slot.index] = torch.ones(slot.size, dtype=slot.dtype, device=on)
    return tensors


def _advance(op: Op, generators: Mapping[int, torch.Generator]) -> None:
    """Run an operation that draws from explicit generators for real, on scratch tensors, to advance them."""
    with _disable_current_modes(), torch.no_grad():
        args, kwargs = op.arguments(scratch_arguments(op, None), None, generators)
        op.func(*args, **kwargs)


def _reads_values(pending: _Pending) -> bool:
    """Whether the operation draws as many numbers as the values of fake tensors say (opaque ones might)."""
    value_dependent = pending.func in _VALUE_DEPENDENT_DRAWS or not isinstance(pending.func, torch._ops.OpOverload)
    return value_dependent and any(not slot.written for slot in pending.slots)


# Random operations that draw as many numbers as their inputs' values say.
_VALUE_DEPENDENT_DRAWS = frozenset(
    {
        torch.ops.aten.poisson.default,
        torch.ops.aten.binomial.default,
        torch.ops.aten._standard_gamma.default,
        torch.ops.aten._sample_dirichlet.default,
        torch.ops.aten.multinomial.default,
    }
)

_MUTATED: dict[Any, tuple[tuple[int, str], ...]] = {}


def _mutated_arguments(func: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors that an aten operation writes in place, from its schema."""
    written = _MUTATED.get(func)
    if written is None:
        written = tuple(
            (index, argument.name)
            for index, argument in enumerate(func._schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        _MUTATED[func] = written
    tensors: list[torch.Tensor] = []
    for index, name in written:
        value = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(v for v in value if isinstance(v, torch.Tensor))
    return tensors


# --- where an operation happened, for error messages -----------------------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, __file__, contextlib.__file__, functools.__file__)
)


def where() -> str:
    """The innermost module method running and the first source line outside torch and modattrs."""
    frame = sys._getframe(1)
    method: str | None = None
    line: str | None = None
    while frame is not None and (method is None or line is None):
        code = frame.f_code
        if method is None:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                method = f"{type(owner).__name__}.{code.co_name}"
        if line is None and not code.co_filename.startswith(_LIBRARY_DIRS) and "<frozen" not in code.co_filename:
            line = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    parts = [f"in {method}" if method else "outside any module", f"at {line}" if line else None]
    return ", ".join(part for part in parts if part)


def _is_default(generator: torch.Generator) -> bool:
    # The dispatcher hands the default generator over as a new Python object: compare what it wraps.
    address: int = generator._cdata  # type: ignore[attr-defined]
    default: int = torch.default_generator._cdata  # type: ignore[attr-defined]
    return address == default


def _name(func: Callable[..., Any]) -> str:
    return str(func) if isinstance(func, torch._ops.OpOverload) else _qualname(func)


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"
