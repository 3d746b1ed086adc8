"""Each method of the jump's C routines is checked where it runs: at its first use in a process, against the portable
method, on a jump long enough to reach its vector loops. One that disagrees is not used again, with a warning, and
replays keep eager construction's values (see Note [Each jump method checked where it runs] in mt19937)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from modattrs._deferred.rng import mt19937
from modattrs.deferred import deferred_init, materialize_module


class Wrong:
    """The C routines with the best method of the sums (``mt19937_twisted``, the one routine with methods to choose
    from) made wrong: one bit of what it returns flipped."""

    def __init__(self) -> None:
        if mt19937._speedups is None:
            pytest.skip("modattrs._generator_jump is not built in this install")
        self.module = mt19937._speedups
        self.method = self.module.mt19937_methods()["twisted"][-1]
        if self.method == mt19937._PORTABLE["twisted"]:
            pytest.skip("this CPU runs mt19937_twisted by its portable method only")
        self.wrong_calls = 0

    def mt19937_methods(self) -> dict[str, tuple[str, ...]]:
        return self.module.mt19937_methods()

    def mt19937_twisted(self, array: memoryview, coefficients: bytes, method: str | None = None) -> None:
        self.module.mt19937_twisted(array, coefficients, method)
        if self._uses_wrong(method, coefficients):
            array[56] ^= 1  # bit 0 of word 7

    def mt19937_power_of_x(self, exponent: bytes, modulus: bytes) -> bytes:
        return self.module.mt19937_power_of_x(exponent, modulus)

    def _uses_wrong(self, method: str | None, coefficients: bytes) -> bool:
        if method is None:  # the routine's own choice: its best method, or words for a power of few terms
            ones = int.from_bytes(coefficients, "little").bit_count()
            method = self.method if ones >= mt19937._WORDS_BELOW[self.method] else "words"
        wrong = method == self.method
        self.wrong_calls += wrong
        return wrong


@contextlib.contextmanager
def routines(replacement: object) -> Iterator[None]:
    """``mt19937``'s C routines replaced for the block, checked afresh, with no power cached before or after."""
    kept = mt19937._speedups
    mt19937._speedups = replacement  # type: ignore[assignment]
    mt19937._powers.clear()
    mt19937.forget_checked_methods()
    try:
        yield
    finally:
        mt19937._speedups = kept
        mt19937._powers.clear()
        mt19937.forget_checked_methods()


class Model(nn.Module):
    """Far jumps (past the embedding's 320,000 draws) to the last layer: a dense power, every method's loops."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5000, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))


def test_a_jump_method_that_disagrees_with_the_portable_one_is_disabled_with_one_warning_and_replays_stay_eagers() -> (
    None
):
    wrong = Wrong()
    torch.manual_seed(0)
    expected = Model()
    after_eager = torch.default_generator.get_state()
    torch.manual_seed(0)
    model = deferred_init(Model)
    with routines(wrong), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        materialize_module(model.layers[2])  # jumps over the embedding and two layers
        materialize_module(model.layers[1])
        materialize_module(model)
    messages = [str(warning.message) for warning in caught if issubclass(warning.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "mt19937_twisted" in messages[0]
    assert repr(wrong.method) in messages[0]
    assert wrong.wrong_calls == 1  # in the check only
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected.state_dict()[name]), name
    assert torch.equal(torch.default_generator.get_state(), after_eager)


def test_every_method_this_cpu_has_agrees_with_the_portable_one() -> None:
    if mt19937._speedups is None:
        pytest.skip("modattrs._generator_jump is not built in this install")
    speedups = mt19937._speedups
    with routines(speedups), warnings.catch_warnings():
        warnings.simplefilter("error")
        for method in speedups.mt19937_methods()["twisted"]:
            with mt19937._checking:
                assert mt19937._agrees(speedups, "twisted", method), method
        assert mt19937._checked_method(speedups, "twisted").name == speedups.mt19937_methods()["twisted"][-1]
