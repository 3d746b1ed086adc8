"""What parallelizing a deferred model costs, against the same calls on a meta-device model (issue 35, item 3).

Run with ``python benchmarks/parallelize.py`` (about 4 minutes on a 2-core machine), ``--quick`` for 8 blocks only
and fewer runs, ``--runs N`` for the best of N runs (5 by default). On the Llama-shaped decoder of
``benchmarks/shard_local.py`` (hidden 1024, intermediate 2816, vocab 32000) with 8 and 32 blocks, as rank 0 and as
the middle rank (N/2) of torch's fake process group (one process plays each rank in turn), it times, deferred and
on the meta device in this process, runs alternating:

* ``fully_shard`` of each block, then of the root, over a 1-D mesh of 8 and of 64 ranks;
* ``parallelize_module`` of each block (``ColwiseParallel`` for q, k, v, gate and up, ``RowwiseParallel`` for o and
  down, ``src_data_rank=None``) over the ``tp`` dimension, then ``fully_shard`` of each block and of the root over
  ``dp``, on 2-D meshes dp 4 x tp 2 and dp 8 x tp 8.

The ratio is deferred over meta, for each of the two ranks (target 3x); the row's verdict is the higher one's. The
ranks may differ: FSDP2 reads chunk 0 of each parameter for the padded size, which on rank 0 is the rank's own chunk
and on every other rank is read for its size alone (cut from a meta tensor: change 15 of docs/torch_changes.rst).
Beside them, the middle rank's whole path on the deferred model: ``deferred_init``, the parallelization, then
``materialize_module`` (on one thread), with the materialization alone beside it: how much of what a rank pays is
its draws. Times are the CPU time of this thread (``time.thread_time``, see ``_timing``), best of the runs; the load
average is printed. Timings are printed, never asserted; the values that these paths give are checked by the tests
(``tests/test_shard_local_replay.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from _timing import collected
from shard_local import FULL, SEED, Decoder, Dims, as_in_a_fresh_process, one_thread
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Registers the "fake" backend: collectives that do nothing, so one process can play any rank of any world size.
from torch.testing._internal.distributed.fake_pg import FakeStore

from modattrs.deferred import deferred_init, materialize_module

TARGET = 3.0
BLOCKS = (8, 32)


@dataclass(frozen=True)
class Layout:
    label: str
    dp: int
    tp: int  # 0: a 1-D mesh of dp ranks, no tensor parallelism

    @property
    def world_size(self) -> int:
        return self.dp * max(self.tp, 1)

    @property
    def ranks(self) -> tuple[int, int]:
        """The ranks measured: rank 0, and the middle one, which stands for every rank but 0."""
        return 0, self.world_size // 2


LAYOUTS = (
    Layout("fully_shard, 8 ranks", 8, 0),
    Layout("fully_shard, 64 ranks", 64, 0),
    Layout("parallelize_module + fully_shard, dp 4 x tp 2", 4, 2),
    Layout("parallelize_module + fully_shard, dp 8 x tp 8", 8, 8),
)

TP_PLAN = {
    "attention.q_proj": ColwiseParallel(),
    "attention.k_proj": ColwiseParallel(),
    "attention.v_proj": ColwiseParallel(),
    "attention.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


@contextlib.contextmanager
def fake_world(layout: Layout, rank: int = 0) -> Iterator[tuple[DeviceMesh, DeviceMesh | None]]:
    """This process as ``rank`` of the layout's world on torch's fake process group: the dp mesh and the tp mesh."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        if not layout.tp:
            yield init_device_mesh("cpu", (layout.dp,)), None
        else:
            mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
            yield mesh["dp"], mesh["tp"]
    finally:
        dist.destroy_process_group()


def parallelize(model: nn.Module, dp: DeviceMesh, tp: DeviceMesh | None) -> None:
    """Tensor parallelism on each block (when there is a tp mesh), then ``fully_shard`` of each block and the root."""
    assert isinstance(model, Decoder)
    for block in model.layers:
        if tp is not None:
            parallelize_module(block, tp, TP_PLAN, src_data_rank=None)
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def build_deferred(dims: Dims) -> nn.Module:
    torch.manual_seed(SEED)
    return deferred_init(Decoder, dims)


