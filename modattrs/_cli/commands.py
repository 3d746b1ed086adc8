"""``python -m modattrs inspect``: build a model in fake mode and report what it would take, without allocating it.
``python -m modattrs audit``: run a flow under the write ledger and report what wrote each tensor's bytes."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch import nn

from modattrs import _torch_changes
from modattrs._attribute import own_attributes
from modattrs._devices import as_device
from modattrs._fake import MAX_DEVICES, PRESETS
from modattrs.shaped import ShapedTensor
from modattrs.virtual import VirtualTensor

__all__ = ["main"]

DEFAULT_TARGET = "modattrs.default_model:Decoder"


class UsageError(Exception):
    """A problem with what the user asked for: reported without a traceback, on one line unless it is long."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


@dataclass
class Row:
    """One module of the tree: its own totals include its submodules'."""

    name: str
    kind: str
    depth: int
    parameters: int
    bytes: int


@dataclass
class Report:
    target: str
    device: str
    dtype: str
    seconds: float
    memory_mib: float
    total_parameters: int = 0
    total_bytes: int = 0
    by_device: dict[str, dict[str, int]] = field(default_factory=dict)
    by_dtype: dict[str, dict[str, int]] = field(default_factory=dict)
    modules: list[Row] = field(default_factory=list)
    attributes: list[dict[str, Any]] = field(default_factory=list)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        arguments = _parser().parse_args(argv)
    except UsageError as error:
        command = "audit" if argv is not None and list(argv)[:1] == ["audit"] else "inspect"
        print(f"modattrs {command}: error: {error}", file=sys.stderr)
        return 2
    if arguments.command == "audit":
        return _audit(arguments.target, arguments.kwargs, arguments.format)
    try:
        target, kwargs = arguments.target, arguments.kwargs
        if _is_keyword(target):  # no target, only keyword arguments for the default model
            target, kwargs = DEFAULT_TARGET, [target, *kwargs]
        if arguments.depth < 0:
            raise UsageError(f"--depth must be 0 or more, got {arguments.depth}")
        report = inspect(target, kwargs, arguments.device, arguments.dtype, arguments.gpu)
    except UsageError as error:
        print(f"modattrs inspect: error: {error}", file=sys.stderr)
        return 2
    output = json.dumps(_as_json(report), indent=2) if arguments.format == "json" else _as_text(report, arguments.depth)
    return 0 if _printed(output) else 1


def _printed(output: str) -> bool:
    try:
        print(output)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more (the way the Python docs advise)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False
    return True


def _audit(target: str, kwargs: Sequence[str], output_format: str) -> int:
    """Run ``target(**kwargs)`` under the write ledger and print its report: exit 0 when the strict check passes, 1
    when it fails (bytes unwritten, computed from unwritten bytes, overwritten after loading, a tie lost), 2 when the
    flow cannot run."""
    from modattrs.ledger import LedgerError, watch

    try:
        flow = _load(target)
        keywords = _keywords(kwargs)
        try:
            with watch() as ledger:
                model = flow(**keywords)
        except (Exception, SystemExit) as error:  # whatever the flow raises: its message, no traceback
            raise UsageError(f"{target}({_show(keywords)}) failed: {type(error).__name__}: {error}") from None
        if not isinstance(model, nn.Module):
            raise UsageError(f"{target} returned {type(model).__name__}, not an nn.Module")
    except UsageError as error:
        print(f"modattrs audit: error: {error}", file=sys.stderr)
        return 2
    report = ledger.report(model)
    if not _printed(report.to_json(indent=2) if output_format == "json" else report.to_text()):
        return 1
    try:
        report.check()
    except LedgerError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


def _is_keyword(argument: str) -> bool:
    key = argument.partition("=")[0]
    return "=" in argument and key.isidentifier()


