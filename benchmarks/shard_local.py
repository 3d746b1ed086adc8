"""What a rank pays to materialize its own shards of a deferred model, against eager construction (issue 26).

Run with ``python benchmarks/shard_local.py`` (needs ``transformers``; 3 to 5 minutes on a 2-core machine), or
with ``--quick`` for a smoke run on models of about 50M parameters; ``--only plain`` or ``--only llama`` measures one
model, ``--runs N`` keeps the best of N timed materializations (2 by default). For a Llama-shaped decoder of about
300M float32 parameters in plain torch (every weight drawn once, by torch's initializers) and transformers'
``LlamaForCausalLM`` of the same shape (whose ``post_init`` draws every weight a second time), seed 0, it prints
one table of ratios against eager construction measured in this process (best of 3, on one thread: torch's random
kernels draw serially, so eager code draws on one core):

* FSDP2 shard-local materialization per rank at world sizes 1, 2, 4, 8 and 64 (target 1.3/N + 0.03): one rank at a
  time in this process on torch's fake process group, for ranks 0, N/2 and N-1: ``deferred_init``, ``fully_shard``
  each block then the root, then ``materialize_module(model)``, of which only the materialization is timed, on one
  thread as eager construction; the row gives the slowest of the ranks measured.
* the layouts large-model training runs, for the plain decoder: 1-D FSDP2 over 8 ranks, and on a 2-D
  ("dp", "tp") mesh dp 4 x tp 2, dp 8 x tp 8, dp 8 x tp 1 (a trivial tp dimension) and tp 8 alone:
  ``parallelize_module`` of each block over tp (Megatron's cut: q, k, v, gate and up ``ColwiseParallel``, o and down
  ``RowwiseParallel``; the embedding and ``lm_head`` too), with ``src_data_rank=None``, then ``fully_shard`` of each
  block and the root over dp; ranks 0, N/2 and N-1, the row giving the one furthest above its target. Each rank's
  target is 1.3 times its *floor* plus 0.03x: the least a rank pays with torch's CPU generator, its own elements'
  draws plus, for each contiguous run of them in the eager parameter, the lesser of a jump and drawing the gap
  before it, from torch's ``normal_`` and ``uniform_`` per element and a jump to a repeated distance measured in
  this process. modattrs draws ``uniform_`` with a kernel of its own (the same bits, several times faster), so a
  rank can pay less than that floor: beside it the row prints the floor at that kernel's rate. ``--layouts``
  measures these rows alone. Local shards are checked against ``torch.chunk`` of the eager parameter along each
  sharded dim, the tensor-parallel cut first under FSDP2's ``_StridedShard``.
* whole-model ``materialize_module`` with its default thread count, torch's (target 0.65x).
* ``lm_head`` alone, after ``load_state_dict`` of every other tensor of the eager model with ``assign=True``,
  on one thread, against drawing ``lm_head`` alone with eager code (target 2x).
* peak memory per rank at world size 4: in a fresh process per rank, the growth of the resident set's high-water
  mark (``VmHWM``) over the materialization against the bytes of the rank's shards (target 1.2x). The processes run
  with glibc's ``MALLOC_MMAP_THRESHOLD_`` fixed, so that freed tensors go back to the system at once and the mark
  follows the tensors alive; one-time set-up (FSDP2's and modattrs's first uses, the jump tables) is warmed up
  before the mark is reset.

Each rank of a real job is a process of its own: before every timed materialization, the jumps' cache of powers
(which a rank's identical layers share) is emptied, so that no rank profits from one measured before it; and before
every timed run, eager construction included, the memory freed so far goes back to the system (``_timing.trim_heap``),
so that what a run allocates is faulted in as in a fresh process, not reused from the run before. Times are
wall-clock (the whole-model row spreads draws over threads); on a machine other jobs keep busy they vary by a
factor of 2 or more from run to run, so the load average is printed with them.

Every row checks its values bit for bit: each rank's local shards against ``torch.chunk`` of the eager parameter
along dim 0 (an empty slice for ranks past the last chunk), buffers against the eager ones, and the default
generator's state after materialization against the state eager construction leaves. A row whose values differ, or
that raises, prints FAILED, and the script exits with 1 at the end. Timings are printed, never asserted.

Then a projection for a 70B Llama at 64 ranks, from costs measured in this process: ``normal_`` and ``uniform_``
per float32 element on one thread, a generator jump (``jumped_state``) at a few distances, and the replay's
overhead per recorded operation, from the slowest rank at 64 ranks run again with its jumps timed and its draws
counted by torch's profiler. It is a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from _timing import collected, reset_peak, resident_kib, wall_s
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

# Registers the "fake" backend: collectives that do nothing, so one process can play any rank of any world size.
from torch.testing._internal.distributed.fake_pg import FakeStore
from transformers import LlamaConfig, LlamaForCausalLM

from modattrs._deferred.materialize import roots
from modattrs._deferred.record import Draws
from modattrs._deferred.rng import kernels, mt19937
from modattrs._deferred.rng.mt19937 import jumped_state
from modattrs.deferred import deferred_init, is_deferred, materialize_module

SEED = 0
WORLD_SIZES = (1, 2, 4, 8, 64)
MEMORY_WORLD_SIZE = 4
EAGER_RUNS = 3
TARGETS = {"whole": 0.65, "head": 2.0, "memory": 1.2}
MMAP_THRESHOLD = 64 * 1024
JUMP_DISTANCES = (10**7, 2**32, 10**11)
OWN_UNIFORM = "uniform_ (modattrs' kernel)"


def shard_target(world_size: int) -> float:
    return 1.3 / world_size + 0.03


@dataclass(frozen=True)
class Dims:
    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int

    def describe(self) -> str:
        return (
            f"hidden {self.hidden}, intermediate {self.intermediate}, {self.layers} layers, vocab {self.vocab}, "
            f"{self.heads} heads / {self.kv_heads} KV heads"
        )


FULL = Dims(hidden=1024, intermediate=2816, layers=18, vocab=32000, heads=16, kv_heads=16)  # 297M parameters
QUICK = Dims(hidden=512, intermediate=1408, layers=6, vocab=32000, heads=8, kv_heads=8)  # 52M parameters
LLAMA_70B = Dims(hidden=8192, intermediate=28672, layers=80, vocab=32000, heads=64, kv_heads=8)  # 69B parameters


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        kv_width = dims.hidden // dims.heads * dims.kv_heads
        self.q_proj = nn.Linear(dims.hidden, dims.hidden, bias=False)
        self.k_proj = nn.Linear(dims.hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(dims.hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(dims.hidden, dims.hidden, bias=False)


class MLP(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dims.hidden, dims.intermediate, bias=False)
        self.up_proj = nn.Linear(dims.hidden, dims.intermediate, bias=False)
        self.down_proj = nn.Linear(dims.intermediate, dims.hidden, bias=False)


class Block(nn.Module):
    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.input_norm = RMSNorm(dims.hidden)
        self.attention = Attention(dims)
        self.post_attention_norm = RMSNorm(dims.hidden)
        self.mlp = MLP(dims)


class Decoder(nn.Module):
    """A Llama-shaped decoder in plain torch: every weight drawn once, at construction, by torch's defaults."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(dims.vocab, dims.hidden)
        self.layers = nn.ModuleList(Block(dims) for _ in range(dims.layers))
        self.norm = RMSNorm(dims.hidden)
        self.lm_head = nn.Linear(dims.hidden, dims.vocab, bias=False)


