"""Deferred initialization: build a model without memory, then give it exactly the values eager construction gives.

The same small decoder is built three ways from seed 0:

* eagerly on the CPU: the reference;
* on the meta device, then ``to_empty`` and every ``reset_parameters()``, the usual recipe for big models: the
  initialization done in ``__init__`` (a rotary ``inv_freq`` buffer, ``trunc_normal_`` on the projections) is lost,
  and the random draws come out in another order;
* with ``deferred_init`` and ``materialize_module``: equal to the reference, bit for bit.

Then one layer alone is materialized with ``check_fn``, as FSDP1 materializes one unit at a time, and compared with
the same layer of the reference.

Run it with ``python examples/deferred_init.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from modattrs.deferred import deferred_init, is_deferred, materialize_module
from modattrs.fake import is_fake

DIM, VOCAB, LAYERS = 64, 1000, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attention = nn.Linear(DIM, 3 * DIM)
        self.output = nn.Linear(DIM, DIM)
        for projection in (self.attention, self.output):
            nn.init.trunc_normal_(projection.weight, std=0.02)
            nn.init.zeros_(projection.bias)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        inv_freq = 1.0 / 10_000 ** (torch.arange(0, DIM, 2).float() / DIM)
        self.register_buffer("inv_freq", inv_freq, persistent=False)


def equal(a: nn.Module, b: nn.Module) -> bool:
    """Whether every parameter and buffer of ``a`` and ``b`` holds the same bits."""
    pairs = zip(a.state_dict(keep_vars=True).values(), b.state_dict(keep_vars=True).values(), strict=True)
    buffers = zip(a.buffers(), b.buffers(), strict=True)
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in [*pairs, *buffers])


def main() -> None:
    torch.manual_seed(0)
    eager = Decoder()
    generator_after_eager = torch.get_rng_state()

    torch.manual_seed(0)
    with torch.device("meta"):
        usual = Decoder()
    usual.to_empty(device="cpu")
    for module in usual.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    print(f"meta + to_empty + reset_parameters equal to eager: {equal(eager, usual)}")

    torch.manual_seed(0)
    deferred = deferred_init(Decoder)
    print(f"deferred: {deferred.embed.weight}")
    materialize_module(deferred)
    print(f"deferred_init + materialize_module equal to eager: {equal(eager, deferred)}")
    print(f"tie kept: {deferred.head.weight is deferred.embed.weight}")
    print(f"generator after materializing equals eager's: {torch.equal(torch.get_rng_state(), generator_after_eager)}")

    torch.manual_seed(0)
    partial = deferred_init(Decoder)
    torch.manual_seed(1234)  # draws and reseeding in between change nothing: replay starts where recording did
    layer = set(partial.blocks[1].modules())
    materialize_module(partial, check_fn=lambda module: module in layer)
    others_fake = all(is_fake(p) for block in (0, 2, 3) for p in partial.blocks[block].parameters())
    print(
        f"layer 1 alone equal to eager's layer 1: {equal(eager.blocks[1], partial.blocks[1])}; "
        f"other layers still fake: {others_fake}; model still deferred: {is_deferred(partial)}"
    )


if __name__ == "__main__":
    main()
