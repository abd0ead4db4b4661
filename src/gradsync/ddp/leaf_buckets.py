"""The deterministic mode's bucket: each leaf's gradients kept apart, added in tree order.

A :class:`LeafBucket` owns its parameters' gradients like an ``AccumulatingBucket`` (each hook
adds the gradient into the buffer, in the buffer's dtype, and frees ``.grad``), but the buffer
holds one leaf at a time: when a leaf's backward ends, its gradients move into the bucket's
:class:`~gradsync.comm.tree.TreeFold`, which adds them to the others in the fixed tree's order
([Note: the fixed leaf tree] in ``comm/tree.py``), and the buffer starts the next leaf from
zero. The last leaf of a step is the synchronised backward: when the bucket is full its leaf
joins the fold too, and the comm hook (``comm/tree_exchange.py``) reads :attr:`pieces`. After
the exchange the buffer holds the step's sum, which goes out as with the other buckets: into
``.grad`` (and ``p.main_grad`` with ``main_grad_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.comm.hook import CommHook
from gradsync.comm.tree import Node, TreeFold
from gradsync.comm.tree_exchange import TreeExchange
from gradsync.ddp.buckets import AccumulatingBucket, Bucket
from gradsync.ddp.plan import BucketSpec
from gradsync.failfast.deadline import Deadline


class LeafBucket(AccumulatingBucket):
    """An accumulating bucket whose window is a fold of leaves starting at leaf ``first``."""

    def __init__(
        self,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        first: int,
        main_grads: bool,
        tail_numel: int = 0,
    ) -> None:
        self.first, self.main_grads = first, main_grads  # first: where this rank's block starts
        self.contributes = True  # False in a join round: no leaf of this rank's in the sum
        self.fold = TreeFold(first)
        super().__init__(spec, params, tail_numel=tail_numel)

    def reset(self) -> None:
        super().reset()
        self.fold = TreeFold(self.first)
        self.contributes = True

    def end_leaf(self) -> None:
        """A leaf's backward ended: its gradients join the fold; the buffer starts from zero."""
        self.fold.add(self.grads.clone())
        self.grads.zero_()

    @property
    def pieces(self) -> list[tuple[Node, torch.Tensor]]:
        """This rank's pieces of the step (after the last leaf joined them)."""
        return self.fold.pieces()

    def gather(self, scale: float | None) -> None:
        # The synchronised backward's leaf is complete in this bucket: it joins the fold.
        assert scale is None, "the deterministic mode scales once, after the sum"
        if self.contributes:
            self.end_leaf()

    def flag_finite(self) -> None:
        """Whether each parameter's gradient is finite in every leaf of this rank."""
        pieces = [t for _, t in self.pieces]
        self.local_finite = torch.stack([
            torch.stack([torch.isfinite(t[a : a + v.numel()]).all() for t in pieces]).all()
            if pieces else torch.ones((), dtype=torch.bool, device=v.device)
            for a, v in zip(self.spec.offsets, self.views, strict=True)
        ])  # fmt: skip

    def results(self, counts: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.main_grads:
            return super().results(counts)
        return Bucket.results(self, counts)

    def write_back(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.main_grads:
            return super().write_back(slot)
        return Bucket.write_back(self, slot)


class NoLeaves:
    """The reducer's leaf bookkeeping outside the deterministic mode: none."""

    on = False

    def end_leaf_with_backward(self) -> None:
        pass

    def begin_reduction(self, contributes: bool) -> None:
        pass

    def total(self) -> int | None:
        return None

    def finish(self) -> None:
        pass


class LeafSteps(NoLeaves):
    """The reducer's leaf bookkeeping in the deterministic mode: its :class:`LeafBucket` s and
    the :class:`~gradsync.comm.tree_exchange.TreeExchange` they travel by."""

    on = True

    def __init__(
        self, buckets: Sequence[LeafBucket], exchange: TreeExchange, deadline: Deadline
    ) -> None:
        self.buckets, self.exchange, self.deadline = list(buckets), exchange, deadline

    @classmethod
    def of(cls, buckets: Sequence[Bucket], hook: CommHook, deadline: Deadline) -> NoLeaves:
        """The bookkeeping of ``buckets``: none unless they are leaf buckets."""
        if not isinstance(hook, TreeExchange):
            return NoLeaves()
        assert all(isinstance(b, LeafBucket) for b in buckets)
        return cls(buckets, hook, deadline)  # type: ignore[arg-type]

    def end_leaf_with_backward(self) -> None:
        """Under ``no_sync()``: the leaf whose backward runs ends with it (an engine callback)."""
        torch.autograd.Variable._execution_engine.queue_callback(self._end_leaf)

    def _end_leaf(self) -> None:
        for bucket in self.buckets:
            bucket.end_leaf()

    def begin_reduction(self, contributes: bool) -> None:
        """The step's reduction begins: with this rank's last leaf (``contributes``) or, in a
        join round, with none more. Starts the exchange of every rank's leaf count."""
        if not self.buckets:
            return
        for bucket in self.buckets:
            bucket.contributes = contributes
        leaves_here = self.buckets[0].fold.count + int(contributes)
        what = "every rank's leaf count of this step"
        wait = lambda work: self.deadline.wait(work, what)  # noqa: E731
        self.exchange.begin_step(leaves_here, self.buckets[0].buffer.device, wait)

    def total(self) -> int | None:
        """The step's leaves, over all ranks (after the first bucket was launched)."""
        layout = self.exchange.layout
        assert layout is not None
        return layout.total

    def finish(self) -> None:
        self.exchange.finish()
