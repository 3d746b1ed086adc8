"""The dispatch mode that sees every write while a ledger watches, and labels the bytes written.

Note [What an aten operation writes]
torch's schemas say which arguments an operation writes (``Tensor(a!)``): in-place operations write ``self``,
``out=`` overloads their outputs. Operations that change only a tensor's metadata (``t_``, ``set_``: the
``inplace_view`` tag) write no bytes. ``resize_`` that grows a storage adds bytes nothing wrote. An operation with
no written argument and no aliasing result makes new storages: unwritten for ``empty`` and its kin, initialized for
factories (``zeros``, ``arange``, ``randn``, ``*_like`` and ``new_*`` of a tensor, which read its metadata only),
and computed from what it reads otherwise (Note [Provenance of a write]). c10d's collectives write their first
argument without saying so in their schemas (``broadcast_`` on a rank other than the source, ``scatter_``...), and
the functional collectives return what they receive (``wait_tensor`` only hands it over).

A tensor subclass (DTensor, FSDP2's sharded parameters) runs its own operations on its local tensors below this
mode, unseen: an operation on a DTensor is taken as the same operation on its local tensor.

Note [Labels only for bytes that exist]
Most operations of a model built on the meta device touch no data (``from_pretrained`` builds its model so: two
thirds of the operations it runs are factories, initializers and detaches of meta tensors). The mode works out a
label only for an operation that wrote or made a tensor holding data, after the operation ran: running it changes
no label (only this mode labels, and the operation runs below it), so a label worked out after it is the one worked
out before. The initializers of ``torch.nn.init`` called on a meta tensor do not announce themselves either
(``sources.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from modattrs._compiled import install_dispatch_entry
from modattrs._ledger.intervals import byte_runs
from modattrs._ledger.provenance import COMPUTED, INITIALIZED, LOADED, RECEIVED, Origin, Write, user_line
from modattrs._ledger.sources import conversion_running, initializer_running
from modattrs._ledger.storages import StorageTable
from modattrs._torch_private import (
    FakeTensor,
    OpOverload,
    TorchDispatchMode,
    imported_dtensor_type,
    returns_aliases,
    tensor_arguments,
    written_arguments,
)
from modattrs._torch_private import dtensor_local as _dtensor_local

__all__ = ["LedgerMode"]

#: Operations that allocate without writing values.
_EMPTY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "empty_permuted"})
#: In-place operations that write every byte of ``self`` without reading it.
_OVERWRITING = frozenset(
    {"fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_"}
    | {"cauchy_", "copy_", "fill_diagonal_"}  # fill_diagonal_ is composite: not seen here, listed for clarity
)
#: Operations whose results are their inputs' values, rearranged or cast: they keep the label of what they copy.
_COPYING = frozenset(
    {"copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy", "cat", "stack"}
    | {"narrow_copy", "slice_copy", "select_copy", "t_copy", "transpose_copy", "permute_copy", "view_copy"}
    | {"expand_copy", "repeat", "index_select", "_foreach_copy_", "constant_pad_nd"}
)
#: c10d operations that write what their first argument holds, received from other ranks.
_RECEIVING = frozenset(
    {"broadcast_", "scatter_", "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "recv_"}
    | {"reduce_scatter_", "_reduce_scatter_base_", "alltoall_", "alltoall_base_", "reduce_", "recv_any_source_"}
    | {"allgather_into_tensor_coalesced_", "reduce_scatter_tensor_coalesced_", "allgather_coalesced_"}
)


@dataclass(frozen=True, slots=True)
class _Plan:
    """How an operation is handled, worked out once per overload from its schema."""

    name: str  # e.g. "normal_", "empty_like"
    skip: bool  # writes no bytes and makes no storage (views, metadata changes)
    written: tuple[tuple[int, str], ...]  # the arguments it writes
    read: tuple[tuple[int, str], ...]  # the arguments whose bytes its values come from
    reads_written: bool  # whether it reads what it writes (add_ does, fill_ and out= do not)
    c10d: bool  # a collective of c10d, writing its first argument (Note [What an aten operation writes])
    receives: bool  # a functional collective: its results hold what other ranks sent
    allocates_empty: bool  # makes storages without values (empty, empty_like...)


@functools.cache
def _plan(func: OpOverload) -> _Plan:
    name = func.__name__.split(".")[0]
    if func.namespace == "c10d":
        return _Plan(name, name not in _RECEIVING, ((0, "tensors"),), (), False, True, False, False)
    written = written_arguments(func)
    metadata_only = torch.Tag.inplace_view in func.tags and name != "resize_"
    # wait_tensor returns the tensor a functional collective made, once it holds what was received: labelled then
    waits = func.namespace == "_c10d_functional" and name == "wait_tensor"
    skip = metadata_only or waits or (not written and returns_aliases(func))
    reads_written = name not in _OVERWRITING and all(argument == "self" for _, argument in written)
    if (name in _OVERWRITING and name != "copy_") or name.endswith("_like") or name.startswith("new_"):
        read: tuple[tuple[int, str], ...] = ()  # a fill reads nothing; ``*_like`` and ``new_*`` only metadata
    else:
        read = tuple(argument for argument in tensor_arguments(func) if reads_written or argument not in written)
    receives = func.namespace == "_c10d_functional"
    return _Plan(name, skip, written, read, reads_written, False, receives, name in _EMPTY)


def _flatten(value: object, into: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor):
                into.append(item)
            elif isinstance(item, (list, tuple)):  # c10d's Tensor[][]
                _flatten(item, into)


def _has_storage(tensor: torch.Tensor) -> bool:
    """Whether a tensor of a subclass has memory of its own to label (a wrapper subclass may have none)."""
    try:
        tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> object:
    return args[index] if index < len(args) else kwargs.get(name)


class LedgerMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Labels the bytes every operation writes in ``table``, and notes the storages it allocates."""

    def __init__(
        self,
        table: StorageTable,
        rank_of: Callable[[object], int | None],
        queued_reads: Sized,
        label_reads: Callable[[], None],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.table = table
        self._rank_of = rank_of  # the rank of this process in a c10d process group argument
        # checkpoint reads queued by any thread, labelled before an operation is (Note [Checkpoint reads labelled in
        # the watching thread] in session.py)
        self._queued_checkpoint_reads = queued_reads
        self._label_checkpoint_reads = label_reads
        dtensor = imported_dtensor_type()
        self._dtensor: type[torch.Tensor] | None = dtensor

    def __torch_dispatch__(
        self, func: OpOverload, types: Iterable[type], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        plan = _plan(func)
        if plan.skip:
            if plan.name == "lift_fresh":  # torch.tensor(data), torch.as_tensor: the data is a constant of the code
                self._constant(args[0])
            return func(*args, **kwargs)
        if self._queued_checkpoint_reads:
            self._label_checkpoint_reads()
        if self._dtensor is None:
            self._dtensor = imported_dtensor_type()
        if plan.c10d:
            return self._collective(func, plan, args, kwargs)
        written: list[torch.Tensor] = []
        for index, name in plan.written:
            _flatten(_argument(args, kwargs, index, name), written)
        grown = [(tensor, tensor.untyped_storage().nbytes()) for tensor in written] if plan.name == "resize_" else []
        result = func(*args, **kwargs)
        # Labels are worked out after the operation ran, and only for tensors holding data: running it changes no
        # label (only this mode writes labels, and the operation runs below it), and most operations of a model
        # built on the meta device hold none (Note [Labels only for bytes that exist]).
        if written:
            targets = [local for tensor in written if (local := self._local(tensor)) is not None]
            if not targets or plan.allocates_empty:  # empty.out: the output keeps what it held
                return result
            written_label = self._label(plan, self._read_arguments(plan, args, kwargs), written)
            for local in targets:
                self._write(local, written_label)
            for tensor, before in grown:
                self._grow(tensor, before)
            return result
        outputs: list[torch.Tensor] = []
        _flatten(result, outputs)
        made = [local for output in outputs if (local := self._local(output)) is not None]
        if made:
            made_label = None
            if not plan.allocates_empty:
                made_label = self._label(plan, self._read_arguments(plan, args, kwargs), [])
            self._outputs(plan, made, made_label)
        return result

    @staticmethod
    def _read_arguments(plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensors whose bytes an operation's values come from."""
        reads: list[torch.Tensor] = []
        for index, name in plan.read:
            _flatten(_argument(args, kwargs, index, name), reads)
        return reads

    # --- labels ------------------------------------------------------------------------------------------------------

    def _local(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The tensor whose bytes an operation on ``tensor`` reads or writes, None for one that holds no data."""
        kind = type(tensor)
        if kind is not torch.Tensor and kind is not nn.Parameter:
            if self._dtensor is not None and isinstance(tensor, self._dtensor):
                tensor = _dtensor_local(tensor)
            if isinstance(tensor, FakeTensor) or not _has_storage(tensor):
                return None
        if tensor.is_meta or tensor.layout != torch.strided:
            return None
        return tensor

    def _label(self, plan: _Plan, reads: list[torch.Tensor], written: list[torch.Tensor]) -> Write:
        """The label of what an operation writes, from the labels of the bytes it reads (Note [Provenance of a
        write]); a rescaling in place (``mul_`` by a number: reads only what it writes) keeps the label it had."""
        self_only = bool(written) and plan.reads_written and all(any(r is w for w in written) for r in reads)
        found: dict[int, Write] = {}
        kinds: set[str] = set()
        tainted: Origin | None = None
        for tensor in reads:
            local = self._local(tensor)
            if local is None:
                continue
            seen = False
            for piece in self.table.pieces(local):
                seen = True
                if piece.write is None:
                    if piece.allocated is not None:
                        tainted = piece.allocated
                    else:
                        kinds.add("kept")
                else:
                    found[id(piece.write)] = piece.write
                    kinds.add(piece.write.kind)
                    tainted = tainted or piece.write.tainted
            if not seen and local.numel():
                kinds.add("kept")
        if tainted is not None:
            return Write(COMPUTED, plan.name, user_line(), tainted=tainted)
        running = initializer_running()
        if running is not None:  # whatever an initializer of torch.nn.init writes, it initializes
            if running[2] is None:
                running[2] = Write(INITIALIZED, running[0], running[1])
            label: Write = running[2]
            return label
        if not kinds:
            return Write(INITIALIZED, plan.name, user_line())
        keeps = self_only or plan.name in _COPYING
        if len(kinds) == 1 and kinds <= {LOADED, INITIALIZED, RECEIVED} and keeps:
            writes = list(found.values())
            if len(writes) == 1:
                return writes[0]  # a copy, cast or scaling of one write keeps its label
            keys = tuple(dict.fromkeys(key for write in writes for key in write.keys))
            return Write(next(iter(kinds)), plan.name, user_line(), keys=keys)
        return Write(COMPUTED, plan.name, user_line())

    def _write(self, local: torch.Tensor, label: Write) -> None:
        """Label the bytes of ``local``, a tensor holding data (see ``_local``)."""
        runs = byte_runs(local)
        if label.kind not in (LOADED, RECEIVED):
            for piece in self.table.pieces(local, runs):
                if piece.write is not None and piece.write.kind == LOADED and piece.write is not label:
                    label = Write(label.kind, label.op, label.where, label.keys, label.tainted, overwrote=piece.write)
                    break
        self.table.write(local, runs, label)

    def _grow(self, tensor: torch.Tensor, before: int) -> None:
        """After ``resize_``: the bytes past the old end of the storage were written by nothing."""
        local = self._local(tensor)
        if local is None:
            return
        storage = local.untyped_storage()
        record = self.table.record_of(storage)
        if storage.nbytes() > before and (record is None or record.allocated is None):
            fresh = self.table.allocate(storage, Origin("resize_", user_line()), None)
            if record is not None:
                for start, end, write in record.writes:
                    fresh.writes.assign(start, min(end, before), write)
            else:
                fresh.writes.assign(0, before, Write(COMPUTED, "resize_ (bytes kept)", None))

    def _outputs(self, plan: _Plan, made: list[torch.Tensor], label: Write | None) -> None:
        """Note the storages an operation without written arguments made: its results holding data, new storages
        whenever its schema says they alias nothing (Note [What an aten operation writes])."""
        for local in made:
            storage = local.untyped_storage()
            if label is None:
                converting = conversion_running()
                op = plan.name if converting is None else f"{plan.name} in {converting}"
                self.table.allocate(storage, Origin(op, user_line()), None)
            elif plan.receives:
                self.table.allocate(storage, None, Write(RECEIVED, plan.name, user_line()))
            else:
                self.table.allocate(storage, None, label)

    def _constant(self, tensor: object) -> None:
        local = self._local(tensor) if isinstance(tensor, torch.Tensor) else None
        if local is not None and self.table.record_of(local.untyped_storage()) is None:
            self.table.write(local, byte_runs(local), Write(INITIALIZED, "torch.tensor", user_line()))

    # --- collectives -------------------------------------------------------------------------------------------------

    def _collective(self, func: OpOverload, plan: _Plan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        targets: list[torch.Tensor] = []
        _flatten(args[0] if args else None, targets)
        label: Write | None = Write(RECEIVED, plan.name, user_line())
        if plan.name in ("broadcast_", "scatter_"):
            group, root = (args[1], args[2]) if plan.name != "scatter_" else (args[2], args[3])
            if self._rank_of(group) == root:
                label = None if plan.name != "scatter_" else self._label(plan, _all(args[1]), [])
        result = func(*args, **kwargs)
        if label is not None:
            for tensor in targets:
                local = self._local(tensor)
                if local is not None:
                    self._write(local, label)
        return result


install_dispatch_entry(LedgerMode)  # Note [A dispatch entry dynamo cannot see] in modattrs/_compiled.py


def _all(value: object) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _flatten(value, found)
    return found
