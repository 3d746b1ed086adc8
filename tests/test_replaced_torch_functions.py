"""The functions modattrs replaces in torch take every argument form torch's take, and behave as torch's do.

Each comparison runs one script in fresh processes: one with stock torch, one where modattrs made its changes to
torch (fake CUDA used once: every replacement there is). The script calls torch's functions in each argument form
their signatures admit, outside modattrs' modes, and prints what came of it: values returned, gradients filled,
exceptions raised, warnings and the file and line they name. The two printouts must be equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from modattrs import _torch_changes
from tests.test_torch_changes import fake_cuda_can_be_built

ROOT = Path(__file__).resolve().parent.parent

COMMON = r"""
import json, re, sys, warnings
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

SETUP = sys.argv[1]
FAKE = SETUP.startswith("fake")
if SETUP != "stock":
    from modattrs.fake import fake_mode
    with fake_mode(fake_cuda=True):
        pass  # every replacement is made
    import modattrs._torch_changes
    assert modattrs._torch_changes._replaced, "no replacement was made"


def describe(value):
    if isinstance(value, torch.Tensor):
        described = {"shape": list(value.shape), "dtype": str(value.dtype), "requires_grad": value.requires_grad}
        if not FAKE:
            described["values"] = value.detach().tolist() if value.numel() < 100 else float(value.double().sum())
        return described
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [describe(item) for item in value]]
    if isinstance(value, dict):
        return ["dict", {key: describe(item) for key, item in value.items()}]
    return re.sub("0x[0-9a-f]+", "0x?", repr(value))


def run(name, case):
    # What calling case gives: its value and the gradients of the leaves it names, or its exception; its warnings,
    # with the file and line they name.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value, leaves = case()
            outcome = {"value": describe(value), "grads": [describe(leaf.grad) for leaf in leaves]}
        except Exception as error:
            message = "" if FAKE else re.sub("0x[0-9a-f]+", "0x?", str(error))  # the simulation words some its way
            outcome = {"raised": type(error).__name__, "message": message}
    outcome["warnings"] = [[w.category.__name__, str(w.message), w.filename, w.lineno] for w in caught]
    return name, outcome
"""

# torch.autograd.backward, torch.autograd.grad and Tensor.backward in every argument form, on a small graph of real
# CPU tensors (stock against replaced), or of fake ones (torch's engine on CPU against the simulation on spoofed
# CUDA). Arguments are expressions over the graph's names, evaluated when the case runs.
AUTOGRAD = r"""
import contextlib

MODES = {"fake-cpu": lambda: fake_mode(), "fake-cuda": lambda: fake_mode(fake_cuda=True)}
DEVICE = "cuda" if SETUP == "fake-cuda" else "cpu"


def graph():
    # Made in the setup's mode; the calls are made outside any mode, as torch's own modes (torch.device blocks)
    # would name themselves in warnings.
    torch.manual_seed(0)
    with MODES.get(SETUP, contextlib.nullcontext)(), torch.device(DEVICE):
        w = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        u = torch.randn(2, requires_grad=True)  # not used by the outputs
        y = w * b
        loss, other = (y * 2).sum(), (y + 1).sum()
    return {"w": w, "b": b, "u": u, "y": y, "loss": loss, "other": other, "edge": get_gradient_edge}


def call(function, *args, **kwargs):
    def case():
        names = graph()
        given = [eval(arg, globals(), names) for arg in args]
        named = {key: eval(arg, globals(), names) for key, arg in kwargs.items()}
        return eval(function, globals(), names)(*given, **named), (names["w"], names["b"], names["u"])

    return case


BACKWARD, GRAD, METHOD = "torch.autograd.backward", "torch.autograd.grad", "loss.backward"
OUTPUTS = {
    "a tensor": "loss",
    "a list": "[loss, other]",
    "a tuple": "(loss, other)",
    "a generator": "(o for o in [loss, other])",
    "an iterator": "iter([loss, other])",
    "a map": "map(lambda t: t * 1, [loss, other])",
    "a leaf among them": "[u.sum(), w]",
}
INPUTS = {
    "a tensor": "w",
    "a list": "[w, u]",
    "a tuple": "(w, b)",
    "a generator": "(t for t in [w, b])",
    "a dict": "{'w': w, 'b': b}",
    "an empty list": "[]",
    "a non-leaf": "[y, w]",
    "an unused leaf": "[u]",
    "a tensor not requiring grad": "[w.detach()]",
    "a gradient edge": "edge(w)",
    "a list of gradient edges": "[edge(w), edge(y)]",
    "a string": "'w'",
}
GRADIENTS = {
    "None": "None",
    "a tensor": "torch.ones_like(loss)",
    "a list with None": "[None, torch.ones_like(other)]",
    "a tuple": "(torch.ones_like(loss), torch.ones_like(other))",
    "a generator": "(g for g in [torch.ones_like(loss), None])",
    "a wrong shape": "[loss.new_ones(2), None]",
}

