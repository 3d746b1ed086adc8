"""Materializing a deferred module wherever and however often it is asked for: inside fake modes, inside another
``deferred_init``, on any device spelling torch accepts, twice from one record, and right after an error that said
to materialize first."""

from __future__ import annotations

import contextlib
import copy
import gc
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from modattrs._fake import cuda_guard
from modattrs.deferred import DeferredInitError, deferred_init, is_deferred, materialize_module, materialize_tensor
from modattrs.fake import fake_mode, is_fake
from tests.deferred_models import DeepCopied, OwnGenerator, Stack, Tied
from tests.test_deferred import assert_bit_identical, tensors_of


def normalized_block() -> nn.Module:
    """Random weights and the buffers of a batch norm (``num_batches_tracked`` is ``torch.tensor(0)``, then zeroed)."""
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def eager(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def deferred(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return deferred_init(build)


def assert_all_real(module: nn.Module) -> None:
    fakes = [name for name, tensor in tensors_of(module).items() if is_fake(tensor)]
    assert not fakes, f"still fake: {fakes}"
    assert not is_deferred(module)


# --- inside fake modes ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def torch_fake_mode() -> Iterator[None]:
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


@contextlib.contextmanager
def spoofed_cuda() -> Iterator[None]:
    try:
        cuda_guard.require()
    except RuntimeError as error:
        pytest.skip(f"fake CUDA cannot be set up here: {error}")
    with fake_mode(fake_cuda=True):
        yield


@contextlib.contextmanager
def meta_default_device() -> Iterator[None]:
    with torch.device("meta"):
        yield


MODES: dict[str, Callable[[], contextlib.AbstractContextManager[object]]] = {
    "fake_mode()": fake_mode,
    "fake_mode(fake_cuda=True)": spoofed_cuda,
    "torch's own FakeTensorMode": torch_fake_mode,
    "torch.device('meta')": meta_default_device,
}


def whole(module: nn.Module) -> None:
    materialize_module(module)


def batch_norms_then_the_rest(module: nn.Module) -> None:
    materialize_module(module, check_fn=lambda sub: isinstance(sub, nn.BatchNorm1d))
    materialize_module(module)


def buffers_then_the_rest(module: nn.Module) -> None:
    materialize_module(module, buffers_only=True)
    materialize_module(module)


def one_tensor_at_a_time(module: nn.Module) -> None:
    for tensor in list(tensors_of(module).values()):
        materialize_tensor(tensor)


WAYS: dict[str, Callable[[nn.Module], None]] = {
    "whole": whole,
    "check_fn, then the rest": batch_norms_then_the_rest,
    "buffers_only, then the rest": buffers_then_the_rest,
    "materialize_tensor, one at a time": one_tensor_at_a_time,
}


@pytest.mark.parametrize("way", WAYS.values(), ids=WAYS.keys())
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_materializing_inside_a_fake_mode_gives_real_eager_values(
    mode: Callable[[], contextlib.AbstractContextManager[object]], way: Callable[[nn.Module], None]
) -> None:
    expected = eager(normalized_block)
    module = deferred(normalized_block)
    with mode():
        way(module)
    assert_all_real(module)
    assert_bit_identical(expected, module)


def test_a_cuda_record_materialized_inside_spoofed_cuda_says_there_is_no_cuda_device_and_stays_deferred() -> None:
    if cuda_guard.gpu_present():
        pytest.skip("this machine has a GPU: nothing is spoofed")
    expected = eager(lambda: nn.Linear(2, 2))
    with spoofed_cuda():
        module = deferred(lambda: nn.Linear(2, 2, device="cuda"))
        with pytest.raises(DeferredInitError, match="this machine has no CUDA device; pass device='cpu'"):
            materialize_module(module)
        assert is_deferred(module)
        materialize_module(module, device="cpu")
    assert_all_real(module)
    assert_bit_identical(expected, module)


def test_materializing_inside_the_function_deferred_init_records_gives_real_eager_values() -> None:
    expected = eager(normalized_block)
    inner = deferred(normalized_block)

    def build() -> nn.Module:
        materialize_module(inner)
        return nn.Sequential(inner, nn.Linear(4, 2))

    outer = deferred_init(build)
    assert_all_real(inner)
    assert_bit_identical(expected, inner)
    assert is_deferred(outer[1].weight)
    materialize_module(outer)
    assert_all_real(outer)
    assert_bit_identical(expected, inner)


# --- a record is never changed by replaying it ------------------------------------------------------------------------


class Holder(nn.Module):
    def __init__(self, value: Tensor) -> None:
        super().__init__()
        self.register_buffer("value", value)


class SharesAChangedConstant(nn.Module):
    """A ``torch.tensor`` changed in place in ``__init__``, then used by two submodules, each holding a result."""

    def __init__(self) -> None:
        super().__init__()
        start = torch.tensor(5)
        start.add_(1)
        self.first = Holder(start * 2)
        self.second = Holder(start + 3)
        self.both = Holder(start)
        start.mul_(7)


class ViewsWhatItIsGiven(nn.Module):
    """Holds a view of a real tensor it is given, as eager code would: the replay returns that tensor's memory."""

    def __init__(self, given: Tensor) -> None:
        super().__init__()
        self.register_buffer("table", given.view(2, 2))
        self.linear = nn.Linear(2, 2)


GIVEN = [0.5, 1.5, -2.0, 4.0]


def views_what_it_is_given() -> nn.Module:
    return ViewsWhatItIsGiven(torch.tensor(GIVEN))


def test_a_deep_copy_of_a_deferred_batch_norm_materializes_after_the_original_as_model_ema_does() -> None:
    expected = eager(lambda: nn.BatchNorm2d(4))
    module = deferred(lambda: nn.BatchNorm2d(4))
    ema = copy.deepcopy(module)
    materialize_module(module)
    materialize_module(ema)
    assert_bit_identical(expected, module)
    assert_bit_identical(expected, ema)


def test_a_constant_changed_in_place_in_init_materializes_one_submodule_at_a_time() -> None:
    expected = eager(SharesAChangedConstant)
    module = deferred(SharesAChangedConstant)
    for part in (module.first, module.second, module.both):
        materialize_module(part)
    assert_all_real(module)
    assert_bit_identical(expected, module)


def test_a_view_of_a_real_tensor_given_to_the_constructor_can_be_trained_in_place_and_materialized_again() -> None:
    expected = eager(views_what_it_is_given)
    given = torch.tensor(GIVEN)
    module = deferred(lambda: ViewsWhatItIsGiven(given))
    twin = copy.deepcopy(module)
    materialize_module(module)
    assert_bit_identical(expected, module)
    module.table.add_(1)  # a step of training, in place
    materialize_module(twin)
    assert_bit_identical(expected, twin)
    assert torch.equal(given, torch.tensor(GIVEN))


def first_with_tensors(module: nn.Module) -> nn.Module:
    return next(
        sub
        for sub in module.modules()
        if any(True for _ in sub.named_parameters(recurse=False)) or any(True for _ in sub.named_buffers(recurse=False))
    )


RECORDS: dict[str, Callable[[], nn.Module]] = {
    "batch norm": normalized_block,
    "a constant changed in place": SharesAChangedConstant,
    "a view of a real tensor given": views_what_it_is_given,
    "stack": Stack,
    "tied": Tied,
    "deep-copied layers": DeepCopied,
    "own generator": OwnGenerator,
}


@pytest.mark.parametrize("build", RECORDS.values(), ids=RECORDS.keys())
def test_replaying_a_record_twice_a_copy_then_part_then_all_gives_eager_values_and_leaves_the_generator_as_eager(
    build: Callable[[], nn.Module],
) -> None:
    expected = eager(build, seed=3)
    torch.rand(10)
    after_eager = torch.get_rng_state()
    module = deferred(build, seed=3)
    twin = copy.deepcopy(module)
    torch.rand(10)  # draws in between come after the module's, as in eager code, and change none of its values
    materialize_module(twin)
    materialize_module(module, check_fn=lambda sub: sub is first_with_tensors(module))
    materialize_module(module)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert_all_real(module)
    assert_all_real(twin)
    assert_bit_identical(expected, module)
    assert_bit_identical(expected, twin)


# --- an error saying to materialize first lets materializing work at once ---------------------------------------------


READS: dict[str, Callable[[Tensor], object]] = {
    "tolist of a matrix": lambda tensor: tensor.tolist(),
    "tolist of a vector": lambda tensor: tensor[0].tolist(),
    "float": lambda tensor: float(tensor[0, 0]),
    "int": lambda tensor: int(tensor.sum()),
    "item": lambda tensor: tensor.mean().item(),
}


@contextlib.contextmanager
def no_garbage_collection() -> Iterator[None]:
    """So that nothing a reference cycle holds goes away by luck."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_materializing_right_after_a_caught_value_read_error_works(read: Callable[[Tensor], object]) -> None:
    expected = eager(normalized_block)
    with no_garbage_collection():
        module = deferred(normalized_block)
        with pytest.raises(
            DeferredInitError, match=r"\nCall modattrs\.deferred\.materialize_module on its module first"
        ):
            read(module[0].weight)
        materialize_module(module)
    assert_bit_identical(expected, module)


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_materializing_while_the_value_read_error_is_still_kept_works(read: Callable[[Tensor], object]) -> None:
    # As pytest.raises(...) as info, a logger or `kept = error` keep it: its traceback holds views of the tensor.
    expected = eager(normalized_block)
    with no_garbage_collection():
        module = deferred(normalized_block)
        with pytest.raises(DeferredInitError) as info:
            read(module[0].weight)
        kept = info.value
        materialize_module(module)
        assert kept.__traceback__ is not None  # the error is whole: only torch's and modattrs' finished frames cleared
    assert_bit_identical(expected, module)


@pytest.mark.parametrize("read", READS.values(), ids=READS.keys())
def test_materializing_inside_the_handler_of_a_value_read_error_works(read: Callable[[Tensor], object]) -> None:
    expected = eager(normalized_block)
    with no_garbage_collection():
        module = deferred(normalized_block)
        try:
            read(module[0].weight)
        except DeferredInitError:
            materialize_module(module)
            assert read(module[0].weight) == read(expected[0].weight)
    assert_bit_identical(expected, module)


INTERACTIVE = """
import gc
gc.disable()
import torch
from torch import nn
from modattrs.deferred import deferred_init, materialize_module, is_deferred
module = deferred_init(nn.Linear, 3, 3)
module.weight.tolist()
materialize_module(module)
print("deferred:", is_deferred(module))
"""


def test_materializing_after_a_value_read_error_printed_by_the_interactive_interpreter_works() -> None:
    result = subprocess.run(
        [sys.executable, "-i", "-q"], input=textwrap.dedent(INTERACTIVE), capture_output=True, text=True, timeout=300
    )
    assert "\nCall modattrs.deferred.materialize_module on its module first" in result.stderr
    assert "other tensors hold it" not in result.stderr, result.stderr[-3000:]
    assert "deferred: False" in result.stdout


# --- devices ----------------------------------------------------------------------------------------------------------


def test_materializing_on_cpu_with_an_index_puts_the_tensors_where_torch_puts_them() -> None:
    expected = eager(normalized_block)
    module = deferred(normalized_block)
    materialize_module(module, device="cpu:1")
    assert_all_real(module)
    assert {tensor.device for tensor in tensors_of(module).values()} == {torch.empty(0, device="cpu:1").device}
    assert_bit_identical(expected, module)


class OnIndexedCpu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3, device="cpu:1"))
        self.register_buffer("ones", torch.ones(2, device=torch.device("cpu", 1)))


def test_a_record_made_on_cpu_with_an_index_materializes_where_eager_code_puts_the_tensors() -> None:
    expected = eager(OnIndexedCpu)
    module = deferred(OnIndexedCpu)
    materialize_module(module)
    assert_all_real(module)
    assert_bit_identical(expected, module)


def device_types_torch_accepts() -> list[str]:
    candidates = [
        "cpu", "cpu:1", "cuda", "cuda:1", "mps", "xpu", "xla", "meta", "hpu", "ve", "ipu", "mtia", "maia", "lazy",
        "vulkan", "hip", "fpga", "privateuseone", "mkldnn", "ideep", "opengl", "opencl", "ort",
    ]  # fmt: skip
    accepted = []
    for name in candidates:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # 'mkldnn' is no longer used as device type
                torch.device(name)
        except RuntimeError:
            continue
        accepted.append(name)
    return accepted


@pytest.mark.filterwarnings("ignore:'mkldnn' is no longer used as device type")
@pytest.mark.parametrize("device", device_types_torch_accepts())
def test_any_device_torch_accepts_materializes_there_or_says_why_not_naming_the_argument(device: str) -> None:
    expected = eager(normalized_block)
    module = deferred(normalized_block)
    try:
        materialize_module(module, device=device)
    except (DeferredInitError, ValueError) as error:
        message = str(error)
        assert message.startswith("materialize_module: ") or "pass device='cpu'" in message.lower(), message
        assert repr(device) in message or str(torch.device(device)) in message, message
        assert "bug in modattrs" not in message
        assert is_deferred(module)
        assert all(is_fake(tensor) for tensor in tensors_of(module).values())
        return
    assert_all_real(module)
    where = torch.empty(0, device=device).device
    assert {tensor.device for tensor in tensors_of(module).values()} == {where}
    if where.type == "cpu":
        assert_bit_identical(expected, module)
