"""python -m modattrs inspect: output, JSON, targets and every error path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from modattrs._cli.commands import main

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

SMALL = ["layers=2", "dim=64", "heads=4", "kv_heads=2", "hidden=128", "vocab=100", "context=32"]


def inspect_json(*arguments: str, capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["inspect", *arguments, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_the_default_target_is_a_70b_decoder_built_fake_on_a_spoofed_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    report = inspect_json("--device", "cuda", "--dtype", "bfloat16", capsys=capsys)
    assert report["total_parameters"] == 68_976_648_192
    kv_cache = 80 * 2 * (1 * 8 * 4096 * 128) * 2
    assert report["total_bytes"] == 68_976_648_192 * 2 + kv_cache
    assert report["by_device"] == {"cuda:0": {"parameters": 68_976_648_192, "bytes": report["total_bytes"]}}
    assert report["by_dtype"] == {"bfloat16": {"parameters": 68_976_648_192, "bytes": report["total_bytes"]}}
    modules = {m["name"]: m for m in report["modules"]}  # type: ignore[attr-defined]
    assert modules["layers.0"]["parameters"] == 855_654_400
    assert modules["embed"]["bytes"] == 32000 * 8192 * 2
    attributes = {a["name"]: a for a in report["attributes"]}  # type: ignore[attr-defined]
    assert len(attributes) == 80 * 4
    assert attributes["layers.79.attention.rotary.cos"] == {
        "name": "layers.79.attention.rotary.cos", "kind": "VirtualTensor", "shape": [4096, 64],
        "dtype": "float32", "device": "cuda:0", "bytes": 4096 * 64 * 4,
    }  # fmt: skip
    assert attributes["layers.0.attention.keys"]["constraints"] == {"1": 8, "3": 128}
    assert report["build_memory_mib"] < 100


def test_text_output_shows_the_tree_totals_and_attributes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", *SMALL, "--dtype", "float16", "--depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "modattrs.default_model:Decoder on cpu as float16 (fake: nothing was allocated)" in out
    assert "peak memory up by" in out
    assert "    0-1  " in out  # layers.0 and layers.1 are the same: one line
    assert "      attention " in out  # depth 3
    for line in ("total: ", "  device cpu ", "  dtype float16 ", "layers.0-1.attention.rotary.cos      VirtualTensor"):
        assert line in out
    assert "constraints {1: 2, 3: 16}" in out


def test_the_default_target_is_named_by_a_public_importable_path(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    report = inspect_json(*SMALL, capsys=capsys)
    target = str(report["target"])
    module_name, _, attribute = target.partition(":")

    assert not any(part.startswith("_") for part in module_name.split("."))
    built = getattr(importlib.import_module(module_name), attribute)
    assert (built.__module__, built.__qualname__) == (module_name, attribute)  # what a pickle of the model names


def test_depth_limits_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", *SMALL, "--depth", "0"]) == 0
    table = capsys.readouterr().out.split("\n\n")[1]
    assert len(table.splitlines()) == 2  # the header and the model


def test_keyword_arguments_are_python_literals(capsys: pytest.CaptureFixture[str]) -> None:
    report = inspect_json(*SMALL, "rope_base=5e5", capsys=capsys)
    assert report["target"] == "modattrs.default_model:Decoder"
    assert report["total_parameters"] == 100 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128 + 2 * 64) + 64


def test_a_transformers_model_through_a_small_factory(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    report = inspect_json(
        "cli_targets:llama", "hidden_size=4096", "intermediate_size=11008", "num_hidden_layers=32",
        "num_attention_heads=32", "num_key_value_heads=32", "vocab_size=32000", "--device", "cuda:1",
        "--dtype", "bfloat16", capsys=capsys,
    )  # fmt: skip
    assert report["total_parameters"] == 6_738_415_616
    assert list(report["by_device"]) == ["cuda:1"]  # type: ignore[call-overload]


CLIP_CONFIG = {
    "text_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2},
    "vision_config": {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "image_size": 32, "patch_size": 8,
    },
    "projection_dim": 16,
}  # fmt: skip


def test_a_clip_model_with_its_scalar_logit_scale_inspects_on_the_default_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    import cli_targets

    report = inspect_json(
        "cli_targets:clip", *(f"{key}={value!r}" for key, value in CLIP_CONFIG.items()), capsys=capsys
    )
    real = cli_targets.clip(**CLIP_CONFIG)
    assert report["total_parameters"] == sum(p.numel() for p in real.parameters())
    assert list(report["by_device"]) == ["cpu"]  # type: ignore[call-overload]
    assert report["by_dtype"]["float32"]["parameters"] == report["total_parameters"]  # type: ignore[index]


def test_a_clip_model_with_its_scalar_logit_scale_inspects_on_the_meta_device_as_bfloat16(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers")
    import cli_targets

    report = inspect_json(
        "cli_targets:clip", *(f"{key}={value!r}" for key, value in CLIP_CONFIG.items()), "--device", "meta",
        "--dtype", "bfloat16", capsys=capsys,
    )  # fmt: skip
    real = cli_targets.clip(**CLIP_CONFIG)
    assert report["total_parameters"] == sum(p.numel() for p in real.parameters())
    assert list(report["by_device"]) == ["meta"]  # type: ignore[call-overload]
    assert report["by_dtype"]["bfloat16"]["parameters"] == report["total_parameters"]  # type: ignore[index]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["no_such_package.models:Model"], "cannot import 'no_such_package.models': ModuleNotFoundError"),
        (["cli_targets"], "target must be package.module:callable, got 'cli_targets'"),
        (["cli_targets:missing"], "module 'cli_targets' has no attribute 'missing'"),
        (["cli_targets:NOT_CALLABLE"], "cli_targets:NOT_CALLABLE is a int, not callable"),
        (["cli_targets:not_a_module"], "cli_targets:not_a_module returned str, not an nn.Module"),
        (["cli_targets:failing", "layers=0"], "cli_targets:failing(layers=0) failed: ValueError: layers must be"),
        (["cli_targets:exiting"], "cli_targets:exiting() failed: SystemExit: 0"),
        (["cli_targets:llama", "a={[]: 1}"], "the value of a is not a Python literal"),
        (["s='x:y'", "--depth", "0"], "modattrs.default_model:Decoder(s='x:y') failed: TypeError"),
        (["--depth", "-1"], "--depth must be 0 or more, got -1"),
        (["--device", "cuda:8"], "spoofed CUDA has cuda:0 to cuda:7"),
        (["cli_targets:llama", "hidden_size=big"], "the value of hidden_size is not a Python literal: 'big'"),
        (["cli_targets:llama", "4096"], "expected key=value, got '4096'"),
        (["--device", "gpu"], "unknown device 'gpu'"),
        (["--device", "mps"], "device 'mps' is not supported here"),
        (["--dtype", "float12"], "unknown floating-point dtype 'float12'"),
        (["--dtype", "int8"], "unknown floating-point dtype 'int8'"),
        (["--format", "yaml"], "invalid choice: 'yaml'"),
        (["--depth", "deep"], "invalid int value: 'deep'"),
    ],
)
def test_errors_print_one_line_and_exit_non_zero(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("modattrs inspect: error: ")
    assert message in captured.err


def test_without_a_compiler_spoofed_cuda_is_refused_without_a_traceback_saying_what_to_run_instead(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    monkeypatch.setattr(_cuda_guard, "_ready", False)
    monkeypatch.setattr(_cuda_guard, "_failure", "RuntimeError: Error building extension")
    monkeypatch.setattr(_cuda_guard, "cuda_built", lambda: False)
    assert main(["inspect", "--device", "cuda"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("modattrs inspect: error: --device cuda: fake CUDA needs a device guard")
    assert lines[1] == "reason: RuntimeError: Error building extension"
    assert lines[-1] == "Or run with --device cpu or --device meta."
    assert not any(line.startswith("Traceback") for line in lines)


def test_python_dash_m_runs_the_command_and_reports_errors_without_a_traceback() -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "modattrs", "inspect"]
    ok = subprocess.run([*command, *SMALL], capture_output=True, text=True, env=environment, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "(fake: nothing was allocated)" in ok.stdout
    bad = subprocess.run([*command, "nowhere:Model"], capture_output=True, text=True, env=environment, timeout=120)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "modattrs inspect: error: cannot import 'nowhere': ModuleNotFoundError: No module named 'nowhere'"
    ]


def test_the_default_model_runs_a_prompt_and_a_decoding_step_with_its_kv_cache() -> None:
    import torch

    from modattrs.default_model import Decoder

    torch.manual_seed(0)
    model = Decoder(vocab=50, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, batch=2, context=16)
    tokens = torch.randint(0, 50, (2, 6))
    with torch.no_grad():
        full = model(tokens)
        model(tokens[:, :5])
        step = model(tokens[:, 5:], start=5)
    torch.testing.assert_close(step[:, 0], full[:, 5], rtol=1e-4, atol=1e-4)


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    command = f"{sys.executable} -m modattrs inspect {' '.join(SMALL)} | head -1"
    result = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120, check=False)
    assert result.stdout.startswith("modattrs.default_model:Decoder on cpu")
    assert "Traceback" not in result.stderr


def test_an_alias_of_another_modules_attribute_is_reported_once_under_its_owner(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = inspect_json("cli_targets:shared_rotary", capsys=capsys)
    assert [attribute["name"] for attribute in report["attributes"]] == ["0.cos"]  # type: ignore[attr-defined]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU describes itself, whatever --gpu says")
@pytest.mark.parametrize(("gpu", "sms", "capability"), [(None, 132, 90), ("H100", 132, 90), ("A100", 108, 80)])
def test_gpu_chooses_what_torch_cuda_tells_the_model_and_h100_is_the_default(
    gpu: str | None, sms: int, capability: int, capsys: pytest.CaptureFixture[str]
) -> None:
    chosen = [] if gpu is None else ["--gpu", gpu]
    report = inspect_json("cli_targets:sized_by_the_gpu", "--device", "cuda", *chosen, capsys=capsys)
    assert report["total_parameters"] == sms * capability


def rotary_with_complex_table() -> nn.Module:
    """A layer and a RoPE table of complex64 values, as torchtitan's ``freqs_cis`` buffer."""
    model = nn.Linear(8, 8)
    angles = torch.outer(torch.arange(16.0), torch.linspace(0.0, 1.0, 4))
    model.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
    return model


def test_dtype_casts_floating_point_tensors_and_leaves_complex_ones_complex() -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-W", "always", "-m", "modattrs", "inspect", "test_cli:rotary_with_complex_table"]
    arguments = ["--dtype", "bfloat16", "--format", "json"]  # in a fresh process: torch warns once per process
    result = subprocess.run([*command, *arguments], capture_output=True, text=True, env=environment, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "imaginary" not in result.stderr
    real = rotary_with_complex_table()
    weights = sum(p.numel() for p in real.parameters())
    table = real.get_buffer("freqs_cis")
    assert json.loads(result.stdout)["by_dtype"] == {
        "bfloat16": {"parameters": weights, "bytes": weights * torch.bfloat16.itemsize},
        str(table.dtype).removeprefix("torch."): {"parameters": 0, "bytes": table.numel() * table.element_size()},
    }
