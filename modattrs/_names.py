"""How error messages name the callables and objects users gave modattrs."""

from __future__ import annotations

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
