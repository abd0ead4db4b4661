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
A stall is named by what it costs the job, against the job's own noise, both measured:

- the *noise* a rank is judged against is how far the other ranks strayed in the steps it was
  not late in: per such step, the largest lateness or earliness of any other rank, and of
  those, the ``noise_quantile`` (95 %) over the kept history (``reference``: the timeline's
  last 100 steps; the window itself when none is given). Its own steps are left out, so a
  rank's stalls do not raise its own bar; with two ranks the other rank's lateness is the
  noise;
- a step counts towards a stall if the rank was late in it by ``stall_over_noise`` (2.5) times
  that noise, and by ``min_late_fraction`` of the median interval (5 %, so that a job with no
  measurable noise does not count rounding);
- the rank is named if it was so late at least ``min_stall_steps`` (2) times in the window
  (adjacent steps count once: one pause can straddle the end of a step), those steps cost
  the window at least ``min_cost`` (15 %) of its time (their lateness summed, as a share of
  the window's time, the sum of its steps' median intervals: the share of the window the
  others spent waiting for it), and the stall recurs: the rank was late by the same bar at
  least once in the window's length of history before it. A periodic stall always does; the
  job's first window, with nothing before it, never does.

Every bar is a ratio, so a job of 2 ms steps and one of 2 s steps get the same verdict for the
same shape of stall. Why twice, and why again: on an oversubscribed machine the scheduler takes
any rank's core for a step or two now and then, for up to a second (measured:
``docs/stragglers.md``), which in that window is a stall by every measure; the same rank
stalling twice apart in one window beyond the other ranks' noise was rare in the balanced runs
measured there, and doing so again in the steps before that window rarer still (none there).
The stall's figures (``late_in``, ``late_ms``, ``job_lost_pct``) are of the steps counted, and
every rank's noise is in ``ranks`` (``noise_ms``).
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
Lateness = dict[int, dict[int, float]]  # step -> rank -> how late it arrived (computed once)


@dataclass(frozen=True)
class Thresholds:
    """When a rank counts as late, or as a stall; see [Note: naming a straggler]."""

    min_late_ms: float = 5.0
    min_late_fraction: float = 0.05
    min_share: float = 0.8  # of the window's steps in which it must have been late
    min_cost: float = 0.15  # of the window's time the others spent waiting for a stalling rank
    stall_over_noise: float = 2.5  # a step counts towards a stall if this many times the noise
    noise_quantile: float = 0.95  # of the other ranks' per-step spread over the history
    min_stall_steps: int = 2  # times it must have stalled in the window (adjacent steps: once)


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


def _rank_means(steps: Window, lateness: Lateness) -> dict[int, dict[str, Any]]:
    """Per rank: its mean lateness and mean phases over ``steps``."""
    sums: dict[int, list[list[float]]] = {}  # rank -> per step [late, *phases]
    for s, records in steps:
        for r, late in lateness[s].items():
            rec = records[r]
            assert rec is not None
            sums.setdefault(r, []).append([late, *rec.phases])
    keys = ["late_ms", *(f"{p}_ms" for p in PHASES)]
    return {
        r: dict(zip(keys, (statistics.fmean(col) for col in zip(*rows, strict=True)), strict=True))
        for r, rows in sums.items()
    }


def _late_steps(steps: Window, floor: float, lateness: Lateness) -> dict[int, dict[int, float]]:
    """Per rank, the steps in which it arrived later than ``floor``: index into ``steps`` ->
    how late (in order)."""
    late_in: dict[int, dict[int, float]] = {}
    for i, (s, _) in enumerate(steps):
        for r, late in lateness[s].items():
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


def _noise(reference: Window, lateness: Lateness, quantile: float) -> dict[int, float]:
    """Per rank, the noise it is judged against (see [Note: naming a straggler]): of the steps
    of ``reference`` in which it was not late, the ``quantile`` of the largest lateness or
    earliness of any other rank in each."""
    spreads: dict[int, list[float]] = {}
    for s, _ in reference:
        late = lateness[s]
        top = sorted(((abs(v), r) for r, v in late.items()), reverse=True)[:2]
        for r, mine in late.items():
            if mine <= 0.0:  # another rank's value: the largest unless that is this rank's
                spreads.setdefault(r, []).append(top[1][0] if top[0][1] == r else top[0][0])
    out = {}
    for r, values in spreads.items():
        values.sort()
        out[r] = values[min(len(values) - 1, int(quantile * len(values)))]
    return out


