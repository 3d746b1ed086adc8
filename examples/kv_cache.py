"""A KV cache that resizes with the batch: ``ShapedTensor`` keeps heads and head size fixed.

``CachedSelfAttention`` decodes one token at a time. Its key and value caches have shape
``(batch, heads, length, head_dim)``; heads and head_dim are fixed by the layer's configuration and checked on
every assignment (``live=True``), while batch and length are free. When the batch size changes, ``reconstrain``
resizes the caches along dim 0 and keeps the most recent sequences.

Run it with ``python examples/kv_cache.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modattrs import ShapedTensor


class CachedSelfAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        empty = torch.zeros(0, heads, 0, self.head_dim)
        fixed = {1: heads, 3: self.head_dim}
        ShapedTensor(self, "keys", empty.clone(), fixed, persist_data=False, live=True)
        ShapedTensor(self, "values", empty.clone(), fixed, persist_data=False, live=True)

    def set_batch_size(self, batch: int) -> None:
        """Resize the caches to ``batch`` sequences; existing sequences stay, new ones start empty."""
        self.keys.reconstrain(0, batch)
        self.values.reconstrain(0, batch)

    def forward(self, token: Tensor) -> Tensor:
        """Attend from ``token`` (batch, 1, dim) to everything cached so far, and cache its key and value."""
        batch, length, dim = token.shape
        q, k, v = (
            t.view(batch, length, self.heads, self.head_dim).transpose(1, 2) for t in self.qkv(token).chunk(3, -1)
        )
        self.keys.value = torch.cat([self.keys.value, k], dim=2)
        self.values.value = torch.cat([self.values.value, v], dim=2)
        attended = F.scaled_dot_product_attention(q, self.keys.value, self.values.value)
        return self.out(attended.transpose(1, 2).reshape(batch, length, dim))


def main() -> None:
    torch.manual_seed(0)
    layer = CachedSelfAttention()
    layer.set_batch_size(2)
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(2, 1, 32))
        print("after 3 steps with batch 2:", tuple(layer.keys.value.shape))

        layer.set_batch_size(3)  # a new sequence joins: padded at the head with an empty (zero) history
        print("after growing the batch to 3:", tuple(layer.keys.value.shape))
        layer(torch.randn(3, 1, 32))
        print("after one more step:", tuple(layer.keys.value.shape))

        layer.set_batch_size(1)  # keep only the most recent sequence
        print("after shrinking the batch to 1:", tuple(layer.keys.value.shape))

        try:
            layer.keys.value = torch.zeros(1, 2, 4, 8)  # wrong number of heads
        except ValueError as error:
            print("a cache with 2 heads is rejected:", error)


if __name__ == "__main__":
    main()
