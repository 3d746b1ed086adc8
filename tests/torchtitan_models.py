"""torchtitan's own models and parallelization entry points, set up as its trainer sets them up, at toy sizes.

Shared by tests/test_torchtitan.py (fake process group, in process) and tests/torchtitan_workers.py (gloo ranks).
Importing this module imports torchtitan's model code: it raises where that code does not import (see the test
module for which torch builds that is).

What differs from ``torchtitan.trainer`` (which these tests cannot import: it needs datasets, torchdata,
tensorboard, wandb and more), each on purpose:
- The model config's sharding is filled by its own ``set_*_sharding_config``, the part of
  ``Config.update_from_config`` that matters here (the rest validates the trainer's config and sizes the RoPE
  cache to the training sequence length).
- ``spmd_backend="partial_dtensor"``: torchtitan 0.3.0's default, ``"spmd_types"``, leaves the parameters of a
  model with no tensor parallelism plain tensors that ``fully_shard(dp_mesh_dims=...)`` then refuses, on the meta
  device as on a deferred model, with torch 2.13 (torchtitan targets torch nightlies).
- Its meshes are built with device type ``cpu``: ``torchtitan.tools.utils.device_type`` is ``cuda`` on a machine
  without an accelerator (``use_cpu_meshes`` sets what ``ParallelDims.build_mesh`` reads).
- The weights are initialized by ``init_weights()`` on the model as built, where ``torchtitan.trainer`` calls it
  after parallelizing (on ``to_empty`` shards): a deferred model is initialized as one device initializes it, so
  that every layout gets the same weights, which is the point of deferring.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import parallel_dims as parallel_dims_module
from torchtitan.models import deepseek_v3, llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

SPMD_BACKEND = "partial_dtensor"


def use_cpu_meshes() -> None:
    parallel_dims_module.device_type = "cpu"  # type: ignore[attr-defined]


def llama3_config(
    *, layers: int = 2, dim: int = 64, heads: int = 8, vocab: int = 2048, cpu_attention: bool = False
) -> Any:
    """torchtitan's Llama3 (``llama3._debugmodel`` made smaller): its initializers, fused wqkv and sharding plan.

    ``cpu_attention`` selects torch's SDPA for its inner attention (its language models allow only flex and varlen
    attention in 0.3.0, neither of which runs eagerly on CPU): for a forward pass on CPU ranks."""
    config = llama3.Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=layers,
            dim=dim,
            n_heads=heads,
            hidden_dim=llama3.compute_ffn_hidden_dim(dim, multiple_of=64),
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    if cpu_attention:
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(config, enable_sp=ParallelismConfig().enable_sequence_parallel)
    return config


def deepseek_v3_config(*, experts: int = 8, dim: int = 64, vocab: int = 2048, ep: bool) -> Any:
    """torchtitan's DeepSeek-V3 (``deepseek_v3._debugmodel`` made smaller): one dense layer, then MoE layers."""
    layers = deepseek_v3._build_dsv3_layers(
        n_layers=2,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=128,
        moe_hidden_dim=dim,  # FSDP shards experts on dim 1 when they are fewer than its ranks: even at 64
        num_experts=experts,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=8,
            max_seq_len=256,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=64,
        ),
    )
    config = deepseek_v3.DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init=deepseek_v3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=deepseek_v3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=deepseek_v3._output_linear_init(dim)),
        layers=layers,
    )
    set_deepseek_v3_sharding_config(config, enable_sp=ParallelismConfig().enable_sequence_parallel, enable_ep=ep)
    return config


def built_and_initialized(config: Any) -> nn.Module:
    """The model as torchtitan builds it, then its own ``init_weights()`` (under no_grad, as its trainer calls it)."""
    model: nn.Module = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)  # type: ignore[operator]
    return model


def parallel_dims(world: int, *, dp_replicate: int = 1, tp: int = 1, ep: int = 1) -> ParallelDims:
    """A ``ParallelDims`` with its meshes built (dp_shard takes what the others leave, as ``-1`` does in torchtitan)."""
    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=-1,
        cp=1,
        tp=tp,
        pp=1,
        ep=ep,
        world_size=world,
        spmd_backend=SPMD_BACKEND,
    )
    dims.build_mesh()
    return dims


def parallelize(model: nn.Module, dims: ParallelDims) -> nn.Module:
    """The model's own entry point (``parallelize_llama`` or ``parallelize_deepseekv3``) with default configs."""
    entry = llama3.parallelize_llama if isinstance(model, llama3.Llama3Model) else deepseek_v3.parallelize_deepseekv3
    parallelized: nn.Module = entry(
        model,
        parallel_dims=dims,
        training=TrainingConfig(),
        parallelism=ParallelismConfig(
            data_parallel_replicate_degree=dims.dp_replicate,
            data_parallel_shard_degree=dims.dp_shard,
            tensor_parallel_degree=dims.tp,
            expert_parallel_degree=dims.ep,
            spmd_backend=SPMD_BACKEND,
        ),
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    return parallelized


@contextlib.contextmanager
def fake_rank(world: int, rank: int) -> Iterator[None]:
    """This process as ``rank`` of ``world`` on torch's fake process group, torchtitan's meshes on the CPU."""
    use_cpu_meshes()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
