"""Replay of a record (``record``): run, for real, what some of its tensors need.

The operations kept (``slicing``) run in order; tensors are freed after their last use.

Random numbers are exact randomness's business (``rng``): a replay walks the record's draws with one ``rng.Walk``,
which sets, before each kept draw from the default CPU generator, the state eager code drew from, and draws the parts
of fills that the shard-local planner (``windows.Plan``) makes alone. Operations that draw from an explicit
``torch.Generator`` use its recorded state; the generators of other devices are used as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from typing import Any

import torch

from modattrs._deferred import rng, windows
from modattrs._deferred.ops import facts_of
from modattrs._deferred.record import Copies, DeferredInitError, Layout, Op, Record, reads_no_values
from modattrs._deferred.slicing import Slice, keep_results, slice_of
from modattrs._torch_private import OpOverload

__all__: list[str] = []


def replay(
    record: Record,
    targets: Mapping[int, int],
    labels: Mapping[int, str],
    *,
    device: torch.device | None,
    to_end: bool,
    threads: int = 1,
    views: Sequence[Layout] = (),
) -> dict[int, torch.Tensor]:
    """Run what the refs in ``targets`` (ref to its storage) need, for real, and return them by ref; ``labels``
    names them for messages. ``views``: where tensors lie that the caller makes from the memory of a target on
    their storage (see Note [A view of a chosen tensor's memory is made from it] in ``materialize``): the memory made
    for that storage holds them.

    With ``to_end``, the default CPU generator is left where eager construction would have left it (unless the
    caller reseeded it since); otherwise the replay stops after the last operation needed and the generator is put
    back as it was.
    """
    with rng.replaying(record, device, to_end=to_end) as walk:
        sliced = slice_of(record, targets)
        _check_devices(record, sliced.kept, device)
        _refuse_collectives(record, sliced.kept, targets, labels)
        plan = windows.Plan(record, sliced.kept, targets, walk, device, copies={}, views=views)
        env = _run_kept(record, sliced, walk, plan, device, threads)
        if to_end and not record.settled:  # a settled record's end is where the generator is already
            walk.reach(len(record.ops))
        return {ref: env[ref] for ref in targets}


def _run_kept(
    record: Record, sliced: Slice, walk: rng.Walk, plan: windows.Plan, device: torch.device | None, threads: int
) -> dict[int, torch.Tensor]:
    """Run the kept operations of ``sliced`` in order, those with a role in a window of ``plan`` on it (see
    ``Note [Replaying only the part that is kept]``), and each draw from the default CPU generator from the state
    eager code drew it from (``walk``); keep their results until their last use, and return what is left."""
    ops = record.ops
    kept, frees, wanted = sliced
    env: dict[int, torch.Tensor] = {}
    unfilled = _dead_fills(record, kept)
    plan.prepare(unfilled)
    for index in kept:
        if not plan.run(index, env, wanted):
            tensors = plan.arguments(index, env)  # None unless it reads windows: then run on one thread
            draws = walk.is_draw(index)
            if draws:
                walk.before(index)
            filled = functools.partial(walk.filled, index, threads=threads if tensors is None else 1) if draws else None
            _run(ops[index], env, wanted, device, plan.copies, tensors=tensors, func=unfilled.get(index), filled=filled)
            if draws:
                walk.ran(index)
            plan.release_after(index)
        for ref in frees.get(index, ()):
            env.pop(ref, None)
    return env


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
        needing = (labels[ref] for ref, storage in targets.items() if index in slice_of(record, {ref: storage}).kept)
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


def _run(
    op: Op,
    env: dict[int, torch.Tensor],
    wanted: Container[int],
    device: torch.device | None,
    copies: Copies,
    *,
    tensors: dict[int, torch.Tensor] | None = None,
    func: OpOverload | None = None,
    filled: Callable[[tuple[Any, ...], dict[str, Any]], torch.Tensor | None] | None = None,
) -> None:
    """Run ``op`` on the tensors of ``env`` (or ``tensors``), as ``func`` if given; a draw as ``filled`` (the walk's)
    draws it where the walk has a faster way to the same values (``rng.Walk.filled``)."""
    if tensors is None:
        tensors = {slot.index: env[slot.ref] for slot in op.slots}
    args, kwargs = op.arguments(tensors, device, copies=copies)
    result = None if filled is None else filled(args, kwargs)
    if result is None:
        result = (func or op.func)(*args, **kwargs)
    keep_results(op, result, env, wanted, device, copies)
