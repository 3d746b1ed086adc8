"""What a saved model holds, as plain data, and the globals a saved file names.

``make_files.py`` writes ``expected.pt`` and ``expected.json`` with :func:`describe` and ``NAMES.txt`` with
:func:`globals_named`; ``tests/test_saved_format.py`` loads each pinned file in a fresh process and checks the
result with :func:`check`. Nothing here is named by a saved file.
"""

from __future__ import annotations

import importlib
import io
import json
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor

#: The pickle files of a pinned folder, by name. The ``.pt`` files are torch.save zips.
PICKLES = ("module.pt", "module.pkl", "module_protocol2.pkl", "state_dict.pt", "expected.pt")
#: The distributed checkpoint's files: a plain pickle, and torch.save zips one after another.
DCP_METADATA = "dcp/.metadata"
DCP_DATA = "dcp/__0_0.distcp"

# --- what a model holds ----------------------------------------------------------------------------------------------


def attributes(model: nn.Module) -> dict[str, VirtualTensor | ShapedTensor]:
    """Every modattrs attribute reachable in ``model``, aliases included, by path."""
    found: dict[str, VirtualTensor | ShapedTensor] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, (VirtualTensor, ShapedTensor)):
                found[_join(prefix, name)] = value
    return dict(sorted(found.items()))


def facts(model: nn.Module, attribute: VirtualTensor | ShapedTensor) -> dict[str, Any]:
    """What ``attribute`` says of itself, as JSON."""
    owners = {id(module): path for path, module in model.named_modules()}
    owner = attribute.owner
    assert owner is not None, f"{attribute!r} has no owner"
    common = {"kind": type(attribute).__name__, "owner": owners[id(owner)], "name": attribute.name}
    if isinstance(attribute, VirtualTensor):
        return {
            **common,
            "reference": attribute.attributes.ref,
            "persist": attribute.persist,
            "follow_dtype": attribute.follow_dtype,
            "dtype": str(attribute.dtype),
            "device": str(attribute.device),
            "dtype_from": attribute.dtype_from,
            "cached": attribute.cached,
            "depends_on": list(attribute.depends_on),
        }
    value = attribute.value
    return {
        **common,
        "data": attribute.attributes.data,
        "constraints": sorted([dim, size] for dim, size in attribute.constraints.items()),
        "dimensionality": attribute.dimensionality,
        "strict": attribute.strict,
        "live": attribute.live,
        "persist_data": attribute.persist_data,
        "persist_constraints": attribute.persist_constraints,
        "parameter": isinstance(value, nn.Parameter),
        "shape": None if value is None else list(value.shape),
    }


def describe(model: nn.Module) -> tuple[dict[str, Any], dict[str, dict[str, Tensor]]]:
    """``model``'s attributes and tensors: facts as JSON, and tensors (plain, detached) by section and path."""
    found = attributes(model)
    state = model.state_dict()
    buffers = dict(model.named_buffers())
    described = {
        "attributes": {path: facts(model, attribute) for path, attribute in found.items()},
        "state_dict_keys": list(state),
        "parameters": [name for name, _ in model.named_parameters()],
        "buffers": list(buffers),
        "non_persistent_buffers": [name for name in buffers if name not in state],
    }
    values = {path: attribute.value for path, attribute in found.items()}
    tensors = {
        "values": {path: value.detach() for path, value in values.items() if value is not None},
        "parameters": {name: parameter.detach() for name, parameter in model.named_parameters()},
        "buffers": {name: buffer.detach() for name, buffer in buffers.items()},
        "state_dict": {key: value.detach() for key, value in state.items()},
    }
    return described, tensors


def same(got: Tensor, expected: Tensor) -> bool:
    return got.dtype == expected.dtype and got.shape == expected.shape and bool(torch.equal(got, expected))


