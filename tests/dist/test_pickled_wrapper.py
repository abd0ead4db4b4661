"""A pickled wrapper (real gloo ranks, one spawn of 2): ``copy.deepcopy`` and ``torch.save`` of a
wrapped model, as torch DDP allows ([Note: a pickled wrapper] in ``ddp/compat/pickling.py``).

A copy is loaded but not built: a forward without gradients on one rank alone runs its module
with no collective; at its first training forward every rank builds it, and from then on it
trains bit for bit as the original does (PowerSGD's state travels with it). A whole saved
wrapper loads in a process without any process group. What cannot be rebuilt is refused."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradsync
from gradsync.comm import PowerSGD
from gradsync.ddp.forward import Lifecycle
from gradsync.testing.spawn import spawn

from toy import outcome

GLOBAL = 8


def new() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL, 6, generator=g), torch.randn(GLOBAL, 4, generator=g)
    return x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        opt.zero_grad()
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def copies_train_alike(rank: int, compression: Any) -> dict[str, Any]:
    original = gradsync.DistributedDataParallel(new(), compression=compression, timeout=20)
    opt = torch.optim.SGD(original.parameters(), lr=0.1)
    train(original, opt, range(2), rank)
    twin = copy.deepcopy(original)
    out: dict[str, Any] = {"loaded": twin.lifecycle}
    if rank == 0:  # one rank alone: an evaluation needs no collective
        with torch.no_grad():
            x = batch(9, rank)[0]
            out["eval"] = torch.equal(twin(x), original.module(x))
        out["still_loaded"] = twin.lifecycle
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    train(original, opt, range(2, 4), rank)
    train(twin, twin_opt, range(2, 4), rank)  # built at its first forward, on both ranks
    out["built"] = twin.lifecycle
    out["same"] = all(
        torch.equal(a, b) for a, b in zip(params(original), params(twin), strict=True)
    )
    return out


def refusals(rank: int) -> dict[str, str]:
    out = {}
    model = gradsync.DistributedDataParallel(new(), timeout=20)
    x, y = batch(0, rank)
    with model.no_sync():
        F.mse_loss(model(x), y).backward()
    out["mid_step"] = outcome(lambda: copy.deepcopy(model))
    sharded = gradsync.DistributedDataParallel(new(), timeout=20)
    sharded.shard_optimizer(torch.optim.SGD, lr=0.1)
    out["sharded"] = outcome(lambda: copy.deepcopy(sharded))
    group = dist.new_group([0, 1])
    own_group = gradsync.DistributedDataParallel(new(), process_group=group, timeout=20)
    out["group"] = outcome(lambda: copy.deepcopy(own_group))
    return out


def pickled(rank: int, world: int, folder: str) -> dict[str, Any]:
    model = gradsync.DistributedDataParallel(new(), timeout=20)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train(model, opt, range(2), rank)
    torch.save(model, Path(folder) / f"whole{rank}.pt")
    return {
        "saved": params(model.module),
        "default": copies_train_alike(rank, None),
        "powersgd": copies_train_alike(rank, PowerSGD(1)),
        "refusals": refusals(rank),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    folder = tmp_path_factory.mktemp("whole")
    return spawn(pickled, 2, (str(folder),), timeout_s=120), folder


@pytest.mark.parametrize("wire", ["default", "powersgd"])
def test_a_copy_is_built_by_its_first_training_forward_and_trains_as_the_original(
    results: tuple[list[dict[str, Any]], Path], wire: str
) -> None:
    for rank, res in enumerate(results[0]):
        got = res[wire]
        assert got["loaded"] is Lifecycle.LOADED and got["built"] is Lifecycle.TRAINING, got
        assert got["same"], rank
    assert results[0][0][wire]["eval"] and results[0][0][wire]["still_loaded"] is Lifecycle.LOADED


def test_a_saved_wrapper_loads_without_a_process_group(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    assert not dist.is_initialized()
    loaded = torch.load(results[1] / "whole0.pt", weights_only=False)
    assert isinstance(loaded, torch.nn.parallel.DistributedDataParallel)
    assert loaded.lifecycle is Lifecycle.LOADED
    for a, b in zip(params(loaded.module), results[0][0]["saved"], strict=True):
        assert torch.equal(a, b)
    assert set(loaded.state_dict()) == set(new().state_dict())  # the module's keys
    with torch.no_grad():
        x = batch(0, 0)[0]
        assert torch.equal(loaded.eval()(x), loaded.module(x))
    said = outcome(lambda: loaded.train()(x))  # training needs the process group
    assert said.startswith("ProtocolError") and "init_process_group" in said, said


@pytest.mark.parametrize(
    "case, words",
    [
        ("mid_step", "inside a step"),
        ("sharded", "shard_optimizer()"),
        ("group", "process_group of its own"),
    ],
)
def test_what_cannot_be_rebuilt_is_refused_naming_what_to_save(
    results: tuple[list[dict[str, Any]], Path], case: str, words: str
) -> None:
    for res in results[0]:
        said = res["refusals"][case]
        assert said.startswith("UsageError") and words in said, said
        assert "save or copy model.module" in said, said
