"""The naive reference: all-reduce every gradient after backward, one parameter at a time.

This is data parallelism in ten lines, and the oracle the fast path is tested against. It
communicates nothing until backward has finished (no overlap) and pays one collective's latency
per parameter; ``wrapper.py`` removes both costs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from gradsync.ddp.reduction import check_reduction


def average_gradients(
    module: nn.Module, group: dist.ProcessGroup | None = None, reduction: str = "mean"
) -> None:
    """All-reduce the ``.grad`` of every trainable parameter of ``module`` over ``group``.

    Call after ``loss.backward()`` and before ``optimizer.step()`` on every rank. A parameter
    without a gradient contributes zeros (every rank must issue the same collectives).
    ``reduction`` means what it means for the wrapper (``reduction.py``): ``"mean"`` divides
    the sum by the number of ranks, ``"sum"`` does not.
    """
    check_reduction(reduction, allowed=("mean", "sum"))
    world_size = dist.get_world_size(group)
    for param in module.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)
        if reduction == "mean":
            param.grad.div_(world_size)
