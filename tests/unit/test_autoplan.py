"""The planner of ``bucket_cap_mb="auto"`` is pure: known answers from synthetic profiles."""

from __future__ import annotations

import pytest
import torch

from gradsync.ddp.plan import MB, plan_buckets
from gradsync.ddp.replan.autoplan import CostModel, choose_plan, fit_cost, predict_end

F32 = torch.float32
# A model of 8 parameters of 1 MiB each (fp32); in backward the last one is ready first.
PARAMS = [(MB // 4, F32)] * 8


def ready_reverse(gap_s: float) -> list[float]:
    """Parameter i ready at (7 - i) * gap: reverse registration order, evenly spaced."""
    return [(len(PARAMS) - 1 - i) * gap_s for i in range(len(PARAMS))]


def test_predict_end_simulates_buckets_one_after_another() -> None:
    cost = CostModel(latency_s=1.0, bytes_per_s=float(MB))  # 1 s + 1 s per MiB
    one = plan_buckets(PARAMS, None)
    # One bucket: starts when the last gradient is ready (7 s), takes 1 + 8 s.
    assert predict_end(one, ready_reverse(1.0), cost) == pytest.approx(16.0)
    each = plan_buckets(PARAMS, 0)
    # One per parameter: each takes 2 s, ready 1 s apart, so the wire is the bottleneck:
    # starts at 0, then back to back: 8 * 2 s.
    assert predict_end(each, ready_reverse(1.0), cost) == pytest.approx(16.0)
    # Ready 3 s apart: each bucket waits for its gradient; the last starts at 21 s.
    assert predict_end(each, ready_reverse(3.0), cost) == pytest.approx(23.0)


def test_slow_latency_gives_one_bucket() -> None:
    # A 1 s latency dwarfs everything else: pay it once.
    plan = choose_plan(PARAMS, ready_reverse(1e-3), CostModel(1.0, 1e9))
    assert plan.num_buckets == 1


def test_fast_latency_slow_compute_gives_small_buckets() -> None:
    # Gradients 50 ms apart, 1 MiB takes ~1 ms and a call 10 us: send each as soon as it exists.
    plan = choose_plan(PARAMS, ready_reverse(0.05), CostModel(1e-5, 1e9))
    assert plan.num_buckets == len(PARAMS)
    assert plan.cap_mb is not None and plan.cap_mb <= 1
    # The prediction is the last gradient's time plus one bucket's cost.
    assert plan.predicted_s == pytest.approx(7 * 0.05 + 1e-5 + MB / 1e9)


def test_in_between_balances_latency_and_overlap() -> None:
    # 10 ms latency, 1 MiB per 10 ms, gradients 20 ms apart: per-parameter buckets would end at
    # 7 * 20 + 20 = 160 ms; one bucket at 140 + 10 + 80 = 230 ms; two-parameter buckets finish
    # each pair 30 ms after its second gradient: 140 + 30 = 170 ms. The planner picks the best.
    cost = CostModel(0.01, MB / 0.01)
    plan = choose_plan(PARAMS, ready_reverse(0.02), cost)
    assert plan.num_buckets == 8
    assert plan.predicted_s == pytest.approx(0.16)
    assert plan.predicted_s <= predict_end(plan_buckets(PARAMS, 2 * MB), ready_reverse(0.02), cost)


def test_ties_prefer_fewer_buckets() -> None:
    # Everything ready at once and free communication: every plan ends at 0.
    plan = choose_plan(PARAMS, [0.0] * len(PARAMS), CostModel(0.0, 1e30))
    assert plan.num_buckets == 1


def test_first_bucket_cap_is_a_candidate() -> None:
    # Cap 100 MiB with a 1 MiB first bucket: the last layer goes early, the rest together.
    plan = choose_plan(
        PARAMS, ready_reverse(0.01), CostModel(0.05, 1e9), caps_mb=(100,), first_caps_mb=(None, 1)
    )
    assert (plan.cap_mb, plan.first_cap_mb, plan.num_buckets) == (100, 1, 2)
    assert plan.specs(PARAMS) == plan_buckets(PARAMS, 100 * MB, MB)


def test_fit_cost_recovers_latency_and_bandwidth() -> None:
    truth = CostModel(2e-4, 1e8)
    samples = [(n, truth.seconds(n)) for n in (4096, 1 << 18, 1 << 22)]
    fit = fit_cost(samples)
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(1e8, rel=1e-6)


def test_fit_cost_clamps_noise_to_a_usable_model() -> None:
    # Larger messages measured faster (noise): no negative bandwidth, a positive one.
    fit = fit_cost([(4096, 2e-3), (1 << 20, 1e-3)])
    assert fit.latency_s >= 0 and fit.bytes_per_s > 0
    # A negative intercept becomes zero latency, bandwidth through the origin.
    fit = fit_cost([(1000, 1e-6), (2000, 1e-2)])
    assert fit.latency_s == 0 and fit.bytes_per_s > 0


def test_bad_profiles_are_refused() -> None:
    with pytest.raises(ValueError, match="ready times"):
        choose_plan(PARAMS, [0.0], CostModel(0, 1))
    with pytest.raises(ValueError, match="finite"):
        choose_plan(PARAMS, [float("nan")] * len(PARAMS), CostModel(0, 1))
    with pytest.raises(ValueError, match="sample"):
        fit_cost([])
