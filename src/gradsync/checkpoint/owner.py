"""One job per checkpoint folder: a lock that rank 0 holds while a ``Checkpointer`` lives.

[Note: a folder belongs to one job]
Two jobs pointed at one folder would silently undo each other: each commits ``step_N`` folders
that the other then loads as its own, rotates away, or removes at its start as a save that never
committed. So rank 0 of a job takes an exclusive ``flock`` on ``<folder>/.gradsync-owner`` and
holds it as long as one of its checkpointers lives; a second job's rank 0 cannot take it, and
every rank of that job raises ``CheckpointError`` naming the folder and the job that holds it,
before it has written or removed anything.

Why a kernel lock and not a lease file with a heartbeat: the kernel drops the lock when the
holding process ends, however it ends (``kill -9`` included), so a restarted job (torchrun
``--max-restarts``, a resubmitted job after a preemption) takes its folder back at once, with no
stale lease to wait out and no clock to trust. The holder writes who it is into the file (job
id, host, pid, since when), which a refused job quotes; the file outlives the lock and is simply
overwritten by the next holder. On a folder shared between nodes, Linux maps ``flock`` to the
file system's byte-range locks (NFSv4, Lustre with ``flock`` mounts), so the check holds across
nodes where those locks are honoured.

Within one process the lock is counted, not taken twice: a job may build another checkpointer
of its own folder (after a failure, or to load in a fresh one) while the first still lives.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from gradsync.errors import CheckpointError

LOCK_NAME = ".gradsync-owner"

_held: dict[str, tuple[int, int]] = {}  # real path of a held lock file -> (fd, holders)


def job_id() -> str:
    """This job's name for the refusal: torchrun's run id, else the rendezvous address."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run:
        return run
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else "unknown"


def claim(root: Path) -> str:
    """Take (or count another holder of) the lock on ``root``; return the lock file's path.
    Raise ``CheckpointError`` naming the job that holds it if another process does."""
    path = str((root / LOCK_NAME).resolve())
    if path in _held:
        fd, holders = _held[path]
        _held[path] = (fd, holders + 1)
        return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise CheckpointError(
            f"the checkpoint folder {root} belongs to another running job ({holder}): two "
            "jobs writing one folder would replace and remove each other's checkpoints. Give "
            "this job a folder of its own, or stop the other job first; nothing was written"
        ) from None
    me = {"job": job_id(), "host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held[path] = (fd, 1)
    return path


def release(path: str) -> None:
    """One holder fewer; the last one unlocks (closing the file drops the lock)."""
    fd, holders = _held.pop(path, (-1, 0))
    if holders > 1:
        _held[path] = (fd, holders - 1)
    elif fd >= 0:
        os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        return "a job that did not say who it is"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return (
        f"job {info.get('job', '?')}, rank 0 is pid {info.get('pid', '?')} on host "
        f"{info.get('host', '?')}, holding it since {since}"
    )
