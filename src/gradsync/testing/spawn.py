"""Run a function on N local gloo ranks: the harness behind the tests and ``gradsync verify``.

Each rank is a fresh process (``spawn`` start method) that joins a gloo process group through a
``file://`` store in a private temp dir: no ports, so any number of these can run side by side.
The process-group timeout is seconds, not torch's 30-minute default, so a hang fails fast.
Errors come back tagged with the rank that raised them. A rank passes only if it returns and
then exits by itself with code 0: a crash or hang at interpreter shutdown (a process-group
destructor racing finalisation) fails the run like any other crash.
"""

from __future__ import annotations

import gc
import io
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gradsync.errors import SpawnError

TEARDOWN_GRACE_S = 10.0
"""Seconds the ranks get to exit once none is still computing. A clean exit takes well under
one; a rank still alive after this is stuck (a process-group destructor, a non-daemon thread,
an atexit handler) and is killed and reported."""


@dataclass
class RankFailure:
    """What one rank raised, as text (exceptions do not always survive pickling).

    ``traceback`` is empty when the harness, not the rank, saw the failure: a rank that died,
    exited non-zero, hung in teardown or ran past the timeout."""

    rank: int
    exc_type: str
    message: str
    traceback: str


def _summary(failure: RankFailure) -> str:
    if not failure.traceback:  # the harness's own words: "rank 1 exited with SIGABRT ..."
        return f"rank {failure.rank} {failure.message}"
    return f"rank {failure.rank} raised {failure.exc_type}: {failure.message}"


def _spawn_error(failures: list[RankFailure]) -> SpawnError:
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


class _InitFailure(RuntimeError):
    """``init_process_group`` failed: the rank never ran the test function."""


def _rank_entry(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    init_file: str,
    pg_timeout_s: float,
    results: Any,
    backend: str,
) -> None:
    torch.set_num_threads(1)
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
        except Exception as exc:
            raise _InitFailure(f"{type(exc).__name__}: {exc}") from exc
        out = fn(rank, world_size, *args)
        # Serialised to bytes: tensors put on a torch queue are shared through the sending
        # process, which may have exited by the time the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException as exc:  # report everything, KeyboardInterrupt in a child too
        failure = RankFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())
        results.put((rank, False, failure))
    finally:
        # Free every process group before the interpreter shuts down, so that no gloo worker
        # thread is left to drop the last reference to a finished collective during
        # finalization (std::terminate, pytorch#190489). Groups that only garbage still holds
        # (a wrapper's private group, in a reference cycle with its hooks) go with collect().
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()


def _exit_text(exitcode: int) -> str:
    """``SIGABRT`` for -6, ``code 3`` for 3."""
    if exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"code {exitcode}"


def _receive(results: Any, outcomes: dict[int, tuple[bool, Any]], timeout: float) -> bool:
    """Move one report from the queue into ``outcomes``; ``False`` if none came in ``timeout``."""
    try:
        rank, ok, value = results.get(timeout=timeout)
    except queue_mod.Empty:
        return False
    if ok:
        value = torch.load(io.BytesIO(value), weights_only=False)
    outcomes[rank] = (ok, value)
    return True


def _kill(p: Any) -> None:
    p.kill()
    p.join()


def _verdict(
    rank: int, exitcode: int, reported: tuple[bool, Any] | None, killed: RankFailure | None
) -> tuple[bool, Any]:
    """A rank's entry: its result only if it reported one and then exited cleanly by itself."""
    if killed is None and exitcode == 0 and reported is not None:
        return reported
    if killed is not None:
        fault = killed
    else:
        when = (
            "before reporting a result"
            if reported is None
            else f"after reporting its {'result' if reported[0] else 'error'}"
        )
        fault = RankFailure(rank, "ProcessDied", f"exited with {_exit_text(exitcode)} {when}", "")
    if reported is not None and not reported[0]:
        # What the rank raised is the cause; how it then ended is a footnote.
        first: RankFailure = reported[1]
        first.message += f" (then: {fault.message})"
        return False, first
    return False, fault


