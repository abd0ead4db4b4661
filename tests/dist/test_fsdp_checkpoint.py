"""A ``fully_shard``-ed GPT synchronised by ``replicate_gradients``, checkpointed with gradsync's
``Checkpointer``, continues at another replicate size exactly.

Job 1 runs replicate2 x shard2 (4 ranks): it trains 2 steps of a ``GlobalBatchSampler``'s global
batches (12 samples, split over the 4 data-parallel ranks), saving after step 1 (``save``, from
the live DTensors) and step 2 (``async_save``, from a CPU copy while training goes on), and
trains 2 more: the uninterrupted run; then a save inside an accumulation window is refused,
and so are ``MasterWeights`` over DTensor parameters.
Job 2 runs replicate1 x shard2 (2 ranks), job 3 replicate3 x shard2 (6 ranks): each starts
from other weights, loads the newest checkpoint (DCP reshards the DTensor weights and AdamW's
DTensor moments onto its mesh) and trains the same 2 steps from the sampler's saved
position. Every run must equal one process trained on the 4 global batches (float64, 1e-12),
with an LR schedule. The load's warning names the world-size change on rank 0 only. The same
for the context-parallel layout: shard2 x cp2 (4 ranks) saves, shard2 alone (2 ranks) continues.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import Checkpointer
from gradsync.data import GlobalBatchSampler
from gradsync.errors import UsageError
from gradsync.optim import MasterWeights
from gradsync.testing import fsdp_run
from gradsync.testing.fsdp_run import FSDPLayout
from gradsync.testing.gpt import GPT, GPTConfig, lm_loss
from gradsync.testing.mesh_run import random_batches
from gradsync.testing.parallel import full_parameters
from gradsync.testing.spawn import spawn

CFG = GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=8)
GLOBAL, SAVED_AT, STEPS = 12, 2, 4  # 12 rows: an equal share on 2, 4 and 6 ranks
DTYPE = torch.float64
TOL = 1e-12  # the sums over ranks differ in order between layouts: float64 rounding


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    """The data set: 48 sequences (tokens, targets), 4 global batches."""
    (tokens, targets), = random_batches(CFG, 4 * GLOBAL, 1, seed=31)  # fmt: skip
    return tokens, targets


def _optimizer(params: Any) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _sampler(replicas: int, rank: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(range(4 * GLOBAL), GLOBAL, num_replicas=replicas, rank=rank, seed=5)


def _job(layout: FSDPLayout, seed: int, root: str) -> tuple[Any, ...]:
    """The model sharded over ``shard``, synchronised over ``replicate`` and ``cp``, its
    optimizer, schedule, sampler (one share per row of the batch: replicate x shard ranks; the
    cp ranks of a row share it) and checkpointer."""
    mesh = layout.build_mesh()
    model = fsdp_run.make_model(CFG, mesh, DTYPE, seed=seed)
    fsdp_run.parallelize(model, mesh, "mean")  # FSDP2's hooks keep the synchronisation
    opt, schedule = _optimizer(model.parameters())
    dp_rank = mesh["replicate"].get_local_rank() * layout.shard + mesh["shard"].get_local_rank()
    sampler = _sampler(layout.replicate * layout.shard, dp_rank)
    ckpt = Checkpointer(root, model=model, optimizer=opt, lr_scheduler=schedule,
                        sampler=sampler, timeout=60)  # fmt: skip
    return model, (opt, schedule, mesh["cp"]), sampler, ckpt


def _my_chunks(cp: Any) -> list[torch.Tensor]:
    """The data set's tokens and targets, this rank's chunk of every sequence (by cp)."""
    return [t.chunk(cp.size(), dim=1)[cp.get_local_rank()] for t in _data()]


def _train(model: Any, objects: tuple, batches: Any, steps: int) -> None:
    """``steps`` optimizer steps on this rank's share of the next global batches (its rows,
    and its chunk of every sequence by cp position)."""
    opt, schedule, cp = objects
    tokens, targets = _my_chunks(cp)
    for _ in range(steps):
        rows = next(batches)
        opt.zero_grad()
        lm_loss(model(tokens[rows]), targets[rows], "mean").backward()
        opt.step()
        schedule.step()


def _save_and_go_on(rank: int, world: int, root: str, layout: FSDPLayout) -> dict[str, Any]:
    model, objects, sampler, ckpt = _job(layout, 0, root)
    batches = iter(sampler)
    _train(model, objects, batches, SAVED_AT - 1)
    ckpt.save(SAVED_AT - 1)  # written from the live DTensors
    _train(model, objects, batches, 1)
    ckpt.async_save(SAVED_AT)  # from a CPU copy, while training goes on: the newest
    _train(model, objects, batches, STEPS - SAVED_AT)
    ckpt.wait()
    params = full_parameters(model)
    # An accumulation window open: FSDP2 holds gradients no checkpoint saves.
    model.set_requires_gradient_sync(False)
    tokens, targets = _my_chunks(objects[2])
    lm_loss(model(tokens[:2]), targets[:2], "mean").backward()
    refused = error_text(lambda: ckpt.save(STEPS))
    # fp32 masters of DTensor parameters: refused by name (FSDP2 has its own mixed precision).
    masters = error_text(lambda: MasterWeights(model.parameters(), torch.optim.AdamW))
    return {"params": params, "refused": refused, "masters": masters}


def error_text(fn: Callable[[], object]) -> str:
    """What ``fn`` raised (a ``UsageError``), or ``""``."""
    try:
        fn()
    except UsageError as exc:
        return str(exc)
    return ""


def _resume(rank: int, world: int, root: str, layout: FSDPLayout) -> dict[str, Any]:
    model, objects, sampler, ckpt = _job(layout, 1, root)  # other weights
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ckpt.load()
    position = (sampler.epoch, sampler.step)
    _train(model, objects, iter(sampler), STEPS - SAVED_AT)
    said = [str(w.message) for w in caught if "world size" in str(w.message)]
    return {"step": step, "position": position, "said": said, "params": full_parameters(model)}


def _reference() -> dict[str, torch.Tensor]:
    """One process, each step the whole global batch, in the sampler's order."""
    torch.manual_seed(0)
    model = GPT(CFG).to(DTYPE)
    opt, schedule = _optimizer(model.parameters())
    tokens, targets = _data()
    order = _sampler(1, 0).global_order()
    for step in range(STEPS):
        rows = order[step * GLOBAL : (step + 1) * GLOBAL]
        opt.zero_grad()
        lm_loss(model(tokens[rows]), targets[rows], "mean").backward()
        opt.step()
        schedule.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max((got[n] - want[n]).abs().max().item() for n in want)


