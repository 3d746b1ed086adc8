"""Backward passes over spoofed-CUDA fake tensors, on builds of torch without CUDA.

torch's autograd engine asks for an accelerator as soon as a gradient is on a CUDA device, and a build without
CUDA has none: ``backward()`` raises, fake tensors or not. The gradient of a fake graph has no values either,
only metadata, and that is each leaf's own: so for such graphs the engine is replaced by a walk of the graph that
gives every leaf reached a fake gradient like itself. Hooks and custom ``backward`` functions do not run.

What is replaced is the engine's entry, not ``torch.autograd.backward`` and ``grad``: those stay torch's own and
take their arguments as torch does (generators, dicts, gradient edges, deprecated names, with their warnings at the
caller's line), then hand the entry tuples. Every other graph goes to torch's engine.

``_torch_changes`` installs the replacement when spoofed CUDA is set up, in processes that ask for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from modattrs._torch_private import FakeTensor, gradient_metadata, is_reentrant_checkpoint

__all__: list[str] = []


def simulating_engine(original: Callable[..., Any]) -> Callable[..., Any]:
    """torch's autograd engine entry (``original``) for everything but graphs involving spoofed-CUDA fakes."""

    @functools.wraps(original)
    def run_backward(*args: Any, **kwargs: Any) -> Any:  # as torch's functions call it: positionally
        tensors = args[0] if args else kwargs.get("t_outputs")
        if not (isinstance(tensors, tuple) and _spoofed(tensors)):
            return original(*args, **kwargs)  # as given: torch takes and checks them
        if not args:  # torch's entry names its first parameter t_outputs, its engine the rest
            args = (kwargs.pop("t_outputs"),)
        return _simulated(*args, **kwargs)

    return run_backward


