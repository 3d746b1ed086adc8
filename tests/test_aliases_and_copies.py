"""Attributes reached through aliases, copies of modules and of attributes, namesakes of derived names, and
modules saved in one process and changed in another: what one module does never changes another."""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor
from modattrs.fake import fake_copy, is_fake


def ones(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.ones(4, dtype=dtype, device=device)


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "cos", ones, persist=True)


class Model(nn.Module):
    """``layer`` holds an alias of ``rotary.cos`` and is registered first, so copies reach the alias first."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.rotary = Rotary()
        self.layer.cos = self.rotary.cos


@pytest.mark.parametrize("how", ["deepcopy", "fake_copy", "pickle"])
def test_a_copy_keeps_an_alias_reached_before_its_owner_one_attribute(how: str) -> None:
    model = Model()
    twin = {"deepcopy": copy.deepcopy, "fake_copy": fake_copy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how](
        model
    )
    assert twin.layer.cos is twin.rotary.cos
    assert twin.rotary.cos.owner is twin.rotary
    del twin.layer.cos  # dropping the alias in the copy changes nothing of the attribute
    gc.collect()
    assert twin.rotary.cos.value.shape == (4,)
    assert "rotary._cos_ref" in twin.state_dict()


@pytest.mark.parametrize("how", ["deepcopy", "fake_copy", "pickle"])
def test_a_copy_of_a_module_holding_only_an_alias_says_its_owner_was_copied_and_dropped(how: str) -> None:
    model = Model()
    copies = {"deepcopy": copy.deepcopy, "fake_copy": fake_copy, "pickle": lambda m: pickle.loads(pickle.dumps(m))}
    twin = copies[how](model.layer)  # holds the alias, not the module that owns the attribute
    gc.collect()
    with pytest.raises(
        ReferenceError,
        match=r"^VirtualTensor 'cos' has no owner: the module it belonged to was deleted\.\n(?s:.*)\(an alias\) copies "
        r"that owner too(?s:.*)\nKeep a reference to the module .*, and copy the module that owns them$",
    ):
        twin.cos.value


def test_a_copy_of_an_attribute_is_the_attribute() -> None:
    m = Rotary()
    duplicate = copy.copy(m.cos)
    assert duplicate is m.cos
    del duplicate
    gc.collect()
    assert torch.equal(m.cos.value, torch.ones(4))
    assert list(m.state_dict()) == ["_cos_ref"]


def test_loading_into_a_module_never_reaches_another_modules_attribute_through_an_alias() -> None:
    shared, layer = nn.Module(), nn.Module()
    ShapedTensor(shared, "state", torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    ShapedTensor(layer, "state", torch.zeros(2, 4), {1: 4}, persist_constraints=True)
    held = layer.state  # the replaced attribute stays alive
    layer.state = shared.state
    assert "_state_constraints" not in layer.state_dict()  # layer's own attribute is gone: nothing of shared's
    saved = {"_state_data": torch.zeros(5, 7), "_state_constraints": torch.tensor([[-1, 7], [-1, -1]])}
    with pytest.raises(RuntimeError, match="size mismatch for _state_data"):  # the old attribute's plain buffer
        layer.load_state_dict(saved, strict=False)
    assert shared.state.constraints == {1: 3}
    assert shared.state.value.shape == (2, 3)  # type: ignore[union-attr]
    del held


def test_an_attribute_replaced_by_an_alias_leaves_nothing_behind() -> None:
    rotary, layer = Rotary(), nn.Linear(2, 2)
    VirtualTensor(layer, "cos", ones, persist=True)
    layer.cos = rotary.cos  # the old attribute goes away
    gc.collect()
    assert "_cos_ref" not in layer._buffers
    assert "_cos_ref" not in layer.state_dict()
    del layer.cos
    VirtualTensor(layer, "cos", ones)
    assert torch.equal(rotary.cos.value, torch.ones(4))


def test_a_tensor_registered_later_under_a_reference_name_is_never_read_replaced_or_dropped() -> None:
    m = nn.Module()
    VirtualTensor(m, "x", lambda module, dtype, device: torch.full((2,), 0.5, dtype=dtype, device=device))
    mine = torch.arange(5)
    m.register_buffer("_x_ref", mine)
    with pytest.raises(
        RuntimeError,
        match=r"'_x_ref', and Module now has a tensor of 5 elements under that name\.\n"
        r"That tensor was registered or assigned after the attribute: register it under another name$",
    ):
        m.x.value
    with pytest.raises(ValueError, match="'_x_ref', which Module already has \\(a buffer\\)"):
        VirtualTensor(m, "x", ones)
    del m.x
    gc.collect()
    assert m._buffers["_x_ref"] is mine


def test_a_namesake_of_the_constraints_key_loads_like_any_tensor_and_the_data_loads_too() -> None:
    m = nn.Module()
    ShapedTensor(m, "s", torch.zeros(2, 3), {1: 3})
    m.register_buffer("_s_constraints", torch.zeros(3))
    m.load_state_dict({"_s_data": torch.ones(4, 3), "_s_constraints": torch.ones(3)})
    assert torch.equal(m.s.value, torch.ones(4, 3))  # type: ignore[arg-type]
    assert torch.equal(m._s_constraints, torch.ones(3))


def test_a_failed_load_of_data_without_values_changes_nothing() -> None:
    with torch.device("meta"):
        source = nn.Module()
        ShapedTensor(source, "s", torch.zeros(2, 3), {0: 2, 1: 3}, persist_constraints=True)
    m = nn.Module()
    ShapedTensor(m, "s", torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    with pytest.raises(RuntimeError, match="cannot load the saved data: it has no values"):
        m.load_state_dict(source.state_dict())
    assert m.s.constraints == {1: 3}


def test_materializers_invalidating_and_reading_each_other_in_two_threads_do_not_deadlock() -> None:
    started = threading.Barrier(2, timeout=10)

    def meet() -> None:  # the first two computations, one per thread, run at once
        if not started.broken and started.n_waiting < 2 and not getattr(started, "met", False):
            started.wait()
            started.met = True  # type: ignore[attr-defined]
            time.sleep(0.05)

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            VirtualTensor(self, "a", "make_a", cache=True)
            VirtualTensor(self, "b", "make_b", cache=True)

        def make_a(self, dtype: torch.dtype, device: torch.device) -> Tensor:
            meet()
            self.b.invalidate()  # b is derived from a
            return torch.ones(2, dtype=dtype, device=device)

        def make_b(self, dtype: torch.dtype, device: torch.device) -> Tensor:
            meet()
            return self.a.value * 2

    m = Pair()
    threads = [threading.Thread(target=lambda: m.a.value, daemon=True), threading.Thread(target=lambda: m.b.value)]
    threads[1].daemon = True
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads)
    assert torch.equal(m.b.value, torch.full((2,), 2.0))


def test_a_value_computed_while_its_cache_is_invalidated_is_not_kept() -> None:
    class SelfInvalidating(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0
            VirtualTensor(self, "v", "make", cache=True)

        def make(self, dtype: torch.dtype, device: torch.device) -> Tensor:
            self.calls += 1
            self.v.invalidate()  # something it read changed while it computed
            return torch.full((1,), float(self.calls), dtype=dtype, device=device)

    m = SelfInvalidating()
    assert m.v.value.item() == 1.0
    assert m.v.value.item() == 2.0  # the first was not kept


def test_swap_mode_loads_of_references_of_ever_new_dtypes_each_recompute() -> None:
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m = nn.Module()
        VirtualTensor(m, "x", ones, persist=True, cache=True)
        for dtype in (torch.float32, torch.float64, torch.float16, torch.float32, torch.bfloat16) * 3:
            m.load_state_dict({"_x_ref": torch.empty(0, dtype=dtype)}, assign=True)
            assert m.x.value.dtype == dtype
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("read_before", [False, True], ids=["unread", "read before"])
def test_a_swap_mode_load_of_a_fake_checkpoint_gives_fake_values_whatever_was_read_before(
    device: str, read_before: bool
) -> None:
    m = nn.Module()
    VirtualTensor(m, "x", ones, persist=True)
    if read_before:
        m.x.value  # the attribute has checked its plain reference: the swap puts a fake one in that object
    checkpoint = fake_copy(m, device=device).state_dict()
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.load_state_dict(checkpoint, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    value = m.x.value
    assert is_fake(value)
    assert value.device == torch.device(device if device == "cpu" else "cuda:0")


TESTS = Path(__file__).parent
SAVE = """
import sys, torch
sys.path.insert(0, {tests!r})
import lifecycle_models
torch.save(lifecycle_models.Block(persist=True), {path!r})
"""
# A fresh process numbers hooks from 0 again, as the one that saved the module did.
LOAD_AND_ADD_HOOKS = """
import gc, sys, torch
sys.path.insert(0, {tests!r})
import lifecycle_models
from modattrs import VirtualTensor
block = torch.load({path!r}, weights_only=False)
keys = set(block.state_dict())
assert "_state_constraints" in keys, keys
VirtualTensor(block, "extra", lifecycle_models.twos)
for _ in range(12):
    block.register_state_dict_post_hook(lambda *args: None)
assert set(block.state_dict()) == keys, set(block.state_dict())
del block.extra
gc.collect()
assert block.ramp.value.shape == (3,)
assert set(block.state_dict()) == keys, set(block.state_dict())
"""


def test_hooks_registered_on_a_module_loaded_from_another_process_never_replace_its_attributes_hooks(
    tmp_path: Path,
) -> None:
    arguments = {"tests": str(TESTS), "path": str(tmp_path / "block.pt")}
    for script in (SAVE, LOAD_AND_ADD_HOOKS):
        run = subprocess.run([sys.executable, "-c", script.format(**arguments)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("swap", [False, True], ids=["copy", "swap"])
def test_a_checkpoint_with_a_tensor_of_elements_under_a_reference_name_is_refused(swap: bool) -> None:
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        m = nn.Module()
        VirtualTensor(m, "x", ones, persist=True, cache=True)
        m.x.value
        with pytest.raises(RuntimeError, match=r"_x_ref: .*a tensor of 5 elements under its name"):
            m.load_state_dict({"_x_ref": torch.arange(5.0)}, assign=True)
        assert m._x_ref.numel() == 0
        assert torch.equal(m.x.value, torch.ones(4))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
