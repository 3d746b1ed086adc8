"""modattrs.deferred: modules recorded on fake tensors and materialized with eager construction's exact values."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import inspect
import io
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import modattrs.deferred
from modattrs import ShapedTensor, VirtualTensor
from modattrs.deferred import (
    DeferredInitError,
    deferred_init,
    is_deferred,
    materialize_module,
    materialize_tensor,
    register_opaque_init,
)
from modattrs.fake import fake_copy, fake_mode, is_fake
from tests.deferred_models import (
    CachedFromSubmodule,
    DataAssignedAndViews,
    DeepCopied,
    MovedAfterAliasing,
    OwnGenerator,
    RotaryInvFreq,
    Stack,
    Tied,
    TruncatedAndOrthogonal,
    ViewsAndGraphs,
    ViewsOfTheSameGeometry,
    WithAttributes,
    built_under_bfloat16,
    rejection_sample_,
)


def tiny_llama(tied: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def tensors_of(module: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer under every name it has, non-persistent buffers included."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def bits(tensor: Tensor) -> Tensor:
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)


def assert_same_bits(expected: Tensor, got: Tensor, name: str = "") -> None:
    assert not is_fake(got), name
    assert (got.shape, got.stride(), got.dtype, got.device) == (
        expected.shape,
        expected.stride(),
        expected.dtype,
        expected.device,
    ), name
    assert (got.is_conj(), got.is_neg()) == (expected.is_conj(), expected.is_neg()), name
    assert torch.equal(bits(expected), bits(got)), f"{name} differs from eager construction"


def assert_bit_identical(eager: nn.Module, materialized: nn.Module) -> None:
    expected, got = tensors_of(eager), tensors_of(materialized)
    assert expected.keys() == got.keys()
    for name in expected:
        assert_same_bits(expected[name], got[name], name)
        assert type(got[name]) is type(expected[name]), name
        assert got[name].requires_grad == expected[name].requires_grad, name
    assert aliasing(eager) == aliasing(materialized)


def aliasing(module: nn.Module) -> list[set[str]]:
    """Names grouped by the storage they share: ties and views."""
    groups: dict[int, set[str]] = {}
    for name, tensor in tensors_of(module).items():
        if tensor.numel():
            groups.setdefault(tensor.untyped_storage().data_ptr(), set()).add(name)
    return sorted(groups.values(), key=sorted)


def eager_and_materialized(build: Callable[[], nn.Module], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """``build()`` eagerly and through deferred_init + materialize_module, from one seed; checks the generator."""
    torch.manual_seed(seed)
    eager = build()
    torch.rand(100)
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(seed)
    deferred = deferred_init(build)
    assert is_deferred(deferred)
    torch.rand(100)  # draws in between come after the module's, as in eager code, and change none of its values
    materialize_module(deferred)
    assert not is_deferred(deferred)
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    return eager, deferred


CASES: dict[str, Callable[[], nn.Module]] = {
    "linear": lambda: nn.Linear(7, 5),
    "embedding with padding_idx": lambda: nn.Embedding(20, 6, padding_idx=3),
    "layer norm": lambda: nn.LayerNorm(9),
    "conv2d": lambda: nn.Conv2d(3, 4, 3),
    "batch norm": lambda: nn.BatchNorm1d(5),
    "lstm": lambda: nn.LSTM(4, 6, num_layers=2),
    "multihead attention": lambda: nn.MultiheadAttention(8, 2),
    "transformer": lambda: nn.Transformer(16, 2, 2, 2, 32, batch_first=True),
    "rope inv_freq": RotaryInvFreq,
    "tied weights": Tied,
    ".data = and views": DataAssignedAndViews,
    "views of the same geometry": ViewsOfTheSameGeometry,
    **{
        f"moved by {how} after aliasing": functools.partial(MovedAfterAliasing, how)
        for how in ("unsqueeze_", "t_", "resize_ smaller", "resize_ larger", "set_")
    },
    "deep-copied layers": DeepCopied,
    "trunc_normal_ and orthogonal_": TruncatedAndOrthogonal,
    "own generator": OwnGenerator,
    "built under a bfloat16 default dtype": built_under_bfloat16,
    "llama": functools.partial(tiny_llama, tied=False),
    "llama, tied": functools.partial(tiny_llama, tied=True),
}


@pytest.mark.parametrize("build", CASES.values(), ids=CASES.keys())
def test_materialized_module_is_bit_identical_to_eager_construction(build: Callable[[], nn.Module]) -> None:
    eager, materialized = eager_and_materialized(build)
    assert_bit_identical(eager, materialized)


@given(seed=st.integers(0, 2**32 - 1))
@settings(max_examples=10, deadline=None)
def test_any_seed_gives_bit_identical_values(seed: int) -> None:
    eager, materialized = eager_and_materialized(TruncatedAndOrthogonal, seed)
    assert_bit_identical(eager, materialized)


def test_tied_weights_stay_one_parameter() -> None:
    _, materialized = eager_and_materialized(functools.partial(tiny_llama, tied=True))
    assert materialized.lm_head.weight is materialized.model.embed_tokens.weight  # type: ignore[union-attr]


def test_views_initialized_in_place_stay_views_of_one_storage() -> None:
    _, materialized = eager_and_materialized(DataAssignedAndViews)
    assert isinstance(materialized, DataAssignedAndViews)
    assert materialized.k.untyped_storage().data_ptr() == materialized.q.untyped_storage().data_ptr()
    with torch.no_grad():
        materialized.q.view(-1)[0] = 42.0
    assert materialized.k.untyped_storage().data_ptr() == materialized.q.untyped_storage().data_ptr()


def test_references_taken_before_materializing_see_the_real_tensors() -> None:
    torch.manual_seed(0)
    eager = nn.Linear(3, 4)
    torch.manual_seed(0)
    deferred = deferred_init(nn.Linear, 3, 4)
    weight = deferred.weight
    optimizer = torch.optim.SGD(deferred.parameters(), lr=0.1)
    materialize_module(deferred)
    assert weight is deferred.weight
    assert isinstance(weight, nn.Parameter)
    assert weight.requires_grad
    assert_same_bits(eager.weight, optimizer.param_groups[0]["params"][0])
    deferred(torch.ones(2, 3)).sum().backward()
    optimizer.step()  # trains the real parameters
    assert weight.grad is not None
    assert not torch.equal(weight, eager.weight)


def test_parameters_keep_their_python_attributes_and_requires_grad() -> None:
    def build() -> nn.Linear:
        layer = nn.Linear(2, 2)
        layer.bias.requires_grad_(False)
        layer.weight.no_decay = True  # type: ignore[attr-defined]
        return layer

    materialized = materialize_module(deferred_init(build))
    assert materialized.weight.no_decay  # type: ignore[attr-defined]
    assert not materialized.bias.requires_grad
    assert isinstance(materialized.bias, nn.Parameter)


def test_tensors_in_containers_and_views_of_buffers_are_materialized_and_stay_views() -> None:
    torch.manual_seed(0)
    eager = ViewsAndGraphs()
    torch.manual_seed(0)
    deferred = deferred_init(ViewsAndGraphs)
    materialize_module(deferred)
    assert not is_deferred(deferred)
    for name in ("table", "head", "w", "v", "halves", "conj"):
        assert_same_bits(getattr(eager, name), getattr(deferred, name), name)
    assert_same_bits(eager.masks[0], deferred.masks[0])
    assert_same_bits(eager.tables["cos"], deferred.tables["cos"])
    assert deferred.head.untyped_storage().data_ptr() == deferred.table.untyped_storage().data_ptr()


class ViewsOfRegisteredViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        whole = torch.randn(12)
        self.register_buffer("part", whole[:8])
        self.register_buffer("grid", self.part.view(2, 4))
        self.register_buffer("row", self.grid[1])  # made through two views


def test_a_view_of_a_registered_view_materializes_as_eager_code_makes_it() -> None:
    eager, materialized = eager_and_materialized(ViewsOfRegisteredViews)
    assert_bit_identical(eager, materialized)
    assert materialized.row.data_ptr() == materialized.part.data_ptr() + 4 * 4
    materialized.row.fill_(7)
    eager.row.fill_(7)
    assert torch.equal(materialized.part, eager.part)


class ViewsThroughDroppedViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        table = torch.randn(12)
        self.register_buffer("table", table)
        self.register_buffer("rows", table.view(3, 4)[1:])  # the view(3, 4) between is kept by nothing else
        self.register_buffer("tail", table.view(-1)[2:].view(2, 5)[:, 1:])  # three views between
        self.register_buffer("inner", table.view(-1)[1:])
        self.register_buffer("inner_tail", self.inner.view(-1)[1:])  # a kept view, viewed through a dropped one


def test_a_buffer_viewing_another_through_views_nothing_else_keeps_materializes_as_eager_code_makes_it() -> None:
    eager, materialized = eager_and_materialized(ViewsThroughDroppedViews)
    assert_bit_identical(eager, materialized)
    assert materialized.rows.data_ptr() == materialized.table.data_ptr() + 4 * 4
    assert materialized.tail.data_ptr() == materialized.table.data_ptr() + 3 * 4
    materialized.rows.fill_(7)
    eager.rows.fill_(7)
    assert torch.equal(materialized.table, eager.table)


class DrawnTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.empty(40_000).uniform_())


def keep_only_views_of_the_table(module: nn.Module, *, other_dtype: bool = False) -> None:
    """Replace ``module.table`` by views of parts of it far apart, as FSDP2 replaces a parameter by views of a shard:
    views made after deferred_init, which nothing uses until materializing."""
    whole = module.table.detach()
    del module.table
    module.register_buffer("head", whole[100:110])
    module.register_buffer("tail", whole[30_000:30_010].view(2, 5))
    if other_dtype:
        module.register_buffer("bits", whole[200:204].view(torch.int32))


@pytest.mark.parametrize("other_dtype", [False, True], ids=["one dtype", "and a view in another dtype"])
def test_views_made_after_deferred_init_of_parts_of_a_tensor_far_apart_materialize_as_eager_code_makes_them(
    other_dtype: bool,
) -> None:
    torch.manual_seed(0)
    eager = DrawnTable()
    keep_only_views_of_the_table(eager, other_dtype=other_dtype)
    torch.manual_seed(0)
    deferred = deferred_init(DrawnTable)
    keep_only_views_of_the_table(deferred, other_dtype=other_dtype)
    materialize_module(deferred)
    assert not is_deferred(deferred)
    assert_bit_identical(eager, deferred)
    assert deferred.tail.data_ptr() == deferred.head.data_ptr() + 29_900 * 4  # one memory, as in eager code
    deferred.head.fill_(7)
    eager.head.fill_(7)
    assert_bit_identical(eager, deferred)


def test_a_view_made_after_deferred_init_materialized_alone_brings_the_views_sharing_its_storage_along() -> None:
    torch.manual_seed(0)
    eager = DrawnTable()
    keep_only_views_of_the_table(eager)
    torch.manual_seed(0)
    deferred = deferred_init(DrawnTable)
    keep_only_views_of_the_table(deferred)
    materialize_tensor(deferred.tail)
    assert not is_deferred(deferred)
    assert_bit_identical(eager, deferred)


def test_a_tensor_that_carried_a_graph_comes_back_as_its_value() -> None:
    deferred = materialize_module(deferred_init(ViewsAndGraphs))
    assert deferred.product.grad_fn is None
    assert not deferred.product.requires_grad
    assert torch.equal(deferred.product, deferred.w.detach() * deferred.v.detach())


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")
def test_old_style_weight_norm_materializes_and_trains() -> None:
    eager, materialized = eager_and_materialized(lambda: nn.utils.weight_norm(nn.Linear(4, 5)))
    assert_bit_identical(eager, materialized)
    materialized(torch.ones(2, 4)).sum().backward()
    assert materialized.weight_g.grad is not None


def test_gradient_hooks_registered_on_deferred_parameters_still_fire() -> None:
    calls: list[str] = []
    deferred = deferred_init(nn.Linear, 3, 2)
    deferred.weight.register_hook(lambda grad: calls.append("hook"))
    deferred.bias.register_post_accumulate_grad_hook(lambda parameter: calls.append("post"))
    materialize_module(deferred)
    deferred(torch.ones(1, 3)).sum().backward()
    assert sorted(calls) == ["hook", "post"]


def test_cached_virtual_values_computed_from_fake_tensors_are_recomputed_after_materializing() -> None:
    torch.manual_seed(0)
    eager = CachedFromSubmodule()
    torch.manual_seed(0)
    deferred = deferred_init(CachedFromSubmodule)
    materialize_module(deferred, check_fn=lambda module: module is deferred)  # the references, not the linear
    assert is_fake(deferred.declared.value)
    assert is_fake(deferred.undeclared.value)
    materialize_module(deferred)
    assert_same_bits(eager.declared.value, deferred.declared.value)
    assert_same_bits(eager.undeclared.value, deferred.undeclared.value)


def test_concurrent_materializations_each_give_eager_values() -> None:
    torch.manual_seed(0)
    eager = Stack(layers=8)
    models = []
    for _ in range(4):
        torch.manual_seed(0)
        models.append(deferred_init(Stack, layers=8))
    threads = [threading.Thread(target=materialize_module, args=(model,)) for model in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for model in models:
        assert_bit_identical(eager, model)


def test_a_recurrent_layer_runs_after_materializing() -> None:
    eager, materialized = eager_and_materialized(lambda: nn.LSTM(3, 4))
    inputs = torch.randn(5, 2, 3)
    assert torch.equal(eager(inputs)[0], materialized(inputs)[0])


# --- modattrs attributes ---------------------------------------------------------------------------------------------


def test_virtual_and_shaped_attributes_work_before_and_after_materializing() -> None:
    torch.manual_seed(0)
    eager = WithAttributes()
    torch.manual_seed(0)
    deferred = deferred_init(WithAttributes)
    assert is_fake(deferred.norm.value)  # computed and cached from the fake parameter
    assert is_fake(deferred.state.value)
    assert deferred.state.value.shape == (2, 4)
    materialize_module(deferred)
    assert_same_bits(eager.norm.value, deferred.norm.value)
    assert_same_bits(eager.state.value, deferred.state.value)
    with torch.no_grad():
        deferred.scale.mul_(2)
    assert torch.allclose(deferred.norm.value, 2 * eager.norm.value)
    deferred.state.value = torch.ones(3, 4)
    with pytest.raises(ValueError, match="ShapedTensor 'state'"):
        deferred.state.value = torch.ones(3, 5)


class ShapedParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        ShapedTensor(self, "kv", nn.Parameter(torch.zeros(3, 4)), {1: 4})


class ProbesAShapeInFakeMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, kernel_size=3)
        with fake_mode():  # only a shape is kept
            width = self.conv(torch.empty(1, 2, 8)).shape[-1]
        self.head = nn.Linear(3 * width, 2)


class KeepsAPartBuiltInFakeMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(2, 2)
        with fake_mode():
            self.second = nn.Linear(2, 2)


def test_a_fake_mode_block_inside_deferred_init_may_probe_shapes_but_not_build_what_is_kept() -> None:
    eager, materialized = eager_and_materialized(ProbesAShapeInFakeMode)
    assert_bit_identical(eager, materialized)
    with pytest.raises(
        DeferredInitError,
        match=r"^parameter 'second\.weight' \(Linear\) is a fake tensor that no deferred_init recorded, so there is "
        r"nothing to replay for it\.\n.*in a fake_mode block inside the function",
    ):
        materialize_module(deferred_init(KeepsAPartBuiltInFakeMode))


def test_real_data_assigned_to_a_deferred_shaped_parameter_is_kept_by_materializing() -> None:
    module = deferred_init(ShapedParameter)
    module.kv.value = torch.ones(2, 4)  # a real parameter takes the deferred one's place
    materialize_module(module)
    assert isinstance(module._kv_data, nn.Parameter)
    assert torch.equal(module.kv.value, torch.ones(2, 4))
    assert vars(module._kv_data) == {}  # nothing of the fake parameter it replaced
    assert torch.equal(pickle.loads(pickle.dumps(module)).kv.value, torch.ones(2, 4))
    assert fake_copy(module, device="cuda").kv.value.device == torch.device("cuda:0")


# --- after recording -------------------------------------------------------------------------------------------------


def test_conversions_and_initialization_after_deferred_init_are_replayed() -> None:
    def finish(module: nn.Module) -> nn.Module:
        nn.init.zeros_(module.layers[0].bias)
        with torch.no_grad():
            module.layers[1].weight.data.fill_(0.5)
        nn.init.trunc_normal_(module.layers[2].weight)
        return module.to(torch.float64).half()

    torch.manual_seed(0)
    eager = finish(Stack())
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = finish(deferred_init(Stack))
    assert deferred.layers[0].weight.dtype == torch.half
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_values_copied_in_after_deferred_init_are_replayed() -> None:
    weight = torch.randn(4, 4)
    deferred = deferred_init(nn.Linear, 4, 4)
    with torch.no_grad():
        deferred.weight.copy_(weight)
    materialize_module(deferred)
    assert torch.equal(deferred.weight, weight)


CHECKPOINT_CHANGES: dict[str, Callable[[Tensor], object]] = {
    "through .data": lambda tensor: tensor.data.mul_(0),
    "through a numpy array sharing its memory": lambda tensor: tensor.numpy().fill(0),
    "in place": lambda tensor: tensor.mul_(0),
}


@pytest.mark.parametrize("change", CHECKPOINT_CHANGES.values(), ids=CHECKPOINT_CHANGES.keys())
def test_a_checkpoint_changed_after_a_copying_load_leaves_the_values_it_had_at_load_as_eager_does(
    change: Callable[[Tensor], object],
) -> None:
    torch.manual_seed(0)
    checkpoint = {name: tensor.clone() for name, tensor in nn.Linear(4, 4).state_dict().items()}
    expected = {name: tensor.clone() for name, tensor in checkpoint.items()}
    eager, deferred = nn.Linear(4, 4), deferred_init(nn.Linear, 4, 4)
    eager.load_state_dict(checkpoint)
    deferred.load_state_dict(checkpoint)
    for tensor in checkpoint.values():
        change(tensor)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert torch.equal(deferred.weight, expected["weight"])
    assert torch.equal(deferred.bias, expected["bias"])


def test_a_copying_load_into_a_deferred_model_lets_the_checkpoint_go_as_eager_code_does() -> None:
    checkpoint = {name: tensor.clone() for name, tensor in nn.Linear(4, 4).state_dict().items()}
    expected = {name: tensor.clone() for name, tensor in checkpoint.items()}
    weight = weakref.ref(checkpoint["weight"])
    deferred = deferred_init(nn.Linear, 4, 4)
    deferred.load_state_dict(checkpoint)
    del checkpoint
    gc.collect()
    assert weight() is None
    materialize_module(deferred)
    assert torch.equal(deferred.weight, expected["weight"])
    assert torch.equal(deferred.bias, expected["bias"])


def test_a_value_computed_from_a_handed_tensor_keeps_what_it_computed_when_the_tensor_changes_unseen() -> None:
    def build(given: Tensor) -> nn.Module:
        module = nn.Module()
        module.register_buffer("scaled", given * 2)
        return module

    given = torch.arange(4.0)
    eager = build(given)
    deferred = deferred_init(build, given)
    given.numpy().fill(7)  # moves no version counter
    materialize_module(deferred)
    assert torch.equal(deferred.scaled, eager.scaled)
    assert torch.equal(deferred.scaled, torch.arange(4.0) * 2)


@pytest.mark.parametrize("change", CHECKPOINT_CHANGES.values(), ids=CHECKPOINT_CHANGES.keys())
def test_a_real_tensor_viewed_by_a_deferred_module_and_changed_since_raises_naming_it_and_leaves_the_module_fake(
    change: Callable[[Tensor], object],
) -> None:
    given = torch.arange(4.0)
    deferred = deferred_init(HoldsAViewOf, given)
    change(given)
    state = torch.get_rng_state()
    with pytest.raises(DeferredInitError) as error:
        materialize_module(deferred)
    message = str(error.value)
    assert message.startswith(
        "deferred_init's argument 'given' ((4,), torch.float32), viewed by aten.view.default while recording, was "
        "changed in place since."
    )
    assert "\nexpected: the values it had when recorded\ngot: other values\n" in message
    assert is_fake(deferred.table)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_meta_tensor_handed_in_and_viewed_materializes_on_meta_as_eager_code_builds_it() -> None:
    given = torch.empty(4, device="meta")
    deferred = deferred_init(HoldsAViewOf, given)
    materialize_module(deferred)
    assert deferred.table.is_meta
    assert deferred.table.shape == (2, 2)


class ReshapesAResizedOut(nn.Module):
    """Writes into an empty ``out=`` tensor, which the operation resizes and restrides like its input, then reshapes
    it: a copy in eager code, since the result is transposed."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        if layout == "transposed":
            source = torch.randn(4, 3).t()
        else:
            source = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
        out = torch.mul(source, 2, out=torch.empty(0))
        self.register_buffer("out", out)
        self.register_buffer("flat", out.reshape(-1))
        self.flat.add_(1)


