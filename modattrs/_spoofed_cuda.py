"""The GPU that ``torch.cuda``'s device queries describe inside ``fake_mode(fake_cuda=True)``.

Model code asks about the GPU while it builds or runs (transformers' mixture-of-experts layers ask
``torch.cuda.get_device_capability`` to choose a kernel), and a machine without one answers "not compiled with
CUDA" or "no NVIDIA driver". Inside a spoofed block, six of ``torch.cuda``'s functions answer as the chosen GPU
instead: ``is_available``, ``device_count``, ``current_device``, ``get_device_name``, ``get_device_capability``
and ``get_device_properties``.

Those functions are attributes of the ``torch.cuda`` module, shared by every thread, so ``_torch_changes``
replaces them once for the process, by the wrappers :func:`answering` makes; each wrapper answers from this
thread's innermost spoofed block, and calls torch's own function everywhere else (other threads, outside any
block, inside :func:`truthful`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["A100", "GPU", "H100", "MAX_DEVICES", "PRESETS"]

#: torch's fake CUDA device guard (``c10::impl::FakeGuardImpl``, on builds without CUDA) knows cuda:0 to cuda:7:
#: spoofed CUDA has so many devices at most, on every build.
MAX_DEVICES = 8

_MIB = 1 << 20


@dataclass(frozen=True)
class GPU:
    """A GPU for spoofed CUDA to describe: what ``torch.cuda.get_device_properties`` answers inside
    ``fake_mode(fake_cuda=True, gpu=...)``, with the attribute names of torch's device properties.

    Make your own for a GPU that is not a preset, e.g.
    ``GPU("NVIDIA L4", major=8, minor=9, total_memory=22_491 * 2**20, multi_processor_count=58)``.
    """

    name: str
    major: int
    minor: int
    total_memory: int  # bytes, as the driver reports them (a little less than the card's nominal size)
    multi_processor_count: int
    L2_cache_size: int = 0  # bytes
    max_threads_per_multi_processor: int = 2048
    regs_per_multiprocessor: int = 65536
    warp_size: int = 32
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    gcnArchName: str = ""  # AMD's architecture name; empty for NVIDIA GPUs, as torch reports it

    def __post_init__(self) -> None:
        if self.total_memory <= 0 or self.multi_processor_count <= 0 or self.major < 0 or self.minor < 0:
            raise ValueError(
                f"GPU {self.name!r}: total_memory and multi_processor_count must be positive and major and minor "
                f"at least 0, got total_memory={self.total_memory}, multi_processor_count="
                f"{self.multi_processor_count}, major={self.major}, minor={self.minor}"
            )


#: An NVIDIA H100 SXM with 80 GB of HBM3 (compute capability 9.0): the default.
H100 = GPU(
    "NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    total_memory=81_559 * _MIB,
    multi_processor_count=132,
    L2_cache_size=50 * _MIB,
)

#: An NVIDIA A100 SXM4 with 80 GB (compute capability 8.0).
A100 = GPU(
    "NVIDIA A100-SXM4-80GB",
    major=8,
    minor=0,
    total_memory=81_050 * _MIB,
    multi_processor_count=108,
    L2_cache_size=40 * _MIB,
)

#: The GPUs known by name, for ``python -m modattrs inspect --gpu NAME``.
PRESETS = {"H100": H100, "A100": A100}


@dataclass(frozen=True)
class Spoof:
    gpu: GPU
    device_count: int


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Spoof] = []  # this thread's spoofed blocks, innermost last
        self.truthful = False  # inside truthful()


#: This thread's spoofed blocks and truthful() state (plain attributes: the fake mode reads them for every operation).
state = _ThreadState()


def check(gpu: GPU, device_count: int) -> Spoof:
    """The spoof for ``gpu`` and ``device_count``; raise if they cannot be one."""
    if not isinstance(gpu, GPU):
        raise TypeError(f"gpu must be a modattrs.fake.GPU (e.g. modattrs.fake.A100), got {type(gpu).__name__}: {gpu!r}")
    if isinstance(device_count, bool) or not isinstance(device_count, int) or not 1 <= device_count <= MAX_DEVICES:
        raise ValueError(
            f"device_count must be an int from 1 to {MAX_DEVICES} (torch's fake device guard knows cuda:0 to "
            f"cuda:{MAX_DEVICES - 1}), got {device_count!r}"
        )
    return Spoof(gpu, device_count)


@contextlib.contextmanager
def spoofing(spoof: Spoof) -> Iterator[None]:
    """Make this thread's ``torch.cuda`` device queries describe ``spoof`` until the block ends."""
    stack = state.stack
    stack.append(spoof)
    try:
        yield
    finally:
        del stack[max(i for i, entry in enumerate(stack) if entry is spoof)]


