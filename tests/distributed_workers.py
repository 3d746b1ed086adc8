"""Scenarios run by each rank of the distributed tests: `python distributed_workers.py SCENARIO OUTPUT_DIR`.

Each rank writes what it saw to OUTPUT_DIR/rank{N}.pt; the test compares ranks and references. The environment
gives RANK, WORLD_SIZE, MASTER_ADDR (127.0.0.1) and MASTER_PORT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

import modattrs
import modattrs.deferred
import modattrs.fake  # imported to show that it changes nothing in processes that never use it
from modattrs import ShapedTensor, VirtualTensor
from modattrs.deferred import deferred_init, is_deferred, materialize_module
from tests.support.ranks import run_as_rank

DIM, HEADS, LENGTH = 16, 2, 8


def rope_table(module: nn.Module, dtype: torch.dtype, device: torch.device, kind: str) -> Tensor:
    half = DIM // HEADS // 2
    inv_freq = 1.0 / 10_000 ** (torch.arange(0, half, dtype=torch.float32, device=device) / half)
    angles = torch.outer(torch.arange(LENGTH, dtype=torch.float32, device=device), inv_freq)
    return (angles.cos() if kind == "cos" else angles.sin()).to(dtype)


class Attention(nn.Module):
    """Self-attention with rotary tables as VirtualTensors (fixed float32) and a scale in the compute dtype."""

    def __init__(self, persist: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        VirtualTensor(self, "cos", "make_cos", dtype=torch.float32, follow_dtype=False, persist=persist)
        VirtualTensor(self, "sin", "make_sin", dtype=torch.float32, follow_dtype=False, persist=persist)
        VirtualTensor(self, "scale", "make_scale", dtype_from="qkv.weight")
        ShapedTensor(self, "state", torch.zeros(1, DIM), {1: DIM}, persist_constraints=True)
        self.seen_dtypes: dict[str, torch.dtype] = {}

    def make_cos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return rope_table(self, dtype, device, "cos")

    def make_sin(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return rope_table(self, dtype, device, "sin")

    def make_scale(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.full((DIM,), DIM**-0.5, dtype=dtype, device=device)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        cos, sin, scale = self.cos.value[:length], self.sin.value[:length], self.scale.value
        self.seen_dtypes = {"weight": self.qkv.weight.dtype, "cos": cos.dtype, "scale": scale.dtype}
        q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        state = self.state.value
        assert state is not None
        return self.out(attended.transpose(1, 2).reshape(batch, length, DIM) * scale) + state.sum(0).to(x.dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    first, second = x.float().chunk(2, -1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], -1)


class PlainRotary(nn.Module):
    """The hand-rolled way: a non-persistent buffer computed in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos", rope_table(self, torch.float32, torch.empty(0).device, "cos"), persistent=False)


class Routed(Attention):
    """Attention with a 3-row router: FSDP2 pads its shard on 2 ranks, and leaves rank 3 of 4 with no rows."""

    def __init__(self, persist: bool = False) -> None:
        super().__init__(persist)
        self.router = nn.Linear(DIM, 3)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.router(x).sum(-1, keepdim=True)


class Decoder(nn.Module):
    def __init__(self, persist: bool = False, layers: int = 2, block: type[Attention] = Attention) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, DIM)
        self.blocks = nn.ModuleList(block(persist) for _ in range(layers))
        self.plain = PlainRotary()
        self.head = nn.Linear(DIM, 32, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)

    def init_weights(self) -> None:
        torch.manual_seed(0)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                module.reset_parameters()


