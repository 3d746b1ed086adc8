"""Modules used by the copy, pickle and load tests; importable by name from a fresh process."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor


def ramp(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A callable materializer that reads the owner's state."""
    assert isinstance(module, Block)
    return torch.arange(3, dtype=dtype, device=device) * module.offset


def twos(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((2,), 2.0, dtype=dtype, device=device)


class Block(nn.Module):
    def __init__(self, persist: bool = False) -> None:
        super().__init__()
        self.offset = 2.0
        self.lin = nn.Linear(3, 3)
        VirtualTensor(self, "weight_sum", "sum_weight", persist=persist)
        VirtualTensor(self, "ramp", ramp, persist=persist)
        ShapedTensor(self, "state", torch.ones(2, 3), {1: 3}, persist_constraints=persist)

    def sum_weight(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.lin.weight.detach().sum(0).to(device=device, dtype=dtype)


class Outer(nn.Module):
    def __init__(self, persist: bool = False) -> None:
        super().__init__()
        self.block = Block(persist)
        self.empty = nn.Sequential()  # an owner that defines __len__, and is falsy
        VirtualTensor(self.empty, "twos", twos, persist=persist)
        VirtualTensor(self, "twice", "twice_block", persist=persist)

    def twice_block(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return 2 * self.block.weight_sum.value.to(device=device, dtype=dtype)


def values(module: Outer) -> dict[str, Tensor]:
    """Every modattrs value in an ``Outer``, by path."""
    state = module.block.state.value
    assert state is not None
    return {
        "block.weight_sum": module.block.weight_sum.value,
        "block.ramp": module.block.ramp.value,
        "block.state": state,
        "empty.twos": module.empty.twos.value,
        "twice": module.twice.value,
    }


def attributes(module: Outer) -> dict[str, object]:
    return {
        "block.weight_sum": module.block.weight_sum,
        "block.ramp": module.block.ramp,
        "block.state": module.block.state,
        "empty.twos": module.empty.twos,
        "twice": module.twice,
    }
