"""The optional C extensions, the one part of the build that pyproject.toml holds no stable setting for (setuptools
calls its ``ext-modules`` table experimental). Everything else is in pyproject.toml."""

import os

from setuptools import Extension, setup

# optional: without a C compiler the install goes on, and VirtualTensor.value runs the same reads in Python, the
# generator's jumps the same sums in torch, and torch's own kernels draw.
setup(
    ext_modules=[
        Extension("modattrs._speedups", ["modattrs/_speedups.c"], optional=True),
        Extension("modattrs._generator_jump", ["modattrs/_generator_jump.c"], optional=True),
        # Each multiply and add rounded as written (the kernel computes fused multiply-adds where it says so): the
        # draws must be torch's bits. A compiler that does not know the flag (MSVC, which does not contract unless
        # told to) warns and goes on; either way each form is checked against torch's kernel before it draws.
        Extension(
            "modattrs._generator_draws",
            ["modattrs/_generator_draws.c"],
            extra_compile_args=["-ffp-contract=off"],
            libraries=[] if os.name == "nt" else ["m"],
            optional=True,
        ),
    ]
)
