"""Tensor attributes for ``nn.Module`` that are more than a plain buffer."""

from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor

__all__ = ["ShapedTensor", "VirtualTensor"]
__version__ = "0.1.0"
