from __future__ import annotations

import gc
import io
import sys
import threading
import time
import weakref
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from modattrs import ShapedTensor


def owner_with(value: torch.Tensor | None, constraints: dict[int, int] | None = None, **kwargs: object) -> nn.Module:
    m = nn.Module()
    ShapedTensor(m, "x", value, constraints, **kwargs)  # type: ignore[arg-type]
    return m


def snapshot(m: nn.Module) -> tuple[object, ...]:
    attribute = m.__dict__.get("x")
    constraints = attribute.constraints if isinstance(attribute, ShapedTensor) else None
    data = m._buffers.get("_x_data", m._parameters.get("_x_data"))
    return (
        dict(m.__dict__),
        dict(m._buffers),
        dict(m._parameters),
        set(m._non_persistent_buffers_set),
        dict(m._state_dict_hooks),
        dict(m._load_state_dict_pre_hooks),
        constraints,
        None if data is None else (tuple(data.shape), data.clone()),
    )


def same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    *head_a, data_a = a
    *head_b, data_b = b
    if head_a != head_b:
        return False
    if data_a is None or data_b is None:
        return data_a is data_b
    return data_a[0] == data_b[0] and torch.equal(data_a[1], data_b[1])  # type: ignore[index]


# --- construction -----------------------------------------------------------------------------------------------


def test_buffer_data_is_registered_under_the_derived_name() -> None:
    data = torch.zeros(2, 3)
    m = owner_with(data, {1: 3})
    assert isinstance(m.x, ShapedTensor)
    assert m.x.value is data
    assert m._buffers["_x_data"] is data
    assert m.x.attributes == ShapedTensor.LinkedAttributes(data="_x_data", constraints="_x_constraints")


def test_parameter_data_is_registered_as_a_parameter() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    m = owner_with(p, {1: 3})
    assert m._parameters["_x_data"] is p
    assert list(m.parameters()) == [p]


def test_create_returns_the_new_attribute() -> None:
    m = nn.Module()
    x = ShapedTensor.create(m, "x", torch.zeros(2), {0: 2})
    assert x is m.x


@pytest.mark.parametrize(("persist", "in_state_dict"), [(True, True), (False, False)])
def test_persist_data_decides_whether_the_buffer_is_saved(persist: bool, in_state_dict: bool) -> None:
    m = owner_with(torch.zeros(2), persist_data=persist)
    assert ("_x_data" in m.state_dict()) is in_state_dict
    m.x.persist_data = not persist
    assert ("_x_data" in m.state_dict()) is not in_state_dict


def test_persist_data_false_with_a_parameter_is_rejected() -> None:
    m = nn.Module()
    with pytest.raises(ValueError, match="persist_data=False cannot hold for a parameter, which is always in the"):
        ShapedTensor(m, "x", nn.Parameter(torch.zeros(2)), persist_data=False)
    assert not m._parameters


def test_constraints_returns_a_copy() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3})
    m.x.constraints[1] = 7
    assert m.x.constraints == {1: 3}


@pytest.mark.parametrize(
    ("constraints", "strict", "expected"),
    [
        ({}, True, 0),
        ({0: 1}, True, 1),
        ({2: 1}, True, 3),
        ({-1: 1}, True, 1),
        ({1: 1, -2: 1}, True, 4),
        ({1: 1, -2: 1}, False, 2),
        ({-3: 1, 0: 1}, False, 3),
        ({0: 2, -1: 3}, False, 2),  # one axis cannot be both 2 and 3: two dims at least
        ({0: 2, 1: 4, -1: 4}, False, 2),
        ({0: 2, 1: 5, -1: 4}, False, 3),
    ],
)
def test_dimensionality_is_the_least_number_of_dims(constraints: dict[int, int], strict: bool, expected: int) -> None:
    m = owner_with(None, constraints, strict=strict)
    assert m.x.dimensionality == expected


def test_strict_forbids_a_positive_and_negative_dim_naming_one_axis() -> None:
    strict = owner_with(None, {0: 2, -1: 2}, strict=True)
    loose = owner_with(None, {0: 2, -1: 2}, strict=False)
    assert not strict.x.compatible(torch.zeros(2))
    assert loose.x.compatible(torch.zeros(2))
    assert strict.x.compatible(torch.zeros(2, 2))


@pytest.mark.parametrize(
    "value",
    [
        None,
        torch.empty(0),
        torch.empty(0, dtype=torch.int64),
        nn.parameter.UninitializedBuffer(),
        nn.parameter.UninitializedParameter(),
    ],
)
def test_ignored_values_are_never_checked(value: torch.Tensor | None) -> None:
    m = owner_with(value, {0: 5, 1: 3}, live=True)
    assert m.x.ignored
    assert m.x.valid
    m.x.value = value


