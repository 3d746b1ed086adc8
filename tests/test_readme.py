"""The Python example in the README runs and computes what it says."""

from __future__ import annotations

import re
from pathlib import Path

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
