"""The model ``python -m modattrs inspect`` shows when given no target, ``modattrs.default_model:Decoder``: a
Llama-style decoder written with modattrs, importable under this name (and pickled under it).

Rotary tables are :class:`~modattrs.VirtualTensor` s (float32 whatever the model's dtype, computed on whatever
device the model is on) and each attention layer's KV cache is a :class:`~modattrs.ShapedTensor` constrained on
its heads and head size. The default configuration has the shape of Llama-2-70B.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor

__all__ = ["Decoder"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class Rotary(nn.Module):
    """Cos and sin tables for rotary position embeddings, as float32 VirtualTensors."""

    cos: VirtualTensor  # annotated for type checkers, which otherwise see nn.Module.__getattr__'s Tensor | Module
    sin: VirtualTensor

    def __init__(self, head_dim: int, context: int, base: float) -> None:
        super().__init__()
        self.head_dim, self.context, self.base = head_dim, context, base
        VirtualTensor(self, "cos", "make_cos", dtype=torch.float32, follow_dtype=False)
        VirtualTensor(self, "sin", "make_sin", dtype=torch.float32, follow_dtype=False)

    def angles(self, device: torch.device) -> Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        positions = torch.arange(self.context, dtype=torch.float32, device=device)
        return torch.outer(positions, 1.0 / self.base**exponents)

    def make_cos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.angles(device).cos().to(dtype)

    def make_sin(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.angles(device).sin().to(dtype)


class Attention(nn.Module):
    rotary: Rotary
    keys: ShapedTensor
    values: ShapedTensor

    def __init__(self, dim: int, heads: int, kv_heads: int, batch: int, context: int, base: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.rotary = Rotary(self.head_dim, context, base)
        shape = (batch, kv_heads, context, self.head_dim)
        fixed = {1: kv_heads, 3: self.head_dim}
        ShapedTensor(self, "keys", torch.zeros(shape), fixed, persist_data=False, live=True)
        ShapedTensor(self, "values", torch.zeros(shape), fixed, persist_data=False, live=True)

    def forward(self, x: Tensor, start: int) -> Tensor:
        batch, length, dim = x.shape
        q = self.q(x).view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        cos = self.rotary.cos.value[start : start + length]
        sin = self.rotary.sin.value[start : start + length]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values = self.keys.value, self.values.value
        assert keys is not None
        assert values is not None
        keys[:batch, :, start : start + length] = k
        values[:batch, :, start : start + length] = v
        k, v = keys[:batch, :, : start + length], values[:batch, :, : start + length]
        repeat = self.heads // self.kv_heads
        attended = F.scaled_dot_product_attention(
            q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=start == 0
        )
        out: Tensor = self.o(attended.transpose(1, 2).reshape(batch, length, dim))
        return out


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.float().chunk(2, -1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], -1).to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int, batch: int, context: int, base: float):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads, batch, context, base)
        self.feed_forward_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: Tensor, start: int) -> Tensor:
        x = x + self.attention(self.attention_norm(x), start)
        out: Tensor = x + self.feed_forward(self.feed_forward_norm(x))
        return out


class Decoder(nn.Module):
    """A Llama-style decoder; the defaults are Llama-2-70B's shape, with a KV cache for one 4096-token sequence."""

    def __init__(
        self,
        vocab: int = 32000,
        dim: int = 8192,
        layers: int = 80,
        heads: int = 64,
        kv_heads: int = 8,
        hidden: int = 28672,
        batch: int = 1,
        context: int = 4096,
        rope_base: float = 10_000.0,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            Layer(dim, heads, kv_heads, hidden, batch, context, rope_base) for _ in range(layers)
        )
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor, start: int = 0) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, start)
        out: Tensor = self.head(self.norm(x))
        return out
