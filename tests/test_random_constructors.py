"""Random constructors, built eagerly, in fake mode and by ``deferred_init``: never a silently wrong value.

Hypothesis draws a constructor as a list of steps, each something construction code does to its tensors: make one
(from Python numbers, or drawn at random), write into one through dispatch (``fill_``, ``add_``, ``normal_``, a write
through a view, an ``add_`` of another tensor's sum), write into one where dispatch does not show what is written
(``nn.init.trunc_normal_``, an initializer registered with ``register_opaque_init``, ``.data =``), take a view,
turn a tensor into a parameter, deep-copy every tensor at once, read values (``tolist()``) and branch on them. The
module registers what the steps leave as buffers and parameters.

The same constructor, from the same seed, is then built three ways and held to eager construction:

* in :func:`~modattrs.fake.fake_mode`, on the CPU and on spoofed CUDA: every value read, inside the constructor or
  after it, is eager's or refused (``FakeValueError``), never another;
* by :func:`~modattrs.deferred.deferred_init`: reads as in fake mode; a construction that fails leaves the generator
  as it found it; materializing gives eager's values bit for bit, eager's aliasing (which tensors share memory, at
  which offsets), and leaves the generator where eager construction leaves it;
* deep copies of the finished module (fake, deferred, eager), written into through one tensor: the writes reach
  the same tensors as in the eager copy.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, given, note, reject, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from modattrs.deferred import (
    DeferredInitError,
    deferred_init,
    is_deferred,
    materialize_module,
    register_opaque_init,
)
from modattrs.fake import FakeShapeError, FakeValueError, fake_mode

REFUSED = (FakeValueError, FakeShapeError, DeferredInitError)


def noisy_ramp_(tensor: Tensor) -> Tensor:
    """An initializer modattrs cannot see into (registered below): a ramp plus a little noise, written in place."""
    with torch.no_grad():
        ramp = torch.arange(tensor.numel(), dtype=tensor.dtype).view(tensor.shape) * 0.25
        return tensor.copy_(ramp + 0.01 * torch.randn(tensor.shape, dtype=tensor.dtype))


register_opaque_init(sys.modules[__name__], "noisy_ramp_")


# --- the constructors ------------------------------------------------------------------------------------------------

Step = tuple[Any, ...]

MAKERS: dict[str, Callable[[int], Tensor]] = {
    "zeros": lambda n: torch.zeros(n),
    "ones": lambda n: torch.ones(n),
    "arange": lambda n: torch.arange(n, dtype=torch.float32) - 1.5,
    "linspace": lambda n: torch.linspace(-1, 1, n),
    "tensor": lambda n: torch.tensor([0.5 * i - 1 for i in range(n)]),
    "randn": lambda n: torch.randn(n),
    "rand": lambda n: torch.rand(n),
}


def remade(kind: str, like: Tensor) -> Tensor:
    """A new tensor of ``like``'s shape, made as ``MAKERS[kind]`` makes one."""
    return MAKERS[kind](like.numel()).view(like.shape)


def write(kind: str, target: Tensor, other: Tensor) -> None:
    with torch.no_grad():
        if kind == "fill":
            target.fill_(0.75)
        elif kind == "add":
            target.add_(1.5)
        elif kind == "normal":
            nn.init.normal_(target)
        elif kind == "uniform":
            nn.init.uniform_(target, -1, 1)
        elif kind == "trunc_normal":
            nn.init.trunc_normal_(target, std=0.02)
        elif kind == "opaque":
            noisy_ramp_(target)
        elif kind == "tail":
            target.view(-1)[1:].mul_(-2.0)
        elif kind == "sum_of":
            target.add_(other.sum())
        else:
            raise AssertionError(kind)


WRITES = ("fill", "add", "normal", "uniform", "trunc_normal", "opaque", "tail", "sum_of")