CASES = {}
for form, outputs in OUTPUTS.items():
    CASES[f"backward of {form}"] = call(BACKWARD, outputs)
    CASES[f"backward(tensors=) of {form}"] = call(BACKWARD, tensors=outputs)
    CASES[f"grad of {form}"] = call(GRAD, outputs, "w")
    CASES[f"grad(outputs=, inputs=) of {form}"] = call(GRAD, outputs=outputs, inputs="[w, b]")
for form, inputs in INPUTS.items():
    CASES[f"backward, inputs {form}"] = call(BACKWARD, "loss", inputs=inputs)
    CASES[f"grad, inputs {form}"] = call(GRAD, "loss", inputs)
    CASES[f"grad, inputs {form}, allow_unused"] = call(GRAD, "loss", inputs, allow_unused="True")
    CASES[f"Tensor.backward, inputs {form}"] = call(METHOD, inputs=inputs)
for form, gradients in GRADIENTS.items():
    CASES[f"backward, grad_tensors {form}"] = call(BACKWARD, "(loss, other)", gradients)
    CASES[f"backward, grad_tensors= {form}"] = call(BACKWARD, "(loss, other)", grad_tensors=gradients)
    CASES[f"backward, grad_variables= {form}"] = call(BACKWARD, "(loss, other)", grad_variables=gradients)
    CASES[f"grad, grad_outputs {form}"] = call(GRAD, "(loss, other)", "w", gradients)
    CASES[f"grad, grad_outputs= {form}"] = call(GRAD, "(loss, other)", "w", grad_outputs=gradients)
CASES.update({
    "backward, grad_tensors and grad_variables": call(BACKWARD, "loss", "None", grad_variables="None"),
    "backward, both given": call(BACKWARD, "loss", "loss.new_ones(())", grad_variables="loss.new_ones(())"),
    "backward, grad_variables positional": call(BACKWARD, "loss", "None", "None", "False", "loss.new_ones(())"),
    "backward, all positional": call(BACKWARD, "loss", "loss.new_ones(())", "True", "False", "None", "w"),
    "backward, retain_graph": call(BACKWARD, "loss", retain_graph="True"),
    "backward, non-scalar without gradient": call(BACKWARD, "y"),
    "backward, non-scalar with gradient": call(BACKWARD, "y", "torch.ones_like(y)"),
    "backward, an output without grad": call(BACKWARD, "loss.new_ones(())"),
    "backward, an int": call(BACKWARD, "5"),
    "backward, no argument": call(BACKWARD),
    "backward, an unknown keyword": call(BACKWARD, "loss", gradient="None"),
    "backward, too many arguments": call(BACKWARD, "loss", "None", "None", "False", "None", "None", "None"),
    "backward, edge outputs": call(BACKWARD, "edge(loss)", "loss.new_ones(())"),
    "grad, positional": call(GRAD, "loss", "w", "loss.new_ones(())", "True", "False", "True", "True", "False", "False"),
    "grad, too many arguments": call(GRAD, "loss", "w", "None", "None", "False", "True", "None", "False", "False", "1"),
    "grad, no inputs": call(GRAD, "loss"),
    "grad, only_inputs=False": call(GRAD, "loss", "w", only_inputs="False"),
    "grad, materialize_grads": call(GRAD, "loss", "[w, u]", materialize_grads="True"),
    "grad, materialize_grads, allow_unused=False": call(GRAD, "loss", "w", materialize_grads="1", allow_unused="False"),
    "grad, materialize_grads, allow_unused=True": call(GRAD, "loss", "w", materialize_grads="1", allow_unused="True"),
    "grad, is_grads_batched": call(GRAD, "y", "w", "y.new_ones(4, 3)", is_grads_batched="True"),
    "grad, is_grads_batched, wrong shape": call(GRAD, "y", "w", "y.new_ones(4, 2)", is_grads_batched="True"),
    "grad, non-scalar": call(GRAD, "y", "w"),
    "grad, edge outputs": call(GRAD, "edge(loss)", "w", "loss.new_ones(())"),
    "Tensor.backward": call(METHOD),
    "Tensor.backward, gradient positional": call("y.backward", "torch.ones_like(y)"),
    "Tensor.backward, gradient=": call("y.backward", gradient="torch.ones_like(y)"),
    "Tensor.backward, all positional": call(METHOD, "loss.new_ones(())", "True", "False", "w"),
    "Tensor.backward, retain_graph=": call(METHOD, retain_graph="False"),
    "Tensor.backward, an unknown keyword": call(METHOD, grad_tensors="None"),
})
if not FAKE:
    # torch makes the default gradient of an edge as a real tensor on its device: for a spoofed-CUDA edge, inside a
    # fake_mode block only
    CASES["backward, edge outputs without gradient"] = call(BACKWARD, "edge(loss)")
    # the simulation refuses double backward
    CASES["backward, create_graph"] = call(BACKWARD, "loss", create_graph="True")
    CASES["grad, create_graph"] = call(GRAD, "loss", "w", create_graph="True")
    CASES["Tensor.backward, create_graph"] = call(METHOD, create_graph="True")

