"""In-process recovery at scale: the roll call and the regroup cost a survivor the same number
of store operations at any world size; a rank on another host is seen gone by its heartbeat
within half a second; a stopped rank is named at once; a live rank slowed by load is never
left out.

Each case is a run of ``gradsync.testing.lose_a_rank``: ranks on a TCPStore on loopback, hosted
by rank 0's process (as torchrun's), every store operation counted; the last rank SIGKILLs (or
SIGSTOPs) itself inside backward of step 2, and the survivors' parameters must equal one
process trained on the same global batches. The 16- and 32-rank figures are
``benchmarks/recovery_scale.py``'s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
import torch

from gradsync.recovery.heartbeat import STALE_S, WATCH_S
from gradsync.recovery.membership import GRACE_S
from gradsync.testing.lose_a_rank import beats_stand_still, lose_a_rank, reference
from gradsync.testing.spawn import RankFailure, spawn

STEPS, AT_STEP = 5, 2


def _run(world: int, at_step: int = AT_STEP, **options: object) -> list[dict]:
    results = spawn(
        lose_a_rank,
        world,
        (world - 1, at_step, STEPS, options),
        fresh=True,
        return_failures=True,
        timeout_s=120,
    )
    assert isinstance(results[-1], RankFailure), results[-1]  # the victim
    survivors = results[:-1]
    for r in survivors:
        assert not isinstance(r, RankFailure), r
    return survivors


def _check_equal_to_one_process(survivors: list[dict], world: int) -> None:
    ref = reference(world, STEPS)
    for r in survivors:
        assert [e["world_size"] for e in r["events"]] == [world - 1], r["events"]
        assert r["events"][0]["lost"] == [world - 1], r["events"]
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-12, msg=name)


@pytest.mark.timeout(240)
def test_a_survivors_store_operations_do_not_grow_with_the_world_size() -> None:
    counts = {}
    for world in (4, 8):
        survivors = _run(world)
        _check_equal_to_one_process(survivors, world)
        roll_call = sorted(r["ops"]["roll call"]["ops"] for r in survivors)
        regroup = [r["gradsync_ops"]["regroup"]["ops"] for r in survivors]
        counts[world] = roll_call, regroup
        # All but the leader: announce, answer, propose a leader, wait for and read the decision.
        assert roll_call[:-1] == [5] * (world - 2), (world, roll_call)
        assert roll_call[-1] <= 40, (world, roll_call)  # the leader's polls: time, not ranks
    # gradsync's own in the regroup (torch's group set-up is O(N) each: docs/recovery.md)
    assert max(counts[8][1]) <= max(counts[4][1]) + 1 <= 12, counts


@pytest.mark.timeout(180)
def test_survivors_compare_their_first_batches_again_only_when_redoing_the_step_that_did() -> None:
    """A survivors' regroup skips the gather of every rank's first-batch fingerprint, known to
    have run, unless the step redone is the one whose forward ran it (a loss in the job's first
    step): then every survivor runs it again, the same collective on every rank."""
    for at_step, checks in ((0, 2), (AT_STEP, 1)):
        survivors = _run(3, at_step=at_step, count_batch_checks=True)
        _check_equal_to_one_process(survivors, 3)
        assert [r["batch_checks"] for r in survivors] == [checks, checks], at_step


@pytest.mark.timeout(180)
def test_a_stopped_rank_is_named_and_the_job_restarts_within_the_watch_and_the_window() -> None:
    """SIGSTOP keeps the rank's connections open: the survivors would wait in their all-reduce
    for the wrapper's whole timeout (300 s by default). Its heartbeat stops instead: its
    watcher announces a regroup after ``WATCH_S``, the leader sees the process stopped, and
    every survivor takes the restart path naming it."""
    survivors = _run(4, signal_name="SIGSTOP")
    window = 1.0  # Recovery's default
    for r in survivors:
        assert "rank(s) [3] of generation 0 are alive but did not answer" in r["no_recovery"], r
        assert "is stopped" in r["no_recovery"], r
        assert WATCH_S <= r["raised"] - r["signalled"] < WATCH_S + window + GRACE_S, r


def _burners(n: int) -> list[subprocess.Popen[bytes]]:
    """Processes that keep the CPUs busy beside the ranks."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


@pytest.mark.timeout(180)
def test_on_separate_hosts_a_dead_rank_is_seen_gone_by_its_heartbeat_not_the_window() -> None:
    """No rank can look up another's process (each in a pid space of its own, as on separate
    hosts): the killed rank's heartbeat standing still is all that tells it from a slow one,
    long before the roll call's window runs out (a long one here, so that a loaded machine's
    delays cannot be mistaken for it; the figure, 0.33 s, is recovery_scale.py's)."""
    window = 6.0
    survivors = _run(4, separate_hosts=True, window=window)
    _check_equal_to_one_process(survivors, 4)
    detected = [r["events"][0]["agreed"] - r["signalled"] for r in survivors]
    assert statistics.median(detected) < window / 2, detected  # not the window's end
    assert min(detected) >= STALE_S * 0.9, detected  # the heartbeat told, not a process lookup


@pytest.mark.timeout(240)
def test_live_ranks_slowed_by_load_are_never_left_out() -> None:
    """Four busy processes beside four ranks on this machine's cores (every rank slowed 2-3x),
    and rank 1 computing 0.1 s more in every step: when rank 3 dies, the survivors are the
    three live ranks, every one of them, and no other membership change happens."""
    burners = _burners(4)
    try:
        survivors = _run(4, separate_hosts=True, slow_rank=1, slow_s=0.1)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    _check_equal_to_one_process(survivors, 4)


@pytest.mark.timeout(120)
def test_a_live_rank_whose_beats_stand_still_a_moment_sets_off_no_regroup() -> None:
    """Rank 1's beating thread cannot run for longer than the roll call's 0.3 s (as when a
    loaded machine starves it), inside backward, while the others wait for it in the
    all-reduce: nobody is lost, so the watchers announce nothing and the job runs on as it
    was, equal to one process."""
    stand_still = (STALE_S + WATCH_S) / 2
    results = spawn(beats_stand_still, 3, (1, stand_still, STEPS), fresh=True, timeout_s=90)
    ref = reference(3, STEPS)
    for r in results:
        assert r["events"] == [], r["events"]
        for name, p in r["params"].items():
            torch.testing.assert_close(p, ref[name], rtol=0, atol=1e-12, msg=name)
