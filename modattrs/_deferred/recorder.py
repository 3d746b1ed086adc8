"""The recorder behind :mod:`modattrs.deferred`: a fake tensor mode that writes down every operation on its tensors
into a record (``record``).

Identity. A tensor is known by where its data would live: (storage, offset, sizes, strides, dtype, conj and neg
bits). Python objects and tensor impls are no good as keys, because ``nn.Parameter(t)``, ``t.data`` and
``p.data = t`` make or rewire them without an operation that a mode could see; all three keep storage and
geometry, though. Every storage the record has seen is kept alive (a fake storage holds no data), so no two
storages ever share an address.

Random numbers. Fake tensors draw nothing, so the real generators stay where they were while recording; what each
random operation would have drawn is worked out at replay (``replay``, ``rng``). A draw from the default
CPU generator notes what ``rng`` says about where eager code would have the generator. A
``torch.Generator`` passed explicitly is advanced for real, on a scratch tensor, and its state before each operation
is kept, so replays use it in constant time and the object ends where eager code leaves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from modattrs._compiled import install_dispatch_entry
from modattrs._deferred import rng
from modattrs._deferred.ops import OpFacts, facts_of
from modattrs._deferred.record import (
    LEAF_TYPES,
    NO_RESULTS,
    Constant,
    DeferredInitError,
    Draws,
    Key,
    Layout,
    Op,
    Plain,
    Position,
    Record,
    Results,
    Slot,
    draws_on_cpu,
    plain_call,
    results_of,
    scratch_arguments,
    snapshot,
    span_bytes,
)
from modattrs._fake import cuda_guard
from modattrs._fake.mode import CONSTANT_LIMIT, ModattrsFakeTensorMode
from modattrs._names import callable_name, where
from modattrs._torch_private import (
    TRUNC_NORMAL_HELPER,
    DataDependentOutputException,
    DisableTorchDispatch,
    DisableTorchFunction,
    DynamicOutputShapeException,
    FakeTensor,
    OpOverload,
    TreeSpec,
    UnsupportedFakeTensorException,
    UnsupportedOperatorException,
    address_of,
    disable_current_modes,
    forget_fakes,
    operator_arguments,
    tree_flatten,
    tree_unflatten,
    version_of,
    view_base_of,
)

__all__: list[str] = []


class RecordingFakeTensorMode(ModattrsFakeTensorMode):  # type: ignore[no-untyped-call]
    """modattrs' fake tensor mode, writing every operation on its tensors into a :class:`Record`.

    The mode records for as long as its tensors live, inside ``deferred_init`` and after it: conversions
    (``.half()``, ``.to()``) and in-place initialization done later are part of the record, so materializing
    honours them.
    """

    values_from = "materialize it first (modattrs.deferred.materialize_module): its values are eager construction's"

    def __init__(self, record: Record, make_fake_cuda_possible: Callable[[], None]) -> None:
        """``make_fake_cuda_possible`` is called when a recorded operation asks for CUDA before fake CUDA is set up
        (``_torch_changes.install_fake_cuda``, which the public face passes: engines change nothing in torch)."""
        super().__init__()
        self.record = record
        self._make_fake_cuda_possible = make_fake_cuda_possible
        self._depth = threading.local()  # the mode calls itself for decompositions: only the outer call counts
        # The real tensors handed to deferred_init, while it records, for messages: by id, and by storage for the
        # tensors sharing their memory (``nn.Parameter(given)``). Dropped after: ids and addresses get reused.
        self._handed: dict[int, _Real] = {}
        self._handed_memory: dict[int, _Real] = {}
        # Storages of fake tensors that view real ones (``given.view(2, 2)``), with the real tensor: a write through
        # one of them would change the real tensor in eager code, so it is refused, naming the real tensor.
        self._real_views: dict[int, _Real] = {}
        # By the address of each fake tensor a view operation made: the address of the tensor it was made from (see
        # Note [A view holds what it was made from]).
        self._view_sources: dict[int, int] = {}
        # The copies of real tensors that recorded operations read, by where the tensor's data is (see Note [Real
        # tensors are read when recorded]).
        self._snapshots: dict[tuple[object, ...], torch.Tensor] = {}
        # Views not written down yet, by the key of what each made (see Note [Views written down when used]).
        self._unwritten_views: dict[Key, _UnwrittenView] = {}
        self._placeholder: FakeTensor | None = None  # see _argument_placeholder

    def _fake_cuda_for(self, func: Callable[..., Any]) -> None:
        """A record that asks for CUDA on a build of torch without it gets fake CUDA, as torchdistx's did: what
        ``fake_mode(fake_cuda=True)`` sets up."""
        try:
            self._make_fake_cuda_possible()
        except RuntimeError as error:
            raise DeferredInitError(
                f"{callable_name(func)} asks for a CUDA device, which this build of torch lacks: deferred_init makes "
                f"fake CUDA tensors then, and cannot here.\nwhere: {where()}\n{error}\n"
                "Or build the module for the CPU: materialized, its values are those of eager construction on the CPU "
                "either way"
            ) from error

    def moving_to_cuda(self, func: Callable[..., Any]) -> None:
        """A deferred tensor moved to CUDA (``model.to("cuda")``) gets fake CUDA, as a recorded operation asking for
        CUDA does: set up before torch's binding asks torch.cuda to initialize, which would fail."""
        self._fake_cuda_for(func)

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
        # A detach, or a slice keeping all of a tensor (three of FSDP2's seven operations on each parameter), is its
        # argument to the record (Note [Views that are their argument]): nothing to look up or write down.
        alias = self.whole_alias(func, args, kwargs)
        if alias is not None:
            with rng.lock:
                self._view_sources[address_of(alias)] = address_of(args[0])
            return alias
        kwargs = kwargs or {}
        facts = facts_of(func)
        with rng.lock:
            # A view of one fake tensor given nothing else but plain values (a detach, a narrow, a split: most of
            # FSDP2's cutting) is known by its argument's key alone until it runs: its result may be that argument
            # (Note [Views that are their argument]), which the record does not write down, so the rest of what an
            # operation's entry needs is worked out after it ran, and only if it is written down. A view writes
            # nothing, so its arguments are the same after it as before.
            viewed = _viewed_alone(facts, args, kwargs)
            pending = None
            if viewed is None:
                mutated = _mutated_arguments(facts, args, kwargs)
                if mutated and not facts.value_writer and self._unwritten_views:
                    self._write_views()  # it may move a viewed tensor in place: see Note [Views written down when used]
                pending = self._begin(func, facts, args, kwargs, mutated, random=facts.random)
            else:
                viewed_ref, viewed_key = self._ref_of(viewed, func)
            self._depth.n = 1
            needs_values = False
            try:
                result = super().__torch_dispatch__(func, types, args, kwargs)
            except (DataDependentOutputException, DynamicOutputShapeException):
                # Raised below, unchained: torch's exception and its frames would keep the views that the code
                # reading values made (tolist's rows) alive, and materializing, as the message says, refuses a
                # tensor that views hold.
                needs_values = True
            except (UnsupportedFakeTensorException, UnsupportedOperatorException) as error:
                if isinstance(func, OpOverload) and func.namespace == "c10d":
                    raise DeferredInitError(
                        f"{callable_name(func)} is a collective that would send data between ranks while deferred, "
                        f"and this torch cannot run it on fake tensors.\nwhere: {where()}\n"
                        "distribute_tensor and parallelize_module send rank 0's values unless given "
                        "src_data_rank=None.\n"
                        "Pass src_data_rank=None to parallelize_module or distribute_tensor: every rank's deferred "
                        "module holds the same values, so each rank cuts its own part without communication.\n"
                        "Or materialize_module first, then parallelize"
                    ) from error
                raise DeferredInitError(
                    f"{callable_name(func)} cannot run on fake tensors, and deferred_init records on fake tensors.\n"
                    f"where: {where()}\nreason: {error}\n"
                    "Build this part outside deferred_init and hand it in real"
                ) from error
            finally:
                self._depth.n = 0
            if needs_values:
                raise _needs_values(callable_name(func))
            if facts.view and args and isinstance(args[0], FakeTensor):
                source = address_of(args[0])
                leaves = _leaves(result)
                view_sources = self._view_sources
                for leaf in leaves:
                    if isinstance(leaf, FakeTensor):
                        view_sources[address_of(leaf)] = source
            result_key = None
            if viewed is not None:
                if type(result) is FakeTensor and result.layout is torch.strided:
                    result_key = self._key_of(result)
                    if result_key == viewed_key:
                        return result  # see Note [Views that are their argument]
                    if not facts.random:  # see Note [Views written down when used]
                        # (the first view of a key stays: a later one makes the same tensor, to the record)
                        unwritten = _UnwrittenView(
                            func, facts, args[1:], kwargs, (viewed_ref, viewed_key, viewed.device)
                        )
                        self._unwritten_views.setdefault(result_key, unwritten)
                        return result
                pending = self._begin(func, facts, args, kwargs, (), random=facts.random)
            assert pending is not None
            self._finish(pending, result, result_key)
        return result

    @contextlib.contextmanager
    def handed(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> Iterator[None]:
        """Name the real tensors handed to ``deferred_init`` in messages while it records, each by where it is in
        the arguments (``given``, ``layers[0]``, ``backbone.weight``)."""
        for name, tensor in tensors:
            if tensor.layout is not torch.strided:  # refused when used, and without a storage to key it by
                continue
            real = _Real(f"deferred_init's argument {name!r} ({tuple(tensor.shape)}, {tensor.dtype})", name)
            self._handed.setdefault(id(tensor), real)
            self._handed_memory.setdefault(address_of(tensor.untyped_storage()), real)
        try:
            yield
        finally:
            self._handed.clear()
            self._handed_memory.clear()

    def opaque_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], target: FakeTensor
    ) -> FakeTensor:
        """Record ``func(*args, **kwargs)`` as one call that writes ``target`` in place, without running it (a
        constant it writes forgets its values, as in fake mode)."""
        with rng.lock:
            pending = self._begin(func, facts_of(func), args, kwargs, (target,), random=True)
            self._finish(pending, target)
        return super().opaque_call(func, args, kwargs, target)

    def note_generator(self) -> None:
        """Record where the default CPU generator is if it moved since the last draw (a reseed at the end of
        construction), so that a full replay leaves it there."""
        with rng.lock:
            reset = rng.reset_before_draw(self.record)
            if reset is None:
                return
            self._append(_made_here(_no_draw, (), device=torch.device("cpu"), draws=Draws.DEFAULT, reset=reset))
            rng.drew(self.record)

    def ref_and_storage_of(self, tensor: FakeTensor) -> tuple[int | None, int]:
        """The record's name for ``tensor`` (None if the record cannot account for it), and its storage."""
        with rng.lock:
            key = self._key_of(tensor)
            if key in self._unwritten_views:
                self._write_view(key, tensor)
            return self.record.keys.get(key), key[0]

    def made_through(self, view: FakeTensor) -> list[int]:
        """The addresses of the views ``view`` was made through, from the last to the first: the tensors between its
        base and it, which it holds (see Note [A view holds what it was made from]). Empty for a view of its base, or
        where the record does not know."""
        base = view_base_of(view)
        if base is None:
            return []
        root = address_of(base)
        chain: list[int] = []
        with rng.lock:
            source = self._view_sources.get(address_of(view))
            while source is not None and source != root and source not in chain:
                chain.append(source)
                source = self._view_sources.get(source)
        return chain if source == root else []

    def storage_of(self, tensor: FakeTensor) -> int:
        with rng.lock:
            return self._storage_of(tensor)

    def ref_storage_or_view(self, tensor: FakeTensor) -> tuple[int | None, int, bool]:
        """``ref_and_storage_of``, but for a tensor known by a view not written down yet (Note [Views written down
        when used]): that view is left as it is, and the ref is None; with whether it is such a view."""
        with rng.lock:
            key = self._key_of(tensor)
            if key in self._unwritten_views:
                return None, key[0], True
            return self.record.keys.get(key), key[0], False

    def forget(self, tensors: Iterable[FakeTensor]) -> None:
        """Drop the weak references torch's fake tensor machinery keeps to ``tensors`` (the memo of fakes made from
        real tensors, and of constants), which ``torch.utils.swap_tensors`` would refuse."""
        forget_fakes(self, tensors)

    # --- recording --------------------------------------------------------------------------------------------------

    def _write_view(self, key: Key, tensor: FakeTensor) -> None:
        """Write down the view that made the tensor known by ``key``, which ``tensor`` has: it is being used (see
        Note [Views written down when used]).

        Note [Views written down when used]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        A view of one fake tensor given plain values (a ``narrow``, a ``view``: most of what FSDP2 does to a
        parameter) reads no values, writes nothing and draws nothing: what it makes is its argument's ref seen
        through its geometry, whenever that is worked out. So it is written down when something needs its result's
        ref: an operation given a tensor of its key, or a question about one (``ref_and_storage_of``: materializing,
        is it deferred). One that nothing uses is never written down: FSDP2 cuts a chunk of each parameter for its
        size alone (its post-forward metadata), and every replay would make it, and every pass over the record
        step over it. Written later than it ran, it is written before its first use, which is all that orders a
        view: its values are its argument's when they are read. Its argument is noted as it was (its ref, key and
        device), as ``.data =`` moves a tensor without an operation. What else could change what it makes is its
        argument moving in place (``t_``, ``set_``, ``resize_``: see ``_keep_place``), so before an operation that
        writes a tensor and is no value writer, every view not written down yet is, those whose results are gone
        too: a tensor can take their key without an operation (``.data =``, ``swap_tensors``), so a view not
        written down is never forgotten.
        """
        self._write_down(self._unwritten_views.pop(key), key, tensor)

    def _write_views(self) -> None:
        """Write down every view not written down yet, in the order they ran, each for a stand-in of its result (see
        ``_UnwrittenView``): the record knows a result by its key."""
        views, self._unwritten_views = self._unwritten_views, {}
        for key, view in views.items():
            self._write_down(view, key, self._stand_in(key, view.viewed[2]))

    def _write_down(self, view: _UnwrittenView, key: Key, result: FakeTensor) -> None:
        """Append the operation ``view`` was, whose result ``result`` is known by ``key``: the entry ``_begin`` and
        ``_finish`` make of a view of one fake tensor given plain values (``_viewed_alone``), made directly. Its one
        tensor argument is ``view.viewed``. It writes, draws and reads nothing, and reads no default dtype (its
        result has its argument's dtype, or one it is given: ``view(torch.int32)``). Its one result is new to the
        record (a view that made its argument's key was not left unwritten), on its argument's storage."""
        ref, viewed_key, device = view.viewed
        args = (self._argument_placeholder(), *view.rest)
        plain = plain_call(args, view.kwargs)
        leaves, spec = _flattened(args, view.kwargs, plain)
        laid = _is_laid(self.record.layouts.get(ref), viewed_key)
        slot = Slot(0, ref, viewed_key[0], viewed_key[2], viewed_key[3], viewed_key[4], device, False, laid)
        made = self._new_ref(key)
        self.record.keys[key] = made
        results = results_of(view.func, (made,), self.record.layouts)
        arguments = ([None, *leaves[1:]], spec, plain)
        op = _made_here(
            view.func, (slot,), device=result.device, out_refs=(made,), results=results, arguments=arguments
        )
        self._append(op, view.facts)

    def _argument_placeholder(self) -> FakeTensor:
        """What stands for a view's argument when it is written down (``_write_down``): the record takes the
        argument's ref, key and device from ``_UnwrittenView.viewed``, and only needs a fake tensor in its place. One
        per mode, never a result: results are told apart from arguments by identity (``_Pending.arg_refs``)."""
        placeholder = self._placeholder
        if placeholder is None:
            key: Key = (0, 0, (), (), torch.float32, False, False)
            placeholder = self._placeholder = self._stand_in(key, torch.device("cpu"))
        return placeholder

    def _stand_in(self, key: Key, device: torch.device) -> FakeTensor:
        """A fresh fake tensor of ``key``'s sizes, strides and dtype on ``device``, for the record to know as the
        tensor of ``key`` (in no storage the record knows)."""
        with DisableTorchFunction(), DisableTorchDispatch():
            meta = torch.empty_strided(key[2], key[3], dtype=key[4], device="meta")
        return self._wrap(meta, device)

    def _begin(
        self,
        func: Callable[..., Any],
        facts: OpFacts,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        mutated: Sequence[torch.Tensor],
        *,
        random: bool,
        first: tuple[int, Key, torch.device] | None = None,
    ) -> _Pending:
        """``first``: the ref, key and device of the first argument, a fake tensor, when the view operation was
        given it (Note [Views written down when used]): it may have moved since without an operation (``.data =``)."""
        plain = plain_call(args, kwargs)
        originals, spec = _flattened(args, kwargs, plain)
        flat = list(originals)
        written = {id(t) for t in mutated}
        slots: list[Slot] = []
        constant_slots: list[Constant] = []
        device_slots: list[int] = []
        generators: list[tuple[int, torch.Generator]] = []
        keys: list[Key] = []
        for position, value in enumerate(originals):
            if type(value) in _NUMBERS_AND_NAMES:  # most arguments: sizes, dims, dtypes
                continue
            if isinstance(value, (torch.UntypedStorage, torch.TypedStorage)) or (
                isinstance(value, torch.Tensor) and value.layout is not torch.strided
            ):
                raise DeferredInitError(
                    f"{callable_name(func)} was given a {type(value).__name__}, and deferred_init records strided "
                    f"tensors only.\nwhere: {where()}\n"
                    "It records no storages (set_ with a storage) and no sparse tensors.\n"
                    "Do this after materialize_module"
                )
            if isinstance(value, FakeTensor):
                ref, key = self._ref_of(value, func) if first is None or position else first[:2]
                storage = key[0]
                keys.append(key)
                size, stride, dtype = key[2], key[3], key[4]  # the key holds them
                laid = _is_laid(self.record.layouts.get(ref), key)
                written_here = id(value) in written
                device = value.device if first is None or position else first[2]
                slots.append(Slot(position, ref, storage, size, stride, dtype, device, written_here, laid))
                flat[position] = None
            elif isinstance(value, torch.Tensor):  # a real tensor from outside (torch.tensor(...), a loaded weight)
                if id(value) in written:
                    # Read-only while recorded: eager code would change it, and fake tensors have no values to write.
                    raise _writes_real(func, self._real(value))
                constant_slots.append(self._constant(func, position, value))
                flat[position] = None
            elif isinstance(value, torch.device):
                device_slots.append(position)
                if value.type == "cuda" and not cuda_guard.ready():
                    self._fake_cuda_for(func)
            elif isinstance(value, torch.Generator) and not _is_default(value):
                generators.append((position, value))
        # Nor through a fake view of a real tensor.
        for slot in slots:
            if slot.written and slot.storage in self._real_views:
                real = self._real_views[slot.storage]
                raise _writes_real(func, real._replace(text=f"a view of {real.text}"))
        viewed = None
        if facts.view and not facts.lift and constant_slots:
            viewed = next((self._real(c.tensor) for c in constant_slots if c.index == 0), None)
        draws = Draws.NONE if not random else Draws.EXPLICIT if generators else Draws.DEFAULT
        value_writer = facts.value_writer
        return _Pending(
            func=func,
            facts=facts,
            flat=flat,
            spec=spec,
            plain=plain,
            slots=tuple(slots),
            constant_slots=tuple(constant_slots),
            device_slots=tuple(device_slots),
            generators=tuple(generators),
            draws=draws,
            mutated=written,
            arg_refs={id(originals[slot.index]): slot.ref for slot in slots},
            keys=tuple(keys),
            written_fakes=tuple(
                (slot, key, originals[slot.index]) for slot, key in zip(slots, keys, strict=True) if slot.written
            ),
            value_writer=value_writer,
            overwrites=_overwritten(slots, originals) if value_writer else frozenset(),
            viewed=viewed,
        )

    def _same_tensor(self, pending: _Pending, result: Any, result_key: Key | None) -> bool:
        """Whether ``result`` is, to the record, the one fake tensor its view operation was given: in the same
        place, with the same geometry (``detach``, ``alias``, a ``view`` to the same sizes).

        Note [Views that are their argument]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
        The record knows a tensor by where its data lives (the module's docstring), so such a result is its argument:
        it has the argument's ref already, and a replay would make it as an alias of the argument's real tensor,
        which stands for it as well. Such operations are not written down: ``nn.Parameter`` detaches each weight,
        ``fully_shard`` each shard and takes all of an even one (two fifths of the operations of a model sharded over
        64 ranks), and every replay would run them, and each pass over the record step over them. A detach, and a
        slice that keeps all of its tensor, are known to be such before they run: they are made first thing in
        ``__torch_dispatch__`` (``whole_alias``), with no key worked out and nothing looked up.
        """
        if not pending.facts.view or len(pending.keys) != 1 or pending.constant_slots:
            return False
        if pending.mutated or pending.draws is not Draws.NONE or pending.device_slots:
            return False
        if result_key is not None:  # worked out by the caller, for ``result``
            return result_key == pending.keys[0]
        return (
            isinstance(result, FakeTensor)
            and result.layout is torch.strided
            and self._key_of(result) == pending.keys[0]
        )

    def _keep_place(self, slot: Slot, key: Key) -> None:
        """Before an operation moves the fake tensor of ``slot`` in place (``unsqueeze_``, ``t_``, ``resize_``,
        ``set_``), record an alias of it where it is (``key``), under a ref of its own: the tensors it was, to the
        record, stay there (a ``detach`` of it made earlier, a view that was its argument: see Note [Views that are
        their argument]), and name that ref from now on, as eager code's still see the old place."""
        ref = self._new_ref(key)
        self.record.keys[key] = ref
        viewed = dataclasses.replace(slot, index=0, written=False)
        alias, made = torch.ops.aten.alias.default, (ref,)
        results = results_of(alias, made, self.record.layouts)
        self._append(_made_here(alias, (viewed,), device=slot.device, out_refs=made, results=results))

    def _constant(self, func: Callable[..., Any], position: int, tensor: torch.Tensor) -> Constant:
        """The record's note of a real tensor given to ``func``: a copy of its values now, or, given to a view
        operation, the tensor itself and the bytes it spans now (see Note [Real tensors are read when recorded])."""
        if facts_of(func).lift or tensor.is_meta:  # no other code holds the former; the latter has no values
            return Constant(position, tensor, version_of(tensor))
        with disable_current_modes(), torch.no_grad():
            if isinstance(func, OpOverload) and (func.is_view or func.overloadpacket is torch.ops.aten.set_):
                recorded = span_bytes(tensor).clone()
                return Constant(position, tensor, version_of(tensor), recorded, self._real(tensor).text)
            # Not _key_of, which keeps the storage alive: the record holds the copy, not the tensor.
            storage, bits = address_of(tensor.untyped_storage()), (tensor.is_conj(), tensor.is_neg())
            key = (storage, tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device, bits)
            copy = self._snapshots.get(key)
            # One copy for every read of the same values (a template copied into each layer); a change since, even
            # one no version counter saw, makes a new one.
            if copy is None or not torch.equal(span_bytes(tensor), span_bytes(copy)):
                copy = self._snapshots[key] = snapshot(tensor)
        return Constant(position, copy, version_of(copy))

    def _real(self, tensor: torch.Tensor) -> _Real:
        """A real tensor, for messages: the argument of deferred_init it is or shares memory with, if it is one."""
        handed = self._handed.get(id(tensor))
        if handed is not None:
            return handed
        text = f"a real tensor ({tuple(tensor.shape)}, {tensor.dtype})"
        shared = self._handed_memory.get(address_of(tensor.untyped_storage()))
        return _Real(text, None) if shared is None else _Real(f"{text} sharing memory with {shared.text}", shared.name)

    def _finish(self, pending: _Pending, result: Any, result_key: Key | None = None) -> None:
        """Name the results, then append the operation, noting what it drew from. ``result_key``: the key of
        ``result``, a fake tensor, if the caller worked it out."""
        if self._same_tensor(pending, result, result_key):
            return  # see Note [Views that are their argument]
        for slot, key, tensor in pending.written_fakes:
            if self._key_of(tensor) != key:
                self._keep_place(slot, key)
                result_key = None  # its place moved: worked out again
        out_refs, writes, device = self._name_results(pending, result, result_key)
        if pending.facts.collective:
            # c10d's schemas do not mark the tensors they fill as written: they come back as results, with their
            # argument's ref. Written they are, whatever else views their storage (a scatter into a row of a weight).
            writes = writes.union([slot.storage for slot in pending.slots if slot.ref in out_refs])
        results = results_of(pending.func, out_refs, self.record.layouts)
        promoted, reads_default_dtype = _pass_default_dtype(pending, result)
        op = Op(
            func=pending.func,
            flat=pending.flat,
            spec=pending.spec,
            plain=pending.plain,
            slots=pending.slots,
            constant_slots=pending.constant_slots,
            device_slots=pending.device_slots,
            generator_states=(),
            in_refs=frozenset(slot.ref for slot in pending.slots),
            reads=_reads(pending),
            out_refs=out_refs,
            results=results,
            writes=writes,
            value_writer=pending.value_writer,
            overwrites=pending.overwrites,
            touched=results.storages.union(writes, [slot.storage for slot in pending.slots]),
            draws=pending.draws,
            device=device,
            reset=None,
            pinned=pending.draws is Draws.DEFAULT and _reads_values(pending),
            default_dtype=torch.get_default_dtype(),
            promoted=promoted,
            reads_default_dtype=reads_default_dtype,
        )
        if pending.draws is Draws.EXPLICIT:
            if _reads_values(pending):
                raise DeferredInitError(
                    f"{callable_name(pending.func)} draws from a torch.Generator as many numbers as the values of its "
                    f"fake inputs say, which cannot be known while recording.\nwhere: {where()}\n"
                    "Draw from the default generator or do this after materialize_module"
                )
            op.generator_states = tuple((index, generator.get_state()) for index, generator in pending.generators)
            _advance(op, dict(pending.generators))  # so the generator object ends where eager code leaves it
        elif pending.draws is Draws.DEFAULT and device is not None and device.type == "cpu":
            op.reset = rng.reset_before_draw(self.record)
            self._append(op, pending.facts)
            rng.drew(self.record)
            if not recording_in_this_thread():  # initialization of a deferred module: as eager code draws, now
                rng.settle(self.record)
            return
        elif pending.draws is Draws.DEFAULT:
            op.reset = rng.reset_for_other_device(self.record)
        self._append(op, pending.facts)

    def _append(self, op: Op, facts: OpFacts | None = None) -> None:
        """Append ``op`` to the record, noting what replays would otherwise find in a pass over the record: the
        devices it names and whether it is a collective (``replay._check_devices``, ``replay._refuse_collectives``),
        whether it draws from a default generator and from a reset (``rng.Walk``), the storages it touches
        (``windows``), what it writes and returns and whether it is pinned (``slicing.slice_of``), and whether it is a
        factory that fills what it makes (``replay._dead_fills``). Each replay, and each draw recorded after
        ``deferred_init`` returned, then costs what it uses of the record, not a pass over all of it."""
        record, index = self.record, len(self.record.ops)
        facts = facts or facts_of(op.func)
        record.devices.update([slot.device for slot in op.slots])
        if op.device_slots:
            record.devices.update([op.flat[position] for position in op.device_slots])
        if facts.collective:
            record.collectives.append(index)
        if op.draws is Draws.DEFAULT:
            record.default_draws.append(index)
            on_cpu = draws_on_cpu(op, None)
            if on_cpu:
                record.cpu_draws.append(index)
            if op.reset is not None:
                record.default_resets.append(index)
                if on_cpu:
                    record.cpu_resets.append(index)
        if op.pinned:
            record.pinned.append(index)
        if facts.unfilled is not None:
            record.filling_factories.append(index)
        for storage in op.touched:
            record.touching.setdefault(storage, []).append(index)
        for storage in op.writes:
            record.writing.setdefault(storage, []).append(index)
        for ref in set(op.out_refs):
            if ref is not None:
                record.returning.setdefault(ref, []).append(index)
        record.ops.append(op)

    def _name_results(
        self, pending: _Pending, result: Any, result_key: Key | None
    ) -> tuple[tuple[int | None, ...], frozenset[int], torch.device | None]:
        """Give each fake tensor in ``result`` its ref (a new one, or its argument's if written in place), and find
        the storages written and the device the operation ran on. ``result_key``: the key of ``result``, a fake
        tensor, if the caller worked it out."""
        record = self.record
        out_refs: list[int | None] = []
        writes = {slot.storage for slot in pending.slots if slot.written}
        device: torch.device | None = None
        leaves = _leaves(result)
        # The results of one view operation of one tensor (a split's, FSDP2's chunks: as many as ranks) view its
        # storage, in its dtype and with its conjugate and negative bits: those parts of their keys are the first
        # one's, and only where each lies in the storage is asked of each.
        shared: tuple[int, torch.dtype, bool, bool] | None = None
        alike = pending.facts.view and len(leaves) > 1 and pending.viewed is None and len(pending.slots) == 1
        for leaf in leaves:
            if not isinstance(leaf, FakeTensor):
                out_refs.append(None)
                continue
            if shared is None and leaf.layout is not torch.strided:  # the others view what the first views
                raise DeferredInitError(
                    f"{callable_name(pending.func)} made a {leaf.layout} tensor, and deferred_init records strided "
                    f"tensors only.\nwhere: {where()}\nMake this one after materialize_module"
                )
            device = device or leaf.device
            if pending.viewed is not None:
                self._real_views.setdefault(self._storage_of(leaf), pending.viewed)
            if shared is not None:
                storage, dtype, conj, neg = shared
                key = (storage, int(leaf.storage_offset()), tuple(leaf.shape), tuple(leaf.stride()), dtype, conj, neg)
            elif leaf is result and result_key is not None:
                key = result_key
            else:
                key = self._key_of(leaf)
                if alike:
                    shared = (key[0], key[4], key[5], key[6])
            ref = pending.arg_refs.get(id(leaf))
            if ref is None:
                ref = self._new_ref(key)
            elif id(leaf) in pending.mutated:
                writes.add(key[0])  # set_ and resize_ move it to another storage
            record.keys[key] = ref
            self._unwritten_views.pop(key, None)  # a view not written down that made this key is this one now
            out_refs.append(ref)
        if device is None:
            device = next((slot.device for slot in pending.slots if slot.written), None)
        return tuple(out_refs), frozenset(writes), device

    def _new_ref(self, key: Key) -> int:
        """A new ref, for a tensor made where ``key`` says, with its layout noted (once: a ref's layout never
        changes; a tensor moved in place gets a new ref, see ``_keep_place``)."""
        record = self.record
        ref = record.next_ref
        record.next_ref += 1
        record.layouts[ref] = Layout(key[0], key[1], key[2], key[3], key[4])
        return ref

    def _ref_of(self, tensor: FakeTensor, func: Callable[..., Any]) -> tuple[int, Key]:
        """The ref and the key of a fake tensor given to ``func``."""
        if tensor.fake_mode is not self:
            raise DeferredInitError(
                f"{callable_name(func)} was given a fake tensor that this deferred_init did not record (made by "
                f"another fake mode or another deferred_init call).\nwhere: {where()}\n"
                "Deferred modules can only be combined with tensors made in the same deferred_init call or real ones"
            )
        key = self._key_of(tensor)
        if key in self._unwritten_views:
            self._write_view(key, tensor)
        ref = self.record.keys.get(key)
        if ref is None:
            raise DeferredInitError(
                f"{callable_name(func)} was given a fake tensor ({tuple(tensor.shape)}, {tensor.dtype}) whose making "
                f"was not recorded.\nwhere: {where()}\nMake tensors with torch operations inside deferred_init"
            )
        return ref, key

    def _storage_of(self, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        address: int = address_of(storage)
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
            tensor.is_conj(),
            tensor.is_neg(),
        )


