"""Tensor attributes for ``nn.Module`` that are more than a plain buffer."""

from modattrs.virtual import VirtualTensor

__all__ = ["VirtualTensor"]
__version__ = "0.1.0"
