"""The package's shape: the attribute core, the three engines (fake mode in ``modattrs/_fake``, deferred init in
``modattrs/_deferred``, the write ledger in ``modattrs/_ledger``) behind their public faces (``modattrs.fake``,
``modattrs.deferred``, ``modattrs.ledger``), the command line (``modattrs/_cli``); imports run one way, from the faces
down to the core, and private torch names stay in one module. Inside deferred init's engine, each step has a module of
its own and imports and calls only the steps below it (``ENGINE_LAYERS``).
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import modattrs

PACKAGE = Path(modattrs.__file__).resolve().parent
ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def is_module(package: Path, name: str) -> bool:
    """Whether ``name`` in ``package`` is a module: a Python file, a package, or the C extension (its stub)."""
    return any(package.joinpath(name + suffix).exists() for suffix in (".py", ".pyi", "/__init__.py"))


def imports_of(path: Path) -> set[str]:
    """The modattrs modules a file imports anywhere: at the top, inside functions, under TYPE_CHECKING."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "modattrs":
            base = PACKAGE.parent.joinpath(*node.module.split("."))
            modules = {f"{node.module}.{a.name}" for a in node.names if is_module(base, a.name)}
            found |= modules or {node.module}  # from a package: its modules; else the module itself
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("modattrs"))
    return found


def import_graph() -> dict[str, set[str]]:
    return {module_name(path): imports_of(path) for path in package_files()}


def test_no_module_of_the_package_is_part_of_an_import_cycle() -> None:
    graph = import_graph()
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