install_dispatch_entry(RecordingFakeTensorMode)  # Note [A dispatch entry dynamo cannot see] in modattrs/_compiled.py


class ValueReads(TorchFunctionMode):
    """Active while ``deferred_init`` records: reads of values that torch does not send through the dispatcher.

    ``.numpy()``, ``np.asarray``, DLPack and formatting (``f"{t:.2f}"``) of a recorded fake tensor raise a
    :class:`DeferredInitError` naming the operation and where it ran, as reads that do reach the dispatcher
    (``.item()``, ``bool(t)``) do, rather than torch's error for tensor subclasses. Value reads of real tensors run
    outside the fake mode: inside it, ``.numpy()`` detaches into a fake tensor and reads memory that is not its
    data, and ``.item()`` makes a fake of the tensor first, which has no values.
    """

    def __init__(self) -> None:
        super().__init__()
        # torch hands __torch_function__ the method that Tensor has at call time: for numpy, the wrapper that
        # _torch_changes.install_deferred puts there before any recording starts.
        self._reads = {getattr(torch.Tensor, name): label for name, label in _VALUE_READS.items()}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = self._reads.get(func) if args else None
        if name is None:
            return func(*args, **kwargs)
        tensor = args[0]
        if not isinstance(tensor, FakeTensor):
            with disable_current_modes():
                return func(*args, **kwargs)
        if isinstance(tensor.fake_mode, RecordingFakeTensorMode) and _skips_dispatch(name, tensor, args):
            raise _needs_values(name)
        return func(*args, **kwargs)


