"""The write ledger's core: what it says wrote each byte of a module's tensors, byte for byte, and what it changes
while it watches (nothing after)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

import modattrs.ledger
from modattrs.fake import fake_mode
from modattrs.ledger import LedgerError, watch


def next_line() -> int:
    """The number of the caller's next line."""
    frame = inspect.currentframe()
    assert frame is not None
    assert frame.f_back is not None
    return frame.f_back.f_lineno + 1


def meta_linear(rows: int = 8, columns: int = 4) -> nn.Linear:
    with torch.device("meta"):
        return nn.Linear(columns, rows)


def test_a_slice_written_after_to_empty_leaves_exactly_the_other_bytes_unwritten() -> None:
    layer = meta_linear()
    with watch() as ledger, torch.no_grad():
        layer.to_empty(device="cpu")
        layer.weight[2:5].normal_()
        layer.bias.zero_()
    entry = ledger.report(layer)["weight"]
    assert entry.status == "unwritten"
    row = 4 * 4
    assert entry.ranges("initialized") == ((2 * row, 5 * row),)
    assert entry.ranges("unwritten") == ((0, 2 * row), (5 * row, 8 * row))
    assert ledger.report(layer)["bias"].status == "initialized"


def test_one_row_written_is_reported_as_those_bytes_and_no_more() -> None:
    with torch.device("meta"):
        embedding = nn.Embedding(6, 3)
    with watch() as ledger, torch.no_grad():
        embedding.to_empty(device="cpu")
        embedding.weight[4].zero_()  # a padding row, and nothing else
    entry = ledger.report(embedding)["weight"]
    assert entry.ranges("initialized") == ((4 * 12, 5 * 12),)
    assert entry.ranges("unwritten") == ((0, 48), (60, 72))


def test_a_column_cut_written_leaves_the_other_columns_of_every_row_unwritten() -> None:
    layer = meta_linear(rows=3, columns=5)
    with watch() as ledger, torch.no_grad():
        layer.to_empty(device="cpu")
        layer.weight[:, 1:3].fill_(1.0)
    entry = ledger.report(layer)["weight"]
    assert entry.ranges("initialized") == tuple((20 * row + 4, 20 * row + 12) for row in range(3))
    assert entry.ranges("unwritten") == ((0, 4), *((20 * row + 12, 20 * row + 24) for row in range(2)), (52, 60))


def test_an_initializer_is_named_with_the_line_of_the_user_code_that_ran_it() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        line = next_line()
        nn.init.kaiming_uniform_(layer.weight)
        nn.init.zeros_(layer.bias)
    entry = ledger.report(layer)["weight"]
    assert entry.status == "initialized"
    assert f"{Path(__file__).name}:{line} in test_an_initializer" in entry.parts[0].what
    assert entry.parts[0].what.startswith("nn.init.kaiming_uniform_ at")


def test_load_state_dict_writes_each_tensor_as_loaded_under_its_key() -> None:
    layer = meta_linear()
    checkpoint = {"weight": torch.randn(8, 4), "bias": torch.randn(8)}
    with watch() as ledger:
        layer.to_empty(device="cpu")
        layer.load_state_dict(checkpoint)
    report = ledger.report(layer)
    assert [entry.status for entry in report] == ["loaded", "loaded"]
    assert "'weight'" in report["weight"].parts[0].what
    assert "'bias'" in report["bias"].parts[0].what
    report.check()


def test_a_load_with_assign_is_loaded_under_its_key_too() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.load_state_dict({"weight": torch.randn(8, 4), "bias": torch.randn(8)}, assign=True)
    assert {entry.status for entry in ledger.report(layer)} == {"loaded"}


@pytest.mark.parametrize("swap", [False, True], ids=["assigned", "swapped"])
def test_a_meta_module_loaded_with_assign_is_loaded_in_either_conversion_mode(swap: bool) -> None:
    # with this future flag set, torch swaps the tensors behind the module's parameter objects rather than assigning
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        layer = meta_linear()
        weight = layer.weight
        with watch() as ledger:
            layer.load_state_dict({"weight": torch.randn(8, 4), "bias": torch.randn(8)}, assign=True)
            with torch.no_grad():
                layer.weight[0].zero_()  # loaded bytes initialized again
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert (layer.weight is weight) == swap
    report = ledger.report(layer)
    assert report["bias"].status == "loaded"
    assert "'bias'" in report["bias"].parts[0].what
    weight_parts = {part.kind: part for part in report["weight"].parts}
    assert set(weight_parts) == {"loaded", "overwritten after loading"}
    assert weight_parts["overwritten after loading"].ranges == ((0, 16),)  # the first row, zeroed
    assert "'weight'" in weight_parts["loaded"].what


