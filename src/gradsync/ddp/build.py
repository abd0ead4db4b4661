"""A wrapper's first reducer: the buckets planned for its trainable parameters, the comm hook
their communication goes through and the reduction that gives the gradient its meaning."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from gradsync.comm import CommHook
from gradsync.comm.formats import make_comm_hook, wire_bytes
from gradsync.comm.hosts import count_hosts
from gradsync.comm.tree_exchange import TreeExchange
from gradsync.ddp.checks.param_watch import ParameterWatch
from gradsync.ddp.deterministic import check_compute, refuse_mesh
from gradsync.ddp.options import SyncOptions
from gradsync.ddp.plan import cap_to_bytes, plan_buckets, resolve_cap
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.reduction import Reduction
from gradsync.failfast.deadline import Deadline
from gradsync.mesh.dtensors import GradLayout, local
from gradsync.timing import StepTimeline

Sizes = list[tuple[int, torch.dtype]]


def first_reducer(
    watch: ParameterWatch,
    options: SyncOptions,
    deadline: Deadline,
    timeline: StepTimeline,
    layouts: Sequence[GradLayout | None],
    owner: nn.Module,
    mesh_axes: tuple[str, ...] = (),
) -> tuple[Reducer, Sizes, float | None]:
    """The reducer of ``watch``'s trainable parameters, with ``(numel, dtype)`` of each one's
    gradient as the buckets hold it and the bucket cap (MiB) they were planned with."""
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
    if options.deterministic is not None:
        refuse_mesh(mesh_axes, layouts)
        buffers = options.broadcast_buffers and any(True for _ in owner.buffers())
        check_compute(options.deterministic, device, dist.get_world_size(group), buffers)
    hook = _comm_hook(options, group, named, owner)
    reducer = Reducer(
        watch, specs, options, deadline=deadline, comm_hook=hook,
        reduction=Reduction(options.reduction, group, device, options.deterministic is not None),
        timeline=timeline,
        layouts=layouts,
    )  # fmt: skip
    return reducer, sizes, cap_mb


def _comm_hook(
    options: SyncOptions,
    group: dist.ProcessGroup | None,
    named: list[tuple[str, nn.Parameter]],
    owner: nn.Module,
) -> CommHook:
    """How the buckets travel: the fixed leaf tree in the deterministic mode, else the wire
    the options chose."""
    leaves = options.deterministic
    if leaves is None:
        return make_comm_hook(
            options.compression, options.all_reduce, group, named,
            grad_dtype=options.main_grad_dtype, owner=owner, keep_undo=options.check_finite,
        )  # fmt: skip
    return TreeExchange(leaves, group)
