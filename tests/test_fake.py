"""modattrs.fake: fake tensors on any device, modules built and moved fake, and modattrs attributes on them."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from modattrs import ShapedTensor, VirtualTensor
from modattrs._torch_private import address_of
from modattrs.fake import fake_copy, fake_mode, is_fake, meta_like

DEVICES = ["cpu", "cuda", "cuda:1"]


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    """Run code in a new process: a crash there fails the test instead of killing the suite."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )


class Rotary(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.dim = dim
        self.proj = nn.Linear(dim, dim)
        VirtualTensor(self, "inv_freq", "compute_inv_freq")
        ShapedTensor(self, "cache", torch.zeros(2, dim), {1: dim})

    def compute_inv_freq(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return 1.0 / 10_000 ** (torch.arange(0, self.dim, 2, dtype=dtype, device=device) / self.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)[..., : self.dim // 2] * self.inv_freq.value


# --- the mode -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_created_inside_are_fake_on_the_device_asked_for(device: str) -> None:
    with fake_mode(fake_cuda=True):
        by_argument = torch.ones(3, device=device)
        with torch.device(device):
            by_context = torch.randn(2, 2)
            layer = nn.Linear(4, 4)
    expected = torch.device("cuda:0") if device == "cuda" else torch.device(device)
    for tensor in (by_argument, by_context, layer.weight):
        assert is_fake(tensor)
        assert tensor.device == expected


def test_fake_mode_yields_the_fake_tensor_mode_in_effect() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with fake_mode() as mode:
        tensor = torch.zeros(2)
    assert isinstance(mode, FakeTensorMode)
    assert tensor.fake_mode is mode  # type: ignore[attr-defined]


def test_tensors_created_inside_print_as_fake() -> None:
    with fake_mode():
        layer = nn.Linear(2, 2)
    assert "FakeTensor" in repr(layer.weight)


def test_without_fake_cuda_a_fresh_process_refuses_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = run_python(
        """
        import torch
        from modattrs.fake import fake_mode
        with fake_mode():
            try:
                torch.nn.Linear(2, 2, device="cuda")
            except RuntimeError as error:
                print(error)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "need modattrs.fake.fake_mode(fake_cuda=True)" in result.stdout


def test_cuda_devices_past_the_eighth_are_refused() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with fake_mode(fake_cuda=True), pytest.raises(ValueError, match="knows cuda:0 to cuda:7 only"):
        torch.empty(2, device="cuda:8")
    with pytest.raises(ValueError, match="knows cuda:0 to cuda:7 only"):
        fake_copy(nn.Linear(2, 2), device="cuda:8")


INITIALIZERS = {
    "uniform_": nn.init.uniform_,
    "normal_": nn.init.normal_,
    "trunc_normal_": nn.init.trunc_normal_,
    "constant_": lambda t: nn.init.constant_(t, 0.5),
    "ones_": nn.init.ones_,
    "zeros_": nn.init.zeros_,
    "eye_": nn.init.eye_,
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "kaiming_uniform_": nn.init.kaiming_uniform_,
    "kaiming_normal_": nn.init.kaiming_normal_,
    "orthogonal_": nn.init.orthogonal_,
    "sparse_": lambda t: nn.init.sparse_(t, 0.5),
}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", sorted(INITIALIZERS))
def test_every_init_function_works_on_fake_tensors(name: str, device: str) -> None:
    with fake_mode(fake_cuda=True):
        weight = torch.empty(4, 6, device=device)
        INITIALIZERS[name](weight)
        kernel = torch.empty(4, 6, 3, device=device)
        nn.init.dirac_(kernel)
    assert is_fake(weight)
    assert weight.shape == (4, 6)


def test_trunc_normal_works_on_fakes_after_the_block_and_unchanged_on_real_tensors() -> None:
    with fake_mode():
        weight = torch.empty(4, 4)
    nn.init.trunc_normal_(weight)  # e.g. re-initializing a fake twin with a model's own init function
    nn.init.trunc_normal_(fake_copy(nn.Linear(4, 4)).weight)
    torch.manual_seed(0)
    values = nn.init.trunc_normal_(torch.zeros(1000), a=-1.0, b=1.0)
    assert bool((values.abs() <= 1.0).all())
    assert values.std() > 0.3


NUMPY_READS: dict[str, Callable[[Tensor], np.ndarray]] = {
    ".numpy()": lambda t: t.numpy(),
    ".numpy(force=True)": lambda t: t.numpy(force=True),
    "np.asarray": lambda t: np.asarray(t),
    "np.asarray(dtype=)": lambda t: np.asarray(t, dtype=np.float64),
}


@pytest.mark.parametrize("fake_cuda", [False, True], ids=["cpu", "fake cuda"])
@pytest.mark.parametrize("how", NUMPY_READS)
def test_numpy_of_a_real_tensor_inside_fake_mode_is_its_data(how: str, fake_cuda: bool) -> None:
    real = torch.arange(6.0)
    with fake_mode(fake_cuda=fake_cuda):
        array = NUMPY_READS[how](real)
    np.testing.assert_array_equal(array, np.arange(6.0))


def test_numpy_of_a_real_tensor_inside_fake_mode_shares_its_memory_as_outside() -> None:
    real = torch.zeros(3)
    with fake_mode():
        inside = real.numpy()
    outside = real.numpy()
    real[1] = 5.0
    assert inside[1] == outside[1] == 5.0


def test_numpy_of_a_fake_tensor_raises_instead_of_reading_memory() -> None:
    with fake_mode():
        fake = torch.ones(3)
        with pytest.raises(RuntimeError, match="numpy"):
            fake.numpy()
    with pytest.raises(RuntimeError, match="numpy"):
        np.asarray(fake)


def test_small_tensors_made_from_python_values_keep_their_values_right() -> None:
    with fake_mode():
        parameter = nn.Parameter(torch.tensor(1.0))
        nn.init.constant_(parameter, 0.5)
        counter = torch.tensor(7)
        counter.zero_()
        for tensor in (parameter, counter):
            try:  # torch knows the value of such small constants, or says it does not: never a stale one
                value = tensor.item()
            except Exception:
                continue
            assert value == (0.5 if tensor is parameter else 0)


@pytest.mark.parametrize("on_meta", ["device block", "device argument"])
def test_a_parameter_of_a_python_number_on_the_meta_device_is_cast_through_data_inside_fake_mode(on_meta: str) -> None:
    with fake_mode(), torch.device("meta") if on_meta == "device block" else torch.device("cpu"):
        scale = nn.Parameter(torch.tensor(2.6592, device="meta" if on_meta == "device argument" else None))
        table = torch.tensor([1.0, 2.0], device="meta")
        kept = scale
        scale.data = scale.data.to(torch.bfloat16)
        table.data = table.data.to(torch.float16)

    assert scale is kept
    assert (scale.dtype, scale.device.type, scale.shape) == (torch.bfloat16, "meta", torch.Size([]))
    assert (table.dtype, table.device.type, table.shape) == (torch.float16, "meta", torch.Size([2]))


def test_saving_a_fake_state_dict_is_refused_naming_the_tensor_and_shapes_only_are_saved_inside_skip_data() -> None:
    import pickle

    with fake_mode():
        layer = nn.Linear(2, 3)
        layer.register_buffer("table", torch.arange(4.0))

    for saved, named in ((layer.state_dict(), r"a fake tensor of shape \(3, 2\)"), (layer, "a fake parameter")):
        with pytest.raises(pickle.PicklingError, match=named) as raised:
            torch.save(saved, io.BytesIO())
        message = str(raised.value)
        assert "\nexpected: tensors with values, or torch.save inside torch.serialization.skip_data(" in message
        assert "\ngot: a fake " in message
        assert "build the model outside fake mode" in message
    file = io.BytesIO()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(layer.state_dict(), file)
    file.seek(0)
    loaded = torch.load(file, map_location="meta")
    assert {name: (t.shape, t.device.type) for name, t in loaded.items()} == {
        "weight": ((3, 2), "meta"), "bias": ((3,), "meta"), "table": ((4,), "meta"),
    }  # fmt: skip


def test_saving_a_deferred_state_dict_is_refused_saying_to_materialize_it_first() -> None:
    import pickle

    from modattrs.deferred import deferred_init

    deferred = deferred_init(nn.Linear, 2, 2)

    with pytest.raises(pickle.PicklingError, match=r"(?s)a fake tensor of shape \(2, 2\).*materialize_module"):
        torch.save(deferred.state_dict(), io.BytesIO())


def test_layers_that_deep_copy_submodules_end_in_one_fake_mode() -> None:
    with fake_mode(fake_cuda=True) as mode, torch.device("cuda"):
        model = nn.Transformer(
            d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True
        )
    assert {id(p.fake_mode) for p in model.parameters()} == {id(mode)}  # type: ignore[attr-defined]
    with fake_mode():
        copied = copy.deepcopy(nn.Linear(2, 2))
        out = copied(torch.ones(1, 2))
    assert is_fake(out)


# --- is_fake and meta_like ----------------------------------------------------------------------------------------


def test_is_fake_is_true_only_for_fake_tensors() -> None:
    with fake_mode():
        fake = torch.ones(2)
    assert is_fake(fake)
    assert not is_fake(torch.ones(2))
    assert not is_fake(torch.ones(2, device="meta"))


def test_meta_like_gives_a_meta_tensor_with_the_same_shape_dtype_and_strides() -> None:
    with fake_mode(fake_cuda=True):
        fake = torch.empty(3, 4, dtype=torch.float16, device="cuda").t()
    meta = meta_like(fake)
    assert meta.device == torch.device("meta")
    assert (meta.shape, meta.dtype, meta.stride()) == (fake.shape, fake.dtype, fake.stride())


@pytest.mark.parametrize("tensor", [torch.ones(2), torch.ones(2, device="meta")], ids=["real", "meta"])
def test_meta_like_raises_error_if_tensor_is_not_fake(tensor: Tensor) -> None:
    with pytest.raises(ValueError, match="meta_like expects a fake tensor"):
        meta_like(tensor)


# --- fake_copy ----------------------------------------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.rotary = Rotary(4)


def test_fake_copy_is_a_fake_twin_that_copies_no_data() -> None:
    model = Tied()
    twin = fake_copy(model)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert is_fake(q), name
        assert isinstance(q, nn.Parameter), name
        assert (q.shape, q.dtype, q.device, q.requires_grad) == (p.shape, p.dtype, p.device, p.requires_grad), name
    assert twin.head.weight is twin.embed.weight
    assert all(not is_fake(p) for p in model.parameters())


def test_fake_copy_keeps_modattrs_attributes_working_on_the_twin() -> None:
    model = Tied()
    twin = fake_copy(model, device="cuda:1") if torch.cuda.is_available() else fake_copy(model, device="cpu")
    assert twin.rotary.inv_freq.owner is twin.rotary
    assert is_fake(twin.rotary.inv_freq.value)
    assert is_fake(twin.rotary.cache.value)  # type: ignore[arg-type]


def test_fake_copy_on_a_spoofed_device() -> None:
    twin = fake_copy(Tied(), device="cuda")
    assert {p.device for p in twin.parameters()} == {torch.device("cuda:0")}
    assert twin.rotary.inv_freq.value.device == torch.device("cuda:0")


@pytest.mark.parametrize(("device", "error"), [(True, TypeError), ("gpu", ValueError)])
def test_fake_copy_to_something_that_is_not_a_device_names_the_call(device: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"^fake_copy: (device must be|invalid device)"):
        fake_copy(Tied(), device=device)  # type: ignore[arg-type]


def test_fake_copy_of_a_meta_model_needs_a_device() -> None:
    with torch.device("meta"):
        model = Tied()
    with pytest.raises(ValueError, match="on the meta device; pass device="):
        fake_copy(model)
    twin = fake_copy(model, device="cuda:1")
    assert {p.device for p in twin.parameters()} == {torch.device("cuda:1")}
    assert twin.rotary.inv_freq.value.device == torch.device("cuda:1")


def test_fake_copy_fakes_plain_tensor_attributes_and_keeps_parameter_attributes() -> None:
    model = nn.Linear(4, 4)
    model.mask = torch.ones(1000, 1000)
    model.weight.no_decay = True  # type: ignore[attr-defined]
    twin = fake_copy(model)
    assert is_fake(twin.mask)
    assert twin.weight.no_decay  # type: ignore[attr-defined]
    assert twin.to("cuda:1").weight.device == torch.device("cuda:1")  # a CPU twin moves to a spoofed device


def test_fake_copy_fakes_tensors_inside_containers_on_the_twin_device_keeping_ties() -> None:
    model = nn.Linear(4, 4)
    model.masks = [torch.ones(1000, 1000), {"causal": torch.zeros(8), "step": 3}]
    model.pair = (model.weight, "label")  # the parameter itself, held in a tuple
    twin = fake_copy(model, device="cuda")
    mask, table = twin.masks
    assert is_fake(mask)
    assert (mask.device, mask.shape) == (torch.device("cuda:0"), (1000, 1000))
    assert is_fake(table["causal"])
    assert (table["causal"].device, table["step"]) == (torch.device("cuda:0"), 3)
    assert twin.pair[0] is twin.weight
    assert twin.pair[1] == "label"
    assert not is_fake(model.masks[0])
    assert bool(model.masks[0].all())  # the original is untouched


def test_fake_copy_of_a_fake_module_puts_its_parameters_on_the_device_asked_for() -> None:
    with fake_mode() as mode:
        model = nn.Linear(2, 2)
    model.weight.no_decay = True  # type: ignore[attr-defined]
    twin = fake_copy(model, device="cuda:1")
    assert twin.weight.device == torch.device("cuda:1")
    assert twin.weight.fake_mode is not mode  # type: ignore[attr-defined]
    assert twin.weight.no_decay  # type: ignore[attr-defined]


def test_fake_copy_inside_fake_mode_uses_that_mode() -> None:
    with fake_mode() as mode:
        twin = fake_copy(nn.Linear(2, 2))
    assert twin.weight.fake_mode is mode  # type: ignore[attr-defined]


# --- moving fake modules -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["inside", "outside", "in-another-mode"])
def test_fake_modules_with_parameters_move(where: str) -> None:
    with fake_mode(fake_cuda=True) as mode:
        model = Rotary()
    with mode if where == "inside" else fake_mode() if where == "in-another-mode" else torch.device("cpu"):
        model.to(torch.bfloat16)
        assert model.proj.weight.dtype == torch.bfloat16
        model.to("cuda:1")
        assert model.proj.weight.device == torch.device("cuda:1")
        model.half()
    assert isinstance(model.proj.weight, nn.Parameter)
    assert is_fake(model.proj.weight)
    assert model.proj.weight.dtype == torch.float16
    assert model.inv_freq.value.dtype == torch.float16
    assert model.inv_freq.value.device == torch.device("cuda:1")


class LogitScale(nn.Module):
    """CLIP's logit_scale: a parameter made from a Python number (about 20 transformers models have one)."""

    def __init__(self) -> None:
        super().__init__()
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.proj = nn.Linear(2, 2)


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_a_fake_module_with_a_scalar_parameter_can_be_cast_to_half_and_moved(where: str) -> None:
    with fake_mode(fake_cuda=True) as mode:
        model = LogitScale()
    with mode if where == "inside" else torch.device("cpu"):
        model.half()
        model.to("cuda:1")
        model.to(torch.bfloat16)
    scale = model.logit_scale
    assert isinstance(scale, nn.Parameter)
    assert is_fake(scale)
    assert (scale.shape, scale.dtype, scale.device) == ((), torch.bfloat16, torch.device("cuda:1"))


def test_a_constant_written_through_a_parameter_made_from_it_is_never_read_stale() -> None:
    with fake_mode():
        value = torch.tensor(1.0)  # torch keeps the value of tensors of one element as a constant
        view = value.view(1)
        parameter = nn.Parameter(value)  # the same storage: writing one writes the others
        with torch.no_grad():
            parameter.fill_(3.0)
        for tensor in (value, view, parameter):
            try:  # torch may know the value, or say it does not: never the value from before the write
                read = tensor.item()
            except Exception:
                continue
            assert read == 3.0


# --- modattrs attributes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [lambda t: t, nn.Parameter], ids=["buffer", "parameter"])
def test_reconstraining_a_real_module_inside_fake_mode_makes_its_tensor_fake_on_its_device(
    kind: Callable[[Tensor], Tensor],
) -> None:
    m = nn.Module()
    ShapedTensor(m, "cache", kind(torch.arange(6.0).reshape(3, 2)), {1: 2})
    before = m._cache_data
    before.flag = "kept"  # type: ignore[union-attr]
    with fake_mode():
        m.cache.reconstrain(0, 4)
    after = m.cache.value
    assert is_fake(after)
    assert (after.shape, after.device) == ((4, 2), torch.device("cpu"))  # a real parameter's .data = fake went to meta
    assert isinstance(after, nn.Parameter) is isinstance(before, nn.Parameter)
    if isinstance(before, nn.Parameter):
        assert after.flag == "kept"  # type: ignore[attr-defined]  # a parameter's Python attributes go with it
    assert torch.equal(before, torch.arange(6.0).reshape(3, 2))  # the real tensor itself is untouched


@pytest.mark.parametrize("device", DEVICES)
def test_virtual_values_stay_fake_on_the_reference_device_inside_and_after_the_mode(device: str) -> None:
    with fake_mode(fake_cuda=True):
        with torch.device(device):
            model = Rotary()
        inside = model.inv_freq.value
    after = model.inv_freq.value
    for value in (inside, after):
        assert is_fake(value)  # on fake cpu too, where a bare factory call would be real
        assert value.device == model.proj.weight.device
        assert value.shape == (4,)


def test_shaped_tensors_reconstrain_fake_data_without_allocating() -> None:
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = Rotary()
        model.cache.reconstrain(0, 1 << 20)  # 32 GiB of float32 if it were real
    model.cache.reconstrain(0, 1 << 21)  # and after the mode
    assert is_fake(model.cache.value)  # type: ignore[arg-type]
    assert model.cache.value.shape == (1 << 21, 8)  # type: ignore[union-attr]


def test_a_fake_module_forward_and_strict_export_read_virtual_values() -> None:
    with fake_mode() as mode:
        model = Rotary()
        x = torch.randn(2, 8)
    program = torch.export.export(model, (x,), strict=True)
    assert "aten.arange.start_step" in {str(n.target) for n in program.graph.nodes}
    with mode:
        assert is_fake(model(x))


def test_compiled_forward_of_a_real_module_is_unaffected_by_fake_mode_support() -> None:
    torch._dynamo.reset()
    model = Rotary()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randn(2, 8)
    torch.testing.assert_close(compiled(x), model(x))


# --- meta device ----------------------------------------------------------------------------------------------------


def test_a_saved_module_loads_on_the_meta_device_and_becomes_fake_on_a_spoofed_device() -> None:
    buffer = io.BytesIO()
    torch.save(Rotary(), buffer)
    buffer.seek(0)
    meta = torch.load(buffer, map_location="meta", weights_only=False)
    assert meta.proj.weight.is_meta
    assert meta.inv_freq.value.is_meta
    assert meta.cache.value.is_meta
    twin = fake_copy(meta, device="cuda")
    assert twin.inv_freq.value.device == torch.device("cuda:0")
    assert is_fake(twin.cache.value)


# --- spoofed cuda: forward and backward ----------------------------------------------------------------------------


def test_forward_and_backward_on_spoofed_cuda_give_fake_gradients() -> None:
    result = run_python(
        """
        import torch
        from torch import nn
        from modattrs.fake import fake_mode, is_fake

        with fake_mode(fake_cuda=True), torch.device("cuda"):
            embed, linear, norm = nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8)
            attention = nn.MultiheadAttention(8, 2, batch_first=True)
            tokens = torch.randint(0, 10, (2, 5))
            hidden = norm(linear(embed(tokens)))
            attended, _ = attention(hidden, hidden, hidden)
            loss = attended[:, -1].sum() + hidden[0, 1:3].mean()
            loss.backward()
            grads = torch.autograd.grad(linear(hidden).sum(), [linear.weight])
        loss = linear(hidden).sum()  # after the block, too
        modules = (embed, linear, norm, attention)
        for module in modules:
            for name, p in module.named_parameters():
                assert is_fake(p.grad), name
                assert (p.grad.shape, p.grad.device, p.grad.dtype) == (p.shape, p.device, p.dtype), name
        assert is_fake(grads[0]) and grads[0].shape == linear.weight.shape
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"


def test_spoofed_backward_edge_cases() -> None:
    result = run_python(
        """
        import torch
        from torch.utils.checkpoint import checkpoint
        from modattrs.fake import fake_mode, is_fake

        with fake_mode(fake_cuda=True), torch.device("cuda"):
            linear = torch.nn.Linear(4, 4)
            leaf = torch.nn.Parameter(torch.ones(()))
            loss = linear(torch.ones(2, 4)).sum()
            torch.autograd.backward([leaf, loss])  # a leaf among the outputs
            print(is_fake(leaf.grad), is_fake(linear.weight.grad))
            unused = torch.nn.Parameter(torch.ones(3))
            grads = torch.autograd.grad(linear(torch.ones(1, 4)).sum(), [linear.bias, unused], materialize_grads=True)
            print([tuple(g.shape) for g in grads])
            try:
                torch.autograd.grad(linear(torch.ones(1, 4)).sum(), [linear.bias], create_graph=True)
            except NotImplementedError as error:
                print("create_graph:", str(error)[:40])
            on_cpu = linear(torch.ones(1, 4)).sum().cpu()
            linear.weight.grad = None
            on_cpu.backward()
            print(is_fake(linear.weight.grad), linear.weight.grad.device)
            hidden = torch.ones(1, 4, requires_grad=True)
            try:
                checkpoint(linear, hidden, use_reentrant=True).sum().backward()
            except RuntimeError as error:
                print("reentrant:", "use_reentrant=False" in str(error))
            linear.weight.grad = None
            checkpoint(linear, hidden, use_reentrant=False).sum().backward()
            print(is_fake(linear.weight.grad))
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "True True",
        "[(4,), (3,)]",
        "create_graph: create_graph=True: gradients of gradient",
        "True cuda:0",
        "reentrant: True",
        "True",
    ]


def test_backward_of_fake_cpu_graphs_after_spoofed_cuda_is_torchs_own_and_a_cuda_middle_is_simulated() -> None:
    result = run_python(
        """
        import torch
        from torch.utils.checkpoint import checkpoint
        from modattrs.fake import fake_mode, is_fake

        with fake_mode(fake_cuda=True):
            pass  # spoofed CUDA set up in the process
        with fake_mode():
            linear = torch.nn.Linear(4, 4)
            checkpoint(linear, torch.ones(2, 4, requires_grad=True), use_reentrant=True).sum().backward()
            print(is_fake(linear.weight.grad))
        with fake_mode(fake_cuda=True):
            x = torch.ones(2, 4, requires_grad=True)
            (x.cuda() * 2).cpu().sum().backward()
            print(is_fake(x.grad), x.grad.device)
        """
    )
    assert result.stdout.split() == ["True", "True", "cpu"], result.stderr


def test_backward_checks_what_torch_checks() -> None:
    result = run_python(
        """
        import torch
        from modattrs.fake import fake_mode

        with fake_mode(fake_cuda=True), torch.device("cuda"):
            weight = torch.nn.Parameter(torch.ones(3))
            for action in (lambda: (weight * 2).backward(), lambda: torch.ones(3).sum().backward()):
                try:
                    action()
                except RuntimeError as error:
                    print(str(error).split(" and ")[0])
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "grad can be implicitly created only for scalar outputs",
        "element 0 of tensors does not require grad",
    ]


def test_without_a_compiler_fake_cuda_says_what_to_do_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    def no_compiler(*, replace: bool) -> None:
        raise FileNotFoundError("[Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(_cuda_guard, "_ready", False)
    monkeypatch.setattr(_cuda_guard, "_failure", None)
    monkeypatch.setattr(_cuda_guard, "cuda_built", lambda: False)
    monkeypatch.setattr(_cuda_guard, "_build_and_register", no_compiler)
    with (
        pytest.raises(
            RuntimeError,
            match=r"^fake CUDA needs a device guard that this CPU-only build of torch lacks, and compiling one at "
            r"first use failed\.\n"
            r"reason: FileNotFoundError: .*No such file or directory: 'c\+\+'\n(?s:.*)meta device.*fake_copy",
        ),
        fake_mode(fake_cuda=True),
    ):
        pass
    with pytest.raises(RuntimeError, match="Install a C"):  # the failure is remembered, not retried
        fake_copy(nn.Linear(2, 2), device="cuda")


def test_on_a_cuda_build_whose_guard_needs_the_driver_without_a_compiler_fake_cuda_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    def no_compiler(*, replace: bool) -> None:
        assert replace  # the build's own guard is taken out
        raise FileNotFoundError("[Errno 2] No such file or directory: 'c++'")

    monkeypatch.setattr(_cuda_guard, "_ready", False)
    monkeypatch.setattr(_cuda_guard, "_failure", None)
    monkeypatch.setattr(_cuda_guard, "cuda_built", lambda: True)
    monkeypatch.setattr(_cuda_guard, "gpu_present", lambda: False)
    monkeypatch.setattr(_cuda_guard, "_initialize_bindings_without_a_driver", lambda: None)
    monkeypatch.setattr(_cuda_guard, "_guard_switches_devices", lambda: False)
    monkeypatch.setattr(_cuda_guard, "_build_and_register", no_compiler)
    with (
        pytest.raises(
            RuntimeError,
            match=r"^fake CUDA could not be set up on this CUDA build of torch without a GPU\.\n"
            r"reason: FileNotFoundError: .*'c\+\+'\n(?s:.*)\nInstall a C\+\+ compiler \(g\+\+\) and ninja"
            r"(?s:.*)meta device.*fake_copy",
        ),
        fake_mode(fake_cuda=True),
    ):
        pass


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build compiles no guard where its own can switch")
def test_a_guard_build_killed_midway_does_not_make_the_next_process_wait_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modattrs._fake import cuda_guard as _cuda_guard

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = _cuda_guard.build_directory()
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what torch's loader leaves when its builder is killed mid-build
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import torch\n"
            "from modattrs.fake import fake_mode\n"
            "with fake_mode(fake_cuda=True):\n"
            "    print(torch.ones(2, device='cuda').device)\n",
        ],
        capture_output=True,
        text=True,
        timeout=240,  # before the fix: waited on the file for ever
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "cuda:0"
    assert any(directory.glob("*.so"))  # built where the file was left


def test_a_process_that_never_uses_fake_cuda_has_no_fake_guard() -> None:
    result = run_python(
        """
        import torch, modattrs, modattrs.fake
        try:
            torch.empty(1, device="cuda")
        except (RuntimeError, AssertionError) as error:
            print(type(error).__name__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() in {"AssertionError", "RuntimeError"}


# --- models too big for this machine --------------------------------------------------------------------------------

MEMORY_CHECK = """
    import resource, time, torch, transformers
    from transformers import {config}, {model}
    from modattrs.fake import fake_mode, is_fake

    config = {config}({arguments})
    def peak_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    with fake_mode(fake_cuda=True), torch.device("cuda"):
        torch.ones(1)  # warm the fake machinery up
    before = peak_mb()
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = {model}(config)
    grown = peak_mb() - before
    parameters = sum(p.numel() for p in model.parameters())
    assert all(is_fake(p) and p.device == torch.device("cuda:0") for p in model.parameters())
    print(parameters, round(grown, 1))
"""


@pytest.mark.parametrize(
    ("config", "model", "arguments", "expected"),
    [
        (
            "LlamaConfig",
            "LlamaForCausalLM",
            "hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, "
            "num_key_value_heads=32, vocab_size=32000",
            6_738_415_616,
        ),
        ("BlenderbotConfig", "BlenderbotModel", "", None),
    ],
    ids=["llama-2-7b", "blenderbot"],
)
def test_models_too_big_for_this_machine_build_fake_on_spoofed_cuda(
    config: str, model: str, arguments: str, expected: int | None
) -> None:
    pytest.importorskip("transformers")
    result = run_python(MEMORY_CHECK.format(config=config, model=model, arguments=arguments))
    assert result.returncode == 0, result.stderr[-3000:]
    parameters, grown = result.stdout.split()
    if expected is not None:
        assert int(parameters) == expected
    assert float(grown) <= 50.0


def test_a_fake_value_under_another_dispatch_mode_is_still_fake() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    with fake_mode():
        model = Rotary()
    with FlopCounterMode(display=False):
        value = model.inv_freq.value
    assert is_fake(value)


TO_ARGUMENTS: dict[str, dict[str, object]] = {
    "dtype": {"dtype": torch.float16},
    "device and dtype": {"device": "cuda", "dtype": torch.float64},
    "device": {"device": "cuda:1"},
    "channels last": {"memory_format": torch.channels_last},
    "contiguous format": {"dtype": torch.float64, "memory_format": torch.contiguous_format},
    "copy": {"dtype": torch.float32, "copy": True},
    "int": {"dtype": torch.int64},
}
SOURCES: dict[str, Callable[[], Tensor]] = {
    "contiguous": lambda: torch.empty(2, 3, 4, 5),
    "transposed": lambda: torch.empty(2, 3, 4, 5).transpose(1, 3),
    "requiring grad": lambda: torch.empty(2, 3, 4, 5, requires_grad=True),
    "constant": lambda: torch.arange(120.0).reshape(2, 3, 4, 5),
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("call", TO_ARGUMENTS)
def test_a_fake_moved_or_cast_with_to_has_the_shape_strides_dtype_grad_and_device_that_torch_gives(
    source: str, call: str
) -> None:
    arguments = TO_ARGUMENTS[call]
    with torch.device("meta"):
        expected = SOURCES[source]().to(**{k: v for k, v in arguments.items() if k != "device"})  # type: ignore[call-overload]
    with fake_mode(fake_cuda=True):
        got = SOURCES[source]().to(**arguments)  # type: ignore[call-overload]
        if source == "constant":  # the values are kept
            assert got.sum().item() == sum(range(120))
    assert is_fake(got)
    assert (got.shape, got.stride(), got.dtype, got.requires_grad) == (
        expected.shape,
        expected.stride(),
        expected.dtype,
        expected.requires_grad,
    )
    asked = torch.device(str(arguments.get("device", "cpu")))
    assert got.device == (torch.device("cuda", 0) if str(asked) == "cuda" else asked)


def describe_detached(make: Callable[[], Tensor]) -> tuple[object, ...]:
    """What a detach of a view of a leaf that requires grad gives, and what a write through it does."""
    source = make()
    detached = source.detach()
    before = source._version
    detached.zero_()
    return (
        detached.shape, detached.stride(), detached.storage_offset(), detached.dtype, detached.requires_grad,
        detached.is_leaf, detached.grad_fn, source.requires_grad, source._version - before, detached._version - before,
        address_of(detached.untyped_storage()) == address_of(source.untyped_storage()),
    )  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
def test_a_detached_fake_views_its_storage_shares_its_version_and_tracks_no_grad_as_a_real_one_does(
    device: str,
) -> None:
    def make() -> Tensor:
        return torch.empty(5, 6, requires_grad=True)[1:, 2:]

    eager = describe_detached(make)
    with fake_mode(fake_cuda=device != "cpu"), torch.device(device):
        faked = describe_detached(make)
        parameter = nn.Parameter(torch.empty(2, 3))

    assert faked == eager
    assert is_fake(parameter)
    assert (parameter.requires_grad, parameter.is_leaf, parameter.device.type) == (True, True, device[:4])


def _transposed() -> Tensor:
    return torch.randn(4, 3).t()


# Operations writing into an empty out= tensor, which they resize: eager code gives it the strides of the result.
RESIZED_OUTS: dict[str, Callable[[], object]] = {
    "add, transposed": lambda: torch.add(_transposed(), 1, out=torch.empty(0)),
    "mul, channels_last": lambda: torch.mul(
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), 2, out=torch.empty(0)
    ),
    "add, broadcast to a transposed input": lambda: torch.add(_transposed(), torch.randn(3, 1), out=torch.empty(0)),
    "add, broadcast row": lambda: torch.add(torch.randn(4), _transposed(), out=torch.empty(0)),
    "exp, transposed": lambda: torch.exp(_transposed(), out=torch.empty(0)),
    "where, transposed": lambda: torch.where(_transposed() > 0, _transposed(), torch.zeros(3, 1), out=torch.empty(0)),
    "sum over a dim, transposed": lambda: torch.sum(torch.randn(2, 4, 3).transpose(0, 2), 1, out=torch.empty(0)),
    "max over a dim, two outs": lambda: torch.max(
        torch.randn(5, 4, 3).permute(2, 0, 1), 1, out=(torch.empty(0), torch.empty(0, dtype=torch.long))
    ),
    "mm, transposed": lambda: torch.mm(_transposed(), torch.randn(4, 2), out=torch.empty(0)),
    "cat, channels_last": lambda: torch.cat(
        [torch.randn(1, 3, 2, 2).to(memory_format=torch.channels_last)] * 2, out=torch.empty(0)
    ),
}


def _strides(result: object) -> list[tuple[int, ...]]:
    results = result if isinstance(result, tuple) else (result,)
    return [tensor.stride() for tensor in results if isinstance(tensor, Tensor)]


@pytest.mark.parametrize("operation", RESIZED_OUTS.values(), ids=RESIZED_OUTS.keys())
def test_an_out_tensor_that_an_operation_resizes_gets_the_strides_eager_code_gives_it(
    operation: Callable[[], object],
) -> None:
    eager = _strides(operation())
    with fake_mode():
        fake = _strides(operation())
    assert fake == eager


# --- operations on fake tensors outside their mode ------------------------------------------------------------------

# What FSDP2 and DTensor do to a parameter they cut, and other views and fresh tensors: each taken, inside the mode
# and out of it, from a (6, 4) parameter and a (6, 4) tensor of other values to copy.
CUTS: dict[str, Callable[[Tensor, Tensor], Tensor | tuple[Tensor, ...]]] = {
    "chunk": lambda t, _: torch.chunk(t, 4),
    "split sizes": lambda t, _: t.split([1, 5], dim=0),
    "unbind": lambda t, _: t.unbind(1),
    "narrow": lambda t, _: t.narrow(0, 2, 3),
    "view": lambda t, _: t.view(2, 12),
    "view as dtype": lambda t, _: t.view(torch.int32),
    "transposed": lambda t, _: t.t(),
    "expanded": lambda t, _: t[:1].expand(3, 4),
    "as_strided": lambda t, _: t.as_strided((2, 2), (1, 4), 3),
    "detached": lambda t, _: t.detach(),
    "clone of a transpose": lambda t, _: t.t().clone(),
    "new_zeros": lambda t, _: t.new_zeros((8, 4)),
    "new_full of another dtype": lambda t, _: t.new_full((2,), 3.5, dtype=torch.float64),
    "new_empty": lambda t, _: t.new_empty((3, 3)),
    "new_ones of a transpose, as integers": lambda t, _: t.t().new_ones([4, 2], dtype=torch.int64),
    "padded copy": lambda t, other: t.new_zeros((8, 4)).narrow(0, 0, 6).copy_(other),
    "broadcast copy": lambda t, other: t.new_zeros((2, 6, 4)).copy_(other),
}


def described(result: Tensor | tuple[Tensor, ...]) -> list[tuple[object, ...]]:
    tensors = result if isinstance(result, tuple | list) else (result,)
    return [
        (type(t).__name__ == "FakeTensor", t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
        for t in tensors
    ]


@pytest.mark.parametrize("cut", CUTS)
def test_a_fake_tensor_cut_outside_its_mode_is_laid_out_as_inside_it_and_as_a_real_one(cut: str) -> None:
    with fake_mode():
        parameter, other = nn.Parameter(torch.empty(6, 4)), torch.empty(6, 4)
        with torch.no_grad():
            inside = described(CUTS[cut](parameter, other))
    with torch.no_grad():
        outside = described(CUTS[cut](parameter, other))
        real = described(CUTS[cut](nn.Parameter(torch.randn(6, 4)), torch.randn(6, 4)))
    assert outside == inside
    assert [entry[1:] for entry in outside] == [entry[1:] for entry in real]
    assert all(entry[0] for entry in outside)


@pytest.mark.parametrize("cut", CUTS)
def test_a_constant_cut_outside_its_mode_is_laid_out_as_a_real_one_and_keeps_its_values(cut: str) -> None:
    # FSDP2's padded shard of a norm weight is one: a new_zeros of a few elements, then cut and copied into.
    with fake_mode():
        constant, other = torch.arange(24.0).view(6, 4), torch.arange(24.0, 48.0).view(6, 4)
    with torch.no_grad():
        outside = CUTS[cut](constant, other)
        real = CUTS[cut](torch.arange(24.0).view(6, 4), torch.arange(24.0, 48.0).view(6, 4))
    assert described(outside) == [(True, *entry[1:]) for entry in described(real)]
    # new_empty has no values; a detach forgets them (nn.Parameter detaches: a parameter holds none), and so does a
    # view as another dtype outside the mode, which torch's C++ makes through a detach.
    if cut not in ("new_empty", "detached", "view as dtype"):
        fakes = outside if isinstance(outside, tuple | list) else [outside]
        reals = real if isinstance(real, tuple | list) else [real]
        with fake_mode():
            assert [fake.tolist() for fake in fakes] == [tensor.tolist() for tensor in reals]


def test_a_view_of_a_fake_parameter_outside_its_mode_is_a_view_autograd_knows() -> None:
    with fake_mode():
        parameter = nn.Parameter(torch.empty(6, 4))
    chunk = torch.chunk(parameter, 3)[1]
    assert chunk._base is parameter
    assert chunk.requires_grad
    assert chunk.untyped_storage().nbytes() == parameter.untyped_storage().nbytes()


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=3),
    dim=st.integers(-3, 2),
    start=st.one_of(st.none(), st.integers(-8, 8)),
    end=st.one_of(st.none(), st.integers(-8, 9)),
    step=st.integers(1, 3),
    inside=st.booleans(),
)
def test_a_slice_of_a_fake_tensor_is_laid_out_as_torch_lays_out_the_meta_one_and_shares_its_storage(
    sizes: list[int], dim: int, start: int | None, end: int | None, step: int, inside: bool
) -> None:
    assume(-len(sizes) <= dim < len(sizes))
    meta = torch.empty(sizes, device="meta").t() if len(sizes) == 2 else torch.empty(sizes, device="meta")
    expected = torch.ops.aten.slice.Tensor(meta, dim, start, end, step)
    with fake_mode():
        fake = torch.empty(sizes).t() if len(sizes) == 2 else torch.empty(sizes)
        if inside:
            sliced = torch.ops.aten.slice.Tensor(fake, dim, start, end, step)
    if not inside:  # the short path outside the mode
        sliced = torch.ops.aten.slice.Tensor(fake, dim, start, end, step)
    assert (tuple(sliced.shape), sliced.stride(), sliced.storage_offset()) == (
        tuple(expected.shape),
        expected.stride(),
        expected.storage_offset(),
    )
    assert address_of(sliced.untyped_storage()) == address_of(fake.untyped_storage())
    assert sliced.device == fake.device
    assert is_fake(sliced)
    assert sliced is not fake


def test_a_view_of_a_constant_holds_its_values_inside_the_mode_and_out_of_it() -> None:
    with fake_mode():
        weight = torch.empty(6, 4)
        zeros, counted = weight.new_zeros((2, 3)), torch.arange(6.0)
        rows_inside = counted.view(2, 3).unbind(0)
        assert zeros.tolist() == [[0.0] * 3] * 2
    rows_outside = torch.chunk(counted, 2)
    with fake_mode():
        assert [row.tolist() for row in rows_inside] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert [row.tolist() for row in rows_outside] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert weight.new_zeros((2,)).tolist() == [0.0, 0.0]


def test_a_copy_between_constants_writes_their_values_inside_the_mode_and_out_of_it() -> None:
    with fake_mode():
        inside = torch.zeros(3).copy_(torch.arange(3.0))
        target, source = torch.zeros(3), torch.arange(3.0)
    target.copy_(source)
    with fake_mode():
        assert inside.tolist() == [0.0, 1.0, 2.0]
        assert target.tolist() == [0.0, 1.0, 2.0]
