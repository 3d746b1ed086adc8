"""Every change modattrs makes to torch in a process: what it is, why, and the one order it is made in.

Importing modattrs changes nothing. The first use of fake mode or deferred initialization (``fake_mode``,
``fake_copy``, ``deferred_init``) calls :func:`install`, which makes the *base* changes, all of them, in the order
of its body, whichever feature came first; the first ``deferred_init`` calls :func:`install_deferred`, which makes
them and then the generator change that only deferred initialization needs (and, in a process that imported
``torch.distributed.tensor``, the change to DTensor's scatter and broadcast); the base changes are followed, once
FSDP2 is imported, by the change to how it cuts fake tensors into chunks; the first use of fake CUDA calls
:func:`install_fake_cuda`, which makes the base changes and then the fake CUDA ones (fewer on a machine with a
GPU). Each group is made after the base one and touches nothing another group touches, so a process ends in the
same state whatever order its features were first used in. The engines (``_fake``, ``_deferred``) change nothing
themselves: the public faces call these functions, and pass :func:`install_fake_cuda` to the recorder.
``docs/torch_changes.rst`` lists the changes for users; :func:`undo` puts back what can be put back, for tests.
Replays make no process-wide change at all: they never set torch's default dtype (Note [The default dtype is passed,
never set] in ``_deferred.record``) nor its thread count.

Replacements are made at install time, around whatever the attribute holds then (``functools.wraps``, so each
keeps ``__wrapped__``), and each remembers what it replaced, so :func:`undo` restores exactly that.
"""

from __future__ import annotations

import functools
import inspect
import operator
import sys
import threading
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import torch

from modattrs._deferred import rng
from modattrs._deferred.fingerprint import refuse_unless_ranks_agree
from modattrs._deferred.recorder import recorded_together, scatter_own_chunk
from modattrs._fake import backward, cuda_guard, spoofed_cuda
from modattrs._fake.mode import ModattrsFakeTensorMode, data_for, data_replaced, deep_copy, note_reduced
from modattrs._fake.trunc_normal import as_one_normal as trunc_normal_as_one_normal
from modattrs._fake.trunc_normal import helper_draws_one_normal
from modattrs._torch_private import (
    DTENSOR_BROADCAST,
    DTENSOR_PLACEMENTS,
    DTENSOR_SCATTER,
    ENGINE_ENTRY,
    ENGINE_ENTRY_OWNERS,
    FSDP_CHUNKS,
    FSDP_PARAM_CLASS,
    FSDP_PARAM_MODULE,
    FSDP_POST_FORWARD_SIZES,
    FSDP_SHARDED_PARAM,
    TRUNC_NORMAL_HELPER,
    TRUNC_NORMAL_WARNINGS,
    DisableTorchDispatch,
    DisableTorchFunction,
    FakeTensor,
    active_fake_mode,
    disable_current_modes,
    dispatch_mode_count,
    import_dynamo,
    math_attention,
)

__all__: list[str] = []

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

_DATA_POINTER_WARNING = "Accessing the data pointer of FakeTensor"


@dataclass(frozen=True)
class _Replaced:
    owner: object
    name: str
    original: object
    inherited: bool  # the owner (a class) had no attribute of its own by that name: undo deletes it


_lock = threading.RLock()
_base = False  # install() done
_deferred_installed = False  # install_deferred() done
_dtensor_installed = False  # change 14 made
_fsdp_installed = False  # change 15 made
_fake_cuda_installed = False
_replaced: list[_Replaced] = []  # in the order made
_filters: list[Any] = []  # the entries added to warnings.filters


def install() -> None:
    """Make the base changes (1, 2, 3, 5, 9 to 13), once, then change 15 once FSDP2 is imported; every ``fake_mode``
    entry and ``deferred_init`` call comes here."""
    if not _base:  # no lock once done
        _install_base()
    if not _fsdp_installed and FSDP_PARAM_MODULE in sys.modules:
        _install_fsdp_chunks()


