"""Ending a launched process and everything it started, as a power loss or a hard timeout would.

torchrun starts its workers in sessions of their own (``start_new_session=True``), so signalling
the launcher's process group misses them; they are found by walking the process tree through
``/proc`` parent links instead. :class:`~gradsync.testing.cluster.SimulatedCluster` ends its
nodes with these, and :class:`~gradsync.testing.netns.SimulatedNetwork` the processes left in
its namespaces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence


def children_of(pids: set[int]) -> set[int]:
    """All live descendants of ``pids``, found through ``/proc`` parent links."""
    parent_of: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # Field 4 (ppid) follows the parenthesised command name, which may contain spaces.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1:
            parent_of[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = set(pids)
    while frontier:
        frontier = {c for c, p in parent_of.items() if p in frontier and c not in found}
        found |= frontier
    return found


def kill_pids(pids: set[int], sig: signal.Signals) -> None:
    """Send ``sig`` to each of ``pids``, skipping those already gone."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def killpg(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid``, unless it is gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``, the leader of its own process group, with the group and all its
    descendants; then reap it."""
    tree = children_of({proc.pid})
    killpg(proc.pid, signal.SIGKILL)
    kill_pids(tree, signal.SIGKILL)
    proc.wait()


def terminate(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM each process group leader's group, then SIGKILL group and descendants after
    ``grace_s``; then reap them."""
    tree = children_of({p.pid for p in procs})
    for p in procs:
        killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.02)
    tree |= children_of({p.pid for p in procs} | tree)
    for p in procs:
        killpg(p.pid, signal.SIGKILL)
    kill_pids(tree, signal.SIGKILL)
    for p in procs:
        p.wait()
