"""A wrapper's step timeline: every rank's phases, step after step, and who made the others wait.

The :class:`PhaseRecorder` marks this rank's phases; the first bucket carries each rank's
record of the interval before the step (``slots.py``); after the step's readout every rank
holds every rank's record, kept here for the last ``keep`` steps. Every ``every`` steps the
last window is judged (``attribution.py``) and, if a rank made the others wait in most steps
(a straggler) or cost them a large share of the window in a few (a stall), rank 0 says so
through :mod:`logging` (logger ``gradsync.stragglers``, level WARNING; a report that names
nobody goes out at INFO). ``report()`` and ``metrics()`` give the same figures as plain data.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.timing.attribution import Thresholds, attribute, describe, metrics
from gradsync.timing.clock import clock_for
from gradsync.timing.phases import PhaseRecorder, RankStep
from gradsync.timing.slots import RIDER, decode, encode, fields_per_rank

logger = logging.getLogger("gradsync.stragglers")


class _NoRecorder:
    """The recorder of a timeline that is off: every mark is a no-op."""

    def __getattr__(self, name: str) -> Any:
        return _nothing


def _nothing(*args: Any) -> None:
    return None


class TimingsRider:
    """Every rank's phases of the last interval, riding in bucket 0's tail (``slots.py``)."""

    name = RIDER

    def __init__(self, timeline: StepTimeline, num_buckets: int) -> None:
        self.timeline, self.num_buckets = timeline, num_buckets
        self.width = timeline.width(num_buckets)

    def encode(self, step: object) -> list[float] | None:
        return self.timeline.outgoing(self.num_buckets)  # the last interval, if any

    def decode(self, values: list[float], world_size: int) -> list[float]:
        return values  # decoded by StepTimeline.received, which keeps the records


class StepTimeline:
    """Every rank's step phases and the straggler reports of one wrapper (``model.timeline``).

    ``every``: steps per report (``straggler_every`` of the wrapper); ``0`` turns measuring,
    carrying and reporting off. ``thresholds`` may be replaced (the same on every rank).
    """

    def __init__(
        self, every: int, rank: int, world_size: int, device: torch.device, keep: int = 100
    ) -> None:
        self.every, self.rank, self.world_size = every, rank, world_size
        self.enabled = every > 0
        self.recorder: Any = PhaseRecorder(clock_for(device)) if self.enabled else _NoRecorder()
        self.history: deque[tuple[int, list[RankStep | None]]] = deque(maxlen=max(keep, every))
        self.thresholds = Thresholds()
        self.last_report: dict[str, Any] | None = None
        self._outgoing: RankStep | None = None  # this rank's last interval, sent next step
        self._outgoing_late = 0  # steps it ended before the last one (phases.py: one rank)

    @classmethod
    def of(cls, every: int, deadline: Any) -> StepTimeline:
        """The timeline of a wrapper whose collectives run under ``deadline`` (its rank, world
        size and the replica's device)."""
        return cls(every, deadline.rank, deadline.world_size, deadline.device)

    def width(self, num_buckets: int) -> int:
        """Values per rank this timeline sends in bucket 0's tail (``0``: off)."""
        return fields_per_rank(num_buckets) if self.enabled else 0

    def riders(self, num_buckets: int) -> list[TimingsRider]:
        """What this timeline sends in bucket 0's tail (``ddp/tail.py``): none when off."""
        return [TimingsRider(self, num_buckets)] if self.enabled else []

    def outgoing(self, num_buckets: int) -> list[float] | None:
        """Before the step's first bucket launches: this rank's last interval, encoded for its
        slots, or ``None`` when there is none to send (off, or no interval measured yet)."""
        if self._outgoing is None:
            return None
        return encode(self._outgoing, num_buckets)

    def received(self, values: Sequence[float], step: int) -> None:
        """After step ``step``'s readout: ``values`` holds every rank's record of the interval
        that ended with step ``step - 1`` (one rank on a GPU: or ``step - 2``, see [Note:
        reading a GPU interval late] in ``phases.py``)."""
        if not self.enabled:
            return
        late = self._outgoing_late  # of the records in ``values``: 0 with two ranks or more
        self._outgoing = self.recorder.resolve()
        self._outgoing_late = self.recorder.late
        records = decode(values, self.world_size)
        if any(rec is not None for rec in records):
            self.history.append((step - 1 - late, records))
        if (step + 1) % self.every == 0 and self.history:
            self.last_report = self.report()
            self._log(self.last_report)

    def report(self, last: int | None = None) -> dict[str, Any]:
        """The straggler report of the last ``last`` steps (default: ``every``) as plain data:
        ``stragglers`` (rank, phase, late_in, of, late_ms, job_lost_pct), ``stalls`` (the
        same keys, of the steps it stalled in), ``step_ms``, ``window_ms``, ``threshold_ms``
        and, per rank, its mean phases and lateness, what the others lost waiting for it
        (``ranks``: late_in, lost_ms, lost_pct) and the noise its stalls are judged against,
        measured over the whole kept history (noise_ms)."""
        history = list(self.history)
        window = history[-(last or self.every or len(history)) :]
        return attribute(window, self.thresholds, reference=history)

    def metrics(self, prefix: str = "gradsync/") -> dict[str, float]:
        """The last report as flat ``name -> number`` pairs, for any metrics logger; only
        ``num_steps: 0`` while nothing was measured (``every=0``, one rank, no step yet)."""
        return metrics(self.last_report or self.report(), prefix)

    def _log(self, report: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        lines = describe(report)
        for line in lines:
            logger.warning(line)
        if not lines and report["steps"]:
            first, last = report["steps"]
            lost = max((entry["lost_pct"] for entry in report["ranks"].values()), default=0.0)
            logger.info(
                "gradsync: no straggler in steps %d-%d (median step %.1f ms, threshold %.1f ms; "
                "the most the job lost waiting for one rank: %.0f%% of its time)",
                first,
                last,
                report["step_ms"],
                report["threshold_ms"],
                lost,
            )
