"""Replay of a record (``_recording``): run, for real, what some of its tensors need.

Slicing. Walking the record backwards, an operation is kept when it makes a tensor that is needed or writes into
storage that is needed, and what it reads becomes needed. Tensors are freed after their last use.

Random numbers. The CPU generator has no way to skip ahead, so random operations that draw from it and are not
kept still run, into a scratch tensor of the same layout that is freed at once: the kept ones then draw what they
drew in eager order. The walk starts at the last reset of the generator (a ``manual_seed`` seen while recording)
before the first kept draw, or at the state recording began from, which for a record that went on from another
one's draws is the state after those. Operations that draw from an explicit ``torch.Generator`` use its recorded
state and need nothing of the kind. The generators of other devices are used as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from modattrs import _generator
from modattrs._generator import Position
from modattrs._recording import DeferredInitError, Draws, Op, Record, scratch_arguments

__all__: list[str] = []


def replay(
    record: Record, targets: Mapping[int, int], *, device: torch.device | None, to_end: bool
) -> dict[int, torch.Tensor]:
    """Run what the refs in ``targets`` (ref to its storage) need, for real, and return them by ref.

    With ``to_end``, every CPU draw of the record happens and the default CPU generator is left where eager
    construction would have left it (unless the caller reseeded it since); otherwise the replay stops after the
    last operation needed and the generator is put back as it was.
    """
    with _generator.lock:
        at_point = _generator.position() is record.point
    with _running() as after:
        ops = record.ops
        kept = _slice(ops, targets)
        _check_devices(ops, kept, device)
        env: dict[int, torch.Tensor] = {}
        _run_all(record, ops if to_end else ops[: max(kept, default=-1) + 1], kept, targets, env, device, to_end=to_end)
        if to_end and device is None:
            record.states_after[len(ops)] = torch.default_generator.get_state()
        # Eager code would be past this record's draws, unless the caller reseeded since: then it stays reseeded.
        after.keep_generator = to_end and (at_point or _generator.epoch == record.point_epoch)
        return {ref: env[ref] for ref in targets}


def state_after(record: Record, count: int) -> torch.Tensor:
    """The default CPU generator's state after the first ``count`` operations of ``record`` drew, as in eager code."""
    with _running():
        state = record.states_after.get(count)
        if state is None:
            ops = record.ops[:count]
            _run_all(record, ops, _slice(ops, {}), {}, {}, None, to_end=True)  # draws that read data run
            state = record.states_after[count] = torch.default_generator.get_state()
        return state


@dataclass
class _After:
    keep_generator: bool = False  # set by a block that finished where the generator should stay


@contextlib.contextmanager
def _running() -> Iterator[_After]:
    """Run real operations, one replay at a time, and put the default dtype and the default CPU generator back
    after, the generator unless the block says to keep it."""
    with _generator.lock, _generator.suspended(), torch.no_grad(), _disable_current_modes():
        saved = torch.default_generator.get_state()
        default_dtype = torch.get_default_dtype()
        after = _After()
        try:
            yield after
        finally:
            torch.set_default_dtype(default_dtype)
            if not after.keep_generator:
                _set_cpu_state(saved)


def _run_all(
    record: Record,
    ops: list[Op],
    kept: set[int],
    targets: Mapping[int, int],
    env: dict[int, torch.Tensor],
    device: torch.device | None,
    *,
    to_end: bool,
) -> None:
    draws = [index for index, op in enumerate(ops) if _draws_on_cpu(op, device)]
    first_kept = next((index for index in draws if index in kept), None)
    # The CPU draws start at the last reset of the generator up to the first kept draw (to the last draw, to reach
    # the end state): earlier ones cannot change what comes after.
    limit = first_kept if first_kept is not None or not to_end else (draws[-1] if draws else None)
    start = None
    if to_end and not draws:
        _set_cpu_state(_start_of(record))  # no draws: eager construction leaves the generator as it found it
    if limit is not None:
        resets = [index for index in draws if index <= limit and ops[index].reset is not None]
        start = resets[-1] if resets else draws[0]
        if not resets:
            _set_cpu_state(_start_of(record))
    frees = _last_uses(ops, kept, targets)
    for index, op in enumerate(ops):
        random_here = start is not None and index >= start and _draws_on_cpu(op, device)
        if random_here and op.reset is not None:
            op.reset = _resolve(op.reset)  # worked out once; the record it pointed into can then go
            _set_cpu_state(op.reset)
        if index not in kept and not random_here:
            continue
        if op.default_dtype is not torch.get_default_dtype():
            torch.set_default_dtype(op.default_dtype)
        if index in kept:
            _run(op, env, device)
            for ref in frees.get(index, ()):
                env.pop(ref, None)
        else:
            args, kwargs = op.arguments(scratch_arguments(op, device), device)
            op.func(*args, **kwargs)


def _set_cpu_state(state: torch.Tensor) -> None:
    # Not torch.set_rng_state: modattrs watches that one for the user's changes (see _generator).
    torch.default_generator.set_state(state)


def _resolve(position: Position) -> torch.Tensor:
    return position if isinstance(position, torch.Tensor) else state_after(*position)


def _start_of(record: Record) -> torch.Tensor:
    record.start = _resolve(record.start)
    return record.start


def _draws_on_cpu(op: Op, device: torch.device | None) -> bool:
    if op.draws is not Draws.DEFAULT:
        return False
    on = device or op.device
    return on is not None and on.type == "cpu"


def _slice(ops: list[Op], targets: Mapping[int, int]) -> set[int]:
    needed_refs = set(targets)
    needed_storages = set(targets.values())
    kept: set[int] = set()
    for index in range(len(ops) - 1, -1, -1):
        op = ops[index]
        keep = op.pinned or not needed_refs.isdisjoint(ref for ref in op.out_refs if ref is not None)
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
    devices: set[torch.device] = set()
    if device is not None:
        devices.add(device)
    else:
        for index in kept:
            op = ops[index]
            devices.update(op.flat[position] for position in op.device_slots)
            devices.update(slot.device for slot in op.slots)
    for candidate in devices:
        if candidate.type == "cuda" and not torch.cuda.is_available():
            raise DeferredInitError(
                f"materializing needs real tensors on {candidate}, and this machine has no CUDA device; pass "
                "device='cpu' to materialize on the CPU instead"
            )
    for index in kept:
        op = ops[index]
        for position, _ in op.generator_states:
            generator_device = op.flat[position].device
            if device is not None and device.type != generator_device.type:
                raise DeferredInitError(
                    f"{op.name} drew from a torch.Generator on {generator_device} while recording, which cannot "
                    f"draw on {device}; materialize without device= (on the devices it was recorded for)"
                )


def _run(op: Op, env: dict[int, torch.Tensor], device: torch.device | None) -> None:
    args, kwargs = op.arguments({slot.index: env[slot.ref] for slot in op.slots}, device)
    result = op.func(*args, **kwargs)
    if op.opaque:
        return  # an initializer that wrote into its argument, which env holds already
    if isinstance(result, torch.Tensor):
        ref = op.out_refs[0]
        if ref is not None:
            env[ref] = result
        return
    leaves, _ = tree_flatten(result)
    for leaf, ref in zip(leaves, op.out_refs, strict=True):
        if ref is not None:
            env[ref] = leaf