def compare(model: nn.Module, folder: Path) -> None:
    """Assert that ``model`` holds what the model saved in ``folder`` held: every fact and every tensor."""
    expected_facts = json.loads((folder / "expected.json").read_text())["model"]
    expected_tensors = torch.load(folder / "expected.pt", weights_only=True)
    got_facts, got_tensors = describe(model)
    assert list(got_facts["attributes"]) == list(expected_facts["attributes"]), "attribute paths differ"
    for path, expected in expected_facts["attributes"].items():
        got = got_facts["attributes"][path]
        for key, value in expected.items():  # the facts recorded then: a later describe() may add some
            assert got[key] == value, f"{path}.{key}: got {got[key]!r}, saved {value!r}"
    for key in ("state_dict_keys", "parameters", "buffers", "non_persistent_buffers"):
        assert got_facts[key] == expected_facts[key], f"{key}: got {got_facts[key]}, saved {expected_facts[key]}"
    for section, tensors in expected_tensors.items():
        assert list(got_tensors[section]) == list(tensors), f"{section}: keys differ"
        for key, tensor in tensors.items():
            got_tensor = got_tensors[section][key]
            assert same(got_tensor, tensor), f"{section} {key}: got {got_tensor}, saved {tensor}"
    # Binding: each attribute is its owner's, and an alias is the very object its owner holds.
    found = attributes(model)
    for path, attribute in found.items():
        owner_path = expected_facts["attributes"][path]["owner"]
        assert attribute.owner is model.get_submodule(owner_path), f"{path} is bound to another module"
        own_path = _join(owner_path, attribute.name)
        assert found[own_path] is attribute, f"{path} is not the attribute {own_path}"


def exercise(model: nn.Module) -> None:
    """Assert that the loaded ``model``'s attributes work: hooks save and load, constraints refuse, caches cache,
    values follow conversions, and deleting an attribute removes what it registered. Changes ``model``."""
    own = {path: a for path, a in attributes(model).items() if _owner_path(model, path, a) is not None}
    result = model.load_state_dict(model.state_dict(), strict=True)
    assert not result.missing_keys, result
    assert not result.unexpected_keys, result
    for path, attribute in own.items():
        if isinstance(attribute, ShapedTensor) and attribute.value is not None and attribute.constraints:
            _refuses_a_wrong_shape(model, path, attribute)
    for path, attribute in own.items():
        if isinstance(attribute, VirtualTensor) and attribute.cached:
            first = attribute.value
            assert attribute.value is first, f"{path}: a cached value was computed again"
            attribute.invalidate()
            assert attribute.value is not first, f"{path}: invalidate() kept the value"
            assert same(attribute.value, first), path
    dtypes = {path: a.dtype for path, a in own.items() if isinstance(a, VirtualTensor)}
    model.double()
    for path, attribute in own.items():
        if isinstance(attribute, VirtualTensor):
            follows = attribute.follow_dtype or attribute.dtype_from is not None
            expected = torch.float64 if follows else dtypes[path]
            assert attribute.value.dtype == expected, f"{path}: {attribute.value.dtype}, expected {expected}"
        elif attribute.value is not None and attribute.value.is_floating_point():
            assert attribute.value.dtype == torch.float64, f"{path}: {attribute.value.dtype}"
    # Once the module and every alias let go of an attribute, its finalizer removes what it registered.
    registered = {path: (a.owner, _registered_name(a)) for path, a in own.items()}
    derived_keys = {_join(path.rpartition(".")[0], name) for path, a in own.items() for name in a.attributes}
    plain_keys = [key for key in model.state_dict() if key not in derived_keys]
    for path in attributes(model):
        prefix, _, name = path.rpartition(".")
        delattr(model.get_submodule(prefix), name)
    del own, attribute
    for path, (owner, derived) in registered.items():
        assert owner is not None
        tensors = {*dict(owner.named_buffers(recurse=False)), *dict(owner.named_parameters(recurse=False))}
        assert derived not in tensors, f"{path}: deleting the attribute left {derived}"
    assert list(model.state_dict()) == plain_keys, "deleting the attributes left state_dict keys of theirs"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _registered_name(attribute: VirtualTensor | ShapedTensor) -> str:
    return attribute.attributes.ref if isinstance(attribute, VirtualTensor) else attribute.attributes.data


def _owner_path(model: nn.Module, path: str, attribute: VirtualTensor | ShapedTensor) -> str | None:
    """The path of the module holding ``attribute`` at ``path``, if it is that module's own (not an alias)."""
    prefix, _, name = path.rpartition(".")
    return prefix if attribute.owner is model.get_submodule(prefix) and attribute.name == name else None


