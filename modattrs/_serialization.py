"""What ``torch.load(..., weights_only=True)`` must be allowed to build for modules with modattrs attributes."""

from __future__ import annotations

from typing import Any

from modattrs._attribute import LoadedHook, LoadHook, SaveHook, _rebuild
from modattrs._cache import Cache
from modattrs._torch_private import WrappedHook
from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor

__all__ = ["safe_globals"]


def safe_globals() -> list[Any]:
    """The modattrs objects that a pickled module refers to, for ``torch.serialization``'s allowlist.

    ``torch.load`` with the default ``weights_only=True`` refuses to build any object it was not told about. A
    whole module saved with ``torch.save(module)`` loads once its own classes and these are allowed::

        torch.serialization.add_safe_globals([*modattrs.safe_globals(), MyModel, nn.Linear])

    or, for one load only, ``with torch.serialization.safe_globals([...]):``. A callable materializer (a
    function rather than a method name) must be allowed too. Loading a ``state_dict`` needs none of this.
    """
    # Saved files name these by module path and qualified name (tests/test_saved_format.py lists the names they
    # pin). torch's allowlist matches that path, not the object: if one of them ever moves, keep a shim at the old
    # path and add (object, "old.path.Name") pairs here, or files saved before stop loading with weights_only.
    return [VirtualTensor, ShapedTensor, _rebuild, SaveHook, LoadHook, LoadedHook, Cache, WrappedHook]
