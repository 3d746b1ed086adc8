"""Files saved by released versions keep loading: the pinned files of ``tests/saved/v*/`` (see README.md there),
each loaded in a fresh process by the current code, and the module paths they name kept as a promise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import modattrs
from modattrs import ShapedTensor, VirtualTensor

SAVED = Path(__file__).resolve().parent / "saved"
#: Every pinned version's folder; a new version adds one, and none is ever made again.
FOLDERS = sorted(path for path in SAVED.glob("v*") if path.is_dir() and not path.name.endswith(".partial"))
by_version = pytest.mark.parametrize("folder", FOLDERS, ids=[path.name for path in FOLDERS])
sys.path.insert(0, str(SAVED))
import snapshot  # noqa: E402

#: The classes and functions of the saved model itself, which a weights-only load must be told about, as the docs
#: say ("next to your own classes").
OWN_GLOBALS = "[models.Outer, models.Inner, models.ramp, nn.Linear]"


def run_fresh(folder: Path, *code: str) -> str:
    """Run the ``code`` parts in a new Python process (this interpreter, this environment: PYTHONPATH is
    inherited) that can import the saved models, with ``folder`` and the checks at hand; return what it printed."""
    prelude = f"""
        import pathlib, pickle, sys, warnings
        sys.path.insert(0, {str(SAVED)!r})
        import torch
        from torch import nn
        import modattrs, models, snapshot
        folder = pathlib.Path({str(folder)!r})
    """
    script = "".join(textwrap.dedent(part) for part in (prelude, *code))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_there_are_pinned_files_to_load() -> None:
    assert FOLDERS, f"no pinned folder in {SAVED}"


# --- loading each file -----------------------------------------------------------------------------------------------


@by_version
def test_a_whole_module_saved_by_torch_save_loads_with_weights_only_once_modattrs_safe_globals_are_allowed(
    folder: Path,
) -> None:
    out = run_fresh(
        folder,
        f"""
        with torch.serialization.safe_globals([*modattrs.safe_globals(), *{OWN_GLOBALS}]):
            model = torch.load(folder / "module.pt", weights_only=True)
        snapshot.check(model, folder)
        print("ok")
        """,
    )
    assert out == "ok\n"


@by_version
def test_a_weights_only_load_of_a_whole_module_is_refused_without_modattrs_safe_globals(folder: Path) -> None:
    out = run_fresh(
        folder,
        f"""
        try:
            with torch.serialization.safe_globals({OWN_GLOBALS}):
                torch.load(folder / "module.pt", weights_only=True)
        except pickle.UnpicklingError as error:
            print("refused:", "modattrs." in str(error))
        """,
    )
    assert out == "refused: True\n"


@by_version
def test_a_whole_module_saved_by_torch_save_loads_with_weights_only_false(folder: Path) -> None:
    out = run_fresh(
        folder,
        """
        model = torch.load(folder / "module.pt", weights_only=False)
        snapshot.check(model, folder)
        print("ok")
        """,
    )
    assert out == "ok\n"


@by_version
@pytest.mark.parametrize("file", ["module.pkl", "module_protocol2.pkl"])
def test_a_pickled_whole_module_loads_with_pickle(folder: Path, file: str) -> None:
    out = run_fresh(
        folder,
        f"""
        model = pickle.loads((folder / {file!r}).read_bytes())
        snapshot.check(model, folder)
        print("ok")
        """,
    )
    assert out == "ok\n"


# A freshly built model (another seed, the constructor's shapes and constraints) differs from the saved one, in every
# parameter and every ShapedTensor's data and in constraints, until it loads the saved state.
FRESH_MODEL = """
    torch.manual_seed(1)
    model = models.Outer()
    saved = torch.load(folder / "expected.pt", weights_only=True)["state_dict"]
    before = model.state_dict()
    differ = {key for key in saved if not snapshot.same(before[key], saved[key])}
    shaped = [a.attributes.data for a in snapshot.attributes(model).values() if isinstance(a, modattrs.ShapedTensor)]
    must_differ = {name for name, _ in model.named_parameters()} | {"inner._window_constraints"}
    must_differ |= {f"inner.{data}" for data in shaped if f"inner.{data}" in saved}
    assert must_differ <= differ, f"the fresh model already holds the saved {sorted(must_differ - differ)}"
