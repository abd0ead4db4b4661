"""ZeRO-1 (``model.shard_optimizer``) under ``Recovery``: no slice of the optimizer state is lost
with a rank, and the survivors end equal to one process.

Each rank mirrors the next rank's slices by stepping a second inner optimizer from the same
reduced gradient: the mirror must be the owner's state, bit for bit, at 2/N of the state per
rank, stepped once every gather of the step has started (off the gathers' path). Four ranks
train the float64 model of ``test_recovery.py`` with AdamW and a decaying learning rate; ranks
die by SIGKILL inside backward (the all-reduce), inside the sharded step (after the agreement,
before their slices step) and inside the parameters' all-gather, and the last survivor must
hold one process's parameters (1e-12) with every sample used once. A loss that splits the
survivors (one stepped its slices, its buddy had not) hands the step's gradient on. Losing an
owner and its buddy together takes the restart path, saying so on every survivor. The
survivors' checkpoints resume a new job at another world size, equal to one process. Fresh
processes where ranks kill themselves.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from test_recovery import GLOBAL_BATCH, MICRO, STEPS, _data, _model, _reference
from torch.utils.data import DataLoader

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.ddp import sharding
from gradsync.errors import CollectiveTimeoutError, GradsyncError
from gradsync.recovery import NoRecoveryError, Recovery
from gradsync.testing.spawn import RankFailure, spawn

pytestmark = pytest.mark.filterwarnings("ignore:global batches of")  # item_mean: exact anyway

WORLD = 4
# original rank -> (step, where it dies): the ranks left are 3, then 2, then 1
DEATHS = {3: (2, "backward"), 1: (4, "sharded step"), 0: (6, "all-gather")}


def _setup(steps_with_recovery: bool = True):  # type: ignore[no-untyped-def]
    data = _data()
    sampler = GlobalBatchSampler(data, GLOBAL_BATCH, MICRO, shuffle=True, seed=5)
    ddp = gradsync.DistributedDataParallel(
        _model(), reduction="item_mean", bucket_cap_mb=0, timeout=10.0
    )
    opt = ddp.shard_optimizer(torch.optim.AdamW, lr=2e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.3 * s))
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched, window=3.0)
    return data, sampler, ddp, opt, sched, recovery


def _run_step(step, ddp, opt, sched, loader, die_if) -> None:  # type: ignore[no-untyped-def]
    batches = list(step.micro_batches(loader))
    for i, (x, y) in enumerate(batches):
        with ddp.no_sync() if i < len(batches) - 1 else nullcontext():
            loss = ((ddp(x) - y) ** 2).sum()
            ddp.count_items(len(x))
            loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _train(rank: int, world: int, deaths: dict, late: tuple[int, int] | None = None) -> dict:
    data, sampler, ddp, opt, sched, recovery = _setup()
    death = deaths.get(rank)
    armed, noticed = [False], []

    def die_if(where: str) -> None:
        if armed[0] and death[1] == where:
            os.kill(os.getpid(), signal.SIGKILL)

    def notice_late(*_: object) -> None:
        """This survivor notices the loss after the agreement, before its slices step, as one
        would whose agreement failed where the others' completed: the loss splits them."""
        if recovery.completed == late[1] and not noticed:
            noticed.append(True)
            time.sleep(1.0)  # the dying rank is gone, the others have stepped their slices
            raise CollectiveTimeoutError("the sharded step's agreement lost a peer here")

    ddp.module[0].weight.register_hook(lambda g: die_if("backward") or g)  # last in backward
    opt.optim.register_step_pre_hook(lambda *_: die_if("sharded step"))
    if late is not None and rank == late[0]:
        opt.optim.register_step_pre_hook(notice_late)
    start = sharding._Gather.start
    sharding._Gather.start = lambda self, b: (
        (b.index == 2 and die_if("all-gather")) or start(self, b)
    )  # type: ignore[method-assign]
    loader = DataLoader(data)
    used: dict[int, list[int]] = {}
    for step in recovery.steps(STEPS):
        with step:
            armed[0] = death is not None and step.number == death[0]
            shares = sampler.micro_batches_of(step.index)
            _run_step(step, ddp, opt, sched, loader, die_if)
            used[step.number] = [i for s in shares for i in s]
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"params": params, "used": used, "events": recovery.events,
            "world": recovery.membership.world_size, "rank": recovery.membership.rank}  # fmt: skip


