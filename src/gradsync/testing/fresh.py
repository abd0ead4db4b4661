"""One run on fresh processes: each rank a new ``spawn``-method process, gone when it ends.

A rank passes only if it returns and then exits by itself with code 0: a crash or hang at
interpreter shutdown (a process-group destructor racing finalisation) fails the run like any
other crash. This is the way to run a rank that kills itself, changes what a process keeps
(environment variables read at import, a framework's process singletons), or uses NCCL.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

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


def _rank_entry(rank: int, job: Job, init_file: str, results: Any) -> None:
    torch.set_num_threads(1)
    try:
        ok, value = run_rank(
            rank, job.world_size, job.fn, job.args, init_file, job.pg_timeout_s, job.backend
        )
        results.put((rank, ok, value))
    finally:
        free_groups()


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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # One thread per rank: on a 2-core machine oversubscription turns seconds into minutes.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gradsync-spawn-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_entry,
                args=(rank, job, init_file, results),
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
