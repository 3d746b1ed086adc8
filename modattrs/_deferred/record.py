"""What :mod:`modattrs.deferred` writes down: the record of one ``deferred_init`` call, as plain data.

A record is a list of operations (:class:`Op`) on tensors known by number (refs), each with where its fake
arguments sit in its flattened arguments (:class:`Slot`), what it read and wrote, and which generator it drew from
(:class:`Draws`). The recorder (``recorder``) appends to it, the replayer (``replay``) runs parts of it, and the
generator timeline (``rng.generator``) keeps its notes on the random generator in the record's last fields. Nothing
here changes a record or torch, and the one state of torch read is the default dtype, by ``Op.arguments`` (see
Note [The default dtype is passed, never set]).
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Union

import torch

from modattrs._names import callable_name
from modattrs._torch_private import OpOverload, TreeSpec, address_of, negative_view, tree_unflatten, version_of

__all__: list[str] = []


class DeferredInitError(RuntimeError):
    """Deferred initialization cannot reproduce what eager construction would do."""


# Where the default CPU generator is, as eager code would see it (see generator): its real state, or a point of a
# record, (record, n), meaning "the state after the first n operations of that record drew".
Point = tuple["Record", int]
Position = Union[torch.Tensor, Point]  # noqa: UP007 (evaluated at runtime on Python 3.10)

Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype, bool, bool]


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a ref's data sits when an operation made it: its storage, and its offset, sizes and strides there, in
    elements of its dtype."""

    storage: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def span(self) -> range:
        """The elements of the storage it spans; empty without elements. Worked out when asked: most refs are never
        asked (a split into as many chunks as ranks makes a ref of every chunk, and a rank keeps one)."""
        if not all(self.size):
            return range(self.offset, self.offset)
        low = high = self.offset
        for size, stride in zip(self.size, self.stride, strict=True):
            if stride < 0:
                low += (size - 1) * stride
            else:
                high += (size - 1) * stride
        return range(low, high + 1)


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
    # Whether it sits where its ref's layout says (in its storage, sizes, strides and dtype: slots hold no offsets);
    # not so for a ref whose geometry changed in place (``set_``, ``resize_``).
    laid: bool = False


@dataclass(frozen=True, slots=True)
class Constant:
    """A real tensor argument (``torch.tensor(...)``'s data, a tensor handed to the constructor, a checkpoint's
    tensor copied in): its position in the flattened arguments, the tensor the replays use and its version when
    recorded. Recording refuses an operation that writes into one, so replays only read it.

    Note [Real tensors are read when recorded]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Eager code reads a real tensor's values when the operation runs, and a replay runs it later; in between, its
    values can change without its version counter moving (``t.data.mul_(0)``, a numpy array sharing its memory), so
    the counter cannot tell. An operation that reads the values (``copy_`` of ``load_state_dict``, ``given + 1``)
    gets a copy of them made when it is recorded (``snapshot``): replays compute what eager code did, and the real
    tensor is not kept. A view operation (``given[:2]``) keeps the real tensor, as eager code's view does, and the
    bytes it spans when recorded (``recorded``): a replay that finds other values or another version refuses, as
    the module would hold other values than eager construction made. ``torch.tensor(...)``'s own real tensor, which
    no other code holds, is kept as it is.
    """

    index: int
    tensor: torch.Tensor
    version: int
    recorded: torch.Tensor | None = None  # of a tensor kept by reference: the bytes it spanned when recorded
    text: str = "a real tensor"  # what it is, for messages


def span_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s storage from its first element to its last, as a 1-D uint8 tensor viewing them."""
    storage = tensor.untyped_storage()
    low = high = tensor.storage_offset()
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if size == 0:
            low, high = tensor.storage_offset(), tensor.storage_offset() - 1
            break
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    item = tensor.element_size()
    raw = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return raw.set_(storage, low * item, ((high - low + 1) * item,), (1,))


def snapshot(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` as it is now, in memory of its own: the bytes it spans, with its sizes, strides, dtype,
    conjugate and negative bits (see Note [Real tensors are read when recorded]). Call with every mode off."""
    spanned = span_bytes(tensor)
    low = spanned.storage_offset() // tensor.element_size()
    copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    copy.set_(spanned.clone().untyped_storage(), tensor.storage_offset() - low, tensor.shape, tensor.stride())
    if tensor.is_conj():
        copy = copy.conj()
    if tensor.is_neg():
        copy = negative_view(copy)
    return copy


