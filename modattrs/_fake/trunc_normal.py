"""When ``torch.nn.init.trunc_normal_`` is exactly one ``normal_``, provably, so that a fake or deferred tensor
can record that one draw (which deferred init's replay models, shard by shard) instead of an opaque call.

Note [trunc_normal_ as one normal_]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch 2.13's helper (``torch.nn.init._no_grad_trunc_normal_``) computes ``p``, the normal mass inside ``[a, b]``.
When ``p > 0.3`` it runs ``tensor.normal_(mean, std, generator=generator)`` under ``no_grad`` and then draws again
(a fresh ``normal_``, merged by ``torch.where``) only while some element lies below ``lo`` or above ``hi``, the
bounds cast to the tensor's dtype. If no value ``normal_`` can return lies outside ``[lo, hi]``, the loop never
runs: the call is that one ``normal_``, values and generator alike.

How far ``normal_`` reaches, from torch's CPU kernels (``aten/src/ATen/native/cpu/DistributionTemplates.h``,
``DistributionsHelper.h``): every path is Box-Muller, ``z = sqrt(-2 log(u)) * cos or sin(theta)``, where ``u`` is
``1 - x`` for a uniform ``x`` on a grid of ``2**-d`` in ``[0, 1)``, so ``u >= 2**-d`` and ``|z| <=
sqrt(2 d log 2)``.

- contiguous tensors of 16 elements or more (the vectorized fill, ``normal_fill``): ``x`` of the tensor's own
  dtype, ``d`` = its digits: 24 for float32 (5.77), 53 for float64 (8.57), 11 for float16 (3.91), 8 for bfloat16
  (3.33);
- fewer elements or other layouts (``normal_distribution<double>``, then a cast): ``d`` = 53 (8.57), ``log1p(-x)``.

So no ``z`` exceeds ``Z_MAX = sqrt(106 log 2) ~ 8.572``. The AVX2 fill's ``log`` and ``sincos`` are polynomial
approximations accurate to a few units in the last place, and CUDA's Philox Box-Muller uses uniforms of 32 or 53
bits offset by half a step (at most about 8.65): a bound of ``REACH = 3 * Z_MAX`` standard deviations leaves room
for all of them. The stored value is ``z * std + mean`` computed in the tensor's dtype (a few roundings, each at
most half a unit in the last place of a value of magnitude ``|mean| + REACH * std`` at most, or an absolute
``tiny`` where values are subnormal): a margin of ``8 * eps * (|mean| + REACH * std) + tiny`` covers them.

The call is taken as one ``normal_`` only when all of this holds: a float dtype (float16, bfloat16, float32,
float64); ``mean``, ``std``, ``a``, ``b`` real numbers, ``mean`` and ``std`` finite, ``std > 0``, neither bound NaN;
the helper's ``p > 0.3``; ``lo <= mean - REACH * std - margin`` and ``hi >= mean + REACH * std + margin``; and
``|mean| + REACH * std + margin`` at most half the dtype's largest value (nothing overflows). ``std=0.02`` with the
default bounds of plus or minus 2 (torchtitan's and timm's initializers) is 100 standard deviations away.

The helper's algorithm differs between torch builds (2.8's is ``uniform_`` then ``erfinv_``), so the first time a
process asks, :func:`helper_draws_one_normal` runs the helper and ``normal_`` on real CPU tensors from equal states
of a generator of their own (sizes below 16, 16, 17 and 100, a transposed one, each float dtype, in one sequence,
so that the scalar path's cached normal is exercised), and compares every value bit for bit and the generator's
state after. Where they differ, every call stays opaque, as everywhere else the proof does not hold.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from modattrs._torch_private import disable_current_modes

__all__ = ["NormalRounds", "OneNormal", "as_normal_rounds", "as_one_normal", "helper_draws_one_normal"]

Z_MAX = math.sqrt(106 * math.log(2))  # the largest |z| torch's CPU normal_ returns (see the Note)
REACH = 3 * Z_MAX  # how many standard deviations the bounds must lie beyond

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BITS = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


class OneNormal(NamedTuple):
    """The arguments of the one ``normal_`` a ``trunc_normal_`` call is, as the helper passes them."""

    mean: Any
    std: Any
    generator: torch.Generator | None


def as_one_normal(
    helper: Callable[..., Any], dtype: torch.dtype, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> OneNormal | None:
    """The one ``normal_`` that ``helper(*args, **kwargs)`` (``_no_grad_trunc_normal_``) is on a tensor of
    ``dtype``, or None where that cannot be proven (see Note [trunc_normal_ as one normal_])."""
    call = _normal_rounds(helper, dtype, args, kwargs)
    if call is None:
        return None
    mean, std, lo, hi, generator = call
    mean_f, std_f = float(mean), float(std)
    info = torch.finfo(dtype)
    reach = abs(mean_f) + REACH * std_f
    margin = 8 * info.eps * reach + info.tiny
    if reach + margin > info.max / 2:
        return None
    if not (lo <= mean_f - REACH * std_f - margin and hi >= mean_f + REACH * std_f + margin):
        return None
    return OneNormal(mean, std, generator)


class NormalRounds(NamedTuple):
    """A ``trunc_normal_`` call the helper samples by rounds of ``normal_(mean, std, generator=generator)``, and
    the bounds, cast to the tensor's dtype, outside which an element is drawn again."""

    mean: Any
    std: Any
    lo: float
    hi: float
    generator: torch.Generator | None


