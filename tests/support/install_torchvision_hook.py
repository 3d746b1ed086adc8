"""Install ``torchvision_ops_hook`` into the running interpreter's environment: the module, and a ``.pth`` file
that imports it at every start-up, in site-packages. tox runs this before the tests (``commands_pre``); running it
again changes nothing. Usage: ``python tests/support/install_torchvision_hook.py``.

PyPI's torchvision wheels for Linux are CUDA builds, whose compiled ops do not load beside the CPU build of torch
the ``tests`` environment pins; without the hook ``import timm`` fails (see ``torchvision_ops_hook``).
"""

from __future__ import annotations

import pathlib
import shutil
import sysconfig

here = pathlib.Path(__file__).resolve().parent
site = pathlib.Path(sysconfig.get_paths()["purelib"])
shutil.copyfile(here / "torchvision_ops_hook.py", site / "torchvision_ops_hook.py")
(site / "torchvision_ops_hook.pth").write_text("import torchvision_ops_hook\n")
print(f"torchvision_ops_hook installed in {site}")
