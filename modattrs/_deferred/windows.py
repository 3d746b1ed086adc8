"""Shard-local replay: a storage of which a replay keeps only a part is made only there.

Note [Replaying only the part that is kept]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``fully_shard`` cuts a rank's part out of each deferred parameter with ``split`` and copies it into a new tensor;
``distribute_tensor`` (``ColwiseParallel``) keeps a ``chunk`` of it. A replay of such a shard needs the operations
that made the whole parameter, but only some of their elements: a *window* of the parameter's storage, the span
of elements its kept readers and targets read. When every kept operation on a storage is one whose effect on the
window is known, the replay allocates the window alone and runs those operations on it:

- the *creator*, a factory (``empty``, ``zeros``, ``new_ones``, ...) that made the storage whole, contiguous: it
  makes the window's elements instead;
- *views* of the storage: not run; the refs they made that lie within the window become views of it;
- *metadata reads* (``prim.device``, the ``new_*`` factories, which read only dtype and device): given the window;
- *whole writes* covering the storage, contiguous: a random fill whose consumption of the generator ``rng.draws``
  models draws only the window's elements (``Pattern.draw``, which jumps to the first output they read), and the
  generator is left where the fill begins, for the walk to jump past it (so does ``trunc_normal_`` drawn in rounds
  of ``normal_``, Note [trunc_normal_ as rounds of normal_] in ``rng.rejection``); an elementwise in-place
  operation with no other tensor argument (``fill_``, ``zero_``, ``mul_`` by a number) runs on the window;
- *partial writes* of that elementwise kind (``weight[padding_idx].zero_()``) run on the window when their span
  lies within it, and not at all when it lies outside;
- *readers* (``copy_`` from a shard view, ``clone``, a conversion): run as usual on views of the window, which they
  lie in by construction;
- *the copy into a host*: when the window's only reader is a ``copy_`` of all of it into a storage made whole by
  a factory (FSDP2's padded shard, ``new_zeros``), or a ``clone`` of all of it into a window that has a host, the
  window is drawn straight into that storage, where the copy would put it (see ``Note [Drawing into the padded
  shard]``).

Which operations are creators, metadata reads and elementwise writes is the catalogue's (``ops``: read off their
schemas and tags where torch states it).

A storage touched by anything else (a write with a tensor source, an opaque initializer, a fill whose draws are
not modelled, a view in another dtype, a change of geometry in place) is made whole, as before; so is one whose
window would be all of it. The values in the window are those of the whole storage, bit for bit, so a shard
replayed this way equals the slice of the eager tensor, and the unsharded parameter is never allocated: a rank's
memory is its shards plus the window of the parameter at hand (or its shards alone, when each window is drawn
into its shard).

A storage made whole by a ``clone`` of a view of another (``distribute_tensor``'s local shard, which FSDP2 then
cuts along dim 0) has a window too: whole rows of the copy, made by cloning the same rows of the view (the *source*
part), which is all its source's window must hold for that reader. So a rank of FSDP2 over tensor parallelism
copies and draws its own rows, not its tensor-parallel shard, and a trivial mesh dimension (tp 1) costs nothing.
A storage that a factory made (``empty_like``, ``new_empty``, ...) and a ``copy_`` then wrote all of, from a view
of another storage of the same sizes and dtype, with nothing but metadata reads in between, is such a copy too (the
factory's memory is never made: the copy's rows are the window): that is what a scatter of a deferred source
records (Note [A scatter of a deferred source is the rank's own chunk] in ``recorder``), ``distribute_tensor``'s
default, and torchtitan's. The factory may be a creator: torchtitan's fused ``wqkv`` is ``nn.Linear``'s weight,
which a ``copy_`` overwrites.

A storage that a ``cat`` made whole, contiguous, of contiguous tensors of other storages (torchtitan's ``wqkv`` is a
copy of ``cat`` of views of q, k and v along dim 1) has a window too: within one slice of the cat's dimension, a run
of the result is a run of one input, so the window is copied from runs of its inputs (the *parts*), which are all
their windows must hold for that reader: a rank draws the runs of q, k and v its rows come from, and nothing of the
parts it holds none of. An input that is not contiguous makes the ``cat`` whole, as before.

Storages are planned each before those it may be copied from (``_copies_first``), so a copy's window is known
before its sources'. Planned in another order (a cycle of copies), a source's window covers all that its reader
reads: wider, never wrong.

Note [A window drawn as runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A window is the span of what is read, but what is read may be runs with gaps between them (a strided view: the
rows of a ``RowwiseParallel`` column cut that a rank keeps, or of an FSDP2 cut of it). Each reader's elements are
taken as runs (``_runs``), those less than a jump apart joined (``_gap_drawn``: drawing ``rng.JUMP_COST`` outputs
costs what a jump costs), and a random fill of all of the window draws only these *segments* into the window's
memory: the first from where the walk left the generator, each next one from where the one before stopped, jumping
the gap (a distance that repeats from one identical layer to the next, whose power ``rng.mt19937`` keeps). Each
segment is ``Pattern.draw`` of its elements, exact for the block path of ``normal_`` too (a segment's blocks and the
redrawn tail are drawn whole), and the fill's last segment leaves the generator where the walk goes on from, as for
one part. The window's other elements are never written and never read (every reader reads within its runs), so a
window may be all of its storage when its segments are not. The scalar ``normal_`` path (fewer than 16 elements)
is drawn as one segment.

Note [Drawing into the padded shard]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``fully_shard`` copies a rank's rows of each parameter into a padded shard it makes with ``new_zeros``, and the
sharded parameter is a view of that. Replayed as recorded, a rank would allocate and fill the window, then allocate
the padded shard and copy the window into it: its memory is paid for twice, and written twice. When the copy is
the window's only reader and writes all of it, contiguous, into a storage (the *host*) that a factory made whole,
contiguous, from its start, the replay makes the host when the window's elements are first drawn, and the window
is the part of the host the copy writes: the fill draws into it, the factory's result is the host made already,
and the copy is not run. That gives the same values only when nothing tells the two apart, so the replay hosts a
window only when

- the first thing to write the window is a random fill that writes all of it (the host's own fill, which the
  window's memory now holds, is never read), or nothing but elementwise writes do (a norm's weight, made by
  ``ones``): then the window's creator runs on the window's size when it would have, and its fill is written into
  the host's part;
- the copy is the window's only reader (so nothing after it writes the window: the slice keeps a write only for
  a later reader), and no target is on the window's storage (a target on it would see what later writes into
  the host);
- between the factory and the copy, the host is only viewed (nothing reads what the copy has not yet written);
- the factory reads no tensor but the window's dtype and device (``new_zeros`` on the parameter), so it can run
  early, as it would run at its own place.

Under FSDP2 over tensor parallelism the padded shard is copied from a window of ``distribute_tensor``'s ``clone``
(a CLONE window, whole rows), itself a copy of rows of the parameter's window. The same holds one step up: a CLONE
window is hosted as a drawn one is (the clone writes all of it first, so its fill is never read), its rows copied
straight into the padded shard; and a parameter's window whose only reader is such a clone of all of it,
contiguous (a column cut's rows, or any cut over a trivial tp dimension), is drawn straight into the clone's
window, which is its host: the clone is not run either, and a rank writes its elements once, where they end. A row
cut's rows are strided in the parameter: those are drawn into a window of their own and copied once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from modattrs._deferred import rng
from modattrs._deferred.ops import facts_of
from modattrs._deferred.record import Copies, Layout, Op, Record, Slot, reads_no_values
from modattrs._torch_private import OpOverload, contiguous_strides, operator_arguments

__all__: list[str] = []

aten = torch.ops.aten


class Role:
    """What a kept operation is to a window (see the Note above)."""

    CREATE = "create"
    VIEW = "view"
    METADATA = "metadata"
    DRAW = "draw"  # a whole write by a modelled random fill
    ELEMENTWISE = "elementwise"  # a whole or partial elementwise write within the window
    OUTSIDE = "outside"  # a partial elementwise write outside the window: not run
    READ = "read"
    HOST = "host"  # the factory of the storage the window is drawn into: gives it
    # the copy that made the storage whole, contiguous, from a view of another (a clone, or a copy_ into what a
    # factory made): copies the window
    CLONE = "clone"
    CAT = "cat"  # the cat that made the storage whole, contiguous, from contiguous inputs: copies their parts
    COPIED = "copied"  # the copy of the window into its host: not run


@dataclass
class Host:
    """The storage a window is drawn into (``Note [Drawing into the padded shard]``): made whole by the operation
    at ``factory``, or the memory of the window a ``clone`` copies it into (``factory`` None); the window is its
    elements from ``offset`` on."""

    factory: int | None
    offset: int
    make: Callable[[], torch.Tensor] | None = None  # the factory, run with stand-ins: see prepare
    tensor: torch.Tensor | None = None  # the whole storage, once made

    def whole(self) -> torch.Tensor:
        """The host's storage, whole, made now if it is not yet."""
        if self.tensor is None:
            assert self.make is not None
            self.tensor, self.make = self.make(), None
        return self.tensor


