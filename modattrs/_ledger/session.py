"""One watch of a ledger: its storage table, its dispatch mode, the scoped wraps it takes part in, and the ties of the
modules it saw converted."""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from modattrs._ledger import sources
from modattrs._ledger.intervals import byte_runs
from modattrs._ledger.provenance import INITIALIZED, LOADED, Where, Write, user_line
from modattrs._ledger.storages import StorageTable
from modattrs._ledger.tracking import LedgerMode
from modattrs._module_tensors import listen_for_writes, stop_listening_for_writes
from modattrs._torch_private import FakeTensor, import_dynamo, imported_dtensor_type
from modattrs._torch_private import dtensor_local as _dtensor_local

__all__ = ["Session", "TiesBefore", "local_data", "tie_groups"]


@dataclass(frozen=True)
class TiesBefore:
    """The ties a module had when a conversion of it began: names relative to the module, grouped."""

    module: weakref.ref[nn.Module]
    groups: tuple[tuple[str, ...], ...]
    op: str
    where: Where | None


def local_data(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding ``tensor``'s bytes here (a DTensor's local tensor), None if it holds none (fake, meta)."""
    dtensor = imported_dtensor_type()
    if dtensor is not None and isinstance(tensor, dtensor):
        tensor = _dtensor_local(tensor)
    if tensor.is_meta or isinstance(tensor, FakeTensor) or tensor.layout != torch.strided:
        return None
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass with no memory of its own
        return None
    return tensor


def tie_groups(module: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The names of ``module``'s parameters and buffers that are one tensor object, for tensors with several names."""
    names: dict[int, list[str]] = {}
    for name, tensor in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        names.setdefault(id(tensor), []).append(name)
    return tuple(tuple(group) for group in names.values() if len(group) > 1)


def _rank_of(group: object) -> int | None:
    """This process's rank in a c10d operation's process group (the dispatcher hands it over boxed)."""
    try:
        import torch.distributed as dist

        unboxed = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else group
        rank = getattr(unboxed, "rank", None)
        return int(rank()) if callable(rank) else None
    except Exception:  # a group object this torch does not let Python ask: every rank counts as receiving
        return None


# Note [Checkpoint reads labelled in the watching thread]
# transformers reads a checkpoint's tensors in a pool of threads. Labelling each read where it happens (finding its
# storage's record, its byte runs, an interval) is Python run in those threads, and they contend for the GIL with
# the thread that watches: measured on from_pretrained of a 322M Llama, that cost the workers about twice their own
# labelling work and the watching thread some more. A read only queues its tensor (one append, safe from any
# thread); the watching thread labels what is queued before its next operation is labelled, when the watch ends and
# before a report. A queued tensor is held until then, so its storage cannot die and be reborn at its address; the
# thread that hands a read tensor to the watching thread (a future's result, a queue) queued it first, so no
# operation of the watching thread can read it unlabelled.


class Session:
    """What one watch keeps; a sink of the scoped wraps (Note [Scoped wraps of a watch])."""

    def __init__(self) -> None:
        self.table = StorageTable()
        self._reads: collections.deque[tuple[torch.Tensor, str, str, Where | None]] = collections.deque()
        self.mode = LedgerMode(self.table, _rank_of, self._reads, self.label_reads)
        self.ties: list[TiesBefore] = []
        self._lock = threading.Lock()
        self.active = False

    def start(self) -> None:
        # On torch 2.8, an operation run by torch._dynamo's own import under a dispatch mode reaches
        # torch._disable_dynamo, which needs the module imported whole (a flow importing transformers' generation
        # code inside a watch failed so): imported first, as torch imports it at its first compile or fake tensor.
        import_dynamo()
        sources.start(self)
        try:
            self.mode.__enter__()  # type: ignore[no-untyped-call]
        except BaseException:
            sources.stop(self)
            raise
        listen_for_writes(self.written_unseen)
        self.active = True

    def stop(self) -> None:
        try:
            self.mode.__exit__(None, None, None)  # type: ignore[no-untyped-call]
            self.label_reads()
        finally:
            stop_listening_for_writes(self.written_unseen)
            self.active = False
            sources.stop(self)
            self.table.sweep()

    def written_unseen(self, tensors: Sequence[torch.Tensor], operation: str) -> None:
        """``operation`` wrote all of ``tensors`` below every dispatch mode (materialize_module's replay: see Note
        [Writes no dispatch mode sees] in ``modattrs._module_tensors``): initialized by it, at the user's line."""
        label = Write(INITIALIZED, operation, user_line())
        self.label_reads()  # read before these writes
        with self._lock:
            for tensor in tensors:
                local = local_data(tensor)
                if local is not None:
                    self.table.write(local, byte_runs(local), label)

    def loaded(self, tensor: torch.Tensor, key: str, op: str, where: Where | None) -> None:
        """``tensor`` was read from a checkpoint under ``key``, in any thread: queued (Note [Checkpoint reads
        labelled in the watching thread])."""
        self._reads.append((tensor, key, op, where))

    def label_reads(self) -> None:
        """Label the checkpoint reads queued so far as loaded."""
        with self._lock:
            while self._reads:
                self._label_read(*self._reads.popleft())

    def _label_read(self, tensor: torch.Tensor, key: str, op: str, where: Where | None) -> None:
        local = local_data(tensor)
        if local is None:
            return
        label = Write(LOADED, op, where, keys=(key,))
        storage = local.untyped_storage()
        record = self.table.record_of(storage)
        runs = byte_runs(local)
        if record is None:  # most often: a tensor the loader just made
            record = self.table.allocate(storage, None, None)
        if record.allocated is None:
            for start, end in runs:
                record.writes.assign(start, end, label)
            return
        # bytes nothing wrote stay unwritten: a checkpoint made of garbage is garbage
        for piece in list(self.table.pieces(local, runs)):
            if piece.write is not None:
                record.writes.assign(piece.start, piece.end, label)

    def converting(self, module: nn.Module, op: str, where: Where | None) -> None:
        groups = tie_groups(module)
        if groups:
            self.ties.append(TiesBefore(weakref.ref(module), groups, op, where))
