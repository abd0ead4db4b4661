"""A lost rank does not end the job: the survivors redo the step, and the end equals one process.

Five ranks train a float64 model with AdamW and a decaying learning rate over the global batches
of a ``GlobalBatchSampler``, inside ``gradsync.recovery.Recovery``. Three of them die by SIGKILL,
one after another, each at another point of a step: before a forward (or, in the deterministic
test, after backward, before the loop's own ``step.all_reduce`` of its loss: survivors that do
not exchange data with the dead rank must not wait there for torch's timeout), inside backward
once the first buckets' all-reduces are under way, and inside ``optimizer.step()`` (when the
survivors have all they need to finish that step). The two left must end with the parameters
of one process trained on the same global batches (1e-12), having used every sample of every
step after a loss exactly once, at the new world size. No copy of the model is kept for it: a
survivor that stepped hands the step's result to one that had not. Fresh processes
(``fresh=True``): a rank that kills itself is the point.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.errors import CollectiveTimeoutError
from gradsync.recovery import NoRecoveryError, Recovery
from gradsync.testing.spawn import RankFailure, spawn

pytestmark = pytest.mark.filterwarnings("ignore:global batches of")  # item_mean: exact anyway

WORLD, STEPS, GLOBAL_BATCH, MICRO = 5, 9, 12, 2
SAMPLES = GLOBAL_BATCH * STEPS
# original rank -> (step, where it dies)
DEATHS = {4: (2, "forward"), 1: (4, "backward"), 0: (6, "optimizer")}
LOGGING_DEATHS = {**DEATHS, 4: (2, "logging")}


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)).repeat(1, 3))


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3)).double()  # fmt: skip


def _optimizer(params) -> tuple[torch.optim.Optimizer, object]:  # type: ignore[no-untyped-def]
    opt = torch.optim.AdamW(params, lr=2e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))


def _train(
    rank: int,
    world: int,
    deaths: dict,
    folder: str | None = None,
    leaves: bool = False,
    split: tuple[int, int] | None = None,
) -> dict:
    data = _data()
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, MICRO, shuffle=True, seed=5,
                                 deterministic=leaves)  # fmt: skip
    ddp = gradsync.DistributedDataParallel(
        _model(), reduction="item_mean", bucket_cap_mb=0, timeout=10.0,
        deterministic=sampler.leaves_per_step if leaves else None,
    )  # fmt: skip
    opt, sched = _optimizer(ddp.parameters())
    ckpt = None
    if folder is not None:
        ckpt = Checkpointer(folder, model=ddp, optimizer=opt, lr_scheduler=sched, keep=None)
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched, checkpointer=ckpt, window=3.0)
    death = deaths.get(rank)
    armed = [False]

    def die_if(where: str) -> None:
        if armed[0] and death[1] == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def notice_late(at: int) -> None:
        """This survivor notices the loss just before its optimizer step, as one does whose
        last all-reduce failed where another survivor's completed: the loss splits them."""
        if recovery.completed == at and not recovery.changes:
            time.sleep(1.0)  # the dying rank is gone, the other survivor has stepped
            raise CollectiveTimeoutError("the last bucket's all-reduce lost a peer here")

    first = ddp.module[0].weight  # its gradient comes last in backward
    first.register_hook(lambda g: die_if("backward") or g)
    opt.register_step_pre_hook(lambda *_: die_if("optimizer"))
    if split is not None and rank == split[0]:
        opt.register_step_pre_hook(lambda *_: notice_late(split[1]))
    write = dcp.FileSystemWriter.write_data
    dcp.FileSystemWriter.write_data = lambda *a: die_if("save") or write(*a)  # type: ignore[method-assign]
    loader = DataLoader(data)
    used: dict[int, list[tuple[int, list[int]]]] = {}
    losses: dict[int, float] = {}  # each step's loss summed over the global batch
    for step in recovery.steps(STEPS):
        with step:
            armed[0] = death is not None and step.number == death[0]
            die_if("forward")
            shares = sampler.micro_batches_of(step.index)
            batches = list(step.micro_batches(loader))
            total = torch.zeros((), dtype=torch.float64)
            for i, (x, y) in enumerate(batches):
                with ddp.no_sync() if i < len(batches) - 1 else nullcontext():
                    loss = ((ddp(x) - y) ** 2).sum()
                    ddp.count_items(len(x))
                    loss.backward()
                    total += loss.detach()
            die_if("logging")
            logged = step.all_reduce(torch.stack([total, torch.ones_like(total)]))
            assert logged[1] == recovery.membership.world_size, logged  # every member's share
            opt.step()
            sched.step()
            opt.zero_grad()
            if ckpt is not None and step.number % 2 == 1:
                ckpt.save(step.number + 1)
            used[step.number] = [(recovery.membership.rank, [i for s in shares for i in s])]
            losses[step.number] = logged[0].item()
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"params": params, "used": used, "events": recovery.events, "losses": losses,
            "world": recovery.membership.world_size}  # fmt: skip


