"""The flat parameter buffer of one bucket, and which optimizer classes may step on its pieces.

[Note: parameters live in the flat buffer]
At construction every parameter of a bucket is copied into the bucket's flat buffer and its
``.data`` is pointed at its place there, as Megatron-LM's distributed optimizer does with its
parameter buffer. So a rank's slice of the buffer *is* its share of the parameters: the inner
optimizer updates views of it in place (no copy in, no copy out), and one ``all_gather`` per
bucket into the same buffer refreshes every parameter on every rank (no per-parameter
broadcasts, no second full copy of the parameters). Parameters and gradients stay replicated,
as ZeRO stage 1 prescribes; only the optimizer state is sharded. Replacing a parameter's
``.data`` afterwards (``model.to(...)``, ``p.data = ...``) cuts that link;
:meth:`FlatBucket.check_params` notices at the next step and says so instead of training a
stale copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradsync.errors import ProtocolError, UsageError
from gradsync.optim.layout import Piece, ShardLayout

ELEMENTWISE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "Adadelta",
    "RMSprop",
    "Rprop",
    "ASGD",
)
"""torch.optim classes whose update of an element depends only on that element's own gradient
and state (plus replicated scalars such as the step count): stepping them on pieces of
parameters gives exactly the unsharded result."""

NOT_ELEMENTWISE = {
    "LBFGS": "its line search and curvature pairs use dot products over all parameters",
    "SparseAdam": "it needs sparse gradients, and the flat gradient slices are dense",
    "Adafactor": "it factors the second moment of a matrix into row and column statistics",
    "Muon": "it orthogonalises each whole weight matrix",
}
"""Known torch.optim classes that would silently give a different result on pieces."""


def check_optimizer_class(optimizer_class: object) -> None:
    """Refuse what is not an optimizer class, and the known non-elementwise ones.

    A custom subclass of ``torch.optim.Optimizer`` cannot be checked: it is accepted, and must
    be elementwise (the docs of :class:`~gradsync.optim.ShardedOptimizer` say so)."""
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise UsageError(
            f"optimizer_class must be a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
            f"got {optimizer_class!r}"
        )
    for name, why in NOT_ELEMENTWISE.items():
        known = getattr(torch.optim, name, None)
        if isinstance(known, type) and issubclass(optimizer_class, known):
            raise UsageError(
                f"ShardedOptimizer cannot shard {optimizer_class.__name__}: {why}, so stepping "
                f"slices of parameters would not equal the unsharded step. Supported: "
                f"{', '.join(ELEMENTWISE)} (and other elementwise optimizers)"
            )


class FlatBucket:
    """One bucket's flat parameter buffer, this rank's slice of it, and the slice's pieces."""

    def __init__(
        self, index: int, params: Sequence[torch.nn.Parameter], layout: ShardLayout, rank: int
    ) -> None:
        self.index = index
        self.params = list(params)
        self.layout = layout
        first = self.params[0]
        self.data = torch.zeros(layout.padded_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, offset in zip(self.params, layout.offsets, strict=True):
                view = self.data[offset : offset + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)  # see [Note: parameters live in the flat buffer]
        self._data_ptrs = [p.data_ptr() for p in self.params]
        lo, hi = layout.rank_range(rank)
        self.shard = self.data[lo:hi]
        self.pieces: tuple[Piece, ...] = layout.pieces(rank)
        # The tensors the inner optimizer steps: 1-D views of this rank's slice, one per piece.
        self.slices = [
            self.shard[pc.shard_offset : pc.shard_offset + pc.numel] for pc in self.pieces
        ]

    def check_params(self, where: str) -> None:
        """Raise if a parameter's storage is no longer its place in the flat buffer."""
        for i, (p, ptr) in enumerate(zip(self.params, self._data_ptrs, strict=True)):
            if p.data_ptr() != ptr:
                raise ProtocolError(
                    f"{where}: parameter {i} of bucket {self.index} (shape {list(p.shape)}) no "
                    f"longer lives in the optimizer's flat buffer: its .data was replaced after "
                    f"ShardedOptimizer was built (model.to(), p.data = ...). Move or replace "
                    f"parameters before building the optimizer."
                )

    def attach_param_grads(self) -> None:
        """Give each piece the matching slice of its parameter's ``.grad`` (a view, no copy);
        a parameter without a gradient leaves its pieces without one (the step skips them,
        as the unsharded optimizer skips the parameter)."""
        for pc, s in zip(self.pieces, self.slices, strict=True):
            grad = self.params[pc.param].grad
            s.grad = None if grad is None else grad.reshape(-1)[pc.start : pc.end]

    def attach_shard_grads(self, grad_shard: torch.Tensor, skip: set[int]) -> None:
        """Give each piece its part of ``grad_shard``, this rank's reduced slice of the flat
        gradient (``[shard_numel]``); pieces of parameters whose id is in ``skip`` get none."""
        if grad_shard.shape != self.shard.shape or grad_shard.dtype != self.shard.dtype:
            raise UsageError(
                f"the gradient shard of bucket {self.index} must be a {self.shard.dtype} tensor "
                f"of shape {list(self.shard.shape)}, got {grad_shard.dtype} "
                f"{list(grad_shard.shape)}"
            )
        for pc, s in zip(self.pieces, self.slices, strict=True):
            if id(self.params[pc.param]) in skip:
                s.grad = None
            else:
                s.grad = grad_shard[pc.shard_offset : pc.shard_offset + pc.numel]

    def detach_grads(self) -> None:
        for s in self.slices:
            s.grad = None
