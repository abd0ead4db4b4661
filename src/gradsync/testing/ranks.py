"""What one rank of :func:`~gradsync.testing.spawn.spawn` does, and how its end is judged.

Shared by the two ways a run gets its ranks: fresh processes (``fresh.py``) and the pool of
long-lived workers (``pool.py``). Either way a rank joins a gloo group through a ``file://``
store, runs the function, reports its result as ``torch.save`` bytes or a :class:`RankFailure`,
and then frees every process group.
"""

from __future__ import annotations

import gc
import io
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.errors import SpawnError

TEARDOWN_GRACE_S = 10.0
"""Seconds the ranks get to finish tearing down once none is still computing. A clean teardown
takes well under one; a rank still busy after this is stuck (a process-group destructor, a
non-daemon thread, an atexit handler) and is killed and reported."""


@dataclass
class RankFailure:
    """What one rank raised, as text (exceptions do not always survive pickling).

    ``traceback`` is empty when the harness, not the rank, saw the failure: a rank that died,
    exited non-zero, hung in teardown or ran past the timeout."""

    rank: int
    exc_type: str
    message: str
    traceback: str


class InitFailure(RuntimeError):
    """``init_process_group`` failed: the rank never ran the test function."""


Outcome = tuple[bool, Any]
"""A rank's ``(ok, result)``, or ``(False, RankFailure)``."""


@dataclass(frozen=True)
class Job:
    """One run of ``fn(rank, world_size, *args)`` on every rank, and its bounds: the process
    group's timeout, the run's deadline and the teardown grace (see ``spawn``)."""

    fn: Callable[..., Any]
    world_size: int
    args: tuple[Any, ...]
    pg_timeout_s: float
    timeout_s: float
    backend: str
    teardown_grace_s: float


def _summary(failure: RankFailure) -> str:
    if not failure.traceback:  # the harness's own words: "rank 1 exited with SIGABRT ..."
        return f"rank {failure.rank} {failure.message}"
    return f"rank {failure.rank} raised {failure.exc_type}: {failure.message}"


def spawn_error(failures: list[RankFailure]) -> SpawnError:
    """The :class:`~gradsync.errors.SpawnError` for ``failures`` (sorted by rank), which it
    keeps as ``failures``: the message names the first failed rank and carries its traceback,
    with one line for each other failed rank (the lowest rank is often only a victim, e.g. a
    collective timeout on rank 0 after rank 1 crashed)."""
    first = failures[0]
    others = "".join(f"\n  {_summary(f).splitlines()[0][:300]}" for f in failures[1:])
    err = SpawnError(
        f"{_summary(first)}\n(ranks that failed: {[f.rank for f in failures]}){others}\n"
        f"{first.traceback}"
    )
    err.failures = failures
    return err


def run_rank(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init_file: str,
    pg_timeout_s: float,
    backend: str,
) -> tuple[bool, bytes | RankFailure]:
    """Join the group, run ``fn``: ``(True, torch.save bytes of its result)`` or
    ``(False, RankFailure)``. The group is left for :func:`free_groups`, after the report."""
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        try:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
            # A rank leaves gloo's connection set-up once its own pairs are connected, maybe
            # before a peer has finished its side. Were it then to fail or end its process at
            # once, that peer's init would fail too ("Connection closed by peer") and the run
            # would name two ranks, which one depending on timing. Past this barrier every
            # rank is connected, so what ``fn`` does is all that is reported.
            dist.barrier()
        except Exception as exc:
            raise InitFailure(f"{type(exc).__name__}: {exc}") from exc
        out = fn(rank, world_size, *args)
        # Serialised to bytes: tensors sent between processes are otherwise shared through the
        # sending process, which may have exited (or moved on) by the time the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        return True, buf.getvalue()
    except BaseException as exc:  # report everything, KeyboardInterrupt in a child too
        return False, RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())


def free_groups() -> None:
    """Free every process group, so that no gloo worker thread is left to drop the last
    reference to a finished collective during finalization (std::terminate, pytorch#190489),
    and a pooled worker's next case starts with none. Groups that only garbage still holds (a
    wrapper's private group, in a reference cycle with its hooks) go with collect()."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def load_result(ok: bool, value: Any) -> Outcome:
    """A report as the parent keeps it: the result loaded back from its bytes."""
    if ok:
        value = torch.load(io.BytesIO(value), weights_only=False)
    return ok, value


def exit_text(exitcode: int) -> str:
    """``SIGABRT`` for -6, ``code 3`` for 3."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode}"


def died(rank: int, exitcode: int, reported: Outcome | None) -> RankFailure:
    """The failure of a rank whose process ended on its own, with ``exitcode``."""
    when = (
        "before reporting a result"
        if reported is None
        else f"after reporting its {'result' if reported[0] else 'error'}"
    )
    return RankFailure(rank, "ProcessDied", f"exited with {exit_text(exitcode)} {when}", "")


def verdict(reported: Outcome | None, fault: RankFailure | None) -> Outcome:
    """A rank's entry: its result only if it reported one and then ended cleanly (``fault``
    ``None``: a fresh process exited by itself with code 0, a pooled worker freed its groups)."""
    if fault is None and reported is not None:
        return reported
    assert fault is not None, "a rank that reported nothing has a fault"
    if reported is not None and not reported[0]:
        # What the rank raised is the cause; how it then ended is a footnote.
        first: RankFailure = reported[1]
        first.message += f" (then: {fault.message})"
        return False, first
    return False, fault


def timed_out(rank: int, timeout_s: float) -> RankFailure:
    return RankFailure(rank, "Timeout", f"no result within {timeout_s:.0f} s", "")


def hung_in_teardown(rank: int, grace_s: float) -> RankFailure:
    hang = f"hung in teardown: still running {grace_s:g} s after the run ended (killed)"
    return RankFailure(rank, "TeardownHang", hang, "")
