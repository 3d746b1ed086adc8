"""Construction-time constants: fake tensors made from Python numbers keep their values in fake mode and while
deferred_init records, so model code that reads them (stochastic-depth rates from linspace, widths from unique)
builds as it does eagerly; values of random draws and parameters are still refused, naming the op and the line."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from modattrs._torch_private import DataDependentOutputException, DynamicOutputShapeException
from modattrs.deferred import DeferredInitError, deferred_init, materialize_module
from modattrs.fake import fake_mode, is_fake

DEVICES = ["cpu", "cuda"]


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    with fake_mode(fake_cuda=name == "cuda"), torch.device(name):
        yield name


def test_reading_a_linspace_gives_its_values_and_the_tensor_stays_fake_on_the_device(device: str) -> None:
    rates = torch.linspace(0, 0.1, 5)
    eager = torch.linspace(0, 0.1, 5, device="cpu").tolist()

    assert [r.item() for r in rates] == eager
    assert rates.tolist() == eager
    assert is_fake(rates)
    assert rates.device.type == device


def test_int_bool_and_control_flow_on_constants_take_the_eager_branch(device: str) -> None:
    widths = torch.arange(6).reshape(2, 3) * 2

    assert int(widths[1, 2]) == 10
    assert bool(widths.sum() > 20)
    taken = "big" if widths.max() > 5 else "small"
    assert taken == "big"
    assert widths.device.type == device


def test_unique_and_nonzero_of_constants_give_fakes_of_the_real_shape_on_the_device(device: str) -> None:
    values, counts = torch.unique(torch.tensor([3, 1, 1, 3, 3]), return_counts=True)
    where = torch.nonzero(torch.tensor([0, 2, 0, 5]))

    assert (values.tolist(), counts.tolist()) == ([1, 3], [2, 3])
    assert where.tolist() == [[1], [3]]
    assert {values.device.type, counts.device.type, where.device.type} == {device}
    assert is_fake(values)
    assert is_fake(where)


def test_torch_equal_of_constants_compares_their_values(device: str) -> None:
    assert torch.equal(torch.arange(3) * 2, torch.tensor([0, 2, 4]))
    assert not torch.equal(torch.arange(3), torch.tensor([0, 2, 4]))


def test_moving_a_constant_to_another_dtype_or_device_keeps_its_values(device: str) -> None:
    half = torch.arange(3.0).to(torch.float16)
    on_cpu = torch.arange(3).to("cpu")

    assert (half.dtype, half.device.type, half.tolist()) == (torch.float16, device, [0.0, 1.0, 2.0])
    assert (on_cpu.device.type, on_cpu.tolist()) == ("cpu", [0, 1, 2])


def test_in_place_updates_of_a_constant_and_of_its_views_are_seen_in_its_values(device: str) -> None:
    table = torch.zeros(4)
    table[1:3] = torch.tensor([5.0, 6.0])
    head = table[:1]
    head.add_(2)
    table.mul_(torch.full((4,), 3.0))

    assert table.tolist() == [6.0, 15.0, 18.0, 0.0]
    assert head.tolist() == [6.0]


def test_a_random_draw_is_refused_naming_the_op_the_line_and_what_a_constant_is(device: str) -> None:
    drawn = torch.rand(3)

    with pytest.raises(
        Exception, match=r"needs the values.*\noperation: aten\._local_scalar_dense\.default\n"
    ) as raised:
        drawn.sum().item()

    message = str(raised.value)
    assert f"{__file__}:" in message
    assert "construction-time constants" in message
    assert "at most 4096 elements" in message
    assert isinstance(raised.value, DataDependentOutputException)


def test_nonzero_of_a_parameter_is_refused_naming_the_op(device: str) -> None:
    layer = nn.Linear(3, 3)

    with pytest.raises(DynamicOutputShapeException, match=r"aten\.nonzero\.default"):
        torch.nonzero(layer.weight)


def test_a_parameter_made_from_a_constant_holds_no_values(device: str) -> None:
    scale = nn.Parameter(torch.tensor(2.5))

    with pytest.raises(Exception, match="construction-time constants"):
        scale.item()


def test_a_constant_written_with_random_numbers_or_a_parameter_forgets_its_values_and_its_views_too(
    device: str,
) -> None:
    drawn_into = torch.arange(3.0)
    view = drawn_into.view(3, 1)
    view.add_(torch.randn(3, 1))
    mixed = torch.arange(2.0)
    mixed.mul_(nn.Parameter(torch.ones(2)))
    filled = torch.zeros(2)
    filled.normal_()

    for forgotten in (drawn_into, view, mixed, filled):
        with pytest.raises(Exception, match="construction-time constants"):
            forgotten.tolist()


def test_trunc_normal_of_a_constant_makes_it_and_its_views_forget_their_values(device: str) -> None:
    drawn_into = torch.zeros(5)
    view = drawn_into[1:3]
    nn.init.trunc_normal_(drawn_into, std=0.02)
    part_drawn = torch.zeros(4)
    nn.init.trunc_normal_(part_drawn[:2])

    for forgotten in (drawn_into, view, part_drawn):
        with pytest.raises(Exception, match="construction-time constants"):
            forgotten.tolist()
    with pytest.raises(Exception, match="construction-time constants"):
        bool((drawn_into != 0).any())


def test_data_assignment_gives_a_constant_the_values_of_its_new_data_shared_with_it(device: str) -> None:
    replaced = torch.zeros(3)
    replaced.data = torch.ones(3)
    shared = torch.zeros(2)
    given = torch.arange(2.0)
    shared.data = given
    given.add_(5)
    written = torch.zeros(2)
    source = torch.arange(2.0)
    written.data = source
    written.normal_()
    unknown = torch.arange(3.0)
    unknown.data = torch.empty(3)

    assert replaced.tolist() == [1.0, 1.0, 1.0]
    assert shared.tolist() == [5.0, 6.0]
    for forgotten in (written, source, unknown):
        with pytest.raises(Exception, match="construction-time constants"):
            forgotten.tolist()
    assert is_fake(replaced)
    assert replaced.device.type == device


def test_a_random_write_into_the_memory_a_view_left_by_data_assignment_leaves_it_and_its_new_views_their_values(
    device: str,
) -> None:
    whole = torch.arange(3.0)
    part = whole[1:]
    part.data = torch.tensor([-1.5, -0.5])  # part leaves whole's memory
    tail = part[1:]
    nn.init.normal_(whole)  # whole's memory only: part and tail keep theirs
    part.fill_(9)

    assert part.tolist() == [9.0, 9.0]
    assert tail.tolist() == [9.0]  # before: part forgot its values, tail kept a stale -0.5


def test_a_parameter_given_a_constants_data_holds_no_values_and_the_constant_forgets_its_own(device: str) -> None:
    scale = nn.Parameter(torch.zeros(2))
    table = torch.arange(2.0)
    scale.data = table
    scale.data = scale.data.to(torch.bfloat16)

    for forgotten in (scale, table):
        with pytest.raises(Exception, match="construction-time constants"):
            forgotten.tolist()
    assert scale.dtype == torch.bfloat16


def test_constants_are_bounded_to_4096_elements_but_views_of_a_constant_are_not(device: str) -> None:
    small = torch.arange(4096.0)
    large = torch.arange(4097.0)
    wide = torch.ones(3).expand(5000, 3)

    assert small.sum().item() == sum(range(4096))
    assert wide.sum().item() == 15000.0
    with pytest.raises(Exception, match="at most 4096 elements"):
        large.sum().item()
    with pytest.raises(Exception, match="at most 4096 elements"):
        torch.arange(10000).sum().item()


def test_empty_is_no_constant(device: str) -> None:
    with pytest.raises(Exception, match="construction-time constants"):
        torch.empty(3).tolist()


def test_on_the_meta_device_values_are_refused_as_outside_fake_mode() -> None:
    with fake_mode(), pytest.raises(Exception, match=r"meta|values"):
        torch.arange(3, device="meta").tolist()


def test_a_deep_copy_of_a_module_keeps_the_values_of_its_constant_buffers_on_the_device(device: str) -> None:
    norm = nn.BatchNorm2d(4)  # running statistics and their count are constants
    norm.running_mean.add_(torch.arange(4.0))

    copied = copy.deepcopy(norm)  # timm's pruned models copy their blocks so

    assert copied.running_mean.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert copied.running_var.tolist() == [1.0] * 4
    assert copied.num_batches_tracked.item() == 0
    assert all(is_fake(t) and t.device.type == device for t in copied.state_dict().values())
    assert copied.running_mean is not norm.running_mean


def test_a_deep_copy_of_a_constant_has_values_of_its_own(device: str) -> None:
    table = torch.arange(4.0)
    copied = copy.deepcopy(table)
    copied.add_(1)
    table.mul_(2)

    assert copied.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert table.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert is_fake(copied)
    assert copied.device.type == device


class _Model(nn.Module):
    """Reads constants while building, as timm models do (drop-path rates, widths), then draws its weights."""

    def __init__(self, refuse: str = "") -> None:
        super().__init__()
        rates = torch.linspace(0, 0.3, 4).tolist()
        widths = torch.unique(torch.round(torch.arange(6.0) * 1.7)).int().tolist()
        self.layers = nn.ModuleList(nn.Linear(w, w) for w in widths[1:4])
        self.scale = nn.Parameter(torch.full((3,), rates[-1]))
        self.register_buffer("index", torch.arange(4) * 2)
        self.register_buffer("table", torch.zeros(4))
        self.table[1:3] = torch.tensor([5.0, 6.0])
        if int(self.index.sum()) > 3:
            self.extra = nn.Linear(2, 2)
        if refuse == "random":
            int(torch.rand(()) * 3)
        if refuse == "parameter":
            self.scale.sum().item()
        if refuse == "written":
            self.table.add_(torch.randn(4))
            self.table.tolist()


def test_deferred_init_records_reads_of_constants_and_materializes_bit_identically_with_the_generator_at_its_end() -> (
    None
):
    torch.manual_seed(0)
    eager = _Model()
    eager_state = torch.default_generator.get_state()
    torch.manual_seed(0)
    deferred = deferred_init(_Model)
    materialize_module(deferred)

    assert list(deferred.state_dict()) == list(eager.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(eager.state_dict().values(), deferred.state_dict().values(), strict=True)
    )
    assert torch.equal(torch.default_generator.get_state(), eager_state)
    assert hasattr(deferred, "extra")


class _Copied(nn.Module):
    """Deep-copies a block whose buffers are constants, then initializes and reads the copy, as timm's pruned
    models (``adapt_model_from_string``) do."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4))
        self.first[1].running_mean.add_(torch.arange(4.0))
        self.second = copy.deepcopy(self.first)
        nn.init.normal_(self.second[0].weight)
        self.second[1].running_var.mul_(torch.full((4,), 2.0))
        self.first[1].running_var.sub_(0.5)
        self.register_buffer(
            "read", torch.tensor(self.second[1].running_mean.tolist() + self.second[1].running_var.tolist())
        )


