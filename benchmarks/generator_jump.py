"""What jumping torch's CPU generator ahead costs (``modattrs._deferred.rng.mt19937``), against drawing.

Run with ``python benchmarks/generator_jump.py`` (about 5 minutes on a 2-core machine; needs ``transformers``, which
``benchmarks/shard_local.py`` imports), or ``--quick`` (about 2 minutes: the replay on a model of about 50M
parameters), ``--replay-only`` for the replay alone. For jumps of ``k`` outputs from a state in mid-block it prints the
cost of a polynomial jump to a fresh distance (``x^M mod p`` computed: the cache of powers emptied before each
run) and to a repeated one (the power cached), with the C routines of ``modattrs._generator_jump`` and with the torch
path that runs without them, each as a ratio against drawing 1M outputs (``advance_by_drawing``) in the same process
and in milliseconds: the best and the median of the runs, CPU time of the measuring thread
(``time.thread_time``), with ``torch.set_num_threads(1)``. Then, for distances around ``DRAWING_CROSSOVER`` and
beyond, drawing against jumping; with the C routines, each of their methods alone. Every jump is checked to give the
state drawing gives (beyond 2^23 outputs, the C routines' state the torch path's).

Then each method of the C routines on a replay, where a method's gain has to show: ranks of ``shard_local.py``'s
plain-torch decoder (FSDP2 shard-local materialization at world sizes 8 and 64, the middle rank, which jumps over
the rows before and after its own in every parameter), built and sharded as there, the jumps' cache of powers
emptied before each timed materialization as in a rank's own process, the sums (``mt19937_twisted``) bound to each
of their methods in turn (a method, as the routine itself, takes ``words`` for a power of few terms; the power has
one method). It prints the best of the runs (their order rotated from run to run) of the materialization's CPU time
(``time.process_time``) as a ratio against the portable method, ``words``, and the CPU time spent in each C
routine, and checks each rank's shards and the generator's end state against eager construction. Timings are
printed, never asserted; ``docs/benchmarks.rst`` says which methods were kept, and why.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
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
    """The C routines on their own: ``mt19937_twisted`` by each method with a far jump's power (10^6 outputs, about
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
    best, median = times_ms(partial(speedups.mt19937_power_of_x, exponent, mt19937._P_PACKED))
    per_bit = f"{best / 50 * 1e3:.2f} / {median / 50 * 1e3:.2f} us"
    print(f"mt19937_power_of_x per bit of the exponent, best and median: {per_bit}")


class Bound:
    """``modattrs._generator_jump`` with its sums bound to one method; it lists only the portable method and that
    one, so the first-use check compares them, and it adds up the CPU time spent in each routine."""

    def __init__(self, twist: str) -> None:
        speedups = mt19937._speedups
        assert speedups is not None
        self.module, self.twist = speedups, twist
        self.power_s = self.twist_s = 0.0

    def mt19937_methods(self) -> dict[str, tuple[str, ...]]:
        return {mt19937._TWISTED: tuple(dict.fromkeys((mt19937._PORTABLE[mt19937._TWISTED], self.twist)))}

    def mt19937_power_of_x(self, exponent: bytes, modulus: bytes) -> bytes:
        start = time.thread_time()
        try:
            packed: bytes = self.module.mt19937_power_of_x(exponent, modulus)
            return packed
        finally:
            self.power_s += time.thread_time() - start

    def mt19937_twisted(self, array: memoryview, coefficients: bytes, method: str | None = None) -> None:
        if method is None:  # the routine's own choice, as the C file makes it: words for a power of few terms
            ones = int.from_bytes(coefficients, "little").bit_count()
            method = "words" if ones < mt19937._WORDS_BELOW.get(self.twist, 0) else self.twist
        start = time.thread_time()
        try:
            self.module.mt19937_twisted(array, coefficients, method)
        finally:
            self.twist_s += time.thread_time() - start


