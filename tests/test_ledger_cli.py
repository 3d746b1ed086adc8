"""``python -m modattrs audit package.module:flow``: the report, the exit codes, and the errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modattrs._cli.commands import main

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def test_an_unwritten_buffer_makes_audit_exit_1_naming_it_with_its_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "ledger_incidents:rotary_after_to_empty"]) == 1
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "write ledger: 5 tensors (initialized 4, unwritten 1); 1 problem(s)"
    assert lines[2].startswith("inv_freq") and "unwritten bytes 0-15 of 16" in lines[2]  # noqa: PT018
    assert "- inv_freq (non-persistent buffer, 16 bytes): unwritten" in captured.err


def test_a_clean_flow_makes_audit_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "ledger_incidents:rotary_after_to_empty_fixed"]) == 0
    captured = capsys.readouterr()
    assert "0 problem(s)" in captured.out.splitlines()[0]
    assert captured.err == ""


def test_weights_overwritten_after_loading_make_audit_exit_1_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "ledger_incidents:initialized_after_loading"]) == 1
    assert "proj.weight (parameter, 256 bytes): overwritten after loading" in capsys.readouterr().err


def test_a_broken_tie_makes_audit_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "ledger_incidents:tie_after_to_empty"]) == 1
    assert "embed.weight and head.weight: a tie lost" in capsys.readouterr().err


def test_audit_passes_keyword_arguments_to_the_flow_and_prints_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "ledger_incidents:broadcast_from_rank_0", "everything=True", "--format", "json"]) == 2
    assert "failed: ValueError: Default process group has not been initialized" in capsys.readouterr().err
    assert main(["audit", "ledger_incidents:meta_decoder", "tie=True", "--format", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["counts"] == {"no data": 4, "tied": 1}


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (
            "ledger_incidents:failing_flow",
            "ledger_incidents:failing_flow() failed: ValueError: the checkpoint is missing",
        ),
        ("ledger_incidents:not_a_module", "ledger_incidents:not_a_module returned str, not an nn.Module"),
        ("nowhere:flow", "cannot import 'nowhere'"),
        ("ledger_incidents", "target must be package.module:callable"),
    ],
)
def test_a_flow_that_cannot_run_makes_audit_exit_2_with_one_line(
    target: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["audit", target]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("modattrs audit: error: ")
    assert message in captured.err


def test_python_m_modattrs_audit_runs_as_a_program() -> None:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    done = subprocess.run(
        [sys.executable, "-m", "modattrs", "audit", "ledger_incidents:empty_like_buffer"],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    assert done.returncode == 1
    assert "scale" in done.stdout.splitlines()[2]
    assert "- scale (non-persistent buffer, 32 bytes): unwritten" in done.stderr
