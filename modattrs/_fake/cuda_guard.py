"""A device guard for spoofed CUDA on builds of torch without CUDA.

Some of torch's Python bindings (``copy_``, indexing, ``.contiguous()``, ...) and the autograd engine build a
device guard for the device of their tensors, fake ones included. A CUDA build with no GPU has a guard that
pretends (torch's ``FakeGuardImpl``); a CPU-only build has none, and those calls fail, or abort the process when
autograd is involved. The cure is to register torch's own ``FakeGuardImpl<CUDA>``, which takes a few lines of
C++: they are compiled at the first use of fake CUDA and cached by torch's extension loader under a name that
includes the torch version. ``_torch_changes`` registers it, and then replaces the entry of torch's autograd engine
(``_engine_run_backward``, which ``torch.autograd.backward`` and ``grad`` call once they have taken their arguments)
by one that simulates backward passes over spoofed-CUDA graphs (see ``_fake.backward``).

A CUDA build on a machine without a GPU or a driver (what ``pip install torch`` gives on Linux) has its real
guard, and its bindings call ``torch.cuda._lazy_init()`` before moving even a fake tensor to CUDA, once per
process, which fails without a driver: :func:`require` has that first call made while torch's Python
initialization returns at once, so the bindings count CUDA as initialized, as the guard's C++ does on CPU-only
builds. Where the real guard then cannot switch devices without the driver (torch 2.8; not 2.15), the same C++
puts ``FakeGuardImpl<CUDA>`` in its place, for the process: without a GPU, the real guard has nothing to guard.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from modattrs._fake.spoofed_cuda import MAX_DEVICES, real_device_count
from modattrs._torch_private import FakeTensorMode, cuda_initialization_skipped

__all__ = ["MAX_DEVICES"]

_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <torch/csrc/utils/device_lazy_init.h>

// Registers torch's fake CUDA device guard and says whether it did: where CUDA has no guard (a CPU-only build), or,
// with replace, in place of the one it has (a CUDA build without a GPU, whose guard calls the driver). The guard
// lives until the process ends: the registry does not own it. Also marks CUDA as initialized for the Python
// bindings, which would otherwise call torch.cuda._lazy_init() (and fail) before moving even a fake tensor to
// CUDA outside a fake mode.
static bool register_fake_cuda_guard(bool replace) {
  auto& slot = c10::impl::device_guard_impl_registry[static_cast<size_t>(c10::DeviceType::CUDA)];
  static const c10::impl::DeviceGuardImplInterface* guard = new c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>();
  if (replace) {
    slot.store(guard);
  } else {
    const c10::impl::DeviceGuardImplInterface* expected = nullptr;
    if (!slot.compare_exchange_strong(expected, guard)) {
      return false;
    }
  }
  torch::utils::set_requires_device_init(c10::DeviceType::CUDA, false);
  return true;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_fake_cuda_guard", &register_fake_cuda_guard);
}
"""

_lock = threading.Lock()
_failure: str | None = None
_ready = False


def ready() -> bool:
    """Whether fake CUDA tensors can be used in this process: a real GPU, or fake CUDA is set up."""
    return _ready or gpu_present()


@functools.cache  # fixed for the build; asked on every fake dispatch with a device
def cuda_built() -> bool:
    """Whether this build of torch has CUDA (or ROCm), with or without a GPU."""
    return bool(torch.backends.cuda.is_built())  # type: ignore[no-untyped-call]


@functools.cache  # fixed for the process: CUDA counts its devices once
def gpu_present() -> bool:
    """Whether this machine has a GPU that torch can use (so nothing about CUDA needs to be faked)."""
    return cuda_built() and real_device_count() > 0


def require() -> None:
    """Make sure fake CUDA tensors can be used in this process; raise a RuntimeError saying why not."""
    global _ready, _failure
    if _ready or gpu_present():
        return
    with _lock:
        if _ready:
            return
        if _failure is None:
            try:
                if cuda_built():
                    _initialize_bindings_without_a_driver()
                    if not _guard_switches_devices():
                        _build_and_register(replace=True)
                else:
                    _build_and_register(replace=False)
                _ready = True
                return
            except Exception as error:  # the compiler's and the loader's errors vary; all mean "not available"
                _failure = f"{type(error).__name__}: {error}"
        if cuda_built():
            raise RuntimeError(
                "fake CUDA could not be set up on this CUDA build of torch without a GPU.\n"
                f"reason: {_failure}\n"
                "On torch releases whose CUDA device guard calls the driver (2.8, for one), modattrs compiles a fake "
                "one at first use.\n"
                "Install a C++ compiler (g++) and ninja (pip install ninja) and restart Python, or use a newer torch.\n"
                "Without them, build the model on the meta device (with torch.device('meta')) to inspect it, or make "
                "a fake CPU twin with modattrs.fake.fake_copy(model)."
            )
        raise RuntimeError(
            "fake CUDA needs a device guard that this CPU-only build of torch lacks, and compiling one at first use "
            "failed.\n"
            f"reason: {_failure}\n"
            "Install a C++ compiler (g++) and ninja (pip install ninja) and restart Python to use fake CUDA tensors.\n"
            "Without them, build the model on the meta device (with torch.device('meta')) to inspect it, or make "
            "a fake CPU twin with modattrs.fake.fake_copy(model)."
        )


