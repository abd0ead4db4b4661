"""In-process recovery: a lost rank does not end the job.

- ``notice.py``: a lost peer, recognised by the type of what the step raised.
- ``membership.py``: the survivors agree, through the store, on one membership.
- ``rollback.py``: what a step changes, kept so that the interrupted step can be redone.
- ``regroup.py``: new process groups for the survivors, in the same processes.
- ``heal.py``: a replacement joins the running job, with a live peer's state.
- ``coverage.py``: what it covers (the wrapper, optimizer and sampler it can recover with).
- ``events.py``: each membership change as a typed record, and the line rank 0 logs for it.
- ``loop.py``: :class:`Recovery`, the training loop's side: steps a lost rank does not end.
- ``shares.py``: a step's share of the global batch, a micro-batch of no sample where it is empty.
- ``collectives.py``: the loop's own collectives in a step, stamped with the step's number.
"""

from gradsync.recovery.events import Admitted, Joined, Lost
from gradsync.recovery.loop import Recovery, Step
from gradsync.recovery.membership import Membership, NoRecoveryError, RankExcludedError, Report

__all__ = [
    "Admitted",
    "Joined",
    "Lost",
    "Membership",
    "NoRecoveryError",
    "RankExcludedError",
    "Recovery",
    "Report",
    "Step",
]
