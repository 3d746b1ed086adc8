"""What decides a deferred tensor's values, as a digest that ranks compare before one rank's values are sent.

Note [Ranks must agree on a deferred source]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DTensor's scatter and broadcast of a deferred source are recorded as this rank's own chunk (Note [A scatter of a
deferred source is the rank's own chunk] in ``recorder``): right when every rank's record would give the values that
the sending rank's gives, wrong otherwise, and silently so. Ranks seeded apart (accelerate's
``set_seed(..., device_specific=True)``), values written from the rank number, or data that one rank alone loaded
break that premise. So before recording the chunk, the ranks of the group compare a digest of what decides the
source's values in their records:

* the operations the source needs (the replay's slice of the record, pinned draws included), each with its
  function, its arguments (devices by type only: ``cuda:3`` on rank 3 is ``cuda:0`` on rank 0), the layouts of its
  tensors, its default dtype and the bytes of the real tensors it reads (a checkpoint's data copied in);
* for each of them that draws from the default CPU generator, the state it draws from: the state the record began
  from, or the last reset before it (a reseed inside ``deferred_init``), and every CPU draw between that and it
  (what each draws is decided by its function, arguments and layouts, or, for a pinned draw, by values, whose own
  slice is then part of it);
* the state of each explicit ``torch.Generator`` it was given.

Tensors and storages are numbered by their first appearance in the slice, not by the record's numbers, which
differ where ranks recorded other operations on other tensors (the rank's own chunk of an earlier scatter). Only
what decides the values counts, so a rank-dependent buffer that is never sent, or an earlier scatter, refuses
nothing. The digest errs one way: two records with equal digests give equal values (but for draws from another
device's generator, which replays draw from as it is when they run: for those the CPU generator's state stands in
for how the ranks were seeded, as ``torch.manual_seed`` seeds every device; ``torch.cuda.manual_seed`` alone by
rank goes unseen); unequal ones are refused even if the values would happen to agree. All ranks gather every
digest and decide alike, so that all of them raise, not some while others wait in the next collective. torch's
fake process group sends nothing: there each rank plays alone and nothing is compared.
"""

from __future__ import annotations

import bisect
import hashlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from modattrs._deferred import rng
from modattrs._deferred.record import Constant, DeferredInitError, Draws, Op, Position, Record, span_bytes
from modattrs._deferred.recorder import RecordingFakeTensorMode
from modattrs._deferred.slicing import needed_ops
from modattrs._names import callable_name
from modattrs._torch_private import FakeTensor, disable_current_modes

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__: list[str] = []

_DIGEST_SIZE = 32


def digest_of(record: Record, targets: dict[int, int]) -> bytes:
    """The digest of what decides the values of the refs ``targets`` (ref to its storage) in ``record``."""
    return _Digester(record).of_slice(targets, len(record.ops))


