"""A rank that makes the others wait is named, with the phase it spent the time in.

Three gloo ranks; one of them sleeps 50 ms in one place: before fetching each batch (data
loading) or in each backward (a gradient hook), with two micro-batches per step (the first under
``no_sync``), or in its forward, or in its optimizer step. Within the first report, at step 10,
rank 0 logs that rank with the right phase, every rank holds the same report, and its buckets
launched late by about the sleep. A rank that sleeps 150 ms before its batch in only 2 of
every 10 steps (a periodic stall) is never late in 80 % of them, but each report after the
first names it with what it cost (a stall is named once it recurs, and the job's first window
has no steps before it). So is the issue's case: every rank's step padded to about 20 ms, and
rank 1 late by about 36 ms in its forward in every 5th step, costing the job about a fifth of
its time (the old 40 ms floor named it in no step). A balanced run of 50 steps names nobody.
One spawn for all cases.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.testing.log_lines import LogLines
from gradsync.testing.spawn import spawn

SLOW_RANK, SLEEP = 2, 0.05
STALL_RANK, STALL, STALL_STEPS = 1, 0.15, (3, 7)  # sleeps STALL s in these steps of every 10
MICRO = {"data": 2, "backward": 2, "forward": 1, "optimizer": 1}  # micro-batches per step
PAD, PERIODIC = 0.015, 0.036  # every rank's step padded (s); rank STALL_RANK's 5th-step stall


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )


def _train(rank: int, where: str, steps: int, micro: int = 1) -> dict[str, Any]:
    net = _net()
    model = gradsync.DistributedDataParallel(net, bucket_cap_mb=0, timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    slow = rank == SLOW_RANK
    if slow and where == "optimizer":
        opt.register_step_pre_hook(lambda *a: time.sleep(SLEEP))
    if slow and where == "forward":
        net[2].register_forward_hook(lambda *a: time.sleep(SLEEP))
    if slow and where == "backward":
        net[2].weight.register_hook(lambda g: time.sleep(SLEEP))
    step = 0
    if rank == STALL_RANK and where == "periodic":  # in steps 1, 6, 11, ...: 2 in every report
        net[2].register_forward_hook(lambda *a: time.sleep(PERIODIC) if step % 5 == 1 else None)
    handler = LogLines(logging.INFO)
    logging.getLogger("gradsync.stragglers").addHandler(handler)
    logging.getLogger("gradsync.stragglers").setLevel(logging.INFO)
    reports = []
    gen = torch.Generator().manual_seed(rank)
    try:
        for step in range(steps):
            if rank == STALL_RANK and where == "stall" and step % 10 in STALL_STEPS:
                time.sleep(STALL)
            if where == "periodic":
                time.sleep(PAD)
            for m in range(micro):
                if slow and where == "data":
                    time.sleep(SLEEP)
                x = torch.randn(8, 16, generator=gen)
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if (step + 1) % model.timeline.every == 0:
                reports.append(model.timeline.last_report)
    finally:
        logging.getLogger("gradsync.stragglers").removeHandler(handler)
    return {"reports": reports, "lines": handler.lines, "metrics": model.timeline.metrics()}


def _cases(rank: int, world: int) -> dict[str, Any]:
    out = {where: _train(rank, where, 10, MICRO[where]) for where in MICRO}
    out["stall"] = _train(rank, "stall", 20)
    out["periodic"] = _train(rank, "periodic", 50)
    out["balanced"] = _train(rank, "none", 50)
    return out


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    return spawn(_cases, 3, timeout_s=180)


@pytest.mark.parametrize("where", ["data", "forward", "backward", "optimizer"])
def test_the_slow_rank_is_named_with_its_phase_within_ten_steps(
    cases: list[dict[str, Any]], where: str
) -> None:
    first = cases[0][where]["reports"][0]  # the report at step 10
    named = [(s["rank"], s["phase"]) for s in first["stragglers"]]
    assert named == [(SLOW_RANK, where)], first
    late, excess = first["stragglers"][0]["late_ms"], first["stragglers"][0]["phase_excess_ms"]
    per_step = SLEEP * 1e3 * MICRO[where]
    assert 0.7 * per_step < late < 2.0 * per_step, first
    assert excess > 0.7 * per_step, first  # all of it in that phase (under no_sync too)
    # Rank 0 says it in one line; the other ranks hold the same report.
    lines = [line for line in cases[0][where]["lines"] if "arrived late" in line]
    assert len(lines) == 1 and f"rank {SLOW_RANK} arrived late" in lines[0], lines
    assert not cases[1][where]["lines"] and not cases[2][where]["lines"]
    assert all(c[where]["reports"][0]["stragglers"] == first["stragglers"] for c in cases)


@pytest.mark.parametrize("where", ["data", "forward"])
def test_a_late_start_delays_every_bucket_launch(cases: list[dict[str, Any]], where: str) -> None:
    ranks = cases[0][where]["reports"][0]["ranks"]
    slow, fast = ranks[SLOW_RANK]["bucket_late_ms"], ranks[0]["bucket_late_ms"]
    assert len(slow) == 6  # a bucket per parameter
    assert min(slow) > 0.7 * SLEEP * 1e3 > max(fast), (slow, fast)


def test_a_periodic_stall_is_named_with_what_it_cost(cases: list[dict[str, Any]]) -> None:
    reports = cases[0]["stall"]["reports"]  # at steps 9 and 19: steps 1-8, then 9-18
    assert [r["stragglers"] for r in reports] == [[], []]  # late in 2 steps of 8 or 10
    # The job's first window has no steps before it for the stall to recur in: its cost is a
    # figure, not a name. The second window's stall recurs (steps 3 and 7 before it).
    assert reports[0]["stalls"] == [], reports[0]
    assert reports[0]["ranks"][STALL_RANK]["lost_ms"] >= 0.7 * 2 * STALL * 1e3
    lines = [line for line in cases[0]["stall"]["lines"] if "was late in" in line]
    assert len(lines) == 1, cases[0]["stall"]["lines"]
    report, of, [line] = reports[1], 10, lines
    [stall] = report["stalls"]
    assert (stall["rank"], stall["phase"], stall["of"]) == (STALL_RANK, "data", of), report
    # Late in both stalled steps; a step that the shared machine slowed past 40 ms may
    # add a third. Steps it was late in by less (noise) are not the stall's.
    assert 2 <= stall["late_in"] <= 3, report
    cost = stall["late_ms"] * stall["late_in"]
    assert 0.7 * 2 * STALL * 1e3 < cost < 2.0 * 2 * STALL * 1e3, report
    # what the others waited, of the window's time: 2 sleeps of 150 ms against steps of
    # about 20 ms, 50 ms on a loaded CI machine (the share stays above 20 % unless the
    # steps take 120 ms or more)
    assert stall["job_lost_pct"] == pytest.approx(100.0 * cost / report["window_ms"])
    assert report["ranks"][STALL_RANK]["lost_ms"] >= 0.7 * 2 * STALL * 1e3  # and small delays
    assert stall["job_lost_pct"] > 20.0, report
    assert line == (
        f"gradsync: rank {STALL_RANK} was late in {stall['late_in']} of the last {of} steps by "
        f"{stall['late_ms']:.1f} ms, in data loading (between steps), costing the job "
        f"{stall['job_lost_pct']:.0f}% of its time"
    )
    assert all(c["stall"]["reports"][1]["stalls"] == reports[1]["stalls"] for c in cases)
    assert not cases[1]["stall"]["lines"] and not cases[2]["stall"]["lines"]
    metrics = cases[0]["stall"]["metrics"]
    assert metrics["gradsync/stalls"] == 1.0 and metrics["gradsync/stragglers"] == 0.0
    assert metrics[f"gradsync/rank{STALL_RANK}/lost_pct"] > 20.0


def test_a_periodic_stall_under_40_ms_is_named_against_the_jobs_noise(
    cases: list[dict[str, Any]],
) -> None:
    reports = cases[0]["periodic"]["reports"]  # steps 1-8, 9-18, ..., 39-48: 2 stalls in each
    assert all(r["stragglers"] == [] for r in reports), reports
    assert all(s["rank"] == STALL_RANK for r in reports for s in r["stalls"]), reports
    named = [(r, s) for r in reports for s in r["stalls"]]
    # A window in which the loaded machine made the other ranks stray as far as the stall
    # (the noise is measured over the history, 8 to 48 steps here) rightly names nobody; a
    # job of 5 windows in which none stands out would be a machine unfit to run this test.
    assert named, [r["ranks"][STALL_RANK] for r in reports]
    for report, stall in named:
        # both stalls; a step a few ms beyond a quiet job's noise may add one more
        assert 2 <= stall["late_in"] <= 3, report
        assert stall["phase"] == "forward" or stall["late_in"] > 2, report
        lost = stall["late_ms"] * stall["late_in"]
        assert 0.7 * 2 * PERIODIC * 1e3 < lost < 2.0 * 2 * PERIODIC * 1e3, report
        assert stall["job_lost_pct"] >= 15.0, report
        assert stall["late_ms"] >= 2.5 * report["ranks"][STALL_RANK]["noise_ms"], report
    assert all(c["periodic"]["reports"] == reports for c in cases[1:])


def test_a_balanced_run_names_nobody(cases: list[dict[str, Any]]) -> None:
    reports = cases[0]["balanced"]["reports"]
    assert len(reports) == 5
    assert all(r["stragglers"] == [] and r["stalls"] == [] for r in reports), reports
    assert not [line for line in cases[0]["balanced"]["lines"] if "late in" in line]
    assert cases[0]["balanced"]["metrics"]["gradsync/stalls"] == 0.0


def test_the_figures_are_plain_numbers_for_a_metrics_logger(cases: list[dict[str, Any]]) -> None:
    metrics = cases[0]["optimizer"]["metrics"]
    assert metrics["gradsync/stragglers"] == 1.0
    assert metrics[f"gradsync/rank{SLOW_RANK}/optimizer_ms"] > 0.7 * SLEEP * 1e3
    assert all(isinstance(v, float) for v in metrics.values())
