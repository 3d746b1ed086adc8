"""The classification of a module's parameters and buffers from a ledger's table, as text, JSON, and a strict check.

Note [Statuses of a tensor]
Each name of a parameter or buffer (tied names each, ``remove_duplicate=False``) gets one status, the first that
applies: ``no data`` (fake or meta: nothing to write), ``tied`` (the same tensor as an earlier name, reported
there), ``unwritten`` (bytes allocated while the ledger watched that nothing wrote), ``computed from unwritten``
(bytes computed from such bytes), ``overwritten after loading`` (loaded bytes that a later write replaced with
something not loaded), then what wrote every byte: ``loaded``, ``initialized``, ``computed``, ``received``, or
``mixed`` when bytes differ, and ``unseen`` for bytes the ledger never saw written (tensors made before the watch,
or by code below torch's dispatcher). The first three problems, and ties broken since a conversion (Note [Scoped
wraps of a watch]), make the strict check fail.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from modattrs._ledger.intervals import merged
from modattrs._ledger.provenance import Origin, Write
from modattrs._ledger.session import Session, local_data
from modattrs._torch_private import FakeTensor, address_of, non_persistent_buffers_of

__all__ = ["Entry", "LedgerError", "Part", "Report", "Tie", "report_of"]

UNWRITTEN = "unwritten"
TAINTED = "computed from unwritten"
OVERWRITTEN = "overwritten after loading"
TIED = "tied"
NO_DATA = "no data"
UNSEEN = "unseen"
MIXED = "mixed"
PROBLEMS = (UNWRITTEN, TAINTED, OVERWRITTEN)

Range = tuple[int, int]


class LedgerError(RuntimeError):
    """Tensors of a module hold bytes nothing wrote, were computed from such bytes, lost what was loaded into them,
    or lost a tie: raised by :meth:`Report.check`, listing each by name with the fix."""


@dataclass(frozen=True)
class Part:
    """Bytes of a tensor with one provenance: ``kind``, how many bytes, which (offsets from the tensor's first byte,
    half-open), and what wrote them (or allocated them, for unwritten bytes)."""

    kind: str
    nbytes: int
    ranges: tuple[Range, ...]
    what: str


@dataclass(frozen=True)
class Entry:
    """One name of a parameter or buffer of the module, and what its bytes hold (Note [Statuses of a tensor])."""

    name: str
    role: str  # "parameter", "buffer" or "non-persistent buffer"
    shape: tuple[int, ...]
    dtype: str
    device: str
    nbytes: int
    status: str
    parts: tuple[Part, ...] = ()
    tied_to: str | None = None

    @property
    def problem(self) -> bool:
        return self.status in PROBLEMS

    def ranges(self, kind: str) -> tuple[Range, ...]:
        """The byte ranges of the parts of one ``kind`` (``"unwritten"``, ``"loaded"``...)."""
        return tuple(merged([r for part in self.parts if part.kind == kind for r in part.ranges]))


@dataclass(frozen=True)
class Tie:
    """Names that were one tensor when a conversion began (``op`` at ``where``), and whether they still are."""

    names: tuple[str, ...]
    holds: bool
    op: str
    where: str | None


@dataclass
class Report:
    """What a ledger saw written into each parameter and buffer of a module."""

    entries: list[Entry] = field(default_factory=list)
    ties: list[Tie] = field(default_factory=list)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def __getitem__(self, name: str) -> Entry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(name)

    @property
    def problems(self) -> list[Entry]:
        return [entry for entry in self.entries if entry.problem]

    @property
    def broken_ties(self) -> list[Tie]:
        return [tie for tie in self.ties if not tie.holds]

    @property
    def unwritten(self) -> list[Entry]:
        return [entry for entry in self.entries if entry.status == UNWRITTEN]

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for entry in self.entries:
            counts[entry.status] = counts.get(entry.status, 0) + 1
        return counts

    def to_json(self, **dumps: Any) -> str:
        """The report as JSON: ``{"counts", "entries", "ties"}``, each entry with its parts."""
        document = {
            "counts": self.counts(),
            "entries": [asdict(entry) for entry in self.entries],
            "ties": [asdict(tie) for tie in self.ties],
        }
        return json.dumps(document, **dumps)

    def to_text(self, *, all_entries: bool = True) -> str:
        """A table, one line per name (problems first), then the ties; ``all_entries=False`` shows problems only."""
        counts = ", ".join(f"{status} {count}" for status, count in sorted(self.counts().items()))
        problems = len(self.problems) + len(self.broken_ties)
        lines = [f"write ledger: {len(self.entries)} tensors ({counts}); {problems} problem(s)"]
        shown = sorted(self.entries, key=lambda entry: not entry.problem)
        if not all_entries:
            shown = [entry for entry in shown if entry.problem]
        if shown:
            width = max(len(entry.name) for entry in shown)
            lines.append(f"{'name':<{width}}  {'status':<25} {'bytes':>10}  what")
            for entry in shown:
                lines.append(f"{entry.name:<{width}}  {entry.status:<25} {entry.nbytes:>10}  {_what(entry)}")
        for tie in self.ties:
            state = "holds" if tie.holds else "BROKEN"
            before = tie.op if tie.where is None else f"{tie.op} at {tie.where}"
            lines.append(f"tie {' = '.join(tie.names)}: {state} (one tensor before {before})")
        return "\n".join(lines)

    def check(self) -> None:
        """Raise :class:`LedgerError` listing every unwritten, garbage-derived or overwritten tensor and every
        broken tie, each with its fix; return if there is none."""
        problems = self.problems
        broken = self.broken_ties
        if not problems and not broken:
            return
        lines = [
            f"{len(problems) + len(broken)} problem(s) in the module's tensors: bytes nothing wrote, values computed "
            "from them, loaded values written over, or ties lost"
        ]
        for entry in problems:
            lines.append(f"- {entry.name} ({entry.role}, {entry.nbytes} bytes): {entry.status}")
            lines.append(f"    expected: {_expected(entry)}")
            lines.append(f"    got: {_got(entry)}")
            lines.append(f"    fix: {_fix(entry)}")
        for tie in broken:
            before = tie.op if tie.where is None else f"{tie.op} at {tie.where}"
            lines.append(f"- {' and '.join(tie.names)}: a tie lost")
            lines.append(f"    expected: one tensor, as before {before}")
            lines.append("    got: separate tensors")
            lines.append(f"    fix: {_TIE_FIX}")
        raise LedgerError("\n".join(lines))


_TIE_FIX = "tie them again after the conversion (transformers: model.tie_weights()), or assign one Parameter to both"


def _what(entry: Entry) -> str:
    if entry.tied_to is not None:
        return f"same tensor as {entry.tied_to}"
    if len(entry.parts) == 1 and entry.parts[0].kind != UNWRITTEN:
        return entry.parts[0].what
    described = [f"{part.kind} {_ranges(part.ranges, entry.nbytes)}: {part.what}" for part in entry.parts]
    return "; ".join(described) or "-"


def _ranges(ranges: tuple[Range, ...], total: int) -> str:
    shown = ", ".join(f"{start}-{end - 1}" for start, end in ranges[:4])
    more = f" and {len(ranges) - 4} more ranges" if len(ranges) > 4 else ""
    return f"bytes {shown}{more} of {total}"


def _expected(entry: Entry) -> str:
    if entry.status == OVERWRITTEN:
        return "the loaded values, kept"
    return "every byte written by a load, an initializer or a computation on written bytes"


def _got(entry: Entry) -> str:
    kinds = {UNWRITTEN: UNWRITTEN, TAINTED: "computed", OVERWRITTEN: "overwritten"}
    part_kind = {UNWRITTEN: UNWRITTEN, TAINTED: TAINTED, OVERWRITTEN: OVERWRITTEN}[entry.status]
    parts = [part for part in entry.parts if part.kind == part_kind]
    ranges = tuple(merged([r for part in parts for r in part.ranges]))
    return f"{_ranges(ranges, entry.nbytes)} {kinds[entry.status]}: " + "; ".join(part.what for part in parts)


def _fix(entry: Entry) -> str:
    if entry.status == OVERWRITTEN:
        return ("initialize before loading, or skip loaded tensors in the initializer (transformers marks them "
                "_is_hf_initialized)")  # fmt: skip
    if entry.status == TAINTED:
        return "write the unwritten tensor it was computed from first, then compute this one"
    if entry.role == "non-persistent buffer":
        return ("no checkpoint holds a non-persistent buffer: compute it again after to_empty (or make it a "
                "modattrs.VirtualTensor, computed when read)")  # fmt: skip
    return "initialize it after to_empty (init_weights(), reset_parameters()) or load it: nothing wrote these bytes"


# --- classification --------------------------------------------------------------------------------------------------


def _roles(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    for name, parameter in module.named_parameters(remove_duplicate=False):
        yield name, "parameter", parameter
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        hidden = non_persistent_buffers_of(owner)
        for name, buffer in owner.named_buffers(recurse=False, remove_duplicate=False):
            role = "non-persistent buffer" if name in hidden else "buffer"
            yield (f"{owner_name}.{name}" if owner_name else name), role, buffer


def _identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    local = local_data(tensor)
    if local is None:
        return ("object", id(tensor))
    return (address_of(local.untyped_storage()), local.storage_offset(), local.shape, local.stride(), local.dtype)


def report_of(session: Session, module: nn.Module) -> Report:
    session.label_reads()
    report = Report()
    first_names: dict[tuple[Any, ...] | None, str] = {}
    identities: dict[str, tuple[Any, ...] | None] = {}
    for name, role, tensor in _roles(module):
        identity = _identity(tensor)
        identities[name] = identity
        common: dict[str, Any] = {
            "name": name,
            "role": role,
            "shape": tuple(int(length) for length in tensor.shape),
            "dtype": str(tensor.dtype).removeprefix("torch."),
            "device": str(tensor.device),
            "nbytes": tensor.numel() * tensor.element_size(),
        }
        if identity in first_names:
            report.entries.append(Entry(status=TIED, tied_to=first_names[identity], **common))
            continue
        first_names[identity] = name
        report.entries.append(_classified(session, tensor, common))
    report.ties = _ties(session, module, identities)
    return report


def _classified(session: Session, tensor: torch.Tensor, common: dict[str, Any]) -> Entry:
    local = local_data(tensor)
    if local is None:
        what = "fake" if isinstance(tensor, FakeTensor) else "meta" if tensor.is_meta else type(tensor).__name__
        return Entry(status=NO_DATA, parts=(Part(NO_DATA, 0, (), f"a {what} tensor holds no data"),), **common)
    base = int(local.storage_offset()) * local.element_size()
    groups: dict[int, tuple[str, list[Range], str]] = {}
    seen_any = False
    for piece in session.table.pieces(local):
        seen_any = True
        span: Range = (piece.start - base, piece.end - base)
        key, kind, what = _piece_kind(piece.write, piece.allocated)
        groups.setdefault(key, (kind, [], what))[1].append(span)
    if not seen_any and local.numel():
        groups[0] = (UNSEEN, [(0, int(local.numel() * local.element_size()))], _UNSEEN_WHAT)
    parts = tuple(
        Part(kind, sum(end - start for start, end in merged(ranges)), tuple(merged(ranges)), what)
        for kind, ranges, what in groups.values()
    )
    kinds = {part.kind for part in parts}
    status = next((problem for problem in PROBLEMS if problem in kinds), None)
    if status is None:
        status = next(iter(kinds)) if len(kinds) == 1 else MIXED if kinds else UNSEEN
    return Entry(status=status, parts=parts, **common)


_UNSEEN_WHAT = "not written while the ledger watched (made before, or out of its sight)"


def _piece_kind(write: Write | None, allocated: Origin | None) -> tuple[int, str, str]:
    if write is None:
        if allocated is not None:
            return id(allocated), UNWRITTEN, f"allocated by {allocated}, never written"
        return 0, UNSEEN, _UNSEEN_WHAT
    if write.tainted is not None:
        return id(write), TAINTED, f"{write.describe()}, reading bytes that {write.tainted} allocated and nothing wrote"
    if write.overwrote is not None:
        return id(write), OVERWRITTEN, f"loaded {write.overwrote.describe()}, then {write.kind} by {write.describe()}"
    return id(write), write.kind, write.describe()


def _ties(session: Session, module: nn.Module, identities: dict[str, tuple[Any, ...] | None]) -> list[Tie]:
    prefixes = {id(owner): name for name, owner in module.named_modules(remove_duplicate=False)}
    latest: dict[tuple[str, ...], Tie] = {}
    for before in session.ties:
        owner = before.module()
        if owner is None or id(owner) not in prefixes:
            continue
        prefix = prefixes[id(owner)]
        for group in before.groups:
            names = tuple(f"{prefix}.{name}" if prefix else name for name in group)
            if not all(name in identities for name in names):
                continue
            holds = len({identities[name] for name in names}) == 1
            where = None if before.where is None else str(before.where)
            latest[names] = Tie(names, holds, before.op, where)
    return list(latest.values())