def _stall(
    steps: Window,
    lateness: Sequence[dict[int, float]],
    rank: int,
    bar: float,
    window_ms: float,
    thresholds: Thresholds,
    before: Sequence[dict[int, float]] | None,
) -> dict[str, Any] | None:
    """``rank``'s stall: the steps in which it was late by ``bar`` or more (``lateness``: every
    rank's, per step), if they are at least ``min_stall_steps`` apart (not adjacent), cost the
    others ``min_cost`` of ``window_ms``, and recur: ``rank`` was late by ``bar`` in one of the
    steps ``before`` the window too (``None``: the window is judged alone); else ``None``."""
    mine = (late.get(rank, 0.0) for late in lateness)
    stalled = {i: late for i, late in enumerate(mine) if late >= bar}
    lost = sum(stalled.values())
    apart = sum(i - 1 not in stalled for i in stalled)  # adjacent steps: one incident
    if (
        not window_ms
        or apart < thresholds.min_stall_steps
        or lost < thresholds.min_cost * window_ms
        or (before is not None and not any(late.get(rank, 0.0) >= bar for late in before))
    ):
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


def _straggler(
    steps: Window, rank: int, entry: dict[str, Any], late_in: Collection[int], step_ms: float
) -> dict[str, Any]:
    phase, excess = _phase(steps, rank, late_in)
    return {
        "rank": rank,
        "phase": phase,
        "late_in": entry["late_in"],
        "of": len(steps),
        "late_ms": entry["late_ms"],
        "phase_excess_ms": excess,
        "job_lost_pct": 100.0 * entry["late_ms"] / step_ms if step_ms else 0.0,
    }


def _just_before(history: Window, lateness: Lateness, steps: Window) -> list[dict[int, float]]:
    """Every rank's lateness in the window's length of ``history`` just before the window's
    first step: where a stall must have been seen already to recur."""
    if not steps:
        return []
    earlier = [lateness[s] for s, _ in history if s < steps[0][0]]
    return earlier[-len(steps) :]


def attribute(
    window: Window, thresholds: Thresholds = Thresholds(), reference: Window | None = None
) -> dict[str, Any]:
    """The report of ``window`` (the same on every rank: every rank holds every record);
    ``reference``: the kept history, ``window`` included, that the job's noise is measured over
    and in which a stall must recur (default: ``window``, judged alone)."""
    history = list(window if reference is None else reference)
    lateness: Lateness = {s: _late_in(recs) for s, recs in history}
    lateness |= {s: _late_in(recs) for s, recs in window if s not in lateness}
    steps = [(s, recs) for s, recs in window if len(lateness[s]) >= 2]
    intervals = [rec.interval for _, recs in steps for rec in recs if rec is not None]
    step_ms = statistics.median(intervals) if intervals else 0.0
    fraction = thresholds.min_late_fraction
    floor = max(thresholds.min_late_ms, fraction * step_ms)
    ranks, window_ms = _rank_means(steps, lateness), _window_ms(steps)
    late_in = _late_steps(steps, floor, lateness)
    for r, bucket_late in _bucket_lateness(steps).items():
        ranks[r]["bucket_late_ms"] = bucket_late
    noise = _noise(history, lateness, thresholds.noise_quantile)
    per_step = [lateness[s] for s, _ in steps]
    before = None if reference is None else _just_before(history, lateness, steps)
    stragglers, stalls = [], []
    for r, entry in ranks.items():
        # what the others spent waiting for it: its lateness summed over the steps it was late in
        entry["late_in"] = len(late_in.get(r, {}))
        entry["lost_ms"] = sum(late_in.get(r, {}).values(), 0.0)
        entry["lost_pct"] = 100.0 * entry["lost_ms"] / window_ms if window_ms else 0.0
        entry["noise_ms"] = noise.get(r, 0.0)
        bar = max(thresholds.stall_over_noise * entry["noise_ms"], fraction * step_ms)
        persistent = entry["late_in"] >= max(1, thresholds.min_share * len(steps))
        if persistent and entry["late_ms"] >= floor:
            stragglers.append(_straggler(steps, r, entry, late_in[r], step_ms))
        elif bar > 0.0 and (
            stall := _stall(steps, per_step, r, bar, window_ms, thresholds, before)
        ):
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
