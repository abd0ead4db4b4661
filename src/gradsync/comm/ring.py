"""Ring all-reduce built from point-to-point sends, run on a background thread.

The ring all-reduce (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", 2009; popularised for deep learning by Baidu's ``allreduce`` in 2017) splits the
tensor into N chunks and runs two phases of N-1 steps over a ring of ranks. In each step every
rank sends one chunk to its successor and receives one from its predecessor, so all links are
busy at once and every rank sends 2(N-1)/N of the tensor whatever N is: the bandwidth term is
independent of the number of ranks, which is why it is the textbook choice for large gradients.

* reduce-scatter: after step s, rank p has added its own data into chunk p-s-1; after N-1 steps
  rank p holds the complete sum of chunk p+1.
* all-gather: the complete chunks travel once more around the ring, overwriting stale data.

The pieces here (:func:`chunk_bounds`, :class:`RingRunner`, :class:`ThreadedAllReduce`) are
shared with :mod:`gradsync.comm.hierarchical`.

Host memory only: the scratch buffers the segments are received into live on the CPU, and
gloo's send/recv read raw data pointers as host memory, so a CUDA tensor would be read as
garbage (or crash the process). Every send and receive refuses a tensor off the CPU instead:
on GPUs, NCCL's own ring (``algorithm="native"``, the default) runs on the device.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import AllReduceAlgorithm, CommStats, Handle
from gradsync.comm.worker import SerialWorker
from gradsync.errors import UsageError

# Half-precision chunks are added in float32 and rounded back once per step. The running partial
# sum has to cross the wire in the tensor's own dtype at every step (sending float32 would double
# the bytes), so one rounding per hop is the best a ring can do; adding in float32 makes that
# rounding the correctly rounded sum of the two operands on every device, instead of depending on
# whether a backend's half-precision add kernel keeps a wider intermediate.
_WIDEN = {torch.bfloat16: torch.float32, torch.float16: torch.float32}


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(numel)`` into ``parts`` contiguous ``(start, stop)`` pieces, sizes within one.

    The first ``numel % parts`` chunks get one extra element, so chunk 0 is always a largest one;
    when ``numel < parts`` the trailing chunks are empty. Every rank computes the same bounds from
    the same two numbers, which is what lets sender and receiver agree without talking.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    base, extra = divmod(numel, parts)
    bounds = []
    start = 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    assert start == numel
    return bounds


@dataclass(frozen=True)
class Ring:
    """Ranks in ring order (global ranks, as p2p calls take them) and this rank's position."""

    group: dist.ProcessGroup | None
    ranks: tuple[int, ...]
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def next(self) -> int:
        return self.ranks[(self.index + 1) % self.size]

    @property
    def prev(self) -> int:
        return self.ranks[(self.index - 1) % self.size]


def group_ring(group: dist.ProcessGroup | None) -> Ring:
    """The ring over all ranks of ``group`` in group-rank order."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "default process group is not initialised"
    size = dist.get_world_size(group)
    ranks = tuple(dist.get_global_rank(pg, r) for r in range(size))
    return Ring(group, ranks, dist.get_rank(group))


def _accumulate(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` in place; half precision goes through float32 (see ``_WIDEN``)."""
    wide = _WIDEN.get(dst.dtype)
    if wide is None:
        torch.add(dst, src, out=dst)
    else:
        dst.copy_(dst.to(wide).add_(src.to(wide)))


def _host_only(t: torch.Tensor) -> None:
    if t.device.type != "cpu":
        raise UsageError(
            f"gradsync's point-to-point ring moves host memory only, and this bucket is on "
            f"{t.device}: algorithm='ring' or 'hierarchical', and on gloo also "
            "compression='bf16'/'fp16' and shard_optimizer(), need CPU tensors. On GPUs use "
            "backend='nccl' with algorithm='native' (the default): NCCL's own ring runs on the "
            "device, and compression and shard_optimizer() use NCCL's collectives there"
        )


def segment_bounds(start: int, stop: int, segment: int) -> list[tuple[int, int]]:
    """Split ``range(start, stop)`` into pieces of ``segment`` elements (the last one shorter)."""
    if segment < 1:
        raise ValueError(f"segment must be >= 1, got {segment}")
    return [(lo, min(lo + segment, stop)) for lo in range(start, stop, segment)]


