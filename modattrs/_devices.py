"""How modattrs reads the devices users give it."""

from __future__ import annotations

import torch

__all__: list[str] = []


def as_device(value: object, what: str) -> torch.device:
    """``value``, a torch.device, a string such as ``"cuda:1"`` or a CUDA index, as a torch.device.

    Raises:
        TypeError: ``value`` is of another type (a bool too, which would pass for an index), naming ``what``.
        ValueError: torch does not know the device, naming ``what`` and saying why.
    """
    if isinstance(value, torch.device):
        return value
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise TypeError(f"{what}: device must be a torch.device, str or int, got {value!r}")
    try:
        # An int is a CUDA index, on any build: torch.device(1) asks for the machine's accelerator, which a build
        # without CUDA lacks (and which is not CUDA everywhere).
        return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{what}: invalid device {value!r}: {error}") from None
