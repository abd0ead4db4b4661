"""A pool of long-lived rank processes that run case after case, each on a fresh gloo group.

Starting a rank costs seconds (a new interpreter importing torch); running a small case costs
less. So :func:`~gradsync.testing.spawn.spawn` runs its ranks on this pool while one is open
(the test session opens one). Worker ``r`` plays rank ``r`` of every case of world size above
``r``. What each case gets is what spawn's fresh processes give it:

- a new process group, through a new ``file://`` store, torn down (with garbage collected)
  before the worker is reused: no c10d state is shared between cases;
- the process-global state a fresh process starts with (``pristine.py``);
- the same report: each rank's result, or a :class:`~gradsync.testing.ranks.RankFailure`
  tagged with the rank, under the same deadline and teardown grace.

A case that fails in any way (a rank raised, died, ran past its deadline, hung in teardown, or
left something behind that cannot be reset) costs the workers it ran on: they are killed and
replaced by fresh processes before the next case, so a broken case cannot poison later ones.
What only a fresh process checks, its own exit, is checked once per worker when the pool
closes (:meth:`RankPool.close` returns the workers that did not exit cleanly). Workers, new and
replacements alike, are forked from the forkserver ([Note: processes from a forkserver]), so
growing the pool for a large case or replacing a failed one costs no imports.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Any

from gradsync.testing.forkserver import forkserver, parents
from gradsync.testing.pool_worker import send, serve
from gradsync.testing.ranks import (
    Job,
    Outcome,
    RankFailure,
    died,
    exit_text,
    hung_in_teardown,
    load_result,
    timed_out,
    verdict,
)


class _Worker:
    """One pooled process and the parent's end of its pipe."""

    def __init__(self, index: int) -> None:
        ctx = forkserver()
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=serve, args=(child, parents()), daemon=True, name=f"gradsync-pool-{index}"
        )
        self.process.start()
        child.close()
        self.gone = False  # its pipe is closed: it exited or was killed
        self.ready = False  # it has taken its parent's state and waits for a case

    def read(self, case: int, into: dict[str, Any]) -> None:
        """Everything the worker has sent for ``case``; once it has exited, ``gone``."""
        self._drain(case, into)
        if not self.gone and not self.process.is_alive():
            self._drain(case, into)  # what it sent just before it exited
            self.gone = True

    def _drain(self, case: int, into: dict[str, Any]) -> None:
        try:
            while not self.gone and self.conn.poll():
                kind, sent_for, *rest = pickle.loads(self.conn.recv_bytes())
                self.ready = self.ready or kind == "ready"
                if sent_for == case:
                    into[kind] = rest
        except (EOFError, OSError):
            self.gone = True

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()
        self.gone = True


class RankPool:
    """Worker processes kept between runs; ``keep`` of them stay after a larger run."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._workers: list[_Worker] = []
        self._stopping: list[_Worker] = []  # told to stop; their exit is checked at close
        self._lock = threading.Lock()
        self._cases = itertools.count()
        self.started = 0  # processes started so far (the tests count replacements)
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every worker

    def busy(self) -> bool:
        return self._lock.locked()

    def pids(self) -> list[int]:
        return [w.process.pid or 0 for w in self._workers]

    def run(self, job: Job) -> dict[int, Outcome]:
        """One case on ranks ``0 .. world_size - 1``: each rank's (ok, result or RankFailure).
        The pool's ranks are gloo ranks: ``job.backend`` is not read."""
        world_size, pg_timeout_s = job.world_size, job.pg_timeout_s
        payload = pickle.dumps((job.fn, job.args), protocol=pickle.HIGHEST_PROTOCOL)
        deadline = time.monotonic() + job.timeout_s  # like a fresh process's, from its start
        with self._lock:
            while len(self._workers) < world_size:
                self._start(len(self._workers))
            workers = self._workers[:world_size]
            case = next(self._cases)
            # Every rank waits for the others in init_process_group for pg_timeout_s only:
            # a rank still importing torch must not count against that.
            _await_ready(workers, deadline)
            with tempfile.TemporaryDirectory(prefix="gradsync-pool-") as tmp:
                store = os.path.join(tmp, "store")
                for rank, w in enumerate(workers):
                    message = ("case", case, sys.path, rank, world_size, store, pg_timeout_s)
                    try:
                        if w.ready:
                            send(w.conn, (*message, payload))
                    except OSError:  # died while idle; the collection reports it
                        w.gone = True
                outcomes, replace = _collect(
                    workers, case, deadline, job.timeout_s, job.teardown_grace_s
                )
            for rank in replace:
                workers[rank].kill()
                self._start(rank)
            self._trim()
        return outcomes

    def _start(self, index: int) -> None:
        worker = _Worker(index)
        self.started += 1
        if index < len(self._workers):
            self._workers[index] = worker
        else:
            self._workers.append(worker)

    def _trim(self) -> None:
        """Stop the workers past ``keep`` (a rare large run should not hold memory for good)."""
        while len(self._workers) > self.keep:
            self._stop(self._workers.pop())

    def _stop(self, worker: _Worker) -> None:
        try:
            send(worker.conn, ("stop",))
        except OSError:
            pass
        self._stopping.append(worker)

    def close(self, grace_s: float = 30.0) -> list[str]:
        """Stop every worker; the ones that did not exit by themselves with code 0 within
        ``grace_s`` (a crash or hang in their exit handlers), one line each."""
        with self._lock:
            for w in self._workers:
                self._stop(w)
            self._workers = []
            problems, end = [], time.monotonic() + grace_s
            for w in self._stopping:
                w.process.join(timeout=max(0.0, end - time.monotonic()))
                if w.process.exitcode is None:
                    w.kill()
                    problems.append(f"{w.process.name} hung at exit ({grace_s:g} s, killed)")
                elif w.process.exitcode != 0:
                    code = exit_text(w.process.exitcode)
                    problems.append(f"{w.process.name} exited with {code} when stopped")
            self._stopping = []
        return problems


