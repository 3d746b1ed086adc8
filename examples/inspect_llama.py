"""Inspect a 7-billion-parameter model on a machine that could not hold it, on a GPU it does not have.

``transformers.LlamaForCausalLM`` with a Llama-2-7B configuration is built in fake mode on a spoofed ``cuda``
device: every parameter exists, with its shape, dtype and device, and none holds data. The script prints the
parameters and the bytes they would take per top-level module, the totals, and how long the build took.

Needs ``transformers`` (its configurations only; nothing is downloaded). Run it with
``python examples/inspect_llama.py``.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs.fake import fake_mode, is_fake

LLAMA_2_7B = LlamaConfig(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
)


def summarize(name: str, module: nn.Module) -> int:
    parameters = list(module.parameters())
    count = sum(p.numel() for p in parameters)
    size = sum(p.numel() * p.element_size() for p in parameters)
    print(f"{name:<28} {count:>15,} parameters {size / 2**30:>8.2f} GiB")
    return count


def main() -> None:
    start = time.perf_counter()
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = LlamaForCausalLM(LLAMA_2_7B).to(torch.bfloat16)
    elapsed = time.perf_counter() - start

    assert all(is_fake(p) for p in model.parameters())
    devices = sorted({str(p.device) for p in model.parameters()})
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    for name, child in model.model.named_children():
        summarize(f"model.{name}", child)
    summarize("lm_head", model.lm_head)
    total = summarize("total", model)
    print(f"devices {devices}, dtypes {dtypes}; built fake in {elapsed:.2f} s")
    print(f"Llama-2-7B: {total:,} parameters")


if __name__ == "__main__":
    main()
