"""The spawn harness sees every way a rank can end badly, not only exceptions.

A rank is a real process on gloo. Reporting a result is not enough to pass: the rank must then
exit by itself with code 0, because a crash or a hang at interpreter shutdown (a process-group
destructor racing the interpreter's finalisation) is a bug the tests must not hide. The ranks
below misbehave on purpose through atexit handlers, which run after ``_rank_entry`` has put the
result on the queue and torn the process group down: exactly where such crashes happen.
"""

from __future__ import annotations

import atexit
import os
import time

import pytest
import torch

from gradsync.errors import SpawnError
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
    out = spawn(_report, 2, timeout_s=TIMEOUT_S)
    assert [o["rank"] for o in out] == [0, 1] and all(o["world"] == 2 for o in out)
    assert torch.equal(out[1]["t"], torch.ones(3))


@pytest.mark.timeout(60)
def test_an_abort_after_reporting_fails_the_run_and_names_the_rank() -> None:
    with pytest.raises(SpawnError) as info:
        spawn(_abort_at_exit, 2, (1,), timeout_s=TIMEOUT_S)
    message = str(info.value)
    assert "rank 1 exited with SIGABRT after reporting its result" in message, message
    assert [f.rank for f in info.value.failures] == [1]


@pytest.mark.timeout(60)
def test_a_hang_after_reporting_is_killed_after_the_grace_period() -> None:
    grace = 5.0  # a clean exit took up to 2.5 s on a loaded 2-core machine
    t0 = time.monotonic()
    out = spawn(_hang_at_exit, 2, timeout_s=TIMEOUT_S, return_failures=True, teardown_grace_s=grace)
    elapsed = time.monotonic() - t0
    assert out[0]["rank"] == 0
    assert isinstance(out[1], RankFailure), out[1]
    assert "hung in teardown" in out[1].message, out[1]
    # Startup (imports, process group) takes seconds; the 1000 s sleep and the 60 s timeout
    # must not be waited for.
    assert elapsed < grace + 20, elapsed


@pytest.mark.timeout(60)
def test_a_rank_that_exits_before_reporting_is_named_with_its_exit_code() -> None:
    out = spawn(_exit_3_before_reporting, 2, timeout_s=TIMEOUT_S, return_failures=True)
    assert out[0]["rank"] == 0
    assert isinstance(out[1], RankFailure), out[1]
    assert out[1].message == "exited with code 3 before reporting a result", out[1]
