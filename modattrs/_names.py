"""How error messages name the callables and objects users gave modattrs."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types

import torch

from modattrs._torch_private import OpOverload

__all__: list[str] = []


def callable_name(obj: object) -> str:
    """``module.qualname`` of a function or class, the schema name of an aten operation, the name of a Python
    module, or else the name of the object's type."""
    if isinstance(obj, OpOverload):
        return str(obj)
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None:
        return str(getattr(obj, "__name__", None) or type(obj).__name__)
    module = getattr(obj, "__module__", None)
    return f"{module}.{qualname}" if module else str(qualname)


# --- where an operation happened, for error messages -----------------------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.dirname(path) + os.sep for path in (torch.__file__, __file__, contextlib.__file__, functools.__file__)
)


def where() -> str:
    """The innermost module method running and the first source line outside torch and modattrs."""
    frame = sys._getframe(1)
    method: str | None = None
    line: str | None = None
    while frame is not None and (method is None or line is None):
        code = frame.f_code
        # Before Python 3.13 reading f_locals keeps a copy of the locals on the frame, which a traceback then keeps
        # alive: only methods are read.
        if method is None and code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                method = f"{type(owner).__name__}.{code.co_name}"
        if line is None and not in_library(code):
            line = f"{code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    parts = [f"in {method}" if method else "outside any module", f"at {line}" if line else None]
    return ", ".join(part for part in parts if part)


def in_library(code: types.CodeType) -> bool:
    """Whether ``code`` is torch's, modattrs' or the standard library's."""
    return code.co_filename.startswith(_LIBRARY_DIRS) or "<frozen" in code.co_filename


def load_error(key: str, message: str) -> str:
    """``message`` about ``key`` as an entry of ``load_state_dict``'s error list, which torch joins with a newline and
    a tab: the lines after its first indented under it, so that each entry reads as one."""
    return f"{key}: " + message.replace("\n", "\n\t  ")
