"""The storage table of a ledger: for each storage written or allocated while it watches, which bytes hold what.

Storages are found by the address of their C++ object and held weakly: a storage that dies leaves the table at the
next sweep, and one that a new storage replaces at the same address is told apart by its weak reference, which
expires with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from modattrs._ledger.intervals import IntervalMap, Run, byte_runs
from modattrs._ledger.provenance import Origin, Write
from modattrs._torch_private import address_of

__all__ = ["Piece", "Record", "StorageTable"]

#: Records made between two sweeps of the dead ones.
_SWEEP_EVERY = 4096


@dataclass(eq=False, slots=True)
class Record:
    """One storage: its bytes' labels, and, when it was allocated without values while the ledger watched, by what.

    Bytes no label covers are *unwritten* if ``allocated`` is set, and were there before the ledger looked if not.
    """

    ref: StorageWeakRef
    allocated: Origin | None
    writes: IntervalMap[Write]


@dataclass(slots=True)
class Piece:
    """Bytes ``[start, end)`` of a storage: written by ``write``, or (``write`` None) unwritten if ``allocated``."""

    start: int
    end: int
    write: Write | None
    allocated: Origin | None


class StorageTable:
    def __init__(self) -> None:
        self._records: dict[int, Record] = {}
        self._made = 0

    def __len__(self) -> int:
        return len(self._records)

    def record_of(self, storage: torch.UntypedStorage) -> Record | None:
        record = self._records.get(address_of(storage))
        if record is not None and record.ref.expired():  # type: ignore[no-untyped-call]
            del self._records[address_of(storage)]
            return None
        return record

    def allocate(self, storage: torch.UntypedStorage, allocated: Origin | None, write: Write | None) -> Record:
        """A new record for ``storage``: unwritten (``allocated``), or written whole by ``write``."""
        record = Record(StorageWeakRef(storage), allocated, IntervalMap())  # type: ignore[no-untyped-call]
        if write is not None and storage.nbytes():
            record.writes.assign(0, storage.nbytes(), write)
        self._records[address_of(storage)] = record
        self._made += 1
        if self._made % _SWEEP_EVERY == 0:
            self.sweep()
        return record

    def sweep(self) -> None:
        """Drop the records of storages that died."""
        dead = [address for address, record in self._records.items() if record.ref.expired()]  # type: ignore[no-untyped-call]
        for address in dead:
            del self._records[address]

    def write(self, tensor: torch.Tensor, runs: list[Run], write: Write) -> None:
        """Label the bytes ``runs`` of ``tensor``'s storage; an untracked storage gets a record (not unwritten)."""
        storage = tensor.untyped_storage()
        record = self.record_of(storage) or self.allocate(storage, None, None)
        for start, end in runs:
            record.writes.assign(start, end, write)

    def pieces(self, tensor: torch.Tensor, runs: list[Run] | None = None) -> Iterator[Piece]:
        """What labels the bytes of ``tensor`` (or its ``runs``), in order; nothing for a storage never seen."""
        record = self.record_of(tensor.untyped_storage())
        if record is None:
            return
        for run_start, run_end in byte_runs(tensor) if runs is None else runs:
            for start, end, write in record.writes.pieces(run_start, run_end):
                yield Piece(start, end, write, record.allocated)
