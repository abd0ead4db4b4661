"""The seam between the reducer and the wire: what happens to one bucket once it is full.

[Note: the bucket communication seam]
The reducer (``gradsync.ddp.reducer``) fills flat buckets from autograd hooks and hands each
full one to a :class:`CommHook`, chosen once when the wrapper is built. Everything about *how*
a bucket travels (which collective, which process group, which algorithm, in which precision)
lives behind this one call; the hook path never changes when it does. The contract:

1. Order. ``start(bucket, index)`` is called exactly once per bucket per synchronised
   backward, in increasing ``index`` order, with the same sequence of calls on every rank of
   the group (backends match collectives by issue order; see [Note: when a bucket fires]). A
   hook must issue its collectives in that order too, and on the group it was built for.
2. Layout. ``bucket`` is 1-D: the gradients, already scaled by the reduction (``mean``
   pre-divides by the number of active ranks), followed by one used flag per parameter (see
   [Note: used flags]) and, in bucket 0, one step tag per rank (see [Note: step tags]). Flags
   and tags must come back as the *exact* sum over ranks: a hook that compresses the wire
   (lower precision, low rank) must carry them losslessly.
3. No blocking. ``start`` returns at once with a handle; ``handle.wait(timeout)`` returns when
   the result is in place and raises ``RuntimeError`` if it is not there within ``timeout``,
   as ``dist.Work.wait`` does (gradsync's deadlines are built on that).
4. Result. After ``wait`` returns, ``bucket`` holds on every rank the elementwise sum over the
   group of what the ranks passed in, in the bucket's own dtype and shape.

Later hooks plug in here: a reduce-scatter for sharded optimizer state, wire compression, the
data-parallel axes of a device mesh. The default, :class:`AllReduceHook`, is an all-reduce by
the selected :class:`~gradsync.comm.algorithm.AllReduceAlgorithm`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm, Handle


class CommHook(ABC):
    """Starts the communication of one full bucket; see [Note: the bucket communication seam]."""

    @abstractmethod
    def start(self, bucket: torch.Tensor, index: int) -> Handle:
        """Start summing ``bucket`` over the group in place; return a handle to wait on."""


class AllReduceHook(CommHook):
    """The default: an in-place all-reduce of the whole bucket by ``algorithm`` over ``group``."""

    def __init__(self, algorithm: AllReduceAlgorithm, group: dist.ProcessGroup | None) -> None:
        self.algorithm = algorithm
        self.group = group

    def start(self, bucket: torch.Tensor, index: int) -> Handle:
        return self.algorithm.all_reduce(bucket, self.group)
