"""Cached virtual values: reused while nothing they depend on changes, recomputed once when something does."""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import modattrs
from modattrs import ShapedTensor, VirtualTensor
from modattrs._torch_private import address_of
from modattrs.deferred import deferred_init, materialize_module
from modattrs.fake import fake_mode


class Counted(nn.Module):
    """``table`` depends on ``weight`` (a parameter), ``scale`` (a plain attribute) and ``offsets`` (a buffer)."""

    def __init__(self, cache: bool = True, **kwargs: object) -> None:
        super().__init__()
        self.calls = 0
        self.scale = 2.0
        self.weight = nn.Parameter(torch.ones(3))
        self.register_buffer("offsets", torch.zeros(3))
        depends_on = kwargs.pop("depends_on", ("weight", "scale", "offsets"))
        VirtualTensor(self, "table", "make_table", cache=cache, depends_on=depends_on, **kwargs)  # type: ignore[arg-type]

    def make_table(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        self.calls += 1
        return (self.weight.detach() * self.scale + self.offsets).to(device=device, dtype=dtype)


def test_a_cached_value_is_the_same_tensor_until_something_changes() -> None:
    m = Counted()
    first = m.table.value
    assert m.table.value is first
    assert m.calls == 1
    assert m.table.cached
    assert m.table.depends_on == ("weight", "scale", "offsets")


def test_without_cache_every_read_computes() -> None:
    m = Counted(cache=False)
    assert m.table.value is not m.table.value
    assert m.calls == 2


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda m: m.to(torch.float64), id="module.to"),
        pytest.param(lambda m: m.half(), id="module.half"),
        pytest.param(lambda m: m.to("meta").to_empty(device="cpu"), id="to_empty"),
        pytest.param(lambda m: m.table.to(torch.float64), id="vt.to"),
        pytest.param(lambda m: setattr(m.table, "dtype", torch.float16), id="vt.dtype"),
        pytest.param(lambda m: m.table.to("meta"), id="vt.device"),
        pytest.param(lambda m: m.load_state_dict(Counted(persist=True).double().state_dict(), assign=True),
                     id="load_state_dict-assign"),
        pytest.param(lambda m: setattr(m, "weight", nn.Parameter(torch.ones(3))), id="dependency-replaced"),
        pytest.param(lambda m: m.offsets.add_(1.0), id="dependency-modified-in-place"),
        pytest.param(lambda m: torch.no_grad()(m.weight.mul_)(2.0), id="parameter-modified-in-place"),
        pytest.param(lambda m: setattr(m, "scale", 3.0), id="plain-dependency-changed"),
        pytest.param(lambda m: m.table.invalidate(), id="invalidate"),
    ],
)  # fmt: skip
def test_each_change_invalidates_and_the_next_read_computes_once(change: object) -> None:
    m = Counted(persist=True)
    first = m.table.value
    change(m)  # type: ignore[operator]
    second = m.table.value
    assert second is not first
    assert m.table.value is second
    assert m.calls == 2


def test_an_equal_plain_dependency_is_no_change() -> None:
    m = Counted()
    first = m.table.value
    m.scale = float("2.0")  # another object, equal value
    assert m.table.value is first


def test_a_fixed_dtype_attribute_is_invalidated_by_a_device_change_only() -> None:
    m = Counted(dtype=torch.float32, follow_dtype=False)
    first = m.table.value
    m.half()
    assert m.table.value is not first  # the reference was replaced, even though the dtype stayed float32
    assert m.table.value.dtype == torch.float32


def test_changes_that_cannot_be_seen_are_not_seen() -> None:
    m = Counted(depends_on=("weight",))
    first = m.table.value
    with torch.no_grad():
        m.offsets.add_(1.0)  # not declared
    m.weight.data.mul_(2.0)  # .data has a version counter of its own
    assert m.table.value is first  # documented: declare dependencies, write through no_grad, or invalidate()