def _install_base() -> None:
    global _base
    with _lock:
        if _base:
            return
        # 1. torch._dynamo wraps torch.manual_seed when it is imported (so that compiled code does not trace into
        #    it), and only if torch.manual_seed is still torch.random.manual_seed. The first fake tensor operation
        #    imports it anyway; importing it first means change 4 always wraps the same functions.
        import_dynamo()

        # 2. torch warns that reading the data pointer of a fake tensor is a bug, and copy.deepcopy of any tensor
        #    reads it (nn.Transformer deep-copies its layers): that one warning is silenced.
        warnings.filterwarnings("ignore", _DATA_POINTER_WARNING, UserWarning)
        _filters.append(warnings.filters[0])
        # 3. torch.nn.init.trunc_normal_ samples by rejection, reading values (.item(), mask.any()) that fake tensors
        #    do not have, and has no __torch_function__ hook: its helper, which every caller (transformers' copy
        #    too) goes through, hands fake tensors to their mode (deferred_init records the call as one step), or,
        #    where its bounds lie beyond anything normal_ returns, runs the one normal_ it then is (see Note
        #    [trunc_normal_ as one normal_] in _fake.trunc_normal).
        _replace(torch.nn.init, TRUNC_NORMAL_HELPER, _trunc_normal_for_fakes)
        #    The helper warns (a mean far outside [a, b]) naming its caller, two frames up, and the replacement is one
        #    frame more: the `warnings` its module warns through becomes one that does not count the replacement's
        #    frame, so the warning names the line stock torch names, and the user's filters see it as they would.
        helper = getattr(torch.nn.init, TRUNC_NORMAL_HELPER)
        module = sys.modules[helper.__wrapped__.__module__]
        if getattr(module, TRUNC_NORMAL_WARNINGS, None) is warnings:
            _replace_by(module, TRUNC_NORMAL_WARNINGS, _WarningsSkipping(helper.__code__))
        # 5. Tensor.numpy detaches its tensor first, and inside a fake mode that detach makes a fake of a real
        #    tensor, whose memory numpy then reads: real.numpy() and np.asarray(real) gave garbage, silently. Inside
        #    modattrs' fake modes a real tensor's numpy() runs outside them and returns its data, as tolist() does.
        _replace(torch.Tensor, "numpy", _numpy_of_real_tensors)
        # 9. torch's copy.deepcopy of a fake tensor clones it, but sets a copied meta storage into a view at an
        #    offset (which deferred_init cannot record): the copies of tensors sharing memory share none, unlike
        #    eager copies. A real tensor's deep copy inside a fake mode fails (a meta tensor cannot take a real
        #    storage). FakeTensor gets a __deepcopy__ of its own, and torch.Tensor's is wrapped: modattrs' fake
        #    tensors, and real ones inside modattrs' fake modes, are copied as eager copies are, into fake tensors
        #    (see Note [Deep copies that share memory as eager ones do] in _fake.mode).
        _replace(FakeTensor, "__deepcopy__", _deepcopy_of_fakes)
        _replace(torch.Tensor, "__deepcopy__", _deepcopy_of_reals_into_fakes)
        # 10. Tensor.to and Tensor.cuda ask torch.cuda to initialize before moving even a fake tensor to CUDA, and on
        #    a machine without a GPU that fails with torch's bare "Torch not compiled with CUDA enabled" (or "Found no
        #    NVIDIA driver") until fake CUDA is set up, before any mode sees the move: the same model.to("cuda")
        #    worked or not depending on what ran before in the process. A fake tensor of modattrs' modes moved there
        #    first goes to its mode, which sets up fake CUDA (deferred_init's, as for any recorded request of
        #    CUDA) or says what to do (fake_mode's).
        for name in ("to", "cuda"):
            _replace(torch.Tensor, name, _fake_cuda_asked_by_moves)
        # 11. `t.data = x` (set_data) reaches no dispatch mode, and the constant a fake tensor keeps in its __dict__
        #     stays: torch.Tensor.data becomes a property, torch's getter and setter, after which the setter gives a
        #     fake tensor the values of the data it now shares, or none. torch.tensor(...) on the meta device is
        #     made below every mode, a plain meta tensor even inside a fake mode (nn.Parameter of it too): given a
        #     fake meta tensor's data, which any operation on it inside the mode makes, it takes the meta tensor
        #     that stands for it (torch refused the mix).
        _replace_by(torch.Tensor, "data", _data_keeping_constants(torch.Tensor.data))
        # 12. torch.save and pickle of a fake tensor of modattrs' modes fail on the mode, which refuses to be pickled
        #     (a fake tensor has no values): FakeTensor gets a __reduce_ex__ of its own, torch's, which first notes
        #     the tensor so that the refusal names it.
        _replace(FakeTensor, "__reduce_ex__", _reduce_noting_fakes)
        # 13. An operation on a fake tensor outside its mode (a deferred model after deferred_init returned, which
        #     fully_shard and parallelize_module cut) reaches FakeTensor.__torch_dispatch__, which enters the mode
        #     and dispatches the operation again from the top: for a view, ten times what making it costs. A view,
        #     detach, copy_, clone or new_zeros of a fake tensor of modattrs' modes that the mode makes itself
        #     (ModattrsFakeTensorMode.takes_short_path; a construction-time constant's too) goes to the mode's
        #     handler at once, as an entered mode would get it; a tensor's device, which torch's C++ asks for each
        #     view it makes, is answered as torch's method answers it; every other operation, and every other fake
        #     tensor, goes to torch's method.
        original = vars(FakeTensor)["__torch_dispatch__"]
        FakeTensor.__torch_dispatch__ = _short_paths_outside_the_mode(original)  # type: ignore[method-assign,assignment]
        _replaced.append(_Replaced(FakeTensor, "__torch_dispatch__", original, inherited=False))
        _base = True