# This replay's copy of each storage of the record's real tensors that it writes or aliases, by address: a record is
# never changed by replaying it (a second replay, of a deep copy or of another part, starts from the same values),
# and real tensors sharing a storage share its copy, as they share the storage in eager code.
Copies = dict[int, torch.UntypedStorage]


class Results(NamedTuple):
    """Where the tensors an operation returned lie, by the record's layouts: noted once, when it is recorded, for
    every replay's windows (``windows``) to read (a ``split`` at N ranks returns N tensors)."""

    storages: frozenset[int]  # of those the record knows the layout of
    dtypes: frozenset[torch.dtype]  # of those
    unlaid: bool  # whether the record knows no layout for one of them


NO_RESULTS = Results(frozenset(), frozenset(), False)


def results_of(func: object, out_refs: Sequence[int | None], layouts: Mapping[int, Layout]) -> Results:
    """The ``Results`` of an operation ``func`` that returned the tensors ``out_refs``."""
    first = layouts.get(out_refs[0]) if out_refs and out_refs[0] is not None else None
    if first is not None and (len(out_refs) == 1 or (isinstance(func, OpOverload) and func.is_view)):
        # one result (most operations), or a split's: each result of a view operation is a view of the storage it
        # viewed, in its dtype, and the first tells for all
        return Results(frozenset((first.storage,)), frozenset((first.dtype,)), False)
    laid = [layouts.get(ref) for ref in out_refs if ref is not None]
    known = [layout for layout in laid if layout is not None]
    return Results(
        frozenset(layout.storage for layout in known),
        frozenset(layout.dtype for layout in known),
        len(known) < len(laid),
    )


class Later(enum.Enum):
    """A field of an ``Op`` not worked out yet."""

    CALL = enum.auto()


