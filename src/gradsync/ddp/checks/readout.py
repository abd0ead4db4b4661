"""The step's readout: what every rank reads after a step's reduction, in one device-to-host
copy.

The used counts ([Note: used flags] in ``reducer.py``), every rank's step tag ([Note: step
tags] in ``tags.py``), the finite flag of each bucket (``check_finite``) and the global item
count (``item_mean``) are concatenated and read in one ``tolist()``: on CUDA each read is a sync
point, so there is one per step, not one per bucket (hundreds with ``bucket_cap_mb=0``). With
``check_finite`` the per-parameter flags each rank noted before the sum ride along, so naming
the parameters that held NaN/Inf costs no read of its own either.

With one rank there is nobody to hear from: the "sums" are what this rank wrote, the used flags
from its own hooks and its own step tag, and the host already holds both. Then nothing is read
from the device (unless ``check_finite`` or ``item_mean`` asks for values only the device
has), so on a GPU the host never waits for the backward to finish and keeps queueing the
optimizer's and the next forward's kernels, as torch DDP's reducer does; the checks that
follow see the same values either way (``tests/unit/test_results.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from gradsync.ddp.buckets import Bucket
from gradsync.ddp.checks.tags import NUM_FIELDS, StepTag, TagSlots, decode
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reduction import Reduction
from gradsync.timing.slots import TimingSlots


class StepReadout(NamedTuple):
    """What every rank holds identically after a step's bucket sums."""

    counts: list[list[float]]  # per bucket, per parameter: on how many ranks it was used
    finite: list[float] | None  # per bucket: no NaN/Inf after the sum (check_finite only)
    local_finite: list[list[float]] | None  # per bucket and slot, on this rank before the sum
    total_items: float  # the window's items over every rank (item_mean only)
    tags: list[StepTag | None] | None  # every rank's step tag (None: no buckets)
    timings: list[float]  # every rank's slots of the step timeline (timing/slots.py)


def read_step(
    buckets: Sequence[Bucket],
    check_finite: bool,
    reduction: Reduction,
    world_size: int,
    used: Sequence[bool],
    tag_slots: TagSlots | None,
    timing_slots: TimingSlots | None = None,
) -> StepReadout:
    """The step's readout. ``used``, ``tag_slots`` and ``timing_slots``: what this rank wrote
    into the flags, tags and timings (a slot of a filled bucket is used: its hook fired, or it
    was filled late as used)."""
    if world_size == 1 and not check_finite and not reduction.counts_items:
        flags = [float(used[i]) for b in buckets for i in b.spec.param_indices]
        written = tag_slots.written if tag_slots is not None else []
        timed = timing_slots.written if timing_slots is not None else []
        return _parse([*flags, *written, *timed], buckets, check_finite, reduction, world_size)
    return _parse(
        _read(buckets, check_finite, reduction), buckets, check_finite, reduction, world_size
    )


def _read(buckets: Sequence[Bucket], check_finite: bool, reduction: Reduction) -> list[float]:
    """Every value the checks need, from the device in one copy."""
    flags = [b.used_flags for b in buckets]
    parts = []
    if flags:  # one cat per dtype, not one conversion per bucket
        same = len({f.dtype for f in flags}) == 1
        parts.append(torch.cat(flags if same else [f.double() for f in flags]))
        parts.append(buckets[0].tags)
    if check_finite and buckets:
        parts.append(torch.stack([torch.isfinite(b.grads).all() for b in buckets]))
        parts.extend(b.local_finite for b in buckets if b.local_finite is not None)
    if reduction.counts_items:
        parts.append(reduction.total_items)
    return torch.cat([p.to(torch.float64) for p in parts]).tolist() if parts else []


def _parse(
    flat: list[float],
    buckets: Sequence[Bucket],
    check_finite: bool,
    reduction: Reduction,
    world_size: int,
) -> StepReadout:
    counts, start = [], 0
    for bucket in buckets:
        counts.append(flat[start : start + len(bucket.params)])
        start += len(bucket.params)
    tags, timings = None, []
    if buckets:  # bucket 0's tail: every rank's step tag, then every rank's timings
        num_tags, num_tail = NUM_FIELDS * world_size, buckets[0].tags.numel()
        tags = decode(flat[start : start + num_tags], world_size)
        timings = flat[start + num_tags : start + num_tail]
        start += num_tail
    finite, local_finite = None, None
    if check_finite:
        finite = flat[start : start + len(buckets)]
        start += len(buckets)
        local_finite = []
        for bucket in buckets:  # every bucket was flagged when it launched
            local_finite.append(flat[start : start + len(bucket.params)])
            start += len(bucket.params)
    total_items = flat[start] if reduction.counts_items else 0.0
    return StepReadout(counts, finite, local_finite, total_items, tags, timings)


def unused_somewhere(
    specs: Sequence[BucketSpec], counts: Sequence[Sequence[float]], contributed: int
) -> tuple[int, ...]:
    """Indices of the parameters used on fewer ranks than ``contributed`` to the step
    (``counts``: the summed used flags, per bucket and slot, the same on every rank)."""
    return tuple(
        sorted(
            i
            for spec, bucket in zip(specs, counts, strict=True)
            for i, count in zip(spec.param_indices, bucket, strict=True)
            if count < contributed
        )
    )
