"""Who made the others wait, in which phase, and what it cost: pure arithmetic on the records.

[Note: naming a straggler]
In a step, the ranks that arrived last at the step's final collective are those with the most
``busy`` time (the interval minus the exposed communication, see [Note: step phases]); how late
a rank was is its busy time minus the median rank's, which is what a typical rank waited for
it. Noise makes *some* rank last in every step, so a rank is named only if, over a window,

- it was late by more than the threshold in at least 80 % of the steps (two ranks equally
  slow are both late in every step, though only one of them is the very last), and
- it was late on average by more than the threshold,

where the threshold is the larger of ``min_late_ms`` and ``min_late_fraction`` of the median
interval. The defaults (5 ms, 5 %, 80 % of the steps) name no rank in any window of the
balanced runs measured on a loaded 2-core machine (``benchmarks/2026-11-26-stragglers.md``;
at half of the steps, 2 of 78 windows of the main job's model named one). The phase named
is the one in which the rank spent the most time over the median rank's, in the steps it was
late; "the job lost X %" is its average lateness over the median interval.

A rank that is slow only now and then (a *stall*: garbage collection, a checkpoint one rank
writes, an evaluation on rank 0) is late in too few steps to be named so, whatever it costs.
So every rank's cost is added up too: its lateness summed over the steps it was late in (by
more than the threshold), as a share of the window's time (the sum of its steps' median
intervals), which is the share of the window the others spent waiting for it. A rank not
named above is reported as a stall if, counting only the steps in which it was late by at
least ``min_stall_ms`` (40 ms), that share is at least ``min_cost`` (20 %). The share alone
does not separate a stall from noise on short steps: in balanced runs on the loaded 2-core
machine (section 5 of the benchmark note: 344 windows) a rank that lost its core for a few
steps cost a window of the 10-25 ms steps of a small MLP up to 32 % (4 of 270 windows at 20 %
or more), but by at most 24 ms a step on average; the main job's 650 ms steps reached 9.7 %,
the tests' tiny model 10.6 %. The 40 ms is asked of each step counted, not of their mean:
noise on a loaded machine also makes the stalling rank a few ms late in other steps, and a
mean over those can fall under 40 ms and hide two 100 ms stalls (section 6 of the benchmark
note, where no balanced step made a rank 40 ms late). The stall's figures (``late_in``,
``late_ms``, ``job_lost_pct``) are of those steps only.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync.timing.phases import PHASES, RankStep

COMPUTE_PHASES = ("data", "forward", "backward", "optimizer")  # what a rank spends before arriving
_WORDS = {
    "data": "data loading (between steps)",
    "forward": "the forward",
    "backward": "the backward",
    "optimizer": "the optimizer step",
}

Window = Sequence[tuple[int, Sequence[RankStep | None]]]  # (step, every rank's record)


@dataclass(frozen=True)
class Thresholds:
    """When a rank counts as late, or as a stall; see [Note: naming a straggler]."""

    min_late_ms: float = 5.0
    min_late_fraction: float = 0.05
    min_share: float = 0.8  # of the window's steps in which it must have been late
    min_cost: float = 0.2  # of the window's time the others spent waiting for a stalling rank
    min_stall_ms: float = 40.0  # a step counts towards a stall if the rank was this late


def _late_in(records: Sequence[RankStep | None]) -> dict[int, float]:
    present = {r: rec.busy for r, rec in enumerate(records) if rec is not None}
    if len(present) < 2:
        return {}
    middle = statistics.median(present.values())
    return {r: busy - middle for r, busy in present.items()}


def _excess(records: Sequence[RankStep | None], rank: int) -> dict[str, float]:
    present = [rec for rec in records if rec is not None]
    mine = records[rank]
    assert mine is not None
    return {p: mine[p] - statistics.median(rec[p] for rec in present) for p in COMPUTE_PHASES}


def _bucket_lateness(steps: Window) -> dict[int, list[float]]:
    """Per rank, per bucket: the mean delay of its launch after the first rank's."""
    delays: dict[int, dict[int, list[float]]] = {}  # rank -> bucket -> delays
    for _, records in steps:
        present = [(r, rec) for r, rec in enumerate(records) if rec is not None]
        for b in range(min(len(rec.launches) for _, rec in present)):
            times = [(r, rec.launches[b]) for r, rec in present if rec.launches[b] > 0]
            first = min((t for _, t in times), default=0.0)
            for r, t in times if len(times) > 1 else ():
                delays.setdefault(r, {}).setdefault(b, []).append(t - first)
    return {
        r: [
            statistics.fmean(by_bucket[b]) if b in by_bucket else 0.0
            for b in range(max(by_bucket) + 1)
        ]
        for r, by_bucket in delays.items()
    }


def _rank_means(steps: Window) -> dict[int, dict[str, Any]]:
    """Per rank: its mean lateness and mean phases over ``steps``."""
    sums: dict[int, list[list[float]]] = {}  # rank -> per step [late, *phases]
    for _, records in steps:
        for r, late in _late_in(records).items():
            rec = records[r]
            assert rec is not None
            sums.setdefault(r, []).append([late, *rec.phases])
    keys = ["late_ms", *(f"{p}_ms" for p in PHASES)]
    return {
        r: dict(zip(keys, (statistics.fmean(col) for col in zip(*rows, strict=True)), strict=True))
        for r, rows in sums.items()
    }


def _late_steps(steps: Window, floor: float) -> dict[int, dict[int, float]]:
    """Per rank, the steps in which it arrived later than ``floor``: index into ``steps`` ->
    how late (in order)."""
    late_in: dict[int, dict[int, float]] = {}
    for i, (_, records) in enumerate(steps):
        for r, late in _late_in(records).items():
            if late >= floor:
                late_in.setdefault(r, {})[i] = late
    return late_in