def _simulated(
    tensors: tuple[Tensor | GradientEdge, ...],
    grad_tensors: tuple[Tensor | None, ...],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[Tensor | GradientEdge] | None = None,
    allow_unreachable: bool = False,
    accumulate_grad: bool = False,
) -> tuple[Tensor | None, ...] | None:
    """What the engine's entry returns, with torch's parameters: ``backward`` accumulates (into every leaf reached,
    or into the ``inputs`` reached) and returns None; ``grad`` gets a gradient for each input."""
    del keep_graph  # nothing is kept or freed
    if create_graph:
        raise NotImplementedError(
            "create_graph=True: gradients of gradients cannot be simulated for spoofed CUDA on a build of torch "
            "without CUDA; use fake CPU tensors, or a CUDA build of torch"
        )
    _check(tensors, grad_tensors, inputs or ())
    if not accumulate_grad and not inputs:  # torch 2.8's grad() leaves this check to its engine (2.13 makes it)
        raise ValueError("grad requires non-empty inputs.")
    leaves, nodes = _reach(tensors)
    reached = {id(leaf) for leaf in leaves}
    if accumulate_grad:
        targets = leaves if not inputs else [_target(item) for item in inputs]
        for tensor in targets:
            if tensor is not None and tensor.grad_fn is not None:
                tensor.retain_grad()  # as torch's engine does: the .grad of a non-leaf input is filled
            if tensor is not None and _used(tensor, reached, nodes) and tensor.grad is None:
                with torch.no_grad():
                    tensor.grad = torch.zeros_like(tensor)
        return None
    fakes = [t for t in (*tensors, *leaves) if isinstance(t, FakeTensor)]  # one makes the gradients of edges
    grads: list[Tensor | None] = []
    for index, item in enumerate(inputs or ()):
        gradient = _gradient(item, reached, nodes, fakes)
        if gradient is None and not allow_unreachable:
            raise RuntimeError(
                f"The differentiated Tensor at index {index} appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
        grads.append(gradient)
    return tuple(grads)


def _check(tensors: tuple[Any, ...], grad_tensors: tuple[Any, ...], inputs: Sequence[Any]) -> None:
    """What torch's engine checks of its arguments (torch's functions checked the gradients' shapes)."""
    if len(tensors) != len(grad_tensors):
        raise RuntimeError(f"got {len(tensors)} tensors and {len(grad_tensors)} gradients")
    for index, output in enumerate(tensors):
        if isinstance(output, Tensor) and output.grad_fn is None and not output.requires_grad:
            raise RuntimeError(f"element {index} of tensors does not require grad and does not have a grad_fn")
    for item in inputs:
        if not isinstance(item, (Tensor, GradientEdge)):
            raise RuntimeError(f"all inputs have to be Tensors or GradientEdges, but got {type(item).__name__}")
        if isinstance(item, Tensor) and not item.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")


def _target(item: Tensor | GradientEdge) -> Tensor | None:
    """The tensor whose ``.grad`` backward fills for an entry of ``inputs``: torch fills none for the edge of a
    non-leaf."""
    if isinstance(item, Tensor):
        return item
    variable = getattr(item.node, "variable", None)  # AccumulateGrad nodes hold their leaf
    return variable if isinstance(variable, Tensor) else None


def _used(tensor: Tensor, reached: set[int], nodes: dict[int, object]) -> bool:
    return id(tensor) in reached if tensor.grad_fn is None else id(tensor.grad_fn) in nodes


def _gradient(
    item: Tensor | GradientEdge, reached: set[int], nodes: dict[int, object], fakes: Sequence[Tensor]
) -> Tensor | None:
    """A fake gradient for an input of ``grad``, or None where the outputs do not depend on it."""
    with torch.no_grad():
        target = _target(item)
        if target is not None:
            return torch.zeros_like(target) if _used(target, reached, nodes) else None
        assert isinstance(item, GradientEdge)
        if id(item.node) not in nodes:
            return None
        metadata = gradient_metadata(item.node)[item.output_nr]
        if not fakes:
            raise NotImplementedError(
                "torch.autograd.grad of a gradient edge of a spoofed-CUDA graph whose outputs and leaves are not fake "
                "cannot be simulated; pass the tensor instead of its edge"
            )
        return fakes[0].new_zeros(metadata.shape, dtype=metadata.dtype, device=metadata.device)


def _start(output: Tensor | GradientEdge) -> Any:
    """The graph node a backward pass from ``output`` begins at (None for a leaf)."""
    return output.node if isinstance(output, GradientEdge) else output.grad_fn


def _spoofed(outputs: tuple[Any, ...]) -> bool:
    """Whether the graph from ``outputs`` involves spoofed-CUDA fakes: the outputs, a leaf, or a gradient on the
    way (a fake CPU output of a CUDA graph, ``.cpu()``). Only looks; what torch checks is checked later."""
    fakes: list[Tensor] = [t for t in outputs if isinstance(t, FakeTensor)]
    if any(t.device.type == "cuda" for t in fakes):
        return True
    edges: list[Tensor | GradientEdge] = [t for t in outputs if isinstance(t, GradientEdge)]  # fake graph or not
    starts = [node for node in map(_start, [*fakes, *edges]) if node is not None]
    for node in _graph(starts, {}):
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor) and variable.device.type == "cuda":
            return True
        if any(metadata.device.type == "cuda" for metadata in gradient_metadata(node)):
            return True  # the gradient this node receives is on CUDA
    return False


def _graph(starts: list[Any], seen: dict[int, object]) -> Iterator[Any]:
    """Each graph node reachable from ``starts``, once, kept in ``seen`` by id: torch's Python object for a graph
    node lives only while referenced (on torch 2.8; later releases keep it), and a node dropped could give its id
    to the next one."""
    nodes = list(starts)
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        nodes.extend(next_node for next_node, _ in node.next_functions if next_node is not None)


def _reach(outputs: tuple[Tensor | GradientEdge, ...]) -> tuple[list[Tensor], dict[int, object]]:
    """The leaves whose gradients a backward pass from ``outputs`` would accumulate, and the graph nodes it would
    run, by id."""
    nodes = []
    leaves: list[Tensor] = []
    for output in outputs:
        start = _start(output)
        if start is None:
            assert isinstance(output, Tensor)
            leaves.append(output)
        else:
            nodes.append(start)
    seen: dict[int, object] = {}
    for node in _graph(nodes, seen):
        if is_reentrant_checkpoint(node):
            raise RuntimeError(
                "a backward pass through torch.utils.checkpoint with use_reentrant=True cannot be simulated for "
                "spoofed CUDA.\nIts parameters are not in the graph until backward runs the forward again.\n"
                "Pass use_reentrant=False"
            )
        variable = getattr(node, "variable", None)  # AccumulateGrad nodes hold their leaf
        if isinstance(variable, Tensor):
            leaves.append(variable)
    return leaves, seen
