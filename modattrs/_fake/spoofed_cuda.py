"""The GPU that ``torch.cuda``'s device queries describe inside ``fake_mode(fake_cuda=True)``.

Model code asks about the GPU while it builds or runs (transformers' mixture-of-experts layers ask
``torch.cuda.get_device_capability`` to choose a kernel), and a machine without one answers "not compiled with
CUDA" or "no NVIDIA driver". Inside a spoofed block, these functions of ``torch.cuda`` answer as the chosen GPU
instead: ``is_available``, ``device_count``, ``current_device``, ``get_device_name``, ``get_device_capability``,
``get_device_properties``, and ``set_device`` and the two that ``torch.cuda.device`` switches devices with, which
accept the current device (cuda:0, which spoofed CUDA never switches from) and refuse the others.

Those functions are attributes of the ``torch.cuda`` module, shared by every thread, so ``_torch_changes``
replaces them once for the process, by the wrappers :func:`answering` makes; each wrapper answers from this
thread's innermost spoofed block, and calls torch's own function everywhere else (other threads, outside any
block, inside :func:`truthful`).

On a build of torch without CUDA, a spoofed block also makes an int given as a device (``t.cuda(1)``,
``device=1``) a CUDA device, as torch makes it where CUDA is its accelerator (see :class:`IntDevicesAreCuda`).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from modattrs._compiled import speedups
from modattrs._torch_private import CUDA_DEVICE_EXCHANGES, PARSE_TO_BINDING

__all__ = ["A100", "GPU", "H100", "MAX_DEVICES", "PRESETS"]

#: torch's fake CUDA device guard (``c10::impl::FakeGuardImpl``, on builds without CUDA) knows cuda:0 to cuda:7:
#: spoofed CUDA has so many devices at most, on every build.
MAX_DEVICES = 8

_KIB = 1 << 10
_MIB = 1 << 20


@dataclass(frozen=True)
class GPU:
    """A GPU model for spoofed CUDA to describe: what ``torch.cuda.get_device_properties`` answers inside
    ``fake_mode(fake_cuda=True, gpu=...)``, with the attribute names of torch's device properties. Each spoofed
    device adds what is its own: a ``uuid`` and its place on the PCI bus (``pci_bus_id``, ``pci_device_id``,
    ``pci_domain_id``), as on an 8-GPU server.

    Make your own for a GPU that is not a preset, e.g.
    ``GPU("NVIDIA L4", major=8, minor=9, total_memory=22_491 * 2**20, multi_processor_count=58)``. Fields left out
    take the values that NVIDIA's data-center GPUs from V100 to H100 share (warp size, registers and threads per
    multiprocessor, threads and 48 KiB of shared memory per block), and are 0 where they depend on the model
    (clocks, memory bus, L2 cache, the shared memory a block can opt in to and a multiprocessor has).
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
    # AMD's architecture name. Empty for NVIDIA GPUs: their spoofed properties report the name there, as torch's
    # CUDA builds do.
    gcnArchName: str = ""
    clock_rate: int = 0  # kHz, the boost clock, as CUDA reports it
    memory_clock_rate: int = 0  # kHz, as CUDA reports it
    memory_bus_width: int = 0  # bits
    shared_memory_per_block: int = 48 * _KIB  # bytes a block gets without opting in to more
    shared_memory_per_block_optin: int = 0  # bytes a block can opt in to
    shared_memory_per_multiprocessor: int = 0  # bytes
    max_threads_per_block: int = 1024

    def __post_init__(self) -> None:
        if self.total_memory <= 0 or self.multi_processor_count <= 0 or self.major < 0 or self.minor < 0:
            raise ValueError(
                f"GPU {self.name!r}: total_memory and multi_processor_count must be positive and major and minor "
                f"at least 0.\ngot: total_memory={self.total_memory}, multi_processor_count="
                f"{self.multi_processor_count}, major={self.major}, minor={self.minor}"
            )
        for field in fields(self):
            value = getattr(self, field.name)
            if field.name in _SIZES and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"GPU {self.name!r}: {field.name} must be at least 0, got {value!r}")