def _save_then_resume(root: str, saved: FSDPLayout, resumed: list[FSDPLayout]) -> None:
    want = _reference()
    job = spawn(_save_and_go_on, saved.world_size, (root, saved), timeout_s=240)
    for rank, out in enumerate(job):
        assert _max_diff(out["params"], want) < TOL, ("uninterrupted", rank)
        assert "inside an accumulation window" in out["refused"], (rank, out["refused"])
        assert "MixedPrecisionPolicy" in out["masters"], (rank, out["masters"])
    for layout in resumed:  # the same checkpoint, each on another mesh
        world = layout.world_size
        for rank, out in enumerate(spawn(_resume, world, (root, layout), timeout_s=240)):
            where = f"rank {rank} of {layout}"
            assert out["step"] == SAVED_AT, where
            assert out["position"] == (0, SAVED_AT), where
            diff = _max_diff(out["params"], want)
            assert diff < TOL, (where, diff)
            assert bool(out["said"]) == (rank == 0), (where, out["said"])
            said = f"from {saved.world_size} to {world} at step 2"
            assert all(said in s for s in out["said"]), out["said"]


@pytest.mark.timeout(300)
def test_replicate2_checkpoint_continues_exactly_on_replicate1_and_replicate3(
    tmp_path: Path,
) -> None:
    resumed = [FSDPLayout(replicate=1, shard=2), FSDPLayout(replicate=3, shard=2)]
    _save_then_resume(str(tmp_path), FSDPLayout(replicate=2, shard=2), resumed)


@pytest.mark.timeout(300)
def test_a_context_parallel_checkpoint_continues_exactly_without_it(tmp_path: Path) -> None:
    _save_then_resume(str(tmp_path), FSDPLayout(shard=2, cp=2), [FSDPLayout(shard=2, cp=1)])
