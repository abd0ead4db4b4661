"""Compressed wires at the edges (real gloo ranks, one spawn): PowerSGD's state across a
skipped NaN step, a parameter unused on every rank, fp32 main gradients, a second model, the
state of a model that is gone passed to the next, loads that do not fit and one loaded on one
rank only; an fp16 wire that overflows.

Each case checks what the user is promised: skipping a refused step skips it for PowerSGD
too (bit for bit the run that never had that step), an unused parameter's error feedback is
kept, and a state that cannot be loaded is refused on every rank with nothing loaded."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.comm import PowerSGD
from gradsync.testing.spawn import spawn

from toy import outcome

TIMEOUT = 20.0
GLOBAL = 8


class Mlp(nn.Module):
    """16x8 and 16x16 matrices (compressed at rank 2) and a side branch ``c`` that a step may
    leave out."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, use_c: bool = True) -> torch.Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return h + self.c(h) if use_c else h


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    x, y = torch.randn(GLOBAL, 8, generator=g), torch.randn(GLOBAL, 16, generator=g)
    n = GLOBAL // 2
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def new_mlp(dtype: torch.dtype = torch.float32) -> Mlp:
    torch.manual_seed(0)
    return Mlp().to(dtype)


def wrap(model: nn.Module, **kw: Any) -> gradsync.DistributedDataParallel:
    return gradsync.DistributedDataParallel(model, timeout=TIMEOUT, **kw)


def state_of(model: nn.Module, psgd: PowerSGD) -> dict[str, torch.Tensor]:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"q.{n}": q.clone() for n, q in psgd.q.items()}
    out |= {f"error.{n}": e.clone() for n, e in psgd.error.items()}
    return out


