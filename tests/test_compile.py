"""torch.compile(fullgraph=True) and torch.export of forwards that read modattrs attributes."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor


def scaled_ones(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    assert isinstance(module, Model)
    return module.proj.weight.sum(0).to(dtype) * torch.ones(4, dtype=dtype, device=device)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        VirtualTensor(self, "pos", "make_pos")
        VirtualTensor(self, "scale", scaled_ones)
        ShapedTensor(self, "state", torch.ones(3, 4), {-1: 4})

    def make_pos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(4, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        state = self.state.value
        assert state is not None
        return self.proj(x) + self.pos.value + self.scale.value + state.sum(0)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_forward_has_no_graph_break_and_matches_eager(backend: str) -> None:
    model = Model()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 4)
    torch.testing.assert_close(compiled(x), model(x))


def test_compiled_forward_recompiles_after_module_to_float64() -> None:
    model = Model()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    compiled(torch.randn(2, 4))
    model.to(torch.float64)
    x = torch.randn(2, 4, dtype=torch.float64)
    out = compiled(x)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model(x))


def test_compiled_forward_sees_a_reconstrained_state() -> None:
    model = Model()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(2, 4)
    compiled(x)
    model.state.reconstrain(0, 5)
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("strict", [True, False])
def test_export_computes_the_virtual_value_in_the_graph(strict: bool) -> None:
    model = Model()
    x = torch.randn(2, 4)
    program = torch.export.export(model, (x,), strict=strict)
    torch.testing.assert_close(program.module()(x), model(x))
    targets = {str(node.target) for node in program.graph.nodes}
    assert "aten.arange.default" in targets
