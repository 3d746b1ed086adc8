"""Copies, pickles, saves, loads, garbage and threads: what a module goes through, with attributes of both kinds."""

from __future__ import annotations

import copy
import gc
import pickle
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import modattrs
from modattrs import ShapedTensor, VirtualTensor
from modattrs.fake import fake_mode, is_fake

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
import lifecycle_models as models  # noqa: E402


def assert_bound_to(module: models.Outer) -> None:
    owners = {
        "block.weight_sum": module.block,
        "block.ramp": module.block,
        "block.state": module.block,
        "empty.twos": module.empty,
        "twice": module,
    }
    for path, attribute in models.attributes(module).items():
        assert attribute.owner is owners[path], path  # type: ignore[attr-defined]


def assert_same_values(a: models.Outer, b: models.Outer) -> None:
    va, vb = models.values(a), models.values(b)
    for path in va:
        torch.testing.assert_close(va[path], vb[path], msg=path)


# --- copy.deepcopy ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("persist", [False, True])
def test_deepcopy_binds_every_attribute_to_the_copy(persist: bool) -> None:
    original = models.Outer(persist)
    clone = copy.deepcopy(original)
    assert_bound_to(clone)
    assert_bound_to(original)
    assert_same_values(clone, original)
    assert clone.state_dict().keys() == original.state_dict().keys()


def test_deepcopy_values_read_the_copys_state() -> None:
    original = models.Outer()
    clone = copy.deepcopy(original)
    with torch.no_grad():
        clone.block.lin.weight.add_(1.0)
    clone.block.offset = 5.0
    clone.block.state.reconstrain(0, 4)
    torch.testing.assert_close(clone.block.weight_sum.value, original.block.weight_sum.value + 3.0)
    torch.testing.assert_close(clone.block.ramp.value, torch.tensor([0.0, 5.0, 10.0]))
    assert original.block.ramp.value.tolist() == [0.0, 2.0, 4.0]
    assert original.block.state.value.shape == (2, 3)  # type: ignore[union-attr]


def test_deepcopy_follows_the_copys_conversions_only() -> None:
    original = models.Outer()
    clone = copy.deepcopy(original).double()
    assert all(v.dtype == torch.float64 for v in models.values(clone).values())
    assert all(v.dtype == torch.float32 for v in models.values(original).values())


def test_deepcopy_has_its_own_finalizer() -> None:
    original = models.Outer(persist=True)
    clone = copy.deepcopy(original)
    del clone.block.weight_sum, clone.block.state, clone.empty.twos
    assert "_weight_sum_ref" not in clone.block._buffers
    assert "_state_data" not in clone.block._buffers
    assert "_twos_ref" not in clone.empty._buffers
    assert "block._state_constraints" not in clone.state_dict()
    assert "_weight_sum_ref" in original.block._buffers
    assert "block._state_constraints" in original.state_dict()
    assert_bound_to(original)
    models.values(original)


def test_a_module_deep_copied_twice_is_bound_to_the_last_copy() -> None:
    second = copy.deepcopy(copy.deepcopy(models.Outer()))
    assert_bound_to(second)
    del second.twice
    assert "_twice_ref" not in second._buffers


def test_deleting_a_deep_copy_frees_it_and_leaves_the_original_working() -> None:
    original = models.Outer()
    clone = copy.deepcopy(original)
    alive = weakref.ref(clone)
    gc.disable()
    try:
        del clone
        assert alive() is None
    finally:
        gc.enable()
    assert_bound_to(original)
    models.values(original)


# --- copy.copy --------------------------------------------------------------------------------------------------


def test_shallow_copy_shares_the_attributes_as_it_shares_buffers_and_parameters() -> None:
    original = models.Block()
    shallow = copy.copy(original)
    assert shallow._buffers is original._buffers
    assert shallow.weight_sum is original.weight_sum
    assert shallow.weight_sum.owner is original
    torch.testing.assert_close(shallow.weight_sum.value, original.weight_sum.value)
    del shallow
    gc.collect()
    assert "_weight_sum_ref" in original._buffers


# --- pickle and torch.save ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("persist", [False, True])
def test_pickle_round_trip_rebinds_to_the_loaded_module(persist: bool) -> None:
    original = models.Outer(persist)
    loaded = pickle.loads(pickle.dumps(original))
    assert_bound_to(loaded)
    assert_same_values(loaded, original)
    loaded.half()
    assert loaded.block.weight_sum.value.dtype == torch.float16
    assert original.block.weight_sum.value.dtype == torch.float32


