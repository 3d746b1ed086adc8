"""The fake tensor mode behind :func:`modattrs.fake.fake_mode`: torch's ``FakeTensorMode``, with three changes.

* A deep copy of the mode is the mode itself. ``copy.deepcopy`` of a fake tensor copies the mode it belongs to,
  so layers that clone submodules (``nn.Transformer``) would otherwise spread their parameters over many modes,
  which cannot be mixed.
* Fake tensors made from fresh meta tensors are not memoized. The memo holds weak references to them, and
  ``torch.utils.swap_tensors``, which ``Module.to`` uses for fake parameters, refuses tensors that have any.
* In-place operations that only write values (random fills, ``fill_``, ``zero_``) return their input at once:
  a fake tensor has no values, and these are most of what initializing a model costs. ``detach`` and ``empty``,
  the rest of it, take a short path to the same result.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorConverter, FakeTensorMode, in_kernel_invocation_manager
from torch.overrides import TorchFunctionMode

from modattrs._cuda_guard import cuda_built

__all__: list[str] = []

aten = torch.ops.aten

_VALUE_ONLY_IN_PLACE = frozenset(
    {
        aten.uniform_.default,
        aten.normal_.default,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
        aten.cauchy_.default,
        aten.log_normal_.default,
        aten.geometric_.default,
        aten.fill_.Scalar,
        aten.zero_.default,
    }
)


class _Converter(FakeTensorConverter):
    def from_meta_and_device(
        self,
        fake_mode: FakeTensorMode,
        t: torch.Tensor,
        device: torch.device,
        pytype: type[torch.Tensor] | None = None,
        dispatch_keys: torch.DispatchKeySet | None = None,
    ) -> FakeTensor:
        # `t` is a fresh meta tensor (torch's own comment says so), so there is nothing to look up.
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)


class ModattrsFakeTensorMode(FakeTensorMode):  # type: ignore[no-untyped-call]
    """``FakeTensorMode(allow_non_fake_inputs=True)`` with the changes listed in this module's docstring.

    Unless ``fake_cuda`` is set, CUDA devices are refused on builds of torch without CUDA: without the device
    guard that ``fake_cuda`` sets up, some operations on such tensors fail and autograd aborts the process.
    """

    def __init__(self, *, fake_cuda: bool = False) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.refuse_cuda = not fake_cuda and not cuda_built()
        converter = self.fake_tensor_converter
        self.fake_tensor_converter = _Converter(copy_data=converter.meta_converter.copy_data, export=converter.export)

    def __deepcopy__(self, memo: dict[int, Any]) -> ModattrsFakeTensorMode:
        return self

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        if func in _VALUE_ONLY_IN_PLACE:
            return args[0]
        kwargs = kwargs or {}
        if self.refuse_cuda and _on_cuda(kwargs.get("device")):
            raise RuntimeError(
                f"{func}: fake tensors on CUDA need modattrs.fake.fake_mode(fake_cuda=True) on this build of torch, "
                "which has no CUDA"
            )
        if func is aten.detach.default and _plain_fake(args[0], self):
            device = args[0].device
            with in_kernel_invocation_manager(self):  # the fake tensor is seen as the meta tensor it is
                meta = func(*args)
            return self._from_meta(meta, device)
        if func is aten.empty.memory_format and kwargs.get("layout") in (None, torch.strided):
            device = torch.device(kwargs.get("device") or "cpu")
            return self._from_meta(func(*args, **{**kwargs, "device": "meta", "pin_memory": False}), device)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _from_meta(self, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        return FakeTensor(self, meta, device)


def _on_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"  # type: ignore[call-overload]


def _plain_fake(tensor: object, mode: FakeTensorMode) -> bool:
    # The short path is for ordinary fakes of this mode; constants and symbolic sizes take torch's path.
    return type(tensor) is FakeTensor and tensor.fake_mode is mode and tensor.constant is None


# trunc_normal_ draws by rejection sampling, which reads values (`.item()`, `mask.any()`): it cannot run on fake
# tensors at all. It has no __torch_function__ hook, so while a fake mode is open torch's helper is replaced by one
# that returns fake tensors untouched and runs the original on everything else. Counted, for nested and
# concurrent modes.
_patch_lock = threading.Lock()
_patch_depth = 0
_original_trunc_normal = torch.nn.init._no_grad_trunc_normal_


def _trunc_normal_skipping_fakes(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    if isinstance(tensor, FakeTensor):
        return tensor
    return _original_trunc_normal(tensor, *args, **kwargs)


@contextlib.contextmanager
def skip_data_dependent_init() -> Iterator[None]:
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            torch.nn.init._no_grad_trunc_normal_ = _trunc_normal_skipping_fakes
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.nn.init._no_grad_trunc_normal_ = _original_trunc_normal


class SimulatedBackward(TorchFunctionMode):
    """Backward passes over spoofed-CUDA fakes on a build of torch without CUDA.

    The autograd engine needs an accelerator for CUDA tensors and raises without one, fake or not. The gradient
    of a fake graph has no values either, only metadata, which is each leaf's own: so the leaves reachable from
    the outputs get a fake ``.grad`` like themselves (``torch.autograd.grad`` returns such tensors), without
    running the engine. Hooks and custom ``backward`` functions do not run.
    """

    def __torch_function__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in _BACKWARDS:  # everything else, first: this runs for every torch call in the block
            return func(*args, **kwargs)
        if func is torch.Tensor.backward:
            outputs, inputs = [args[0]], kwargs.get("inputs")
            gradients = [kwargs.get("gradient", args[1] if len(args) > 1 else None)]
        elif func is torch.autograd.backward:
            outputs, inputs = _as_list(args[0] if args else kwargs["tensors"]), kwargs.get("inputs")
            gradients = _as_list(kwargs.get("grad_tensors")) or [None] * len(outputs)
        else:
            outputs = _as_list(args[0] if args else kwargs["outputs"])
            inputs = args[1] if len(args) > 1 else kwargs["inputs"]
            gradients = _as_list(kwargs.get("grad_outputs")) or [None] * len(outputs)
        if not any(_spoofed_cuda(t) for t in outputs):
            return func(*args, **kwargs)
        leaves = _reachable_leaves(outputs, gradients)
        if func is not torch.autograd.grad:
            for leaf in leaves if inputs is None else _as_list(inputs):
                if leaf.grad is None and (inputs is not None or leaf.requires_grad):
                    leaf.grad = torch.empty_like(leaf)
            return None
        grads: list[torch.Tensor | None] = []
        for tensor in _as_list(inputs):
            if not any(tensor is leaf for leaf in leaves) and tensor.grad_fn is None:
                if not kwargs.get("allow_unused", kwargs.get("materialize_grads", False)):
                    raise RuntimeError(
                        "One of the differentiated Tensors appears to not have been used in the graph. "
                        "Set allow_unused=True if this is the desired behavior."
                    )
                grads.append(None)
            else:
                grads.append(torch.empty_like(tensor))
        return tuple(grads)


_BACKWARDS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})


def _as_list(tensors: Any) -> list[Any]:
    if tensors is None:
        return []
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _spoofed_cuda(tensor: Any) -> bool:
    return isinstance(tensor, FakeTensor) and tensor.device.type == "cuda" and not cuda_built()


def _reachable_leaves(outputs: list[torch.Tensor], gradients: list[Any]) -> list[torch.Tensor]:
    """The leaves whose gradients a backward pass from ``outputs`` would accumulate; checks what torch checks."""
    nodes = []
    for index, (output, gradient) in enumerate(zip(outputs, gradients, strict=False)):
        if output.grad_fn is None and not output.requires_grad:
            raise RuntimeError(f"element {index} of tensors does not require grad and does not have a grad_fn")
        if gradient is None and output.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        if output.grad_fn is None:
            return [output]
        nodes.append(output.grad_fn)
    leaves: list[torch.Tensor] = []
    seen: set[int] = set()
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        nodes.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return leaves