def _check(results: list, deaths: dict) -> list[int]:
    for rank in deaths:
        assert isinstance(results[rank], RankFailure), (rank, results[rank])
    survivors = [r for r in range(len(results)) if r not in deaths]
    reference = _reference()
    for r in survivors:
        assert not isinstance(results[r], RankFailure), results[r]
        assert results[r]["world"] == len(survivors)
        for name, p in results[r]["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=name)
    return survivors


def _used_once(results: list, survivors: list[int], since: int) -> None:
    batches = list(GlobalBatchSampler(_data(), GLOBAL_BATCH, num_replicas=1, rank=0, seed=5))
    for step in range(since, STEPS):
        got = sorted(i for r in survivors for i in results[r]["used"][step])
        assert got == sorted(batches[step]), step


@pytest.mark.timeout(120)
def test_killed_in_backward_the_sharded_step_and_the_all_gather_the_last_equals_one_process():
    results = spawn(_train, WORLD, (DEATHS,), fresh=True, return_failures=True, timeout_s=100)
    [last] = _check(results, DEATHS)
    events = results[last]["events"]
    assert [e["world_size"] for e in events] == [3, 2, 1]
    # A loss in backward redoes the step; one after the slices stepped costs no step.
    assert [e["step"] for e in events] == [2, 4, 6], events
    _used_once(results, [last], 6)


@pytest.mark.timeout(90)
def test_a_loss_that_splits_the_survivors_hands_the_steps_gradient_to_the_buddy():
    """Rank 2 dies after the agreement of step 3; its buddy, rank 1, notices before stepping
    its slices while ranks 0 and 3 step theirs: rank 1 takes the step's gradient from rank 0
    and steps its own slice and its mirror of rank 2's, and step 3 is replayed on 3 ranks."""
    deaths = {2: (3, "sharded step")}
    results = spawn(_train, WORLD, (deaths, (1, 3)), fresh=True, return_failures=True,
                    timeout_s=80)  # fmt: skip
    survivors = _check(results, deaths)
    for r in survivors:
        [event] = results[r]["events"]
        assert event["step"] == 3 and event["world_size"] == 3, event
        # rank 1 had not begun to step: the record has no phase of its own for that
        assert event["phases"] == ["forward", "optimizer step"], event
    _used_once(results, survivors, 3)


def _pair(rank: int, world: int) -> str:
    """Ranks 1 and 2 (2's buddy) die together before step 2's backward."""
    data, sampler, ddp, opt, sched, recovery = _setup()
    loader = DataLoader(data)
    try:
        for step in recovery.steps(STEPS):
            with step:
                if rank in (1, 2) and step.number == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                _run_step(step, ddp, opt, sched, loader, lambda where: None)
    except NoRecoveryError as exc:
        return str(exc)
    return "trained on"


@pytest.mark.timeout(90)
def test_losing_an_owner_and_its_buddy_together_takes_the_restart_path_naming_both():
    results = spawn(_pair, WORLD, fresh=True, return_failures=True, timeout_s=80)
    for r in (0, 3):
        assert "lost ranks [1, 2] together" in results[r], results[r]
        assert "rank 2's slices lived on rank 2 and, mirrored, on its buddy rank 1" in results[r]


def _mirrors(rank: int, world: int, tamper: bool) -> dict:
    data, sampler, ddp, opt, sched, recovery = _setup()
    loader = DataLoader(data)
    error = None
    order: list[str] = []  # when the gathers start and the mirror steps
    gather = ddp.sharded_steps.gather
    start = gather.start
    gather.start = lambda b: order.append(f"gather {b.index}") or start(b)
    opt.mirror.optim.register_step_pre_hook(lambda *_: order.append("mirror"))
    try:
        for step in recovery.steps(4):
            with step:
                if tamper and rank == 1 and step.number == 2:
                    some = next(iter(opt.mirror.optim.state.values()))
                    some["exp_avg"] += 1e-12  # one element of rank 2's mirrored moments
                _run_step(step, ddp, opt, sched, loader, lambda where: None)
    except GradsyncError as exc:
        error = str(exc)
    mine = {"own": opt.optim.state_dict(), "mirror": opt.mirror.optim.state_dict(),
            "mirror_params": [mb.shard.clone() for mb in opt.mirror.buckets],
            "own_params": [b.shard.clone() for b in opt.buckets]}  # fmt: skip
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    full = sum(p.numel() * 8 * 2 for p in ddp.module.parameters())  # AdamW's moments
    held = _moment_bytes(opt.optim) + _moment_bytes(opt.mirror.optim)
    return {"everyone": everyone, "error": error, "held": held, "full": full,
            "buckets": len(opt.buckets), "order": order}  # fmt: skip


def _moment_bytes(optim: torch.optim.Optimizer) -> int:
    moments = [v for s in optim.state.values() for k, v in s.items() if k != "step"]
    return sum(v.numel() * v.element_size() for v in moments)


def test_each_mirror_holds_its_neighbours_state_bit_for_bit_at_two_nths_of_the_state():
    results = spawn(_mirrors, WORLD, (False,), timeout_s=60)
    everyone = results[0]["everyone"]
    for r in range(WORLD):
        assert results[r]["error"] is None
        n = (r + 1) % WORLD
        mirror, own = everyone[r]["mirror"], everyone[n]["own"]
        assert mirror["state"].keys() == own["state"].keys() and own["state"], r
        for i, entry in own["state"].items():
            for key, value in entry.items():
                assert torch.equal(mirror["state"][i][key], value), (r, i, key)
        for got, want in zip(everyone[r]["mirror_params"], everyone[n]["own_params"], strict=True):
            assert torch.equal(got, want), r
        # own + mirror: 2/N of AdamW's moments, give or take a slice's alignment (16 elements)
        slack = 2 * 16 * 8 * 2 * results[r]["buckets"]
        assert results[r]["held"] <= results[r]["full"] * 2 / WORLD + slack, results[r]
    # every element's moments are held twice over the ranks: once by the owner, once mirrored
    assert sum(results[r]["held"] for r in range(WORLD)) == 2 * results[0]["full"]
    # the mirror steps once a step, in one call, while every bucket's gather is under way
    step = [f"gather {i}" for i in range(results[0]["buckets"])] + ["mirror"]
    orders = [r["order"] for r in results]
    assert results[0]["buckets"] > 1 and orders == [step * 4] * WORLD, orders


def test_a_mirror_that_stepped_other_bits_refuses_the_next_step_on_every_rank():
    results = spawn(_mirrors, WORLD, (True,), timeout_s=60)
    for r in range(WORLD):
        assert "rank 1's mirror of rank 2's slice of bucket" in results[r]["error"], results[r]


def _saving(rank: int, world: int, folder: str, phase: str) -> dict:
    """ZeRO-1 under ``Recovery`` with a ``Checkpointer`` saving after every odd step. "lose":
    4 ranks, the last killed inside backward of step 2, the 3 survivors saving on; "resume": a
    new job loads the newest save and trains to the end."""
    data, sampler, ddp, opt, sched, _ = _setup()
    ckpt = Checkpointer(folder, model=ddp, optimizer=opt, lr_scheduler=sched, sampler=sampler)
    loaded = ckpt.load() if phase == "resume" else None
    recovery = Recovery(ddp, opt, sampler, lr_scheduler=sched, checkpointer=ckpt, window=3.0)
    dies = phase == "lose" and rank == world - 1
    armed = [False]
    ddp.module[0].weight.register_hook(lambda g: os.kill(os.getpid(), 9) if armed[0] else g)
    loader = DataLoader(data)
    for step in recovery.steps(STEPS if phase == "resume" else 7):
        with step:
            armed[0] = dies and step.number == 2
            _run_step(step, ddp, opt, sched, loader, None)
            if step.number % 2 == 1:
                ckpt.save(step.number + 1)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"params": params, "loaded": loaded, "events": recovery.events}


@pytest.mark.timeout(120)
def test_checkpoints_saved_by_the_survivors_resume_a_new_job_equal_to_one_process(
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    """The saves after the loss hold the survivors' slices (and refill the mirrors when
    loaded): a new job of 2 ranks resumes from the 3 survivors' last save, at step 6, and ends
    equal to one process."""
    folder = str(tmp_path)
    lost = spawn(_saving, WORLD, (folder, "lose"), fresh=True, return_failures=True, timeout_s=90)
    assert isinstance(lost[-1], RankFailure)
    assert [e["world_size"] for e in lost[0]["events"]] == [3], lost[0]["events"]
    resumed = spawn(_saving, 2, (folder, "resume"), timeout_s=90)
    reference = _reference()
    for result in resumed:
        assert result["loaded"] == 6
        for name, p in result["params"].items():
            torch.testing.assert_close(p, reference[name], rtol=0, atol=1e-12, msg=name)