def test_pickling_an_attribute_whose_owner_is_gone_raises_reference_error() -> None:
    block = models.Block()
    attribute = block.weight_sum
    del block
    gc.collect()
    with pytest.raises(ReferenceError, match="'weight_sum' has no owner"):
        pickle.dumps(attribute)


def run_fresh(*parts: str) -> str:
    """Run code in a new Python process that can import lifecycle_models; return what it printed."""
    script = f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n" + "".join(textwrap.dedent(p) for p in parts)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


CHECK_LOADED = """
    import torch, lifecycle_models as models
    expected = torch.load({expected!r}, weights_only=True)
    for path, value in models.values(module).items():
        assert torch.equal(value, expected[path]), path
    assert module.block.weight_sum.owner is module.block and module.twice.owner is module
    module.double()
    assert module.block.ramp.value.dtype == torch.float64
    del module.block.weight_sum
    assert "_weight_sum_ref" not in module.block._buffers
    print("ok")
"""


@pytest.mark.parametrize("persist", [False, True])
def test_torch_save_then_load_in_a_fresh_process(persist: bool, tmp_path: Path) -> None:
    module = models.Outer(persist)
    module.block.state.reconstrain(0, 5)
    torch.save(module, tmp_path / "module.pt")
    torch.save(models.values(module), tmp_path / "expected.pt")
    out = run_fresh(
        f"""
        import torch
        module = torch.load({str(tmp_path / "module.pt")!r}, weights_only=False)
        """,
        CHECK_LOADED.format(expected=str(tmp_path / "expected.pt")),
    )
    assert out.strip() == "ok"


def test_pickle_then_load_in_a_fresh_process(tmp_path: Path) -> None:
    module = models.Outer()
    (tmp_path / "module.pkl").write_bytes(pickle.dumps(module))
    torch.save(models.values(module), tmp_path / "expected.pt")
    out = run_fresh(
        f"""
        import pickle, pathlib
        module = pickle.loads(pathlib.Path({str(tmp_path / "module.pkl")!r}).read_bytes())
        """,
        CHECK_LOADED.format(expected=str(tmp_path / "expected.pt")),
    )
    assert out.strip() == "ok"


def test_weights_only_load_works_once_safe_globals_are_allowed(tmp_path: Path) -> None:
    torch.save(models.Outer(persist=True), tmp_path / "module.pt")
    torch.save(models.values(models.Outer(persist=True)), tmp_path / "unused.pt")
    out = run_fresh(
        f"""
        import torch, modattrs, lifecycle_models as models
        from torch import nn
        path = {str(tmp_path / "module.pt")!r}
        try:
            torch.load(path)
        except Exception as error:
            print("refused:", type(error).__name__)
        torch.serialization.add_safe_globals(
            [*modattrs.safe_globals(), models.Outer, models.Block, models.ramp, models.twos, nn.Linear, nn.Sequential]
        )
        module = torch.load(path)
        assert module.block.weight_sum.owner is module.block
        print(module.block.ramp.value.tolist())
        """
    )
    assert out.splitlines() == ["refused: UnpicklingError", "[0.0, 2.0, 4.0]"]


def test_safe_globals_lists_only_modattrs_and_the_hook_wrapper() -> None:
    names = {f"{g.__module__}.{g.__qualname__}" for g in modattrs.safe_globals()}
    assert all(n.startswith(("modattrs.", "torch.nn.modules.module._WrappedHook")) for n in names)


# --- state_dict round trips ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("persist", [False, True])
def test_state_dict_round_trip_between_fresh_instances(persist: bool) -> None:
    source = models.Outer(persist)
    source.block.state.value = torch.full((4, 3), 7.0)
    target = models.Outer(persist)
    target.load_state_dict(source.state_dict())
    assert_same_values(target, source)


@pytest.mark.parametrize(("saved", "loading"), [(True, False), (False, True)])
def test_checkpoints_load_strictly_whatever_the_persistence_of_references(saved: bool, loading: bool) -> None:
    source = models.Outer(saved)
    target = models.Outer(loading)
    result = target.load_state_dict(source.state_dict(), strict=True)
    assert not result.missing_keys
    assert not result.unexpected_keys
    assert_same_values(target, source)