def build_meta(dims: Dims) -> nn.Module:
    with torch.device("meta"):
        return Decoder(dims)


def seconds_of(fn: Callable[[], object]) -> float:
    """CPU seconds of this thread for one call of ``fn``, with the collector off (``_timing.collected``)."""
    with collected():
        start = time.thread_time()
        fn()
        return time.thread_time() - start


def parallelize_s(build: Callable[[], nn.Module], dp: DeviceMesh, tp: DeviceMesh | None) -> float:
    model = build()
    return seconds_of(lambda: parallelize(model, dp, tp))


@dataclass
class Measure:
    deferred: float = math.inf
    meta: float = math.inf
    path: float = math.inf  # deferred_init, parallelize, materialize
    materialize: float = math.inf


def whole_path(dims: Dims, dp: DeviceMesh, tp: DeviceMesh | None) -> tuple[float, float]:
    """A rank's whole path on a deferred model, and its materialization alone, in CPU seconds of this thread."""
    as_in_a_fresh_process()
    with collected(), one_thread():
        start = time.thread_time()
        model = build_deferred(dims)
        parallelize(model, dp, tp)
        before = time.thread_time()
        materialize_module(model)
        end = time.thread_time()
    return end - start, end - before


def measure(dims: Dims, layout: Layout, rank: int, runs: int, whole_path_too: bool) -> Measure:
    best = Measure()
    with fake_world(layout, rank) as (dp, tp):
        parallelize(build_deferred(replace(dims, layers=1)), dp, tp)  # first uses, outside the measure
        parallelize(build_meta(replace(dims, layers=1)), dp, tp)
        for _ in range(runs):
            best.deferred = min(best.deferred, parallelize_s(lambda: build_deferred(dims), dp, tp))
            best.meta = min(best.meta, parallelize_s(lambda: build_meta(dims), dp, tp))
        for _ in range(max(1, runs // 2) if whole_path_too else 0):
            path, materialize = whole_path(dims, dp, tp)
            best.path, best.materialize = min(best.path, path), min(best.materialize, materialize)
    return best


def run(blocks: tuple[int, ...], runs: int) -> None:
    load_before = os.getloadavg()
    rows: list[list[str]] = [
        [
            "blocks",
            "layout",
            "rank 0: deferred / meta",
            "rank N/2: deferred / meta",
            "verdict",
            "rank N/2's whole path",
            "of it materialize",
        ]
    ]
    for count in blocks:
        dims = replace(FULL, layers=count)
        for layout in LAYOUTS:
            first, middle = (measure(dims, layout, rank, runs, whole_path_too=rank > 0) for rank in layout.ranks)
            ratios = [best.deferred / best.meta for best in (first, middle)]
            verdict = "within target" if max(ratios) <= TARGET else "above target"
            rows.append(
                [
                    str(count),
                    layout.label,
                    *(
                        f"{ratio:.1f}x ({best.deferred:.3f} s / {best.meta:.3f} s)"
                        for ratio, best in zip(ratios, (first, middle), strict=True)
                    ),
                    verdict,
                    f"{middle.path:.3f} s",
                    f"{middle.materialize:.3f} s ({middle.materialize / middle.path:.0%})",
                ]
            )
            print(f"[{count} blocks] {layout.label}: {' '.join(rows[-1][2:])}", file=sys.stderr, flush=True)
    print(
        f"Parallelizing deferred against meta, ranks 0 and N/2 of the fake process group: torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {load_before[0]:.2f} before and {os.getloadavg()[0]:.2f} after; "
        f"best of {runs} runs (whole path: of {max(1, runs // 2)}), CPU time of this thread; target {TARGET}x; "
        f"decoder {FULL.describe().replace(f'{FULL.layers} layers, ', '')}"
    )
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 blocks only, 2 runs: a smoke run")
    parser.add_argument("--runs", type=int, default=5, help="runs per row, the best kept (default 5)")
    arguments = parser.parse_args()
    if arguments.runs < 1:
        parser.error(f"--runs must be 1 or more, got {arguments.runs}")
    if arguments.quick:
        run((BLOCKS[0],), min(arguments.runs, 2))
    else:
        run(BLOCKS, arguments.runs)


if __name__ == "__main__":
    main()