#: The layers, each allowed to import only itself and those listed after it.
LAYERS: list[tuple[str, set[str]]] = [
    ("the command line", {"modattrs._cli", "modattrs.__main__", "modattrs.default_model"}),
    ("the package's face", {"modattrs"}),
    ("the public faces of the engines", {"modattrs.fake", "modattrs.deferred", "modattrs.ledger"}),
    ("what modattrs changes in torch", {"modattrs._torch_changes"}),
    ("the write ledger's engine", {"modattrs._ledger"}),
    ("deferred init's engine", {"modattrs._deferred"}),
    ("fake mode's engine", {"modattrs._fake"}),
    ("saving and loading", {"modattrs._serialization", "modattrs._checkpoint"}),
    ("the attribute core", {"modattrs.virtual", "modattrs.shaped", "modattrs._attribute", "modattrs._cache"}),
    ("helpers", {"modattrs._module_tensors", "modattrs._names", "modattrs._devices", "modattrs._compiled"}),
    ("the compiled hot paths", {"modattrs._speedups", "modattrs._generator_jump", "modattrs._generator_draws"}),
    ("the compatibility module", {"modattrs._torch_private"}),
]


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer a module belongs to (by its longest listed prefix)."""
    matches = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} belongs to no layer: add it to LAYERS, and to the README's tree"
    return max(matches)[1]


def test_every_module_imports_only_its_own_layer_and_those_below_it() -> None:
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in import_graph().items()
        for target in targets
        if layer_of(target) < layer_of(module)
    ]
    assert not upward, "\n".join(sorted(upward))


# --- deferred init's engine ------------------------------------------------------------------------------------------

#: The layers of deferred init's engine, top down. ``materialize_module`` reads record -> plan -> replay -> swap, each
#: step a module of its own: a module imports only modules of the layers below its own, never one above it, nor
#: another of its own layer (siblings stand apart). Exact randomness is one subpackage (``rng``), which the rest
#: reaches through its face only; inside it, the timeline stands on the rounds of trunc_normal_, which stand on the
#: kernels' models, which stand on the jump and on modattrs' own uniform_ kernel, side by side.
ENGINE_LAYERS: list[tuple[str, set[str]]] = [
    ("the face", {"modattrs.deferred"}),
    (
        "the steps of the face's calls: swapping real tensors in, opaque initializers, ranks comparing sources",
        {"modattrs._deferred.materialize", "modattrs._deferred.opaque", "modattrs._deferred.fingerprint"},
    ),
    ("writing a record, and replaying one", {"modattrs._deferred.recorder", "modattrs._deferred.replay"}),
    ("planning what a shard-local replay makes", {"modattrs._deferred.windows"}),
    ("exact randomness, its face", {"modattrs._deferred.rng"}),
    ("the generator timeline", {"modattrs._deferred.rng.generator"}),
    ("trunc_normal_ as rounds of normal_", {"modattrs._deferred.rng.rejection"}),
    ("the models of torch's random kernels", {"modattrs._deferred.rng.draws"}),
    (
        "the generator's own engine: the jump, and uniform_ drawn faster",
        {"modattrs._deferred.rng.mt19937", "modattrs._deferred.rng.kernels"},
    ),
    ("slicing a record", {"modattrs._deferred.slicing"}),
    ("the record", {"modattrs._deferred.record", "modattrs._deferred.construction", "modattrs._deferred"}),
    ("what the engine knows of torch's operators", {"modattrs._deferred.ops"}),
]


def engine_layer_of(module: str) -> int:
    found = [index for index, (_, modules) in enumerate(ENGINE_LAYERS) if module in modules]
    assert len(found) == 1, f"{module} is in {len(found)} layers of ENGINE_LAYERS: put it in one"
    return found[0]


def engine_modules() -> set[str]:
    return {module for _, modules in ENGINE_LAYERS for module in modules}


def test_every_module_of_deferred_inits_engine_has_one_place_in_its_layers() -> None:
    present = {module for module in import_graph() if module.startswith("modattrs._deferred")} | {"modattrs.deferred"}
    assert sorted(present) == sorted(engine_modules())
    for module in present:
        engine_layer_of(module)


def engine_imports_out_of_order() -> set[tuple[str, str]]:
    """The imports between modules of the engine that go up a layer, or to another module of the same layer."""
    engine = engine_modules()
    return {
        (module, target)
        for module, targets in import_graph().items()
        if module in engine
        for target in targets
        if target in engine and target != module and engine_layer_of(target) <= engine_layer_of(module)
    }


def test_no_module_of_deferred_inits_engine_imports_one_above_it_or_beside_it() -> None:
    wrong = engine_imports_out_of_order()
    described = [
        f"{module} ({ENGINE_LAYERS[engine_layer_of(module)][0]}) imports {target} "
        f"({ENGINE_LAYERS[engine_layer_of(target)][0]})"
        for module, target in sorted(wrong)
    ]
    assert not described, "\n".join(described)


def test_outside_exact_randomness_the_package_imports_only_its_face() -> None:
    reaching_in = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if not module.startswith("modattrs._deferred.rng")
        for target in targets
        if target.startswith("modattrs._deferred.rng.")
    ]
    assert not reaching_in, "\n".join(sorted(reaching_in))


#: The hooks of the recording modes, which torch calls on each operation run under them, whoever runs it: the
#: recorder's value-read watch sees the torch functions that the timeline runs while it settles a record.
TORCH_CALLS_THEM = {"__torch_function__", "__torch_dispatch__"}


def calls_between_engine_modules(run: Callable[[], object]) -> list[tuple[str, str, str]]:
    """The calls from a function of one module of the engine into a function of another while ``run`` runs, as
    (caller's module, callee's module, callee), in the order first made; the frames of other modules between the
    two (torch, contextlib, functools) are skipped."""
    engine = engine_modules()
    seen: dict[tuple[str, str, str], None] = {}

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if callee not in engine:
            return
        caller = frame.f_back
        while caller is not None and caller.f_globals.get("__name__") not in engine:
            caller = caller.f_back
        if caller is not None and caller.f_globals["__name__"] != callee:
            seen.setdefault((caller.f_globals["__name__"], callee, frame.f_code.co_name), None)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(previous)
    return list(seen)


class _Forked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(40, 24)
        with torch.random.fork_rng(devices=[]):  # draws that the generator is put back from
            self.probe = nn.Parameter(torch.rand(3))
        self.second = nn.Linear(40, 24)  # draws from a state given back: a point of the record
        self.norm = nn.LayerNorm(24)
        self.cut = nn.Parameter(torch.empty(8, 24))  # within normal_'s reach: sampled in rounds (2.13 and later)
        nn.init.trunc_normal_(self.cut, a=-2.0, b=2.0)


def test_the_walks_from_deferred_init_and_materialize_module_visit_each_module_of_the_engine_once_on_the_way_down() -> (
    None
):
    # Recording settles the generator where eager code has it after the record (the timeline works that out from the
    # record), and fork_rng asks it for the state at a point of the record; a rank then materializes its shards part
    # by part, each made alone by the planner, its part drawn by the timeline, which jumps over the rest.
    from torch.distributed.fsdp import fully_shard

    from modattrs.deferred import deferred_init, materialize_module
    from tests.support.ranks import fake_world

    def record_shard_and_materialize_part_by_part() -> None:
        model = deferred_init(_Forked)
        for part in (model.second, model.first):
            fully_shard(part, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for part in (model.second, model.first, model):
            materialize_module(part)

    torch.manual_seed(0)
    with fake_world((4,), 1) as mesh:
        calls = calls_between_engine_modules(record_shard_and_materialize_part_by_part)
    climbing = [
        f"{caller} ({ENGINE_LAYERS[engine_layer_of(caller)][0]}) calls {callee}.{name} "
        f"({ENGINE_LAYERS[engine_layer_of(callee)][0]})"
        for caller, callee, name in calls
        if engine_layer_of(callee) <= engine_layer_of(caller) and name not in TORCH_CALLS_THEM
    ]
    assert not climbing, "\n".join(climbing)
    visited = {module for call in calls for module in call[:2]}
    # Each call went down (so along each chain of calls, each module comes once), and every step of the engine is on
    # the way (so that the check has something to look at) ...
    assert visited >= engine_modules() - {
        "modattrs._deferred",  # nothing in it to call
        "modattrs._deferred.rng",  # a face of names defined in the modules below it
        "modattrs._deferred.opaque",  # no opaque initializer in the model
        "modattrs._deferred.fingerprint",  # nothing sent between ranks
        "modattrs._deferred.construction",  # what deferred_init hands the constructor
    }
    # ... and the replay and the planner reach exact randomness through the timeline alone (one walk per replay).
    replay, windows, timeline = (
        "modattrs._deferred.replay",
        "modattrs._deferred.windows",
        "modattrs._deferred.rng.generator",
    )
    into_randomness = {
        (caller, callee)
        for caller, callee, _ in calls
        if caller in (replay, windows) and callee.startswith("modattrs._deferred.rng.")
    }
    assert into_randomness == {(replay, timeline), (windows, timeline)}


def test_the_attribute_core_imports_nothing_from_any_engine() -> None:
    engines = ("modattrs._fake", "modattrs._deferred", "modattrs._ledger", "modattrs.fake", "modattrs.deferred")
    engines += ("modattrs.ledger", "modattrs._torch_changes")
    core = {"modattrs.virtual", "modattrs.shaped", "modattrs._attribute", "modattrs._cache", "modattrs._serialization"}
    crossing = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module in core
        for target in targets
        if target.startswith(engines)
    ]
    assert not crossing, "\n".join(crossing)


def test_the_readme_tree_lists_every_module_of_the_package() -> None:
    readme = (ROOT / "README.md").read_text()
    tree = re.search(r"```text\n\s*modattrs/\n(.*?)```", readme, re.DOTALL)
    assert tree is not None, "the README has no tree of modattrs/ in a text block"
    entries = re.findall(r"^\s*(\w+(?:\.py|\.c|/))", tree.group(1), re.MULTILINE)
    # The checkout's files: wheels leave the C source out, and tox tests an installed wheel.
    checkout = ROOT / "modattrs"
    present = [path.relative_to(checkout) for path in checkout.rglob("*") if path.suffix in (".py", ".c")]
    expected = {
        path.parent.name + "/" if path.name == "__init__.py" and len(path.parts) > 1 else path.name for path in present
    }
    assert sorted(entries) == sorted(expected)


def test_a_newcomer_sees_the_architecture_in_the_top_level_listing() -> None:
    top = sorted(path.name for path in PACKAGE.iterdir() if path.suffix == ".py" or (path / "__init__.py").exists())
    assert len(top) <= 22, top  # each engine adds two: its face and its package
    engines = {"_fake", "_deferred", "_ledger", "fake.py", "deferred.py", "ledger.py"}
    assert engines | {"_cli", "virtual.py", "shaped.py"} <= set(top)


def test_the_ledger_stands_alone_behind_its_face() -> None:
    # The ledger watches flows that use fake mode or deferred init (or neither), and depends on neither to do so;
    # only its face reaches its engine.
    others = ("modattrs._fake", "modattrs._deferred", "modattrs.fake", "modattrs.deferred", "modattrs._torch_changes")
    crossing = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if (module.startswith("modattrs._ledger") and target.startswith(others))
        or (target.startswith("modattrs._ledger") and not module.startswith(("modattrs._ledger", "modattrs.ledger")))
    ]
    assert not crossing, "\n".join(sorted(crossing))


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
        (torch.ones(1, requires_grad=True) * 2).grad_fn,  # an autograd graph node
    ]
    names = set()
    for obj in objects:
        names.update(name for name in dir(obj) if _private(name))
        names.update(name for name in getattr(obj, "__dict__", {}) if _private(name))
    return names


@functools.cache
def torch_classes() -> frozenset[str]:
    """The names of torch's classes, and of the autograd graph nodes its ``autograd.Function`` subclasses make: a
    string equal to one is a match on a torch class by name, which only the compatibility module may make."""
    import torch
    import torch.distributed.tensor
    import torch.utils.checkpoint

    names = set()
    with warnings.catch_warnings():  # reading some module attributes warns that they are deprecated
        warnings.simplefilter("ignore")
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "torch" and module is not None:
                names.update(
                    value.__name__
                    for value in list(vars(module).values())
                    if isinstance(value, type) and str(value.__module__).startswith("torch")
                )
    functions = [torch.autograd.Function]
    while functions:
        cls = functions.pop()
        names.add(f"{cls.__name__}Backward")
        functions.extend(cls.__subclasses__())
    return frozenset(name for name in names if name[:1].isupper())


@functools.cache
def own_classes() -> frozenset[str]:
    return frozenset(
        node.name
        for path in package_files()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    )


def own_names() -> set[str]:
    """The underscore names modattrs gives its own functions, classes, attributes and slots."""
    names = set()
    for path in package_files():
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
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value in torch_classes() - own_classes()
        ):
            name = repr(node.value)  # type(x).__name__ == "SomeTorchClass", getattr(module, "SomeTorchClass")
        if name is not None:
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return found


def test_private_torch_names_are_used_only_in_the_compatibility_module() -> None:
    torch_private = torch_private_attributes() - own_names()
    uses = [
        use
        for path in package_files()
        if path.relative_to(PACKAGE).as_posix() != COMPATIBILITY_MODULE
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


# --- public names ----------------------------------------------------------------------------------------------------

PUBLIC_MODULES = ("modattrs", "modattrs.fake", "modattrs.deferred", "modattrs.ledger")


def public_objects() -> list[tuple[str, object]]:
    """Every class and function the public modules export, with the module exporting it."""
    import importlib

    found = []
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        for exported in module.__all__:
            value = getattr(module, exported)
            if isinstance(value, type) or (callable(value) and hasattr(value, "__qualname__")):
                found.append((f"{name}.{exported}", value))
    return found


def test_public_names_say_a_public_module_they_can_be_imported_from() -> None:
    import importlib

    wrong = []
    for path, value in public_objects():
        module = getattr(value, "__module__", "")
        named = getattr(importlib.import_module(module), getattr(value, "__qualname__", ""), None)
        if any(part.startswith("_") for part in module.split(".")) or named is not value:
            wrong.append(f"{path}: __module__ is {module!r}")
    assert not wrong, "\n".join(wrong)
    assert {path for path, _ in public_objects()} >= {
        "modattrs.deferred.DeferredInitError", "modattrs.fake.GPU", "modattrs.ledger.LedgerError"
    }  # fmt: skip


def test_the_command_line_reaches_the_engines_only_through_their_packages_faces() -> None:
    engine_modules = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.startswith("modattrs._cli")
        for target in targets
        if target.startswith(("modattrs._fake.", "modattrs._deferred.", "modattrs._ledger"))
    ]
    assert not engine_modules, "\n".join(engine_modules)


def test_every_package_of_the_checkout_is_one_that_pyproject_installs() -> None:
    # setuptools installs the packages pyproject.toml lists, no others: a package left out imports in a checkout
    # (and an editable install) and is missing from every wheel (the write ledger's was, once).
    tomllib = pytest.importorskip("tomllib", reason="Python 3.10 has no TOML reader")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    checkout = ROOT / "modattrs"
    present = {
        ".".join(("modattrs", *init.parent.relative_to(checkout).parts)) for init in checkout.rglob("__init__.py")
    }
    assert listed == present
