"""Replay of a record (``record``): run, for real, what some of its tensors need.

Slicing. Walking the record backwards, an operation is kept when it makes a tensor that is needed or writes into
storage that is needed, and what it reads becomes needed. An operation that writes a whole storage whatever it
held (``normal_`` on a weight) ends the need for that storage: earlier writes to it (the constructor's own
initialization, which ``post_init`` draws over) are dead, and run only as draws, if they draw. Operations whose
number of draws depends on values (``pinned``) are kept in every replay. Kept operations run in order; tensors
are freed after their last use.

Random numbers are the generator timeline's business (``generator``): before each kept draw from the default CPU
generator, the replay asks it to set the state eager code drew from. Operations that draw from an explicit
``torch.Generator`` use its recorded state; the generators of other devices are used as they are.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from modattrs._deferred import draws, generator, windows
from modattrs._deferred.ops import facts_of
from modattrs._deferred.record import Copies, DeferredInitError, Op, Point, Record, private_results, reads_no_values
from modattrs._torch_private import OpOverload, tree_flatten, written_arguments

__all__: list[str] = []


def replay(
    record: Record,
    targets: Mapping[int, int],
    labels: Mapping[int, str],
    *,
    device: torch.device | None,
    to_end: bool,
    threads: int = 1,
) -> dict[int, torch.Tensor]:
    """Run what the refs in ``targets`` (ref to its storage) need, for real, and return them by ref; ``labels``
    names them for messages.

    With ``to_end``, the default CPU generator is left where eager construction would have left it (unless the
    caller reseeded it since); otherwise the replay stops after the last operation needed and the generator is put
    back as it was.
    """
    with generator.replaying(record, device, state_after, to_end=to_end) as walk:
        sliced = _slice(record, targets)
        _check_devices(record, sliced.kept, device)
        _refuse_collectives(record, sliced.kept, targets, labels)
        env: dict[int, torch.Tensor] = {}
        parts = windows.plan(record, sliced.kept, targets, walk.pattern_of, device)
        _run_kept(record.ops, sliced, env, device, walk, threads, parts, record)
        if to_end and not record.settled:  # a settled record's end is where the generator is already
            walk.reach(len(record.ops))
        return {ref: env[ref] for ref in targets}


def state_after(point: Point) -> torch.Tensor:
    """The default CPU generator's state after the first ``count`` operations of ``record`` drew, as in eager code."""
    record, count = point
    with generator.replaying(record, None, state_after, to_end=False) as walk:
        _run_kept(record.ops, _slice(record, {}, count), {}, None, walk)  # draws that depend on values run for real
        walk.reach(count)
        return generator.real_state()


def _run_kept(
    ops: list[Op],
    sliced: Slice,
    env: dict[int, torch.Tensor],
    device: torch.device | None,
    walk: generator.Walk,
    threads: int = 1,
    parts: Mapping[int, windows.Window] | None = None,
    record: Record | None = None,
) -> None:
    """Run the kept operations of ``sliced`` in order, keeping their results in ``env`` until their last use;
    ``parts``: the windows of storages made in part (see ``Note [Replaying only the part that is kept]``) of
    ``record``, whose operations ``ops`` are (without it, factories fill what they make: see ``_dead_fills``)."""
    kept, frees, wanted = sliced
    unfilled = _dead_fills(record, kept) if record is not None else {}
    copies: Copies = {}
    roles: dict[int, list[windows.Window]] = {}
    for window in (parts or {}).values():
        for index in window.roles:
            roles.setdefault(index, []).append(window)
    if parts:
        windows.prepare(ops, parts, unfilled, device, copies)
    for index in kept:
        op = ops[index]
        on = roles.get(index)
        if on is not None:
            assert parts is not None
            assert record is not None
            if not windows.run(op, index, on, parts, env, wanted, device, copies, walk, record.layouts):
                # it only reads windows: run as usual, a draw from the state eager code drew it from
                draws = walk.is_draw(index)
                if draws:
                    walk.before(index)
                tensors = windows.window_arguments(op, parts, env)
                _run(op, env, wanted, device, copies, tensors=tensors, func=unfilled.get(index))
                if draws:
                    walk.ran(index)
            for window in on:
                if window.last == index:
                    window.release()
        else:
            draws = walk.is_draw(index)
            if draws:
                walk.before(index)
            _run(op, env, wanted, device, copies, threads if draws else 1, func=unfilled.get(index))
            if draws:
                walk.ran(index)
        for ref in frees.get(index, ()):
            env.pop(ref, None)


