"""The deterministic mode's bucket: each leaf's gradients kept apart, added in tree order.

A :class:`LeafBucket` owns its parameters' gradients like an ``AccumulatingBucket`` (each hook
takes the gradient, in the bucket's dtype, and frees ``.grad``), but keeps each leaf apart, as
the list of its gradients: when a leaf's backward ends, that list joins the bucket's
:class:`~gradsync.comm.tree.TreeFold`, which adds it to the others in the fixed tree's order
([Note: the fixed leaf tree] in ``comm/tree.py``). The last leaf of a step is the synchronised
backward: when the bucket is full its leaf joins the fold too, and the comm hook
(``comm/tree_exchange.py``) reads :attr:`pieces`. The exchange writes the step's sum into the
bucket's own buffer, which goes out as with the other buckets: into ``.grad`` (and
``p.main_grad`` with ``main_grad_dtype``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.comm.tree import Node, TreeFold
from gradsync.ddp.buckets import Bucket
from gradsync.ddp.main_grads import AccumulatingBucket
from gradsync.ddp.plan import BucketSpec
from gradsync.mesh.dtensors import GradLayout


class LeafBucket(AccumulatingBucket):
    """An accumulating bucket whose window is a fold of leaves starting at leaf ``first``.

    A leaf is the list of its parameters' gradients as autograd produced them (in the bucket's
    dtype): a hook takes ``.grad`` over and frees it, so no leaf costs a copy of the bucket, and
    the fold adds lists with one ``_foreach_add_``. Only the pieces of the step, a few, are laid
    out flat, for the exchange.

    [Note: autograd adds the first level]
    The tree's first level adds leaves in pairs, ``2i + (2i + 1)``, and that is what autograd
    computes when it accumulates leaf ``2i + 1``'s gradient into a ``.grad`` holding leaf
    ``2i``'s: ``old + new``, one rounding, the same bits (addition commutes). So a hook under
    ``no_sync()`` leaves an even leaf's gradient in ``.grad``, and the next leaf's hook takes
    the pair's sum: half the folding and half the fresh gradient tensors. Not where the bucket
    widens the gradients (``main_grad_dtype``): autograd would add them in the narrower dtype.
    A synchronised backward always takes what ``.grad`` holds (the step's last leaf has no
    right neighbour to wait for), and so does a join round after an even leaf.
    """

    def __init__(
        self,
        spec: BucketSpec,
        params: Sequence[nn.Parameter],
        first: int,
        main_grads: bool,
        tail_numel: int = 0,
        layouts: Sequence[GradLayout | None] | None = None,
    ) -> None:
        self.first, self.main_grads = first, main_grads  # first: where this rank's block starts
        self.contributes = True  # False in a join round: no leaf of this rank's in the sum
        self.left_open = False  # an even leaf's gradients wait in .grad for the next leaf's
        super().__init__(spec, params, tail_numel=tail_numel, layouts=layouts)
        self.leaf: list[torch.Tensor | None] = [None] * len(self.params)  # the running leaf
        # The second and later pieces' buffers (a block of leaves that is not one subtree),
        # kept between steps as the exchange's receive buffers are: new memory each step costs
        # a CPU a page fault per 4 KiB.
        self.spares: list[torch.Tensor] = []
        # DTensor gradients are not paired: [Note: leaves on a device mesh] (deterministic.py)
        self.pairs = all(
            p.dtype == self.grads.dtype and layout is None
            for p, layout in zip(self.params, self.layouts, strict=True)
        )

    def reset(self) -> None:
        super().reset()
        self.fold: TreeFold[list[torch.Tensor]] = TreeFold(self.first, _add_lists)
        self.contributes, self.left_open = True, False

    @property
    def leaves_done(self) -> int:
        """This rank's leaves of the step whose backward has ended."""
        return self.fold.count + int(self.left_open)

    def _left_of_a_pair(self) -> bool:
        """The running leaf (under ``no_sync()``) is even: autograd adds the next one into it."""
        return self.pairs and not self.left_open and (self.first + self.fold.count) % 2 == 0

    def arrive(self, slot: int) -> None:
        self._mark_ready(slot)
        self._take(slot)

    def accumulate(self, slot: int) -> None:
        """Under ``no_sync()``: take ``params[slot].grad`` into this leaf, unless autograd is to
        add the next leaf into it ([Note: autograd adds the first level])."""
        if not self._left_of_a_pair():
            self._take(slot)

    def _take(self, slot: int) -> None:
        grad, layout = self.params[slot].grad, self.layouts[slot]
        if grad is None:
            return
        if layout is not None:
            grad = layout.local_grad(grad)  # this rank's shard, Partial reduced over its axis
        if grad.dtype != self.grads.dtype:  # main_grad_dtype: one widening copy
            grad = grad.to(self.grads.dtype)
        held = self.leaf[slot]
        self.leaf[slot] = grad if held is None else held.add_(grad)  # a reentrant backward
        self.params[slot].grad = None

    def end_leaf(self, synchronised: bool = False) -> None:
        """A leaf's backward ended: its gradients join the fold (zeros where it has none), or
        wait in ``.grad`` for the next leaf's."""
        if not synchronised and self._left_of_a_pair():
            self.left_open = True
            return
        # By shape, not by the views: between reductions the bucket has handed its buffer over
        # and takes it back only when the next reduction begins (Bucket.claim), the same memory
        # once zero_grad() has let go of it.
        leaf = [
            self.grads.new_zeros(shape) if grad is None else grad
            for grad, shape in zip(self.leaf, self.shapes, strict=True)
        ]
        self.fold.add(leaf, 2 if self.left_open else 1)
        self.leaf, self.left_open = [None] * len(self.params), False

    def pieces(self, present: int) -> list[tuple[Node, torch.Tensor]]:
        """This rank's pieces of a step of ``present`` leaves (after the last leaf joined them,
        closed up the tree if this block holds the step's last leaf), each laid out as the
        bucket's buffer: its gradients, then, in the first piece, the bucket's used flags and
        tail (small integers, exact in any order: they travel with the tree) and zeros in the
        others."""
        out: list[tuple[Node, torch.Tensor]] = []
        where = list(zip(self.spec.offsets, self.views, strict=True))
        n = self.grads.numel()
        self.fold.close(present)
        for node, grads in self.fold.pieces():
            if not out:  # the first piece in the buffer itself, its flags and tail in place
                torch._foreach_copy_(self.views, grads)
                out.append((node, self.buffer))
                continue
            flat = self._spare(len(out) - 1)
            torch._foreach_copy_([flat[a : a + v.numel()].view(v.shape) for a, v in where], grads)
            flat[n:].zero_()
            out.append((node, flat))
        return out

    def _spare(self, i: int) -> torch.Tensor:
        """Spare buffer ``i``, laid out as the bucket's buffer; free again once the step's
        exchange is over, before the next step lays its pieces out."""
        if i == len(self.spares):
            self.spares.append(self.buffer.new_empty(self.buffer.shape))
        return self.spares[i]

    def gather(self, scale: float | None) -> None:
        # The synchronised backward's leaf is complete in this bucket: it joins the fold. In a
        # join round, an even leaf still waiting in .grad joins alone.
        assert scale is None, "the deterministic mode scales once, after the sum"
        if self.contributes or self.left_open:
            if not self.contributes:
                for slot in range(len(self.params)):
                    self._take(slot)
            self.end_leaf(synchronised=True)

    def flag_finite(self) -> None:
        """Whether each parameter's gradient is finite in every piece of this rank."""
        pieces = [grads for _, grads in self.fold.pieces()]
        self.local_finite = torch.stack(
            [
                torch.stack([torch.isfinite(p[slot]).all() for p in pieces]).all()
                if pieces
                else torch.ones((), dtype=torch.bool, device=v.device)
                for slot, v in enumerate(self.views)
            ]
        )

    def open_window(self, training: bool) -> None:
        if self.main_grads:
            super().open_window(training)

    def results(self, counts: Sequence[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.main_grads:
            return super().results(counts)
        return Bucket.results(self, counts)

    def write_back(self, slot: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.main_grads:
            return super().write_back(slot)
        return Bucket.write_back(self, slot)


def _add_lists(left: list[torch.Tensor], right: list[torch.Tensor]) -> list[torch.Tensor]:
    torch._foreach_add_(left, right)  # addition commutes: in place is left + right, bit for bit
    return left