@dataclass
class Window:
    """The part ``start:stop`` (in elements) of a storage that a replay makes, and how each operation on it runs."""

    storage: int
    dtype: torch.dtype
    start: int
    stop: int
    roles: dict[int, str]  # operation index -> its role: its own operations in order, then its host's factory
    last: int  # the last kept operation that touches it
    tensor: torch.Tensor | None = None  # the window's memory, once made
    make: Callable[[], torch.Tensor] | None = None  # its creator, run on the window's size: see memory
    empty: torch.Tensor | None = None  # its stand_in
    host: Host | None = None  # the storage it is drawn into, if any
    # The parts of the window a random fill of all of it draws (Note [A window drawn as runs]): sorted, disjoint,
    # within start:stop, holding every element anything kept reads; the rest of the window is never read.
    segments: tuple[range, ...] = ()
    source: Layout | None = None  # for a window made by a CLONE: the part of the view copied that lands in it
    # For a window made by a CAT: where in the window each part of an input lands (element, then the part: a run
    # of its input's storage), in the order of the window's elements.
    parts: tuple[tuple[int, Layout], ...] = ()
    creator_read: bool = False  # hosted, and its creator's fill is read: written into the host's part

    def memory(self) -> torch.Tensor:
        """The window's memory, made now if it is not yet: its part of its host, or else its creator's result. The
        creator runs only when something needs it before a random fill writes all of it: the fill's result then is
        the window, not a copy (no second allocation)."""
        if self.tensor is None and self.host is not None:
            whole = self.host.whole()
            self.tensor = whole.as_strided((self.stop - self.start,), (1,), whole.storage_offset() + self.host.offset)
        elif self.tensor is None:
            assert self.make is not None
            self.tensor, self.make = self.make(), None
        return self.tensor

    def destination(self) -> torch.Tensor | None:
        """Where a random fill of all of the window draws its elements: its part of its host; None, into memory of
        its own."""
        return None if self.host is None else self.memory()

    def release(self) -> None:
        """Drop the window's memory (what still reads it holds views of it)."""
        self.tensor = self.make = self.host = None

    def filled(self, values: torch.Tensor) -> None:
        """Write all of the window: ``values``, its elements."""
        if values is self.tensor:
            return  # drawn into it
        if self.tensor is None:
            # A draw's result may be a slice of its scratch memory; a single element may have any stride.
            self.tensor, self.make = (values if values.numel() < 2 or values.stride() == (1,) else values.clone()), None
        else:
            self.tensor.copy_(values)

    def view(self, layout: Layout) -> torch.Tensor:
        """The tensor of ``layout`` (which lies within the window) on the window's memory."""
        memory = self.memory()  # 1-D, its elements adjacent, but maybe not at the start of its storage
        offset = layout.offset - self.start if layout.span else 0
        return memory.as_strided(layout.size, layout.stride, memory.storage_offset() + offset)

    def stand_in(self) -> torch.Tensor:
        """A tensor of the window's dtype and device, without elements, for operations that read only those (one
        for all of them: they do not write it)."""
        if self.empty is None:
            self.empty = torch.empty(0, dtype=self.dtype, device="cpu")
        return self.empty