def _collect(
    procs: list[Any], results: Any, timeout_s: float, grace_s: float
) -> dict[int, tuple[bool, Any]]:
    """``rank -> (ok, result or RankFailure)`` once every rank has exited or been killed.

    A report is not the end of a rank: it must then exit, with code 0, within ``grace_s`` of the
    last rank reporting (the grace starts then, not at its own report, because tearing down a
    process group may wait on peers still at work). Anything else fails it, result or not."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, tuple[bool, Any]] = {}
    killed: dict[int, RankFailure] = {}

    def computing() -> list[int]:
        return [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is None]

    while computing() and time.monotonic() < deadline:
        _receive(results, outcomes, timeout=0.2)
    while _receive(results, outcomes, timeout=0.0):
        pass
    for rank in computing():
        _kill(procs[rank])
        killed[rank] = RankFailure(rank, "Timeout", f"no result within {timeout_s:.0f} s", "")
    grace_end = time.monotonic() + grace_s
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.0, grace_end - time.monotonic()))
        if p.exitcode is None:
            _kill(p)
            hang = f"hung in teardown: still running {grace_s:g} s after the run ended (killed)"
            killed[rank] = RankFailure(rank, "TeardownHang", hang, "")
    # Reports of ranks that exited after the last read are still in the pipe.
    while _receive(results, outcomes, timeout=0.0):
        pass
    return {
        rank: _verdict(rank, p.exitcode, outcomes.get(rank), killed.get(rank))
        for rank, p in enumerate(procs)
    }


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    pg_timeout_s: float = 20.0,
    timeout_s: float = 240.0,
    return_failures: bool = False,
    backend: str = "gloo",
    teardown_grace_s: float = TEARDOWN_GRACE_S,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each result.

    ``fn`` must be importable by name (a module-level function). ``backend="nccl"`` puts rank
    ``r`` on GPU ``r % device_count``. On failure raises :class:`~gradsync.errors.SpawnError`
    naming the rank (its ``failures`` holds every failed rank's :class:`RankFailure`), unless
    ``return_failures`` is set, in which case a failed rank's entry in the returned list is its
    :class:`RankFailure`. A rank that neither returns nor raises within ``timeout_s`` is killed
    and reported as a failure. So is a rank that returned but then exits non-zero or by a
    signal (a crash at interpreter shutdown is a crash), or does not exit within
    ``teardown_grace_s`` of the last rank reporting.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    run = (fn, world_size, args, pg_timeout_s, timeout_s, backend, teardown_grace_s)
    outcomes = _attempt(*run)
    failures = [v for ok, v in outcomes.values() if not ok]
    if failures and all(f.exc_type == _InitFailure.__name__ for f in failures):
        # gloo's connectFullMesh now and then loses a connection while a loaded 2-core machine
        # starts many processes at once ("Connection closed by peer" inside
        # init_process_group). No rank has run ``fn`` yet, so one fresh start cannot hide a
        # fault of the code under test.
        outcomes = _attempt(*run)
        failures = [v for ok, v in outcomes.values() if not ok]
    if failures and not return_failures:
        raise _spawn_error(sorted(failures, key=lambda f: f.rank))
    return [outcomes[r][1] for r in range(world_size)]


def _attempt(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    pg_timeout_s: float,
    timeout_s: float,
    backend: str,
    teardown_grace_s: float,
) -> dict[int, tuple[bool, Any]]:
    """One start of every rank: each rank's (ok, result or RankFailure)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # One thread per rank: on a 2-core machine oversubscription turns seconds into minutes.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gradsync-spawn-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(rank, world_size, fn, args, init_file, pg_timeout_s, results, backend),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout_s, teardown_grace_s)
        finally:
            for p in procs:  # only on an error in this process (Ctrl-C, a result that won't load)
                if p.is_alive():
                    _kill(p)
