"""Spoofed CUDA answers model code's questions about the GPU: torch.cuda inside fake_mode(fake_cuda=True)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from modattrs.fake import A100, GPU, H100, fake_mode, is_fake

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
    assert properties is H100
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
