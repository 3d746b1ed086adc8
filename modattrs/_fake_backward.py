"""Backward passes over spoofed-CUDA fake tensors, on builds of torch without CUDA.

torch's autograd engine asks for an accelerator as soon as a gradient is on a CUDA device, and a build without
CUDA has none: ``backward()`` raises, fake tensors or not. The gradient of a fake graph has no values either,
only metadata, and that is each leaf's own: so for such graphs ``torch.autograd.backward`` and
``torch.autograd.grad`` are replaced by a walk of the graph that gives every leaf reached a fake gradient like
itself. Hooks and custom ``backward`` functions do not run. Everything else goes to torch's own functions.

``_torch_changes`` installs the replacements when spoofed CUDA is set up, in processes that ask for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from modattrs._torch_private import FakeTensor

__all__: list[str] = []


def simulating_backward(original: Callable[..., None]) -> Callable[..., None]:
    """``torch.autograd.backward`` (``original``) for everything but graphs involving spoofed-CUDA fakes."""

    @functools.wraps(original)
    def backward(
        tensors: Tensor | Sequence[Tensor],
        grad_tensors: Tensor | Sequence[Tensor | None] | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        grad_variables: Any = None,
        inputs: Tensor | Sequence[Tensor] | None = None,
    ) -> None:
        outputs = _as_list(tensors)
        if not _spoofed(outputs):
            original(tensors, grad_tensors, retain_graph, create_graph, grad_variables, inputs)
            return
        _refuse_double_backward(create_graph)
        leaves = _reachable_leaves(outputs, _as_list(grad_tensors) or [None] * len(outputs))
        targets = leaves if inputs is None else _as_list(inputs)
        for tensor in targets:
            if tensor.grad is None and tensor.requires_grad:
                with torch.no_grad():
                    tensor.grad = torch.zeros_like(tensor)

    return backward


def simulating_grad(original: Callable[..., tuple[Tensor | None, ...]]) -> Callable[..., tuple[Tensor | None, ...]]:
    """``torch.autograd.grad`` (``original``) for everything but graphs involving spoofed-CUDA fakes."""

    @functools.wraps(original)
    def grad(
        outputs: Tensor | Sequence[Tensor],
        inputs: Tensor | Sequence[Tensor],
        grad_outputs: Tensor | Sequence[Tensor | None] | None = None,
        retain_graph: bool | None = None,
        create_graph: bool = False,
        only_inputs: bool = True,
        allow_unused: bool | None = None,
        is_grads_batched: bool = False,
        materialize_grads: bool = False,
    ) -> tuple[Tensor | None, ...]:
        output_list = _as_list(outputs)
        if not _spoofed(output_list):
            return original(
                outputs, inputs, grad_outputs, retain_graph, create_graph, only_inputs, allow_unused,
                is_grads_batched, materialize_grads,
            )  # fmt: skip
        _refuse_double_backward(create_graph)
        return _simulated_grad(output_list, inputs, grad_outputs, allow_unused, materialize_grads)

    return grad


def _simulated_grad(
    outputs: list[Tensor], inputs: Any, grad_outputs: Any, allow_unused: bool | None, materialize_grads: bool
) -> tuple[Tensor | None, ...]:
    reached = {id(leaf) for leaf in _reachable_leaves(outputs, _as_list(grad_outputs) or [None] * len(outputs))}
    grads: list[Tensor | None] = []
    for tensor in _as_list(inputs):
        used = id(tensor) in reached or tensor.grad_fn is not None
        if used or materialize_grads:
            with torch.no_grad():
                grads.append(torch.zeros_like(tensor))
        elif allow_unused:
            grads.append(None)
        else:
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
    return tuple(grads)


def _as_list(tensors: Any) -> list[Any]:
    if tensors is None:
        return []
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _spoofed(outputs: list[Any]) -> bool:
    """Whether the graph from ``outputs`` involves spoofed-CUDA fakes: the outputs, a leaf, or a gradient on the
    way (a fake CPU output of a CUDA graph, ``.cpu()``). Only looks; what torch checks is checked later."""
    fakes: list[Tensor] = [t for t in outputs if isinstance(t, FakeTensor)]
    if any(t.device.type == "cuda" for t in fakes):
        return True
    nodes = [t.grad_fn for t in fakes if t.grad_fn is not None]
    # Keyed by id, and the nodes kept: torch's Python object for a graph node lives only while referenced (on
    # torch 2.8; later releases keep it), and a node dropped could give its id to the next one.
    seen: dict[int, object] = {}
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor) and variable.device.type == "cuda":
            return True
        if any(metadata.device.type == "cuda" for metadata in getattr(node, "_input_metadata", ())):
            return True  # the gradient this node receives is on CUDA
        nodes.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return False


def _refuse_double_backward(create_graph: bool) -> None:
    if create_graph:
        raise NotImplementedError(
            "create_graph=True: gradients of gradients cannot be simulated for spoofed CUDA on a build of torch "
            "without CUDA; use fake CPU tensors, or a CUDA build of torch"
        )


def _reachable_leaves(outputs: list[Tensor], gradients: list[Any]) -> list[Tensor]:
    """The leaves whose gradients a backward pass from ``outputs`` would accumulate; checks what torch checks."""
    nodes = []
    leaves: list[Tensor] = []
    for index, (output, gradient) in enumerate(zip(outputs, gradients, strict=False)):
        if output.grad_fn is None and not output.requires_grad:
            raise RuntimeError(f"element {index} of tensors does not require grad and does not have a grad_fn")
        if gradient is None and output.numel() != 1:
            raise RuntimeError("grad can be implicitly created only for scalar outputs")
        if output.grad_fn is None:
            leaves.append(output)
        else:
            nodes.append(output.grad_fn)
    # Keyed by id, and the nodes kept: torch's Python object for a graph node lives only while referenced (on
    # torch 2.8; later releases keep it), and a node dropped could give its id to the next one.
    seen: dict[int, object] = {}
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if type(node).__name__ == "CheckpointFunctionBackward":
            raise RuntimeError(
                "a backward pass through torch.utils.checkpoint with use_reentrant=True cannot be simulated for "
                "spoofed CUDA (its parameters are not in the graph until backward runs the forward again); pass "
                "use_reentrant=False"
            )
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor):
            leaves.append(variable)
        nodes.extend(next_node for next_node, _ in node.next_functions if next_node is not None)
    return leaves