@pytest.mark.parametrize("value", [torch.empty(0, 3), torch.tensor(1.0)])
def test_empty_multi_dim_and_scalar_tensors_are_checked(value: torch.Tensor) -> None:
    m = owner_with(None, {1: 3})
    m.x.value = value
    assert not m.x.ignored


# --- value assignment -------------------------------------------------------------------------------------------


def test_live_assignment_of_an_incompatible_tensor_raises_and_keeps_the_data() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3}, live=True)
    before = m.x.value
    with pytest.raises(ValueError, match=r"shape \(2, 4\) violates the constraints \{dim 1: 3\}"):
        m.x.value = torch.zeros(2, 4)
    assert m.x.value is before


def test_assignment_without_live_is_not_checked() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3})
    m.x.value = torch.zeros(2, 4)
    assert not m.x.valid
    m.x.live = True
    assert m.x.live
    with pytest.raises(ValueError, match="violates"):
        m.x.value = torch.zeros(1, 4)


def test_a_plain_tensor_assigned_to_parameter_data_keeps_the_parameter() -> None:
    p = nn.Parameter(torch.zeros(2, 3))
    m = owner_with(p, {1: 3})
    m.x.value = torch.ones(5, 3)
    assert m.x.value is p
    assert torch.equal(p, torch.ones(5, 3))
    assert p.requires_grad


def test_assigning_a_parameter_over_buffer_data_makes_it_a_parameter() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3})
    p = nn.Parameter(torch.ones(2, 3))
    m.x.value = p
    assert m._parameters["_x_data"] is p
    assert "_x_data" not in m._buffers


def test_assigning_a_non_tensor_raises_type_error_naming_the_attribute() -> None:
    m = owner_with(torch.zeros(2))
    with pytest.raises(TypeError, match="ShapedTensor 'x': value must be a Tensor or None, got list"):
        m.x.value = [1, 2]  # type: ignore[assignment]


def test_strict_is_settable() -> None:
    m = owner_with(torch.zeros(2, 2), {0: 2, -1: 2}, strict=False)
    m.x.strict = True
    assert m.x.strict
    assert m.x.valid


def test_making_valid_data_invalid_by_setting_strict_raises_and_changes_nothing() -> None:
    m = owner_with(torch.zeros(2), {0: 2, -1: 2}, strict=False)
    with pytest.raises(ValueError, match=r"cannot make ShapedTensor 'x' strict: its data's shape \(2,\) violates"):
        m.x.strict = True
    assert not m.x.strict
    assert m.x.valid


# --- reconstrain ------------------------------------------------------------------------------------------------


def test_reconstrain_shrinks_keeping_the_tail() -> None:
    data = torch.arange(12.0).reshape(4, 3)
    m = owner_with(data, {0: 4, 1: 3})
    out = m.x.reconstrain(0, 2)
    assert out is m.x.value
    assert torch.equal(out, data[2:])  # type: ignore[arg-type]
    assert m.x.constraints == {0: 2, 1: 3}


def test_reconstrain_grows_padding_zeros_at_the_head() -> None:
    data = torch.arange(1.0, 7.0).reshape(2, 3)
    m = owner_with(data, {0: 2})
    out = m.x.reconstrain(0, 4)
    assert torch.equal(out, torch.cat([torch.zeros(2, 3), data]))  # type: ignore[arg-type]


def test_reconstrain_adds_a_constraint_resizing_a_free_dim() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3})
    m.x.reconstrain(0, 5)
    assert m.x.constraints == {0: 5, 1: 3}
    assert m.x.value.shape == (5, 3)  # type: ignore[union-attr]


def test_reconstrain_removes_a_constraint_with_none() -> None:
    m = owner_with(torch.ones(2, 3), {0: 2, 1: 3})
    m.x.reconstrain(0, None)
    assert m.x.constraints == {1: 3}
    m.x.live = True
    m.x.value = torch.ones(7, 3)


def test_reconstrain_keeps_parameter_identity() -> None:
    p = nn.Parameter(torch.arange(6.0).reshape(3, 2))
    m = owner_with(p, {0: 3})
    out = m.x.reconstrain(0, 1)
    assert out is p
    assert torch.equal(p.detach(), torch.tensor([[4.0, 5.0]]))
    assert p.requires_grad


def test_reconstrain_on_ignored_data_only_records_the_constraint() -> None:
    m = owner_with(None, {})
    assert m.x.reconstrain(2, 4) is None
    assert m.x.constraints == {2: 4}