def install_deferred() -> None:
    """Make the base changes, then change 4, once; every ``deferred_init`` call comes here."""
    global _deferred_installed
    install()
    if not _dtensor_installed and DTENSOR_PLACEMENTS in sys.modules:
        _install_dtensor_sources()
    if _deferred_installed:  # no lock once done
        return
    with _lock:
        if _deferred_installed:
            return
        # 4. Fake tensors draw nothing, so deferred_init keeps track of where eager code would have the default
        #    CPU generator (see generator); a reseed or a state put back must be seen, also one that sets the state
        #    the generator already has. Both names of each function are wrapped.
        for name, wrap in (
            ("manual_seed", rng.seeding),
            ("set_rng_state", rng.restoring),
            ("get_rng_state", rng.saving),
        ):
            _replace_under_both_names(name, wrap)
        _deferred_installed = True


def _install_dtensor_sources() -> None:
    """Change 14, once torch.distributed.tensor is imported (importing it takes seconds: modattrs never does)."""
    global _dtensor_installed
    with _lock:
        if _dtensor_installed:
            return
        # 14. distribute_tensor and parallelize_module send rank 0's data to the other ranks unless given
        #     src_data_rank=None, with DTensor's scatter (Shard) and broadcast (Replicate) helpers, which a replay
        #     cannot run; on the ranks that do not send, the scatter names no source. Where every tensor handed to
        #     them is a deferred value of one record, the helpers that DTensor's placements call record what they
        #     deliver instead, this rank's own chunk (see Note [A scatter of a deferred source is the rank's own
        #     chunk] in _deferred.recorder); anything else goes to torch's. Only the placements' names are
        #     replaced: DTensor.from_local's check of replicated local tensors, which may differ by rank, is
        #     torch's.
        placements = sys.modules[DTENSOR_PLACEMENTS]
        if callable(getattr(placements, DTENSOR_SCATTER, None)):
            _replace(placements, DTENSOR_SCATTER, _own_chunk_scattered)
        if callable(getattr(placements, DTENSOR_BROADCAST, None)):
            _replace(placements, DTENSOR_BROADCAST, _own_values_broadcast)
        _dtensor_installed = True


