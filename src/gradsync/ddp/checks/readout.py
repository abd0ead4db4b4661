"""The step's readout: what every rank reads after a step's reduction, in one device-to-host
copy.

The used counts ([Note: used flags] in ``buckets.py``), bucket 0's tail (every rank's step
tag and timings: [Note: bucket 0's tail] in ``tail.py``), the finite flag of each bucket
(``check_finite``) and the global item count (``item_mean``) are concatenated and read in one
``tolist()``: on CUDA each read is a sync point, so there is one per step, not one per bucket
(hundreds with ``bucket_cap_mb=0``). With ``check_finite`` the per-parameter flags each rank
noted before the sum ride along, so naming the parameters that held NaN/Inf costs no read of
its own either.

With one rank there is nobody to hear from: the "sums" are what this rank wrote, the used flags
from its own hooks and its own step tag, and the host already holds both. Then nothing is read
from the device (unless ``check_finite`` or ``item_mean`` asks for values only the device
has), so on a GPU the host never waits for the backward to finish and keeps queueing the
optimizer's and the next forward's kernels, as torch DDP's reducer does; the checks that
follow see the same values either way (``tests/unit/test_results.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from gradsync.ddp.buckets import Bucket
from gradsync.ddp.plan import BucketSpec
from gradsync.ddp.reduction import Reduction
from gradsync.ddp.tail import TailLayout


class StepReadout(NamedTuple):
    """What every rank holds identically after a step's bucket sums."""

    counts: list[list[float]]  # per bucket, per parameter: on how many ranks it was used
    finite: list[float] | None  # per bucket: no NaN/Inf after the sum (check_finite only)
    local_finite: list[list[float]] | None  # per bucket and slot, on this rank before the sum
    total_items: float  # the window's items over every rank (item_mean only)
    riders: dict[str, Any]  # each tail rider's decoding of every rank's record, by its name


def read_step(
    buckets: Sequence[Bucket],
    check_finite: bool,
    reduction: Reduction,
    world_size: int,
    used: Sequence[bool],
    tail: TailLayout | None,
) -> StepReadout:
    """The step's readout. ``used`` and ``tail``: what this rank wrote into the flags and into
    bucket 0's tail (a slot of a filled bucket is used: its hook fired, or it was filled late
    as used); ``tail`` is ``None`` without buckets."""
    if world_size == 1 and not check_finite and not reduction.counts_items:
        flags = [float(used[i]) for b in buckets for i in b.spec.param_indices]
        written = tail.written if tail is not None else []
        return _parse([*flags, *written], buckets, check_finite, reduction, world_size, tail)
    flat = _read(buckets, check_finite, reduction)
    return _parse(flat, buckets, check_finite, reduction, world_size, tail)


def _read(buckets: Sequence[Bucket], check_finite: bool, reduction: Reduction) -> list[float]:
    """Every value the checks need, from the device in one copy."""
    parts = [b.used_flags for b in buckets]
    if buckets:
        parts.append(buckets[0].tail)
    if check_finite and buckets:
        parts.append(torch.stack([torch.isfinite(b.grads).all() for b in buckets]))
        parts.extend(b.local_finite for b in buckets if b.local_finite is not None)
    if reduction.counts_items:
        parts.append(reduction.total_items)
    # One cat, which promotes mixed dtypes to one that holds every value exactly (bool flags,
    # a bf16 bucket's counts, the float64 item total), and one read: a cat per dtype and a
    # conversion per part cost more than the values they carry (a few hundred per step).
    return torch.cat(parts).tolist() if parts else []


def _parse(
    flat: list[float],
    buckets: Sequence[Bucket],
    check_finite: bool,
    reduction: Reduction,
    world_size: int,
    tail: TailLayout | None,
) -> StepReadout:
    counts, start = [], 0
    for bucket in buckets:
        counts.append(flat[start : start + len(bucket.params)])
        start += len(bucket.params)
    riders = {}
    if tail is not None:  # bucket 0's tail: every rank's records ([Note: bucket 0's tail])
        riders = tail.read(flat[start : start + tail.numel])
        start += tail.numel
    finite, local_finite = None, None
    if check_finite:
        finite = flat[start : start + len(buckets)]
        start += len(buckets)
        local_finite = []
        for bucket in buckets:  # every bucket was flagged when it launched
            local_finite.append(flat[start : start + len(bucket.params)])
            start += len(bucket.params)
    total_items = flat[start] if reduction.counts_items else 0.0
    return StepReadout(counts, finite, local_finite, total_items, riders)


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
