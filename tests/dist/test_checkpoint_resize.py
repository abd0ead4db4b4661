"""A checkpoint saved by 3 ranks continues on 2 and on 4 ([Note: resuming at another world
size]).

Each step's global batch (6 samples) is split over the ranks, and ``reduction="item_mean"``
makes the step's gradient the mean over the 6 whatever the split. Job 1 (3 ranks) trains 2
steps, saves with the ``Checkpointer``, and trains 2 more: the uninterrupted run. Job 2
(2 ranks, then 4) starts from other weights, loads the checkpoint and trains the same 2 steps: its
parameters must equal the uninterrupted run's to float64 reordering noise, with a plain AdamW
(and an LR schedule) and with ``shard_optimizer`` (whose slices DCP cuts anew); a bf16
model's ``MasterWeights`` (fp32 masters, AdamW's moments) arrive bit for bit.
What cannot move is refused on every rank before anything is loaded: PowerSGD's per-rank state,
and a sampler whose position is per rank.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.checkpoint import Checkpointer
from gradsync.comm import PowerSGD
from gradsync.data import DistributedSampler, GlobalBatchSampler
from gradsync.optim import MasterWeights
from gradsync.testing.spawn import spawn

GLOBAL, SAVED_AT, STEPS = 6, 2, 4
TOL = 1e-12  # float64; the sums over ranks differ in order between 3 and 2 ranks


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1)).double()


def _my_part(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL, 4, generator=g, dtype=torch.float64)
    y = torch.randn(GLOBAL, 1, generator=g, dtype=torch.float64)
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    return x[lo:hi], y[lo:hi]


def _objects(seed: int, sharded: bool, **options: Any) -> tuple[Any, Any, Any]:
    ddp = gradsync.DistributedDataParallel(_model(seed), reduction="item_mean", **options)
    if sharded:
        opt = ddp.shard_optimizer(torch.optim.AdamW, lr=0.05)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return ddp, opt, schedule


def _train(ddp: Any, opt: Any, schedule: Any, steps: range) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        x, y = _my_part(step, rank, world)
        loss = (ddp(x) - y).pow(2).sum()
        ddp.count_items(len(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()


def _params(ddp: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ddp.state_dict().items()}


def _sampler() -> GlobalBatchSampler:
    return GlobalBatchSampler(range(10 * GLOBAL), GLOBAL, 1, seed=3)


def _save_at_3(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for sharded in (False, True):
        ddp, opt, schedule = _objects(0, sharded)
        sampler = _sampler()
        ckpt = Checkpointer(f"{root}/sharded{sharded}", model=ddp, optimizer=opt,
                            lr_scheduler=schedule, sampler=sampler, timeout=60)  # fmt: skip
        _train(ddp, opt, schedule, range(SAVED_AT))
        sampler.set_epoch(1)
        sampler.step = SAVED_AT  # the loop's position (this test feeds its own batches)
        ckpt.save(SAVED_AT)
        _train(ddp, opt, schedule, range(SAVED_AT, STEPS))
        out[sharded] = _params(ddp)
    out["master"] = _master_weights(root, save=True)
    ddp = gradsync.DistributedDataParallel(
        _model(0), compression=PowerSGD(rank=1), reduction="item_mean"
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    _train(ddp, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), range(1))
    Checkpointer(f"{root}/powersgd", model=ddp, optimizer=opt, timeout=60).save(1)
    return out


def _master_weights(root: str, save: bool) -> dict[str, torch.Tensor]:
    """A bf16 model with fp32 main gradients and MasterWeights: saved after 2 steps, or loaded
    into other weights; returns the fp32 masters and AdamW's moments right after."""
    model = _model(0 if save else 1).bfloat16()
    ddp = gradsync.DistributedDataParallel(
        model, reduction="item_mean", main_grad_dtype=torch.float32
    )
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, lr=0.05)
    ckpt = Checkpointer(f"{root}/master", model=ddp, optimizer=opt, timeout=60)
    if save:
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(SAVED_AT):
            x, y = _my_part(step, rank, world)
            loss = (ddp(x.bfloat16()) - y.bfloat16()).float().pow(2).sum()
            ddp.count_items(len(x))
            loss.backward()
            opt.step()
            opt.zero_grad()
        ckpt.save(SAVED_AT)
    else:
        assert ckpt.load() == SAVED_AT
    state = opt.optimizer.state
    moments = {f"exp_avg{i}": state[m]["exp_avg"].clone() for i, m in enumerate(opt.master)}
    return {**{f"master{i}": m.detach().clone() for i, m in enumerate(opt.master)}, **moments}


def _continue(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {"master": _master_weights(root, save=False)}
    for sharded in (False, True):
        ddp, opt, schedule = _objects(1, sharded)  # other weights: the load must replace them
        sampler = _sampler()
        ckpt = Checkpointer(f"{root}/sharded{sharded}", model=ddp, optimizer=opt,
                            lr_scheduler=schedule, sampler=sampler, timeout=60)  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out[f"step{sharded}"] = ckpt.load()
        out[f"position{sharded}"] = (sampler.epoch, sampler.step)  # the global data position
        out[f"said{sharded}"] = [str(w.message) for w in caught if "world size" in str(w.message)]
        _train(ddp, opt, schedule, range(SAVED_AT, STEPS))
        out[sharded] = _params(ddp)
    ddp = gradsync.DistributedDataParallel(
        _model(0), compression=PowerSGD(rank=1), reduction="item_mean"
    )
    refusals = {}
    try:
        Checkpointer(f"{root}/powersgd", model=ddp, timeout=60).load()
    except gradsync.CheckpointError as exc:
        refusals["powersgd"] = str(exc)
    ddp = gradsync.DistributedDataParallel(_model(0))
    sampler = DistributedSampler(range(12))
    try:
        Checkpointer(f"{root}/shardedFalse", model=ddp, sampler=sampler, timeout=60).load()
    except gradsync.CheckpointError as exc:
        refusals["sampler"] = str(exc)
    out["refusals"] = refusals
    return out


@pytest.mark.timeout(300)
def test_a_checkpoint_of_3_ranks_continues_exactly_on_2_and_on_4(tmp_path: Path) -> None:
    root = str(tmp_path)
    uninterrupted = spawn(_save_at_3, 3, (root,))[0]
    for world in (2, 4):  # a node lost, a node added: the same checkpoint
        for rank, out in enumerate(spawn(_continue, world, (root,))):
            _check(uninterrupted, out, rank, world)


def _check(uninterrupted: dict[str, Any], out: dict[str, Any], rank: int, world: int) -> None:
    where = f"rank {rank} of {world}"
    for sharded in (False, True):
        assert out[f"step{sharded}"] == SAVED_AT
        assert out[f"position{sharded}"] == (1, SAVED_AT)
        want, got = uninterrupted[sharded], out[sharded]
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        assert diff < TOL, (sharded, where, diff)
        said = out[f"said{sharded}"]
        assert bool(said) == (rank == 0), said  # rank 0 says it, once
        assert all(f"from 3 to {world} at step 2" in s for s in said), said
    # MasterWeights' fp32 masters and AdamW's moments arrive as saved, bit for bit.
    saved = uninterrupted["master"]
    assert saved.keys() == out["master"].keys() and len(saved) > 4
    assert all(torch.equal(out["master"][k], v) for k, v in saved.items()), where
    refusals = out["refusals"]
    assert f"saved by 3 ranks and cannot continue on {world}" in refusals["powersgd"]
    assert "compression state" in refusals["powersgd"]
    assert "keeps a position per rank" in refusals["sampler"], refusals