def test_deferred_init_deep_copying_constant_buffers_materializes_bit_identically_generator_included() -> None:
    torch.manual_seed(0)
    eager = _Copied()
    eager_state = torch.default_generator.get_state()
    torch.manual_seed(0)
    deferred = deferred_init(_Copied)
    materialize_module(deferred)

    assert list(deferred.state_dict()) == list(eager.state_dict())
    assert all(
        torch.equal(a, b) for a, b in zip(eager.state_dict().values(), deferred.state_dict().values(), strict=True)
    )
    assert torch.equal(torch.default_generator.get_state(), eager_state)


def _scatter_(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """An initializer that deferred_init records as one call (registered with register_opaque_init)."""
    with torch.no_grad():
        return tensor.copy_(torch.randn(tensor.shape) * scale)


class _OpaquelyWritten(nn.Module):
    """Writes constants with trunc_normal_ and with a registered opaque initializer, then reads them."""

    def __init__(self, writer: str, read: bool) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(5))
        self.register_buffer("other", torch.arange(3.0))
        if writer == "trunc_normal_":
            nn.init.trunc_normal_(self.table, std=0.02)
        else:
            sys.modules[__name__]._scatter_(self.table, 0.5)
        self.other.mul_(2)
        self.doubled = self.other.tolist()
        if read:
            self.drawn = bool((self.table != 0).any())


