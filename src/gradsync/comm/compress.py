"""Half-precision wire formats (bf16, fp16) whose sum is formed in fp32 and rounded once.

torch's ``bf16_compress_hook`` / ``fp16_compress_hook`` cast the bucket to half precision and
all-reduce it there: every partial sum of the ring is rounded to 8 (bf16) or 11 (fp16)
significant bits, so the error grows with the number of ranks. Here partial sums never travel:
each rank rounds its gradients to the wire format once and sends every other rank that rank's
1/N chunk; the owner of a chunk adds the N copies in fp32 and rounds the sum once; the rounded
chunks are then gathered by every rank (the scheme of Megatron-LM's
``reduce_scatter_with_fp32_accumulation``). Each rank sends 2(N-1)/N of the bucket in 2-byte
elements: half the bytes of an fp32 ring all-reduce, the same as torch's hooks.

On gloo the exchange runs on gradsync's point-to-point sends (``exchange.py``), because
gloo's ``all_to_all_single`` and ``all_gather_single`` are far slower than the link, and with
two ranks it is gloo's own all-reduce in the wire dtype, which then computes the same bits
([Note: two ranks, one half-precision all-reduce]); other backends (NCCL) use those two
collectives (:func:`sum_with_fp32_accumulation`). All give the bound below.

[Note: the half-precision error bound]
Let ``x_j`` be rank j's (pre-divided) value of one gradient element, ``S = sum_j x_j`` the exact
sum, ``u`` the unit roundoff of the wire format (``2**-8`` for bf16, ``2**-11`` for fp16),
``eta`` its absolute rounding error below the normal range (``2**-25`` for fp16, ``2**-134``
for bf16) and ``g = (N-1) u32 / (1 - (N-1) u32)`` with ``u32 = 2**-24`` (fp32 summation of N
terms). Rounding each input once, summing the N rounded values in fp32 (in rank order, on
both paths) and rounding the sum once gives a result ``r`` with

    |r - S| <= u |S| + (u (1 + u) + g (1 + u)**2) sum_j |x_j| + 2 (N + 1) eta

that is one rounding of the result plus one rounding of each input (the fp32 term is ~1e-7
relative and the ``eta`` term only matters for fp16 values below 6e-5). :func:`rounding_bound`
computes it; ``tests/dist/test_wire_formats.py`` checks it per element against an fp64 mean.
fp16 overflows beyond 65504: an element that large becomes inf. ``check_finite=True`` catches
it in the reduced gradients and raises on every rank, saying that no rank had NaN/Inf before
communication (an overflow in the sum or on the wire).
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradsync.comm.algorithm import CommStats, Handle
from gradsync.comm.exchange import DirectExchange
from gradsync.comm.hook import BucketLike, CommHook, tail
from gradsync.comm.ring import group_ring
from gradsync.comm.worker import ChainedHandle, SerialWorker

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_SUBNORMAL_ERROR = {torch.bfloat16: 2.0**-134, torch.float16: 2.0**-25}


def all_reduce_wire_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a bandwidth-optimal all-reduce of ``numel`` elements: a
    reduce-scatter and an all-gather of N chunks of at most ``ceil(numel / N)`` elements."""
    return 2 * (world_size - 1) * math.ceil(numel / world_size) * element_size


