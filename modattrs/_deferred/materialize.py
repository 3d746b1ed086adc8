"""Materializing: replaying what the chosen fake tensors need, record by record, and swapping the real results into
the same tensor objects, with every check made before anything changes."""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from modattrs._deferred.record import DeferredInitError, Layout
from modattrs._deferred.recorder import RecordingFakeTensorMode, recording_mode, value_read_errors
from modattrs._deferred.replay import replay
from modattrs._fake import spoofed_cuda
from modattrs._module_tensors import announce_written, join, own_tensors, user_attributes
from modattrs._names import in_library
from modattrs._torch_private import (
    FakeTensor,
    address_of,
    disable_current_modes,
    dtensor_local,
    fsdp_padded_shards,
    hooks_of,
    imported_dtensor_type,
    rebuild_rnn_weights,
    release_rnn_weights,
    restore_hooks,
    rnn_flat_weights,
    storage_use_count,
    torch_tensor_fields,
    use_count,
    view_base_of,
)

__all__: list[str] = []


roots: weakref.WeakKeyDictionary[nn.Module, RecordingFakeTensorMode] = weakref.WeakKeyDictionary()


Chosen = dict[int, tuple[str, FakeTensor]]  # id of a fake tensor -> (its label for messages, the tensor)


def materialize(
    chosen: list[tuple[str, FakeTensor]],
    module: nn.Module | None,
    *,
    full: bool,
    device: torch.device | None,
    threads: int = 1,
) -> None:
    """Replay what ``chosen`` needs, record by record, and swap the results in.

    Everything that can refuse is checked before anything changes; if a replay fails, the generator is put back.
    Real values are what materializing is for: it steps out of the caller's dispatch modes (a fake mode, modattrs'
    or torch's own, the recording of an enclosing ``deferred_init``) and spoofed CUDA.
    """
    with disable_current_modes(), spoofed_cuda.truthful():
        _replay_and_swap(chosen, module, full=full, device=device, threads=threads)


def _replay_and_swap(
    chosen: list[tuple[str, FakeTensor]],
    module: nn.Module | None,
    *,
    full: bool,
    device: torch.device | None,
    threads: int,
) -> None:
    root_mode = roots.get(module) if full and module is not None else None
    groups = _by_record(chosen)
    if root_mode is not None:
        groups.setdefault(id(root_mode), (root_mode, {}))  # even with nothing left, the generator is set
    tops = [] if module is None else [module]  # the scope: these modules and their submodules
    for mode, tensors in groups.values():
        recorded_root = mode.record.root() if mode.record.root is not None else None
        if module is not None and module is not recorded_root:
            # A deep copy (a pipeline stage) holds what FSDP2 keeps for it on storages of its own, which the root
            # never sees: see Note [A deep copy's shards are its own].
            _add_aliases(tensors, mode, module, walked=full)
        if recorded_root is not None:
            _add_aliases(tensors, mode, recorded_root, walked=full and recorded_root is module)
            if recorded_root is not module:
                tops.append(recorded_root)
    refs: dict[int, tuple[int, int]] = {}
    seen_through: dict[int, int] = {}  # a chosen view not written down -> the chosen tensor whose memory it views
    for mode, tensors in groups.values():
        seen_through.update(_refs_and_views(mode, tensors, refs))
    everything = [entry for _, tensors in groups.values() for entry in tensors.values()]
    # See Note [Block by block without walking the model]: the scope is walked only when something is to be found.
    weakly_held = any(weakref.getweakrefcount(tensor) for _, tensor in everything)
    scope = [found for top in tops for found in top.modules()] if weakly_held else []
    with _recurrent_weights_released(scope, everything):
        _check_swappable(everything)
        saved = torch.default_generator.get_state()
        swaps: list[tuple[str, FakeTensor, Tensor]] = []
        try:
            for mode, tensors in groups.values():
                targets = dict(refs[key] for key in tensors if key in refs)
                labels = {refs[key][0]: label for key, (label, _) in tensors.items() if key in refs}
                views = [
                    _layout_of(tensor, refs[seen_through[key]][1])
                    for key, (_, tensor) in tensors.items()
                    if key in seen_through
                ]
                reals = replay(
                    mode.record, targets, labels, device=device, to_end=mode is root_mode, threads=threads, views=views
                )
                for key, (label, tensor) in tensors.items():
                    if key in seen_through:
                        seen = tensors[seen_through[key]][1]
                        real = _same_memory(label, tensor, seen, reals[refs[seen_through[key]][0]])
                    else:
                        real = reals[refs[key][0]]
                    swaps.append((label, tensor, _real_twin(label, tensor, real, device)))
        except BaseException:
            torch.default_generator.set_state(saved)
            raise
        made_real = [tensor for _, tensor, _ in swaps]  # each swapped in place: real once _swap is done
        _swap(swaps)
        announce_written(made_real, "materialize_module")  # see Note [Writes no dispatch mode sees]
        del made_real
    # Cached virtual values need no refreshing: a value computed from fake tensors is kept only for the fake mode it
    # was read in, never for a real reference (_cache._keepable), so nothing kept can outlive the swap.
    if root_mode is not None and module is not None:
        del roots[module]  # all of it is real: the record can go


