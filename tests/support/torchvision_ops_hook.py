"""Let ``import torchvision`` (and so ``import timm``) work where torchvision's compiled ops cannot load.

PyPI's torchvision wheels for Linux are CUDA builds: beside a CPU build of torch (or a torch they were not built
for) their ``_C.so`` fails to load, torchvision carries on without its ops, and then fails in its own
``_meta_registrations`` ("operator torchvision::nms does not exist"). Any package that imports torchvision fails with
it: timm, and transformers as soon as Pillow is installed too (``transformers.LlamaForCausalLM`` included).

Importing this module installs an import hook and nothing else (torch is not imported): at the first
``import torchvision`` it loads torchvision's extension as torchvision would, and only if that fails defines the
two schemas torchvision registers fake kernels for, without kernels (calling them raises). A ``.pth`` file in the
environment's site-packages that imports this module makes every interpreter of the environment do so, the
subprocesses that tests start included.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_library: Any = None  # the torch.library.Library holding the stand-in schemas: they last as long as it does


def prepare_torchvision() -> bool:
    """True if torchvision's compiled ops load; False if the stand-in schemas were defined or torchvision is absent."""
    global _library
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    import torch

    package = next(iter(spec.submodule_search_locations))
    extension = next((n for n in os.listdir(package) if n.startswith("_C.") and n.endswith(".so")), None)
    if extension is not None and _built_for_this_torch(torch.__version__):
        try:
            torch.ops.load_library(os.path.join(package, extension))
            return True
        except (ImportError, OSError):  # what torchvision.extension._load_library catches too
            pass
    # torchvision must not load its ops after the stand-ins are defined (a second definition aborts the process), nor
    # ops built for another torch (torch 2.15 beside torchvision 0.29, PyPI's newest for a while).
    _refuse_loading(torch, package)
    if _library is None and not hasattr(torch.ops.torchvision, "nms"):
        _library = torch.library.Library("torchvision", "DEF")
        for schema in _SCHEMAS:
            _library.define(schema)
    return False


def _built_for_this_torch(torch_version: str) -> bool:
    """Whether the installed torchvision is the release made for this torch (torchvision 0.N+15 for torch 2.N)."""
    from importlib.metadata import version

    vision = version("torchvision").split(".")
    torch_parts = torch_version.split("+")[0].split(".")
    return vision[0] == "0" and int(vision[1]) == int(torch_parts[1]) + 15


def _refuse_loading(torch: Any, package: str) -> None:
    """Make torch.ops.load_library raise OSError for the libraries in torchvision's ``package`` (as for a library
    that cannot load), which torchvision's extension module catches, carrying on without its ops."""
    original = torch.ops.load_library
    package = os.path.realpath(package)

    def load_library(lib_path: str) -> None:
        if os.path.realpath(lib_path).startswith(package + os.sep):
            raise OSError(f"{lib_path}: torchvision's ops are not loaded beside torch {torch.__version__} here")
        original(lib_path)

    torch.ops.load_library = load_library


class _Hook:
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torchvision":
            sys.meta_path.remove(self)
            prepare_torchvision()
        # None: the usual finders import it


if not any(isinstance(finder, _Hook) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Hook())
