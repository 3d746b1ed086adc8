"""The record behind :mod:`modattrs.deferred`: a fake tensor mode that writes down every operation on its tensors,
and the replay that runs a slice of that record for real.

Identity. A tensor is known by where its data would live: (storage, offset, sizes, strides, dtype). Python
objects and tensor impls are no good as keys, because ``nn.Parameter(t)``, ``t.data`` and ``p.data = t`` make or
rewire them without an operation that a mode could see; all three keep storage and geometry, though. Every
storage the record has seen is kept alive (a fake storage holds no data), so no two storages ever share an address.

Slicing. To materialize some tensors, the replay runs only the operations they depend on: walking the record
backwards, an operation is kept when it makes a tensor that is needed or writes into storage that is needed, and
what it reads becomes needed. Random operations that are not kept still run, into a scratch tensor of the same
geometry, because each one moves the generator on and the kept ones must draw what they drew in eager order.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from modattrs._fake_tensors import ModattrsFakeTensorMode

__all__: list[str] = []

Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


class DeferredInitError(RuntimeError):
    """Deferred initialization cannot reproduce what eager construction would do."""


@dataclass(slots=True)
class Op:
    """One recorded call: an aten operation, or an opaque initializer (a Python function)."""

    func: Callable[..., Any]
    flat: list[Any]  # the flattened (args, kwargs), tensors left as None
    spec: TreeSpec
    tensor_slots: tuple[tuple[int, int], ...]  # (position in flat, ref) of each tensor argument
    constant_slots: tuple[tuple[int, torch.Tensor, int], ...]  # (position, real tensor, its version when recorded)
    device_slots: tuple[int, ...]
    generator_slots: tuple[int, ...]
    in_refs: frozenset[int]
    in_storages: frozenset[int]
    out_refs: tuple[int | None, ...]  # one per leaf of the result; None for leaves that are not tensors
    writes: frozenset[int]  # storages written in place
    random: bool
    pinned: bool  # a random operation that also reads fake tensors: it runs in every replay
    scratch: tuple[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]
    # ^ (position, sizes, strides, dtype, device) of the tensors a skipped random operation writes into

    @property
    def name(self) -> str:
        return str(self.func) if isinstance(self.func, torch._ops.OpOverload) else _qualname(self.func)


@dataclass(slots=True)
class Record:
    """Everything that happened to the tensors of one ``deferred_init`` call, in order."""

    cpu_rng_state: torch.Tensor
    ops: list[Op] = field(default_factory=list)
    keys: dict[Key, int] = field(default_factory=dict)
    storages: dict[int, torch.UntypedStorage] = field(default_factory=dict)
    generators: dict[int, tuple[torch.Generator, torch.Tensor]] = field(default_factory=dict)
    ref_count: int = 0
    root: weakref.ref[torch.nn.Module] | None = None  # what deferred_init returned
    lock: threading.RLock = field(default_factory=threading.RLock)


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
        with self.record.lock:
            pending = self._begin(func, args, kwargs)
            self._depth.n = 1
            try:
                result = super().__torch_dispatch__(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException) as error:
                raise DeferredInitError(
                    f"{func} needs the values of fake tensors, which do not exist while deferred_init records "
                    f"({where()}). Values that depend on data cannot be recorded one operation at a time: move this "
                    "code after materialize_module, or record the function doing it as one call with "
                    "modattrs.deferred.register_opaque_init"
                ) from error
            finally:
                self._depth.n = 0
            self._finish(pending, result)
        return result

    def record_opaque(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], mutates: int
    ) -> Any:
        """Record ``func(*args, **kwargs)`` as one call that writes ``args[mutates]`` in place, without running it."""
        with self.record.lock:
            pending = self._begin(func, args, kwargs, mutated=(args[mutates],), random=True)
            self._finish(pending, args[mutates])
        return args[mutates]

    # --- recording --------------------------------------------------------------------------------------------------

    def _begin(
        self,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        mutated: Sequence[torch.Tensor] | None = None,
        random: bool | None = None,
    ) -> _Pending:
        originals, spec = tree_flatten((tuple(args), dict(kwargs)))
        flat = list(originals)
        tensor_slots: list[tuple[int, int]] = []
        constant_slots: list[tuple[int, torch.Tensor, int]] = []
        device_slots: list[int] = []
        generator_slots: list[int] = []
        in_storages: set[int] = set()
        for position, value in enumerate(originals):
            if isinstance(value, torch.Tensor):
                if isinstance(value, FakeTensor):
                    tensor_slots.append((position, self._ref_of(value, func)))
                    in_storages.add(self._storage_of(value))
                else:  # a real tensor from outside (torch.tensor(...), a loaded weight): used as it is now
                    constant_slots.append((position, value, value._version))
                flat[position] = None
            elif isinstance(value, torch.device):
                device_slots.append(position)
            elif isinstance(value, torch.Generator):
                generator_slots.append(position)
                if id(value) not in self.record.generators:  # fake draws never move it: this is its eager state
                    self.record.generators[id(value)] = (value, value.get_state())
        if mutated is None:
            mutated = _mutated_arguments(func, args, kwargs)
        if random is None:
            random = torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())
        mutated_ids = {id(t) for t in mutated}
        scratch = tuple(
            (position, tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
            for position, _ in tensor_slots
            if id(t := originals[position]) in mutated_ids
        )
        # A random operation that reads fake tensors draws in a way a scratch run could not repeat: it always runs.
        pinned = random and len(scratch) < len(tensor_slots)
        return _Pending(
            func,
            flat,
            spec,
            tuple(tensor_slots),
            tuple(constant_slots),
            tuple(device_slots),
            tuple(generator_slots),
            frozenset(ref for _, ref in tensor_slots),
            frozenset(in_storages),
            frozenset(self._storage_of(t) for t in mutated if isinstance(t, FakeTensor)),
            random,
            pinned,
            scratch,
            mutated_ids,
            {id(originals[position]): ref for position, ref in tensor_slots},
        )

    def _finish(self, pending: _Pending, result: Any) -> None:
        out_refs: list[int | None] = []
        writes = set(pending.writes)
        leaves, _ = tree_flatten(result)
        for leaf in leaves:
            if not isinstance(leaf, FakeTensor):
                out_refs.append(None)
                continue
            ref = pending.arg_refs.get(id(leaf))
            if ref is None:
                ref = self.record.ref_count
                self.record.ref_count += 1
            elif id(leaf) in pending.mutated:
                writes.add(self._storage_of(leaf))  # set_ and resize_ move it to another storage
            self.record.keys[self._key_of(leaf)] = ref
            out_refs.append(ref)
        self.record.ops.append(
            Op(
                pending.func,
                pending.flat,
                pending.spec,
                pending.tensor_slots,
                pending.constant_slots,
                pending.device_slots,
                pending.generator_slots,
                pending.in_refs,
                pending.in_storages,
                tuple(out_refs),
                frozenset(writes),
                pending.random,
                pending.pinned,
                pending.scratch,
            )
        )

    def _ref_of(self, tensor: FakeTensor, func: object) -> int:
        if tensor.fake_mode is not self:
            raise DeferredInitError(
                f"{func} was given a fake tensor that deferred_init did not record (made by another fake mode or "
                f"another deferred_init call) ({where()}); deferred modules can only be combined with tensors made "
                "in the same deferred_init call or real ones"
            )
        ref = self.record.keys.get(self._key_of(tensor))
        if ref is None:
            raise DeferredInitError(
                f"{func} was given a fake tensor ({tuple(tensor.shape)}, {tensor.dtype}) whose making was not "
                f"recorded ({where()}); make tensors with torch operations inside deferred_init"
            )
        return ref

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
        )

    def ref_of(self, tensor: FakeTensor) -> int | None:
        """The record's name for ``tensor``, or None if the record cannot account for it."""
        with self.record.lock:
            return self.record.keys.get(self._key_of(tensor))

    def forget(self, tensor: FakeTensor) -> None:
        """Drop the weak references torch's fake tensor machinery keeps to ``tensor`` (the memo of fakes made from
        real tensors, and of constants), which ``torch.utils.swap_tensors`` would refuse."""
        converter = self.fake_tensor_converter
        memo = converter.meta_converter.tensor_memo
        for key in [key for key, value in memo.items() if value is tensor]:
            del memo[key]
        for refs in converter.constant_storage_mapping.values():
            refs[:] = [ref for ref in refs if ref() is not tensor]

    def storage_of(self, tensor: FakeTensor) -> int:
        with self.record.lock:
            return self._storage_of(tensor)