def _by_record(chosen: list[tuple[str, FakeTensor]]) -> dict[int, tuple[RecordingFakeTensorMode, Chosen]]:
    groups: dict[int, tuple[RecordingFakeTensorMode, Chosen]] = {}
    for label, tensor in chosen:
        mode = recording_mode(tensor)
        if mode is None:
            raise _not_recorded(label)
        groups.setdefault(id(mode), (mode, {}))[1][id(tensor)] = (label, tensor)
    return groups


def _add_aliases(tensors: Chosen, mode: RecordingFakeTensorMode, root: nn.Module, *, walked: bool) -> None:
    """Add the root's tensors that share storage with a chosen one: materialized apart, they would stop aliasing.
    ``walked``: the chosen ones are all of the root's own tensors (``materialize_module`` of the whole root), so that
    only what FSDP2 keeps beside them is left to look at.

    Note [Block by block without walking the model]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    ``materialize_module(block)`` must not walk the whole model at every block: block by block, that is quadratic
    in the blocks. A tensor can only share storage with a chosen one if it holds a reference to that storage, and
    torch counts them: one per tensor on it, and one for its Python object, which the record keeps
    (``storage_use_count``). When every chosen storage has no reference but those, no other tensor, in the root
    or anywhere, shares it, and the root is not walked; otherwise (a view, a ``.data`` kept as a buffer, a
    leftover of the constructor still alive, or a torch that counts otherwise) it is, as before. The scope's walk
    for recurrent layers is skipped likewise when no chosen tensor is
    weakly referenced (a recurrent layer holds its weights so). Nothing else walks it: cached virtual values are
    never kept from fake tensors for a real reference, so they need no refreshing after the swap.
    """
    storages = {mode.storage_of(tensor) for _, tensor in tensors.values()}
    if _alone_on_their_storages(tensors):
        return
    found = fsdp_tensors(root) if walked else module_tensors(root)
    for label, tensor in found:
        if id(tensor) in tensors or not isinstance(tensor, FakeTensor) or tensor.fake_mode is not mode:
            continue
        if mode.storage_of(tensor) in storages:
            tensors[id(tensor)] = (label, tensor)


# Note [A deep copy's shards are its own]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A deep copy of a deferred module records into the original's record (its fake tensors are clones made by it),
# but nothing of it is under the module deferred_init returned: torchtitan's pipeline split copies the model,
# deletes the original and applies fully_shard to the copy, whose padded shards live only there. So the module
# being materialized is searched as well as the recorded root (which may be gone, or hold nothing of the copy). For a
# module under the root (a block), that adds a search of the block, and only when the root's would run too (its
# chosen storages are not alone on their storages): block by block stays linear.