def train(model: nn.Module, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        tokens = torch.randint(0, 32, (2, LENGTH), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def virtual_values(model: nn.Module) -> dict[str, Tensor]:
    values = {}
    for name, module in model.named_modules():
        for attribute in list(module.__dict__.values()):
            if isinstance(attribute, VirtualTensor):
                values[f"{name}.{attribute.name}"] = attribute.value.detach().clone()
    return values


def full_parameters(model: nn.Module) -> dict[str, Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


def sharded(model: Decoder, mesh: Any, policy: MixedPrecisionPolicy | None = None) -> Decoder:
    kwargs = {} if policy is None else {"mp_policy": policy}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def scenario_ddp(output: Path, broadcast_buffers: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(Decoder(), broadcast_buffers=broadcast_buffers)
    train(model)
    return {"parameters": full_parameters(model.module), "virtual": virtual_values(model.module)}


def scenario_fsdp_meta_init(output: Path) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = sharded(Decoder(), mesh)
    model.to_empty(device="cpu")
    model.init_weights()
    built_on_meta = virtual_values(model)
    plain_after_to_empty = model.plain.cos.clone()
    train(model)
    reference = Decoder()  # the same model built directly on the CPU
    return {
        "virtual": built_on_meta,
        "virtual_after_training": virtual_values(model),
        "reference_virtual": virtual_values(reference),
        "plain": plain_after_to_empty,
        "reference_plain": reference.plain.cos,
        "parameters": full_parameters(model),
    }


def scenario_fsdp_deferred(output: Path) -> dict[str, Any]:
    """FSDP2 with deferred initialization: each block is materialized right before it is sharded."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = deferred_init(Decoder)
    for block in model.blocks:
        materialize_module(block)
        fully_shard(block, mesh=mesh)
    materialize_module(model)
    fully_shard(model, mesh=mesh)
    generator_after = torch.get_rng_state()
    initial = full_parameters(model)
    buffers = {"plain.cos": model.plain.cos.clone(), **virtual_values(model)}
    train(model)
    torch.manual_seed(0)
    reference = Decoder()  # the same model built eagerly on the CPU, unsharded
    return {
        "initial": initial,
        "reference": full_parameters(reference),
        "buffers": buffers,
        "reference_buffers": {"plain.cos": reference.plain.cos, **virtual_values(reference)},
        "generator_equal": torch.equal(generator_after, torch.get_rng_state()),
        "trained": full_parameters(model),
    }


def llama() -> nn.Module:
    """transformers' Llama, tiny: post_init draws every weight again after construction."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32,
        hidden_size=DIM,
        intermediate_size=2 * DIM + 6,  # 38 rows: FSDP2 pads the shards of the MLP's up and gate projections on 4 ranks
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


def routed_decoder() -> nn.Module:
    return Decoder(layers=3, block=Routed)


MODELS = {"decoder": routed_decoder, "llama": llama}


def blocks_of(model: nn.Module) -> nn.ModuleList:
    blocks = model.model.layers if hasattr(model, "model") else model.blocks
    assert isinstance(blocks, nn.ModuleList)
    return blocks


def shard_deferred(build: Any, mesh: Any) -> nn.Module:
    """Seed, build deferred, and fully_shard every block, then the root: nothing is real yet."""
    torch.manual_seed(0)
    model = deferred_init(build)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert is_deferred(model)
    return model


def local_shards(model: nn.Module) -> dict[str, Tensor]:
    return {name: p._local_tensor.detach().clone() for name, p in model.named_parameters()}


def fsdp_storage_shared(model: nn.Module) -> dict[str, bool]:
    """For each parameter, whether FSDP2's padded flat shard (what its all-gathers read) is real, starts where the
    parameter's local tensor does, and holds zeros after it."""
    shared = {}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.8: one group, as _fsdp_param_group
        if groups is None:
            groups = [group] if (group := state._fsdp_param_group) is not None else []
        for group in groups:
            for fsdp_param in group.fsdp_params:
                local, flat = fsdp_param.sharded_param._local_tensor, fsdp_param._sharded_param_data
                name = f"{type(fsdp_param._module_info.module).__name__}.{fsdp_param._module_info.param_name}"
                shared[f"{name}#{len(shared)}"] = (
                    not modattrs.fake.is_fake(flat)
                    and flat.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
                    and flat.storage_offset() == local.storage_offset()
                    and not flat[local.numel() :].any()
                )
    return shared


def train_llama(model: nn.Module) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 32, (2, LENGTH), generator=torch.Generator().manual_seed(dist.get_rank()))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()


def shard_mesh(size: int) -> Any:
    """A mesh of ``size`` ranks for FSDP2 to shard over: a row of a (world / size, size) mesh, as HSDP builds."""
    world = dist.get_world_size()
    return init_device_mesh("cpu", (world // size, size), mesh_dim_names=("replicate", "shard"))["shard"]


def scenario_fsdp_materialize_after_sharding(output: Path, kind: str) -> dict[str, Any]:
    """Deferred, sharded with FSDP2 over 1, 2, ... up to all ranks, then materialized: block by block (a rank holds
    its shards and one unsharded block), and in one materialize_module call; then one training step each."""
    result: dict[str, Any] = {}
    build = MODELS[kind]
    for size in (1, 2, 4):
        if size <= dist.get_world_size():
            mesh = shard_mesh(size)
            by_block = shard_deferred(build, mesh)
            for block in blocks_of(by_block):
                materialize_module(block)
                assert not is_deferred(block)
            materialize_module(by_block)
            generator_by_block = torch.get_rng_state()
            whole = shard_deferred(build, mesh)
            materialize_module(whole)
            result[size] = {
                "by_block": local_shards(by_block),
                "whole": local_shards(whole),
                "generator_by_block": generator_by_block,
                "generator_whole": torch.get_rng_state(),
                "fsdp_storage_shared": {**fsdp_storage_shared(by_block), **fsdp_storage_shared(whole)},
                "deferred": is_deferred(by_block) or is_deferred(whole),
            }
            for model in (by_block, whole):
                train_llama(model) if kind == "llama" else train(model, steps=1)
            parameters = (*by_block.parameters(), *whole.parameters())
            result[size]["trained_finite"] = all(p.full_tensor().isfinite().all() for p in parameters)
    return result


def feed_forward() -> nn.Module:
    """An MLP for tensor parallelism (38 hidden rows: torch 2.13's DTensor linear fails on uneven column shards)."""
    return nn.Sequential(nn.Linear(DIM, 38), nn.ReLU(), nn.Linear(38, DIM))


def tensor_parallel(model: nn.Module, mesh: Any, **kwargs: Any) -> nn.Module:
    plan: dict[str, ParallelStyle] = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    return parallelize_module(model, mesh, plan, **kwargs)


def scenario_tensor_parallel(output: Path) -> dict[str, Any]:
    """Deferred, parallelized with ColwiseParallel and RowwiseParallel, then materialized; distributed without
    communication (src_data_rank=None), and with rank 0's values scattered (the default)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = tensor_parallel(deferred_init(feed_forward), mesh, src_data_rank=None)
    materialize_module(model)
    generator = torch.get_rng_state()
    shards = {name: p._local_tensor.detach().clone() for name, p in model.named_parameters()}
    placements = {
        name: [(type(x).__name__, getattr(x, "dim", None)) for x in p.placements]
        for name, p in model.named_parameters()
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, DIM, generator=torch.Generator().manual_seed(0))).pow(2).mean().backward()  # same input
    optimizer.step()

    # The default src_data_rank=0: rank 0's values scattered and broadcast, which every rank holds already.
    torch.manual_seed(0)
    scattered = materialize_module(tensor_parallel(deferred_init(feed_forward), mesh))
    return {
        "shards": shards,
        "placements": placements,
        "generator": generator,
        "trained_finite": all(p.full_tensor().isfinite().all() for p in model.parameters()),
        "scattered_shards": {name: p._local_tensor.detach().clone() for name, p in scattered.named_parameters()},
        "scattered_generator": torch.get_rng_state(),
        "scattered_still_deferred": is_deferred(scattered),
    }


class RankMarked(nn.Module):
    """``feed_forward``'s layers, plus what a constructor may do by rank (``how``): nothing, seed by rank, write the
    rank into a parameter, copy in data that differs by rank (a checkpoint only rank 0 read), draw once more on one
    rank, or keep a rank-dependent buffer that is never sent."""

    def __init__(self, how: str) -> None:
        super().__init__()
        rank = dist.get_rank()
        if how == "seeded by rank":
            torch.manual_seed(rank)
        if how == "an extra draw on the last rank" and rank == dist.get_world_size() - 1:
            torch.randn(3)
        self.layers = feed_forward()
        self.register_buffer("marks", torch.zeros(3))
        with torch.no_grad():
            if how == "the rank in a replicated bias":
                self.layers[2].bias.fill_(rank)
            if how == "data only rank 0 read":
                self.layers[0].weight.copy_(torch.full_like(self.layers[0].weight, float(rank == 0), device="cpu"))
            if how == "a rank-dependent buffer never sent":
                self.marks.fill_(rank)


def scenario_rank_dependent_sources(output: Path) -> dict[str, Any]:
    """Each kind of ``RankMarked``, deferred and parallelized with rank 0's values sent (src_data_rank=0): what
    each rank got, or the error it raised."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan: dict[str, ParallelStyle] = {"layers.0": ColwiseParallel(), "layers.2": RowwiseParallel()}
    outcomes: dict[str, Any] = {}
    for how in (
        "alike",
        "seeded by rank",
        "the rank in a replicated bias",
        "data only rank 0 read",
        "an extra draw on the last rank",
        "a rank-dependent buffer never sent",
    ):
        torch.manual_seed(0)
        model = deferred_init(RankMarked, how)
        try:
            parallelize_module(model, mesh, plan)
        except modattrs.deferred.DeferredInitError as error:
            outcomes[how] = str(error)
            continue
        materialize_module(model)
        outcomes[how] = {name: p.to_local().detach().clone() for name, p in model.layers.named_parameters()}
    return outcomes


def scenario_mixed_precision(output: Path) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = sharded(Decoder(), mesh, MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    train(model, steps=1)
    return {"seen": model.blocks[0].seen_dtypes, "outside": model.blocks[0].scale.value.dtype}


def scenario_dcp(output: Path) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = sharded(Decoder(persist=True), mesh)
    model.blocks[0].state.reconstrain(0, 3)  # one more constraint than a fresh model has
    model.blocks[0].state.value = torch.full((3, DIM), 5.0)
    model.blocks[1].state.reconstrain(1, None)  # and one fewer
    train(model, steps=1)
    saved_parameters = full_parameters(model)
    checkpoint = str(output / "checkpoint")
    dcp.save(model.state_dict(), checkpoint_id=checkpoint)

    with torch.device("meta"):
        fresh = sharded(Decoder(persist=True), mesh)
    fresh.to_empty(device="cpu")
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint, planner=modattrs.ResizingLoadPlanner())
    fresh.load_state_dict(state)
    return {
        "saved_parameters": saved_parameters,
        "loaded_parameters": full_parameters(fresh),
        "constraints": [block.state.constraints for block in fresh.blocks],
        "saved_constraints": [block.state.constraints for block in model.blocks],
        "state": fresh.blocks[0].state.value,
        "virtual": virtual_values(fresh),
        "reference_virtual": virtual_values(Decoder()),
    }


def scenario_raises_on_the_last_rank(output: Path) -> dict[str, Any]:
    if dist.get_rank() == dist.get_world_size() - 1:
        raise RuntimeError("this rank failed before its last line")
    return {}


SCENARIOS = {
    "ddp-broadcast": lambda out: scenario_ddp(out, broadcast_buffers=True),
    "ddp-no-broadcast": lambda out: scenario_ddp(out, broadcast_buffers=False),
    "fsdp-meta-init": scenario_fsdp_meta_init,
    "fsdp-deferred": scenario_fsdp_deferred,
    "fsdp-after-sharding-decoder": lambda out: scenario_fsdp_materialize_after_sharding(out, "decoder"),
    "fsdp-after-sharding-llama": lambda out: scenario_fsdp_materialize_after_sharding(out, "llama"),
    "tensor-parallel": scenario_tensor_parallel,
    "mixed-precision": scenario_mixed_precision,
    "rank-dependent-sources": scenario_rank_dependent_sources,
    "dcp": scenario_dcp,
    "raises-on-the-last-rank": scenario_raises_on_the_last_rank,
}


def main() -> None:
    scenario, output = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = SCENARIOS[scenario](output)
        torch.save(result, output / f"rank{dist.get_rank()}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    run_as_rank(main)
