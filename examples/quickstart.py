"""Quick start: a derived tensor that follows its module everywhere.

A rotary-embedding-style module needs ``inv_freq``, a tensor computed from its configuration. Written as a plain
buffer it is computed once in ``__init__``; after the module is built on the meta device and materialized with
``to_empty`` (the way large models are initialized), that buffer holds uninitialized memory. As a
``VirtualTensor`` it is computed from the module's state on the module's current dtype and device.

Run it with ``python examples/quickstart.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modattrs import VirtualTensor


class Rotary(nn.Module):
    def __init__(self, dim: int = 8, base: float = 10_000.0) -> None:
        super().__init__()
        self.dim = dim
        self.base = base
        VirtualTensor(self, "inv_freq", "compute_inv_freq")
        # The hand-rolled way, for comparison.
        self.register_buffer("inv_freq_buffer", self.compute_inv_freq(torch.float32, None), persistent=False)

    def compute_inv_freq(self, dtype: torch.dtype, device: torch.device | None) -> Tensor:
        exponents = torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim
        return (1.0 / self.base**exponents).to(dtype)


def show(label: str, module: Rotary) -> None:
    value = module.inv_freq.value
    print(f"{label:<34} VirtualTensor {value.dtype} {value.device}: {format_values(value)}")
    buffer = module.inv_freq_buffer
    print(f"{'':<34} plain buffer  {buffer.dtype} {buffer.device}: {format_values(buffer)}")


def format_values(tensor: Tensor) -> str:
    if tensor.device.type == "meta":
        return "(no data on the meta device)"
    return "[" + ", ".join(f"{v:.4g}" for v in tensor.tolist()) + "]"


def main() -> None:
    torch.manual_seed(0)
    module = Rotary()
    show("built on the CPU", module)

    module.to(torch.float64)
    show("after .to(torch.float64)", module)

    module.to("meta")
    show('after .to("meta")', module)

    module.to_empty(device="cpu")
    show('after .to_empty(device="cpu")', module)

    with torch.device("meta"):
        fresh = Rotary()
    fresh.to_empty(device="cpu")
    show("built on meta, then to_empty", fresh)

    reference = Rotary()
    expected = reference.inv_freq.value
    print()
    print("VirtualTensor correct after meta init + to_empty:", torch.equal(fresh.inv_freq.value, expected))
    print("plain buffer correct after meta init + to_empty: ", torch.equal(fresh.inv_freq_buffer, expected))


if __name__ == "__main__":
    main()
