"""A reducer's plan: the buckets planned for a wrapper's trainable parameters, the comm hook their
communication goes through and the reduction that gives the gradient its meaning."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.comm.formats import wire_bytes
from gradsync.comm.hosts import count_hosts
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.mode import Mode
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import cap_to_bytes, plan_buckets, resolve_cap
from gradsync.ddp.reducer import ReducerPlan
from gradsync.ddp.reduction import Reduction
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout, local


def plan_reducer(
    watch: ParameterWatch,
    options: SyncOptions,
    deadline: Deadline,
    mode: Mode,
    layouts: Sequence[GradLayout | None],
    owner: nn.Module,
    mesh_axes: tuple[str, ...] = (),
) -> ReducerPlan:
    """The plan of ``watch``'s trainable parameters over ``deadline``'s group, after ``mode``
    has checked what it refuses."""
    # named_parameters() already yields a tied parameter once, so it is reduced once.
    named = [(n, p) for n, p in watch.named if p.requires_grad]
    grad_dtype = options.main_grad_dtype
    sizes = [(local(p).numel(), grad_dtype or p.dtype) for _, p in named]
    wire = wire_bytes(options.compression, named, sizes)
    group = deadline.group
    # Only the default cap (and "auto"'s start, the default) depends on where the ranks are;
    # every rank has the same options.
    hosts = count_hosts(deadline) if options.bucket_cap_mb in (None, "auto") else None
    cap_mb = resolve_cap(options.bucket_cap_mb, sizes, wire, hosts)
    specs = plan_buckets(sizes, cap_to_bytes(cap_mb), cap_to_bytes(options.first_bucket_cap_mb))
    device = local(named[0][1]).device if named else torch.device("cpu")
    buffers = any(True for _ in owner.buffers())
    mode.check(options, device, deadline.world_size, buffers, mesh_axes, layouts)
    hook = mode.comm_hook(options, group, named, owner)
    reduction = Reduction(options.reduction, group, device)
    return ReducerPlan(specs, sizes, cap_mb, hook, reduction)
