"""Uneven data: ranks that run out of batches keep answering until every rank is done.

Without this, the rank with one batch more waits forever in its gradient all-reduce. Inside
``with model.join():`` every training forward starts with a tiny handshake, an all-reduce of
``[active, syncing, broadcasting]``. A rank that has left its loop answers ``[0, 0, 0]`` in a
loop: for each round in which others are still active, it issues the same collectives they do
(buffer broadcast, item count, bucket all-reduces) with zero gradients, zero used-flags, no step
tag and zero items, so the others' reductions complete and average over the ranks that still
had data. When a handshake sums to zero, all ranks are done.

The protocol runs on gradsync's private process group (``failfast/group.py``), so a collective
the active ranks issue on their own group (a logging all_reduce, say) can never be matched with a
handshake: the waiting rank reaches its deadline and raises, naming what it waited for, instead
of mixing unrelated tensors. Compare torch's ``Join`` context manager (pytorch RFC #38174),
which this follows in spirit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.ddp.reducer import Reducer
from gradsync.failfast.deadline import Deadline


class JoinProtocol:
    """The handshake: one all-reduce of three int64 per training forward."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self.rounds_active = 0  # handshakes this rank answered with data

    def handshake(self, active: bool, sync: bool, broadcast: bool) -> tuple[int, bool, bool]:
        """(ranks still active, will they reduce, will they broadcast buffers) for this round."""
        flags = [int(active), int(active and sync), int(active and broadcast)]
        t = torch.tensor(flags, dtype=torch.int64, device=self.deadline.device)
        what = (
            "the join handshake (this rank is active)"
            if active
            else "the join handshake: this rank ran out of data and waits for the others' next "
            "training forward"
        )
        self.deadline.all_reduce(t, what)
        self.rounds_active += int(active)
        num_active, syncing, broadcasting = t.tolist()
        return num_active, syncing > 0, broadcasting > 0

    def serve_until_done(
        self,
        reducer: Reducer,
        optimizer: torch.optim.Optimizer,
        broadcast_buffers: Callable[[], None],
    ) -> None:
        """This rank is out of data: answer every round of the others until all are done."""
        while True:
            self.deadline.begin("join: this rank is out of data and waits for the others")
            num_active, syncing, broadcasting = self.handshake(False, False, False)
            if num_active == 0:
                return
            if broadcasting:
                broadcast_buffers()
            if syncing:
                optimizer.zero_grad()
                reducer.shadow_backward(num_active, write_back=True)
                optimizer.step()

    def authoritative_rank(self) -> int:
        """A rank that was active in the last round (the highest such): its state is final."""
        world = self.deadline.world_size
        t = torch.tensor(
            [self.rounds_active * world + self.deadline.rank],
            dtype=torch.int64,
            device=self.deadline.device,
        )
        self.deadline.all_reduce(t, "the end of join (choosing the final state)", dist.ReduceOp.MAX)
        return int(t.item()) % world