@pytest.mark.parametrize("layout", ["transposed", "channels_last"])
def test_a_reshape_of_a_resized_out_tensor_is_recorded_as_eager_code_runs_it_and_materializes(layout: str) -> None:
    torch.manual_seed(0)
    eager = ReshapesAResizedOut(layout)
    torch.manual_seed(0)
    deferred = deferred_init(ReshapesAResizedOut, layout)
    assert deferred.out.stride() == eager.out.stride()
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert deferred.out.stride() == eager.out.stride()


# --- partial materialization ------------------------------------------------------------------------------------------


@given(
    chosen=st.sets(
        st.sampled_from(
            [
                "model.embed_tokens",
                "model.layers.0",
                "model.layers.1.mlp",
                "lm_head",
                "model.norm",
                "model.rotary_emb",
                "model.layers.1.self_attn.q_proj",
            ]
        )
    )
)
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_partial_materialization_gives_the_eager_values_of_what_it_chose(chosen: set[str]) -> None:
    torch.manual_seed(0)
    eager = tiny_llama(tied=False)
    torch.rand(99)
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = deferred_init(tiny_llama, tied=False)
    torch.rand(99)  # draws in between come after the model's, as in eager code, and change none of its values
    state_before = torch.get_rng_state()
    names = {module: name for name, module in deferred.named_modules()}
    in_chosen = lambda name: any(name == c or name.startswith(c + ".") for c in chosen)  # noqa: E731
    materialize_module(deferred, check_fn=lambda module: in_chosen(names[module]))
    assert torch.equal(torch.get_rng_state(), state_before)  # a partial materialization leaves the generator alone
    expected = tensors_of(eager)
    for name, tensor in tensors_of(deferred).items():
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if in_chosen(owner):
            assert_same_bits(expected[name], tensor, name)
        else:
            assert is_fake(tensor), name
    assert is_deferred(deferred) == any(is_fake(t) for t in tensors_of(deferred).values())
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