#: GPU's fields that are sizes, counts or rates: ints, 0 or more.
_SIZES = frozenset(
    {
        "L2_cache_size", "max_threads_per_multi_processor", "regs_per_multiprocessor", "warp_size", "clock_rate",
        "memory_clock_rate", "memory_bus_width", "shared_memory_per_block", "shared_memory_per_block_optin",
        "shared_memory_per_multiprocessor", "max_threads_per_block",
    }
)  # fmt: skip

# The presets' figures are NVIDIA's published specifications, in the units CUDA reports them in.

#: An NVIDIA H100 SXM5 with 80 GB of HBM3 (compute capability 9.0): the default.
H100 = GPU(
    "NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    total_memory=81_559 * _MIB,
    multi_processor_count=132,
    L2_cache_size=50 * _MIB,
    clock_rate=1_980_000,  # 1,980 MHz boost
    memory_clock_rate=2_619_000,  # 5,120 bits at 2 x 2,619 MHz: 3.35 TB/s
    memory_bus_width=5120,
    shared_memory_per_block_optin=227 * _KIB,
    shared_memory_per_multiprocessor=228 * _KIB,
)

#: An NVIDIA A100 SXM4 with 80 GB of HBM2e (compute capability 8.0).
A100 = GPU(
    "NVIDIA A100-SXM4-80GB",
    major=8,
    minor=0,
    total_memory=81_050 * _MIB,
    multi_processor_count=108,
    L2_cache_size=40 * _MIB,
    clock_rate=1_410_000,  # 1,410 MHz boost
    memory_clock_rate=1_593_000,  # 5,120 bits at 2 x 1,593 MHz: 2.04 TB/s
    memory_bus_width=5120,
    shared_memory_per_block_optin=163 * _KIB,
    shared_memory_per_multiprocessor=164 * _KIB,
)

#: The GPUs known by name, for ``python -m modattrs inspect --gpu NAME``.
PRESETS = {"H100": H100, "A100": A100}


class CudaUUID:
    """A GPU's UUID as torch gives it (``torch._C._CUuuid``): ``str()`` is the 8-4-4-4-12 hexadecimal form, and
    ``bytes`` its 16 bytes, as a list of ints."""

    __slots__ = ("_value",)

    def __init__(self, value: uuid.UUID) -> None:
        self._value = value

    @property
    def bytes(self) -> list[int]:
        return list(self._value.bytes)

    def __str__(self) -> str:
        return str(self._value)

    def __repr__(self) -> str:
        return f"CudaUUID('{self._value}')"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CudaUUID) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True, repr=False)
class DeviceProperties:
    """What ``torch.cuda.get_device_properties`` answers for a spoofed device: the attributes of torch's
    ``_CudaDeviceProperties`` (every one that torch 2.8 to 2.15 has), from the device's :class:`GPU` and index."""

    name: str
    major: int
    minor: int
    total_memory: int
    multi_processor_count: int
    L2_cache_size: int
    max_threads_per_multi_processor: int
    regs_per_multiprocessor: int
    warp_size: int
    is_integrated: bool
    is_multi_gpu_board: bool
    gcnArchName: str
    clock_rate: int
    memory_clock_rate: int
    memory_bus_width: int
    shared_memory_per_block: int
    shared_memory_per_block_optin: int
    shared_memory_per_multiprocessor: int
    max_threads_per_block: int
    uuid: CudaUUID
    pci_bus_id: int
    pci_device_id: int
    pci_domain_id: int

    def __repr__(self) -> str:  # torch's
        return (
            f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
            f"total_memory={self.total_memory // _MIB}MB, multi_processor_count={self.multi_processor_count}, "
            f"uuid={self.uuid}, pci_bus_id={self.pci_bus_id}, pci_device_id={self.pci_device_id}, "
            f"pci_domain_id={self.pci_domain_id}, L2_cache_size={self.L2_cache_size // _MIB}MB)"
        )


#: Where an 8-GPU HGX H100 board puts its GPUs on the PCI bus, by device index.
_PCI_BUS_IDS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