print(json.dumps([run(name, case) for name, case in CASES.items()]))
"""

# The other functions modattrs replaces, called outside its modes (and scaled_dot_product_attention, which it
# replaces on torch 2.8's CUDA builds without a GPU). The helper of trunc_normal_ is called by its name.
OTHERS = r"""
torch.manual_seed(0)  # torch seeds its generator at random in each process
state = torch.get_rng_state()
q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
helper = getattr(nn.init, "_no_grad_trunc_normal_")
seeded = lambda seed: torch.Generator().manual_seed(seed)
attention = torch.nn.functional.scaled_dot_product_attention
from torch._subclasses.fake_tensor import FakeTensorMode
with FakeTensorMode():  # torch's own fake tensors: their data property is left as torch's
    fake, other_fake = torch.empty(3), torch.empty(2, dtype=torch.float64)
real = torch.zeros(2)
import copy, io, pickle


def skipping(save):
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        return save()


CALLS = {
    "numpy": "torch.ones(3).numpy().tolist()",
    "numpy(force=True)": "torch.ones(3, requires_grad=True).numpy(force=True).tolist()",
    "numpy of a tensor requiring grad": "torch.ones(3, requires_grad=True).numpy()",
    "numpy(True)": "torch.ones(3).numpy(True)",
    "numpy(unknown=1)": "torch.ones(3).numpy(unknown=1)",
    "Tensor.numpy(tensor)": "torch.Tensor.numpy(torch.ones(2)).tolist()",
    "trunc_normal_": "nn.init.trunc_normal_(torch.empty(5), generator=seeded(1))",
    "trunc_normal_ positional": "nn.init.trunc_normal_(torch.empty(5), 0.5, 2.0, -1.0, 1.0, seeded(1))",
    "trunc_normal_ keywords": "nn.init.trunc_normal_(tensor=torch.empty(5), mean=0.0, std=0.5, generator=seeded(2))",
    "trunc_normal_ of a non-tensor": "nn.init.trunc_normal_([1.0, 2.0])",
    "trunc_normal_'s helper": "helper(torch.empty(5), 0.0, 1.0, -2.0, 2.0, generator=seeded(3))",
    "trunc_normal_'s helper, keywords": "helper(tensor=torch.empty(5), mean=0.0, std=1.0, a=-2.0, b=2.0)",
    "trunc_normal_'s helper, too few arguments": "helper(torch.empty(5), 0.0)",
    "trunc_normal_'s helper without arguments": "helper()",
    "trunc_normal_'s helper, only the tensor by keyword": "helper(tensor=torch.empty(5))",
    "trunc_normal_, mean far outside [a, b]": "nn.init.trunc_normal_(torch.empty(5), mean=9.0, generator=seeded(4))",
    "trunc_normal_'s helper, mean far outside [a, b]": "helper(torch.empty(5), -9.0, 1.0, -2.0, 2.0, seeded(4))",
    # torch.nn.init's other warnings, which go through what it warns with too
    "kaiming_uniform_ of an empty tensor": "nn.init.kaiming_uniform_(torch.empty(0))",
    "a deprecated initializer": "getattr(nn.init, 'uniform')(torch.empty(3))",
    "manual_seed": "torch.manual_seed(3)",
    "manual_seed(seed=)": "torch.manual_seed(seed=3)",
    "random.manual_seed": "torch.random.manual_seed(3).initial_seed()",
    "manual_seed of a string": "torch.manual_seed('x')",
    "manual_seed without a seed": "torch.manual_seed()",
    "get_rng_state": "torch.get_rng_state()",
    "random.get_rng_state": "torch.random.get_rng_state()",
    "get_rng_state(1)": "torch.get_rng_state(1)",
    "set_rng_state": "(torch.set_rng_state(state), torch.rand(2))",
    "set_rng_state(new_state=)": "(torch.set_rng_state(new_state=state), torch.rand(2))",
    "random.set_rng_state": "(torch.random.set_rng_state(state), torch.rand(2))",
    "set_rng_state without a state": "torch.set_rng_state()",
    "set_rng_state of a list": "torch.set_rng_state([1, 2])",
    "set_rng_state of None": "torch.set_rng_state(None)",
    "set_rng_state(new_state=) of an int": "torch.set_rng_state(new_state=5)",
    "set_rng_state of a float tensor": "torch.set_rng_state(state.float())",
    "set_rng_state, an unknown keyword": "torch.set_rng_state(state=state)",
    "get_rng_state, an unknown keyword": "torch.get_rng_state(device='cpu')",
    "Tensor.numpy without a tensor": "torch.Tensor.numpy()",
    "Tensor.numpy of a list": "torch.Tensor.numpy([1.0])",
    "to(dtype)": "torch.ones(2).to(torch.float64)",
    "to(device, dtype)": "torch.ones(2).to('cpu', torch.half)",
    "to(device=, copy=)": "torch.ones(2).to(device=torch.device('cpu'), copy=True)",
    "to(other)": "torch.ones(2).to(torch.ones(1, dtype=torch.int64))",
    "to(memory_format=)": "torch.ones(1, 2, 2, 2).to(memory_format=torch.channels_last).stride()",
    "to(unknown=1)": "torch.ones(2).to(unknown=1)",
    "to of a meta tensor": "torch.ones(2, device='meta').to('cpu')",
    "Tensor.to(tensor, device)": "torch.Tensor.to(torch.ones(2), 'cpu')",
    "Tensor.to without a tensor": "torch.Tensor.to()",
    "Tensor.to of a list": "torch.Tensor.to([1.0], 'cpu')",
    "Tensor.cuda without a tensor": "torch.Tensor.cuda()",
    "Tensor.cuda of a list": "torch.Tensor.cuda([1.0])",
    "cuda(unknown=1)": "torch.ones(2).cuda(unknown=1)",
    "cuda.is_available": "torch.cuda.is_available()",
    "cuda.is_available(1)": "torch.cuda.is_available(1)",
    "cuda.device_count": "torch.cuda.device_count()",
    "cuda.current_device": "torch.cuda.current_device()",
    "cuda.get_device_name": "torch.cuda.get_device_name()",
    "cuda.get_device_name(0)": "torch.cuda.get_device_name(0)",
    "cuda.get_device_capability(device=0)": "torch.cuda.get_device_capability(device=0)",
    "cuda.get_device_properties(0)": "torch.cuda.get_device_properties(0)",
    "data of a fake tensor": "(fake.data.shape, fake.data.dtype, type(fake.data).__name__)",
    "data of a fake tensor set": "(setattr(fake, 'data', other_fake), fake.shape, fake.dtype)",
    "data of a fake tensor set to a real tensor": "setattr(fake, 'data', torch.ones(2))",
    "data of a fake tensor set to a list": "setattr(fake, 'data', [1.0])",
    "data of a real tensor set": "(setattr(real, 'data', torch.ones(3)), real)",
    "pickle of a fake tensor": "pickle.dumps(other_fake)",
    "copy of a fake tensor": "type(copy.copy(other_fake)).__name__",
    "saving a fake tensor without its data": "skipping(lambda: torch.save(other_fake, io.BytesIO()))",
    "FakeTensor.__reduce_ex__ without a protocol": "other_fake.__reduce_ex__()",
    "FakeTensor.data.__get__ without a tensor": "torch._subclasses.fake_tensor.FakeTensor.data.__get__(None)",
    "scaled_dot_product_attention": "attention(q, k, v)",
    "scaled_dot_product_attention, keywords": "attention(query=q, key=k, value=v, is_causal=True, scale=0.5)",
    "scaled_dot_product_attention, scale positional": "attention(q, k, v, None, 0.0, True, 0.5)",
}
results = [run(name, lambda: (eval(call), ())) for name, call in CALLS.items()]
print(json.dumps(results))
"""


def outcomes(tmp_path: Path, script: str, setup: str) -> list[tuple[str, dict[str, Any]]]:
    """What ``script`` prints, run as a file in a new process with ``setup``: ``stock`` or ``replaced``; the
    warnings it reports name that file."""
    path = tmp_path / "calls.py"
    path.write_text(COMMON + script)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(path), setup], capture_output=True, text=True, timeout=600, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [tuple(pair) for pair in json.loads(result.stdout.splitlines()[-1])]  # type: ignore[misc]


def assert_same(stock: list[tuple[str, dict[str, Any]]], replaced: list[tuple[str, dict[str, Any]]]) -> None:
    assert [name for name, _ in stock] == [name for name, _ in replaced]
    differing = {name: (a, b) for (name, a), (_, b) in zip(stock, replaced, strict=True) if a != b}
    assert not differing, "\n".join(f"{name}:\n  stock:    {a}\n  replaced: {b}" for name, (a, b) in differing.items())


needs_fake_cuda = pytest.mark.skipif(not fake_cuda_can_be_built(), reason="fake CUDA cannot be built here")


@needs_fake_cuda
def test_backward_and_grad_take_every_argument_form_as_stock_torch_does_once_modattrs_changed_torch(
    tmp_path: Path,
) -> None:
    stock = outcomes(tmp_path, AUTOGRAD, "stock")
    assert any("grads" in outcome and outcome["grads"][0] != "None" for _, outcome in stock)  # gradients compared
    assert any(outcome["warnings"] for _, outcome in stock)  # warnings compared
    assert_same(stock, outcomes(tmp_path, AUTOGRAD, "replaced"))


@needs_fake_cuda
def test_the_other_replaced_functions_take_every_argument_form_as_stock_torch_does(tmp_path: Path) -> None:
    assert_same(outcomes(tmp_path, OTHERS, "stock"), outcomes(tmp_path, OTHERS, "replaced"))


@needs_fake_cuda
def test_simulated_backward_on_spoofed_cuda_takes_every_argument_form_torchs_engine_takes_on_fake_cpu(
    tmp_path: Path,
) -> None:
    # Fake CPU graphs run torch's own engine; spoofed-CUDA ones the simulation: same shapes of gradients, same
    # Nones, same exception types, same warnings at the same lines.
    on_cpu = outcomes(tmp_path, AUTOGRAD, "fake-cpu")
    assert sum("grads" in outcome for _, outcome in on_cpu) > len(on_cpu) // 2
    assert_same(on_cpu, outcomes(tmp_path, AUTOGRAD, "fake-cuda"))


WARNING_SCRIPT = r"""
import warnings
import torch
from modattrs.fake import fake_mode
from tests.test_torch_changes import fake_cuda_can_be_built

