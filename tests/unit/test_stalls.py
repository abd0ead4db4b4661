"""A stall is named by what it costs the job against the job's own noise, at any step length.

Windows are built from records (no clock): three ranks with the same work, each step's
``busy`` time jittered by a seeded random amount on every rank, and rank 1 late in its
forward in every 5th step. Scaling every duration of a window by the same factor (a 1 ms stall
on sub-millisecond steps, or 2 s stalls on 1.6 s steps) must not change the verdict.
"""

from __future__ import annotations

import random

import pytest
import torch

from gradsync.timing import RankStep, StepTimeline, Thresholds
from gradsync.timing.attribution import attribute, describe

STEP, STALL, JITTER = 32.0, 38.0, 1.0  # ms: the case, before scaling


def _step(busy: list[float], forward_extra: list[float], scale: float) -> list[RankStep]:
    """One step of every rank: ``busy`` split over the phases (the extra in the forward), and
    every rank's interval the same: the last rank's busy time plus the collective."""
    interval = max(busy) + 0.05 * STEP * scale
    return [
        RankStep((0.2 * (b - x), 0.3 * (b - x) + x, 0.4 * (b - x), 0.1 * (b - x), interval - b))
        for b, x in zip(busy, forward_extra, strict=True)
    ]


def _periodic(scale: float = 1.0, stall: float = STALL, jitter: float = JITTER, seed: int = 0,
              steps: int = 10, first: int = 0) -> list:  # fmt: skip
    """``steps`` steps of STEP ms on 3 ranks; rank 1 is ``stall`` ms late in its forward in
    every 5th step; every rank's busy time jittered by up to ``jitter`` ms; all times
    ``scale``d."""
    noise = random.Random(seed)
    window = []
    for s in range(first, first + steps):
        extra = [stall if r == 1 and s % 5 == 0 else 0.0 for r in range(3)]
        busy = [STEP + noise.uniform(-jitter, jitter) + x for x in extra]
        window.append((s, _step([b * scale for b in busy], [x * scale for x in extra], scale)))
    return window


def test_a_periodic_stall_just_under_40_ms_costing_a_fifth_is_named() -> None:
    # The case: late by 38 ms in every 5th step of 32 ms (the median rank's own time
    # subtracted), costing the job about a fifth of its time; the other ranks' noise is ~2 ms.
    report = attribute(_periodic())
    assert report["stragglers"] == []
    [stall] = report["stalls"]
    assert (stall["rank"], stall["phase"], stall["late_in"], stall["of"]) == (1, "forward", 2, 10)
    assert stall["late_ms"] == pytest.approx(STALL, abs=2 * JITTER)
    assert 15.0 < stall["job_lost_pct"] < 20.0, report  # under the old 20 % share too
    assert report["ranks"][1]["noise_ms"] < 2 * JITTER
    assert describe(report) == [
        f"gradsync: rank 1 was late in 2 of the last 10 steps by {stall['late_ms']:.1f} ms, in "
        f"the forward, costing the job {stall['job_lost_pct']:.0f}% of its time"
    ]


@pytest.mark.parametrize(
    "scale",
    [1 / 38, 3 / 32, 50.0],  # a 1 ms stall on 0.84 ms steps; steps of 3 ms; 1.9 s on 1.6 s
)
def test_the_verdict_does_not_depend_on_the_step_length(scale: float) -> None:
    base = attribute(_periodic())
    scaled = attribute(_periodic(scale))
    [stall], [ref] = scaled["stalls"], base["stalls"]
    assert (stall["rank"], stall["phase"], stall["late_in"]) == (ref["rank"], ref["phase"], 2)
    assert stall["late_ms"] == pytest.approx(ref["late_ms"] * scale)
    assert stall["job_lost_pct"] == pytest.approx(ref["job_lost_pct"])
    # noise as large as the stall hides it at every scale alike
    assert attribute(_periodic(scale, jitter=STALL))["stalls"] == []


