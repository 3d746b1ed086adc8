"""modattrs under torch.distributed: DDP, FSDP2 with meta-device initialization, mixed precision and DCP.

Every scenario runs on 2 real processes (gloo, 127.0.0.1), each bounded by a timeout; a crash or an abort at
teardown fails the test. The workers are in distributed_workers.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import ranks

TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "distributed_workers.py"
TIMEOUT = 90

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")


def run_ranks(scenario: str, output: Path, world_size: int = 2) -> list[dict[str, Any]]:
    """Run one scenario on ``world_size`` processes; return what each rank saved."""
    return ranks.run_ranks(WORKERS, [scenario], output, world_size, TIMEOUT)


def assert_equal_dicts(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast-buffers", "no-broadcast-buffers"])
def test_ddp_trains_and_ranks_agree(broadcast: bool, tmp_path: Path) -> None:
    first, second = run_ranks("ddp-broadcast" if broadcast else "ddp-no-broadcast", tmp_path)
    assert_equal_dicts(first["parameters"], second["parameters"])
    assert_equal_dicts(first["virtual"], second["virtual"])
    assert len(first["virtual"]) == 6  # cos, sin and scale of two blocks


def test_fsdp2_meta_init_gives_virtual_values_equal_to_a_cpu_build(tmp_path: Path) -> None:
    for rank in run_ranks("fsdp-meta-init", tmp_path):
        assert_equal_dicts(rank["virtual"], rank["reference_virtual"])  # bit for bit, no re-initialization
        assert_equal_dicts(rank["virtual_after_training"], rank["reference_virtual"])
        # The hand-rolled buffer computed in __init__ comes back as whatever memory to_empty handed out.
        assert not torch.equal(rank["plain"], rank["reference_plain"])


def test_fsdp2_with_deferred_init_starts_from_the_eager_weights_one_block_at_a_time(tmp_path: Path) -> None:
    first, second = run_ranks("fsdp-deferred", tmp_path)
    for rank in (first, second):
        assert_equal_dicts(rank["initial"], rank["reference"])  # sharded init == unsharded eager init, same seed
        assert_equal_dicts(rank["buffers"], rank["reference_buffers"])  # the __init__-computed buffer too
        assert rank["generator_equal"]
    assert_equal_dicts(first["trained"], second["trained"])


def eager_shards(kind: str, world_size: int, rank: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """This rank's part of each parameter of the model built eagerly in this process with seed 0 (FSDP2 cuts dim 0
    with torch.chunk, and gives ranks past the last chunk none), and the generator state eager construction leaves."""
    from tests.distributed_workers import MODELS

    torch.manual_seed(0)
    eager = MODELS[kind]()
    generator = torch.get_rng_state()
    shards = {}
    for name, parameter in eager.named_parameters():
        chunks = torch.chunk(parameter.detach(), world_size, dim=0)
        shards[name] = chunks[rank] if rank < len(chunks) else parameter.detach()[:0]
    return shards, generator


@pytest.mark.parametrize(("kind", "world_size"), [("decoder", 4), ("llama", 2)], ids=["decoder", "llama"])
def test_fsdp2_sharded_deferred_model_materializes_every_rank_shard_as_the_eager_slice_at_every_shard_count(
    kind: str, world_size: int, tmp_path: Path
) -> None:
    # FSDP2 shards over meshes of 1, 2 (and 4) ranks, the rows of a 2-D mesh as HSDP uses, in one start-up of the
    # processes: starting them is most of the time. transformers' Llama redraws every weight in post_init.
    ranks = run_ranks(f"fsdp-after-sharding-{kind}", tmp_path, world_size=world_size)
    for size in (1, 2, 4)[: world_size.bit_length()]:
        for rank, everything in enumerate(ranks):
            saved = everything[size]
            expected, generator = eager_shards(kind, size, rank % size)
            where = f"{kind} sharded over {size}, rank {rank}"
            for way in ("by_block", "whole"):  # block by block after sharding, and one materialize_module call
                assert saved[way].keys() == expected.keys()
                for name, shard in expected.items():
                    assert torch.equal(saved[way][name], shard), f"{where}, {way}: {name}"
                assert torch.equal(saved[f"generator_{way}"], generator), f"{where}, {way}: generator"
            assert saved["fsdp_storage_shared"], where
            assert all(saved["fsdp_storage_shared"].values()), f"{where}: {saved['fsdp_storage_shared']}"
            assert not saved["deferred"], where
            assert saved["trained_finite"], where


def test_tensor_parallel_deferred_model_materializes_each_rank_slice_whether_or_not_rank_0s_values_are_sent(
    tmp_path: Path,
) -> None:
    from tests.distributed_workers import feed_forward

    torch.manual_seed(0)
    eager = dict(feed_forward().named_parameters())
    generator = torch.get_rng_state()
    for rank, saved in enumerate(run_ranks("tensor-parallel", tmp_path)):
        # Column-wise: weight and bias cut along dim 0 (19 rows each); row-wise: weight along dim 1, bias whole.
        assert saved["placements"] == {
            "0.weight": [("Shard", 0)],
            "0.bias": [("Shard", 0)],
            "2.weight": [("Shard", 1)],
            "2.bias": [("Replicate", None)],
        }
        # src_data_rank=None, then the default (rank 0's values scattered and broadcast): the same slices.
        for shards in ("shards", "scattered_shards"):
            for name, parameter in eager.items():
                ((kind, dim),) = saved["placements"][name]
                expected = parameter.detach() if kind == "Replicate" else torch.chunk(parameter.detach(), 2, dim)[rank]
                assert torch.equal(saved[shards][name], expected), f"rank {rank}, {shards}: {name}"
        assert torch.equal(saved["generator"], generator)
        assert torch.equal(saved["scattered_generator"], generator)
        assert saved["trained_finite"]
        assert not saved["scattered_still_deferred"]


def test_a_deferred_source_that_differs_by_rank_is_refused_on_every_rank_rather_than_replayed_as_each_ones_own(
    tmp_path: Path,
) -> None:
    from tests.distributed_workers import feed_forward

    torch.manual_seed(0)
    eager = dict(feed_forward().named_parameters())
    cut = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # the others replicated
    refused = {  # how the ranks differ -> the tensor named, and what sends it
        "seeded by rank": ("layers.0.weight", "scatter"),
        "the rank in a replicated bias": ("layers.2.bias", "broadcast"),
        "data only rank 0 read": ("layers.0.weight", "scatter"),
        "an extra draw on the last rank": ("layers.0.weight", "scatter"),
    }
    for rank, outcomes in enumerate(run_ranks("rank-dependent-sources", tmp_path)):
        for how, (name, collective) in refused.items():
            message = outcomes[how]
            assert isinstance(message, str), f"rank {rank}, {how}: not refused"
            assert message.startswith(f"{name} cannot be sent from rank 0"), f"rank {rank}, {how}: {message}"
            assert f"DTensor's {collective} sends rank 0's values" in message
            assert "got: ranks [1] recorded it otherwise" in message
        # Alike, or different only in a tensor that is never sent: each rank gets its slice of rank 0's values.
        for how in ("alike", "a rank-dependent buffer never sent"):
            shards = outcomes[how]
            assert isinstance(shards, dict), f"rank {rank}, {how}: {shards}"
            for name, parameter in eager.items():
                expected = parameter.detach()
                if name in cut:
                    expected = torch.chunk(expected, 2, cut[name])[rank]
                assert torch.equal(shards[name], expected), f"rank {rank}, {how}: {name}"


def test_fsdp2_mixed_precision_virtual_values_follow_the_compute_dtype_where_asked(tmp_path: Path) -> None:
    for rank in run_ranks("mixed-precision", tmp_path):
        # FSDP casts parameters to bfloat16 for forward, and leaves buffers alone.
        assert rank["seen"]["weight"] == torch.bfloat16
        assert rank["seen"]["scale"] == torch.bfloat16  # dtype_from="qkv.weight": the compute dtype
        assert rank["seen"]["cos"] == torch.float32  # follow_dtype=False: fixed float32 rotary tables
        assert rank["outside"] == torch.float32  # outside forward, qkv.weight is the float32 sharded parameter


def test_distributed_checkpoint_round_trip_into_a_fresh_meta_built_model(tmp_path: Path) -> None:
    for rank in run_ranks("dcp", tmp_path):
        assert_equal_dicts(rank["loaded_parameters"], rank["saved_parameters"])
        assert rank["constraints"] == rank["saved_constraints"] == [{0: 3, 1: 16}, {}]
        assert torch.equal(rank["state"], torch.full((3, 16), 5.0))
        assert_equal_dicts(rank["virtual"], rank["reference_virtual"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP in one process warns
def test_resizing_load_planner_loads_shaped_data_with_other_free_sizes_also_nested(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from modattrs import ResizingLoadPlanner, ShapedTensor

    saved = nn.Module()
    ShapedTensor(saved, "cache", torch.arange(32.0).reshape(8, 4), {1: 4})
    dcp.save({"model": saved.state_dict(), "step": torch.tensor(3)}, checkpoint_id=str(tmp_path))

    fresh = nn.Module()
    ShapedTensor(fresh, "cache", torch.zeros(1, 4), {1: 4})
    state = {"model": fresh.state_dict(), "step": torch.tensor(0)}
    with pytest.raises(dcp.api.CheckpointException) as refused:  # without the planner
        dcp.load({"model": fresh.state_dict(), "step": torch.tensor(0)}, checkpoint_id=str(tmp_path))
    assert "Size mismatch" in repr(refused.value)
    dcp.load(state, checkpoint_id=str(tmp_path), planner=ResizingLoadPlanner())
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.cache.value, torch.arange(32.0).reshape(8, 4))  # type: ignore[arg-type]
    assert int(state["step"]) == 3


def test_a_rank_that_raises_before_its_last_line_fails_the_run_with_its_traceback(tmp_path: Path) -> None:
    # The workers leave with os._exit(0) once done (torch's gloo teardown aborts now and then): that must not hide
    # a rank that failed.
    with pytest.raises(AssertionError, match=r"(?s)rank 1 exited with 1:.*this rank failed before its last line"):
        run_ranks("raises-on-the-last-rank", tmp_path)