class Built(nn.Module):
    """Runs the steps; ``reads`` keeps what each read gave (None: refused)."""

    def __init__(self, steps: list[Step]) -> None:
        super().__init__()
        slots: list[Tensor] = [torch.arange(3, dtype=torch.float32)]
        self.reads: list[Any] = []
        with torch.no_grad():  # as initialization code runs: views and copies of parameters carry no graph
            self._run(slots, steps)

    def _run(self, slots: list[Tensor], steps: list[Step]) -> None:
        for step in steps:
            kind, index = step[0], step[1] % len(slots)
            target = slots[index]
            if kind == "make":
                slots.append(MAKERS[step[2]](step[3]))
            elif kind == "write":
                write(step[2], target, slots[step[3] % len(slots)])
            elif kind == "data":
                target.data = remade(step[2], target)
            elif kind == "slice":
                slots.append(target.view(-1)[1:] if target.numel() > 1 else target.view(-1)[:])
            elif kind == "view":
                slots.append(target.view(1, -1))
            elif kind == "parameter":
                slots[index] = nn.Parameter(target)
            elif kind == "deepcopy":
                slots[:] = copy.deepcopy(slots)
            elif kind == "read":
                self.reads.append(read(target))
            elif kind == "branch":  # eager code that branches on values
                try:
                    positive = bool((target > 0).any())
                except REFUSED:
                    self.reads.append(None)
                else:
                    self.reads.append(positive)
                    if positive:
                        target.mul_(-1)
            else:
                raise AssertionError(kind)
        for number, tensor in enumerate(slots):
            if isinstance(tensor, nn.Parameter) and not any(tensor is p for p in self.parameters()):
                self.register_parameter(f"p{number}", tensor)
            elif not isinstance(tensor, nn.Parameter):
                self.register_buffer(f"b{number}", tensor)


def read(tensor: Tensor) -> Any:
    """``tensor.tolist()``, or None where it is refused. Under no_grad: torch's ``FakeTensor.tolist`` reads row by row
    through ``unbind``, which autograd refuses on a view made under no_grad of a tensor written since."""
    try:
        with torch.no_grad():
            return tensor.tolist()
    except REFUSED:
        return None


sizes = st.integers(1, 6)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("make"), st.just(0), st.sampled_from(sorted(MAKERS)), sizes),
        st.tuples(st.just("write"), st.integers(0, 20), st.sampled_from(WRITES), st.integers(0, 20)),
        st.tuples(st.just("data"), st.integers(0, 20), st.sampled_from(sorted(MAKERS))),
        st.tuples(st.sampled_from(["slice", "view", "parameter", "read", "branch"]), st.integers(0, 20)),
        st.tuples(st.just("deepcopy"), st.just(0)),
    ),
    max_size=14,
)


# --- oracles ---------------------------------------------------------------------------------------------------------


@dataclass
class Eager:
    module: Built
    state_after: Tensor  # the generator after construction
    tensors: dict[str, Tensor]  # clones of every parameter and buffer, by name


def build_eager(seed: int, program: list[Step]) -> Eager:
    torch.manual_seed(seed)
    try:
        return snapshot(Built(program))
    except RuntimeError:  # a program eager code refuses (autograd's rules for views made under no_grad): none to hold
        reject()


def eager_copies_written(eager: Eager) -> dict[str, Eager]:
    """For each buffer, a deep copy of the eager module written through it."""
    try:
        return {name: snapshot(written_through_a_copy(eager.module, name)) for name in eager.tensors if name[0] == "b"}
    except RuntimeError:  # as above: deepcopy asks is_leaf, which autograd refuses for some views made under no_grad
        reject()


def snapshot(module: nn.Module) -> Eager:
    """The module, the generator now, and clones of its tensors."""
    assert isinstance(module, Built)
    return Eager(module, torch.get_rng_state(), {name: t.detach().clone() for name, t in tensors_of(module).items()})


def tensors_of(module: nn.Module) -> dict[str, Tensor]:
    return dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))


