"""A wrapper's first reducer: the buckets planned for its trainable parameters, the comm hook
their communication goes through and the reduction that gives the gradient its meaning."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gradsync.comm.formats import make_comm_hook, wire_bytes
from gradsync.ddp.checks.param_watch import ParameterWatch
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
) -> tuple[Reducer, Sizes, float | None]:
    """The reducer of ``watch``'s trainable parameters, with ``(numel, dtype)`` of each one's
    gradient as the buckets hold it and the bucket cap (MiB) they were planned with."""
    # named_parameters() already yields a tied parameter once, so it is reduced once.
    named = [(n, p) for n, p in watch.named if p.requires_grad]
    grad_dtype = options.main_grad_dtype
    sizes = [(local(p).numel(), grad_dtype or p.dtype) for _, p in named]
    wire = wire_bytes(options.compression, named, sizes)
    cap_mb = resolve_cap(options.bucket_cap_mb, sizes, wire)
    specs = plan_buckets(sizes, cap_to_bytes(cap_mb), cap_to_bytes(options.first_bucket_cap_mb))
    device = local(named[0][1]).device if named else torch.device("cpu")
    group = deadline.group
    hook = make_comm_hook(
        options.compression, options.all_reduce, group, named, grad_dtype=grad_dtype,
        owner=owner, keep_undo=options.check_finite,
    )  # fmt: skip
    reducer = Reducer(
        watch, specs, options, deadline=deadline, comm_hook=hook,
        reduction=Reduction(options.reduction, group, device), timeline=timeline,
        layouts=layouts,
    )  # fmt: skip
    return reducer, sizes, cap_mb
