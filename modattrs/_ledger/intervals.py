"""Byte intervals: the runs of bytes a tensor covers in its storage, and a map from disjoint byte intervals to labels.

Note [Intervals, never a bitmap]
A ledger keeps, per storage, which bytes were written and by what, as sorted disjoint half-open intervals
``[start, end)`` each with a label. Writes of a whole tensor, of a row or of a shard are one interval each; a column
slice is one run per row; neighbours with the same label merge. A model whose tensors are each written by one
initializer holds one interval per storage, whatever its size, where a bitmap would hold a bit per byte.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

__all__ = ["IntervalMap", "byte_runs", "merged"]

Label = TypeVar("Label")

Run = tuple[int, int]


def merged(runs: list[Run]) -> list[Run]:
    """``runs`` sorted, with overlapping and touching runs made one, empty runs left out."""
    result: list[Run] = []
    for start, end in sorted(runs):
        if end <= start:
            continue
        if result and start <= result[-1][1]:
            if end > result[-1][1]:
                result[-1] = (result[-1][0], end)
        else:
            result.append((start, end))
    return result


def byte_runs(tensor: torch.Tensor) -> list[Run]:
    """The bytes of its storage that ``tensor`` covers, as sorted disjoint runs ``(start, end)``.

    Dimensions of size 1 and of stride 0 (expanded) cover no other bytes; the innermost dimensions that lie end to
    end make one block, and each index of the outer dimensions starts a run of that block.
    """
    count = int(tensor.numel())
    if count == 0:
        return []
    size = tensor.element_size()
    offset = int(tensor.storage_offset())
    if tensor.is_contiguous():
        return [(offset * size, (offset + count) * size)]
    shape = [int(length) for length in tensor.shape]
    pairs = zip(shape, tensor.stride(), strict=True)
    dims = sorted((stride, length) for length, stride in pairs if length > 1 and stride)
    block = 1
    while dims and dims[0][0] == block:
        block *= dims.pop(0)[1]
    starts = [offset]
    for stride, length in dims:
        starts = [start + index * stride for index in range(length) for start in starts]
    return merged([(start * size, (start + block) * size) for start in starts])


class IntervalMap(Generic[Label]):
    """Disjoint half-open byte intervals, sorted, each with a label; neighbours with the same label (``is``) merge."""

    __slots__ = ("_ends", "_labels", "_starts")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._labels: list[Label] = []

    def __len__(self) -> int:
        return len(self._starts)

    def __iter__(self) -> Iterator[tuple[int, int, Label]]:
        return iter(zip(self._starts, self._ends, self._labels, strict=True))

    def assign(self, start: int, end: int, label: Label) -> None:
        """Label the bytes ``[start, end)`` with ``label``, whatever labelled them before."""
        if end <= start:
            return
        starts, ends, labels = self._starts, self._ends, self._labels
        first = bisect_right(ends, start)  # the first interval ending after start (or touching it: see below)
        if first > 0 and ends[first - 1] == start and labels[first - 1] is label:
            first -= 1
        last = bisect_left(starts, end)  # intervals [first, last) overlap [start, end) or touch it
        if last < len(starts) and starts[last] == end and labels[last] is label:
            last += 1
        new_starts, new_ends, new_labels = [], [], []
        if first < last and starts[first] < start:
            if labels[first] is label:
                start = starts[first]
            else:
                new_starts.append(starts[first])
                new_ends.append(start)
                new_labels.append(labels[first])
        tail: tuple[int, int, Label] | None = None
        if first < last and ends[last - 1] > end:
            if labels[last - 1] is label:
                end = ends[last - 1]
            else:
                tail = (end, ends[last - 1], labels[last - 1])
        new_starts.append(start)
        new_ends.append(end)
        new_labels.append(label)
        if tail is not None:
            new_starts.append(tail[0])
            new_ends.append(tail[1])
            new_labels.append(tail[2])
        starts[first:last] = new_starts
        ends[first:last] = new_ends
        labels[first:last] = new_labels

    def pieces(self, start: int, end: int) -> Iterator[tuple[int, int, Label | None]]:
        """The bytes ``[start, end)`` in order, as ``(start, end, label)``, with None for bytes no label covers."""
        starts, ends, labels = self._starts, self._ends, self._labels
        index = bisect_right(ends, start)
        at = start
        while at < end:
            if index < len(starts) and starts[index] < end:
                if starts[index] > at:
                    yield at, starts[index], None
                    at = starts[index]
                piece_end = min(ends[index], end)
                yield at, piece_end, labels[index]
                at = piece_end
                index += 1
            else:
                yield at, end, None
                at = end
