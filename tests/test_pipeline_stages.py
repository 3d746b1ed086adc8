"""A pipeline stage, made as torchtitan makes one, materializes as completely as the model it was copied from.

torchtitan's pipeline split deep-copies the whole model, deletes the layers another stage runs (and the original
model), then applies ``fully_shard`` to each kept block and to the stage. Ranks run one at a time in this process on
torch's fake process group, as in ``tests/test_shard_local_replay.py``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from modattrs.deferred import deferred_init, is_deferred, materialize_module
from tests.support.ranks import fake_world

WORLD = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(24)
        self.wqkv = nn.Linear(24, 3 * 24, bias=False)
        self.wo = nn.Linear(24, 24, bias=False)
        self.ffn_norm = nn.LayerNorm(24)
        self.w1 = nn.Linear(24, 61)  # 61 rows: uneven shards over 8 ranks, so FSDP2 pads them
        self.w2 = nn.Linear(61, 24)


class Decoder(nn.Module):
    """A small decoder laid out as torchtitan's: layers in a ModuleDict keyed by their index."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(50, 24)
        self.layers = nn.ModuleDict({str(index): Block() for index in range(6)})
        self.norm = nn.LayerNorm(24)
        self.output = nn.Linear(24, 50, bias=False)


def stage_of(model: Decoder, kept: range, *, first: bool, last: bool) -> Decoder:
    """torchtitan's split: a deep copy keeping only what this stage runs."""
    stage = copy.deepcopy(model)
    for name in [name for name in stage.layers if int(name) not in kept]:
        del stage.layers[name]
    if not first:
        stage.tok_embeddings = None  # type: ignore[assignment]
    if not last:
        stage.norm = None  # type: ignore[assignment]
        stage.output = None  # type: ignore[assignment]
    return stage


def shard_of(full: torch.Tensor, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full.detach(), WORLD, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


STAGES = {
    "a middle stage (layers 2 and 3 of 6)": (range(2, 4), False, False),
    "the first stage (embeddings, layers 0 and 1)": (range(2), True, False),
    "the whole model, deep-copied": (range(6), True, True),
}


# Every stage with the original deleted, as torchtitan does; the middle one with it kept alive too.
CASES = [(name, "deleted") for name in STAGES] + [(next(iter(STAGES)), "alive")]


@pytest.mark.parametrize(("stage_name", "original"), CASES)
@pytest.mark.parametrize("rank", [0, 4, 7])
def test_a_deep_copied_pipeline_stage_sharded_by_fsdp2_materializes_whole_with_the_eager_slices(
    stage_name: str, rank: int, original: str
) -> None:
    kept, first, last = STAGES[stage_name]
    torch.manual_seed(0)
    eager_stage = stage_of(Decoder(), kept, first=first, last=last)
    state_after_eager = torch.get_rng_state()
    with fake_world((WORLD,), rank) as mesh:
        torch.manual_seed(0)
        model = deferred_init(Decoder)
        stage = stage_of(model, kept, first=first, last=last)
        if original == "deleted":
            del model
            gc.collect()
        for block in stage.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(stage, mesh=mesh)
        materialize_module(stage)
        assert not is_deferred(stage)
        names = [name for name, _ in stage.named_parameters()]
        assert names == [name for name, _ in eager_stage.named_parameters()]
        for name, parameter in stage.named_parameters():
            local = parameter.to_local()  # type: ignore[operator]
            assert torch.equal(local, shard_of(eager_stage.get_parameter(name), rank)), name
    assert torch.equal(torch.get_rng_state(), state_after_eager)
