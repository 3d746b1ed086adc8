"""What a ledger changes while it watches, and puts back when the last watch ends.

Note [Scoped wraps of a watch]
A dispatch mode sees operations, not where their inputs come from. While at least one ledger watches, in the whole
process (threads included: transformers reads checkpoints in a thread pool):
- ``nn.Module.load_state_dict`` tags each tensor of the state dict it is given as checkpoint data under its key, so
  that the copy into the module (or the tensor itself, with ``assign=True``) is loaded under that key;
- ``torch.load`` tags the tensors it returns under their path in what it returns;
- safetensors' ``load_file``, ``load`` and ``safe_open`` (its handles' ``get_tensor`` and ``get_slice``) tag theirs
  under their names; they are replaced wherever a module bound them by name (``from safetensors import safe_open``);
- ``nn.Module._apply``, through which every conversion runs, tells the ledger the module's ties before the outermost
  conversion (``to_empty`` breaks ties between parameters on the meta device);
- the initializers of ``torch.nn.init`` (``normal_``, ``trunc_normal_``, ``orthogonal_``...) say, in their thread,
  that an initializer runs: what they write is initialized by them, whatever operations they write it with
  (``trunc_normal_`` resamples by reading its own draws, ``orthogonal_`` copies a QR factor). Code that imported an
  initializer by name before the watch keeps torch's function, and its writes are labelled by their operations.
Each wrap calls what it replaced and returns what it returns; when the last watch ends every replaced name holds what
it held before (a name rebound since is left alone). ``docs/ledger.rst`` lists them for users.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import nn

from modattrs._ledger.provenance import Where, user_line
from modattrs._torch_private import MODULE_CONVERSION

__all__ = ["Sink", "conversion_running", "initializer_running", "start", "stop"]


class Sink(Protocol):
    def loaded(self, tensor: torch.Tensor, key: str, op: str, where: Where | None) -> None: ...

    def converting(self, module: nn.Module, op: str, where: Where | None) -> None: ...


#: The in-place initializers of torch.nn.init (its deprecated aliases without the underscore call these).
_INITIALIZER_NAMES = tuple(
    name
    for name, value in vars(nn.init).items()
    if name.endswith("_") and not name.startswith("_") and callable(value)
    and getattr(value, "__module__", None) == nn.init.__name__
)  # fmt: skip

_lock = threading.RLock()
_sinks: list[Sink] = []
_replaced: list[tuple[Any, str, object, object]] = []  # (owner, name, original, replacement)
_depth = threading.local()

#: Names under which modules bind the loaders this file wraps.
_BOUND_NAMES = frozenset({"load", "safe_open", "load_file", "safe_load_file", "safe_load", "torch_load"})


def _tag(tensor: object, key: str, op: str, where: Where | None) -> None:
    if isinstance(tensor, torch.Tensor):
        for sink in list(_sinks):
            sink.loaded(tensor, key, op, where)


def _tag_tree(value: object, prefix: str, op: str, where: Where | None) -> None:
    if isinstance(value, torch.Tensor):
        _tag(value, prefix, op, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _tag_tree(item, f"{prefix}.{key}" if prefix else str(key), op, where)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _tag_tree(item, f"{prefix}.{index}" if prefix else str(index), op, where)


def _file_name(args: tuple[Any, ...], kwargs: dict[str, Any], keyword: str) -> str:
    source = args[0] if args else kwargs.get(keyword)
    return repr(str(source)) if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__") else "a stream"


def _wrap_load_state_dict(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load_state_dict(self: nn.Module, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        if _sinks and hasattr(state_dict, "items"):
            where = user_line()
            for key, value in state_dict.items():
                _tag(value, str(key), "load_state_dict", where)
        return original(self, state_dict, *args, **kwargs)

    return load_state_dict


def _wrap_conversion(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def convert(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_depth, "value", 0)
        if depth == 0 and _sinks:
            _depth.caller = sys._getframe(1).f_code.co_name  # to_empty, to, half, cuda...
            for sink in list(_sinks):
                sink.converting(self, _depth.caller, user_line())
        _depth.value = depth + 1
        try:
            return original(self, *args, **kwargs)
        finally:
            _depth.value = depth

    return convert


_initializing = threading.local()


def initializer_running() -> list[Any] | None:
    """``[name, where, label]`` of the outermost ``torch.nn.init`` initializer running in this thread, if one is; the
    tracking mode fills ``label`` at the first write, so that one call's writes share one label."""
    running: list[Any] | None = getattr(_initializing, "running", None)
    return running


