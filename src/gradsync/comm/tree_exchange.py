"""The deterministic mode's bucket communication: the fixed leaf tree, summed across ranks.

Each rank arrives with the pieces of its block of leaves ([Note: the fixed leaf tree] in
``tree.py``), and the sum must be the tree's root, the same bits at any world size. The
exchange is a reduce-scatter in which the owner of each chunk, not the wire, does the adding:

1. *Counts* (once per step, :meth:`TreeExchange.begin_step`): every rank's number of leaves,
   gathered (a few bytes). From them every rank knows every rank's pieces, so no sizes travel
   with the data, and a leaf count that breaks the layout is refused on every rank alike.
2. *Scatter* (per bucket, :meth:`TreeExchange.start`): the gradients are cut into N chunks;
   rank p sends chunk c of each of its pieces to rank c.
3. *Combine*: rank c now holds chunk c of every piece of the step and adds them up the tree
   (:func:`~gradsync.comm.tree.combine`), in the tree's order, whoever computed them.
4. *Gather*: the summed chunks, to every rank.

With one piece per rank (``L = N 2^j`` leaves) a rank sends (N-1)/N of the bucket in step 2
and (N-1)/N in step 4: the bytes of a ring all-reduce. A rank with k pieces sends k (N-1)/N in
step 2 (``tree.leaf_blocks`` keeps k at most 3 wherever a block an eighth longer allows). The
used flags and step tags after the gradients are small integers, exact in any order: they
travel up the tree too, in each rank's first piece (zeros in the others), with no collective
of their own. The first piece is the bucket's own buffer, where the sum lands.

On a CPU (gloo) a bucket's exchange is one job of point-to-point messages on a thread of its own,
started when the bucket is full ([Note: the tree's exchange on a CPU] in ``tree_messages.py``);
the first bucket's job is also the one that waits for the counts and reads the layout.
Elsewhere (NCCL) it is the collectives ``all_to_all_single`` (step 2) and
``all_gather_into_tensor`` (step 4), issued in bucket order from the caller's thread: the
scatters as the buckets fill, the combines and gathers when the reducer waits for the first
bucket (:class:`TreeHandle`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats
from gradsync.comm.hook import BucketLike, CommHook
from gradsync.comm.ring import chunk_bounds
from gradsync.comm.tree import Node, block_pieces, combine, leaf_range
from gradsync.comm.tree_messages import TreeMessages
from gradsync.comm.worker import AsyncHandle
from gradsync.errors import UsageError

# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older torch lacks it.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TreeExchange(CommHook):
    """Sums each bucket's leaf pieces over ``group`` in the fixed tree's order; ``leaves``: the
    leaves of a full step (the deterministic mode's setting)."""

    exchange = "the fixed tree's sum (after every rank's leaf count of the step)"

    def __init__(self, leaves: int, group: dist.ProcessGroup | None) -> None:
        self.leaves = leaves
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.blocks = [leaf_range(leaves, self.world_size, r) for r in range(self.world_size)]
        self.stats = CommStats()
        self.counts: StepCounts | None = None  # this step's, from begin_step()
        self._wait: Callable[[Any], None] = lambda work: work.wait()  # begin_step's
        self._handles: list[TreeHandle] = []  # this step's buckets in flight, in order
        self.messages = TreeMessages(group, self.stats)  # the exchange on a CPU

    def begin_step(
        self, leaves_here: int, device: torch.device, wait: Callable[[Any], None]
    ) -> None:
        """Start gathering every rank's leaf count for the step whose reduction begins now
        (0 on a rank that has joined): issued before the step's first bucket on every rank.
        ``wait(work)`` waits for the gather on the caller's thread, under its deadline."""
        self._wait = wait
        mine = torch.tensor([leaves_here], dtype=torch.int64, device=device)
        counts = torch.empty(self.world_size, dtype=torch.int64, device=device)
        work = None
        if self.world_size == 1:
            counts.copy_(mine)
        else:
            work = _all_gather(counts, mine, group=self.group, async_op=True)
        self.counts = StepCounts(counts, work, self.blocks)

    @property
    def layout(self) -> StepLayout | None:
        """The step's layout, once its first bucket has read the counts."""
        return None if self.counts is None else self.counts.layout

    def start(self, bucket: BucketLike) -> TreeHandle | AsyncHandle:
        counts = self.counts
        assert counts is not None, "begin_step() comes before the first bucket"
        if self.world_size > 1 and self._by_messages(bucket.buffer):
            # The counts are read on the worker too ([Note: the tree's exchange on a CPU]).
            return self.messages.submit(lambda: self._by_worker(counts, bucket))
        layout = counts.read(self._wait)
        handle = TreeHandle(self, bucket, layout, self._pieces(bucket, layout))
        self._handles.append(handle)
        return handle

    def _by_worker(self, counts: StepCounts, bucket: BucketLike) -> None:
        # No deadline here: the caller's wait for the job is the deadline.
        layout = counts.read(lambda work: work.wait())
        mine = self._pieces(bucket, layout)
        self.messages.exchange(bucket.buffer, mine, layout.pieces, layout.total, bucket.spec.index)

    def _pieces(self, bucket: BucketLike, layout: StepLayout) -> list[torch.Tensor]:
        mine: Sequence[tuple[Node, torch.Tensor]] = bucket.pieces(layout.total)  # type: ignore[attr-defined]
        assert [n for n, _ in mine] == layout.pieces[self.rank], "pieces and counts disagree"
        return [t for _, t in mine]

    @staticmethod
    def _by_messages(buffer: torch.Tensor) -> bool:
        """Whether a bucket travels in messages ([Note: the tree's exchange on a CPU] in
        ``tree_messages.py``)."""
        return buffer.device.type == "cpu"

    def advance(self, timeout: timedelta | None) -> None:
        """Combine and start gathering every bucket of the step whose gather has not started,
        in bucket order: the reducer waits for bucket 0 once every bucket is launched, and the
        gathers then travel together instead of one after another. The same order on every
        rank, so the collectives pair up."""
        for handle in self._handles:
            handle.combine_and_gather(timeout)

    def finish(self) -> None:
        """The step's reduction is over (or abandoned): forget its counts."""
        self.counts, self._handles = None, []


class StepCounts:
    """One step's leaf counts, gathered once (:meth:`TreeExchange.begin_step`), and the layout
    read from them by the step's first bucket. A job of an abandoned step holds its own."""

    def __init__(self, counts: torch.Tensor, work: Any, blocks: Sequence[range]) -> None:
        self.counts, self.work, self.blocks = counts, work, blocks
        self.layout: StepLayout | None = None

    def read(self, wait: Callable[[Any], None]) -> StepLayout:
        """The step's layout, the counts first waited for by ``wait(work)``."""
        if self.layout is None:
            if self.work is not None:
                wait(self.work)
                self.work = None
            self.layout = StepLayout(self.counts.tolist(), self.blocks)
        return self.layout


class StepLayout:
    """Who holds which pieces in one step, from every rank's leaf count; refuses counts that do
    not put the step's leaves, in order, on the ranks that hold them at every world size."""

    def __init__(self, counts: Sequence[int], blocks: Sequence[range]) -> None:
        self.counts = list(counts)
        for rank, (count, block) in enumerate(zip(counts, blocks, strict=True)):
            later = [r for r in range(rank + 1, len(counts)) if counts[r]]
            if count > len(block) or (count < len(block) and later):
                raise UsageError(
                    f"deterministic mode: rank {rank} ran {count} leaves (micro-batches with a "
                    f"backward) in this step, but its leaves are {block.start}..{block.stop - 1} "
                    f"of every step ({len(block)}), and a rank may run fewer only in a short last "
                    f"step, after which later ranks run none (leaves per rank: {self.counts}). "
                    "Take the leaves from GlobalBatchSampler(..., deterministic=True), or from "
                    "gradsync.data.leaf_range(leaves, world_size, rank); over a device mesh, of "
                    "its data-parallel axis: num_replicas=mesh['dp'].size(), "
                    "rank=mesh['dp'].get_local_rank()"
                )
        self.total = sum(counts)  # the step's leaves: a prefix of the full step's
        self.pieces = [
            block_pieces(block.start, block.start + count, self.total)
            for count, block in zip(counts, blocks, strict=True)
        ]


class TreeHandle:
    """One bucket's exchange in flight: the scatter starts in :meth:`__init__`; the first
    :meth:`wait` combines this rank's chunk (and the other buckets', :meth:`TreeExchange.advance`)
    and gathers every chunk into the bucket's buffer."""

    def __init__(
        self,
        owner: TreeExchange,
        bucket: BucketLike,
        layout: StepLayout,
        mine: list[torch.Tensor],
    ) -> None:
        self.owner, self.bucket, self.layout = owner, bucket, layout
        n, rank = owner.world_size, owner.rank
        buffer = bucket.buffer  # the gradients, used flags and tail: all summed up the tree
        self.bounds = chunk_bounds(buffer.numel(), n)
        self.width = max(b - a for a, b in self.bounds)  # every chunk gathered at this length
        self.done = False
        if n == 1:
            self._finish_alone(mine)
            return
        stats = owner.stats
        stats.calls += 1
        lo, hi = self.bounds[rank]
        # Chunk c of each of my pieces, for rank c, in rank order: one contiguous send buffer.
        if len(mine) == 1:  # one piece: its chunks are in rank order already
            send = mine[0]
        else:
            send = torch.cat([t[a:b] for a, b in self.bounds for t in mine]) if mine else buffer[:0]
        sizes_in = [len(mine) * (b - a) for a, b in self.bounds]
        sizes_out = [len(p) * (hi - lo) for p in layout.pieces]
        self.received = buffer.new_empty(sum(sizes_out))
        self.scatter = dist.all_to_all_single(
            self.received, send, sizes_out, sizes_in, group=owner.group, async_op=True
        )
        element = buffer.element_size()
        stats.bytes_sent += (sum(sizes_in) - sizes_in[rank]) * element
        stats.bytes_received += (sum(sizes_out) - sizes_out[rank]) * element
        self.gather: Any = None
        self.gathered: torch.Tensor | None = None

    def _finish_alone(self, mine: list[torch.Tensor]) -> None:
        pieces = dict(zip(self.layout.pieces[0], mine, strict=True))
        root = combine(pieces, self.layout.total)
        if root is None:
            self.bucket.buffer.zero_()
        elif root.data_ptr() != self.bucket.buffer.data_ptr():
            self.bucket.buffer.copy_(root)
        self.done = True

    def is_completed(self) -> bool:
        if self.done:
            return True
        if self.gather is None:
            return False
        return bool(self.gather.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self.done:
            return True
        if self.gather is None:
            self.owner.advance(timeout)
        self.gather.wait(timeout) if timeout is not None else self.gather.wait()
        gathered, width = self.gathered, self.width
        assert gathered is not None
        buffer = self.bucket.buffer
        for c, (a, b) in enumerate(self.bounds):
            buffer[a:b].copy_(gathered[c * width : c * width + (b - a)])
        self.done = True
        return True

    def combine_and_gather(self, timeout: timedelta | None) -> None:
        """Once the scatter is in, add the step's pieces of this rank's chunk up the tree, then
        start gathering every rank's summed chunk (each padded to the longest chunk, as the
        gather needs). Once."""
        if self.done or self.gather is not None:
            return
        self.scatter.wait(timeout) if timeout is not None else self.scatter.wait()
        owner, layout = self.owner, self.layout
        lo, hi = self.bounds[owner.rank]
        length = hi - lo
        chunks: dict[Node, torch.Tensor] = {}
        offset = 0
        for pieces in layout.pieces:
            for node in pieces:
                chunks[node] = self.received[offset : offset + length]
                offset += length
        width = self.width
        mine = self.bucket.buffer.new_zeros(width)
        root = combine(chunks, layout.total)
        if root is not None:
            mine[:length].copy_(root)
        self.gathered = mine.new_empty(width * owner.world_size)
        self.gather = _all_gather(self.gathered, mine, group=owner.group, async_op=True)
        element = mine.element_size()
        owner.stats.bytes_sent += (owner.world_size - 1) * width * element
        owner.stats.bytes_received += (owner.world_size - 1) * width * element
