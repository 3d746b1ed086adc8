"""The optional C extensions, imported and checked in one place: the modules that use them take them from here, as
None where pip built no extension (no C compiler).

- ``speedups`` (``modattrs/_speedups.c``): ``VirtualTensor.value``'s read and fake mode's entries.
- ``generator_jump`` (``modattrs/_generator_jump.c``): the two loops of the CPU generator's jump
  (``modattrs/_deferred/rng/mt19937.py``).
"""

from __future__ import annotations

import importlib
import types

#: What this version of each C file defines, by extension. An extension without one of them is a build of another
#: version.
NAMES = {
    "_speedups": ("bind", "read", "dispatch_unless_compiling", "forward_unless_index", "instance_method"),
    "_generator_jump": ("mt19937_power_of_x", "mt19937_twisted", "mt19937_methods"),
}


def stale_build(module: types.ModuleType) -> ImportError:
    """The error for an extension built from another version of its C file, left in a checkout."""
    name = module.__name__.rpartition(".")[2]
    return ImportError(
        f"{module.__name__}, a C extension, was built from another version of modattrs/{name}.c.\n"
        f"extension: {module.__file__}\n"
        "Rebuild it: reinstall modattrs (pip install -e . in a checkout)"
    )


def _load(name: str) -> types.ModuleType | None:
    try:
        module = importlib.import_module(f"modattrs.{name}")
    except ImportError:  # installed without a C compiler: the same work, in Python (or torch)
        return None
    if not all(hasattr(module, attribute) for attribute in NAMES[name]):
        raise stale_build(module)
    return module


speedups: types.ModuleType | None = _load("_speedups")
generator_jump: types.ModuleType | None = _load("_generator_jump")
