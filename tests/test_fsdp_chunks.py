"""How FSDP2 cuts a fake tensor of modattrs' modes into chunks (change 15 of docs/torch_changes.rst): the chunks
torch's own cut gives, each made when read."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param

from modattrs.deferred import deferred_init
from modattrs.fake import fake_mode
from tests.support.ranks import fake_world


def layout(tensor: torch.Tensor) -> tuple[object, ...]:
    return tuple(tensor.shape), tensor.stride(), tensor.storage_offset(), tensor.dtype


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 70),
    columns=st.integers(1, 3),
    count=st.integers(1, 80),
    dim=st.integers(0, 1),
    reads=st.lists(st.integers(-80, 79), max_size=6),
)
def test_fsdp2s_chunks_of_a_fake_tensor_are_torchs_chunks_in_number_and_layout(
    rows: int, columns: int, count: int, dim: int, reads: list[int]
) -> None:
    with fake_mode():
        fake = torch.empty(rows, columns)
        chunks = _fsdp_param._chunk_with_empty(fake, count, dim)
    expected = _fsdp_param._chunk_with_empty.__wrapped__(torch.empty(rows, columns, device="meta"), count, dim)
    assert len(chunks) == len(expected) == count
    for index in [*reads, *range(count)]:  # in any order, read again, negative indices as a list takes them
        if -count <= index < count:
            assert layout(chunks[index]) == layout(expected[index])
            assert chunks[index] is chunks[index]
    assert [layout(chunk) for chunk in chunks[1::2]] == [layout(chunk) for chunk in expected[1::2]]


def test_a_chunk_of_a_fake_tensor_is_a_fake_view_of_it() -> None:
    with fake_mode():
        fake = torch.empty(10, 4)
        chunks = _fsdp_param._chunk_with_empty(fake, 4, 0)
        chunks[1].fill_(1.0)
    assert chunks[1]._base is fake
    assert chunks[1].fake_mode is fake.fake_mode  # type: ignore[attr-defined]


def test_an_index_past_the_last_chunk_raises_as_a_list_does() -> None:
    with fake_mode():
        chunks = _fsdp_param._chunk_with_empty(torch.empty(10, 4), 4, 0)
    for index in (4, -5):
        try:
            chunks[index]
        except IndexError:
            continue
        raise AssertionError(f"chunks[{index}] of 4 chunks did not raise IndexError")


def test_real_and_meta_tensors_get_torchs_list() -> None:
    with fake_mode():
        pass  # the changes are made
    for tensor in (torch.zeros(10, 4), torch.empty(10, 4, device="meta")):
        chunks = _fsdp_param._chunk_with_empty(tensor, 4, 0)
        assert type(chunks) is list
        assert [layout(chunk) for chunk in chunks] == [layout(chunk) for chunk in torch.chunk(tensor, 4)]


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    columns=st.integers(1, 5),
    size=st.sampled_from([2, 3, 4, 8, 64]),
    data=st.data(),
)
def test_fsdp2s_sizes_of_a_deferred_parameters_shards_are_those_of_the_meta_parameters(
    rows: int, columns: int, size: int, data: st.DataObject
) -> None:
    # Its post-forward metadata reads the size of the rank's chunk alone, cut from a meta tensor for a fake one.
    rank = data.draw(st.integers(0, size - 1), label="rank")
    with fake_world((size,), rank) as mesh:
        states = []
        for module in (deferred_init(nn.Linear, columns, rows), nn.Linear(columns, rows, device="meta")):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
            group = fully_shard.state(module)._fsdp_param_group  # type: ignore[attr-defined]
            states.append(
                [
                    (
                        param.sharded_size,
                        param.padded_sharded_param_size,
                        param.sharded_post_forward_size,
                        param.contiguous_sharded_post_forward_stride,
                    )
                    for param in group.fsdp_params
                ]
            )
        deferred, meta = states
    assert deferred == meta
    assert all(isinstance(size, torch.Size) for state in deferred for size in state[:3])


@pytest.fixture
def cuts() -> Iterator[list[Sequence[torch.Tensor]]]:
    """What FSDP2's ``_chunk_with_empty`` returns while the test runs, in order."""
    made: list[Sequence[torch.Tensor]] = []
    with fake_mode():
        pass  # the changes are made
    wrapped = _fsdp_param._chunk_with_empty

    def spy(tensor: torch.Tensor, count: int, dim: int) -> Sequence[torch.Tensor]:
        chunks = wrapped(tensor, count, dim)
        made.append(chunks)
        return chunks

    _fsdp_param._chunk_with_empty = spy
    try:
        yield made
    finally:
        _fsdp_param._chunk_with_empty = wrapped


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_chunk_0_read_for_the_padded_size_on_another_rank_is_a_meta_tensor_of_its_size(
    cuts: list[Sequence[torch.Tensor]], rank: int
) -> None:
    with fake_world((4,), rank) as mesh:
        module = deferred_init(nn.Linear, 3, 10)  # 10 rows over 4 ranks: chunks of 3, 3, 3 and 1
        fully_shard(module, mesh=mesh)
    shards = cuts[::2]  # each parameter's shard, then its post-forward sizes
    assert len(shards) == 2
    for chunks, padded in zip(shards, [(3, 3), (3,)], strict=True):
        own, first = chunks[rank], chunks[0]
        assert type(own) is FakeTensor
        assert type(first) is torch.Tensor
        assert first.is_meta
        assert first.shape == padded


def test_chunk_0_is_the_fake_shard_on_rank_0(cuts: list[Sequence[torch.Tensor]]) -> None:
    with fake_world((4,), 0) as mesh:
        fully_shard(deferred_init(nn.Linear, 3, 10), mesh=mesh)
    for chunks in cuts[::2]:
        assert type(chunks[0]) is FakeTensor
