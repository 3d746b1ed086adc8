"""The incidents of issue 37, each reproduced by a small model (``ledger_incidents.py``): the ledger flags each,
naming the tensor and its bytes, and flags nothing on the eager equivalent or the corrected flow."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from modattrs import ShapedTensor, VirtualTensor
from modattrs.deferred import deferred_init, materialize_module
from modattrs.ledger import LedgerError, Report, watch
from tests import ledger_incidents as incidents
from tests.support import ranks


def audited(flow: Callable[[], nn.Module]) -> Report:
    with watch() as ledger:
        model = flow()
    return ledger.report(model)


def problems_of(report: Report) -> str:
    with pytest.raises(LedgerError) as raised:
        report.check()
    return str(raised.value)


def test_a_rotary_buffer_lost_by_to_empty_is_flagged_with_its_bytes_and_the_to_empty_line() -> None:
    report = audited(incidents.rotary_after_to_empty)
    entry = report["inv_freq"]
    assert entry.status == "unwritten"
    assert entry.ranges("unwritten") == ((0, 16),)
    assert "empty_like in to_empty at" in entry.parts[0].what
    assert "ledger_incidents.py" in entry.parts[0].what
    assert [problem.name for problem in report.problems] == ["inv_freq"]
    assert "- inv_freq (non-persistent buffer, 16 bytes): unwritten" in problems_of(report)


@pytest.mark.parametrize("flow", [incidents.rotary_after_to_empty_fixed, incidents.rotary_eager])
def test_a_rotary_buffer_computed_again_or_built_eagerly_is_not_flagged(flow: Callable[[], nn.Module]) -> None:
    report = audited(flow)
    report.check()
    assert report["inv_freq"].status in ("computed", "initialized")


def test_an_empty_like_buffer_that_nothing_fills_is_flagged_though_the_parameters_were_loaded() -> None:
    report = audited(incidents.empty_like_buffer)
    assert report["weight"].status == "loaded"
    assert report["scale"].status == "unwritten"
    assert "allocated by empty_like at" in report["scale"].parts[0].what
    assert "- scale (non-persistent buffer, 32 bytes): unwritten" in problems_of(report)


def test_an_empty_like_buffer_filled_after_loading_is_not_flagged() -> None:
    report = audited(incidents.empty_like_buffer_fixed)
    report.check()
    assert report["scale"].status == "computed"


def test_weights_initialized_again_after_loading_are_flagged_as_overwritten_with_their_keys() -> None:
    report = audited(incidents.initialized_after_loading)
    assert {entry.name for entry in report.problems} == {"embed.weight", "proj.weight", "proj.bias", "head.weight"}
    entry = report["proj.weight"]
    assert entry.status == "overwritten after loading"
    assert entry.ranges("overwritten after loading") == ((0, 8 * 8 * 4),)
    assert "loaded 'proj.weight'" in entry.parts[0].what
    assert "fix: initialize before loading" in problems_of(report)


@pytest.mark.parametrize("flow", [incidents.initialized_after_loading_fixed, incidents.loaded_eager])
def test_weights_initialized_before_loading_are_loaded_and_not_flagged(flow: Callable[[], nn.Module]) -> None:
    report = audited(flow)
    report.check()
    assert {report[name].status for name in ("embed.weight", "proj.weight", "proj.bias", "head.weight")} == {"loaded"}


def test_a_tie_broken_by_to_empty_is_flagged_naming_both_tensors() -> None:
    report = audited(incidents.tie_after_to_empty)
    assert [tie.names for tie in report.broken_ties] == [("embed.weight", "head.weight")]
    assert report.broken_ties[0].op == "to_empty"
    message = problems_of(report)
    assert "- embed.weight and head.weight: a tie lost" in message
    assert "tie_weights" in message


@pytest.mark.parametrize("flow", [incidents.tie_after_to_empty_fixed, incidents.tied_eager])
def test_a_tie_made_again_after_to_empty_or_never_broken_is_not_flagged(flow: Callable[[], nn.Module]) -> None:
    report = audited(flow)
    report.check()
    assert report["head.weight"].status == "tied"
    assert report["head.weight"].tied_to == "embed.weight"


def fake_world(size: int, rank: int) -> contextlib.AbstractContextManager[object]:
    return ranks.fake_world((size,), rank)


def test_buffers_left_out_of_a_rank_0_broadcast_are_flagged_on_the_other_ranks() -> None:
    with fake_world(2, 1):
        report = audited(lambda: incidents.broadcast_from_rank_0(everything=False))
    assert report["proj.weight"].status == "received"
    assert report["inv_freq"].status == "unwritten"
    assert [entry.name for entry in report.problems] == ["inv_freq"]


def test_a_rank_0_broadcast_of_every_tensor_is_received_on_the_other_ranks_and_loaded_on_rank_0() -> None:
    with fake_world(2, 1):
        received = audited(lambda: incidents.broadcast_from_rank_0(everything=True))
    received.check()
    assert {entry.status for entry in received} == {"received"}
    with fake_world(2, 0):
        source = audited(lambda: incidents.broadcast_from_rank_0(everything=True))
    source.check()
    assert source["proj.weight"].status == "loaded"
    assert source["inv_freq"].status == "computed"


def audit_on_gloo(everything: bool) -> list[tuple[int, dict[str, object]]]:
    """``python -m modattrs audit ledger_incidents:broadcast_on_gloo`` on 2 gloo ranks: each rank's exit code and
    JSON report."""
    port = ranks.free_port()
    tests = Path(__file__).resolve().parent
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable,
        "-m",
        "modattrs",
        "audit",
        "ledger_incidents:broadcast_on_gloo",
        f"everything={everything}",
    ]
    processes = [
        subprocess.Popen(
            [*command, "--format", "json"],
            env={**environment, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        assert out, err
        # torch 2.8's gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks..." on stdout before the report
        report = out[out.index("{") :]
        results.append((process.returncode, json.loads(report)))
    return results


def test_on_two_gloo_ranks_the_audit_of_a_broadcast_skipping_buffers_fails_on_rank_1_only() -> None:
    (code_0, report_0), (code_1, report_1) = audit_on_gloo(everything=False)
    assert code_0 == 0
    assert code_1 == 1
    statuses_1 = {entry["name"]: entry["status"] for entry in report_1["entries"]}  # type: ignore[attr-defined]
    assert statuses_1 == {"embed.weight": "received", "proj.weight": "received", "proj.bias": "received",
                          "head.weight": "received", "inv_freq": "unwritten"}  # fmt: skip
    assert report_0["counts"] == {"loaded": 4, "computed": 1}


def test_on_two_gloo_ranks_a_broadcast_of_every_tensor_passes_the_audit_on_both() -> None:
    (code_0, _), (code_1, report_1) = audit_on_gloo(everything=True)
    assert (code_0, code_1) == (0, 0)
    assert report_1["counts"] == {"received": 5}


class ModattrsRotary(nn.Module):
    """The rotary table as a VirtualTensor (computed when read) and a KV cache as a ShapedTensor."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(dim, dim)
        VirtualTensor(self, "inv_freq", "compute_inv_freq")
        ShapedTensor(self, "cache", torch.zeros(1, dim), {1: dim})

    def compute_inv_freq(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return (1.0 / 10_000 ** (torch.arange(0, self.dim, 2, device=device) / self.dim)).to(dtype)


def test_a_virtual_tensor_needs_no_write_after_to_empty_and_a_shaped_tensor_is_checked_like_any_buffer() -> None:
    with watch() as ledger:
        with torch.device("meta"):
            model = ModattrsRotary()
        model.to_empty(device="cpu")
        model.proj.reset_parameters()
        computed = model.inv_freq.value
    report = ledger.report(model)
    assert computed.tolist() == pytest.approx([1.0, 0.1, 0.01, 0.001])
    assert [entry.name for entry in report.problems] == ["_cache_data"]  # to_empty left the cache as memory was
    with watch() as ledger:
        with torch.device("meta"):
            model = ModattrsRotary()
        model.to_empty(device="cpu")
        model.proj.reset_parameters()
        model.cache.value = torch.zeros(2, 8)
    ledger.report(model).check()


def test_a_deferred_model_materialized_inside_a_watch_is_initialized_by_materialize_module_and_keeps_its_tie() -> None:
    # materialize_module replays below every dispatch mode (it steps out of the caller's modes on purpose), and
    # announces what it put in place: every byte is labelled by it, at the line that called it.
    with watch() as ledger:
        model = deferred_init(incidents.RotaryDecoder, tie=True)
        materialize_module(model)
    report = ledger.report(model)
    report.check()
    assert report["head.weight"].status == "tied"
    entries = [entry for entry in report if entry.name != "head.weight"]
    assert {entry.status for entry in entries} == {"initialized"}
    written_by = {part.what for entry in entries for part in entry.parts}
    assert len(written_by) == 1, written_by
    (what,) = written_by
    assert what.startswith("materialize_module at "), what
    assert "test_ledger_incidents.py" in what, what


def test_a_deferred_model_materialized_outside_a_watch_is_unseen() -> None:
    model = deferred_init(incidents.RotaryDecoder)
    with watch() as ledger:
        pass
    materialize_module(model)
    assert {entry.status for entry in ledger.report(model)} == {"unseen"}


def test_a_deferred_model_not_yet_materialized_holds_no_data() -> None:
    with watch() as ledger:
        model = deferred_init(incidents.RotaryDecoder)
    report = ledger.report(model)
    report.check()
    assert {entry.status for entry in report} == {"no data"}


def test_the_incident_checkpoint_is_made_outside_the_ledger_s_sight_of_the_flow() -> None:
    # checkpoint() is what a file would hold: its tensors are plain, and loading it labels them by key
    state = incidents.checkpoint()
    assert set(state) == {"embed.weight", "proj.weight", "proj.bias", "head.weight"}
    assert torch.equal(state["proj.bias"], incidents.checkpoint()["proj.bias"])


def test_a_functional_collective_receives_what_it_returns_and_leaves_its_input_as_it_was() -> None:
    from torch.distributed.tensor import DTensor, Shard

    with ranks.fake_world((2,), 1) as mesh:

        def gathered() -> nn.Module:  # DTensor gathers with torch's functional collectives
            module = nn.Module()
            module.register_buffer("shard", torch.zeros(4))
            module.register_buffer("whole", DTensor.from_local(module.shard, mesh, [Shard(0)]).full_tensor())
            return module

        report = audited(gathered)
    assert report["shard"].status == "initialized"
    assert report["whole"].status == "received"
    assert "all_gather_into_tensor" in report["whole"].parts[0].what
