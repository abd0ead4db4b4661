"""Uneven data: ranks that run out of batches keep answering until every rank is done.

Without this, the rank with one batch more waits forever in its gradient all-reduce. Inside
``with model.join():`` every training forward starts with a tiny handshake, an all-reduce of
``[active, syncing, broadcasting]`` on a private process group. A rank that has left its loop
answers ``[0, 0, 0]`` in a loop: for each round in which others are still active, it issues the
same collectives they do (buffer broadcast, item count, bucket all-reduces) with zero gradients,
zero used-flags and zero items, so the others' reductions complete and average over the ranks
that still had data. When a handshake sums to zero, all ranks are done.

The protocol lives on its own process group so that a collective the active ranks issue outside
it (a logging all_reduce, say) can never be matched with a handshake: the waiting rank reaches
its deadline and raises, naming what it waited for, instead of mixing unrelated tensors. Compare
torch's ``Join`` context manager (pytorch RFC #38174), which this follows in spirit.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.ddp.deadline import wait_or_raise


class JoinProtocol:
    """The handshake: one all-reduce of three int64 per training forward, on a private group."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, timeout: timedelta):
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        # new_group does not inherit the default group's timeout: pass ours explicitly.
        self.group = dist.new_group(
            ranks, timeout=timeout, use_local_synchronization=group is not None
        )
        self.rank = dist.get_rank(self.group)
        self.device = device
        self.timeout = timeout
        self.rounds_active = 0  # handshakes this rank answered with data

    def handshake(self, active: bool, sync: bool, broadcast: bool) -> tuple[int, bool, bool]:
        """(ranks still active, will they reduce, will they broadcast buffers) for this round."""
        flags = [int(active), int(active and sync), int(active and broadcast)]
        t = torch.tensor(flags, dtype=torch.int64, device=self.device)
        work = dist.all_reduce(t, group=self.group, async_op=True)
        assert work is not None
        what = (
            "the join handshake (this rank is active)"
            if active
            else "the join handshake: this rank ran out of data and waits for the others' next "
            "training forward"
        )
        wait_or_raise(work, self.timeout, what, self.rank)
        self.rounds_active += int(active)
        num_active, syncing, broadcasting = t.tolist()
        return num_active, syncing > 0, broadcasting > 0

    def authoritative_rank(self) -> int:
        """A rank that was active in the last round (the highest such): its state is final."""
        t = torch.tensor(
            [self.rounds_active * dist.get_world_size(self.group) + self.rank],
            dtype=torch.int64,
            device=self.device,
        )
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        assert work is not None
        wait_or_raise(work, self.timeout, "the end of join (choosing the final state)", self.rank)
        return int(t.item()) % dist.get_world_size(self.group)