with fake_mode(fake_cuda=True):
    pass  # spoofed CUDA set up: modattrs' changes to autograd are made
warnings.simplefilter("always")
for device in ("cpu", "cuda"):
    with fake_mode(fake_cuda=True):
        w = torch.ones(3, requires_grad=True, device=device)
        one = w.new_ones(())
    with warnings.catch_warnings(record=True) as caught:
        torch.autograd.backward((w * 2).sum(), grad_variables=one)  # deprecated
        torch.autograd.grad((w * 2).sum(), [w], only_inputs=False)  # deprecated
    print(device, [(w.category.__name__, w.filename, w.lineno) for w in caught])
"""


@needs_fake_cuda
def test_a_warning_of_torch_autograd_names_the_callers_line_once_modattrs_changed_torch(tmp_path: Path) -> None:
    path = tmp_path / "caller.py"
    path.write_text(WARNING_SCRIPT)
    lines = [number for number, line in enumerate(WARNING_SCRIPT.splitlines(), 1) if line.endswith("# deprecated")]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, env=environment, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = [("FutureWarning", str(path), line) for line in lines]
    assert result.stdout.splitlines() == [f"cpu {expected}", f"cuda {expected}"]


# trunc_normal_ warns when the mean is far outside [a, b], naming its caller (torch's trunc_normal_, or the code that
# called the helper): under each warning filter, what is shown, raised or left out, and where, is compared, and that a
# warning raised as an error leaves the tensor and the generator untouched.
TRUNC_NORMAL_WARNINGS = r"""
def draw(function, mean):
    tensor = torch.full((3,), 5.0)
    state = torch.get_rng_state()
    try:
        if function == "trunc_normal_":
            nn.init.trunc_normal_(tensor, mean=mean)
        else:
            nn.init._no_grad_trunc_normal_(tensor, mean, 1.0, -2.0, 2.0)  # the helper's caller
        raised = None
    except UserWarning as error:
        raised = str(error)
    untouched = torch.equal(tensor, torch.full((3,), 5.0)) and torch.equal(torch.get_rng_state(), state)
    return raised, untouched