class SeedsInAFork(nn.Module):
    """Reseeds inside a fork, which puts the generator back: eager code leaves it where it found it."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(3)
        self.norm = nn.LayerNorm(3)


def test_a_reseed_undone_by_a_fork_while_recording_does_not_count_as_the_callers() -> None:
    torch.manual_seed(0)
    nn.Linear(4, 4), SeedsInAFork()
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    first, second = deferred_init(nn.Linear, 4, 4), deferred_init(SeedsInAFork)
    materialize_module(second)
    materialize_module(first)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_a_reseed_after_deferred_init_is_kept_by_the_full_materialization() -> None:
    torch.manual_seed(0)
    deferred = deferred_init(Stack)
    torch.manual_seed(1000)  # as ranks do, to draw different data: eager code would be at this state now
    reseeded = torch.get_rng_state()
    materialize_module(deferred)
    assert torch.equal(torch.get_rng_state(), reseeded)
    torch.manual_seed(0)
    assert_bit_identical(Stack(), deferred)


def test_check_fn_is_called_with_every_submodule_and_buffers_only_leaves_parameters_fake() -> None:
    deferred = deferred_init(Stack)
    seen: list[nn.Module] = []
    materialize_module(deferred, check_fn=lambda module: seen.append(module) is None, buffers_only=True)
    assert seen == list(deferred.modules())
    assert not is_fake(deferred.steps)
    assert all(is_fake(p) for p in deferred.parameters())
    assert is_deferred(deferred)


def test_a_chosen_view_brings_the_tensors_sharing_its_storage_along() -> None:
    torch.manual_seed(0)
    eager = DataAssignedAndViews()
    torch.manual_seed(0)
    deferred = deferred_init(DataAssignedAndViews)
    materialize_tensor(deferred.q)
    assert_same_bits(eager.k, deferred.k)
    assert deferred.k.untyped_storage().data_ptr() == deferred.q.untyped_storage().data_ptr()
    assert is_fake(deferred.linear.weight)


def test_materialize_tensor_replays_one_tensor_and_passes_real_ones_through() -> None:
    torch.manual_seed(0)
    eager = Stack()
    torch.manual_seed(0)
    deferred = deferred_init(Stack)
    weight = deferred.layers[2].weight
    assert is_deferred(weight)
    assert materialize_tensor(weight) is weight
    assert not is_deferred(weight)
    assert_same_bits(eager.layers[2].weight, weight)
    real = torch.ones(2)
    assert materialize_tensor(real) is real


def test_materializing_twice_repeats_the_same_values() -> None:
    torch.manual_seed(0)
    first = deferred_init(Stack)
    second = copy.deepcopy(first)  # recorded as well: clones of the same record
    materialize_module(first)
    materialize_module(second)
    assert_bit_identical(first, second)


class ViewingOneAnother(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        whole = torch.arange(8.0)
        self.register_buffer("whole", whole)
        self.register_buffer("grid", whole.view(2, 4))
        self.register_buffer("middle", whole[2:6])
        self.linear = nn.Linear(3, 3)


class ViewingATiedWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("rows", self.embed.weight.detach()[3:5])


def offsets(module: nn.Module) -> dict[str, int]:
    return {name: tensor.storage_offset() for name, tensor in tensors_of(module).items()}


def assert_copies_materialize_as_eager_copies(
    build: Callable[[], nn.Module], write: Callable[[nn.Module], None]
) -> None:
    """A deferred model and its deep copy, materialized (the copy first), hold the eager model's and its deep copy's
    values, sharing memory where they do at the same offsets, and stay so after ``write`` changes both in place."""
    torch.manual_seed(0)
    eager = build()
    eager_copy = copy.deepcopy(eager)
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = deferred_init(build)
    copied = copy.deepcopy(deferred)
    materialize_module(copied)
    materialize_module(deferred)
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    for expected, got in ((eager, deferred), (eager_copy, copied)):
        assert_bit_identical(expected, got)
        assert offsets(got) == offsets(expected)
        write(expected)
        write(got)
        assert_bit_identical(expected, got)


def test_a_deep_copy_of_a_deferred_model_materializes_views_in_the_copied_memory_of_what_they_view() -> None:
    def write(module: nn.Module) -> None:
        module.grid[1].fill_(9)
        module.middle.mul_(3)

    assert_copies_materialize_as_eager_copies(ViewingOneAnother, write)


def test_a_deep_copy_of_a_deferred_model_holding_a_view_of_a_tied_weight_at_an_offset_materializes_as_eager_does() -> (
    None
):
    def write(module: nn.Module) -> None:
        module.rows.fill_(9)
        with torch.no_grad():
            module.head.weight.add_(1)

    assert_copies_materialize_as_eager_copies(ViewingATiedWeight, write)


class CopyingGivenTensors(nn.Module):
    def __init__(self, given: list[Tensor]) -> None:
        super().__init__()
        whole, part = copy.deepcopy(given)
        self.register_buffer("whole", whole)
        self.register_buffer("part", part)


def test_a_deep_copy_of_real_tensors_inside_deferred_init_materializes_as_an_eager_copy_of_them() -> None:
    given = torch.arange(6.0)
    eager = CopyingGivenTensors([given, given[2:4]])
    deferred = deferred_init(CopyingGivenTensors, [given, given[2:4]])
    assert is_deferred(deferred.part)
    materialize_module(deferred)

    assert_bit_identical(eager, deferred)
    assert offsets(deferred) == offsets(eager)
    deferred.part.fill_(9)
    assert deferred.whole.tolist() == [0.0, 1.0, 9.0, 9.0, 4.0, 5.0]
    assert given.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


PEAK_MEMORY = """
    import resource, torch
    from torch import nn
    from modattrs.deferred import deferred_init, materialize_module

    width = 2048  # 16 MiB per weight

    def build():
        layers = nn.Sequential(*(nn.Linear(width, width) for _ in range(8)))
        for layer in layers:  # a draw that reads a tensor's shape only: it need not run for real
            layer.register_buffer("noise", torch.rand_like(layer.weight))
        return layers

    model = deferred_init(build)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    materialize_module(model, check_fn=lambda module: module is model[5])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(grown // 1024)
"""


def test_partial_materialization_peaks_at_the_subset_plus_one_tensor() -> None:
    # Big blocks straight from mmap, and back to the system when freed: what is measured is what is alive.
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PEAK_MEMORY)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=environment,
    )
    grown_mib = int(result.stdout.split()[-1])
    # The subset is one layer: a 16 MiB weight and 16 MiB of noise; every other draw goes into one scratch tensor.
    assert grown_mib <= 2 * 16 + 16 + 8, result.stdout


# --- devices -----------------------------------------------------------------------------------------------------


class LogitScale(nn.Module):
    """CLIP's logit_scale: a parameter made from a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.proj = nn.Linear(2, 2)


def test_a_deferred_module_with_a_scalar_parameter_can_be_cast_to_half_and_materializes_eager_values() -> None:
    torch.manual_seed(0)
    eager = LogitScale().half()
    torch.manual_seed(0)
    deferred = deferred_init(LogitScale).half()
    assert deferred.logit_scale.dtype == torch.float16
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


def cuda_stack() -> nn.Module:
    with torch.device("cuda"):
        return Stack()


def test_a_spoofed_cuda_record_materializes_on_the_cpu_with_eager_cpu_values() -> None:
    torch.manual_seed(0)
    eager = Stack()
    with fake_mode(fake_cuda=True):
        torch.manual_seed(0)
        deferred = deferred_init(cuda_stack)
    assert deferred.layers[0].weight.device.type == "cuda"
    with pytest.raises(DeferredInitError, match="no CUDA device; pass device='cpu'"):
        materialize_module(deferred)
    assert is_deferred(deferred)
    assert all(is_fake(t) for t in tensors_of(deferred).values())
    materialize_module(deferred, device="cpu")
    assert_bit_identical(eager, deferred)


CUDA_ON_ITS_OWN = """
    import torch
    from torch import nn
    from modattrs.deferred import deferred_init, materialize_module

    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    torch.manual_seed(0)
    by_argument = deferred_init(lambda: nn.Linear(4, 4, device="cuda"))
    torch.manual_seed(0)  # CUDA draws do not move the CPU generator
    with torch.device("cuda"):
        by_context = deferred_init(nn.Linear, 4, 4)
    print(by_argument.weight.device, by_context.weight.device)
    for deferred in (by_argument, by_context):
        materialize_module(deferred, device="cpu")
        print(torch.equal(deferred.weight, eager.weight), torch.equal(deferred.bias, eager.bias))
"""


def test_deferring_a_module_built_for_cuda_works_on_its_own_and_materializes_eager_values_on_the_cpu() -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    if _cuda_guard.gpu_present():
        pytest.skip("this machine has a GPU: nothing is spoofed")

    try:
        _cuda_guard.require()  # builds the guard once, for the fresh process below
    except RuntimeError as error:
        pytest.skip(f"the fake CUDA guard cannot be built here: {error}")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CUDA_ON_ITS_OWN)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cuda:0", "cuda:0", "True", "True", "True", "True"]