def _alone_on_their_storages(tensors: Chosen) -> bool:
    """Whether nothing but the chosen tensors, and their storages' Python objects, which the record keeps, holds a
    reference to their storages (see Note [Block by block without walking the model])."""
    on_storage: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for _, tensor in tensors.values():
        storage = tensor.untyped_storage()
        held = on_storage.get(address_of(storage))
        on_storage[address_of(storage)] = (storage, 1 if held is None else held[1] + 1)
    return all(storage_use_count(storage) == count + 1 for storage, count in on_storage.values())


@contextlib.contextmanager
def _recurrent_weights_released(scope: list[nn.Module], tensors: list[tuple[str, FakeTensor]]) -> Iterator[None]:
    """Recurrent layers hold weak references to their weights, which swap_tensors refuses: like their own
    ``_apply``, drop them for the swap and make them again."""
    ids = {id(tensor) for _, tensor in tensors}
    layers = {
        id(layer): layer
        for layer in scope
        if isinstance(layer, nn.RNNBase) and any(id(weight) in ids for weight in rnn_flat_weights(layer))
    }.values()
    for layer in layers:
        release_rnn_weights(layer)
    try:
        yield
    finally:
        for layer in layers:
            rebuild_rnn_weights(layer)


# Note [A view holds what it was made from]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's autograd keeps, on a view of a tensor subclass (a fake tensor is one), a function that makes the view again
# from its base, and that function holds the tensor the view was made from and, through the functions of that
# tensor's own view information, every view between it and the base (measured on torch 2.13: `b = a.view(5, 1)` of
# `a = t[:5]` holds `a` once and `t` twice; `t`, once more through its view information, as every view holds its
# base twice). torch.utils.swap_tensors refuses a tensor held by anything but its Python object, so a module holding
# a view of a registered view (`a` and `b` above) would be refused if these references were not counted, and `a`
# can only be swapped once `b`'s fake half is gone. The recorder notes, for each view it sees made, the tensor it was
# made from (`RecordingFakeTensorMode.made_through`). Every view that the chosen ones keep alive, chosen or not,
# counts: it holds its base twice and each view it was made through once (`t.view(2, 3)[1:]` alone keeps the
# dropped `t.view(2, 3)`, which holds `t` twice as well). The check counts those references, and the swap takes the
# views made through the most views first.


def _check_swappable(tensors: list[tuple[str, FakeTensor]]) -> None:
    """Raise for a tensor that torch.utils.swap_tensors would refuse, once torch's own fake tensor memo (which holds
    weak references to some) has let go of it."""
    views_of: dict[int, set[int]] = {}  # by base: the addresses of the views alive through the chosen ones
    held_by_views: dict[int, set[int]] = {}  # by address: the views alive through the chosen ones that hold it
    by_mode: dict[int, tuple[RecordingFakeTensorMode, list[FakeTensor]]] = {}
    for _, tensor in tensors:
        mode = recording_mode(tensor)
        assert mode is not None
        base = view_base_of(tensor)
        if base is not None:
            alive = [address_of(tensor), *mode.made_through(tensor)]  # each view holds those it was made through
            views_of.setdefault(id(base), set()).update(alive)
            for place, holder in enumerate(alive):
                for source in alive[place + 1 :]:
                    held_by_views.setdefault(source, set()).add(holder)
        by_mode.setdefault(id(mode), (mode, []))[1].append(tensor)
    for mode, held in by_mode.values():
        mode.forget(held)
    for label, tensor in tensors:
        if weakref.getweakrefcount(tensor):
            raise DeferredInitError(
                f"{label} cannot be made real in place: something holds a weak reference to it.\n"
                "torch.utils.swap_tensors refuses such tensors: drop the weak reference first"
            )
        # A fake view holds its base twice, and the views it was made through once, each of which, chosen or not,
        # holds the base twice too (see Note [A view holds what it was made from]); the views are swapped first and
        # let go of them.
        allowed = (
            1
            + 2 * len(views_of.get(id(tensor), ()))
            + len(held_by_views.get(address_of(tensor), ()))
            + (1 if tensor.is_leaf and tensor.requires_grad else 0)
        )
        if use_count(tensor) > allowed:
            _let_go_of_errors_read_values()
        if use_count(tensor) > allowed:
            raise DeferredInitError(
                f"{label} cannot be made real in place: other tensors hold it, such as\n"
                "- a view of it outside the module\n"
                "- the autograd graph of a fake forward pass whose outputs are still alive\n"
                "Drop them first"
            )