def as_normal_rounds(
    helper: Callable[..., Any], dtype: torch.dtype, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> NormalRounds | None:
    """What ``helper(*args, **kwargs)`` (``_no_grad_trunc_normal_``) draws on a tensor of ``dtype`` when it takes
    its ``normal_`` branch (the helper's ``p > 0.3``): rounds of ``normal_`` and the bounds it checks them against.
    None for arguments outside what Note [trunc_normal_ as one normal_] lists (the bounds aside), and for the
    helper's other branch. Whether this process's helper does so is not checked here."""
    return _normal_rounds(helper, dtype, args, kwargs)


def _normal_rounds(
    helper: Callable[..., Any], dtype: torch.dtype, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> NormalRounds | None:
    try:
        bound = _signature(helper).bind(*args, **kwargs)
    except TypeError:
        return None
    given = bound.arguments
    if set(given) - {"tensor", "mean", "std", "a", "b", "generator"}:
        return None
    try:
        mean, std, a, b = (given[name] for name in ("mean", "std", "a", "b"))
    except KeyError:
        return None
    generator = given.get("generator")
    if generator is not None and not isinstance(generator, torch.Generator):
        return None
    if dtype not in _FLOATS or not all(_is_real(value) for value in (mean, std, a, b)):
        return None
    try:
        mean_f, std_f, a_f, b_f = float(mean), float(std), float(a), float(b)
    except OverflowError:  # an int beyond any float
        return None
    if not (math.isfinite(mean_f) and math.isfinite(std_f) and std_f > 0) or math.isnan(a_f) or math.isnan(b_f):
        return None
    if _mass_inside(mean_f, std_f, a_f, b_f) <= 0.3:
        return None
    lo, hi = _in_dtype(a, dtype), _in_dtype(b, dtype)
    if lo is None or hi is None:
        return None
    return NormalRounds(mean, std, lo, hi, generator)


def helper_draws_one_normal(helper: Callable[..., Any]) -> bool:
    """Whether ``helper`` behaves, in this process's torch, as one ``normal_`` where the bounds lie beyond its
    reach: checked on real tensors the first time it is asked, then remembered."""
    key = id(helper)
    known = _checked.get(key)
    if known is not None:
        return known
    with _lock:
        known = _checked.get(key)
        if known is None:
            known = _checked[key] = _agrees(helper)
        return known


_checked: dict[int, bool] = {}
_lock = threading.Lock()


def _agrees(helper: Callable[..., Any]) -> bool:
    """Run ``helper`` and ``normal_`` from equal generator states on a sequence of real CPU tensors, and compare
    the values bit for bit and the states after."""
    calls = [(0.0, 0.02, -2.0, 2.0), (0.5, 1.5, -60.0, 70.0)]
    shapes = [(5,), (3, 4), (16,), (17,), (100,), (12, 10)]
    with disable_current_modes(), torch.no_grad():
        by_helper, by_normal = torch.Generator(device="cpu"), torch.Generator(device="cpu")
        by_helper.manual_seed(20_261_129)
        by_normal.manual_seed(20_261_129)
        try:
            for dtype in _FLOATS:
                for mean, std, a, b in calls:
                    for shape in shapes:
                        first = torch.empty(shape, dtype=dtype, device="cpu")
                        second = torch.empty(shape, dtype=dtype, device="cpu")
                        if shape == (12, 10):  # transposed: the scalar path on many elements
                            first, second = first.t(), second.t()
                        if as_one_normal(helper, dtype, (first, mean, std, a, b), {"generator": by_helper}) is None:
                            return False
                        helper(first, mean, std, a, b, generator=by_helper)
                        second.normal_(mean, std, generator=by_normal)
                        if not torch.equal(first.view(_BITS[dtype]), second.view(_BITS[dtype])):
                            return False
        except Exception:  # a helper that refuses these arguments is not the one the Note describes
            return False
        return torch.equal(by_helper.get_state(), by_normal.get_state())


@functools.lru_cache(maxsize=8)
def _signature(helper: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(getattr(helper, "__wrapped__", helper))


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _mass_inside(mean: float, std: float, a: float, b: float) -> float:
    """The helper's ``p``, computed as it computes it."""

    def norm_cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    return norm_cdf((b - mean) / std) - norm_cdf((a - mean) / std)


def _in_dtype(bound: object, dtype: torch.dtype) -> float | None:
    """``bound`` cast to ``dtype`` as the helper casts it (``new_tensor(bound).item()``), on a real CPU tensor; None
    where torch refuses it (an int beyond int64)."""
    with disable_current_modes():
        try:
            return float(torch.tensor(bound, dtype=dtype, device="cpu").item())
        except (RuntimeError, OverflowError):
            return None