def _phase(steps: Window, rank: int, late_in: Collection[int]) -> tuple[str, float]:
    """The phase in which ``rank`` spent the most over the median rank, on average over the
    steps ``late_in`` (indices into ``steps``), and that excess."""
    excess = dict.fromkeys(COMPUTE_PHASES, 0.0)
    for i in late_in:
        for p, v in _excess(steps[i][1], rank).items():
            excess[p] += v / len(late_in)
    phase = max(excess, key=lambda p: excess[p])
    return phase, excess[phase]


def _window_ms(steps: Window) -> float:
    """The window's time: the sum of its steps' median intervals."""
    return sum(
        statistics.median(rec.interval for rec in recs if rec is not None) for _, recs in steps
    )


def _stall(
    steps: Window, rank: int, late_in: dict[int, float], window_ms: float, thresholds: Thresholds
) -> dict[str, Any] | None:
    """``rank``'s stall over the steps of ``late_in`` (index -> how late) in which it was late
    by ``min_stall_ms`` or more, or ``None`` if those steps cost the others less than
    ``min_cost`` of ``window_ms``."""
    stalled = {i: late for i, late in late_in.items() if late >= thresholds.min_stall_ms}
    lost = sum(stalled.values())
    if not stalled or not window_ms or lost < thresholds.min_cost * window_ms:
        return None
    phase, excess = _phase(steps, rank, stalled)
    return {
        "rank": rank,
        "phase": phase,
        "late_in": len(stalled),
        "of": len(steps),
        "late_ms": lost / len(stalled),
        "phase_excess_ms": excess,
        "job_lost_pct": 100.0 * lost / window_ms,
    }


def attribute(window: Window, thresholds: Thresholds = Thresholds()) -> dict[str, Any]:
    """The report of ``window`` (the same on every rank: every rank holds every record)."""
    steps = [(s, recs) for s, recs in window if len(_late_in(recs)) >= 2]
    intervals = [rec.interval for _, recs in steps for rec in recs if rec is not None]
    step_ms = statistics.median(intervals) if intervals else 0.0
    floor = max(thresholds.min_late_ms, thresholds.min_late_fraction * step_ms)
    ranks, late_in, window_ms = _rank_means(steps), _late_steps(steps, floor), _window_ms(steps)
    for r, lateness in _bucket_lateness(steps).items():
        ranks[r]["bucket_late_ms"] = lateness
    stragglers, stalls = [], []
    for r, entry in ranks.items():
        # what the others spent waiting for it: its lateness summed over the steps it was late in
        entry["late_in"] = len(late_in.get(r, {}))
        entry["lost_ms"] = sum(late_in.get(r, {}).values(), 0.0)
        entry["lost_pct"] = 100.0 * entry["lost_ms"] / window_ms if window_ms else 0.0
        persistent = entry["late_in"] >= max(1, thresholds.min_share * len(steps))
        if persistent and entry["late_ms"] >= floor:
            phase, excess = _phase(steps, r, late_in[r])
            stragglers.append(
                {
                    "rank": r,
                    "phase": phase,
                    "late_in": entry["late_in"],
                    "of": len(steps),
                    "late_ms": entry["late_ms"],
                    "phase_excess_ms": excess,
                    "job_lost_pct": 100.0 * entry["late_ms"] / step_ms if step_ms else 0.0,
                }
            )
        elif stall := _stall(steps, r, late_in.get(r, {}), window_ms, thresholds):
            stalls.append(stall)
    stragglers.sort(key=lambda s: -s["late_ms"])
    stalls.sort(key=lambda s: -s["job_lost_pct"])
    return {
        "steps": [steps[0][0], steps[-1][0]] if steps else [],
        "num_steps": len(steps),
        "step_ms": step_ms,
        "window_ms": window_ms,
        "threshold_ms": floor,
        "stragglers": stragglers,
        "stalls": stalls,
        "ranks": ranks,
    }


def describe(report: dict[str, Any]) -> list[str]:
    """One line per straggler, then one per stall, named in ``report``."""
    return [
        f"gradsync: rank {s['rank']} arrived late in {s['late_in']} of the last {s['of']} "
        f"steps, +{s['late_ms']:.1f} ms/step, in {_WORDS[s['phase']]} (the job lost "
        f"{s['job_lost_pct']:.0f}% of its time waiting for it)"
        for s in report["stragglers"]
    ] + [
        f"gradsync: rank {s['rank']} was late in {s['late_in']} of the last {s['of']} steps by "
        f"{s['late_ms']:.1f} ms, in {_WORDS[s['phase']]}, costing the job "
        f"{s['job_lost_pct']:.0f}% of its time"
        for s in report["stalls"]
    ]


def metrics(report: dict[str, Any], prefix: str = "gradsync/") -> dict[str, float]:
    """``report`` as flat ``name -> number`` pairs, for TensorBoard's ``add_scalar`` or
    ``wandb.log``. A report of no step (the timeline off, one rank alone, no step measured
    yet) is only ``num_steps: 0``: nothing was measured, which is not "no straggler"."""
    out = {f"{prefix}num_steps": float(report["num_steps"])}
    if not report["num_steps"]:
        return out
    out |= {
        f"{prefix}step_ms": float(report["step_ms"]),
        f"{prefix}stragglers": float(len(report["stragglers"])),
        f"{prefix}stalls": float(len(report["stalls"])),
    }
    for r, entry in report["ranks"].items():
        for key, value in entry.items():
            if isinstance(value, (int, float)):
                out[f"{prefix}rank{r}/{key}"] = float(value)
    return out