def _install_fsdp_chunks() -> None:
    """Change 15, once FSDP2 is imported (modattrs never imports it)."""
    global _fsdp_installed
    with _lock:
        if _fsdp_installed:
            return
        # 15. fully_shard cuts each parameter into as many chunks as ranks and reads two of them (the rank's and the
        #     first, always the longest). A fake tensor of modattrs' modes makes each chunk in Python (its fake
        #     tensor, its record, the device torch's C++ asks of each view): at 64 ranks, nine tenths of what
        #     fully_shard of a deferred model cost. For such a tensor the chunks are made when read, each the view
        #     torch.chunk makes (narrow of the same range); every other tensor gets torch's list.
        #     Its post-forward metadata cuts the parameter once more for the size of the rank's chunk alone: while
        #     it runs, a fake tensor of modattrs' modes is cut as a meta tensor of its sizes, strides and dtype
        #     (a chunk's size depends on nothing else), which costs no fake tensor and no record. So is chunk 0 where
        #     the shard is made on a rank other than 0, read after the rank's own chunk for the padded size alone.
        module = sys.modules[FSDP_PARAM_MODULE]
        if callable(getattr(module, FSDP_CHUNKS, None)):
            _replace(module, FSDP_CHUNKS, _chunks_read_on_demand)
            owner = getattr(module, FSDP_PARAM_CLASS, None)
            if callable(getattr(owner, FSDP_POST_FORWARD_SIZES, None)):
                _replace(owner, FSDP_POST_FORWARD_SIZES, _cutting_for("sizes"))
            if callable(getattr(owner, FSDP_SHARDED_PARAM, None)):
                _replace(owner, FSDP_SHARDED_PARAM, _cutting_for("shard"))
        _fsdp_installed = True


def install_fake_cuda() -> None:
    """Make fake CUDA tensors possible, after the base changes; on a machine with a GPU, only change 8.

    Raises:
        RuntimeError: fake CUDA cannot be set up (a CPU-only build without a C++ compiler); the message says what
            to do instead.
    """
    global _fake_cuda_installed
    install()
    # 6. Some Python bindings and the autograd engine build a device guard for fake CUDA tensors too, and a build of
    #    torch without CUDA has none: torch's own FakeGuardImpl is compiled and registered. A CUDA build without a
    #    GPU has its guard, but its bindings fail to initialize CUDA before moving a tensor there: they are made to
    #    count CUDA as initialized. Neither can be undone. See cuda_guard.
    cuda_guard.require()
    if _fake_cuda_installed:
        return
    with _lock:
        if _fake_cuda_installed:
            return
        if not cuda_guard.gpu_present():
            # 7. torch's autograd engine needs a real GPU for CUDA gradients: backward passes over spoofed-CUDA fakes
            #    are simulated (see _fake.backward); everything else is torch's own. The engine's entry is replaced,
            #    under both its names, not torch.autograd.backward and grad: they take their arguments as torch does
            #    (generators too) and warn at the caller's line, and a copy imported by name is covered.
            _replace_under_both_names(ENGINE_ENTRY, backward.simulating_engine, ENGINE_ENTRY_OWNERS)
            if cuda_guard.attention_needs_the_driver():
                # 7b. On a CUDA build whose scaled_dot_product_attention asks the driver which kernel to use
                #     (torch 2.8), spoofed-CUDA fakes take torch's math kernel, its own fallback; everything else
                #     is torch's own. torch's flags to force that kernel are process-wide, so they are not used.
                _replace(torch.nn.functional, "scaled_dot_product_attention", _math_attention_for_spoofed_cuda)
        # 8. Model code asks torch.cuda about the GPU (transformers' MoE layers ask its capability to choose a
        #    kernel): inside fake_mode(fake_cuda=True) blocks, nine of its functions answer as the spoofed GPU, in the
        #    block's thread only; everywhere else they are torch's own (see _fake.spoofed_cuda).
        for name in spoofed_cuda.ANSWERS:
            _replace(torch.cuda, name, spoofed_cuda.answering(name))
        _fake_cuda_installed = True


