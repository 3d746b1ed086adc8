"""Rotary position embeddings whose cos/sin tables are VirtualTensors.

The tables stay float32 inside a bfloat16 model (rotary embeddings lose accuracy in bfloat16 at long contexts),
follow the model to whatever device it goes, and are correct after meta-device initialization with
``to_empty``. The hand-rolled version next to it, tables computed in ``__init__`` and stored in non-persistent
buffers as many models do, comes back from the same flow holding uninitialized memory, and is cast to bfloat16
by ``model.bfloat16()``.

Run it with ``python examples/rope.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modattrs import VirtualTensor

HEAD_DIM, CONTEXT, BASE = 64, 2048, 10_000.0


def angles(device: torch.device | None) -> Tensor:
    exponents = torch.arange(0, HEAD_DIM, 2, dtype=torch.float32, device=device) / HEAD_DIM
    positions = torch.arange(CONTEXT, dtype=torch.float32, device=device)
    return torch.outer(positions, 1.0 / BASE**exponents)


class RotaryEmbedding(nn.Module):
    cos: VirtualTensor
    sin: VirtualTensor

    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "cos", "make_cos", dtype=torch.float32, follow_dtype=False)
        VirtualTensor(self, "sin", "make_sin", dtype=torch.float32, follow_dtype=False)

    def make_cos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return angles(device).cos().to(dtype)

    def make_sin(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return angles(device).sin().to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        """Rotate x, of shape (..., length, HEAD_DIM), computing in float32."""
        length = x.shape[-2]
        cos, sin = self.cos.value[:length], self.sin.value[:length]
        first, second = x.float().chunk(2, -1)
        return torch.cat([first * cos - second * sin, first * sin + second * cos], -1).to(x.dtype)


class HandRolledRotaryEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", angles(None).cos(), persistent=False)
        self.register_buffer("sin", angles(None).sin(), persistent=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HEAD_DIM, HEAD_DIM)
        self.rotary = RotaryEmbedding()
        self.hand_rolled = HandRolledRotaryEmbedding()


def main() -> None:
    reference = angles(None)
    with torch.device("meta"):
        model = Model()
    model.to_empty(device="cpu")
    model.bfloat16()

    rotary, hand_rolled = model.rotary, model.hand_rolled
    print(f"model weights: {model.proj.weight.dtype}")
    print(
        f"VirtualTensor cos: {rotary.cos.value.dtype}, equal to the exact table: "
        f"{torch.equal(rotary.cos.value, reference.cos())}"
    )
    print(
        f"hand-rolled cos:   {hand_rolled.cos.dtype}, equal to the exact table: "
        f"{torch.equal(hand_rolled.cos.float(), reference.cos())}"
    )

    x = torch.randn(2, 16, HEAD_DIM, dtype=torch.bfloat16)
    rotated = rotary(x)
    norms_kept = torch.allclose(rotated.float().norm(dim=-1), x.float().norm(dim=-1), rtol=1e-2)
    print(f"rotation keeps vector norms: {norms_kept}")


if __name__ == "__main__":
    main()