def test_reconstrain_with_negative_dim_resizes_the_matching_axis() -> None:
    m = owner_with(torch.ones(2, 3), {-1: 3})
    m.x.reconstrain(-1, 5)
    assert m.x.value.shape == (2, 5)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("dim", "size", "error", "match"),
    [
        (5, None, ValueError, "dim 5 is not constrained"),
        ("0", 2, TypeError, "dim must be an int"),
        (True, 2, TypeError, "dim must be an int"),
        (0, -1, ValueError, "must be non-negative"),
        (0, 2.0, TypeError, "must be an int"),
        (4, 2, ValueError, "needs at least 6 dims"),  # non-strict: at 5 dims, dim 4 (2) and dim -1 (3) collide
        (-1, 4, ValueError, "needs at least 3 dims"),  # at 2 dims, -1 is dim 1, which must stay 3
    ],
)
def test_failed_reconstrain_changes_nothing(dim: object, size: object, error: type[Exception], match: str) -> None:
    m = owner_with(torch.ones(2, 3), {0: 2, 1: 3, -1: 3}, strict=False)
    before = snapshot(m)
    with pytest.raises(error, match=match):
        m.x.reconstrain(dim, size)  # type: ignore[arg-type]
    assert same(snapshot(m), before)


def test_reconstrain_of_already_invalid_data_raises_and_changes_nothing() -> None:
    m = owner_with(torch.ones(2, 3), {0: 2, 1: 3})
    m.x.value = torch.ones(2, 4)
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"shape \(5, 4\) violates"):
        m.x.reconstrain(0, 5)
    assert same(snapshot(m), before)


# --- resize -----------------------------------------------------------------------------------------------------


def test_resize_returns_the_same_tensor_when_the_size_is_unchanged() -> None:
    t = torch.ones(2, 3)
    assert ShapedTensor.resize(t, 1, 3) is t


def test_resize_without_preserve_tail_keeps_the_head_and_pads_at_the_end() -> None:
    t = torch.arange(4.0)
    assert torch.equal(ShapedTensor.resize(t, 0, 2, preserve_tail=False), torch.tensor([0.0, 1.0]))
    assert torch.equal(
        ShapedTensor.resize(t, 0, 6, preserve_tail=False, fill=-1), torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0, -1.0])
    )


def test_resize_does_not_modify_a_parameter_and_returns_a_plain_tensor() -> None:
    p = nn.Parameter(torch.arange(4.0))
    out = ShapedTensor.resize(p, 0, 2)
    assert type(out) is torch.Tensor
    assert not out.requires_grad
    assert p.shape == (4,)


def test_resize_rejects_out_of_range_dims() -> None:
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        ShapedTensor.resize(torch.ones(2, 2), 2, 1)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_resize_keeps_the_matching_slice_of_the_original(shape: list[int], data: st.DataObject) -> None:
    t = torch.randn(shape)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    size = data.draw(st.integers(0, 7))
    tail = data.draw(st.booleans())
    out = ShapedTensor.resize(t, dim, size, preserve_tail=tail, fill=3.0)
    old = t.shape[dim]
    kept = min(old, size)
    assert out.shape[dim] == size
    if tail:
        assert torch.equal(out.narrow(dim, size - kept, kept), t.narrow(dim, old - kept, kept))
        padding = out.narrow(dim, 0, size - kept)
    else:
        assert torch.equal(out.narrow(dim, 0, kept), t.narrow(dim, 0, kept))
        padding = out.narrow(dim, kept, size - kept)
    assert bool((padding == 3.0).all())


# --- property-based: compatible and reconstrain sequences ----------------------------------------------------------


def satisfies_by_definition(shape: tuple[int, ...], constraints: dict[int, int], strict: bool) -> bool:
    ndim = len(shape)
    for d, s in constraints.items():
        if not -ndim <= d < ndim or shape[d] != s:
            return False
    if strict:
        positive = {d for d in constraints if d >= 0}
        negative = {ndim + d for d in constraints if d < 0}
        if positive & negative or (positive and negative and max(positive) >= min(negative)):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(0, 3), max_size=5).map(tuple),
    constraints=st.dictionaries(st.integers(-5, 4), st.integers(0, 3), max_size=3),
    strict=st.booleans(),
)
def test_compatible_agrees_with_the_constraints(
    shape: tuple[int, ...], constraints: dict[int, int], strict: bool
) -> None:
    m = owner_with(None, constraints, strict=strict)
    assert m.x.compatible(torch.empty(shape)) == satisfies_by_definition(shape, constraints, strict)


@settings(max_examples=100, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple),
    steps=st.lists(st.tuples(st.integers(-4, 3), st.one_of(st.none(), st.integers(0, 5))), max_size=6),
    strict=st.booleans(),
)
def test_reconstrain_sequences_keep_data_or_change_nothing(
    shape: tuple[int, ...], steps: list[tuple[int, int | None]], strict: bool
) -> None:
    m = owner_with(torch.randn(shape), {}, strict=strict)
    for dim, size in steps:
        before = snapshot(m)
        old = m.x.value
        assert old is not None
        try:
            new = m.x.reconstrain(dim, size)
        except ValueError:
            assert same(snapshot(m), before)
            continue
        assert new is not None
        assert m.x.valid
        if old.numel() == 0 and old.dim() <= 1:  # ignored data: only the constraint changes
            assert new is old
        elif size is not None:
            assert m.x.constraints[dim] == size
            kept = min(old.shape[dim], size)
            assert torch.equal(new.narrow(dim, size - kept, kept), old.narrow(dim, old.shape[dim] - kept, kept))
        else:
            assert dim not in m.x.constraints


