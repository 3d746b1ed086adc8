"""What modattrs knows about each torch operator: one catalogue.

``facts_of(op)`` answers, for an aten operator overload (``torch.ops.aten.normal_.default``) or a Python function
recorded as one call (an opaque initializer), with an ``OpFacts``, worked out once per operator and kept. Ask it
what ``aten.normal_.default`` is and it says: it writes its first argument in place, whatever it held (a value
writer); it draws (a random fill); it binds ``self, mean=0.0, std=1.0, *, generator=None``.

Most facts are read off what torch states. The schema (``schema_arguments`` in ``_torch_private``) says which
arguments an operation writes in place and which are ``out=`` ones, each argument's name, default and whether it is
keyword-only, and whether the operation returns a view; its tags say whether it draws (``nondeterministic_seeded``),
changes only a tensor's geometry in place (``inplace_view``) or computes each element from the same element of its
inputs (``pointwise``). What torch does not state is written here, each table with its reason in a comment: which
factories fill what they make, which operations read only the metadata of a tensor, which overwrite a tensor
whatever it held, which namespaces hold collectives.

``tests/test_operator_facts.py`` holds the catalogue to torch on every build CI runs: each derived fact against a
direct reading of the schema and tags of every aten operator, and, for each hand-written table, that no tag of this
torch tells its operators from those it leaves out. A torch that starts stating one of them fails that test, and
the table can give way to the tag.

Who asks what: the recorder (``recorder``) asks every call for ``written``, ``view``, ``random``, ``lift``,
``value_writer``, ``collective``, ``unfilled``, and what reads the default dtype for ``dtype_keyword``,
``tensor_bounded`` and ``pointwise``; the
replay (``replay``) asks ``unfilled``; the shard-local planner (``windows``) asks ``creator``,
``metadata_read``, ``geometry_read`` and ``elementwise``; the models of the random kernels (``draws``) bind their
arguments with ``signature`` and ``bind``.

The write ledger (``modattrs._ledger.tracking``) classifies operations too (allocations, overwrites, copies,
receiving collectives), for its own purpose; it stands apart from deferred init and does not import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

import torch

from modattrs._torch_private import OpOverload, overloads_of, returns_tensors, schema_arguments

__all__: list[str] = []

aten = torch.ops.aten


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a schema argument that has none.
REQUIRED: Final = _Required()


class Parameter(NamedTuple):
    name: str
    default: object  # the schema's default, or REQUIRED


@dataclass(frozen=True, slots=True)
class Signature:
    """How an operation's arguments bind, from its schema: the positional ones in order, then the keyword-only."""

    positional: tuple[Parameter, ...]
    keyword: tuple[Parameter, ...]


@dataclass(frozen=True, slots=True, eq=False)
class OpFacts:
    """What modattrs knows about one operator (module docstring). An opaque initializer, Python code, has no schema:
    it writes its argument whatever it held, and torch states nothing else about it."""

    op: object  # held, so that its id, the key of the cache, names it for good
    aten: bool  # an operator overload, with a schema and tags (else a Python function)
    # From the schema
    written: tuple[tuple[int, str], ...]  # (position, name) of each argument marked written (``Tensor(a!)``)
    in_place: bool  # writes its first argument (``normal_``, ``add_``, ``copy_``)
    out: bool  # writes ``out=`` arguments
    view: bool  # returns a view of an argument (``OpOverload.is_view``)
    factory: bool  # reads no tensor but ``out=`` ones, and returns tensors (``empty``, ``randn``, ``arange``)
    dtype_keyword: bool  # has a keyword-only ``dtype`` that may be None
    signature: Signature | None  # None for Python functions
    # From the tags
    random: bool  # ``nondeterministic_seeded``: draws from a generator
    inplace_view: bool  # changes the geometry of its argument in place (``unsqueeze_``, ``t_``)
    pointwise: bool
    # Hand-written (the tables below, each with its reason)
    collective: bool
    lift: bool
    value_writer: bool
    creator: bool
    metadata_read: bool
    geometry_read: bool
    elementwise: bool  # an in-place write of each element from itself alone: pointwise and in place, or listed
    unfilled: OpOverload | None  # a factory that fills what it makes: the one that makes it alike, unfilled
    tensor_bounded: bool

    @property
    def random_fill(self) -> bool:
        """Whether the operation fills its first argument in place with draws (``normal_``, ``uniform_``)."""
        return self.random and self.in_place

    @property
    def reads_default_dtype(self) -> bool:
        """Whether, given no ``dtype``, the operation may make torch's default dtype: a factory with an optional
        ``dtype`` (``empty``, ``randn``, ``zeros``; ``arange`` and ``full`` of integers make int64), or one of tensor
        bounds (``linspace`` of 0-dim tensors). The recorder writes down the dtype each such call made."""
        return self.dtype_keyword and (self.factory or self.tensor_bounded)


