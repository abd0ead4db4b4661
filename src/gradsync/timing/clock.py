"""Where a rank's phase boundaries are read from: the host's clock, or the GPU's.

A phase of a CPU step is host time between two marks. On CUDA the host only queues work and
runs ahead of the GPU, so host time would charge a slow GPU's forward to whatever the host
waits at next (the step's readout). There a mark is a CUDA event recorded on the current
stream, and a duration is read with ``Event.elapsed_time`` once the GPU has passed both marks:
after the step's readout, which waits for the GPU anyway (one rank reads nothing: there an
interval is read a step late, see ``phases.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class HostClock:
    """Marks are ``time.perf_counter()`` readings; a mark costs well under a microsecond."""

    def mark(self) -> Any:
        return time.perf_counter()

    def release(self, marks: list[Any]) -> None:
        """Marks read for the last time: nothing to keep."""

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return (end - start) * 1e3

    def reached(self, mark: Any) -> bool:
        return True


class DeviceClock:
    """Marks are CUDA events on the current stream of ``device`` (timing enabled, no sync).

    Events are kept and recorded again: creating one costs the host about 12 us the first
    time it is recorded, and a step takes about ten marks. An event goes back to the pool once
    its interval was read (:meth:`release`): the GPU has passed it, so recording it again
    cannot change what was read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: list[Any] = []  # events the GPU has passed and nobody reads any more

    def mark(self) -> Any:
        event = self.free.pop() if self.free else torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, marks: list[Any]) -> None:
        """``marks`` were read for the last time, after the GPU passed them: record them again
        for later marks."""
        self.free.extend(marks)

    def elapsed_ms(self, start: Any, end: Any) -> float:
        # elapsed_time raises on an event the GPU has not reached: wait for it then. The
        # recorder asks only for ends that are reached or a step old ([Note: reading a GPU
        # interval late] in phases.py), so the wait idles nothing.
        if not end.query():
            end.synchronize()
        return float(start.elapsed_time(end))

    def reached(self, mark: Any) -> bool:
        """Whether the GPU has passed ``mark`` (no wait)."""
        return bool(mark.query())


def clock_for(device: torch.device) -> HostClock | DeviceClock:
    """The GPU's clock for a replica on CUDA, else the host's."""
    return DeviceClock(device) if device.type == "cuda" else HostClock()
