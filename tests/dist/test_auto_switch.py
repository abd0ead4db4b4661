"""``bucket_cap_mb="auto"`` and a module changed on one rank only, at a plan switch: the ranks
agree not to switch, and every rank raises ``ParametersChangedError`` naming the parameter (as
with a fixed plan), instead of one rank building buckets that its peers do not have.

Both switches are covered in one spawn: to the chosen plan (``SWITCH``) and back to the initial
one when the trial finds the chosen plan slower (``SETTLE``). One-rank changes at a switch are
in ``tests/unit/test_auto_switch_one_rank.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp import autotune
from gradsync.ddp.autoplan import CostModel
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


def _both(rank: int, world: int) -> dict[int, str]:
    slow_wire = CostModel(latency_s=1e-9, bytes_per_s=1e3)  # one bucket per parameter wins
    autotune.fit_cost = lambda samples: slow_wire
    autotune.CANDIDATE_CAPS_MB = (0, None)
    return {at: _run(rank, at) for at in (SWITCH, SETTLE)}


@pytest.mark.timeout(120)
def test_a_change_on_one_rank_at_a_switch_raises_everywhere() -> None:
    for rank, out in enumerate(spawn(_both, 2, timeout_s=110)):
        for at, what in out.items():
            assert what.startswith(f"step {at}: "), f"rank {rank}, step {at}: {what}"
            assert "'0.weight' requires_grad True -> False" in what, what
