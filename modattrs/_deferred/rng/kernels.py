"""modattrs' own kernel for torch's CPU ``uniform_``: the same elements and generator state, bit for bit, drawn faster.

Note [A kernel of our own, checked against torch's where it runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's CPU ``uniform_`` takes one output of the generator per element (two for float64) through TensorIterator's
serial loop: 4 to 8 ns an element here, which is most of what a replay of ``nn.Linear``'s ``kaiming_uniform_``
costs. The C extension ``modattrs._generator_draws`` runs the same MT19937 engine on a copy of the state and turns
the outputs into elements as torch's kernel does, in vectorized loops (0.8 to 1 ns an element for float32 with
AVX2 from 65,536 elements on; ``benchmarks/uniform_kernel.py``).

What torch's kernel computes has changed across releases, and part of it depends on how torch was compiled:

- the *form* (``aten/src/ATen/native/cpu/DistributionTemplates.h``): since torch 2.13 the bounds and the arithmetic
  are in the accumulation type (float, double for float64) with its bits, and a value that rounds to ``high`` in the
  element type is replaced by ``low`` (``"opmath"``); before, bfloat16 took the bounds and their difference in
  the element type and its 8 bits, and nothing was replaced (``"scalar"``);
- whether ``x * (high - low) + low`` is one fused multiply-add: the compiler decides, per CPU capability torch
  built the kernel for (AVX2 builds fuse it here; ``ATEN_CPU_CAPABILITY=default`` may not).

So nothing is assumed: the first time a process draws a dtype here, each form, fused and not, is compared with
torch's own kernel on probes that tell them apart (an ugly range over 5,000 elements, across twists of the engine;
a range whose values round to ``high`` a quarter of the time or more, where the replacement shows), elements and
state after; the first that agrees draws that dtype from then on, and with none torch's kernel draws it in this
process (bfloat16 tries float32's rounding first: see ``_form_for``). Each new pair of bounds of a dtype
is compared once more on its own bounds before it is drawn here. A tensor too small to gain (``FEWEST``), not
contiguous, or not on the CPU, and a build without the extension, go to torch's kernel. ``forms()`` says what was
chosen.
"""

from __future__ import annotations

import threading
from typing import Literal

import torch
from torch.autograd.graph import increment_version

from modattrs._compiled import generator_draws as _extension
from modattrs._torch_private import CPU_STATE_ARRAY, CPU_STATE_BYTES, CPU_STATE_LEFT, CPU_STATE_NEXT

__all__ = ["FEWEST", "forms", "takes", "uniform_"]

#: Below this many elements torch's kernel draws: copying the state out and back costs about what torch's kernel
#: takes for a few thousand elements.
FEWEST = 4096

# float16 is left to torch: its rounding does not vectorize as these do, and gained nothing
_NAMES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16"}
_Form = tuple[Literal["opmath", "scalar"], bool]  # torch's kernel's form, and whether it fuses x * range + low
_FORMS: tuple[_Form, ...] = (("opmath", True), ("opmath", False), ("scalar", True), ("scalar", False))

_UGLY = (-0.3711, 0.8123)  # bounds whose products round differently fused and not
_PROBE_ELEMENTS = 5_000  # eight twists of the engine (sixteen for float64)
_BOUNDS_PROBE_ELEMENTS = 1_500
_PROBE_SEED = 20_261_201

_LAYOUT = (CPU_STATE_LEFT[1], CPU_STATE_NEXT[1], CPU_STATE_ARRAY.start)  # where the extension finds the engine

_lock = threading.Lock()
_form_of: dict[torch.dtype, _Form | None] = {}  # the form that agreed with torch, by dtype: None if none did
_bounds_agree: dict[tuple[torch.dtype, str, str], bool] = {}  # by the bounds' hex: -0.0 is not 0.0


def uniform_(tensor: torch.Tensor, low: float, high: float, generator: torch.Generator) -> bool:
    """Fill ``tensor`` as ``tensor.uniform_(low, high, generator=generator)`` would, and move ``generator`` as it
    would, if this kernel draws it (see the module's Note); False, and nothing done, for torch's kernel to draw it.
    ``low`` and ``high`` are bounds torch accepted for ``tensor``'s dtype. ``generator`` is a private one: the state
    is read, drawn from and put back without torch's lock on it, so the default generator, which other threads may
    draw from meanwhile, is left to torch's kernel."""
    if not takes(tensor) or generator.device.type != "cpu" or generator is torch.default_generator:
        return False
    form = _checked(tensor.dtype, float(low), float(high))
    state = generator.get_state()  # a copy: ours to write
    if form is None or not _known(state):
        return False
    generator.set_state(_drawn(state, tensor, float(low), float(high), form))
    increment_version(tensor)  # written in place, as torch's kernel counts it
    return True