LINES = open(__file__).read().splitlines()
CALLER = next(number for number, line in enumerate(LINES, 1) if line.endswith("# the helper's caller"))
FILTERS = {
    "default": [("default",)],
    "once": [("once",)],
    "module": [("module",)],
    "error": [("error",)],
    "ignored in torch.nn.init": [("default",), ("ignore", "", Warning, r"torch\.nn\.init")],
    "an error in __main__": [("default",), ("error", "", Warning, "__main__")],
    "an error at the helper's caller's line": [("default",), ("error", "", Warning, "", CALLER)],
}
results = []
for name, filters in FILTERS.items():
    with warnings.catch_warnings(record=True) as caught:
        for action, *rest in filters:
            warnings.filterwarnings(action, *rest)
        drawn = []
        for function in ("trunc_normal_", "helper"):
            for mean in (9.0, 9.0, -9.0):
                drawn.append(draw(function, mean))
    shown = [[w.category.__name__, str(w.message), w.filename, w.lineno] for w in caught]
    results.append((name, {"drawn": drawn, "shown": shown}))
print(json.dumps(results))
"""


@needs_fake_cuda
def test_trunc_normal_warns_where_stock_torch_does_under_every_warning_filter(tmp_path: Path) -> None:
    stock = outcomes(tmp_path, TRUNC_NORMAL_WARNINGS, "stock")
    shown = {warning[2] for _, outcome in stock for warning in outcome["shown"]}
    assert shown == {torch.nn.init.__file__, str(tmp_path / "calls.py")}  # both places are compared
    assert {raised is not None for _, outcome in stock for raised, _ in outcome["drawn"]} == {True, False}
    assert_same(stock, outcomes(tmp_path, TRUNC_NORMAL_WARNINGS, "replaced"))


def test_the_attention_replacement_takes_the_argument_forms_of_torchs_attention() -> None:
    # Installed on torch 2.8's CUDA builds without a GPU only: its wrap is compared on tensors it hands to torch.
    stock = F.scaled_dot_product_attention
    replaced = _torch_changes._math_attention_for_spoofed_cuda(stock)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((q, k, v), {}),
        ((q, k, v, None, 0.0, True), {"scale": 0.5, "enable_gqa": False}),
        ((), {"query": q, "key": k, "value": v, "attn_mask": None, "dropout_p": 0.0, "is_causal": False}),
        ((q, k, v, None, 0.0, False, 0.5), {}),  # scale is keyword-only
        ((q, k, v), {"unknown": 1}),
        ((q, k), {}),
    ]
    for args, kwargs in calls:
        outcomes = []
        for function in (stock, replaced):
            try:
                outcomes.append(function(*args, **kwargs))
            except TypeError as error:
                outcomes.append(str(error))
        if isinstance(outcomes[0], torch.Tensor):
            torch.testing.assert_close(outcomes[1], outcomes[0], rtol=0, atol=0)
        else:
            assert outcomes[1] == outcomes[0], (args, kwargs)
