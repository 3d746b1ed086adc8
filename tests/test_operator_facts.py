"""The catalogue of operator facts (``modattrs/_deferred/ops.py``) held to torch itself.

Each derived fact is checked against a direct reading of the schema and tags of every aten operator of this torch;
each hand-written table against the tags, which must not tell its operators from those it leaves out (a torch that
starts stating the fact fails here, and the table can give way to the tag).
"""

from __future__ import annotations

import functools

import pytest
import torch

from modattrs._deferred import ops
from modattrs._deferred.rng import draws

aten = torch.ops.aten


@functools.cache
def aten_overloads() -> tuple[object, ...]:
    """Every overload of every aten operator this torch registers."""
    names = sorted({schema.name.removeprefix("aten::") for schema in torch._C._jit_get_all_schemas()})
    found = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None:
            found.extend(getattr(packet, overload) for overload in packet.overloads())
    return tuple(found)


def test_every_argument_a_schema_marks_written_is_known_as_written() -> None:
    disagreeing = []
    for op in aten_overloads():
        schema = op._schema  # type: ignore[attr-defined]
        marked = tuple(
            (index, argument.name)
            for index, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        if ops.facts_of(op).written != marked:
            disagreeing.append(str(op))
    assert disagreeing == []


def test_every_operation_with_a_mutable_first_argument_is_known_as_an_in_place_writer() -> None:
    in_place = []
    for op in aten_overloads():
        arguments = op._schema.arguments  # type: ignore[attr-defined]
        first = arguments[0].alias_info if arguments else None
        if (first is not None and first.is_write) != ops.facts_of(op).in_place:
            in_place.append(str(op))
    assert in_place == []
    assert ops.facts_of(aten.normal_.default).in_place
    assert not ops.facts_of(aten.add.out).in_place


def test_every_operation_writing_an_out_argument_is_known_as_one() -> None:
    disagreeing = [
        str(op)
        for op in aten_overloads()
        if ops.facts_of(op).out
        != any(
            argument.is_out and argument.alias_info is not None and argument.alias_info.is_write
            for argument in op._schema.arguments  # type: ignore[attr-defined]
        )
    ]
    assert disagreeing == []
    assert ops.facts_of(aten.add.out).out


def test_views_random_operations_and_pointwise_ones_are_what_torch_says() -> None:
    disagreeing = []
    for op in aten_overloads():
        facts, tags = ops.facts_of(op), op.tags  # type: ignore[attr-defined]
        if facts.view != op.is_view:  # type: ignore[attr-defined]
            disagreeing.append(f"{op} view")
        if facts.random != (torch.Tag.nondeterministic_seeded in tags):
            disagreeing.append(f"{op} random")
        if facts.inplace_view != (torch.Tag.inplace_view in tags):
            disagreeing.append(f"{op} inplace_view")
        if facts.pointwise != (torch.Tag.pointwise in tags):
            disagreeing.append(f"{op} pointwise")
    assert disagreeing == []


def test_every_signature_is_the_schemas_names_defaults_and_keywords() -> None:
    disagreeing = []
    for op in aten_overloads():
        signature = ops.facts_of(op).signature
        assert signature is not None
        arguments = op._schema.arguments  # type: ignore[attr-defined]
        expected_names = [(a.name, a.kwarg_only) for a in arguments]
        got = [(p.name, False) for p in signature.positional] + [(p.name, True) for p in signature.keyword]
        if got != expected_names:
            disagreeing.append(f"{op} names")
        for argument, parameter in zip(arguments, (*signature.positional, *signature.keyword), strict=True):
            if argument.has_default_value() == (parameter.default is ops.REQUIRED):
                disagreeing.append(f"{op} {argument.name} required")
    assert disagreeing == []


def test_a_default_dtype_in_a_schema_binds_as_the_dtype_torch_makes() -> None:
    signature = ops.facts_of(aten.randint.default).signature
    assert signature is not None
    bound = ops.bind(signature, (10, [3]), {})
    assert bound is not None
    assert bound["dtype"] is torch.randint(10, (3,), device="meta").dtype


def test_every_random_operation_binds_a_generator_passed_to_it() -> None:
    unbound = []
    generator = torch.Generator()
    for op in aten_overloads():
        facts = ops.facts_of(op)
        if not facts.random or facts.signature is None:
            continue
        names = [p.name for p in (*facts.signature.positional, *facts.signature.keyword)]
        if "generator" not in names:
            continue
        args = [object() for p in facts.signature.positional if p.default is ops.REQUIRED and p.name != "generator"]
        kwargs: dict[str, object] = {p.name: object() for p in facts.signature.keyword if p.default is ops.REQUIRED}
        kwargs["generator"] = generator
        bound = ops.bind(facts.signature, args, kwargs)
        if bound is None or bound["generator"] is not generator or sorted(bound) != sorted(names):
            unbound.append(str(op))
    assert unbound == []


def test_every_random_fill_the_draws_model_binds_as_its_schema_says() -> None:
    # the models of the random kernels bind through the catalogue: the default of each argument left out is the
    # schema's, so a call with only its tensor draws what a call with the defaults written out draws
    modelled = [op for op in aten_overloads() if str(op) in draws._PARSERS]
    assert modelled
    for op in modelled:
        facts = ops.facts_of(op)
        assert facts.random
        assert facts.random_fill == facts.in_place  # normal_ fills its argument; randn makes its result
        assert draws._PARSERS[str(op)].signature == facts.signature
    tensor = torch.empty(40)
    short = draws.pattern(aten.normal_.default, (tensor,), {})
    spelt = draws.pattern(aten.normal_.default, (tensor, 0.0, 1.0), {"generator": None})
    assert short is not None
    assert spelt is not None
    state = torch.Generator().manual_seed(3).get_state()
    assert torch.equal(short.draw(state, 0, 40), spelt.draw(state, 0, 40))


def test_a_call_that_does_not_fit_the_schema_binds_to_nothing() -> None:
    signature = ops.facts_of(aten.normal_.default).signature
    assert signature is not None
    tensor = torch.empty(2)
    assert ops.bind(signature, (tensor, 0.0, 1.0, 2.0), {}) is None  # too many
    assert ops.bind(signature, (tensor, 0.0), {"mean": 1.0}) is None  # mean twice
    assert ops.bind(signature, (tensor,), {"median": 1.0}) is None  # no such argument
    assert ops.bind(signature, (), {}) is None  # self missing


def test_a_python_function_is_an_opaque_value_writer_and_nothing_else() -> None:
    def initializer(tensor: torch.Tensor) -> None:
        tensor.fill_(1.0)

    facts = ops.facts_of(initializer)
    assert facts.value_writer
    assert not facts.aten
    assert not facts.written
    assert not facts.random
    assert not facts.collective
    assert facts.signature is None
    assert ops.facts_of(initializer) is facts  # kept


def test_factories_that_may_read_the_default_dtype_are_those_with_an_optional_dtype_and_no_tensor() -> None:
    assert ops.facts_of(aten.randn.default).reads_default_dtype
    assert ops.facts_of(aten.empty.memory_format).reads_default_dtype
    assert ops.facts_of(aten.linspace.Tensor_Tensor).reads_default_dtype  # tensor bounds: hand-written
    assert not ops.facts_of(aten.zeros_like.default).reads_default_dtype  # dtype None: its tensor's
    assert not ops.facts_of(aten.randint.default).reads_default_dtype  # dtype defaults to int64
    for op in aten_overloads():
        facts = ops.facts_of(op)
        if facts.factory:
            arguments = op._schema.arguments  # type: ignore[attr-defined]
            assert all(a.is_out or "Tensor" not in str(a.type) for a in arguments), op


# --- hand-written: what torch does not state --------------------------------------------------------------------------


def tags_of(op: object) -> set[object]:
    return set(op.tags)  # type: ignore[attr-defined]


def stating_tags(members: list[object], others: list[object]) -> set[object]:
    """The tags every one of ``members`` has and none of ``others`` has: a tag that would state what a hand-written
    table says."""
    common = set.intersection(*(tags_of(op) for op in members))
    return common - set().union(*(tags_of(op) for op in others))


#: Each hand-written table, with operators it leaves out that the schema alone cannot tell from its own.
HAND_WRITTEN: dict[str, tuple[list[object], list[object]]] = {
    "the value writers overwrite what they write": (
        list(ops.VALUE_WRITERS),
        [aten.add_.Tensor, aten.mul_.Scalar, aten.clamp_.default, aten.masked_fill_.Scalar, aten.index_put_.default],
    ),
    "the creators make elements alike": (
        list(ops.CREATORS),
        [aten.arange.default, aten.eye.default, aten.linspace.default, aten.randn.default, aten.scalar_tensor.default],
    ),
    "the metadata reads read only dtype and device": (
        list(ops.METADATA_READS),
        [aten.clone.default, aten.neg.default, aten._to_copy.default, aten.add.Tensor],
    ),
    "the geometry reads read no values": (
        list(ops.GEOMETRY_READS),
        [aten.clone.default, aten.neg.default, aten._to_copy.default, aten.contiguous.default],
    ),
    "lift_fresh hands over a tensor no other code holds": (
        list(ops.LIFTS),
        [aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default],
    ),
    "the filling factories fill what they make": (
        list(ops.UNFILLED),
        list(ops.UNFILLED.values()),
    ),
    "tensor bounded factories read the default dtype": (
        list(ops.TENSOR_BOUNDED),
        [aten.zeros_like.default, aten.full_like.default, aten.randn_like.default],
    ),
    "the collectives send data between ranks": (
        [torch.ops.c10d.broadcast_.default, torch.ops.c10d.scatter_.default, torch.ops.c10d.allreduce_.default],
        [aten.copy_.default, aten.add_.Tensor, aten.fill_.Scalar],
    ),
}


@pytest.mark.parametrize("table", HAND_WRITTEN)
def test_no_tag_of_this_torch_states_what_a_hand_written_table_says(table: str) -> None:
    # a tag found here states the table's fact: derive it from the tag, and drop the table
    members, others = HAND_WRITTEN[table]
    assert members
    assert not set(members) & set(others)
    assert stating_tags(members, others) == set()


def test_torch_tags_neither_fill_nor_zero_pointwise() -> None:
    # ops.ELEMENTWISE_UNTAGGED lists them for that reason: once torch tags them, the table can go
    for op in ops.ELEMENTWISE_UNTAGGED:
        assert torch.Tag.pointwise not in tags_of(op)
        assert ops.facts_of(op).elementwise


def test_no_tag_of_this_torch_names_collectives() -> None:
    # ops.COLLECTIVE_NAMESPACES stands for such a tag
    assert [tag for tag in torch.Tag.__members__ if "collective" in tag or "distributed" in tag] == []


def test_every_operator_a_hand_written_table_names_is_an_operator_of_this_torch() -> None:
    # a table entry torch dropped or renamed would be a name that matches nothing
    tables = [ops.LIFTS, ops.VALUE_WRITERS, ops.CREATORS, ops.METADATA_READS, ops.GEOMETRY_READS]
    tables += [ops.ELEMENTWISE_UNTAGGED, frozenset(ops.UNFILLED), frozenset(ops.UNFILLED.values()), ops.TENSOR_BOUNDED]
    for table in tables:
        assert table
        for op in table:
            assert ops.facts_of(op).aten
            assert ops.facts_of(op).signature is not None


def test_each_filling_factory_and_its_unfilled_twin_take_the_same_arguments() -> None:
    for filled, unfilled in ops.UNFILLED.items():
        assert ops.facts_of(filled).unfilled is unfilled
        a, b = ops.facts_of(filled).signature, ops.facts_of(unfilled).signature
        assert a is not None
        assert b is not None
        assert [p.name for p in a.positional] == [p.name for p in b.positional]


def test_an_in_place_pointwise_operation_is_an_elementwise_write_and_its_out_of_place_twin_is_not() -> None:
    assert ops.facts_of(aten.mul_.Scalar).elementwise  # pointwise, in place: derived
    assert not ops.facts_of(aten.mul.Scalar).elementwise
    assert not ops.facts_of(aten.copy_.default).elementwise  # reads another tensor


def test_every_hand_written_writer_writes_its_first_argument_by_its_schema() -> None:
    # the hand-written tables add to what the schema says, never contradict it
    for op in ops.VALUE_WRITERS | ops.ELEMENTWISE_UNTAGGED:
        assert ops.facts_of(op).in_place, op


def test_every_creator_and_filling_factory_reads_no_values_by_its_schema() -> None:
    for op in ops.CREATORS | frozenset(ops.UNFILLED) | frozenset(ops.UNFILLED.values()):
        facts = ops.facts_of(op)
        assert facts.factory or op in ops.METADATA_READS, op
        assert not facts.written
        assert not facts.random