def undo() -> None:
    """Put back every function replaced and remove the warning filter, in the reverse order; for tests.

    The CUDA device guard stays registered (a C++ registration cannot be taken back), and so does CUDA's
    initialization for the bindings of a CUDA build without a GPU: fake CUDA keeps working after
    ``install_fake_cuda``, with torch's autograd engine.
    """
    global _base, _deferred_installed, _fake_cuda_installed, _dtensor_installed, _fsdp_installed
    with _lock:
        while _replaced:
            replaced = _replaced.pop()
            if replaced.inherited:
                delattr(replaced.owner, replaced.name)
            else:
                setattr(replaced.owner, replaced.name, replaced.original)
        filters = cast(list[Any], warnings.filters)  # a list, typed as a sequence
        filters[:] = [entry for entry in filters if not any(entry is ours for ours in _filters)]
        _filters.clear()
        mutated = getattr(warnings, "_filters_mutated", None)  # private: makes warnings read its filters again
        if mutated is not None:
            mutated()
        _base = _deferred_installed = _fake_cuda_installed = _dtensor_installed = _fsdp_installed = False


def _replace(owner: object, name: str, wrap: Wrap) -> None:
    _replace_by(owner, name, wrap(getattr(owner, name)))


def _replace_by(owner: object, name: str, value: object) -> None:
    original = getattr(owner, name)
    inherited = name not in vars(owner)
    setattr(owner, name, value)
    _replaced.append(_Replaced(owner, name, original, inherited))


def _replace_under_both_names(name: str, wrap: Wrap, owners: tuple[object, object] = (torch, torch.random)) -> None:
    """Replace ``name`` in both ``owners``: one replacement when they hold one function (so they stay one), two
    when torch made them two."""
    wrapped: dict[int, Callable[..., Any]] = {}
    for owner in owners:
        original = getattr(owner, name)
        if id(original) not in wrapped:
            wrapped[id(original)] = wrap(original)
        setattr(owner, name, wrapped[id(original)])
        _replaced.append(_Replaced(owner, name, original, inherited=False))


class _WarningsSkipping(types.ModuleType):
    """The ``warnings`` module as torch code sees it through a module global, where a warning's ``stacklevel``
    does not count the frames of a replacement (``skipped``): a warning names the frame it names without modattrs,
    and the registry, module and filters that go with it are that frame's, as ``warnings.warn`` finds them."""

    def __init__(self, skipped: types.CodeType) -> None:
        super().__init__(warnings.__name__, warnings.__doc__)
        self._skipped = skipped

    def __getattr__(self, name: str) -> Any:
        return getattr(warnings, name)

    def warn(
        self,
        message: Any,
        category: type[Warning] | None = None,
        stacklevel: int = 1,
        source: Any = None,
        **kwargs: Any,
    ) -> None:
        # The frame stacklevel names, counted without the replacement's frames; those passed are counted in.
        frame = sys._getframe(1)
        passed = 0
        for _ in range(stacklevel - 1):
            frame = frame.f_back  # type: ignore[assignment]
            while frame is not None and frame.f_code is self._skipped:
                frame = frame.f_back  # type: ignore[assignment]
                passed += 1
            if frame is None:
                break
        # One more for this frame: a stacklevel under 1 names warn's caller, as warnings.warn's own does.
        warnings.warn(message, category, max(stacklevel, 1) + 1 + passed, source, **kwargs)