def _dead_fills(record: Record, kept: list[int]) -> dict[int, OpOverload]:
    """The kept factories whose fill nothing reads (``new_zeros`` that a ``copy_`` overwrites whole before any
    read, as FSDP2's padded shard), with the factory to run instead, which fills nothing: one pass over the memory
    less, as a ``copy_`` into ``empty`` would be in eager code (``ops.UNFILLED``; the record notes where such
    factories run: ``Record.filling_factories``)."""
    ops, layouts = record.ops, record.layouts
    kept_ones = set(kept)
    dead: dict[int, OpOverload] = {}
    # The kept ones among them: from the shorter list (a replay of one block keeps few of a large model's).
    factories = (
        record.filling_factories
        if len(record.filling_factories) <= len(kept)
        else [index for index in kept if facts_of(ops[index].func).unfilled is not None]
    )
    for index in factories:
        factory = ops[index]
        if index not in kept_ones or len(factory.out_refs) != 1 or factory.out_refs[0] not in layouts:
            continue
        storage = layouts[factory.out_refs[0]].storage  # its own: nothing before it touched it
        for later in record.touching[storage]:  # the first kept operation after it to read or write values
            if later <= index or later not in kept_ones:
                continue
            op = ops[later]
            if reads_no_values(op):
                continue
            unfilled = facts_of(factory.func).unfilled
            if unfilled is not None and op.value_writer and storage in op.overwrites and storage not in op.reads:
                dead[index] = unfilled
            break
    return dead


class Slice(NamedTuple):
    """What a replay runs (``_slice``)."""

    kept: list[int]  # the operations kept, in order
    frees: dict[int, list[int]]  # by kept operation: the refs no later one reads, and that are not targets
    wanted: set[int]  # the refs a kept operation reads, and the targets


def _slice(record: Record, targets: Mapping[int, int], count: int | None = None) -> Slice:
    """The operations among the first ``count`` of ``record`` (all of them by default) to keep for ``targets`` (see
    the module's docstring), and when what they make is last read.

    Note [Slicing from the needed tensors]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The walk backwards looks only at the operations that a rule could keep: the pinned ones, and, once a ref or a
    storage is needed, the earlier operations that return that ref or write that storage (the record lists them
    as it grows: ``Record.returning``, ``Record.writing``), taken latest first from a heap. Any other operation
    returns no needed ref and writes no needed storage, so no rule keeps it: the slice is the one a pass over every
    operation gives. A replay of one block of a large model, and the generator's settling after each draw of an
    initialization applied to a deferred model (``state_after``), then cost what they keep, not the whole record.
    Each ref's and each storage's operations are queued once, when it is first needed: the walk goes backwards, so
    a storage needed again later in the walk (after an overwrite ended its need) has its earlier writers queued
    already.
    """
    end = len(record.ops) if count is None else count
    ops = record.ops
    needed_refs = set(targets)
    needed_storages = set(targets.values())
    kept: list[int] = []
    frees: dict[int, list[int]] = {}
    latest_first: list[int] = []  # a heap of negated indices
    queued: set[int] = set()
    refs_queued: set[int] = set()
    storages_queued: set[int] = set()

    def queue(indices: list[int], before: int) -> None:
        for index in indices[: bisect.bisect_left(indices, before)]:
            if index not in queued:
                queued.add(index)
                heapq.heappush(latest_first, -index)

    queue(record.pinned, end)
    for ref in needed_refs:
        refs_queued.add(ref)
        queue(record.returning.get(ref, []), end)
    for storage in needed_storages:
        storages_queued.add(storage)
        queue(record.writing.get(storage, []), end)
    while latest_first:
        index = -heapq.heappop(latest_first)
        op = ops[index]
        keep = (
            op.pinned
            or (not op.value_writer and not needed_refs.isdisjoint(op.out_refs))  # None is never needed
            or not needed_storages.isdisjoint(op.writes)
        )
        if keep:
            kept.append(index)
            needed_storages.difference_update(op.overwrites)  # what was written there before is dead
            needed_storages.update(op.reads)
            for storage in op.reads:
                if storage not in storages_queued:
                    storages_queued.add(storage)
                    queue(record.writing.get(storage, []), index)
            for ref in op.in_refs:
                if ref not in needed_refs:  # read by no later kept operation: freed after this one
                    needed_refs.add(ref)
                    frees.setdefault(index, []).append(ref)
                if ref not in refs_queued:
                    refs_queued.add(ref)
                    queue(record.returning.get(ref, []), index)
    kept.reverse()
    return Slice(kept, frees, needed_refs)


def _check_devices(record: Record, kept: Iterable[int], device: torch.device | None) -> None:
    if device is None and all(named.type in ("cpu", "meta") for named in record.devices):
        return  # a record of CPU and meta tensors replays where it was recorded: nothing to check
    ops = record.ops
    devices: set[torch.device] = set()
    if device is not None:
        devices.add(device)
    else:
        for index in kept:
            op = ops[index]
            if op.device_slots:
                devices.update([op.flat[position] for position in op.device_slots])
            for slot in op.slots:
                devices.add(slot.device)
    for candidate in devices:
        where = f"device={str(candidate)!r}" if device is not None else f"{candidate}, where it was recorded,"
        if candidate.type == "cuda" and not torch.cuda.is_available():
            raise DeferredInitError(
                f"materializing needs real tensors on {where} and this machine has no CUDA device; pass "
                "device='cpu' to materialize on the CPU instead"
            )
        if candidate.type not in ("cpu", "meta"):
            try:
                torch.empty(0, device=candidate)
            except Exception as error:  # torch's errors for a device it knows but cannot use are of many kinds
                reason = str(error).split("\n")[0]
                raise DeferredInitError(
                    f"materializing needs real tensors on {where} and this machine cannot make them there.\n"
                    f"reason: {type(error).__name__}: {reason}\n"
                    "Pass device='cpu' to materialize on the CPU instead"
                ) from None
    for index in kept:
        op = ops[index]
        for position, _ in op.generator_states:
            generator_device = op.flat[position].device
            if device is not None and device.type != generator_device.type:
                raise DeferredInitError(
                    f"{op.name} drew from a torch.Generator on {generator_device} while recording, which cannot "
                    f"draw on {device}.\nMaterialize without device= (on the devices it was recorded for)"
                )