class Plan:
    """The windows of one replay (by storage), and how the kept operations that have a role in them run: the
    shard-local planner's whole interface to the replay. Its random fills are drawn by the replay's walk along
    the generator (``rng.Walk``), which says which draws it models (``kind_of``) and draws their parts."""

    def __init__(
        self,
        record: Record,
        kept: list[int],
        targets: Mapping[int, int],
        walk: rng.Walk,
        device: torch.device | None,
        copies: Copies,
        views: Sequence[Layout] = (),
    ) -> None:
        """Plan the windows of a replay of ``kept`` (operation indices, ascending) of ``record`` for ``targets`` (ref
        -> storage), onto ``device``, sharing the replay's ``copies`` of constants; ``views`` lie where the memory
        made must hold them, as a target's. Replays onto another device than the CPU make no windows."""
        self.record, self.walk, self.device, self.copies = record, walk, device, copies
        self.windows = _plan(record, kept, targets, walk, device, views)
        self.on: dict[int, list[Window]] = {}  # operation index -> the windows it has a role in
        for window in self.windows.values():
            for index in window.roles:
                self.on.setdefault(index, []).append(window)

    def prepare(self, factories: Mapping[int, OpOverload]) -> None:
        """Give each host its factory, to run whenever it is first needed: ``factories`` holds the factories to run
        instead of those recorded (``new_empty`` for a ``new_zeros`` whose zeros nothing reads)."""
        if self.windows:
            _prepare(self.record.ops, self.windows, factories, self.device, self.copies)

    def run(self, index: int, env: dict[int, torch.Tensor], wanted: set[int]) -> bool:
        """Run the kept operation at ``index`` on the windows it has a role in, keeping in ``env`` the refs it makes
        that ``wanted`` holds; False if it has none, or only reads them, for the caller to run it as recorded, with
        ``arguments``. A window is released after the last operation that touches it."""
        on = self.on.get(index)
        if on is None:
            return False
        done = _run(self, self.record.ops[index], index, on, env, wanted)
        if done:
            self.release_after(index)
        return done

    def arguments(self, index: int, env: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
        """The tensors to run the operation at ``index`` with, by position, if it reads windows (see
        ``window_arguments``); None for ``env``'s own."""
        return window_arguments(self.record.ops[index], self.windows, env) if index in self.on else None

    def release_after(self, index: int) -> None:
        """Drop the memory of the windows whose last kept operation is the one at ``index``."""
        for window in self.on.get(index, ()):
            if window.last == index:
                window.release()


def _plan(
    record: Record,
    kept: list[int],
    targets: Mapping[int, int],
    walk: rng.Walk,
    device: torch.device | None,
    views: Sequence[Layout] = (),
) -> dict[int, Window]:
    """The windows of ``Plan``, by storage."""
    if device is not None and device.type != "cpu":
        return {}
    layouts = record.layouts
    touching: dict[int, list[int]] = {}  # the kept operations that touch each storage, in the record's order
    for index in kept:  # not a pass over record.touching: a replay of one block keeps few of a large model's
        for storage in record.ops[index].touched:
            touching.setdefault(storage, []).append(index)
    touching = {storage: touching[storage] for storage in sorted(touching, key=_first_touch(record))}
    spans: dict[int, list[range]] = {}
    whole: set[int] = set()  # storages a target holds in a layout the record does not know
    for ref, storage in targets.items():
        layout = layouts.get(ref)
        if layout is None or layout.storage != storage:
            whole.add(storage)
        else:
            spans.setdefault(storage, []).extend(_runs(layout))
    for layout in views:
        spans.setdefault(layout.storage, []).extend(_runs(layout))
    found: dict[int, Window] = {}
    copied: dict[int, list[Layout]] = {}  # a CLONE's or CAT's index -> the parts of its sources it copies
    # A storage copied from others (a CLONE, a CAT) is planned before the storages it copies from, whose windows
    # then hold only the parts copied.
    order, first_copies = _copies_first(record, touching)
    for storage in order:
        if storage in whole:
            continue
        window = _window(
            record, storage, touching[storage], spans.get(storage, []), walk.kind_of, copied, first_copies[storage]
        )
        if window is not None:
            found[storage] = window
            for index in _copies_of(window):
                copied[index] = [window.source] if window.source is not None else [part for _, part in window.parts]
    windows = {storage: found[storage] for storage in touching if storage in found}
    for storage, window in windows.items():
        if storage not in spans:
            window.host = _host(record, window, touching, windows)
    # Each CLONE's window by the clone's operation: a window read once, by a clone, may be drawn into its memory.
    clones = {
        index: window for window in windows.values() for index, role in window.roles.items() if role == Role.CLONE
    }
    for storage, window in windows.items():  # once the copies' hosts are known
        if storage not in spans and window.host is None:
            window.host = _clone_host(window, clones)
    return windows


def _copies_first(record: Record, touching: Mapping[int, list[int]]) -> tuple[list[int], dict[int, int | None]]:
    """The storages of ``touching`` (in the order of their first touch), each before those it may be copied from:
    what the first operation on it reads (a ``clone``, a ``cat``), and what the first ``copy_`` into it after
    metadata reads reads (see ``_copied_whole``); and where in its operations that ``copy_`` is, by storage (see
    ``_first_copy_into``). Most storages are made before what is copied from them, so this is mostly last touched
    first; a weight made by its constructor and later overwritten by a ``copy_`` of a ``cat`` is made before its
    source."""
    ops = record.ops
    sources: dict[int, list[int]] = {}
    first_copies: dict[int, int | None] = {}
    for storage, indices in touching.items():
        read = [slot.storage for slot in ops[indices[0]].slots]
        at = first_copies[storage] = _first_copy_into(ops, indices, storage)
        if at is not None:
            read.extend(slot.storage for slot in ops[indices[at]].slots)
        sources[storage] = [source for source in read if source != storage and source in touching]
    finished: list[int] = []  # each after the storages it is copied from: reversed, before them
    seen: set[int] = set()
    for root in touching:  # an iterative depth-first search: chains of copies may be long
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sources[root]))]
        while stack:
            storage, rest = stack[-1]
            source = next(rest, None)
            if source is None:
                stack.pop()
                finished.append(storage)
            elif source not in seen:
                seen.add(source)
                stack.append((source, iter(sources[source])))
    return finished[::-1], first_copies