@dataclass(slots=True)
class Op:
    """One recorded call: an aten operation, or an opaque initializer (a Python function)."""

    func: Callable[..., Any]
    flat: list[Any]  # the flattened (args, kwargs); fake tensors and real ones left as None
    spec: TreeSpec
    slots: tuple[Slot, ...]
    constant_slots: tuple[Constant, ...]
    device_slots: tuple[int, ...]
    generator_states: tuple[tuple[int, torch.Tensor], ...]  # (position, state before the operation)
    in_refs: frozenset[int]
    reads: frozenset[int]  # storages whose values it reads (a view reads none; an overwrite not its target)
    out_refs: tuple[int | None, ...]  # one per leaf of the result; None for leaves that are not tensors
    results: Results  # where those lie
    writes: frozenset[int]  # storages written in place
    # Writes values into its first argument, whatever it held, and returns it unchanged otherwise (``normal_``,
    # ``fill_``, ``copy_``, opaque initializers): the tensor it returns is not made by it.
    value_writer: bool
    overwrites: frozenset[int]  # storages it writes whole, as a value writer: earlier writes to them are dead
    touched: frozenset[int]  # the storages of its tensor arguments and results, and those it writes
    draws: Draws
    device: torch.device | None  # where it ran: the device of its result, or of what it wrote
    reset: Position | None  # for draws: where the default CPU generator was set to before it (see generator)
    pinned: bool  # draws from a default generator as many numbers as fake values say: it runs in every replay
    default_dtype: torch.dtype  # torch's default dtype when it was recorded
    # How ``flat`` splits into the arguments when each is a leaf or a list of leaves, as for aten calls (see
    # ``plain_call``); else None, and ``spec`` says.
    plain: Plain | None = None
    # The arguments as called, fake tensors left None, when they need no more than those put in (see ``call_of``):
    # worked out by the first replay that calls it, as most recorded operations are never replayed on a rank.
    call: Call | Literal[Later.CALL] | None = Later.CALL
    # The positions in ``flat`` of the integer and boolean tensors that it promoted to the default dtype: cast to
    # ``default_dtype`` before the call (see Note [The default dtype is passed, never set]).
    promoted: tuple[int, ...] = ()
    # Whether it reads torch's default dtype in a way the replay cannot pass: it runs only under ``default_dtype``.
    reads_default_dtype: bool = False

    @property
    def name(self) -> str:
        return callable_name(self.func)

    @property
    def opaque(self) -> bool:
        return not isinstance(self.func, OpOverload)

    def arguments(
        self,
        tensors: Mapping[int, torch.Tensor],
        device: torch.device | None,
        generators: Mapping[int, torch.Generator] | None = None,
        copies: Copies | None = None,
    ) -> tuple[Any, Any]:
        """The arguments to call ``func`` with: fake tensors replaced from ``tensors`` (by position), real ones
        checked, and replaced by views of their storage's copy in ``copies`` where the operation writes them (an
        opaque one may) or where the replay copied it before; devices replaced by ``device`` if given, generators by
        ``generators`` or by copies at their recorded state. The real tensors it hands over unchanged may come back
        in the results: see :func:`private_results`.

        Raises ``DeferredInitError`` for an operation that reads torch's default dtype in a way that cannot be passed
        to it (``reads_default_dtype``) when the default dtype is not the one it was recorded with.
        """
        if self.reads_default_dtype and self.default_dtype is not torch.get_default_dtype():
            raise _default_dtype_refused(self)
        call = self.call
        if call is Later.CALL:
            call = self.call = call_of(self)
        if call is not None and not generators and (device is None or not self.device_slots):
            # Most operations of a replay (the views and splits of FSDP2's sharding) take this way. The arguments
            # (size lists among them) are the record's, shared by every replay: replaced, never changed in place.
            arguments = list(call.args)
            for position, tensor in tensors.items():
                arguments[position] = tensor
            for position in self.promoted:  # fake tensors only: a call holds no real ones
                arguments[position] = arguments[position].to(self.default_dtype)
            return tuple(arguments), dict(call.kwargs)
        flat = list(self.flat)
        for position, tensor in tensors.items():
            flat[position] = tensor
        copies = {} if copies is None else copies
        for constant in self.constant_slots:
            tensor = constant.tensor
            if version_of(tensor) != constant.version or (
                constant.recorded is not None and not torch.equal(span_bytes(tensor), constant.recorded)
            ):
                raise DeferredInitError(
                    f"{constant.text}, viewed by {self.name} while recording, was changed in place since.\n"
                    "The deferred module views it, and its values would differ from those eager construction "
                    "made.\n"
                    "expected: the values it had when recorded\n"
                    "got: other values\n"
                    "Leave tensors that a deferred module views unchanged until it is materialized, or hand it a copy "
                    "(given.clone())"
                )
            if self.opaque or address_of(tensor.untyped_storage()) in copies:
                flat[constant.index] = _on_copy(tensor, device, copies)
            else:
                flat[constant.index] = tensor if device is None else tensor.to(device)
        if device is not None:
            for position in self.device_slots:
                flat[position] = device
        for position, state in self.generator_states:
            generator = torch.Generator(self.flat[position].device)
            generator.set_state(state)
            flat[position] = generator
        for position, generator in (generators or {}).items():
            flat[position] = generator
        for position in self.promoted:
            flat[position] = flat[position].to(self.default_dtype)
        if self.plain is None:
            return tree_unflatten(flat, self.spec)  # type: ignore[no-any-return]
        positional, names, containers = self.plain  # pytree's unflatten costs more than most operations it calls
        if containers is not None:
            flat = _gathered(flat, containers)
        return tuple(flat[:positional]), dict(zip(names, flat[positional:], strict=True))


def _default_dtype_refused(op: Op) -> DeferredInitError:
    what = "calls Python code that may make tensors" if op.opaque else "computes"
    return DeferredInitError(
        f"{op.name} {what} in torch's default dtype, which differs from the one it was recorded with, and a "
        "replay cannot hand it the recorded one: it would make other values than eager construction made.\n"
        f"expected: torch.get_default_dtype() == {op.default_dtype}, as when recorded\n"
        f"got: {torch.get_default_dtype()}\n"
        "modattrs never changes the default dtype itself (it is process-wide). Materialize under "
        f"torch.set_default_dtype({op.default_dtype}), or give the operation its dtype in the constructor"
    )