def test_tensors_from_torch_load_and_safetensors_are_loaded_under_their_names(tmp_path: Path) -> None:
    torch.save({"weight": torch.randn(8, 4)}, tmp_path / "w.pt")
    safetensors.torch.save_file({"bias": torch.randn(8)}, str(tmp_path / "b.safetensors"))
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        with torch.no_grad():
            layer.weight.copy_(torch.load(tmp_path / "w.pt")["weight"])
            layer.bias.copy_(safetensors.torch.load_file(str(tmp_path / "b.safetensors"))["bias"].double())
    report = ledger.report(layer)
    assert report["weight"].status == report["bias"].status == "loaded"
    assert "'weight'" in report["weight"].parts[0].what
    assert "torch.load" in report["weight"].parts[0].what
    assert "'bias'" in report["bias"].parts[0].what
    assert "safetensors" in report["bias"].parts[0].what


def test_a_tensor_read_through_a_safetensors_handle_is_loaded_under_its_name(tmp_path: Path) -> None:
    safetensors.torch.save_file({"w": torch.randn(8, 4), "b": torch.randn(8)}, str(tmp_path / "m.safetensors"))
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        with safetensors.safe_open(str(tmp_path / "m.safetensors"), framework="pt") as handle, torch.no_grad():
            layer.weight.copy_(handle.get_slice("w")[:, :])
            layer.bias.copy_(handle.get_tensor("b"))
    report = ledger.report(layer)
    assert "'w'" in report["weight"].parts[0].what
    assert "'b'" in report["bias"].parts[0].what


