"""What torchrun restarts (``--max-restarts``) need from torch 2.13, checked before it matters.

By default torchrun shares its rendezvous store with the workers
(``TORCHELASTIC_USE_AGENT_STORE=True``) and keeps it across restarts. Process groups created
with ``new_group`` (gradsync's private group, the checkpointer's) publish their addresses under
names that repeat from one attempt to the next, so after a restart a rank can read the address
of a worker of the previous attempt and fail, after a timeout, with a gloo "connectFullMesh ...
Connection refused" that names nothing (pytorch issue #135712 describes the shared store; the
default group is not affected). Starting torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
gives every attempt a store of its own.
"""

from __future__ import annotations

import os
import warnings

from gradsync.errors import UsageError

FIX = "start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment"
_warned = False


def check_restartable() -> None:
    """Raise on a restarted attempt that cannot create process groups; warn on the first
    attempt of a job whose restarts would fail that way."""
    global _warned
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        raise UsageError(
            "torchrun restarted this job but shares one rendezvous store across attempts, so "
            "new process groups would connect to workers of the previous attempt and fail; "
            f"{FIX}"
        )
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and not _warned:
        _warned = True
        warnings.warn(
            f"gradsync: torchrun --max-restarts is set, but a restart would fail to create "
            f"gradsync's process groups (torch shares the rendezvous store across attempts); "
            f"{FIX}",
            stacklevel=3,
        )


def joining() -> str | None:
    """The store of the running job this process is to join as a replacement
    (``GRADSYNC_JOIN=host:port``, see ``gradsync.recovery``), if it is one."""
    return os.environ.get("GRADSYNC_JOIN") or None