def layout(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Each tensor's storage, numbered by first appearance, and its offset from the lowest offset of the module's
    tensors on that storage: which tensors share memory, and where, relative to each other. (Not the absolute
    offset: a replay may make only the part of a storage that the module's tensors still view.)"""
    storages: dict[int, int] = {}
    lowest: dict[int, int] = {}
    for tensor in tensors_of(module).values():
        key = tensor.untyped_storage()._cdata
        lowest[key] = min(lowest.get(key, tensor.storage_offset()), tensor.storage_offset())
    return {
        name: (
            storages.setdefault(tensor.untyped_storage()._cdata, len(storages)),
            tensor.storage_offset() - lowest[tensor.untyped_storage()._cdata],
        )
        for name, tensor in sorted(tensors_of(module).items())
    }


def sharing(module: nn.Module) -> set[frozenset[str]]:
    """The groups of names whose tensors share a storage."""
    groups: dict[Any, set[str]] = {}
    for name, (storage, _) in layout(module).items():
        groups.setdefault(storage, set()).add(name)
    return {frozenset(group) for group in groups.values()}


def assert_reads_agree(eager: list[Any], other: list[Any], where: str) -> None:
    assert len(eager) == len(other), where
    for number, (expected, got) in enumerate(zip(eager, other, strict=True)):
        assert got is None or got == expected, f"{where}: read {number} gave {got}, eager {expected}"


def assert_values_agree_or_refuse(eager: Eager, module: nn.Module, where: str) -> None:
    for name, tensor in tensors_of(module).items():
        got = read(tensor)
        assert got is None or got == eager.tensors[name].tolist(), (
            f"{where}: {name} reads {got}, eager {eager.tensors[name].tolist()}"
        )


def written_through_a_copy(module: nn.Module, name: str) -> nn.Module:
    duplicate = copy.deepcopy(module)
    with torch.no_grad():
        getattr(duplicate, name).fill_(9.0)
    return duplicate


# --- the properties --------------------------------------------------------------------------------------------------


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@given(program=steps, seed=st.integers(0, 2**16))
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
def test_fake_construction_reads_eager_values_or_refuses(program: list[Step], seed: int, device: str) -> None:
    if currently_in_test_context():
        note(f"program: {program}")
    eager = build_eager(seed, program)
    written = eager_copies_written(eager)
    torch.manual_seed(seed)
    with fake_mode(fake_cuda=device == "cuda"), torch.device(device):
        fake = Built(program)
        assert_reads_agree(eager.module.reads, fake.reads, f"fake {device}, in the constructor")
        assert_values_agree_or_refuse(eager, fake, f"fake {device}, after construction")
        assert sharing(fake) == sharing(eager.module)
        for name, expected in written.items():
            duplicate = written_through_a_copy(fake, name)
            assert sharing(duplicate) == sharing(expected.module), f"fake {device}, deep copy written through {name}"
            assert_values_agree_or_refuse(expected, duplicate, f"fake {device}, deep copy written through {name}")


@given(program=steps, seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_deferred_construction_materializes_eager_values_aliasing_and_generator(program: list[Step], seed: int) -> None:
    if currently_in_test_context():
        note(f"program: {program}")
    eager = build_eager(seed, program)
    eager_copies_written(eager)
    torch.manual_seed(seed)
    before = torch.get_rng_state()
    try:
        deferred = deferred_init(Built, program)
    except REFUSED:
        # construction branched on a value nothing can know without drawing: refused, and the generator untouched
        assert torch.equal(torch.get_rng_state(), before)
        return
    assert_reads_agree(eager.module.reads, deferred.reads, "deferred, in the constructor")
    copies = {name: written_through_a_copy(deferred, name) for name in tensors_of(deferred) if name.startswith("b")}
    materialize_module(deferred)
    assert not is_deferred(deferred)
    assert torch.equal(torch.get_rng_state(), eager.state_after)
    for name, tensor in tensors_of(deferred).items():
        assert torch.equal(tensor, eager.tensors[name]), name
    assert layout(deferred) == layout(eager.module)
    for name, duplicate in copies.items():
        materialize_module(duplicate)
        expected = written_through_a_copy(eager.module, name)
        assert layout(duplicate) == layout(expected), f"deep copy written through {name}"
        for other, tensor in tensors_of(duplicate).items():
            assert torch.equal(tensor, tensors_of(expected)[other]), f"deep copy written through {name}: {other}"