MOVED_TO_CUDA = """
    import sys
    import torch
    from torch import nn
    from modattrs.deferred import deferred_init, materialize_module
    from modattrs.fake import fake_mode

    if sys.argv[1] == "after fake CUDA":
        with fake_mode(fake_cuda=True):
            torch.empty(1, device="cuda")
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    torch.manual_seed(0)
    deferred = deferred_init(nn.Linear, 4, 4)
    moved = deferred.to("cuda") if sys.argv[2] == "to" else deferred.cuda()
    print(moved.weight.device)
    materialize_module(moved, device="cpu")
    print(torch.equal(moved.weight, eager.weight), torch.equal(moved.bias, eager.bias))
"""


@pytest.mark.parametrize("move", ["to", "cuda"])
@pytest.mark.parametrize("before", ["in a fresh process", "after fake CUDA"])
def test_moving_a_deferred_cpu_model_to_cuda_works_whatever_ran_before_in_the_process(before: str, move: str) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    if _cuda_guard.gpu_present():
        pytest.skip("this machine has a GPU: nothing is spoofed")
    try:
        _cuda_guard.require()  # builds the guard once, for the fresh process below
    except RuntimeError as error:
        pytest.skip(f"the fake CUDA guard cannot be built here: {error}")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MOVED_TO_CUDA), before, move],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cuda:0", "True", "True"]


FAKE_MODE_MODEL_MOVED_TO_CUDA = """
    import torch
    from torch import nn
    from modattrs.fake import fake_mode

    with fake_mode():
        module = nn.Linear(2, 2)
    try:
        module.to("cuda")
    except RuntimeError as error:
        print(type(error).__name__, error)
    print(module.weight.device)
"""


