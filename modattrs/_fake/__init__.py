"""Fake mode's engine: the fake tensor mode, the device guard that lets torch make fake CUDA tensors without a GPU, the
simulated backward pass, and the spoofed GPU that ``torch.cuda`` describes inside fake blocks.

Outside the engine, the public face ``modattrs.fake`` and ``_torch_changes`` use its modules; the command line uses
the two names below.
"""

from modattrs._fake.spoofed_cuda import MAX_DEVICES, PRESETS

__all__ = ["MAX_DEVICES", "PRESETS"]
