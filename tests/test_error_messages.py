"""The shape of long error messages, as torch.nn.utils.parametrize gives its longest ones: a first line saying what
went wrong and to which attribute, argument or operation, then the values, the options and what to do, each on a
line of its own. A message of one line stays within the first line's limit."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor
from modattrs._cli.commands import main
from modattrs._fake import cuda_guard
from modattrs.deferred import DeferredInitError, deferred_init, materialize_module, register_opaque_init
from modattrs.fake import GPU, FakeValueError, fake_mode

#: The longest first line: the cause and what it concerns, read at a glance.
FIRST_LINE = 160
#: The longest of the lines after it (values, options, what to do).
ANY_LINE = 200


def table(module: nn.Module, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.ones(2, dtype=dtype, device=device)


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        VirtualTensor(self, "table", table, cache=True, depends_on=("weight",))


class ReadsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(3))
        self.positive = self.weight.sum().item() > 0


class WritesWhatItIsGiven(nn.Module):
    def __init__(self, given: Tensor) -> None:
        super().__init__()
        self.register_buffer("scaled", given.mul_(2))


class BuiltInFakeMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with fake_mode():
            self.layer = nn.Linear(2, 2)


def shaped_parameter_not_persisted() -> None:
    ShapedTensor(nn.Module(), "cache", nn.Parameter(torch.zeros(2, 3)), {1: 3}, persist_data=False)


def shaped_constraints_key_taken() -> None:
    module = nn.Module()
    ShapedTensor(module, "cache", torch.zeros(2, 3), {1: 3}, persist_constraints=True)
    module.register_buffer("_cache_constraints", torch.arange(4))
    module.state_dict()


def virtual_owner_gone() -> None:
    attribute = Rotary().table
    gc.collect()
    attribute.value


def virtual_alias_taken() -> None:
    rotary, layer = Rotary(), nn.Module()
    layer.table = rotary.table
    VirtualTensor(layer, "table", table)


def virtual_integer_following_the_dtype() -> None:
    VirtualTensor(nn.Module(), "positions", table, dtype=torch.int64, follow_dtype=True)


def virtual_reference_name_taken() -> None:
    module = nn.Module()
    VirtualTensor(module, "table", table)
    module.register_buffer("_table_ref", torch.arange(5))
    module.table.value


def virtual_dependency_gone() -> None:
    module = Rotary()
    module.table.value
    del module.weight
    module.table.value


def fake_value_read() -> None:
    with fake_mode():
        torch.rand(3).sum().item()


def fake_gpu_without_memory() -> None:
    GPU("broken", major=9, minor=0, total_memory=0, multi_processor_count=132)


def fake_cuda_without_a_compiler() -> None:
    with fake_mode(fake_cuda=True):
        pass


def deferred_inside_deferred() -> None:
    deferred_init(lambda: deferred_init(nn.Linear, 2, 2))


def deferred_value_read() -> None:
    deferred_init(ReadsValues)


def deferred_write_into_a_real_tensor() -> None:
    deferred_init(WritesWhatItIsGiven, torch.arange(4.0))


def deferred_not_recorded() -> None:
    materialize_module(deferred_init(BuiltInFakeMode))


def deferred_materialized_on_meta() -> None:
    materialize_module(deferred_init(nn.Linear, 2, 2), device="meta")


def deferred_opaque_builtin() -> None:
    register_opaque_init(torch, "rand")


#: Each long error: what triggers it, its type, and what its first line must name.
LONG_ERRORS: dict[str, tuple[Callable[[], None], type[Exception], str]] = {
    "ShapedTensor: a parameter that persist_data=False cannot leave out": (
        shaped_parameter_not_persisted,
        ValueError,
        "ShapedTensor 'cache'",
    ),
    "ShapedTensor: a tensor under its constraints key": (
        shaped_constraints_key_taken,
        RuntimeError,
        "ShapedTensor 'cache'",
    ),
    "VirtualTensor: an owner that is gone": (virtual_owner_gone, ReferenceError, "VirtualTensor 'table'"),
    "VirtualTensor: a name an alias holds": (virtual_alias_taken, ValueError, "VirtualTensor 'table'"),
    "VirtualTensor: an integer value following the dtype": (
        virtual_integer_following_the_dtype,
        ValueError,
        "VirtualTensor 'positions'",
    ),
    "VirtualTensor: a tensor under its reference name": (
        virtual_reference_name_taken,
        RuntimeError,
        "VirtualTensor 'table'",
    ),
    "VirtualTensor: a dependency that is gone": (virtual_dependency_gone, AttributeError, "VirtualTensor 'table'"),
    "fake mode: a value read": (fake_value_read, FakeValueError, ".item()"),
    "fake mode: a GPU without memory": (fake_gpu_without_memory, ValueError, "GPU 'broken'"),
    "fake mode: fake CUDA without a compiler": (fake_cuda_without_a_compiler, RuntimeError, "fake CUDA"),
    "deferred init: a call inside another": (deferred_inside_deferred, DeferredInitError, "deferred_init("),
    "deferred init: a value read while recording": (deferred_value_read, DeferredInitError, ".item()"),
    "deferred init: a write into a real tensor": (deferred_write_into_a_real_tensor, DeferredInitError, "aten.mul_"),
    "deferred init: a fake tensor no record made": (
        deferred_not_recorded,
        DeferredInitError,
        "parameter 'layer.weight'",
    ),
    "deferred init: materializing on meta": (deferred_materialized_on_meta, ValueError, "device='meta'"),
    "deferred init: an opaque builtin": (deferred_opaque_builtin, TypeError, "register_opaque_init: torch.rand"),
}


def assert_shaped(message: str, names: str) -> None:
    lines = message.splitlines()
    assert len(lines) > 1, f"a long message on one line: {message!r}"
    assert len(lines[0]) <= FIRST_LINE, f"a first line of {len(lines[0])} characters: {lines[0]!r}"
    assert names in lines[0], f"a first line that does not name {names!r}: {lines[0]!r}"
    for line in lines[1:]:
        assert line.strip(), f"an empty line: {message!r}"
        assert len(line) <= ANY_LINE, f"a line of {len(line)} characters: {line!r}"


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake CUDA on a CPU-only build of torch whose device guard could not be compiled."""
    monkeypatch.setattr(cuda_guard, "_ready", False)
    monkeypatch.setattr(cuda_guard, "_failure", "FileNotFoundError: [Errno 2] No such file or directory: 'c++'")
    monkeypatch.setattr(cuda_guard, "cuda_built", lambda: False)