def _reference() -> dict[str, torch.Tensor]:
    data = _data()
    model = _model()
    opt, sched = _optimizer(model.parameters())
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, num_replicas=1, rank=0, shuffle=True, seed=5)
    for step, indices in enumerate(sampler):
        if step == STEPS:
            break
        x, y = data[indices]
        (((model(x) - y) ** 2).sum() / len(x)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def _check_survivors(results: list, deaths: dict) -> list[int]:
    for rank in deaths:
        assert isinstance(results[rank], RankFailure), (rank, results[rank])
    survivors = [r for r in range(len(results)) if r not in deaths]
    reference = _reference()
    for r in survivors:
        result = results[r]
        assert not isinstance(result, RankFailure), result
        assert result["world"] == len(survivors)
        for name, p in result["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=name)
    return survivors


@pytest.mark.timeout(180)
def test_survivors_redo_the_step_and_end_equal_to_one_process() -> None:
    results = spawn(_train, WORLD, (DEATHS,), fresh=True, return_failures=True, timeout_s=150)
    survivors = _check_survivors(results, DEATHS)
    batches = list(GlobalBatchSampler(_data(), GLOBAL_BATCH, num_replicas=1, rank=0, seed=5))
    for r in survivors:
        assert [e["world_size"] for e in results[r]["events"]] == [4, 3, 2]
    # A loss inside the optimizer step costs no step: the survivors had every gradient.
    redone = [e["step"] for e in results[survivors[0]]["events"]]
    assert redone == [DEATHS[4][0], DEATHS[1][0], DEATHS[0][0] + 1], redone
    # From the last loss on, every step's global batch is used once, split over the two left.
    for step in range(redone[-1], STEPS):
        got = sorted(i for r in survivors for _, idx in results[r]["used"][step] for i in idx)
        assert got == sorted(batches[step]), step


@pytest.mark.timeout(240)
def test_in_the_deterministic_mode_the_survivors_end_with_the_bits_of_one_process() -> None:
    # 6 leaves per step over 5 ranks, then 4, 3 and 2: the same bits as 1 rank throughout.
    results = spawn(_train, WORLD, (LOGGING_DEATHS, None, True), fresh=True,
                    return_failures=True, timeout_s=150)  # fmt: skip
    survivors = _check_survivors(results, LOGGING_DEATHS)
    alone = spawn(_train, 1, ({}, None, True), timeout_s=150)[0]
    for r in survivors:
        assert [e["world_size"] for e in results[r]["events"]] == [4, 3, 2]
        for name, p in results[r]["params"].items():
            assert torch.equal(p, alone["params"][name]), (r, name)
        # the loop's own all_reduce: the global batch's loss, on every member, every step
        assert results[r]["losses"] == pytest.approx(alone["losses"], rel=1e-12, abs=0)


@pytest.mark.timeout(180)
def test_a_rank_lost_during_a_save_after_the_optimizer_step_replays_the_step(tmp_path) -> None:
    """Every survivor had stepped its optimizer when the save lost a rank: the step is replayed
    on 2 ranks without its optimizer step (the learning rate steps once), with its save."""
    deaths = {1: (3, "save")}
    args = (deaths, str(tmp_path))
    results = spawn(_train, 3, args, fresh=True, return_failures=True, timeout_s=150)
    survivors = _check_survivors(results, deaths)
    assert [e["step"] for e in results[survivors[0]]["events"]] == [3]
    assert [p.name for p in sorted(tmp_path.glob("step_*"))] == [
        f"step_{s:08d}" for s in range(2, STEPS + 1, 2)
    ]
    assert not list(tmp_path.glob(".step_*.partial"))


@pytest.mark.timeout(180)
def test_a_loss_that_splits_the_survivors_hands_the_steps_result_to_those_that_had_not_stepped():
    """Rank 2 dies once its step 3's all-reduce is complete; rank 0 steps and goes on to step 4,
    rank 1 notices before stepping. Rank 0 holds step 3's result: rank 1 takes it, and step 3 is
    replayed without its optimizer step (the schedule steps once), on 2 ranks, exactly."""
    deaths = {2: (3, "optimizer")}
    results = spawn(_train, 3, (deaths, None, False, (1, 3)), fresh=True,
                    return_failures=True, timeout_s=150)  # fmt: skip
    survivors = _check_survivors(results, deaths)
    for r in survivors:
        [event] = results[r]["events"]
        assert event["step"] == 3 and event["world_size"] == 2, event
        assert event["phases"] == ["backward", "forward"], event  # neither had stepped in 4


def _stuck(rank: int, world: int) -> str:
    """Rank 2 stops itself (SIGSTOP) at step 2: alive, silent. The others must take the restart
    path, all of them, saying why; then they end the stopped process."""
    data = _data()
    # A stopped rank keeps its connections open: the others notice it at the deadline.
    ddp = gradsync.DistributedDataParallel(_model(), reduction="item_mean", timeout=3.0)
    opt, sched = _optimizer(ddp.parameters())
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, shuffle=True, seed=5)
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched, window=1.0)
    loader = DataLoader(data)
    try:
        for step in recovery.steps(STEPS):
            with step:
                if rank == 2 and step.number == 2:
                    recovery.store.set("test/stopped", str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGSTOP)
                for x, y in step.micro_batches(loader):
                    loss = ((ddp(x) - y) ** 2).sum()
                    ddp.count_items(len(x))
                    loss.backward()
                opt.step()
                opt.zero_grad()
    except NoRecoveryError as exc:
        # Ended by whichever survivor gets here first: for the other, the process may be gone,
        # and so may the store with rank 0's process.
        with contextlib.suppress(ProcessLookupError, dist.DistError):
            os.kill(int(recovery.store.get("test/stopped")), signal.SIGKILL)
        return str(exc)
    return "trained on"


@pytest.mark.timeout(120)
def test_a_rank_stopped_rather_than_dead_sends_every_survivor_to_the_restart_path() -> None:
    results = spawn(_stuck, 3, fresh=True, return_failures=True, timeout_s=90)
    assert isinstance(results[2], RankFailure)
    for rank in (0, 1):
        assert "rank(s) [2] of generation 0 are alive but did not answer" in results[rank], results