@pytest.mark.parametrize("writer", ["trunc_normal_", "registered"])
def test_deferred_init_refuses_values_of_a_constant_an_opaque_initializer_wrote_and_materializes_its_draws(
    writer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modattrs.deferred import register_opaque_init

    monkeypatch.setattr(sys.modules[__name__], "_scatter_", _scatter_)  # registering replaces it: for this test only
    register_opaque_init(sys.modules[__name__], "_scatter_", mutates=0)
    with pytest.raises(DeferredInitError, match="not a construction-time constant"):
        deferred_init(_OpaquelyWritten, writer, read=True)

    torch.manual_seed(0)
    eager = _OpaquelyWritten(writer, read=False)
    torch.manual_seed(0)
    deferred = deferred_init(_OpaquelyWritten, writer, read=False)
    materialize_module(deferred)

    assert deferred.doubled == eager.doubled == [0.0, 2.0, 4.0]
    assert torch.equal(deferred.table, eager.table)
    assert bool((deferred.table != 0).all())


class _DataReplaced(nn.Module):
    """Replaces a constant buffer's data, then builds from its values."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("widths", torch.zeros(3, dtype=torch.int64))
        self.widths.data = torch.tensor([2, 3, 4])
        self.layers = nn.ModuleList(nn.Linear(w, w) for w in self.widths.tolist())


def test_deferred_init_reads_the_values_data_assignment_gave_a_constant_and_materializes_them() -> None:
    torch.manual_seed(0)
    eager = _DataReplaced()
    torch.manual_seed(0)
    deferred = deferred_init(_DataReplaced)

    assert [layer.in_features for layer in deferred.layers] == [2, 3, 4]
    materialize_module(deferred)
    assert all(
        torch.equal(a, b) for a, b in zip(eager.state_dict().values(), deferred.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("refuse", ["random", "parameter", "written"])
def test_deferred_init_refuses_values_of_random_draws_parameters_and_overwritten_constants(refuse: str) -> None:
    with pytest.raises(DeferredInitError, match="not a construction-time constant") as raised:
        deferred_init(_Model, refuse)

    assert f"{__file__}:" in str(raised.value)


def test_linspace_and_logspace_from_tensor_ends_take_their_values_and_refuse_ends_without(device: str) -> None:
    between = torch.linspace(torch.tensor(2.0), torch.tensor(4.0), 3)
    powers = torch.logspace(torch.tensor(0.0), 2, 3)

    assert between.tolist() == [2.0, 3.0, 4.0]
    assert powers.tolist() == [1.0, 10.0, 100.0]
    assert between.device.type == powers.device.type == device
    with pytest.raises(Exception, match="construction-time constants"):
        torch.linspace(torch.empty(()), 1, 3).tolist()


#: Pointwise operations on constants: small ones run on the values only.
POINTWISE: dict[str, Callable[[], torch.Tensor]] = {
    "rotary frequencies": lambda: 1.0 / (10_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16)),
    "true division of ints": lambda: torch.arange(6) / 4,
    "floor division": lambda: torch.div(torch.arange(6), 4, rounding_mode="floor"),
    "broadcast": lambda: torch.arange(3).reshape(3, 1) * torch.arange(4.0).reshape(1, 4),
    "0-dim tensor, ints and a float": lambda: torch.tensor(2.0) * torch.arange(3) + 0.5,
    "half": lambda: torch.arange(3, dtype=torch.float16) * 2,
    "comparison and where": lambda: torch.where(torch.arange(4) > 1, torch.arange(4), torch.zeros(4, dtype=torch.long)),
    "clamp and exp": lambda: torch.arange(5.0).clamp(1, 3).exp(),
    "transposed": lambda: torch.arange(6.0).reshape(2, 3).t() * 2,
    "channels last": lambda: torch.ones(2, 3, 2, 2).clone(memory_format=torch.channels_last) + 1,
    "too large to keep": lambda: torch.arange(128.0).reshape(128, 1) * torch.arange(64.0),
}


@pytest.mark.parametrize("operation", POINTWISE)
def test_pointwise_operations_on_constants_give_torchs_shapes_strides_and_dtypes_and_eager_values(
    operation: str,
) -> None:
    eager = POINTWISE[operation]()
    with torch.device("meta"):
        meta = POINTWISE[operation]()
    for device in DEVICES:
        with fake_mode(fake_cuda=device == "cuda"), torch.device(device):
            made = POINTWISE[operation]()
            values = made.tolist() if eager.numel() <= 4096 else None

        assert is_fake(made)
        assert (made.shape, made.stride(), made.dtype) == (meta.shape, meta.stride(), meta.dtype)
        assert made.device.type == device
        assert values == (eager.tolist() if eager.numel() <= 4096 else None)


#: Factories of Python numbers whose results differ only by the type of a number or by the default dtype.
NUMBER_FACTORIES: list[Callable[[], torch.Tensor]] = [
    lambda: torch.arange(5),
    lambda: torch.arange(5.0),
    lambda: torch.arange(0, 8, 2, dtype=torch.float),
    lambda: torch.linspace(0, 1, 5),
    lambda: torch.eye(2, 3),
    lambda: torch.scalar_tensor(1),
]


@pytest.mark.parametrize("device", DEVICES)
def test_factories_of_python_numbers_make_what_eager_makes_for_every_type_of_number_and_default_dtype(
    device: str,
) -> None:
    default = torch.get_default_dtype()
    try:
        for dtype in (torch.float64, torch.float32):
            torch.set_default_dtype(dtype)
            eager = [make() for make in NUMBER_FACTORIES]
            with fake_mode(fake_cuda=device == "cuda"), torch.device(device):
                first = [make() for make in NUMBER_FACTORIES]
                second = [make() for make in NUMBER_FACTORIES]
                values = [(made.tolist(), again.tolist()) for made, again in zip(first, second, strict=True)]

            for expected, made, again, (got, got_again) in zip(eager, first, second, values, strict=True):
                assert (made.shape, made.stride(), made.dtype) == (expected.shape, expected.stride(), expected.dtype)
                assert (again.shape, again.stride(), again.dtype) == (expected.shape, expected.stride(), expected.dtype)
                assert got == got_again == expected.tolist()
                assert made.device.type == again.device.type == device
    finally:
        torch.set_default_dtype(default)


class _Viewed(nn.Module):
    def __init__(self, view: str) -> None:
        super().__init__()
        whole = torch.arange(4.0)
        self.register_buffer("whole", whole)
        self.register_buffer("part", whole[1:3] if view == "slice" else whole.view(2, 2))


#: What eager code gets: a copy's view, filled with 9, writes into the copy's buffer at its own offset.
_EAGER_COPIES = {"slice": ([0.0, 9.0, 9.0, 3.0], 1), "view": ([9.0, 9.0, 9.0, 9.0], 0)}


@pytest.mark.parametrize("view", ["slice", "view"])
def test_a_deep_copy_keeps_a_view_a_view_of_the_copied_buffer_as_eager_copies_do(device: str, view: str) -> None:
    original = _Viewed(view)
    copied = copy.deepcopy(original)
    copied.part.fill_(9)

    assert (copied.whole.tolist(), copied.part.storage_offset()) == _EAGER_COPIES[view]
    assert original.whole.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert is_fake(copied.part)
    assert copied.part.device.type == device


class _ViewsOfAParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(6.0))
        with torch.no_grad():
            self.register_buffer("tail", self.weight.view(-1)[1:])
            self.register_buffer("grid", self.tail.view(1, -1))


def test_a_deep_copys_views_are_no_autograd_views_and_can_be_viewed_after_a_write_as_eager_copies_can(
    device: str,
) -> None:
    copied = copy.deepcopy(_ViewsOfAParameter())
    with torch.no_grad():
        copied.tail.fill_(9)

    (row,) = copied.grid.unbind(0)  # a view made under no_grad whose base was written would refuse this
    assert row.shape == (5,)
    assert copied.grid._base is None  # eager's copy sets the copied storage into a tensor: no view to autograd
    assert copied.grid.requires_grad
    assert copied.grid.untyped_storage()._cdata == copied.tail.untyped_storage()._cdata
    assert copied.grid.untyped_storage()._cdata != copied.weight.untyped_storage()._cdata  # a parameter is cloned


def test_a_deep_copy_of_a_dtype_view_of_a_matrixs_memory_copies_as_eager_code_does(device: str) -> None:
    matrix = torch.zeros(2, 3)
    wide = matrix.view(-1).view(torch.float64)  # the matrix, met first, is copied whole: its last dim is 3

    copied, copied_wide = copy.deepcopy([matrix, wide])
    copied_wide.fill_(1.0)

    assert copied_wide.shape == (3,)
    assert copied.untyped_storage()._cdata == copied_wide.untyped_storage()._cdata


def test_a_deep_copy_of_real_tensors_inside_fake_mode_is_a_fake_copy_keeping_their_values_and_views() -> None:
    real = torch.arange(6.0)
    view = real[2:4]
    large = torch.zeros(5000)

    with fake_mode():
        copied, copied_view, copied_large = copy.deepcopy([real, view, large])
        assert all(is_fake(t) for t in (copied, copied_view, copied_large))
        assert copied_view.tolist() == [2.0, 3.0]
        copied_view.fill_(5)
        assert copied.tolist() == [0.0, 1.0, 5.0, 5.0, 4.0, 5.0]
        assert copied_large.shape == (5000,)

    assert real.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def _padded_shard(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FSDP2's cut of a small weight: a shard of it, a padded copy of the shard, and a view of the copy."""
    shard = weight.narrow(0, 2, 3)
    padded = weight.new_zeros(4)
    padded[:3].copy_(shard)
    return shard, padded, padded.view(2, 2)


def test_a_constant_cut_outside_its_fake_mode_keeps_the_values_it_keeps_inside() -> None:
    with fake_mode() as mode:
        inside = _padded_shard(torch.arange(8.0))
        weight = torch.arange(8.0)

    outside = _padded_shard(weight)

    with mode:
        expected = [
            torch.tensor([2.0, 3.0, 4.0]),
            torch.tensor([2.0, 3.0, 4.0, 0.0]),
            torch.tensor([[2.0, 3.0], [4.0, 0.0]]),
        ]
        assert [torch.equal(t, e) for t, e in zip(inside, expected, strict=True)] == [True] * 3
        assert [torch.equal(t, e) for t, e in zip(outside, expected, strict=True)] == [True] * 3
    assert all(is_fake(t) for t in outside)


def test_a_constant_written_outside_its_fake_mode_from_a_tensor_without_values_forgets_them() -> None:
    with fake_mode() as mode:
        weight = torch.arange(8.0)
        noise = torch.empty(8).normal_()

    weight.narrow(0, 0, 4).copy_(noise[:4])

    with mode, pytest.raises(Exception, match="needs the values of a fake tensor"):
        float(weight.sum())
