"""Write this version's pinned saved files into ``tests/saved/v<version>/``; see README.md there.

Run by hand, once per version, from the checkout, with the oldest torch CI runs (files saved by the oldest torch
must load on the newer ones), e.g.::

    PYTHONPATH=. path/to/torch-2.8/bin/python tests/saved/make_files.py

It refuses to write a folder that exists: files of a released version are never made again.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import pickle
import platform
import re
import shutil
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import models  # noqa: E402
import snapshot  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import modattrs  # noqa: E402


def saved_model() -> models.Outer:
    """The model every file holds: seeded, and changed after construction as a used model is, so that a freshly
    built one (another seed, the constructor's shapes and constraints) differs from it everywhere."""
    torch.manual_seed(0)
    model = models.Outer()
    inner = model.inner
    inner.history.value = torch.arange(9.0).reshape(3, 3)  # free dim 0: 2 -> 3
    inner.gain.value = torch.linspace(0, 1, 15).reshape(3, 5)  # parameter data, free dim 1: 2 -> 5
    inner.window.reconstrain(-1, 6)  # constraints {0: 1, -1: 4} -> {0: 1, -1: 6}
    inner.window.value = torch.arange(6.0).reshape(1, 6)
    for attribute in snapshot.attributes(model).values():
        attribute.value  # fills the caches: a pickle must leave them out
    return model


def oldest_torch() -> str:
    match = re.search(r'"torch>=([0-9.]+)"', (HERE.parents[1] / "pyproject.toml").read_text())
    if match is None:
        raise SystemExit('cannot find the oldest supported torch ("torch>=X") in pyproject.toml')
    return match.group(1)


def unpickled_globals(data: bytes) -> set[str]:
    """Every global that unpickling ``data`` looks up: a check of snapshot.pickled_globals on plain pickles."""
    found: set[str] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            found.add(f"{module}.{name}")
            return super().find_class(module, name)

    Recording(io.BytesIO(data)).load()
    return found


def write(folder: Path) -> None:
    model = saved_model()
    torch.save(model, folder / "module.pt")
    (folder / "module.pkl").write_bytes(pickle.dumps(model))
    (folder / "module_protocol2.pkl").write_bytes(pickle.dumps(model, protocol=2))
    torch.save(model.state_dict(), folder / "state_dict.pt")
    # One process, no process group: DCP says it assumes so, with a warning. A relative checkpoint id, which the
    # metadata records: not this machine's paths.
    cwd = Path.cwd()
    os.chdir(folder)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            warnings.filterwarnings("ignore", "TypedStorage is deprecated")
            dcp.save(model.state_dict(), checkpoint_id="dcp", no_dist=True)
    finally:
        os.chdir(cwd)
    described, tensors = snapshot.describe(model)
    torch.save(tensors, folder / "expected.pt")
    made_with = {
        "modattrs": modattrs.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "module.pkl protocol": pickle.DEFAULT_PROTOCOL,
        "module_protocol2.pkl protocol": 2,
        "torch.save protocol": 2,
    }
    (folder / "expected.json").write_text(json.dumps({"made_with": made_with, "model": described}, indent=1) + "\n")

    named = snapshot.globals_named(folder)
    for file in ("module.pkl", "module_protocol2.pkl", snapshot.DCP_METADATA):
        # The scan of the pickle stream, against what unpickling it looks up (torch.storage._load_from_bytes
        # unpickles the storages nested in a plain pickle by itself).
        data = (folder / file).read_bytes()
        scanned = set(snapshot.pickled_globals(io.BytesIO(data), nested=False))
        assert scanned == unpickled_globals(data), (file, scanned ^ unpickled_globals(data))
    lines = [
        "# Every global each file of this folder names (module.qualname as the pickle spells it: protocol 2 writes",
        "# builtins as __builtin__), by file; nested torch storages of the plain pickles included. Written by",
        "# tests/saved/make_files.py; tests/test_saved_format.py checks it against the files.",
    ]
    for file, names in named.items():
        lines += [f"[{file}]", *names]
    (folder / "NAMES.txt").write_text("\n".join(lines) + "\n")


def main() -> None:
    version = importlib.metadata.version("modattrs")
    if version != modattrs.__version__:
        raise SystemExit(
            f"the installed metadata says modattrs {version}, the imported package {modattrs.__version__} "
            f"({modattrs.__file__}); reinstall the checkout (pip install -e .) so that they agree"
        )
    oldest = oldest_torch()
    if torch.__version__.split("+")[0].split(".")[:2] != oldest.split(".")[:2]:
        raise SystemExit(f"save with the oldest torch CI runs, {oldest}: this is torch {torch.__version__}")
    folder = HERE / f"v{version}"
    if folder.exists():
        raise SystemExit(f"{folder} exists: pinned files are never made again; a new version gets a new folder")
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    write(partial)
    partial.rename(folder)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size:>8}  {path.relative_to(HERE)}")


if __name__ == "__main__":
    main()
