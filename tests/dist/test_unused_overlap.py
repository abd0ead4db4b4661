"""Unused parameters among the last layers do not hold every bucket back (unused_last.py).

With ``find_unused_parameters=True``, a parameter without a gradient keeps its bucket pending
until the end of backward, and buckets launch in order: an unused head in the first bucket used
to stop every launch until backward ended. After the first step the wrapper plans the
parameters that step left unused on some rank into the last buckets. Counted here: how many
buckets each step launched while backward was still running, and the results against one
process; and that a checkpoint's sync state carries the plan to a resumed wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

import gradsync
from gradsync.ddp.launch import LaunchQueue
from gradsync.testing.spawn import spawn

WORLD, STEPS, DIM, BATCH = 2, 3, 4, 3
TOL = 1e-12  # float64, 2 ranks: a sum of two is exact in any order; the mean's halving too


class Net(nn.Module):
    """Three layers; ``side`` is used on rank 0 only, ``head`` by nobody. Registered last, both
    sit in the first buckets, which fill first in a backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(*(nn.Linear(DIM, DIM) for _ in range(3))).double()
        self.side = nn.Linear(DIM, DIM).double()
        self.head = nn.Linear(DIM, 1).double()

    def forward(self, x: torch.Tensor, use_side: bool) -> torch.Tensor:
        y = self.layers(x)
        return self.side(y) if use_side else y


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, DIM, generator=g, dtype=torch.float64)


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _run(rank: int, world: int) -> dict[str, Any]:
    launched: list[tuple[int, int]] = []  # per step: buckets launched before backward ended
    original = LaunchQueue.launch_rest

    def counting(self: LaunchQueue, zeros: bool, used: Sequence[bool]) -> None:
        launched.append((self.next, len(self.buckets)))
        original(self, zeros, used)

    LaunchQueue.launch_rest = counting  # type: ignore[method-assign]
    model = Net()
    ddp = gradsync.DistributedDataParallel(model, bucket_cap_mb=0, find_unused_parameters=True)
    first_specs = ddp.bucket_specs
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        _loss(ddp(_batch(step, rank), use_side=rank == 0)).backward()
        opt.step()
        opt.zero_grad()
    names = [n for n, p in model.named_parameters()]
    state = ddp.sync_state_dict()
    resumed = gradsync.DistributedDataParallel(Net(), bucket_cap_mb=0, find_unused_parameters=True)
    resumed.load_sync_state_dict(state)
    LaunchQueue.launch_rest = original  # type: ignore[method-assign]
    return {
        "launched": launched,
        "first_bucket": [names[i] for i in first_specs[0].param_indices],
        "planned_last": [names[i] for s in ddp.bucket_specs[-4:] for i in s.param_indices],
        "resumed_same_plan": resumed.bucket_specs == ddp.bucket_specs,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _reference() -> dict[str, torch.Tensor]:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        per_rank = [_loss(model(_batch(step, r), use_side=r == 0)) for r in range(WORLD)]
        (sum(per_rank) / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_unused_parameters_go_last_and_the_other_buckets_overlap_backward() -> None:
    per_rank = spawn(_run, WORLD)
    want = _reference()
    for out in per_rank:
        assert out["first_bucket"] == ["head.bias"]  # what made every launch wait
        assert sorted(out["planned_last"]) == [
            "head.bias",
            "head.weight",
            "side.bias",
            "side.weight",
        ]
        # Step 1 launches nothing during backward; later steps all 6 buckets of the used layers.
        assert out["launched"] == [(0, 10), (6, 10), (6, 10)], out["launched"]
        assert out["resumed_same_plan"]
        for name, value in want.items():
            torch.testing.assert_close(out["params"][name], value, rtol=0, atol=TOL)
        assert torch.equal(out["params"]["head.weight"], Net().head.weight)  # never stepped
