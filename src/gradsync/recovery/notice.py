"""How a survivor notices that a peer is lost: by the type of what its step raised.

[Note: what a lost peer raises]
Measured on torch 2.13 (two processes, one of them SIGKILLed; ``docs/recovery.md`` has the
table): gloo raises a plain ``RuntimeError`` naming its transport in every collective that
needed the dead peer, whether the survivor was waiting on the work (with or without a timeout),
inside a blocking ``all_reduce``, ``broadcast`` (from either side), ``all_gather`` or
``barrier``, in the middle of a transfer, or issuing a collective after the death (the call
returns; the wait raises). Only the store's clients raise torch's typed errors: a store
whose host died raises ``DistNetworkError`` from ``get``, ``check``, ``add``, ``wait`` and
``compare_set``, and a store's own timeout raises ``DistStoreError``.

So the words are never read: every collective of the wrapper and of a checkpointer is waited
for by a :class:`~gradsync.failfast.deadline.Deadline`, which turns the backend's error into
:class:`~gradsync.errors.CollectiveTimeoutError` naming this rank, the collective and who is
missing; :meth:`Step.all_reduce <gradsync.recovery.Step.all_reduce>` does the same for the
loop's own collectives; a checkpointer types what DCP's own collectives raise on its write's
thread, where no deadline waits, and raises ``CollectiveTimeoutError`` too once a regroup has
begun while it waits for the write. What reaches the end of a step is then recognised by its
type alone.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from gradsync.errors import CollectiveTimeoutError
from gradsync.recovery.membership import NoRecoveryError

if TYPE_CHECKING:
    from gradsync.ddp.wrapper import DistributedDataParallel

# What a step ends with when a peer was lost: gradsync's deadline error (a collective that a
# peer left, or that did not complete in time), or torch's DistError family (DistBackendError,
# DistNetworkError, DistStoreError: a store, or a backend that types its errors, as NCCL does).
LOST_PEER: tuple[type[BaseException], ...] = (CollectiveTimeoutError, dist.DistError)


def lost_a_peer(exc: BaseException) -> bool:
    """Whether ``exc``, raised inside a step, is how a collective ends when a peer is lost."""
    return isinstance(exc, LOST_PEER)


def regroup_failed(error: BaseException, address: str | None) -> NoRecoveryError:
    """Why the survivors cannot go on, when ``error`` ended their regroup: most often the job's
    store (at ``address``, ``None``: the default group's) is gone, with the process that held it.
    Then no survivor can reach the others, and each says so: where the store lived, and that
    the restart path takes over."""
    what = f"{type(error).__name__}: {error}"
    if not isinstance(error, dist.DistNetworkError):
        return NoRecoveryError(f"regrouping failed: {what}")
    shared = "TORCHELASTIC_RUN_ID" in os.environ and (
        os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
    )
    holder = (
        "the torchrun agent of the rendezvous host (global rank 0's node)"
        if shared
        else "global rank 0's process"
    )
    at = f" at {address}" if address else ""
    return NoRecoveryError(
        f"regrouping failed: the job's store{at} cannot be reached ({what}): it lived in "
        f"{holder}, lost with it, and the survivors can agree on who goes on only through "
        "it; every survivor ends here, and torchrun's restart (--max-restarts) takes over"
    )


def where_noticed(model: DistributedDataParallel, stepped: bool, exc: BaseException) -> str:
    """Where this survivor was in its step when it noticed the loss (``stepped``: its optimizer
    had stepped): ``optimizer step``, ``backward`` or ``forward``."""
    if stepped:
        return "optimizer step"
    reducing = model.reducer.reducing or "gradient reduction" in str(exc)
    return "backward" if reducing else "forward"
