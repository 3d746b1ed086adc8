"""Small models and flows that reproduce the public incidents of issue 37, each beside its eager equivalent and its
corrected flow; importable as ``ledger_incidents:NAME`` (``python -m modattrs audit`` targets).

Each flow returns the module it made; the incident a flow reproduces is named in its docstring.
"""

from __future__ import annotations

import atexit

import torch
import torch.distributed as dist
from torch import nn

CHECKPOINT_SEED = 1234


class RotaryDecoder(nn.Module):
    """A decoder's shape in miniature: embeddings, a projection, an output head (tied or not), and a rotary
    ``inv_freq`` computed in ``__init__`` into a non-persistent buffer, as most model code does it."""

    def __init__(self, vocab: int = 32, dim: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", self.rotary_frequencies(), persistent=False)

    def rotary_frequencies(self) -> torch.Tensor:
        return 1.0 / 10_000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)

    def init_parameters(self) -> None:
        """What a library's ``init_weights`` does: the parameters, not the buffers."""
        for module in (self.embed, self.proj, self.head):
            module.reset_parameters()

    def init_buffers(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(self.rotary_frequencies())


def checkpoint(tie: bool = False) -> dict[str, torch.Tensor]:
    """A state dict saved from an eager model (made outside any ledger)."""
    generator_state = torch.get_rng_state()
    torch.manual_seed(CHECKPOINT_SEED)
    try:
        return {key: value.clone() for key, value in RotaryDecoder(tie=tie).state_dict().items()}
    finally:
        torch.set_rng_state(generator_state)


def meta_decoder(tie: bool = False) -> RotaryDecoder:
    with torch.device("meta"):
        return RotaryDecoder(tie=tie)


# --- transformers#45902, torchtitan#3772/#3775/#4783: a non-persistent rotary buffer lost by to_empty ---------------


def rotary_after_to_empty() -> nn.Module:
    """The incident: meta build, ``to_empty``, parameters initialized; ``inv_freq`` keeps what memory held."""
    model = meta_decoder()
    model.to_empty(device="cpu")
    model.init_parameters()
    return model


def rotary_after_to_empty_fixed() -> nn.Module:
    model = meta_decoder()
    model.to_empty(device="cpu")
    model.init_parameters()
    model.init_buffers()
    return model


def rotary_eager() -> nn.Module:
    return RotaryDecoder()


# --- unsloth#4112: buffers made by empty_like and never filled ----------------------------------------------------


class ScaledNorm(nn.Module):
    """A norm whose non-persistent scale buffer is made with ``empty_like`` and filled only by ``reset_scale``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.register_buffer("scale", torch.empty_like(self.weight), persistent=False)

    def reset_scale(self) -> None:
        with torch.no_grad():
            self.scale.copy_(self.weight.detach().abs().sqrt())


def empty_like_buffer() -> nn.Module:
    """The incident: the model is built and loaded; the non-persistent buffer is in no checkpoint."""
    model = ScaledNorm()
    model.load_state_dict({"weight": torch.full((8,), 2.0)})
    return model


def empty_like_buffer_fixed() -> nn.Module:
    model = ScaledNorm()
    model.load_state_dict({"weight": torch.full((8,), 2.0)})
    model.reset_scale()
    return model


# --- transformers#46620: loaded weights initialized again after loading -------------------------------------------


def initialized_after_loading() -> nn.Module:
    """The incident: load, then an initialization pass that does not skip what was loaded."""
    model = meta_decoder()
    model.to_empty(device="cpu")
    model.init_buffers()
    model.load_state_dict(checkpoint())
    model.init_parameters()
    return model


def initialized_after_loading_fixed() -> nn.Module:
    model = meta_decoder()
    model.to_empty(device="cpu")
    model.init_buffers()
    model.init_parameters()
    model.load_state_dict(checkpoint())
    return model


def loaded_eager() -> nn.Module:
    model = RotaryDecoder()
    model.load_state_dict(checkpoint())
    return model


# --- verl#7835: to_empty breaks a weight tie ----------------------------------------------------------------------


def tie_after_to_empty() -> nn.Module:
    """The incident: a tied model built on meta, ``to_empty``, initialized: the head is a separate tensor now."""
    model = meta_decoder(tie=True)
    model.to_empty(device="cpu")
    model.init_parameters()
    model.init_buffers()
    return model


def tie_after_to_empty_fixed() -> nn.Module:
    model = meta_decoder(tie=True)
    model.to_empty(device="cpu")
    model.head.weight = model.embed.weight  # tie again, as transformers' tie_weights() does
    model.init_parameters()
    model.init_buffers()
    return model


def tied_eager() -> nn.Module:
    return RotaryDecoder(tie=True)


# --- transformers#45050: rank 0 loads and broadcasts, other ranks keep empty memory --------------------------------


def broadcast_from_rank_0(everything: bool) -> nn.Module:
    """Rank 0 loads the checkpoint into a model made with ``to_empty``; the others receive it by broadcast. The
    incident: only parameters are broadcast (``everything=False``), so the other ranks' buffers keep ``empty``
    memory. Needs an initialized default process group."""
    model = meta_decoder()
    model.to_empty(device="cpu")
    if dist.get_rank() == 0:
        model.init_buffers()
        model.load_state_dict(checkpoint())
    tensors = [*model.parameters(), *model.buffers()] if everything else list(model.parameters())
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor, src=0)
    return model


def not_a_module() -> str:
    return "a string"


def failing_flow() -> nn.Module:
    raise ValueError("the checkpoint is missing")


def broadcast_on_gloo(everything: bool) -> nn.Module:
    """``broadcast_from_rank_0`` on the gloo ranks the environment describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``): a target for ``python -m modattrs audit`` run once per rank."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
        atexit.register(dist.destroy_process_group)
    return broadcast_from_rank_0(everything)