def llama_config(dims: Dims) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=dims.hidden,
        intermediate_size=dims.intermediate,
        num_hidden_layers=dims.layers,
        num_attention_heads=dims.heads,
        num_key_value_heads=dims.kv_heads,
        vocab_size=dims.vocab,
        tie_word_embeddings=False,
    )


@dataclass(frozen=True)
class Subject:
    """A model under measurement, and how eager code draws its ``lm_head`` alone."""

    key: str
    label: str
    build: Callable[[], nn.Module]
    draw_head: Callable[[], object]
    head_baseline: str


def subjects(dims: Dims) -> dict[str, Subject]:
    config = llama_config(dims)
    std = config.initializer_range
    return {
        "plain": Subject(
            "plain",
            "plain-torch Llama-shaped decoder",
            lambda: Decoder(dims),
            lambda: nn.Linear(dims.hidden, dims.vocab, bias=False),
            f"nn.Linear({dims.hidden}, {dims.vocab}, bias=False)",
        ),
        "llama": Subject(
            "llama",
            "transformers LlamaForCausalLM",
            lambda: LlamaForCausalLM(config),
            lambda: torch.empty(dims.vocab, dims.hidden).normal_(0.0, std),
            f"normal_(0, {std}) on ({dims.vocab}, {dims.hidden}), post_init's draw",
        ),
    }


def blocks_of(model: nn.Module) -> list[nn.Module]:
    inner = model.model if isinstance(model, LlamaForCausalLM) else model
    layers = inner.layers
    assert isinstance(layers, nn.ModuleList)
    return list(layers)


# Checking values


