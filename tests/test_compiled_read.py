"""The compiled hot path of ``VirtualTensor.value`` (``modattrs/_speedups.c``) reads what the Python one reads.

``tests/test_virtual.py`` runs whole with each reader (the ``value_reader`` fixture); here a stateful property test
puts attributes of every kind through the states a reference can be in, reading each with both after every step,
and the compiled reader is shown to take its hot path and to survive a materializer that changes the attribute.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import modattrs
import modattrs.virtual
from modattrs import VirtualTensor
from modattrs._compiled import generator_draws, generator_jump
from modattrs._deferred.rng import kernels, mt19937
from modattrs.deferred import deferred_init, is_deferred, materialize_module
from modattrs.fake import fake_copy, fake_mode, is_fake

speedups = modattrs.virtual._speedups
needs_speedups = pytest.mark.skipif(speedups is None, reason="modattrs._speedups is not built in this install")
Read = Callable[[VirtualTensor], Tensor]


def attributes_of(host: nn.Module) -> list[VirtualTensor]:
    return [getattr(host, name.replace(" ", "_")) for name in KINDS]


has_owner = precondition(lambda machine: machine.host is not None)
# What deferred init refuses by design (tests/test_deferred.py): real data under a deferred reference, loads and
# copies of tensors it did not record. Those steps need a module that is not deferred.
not_deferred = precondition(lambda machine: machine.host is not None and not is_deferred(machine.host))
# Neither is deferred nor holds a taken reference, which makes state_dict refuse (tests/test_virtual.py).
loadable = precondition(
    lambda machine: (
        machine.host is not None
        and not is_deferred(machine.host)
        and not any(tensor.numel() for tensor in machine.host.buffers())
    )
)


def test_the_compiled_reader_is_built_and_reads_value() -> None:
    assert speedups is not None, (
        "modattrs._speedups was not built: pip builds it from modattrs/_speedups.c when a C compiler and Python's "
        "headers are there at install time; reinstall (pip install -e .) with them to test it"
    )
    assert modattrs.virtual._read is speedups.read


RESULTS: dict[str, Callable[[torch.dtype, torch.device], object]] = {
    "as asked": lambda dtype, device: torch.arange(3, dtype=dtype, device=device),
    "int64": lambda dtype, device: torch.arange(3, device=device),
    "on the cpu": lambda dtype, device: torch.arange(3, dtype=dtype),
    "on meta": lambda dtype, device: torch.empty(3, dtype=dtype, device="meta"),
    "a parameter": lambda dtype, device: nn.Parameter(torch.ones(3, dtype=dtype, device=device)),
    "a list": lambda dtype, device: [1, 2, 3],
    "an error": lambda dtype, device: [][0],
}
KINDS = {
    "method": {},
    "fixed dtype": {"dtype": torch.float16},
    "dtype_from": {"dtype_from": "weight"},
    "cached": {"cache": True},
}


class Host(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.result = "as asked"
        for name, options in KINDS.items():
            VirtualTensor(self, name.replace(" ", "_"), "materialize", **options)  # type: ignore[arg-type]

    def materialize(self, dtype: torch.dtype, device: torch.device) -> object:
        return RESULTS[self.result](dtype, device)


def outcome(read: Read, attribute: VirtualTensor) -> tuple[object, ...]:
    """What a read gives, comparable across readers: the value's kind, dtype, device and data, or the error."""
    try:
        value = read(attribute)
    except Exception as error:
        return type(error), str(error)
    fake = is_fake(value)
    data = None if value.is_meta or fake else value.tolist()
    return type(value), fake, value.dtype, value.device, tuple(value.shape), data


