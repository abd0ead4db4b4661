"""GlobalBatchSampler on real gloo ranks: the accumulation loop of docs/global-batches.md at 2 and
3 ranks, and across a change from 3 to 2 ranks in the middle of an epoch, ends with the
parameters of one process trained on the same global batches (float64, to 1e-12).

Two spawns: 3 ranks train without stopping, saving the state after ``RESUME_AT`` steps of the
first epoch, and train a short epoch whose last step leaves one rank without a sample (which
``mark_step_ends`` hands a micro-batch of none); then 2 ranks train without stopping, and again
from that saved state.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.data import GlobalBatchSampler
from gradsync.testing.spawn import spawn

N_SAMPLES, GLOBAL, MICRO, EPOCHS, SEED = 26, 7, 2, 2, 3  # global batches of 7, 7, 7 and 5
RESUME_AT = 2  # global steps of epoch 0 trained at 3 ranks before the change to 2
JOIN_SAMPLES = 23  # global batches of 7, 7, 7 and 2: at 3 ranks the last rank has no share
TOL = 1e-12

Used = list[tuple[int, int, list[int]]]  # (epoch, step, dataset indices) of each micro-batch


def make_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    return TensorDataset(torch.arange(n), x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def loss_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).squeeze(1) - y) ** 2).sum()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(n: int, epochs: int) -> dict[str, torch.Tensor]:
    """One process, each global batch whole (drawn here as torch's sampler draws its order):
    the mean squared error over the global batch."""
    data, model = make_data(n), make_model()
    opt = make_optimizer(model)
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(SEED + epoch)
        for batch in torch.randperm(n, generator=g).split(GLOBAL):
            _, x, y = data[batch]
            opt.zero_grad()
            (loss_sum(model, x, y) / len(batch)).backward()
            opt.step()
    return params(model)


def train(
    ddp: gradsync.DistributedDataParallel,
    opt: torch.optim.Optimizer,
    sampler: GlobalBatchSampler,
    epochs: int,
    after_step: Callable[[int, int], None] = lambda epoch, step: None,
) -> Used:
    """From the sampler's position to the end of ``epochs``; ``no_sync()`` on all but the last
    micro-batch of a step, ``count_items`` for each."""
    loader = DataLoader(make_data(sampler.dataset_length), batch_sampler=sampler)
    used: Used = []
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        step = sampler.step  # 0, or the step a loaded state resumes at
        for (index, x, y), last in sampler.mark_step_ends(loader):
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_sum(ddp, x, y)
                ddp.count_items(len(y))
                loss.backward()
            used.append((epoch, step, index.tolist()))
            if last:
                opt.step()
                opt.zero_grad()
                step += 1
                assert sampler.step == step, (sampler.step, step)
                after_step(epoch, step)
    return used


def make_sampler(world: int, rank: int, n: int = N_SAMPLES) -> GlobalBatchSampler:
    with warnings.catch_warnings():  # uneven shares warn for reduction="mean"; this is item_mean
        warnings.simplefilter("ignore")
        return GlobalBatchSampler(range(n), GLOBAL, MICRO, num_replicas=world, rank=rank, seed=SEED)


def fresh(world: int, rank: int, n: int = N_SAMPLES) -> tuple[Any, Any, GlobalBatchSampler]:
    ddp = gradsync.DistributedDataParallel(make_model(), reduction="item_mean")
    return ddp, make_optimizer(ddp), make_sampler(world, rank, n)


def _three_ranks(rank: int, world: int, folder: str) -> dict:
    ddp, opt, sampler = fresh(world, rank)
    states: list[dict[str, int]] = []

    def save(epoch: int, step: int) -> None:
        if (epoch, step) != (0, RESUME_AT):
            return
        states.append(sampler.state_dict())
        if rank == 0:
            model, sampler_state = ddp.module.state_dict(), states[0]
            state = {"model": model, "opt": opt.state_dict(), "sampler": sampler_state}
            torch.save(state, Path(folder) / "state.pt")

    out = {"used": train(ddp, opt, sampler, EPOCHS, save), "params": params(ddp.module)}
    out["saved_sampler"] = states[0]
    ddp, opt, sampler = fresh(world, rank, n=JOIN_SAMPLES)
    out["empty_share"] = sampler.micro_batches_in_step(sampler.steps_per_epoch - 1) == 0
    out["short_used"] = train(ddp, opt, sampler, 1)  # no join(): every rank runs every step
    out["short_params"] = params(ddp.module)
    return out


def _two_ranks(rank: int, world: int, folder: str) -> dict:
    ddp, opt, sampler = fresh(world, rank)
    out = {"used": train(ddp, opt, sampler, EPOCHS), "params": params(ddp.module)}
    saved = torch.load(Path(folder) / "state.pt", weights_only=True)
    model = make_model()
    model.load_state_dict(saved["model"])
    ddp = gradsync.DistributedDataParallel(model, reduction="item_mean")
    opt = make_optimizer(ddp)
    opt.load_state_dict(saved["opt"])
    sampler = make_sampler(world, rank)
    sampler.load_state_dict(saved["sampler"])
    out["resumed_used"] = train(ddp, opt, sampler, EPOCHS)
    out["resumed_params"] = params(ddp.module)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("global-batches")


@pytest.fixture(scope="module")
def three(folder: Path) -> list[dict]:
    return spawn(_three_ranks, 3, (str(folder),), timeout_s=100)


@pytest.fixture(scope="module")
def two(folder: Path, three: list[dict]) -> list[dict]:  # loads the state three ranks saved
    return spawn(_two_ranks, 2, (str(folder),), timeout_s=100)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def global_batches(per_rank: list[Used]) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> the step's samples, rank by rank."""
    steps: dict[tuple[int, int], list[int]] = {}
    for used in per_rank:
        for epoch, step, index in used:
            steps.setdefault((epoch, step), []).extend(index)
    return steps


def reference_batches(n: int, epochs: int) -> dict[tuple[int, int], list[int]]:
    out = {}
    for epoch in range(epochs):
        g = torch.Generator()
        g.manual_seed(SEED + epoch)
        for step, batch in enumerate(torch.randperm(n, generator=g).split(GLOBAL)):
            out[epoch, step] = batch.tolist()
    return out


@pytest.mark.timeout(120)
def test_three_ranks_train_the_one_process_model(three: list[dict]) -> None:
    assert global_batches([out["used"] for out in three]) == reference_batches(N_SAMPLES, EPOCHS)
    expected = reference(N_SAMPLES, EPOCHS)
    for rank, out in enumerate(three):
        assert max_diff(out["params"], expected) < TOL, rank


@pytest.mark.timeout(120)
def test_two_ranks_train_the_one_process_model(two: list[dict]) -> None:
    assert global_batches([out["used"] for out in two]) == reference_batches(N_SAMPLES, EPOCHS)
    expected = reference(N_SAMPLES, EPOCHS)
    for rank, out in enumerate(two):
        assert max_diff(out["params"], expected) < TOL, rank


@pytest.mark.timeout(120)
def test_a_rank_without_a_share_of_the_last_step_runs_it_on_no_sample(three: list[dict]) -> None:
    assert [out["empty_share"] for out in three] == [False, False, True]
    last = [(e, s, index) for e, s, index in three[2]["short_used"] if s == 3]
    assert last == [(0, 3, [])], last  # the last step's one micro-batch, of no sample
    used = global_batches([out["short_used"] for out in three])
    assert used == reference_batches(JOIN_SAMPLES, 1)
    expected = reference(JOIN_SAMPLES, 1)
    for rank, out in enumerate(three):
        assert max_diff(out["short_params"], expected) < TOL, rank


@pytest.mark.timeout(120)
def test_three_ranks_then_two_continue_the_epoch(three: list[dict], two: list[dict]) -> None:
    assert all(out["saved_sampler"] == three[0]["saved_sampler"] for out in three)
    saved = three[0]["saved_sampler"]
    assert (saved["epoch"], saved["step"]) == (0, RESUME_AT)
    before = [
        i for out in three for e, s, index in out["used"] if (e, s) < (0, RESUME_AT) for i in index
    ]
    after = [i for out in two for e, _, index in out["resumed_used"] if e == 0 for i in index]
    assert Counter(before + after) == Counter(range(N_SAMPLES))  # each sample once
    resumed = global_batches([out["resumed_used"] for out in two])
    expected_batches = reference_batches(N_SAMPLES, EPOCHS)
    assert min(resumed) == (0, RESUME_AT)  # the next global step, then every later one
    assert resumed == {k: v for k, v in expected_batches.items() if k >= (0, RESUME_AT)}
    expected = reference(N_SAMPLES, EPOCHS)
    for rank, out in enumerate(two):
        assert max_diff(out["resumed_params"], expected) < TOL, rank
