"""The package's shape: no module imports, directly or through others, a module that imports it back."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import modattrs

PACKAGE = Path(modattrs.__file__).resolve().parent


def imports_of(path: Path) -> set[str]:
    """The modattrs modules a file imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "modattrs":
            if node.module == "modattrs":  # from modattrs import _generator, ...
                found.update(
                    f"modattrs.{alias.name}" for alias in node.names if (PACKAGE / f"{alias.name}.py").exists()
                )
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("modattrs."))
    return found


def test_no_module_of_the_package_is_part_of_an_import_cycle() -> None:
    graph = {f"modattrs.{path.stem}": imports_of(path) for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    graph["modattrs"] = imports_of(PACKAGE / "__init__.py")
    cycles = []
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for target in graph.get(node, ()):
                if target == start:
                    cycles.append(" -> ".join([*path, target]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*path, target]))
    assert not cycles, "\n".join(sorted(cycles))


# --- private torch names ---------------------------------------------------------------------------------------------

#: The one module that may use private names of torch.
COMPATIBILITY_MODULE = "_torch_private.py"
#: Names bound to torch modules or classes in the package's source, as roots of attribute chains.
TORCH_ROOTS = {"torch", "nn", "aten", "Tensor", "F"}
#: Internal state of torch's fake tensor machinery, which has no underscore but no public contract either.
FAKE_MACHINERY = {
    "fake_tensor_converter",
    "meta_converter",
    "describer",
    "tensor_memo",
    "constant_storage_mapping",
    "invalidate_constant_aliases",
    "in_kernel_invocation",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def torch_private_attributes() -> set[str]:
    """The underscore names torch defines on the objects modattrs handles, instances included."""
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        fake = torch.empty(1)
    objects: list[object] = [
        torch.Tensor,
        torch.empty(1),
        nn.Parameter(torch.empty(1)),
        torch.UntypedStorage(1),
        torch.Generator(),
        nn.Module,
        nn.Linear(1, 1),
        nn.LSTM(1, 1),
        FakeTensor,
        fake,
        FakeTensorMode,
        mode,
        FakeTensorConverter,
        mode.fake_tensor_converter,
    ]
    names = set()
    for obj in objects:
        names.update(name for name in dir(obj) if _private(name))
        names.update(name for name in getattr(obj, "__dict__", {}) if _private(name))
    return names


def own_names() -> set[str]:
    """The underscore names modattrs gives its own functions, classes, attributes and slots."""
    names = set()
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.Name)) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Attribute):
                names.add(node.target.attr)
    return {name for name in names if _private(name)}


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(path: Path, torch_private: set[str]) -> list[str]:
    """Where a file reaches a private name of torch, as ``file:line: name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                name = node.module
        elif isinstance(node, ast.Import):
            name = next((a.name for a in node.names if any(_private(p) for p in a.name.split("."))), None)
        elif isinstance(node, ast.Attribute):
            torch_name = _private(node.attr) and (_root(node.value) in TORCH_ROOTS or node.attr in torch_private)
            if torch_name or node.attr in FAKE_MACHINERY:
                name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in torch_private:
            name = repr(node.value)  # getattr(tensor, "_name"), setattr, hasattr
        if name is not None:
            found.append(f"{path.name}:{node.lineno}: {name}")
    return found


def test_private_torch_names_are_used_only_in_the_compatibility_module() -> None:
    torch_private = torch_private_attributes() - own_names()
    uses = [
        use
        for path in sorted(PACKAGE.glob("*.py"))
        if path.name != COMPATIBILITY_MODULE
        for use in private_torch_uses(path, torch_private)
    ]
    assert not uses, "\n".join(uses)


def test_the_compatibility_module_is_where_private_torch_names_are_found() -> None:
    # The check above finds what it looks for: the compatibility module itself is full of them.
    uses = private_torch_uses(PACKAGE / COMPATIBILITY_MODULE, torch_private_attributes() - own_names())
    for expected in ("_buffers", "_version", "_cdata", "torch._subclasses.fake_tensor", "tensor_memo"):
        assert any(use.endswith((f": {expected}", f": '{expected}'")) for use in uses), expected


def test_the_compiled_hot_path_names_no_private_torch_name() -> None:
    # modattrs/_speedups.c reads nn.Module's buffer table by the name the compatibility module passes to bind().
    # The checkout's copy: wheels leave the C source out, and tox tests an installed wheel.
    source = (Path(__file__).resolve().parents[1] / "modattrs" / "_speedups.c").read_text()
    literals = set(re.findall(r'"(_\w+)"', source))
    assert "_plain_ref" in literals  # what it reads of its own is found
    assert not literals & (torch_private_attributes() - own_names())
