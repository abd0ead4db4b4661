"""Gradients that carry a graph: ``loss.backward(create_graph=True)``.

[Note: gradients with a graph]
A backward run with ``create_graph=True`` gives every ``.grad`` a graph of its own, so that a
second derivative can be taken through it (a Hessian-vector product, a penalty on the
gradient, MAML's outer step). gradsync does with it what torch DDP does:

* the buckets take the gradients' *values* (detached: the collectives have no derivative
  here), and the reduced values are written back into the same ``.grad`` tensors without
  being recorded, so ``.grad`` holds the full batch's gradient, bit for bit what it holds
  without ``create_graph``, while its graph is still this rank's own gradient's;
* a derivative taken through ``.grad`` is therefore this rank's part of the full batch's
  (the derivative of this rank's loss): ``torch.autograd.grad(..., inputs=params)`` returns
  it, and all-reducing it the way the reduction combines gradients (averaged for ``"mean"``,
  summed for ``"sum"`` and ``"item_mean"``, then divided by the items) gives one process's.
  gradsync synchronises one backward per forward: a second backward into the parameters is
  refused (``gradient_without_forward``) instead of being left unsynchronised, as torch does.

Where ``.grad`` cannot keep its graph, the first gradient of such a backward is refused:
``main_grad_dtype`` and the deterministic mode take each gradient into the bucket and free
``.grad``; ``gradient_as_bucket_view`` makes ``.grad`` a view of the bucket; a DTensor's
partial gradient is replaced by a new tensor.

A graph made by ``torch.autograd.grad(..., create_graph=True)`` inside the forward or the loss
(a penalty on the gradient with respect to the inputs, forces from an energy, MAML's inner
step) needs none of this: that call runs no parameter hooks, and the loss's one backward is
synchronised like any other.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from gradsync.ddp.buckets import Bucket
from gradsync.ddp.options import SyncOptions
from gradsync.errors import UsageError

# How to get the full batch's derivatives of gradients without a second synchronised backward.
ALL_REDUCE = "all-reduce them as the reduction combines gradients (mean, sum, or / items)"


def check_graph_grads(
    options: SyncOptions, buckets: Sequence[Bucket], taken: str | None = None
) -> None:
    """At the first gradient of a backward: if it runs with ``create_graph=True`` (in a hook,
    grad mode is on exactly then), refuse it where ``.grad`` cannot keep its graph, else say
    what the graph is. ``taken``: why the reducer takes every gradient out of ``.grad``, if
    it does (the deterministic mode's)."""
    if not torch.is_grad_enabled():
        return
    has_layouts = any(layout is not None for b in buckets for layout in b.layouts)
    why = None
    if options.main_grad_dtype is not None:
        why = "main_grad_dtype= (the gradients are added into the main gradient and freed)"
    elif taken is not None:
        why = taken
    elif options.gradient_as_bucket_view:
        why = "gradient_as_bucket_view=True (.grad becomes a view of the bucket)"
    elif has_layouts:
        why = "DTensor parameters (a partial gradient is replaced by the reduced one)"
    if why is not None:
        raise UsageError(
            f"loss.backward(create_graph=True) cannot keep the gradients' graph with {why}. "
            "Wrap the model without that setting, or take the gradients with "
            "torch.autograd.grad(loss, params, create_graph=True), which runs no gradsync "
            f"hook, and {ALL_REDUCE}"
        )
    warnings.warn(
        "backward(create_graph=True) under gradsync: .grad holds the synchronised gradient "
        "of the full batch, but its graph is this rank's own gradient's (as in torch DDP): a "
        "derivative taken through it is this rank's part, to be all-reduced as the reduction "
        "does; a second backward into the parameters is refused. See [Note: gradients with a "
        "graph] in gradsync/ddp/checks/graph_grads.py.",
        UserWarning,
        stacklevel=2,
    )


def is_graph_grad(param: torch.Tensor) -> bool:
    """Whether ``param.grad`` carries a graph (a backward with ``create_graph=True`` made it)."""
    return param.grad is not None and param.grad.requires_grad
