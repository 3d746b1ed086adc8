"""The optional C extensions, the one part of the build that pyproject.toml holds no stable setting for (setuptools
calls its ``ext-modules`` table experimental). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

# optional: without a C compiler the install goes on, and VirtualTensor.value runs the same reads in Python, the
# generator's jumps the same sums in torch.
setup(
    ext_modules=[
        Extension("modattrs._speedups", ["modattrs/_speedups.c"], optional=True),
        Extension("modattrs._generator_jump", ["modattrs/_generator_jump.c"], optional=True),
    ]
)
