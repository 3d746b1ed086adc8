"""What a replay of some tensors of a record runs: the operations kept for them (``slice_of``), and keeping what one
of them returns (``keep_results``). Below the replay and the generator timeline (``rng``), which both slice: the
timeline runs the draws whose count depends on values, and what they read, to know where the generator is.

Walking the record backwards, an operation is kept when it makes a tensor that is needed or writes into
storage that is needed, and what it reads becomes needed. An operation that writes a whole storage whatever it
held (``normal_`` on a weight) ends the need for that storage: earlier writes to it (the constructor's own
initialization, which ``post_init`` draws over) are dead, and run only as draws, if they draw. Operations whose
number of draws depends on values (``pinned``) are kept in every replay. Kept operations run in order; tensors
are freed after their last use.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Container, Mapping
from typing import Any, NamedTuple

import torch

from modattrs._deferred.record import Copies, Op, Record, private_results
from modattrs._torch_private import tree_flatten

__all__: list[str] = []


class Slice(NamedTuple):
    """What a replay runs (``slice_of``)."""

    kept: list[int]  # the operations kept, in order
    frees: dict[int, list[int]]  # by kept operation: the refs no later one reads, and that are not targets
    wanted: set[int]  # the refs a kept operation reads, and the targets


def slice_of(record: Record, targets: Mapping[int, int], count: int | None = None) -> Slice:
    """The operations among the first ``count`` of ``record`` (all of them by default) to keep for ``targets`` (see
    the module's docstring), and when what they make is last read.

    Note [Slicing from the needed tensors]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The walk backwards looks only at the operations that a rule could keep: the pinned ones, and, once a ref or a
    storage is needed, the earlier operations that return that ref or write that storage (the record lists them
    as it grows: ``Record.returning``, ``Record.writing``), taken latest first from a heap. Any other operation
    returns no needed ref and writes no needed storage, so no rule keeps it: the slice is the one a pass over every
    operation gives. A replay of one block of a large model, and the generator's settling after each draw of an
    initialization applied to a deferred model (``rng.state_at``), then cost what they keep, not the whole record.
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


def needed_ops(record: Record, targets: Mapping[int, int], count: int) -> list[int]:
    """The operations among the first ``count`` of ``record`` that a replay of ``targets`` runs, in order."""
    return slice_of(record, targets, count).kept


def keep_results(
    op: Op,
    result: Any,
    env: dict[int, torch.Tensor],
    wanted: Container[int],
    device: torch.device | None,
    copies: Copies,
) -> None:
    """Keep in ``env``, by ref, the tensors among ``result`` (what running ``op`` returned) that ``wanted`` holds."""
    if op.opaque:
        return  # an initializer that wrote into its argument, which env holds already
    leaves = [result] if isinstance(result, torch.Tensor) else tree_flatten(result)[0]
    if op.constant_slots:
        leaves = private_results(op, leaves, device, copies)
    for leaf, ref in zip(leaves, op.out_refs, strict=True):
        if ref is not None and ref in wanted:  # None: a result that is not a tensor
            env[ref] = leaf
