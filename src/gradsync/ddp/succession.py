"""A reducer replaced by another with other buckets, mid-training: what carries over.

``bucket_cap_mb="auto"`` switches its bucket plan at a step boundary (``autotune.py``) and
``shard_optimizer()`` swaps in sharded buckets (``optim/overlap.py``); each builds a new
:class:`Reducer` over the same parameters, which retires the old one (its hooks are removed;
see ``_OWNERS`` in ``reducer.py``). The new one continues:

- the step count, so that step tags and checkpoints go on (the same parameter watch);
- the window, if one is open. Between a reduction and the next training forward no training
  micro-batch is pending, but an eval-mode forward with grad enabled opens a window (see
  [Note: eval forwards keep main gradients] in ``main_grads.py``), and under ``no_sync()`` its
  backward's gradients wait for the next synchronised step. The new reducer takes over which
  parameters were used (the used flags: without them a parameter that only the eval backward
  reached counts as unused everywhere, and each rank keeps its own ``.grad``) and, with main
  gradients, the gradients themselves, which accumulate in the buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gradsync.comm import CommHook
from gradsync.ddp.buckets import BucketSpec
from gradsync.ddp.reducer import Reducer, _Phase

if TYPE_CHECKING:
    from gradsync.optim.overlap import GradientShards


def successor(
    old: Reducer,
    specs: Sequence[BucketSpec],
    *,
    comm_hook: CommHook | None = None,
    sharding: GradientShards | None = None,
) -> Reducer:
    """A reducer of ``old``'s parameters, watch, reduction and options with other buckets (and
    comm hook or sharding, if given) that continues ``old``'s step count and open window.
    Building it retires ``old``; call it only between optimizer steps."""
    phase = old.phase  # before the new reducer retires the old one
    hook = old.comm_hook if comm_hook is None else comm_hook
    new = Reducer(
        old.watch, specs, deadline=old.deadline, comm_hook=hook,
        reduction=old.reduction, find_unused_parameters=old.find_unused_parameters,
        gradient_as_bucket_view=old.gradient_as_bucket_view,
        check_finite=old.check_finite, layouts=old.layouts, sharding=sharding,
        main_grads=old.main_grads,
    )  # fmt: skip
    new.num_reductions = old.num_reductions  # the same watch: step tags continue
    if phase in (_Phase.ACCUMULATING, _Phase.ARMED):
        _continue_window(old, new, phase)
    return new


def _continue_window(old: Reducer, new: Reducer, phase: _Phase) -> None:
    new.phase, new.used, new.num_active = phase, old.used, old.num_active
    new.window_forwards, new.window_no_sync = old.window_forwards, old.window_no_sync
    new.changes = old.changes
    if not new.main_grads:
        return  # the window's gradients are in .grad, where autograd put them
    for index, (b, slot) in new.location.items():
        old_b, old_slot = old.location[index]
        new.buckets[b].views[slot].copy_(old.buckets[old_b].views[old_slot])