def _refuse_collectives(record: Record, kept: list[int], targets: Mapping[int, int], labels: Mapping[int, str]) -> None:
    """Raise if what is needed depends on a collective (a scatter, a broadcast) that ran on fake tensors.

    A collective on deferred tensors is recorded as such, except DTensor's scatter and broadcast of deferred
    values, which record this rank's own part (see Note [A scatter of a deferred source is the rank's own chunk]).
    A replay cannot run one: each rank materializes on its own, what and when it chooses, so the other ranks would
    not be there to answer. Every rank slices alike, so all of them raise.
    """
    kept_ones = set(kept) if record.collectives else ()
    for index in record.collectives:
        if index not in kept_ones:
            continue
        op = record.ops[index]
        # The target named is one whose own slice keeps the collective: what it filled may have been copied or cut
        # since (FSDP2 copies each parameter into a padded shard of its own), and the other targets are innocent.
        needing = (labels[ref] for ref, storage in targets.items() if index in _slice(record, {ref: storage}).kept)
        label = next(needing, None) or ", ".join(labels.values())  # the slice of all is the union of each one's
        advice = "Run it after materialize_module"
        if op.func in _SENDING_ONE_RANKS_DATA:
            advice = (
                "distribute_tensor and parallelize_module (src_data_rank=0) send rank 0's data with DTensor's own "
                "scatter and broadcast, which are replayed as this rank's own part when all they send is deferred "
                "and torch.distributed.tensor was imported before deferred_init; this one is not such a call.\n"
                "Pass src_data_rank=None to parallelize_module or distribute_tensor: every rank's deferred module "
                "holds the same values, so each rank cuts its own part without communication.\n"
                "Or materialize_module first, then parallelize"
            )
        raise DeferredInitError(
            f"{label} cannot be materialized: its values come from a collective.\n"
            f"collective: {op.name}\n"
            "A replay cannot run collectives; this one sent data between ranks while the tensor was deferred.\n"
            f"{advice}"
        )


# c10d's collectives that send one rank's data to the others, as distribute_tensor does.
_SENDING_ONE_RANKS_DATA = frozenset({torch.ops.c10d.scatter_.default, torch.ops.c10d.broadcast_.default})


def _filled_on_threads(op: Op, args: Sequence[Any], kwargs: dict[str, Any], threads: int) -> torch.Tensor | None:
    """A draw from the default CPU generator that fills its first argument in place, run on ``threads`` threads
    (``draws.Pattern.draw_into``: the same values, each thread drawing its own range from a jumped copy of the
    state), and the generator moved past it; None, and nothing done, for any other operation."""
    if not isinstance(op.func, OpOverload) or not args or not isinstance(args[0], torch.Tensor):
        return None
    if 0 not in (index for index, _ in written_arguments(op.func)):
        return None
    found = draws.pattern(op.func, args, kwargs)
    if found is None:
        return None
    torch.default_generator.set_state(found.draw_into(args[0], generator.real_state(), threads))
    return args[0]


def _run(
    op: Op,
    env: dict[int, torch.Tensor],
    wanted: Container[int],
    device: torch.device | None,
    copies: Copies,
    threads: int = 1,
    *,
    tensors: dict[int, torch.Tensor] | None = None,
    func: OpOverload | None = None,
) -> None:
    if tensors is None:
        tensors = {slot.index: env[slot.ref] for slot in op.slots}
    args, kwargs = op.arguments(tensors, device, copies=copies)
    result = _filled_on_threads(op, args, kwargs, threads) if threads > 1 else None
    if result is None:
        result = (func or op.func)(*args, **kwargs)
    if op.opaque:
        return  # an initializer that wrote into its argument, which env holds already
    leaves = [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
    if op.constant_slots:
        leaves = private_results(op, leaves, device, copies)
    for leaf, ref in zip(leaves, op.out_refs, strict=True):
        if ref is not None and ref in wanted:  # None: a result that is not a tensor
            env[ref] = leaf


def needed_ops(record: Record, targets: Mapping[int, int], count: int) -> list[int]:
    """The operations among the first ``count`` of ``record`` that a replay of ``targets`` runs, in order."""
    return _slice(record, targets, count).kept
