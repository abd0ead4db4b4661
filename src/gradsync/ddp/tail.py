"""Bucket 0's tail: the records every rank sends along with the first bucket of a step.

[Note: bucket 0's tail]
Some facts about a step are needed by every rank, from every rank: where each rank is in its
training loop (step tags, ``checks/tags.py``) and how long each of its phases took (the step
timeline, ``timing/slots.py``). Rather than a collective of their own, they ride at the end of
the first bucket's buffer, after its gradients and used flags, and are summed with it. Each rank
writes its own record into its own slots and zeros everywhere else, so after the sum every rank
reads every rank's record exactly, at no extra collective. That asks two things of a rider:
values that come through a sum with zeros unchanged in the bucket's dtype (small integers, or
durations that may round), and a comm hook that carries the tail losslessly (see [Note: the
bucket communication seam] in ``comm/hook.py``).

The layout is rank after rank, and a rank's record is each rider's fields in the order the
riders were given::

    | rank 0: step tags | timings | rank 1: step tags | timings | ...

so this rank writes one contiguous slice per step (one zeroing, one copy). :class:`TailLayout`
is the only place that knows these offsets, and it knows no rider by name: a rider is an object
with a ``name``, a ``width`` per rank, an ``encode`` of this rank's record and a ``decode`` of
every rank's (:class:`Rider`), defined in its own module. The tail's owner (the reducer) hands
the riders over when it lays out the buckets, bucket 0 is built with :attr:`TailLayout.numel`
extra values, the reducer has every rider encode its record once per step into bucket 0's tail
of that step with :meth:`TailLayout.write` (bucket 0 lays its buffer out again after handing it
over: [Note: handing the buffer over] in ``buckets.py``), and the readout hands each rider's
decoding back by name with :meth:`TailLayout.read`. A new rider is its module and one entry in
the reducer's list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch


class Rider(Protocol):
    """One kind of record in the tail: ``width`` values per rank."""

    name: str
    width: int

    def encode(self, step: Any) -> Sequence[float] | None:
        """This rank's record of ``step`` (the reducer), ``width`` values; ``None``: zeros,
        which :meth:`decode` reads as "nothing from this rank"."""

    def decode(self, values: list[float], world_size: int) -> Any:
        """What every rank sent, from ``values``: this rider's fields, rank after rank."""


class GivenRider:
    """A rider whose records come with the step, a mapping from rider name to record: the
    layout checked apart from the reducer (tests, benchmarks)."""

    def __init__(self, name: str, width: int) -> None:
        self.name, self.width = name, width

    def encode(self, step: Mapping[str, Sequence[float] | None]) -> Sequence[float] | None:
        return step.get(self.name)

    def decode(self, values: list[float], world_size: int) -> list[float]:
        return values


class TailLayout:
    """Where each rider's values lie in bucket 0's tail, and this rank's record in it."""

    def __init__(self, world_size: int, rank: int, riders: Sequence[Rider]) -> None:
        self.world_size, self.rank = world_size, rank
        names = [r.name for r in riders]
        if len(set(names)) != len(names) or any(r.width < 0 for r in riders):
            raise ValueError(f"riders named twice, or of negative width: {names}")
        self.riders = list(riders)
        self.offsets = [sum(r.width for r in self.riders[:i]) for i in range(len(self.riders))]
        self.width = sum(r.width for r in self.riders)  # values per rank
        self.written: list[float] = []  # this rank's record as last written, on the host

    @property
    def numel(self) -> int:
        """The tail's length in the bucket: every rank's record."""
        return self.width * self.world_size

    def write(self, tail: torch.Tensor, step: Any | None) -> None:
        """This rank's record of ``step`` for the coming sum, into ``tail`` (the end of bucket
        0's buffer, :attr:`numel` long), each rider's values as it encodes them; ``step``
        ``None`` (a rank that has joined) sends zeros everywhere. Every other rank's slots
        are zeroed."""
        if tail.numel() != self.numel:
            raise ValueError(f"bucket 0's tail holds {tail.numel()} values, not {self.numel}")
        values = [0.0] * self.width
        for rider, offset in zip(self.riders, self.offsets, strict=True):
            record = None if step is None else rider.encode(step)
            if record is None:
                continue
            if len(record) != rider.width:
                raise ValueError(f"{rider.name}: {len(record)} values, expected {rider.width}")
            values[offset : offset + rider.width] = record
        self.written = values
        tail.zero_()
        if not any(values):
            return
        # To a GPU from pinned memory with a non-blocking copy: a plain host-to-device copy
        # would wait for the GPU at the start of every backward. The pinned tensor is a fresh
        # one each step, not a buffer kept and rewritten: the last step's copy from it may
        # still be queued, and torch's pinned-memory cache does not hand a block out again
        # until the copies queued from it have run (as ``Bucket.write_used_flags`` does).
        cuda = tail.is_cuda
        host = torch.tensor(values, dtype=tail.dtype, pin_memory=cuda)
        mine = tail[self.rank * self.width : (self.rank + 1) * self.width]
        mine.copy_(host, non_blocking=cuda)

    def read(self, tail: Sequence[float]) -> dict[str, Any]:
        """Each rider's decoding of what every rank sent, by rider name, from the summed
        ``tail``."""
        width, num_ranks = self.width, len(tail) // self.width if self.width else 0
        decoded = {}
        for rider, offset in zip(self.riders, self.offsets, strict=True):
            values = [
                v
                for r in range(num_ranks)
                for v in tail[r * width + offset : r * width + offset + rider.width]
            ]
            decoded[rider.name] = rider.decode(values, self.world_size)
        return decoded
