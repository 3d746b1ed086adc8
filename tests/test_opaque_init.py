"""modattrs.deferred.register_opaque_init: registered initializers keep how they are called, and builtins are refused
with what to do instead."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from modattrs.deferred import deferred_init, is_deferred, materialize_module, register_opaque_init
from modattrs.fake import is_fake
from tests.deferred_models import rejection_sample_


def owner_of(kind: str) -> tuple[Any, int]:
    """A new owner of ``sample_(tensor, limit)`` stored as ``kind``, and the index ``mutates`` of ``tensor``."""
    if kind == "staticmethod":

        class Static:
            @staticmethod
            def sample_(tensor: Tensor, limit: float) -> Tensor:
                return rejection_sample_(tensor, limit)

        return Static, 0
    if kind == "classmethod":

        class WithClassmethod:
            scale = 1.0

            @classmethod
            def sample_(cls, tensor: Tensor, limit: float) -> Tensor:
                return rejection_sample_(tensor, limit * cls.scale)

        return WithClassmethod, 0
    if kind == "method":

        class WithMethod:
            def sample_(self, tensor: Tensor, limit: float) -> Tensor:
                assert isinstance(self, WithMethod)
                return rejection_sample_(tensor, limit)

        return WithMethod, 1
    if kind == "functools.partial on a class":

        class WithPartial:
            sample_ = functools.partial(rejection_sample_)

        return WithPartial, 0
    if kind == "functools.partialmethod":

        class WithPartialmethod:
            sample_ = functools.partialmethod(lambda self, tensor, limit: rejection_sample_(tensor, limit))

        return WithPartialmethod, 1
    if kind == "metaclass method":

        class Meta(type):
            def sample_(cls, tensor: Tensor, limit: float) -> Tensor:
                return rejection_sample_(tensor, limit)

        class WithMetaclass(metaclass=Meta):
            pass

        return WithMetaclass, 0
    module = types.ModuleType("initializers")
    module.sample_ = lambda tensor, limit: rejection_sample_(tensor, limit)  # type: ignore[attr-defined]
    return module, 0


# Every way of calling each kind: through its owner, and through an instance of a class.
CALLS: dict[str, Callable[[Any, Tensor, float], Tensor]] = {
    "staticmethod through the class": lambda owner, t, limit: owner.sample_(t, limit),
    "staticmethod through an instance": lambda owner, t, limit: owner().sample_(t, limit),
    "classmethod through the class": lambda owner, t, limit: owner.sample_(t, limit),
    "classmethod through an instance": lambda owner, t, limit: owner().sample_(t, limit),
    "method through the class": lambda owner, t, limit: owner.sample_(owner(), t, limit),
    "method through an instance": lambda owner, t, limit: owner().sample_(t, limit),
    "functools.partial on a class through the class": lambda owner, t, limit: owner.sample_(t, limit),
    "functools.partial on a class through an instance": lambda owner, t, limit: owner().sample_(t, limit),
    "functools.partialmethod through the class": lambda owner, t, limit: owner.sample_(owner(), t, limit),
    "functools.partialmethod through an instance": lambda owner, t, limit: owner().sample_(t, limit),
    "metaclass method through the class": lambda owner, t, limit: owner.sample_(t, limit),
    "module function through the module": lambda owner, t, limit: owner.sample_(t, limit),
}


def kind_of(call: str) -> str:
    return call.partition(" through ")[0]


class Sampled(nn.Module):
    weight: nn.Parameter

    def __init__(self, owner: Any, call: Callable[[Any, Tensor, float], Tensor]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(50))
        call(owner, self.weight, 1.0)
        self.after = nn.Parameter(torch.rand(3))  # drawn after the registered call


def bits(tensor: Tensor) -> Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


@pytest.mark.parametrize("call", CALLS)
def test_a_registered_initializer_outside_deferred_init_is_called_as_before_registering(call: str) -> None:
    owner, mutates = owner_of(kind_of(call))
    torch.manual_seed(0)
    expected = CALLS[call](owner, torch.empty(50), 0.5)
    register_opaque_init(owner, "sample_", mutates=mutates)
    torch.manual_seed(0)
    real = torch.empty(50)
    assert CALLS[call](owner, real, 0.5) is real
    assert torch.equal(bits(real), bits(expected))


@pytest.mark.parametrize("call", CALLS)
def test_a_registered_initializer_called_in_deferred_init_is_replayed_bit_identically(call: str) -> None:
    owner, mutates = owner_of(kind_of(call))
    register_opaque_init(owner, "sample_", mutates=mutates)
    torch.manual_seed(0)
    eager = Sampled(owner, CALLS[call])
    torch.rand(100)
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = deferred_init(Sampled, owner, CALLS[call])
    assert is_deferred(deferred)
    torch.rand(100)  # draws in between come after the module's, as in eager code, and change none of its values
    materialize_module(deferred)
    assert torch.equal(torch.get_rng_state(), after_eager)
    for name, tensor in eager.named_parameters():
        got = getattr(deferred, name)
        assert not is_fake(got)
        assert torch.equal(bits(got), bits(tensor)), name
    assert deferred.weight.abs().max() <= 1.0


def test_a_registered_classmethod_called_through_a_subclass_is_given_the_subclass() -> None:
    base, _ = owner_of("classmethod")
    subclass = type("Halved", (base,), {"scale": 0.5})
    register_opaque_init(base, "sample_")
    for call in (CALLS["classmethod through the class"], CALLS["classmethod through an instance"]):
        assert call(subclass, torch.empty(50), 1.0).abs().max() <= 0.5
        deferred = deferred_init(Sampled, subclass, call)
        assert materialize_module(deferred).weight.abs().max() <= 0.5


def test_register_opaque_init_on_a_subclass_leaves_its_base_alone() -> None:
    base, _ = owner_of("staticmethod")
    subclass = type("Sub", (base,), {})
    stored = inspect.getattr_static(base, "sample_")
    register_opaque_init(subclass, "sample_")
    assert inspect.getattr_static(base, "sample_") is stored
    assert isinstance(inspect.getattr_static(subclass, "sample_"), staticmethod)
    assert subclass().sample_(torch.empty(5), 0.5).abs().max() <= 0.5


@pytest.mark.parametrize(("owner", "name"), [(torch.Tensor, "uniform_"), (torch, "rand"), (torch.Tensor, "fill_")])
def test_register_opaque_init_refuses_a_builtin_saying_to_wrap_it_in_a_python_function(owner: Any, name: str) -> None:
    stored = inspect.getattr_static(owner, name)
    with pytest.raises(TypeError) as raised:
        register_opaque_init(owner, name)
    message = str(raised.value)
    assert message.startswith("register_opaque_init: ")
    assert f"{owner.__name__}.{name} is a " in message.splitlines()[0]
    assert "\nIt needs a Python function whose signature can be read" in message
    assert "wrap it in a Python function" in message
    assert "recorded already" in message
    assert inspect.getattr_static(owner, name) is stored  # torch is as it was


def test_a_builtin_wrapped_in_a_python_function_can_be_registered() -> None:
    class Init:
        @staticmethod
        def uniform_(tensor: Tensor, low: float, high: float) -> Tensor:
            with torch.no_grad():
                return tensor.uniform_(low, high)

    register_opaque_init(Init, "uniform_")

    def call(owner: Any, tensor: Tensor, limit: float) -> Tensor:
        return owner().uniform_(tensor, -limit, limit)  # type: ignore[no-any-return]

    torch.manual_seed(0)
    eager = Sampled(Init, call)
    torch.manual_seed(0)
    materialized = materialize_module(deferred_init(Sampled, Init, call))
    assert torch.equal(bits(materialized.weight), bits(eager.weight))


class BoundToNothing:
    """A descriptor that hands out its function bound to ``None``, as no function, staticmethod or classmethod does."""

    def __init__(self, function: Callable[..., Tensor]) -> None:
        self.function = function

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., Tensor]:
        return functools.partial(self.function, None)


def test_register_opaque_init_refuses_a_descriptor_it_cannot_bind_as_the_original_did() -> None:
    class WithDescriptor:
        sample_ = BoundToNothing(lambda _, tensor, limit: rejection_sample_(tensor, limit))

    stored = inspect.getattr_static(WithDescriptor, "sample_")
    with pytest.raises(TypeError, match="BoundToNothing, a descriptor whose binding") as raised:
        register_opaque_init(WithDescriptor, "sample_")
    assert "staticmethod, a classmethod or a function" in str(raised.value)
    assert inspect.getattr_static(WithDescriptor, "sample_") is stored
