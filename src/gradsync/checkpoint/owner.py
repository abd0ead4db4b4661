"""One job per checkpoint folder: locks on ``<folder>/.gradsync-owner`` held by the job's processes.

[Note: a folder belongs to one job]
Two jobs pointed at one folder would silently undo each other: each commits ``step_N`` folders
that the other then loads as its own, rotates away, or removes at its start as a save that never
committed. So the first job to claim a folder holds it, and a second job is refused on every
rank with a ``CheckpointError`` naming the folder and the job that holds it, before it has
written or removed anything.

The claim is two kernel locks on single bytes of the lock file (open file description locks:
the kernel drops them when the process ends, however it ends, ``kill -9`` included):

- byte 1, the *members*: read-locked by every process of the owning job, for the process's
  life: rank 0 when it wins, the other ranks once rank 0 tells them (:func:`join`), a
  replacement when it joins the running job.
- byte 0, the *gate*: write-locked by a job's rank 0 only while it decides. Under the gate it
  asks for a write lock on the members byte, which the kernel grants only if no process of any
  job holds it; granted, it turns it into a read lock (a change of its own lock, atomic) and
  leaves the gate. So the check and the claim are one step for one claimant at a time, and of
  two jobs started at the same moment exactly one wins, however their starts interleave.

Why for the process's life, not the ``Checkpointer``'s: a job that drops its checkpointer (one
built per save, or none kept after the last save) is still running, and a restart of it would
resume from the folder; a job started in that gap took the folder and replaced its steps.
Why every process and not rank 0 alone: when rank 0 is lost and the others go on
(``gradsync.recovery``), the survivors still hold the folder, so a job started before the
regroup is refused instead of taking it from under them. Why kernel locks and not a lease with
a heartbeat: a job that ended, however it ended, leaves nothing to wait out, so a restarted job
(torchrun ``--max-restarts``, a job resubmitted after a preemption) takes its folder back at
once, with no clock to trust. Rank 0 writes who it is into the file (job id, host, pid, since
when), which a refused job quotes. On a folder shared between nodes, Linux passes these locks
to the file system (NFSv4; Lustre mounted with ``flock``), so the check holds across nodes
where it honours them.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import time
from pathlib import Path

from gradsync.errors import CheckpointError

LOCK_NAME = ".gradsync-owner"
_GATE, _MEMBERS = 0, 1  # the bytes locked
_GATE_WAIT_S = 5.0  # another claimant holds the gate for microseconds, unless it was stopped

_held: dict[str, int] = {}  # real path of a lock file -> the descriptor holding its read lock


def job_id() -> str:
    """This job's name for the refusal: torchrun's run id, else the rendezvous address."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return run
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else "unknown"


def claim(root: Path) -> None:
    """Take ``root`` for this job (its rank 0), or raise ``CheckpointError`` naming the job
    that holds it. A process that holds it already (an earlier checkpointer) keeps it."""
    path = _path(root)
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _take_gate(fd, root)
        try:
            if not _lock(fd, fcntl.F_WRLCK, _MEMBERS):
                raise CheckpointError(_refusal(root, _read_holder(fd)))
            _lock(fd, fcntl.F_RDLCK, _MEMBERS)  # from the write lock: never refused
            me = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid()}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({**me, "since": time.time()}).encode(), 0)
        finally:
            _lock(fd, fcntl.F_UNLCK, _GATE)
    except BaseException:
        os.close(fd)  # drops whatever this descriptor held
        raise
    _held[path] = fd


def join(root: Path) -> None:
    """Hold ``root`` as one more process of the job whose rank 0 claimed it (or that this
    replacement joins), so that the claim outlives rank 0 in a job that goes on without it."""
    path = _path(root)
    if path in _held:
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    # Only a claimant that found no member holds a write lock there: never while rank 0 holds
    # its read lock, so this is granted at once.
    if not _lock(fd, fcntl.F_RDLCK, _MEMBERS):
        holder = _read_holder(fd)
        os.close(fd)
        raise CheckpointError(_refusal(root, holder))
    _held[path] = fd


def release_all() -> None:
    """Drop every claim of this process. A job's claims end with its processes; this is for a
    process that runs one job after another (a pooled test worker between cases)."""
    for fd in _held.values():
        os.close(fd)
    _held.clear()


def _path(root: Path) -> str:
    return str((root / LOCK_NAME).resolve())


def _lock(fd: int, kind: int, byte: int) -> bool:
    """Set (or with ``F_UNLCK`` drop) a lock of ``kind`` on one byte; ``False`` if another open
    file description holds a conflicting one."""
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0, as open file description locks
    # require), padded to its size on 64-bit Linux.
    arg = struct.pack("hhqqi4x", kind, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, arg)
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: held by another
        return False
    return True


def _take_gate(fd: int, root: Path) -> None:
    give_up = time.monotonic() + _GATE_WAIT_S
    while not _lock(fd, fcntl.F_WRLCK, _GATE):
        if time.monotonic() > give_up:
            raise CheckpointError(
                f"the checkpoint folder {root} is being claimed by another process "
                f"({_read_holder(fd)}), which has held the claim for over {_GATE_WAIT_S:g} s "
                "(stopped or hung?); nothing was written"
            )
        time.sleep(0.001)


def _refusal(root: Path, holder: str) -> str:
    return (
        f"the checkpoint folder {root} belongs to another running job ({holder}): two "
        "jobs writing one folder would replace and remove each other's checkpoints. Give "
        "this job a folder of its own, or stop the other job first; nothing was written"
    )


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return "a job that did not say who it is"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return (
        f"job {info.get('job', '?')}, whose rank 0 was pid {info.get('pid', '?')} on host "
        f"{info.get('host', '?')} when it claimed it at {since}"
    )
