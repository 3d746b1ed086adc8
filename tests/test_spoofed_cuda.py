"""Spoofed CUDA answers model code's questions about the GPU: torch.cuda inside fake_mode(fake_cuda=True)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from modattrs.fake import A100, GPU, H100, fake_copy, fake_mode, is_fake

QUERIES = ("is_available", "device_count", "current_device", "get_device_name", "get_device_capability")


def torchs_answers() -> dict[str, object]:
    """What torch.cuda answers here outside any spoofed block: its error where it raises one."""
    answers: dict[str, object] = {}
    for name in QUERIES:
        try:
            answers[name] = getattr(torch.cuda, name)()
        except (RuntimeError, AssertionError) as error:
            answers[name] = type(error)
    return answers


def test_inside_fake_cuda_torch_cuda_describes_eight_80gb_h100s_by_default() -> None:
    with fake_mode(fake_cuda=True):
        assert torch.cuda.is_available()
        assert torch.cuda.device_count() == 8
        assert torch.cuda.current_device() == 0
        assert torch.cuda.get_device_name() == torch.cuda.get_device_name("cuda:7") == "NVIDIA H100 80GB HBM3"
        assert torch.cuda.get_device_capability(torch.device("cuda", 3)) == (9, 0)
        properties = torch.cuda.get_device_properties(1)
    assert (properties.name, properties.major, properties.minor) == (H100.name, H100.major, H100.minor)
    assert 80e9 < properties.total_memory < 86e9
    assert properties.multi_processor_count == 132


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU answers for itself outside the block")
def test_torch_cuda_answers_as_before_after_the_block_and_in_other_threads_during_it() -> None:
    before = torchs_answers()
    seen_by_another_thread: list[dict[str, object]] = []
    with fake_mode(fake_cuda=True):
        thread = threading.Thread(target=lambda: seen_by_another_thread.append(torchs_answers()))
        thread.start()
        thread.join()
        assert torch.cuda.is_available()
    assert seen_by_another_thread == [before]
    assert torchs_answers() == before
    assert before["is_available"] is False


def test_a_chosen_gpu_and_device_count_are_described_and_devices_past_the_count_refused() -> None:
    with fake_mode(fake_cuda=True, gpu=A100, device_count=2):
        assert torch.cuda.get_device_name(1) == "NVIDIA A100-SXM4-80GB"
        assert torch.cuda.get_device_capability() == (8, 0)
        assert torch.cuda.device_count() == 2
        assert torch.empty(2, device="cuda:1").device == torch.device("cuda:1")
        with pytest.raises(ValueError, match=r"spoofs 2 CUDA devices, cuda:0 to cuda:1; ask for more"):
            torch.empty(2, device="cuda:2")
        with pytest.raises(ValueError, match=r"cuda:2 is not one of the 2 spoofed devices"):
            torch.cuda.get_device_properties("cuda:2")
        with fake_mode(fake_cuda=True):  # the innermost block answers
            assert torch.cuda.get_device_name() == H100.name
        assert torch.cuda.get_device_name() == A100.name


@pytest.mark.parametrize("device", ["cuda:3", torch.device("cuda", 3)], ids=["str", "torch.device"])
def test_a_device_made_under_a_larger_count_is_refused_under_a_smaller_one_and_again_allowed(device: object) -> None:
    for count, allowed in [(8, True), (2, False), (4, True), (3, False)]:
        with fake_mode(fake_cuda=True, device_count=count):
            if allowed:
                assert torch.empty(1, device=device).device == torch.device("cuda:3")  # type: ignore[call-overload]
            else:
                with pytest.raises(ValueError, match=f"spoofs {count} CUDA devices"):
                    torch.empty(1, device=device)  # type: ignore[call-overload]


def test_a_gpu_of_your_own_is_described() -> None:
    l4 = GPU("NVIDIA L4", major=8, minor=9, total_memory=22_491 * 2**20, multi_processor_count=58)
    with fake_mode(fake_cuda=True, gpu=l4, device_count=1):
        assert torch.cuda.get_device_properties(0).name == "NVIDIA L4"
        assert torch.cuda.get_device_capability(0) == (8, 9)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"gpu": A100}, ValueError, "pass fake_cuda=True too"),
        ({"device_count": 2}, ValueError, "pass fake_cuda=True too"),
        ({"fake_cuda": True, "device_count": 9}, ValueError, "device_count must be an int from 1 to 8"),
        ({"fake_cuda": True, "device_count": 0}, ValueError, "device_count must be an int from 1 to 8"),
        ({"fake_cuda": True, "gpu": "A100"}, TypeError, r"gpu must be a modattrs.fake.GPU \(e.g. modattrs.fake.A100\)"),
    ],
)
def test_a_gpu_or_device_count_that_cannot_be_spoofed_is_refused(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message), fake_mode(**kwargs):  # type: ignore[arg-type]
        pass


def test_a_gpu_with_impossible_properties_is_refused() -> None:
    with pytest.raises(ValueError, match="total_memory and multi_processor_count must be positive"):
        GPU("broken", major=9, minor=0, total_memory=0, multi_processor_count=132)


def test_tensors_made_from_python_values_inside_spoofed_cuda_stay_fake() -> None:
    # torch asks torch.cuda.is_available() whether it may put such constants on the real device: it must get the
    # real answer, not the spoofed one.
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        constant = torch.tensor([1.0, 2.0])
        layer = nn.Linear(2, 2)
        out = layer(constant)
    assert is_fake(constant)
    assert is_fake(out)
    assert out.device == torch.device("cuda:0")


@pytest.mark.parametrize("index", range(8))
def test_every_spoofed_device_initializes_copies_indexes_and_runs_backward(index: int) -> None:
    # These go through torch's CUDA device guard, which on a CUDA build without a GPU switches devices: on torch 2.8
    # the build's own guard asks the driver for every device but cuda:0.
    device = torch.device("cuda", index)
    with fake_mode(fake_cuda=True), device:
        layer = nn.Linear(4, 4)
        nn.init.trunc_normal_(layer.weight)
        copy = torch.empty(4, 4).copy_(layer.weight)
        row = copy[1].contiguous()
        layer(row.unsqueeze(0)).sum().backward()
    assert {tensor.device for tensor in (layer.weight, copy, row)} == {device}
    assert layer.weight.grad is not None
    assert layer.weight.grad.device == device


def test_mixtral_asks_for_the_gpu_capability_and_builds_and_runs_forward_on_spoofed_cuda() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )  # fmt: skip
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)  # H100 kernels: grouped_mm wants bf16
        tokens = torch.randint(0, 64, (2, 7))
        with torch.no_grad():
            logits = model(tokens).logits
    assert is_fake(logits)
    assert (logits.shape, logits.device) == ((2, 7, 64), torch.device("cuda:0"))
    assert logits.dtype == torch.bfloat16
    assert all(is_fake(p) and p.device == torch.device("cuda:0") for p in model.parameters())


# --- device properties -----------------------------------------------------------------------------------------------


def torchs_device_property_names() -> set[str]:
    """The public attributes of the installed torch's CUDA device properties: those of its class on a build with
    CUDA, else those its type stubs declare (a build without CUDA has no class)."""
    properties = getattr(torch._C, "_CudaDeviceProperties", None)
    if properties is not None:
        return {name for name in dir(properties) if not name.startswith("_")}
    stubs = Path(torch.__file__).parent / "_C" / "__init__.pyi"
    if stubs.exists():
        for node in ast.parse(stubs.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name == "_CudaDeviceProperties":
                return {
                    statement.target.id
                    for statement in node.body
                    if isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and not statement.target.id.startswith("_")
                }
    pytest.skip("this torch has neither a CUDA device properties class nor a declaration of one")


@pytest.mark.parametrize("gpu", [H100, A100], ids=["H100", "A100"])
def test_spoofed_device_properties_have_every_attribute_that_torchs_own_have(gpu: GPU) -> None:
    with fake_mode(fake_cuda=True, gpu=gpu, device_count=1):
        properties = torch.cuda.get_device_properties(0)
    ours = {name for name in dir(properties) if not name.startswith("_")}
    assert torchs_device_property_names() - ours == set()


@pytest.mark.parametrize(
    ("gpu", "published_bandwidth", "boost_mhz"), [(H100, 3.35e12, 1980), (A100, 2.039e12, 1410)], ids=["H100", "A100"]
)
def test_the_preset_gpus_report_clocks_bus_and_shared_memory_that_match_their_published_specs(
    gpu: GPU, published_bandwidth: float, boost_mhz: int
) -> None:
    with fake_mode(fake_cuda=True, gpu=gpu, device_count=1):
        properties = torch.cuda.get_device_properties(0)
    # Clocks are in kHz, as CUDA reports them; HBM moves data on both edges of its clock.
    bandwidth = properties.memory_clock_rate * 1e3 * 2 * properties.memory_bus_width / 8
    assert bandwidth == pytest.approx(published_bandwidth, rel=0.01)
    assert properties.clock_rate == boost_mhz * 1000
    assert properties.shared_memory_per_block == 48 * 1024
    assert 48 * 1024 < properties.shared_memory_per_block_optin < properties.shared_memory_per_multiprocessor
    assert properties.max_threads_per_block == 1024
    assert properties.gcnArchName == gpu.name  # torch's CUDA builds report the name there


def test_each_spoofed_device_has_a_uuid_of_its_own_that_stays_the_same_across_blocks() -> None:
    def uuids() -> list[object]:
        with fake_mode(fake_cuda=True, device_count=4):
            return [torch.cuda.get_device_properties(index).uuid for index in range(4)]

    first, second = uuids(), uuids()
    texts = [str(one) for one in first]
    assert texts == [str(one) for one in second]
    assert len(set(texts)) == 4
    for one, text in zip(first, texts, strict=True):
        # torch prints a CUDA UUID as 32 lowercase hexadecimal digits grouped 8-4-4-4-12, and .bytes gives its bytes
        assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", text)
        assert one.bytes == list(uuid.UUID(text).bytes)  # type: ignore[attr-defined]


def test_device_properties_are_of_a_class_named_by_its_public_module_and_pickle_through_it() -> None:
    import pickle

    import modattrs.fake

    with fake_mode(fake_cuda=True):
        properties = torch.cuda.get_device_properties(0)

    assert type(properties).__module__ == "modattrs.fake"
    assert modattrs.fake.DeviceProperties is type(properties)
    assert pickle.loads(pickle.dumps(properties)) == properties
    assert b"cmodattrs.fake\nDeviceProperties\n" in pickle.dumps(properties, protocol=2)


def test_device_properties_of_a_gpu_of_your_own_take_what_it_gives_and_say_zero_for_what_it_does_not() -> None:
    l4 = GPU(
        "NVIDIA L4", major=8, minor=9, total_memory=22_491 * 2**20, multi_processor_count=58,
        clock_rate=2_040_000, memory_bus_width=192,
    )  # fmt: skip
    with fake_mode(fake_cuda=True, gpu=l4, device_count=1):
        properties = torch.cuda.get_device_properties()
    assert (properties.clock_rate, properties.memory_bus_width, properties.memory_clock_rate) == (2_040_000, 192, 0)
    assert properties.shared_memory_per_block == 48 * 1024


def test_a_gpu_with_a_negative_clock_is_refused() -> None:
    with pytest.raises(ValueError, match="clock_rate must be at least 0, got -1"):
        GPU("broken", major=9, minor=0, total_memory=1, multi_processor_count=1, clock_rate=-1)


# --- integer devices -------------------------------------------------------------------------------------------------

#: Every way model code gives a CUDA device as an int, each making a fake tensor (or a module) on that device.
INT_DEVICE_FORMS: dict[str, Callable[[int], object]] = {
    "Module.cuda(i)": lambda i: nn.Linear(2, 2).cuda(i).weight,
    "Module.to(i)": lambda i: nn.Linear(2, 2).to(i).weight,
    "Module.to(device=i)": lambda i: nn.Linear(2, 2).to(device=i).weight,
    "Module.to(i, dtype)": lambda i: nn.Linear(2, 2).to(i, torch.float16).weight,
    "Module.to_empty(device=i)": lambda i: nn.Linear(2, 2).to_empty(device=i).weight,
    "nn.Linear(device=i)": lambda i: nn.Linear(2, 2, device=i).weight,
    "Tensor.cuda(i)": lambda i: torch.ones(2).cuda(i),
    "Tensor.cuda(device=i)": lambda i: torch.ones(2).cuda(device=i),
    "Tensor.to(i)": lambda i: torch.ones(2).to(i),
    "Tensor.to(device=i)": lambda i: torch.ones(2).to(device=i),
    "Tensor.to(i, dtype)": lambda i: torch.ones(2).to(i, torch.float16),
    "Tensor.new_empty(device=i)": lambda i: torch.ones(2).new_empty(3, device=i),
    "torch.ones(device=i)": lambda i: torch.ones(2, device=i),
    "torch.empty(device=i)": lambda i: torch.empty(2, device=i),
    "torch.arange(device=i)": lambda i: torch.arange(4, device=i),
    "torch.tensor(device=i)": lambda i: torch.tensor([1.0, 2.0], device=i),
    "torch.zeros_like(device=i)": lambda i: torch.zeros_like(torch.ones(2), device=i),
}


@pytest.mark.parametrize("form", INT_DEVICE_FORMS)
def test_an_int_device_inside_spoofed_cuda_is_that_cuda_device(form: str) -> None:
    with fake_mode(fake_cuda=True, device_count=2):
        made = INT_DEVICE_FORMS[form](1)
    assert isinstance(made, torch.Tensor)
    assert is_fake(made)
    assert made.device == torch.device("cuda", 1)


@pytest.mark.parametrize("form", INT_DEVICE_FORMS)
def test_an_int_device_past_the_spoofed_count_is_refused_as_its_cuda_name_is(form: str) -> None:
    with fake_mode(fake_cuda=True, device_count=2):
        with pytest.raises(ValueError, match=r"^cuda:2: this fake_mode spoofs 2 CUDA devices, cuda:0 to cuda:1"):
            INT_DEVICE_FORMS[form](2)
        assert INT_DEVICE_FORMS[form](1).device == torch.device("cuda", 1)  # type: ignore[attr-defined]


def test_a_module_moved_to_an_int_device_past_the_spoofed_count_stays_as_it_was() -> None:
    with fake_mode(fake_cuda=True, device_count=2):
        layer = nn.Linear(2, 2, device="cuda:1")
        weight = layer.weight
        with pytest.raises(ValueError, match="spoofs 2 CUDA devices"):
            layer.to(5)
    assert layer.weight is weight
    assert {tensor.device for tensor in layer.parameters()} == {torch.device("cuda", 1)}


def test_an_int_device_too_large_for_a_device_index_is_refused_rather_than_wrapped_around() -> None:
    # torch keeps device indices in 8 bits: device=200 is cuda:-56.
    with fake_mode(fake_cuda=True, device_count=2), pytest.raises(ValueError, match=r"not a CUDA device \(torch wraps"):
        torch.ones(2, device=200)


def test_a_negative_int_device_inside_spoofed_cuda_gets_torchs_own_error() -> None:
    with fake_mode(fake_cuda=True), pytest.raises(RuntimeError, match="Device index must not be negative"):
        torch.ones(2, device=-1)


OUTSIDE_SCRIPT = """
import json, sys, threading, torch
from torch import nn