def _parser() -> _Parser:
    parser = _Parser(prog="python -m modattrs", description="Tools for modules with modattrs attributes.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    inspect = commands.add_parser(
        "inspect",
        help="build a model in fake mode and report its parameters, bytes and modattrs attributes",
        description="Build a model in fake mode, on any device and without allocating it, and report its "
        "parameters and bytes per module, totals per device and dtype, and its modattrs attributes.",
    )
    inspect.add_argument(
        "target",
        nargs="?",
        default=DEFAULT_TARGET,
        help="package.module:callable returning an nn.Module (a class or a factory); by default a 70B-parameter "
        "Llama-style decoder written with modattrs",
    )
    inspect.add_argument("kwargs", nargs="*", metavar="key=value", help="keyword arguments, as Python literals")
    inspect.add_argument("--device", default="cpu", help="device to build on, e.g. cpu, cuda, cuda:1 (default: cpu)")
    inspect.add_argument(
        "--gpu",
        choices=sorted(PRESETS),
        default="H100",
        help="with --device cuda on a machine without a GPU: the GPU that torch.cuda describes to the model "
        "(default: H100, 80 GB)",
    )
    inspect.add_argument("--dtype", default="float32", help="floating-point dtype of the model (default: float32)")
    inspect.add_argument("--depth", type=int, default=2, help="depth of the module tree to show (default: 2)")
    inspect.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    audit = commands.add_parser(
        "audit",
        help="run a flow under the write ledger and report what wrote each parameter's and buffer's bytes",
        description="Run a flow (a callable returning an nn.Module: build, to_empty, initialize, load...) under "
        "modattrs' write ledger, print what wrote each parameter and buffer, and exit 1 if any holds bytes nothing "
        "wrote, was computed from such bytes, lost loaded values to a later write, or lost a tie (the strict "
        "check's problems, printed to stderr); exit 2 if the flow cannot run.",
    )
    audit.add_argument("target", help="package.module:callable returning an nn.Module")
    audit.add_argument("kwargs", nargs="*", metavar="key=value", help="keyword arguments, as Python literals")
    audit.add_argument("--format", choices=("text", "json"), default="text", help="output format")
    return parser


def inspect(target: str, kwargs: Sequence[str], device_name: str, dtype_name: str, gpu: str = "H100") -> Report:
    factory = _load(target)
    keywords = _keywords(kwargs)
    device = _device(device_name)
    dtype = _dtype(dtype_name)

    spoof_cuda = device.type == "cuda" and not torch.cuda.is_available()
    if spoof_cuda:
        try:
            _torch_changes.install_fake_cuda()
        except RuntimeError as error:
            raise UsageError(f"--device {device_name}: {error}\nOr run with --device cpu or --device meta.") from None
    try:
        return _build_and_measure(target, factory, keywords, device, dtype, spoof_cuda, gpu)
    except UsageError:
        raise
    except (Exception, SystemExit) as error:  # whatever the target's code raises: its message, no traceback
        raise UsageError(f"{target}({_show(keywords)}) failed: {type(error).__name__}: {error}") from None


def _build_and_measure(
    target: str,
    factory: Any,
    keywords: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    spoof_cuda: bool,
    gpu: str,
) -> Report:
    from modattrs.fake import fake_mode  # fake-mode machinery is set up on first use, not at import

    chosen = PRESETS[gpu] if spoof_cuda else None  # a real GPU answers for itself
    with fake_mode(fake_cuda=spoof_cuda, gpu=chosen), torch.device(device):
        torch.empty(0)  # first use of the mode (and of the CUDA guard) before measuring
        before = _peak_mib()
        start = time.perf_counter()
        model = factory(**keywords)
        if not isinstance(model, nn.Module):
            raise UsageError(f"{target} returned {type(model).__name__}, not an nn.Module")
        _cast_floating_point(model, dtype)
        seconds = time.perf_counter() - start
        report = Report(target, str(device), str(dtype).removeprefix("torch."), seconds, _peak_mib() - before)
        _measure(model, report)
    return report