# --- hand-written: what torch does not state -----------------------------------------------------------------------

# Collectives: the operations of these namespaces send data between ranks. torch tags none of them so; the namespace
# is the mark. c10d: what torch.distributed calls (scatter_, broadcast_, allreduce_, ...); the others: functional
# collectives, which DTensor uses to redistribute.
COLLECTIVE_NAMESPACES: Final = frozenset({"c10d", "_c10d_functional", "_c10d_functional_autograd"})

# torch.tensor(...) hands its new real tensor to these, which no code but torch's sees: its fake is the record's own.
# Its schema says only that it returns its argument (as ``alias`` does, which others may hold).
LIFTS: Final = frozenset({aten.lift_fresh.default})

# In-place operations that write values into their first argument whatever it held, and change nothing else of it.
# The schema marks ``self`` written for these and for ``add_`` alike; it does not say which ones read it first.
VALUE_WRITERS: Final = overloads_of(
    aten.normal_, aten.uniform_, aten.random_, aten.exponential_, aten.cauchy_, aten.log_normal_, aten.geometric_,
    aten.bernoulli_, aten.fill_, aten.zero_, aten.copy_,
)  # fmt: skip

# Factories that make a whole, new storage of the size they are given, each element alike (nothing, or one value):
# a part of it is the same factory called with the part's size. ``arange``, ``eye`` and ``linspace`` are factories
# whose elements depend on their place; the schema and tags do not tell the two kinds apart.
CREATORS: Final = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.zeros.default,
        aten.ones.default,
        aten.full.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    }
)

# Operations that read only the dtype and device of their tensor argument (or nothing of it). The schema types that
# argument ``Tensor`` like any other whose values are read.
METADATA_READS: Final = frozenset(
    {
        torch.ops.prim.device.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
        aten.new_zeros.default,
        aten.new_ones.default,
        aten.new_full.default,
    }
)

# Operations that read the sizes and strides of their tensor argument besides its dtype and device, and none of its
# values. As above, the schema does not say which arguments are read for their values.
GEOMETRY_READS: Final = frozenset(
    {aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}
)

# In-place operations that write each element from that element alone (besides numbers), which torch does not tag
# ``pointwise`` (they read no element at all).
ELEMENTWISE_UNTAGGED: Final = frozenset({aten.fill_.Scalar, aten.zero_.default})

# Factories that fill what they make, and the factory with the same arguments that leaves it unfilled (a replay runs
# the latter when a later write overwrites the whole result before anything reads it). torch relates no two
# operators so.
UNFILLED: Final[Mapping[OpOverload, OpOverload]] = {
    aten.zeros.default: aten.empty.memory_format,
    aten.ones.default: aten.empty.memory_format,
    aten.new_zeros.default: aten.new_empty.default,
    aten.new_ones.default: aten.new_empty.default,
}

