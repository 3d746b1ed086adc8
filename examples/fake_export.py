"""Export a model for devices this machine does not have, without allocating it.

An MLP whose first layer and activation run on one device and whose second layer runs on another is built in fake
mode and exported with ``torch.export`` on fake example inputs, for (cpu, cpu), (cuda, cuda) and (cpu, cuda). The
exported graphs carry the devices and the transfer between them, and compute the ``VirtualTensor`` the forward
pass reads. No GPU is needed: on a build of torch without CUDA, ``fake_cuda=True`` spoofs it.

Run it with ``python examples/fake_export.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modattrs import VirtualTensor
from modattrs.fake import fake_mode


class SplitMLP(nn.Module):
    def __init__(self, first: str, second: str, width: int = 64) -> None:
        super().__init__()
        with torch.device(first):
            self.fc1 = nn.Linear(width, 4 * width)
            self.act = nn.GELU()
        with torch.device(second):
            self.fc2 = nn.Linear(4 * width, width)
            VirtualTensor(self, "scale", "compute_scale")  # on the second device, like fc2

    def compute_scale(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.linspace(0.5, 1.5, self.fc2.out_features, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.act(self.fc1(x))
        return self.fc2(hidden.to(self.fc2.weight.device)) * self.scale.value


def export_on(first: str, second: str) -> torch.export.ExportedProgram:
    with fake_mode(fake_cuda=True):
        model = SplitMLP(first, second)
        example = torch.randn(8, 64, device=first)
    return torch.export.export(model, (example,))


def devices_in(program: torch.export.ExportedProgram) -> list[str]:
    """The devices of the graph's values, in the order they first appear."""
    seen: list[str] = []
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and str(value.device) not in seen:
            seen.append(str(value.device))
    return seen


def transfers_in(program: torch.export.ExportedProgram) -> list[str]:
    """The device transfers in the graph, as 'source -> destination'."""
    moves = []
    for node in program.graph.nodes:
        if node.op != "call_function" or not node.args:
            continue
        source, result = node.args[0], node.meta.get("val")
        source_value = getattr(source, "meta", {}).get("val")
        tensors = isinstance(result, torch.Tensor) and isinstance(source_value, torch.Tensor)
        if tensors and result.device != source_value.device:
            moves.append(f"{node.target}: {source_value.device} -> {result.device}")
    return moves


def main() -> None:
    for first, second in [("cpu", "cpu"), ("cuda", "cuda"), ("cpu", "cuda")]:
        program = export_on(first, second)
        print(f"fc1 on {first}, fc2 on {second}: devices {devices_in(program)}; transfers {transfers_in(program)}")
        assert "aten.linspace.default" in {str(n.target) for n in program.graph.nodes}


if __name__ == "__main__":
    main()