def current() -> Spoof | None:
    """This thread's innermost spoof, or None outside spoofed blocks (and inside :func:`truthful`)."""
    if state.truthful:
        return None
    stack = state.stack
    return stack[-1] if stack else None


@contextlib.contextmanager
def truthful() -> Iterator[None]:
    """Let torch's own device queries answer in this thread until the block ends: for torch's fake tensor mode and
    modattrs itself, which must know whether a real GPU is there."""
    before = state.truthful
    state.truthful = True
    try:
        yield
    finally:
        state.truthful = before


def real_device_count() -> int:
    """How many CUDA devices this machine really has (0 on builds without CUDA and on machines without a driver)."""
    with truthful():
        return int(torch.cuda.device_count())


def device_limit() -> int:
    """How many spoofed CUDA devices this thread may use now: the innermost block's count (inside
    :func:`truthful` too), else every one."""
    stack = state.stack
    return stack[-1].device_count if stack else MAX_DEVICES


def _index(spoof: Spoof, device: Any, function: str) -> int:
    if device is None:
        return 0
    if isinstance(device, int) and not isinstance(device, bool):
        index = device
    else:
        try:
            parsed = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"torch.cuda.{function}: expected a CUDA device, got {device!r}") from None
        if parsed.type != "cuda":
            raise ValueError(f"torch.cuda.{function}: expected a CUDA device, got {parsed}")
        index = parsed.index or 0
    if not 0 <= index < spoof.device_count:
        raise ValueError(
            f"torch.cuda.{function}: cuda:{index} is not one of the {spoof.device_count} spoofed devices (cuda:0 to "
            f"cuda:{spoof.device_count - 1}); ask for more with fake_mode(fake_cuda=True, device_count=N)"
        )
    return index


def _is_available(spoof: Spoof) -> bool:
    return True


def _device_count(spoof: Spoof) -> int:
    return spoof.device_count


def _current_device(spoof: Spoof) -> int:
    return 0


def _get_device_properties(spoof: Spoof, device: Any = None) -> GPU:
    _index(spoof, device, "get_device_properties")
    return spoof.gpu


def _get_device_name(spoof: Spoof, device: Any = None) -> str:
    _index(spoof, device, "get_device_name")
    return spoof.gpu.name


def _get_device_capability(spoof: Spoof, device: Any = None) -> tuple[int, int]:
    _index(spoof, device, "get_device_capability")
    return spoof.gpu.major, spoof.gpu.minor


#: The functions of torch.cuda that spoofed blocks answer, with the answers.
ANSWERS: dict[str, Callable[..., Any]] = {
    "is_available": _is_available,
    "device_count": _device_count,
    "current_device": _current_device,
    "get_device_name": _get_device_name,
    "get_device_capability": _get_device_capability,
    "get_device_properties": _get_device_properties,
}


def answering(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A wrap for ``torch.cuda.<name>``: the spoofed answer inside this thread's spoofed blocks, torch's outside."""
    answer = ANSWERS[name]

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def query(*args: Any, **kwargs: Any) -> Any:
            spoof = current()
            if spoof is None:
                return original(*args, **kwargs)
            return answer(spoof, *args, **kwargs)

        return query

    return wrap
