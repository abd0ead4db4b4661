"""Each member's heartbeat in the job's store: how a rank on another host is seen gone, or stopped.

[Note: heartbeats]
A survivor sees a lost rank's process gone only on its own host (``failfast/liveness.py``). On
another host a dead rank and a slow one are both silent, and a stopped one (SIGSTOP, a
debugger) keeps its connections open, so that its peers wait in their collective for the
wrapper's whole timeout. So every member beats: a thread of its own bumps a counter of its own
in the store every ``PERIOD_S`` (one ``add``, through its own client of the store, so that no
wait of the training thread delays it). Two readers:

- While inside a step, each member also watches the next member (its rank plus one, modulo the
  world size): a counter that has not moved for ``WATCH_S`` of the watcher's own clock means
  that member is dead or stopped, and the watcher announces a regroup, which wakes every
  survivor waiting in a collective (``failfast/waiting.py``). One read per period per member:
  O(1) each, however many ranks. ``WATCH_S`` is longer than ``STALE_S``: here no collective
  has failed, and a regroup for a member that only missed beats costs every rank a roll call.
  On a 2-core machine loaded five times over, beats stood still for more than 0.3 s during a
  save (the beating thread waits for the interpreter's lock, and the process for a core), and
  a watcher at 0.3 s announced regroups with no rank lost; at 1 s one still did, while a
  replacement's two processes imported torch beside the test suite; 3 s leaves a margin.
- The roll call's leader reads the counters of the members that have not answered
  (``membership.py``): one whose counter stands still for ``STALE_S`` is gone; one whose
  counter moves is alive, and is waited for, never left out.

A member that has finished training adds ``FINISHED`` to its counter and stops beating: a
watcher still in the last step takes that counter for finished, not stopped, and no beat
reaches a store whose host has ended (global rank 0's process, often, once its training is
done).

Counts, not clock times, so that hosts' clocks need not agree: a reader judges by its own clock
how long a counter has stood still. A beat needs a moment of CPU every ``PERIOD_S``: a member
slowed by load still beats (the thread sleeps, and a sleeper is woken first), and a counter
stands still for ``STALE_S`` only when three beats in a row did not happen.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

PERIOD_S = 0.1  # between two beats
STALE_S = 0.3  # a counter that stood still this long (by the reader's clock): not beating
WATCH_S = 3.0  # as long, for a watcher to announce a regroup when no collective has failed
FINISHED = 10**12  # added to a counter when its member has finished training: not dead


class Staleness:
    """When each counter of a set was last seen to move, by this process's clock."""

    def __init__(self) -> None:
        self._seen: dict[object, tuple[bytes | int, float]] = {}

    def update(self, who: object, value: bytes | int) -> float:
        """Record ``value`` for ``who``; how long its value has stood still (0.0 if it moved,
        or was not seen before)."""
        now = time.monotonic()
        last = self._seen.get(who)
        if last is None or last[0] != value:
            self._seen[who] = (value, now)
            return 0.0
        return now - last[1]


def beat_key(scope: str, rank: int) -> str:
    return f"gradsync/recovery/{scope}/beat/{rank}"


class Heartbeat:
    """This member's beating thread, and its watch over the next member while in a step."""

    def __init__(self, store: dist.Store, period: float = PERIOD_S, stale: float = WATCH_S):
        self.period, self.stale = period, stale
        self._store = store.clone()  # type: ignore[attr-defined]  # a client of its own: the training thread's may be waiting
        self._lock = threading.Lock()
        self._own: str | None = None
        self._watched: str | None = None  # the next member's counter
        self._begun = ""  # where a regroup is announced
        self.watching = False  # set by the training loop inside a step
        self._staleness = Staleness()
        self._last_look = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gradsync-heartbeat", daemon=True)
        self._thread.start()

    def beat_as(self, scope: str, rank: int, world_size: int, begun: str) -> None:
        """Beat as ``rank`` of the generation ``scope`` names (one beat now, before returning:
        a reader finds the counter) and watch the next member; ``begun``: the key that
        announces a regroup of that generation."""
        with self._lock:
            self._own = beat_key(scope, rank)
            nxt = (rank + 1) % world_size
            self._watched = beat_key(scope, nxt) if nxt != rank else None
            self._begun, self._staleness = begun, Staleness()
            self._store.set(self._own, "1")  # a number again after ``finish``

    def finish(self) -> None:
        """Say that this member has finished training, and stop beating."""
        with self._lock:
            self.close()
            if self._own is not None:
                self._store.add(self._own, FINISHED)

    def close(self) -> None:
        """Stop beating (the thread ends within a period)."""
        self._stop.set()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._tick()
            except Exception:  # the store is gone: the training thread finds out by itself
                return

    def _tick(self) -> None:
        with self._lock:
            if self._own is None or self._stop.is_set():
                return
            self._store.add(self._own, 1)
            if not self.watching or self._watched is None:
                return
            now = time.monotonic()
            if now - self._last_look > 3 * self.period:  # not watched lately: look afresh
                self._staleness = Staleness()
            self._last_look = now
            beats = self._store.add(self._watched, 0)
            if beats >= FINISHED:  # it finished training: nothing to watch
                self._watched = None
            elif self._staleness.update(0, beats) >= self.stale:
                self._store.set(self._begun, "1")  # wakes every survivor waiting in a collective
                self._watched = None  # once: the roll call decides the rest
