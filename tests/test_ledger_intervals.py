"""The ledger's byte intervals against a reference that keeps one label per byte (a bitmap, here in the test only:
the library keeps intervals), and the runs of bytes a tensor covers against every element's own bytes."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from modattrs._ledger.intervals import IntervalMap, byte_runs, merged

SIZE = 64
LABELS = [object() for _ in range(3)]

writes = st.lists(st.tuples(st.integers(0, SIZE), st.integers(0, SIZE), st.integers(0, len(LABELS) - 1)), max_size=30)


def reference(assignments: list[tuple[int, int, int]]) -> list[object | None]:
    bytes_: list[object | None] = [None] * SIZE
    for start, end, label in assignments:
        for index in range(start, end):
            bytes_[index] = LABELS[label]
    return bytes_


@settings(max_examples=300, deadline=None)
@given(writes)
def test_an_interval_map_labels_each_byte_as_a_bitmap_of_the_same_writes_would(
    assignments: list[tuple[int, int, int]],
) -> None:
    intervals: IntervalMap[object] = IntervalMap()
    for start, end, label in assignments:
        intervals.assign(start, end, LABELS[label])
    expected = reference(assignments)
    got: list[object | None] = [None] * SIZE
    for start, end, label in intervals:
        for index in range(start, end):
            got[index] = label
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(writes, st.integers(0, SIZE), st.integers(0, SIZE))
def test_the_pieces_of_a_range_cover_it_in_order_with_each_byte_s_label(
    assignments: list[tuple[int, int, int]], start: int, end: int
) -> None:
    intervals: IntervalMap[object] = IntervalMap()
    for first, last, label in assignments:
        intervals.assign(first, last, LABELS[label])
    expected = reference(assignments)[start:end]
    got: list[object | None] = []
    previous_end = start
    for piece_start, piece_end, label in intervals.pieces(start, end):
        assert piece_start == previous_end < piece_end
        previous_end = piece_end
        got.extend([label] * (piece_end - piece_start))
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(writes)
def test_neighbouring_intervals_with_one_label_are_one_interval(assignments: list[tuple[int, int, int]]) -> None:
    intervals: IntervalMap[object] = IntervalMap()
    for start, end, label in assignments:
        intervals.assign(start, end, LABELS[label])
    listed = list(intervals)
    for (_, end, label), (start, _, next_label) in itertools.pairwise(listed):
        assert end <= start
        assert end < start or label is not next_label


def test_a_whole_tensor_written_at_once_is_one_interval_however_large() -> None:
    intervals: IntervalMap[object] = IntervalMap()
    label = LABELS[0]
    for row in range(1000):
        intervals.assign(row * 400, (row + 1) * 400, label)
    assert list(intervals) == [(0, 400_000, label)]


def element_bytes(tensor: torch.Tensor) -> set[int]:
    """Every byte of the storage that an element of ``tensor`` occupies: the reference for byte_runs."""
    size = tensor.element_size()
    found: set[int] = set()
    for index in torch.cartesian_prod(*[torch.arange(n) for n in tensor.shape]).reshape(-1, tensor.dim()).tolist():
        offset = tensor.storage_offset() + sum(i * s for i, s in zip(index, tensor.stride(), strict=True))
        found.update(range(offset * size, (offset + 1) * size))
    return found


def run_bytes(runs: list[tuple[int, int]]) -> set[int]:
    return {index for start, end in runs for index in range(start, end)}


views = st.sampled_from(
    [
        lambda t: t,
        lambda t: t[1],  # one row
        lambda t: t[:, 1:3],  # a column cut
        lambda t: t[:, 2],  # one column
        lambda t: t.t(),
        lambda t: t[::2],
        lambda t: t[1:, ::3],
        lambda t: t[2:4].t(),
        lambda t: t[:1, :1],
        lambda t: t.unsqueeze(1).expand(-1, 3, -1),
        lambda t: t.view(2, 3, 6).permute(2, 0, 1)[1:, :, 1:],
    ]
)


@settings(max_examples=100, deadline=None)
@given(views, st.sampled_from([torch.float32, torch.int8, torch.float64]))
def test_the_runs_of_a_view_are_the_bytes_its_elements_occupy(view: object, dtype: torch.dtype) -> None:
    base = torch.zeros(6, 6, dtype=dtype)
    tensor = view(base)  # type: ignore[operator]
    runs = byte_runs(tensor)
    assert runs == merged(runs)
    assert run_bytes(runs) == element_bytes(tensor)


def test_a_column_cut_has_one_run_per_row() -> None:
    base = torch.zeros(5, 8)
    assert byte_runs(base[:, 2:5]) == [(4 * (8 * row + 2), 4 * (8 * row + 5)) for row in range(5)]


def test_an_empty_tensor_covers_no_bytes() -> None:
    assert byte_runs(torch.zeros(3, 0)) == []