# --- persistence of constraints and loading -------------------------------------------------------------------------


def test_persisted_constraints_round_trip_on_a_plain_module() -> None:
    source = owner_with(torch.ones(2, 3), {1: 3}, persist_constraints=True)
    state = source.state_dict()
    assert torch.equal(state["_x_constraints"], torch.tensor([[-1, 3], [-1, -1]]))  # sizes of dims 0, 1; -1, -2
    target = owner_with(torch.zeros(2, 5), {1: 5}, persist_constraints=True)
    target.load_state_dict(state)
    assert target.x.constraints == {1: 3}
    assert torch.equal(target.x.value, torch.ones(2, 3))  # type: ignore[arg-type]


def test_loading_data_with_another_size_along_a_free_dim_takes_the_loaded_shape() -> None:
    source = owner_with(torch.arange(12.0).reshape(4, 3), {1: 3})
    target = owner_with(torch.zeros(2, 3), {1: 3})
    target.load_state_dict(source.state_dict())
    assert torch.equal(target.x.value, torch.arange(12.0).reshape(4, 3))  # type: ignore[arg-type]


def test_loading_a_free_dim_resize_into_parameter_data_keeps_the_parameter() -> None:
    source = owner_with(nn.Parameter(torch.ones(4, 3)), {1: 3})
    p = nn.Parameter(torch.zeros(2, 3))
    target = owner_with(p, {1: 3})
    target.load_state_dict(source.state_dict())
    assert target.x.value is p
    assert torch.equal(p.detach(), torch.ones(4, 3))


def test_loading_data_that_violates_the_constraints_raises_and_keeps_the_data() -> None:
    source = owner_with(torch.ones(2, 4), {})
    target = owner_with(torch.zeros(2, 3), {1: 3})
    before = snapshot(target)
    with pytest.raises(RuntimeError, match=r"ShapedTensor 'x': shape \(2, 4\) violates"):
        target.load_state_dict(source.state_dict())
    assert same(snapshot(target), before)


def test_saved_constraints_load_strictly_into_a_module_that_does_not_persist_them() -> None:
    source = owner_with(torch.ones(2, 3), {1: 3}, persist_constraints=True)
    target = owner_with(torch.zeros(2, 3), {0: 2, 1: 3})
    target.load_state_dict(source.state_dict())
    assert target.x.constraints == {0: 2, 1: 3}


def test_a_checkpoint_without_constraints_loads_strictly_into_a_persisting_module() -> None:
    source = owner_with(torch.ones(2, 3), {1: 3})
    target = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    target.load_state_dict(source.state_dict())
    assert target.x.constraints == {1: 3}


def test_invalid_saved_constraints_raise_and_change_nothing() -> None:
    source = owner_with(torch.ones(2, 3), {1: 3}, persist_constraints=True)
    state = source.state_dict()
    state["_x_constraints"] = torch.tensor([1.0, 3.0])
    target = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    with pytest.raises(RuntimeError, match="invalid constraints for x"):
        target.load_state_dict(state)
    assert target.x.constraints == {1: 3}


def test_nested_modules_save_and_load_constraints_under_their_prefix() -> None:
    source = nn.Sequential(owner_with(torch.ones(2, 3), {1: 3}, persist_constraints=True))
    assert "0._x_constraints" in source.state_dict()
    target = nn.Sequential(owner_with(torch.zeros(1, 7), {1: 7}, persist_constraints=True))
    target.load_state_dict(source.state_dict())
    assert target[0].x.constraints == {1: 3}


def test_persist_constraints_is_settable() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3})
    m.x.persist_constraints = True
    assert "_x_constraints" in m.state_dict()


# --- module conversions, meta, fake -------------------------------------------------------------------------------


def test_data_follows_module_conversions() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3})
    m.half()
    assert m.x.value.dtype == torch.float16  # type: ignore[union-attr]
    m.to("meta")
    assert m.x.value.device == torch.device("meta")  # type: ignore[union-attr]
    m.to_empty(device="cpu")
    assert m.x.value.shape == (2, 3)  # type: ignore[union-attr]


