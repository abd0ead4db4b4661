"""The naive reference: all-reduce every gradient after backward, one parameter at a time.

This is data parallelism in a dozen lines, and the oracle the fast path is tested against. It
communicates nothing until backward has finished (no overlap) and pays one collective's latency
per parameter; ``wrapper.py`` removes both costs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from gradsync.ddp.reduction import check_reduction
from gradsync.mesh.axes import data_parallel_group
from gradsync.mesh.dtensors import grad_layouts, local


def average_gradients(
    module: nn.Module,
    group: dist.ProcessGroup | None = None,
    reduction: str = "mean",
    *,
    device_mesh: DeviceMesh | None = None,
) -> None:
    """All-reduce the ``.grad`` of every trainable parameter of ``module`` over ``group``.

    Call after ``loss.backward()`` and before ``optimizer.step()`` on every rank. A parameter
    without a gradient contributes zeros (every rank must issue the same collectives).
    ``reduction`` means what it means for the wrapper (``reduction.py``): ``"mean"`` divides
    the sum by the number of ranks, ``"sum"`` does not.

    ``device_mesh`` (instead of ``group``) reduces over the ranks of a (sub-)mesh, e.g.
    ``mesh["dp", "cp"]``, or ``mesh["cp"]`` after torch's ``fully_shard`` has reduced over
    ``dp``. A DTensor gradient is reduced as its local shard and stays a DTensor with its
    parameter's placements (a ``Partial`` one is resolved first; see [Note: Partial gradients]).
    """
    check_reduction(reduction, allowed=("mean", "sum"))
    group = data_parallel_group(group, device_mesh)
    world_size = dist.get_world_size(group)
    # Refuse a parameter sharded across the ranks reduced over (see gradsync/mesh/axes.py).
    grad_layouts(module.named_parameters(), group)
    for param in module.parameters():
        if not param.requires_grad:
            continue
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if isinstance(grad, DTensor) and isinstance(param, DTensor):
            grad = grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(local(grad), op=dist.ReduceOp.SUM, group=group)
        if reduction == "mean":
            local(grad).div_(world_size)
        param.grad = grad