# Note [The default dtype is passed, never set]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's default dtype is one setting for the whole process: a replay that set it around the operations recorded
# under another would change what every other thread makes meanwhile. So each operation is given what it read of
# it when recorded (``recorder._pass_default_dtype`` works out which, reading torch's schemas and tags):
# - A factory whose ``dtype`` is None (``zeros``, ``randn``, ``full``, ``arange``, ``scalar_tensor``, ``linspace``
#   of tensor bounds, ...) takes the default for floats; it is recorded with ``dtype=`` the dtype it made, which
#   torch's factories treat alike.
# - A pointwise operation whose tensors are all integers or booleans, promoted to the default dtype by a Python
#   float (``counts * 1.1``, ``counts == 1.5``) or by a float operation (``counts / 7``, ``sin(counts)``): torch's
#   iterator casts those tensors to the default dtype and computes there, keeping a Python number's own value
#   (``original_scalar_value``). The replay casts them itself (``Op.promoted``), and then no operand asks for the
#   default: the same casts, the same kernel, the same scalar, the same bits.
# - What is neither is marked ``Op.reads_default_dtype``: it runs under the default dtype it was recorded with and
#   is refused under another, naming it. That is a pointwise ``counts * 1j`` under a bfloat16 default (the default
#   complex dtype, complex64, is not bfloat16's: a cast to bfloat16 first would round twice), integers computed into
#   an ``out=`` tensor (``sin(counts, out=t)``: the out tensor does not take part in the promotion), any other
#   operation that makes floats from integers only without a ``dtype`` (none is known), and an opaque initializer,
#   which is Python code. torch's own ``trunc_normal_`` helper makes every tensor
#   from its argument's dtype, so it is not marked.


# How many arguments are positional, the names of the others, and the list or tuple each argument is with its
# length (None for a leaf), or None when every argument is a leaf.
Plain = tuple[int, tuple[str, ...], "tuple[tuple[type, int] | None, ...] | None"]


