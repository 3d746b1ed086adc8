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
        if isinstance(value, int) and torch.accelerator.current_accelerator() is None:
            # torch makes an int an index of the machine's accelerator, and fails on a build without one: there it
            # is a CUDA index, as on CUDA builds, for fake CUDA (on MPS or XPU it stays theirs, as in torch).
            return torch.device("cuda", value)
        return torch.device(value)
    except RuntimeError as error:
        raise ValueError(f"{what}: invalid device {value!r}\nreason: {error}") from None
