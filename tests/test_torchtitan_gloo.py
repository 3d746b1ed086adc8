"""torchtitan's Llama3 on 4 real gloo ranks: deferred, parallelized by its ``parallelize_llama``, materialized and
trained one step, against the same flow on the model built and initialized eagerly (tests/torchtitan_workers.py).

Both flows run in each rank, on the same tokens: the losses and the local shards after the optimizer step must be
bit-identical (the reduced gradients come from gloo's reductions of identical inputs in the same order), and the
default generator must end where eager construction leaves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

try:
    from tests import torchtitan_models  # noqa: F401  (the workers import it: skip where it cannot be)
except ImportError as error:
    pytest.skip(
        f"torchtitan's model code does not import on torch {torch.__version__}: {error}", allow_module_level=True
    )

from tests.support import ranks

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "torchtitan_workers.py"
WORLD, TIMEOUT = 4, 240


def run_ranks(layout: str, output: Path) -> list[dict[str, Any]]:
    return ranks.run_ranks(WORKER, [layout], output, WORLD, TIMEOUT)


def test_a_training_step_of_torchtitans_llama3_on_deferred_weights_is_the_eager_step_bit_for_bit(
    tmp_path: Path,
) -> None:
    """FSDP 2 x TP 2 on 4 gloo ranks: torchtitan's own 2-D layout, its weights scattered from rank 0."""
    for rank, result in enumerate(run_ranks("tp=2", tmp_path)):
        eager_loss, deferred_loss = result["losses"]
        assert torch.isfinite(eager_loss)
        assert torch.equal(deferred_loss, eager_loss), f"rank {rank}: the loss differs"
        eager_state, deferred_state = result["states"]
        assert torch.equal(deferred_state, eager_state), f"rank {rank}: the generator ends elsewhere"
        eager_shards, deferred_shards = result["shards"]
        assert eager_shards.keys() == deferred_shards.keys()
        for name, shard in deferred_shards.items():
            assert torch.equal(shard, eager_shards[name]), f"rank {rank}: {name} after the step differs"


def test_torchtitans_models_on_fsdp2_gloo_ranks_have_every_local_byte_written_by_init_weights_under_the_ledger(
    tmp_path: Path,
) -> None:
    """Meta build, torchtitan's parallelize (FSDP2 over 2 gloo ranks), to_empty, init_weights, under the write
    ledger: every tensor of each rank written; without init_weights, every tensor flagged, the embedding by the
    bytes of the rank's own shard."""
    for rank, flows in enumerate(ranks.run_ranks(WORKER, ["ledger"], tmp_path, 2, TIMEOUT)):
        for model in ("llama3", "deepseek_v3"):
            initialized = flows[f"{model}, initialized"]
            assert initialized["problems"] == [], (rank, model, initialized["problems"])
            assert set(initialized["statuses"].values()) <= {"initialized", "computed"}, (rank, model)
            skipped = flows[f"{model}, not initialized"]
            assert skipped["problems"] == skipped["tensors"], (rank, model)
            assert skipped["embedding unwritten"] == ((0, skipped["embedding bytes"]),), (rank, model)