def test_a_stall_within_the_jobs_noise_is_not_named() -> None:
    # Every rank's step varies by up to 38 ms: the stall is under 2.5 times the other ranks'
    # spread, though it costs the job 19 % of its time.
    report = attribute(_periodic(jitter=STALL))
    assert report["stalls"] == [] and report["ranks"][1]["noise_ms"] > STALL / 2.5
    assert report["ranks"][1]["lost_pct"] > 15.0
    # Well beyond that noise: named.
    [stall] = attribute(_periodic(stall=150.0, jitter=STALL))["stalls"]
    assert (stall["rank"], stall["late_in"]) == (1, 2)


def test_one_late_step_is_not_a_stall() -> None:
    # A rank of an oversubscribed machine loses its core for a step now and then: once in a
    # window is not named, however late; twice, apart, is.
    window = _periodic(stall=0.0)
    recs = list(window[3][1])
    recs[2] = _step([STEP, STEP, STEP + 300.0], [0.0, 0.0, 300.0], 1.0)[2]
    window[3] = (3, recs)
    report = attribute(window)
    assert report["stalls"] == [] and report["ranks"][2]["lost_pct"] > 50.0
    assert attribute(window, Thresholds(min_stall_steps=1))["stalls"][0]["rank"] == 2
    # Nor is one that spills into the next step (one incident, two steps); once more later is.
    window[4] = (4, window[3][1])
    assert attribute(window)["stalls"] == []
    window[7] = (7, window[3][1])
    [stall] = attribute(window)["stalls"]
    assert (stall["rank"], stall["late_in"]) == (2, 3)


def test_the_noise_is_measured_over_the_reference_history() -> None:
    # The same quiet window, after 90 steps in which every rank varied by up to 20 ms: the
    # stall does not stand out from what this job does.
    window = _periodic(first=90)
    noisy = _periodic(jitter=20.0, stall=0.0, steps=90, seed=1)
    assert attribute(window)["stalls"]
    report = attribute(window, reference=noisy + window)
    assert report["stalls"] == [] and report["ranks"][1]["noise_ms"] > STALL / 2.5


def test_with_two_ranks_the_other_ranks_steps_are_the_noise() -> None:
    # Lateness is over the median rank, which with two ranks is their mean: half the gap, so
    # the stall here is twice the to cost the same share.
    window = [(s, recs[:2]) for s, recs in _periodic(stall=2 * STALL)]
    [stall] = attribute(window)["stalls"]
    assert (stall["rank"], stall["late_in"]) == (1, 2)
    assert stall["late_ms"] == pytest.approx(STALL, abs=JITTER)
    noisy = [(s, recs[:2]) for s, recs in _periodic(stall=2 * STALL, jitter=2 * STALL)]
    assert attribute(noisy)["stalls"] == []


def test_the_timeline_judges_its_report_against_its_whole_history() -> None:
    timeline = StepTimeline(10, rank=0, world_size=3, device=torch.device("cpu"))
    window = _periodic(first=90)
    timeline.history.extend(_periodic(jitter=20.0, stall=0.0, steps=90, seed=1) + window)
    assert attribute(window)["stalls"] and timeline.report()["stalls"] == []
    assert timeline.report()["ranks"][1]["noise_ms"] > STALL / 2.5


def test_a_stall_is_named_once_it_recurs() -> None:
    # Judged against the kept history, a window's stall is named only if the rank stalled
    # beyond the same bar in the steps before it too: a periodic stall does, two chance
    # pauses of a loaded machine in one window seldom do, and the job's first window cannot.
    quiet = _periodic(stall=0.0, steps=20)
    window = _periodic(first=20)
    assert attribute(window)["stalls"]  # judged alone: nothing to recur in is asked
    assert attribute(window, reference=quiet + window)["stalls"] == []
    assert attribute(window, reference=window)["stalls"] == []  # the job's first window
    assert attribute(window, reference=_periodic(steps=30))["stalls"][0]["rank"] == 1
    # once, in the window's length of steps before it, is enough; earlier than that is not
    stalled = _periodic(steps=20)
    for once, named in ((15, True), (5, False)):
        history = [*quiet[:once], stalled[once], *quiet[once + 1 :]]
        assert bool(attribute(window, reference=history + window)["stalls"]) is named, once
