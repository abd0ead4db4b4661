"""The spawn harness sees every way a rank can end badly, not only exceptions.

A rank is a real process on gloo. Reporting a result is not enough to pass: the rank must then
exit by itself with code 0, because a crash or a hang at its end (freeing its process groups,
its exit handlers) is a bug the tests must not hide. The ranks
below misbehave on purpose through atexit handlers, which run after the rank has put its result
on the queue and torn the process group down: exactly where such crashes happen. They run on
fresh processes (``fresh=True``).

The pool (``gradsync.testing.pool``) runs case after case on the same workers. Its tests at the
end: a case finds the state of a fresh process, whatever the previous one changed; a case that
raises, hangs, kills its process or hangs its teardown is named by rank, within its deadline,
and costs its workers (the next case gets new ones and runs); a worker that crashes at exit is
reported when the pool closes.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from gradsync.errors import SpawnError
from gradsync.testing.pool import RankPool, current_pool
from gradsync.testing.spawn import RankFailure, spawn

TIMEOUT_S = 60.0  # far above a run's few seconds of imports, so no test here depends on it


def _report(rank: int, world: int) -> dict:
    return {"rank": rank, "world": world, "t": torch.full((3,), float(rank))}


def _abort_at_exit(rank: int, world: int, bad_rank: int) -> dict:
    if rank == bad_rank:
        atexit.register(os.abort)
    return _report(rank, world)


def _hang_at_exit(rank: int, world: int) -> dict:
    if rank == 1:
        atexit.register(time.sleep, 1000)
    return _report(rank, world)


def _exit_3_before_reporting(rank: int, world: int) -> dict:
    if rank == 1:
        os._exit(3)
    return _report(rank, world)


@pytest.mark.timeout(60)
def test_a_clean_run_returns_every_rank_result() -> None:
    out = spawn(_report, 2, timeout_s=TIMEOUT_S, fresh=True)
    assert [o["rank"] for o in out] == [0, 1] and all(o["world"] == 2 for o in out)
    assert torch.equal(out[1]["t"], torch.ones(3))


@pytest.mark.timeout(60)
def test_an_abort_after_reporting_fails_the_run_and_names_the_rank() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_abort_at_exit, 2, (1,), timeout_s=TIMEOUT_S, fresh=True)
    message = str(info.value)
    assert "rank 1 exited with SIGABRT after reporting its result" in message, message
    assert [f.rank for f in info.value.failures] == [1]


@pytest.mark.timeout(60)
def test_a_hang_after_reporting_is_killed_after_the_grace_period() -> None:
    grace = 5.0  # a clean exit took up to 2.5 s on a loaded 2-core machine
    t0 = time.monotonic()
    out = spawn(
        _hang_at_exit, 2, timeout_s=TIMEOUT_S, return_failures=True, teardown_grace_s=grace,
        fresh=True,
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    assert out[0]["rank"] == 0
    assert isinstance(out[1], RankFailure), out[1]
    assert "hung in teardown" in out[1].message, out[1]
    # Startup (imports, process group) takes seconds; the 1000 s sleep and the 60 s timeout
    # must not be waited for.
    assert elapsed < grace + 20, elapsed


@pytest.mark.timeout(60)
def test_a_rank_that_exits_before_reporting_is_named_with_its_exit_code() -> None:
    out = spawn(_exit_3_before_reporting, 2, timeout_s=TIMEOUT_S, return_failures=True, fresh=True)
    assert out[0]["rank"] == 0
    assert isinstance(out[1], RankFailure), out[1]
    assert out[1].message == "exited with code 3 before reporting a result", out[1]


# -- the pool: workers that run case after case ---------------------------------------------------
# A private pool, so that these cases do not disturb the session's (conftest.py), except where
# a test checks that spawn uses the session's pool.
def _run(
    pool: RankPool, fn, args: tuple = (), timeout_s: float = TIMEOUT_S, grace_s: float = 5.0
) -> list:  # type: ignore[no-untyped-def]
    return spawn(
        fn, 2, args, timeout_s=timeout_s, return_failures=True, teardown_grace_s=grace_s, pool=pool
    )


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    pool = RankPool(keep=2)
    yield pool
    assert pool.close() == []  # each worker exited by itself, with code 0


def _state(rank: int, world: int) -> dict:
    """What a case may change in its process, as this case finds it."""
    store = dist.distributed_c10d._get_default_store()
    return {
        "pid": os.getpid(),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "random": torch.rand(2),
        "env": os.environ.get("GRADSYNC_POOL_TEST"),
        "cwd": os.getcwd(),
        "level": logging.getLogger("gradsync").level,
        "filters": len(warnings.filters),
        "sigterm": signal.getsignal(signal.SIGTERM),
        "groups": len(dist.distributed_c10d._world.pg_map),
        "stored": store.check(["left-by-an-earlier-case"]),
    }


def _spoil(rank: int, world: int) -> dict:
    """Change everything ``_state`` reads, and leave it changed."""
    before = _state(rank, world)
    dist.new_group([0, 1])
    dist.distributed_c10d._get_default_store().set("left-by-an-earlier-case", "1")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(1234)
    os.environ["GRADSYNC_POOL_TEST"] = "spoiled"
    os.chdir("/")
    logging.getLogger("gradsync").setLevel(logging.DEBUG)
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return before


@pytest.mark.timeout(120)
def test_a_pooled_case_finds_the_state_of_a_fresh_process(pool: RankPool) -> None:
    # A long grace: a teardown slowed past it by a busy machine would replace the workers.
    first = _run(pool, _spoil, grace_s=60.0)
    second = _run(pool, _state, grace_s=60.0)
    for before, after in zip(first, second, strict=True):
        assert before["pid"] == after["pid"]  # the same worker ran both cases
        assert not after["stored"] and after["groups"] == 1  # a new group and store
        assert torch.equal(before.pop("random"), after.pop("random"))  # the seed is put back
        assert before == after


def _raise_on_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("broken case")
    return os.getpid()


def _pid(rank: int, world: int) -> int:
    return os.getpid()


@pytest.mark.timeout(120)
def test_a_case_that_raises_is_named_and_its_workers_are_replaced(pool: RankPool) -> None:
    _run(pool, _pid)
    before = pool.pids()  # not the pids _pid returned: a slow teardown replaces its workers
    out = _run(pool, _raise_on_1)
    assert out[0] == before[0]
    assert isinstance(out[1], RankFailure) and out[1].exc_type == "ValueError", out[1]
    assert "broken case" in out[1].message and "_raise_on_1" in out[1].traceback
    after = _run(pool, _pid)  # new processes: a broken case cannot poison the next one
    assert not set(after) & set(before), (before, after)


def _hang_on_0(rank: int, world: int) -> int:
    if rank == 0:
        time.sleep(1000)
    return os.getpid()


@pytest.mark.timeout(120)
def test_a_hung_case_fails_at_its_deadline_and_the_next_case_runs(pool: RankPool) -> None:
    _run(pool, _pid)  # started up: the deadline below is the case's own
    before = pool.pids()  # not the pids _pid returned: a slow teardown replaces its workers
    t0 = time.monotonic()
    out = _run(pool, _hang_on_0, timeout_s=3.0)
    assert time.monotonic() - t0 < 3.0 + 5.0
    assert isinstance(out[0], RankFailure) and out[0].message == "no result within 3 s", out[0]
    assert out[1] == before[1]
    after = _run(pool, _pid)
    assert not set(after) & set(before), (before, after)


def _die(rank: int, world: int, how: str) -> int:
    if rank == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "said"), [("exit", "code 3"), ("kill", "SIGKILL")])
def test_a_case_that_kills_its_process_is_named_and_the_next_case_runs(
    pool: RankPool, how: str, said: str
) -> None:
    _run(pool, _pid)
    before = pool.pids()  # not the pids _pid returned: a slow teardown replaces its workers
    out = _run(pool, _die, args=(how,))
    assert out[0] == before[0]
    assert isinstance(out[1], RankFailure), out[1]
    assert out[1].message == f"exited with {said} before reporting a result", out[1]
    after = _run(pool, _pid)
    assert not set(after) & set(before), (before, after)


def _leave_a_thread(rank: int, world: int) -> int:
    if rank == 1:  # not a daemon: a fresh process could not exit either
        threading.Thread(target=time.sleep, args=(1000,), daemon=False).start()
    return os.getpid()


@pytest.mark.timeout(120)
def test_a_case_that_hangs_its_teardown_is_killed_after_the_grace(pool: RankPool) -> None:
    _run(pool, _pid)
    before = pool.pids()  # not the pids _pid returned: a slow teardown replaces its workers
    t0 = time.monotonic()
    out = _run(pool, _leave_a_thread)
    assert time.monotonic() - t0 < 5.0 + 5.0  # the grace, not the thread's 1000 s
    assert out[0] == before[0]
    assert isinstance(out[1], RankFailure) and "hung in teardown" in out[1].message, out[1]
    assert not set(_run(pool, _pid)) & set(before)


def _abort_at_exit_on_1(rank: int, world: int) -> int:
    if rank == 1:
        atexit.register(os.abort)
    return os.getpid()


@pytest.mark.timeout(120)
def test_a_worker_that_crashes_at_exit_is_reported_when_the_pool_closes() -> None:
    pool = RankPool(keep=2)
    try:
        _run(pool, _abort_at_exit_on_1)
    finally:
        problems = pool.close()
    assert problems == ["gradsync-pool-1 exited with SIGABRT when stopped"], problems


@pytest.mark.timeout(120)
def test_spawn_runs_on_the_sessions_pool_and_names_the_failed_rank() -> None:
    assert current_pool() is not None  # opened by conftest.py
    first, second = spawn(_pid, 2, timeout_s=TIMEOUT_S), spawn(_pid, 2, timeout_s=TIMEOUT_S)
    assert first == second
    with pytest.raises(SpawnError) as info:
        spawn(_raise_on_1, 2, timeout_s=TIMEOUT_S)
    assert "rank 1 raised ValueError: broken case" in str(info.value)
    assert [f.rank for f in info.value.failures] == [1]
    assert not set(spawn(_pid, 2, timeout_s=TIMEOUT_S)) & set(first)