def _first_touch(record: Record) -> Callable[[int], tuple[int, int]]:
    """A sort key putting storages in the order ``record.touching`` has them: of the operation that touched each
    first, then of that operation's ``touched``."""

    def first_touch(storage: int) -> tuple[int, int]:
        first = record.touching[storage][0]
        return first, list(record.ops[first].touched).index(storage)

    return first_touch


def _host(record: Record, window: Window, touching: Mapping[int, list[int]], windows: Container[int]) -> Host | None:
    """The storage to draw ``window`` into, if it can be (``Note [Drawing into the padded shard]``), with the roles
    of its factory and its copy set; else None. ``window``'s storage holds no target."""
    ops, layouts = record.ops, record.layouts
    roles = window.roles
    reads = [index for index, role in roles.items() if role == Role.READ]
    if len(reads) != 1 or window.start == window.stop:
        return None
    (reader,) = reads
    copy = ops[reader]
    if copy.func is not aten.copy_.default or len(copy.slots) != 2 or copy.constant_slots:
        return None
    destination, source = copy.slots  # in the order of the arguments
    host = destination.storage
    if destination.index != 0 or not destination.written or source.written or host == window.storage:
        return None
    if copy.out_refs != (destination.ref,) or copy.writes != {host} or host in windows:
        return None
    laid, read = layouts.get(destination.ref), layouts[source.ref]
    if laid is None or not _laid_out(destination, window.dtype) or laid.size != read.size:
        return None
    if read.span != range(window.start, window.stop) or not _contiguous(read) or not _contiguous(laid):
        return None  # the copy reads other than all of the window, or not in its order
    first_write = next(role for role in roles.values() if role not in (Role.CREATE, Role.VIEW, Role.METADATA))
    # (roles are in the order of the operations) What the copy reads is a fill of all of the window, or else the
    # creator's fill, then maybe elementwise writes: the creator's fill is then written into the host's part.
    creator_read = first_write in (Role.READ, Role.ELEMENTWISE) and next(iter(roles.values())) == Role.CREATE
    if first_write not in (Role.DRAW, Role.CLONE) and not creator_read:
        return None
    factory, *between = touching[host]
    made = _created(ops[factory], host, layouts)
    if made is None or made.dtype != window.dtype:
        return None
    if any(slot.storage != window.storage for slot in ops[factory].slots) or ops[factory].constant_slots:
        return None  # it reads other tensors than the window's, which may not be there yet
    for index in between:
        if index >= reader:
            break
        if not reads_no_values(ops[index]):
            return None
    roles[factory] = Role.HOST
    roles[reader] = Role.COPIED
    window.creator_read = creator_read
    return Host(factory, laid.offset)


def _clone_host(window: Window, clones: Mapping[int, Window]) -> Host | None:
    """The memory of the window that a ``clone`` of all of ``window``, contiguous, makes, to draw ``window`` into
    (``Note [Drawing into the padded shard]``), with the clone's role set; else None. ``window``'s storage holds no
    target."""
    reads = [index for index, role in window.roles.items() if role == Role.READ]
    if len(reads) != 1 or window.start == window.stop:
        return None
    (reader,) = reads
    copy = clones.get(reader)
    if copy is None or copy.host is None or copy.source is None:
        return None  # a copy with memory of its own keeps its clone: its memory is made by it
    read = copy.source
    if read.storage != window.storage or read.span != range(window.start, window.stop) or not _contiguous(read):
        return None  # the clone reads other than all of the window, or not in its order
    first_write = next(role for role in window.roles.values() if role not in (Role.CREATE, Role.VIEW, Role.METADATA))
    if first_write not in (Role.DRAW, Role.CLONE) or copy.stop - copy.start != window.stop - window.start:
        return None  # its creator's fill would be what the copy reads, or the copy reads another length
    window.roles[reader] = Role.COPIED
    return Host(None, 0, make=copy.memory)