def _skips_dispatch(name: str, tensor: torch.Tensor, args: Sequence[Any]) -> bool:
    """Whether ``name`` reads values without an operation that the recording mode would see (and refuse)."""
    if name == "Tensor.__format__":  # a format spec on a tensor of one value formats that value; repr otherwise
        return tensor.dim() == 0 and any(args[1:])
    return name in _SKIPPING_DISPATCH


# Tensor methods that read values; the first ones do so without an operation a dispatch mode sees.
_SKIPPING_DISPATCH = ("Tensor.numpy", "Tensor.__array__", "Tensor.__dlpack__")
_VALUE_READS = {
    name: f"Tensor.{name}"
    for name in (
        "numpy", "__array__", "__dlpack__", "__format__",
        "item", "tolist", "__float__", "__int__", "__bool__", "__complex__", "__index__",
    )
}  # fmt: skip


def _needs_values(operation: str) -> DeferredInitError:
    what, named = operation, ""
    if operation in _VALUE_OPERATIONS:  # what it is called in Python first, and its schema name on a line of its own
        what, named = _VALUE_OPERATIONS[operation], f"operation: {operation}\n"
    if recording_in_this_thread():
        refusal = (
            f"{what} needs the values of a fake tensor that is not a construction-time constant.\n"
            f"{named}where: {where()}"
        )
        if not _formatting_a_log_record():
            _this_thread.refused.append(refusal)
        return DeferredInitError(
            f"{refusal}\n"
            f"not constants: random draws, parameters, empty tensors, tensors of more than {CONSTANT_LIMIT} elements\n"
            "deferred_init records one operation at a time, and cannot record values that depend on such data.\n"
            "Move this code after materialize_module, or record the function doing it as one call with "
            "modattrs.deferred.register_opaque_init"
        )
    error = DeferredInitError(
        f"{what} needs the values of a deferred tensor, which has none until it is materialized.\n"
        f"{named}where: {where()}\n"
        "Call modattrs.deferred.materialize_module on its module first"
    )
    value_read_errors.add(error)
    return error


