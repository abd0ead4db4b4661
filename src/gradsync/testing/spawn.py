"""Run a function on N local gloo ranks: the harness behind the tests and ``gradsync verify``.

Each rank joins a gloo process group through a ``file://`` store in a private temp dir: no
ports, so any number of these can run side by side. The process-group timeout is seconds, not
torch's 30-minute default, so a hang fails fast. Errors come back tagged with the rank that
raised them.

The ranks are fresh processes (``fresh.py``), or, while a pool is open (``pool.py``; the test
session opens one), long-lived workers that run case after case, each on a new group and with
the process state of a fresh start put back; both are forked from one server that imported the
library (``forkserver.py``). Either way a rank passes only if it returns and then ends
cleanly: a fresh process must exit by itself with code 0 (a crash or hang in its exit
handlers or in freeing its process groups fails the run like any other crash); a pooled worker
must free its process groups and threads in time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gradsync.testing.fresh import run_fresh
from gradsync.testing.pool import RankPool, current_pool
from gradsync.testing.ranks import (
    TEARDOWN_GRACE_S,
    InitFailure,
    Job,
    Outcome,
    RankFailure,
    spawn_error,
)

__all__ = ["TEARDOWN_GRACE_S", "RankFailure", "spawn"]


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
    fresh: bool = False,
    pool: RankPool | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each result.

    ``fn`` must be importable by name (a module-level function). ``backend="nccl"`` puts rank
    ``r`` on GPU ``r % device_count``. On failure raises :class:`~gradsync.errors.SpawnError`
    naming the rank (its ``failures`` holds every failed rank's :class:`RankFailure`), unless
    ``return_failures`` is set, in which case a failed rank's entry in the returned list is its
    :class:`RankFailure`. A rank that neither returns nor raises within ``timeout_s`` is killed
    and reported as a failure. So is a rank that returned but then does not end cleanly within
    ``teardown_grace_s`` of the last rank reporting (see the module's docstring).

    The ranks run on ``pool``, else on the open pool (:func:`~gradsync.testing.pool.open_pool`)
    if any, unless ``fresh`` (or ``backend`` is not gloo): a rank that kills its process, or
    changes what a process keeps between cases (environment read at import, a framework's
    process singletons), or checks its own exit, needs ``fresh=True``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if fresh or backend != "gloo":
        pool = None
    elif pool is None:
        pool = current_pool()
    job = Job(fn, world_size, args, pg_timeout_s, timeout_s, backend, teardown_grace_s)
    outcomes = _attempt(job, pool)
    failures = [v for ok, v in outcomes.values() if not ok]
    if failures and all(f.exc_type == InitFailure.__name__ for f in failures):
        # gloo's connectFullMesh now and then loses a connection while a loaded 2-core machine
        # starts many processes at once ("Connection closed by peer" inside
        # init_process_group). No rank has run ``fn`` yet, so one new start cannot hide a
        # fault of the code under test (a pool replaces the workers of a failed case).
        outcomes = _attempt(job, pool)
        failures = [v for ok, v in outcomes.values() if not ok]
    if failures and not return_failures:
        raise spawn_error(sorted(failures, key=lambda f: f.rank))
    return [outcomes[r][1] for r in range(world_size)]


def _attempt(job: Job, pool: RankPool | None) -> dict[int, Outcome]:
    """One run of every rank: each rank's (ok, result or RankFailure)."""
    # A pool runs one case at a time; a run started while it is busy (from another thread)
    # gets fresh processes rather than waiting.
    if pool is not None and not pool.busy():
        return pool.run(job)
    return run_fresh(job)
