"""One large random operation filled by several threads, against the whole operation on one thread.

Run with ``python benchmarks/parallel_draws.py``. For ``normal_`` and ``uniform_`` on contiguous float32 tensors of
20M and 100M elements it prints the wall-clock time of ``Pattern.draw_into`` with 1 and 2 threads as a ratio against
the baseline, the operation run whole on one thread as eager code runs it (``torch.set_num_threads(1)``: torch's
random kernels draw serially anyway), measured alternately in the same process (medians); then the CPU time the
process spent, as a ratio against the baseline's. Every result and state after is checked to equal the baseline's,
bit for bit. The speedup needs idle cores: on a machine that other jobs keep busy it is smaller. So each line also
gives the ceiling: the two halves of the operation, each from a generator of its own (no jump, other values), on
2 threads at once against the whole on one; and what 2 threads would give with 2 idle cores, from CPU times of the
calling thread alone (``time.thread_time``): the baseline against the longer of the first range's kernel and the
second range's jump and kernel.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch

from modattrs._deferred.rng import draws
from modattrs._deferred.rng.mt19937 import jumped_state

RUNS = 7
aten = torch.ops.aten
_Op = Callable[..., object]


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU time of one call, in seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def eager(op: _Op, tensor: torch.Tensor, state: torch.Tensor, after: torch.Generator) -> None:
    after.set_state(state)
    op(tensor, generator=after)


def split(pattern: draws.Pattern, out: torch.Tensor, state: torch.Tensor, threads: int, expected: torch.Tensor) -> None:
    if not torch.equal(pattern.draw_into(out, state, threads), expected):
        raise AssertionError(f"draw_into on {threads} threads left another state than the operation")


def halves(op: _Op, tensor: torch.Tensor, pool: ThreadPoolExecutor) -> None:
    half = tensor.numel() // 2
    other = pool.submit(op, tensor[half:], generator=torch.Generator())
    op(tensor[:half], generator=torch.Generator())
    other.result()


def medians(runs: dict[str, Callable[[], object]]) -> dict[str, tuple[float, float]]:
    """Median wall-clock and CPU times of each function, their runs alternating."""
    for fn in runs.values():
        fn()  # warm up: the first jump builds the polynomial tables, the first range starts a thread
    times: dict[str, list[tuple[float, float]]] = {key: [] for key in runs}
    for _ in range(RUNS):
        for key, fn in runs.items():
            times[key].append(timed(fn))
    return {key: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for key, t in times.items()}


def thread_ms(fn: Callable[[], object]) -> float:
    """Median CPU time of the calling thread for one call, in milliseconds."""
    fn()
    runs = []
    for _ in range(RUNS):
        start = time.thread_time()
        fn()
        runs.append(time.thread_time() - start)
    return statistics.median(runs) * 1e3


def idle_cores(op: _Op, pattern: draws.Pattern, out: torch.Tensor, state: torch.Tensor) -> float:
    """How much faster 2 threads would be than 1 with 2 idle cores, from CPU times of each part on its own."""
    bounds = pattern._boundaries(state, 2, draws.JUMP_COST)
    if len(bounds) != 3:
        return 1.0
    cut = bounds[1]
    whole = thread_ms(lambda: op(out, generator=torch.Generator()))
    first = thread_ms(lambda: op(out[:cut], generator=torch.Generator()))
    second = thread_ms(lambda: jumped_state(state, cut)) + thread_ms(lambda: op(out[cut:], generator=torch.Generator()))
    return whole / max(first, second)


def main() -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    seeded = torch.Generator()
    seeded.manual_seed(0)
    torch.empty(7).uniform_(generator=seeded)  # a state in mid-block
    state = seeded.get_state()
    with ThreadPoolExecutor(max_workers=1) as pool:
        for numel in (20_000_000, 100_000_000):
            reference, out = torch.empty(numel), torch.empty(numel)
            for name, op in (("normal_", aten.normal_.default), ("uniform_", aten.uniform_.default)):
                pattern = draws.pattern(op, (out,), {})
                assert pattern is not None
                after = torch.Generator()
                eager(op, reference, state, after)
                expected = after.get_state()
                runs: dict[str, Callable[[], object]] = {
                    "eager": partial(eager, op, reference, state, after),
                    "halves": partial(halves, op, out, pool),
                    "1": partial(split, pattern, out, state, 1, expected),
                    "2": partial(split, pattern, out, state, 2, expected),
                }
                times = medians(runs)
                for threads in ("1", "2"):
                    runs[threads]()
                    if not torch.equal(out.view(torch.int32), reference.view(torch.int32)):
                        raise AssertionError(f"draw_into on {threads} threads wrote other values than {name}")
                projected = idle_cores(op, pattern, out, state)
                base_wall, base_cpu = times["eager"]
                line = f"{name:<9}{numel / 1e6:>4.0f}M: eager {base_wall * 1e3:6.1f} ms; 2 halves at once (ceiling) "
                line += f"{base_wall / times['halves'][0]:4.2f}x as fast"
                for threads in ("1", "2"):
                    wall, cpu = times[threads]
                    line += f"; {threads} thread{'s' if threads != '1' else ''} {wall * 1e3:6.1f} ms = "
                    line += f"{base_wall / wall:4.2f}x as fast, {cpu / base_cpu:4.2f}x the CPU"
                print(f"{line}; with 2 idle cores 2 threads would be {projected:4.2f}x as fast")
            del reference, out


if __name__ == "__main__":
    main()