def _window(
    record: Record,
    storage: int,
    indices: list[int],
    target_spans: list[range],
    kind_of: Callable[[int], str | None],
    copied: Mapping[int, list[Layout]],
    first_copy: int | None,
) -> Window | None:
    ops, layouts = record.ops, record.layouts
    if target_spans:  # whatever made the storage whole made it as the layout of its only result
        results = ops[indices[0]].out_refs
        laid = layouts.get(results[0]) if len(results) == 1 and results[0] is not None else None
        if laid is not None and laid.storage == storage and _covered(target_spans, math.prod(laid.size)):
            return None  # all of it is a target's (FSDP2's padded shard)
    whole: Layout | None
    cloned: Layout | None = None
    concatenated: tuple[Layout, int, list[Layout]] | None = None
    roles = {indices[0]: Role.CREATE}
    later = indices[1:]
    # A factory whose memory a copy_ then writes all of (a creator too: torchtitan's fused wqkv, made by nn.Linear
    # and overwritten by a copy_ of a cat) makes nothing (see the CREATE role in _run).
    copy = _copied_whole(ops, indices, storage, layouts, first_copy)
    if copy is not None:
        at, whole, cloned = copy
        roles.update(dict.fromkeys(indices[1:at], Role.METADATA))
        roles[indices[at]] = Role.CLONE
        later = indices[at + 1 :]
    else:
        whole = _created(ops[indices[0]], storage, layouts)
    if whole is None:
        whole, cloned = _cloned(ops[indices[0]], storage, layouts) or (None, None)
        if whole is not None:
            roles[indices[0]] = Role.CLONE
    if whole is None:
        concatenated = _catted(ops[indices[0]], storage, layouts)
        if concatenated is not None:
            whole = concatenated[0]
            roles[indices[0]] = Role.CAT
    if whole is None or _covered(target_spans, math.prod(whole.size)):
        return None  # not made whole by a factory, or all of it is a target's (FSDP2's padded shard)
    if cloned is not None and target_spans:
        return None  # a target on a copy (a deep copy's view) keeps its place in the whole copy, as in eager code
    spans = list(target_spans)
    partial: dict[int, range] = {}
    kinds: dict[int, str] = {}
    for index in later:
        op = ops[index]
        on = [slot for slot in op.slots if slot.storage == storage]
        for slot in on:
            if not _laid_out(slot, whole.dtype):
                return None  # a ref whose geometry changed in place, not laid out, or in another dtype
        func = op.func
        if not isinstance(func, OpOverload) and storage not in op.writes:
            return None  # an opaque initializer reading it: what it reads is unknown
        made = op.results
        facts = facts_of(func)
        written = [slot for slot in on if slot.written]
        if not written and storage not in op.writes:
            if facts.view and not made.unlaid and made.storages <= {storage}:
                if not made.dtypes <= {whole.dtype}:
                    return None
                roles[index] = Role.VIEW
            elif (facts.metadata_read or facts.geometry_read) and storage not in made.storages:
                roles[index] = Role.METADATA
            elif storage in made.storages:
                return None  # makes a tensor on this storage without being a view
            else:
                roles[index] = Role.READ
                parts = copied.get(index)  # a CLONE or CAT into a window copies only these parts
                for slot in on:
                    if parts is None:
                        spans.extend(_runs(layouts[slot.ref]))
                    else:
                        spans.extend(run for part in parts if part.storage == storage for run in _runs(part))
            continue
        if len(written) != 1 or len(op.slots) != 1 or op.constant_slots or op.writes != {storage}:
            return None  # writes from another tensor, or through several arguments
        layout = layouts[written[0].ref]
        covers = layout.offset == 0 and _contiguous(layout) and math.prod(layout.size) == math.prod(whole.size)
        kind = kind_of(index) if covers else None
        if kind is not None:
            roles[index] = Role.DRAW
            kinds[index] = kind
        elif not isinstance(func, OpOverload):
            return None  # an opaque initializer: its effect on a part is unknown unless modelled (rng.rejection)
        elif op.draws.value == 0 and facts.elementwise:
            roles[index] = Role.ELEMENTWISE
            if not covers:
                partial[index] = layout.span
        else:
            return None
    segments = _merged(spans, _gap_drawn(whole.dtype))
    if len(segments) == 1 and _covered(segments, math.prod(whole.size)):
        return None  # all of it is needed: made whole, as eager code makes it
    start, stop = _hull(segments) or (0, 0)
    source = None
    if cloned is not None:  # whole rows of the copy: the part of its source they come from is a narrowed view
        row = math.prod(whole.size[1:])
        if not whole.size or row == 0:
            return None
        start, stop = start - start % row, -(-stop // row) * row
        if _covered([range(start, stop)], math.prod(whole.size)) or cloned.size != whole.size:
            return None
        segments = (range(start, stop),)
        source = Layout(
            cloned.storage,
            cloned.offset + start // row * cloned.stride[0],
            ((stop - start) // row, *cloned.size[1:]),
            cloned.stride,
            cloned.dtype,
        )
    for index, span in partial.items():
        if span.start >= start and span.stop <= stop:
            continue
        if span.stop <= start or span.start >= stop or not span:
            roles[index] = Role.OUTSIDE
            continue
        return None  # straddles the window's edge
    if rng.PAIRS in kinds.values():
        segments = (range(start, stop),)  # the scalar path's cached normal: drawn from the window's start
    landing: tuple[tuple[int, Layout], ...] = ()
    if concatenated is not None:
        landing = _cat_parts(*concatenated, segments, start)
        if not landing or len(landing) > _MOST_RUNS:
            return None
    return Window(
        storage, whole.dtype, start, stop, roles, indices[-1], segments=segments, source=source, parts=landing
    )


def _gap_drawn(dtype: torch.dtype) -> int:
    """The longest gap, in elements, between two parts of a window that a random fill draws through rather than
    jumps (Note [A window drawn as runs]): what a jump costs, in outputs (``rng.JUMP_COST``), over the outputs an
    element takes (two for float64, one for narrower floats; fills that take more per element draw through a little
    more than they could jump)."""
    return rng.JUMP_COST // (2 if dtype == torch.float64 else 1)


def _merged(runs: list[range], gap: int) -> tuple[range, ...]:
    """The non-empty ``runs`` sorted, those that overlap or lie at most ``gap`` elements apart joined."""
    joined: list[range] = []
    for run in sorted((run for run in runs if run), key=lambda run: run.start):
        if joined and run.start - joined[-1].stop <= gap:
            if run.stop > joined[-1].stop:
                joined[-1] = range(joined[-1].start, run.stop)
        else:
            joined.append(run)
    return tuple(joined)


_MOST_RUNS = 1 << 16  # a layout of more runs than this (after joining) is taken as its span: drawn through


def _runs(layout: Layout) -> list[range]:
    """The elements of its storage ``layout`` reads, as runs of adjacent elements, those at most ``_gap_drawn``
    apart joined (so, for most layouts, one run: its span)."""
    span = layout.span
    if len(span) == math.prod(layout.size) or any(stride < 0 for stride in layout.stride):
        return [span] if span else []  # dense (most layouts): one run
    gap = _gap_drawn(layout.dtype)
    dims = sorted(((stride, size) for size, stride in zip(layout.size, layout.stride, strict=True) if size > 1))
    runs = [range(1)]  # relative to the layout's offset, from the innermost dimension out
    for stride, size in dims:
        if len(runs) == 1 and stride - runs[0].stop <= gap:  # its copies touch or draw through: one run
            runs = [range((size - 1) * stride + runs[0].stop)]
            continue
        if len(runs) * size > _MOST_RUNS:
            return [span]
        runs = list(
            _merged([range(run.start + i * stride, run.stop + i * stride) for i in range(size) for run in runs], gap)
        )
    return [range(span.start + run.start, span.start + run.stop) for run in runs]


def _covered(spans: Sequence[range], elements: int) -> bool:
    """Whether the hull of ``spans`` covers elements ``0:elements`` (a window of it would be all of it)."""
    start, stop = _hull(spans) or (0, 0)
    return start <= 0 and stop >= elements


def _hull(spans: Sequence[range]) -> tuple[int, int] | None:
    """The first and last element + 1 of the non-empty ``spans`` (which lie within their storage), if any."""
    hull = None
    for span in spans:
        if span:
            hull = (span.start, span.stop) if hull is None else (min(hull[0], span.start), max(hull[1], span.stop))
    return hull


def _created(op: Op, storage: int, layouts: Mapping[int, Layout], *, like: bool = False) -> Layout | None:
    """The layout of the whole storage if ``op`` is a factory that made it, contiguous from its start: a creator
    (which a window can run on its own size), or with ``like``, ``empty_like`` too."""
    if len(op.out_refs) != 1 or not (facts_of(op.func).creator or (like and op.func is aten.empty_like.default)):
        return None
    for slot in op.slots:
        if slot.storage == storage:
            return None
    ref = op.out_refs[0]
    layout = layouts.get(ref) if ref is not None else None
    if layout is None or layout.storage != storage or layout.offset != 0 or not _contiguous(layout):
        return None
    if op.device is None or op.device.type != "cpu":
        return None
    return layout


def _cloned(op: Op, storage: int, layouts: Mapping[int, Layout]) -> tuple[Layout, Layout] | None:
    """The layouts of the whole storage and of the view ``op`` copied into it if ``op`` is a ``clone`` that made
    ``storage`` whole, contiguous from its start, of another storage's elements in the same dtype and sizes
    (``distribute_tensor``'s local shard, which FSDP2 then cuts): a window of it is a copy of a narrowed view."""
    if op.func is not aten.clone.default or len(op.slots) != 1 or op.constant_slots or len(op.out_refs) != 1:
        return None
    (source,) = op.slots
    ref = op.out_refs[0]
    made = layouts.get(ref) if ref is not None else None
    read = layouts.get(source.ref)
    if made is None or read is None or made.storage != storage or not source.laid:
        return None
    if made.offset != 0 or not _contiguous(made) or not _rows_copied(made, read):
        return None
    if op.device is None or op.device.type != "cpu" or source.written or op.writes:
        return None
    return made, read


def _rows_copied(made: Layout, read: Layout) -> bool:
    """Whether ``read``, a view of another storage than ``made``'s, copied into all of ``made``, gives each of its
    rows from a row of the view of the same sizes and dtype, found by its offset (an expanded dim 0 has none)."""
    return (
        read.storage != made.storage
        and read.size == made.size
        and read.dtype == made.dtype
        and bool(read.size)
        and read.stride[0] > 0
    )


def _copied_whole(
    ops: Sequence[Op], indices: Sequence[int], storage: int, layouts: Mapping[int, Layout], at: int | None
) -> tuple[int, Layout, Layout] | None:
    """Where in ``indices`` (the operations touching ``storage``) a ``copy_`` writes all of ``storage`` from a view
    of another storage of the same sizes and dtype, when the first of them made it whole, contiguous from its start,
    with values nothing reads (a factory: a creator, or ``empty_like``, which is all a scatter's output is), and
    those in between only read its metadata; with the layouts of the whole storage and of the view copied. To a
    window the copy is a ``clone`` of that view, and the factory's memory is never made. Else None. ``at``: where
    the first ``copy_`` into ``storage`` is, if only metadata reads come before it (``_first_copy_into``)."""
    if at is None:
        return None
    made = _created(ops[indices[0]], storage, layouts, like=True)
    if made is None:
        return None
    op = ops[indices[at]]
    if len(op.slots) != 2 or op.constant_slots or op.writes != {storage} or op.out_refs != (op.slots[0].ref,):
        return None
    target, source = op.slots
    if target.index != 0 or target.storage != storage or not target.written or not _laid_out(target, made.dtype):
        return None
    if layouts.get(target.ref) != made or source.storage == storage or source.written or not source.laid:
        return None  # the copy writes other than all of what the factory made
    read = layouts.get(source.ref)
    if read is None or not _rows_copied(made, read):
        return None
    return at, made, read


def _catted(op: Op, storage: int, layouts: Mapping[int, Layout]) -> tuple[Layout, int, list[Layout]] | None:
    """The layouts of the whole storage, the dimension and the layouts of the inputs, if ``op`` is a ``cat`` that
    made ``storage`` whole, contiguous from its start, of contiguous tensors of other storages in its dtype (the
    views of q, k and v that torchtitan's fused ``wqkv`` is copied from): each run of its elements within one slice
    of that dimension is a run of one input's, so a window of it is copied from runs of its inputs. Else None."""
    if op.func is not aten.cat.default or op.constant_slots or len(op.out_refs) != 1 or op.writes:
        return None
    if op.device is None or op.device.type != "cpu":
        return None
    ref = op.out_refs[0]
    made = layouts.get(ref) if ref is not None else None
    if made is None or made.storage != storage or made.offset != 0 or not made.size or not _contiguous(made):
        return None
    inputs: list[Layout] = []
    for slot in sorted(op.slots, key=lambda slot: slot.index):  # the list's tensors, in order
        read = layouts.get(slot.ref)
        if read is None or slot.storage == storage or slot.written or not _laid_out(slot, made.dtype):
            return None
        if len(read.size) != len(made.size) or not _contiguous(read):
            return None
        inputs.append(read)
    args, kwargs = op.arguments({}, None)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if type(dim) is not int or not inputs:
        return None
    dim %= len(made.size)
    if sum(read.size[dim] for read in inputs) != made.size[dim]:
        return None
    if any(read.size[:dim] != made.size[:dim] or read.size[dim + 1 :] != made.size[dim + 1 :] for read in inputs):
        return None
    return made, dim, inputs


def _cat_parts(
    made: Layout, dim: int, inputs: Sequence[Layout], segments: Sequence[range], start: int
) -> tuple[tuple[int, Layout], ...]:
    """Where each run of an input that the elements ``segments`` of a ``cat`` of ``inputs`` along ``dim`` come
    from lands in a window beginning at element ``start``: the element of the window, and the run."""
    inner = math.prod(made.size[dim + 1 :])  # the elements of one slice of `dim`: a run of one input
    across = made.size[dim]
    firsts = [0]
    for read in inputs:
        firsts.append(firsts[-1] + read.size[dim])
    parts: list[tuple[int, Layout]] = []
    for segment in segments:
        position = segment.start
        while position < segment.stop:
            row, within = divmod(position, inner)
            outer, index = divmod(row, across)
            which = next(j for j, read in enumerate(inputs) if firsts[j] <= index < firsts[j + 1])
            read = inputs[which]
            # the rest of this input's slices within `outer` are adjacent, in its memory as in the result's
            length = min(segment.stop - position, (firsts[which + 1] - index) * inner - within)
            first = read.offset + (outer * read.size[dim] + index - firsts[which]) * inner + within
            parts.append((position - start, Layout(read.storage, first, (length,), (1,), read.dtype)))
            position += length
    return tuple(parts)


def _first_copy_into(ops: Sequence[Op], indices: Sequence[int], storage: int) -> int | None:
    """Where in ``indices`` (the operations touching ``storage``) the first ``copy_`` into ``storage`` is, when only
    metadata reads come before it after the first operation; else None."""
    for at in range(1, len(indices)):
        op = ops[indices[at]]
        if op.func is aten.copy_.default and storage in op.writes:
            return at
        facts = facts_of(op.func) if isinstance(op.func, OpOverload) else None
        if facts is None or not (facts.metadata_read or facts.geometry_read) or storage in op.results.storages:
            return None  # anything else on the storage before the copy: a view, a read, a write
    return None


def _copies_of(window: Window) -> list[int]:
    """The operations that copied ``window``'s elements from parts of other storages (a CLONE, a CAT): one, or
    none."""
    return [index for index, role in window.roles.items() if role in (Role.CLONE, Role.CAT)]


def _laid_out(slot: Slot, dtype: torch.dtype) -> bool:
    """Whether a tensor given to an operation sits where its ref's layout says (``Slot.laid``), in ``dtype``."""
    return slot.laid and slot.dtype == dtype


def _contiguous(layout: Layout) -> bool:
    """Whether ``layout`` is row-major contiguous (the strides of dimensions of size 1 aside)."""
    return _contiguous_geometry(layout.size, layout.stride)


@functools.lru_cache(maxsize=1024)  # a model's layers repeat a few geometries; torch's strides are Python
def _contiguous_geometry(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = contiguous_strides(sizes)
    return all(size == 1 or got == want for size, got, want in zip(sizes, strides, expected, strict=True))


# --- running ---------------------------------------------------------------------------------------------------------


def window_arguments(op: Op, windows: Mapping[int, Window], env: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The tensors to call ``op`` with, by position: ``env``'s, and for a ref on a window that ``env`` lacks (one
    that spans more than the window, which only metadata reads are given), a stand-in of its dtype and device, and
    for an operation that reads its geometry, of its sizes and strides too (never written, never read)."""
    tensors = {}
    for slot in op.slots:
        found = env.get(slot.ref)
        if found is None and facts_of(op.func).geometry_read:
            found = torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype, device="cpu")
        tensors[slot.index] = windows[slot.storage].stand_in() if found is None else found
    return tensors


def create(op: Op, window: Window, arguments: tuple[Any, Any]) -> None:
    """Make the factory ``op`` the window's creator, run with the window's size instead of the whole storage's."""
    args, kwargs = arguments
    assert isinstance(op.func, OpOverload)
    flat_args = list(args)
    length = window.stop - window.start
    for position, name in enumerate(operator_arguments(op.func)):
        value: object
        if name == "size":
            value = [length]
        elif name == "stride":
            value = [1]
        elif name == "memory_format":
            value = None
        else:
            continue
        if position < len(flat_args):
            flat_args[position] = value
        elif name in kwargs:
            kwargs[name] = value

    def make() -> torch.Tensor:
        made = op.func(*flat_args, **kwargs)
        assert isinstance(made, torch.Tensor)
        assert made.numel() == length
        return made

    window.make = make


def _prepare(
    ops: list[Op],
    windows: Mapping[int, Window],
    factories: Mapping[int, OpOverload],
    device: torch.device | None,
    copies: Copies,
) -> None:
    """Give each host its factory, to run whenever it is first needed: ``factories`` holds the factories to run
    instead of those recorded (``new_empty`` for a ``new_zeros`` whose zeros nothing reads)."""
    for window in windows.values():
        if window.host is not None and window.host.factory is not None:
            op = ops[window.host.factory]
            window.host.make = functools.partial(
                _run_factory, op, factories.get(window.host.factory), windows, device, copies
            )


def _run_factory(
    op: Op, func: OpOverload | None, windows: Mapping[int, Window], device: torch.device | None, copies: Copies
) -> torch.Tensor:
    """A host's factory, run with stand-ins for the window it reads the dtype and device of (its dtype is in its
    arguments: see Note [The default dtype is passed, never set] in record)."""
    args, kwargs = op.arguments(window_arguments(op, windows, {}), device, copies=copies)
    made = (func or op.func)(*args, **kwargs)
    assert isinstance(made, torch.Tensor)
    return made


def _run(plan: Plan, op: Op, index: int, on: list[Window], env: dict[int, torch.Tensor], wanted: set[int]) -> bool:
    """``Plan.run`` of the kept operation ``op`` (at ``index``) on the windows ``on`` that it has a role in."""
    windows, layouts, device, copies = plan.windows, plan.record.layouts, plan.device, plan.copies
    roles = {on[0].roles[index]} if len(on) == 1 else {window.roles[index] for window in on}
    if Role.VIEW in roles:
        (window,) = on
        start, stop = window.start, window.stop
        for ref in wanted.intersection(op.out_refs):  # of a split's N results, this rank's
            layout = layouts[ref]
            span = layout.span
            if not span or (span.start >= start and span.stop <= stop):
                env[ref] = window.view(layout)
        return True
    if Role.OUTSIDE in roles or Role.COPIED in roles:
        return True
    if Role.HOST in roles:
        (window,) = on
        assert window.host is not None
        (host,) = op.out_refs
        if host is not None and host in wanted:
            env[host] = window.host.whole()
        return True
    if Role.DRAW in roles:
        (window,) = on
        if len(window.segments) <= 1 or window.host is not None:
            window.filled(plan.walk.draw_part(index, window.start, window.stop, out=window.destination()))
        else:  # Note [A window drawn as runs]
            plan.walk.draw_runs(index, window.segments, window.memory(), window.start)
        return True
    if Role.CLONE in roles:
        made = next(window for window in on if window.roles[index] == Role.CLONE)
        assert made.source is not None
        slot = op.slots[-1]  # what it copies: a clone's only tensor, a copy_'s source
        copied = windows.get(slot.storage)
        if copied is not None:
            part = copied.view(made.source)
        else:  # its source is made whole: the rows of its view that the window holds
            read = layouts[slot.ref]
            part = env[slot.ref].narrow(0, (made.source.offset - read.offset) // read.stride[0], made.source.size[0])
        if made.host is None:
            made.tensor = aten.clone.default(part, memory_format=torch.contiguous_format).view(-1)
        else:  # copied straight into its part of the host, where the copy into the host would put it
            made.memory().view(part.shape).copy_(part)
        return True
    if Role.CAT in roles:
        made = next(window for window in on if window.roles[index] == Role.CAT)
        memory = made.tensor = torch.empty(made.stop - made.start, dtype=made.dtype, device="cpu")
        for at, run in made.parts:
            inside = windows.get(run.storage)
            if inside is not None:
                piece = inside.view(run)
            else:  # made whole: the run of the input's own tensor
                given = next(slot for slot in op.slots if slot.storage == run.storage)
                tensor, read = env[given.ref], layouts[given.ref]
                piece = tensor.as_strided(run.size, run.stride, tensor.storage_offset() + run.offset - read.offset)
            memory[at : at + run.size[0]].copy_(piece)
        return True
    if Role.ELEMENTWISE in roles:
        (window,) = on
        (slot,) = op.slots
        written = env.get(slot.ref)  # a part of it, made by a view
        if written is None:
            written = window.memory()  # all of it
        args, kwargs = op.arguments({slot.index: written}, device, copies=copies)
        op.func(*args, **kwargs)
        return True
    if Role.CREATE in roles:
        made = next(window for window in on if window.roles[index] == Role.CREATE)
        # Else the window is its host's memory (see memory), or a later copy of all of it from a view makes it.
        if made.source is None and (made.host is None or made.creator_read):
            create(op, made, op.arguments(window_arguments(op, windows, env), device, copies=copies))
            if made.host is not None:  # its fill, written where the window lies in its host
                fill, made.make = made.make, None
                assert fill is not None
                made.memory().copy_(fill())
        return True
    return False