def plain_call(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Plain | None:
    """``Op.plain`` of a call whose arguments pytree flattens as leaves (a tensor, a number, a string, None, a
    dtype, a device, a layout, a memory format) or lists and tuples of leaves (sizes); else None."""
    containers: list[tuple[type, int] | None] = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind in LEAF_TYPES or isinstance(value, torch.Tensor):
            containers.append(None)
        elif (kind is list or kind is tuple) and all(
            type(item) in LEAF_TYPES or isinstance(item, torch.Tensor) for item in value
        ):
            containers.append((kind, len(value)))
        else:
            return None
    return len(args), tuple(kwargs), None if not any(containers) else tuple(containers)


class Call(NamedTuple):
    """An operation's arguments as it is called, with None for its fake tensors, each of which is a positional
    argument of its own: its index among the flattened arguments is its index among the positional ones."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def call_of(op: Op) -> Call | None:
    """``Op.call`` of ``op``: its arguments ready to be called once its fake tensors are put in, when it holds no
    real tensor, no generator, and its fake tensors come before any list argument; else None."""
    if op.plain is None or op.constant_slots or op.generator_states:
        return None
    positional, names, containers = op.plain
    before = positional  # the fake tensors' positions must lie before this: among the positional leaves, no list yet
    if containers is not None:
        before = min(positional, next(at for at, container in enumerate(containers) if container is not None))
    for slot in op.slots:
        if slot.index >= before:
            return None
    arguments = op.flat if containers is None else _gathered(op.flat, containers)
    return Call(tuple(arguments[:positional]), dict(zip(names, arguments[positional:], strict=True)) if names else {})


def _gathered(flat: list[Any], containers: tuple[tuple[type, int] | None, ...]) -> list[Any]:
    """The arguments from their leaves: the leaves of a list argument made into that list again."""
    arguments, at = [], 0
    for container in containers:
        if container is None:
            arguments.append(flat[at])
            at += 1
        else:
            kind, length = container
            arguments.append(kind(flat[at : at + length]))
            at += length
    return arguments


# Exact types: subclasses of tuple (torch.Size, named tuples) are pytree nodes.
LEAF_TYPES = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format}
)


@dataclass(eq=False)  # identity: points of records are compared with `is`
class Record:
    """Everything that happened to the tensors of one ``deferred_init`` call, in order, and the generator timeline's
    notes on it."""

    # The generator timeline's notes (kept by generator, which makes records):
    start: Position  # the default CPU generator's position when recording began
    point: Position  # its position after the record's last draw
    point_epoch: int  # generator.epoch at that draw: a reseed since makes the point history
    epoch: int  # generator.epoch at the record's last draw on another device
    # Whether the real generator was put past every CPU draw of the record, where eager code has it (generator.settle)
    settled: bool = False
    # The operations, and how tensors are known:
    ops: list[Op] = field(default_factory=list)
    keys: dict[Key, int] = field(default_factory=dict)  # where a tensor's data would live -> its ref
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)  # kept alive: addresses stay unique
    next_ref: int = 0
    layouts: dict[int, Layout] = field(default_factory=dict)  # ref -> where the operation that made it put it
    devices: set[torch.device] = field(default_factory=set)  # of the operations' tensor and device arguments
    collectives: list[int] = field(default_factory=list)  # the operations that are collectives, in order
    default_draws: list[int] = field(default_factory=list)  # the operations that draw from a default generator
    default_resets: list[int] = field(default_factory=list)  # those of them with a reset (Op.reset)
    cpu_draws: list[int] = field(default_factory=list)  # those of them that ran on the CPU (draws_on_cpu)
    cpu_resets: list[int] = field(default_factory=list)  # those of the CPU draws with a reset
    touching: dict[int, list[int]] = field(default_factory=dict)  # storage -> the operations that touch it (Op.touched)
    # For slicing without a pass over every operation (Note [Slicing from the needed tensors] in slicing):
    writing: dict[int, list[int]] = field(default_factory=dict)  # storage -> the operations that write it (Op.writes)
    returning: dict[int, list[int]] = field(default_factory=dict)  # ref -> the operations returning it (Op.out_refs)
    pinned: list[int] = field(default_factory=list)  # the operations that are pinned (Op.pinned)
    filling_factories: list[int] = field(default_factory=list)  # zeros, new_ones, ... (see replay._dead_fills)
    root: weakref.ref[torch.nn.Module] | None = None  # what deferred_init returned
    # Per replay device ("" for the recorded devices): the CPU generator's state after the first n operations,
    # remembered by replays that passed there, so that later ones start from the nearest one (see generator).
    states: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    drawn: set[int] = field(default_factory=set)  # CPU draws that replays ran for real (materialized)
    # Per replay device, as states: a trunc_normal_ draw -> its rounds of normal_ (rng.rejection), counted once.
    rounds: dict[str, dict[int, int]] = field(default_factory=dict)
    _dead: tuple[int, frozenset[int]] = (0, frozenset())  # (number of ops, dead_writes of them)

    def dead_writes(self) -> frozenset[int]:
        """The operations whose writes nothing reads: every storage they write is overwritten whole later, before
        any read. No replay keeps them; they run only for what they draw."""
        count, dead = self._dead
        if count != len(self.ops):
            overwritten_before_read: set[int] = set()  # from the operation at hand on, walking backwards
            found = set()
            for index in range(len(self.ops) - 1, -1, -1):
                op = self.ops[index]
                if op.value_writer and op.writes and op.writes <= overwritten_before_read:
                    found.add(index)
                overwritten_before_read.update(op.overwrites)
                overwritten_before_read.difference_update(op.reads)
            self._dead = count, dead = len(self.ops), frozenset(found)
        return dead


def private_results(op: Op, results: list[Any], device: torch.device | None, copies: Copies) -> list[Any]:
    """``results`` (the flattened results of ``op``, called with arguments from ``Op.arguments``), with each tensor
    that shares memory with a real tensor of the record (``aten.lift_fresh`` returns its argument, a view views it)
    replaced by the same view of this replay's copy: what the replay does to it next must not change the record."""
    held = {address_of(constant.tensor.untyped_storage()): constant.tensor for constant in op.constant_slots}
    private = list(results)
    for index, result in enumerate(results):
        if isinstance(result, torch.Tensor):
            original = held.get(address_of(result.untyped_storage()))
            if original is not None:
                _on_copy(original, device, copies)  # the storage copied as it is: the operation did not write it
                private[index] = _on_storage(result, copies[address_of(original.untyped_storage())])
    return private


def _on_copy(tensor: torch.Tensor, device: torch.device | None, copies: Copies) -> torch.Tensor:
    """``tensor`` as a view of the same place in this replay's copy of its storage, copied now if it is not yet."""
    storage = tensor.untyped_storage()
    key = address_of(storage)
    copy = copies.get(key)
    if copy is None:
        raw = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        copy = copies[key] = raw.to(device or storage.device, copy=True).untyped_storage()
    return _on_storage(tensor, copy)


def _on_storage(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    """A tensor with the geometry of ``tensor`` on ``storage``."""
    if tensor.is_neg():  # a negative view cannot be made without a private name: its value, not aliased
        return tensor.resolve_neg().to(storage.device, copy=True)
    view = torch.empty(0, dtype=tensor.dtype, device=storage.device)
    view.set_(storage, tensor.storage_offset(), tensor.size(), tensor.stride())
    return view.conj() if tensor.is_conj() else view


def scratch_arguments(
    op: Op, device: torch.device | None, memory: dict[int, torch.Tensor] | None = None
) -> dict[int, torch.Tensor]:
    """Stand-ins for an operation's fake arguments, to make it draw what it would draw: tensors of the same layout
    (sizes and strides) for what it writes, whatever they hold, and ones of the same layout for what it reads.
    ``memory`` (position -> bytes) lends the written ones memory that earlier calls grew, so that a run of draws
    does not allocate (and fault in) its scratch memory each time.

    A read argument's strides matter as much as a written one's: a ``*_like`` factory and ``TensorIterator``'s
    outputs take the layout of what they read, and the layout decides the kernel's path (``randn_like`` of a
    transposed tensor fills it with the scalar ``normal_`` path, a contiguous one with the block path: other
    counts of the generator's outputs, see ``draws``).

    Only operations whose draws depend on nothing but these layouts, the dtypes and the other arguments can be run
    on stand-ins; those whose draws depend on values too are ``Op.pinned`` (``draws.VALUE_DEPENDENT``)."""
    tensors = {}
    for slot in op.slots:
        on = device or slot.device
        if not slot.written:
            ones = torch.ones(_extent(slot), dtype=slot.dtype, device=on)
            tensors[slot.index] = ones.as_strided(slot.size, slot.stride)
        elif memory is None:
            tensors[slot.index] = torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype, device=on)
        else:
            tensors[slot.index] = _lent(memory, slot, on)
    return tensors


def _extent(slot: Slot) -> int:
    """The elements of memory a tensor of ``slot``'s sizes and strides spans from offset 0."""
    if not all(slot.size):
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(slot.size, slot.stride, strict=True))


def _lent(memory: dict[int, torch.Tensor], slot: Slot, device: torch.device) -> torch.Tensor:
    needed = _extent(slot) * slot.dtype.itemsize
    held = memory.get(slot.index)
    if held is None or held.device != device or held.numel() < needed:
        held = memory[slot.index] = torch.empty(needed, dtype=torch.uint8, device=device)
    return held[:needed].view(slot.dtype).as_strided(slot.size, slot.stride)  # from offset 0: aligned


def reads_no_values(op: Op) -> bool:
    """Whether ``op`` leaves the values of what it is given alone: a view that writes nothing, or the device."""
    return (isinstance(op.func, OpOverload) and op.func.is_view and not op.writes) or op.func is _DEVICE


_DEVICE = torch.ops.prim.device.default


def draws_on_cpu(op: Op, device: torch.device | None) -> bool:
    """Whether ``op``, replayed on ``device`` (None: where it was recorded), draws from the default CPU generator."""
    if op.draws is not Draws.DEFAULT:
        return False
    on = device or op.device
    return on is not None and on.type == "cpu"