def test_reconstrain_on_the_meta_device_allocates_nothing() -> None:
    with torch.device("meta"):
        m = owner_with(torch.ones(2, 3), {1: 3})
    m.x.reconstrain(0, 10)
    assert m.x.value.device == torch.device("meta")  # type: ignore[union-attr]
    assert m.x.value.shape == (10, 3)  # type: ignore[union-attr]


def test_works_under_fake_tensor_mode_without_materializing_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        m = owner_with(torch.ones(4, 3), {1: 3})
        m.x.reconstrain(0, 1000)
        m.x.reconstrain(1, 7)
    assert isinstance(m.x.value, FakeTensor)
    assert m.x.value.shape == (1000, 7)


# --- cleanup and bad input ----------------------------------------------------------------------------------------


def test_deleting_the_attribute_removes_its_data_and_hooks() -> None:
    m = owner_with(torch.ones(2), persist_constraints=True)
    del m.x
    assert "_x_data" not in m._buffers
    assert not m._state_dict_hooks
    assert not m._load_state_dict_pre_hooks
    assert m.state_dict() == {}


def test_recreating_an_attribute_never_deletes_the_new_storage() -> None:
    m = owner_with(torch.ones(2), {0: 2})
    old = m.x
    new_data = torch.zeros(5)
    ShapedTensor.create(m, "x", new_data, {0: 5})
    del old
    gc.collect()
    assert m._buffers["_x_data"] is new_data
    assert m.x.value is new_data


def test_failed_construction_leaves_an_existing_attribute_intact() -> None:
    m = owner_with(torch.ones(2), {0: 2})
    before = snapshot(m)
    with pytest.raises(ValueError, match="violates"):
        ShapedTensor(m, "x", torch.ones(3), {0: 2})
    gc.collect()
    assert same(snapshot(m), before)
    assert m.x.value is not None


def test_owners_that_define_len_work() -> None:
    owner = nn.Sequential()
    ShapedTensor(owner, "x", torch.ones(2), {0: 2})
    assert owner.x.valid
    del owner.x
    assert "_x_data" not in owner._buffers


def test_deleting_the_owner_frees_it_by_reference_counting() -> None:
    gc.collect()
    gc.disable()
    try:
        m = owner_with(torch.ones(2), {0: 2}, persist_constraints=True)
        alive = weakref.ref(m)
        del m
        assert alive() is None
    finally:
        gc.enable()


def test_valid_is_false_once_the_owner_is_gone() -> None:
    m = owner_with(torch.ones(2), {0: 2})
    x = m.x
    del m
    gc.collect()
    assert not x.valid
    with pytest.raises(ReferenceError, match="'x' has no owner"):
        x.value


@pytest.mark.parametrize(
    ("constraints", "error", "match"),
    [
        ({"0": 2}, TypeError, "constrained dim must be an int"),
        ({0: -2}, ValueError, "must be non-negative"),
        ({0: 2.5}, TypeError, "must be an int"),
        ({True: 2}, TypeError, "constrained dim must be an int"),
        ([(0, 2)], TypeError, "must be a mapping"),
        ({0: 3}, ValueError, r"shape \(2,\) violates"),
    ],
)
def test_bad_constructor_input_raises_and_changes_nothing(
    constraints: object, error: type[Exception], match: str
) -> None:
    m = nn.Module()
    m.register_buffer("other", torch.ones(1))
    before = snapshot(m)
    with pytest.raises(error, match=match):
        ShapedTensor(m, "x", torch.ones(2), constraints)  # type: ignore[arg-type]
    assert same(snapshot(m), before)


def test_name_clash_with_derived_name_is_rejected() -> None:
    m = nn.Module()
    m.register_buffer("_x_data", torch.ones(1))
    with pytest.raises(ValueError, match=r"'_x_data'.*a buffer"):
        ShapedTensor(m, "x", torch.ones(2))


def test_value_that_is_not_a_tensor_is_rejected_at_construction() -> None:
    with pytest.raises(TypeError, match="value must be a Tensor or None, got int"):
        ShapedTensor(nn.Module(), "x", 3)  # type: ignore[arg-type]


def test_repr_shows_name_and_constraints() -> None:
    m = owner_with(torch.ones(2), {0: 2})
    assert repr(m.x) == "ShapedTensor(name='x', constraints={0: 2}, owner=Module)"


# --- loading edge cases ---------------------------------------------------------------------------------------------


def test_loading_into_non_persistent_data_leaves_the_data_alone() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3}, persist_data=False)
    result = m.load_state_dict({"_x_data": torch.full((5, 3), 7.0)}, strict=False)
    assert result.unexpected_keys == ["_x_data"]
    assert torch.equal(m.x.value, torch.ones(2, 3))  # type: ignore[arg-type]


def test_a_load_whose_copy_fails_leaves_the_data_as_it_was() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3})
    before = snapshot(m)
    with pytest.raises(RuntimeError, match="cannot load the saved data"):
        m.load_state_dict({"_x_data": torch.ones(4, 3, device="meta")})
    assert same(snapshot(m), before)


