"""Who is alive after a failure: the survivors of a collective name the rank that died in it.

When a rank is killed or exits while the others are inside a collective with it, every rank's
arrival record says it reached the operation, and the backend's error ("Connection closed by
peer") names a socket address, not a rank. Two sources tell the dead from the living:

- The process, on the same host. Every arrival record carries its writer's :class:`ProcessId`:
  host name and pid, plus what makes a pid comparable, the kernel's boot id and pid namespace
  (another container on the same host has its own pids) and the process's start time (a pid
  reused by a new process is not the old one). A survivor in the same pid space reads
  ``/proc/<pid>/stat``: no such process, a zombie or another start time means it died.
- A roll call through the c10d store, for ranks on other hosts. After the failure every survivor
  writes an answer key and waits a short, bounded time for the others' answers; the dead never
  answer. From another host a rank without an answer is "dead, or stuck": a stopped process, or
  one still blocked in its own wait, does not answer either.

Nothing here costs a step anything: the identity rides in the arrival record (a few more bytes
in the same store write); the rest runs after a failure only.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist


@dataclass(frozen=True)
class ProcessId:
    """One rank's process, as its peers can look it up."""

    pid: int
    start: int  # start time in clock ticks after boot (0: unknown): tells a reused pid apart
    space: str  # boot id and pid namespace: pids are comparable within one space only
    host: str

    def encode(self) -> str:
        return f"{self.pid},{self.start},{self.space},{self.host}"  # host names have no comma

    @classmethod
    def decode(cls, text: str) -> ProcessId | None:
        try:
            pid, start, space, host = text.split(",", 3)
            return cls(int(pid), int(start), space, host)
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"process {self.pid} on host {self.host}"


def _stat(pid: int) -> tuple[str, int] | None:
    """``(state, start time)`` of ``pid`` from ``/proc/<pid>/stat``; ``None``: no such process.
    The command name (field 2) may hold spaces and parentheses: fields are counted after it."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # the latter: it exited while being read
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


@functools.cache
def _this_process(pid: int) -> ProcessId:  # keyed by pid: a forked child is another process
    host = socket.gethostname()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = _stat(pid)
        space = f"{boot}/{os.readlink('/proc/self/ns/pid')}"
        return ProcessId(pid, stat[1] if stat else 0, space, host)
    except OSError:  # no /proc (not Linux): the host name is the pid space; signals tell
        return ProcessId(pid, 0, f"host:{host}", host)


def this_process() -> ProcessId:
    return _this_process(os.getpid())


def process_state(proc: ProcessId) -> str | None:
    """``"gone"`` (exited: no such process, a zombie, or its pid reused), ``"stopped"`` (by a
    signal or a debugger) or ``"running"``; ``None`` if ``proc`` is in another pid space (another
    host, another container) and cannot be seen from here."""
    me = this_process()
    if proc.space != me.space:
        return None
    if proc.space.startswith("host:"):
        return _signal_zero(proc.pid)
    stat = _stat(proc.pid)
    if stat is None:
        return _signal_zero(proc.pid)  # /proc may hide other users' processes (hidepid)
    if stat[0] in "ZXx" or (proc.start and stat[1] != proc.start):
        return "gone"
    return "stopped" if stat[0] in "Tt" else "running"


def _signal_zero(pid: int) -> str:
    """Whether ``pid`` exists, asked of the kernel with the null signal."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:  # another user's process: it exists
        pass
    return "running"


class Fate(enum.Enum):
    """What the roll call found out about one rank."""

    ANSWERED = "answered"  # alive: it answered after the failure
    GONE = "gone"  # its process has exited (seen on this host)
    STOPPED = "stopped"  # no answer; its process is stopped (seen on this host)
    RUNNING = "running"  # no answer; its process runs (seen on this host): stuck, or still waiting
    SILENT = "silent"  # no answer, and another host: dead, or stuck


def roll_call(
    store: dist.Store,
    answer: str,
    others: Mapping[int, tuple[str, ProcessId | None]],
    seconds: float,
) -> dict[int, Fate]:
    """Answer (set key ``answer``), then find out each other rank's fate: ``others`` maps a rank
    to its answer key and process. Waits at most ``seconds`` for answers, less once every rank
    has answered or is seen dead. Store errors propagate."""
    store.set(answer, "alive")
    give_up = time.monotonic() + seconds
    fates: dict[int, Fate] = {}
    pause = 0.001
    while True:
        for rank, (key, proc) in others.items():
            if rank in fates:
                continue
            if store.check([key]):  # answered first, then exited: it was alive after the failure
                fates[rank] = Fate.ANSWERED
            elif proc is not None and process_state(proc) == "gone":
                fates[rank] = Fate.GONE
        if len(fates) == len(others) or time.monotonic() >= give_up:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    for rank, (_, proc) in others.items():
        if rank not in fates:
            state = None if proc is None else process_state(proc)
            fates[rank] = Fate.SILENT if state is None else Fate(state)
    return fates


def find_dead(processes: Mapping[int, ProcessId], seconds: float) -> list[int]:
    """The ranks whose process this host sees gone, without a store to hold a roll call in:
    polled for at most ``seconds``, until one is (a process that just closed its connections
    may take a moment to exit)."""
    visible = {r: p for r, p in processes.items() if process_state(p) is not None}
    give_up = time.monotonic() + seconds
    while True:
        dead = sorted(r for r, p in visible.items() if process_state(p) == "gone")
        if dead or not visible or time.monotonic() >= give_up:
            return dead
        time.sleep(0.01)