def test_moving_a_fake_mode_model_to_cuda_before_fake_cuda_is_set_up_says_what_to_do() -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    if _cuda_guard.gpu_present():
        pytest.skip("this machine has a GPU: nothing is spoofed")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FAKE_MODE_MODEL_MOVED_TO_CUDA)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "RuntimeError fake tensors on cuda need modattrs.fake.fake_mode(fake_cuda=True) (or fake_copy to a CUDA "
        "device) first, on this machine, which has no GPU",
        "cpu",
    ]


def test_deferring_a_module_built_for_cuda_without_a_compiler_says_so_and_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    def no_compiler(*, replace: bool) -> None:
        raise FileNotFoundError("[Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(_cuda_guard, "_ready", False)
    monkeypatch.setattr(_cuda_guard, "_failure", None)
    monkeypatch.setattr(_cuda_guard, "cuda_built", lambda: False)
    monkeypatch.setattr(_cuda_guard, "_build_and_register", no_compiler)
    with pytest.raises(DeferredInitError) as error:
        deferred_init(lambda: nn.Linear(4, 4, device="cuda"))
    message = str(error.value)
    assert "asks for a CUDA device" in message
    assert "test_deferred.py:" in message
    assert "No such file or directory: 'c++'" in message
    assert "Install a C++ compiler (g++) and ninja" in message
    assert "build the module for the CPU" in message


def test_a_cpu_part_of_a_record_with_spoofed_cuda_materializes_alone() -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(2, 2, device="cuda"), nn.Linear(2, 2))

    with fake_mode(fake_cuda=True):
        torch.manual_seed(0)
        deferred = deferred_init(build)
    materialize_module(deferred, check_fn=lambda module: module is deferred[1])
    # The CUDA layer draws from CUDA's generator, not the CPU's: the CPU layer draws first on the CPU.
    torch.manual_seed(0)
    assert_same_bits(nn.Linear(2, 2).weight, deferred[1].weight)
    assert is_fake(deferred[0].weight)


# --- errors --------------------------------------------------------------------------------------------------------


class ReadsItsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        if self.weight.sum() > 0:  # the line the error must name
            self.weight.data.neg_()


def test_reading_values_while_recording_raises_naming_the_op_module_and_line() -> None:
    line = (
        inspect.getsource(ReadsItsValues)
        .splitlines()
        .index("        if self.weight.sum() > 0:  # the line the error must name")
    )
    expected_line = inspect.getsourcelines(ReadsItsValues)[1] + line
    with pytest.raises(DeferredInitError) as error:
        deferred_init(ReadsItsValues)
    message = str(error.value)
    assert "aten._local_scalar_dense" in message or "aten.is_nonzero" in message
    assert "ReadsItsValues.__init__" in message
    assert f"test_deferred.py:{expected_line}" in message
    assert "register_opaque_init" in message


class RejectionSampled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(50))
        sys.modules[__name__].rejection_sample_(self.weight, 1.0)
        self.after = nn.Parameter(torch.rand(3))


# Every way of reading values, each on a line of its own: the error names that line.
VALUE_READS: dict[str, Callable[[Tensor], object]] = {
    ".numpy()": lambda t: t.numpy(),
    ".numpy(force=True)": lambda t: t.numpy(force=True),
    "np.asarray": lambda t: np.asarray(t),
    "np.from_dlpack": lambda t: np.from_dlpack(t),
    ".tolist()": lambda t: t.tolist(),
    ".item()": lambda t: t[0].item(),
    "float()": lambda t: float(t[0]),
    "int()": lambda t: int(t[0]),
    "complex()": lambda t: complex(t[0]),
    "bool()": lambda t: bool(t[0]),
    "an index": lambda t: [1, 2, 3][t[0].long()],
    "a format": lambda t: f"{t[0]:.2f}",
}


