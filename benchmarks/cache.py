"""What a cached VirtualTensor costs: a cache hit against reading a registered buffer, the cost per declared
dependency, and a small decoder's forward pass with cached rotary tables against recomputing them every pass
(what transformers' Llama does) and against tables stored in a plain buffer.

Run with ``python benchmarks/cache.py``. Figures are ratios against baselines measured in the same process.
"""

from __future__ import annotations

import torch
from _timing import median_ns, paired_ns, report
from torch import Tensor, nn

from modattrs import VirtualTensor

DIM, HEADS, LAYERS, LENGTH = 256, 4, 4, 512


def table(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.ones(8, dtype=dtype, device=device)


def with_dependencies(count: int) -> nn.Module:
    module = nn.Module()
    names = []
    for i in range(count):
        module.register_buffer(f"dependency{i}", torch.zeros(1))
        names.append(f"dependency{i}")
    VirtualTensor(module, "table", table, cache=True, depends_on=names)
    return module


def rope(dim: int, length: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / 10_000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32, device=device), inv_freq)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Layer(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        head = DIM // HEADS
        if how == "cached":
            VirtualTensor(self, "cos", lambda m, dtype, device: rope(head, LENGTH, dtype, device)[0], cache=True)
            VirtualTensor(self, "sin", lambda m, dtype, device: rope(head, LENGTH, dtype, device)[1], cache=True)
        elif how == "buffer":
            cos, sin = rope(head, LENGTH, torch.float32, torch.device("cpu"))
            self.register_buffer("cos_buffer", cos, persistent=False)
            self.register_buffer("sin_buffer", sin, persistent=False)

    def tables(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.how == "cached":
            return self.cos.value, self.sin.value
        if self.how == "buffer":
            return self.cos_buffer, self.sin_buffer
        return rope(DIM // HEADS, x.shape[1], x.dtype, x.device)  # recomputed every forward, as in transformers

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        cos, sin = self.tables(x)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(attended.transpose(1, 2).reshape(batch, length, DIM))


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.chunk(2, -1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], -1)


def main() -> None:
    torch.set_num_threads(1)
    plain = nn.Module()
    plain.register_buffer("buffer", torch.ones(8))
    hits, buffer_reads = {}, {}
    for count in (0, 1, 4):
        module = with_dependencies(count)
        hits[count], buffer_reads[count] = paired_ns(
            lambda module=module: module.table.value, lambda: plain.buffer, number=50_000
        )
    report("cache hit, no dependency, vs reading a registered buffer", hits[0], buffer_reads[0])
    report("cache hit, one dependency, vs reading a registered buffer", hits[1], buffer_reads[1], target=1.0)
    print(f"{'':<58} each further dependency: {(hits[4] - hits[1]) / 3:,.0f} ns")

    x = torch.randn(1, LENGTH, DIM)
    times = {}
    for how in ("recomputed", "cached", "buffer"):
        model = nn.Sequential(*(Layer(how) for _ in range(LAYERS)))
        with torch.no_grad():
            times[how] = median_ns(lambda model=model: model(x), number=5, repeat=7)
    for how, label in (("recomputed", "recomputing the tables every pass"), ("buffer", "tables in a plain buffer")):
        report(f"decoder forward, cached tables vs {label}", times["cached"], times[how])


if __name__ == "__main__":
    main()
