"""The backend's own all-reduce (gloo, NCCL) behind the algorithm interface: the default."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm, Handle


class NativeAllReduce(AllReduceAlgorithm):
    """``dist.all_reduce`` with ``ReduceOp.SUM``; the backend picks its own algorithm."""

    name = "native"

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Handle:
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.calls += 1
        # What the backend moves internally is its business; we count what we hand it.
        self.stats.bytes_sent += nbytes
        self.stats.bytes_received += nbytes
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
        assert work is not None
        return work
