"""The extension point for all-reduce: one small interface, several algorithms behind it, and the
default, :class:`NativeAllReduce` (the backend's own: gloo, NCCL).

An algorithm takes a tensor and a process group and starts an in-place sum over the group,
returning a handle with ``wait()``, like ``dist.all_reduce(..., async_op=True)`` does. The
reducer reaches it through the bucket communication seam (``hook.py``) and never needs to know
which algorithm runs. Only sums: what a sum is divided by is the reduction's business
(``gradsync.ddp.reduction``), not the wire's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.failfast.deadline import Handle  # what start() returns: see there


@dataclass
class CommStats:
    """Bytes this rank has sent and received through an algorithm, for bandwidth accounting."""

    bytes_sent: int = 0
    bytes_received: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.bytes_sent = self.bytes_received = self.calls = 0


class AllReduceAlgorithm(ABC):
    """Base class of every all-reduce algorithm.

    Subclasses implement :meth:`all_reduce`; the sum must land in ``tensor`` in place and be
    identical on every rank of ``group``.
    """

    name: str = "abstract"

    def __init__(self) -> None:
        self.stats = CommStats()

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Handle:
        """Start an in-place sum of ``tensor`` over ``group`` and return its handle."""


class Done:
    """The handle of a sum over one rank: nothing to add, so done as it starts."""

    def wait(self, timeout: object = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()


class NativeAllReduce(AllReduceAlgorithm):
    """``dist.all_reduce`` with ``ReduceOp.SUM``; the backend picks its own algorithm. A world
    of one sums nothing: the tensor is its own sum, and no collective is issued (the backend's
    would cost the host a launch and a wait, on a GPU a kernel too)."""

    name = "native"

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Handle:
        if (group.size() if group is not None else dist.get_world_size()) == 1:
            return DONE
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        # What the backend moves internally is its business; we count what we hand it.
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        return work
