"""Cost of ``VirtualTensor.value`` and of ``module.to()`` with many VirtualTensors.

Run with ``python benchmarks/virtual_value.py``. Every figure is a ratio against a baseline measured in the same
process, so the machine's speed cancels out. ``.value`` is measured with the reader the install has (compiled from
``modattrs/_speedups.c`` when a C compiler was there) and with the Python reader, which an install without one uses.
"""

from __future__ import annotations

import torch
from _timing import median_ns, paired_ns, report
from torch import Tensor, nn

import modattrs.virtual
from modattrs import VirtualTensor


class Arange(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stored = torch.arange(8.0)
        VirtualTensor(self, "positions", "make_positions")
        VirtualTensor(self, "stored_value", "return_stored")

    def make_positions(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(8, dtype=dtype, device=device)

    def return_stored(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.stored


def with_virtual_tensors(count: int) -> nn.Module:
    module = nn.Module()
    for i in range(count):
        VirtualTensor(module, f"v{i}", lambda m, dtype, device: torch.zeros(0, dtype=dtype, device=device))
    return module


def with_plain_buffers(count: int) -> nn.Module:
    module = nn.Module()
    for i in range(count):
        module.register_buffer(f"b{i}", torch.empty(0), persistent=False)
    return module


def main() -> None:
    torch.set_num_threads(1)
    m = Arange()
    dtype, device = torch.get_default_dtype(), torch.device("cpu")

    installed = modattrs.virtual._read
    readers = {"compiled": installed} if modattrs.virtual._speedups is not None else {}
    readers["Python"] = VirtualTensor._read
    for kind, reader in readers.items():
        modattrs.virtual._read = reader
        print(f"{kind} read of .value:")
        value, direct = paired_ns(lambda: m.positions.value, lambda: m.make_positions(dtype, device), number=5_000)
        report("  arange(8) materializer vs calling it directly", value, direct, target=1.25)
        value_stored, direct_stored = paired_ns(
            lambda: m.stored_value.value, lambda: m.return_stored(dtype, device), number=20_000
        )
        report("  stored-tensor materializer vs calling it directly", value_stored, direct_stored)
        print(f"{'':<58} pure overhead of .value: {value_stored - direct_stored:,.0f} ns")
    modattrs.virtual._read = installed

    virtual, plain = with_virtual_tensors(1000), with_plain_buffers(1000)

    def round_trip(module: nn.Module) -> None:
        module.to(torch.float64)
        module.to(torch.float32)

    to_virtual = median_ns(lambda: round_trip(virtual), number=20) / 2
    to_plain = median_ns(lambda: round_trip(plain), number=20) / 2
    report("module.to(float64), 1000 VirtualTensors vs 1000 buffers", to_virtual, to_plain, target=1.1)


if __name__ == "__main__":
    main()
