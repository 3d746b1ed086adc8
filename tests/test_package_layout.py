"""The package's shape: no module imports, directly or through others, a module that imports it back."""

from __future__ import annotations

import ast
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