# -- cases, run on every rank -------------------------------------------------------------------
def skipped_step(rank: int, nan_at: int | None) -> dict[str, Any]:
    """Five steps, SGD with momentum, ``check_finite``; at ``nan_at`` rank 1's input is NaN and
    every rank skips the step as the error message says. ``None``: that step never happens."""
    model, psgd = new_mlp(), PowerSGD(2)
    ddp = wrap(model, compression=psgd, check_finite=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    raised = []
    for step in range(5):
        if step == 2 and nan_at is None:
            continue
        opt.zero_grad()
        x, y = batch(step, rank)
        if step == nan_at and rank == 1:
            x = torch.full_like(x, float("nan"))
        try:
            F.mse_loss(ddp(x), y).backward()
        except gradsync.NonFiniteGradientError:
            raised.append(step)
            opt.zero_grad()
            continue
        opt.step()
    return {"raised": raised, "state": state_of(model, psgd), "step": psgd.step}


def unused_everywhere(rank: int) -> dict[str, Any]:
    """Step 1 leaves ``c`` out on every rank: its error buffer and Q must stay as they were."""
    model, psgd = new_mlp(), PowerSGD(2)
    ddp = wrap(model, compression=psgd, find_unused_parameters=True)
    states = []
    for step, use_c in enumerate((True, False)):
        model.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(ddp(x, use_c), y).backward()
        states.append((psgd.error["c.weight"].clone(), psgd.q["c.weight"].clone()))
    return {"states": states, "grad_c": model.c.weight.grad}


def main_grads(rank: int) -> dict[str, Any]:
    """A bf16 model with fp32 main gradients: PowerSGD keeps its state in fp32."""
    model, psgd = new_mlp(torch.bfloat16), PowerSGD(2)
    ddp = wrap(model, compression=psgd, main_grad_dtype=torch.float32)
    for step in range(3):
        model.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(ddp(x.bfloat16()), y.bfloat16()).backward()
    return {
        "dtypes": sorted({str(e.dtype) for e in psgd.error.values()}),
        "main_grad": model.b.weight.main_grad.clone(),  # type: ignore[attr-defined]
    }


def bad_loads(rank: int, folder: str) -> dict[str, str]:
    out = {}
    psgd = PowerSGD(2)
    model = new_mlp()
    ddp = wrap(model, compression=psgd)
    out["second_model"] = outcome(lambda: wrap(new_mlp(), compression=psgd))
    out["same_model_again"] = outcome(lambda: wrap(model, compression=psgd))
    ddp = wrap(model, compression=psgd)  # the re-wrap above retired the first wrapper
    x, y = batch(0, rank)
    F.mse_loss(ddp(x), y).backward()
    saved = ddp.sync_state_dict()
    # Rank 0's state loaded on every rank: its error buffers are keyed to rank 0.
    comm = dict(saved["comm"])
    comm["error.rank0"] = comm.pop(f"error.rank{rank}")
    rank0_only = {**saved, "comm": comm}
    out["rank0_state"] = outcome(lambda: ddp.load_sync_state_dict(rank0_only))
    out["step_after_refusal"] = str(psgd.step)
    exact = wrap(new_mlp())
    out["exact_into_powersgd"] = outcome(lambda: ddp.load_sync_state_dict(exact.sync_state_dict()))
    out["powersgd_into_exact"] = outcome(lambda: exact.load_sync_state_dict(saved))
    Checkpointer(folder, model=ddp).save(1)
    out["checkpoint_into_exact"] = outcome(lambda: Checkpointer(folder, model=exact).load())
    # A state loaded on rank 0 alone (the PowerSGD object directly, no collective), then the
    # model wrapped again: refused on every rank, not P = M Q summed over different Q.
    F.mse_loss(ddp(x), y).backward()
    if rank == 0:
        psgd.load_state_dict(saved["comm"], rank)
    out["one_rank_load"] = outcome(lambda: wrap(model, compression=psgd))
    return out


def train_three(rank: int, psgd: PowerSGD) -> dict[str, torch.Tensor]:
    model = new_mlp()
    ddp = wrap(model, compression=psgd)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        F.mse_loss(ddp(*batch(step, rank)[:1]), batch(step, rank)[1]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reused_state(rank: int, world: int) -> dict[str, Any]:
    """A sweep in one process: the wire state of a model that is gone, passed to the next."""
    psgd = PowerSGD(2)
    train_three(rank, psgd)  # the first model and its wrapper are gone when this returns
    gc.collect()
    out: dict[str, Any] = {
        "reused": train_three(rank, psgd),
        "fresh": train_three(rank, PowerSGD(2)),
    }
    state = powerSGD.PowerSGDState(None, matrix_approximation_rank=2)
    first = wrap(new_mlp())
    first.register_comm_hook(state, powerSGD.powerSGD_hook)
    del first
    gc.collect()
    out["torch_state"] = outcome(
        lambda: wrap(new_mlp()).register_comm_hook(state, powerSGD.powerSGD_hook)
    )
    return out


def fp16_overflow(rank: int) -> str:
    """Finite inputs whose sum exceeds fp16's range: inf after the reduction."""
    model = nn.Linear(1, 1, bias=False)
    ddp = wrap(model, compression="fp16", check_finite=True)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return outcome(lambda: (ddp(torch.full((1, 1), 1.0)) * 80000.0).sum().backward())


def grid(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {
        "skipped": skipped_step(rank, nan_at=2),
        "never_had_it": skipped_step(rank, nan_at=None),
        "unused": unused_everywhere(rank),
        "main_grads": main_grads(rank),
        "bad_loads": bad_loads(rank, folder),
        "fp16_overflow": fp16_overflow(rank),
    }


# -- the asserts ----------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_wire_edges(tmp_path: Path) -> None:
    results = spawn(grid, 2, (str(tmp_path),), timeout_s=150)
    for r in results:
        skipped, never = r["skipped"], r["never_had_it"]
        assert skipped["raised"] == [2] and never["raised"] == []
        # Skipping the refused step skips it for PowerSGD too: error buffers, Q, the step
        # count and the parameters are those of the run that never had that step.
        assert skipped["step"] == never["step"] == 4
        for k, v in never["state"].items():
            assert torch.equal(skipped["state"][k], v), k

        (error0, q0), (error1, q1) = r["unused"]["states"]
        assert torch.equal(error0, error1) and torch.equal(q0, q1)  # kept, bit for bit
        assert r["unused"]["grad_c"] is None  # zero_grad(set_to_none) and unused: untouched

        assert r["main_grads"]["dtypes"] == ["torch.float32"]
        assert torch.isfinite(r["main_grads"]["main_grad"]).all()

        e = r["bad_loads"]
        assert e["second_model"].startswith("UsageError") and "another model" in e["second_model"]
        assert e["same_model_again"] == "ok"
        # Refused on every rank (rank 0 could load its part), naming rank 1 and why.
        assert e["rank0_state"].startswith("UsageError"), e["rank0_state"]
        assert "rank 1: the PowerSGD state holds the error buffers of" in e["rank0_state"]
        assert e["step_after_refusal"] == "1"  # nothing was loaded
        assert "holds no compression state" in e["exact_into_powersgd"]
        assert "holds compression state" in e["powersgd_into_exact"]
        assert e["checkpoint_into_exact"].startswith("CheckpointError")
        assert "'gradsync.comm." in e["checkpoint_into_exact"]
        assert e["one_rank_load"].startswith("ModelMismatchError"), e["one_rank_load"]
        assert "'compression state (load it on every rank)'" in e["one_rank_load"]
        assert "rank 0 has 'step 1, Q of 3 matrices" in e["one_rank_load"]
        assert "rank 1 has 'step 2, Q of 3 matrices" in e["one_rank_load"]

        # 80000 on each rank, 40000 after the mean's pre-division, 80000 summed: inf in fp16.
        overflow = r["fp16_overflow"]
        assert overflow.startswith("NonFiniteGradientError"), overflow
        assert "no rank had any before communication" in overflow
    assert torch.equal(results[0]["main_grads"]["main_grad"], results[1]["main_grads"]["main_grad"])


def test_wire_state_of_a_model_that_is_gone_is_never_mixed_into_the_next(tmp_path: Path) -> None:
    for r in spawn(reused_state, 2, timeout_s=120):  # PowerSGD: the next model starts fresh
        for name, value in r["fresh"].items():
            assert torch.equal(r["reused"][name], value), name
        said = r["torch_state"]  # torch's PowerSGDState: refused, on every rank
        assert said.startswith("UsageError") and "already served another" in said, said
