"""The modules saved in the pinned files of ``tests/saved/v*/``.

A whole-module pickle names its classes and callable materializers by module and qualified name (``models.Outer``,
``models.ramp``), so these are part of what every saved file needs, as modattrs' own names are. Never rename,
remove or change what anything here does (a method materializer is looked up again on the loaded module's class);
a later version that needs other modules adds new classes next to these.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor


def ramp(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A callable materializer: module-level, so that pickle can name it."""
    return torch.arange(4, dtype=dtype, device=device) * module.scale


class Inner(nn.Module):
    """Every kind of modattrs attribute, with plain tensors beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 0.5
        self.proj = nn.Linear(3, 2)
        self.bias = nn.Parameter(torch.randn(2))  # a plain parameter
        self.register_buffer("counts", torch.arange(3))  # a plain buffer
        self.register_buffer("scratch", torch.full((2,), 3.0), persistent=False)
        # ShapedTensor: buffer data with a free dim 0, constraints persisted, assignments checked
        ShapedTensor(self, "history", torch.zeros(2, 3), {1: 3}, persist_constraints=True, live=True)
        # parameter-backed, free dim 1
        ShapedTensor(self, "gain", nn.Parameter(torch.ones(3, 2)), {0: 3}, persist_constraints=True, live=True)
        # a negative dim, non-strict
        ShapedTensor(self, "window", torch.zeros(1, 4), {0: 1, -1: 4}, persist_constraints=True, strict=False)
        # data out of the state_dict, constraints not persisted
        ShapedTensor(self, "carry", torch.ones(2, 2), {0: 2}, persist_data=False)
        ShapedTensor(self, "pending", None, {0: 2})  # a placeholder
        # VirtualTensor: a method materializer, persisted reference
        VirtualTensor(self, "col_sum", "sum_columns", persist=True)
        VirtualTensor(self, "ramp", ramp)  # a callable materializer, reference not persisted
        # cached, invalidated by its dependencies
        VirtualTensor(self, "history_mean", "mean_history", cache=True, depends_on=("_history_data", "scale"))
        # a fixed floating dtype, persisted reference
        VirtualTensor(self, "positions", "make_positions", dtype=torch.float64, follow_dtype=False, persist=True)
        VirtualTensor(self, "index", "make_index", dtype=torch.int64)  # an integer dtype: always fixed
        VirtualTensor(self, "bias_like", "make_bias_like", dtype_from="bias")  # the dtype of another tensor
        self.ramp_alias = self.ramp  # an alias in the same module

    def sum_columns(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.proj.weight.detach().sum(0).to(device=device, dtype=dtype)

    def mean_history(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.history.value.mean(0).to(device=device, dtype=dtype) * self.scale

    def make_positions(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(3, dtype=dtype, device=device) / 3

    def make_index(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(5, dtype=dtype, device=device)

    def make_bias_like(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.bias.detach().to(device=device, dtype=dtype) * 2


class Outer(nn.Module):
    """An owner of a submodule's attributes' aliases, with an attribute reading them."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        VirtualTensor(self, "twice", "double_col_sum")
        self.col_sum = self.inner.col_sum  # an alias of another module's attribute

    def double_col_sum(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return 2 * self.inner.col_sum.value.to(device=device, dtype=dtype)
