"""One run on fresh processes: each rank a new process, gone when it ends.

A rank passes only if it returns and then exits by itself with code 0: a crash or hang at
its end (tearing down its process groups, an ``atexit`` handler) fails the run like any other
crash. This is the way to run a rank that kills itself, changes what a process keeps
(a framework's process singletons, environment variables read once per process), or uses NCCL.

Each rank is forked from the forkserver, not spawned ([Note: processes from a forkserver] in
``forkserver.py``): as fresh as a spawned process but for the imports.
"""

from __future__ import annotations

import atexit
import os
import queue as queue_mod
import tempfile
import time
from typing import Any

import torch

from gradsync.testing.forkserver import forkserver, parents, take_parents
from gradsync.testing.ranks import (
    Job,
    Outcome,
    RankFailure,
    died,
    free_groups,
    hung_in_teardown,
    load_result,
    run_rank,
    timed_out,
    verdict,
)


def _rank_entry(
    rank: int, job: Job, init_file: str, results: Any, parent: tuple[dict[str, str], str]
) -> None:
    take_parents(*parent)  # not the server's ([Note: processes from a forkserver])
    torch.set_num_threads(1)
    try:
        ok, value = run_rank(
            rank, job.world_size, job.fn, job.args, init_file, job.pg_timeout_s, job.backend
        )
        results.put((rank, ok, value))
    finally:
        free_groups()
        # A forked process ends in os._exit, skipping the interpreter's exit: run what a spawned
        # rank would run there, so that a handler that crashes or hangs fails the run as before.
        atexit._run_exitfuncs()


def _receive(results: Any, outcomes: dict[int, Outcome], timeout: float) -> bool:
    """Move one report from the queue into ``outcomes``; ``False`` if none came in ``timeout``."""
    try:
        rank, ok, value = results.get(timeout=timeout)
    except queue_mod.Empty:
        return False
    outcomes[rank] = load_result(ok, value)
    return True


def _kill(p: Any) -> None:
    p.kill()
    p.join()


def _collect(
    procs: list[Any], results: Any, timeout_s: float, grace_s: float
) -> dict[int, Outcome]:
    """``rank -> (ok, result or RankFailure)`` once every rank has exited or been killed.

    A report is not the end of a rank: it must then exit, with code 0, within ``grace_s`` of the
    last rank reporting (the grace starts then, not at its own report, because tearing down a
    process group may wait on peers still at work). Anything else fails it, result or not."""
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, Outcome] = {}
    killed: dict[int, RankFailure] = {}

    def computing() -> list[int]:
        return [r for r, p in enumerate(procs) if r not in outcomes and p.exitcode is None]

    while computing() and time.monotonic() < deadline:
        _receive(results, outcomes, timeout=0.2)
    while _receive(results, outcomes, timeout=0.0):
        pass
    for rank in computing():
        _kill(procs[rank])
        killed[rank] = timed_out(rank, timeout_s)
    grace_end = time.monotonic() + grace_s
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.0, grace_end - time.monotonic()))
        if p.exitcode is None:
            _kill(p)
            killed[rank] = hung_in_teardown(rank, grace_s)
    # Reports of ranks that exited after the last read are still in the pipe.
    while _receive(results, outcomes, timeout=0.0):
        pass
    verdicts = {}
    for rank, p in enumerate(procs):
        reported = outcomes.get(rank)
        fault = killed.get(rank)
        if fault is None and (p.exitcode != 0 or reported is None):
            fault = died(rank, p.exitcode, reported)
        verdicts[rank] = verdict(reported, fault)
    return verdicts


def run_fresh(job: Job) -> dict[int, Outcome]:
    """One start of every rank: each rank's (ok, result or RankFailure)."""
    ctx = forkserver()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="gradsync-spawn-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(rank, job, init_file, results, parents()),
                daemon=True,
            )
            for rank in range(job.world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, job.timeout_s, job.teardown_grace_s)
        finally:
            for p in procs:  # only on an error in this process (Ctrl-C, a result that won't load)
                if p.is_alive():
                    _kill(p)