def _let_go_of_errors_read_values() -> None:
    """Clear the finished frames of torch and modattrs in the tracebacks of the value-read errors still alive.

    Code that reads the values of a deferred tensor (``t.tolist()`` reads each row, a view of ``t``) raises an error
    saying to materialize first; its traceback keeps the frames that were running, and with them those views, which
    materializing would refuse to leave fake, for as long as anything keeps the error. Those frames have returned:
    their locals are only for post-mortem debugging, and the code of the user's own frames keeps its own.
    """
    for error in list(value_read_errors):
        _clear_library_frames(error.__traceback__)


def _clear_library_frames(traceback: types.TracebackType | None) -> None:
    while traceback is not None:
        frame = traceback.tb_frame
        if in_library(frame.f_code):
            with contextlib.suppress(RuntimeError):  # a frame still running cannot be cleared
                frame.clear()
                # Before Python 3.13, the copy of the locals that reading f_locals made stays on the frame; reading
                # f_locals again updates it to the locals there are now: none.
                frame.f_locals  # noqa: B018
        traceback = traceback.tb_next


def _swap(swaps: list[tuple[str, FakeTensor, Tensor]]) -> None:
    """Swap each real twin into its fake tensor object: views first, those made through the most views first (see
    Note [A view holds what it was made from]), then the tensors they view."""
    swaps.sort(key=_swap_order)
    while swaps:
        label, tensor, twin = swaps.pop(0)
        hooks = hooks_of(tensor)
        try:
            torch.utils.swap_tensors(tensor, twin)  # type: ignore[no-untyped-call]
        except RuntimeError as error:  # checked for before: not expected
            raise DeferredInitError(
                f"{label} could not be made real in place; the tensors listed before it were.\nreason: {error}"
            ) from error
        del twin  # now the fake half: let go of it, and of the base it may hold
        restore_hooks(tensor, hooks)  # they live on the tensor's autograd data, which the swap replaced


def _swap_order(swap: tuple[str, FakeTensor, Tensor]) -> tuple[bool, int]:
    tensor = swap[1]
    if view_base_of(tensor) is None:
        return True, 0
    mode = recording_mode(tensor)
    depth = 0 if mode is None else len(mode.made_through(tensor))
    return False, -depth


def _real_twin(label: str, fake: FakeTensor, real: Tensor, device: torch.device | None) -> Tensor:
    expected = (fake.shape, fake.stride(), fake.dtype)
    got = (real.shape, real.stride(), real.dtype)
    on = fake.device if device is None else device
    if got != expected or not _same_device(real.device, on):
        raise DeferredInitError(
            f"replaying {label} gave a tensor of another (shape, strides, dtype) or device than recorded.\n"
            f"expected: {expected} on {on}\n"
            f"got: {got} on {real.device}\n"
            "This is a bug in modattrs, please report it"
        )
    twin: Tensor
    if isinstance(fake, nn.Parameter):
        twin = nn.Parameter(real, requires_grad=fake.requires_grad)
    else:  # a graph is not replayed: a tensor that had one comes back as its value, a leaf
        twin = real.detach().requires_grad_(fake.requires_grad and fake.is_leaf)
    if not vars(fake).keys() <= torch_tensor_fields():  # most tensors have no attribute of the user's
        vars(twin).update(user_attributes(fake))
    return twin


def _same_device(one: torch.device, other: torch.device) -> bool:
    if one.type == "cpu":  # torch puts a tensor asked for on cpu:1 on the CPU, which has no index
        return other.type == "cpu"
    return one.type == other.type and (one.index or 0) == (other.index or 0)  # cuda is cuda:0


