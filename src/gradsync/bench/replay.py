"""Communication alone, for ``gradsync bench``: each variant's all-reduces of one step replayed
on idle buffers of the same sizes, in the same order and the same way, with no compute; and one
all-reduce of every gradient byte, the fastest way over the link. Timed in the same rounds as
the steps (``worker.py``), they give the ``comm`` of each step's limit (``report.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.bench import wire
from gradsync.bench.variant import Variant

COMM_PREFIX = "comm|"
FLAT = "flat (all gradient bytes, 1 call)"


def comm_plan(variant: Variant, model: nn.Module) -> list[int]:
    """Element counts of the all-reduces one step of ``variant`` issues, in launch order.

    gradsync: its planned buckets, each with the one used-flag element per parameter that rides
    along (see ``gradsync.ddp.reducer``). torch DDP: the bucket sizes it rebuilt in gradient-ready
    order, which it uses from its third step on and reports in its logging data only after that
    step, so call this after three steps. ``average_gradients``: one call per trainable parameter.
    """
    if variant.kind in ("local", "gradsync_auto", *wire.WIRE_KINDS):
        return []  # no replay: a wire format's collectives depend on the data, auto's plan
        # is chosen after the steps this runs after
    if variant.kind == "naive":
        return [p.numel() for p in model.parameters() if p.requires_grad]
    if variant.kind == "gradsync":
        assert isinstance(model, gradsync.DistributedDataParallel)
        return [s.numel + len(s.param_indices) for s in model.bucket_specs]
    if variant.kind == "torch_ddp":
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        data = model._get_ddp_logging_data()
        if "rebuilt_bucket_sizes" not in data:
            raise RuntimeError("torch DDP has not rebuilt its buckets yet; run 3 steps first")
        sizes = str(data["rebuilt_bucket_sizes"])
        elem = next(model.module.parameters()).element_size()
        return [int(b) // elem for b in sizes.split(",")]
    raise ValueError(f"unknown variant kind {variant.kind!r}")


def comm_task(numels: Sequence[int], dtype: torch.dtype, blocking: bool) -> Callable[[], None]:
    """All-reduce buffers of ``numels`` elements the way a step does, without any compute.

    ``blocking``: one call after the other, as ``average_gradients`` does; otherwise all are
    launched asynchronously and then waited for, as the bucketed reducers launch theirs.
    """
    buffers = [torch.zeros(n, dtype=dtype) for n in numels]

    def run() -> None:
        if blocking:
            for b in buffers:
                dist.all_reduce(b)
            return
        works = [dist.all_reduce(b, async_op=True) for b in buffers]
        for w in works:
            assert w is not None
            w.wait()

    return run


def comm_tasks(
    variants: Sequence[Variant], plans: dict[str, list[int]], dtype: torch.dtype
) -> dict[str, Callable[[], None]]:
    """Communication alone: each variant's own all-reduces (``plans``) replayed, and the one
    all-reduce of every gradient byte (``plans[FLAT]``), made one call after the other."""
    tasks = {
        COMM_PREFIX + v.name: comm_task(plans[v.name], dtype, v.kind == "naive")
        for v in variants
        if plans.get(v.name)
    }
    tasks[COMM_PREFIX + FLAT] = comm_task(plans[FLAT], dtype, blocking=True)
    return tasks
