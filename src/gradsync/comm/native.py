"""The backend's own all-reduce (gloo, NCCL) behind the algorithm interface: the default."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm, Handle, ReduceOpName, check_op


class _DivideOnWait:
    """Wraps a backend work so ``avg`` divides after the sum, the same way on every backend.

    NCCL has ``ReduceOp.AVG`` and gloo does not; summing then dividing on both keeps results
    bit-identical across backends.
    """

    def __init__(self, work: dist.Work, tensor: torch.Tensor, divisor: int) -> None:
        self._work = work
        self._tensor = tensor
        self._divisor = divisor
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout=timeout)
            self._tensor.div_(self._divisor)
            self._done = True
        return True


class NativeAllReduce(AllReduceAlgorithm):
    """``dist.all_reduce`` with ``ReduceOp.SUM``; the backend picks its own algorithm."""

    name = "native"

    def all_reduce(
        self, tensor: torch.Tensor, op: ReduceOpName = "sum", group: dist.ProcessGroup | None = None
    ) -> Handle:
        check_op(op)
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        # What the backend moves internally is its business; we count what we hand it.
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        if op == "avg":
            return _DivideOnWait(work, tensor, dist.get_world_size(group))
        return work
