import types
from collections.abc import Callable
from typing import Any

from torch import Tensor

from modattrs.virtual import VirtualTensor

def read(attribute: VirtualTensor, /) -> Tensor: ...
def bind(cls: type[VirtualTensor], buffer_table: str, cache: types.ModuleType, /) -> None: ...
def dispatch_unless_compiling(
    frame_hook: Callable[[], object], raw: Callable[..., Any], wrapped: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any: ...
def forward_unless_index(
    python_method: Callable[..., Any],
    mode: object,
    func: Callable[..., Any],
    types: object,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    /,
) -> Any: ...
def instance_method(callable: Callable[..., Any], /) -> Any: ...
