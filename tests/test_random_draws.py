"""Any range of a random operation's result, drawn alone (``modattrs._deferred.rng.draws``), is what torch puts there.

The reference is torch itself: each operation runs whole from a state, and every range the model draws from that
state must equal, bit for bit, the same elements of the whole result in memory order (increasing storage offset).
The outputs the model says the operation consumes are checked by advancing a copy of the state that many outputs
with float32 ``uniform_`` (one output per element) and comparing it with the state the operation leaves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from modattrs._deferred.rng import draws

aten = torch.ops.aten
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTEGERS = [torch.int64, torch.int32, torch.uint8, torch.bool]
#: Bytes of the state before the Box-Muller caches: the position and the array.
POSITION = slice(0, 5016)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- helpers ---------------------------------------------------------------------------------------------------------


def in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of ``tensor`` by increasing storage offset."""
    offsets = torch.zeros(tensor.shape, dtype=torch.int64)
    for dim, (size, stride) in enumerate(zip(tensor.shape, tensor.stride(), strict=True)):
        shape = [1] * tensor.dim()
        shape[dim] = size
        offsets = offsets + (torch.arange(size) * stride).reshape(shape)
    return tensor.flatten()[offsets.flatten().argsort()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        integer = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(integer), b.contiguous().view(integer))
    return torch.equal(a, b)


def advanced(state: torch.Tensor, outputs: int) -> torch.Tensor:
    """``state`` after ``outputs`` more 32-bit outputs, by drawing them."""
    generator = generator_at(state)
    if outputs:
        torch.empty(outputs, dtype=torch.float32).uniform_(generator=generator)
    return generator.get_state()


