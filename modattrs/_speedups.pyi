import types

from torch import Tensor

from modattrs.virtual import VirtualTensor

def read(attribute: VirtualTensor, /) -> Tensor: ...
def bind(cls: type[VirtualTensor], buffer_table: str, cache: types.ModuleType, /) -> None: ...