def _await_ready(workers: list[_Worker], deadline: float) -> None:
    """Until every worker has started up (or died), or ``deadline``."""
    while time.monotonic() < deadline:
        starting = [w for w in workers if not w.ready and not w.gone]
        if not starting:
            return
        ends = [w.conn for w in starting] + [w.process.sentinel for w in starting]
        wait(ends, timeout=max(0.0, min(deadline - time.monotonic(), 0.5)))
        for w in starting:
            w.read(-1, {})


def _collect(
    workers: list[_Worker], case: int, deadline: float, timeout_s: float, grace_s: float
) -> tuple[dict[int, Outcome], list[int]]:
    """``rank -> (ok, result or RankFailure)``, and the ranks whose workers must be replaced.

    As for fresh processes (``fresh.py``), a report is not the end of a rank: it must then
    free its groups within ``grace_s`` of the last rank reporting. A rank that does not is
    killed; so is one that has not reported within ``timeout_s``."""
    sent: list[dict[str, Any]] = [{} for _ in workers]

    def waiting(stage: str) -> list[int]:
        return [r for r, w in enumerate(workers) if stage not in sent[r] and not w.gone]

    def pump(ranks: list[int], until: float) -> None:
        ends = [workers[r].conn for r in ranks] + [workers[r].process.sentinel for r in ranks]
        wait(ends, timeout=max(0.0, min(until - time.monotonic(), 0.5)))
        for r in ranks:
            workers[r].read(case, sent[r])

    while waiting("result") and time.monotonic() < deadline:
        pump(waiting("result"), deadline)
    killed: dict[int, RankFailure] = {}
    for rank in waiting("result"):
        workers[rank].kill()
        killed[rank] = timed_out(rank, timeout_s)
    grace_end = time.monotonic() + grace_s
    while waiting("clean") and time.monotonic() < grace_end:
        pump(waiting("clean"), grace_end)
    for rank in waiting("clean"):
        workers[rank].kill()
        killed[rank] = hung_in_teardown(rank, grace_s)
    outcomes: dict[int, Outcome] = {}
    for rank, w in enumerate(workers):
        reported = load_result(*sent[rank]["result"]) if "result" in sent[rank] else None
        fault = killed.get(rank)
        if fault is None and w.gone:
            w.process.join()
            fault = died(rank, w.process.exitcode or 0, reported)
        outcomes[rank] = verdict(reported, fault)
    failed = any(not ok for ok, _ in outcomes.values())
    dirty = any(s.get("clean", ["gone"])[0] for s in sent)
    return outcomes, list(range(len(workers))) if failed or dirty else []


_pool: RankPool | None = None


def open_pool(keep: int = 4) -> RankPool:
    """Make :func:`~gradsync.testing.spawn.spawn` run its gloo ranks on a pool from now on."""
    global _pool
    if _pool is None:
        _pool = RankPool(keep)
    return _pool


def current_pool() -> RankPool | None:
    return _pool


def close_pool() -> list[str]:
    """Close the open pool (if any): :meth:`RankPool.close`'s problems."""
    global _pool
    pool, _pool = _pool, None
    return pool.close() if pool is not None else []