# Large enough that the fixed cost of a message (gloo, a thread wake-up and the Python loop: up to
# a few hundred microseconds on an oversubscribed 2-CPU machine) stays small next to its transfer,
# small enough to pipeline multi-MB chunks. On 2 CPUs 4 MiB beat 1-2 MiB; on 16 CPUs 1 MiB was a
# little better; see benchmarks/2026-11-22-allreduce.md.
DEFAULT_SEGMENT_BYTES = 4 << 20
# Receive buffers in flight during the reduce-scatter: while one segment is being added, the
# next one is already landing, so the predecessor never waits for a posted buffer.
_RECV_DEPTH = 3
# Tags of the all-gather start here, so its messages can never match a reduce-scatter receive.
_ALL_GATHER_TAG = 1 << 24


class RingRunner:
    """Runs the ring phases for one algorithm instance: byte counts, segmenting, scratch space.

    Each chunk moves as segments of at most ``segment_bytes``, and a segment is forwarded as
    soon as it has been reduced (or received, in the all-gather) rather than when its whole
    chunk is done, so the ring works as a pipeline: a rank starts the next step while the
    previous one is still arriving, the add of one segment overlaps the transfer of the next,
    and the staging buffers are small enough to stay in cache and to be reused across calls.
    Both ends derive the same segments from the same chunk bounds, and a message's tag is its
    position in the sender's sequence, which equals its position in the receiver's.
    """

    def __init__(self, stats: CommStats, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self.stats = stats
        self.segment_bytes = segment_bytes
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def _segment_elems(self, flat: torch.Tensor) -> int:
        return max(1, self.segment_bytes // flat.element_size())

    def _buffers(self, flat: torch.Tensor, count: int, elems: int) -> list[torch.Tensor]:
        nbytes = count * elems * flat.element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        typed = self._scratch[:nbytes].view(flat.dtype)
        return [typed[i * elems : (i + 1) * elems] for i in range(count)]

    def _isend(self, t: torch.Tensor, ring: Ring, tag: int) -> dist.Work:
        _host_only(t)
        self.stats.bytes_sent += t.numel() * t.element_size()
        work = dist.isend(t, dst=ring.next, group=ring.group, tag=tag)
        assert work is not None
        return work

    def _irecv(self, t: torch.Tensor, ring: Ring, tag: int) -> dist.Work:
        _host_only(t)
        self.stats.bytes_received += t.numel() * t.element_size()
        work = dist.irecv(t, src=ring.prev, group=ring.group, tag=tag)
        assert work is not None
        return work

    def _plan(self, flat: torch.Tensor, ring: Ring, first_chunk: int) -> list[tuple[int, int, int]]:
        """``(step, start, stop)`` of every segment received, in order; step s gets chunk
        ``first_chunk - s``. Empty chunks have no segments, so they cost no message at all."""
        bounds = chunk_bounds(flat.numel(), ring.size)
        seg = self._segment_elems(flat)
        return [
            (step, lo, hi)
            for step in range(ring.size - 1)
            for lo, hi in segment_bounds(*bounds[(first_chunk - step) % ring.size], seg)
        ]

    def reduce_scatter(self, flat: torch.Tensor, ring: Ring) -> int:
        """Reduce-scatter ``flat`` (1-D, contiguous) in place; return the chunk this rank owns.

        Chunks are ``chunk_bounds(flat.numel(), ring.size)``. At step s rank p sends chunk p-s
        and adds the incoming chunk p-s-1 into its own; after N-1 steps chunk p+1 holds the
        sum over the ring (the other chunks hold partial sums).
        """
        self._reduce_scatter(flat, ring, start_gather=False)
        return (ring.index + 1) % ring.size

    def all_gather(self, flat: torch.Tensor, ring: Ring) -> None:
        """All-gather in place: rank p contributes chunk p+1, as the reduce-scatter left it."""
        self._all_gather(flat, ring, [])

    def all_reduce(self, flat: torch.Tensor, ring: Ring) -> None:
        """Sum ``flat`` (1-D, contiguous) over ``ring`` in place.

        The two phases are fused: each segment of the chunk this rank completes is sent on as
        the first all-gather message the moment its last add is done, instead of after the
        whole reduce-scatter, which hides most of one chunk's transfer time.
        """
        self._all_gather(flat, ring, self._reduce_scatter(flat, ring, start_gather=True))

    def _reduce_scatter(
        self, flat: torch.Tensor, ring: Ring, start_gather: bool
    ) -> list[dist.Work]:
        """The reduce-scatter; with ``start_gather``, returns the all-gather's first sends."""
        n, p = ring.size, ring.index
        if n == 1:
            return []
        plan = self._plan(flat, ring, p - 1)
        depth = min(_RECV_DEPTH, len(plan))
        bufs = self._buffers(flat, depth, self._segment_elems(flat))
        recvs: list[dist.Work] = []

        def post(k: int) -> None:
            _, lo, hi = plan[k]
            recvs.append(self._irecv(bufs[k % depth][: hi - lo], ring, k))

        for k in range(depth):
            post(k)
        start, stop = chunk_bounds(flat.numel(), n)[p]
        sends = [
            self._isend(flat[lo:hi], ring, tag)
            for tag, (lo, hi) in enumerate(segment_bounds(start, stop, self._segment_elems(flat)))
        ]
        gather_sends: list[dist.Work] = []
        for k, (step, lo, hi) in enumerate(plan):
            recvs[k].wait()
            _accumulate(flat[lo:hi], bufs[k % depth][: hi - lo])
            if k + depth < len(plan):
                post(k + depth)  # into the buffer just drained
            if step < n - 2:  # this segment belongs to the chunk sent at the next step
                sends.append(self._isend(flat[lo:hi], ring, len(sends)))
            elif start_gather:  # a finished segment of the chunk this rank owns
                tag = _ALL_GATHER_TAG + len(gather_sends)
                gather_sends.append(self._isend(flat[lo:hi], ring, tag))
        for work in sends:
            work.wait()  # before the all-gather may receive into these chunks
        return gather_sends

    def _all_gather(self, flat: torch.Tensor, ring: Ring, sends: list[dist.Work]) -> None:
        """The all-gather; ``sends`` holds the sends of the owned chunk made by a fused
        reduce-scatter, if any. Segments are received straight into ``flat`` (no staging copy)
        and, as each one targets a different place, all receives are posted up front."""
        n, p = ring.size, ring.index
        if n == 1:
            return
        plan = self._plan(flat, ring, p)
        recvs = [
            self._irecv(flat[lo:hi], ring, _ALL_GATHER_TAG + k)
            for k, (_, lo, hi) in enumerate(plan)
        ]
        if not sends:
            start, stop = chunk_bounds(flat.numel(), n)[(p + 1) % n]
            for lo, hi in segment_bounds(start, stop, self._segment_elems(flat)):
                sends.append(self._isend(flat[lo:hi], ring, _ALL_GATHER_TAG + len(sends)))
        for k, (step, lo, hi) in enumerate(plan):
            recvs[k].wait()
            if step < n - 2:
                sends.append(self._isend(flat[lo:hi], ring, _ALL_GATHER_TAG + len(sends)))
        for work in sends:
            work.wait()


PlanT = TypeVar("PlanT")


class ThreadedAllReduce(AllReduceAlgorithm, Generic[PlanT]):
    """Common frame of the algorithms that run on a :class:`SerialWorker`.

    The caller's thread validates, flattens and calls :meth:`_prepare` (anything collective that
    must happen in program order, like creating process groups); the worker thread runs
    :meth:`_sum` on a flat contiguous view and copies back into a non-contiguous input.
    """

    def __init__(self, segment_bytes: int = DEFAULT_SEGMENT_BYTES) -> None:
        super().__init__()
        self._runner = RingRunner(self.stats, segment_bytes)
        self._worker = SerialWorker(f"gradsync-{self.name}")

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Handle:
        if dist.get_rank(group) < 0:
            raise ValueError("this rank is not a member of the process group passed to all_reduce")
        plan = self._prepare(group)
        self.stats.calls += 1
        contiguous = tensor.is_contiguous()
        flat = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)

        def job() -> None:
            if flat.numel() > 0:
                self._sum(flat, plan)
            if not contiguous:
                tensor.copy_(flat.view(tensor.shape))

        return self._worker.submit(job)

    def close(self) -> None:
        """Wait for queued all-reduces and stop the worker thread."""
        self._worker.close()

    @abstractmethod
    def _prepare(self, group: dist.ProcessGroup | None) -> PlanT:
        """Per-call set-up on the caller's thread; the result is passed to :meth:`_sum`."""

    @abstractmethod
    def _sum(self, flat: torch.Tensor, plan: PlanT) -> None:
        """Sum ``flat`` (1-D, contiguous, non-empty) over the group in place; worker thread."""


class RingAllReduce(ThreadedAllReduce[Ring]):
    """Bandwidth-optimal ring all-reduce (reduce-scatter, then all-gather) over p2p sends.

    Asynchronous: ``all_reduce`` queues the work on this instance's worker thread and returns a
    handle at once. Two instances must not run all-reduces on the same group at the same time
    (their p2p tags would collide); one instance per data-parallel wrapper is the intended use.
    """

    name = "ring"

    def _prepare(self, group: dist.ProcessGroup | None) -> Ring:
        return group_ring(group)

    def _sum(self, flat: torch.Tensor, plan: Ring) -> None:
        self._runner.all_reduce(flat, plan)
