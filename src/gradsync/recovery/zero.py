"""ZeRO-1 under :class:`~gradsync.recovery.Recovery`: no slice of the optimizer state is lost
with one rank, and the survivors go on exactly.

[Note: ZeRO-1 under Recovery]
Under ``model.shard_optimizer()`` the optimizer state of rank ``j``'s slices lives on ``j``
alone. Recovery keeps a second copy on ``j``'s buddy, rank ``j - 1``, kept current by stepping
it from the same reduced gradient, not by sending it ([Note: a mirror of the neighbour's slices]
in ``optim/mirror.py``): each rank holds ``2/N`` of the state. After a loss:

1. *Who holds what.* A sharded step is a collective (an agreement, then one all-gather per
   bucket), so unlike a plain optimizer's it can be cut between ranks. Each rank steps every
   slice it holds (its own and its mirror) or none: the slice steps issue no collective,
   and the gathers are only started between them (their failures are seen once all
   slices have stepped). A rank counts as having *stepped* in the step from then on, not when
   ``step()`` returns: it holds that step's result for its own slice and its mirror, the
   parameters included (the mirror's stepped copy). A rank that had not stepped holds the
   step's start for both, as its whole flat buffer does (no gather ran into it).
2. *Losing an owner and its buddy together* (ranks ``j - 1`` and ``j``) loses ``j``'s slices:
   the restart path, with ``NoRecoveryError`` naming both. Any other loss leaves every slice
   with its owner or its buddy.
3. *No survivor stepped*: the step is redone from its start, as without ZeRO.
4. *Some survivor stepped*: every slice must hold the step's result, and the step is replayed
   without its optimizer step ([Note: rolling a step back] in ``rollback.py``). If the loss
   split them (one stepped, another had not), none of them could finish the step (the
   gathers need every slice), so those that stepped still have the step's gradient in
   ``.grad``, exactly as their slices stepped from it (after any clipping): the first of them
   sends it, and each survivor that had not stepped steps its own slice and its mirror from
   it, as it would have (``recut.roll_forward``).
5. *Re-cut.* Every old slice comes from its owner, else from its buddy's mirror; every member
   assembles the parameters and a full state dict from them, the buckets are cut again for
   the new world size and each member keeps its new slices, then its new mirror is filled from
   its new neighbour (``recut.recut``). This moment costs the full state on every member (an
   object all-gather): bounded, but not ``2/N``; a point-to-point re-cut would move only the
   ranges each member lacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from gradsync.ddp.sharding import ShardedSteps
from gradsync.errors import UsageError
from gradsync.optim.mirror import Mirror
from gradsync.optim.sharded import ShardedOptimizer
from gradsync.recovery.membership import Report
from gradsync.recovery.recut import recut, refuse_lost_pairs, roll_forward
from gradsync.recovery.rollback import OptimizerSteps, holder_of


def steps_for(model: Any, optimizer: torch.optim.Optimizer) -> OptimizerSteps:
    """The record of optimizer steps that Recovery keeps for ``optimizer`` (a collective for a
    sharded one: its mirrors are filled)."""
    if isinstance(optimizer, ShardedOptimizer):
        assert model.sharded_steps is not None  # checked by coverage.py
        return MirroredSteps(optimizer, model.sharded_steps)
    return OptimizerSteps(optimizer)


class MirroredSteps(OptimizerSteps):
    """:class:`OptimizerSteps` for a wrapper's sharded optimizer: a step counts once this
    rank's slices have stepped, and a loss re-cuts the state ([Note: ZeRO-1 under Recovery])."""

    def __init__(self, optimizer: ShardedOptimizer, sharded: ShardedSteps) -> None:
        super().__init__(optimizer)
        self.sharded, self.zero = sharded, optimizer
        self.mirror = Mirror(optimizer)
        self.mirror.stepped = self._slices_stepped
        self.mirror.sync(optimizer.process_group)
        optimizer.mirror = self.mirror
        self._grads: list[torch.Tensor | None] | None = None  # what the slices stepped from

    def _before_step(self) -> None:
        super()._before_step()
        # An LR of 0 (a warm-up's first step) is a step: the outer optimizer has no state of
        # its own for _creates_state to look at.
        self._counted = self.step is not None

    def _after_step(self) -> None:
        """Counted when the slices stepped (before the gathers), not when step() returns."""

    def _slices_stepped(self) -> None:
        if self._counted:
            self.stepped_in = self.step
            self._grads = [p.grad for b in self.zero.buckets for p in b.params]

    def begin(self, step: int) -> None:
        self._grads = None  # references only: the step's gradients, until the next step
        super().begin(step)

    def settle(
        self, target: int, reports: Mapping[int, Report], order: Iterable[int], module: nn.Module
    ) -> None:
        order = list(order)
        opt, mirror = self.zero, self.mirror
        refuse_lost_pairs(opt.world_size, set(order))
        holder = holder_of(target, reports, order)
        self.replay = None if holder is None else target
        if holder is None:  # every flat buffer holds the step's start: so does each mirror
            for mb in mirror.buckets:
                mb.take()
        elif any(reports[r].stepped != target for r in order):
            stepped = self.stepped_in == target
            if stepped and self._grads is None:
                raise UsageError("a survivor that stepped kept no gradient to hand on")
            if roll_forward(opt, mirror, holder, self._grads if stepped else None):
                self.sharded.count_step()
        if holder is not None:
            self.stepped_in = target
        recut(opt, mirror, order)
        self._grads = None

    def remove(self) -> None:
        super().remove()
        self.zero.mirror = None
