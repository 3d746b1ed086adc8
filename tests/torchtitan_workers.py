"""One rank of tests/test_torchtitan_gloo.py: `python torchtitan_workers.py LAYOUT OUTPUT_DIR`, LAYOUT like `tp=2`, or
`python torchtitan_workers.py ledger OUTPUT_DIR` for the write ledger's flows (``ledger_flows``).

torchtitan's Llama3 is parallelized by its own ``parallelize_llama`` on a 4-rank gloo world twice: once deferred
(``deferred_init`` of the model and its ``init_weights()``, then ``materialize_module``) and once built and
initialized eagerly on CPU (same seed); each then trains one step on the same tokens. The rank saves both losses,
the local shards after the step and the default generator's state after each construction to OUTPUT_DIR/rank{N}.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from modattrs.deferred import deferred_init, is_deferred, materialize_module
from modattrs.ledger import watch
from tests import torchtitan_models as titan
from tests.support.ranks import run_as_rank

SEED, BATCH, LENGTH = 0, 2, 16


def config() -> Any:
    return titan.llama3_config(layers=2, cpu_attention=True)


def train_step(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logits = model(tokens[:, :-1])
    if isinstance(logits, DTensor):  # the lm_head's output keeps its layout
        logits = logits.full_tensor()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    return loss.detach()


def on_gloo(model: nn.Module) -> nn.Module:
    """torchtitan sets FSDP2's gradient divide factor, which FSDP2 applies with a PREMUL_SUM reduction that gloo does
    not have: sum, then divide, as FSDP2 does for such backends."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    return model


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: parameter.to_local().detach().clone() for name, parameter in model.named_parameters()}


def run(layout: dict[str, int]) -> dict[str, Any]:
    titan.use_cpu_meshes()
    world = dist.get_world_size()
    # The same tokens on every rank of a tensor-parallel group, others per data-parallel rank, as a loader gives.
    tokens = torch.randint(
        0,
        2048,
        (BATCH, LENGTH + 1),
        generator=torch.Generator().manual_seed(1 + dist.get_rank() // layout.get("tp", 1)),
    )

    torch.manual_seed(SEED)
    eager = titan.built_and_initialized(config())
    eager_state = torch.get_rng_state()
    eager = on_gloo(titan.parallelize(eager, titan.parallel_dims(world, **layout)))
    eager_loss = train_step(eager, tokens)

    torch.manual_seed(SEED)
    deferred = deferred_init(titan.built_and_initialized, config())
    deferred = on_gloo(titan.parallelize(deferred, titan.parallel_dims(world, **layout)))
    materialize_module(deferred)
    deferred_state = torch.get_rng_state()
    assert not is_deferred(deferred)
    deferred_loss = train_step(deferred, tokens)
    return {
        "losses": (eager_loss, deferred_loss),
        "states": (eager_state, deferred_state),
        "shards": (local_shards(eager), local_shards(deferred)),
    }


LEDGER_CONFIGS = {
    "llama3": lambda: titan.llama3_config(layers=1, dim=16, heads=2, vocab=256),
    "deepseek_v3": lambda: titan.deepseek_v3_config(ep=False),
}


def ledger_flows() -> dict[str, Any]:
    """torchtitan trainer's order under the write ledger, for each model: build on meta, ``parallelize`` (FSDP2 over
    every rank), ``to_empty``, then ``init_weights`` or not; what the report says of each tensor of this rank."""
    titan.use_cpu_meshes()
    found: dict[str, Any] = {}
    for name, make in LEDGER_CONFIGS.items():
        for initialize in (True, False):
            with watch() as ledger:
                with torch.device("meta"):
                    model: nn.Module = make().build()
                model = titan.parallelize(model, titan.parallel_dims(dist.get_world_size()))
                model.to_empty(device="cpu")
                if initialize:
                    with torch.no_grad():
                        model.init_weights(buffer_device=torch.device("cpu"))  # type: ignore[operator]
            report = ledger.report(model)
            embedding = model.get_parameter("tok_embeddings.weight")
            assert isinstance(embedding, DTensor)
            local = embedding.to_local()
            found[f"{name}, {'initialized' if initialize else 'not initialized'}"] = {
                "statuses": {entry.name: entry.status for entry in report},
                "problems": sorted(entry.name for entry in report.problems),
                "tensors": sorted(name for name, _ in [*model.named_parameters(), *model.named_buffers()]),
                "embedding unwritten": report["tok_embeddings.weight"].ranges("unwritten"),
                "embedding bytes": local.numel() * local.element_size(),
            }
    return found


def main() -> None:
    output = Path(sys.argv[2])
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        if sys.argv[1] == "ledger":
            result = ledger_flows()
        else:
            result = run({axis: int(degree) for axis, degree in (item.split("=") for item in sys.argv[1].split(","))})
        torch.save(result, output / f"rank{dist.get_rank()}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_as_rank(main)
