"""``bucket_cap_mb="auto"`` plans its new buckets in the dtype the wrapper reduces in.

With ``main_grad_dtype=torch.float32`` on a bf16 model the buckets hold fp32 main gradients; a
plan switched to must keep them fp32, or every gradient after the switch would be rounded to
bf16 before it is reduced. One gloo process of world size 1 (no spawn); the cost model and the
trial's clock are fixed so that "auto" moves to one bucket per parameter and keeps it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp.replan import autotune
from gradsync.ddp.replan.autoplan import CostModel

STEPS = autotune.WARMUP_STEPS + autotune.PROFILE_STEPS + 2 * autotune.TRIAL_STEPS + 2


def _train(cap: Any) -> tuple[gradsync.DistributedDataParallel, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ddp = gradsync.DistributedDataParallel(
        model, bucket_cap_mb=cap, main_grad_dtype=torch.float32, timeout=20
    )
    grads = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
        for p in model.parameters():
            p.grad = None  # p.main_grad: its bucket is zeroed by the next forward
        ddp(x).float().pow(2).mean().backward()
        grads.append(torch.cat([p.main_grad.flatten() for p in model.parameters()]))
    return ddp, grads


def test_auto_keeps_fp32_main_gradients_across_the_switch(one_rank, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # Bytes dominate: the first bucket should start early, so one bucket per parameter wins.
    slow_wire = CostModel(latency_s=1e-9, bytes_per_s=1e3)
    monkeypatch.setattr(autotune, "fit_cost", lambda samples: slow_wire)
    monkeypatch.setattr(autotune, "CANDIDATE_CAPS_MB", (0, None))
    ticks = iter(range(10**6))  # every step 1 s: the trial keeps the new plan (not slower)
    monkeypatch.setattr(autotune, "_step_clock", lambda: float(next(ticks)))
    auto, auto_grads = _train("auto")
    assert auto.bucket_plan is not None and auto.bucket_plan.cap_mb == 0, auto.bucket_plan
    assert auto.bucket_tuner.settled and auto.num_buckets == 4
    assert {s.dtype for s in auto.bucket_specs} == {torch.float32}
    _, fixed_grads = _train(0)  # the plan "auto" switched to, from the start
    for step, (a, f) in enumerate(zip(auto_grads, fixed_grads, strict=True)):
        assert a.dtype == torch.float32 and torch.equal(a, f), f"step {step}"


@pytest.fixture(autouse=True)
def _quiet_logs(caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level("WARNING", logger="gradsync")
