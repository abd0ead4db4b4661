"""Deadlines for gradsync's own collectives: a missing rank becomes an error that says what for.

Torch's default process-group timeout is 30 minutes and its message names no cause. Every
collective gradsync issues is started asynchronously and waited for with its own deadline
(``timeout=`` of the wrapper, minutes by default, seconds in tests); on expiry every waiting rank
raises :class:`CollectiveTimeoutError` naming the operation, the step and the usual culprits.
"""

from __future__ import annotations

import math
from datetime import timedelta

from gradsync.comm import Handle
from gradsync.errors import CollectiveTimeoutError, UsageError


def as_timedelta(timeout: float | timedelta) -> timedelta:
    """``timeout`` (seconds or ``timedelta``) as a ``timedelta``; it must be positive and finite
    in either form, since a zero or infinite deadline would wait forever."""
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"timeout must be a positive, finite duration, got {timeout!r}")
    return timedelta(seconds=seconds)


def wait_or_raise(handle: Handle, timeout: timedelta | None, what: str, rank: int) -> None:
    """``handle.wait(timeout)``, turning a timeout or a lost peer into a message with a cause.

    ``timeout=None`` waits without a deadline of ours. The reducer passes it for CUDA tensors:
    on NCCL a wait with a timeout blocks the host until the GPU is done, once per bucket, which
    would stall the launch of the rest of backward; there the process group's own timeout
    (``init_process_group(timeout=...)``) is the deadline.
    """
    try:
        if timeout is None:
            handle.wait()  # dist.Work.wait takes no None
        else:
            handle.wait(timeout=timeout)
    except RuntimeError as exc:
        limit = (
            f"at most {timeout.total_seconds():g} s" if timeout else "the process group's timeout"
        )
        raise CollectiveTimeoutError(
            f"rank {rank} gave up waiting for {what} after {limit} ({exc}). Some "
            "rank did not get there: it may be busy with rank-specific work (saving, evaluating "
            "on rank 0 only), blocked in a collective the others do not issue (e.g. a logging "
            "all_reduce on some ranks only), out of data (wrap the loop in "
            "`with model.join(optimizer):`), or dead. Raise `timeout=` of "
            "DistributedDataParallel if the work is legitimately that long."
        ) from exc
