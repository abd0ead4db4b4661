"""The deterministic mode on the step's path: its side of [Note: the mode seam] (``mode.py``).

:class:`LeafMode` is what the wrapper's state holds with ``deterministic=L``; its reducer,
:class:`LeafReducer`, keeps each leaf's gradients apart in :class:`~gradsync.ddp.leaf_buckets.
LeafBucket` s and sums them with the :class:`~gradsync.comm.tree_exchange.TreeExchange`, in the
fixed tree's order ([Note: the fixed leaf tree] in ``comm/tree.py``). What the mode needs to give
the same bits, and what it refuses, is ``deterministic.py``'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommHook
from gradsync.comm.tree import leaf_range
from gradsync.comm.tree_exchange import TreeExchange
from gradsync.ddp.buckets import Bucket
from gradsync.ddp.deterministic import check_compute, check_sharding, refuse_mesh
from gradsync.ddp.leaf_buckets import LeafBucket
from gradsync.ddp.mode import Mode
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reducer import Reducer
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout


class LeafReducer(Reducer):
    """The reducer of the deterministic mode: a micro-batch is a leaf, kept apart until the
    step's reduction sums every rank's leaves in the tree's order; every scale comes after
    the sum ([Note: what the same bits need] in ``deterministic.py``)."""

    takes_grads = "deterministic= (each leaf's gradients are taken into the bucket and freed)"
    compares_windows = False  # ranks run different numbers of leaves per step

    @property
    def exchange(self) -> TreeExchange:
        assert isinstance(self.comm_hook, TreeExchange)  # LeafMode.comm_hook's; no other
        return self.comm_hook

    def _bucket(self, b: int, spec: BucketSpec) -> Bucket:
        assert self.options.deterministic is not None
        first = leaf_range(self.options.deterministic, self.world_size, self.rank).start
        params = [self.params[i] for i in spec.param_indices]
        layouts = [self.layouts[i] for i in spec.param_indices]
        tail_numel = self.tail.numel if b == 0 else 0
        return LeafBucket(spec, params, first, self.main_grads, tail_numel, layouts)

    def _leaf_buckets(self) -> list[LeafBucket]:
        return [b for b in self.buckets if isinstance(b, LeafBucket)]

    def _accumulation_began(self) -> None:
        super()._accumulation_began()
        # Under no_sync() the leaf ends with its backward: an engine callback.
        torch.autograd.Variable._execution_engine.queue_callback(self._end_leaf)

    def _end_leaf(self) -> None:
        for bucket in self._leaf_buckets():
            bucket.end_leaf()

    def _claim_buffers(self, contributes: bool) -> None:
        """The step's reduction begins: with this rank's last leaf (``contributes``) or, in a
        join round, with none more. Starts the exchange of every rank's leaf count."""
        super()._claim_buffers(contributes)
        buckets = self._leaf_buckets()
        if not buckets:
            return
        for bucket in buckets:
            bucket.contributes = contributes
        leaves_here = buckets[0].leaves_done + int(contributes)
        what = "every rank's leaf count of this step"
        wait = lambda work: self.deadline.wait(work, what)  # noqa: E731
        self.exchange.begin_step(leaves_here, buckets[0].buffer.device, wait)

    def _pre_division(self) -> float | None:
        return None  # every scale after the sum; the tree's exchange divides by nothing

    def _post_divide(self, grads: list[torch.Tensor], total_items: float) -> None:
        """``mean`` divides by the step's leaves over all ranks; ``item_mean`` as always."""
        if self.reduction.name != "mean":
            super()._post_divide(grads, total_items)
            return
        layout = self.exchange.layout  # known once the first bucket was launched
        assert layout is not None
        torch._foreach_div_(grads, float(layout.total))

    def _reset(self) -> None:
        self.exchange.finish()
        super()._reset()


class LeafMode(Mode):
    """``deterministic=L``: ``L`` leaves per step, summed in one fixed tree."""

    reducer_class = LeafReducer
    # Ranks run different numbers of leaves per step: one handshake per step, at its
    # synchronised forward ([Note: leaves and join] in deterministic.py).
    handshake_each_forward = False

    def __init__(self, leaves: int) -> None:
        self.leaves = leaves

    def check(
        self,
        options: SyncOptions,
        device: torch.device,
        world_size: int,
        buffers: bool,
        mesh_axes: tuple[str, ...],
        layouts: Sequence[GradLayout | None],
    ) -> None:
        refuse_mesh(mesh_axes, layouts)
        check_compute(self.leaves, device, world_size, options.broadcast_buffers and buffers)

    def check_sharding(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        params: Sequence[torch.Tensor],
        deadline: Deadline,
    ) -> None:
        check_sharding(optimizer_class, defaults, params, deadline)

    def comm_hook(
        self,
        options: SyncOptions,
        group: dist.ProcessGroup | None,
        named: list[tuple[str, nn.Parameter]],
        owner: nn.Module,
    ) -> CommHook:
        return TreeExchange(self.leaves, group)


def mode_of(options: SyncOptions) -> Mode:
    """The mode ``options`` ask for: the default, or the deterministic mode's."""
    return Mode() if options.deterministic is None else LeafMode(options.deterministic)
