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
riders registered::

    | rank 0: step tags | timings | rank 1: step tags | timings | ...

so this rank writes one contiguous slice per step (one zeroing, one copy). :class:`TailLayout`
is the only place that knows these offsets: riders register a width, the bucket is built with
:attr:`TailLayout.numel` extra values, the reducer writes a record per step into bucket 0's
tail of that step with :meth:`TailLayout.write` (bucket 0 lays its buffer out again after
handing it over: [Note: handing the buffer over] in ``buckets.py``), and the readout hands
each rider back what every rank sent with :meth:`TailLayout.split`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from gradsync.ddp.checks import tags
from gradsync.timing import StepTimeline, slots


@dataclass(frozen=True)
class Rider:
    """One kind of record in the tail: ``width`` values per rank, at ``offset`` in a record."""

    name: str
    width: int
    offset: int


class TailLayout:
    """Where each rider's values lie in bucket 0's tail, and this rank's record in it."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.world_size, self.rank = world_size, rank
        self.riders: dict[str, Rider] = {}
        self.width = 0  # values per rank: the riders' widths added up
        self.written: list[float] = []  # this rank's record as last written, on the host
        self.laid_out = False  # a record was written: the riders are fixed

    def register(self, name: str, width: int) -> Rider:
        """Reserve ``width`` values per rank for ``name``; only before the first :meth:`write`."""
        if self.laid_out:
            raise RuntimeError(f"rider {name!r} registered after the tail was laid out")
        if name in self.riders or width < 0:
            raise ValueError(f"rider {name!r} registered twice, or with width {width}")
        rider = self.riders[name] = Rider(name, width, self.width)
        self.width += width
        return rider

    @property
    def numel(self) -> int:
        """The tail's length in the bucket: every rank's record."""
        return self.width * self.world_size

    def write(self, tail: torch.Tensor, records: Mapping[str, Sequence[float] | None]) -> None:
        """This rank's record for the coming sum, into ``tail`` (the end of bucket 0's buffer,
        :attr:`numel` long), each rider's values by name. A rider left out or given ``None``
        sends zeros, which its decoder reads as "nothing from this rank" (a rank that has
        joined); every other rank's slots are zeroed."""
        if tail.numel() != self.numel:
            raise ValueError(f"bucket 0's tail holds {tail.numel()} values, not {self.numel}")
        self.laid_out = True
        values = [0.0] * self.width
        for name, record in records.items():
            if record is None:
                continue
            rider = self.riders[name]
            if len(record) != rider.width:
                raise ValueError(f"{name}: {len(record)} values, expected {rider.width}")
            values[rider.offset : rider.offset + rider.width] = record
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

    def split(self, tail: Sequence[float]) -> dict[str, list[float]]:
        """Each rider's values of every rank, rank after rank, from the summed ``tail``."""
        width = self.width
        return {
            name: [
                v
                for r in range(len(tail) // width if width else 0)
                for v in tail[r * width + rider.offset : r * width + rider.offset + rider.width]
            ]
            for name, rider in self.riders.items()
        }


def step_tail(world_size: int, rank: int, timeline: StepTimeline, num_buckets: int) -> TailLayout:
    """What rides in bucket 0 after its used flags: every rank's step tag ([Note: step tags])
    and, with the step timeline on, its phases of the last interval (``timing/slots.py``)."""
    tail = TailLayout(world_size, rank)
    tail.register(tags.RIDER, tags.NUM_FIELDS)
    if timeline.enabled:
        tail.register(slots.RIDER, timeline.width(num_buckets))
    return tail