def test_invalid_saved_constraints_keep_the_data_too() -> None:
    m = owner_with(torch.ones(2, 3), {1: 3}, persist_constraints=True)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match="invalid constraints for x"):
        m.load_state_dict({"_x_data": torch.full((2, 3), 9.0), "_x_constraints": torch.tensor([[-1, -3], [-1, -1]])})
    assert same(snapshot(m), before)


def test_loaded_constraints_are_checked_against_data_that_stays() -> None:
    m = owner_with(torch.ones(2, 3), {0: 2}, persist_data=False, persist_constraints=True)
    with pytest.raises(RuntimeError, match=r"shape \(2, 3\) violates the constraints \{dim 0: 4\}"):
        m.load_state_dict({"_x_constraints": torch.tensor([[4, -1], [-1, -1]])})
    assert m.x.constraints == {0: 2}
    assert m.x.valid


@pytest.mark.parametrize(
    "placeholder", [None, nn.parameter.UninitializedBuffer()], ids=["none", "uninitialized-buffer"]
)
def test_data_loads_into_a_placeholder(placeholder: torch.Tensor | None) -> None:
    m = owner_with(placeholder, {1: 3})
    m.load_state_dict({"_x_data": torch.full((4, 3), 5.0)})
    assert torch.equal(m.x.value, torch.full((4, 3), 5.0))  # type: ignore[arg-type]
    assert "_x_data" in m._buffers


def test_data_loads_into_an_uninitialized_parameter_as_a_parameter() -> None:
    m = owner_with(nn.parameter.UninitializedParameter(), {1: 3})
    m.load_state_dict({"_x_data": torch.full((4, 3), 5.0)})
    assert isinstance(m._parameters["_x_data"], nn.Parameter)
    assert torch.equal(m.x.value.detach(), torch.full((4, 3), 5.0))  # type: ignore[union-attr]


def test_a_plain_tensor_assigned_to_an_emptied_parameter_slot_becomes_a_parameter() -> None:
    m = owner_with(nn.Parameter(torch.zeros(2, 3)), {1: 3})
    m.x.value = None
    assert m._parameters["_x_data"] is None
    m.x.value = torch.ones(2, 3)
    assert isinstance(m._parameters["_x_data"], nn.Parameter)


# --- replacement, detachment and gradients --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (torch.zeros(2, 3), nn.Parameter(torch.ones(2, 3))),
        (nn.Parameter(torch.zeros(2, 3)), torch.ones(2, 3)),
        (nn.Parameter(torch.zeros(2, 3)), None),
    ],
    ids=["buffer-to-parameter", "parameter-to-buffer", "parameter-to-none"],
)
def test_recreating_with_another_kind_of_storage_replaces_it(first: torch.Tensor, second: torch.Tensor | None) -> None:
    m = owner_with(first, {1: 3})
    ShapedTensor(m, "x", second, {1: 3})
    gc.collect()
    assert m.x.value is second
    assert (second is None) or (isinstance(second, nn.Parameter) == ("_x_data" in m._parameters))


def test_reconstraining_a_parameter_drops_its_stale_gradient() -> None:
    p = nn.Parameter(torch.ones(2, 3))
    m = owner_with(p, {0: 2})
    p.sum().backward()
    m.x.reconstrain(0, 4)
    assert p.grad is None
    (p * 2).sum().backward()
    assert p.grad is not None
    assert p.grad.shape == (4, 3)


def test_a_replaced_attribute_is_detached() -> None:
    m = owner_with(torch.zeros(3, 2), {0: 3})
    old = m.x
    ShapedTensor(m, "x", torch.zeros(5, 2), {0: 5})
    with pytest.raises(ReferenceError, match="'x' is detached"):
        old.reconstrain(0, 2)
    with pytest.raises(ReferenceError, match="'x' is detached"):
        old.value
    assert m.x.value.shape == (5, 2)  # type: ignore[union-attr]


def test_an_attribute_deleted_but_still_referenced_is_detached_and_can_be_recreated() -> None:
    m = owner_with(torch.zeros(2), {0: 2})
    old = m.x
    del m.x
    with pytest.raises(ReferenceError, match="'x' is detached"):
        old.reconstrain(0, 3)
    new_data = torch.ones(4)
    ShapedTensor(m, "x", new_data, {0: 4})
    assert list(m.state_dict()) == ["_x_data"]
    del old
    gc.collect()
    assert m.x.value is new_data
    assert len(m._state_dict_hooks) == 1


