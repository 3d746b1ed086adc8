"""The optional C extensions, imported and checked in one place: the modules that use them take them from here, as
None where pip built no extension (no C compiler).

- ``speedups`` (``modattrs/_speedups.c``): ``VirtualTensor.value``'s read and fake mode's entries.
- ``generator_jump`` (``modattrs/_generator_jump.c``): the two loops of the CPU generator's jump
  (``modattrs/_deferred/rng/mt19937.py``).
- ``generator_draws`` (``modattrs/_generator_draws.c``): the CPU generator's ``uniform_``, drawn as torch's kernel
  draws it (``modattrs/_deferred/rng/kernels.py``).
"""

from __future__ import annotations

import functools
import importlib
import types

from modattrs._torch_private import TorchDispatchMode, dispatch_as_written, dynamo_frame_hook

#: What this version of each C file defines, by extension. An extension without one of them is a build of another
#: version.
NAMES = {
    "_speedups": ("bind", "read", "dispatch_unless_compiling", "forward_unless_index", "instance_method"),
    "_generator_jump": ("mt19937_power_of_x", "mt19937_twisted", "mt19937_methods"),
    "_generator_draws": ("mt19937_uniform",),
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
generator_draws: types.ModuleType | None = _load("_generator_draws")


# Note [A dispatch entry dynamo cannot see]
# torch wraps the __torch_dispatch__ of every dispatch mode class (2.13, 2.15; not 2.8) in a dynamo "disable", so
# that dynamo, while it compiles or runs compiled code, does not trace the mode's Python code. Outside compiled code
# the wrapper only sets and restores dynamo's frame hook, None both times, at 1.2 to 2.3 us per operation: 3% of a
# fake build, a tenth of what the write ledger adds to an operation. The entry below is C: it calls the method as
# written while no frame hook is set, and torch's wrapper otherwise. It has to be C, not Python: a Python entry would
# itself start a frame, which a set hook intercepts before the entry could choose.
def install_dispatch_entry(mode: type[TorchDispatchMode]) -> None:
    """Give ``mode``'s own ``__torch_dispatch__`` the C entry of Note [A dispatch entry dynamo cannot see]; nothing
    where pip built no extension, or torch wrapped nothing (2.8)."""
    wrapped = vars(mode)["__torch_dispatch__"]
    written = dispatch_as_written(wrapped)
    if speedups is not None and written is not None:
        entry = functools.partial(speedups.dispatch_unless_compiling, dynamo_frame_hook, written, wrapped)
        mode.__torch_dispatch__ = speedups.instance_method(entry)  # type: ignore[method-assign]
