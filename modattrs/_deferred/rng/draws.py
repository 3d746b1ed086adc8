"""Which outputs of torch's CPU generator each random operation reads, and any range of its result from them.

``pattern(op, args, kwargs)`` takes an aten operator overload as a replay sees it (``torch.ops.aten.uniform_.default``
and the like, with its arguments) and returns a ``Pattern``, or ``None`` when the operation is not modelled (the
caller then runs it as it is, drawing through it). A ``Pattern`` answers, for a generator state ``state`` as
``torch.Generator.get_state()`` returns it (the state right before the operation):

- ``outputs(state)``: how many 32-bit outputs the whole operation consumes;
- ``outputs_read(state, start, stop)``: which outputs (counted from the operation's first) elements ``start`` to
  ``stop - 1`` of the result depend on;
- ``draw(state, start, stop)``: those elements, bit for bit what the whole operation would put there, computed by
  jumping (``mt19937.jumped_state``) to the first output they need and running the same kernel on a scratch tensor
  just big enough, with a private generator (never the default one); ``uniform_`` on enough elements runs on
  modattrs' own kernel (``kernels``), which gives the same bits faster;
- ``state_after(state)``: the generator's state after the whole operation;
- ``draw_into(out, state, threads)``: the whole result written into ``out``, by up to ``threads`` threads at once
  (below), and the state after it.

Elements are counted in the result's memory order: the order of increasing storage offset, the order in which torch's
kernels fill them (``TensorIterator`` sorts the dimensions by stride, and the vectorized ``normal_`` path writes a
contiguous tensor front to back). For a contiguous result that is ``result.flatten()``; for a transposed weight, its
storage. Only layouts where that order is well defined are modelled: after dropping dimensions of size 1 and sorting
the rest by stride, each stride is at least the next one times its size (no overlap, no interleaving); gaps are fine.

Measured facts (torch 2.8.0+cu128, 2.13.0+cpu and 2.15.0+cu132 wheels on an x86-64 AMD EPYC with AVX-512; counted
by comparing the state after the operation with the state after ``k`` single outputs, and read in
``aten/src/ATen/native/cpu/DistributionTemplates.h``, ``DistributionKernels.cpp`` and
``aten/src/ATen/core/DistributionsHelper.h``). The three builds agree except where noted. ``k`` is the number of
outputs one element takes (one uniform, for the block path); a serial kernel fills the elements in memory order, and
element ``i`` reads outputs ``[k i, k i + k)``, whatever the layout.

- ``uniform_``, ``rand``, ``rand_like``: serial; ``k`` = 2 for float64 (a 53-bit draw), 1 for float32, float16 and
  bfloat16 (24, 11 and 8 bits of one output).
- ``random_()``: serial; ``k`` = 2 for int64 and float64, else 1.
- ``random_(from, to)``, ``random_(to)``, ``randint``, ``randint_like``: serial; ``k`` = 2 when the range is
  ``2^28`` or more, else 1, for every dtype (public builds; Meta's internal FBCODE builds use ``2^32`` and four
  dtypes, and are not modelled: the check finds them). On floating dtypes torch first moves ``from`` and ``to`` inside
  the dtype's exact integers (``update_from``, ``update_to``), so float32's threshold is ``to - from >= 2^28 + 1``;
  ``from = -2^63, to = None`` takes 64 bits (``k`` = 2).
- ``bernoulli_(p: float)``, ``exponential_``, ``cauchy_``, ``geometric_``: serial, ``k`` = 2 (one double uniform per
  element) whatever the dtype.
- ``normal_``, ``randn``, ``randn_like``, ``normal(mean, std, size)`` on a contiguous result of ``n >= 16``
  elements (``BLOCKS``): ``n`` uniforms are drawn, then each block of 16 (elements ``[16 b, 16 b + 16)``, element
  ``j`` paired with ``j + 8``) is transformed from its own outputs ``[16 k b, 16 k (b + 1))``; when ``n % 16 != 0``
  the last 16 elements ``[n - 16, n)`` are redrawn from 16 fresh uniforms, outputs ``[T, T + 16 k)``. ``k`` = 2 for
  float64, else 1. ``T = n k`` (float32 and float64 on all three builds, float16 and bfloat16 on 2.8), so the call
  takes ``n k + 16 k`` outputs; float16 and bfloat16 on 2.13 and 2.15 draw uniforms for the full blocks only and
  compute in float32: ``T = 16 k floor(n / 16)``, ``16 ceil(n / 16)`` outputs in all.
- ``normal_`` (and the factories above) on fewer than 16 elements or a non-contiguous result, and ``log_normal_``
  always (``PAIRS``): serial pairs. Each pair of elements takes two double uniforms (4 outputs); the first element
  gets ``r cos(theta)``, the second ``r sin(theta)``, which a lone last element leaves cached in the generator.
  ``4 ceil(m / 2)`` outputs, ``m`` being ``n`` less one when the state holds a cached normal (element 0 is then that
  normal).

Which of the two block variants a build uses is not read off its version: ``pattern`` checks the model against torch
once per kind of call and process (below), and takes the variant that agrees.

The cached normal: the scalar path draws normals with ``at::normal_distribution<double>``, which makes two per pair
of uniforms and keeps the second in the generator (``normal_y`` and ``normal_is_valid`` in the state, bytes 5,024
and 5,040); a call that finds one cached returns it first without drawing. So the number of outputs, and which
element reads which, depend on that flag of the state, and ``outputs`` takes the state. The block path neither reads
nor writes the cache; ``state_after`` sets it as torch does (a value when a pair was left half used, zeros when it
was used up).

Threads: every CPU random kernel above locks the generator and runs serially (``cpu_serial_kernel``, or the block
loops); results and states were measured equal with 1 and 2 intra-op threads on tensors of 300,300 elements (well
past the parallel grain sizes), on all three builds.

Filling in parallel: eager code draws a random operation on one core. ``draw_into`` splits the result, in memory
order, into ranges that threads fill at once, each from a private generator jumped to its range's first output, and
writes what the operation writes, bit for bit (torch's kernels release the GIL). Boundaries fall anywhere for
``SERIAL``, on blocks of 16 for ``BLOCKS`` (the last range begins on a block and holds the redrawn last 16: run on
that range, the kernel redraws them from the same outputs), on pairs for ``PAIRS`` (counting the cached normal as
element 0). ``SERIAL`` and ``BLOCKS`` ranges are drawn straight into ``out``'s memory, through views of it;
``PAIRS`` ones on scratch tensors on the scalar path, then copied in (a range of a non-contiguous result can be
contiguous, and the kernel would take the block path on it). Each range after the first pays for a jump, which costs
about what drawing ``JUMP_COST`` outputs costs (``mt19937.FAR_JUMP_COST``: 50,000 with the C extension on a CPU
with carry-less multiplication, 0.03 to 0.17 ms, 200,000 without it; 5M with the torch path alone, 11 to 15 ms;
against 2.2 to 4.2 ns an output), so the first range, which needs none, draws that many outputs more than each of
the others, and each of the others draws at least that many: below three times that (150,000 outputs with the
extension, 15M without) or with one thread the operation runs once, on
``out``. That threshold counts outputs,
not time, so it is conservative for kernels that spend more per output (``normal_``'s transforms, ``PAIRS``). The
threads are kept from call to call (a new thread's first jump costs about 90 ms more, setting up OpenMP and MKL) and
take torch's intra-op thread count (``benchmarks/parallel_draws.py`` measures what they gain:
``docs/benchmarks.rst``).

Not modelled (``pattern`` returns ``None``; the caller draws through the operation as today):

- operations not listed above: ``randperm``, ``multinomial``, ``bernoulli_`` with a tensor ``p``, ``bernoulli``,
  ``normal`` with tensor means or deviations, ``rand``/``randn`` with names, ``*_like`` with a layout other than
  contiguous or preserved dense strides, and whatever a user's init does itself (``orthogonal_`` and ``sparse_``
  are built from ``normal_``, ``randperm`` and linear algebra; each of their random calls is its own operation);
- tensors not on the CPU (or meta), complex, quantized or sparse ones, and dtypes outside float32, float64,
  float16, bfloat16, int8, int16, int32, int64, uint8 and bool (the unsigned 16- to 64-bit ones have no kernel);
- layouts whose memory order is not as above (overlapping or interleaved strides);
- arguments torch refuses (the caller's run raises torch's error), and a generator that is not a CPU one;
- any kind of call whose check against torch fails on this machine and build. Known case: on Intel CPUs, torch
  builds with MKL may compute ``bernoulli_(p)`` with MKL's own stream seeded by one output (some releases'
  ``bernoulli_scalar_kernel`` checks the CPU vendor; the builds above took the serial kernel on this AMD CPU). That
  kernel is not modelled, and the check finds it.

The check: the first time a process asks for a kind of call (the operation's kernel, dtype, path, outputs per element
and variant), ``pattern`` runs that kernel on a few small tensors (sizes chosen to hit every branch of the model:
1, 5 and 20 elements or transposed for serial kernels, 16, 37 and 48 for the block path, 5 or transposed, with and
without a cached normal, for the pairs) from a mid-block state, and compares every element and the state after with
what the model computes. A kind that disagrees is not modelled in that process. The check costs 2 to 7 ms per kind;
after it ``pattern`` costs 40 to 90 microseconds a call, most of it one run of the kernel on one scratch element,
which lets torch refuse the arguments it refuses. The test suite (``tests/test_random_draws.py``) checks the model on
many more sizes, layouts and ranges, on every torch build CI runs, so that a torch release changing a pattern fails a
test.

Draws are bit-identical to the operation run in the same process, whose kernel the scratch runs (which kernel that
is depends on the CPU's capabilities, so torch's own ``normal_`` values may differ between machines). All torch work
here (the scratch kernels, the check) must run outside fake or other dispatch modes, on real CPU tensors. ``self`` of
an in-place operation is only read for its shape, strides, dtype and device; a meta or fake tensor with the target's
metadata will do.

Two things ``nn.init`` does that a replay by ranges has to know (measured; each random operation they run is
modelled): ``trunc_normal_`` on torch 2.13 and 2.15 is rejection sampling (``normal_``, then ``normal_`` again
into a fresh tensor while any element is out of bounds; or ``uniform_`` candidates and acceptance draws when the
interval holds under 30% of the mass), so how many operations it runs depends on every element drawn so far (the
first kind is modelled as a whole by ``rejection``, on this module's ``normal_``); on 2.8 it is ``uniform_`` then
``erfinv_``, one operation. And ``sparse_`` (all three builds) ignores its ``generator`` for
``randperm``, which draws from the default generator (not modelled).

The catalogue: what decides how many outputs each random operation takes. A replay that reaches a draw it does
not model runs the operation on stand-ins (``record.scratch_arguments``: tensors of the recorded sizes, strides
and dtypes, holding ones), which takes what the real operation takes only when the count depends on nothing but
those and the operation's other arguments. ``SIZE_ONLY`` names the aten operators (every overload) for which that
holds in torch's CPU kernels, ``VALUE_DEPENDENT`` those for which it does not; ``count_depends_on_values`` answers
for any operator, and takes an operator in neither (a new one, a custom one, a Python function) to depend on values.
An operation whose count depends on the values of a fake tensor it reads is pinned by the recorder
(``Op.pinned``): every replay, and every computation of the generator's state at a point of the record, runs it on
the real values, never on stand-ins. Measured on 2.13 (counted as above, on inputs of one layout and different
values) and read in ``Distributions.cpp``, ``DistributionKernels.cpp``, ``Activation.cpp`` (``rrelu``) and
``Randperm.cpp``:

- size only: every operation modelled above, in all its overloads (``out=`` ones too: they write a tensor of the
  layout given, which the stand-in has); ``bernoulli`` with a tensor ``p`` (one draw per element whatever ``p``);
  ``normal`` with tensor means or deviations (a ``normal_`` of the result, then arithmetic); ``multinomial``
  (``exponential_`` of a tensor of the input's layout, or one double per sample with replacement; an input torch
  refuses raises before drawing); ``randperm`` (a function of ``n``); the dropouts (``bernoulli_`` masks); and the
  recurrent layers and attention, whose only draws are dropout masks (on the CPU and, read in their kernels, on
  GPUs; ``_fused_sdp_choice`` and ``_nested_tensor_softmax_with_shape`` draw nothing);
- value-dependent: ``rrelu_with_noise`` and the ``rrelu`` functions built on it (training: one double per element
  that is not positive), ``poisson``, ``binomial``, ``_standard_gamma`` and ``_sample_dirichlet`` (rejection
  sampling, whose count depends on the rates and on the numbers drawn), and ``randint_like`` with a tensor ``high``
  (whose value decides whether an element takes one output or two).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import struct
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final

import torch

from modattrs._deferred.ops import Signature, bind, facts_of
from modattrs._deferred.rng import kernels
from modattrs._deferred.rng.mt19937 import FAR_JUMP_COST, jumped_state
from modattrs._torch_private import CPU_STATE_NORMAL_CACHE, CPU_STATE_NORMAL_VALID, FakeTensor, contiguous_strides

__all__ = [
    "BLOCKS",
    "JUMP_COST",
    "PAIRS",
    "SERIAL",
    "SIZE_ONLY",
    "VALUE_DEPENDENT",
    "Pattern",
    "count_depends_on_values",
    "pattern",
    "same_bits",
    "workers",
]

#: Element ``i`` reads outputs ``[k i, k i + k)``.
SERIAL: Final = "serial"
#: The vectorized ``normal_`` path: blocks of 16 from 16 ``k`` outputs, the last 16 elements redrawn when needed.
BLOCKS: Final = "blocks"
#: The scalar ``normal_`` path: pairs of elements from 4 outputs, and the Box-Muller cache.
PAIRS: Final = "pairs"

_aten = torch.ops.aten
_Fill = Callable[[torch.Tensor, torch.Generator], object]
_Op = Callable[..., object]  # an aten operator overload

_FLOATS: Final = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_INTEGERS: Final = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool})
_DIGITS: Final = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}
#: dtypes ``random_(from, to)`` can fill over the full 64-bit range (``random_full_64_bits_range_kernel``)
_WIDE_RANDOM: Final = frozenset({torch.int64, torch.float64, torch.float32, torch.bfloat16})
_INT64_MIN: Final = -(1 << 63)
_INT64_MAX: Final = (1 << 63) - 1

# The Box-Muller cache in the state (native byte order): normal_x, normal_y, normal_rho (doubles), normal_is_valid.
_CACHE_START: Final = CPU_STATE_NORMAL_CACHE.start
_CACHE_VALID: Final = CPU_STATE_NORMAL_VALID.start
_CACHE_END: Final = CPU_STATE_NORMAL_CACHE.stop
_BLOCK: Final = 16

#: What a jump into a large result costs, counted in outputs drawn in that time (``mt19937.FAR_JUMP_COST``; short
#: jumps cost less, but a range's jump is far). ``Pattern.draw_into`` splits a result so that each range after the
#: first draws at least this many outputs (the module docstring has the measurements).
JUMP_COST: Final = FAR_JUMP_COST


@dataclass(frozen=True)
class Pattern:
    """How one random operation reads torch's CPU generator, and its result from any state.

    ``numel``, ``dtype``, ``shape`` and ``strides`` are the result's; ``kind`` is ``SERIAL``, ``BLOCKS`` or
    ``PAIRS``; ``per_draw`` the outputs one element (``SERIAL``) or one uniform (``BLOCKS``) takes, 4 for a pair
    (``PAIRS``); ``tail_output`` the first output of the redrawn last 16 elements (``BLOCKS`` with
    ``numel % 16 != 0``, else ``None``); ``fill`` the operation's kernel, run in place on a tensor with a generator.
    """

    op: _Op  # the overload asked about
    numel: int
    dtype: torch.dtype
    kind: str
    per_draw: int
    tail_output: int | None
    fill: _Fill  # the operation's kernel on a scratch tensor, with the given generator
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def outputs(self, state: torch.Tensor) -> int:
        """The 32-bit outputs the whole operation consumes from ``state`` (the state right before it)."""
        if self.kind == SERIAL:
            return self.per_draw * self.numel
        if self.kind == BLOCKS:
            return self.per_draw * self.numel if self.tail_output is None else self.tail_output + _BLOCK * self.per_draw
        return 4 * math.ceil(self._fresh(state) / 2)

    def outputs_read(self, state: torch.Tensor, start: int, stop: int) -> tuple[range, ...]:
        """The outputs, counted from the operation's first, that elements ``start`` to ``stop - 1`` depend on.

        Sorted, disjoint and not adjacent. A cached normal returned as element 0 (``PAIRS``) reads no output.
        """
        self._check_range(start, stop, "outputs_read")
        ranges: list[range] = []
        if start < stop:
            if self.kind == SERIAL:
                ranges.append(range(self.per_draw * start, self.per_draw * stop))
            elif self.kind == BLOCKS:
                end = min(stop, self._tail_begin)
                if start < end:
                    first, last = start // _BLOCK, -(-end // _BLOCK)
                    ranges.append(range(_BLOCK * self.per_draw * first, _BLOCK * self.per_draw * last))
                if stop > self._tail_begin and self.tail_output is not None:
                    ranges.append(range(self.tail_output, self.tail_output + _BLOCK * self.per_draw))
            else:
                cached = self._cached(state)
                first, last = max(start, cached) - cached, stop - cached
                if first < last:
                    ranges.append(range(4 * (first // 2), 4 * math.ceil(last / 2)))
        merged: list[range] = []
        for block in ranges:
            if merged and merged[-1].stop >= block.start:
                merged[-1] = range(merged[-1].start, max(merged[-1].stop, block.stop))
            else:
                merged.append(block)
        return tuple(merged)

    def draw(self, state: torch.Tensor, start: int, stop: int, *, ahead: int = 0) -> torch.Tensor:
        """Elements ``start`` to ``stop - 1`` (memory order) of the operation's result from ``state``, as a new 1-D
        tensor: bit for bit ``result_in_memory_order[start:stop]`` of the operation run from ``state``.

        Jumps to the first output those elements read and draws only what they need (at most 15 more elements at
        either end, for the block path); ``state`` is left as it was. ``ahead``: ``state`` is that many outputs
        before the operation's first, which the jump adds to its distance (one jump, not two).
        """
        return self.draw_with_end(state, start, stop, ahead=ahead)[0]

    def draw_with_end(
        self,
        state: torch.Tensor,
        start: int,
        stop: int,
        *,
        ahead: int = 0,
        out: torch.Tensor | None = None,
        behind: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """``draw``'s result, with where its last private generator stopped: its state, and how many outputs after
        the operation's first that is (``None, 0`` when nothing was drawn, and for ``PAIRS``, whose positions
        depend on the cached normal). A caller that goes on from there jumps a distance that repeats from one
        identical layer to the next (a jump whose power of x is known, see ``mt19937``), not from ``state``.

        ``out``: a real 1-D CPU tensor of ``stop - start`` adjacent elements of the pattern's dtype, written with
        the elements and returned (drawn into where the kernel's path allows, else copied) instead of a new one.

        ``behind``: ``state`` is that many outputs after the operation's first (where the draw of an earlier part
        stopped: the next part jumps the gap between them, a distance that repeats from one identical layer to the
        next), instead of ``ahead`` of it; the part must read no output before that (``SERIAL`` and ``BLOCKS``).
        """
        self._check_range(start, stop, "draw")
        for name, value in (("ahead", ahead), ("behind", behind)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"Pattern.draw: `{name}` must be a non-negative int (outputs), got {value!r}")
        read = self.outputs_read(state, start, stop)[:1] if behind else ()
        if behind and (ahead or self.kind == PAIRS or (read and read[0].start < behind)):
            first = read
            raise ValueError(
                "Pattern.draw: a part drawn from a state `behind` the operation's first output must read no output "
                "before that state, on a path without the Box-Muller cache, without `ahead`\n"
                f"  expected: its first output at or after {behind}, kind {SERIAL!r} or {BLOCKS!r}, ahead 0\n"
                f"  got:      {first[0].start if first else None}, kind {self.kind!r}, ahead {ahead}"
            )
        ahead -= behind  # the distance from `state` to the operation's first output, negative when past it
        if out is not None:
            self._check_draw_out(out, stop - start)
        parts: list[torch.Tensor] = []
        end: tuple[torch.Generator | None, int] = (None, 0)
        if start < stop and self.kind == SERIAL:
            scratch = torch.empty(stop - start, dtype=self.dtype, device="cpu") if out is None else out
            generator = _generator(jumped_state(state, ahead + self.per_draw * start))
            self.fill(scratch, generator)
            parts.append(scratch)
            end = generator, self.per_draw * stop
        elif start < stop and self.kind == BLOCKS:
            end = self._draw_blocks(state, start, stop, ahead, parts, out)
        elif start < stop:  # a jump keeps the cached normal, which element 0 may be: jumped first
            parts.extend(self._draw_pairs(jumped_state(state, ahead) if ahead else state, start, stop))
        if out is not None:
            taken = 0
            for part in parts:
                if part.data_ptr() != out.data_ptr() + taken * out.element_size():  # not drawn in place
                    out[taken : taken + part.numel()].copy_(part)
                taken += part.numel()
            values = out
        elif len(parts) == 1:
            values = parts[0]
        else:
            values = torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype, device="cpu")
        last, position = end
        return values, (None if last is None else last.get_state()), position

    def draw_runs(
        self, state: torch.Tensor, ahead: int, runs: Sequence[range], out: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor | None, int]:
        """Write elements ``runs`` (sorted, at least a block of 16 apart, each drawn from where the one before
        stopped, the gaps jumped) into ``out``, a real 1-D CPU tensor holding the result's elements from ``offset``
        on, from ``state``, ``ahead`` outputs before the operation's first; return where the last private generator
        stopped, as ``draw_with_end`` does."""
        end: torch.Tensor | None = state
        position = -ahead  # outputs after the operation's first: the generator is `ahead` outputs before it
        for run in runs:
            part = out[run.start - offset : run.stop - offset]
            assert end is not None
            if position < 0:
                _, end, position = self.draw_with_end(end, run.start, run.stop, ahead=-position, out=part)
            else:
                _, end, position = self.draw_with_end(end, run.start, run.stop, behind=position, out=part)
        return end, position

    def state_after(self, state: torch.Tensor) -> torch.Tensor:
        """The generator's state after the whole operation from ``state``: ``jumped_state(state, outputs)``, with the
        Box-Muller cache as the scalar ``normal_`` path leaves it (``PAIRS``)."""
        if self.kind != PAIRS or self.numel == 0:
            return jumped_state(state, self.outputs(state))
        fresh = self._fresh(state)
        if fresh == 0:  # the one element is the cached normal: drawing it uses the cache up and nothing else
            generator = _generator(state)
            self.fill(_pairs_scratch(1, self.dtype), generator)
            return generator.get_state()
        last_pair = (fresh - 1) // 2
        generator = _generator(_without_cached_normal(jumped_state(state, 4 * last_pair)))
        self.fill(_pairs_scratch(fresh - 2 * last_pair, self.dtype), generator)
        return generator.get_state()

    def draw_into(
        self, out: torch.Tensor, state: torch.Tensor, threads: int, *, jump_cost: int = JUMP_COST
    ) -> torch.Tensor:
        """Write into ``out`` what the whole operation writes there from ``state``, on up to ``threads`` threads,
        and return the generator's state after it (what ``state_after(state)`` gives).

        ``out`` is a real CPU tensor of the pattern's ``dtype``, ``shape`` and ``strides`` (those of dimensions of
        size 1 aside); its memory is written outside autograd, as ``nn.init`` writes under ``no_grad``. Neither
        ``state`` nor the default generator changes. Too few outputs for the threads (below) or ``threads=1``:
        the operation runs once, on ``out``, from ``state``, as eager code runs it. Else the elements, in memory
        order, are split into ranges, each filled in a thread of its own (the first in the calling thread) by a
        private generator jumped to the range's first output (``mt19937.jumped_state``): the kernel runs on the
        range's views of ``out`` (``SERIAL``, and ``BLOCKS`` whose ranges are whole blocks of 16 but the last, which
        starts on a block and holds the redrawn tail), or on a scratch tensor on the scalar path, copied into them
        (``PAIRS``, whose ranges begin on a pair). torch's kernels release the GIL while they run.

        How many ranges: a range after the first pays for a jump, about ``jump_cost`` outputs' worth of drawing
        (``JUMP_COST``), so the first range draws that many outputs more than each of the others, and each of the
        others draws at least that many (so below ``3 * jump_cost`` outputs there is one range); ``jump_cost=0``
        splits into ``threads`` ranges of equal size (as far as their boundaries allow), whatever the size. As for
        ``draw``, call it outside fake and other dispatch modes (the first range runs in the calling thread, the
        others in threads that have none, in the caller's inference mode).

        Raises ``TypeError`` or ``ValueError``, before writing anything, for an ``out`` that is not such a tensor and
        for a ``threads`` (``jump_cost``) that is not a positive (non-negative) int; torch's own error for a
        ``state`` it refuses.
        """
        for name, value, least in (("threads", threads, 1), ("jump_cost", jump_cost, 0)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Pattern.draw_into: `{name}` must be an int, got {value!r}")
            if value < least:
                raise ValueError(f"Pattern.draw_into: `{name}` must be at least {least}, got {value}")
        self._check_out(out)
        target = out.detach()  # worker threads run with grad mode on, whatever the caller's thread has
        first = _generator(state)  # torch refuses a bad state here, before anything is written
        bounds = self._boundaries(state, threads, jump_cost)
        if len(bounds) == 2:
            self.fill(target, first)
            return first.get_state()
        ranges = list(itertools.pairwise(bounds))
        pool = workers(len(ranges) - 1)
        inference = torch.is_inference_mode_enabled()  # thread-local: the workers take the caller's
        rest = [pool.submit(self._fill_range_in, inference, target, state, start, stop) for start, stop in ranges[1:]]
        try:
            self._fill_range(target, state, *ranges[0], first)
        finally:
            last = [future.result() for future in rest][-1]  # every range is written (or has raised) on return
        return last.get_state()

    # --- the three kinds ---------------------------------------------------------------------------------------------

    @property
    def _tail_begin(self) -> int:
        """The first element of the redrawn last 16 (``numel`` when nothing is redrawn)."""
        return self.numel if self.tail_output is None else self.numel - _BLOCK

    def _draw_blocks(
        self,
        state: torch.Tensor,
        start: int,
        stop: int,
        ahead: int,
        parts: list[torch.Tensor],
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Generator | None, int]:
        """Append the parts of elements ``start:stop``; return the last generator used and its position. The
        blocks are drawn into ``out`` when they are exactly its first elements."""
        generator: torch.Generator | None = None
        position = 0  # outputs consumed by `generator` since the operation's first
        end = min(stop, self._tail_begin)
        if start < end:
            first, last = start // _BLOCK, -(-end // _BLOCK)
            position = _BLOCK * self.per_draw * first
            generator = _generator(jumped_state(state, ahead + position))
            # whole blocks only, so that the scratch takes the block path without a tail of its own
            if out is not None and start == _BLOCK * first and end == _BLOCK * last:
                scratch = out[: end - start]
            else:
                scratch = torch.empty(_BLOCK * (last - first), dtype=self.dtype, device="cpu")
            self.fill(scratch, generator)
            position = _BLOCK * self.per_draw * last
            parts.append(scratch[start - _BLOCK * first : end - _BLOCK * first])
        if stop > self._tail_begin and self.tail_output is not None:
            if generator is None:  # from `state`; else from where the blocks ended, at most 32 k outputs before
                here = jumped_state(state, ahead + self.tail_output)
            else:
                here = jumped_state(generator.get_state(), self.tail_output - position)
            scratch = torch.empty(_BLOCK, dtype=self.dtype, device="cpu")
            generator = _generator(here)
            self.fill(scratch, generator)
            position = self.tail_output + _BLOCK * self.per_draw
            parts.append(scratch[max(start, self._tail_begin) - self._tail_begin : stop - self._tail_begin])
        return generator, position

    def _draw_pairs(self, state: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
        parts: list[torch.Tensor] = []
        cached = self._cached(state)
        if start < cached:  # element 0 is the cached normal, transformed by this operation's parameters
            scratch = _pairs_scratch(1, self.dtype)
            self.fill(scratch, _generator(state))
            parts.append(scratch.contiguous())
        first, last = max(start, cached) - cached, stop - cached  # among the freshly drawn elements
        if first < last:
            pair = first // 2
            generator = _generator(_without_cached_normal(jumped_state(state, 4 * pair)))
            scratch = _pairs_scratch(last - 2 * pair, self.dtype)
            self.fill(scratch, generator)
            parts.append(scratch[first - 2 * pair :].contiguous())
        return parts

    def _boundaries(self, state: torch.Tensor, threads: int, jump_cost: int) -> list[int]:
        """Where ``draw_into``'s ranges begin, then ``numel``: ``[0, numel]`` when it does not split."""
        per_element = 2 if self.kind == PAIRS else self.per_draw  # a pair's 4 outputs make 2 elements
        if jump_cost == 0:
            count, lead = threads, 0
        else:  # the first range draws `lead` elements more; each other range's outputs pay for its jump
            count, lead = min(threads, self.numel * per_element // jump_cost - 1), jump_cost // per_element
        if count < 2 or lead >= self.numel:
            return [0, self.numel]
        cuts = {self._aligned(state, lead + (self.numel - lead) * i // count) for i in range(1, count)}
        if self.kind == BLOCKS:  # the last range holds the redrawn tail: at least the last 16 elements
            cuts = {cut for cut in cuts if cut <= self.numel - _BLOCK}
        return [0, *sorted(cut for cut in cuts if 0 < cut < self.numel), self.numel]

    def _aligned(self, state: torch.Tensor, element: int) -> int:
        """The last element at or before ``element`` that a range may begin with."""
        if self.kind == BLOCKS:
            return element - element % _BLOCK
        if self.kind == PAIRS:  # the first element of a pair, counting the cached normal as element 0
            return element - (element - self._cached(state)) % 2
        return element

    def _fill_range(
        self, out: torch.Tensor, state: torch.Tensor, start: int, stop: int, generator: torch.Generator | None = None
    ) -> torch.Generator:
        """Write elements ``start`` to ``stop - 1`` (memory order) of the result into ``out``, ``start`` being a
        boundary ``_aligned`` gives; the private generator that drew them, after them. ``generator``: one already
        at ``state``, for ``start = 0``."""
        if generator is None and self.kind == PAIRS and start > 0:  # a pair's first element, drawn afresh
            pair = (start - self._cached(state)) // 2
            generator = _generator(_without_cached_normal(jumped_state(state, 4 * pair)))
        elif generator is None:
            generator = _generator(state if start == 0 else jumped_state(state, self.per_draw * start))
        pieces = _pieces(out, start, stop)
        if self.kind != PAIRS:
            for piece in pieces:
                self.fill(piece, generator)
            return generator
        scratch = _pairs_scratch(stop - start, self.dtype)  # a piece could be contiguous: the block path
        self.fill(scratch, generator)
        taken = 0
        for piece in pieces:
            piece.copy_(scratch[taken : taken + piece.numel()].view(piece.shape))
            taken += piece.numel()
        return generator

    def _fill_range_in(
        self, inference: bool, out: torch.Tensor, state: torch.Tensor, start: int, stop: int
    ) -> torch.Generator:
        """``_fill_range`` in inference mode or out of it (an inference tensor is written only in it)."""
        with torch.inference_mode(inference):
            return self._fill_range(out, state, start, stop)

    def _check_out(self, out: object) -> None:
        _check_real_out(out, "draw_into")
        assert isinstance(out, torch.Tensor)
        strides = [(size, stride) for size, stride in zip(self.shape, self.strides, strict=True) if size != 1]
        got = [(size, stride) for size, stride in zip(out.shape, out.stride(), strict=True) if size != 1]
        if out.dtype != self.dtype or tuple(out.shape) != self.shape or (self.numel and got != strides):
            raise ValueError(
                "Pattern.draw_into: `out` does not have the layout the pattern was made for; pass a tensor of that "
                f"dtype, shape and strides\n  expected: {self.dtype}, shape {self.shape}, strides {self.strides}\n"
                f"  got:      {out.dtype}, shape {tuple(out.shape)}, strides {out.stride()}"
            )

    def _check_draw_out(self, out: object, elements: int) -> None:
        _check_real_out(out, "draw")
        assert isinstance(out, torch.Tensor)
        if out.dtype != self.dtype or out.shape != (elements,) or (elements > 1 and out.stride() != (1,)):
            raise ValueError(
                "Pattern.draw: `out` must hold the drawn elements, adjacent, in the pattern's dtype\n"
                f"  expected: {self.dtype}, shape ({elements},), stride (1,)\n"
                f"  got:      {out.dtype}, shape {tuple(out.shape)}, stride {out.stride()}"
            )

    def _cached(self, state: torch.Tensor) -> int:
        """1 when the scalar path's first element is the normal cached in ``state``, else 0."""
        return 1 if self.kind == PAIRS and self.numel > 0 and _has_cached_normal(state) else 0

    def _fresh(self, state: torch.Tensor) -> int:
        """Elements the scalar path draws rather than takes from the cache."""
        return self.numel - self._cached(state)

    def _check_range(self, start: int, stop: int, caller: str) -> None:
        for name, value in (("start", start), ("stop", stop)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Pattern.{caller}: `{name}` must be an int (an element index), got {value!r}")
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(
                f"Pattern.{caller}: the range is not within the result of {self.numel} elements; pass "
                f"0 <= start <= stop <= {self.numel}\n  got: start={start}, stop={stop}"
            )


def _check_real_out(out: object, caller: str) -> None:
    """Raise unless ``out`` is a real strided CPU tensor, neither negated nor conjugated: what ``Pattern.{caller}``
    writes into."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"Pattern.{caller}: `out` must be a torch.Tensor, got {type(out).__name__}")
    if isinstance(out, FakeTensor) or out.device.type != "cpu" or out.layout != torch.strided:
        kind = "fake" if isinstance(out, FakeTensor) else f"{out.layout} {out.device}"
        raise ValueError(
            f"Pattern.{caller} writes into a real strided CPU tensor; `out` is a {kind} tensor: pass a CPU one"
        )
    if out.is_neg() or out.is_conj():
        raise ValueError(f"Pattern.{caller}: `out` is a negated or conjugated view; pass the tensor itself")


def pattern(op: object, args: Sequence[object], kwargs: Mapping[str, object] | None = None) -> Pattern | None:
    """The ``Pattern`` of ``op(*args, **kwargs)``, an aten overload run on the CPU, or ``None`` if not modelled.

    ``op`` is the overload as a replay sees it (``torch.ops.aten.normal_.default``, ``torch.ops.aten.randn.generator``,
    ...). Factories with ``dtype=None`` take ``torch.get_default_dtype()`` (``randint`` without a ``dtype`` argument
    takes int64, as its schema says) and those without a device the default device, as of the call. The first call
    of a kind checks the model against torch (module docstring); later calls of that kind cost microseconds.
    """
    parser = _PARSERS.get(str(op)) if isinstance(op, _OVERLOAD) else None
    if parser is None or not callable(op):
        return None
    bound = bind(parser.signature, args, kwargs or {})
    if bound is None:
        return None
    call = parser.build(bound)
    if call is None or not _cpu_generator(bound.get("generator")):
        return None
    if not _accepted(call):
        return None
    chosen = _check(op, call, _variants(call))
    if chosen is None:
        return None
    kind, per_draw, tail = chosen
    layout = call.layout
    return Pattern(
        op, layout.numel, call.dtype, kind, per_draw, tail(layout.numel), call.fill, layout.shape, layout.strides
    )


# --- calls -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    numel: int
    contiguous: bool
    shape: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class _Call:
    """What a modelled call does: ``fill`` (an in-place kernel with the call's parameters) on a tensor of
    ``dtype`` with ``layout``. ``family`` names the kernel; ``per_element`` the outputs of one element, for serial
    kernels."""

    family: str
    dtype: torch.dtype
    layout: _Layout
    fill: _Fill
    per_element: int


_Tail = Callable[[int], "int | None"]
_Variant = tuple[str, int, _Tail]  # kind, per_draw, the tail's first output for n elements


def _no_tail(numel: int) -> int | None:
    return None


def _variants(call: _Call) -> list[_Variant]:
    """The models that may describe ``call`` on this build, in order of preference (the check picks one)."""
    if call.family not in ("normal", "log_normal"):
        return [(SERIAL, call.per_element, _no_tail)]
    if call.family == "log_normal" or call.layout.numel < _BLOCK or not call.layout.contiguous:
        return [(PAIRS, 4, _no_tail)]
    per = 2 if call.dtype == torch.float64 else 1

    def after_all_uniforms(numel: int) -> int | None:
        return None if numel % _BLOCK == 0 else per * numel

    def after_full_blocks(numel: int) -> int | None:
        return None if numel % _BLOCK == 0 else per * _BLOCK * (numel // _BLOCK)

    variants: list[_Variant] = [(BLOCKS, per, after_all_uniforms)]
    if call.dtype in (torch.float16, torch.bfloat16):  # measured: torch 2.13 and 2.15 (module docstring)
        variants.append((BLOCKS, per, after_full_blocks))
    return variants


# --- parsing the arguments -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Parser:
    signature: Signature  # how the operation's arguments bind: its schema's (``ops``)
    build: Callable[[dict[str, object]], _Call | None]


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cpu_generator(generator: object) -> bool:
    return generator is None or (isinstance(generator, torch.Generator) and generator.device.type == "cpu")


def _self_layout(tensor: object, dtypes: frozenset[torch.dtype]) -> tuple[torch.dtype, _Layout] | None:
    """The dtype and layout of a tensor an in-place kernel would fill, if modelled."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type not in ("cpu", "meta"):
        return None
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.dtype not in dtypes or tensor.is_neg():
        return None
    layout = _layout(tuple(tensor.shape), tuple(tensor.stride()))
    return None if layout is None else (tensor.dtype, layout)


def _layout(shape: Sequence[int], strides: Sequence[int]) -> _Layout | None:
    """The layout if its memory order is the order of the dimensions sorted by stride (module docstring)."""
    numel = math.prod(shape)
    if numel == 0:
        return _Layout(0, True, tuple(shape), tuple(strides))
    dims = sorted(((stride, size) for size, stride in zip(shape, strides, strict=True) if size != 1), reverse=True)
    for (outer, _), (inner, size) in itertools.pairwise(dims):
        if outer < inner * size:
            return None
    if dims and dims[-1][0] < 1:
        return None
    expected, contiguous = 1, True  # torch's is_contiguous(): strides of a row-major tensor, size-1 dims aside
    for size, stride in reversed(list(zip(shape, strides, strict=True))):
        if size != 1:
            contiguous = contiguous and stride == expected
            expected *= size
    return _Layout(numel, contiguous, tuple(shape), tuple(strides))


def _dense_strides(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """torch's is_non_overlapping_and_dense(): a permutation of a contiguous layout."""
    dims = sorted((stride, size) for size, stride in zip(shape, strides, strict=True) if size != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _factory_layout(bound: dict[str, object], default_dtype: torch.dtype) -> tuple[torch.dtype, _Layout] | None:
    """The dtype and layout of a factory's result (always contiguous), if modelled."""
    size = bound["size"]
    if not isinstance(size, (list, tuple)) or any(_integer(s) is None for s in size):
        return None
    sizes = [int(s) for s in size]
    dtype = default_dtype if bound["dtype"] is None else bound["dtype"]
    device = _device(bound["device"], torch.get_default_device())
    if min(sizes, default=0) < 0 or not isinstance(dtype, torch.dtype) or device is None or device.type != "cpu":
        return None
    if bound["layout"] not in (None, torch.strided):
        return None
    return dtype, _Layout(math.prod(sizes), True, tuple(sizes), contiguous_strides(sizes))


def _device(device: object, default: torch.device) -> torch.device | None:
    if device is None:
        return default
    try:
        result: torch.device = torch.device(device)  # type: ignore[call-overload]  # what torch accepts as one
        return result
    except (RuntimeError, TypeError):
        return None


def _like_layout(bound: dict[str, object]) -> tuple[torch.dtype, _Layout] | None:
    """The dtype and layout of a ``*_like`` factory's result, if modelled: contiguous when asked, the input's
    strides when preserved from a dense input (as ``empty_like`` does)."""
    tensor = bound["self"]
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        return None
    dtype = tensor.dtype if bound["dtype"] is None else bound["dtype"]
    device = _device(bound["device"], tensor.device)
    if not isinstance(dtype, torch.dtype) or device is None or device.type not in ("cpu", "meta"):
        return None
    if bound["layout"] not in (None, torch.strided):
        return None
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    memory_format = bound["memory_format"]
    if memory_format is torch.contiguous_format:
        return dtype, _Layout(math.prod(shape), True, shape, contiguous_strides(shape))
    if memory_format in (None, torch.preserve_format) and _dense_strides(shape, strides):
        layout = _layout(shape, strides)
        return None if layout is None else (dtype, layout)
    return None


# --- the kernels -----------------------------------------------------------------------------------------------------


#: A fill on one thread goes to modattrs' kernel through its pattern (``pattern`` and ``draw_into``: 50 to 90 us),
#: which the kernel's speed repays from about 50,000 elements.
ONE_THREAD_FEWEST = 1 << 16


def own_kernel_draws(op: object, args: Sequence[object]) -> bool:
    """Whether ``op(*args)``, run on one thread, is a fill that modattrs' own kernel would draw (``kernels``:
    ``uniform_`` on a tensor it takes) enough faster than torch's to repay finding its pattern."""
    if op is not _aten.uniform_.default or not args:
        return False
    tensor = args[0]
    return isinstance(tensor, torch.Tensor) and tensor.numel() >= ONE_THREAD_FEWEST and kernels.takes(tensor)


def _uniform(target: tuple[torch.dtype, _Layout] | None, low: float | None, high: float | None) -> _Call | None:
    if target is None or low is None or high is None or target[0] not in _FLOATS:
        return None
    dtype, layout = target

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        if kernels.uniform_(tensor, low, high, generator):  # the same bits, faster: see kernels
            return tensor
        return _aten.uniform_.default(tensor, low, high, generator=generator)

    return _Call("uniform", dtype, layout, fill, 2 if dtype == torch.float64 else 1)


def _normal(target: tuple[torch.dtype, _Layout] | None, mean: float | None, std: float | None) -> _Call | None:
    if target is None or mean is None or std is None or target[0] not in _FLOATS:
        return None
    dtype, layout = target

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        return _aten.normal_.default(tensor, mean, std, generator=generator)

    return _Call("normal", dtype, layout, fill, 0)


def _two_per_element(
    family: str,
    op: _Op,
    dtypes: frozenset[torch.dtype],
    target: tuple[torch.dtype, _Layout] | None,
    *parameters: float | None,
) -> _Call | None:
    """Kernels that take one double uniform (two outputs) per element whatever the dtype."""
    if target is None or target[0] not in dtypes or any(p is None for p in parameters):
        return None

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        return op(tensor, *parameters, generator=generator)

    return _Call(family, target[0], target[1], fill, 2)


def _log_normal(target: tuple[torch.dtype, _Layout] | None, mean: float | None, std: float | None) -> _Call | None:
    if target is None or mean is None or std is None or target[0] not in _FLOATS:
        return None

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        return _aten.log_normal_.default(tensor, mean, std, generator=generator)

    return _Call("log_normal", target[0], target[1], fill, 0)


def _random(target: tuple[torch.dtype, _Layout] | None) -> _Call | None:
    if target is None or target[0] not in _FLOATS | _INTEGERS:
        return None
    dtype, layout = target

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        return _aten.random_.default(tensor, generator=generator)

    return _Call("random", dtype, layout, fill, 2 if dtype in (torch.float64, torch.int64) else 1)


def _random_from_to(target: tuple[torch.dtype, _Layout] | None, low: object, high: object) -> _Call | None:
    """``random_(from, to)`` and ``randint``: one output per element, two when the range needs 64 bits."""
    start, end = _integer(low), (None if high is None else _integer(high))
    if target is None or start is None or (high is not None and end is None) or target[0] not in _FLOATS | _INTEGERS:
        return None
    dtype, layout = target
    span = _random_range(dtype, start, end)
    if span is None:
        return None

    def fill(tensor: torch.Tensor, generator: torch.Generator) -> object:
        return getattr(_aten.random_, "from")(tensor, start, end, generator=generator)

    # uniform_int_from_to_distribution: 64 bits from a range of 2^28 on ("allow approx 5% skew" of the modulo), in
    # torch's public builds; Meta's internal (FBCODE) builds draw 64 bits from 2^32 on, for four dtypes only
    return _Call("random_from_to", dtype, layout, fill, 2 if span >= 1 << 28 else 1)


def _random_range(dtype: torch.dtype, low: int, high: int | None) -> int | None:
    """The range torch's ``random_from_to_impl`` passes its kernel (2^64 for the full 64-bit range), or ``None``
    where it raises."""
    if high is None and low == _INT64_MIN:
        return 1 << 64 if dtype in _WIDE_RANDOM else None
    if high is None:
        if dtype in _FLOATS:
            high_inclusive = min(1 << _DIGITS[dtype], _INT64_MAX)
            low = _moved_from(dtype, low)
        else:
            high_inclusive = 1 if dtype == torch.bool else torch.iinfo(dtype).max
        if not low <= high_inclusive or not _in_bounds(dtype, low, high_inclusive):
            return None
        return high_inclusive - low + 1
    if not low < high:
        return None
    if dtype in _FLOATS:
        low, high = _moved_from(dtype, low), _moved_to(dtype, high)
        if not low < high:
            return None
    return high - low if _in_bounds(dtype, low, high - 1) else None


def _in_bounds(dtype: torch.dtype, low: int, high_inclusive: int) -> bool:
    """torch's ``check_from_to_in_range``."""
    if dtype in _FLOATS:
        info = torch.finfo(dtype)
        return all(info.min <= value <= info.max for value in (low, high_inclusive))
    if dtype == torch.bool:
        return all(0 <= value <= 1 for value in (low, high_inclusive))
    iinfo = torch.iinfo(dtype)
    return all(iinfo.min <= value <= iinfo.max for value in (low, high_inclusive))


def _through(dtype: torch.dtype, value: int) -> int:
    """``static_cast<int64_t>(static_cast<scalar_t>(value))``, by torch's own conversions."""
    return int(torch.tensor(value, dtype=torch.int64).to(dtype).to(torch.int64).item())


def _moved_from(dtype: torch.dtype, low: int) -> int:
    """torch's ``update_from``: the smallest ``from`` whose values stay at or above it once cast to ``dtype``."""
    plus_one = _through(dtype, low + 1)
    if plus_one < low:
        bits = abs(low + 1).bit_length() - 1
        low = plus_one + (1 << (bits - _DIGITS[dtype] + 1))
    return low


def _moved_to(dtype: torch.dtype, high: int) -> int:
    """torch's ``update_to``."""
    minus_one = _through(dtype, high - 1)
    if minus_one >= high:
        bits = abs(high - 1).bit_length() - 1
        high = minus_one - (1 << (bits - _DIGITS[dtype] + 1))
    return high


def _parsers() -> dict[str, _Parser]:
    parsers: dict[str, _Parser] = {}

    def add(packet: str, overload: str, build: Callable[[dict[str, object]], _Call | None]) -> None:
        try:
            op = getattr(getattr(_aten, packet), overload)
        except AttributeError:  # an overload this torch release lacks
            return
        signature = facts_of(op).signature
        assert signature is not None  # an aten overload's
        parsers[str(op)] = _Parser(signature, build)  # by name: packets can hand out more than one object per overload

    every = _FLOATS | _INTEGERS

    def floats(b: dict[str, object]) -> tuple[torch.dtype, _Layout] | None:
        return _self_layout(b["self"], _FLOATS)

    def anything(b: dict[str, object]) -> tuple[torch.dtype, _Layout] | None:
        return _self_layout(b["self"], every)

    def made(b: dict[str, object]) -> tuple[torch.dtype, _Layout] | None:
        return _factory_layout(b, torch.get_default_dtype())  # read at each call, as the factories do

    def two(
        family: str, op: _Op, dtypes: frozenset[torch.dtype], *names: str
    ) -> Callable[[dict[str, object]], _Call | None]:
        return lambda b: _two_per_element(family, op, dtypes, anything(b), *(_number(b[name]) for name in names))

    # each binds its arguments as its schema says (``ops.facts_of(op).signature``): names, defaults, keywords
    add("uniform_", "default", lambda b: _uniform(floats(b), _number(b["from"]), _number(b["to"])))
    add("normal_", "default", lambda b: _normal(floats(b), _number(b["mean"]), _number(b["std"])))
    add("log_normal_", "default", lambda b: _log_normal(floats(b), _number(b["mean"]), _number(b["std"])))
    add("bernoulli_", "float", two("bernoulli", _aten.bernoulli_.float, every, "p"))
    add("exponential_", "default", two("exponential", _aten.exponential_.default, _FLOATS, "lambd"))
    add("cauchy_", "default", two("cauchy", _aten.cauchy_.default, _FLOATS, "median", "sigma"))
    add("geometric_", "default", two("geometric", _aten.geometric_.default, every - {torch.bool}, "p"))
    add("random_", "default", lambda b: _random(anything(b)))
    add("random_", "from", lambda b: _random_from_to(anything(b), b["from"], b["to"]))
    add("random_", "to", lambda b: _random_from_to(anything(b), 0, b["to"]))

    for suffix in ("default", "generator"):
        add("rand", suffix, lambda b: _uniform(made(b), 0.0, 1.0))
        add("randn", suffix, lambda b: _normal(made(b), 0.0, 1.0))
        add("rand_like", suffix, lambda b: _uniform(_like_layout(b), 0.0, 1.0))
        add("randn_like", suffix, lambda b: _normal(_like_layout(b), 0.0, 1.0))
    for high, low in (("default", "low"), ("generator", "low_generator")):
        add("randint", high, lambda b: _random_from_to(made(b), 0, b["high"]))
        add("randint", low, lambda b: _random_from_to(made(b), b["low"], b["high"]))
    for high, low in (("default", "low_dtype"), ("generator", "low_generator_dtype")):
        add("randint_like", high, lambda b: _random_from_to(_like_layout(b), 0, b["high"]))
        add("randint_like", low, lambda b: _random_from_to(_like_layout(b), b["low"], b["high"]))
    add("normal", "float_float", lambda b: _normal(made(b), _number(b["mean"]), _number(b["std"])))
    return parsers


_PARSERS: Final = _parsers()
_OVERLOAD: Final = type(_aten.uniform_.default)  # torch's OpOverload, without naming its private module


# --- the catalogue ---------------------------------------------------------------------------------------------------


#: aten operators (all overloads) whose count of outputs is a function of their tensors' layouts and dtypes and
#: their other arguments (module docstring).
SIZE_ONLY: Final = frozenset(
    {
        "uniform", "uniform_", "normal", "normal_", "normal_functional", "log_normal", "log_normal_",
        "cauchy", "cauchy_", "exponential", "exponential_", "geometric", "geometric_", "bernoulli", "bernoulli_",
        "random", "random_", "rand", "rand_like", "randn", "randn_like", "randint", "randperm", "multinomial",
        "native_dropout", "dropout", "dropout_", "alpha_dropout", "alpha_dropout_", "feature_dropout",
        "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "rnn_relu", "rnn_tanh", "lstm", "gru",
        "scaled_dot_product_attention", "_scaled_dot_product_attention_math",
        "_scaled_dot_product_flash_attention_for_cpu", "_fused_sdp_choice", "_nested_tensor_softmax_with_shape",
        # GPU kernels (read, not measured: no GPU here), whose only draws are dropout masks from their device's
        # generator; listed so that a fake forward pass through them is not pinned into every replay
        "_fused_dropout", "_fill_mem_eff_dropout_mask_", "_cudnn_init_dropout_state", "_cudnn_rnn", "miopen_rnn",
        "_lstm_mps", "_efficient_attention_forward", "_flash_attention_forward",
        "_flash_attention_forward_no_dropout_inplace", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps",
        "_cudnn_attention_forward", "_cudnn_attention_backward", "_triton_scaled_dot_attention",
    }
)  # fmt: skip
#: aten operators whose count of outputs depends on the values of their tensor arguments; ``randint_like`` is
#: listed by overload: only those with a tensor ``high`` are.
VALUE_DEPENDENT: Final = frozenset(
    {
        "rrelu", "rrelu_", "rrelu_with_noise", "rrelu_with_noise_", "rrelu_with_noise_functional",
        "poisson", "binomial", "_standard_gamma", "_sample_dirichlet",
        "randint_like.Tensor", "randint_like.Tensor_generator", "randint_like.Tensor_out",
        "randint_like.Tensor_generator_out",
    }
)  # fmt: skip


def count_depends_on_values(op: object) -> bool:
    """Whether how many outputs of the CPU generator ``op`` takes may depend on the values of its tensor arguments:
    true for the operators ``VALUE_DEPENDENT`` names, false for those ``SIZE_ONLY`` names (and the other overloads
    of ``randint_like``), and true for anything else (an operator the catalogue does not know, a Python function)."""
    if not isinstance(op, _OVERLOAD):
        return True
    return _by_name(str(op))


@functools.lru_cache(maxsize=256)
def _by_name(name: str) -> bool:
    """``count_depends_on_values`` of the aten overload called ``name`` (``aten.packet.overload``)."""
    namespace, packet, overload = name.split(".")
    if namespace != "aten" or packet in VALUE_DEPENDENT or f"{packet}.{overload}" in VALUE_DEPENDENT:
        return True
    return packet not in SIZE_ONLY and packet != "randint_like"


# --- the check against torch -----------------------------------------------------------------------------------------


#: Per kind of call: the variant that agreed with torch on this build and machine, or None if none did.
_CHECKED: dict[tuple[object, ...], _Variant | None] = {}


def _check(op: _Op, call: _Call, variants: list[_Variant]) -> _Variant | None:
    """The first of ``variants`` that agrees with torch on small tensors of ``call``'s kernel, dtype and path."""
    kind = variants[0][0]
    key = (call.family, call.dtype, kind, call.layout.contiguous, call.per_element)
    if key in _CHECKED:
        return _CHECKED[key]
    with warnings.catch_warnings():  # torch's warnings about these arguments belong to the caller's own run
        warnings.simplefilter("ignore")
        chosen = next((v for v in variants if _agrees(op, call, v)), None)
    _CHECKED[key] = chosen
    return chosen


def _accepted(call: _Call) -> bool:
    """Whether torch accepts the call's arguments: its kernel run on one scratch element (torch's own checks, rather
    than a copy of them)."""
    try:
        with warnings.catch_warnings():  # torch's warnings about these arguments belong to the caller's own run
            warnings.simplefilter("ignore")
            call.fill(torch.empty(1, dtype=call.dtype, device="cpu"), torch.Generator(device="cpu"))
    except (RuntimeError, ValueError, TypeError, IndexError, OverflowError):
        return False
    return True


_Shape = tuple[tuple[int, ...], tuple[int, ...]]  # sizes and strides


def _probes(kind: str, contiguous: bool) -> list[_Shape]:
    """Small layouts on which a kind of call takes the path the model claims for it."""

    def transposed(rows: int, columns: int) -> _Shape:
        return (rows, columns), (1, rows)

    if kind == BLOCKS:
        return [((n,), (1,)) for n in (16, 37, 48)]
    if kind == PAIRS:
        return [((5,), (1,)), ((1,), (1,))] if contiguous else [transposed(3, 2), transposed(6, 3)]
    return [((n,), (1,)) for n in (1, 5, 20)] if contiguous else [transposed(3, 4), transposed(5, 4)]


def _agrees(op: _Op, call: _Call, variant: _Variant) -> bool:
    """Whether ``variant`` gives, on probes of ``call``'s kind, every element and state torch gives."""
    kind, per_draw, tail = variant
    for shape, strides in _probes(kind, call.layout.contiguous):
        probe = torch.empty_strided(shape, strides, dtype=call.dtype, device="cpu")
        numel = probe.numel()
        model = Pattern(op, numel, call.dtype, kind, per_draw, tail(numel), call.fill, shape, strides)
        for state in _probe_states(kind):
            generator = _generator(state)
            call.fill(probe, generator)
            full = _in_memory_order(probe)
            if not torch.equal(model.state_after(state), generator.get_state()):
                return False
            if jumped_state(state, model.outputs(state))[:_CACHE_START].ne(generator.get_state()[:_CACHE_START]).any():
                return False
            for start, stop in _probe_ranges(numel):
                if not same_bits(model.draw(state, start, stop), full[start:stop]):
                    return False
    return True


def _probe_states(kind: str) -> list[torch.Tensor]:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(20_240_601)
    torch.empty(7, dtype=torch.float32).uniform_(generator=generator)  # mid-block
    states = [generator.get_state()]
    if kind == PAIRS:
        torch.empty(1, dtype=torch.float64).normal_(generator=generator)  # leaves a cached normal
        states.append(generator.get_state())
    return states


def _probe_ranges(numel: int) -> list[tuple[int, int]]:
    ranges = {(0, numel), (0, 1), (numel - 1, numel), (numel // 3, numel - numel // 4), (1, 2)}
    if numel >= 32:  # across the last full block into the redrawn tail, and one aligned block
        ranges |= {(numel - 20, numel - 3), (_BLOCK, 2 * _BLOCK), (3, numel - 17)}
    return sorted((start, stop) for start, stop in ranges if 0 <= start <= stop <= numel)


# --- helpers ---------------------------------------------------------------------------------------------------------


@dataclass
class _Pool:
    executor: ThreadPoolExecutor | None = None
    size: int = 0
    intra_op: int = 0  # torch.get_num_threads() when the threads started
    process: int = 0  # a forked child has none of its parent's threads


_POOL = _Pool()
_POOL_LOCK = threading.Lock()


def workers(count: int) -> ThreadPoolExecutor:
    """Threads for ``draw_into``'s ranges (and ``rejection``'s), at least ``count``, kept from call to call: a new
    thread's first jump costs about 90 ms more (OpenMP and MKL set up their per-thread state). Each thread first asks
    torch for its intra-op thread count, which sets that thread's OpenMP and MKL counts to torch's setting (else they
    take every core); a new pool replaces the old one when that setting has changed since, and in a forked child."""
    intra_op, process = torch.get_num_threads(), os.getpid()
    with _POOL_LOCK:
        if _POOL.executor is None or _POOL.size < count or (_POOL.intra_op, _POOL.process) != (intra_op, process):
            # the old pool's threads end once the calls still using it let it go
            _POOL.executor = ThreadPoolExecutor(count, "modattrs-draws", initializer=torch.get_num_threads)
            _POOL.size, _POOL.intra_op, _POOL.process = count, intra_op, process
        return _POOL.executor


def _generator(state: torch.Tensor) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.set_state(state)
    return generator


def _has_cached_normal(state: torch.Tensor) -> bool:
    (valid,) = struct.unpack("=i", bytes(state[_CACHE_VALID:_CACHE_END].tolist()))
    return bool(valid)


def _without_cached_normal(state: torch.Tensor) -> torch.Tensor:
    """``state`` with the double Box-Muller cache emptied, as torch writes it when there is none."""
    result = state.clone()
    result[_CACHE_START:_CACHE_END] = 0
    return result


def _pieces(tensor: torch.Tensor, start: int, stop: int) -> list[torch.Tensor]:
    """Views of ``tensor`` (a layout ``_layout`` accepts) that hold its elements ``start`` to ``stop - 1`` in memory
    order, in that order; each is a box of the dimensions sorted by stride, whose row-major order is its memory order.
    One view when those elements are evenly spaced in memory (always, for a contiguous tensor)."""
    dims: list[tuple[int, int]] = []  # (size, stride), innermost first, neighbours merged when evenly spaced
    for stride, size in sorted(((st, si) for si, st in zip(tensor.shape, tensor.stride(), strict=True) if si != 1)):
        if dims and stride == dims[-1][0] * dims[-1][1]:
            dims[-1] = (dims[-1][0] * size, dims[-1][1])
        else:
            dims.append((size, stride))
    dims = dims[::-1] or [(1, 1)]
    pieces: list[torch.Tensor] = []

    def add(offset: int, level: int, first: int, last: int) -> None:
        """Elements ``first`` to ``last - 1`` of the box of ``dims[level:]`` at storage offset ``offset``."""
        inner_dims = dims[level + 1 :]
        inner = math.prod(size for size, _ in inner_dims)
        row, head = divmod(first, inner)
        end, tail = divmod(last, inner)
        stride = dims[level][1]
        if row == end:
            add(offset + row * stride, level + 1, head, tail)
            return
        if head:
            add(offset + row * stride, level + 1, head, inner)
            row += 1
        if row < end:
            sizes = (end - row, *(size for size, _ in inner_dims))
            pieces.append(tensor.as_strided(sizes, (stride, *(s for _, s in inner_dims)), offset + row * stride))
        if tail:
            add(offset + end * stride, level + 1, 0, tail)

    if start < stop:
        add(int(tensor.storage_offset()), 0, start, stop)
    return pieces


def _pairs_scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``numel`` elements on which ``normal_`` takes the scalar path: not contiguous (or too small)."""
    return torch.empty(numel, 2, dtype=dtype, device="cpu")[:, 0]


def _in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """The elements of a tensor whose layout ``_layout`` accepts, in memory order, as a 1-D tensor."""
    order = sorted(range(tensor.dim()), key=lambda d: (tensor.stride(d), tensor.shape[d]), reverse=True)
    return tensor.permute(order).reshape(-1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)
