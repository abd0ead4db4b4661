"""Half precision on the wire, fp32 sums: a direct exchange on gradsync's point-to-point sends.

A ring reduce-scatter forwards running partial sums, so with a half-precision wire every
partial sum would be rounded before each of its N-1 hops. Here the *inputs* travel instead:
rank p rounds its copy of chunk c once and sends it straight to rank c, which owns that chunk;
the owner rounds its own copy too, adds the N rounded copies in fp32, in rank order, and rounds
the sum once; then it sends the rounded sum straight to every peer, which only copies it. That
is, bit for bit, what the collective path computes (``compress.py``, used on NCCL), whichever
rank owns an element: not rounding the owner's copy would be a little more accurate, but would
make the result depend on the bucket layout and the backend. Each rank
sends (N-1)/N of the tensor in each half, 2(N-1)/N in all, as in a ring all-reduce, in 2-byte
elements. See [Note: the half-precision error bound] in ``compress.py``. With 2 ranks every
byte crosses the link once each way, as in a ring; where several ranks share a node's link the
direct exchange crosses it more often (2 nodes x 2 ranks: 4/3 of a ring's bytes between
nodes), the price of rounding each input once instead of N-1 times.

Why not gloo's ``all_to_all_single`` and ``all_gather_single``, which do the same exchange:
over a 1 Gbit/s link (12.7M elements, 2 ranks) they took 210 ms and 165 ms where the bound of
each is ~106 ms (benchmarks/2026-11-22-wire.md); this exchange takes ~225 ms for both. What it
takes to run at the link's rate (measured on that link, benchmarks/2026-11-23-wire.md):

- Every receive is posted before the first send. gloo delivers a pair's messages in order,
  and a message that arrives before its receive is posted holds up those behind it: sending
  the first rounded sums while the peers were still sending their inputs, into receives not
  yet posted, made the 12.7M-element sum take 327 ms instead of 225 ms.
- Chunks move as segments of ``segment_bytes`` (1 MiB): the owner adds segment k while
  segment k+1 lands, and sends each sum as soon as it is rounded.
- :meth:`DirectExchange.start` returns once the sums are sent; :meth:`~DirectExchange.finish`
  waits for the peers' sums. A hook runs the two on two threads, so the next bucket's inputs go
  out while this bucket's sums come back, instead of the link idling at every bucket boundary.
- Used flags and step tags (the bucket's tail) travel in the same exchange, exactly: each rank
  sends its tail to every peer and every rank adds the N tails (small integers: exact in any
  order; added in rank order all the same), with no collective of their own.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats
from gradsync.comm.ring import Ring, segment_bounds

# Tags, per pair of ranks: the exchange's segments count from 0, the gathered sums' from
# _GATHER_TAG, the exact tails use _TAIL_TAG. Messages with one tag on one pair are matched in
# the order they were posted, which is the same on every rank (one thread posts them all).
_GATHER_TAG = 1 << 24
_TAIL_TAG = 1 << 25
DEPTH = 2  # sums in flight: while one's sums travel back, the next one's inputs go out
# Three sums in a row over the 1 Gbit/s link, 2 ranks, ms per sum (bound 17.6 and 105.4):
# 1.05M elements 19.8 / 18.4 / 19.3 / 19.5 and 6.3M 110.5 / 108.9 / 112.8 / 109.0 with
# segments of 4 MiB / 1 MiB / 512 KiB / 256 KiB (gloo's own bf16 all-reduce: 17.5 for 1.05M).
SEGMENT_BYTES = 1 << 20


@dataclass
class _Scratch:
    """Buffers of one sum in flight, reused while large enough."""

    wire: torch.Tensor  # outbox, inbox and result (see DirectExchange.start), wire dtype
    wide: torch.Tensor  # one segment of the inbox, widened to fp32 for the add
    acc: torch.Tensor  # one segment's fp32 sum
    tails: torch.Tensor  # the peers' tails
    free: threading.Event = field(default_factory=threading.Event)


@dataclass
class Pending:
    """One sum started by :meth:`DirectExchange.start`, completed by :meth:`~.finish`."""

    flat: torch.Tensor
    tail: torch.Tensor | None
    result: torch.Tensor | None  # the rounded sums, chunk after chunk (None: one rank)
    tails: torch.Tensor  # the peers' tails: row i from the rank i + 1 places after this one
    works: list[dist.Work]
    scratch: _Scratch


class DirectExchange:
    """Sums floating tensors over ``ring``'s group, ``wire_dtype`` on the wire, and an exact
    ``tail`` (used flags and step tags) in the tensor's own dtype.

    :meth:`start` posts every message of one sum and does its adds (blocking on the peers'
    inputs); :meth:`finish` waits for the rounded sums and writes the result. Starts must come
    one at a time and in the same order on every rank, as must finishes; up to ``DEPTH`` sums
    may be started and not yet finished (the next start waits for a free set of buffers).
    """

    def __init__(
        self,
        ring: Ring,
        wire_dtype: torch.dtype,
        stats: CommStats,
        exact_stats: CommStats | None = None,
        segment_bytes: int = SEGMENT_BYTES,
    ) -> None:
        self.ring = ring
        self.wire_dtype = wire_dtype
        self.stats = stats
        self.exact_stats = stats if exact_stats is None else exact_stats
        self.segment_elems = max(1, segment_bytes // (torch.finfo(wire_dtype).bits // 8))
        empty = torch.empty(0)
        self._scratch = [_Scratch(empty.to(wire_dtype), empty, empty, empty) for _ in range(DEPTH)]
        for scratch in self._scratch:
            scratch.free.set()
        self._started = 0

    def sum(self, flat: torch.Tensor, tail: torch.Tensor | None = None) -> int:
        """:meth:`start` and :meth:`finish` in one blocking call; the bytes this rank sent."""
        before = self.stats.bytes_sent
        self.finish(self.start(flat, tail))
        return self.stats.bytes_sent - before

    def start(self, flat: torch.Tensor, tail: torch.Tensor | None = None) -> Pending:
        """Round this rank's inputs once and send each peer its chunk; add the N rounded copies
        of this rank's chunk in fp32, round each sum once and send it to every peer; post the
        receives of the peers' sums and tails. ``flat``: 1-D, any floating dtype."""
        n, size, me = flat.numel(), self.ring.size, self.ring.index
        chunk = math.ceil(n / size)  # chunk j: flat[j * chunk :][:chunk], padded with zeros
        if size == 1:  # nothing travels, nothing is rounded
            return Pending(flat, tail, None, flat[:0], [], self._scratch[0])
        scratch = self._scratch[self._started % DEPTH]
        self._started += 1
        scratch.free.wait()  # the sum that used these buffers DEPTH starts ago has finished
        scratch.free.clear()
        outbox, inbox, result = self._buffers(scratch, flat, chunk, tail)
        peers = [(me + d) % size for d in range(1, size)]
        tails = scratch.tails[: (size - 1) * (0 if tail is None else tail.numel())]
        tails = tails.view(size - 1, -1)
        segments = segment_bounds(0, chunk, self.segment_elems)  # offsets within a chunk
        # Every receive is posted before anything is sent: gloo delivers a pair's messages in
        # order, and one that arrives before its receive is posted holds up those behind it.
        copies = [
            [self._irecv(inbox[i, lo:hi], q, k) for i, q in enumerate(peers)]
            for k, (lo, hi) in enumerate(segments)
        ]
        works = [
            self._irecv(result[q, lo:hi], q, _GATHER_TAG + k)
            for k, (lo, hi) in enumerate(segments)
            for q in peers
        ]
        if tail is not None:  # every rank has one or none: the buckets are the same
            works += [self._irecv(tails[i], q, _TAIL_TAG, exact=True) for i, q in enumerate(peers)]
            works += [self._isend(tail, q, _TAIL_TAG, exact=True) for q in peers]
        for k, (lo, hi) in enumerate(segments):
            for q in peers:
                valid = flat[q * chunk + lo : min(q * chunk + hi, n)]
                outbox[q, lo : lo + valid.numel()].copy_(valid)  # each input's one rounding
                works.append(self._isend(outbox[q, lo:hi], q, k))
        for k, (lo, hi) in enumerate(segments):
            valid = flat[me * chunk + lo : min(me * chunk + hi, n)]
            outbox[me, lo : lo + valid.numel()].copy_(valid)  # rounded too, though it stays
            acc, wide = scratch.acc[: hi - lo], scratch.wide[: hi - lo]
            for j in range(size):  # in rank order, as the collective path adds them
                if j == me:
                    row = outbox[me]
                else:
                    copies[k][(j - me - 1) % size].wait()
                    row = inbox[(j - me - 1) % size]
                if j == 0:
                    acc.copy_(row[lo:hi])  # widening to fp32 is exact
                else:
                    acc.add_(wide.copy_(row[lo:hi]))
            result[me, lo:hi].copy_(acc)  # the sum's one rounding
            works += [self._isend(result[me, lo:hi], q, _GATHER_TAG + k) for q in peers]
        return Pending(flat, tail, result, tails, works, scratch)

    def finish(self, pending: Pending) -> None:
        """Wait for the peers' rounded sums and tails; write the result into ``flat`` and the
        tail's exact sum, added in rank order (the same bits on every rank), into ``tail``."""
        if pending.result is None:
            return
        try:
            for work in pending.works:
                work.wait()
            flat, tail = pending.flat, pending.tail
            flat.copy_(pending.result.view(-1)[: flat.numel()])
            if tail is not None:
                me, size, peers = self.ring.index, self.ring.size, pending.tails
                rows = [tail if j == me else peers[(j - me - 1) % size] for j in range(size)]
                total = rows[0].clone()
                for row in rows[1:]:
                    total.add_(row)
                tail.copy_(total)
        finally:
            pending.scratch.free.set()

    def _buffers(
        self, scratch: _Scratch, flat: torch.Tensor, chunk: int, tail: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``outbox`` (this rank's rounded copies, by chunk), ``inbox`` (the peers' copies of
        this rank's chunk) and ``result`` (the rounded sums, by chunk), padding zeroed: 5/2
        bytes per element of ``flat`` with 2 ranks and a 2-byte wire dtype."""
        size, device = self.ring.size, flat.device
        need = (3 * size - 1) * chunk
        if scratch.wire.numel() < need or scratch.wire.device != device:
            scratch.wire = torch.empty(need, dtype=self.wire_dtype, device=device)
        seg = min(chunk, self.segment_elems)
        if scratch.wide.numel() < seg or scratch.wide.device != device:
            scratch.wide = torch.empty(seg, dtype=torch.float32, device=device)
            scratch.acc = torch.empty_like(scratch.wide)
        ntail = 0 if tail is None else (size - 1) * tail.numel()
        if tail is not None and (
            scratch.tails.numel() < ntail
            or scratch.tails.dtype != tail.dtype
            or scratch.tails.device != device
        ):
            scratch.tails = torch.empty(ntail, dtype=tail.dtype, device=device)
        outbox = scratch.wire[: size * chunk].view(size, chunk)
        inbox = scratch.wire[size * chunk : (2 * size - 1) * chunk].view(size - 1, chunk)
        result = scratch.wire[(2 * size - 1) * chunk : need].view(size, chunk)
        outbox.view(-1)[flat.numel() :].zero_()  # the padding: zeros, summed to zeros
        return outbox, inbox, result

    def _isend(self, t: torch.Tensor, index: int, tag: int, exact: bool = False) -> dist.Work:
        (self.exact_stats if exact else self.stats).bytes_sent += t.numel() * t.element_size()
        work = dist.isend(t, dst=self.ring.ranks[index], group=self.ring.group, tag=tag)
        assert work is not None
        return work

    def _irecv(self, t: torch.Tensor, index: int, tag: int, exact: bool = False) -> dist.Work:
        stats = self.exact_stats if exact else self.stats
        stats.bytes_received += t.numel() * t.element_size()
        work = dist.irecv(t, src=self.ring.ranks[index], group=self.ring.group, tag=tag)
        assert work is not None
        return work
