"""The optional C extension, the one part of the build that pyproject.toml holds no stable setting for (setuptools
calls its ``ext-modules`` table experimental). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional: without a C compiler the install goes on, and VirtualTensor.value runs the same reads in Python.
setup(ext_modules=[Extension("modattrs._speedups", ["modattrs/_speedups.c"], optional=True)])