def outcomes():
    forms = {
        "Tensor.cuda(1)": lambda: torch.ones(2).cuda(1),
        "Tensor.to(1)": lambda: torch.ones(2).to(1),
        "torch.ones(device=1)": lambda: torch.ones(2, device=1),
        "Module.to(1)": lambda: nn.Linear(2, 2).to(1).weight,
    }
    seen = {}
    for name, form in forms.items():
        try:
            seen[name] = str(form().device)
        except Exception as error:
            seen[name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return seen

stock = outcomes()
from modattrs.fake import fake_mode
other_thread = []
with fake_mode(fake_cuda=True, device_count=2):
    thread = threading.Thread(target=lambda: other_thread.append(outcomes()))
    thread.start()
    thread.join()
json.dump({"stock": stock, "other thread": other_thread[0], "after": outcomes()}, sys.stdout)
"""


@pytest.mark.skipif(
    torch.accelerator.current_accelerator() is not None,
    reason="torch itself makes int devices devices of its accelerator",
)
def test_int_devices_are_torchs_own_outside_spoofed_cuda_blocks_and_in_other_threads() -> None:
    run = subprocess.run([sys.executable, "-c", OUTSIDE_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout)
    assert seen["other thread"] == seen["after"] == seen["stock"]
    assert all(outcome.startswith("RuntimeError") for outcome in seen["stock"].values())


# --- the current device ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", [0, "cuda:0", torch.device("cuda", 0), None, -1], ids=repr)
def test_selecting_the_current_spoofed_device_is_allowed_and_changes_nothing(device: object) -> None:
    with fake_mode(fake_cuda=True, device_count=2):
        with torch.cuda.device(device):
            assert torch.cuda.current_device() == 0
            made = torch.empty(2, device="cuda")
        if device is not None:
            torch.cuda.set_device(device)  # type: ignore[arg-type]
        assert torch.cuda.current_device() == 0
    assert made.device == torch.device("cuda", 0)


@pytest.mark.parametrize("device", [1, "cuda:1", torch.device("cuda", 1)], ids=repr)
def test_switching_the_current_spoofed_device_is_refused_saying_to_name_the_device(device: object) -> None:
    with fake_mode(fake_cuda=True, device_count=2):
        with pytest.raises(
            NotImplementedError,
            match=r"^torch\.cuda\.set_device: cuda:1 cannot be made the current device: spoofed CUDA's current device "
            r"stays cuda:0\.\n(?s:.*)\nName the device instead: 'cuda:1'",
        ):
            torch.cuda.set_device(device)  # type: ignore[arg-type]
        with (
            pytest.raises(NotImplementedError, match=r"cuda:1.*current device stays cuda:0"),
            torch.cuda.device(device),
        ):
            pass
        with pytest.raises(ValueError, match=r"cuda:5 is not one of the 2 spoofed devices"):
            torch.cuda.set_device(5)
        assert torch.cuda.current_device() == 0


@pytest.mark.parametrize(
    "device",
    [
        1,
        "cuda:1",
        torch.device("cuda", 1),
        pytest.param("numpy", id="numpy int"),
        pytest.param("context", id="torch.cuda.device"),
    ],
)
def test_torch_cuda_queries_take_a_device_in_every_form_torch_takes(device: object) -> None:
    with fake_mode(fake_cuda=True, gpu=A100, device_count=2):
        if device == "numpy":
            device = pytest.importorskip("numpy").int64(1)
        elif device == "context":
            device = torch.cuda.device(1)  # made, not entered
        properties = torch.cuda.get_device_properties(device)  # type: ignore[arg-type]
        assert torch.cuda.get_device_name(device) == A100.name  # type: ignore[arg-type]
        assert torch.cuda.get_device_capability(device) == (8, 0)  # type: ignore[arg-type]
        first, second = (str(torch.cuda.get_device_properties(index).uuid) for index in range(2))
    assert str(properties.uuid) == second != first  # the device asked about, not the current one


def test_fake_copy_to_an_int_device_makes_its_twin_on_that_cuda_device() -> None:
    twin = fake_copy(nn.Linear(2, 2), device=1)
    assert is_fake(twin.weight)
    assert twin.weight.device == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: torch.cuda.get_device_name("cpu"), ValueError, r"get_device_name: expected a CUDA device, got cpu"),
        (lambda: torch.cuda.get_device_name("gpu:1"), ValueError, r"get_device_name: .*got 'gpu:1'"),
        (lambda: torch.cuda.get_device_capability(True), TypeError, r"expected a CUDA device .*got bool: True"),
        (lambda: torch.cuda.set_device("cuda"), ValueError, r"set_device: expected a CUDA device with an index"),
        (lambda: torch.cuda.set_device(None), ValueError, r"set_device: expected a CUDA device with an index"),
    ],
    ids=["cpu", "unknown type", "bool", "no index", "None"],
)
def test_torch_cuda_queries_refuse_what_is_not_a_cuda_device_naming_the_function(
    call: Callable[[], object], error: type[Exception], message: str
) -> None:
    with fake_mode(fake_cuda=True), pytest.raises(error, match=message):
        call()
