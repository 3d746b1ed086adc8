"""What modattrs' own ``uniform_`` kernel costs (``modattrs/_deferred/rng/kernels.py``), against torch's.

Run with ``python benchmarks/uniform_kernel.py`` (about 30 seconds). For each dtype the kernel draws and sizes from
its threshold (``kernels.FEWEST``) to 16M elements, it times ``kernels.uniform_`` (copying the generator's state
out and back in included) and torch's ``Tensor.uniform_`` on the same tensor and a private generator, their runs
alternating (``_timing.paired_ns``: median of 21 runs each, CPU time of this thread, one intra-op thread), and prints
nanoseconds per element and the ratio torch's over modattrs'. Every pair of runs first checks that both give the same
elements and the same generator state. Then the form each dtype was drawn in (the one that agreed with torch's
kernel in this process). Timings are printed, never asserted.
"""

from __future__ import annotations

import functools
import os

import torch
from _timing import paired_ns

from modattrs._deferred.rng import kernels

DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SIZES = (kernels.FEWEST, 65_536, 1 << 20, 1 << 24)


def checked(dtype: torch.dtype, numel: int) -> None:
    """Both kernels give the same elements and state from the same state (else the timing would mean nothing)."""
    ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    got, expected = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
    if not kernels.uniform_(got, -0.05, 0.05, ours):
        raise SystemExit(f"modattrs' kernel does not draw {dtype} here (no agreeing form, or not built)")
    expected.uniform_(-0.05, 0.05, generator=theirs)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    if not torch.equal(got.view(bits), expected.view(bits)) or not torch.equal(ours.get_state(), theirs.get_state()):
        raise SystemExit(f"FAILED: modattrs' kernel and torch's differ on {numel} elements of {dtype}")


def main() -> None:
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    print(f"uniform_ on one thread, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    print(f"{'dtype':10s} {'elements':>10s} {'torch':>10s} {'modattrs':>10s} {'torch / modattrs':>17s}")
    for dtype in DTYPES:
        for numel in SIZES:
            checked(dtype, numel)
            tensor = torch.empty(numel, dtype=dtype)
            generator = torch.Generator().manual_seed(0)
            number = max(1, (1 << 22) // numel)
            ours_ns, torch_ns = paired_ns(
                functools.partial(kernels.uniform_, tensor, -0.05, 0.05, generator),
                functools.partial(tensor.uniform_, -0.05, 0.05, generator=generator),
                number,
            )
            print(
                f"{str(dtype).removeprefix('torch.'):10s} {numel:10,d} {torch_ns / numel:8.2f} ns "
                f"{ours_ns / numel:8.2f} ns {torch_ns / ours_ns:16.1f}x"
            )
    forms = ", ".join(f"{str(dtype).removeprefix('torch.')} {form}" for dtype, form in kernels.forms().items())
    print(f"forms (that agreed with torch's kernel here): {forms}")
    print(f"load average {load:.2f} before and {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
