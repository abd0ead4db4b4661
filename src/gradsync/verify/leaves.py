"""``gradsync verify --deterministic L``: a step of the deterministic mode, on both sides.

The reference cuts the global batch ``batch_fn(0, 1, step)`` into ``L`` leaves along the sample
dimension (``torch.tensor_split``), runs each leaf's loss backward on its own, adds the leaves'
gradients up the fixed tree (:func:`~gradsync.comm.tree.naive_tree_sum`, the definition) and
scales once, as the wrapper does: ``"mean"`` divides by ``L``, ``"sum"`` by nothing. Each rank
takes the same global batch and runs its block of leaves (``leaf_range``) through a wrapper
built with ``deterministic=L``, ``no_sync()`` on all but the last. Then both step their
optimizer: the deterministic mode is right when every parameter and gradient is the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

import torch
from torch import nn

from gradsync.comm.tree import leaf_range, naive_tree_sum

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]


def cut(batch: Batch, leaves: int) -> list[Batch]:
    """``batch`` cut into ``leaves`` leaves along the sample dimension, in order."""
    return list(zip(*(t.tensor_split(leaves) for t in batch), strict=True))


def reference_backward(
    model: nn.Module, loss_fn: LossFn, batch: Batch, leaves: int, reduction: str
) -> float:
    """The definition in one process: leave the step's gradient in ``.grad``; return the step's
    loss (the mean or sum of the leaves' losses, as ``reduction``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads: list[list[torch.Tensor | None]] = [[] for _ in params]
    total = 0.0
    for leaf in cut(batch, leaves):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, leaf)
        loss.backward()
        total += float(loss.item())
        for g, p in zip(grads, params, strict=True):
            g.append(p.grad)
    summed = [naive_tree_sum(g) for g in grads]
    if reduction == "mean":  # the wrapper's one division, after the sum
        torch._foreach_div_([s for s in summed if s is not None], float(leaves))
    for p, s in zip(params, summed, strict=True):
        p.grad = s
    return total / leaves if reduction == "mean" else total


def rank_leaves(batch: Batch, leaves: int, rank: int, world_size: int) -> list[Batch]:
    """This rank's leaves of the global batch ``batch``, in order."""
    every = cut(batch, leaves)
    return [every[i] for i in leaf_range(leaves, world_size, rank)]


def rank_backward(wrapped: nn.Module, loss_fn: LossFn, mine: list[Batch]) -> float:
    """This rank's leaves ``mine`` of the step through the wrapper, ``no_sync()`` on all but
    the last; returns the sum of their losses."""
    total = 0.0
    for j, leaf in enumerate(mine):
        last = j == len(mine) - 1
        with nullcontext() if last else wrapped.no_sync():  # type: ignore[operator]
            loss = loss_fn(wrapped, leaf)
            loss.backward()
        total += float(loss.item())
    return total
