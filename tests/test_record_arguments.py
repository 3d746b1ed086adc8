"""A replayed operation is called with the arguments it was recorded with, however they were nested."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

from modattrs._deferred.record import NO_RESULTS, Draws, Op, plain_call
from modattrs._torch_private import tree_flatten, tree_unflatten

leaves = st.one_of(
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
    st.sampled_from([torch.float32, torch.int64, torch.device("cpu"), torch.strided, torch.channels_last]),
)
arguments = st.one_of(
    leaves,
    st.lists(leaves, max_size=4),
    st.lists(leaves, max_size=4).map(tuple),
    st.lists(st.lists(leaves, max_size=2), max_size=2),  # nested: rebuilt by pytree
    st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
    st.dictionaries(st.text(max_size=2), leaves, max_size=2),
)


def recorded(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Op:
    flat, spec = tree_flatten((args, kwargs))
    return Op(
        func=print,
        flat=flat,
        spec=spec,
        slots=(),
        constant_slots=(),
        device_slots=(),
        generator_states=(),
        in_refs=frozenset(),
        reads=frozenset(),
        out_refs=(),
        results=NO_RESULTS,
        writes=frozenset(),
        value_writer=False,
        overwrites=frozenset(),
        touched=frozenset(),
        draws=Draws.NONE,
        device=None,
        reset=None,
        pinned=False,
        default_dtype=torch.float32,
        plain=plain_call(args, kwargs),
    )


@given(st.lists(arguments, max_size=5).map(tuple), st.dictionaries(st.text(max_size=4), arguments, max_size=3))
def test_the_arguments_of_a_replayed_call_are_those_pytree_rebuilds(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    op = recorded(args, kwargs)
    rebuilt_args, rebuilt_kwargs = op.arguments({}, None)
    expected_args, expected_kwargs = tree_unflatten(list(op.flat), op.spec)
    assert rebuilt_args == expected_args
    assert [type(a) for a in rebuilt_args] == [type(a) for a in expected_args]
    assert rebuilt_kwargs == expected_kwargs
    assert [type(v) for v in rebuilt_kwargs.values()] == [type(v) for v in expected_kwargs.values()]


def test_calls_of_leaves_and_lists_of_leaves_are_rebuilt_without_pytree() -> None:
    assert plain_call((None, [2, 3], (1,), 0.5), {"dtype": torch.float16}) is not None
    assert plain_call((None, [[2]]), {}) is None
    assert plain_call((torch.Size([2, 3]),), {}) is None
