"""One rank's time between two synchronised steps, cut into the phases a person can act on.

[Note: step phases]
Every rank leaves a step's last collective at about the same moment: a collective ends when its
last rank arrives. So the end of each synchronised step is a clock that all ranks share without
exchanging a single timestamp, and the time from one step's end to the next (the *interval*) is
about the same on every rank. Each rank cuts its interval into:

- ``optimizer``: inside any ``torch.optim.Optimizer.step`` (torch's global step hooks), the
  outermost call only (a sharded or fp32-master optimizer steps an inner one), less the
  forwards and backwards a closure runs inside it (Lightning's automatic optimization);
- ``forward``: inside the wrapper's training forwards;
- ``backward``: from the end of each training forward to the end of its backward's
  computation (the loss is computed in between; it is the backward's input);
- ``exposed_comm``: from the end of the synchronising backward's computation to the end of the
  step's collectives: communication that backward did not hide, including waiting for others;
- ``data``: the rest: loading the next batch, and anything else the loop does between steps.

Phases tile the interval, so the rank whose ``exposed_comm`` is smallest is the one the others
waited for, and the phase in which it spent more than the others is where its time went. Each
bucket's launch is marked too, as an offset from the interval's start, comparable across ranks
for the same reason.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from gradsync.lifetime import HeldHooks
from gradsync.timing.clock import DeviceClock, HostClock

PHASES = ("data", "forward", "backward", "optimizer", "exposed_comm")
_COMPUTED = tuple(p for p in PHASES if p != "data")  # "data" is what is left
_WAITING = ":waiting"  # a span of waiting inside the phase it is named after (waited())


@dataclass(frozen=True)
class RankStep:
    """One rank's interval: milliseconds per phase (in ``PHASES`` order) and each bucket's
    launch as milliseconds from the interval's start (0: not known)."""

    phases: tuple[float, ...]
    launches: tuple[float, ...] = ()

    @property
    def interval(self) -> float:
        return sum(self.phases)

    def __getitem__(self, phase: str) -> float:
        return self.phases[PHASES.index(phase)]

    @property
    def busy(self) -> float:
        """Time until this rank arrived at the step's last collective."""
        return self.interval - self["exposed_comm"]