#: The namespace of spoofed GPUs' UUIDs, which are derived from the GPU's name and the device index.
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "modattrs.fake/spoofed-cuda")


@functools.lru_cache(maxsize=64)
def properties(gpu: GPU, index: int) -> DeviceProperties:
    """The properties of spoofed device ``index``, a ``gpu``: the same object, and UUID, for the same arguments."""
    model = {field.name: getattr(gpu, field.name) for field in fields(gpu)}
    model["gcnArchName"] = gpu.gcnArchName or gpu.name  # torch's CUDA builds report the name there
    return DeviceProperties(
        **model,
        uuid=CudaUUID(uuid.uuid5(_UUID_NAMESPACE, f"{gpu.name}/{index}")),
        pci_bus_id=_PCI_BUS_IDS[index],
        pci_device_id=0,
        pci_domain_id=0,
    )


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
        with IntDevicesAreCuda() if _ints_are_not_cuda() else contextlib.nullcontext():
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


#: The current device of every spoofed block: spoofed CUDA does not switch devices (see :func:`_select`).
_CURRENT = 0


def _requested(device: Any, function: str, *, optional: bool = True) -> int:
    """The device index that ``torch.cuda.<function>`` makes of ``device``, by torch's rules: an int as it is, a
    CUDA device (a ``torch.device`` or its name) its index, a ``torch.cuda.device`` its own; None and ``cuda``
    without an index the current device where ``optional``. Raises ValueError or TypeError saying what is wrong."""
    if device is None and optional:
        return _CURRENT
    if isinstance(device, torch.cuda.device):
        return int(device.idx)
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):  # numpy's ints too
        return int(device)
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError as error:
            raise ValueError(
                f"torch.cuda.{function}: expected a CUDA device, got {device!r}\nreason: {error}"
            ) from None
        if parsed.type != "cuda":
            raise ValueError(f"torch.cuda.{function}: expected a CUDA device, got {parsed}")
        if parsed.index is not None:
            return parsed.index
        if optional:
            return _CURRENT
    if device is None or isinstance(device, (str, torch.device)):
        raise ValueError(f"torch.cuda.{function}: expected a CUDA device with an index, or an int, got {device!r}")
    raise TypeError(
        f"torch.cuda.{function}: expected a CUDA device (a torch.device, str or int), got {type(device).__name__}: "
        f"{device!r}"
    )


def _checked(spoof: Spoof, index: int, function: str) -> int:
    if not 0 <= index < spoof.device_count:
        raise ValueError(
            f"torch.cuda.{function}: cuda:{index} is not one of the {spoof.device_count} spoofed devices (cuda:0 to "
            f"cuda:{spoof.device_count - 1}).\nAsk for more with fake_mode(fake_cuda=True, device_count=N)"
        )
    return index


def _index(spoof: Spoof, device: Any, function: str) -> int:
    """The spoofed device that ``torch.cuda.<function>(device)`` asks about."""
    return _checked(spoof, _requested(device, function), function)


def _select(spoof: Spoof, index: int, function: str) -> int:
    """Make ``cuda:<index>`` the current device, for ``torch.cuda.<function>``, and return the one it was.

    Only the current device can be: fake tensors made for ``cuda`` without an index are on cuda:0 whatever is
    selected (torch gives them cuda:0 while CUDA is not initialized), so a switch would be silently half-made.
    """
    _checked(spoof, index, function)
    if index != _CURRENT:
        raise NotImplementedError(
            f"torch.cuda.{function}: cuda:{index} cannot be made the current device: spoofed CUDA's current device "
            f"stays cuda:{_CURRENT}.\nTensors made for 'cuda' without an index would not follow.\n"
            f"Name the device instead: 'cuda:{index}', torch.device('cuda', {index}) or device={index}"
        )
    return _CURRENT


def _is_available(spoof: Spoof) -> bool:
    return True


def _device_count(spoof: Spoof) -> int:
    return spoof.device_count


def _current_device(spoof: Spoof) -> int:
    return _CURRENT


def _get_device_properties(spoof: Spoof, device: Any = None) -> DeviceProperties:
    return properties(spoof.gpu, _index(spoof, device, "get_device_properties"))