@dataclass(slots=True)
class _Pending:
    func: Callable[..., Any]
    flat: list[Any]
    spec: TreeSpec
    tensor_slots: tuple[tuple[int, int], ...]
    constant_slots: tuple[tuple[int, torch.Tensor, int], ...]
    device_slots: tuple[int, ...]
    generator_slots: tuple[int, ...]
    in_refs: frozenset[int]
    in_storages: frozenset[int]
    writes: frozenset[int]
    random: bool
    pinned: bool
    scratch: tuple[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device], ...]
    mutated: set[int]
    arg_refs: dict[int, int]


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

_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


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


def _qualname(func: Callable[..., Any]) -> str:
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


# --- replay -------------------------------------------------------------------------------------------------------


def replay(
    record: Record,
    targets: Mapping[int, int],
    *,
    device: torch.device | None,
    to_end: bool,
) -> dict[int, torch.Tensor]:
    """Run what the refs in ``targets`` (ref to its storage) need, for real, and return them by ref.

    The default CPU generator starts from its state when recording began. With ``to_end``, every random operation
    of the record runs, and the generator is left where eager construction would have left it; otherwise the replay
    stops after the last operation needed and the generator is put back as it was.
    """
    with record.lock:
        ops = record.ops
        kept = _slice(ops, targets)
        last = len(ops) - 1 if to_end else max(kept, default=-1)
        frees = _last_uses(ops, kept, targets)
        _check_devices(ops, kept, device)
        generators = _replay_generators(record, device)
        env: dict[int, torch.Tensor] = {}
        saved_state = torch.get_rng_state()
        torch.set_rng_state(record.cpu_rng_state)
        done = False
        try:
            with torch.no_grad(), _disable_current_modes():
                for index in range(last + 1):
                    op = ops[index]
                    if index in kept:
                        _run(op, env, device, generators)
                        for ref in frees.get(index, ()):
                            env.pop(ref, None)
                    elif op.random:
                        _run_on_scratch(op, device, generators)
            done = True
        finally:
            if not (done and to_end):
                torch.set_rng_state(saved_state)
        return {ref: env[ref] for ref in targets}


