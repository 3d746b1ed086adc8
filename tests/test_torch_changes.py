"""What modattrs changes in torch: made in one fixed order whatever feature a process uses first, and undone."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from modattrs._fake import cuda_guard, spoofed_cuda

ROOT = Path(__file__).resolve().parent.parent

# Each feature is used once in the order given on the command line, then all of them again (each must still work
# after the others were first used), and the script prints what is changed in torch. With "undo", it then undoes
# the changes, prints what is left, uses every feature again and prints the state once more.
SCRIPT = r'''
import copy, json, os, sys, warnings
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

warnings.simplefilter("error", UserWarning)  # the data pointer warning of fake deep copies must be silenced

from modattrs import VirtualTensor, _torch_changes
from modattrs._fake import cuda_guard
from modattrs.deferred import deferred_init, materialize_module
from modattrs.fake import fake_mode, is_fake


def build():
    layer = nn.Linear(4, 4)
    nn.init.trunc_normal_(layer.weight)
    torch.manual_seed(5)  # a reseed in the middle: the generator functions must see it
    return nn.Sequential(layer, nn.Linear(4, 2))


def deferred():
    torch.manual_seed(0)
    eager = build()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    model = materialize_module(deferred_init(build))
    assert all(torch.equal(a, b) for a, b in zip(eager.state_dict().values(), model.state_dict().values()))
    assert torch.equal(torch.get_rng_state(), after_eager)


def fake():
    with fake_mode():
        model = build()
        nn.init.trunc_normal_(torch.empty(3, 3))
        copied = copy.deepcopy(model)
    assert is_fake(copied[0].weight) and model.half()[0].weight.dtype == torch.float16
    real = nn.init.trunc_normal_(torch.zeros(1000), a=-1.0, b=1.0)
    assert bool((real.abs() <= 1.0).all()) and real.std() > 0.3


def cuda():
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = build()
        model(torch.ones(2, 4)).sum().backward()
    assert model[0].weight.grad.device.type == "cuda"


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        VirtualTensor(self, "positions", "make", cache=True)

    def make(self, dtype, device):
        return torch.arange(4, dtype=dtype, device=device)


def cached():
    module = Cached()
    first = module.positions.value
    assert module.positions.value is first and torch.equal(first, torch.arange(4.0)) and not is_fake(first)


def where(function):
    names = []
    while function is not None and len(names) < 10:
        code = getattr(function, "__code__", None)
        if not hasattr(code, "co_filename"):
            names.append(type(function).__name__)
        else:
            path = code.co_filename.replace(os.sep, "/")
            package = next((p for p in ("modattrs/", "torch/") if p in path), "")
            names.append(package + path.rpartition(package)[2] + ":" + code.co_name if package else code.co_name)
        function = getattr(function, "__wrapped__", None)
    return names


def changed():
    """Every attribute of torch's modules and main classes that is, or wraps, a function of modattrs."""
    found = {}
    owners = [(name, module) for name, module in list(sys.modules.items()) if name.split(".")[0] == "torch" and module]
    classes = [torch.Tensor, nn.Module, FakeTensor, FakeTensorMode]
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param")
    if fsdp is not None:
        classes.append(fsdp.FSDPParam)
    owners += [(f"{cls.__module__}.{cls.__name__}", cls) for cls in classes]
    for owner_name, owner in owners:
        for attribute, value in list(vars(owner).items()):
            if isinstance(value, property):  # a property is modattrs' if its setter is
                value = value.fset
            if isinstance(value, classmethod):  # not callable itself
                value = value.__func__
            if callable(value) and any(name.startswith("modattrs/") for name in where(value)):
                found[f"{owner_name}.{attribute}"] = where(value)
    silenced = [f[1].pattern for f in warnings.filters if f[0] == "ignore" and f[1] is not None]
    return {
        "functions": dict(sorted(found.items())),
        "silenced": [p for p in silenced if "FakeTensor" in p],
        "fake cuda guard": cuda_guard.ready(),
    }


FEATURES = {"deferred": deferred, "fake": fake, "cuda": cuda, "cached": cached}
order = sys.argv[1].split(",")
for name in order:
    FEATURES[name]()
for name in order:
    FEATURES[name]()
states = [changed()]
if sys.argv[2:] == ["undo"]:
    _torch_changes.undo()
    states.append(changed())
    for name in order:
        FEATURES[name]()
    states.append(changed())