def generator_at(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(state)
    return generator


def start_state(drawn: int, cached_normal: bool = False, seed: int = 1234) -> torch.Tensor:
    generator = torch.Generator()
    generator.manual_seed(seed)
    if drawn:
        torch.empty(drawn, dtype=torch.float32).uniform_(generator=generator)
    if cached_normal:
        torch.empty(1, dtype=torch.float64).normal_(generator=generator)  # the scalar path caches a second normal
    return generator.get_state()


STATES = {
    "right after manual_seed": (0, False),
    "mid-block": (5, False),
    "near a block's end": (617, False),
    "with a cached normal": (9, True),
}


def ranges(numel: int) -> list[tuple[int, int]]:
    """Whole, first element, last element, one starting and ending mid-block, an aligned block, into the tail."""
    if numel == 0:
        return [(0, 0)]
    chosen = {(0, numel), (0, 1), (numel - 1, numel), (numel // 3, numel - numel // 4)}
    if numel >= 32:
        chosen |= {(16, 32), (5, 27), (numel - 20, numel - 2), (numel - 17, numel)}
    if numel >= 2:
        chosen.add((1, numel - 1))
    return sorted(chosen)


def check_every_range(
    op: object, args: tuple[object, ...], kwargs: dict[str, object], run: Callable[[], torch.Tensor],
    state: torch.Tensor, set_state: Callable[[torch.Tensor], None], get_state: Callable[[], torch.Tensor],
) -> None:  # fmt: skip
    """The model of ``op(*args, **kwargs)`` against ``run()``, which runs it on the generator ``set_state`` sets."""
    model = draws.pattern(op, args, kwargs)
    assert model is not None, f"{op} is not modelled for {args}, {kwargs}"
    set_state(state)
    full = in_memory_order(run())
    after = get_state()
    assert model.numel == full.numel()
    assert torch.equal(advanced(state, model.outputs(state))[POSITION], after[POSITION])
    assert torch.equal(model.state_after(state), after)
    for start, stop in ranges(full.numel()):
        drawn = model.draw(state, start, stop)
        assert same_bits(drawn, full[start:stop]), f"elements [{start}, {stop}) differ"
        assert all(
            0 <= read.start < read.stop <= model.outputs(state) for read in model.outputs_read(state, start, stop)
        )
    if model.outputs(state):  # the operation's last output is read by some element
        assert model.outputs_read(state, 0, full.numel())[-1].stop == model.outputs(state)


# --- in-place operations ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InPlace:
    op: object
    parameters: tuple[object, ...]
    dtypes: tuple[torch.dtype, ...]


IN_PLACE = {
    "uniform_": InPlace(aten.uniform_.default, (-0.5, 2.0), tuple(FLOATS)),
    "normal_": InPlace(aten.normal_.default, (0.25, 3.0), tuple(FLOATS)),
    "bernoulli_": InPlace(aten.bernoulli_.float, (0.3,), (*FLOATS, *INTEGERS)),
    "random_": InPlace(aten.random_.default, (), (*FLOATS, *INTEGERS)),
    "random_ from to": InPlace(getattr(aten.random_, "from"), (-3, 100), (*FLOATS, torch.int64, torch.int32)),
    "random_ to": InPlace(aten.random_.to, (2,), (*FLOATS, *INTEGERS)),
    "exponential_": InPlace(aten.exponential_.default, (1.5,), tuple(FLOATS)),
    "cauchy_": InPlace(aten.cauchy_.default, (0.5, 2.0), tuple(FLOATS)),
    "log_normal_": InPlace(aten.log_normal_.default, (0.0, 0.5), tuple(FLOATS)),
    "geometric_": InPlace(aten.geometric_.default, (0.25,), (*FLOATS, torch.int64)),
}


def transposed(rows: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(columns, rows, dtype=dtype).t()


SHAPES: dict[str, Callable[[torch.dtype], torch.Tensor]] = {
    "1": lambda dtype: torch.zeros(1, dtype=dtype),
    "7": lambda dtype: torch.zeros(7, dtype=dtype),
    "15": lambda dtype: torch.zeros(15, dtype=dtype),
    "16": lambda dtype: torch.zeros(16, dtype=dtype),
    "17": lambda dtype: torch.zeros(17, dtype=dtype),
    "100": lambda dtype: torch.zeros(100, dtype=dtype),
    "1003": lambda dtype: torch.zeros(1003, dtype=dtype),
    "3x5x7 contiguous": lambda dtype: torch.zeros(3, 5, 7, dtype=dtype),
    "a transposed 40x33 weight": lambda dtype: transposed(40, 33, dtype),
    "a transposed 3x4": lambda dtype: transposed(3, 4, dtype),
    "columns 3 to 17 of 9x20": lambda dtype: torch.zeros(9, 20, dtype=dtype)[:, 3:17],
    "channels_last 2x3x5x4": lambda dtype: torch.zeros(2, 3, 5, 4, dtype=dtype).to(memory_format=torch.channels_last),
}


def in_place_cases() -> Iterator[object]:
    for name, case in IN_PLACE.items():
        for dtype in case.dtypes:
            for shape in SHAPES:
                yield pytest.param(case, dtype, shape, id=f"{name}-{str(dtype)[6:]}-{shape}")


@pytest.mark.parametrize(("case", "dtype", "shape"), list(in_place_cases()))
def test_every_range_of_an_in_place_random_operation_is_the_slice_of_its_whole_result_from_any_state(
    case: InPlace, dtype: torch.dtype, shape: str
) -> None:
    tensor = SHAPES[shape](dtype)
    generator = torch.Generator()
    args = (tensor, *case.parameters)
    for drawn, cached in STATES.values():
        check_every_range(
            case.op, args, {"generator": generator},
            lambda: case.op(*args, generator=generator),  # type: ignore[operator]
            start_state(drawn, cached), generator.set_state, generator.get_state,
        )  # fmt: skip


@pytest.mark.parametrize("shape", ["1", "17", "a transposed 40x33 weight"])
def test_an_in_place_operation_on_the_default_generator_is_modelled_alike(shape: str) -> None:
    tensor = SHAPES[shape](torch.float32)
    with torch.random.fork_rng(devices=[]):
        check_every_range(
            aten.normal_.default, (tensor,), {}, lambda: aten.normal_.default(tensor),
            start_state(5), torch.set_rng_state, torch.get_rng_state,
        )  # fmt: skip


# --- factories -------------------------------------------------------------------------------------------------------


FACTORY_SIZES = {
    "1": [1],
    "7": [7],
    "15": [15],
    "16": [16],
    "17": [17],
    "100": [100],
    "1003": [1003],
    "3x5x7": [3, 5, 7],
}


@dataclass(frozen=True)
class Factory:
    op_name: str  # "packet.overload"
    leading: tuple[object, ...]  # arguments before the size
    dtypes: tuple[torch.dtype | None, ...]  # None: the default, left out
    generator: bool


FACTORIES = {
    "rand": Factory("rand.default", (), (*FLOATS, None), False),
    "rand with a generator": Factory("rand.generator", (), (*FLOATS, None), True),
    "randn": Factory("randn.default", (), (*FLOATS, None), False),
    "randn with a generator": Factory("randn.generator", (), (*FLOATS, None), True),
    "randint": Factory("randint.default", (10,), (*FLOATS, torch.int64, torch.int32, None), False),
    "randint with a generator": Factory("randint.generator", (2**33,), (torch.int64, torch.float64, None), True),
    "randint low high": Factory("randint.low", (-7, 9), (*FLOATS, torch.int64, torch.int8, None), False),
    "randint of bytes": Factory("randint.low", (3, 250), (torch.uint8,), False),
    "randint low high with a generator": Factory("randint.low_generator", (-7, 9), (torch.float16, None), True),
    "normal(mean, std, size)": Factory("normal.float_float", (2.0, 0.5), (*FLOATS, None), True),
}


def factory_cases() -> Iterator[object]:
    for name, case in FACTORIES.items():
        for dtype in case.dtypes:
            for size in FACTORY_SIZES:
                yield pytest.param(case, dtype, size, id=f"{name}-{str(dtype)[6:]}-{size}")


@pytest.mark.parametrize(("case", "dtype", "size"), list(factory_cases()))
def test_every_range_of_a_random_factory_is_the_slice_of_its_result_from_any_state(
    case: Factory, dtype: torch.dtype | None, size: str
) -> None:
    packet, overload = case.op_name.split(".")
    op = getattr(getattr(aten, packet), overload)
    args = (*case.leading, FACTORY_SIZES[size])
    generator = torch.Generator()
    kwargs: dict[str, object] = {"device": torch.device("cpu")}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if case.generator:
        kwargs["generator"] = generator
    with torch.random.fork_rng(devices=[]):
        for drawn, cached in STATES.values():
            check_every_range(
                op, args, kwargs, lambda: op(*args, **kwargs), start_state(drawn, cached),
                generator.set_state if case.generator else torch.set_rng_state,
                generator.get_state if case.generator else torch.get_rng_state,
            )  # fmt: skip


@pytest.mark.parametrize("op_name", ["rand_like", "randn_like", "randint_like"])
@pytest.mark.parametrize("generator", [False, True], ids=["default generator", "a generator"])
@pytest.mark.parametrize("shape", ["15", "100", "a transposed 40x33 weight", "channels_last 2x3x5x4"])
def test_every_range_of_a_like_factory_follows_the_layout_it_preserves(
    op_name: str, generator: bool, shape: str
) -> None:
    packet = getattr(aten, op_name)
    overload = "generator" if generator else "default"
    if overload not in packet.overloads():
        pytest.skip(f"torch {torch.__version__} has no {op_name}.{overload}")
    op = getattr(packet, overload)
    source = SHAPES[shape](torch.float32)
    args = (source, 5) if op_name == "randint_like" else (source,)
    private = torch.Generator()
    kwargs: dict[str, object] = {"generator": private} if generator else {}
    with torch.random.fork_rng(devices=[]):
        for drawn, cached in STATES.values():
            check_every_range(
                op, args, kwargs, lambda: op(*args, **kwargs), start_state(drawn, cached),
                private.set_state if generator else torch.set_rng_state,
                private.get_state if generator else torch.get_rng_state,
            )  # fmt: skip


# --- random_ ranges --------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*is out of bounds")  # torch's warning past a float dtype's exact integers
@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.float64, torch.float32, torch.bfloat16, torch.float16]
)
@pytest.mark.parametrize(
    ("low", "high"),
    [
        (0, 2**32 - 1),
        (0, 2**32),
        (0, 2**32 + 1),
        (-(2**31), 2**31),
        (-(2**31), 2**31 + 1),
        (-(2**40) - 3, 2**40 + 5),
        (-(2**31) - 2**8, 2**31 + 2**8),
        (5, None),
        (-(2**24) - 1, None),
        (-(2**63), None),
        (-(2**63), 2**63 - 1),
        (-9, -2),
        (2**24, 2**24 + 2),
        (0, 2**28 - 1),
        (0, 2**28),
        (0, 2**28 + 1),
        (0, 2**28 + 32),
        (-(2**27), 2**27),
    ],
)
def test_random_from_to_takes_one_or_two_outputs_per_element_as_its_range_needs(
    dtype: torch.dtype, low: int, high: int | None
) -> None:
    tensor = torch.zeros(37, dtype=dtype)
    op = getattr(aten.random_, "from")
    generator = torch.Generator()
    try:
        op(tensor, low, high, generator=generator)
    except RuntimeError:
        assert draws.pattern(op, (tensor, low, high), {}) is None  # torch refuses these: not modelled
        return
    check_every_range(
        op, (tensor, low, high), {"generator": generator}, lambda: op(tensor, low, high, generator=generator),
        start_state(3), generator.set_state, generator.get_state,
    )  # fmt: skip


# --- what nn.init runs -----------------------------------------------------------------------------------------------


class CheckRandomOps(TorchDispatchMode):
    """Checks every random operation dispatched against its model, from the state before it; lists unmodelled ones."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator
        self.modelled: list[str] = []
        self.unmodelled: list[str] = []

    def __torch_dispatch__(
        self, func: object, types: object, args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None
    ) -> object:
        kwargs = kwargs or {}
        model = draws.pattern(func, args, kwargs)
        before = self.generator.get_state()
        result = func(*args, **kwargs)  # type: ignore[operator]
        if model is None:
            if before.ne(self.generator.get_state()).any():
                self.unmodelled.append(str(func))
            return result
        assert isinstance(result, torch.Tensor)
        full = in_memory_order(result)
        assert torch.equal(model.state_after(before), self.generator.get_state()), str(func)
        for start, stop in ranges(full.numel()):
            assert same_bits(model.draw(before, start, stop), full[start:stop]), f"{func} [{start}, {stop})"
        self.modelled.append(str(func))
        return result


INITS: dict[str, Callable[[torch.Tensor, torch.Generator], object]] = {
    "uniform_": lambda w, g: torch.nn.init.uniform_(w, -0.1, 0.3, generator=g),
    "normal_": lambda w, g: torch.nn.init.normal_(w, 0.0, 0.02, generator=g),
    "kaiming_uniform_": lambda w, g: torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=g),
    "kaiming_normal_": lambda w, g: torch.nn.init.kaiming_normal_(w, generator=g),
    "xavier_uniform_": lambda w, g: torch.nn.init.xavier_uniform_(w, generator=g),
    "xavier_normal_": lambda w, g: torch.nn.init.xavier_normal_(w, generator=g),
    "trunc_normal_": lambda w, g: torch.nn.init.trunc_normal_(w, std=0.02, generator=g),
    "trunc_normal_ to one deviation": lambda w, g: torch.nn.init.trunc_normal_(w, a=-1.0, b=1.0, generator=g),
    "trunc_normal_ to a narrow interval": lambda w, g: torch.nn.init.trunc_normal_(w, a=0.5, b=0.8, generator=g),
    "orthogonal_": lambda w, g: torch.nn.init.orthogonal_(w, generator=g),
}


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("weight", ["64x33", "a transposed 40x33 weight", "3x5"])
@pytest.mark.parametrize("init", INITS)
def test_every_random_operation_an_nn_init_function_runs_is_modelled_and_drawn_exactly(
    init: str, weight: str, dtype: torch.dtype
) -> None:
    if dtype in (torch.float16, torch.bfloat16) and init == "orthogonal_":
        pytest.skip("orthogonal_'s QR has no float16/bfloat16 CPU kernel")
    tensor = {
        "64x33": lambda: torch.zeros(64, 33, dtype=dtype),
        "a transposed 40x33 weight": lambda: transposed(40, 33, dtype),
        "3x5": lambda: torch.zeros(3, 5, dtype=dtype),
    }[weight]()
    generator = torch.Generator()
    generator.manual_seed(77)
    mode = CheckRandomOps(generator)
    with mode:
        INITS[init](tensor, generator)
    assert mode.modelled
    assert mode.unmodelled == []


def test_sparse_init_draws_through_randperm_which_is_not_modelled() -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        mode = CheckRandomOps(torch.default_generator)
        with mode:
            torch.nn.init.sparse_(torch.zeros(20, 4), 0.5)
    assert mode.modelled == ["aten.normal_.default"]
    assert set(mode.unmodelled) == {"aten.randperm.default"}


# --- what is not modelled --------------------------------------------------------------------------------------------


NOT_MODELLED: dict[str, Callable[[], tuple[object, tuple[object, ...], dict[str, object]]]] = {
    "randperm": lambda: (aten.randperm.default, (10,), {}),
    "bernoulli_ with a tensor of probabilities": lambda: (
        aten.bernoulli_.Tensor,
        (torch.zeros(5), torch.full((5,), 0.5)),
        {},
    ),
    "multinomial": lambda: (aten.multinomial.default, (torch.ones(5), 2), {}),
    "normal with a tensor of means": lambda: (aten.normal.Tensor_float, (torch.zeros(5), 1.0), {}),
    "a deterministic operation": lambda: (aten.add_.Tensor, (torch.zeros(5), torch.ones(5)), {}),
    "a complex tensor": lambda: (aten.normal_.default, (torch.zeros(5, dtype=torch.complex64),), {}),
    "an unsigned 16-bit tensor": lambda: (aten.random_.default, (torch.zeros(5, dtype=torch.uint16),), {}),
    "an integer tensor for uniform_": lambda: (aten.uniform_.default, (torch.zeros(5, dtype=torch.int64),), {}),
    "an expanded tensor whose elements overlap": lambda: (aten.uniform_.default, (torch.zeros(5, 1).expand(5, 3),), {}),
    "interleaved strides": lambda: (aten.uniform_.default, (torch.zeros(20).as_strided((2, 3), (3, 2)),), {}),
    "a factory on another device": lambda: (aten.randn.default, ([5],), {"device": torch.device("cuda")}),
    "a factory with a sparse layout": lambda: (aten.rand.default, ([5],), {"layout": torch.sparse_coo}),
    "an argument the schema does not have": lambda: (aten.uniform_.default, (torch.zeros(5),), {"low": 0.0}),
    "too many arguments": lambda: (aten.uniform_.default, (torch.zeros(5), 0.0, 1.0, 2.0), {}),
    "a probability torch refuses": lambda: (aten.bernoulli_.float, (torch.zeros(5), 1.5), {}),
    "from not below to": lambda: (getattr(aten.random_, "from"), (torch.zeros(5), 3, 3), {}),
    "a tensor for a float argument": lambda: (aten.uniform_.default, (torch.zeros(5), torch.tensor(0.0)), {}),
    "not an operator": lambda: (torch.rand, ([5],), {}),
    "a like factory with an unusual memory format": lambda: (
        aten.rand_like.default,
        (torch.zeros(2, 3, 4, 5),),
        {"memory_format": torch.channels_last},
    ),
}


@pytest.mark.parametrize("call", NOT_MODELLED.values(), ids=NOT_MODELLED.keys())
def test_an_operation_whose_pattern_is_not_modelled_gets_none(
    call: Callable[[], tuple[object, tuple[object, ...], dict[str, object]]],
) -> None:
    op, args, kwargs = call()
    assert draws.pattern(op, args, kwargs) is None


# --- the catalogue: what decides how many outputs an operation takes ------------------------------------------------


class RandomOps(TorchDispatchMode):
    """Notes the random aten operations that run."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: list[object] = []

    def __torch_dispatch__(
        self, func: object, types: object, args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None
    ) -> object:
        if torch.Tag.nondeterministic_seeded in func.tags:  # type: ignore[attr-defined]
            self.ran.append(func)
        return func(*args, **(kwargs or {}))  # type: ignore[operator]


def outputs_taken(call: Callable[[], object]) -> tuple[int, list[object]]:
    """How many 32-bit outputs of the default CPU generator ``call`` takes (a copy of the state before it is moved
    on one output at a time until it matches), and the random operations it ran."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(11)
        before = torch.get_rng_state()
        mode = RandomOps()
        with mode:
            call()
        after = torch.get_rng_state()[: draws._CACHE_START]
    copy = torch.Generator().set_state(before)
    for taken in range(20_000):
        if torch.equal(copy.get_state()[: draws._CACHE_START], after):
            return taken, mode.ran
        torch.empty((), dtype=torch.float32).random_(generator=copy)  # one output
    raise AssertionError("took more than 20,000 outputs")


def _probabilities(values: torch.Tensor) -> torch.Tensor:
    return values.abs() / values.abs().max()


#: Random calls on two inputs of one layout: ``(call, tame values, other values)``.
CatalogueCase = tuple[Callable[[torch.Tensor], object], torch.Tensor, torch.Tensor]
TAME = torch.full((3, 4), 0.5)
WILD = torch.tensor([[-3.0, 0.0, 7.5, 1e-3], [40.0, -0.5, 2.0, 0.25], [0.9, 12.0, -8.0, 3.0]])
#: Their counts depend on sizes only: the same on both inputs.
SIZE_ONLY_CALLS: dict[str, CatalogueCase] = {
    "bernoulli with tensor probabilities": (lambda v: torch.bernoulli(_probabilities(v)), TAME, WILD),
    "bernoulli_ with tensor probabilities": (lambda v: torch.empty(3, 4).bernoulli_(_probabilities(v)), TAME, WILD),
    "multinomial": (lambda v: torch.multinomial(_probabilities(v) + 0.1, 3), TAME, WILD),
    "multinomial with replacement": (lambda v: torch.multinomial(_probabilities(v), 6, True), TAME, WILD),
    "normal with tensor means and deviations": (lambda v: torch.normal(v, v.abs()), TAME, WILD),
    "normal with tensor means": (lambda v: torch.normal(v.t(), 2.0), TAME, WILD),
    "dropout": (lambda v: torch.nn.functional.dropout(v, 0.3), TAME, WILD),
    "randn_like": (lambda v: torch.randn_like(v), TAME, WILD),
    "randint_like with a number high": (lambda v: torch.randint_like(v.long(), 1 << 30), TAME, WILD),
}
#: Their counts depend on values: other counts on the two inputs.
VALUE_DEPENDENT_CALLS: dict[str, CatalogueCase] = {
    "rrelu in training": (lambda v: torch.nn.functional.rrelu(v, training=True), TAME, WILD),
    "rrelu in training, in place": (
        lambda v: torch.nn.functional.rrelu(v.clone(), training=True, inplace=True),
        TAME,
        WILD,
    ),
    "poisson": (lambda v: torch.poisson(v.abs()), TAME, WILD),
    "binomial": (lambda v: torch.binomial(v.abs().round(), torch.full_like(v, 0.3)), TAME, WILD),
    "gamma sampling": (lambda v: torch.distributions.Gamma(v.abs() + 0.1, 1.0).sample(), TAME, WILD),
    "Dirichlet sampling": (lambda v: torch.distributions.Dirichlet(v.abs() + 0.1).sample(), TAME, WILD),
    "randint_like with a tensor high": (  # from 2^28 on, two outputs an element
        lambda v: torch.randint_like(v.long(), torch.tensor(10 if bool(v.max() < 1) else 1 << 30)),
        TAME,
        WILD,
    ),
}


@pytest.mark.parametrize("case", SIZE_ONLY_CALLS)
def test_the_catalogue_knows_the_random_operations_whose_counts_depend_on_sizes_only(case: str) -> None:
    call, tame, wild = SIZE_ONLY_CALLS[case]
    (taken, ran), (other, ran_again) = outputs_taken(lambda: call(tame)), outputs_taken(lambda: call(wild))
    assert taken == other
    assert ran == ran_again
    assert not [op for op in ran if draws.count_depends_on_values(op)]


@pytest.mark.parametrize("case", VALUE_DEPENDENT_CALLS)
def test_the_catalogue_knows_the_random_operations_whose_counts_depend_on_values(case: str) -> None:
    call, tame, wild = VALUE_DEPENDENT_CALLS[case]
    (taken, ran), (other, _) = outputs_taken(lambda: call(tame)), outputs_taken(lambda: call(wild))
    assert taken != other
    assert ran
    assert all(draws.count_depends_on_values(op) for op in ran)


def test_every_random_operator_of_this_torch_is_in_the_catalogue() -> None:
    # A torch release adding one fails here: classify it (module docstring of draws), measuring its counts above.
    # (A misspelt name in the catalogue leaves the operator it means out, and fails here too.)
    names = {schema.name.removeprefix("aten::") for schema in torch._C._jit_get_all_schemas()}
    random = set()
    for name in names:
        packet = getattr(aten, name, None)
        if packet is not None and any(
            torch.Tag.nondeterministic_seeded in getattr(packet, overload).tags for overload in packet.overloads()
        ):
            random.add(name)
    catalogued = draws.SIZE_ONLY | {name.partition(".")[0] for name in draws.VALUE_DEPENDENT}
    assert sorted(random - catalogued) == []


def test_an_operator_the_catalogue_does_not_know_is_taken_to_depend_on_values() -> None:
    assert not draws.SIZE_ONLY & {name.partition(".")[0] for name in draws.VALUE_DEPENDENT}
    for unknown in (aten.rrelu_with_noise_backward.default, torch.rand, lambda tensor: tensor):
        assert draws.count_depends_on_values(unknown)


def test_a_model_that_disagrees_with_torch_on_this_machine_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    # as if bernoulli_ took one output per element here (it takes two): the check against torch must refuse it
    monkeypatch.setattr(draws, "_CHECKED", {})
    real = draws._variants

    def off_by_one(call: draws._Call) -> list[draws._Variant]:
        return [(kind, per_draw - 1, tail) for kind, per_draw, tail in real(call)]

    monkeypatch.setattr(draws, "_variants", off_by_one)
    assert draws.pattern(aten.bernoulli_.float, (torch.zeros(100), 0.5), {}) is None
    monkeypatch.setattr(draws, "_variants", real)
    monkeypatch.setattr(draws, "_CHECKED", {})
    assert draws.pattern(aten.bernoulli_.float, (torch.zeros(100), 0.5), {}) is not None


@pytest.mark.parametrize("op", IN_PLACE)
def test_an_empty_tensor_consumes_no_output_and_leaves_the_state_as_it_was(op: str) -> None:
    case = IN_PLACE[op]
    tensor = torch.zeros(0, 3)
    generator = torch.Generator()
    state = start_state(5, cached_normal=True)
    check_every_range(
        case.op, (tensor, *case.parameters), {"generator": generator},
        lambda: case.op(tensor, *case.parameters, generator=generator),  # type: ignore[operator]
        state, generator.set_state, generator.get_state,
    )  # fmt: skip
    model = draws.pattern(case.op, (tensor, *case.parameters), {})
    assert model is not None
    assert model.outputs(state) == 0
    assert torch.equal(model.state_after(state), state)


def test_a_meta_tensor_stands_for_a_cpu_one_of_its_shape_strides_and_dtype() -> None:
    meta = torch.empty(40, 33, device="meta").t()
    model = draws.pattern(aten.normal_.default, (meta,), {})
    assert model is not None
    state = start_state(5)
    real = transposed(33, 40, torch.float32)
    real.normal_(generator=generator_at(state))
    assert same_bits(model.draw(state, 0, model.numel), in_memory_order(real))


# --- threads, long jumps, random sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["uniform_", "normal_", "bernoulli_", "random_"])
def test_results_do_not_depend_on_the_number_of_intra_op_threads(op: str) -> None:
    case = IN_PLACE[op]
    tensor = torch.zeros(700, 500)  # well past the kernels' parallel grain sizes
    model = draws.pattern(case.op, (tensor, *case.parameters), {})
    assert model is not None
    state = start_state(11)
    generator = generator_at(state)
    torch.set_num_threads(2)
    case.op(tensor, *case.parameters, generator=generator)  # type: ignore[operator]
    torch.set_num_threads(1)  # the model draws with one thread
    assert torch.equal(model.state_after(state), generator.get_state())
    for start, stop in [(0, 5), (123_456, 200_001), (349_990, 350_000)]:
        assert same_bits(model.draw(state, start, stop), tensor.flatten()[start:stop])


@pytest.mark.parametrize("op", ["uniform_", "normal_"])
def test_a_range_millions_of_outputs_in_is_reached_by_a_polynomial_jump_and_drawn_exactly(op: str) -> None:
    case = IN_PLACE[op]
    tensor = torch.zeros(6_000_003)  # past mt19937.DRAWING_CROSSOVER
    model = draws.pattern(case.op, (tensor, *case.parameters), {})
    assert model is not None
    state = start_state(300)
    generator = generator_at(state)
    case.op(tensor, *case.parameters, generator=generator)  # type: ignore[operator]
    assert same_bits(model.draw(state, 5_999_980, 6_000_003), tensor[5_999_980:])
    assert torch.equal(model.state_after(state), generator.get_state())


@settings(max_examples=60, deadline=None)
@given(
    op=st.sampled_from(["uniform_", "normal_", "bernoulli_", "log_normal_", "random_ from to"]),
    dtype=st.sampled_from(FLOATS),
    numel=st.integers(1, 2500),
    transpose=st.booleans(),
    drawn=st.integers(0, 1300),
    cached=st.booleans(),
    bounds=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_any_range_of_any_size_from_any_state_is_the_slice_of_the_whole_result(
    op: str, dtype: torch.dtype, numel: int, transpose: bool, drawn: int, cached: bool, bounds: tuple[float, float]
) -> None:
    case = IN_PLACE[op]
    rows = next(r for r in (7, 5, 3, 2, 1) if numel % r == 0)
    tensor = transposed(rows, numel // rows, dtype) if transpose else torch.zeros(numel, dtype=dtype)
    model = draws.pattern(case.op, (tensor, *case.parameters), {})
    assert model is not None
    state = start_state(drawn, cached)
    generator = generator_at(state)
    case.op(tensor, *case.parameters, generator=generator)  # type: ignore[operator]
    full = in_memory_order(tensor)
    start, stop = sorted(round(b * numel) for b in bounds)
    assert same_bits(model.draw(state, start, stop), full[start:stop])
    assert torch.equal(model.state_after(state), generator.get_state())


# --- the interface ---------------------------------------------------------------------------------------------------


def test_outputs_read_are_the_outputs_a_range_depends_on() -> None:
    model = draws.pattern(aten.normal_.default, (torch.zeros(50),), {})  # blocks 0-2, then 16 redrawn from 50 on
    assert model is not None
    state = start_state(0)
    assert model.outputs(state) == 66
    assert model.outputs_read(state, 0, 1) == (range(16),)
    assert model.outputs_read(state, 17, 33) == (range(16, 48),)
    assert model.outputs_read(state, 33, 35) == (range(32, 48), range(50, 66))
    assert model.outputs_read(state, 34, 50) == (range(50, 66),)
    pairs = draws.pattern(aten.normal_.default, (torch.zeros(7),), {})
    assert pairs is not None
    assert pairs.outputs_read(state, 2, 5) == (range(4, 12),)
    cached = start_state(0, cached_normal=True)
    assert pairs.outputs(cached) == 12
    assert pairs.outputs_read(cached, 0, 1) == ()
    assert pairs.outputs_read(cached, 0, 3) == (range(4),)


@pytest.mark.parametrize(("start", "stop"), [(-1, 3), (3, 2), (0, 11)])
def test_a_range_outside_the_result_is_refused_with_a_value_error(start: int, stop: int) -> None:
    model = draws.pattern(aten.uniform_.default, (torch.zeros(10),), {})
    assert model is not None
    with pytest.raises(ValueError, match=r"the range is not within the result of 10 elements") as raised:
        model.draw(start_state(0), start, stop)
    assert f"got: start={start}, stop={stop}" in str(raised.value)


def test_drawing_leaves_the_state_it_is_given_as_it_was() -> None:
    model = draws.pattern(aten.normal_.default, (torch.zeros(7),), {})
    assert model is not None
    state = start_state(3, cached_normal=True)
    kept = state.clone()
    model.draw(state, 0, 7)
    model.state_after(state)
    assert torch.equal(state, kept)