class Before(nn.Module):
    """A model as it was before it gained a VirtualTensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)


class After(Before):
    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "scale", lambda m, dtype, device: m.lin.weight.detach().abs().sum(), persist=True)


def test_a_checkpoint_from_before_the_attribute_existed_loads_strictly() -> None:
    old = Before()
    new = After()
    new.load_state_dict(old.state_dict(), strict=True)
    assert torch.equal(new.lin.weight, old.lin.weight)
    torch.testing.assert_close(new.scale.value, old.lin.weight.abs().sum())
    assert "_scale_ref" in new.state_dict()


def test_a_checkpoint_with_a_reference_loads_into_a_model_without_the_attribute_only_non_strictly() -> None:
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "_scale_ref"'):
        Before().load_state_dict(After().state_dict(), strict=True)
    result = Before().load_state_dict(After().state_dict(), strict=False)
    assert result.unexpected_keys == ["_scale_ref"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda sd: sd.pop("block.lin.weight"), r'Missing key\(s\) in state_dict: "block.lin.weight"'),
        (lambda sd: sd.pop("block._state_data"), r'Missing key\(s\) in state_dict: "block._state_data"'),
        (lambda sd: sd.__setitem__("block.typo", torch.ones(1)), r'Unexpected key\(s\) in state_dict: "block.typo"'),
        (lambda sd: sd.__setitem__("block._weight_sum_ref", torch.ones(3)), "block._weight_sum_ref: .* 3 elements"),
    ],
)
def test_loads_that_must_still_fail(edit: object, match: str) -> None:
    state = models.Outer(persist=True).state_dict()
    edit(state)  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=match):
        models.Outer(persist=True).load_state_dict(state, strict=True)


def test_assign_load_into_a_meta_model_moves_references_of_owners_with_parameters() -> None:
    source = models.Outer().to(torch.bfloat16)
    with torch.device("meta"):
        target = models.Outer()
    target.load_state_dict(source.state_dict(), assign=True)
    for owner, name in [(target.block, "_weight_sum_ref"), (target.block, "_ramp_ref"), (target, "_twice_ref")]:
        ref = owner._buffers[name]
        assert (ref.device, ref.dtype) == (torch.device("cpu"), torch.bfloat16), name
    # `empty` holds no tensor, so its reference cannot know where the data went: sync_references says.
    assert target.empty.twos.device == torch.device("meta")
    modattrs.sync_references(target)
    assert (target.empty.twos.device, target.empty.twos.dtype) == (torch.device("cpu"), torch.bfloat16)
    assert_same_values(target, source)


def test_assign_load_into_a_fake_model_makes_its_references_real() -> None:
    source = models.Outer().to(torch.bfloat16)
    with fake_mode():
        target = models.Outer()
    target.load_state_dict(source.state_dict(), assign=True)
    for owner, name in [(target.block, "_weight_sum_ref"), (target.block, "_ramp_ref"), (target, "_twice_ref")]:
        ref = owner._buffers[name]
        assert not is_fake(ref), name
        assert (ref.device, ref.dtype) == (torch.device("cpu"), torch.bfloat16), name
    assert is_fake(target.empty._buffers["_twos_ref"])  # no tensor of its own to follow: sync_references does it
    modattrs.sync_references(target)
    assert not is_fake(target.empty.twos.value)
    assert (target.empty.twos.device, target.empty.twos.dtype) == (torch.device("cpu"), torch.bfloat16)
    assert_same_values(target, source)


def test_sync_references_leaves_the_fake_references_of_a_fake_model_alone() -> None:
    with fake_mode():
        module = models.Outer()
    modattrs.sync_references(module)
    assert all(is_fake(ref) for name, ref in module.named_buffers() if name.endswith("_ref"))


def test_sync_references_after_loading_one_block_of_a_fake_model_leaves_the_others_fake() -> None:
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = nn.ModuleDict({"loaded": models.Outer(), "pending": models.Outer()})
    model["loaded"].load_state_dict(models.Outer().state_dict(), assign=True)
    modattrs.sync_references(model)
    for name, ref in model.named_buffers():
        if name.endswith("_ref"):
            assert is_fake(ref) is name.startswith("pending."), name
            assert ref.device == torch.device("cuda:0" if name.startswith("pending.") else "cpu"), name


def test_sync_references_takes_an_explicit_device_and_dtype() -> None:
    with torch.device("meta"):
        module = models.Outer()
    modattrs.sync_references(module, device="cpu", dtype=torch.float64)
    assert module.empty.twos.value.dtype == torch.float64
    assert module.empty.twos.value.device == torch.device("cpu")


def test_sync_references_without_any_data_asks_for_a_device() -> None:
    with torch.device("meta"):
        module = models.Outer()
    with pytest.raises(ValueError, match="pass device="):
        modattrs.sync_references(module)
    assert module.empty.twos.device == torch.device("meta")


def test_sync_references_with_a_dtype_modules_cannot_follow_moves_nothing() -> None:
    with torch.device("meta"):
        module = models.Outer()
    with pytest.raises(ValueError, match=r"must be floating-point or complex, got torch\.int64"):
        modattrs.sync_references(module, device="cpu", dtype=torch.int64)
    assert all(ref.is_meta for name, ref in module.named_buffers() if name.endswith("_ref"))


def test_sync_references_leaves_real_references_alone() -> None:
    module = models.Outer().double()
    modattrs.sync_references(module, device="meta", dtype=torch.float16)
    assert module.block.weight_sum.dtype == torch.float64
    assert module.block.weight_sum.device == torch.device("cpu")


def test_assign_load_keeps_a_fixed_dtype_and_moves_only_the_device() -> None:
    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            VirtualTensor(
                self,
                "table",
                lambda m, dtype, device: torch.ones(2, dtype=dtype, device=device),
                dtype=torch.float32,
                follow_dtype=False,
            )

    source = Fixed().to(torch.bfloat16)
    with torch.device("meta"):
        target = Fixed()
    target.load_state_dict(source.state_dict(), assign=True)
    assert target.table.value.device == torch.device("cpu")
    assert target.table.value.dtype == torch.float32


def test_assign_load_of_an_integer_persisted_reference_is_made_floating_again() -> None:
    source = models.Outer(persist=True)
    state = source.state_dict()
    state["block._weight_sum_ref"] = torch.empty(0, dtype=torch.int64)
    target = models.Outer(persist=True)
    target.load_state_dict(state, assign=True)
    assert target.block.weight_sum.dtype == torch.float32


# --- torch.func.functional_call -----------------------------------------------------------------------------------


class Probe(nn.Module):
    """Returns a virtual value from forward, so that functional_call can run it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = models.Block()

    def forward(self) -> torch.Tensor:
        return self.block.weight_sum.value


