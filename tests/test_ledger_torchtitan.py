"""torchtitan's Llama3 and DeepSeek-V3 under the write ledger: built on the meta device, ``to_empty``, and initialized
by their own ``init_weights(buffer_device=...)``, on one device and sharded by FSDP2 (through torchtitan's own
``parallelize_*``) on a rank of a fake process group, where the ledger reads each DTensor's local shard."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modattrs.ledger import Report, watch

try:
    from tests import torchtitan_models as titan
except ImportError as error:  # torchtitan not installed, or its model code needs what this torch lacks
    pytest.skip(
        f"torchtitan's model code does not import on torch {torch.__version__}: {error}", allow_module_level=True
    )

CONFIGS: dict[str, Callable[[], Any]] = {
    "llama3": lambda: titan.llama3_config(layers=1, dim=16, heads=2, vocab=256),
    "deepseek_v3": lambda: titan.deepseek_v3_config(ep=False),
}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    return None


def meta_flow(name: str, *, world: int | None = None, initialize: bool = True) -> tuple[nn.Module, Report]:
    """torchtitan trainer's order: build on meta, parallelize (when ``world``), to_empty, init_weights."""
    with watch() as ledger:
        with torch.device("meta"):
            model: nn.Module = CONFIGS[name]().build()
        if world is not None:
            model = titan.parallelize(model, titan.parallel_dims(world))
        model.to_empty(device="cpu")
        if initialize:
            with torch.no_grad():
                model.init_weights(buffer_device=torch.device("cpu"))  # type: ignore[operator]
    return model, ledger.report(model)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchtitan_init_weights_after_to_empty_writes_every_byte_of_every_tensor(name: str) -> None:
    _, report = meta_flow(name)
    report.check()
    assert {entry.status for entry in report if entry.role == "parameter"} == {"initialized"}
    rope = [entry for entry in report if entry.name.endswith("rope.cache")]
    assert rope
    assert {entry.status for entry in rope} == {"computed"}  # from init_weights' buffer_device


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support:UserWarning")
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_torchtitan_init_weights_writes_every_local_shard_of_an_fsdp2_rank(name: str) -> None:
    with titan.fake_rank(8, 3):
        model, report = meta_flow(name, world=8)
    assert any(isinstance(parameter, DTensor) for parameter in model.parameters())
    report.check()
    assert {entry.status for entry in report} <= {"initialized", "computed"}


@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support:UserWarning")
def test_an_fsdp2_rank_that_skips_init_weights_is_flagged_with_the_bytes_of_its_own_shard() -> None:
    with titan.fake_rank(8, 3):
        model, report = meta_flow("llama3", world=8, initialize=False)
        embedding = model.get_parameter("tok_embeddings.weight")
        assert isinstance(embedding, DTensor)
        local = embedding.to_local()
    entry = report["tok_embeddings.weight"]
    assert entry.status == "unwritten"
    assert entry.ranges("unwritten") == ((0, local.numel() * local.element_size()),)
    assert local.numel() == 256 * 16 // 8  # the shard of rank 3, not the whole table
    assert {entry.name for entry in report.problems} == {
        name for name, _ in [*model.named_parameters(), *model.named_buffers()]
    }