class _Digester:
    def __init__(self, record: Record) -> None:
        self.record = record
        self.sliced: dict[tuple[frozenset[tuple[int, int]], int], bytes] = {}

    def of_slice(self, targets: dict[int, int], count: int) -> bytes:
        """The digest of the operations among the first ``count`` that ``targets`` need."""
        key = (frozenset(targets.items()), count)
        found = self.sliced.get(key)
        if found is not None:
            return found
        hasher = hashlib.blake2b(digest_size=_DIGEST_SIZE)
        numbers: dict[tuple[str, int], int] = {}  # (kind, record's number) -> number in this slice

        def number(kind: str, value: int) -> int:
            return numbers.setdefault((kind, value), len(numbers))

        for ref in sorted(targets):  # what is asked, in the slice's numbers
            hasher.update(repr(("target", number("ref", ref), number("storage", targets[ref]))).encode())
        for index in needed_ops(self.record, targets, count):
            op = self.record.ops[index]
            for part in self._parts_of(op, index, number):
                hasher.update(part)
        self.sliced[key] = digest = hasher.digest()
        return digest

    def _parts_of(self, op: Op, index: int, number: Callable[[str, int], int]) -> Iterator[bytes]:
        constants = {constant.index: constant for constant in op.constant_slots}
        generators = dict(op.generator_states)
        slots = {slot.index: slot for slot in op.slots}
        yield repr((callable_name(op.func), op.opaque, str(op.spec), op.default_dtype, op.draws.name)).encode()
        for position, leaf in enumerate(op.flat):
            slot = slots.get(position)
            if slot is not None:
                yield repr(
                    (
                        "tensor",
                        number("ref", slot.ref),
                        number("storage", slot.storage),
                        slot.size,
                        slot.stride,
                        slot.dtype,
                        slot.device.type,
                        slot.written,
                        slot.laid,
                    )
                ).encode()
            elif position in constants:
                yield b"real" + _bytes_digest(constants[position])
            elif position in generators:
                yield b"generator" + _state_digest(generators[position])
            else:
                yield _leaf(leaf).encode()
        yield repr(("returns", [None if ref is None else number("ref", ref) for ref in op.out_refs])).encode()
        if op.draws is Draws.DEFAULT:
            # Another device's generator is drawn from as it is when replayed: the CPU generator's state stands in
            # for how the ranks were seeded (torch.manual_seed seeds every device).
            yield b"drawing from" + self._state_before(index)

    def _state_before(self, index: int) -> bytes:
        """A digest of the default CPU generator's state right before the draw ``index`` of the record (for a CPU
        draw, the state it draws from)."""
        reset = self.record.ops[index].reset
        if reset is not None:
            return b"reset" + _position_digest(reset)
        return _state_after_draws(self.record, bisect.bisect_left(self.record.cpu_draws, index))


# By record: a digest of the default CPU generator's state after each of its CPU draws (Record.cpu_draws), in order.
# A record only grows, and its operations never change: the digests are worked out once, when first asked.
_after_draws: weakref.WeakKeyDictionary[Record, list[bytes]] = weakref.WeakKeyDictionary()


def _state_before_draw(record: Record, k: int) -> bytes:
    """A digest of the state before the ``k``-th CPU draw of ``record`` (after its last one for ``k`` past them)."""
    op = record.ops[record.cpu_draws[k]] if k < len(record.cpu_draws) else None
    if op is not None and op.reset is not None:
        return b"reset" + _position_digest(op.reset)
    return _state_after_draws(record, k)


def _state_after_draws(record: Record, k: int) -> bytes:
    """A digest of the state after the first ``k`` CPU draws of ``record``: from where it began, each draw chained."""
    if k == 0:
        return b"start" + _position_digest(record.start)
    chain = _after_draws.setdefault(record, [])
    while len(chain) < k:
        drawn = len(chain)
        before = _state_before_draw(record, drawn)
        index = record.cpu_draws[drawn]
        chain.append(hashlib.blake2b(before + _what_it_draws(record, index), digest_size=_DIGEST_SIZE).digest())
    return chain[k - 1]


def _what_it_draws(record: Record, index: int) -> bytes:
    """What decides how far the CPU draw ``index`` moves the generator: its call and layouts, and, for a pinned
    draw, the values it reads."""
    op = record.ops[index]
    hasher = hashlib.blake2b(digest_size=_DIGEST_SIZE)
    slots = {slot.index: slot for slot in op.slots}
    constants = {constant.index for constant in op.constant_slots}
    hasher.update(repr((callable_name(op.func), str(op.spec), op.default_dtype)).encode())
    for position, leaf in enumerate(op.flat):
        slot = slots.get(position)
        if slot is not None:
            hasher.update(repr((slot.size, slot.stride, slot.dtype, slot.written)).encode())
        elif position not in constants:
            hasher.update(_leaf(leaf).encode())
    if op.pinned:
        read = {slot.ref: slot.storage for slot in op.slots if not slot.written}
        hasher.update(_Digester(record).of_slice(read, index))
    return hasher.digest()


def _leaf(leaf: object) -> str:
    """A rank-independent text for an argument that is not a tensor: addresses and device indices left out."""
    if isinstance(leaf, torch.device):
        return f"device:{leaf.type}"
    if isinstance(leaf, (list, tuple)):
        return f"{type(leaf).__name__}({', '.join(_leaf(item) for item in leaf)})"
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, torch.dtype, torch.layout)):
        return repr(leaf)
    if isinstance(leaf, torch.memory_format):
        return str(leaf)
    if isinstance(leaf, torch.Generator):
        return "generator"
    # An object of an opaque initializer's call (a function, a module): its kind, as its repr may hold an address.
    return f"<{type(leaf).__module__}.{type(leaf).__qualname__}>"