def test_functional_call_materializers_see_the_substituted_parameters() -> None:
    probe = Probe()
    out = torch.func.functional_call(probe, {"block.lin.weight": torch.ones(3, 3)}, ())
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    assert not torch.equal(probe(), out)


def test_functional_call_with_strict_needs_the_reference_buffers_too() -> None:
    probe = Probe()
    tensors = dict(probe.named_parameters())
    with pytest.raises(RuntimeError, match=r"block\._weight_sum_ref"):
        torch.func.functional_call(probe, tensors, (), strict=True)
    tensors.update(probe.named_buffers())
    torch.testing.assert_close(torch.func.functional_call(probe, tensors, (), strict=True), probe())


# --- garbage ------------------------------------------------------------------------------------------------------


def test_ten_thousand_modules_are_freed_without_the_garbage_collector() -> None:
    gc.collect()
    registry_before = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    alive: list[weakref.ref[nn.Module]] = []
    gc.disable()
    try:
        for _ in range(10_000):
            module = nn.Module()
            module.lin = nn.Linear(1, 1)
            VirtualTensor(module, "twos", models.twos)
            ShapedTensor(module, "state", torch.zeros(1, 1), {1: 1}, persist_constraints=True)
            alive.append(weakref.ref(module))
            del module
        assert not any(ref() is not None for ref in alive)
        assert len(weakref.finalize._registry) == registry_before  # type: ignore[attr-defined]
    finally:
        gc.enable()


def test_deleting_attributes_removes_everything_they_registered() -> None:
    module = nn.Module()
    before = (
        dict(module._buffers),
        dict(module._state_dict_hooks),
        dict(module._load_state_dict_pre_hooks),
        dict(module._load_state_dict_post_hooks),
        set(module._non_persistent_buffers_set),
    )
    VirtualTensor(module, "twos", models.twos)
    ShapedTensor(module, "state", torch.zeros(1, 1), {1: 1}, persist_data=False, persist_constraints=True)
    del module.twos, module.state
    after = (
        dict(module._buffers),
        dict(module._state_dict_hooks),
        dict(module._load_state_dict_pre_hooks),
        dict(module._load_state_dict_post_hooks),
        set(module._non_persistent_buffers_set),
    )
    assert after == before


# --- threads ------------------------------------------------------------------------------------------------------


def test_eight_threads_reading_values_concurrently_get_correct_values() -> None:
    module = models.Outer()
    expected = models.values(module)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def read() -> None:
        try:
            start.wait()
            for _ in range(200):
                for path, value in models.values(module).items():
                    assert torch.equal(value, expected[path]), path
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert not any(thread.is_alive() for thread in threads)
