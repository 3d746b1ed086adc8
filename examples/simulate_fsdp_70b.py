"""How much memory would each of 64 GPUs need to train Llama-2-70B with FSDP2? Answered on one CPU, in seconds.

A fake process group (torch's testing backend, one process standing for all 64 ranks) and ``modattrs.fake``
together let ``fully_shard`` shard a Llama-2-70B-shaped model that is never allocated. The script prints the
parameter and buffer bytes one rank holds, in bfloat16.

Needs ``transformers`` (its configurations only; nothing is downloaded). Run it with
``python examples/simulate_fsdp_70b.py``.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs.fake import fake_mode

RANKS = 64
LLAMA_2_70B = LlamaConfig(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=32000,
)


def main() -> None:
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=RANKS)
    try:
        mesh = init_device_mesh("cpu", (RANKS,))
        with fake_mode():
            model = LlamaForCausalLM(LLAMA_2_70B).to(torch.bfloat16)
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        parameters = list(model.parameters())
        total = sum(p.numel() for p in parameters)
        per_rank = sum(p.to_local().numel() * p.element_size() for p in parameters)  # type: ignore[attr-defined]
        # What FSDP2 should hold per rank: dim 0 split in RANKS chunks, the last ones padded.
        expected = sum(math.ceil(p.shape[0] / RANKS) * (p.numel() // p.shape[0]) * p.element_size() for p in parameters)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    finally:
        dist.destroy_process_group()
    print(f"Llama-2-70B: {total:,} parameters, sharded over {RANKS} ranks in {time.perf_counter() - start:.1f} s")
    print(f"per rank: {per_rank / 2**30:.3f} GiB of bfloat16 parameters, {buffers:,} bytes of buffers (replicated)")
    print(f"matches an even split of dim 0: {per_rank == expected}")


if __name__ == "__main__":
    main()
