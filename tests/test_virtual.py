from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import modattrs
from modattrs import VirtualTensor

# Every test here runs with the compiled reader of .value and with the Python one.
pytestmark = pytest.mark.usefixtures("value_reader")


class Positions(nn.Module):
    """A module whose ``pos`` is derived from ``scale`` through a method materializer."""

    def __init__(self, n: int = 4, **kwargs: object) -> None:
        super().__init__()
        self.n = n
        self.scale = nn.Parameter(torch.tensor(2.0))
        VirtualTensor(self, "pos", "make_pos", **kwargs)  # type: ignore[arg-type]

    def make_pos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        positions = torch.arange(self.n, device=device) * self.scale.detach().to(device)
        return positions.to(dtype)


def doubled(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.full((2,), 2.0, dtype=dtype, device=device)


@pytest.fixture
def default_float64() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# --- construction -----------------------------------------------------------------------------------------------


def test_constructor_binds_the_attribute_and_registers_a_zero_element_reference() -> None:
    m = Positions()
    assert isinstance(m.pos, VirtualTensor)
    assert m.pos.owner is m
    assert m.pos.name == "pos"
    assert m.pos.attributes == VirtualTensor.LinkedAttributes(ref="_pos_ref")
    assert m._buffers["_pos_ref"].numel() == 0
    torch.testing.assert_close(m.pos.value, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_create_returns_the_new_attribute() -> None:
    m = nn.Module()
    vt = VirtualTensor.create(m, "twos", doubled)
    assert vt is m.twos
    torch.testing.assert_close(m.twos.value, torch.tensor([2.0, 2.0]))


def test_assigning_the_constructed_attribute_is_equivalent() -> None:
    m = nn.Module()
    m.twos = VirtualTensor(m, "twos", doubled)
    assert m.twos.owner is m
    assert list(m._buffers) == ["_twos_ref"]


def test_callable_materializer_receives_the_owner() -> None:
    seen: list[nn.Module] = []

    def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
        seen.append(module)
        return torch.zeros(1, dtype=dtype, device=device)

    m = nn.Module()
    VirtualTensor(m, "z", materialize)
    m.z.value
    assert seen == [m]


def test_reference_dtype_and_device_default_to_torch_defaults(default_float64: None) -> None:
    m = Positions()
    assert m.pos.dtype == torch.float64
    with torch.device("meta"):
        meta = Positions()
    assert meta.pos.device == torch.device("meta")
    assert meta.pos.value.device == torch.device("meta")


def test_explicit_dtype_and_device_are_used() -> None:
    m = Positions(dtype=torch.float16, device="cpu")
    assert m.pos.dtype == torch.float16
    assert m.pos.value.dtype == torch.float16
    assert m.pos.device == torch.device("cpu")


# --- value ------------------------------------------------------------------------------------------------------


def test_value_is_recomputed_from_the_current_state() -> None:
    m = Positions()
    with torch.no_grad():
        m.scale.fill_(1.0)
    torch.testing.assert_close(m.pos.value, torch.tensor([0.0, 1.0, 2.0, 3.0]))


def test_value_is_cast_when_the_materializer_ignores_dtype() -> None:
    m = nn.Module()
    VirtualTensor(m, "x", lambda mod, dtype, device: torch.ones(2, dtype=torch.int64), dtype=torch.float16)
    assert m.x.value.dtype == torch.float16


def test_value_is_not_copied_when_dtype_and_device_already_match() -> None:
    stored = torch.ones(3)
    m = nn.Module()
    VirtualTensor(m, "x", lambda mod, dtype, device: stored)
    assert m.x.value is stored


RESULTS: dict[str, Callable[[torch.dtype, torch.device], Tensor]] = {
    "as asked": lambda dtype, device: torch.ones(2, dtype=dtype, device=device),
    "another dtype": lambda dtype, device: torch.ones(2, dtype=torch.int64, device=device),
    "on the cpu": lambda dtype, device: torch.ones(2, dtype=dtype),
    "another dtype, on the cpu": lambda dtype, device: torch.ones(2, dtype=torch.int64),
    "a parameter": lambda dtype, device: nn.Parameter(torch.ones(2, dtype=dtype, device=device)),
}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("result", sorted(RESULTS))
def test_every_read_converts_the_result_to_the_attribute_dtype_and_device(device: str, result: str) -> None:
    make = RESULTS[result]
    m = nn.Module()
    VirtualTensor(m, "v", lambda module, dtype, device: make(dtype, device), dtype=torch.float16, device=device)
    for _ in range(3):  # the first read takes the slow path, the next ones the hot path
        value = m.v.value
        assert (value.dtype, value.device) == (torch.float16, torch.device(device))
    m.to(torch.float64)
    value = m.v.value
    assert (value.dtype, value.device) == (torch.float64, torch.device(device))


def test_materializer_returning_a_non_tensor_raises_type_error_naming_both() -> None:
    def bad(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
        return [1, 2]  # type: ignore[return-value]

    m = nn.Module()
    VirtualTensor(m, "x", bad)
    with pytest.raises(TypeError, match=r"^the materializer of VirtualTensor 'x' returned list, expected a Tensor\n"):
        m.x.value
    with pytest.raises(TypeError, match=r"\nmaterializer: tests\.test_virtual\..*\.bad$"):
        m.x.value


def test_reading_value_after_the_owner_is_gone_raises_reference_error() -> None:
    m = Positions()
    vt = m.pos
    del m
    gc.collect()
    assert vt.owner is None
    with pytest.raises(ReferenceError, match="'pos' has no owner"):
        vt.value


def test_reading_value_after_the_reference_was_removed_raises_runtime_error() -> None:
    m = Positions()
    del m._buffers["_pos_ref"]
    with pytest.raises(RuntimeError, match="lost its reference buffer '_pos_ref'"):
        m.pos.value


# --- dtype, device, to -----------------------------------------------------------------------------------------


def test_dtype_and_device_setters_move_the_reference() -> None:
    m = Positions()
    m.pos.dtype = torch.float64
    assert m._buffers["_pos_ref"].dtype == torch.float64
    m.pos.device = "meta"
    assert m.pos.value.device == torch.device("meta")


def test_to_accepts_tensor_to_arguments_and_returns_self() -> None:
    m = Positions()
    assert m.pos.to(torch.float64) is m.pos
    assert m.pos.dtype == torch.float64
    m.pos.to("cpu", torch.float16)
    assert m.pos.dtype == torch.float16
    m.pos.to(torch.zeros(1, dtype=torch.bfloat16))
    assert m.pos.value.dtype == torch.bfloat16
    m.pos.to(device="meta", dtype=torch.float32)
    assert (m.pos.device, m.pos.dtype) == (torch.device("meta"), torch.float32)


def test_to_from_meta_to_cpu_works_because_the_reference_has_no_data() -> None:
    with torch.device("meta"):
        m = nn.Module()
        VirtualTensor(m, "twos", doubled)
    m.twos.to("cpu")
    torch.testing.assert_close(m.twos.value, torch.full((2,), 2.0))


def test_to_with_invalid_arguments_raises_and_changes_nothing() -> None:
    m = Positions()
    ref = m._buffers["_pos_ref"]
    with pytest.raises(RuntimeError, match="'pos': invalid arguments"):
        m.pos.to("not-a-device")
    with pytest.raises(TypeError, match="'pos': invalid arguments"):
        m.pos.to("cpu", "float32")
    assert m._buffers["_pos_ref"] is ref


def test_a_following_attribute_rejects_a_non_floating_dtype() -> None:
    m = Positions()
    with pytest.raises(ValueError, match=r"'pos' follows the module's dtype.*torch\.int64"):
        m.pos.to(torch.int64)
    assert m.pos.dtype == torch.float32


@pytest.mark.parametrize("bad", ["float32", 3, None])
def test_dtype_setter_rejects_non_dtypes(bad: object) -> None:
    m = Positions()
    with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
        m.pos.dtype = bad  # type: ignore[assignment]


# --- following the module ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.to(torch.float64), torch.float64),
        (lambda m: m.half(), torch.float16),
        (lambda m: m.double(), torch.float64),
        (lambda m: m.bfloat16(), torch.bfloat16),
        (lambda m: m.double().float(), torch.float32),
        (lambda m: m.type(torch.float64), torch.float64),
        (lambda m: m.to(dtype=torch.float16), torch.float16),
    ],
)
def test_value_follows_module_dtype_conversions(convert: object, dtype: torch.dtype) -> None:
    m = Positions()
    convert(m)  # type: ignore[operator]
    assert m.pos.value.dtype == dtype
    assert m.pos.value.dtype == m.scale.dtype


def test_value_follows_nested_submodules() -> None:
    outer = nn.Sequential(nn.Sequential(Positions()))
    outer.to(torch.float64)
    assert outer[0][0].pos.value.dtype == torch.float64


def test_meta_initialization_then_to_empty_gives_correct_values() -> None:
    with torch.device("meta"):
        m = Positions()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.scale.fill_(2.0)
    torch.testing.assert_close(m.pos.value, torch.tensor([0.0, 2.0, 4.0, 6.0]))


def test_module_to_meta_moves_the_value_to_meta() -> None:
    m = Positions().to("meta")
    assert m.pos.value.device == torch.device("meta")


# --- fixed dtype, integer, bool and complex ---------------------------------------------------------------------


def test_follow_dtype_false_keeps_the_dtype_and_follows_the_device() -> None:
    m = Positions(dtype=torch.float32, follow_dtype=False)
    m.to(torch.bfloat16)
    assert m.scale.dtype == torch.bfloat16
    assert m.pos.value.dtype == torch.float32
    m.to("meta")
    assert m.pos.value.device == torch.device("meta")
    assert m.pos.value.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_integer_and_bool_attributes_keep_their_dtype_through_conversions(dtype: torch.dtype) -> None:
    m = Positions(dtype=dtype)
    assert not m.pos.follow_dtype
    m.half()
    m.to(torch.float64)
    assert m.pos.value.dtype == dtype
    assert m._buffers["_pos_ref"].is_floating_point()


def test_complex_attributes_keep_their_dtype_by_default() -> None:
    m = Positions(dtype=torch.complex64)
    m.to(torch.float16)
    assert m.pos.value.dtype == torch.complex64


def test_complex_attributes_can_follow_the_module() -> None:
    m = Positions(dtype=torch.complex64, follow_dtype=True)
    with pytest.warns(UserWarning, match="Complex modules"):
        m.to(torch.complex128)
    assert m.pos.value.dtype == torch.complex128


def test_follow_dtype_true_with_an_integer_dtype_raises_value_error() -> None:
    m = nn.Module()
    with pytest.raises(ValueError, match=r"torch\.int64 value cannot follow"):
        VirtualTensor(m, "x", doubled, dtype=torch.int64, follow_dtype=True)
    assert not hasattr(m, "x")
    assert list(m._buffers) == []


def test_fixed_dtype_can_be_changed_with_to_and_setter() -> None:
    m = Positions(dtype=torch.int64)
    m.pos.to(torch.int32)
    assert m.pos.value.dtype == torch.int32
    m.pos.dtype = torch.bool
    assert m.pos.value.dtype == torch.bool


def test_follow_dtype_can_be_toggled() -> None:
    m = Positions()
    m.pos.follow_dtype = False
    m.half()
    assert m.pos.dtype == torch.float32
    m.pos.follow_dtype = True
    m.double()
    assert m.pos.dtype == torch.float64


def test_turning_on_follow_dtype_for_an_integer_value_raises() -> None:
    m = Positions(dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot follow"):
        m.pos.follow_dtype = True
    assert m.pos.dtype == torch.int64


# --- persistence ------------------------------------------------------------------------------------------------


def test_reference_is_not_in_the_state_dict_by_default() -> None:
    m = Positions()
    assert "_pos_ref" not in m.state_dict()
    assert not m.pos.persist


def test_persist_puts_the_reference_in_the_state_dict() -> None:
    m = Positions(persist=True)
    assert "_pos_ref" in m.state_dict()


def test_persistence_can_be_toggled_and_the_state_dict_follows_at_once() -> None:
    m = Positions()
    m.pos.persist = True
    assert m.pos.persist
    assert "_pos_ref" in m.state_dict()
    m.pos.persist = False
    assert "_pos_ref" not in m.state_dict()
    m.to(torch.float64)
    assert "_pos_ref" not in m.state_dict()


def test_persisted_reference_round_trips_through_a_state_dict() -> None:
    source = Positions(persist=True)
    target = Positions(persist=True)
    target.load_state_dict(source.state_dict())
    torch.testing.assert_close(target.pos.value, source.pos.value)


# --- cleanup ----------------------------------------------------------------------------------------------------


def test_deleting_the_attribute_removes_its_reference() -> None:
    m = Positions()
    del m.pos
    assert "_pos_ref" not in m._buffers
    assert not hasattr(m, "pos")


def test_assigning_something_else_removes_the_reference() -> None:
    m = Positions(persist=True)
    m.pos = 3  # type: ignore[assignment]
    assert "_pos_ref" not in m._buffers
    assert "_pos_ref" not in m.state_dict()


def test_assigning_a_tensor_over_the_attribute_removes_the_reference() -> None:
    m = Positions()
    m.pos = torch.zeros(2)  # type: ignore[assignment]
    assert "_pos_ref" not in m._buffers
    assert torch.equal(m.pos, torch.zeros(2))  # type: ignore[arg-type]


def test_an_attribute_kept_alive_elsewhere_keeps_its_reference_until_it_dies() -> None:
    m = Positions()
    kept = m.pos
    del m.pos
    assert "_pos_ref" in m._buffers
    torch.testing.assert_close(kept.value, torch.tensor([0.0, 2.0, 4.0, 6.0]))
    del kept
    assert "_pos_ref" not in m._buffers


def test_recreating_an_attribute_of_the_same_name_keeps_the_new_reference() -> None:
    m = Positions()
    old = m.pos
    new = VirtualTensor(m, "pos", doubled, dtype=torch.float64)
    assert m.pos is new
    del old
    gc.collect()
    assert m._buffers["_pos_ref"].dtype == torch.float64
    torch.testing.assert_close(m.pos.value, torch.full((2,), 2.0, dtype=torch.float64))


def test_replacing_by_assignment_keeps_the_new_reference() -> None:
    m = Positions()
    m.pos = VirtualTensor(m, "pos", doubled, persist=True)
    assert "_pos_ref" in m.state_dict()
    torch.testing.assert_close(m.pos.value, torch.full((2,), 2.0))


def test_owners_that_define_len_are_cleaned_up() -> None:
    owner = nn.Sequential()
    assert len(owner) == 0
    VirtualTensor(owner, "twos", doubled)
    del owner.twos
    assert "_twos_ref" not in owner._buffers


def test_deleting_the_owner_frees_it_by_reference_counting() -> None:
    gc.collect()
    gc.disable()
    try:
        m = Positions()
        VirtualTensor(m, "twos", doubled)
        alive = weakref.ref(m)
        del m
        assert alive() is None
    finally:
        gc.enable()


def test_finalizers_do_not_accumulate() -> None:
    gc.collect()
    before = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    for _ in range(200):
        Positions()
    assert len(weakref.finalize._registry) == before  # type: ignore[attr-defined]


# --- bad input leaves the module as it was ------------------------------------------------------------------------


def snapshot(m: nn.Module) -> tuple[object, ...]:
    return (
        dict(m.__dict__),
        dict(m._buffers),
        dict(m._parameters),
        dict(m._modules),
        set(m._non_persistent_buffers_set),
        dict(m._state_dict_hooks),
        dict(m._load_state_dict_pre_hooks),
    )


class Occupied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.register_buffer("buf", torch.zeros(1))
        self.plain = 3
        self.register_buffer("_taken_ref", torch.zeros(1))

    def method(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.zeros(1, dtype=dtype, device=device)

    @staticmethod
    def static(dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.zeros(1, dtype=dtype, device=device)


def test_moving_an_attribute_with_dtype_from_keeps_its_reference_dtype_whatever_that_tensor_is() -> None:
    m = Scaled()
    m.proj.weight.data = m.proj.weight.data.to(torch.float16)
    m.scale.to("meta")
    assert m._buffers["_scale_ref"].dtype == torch.float32
    m.register_buffer("positions", torch.arange(3))  # a dtype a module could not follow
    VirtualTensor(m, "counted", doubled, dtype_from="positions")
    m.counted.device = "meta"
    assert m.counted.device == torch.device("meta")
    assert m.counted.value.dtype == torch.int64


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "1x"}, ValueError, "identifier"),
        ({"name": "a.b"}, ValueError, "identifier"),
        ({"name": "class"}, ValueError, "identifier"),
        ({"name": 3}, TypeError, "must be a str"),
        ({"name": "lin"}, ValueError, "'lin' \\(a submodule\\)"),
        ({"name": "buf"}, ValueError, "'buf' \\(a buffer\\)"),
        ({"name": "plain"}, ValueError, "'plain' \\(an instance attribute of type int\\)"),
        ({"name": "forward"}, ValueError, "class attribute"),
        ({"name": "taken"}, ValueError, "'_taken_ref'.*a buffer"),
        ({"materializer": "missing"}, AttributeError, "no attribute 'missing'"),
        ({"materializer": "plain"}, TypeError, "must name a method.*got int"),
        ({"materializer": "static"}, TypeError, "must name a method.*got staticmethod"),
        ({"materializer": 42}, TypeError, "method name or a callable"),
        ({"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
        ({"device": "nowhere"}, ValueError, "invalid device 'nowhere'"),
        ({"device": 1.5}, TypeError, "device must be"),
        ({"device": "cuda"}, ValueError, "cannot use device cuda"),
    ],
)
def test_bad_input_raises_and_leaves_the_module_as_it_was(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    m = Occupied()
    before = snapshot(m)
    arguments: dict[str, object] = {"name": "fresh", "materializer": "method", **kwargs}
    with pytest.raises(error, match=match):
        VirtualTensor(m, **arguments)  # type: ignore[arg-type]
    assert snapshot(m) == before


def test_owner_that_is_not_a_module_raises_type_error() -> None:
    with pytest.raises(TypeError, match=r"needs an nn\.Module"):
        VirtualTensor(object(), "x", doubled)  # type: ignore[arg-type]


def test_a_bound_method_of_the_owner_is_rejected_with_the_fix() -> None:
    m = Occupied()
    with pytest.raises(TypeError, match="pass the bound method's name, 'method'"):
        VirtualTensor(m, "x", m.method)


def test_string_materializer_holds_no_reference_to_the_owner() -> None:
    m = Occupied()
    vt = VirtualTensor(m, "x", "method")
    assert m not in gc.get_referents(vt)
    assert all(not isinstance(r, nn.Module) for r in gc.get_referents(vt))


def test_repr_names_the_attribute_and_materializer() -> None:
    m = Positions()
    assert repr(m.pos) == "VirtualTensor(name='pos', materializer='make_pos', owner=Positions)"


def test_to_accepts_copy_and_non_blocking() -> None:
    m = Positions()
    m.pos.to(torch.float64, copy=True, non_blocking=True)
    assert m.pos.dtype == torch.float64


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_moving_to_an_unavailable_device_raises_value_error_and_changes_nothing() -> None:
    m = Positions()
    ref = m._buffers["_pos_ref"]
    with pytest.raises(ValueError, match="'pos': cannot use device cuda"):
        m.pos.to("cuda")
    with pytest.raises(ValueError, match="'pos': cannot use device cuda"):
        m.pos.device = "cuda"
    assert m._buffers["_pos_ref"] is ref


def test_a_replaced_virtual_tensor_is_detached() -> None:
    m = nn.Module()
    old = VirtualTensor(m, "v", doubled)
    VirtualTensor(m, "v", doubled, dtype=torch.float64)
    with pytest.raises(ReferenceError, match="'v' is detached"):
        old.to(torch.float16)
    with pytest.raises(ReferenceError, match="'v' is detached"):
        old.value
    assert m.v.dtype == torch.float64


def test_a_deleted_virtual_tensor_still_held_can_be_recreated() -> None:
    m = nn.Module()
    held = VirtualTensor(m, "v", doubled)
    del m.v
    with pytest.raises(ReferenceError, match="'v' is detached"):
        held.persist = True
    VirtualTensor(m, "v", doubled, dtype=torch.float16)
    del held
    gc.collect()
    assert m._buffers["_v_ref"].dtype == torch.float16
    assert len(m._state_dict_hooks) == 1


# --- dtype_from -----------------------------------------------------------------------------------------------------


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2)
        VirtualTensor(self, "scale", doubled, dtype_from="proj.weight")


def test_dtype_from_takes_the_dtype_of_an_owners_tensor_at_each_read() -> None:
    m = Scaled()
    assert m.scale.value.dtype == torch.float32
    m.proj.weight.data = m.proj.weight.data.to(torch.bfloat16)  # what FSDP mixed precision does in forward
    assert m.scale.value.dtype == torch.bfloat16
    assert m.scale.dtype == torch.bfloat16
    assert m.scale.dtype_from == "proj.weight"
    assert not m.scale.follow_dtype


def test_dtype_from_follows_the_device_of_the_reference() -> None:
    m = Scaled().to("meta")
    assert m.scale.value.device == torch.device("meta")


def test_an_attribute_with_dtype_from_refuses_dtype_changes_of_its_own() -> None:
    m = Scaled()
    for change in (lambda: m.scale.to(torch.float64), lambda: setattr(m.scale, "dtype", torch.float64)):
        with pytest.raises(ValueError, match=r"takes its dtype from 'proj\.weight'"):
            change()
    with pytest.raises(ValueError, match="takes its dtype from"):
        m.scale.follow_dtype = False
    m.scale.to("meta")  # devices still move
    assert m.scale.device == torch.device("meta")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype_from": "proj.missing"}, AttributeError, "dtype_from='proj.missing'"),
        ({"dtype_from": "proj"}, TypeError, "'proj' is a Linear, not a tensor"),
        ({"dtype_from": 3}, TypeError, "dtype_from must be a str"),
        ({"dtype_from": "proj.weight", "dtype": torch.float64}, ValueError, "do not pass dtype or follow_dtype"),
        ({"dtype_from": "proj.weight", "follow_dtype": False}, ValueError, "do not pass dtype or follow_dtype"),
    ],
)
def test_bad_dtype_from_raises_and_leaves_the_module_as_it_was(
    kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    m = nn.Module()
    m.proj = nn.Linear(2, 2)
    before = snapshot(m)
    with pytest.raises(error, match=match):
        VirtualTensor(m, "scale", doubled, **kwargs)  # type: ignore[arg-type]
    assert snapshot(m) == before


def test_dtype_from_survives_a_deep_copy() -> None:
    import copy

    clone = copy.deepcopy(Scaled())
    clone.proj.half()
    assert clone.scale.value.dtype == torch.float16


# --- names, aliases and detached attributes -------------------------------------------------------------------------


def test_a_deleted_attribute_raises_once_a_newer_attribute_took_its_name() -> None:
    m = Positions()
    held = m.pos
    del m.pos
    assert torch.equal(held.value, torch.arange(4) * 2.0)  # until then it reads its own reference
    VirtualTensor(m, "pos", doubled, dtype=torch.float64, device="meta")
    with pytest.raises(ReferenceError, match="'pos' is detached"):
        held.value
    assert m.pos.value.dtype == torch.float64


def test_a_deleted_cached_attribute_raises_once_a_newer_attribute_took_its_name() -> None:
    m = Positions(cache=True)
    held = m.pos
    held.value
    del m.pos
    VirtualTensor(m, "pos", doubled)
    with pytest.raises(ReferenceError, match="'pos' is detached"):
        held.value


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "cos", doubled)


