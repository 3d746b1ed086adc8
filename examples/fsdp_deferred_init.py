"""FSDP2 with deferred initialization: every rank's shards are those of the eager model, at any world size.

Each rank seeds the generator, builds the model with ``deferred_init`` (fake tensors, nothing allocated), shards it
with ``fully_shard`` (each block, then the root) and only then materializes it, in one call: a rank makes only its
shards, each parameter's random fill drawn for the rank's rows alone, from a jumped generator state, and never
holds an unsharded parameter. Each rank then builds the same model eagerly, in one process and unsharded, and
checks that its shards are that model's slices (FSDP2 cuts dim 0 with ``torch.chunk``), bit for bit, and that the
random generator ends where eager construction leaves it. A table gives, per world size, the time
of the deferred flow against eager construction and each rank's peak memory against the model's size.

Run it with ``python examples/fsdp_deferred_init.py [WORLD_SIZE ...]`` (2 by default); it starts its
processes itself. Peak memory is the growth of the resident set's high-water mark (Linux ``/proc``) over the whole
flow, recording included. The processes run with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors
go back to the system at once and the mark follows the tensors alive, not what the allocator keeps for reuse.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from modattrs.deferred import deferred_init, materialize_module

DIM, VOCAB, BLOCKS = 256, 1000, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def resident_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def reset_peak() -> int:
    """Start measuring the peak of the resident set from now (Linux); return the resident set's size in KiB."""
    with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak since the process began stands in
        Path("/proc/self/clear_refs").write_text("5")
    return resident_kib("VmRSS")


def worker() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    warm_up(mesh)  # first uses set modattrs and FSDP2 up: not part of the measure

    dist.barrier()
    before = reset_peak()
    start = time.perf_counter()
    torch.manual_seed(0)  # the same seed on every rank
    model = deferred_init(Model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sharded = time.perf_counter()
    materialize_module(model)  # this rank's shards, and nothing more; the generator ends where eager code leaves it
    end = time.perf_counter()
    peak_kib = resident_kib("VmHWM") - before
    generator_after = torch.get_rng_state()

    eager_seconds = float("inf")
    for _ in range(3):  # the best of three: a build takes milliseconds, and other processes share the CPUs
        began = time.perf_counter()
        torch.manual_seed(0)
        eager = Model()  # the whole model, in this one process, unsharded
        eager_seconds = min(eager_seconds, time.perf_counter() - began)
    same_generator = torch.equal(generator_after, torch.get_rng_state())
    same_shards = all(
        torch.equal(parameter.to_local(), shard_of(eager.get_parameter(name), rank, world_size))
        for name, parameter in model.named_parameters()
    )

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # FSDP2's all-gathers work on the materialized shards
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(rank))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()

    reports: list[object] = [None] * world_size
    dist.all_gather_object(reports, {"peak_kib": peak_kib, "shards": same_shards, "generator": same_generator})
    if rank == 0:
        model_bytes = sum(p.numel() * p.element_size() for p in eager.parameters())
        times = {"materialize": end - sharded, "total": end - start, "eager": eager_seconds}
        print(json.dumps({"ranks": reports, "bytes": model_bytes, **times}))
    # Both ranks done with gloo before either tears it down.
    dist.barrier()
    dist.destroy_process_group()


def warm_up(mesh: DeviceMesh) -> None:
    small = deferred_init(nn.Sequential, nn.Linear(64, 64), nn.Linear(64, 64))
    fully_shard(small[0], mesh=mesh)
    fully_shard(small, mesh=mesh)
    materialize_module(small)
    small(torch.ones(2, 64)).sum().backward()


def shard_of(full: Tensor, rank: int, world_size: int) -> Tensor:
    """What FSDP2 gives ``rank`` of a parameter: its chunk of dim 0, or nothing for ranks past the last chunk."""
    chunks = torch.chunk(full.detach(), world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


def launch(world_size: int, timeout: float = 300) -> dict[str, Any]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environment = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "MALLOC_MMAP_THRESHOLD_": str(64 * 1024),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__], env={**environment, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True
        )
        for rank in range(world_size)
    ]
    try:
        outputs = [process.communicate(timeout=timeout)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()  # a rank that crashed leaves the others waiting in a collective
    codes = [process.returncode for process in ranks]
    if any(codes):
        raise SystemExit(f"a rank failed on {world_size} processes: exit codes {codes}")
    result: dict[str, Any] = json.loads(outputs[0].strip().splitlines()[-1])
    return result


def main() -> None:
    arguments = sys.argv[1:]  # world sizes; under pytest, which runs this file with runpy, pytest's arguments
    sizes = [int(a) for a in arguments] if arguments and all(a.isdigit() for a in arguments) else [2]
    rows = [(size, launch(size)) for size in sizes]
    mib = 2**20
    model_mib = int(rows[0][1]["bytes"]) / mib
    print(f"{BLOCKS}-block model, {model_mib:.1f} MiB of float32 parameters, FSDP2 over gloo on this machine's CPUs")
    print("world size | materialize vs eager | with deferred_init, fully_shard | peak memory per rank | bit-identical")
    for size, result in rows:
        ranks = result["ranks"]
        eager = float(result["eager"])
        materialize, total = float(result["materialize"]) / eager, float(result["total"]) / eager
        peak = max(int(rank["peak_kib"]) for rank in ranks) / 1024
        identical = all(rank["shards"] and rank["generator"] for rank in ranks)
        print(
            f"{size:>10} | {materialize:>19.1f}x | {total:>30.1f}x | {peak:>7.1f} MiB ({peak / model_mib:>4.0%}) | "
            f"{identical}"
        )
    everything = all(rank["shards"] and rank["generator"] for _, result in rows for rank in result["ranks"])
    print(f"every rank's shards equal the eager model's slices, bit for bit, generator included: {everything}")


def end_rank(code: int) -> NoReturn:
    """End this rank's process with ``code``, its output flushed, skipping the interpreter's teardown.

    torch's teardown of a gloo process group at interpreter exit now and then aborts a rank, whatever it did
    ("terminate called without an active exception", exit -6; plain torch, 2.8 to 2.15): ``os._exit`` skips it, so
    a rank's exit code is its own, 0 when its work is done and 1 when it raised.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    if "RANK" in os.environ:
        try:
            worker()
        except BaseException:
            traceback.print_exc()
            end_rank(1)
        end_rank(0)
    else:
        main()