@settings(max_examples=60, stateful_step_count=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
class BothReaders(RuleBasedStateMachine):
    """After every step, each attribute read by the compiled reader, the Python one, then the compiled one again
    gives one outcome; also inside fake mode, a cached() block and another thread, after loads with assign=True in
    both swap modes, copies, and on modules built in fake mode or by deferred_init."""

    def __init__(self) -> None:
        super().__init__()
        self.host = Host()
        self.attributes = attributes_of(self.host)

    @has_owner
    @rule(result=st.sampled_from(sorted(RESULTS)))
    def materialize(self, result: str) -> None:
        self.host.result = result

    @has_owner
    @rule(dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
    def convert(self, dtype: torch.dtype) -> None:
        self.host.to(dtype)

    @has_owner
    @rule(device=st.sampled_from(["meta", "cpu"]))
    def move(self, device: str) -> None:
        if device == "meta":
            self.host.to("meta")
        else:
            self.host.to_empty(device="cpu")

    @not_deferred
    @rule(name=st.sampled_from(sorted(KINDS)), dtype=st.sampled_from([torch.float64, torch.float16]))
    def set_reference_data(self, name: str, dtype: torch.dtype) -> None:
        # What FSDP2 does to move buffers: the same tensor object, another dtype (or device) inside.
        ref = self.host._buffers[f"_{name.replace(' ', '_')}_ref"]
        assert ref is not None
        ref.data = ref.new_empty(0, dtype=dtype)  # of the reference's kind: a fake one's is made in its fake mode

    @has_owner
    @rule(name=st.sampled_from(sorted(KINDS)))
    def take_the_reference(self, name: str) -> None:
        # Somebody else's tensor under the reference's name: both readers must refuse it.
        self.host._buffers[f"_{name.replace(' ', '_')}_ref"] = torch.ones(2)

    @has_owner
    @rule()
    def read_in_a_cached_block(self) -> None:
        with modattrs.cached():
            self.check()

    @has_owner
    @rule()
    def drop_the_owner(self) -> None:
        self.host = None  # type: ignore[assignment]
        gc.collect()

    @has_owner
    @rule()
    def read_in_fake_mode(self) -> None:
        with fake_mode():
            self.check()

    @has_owner
    @rule()
    def read_in_another_thread(self) -> None:
        failures: list[BaseException] = []

        def check() -> None:
            try:
                self.check()
            except BaseException as error:
                failures.append(error)

        thread = threading.Thread(target=check)
        thread.start()
        thread.join()
        assert not failures, failures

    @loadable
    @rule(swap=st.booleans())
    def load_assigned(self, swap: bool) -> None:
        state = {name: tensor.clone() for name, tensor in self.host.state_dict().items()}
        before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(swap)
        try:
            self.host.load_state_dict(state, assign=True)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(before)

    @loadable
    @rule(how=st.sampled_from(["deepcopy", "fake_copy"]))
    def copy(self, how: str) -> None:
        # The copy becomes the host; the original's attributes stay in the list, their owner gone.
        self.host = copy.deepcopy(self.host) if how == "deepcopy" else fake_copy(self.host, device="cpu")
        self.attributes += attributes_of(self.host)

    @precondition(lambda machine: machine.host is None)
    @rule(how=st.sampled_from(["eager", "fake_mode", "deferred_init"]))
    def rebuild(self, how: str) -> None:
        # The attributes of the dropped owner stay in the list: both readers must say that their owner is gone.
        if how == "eager":
            self.host = Host()
        elif how == "fake_mode":
            with fake_mode():
                self.host = Host()
        else:
            self.host = deferred_init(Host)
        self.attributes += attributes_of(self.host)

    @precondition(lambda machine: machine.host is not None and is_deferred(machine.host))
    @rule()
    def materialize_deferred(self) -> None:
        materialize_module(self.host)

    @invariant()
    def check(self) -> None:
        for attribute in self.attributes:
            first = outcome(speedups.read, attribute)
            assert outcome(VirtualTensor._read, attribute) == first
            assert outcome(speedups.read, attribute) == first


@needs_speedups
def test_compiled_and_python_readers_agree_in_every_state() -> None:
    BothReaders.TestCase().runTest()


def python_calls(read: Callable[[], object]) -> list[str]:
    """The names of the Python functions that run during ``read()``."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        read()
    finally:
        sys.setprofile(None)
    return calls


@needs_speedups
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_plain_read_runs_no_python_of_modattrs_but_the_property(device: str) -> None:
    module = Host().to(device)
    module.method.value  # the first read checks the reference
    calls = python_calls(lambda: module.method.value)
    assert "materialize" in calls
    assert not {"_read", "read", "_compute", "_converted"} & set(calls)
    module.double()  # a new reference: checked again, by the general path
    assert {"read", "_compute"} <= set(python_calls(lambda: module.method.value))
    assert "_read" not in python_calls(lambda: module.method.value)


@needs_speedups
def test_a_cached_read_goes_from_the_compiled_reader_to_the_cache() -> None:
    module = Host()
    module.cached.value
    calls = python_calls(lambda: module.cached.value)
    assert "read" in calls  # _cache.read, which serves the kept value
    assert not {"_read", "materialize"} & set(calls)


@needs_speedups
def test_a_materializer_that_deletes_its_attribute_while_running_gets_its_value_returned() -> None:
    class SelfDeleting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.delete = False
            # A lambda held by nothing but the attribute: deleting the attribute while it runs must not free it.
            VirtualTensor(self, "once", lambda module, dtype, device: module.make(dtype, device))

        def make(self, dtype: torch.dtype, device: torch.device) -> Tensor:
            if self.delete:
                del self.once
                gc.collect()
            return torch.ones(2, dtype=dtype, device=device)

    module = SelfDeleting()
    attribute = module.once
    attribute.value  # the first read checks the reference, in Python
    module.delete = True
    torch.testing.assert_close(attribute.value, torch.ones(2))
    assert "once" not in vars(module)
    del attribute  # the last reference: what it registered goes with it
    gc.collect()
    assert "_once_ref" not in module._buffers


@needs_speedups
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_torch_function_mode_sees_the_same_calls_from_both_readers(device: str) -> None:
    class Log(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(
            self, func: Callable[..., object], types: object, args: tuple[object, ...] = (), kwargs: object = None
        ) -> object:
            self.calls.append(repr(func))
            return func(*args, **(kwargs or {}))  # type: ignore[arg-type]

    module = Host().to(device)
    attribute = module.method
    attribute.value  # the first read checks the reference
    outcomes, calls = [], []
    for read in (speedups.read, VirtualTensor._read):
        with Log() as log:
            outcomes.append(outcome(read, attribute))
        calls.append(log.calls)
    assert outcomes[0] == outcomes[1]
    assert calls[0] == calls[1]
    # Attribute getters (the reference's and the result's dtype and device among them), the materializer's arange.
    assert sum("getset_descriptor" in call for call in calls[0]) >= 4
    assert any("arange" in call for call in calls[0])


def test_the_compiled_generator_jump_is_built_and_jumps_use_it() -> None:
    assert generator_jump is not None, (
        "modattrs._generator_jump was not built: pip builds it from modattrs/_generator_jump.c when a C compiler and "
        "Python's headers are there at install time; reinstall (pip install -e .) with them to test it"
    )
    assert mt19937._speedups is generator_jump


def test_the_compiled_uniform_kernel_is_built_and_draws_use_it() -> None:
    assert generator_draws is not None, (
        "modattrs._generator_draws was not built: pip builds it from modattrs/_generator_draws.c when a C compiler "
        "and Python's headers are there at install time; reinstall (pip install -e .) with them to test it"
    )
    assert kernels._extension is generator_draws


@pytest.mark.parametrize(
    ("extension", "defined"),
    [
        ("_speedups", "bind = lambda cls: None; read = lambda attribute: None"),
        ("_generator_jump", "mt19937_twisted = 0"),
        ("_generator_draws", "mt19937_gaussian = 0"),
    ],
)
def test_a_build_of_another_version_of_a_c_file_fails_the_import_saying_to_rebuild(
    extension: str, defined: str
) -> None:
    # What a checkout holds after a C file changed and nobody reinstalled: an extension without all that the C file
    # now defines (modattrs/_speedups.c: a bind() of other arguments).
    code = f"""if True:
        import sys, types
        stale = types.ModuleType("modattrs.{extension}")
        stale.__file__ = "/checkout/modattrs/{extension}.so"
        exec("{defined}", stale.__dict__)
        sys.modules["modattrs.{extension}"] = stale
        import modattrs
    """
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    assert (
        f"ImportError: modattrs.{extension}, a C extension, was built from another version of modattrs/{extension}.c"
        in result.stderr
    )
    assert f"\nextension: /checkout/modattrs/{extension}.so\n" in result.stderr
    assert "pip install -e ." in result.stderr


def test_a_materializer_that_reads_its_own_value_raises_recursion_error_at_a_high_recursion_limit(
    value_reader: str,
) -> None:
    # In a subprocess: a C read that recursed without counting would overflow the stack and kill the interpreter.
    code = """if True:
        import sys
        import modattrs.virtual
        from torch import nn
        from modattrs import VirtualTensor
        if sys.argv[1] == "python":
            modattrs.virtual._read = VirtualTensor._read

        class Recursive(nn.Module):
            def __init__(self):
                super().__init__()
                VirtualTensor(self, "x", "materialize")

            def materialize(self, dtype, device):
                return self.x.value

        module = Recursive()
        sys.setrecursionlimit(25000)
        try:
            module.x.value
        except RecursionError:
            print("RecursionError")
    """
    result = subprocess.run([sys.executable, "-c", code, value_reader], capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "RecursionError"), result.stderr[-2000:]
