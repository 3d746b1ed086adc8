"""Every script in examples/ runs, and says what it promises."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# A line each example must print: what it demonstrates, checked rather than assumed.
EXPECTED = {
    "quickstart.py": "VirtualTensor correct after meta init + to_empty: True",
    "kv_cache.py": "after shrinking the batch to 1: (1, 4, 4, 8)",
    "fake_export.py": "fc1 on cpu, fc2 on cuda: devices ['cpu', 'cuda:0']; transfers ['aten.to.dtype_layout: cpu ->",
    "inspect_llama.py": "Llama-2-7B: 6,738,415,616 parameters",
    "fsdp_meta_init.py": (
        "VirtualTensor rotary tables equal to a CPU build: True\n"
        "hand-rolled inv_freq buffer equal to a CPU build: False"
    ),
    "fsdp_deferred_init.py": (
        "every rank's shards equal the eager model's slices, bit for bit, generator included: True"
    ),
    "simulate_fsdp_70b.py": "matches an even split of dim 0: True",
    "deferred_init.py": (
        "meta + to_empty + reset_parameters equal to eager: False\n"
        "deferred: Parameter(FakeTensor(..., size=(1000, 64), requires_grad=True))\n"
        "deferred_init + materialize_module equal to eager: True\n"
        "tie kept: True\n"
        "generator after materializing equals eager's: True\n"
        "layer 1 alone equal to eager's layer 1: True; other layers still fake: True; model still deferred: True"
    ),
    "rope.py": "VirtualTensor cos: torch.float32, equal to the exact table: True",
}


def test_every_example_is_checked() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs_and_prints_its_result(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    assert EXPECTED[name] in capsys.readouterr().out