def _holds_no_data(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an initializer's tensor is a meta tensor: nothing to label (Note [Labels only for bytes that exist]
    in ``tracking.py``)."""
    tensor = args[0] if args else kwargs.get("tensor")
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


def _wrap_initializer(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initializer(*args: Any, **kwargs: Any) -> Any:
        if getattr(_initializing, "running", None) is not None or not _sinks or _holds_no_data(args, kwargs):
            return original(*args, **kwargs)
        _initializing.running = [f"nn.init.{original.__name__}", user_line(), None]
        try:
            return original(*args, **kwargs)
        finally:
            _initializing.running = None

    return initializer


def conversion_running() -> str | None:
    """The name of the module conversion running in this thread (``to_empty``...), if one is."""
    return getattr(_depth, "caller", None) if getattr(_depth, "value", 0) else None


def _wrap_tree_loader(original: Callable[..., Any], op: str, keyword: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if _sinks:
            _tag_tree(result, "", f"{op}({_file_name(args, kwargs, keyword)})", user_line())
        return result

    return load


class _TaggingSlice:
    """A safetensors slice whose reads are tagged as checkpoint data under the tensor's name."""

    def __init__(self, inner: Any, key: str, op: str) -> None:
        self._inner, self._key, self._op = inner, key, op

    def __getitem__(self, index: Any) -> Any:
        tensor = self._inner[index]
        _tag(tensor, self._key, self._op, user_line())
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _TaggingHandle:
    """A safetensors handle (``safe_open``) whose tensors are tagged as checkpoint data under their names."""

    def __init__(self, inner: Any, op: str) -> None:
        self._inner, self._op = inner, op

    def __enter__(self) -> _TaggingHandle:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> Any:
        return self._inner.__exit__(*exc)

    def get_tensor(self, name: str) -> Any:
        tensor = self._inner.get_tensor(name)
        _tag(tensor, name, self._op, user_line())
        return tensor

    def get_slice(self, name: str) -> _TaggingSlice:
        return _TaggingSlice(self._inner.get_slice(name), name, self._op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _wrap_safe_open(original: Callable[..., Any]) -> Callable[..., Any]:
    def safe_open(*args: Any, **kwargs: Any) -> Any:
        handle = original(*args, **kwargs)
        return _TaggingHandle(handle, f"safetensors({_file_name(args, kwargs, 'filename')})") if _sinks else handle

    safe_open.__wrapped__ = original  # type: ignore[attr-defined]
    safe_open.__doc__ = original.__doc__
    return safe_open


def _replace(owner: Any, name: str, replacement: object) -> None:
    _replaced.append((owner, name, getattr(owner, name), replacement))
    setattr(owner, name, replacement)


def _install() -> None:
    _replace(nn.Module, "load_state_dict", _wrap_load_state_dict(nn.Module.load_state_dict))
    _replace(nn.Module, MODULE_CONVERSION, _wrap_conversion(getattr(nn.Module, MODULE_CONVERSION)))
    for name in _INITIALIZER_NAMES:
        _replace(nn.init, name, _wrap_initializer(getattr(nn.init, name)))
    loaders: dict[int, object] = {id(torch.load): _wrap_tree_loader(torch.load, "torch.load", "f")}
    originals: dict[int, object] = {id(torch.load): torch.load}
    if "safetensors" in sys.modules or importlib.util.find_spec("safetensors") is not None:
        import safetensors
        import safetensors.torch

        for original, wrapped in (
            (safetensors.safe_open, _wrap_safe_open(safetensors.safe_open)),
            (safetensors.torch.load_file, _wrap_tree_loader(safetensors.torch.load_file, "safetensors", "filename")),
            (safetensors.torch.load, _wrap_tree_loader(safetensors.torch.load, "safetensors", "data")),
        ):
            loaders[id(original)] = wrapped
            originals[id(original)] = original
    for module, name in _bindings(loaders):
        value = getattr(module, name, None)
        if id(value) in loaders and originals[id(value)] is value:
            _replace(module, name, loaders[id(value)])


#: The modules looked at for bindings of the loaders (name -> module), and those found (name -> (module, names)):
#: a module's bindings are looked for once, when it is first seen, not at every watch (thousands of modules).
_modules_seen: dict[str, object] = {}
_bindings_found: dict[str, tuple[ModuleType, tuple[str, ...]]] = {}


def _bindings(loaders: dict[int, object]) -> list[tuple[ModuleType, str]]:
    seen, found = _modules_seen, _bindings_found
    # Most watches find no module new or replaced since the last one: that is one comparison of two dicts in C (a
    # module compares equal only to itself), without copying sys.modules; otherwise the pass allocates nothing per
    # module it has seen, which in a large process could set off a full garbage collection.
    if sys.modules == seen:
        return [(module, name) for module, names in found.values() for name in names]
    modules = dict(sys.modules)  # copied in C: another thread may import meanwhile
    unseen = [(name, module) for name, module in modules.items() if seen.get(name) is not module]
    for module_name, module in unseen:
        seen[module_name] = module
        found.pop(module_name, None)
        namespace = getattr(module, "__dict__", None) if isinstance(module, ModuleType) else None
        if namespace is not None and isinstance(module, ModuleType):
            bound = namespace.keys() & _BOUND_NAMES  # looks up the few names in the namespace, in C
            names = tuple(name for name in bound if id(namespace.get(name)) in loaders) if bound else ()
            if names:
                found[module_name] = (module, names)
    if len(seen) != len(modules):  # some were removed from sys.modules: forget them, or no later pass is quick
        for module_name in [name for name in seen if name not in modules]:
            del seen[module_name]
            found.pop(module_name, None)
    return [(module, name) for module, names in found.values() for name in names]


def _uninstall() -> None:
    while _replaced:
        owner, name, original, replacement = _replaced.pop()
        if getattr(owner, name, None) is replacement:
            setattr(owner, name, original)


def start(sink: Sink) -> None:
    with _lock:
        if not _sinks:
            _install()
        _sinks.append(sink)


def stop(sink: Sink) -> None:
    with _lock:
        _sinks.remove(sink)
        if not _sinks:
            _uninstall()
