"""The seam between the reducer and the wire: what happens to one bucket once it is full.

[Note: the bucket communication seam]
The reducer (``gradsync.ddp.reducer``) fills flat buckets from autograd hooks and hands each
full one to a :class:`CommHook`, chosen once when the wrapper is built. Everything about *how*
a bucket travels (which collective, which process group, which algorithm, in which precision)
lives behind this one call; the hook path never changes when it does. The contract:

1. Order. ``start(bucket)`` is called exactly once per bucket per synchronised backward, in
   increasing ``bucket.spec.index`` order, with the same sequence of calls on every rank of
   the group (backends match collectives by issue order; see [Note: when a bucket fires]). A
   hook must issue its collectives in that order too, and on the group it was built for.
2. Layout. ``bucket`` is the reducer's bucket (:class:`BucketLike`): ``bucket.buffer`` is 1-D,
   the gradients (``bucket.grads``, already scaled by the reduction: ``mean`` pre-divides by
   the number of active ranks), followed by one used flag per parameter (see [Note: used
   flags]) and, in bucket 0, one step tag per rank (see [Note: step tags]); ``bucket.views``
   are the gradients shaped like ``bucket.params``. Flags and tags (:func:`tail`) must come
   back as the *exact* sum over ranks: a hook that compresses the wire (lower precision, low
   rank) carries them losslessly, e.g. in a second, small, uncompressed all-reduce.
3. No blocking. ``start`` returns at once with a handle; ``handle.wait(timeout)`` returns when
   the result is in place and raises ``RuntimeError`` if it is not there within ``timeout``,
   as ``dist.Work.wait`` does (gradsync's deadlines are built on that).
4. Result. After ``wait`` returns, ``bucket.buffer`` holds on every rank the elementwise sum
   over the group of what the ranks passed in, in the bucket's own dtype and shape; a
   compressing hook may replace the gradient part by an approximation of that sum, and says
   how far it may be from it (``compress.py``, ``powersgd.py``). The exception is a hook of
   torch's ``ddp_comm_hooks`` (``torch_hooks.py``): those average, so the reduction scales
   the gradients by the world size more (``CommHook.divides_by``).
5. Thread. A hook issuing more than one collective per bucket issues them all from one
   thread, bucket after bucket (``worker.py``): collectives chained by completion callbacks
   could interleave with the next bucket's in a different order on different ranks.

Later hooks plug in here: a reduce-scatter for sharded optimizer state, the data-parallel axes
of a device mesh. The default, :class:`AllReduceHook`, is an all-reduce by
the selected :class:`~gradsync.comm.algorithm.AllReduceAlgorithm`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm, Handle


class BucketSpecLike(Protocol):
    @property
    def index(self) -> int: ...
    @property
    def param_indices(self) -> tuple[int, ...]: ...


class BucketLike(Protocol):
    """What a hook sees of the reducer's ``gradsync.ddp.buckets.Bucket``."""

    @property
    def spec(self) -> BucketSpecLike: ...
    @property
    def buffer(self) -> torch.Tensor: ...  # grads, then used flags, then (bucket 0) step tags
    @property
    def grads(self) -> torch.Tensor: ...  # buffer[: number of gradient elements]
    @property
    def views(self) -> Sequence[torch.Tensor]: ...  # one view of grads per parameter
    @property
    def params(self) -> Sequence[torch.Tensor]: ...


def tail(bucket: BucketLike) -> torch.Tensor:
    """The used flags and step tags after the gradients: they must be summed exactly."""
    return bucket.buffer[bucket.grads.numel() :]


class CommHook(ABC):
    """Starts the communication of one full bucket; see [Note: the bucket communication seam]."""

    # What the hook divides the sum by (point 4 of the Note): 1, except for torch's hooks.
    divides_by: int = 1
    # What a wait for a bucket's handle waits for, in a deadline's message.
    exchange: str = "the all-reduce"

    @abstractmethod
    def start(self, bucket: BucketLike) -> Handle:
        """Start summing ``bucket.buffer`` over the group in place; return a handle to wait on."""

    def state_dict(self) -> dict[str, Any]:
        """State that must outlive the process (e.g. PowerSGD's); saved with the wrapper's
        ``sync_state_dict()``. Empty for stateless hooks."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 (stateless: no-op)
        """Restore what :meth:`state_dict` returned."""

    def load_problem(self, state: dict[str, Any]) -> str | None:
        """Why :meth:`load_state_dict` would refuse ``state``, or ``None`` (checked on every
        rank before any rank loads)."""
        return None

    def discard_step(self) -> None:  # noqa: B027 (stateless: nothing to undo)
        """The step's reduction was refused (NaN/Inf gradients, the step is skipped): put
        back any state this step's buckets changed."""


class AllReduceHook(CommHook):
    """The default: an in-place all-reduce of the whole bucket by ``algorithm`` over ``group``."""

    def __init__(self, algorithm: AllReduceAlgorithm, group: dist.ProcessGroup | None) -> None:
        self.algorithm = algorithm
        self.group = group

    def start(self, bucket: BucketLike) -> Handle:
        return self.algorithm.all_reduce(bucket.buffer, self.group)