def rounding_bound(
    exact_sum: torch.Tensor, abs_sum: torch.Tensor, wire_dtype: torch.dtype, world_size: int
) -> torch.Tensor:
    """The per-element bound of [Note: the half-precision error bound] (fp64 inputs: the exact
    sum ``S`` and ``sum_j |x_j|`` of each element)."""
    u = torch.finfo(wire_dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    g = (world_size - 1) * u32 / (1 - (world_size - 1) * u32)
    eta = _SUBNORMAL_ERROR[wire_dtype]
    coeff = u * (1 + u) + g * (1 + u) ** 2
    return u * exact_sum.abs() + coeff * abs_sum + 2 * (world_size + 1) * eta


def sum_with_fp32_accumulation(
    flat: torch.Tensor, wire_dtype: torch.dtype, group: dist.ProcessGroup | None
) -> int:
    """Sum 1-D ``flat`` over ``group`` in place: ``wire_dtype`` on the wire, fp32 accumulation,
    one rounding of the sum; every rank gets the same result. Returns the bytes this rank sent.
    Blocking: run it on a worker thread."""
    world = dist.get_world_size(group)
    if world == 1 or flat.numel() == 0:
        return 0  # nothing travels, nothing is rounded
    chunk = math.ceil(flat.numel() / world)
    send = torch.zeros(world * chunk, dtype=wire_dtype, device=flat.device)
    send[: flat.numel()].copy_(flat)  # the inputs' one rounding
    received = torch.empty_like(send)
    # Chunk j of ``received`` is rank j's copy of this rank's chunk.
    dist.all_to_all_single(received, send, group=group)
    copies = received.view(world, chunk)
    total = copies[0].to(torch.float32)
    for j in range(1, world):  # in rank order, as exchange.py adds them: the same bits
        total.add_(copies[j])  # widened to fp32 (exactly), added in fp32
    mine = total.to(wire_dtype)  # rounded once
    gathered = torch.empty_like(send)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    flat.copy_(gathered[: flat.numel()])
    return 2 * (world - 1) * chunk * send.element_size()


def naive_half_all_reduce(flat: torch.Tensor, wire_dtype: torch.dtype, group: Any) -> None:
    """What torch's compress hooks do, for comparison: all-reduce in half precision, so every
    partial sum is rounded (the error grows with the number of ranks)."""
    half = flat.to(wire_dtype)
    dist.all_reduce(half, group=group)
    flat.copy_(half)


class _WidenedOnWait:
    """The handle of a half-precision all-reduce whose result is copied back into the
    bucket's dtype (exactly: widening) once it has arrived."""

    def __init__(self, work: dist.Work, wire: torch.Tensor, buffer: torch.Tensor) -> None:
        self.work, self.wire, self.buffer = work, wire, buffer

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.work.wait() if timeout is None else self.work.wait(timeout)
        self.buffer.copy_(self.wire)
        return True


class HalfPrecisionHook(CommHook):
    """Buckets travel as bf16 or fp16 with fp32 accumulation; used flags and step tags travel
    exactly, in the bucket's own dtype (a few elements per parameter).

    ``point_to_point`` (the default on gloo): the exchange runs on gradsync's sends
    (``exchange.py``), its flags and tags with it, and a bucket's inputs go out while the
    previous bucket's sums are still coming back (one thread sends, another waits). Otherwise
    (NCCL): the backend's all-to-all and all-gather, then an all-reduce of flags and tags,
    bucket after bucket on one thread. ``stats`` counts the gradients' bytes, ``exact_stats``
    those of the flags and tags.

    [Note: two ranks, one half-precision all-reduce]
    With two ranks each element's sum is ``a + b``: the backend's own all-reduce in the wire
    dtype rounds each input once (the cast) and the sum once (c10's ``BFloat16`` and ``Half``
    add in fp32 and round the result), the very bits of the exchange
    (``tests/dist/test_half_exchange.py`` compares them). Flags and step tags are integers
    below 256 (a tag is at most 128 and only its own rank writes it, a used count at most 2),
    exact in either wire dtype, so they ride in the same message. gloo's C++ all-reduce then
    replaces the exchange's two Python threads, which compete with the backward for the CPU.
    """

    def __init__(self, wire: str, group: dist.ProcessGroup | None) -> None:
        self.name = wire
        self.wire_dtype = WIRE_DTYPES[wire]
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.point_to_point = dist.get_backend(group) == "gloo"
        self.pair = self.point_to_point and self.world_size == 2  # see the Note above
        self._wires: dict[int, torch.Tensor] = {}  # bucket index -> its wire buffer (pair)
        self.stats = CommStats()
        self.exact_stats = CommStats()
        ring = group_ring(group)
        self._exchange = DirectExchange(ring, self.wire_dtype, self.stats, self.exact_stats)
        self._worker = SerialWorker(f"gradsync-{wire}-wire")
        self._finisher = SerialWorker(f"gradsync-{wire}-wire-finish")

    def start(self, bucket: BucketLike) -> Handle:
        if self.pair:
            wire = self._wire_buffer(bucket)
            wire.copy_(bucket.buffer)  # each input's one rounding
            work = dist.all_reduce(wire, group=self.group, async_op=True)
            assert work is not None
            size = wire.element_size()
            for stats, numel in (
                (self.stats, bucket.grads.numel()),
                (self.exact_stats, tail(bucket).numel()),
            ):
                stats.calls += 1
                stats.bytes_sent += all_reduce_wire_bytes(numel, size, 2)
                stats.bytes_received += all_reduce_wire_bytes(numel, size, 2)
            return _WidenedOnWait(work, wire, bucket.buffer)
        if not self.point_to_point:
            return self._worker.submit(lambda: self._reduce(bucket))
        handle = ChainedHandle()

        def send_and_add() -> None:
            pending = self._exchange.start(bucket.grads, tail(bucket))
            self.stats.calls += 1
            self.exact_stats.calls += 1
            handle.second = self._finisher.submit(lambda: self._exchange.finish(pending))

        handle.first = self._worker.submit(send_and_add)
        return handle

    def _wire_buffer(self, bucket: BucketLike) -> torch.Tensor:
        """The bucket's wire-dtype buffer, kept from step to step: a fresh one every step
        is megabytes of new pages to fault in, on the core the backward needs. Every bucket
        is waited for before the next backward starts, so reuse is safe."""
        buffer = bucket.buffer
        wire = self._wires.get(bucket.spec.index)
        if wire is None or wire.numel() != buffer.numel() or wire.device != buffer.device:
            wire = self._wires[bucket.spec.index] = torch.empty_like(buffer, dtype=self.wire_dtype)
        return wire

    def _reduce(self, bucket: BucketLike) -> None:
        """The collective path: blocking, on the worker thread."""
        sent = sum_with_fp32_accumulation(bucket.grads, self.wire_dtype, self.group)
        self.stats.calls += 1
        self.stats.bytes_sent += sent
        self.stats.bytes_received += sent
        exact = tail(bucket)
        dist.all_reduce(exact, group=self.group)
        nbytes = all_reduce_wire_bytes(exact.numel(), exact.element_size(), self.world_size)
        self.exact_stats.calls += 1
        self.exact_stats.bytes_sent += nbytes
        self.exact_stats.bytes_received += nbytes
