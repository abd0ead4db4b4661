"""Choosing bucket boundaries from a profile: the pure half of ``bucket_cap_mb="auto"``.

The best bucket size depends on the model and the link (Li et al., VLDB 2020, section 5): small
buckets start communicating early in backward but pay the per-collective latency many times;
one big bucket pays it once but cannot start before the last gradient. Given when each gradient
becomes ready and what a collective of ``n`` bytes costs on this group, this module predicts the
end of a step's communication for a candidate plan and picks the plan that ends first.

The prediction is a simulation of [Note: when a bucket fires] in ``launch.py``: buckets launch
in index order, one after another on the wire, so bucket ``b`` starts when its last gradient is
ready *and* bucket ``b - 1`` has finished, and takes ``latency + bytes / bandwidth``. Everything
here is pure (numbers in, a plan out), so it is tested without a process group; the runtime
half (profiling, agreement, the switch) is ``autotune.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradsync.ddp.plan import BucketSpec, cap_to_bytes, plan_buckets

CANDIDATE_CAPS_MB: tuple[float | None, ...] = (0.25, 0.5, 1, 2, 5, 10, 25, 50, 100, None)
"""The caps ``"auto"`` chooses among (MiB; ``None``: one bucket per dtype)."""


@dataclass(frozen=True)
class CostModel:
    """What one all-reduce of ``n`` bytes costs on a group: ``latency_s + n / bytes_per_s``."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


def fit_cost(samples: Sequence[tuple[int, float]]) -> CostModel:
    """Least-squares fit of ``seconds = latency + bytes / bandwidth`` to ``(bytes, seconds)``.

    Timings are noisy; a fit that comes out negative (latency below zero, a non-positive slope)
    is clamped to what the samples can still say: zero latency, or the bandwidth of the largest
    sample.
    """
    if not samples:
        raise ValueError("fit_cost needs at least one (bytes, seconds) sample")
    xs = [float(n) for n, _ in samples]
    ys = [float(t) for _, t in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    biggest = max(range(len(xs)), key=xs.__getitem__)
    if slope <= 0.0:  # no measurable bandwidth term: attribute the largest sample to bytes
        slope = max(ys[biggest], 1e-12) / max(xs[biggest], 1.0)
        return CostModel(latency_s=max(min(ys), 0.0), bytes_per_s=1.0 / slope)
    latency = my - slope * mx
    if latency < 0.0:
        latency = 0.0
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    return CostModel(latency_s=latency, bytes_per_s=1.0 / slope)


def predict_end(specs: Sequence[BucketSpec], ready_s: Sequence[float], cost: CostModel) -> float:
    """Seconds from the first gradient until the last bucket's communication ends.

    ``ready_s[i]``: when parameter ``i``'s gradient is ready (seconds since the step's first).
    """
    end = 0.0
    for spec in specs:
        ready = max(ready_s[i] for i in spec.param_indices)
        end = max(end, ready) + cost.seconds(spec.nbytes)
    return end


@dataclass(frozen=True)
class BucketPlan:
    """The plan ``"auto"`` chose: the caps to build buckets with and what it predicted."""

    cap_mb: float | None
    first_cap_mb: float | None
    num_buckets: int
    predicted_s: float  # predicted seconds from the first gradient to the last bucket's end
    cost: CostModel

    def specs(self, params: Sequence[tuple[int, torch.dtype]]) -> list[BucketSpec]:
        """The buckets of ``params`` (``(numel, dtype)`` in registration order) under this plan."""
        return plan_buckets(params, cap_to_bytes(self.cap_mb), cap_to_bytes(self.first_cap_mb))


def choose_plan(
    params: Sequence[tuple[int, torch.dtype]],
    ready_s: Sequence[float],
    cost: CostModel,
    *,
    caps_mb: Sequence[float | None] = CANDIDATE_CAPS_MB,
    first_caps_mb: Sequence[float | None] = (None,),
) -> BucketPlan:
    """The candidate plan with the earliest predicted end; on a tie (within a nanosecond), the
    one with fewer buckets (fewer collectives, less to go wrong), then the earlier candidate.

    Candidates are every cap of ``caps_mb`` combined with every first-bucket cap of
    ``first_caps_mb`` (a first cap applies only below a positive cap; see ``plan_buckets``).
    """
    if len(ready_s) != len(params):
        raise ValueError(f"{len(ready_s)} ready times for {len(params)} parameters")
    if any(not math.isfinite(t) for t in ready_s):
        raise ValueError("ready times must be finite (fill in parameters without a gradient)")
    best: BucketPlan | None = None
    best_key: tuple[float, int] | None = None
    for cap in caps_mb:
        for first in first_caps_mb:
            if first is not None and (cap is None or cap == 0 or first >= cap):
                continue  # the first cap would not change anything
            specs = plan_buckets(params, cap_to_bytes(cap), cap_to_bytes(first))
            predicted = predict_end(specs, ready_s, cost)
            key = (round(predicted, 9), len(specs))
            if best_key is None or key < best_key:
                best_key = key
                best = BucketPlan(cap, first, len(specs), predicted, cost)
    if best is None:
        raise ValueError("choose_plan needs at least one candidate cap")
    return best


def describe(plan: BucketPlan) -> str:
    """One line for the log: the caps, the bucket count, the prediction and the cost model."""
    first = "" if plan.first_cap_mb is None else f", first bucket {plan.first_cap_mb:g} MiB"
    cap = "one bucket per dtype" if plan.cap_mb is None else f"cap {plan.cap_mb:.3g} MiB"
    return (
        f"{cap}{first}: {plan.num_buckets} bucket(s), predicted {plan.predicted_s * 1e3:.2f} ms "
        f"from the first gradient to the last bucket's end (collective cost "
        f"{plan.cost.latency_s * 1e6:.0f} us + bytes at {plan.cost.bytes_per_s / 1e6:.1f} MB/s)"
    )