print(json.dumps(states))
'''


def fake_cuda_can_be_built() -> bool:

    try:
        cuda_guard.require()  # builds and caches it for the processes below too
    except RuntimeError:
        return False
    return True


def features() -> list[str]:
    names = ["deferred", "fake", "cached"]
    if fake_cuda_can_be_built():
        names.append("cuda")  # spoofed CUDA: the device guard or the bindings' CUDA initialization, and replacements
    return names


def run(order: tuple[str, ...], *extra: str) -> list[dict[str, Any]]:
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(order), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=environment,
        check=False,
    )
    assert result.returncode == 0, f"order {order}: {result.stderr[-3000:]}"
    return json.loads(result.stdout.splitlines()[-1])  # type: ignore[no-any-return]


DTENSOR_HELPERS = {f"torch.distributed.tensor.placement_types.{name}" for name in ("mesh_scatter", "mesh_broadcast")}
FSDP_CHUNKS = {
    "torch.distributed.fsdp._fully_shard._fsdp_param._chunk_with_empty",
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._init_sharded_post_forward_param_metadata",
    "torch.distributed.fsdp._fully_shard._fsdp_param.FSDPParam._init_sharded_param",
}


def test_every_order_of_first_use_leaves_torch_in_one_state_and_every_feature_working() -> None:
    used = features()
    orders = list(itertools.permutations(used))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        results = dict(zip(orders, pool.map(run, orders), strict=True))
    (installed,) = results[orders[0]]
    for order, states in results.items():
        assert states == [installed], f"order {order} leaves torch otherwise than order {orders[0]}"
    expected = {
        "torch.nn.init._no_grad_trunc_normal_",
        "torch.manual_seed",
        "torch.random.manual_seed",
        "torch.get_rng_state",
        "torch.random.get_rng_state",
        "torch.set_rng_state",
        "torch.random.set_rng_state",
        "torch.Tensor.numpy",
        "torch.Tensor.__deepcopy__",
        "torch._subclasses.fake_tensor.FakeTensor.__deepcopy__",
        "torch.Tensor.to",
        "torch.Tensor.cuda",
        "torch.Tensor.data",
        "torch._subclasses.fake_tensor.FakeTensor.__reduce_ex__",
        "torch._subclasses.fake_tensor.FakeTensor.__torch_dispatch__",
    }
    if "cuda" in used:
        expected |= {f"torch.cuda.{name}" for name in spoofed_cuda.ANSWERS}
        if not cuda_guard.gpu_present():  # a real GPU runs torch's autograd engine
            expected |= {"torch.autograd._engine_run_backward", "torch.autograd.graph._engine_run_backward"}
        if cuda_guard.attention_needs_the_driver():  # torch 2.8's CUDA build without a GPU
            expected.add("torch.nn.functional.scaled_dot_product_attention")
    # Changes 14 and 15 where torch.distributed.tensor and FSDP2 are imported (torch._dynamo, which change 1 imports,
    # imports both here).
    assert set(installed["functions"]) - DTENSOR_HELPERS - FSDP_CHUNKS == expected
    assert set(installed["functions"]) & DTENSOR_HELPERS in (set(), DTENSOR_HELPERS)
    assert set(installed["functions"]) & FSDP_CHUNKS in (set(), FSDP_CHUNKS)
    assert installed["silenced"] == ["Accessing the data pointer of FakeTensor"]


def test_undoing_the_changes_puts_torch_back_and_the_next_use_makes_them_again() -> None:
    installed, undone, reinstalled = run(tuple(features()), "undo")
    assert installed["functions"]
    assert undone["functions"] == {}
    assert undone["silenced"] == []
    assert reinstalled == installed


GENERATOR_FUNCTIONS = {
    f"torch.{space}{name}" for space in ("", "random.") for name in ("manual_seed", "get_rng_state", "set_rng_state")
}


def test_a_process_that_only_uses_fake_mode_keeps_torchs_generator_functions() -> None:
    (fake_only,) = run(("fake", "cached"))
    assert fake_only["functions"]  # the base changes are made
    assert not set(fake_only["functions"]) & GENERATOR_FUNCTIONS
    (fake_then_deferred,) = run(("fake", "deferred"))
    added = set(fake_then_deferred["functions"]) - set(fake_only["functions"])
    assert added - DTENSOR_HELPERS == GENERATOR_FUNCTIONS
    # Change 14 where torch.distributed.tensor is imported (torch._dynamo, which change 1 imports, imports it here):
    # both of DTensor's helpers or neither.
    assert added & DTENSOR_HELPERS in (set(), DTENSOR_HELPERS)
