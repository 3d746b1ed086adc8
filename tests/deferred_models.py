"""Modules for the deferred initialization tests: each does one thing eager construction must reproduce."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor


def rejection_sample_(tensor: Tensor, limit: float) -> Tensor:
    """Draw until every value is within the limit: how many draws it takes depends on the values."""
    with torch.no_grad():
        tensor.normal_()
        while (outside := tensor.abs() > limit).any():
            tensor[outside] = torch.randn(int(outside.sum()))
    return tensor


class RotaryInvFreq(nn.Module):
    """RoPE tables computed in ``__init__`` from arange, pow, outer and cat."""

    def __init__(self, dim: int = 16, positions: int = 32) -> None:
        super().__init__()
        inv_freq = 1.0 / (10_000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        freqs = torch.outer(torch.arange(positions).float(), inv_freq)
        self.register_buffer("cos", torch.cat([freqs, freqs], dim=-1).cos())


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8, padding_idx=0)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight


class DataAssignedAndViews(nn.Module):
    """``.data =``, ``.data.normal_()``, and in-place initialization through views."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.linear.weight.data = torch.randn(6, 4) * 0.1
        self.linear.bias.data.normal_()
        with torch.no_grad():
            self.linear.weight[0].fill_(3.0)
            self.linear.weight[:, 1].uniform_()
        packed = torch.empty(6, 4)
        self.q = nn.Parameter(packed[:3])
        self.k = nn.Parameter(packed[3:])
        nn.init.normal_(packed)


class ViewsOfTheSameGeometry(nn.Module):
    """Views that keep their argument's place and geometry (``detach``, ``alias``, ``view`` to the same sizes,
    ``as_strided`` at the same offset), next to one at another offset, each drawn or written through afterwards."""

    def __init__(self) -> None:
        super().__init__()
        whole = torch.empty(24).uniform_().resize_(5, 4)  # 5 rows of a storage of 6
        self.detached = nn.Parameter(whole.detach())
        self.register_buffer("viewed", whole.view(5, 4))
        self.register_buffer("aliased", torch.ops.aten.alias(whole))
        self.register_buffer("strided", whole.as_strided((5, 4), (4, 1), 0))
        self.register_buffer("shifted", whole.as_strided((5, 4), (4, 1), 4))  # one row on: another tensor
        with torch.no_grad():
            self.detached.mul_(3.0)
            self.shifted[0].normal_()
        self.register_buffer("whole", whole)


class MovedAfterAliasing(nn.Module):
    """A weight moved in place (``how``) after a tensor in its place was kept: that one stays where it was."""

    def __init__(self, how: str) -> None:
        super().__init__()
        weight = torch.empty(4, 3).normal_()
        self.kept = nn.Parameter(weight.detach())
        self.register_buffer("viewed", weight[:])
        if how == "unsqueeze_":
            weight.unsqueeze_(0)
        elif how == "t_":
            weight.t_()
        elif how == "resize_ smaller":
            weight.resize_(2, 3)
        elif how == "resize_ larger":
            weight.resize_(5, 4)
            weight.view(-1)[12:].uniform_()  # the elements it grew by, which hold no values yet
        elif how == "set_":
            weight.set_(torch.empty(6).uniform_())
        with torch.no_grad():
            weight.mul_(2.0)  # written after the move: the kept tensors see it where they share memory
        self.register_buffer("weight", weight)


class DeepCopied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.Linear(5, 5)
        self.layers = nn.ModuleList(copy.deepcopy(layer) for _ in range(3))
        nn.init.xavier_uniform_(self.layers[1].weight)


class TruncatedAndOrthogonal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        nn.init.trunc_normal_(self.a.weight, std=0.5, a=-0.6, b=0.6)
        nn.init.orthogonal_(self.b.weight)


class OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(1234)
        self.weight = nn.Parameter(torch.randn(4, 4, generator=generator))
        self.other = nn.Parameter(torch.rand(3))


class WithAttributes(nn.Module):
    """A module with modattrs attributes: a cached virtual value computed from a parameter, and a shaped buffer."""

    norm: VirtualTensor
    state: ShapedTensor

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(4))
        VirtualTensor(self, "norm", "compute_norm", cache=True, depends_on=["scale"])
        ShapedTensor(self, "state", torch.randn(2, 4), {1: 4}, live=True)

    def compute_norm(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.scale.to(dtype).square().sum().sqrt()


class Stack(nn.Module):
    """A few big layers, for partial materialization and memory."""

    def __init__(self, layers: int = 4, width: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.register_buffer("steps", torch.zeros(()))


class ViewsAndGraphs(nn.Module):
    """A buffer viewing another, a buffer computed from parameters with grad on, tensors kept in containers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.randn(6))
        self.register_buffer("head", self.table[:2])
        self.w = nn.Parameter(torch.randn(3))
        self.v = nn.Parameter(torch.randn(3))
        self.register_buffer("product", self.w * self.v)  # carries an autograd graph
        self.masks = [torch.rand(2) > 0.5, torch.ones(2), self.w * 2]  # the last one carries a graph
        self.tables = {"cos": torch.randn(3).cos()}
        self.halves = torch.randn(4).split(4)[0]  # an operation returning a one-tensor list
        self.conj = torch.randn(2, dtype=torch.complex64).conj()  # a view with the same layout as its base


def built_under_bfloat16() -> nn.Module:
    """A module built with bfloat16 as the default dtype, then converted: its draws were made in bfloat16."""
    torch.set_default_dtype(torch.bfloat16)
    try:
        return nn.Embedding(4, 3).float()
    finally:
        torch.set_default_dtype(torch.float32)


class CachedFromSubmodule(nn.Module):
    """A cached virtual value computed from a submodule's weight, with and without a declared dependency."""

    declared: VirtualTensor
    undeclared: VirtualTensor

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        VirtualTensor(self, "declared", "weight_sum", cache=True, depends_on=["linear"])
        VirtualTensor(self, "undeclared", "weight_sum", cache=True)

    def weight_sum(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.linear.weight.detach().to(dtype).sum()
