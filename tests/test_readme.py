"""The Python example in the README runs and computes what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_python_example_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    rotary = namespace["rotary"]
    expected = 1.0 / 10_000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    assert torch.equal(rotary.inv_freq.value, expected)  # type: ignore[attr-defined]


def test_readme_shows_what_quick_start_command_1_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from modattrs._cli.commands import main

    text = README.read_text()
    commands = re.findall(r"```sh\n(.*?)```", text, re.S)[0]
    command_1 = next(line for line in commands.splitlines() if line.startswith("python3"))
    arguments = command_1.split(" -m modattrs ")[1].split()
    assert main(arguments) == 0
    shown = re.findall(r"```text\n(.*?)```", text, re.S)[0].splitlines()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == shown[0]
    assert printed[2:] == shown[2:]  # line 1 has the build time and memory, which vary
