"""Views of deferred tensors are written into the record when something uses them (Note [Views written down when
used] in ``modattrs/_deferred/recorder.py``): whatever is done with them, before and after, materializing gives the
tensors, the views between them and the generator's state that eager code gives."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from modattrs.deferred import deferred_init, is_deferred, materialize_module

Step = tuple[str, int, int, int]


def run(held: list[Tensor], step: Step) -> None:
    """One step of a program on ``held`` (the base first, then views of it), its choices taken modulo what is
    there, so that eager code and a deferred module take the same ones."""
    kind, a, b, c = step
    tensor = held[a % len(held)]
    if kind == "narrow" and tensor.dim():
        dim = b % tensor.dim()
        start = c % (tensor.size(dim) + 1)
        held.append(tensor.narrow(dim, start, (b + c) % (tensor.size(dim) - start + 1)))
    elif kind == "whole" and tensor.dim():  # a slice keeping all of it, and a detach: aliases, as FSDP2 makes
        dim = b % tensor.dim()
        held.append(tensor.narrow(dim, 0, tensor.size(dim)) if c % 2 else tensor.detach())
    elif kind == "flatten" and tensor.is_contiguous():
        held.append(tensor.view(-1))
    elif kind == "transpose" and tensor.dim() == 2:
        held.append(tensor.t())
    elif kind == "drop" and len(held) > 1:
        del held[1 + a % (len(held) - 1)]  # the base stays
    elif kind == "move base":  # in place: the views made before keep viewing where it was
        base = held[0]
        if b % 3 == 0 and base.dim() == 2:
            base.t_()
        elif b % 3 == 1 and base.dim() < 4:
            base.unsqueeze_(0)
        elif base.dim() > 2 and base.size(0) == 1:
            base.squeeze_(0)
    elif kind == "rebind base":  # no operation: the views made before keep viewing the memory it had
        held[0].data = held[0].new_zeros(3 + b % 2, 5)
    elif kind == "write":
        if b % 3 == 0:
            tensor.normal_()
        elif b % 3 == 1:
            tensor.fill_(float(c))
        else:
            tensor.mul_(2.0)


class Holder(nn.Module):
    def __init__(self, steps: list[Step], during_construction: bool) -> None:
        super().__init__()
        self.register_buffer("base", torch.empty(4, 6).uniform_())
        if during_construction:
            self.follow(steps)

    def follow(self, steps: list[Step]) -> None:
        held = [self.base]
        with torch.no_grad():
            for step in steps:
                run(held, step)
        for index, tensor in enumerate(held[1:]):
            self.register_buffer(f"view{index}", tensor)


def described(module: nn.Module) -> list[tuple[object, ...]]:
    """Each buffer's geometry and values, which buffers share memory, and where each lies in that memory against
    the others sharing it (a storage that only views hold is made only as large as they need: see Note [Replaying
    only the part that is kept])."""
    buffers = {name: tensor for name, tensor in module.named_buffers() if tensor.numel()}  # empty ones view nothing
    storages = [tensor.untyped_storage().data_ptr() for tensor in buffers.values()]
    lowest: dict[int, int] = {}
    for storage, tensor in zip(storages, buffers.values(), strict=True):
        lowest[storage] = min(lowest.get(storage, tensor.storage_offset()), tensor.storage_offset())
    described = []
    for (name, tensor), storage in zip(buffers.items(), storages, strict=True):
        offset = tensor.storage_offset() - lowest[storage]
        described.append((name, tensor.shape, tensor.stride(), storages.index(storage), offset, tensor.tolist()))
    return described + [(name, tensor.shape) for name, tensor in module.named_buffers() if not tensor.numel()]


steps = st.lists(
    st.tuples(
        st.sampled_from(["narrow", "whole", "flatten", "transpose", "drop", "move base", "rebind base", "write"]),
        st.integers(0, 30),
        st.integers(0, 30),
        st.integers(0, 30),
    ),
    max_size=14,
)


@given(steps=steps, during_construction=st.booleans())
# A view next to an empty one on its storage, its base rebound: the empty one's real twin holds none of the storage.
@example(steps=[("narrow", 0, 0, 0), ("narrow", 0, 0, 1), ("rebind base", 0, 0, 0)], during_construction=False)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_views_made_kept_dropped_and_written_through_materialize_as_eager_code_makes_them(
    steps: list[Step], during_construction: bool
) -> None:
    torch.manual_seed(0)
    eager = Holder(steps, during_construction)
    if not during_construction:
        eager.follow(steps)
    eager_state = torch.get_rng_state()
    torch.manual_seed(0)
    deferred = deferred_init(Holder, steps, during_construction)
    if not during_construction:
        deferred.follow(steps)  # after deferred_init returned, as FSDP2 cuts a deferred model
    materialize_module(deferred)
    assert not is_deferred(deferred)
    assert described(deferred) == described(eager)
    assert torch.equal(torch.get_rng_state(), eager_state)
