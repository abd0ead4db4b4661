"""Gradient clipping by the global norm when each rank holds only part of the gradients.

``torch.nn.utils.clip_grad_norm_`` computes the norm of what it is given. With sharded
gradients (a reduce-scatter's output, or ZeRO's slices of replicated gradients) each rank sees
only its part, and clipping by that local norm would scale each rank differently. Here each rank
reduces its part to one number (the sum of ``|g|^p``, or the max for ``inf``), one scalar
all-reduce over ``process_group`` combines them, and every rank clips by the same global norm:
the unsharded result, up to the order of floating-point summation. Every element must be held
by exactly one rank of the group; replicated gradients would be counted once per rank (pass
``process_group=None`` for those, which is torch's local behaviour).

DTensor gradients carry their own layout: their norm is taken with DTensor's own ops (the
partial results are combined over *their* device mesh, a replicated one counted once), and it
is not summed over ``process_group`` again, which is right when they are replicated over that
group (e.g. tensor-parallel gradients after the data-parallel reduction).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradsync.errors import UsageError

_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (total_norm + 1e-6)


def _check_norm_type(norm_type: float) -> float:
    norm_type = float(norm_type)
    if not (norm_type > 0 or norm_type == math.inf):
        raise UsageError(f"norm_type must be positive or inf, got {norm_type}")
    return norm_type


def _combine(parts: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """Sum (max for inf) of per-tensor ``|g|^p`` contributions, in fp64 for a stable sum."""
    if not parts:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack([t.to(device=device, dtype=torch.float64) for t in parts])
    return stacked.max() if norm_type == math.inf else stacked.sum()


def total_norm(
    grads: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``grads`` over every rank of ``process_group`` (each
    rank passing the tensors it holds; ``None``: this rank's alone), as a scalar of the
    gradients' dtype (as torch's ``clip_grad_norm_`` returns; summed in fp64 meanwhile)."""
    norm_type = _check_norm_type(norm_type)
    grads = list(grads)
    plain = [g for g in grads if not isinstance(g, DTensor)]
    dtensors = [g for g in grads if isinstance(g, DTensor)]
    if device is None:
        device = grads[0].device if grads else torch.device("cpu")
    pw = 1.0 if norm_type == math.inf else norm_type

    def power(n: torch.Tensor) -> torch.Tensor:
        return n.double() if norm_type == math.inf else n.double() ** pw

    local = _combine(
        [power(torch.linalg.vector_norm(g, norm_type)) for g in plain], norm_type, device
    )
    if process_group is not None and dist.get_world_size(process_group) > 1:
        op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
        dist.all_reduce(local, op=op, group=process_group)
    # DTensor's vector_norm reduces over the tensor's own mesh; full_tensor() replicates it.
    from_dtensors = [power(torch.linalg.vector_norm(g, norm_type).full_tensor()) for g in dtensors]
    total = _combine([local, *from_dtensors], norm_type, device)
    if norm_type != math.inf:
        total = total ** (1.0 / pw)
    return total.to(grads[0].dtype if grads else torch.float32)


def clip_grads_with_norm_(
    grads: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor
) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total + 1e-6))``, as torch does."""
    coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
    for g in grads:
        target = g.to_local() if isinstance(g, DTensor) else g
        target.mul_(coef.to(device=target.device, dtype=target.dtype))


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` when each rank of ``process_group`` holds a different
    part of the gradients: the norm is global (one scalar all-reduce), so every rank scales by
    the same factor and the result equals clipping the unsharded gradients. Returns the total
    norm. Call it on every rank of the group. ``parameters``' ``.grad`` may be DTensors.

    Unlike torch.distributed's collectives, ``process_group=None`` does not mean the default
    group: it means the gradients are not sharded (torch's local clipping), because summing
    replicated gradients over the ranks would overstate the norm by ``sqrt(world_size)``. Pass
    ``torch.distributed.group.WORLD`` for the default group."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total = total_norm(grads, norm_type, process_group=process_group)
    clip_grads_with_norm_(grads, max_norm, total)
    return total
