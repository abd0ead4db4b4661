"""Run a function on N local gloo ranks: the harness behind the tests and ``gradsync verify``.

Each rank is a fresh process (``spawn`` start method) that joins a gloo process group through a
``file://`` store in a private temp dir: no ports, so any number of these can run side by side.
The process-group timeout is seconds, not torch's 30-minute default, so a hang fails fast.
Errors come back tagged with the rank that raised them.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
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


@dataclass
class RankFailure:
    """What one rank raised, as text (exceptions do not always survive pickling)."""

    rank: int
    exc_type: str
    message: str
    traceback: str


def _spawn_error(failures: list[RankFailure]) -> SpawnError:
    """The :class:`~gradsync.errors.SpawnError` for ``failures`` (sorted by rank), which it
    keeps as ``failures``: the message names the first failed rank and carries its traceback."""
    first = failures[0]
    err = SpawnError(
        f"rank {first.rank} raised {first.exc_type}: {first.message}\n"
        f"(ranks that failed: {[f.rank for f in failures]})\n{first.traceback}"
    )
    err.failures = failures
    return err


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
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
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
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list[Any], results: Any, deadline: float) -> dict[int, tuple[bool, Any]]:
    """``rank -> (ok, result or RankFailure)`` for the ranks that reported (or died without
    reporting) before ``deadline``."""
    outcomes: dict[int, tuple[bool, Any]] = {}
    while len(outcomes) < len(procs) and time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.2)
            if ok:
                value = torch.load(io.BytesIO(value), weights_only=False)
            outcomes[rank] = (ok, value)
            continue
        except queue_mod.Empty:
            pass
        for rank, p in enumerate(procs):
            # A process that died without reporting (segfault, os._exit, kill -9).
            if rank not in outcomes and not p.is_alive() and p.exitcode not in (None, 0):
                outcomes[rank] = (
                    False,
                    RankFailure(rank, "ProcessDied", f"exit code {p.exitcode}", ""),
                )
    return outcomes


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...] = (),
    *,
    pg_timeout_s: float = 20.0,
    timeout_s: float = 240.0,
    return_failures: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each result.

    ``fn`` must be importable by name (a module-level function). ``backend="nccl"`` puts rank
    ``r`` on GPU ``r % device_count``. On failure raises :class:`~gradsync.errors.SpawnError`
    naming the rank (its ``failures`` holds every failed rank's :class:`RankFailure`), unless
    ``return_failures`` is set, in which case a failed rank's entry in the returned list is its
    :class:`RankFailure`. A rank that neither returns nor raises within ``timeout_s`` is killed
    and reported as a failure.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
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
            outcomes = _collect(procs, results, time.monotonic() + timeout_s)
        finally:
            for p in procs:
                p.join(timeout=5.0)
                if p.is_alive():
                    p.kill()
                    p.join()
    for rank in range(world_size):
        if rank not in outcomes:
            outcomes[rank] = (
                False,
                RankFailure(rank, "Timeout", f"no result within {timeout_s:.0f} s", ""),
            )
    failures = [v for ok, v in outcomes.values() if not ok]
    if failures and not return_failures:
        raise _spawn_error(sorted(failures, key=lambda f: f.rank))
    return [outcomes[r][1] for r in range(world_size)]