def ref_of(label: str, tensor: FakeTensor) -> int:
    return refs_of(label, tensor)[0]


def _refs_and_views(mode: RecordingFakeTensorMode, tensors: Chosen, refs: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Put into ``refs`` the ref and storage of each of ``tensors`` (chosen ones of ``mode``'s record), but for views
    not written down yet that view the memory of another of them, in its dtype: return those, each with the one
    whose memory it views.

    Note [A view of a chosen tensor's memory is made from it]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    FSDP2 keeps, beside each sharded parameter (a ``narrow`` of its padded shard), a ``view(-1)`` of all of the
    padded shard, and materializing makes both real (they share storage). Written down and replayed, that view costs
    an operation in the record and one in the replay per parameter, for what is the other tensor's memory seen
    through another geometry. So a chosen tensor known only by a view not written down (``ref_storage_or_view``),
    with another chosen tensor on its storage in its dtype, is not replayed: its real twin is that tensor's real
    one, seen through its own offset, sizes and strides. The replay is told where it lies (``views``), so that the
    memory made for that storage holds it: all of it when it is a target's, a window wide enough when not. The
    view stays not written down; nothing uses it but the swap, after which it is real.
    """
    by_storage: dict[tuple[int, torch.dtype, torch.device], int] = {}
    views: dict[int, int] = {}
    unwritten = []
    for key, (label, tensor) in tensors.items():
        ref, storage, unwritten_view = mode.ref_storage_or_view(tensor)
        alike = not (tensor.is_conj() or tensor.is_neg())  # a replay gives those a copy of their own
        # A tensor without elements spans no memory: its real twin need not hold its storage's.
        alike = alike and tensor.numel() > 0
        if unwritten_view and alike:
            unwritten.append((key, storage))
            continue
        refs[key] = refs_of(label, tensor) if unwritten_view else _checked(label, tensor, ref, storage)
        if alike:
            by_storage.setdefault((storage, tensor.dtype, tensor.device), key)
    for key, storage in unwritten:
        label, tensor = tensors[key]
        seen = by_storage.get((storage, tensor.dtype, tensor.device))
        if seen is not None:
            views[key] = seen
        else:
            refs[key] = refs_of(label, tensor)  # written down now
            by_storage.setdefault((storage, tensor.dtype, tensor.device), key)
    return views


def _layout_of(tensor: FakeTensor, storage: int) -> Layout:
    """Where ``tensor`` lies in ``storage`` (its own), in elements of its dtype."""
    return Layout(storage, int(tensor.storage_offset()), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def _same_memory(label: str, view: FakeTensor, seen: FakeTensor, real: Tensor) -> Tensor:
    """The real tensor that ``view`` (``label`` names it) is, given ``real``, the real twin of ``seen``, a tensor on
    ``view``'s storage in its dtype: ``real``'s memory seen through ``view``'s geometry (Note [A view of a chosen
    tensor's memory is made from it])."""
    offset = real.storage_offset() + view.storage_offset() - seen.storage_offset()
    try:
        return real.as_strided(view.shape, view.stride(), offset)
    except RuntimeError as error:  # the replay made less of the storage than the view spans: not expected
        raise DeferredInitError(
            f"replaying {label} gave memory that does not hold it, a view of the memory of another tensor.\n"
            f"reason: {error}\n"
            "This is a bug in modattrs, please report it"
        ) from error


def refs_of(label: str, tensor: FakeTensor) -> tuple[int, int]:
    """The ref of a chosen fake tensor (``label`` names it in errors) and its storage, in its record."""
    mode = recording_mode(tensor)
    if mode is None:
        raise _not_recorded(label)
    ref, storage = mode.ref_and_storage_of(tensor)
    return _checked(label, tensor, ref, storage)


def _checked(label: str, tensor: FakeTensor, ref: int | None, storage: int) -> tuple[int, int]:
    """``ref`` and ``storage``, what the record knows a chosen fake tensor by; raises if it knows no ref."""
    if ref is None and tensor.untyped_storage().device.type != "meta":
        raise DeferredInitError(
            f"{label} had its data replaced by a real tensor (`.data = real`), which no operation records.\n"
            "Assign a new parameter or buffer instead, or copy_ the values in"
        )
    if ref is None:
        raise DeferredInitError(
            f"{label} is fake, and no recorded operation made a tensor with its storage and layout.\n"
            f"shape and dtype: {tuple(tensor.shape)}, {tensor.dtype}\n"
            "It was likely built from another fake tensor without a torch operation (torch.Tensor._make_subclass).\n"
            "Make it with torch operations"
        )
    return ref, storage


def _not_recorded(label: str) -> DeferredInitError:
    return DeferredInitError(
        f"{label} is a fake tensor that no deferred_init recorded, so there is nothing to replay for it.\n"
        "fake_mode or fake_copy made it, outside deferred_init or in a fake_mode block inside the function "
        "deferred_init records.\n"
        "Build it inside the deferred_init call without fake_mode, or assign a real tensor"
    )


def module_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of ``module`` and its submodules (see ``own_tensors_of``), and the shard storage FSDP2 keeps for
    them, labelled for messages."""
    for prefix, submodule in module.named_modules():
        yield from own_tensors_of(submodule, prefix, buffers_only=False)
        yield from _fsdp_shards(submodule, prefix)


def fsdp_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The shard storage FSDP2 keeps for the parameters of ``module`` and its submodules: ``module_tensors`` without
    the modules' own tensors."""
    walked = list(module.named_modules())
    paths = {id(submodule): prefix for prefix, submodule in walked}  # one walk for all the units
    for _, submodule in walked:
        for holder, parameter_name, shard in fsdp_padded_shards(submodule):
            yield _fsdp_label(join(paths.get(id(holder), "?"), parameter_name)), shard


def own_tensors_of(module: nn.Module, prefix: str, *, buffers_only: bool) -> Iterator[tuple[str, Tensor]]:
    """A module's own tensors (see ``_module_tensors.own_tensors``), labelled for messages; for a DTensor (sharded by
    FSDP2 or by tensor parallelism), the local tensor it wraps, which is what the record made."""
    for held in own_tensors(module, prefix, buffers_only=buffers_only):
        yield _local(held.label, held.tensor)


def _local(label: str, tensor: Tensor) -> tuple[str, Tensor]:
    """``tensor``, or the local tensor of a DTensor: the DTensor itself is a wrapper without data of its own, and its
    local tensor is a fake tensor that the record made (``fully_shard`` and ``distribute_tensor`` run torch
    operations on the deferred tensor to cut this rank's part out of it)."""
    dtensor_type = imported_dtensor_type()
    if dtensor_type is None or not isinstance(tensor, dtensor_type):
        return label, tensor
    return f"{label} (this rank's local tensor of the DTensor)", dtensor_local(tensor)


def _fsdp_shards(module: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
    """The padded shard storage FSDP2 keeps for each parameter it manages in ``module`` (a ``fully_shard`` unit).

    ``fully_shard`` pads this rank's part of each parameter to an equal size on every rank and keeps the padded
    tensor flat, next to the DTensor parameter whose local tensor is a view of its first rows; all-gathers read it.
    Materialized with the parameter (they share storage), it stays a view of the same real storage, as FSDP2 made it.
    """
    paths: dict[int, str] | None = None
    for holder, parameter_name, shard in fsdp_padded_shards(module):
        if paths is None:  # once per unit, not per parameter: the root's unit spans the whole model
            paths = {id(sub): path for path, sub in module.named_modules()}
        owner = paths.get(id(holder), "?")
        yield _fsdp_label(join(join(prefix, owner) if owner else prefix, parameter_name)), shard


def _fsdp_label(name: str) -> str:
    return f"FSDP2's padded shard of parameter {name!r}"