def same_bits(actual: Tensor, expected: Tensor) -> bool:
    """Equal shape, dtype and bits (``torch.equal`` calls -0.0 and 0.0 equal, and NaN unequal to itself)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return False
    if actual.is_floating_point():
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        return torch.equal(actual.contiguous().view(as_int), expected.contiguous().view(as_int))
    return torch.equal(actual, expected)


def shard_of(full: Tensor, rank: int, world_size: int) -> Tensor:
    """What FSDP2 gives ``rank`` of a parameter: its chunk of dim 0, or nothing for ranks past the last chunk."""
    chunks = torch.chunk(full.detach(), world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.detach()[:0]


def local_of(parameter: Tensor) -> Tensor:
    """A rank's part of a parameter: its local shard when FSDP2 sharded it (a DTensor)."""
    return (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach()


def differences(
    model: nn.Module, eager: nn.Module, eager_state: Tensor, rank: int = 0, world_size: int = 1
) -> list[str]:
    """What differs from eager construction, bit for bit: parameters (a rank's local shards when sharded), buffers,
    and the default generator's state now against the state eager construction left."""
    found = []
    if is_deferred(model):
        found.append("tensors still deferred after materialization")
    for name, parameter in model.named_parameters():
        local, expected = local_of(parameter), eager.get_parameter(name).detach()
        if isinstance(parameter, DTensor):
            expected = shard_of(expected, rank, world_size)
        if not same_bits(local, expected):
            found.append(f"parameter {name}")
    for name, buffer in model.named_buffers():
        if not same_bits(buffer, eager.get_buffer(name)):
            found.append(f"buffer {name}")
    if not same_bits(torch.get_rng_state(), eager_state):
        found.append("the default generator's state after materializing")
    return found


# Measuring


@dataclass
class Row:
    model: str
    label: str
    measured: str
    baseline: str
    ratio: float | None
    target: float
    problems: list[str] = field(default_factory=list)

    def cells(self) -> list[str]:
        ratio = "-" if self.ratio is None else f"{self.ratio:.3f}x"
        verdict = "-"  # a time of wrong values, or none, is no verdict
        if self.ratio is not None and not self.problems:
            verdict = "within target" if self.ratio <= self.target else "above target"
        values = "FAILED" if self.problems else "identical"
        return [self.model, self.label, self.measured, self.baseline, ratio, f"{self.target:.3g}x", verdict, values]


class Progress:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f} s] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Eager code draws on one core (torch's random kernels run serially), so eager baselines run on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def eager_once(subject: Subject) -> float:
    """One more eager construction on one thread, as ``eager_construction`` times it, the model freed after."""
    with one_thread():
        torch.manual_seed(SEED)
        seconds, _ = wall_s(subject.build)
    return seconds


def eager_construction(subject: Subject) -> tuple[float, nn.Module, Tensor]:
    """Best of ``EAGER_RUNS`` constructions on one thread; the last model built, and the generator's state after."""
    best, model = math.inf, None
    with one_thread():
        for _ in range(EAGER_RUNS):
            model = None  # the previous model freed before the next is built
            torch.manual_seed(SEED)
            seconds, model = wall_s(subject.build)
            best = min(best, seconds)
    assert model is not None
    return best, model, torch.get_rng_state()


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a world of ``world_size`` on torch's fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def shard_deferred(subject: Subject, mesh: DeviceMesh) -> nn.Module:
    """Seed, build deferred, and ``fully_shard`` each block, then the root: nothing is real yet."""
    torch.manual_seed(SEED)
    model: nn.Module = deferred_init(subject.build)
    for block in blocks_of(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def as_in_a_fresh_process() -> None:
    """Forget what earlier replays in this process left that a rank's own process would not have: the jumps' cache
    of powers by distance (identical layers of one rank make identical jumps; other ranks, in their own processes,
    do not share them), and which form of ``uniform_`` modattrs' kernel agreed with torch's in (a process checks at
    its first draw). Called before every timed materialization."""
    mt19937.forget_powers()
    kernels.forget()


def materialize_sharded(model: nn.Module, threads: int | None = None) -> None:
    """A rank's flow: one call, which makes only the rank's shards (block by block gives the same values and memory,
    and walks the model and the record once per block)."""
    materialize_module(model, threads=threads)


def ranks_measured(world_size: int) -> list[int]:
    return sorted({0, world_size // 2, world_size - 1})


def fsdp_rows(
    subject: Subject, eager: nn.Module, eager_state: Tensor, eager_s: float, runs: int, progress: Progress
) -> tuple[list[Row], int | None]:
    """The rows per world size (each rank's best of ``runs``, on one thread as eager construction), and the slowest
    rank measured at the largest."""
    rows, slowest = [], None
    for world_size in WORLD_SIZES:
        ranks = ranks_measured(world_size)
        row = Row(
            subject.key,
            f"FSDP2 shard-local materialization per rank, world size {world_size} (ranks {', '.join(map(str, ranks))})",
            "-",
            f"{eager_s:.3f} s",
            None,
            shard_target(world_size),
        )
        times: dict[int, float] = {}
        for rank in ranks:
            seconds = math.inf
            try:
                with fake_group(rank, world_size) as mesh, one_thread():
                    for _ in range(runs):
                        model = shard_deferred(subject, mesh)
                        as_in_a_fresh_process()
                        seconds = min(seconds, wall_s(lambda model=model: materialize_sharded(model))[0])  # type: ignore[misc]
                        found = differences(model, eager, eager_state, rank, world_size)
                        row.problems += [f"rank {rank}: {d}" for d in found]
                        del model
                times[rank] = seconds
            except Exception as error:
                traceback.print_exc()
                row.problems.append(f"rank {rank} raised {type(error).__name__}: {first_line(error)}")
            progress(f"{subject.key}: world size {world_size}, rank {rank}: {seconds:.3f} s")
        if times:
            slowest = max(times, key=times.__getitem__)
            row.measured = f"{times[slowest]:.3f} s"
            row.ratio = times[slowest] / eager_s
        rows.append(row)
    return rows, slowest


def whole_model_row(subject: Subject, eager: nn.Module, eager_state: Tensor, eager_s: float, runs: int) -> Row:
    threads = torch.get_num_threads()
    row = Row(
        subject.key,
        f"whole-model materialize_module on this machine ({threads} threads, best of {runs})",
        "-",
        f"{eager_s:.3f} s",
        None,
        TARGETS["whole"],
    )
    try:
        best = math.inf
        for _ in range(runs):
            model = None
            torch.manual_seed(SEED)
            model = deferred_init(subject.build)
            as_in_a_fresh_process()
            seconds, _ = wall_s(lambda model=model: materialize_module(model))  # type: ignore[misc]
            best = min(best, seconds)
            row.problems += differences(model, eager, eager_state)
        row.measured, row.ratio = f"{best:.3f} s", best / eager_s
    except Exception as error:
        traceback.print_exc()
        row.problems.append(f"raised {type(error).__name__}: {first_line(error)}")
    return row


def head_row(subject: Subject, eager: nn.Module, eager_state: Tensor, runs: int) -> Row:
    """Best of ``runs`` on one thread, against the best of ``2 * runs`` draws of ``lm_head`` alone."""
    row = Row(
        subject.key,
        "lm_head only, after load_state_dict(eager.state_dict() minus lm_head, assign=True, strict=False)",
        "-",
        "-",
        None,
        TARGETS["head"],
    )
    try:
        baseline = math.inf
        with one_thread():
            for _ in range(2 * runs):
                torch.manual_seed(SEED)
                baseline = min(baseline, wall_s(subject.draw_head)[0])
        row.baseline = f"{baseline:.3f} s"
        # Copies: a replay that wrote into a loaded tensor would otherwise change the eager model it is checked against.
        checkpoint = {name: t.clone() for name, t in eager.state_dict().items() if not name.startswith("lm_head.")}
        best = math.inf
        for _ in range(runs):
            model = None
            torch.manual_seed(SEED)
            model = deferred_init(subject.build)
            model.load_state_dict(checkpoint, assign=True, strict=False)
            as_in_a_fresh_process()
            with one_thread():
                seconds, _ = wall_s(lambda model=model: materialize_module(model))  # type: ignore[misc]
            best = min(best, seconds)
            row.problems += differences(model, eager, eager_state)
        row.measured, row.ratio = f"{best:.3f} s", best / baseline
    except Exception as error:
        traceback.print_exc()
        row.problems.append(f"raised {type(error).__name__}: {first_line(error)}")
    return row


def memory_row(subject: Subject, quick: bool, progress: Progress) -> Row:
    row = Row(
        subject.key,
        f"peak memory per rank at world size {MEMORY_WORLD_SIZE} (VmHWM growth vs the rank's shards)",
        "-",
        "-",
        None,
        TARGETS["memory"],
    )
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    worst: tuple[float, int, int] | None = None
    for rank in range(MEMORY_WORLD_SIZE):
        command = [sys.executable, os.path.abspath(__file__), "--worker", subject.key, str(rank)]
        completed = subprocess.run(
            [*command, *(["--quick"] if quick else [])], env=environment, capture_output=True, text=True, timeout=1800
        )
        if completed.returncode != 0:
            sys.stderr.write(completed.stderr[-5000:])
            row.problems.append(f"rank {rank}'s process exited with {completed.returncode}")
            continue
        report = json.loads(completed.stdout.strip().splitlines()[-1])
        row.problems += [f"rank {rank}: {d}" for d in report["differences"]]
        peak, shards = int(report["peak_kib"]) * 1024, int(report["shard_bytes"])
        progress(
            f"{subject.key}: rank {rank} of {MEMORY_WORLD_SIZE}: peak {peak / 2**20:.1f} MiB, "
            f"shards {shards / 2**20:.1f} MiB"
        )
        if worst is None or peak / shards > worst[0]:
            worst = (peak / shards, peak, shards)
    if worst is not None:
        row.ratio = worst[0]
        row.measured, row.baseline = f"{worst[1] / 2**20:.1f} MiB", f"{worst[2] / 2**20:.1f} MiB"
    return row


def memory_worker(subject: Subject, rank: int) -> None:
    """One rank of ``MEMORY_WORLD_SIZE``, in a process of its own: prints one JSON line."""
    torch.set_num_threads(1)  # as in the per-rank rows
    with fake_group(rank, MEMORY_WORLD_SIZE) as mesh:
        warm_up(mesh)
        model = shard_deferred(subject, mesh)
        before = reset_peak()
        materialize_sharded(model)
        peak_kib = resident_kib("VmHWM") - before
        shard_bytes = sum(local_of(p).numel() * p.element_size() for p in model.parameters())
        after = torch.get_rng_state()
        torch.manual_seed(SEED)
        eager = subject.build()
        eager_state = torch.get_rng_state()
        torch.set_rng_state(after)
        found = differences(model, eager, eager_state, rank, MEMORY_WORLD_SIZE)
    print(json.dumps({"peak_kib": peak_kib, "shard_bytes": shard_bytes, "differences": found}))


def warm_up(mesh: DeviceMesh) -> None:
    """First uses of FSDP2 and of replays, and the jump's tables (built once per process), outside the measure."""
    small = deferred_init(nn.Sequential, nn.Linear(64, 64), nn.Linear(64, 64))
    fully_shard(small[0], mesh=mesh)
    fully_shard(small, mesh=mesh)
    materialize_module(small[0])
    materialize_module(small)
    jumped_state(torch.get_rng_state(), 2**40)


def first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


# Layouts: FSDP2 over tensor parallelism on a 2-D mesh, and its degenerate cases

#: (label, dp, tp): a 2-D ("dp", "tp") mesh; tp 1 is a trivial tensor-parallel dimension, dp 1 none at all
LAYOUTS = (
    ("1-D FSDP2, 8 ranks", 8, 0),  # tp 0: the 1-D mesh of the rows above
    ("dp 4 x tp 2", 4, 2),
    ("dp 8 x tp 8", 8, 8),
    ("dp 8 x tp 1", 8, 1),
    ("tp 8", 1, 8),
)


def layout_target(floor: float) -> float:
    return 1.3 * floor + 0.03


@contextlib.contextmanager
def fake_mesh(rank: int, dp: int, tp: int) -> Iterator[DeviceMesh]:
    """This process as ``rank`` of a (dp, tp) mesh on torch's fake process group (a 1-D mesh of dp ranks when
    tp is 0)."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dp * max(tp, 1))
    try:
        if tp == 0:
            yield init_device_mesh("cpu", (dp,), mesh_dim_names=("dp",))
        else:
            yield init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """Megatron's cut of a block, as torchtitan makes it: q, k, v, gate and up by rows, o and down by columns."""
    plan: dict[str, ParallelStyle] = {f"attention.{name}_proj": ColwiseParallel() for name in "qkv"}
    plan |= {"attention.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel()}
    plan |= {"mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    return plan


def lay_out(model: nn.Module, mesh: DeviceMesh, tp: int) -> None:
    """``parallelize_module`` over tp (no collective: ``src_data_rank=None``), then ``fully_shard`` over dp."""
    if tp:
        for block in blocks_of(model):
            parallelize_module(block, mesh["tp"], tensor_parallel_plan(), src_data_rank=None)
        head_plan: dict[str, ParallelStyle] = {"embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel()}
        parallelize_module(model, mesh["tp"], head_plan, src_data_rank=None)
    if mesh.mesh_dim_names is not None and mesh["dp"].size() > 1:
        for block in blocks_of(model):
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def coordinates_of(rank: int, tp: int) -> dict[str, int]:
    """Where ``rank`` sits on the row-major (dp, tp) mesh, by name (the fake group's submeshes do not know)."""
    return {"dp": rank // max(tp, 1), "tp": rank % max(tp, 1)}


def local_part(full: Tensor, parameter: Tensor, coordinates: dict[str, int]) -> Tensor:
    """What a rank holds of ``full`` under ``parameter``'s placements: ``torch.chunk`` along each sharded dim, in
    the mesh's order, or for FSDP2 over tensor parallelism (``_StridedShard``) the tensor-parallel cut first."""
    if not isinstance(parameter, DTensor):
        return full
    mesh, placements = parameter.device_mesh, parameter.placements
    assert mesh.mesh_dim_names is not None
    order = list(range(mesh.ndim))
    if any(type(placement).__name__ == "_StridedShard" for placement in placements):
        order.reverse()
    local = full
    for mesh_dim in order:
        dim = getattr(placements[mesh_dim], "dim", None)
        if isinstance(dim, int):
            chunks = torch.chunk(local, mesh.size(mesh_dim), dim=dim)
            index = coordinates[mesh.mesh_dim_names[mesh_dim]]
            local = chunks[index] if index < len(chunks) else local.narrow(dim, 0, 0)
    return local


def layout_differences(
    model: nn.Module, eager: nn.Module, eager_state: Tensor, coordinates: dict[str, int]
) -> list[str]:
    found = []
    if is_deferred(model):
        found.append("tensors still deferred after materialization")
    for name, parameter in model.named_parameters():
        expected = local_part(eager.get_parameter(name).detach(), parameter, coordinates)
        if not same_bits(local_of(parameter), expected):
            found.append(f"parameter {name}")
    if not same_bits(torch.get_rng_state(), eager_state):
        found.append("the default generator's state after materializing")
    return found


#: Elements of the generator's stream between two of a rank's runs, by the draw that makes them (a gap can span the
#: tail of one weight and the head of the next, drawn by another kind of fill).
Gap = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Stream:
    """What a rank takes of the model's generator stream, for its floor: for each drawn parameter it keeps elements
    of, the kind of draw, how many elements it keeps, the gap before its first run (from the rank's run before, in
    this parameter or an earlier one) and the gaps before the others (in elements of this parameter's draw); and the
    gap after its last run, to where eager construction leaves the generator.

    The stream is one for the whole model. A rank that keeps the first rows of every weight (rank 0) still moves the
    generator over the rest of each weight before the next: a gap after its runs rather than before them, as for the
    last rank. The decoder draws its weights in the order it registers them."""

    parameters: tuple[tuple[str, int, Gap, Tensor], ...]
    tail: Gap


def rank_stream(model: nn.Module, eager: nn.Module, coordinates: dict[str, int]) -> Stream:
    """The ``Stream`` of the rank at ``coordinates``, whose materialized ``model`` holds its parts of ``eager``'s
    parameters. A parameter the rank's model lacks (a pipeline stage's) is all gap."""
    draws = {
        f"{name}.weight": kind
        for module_name, module in eager.named_modules()
        for name, kind in [(module_name, "normal_" if isinstance(module, nn.Embedding) else "uniform_")]
        if isinstance(module, (nn.Embedding, nn.Linear))
    }
    held = dict(model.named_parameters())
    parameters: list[tuple[str, int, Gap, Tensor]] = []
    carried: list[tuple[str, int]] = []  # the stream since the rank's last run
    for name, full in eager.named_parameters():
        kind = draws.get(name)
        if kind is None:
            continue  # ones: no draw
        mine = held.get(name)
        indices = torch.empty(0, dtype=torch.int64)
        if mine is not None:
            indices = local_part(torch.arange(full.numel()).view(full.shape), mine, coordinates).flatten()
        if indices.numel() == 0:
            carried.append((kind, full.numel()))
            continue
        indices = indices.sort().values
        breaks = torch.nonzero(indices[1:] != indices[:-1] + 1).flatten() + 1
        starts = torch.cat([indices[:1], indices[breaks]])
        ends = torch.cat([indices[breaks - 1] + 1, indices[-1:] + 1])
        first: Gap = (*carried, (kind, int(starts[0])))
        parameters.append((kind, indices.numel(), first, starts[1:] - ends[:-1]))
        carried = [(kind, full.numel() - int(ends[-1]))]
    return Stream(tuple(parameters), tuple(carried))


def floor_s(stream: Stream, ns_per_element: dict[str, float], jump_s: float) -> float:
    """The least a rank pays with torch's CPU generator: its own elements' draws, and for each gap of its
    ``stream`` (before each contiguous run it keeps, and after its last), the lesser of a jump and drawing the gap."""

    def gap_s(gap: Gap) -> float:
        return min(jump_s, sum(count * ns_per_element[kind] * 1e-9 for kind, count in gap))

    total = gap_s(stream.tail)
    for kind, kept, first, rest in stream.parameters:
        per = ns_per_element[kind] * 1e-9
        total += kept * per + gap_s(first) + torch.clamp(rest.double() * per, max=jump_s).sum().item()
    return total


def layout_rows(
    subject: Subject, eager: nn.Module, eager_state: Tensor, eager_s: float, runs: int, progress: Progress
) -> tuple[list[Row], float]:
    """A row per layout: its slowest rank of 0, middle and last against its own floor, on one thread as eager
    construction, values checked as in every row; and eager construction's best time, which the rows are measured
    against.

    Measured in ``runs`` rounds, each of which materializes every rank of every layout once, then builds the model
    eagerly once more and measures the draws' costs again: each time is the best of its rounds, minutes apart. This
    machine has spells of tens of seconds in which everything runs 1.5x to 1.8x slower; the runs of one rank in a
    row could all fall in one, and a baseline measured once could fall in one or miss them all."""
    costs = measured_draw_costs()
    jump_s = min(again for _, again in measured_jump_costs().values())
    cases = [(label, dp, tp, rank) for label, dp, tp in LAYOUTS for rank in ranks_measured(dp * max(tp, 1))]
    seconds = dict.fromkeys(cases, math.inf)
    streams: dict[tuple[str, int, int, int], Stream] = {}
    problems: dict[str, list[str]] = {label: [] for label, _, _ in LAYOUTS}
    raised: set[tuple[str, int, int, int]] = set()  # not run again in later rounds
    for round_ in range(runs):
        for case in cases:
            label, dp, tp, rank = case
            if case in raised:
                continue
            coordinates = coordinates_of(rank, tp)
            try:
                with fake_mesh(rank, dp, tp) as mesh, one_thread():
                    torch.manual_seed(SEED)
                    model: nn.Module = deferred_init(subject.build)
                    lay_out(model, mesh, tp)
                    as_in_a_fresh_process()
                    seconds[case] = min(seconds[case], wall_s(lambda model=model: materialize_sharded(model))[0])  # type: ignore[misc]
                    if case not in streams:  # every round makes the same values: checked once
                        found = layout_differences(model, eager, eager_state, coordinates)
                        problems[label] += [f"rank {rank}: {difference}" for difference in found]
                        streams[case] = rank_stream(model, eager, coordinates)
                    del model
            except Exception as error:
                traceback.print_exc()
                problems[label].append(f"rank {rank} raised {type(error).__name__}: {first_line(error)}")
                raised.add(case)
            progress(f"{subject.key}: round {round_ + 1} of {runs}: {label}, rank {rank}: {seconds[case]:.3f} s")
        if round_ + 1 < runs:
            eager_s = min(eager_s, eager_once(subject))
            again = measured_draw_costs()
            costs = {kind: min(cost, again[kind]) for kind, cost in costs.items()}
    rows = []
    for label, dp, tp in LAYOUTS:
        ranks = ranks_measured(dp * max(tp, 1))
        row = Row(subject.key, f"{label} (ranks {', '.join(map(str, ranks))})", "-", f"{eager_s:.3f} s", None, 1.0)
        row.problems = problems[label]
        # (ratio over target, rank, seconds, floor, floor with modattrs' uniform_ kernel's rate)
        worst: tuple[float, int, float, float, float] | None = None
        for rank in ranks:
            case = (label, dp, tp, rank)
            if case not in streams or math.isinf(seconds[case]):
                continue
            floor = floor_s(streams[case], costs, jump_s) / eager_s
            over = (seconds[case] / eager_s) / layout_target(floor)
            if worst is None or over > worst[0]:
                own = floor_s(streams[case], {**costs, "uniform_": costs[OWN_UNIFORM]}, jump_s) / eager_s
                worst = over, rank, seconds[case], floor, own
        if worst is not None:
            _, rank, best, floor, own = worst
            row.label += f": rank {rank}, floor {floor:.3f}x ({own:.3f}x at modattrs' uniform_ rate)"
            row.measured, row.ratio, row.target = f"{best:.3f} s", best / eager_s, layout_target(floor)
        rows.append(row)
    return rows, eager_s


# Projection


@dataclass(frozen=True)
class Census:
    """What a deferred model's record holds: how many operations, and the random ones with the elements they fill
    (``live``: their values are kept; ``dead``: overwritten whole before anything reads them)."""

    ops: int
    live: tuple[tuple[str, int], ...]
    dead: tuple[tuple[str, int], ...]

    @staticmethod
    def of(model: nn.Module) -> Census:
        record = roots[model].record
        dead_writes = record.dead_writes()
        live: list[tuple[str, int]] = []
        dead: list[tuple[str, int]] = []
        for index, op in enumerate(record.ops):
            if op.draws is Draws.NONE:
                continue
            numel = sum(math.prod(slot.size) for slot in op.slots if slot.written)
            (dead if index in dead_writes else live).append((kind_of(op.name), numel))
        return Census(len(record.ops), tuple(live), tuple(dead))

    def elements(self, kind: str | None = None) -> int:
        return sum(numel for name, numel in self.live if kind in (None, name))


def kind_of(name: str) -> str:
    """``normal_`` or ``uniform_``: the draw an operation's cost per element is taken from (the models here draw
    with nothing else)."""
    return "normal_" if "normal" in name else "uniform_"


def draw_s(draws: Iterable[tuple[str, float]], ns_per_element: dict[str, float]) -> float:
    """Seconds to draw ``(kind, elements)`` pairs at the measured cost per element."""
    return sum(elements * ns_per_element[kind] for kind, elements in draws) * 1e-9


def measured_draw_costs() -> dict[str, float]:
    """Nanoseconds per float32 element of torch's ``normal_`` and ``uniform_`` on one thread, and of ``uniform_``
    drawn by modattrs' own kernel (``OWN_UNIFORM``: the same bits, see ``modattrs/_deferred/rng/kernels.py``; torch's
    rate where it is not built), each run into a new 64 MiB tensor (which the allocator may serve from memory freed
    before: eager construction's first touch of its pages is in the factor ``projection`` derives), wall clock, best
    of 7 runs of each, alternating."""
    numel, kinds = 2**24, ("normal_", "uniform_", OWN_UNIFORM)
    generator = torch.Generator().manual_seed(SEED)

    def draw(kind: str) -> None:
        tensor = torch.empty(numel)
        if kind != OWN_UNIFORM or not kernels.uniform_(tensor, 0.0, 1.0, generator):
            getattr(tensor, kind.split()[0])(generator=generator)

    best = dict.fromkeys(kinds, math.inf)
    with one_thread():
        for _ in range(7):
            for kind in kinds:
                seconds, _ = wall_s(lambda kind=kind: draw(kind))  # type: ignore[misc]
                best[kind] = min(best[kind], seconds)
    return {kind: seconds / numel * 1e9 for kind, seconds in best.items()}


def measured_jump_costs() -> dict[int, tuple[float, float]]:
    """Seconds of ``jumped_state`` per distance (it picks drawing or a polynomial jump), wall clock, best of 5: for a
    distance not jumped before (each run a few blocks further), and for one jumped again (replays keep the powers of
    the last distances: identical layers make identical jumps)."""
    torch.manual_seed(SEED)
    torch.empty(7).uniform_()  # a state in mid-block
    state = torch.get_rng_state()
    jumped_state(state, JUMP_DISTANCES[-1])  # a process's first jump sets up tables
    return {
        k: (best_jump_s(state, [k + 624 * 1009 * i for i in range(1, 6)]), best_jump_s(state, [k] * 5))
        for k in JUMP_DISTANCES
    }


def best_jump_s(state: Tensor, distances: list[int]) -> float:
    """The fastest of jumps to ``distances``, one after another as a replay makes them (``wall_s`` collects garbage
    before each call, which leaves a lone jump's tables out of the caches: 0.25 ms where a replay's take 0.04)."""
    times = []
    with collected():
        for k in distances:
            start = time.perf_counter()
            jumped_state(state, k)
            times.append(time.perf_counter() - start)
    return min(times)


@dataclass
class Jumps:
    count: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def timing_jumps() -> Iterator[Jumps]:
    """Count and time the generator jumps replays make (``mt19937``'s two ways of advancing a state, which every jump
    goes through), by wrapping them for the block."""
    jumps, lock, depth = Jumps(), threading.Lock(), threading.local()
    originals = {name: getattr(mt19937, name) for name in ("_advance_by_polynomial", "_advance_by_drawing")}

    def timed(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def advance(*args: Any, **kwargs: Any) -> Tensor:
            if getattr(depth, "value", 0):  # one inside the other: counted once
                return original(*args, **kwargs)
            depth.value = 1
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                depth.value = 0
                with lock:
                    jumps.count += 1
                    jumps.seconds += time.perf_counter() - start

        return advance

    for name, original in originals.items():
        setattr(mt19937, name, timed(original))
    try:
        yield jumps
    finally:
        for name, original in originals.items():
            setattr(mt19937, name, original)


RANDOM_EVENTS = {"aten::normal_": "normal_", "aten::uniform_": "uniform_"}


def drawn_elements(subject: Subject, rank: int, world_size: int) -> dict[str, int]:
    """The elements a rank's replay draws, per kind, from torch's profiler (one thread, so that every draw runs on
    the profiled one). Jumps by drawing use ``random_`` on scratch memory, which is not counted."""
    drawn = dict.fromkeys(("normal_", "uniform_"), 0)
    with fake_group(rank, world_size) as mesh, mock.patch.object(kernels, "_extension", None):
        # torch's kernels only: modattrs' uniform_ kernel is not an operator, which the profiler would not see
        model = shard_deferred(subject, mesh)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
            materialize_sharded(model, threads=1)
    for event in profile.events():
        kind = RANDOM_EVENTS.get(event.name)
        parent = event.cpu_parent
        if kind is not None and (parent is None or parent.name != event.name) and event.input_shapes:
            drawn[kind] += math.prod(event.input_shapes[0])
    return drawn


@dataclass
class Measured:
    """What the projection takes from a model's rows: eager construction, the record's census, and the slowest
    rank at the largest world size, run again with its jumps timed and its draws counted."""

    subject: Subject
    eager_s: float
    census: Census
    rank: int
    rank_s: float
    jumps: Jumps
    drawn: dict[str, int]


def measure_for_projection(
    subject: Subject, eager_s: float, census: Census, slowest_rank: int, runs: int, progress: Progress
) -> Measured:
    """The slowest rank at the largest world size again, with its jumps timed: the run of the best of ``runs``."""
    world_size = WORLD_SIZES[-1]
    best: tuple[float, Jumps] | None = None
    with fake_group(slowest_rank, world_size) as mesh, one_thread():
        for _ in range(runs):
            model = shard_deferred(subject, mesh)
            as_in_a_fresh_process()
            with timing_jumps() as counted:
                seconds, _ = wall_s(lambda model=model: materialize_sharded(model))  # type: ignore[misc]
            if best is None or seconds < best[0]:
                best = seconds, counted
    assert best is not None
    seconds, jumps = best
    drawn = drawn_elements(subject, slowest_rank, world_size)
    progress(f"{subject.key}: rank {slowest_rank} of {world_size} again: {seconds:.3f} s, {jumps.count} jumps")
    return Measured(subject, eager_s, census, slowest_rank, seconds, jumps, drawn)


def projection(measured: list[Measured], dims: Dims) -> list[str]:
    world_size = WORLD_SIZES[-1]
    costs = measured_draw_costs()
    jumps = measured_jump_costs()
    jump_s = max(new for new, _ in jumps.values())
    lines = [
        "",
        f"PROJECTION (not a measurement): 70B Llama ({LLAMA_70B.describe()}) at {world_size} ranks, one thread",
        f"per rank. Measured here: normal_ {costs['normal_']:.2f} ns and uniform_ {costs['uniform_']:.2f} ns per "
        f"float32 element with torch's kernels, uniform_ {costs[OWN_UNIFORM]:.2f} ns with modattrs' (one thread, a "
        "new tensor each run; replays draw uniform_ with modattrs'); jumped_state over "
        + ", ".join(
            f"{k:.3g} outputs {jumps[k][0] * 1e3:.2f} ms ({jumps[k][1] * 1e3:.2f} ms again)" for k in JUMP_DISTANCES
        )
        + f"; the projection takes {jump_s * 1e3:.2f} ms for every jump.",
    ]
    replayed = {**costs, "uniform_": costs[OWN_UNIFORM]}  # what a replay draws with
    for entry in measured:
        subject, census = entry.subject, entry.census
        # Eager construction costs more than its draws' kernels (Python, allocation): the same factor is applied to
        # every draw, eager or replayed.
        factor = entry.eager_s / draw_s(census.live + census.dead, costs)
        drawn_s = factor * draw_s(entry.drawn.items(), replayed)
        rest = entry.rank_s - drawn_s - entry.jumps.seconds
        overhead = max(rest, 0.0) / census.ops
        share = sum(entry.drawn.values()) / census.elements()
        torch.manual_seed(SEED)
        big = Census.of(deferred_init(subjects(LLAMA_70B)[subject.key].build))
        eager = factor * draw_s(big.live + big.dead, costs)
        kept = [(kind, numel / world_size) for kind, numel in big.live]
        local = factor * draw_s(kept, replayed) + len(big.live) * jump_s + big.ops * overhead
        scaled_jumps = entry.jumps.count * big.ops / census.ops
        as_measured = (
            factor * draw_s(((kind, numel * share) for kind, numel in big.live), replayed)
            + scaled_jumps * jump_s
            + big.ops * overhead
        )
        target = shard_target(world_size)
        lines += [
            f"  {subject.label} ({subject.key}): {big.elements() / 1e9:.1f}B elements kept, {len(big.live)} random "
            f"operations kept, {len(big.dead)} overwritten, {big.ops} recorded operations.",
            f"    From the {dims.layers}-layer model: its rank {entry.rank} of {world_size}, run again with its jumps "
            f"timed, took {entry.rank_s:.3f} s: it drew {share:.2%} of the kept elements (its shards: "
            f"{1 / world_size:.2%}), about {drawn_s:.3f} s; {entry.jumps.count} jumps, {entry.jumps.seconds:.3f} s; "
            f"the rest, {rest:.3f} s, is {overhead * 1e6:.0f} us per recorded operation"
            f"{' (taken as 0)' if rest < 0 else ''}. Eager construction took {factor:.2f}x its draws' kernels.",
            f"    projected eager construction: {eager:.0f} s ({eager / 60:.1f} min)",
            f"    projected shard-local replay per rank (its shards drawn, a jump per kept draw): {local:.1f} s = "
            f"{local / eager:.4f}x eager (target {target:.4f}x: {'within' if local / eager <= target else 'above'} "
            "target)",
            f"    projected replay per rank drawing {share:.2%} of the elements, as measured: {as_measured:.0f} s = "
            f"{as_measured / eager:.3f}x eager",
        ]
    return lines


# The run


def run(dims: Dims, keys: list[str], quick: bool, runs: int, layouts_only: bool = False) -> int:
    progress = Progress()
    threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    chosen = subjects(dims)
    rows: list[Row] = []
    header: list[str] = []
    measured: list[Measured] = []
    notes: list[str] = []
    for key in keys:
        subject = chosen[key]
        try:
            eager_s, eager, eager_state = eager_construction(subject)
        except Exception as error:
            traceback.print_exc()
            rows.append(Row(key, "eager construction", "-", "-", None, 1.0, [f"raised: {first_line(error)}"]))
            continue
        parameters = sum(p.numel() for p in eager.parameters())
        header.append(
            f"{key}: {subject.label}, {parameters / 1e6:.1f}M float32 parameters ({dims.describe()}); "
            f"eager construction {eager_s:.3f} s (best of {EAGER_RUNS}, one thread)"
        )
        progress(header[-1])
        if key == "plain":
            layout_rows_, layouts_eager_s = layout_rows(subject, eager, eager_state, eager_s, runs, progress)
            rows += layout_rows_
            if layouts_eager_s < eager_s:
                header[-1] += f"; {layouts_eager_s:.3f} s for the layout rows (best of {EAGER_RUNS + runs - 1})"
        if layouts_only:
            continue
        subject_rows, slowest = fsdp_rows(subject, eager, eager_state, eager_s, runs, progress)
        subject_rows.append(whole_model_row(subject, eager, eager_state, eager_s, runs))
        progress(f"{key}: whole model: {subject_rows[-1].measured}")
        subject_rows.append(head_row(subject, eager, eager_state, max(runs, 3)))
        progress(f"{key}: lm_head only: {subject_rows[-1].measured} vs {subject_rows[-1].baseline}")
        del eager
        subject_rows.append(memory_row(subject, quick, progress))
        rows += subject_rows
        try:
            if slowest is None:
                raise RuntimeError(f"no rank at world size {WORLD_SIZES[-1]} ran")
            torch.manual_seed(SEED)
            census = Census.of(deferred_init(subject.build))
            measured.append(measure_for_projection(subject, eager_s, census, slowest, runs, progress))
        except Exception as error:
            traceback.print_exc()
            notes.append(f"{key}: no projection: {type(error).__name__}: {first_line(error)}")

    print(
        f"Shard-local materialization against eager construction, seed {SEED}: torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, load average {load_before:.2f} before and {os.getloadavg()[0]:.2f} after; eager "
        f"construction and materialization on one thread, but for the whole-model row ({threads} threads, "
        f"materialize_module's default); best of {runs} materializations"
    )
    for line in header:
        print(f"  {line}")
    print_table(rows)
    failed = [row for row in rows if row.problems]
    for row in failed:
        print(f"FAILED: {row.model}: {row.label}")
        for problem in row.problems[:20]:
            print(f"    {problem}")
        if len(row.problems) > 20:
            print(f"    ... and {len(row.problems) - 20} more")
    try:
        for line in projection(measured, dims) if measured else []:
            print(line)
    except Exception as error:
        traceback.print_exc()
        notes.append(f"projection failed: {type(error).__name__}: {first_line(error)}")
    for note in notes:
        print(note)
    return 1 if failed or notes else 0


def print_table(rows: list[Row]) -> None:
    titles = ["model", "row", "measured", "baseline", "ratio", "target", "verdict", "values"]
    cells = [titles, *(row.cells() for row in rows)]
    widths = [max(len(line[column]) for line in cells) for column in range(len(titles))]
    for line in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="models of about 50M parameters: a smoke run")
    parser.add_argument("--only", choices=["plain", "llama"], help="measure one of the two models")
    parser.add_argument(
        "--runs", type=int, default=2, help="timed materializations per rank and per row, the best kept (default 2)"
    )
    parser.add_argument(
        "--layouts", action="store_true", help="only the rows of the layouts (FSDP2 over tensor parallelism, ...)"
    )
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "RANK"), help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.runs < 1:
        parser.error(f"--runs must be 1 or more, got {arguments.runs}")
    dims = QUICK if arguments.quick else FULL
    if arguments.worker:
        key, rank = arguments.worker
        memory_worker(subjects(dims)[key], int(rank))
        return
    keys = [arguments.only] if arguments.only else ["plain", "llama"]
    if arguments.layouts:
        keys = ["plain"]
    sys.exit(run(dims, keys, arguments.quick, arguments.runs, arguments.layouts))


if __name__ == "__main__":
    main()