def test_tensors_read_in_a_pool_of_threads_are_loaded_whether_copied_or_assigned(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    safetensors.torch.save_file({"w": torch.randn(8, 4), "b": torch.randn(8)}, str(tmp_path / "m.safetensors"))
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        checkpoint = safetensors.safe_open(str(tmp_path / "m.safetensors"), framework="pt")
        with checkpoint as handle, ThreadPoolExecutor(max_workers=2) as pool:  # as transformers reads checkpoints
            weight, bias = pool.map(lambda name: handle.get_slice(name)[...], ["w", "b"])
        with torch.no_grad():
            layer.weight.copy_(weight)  # the copy is the first operation after the reads
        layer.bias = nn.Parameter(bias)  # no operation: the report is the first to look
    report = ledger.report(layer)
    assert (report["weight"].status, report["bias"].status) == ("loaded", "loaded")
    assert "'w'" in report["weight"].parts[0].what
    assert "'b'" in report["bias"].parts[0].what


def test_initializing_loaded_bytes_again_is_reported_as_overwritten_after_loading() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        layer.load_state_dict({"weight": torch.randn(8, 4), "bias": torch.randn(8)})
        with torch.no_grad():
            layer.weight[0].normal_()
    report = ledger.report(layer)
    assert report["weight"].status == "overwritten after loading"
    assert report["weight"].ranges("overwritten after loading") == ((0, 16),)
    assert report["weight"].ranges("loaded") == ((16, 128),)
    assert report["bias"].status == "loaded"


def test_scaling_or_casting_loaded_bytes_keeps_them_loaded() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        layer.load_state_dict({"weight": torch.randn(8, 4), "bias": torch.randn(8)})
        with torch.no_grad():
            layer.weight.mul_(2.0)
        layer.double()
    assert {entry.status for entry in ledger.report(layer)} == {"loaded"}


def test_a_buffer_computed_from_unwritten_bytes_is_reported_as_computed_from_unwritten() -> None:
    with torch.device("meta"):
        module = nn.Module()
        module.register_buffer("inv_freq", torch.ones(4), persistent=False)
    with watch() as ledger:
        module.to_empty(device="cpu")
        module.register_buffer("cos", torch.outer(torch.arange(3.0), module.inv_freq).cos(), persistent=False)
    report = ledger.report(module)
    assert report["inv_freq"].status == "unwritten"
    assert report["cos"].status == "computed from unwritten"
    with pytest.raises(LedgerError) as raised:
        report.check()
    assert "inv_freq" in str(raised.value)
    assert "cos" in str(raised.value)


def test_computed_buffers_of_an_eager_build_are_computed_and_nothing_is_a_problem() -> None:
    with watch() as ledger:
        layer = nn.Linear(4, 8)
        layer.register_buffer("norm", layer.weight.detach().norm(dim=1))
    report = ledger.report(layer)
    assert report["norm"].status == "computed"
    assert report["weight"].status == "initialized"
    report.check()


def test_a_tensor_written_partly_by_an_initializer_and_partly_by_a_computation_is_mixed_with_both_parts() -> None:
    layer = meta_linear()
    with watch() as ledger, torch.no_grad():
        layer.to_empty(device="cpu")
        layer.weight[:4].zero_()
        layer.weight[4:].copy_(torch.ones(4, 4) * torch.ones(4))
        layer.bias.fill_(0.5)
    report = ledger.report(layer)
    entry = report["weight"]
    assert entry.status == "mixed"
    assert entry.ranges("initialized") == ((0, 64),)
    assert entry.ranges("computed") == ((64, 128),)
    report.check()
    assert report.to_text(all_entries=False).splitlines() == [
        "write ledger: 2 tensors (initialized 1, mixed 1); 0 problem(s)"
    ]


def test_a_partial_write_at_indices_into_unwritten_memory_counts_as_computed_from_it() -> None:
    layer = meta_linear()
    with watch() as ledger, torch.no_grad():
        layer.to_empty(device="cpu")
        layer.weight.masked_fill_(torch.ones(8, 4, dtype=torch.bool), 0.0)  # every element, by values it is given
    assert ledger.report(layer)["weight"].status == "computed from unwritten"


def test_every_name_of_a_tied_tensor_and_every_buffer_is_reported() -> None:
    with watch() as ledger:
        module = nn.Module()
        module.first = nn.Linear(2, 2)
        module.second = nn.Linear(2, 2)
        module.second.weight = module.first.weight
        module.register_buffer("kept", torch.zeros(1))
        module.register_buffer("hidden", torch.zeros(1), persistent=False)
    report = ledger.report(module)
    assert [entry.name for entry in report] == [
        "first.weight", "first.bias", "second.weight", "second.bias", "kept", "hidden"
    ]  # fmt: skip
    assert report["second.weight"].status == "tied"
    assert report["second.weight"].tied_to == "first.weight"
    assert report["kept"].role == "buffer"
    assert report["hidden"].role == "non-persistent buffer"


def test_fake_tensors_are_reported_as_holding_no_data_not_as_unwritten() -> None:
    with watch() as ledger, fake_mode():
        layer = nn.Linear(4, 8)
    report = ledger.report(layer)
    assert {entry.status for entry in report} == {"no data"}
    report.check()


def test_a_module_made_before_the_watch_is_unseen_and_no_problem() -> None:
    layer = nn.Linear(4, 8)
    with watch() as ledger:
        pass
    report = ledger.report(layer)
    assert {entry.status for entry in report} == {"unseen"}
    report.check()


def test_the_report_as_json_holds_every_entry_with_its_byte_ranges() -> None:
    layer = meta_linear()
    with watch() as ledger, torch.no_grad():
        layer.to_empty(device="cpu")
        layer.weight[:2].zero_()
    document = json.loads(ledger.report(layer).to_json())
    assert [entry["name"] for entry in document["entries"]] == ["weight", "bias"]
    weight = document["entries"][0]
    assert [part["ranges"] for part in weight["parts"] if part["kind"] == "unwritten"] == [[[32, 128]]]
    assert document["counts"] == {"unwritten": 2}


def test_the_check_lists_every_problem_by_name_with_expected_got_and_fix() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
    with pytest.raises(LedgerError) as raised:
        ledger.check(layer)
    message = str(raised.value)
    assert message.splitlines()[0].startswith("2 problem(s)")
    for name in ("weight", "bias"):
        assert f"- {name} (parameter" in message
    assert message.count("expected:") == message.count("got:") == message.count("fix:") == 2
    assert "bytes 0-127 of 128 unwritten" in message


def test_the_text_report_shows_problems_first_with_their_bytes() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        nn.init.zeros_(layer.weight)
    text = ledger.report(layer).to_text()
    lines = text.splitlines()
    assert lines[0] == "write ledger: 2 tensors (initialized 1, unwritten 1); 1 problem(s)"
    assert lines[2].startswith("bias")
    assert "unwritten bytes 0-31 of 32" in lines[2]
    assert lines[3].startswith("weight")


def test_watches_nest_and_each_sees_the_writes_inside_it() -> None:
    layer = meta_linear()
    with watch() as outer:
        layer.to_empty(device="cpu")
        with watch() as inner:
            nn.init.zeros_(layer.weight)
    assert outer.report(layer)["weight"].status == inner.report(layer)["weight"].status == "initialized"
    assert outer.report(layer)["bias"].status == "unwritten"
    assert inner.report(layer)["bias"].status == "unseen"


def test_an_initializer_that_reads_its_own_draws_still_initializes() -> None:
    layer = meta_linear()
    with watch() as ledger:
        layer.to_empty(device="cpu")
        nn.init.orthogonal_(layer.weight)  # a QR factorization of normal draws, copied in
        nn.init.trunc_normal_(layer.bias, std=0.02)
    report = ledger.report(layer)
    assert report["weight"].parts[0].what.startswith("nn.init.orthogonal_ at")
    assert report["bias"].parts[0].what.startswith("nn.init.trunc_normal_ at")
    assert {entry.status for entry in report} == {"initialized"}


def watched_names() -> tuple[object, ...]:
    return (torch.load, nn.Module.load_state_dict, safetensors.torch.load_file, safetensors.safe_open, nn.init.normal_)


def a_module_binding_safe_open_by_name(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(  # what `from safetensors import safe_open` leaves in a module's namespace
        "from safetensors import safe_open\n"
        "def read(path, key):\n"
        "    with safe_open(path, framework='pt') as handle:\n"
        "        return handle.get_tensor(key)\n",
        module.__dict__,
    )
    return module


def test_a_module_imported_or_replaced_between_watches_has_its_bound_loaders_seen(tmp_path: Path) -> None:
    path = str(tmp_path / "m.safetensors")
    safetensors.torch.save_file({"w": torch.randn(8, 4)}, path)
    name = "modattrs_test_loader_bound_by_name"
    with watch():  # every module imported so far is seen once
        pass
    try:
        for _ in range(2):  # imported after that watch, then replaced under the same name
            module = sys.modules[name] = a_module_binding_safe_open_by_name(name)
            layer = meta_linear()
            with watch() as ledger:
                layer.to_empty(device="cpu")
                with torch.no_grad():
                    layer.weight.copy_(module.read(path, "w"))
            assert ledger.report(layer)["weight"].status == "loaded"
            assert "'w'" in ledger.report(layer)["weight"].parts[0].what
            assert module.safe_open is safetensors.safe_open  # put back when the watch ended
    finally:
        sys.modules.pop(name, None)


def test_a_function_compiled_inside_a_watch_runs_eagerly_and_its_writes_are_seen() -> None:
    # torch.compile does not compile under a dispatch mode of this kind: it runs the function's frames as they are
    layer = meta_linear(rows=4)
    with watch() as ledger:
        layer.to_empty(device="cpu")
        nn.init.normal_(layer.weight)
        with torch.no_grad():
            layer.bias.copy_(torch.compile(lambda weight: weight.sum(1))(layer.weight))
    assert torch.equal(layer.bias, layer.weight.sum(1))
    report = ledger.report(layer)
    assert (report["weight"].status, report["bias"].status) == ("initialized", "computed")
    report.check()


def test_what_a_watch_changes_is_put_back_when_it_ends_even_by_an_exception() -> None:
    before = watched_names()
    during = []

    def flow() -> None:
        with watch():
            during.append(watched_names())
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        flow()
    assert all(wrapped is not original for wrapped, original in zip(during[0], before, strict=True))
    assert watched_names() == before
    assert not torch._C._len_torch_dispatch_stack()


def test_importing_the_ledger_changes_nothing_in_torch() -> None:
    code = (
        "import torch, torch.nn as nn, safetensors, safetensors.torch\n"
        "before = (torch.load, nn.Module.load_state_dict, nn.Module._apply, safetensors.safe_open)\n"
        "import modattrs.ledger\n"
        "assert (torch.load, nn.Module.load_state_dict, nn.Module._apply, safetensors.safe_open) == before\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(modattrs.ledger.__file__).parents[1])


def test_a_watch_in_a_process_that_never_imported_dynamo_survives_a_flow_importing_it() -> None:
    # torch 2.8: torch._dynamo's own import runs operations that, under a dispatch mode, reach torch._disable_dynamo,
    # which needs torch._dynamo imported whole (transformers' generation code imported inside a watch failed so).
    script = (
        "import sys, torch\n"
        "from modattrs.ledger import watch\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "with watch() as ledger:\n"
        "    with torch.device('meta'):\n"
        "        from transformers import GenerationMixin\n"
        "    layer = torch.nn.Linear(3, 2)\n"
        "ledger.check(layer)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
