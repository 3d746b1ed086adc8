"""What wrote bytes: the labels a ledger keeps per byte interval, and the line of user code that made each write.

Note [Provenance of a write]
Every label says how its bytes got their values: ``loaded`` (from a checkpoint: the key), ``initialized`` (a fill, a
random initializer, a factory such as ``zeros`` or ``arange``, or a tensor made from Python data), ``computed``
(from other tensors), ``received`` (a collective, from another rank). A write keeps the kind of what it reads when it
copies, casts or rearranges bytes of that one kind (merging experts with ``stack``: loaded, under all their keys), or
rewrites a tensor in place reading nothing else (scaling what ``normal_`` drew); anything else is computed. A write
that reads bytes nothing wrote is ``computed`` and *tainted*: its values come from garbage as surely as the garbage
itself (a cos/sin table made from an uninitialized ``inv_freq``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from types import FrameType

import torch

__all__ = ["COMPUTED", "INITIALIZED", "LOADED", "RECEIVED", "Origin", "Where", "Write", "user_line"]

LOADED = "loaded"
INITIALIZED = "initialized"
COMPUTED = "computed"
RECEIVED = "received"


@dataclass(slots=True)
class Where:
    """A line of code: the first frame outside torch and modattrs when the write happened."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(slots=True)
class Origin:
    """The call that allocated memory without values (``empty``, ``empty_like``, ``to_empty``...)."""

    op: str
    where: Where | None

    def __str__(self) -> str:
        return self.op if self.where is None else f"{self.op} at {self.where}"


@dataclass(slots=True, eq=False)
class Write:
    """How some bytes got their values; compared by identity, so that neighbouring bytes written together merge.

    ``keys`` name the checkpoint entries of loaded bytes; ``tainted`` is the allocation of unwritten bytes a
    computation read; ``overwrote`` is the load whose bytes this write replaced (an initialization after loading).
    """

    kind: str
    op: str
    where: Where | None
    keys: tuple[str, ...] = ()
    tainted: Origin | None = None
    overwrote: Write | None = None

    def describe(self) -> str:
        what = self.op if self.where is None else f"{self.op} at {self.where}"
        if self.kind == LOADED and self.keys:
            return f"{_keys(self.keys)} ({what})"
        return what


def _keys(keys: tuple[str, ...]) -> str:
    shown = ", ".join(repr(key) for key in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


_INTERNAL = tuple(
    os.path.dirname(path) + os.sep
    for path in (torch.__file__, os.path.dirname(os.path.abspath(__file__)))  # torch/, modattrs/
)
_internal_files: dict[str, bool] = {}


def _is_internal(filename: str) -> bool:
    found = _internal_files.get(filename)
    if found is None:
        found = os.path.abspath(filename).startswith(_INTERNAL) or filename.startswith("<frozen ")
        _internal_files[filename] = found
    return found


def user_line() -> Where | None:
    """The first frame of the calling stack outside torch and modattrs (frozen modules of Python skipped too)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return Where(_short_path(frame.f_code.co_filename), frame.f_lineno, frame.f_code.co_name)


_short_paths: dict[str, str] = {}


def _short_path(filename: str) -> str:
    """A file's path as users read it: relative to the working directory (as it was first seen) below it."""
    short = _short_paths.get(filename)
    if short is None:
        try:
            relative = os.path.relpath(filename)
        except ValueError:  # another drive, on Windows
            relative = filename
        short = _short_paths[filename] = filename if relative.startswith("..") else relative
    return short