"""


@by_version
@pytest.mark.parametrize("allowed", ["nothing", "modattrs"])
def test_a_saved_state_dict_loads_with_weights_only_into_a_freshly_built_model(folder: Path, allowed: str) -> None:
    allowlist = "modattrs.safe_globals()" if allowed == "modattrs" else "[]"
    out = run_fresh(
        folder,
        FRESH_MODEL,
        f"""
        with torch.serialization.safe_globals({allowlist}):
            state = torch.load(folder / "state_dict.pt", weights_only=True)
        result = model.load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        snapshot.check(model, folder)
        print("ok")
        """,
    )
    assert out == "ok\n"


@by_version
def test_a_distributed_checkpoint_loads_into_a_freshly_built_model_through_the_resizing_planner(
    folder: Path,
) -> None:
    out = run_fresh(
        folder,
        FRESH_MODEL,
        """
        import torch.distributed.checkpoint as dcp
        state = model.state_dict()
        with warnings.catch_warnings():  # one process, no process group: DCP says it assumes so
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, checkpoint_id=folder / "dcp", planner=modattrs.ResizingLoadPlanner())
        result = model.load_state_dict(state, strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        snapshot.check(model, folder)
        print("ok")
        """,
    )
    assert out == "ok\n"


# --- the names saved files hold --------------------------------------------------------------------------------------


def _only(found: set[object]) -> object:
    assert len(found) == 1, found
    return found.pop()


def _ones(module: nn.Module, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(2, dtype=dtype, device=device)


def saved_objects() -> dict[str, object]:
    """What the current code pickles, by the role it has in a pickled module: asked of a module built now."""
    module = nn.Module()
    attribute = VirtualTensor(module, "x", _ones, cache=True)
    ShapedTensor(module, "s", torch.zeros(2), {0: 2})
    rebuild, (_, _, fields) = attribute.__reduce_ex__(2)
    # The hook objects torch keeps for a module, which its pickle holds (torch's tables, the same on 2.8 to 2.15).
    load_hooks = list(module._load_state_dict_pre_hooks.values())
    return {
        "virtual attribute": type(attribute),
        "shaped attribute": type(module.s),
        "attribute rebuild": rebuild,
        "cache": type(fields["_cache"]),
        "state_dict hook": _only({type(hook) for hook in module._state_dict_hooks.values()}),
        "load hook": _only({type(hook.hook) for hook in load_hooks}),
        "loaded hook": _only({type(hook) for hook in module._load_state_dict_post_hooks.values()}),
        "wrapped hook": _only({type(hook) for hook in load_hooks}),
    }


#: The promise: every module path of modattrs that a pinned file names, and the role of the object it names. Each
#: keeps importing the object the current code saves in that role, wherever the code moves (leave a shim), and
#: modattrs.safe_globals() keeps allowing it under this name. torch's _WrappedHook is here because
#: modattrs.safe_globals() is what allows it. A version that saves a new name adds it; none is ever removed.
PROMISED = {
    "modattrs._attribute.LoadHook": "load hook",
    "modattrs._attribute.LoadedHook": "loaded hook",
    "modattrs._attribute.SaveHook": "state_dict hook",
    "modattrs._attribute._rebuild": "attribute rebuild",
    "modattrs._cache.Cache": "cache",
    "modattrs.shaped.ShapedTensor": "shaped attribute",
    "modattrs.virtual.VirtualTensor": "virtual attribute",
    "torch.nn.modules.module._WrappedHook": "wrapped hook",
}


def allowed_by(entries: list[object]) -> dict[str, object]:
    """The names a torch.serialization allowlist allows, as torch reads it: an object under its ``__module__``
    and ``__qualname__``, an ``(object, name)`` pair under that name."""
    allowed = {}
    for entry in entries:
        if isinstance(entry, tuple):
            allowed[entry[1]] = entry[0]
        else:
            allowed[f"{entry.__module__}.{entry.__qualname__}"] = entry  # type: ignore[attr-defined]
    return allowed


@by_version
def test_names_txt_lists_every_global_each_saved_file_names(folder: Path) -> None:
    assert snapshot.read_names(folder / "NAMES.txt") == snapshot.globals_named(folder)


def test_every_modattrs_name_a_saved_file_names_is_promised() -> None:
    named = {
        name
        for folder in FOLDERS
        for names in snapshot.read_names(folder / "NAMES.txt").values()
        for name in names
        if name.split(".")[0] == "modattrs"
    }
    assert named, "the saved files name nothing of modattrs: they test nothing of its format"
    assert sorted(named - set(PROMISED)) == [], "add these to PROMISED: saved files name them"
    assert {name for name in PROMISED if name.startswith("modattrs")} == named, "PROMISED names what no file names"


@pytest.mark.parametrize("name", sorted(PROMISED))
def test_a_promised_name_imports_the_object_the_current_code_saves_in_its_place(name: str) -> None:
    assert snapshot.imported(name) is saved_objects()[PROMISED[name]]


@pytest.mark.parametrize("name", sorted(PROMISED))
def test_modattrs_safe_globals_allows_a_promised_name_as_the_object_the_current_code_saves(name: str) -> None:
    allowed = allowed_by(modattrs.safe_globals())
    assert name in allowed, f"modattrs.safe_globals() does not allow {name}; allow it as (object, {name!r})"
    assert allowed[name] is saved_objects()[PROMISED[name]]


@by_version
def test_every_name_a_saved_file_names_still_imports(folder: Path) -> None:
    # In a fresh process, where the saved models import as the files name them; protocol 2 spells builtins
    # "__builtin__", which pickle reads as "builtins".
    out = run_fresh(
        folder,
        """
        names = {name for names in snapshot.read_names(folder / "NAMES.txt").values() for name in names}
        for name in sorted(names):
            snapshot.imported(name.replace("__builtin__.", "builtins.", 1))
        print(len(names))
        """,
    )
    assert int(out) > 0