def _slice(ops: list[Op], targets: Mapping[int, int]) -> set[int]:
    needed_refs = set(targets)
    needed_storages = set(targets.values())
    kept: set[int] = set()
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        keep = op.pinned or not needed_refs.isdisjoint(r for r in op.out_refs if r is not None)
        if not keep and op.writes and not needed_storages.isdisjoint(op.writes):
            keep = True
        if keep:
            kept.add(index)
            needed_refs.update(op.in_refs)
            needed_storages.update(op.in_storages)
    return kept


def _last_uses(ops: list[Op], kept: set[int], targets: Mapping[int, int]) -> dict[int, list[int]]:
    """For each kept operation, the refs that no later kept operation reads and that are not targets."""
    last_use: dict[int, int] = {}
    for index in sorted(kept):
        op = ops[index]
        for ref in op.in_refs:
            last_use[ref] = index
        for out in op.out_refs:
            if out is not None:
                last_use.setdefault(out, index)  # made and never read: freed at once
    frees: dict[int, list[int]] = {}
    for ref, index in last_use.items():
        if ref not in targets:
            frees.setdefault(index, []).append(ref)
    return frees


def _check_devices(ops: list[Op], kept: Iterable[int], device: torch.device | None) -> None:
    devices = {device} if device is not None else set()
    if device is None:
        for index in kept:
            op = ops[index]
            devices.update(op.flat[position] for position in op.device_slots)
            devices.update(scratch_device for *_, scratch_device in op.scratch)
    for candidate in devices:
        if candidate.type == "cuda" and not torch.cuda.is_available():
            raise DeferredInitError(
                f"materializing needs real tensors on {candidate}, and this machine has no CUDA device; pass "
                "device='cpu' to materialize on the CPU instead"
            )


def _replay_generators(record: Record, device: torch.device | None) -> dict[int, torch.Generator]:
    # Each generator made by the code replays from its state at first use, so replays repeat; the caller's own
    # generator object is left alone.
    copies = {}
    for key, (generator, state) in record.generators.items():
        if device is not None and device.type != generator.device.type:
            raise DeferredInitError(
                f"the recorded code drew from a torch.Generator on {generator.device}, which cannot draw on "
                f"{device}; materialize without device= (on the devices it was recorded for)"
            )
        copy = torch.Generator(generator.device)
        copy.set_state(state)
        copies[key] = copy
    return copies


def _arguments(
    op: Op,
    env: Mapping[int, torch.Tensor],
    device: torch.device | None,
    generators: Mapping[int, torch.Generator],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat = list(op.flat)
    for position, ref in op.tensor_slots:
        flat[position] = env[ref]
    for position, constant, version in op.constant_slots:
        if constant._version != version:
            raise DeferredInitError(
                f"a real tensor given to {op.name} while recording was changed in place since; the recorded "
                "result would differ from what eager construction computed. Leave tensors handed to a deferred "
                "module unchanged until it is materialized"
            )
        flat[position] = constant if device is None else constant.to(device)
    if device is not None:
        for position in op.device_slots:
            flat[position] = device
    for position in op.generator_slots:
        flat[position] = generators[id(op.flat[position])]
    args, kwargs = tree_unflatten(flat, op.spec)
    return args, kwargs


def _run(
    op: Op, env: dict[int, torch.Tensor], device: torch.device | None, generators: Mapping[int, torch.Generator]
) -> None:
    args, kwargs = _arguments(op, env, device, generators)
    result = op.func(*args, **kwargs)
    if not isinstance(op.func, torch._ops.OpOverload):
        return  # an opaque initializer: it wrote into its argument, which env holds already
    if len(op.out_refs) == 1:
        ref = op.out_refs[0]
        if ref is not None:
            env[ref] = result
        return
    leaves, _ = tree_flatten(result)
    for leaf, ref in zip(leaves, op.out_refs, strict=True):
        if ref is not None:
            env[ref] = leaf


def _run_on_scratch(op: Op, device: torch.device | None, generators: Mapping[int, torch.Generator]) -> None:
    scratch_env: dict[int, torch.Tensor] = {}
    slot_refs = dict(op.tensor_slots)
    for position, size, stride, dtype, recorded_device in op.scratch:
        scratch_env[slot_refs[position]] = torch.empty_strided(
            size, stride, dtype=dtype, device=device or recorded_device
        )
    args, kwargs = _arguments(op, scratch_env, device, generators)
    op.func(*args, **kwargs)
