"""Real model libraries as shipped: timm architectures of every family (and transformers' models using the same
idioms) read construction-time constants while building (stochastic-depth rates from ``linspace(...).tolist()``,
RegNet's widths from ``unique``), and build in fake mode on spoofed CUDA, under deferred_init bit-identically to
eager construction, and through ``python -m modattrs inspect``.

timm imports torchvision, whose PyPI wheels need the import hook tox installs (tests/support); run these tests
outside tox with ``python tests/support/install_torchvision_hook.py`` run once in the environment.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

from modattrs._cli.commands import main
from modattrs.deferred import deferred_init, is_deferred, materialize_module
from modattrs.fake import fake_mode, is_fake

try:
    import timm
except ImportError as error:  # only when not installed: a torchvision that fails to load fails these tests
    pytest.skip(f"timm is not importable ({error}); pip install -r requirements/test.txt", allow_module_level=True)

#: One or two architectures of each family, as shipped (their default configurations), small variants to stay quick.
ARCHITECTURES: list[str] = [
    "vit_tiny_patch16_224",
    "deit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "swinv2_cr_tiny_224",
    "convnext_atto",
    "regnetx_002",
    "beit_base_patch16_224",
    "eva02_tiny_patch14_224",
    "maxvit_pico_rw_256",
    "poolformer_s12",
    "pvt_v2_b0",
    "mobilevit_xxs",
    "hiera_tiny_224",
    "nest_tiny",
    "mambaout_femto",
    "tiny_vit_5m_224",
    "crossvit_tiny_240",
    "fastvit_t8",
    "efficientnet_b1_pruned",  # deep-copies blocks whose BatchNorm buffers are constants
    "resnet18",  # controls: no constants read
    "efficientnet_b0",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def timm_model(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model: nn.Module = timm.create_model(name, num_classes=10)
        return model

    return build


def assert_defers_bit_identically(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    eager = build()
    eager_generator = torch.default_generator.get_state()
    torch.manual_seed(0)
    deferred = deferred_init(build)
    assert all(is_deferred(t) for t in deferred.state_dict().values() if t.is_floating_point())
    materialize_module(deferred)

    expected, got = eager.state_dict(), deferred.state_dict()
    assert list(got) == list(expected)
    assert [name for name in expected if not torch.equal(expected[name], got[name])] == []
    assert torch.equal(torch.default_generator.get_state(), eager_generator)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_timm_architectures_build_in_fake_mode_on_spoofed_cuda(name: str) -> None:
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = timm_model(name)()

    tensors = list(model.state_dict().values())
    assert all(is_fake(t) for t in tensors)
    assert {t.device for t in tensors} == {torch.device("cuda", 0)}


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_timm_architectures_materialize_bit_identically_to_eager_construction_generator_included(
    name: str,
) -> None:
    assert_defers_bit_identically(timm_model(name))


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_timm_architectures_go_through_modattrs_inspect(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    arguments = [f"model_name={name!r}", "num_classes=10"]
    assert main(["inspect", "timm:create_model", *arguments, "--device", "cuda", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)

    with torch.device("meta"):
        expected = sum(p.numel() for p in timm_model(name)().parameters())
    assert report["total_parameters"] == expected


def transformers_models() -> dict[str, Callable[[], nn.Module]]:
    import transformers as t

    return {
        "ConvNextModel": lambda: t.ConvNextModel(
            t.ConvNextConfig(depths=[1, 1, 2, 1], hidden_sizes=[8, 16, 32, 64], drop_path_rate=0.1)
        ),
        "HieraModel": lambda: t.HieraModel(
            t.HieraConfig(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], drop_path_rate=0.1)
        ),
        "PvtV2Model": lambda: t.PvtV2Model(
            t.PvtV2Config(
                depths=[1, 1, 1, 1], hidden_sizes=[8, 16, 32, 64], num_attention_heads=[1, 1, 2, 2], drop_path_rate=0.1
            )
        ),
    }


TRANSFORMERS = ["ConvNextModel", "HieraModel", "PvtV2Model"]


@pytest.mark.parametrize("name", TRANSFORMERS)
def test_transformers_models_reading_drop_path_rates_build_fake_and_defer_bit_identically(name: str) -> None:
    build = transformers_models()[name]
    with fake_mode(fake_cuda=True), torch.device("cuda"):
        model = build()
    assert {t.device for t in model.state_dict().values()} == {torch.device("cuda", 0)}

    assert_defers_bit_identically(build)


@pytest.mark.parametrize("name", ["vit_tiny_patch16_224", "convnext_atto"])
def test_a_timm_head_reset_before_materializing_is_the_eager_models(name: str) -> None:
    torch.manual_seed(0)
    eager = timm_model(name)()
    eager.reset_classifier(5)
    after_eager = torch.default_generator.get_state()
    torch.manual_seed(0)
    deferred = deferred_init(timm_model(name))
    deferred.reset_classifier(5)  # draws a new head for real, from where eager construction left the generator
    materialize_module(deferred)

    expected, got = eager.state_dict(), deferred.state_dict()
    assert [key for key in expected if not torch.equal(expected[key], got[key])] == []
    assert torch.equal(torch.default_generator.get_state(), after_eager)
