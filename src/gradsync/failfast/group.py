"""gradsync's own process group: the user's ranks, with gradsync's deadline as its timeout.

Every collective of a wrapper runs on a private group built here, for two reasons:

- A collective that outlives gradsync's deadline must end inside the backend too, or it stays
  in flight and blocks interpreter exit and ``destroy_process_group`` until the group's own
  timeout (torch's default: 30 minutes). Created with ``timeout=`` gradsync's deadline, the
  group's gloo/NCCL operations give up when gradsync does, so the process can end.
- A collective the training loop issues on its own group (a logging ``all_reduce`` on some
  ranks only) can never be matched with one of gradsync's: the waiting rank reaches its
  deadline and names what it waited for, instead of mixing unrelated tensors.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch.distributed as dist

from gradsync.elastic import check_restartable


def private_group(
    group: dist.ProcessGroup | None, timeout: timedelta, backend: str | None = None
) -> dist.ProcessGroup:
    """A new group of ``group``'s ranks whose backend timeout is ``timeout`` (and whose
    backend is ``backend``, if given: the checkpointer's is gloo whatever training uses).

    A collective over ``group`` (``new_group`` is): every member must call it, in the same
    order relative to other group creations.
    """
    check_restartable()  # after a torchrun restart new_group may connect to dead workers
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    # new_group does not inherit the parent's timeout; pass ours explicitly.
    new = dist.new_group(
        ranks, timeout=timeout, backend=backend, use_local_synchronization=group is not None
    )
    assert new is not None
    return new


def release_group(group: dist.ProcessGroup) -> None:
    """After a failed collective on a private ``group``: let the process end without waiting.

    On gloo nothing more is needed (aborting is a no-op there in torch 2.13): the group's own
    timeout, equal to gradsync's deadline, ends the operation inside gloo, closes the group's
    connections (so a late rank's matching collective fails instead of pairing with the
    abandoned one) and lets interpreter exit proceed. On NCCL the communicator is aborted now,
    before the watchdog would, so that the error raised is gradsync's.
    """
    try:
        if dist.get_backend(group) == "nccl":
            dist.distributed_c10d._abort_process_group(group)
    except Exception:  # best effort: the group's own timeout still ends the operation
        pass


# Texts by which a backend's failure shows where its type does not: gloo raises plain
# RuntimeErrors, and torch re-raises any error from a future's ``then`` callback as one.
_BACKEND_FAILURE = re.compile(
    r"gloo|nccl|processgroup|connection (closed|reset) by peer", re.IGNORECASE
)


def is_backend_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing in the backend (a lost peer, a timeout), not an
    error of the code around it."""
    return isinstance(exc, dist.DistError) or bool(_BACKEND_FAILURE.search(str(exc)))
