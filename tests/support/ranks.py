"""Ranks of a distributed world, for tests: this process as one rank of torch's fake process group, and real gloo
ranks run as processes of their own (a worker script's ``__main__`` calls ``run_as_rank``)."""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

TESTS = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def fake_world(shape: tuple[int, ...], rank: int, names: tuple[str, ...] | None = None) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a world of ``shape`` ranks on torch's fake process group, and its mesh on the
    CPU, its dimensions named ``names``."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    worker: Path, arguments: Sequence[str], output: Path, world_size: int, timeout: float
) -> list[dict[str, Any]]:
    """Run ``worker`` with ``arguments`` and ``output`` as each of ``world_size`` gloo ranks (127.0.0.1), each bounded
    by ``timeout`` seconds; fail the test if one does not finish or exits otherwise than with 0 (its traceback in the
    message); return what each rank saved in ``output`` as ``rank{N}.pt``."""
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, str(worker), *arguments, str(output)],
            env={**environment, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    failures = []
    for rank, process in enumerate(ranks):
        try:
            _, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            pytest.fail(f"{' '.join(arguments)}: rank {rank} did not finish in {timeout} s")
        if process.returncode != 0:
            failures.append(f"rank {rank} exited with {process.returncode}:\n{stderr[-3000:]}")
    assert not failures, "\n".join(failures)
    return [torch.load(output / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def run_as_rank(main: Callable[[], None]) -> NoReturn:
    """Run a worker's ``main`` and leave with 0, or with 1 after printing its traceback, output flushed, skipping the
    interpreter's teardown: torch's gloo teardown at exit now and then aborts a rank, whatever it did ("terminate
    called without an active exception"; plain torch, see docs/distributed.rst), and a rank that raised must still
    fail its test."""
    code = 0
    try:
        main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# A rank's peak memory, in a process of its own so that the high-water mark is the replay's: rank 5 of 8 builds a
# deferred 4096 x 4096 weight (64 MiB), runs ``distribute`` (Python, on ``model`` and ``mesh``), and materializes.
_PEAK_SCRIPT = """
import re
from pathlib import Path
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from modattrs.deferred import deferred_init, materialize_module

def high_water_mib():
    return int(re.search(r"VmHWM:\\s+(\\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024

dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=8)
mesh = init_device_mesh("cpu", (8,))
torch.manual_seed(0)
model = deferred_init(nn.Linear, 4096, 4096, bias=False)
{distribute}
materialize_module(deferred_init(nn.Linear, 8, 8))  # first uses out of the measure
Path("/proc/self/clear_refs").write_text("5")
before = high_water_mib()
materialize_module(model)
print(high_water_mib() - before, model.weight.to_local().nbytes / 2**20)
"""
WEIGHT_MIB = 4096 * 4096 * 4 / 2**20

needs_high_water_mark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the resident set's high-water mark"
)


def peak_growth_of_a_rank(distribute: str) -> tuple[float, float]:
    """How much rank 5 of 8's peak resident memory grows as it materializes a deferred 64 MiB weight laid out by
    ``distribute``, and the size of its local part, in MiB (see ``_PEAK_SCRIPT``)."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024), "OMP_NUM_THREADS": "1"}
    script = _PEAK_SCRIPT.format(distribute=distribute)
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    growth_mib, local_mib = map(float, done.stdout.split())
    return growth_mib, local_mib