def test_a_value_with_an_autograd_graph_is_never_kept() -> None:
    class Graph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))
            VirtualTensor(self, "doubled", lambda m, dtype, device: m.weight * 2, cache=True)

    m = Graph()
    first = m.doubled.value
    assert first.grad_fn is not None
    second = m.doubled.value
    assert second is not first
    second.sum().backward()  # a fresh graph: never one that a previous backward freed
    first.sum().backward()
    assert torch.equal(m.weight.grad, torch.full((3,), 4.0))  # type: ignore[arg-type]
    with torch.no_grad():
        kept = m.doubled.value
        assert m.doubled.value is kept


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_value_computed_in_a_grad_mode_is_reused_only_in_that_mode(mode: object) -> None:
    m = Counted()
    with mode():  # type: ignore[operator]
        inside = m.table.value
        assert m.table.value is inside
    outside = m.table.value
    assert outside is not inside
    assert m.table.value is outside


def test_a_different_fake_mode_invalidates_and_reading_outside_the_own_mode_does_not() -> None:
    with fake_mode() as own:
        m = Counted()
        inside = m.table.value
    assert m.table.value is inside  # outside its own mode: the same state
    with own:
        assert m.table.value is inside
    with fake_mode():
        other = m.table.value
    assert other is not inside


def test_concurrent_readers_compute_once() -> None:
    m = Counted()
    start = threading.Barrier(8)
    values: list[Tensor] = []

    def read() -> None:
        start.wait()
        values.append(m.table.value)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert m.calls == 1
    assert all(value is values[0] for value in values)


def test_each_instance_has_its_own_cache_and_copies_start_empty() -> None:
    original = Counted()
    other = Counted()
    assert other.table.value is not original.table.value
    value = original.table.value
    clone = copy.deepcopy(original)
    clone.scale = 5.0
    assert torch.equal(clone.table.value, torch.full((3,), 5.0))
    assert original.table.value is value
    loaded = pickle.loads(pickle.dumps(original))
    assert loaded.table.value is not value
    assert loaded.table.cached


def test_the_cache_holds_one_tensor_and_invalidate_or_deleting_the_owner_frees_it() -> None:
    m = Counted()
    value = m.table.value
    alive = weakref.ref(value)
    del value
    m.scale = 4.0
    m.table.value  # replaces the entry: the old value is gone
    assert alive() is None
    current = weakref.ref(m.table.value)
    m.table.invalidate()
    gc.collect()
    assert current() is None
    last = weakref.ref(m.table.value)
    del m
    gc.collect()
    assert last() is None


@pytest.mark.parametrize(
    ("depends_on", "error", "match"),
    [
        (("missing",), AttributeError, "depends_on names 'missing', which is not a parameter"),
        (("forward",), AttributeError, "depends_on names 'forward', which is not a parameter"),
        ("weight", TypeError, "must be a sequence of attribute names"),
        ((3,), TypeError, "must name attributes"),
        (("shaped",), ValueError, "names 'shaped', a ShapedTensor, .* name its data, '_shaped_data'"),
        (("other",), ValueError, "names 'other', a VirtualTensor, .* name the tensors its materializer reads"),
    ],
)
def test_bad_depends_on_raises_and_changes_nothing(depends_on: object, error: type[Exception], match: str) -> None:
    m = nn.Module()
    m.weight = nn.Parameter(torch.ones(1))
    ShapedTensor(m, "shaped", torch.ones(2), {0: 2})
    VirtualTensor(m, "other", lambda o, dtype, device: torch.ones(1))
    registered = list(m._buffers)
    with pytest.raises(error, match=match):
        VirtualTensor(m, "x", lambda o, dtype, device: torch.ones(1), cache=True, depends_on=depends_on)  # type: ignore[arg-type]
    assert list(m._buffers) == registered
    assert "x" not in m.__dict__


