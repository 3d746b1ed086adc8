"""Tensor attributes for ``nn.Module`` that are more than a plain buffer."""

from typing import TYPE_CHECKING

from modattrs._cache import cached
from modattrs._serialization import safe_globals
from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor, sync_references

if TYPE_CHECKING:
    from modattrs._checkpoint import ResizingLoadPlanner

__all__ = ["ResizingLoadPlanner", "ShapedTensor", "VirtualTensor", "cached", "safe_globals", "sync_references"]
__version__ = "0.1.0"

# Names defined in private modules say where users import them: in tracebacks, reprs and the docs.
cached.__module__ = safe_globals.__module__ = __name__


def __getattr__(name: str) -> object:
    # torch.distributed.checkpoint takes most of a second to import: only when this is asked for.
    if name == "ResizingLoadPlanner":
        from modattrs._checkpoint import ResizingLoadPlanner

        ResizingLoadPlanner.__module__ = __name__
        return ResizingLoadPlanner
    raise AttributeError(f"module 'modattrs' has no attribute {name!r}")