#: The errors raised for reading a deferred tensor's values that are still alive (kept by the user, a test's
#: ``pytest.raises``, a logger, the interactive interpreter): their tracebacks hold views of the tensor, which
#: materializing, as the errors advise, lets go of (see deferred._let_go_of_errors_read_values).
value_read_errors: weakref.WeakSet[DeferredInitError] = weakref.WeakSet()


# What the operations that read a value are called in Python.
_VALUE_OPERATIONS = {
    "aten._local_scalar_dense.default": ".item(), .tolist(), float(), int(), bool() or the like",
}

_this_thread = threading.local()


def recording_in_this_thread() -> bool:
    """Whether a ``deferred_init`` call is running its module function in this thread."""
    return bool(getattr(_this_thread, "recording", False))


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Marks this thread as running a ``deferred_init`` call's module function; yields the list of the value reads
    refused meanwhile (see Note [A refused read that the constructor catches])."""
    _this_thread.recording = True
    refused: list[str] = []
    _this_thread.refused = refused
    try:
        yield refused
    finally:
        _this_thread.recording = False
        _this_thread.refused = []


# Note [A refused read that the constructor catches]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A read of values that no fake tensor has raises DeferredInitError, which construction code may catch (`try: ...
# except Exception: fallback`) and go on. Eager code had the values and took the other path, so the module recorded
# is not the one eager construction builds, and materializing it would give other tensors without a word. The reads
# refused while a module function runs are noted; deferred_init raises when the function returns nonetheless. One
# catcher is left out: the logging module, which reports an error raised while formatting a record
# (`logger.info("%.3f", weight.norm())`) and goes on by design; what it formats steers nothing.


def recording_mode(tensor: object) -> RecordingFakeTensorMode | None:
    """The recording mode that made ``tensor``, if it is a fake tensor of a ``deferred_init``."""
    if isinstance(tensor, FakeTensor) and isinstance(tensor.fake_mode, RecordingFakeTensorMode):
        return tensor.fake_mode
    return None


def _formatting_a_log_record() -> bool:
    """Whether the logging module is on this thread's stack (formatting a record, which catches what it raises)."""
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_LOGGING):
            return True
        frame = frame.f_back
    return False