def test_an_alias_of_another_modules_attribute_is_an_occupied_name_and_the_original_keeps_working() -> None:
    rotary, layer = Rotary(), nn.Module()
    layer.cos = rotary.cos
    before = (dict(layer.__dict__), dict(layer._buffers), dict(layer._state_dict_hooks))
    with pytest.raises(
        ValueError,
        match=r"^cannot create VirtualTensor 'cos': Module\.cos is an alias of another attribute, which is left as it "
        r"is\.\nalias of: VirtualTensor\(.*owner=Rotary\)\nDelete the alias first \(del module\.cos\)",
    ):
        VirtualTensor(layer, "cos", doubled)
    assert (dict(layer.__dict__), dict(layer._buffers), dict(layer._state_dict_hooks)) == before
    assert torch.equal(rotary.cos.value, torch.full((2,), 2.0))
    buffer = io.BytesIO()
    torch.save(rotary, buffer)
    buffer.seek(0)
    assert torch.equal(torch.load(buffer, weights_only=False).cos.value, torch.full((2,), 2.0))


def test_an_alias_on_the_same_module_is_an_occupied_name() -> None:
    m = Positions()
    m.alias = m.pos
    with pytest.raises(
        ValueError, match=r"Positions\.alias is an alias of another attribute.*\nalias of: VirtualTensor\(name='pos'"
    ):
        VirtualTensor(m, "alias", doubled)
    assert m.alias is m.pos
    assert torch.equal(m.pos.value, torch.arange(4) * 2.0)
    del m.alias
    VirtualTensor(m, "alias", doubled)  # a free name once the alias is gone
    assert torch.equal(m.pos.value, torch.arange(4) * 2.0)


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a.invalidate(),
        lambda a: setattr(a, "persist", True),
        lambda a: setattr(a, "follow_dtype", False),
        lambda a: a.to(torch.float64),
    ],
    ids=["invalidate", "persist", "follow_dtype", "to"],
)
def test_every_method_and_setter_of_a_detached_attribute_raises(change: Callable[[VirtualTensor], object]) -> None:
    m = Positions(cache=True)
    held = m.pos
    del m.pos
    with pytest.raises(ReferenceError, match="'pos' is detached"):
        change(held)


