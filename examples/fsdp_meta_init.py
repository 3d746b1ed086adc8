"""FSDP2 with meta-device initialization: derived tensors come back right, by construction.

Two processes (gloo on 127.0.0.1) build a small decoder on the meta device, shard it with ``fully_shard``,
materialize it with ``to_empty(device="cpu")``, initialize the parameters and train a few steps. Its rotary
tables are ``VirtualTensor``s: they equal those of the same model built directly on the CPU, bit for bit, with
no re-initialization. Next to them, the hand-rolled version, a non-persistent ``inv_freq`` buffer computed in
``__init__``, comes back from ``to_empty`` holding whatever memory it was given.

Run it with ``python examples/fsdp_meta_init.py``; it starts its two processes itself.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from modattrs import VirtualTensor

DIM, LENGTH = 32, 16


def inverse_frequencies(dtype: torch.dtype, device: torch.device | None) -> Tensor:
    return 1.0 / 10_000 ** (torch.arange(0, DIM, 2, dtype=torch.float32, device=device) / DIM)


class Rotary(nn.Module):
    """Rotary tables as VirtualTensors, kept in float32 whatever the model's dtype."""

    def __init__(self) -> None:
        super().__init__()
        VirtualTensor(self, "cos", "make_cos", dtype=torch.float32, follow_dtype=False)
        VirtualTensor(self, "sin", "make_sin", dtype=torch.float32, follow_dtype=False)

    def angles(self, device: torch.device) -> Tensor:
        return torch.outer(
            torch.arange(LENGTH, dtype=torch.float32, device=device), inverse_frequencies(torch.float32, device)
        )

    def make_cos(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.angles(device).cos().to(dtype)

    def make_sin(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return self.angles(device).sin().to(dtype)


class HandRolledRotary(nn.Module):
    """The usual way: a buffer computed once, in __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(torch.float32, None), persistent=False)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rotary = Rotary()
        self.hand_rolled = HandRolledRotary()
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        cos, sin = self.rotary.cos.value, self.rotary.sin.value
        first, second = x.chunk(2, -1)
        rotated = torch.cat([first * cos - second * sin, first * sin + second * cos], -1)
        return x + self.mix(rotated)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x))


def worker() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Decoder()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):
        loss = model(torch.randn(4, LENGTH, DIM)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    reference = Block()  # built directly on the CPU
    block = model.blocks[0]
    virtual_ok = torch.equal(block.rotary.cos.value, reference.rotary.cos.value) and torch.equal(
        block.rotary.sin.value, reference.rotary.sin.value
    )
    hand_rolled_ok = torch.equal(block.hand_rolled.inv_freq, reference.hand_rolled.inv_freq)
    if rank == 0:
        print(f"trained 3 steps on {dist.get_world_size()} processes; loss {loss.item():.4f}")
        print(f"VirtualTensor rotary tables equal to a CPU build: {virtual_ok}")
        print(f"hand-rolled inv_freq buffer equal to a CPU build: {hand_rolled_ok}")
    # Both ranks done with gloo before either tears it down.
    dist.barrier()
    dist.destroy_process_group()


def launch(world_size: int = 2, timeout: float = 120) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world_size)}
    ranks = [
        subprocess.Popen(
            [sys.executable, __file__], env={**environment, "RANK": str(rank)}, stdout=subprocess.PIPE, text=True
        )
        for rank in range(world_size)
    ]
    outputs = [process.communicate(timeout=timeout)[0] for process in ranks]
    codes = [process.returncode for process in ranks]
    print(outputs[0], end="")
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


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
        launch()