_LOGGING = os.path.dirname(logging.__file__) + os.sep


@dataclass(slots=True, kw_only=True)
class _Pending:
    func: Callable[..., Any]
    facts: OpFacts
    flat: list[Any]
    spec: TreeSpec
    plain: Plain | None
    slots: tuple[Slot, ...]
    constant_slots: tuple[Constant, ...]
    device_slots: tuple[int, ...]
    generators: tuple[tuple[int, torch.Generator], ...]
    draws: Draws
    mutated: set[int]
    arg_refs: dict[int, int]
    keys: tuple[Key, ...]  # of the fake tensors given, in the order of slots
    written_fakes: tuple[tuple[Slot, Key, FakeTensor], ...]  # those written in place, with their keys before
    value_writer: bool
    overwrites: frozenset[int]
    viewed: _Real | None  # a view operation of a real tensor: that tensor, for messages


class _UnwrittenView(NamedTuple):
    """A view of one fake tensor given plain values, not written down yet (Note [Views written down when used]):
    what ``_begin`` takes, but no tensor: a fake held here would be held by something outside the module, which
    materializing refuses (``swap_tensors``)."""

    func: Callable[..., Any]
    facts: OpFacts
    rest: Sequence[Any]  # its arguments but the viewed tensor, as the dispatcher made them: held by nothing else
    kwargs: Mapping[str, Any]
    viewed: tuple[int, Key, torch.device]  # the ref, key and device of what it viewed, when it ran


