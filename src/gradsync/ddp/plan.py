"""Bucket planning: which gradients travel together. Pure: sizes in, layout out, no process
group, so it is tested on its own.

Gradients become ready roughly in reverse registration order (the last layer's first), so
buckets are filled in that order: the first bucket to fill is the first to be sent, while
autograd is still computing the rest. One all-reduce per bucket amortises the per-call latency
that one all-reduce per parameter would pay ~100 times per step. (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, section 3.2.)
The buffers the plan is made real in are in ``buckets.py``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from gradsync.errors import UsageError

MB = 1024 * 1024  # bucket_cap_mb counts MiB, as in torch DDP


@dataclass(frozen=True)
class BucketSpec:
    """The layout of one flat bucket: which parameters, where each one's gradient lives."""

    index: int
    dtype: torch.dtype
    param_indices: tuple[int, ...]  # positions in the wrapper's list of trainable parameters
    offsets: tuple[int, ...]  # element offset of each parameter's gradient in the flat buffer
    numel: int  # elements of gradient in the bucket (excludes the per-parameter used flags)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


# [Note: the default bucket cap]
# torch DDP's 25 MiB suits the models it was tuned on, with hundreds of MiB of gradients or
# more: they get ten buckets or many more. A model with 50 MiB of gradients gets two after the
# 1 MiB first bucket, and the second is ready only halfway through the backward. On a slow
# link the wire idles until then, and the second half's whole transfer comes after the
# backward. Measured on two simulated nodes at 1 Gbit/s with a 12.7M-parameter GPT (50.7 MB):
# 25 MiB 0.95-1.03x torch DDP's step, 5 MiB 0.83-0.86x. So across hosts the default is
# "scaled", an eighth of the model's gradient bytes: about eight buckets, so that the wire
# waits for about an eighth of the backward before the second bucket and about an eighth of
# the all-reduce is left after it. Bucket sizes stay between 1 MiB *on the wire* (below it a
# collective's fixed cost dominates) and torch's 25 MiB (reached at 200 MiB of gradients;
# larger models get torch's plan). The floor counts wire bytes because a compressed bucket
# pays the fixed costs of its collectives (PowerSGD: two, one after the other) for far fewer
# bytes: bf16 halves the bytes, so its buckets hold at least 2 MiB of fp32 gradients;
# PowerSGD rank 4 sends ~1/80 of them, so its buckets stay at 25 MiB (measured on the same
# GPT: 0.571x torch DDP's step at 25 MiB, 0.614x at 6 MiB on the slow link).
#
# Where every rank of the group shares one host (one machine, one network namespace: loopback,
# shared memory, NVLink), the link is fast and overlap gains little, while every collective
# has a fixed cost, paid on the same cores as the backward where the ranks are CPU processes:
# about 0.7 ms each with gloo on loopback. There the same GPT took 1.02-1.04x torch DDP's step
# with the scaled plan's 12 all-reduces and 1.00x with torch's 25 MiB (3), so one host gets
# torch's cap. Unlike "auto" the rule reads only the parameters' sizes, the wire format and
# where the ranks are: the same plan on every rank, in every run of the job and in a resume
# on the same hosts, so the bits a run computes do not depend on timings.
SCALED = "scaled"
SCALED_BUCKETS = 8
SCALED_MIN_MB, SCALED_MAX_MB = 1.0, 25.0
ONE_HOST_MB = 25.0  # torch DDP's cap: the default where the group's ranks share one host
CAP_WORDS = (SCALED, "auto")  # the strings bucket_cap_mb takes (auto: see autotune.py)


def scaled_cap_mb(grad_bytes: int, wire_bytes: int | None = None) -> float:
    """The cap of ``bucket_cap_mb="scaled"`` for ``grad_bytes`` of gradients that take
    ``wire_bytes`` on the wire (default: as many; see [Note: the default bucket cap])."""
    shrink = grad_bytes / wire_bytes if wire_bytes else 1.0  # > 1 for a compressed wire
    floor = SCALED_MIN_MB * max(shrink, 1.0)
    return min(SCALED_MAX_MB, max(floor, grad_bytes / SCALED_BUCKETS / MB))


def check_cap(
    bucket_cap_mb: float | str | None,
    name: str = "bucket_cap_mb",
    words: tuple[str, ...] = CAP_WORDS,
) -> None:
    """``UsageError`` (a ``ValueError``) naming the choices, for a cap ``name`` that is not a
    number >= 0 (``math.inf``: unlimited), ``None`` or one of ``words``."""
    if bucket_cap_mb is None or bucket_cap_mb in words:
        return
    number = isinstance(bucket_cap_mb, (int, float)) and not isinstance(bucket_cap_mb, bool)
    if number and 0 <= bucket_cap_mb <= math.inf:  # type: ignore[operator]
        return
    *others, last = ["a number >= 0 (math.inf: one bucket)", "None", *(repr(w) for w in words)]
    choices = f"{', '.join(others)} or {last}"
    raise UsageError(f"{name} must be {choices}, got {bucket_cap_mb!r}")


