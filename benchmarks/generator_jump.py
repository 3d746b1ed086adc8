"""What jumping torch's CPU generator ahead costs (``modattrs._deferred.rng.mt19937``), against drawing.

Run with ``python benchmarks/generator_jump.py``. For jumps of ``k`` outputs from a state in mid-block it prints the
cost of a polynomial jump to a fresh distance (``x^M mod p`` computed: the cache of powers emptied before each
run) and to a repeated one (the power cached), with the C routines of ``modattrs._speedups`` and with the torch
path that runs without them, each as a ratio against drawing 1M outputs (``advance_by_drawing``) in the same process
and in milliseconds: the best and the median of the runs, CPU time of the measuring thread
(``time.thread_time``), with ``torch.set_num_threads(1)``. Then, for distances around ``DRAWING_CROSSOVER`` and
beyond, drawing against jumping; with the C routines, each of their methods alone. Every jump is checked to give the
state drawing gives (beyond 2^23 outputs, the C routines' state the torch path's).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from modattrs._deferred.rng import mt19937

RUNS = 9
DISTANCES = {"1e5": 10**5, "1e6": 10**6, "2^23": 2**23, "2^32": 2**32, "2^64": 2**64}


def times_ms(fn: Callable[[], object], before: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """Best and median CPU time of ``fn`` in milliseconds, ``before`` run untimed ahead of each call."""
    before()
    fn()  # warm up
    runs = []
    for _ in range(RUNS):
        before()
        start = time.thread_time()
        fn()
        runs.append(time.thread_time() - start)
    return min(runs) * 1e3, statistics.median(runs) * 1e3


def jump_ms(state: torch.Tensor, outputs: int, compiled: bool, fresh: bool) -> tuple[float, float]:
    speedups = mt19937._speedups
    mt19937._speedups = speedups if compiled else None
    try:
        mt19937.forget_powers()
        return times_ms(
            lambda: mt19937.advance_by_polynomial(state, outputs), mt19937.forget_powers if fresh else lambda: None
        )
    finally:
        mt19937._speedups = speedups
        mt19937.forget_powers()


def c_routines_alone(state: torch.Tensor) -> None:
    """Each method of the C routines on its own: ``mt19937_twisted`` with a far jump's power (10^6 outputs, about
    10,000 ones) and a short one's (4 blocks, one), ``mt19937_power_of_x`` per bit of a 64-bit exponent."""
    speedups = mt19937._speedups
    assert speedups is not None
    methods = speedups.mt19937_methods()
    array = bytearray(bytes(state[24 : 24 + 624 * 8].tolist()))
    powers = {name: mt19937._coefficients(624 * blocks - 1) for name, blocks in (("far", 1603), ("4 blocks", 4))}
    print("C routines alone: mt19937_twisted by method (the default last), best and median")
    for method in methods["twisted"]:
        cells = []
        for name, coefficients in powers.items():
            best, median = times_ms(partial(speedups.mt19937_twisted, array, coefficients, method))
            cells.append(f"{name}: {best:6.3f} / {median:6.3f} ms")
        print(f"  {method:<10} " + ", ".join(cells))
    exponent = (2**64 - 59).to_bytes(8, "big")  # 50 bits past the top 14, which need no squaring
    print("mt19937_power_of_x by method (the default last), per bit of the exponent, best and median")
    for method in methods["power_of_x"]:
        best, median = times_ms(partial(speedups.mt19937_power_of_x, exponent, mt19937._P_PACKED, method))
        print(f"  {method:<16} {best / 50 * 1e3:6.2f} / {median / 50 * 1e3:6.2f} us")


def main() -> None:
    torch.set_num_threads(1)
    compiled = mt19937._speedups is not None
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    built = "built" if compiled else "NOT built (only the torch path runs)"
    print(f"C routines {built}; DRAWING_CROSSOVER = {mt19937.DRAWING_CROSSOVER:,}")
    generator = torch.Generator()
    generator.manual_seed(0)
    torch.empty(7).uniform_(generator=generator)  # a state in mid-block
    state = generator.get_state()
    for outputs in DISTANCES.values():
        if outputs <= 2**23:  # drawing is the reference; beyond that, jumps are checked against each other
            expected = mt19937.advance_by_drawing(state, outputs)
        for use_c in (True, False) if compiled else (False,):
            mt19937._speedups, kept = (mt19937._speedups if use_c else None), mt19937._speedups
            try:
                mt19937.forget_powers()
                jumped = mt19937.advance_by_polynomial(state, outputs)
            finally:
                mt19937._speedups = kept
            if outputs <= 2**23 and not torch.equal(jumped, expected):
                raise AssertionError(f"a jump of {outputs} outputs gave another state than drawing")
            if outputs > 2**23 and use_c:
                expected = jumped
            elif outputs > 2**23 and not torch.equal(jumped, expected):
                raise AssertionError(f"a jump of {outputs} outputs gave another state in C than in torch")
    best, median = times_ms(lambda: mt19937.advance_by_drawing(state, 10**6))
    print(f"drawing 1M outputs: best {best:.2f} ms, median {median:.2f} ms (the ratios' unit)")
    print(f"{'k':<6}{'jump':<30}{'best':>18}{'median':>18}")
    for name, outputs in DISTANCES.items():
        for use_c in (True, False) if compiled else (False,):
            for fresh in (True, False):
                label = f"{'C' if use_c else 'torch'}, {'fresh' if fresh else 'repeated'} distance"
                jump_best, jump_median = jump_ms(state, outputs, use_c, fresh)
                print(
                    f"{name:<6}{label:<30}{jump_best / best:7.3f}x {jump_best:7.2f} ms"
                    f"{jump_median / median:7.3f}x {jump_median:7.2f} ms"
                )
    if compiled:
        c_routines_alone(state)
    print(f"drawing against jumping ({'C' if compiled else 'torch'} path), medians:")
    crossover = mt19937.DRAWING_CROSSOVER
    around = {crossover // 2, crossover, 2 * crossover} if crossover else set()
    for outputs in sorted(around | {700, 2_000, 10**4, 10**5, 10**6}):  # from 618 outputs left in the block
        drawing = times_ms(partial(mt19937.advance_by_drawing, state, outputs))[1]
        fresh_ms = jump_ms(state, outputs, compiled, fresh=True)[1]
        repeated = jump_ms(state, outputs, compiled, fresh=False)[1]
        print(
            f"  {outputs:>10,} outputs: drawing {drawing:7.3f} ms, "
            f"jump {fresh_ms:7.3f} ms fresh, {repeated:7.3f} ms again"
        )


if __name__ == "__main__":
    main()
