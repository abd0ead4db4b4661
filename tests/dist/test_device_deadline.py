"""The deadline over a GPU's progress (``Deadline.wait_device``; [Note: a deadline for NCCL]).

On NCCL a rank that never joins a step's collectives leaves the others' hosts blocked at the
step's readout until torch's watchdog kills the process, naming nobody. gradsync polls a CUDA
event recorded after the step's collectives, under its deadline, before that read. Here, on
gloo ranks without a GPU, a fake event stands in for the CUDA one: rank 0 waits on an event
that never completes while rank 1 never starts the step, and must raise
``CollectiveTimeoutError`` naming rank 1 within the timeout; an event that completes after a
few queries is waited for without error.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import CollectiveTimeoutError
from gradsync.failfast.deadline import new_wrapper_deadline
from gradsync.testing.events import FakeEvent
from gradsync.testing.spawn import spawn

TIMEOUT_S = 2.0


def _rank(rank: int, world: int) -> dict[str, Any]:
    deadline = new_wrapper_deadline(None, timedelta(seconds=TIMEOUT_S), torch.device("cpu"))
    out: dict[str, Any] = {}
    if rank == 0:
        # An event that completes says every rank took part in the operation: here, the
        # construction, which rank 1 did take part in.
        finishing = FakeEvent(after=50)
        deadline.wait_device(finishing, "the construction")
        out["waited_queries"] = finishing.queries
        deadline.begin("the gradient reduction of step 0")
        start = time.monotonic()
        try:
            deadline.wait_device(FakeEvent(after=None), "the gradient reduction of step 0")
        except CollectiveTimeoutError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - start
    dist.barrier()  # rank 1 never began the step: it waits here until rank 0 has given up
    return out


def test_a_gpu_that_never_gets_past_the_step_raises_naming_the_missing_rank() -> None:
    out = spawn(_rank, 2)[0]
    assert out["waited_queries"] == 51
    error = out["error"]
    assert "rank 0 gave up waiting for the gradient reduction of step 0" in error, error
    assert "rank 1: last seen" in error and "at construction" in error, error
    assert TIMEOUT_S <= out["seconds"] < TIMEOUT_S + 1.0, out["seconds"]
