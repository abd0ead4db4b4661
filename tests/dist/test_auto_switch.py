"""``bucket_cap_mb="auto"`` and a module changed on one rank only, at a plan switch: the ranks
agree not to switch, and every rank raises ``ParametersChangedError`` naming the parameter (as
with a fixed plan), instead of one rank building buckets that its peers do not have.

Both switches are covered in one spawn: to the chosen plan (``SWITCH``) and back to the initial
one when the trial finds the chosen plan slower (``SETTLE``). One-rank changes at a switch are
in ``tests/unit/test_auto_switch_one_rank.py``.

The same spawn checks a window that an eval forward with grad opens under ``no_sync()`` just
before a switch: its backward's gradient of a parameter only it uses is averaged by the coming
step, on the new buckets, as with a fixed plan (before, the new reducer did not know the
parameter had been used, and each rank kept its own ``.grad``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp.replan import autotune
from gradsync.ddp.replan.autoplan import CostModel
from gradsync.errors import ParametersChangedError
from gradsync.testing.spawn import spawn

SWITCH = autotune.WARMUP_STEPS + autotune.PROFILE_STEPS + autotune.TRIAL_STEPS
SETTLE = SWITCH + autotune.TRIAL_STEPS


def _clock() -> Iterator[float]:
    """Steps of 1 s up to the switch, then of 2 s: the trial goes back at ``SETTLE``."""
    yield from (float(k) for k in range(SWITCH + 1))
    yield from (SWITCH + 2.0 * k for k in range(1, 10**6))


def _run(rank: int, at: int) -> str:
    """Train until step ``at``, where rank 1 freezes a weight; what the step raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb="auto", timeout=20)
    ticks = _clock()
    autotune._step_clock = lambda: next(ticks)
    gen = torch.Generator().manual_seed(rank)
    for step in range(at + 1):
        if step == at and rank == 1:
            model[0].weight.requires_grad_(False)
        try:
            ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        except ParametersChangedError as exc:
            return f"step {step}: {exc}"
    return f"no error; {ddp.num_buckets} bucket(s)"


class Forked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.side = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.training else self.side(x)


def _eval_window(rank: int, cap: str) -> torch.Tensor:
    """Train to the step after ``SETTLE``; before ``SWITCH`` and ``SETTLE``, an eval forward and
    backward under ``no_sync()`` through ``side``, which training forwards leave out: the
    ``.grad`` of ``side`` after the last step (an eval forward runs ``side``, a training one
    ``body``)."""
    autotune.CANDIDATE_CAPS_MB = (0,)  # one bucket per parameter, whatever the timings
    torch.manual_seed(0)
    model = Forked()
    ddp = gradsync.DistributedDataParallel(
        model, bucket_cap_mb=cap, find_unused_parameters=True, timeout=20
    )
    ticks = _clock()
    autotune._step_clock = lambda: next(ticks)
    gen = torch.Generator().manual_seed(rank)
    for step in range(SETTLE + 1):
        if step in (SWITCH, SETTLE):
            model.eval()
            with ddp.no_sync():
                ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
            model.train()
        ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        if cap == "auto" and step in (SWITCH, SETTLE):
            assert ddp.num_buckets == (4 if step == SWITCH else 1), (step, ddp.num_buckets)
    assert model.side.weight.grad is not None
    return model.side.weight.grad.clone()


def _both(rank: int, world: int) -> dict[Any, Any]:
    slow_wire = CostModel(latency_s=1e-9, bytes_per_s=1e3)  # one bucket per parameter wins
    autotune.fit_cost = lambda samples: slow_wire
    autotune.CANDIDATE_CAPS_MB = (0, None)
    out: dict[Any, Any] = {at: _run(rank, at) for at in (SWITCH, SETTLE)}
    out["eval window"] = {cap: _eval_window(rank, cap) for cap in ("scaled", "auto")}
    return out


@pytest.mark.timeout(120)
def test_a_switch_with_a_change_on_one_rank_or_an_open_eval_window() -> None:
    ranks = spawn(_both, 2, timeout_s=110)
    first = ranks[0]["eval window"]["auto"]
    for rank, out in enumerate(ranks):
        windows = out.pop("eval window")
        for at, what in out.items():
            assert what.startswith(f"step {at}: "), f"rank {rank}, step {at}: {what}"
            assert "'0.weight' requires_grad True -> False" in what, what
        assert torch.equal(windows["auto"], windows["scaled"]), f"rank {rank}: eval window"
        assert torch.equal(windows["auto"], first), f"rank {rank}: not averaged"
