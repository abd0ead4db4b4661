"""How a rank waits for an operation in flight: within the deadline, in slices.

A deadline's wait is ``handle.wait(timeout)`` cut in two places, each for a reason:

- **After a moment** (``SLOW_S``): a wait that outlasts it tells the store where this rank is
  (``on_slow``: its arrival record, ``arrivals.py``). A wait that ends sooner needs no record,
  since nobody times out on it, so a step whose collectives are quick writes nothing to the
  store ([Note: records written when waiting] in ``arrivals.py``).
- **Every ``_SLICE_S`` while a regroup may begin** ([Note: waking a survivor]): a survivor
  waiting for a live peer that has left the collective to regroup looks at the store between
  slices.

Slicing needs a handle that can be waited for again after a timed-out wait, which gloo's works
and gradsync's own handles can (``is_completed`` tells whether one is done). NCCL's cannot: a
timed-out ``Work.wait`` there aborts the communicator. So a handle without ``is_completed`` is
waited for in one piece (and ``on_slow`` runs first), and the NCCL path polls a CUDA event
instead (``Deadline.wait_device``).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

SLOW_S = 0.05  # a wait longer than this publishes the waiting rank's arrival record
_SLICE_S = 0.05  # while a regroup may begin: how often a waiting rank looks for one


class RegroupWatch(Protocol):
    """What in-process recovery (``gradsync.recovery``) gives every deadline of the process."""

    def begun(self) -> bool:
        """Whether another rank has begun a regroup: stop waiting for a collective."""


# The watches of this process, newest last. Held weakly: a watch is a Recovery, which holds a
# store client and a copy of the parameters; a strong reference here kept them for the life of
# the process, and every later wait looked at that store. Gone with the last Recovery.
_watches: list[weakref.ref[RegroupWatch]] = []


def watch_for_regroups(watch: RegroupWatch) -> None:
    """Make every deadline of this process give up a wait once ``watch`` says a regroup began,
    for as long as ``watch`` lives (it is held weakly; the newest live watch is asked).

    [Note: waking a survivor]
    When a rank dies, only the ranks that exchange data with it directly see their connection
    close; a survivor waiting for a live peer that has already left the collective (to regroup)
    would wait for the deadline. With a watch, waits run in slices of ``_SLICE_S`` and look at
    the store between slices: one ``check`` per 50 ms of waiting, nothing for a collective that
    is done when it is waited for (the common case at the end of an overlapped backward). The
    failed rank's own roll call is left to the regroup's, which holds one anyway."""
    _watches.append(weakref.ref(watch, _forget))


def _forget(gone: weakref.ref[RegroupWatch]) -> None:
    """Called by the garbage collector, on whatever thread it runs, when a watch is freed."""
    _watches[:] = [ref for ref in _watches if ref is not gone]


def current_watch() -> RegroupWatch | None:
    """The watch deadlines look at now: the newest that lives, or ``None``."""
    for ref in reversed(_watches):
        watch = ref()
        if watch is not None:
            return watch
    return None


def regroup_begun() -> bool:
    """Whether a regroup has begun that this process should stop waiting for peers for."""
    watch = current_watch()
    return watch is not None and watch.begun()


def watching() -> bool:
    return current_watch() is not None


def wait_watching(
    handle: Any, watch: RegroupWatch, timeout: timedelta, start: float | None = None
) -> None:
    """``handle.wait()`` within ``timeout`` (counted from ``start``, ``time.monotonic()``), in
    slices, giving up with ``RuntimeError`` once ``watch`` says a regroup began ([Note: waking a
    survivor])."""
    wait_in_slices(handle, timeout, time.monotonic() if start is None else start, watch=watch)


def wait_in_slices(
    handle: Any,
    timeout: timedelta,
    start: float,
    *,
    watch: RegroupWatch | None = None,
    on_slow: Callable[[], None] | None = None,
) -> None:
    """``handle.wait()`` within ``timeout`` (counted from ``start``, ``time.monotonic()``):
    ``on_slow()`` once the wait has lasted ``SLOW_S``, and with a ``watch`` a look for a regroup
    every ``_SLICE_S``. Raises ``RuntimeError`` on the deadline, on the handle's own error, or
    once ``watch`` says a regroup began."""
    limit = timeout.total_seconds()
    if not hasattr(handle, "is_completed"):  # cannot be waited for again: in one piece
        if on_slow is not None:
            on_slow()
        handle.wait(timeout=timedelta(seconds=max(limit - (time.monotonic() - start), 0.001)))
        return
    while True:
        left = limit - (time.monotonic() - start)
        piece = SLOW_S if on_slow is not None else _SLICE_S if watch is not None else left
        piece = max(min(piece, left), 0.001)
        try:
            handle.wait(timeout=timedelta(seconds=piece))
            return
        except RuntimeError:
            if handle.is_completed():  # done since the slice ran out, or its own error:
                handle.wait()  # returns, or raises that error (not the slice's timeout)
                return
            if left <= piece:  # the deadline
                raise
        if on_slow is not None:
            on_slow()
            on_slow = None
        if watch is not None and watch.begun():
            raise RuntimeError("another rank began to regroup after losing a peer")
