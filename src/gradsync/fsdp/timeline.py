"""The straggler timeline of :func:`~gradsync.fsdp.replicate_gradients`: every data-parallel
rank's step phases, exchanged once per step, judged as the wrapper's are (``gradsync.timing``).

[Note: FSDP2's waits]
The wrapper's phases rest on one fact: a rank waits for the others only in the step's last
collective, so the rank that arrived last there is the one the others waited for. Under FSDP2
that is not so: the ranks of a shard group meet in every module's all-gather in forward. A rank
slow in its forward makes its shard peers wait at the next module's all-gather, inside *their*
forward, and by the end of the step both have been equally busy. So the time each rank spends
in FSDP2's forward all-gathers is measured and counted as waiting (``exposed_comm``), not as
forward: every ``FSDPModule`` gets a forward pre-hook ahead of FSDP2's (which all-gathers the
module's parameters and waits for them) and one after it, and the time between the two is
waiting. What is left in ``forward`` is this rank's own work, and the slow rank is the one
named. In backward the shard ranks meet again, in the all-gathers of parameters resharded after
forward and in every group's reduce-scatter, both issued from torch's own autograd hooks. There
gradsync times the collectives themselves: each module's all-gather and reduce-scatter is
FSDP2's own, wrapped through FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``,
and the time a call blocks inside backward is waiting too. (On CPU FSDP2 issues both
synchronously; on a GPU a call returns once the collective is queued, and that wait shows in
the stream instead.)

The records travel in one small all-reduce over gradsync's ranks and one over the shard
ranks at the end of each synchronised backward, each rank writing its own slots of a zeroed
tensor (``timing/slots.py``), so every data-parallel rank ends with every rank's record; that
pair of collectives is also where all of them leave the step together, the shared clock the
phases are measured from. As on the wrapper, a record is the interval before the step that
carries it, so reports run one step behind.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_leaves

from gradsync.failfast.deadline import Deadline
from gradsync.fsdp.layout import wrap_collectives
from gradsync.timing.slots import fields_per_rank
from gradsync.timing.timeline import StepTimeline


class FSDPTimeline:
    """Marks this rank's phases at FSDP2's hooks and exchanges every rank's record per step.

    ``grid``: the global ranks of every data-parallel rank (shard x gradsync's axes), sorted;
    a rank is reported by its index there (its global rank when they are the whole job); the
    phases are read from ``across``'s device (CUDA events there, as the wrapper's)."""

    def __init__(
        self,
        every: int,
        root: nn.Module,
        modules: list[FSDPModule],
        grid: list[int],
        across: Deadline,
    ) -> None:
        me = grid.index(dist.get_rank())
        self.timeline = StepTimeline(every, me, len(grid), across.device)
        self.recorder = self.timeline.recorder
        self.width = fields_per_rank(0)  # no buckets here: no launch times
        self.handles: list[Any] = []
        self.in_backward = False  # FSDP2's collectives are timed as waiting there
        if not self.timeline.enabled:
            return
        clock = self.recorder.clock
        for m in modules:
            assert isinstance(m, nn.Module)
            arrived: list[Any] = []  # the mark before FSDP2's pre-forward, while it waits

            def before(module: nn.Module, args: Any, arrived: list[Any] = arrived) -> None:
                if torch.is_grad_enabled():
                    if module is root:  # also the end of a no-sync backward
                        self.recorder.forward_began()
                        self.in_backward = False
                    arrived[:] = [clock.mark()]

            def gathered(module: nn.Module, args: Any, arrived: list[Any] = arrived) -> None:
                if arrived:
                    self.recorder.waited("forward", arrived.pop(), clock.mark())

            self.handles.append(m.register_forward_pre_hook(before, prepend=True))
            self.handles.append(m.register_forward_pre_hook(gathered))
            wrap_collectives(m, lambda inner: _Timed(inner, self))
        self.handles.append(root.register_forward_hook(self._forward_ended, prepend=True))

    def _forward_ended(self, module: nn.Module, args: Any, output: Any) -> None:
        """The root's forward is done (before FSDP2's post-forward): its backward begins at
        the output's gradient, whose end a callback marks (a no-sync backward too)."""
        if not torch.is_grad_enabled():
            return
        self.recorder.forward_ended()
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._backward_began)
                return

    def _backward_began(self, grad: torch.Tensor) -> None:
        self.recorder.backward_began()
        self.in_backward = True

    def exchange(self, across: Deadline, shard: Deadline, step: int) -> None:
        """End of synchronised backward ``step`` (counted from 0), its gradients reduced: every
        rank's record of the interval before it to every rank, then this interval ends."""
        self.in_backward = False
        if not self.timeline.enabled:
            return
        size = self.timeline.world_size * self.width
        values = torch.zeros(size, dtype=torch.float64, device=across.device)
        mine = self.timeline.outgoing(0)
        if mine is not None:
            at = self.timeline.rank * self.width
            values[at : at + self.width] = torch.tensor(mine, dtype=torch.float64)
        what = f"the step timeline of synchronised backward {step}"
        across.all_reduce(values, what)
        shard.begin(what)
        shard.all_reduce(values, what)
        self.recorder.synced()
        self.timeline.received(values.tolist(), step)

    def abandon(self) -> None:
        """A step that raised is not measured."""
        self.recorder.abandon()


class _Timed:
    """One of FSDP2's collectives (an all-gather or a reduce-scatter, FSDP2's own or one set
    with ``set_custom_*``), the time a call blocks inside backward counted as waiting ([Note:
    FSDP2's waits])."""

    def __init__(self, inner: Any, owner: FSDPTimeline) -> None:
        self.inner, self.owner = inner, owner

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.owner.in_backward or kwargs.get("async_op", False):
            return self.inner(*args, **kwargs)
        clock = self.owner.recorder.clock
        begin = clock.mark()
        work = self.inner(*args, **kwargs)
        self.owner.recorder.waited("backward", begin, clock.mark())
        return work