def storage_of(module: nn.Module, dtype: torch.dtype, device: torch.device) -> object:
    return torch.ones(2, dtype=dtype, device=device).untyped_storage()


def typed_storage_of(module: nn.Module, dtype: torch.dtype, device: torch.device) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        return torch.ones(2, dtype=dtype, device=device).storage()


@pytest.mark.parametrize("materializer", [storage_of, typed_storage_of], ids=["untyped", "typed"])
def test_a_materializer_result_that_is_not_a_tensor_raises_type_error(materializer: Callable[..., object]) -> None:
    m = nn.Module()
    VirtualTensor(m, "v", materializer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"returned .*Storage, expected a Tensor"):
        m.v.value


class Rebuilt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "v", "make")

    def make(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.ones(2, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "replacement",
    [staticmethod(lambda dtype, device: torch.ones(2)), classmethod(lambda cls, dtype, device: torch.ones(2))],
    ids=["staticmethod", "classmethod"],
)
def test_loading_refuses_a_materializer_name_that_construction_refuses(
    replacement: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer = io.BytesIO()
    torch.save(Rebuilt(), buffer)
    monkeypatch.setattr(Rebuilt, "make", replacement)
    with pytest.raises(TypeError, match=f"must name a method of Rebuilt, got {type(replacement).__name__}"):
        Rebuilt()
    buffer.seek(0)
    with (
        torch.serialization.safe_globals([*modattrs.safe_globals(), Rebuilt]),
        pytest.raises(TypeError, match=f"cannot rebuild VirtualTensor 'v'.*got {type(replacement).__name__}"),
    ):
        torch.load(buffer)


def test_sync_references_moves_the_modules_own_attributes_and_leaves_aliases_to_their_owners() -> None:
    with torch.device("meta"):
        outside = Rotary()
        model = nn.Sequential(nn.Linear(2, 2), Rotary())
    model[1].borrowed = outside.cos  # an alias of a module that is not part of the model
    model.to_empty(device="cpu")
    modattrs.sync_references(model)
    assert model[1].cos.device == torch.device("cpu")
    assert outside.cos.device == torch.device("meta")


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_deleted_attribute_of_a_copied_module_raises_once_a_newer_attribute_took_its_name(how: str) -> None:
    original = Positions(cache=True)
    m = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    held = m.pos
    del m.pos
    VirtualTensor(m, "pos", doubled, dtype=torch.float64)
    with pytest.raises(ReferenceError, match="'pos' is detached"):
        held.value
    assert torch.equal(original.pos.value, torch.arange(4) * 2.0)


@pytest.mark.parametrize("checkpoint_device", ["meta", "cpu"])
def test_a_checkpoint_giving_a_following_reference_an_integer_dtype_leaves_it_its_own(checkpoint_device: str) -> None:
    # The owner holds no tensor with data after a meta load, so nothing else could tell the reference a dtype:
    # it took int64 from the checkpoint, and every value was computed in int64 without an error.
    with torch.device("meta"):
        m = Positions(persist=True)
    checkpoint = {"scale": torch.tensor(2.0, device="meta"), "_pos_ref": torch.empty(0, dtype=torch.int64)}
    checkpoint["_pos_ref"] = checkpoint["_pos_ref"].to(checkpoint_device)
    m.load_state_dict(checkpoint, assign=True)
    assert m.pos.dtype == torch.float32
    assert m.pos.device == torch.device(checkpoint_device)
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.scale.fill_(0.5)
    assert torch.equal(m.pos.value, torch.tensor([0.0, 0.5, 1.0, 1.5]))