def resolve_cap(
    bucket_cap_mb: float | str | None,
    params: Sequence[tuple[int, torch.dtype]],
    wire_bytes: int | None = None,
    hosts: int | None = None,
) -> float | None:
    """The cap in MiB a wrapper plans its buckets with, for parameters given as ``(numel,
    dtype)`` whose gradients take ``wire_bytes`` on the wire, over ranks on ``hosts`` hosts.
    ``None``, the default, is torch's 25 MiB on one host and "scaled" across hosts or where
    ``hosts`` is not known (see [Note: the default bucket cap]); "scaled" is computed from the
    bytes; "auto" starts from the default (until it has chosen, and where its choice was no
    faster); ``math.inf`` is one bucket per dtype."""
    check_cap(bucket_cap_mb)
    if bucket_cap_mb in (None, "auto") and hosts == 1:
        return ONE_HOST_MB
    if bucket_cap_mb is None or isinstance(bucket_cap_mb, str):
        return scaled_cap_mb(grad_bytes(params), wire_bytes)
    return bucket_cap_mb


def grad_bytes(params: Sequence[tuple[int, torch.dtype]]) -> int:
    """Bytes of the gradients of parameters given as ``(numel, dtype)``."""
    return sum(n * d.itemsize for n, d in params)


def parse_cap(text: str) -> float | str:
    """``bucket_cap_mb`` as written on a command line: a number of MiB, ``none`` or ``inf``
    (one bucket: ``math.inf``), ``scaled`` or ``auto``; for argparse's ``type=``, so a
    refusal is an ``ArgumentTypeError`` whose message argparse prints."""
    word = text.strip().lower()
    if word in ("none", "inf"):
        return math.inf
    if word in CAP_WORDS:
        return word
    try:
        cap = float(word)
    except ValueError:
        cap = math.nan
    if not 0 <= cap < math.inf:
        try:
            check_cap(text)  # refused, naming what was written
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
    return cap


def cap_to_bytes(bucket_cap_mb: float | None) -> int | None:
    """``bucket_cap_mb`` in bytes; ``None`` or ``math.inf``: unlimited (one bucket per dtype)."""
    if bucket_cap_mb is None or bucket_cap_mb == math.inf:
        return None
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0 or None, got {bucket_cap_mb}")
    return int(bucket_cap_mb * MB)


# [Note: where a bucket closes]
# torch DDP closes a bucket once it holds the cap (``_compute_bucket_assignment_by_size``, with
# 1 MiB for each dtype's first bucket). plan_buckets walks the same rule in the order torch's
# rebuilt buckets follow when gradients become ready in reverse registration order, and
# ``test_buckets.py`` checks the two agree. Closing *before* the cap instead leaves more to the
# last bucket, the parameters whose gradients come last: with 25 MiB buckets a 6-layer GPT's
# last bucket was 21.3 MB against torch's 16.0, and its all-reduce, the one nothing overlaps,
# kept the end of backward waiting 25 ms instead of 18 on loopback.
def plan_buckets(
    params: Sequence[tuple[int, torch.dtype]],
    cap_bytes: int | None,
    first_cap_bytes: int | None = None,
    last: Collection[int] = (),
) -> list[BucketSpec]:
    """Group parameters, given as ``(numel, dtype)`` in registration order, into buckets.

    - ``cap_bytes == 0``: every parameter is its own bucket.
    - ``cap_bytes > 0``: walking parameters in reverse registration order, a bucket is closed
      once it holds the cap or more (torch DDP's rule: [Note: where a bucket closes]).
    - ``cap_bytes is None``: one bucket (per dtype: a flat buffer holds a single dtype).

    ``first_cap_bytes`` (with a positive ``cap_bytes``) closes the first bucket of each dtype
    once it holds that many bytes (never more than ``cap_bytes``): the last layers' gradients
    are ready first, and a small first bucket starts communication sooner.

    Buckets are numbered in the order they close, which is the order they are launched in
    (buckets still open at the end close in the order they were opened).
    ``last``: parameters planned after all others, in buckets of their own (unused_last.py).
    """
    specs: list[BucketSpec] = []
    open_: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    has_closed: set[torch.dtype] = set()  # dtypes past their first bucket

    def close(dtype: torch.dtype) -> None:
        members = open_.pop(dtype)
        open_bytes.pop(dtype)
        has_closed.add(dtype)
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i][0]
        specs.append(BucketSpec(len(specs), dtype, tuple(members), tuple(offsets), total))

    def add(i: int) -> None:
        numel, dtype = params[i]
        nbytes = numel * dtype.itemsize
        open_.setdefault(dtype, []).append(i)
        open_bytes[dtype] = open_bytes.get(dtype, 0) + nbytes
        if cap_bytes is None:
            return
        limit = cap_bytes
        if first_cap_bytes is not None and dtype not in has_closed:
            limit = min(first_cap_bytes, cap_bytes)
        if open_bytes[dtype] >= limit:
            close(dtype)

    late = set(last)
    for i in reversed(range(len(params))):
        if i not in late:
            add(i)
    for dtype in list(open_) if late else ():
        close(dtype)  # no bucket holds parameters of both groups
    for i in sorted(late, reverse=True):
        add(i)
    for dtype in list(open_):
        close(dtype)
    return specs
