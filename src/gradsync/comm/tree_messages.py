"""The fixed tree's exchange of a bucket on a CPU: point-to-point messages, on a thread of its own.

[Note: the tree's exchange on a CPU]
The exchange (``tree_exchange.py``: scatter, combine, gather) moves a bucket's pieces so that
each chunk's owner adds every piece's copy of it up the tree. On gloo, ``all_to_all_single`` and
``all_gather_into_tensor`` did that at about twice an all-reduce's time (2 ranks, an 11.7 MB
bucket: 19-38 ms against 11-22 ms, benchmarks/2026-12-07-deterministic-cost.md): gloo's
gather goes through a flat buffer of its own, new memory at every call (a page fault per 4 KiB)
and one more pass over the bucket, and the two collectives ran one after the other after
backward. Here every chunk goes in one message from where it lies straight to where it is
needed, the bucket's job for 10-21 ms:

- *Scatter*: rank p sends chunk c of each of its pieces (the first piece is the bucket's buffer)
  to rank c, which receives the peers' copies into a buffer kept for the bucket between steps.
- *Combine*: the owner adds the copies up the tree where they lie: its own pieces' chunks in
  place, the peers' in the receive buffer; the root ends in the bucket's buffer, at its chunk.
- *Gather*: the owner sends that chunk to every peer, which receives it straight into the same
  place of its buffer, once its own scatter sends have left (they read that place).

Each bucket is one job on a :class:`~gradsync.comm.worker.SerialWorker`, submitted when the
bucket is full, so the combine and gather of an early bucket run while backward goes on; the
jobs run in bucket order, the same on every rank, and messages of one tag between two ranks are
matched in the order they were posted: the pairs line up. The job waits for its messages with
no deadline of its own: a gloo receive that times out closes the connection to every peer, and
the reducer waits in slices of 50 ms while a regroup may begin ([Note: waking a survivor] in
``failfast/waiting.py``). The caller's wait on the job is the deadline, as for the ring.

The job also does what the layout of its pieces needs: the first bucket's waits for every
rank's leaf count of the step (``TreeExchange.begin_step``) and reads the layout from it, and
each lays its pieces out in the buffers. Done by the caller, at the first bucket's launch, that
wait held the rest of backward up until the slowest rank had begun its reduction: 15-38 ms a
step at N = 4 on two cores, where the default mode's all-reduce is waited for only at the end
(``benchmarks/2026-12-07-deterministic-cost.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats
from gradsync.comm.ring import chunk_bounds
from gradsync.comm.tree import Node, combine
from gradsync.comm.worker import AsyncHandle, SerialWorker

_SCATTER_TAG = 3 << 24  # tags of the two phases, apart from the ring's and the wire's
_GATHER_TAG = _SCATTER_TAG + 1


class TreeMessages:
    """The exchange of the deterministic mode's buckets over ``group`` in messages; counts what
    it sends and receives in ``stats``."""

    def __init__(self, group: dist.ProcessGroup | None, stats: CommStats) -> None:
        self.group, self.stats = group, stats
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None, "default process group is not initialised"
        self.ranks = [dist.get_global_rank(pg, r) for r in range(self.world_size)]
        self._worker = SerialWorker("gradsync-leaf-tree")
        self.received: dict[int, torch.Tensor] = {}  # per bucket index: the peers' chunks

    def submit(self, job: Callable[[], None]) -> AsyncHandle:
        """Run ``job`` (a bucket's :meth:`exchange`, after what it needs) on the worker."""
        return self._worker.submit(job)

    def exchange(
        self,
        buffer: torch.Tensor,
        mine: list[torch.Tensor],
        pieces: Sequence[Sequence[Node]],
        total: int,
        index: int,
    ) -> None:
        """Sum bucket ``index`` into ``buffer``, on the worker: ``mine`` are this rank's
        pieces, ``mine[0]`` (if any) ``buffer`` itself; ``pieces[r]``, rank ``r``'s nodes;
        ``total``, the step's leaves."""
        rank = self.rank
        bounds = chunk_bounds(buffer.numel(), self.world_size)
        lo, hi = bounds[rank]
        length = hi - lo
        theirs = sum(len(p) for r, p in enumerate(pieces) if r != rank)
        self._count(buffer, len(mine), theirs, length)
        received = self._receive_buffer(index, theirs * length, buffer)
        chunks: dict[Node, torch.Tensor] = {}
        works = []
        for r, nodes in enumerate(pieces):  # every receive posted before the first send
            for j, node in enumerate(nodes):
                if r == rank:
                    chunks[node] = mine[j][lo:hi]
                    continue
                chunks[node], received = received[:length], received[length:]
                if length:
                    works.append(self._message(dist.irecv, chunks[node], r, _SCATTER_TAG))
        sends = [
            self._message(dist.isend, t[a:b], r, _SCATTER_TAG)
            for r, (a, b) in enumerate(bounds)
            if r != rank and b > a
            for t in mine
        ]
        for work in works:
            work.wait()
        root, summed = combine(chunks, total), buffer[lo:hi]
        if root is None:
            summed.zero_()
        elif root.data_ptr() != summed.data_ptr():
            summed.copy_(root)
        for work in sends:
            work.wait()
        peers = [r for r in range(self.world_size) if r != rank]
        works = [
            self._message(dist.irecv, buffer[bounds[r][0] : bounds[r][1]], r, _GATHER_TAG)
            for r in peers
            if bounds[r][1] > bounds[r][0]
        ]
        works += [self._message(dist.isend, summed, r, _GATHER_TAG) for r in peers if length]
        for work in works:
            work.wait()

    def _count(self, buffer: torch.Tensor, pieces: int, theirs: int, length: int) -> None:
        """What one bucket's exchange sends and receives, in ``stats`` (only the worker writes
        them)."""
        element, others = buffer.element_size(), buffer.numel() - length
        self.stats.calls += 1
        self.stats.bytes_sent += (pieces * others + (self.world_size - 1) * length) * element
        self.stats.bytes_received += (theirs * length + others) * element

    def _message(
        self, post: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int, tag: int
    ) -> dist.Work:
        """``dist.isend`` or ``dist.irecv`` (``post``) of ``tensor`` with group rank ``peer``."""
        work = post(tensor, self.ranks[peer], self.group, tag)
        assert work is not None
        return work

    def _receive_buffer(self, index: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s receive buffer, kept between steps: new memory at every step
        costs a page fault per 4 KiB."""
        have = self.received.get(index)
        if have is None or have.numel() < numel or have.dtype != like.dtype:
            have = self.received[index] = like.new_empty(numel)
        return have[:numel]