@contextlib.contextmanager
def routines(bound: Bound) -> Iterator[None]:
    kept = mt19937._speedups
    mt19937._speedups = bound  # type: ignore[assignment]
    try:
        yield
    finally:
        mt19937._speedups = kept


def configurations() -> dict[str, Bound]:
    """The routines bound to each method of the sums this CPU has, the portable one first."""
    speedups = mt19937._speedups
    assert speedups is not None
    return {f"twisted by {twist}": Bound(twist) for twist in speedups.mt19937_methods()[mt19937._TWISTED]}


def replay_by_method(quick: bool, runs: int) -> None:
    """Each method on ranks' shard-local replays (module docstring)."""
    import shard_local

    dims = shard_local.QUICK if quick else shard_local.FULL
    subject = shard_local.subjects(dims)["plain"]
    eager_s, eager, eager_state = shard_local.eager_construction(subject)
    parameters = sum(p.numel() for p in eager.parameters())
    print(
        f"\nreplay: FSDP2 shard-local materialization of {subject.label}, {parameters / 1e6:.0f}M float32 parameters "
        f"({dims.describe()}), one torch thread; eager construction {eager_s:.3f} s; best of {runs} runs, CPU time"
    )
    chosen = configurations()
    for world_size in (8, 64):
        rank = world_size // 2
        best = dict.fromkeys(chosen, math.inf)
        in_power, in_twist = dict.fromkeys(chosen, math.inf), dict.fromkeys(chosen, math.inf)
        problems: list[str] = []
        with shard_local.fake_group(rank, world_size) as mesh, shard_local.one_thread():
            shard_local.warm_up(mesh)
            for bound in chosen.values():  # each method's first-use check, outside the measure
                with routines(bound):
                    mt19937._checked_method(bound, mt19937._TWISTED)
            names = list(chosen)
            for run in range(runs):
                for name in names[run % len(names) :] + names[: run % len(names)]:
                    bound = chosen[name]
                    model = shard_local.shard_deferred(subject, mesh)
                    shard_local.as_in_a_fresh_process()
                    bound.power_s = bound.twist_s = 0.0
                    with routines(bound):
                        start = time.process_time()
                        shard_local.materialize_sharded(model)
                        seconds = time.process_time() - start
                    best[name] = min(best[name], seconds)
                    in_power[name] = min(in_power[name], bound.power_s)
                    in_twist[name] = min(in_twist[name], bound.twist_s)
                    if run == 0:
                        found = shard_local.differences(model, eager, eager_state, rank, world_size)
                        problems += [f"{name}: {difference}" for difference in found]
                    del model
        baseline = next(iter(best.values()))
        print(f"world size {world_size}, rank {rank}, load average {os.getloadavg()[0]:.2f}:")
        print(f"  {'methods':<32}{'replay':>20}{'of it in power_of_x':>22}{'in twisted':>14}")
        for name in chosen:
            print(
                f"  {name:<32}{best[name] / baseline:7.3f}x {best[name] * 1e3:8.1f} ms"
                f"{in_power[name] * 1e3:16.2f} ms{in_twist[name] * 1e3:11.2f} ms"
            )
        print("  values identical to eager construction's" if not problems else "  FAILED: " + "; ".join(problems))


def cpu_model() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return "CPU unknown (no lscpu)"
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    flags = set(fields.get("Flags", "").split())
    features = [f for f in ("pclmulqdq", "avx2", "vpclmulqdq", "avx512f") if f in flags]
    return f"{fields.get('Model name', '?').strip()}, with {', '.join(features) or 'none of the features'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the replay on a model of about 50M parameters")
    parser.add_argument("--replay-only", action="store_true", help="the methods on a replay alone")
    parser.add_argument("--runs", type=int, help="timed materializations per method (best kept)")
    arguments = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}")
    if not arguments.replay_only:
        micro_benchmarks()
    if mt19937._speedups is not None:
        replay_by_method(arguments.quick, arguments.runs or (7 if arguments.quick else 5))
    else:
        print("the C routines are not built: no methods to measure on a replay")


def micro_benchmarks() -> None:
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