def _math_attention_for_spoofed_cuda(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> torch.Tensor:
        query = args[0] if args else kwargs.get("query")
        if not (isinstance(query, FakeTensor) and query.device.type == "cuda"):
            return original(*args, **kwargs)  # as given: torch takes and checks them
        return _math_attention(*args, **kwargs)

    return scaled_dot_product_attention


def _math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch's math kernel, with the parameters of ``scaled_dot_product_attention`` (the last two keyword-only)."""
    return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


def _numpy_of_real_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def numpy(*args: Any, **kwargs: Any) -> Any:  # the tensor by position, as the method takes it
        if (
            dispatch_mode_count()
            and args
            and not isinstance(args[0], FakeTensor)
            and isinstance(active_fake_mode(), ModattrsFakeTensorMode)
        ):
            with disable_current_modes():
                return original(*args, **kwargs)
        return original(*args, **kwargs)

    return numpy


def _data_keeping_constants(original: Any) -> property:
    """``Tensor.data`` (a C descriptor), whose setter then tells the fake mode what the tensor now holds."""

    def set_data(tensor: torch.Tensor, data: Any) -> None:
        original.__set__(tensor, data_for(tensor, data))  # first: it raises for data the tensor cannot take
        data_replaced(tensor, data)

    return property(original.__get__, set_data, doc=original.__doc__)


def _reduce_noting_fakes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __reduce_ex__(*args: Any, **kwargs: Any) -> Any:  # as given: torch's method takes and checks them
        if args and isinstance(args[0], FakeTensor) and isinstance(args[0].fake_mode, ModattrsFakeTensorMode):
            note_reduced(args[0])
        return original(*args, **kwargs)

    return __reduce_ex__


_DEVICE_OF = torch.ops.prim.device.default


def _short_paths_outside_the_mode(original: classmethod[Any, Any, Any]) -> classmethod[Any, Any, Any]:
    dispatch = original.__func__

    @functools.wraps(dispatch)
    def __torch_dispatch__(
        cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:  # as torch calls it
        if func is _DEVICE_OF:
            # A tensor's device, which torch's C++ asks of a fake tensor for each view it makes (twice per result of
            # a split outside the mode): answered as torch's method answers it, first thing, without its frames.
            if len(args) == 1 and type(args[0]) is FakeTensor:
                return args[0].device  # FakeTensor.device: what torch's method returns for prim.device
        elif args:
            first = args[0]
            if type(first) is FakeTensor:
                mode = first.fake_mode
                if (
                    isinstance(mode, ModattrsFakeTensorMode)
                    and active_fake_mode() is None
                    and mode.takes_short_path(func, args, kwargs)
                ):
                    return mode.__torch_dispatch__(func, types, args, kwargs)
        return dispatch(cls, func, types, args) if kwargs is None else dispatch(cls, func, types, args, kwargs)

    return classmethod(__torch_dispatch__)


def _deepcopy_of_fakes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __deepcopy__(*args: Any, **kwargs: Any) -> Any:  # as given: torch's method takes and checks them
        memo = args[1] if len(args) > 1 else kwargs.get("memo")
        tensor = args[0] if args else None
        if (
            type(tensor) is FakeTensor
            and type(memo) is dict
            and tensor.is_leaf
            and isinstance(tensor.fake_mode, ModattrsFakeTensorMode)
        ):
            return deep_copy(tensor, memo)
        return original(*args, **kwargs)

    return __deepcopy__


def _deepcopy_of_reals_into_fakes(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __deepcopy__(*args: Any, **kwargs: Any) -> Any:  # as given: torch's method takes and checks them
        memo = args[1] if len(args) > 1 else kwargs.get("memo")
        tensor = args[0] if args else None
        if (
            dispatch_mode_count()
            and type(tensor) is torch.Tensor
            and type(memo) is dict
            and tensor.is_leaf
            and tensor.layout is torch.strided
            and not tensor.is_quantized
            and tensor.device.type != "meta"
            and isinstance(active_fake_mode(), ModattrsFakeTensorMode)
        ):
            return deep_copy(tensor, memo)
        return original(*args, **kwargs)

    return __deepcopy__


def _fake_cuda_asked_by_moves(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def move(*args: Any, **kwargs: Any) -> Any:  # as given: torch's method takes and checks them
        tensor = args[0] if args else None
        if (
            isinstance(tensor, FakeTensor)
            and isinstance(tensor.fake_mode, ModattrsFakeTensorMode)
            and not cuda_guard.ready()
            and (original.__name__ == "cuda" or _names_cuda(args[1:], kwargs.get("device")))
        ):
            tensor.fake_mode.moving_to_cuda(original)
        return original(*args, **kwargs)

    return move


def _names_cuda(positional: tuple[Any, ...], device: object) -> bool:
    """Whether ``Tensor.to``'s arguments ask for a CUDA device (a bare index is one)."""
    for value in (*positional, device):
        if isinstance(value, torch.device) and value.type == "cuda":
            return True
        if isinstance(value, str) and value.split(":")[0] == "cuda":
            return True
        if isinstance(value, int) and not isinstance(value, bool):
            return True
    return False


class _ChunksOnDemand(Sequence[torch.Tensor]):
    """``torch.chunk(tensor, count, dim)``'s chunks, padded with empty tensors to ``count`` as FSDP2 pads them, each
    made when first read, as the same view (``narrow`` of the same range).

    ``chunk_0_for_size``: chunk 0, read after another chunk, is read for its size alone (FSDP2's padded size, on every
    rank but 0), and is cut from a meta tensor of the same geometry: the same size, no fake tensor, nothing to
    record. Read first (on rank 0, it is the rank's own), it is the fake view."""

    def __init__(self, tensor: torch.Tensor, count: int, dim: int, *, chunk_0_for_size: bool = False) -> None:
        size = tensor.size(dim)
        self._tensor, self._count, self._dim, self._size = tensor, count, dim, size
        self._step = -(-size // count)  # torch.chunk's: the ceiling
        self._nonempty = -(-size // self._step)  # fewer than count where count does not divide size finely
        self._chunk_0_for_size = chunk_0_for_size
        self._made: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(self._count))]
        position = operator.index(index)
        if position < 0:
            position += self._count
        if not 0 <= position < self._count:
            raise IndexError(f"chunk index {index} out of range for {self._count} chunks")
        chunk = self._made.get(position)
        if chunk is None:
            if position < self._nonempty:
                start = position * self._step
                source = self._tensor
                if position == 0 and self._chunk_0_for_size and self._made:
                    source = _meta_of_same_geometry(source)
                chunk = source.narrow(self._dim, start, min(self._step, self._size - start))
            else:
                chunk = self[0].new_empty(0)
            self._made[position] = chunk
        return chunk


class _Cut(threading.local):
    """What FSDP2 is cutting chunks for, in this thread (change 15): ``sizes``, the size of the rank's chunk alone
    (its post-forward metadata: every chunk is cut from a meta tensor); ``shard``, the rank's shard and the padded
    size (chunk 0 read after the rank's own is cut from a meta tensor)."""

    sizes = 0
    shard = 0


_cut = _Cut()


def _chunks_read_on_demand(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _chunk_with_empty(tensor: Any, num_chunks: Any, dim: Any) -> Any:  # FSDP2 calls it so
        if (
            type(tensor) is FakeTensor
            and isinstance(tensor.fake_mode, ModattrsFakeTensorMode)
            and type(num_chunks) is int
            and num_chunks > 0
            and type(dim) is int
            and tensor.dim() > 0
            and tensor.size(dim) > 0
        ):
            if _cut.sizes:
                tensor = _meta_of_same_geometry(tensor)
            return _ChunksOnDemand(tensor, num_chunks, dim, chunk_0_for_size=_cut.shard > 0)
        return original(tensor, num_chunks, dim)

    return _chunk_with_empty


def _cutting_for(purpose: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The change to an FSDP2 method that cuts chunks for ``purpose`` (``sizes`` or ``shard``, see ``_Cut``): the
    method as given, with ``purpose`` counted in this thread while it runs."""

    def change(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def cutting(*args: Any, **kwargs: Any) -> Any:  # as given: FSDP2's method
            setattr(_cut, purpose, getattr(_cut, purpose) + 1)
            try:
                return original(*args, **kwargs)
            finally:
                setattr(_cut, purpose, getattr(_cut, purpose) - 1)

        return cutting

    return change


def _meta_of_same_geometry(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s sizes, strides and dtype, made below every mode."""
    with DisableTorchFunction(), DisableTorchDispatch():
        return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")


def _own_chunk_scattered(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def mesh_scatter(*args: Any, **kwargs: Any) -> Any:  # as given: torch's helper takes and checks them
        called = _bound(signature, args, kwargs)
        chunks = called.get("scatter_list")
        if (
            called.get("async_op") is False
            and isinstance(chunks, (list, tuple))
            and recorded_together([called.get("output"), *chunks])
        ):
            mesh, mesh_dim = called["mesh"], called["mesh_dim"]
            if mesh.get_coordinate() is not None and len(chunks) == mesh.size(mesh_dim):
                group_src = called.get("group_src", 0)
                refuse_unless_ranks_agree(chunks, mesh.get_group(mesh_dim), group_src, "scatter")
                scatter_own_chunk(called["output"], chunks, mesh.get_local_rank(mesh_dim))
                return None  # as for meta tensors: no work to wait for
        return original(*args, **kwargs)

    return mesh_scatter


def _own_values_broadcast(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def mesh_broadcast(*args: Any, **kwargs: Any) -> Any:  # as given: torch's helper takes and checks them
        called = _bound(signature, args, kwargs)
        tensor, mesh = called.get("tensor"), called.get("mesh")
        if (
            called.get("async_op") is False
            and isinstance(tensor, FakeTensor)
            and recorded_together([tensor])
            and mesh is not None
            and mesh.get_coordinate() is not None
        ):
            group = mesh.get_group(called["mesh_dim"])
            refuse_unless_ranks_agree([tensor], group, called.get("group_src", 0), "broadcast")
            return None  # the source's values are this rank's own: nothing to record
        return original(*args, **kwargs)

    return mesh_broadcast


def _bound(signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call by name, defaults included; empty if they do not fit (torch's call then says why)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return {}
    bound.apply_defaults()
    return dict(bound.arguments)


def _trunc_normal_for_fakes(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def trunc_normal(*args: Any, **kwargs: Any) -> torch.Tensor:  # as given: the helper takes and checks them
        tensor = args[0] if args else kwargs.get("tensor")
        if not isinstance(tensor, FakeTensor):
            return original(*args, **kwargs)
        if isinstance(tensor.fake_mode, ModattrsFakeTensorMode):
            # Bounds beyond anything normal_ returns: the helper is one normal_, which a replay models (windows
            # draw only a rank's shard of it); see Note [trunc_normal_ as one normal_] in _fake.trunc_normal.
            one = trunc_normal_as_one_normal(original, tensor.dtype, args, kwargs)
            if one is not None and helper_draws_one_normal(original):
                with torch.no_grad():
                    tensor.normal_(one.mean, one.std, generator=one.generator)
                return tensor
            return tensor.fake_mode.opaque_call(original, args, kwargs, tensor)
        return tensor  # a fake of torch's own mode: there are no values to write, as for meta tensors

    trunc_normal.__modattrs_opaque__ = True  # type: ignore[attr-defined]  # register_opaque_init: registered already
    return trunc_normal
