"""Cost of ``ShapedTensor.reconstrain`` and of reading ``ShapedTensor.value``.

Run with ``python benchmarks/shaped.py``. Every figure is a ratio against a baseline measured in the same process.
"""

from __future__ import annotations

import torch
from _timing import median_ns, report
from torch import nn

from modattrs import ShapedTensor

ROWS, COLS = 4096, 4096  # 64 MiB of float32


def main() -> None:
    torch.set_num_threads(1)
    source = torch.randn(ROWS, COLS)

    # Shrinking dim 0 by a quarter: the least work is one allocation and one copy of the kept rows.
    kept = ROWS * 3 // 4

    def minimum() -> None:
        out = torch.empty(kept, COLS)
        out.copy_(source.narrow(0, ROWS - kept, kept))

    owner = nn.Module()
    ShapedTensor(owner, "state", source, {0: ROWS, 1: COLS})

    def shrink_then_restore() -> None:
        owner.state.reconstrain(0, kept)
        owner._buffers["_state_data"] = source  # back to the full size, outside the measured call's work
        owner.state._constraints[0] = ROWS

    baseline = median_ns(minimum, number=5, repeat=7)
    measured = median_ns(shrink_then_restore, number=5, repeat=7)
    report("reconstrain(0, 3/4 of 4096) on 64 MiB vs empty + copy_", measured, baseline, target=1.5)

    # Growing: one allocation, one copy, and the zero padding.
    grown = ROWS * 5 // 4

    def minimum_grow() -> None:
        out = torch.empty(grown, COLS)
        out.narrow(0, grown - ROWS, ROWS).copy_(source)
        out.narrow(0, 0, grown - ROWS).zero_()

    def grow_then_restore() -> None:
        owner.state.reconstrain(0, grown)
        owner._buffers["_state_data"] = source
        owner.state._constraints[0] = ROWS

    baseline = median_ns(minimum_grow, number=5, repeat=7)
    measured = median_ns(grow_then_restore, number=5, repeat=7)
    report("reconstrain(0, 5/4 of 4096) on 64 MiB vs empty + copy_ + zero_", measured, baseline, target=1.5)

    plain = nn.Module()
    plain.register_buffer("state", source)
    report(
        "ShapedTensor .value vs reading a registered buffer",
        median_ns(lambda: owner.state.value, number=200_000),
        median_ns(lambda: plain.state, number=200_000),
    )


if __name__ == "__main__":
    main()