class Summed(nn.Module):
    """A cached VirtualTensor computed from a ShapedTensor, declared as depending on its data."""

    def __init__(self, kind: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        ShapedTensor(self, "history", kind(torch.arange(6.0).reshape(3, 2)), {1: 2})
        VirtualTensor(self, "total", "make_total", cache=True, depends_on=("_history_data",))

    def make_total(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.history.value.detach().sum(0).to(dtype)


SHAPED_CHANGES: dict[str, Callable[[Summed], None]] = {
    "reconstrain": lambda m: m.history.reconstrain(0, 2),
    "assigned, same shape": lambda m: setattr(m.history, "value", torch.ones(3, 2)),
    "assigned, new shape": lambda m: setattr(m.history, "value", torch.ones(5, 2)),
    # Made in inference mode: no version counter to bump, for a parameter that takes it through `.data =`.
    "assigned an inference tensor": lambda m: setattr(m.history, "value", _inference(torch.ones, 3, 2)),
}


def _inference(make: Callable[..., Tensor], *args: object) -> Tensor:
    with torch.inference_mode():
        return make(*args)


@pytest.mark.parametrize("scoped", [False, True], ids=["lasting cache", "cached() block"])
@pytest.mark.parametrize("change", SHAPED_CHANGES)
@pytest.mark.parametrize("kind", [lambda t: t, nn.Parameter], ids=["buffer", "parameter"])
def test_a_cached_value_depending_on_a_shaped_tensor_sees_its_reconstrain_and_assignment(
    kind: Callable[[Tensor], Tensor], change: str, scoped: bool
) -> None:
    m = Summed(kind)
    with modattrs.cached() if scoped else contextlib.nullcontext():
        before = m.total.value
        SHAPED_CHANGES[change](m)
        after = m.total.value
    assert not torch.equal(before, after)
    assert torch.equal(after, m.history.value.detach().sum(0))


class Wrapper(nn.Module):
    """A real module whose cached value is computed from a submodule that may be deferred."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        VirtualTensor(self, "squared", "make_squared", cache=True, depends_on=("inner",))

    def make_squared(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return (self.inner.weight.detach() ** 2).to(device=device, dtype=dtype)


@pytest.mark.parametrize("scoped", [False, True], ids=["lasting cache", "cached() block"])
def test_a_fake_value_of_a_real_module_is_not_kept_so_materializing_a_deferred_part_is_seen(scoped: bool) -> None:
    torch.manual_seed(0)
    wrapper = Wrapper(deferred_init(nn.Linear, 2, 2))
    with modattrs.cached() if scoped else contextlib.nullcontext():
        assert isinstance(wrapper.squared.value, FakeTensor)  # computed from the deferred weight
        materialize_module(wrapper.inner)
        value = wrapper.squared.value
    assert not isinstance(value, FakeTensor)
    assert torch.equal(value, wrapper.inner.weight.detach() ** 2)


# --- the scoped cache -----------------------------------------------------------------------------------------------


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.arange(3.0))
        self.calls = 0
        VirtualTensor(self, "squared", "make_squared")

    def make_squared(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        self.calls += 1
        return self.weight**2

    def forward(self, x: Tensor) -> Tensor:
        return x * self.squared.value + self.squared.value.sum()


def test_inside_cached_every_value_is_materialized_once_with_autograd_intact() -> None:
    m = Model()
    with modattrs.cached():
        loss = m(torch.ones(3)).sum() + m.squared.value.mean()
        assert m.calls == 1
        loss.backward()
    expected = Model()
    (expected(torch.ones(3)).sum() + expected.squared.value.mean()).backward()
    assert torch.equal(m.weight.grad, expected.weight.grad)  # type: ignore[arg-type]


def test_nothing_is_kept_after_the_block() -> None:
    m = Model()
    with modattrs.cached():
        inside = m.squared.value
    assert m.squared.value is not inside
    assert m.calls == 2


def test_scopes_nest_and_the_inner_block_shares_the_outer() -> None:
    m = Model()
    with modattrs.cached():
        outer = m.squared.value
        with modattrs.cached():
            assert m.squared.value is outer
        assert m.squared.value is outer
    assert m.calls == 1


def test_a_scope_belongs_to_its_thread() -> None:
    m = Model()
    seen: list[Tensor] = []
    with modattrs.cached():
        mine = m.squared.value
        thread = threading.Thread(target=lambda: seen.append(m.squared.value))
        thread.start()
        thread.join(timeout=30)
        assert m.squared.value is mine
    assert seen[0] is not mine


def test_a_change_inside_the_scope_is_seen() -> None:
    m = Counted(cache=False)
    with modattrs.cached():
        first = m.table.value
        m.to(torch.float64)
        assert m.table.value is not first
        assert m.table.value.dtype == torch.float64


# --- tracing ----------------------------------------------------------------------------------------------------------


class Traced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", torch.ones(4))
        VirtualTensor(self, "ramp", "make_ramp", cache=True, depends_on=("base",))

    def make_ramp(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.arange(4, dtype=dtype, device=device) * self.base.to(dtype)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ramp.value


def test_compiled_forward_computes_the_value_in_the_graph_and_sees_later_changes() -> None:
    torch._dynamo.reset()
    m = Traced()
    m.ramp.value  # cached before compiling: must not be baked into the graph
    graphs: list[torch.fx.GraphModule] = []

    def backend(graph: torch.fx.GraphModule, inputs: object) -> object:
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(m, backend=backend, fullgraph=True)
    x = torch.zeros(4)
    torch.testing.assert_close(compiled(x), torch.arange(4.0))
    assert any(node.target is torch.arange for node in graphs[0].graph.nodes)
    with torch.no_grad():
        m.base.mul_(2.0)  # an in-place update of a dependency after compiling
    torch.testing.assert_close(compiled(x), 2 * torch.arange(4.0))
    m.to(torch.float64)
    out = compiled(x.double())
    assert out.dtype == torch.float64


def test_export_computes_the_value_in_the_graph_not_as_a_constant() -> None:
    m = Traced()
    m.ramp.value
    program = torch.export.export(m, (torch.zeros(4),))
    assert "aten.arange.default" in {str(node.target) for node in program.graph.nodes}
    assert all(constant.numel() == 0 for constant in program.constants.values())  # only the reference


def test_a_fixed_dtype_changed_through_the_attribute_invalidates() -> None:
    m = Counted(dtype=torch.float32, follow_dtype=False)
    first = m.table.value
    m.table.to(torch.float64)
    assert m.table.value.dtype == torch.float64
    m.table.follow_dtype = True
    assert m.table.value is not first
    assert m.calls == 3


def test_a_value_computed_with_grad_enabled_and_without_a_graph_serves_every_mode() -> None:
    m = Counted()
    value = m.table.value
    with torch.no_grad():
        assert m.table.value is value
    with torch.inference_mode():
        assert m.table.value is value


# --- found in review ------------------------------------------------------------------------------------------------


def test_a_dependency_starting_to_require_grad_invalidates() -> None:
    m = Counted(depends_on=("weight",))
    m.weight.requires_grad_(False)
    first = m.table.value
    m.weight.requires_grad_(True)
    assert m.table.value is not first


def test_cached_dependencies_do_not_stop_swap_tensors() -> None:
    m = Counted()
    m.table.value
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.double()  # swap_tensors refuses tensors with Python weak references
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert m.table.value.dtype == torch.float64


def test_inference_tensors_can_be_dependencies() -> None:
    with torch.inference_mode():
        m = Counted()
        first = m.table.value
        assert m.table.value is first
    m.scale = 3.0
    with torch.inference_mode():
        assert m.table.value is not first


def test_a_cached_module_is_freed_without_the_garbage_collector() -> None:
    gc.collect()
    gc.disable()
    try:
        m = Counted()
        m.table.value
        alive = weakref.ref(m)
        weight = weakref.ref(m.weight)
        del m
        assert alive() is None
        assert weight() is None
    finally:
        gc.enable()


def test_a_dependency_that_disappears_is_reported() -> None:
    m = Counted(depends_on=("weight",))
    m.table.value
    torch.nn.utils.parametrize.register_parametrization(m, "weight", nn.Identity())
    with pytest.raises(AttributeError, match=r"^VirtualTensor 'table' depends on 'weight', which is no longer"):
        m.table.value


def test_a_materializer_may_invalidate_or_read_other_attributes() -> None:
    class Chained(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            VirtualTensor(self, "base", lambda m, dtype, device: torch.ones(2, dtype=dtype, device=device), cache=True)
            VirtualTensor(self, "twice", "make_twice", cache=True)

        def make_twice(self, dtype: torch.dtype, device: torch.device) -> Tensor:
            self.twice.invalidate()  # reentrant lock: no deadlock
            return 2 * self.base.value

    chained = Chained()
    assert torch.equal(chained.twice.value, torch.full((2,), 2.0))


def test_create_takes_cache_and_depends_on() -> None:
    m = nn.Module()
    m.size = 2
    vt = VirtualTensor.create(m, "x", lambda o, d, v: torch.ones(o.size), cache=True, depends_on=("size",))
    assert vt.cached
    assert vt.depends_on == ("size",)


# --- fake modes and in-place swaps ----------------------------------------------------------------------------------


def _torch_fake_mode() -> object:
    return FakeTensorMode(allow_non_fake_inputs=True)  # the materializer reads real parameters


@pytest.mark.parametrize("enter", [fake_mode, _torch_fake_mode], ids=["modattrs", "torch"])
def test_a_value_cached_inside_a_fake_mode_is_never_served_outside_it(enter: Callable[[], Any]) -> None:
    m = Counted()
    real = m.table.value
    with enter():
        inside = m.table.value
        assert isinstance(inside, FakeTensor)
    assert m.table.value is real
    with torch.no_grad():
        m.weight.add_(1)  # a real change afterwards: a real recomputation, not the fake value
    after = m.table.value
    assert type(after) is torch.Tensor
    assert torch.equal(after, torch.full((3,), 4.0))


def test_a_value_cached_inside_a_fake_mode_before_any_real_read_is_not_served_outside() -> None:
    m = Counted()
    with fake_mode():
        m.table.value
    value = m.table.value
    assert type(value) is torch.Tensor
    assert torch.equal(value, torch.full((3,), 2.0))


def test_a_value_cached_in_one_fake_mode_is_never_served_in_another() -> None:
    m = Counted()
    with fake_mode() as first:
        one = m.table.value
    with fake_mode() as second:
        other = m.table.value
        assert other is not one
        assert other.fake_mode is second
    assert one.fake_mode is first


@pytest.mark.parametrize("meta_init", [False, True], ids=["real", "meta-init"])
def test_a_reference_swapped_in_place_by_an_assign_load_recomputes_the_cached_value(meta_init: bool) -> None:
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        # No declared dependency: the loaded parameters must not be what tells the cache that something changed.
        if meta_init:
            with torch.device("meta"):
                m = Counted(depends_on=())
        else:
            m = Counted(depends_on=())
        m.table.persist = True
        assert m.table.value.dtype == torch.float32
        state = {
            "_table_ref": torch.empty(0, dtype=torch.float64),
            "weight": torch.ones(3),
            "offsets": torch.zeros(3),
        }
        m.load_state_dict(state, assign=True)
        assert m.table.dtype == torch.float64
        value = m.table.value
        assert value.dtype == torch.float64
        assert value.device == torch.device("cpu")
        assert torch.equal(value, torch.full((3,), 2.0, dtype=torch.float64))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


@pytest.mark.parametrize("enter", [fake_mode, _torch_fake_mode], ids=["modattrs", "torch"])
@pytest.mark.parametrize("cache", [False, True])
def test_a_module_read_inside_a_fake_mode_can_be_converted_in_swap_mode_afterwards(
    enter: Callable[[], Any], cache: bool
) -> None:
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m = Counted(cache=cache)
        with enter() as mode:
            m.table.value
        if isinstance(mode, FakeTensorMode) and type(mode) is FakeTensorMode:
            del mode  # torch's own mode keeps weak references to what it converted while it lives
            gc.collect()  # and lives in reference cycles
        m.to(torch.float64)
        assert m.table.value.dtype == torch.float64
        assert torch.equal(m.table.value, torch.full((3,), 2.0, dtype=torch.float64))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


@pytest.mark.parametrize("in_scope", [False, True], ids=["lasting", "cached-block"])
def test_a_cached_value_follows_a_reference_whose_data_is_replaced_in_place(in_scope: bool) -> None:
    # FSDP2's fully_shard moves buffers with `buffer.data = buffer.to(device)`: the reference object and its
    # TensorImpl stay, the device or dtype changes. (Only a GPU can change the device of real data in place; the
    # dtype takes the same path.)
    m = Counted(cache=not in_scope)
    with modattrs.cached() if in_scope else contextlib.nullcontext():
        assert m.table.value.dtype == torch.float32
        m._table_ref.data = torch.empty(0, dtype=torch.float64)
        value = m.table.value
    assert value.dtype == torch.float64
    assert torch.equal(value, torch.full((3,), 2.0, dtype=torch.float64))


# --- changes that bump no version counter: torch.utils.swap_tensors and `.data =` ---------------------------------


@pytest.mark.parametrize("cache", [True, False], ids=["cached", "uncached"])
def test_a_reference_made_fake_by_swap_tensors_gives_a_fake_value_in_its_mode(cache: bool, value_reader: str) -> None:
    m = Counted(cache=cache, depends_on=())
    assert type(m.table.value) is torch.Tensor
    with fake_mode():
        fake = torch.empty(0)
    torch.utils.swap_tensors(m._table_ref, fake)  # type: ignore[no-untyped-call]
    value = m.table.value
    assert isinstance(value, FakeTensor)
    assert value.fake_mode is m._table_ref.fake_mode


@pytest.mark.parametrize(
    "replacement",
    [
        pytest.param(lambda: torch.empty(0, dtype=torch.float64), id="dtype"),
        pytest.param(lambda: torch.empty(0, device="meta"), id="device"),
    ],
)
def test_a_reference_given_another_dtype_or_device_by_swap_tensors_recomputes_the_cached_value(
    replacement: Callable[[], Tensor], value_reader: str
) -> None:
    m = Counted(depends_on=())
    first = m.table.value
    torch.utils.swap_tensors(m._table_ref, replacement())  # type: ignore[no-untyped-call]
    value = m.table.value
    assert value is not first
    assert (value.dtype, value.device) == (m._table_ref.dtype, m._table_ref.device)


def test_a_dependency_swapped_by_swap_tensors_is_seen_when_its_new_tensorimpl_reuses_the_old_address() -> None:
    m = Counted(depends_on=("offsets",))
    torch.utils.swap_tensors(m.offsets, torch.zeros(3))  # type: ignore[no-untyped-call]
    assert torch.equal(m.table.value, torch.full((3,), 2.0))  # kept with the TensorImpl now in m.offsets
    kept = address_of(m.offsets)
    for step in range(1, 1000):
        # The tensor swapped out holds the previous TensorImpl, freed at once: the allocator may give its address
        # to the next one.
        torch.utils.swap_tensors(m.offsets, torch.full((3,), float(step)))  # type: ignore[no-untyped-call]
        if address_of(m.offsets) == kept:
            assert torch.equal(m.table.value, torch.full((3,), 2.0 + step))
            return
    pytest.skip("the allocator gave no new TensorImpl the address of the one the cache saw")


@pytest.mark.parametrize("scoped", [False, True], ids=["lasting cache", "cached() block"])
@pytest.mark.parametrize("inference", [False, True], ids=["tensor", "inference tensor"])
def test_data_assigned_to_a_dependency_is_seen(inference: bool, scoped: bool) -> None:
    m = Counted(depends_on=("weight",))
    make = (lambda *args: _inference(torch.full, *args)) if inference else torch.full
    with modattrs.cached() if scoped else contextlib.nullcontext():
        assert torch.equal(m.table.value, torch.full((3,), 2.0))
        m.weight.data = make((3,), 5.0)
        assert torch.equal(m.table.value, torch.full((3,), 10.0))
        m.weight.data = make((3,), 7.0)  # an inference tensor's data again: nor has the weight a version now
        assert torch.equal(m.table.value, torch.full((3,), 14.0))