def takes(tensor: torch.Tensor) -> bool:
    """Whether ``uniform_`` may draw ``tensor`` here: the extension is built, and it is a contiguous CPU tensor of a
    dtype it draws, large enough to gain, that torch's kernel would write as it is (whether a form agreed is known at
    the first draw). A negative view (whose elements torch negates as it writes them), an inference tensor outside
    inference mode and a tensor that requires grad while grad mode is on (which torch refuses to write in place) are
    torch's."""
    return (
        _extension is not None
        and tensor.numel() >= FEWEST
        and tensor.dtype in _NAMES
        and tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.is_neg()
        and not (tensor.requires_grad and torch.is_grad_enabled())
        and not (tensor.is_inference() and not torch.is_inference_mode_enabled())
    )


def forms() -> dict[torch.dtype, _Form | None]:
    """The form (and whether fused) that this process draws each dtype checked so far with; None: torch's kernel."""
    with _lock:
        return dict(_form_of)


def forget() -> None:
    """Forget what was checked: the next draws check again, as a fresh process's would (for tests)."""
    with _lock:
        _form_of.clear()
        _bounds_agree.clear()


def _known(state: torch.Tensor) -> bool:
    """Whether ``state`` is laid out as the extension reads and writes it (a torch whose CPU generator keeps another
    state would be drawn by torch's kernel, not written past its end)."""
    return state.dtype == torch.uint8 and state.dim() == 1 and state.numel() == CPU_STATE_BYTES


def _drawn(state: torch.Tensor, out: torch.Tensor, low: float, high: float, form: _Form) -> torch.Tensor:
    """``state`` (a CPU generator's, of the caller's own: it is written) after drawing ``out`` (contiguous, on the
    CPU) from it in ``form``; ``out`` is written."""
    assert _extension is not None
    name, fused = form
    _extension.mt19937_uniform(
        state.data_ptr(), _LAYOUT, out.data_ptr(), out.numel(), _NAMES[out.dtype], low, high, name, fused
    )
    return state


def _checked(dtype: torch.dtype, low: float, high: float) -> _Form | None:
    """The form to draw ``dtype`` in between these bounds, checked against torch's kernel; None: torch's kernel."""
    key = (dtype, low.hex(), high.hex())
    agrees = _bounds_agree.get(key)
    if agrees is not None:  # no lock: entries are written once, under it
        return _form_of[dtype] if agrees else None
    with _lock:
        form = _form_for(dtype)
        _bounds_agree[key] = form is not None and _agrees(dtype, form, low, high, _BOUNDS_PROBE_ELEMENTS)
        return form if _bounds_agree[key] else None


def _form_for(dtype: torch.dtype) -> _Form | None:
    """The first form that agrees with torch's kernel on ``dtype``'s probes (``_lock`` held). bfloat16 tries first
    the rounding float32 agreed with: its probes rarely tell a fused multiply-add from two roundings (the two differ
    there only where a float lies within an ulp of a rounding boundary of bfloat16, about one element in 65,000),
    and in either form torch computes its values with the float32 expression."""
    if dtype not in _form_of:
        candidates = list(_FORMS)
        if dtype == torch.bfloat16:
            reference = _form_for(torch.float32)
            if reference is not None:
                candidates.sort(key=lambda form: form[1] != reference[1])  # stable: the forms' order otherwise
        _form_of[dtype] = next((form for form in candidates if _form_agrees(dtype, form)), None)
    return _form_of[dtype]


def _form_agrees(dtype: torch.dtype, form: _Form) -> bool:
    # just below 1 to 1: a value rounds to 1 (replaced, in the "opmath" form) for a quarter of the draws or more
    below_one = 1.0 - torch.finfo(dtype).eps / 2
    return _agrees(dtype, form, *_UGLY, _PROBE_ELEMENTS) and _agrees(dtype, form, below_one, 1.0, _PROBE_ELEMENTS)


def _agrees(dtype: torch.dtype, form: _Form, low: float, high: float, elements: int) -> bool:
    """Whether ``form`` gives torch's elements and state on ``elements`` elements of ``dtype`` from a state in the
    middle of a block."""
    generator = torch.Generator(device="cpu").manual_seed(_PROBE_SEED)
    torch.empty(7, dtype=torch.float32, device="cpu").uniform_(generator=generator)
    state = generator.get_state()
    if not _known(state):
        return False
    expected = torch.empty(elements, dtype=dtype, device="cpu").uniform_(low, high, generator=generator)
    got = torch.empty(elements, dtype=dtype, device="cpu")
    after = _drawn(state.clone(), got, low, high, form)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    return torch.equal(got.view(bits), expected.view(bits)) and torch.equal(after, generator.get_state())