def _initialize_bindings_without_a_driver() -> None:
    """Have torch's C++ bindings count CUDA as initialized, on a CUDA build without a GPU, for good.

    Before moving a tensor to CUDA (``.to``, ``.cuda()``, ``Module.to``), a binding calls ``torch.cuda._lazy_init``
    once per process, and only marks CUDA initialized if that returns: without a driver, it raises "Found no
    NVIDIA driver", fake tensor or not. One fake tensor is moved while torch's own re-entrance flag makes
    ``_lazy_init`` return at once in this thread (``_torch_private.cuda_initialization_skipped``). Python's
    ``torch.cuda`` stays uninitialized: its functions still say there is no driver, and real CUDA tensors still
    cannot be made.
    """
    with FakeTensorMode():
        probe = torch.empty(0)
    with cuda_initialization_skipped():
        probe.to("cuda:0")


@functools.cache  # fixed for the build
def attention_needs_the_driver() -> bool:
    """Whether ``scaled_dot_product_attention`` on fake CUDA tensors asks the driver about the GPU (torch 2.8's CUDA
    build does, to choose a kernel; 2.15 does not, nor does a build without CUDA). Sets up fake CUDA first."""
    if gpu_present():
        return False
    require()
    with FakeTensorMode():
        probe = torch.empty(1, 1, 1, 8, device="cuda")
        try:
            torch.nn.functional.scaled_dot_product_attention(probe, probe, probe)
        except RuntimeError:  # torch.AcceleratorError, where it exists, is a RuntimeError
            return True
    return False


def _guard_switches_devices() -> bool:
    """Whether the CUDA build's own device guard switches between devices without a driver.

    On a CUDA build the bindings (``copy_``, indexing, ...) guard the device of their tensors with torch's real
    CUDA guard. Newer releases (2.15) only note the device to switch to while CUDA is uninitialized; older ones
    (2.8) call ``cudaSetDevice``, which fails without a driver ("CUDA driver version is insufficient"), for any
    device but the current one. Tried once, on a fake tensor on ``cuda:1``.
    """
    with FakeTensorMode():
        probe = torch.empty(1, device="cuda:1")
        try:
            probe.copy_(probe)
        except RuntimeError:  # torch.AcceleratorError, where it exists, is a RuntimeError
            return False
    return True


def build_directory() -> Path:
    """Where the guard is built and cached: one directory per torch version, Python version and source, under
    torch's extension root (``TORCH_EXTENSIONS_DIR``, or torch's default)."""
    from torch.utils.cpp_extension import get_default_build_root

    digest = hashlib.sha1(_SOURCE.encode()).hexdigest()[:8]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    version = re.sub(r"\W", "_", torch.__version__)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"modattrs_fake_cuda_guard_{version}_{python}_{digest}"


@contextlib.contextmanager
def _building(directory: Path) -> Iterator[None]:
    """Hold the build lock of ``directory``, waiting for a process that holds it.

    Note [A lock that dies with its builder]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    torch's extension loader marks a build in progress with a file (``lock`` in the build directory) that the
    builder removes when done. A builder killed mid-build (Ctrl-C during the first use of fake CUDA, a job's time
    limit) leaves the file behind, and every later process then waits for it forever, at no CPU. Builders of this
    directory first take an advisory lock of the operating system on a file of their own, which is released when
    its process ends however it ends: whoever holds it is the only builder, so a ``lock`` file it finds was left by
    a builder that died, and is removed. (Where there are no such locks, as on Windows, torch's file alone is
    used, as before.)
    """
    directory.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(directory / "modattrs.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_and_register(*, replace: bool) -> None:
    import logging

    # On a CUDA build, torch's extension module logs "No CUDA runtime is found" when imported: true, and no concern
    # of this CPU-only extension.
    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils.cpp_extension import load_inline
    finally:
        logger.setLevel(level)

    directory = build_directory()
    with _building(directory):
        # See Note [A lock that dies with its builder].
        (directory / "lock").unlink(missing_ok=True)
        extension = load_inline(  # type: ignore[no-untyped-call]
            name=directory.name,
            cpp_sources=[_SOURCE],
            no_implicit_headers=True,  # without <torch/extension.h>, the build takes seconds rather than half a minute
            extra_cflags=["-O1"],
            with_cuda=False,
            build_directory=str(directory),
            verbose=False,
        )
    if not extension.register_fake_cuda_guard(replace):
        raise RuntimeError("CUDA has a device guard already")