class _Real(NamedTuple):
    """A real tensor, for messages: what it is, and its name among deferred_init's arguments, if it is one."""

    text: str
    name: str | None


def _writes_real(func: Callable[..., Any], real: _Real) -> DeferredInitError:
    given = real.name or "tensor"
    return DeferredInitError(
        f"{callable_name(func)} writes in place into a real tensor, which deferred_init did not make and cannot "
        f"change.\ntensor: {real.text}\nwhere: {where()}\n"
        "Eager code would change that real tensor; its fake tensors have no values to write, so the materialized "
        "module would differ from eager construction.\n"
        "Hand the constructor a copy made inside the function deferred_init records, e.g. "
        f"deferred_init(lambda: Model({given}.clone())).\n"
        f"The copy is recorded with its changes, and {given} stays as it is.\n"
        "Or change the tensor before deferred_init, or after materialize_module"
    )


def _made_here(
    func: Callable[..., Any],
    slots: tuple[Slot, ...],
    *,
    device: torch.device,
    out_refs: tuple[int, ...] = (),
    results: Results = NO_RESULTS,
    draws: Draws = Draws.NONE,
    reset: Position | None = None,
    arguments: tuple[list[Any], TreeSpec, Plain | None] | None = None,
) -> Op:
    """An operation that reads no values and writes nothing, given ``slots`` (not written). Without ``arguments``,
    one the recorder adds itself, whose only arguments are its slots (the generator noted after construction, an
    alias kept at a tensor's old place); with them, a view written down when used: its arguments' leaves (its fake
    tensor None), their spec and their plain structure."""
    if arguments is None:
        arguments = [None] * len(slots), tree_flatten((tuple([None] * len(slots)), {}))[1], (len(slots), (), None)
    flat, spec, plain = arguments
    return Op(
        func=func,
        flat=flat,
        spec=spec,
        plain=plain,
        slots=slots,
        constant_slots=(),
        device_slots=(),
        generator_states=(),
        in_refs=frozenset(slot.ref for slot in slots),
        reads=frozenset(),  # a view, or nothing: no values read
        out_refs=out_refs,
        results=results,
        writes=frozenset(),
        value_writer=False,
        overwrites=frozenset(),
        touched=results.storages.union([slot.storage for slot in slots]),
        draws=draws,
        device=device,
        reset=reset,
        pinned=False,
        default_dtype=torch.get_default_dtype(),
    )


