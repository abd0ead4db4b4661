"""The loop's own collectives inside ``with step:``, stamped with the step they belong to.

Backends pair collectives by issue order only. A rank that skips a step of the loop issues its
next step's :meth:`Step.all_reduce <gradsync.recovery.Step.all_reduce>` where the others issue
this step's, and the sums come back as if nothing were wrong: a loss of another step logged, a
vote to stop counted at the wrong step. So each call sends, with the tensor, every rank's number
of the step in a slot of its own (one all-reduce of ``world_size`` int64, issued with the
tensor's and waited with it); after the sum every rank reads every rank's number, and where
they differ every rank raises the same :class:`~gradsync.errors.DesyncError`, naming the ranks
and their steps as the step tags name them ([Note: step tags] in ``ddp/checks/tags.py``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.ddp.checks.tags import steps_differ
from gradsync.errors import CollectiveTimeoutError, DesyncError
from gradsync.failfast.deadline import small_tensors_device
from gradsync.failfast.waiting import RegroupWatch, wait_watching


def stamped_all_reduce(
    tensor: torch.Tensor, op: Any, number: int, watch: RegroupWatch, timeout: timedelta
) -> torch.Tensor:
    """``dist.all_reduce(tensor, op)`` over the default group, in place, for step ``number``,
    waited for as gradsync's own collectives are (``watch``: give up once a regroup began);
    :class:`DesyncError` on every rank if the ranks are at different steps."""
    _stamped(tensor, op, number, watch, timeout, ("all_reduce", "step.all_reduce"))
    return tensor


def stamped_barrier(number: int, watch: RegroupWatch, timeout: timedelta) -> None:
    """The stamps alone, waited for the same way: every rank has reached step ``number``'s
    call (the step's commit on a mesh, ``recovery/replicas.py``)."""
    _stamped(None, None, number, watch, timeout, ("commit", "the step's commit"))


def _stamped(
    tensor: torch.Tensor | None,
    op: Any,
    number: int,
    watch: RegroupWatch,
    timeout: timedelta,
    what: tuple[str, str],
) -> None:
    device = tensor.device if tensor is not None else small_tensors_device(None)
    stamps = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    stamps[dist.get_rank()] = number + 1  # zero: no rank's
    works = [dist.all_reduce(stamps, async_op=True)]
    if tensor is not None:
        works.append(dist.all_reduce(tensor, op=op, async_op=True))
    try:
        for work in works:
            assert work is not None
            wait_watching(work, watch, timeout)
    except RuntimeError as exc:
        raise CollectiveTimeoutError(f"step {number}'s {what[0]}: {exc}") from exc
    numbers = [int(v) - 1 if v else None for v in stamps.tolist()]
    mismatch = steps_differ(numbers, what[1])
    if mismatch is not None:
        raise DesyncError(f"{mismatch} (seen from rank {dist.get_rank()})")
