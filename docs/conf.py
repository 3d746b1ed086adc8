"""Sphinx configuration for the modattrs documentation."""

from __future__ import annotations

import modattrs

project = "modattrs"
author = "The modattrs developers"
copyright = "2026, The modattrs developers"
release = modattrs.__version__
version = release

extensions = ["sphinx.ext.autodoc", "sphinx.ext.doctest", "sphinx.ext.napoleon"]
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = "modattrs"

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Every example starts from the same imports and seed.
doctest_global_setup = """
import torch
from torch import nn
import modattrs
from modattrs import ShapedTensor, VirtualTensor
torch.manual_seed(0)
"""