class ReadsValuesBy(nn.Module):
    def __init__(self, read: Callable[[Tensor], object]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        read(self.weight.detach())


@pytest.mark.parametrize("how", VALUE_READS)
def test_every_way_of_reading_values_while_recording_raises_naming_the_operation_module_and_line(how: str) -> None:
    read = VALUE_READS[how]
    with pytest.raises(DeferredInitError) as error:
        deferred_init(ReadsValuesBy, read)
    message = str(error.value)
    assert "needs the values of a fake tensor that is not a construction-time constant" in message
    assert "ReadsValuesBy.__init__" in message
    assert f"test_deferred.py:{read.__code__.co_firstlineno}" in message


@pytest.mark.parametrize("how", [".tolist()", ".item()", "float()", "bool()"])
def test_reading_values_of_a_deferred_tensor_after_recording_says_to_materialize_first(how: str) -> None:
    module = deferred_init(nn.Linear, 3, 3)
    with pytest.raises(DeferredInitError) as error:
        VALUE_READS[how](module.bias.detach())
    message = str(error.value)
    assert "until it is materialized" in message
    assert "materialize_module" in message
    assert "while deferred_init records" not in message
    assert f"test_deferred.py:{VALUE_READS[how].__code__.co_firstlineno}" in message


def test_values_of_real_tensors_read_while_recording_are_their_values() -> None:
    real, scalar = torch.tensor([0.5, 2.0]), torch.tensor(0.25)
    read: list[object] = []

    def build() -> nn.Module:
        read.extend([real.numpy().tolist(), np.asarray(real).tolist(), np.from_dlpack(real).tolist(), real.tolist()])
        read.extend([scalar.item(), float(scalar), bool(scalar), f"{scalar:.2f}", [1, 2][scalar.long()]])
        return nn.Linear(2, 2)

    assert is_deferred(deferred_init(build))
    assert read == [[0.5, 2.0]] * 4 + [0.25, 0.25, True, "0.25", 1]


def test_a_registered_opaque_init_is_recorded_as_one_call_and_replayed_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = sys.modules[__name__]
    with pytest.raises(DeferredInitError, match="register_opaque_init"):
        deferred_init(RejectionSampled)
    monkeypatch.setattr(module, "rejection_sample_", rejection_sample_)  # restored after the test
    register_opaque_init(module, "rejection_sample_")
    register_opaque_init(module, "rejection_sample_")  # twice is harmless
    eager, materialized = eager_and_materialized(RejectionSampled)
    assert_bit_identical(eager, materialized)
    assert materialized.weight.abs().max() <= 1.0  # type: ignore[operator]
    keyword = deferred_init(lambda: nn.ParameterList([module.rejection_sample_(tensor=torch.empty(5), limit=0.5)]))
    materialize_module(keyword)
    assert not is_fake(keyword[0])
    assert keyword[0].abs().max() <= 0.5  # recorded although given by name, so it ran at materialization
    real = torch.empty(10)
    assert module.rejection_sample_(real, 0.5) is real
    assert real.abs().max() <= 0.5


def test_register_opaque_init_refuses_what_is_not_a_function() -> None:
    with pytest.raises(TypeError, match="not a function"):
        register_opaque_init(torch.nn.init, "__name__")
    with pytest.raises(ValueError, match="mutates"):
        register_opaque_init(torch.nn.init, "normal_", mutates=-1)


class Reseeding(nn.Module):
    """Changes of the default generator between draws: a reseed, a forked generator, a state put back."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        torch.manual_seed(7)
        self.second = nn.Linear(3, 3)
        with torch.random.fork_rng():
            torch.manual_seed(11)
            self.forked = nn.Parameter(torch.randn(4))
        self.after_fork = nn.Parameter(torch.randn(4))
        state = torch.get_rng_state()
        self.drawn = nn.Parameter(torch.rand(2))
        torch.set_rng_state(state)
        self.drawn_again = nn.Parameter(torch.rand(2))
        torch.manual_seed(3)  # last: eager construction leaves the generator here


class PerLayerGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator()
        self.layers = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))
        for index, layer in enumerate(self.layers):
            generator.manual_seed(100 + index)
            nn.init.normal_(layer.weight, generator=generator)
        self.unseeded = nn.Parameter(torch.rand(3, generator=generator))
        self.default = nn.Parameter(torch.rand(3, generator=torch.default_generator))


@pytest.mark.parametrize("build", [Reseeding, PerLayerGenerator])
def test_generator_reseeds_and_explicit_generators_replay_exactly(build: Callable[[], nn.Module]) -> None:
    eager, materialized = eager_and_materialized(build)
    assert_bit_identical(eager, materialized)


def test_a_generator_shared_by_the_code_and_the_caller_ends_where_eager_code_leaves_it() -> None:
    generator = torch.Generator().manual_seed(5)
    eager = nn.Parameter(torch.randn(6, generator=generator))
    after_eager = torch.randn(2, generator=generator)
    generator.manual_seed(5)
    deferred = deferred_init(lambda: nn.ParameterList([torch.randn(6, generator=generator)]))
    assert torch.equal(torch.randn(2, generator=generator), after_eager)  # advanced as eager code advances it
    materialize_module(deferred)
    assert_same_bits(eager.detach(), deferred[0].detach())


def test_consecutive_deferred_inits_draw_in_eager_order() -> None:
    torch.manual_seed(0)
    eager = [Stack(), Stack(), nn.Linear(3, 3)]
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = [deferred_init(Stack), deferred_init(Stack), deferred_init(nn.Linear, 3, 3)]
    for index in (1, 0, 2):  # any order; the one built last goes last, to leave the generator as eager code does
        materialize_module(deferred[index])
        assert_bit_identical(eager[index], deferred[index])
    assert not torch.equal(bits(deferred[0].layers[0].weight), bits(deferred[1].layers[0].weight))
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_a_reseed_between_deferred_inits_starts_the_next_from_the_seed() -> None:
    torch.manual_seed(0)
    first = deferred_init(Stack)
    torch.manual_seed(0)  # the generator's state is what it was: only the reseed tells the two cases apart
    second = deferred_init(Stack)
    materialize_module(second)
    materialize_module(first)
    assert_bit_identical(first, second)


RESEEDS_NOT_WRAPPED: dict[str, Callable[[int], object]] = {
    "torch.default_generator.manual_seed": lambda seed: torch.default_generator.manual_seed(seed),
    # what `from torch import manual_seed` before modattrs' first use holds
    "torch's own manual_seed": lambda seed: inspect.unwrap(torch.manual_seed)(seed),
}


@pytest.mark.parametrize("how", RESEEDS_NOT_WRAPPED)
def test_a_reseed_between_deferred_inits_through_a_name_that_is_not_wrapped_is_seen(how: str) -> None:
    reseed = RESEEDS_NOT_WRAPPED[how]
    reseed(0)
    first = deferred_init(Stack)
    reseed(0)
    second = deferred_init(Stack)
    reseed(0)
    eager = Stack()
    materialize_module(second)
    materialize_module(first)
    assert_bit_identical(eager, first)
    assert_bit_identical(eager, second)


def interleaved(build: Callable[[int, int], nn.Linear]) -> tuple[nn.Linear, nn.Linear]:
    """Two modules built, then initialized in turns, with reseeds, forks and saved states in between."""
    torch.manual_seed(0)
    first, second = build(3, 3), build(3, 3)
    nn.init.normal_(first.weight)  # after the second module's construction
    with torch.random.fork_rng():
        nn.init.normal_(second.weight)
    saved = torch.get_rng_state()
    nn.init.normal_(first.bias)
    torch.set_rng_state(saved)
    nn.init.normal_(second.bias)
    torch.manual_seed(42)
    nn.init.uniform_(second.weight)
    nn.init.uniform_(first.weight)
    return first, second


def test_modules_initialized_in_turns_after_deferred_init_draw_in_eager_order() -> None:
    eager = interleaved(nn.Linear)
    state_after_eager = torch.get_rng_state()
    deferred = interleaved(functools.partial(deferred_init, nn.Linear))
    materialize_module(deferred[1])
    materialize_module(deferred[0])  # the last to draw goes last, to leave the generator as eager code does
    for expected, got in zip(eager, deferred, strict=True):
        assert_bit_identical(expected, got)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


def test_a_module_that_draws_nothing_or_a_fork_in_between_keeps_the_order() -> None:
    def build(defer: bool) -> list[nn.Module]:
        make = functools.partial(deferred_init) if defer else (lambda f, *a: f(*a))
        torch.manual_seed(0)
        modules = [make(nn.Linear, 3, 3), make(nn.LayerNorm, 3)]
        with torch.random.fork_rng():
            pass
        modules.append(make(nn.Linear, 3, 3))
        return modules

    eager = build(defer=False)
    for module in reversed(deferred := build(defer=True)):
        materialize_module(module)
    for expected, got in zip(eager, deferred, strict=True):
        assert_bit_identical(expected, got)


def test_draws_that_depend_on_fake_values_from_an_explicit_generator_raise() -> None:
    generator = torch.Generator().manual_seed(0)

    class Poisson(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("counts", torch.poisson(torch.rand(4) * 5, generator=generator))

    with pytest.raises(DeferredInitError, match=r"aten.poisson.default draws from a torch.Generator"):
        deferred_init(Poisson)


def assert_generator_as_after_eager(build: Callable[[], nn.Module], later: str = "later") -> None:
    """``deferred_init(build)`` leaves the default CPU generator where eager construction does (its state, and a
    draw from it); the parameter ``later``, made after the draws under test, materialized alone, and then the
    whole module, get eager values, and the generator stays where eager code has it."""
    torch.manual_seed(0)
    eager = build()
    state_after_eager, draw_after_eager = torch.get_rng_state(), torch.rand(5)
    torch.manual_seed(0)
    deferred = deferred_init(build)
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    assert torch.equal(torch.rand(5), draw_after_eager)
    assert_same_bits(getattr(eager, later), materialize_tensor(getattr(deferred, later)), later)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    torch.manual_seed(0)
    deferred = deferred_init(build)
    materialize_module(deferred)
    assert torch.equal(torch.get_rng_state(), state_after_eager)


#: Random operations whose count of outputs depends on the values they read (draws.VALUE_DEPENDENT).
VALUE_DEPENDENT_DRAWS: dict[str, Callable[[], Tensor]] = {
    "rrelu of a construction-time constant": lambda: torch.nn.functional.rrelu(torch.arange(-5.0, 5.0), training=True),
    "rrelu of a random tensor": lambda: torch.nn.functional.rrelu(torch.randn(10), training=True),
    "rrelu in place": lambda: torch.nn.functional.rrelu(torch.randn(10), training=True, inplace=True),
    "RReLU module": lambda: nn.RReLU().train()(torch.randn(3, 4) - 0.5),
    "randint_like with a tensor high": lambda: torch.randint_like(
        torch.empty(7, dtype=torch.int64), torch.tensor(1 << 30)
    ),
    "poisson": lambda: torch.poisson(torch.rand(6) * 20),
}


class ValueDependentDraw(nn.Module):
    def __init__(self, draw: Callable[[], Tensor]) -> None:
        super().__init__()
        self.register_buffer("drawn", draw())
        self.later = nn.Parameter(torch.randn(21))


@pytest.mark.parametrize("case", VALUE_DEPENDENT_DRAWS)
def test_a_draw_whose_count_depends_on_values_leaves_the_generator_where_eager_code_does(case: str) -> None:
    assert_generator_as_after_eager(functools.partial(ValueDependentDraw, VALUE_DEPENDENT_DRAWS[case]))


#: Random operations whose result takes the layout of a tensor they read; the layout decides the kernel's path
#: (normal_ draws 16 at a time into a contiguous tensor, in pairs into any other) and so the generator's outputs.
LAID_OUT_DRAWS: dict[str, Callable[[], Tensor]] = {
    "randn_like of a transposed tensor": lambda: torch.randn_like(torch.empty(6, 5).t()),
    "randn_like of a channels_last tensor": lambda: torch.randn_like(
        torch.empty(2, 3, 4, 4).to(memory_format=torch.channels_last)
    ),
    "randn_like of a strided slice": lambda: torch.randn_like(torch.empty(40)[::2]),
    "rand_like of a transposed double tensor": lambda: torch.rand_like(torch.empty(6, 5, dtype=torch.float64).t()),
    "normal with transposed means": lambda: torch.normal(torch.zeros(6, 5).t(), 1.0),
    "randn into a transposed out=": lambda: torch.randn(5, 6, out=torch.empty(6, 5).t()),
    "log_normal_ of randn_like of a transposed tensor": lambda: torch.randn_like(torch.empty(6, 5).t()).log_normal_(),
}


class LaidOutDraw(nn.Module):
    def __init__(self, draw: Callable[[], Tensor]) -> None:
        super().__init__()
        self.register_buffer("drawn", draw())
        self.later = nn.Parameter(torch.randn(21))  # its values depend on how many outputs the draw took


@pytest.mark.parametrize("case", LAID_OUT_DRAWS)
def test_a_draw_laid_out_like_a_tensor_it_reads_leaves_the_generator_where_eager_code_does(case: str) -> None:
    assert_generator_as_after_eager(functools.partial(LaidOutDraw, LAID_OUT_DRAWS[case]))


GENERATOR_DRAWS_LAID_OUT_LIKE_WHAT_THEY_READ = {
    "randn_like of a transposed tensor": lambda generator: torch.randn_like(torch.empty(6, 5).t(), generator=generator),
    "normal with transposed means": lambda generator: torch.normal(torch.zeros(6, 5).t(), 1.0, generator=generator),
}


@pytest.mark.parametrize("draw", GENERATOR_DRAWS_LAID_OUT_LIKE_WHAT_THEY_READ)
def test_a_torch_generator_passed_to_a_draw_laid_out_like_a_tensor_it_reads_ends_where_eager_code_leaves_it(
    draw: str,
) -> None:
    if draw.startswith("randn_like") and "generator" not in torch.ops.aten.randn_like.overloads():
        pytest.skip(f"torch {torch.__version__} has no randn_like.generator")
    made = GENERATOR_DRAWS_LAID_OUT_LIKE_WHAT_THEY_READ[draw]

    def build(generator: torch.Generator) -> nn.Module:
        return LaidOutDraw(lambda: made(generator))

    generator = torch.Generator().manual_seed(5)
    torch.manual_seed(0)
    eager = build(generator)
    after_eager = generator.get_state()
    generator.manual_seed(5)
    torch.manual_seed(0)
    deferred = deferred_init(build, generator)
    assert torch.equal(generator.get_state(), after_eager)  # advanced while recording, on stand-ins of its layout
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


class BranchesOnADraw(nn.Module):
    """Fails while recording: an ``if`` on a random tensor, after draws (and a reseed, with ``reseed``)."""

    def __init__(self, reseed: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        if reseed:
            torch.manual_seed(123)
        self.second = nn.Parameter(torch.randn(40))
        if self.second.sum() > 0:
            self.second.data.mul_(2)


@pytest.mark.parametrize("reseed", [False, True], ids=["draws", "draws and a reseed"])
def test_a_failed_deferred_init_leaves_the_generator_as_it_found_it(reseed: bool) -> None:
    torch.manual_seed(0)
    fallback_eager = nn.Linear(8, 8)
    state_after_fallback = torch.get_rng_state()
    torch.manual_seed(0)
    with pytest.raises(DeferredInitError, match="needs the values"):
        deferred_init(BranchesOnADraw, reseed)
    fallback = nn.Linear(8, 8)  # what code falling back to eager construction builds
    assert_bit_identical(fallback_eager, fallback)
    assert torch.equal(torch.get_rng_state(), state_after_fallback)


def test_a_failed_deferred_init_after_another_one_leaves_the_generator_where_the_first_left_it() -> None:
    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    state_after_eager, draw_after_eager = torch.get_rng_state(), torch.rand(3)
    torch.manual_seed(0)
    deferred = deferred_init(nn.Linear, 4, 4)
    with pytest.raises(TypeError, match="function returning a module"):
        deferred_init(lambda: torch.randn(5))  # type: ignore[arg-type, return-value]
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    assert torch.equal(torch.rand(3), draw_after_eager)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


class CatchesARefusedRead(nn.Module):
    """Falls back when a value read fails: eager code never does, deferred code would take the fallback."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6))
        try:
            positive = bool((self.weight > 0).any())
        except RuntimeError:
            positive = False
        self.register_buffer("sign", torch.tensor(1.0 if positive else -1.0))


class LogsAValueItCannotRead(nn.Module):
    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        logger.info("weight norm %.3f", self.linear.weight.norm())  # logging reports the refusal and goes on


def test_a_constructor_logging_a_value_it_cannot_read_builds_and_materializes_as_eager_code() -> None:
    logger = logging.getLogger(f"{__name__}.refused")
    logger.propagate = False  # away from pytest's handlers, which raise what a record's formatting raises
    logger.addHandler(logging.StreamHandler(io.StringIO()))
    logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    eager = LogsAValueItCannotRead(logger)
    torch.manual_seed(0)
    with contextlib.redirect_stderr(io.StringIO()):  # logging prints the error it caught
        deferred = deferred_init(LogsAValueItCannotRead, logger)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


def test_a_constructor_that_catches_a_refused_read_and_goes_on_is_refused_leaving_the_generator_alone() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with pytest.raises(DeferredInitError, match="went on after deferred_init refused to read values") as raised:
        deferred_init(CatchesARefusedRead)
    assert f"{__file__}:" in str(raised.value)  # where the read was
    assert torch.equal(torch.get_rng_state(), before)


class SavesTheGenerator(nn.Module):
    """Takes ``torch.get_rng_state()`` between draws, keeps it, and puts it back later."""

    saved: list[Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(5))
        state = torch.get_rng_state()
        SavesTheGenerator.saved.append(state)
        self.second = nn.Parameter(torch.randn(21))
        torch.set_rng_state(state)
        self.again = nn.Parameter(torch.randn(21))


def test_a_generator_state_taken_while_recording_holds_the_bytes_eager_code_gets() -> None:
    SavesTheGenerator.saved = []
    torch.manual_seed(0)
    eager = SavesTheGenerator()
    state_after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = deferred_init(SavesTheGenerator)
    eager_state, deferred_state = SavesTheGenerator.saved
    assert not is_fake(deferred_state)
    assert torch.equal(deferred_state, eager_state)
    assert torch.equal(torch.get_rng_state(), state_after_eager)
    torch.set_rng_state(deferred_state)  # later, outside the record: draws what eager code draws from there
    assert torch.equal(torch.randn(21), eager.second.detach())
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


def test_a_generator_state_copied_while_recording_cannot_be_put_back() -> None:
    class CopiesState(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            state = torch.get_rng_state().clone()
            self.weight = nn.Parameter(torch.randn(2))
            torch.set_rng_state(state)

    with pytest.raises(DeferredInitError, match="set_rng_state was given a fake tensor"):
        deferred_init(CopiesState)


def test_deferred_init_cannot_be_nested() -> None:
    with pytest.raises(DeferredInitError, match="while another deferred_init records"):
        deferred_init(lambda: nn.Sequential(deferred_init(nn.Linear, 2, 2)))


def test_a_fake_tensor_from_another_mode_cannot_enter_a_record() -> None:
    with fake_mode():
        foreign = torch.ones(3)

    def build() -> nn.Module:
        layer = nn.Linear(3, 3)
        layer.register_buffer("foreign", foreign)
        return layer

    with pytest.raises(DeferredInitError, match=r"buffer 'foreign' \(Linear\).*no deferred_init recorded"):
        deferred_init(build)


def test_materializing_a_fake_tensor_nothing_recorded_raises() -> None:
    with fake_mode():
        layer = nn.Linear(2, 2)
    assert not is_deferred(layer)
    with pytest.raises(DeferredInitError, match=r"parameter 'weight' \(Linear\).*no deferred_init recorded"):
        materialize_module(layer)
    with pytest.raises(DeferredInitError, match="no deferred_init recorded"):
        materialize_tensor(layer.weight)


def test_real_tensors_handed_to_the_constructor_stay_real_and_the_rest_materializes() -> None:
    real = nn.Linear(3, 3)
    torch.manual_seed(0)
    eager = nn.Sequential(real, nn.Linear(3, 3))
    torch.manual_seed(0)
    deferred = deferred_init(lambda: nn.Sequential(real, nn.Linear(3, 3)))
    assert deferred[0].weight is real.weight
    assert not is_fake(real.weight)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)


class WritesWhatItIsGiven(nn.Module):
    """Writes in place into a real tensor it is given, in one of several ways, each on a line of its own."""

    def __init__(self, given: Tensor, how: str) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        if how == "read, then multiplied":
            self.register_buffer("before", given * 1)
        if how in ("multiplied", "read, then multiplied"):
            given.mul_(3)  # writes: multiplied
        elif how == "written through a view":
            given.view(-1)[0] = 7  # writes: written through a view
        elif how == "written as a buffer":
            self.register_buffer("b", given)
            self.b.add_(1)  # writes: written as a buffer
        elif how == "initialized as a parameter":
            self.p = nn.Parameter(given)
            nn.init.normal_(self.p)  # writes: initialized as a parameter
        elif how == "filled from a recorded tensor":
            with torch.no_grad():
                given[:2].copy_(self.linear.bias)  # writes: filled from a recorded tensor
        self.register_buffer("held", given)


# How the constructor writes, and the line that does it.
WRITES = {
    "multiplied": "multiplied",
    "read, then multiplied": "multiplied",
    "written through a view": "written through a view",
    "written as a buffer": "written as a buffer",
    "initialized as a parameter": "initialized as a parameter",
    "filled from a recorded tensor": "filled from a recorded tensor",
}


@pytest.mark.parametrize("how", WRITES)
def test_writing_into_a_real_tensor_handed_to_the_constructor_raises_at_recording_naming_it_the_op_and_line(
    how: str,
) -> None:
    # Eager construction changes the tensor handed in; fake tensors have no values to write, so the deferred module
    # could not give what eager construction gives: recording stops there, and the tensor is left as it was.
    given = torch.arange(4.0)
    with pytest.raises(DeferredInitError) as error:
        deferred_init(WritesWhatItIsGiven, given, how=how)
    message = str(error.value)
    source, first = inspect.getsourcelines(WritesWhatItIsGiven)
    line = first + next(n for n, text in enumerate(source) if text.endswith(f"# writes: {WRITES[how]}\n"))
    assert message.startswith("aten.")
    assert "deferred_init's argument 'given' ((4,), torch.float32)" in message
    assert f"in WritesWhatItIsGiven.__init__, at {__file__}:{line}" in message
    assert "given.clone()" in message  # what to do instead
    assert torch.equal(given, torch.arange(4.0))


@pytest.mark.parametrize("how", WRITES)
def test_a_copy_made_inside_the_recorded_function_as_the_error_says_materializes_the_eager_values(how: str) -> None:
    given = torch.arange(4.0)
    torch.manual_seed(0)
    eager = WritesWhatItIsGiven(given.clone(), how)
    torch.manual_seed(0)
    deferred = deferred_init(lambda: WritesWhatItIsGiven(given.clone(), how))
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert torch.equal(given, torch.arange(4.0))


class ReadsWhatItIsGiven(nn.Module):
    def __init__(self, given: Tensor) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.scaled = nn.Parameter(given * 2)
        self.register_buffer("held", given)
        self.register_buffer("copied", given.clone())
        self.copied.mul_(3)  # a copy made while recording is the record's own
        with torch.no_grad():
            self.linear.bias.copy_(given)
            self.linear.weight.add_(given)
        self.register_buffer("rows", given.view(2, 2).sum(0))


def test_a_real_tensor_handed_to_the_constructor_and_only_read_materializes_bit_identically_and_stays_unchanged() -> (
    None
):
    torch.manual_seed(0)
    eager = ReadsWhatItIsGiven(torch.arange(4.0) / 3)
    given = torch.arange(4.0) / 3
    torch.manual_seed(0)
    deferred = deferred_init(ReadsWhatItIsGiven, given)
    materialize_module(deferred)
    assert_bit_identical(eager, deferred)
    assert deferred.held is given
    assert torch.equal(given, torch.arange(4.0) / 3)


class HoldsAViewOf(nn.Module):
    def __init__(self, given: Tensor) -> None:
        super().__init__()
        self.register_buffer("table", given.view(2, 2))


def test_writing_into_a_deferred_view_of_a_real_tensor_after_deferred_init_raises_and_leaves_it_materializable() -> (
    None
):
    given = torch.arange(4.0)
    module = deferred_init(HoldsAViewOf, given)
    with pytest.raises(DeferredInitError) as error:
        module.table.add_(1)  # eager code would change `given` through it
    message = str(error.value)
    assert message.startswith("aten.add_.Tensor writes in place into a real tensor, which deferred_init did not make")
    assert "\ntensor: a view of deferred_init's argument 'given'" in message
    assert f"outside any module, at {__file__}:" in message
    materialize_module(module)
    assert torch.equal(module.table, torch.arange(4.0).view(2, 2))
    assert torch.equal(given, torch.arange(4.0))


def test_storages_and_sparse_tensors_raise_naming_the_op() -> None:
    class SetsStorage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            source = torch.randn(4)
            self.register_buffer("alias", torch.empty(0).set_(source.untyped_storage()))

    class Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("sparse", torch.randn(3, 3).to_sparse())

    with pytest.raises(
        DeferredInitError,
        match=r"^aten\.set_\.source_Storage was given a UntypedStorage, and deferred_init records strided tensors "
        r"only\.\nwhere: in SetsStorage\.__init__",
    ):
        deferred_init(SetsStorage)
    with pytest.raises(
        DeferredInitError,
        match=r"made a torch\.sparse_coo tensor, and deferred_init records strided tensors only\.\n"
        r"where: in Sparse\.__init__",
    ):
        deferred_init(Sparse)


def test_replacing_data_by_a_real_tensor_after_recording_raises_at_materialization() -> None:
    deferred = deferred_init(nn.Linear, 2, 2)
    deferred.weight.data = torch.ones(2, 2)
    with pytest.raises(DeferredInitError, match=r"parameter 'weight' \(Linear\) had its data replaced by a real"):
        materialize_module(deferred)
    assert is_fake(deferred.bias)


def test_deferred_init_needs_a_function_returning_a_module() -> None:
    with pytest.raises(TypeError, match="ones returned a FakeTensor"):
        deferred_init(torch.ones, 3)  # type: ignore[arg-type]


def test_the_deferred_module_is_fake_on_the_recorded_device_and_is_deferred_says_so() -> None:
    deferred = deferred_init(nn.Linear, 2, 3)
    assert is_fake(deferred.weight)
    assert deferred.weight.device == torch.device("cpu")
    assert isinstance(deferred.weight, nn.Parameter)
    assert is_deferred(deferred)
    assert is_deferred(deferred.weight)
    assert not is_deferred(nn.Linear(2, 3))
    assert not is_deferred(torch.ones(2))


IMPORT_CHANGES_NOTHING = """
    import torch
    before = [torch.manual_seed, torch.get_rng_state, torch.set_rng_state, torch.nn.init._no_grad_trunc_normal_]
    import modattrs, modattrs.fake, modattrs.deferred
    after = [torch.manual_seed, torch.get_rng_state, torch.set_rng_state, torch.nn.init._no_grad_trunc_normal_]
    print(all(a is b for a, b in zip(before, after)))
    modattrs.deferred.deferred_init(torch.nn.Linear, 2, 2)
    print(torch.manual_seed is before[0], torch.manual_seed(0) is torch.default_generator)
    print(torch.get_rng_state is torch.random.get_rng_state, torch.set_rng_state is torch.random.set_rng_state)
"""


def test_importing_changes_nothing_in_torch_and_the_first_use_wraps_the_generator_functions() -> None:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(IMPORT_CHANGES_NOTHING)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert result.stdout.split() == ["True", "False", "True", "True", "True"]


def test_materializing_with_any_spelling_of_the_device() -> None:
    torch.manual_seed(0)
    eager = Stack()
    torch.manual_seed(0)
    assert_bit_identical(eager, materialize_module(deferred_init(Stack), device="cpu:0"))


@pytest.mark.parametrize(("device", "error"), [(True, TypeError), ("gpu", ValueError), (1.5, TypeError)])
def test_materializing_on_something_that_is_not_a_device_names_the_call_and_changes_nothing(
    device: object, error: type[Exception]
) -> None:
    deferred = deferred_init(Stack)
    with pytest.raises(error, match=r"^materialize_module: (device must be|invalid device)"):
        materialize_module(deferred, device=device)  # type: ignore[arg-type]
    assert is_deferred(deferred)


def test_a_materialized_module_lets_its_record_go() -> None:
    deferred = deferred_init(Stack)
    record = weakref.ref(deferred.layers[0].weight.fake_mode.record)
    torch.manual_seed(1)
    materialize_module(deferred)
    del deferred
    gc.collect()
    assert record() is None


def test_the_public_names_are_the_module_all() -> None:
    assert sorted(modattrs.deferred.__all__) == [
        "DeferredInitError",
        "deferred_init",
        "is_deferred",
        "materialize_module",
        "materialize_tensor",
        "register_opaque_init",
    ]
    assert issubclass(DeferredInitError, RuntimeError)


def test_materializing_a_module_holding_a_stale_alias_of_a_replaced_attribute_works() -> None:
    def build() -> nn.Module:
        module = CachedFromSubmodule()
        module.stale = module.declared  # an alias of the attribute, which is then replaced
        VirtualTensor(module, "declared", lambda owner, dtype, device: torch.ones(2, dtype=dtype, device=device))
        return module

    deferred = deferred_init(build)
    materialize_module(deferred)
    assert torch.equal(deferred.declared.value, torch.ones(2))
    with pytest.raises(ReferenceError, match="'declared' is detached"):
        deferred.stale.value
