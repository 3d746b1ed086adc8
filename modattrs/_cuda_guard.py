"""A device guard for spoofed CUDA on builds of torch without CUDA.

Some of torch's Python bindings (``copy_``, indexing, ``.contiguous()``, ...) and the autograd engine build a
device guard for the device of their tensors, fake ones included. A CUDA build with no GPU has a guard that
pretends (torch's ``FakeGuardImpl``); a CPU-only build has none, and those calls fail, or abort the process when
autograd is involved. The cure is to register torch's own ``FakeGuardImpl<CUDA>``, which takes a few lines of
C++: they are compiled at the first use of fake CUDA and cached by torch's extension loader under a name that
includes the torch version. ``_torch_changes`` registers it, and then replaces ``torch.autograd.backward`` and
``grad`` by versions that simulate backward passes over spoofed-CUDA graphs (see ``_fake_backward``).
"""

from __future__ import annotations

import functools
import hashlib
import re
import sys
import threading

import torch

__all__: list[str] = []

_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/csrc/utils/device_lazy_init.h>

// Registers torch's fake CUDA device guard unless CUDA has a guard already, and says whether it did. The guard
// lives until the process ends: the registry does not own it. Also marks CUDA as initialized for the Python
// bindings, which would otherwise call torch.cuda._lazy_init() (and fail) before moving even a fake tensor to
// CUDA outside a fake mode.
static bool register_fake_cuda_guard() {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  static const c10::impl::DeviceGuardImplInterface* guard = new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>();
  const c10::impl::DeviceGuardImplInterface* expected = nullptr;
  if (!slot.compare_exchange_strong(expected, guard)) {
    return false;
  }
  torch::utils::set_requires_device_init(c10::DeviceType::CUDA, false);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_fake_cuda_guard", &register_fake_cuda_guard);
}
"""

#: The devices torch's fake guard knows: cuda:0 to cuda:7.
MAX_DEVICES = 8

_lock = threading.Lock()
_failure: str | None = None
_ready = False


def ready() -> bool:
    """Whether fake CUDA tensors can be used in this process: a CUDA build, or the guard is registered."""
    return _ready or cuda_built()


@functools.cache  # fixed for the build; asked on every fake dispatch with a device
def cuda_built() -> bool:
    """Whether this build of torch has CUDA (or ROCm), with or without a GPU."""
    return bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]


def require() -> None:
    """Make sure fake CUDA tensors can be used in this process; raise a RuntimeError saying why not."""
    global _ready, _failure
    if _ready or cuda_built():
        return  # a CUDA build registers torch's fake guard itself when it finds no GPU
    with _lock:
        if _ready:
            return
        if _failure is None:
            try:
                _build_and_register()
                _ready = True
                return
            except Exception as error:  # the compiler's and the loader's errors vary; all mean "not available"
                _failure = f"{type(error).__name__}: {error}"
        raise RuntimeError(
            "fake CUDA needs a device guard that this CPU-only build of torch lacks; modattrs compiles one at first "
            f"use, and that failed ({_failure}). Install a C++ compiler (g++) and ninja (pip install ninja) and "
            "restart Python to use fake CUDA tensors; without them, "
            "build the model on the meta device (with torch.device('meta')) to inspect it, or make a fake CPU "
            "twin with modattrs.fake.fake_copy(model)."
        )


def _build_and_register() -> None:
    from torch.utils.cpp_extension import load_inline

    # One build per torch version, Python version and source; torch's loader caches it and reuses it after.
    digest = hashlib.sha1(_SOURCE.encode()).hexdigest()[:8]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    version = re.sub(r"\W", "_", torch.__version__)
    name = f"modattrs_fake_cuda_guard_{version}_{python}_{digest}"
    extension = load_inline(  # type: ignore[no-untyped-call]
        name=name,
        cpp_sources=[_SOURCE],
        no_implicit_headers=True,  # without <torch/extension.h>, the build takes seconds rather than half a minute
        extra_cflags=["-O1"],
        with_cuda=False,
        verbose=False,
    )
    extension.register_fake_cuda_guard()