# Factories whose bounds are tensors (``linspace(start, end, steps)`` of 0-dim tensors): with ``dtype`` None they make
# the default dtype, whatever the dtypes of those tensors. Their schema reads tensors, as ``zeros_like``'s does,
# whose ``dtype=None`` means the tensor's dtype instead.
TENSOR_BOUNDED: Final = frozenset(
    func for func in overloads_of(aten.linspace, aten.logspace) if any(a.tensor for a in schema_arguments(func))
)


# --- the queries -----------------------------------------------------------------------------------------------------


#: By the id of the operator: an OpOverload hashes in Python code, as dear as the rest of a look-up (the recorder
#: asks once per operation it records).
_FACTS: dict[int, OpFacts] = {}


def facts_of(op: object) -> OpFacts:
    """What the catalogue knows about ``op``, an aten operator overload or a Python function; worked out once."""
    facts = _FACTS.get(id(op))
    if facts is not None and facts.op is op:
        return facts
    facts = _FACTS[id(op)] = _aten_facts(op) if isinstance(op, OpOverload) else _python_facts(op)
    return facts


def _aten_facts(op: OpOverload) -> OpFacts:
    arguments = schema_arguments(op)
    written = tuple((index, argument.name) for index, argument in enumerate(arguments) if argument.written)
    tags = op.tags
    pointwise = torch.Tag.pointwise in tags
    in_place = bool(written) and written[0][0] == 0
    return OpFacts(
        op=op,
        aten=True,
        written=written,
        in_place=in_place,
        out=any(argument.out and argument.written for argument in arguments),
        view=op.is_view,
        factory=not any(argument.tensor and not argument.out for argument in arguments) and returns_tensors(op),
        dtype_keyword=any(
            argument.name == "dtype" and argument.kwarg_only and not argument.required and argument.default is None
            for argument in arguments
        ),
        signature=Signature(
            tuple(Parameter(a.name, REQUIRED if a.required else a.default) for a in arguments if not a.kwarg_only),
            tuple(Parameter(a.name, REQUIRED if a.required else a.default) for a in arguments if a.kwarg_only),
        ),
        random=torch.Tag.nondeterministic_seeded in tags,
        inplace_view=torch.Tag.inplace_view in tags,
        pointwise=pointwise,
        collective=op.namespace in COLLECTIVE_NAMESPACES,
        lift=op in LIFTS,
        value_writer=op in VALUE_WRITERS,
        creator=op in CREATORS,
        metadata_read=op in METADATA_READS,
        geometry_read=op in GEOMETRY_READS,
        elementwise=(pointwise and in_place) or op in ELEMENTWISE_UNTAGGED,
        unfilled=UNFILLED.get(op),
        tensor_bounded=op in TENSOR_BOUNDED,
    )


def _python_facts(op: object) -> OpFacts:
    """An opaque initializer: Python code that writes its argument, whatever it held (``register_opaque_init``)."""
    return OpFacts(
        op=op,
        aten=False,
        written=(),
        in_place=False,
        out=False,
        view=False,
        factory=False,
        dtype_keyword=False,
        signature=None,
        random=False,
        inplace_view=False,
        pointwise=False,
        collective=False,
        lift=False,
        value_writer=True,
        creator=False,
        metadata_read=False,
        geometry_read=False,
        elementwise=False,
        unfilled=None,
        tensor_bounded=False,
    )


def bind(signature: Signature, args: Sequence[object], kwargs: Mapping[str, object]) -> dict[str, object] | None:
    """The arguments of a call by name, with the schema's defaults for those not given; None if they do not fit
    the signature (too many, one given twice, an unknown name, a required one missing)."""
    if len(args) > len(signature.positional):
        return None
    left = dict(kwargs)
    bound: dict[str, object] = {}
    for (name, _), value in zip(signature.positional, args, strict=False):
        bound[name] = value
    for name, default in (*signature.positional, *signature.keyword):
        if name in left:
            if name in bound:
                return None
            bound[name] = left.pop(name)
        elif name not in bound:
            if default is REQUIRED:
                return None
            bound[name] = default
    return None if left else bound
