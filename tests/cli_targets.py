"""Targets for the `python -m modattrs inspect` tests, importable as `cli_targets:NAME`."""

from __future__ import annotations

from typing import Any

from torch import nn

NOT_CALLABLE = 42


def not_a_module() -> str:
    return "a string"


def failing(**kwargs: Any) -> nn.Module:
    raise ValueError("layers must be positive")


def exiting() -> nn.Module:
    raise SystemExit(0)


def llama(**overrides: Any) -> nn.Module:
    """A factory for a third-party model zoo: transformers' Llama, configured from the command line."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**overrides))


def clip(**overrides: Any) -> nn.Module:
    """transformers' CLIP, whose logit_scale is a parameter made from a Python number."""
    from transformers import CLIPConfig, CLIPModel

    return CLIPModel(CLIPConfig(**overrides))


def shared_rotary() -> nn.Module:
    """Two layers that read one rotary table: the second holds an alias of the first's attribute."""
    import torch

    from modattrs import VirtualTensor

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    VirtualTensor(model[0], "cos", lambda owner, dtype, device: torch.ones(8, dtype=dtype, device=device))
    model[1].cos = model[0].cos
    return model


def sized_by_the_gpu() -> nn.Module:
    """A model that sizes itself from what torch.cuda says about the GPU, as tuned kernels' wrappers do."""
    import torch

    properties = torch.cuda.get_device_properties(0)
    major, minor = torch.cuda.get_device_capability()
    return nn.Linear(properties.multi_processor_count, 10 * major + minor, bias=False)