def _refuses_a_wrong_shape(model: nn.Module, path: str, attribute: ShapedTensor) -> None:
    value = attribute.value
    assert value is not None
    dim, size = next(iter(attribute.constraints.items()))
    wrong = list(value.shape)
    wrong[dim] = size + 1
    assert not attribute.compatible(torch.zeros(wrong)), path
    if attribute.live:
        with pytest.raises(ValueError, match="violates the constraints"):
            attribute.value = torch.zeros(wrong)
        assert attribute.value is value, f"{path}: a refused assignment changed the value"
    key = _join(path.rpartition(".")[0], attribute.attributes.data)
    state = model.state_dict()
    if key in state:
        state[key] = torch.zeros(wrong)
        with pytest.raises(RuntimeError, match="violates the constraints"):
            model.load_state_dict(state)
        assert attribute.value is not None, path
        assert same(attribute.value, value), f"{path}: a refused load changed the value"


def check(model: nn.Module, folder: Path) -> None:
    compare(model, folder)
    exercise(model)


# --- the globals a file names ----------------------------------------------------------------------------------------

#: How torch.save (legacy format, used by torch.storage's pickling of a storage) begins: its magic number, pickled.
LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)

_STRINGS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_BYTES = {"SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "BYTEARRAY8"}


def pickled_globals(stream: io.BytesIO, nested: bool = True) -> Iterator[str]:
    """The globals (``module.qualname``, as spelled in the pickle) one pickle at ``stream`` names, and with
    ``nested`` those of the torch storages pickled inside it (``torch.storage._load_from_bytes`` of a legacy
    torch.save)."""
    stack: list[object] = []  # what the stack holds, as far as names go: strings, and None for anything else
    memo: dict[int, object] = {}
    for opcode, argument, _ in pickletools.genops(stream):
        name = opcode.name
        if name in ("GLOBAL", "INST"):
            yield str(argument).replace(" ", ".", 1)
            stack.append(None)
        elif name == "STACK_GLOBAL":  # protocol 4: module and name were pushed as strings, perhaps from the memo
            module, qualname = stack[-2], stack[-1]
            assert isinstance(module, str), module
            assert isinstance(qualname, str), qualname
            del stack[-2:]
            yield f"{module}.{qualname}"
            stack.append(None)
        elif name in _STRINGS or name in _BYTES:
            stack.append(argument)
            inner = argument if isinstance(argument, (bytes, bytearray)) else _latin1(argument)
            if nested and inner is not None and inner.startswith(LEGACY_MAGIC):  # protocol 2: bytes as latin-1
                yield from _legacy_globals(bytes(inner))
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1] if stack else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(argument)] = stack[-1] if stack else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(int(argument)))
        else:
            stack.append(None)


def _latin1(text: object) -> bytes | None:
    try:
        return text.encode("latin-1") if isinstance(text, str) else None
    except UnicodeEncodeError:
        return None


def _legacy_globals(data: bytes) -> Iterator[str]:
    # Five pickles (magic number, protocol version, system info, the object, storage keys), then raw data.
    stream = io.BytesIO(data)
    for _ in range(5):
        yield from pickled_globals(stream)


def _zip_pickle(data: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        (pickled,) = (name for name in archive.namelist() if name.endswith("/data.pkl"))
        return archive.read(pickled)


def globals_named(folder: Path) -> dict[str, list[str]]:
    """Every global each pinned file of ``folder`` names, sorted, by file."""
    named: dict[str, list[str]] = {}
    for file in PICKLES:
        data = (folder / file).read_bytes()
        if file.endswith(".pt"):
            data = _zip_pickle(data)
        named[file] = sorted(set(pickled_globals(io.BytesIO(data))))
    metadata = (folder / DCP_METADATA).read_bytes()
    named[DCP_METADATA] = sorted(set(pickled_globals(io.BytesIO(metadata))))
    # Each tensor of the checkpoint is a torch.save zip at the offset its metadata gives.
    data = (folder / DCP_DATA).read_bytes()
    found: set[str] = set()
    for item in pickle.loads(metadata).storage_data.values():
        found.update(pickled_globals(io.BytesIO(_zip_pickle(data[item.offset : item.offset + item.length]))))
    named[DCP_DATA] = sorted(found)
    return named


def imported(name: str) -> object:
    """The object a pickle naming ``name`` loads: the longest importable module, then attributes."""
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for part in parts[split:]:
            found = getattr(found, part)
        return found
    raise ModuleNotFoundError(name)


def read_names(path: Path) -> dict[str, list[str]]:
    """``NAMES.txt``: ``[file]`` headers, each followed by the globals that file names, one a line."""
    named: dict[str, list[str]] = {}
    current: list[str] = []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = named.setdefault(line[1:-1], [])
        else:
            current.append(line)
    return named
