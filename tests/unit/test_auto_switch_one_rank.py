"""``bucket_cap_mb="auto"`` at its plan switches, in one gloo process of world size 1 (no spawn).

- A module changed at the step of a switch raises ``ParametersChangedError`` naming the
  parameter, as with a fixed plan: the new buckets describe the wrapping-time parameters, and
  a reducer built on the changed set would not match them.
- ``p.main_grad`` of a parameter unused in a step after a switch is read from the new buckets
  (zeroed each window), not from the retired ones, which hold an old step's gradient.
- ``model.bucket_cap_mb`` is the cap the buckets in use were planned with.

The cost model and the step clock are fixed so that "auto" moves to one bucket per parameter
(cap 0) at ``SWITCH`` and keeps it, or, with slower trial steps, goes back at ``SETTLE``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import gradsync
from gradsync.ddp.replan import autotune
from gradsync.ddp.replan.autoplan import CostModel
from gradsync.errors import ParametersChangedError
from gradsync.optim import MasterWeights

SWITCH = autotune.WARMUP_STEPS + autotune.PROFILE_STEPS + autotune.TRIAL_STEPS
SETTLE = SWITCH + autotune.TRIAL_STEPS
STEPS = SETTLE + 2


class Branchy(nn.Module):
    """A bf16 net with a side branch the loop may leave out, and a frozen offset."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.side = nn.Linear(16, 4)
        self.offset = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, use_side: bool = True) -> torch.Tensor:
        y = self.net(x) + self.offset
        return y + self.side(x) if use_side else y


def _step_clock(trial_step_s: float) -> Iterator[float]:
    """Boundaries 1 s apart up to the switch, then the choice (0.5 s, in neither median),
    then trial steps of ``trial_step_s``: 2.0 makes the trial go back, 1.0 keeps the plan."""
    marks = [float(k) for k in range(SWITCH + 1)]
    marks.append(marks[-1] + 0.5)
    yield from marks
    yield from (marks[-1] + k * trial_step_s for k in range(1, 10**6))


@pytest.fixture()
def forced(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Make "auto" choose one bucket per parameter; returns a setter for the trial's speed."""
    slow_wire = CostModel(latency_s=1e-9, bytes_per_s=1e3)  # bytes dominate: start early
    monkeypatch.setattr(autotune, "fit_cost", lambda samples: slow_wire)
    monkeypatch.setattr(autotune, "CANDIDATE_CAPS_MB", (0, None))

    def trial(step_s: float) -> None:
        ticks = _step_clock(step_s)
        monkeypatch.setattr(autotune, "_step_clock", lambda: next(ticks))

    trial(1.0)
    return trial


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(8, 16, generator=gen).to(torch.bfloat16)
    return x, torch.randn(8, 4, generator=gen)


@pytest.mark.parametrize("at", ["switch", "going back"])
@pytest.mark.parametrize("change", ["frozen", "unfrozen"])
@pytest.mark.parametrize("main_grads", [True, False])
def test_a_change_at_a_switch_raises_parameters_changed(
    one_rank: None, forced: Callable[[float], None], at: str, change: str, main_grads: bool
) -> None:
    if at == "going back":
        forced(2.0)  # trial steps slower: the wrapper goes back to its initial plan at SETTLE
    model = Branchy()
    ddp = gradsync.DistributedDataParallel(
        model, bucket_cap_mb="auto", main_grad_dtype=torch.float32 if main_grads else None
    )
    when = SWITCH if at == "switch" else SETTLE
    for step in range(when):
        x, y = _batch(step)
        (ddp(x).float() - y).pow(2).mean().backward()
    assert ddp.num_buckets == (1 if at == "switch" else 6)
    if change == "frozen":
        name = "net.0.weight"
        model.net[0].weight.requires_grad_(False)
    else:
        name = "offset"
        model.offset.requires_grad_(True)
    x, y = _batch(when)
    with pytest.raises(ParametersChangedError, match=f"'{name}' requires_grad"):
        (ddp(x).float() - y).pow(2).mean().backward()


def _train(cap: Any, eval_backward: bool = False) -> dict[str, list[Any]]:
    """Train with ``MasterWeights`` on main gradients; the side branch is left out at the
    switch and at the end of the trial. ``zero_grad(set_to_none=False)`` keeps ``.grad``, so
    the optimizer steps every parameter on its ``main_grad``. ``eval_backward``: before those
    two steps' forwards, an eval-mode forward and backward under ``no_sync()`` adds into the
    window that the step reduces."""
    model = Branchy()
    ddp = gradsync.DistributedDataParallel(
        model, bucket_cap_mb=cap, main_grad_dtype=torch.float32, find_unused_parameters=True
    )
    opt = MasterWeights(model.parameters(), torch.optim.SGD, lr=0.1)
    out: dict[str, list[Any]] = {"weights": [], "side": [], "cap": []}
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        x, y = _batch(step)
        if eval_backward and step in (SWITCH, SETTLE):
            model.eval()
            with ddp.no_sync():
                ddp(x).float().sum().backward()
            model.train()
        (ddp(x, use_side=step not in (SWITCH, SETTLE)).float() - y).pow(2).mean().backward()
        out["side"].append(model.side.weight.main_grad.clone())  # type: ignore[attr-defined]
        opt.step()
        out["weights"].append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        out["cap"].append(ddp.bucket_cap_mb)
    return out


@pytest.mark.parametrize("trial_step_s", [1.0, 2.0], ids=["kept", "went back"])
def test_main_grads_of_unused_parameters_follow_the_switch(
    one_rank: None, forced: Callable[[float], None], trial_step_s: float
) -> None:
    fixed = _train(None)  # the default, where "auto" starts; one rank: every bucket layout
    # gives the same bits
    forced(trial_step_s)
    auto = _train("auto")
    for step in range(STEPS):
        assert torch.equal(auto["side"][step], fixed["side"][step]), f"main_grad, step {step}"
        assert torch.equal(auto["weights"][step], fixed["weights"][step]), f"step {step}"
    assert not auto["side"][SWITCH].any() and not auto["side"][SETTLE].any()
    # The cap the buckets in use were planned with: the initial one, 0 from the switch on,
    # and the initial one again if the trial went back.
    initial = fixed["cap"][0]
    chosen = [0] * (SETTLE - SWITCH) + ([0] if trial_step_s == 1.0 else [initial]) * 2
    assert auto["cap"] == [initial] * SWITCH + chosen, auto["cap"]


@pytest.mark.parametrize("trial_step_s", [1.0, 2.0], ids=["kept", "went back"])
def test_an_eval_backward_before_a_switch_stays_in_the_window(
    one_rank: None, forced: Callable[[float], None], trial_step_s: float
) -> None:
    """Its gradients are in the retired buckets when the plan switches: they move with it."""
    fixed = _train(None, eval_backward=True)
    forced(trial_step_s)
    auto = _train("auto", eval_backward=True)
    for step in range(STEPS):
        assert torch.equal(auto["weights"][step], fixed["weights"][step]), f"step {step}"


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("WARNING", logger="gradsync")