class PhaseRecorder:
    """Marks phase boundaries on this rank and turns a finished interval into a
    :class:`RankStep` (see [Note: step phases]). The wrapper and its reducer call the marks; the
    marks hold clock readings (CUDA events on a GPU) until :meth:`resolve`."""

    def __init__(self, clock: HostClock | DeviceClock) -> None:
        self.clock = clock
        self._start: Any = None  # the end of the last synchronised step (None: none yet)
        # Intervals closed and not yet resolved, oldest first: at most the last two (see
        # resolve); each is (start, spans, launches, end).
        self._closed: list[tuple[Any, list[tuple[str, Any, Any]], dict[int, Any], Any]] = []
        self.late = 0  # intervals closed after the one that resolve() returned last
        self._spans: list[tuple[str, Any, Any]] = []  # (phase, begin, end)
        self._launches: dict[int, Any] = {}
        self._forward_began: Any = None
        self._forward_ended: Any = None  # its backward's start
        self._last_exposed_began: Any = None
        self._optimizer_began: Any = None
        self._optimizer = 0  # id() of the optimizer whose step is being timed (the outermost)
        self._optimizer_depth = 0  # its step's calls in progress (a subclass calls super().step)
        self._optimizer_since = 0  # the interval in which that step began
        self._intervals = 0  # synchronised steps seen
        _listen(self)

    def forward_began(self) -> None:
        self._forward_began = self.clock.mark()
        self._forward_ended = None

    def forward_ended(self) -> None:
        if self._forward_began is not None:
            self._forward_ended = self.clock.mark()
            self._spans.append(("forward", self._forward_began, self._forward_ended))
            self._forward_began = None

    def backward_began(self) -> None:
        """A backward that does not reduce (under ``no_sync``) began: its end is marked by an
        autograd callback (a reducing one's end is the reducer's own end-of-backward)."""
        torch.autograd.Variable._execution_engine.queue_callback(self.backward_ended)

    def backward_ended(self) -> None:
        """The end of a backward's computation (its end-of-backward callback)."""
        if self._forward_ended is not None:
            end = self._last_exposed_began = self.clock.mark()
            self._spans.append(("backward", self._forward_ended, end))
            self._forward_ended = None

    def waited(self, phase: str, begin: Any, end: Any) -> None:
        """From mark ``begin`` to ``end``, inside ``phase``, this rank waited for others (FSDP2's
        all-gathers in forward, see [Note: FSDP2's waits] in ``fsdp/timeline.py``): counted as
        ``exposed_comm``, not as ``phase``."""
        self._spans.append((phase + _WAITING, begin, end))

    def launched(self, bucket: int) -> None:
        self._launches[bucket] = self.clock.mark()

    def optimizer_began(self, optimizer: object) -> None:
        # A step begun two intervals ago never ended: it raised (its post hook never ran).
        if self._optimizer_began is not None and self._intervals - self._optimizer_since > 1:
            self._optimizer_began = None
        if self._optimizer_began is None:  # the outermost step
            self._optimizer_began, self._optimizer = self.clock.mark(), id(optimizer)
            self._optimizer_since, self._optimizer_depth = self._intervals, 0
        if id(optimizer) == self._optimizer:  # also its own super().step() inside it
            self._optimizer_depth += 1

    def optimizer_ended(self, optimizer: object) -> None:
        if self._optimizer_began is None or id(optimizer) != self._optimizer:
            return
        self._optimizer_depth -= 1
        if self._optimizer_depth == 0:
            self._spans.append(("optimizer", self._optimizer_began, self.clock.mark()))
            self._optimizer_began = None

    def synced(self) -> None:
        """The step's collectives are done (on CUDA: the stream has waited for them): the
        interval ends here and the next begins. Resolved by :meth:`resolve` after the readout."""
        now = self.clock.mark()
        self._intervals += 1
        if self._start is not None and self._last_exposed_began is not None:
            self._spans.append(("exposed_comm", self._last_exposed_began, now))
            self._closed = [*self._closed[-1:], (self._start, self._spans, self._launches, now)]
        self._start, self._spans, self._launches = now, [], {}
        self._last_exposed_began = self._forward_began = self._forward_ended = None

    def abandon(self) -> None:
        """A step that raised: its interval is not measured (the next one starts at its end)."""
        self._closed = []
        self._start = None

    def resolve(self) -> RankStep | None:
        """The interval closed by the last :meth:`synced`, once, or the one before it, one step
        late (``late`` says which); ``None``: there is none yet (before the first synchronised
        step, or the GPU has not reached the end of the first one).

        [Note: reading a GPU interval late]
        On CUDA an interval's end is an event recorded when the step's collectives were done.
        With two ranks or more the step's readout has waited for the GPU to pass it. One rank
        reads nothing from the device, so the GPU is usually still working through the
        backward when the host gets here; waiting for the event then would empty the GPU's
        queue every step (the host would queue the optimizer's kernels only once the GPU had
        run dry). So the newest interval is read only once the GPU has reached its end;
        otherwise the one before it is read (its end is a whole step old, with that step's
        work queued behind it, so waiting for it idles nothing) and the newest waits.
        """
        self.late = 0
        if not self._closed:
            return None
        if self.clock.reached(self._closed[-1][3]):
            entry, self._closed = self._closed[-1], []
        elif len(self._closed) > 1:
            entry, self._closed, self.late = self._closed[0], self._closed[1:], 1
        else:
            return None
        start, spans, launches, end = entry
        record = self._record(start, spans, launches, end)
        # Every mark of the interval but its end, which is the next interval's start, is read
        # for the last time (one object may end a phase and begin the next: counted once).
        done = {id(m): m for _, b, e in spans for m in (b, e)} | {id(start): start}
        done |= {id(m): m for m in launches.values()}
        done.pop(id(end), None)
        self.clock.release(list(done.values()))
        return record

    def _record(
        self, start: Any, spans: list[tuple[str, Any, Any]], launches: dict[int, Any], end: Any
    ) -> RankStep:
        """The interval from ``start`` to ``end`` as phase durations and launch times (ms)."""
        offset = self.clock.elapsed_ms
        total = offset(start, end)
        # Milliseconds from the start; a step whose closure synchronised began before it.
        at = [(phase, max(0.0, offset(start, b)), offset(start, e)) for phase, b, e in spans]
        others = [(b, e) for p, b, e in at if p != "optimizer" and not p.endswith(_WAITING)]
        sums = dict.fromkeys(PHASES, 0.0)
        waiting = dict.fromkeys(PHASES, 0.0)
        for phase, begin, end in at:
            if phase.endswith(_WAITING):
                waiting[phase.removesuffix(_WAITING)] += max(0.0, end - begin)
                continue
            inside = 0.0  # forwards and backwards that ran inside an optimizer step (a closure)
            if phase == "optimizer":
                inside = sum(max(0.0, min(end, e) - max(begin, b)) for b, e in others)
            sums[phase] += max(0.0, end - begin - inside)
        for phase, ms in waiting.items():  # waiting for others is exposed communication
            moved = min(ms, sums[phase])
            sums[phase] -= moved
            sums["exposed_comm"] += moved
        sums["data"] = max(0.0, total - sum(sums[p] for p in _COMPUTED))
        order = sorted(launches)
        times = tuple(
            offset(start, launches[b]) if b in launches else 0.0
            for b in range(order[-1] + 1 if order else 0)
        )
        return RankStep(tuple(sums[p] for p in PHASES), times)


# The optimizer's step is timed with torch's global step hooks, installed with the first live
# recorder and removed with the last, which tell every live recorder (a process usually has one
# wrapper). A step that raises never reaches the post hook: the same optimizer's next step
# starts over.
_live: weakref.WeakSet[PhaseRecorder] = weakref.WeakSet()
_HOOKS = HeldHooks(
    lambda: [
        register_optimizer_step_pre_hook(_pre_step),
        register_optimizer_step_post_hook(_post_step),
    ]
)


def _listen(recorder: PhaseRecorder) -> None:
    _live.add(recorder)
    _HOOKS.hold(recorder)


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for recorder in list(_live):
        recorder.optimizer_began(optimizer)


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for recorder in list(_live):
        recorder.optimizer_ended(optimizer)