def _pass_default_dtype(pending: _Pending, result: Any) -> tuple[tuple[int, ...], bool]:
    """How the replay gives ``pending`` (which returned ``result``) what it read of torch's default dtype (see Note
    [The default dtype is passed, never set] in record): a factory's ``dtype`` written into its arguments here; the
    positions of the tensors to cast to it (``Op.promoted``); and whether it reads it in a way neither passes
    (``Op.reads_default_dtype``)."""
    func, facts = pending.func, pending.facts
    if not isinstance(func, OpOverload):  # an opaque initializer: Python code
        return (), not _reads_no_default_dtype(func)
    for slot in pending.slots:
        if not slot.written and (slot.dtype.is_floating_point or slot.dtype.is_complex):
            if facts.tensor_bounded:
                break
            return (), False  # most operations: a float tensor read, whose category promotion keeps (see below)
    leaves = pending.flat
    if any(isinstance(value, torch.dtype) for value in leaves):
        return (), False  # a dtype given: the operation's dtypes come from it and from its tensors
    results = [leaf for leaf in _leaves(result) if isinstance(leaf, torch.Tensor)]
    tensors = [(slot.index, slot.dtype) for slot in pending.slots]
    tensors += [(constant.index, constant.tensor.dtype) for constant in pending.constant_slots]
    if (not tensors or facts.tensor_bounded) and len(results) == 1 and facts.dtype_keyword:
        _give_dtype(pending, results[0].dtype)
        return (), False
    if not tensors:
        return (), any(_is_float(tensor.dtype) for tensor in results)
    written = any(slot.written for slot in pending.slots)
    names = _leaf_names(func, pending.plain) if written else None
    # An `out=` tensor takes what was computed: it has no part in the promotion (nor has it a dtype to pass).
    outs = {slot.index for slot in pending.slots if slot.written and names is not None and names[slot.index] == "out"}
    if any(_is_float(dtype) for index, dtype in tensors if index not in outs):
        return (), False  # promotion keeps the category of a float tensor, whatever the default
    floats_made = any(_is_float(tensor.dtype) for tensor in results)
    python_floats = _python_floats_in(leaves)
    if not floats_made and not python_floats:
        return (), False  # integers and booleans throughout
    if outs:
        return (), True
    if not facts.pointwise or written:
        return (), floats_made
    complex_numbers = any(type(value) is complex for value in leaves) or any(t.dtype.is_complex for t in results)
    if complex_numbers and torch.get_default_dtype() is torch.bfloat16:
        # A complex number promotes integers to the default complex dtype, complex64 under bfloat16: computed from
        # integers cast to bfloat16 first, they would be rounded twice.
        return (), True
    names = _leaf_names(func, pending.plain)
    operands = tuple(index for index, _ in tensors if names is not None and names[index] not in _NOT_OPERANDS)
    if operands and _promotion_replayed(pending, operands, results):
        return tuple(sorted(operands)), False
    # A float made from integers only comes from the default; an integer or boolean result of a call with a Python
    # float that the cast does not reproduce is an operation that cast the float to its tensor's dtype instead
    # (``masked_fill``): it read no default.
    return (), floats_made


# Pointwise operations' tensor arguments that are not promoted with the others: where's condition, a mask.
_NOT_OPERANDS = frozenset({"condition", "mask"})


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _reads_no_default_dtype(func: Callable[..., Any]) -> bool:
    """Whether an opaque initializer is torch's ``trunc_normal_`` helper, which makes every tensor in its argument's
    dtype (``new_tensor``, ``empty_like``; checked on 2.8 to 2.15): the one known not to read the default dtype."""
    original = getattr(torch.nn.init, TRUNC_NORMAL_HELPER, None)
    return func is original or func is getattr(original, "__wrapped__", None)


def _python_floats_in(leaves: Sequence[Any]) -> bool:
    return any(type(value) in (float, complex) for value in leaves)


def _give_dtype(pending: _Pending, dtype: torch.dtype) -> None:
    """Record the factory ``pending`` with ``dtype=dtype``, the dtype it made: a keyword argument at the end (or in
    place of a None), so that the positions of the other leaves stay as noted."""
    plain = pending.plain
    if plain is not None:  # every factory's call: its leaves and lists are known without pytree (a few us)
        positional, names, containers = plain
        if "dtype" in names:
            at = positional + names.index("dtype")
            pending.flat[at if containers is None else sum(1 if c is None else c[1] for c in containers[:at])] = dtype
            return
        given: Plain = (positional, (*names, "dtype"), None if containers is None else (*containers, None))
        spec = _SPECS.get(given)
        if spec is not None:
            pending.flat.append(dtype)
            pending.plain, pending.spec = given, spec
            return
    args, kwargs = tree_unflatten(pending.flat, pending.spec)  # a factory holds no tensors: nothing left out
    kwargs = {**kwargs, "dtype": dtype}
    pending.plain = plain_call(args, kwargs)
    flat, pending.spec = _flattened(args, kwargs, pending.plain)
    pending.flat = list(flat)


@functools.cache  # a schema's arguments are made anew on each read
def _leaf_names(func: OpOverload, plain: Plain | None) -> list[str] | None:
    """The name of the schema argument each leaf of a plain call of ``func`` is (None for a call with lists)."""
    if plain is None or plain[2] is not None:
        return None
    positional, keywords, _ = plain
    return [*operator_arguments(func)[:positional], *keywords]


def _promotion_replayed(pending: _Pending, operands: tuple[int, ...], results: list[torch.Tensor]) -> bool:
    """Whether ``pending`` called with its ``operands`` cast to the default dtype makes results of the dtypes it made:
    tried on meta tensors, out of every mode."""
    default = torch.get_default_dtype()
    flat = list(pending.flat)
    with DisableTorchFunction(), DisableTorchDispatch():
        for slot in pending.slots:
            flat[slot.index] = torch.empty_strided(slot.size, slot.stride, dtype=slot.dtype, device="meta")
        for constant in pending.constant_slots:
            tensor = constant.tensor
            flat[constant.index] = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        for index in operands:
            flat[index] = flat[index].to(default)
        args, kwargs = tree_unflatten(flat, pending.spec)
        try:
            made = pending.func(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError, NotImplementedError):  # ComplexBFloat16, say: no such dtype
            return False
    again = [leaf for leaf in _leaves(made) if isinstance(leaf, torch.Tensor)]
    return [tensor.dtype for tensor in again] == [tensor.dtype for tensor in results]


def _reads(pending: _Pending) -> frozenset[int]:
    """The storages whose values an operation reads: a view reads none (what it views is written later, or
    before, by operations that count), nor does a read of metadata (``new_empty``, ``empty_like``, the device:
    torchtitan's fused ``wqkv`` makes its q, k and v so, between the constructor's fill and the copy that overwrites
    it, which would otherwise be drawn); an overwrite does not read what it overwrites."""
    facts = pending.facts
    if facts.view or facts.metadata_read or facts.geometry_read:
        return frozenset()
    return frozenset(slot.storage for slot in pending.slots if slot.storage not in pending.overwrites)


def _overwritten(slots: Sequence[Slot], flat: Sequence[Any]) -> frozenset[int]:
    """The storages a value writer writes whole: its written tensor covers its storage, densely, from offset 0, in
    any order of its dimensions (a ``copy_`` into a transposed weight writes every element of it), and no other
    argument shares that storage (``copy_`` from a view of itself reads it)."""
    whole: set[int] = set()
    for slot in slots:
        if not slot.written:
            continue
        tensor = flat[slot.index]
        others = [other for other in slots if other is not slot and other.storage == slot.storage]
        covers = (
            tensor.storage_offset() == 0
            and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes()
            and (tensor.is_contiguous() or _dense_in_some_order(tuple(tensor.shape), tensor.stride()))
        )
        if covers and not others:
            whole.add(slot.storage)
    return frozenset(whole)