@pytest.mark.parametrize("case", LONG_ERRORS)
def test_a_long_error_says_what_went_wrong_and_to_what_on_a_short_first_line_and_the_rest_on_lines_of_their_own(
    case: str, no_compiler: None
) -> None:
    trigger, error, names = LONG_ERRORS[case]
    with pytest.raises(error) as raised:
        trigger()
    assert_shaped(str(raised.value), names)


def test_a_long_load_state_dict_error_keeps_the_lines_of_its_entry_indented_under_it() -> None:
    module = nn.Module()
    ShapedTensor(module, "cache", torch.zeros(2, 3), {1: 3})
    with pytest.raises(RuntimeError) as raised:
        module.load_state_dict({"_cache_data": torch.empty(4, 3, device="meta")})
    header, entry, *rest = str(raised.value).splitlines()
    assert header == "Error(s) in loading state_dict for Module:"
    assert entry.startswith("\t_cache_data: cannot load the saved data: it has no values (on meta)")
    assert rest == ["\t  Load with assign=True, or load a checkpoint with values"]


def test_a_long_command_line_error_is_reported_on_lines_of_its_own_without_a_traceback(
    no_compiler: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("modattrs inspect: error: --device cuda: ")
    assert_shaped(captured.err, "--device cuda")
    assert "Traceback" not in captured.err


def test_a_short_error_stays_on_one_line() -> None:
    with pytest.raises(ValueError, match="violates the constraints") as raised:
        ShapedTensor(nn.Module(), "cache", torch.zeros(2, 3), {1: 4})
    message = str(raised.value)
    assert "\n" not in message
    assert len(message) <= FIRST_LINE
