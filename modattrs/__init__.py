"""Tensor attributes for ``nn.Module`` that are more than a plain buffer."""

from modattrs._serialization import safe_globals
from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor, sync_references

__all__ = ["ShapedTensor", "VirtualTensor", "safe_globals", "sync_references"]
__version__ = "0.1.0"