def test_a_held_shaped_tensor_replaced_by_a_virtual_tensor_and_back() -> None:
    from modattrs import VirtualTensor

    m = owner_with(torch.zeros(2), {0: 2})
    held = m.x
    VirtualTensor(m, "x", lambda o, dtype, device: torch.ones(1, dtype=dtype, device=device))
    ShapedTensor(m, "x", torch.ones(3), {0: 3})
    del held
    gc.collect()
    assert set(m._buffers) == {"_x_data"}
    assert torch.equal(m.x.value, torch.ones(3))  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    ndim=st.integers(0, 4),
    first=st.dictionaries(st.integers(-4, 3), st.integers(0, 9), max_size=4),
    second=st.dictionaries(st.integers(-4, 3), st.integers(0, 9), max_size=4),
)
def test_saved_constraints_round_trip_in_a_tensor_whose_shape_depends_only_on_the_data(
    ndim: int, first: dict[int, int], second: dict[int, int]
) -> None:
    data = torch.zeros((1,) * 4)[(0,) * (4 - ndim)] if ndim < 4 else torch.zeros(1, 1, 1, 1)
    saved = []
    for constraints in (first, second):
        m = owner_with(None, constraints, strict=False, persist_constraints=True)
        m._buffers["_x_data"] = data  # unchecked: only the saved form matters here
        saved.append(m.state_dict()["_x_constraints"])
        fresh = owner_with(None, {}, strict=False, persist_constraints=True)
        fresh.load_state_dict({"_x_constraints": saved[-1]}, strict=False)
        assert fresh.x.constraints == constraints
    if all(-d <= ndim and d < ndim for d in {**first, **second}):
        assert saved[0].shape == saved[1].shape == (2, ndim)


# --- composition with loading, threads and detached attributes ------------------------------------------------------


def test_a_meta_checkpoint_with_persisted_constraints_loads_into_a_meta_module_with_assign() -> None:
    with torch.device("meta"):
        saved = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="meta")
    with torch.device("meta"):
        m = owner_with(torch.zeros(5, 3), {1: 3}, persist_constraints=True)
    m.load_state_dict(state, assign=True)
    assert m.x.value is not None
    assert m.x.value.is_meta
    assert m.x.value.shape == (2, 3)
    assert m.x.constraints == {1: 3}  # a meta tensor has no values: the module's own constraints stay


def test_a_meta_checkpoint_still_checks_the_incoming_data_against_the_current_constraints() -> None:
    with torch.device("meta"):
        m = owner_with(torch.zeros(5, 3), {1: 3}, persist_constraints=True)
        state = {"_x_data": torch.zeros(2, 4), "_x_constraints": torch.empty(2, 2, dtype=torch.int64)}
    with pytest.raises(RuntimeError, match=r"shape \(2, 4\) violates the constraints \{dim 1: 3\}"):
        m.load_state_dict(state, assign=True)
    assert m.x.value is not None
    assert m.x.value.shape == (5, 3)


@pytest.mark.parametrize("constraints", [{2**40: 1}, {-(2**40): 1}, {64: 1}, {-65: 1}, {0: 2**63}])
def test_constraints_that_no_tensor_can_have_are_refused_at_construction(constraints: dict[int, int]) -> None:
    m = nn.Module()
    with pytest.raises(ValueError, match=r"out of range|must be at most"):
        ShapedTensor(m, "x", None, constraints)
    assert "x" not in m.__dict__
    assert not m._buffers


def test_constraints_that_no_tensor_can_have_are_refused_from_a_checkpoint_and_change_nothing() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    before = snapshot(m)
    with pytest.raises(RuntimeError, match=r"invalid constraints for x.*out of range"):
        m.load_state_dict({"_x_data": torch.ones(2, 3), "_x_constraints": {2**40: 1}})
    assert same(snapshot(m), before)
    assert m.state_dict()["_x_constraints"].shape == (2, 2)


def test_reconstraining_a_dim_out_of_range_is_refused() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3})
    with pytest.raises(ValueError, match="out of range"):
        m.x.reconstrain(2**40, 1)
    assert m.x.constraints == {1: 3}


def test_a_buffer_registered_later_under_the_constraints_key_is_never_lost() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    mine = torch.arange(4)
    m.register_buffer("_x_constraints", mine)
    namesake = r"'_x_constraints', and Module has a tensor of that name\.\n(?s:.*)Register that tensor under another"
    with pytest.raises(RuntimeError, match=namesake):
        m.state_dict()
    with pytest.raises(RuntimeError, match=namesake):
        m.load_state_dict({"_x_data": torch.zeros(2, 3), "_x_constraints": torch.arange(4) + 1})
    assert m._buffers["_x_constraints"] is mine
    m.x.persist_constraints = False  # then the key is the buffer's, saved and loaded as any other
    assert torch.equal(m.state_dict()["_x_constraints"], mine)
    m.load_state_dict({"_x_data": torch.ones(2, 3), "_x_constraints": torch.arange(4) + 1})
    assert torch.equal(m._x_constraints, torch.arange(4) + 1)
    with pytest.raises(ValueError, match="'_x_constraints', which Module already has \\(a buffer\\)"):
        ShapedTensor(m, "x", torch.zeros(1, 3), {1: 3})  # a new attribute needs the name free
    del m.x
    gc.collect()  # the attribute's finalizer removes its data, and leaves the buffer
    assert "_x_data" not in m._buffers
    assert torch.equal(m._x_constraints, torch.arange(4) + 1)