def _bytes_digest(constant: Constant) -> bytes:
    tensor = constant.recorded if constant.recorded is not None else constant.tensor
    with disable_current_modes():
        raw = span_bytes(tensor).cpu()
        header = repr((tensor.shape, tensor.stride(), tensor.dtype, tensor.is_conj(), tensor.is_neg())).encode()
    return hashlib.blake2b(header + raw.numpy().tobytes(), digest_size=_DIGEST_SIZE).digest()


def _state_digest(state: torch.Tensor) -> bytes:
    with disable_current_modes():
        return hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=_DIGEST_SIZE).digest()


def _position_digest(position: Position) -> bytes:
    if isinstance(position, torch.Tensor):
        return _state_digest(position)
    record, count = position  # a point of another record: the state after its first ``count`` operations drew
    return b"point" + _state_after_draws(record, bisect.bisect_left(record.cpu_draws, count))


def refuse_unless_ranks_agree(
    sent: Sequence[torch.Tensor], group: ProcessGroup, group_src: int, collective: str
) -> None:
    """Raise on every rank of ``group`` unless each one's record decides the tensors ``sent`` (fake tensors of one
    record) as rank ``group_src``'s does (see Note [Ranks must agree on a deferred source])."""
    if dist.get_backend(group) == "fake":
        return  # torch's fake process group: one process plays one rank, with no other to compare with
    mode = sent[0].fake_mode  # type: ignore[attr-defined]
    assert isinstance(mode, RecordingFakeTensorMode)
    record = mode.record
    with rng.lock:
        targets = {}
        for tensor in sent:
            ref, storage = mode.ref_and_storage_of(tensor)  # type: ignore[arg-type]
            targets[-1 - storage if ref is None else ref] = storage  # unknown: the writers of its storage decide
        digest = digest_of(record, targets)
    gathered: list[bytes | None] = [None] * dist.get_world_size(group)
    with disable_current_modes():  # all_gather_object makes real tensors, also inside deferred_init
        dist.all_gather_object(gathered, digest, group=group)
    ranks = dist.get_process_group_ranks(group)
    differing = [rank for rank, other in zip(ranks, gathered, strict=True) if other != gathered[group_src]]
    if not differing:
        return
    raise DeferredInitError(
        f"{_name_of(mode, targets)} cannot be sent from rank {ranks[group_src]} as each rank's own part: the ranks' "
        "deferred values of it differ.\n"
        f"DTensor's {collective} sends rank {ranks[group_src]}'s values; a deferred tensor is replayed as each "
        "rank's own, which are the sender's only when every rank recorded it alike.\n"
        f"expected: the record of it of rank {ranks[group_src]} on ranks {ranks}\n"
        f"got: ranks {differing} recorded it otherwise (another seed, values that depend on the rank, data that only "
        "some ranks loaded)\n"
        "Seed every rank alike before deferred_init and build the same values on each, or materialize_module before "
        "distributing it (rank 0's real values are then sent)"
    )


def _name_of(mode: RecordingFakeTensorMode, targets: dict[int, int]) -> str:
    """The name in the module ``deferred_init`` returned of a tensor whose memory the slice of ``targets`` touches
    (the parameter a scatter's chunks were cut from); else "a deferred tensor"."""
    record = mode.record
    root = record.root() if record.root is not None else None
    if root is None:
        return "a deferred tensor"
    touched = {
        slot.storage for index in needed_ops(record, targets, len(record.ops)) for slot in record.ops[index].slots
    }
    touched.update(targets.values())
    for name, tensor in (*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)):
        local = getattr(tensor, "_local_tensor", tensor)  # a DTensor parameter of an earlier placement
        if isinstance(local, FakeTensor) and local.fake_mode is mode and mode.storage_of(local) in touched:
            return name
    return "a deferred tensor"