def _is_laid(layout: Layout | None, key: Key) -> bool:
    """``Slot.laid`` of a tensor known by ``key`` whose ref has ``layout``: whether it sits where its ref was made
    (the storage, sizes, strides and dtype of both; a layout holds its offset, a slot none)."""
    if layout is None:
        return False
    storage, _, size, stride, dtype = key[:5]
    return layout.storage == storage and layout.size == size and layout.stride == stride and layout.dtype == dtype


def _dense_in_some_order(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a tensor of ``size`` and ``stride`` visits ``numel`` consecutive elements, each once: taken from
    the smallest stride up (dimensions of one element aside), each stride is the number of elements the dimensions
    before it span."""
    span = 1
    for length, step in sorted((pair for pair in zip(size, stride, strict=True) if pair[0] != 1), key=lambda p: p[1]):
        if step != span:
            return False
        span *= length
    return True


def _flattened(args: Sequence[Any], kwargs: Mapping[str, Any], plain: Plain | None) -> tuple[list[Any], TreeSpec]:
    """``tree_flatten((tuple(args), dict(kwargs)))``: for a plain call (``record.plain_call``), its leaves gathered
    here and its spec, which the call's plain structure determines, made once per structure."""
    if plain is None:
        flat, spec = tree_flatten((tuple(args), dict(kwargs)))
        return flat, spec
    leaves: list[Any] = []
    containers = plain[2]
    if containers is None:
        leaves.extend(args)
        leaves.extend(kwargs.values())
    else:
        for value, container in zip((*args, *kwargs.values()), containers, strict=True):
            if container is None:
                leaves.append(value)
            else:
                leaves.extend(value)
    known = _SPECS.get(plain)
    if known is None:
        known = _SPECS[plain] = tree_flatten((tuple(args), dict(kwargs)))[1]
    return leaves, known


#: The spec of each plain structure of arguments met (a handful: sizes lists of a few lengths, a few keywords).
_SPECS: dict[Plain, TreeSpec] = {}


def _leaves(result: Any) -> list[Any]:
    """The leaves of an operation's result, as ``tree_flatten`` gives them: at once for a tensor and for a list of
    them (a split's), the results of most operations."""
    if isinstance(result, torch.Tensor):
        return [result]
    if type(result) is list and all(isinstance(leaf, torch.Tensor) for leaf in result):
        return result
    leaves: list[Any] = tree_flatten(result)[0]
    return leaves


def _no_draw() -> None:
    """Stands for a reset of the default CPU generator that no draw followed."""


def _advance(op: Op, generators: Mapping[int, torch.Generator]) -> None:
    """Run an operation that draws from explicit generators for real, on scratch tensors, to advance them."""
    with disable_current_modes(), torch.no_grad():
        args, kwargs = op.arguments(scratch_arguments(op, None), None, generators)
        op.func(*args, **kwargs)


def _reads_values(pending: _Pending) -> bool:
    """Whether the operation may draw as many numbers as the values of fake tensors say: its count depends on
    values (``rng.count_depends_on_values``: opaque functions might), and it reads a fake tensor's values (an
    argument it does not write, or one it writes in place without being a value writer: ``rrelu_with_noise_``
    reads what it overwrites)."""
    return rng.count_depends_on_values(pending.func) and any(
        not slot.written or not pending.value_writer for slot in pending.slots
    )


def _viewed_alone(facts: OpFacts, args: Sequence[Any], kwargs: Mapping[str, Any]) -> FakeTensor | None:
    """The fake tensor a view operation is given, if it is given that one strided fake tensor first and plain
    values else (no other tensor, device, generator, storage), with no argument written; else None."""
    if not facts.view or facts.written or not args:
        return None
    first = args[0]
    if type(first) is not FakeTensor or first.layout is not torch.strided:
        return None
    for value in (*args[1:], *kwargs.values()):
        kind = type(value)
        if kind in _PLAIN_VALUES:
            continue
        if (kind is list or kind is tuple) and all(type(item) in _PLAIN_VALUES for item in value):
            continue
        return None
    return first


# Arguments that _begin passes on as they are: the leaves of a plain call but devices, which it notes.
_NUMBERS_AND_NAMES = LEAF_TYPES - {torch.device}
# What a view operation may be given besides its tensor and still be known by that tensor alone.
_PLAIN_VALUES = frozenset({int, float, bool, type(None), torch.dtype, torch.memory_format})


def _mutated_arguments(facts: OpFacts, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors that an aten operation writes in place, from its schema."""
    tensors: list[torch.Tensor] = []
    for index, name in facts.written:
        value = args[index] if index < len(args) else kwargs.get(name)
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, (list, tuple)):
            tensors.extend(v for v in value if isinstance(v, torch.Tensor))
    return tensors


def _is_default(generator: torch.Generator) -> bool:
    # The dispatcher hands the default generator over as a new Python object: compare what it wraps.
    return address_of(generator) == address_of(torch.default_generator)


# Note [A scatter of a deferred source is the rank's own chunk]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# distribute_tensor, and parallelize_module's styles through it, send the data of src_data_rank (rank 0 by default)
# to the other ranks: a scatter of its chunks for Shard (and _StridedShard), a broadcast for Replicate. A replay
# cannot run a collective (each rank materializes on its own, when it chooses), and on a rank other than the
# source the scatter names no source at all: only the source hands its list to c10d. But every rank records the
# same deferred model (the same construction, the same seed), so the source's chunk for this rank holds the values
# of this rank's own chunk, which this rank computed too. DTensor's scatter of chunks that are all deferred values
# of one record is recorded as what it delivers: this rank's chunk copied into the output, an ordinary operation
# that replays exactly, draws nothing and reads only that chunk (so a shard-local window still reads only the part
# of the source the rank keeps). A broadcast of a deferred value fills it in place with the source's values, which
# are its own: it records nothing. A collective whose tensors are not all deferred values of one record, one
# asked to run asynchronously, and any other collective, run as torch runs them; a replay refuses them.


def recorded_together(tensors: Sequence[object]) -> bool:
    """Whether ``tensors`` are all fake tensors of the record of one ``deferred_init`` call."""
    modes = {
        id(tensor.fake_mode)
        if isinstance(tensor, FakeTensor) and isinstance(tensor.fake_mode, RecordingFakeTensorMode)
        else None
        for tensor in tensors
    }
    return bool(modes) and None not in modes and len(modes) == 1


def scatter_own_chunk(output: torch.Tensor, chunks: Sequence[torch.Tensor], local_rank: int) -> None:
    """Record what a scatter of deferred ``chunks`` delivers into ``output`` on the rank of ``local_rank`` in its
    group: that chunk (see Note [A scatter of a deferred source is the rank's own chunk])."""
    with torch.no_grad():  # a collective records no autograd history either
        output.copy_(chunks[local_rank])