def test_a_failed_assignment_to_parameter_data_keeps_the_gradient() -> None:
    m = owner_with(nn.Parameter(torch.ones(2, 3)), {1: 3})
    parameter = m.x.value
    assert isinstance(parameter, nn.Parameter)
    parameter.sum().backward()
    grad = parameter.grad
    for bad in (torch.zeros(4, 3, device="meta"), torch.zeros(4, 3).to_sparse()):
        with pytest.raises(RuntimeError):
            m.x.value = bad
        assert parameter.grad is grad
        assert m.x.value is parameter
        assert torch.equal(parameter.detach(), torch.ones(2, 3))


def test_a_non_strict_load_without_the_attributes_key_ignores_its_current_data() -> None:
    m = nn.Module()
    m.other = nn.Linear(2, 2)
    ShapedTensor(m, "x", torch.zeros(2, 3), {1: 3})
    m.x.value = torch.zeros(2, 5)  # not live: not checked
    result = m.load_state_dict({"other.weight": torch.ones(2, 2), "other.bias": torch.ones(2)}, strict=False)
    assert result.missing_keys == ["_x_data"]
    assert torch.equal(m.other.weight.detach(), torch.ones(2, 2))


def test_a_load_that_brings_constraints_the_current_data_violates_is_refused() -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    with pytest.raises(RuntimeError, match=r"shape \(2, 3\) violates the constraints \{dim 1: 4\}"):
        m.load_state_dict({"_x_constraints": {1: 4}}, strict=False)
    assert m.x.constraints == {1: 3}


def test_threads_reconstraining_one_attribute_each_see_a_consistent_attribute() -> None:
    m = owner_with(torch.zeros(4, 3), {1: 3}, live=True)
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        start.wait()
        try:
            for size in range(1, 100):
                m.x.reconstrain(i % 2, (size * (i + 1)) % 7 + 1)
        except BaseException as error:
            errors.append(error)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch inside reconstrain, as they may under load
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert m.x.valid
    assert m.x.value.shape == (m.x.constraints[0], m.x.constraints[1])  # type: ignore[union-attr]


def test_a_reconstrain_waits_for_another_threads_reconstrain_and_neither_is_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    m = owner_with(torch.zeros(4, 3), {1: 3})
    inside, resize = threading.Event(), ShapedTensor.resize

    def slow_resize(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        if threading.current_thread().name == "first":
            inside.set()
            time.sleep(0.2)  # the second thread starts its reconstrain now
        return resize(tensor, dim, size)

    monkeypatch.setattr(ShapedTensor, "resize", staticmethod(slow_resize))
    first = threading.Thread(target=m.x.reconstrain, args=(0, 2), name="first")
    first.start()
    inside.wait()
    second = threading.Thread(target=m.x.reconstrain, args=(1, 5))
    second.start()
    first.join()
    second.join()
    assert m.x.constraints == {0: 2, 1: 5}
    assert m.x.value.shape == (2, 5)  # type: ignore[union-attr]


def test_removing_a_constraint_checks_the_remaining_ones_against_the_data() -> None:
    m = owner_with(torch.zeros(2, 3), {0: 2, -1: 3})
    m.x.value = torch.zeros(2, 4)  # not live: not checked, and now violating dim -1: 3
    before = snapshot(m)
    with pytest.raises(ValueError, match=r"shape \(2, 4\) violates the constraints \{dim -1: 3\}"):
        m.x.reconstrain(0, None)
    assert same(snapshot(m), before)


@pytest.mark.parametrize(
    "change",
    [
        lambda a: setattr(a, "live", True),
        lambda a: setattr(a, "persist_constraints", True),
        lambda a: setattr(a, "strict", False),
        lambda a: setattr(a, "persist_data", False),
        lambda a: a.reconstrain(0, 3),
        lambda a: setattr(a, "value", torch.zeros(2, 3)),
    ],
    ids=["live", "persist_constraints", "strict", "persist_data", "reconstrain", "value"],
)
def test_every_setter_and_method_of_a_detached_shaped_tensor_raises(change: Callable[[ShapedTensor], object]) -> None:
    m = owner_with(torch.zeros(2, 3), {1: 3})
    held = m.x
    del m.x
    with pytest.raises(ReferenceError, match="'x' is detached"):
        change(held)
