"""Exact randomness for deferred init: where torch's default CPU generator is at each point of a record, which of
its outputs each random kernel takes, and moving it ahead without drawing. The rest of the engine calls only the
names below; the modules behind them are, top down:

- ``generator``: the generator timeline. Where eager code would have the generator while records are made (the
  recorder and the wrapped ``torch.manual_seed``, ``set_rng_state`` and ``get_rng_state`` tell it), where it is at a
  point of a record (``state_at``), and, for a replay, the ``Walk`` along the record's draws: set the state a draw
  is run from, draw a part of a fill into a tensor, jump to a point.
- ``draws``: models of torch's CPU random kernels (``Pattern``): how many outputs a call takes and which element
  each output goes to, so that any part of a fill is drawn alone, checked against torch at the first use of each
  kind of call.
- ``rejection``: ``trunc_normal_`` within ``normal_``'s reach as rounds of ``normal_`` (``Rejection``): any part
  of it drawn alone once its rounds are counted, without holding the tensor.
- ``mt19937``: jumping the MT19937 state ahead by any number of outputs (``jumped_state``), with the methods this
  CPU has side by side behind one function.
- ``kernels``: torch's CPU ``uniform_`` drawn by modattrs' own kernel, the same bits several times faster, checked
  against torch's where it runs; ``draws``' fills call it, and leave to torch's kernel what it does not take.

The replay and the shard-local planner (``windows``) reach the generator through one ``Walk`` per replay, as
DTensor's random operations reach theirs through one tracker (``torch/distributed/tensor/_random.py``); the
kernels' models and the jump sit behind it as implementations behind one interface, as the key implementations of
JAX's ``jax/_src/prng.py`` do.
"""

from modattrs._deferred.rng.draws import JUMP_COST, PAIRS, Pattern, count_depends_on_values
from modattrs._deferred.rng.generator import (
    Walk,
    drew,
    lock,
    new_record,
    replaying,
    reset_before_draw,
    reset_for_other_device,
    restoring,
    saving,
    seeding,
    settle,
    state_at,
    undone_on_failure,
)

__all__ = [
    "JUMP_COST",
    "PAIRS",
    "Pattern",
    "Walk",
    "count_depends_on_values",
    "drew",
    "lock",
    "new_record",
    "replaying",
    "reset_before_draw",
    "reset_for_other_device",
    "restoring",
    "saving",
    "seeding",
    "settle",
    "state_at",
    "undone_on_failure",
]
