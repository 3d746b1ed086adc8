"""The optional C extension, ``modattrs/_speedups.c``, imported and checked in one place: the modules that use it
take it from here, as None where pip built no extension (no C compiler)."""

from __future__ import annotations

import types

#: What this version of ``_speedups.c`` defines. An extension without one of them is a build of another version.
NAMES = (
    "bind",
    "read",
    "dispatch_unless_compiling",
    "forward_unless_index",
    "instance_method",
    "mt19937_power_of_x",
    "mt19937_twisted",
)


def stale_build(module: types.ModuleType) -> ImportError:
    """The error for an extension built from another version of the C file, left in a checkout."""
    return ImportError(
        "modattrs._speedups, the C extension, was built from another version of modattrs/_speedups.c.\n"
        f"extension: {module.__file__}\n"
        "Rebuild it: reinstall modattrs (pip install -e . in a checkout)"
    )


def _load() -> types.ModuleType | None:
    try:
        from modattrs import _speedups
    except ImportError:  # installed without a C compiler: the same work, in Python
        return None
    if not all(hasattr(_speedups, name) for name in NAMES):
        raise stale_build(_speedups)
    return _speedups


speedups: types.ModuleType | None = _load()