def _get_device_name(spoof: Spoof, device: Any = None) -> str:
    _index(spoof, device, "get_device_name")
    return spoof.gpu.name


def _get_device_capability(spoof: Spoof, device: Any = None) -> tuple[int, int]:
    _index(spoof, device, "get_device_capability")
    return spoof.gpu.major, spoof.gpu.minor


def _set_device(spoof: Spoof, device: Any) -> None:
    index = _requested(device, "set_device", optional=False)
    if index >= 0:  # torch's set_device does nothing for a negative index
        _select(spoof, index, "set_device")


def _exchange_device(spoof: Spoof, device: Any) -> int:
    # torch.cuda.device's __enter__ and __exit__ call this (and the next) with an index they parsed, -1 for none.
    index = _requested(device, "device", optional=False)
    return -1 if index < 0 else _select(spoof, index, "device")


#: The functions of torch.cuda that spoofed blocks answer, with the answers.
ANSWERS: dict[str, Callable[..., Any]] = {
    "is_available": _is_available,
    "device_count": _device_count,
    "current_device": _current_device,
    "get_device_name": _get_device_name,
    "get_device_capability": _get_device_capability,
    "get_device_properties": _get_device_properties,
    "set_device": _set_device,
    **dict.fromkeys(CUDA_DEVICE_EXCHANGES, _exchange_device),
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


class IntDevicesAreCuda(TorchFunctionMode):
    """Active in spoofed blocks where torch's accelerator is not CUDA (a build without CUDA): an int given as a
    device is that CUDA device, as torch makes it where CUDA is its accelerator.

    torch's argument parser makes an int the device of that index on the machine's accelerator, and on a build
    without one fails ("Cannot access accelerator device when none is available") before any dispatch mode, the fake
    one included, sees the call. Torch function modes see the arguments before they are parsed, as Python objects:
    this one gives ``torch.device("cuda", i)`` in place of ``i`` as a ``device=`` argument to any function, and as
    the device argument that ``Tensor.to``, ``Tensor.cuda`` and ``Module.to``'s parser take by position. The fake
    mode then checks the device as it checks ``"cuda:i"``. Negative ints are left to torch, which refuses them.
    """

    def __init__(self) -> None:
        super().__init__()
        # By the function torch hands __torch_function__: the method Tensor has when the block starts.
        self._positions: dict[object, int] = {torch.Tensor.to: 1, torch.Tensor.cuda: 1, PARSE_TO_BINDING: 0}

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if kwargs:
            device = kwargs.get("device")
            if device is not None and _is_index(device):
                kwargs = {**kwargs, "device": _cuda(device)}
        else:
            kwargs = {}
        position = self._positions.get(func)
        if position is not None and len(args) > position and _is_index(args[position]):
            args = (*args[:position], _cuda(args[position]), *args[position + 1 :])
        return func(*args, **kwargs)


# A torch function mode costs every torch call in the block a round trip through Python. Where the C extension is
# built, the call enters C first, which forwards it at once unless a device argument may be an index.
if speedups is not None:  # else, installed without a C compiler: the Python method, for every call
    IntDevicesAreCuda.__torch_function__ = speedups.instance_method(  # type: ignore[method-assign]
        functools.partial(speedups.forward_unless_index, IntDevicesAreCuda.__torch_function__)
    )


def _is_index(value: object) -> bool:
    """Whether torch reads ``value`` as a device index, and refuses it on a build without an accelerator."""
    if type(value) is int:  # the common case, before the slower checks
        return value >= 0
    if isinstance(value, (str, torch.device, bool)):
        return False
    return isinstance(value, numbers.Integral) and int(value) >= 0


def _cuda(index: Any) -> torch.device:
    return torch.device("cuda", int(index))  # an index past 127 wraps around, as torch.device(index) does


@functools.cache  # torch's accelerator is fixed for the process
def _ints_are_not_cuda() -> bool:
    """Whether torch makes an int given as a device anything but a CUDA device (on a build without CUDA, it fails)."""
    accelerator = torch.accelerator.current_accelerator()
    return accelerator is None or accelerator.type != "cuda"