def _cast_floating_point(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters and buffers to ``dtype``, as ``model.half()`` and ``model.bfloat16()``
    do: complex tensors (a RoPE table of complex64) keep their dtype, whose imaginary part ``model.to(dtype)``
    would discard. Parameters stay the same objects (their data is replaced, as ``Module.to`` does), so ties hold."""
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)
        for name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_floating_point():
                setattr(module, name, buffer.to(dtype))


def _load(target: str) -> Any:
    module_name, colon, attribute = target.partition(":")
    if not colon or not module_name or not attribute:
        raise UsageError(f"target must be package.module:callable, got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:
        raise UsageError(f"cannot import {module_name!r}: {type(error).__name__}: {error}") from None
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise UsageError(f"module {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"{target} is a {type(factory).__name__}, not callable")
    return factory


def _keywords(pairs: Sequence[str]) -> dict[str, Any]:
    keywords = {}
    for pair in pairs:
        key, equals, text = pair.partition("=")
        if not equals or not key.isidentifier():
            raise UsageError(f"expected key=value, got {pair!r}")
        try:
            keywords[key] = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise UsageError(
                f"the value of {key} is not a Python literal: {text!r} (quote strings: {key}='...')"
            ) from None
    return keywords


def _device(name: str) -> torch.device:
    try:
        device = as_device(name, "--device")
    except ValueError:
        raise UsageError(f"unknown device {name!r}; use cpu, cuda, cuda:N, meta, ...") from None
    if device.type not in ("cpu", "cuda", "meta"):
        raise UsageError(f"device {name!r} is not supported here; use cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available() and (device.index or 0) >= MAX_DEVICES:
        raise UsageError(f"device {name!r}: spoofed CUDA has cuda:0 to cuda:{MAX_DEVICES - 1}")
    return device


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UsageError(f"unknown floating-point dtype {name!r}; use float32, bfloat16, float16, ...")
    if dtype.itemsize == 0 or "_x" in name:  # sub-byte packed dtypes: bytes would be counted unpacked
        raise UsageError(f"dtype {name!r} is packed; use float32, bfloat16, float16, float8_e4m3fn, ...")
    return dtype


def _measure(model: nn.Module, report: Report) -> None:
    counted: set[int] = set()  # a tensor both a parameter and a buffer somewhere counts once
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in counted:
            continue
        counted.add(id(tensor))
        size = tensor.numel() * tensor.element_size()
        parameters = tensor.numel() if isinstance(tensor, nn.Parameter) else 0
        report.total_parameters += parameters
        report.total_bytes += size
        for totals, key in ((report.by_device, str(tensor.device)), (report.by_dtype, _short(tensor.dtype))):
            entry = totals.setdefault(key, {"parameters": 0, "bytes": 0})
            entry["parameters"] += parameters
            entry["bytes"] += size
    for name, module in model.named_modules():
        parameters = sum(p.numel() for p in module.parameters())
        size = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
        depth = 0 if not name else name.count(".") + 1
        report.modules.append(Row(name, type(module).__name__, depth, parameters, size))
        for attribute in own_attributes(module):
            if isinstance(attribute, (VirtualTensor, ShapedTensor)):
                report.attributes.append(_describe(name, attribute))


def _describe(module_name: str, attribute: VirtualTensor | ShapedTensor) -> dict[str, Any]:
    path = f"{module_name}.{attribute.name}" if module_name else attribute.name
    if isinstance(attribute, VirtualTensor):
        value = attribute.value
        return {
            "name": path,
            "kind": "VirtualTensor",
            "shape": list(value.shape),
            "dtype": _short(value.dtype),
            "device": str(value.device),
            "bytes": value.numel() * value.element_size(),
        }
    data = attribute.value
    shape = None if data is None else list(data.shape)
    return {
        "name": path,
        "kind": "ShapedTensor",
        "shape": shape,
        "dtype": None if data is None else _short(data.dtype),
        "device": None if data is None else str(data.device),
        "constraints": attribute.constraints,
        "bytes": 0 if data is None else data.numel() * data.element_size(),
    }


def _as_json(report: Report) -> dict[str, Any]:
    return {
        "target": report.target,
        "device": report.device,
        "dtype": report.dtype,
        "build_seconds": round(report.seconds, 3),
        "build_memory_mib": round(report.memory_mib, 1),
        "total_parameters": report.total_parameters,
        "total_bytes": report.total_bytes,
        "by_device": report.by_device,
        "by_dtype": report.by_dtype,
        "modules": [
            {"name": r.name, "type": r.kind, "parameters": r.parameters, "bytes": r.bytes} for r in report.modules
        ],
        "attributes": report.attributes,
    }


def _as_text(report: Report, depth: int) -> str:
    lines = [
        f"{report.target} on {report.device} as {report.dtype} (fake: nothing was allocated)",
        f"built in {report.seconds:.2f} s, peak memory up by {report.memory_mib:.1f} MiB",
        "",
        f"{'module':<40} {'type':<16} {'parameters':>16} {'bytes':>12}",
    ]
    modules = [(r.name, r, (r.kind, r.depth, r.parameters, r.bytes)) for r in report.modules if r.depth <= depth]
    for name, row, count in _collapse(modules):
        label = "  " * row.depth + (name.rsplit(".", 1)[-1] if name else "(model)")
        kind = f"{row.kind} x{count}" if count > 1 else row.kind
        each = " each" if count > 1 else ""
        lines.append(f"{label:<40} {kind:<16} {row.parameters:>16,} {_bytes(row.bytes):>12}{each}")
    lines += ["", f"total: {report.total_parameters:,} parameters, {_bytes(report.total_bytes)} with buffers"]
    for title, totals in (("device", report.by_device), ("dtype", report.by_dtype)):
        for key, entry in totals.items():
            lines.append(f"  {title} {key:<12} {entry['parameters']:>16,} parameters {_bytes(entry['bytes']):>12}")
    if report.attributes:
        lines += ["", "modattrs attributes"]
        attributes = [(a["name"], a, (a["kind"], str(a["shape"]), a["dtype"], a["device"])) for a in report.attributes]
        for name, attribute, _ in _collapse(attributes):
            shape = "None" if attribute["shape"] is None else "(" + ", ".join(map(str, attribute["shape"])) + ")"
            constraints = f"  constraints {attribute['constraints']}" if "constraints" in attribute else ""
            where = f"{attribute['dtype']} {attribute['device']}"
            lines.append(f"  {name:<36} {attribute['kind']:<14} {shape:<20} {where}{constraints}")
    return "\n".join(lines)


_INDEX = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def _collapse(rows: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, int]]:
    """Merge rows whose names differ only in their first number and whose keys are equal: layers.0-79.attention.

    Rows are (name, row, key); the result is (label, first row, count), in the order the groups first appear.
    """
    groups: dict[tuple[str, Any], tuple[Any, list[int]]] = {}
    for name, row, key in rows:
        match = _INDEX.search(name)
        pattern = name if match is None else name[: match.start(1)] + "{}" + name[match.end(1) :]
        indices = groups.setdefault((pattern, key), (row, []))[1]
        if match is not None:
            indices.append(int(match.group(1)))
    merged = []
    for (pattern, _), (row, indices) in groups.items():
        contiguous = indices == list(range(indices[0], indices[0] + len(indices))) if indices else False
        span = f"{indices[0]}-{indices[-1]}" if contiguous and len(indices) > 1 else ",".join(map(str, indices))
        merged.append((pattern.replace("{}", span), row, max(len(indices), 1)))
    return merged


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}"
    return f"{count} B"


def _show(keywords: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in keywords.items())


def _peak_mib() -> float:
    """The process's peak resident memory in MiB (ru_maxrss is in KiB on Linux, in bytes on macOS); 0 on Windows,
    which has no resource module."""
    try:
        import resource
    except ImportError:
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
